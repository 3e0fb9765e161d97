"""Control types and canonical JSON (API.md section 2).

Everything here is small, frozen and JSON-encodable with ``dataclasses.asdict``.
References never carry payload bytes or absolute paths; their field values are
straw's own (docs/FORMAT.md), their names are the contract's.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import orjson

from .errors import CorruptData, InvalidReference, ResourceLimitExceeded
from .limits import JSON_FAST_DECODE_BYTES_MAX, JSON_ITEMS_PER_CALL_MAX

__all__ = [
    "CHECKSUM_ALGORITHM",
    "AcquireResult",
    "Assignment",
    "CommitPage",
    "CommitReceipt",
    "Lease",
    "Limits",
    "Publication",
    "Record",
    "RecordRef",
    "RecordSetRef",
    "SegmentRef",
    "TaskSpec",
    "as_dict",
    "decode",
    "digest",
    "encode",
    "encode_plain",
]

#: Checksum algorithm named by every reference this version writes (docs/FORMAT.md).
CHECKSUM_ALGORITHM = "xxh3-128"

T = TypeVar("T")
_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1

# --------------------------------------------------------------------------- canonical JSON


def _plain(value: Any) -> Any:
    """JSON default hook: dataclasses become dicts, tuples are handled by json itself."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return as_dict(value)
    raise TypeError(f"{type(value).__name__} is not JSON-encodable; pass dicts, lists, str, numbers")


def _canonical_encoder() -> Callable[[Any], str]:
    """One reusable canonical encoder (``json.dumps`` with arguments builds a new one per call).

    It keeps no circular-reference table: a table shared between calls would keep stale
    entries after an error. A circular value then exhausts the recursion limit instead,
    which :func:`encode` reports as a ``ValueError`` like ``json`` would.
    """
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:  # pragma: no cover - CPython always has the C accelerator
        python = json.JSONEncoder(
            sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False, default=_plain
        )
        return python.encode
    # markers, default, string encoder, indent, key sep, item sep, sort_keys, skipkeys, allow_nan
    c_encoder = make(None, _plain, json.encoder.encode_basestring, None, ":", ",", True, False, False)

    def run(value: Any) -> str:
        return "".join(c_encoder(value, 0))

    return run


_ENCODE = _canonical_encoder()


def encode(value: Any) -> bytes:
    """Canonical JSON: sorted keys, compact separators, UTF-8, no NaN/Infinity."""
    return encode_text(value).encode("utf-8")


def encode_text(value: Any) -> str:
    """The text of :func:`encode` before its UTF-8 encoding (for callers that splice canonical
    texts into a larger canonical document, see :func:`quote`)."""
    try:
        return _ENCODE(value)
    except RecursionError:
        raise ValueError("cannot encode canonically: the value contains itself (circular)") from None
    except ValueError as error:
        raise ValueError(f"cannot encode canonically: {error} (NaN and Infinity are rejected)") from None


#: Where orjson's text can differ from :func:`encode`'s for the values :func:`encode_plain`
#: takes: a float of exponent -5 to -9 (``0.00001`` or ``2.5e-7`` where Python writes
#: ``1e-05`` and ``2.5e-07``; every other finite float is written alike by both, shortest
#: round-trip digits). A match anywhere (a string or another number may hold one too) sends
#: the value to the canonical encoder instead. Two patterns: one alternation scans ~10x slower.
_ORJSON_FIXED_TINY = re.compile(rb"\.0000")
_ORJSON_SHORT_EXPONENT = re.compile(rb"e-\d(?!\d)")
_ORJSON_OPTIONS = (
    orjson.OPT_SORT_KEYS
    | orjson.OPT_PASSTHROUGH_DATACLASS
    | orjson.OPT_PASSTHROUGH_SUBCLASS
    | orjson.OPT_PASSTHROUGH_DATETIME
)


def _orjson_refused(value: Any) -> Any:
    raise TypeError  # any value orjson does not write itself: the canonical encoder decides


