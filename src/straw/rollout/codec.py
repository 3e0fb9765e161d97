"""The rollout sample codec: straw.codec with the rollout layer's rules on top.

Every publication is an ordinary sample.v1 publication (docs/FORMAT.md section 10) that
``straw.codec.load`` can read too. What this layer adds (docs/ROLLOUT.md, "The codec"):

- an allowlist: only Samples (and their subclasses), the rollout enums and references,
  straw's protocol records and classes passed to :func:`register_type` are stored or rebuilt;
- replay captures (R3 routes, score-centering top-k / top-p) always become typed tensor
  records that load lazily, are checked at publish time when a configuration says they are
  on, and are narrowed to compact dtypes only once they are known to be complete;
- rollout references nested in a value are dependency edges, and decode with the reading
  pool's mount path;
- the error texts the rollout contract names.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import os
import sys
from collections.abc import Collection, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np

from .. import codec as straw_codec
from .. import protocol
from ..codec import CyclicValue, NotASample, PayloadRef, UnknownClass, UnsupportedValue
from ..errors import InvalidReference, UnsupportedSchema
from ..protocol import Publication, RecordSetRef
from ..store import ReadSession, SharedFilesystemStore
from ..tensor import TensorRef
from . import sample as sample_module
from .sample import REPLAY_FIELDS, Sample, SampleStatus

__all__ = ["STORE_CODECS", "SampleCodec", "decode_value", "register_type"]

#: The codecs every rollout store lists.
STORE_CODECS = ("bytes.v1", "json.v1", "sample.v1", "tensor.v1")

C = TypeVar("C", bound=type)


def register_type(cls: C, *, dependency_field: str | None = None, root_field: str | None = None) -> C:
    """Allow the rollout codec to store and rebuild ``cls`` (a dataclass or an Enum subclass).

    Usable as a decorator. ``dependency_field`` names a field holding a ``RecordSetRef`` that
    is stored as a dependency edge of the publication (retaining the outer publication keeps
    it); ``root_field`` names a field set to the reading pool's mount path on load. Sample
    subclasses need no call: they register when the class is created.
    """
    if not isinstance(cls, type) or not (issubclass(cls, enum.Enum) or dataclasses.is_dataclass(cls)):
        raise TypeError(f"register_type() takes a dataclass or an Enum subclass, got {cls!r}")
    if "<" in cls.__qualname__:
        raise TypeError(
            f"{cls.__module__}.{cls.__qualname__} is defined inside a function; define it at module level"
        )
    names = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    for what, field in (("dependency_field", dependency_field), ("root_field", root_field)):
        if field is not None and field not in names:
            raise ValueError(f"register_type(): {what} {field!r} is not a field of {cls.__qualname__}")
    sample_module._register(cls, dependency_field=dependency_field, root_field=root_field)
    return cls


# straw's protocol records may appear in rollout values as data (receipts, leases, references).
_PROTOCOL_NAMES = frozenset(
    f"{cls.__module__}:{cls.__qualname__}"
    for cls in (
        protocol.SegmentRef,
        protocol.RecordRef,
        protocol.RecordSetRef,
        protocol.TaskSpec,
        protocol.Lease,
        protocol.CommitReceipt,
    )
)
_cache: dict[str, Any] = {"version": -1}


def _tables() -> tuple[frozenset[str], dict[type, str], dict[type, str]]:
    """(allowed class names, dependency fields, root fields), rebuilt when a type registers."""
    if _cache["version"] != sample_module._VERSION[0]:
        _cache["names"] = frozenset(sample_module._TYPES) | _PROTOCOL_NAMES
        _cache["edges"] = dict(sample_module._EDGES)
        _cache["roots"] = dict(sample_module._ROOTS)
        _cache["version"] = sample_module._VERSION[0]
    return _cache["names"], _cache["edges"], _cache["roots"]


# --------------------------------------------------------------------------- replay fields

_FINISHED = (SampleStatus.COMPLETED, SampleStatus.TRUNCATED)
_SCALARS = frozenset({type(None), bool, int, float, str, bytes})
_WALK_DEPTH_MAX = 100  # deeper values are left to straw.codec, which refuses them


def _narrow_dtype(field: str) -> np.dtype[Any]:
    return np.dtype(np.float32) if field.endswith("_log_probs") else np.dtype(np.int32)


def _is_array(value: Any) -> bool:
    return isinstance(value, np.ndarray) or (
        type(value).__module__.startswith("torch") and type(value).__name__ in ("Tensor", "Parameter")
    )


def _shape(value: Any) -> tuple[int, ...] | None:
    if isinstance(value, (np.ndarray, TensorRef)):
        return tuple(value.shape)
    if type(value).__module__.startswith("torch") and hasattr(value, "shape"):
        return tuple(int(n) for n in value.shape)
    return None


def _values(value: Any) -> np.ndarray[Any, Any]:
    """A replay capture's values as NumPy (small fields only: offsets)."""
    if isinstance(value, TensorRef):
        return value.numpy()
    if isinstance(value, np.ndarray):
        return value
    return np.asarray(value.detach().cpu().numpy())


