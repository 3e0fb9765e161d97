"""The queue journal's events: one frozen dataclass per op, and their one codec (docs/FORMAT.md 8.3).

Every mutating call journals one event (``QueueState.check_*`` makes it,
``QueueState.apply`` performs it, live and on replay). An event's journal body
is canonical JSON of its fields plus ``"op"``: :func:`encode` writes exactly
the bytes the queue wrote when events were plain dicts (event version 1), so
journals written before these classes existed replay unchanged. :func:`decode`
is the only way back from bytes: it refuses an unknown op
(:class:`UnsupportedSchema`: a newer straw wrote it) and a missing, unknown or
ill-typed field (:class:`CorruptData`: the frame's checksum held, so only a
writer bug produces one) before anything is applied.

Each class is generic in the reply ``apply`` gives for it, so
``Coordinator._commit`` returns a typed reply. A field marked ``_OMIT`` is not
written while it is None (those are fields later versions of the queue added:
older bodies lack them); a field marked ``_LIVE`` is never journaled (it only
saves the live apply work that replay must redo from the journaled fields).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeAlias, TypeVar

from ..errors import CorruptData, UnsupportedSchema, invariant
from ..protocol import Lease, TaskSpec, encode_plain
from ..protocol import decode as decode_json

R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)

#: JSON-ready values, as the journal holds them (kept as decoded: nothing is converted).
JsonObject: TypeAlias = dict[str, Any]
#: ``[task_id, attempt_id]`` pairs.
Pairs: TypeAlias = list[list[str]]
#: ``[task_id, attempt_id, token]`` triples.
Grants: TypeAlias = list[list[str]]
#: ``[cursor, [positions above it]]``: the accepted history the queue no longer owns.
Released: TypeAlias = list[Any]
#: ``ref_key`` -> the packs a named reference reaches (0: just its manifest's pack).
Reach: TypeAlias = dict[str, Any]
#: A receipt as the accepted log holds it (``CommitReceipt`` fields, ``result_ref`` a dict).
Receipt: TypeAlias = dict[str, Any]

_OMIT = {"omit": True}
_LIVE = {"live": True}


@dataclass(frozen=True)
class Answer(Generic[R_co]):
    """A check's reply that needs no event: an idempotent repeat or a status (nothing to journal)."""

    value: R_co


@dataclass(frozen=True, slots=True, kw_only=True)
class Op(Generic[R_co]):
    """What every event carries: the packs each reference it names reaches (GC roots), set by
    the coordinator from the publications the call adopts."""

    OP: ClassVar[str] = ""
    reach: Reach | None = field(default=None, metadata=_OMIT)


#: Any event (the reply type erased).
Event: TypeAlias = Op[Any]


@dataclass(frozen=True, slots=True, kw_only=True)
class Submit(Op[list[str]]):
    OP: ClassVar[str] = "submit"
    request_id: str
    fingerprint: str
    refs: list[JsonObject]
    tasks: list[list[Any]]
    producer_id: str | None
    producer_state: Any
    #: The checked specs themselves (live only): applying live does not rebuild what replay
    #: must rebuild from ``refs`` and ``tasks``.
    specs: Sequence[TaskSpec] | None = field(default=None, compare=False, repr=False, metadata=_LIVE)


@dataclass(frozen=True, slots=True, kw_only=True)
class Acquire(Op[list[Lease]]):
    OP: ClassVar[str] = "acquire"
    worker_id: str
    reclaimed: Pairs
    grants: Grants
    deadline: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Complete(Op[Receipt]):
    OP: ClassVar[str] = "complete"
    task_id: str
    attempt_id: str
    submission_id: str
    commit_id: str
    digest: str
    result_ref: JsonObject
    #: Packs the result reaches (absent in bodies written before they were journaled).
    packs: list[str] | None = field(default=None, metadata=_OMIT)


@dataclass(frozen=True, slots=True, kw_only=True)
class CompleteMany(Op[list[Receipt]]):
    """One ``complete_tasks`` transaction: its completions are ``complete`` bodies without ``op``."""

    OP: ClassVar[str] = "complete_many"
    completes: list[Complete]


@dataclass(frozen=True, slots=True, kw_only=True)
class Fail(Op[str]):
    OP: ClassVar[str] = "fail"
    request_id: str
    fingerprint: str
    task_id: str
    attempt_id: str
    failure: str
    retryable: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class Release(Op[list[str]]):
    OP: ClassVar[str] = "release"
    request_id: str
    fingerprint: str
    leases: Pairs
    outcomes: list[str]


@dataclass(frozen=True, slots=True, kw_only=True)
class Yield(Op[list[str]]):
    OP: ClassVar[str] = "yield"
    request_id: str
    fingerprint: str
    #: ``{task_id, attempt_id, input_ref, priority, scheduling_key, metadata}`` each (None: kept).
    updates: list[JsonObject]