def encode_plain(value: Any, *, finite: bool = True) -> bytes:
    """:func:`encode` of a value built only of dicts with str keys, lists, str, int, bool,
    None and floats, byte for byte, about four times faster (a rollout group's 13.5 KB
    document: 150 -> 35 us, checks included; a queue's completion event: 7.2 -> 1.8 us).

    orjson writes it; a value orjson refuses (an int beyond 64 bits, a non-str key, a lone
    surrogate, nesting past its depth, another type) and an output where the two encoders
    can differ (the two patterns above) go through :func:`encode`, which raises what it raises.

    orjson writes a NaN or an infinity as ``null``. ``finite`` (the default) is the caller's
    promise that the value holds none (a sample document: the schema writes a non-finite
    float as a tagged node). ``finite=False`` makes no such promise: an output holding
    ``null`` anywhere goes through :func:`encode` too, which refuses NaN and Infinity (a
    value holding None takes that slower path, with the same bytes).

    Not for arbitrary objects: orjson also writes an ``enum.Enum`` (its value) and a
    ``uuid.UUID`` (its text), which :func:`encode` refuses. Callers pass values whose types
    were checked before (journal events: their user parts pass ``validate.json_value``) or
    that they built themselves.
    """
    try:
        data = orjson.dumps(value, default=_orjson_refused, option=_ORJSON_OPTIONS)
    except TypeError:  # orjson.JSONEncodeError is a TypeError
        return encode(value)
    if _ORJSON_FIXED_TINY.search(data) is not None or _ORJSON_SHORT_EXPONENT.search(data) is not None:
        return encode(value)
    if not finite and b"null" in data:
        return encode(value)
    return data


#: A str as canonical JSON text: the string encoder :func:`encode` itself uses, so a document
#: composed of ``quote``d strings, ``str`` of ints and :func:`encode_text` parts, with its keys
#: written in sorted order, is exactly the text ``encode_text`` gives for the whole.
quote: Callable[[str], str] = json.encoder.encode_basestring


def encode_pieces(value: Any, items: int = JSON_ITEMS_PER_CALL_MAX) -> list[bytes]:
    """:func:`encode` in pieces whose concatenation is ``encode(value)``, byte for byte.

    The C encoder holds the GIL for a whole call, so encoding a large state in one call stops
    every other thread of the process meanwhile (issue 12: a background snapshot's encode held
    it for tens of milliseconds). Here a list or dict of more than ``items`` items is encoded
    ``items`` at a time, and the dicts of the top levels are walked key by key, so between
    two C calls the other threads get their turn.
    """
    out: list[str] = []
    try:
        _pieces(value, items, out, 0)
    except RecursionError:
        raise ValueError("cannot encode canonically: the value contains itself (circular)") from None
    except ValueError as error:
        raise ValueError(f"cannot encode canonically: {error} (NaN and Infinity are rejected)") from None
    return [piece.encode("utf-8") for piece in out]


#: Levels of nested dicts that :func:`encode_pieces` walks key by key however small they are
#: (a snapshot body nests its large tables one or two levels down).
_WALKED_LEVELS = 3


def _pieces(value: Any, items: int, out: list[str], depth: int) -> None:
    kind = type(value)
    if kind is dict and all(type(k) is str for k in value):
        keys = sorted(value)
        if len(keys) > items:
            for start in range(0, len(keys), items):
                chunk = _ENCODE({k: value[k] for k in keys[start : start + items]})
                out.append(("{" if start == 0 else ",") + chunk[1:-1])
            out.append("}")
        elif depth < _WALKED_LEVELS and keys:
            for number, key in enumerate(keys):
                out.append(("{" if number == 0 else ",") + json.encoder.encode_basestring(key) + ":")
                _pieces(value[key], items, out, depth + 1)
            out.append("}")
        else:
            out.append(_ENCODE(value))
    elif (kind is list or kind is tuple) and len(value) > items:
        for start in range(0, len(value), items):
            chunk = _ENCODE(list(value[start : start + items]))
            out.append(("[" if start == 0 else ",") + chunk[1:-1])
        out.append("]")
    else:
        out.append(_ENCODE(value))


def _reject_constant(name: str) -> Any:
    raise CorruptData(f"canonical JSON never contains {name}")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise CorruptData(f"canonical JSON never contains a number that overflows ({text[:40]})")
    return value


#: :func:`decode`'s guard for orjson: every digit as ``0``, every other byte as a space, so a
#: run of ``_LONG_DIGIT_RUN`` (19 digits: every int outside 64 bits has at least that many)
#: is found by one substring search. A run inside a string or a fraction is a false alarm:
#: the slower path, never a wrong value.
_DIGITS_ONLY = bytes(0x30 if 0x30 <= byte <= 0x39 else 0x20 for byte in range(256))
_LONG_DIGIT_RUN = b"0" * 19


