"""Argument checks of the queue controller: every public call validates its input here first.

Each helper raises ``TypeError`` or ``ValueError`` naming what was wrong, before the controller
changes anything (docs/ROLLOUT.md, "Faults").
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ..protocol import Lease, RecordSetRef, as_dict, decode, encode
from .refs import DiskPayloadRef


def _text(value: object, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{what} must be a non-empty string, got {value!r}")
    return value


def _count(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an integer, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{what} must be positive, got {value}")
    return value


def _lease(value: object) -> Lease:
    """A Lease, or the dict of one (samples carry ``_queue_lease`` as a dict)."""
    if isinstance(value, Lease):
        return value
    if isinstance(value, Mapping):
        try:
            return Lease.from_dict(value)
        except KeyError as error:
            raise ValueError(f"a lease dict is missing {error.args[0]!r}") from None
    raise TypeError(f"expected a Lease, got {type(value).__name__}")


def _leases(values: object) -> list[Lease]:
    if isinstance(values, (str, bytes, Mapping, Lease)) or not isinstance(values, Iterable):
        raise TypeError(f"expected a sequence of leases, got {type(values).__name__}")
    return [_lease(value) for value in values]


def _manifest(value: object, what: str) -> RecordSetRef:
    if isinstance(value, DiskPayloadRef):
        return value.manifest
    if isinstance(value, RecordSetRef):
        return value
    raise TypeError(f"{what} must be a RecordSetRef or a DiskPayloadRef, got {type(value).__name__}")


def _reason(value: object) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"a reason must be a non-empty string, got {value!r}")
    return value


def _failure(category: str, reason: str) -> str:
    """Failure texts are canonical JSON of ``{category, reason}`` (ROLLOUT.md section 10.5)."""
    return encode({"category": category, "reason": reason}).decode()


def _positions(values: object, what: str) -> list[int]:
    if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, Iterable):
        raise TypeError(f"{what} must be a sequence of positions, got {type(values).__name__}")
    found = list(values)
    for value in found:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{what} holds non-negative integer positions, got {value!r}")
    return found


def _items(values: object, what: str) -> list[Mapping[str, Any]]:
    if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, Iterable):
        raise TypeError(f"{what} must be a sequence of dicts, got {type(values).__name__}")
    found = list(values)
    for item in found:
        if not isinstance(item, Mapping):
            raise TypeError(f"{what} holds dicts, got {type(item).__name__}")
    return found


def _int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an integer, got {type(value).__name__}")
    return value


def _metadata(value: object) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise TypeError(f"task metadata is a dict, got {type(value).__name__}")
    found = dict(value)
    if "source_positions" in found:
        found["source_positions"] = _positions(found["source_positions"], "source_positions")
    try:
        encode(found)
    except (TypeError, ValueError) as error:
        raise TypeError(f"task metadata must be JSON-encodable: {error}") from error
    return found


def _update(item: Mapping[str, Any]) -> dict[str, Any]:
    """A checked yield update: ``{lease, input_ref, priority, scheduling_key, metadata}``."""
    unknown = set(item) - {"lease", "input_ref", "priority", "scheduling_key", "metadata"}
    if unknown:
        raise ValueError(f"an update has unknown fields {sorted(unknown)}")
    if "lease" not in item or "input_ref" not in item:
        raise ValueError("an update needs a lease and its continuation's input_ref")
    update: dict[str, Any] = {
        "lease": _lease(item["lease"]),
        "input_ref": _manifest(item["input_ref"], "an update's input_ref"),
        "metadata": _metadata(item.get("metadata")),
    }
    for key in ("priority", "scheduling_key"):
        if item.get(key) is not None:
            update[key] = _int(item[key], key)
    return update


def _update_fields(update: Mapping[str, Any]) -> dict[str, Any]:
    """An update as JSON (the digest of a return request names it)."""
    return {
        key: as_dict(value) if isinstance(value, (Lease, RecordSetRef)) else value
        for key, value in update.items()
    }


def _category(failure: object) -> str | None:
    if not isinstance(failure, str):
        return None
    try:
        value = decode(failure.encode())
    except Exception:
        return None
    return value.get("category") if isinstance(value, dict) else None
