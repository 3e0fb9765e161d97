"""Checks of every argument the queue journals, before anything durable happens (pure).

A value that reaches the journal is replayed on every recovery and copied into
every snapshot: one that cannot be encoded, or that decodes to something else,
breaks the queue long after the call that let it in returned. So each journaled
argument is checked here, at the coordinator's boundary, with an error naming
the argument; a failing check changes nothing. docs/QUEUE.md lists the rules.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ..errors import ResourceLimitExceeded
from ..limits import (
    COMPLETIONS_PER_CALL_MAX,
    FAILURE_BYTES_MAX,
    NESTING_DEPTH_MAX,
    PRODUCER_STATE_BYTES_MAX,
    QUEUE_ID_BYTES_MAX,
)
from ..protocol import Lease, RecordSetRef, check_text, encode

#: Keys an update of ``yield_tasks`` may carry (API.md section 7).
YIELD_KEYS = frozenset({"lease", "input_ref", "priority", "scheduling_key", "metadata"})
#: Keys an update of ``save_task_progress_many`` carries.
PROGRESS_KEYS = frozenset({"lease", "input_ref"})
#: Keys every entry of ``complete_tasks`` carries (the keyword arguments of ``complete_task``).
COMPLETION_KEYS = ("lease", "submission_id", "result_ref", "result_digest")


def text(value: object, what: str, limit: int = QUEUE_ID_BYTES_MAX) -> str:
    """An id argument of the queue (at most QUEUE_ID_BYTES_MAX bytes unless told)."""
    return check_text(value, what, limit)


def optional_text(value: object, what: str) -> str | None:
    return None if value is None else text(value, what)


def flag(value: object, what: str) -> bool:
    """A real bool: ``"no"`` or ``0`` are not silently truthy or falsy."""
    if not isinstance(value, bool):
        raise TypeError(f"{what} must be True or False, got {value!r}"[:300])
    return value


def json_value(value: Any, what: str, limit: int) -> int:
    """Check that ``value`` survives the journal unchanged; returns its encoded size.

    Canonical JSON turns non-string keys into strings and cannot encode NaN, cycles or
    very deep nesting; a value that would come back different after a replay, or not at
    all, is refused here. The walk is iterative, bounded by ``NESTING_DEPTH_MAX`` levels
    (a circular value is caught there too) and by ``limit`` items (each encodes to at
    least one byte, so more items than that cannot fit the limit anyway).
    """
    todo: list[tuple[Any, int]] = [(value, 0)]
    visited = 0
    while todo:
        item, depth = todo.pop()
        visited += 1
        if visited > limit:
            raise ResourceLimitExceeded(f"{what} holds more than {limit} values, the limit is {limit} bytes")
        if isinstance(item, (dict, list, tuple)):
            if depth >= NESTING_DEPTH_MAX:
                raise ResourceLimitExceeded(
                    f"{what} nests deeper than {NESTING_DEPTH_MAX} levels (or contains itself)"
                )
            if isinstance(item, dict):
                for key, child in item.items():
                    if not isinstance(key, str):
                        raise TypeError(
                            f"{what} has a key {key!r} of type {type(key).__name__}; JSON keys are "
                            "strings (it would read back as a string after recovery)"
                        )
                    _check_string(key, what)
                    todo.append((child, depth + 1))
            else:
                todo.extend((child, depth + 1) for child in item)
        elif isinstance(item, str):
            _check_string(item, what)
        elif isinstance(item, float):
            if not math.isfinite(item):
                raise ValueError(f"{what} holds {item!r}; JSON has no NaN or Infinity")
        elif item is not None and not isinstance(item, (bool, int)):
            raise TypeError(f"{what} holds a {type(item).__name__}; use dicts, lists, str, numbers")
    size = len(encode(value))
    if size > limit:
        raise ResourceLimitExceeded(f"{what} is {size} bytes as JSON, the limit is {limit}")
    return size


def _check_string(value: str, what: str) -> None:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(
            f"{what} holds text that is not valid Unicode (a lone surrogate at character {error.start})"
        ) from None


def producer(producer_id: object, producer_state: object) -> None:
    """``submit_tasks``'s producer: a string id, and a JSON state of bounded size."""
    if producer_id is None:
        if producer_state is not None:
            raise ValueError("producer_state needs a producer_id")
        return
    text(producer_id, "producer_id")
    json_value(producer_state, "producer_state", PRODUCER_STATE_BYTES_MAX)