def decode(data: bytes | bytearray | memoryview, *, check_floats: bool = True) -> Any:
    """Reverse :func:`encode`; any invalid input raises :class:`CorruptData`.

    orjson parses what it parses into the json module's values (floats correctly rounded, and
    never an infinity: it refuses one), except an int beyond 64 bits, which it makes a float.
    Every such int is a run of 19 or more digits, so input with such a run (or over
    ``JSON_FAST_DECODE_BYTES_MAX``), and input orjson refuses, is parsed by the json module,
    which decides every error and its message. There ``check_floats=False`` parses numbers
    with the C float parser instead of a Python callback per number: one that overflows
    becomes an infinity, which the caller must refuse itself
    (``straw.codec.payload.decode_document`` does, for sample documents).
    """
    raw = data if type(data) is bytes else bytes(data)
    if len(raw) <= JSON_FAST_DECODE_BYTES_MAX and _LONG_DIGIT_RUN not in raw.translate(_DIGITS_ONLY):
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass  # the json module's path below names the error
    try:
        text = raw.decode("utf-8")
        if not check_floats:
            return json.loads(text, parse_constant=_reject_constant)
        return json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    except (ValueError, RecursionError) as error:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CorruptData(f"invalid canonical JSON: {error}") from None


def digest(value: Any) -> str:
    """SHA-256 hex of the canonical encoding."""
    return hashlib.sha256(encode(value)).hexdigest()


# --------------------------------------------------------------------------- fast dicts


def _copy_json(value: Any) -> Any:
    """``copy.deepcopy`` of a value journaled as JSON (task metadata: dicts, lists, tuples and
    scalars, checked acyclic and bounded in depth at submit), without deepcopy's memo and
    dispatch: ``tasks`` and ``task_status`` copy one per task."""
    kind = type(value)
    if kind is dict:
        return {key: _copy_json(item) for key, item in value.items()}
    if kind is list:
        return [_copy_json(item) for item in value]
    if kind is tuple:
        return tuple([_copy_json(item) for item in value])
    if value is None or kind is str or kind is int or kind is float or kind is bool:
        return value
    return copy.deepcopy(value)


def as_dict(value: Any) -> Any:
    """``dataclasses.asdict`` for straw's control types, without its deep copies (hot paths).

    Equal to ``dataclasses.asdict(value)`` for every type of this module (a test holds it to that).
    """
    kind = type(value)
    if kind is RecordSetRef:
        return {
            "manifest": as_dict(value.manifest),
            "digest": value.digest,
            "records": value.records,
            "payload_bytes": value.payload_bytes,
            "tokens": value.tokens,
        }
    if kind is RecordRef:
        return {"segment": as_dict(value.segment), "ordinal": value.ordinal}
    if kind is SegmentRef:
        return {
            "run_id": value.run_id,
            "path": value.path,
            "segment_id": value.segment_id,
            "size": value.size,
            "checksum": value.checksum,
            "version": value.version,
            "checksum_algorithm": value.checksum_algorithm,
            "offset": value.offset,
        }
    if kind is Lease:
        return {
            "run_id": value.run_id,
            "queue_id": value.queue_id,
            "task_id": value.task_id,
            "attempt_id": value.attempt_id,
            "generation": value.generation,
            "coordinator_epoch": value.coordinator_epoch,
            "token": value.token,
            "worker_id": value.worker_id,
        }
    if kind is TaskSpec:
        return {
            "task_id": value.task_id,
            "input_ref": as_dict(value.input_ref) if value.input_ref is not None else None,
            "metadata": _copy_json(value.metadata) if value.metadata else {},
            "allow_empty": value.allow_empty,
            "max_attempts": value.max_attempts,
            "estimated_records": value.estimated_records,
            "estimated_bytes": value.estimated_bytes,
            "estimated_tokens": value.estimated_tokens,
            "control": value.control,
            "priority": value.priority,
            "scheduling_key": value.scheduling_key,
        }
    return dataclasses.asdict(value)


# --------------------------------------------------------------------------- field checks