def _shallow_copy(sample: Sample) -> Sample:
    """``copy.copy`` of a sample; for the exact ``Sample`` class its attribute dict is copied
    directly (what copy.copy does for it, without the pickle-protocol detour, per sample)."""
    if type(sample) is not Sample:
        return copy.copy(sample)  # a subclass may define its own copying
    out = object.__new__(Sample)
    out.__dict__.update(sample.__dict__)
    return out


class _SamplePrep:
    """Checks and converts one sample's replay captures; the result is a shallow copy if needed."""

    def __init__(self, sample: Sample, config: Any, views: dict[int, Any]) -> None:
        self.sample = sample
        self.config = config
        self.fields: dict[str, Any] = {}
        self.lists: set[str] = set()
        self.validated: set[str] = set()
        self.viewed = False
        for name in REPLAY_FIELDS:
            value = getattr(sample, name, None)
            if value is not None and _is_array(value):
                # A replay capture is its own typed record even when the same tensor object also
                # appears elsewhere in the value as a plain tensor: a view (no bytes copied) gives
                # it an identity of its own for the encoder's aliasing.
                found = views.get(id(value))
                if found is None:
                    found = views[id(value)] = (value, value[...])
                value = found[1]  # (the original stays referenced, so its id is not reused)
                self.viewed = True
            elif type(value) in (list, tuple):
                try:
                    value = np.asarray(value)
                except ValueError as error:
                    raise ValueError(
                        f"Replay field {name} of sample {sample.index} is not a rectangular array: {error}"
                    ) from None
                self.lists.add(name)
            self.fields[name] = value

    def run(self) -> Sample:
        config = self.config
        if config is not None and self.sample.status in _FINISHED:
            if getattr(config, "use_rollout_routing_replay", False):
                self.check_routes()
            if getattr(config, "use_score_centering", False):
                if config.rollout_top_p < 1:
                    self.check_top_p()
                else:
                    self.check_top_k(config.score_centering_top_k)
        # (A field that is None was None on the sample too: nothing to set.)
        changed = (
            {name: value for name, value in self.fields.items() if value is not None}
            if self.lists or self.validated or self.viewed
            else {}
        )
        for name in self.lists:
            array = self.fields[name]
            if name in self.validated or array.size == 0:
                narrowed = array.astype(_narrow_dtype(name))
                # Log-probs are float32 by design; ids that do not fit int32 keep their own dtype.
                fits = narrowed.dtype.kind == "f" or array.size == 0 or np.array_equal(narrowed, array)
                changed[name] = narrowed if fits else array
        if not changed:
            return self.sample
        out = _shallow_copy(self.sample)
        for name, value in changed.items():
            object.__setattr__(out, name, value)
        if self.validated:
            earlier = set(getattr(self.sample, "_replay_validated", ()) or ())
            object.__setattr__(out, "_replay_validated", tuple(sorted(self.validated | earlier)))
        return out

    def check_routes(self) -> None:
        sample = self.sample
        routes = self.fields["rollout_routed_experts"]
        if routes is None:
            return
        shape = _shape(routes)
        rows = shape[0] if shape else 0
        expected = len(sample.tokens) - 1
        if rows == expected:
            self.validated.add("rollout_routed_experts")
            return
        mask = sample.loss_mask
        if mask is not None and len(mask) > 0 and not any(mask):
            return  # a fully masked sample is never trained on; its routes may be anything
        raise ValueError(
            f"Rollout routed experts of sample {sample.index} have {rows} rows; "
            f"expected len(tokens) - 1 = {expected}"
        )

    def invalid(self, why: str) -> ValueError:
        return ValueError(f"Score-centering data of sample {self.sample.index} is invalid: {why}")

    def check_top_k(self, k: int) -> None:
        length = self.sample.response_length
        names = ("rollout_topk_token_ids", "rollout_topk_log_probs")
        ids, log_probs = (self.fields[n] for n in names)
        if ids is None and log_probs is None:
            if length == 0:
                self.fields[names[0]] = np.zeros((0, k), dtype=np.int32)
                self.fields[names[1]] = np.zeros((0, k), dtype=np.float32)
                self.lists.update(names)
                self.validated.update(names)
            return
        for name, value in zip(names, (ids, log_probs), strict=True):
            if value is None:
                raise self.invalid(f"{name} is missing")
            if _shape(value) != (length, k):
                raise self.invalid(
                    f"{name} has shape {_shape(value)}; expected (response_length, k) = ({length}, {k})"
                )
        self.validated.update(names)

    def check_top_p(self) -> None:
        length = self.sample.response_length
        names = ("rollout_top_p_token_ids", "rollout_top_p_token_offsets", "rollout_top_p_log_probs")
        ids, offsets, log_probs = (self.fields[n] for n in names)
        if ids is None and offsets is None and log_probs is None:
            if length == 0:
                self.fields.update(
                    zip(
                        names,
                        (np.zeros(0, np.int32), np.zeros(1, np.int32), np.zeros(0, np.float32)),
                        strict=True,
                    )
                )
                self.lists.update(names)
                self.validated.update(names)
            return
        missing = [n for n, v in zip(names, (ids, offsets, log_probs), strict=True) if v is None]
        if missing:
            raise self.invalid(f"{', '.join(missing)} missing while the others are set")
        shapes = [_shape(v) for v in (ids, offsets, log_probs)]
        sizes = [shape[0] for shape in shapes if shape is not None and len(shape) == 1]
        if len(sizes) != 3:
            raise self.invalid(f"top-p ids, offsets and log-probs must be 1-D, got shapes {shapes}")
        id_count, offset_count, log_prob_count = sizes
        if offset_count != length + 1:
            raise self.invalid(
                f"{names[1]} has {offset_count} entries; expected response_length + 1 = {length + 1}"
            )
        values = _values(offsets)
        if values[0] != 0 or bool(np.any(np.diff(values) < 0)):
            raise self.invalid("top-p offsets must start at 0 and never decrease")
        total = int(values[-1])
        if id_count != total or log_prob_count != total:
            raise self.invalid(
                f"the last offset is {total}, but there are {id_count} ids and {log_prob_count} log-probs"
            )
        self.validated.update(names)