def failure(value: object, retryable: object) -> None:
    """``fail_task``'s reason, a bounded string or JSON object (the peer's callers pass
    either), and its retry flag (a bool)."""
    if isinstance(value, Mapping):
        json_value(value, "failure", FAILURE_BYTES_MAX)
    elif isinstance(value, str):
        _check_string(value, "failure")
        size = len(value.encode("utf-8"))
        if size > FAILURE_BYTES_MAX:
            raise ResourceLimitExceeded(f"failure is {size} bytes, the limit is {FAILURE_BYTES_MAX}")
    else:
        kind = type(value).__name__
        raise TypeError(f"failure must be a string or a JSON object saying why the task failed, got {kind}")
    flag(retryable, "retryable")


def leases(items: Iterable[object], what: str) -> list[Lease]:
    """A list of :class:`Lease` objects (a dict or a task id is refused, naming its place)."""
    if isinstance(items, (str, bytes, Mapping, Lease)):
        raise TypeError(f"{what} takes a list of Lease objects, got one {type(items).__name__}")
    out: list[Lease] = []
    for number, item in enumerate(items):
        if not isinstance(item, Lease):
            raise TypeError(f"{what}: item {number} is a {type(item).__name__}, not a Lease")
        out.append(item)
    return out


def updates(
    items: Iterable[object], what: str, allowed: frozenset[str], required: Sequence[str]
) -> list[dict[str, Any]]:
    """Update mappings of ``yield_tasks`` / ``save_task_progress_many``: known keys only, a
    Lease each, every task at most once."""
    if isinstance(items, (str, bytes, Mapping)):
        raise TypeError(f"{what} takes a list of update mappings, got one {type(items).__name__}")
    out = []
    seen: set[str] = set()
    for number, item in enumerate(items):
        if not isinstance(item, Mapping):
            raise TypeError(f"{what}: update {number} is a {type(item).__name__}, not a mapping")
        unknown = sorted(str(k) for k in item if k not in allowed)
        if unknown:
            raise ValueError(
                f"{what}: update {number} has unknown keys {unknown} (allowed: {', '.join(sorted(allowed))})"
            )
        missing = [k for k in required if k not in item]
        if missing:
            raise ValueError(f"{what}: update {number} is missing {', '.join(missing)}")
        lease = item.get("lease")
        if not isinstance(lease, Lease):
            raise TypeError(
                f"{what}: update {number} needs a Lease under 'lease', got {type(lease).__name__}"
            )
        if lease.task_id in seen:
            raise ValueError(f"{what} got the same task twice ({lease.task_id!r})")
        seen.add(lease.task_id)
        out.append(dict(item))
    return out


def completions(items: object) -> list[tuple[Lease, str, RecordSetRef, str]]:
    """Entries of ``complete_tasks``: mappings with exactly ``COMPLETION_KEYS``, each value of
    the type ``complete_task`` takes (``lease`` and ``result_ref`` may be their ``asdict``
    forms, as the control transport sends them). Errors name the entry."""
    if isinstance(items, (str, bytes, Mapping)) or not isinstance(items, Iterable):
        raise TypeError(f"complete_tasks takes a list of completion mappings, got {type(items).__name__}")
    out: list[tuple[Lease, str, RecordSetRef, str]] = []
    for number, item in enumerate(items):
        if len(out) >= COMPLETIONS_PER_CALL_MAX:
            raise ResourceLimitExceeded(
                f"complete_tasks takes at most {COMPLETIONS_PER_CALL_MAX} completions per call"
            )
        where = f"complete_tasks entry {number}"
        if not isinstance(item, Mapping):
            raise TypeError(f"{where} is a {type(item).__name__}, not a mapping")
        keys = set(item)
        if keys != set(COMPLETION_KEYS):
            unknown = sorted(str(k) for k in keys - set(COMPLETION_KEYS))
            missing = [k for k in COMPLETION_KEYS if k not in keys]
            raise ValueError(
                f"{where}: unknown keys {unknown}, missing {missing} (it takes {COMPLETION_KEYS})"
            )
        lease, ref, digest = item["lease"], item["result_ref"], item["result_digest"]
        try:
            if isinstance(lease, Mapping):
                lease = Lease.from_dict(lease)
            if isinstance(ref, Mapping):
                ref = RecordSetRef.from_dict(ref)
        except (KeyError, TypeError, ValueError) as error:
            raise TypeError(f"{where}: its lease or result_ref dict is not one: {error!r}") from None
        if not isinstance(lease, Lease):
            raise TypeError(f"{where}: lease must be a Lease, got {type(lease).__name__}")
        if not isinstance(ref, RecordSetRef):
            raise TypeError(f"{where}: result_ref must be a RecordSetRef, got {type(ref).__name__}")
        if not isinstance(digest, str):
            raise TypeError(f"{where}: result_digest must be a string, got {type(digest).__name__}")
        out.append((lease, text(item["submission_id"], f"{where} submission_id"), ref, digest))
    return out