@dataclass(frozen=True, slots=True, kw_only=True)
class Progress(Op[list[str]]):
    OP: ClassVar[str] = "progress"
    request_id: str
    fingerprint: str
    #: ``{task_id, attempt_id, input_ref}`` each.
    updates: list[JsonObject]


@dataclass(frozen=True, slots=True, kw_only=True)
class Cancel(Op[str]):
    OP: ClassVar[str] = "cancel"
    request_id: str
    fingerprint: str
    task_id: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Seal(Op[bool]):
    OP: ClassVar[str] = "seal"
    request_id: str
    fingerprint: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Drain(Op[bool]):
    OP: ClassVar[str] = "drain"


@dataclass(frozen=True, slots=True, kw_only=True)
class Retire(Op[list[Receipt]]):
    OP: ClassVar[str] = "retire"
    worker_id: str
    leased: Pairs
    reads: Pairs


@dataclass(frozen=True, slots=True, kw_only=True)
class ReleaseReads(Op[int]):
    OP: ClassVar[str] = "release_reads"
    reads: Pairs


@dataclass(frozen=True, slots=True, kw_only=True)
class Epoch(Op[int]):
    OP: ClassVar[str] = "epoch"
    epoch: int
    #: The queue's identity (``queue.json``), recorded by the coordinator when it opens (I21).
    identity: JsonObject | None = field(default=None, metadata=_OMIT)


@dataclass(frozen=True, slots=True, kw_only=True)
class OpenConsumer(Op[str]):
    OP: ClassVar[str] = "open_consumer"
    consumer_id: str
    owner: str
    token: str


@dataclass(frozen=True, slots=True, kw_only=True)
class CloseConsumer(Op[bool]):
    OP: ClassVar[str] = "close_consumer"
    consumer_id: str


@dataclass(frozen=True, slots=True, kw_only=True)
class SaveConsumer(Op[JsonObject]):
    OP: ClassVar[str] = "save_consumer"
    request_id: str
    fingerprint: str
    consumer_id: str
    state: JsonObject
    #: A rewind's new released history (only then).
    released: Released | None = field(default=None, metadata=_OMIT)


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanBatch(Op[JsonObject]):
    OP: ClassVar[str] = "plan_batch"
    batch: JsonObject


@dataclass(frozen=True, slots=True, kw_only=True)
class BatchReady(Op[JsonObject]):
    OP: ClassVar[str] = "batch_ready"
    consumer_id: str
    batch_id: str
    ready_ref: JsonObject
    state: JsonObject
    released: Released | None = field(default=None, metadata=_OMIT)


@dataclass(frozen=True, slots=True, kw_only=True)
class RegisterCheckpoint(Op[JsonObject]):
    OP: ClassVar[str] = "register_checkpoint"
    checkpoint_id: str
    checkpoint_ref: JsonObject
    #: Batches the checkpoint says it trained on (accounting only; absent when none).
    batch_ids: list[str] | None = field(default=None, metadata=_OMIT)


@dataclass(frozen=True, slots=True, kw_only=True)
class ReleaseCheckpoint(Op[bool]):
    OP: ClassVar[str] = "release_checkpoint"
    checkpoint_id: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ReleaseHistory(Op[None]):
    OP: ClassVar[str] = "release_history"
    released: Released


#: Every op, by its journal name.
OPS: dict[str, type[Event]] = {
    cls.OP: cls
    for cls in (
        Submit,
        Acquire,
        Complete,
        CompleteMany,
        Fail,
        Release,
        Yield,
        Progress,
        Cancel,
        Seal,
        Drain,
        Retire,
        ReleaseReads,
        Epoch,
        OpenConsumer,
        CloseConsumer,
        SaveConsumer,
        PlanBatch,
        BatchReady,
        RegisterCheckpoint,
        ReleaseCheckpoint,
        ReleaseHistory,
    )
}

# ---------------------------------------------------------------------- the codec


def _is_str(value: object) -> bool:
    return type(value) is str


def _is_int(value: object) -> bool:
    return type(value) is int


def _is_number(value: object) -> bool:
    return type(value) in (int, float)


def _is_list_of(check: Callable[[object], bool]) -> Callable[[object], bool]:
    return lambda value: type(value) is list and all(check(item) for item in value)


def _is_pair(value: object) -> bool:
    return type(value) is list and len(value) == 2 and all(type(x) is str for x in value)


def _is_grant(value: object) -> bool:
    return type(value) is list and len(value) == 3 and all(type(x) is str for x in value)


def _is_released(value: object) -> bool:
    return type(value) is list and len(value) == 2 and _is_int(value[0]) and _is_list_of(_is_int)(value[1])