class _Prepared:
    """A value with its Samples' replay captures converted and checked, and its token count."""

    def __init__(self, value: Any, config: Any) -> None:
        self.config = config
        self.tokens = 0
        self.memo: dict[int, Any] = {}
        self.active: set[int] = set()
        self.views: dict[int, Any] = {}  # id of a replay tensor -> (it, its view), shared by all samples
        self.value = self.walk(value, 0)

    def walk(self, value: Any, depth: int) -> Any:
        kind = type(value)
        if kind in _SCALARS or depth > _WALK_DEPTH_MAX:
            return value
        key = id(value)
        if key in self.memo:
            return self.memo[key]
        if key in self.active:
            return value  # a cycle: straw.codec reports it with its path
        if isinstance(value, Sample):
            out: Any = _SamplePrep(value, self.config, self.views).run()
            self.tokens += len(value.tokens)
        elif kind is list or kind is tuple:
            if set(map(type, value)) <= _SCALARS:
                return value
            self.active.add(key)
            items = [self.walk(item, depth + 1) for item in value]
            self.active.discard(key)
            changed = any(a is not b for a, b in zip(items, value, strict=True))
            out = (items if kind is list else tuple(items)) if changed else value
        elif kind is dict:
            self.active.add(key)
            pairs = {k: self.walk(v, depth + 1) for k, v in value.items()}
            self.active.discard(key)
            out = pairs if any(pairs[k] is not v for k, v in value.items()) else value
        else:
            return value
        self.memo[key] = out
        return out