def check_text(value: object, what: str, limit: int) -> str:
    """A name argument (an id, a codec name): a non-empty string UTF-8 can encode (no lone
    surrogates), at most ``limit`` bytes. The one check the store and the queue share."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"{what} must be a non-empty string, got {value!r}"[:300])
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError as error:
        raise ValueError(
            f"{what} is not valid Unicode text (a lone surrogate at character {error.start}); "
            "names are stored as UTF-8"
        ) from None
    if size > limit:
        raise ResourceLimitExceeded(f"{what} is longer than {limit} bytes ({size} in UTF-8)")
    return value


def _field(data: Mapping[str, Any], name: str, kind: type | tuple[type, ...], what: str) -> Any:
    if not isinstance(data, Mapping):
        raise InvalidReference(f"{what} must be a mapping, got {type(data).__name__}")
    if name not in data:
        raise InvalidReference(f"{what} is missing field {name!r}")
    value = data[name]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise InvalidReference(f"{what}.{name} has type {type(value).__name__}")
    return value


def _check_int64(value: object, name: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not _INT64_MIN <= value <= _INT64_MAX:
        raise ValueError(f"{name} must be a signed 64-bit integer, got {value!r}")


def _check_count(value: object, name: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")


# --------------------------------------------------------------------------- references


@dataclass(frozen=True)
class SegmentRef:
    """One immutable, checksummed extent of a file inside the pool."""

    run_id: str
    path: str
    segment_id: str
    size: int
    checksum: str
    version: int = 1
    checksum_algorithm: str = CHECKSUM_ALGORITHM
    offset: int = 0

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SegmentRef:
        what = "SegmentRef"
        return cls(
            run_id=_field(data, "run_id", str, what),
            path=_field(data, "path", str, what),
            segment_id=_field(data, "segment_id", str, what),
            size=_field(data, "size", int, what),
            checksum=_field(data, "checksum", str, what),
            version=_field(data, "version", int, what) if "version" in data else 1,
            checksum_algorithm=(
                _field(data, "checksum_algorithm", str, what)
                if "checksum_algorithm" in data
                else CHECKSUM_ALGORITHM
            ),
            offset=_field(data, "offset", int, what) if "offset" in data else 0,
        )


@dataclass(frozen=True)
class RecordRef:
    """One record: the index extent that lists it and its position there."""

    segment: SegmentRef
    ordinal: int

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RecordRef:
        segment = _field(data, "segment", (Mapping, SegmentRef), "RecordRef")
        if not isinstance(segment, SegmentRef):
            segment = SegmentRef.from_dict(segment)
        return cls(segment=segment, ordinal=_field(data, "ordinal", int, "RecordRef"))


@dataclass(frozen=True)
class RecordSetRef:
    """An ordered, logically identified set of records plus dependencies."""

    manifest: RecordRef
    digest: str
    records: int
    payload_bytes: int
    tokens: int

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RecordSetRef:
        what = "RecordSetRef"
        manifest = _field(data, "manifest", (Mapping, RecordRef), what)
        if not isinstance(manifest, RecordRef):
            manifest = RecordRef.from_dict(manifest)
        return cls(
            manifest=manifest,
            digest=_field(data, "digest", str, what),
            records=_field(data, "records", int, what),
            payload_bytes=_field(data, "payload_bytes", int, what),
            tokens=_field(data, "tokens", int, what),
        )


# --------------------------------------------------------------------------- payload types


@dataclass(frozen=True)
class Record:
    """One record to write, or one record read back (payload is bytes-like)."""

    record_id: str
    payload: bytes | bytearray | memoryview
    codec: str = "bytes.v1"
    metadata: dict[str, Any] = field(default_factory=dict)
    tokens: int = 0


@dataclass(frozen=True)
class Publication:
    """Records plus dependencies; an int dependency names an earlier publication of the same call."""

    records: tuple[Record, ...]
    dependencies: tuple[RecordSetRef | int, ...] = ()


# --------------------------------------------------------------------------- queue types


@dataclass(frozen=True)
class TaskSpec:
    """A unit of work: an optional input reference plus scheduling fields."""

    task_id: str
    input_ref: RecordSetRef | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    allow_empty: bool = False
    max_attempts: int = 3
    estimated_records: int = 1
    estimated_bytes: int = 0
    estimated_tokens: int = 0
    control: bool = False
    priority: int = 0
    scheduling_key: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.task_id, str) or not self.task_id:
            raise ValueError(f"task_id must be a non-empty string, got {self.task_id!r}")
        if self.input_ref is not None and not isinstance(self.input_ref, RecordSetRef):
            raise TypeError(f"input_ref must be a RecordSetRef or None, got {type(self.input_ref).__name__}")
        if (
            not isinstance(self.max_attempts, int)
            or isinstance(self.max_attempts, bool)
            or self.max_attempts < 1
        ):
            raise ValueError(f"max_attempts must be a positive integer, got {self.max_attempts!r}")
        for name in ("estimated_records", "estimated_bytes", "estimated_tokens"):
            _check_count(getattr(self, name), name)
        _check_int64(self.priority, "priority")
        _check_int64(self.scheduling_key, "scheduling_key")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TaskSpec:
        values = dict(data)
        ref = values.get("input_ref")
        if ref is not None and not isinstance(ref, RecordSetRef):
            values["input_ref"] = RecordSetRef.from_dict(ref)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(values) - names
        if unknown:
            raise ValueError(f"TaskSpec.from_dict got unknown fields {sorted(unknown)}")
        return cls(**values)


@dataclass(frozen=True)
class Lease:
    """The right of one worker to work on one attempt of one task until it expires."""

    run_id: str
    queue_id: str
    task_id: str
    attempt_id: str
    generation: int
    coordinator_epoch: int
    token: str
    worker_id: str

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Lease:
        return cls(
            data["run_id"],
            data["queue_id"],
            data["task_id"],
            data["attempt_id"],
            data["generation"],
            data["coordinator_epoch"],
            data["token"],
            data["worker_id"],
        )


@dataclass(frozen=True)
class Assignment:
    """A task handed to a worker together with its lease."""

    task: TaskSpec
    lease: Lease


AcquireStatus = Literal["acquired", "empty", "backpressured", "end_of_input", "draining"]


@dataclass(frozen=True)
class AcquireResult:
    """The answer to ``acquire``: a status and zero or more assignments."""

    status: AcquireStatus
    assignments: tuple[Assignment, ...] = ()


def unchecked(cls: type[T], values: Mapping[str, Any]) -> T:
    """A frozen protocol object built from values straw itself checked before it journaled them
    (recovery and paging rebuild these by the thousand): no ``__init__``, no validation."""
    obj = object.__new__(cls)
    obj.__dict__.update(values)
    return obj


#: A SegmentRef's field names in declaration order (the order flat rows keep its values in).
SEGMENT_FIELDS = tuple(f.name for f in dataclasses.fields(SegmentRef))
_SET_FIELDS = ("digest", "records", "payload_bytes", "tokens")
_RECEIPT_FIELDS = ("commit_id", "task_id", "submission_id", "digest", "position")


@dataclass(frozen=True)
class CommitReceipt:
    """Proof that a task's result was accepted at a position of the accepted log."""

    commit_id: str
    task_id: str
    submission_id: str
    digest: str
    position: int
    result_ref: RecordSetRef

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CommitReceipt:
        values = {f.name: data[f.name] for f in dataclasses.fields(cls)}
        ref = values["result_ref"]
        if not isinstance(ref, RecordSetRef):
            values["result_ref"] = RecordSetRef.from_dict(ref)
        return cls(**values)

    @classmethod
    def from_journal(cls, data: Mapping[str, Any]) -> CommitReceipt:
        """A receipt read back from straw's own accepted log, whose fields were validated when it
        was accepted: paging builds these by the thousand, so the checks are not repeated."""
        ref = data["result_ref"]
        if not isinstance(ref, RecordSetRef):
            manifest = ref["manifest"]
            segment = unchecked(SegmentRef, {name: manifest["segment"][name] for name in SEGMENT_FIELDS})
            record = unchecked(RecordRef, {"segment": segment, "ordinal": manifest["ordinal"]})
            ref = unchecked(RecordSetRef, {"manifest": record, **{name: ref[name] for name in _SET_FIELDS}})
        return unchecked(cls, {**{name: data[name] for name in _RECEIPT_FIELDS}, "result_ref": ref})


@dataclass(frozen=True)
class CommitPage:
    """A page of the accepted log and the cursor to continue from."""

    commits: tuple[CommitReceipt, ...]
    cursor: int
    end_of_input: bool


@dataclass(frozen=True)
class Limits:
    """Identity fields of a queue kept for compatibility; every field must be positive."""

    pending_tasks: int = 10_000
    inflight_tasks: int = 256
    control_tasks: int = 1
    accepted_records: int = 100_000
    accepted_bytes: int = 64 * 1024**3
    accepted_tokens: int = 100_000_000
    ready_bytes: int = 64 * 1024**3
    max_result_bytes: int = 4 * 1024**3
    max_result_tokens: int = 100_000_000
    metadata_bytes: int = 256 * 1024

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"Limits.{f.name} must be positive, got {value!r}")
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"Limits.{f.name} must be finite, got {value!r}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Limits:
        return cls(**dict(data))