def _is_object(value: object) -> bool:
    return type(value) is dict


def _is_any(value: object) -> bool:
    return True


#: Each field annotation (as written above) and what a decoded value of it must be.
_CHECKS: dict[str, Callable[[object], bool]] = {
    "str": _is_str,
    "int": _is_int,
    "float": _is_number,
    "bool": lambda value: type(value) is bool,
    "Any": _is_any,
    "str | None": lambda value: value is None or _is_str(value),
    "JsonObject": _is_object,
    "JsonObject | None": lambda value: value is None or _is_object(value),
    "Reach | None": lambda value: value is None or _is_object(value),
    "list[str]": _is_list_of(_is_str),
    "list[str] | None": lambda value: value is None or _is_list_of(_is_str)(value),
    "list[JsonObject]": _is_list_of(_is_object),
    "list[list[Any]]": _is_list_of(lambda item: type(item) is list),
    "Pairs": _is_list_of(_is_pair),
    "Grants": _is_list_of(_is_grant),
    "Released": _is_released,
    "Released | None": lambda value: value is None or _is_released(value),
    "list[Complete]": _is_list_of(_is_object),  # each one decoded as a Complete body
}


@dataclass(frozen=True, slots=True)
class _Field:
    name: str
    omit: bool
    check: Callable[[object], bool]
    required: bool
    #: A list of ``complete`` bodies without their op (``complete_many``).
    nested: bool


def _layout(cls: type[Event]) -> tuple[_Field, ...]:
    out = []
    for item in dataclasses.fields(cls):
        if item.metadata.get("live"):
            continue
        kind = str(item.type)
        invariant(kind in _CHECKS, f"event field {cls.__name__}.{item.name} has a known type")
        required = item.default is dataclasses.MISSING and item.default_factory is dataclasses.MISSING
        nested = kind == "list[Complete]"
        out.append(_Field(item.name, bool(item.metadata.get("omit")), _CHECKS[kind], required, nested))
    return tuple(out)


_LAYOUTS: dict[type[Event], tuple[_Field, ...]] = {cls: _layout(cls) for cls in OPS.values()}
_NAMES: dict[type[Event], frozenset[str]] = {
    cls: frozenset(f.name for f in _LAYOUTS[cls]) for cls in OPS.values()
}


def as_body(event: Event, *, op: bool = True) -> JsonObject:
    """An event's journal body as JSON-ready data (``op`` False: a ``complete_many`` entry)."""
    out: JsonObject = {"op": event.OP} if op else {}
    for item in _LAYOUTS[type(event)]:
        value = getattr(event, item.name)
        if value is None and item.omit:
            continue
        if item.nested:
            value = [as_body(entry, op=False) for entry in value]
        out[item.name] = value
    return out


def encode(event: Event) -> bytes:
    """The bytes journaled for an event (canonical JSON; the live-only fields left out).

    ``encode_plain``: an event holds only strings, numbers, lists and dicts that straw built
    or that passed ``validate`` (task metadata, producer states); a NaN or an infinity (an
    injected clock's) is still refused, as by ``protocol.encode``."""
    return encode_plain(as_body(event), finite=False)


def decode(body: bytes | bytearray | memoryview) -> Event:
    """The event a journal body holds, its fields checked (see the module docstring)."""
    return from_body(decode_json(body))


def from_body(data: object) -> Event:
    """The event of a decoded journal body (``decode`` without the JSON step)."""
    if not isinstance(data, dict) or not isinstance(data.get("op"), str):
        raise CorruptData(f"a queue journal body is an object with an op, got {str(data)[:80]}")
    cls = OPS.get(data["op"])
    if cls is None:
        raise UnsupportedSchema(
            f"queue journal op {data['op']!r} is not known to this straw (written by a newer version?)"
        )
    return _build(cls, data, data["op"])


def _build(cls: type[Event], data: Mapping[str, Any], op: str) -> Event:
    extra = data.keys() - _NAMES[cls] - {"op"}
    if extra:
        raise CorruptData(f"queue journal op {op!r} has unknown fields {sorted(extra)}")
    values: dict[str, Any] = {}
    for item in _LAYOUTS[cls]:
        if item.name not in data:
            if item.required:
                raise CorruptData(f"queue journal op {op!r} lacks field {item.name!r}")
            continue
        value = data[item.name]
        if not item.check(value):
            raise CorruptData(f"queue journal op {op!r} field {item.name!r} is ill-typed: {str(value)[:80]}")
        values[item.name] = value
    if cls is CompleteMany:
        values["completes"] = [
            _build(Complete, entry, "complete_many entry") for entry in values["completes"]
        ]
    return cls(**values)