# --------------------------------------------------------------------------- the codec


def _translate(error: Exception) -> Exception:
    if isinstance(error, UnsupportedValue):
        return TypeError(f"Unsupported durable Sample field type: {error.type_name} at {error.path}")
    if isinstance(error, CyclicValue):
        return TypeError(f"Cyclic custom fields are not supported by the durable Sample codec: {error.path}")
    return error


def _lazy_replay(kind: str, node: str) -> bool:
    """Materialise plain tensors and arrays; keep nested TensorRefs and replay fields lazy."""
    return node != "tref" and kind not in REPLAY_FIELDS


def decode_value(
    ref: RecordSetRef,
    *,
    reader: ReadSession | SharedFilesystemStore | None = None,
    root: str = "",
    selection: Mapping[Any, Sequence[int] | None] | None = None,
) -> Any:
    """Decode a rollout publication (the codec's read path, also used by references)."""
    if not isinstance(ref, RecordSetRef):
        raise TypeError(f"expected a RecordSetRef, got {type(ref).__name__}")
    names, _, roots = _tables()
    try:
        return straw_codec.load(
            PayloadRef(ref, root),
            reader=reader,
            materialize=_lazy_replay,
            select=selection,
            classes=names,
            root_fields=roots,
        )
    except UnknownClass as error:
        raise UnsupportedSchema(
            f"Unknown rollout type: {error.class_name}; "
            "import the module that defines it or register_type() it"
        ) from error
    except NotASample as error:
        raise UnsupportedSchema("Expected one sample.v1 collection record") from error


class SampleCodec:
    """Publishes and loads rollout values through one store (docs/ROLLOUT.md, "The codec")."""

    def __init__(self, store: SharedFilesystemStore, *, config: Any = None) -> None:
        if sys.byteorder != "little":
            raise UnsupportedSchema("Version 1 tensor codec requires a little-endian host")
        if not isinstance(store, SharedFilesystemStore):
            raise TypeError(f"SampleCodec takes a SharedFilesystemStore, got {type(store).__name__}")
        if "sample.v1" not in store.codecs or "tensor.v1" not in store.codecs:
            raise ValueError("SampleCodec requires explicit sample.v1 and tensor.v1 store codecs")
        self.store = store
        self.config = config

    def __repr__(self) -> str:
        return f"SampleCodec({self.store!r})"

    def _encode(self, values: Sequence[Any], metadata: Any, single: bool = False) -> list[Publication]:
        prepared = [_Prepared(value, self.config) for value in values]
        names, edges, _ = _tables()
        try:
            return straw_codec.encode_publications(
                self.store,
                [p.value for p in prepared],
                names=["sample"] if single else None,
                metadata=metadata,
                tokens=[p.tokens for p in prepared],
                dependency_fields=edges,
                classes=names,
            )
        except (UnsupportedValue, CyclicValue) as error:
            raise _translate(error) from error

    def publish(
        self,
        value: Any,
        *,
        submission_id: str,
        metadata: Mapping[str, Any] | None = None,
        owned: Collection[RecordSetRef] = (),
    ) -> RecordSetRef:
        """Publish one value as one publication (one durable write); returns its reference.

        Dependencies of the value found in ``owned`` are kept alive by an owner until the
        publication is adopted (the store's ``owned_dependencies``), so they are not staged.
        """
        if metadata is not None and not isinstance(metadata, Mapping):
            raise TypeError(f"metadata= is a mapping, got {type(metadata).__name__}")
        (publication,) = self._encode([value], metadata, single=True)
        records = publication.records
        dependencies = [d for d in publication.dependencies if isinstance(d, RecordSetRef)]
        return self.store.publish(
            records,
            submission_id=submission_id,
            dependencies=dependencies,
            owned_dependencies=[d for d in dependencies if d in owned],
        )

    def publish_many(
        self,
        values: Sequence[Any],
        *,
        submission_ids: Sequence[str],
        metadata: Mapping[str, Any] | Sequence[Mapping[str, Any] | None] | None = None,
    ) -> list[RecordSetRef]:
        """Publish values, one publication each, in as few durable writes as the store allows.

        Everything is encoded before anything is written. Write ``i`` carries the submission
        id ``bundle:<first id>:part:<index of its first value>``, so a retry with the same ids
        and content returns the same references.
        """
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
            raise TypeError(f"publish_many takes a sequence of values, got {type(values).__name__}")
        if isinstance(submission_ids, str) or not isinstance(submission_ids, Sequence):
            raise TypeError("submission_ids= is a sequence of strings, one per value")
        if len(submission_ids) != len(values):
            raise ValueError(f"{len(submission_ids)} submission ids for {len(values)} values")
        if not all(isinstance(s, str) and s for s in submission_ids):
            raise ValueError("submission ids are non-empty strings")
        if not values:
            return []
        publications = self._encode(values, metadata)
        limit = self.store.max_records_per_write
        refs: list[RecordSetRef] = []
        start = 0
        while start < len(publications):
            stop, records = start, 0
            while stop < len(publications) and (
                stop == start or records + len(publications[stop].records) + 1 <= limit
            ):
                records += len(publications[stop].records) + 1  # the records and their manifest
                stop += 1
            part = f"bundle:{submission_ids[0]}:part:{start}"
            refs.extend(self.store.publish_many(publications[start:stop], submission_id=part))
            start = stop
        return refs

    def load(
        self,
        ref: RecordSetRef,
        *,
        reader: ReadSession | SharedFilesystemStore | None = None,
        selection: Mapping[Any, Sequence[int] | None] | None = None,
    ) -> Any:
        """The value of a publication of this pool; replay fields and nested tensors stay lazy."""
        if not isinstance(ref, RecordSetRef):
            raise TypeError(f"SampleCodec.load takes a RecordSetRef, got {type(ref).__name__}")
        run = ref.manifest.segment.run_id
        if reader is None:
            if run == self.store.run_id:
                return decode_value(ref, reader=self.store, selection=selection)
            with ReadSession(self.store.backend, run) as session:
                return decode_value(ref, reader=session, selection=selection)
        if isinstance(reader, SharedFilesystemStore):
            root, reader_run = str(reader.backend.root), reader.run_id
        elif isinstance(reader, ReadSession):
            root, reader_run = reader.root, reader.run_id
        else:
            raise TypeError(
                f"reader= is a ReadSession or a SharedFilesystemStore, got {type(reader).__name__}"
            )
        if reader_run != run or not _same_path(root, str(self.store.backend.root)):
            raise InvalidReference("Sample reader belongs to a different storage root or run")
        return decode_value(ref, reader=reader, selection=selection)


def _same_path(a: str, b: str) -> bool:
    return a == b or os.path.realpath(a) == os.path.realpath(b)
