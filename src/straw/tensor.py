"""Tensors as verified, lazily loaded records (API.md section 6; docs/FORMAT.md section 10).

A tensor is one record with codec ``tensor.v1``: the payload is the tensor's raw
C-contiguous little-endian bytes, written straight from its memory, and the metadata
``{"tensor": {"dtype", "shape", "kind"}}`` describes it. The store's per-chunk checksums
make row slices cheap: ``ref[a:b]`` reads and verifies only the chunks covering those
rows. A full ``load`` allocates the result tensor first and reads into its storage.

A :class:`TensorRef` is a small frozen value with no file handle. It carries the mount path
of the pool it was written to or read from (``root``, a hint outside its identity), so a
process that mounts the pool at the same path reads it with no setup. ``reader=`` (a read
session or a store) names the pool explicitly; a pool mounted at another path is found
through :func:`attach` or the ``STRAW_POOL_ROOTS`` environment variable
(``os.pathsep``-separated), which remap it.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import sys
import threading
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._fs import posix
from .backend import FilesystemBackend
from .errors import CorruptData, InvalidReference, StorageUnavailable, UnsupportedSchema
from .limits import (
    ATTACHED_POOLS_MAX,
    CHUNK_BYTES,
    KIND_BYTES_MAX,
    TENSOR_DESCRIPTIONS_CACHED,
    TENSOR_DIMS_MAX,
    WRITERS_CACHED_MAX,
)
from .protocol import Record, RecordRef, RecordSetRef, decode
from .store import POOL_MARKER, LiveSessions, ReadSession, SharedFilesystemStore

__all__ = [
    "CHUNK_BYTES",
    "DTYPES",
    "POOL_ROOTS_ENV",
    "TENSOR_CODEC",
    "TensorRef",
    "attach",
    "detach",
    "publish_tensors",
    "release_tensor_publications",
    "tensor_record",
]
# CHUNK_BYTES (from straw.limits) is re-exported: the payload bytes one stored checksum covers,
# so a row slice reads and verifies whole chunks of it (informative; the store decides).

#: Codec name of tensor records (docs/FORMAT.md section 10).
TENSOR_CODEC = "tensor.v1"

#: Environment variable naming pool mount paths a process may read tensors from.
POOL_ROOTS_ENV = "STRAW_POOL_ROOTS"

#: Storage dtype (little-endian) of every supported element type. bfloat16 has no NumPy
#: dtype: its bytes travel as 16-bit integers and PyTorch reinterprets them.
_STORAGE: dict[str, np.dtype[Any]] = {
    "uint8": np.dtype("u1"),
    "int8": np.dtype("i1"),
    "int16": np.dtype("<i2"),
    "int32": np.dtype("<i4"),
    "int64": np.dtype("<i8"),
    "float16": np.dtype("<f2"),
    "bfloat16": np.dtype("<i2"),
    "float32": np.dtype("<f4"),
    "float64": np.dtype("<f8"),
    "bool": np.dtype("?"),
}
DTYPES = tuple(_STORAGE)
_NUMPY_NAMES = {dtype.newbyteorder("="): name for name, dtype in _STORAGE.items() if name != "bfloat16"}


# --------------------------------------------------------------------------- pools of this process


class _Pool:
    """One attached pool: its backend and a read session per (thread, run)."""

    def __init__(self, backend: FilesystemBackend) -> None:
        self.backend = backend
        self.root = str(backend.root)
        self._local = threading.local()
        self._sessions = LiveSessions()

    def session(self, run_id: str) -> ReadSession:
        sessions: dict[str, ReadSession] | None = getattr(self._local, "sessions", None)
        if sessions is None:
            sessions = self._local.sessions = {}
        session = sessions.get(run_id)
        if session is None or session.forked:  # a forked child reads through sessions of its own
            session = sessions[run_id] = self._sessions.add(ReadSession(self.backend, run_id))
        return session

    def holds(self, writer: str) -> bool:
        return posix.isdir(os.path.join(self.root, "raw", writer))

    def close(self) -> None:
        for session in self._sessions.members():
            session.close()


_pools: dict[str, _Pool] = {}  # oldest attached first
_kept: set[str] = set()  # roots attach() or STRAW_POOL_ROOTS named: never forgotten on their own
_writers: dict[str, _Pool] = {}  # writer id -> the attached pool holding its directory
_pools_lock = threading.Lock()
_env_seen: list[str | None] = [None]


def attach(pool: SharedFilesystemStore | FilesystemBackend | str | os.PathLike[str]) -> None:
    """Let references of this process read from ``pool`` (a store, a backend or a mount path).

    Attaching opens nothing; reads open the packs they need. The first attachment of a root
    wins: a later store on the same root reuses the attached pool. A pool attached here (or
    named in STRAW_POOL_ROOTS) stays attached until :func:`detach`; pools attached on their
    own (a reference's root, a store passed as ``reader=``) are at most
    ``ATTACHED_POOLS_MAX``, the least recently attached forgotten first.
    """
    _attach(pool, kept=True)


def _attach(pool: SharedFilesystemStore | FilesystemBackend | str | os.PathLike[str], *, kept: bool) -> _Pool:
    """The attached pool of ``pool``'s root, attached now if it is not (``kept``: for good)."""
    if isinstance(pool, SharedFilesystemStore):
        backend = pool.backend
    elif isinstance(pool, FilesystemBackend):
        backend = pool
    else:
        backend = FilesystemBackend(pool)
    root = str(backend.root)
    found = _pools.get(root)
    if found is not None and (not kept or root in _kept):
        return found
    with _pools_lock:
        if kept:
            _kept.add(root)
        found = _pools.get(root)
        if found is not None:
            return found
        found = _pools[root] = _Pool(backend)
        # Forgetting a pool closes nothing here: a read in another thread may be using its
        # descriptors. Its sessions close them once no read holds them (their finalizers).
        automatic = [r for r in _pools if r not in _kept]
        for old in automatic[: max(0, len(automatic) - ATTACHED_POOLS_MAX)]:
            _forget_locked(old)
        return found


def _forget_locked(root: str) -> _Pool | None:
    """Drop a pool from the registry (``_pools_lock`` held), with the writers found in it."""
    pool = _pools.pop(root, None)
    _kept.discard(root)
    for writer in [w for w, p in _writers.items() if p is pool]:
        del _writers[writer]
    return pool


def detach(root: str | os.PathLike[str]) -> None:
    """Forget an attached pool and close the descriptors its read sessions hold."""
    key = os.path.abspath(os.fspath(root))
    with _pools_lock:
        pool = _forget_locked(key)
    if pool is not None:
        pool.close()


def _attach_environment() -> None:
    value = os.environ.get(POOL_ROOTS_ENV)
    if value == _env_seen[0]:
        return
    _env_seen[0] = value
    for root in (value or "").split(os.pathsep):
        if root:
            _attach(root, kept=True)


def _remember_writer(writer: str, pool: _Pool) -> _Pool:
    with _pools_lock:
        if len(_writers) >= WRITERS_CACHED_MAX:
            _writers.clear()
        _writers[writer] = pool
    return pool


def _root_pool(root: str) -> _Pool | None:
    """The pool mounted at a reference's own ``root``, attached on first use; None if no pool is there."""
    pool = _pools.get(root)
    if pool is not None:
        return pool
    if not os.path.isabs(root) or not posix.exists(os.path.join(root, POOL_MARKER)):
        return None
    return _attach(root, kept=False)


def _pool_of(ref: RecordRef, root: str = "") -> _Pool:
    """Which pool holds ``ref`` (docs/FORMAT.md section 10.3): the reference's own mount path
    first, then the pools attached or listed in STRAW_POOL_ROOTS (a remap)."""
    segment = ref.segment
    parts = segment.path.split("/") if isinstance(segment.path, str) else []
    writer = parts[1] if len(parts) == 3 else ""
    pool = _writers.get(writer)
    if pool is not None and _pools.get(pool.root) is pool:  # (not one forgotten since)
        return pool
    own = _root_pool(root) if root else None
    if own is not None and writer and own.holds(writer):
        return _remember_writer(writer, own)
    _attach_environment()
    pools = list(_pools.values())
    holding = [p for p in pools if writer and p.holds(writer)]
    if holding:
        return _remember_writer(writer, holding[0])
    if own is not None:
        return own  # the pack is not visible yet on this client: the read retries, then reports it
    if len(pools) == 1:
        return pools[0]  # likewise
    if not pools:
        where = f"its pool {root!r} is not mounted here; " if root else ""
        raise InvalidReference(
            f"no pool in this process can read {segment.path} of run {segment.run_id!r}: {where}"
            f"pass reader=, call straw.tensor.attach(<pool mount path>) or set {POOL_ROOTS_ENV}"
        )
    raise InvalidReference(
        f"none of the attached pools ({', '.join(sorted(_pools))}) holds {segment.path}; "
        "attach the pool that does or pass reader="
    )


def reader_for(
    ref: RecordRef, reader: ReadSession | SharedFilesystemStore | None = None, root: str = ""
) -> ReadSession:
    """The read session for ``ref``: ``reader`` itself, else one of the pool at ``root`` (the
    reference's mount hint) or of an attached pool."""
    if isinstance(reader, ReadSession):
        return reader
    if isinstance(reader, SharedFilesystemStore):
        return _attach(reader, kept=False).session(reader.run_id)  # refuses other runs
    if reader is not None:
        raise TypeError(
            f"reader must be a ReadSession or a SharedFilesystemStore, got {type(reader).__name__}"
        )
    if not isinstance(ref, RecordRef):
        raise InvalidReference(f"expected a RecordRef, got {type(ref).__name__}")
    if not isinstance(root, str):
        raise InvalidReference(f"a reference's root is a mount path, got {type(root).__name__}")
    return _pool_of(ref, root).session(ref.segment.run_id)


@contextlib.contextmanager
def naming(what: str) -> Iterator[None]:
    """Re-raise a storage failure with the reference it was reading in the message."""
    try:
        yield
    except StorageUnavailable as error:
        raise type(error)(f"{what} cannot be read: {error}") from error


# --------------------------------------------------------------------------- encoding


def _torch() -> Any:
    try:
        import torch
    except ImportError:
        raise UnsupportedSchema(
            "this needs PyTorch, which is not installed (pip install 'straw[torch]'); "
            "TensorRef.numpy() reads tensors without it"
        ) from None
    return torch


def is_torch_tensor(value: object) -> bool:
    """Whether ``value`` is a torch.Tensor, without importing torch when nobody else has."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def tensor_bytes(value: Any) -> tuple[memoryview, str, tuple[int, ...]]:
    """A flat byte view of a NumPy array's or torch tensor's memory, its dtype name and shape.

    No copy for C-contiguous little-endian CPU input; other layouts are made contiguous
    (one copy), CUDA tensors are copied to the CPU. Unsupported dtypes raise UnsupportedSchema.
    """
    if sys.byteorder != "little":
        raise UnsupportedSchema("tensor.v1 stores little-endian bytes; this host is big-endian")
    if isinstance(value, np.ndarray):
        # (A native dtype is its own key; another byte order is looked up as native.)
        name = _NUMPY_NAMES.get(value.dtype) or _NUMPY_NAMES.get(value.dtype.newbyteorder("="))
        if name is None:
            raise UnsupportedSchema(
                f"NumPy dtype {value.dtype} is not supported (supported: {', '.join(DTYPES)})"
            )
        shape = _dims(value.shape)  # a tuple of ints
        native = value.dtype == _STORAGE[name]
        if native and type(value) is np.ndarray and value.size and value.flags.c_contiguous:
            return value.data.cast("B"), name, shape  # stored as it is: its own memory, flat
        array = np.ascontiguousarray(value, dtype=_STORAGE[name])
    elif is_torch_tensor(value):
        torch = sys.modules["torch"]
        name = str(value.dtype).removeprefix("torch.")
        if name not in _STORAGE:
            raise UnsupportedSchema(
                f"torch dtype {value.dtype} is not supported (supported: {', '.join(DTYPES)})"
            )
        if value.layout != torch.strided or value.is_quantized:
            raise UnsupportedSchema(f"only dense tensors are stored, got layout {value.layout}")
        tensor = value.detach()
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        tensor = tensor.contiguous()
        if name == "bfloat16":
            tensor = tensor.view(torch.int16)
        shape = _dims(tuple(int(n) for n in value.shape))
        array = tensor.numpy()
    else:
        raise UnsupportedSchema(f"expected a NumPy array or a torch.Tensor, got {type(value).__name__}")
    return array.reshape(-1).view(np.uint8).data, name, shape


def _dims(shape: tuple[int, ...]) -> tuple[int, ...]:
    if len(shape) > TENSOR_DIMS_MAX:
        raise UnsupportedSchema(f"tensor has {len(shape)} dimensions, at most {TENSOR_DIMS_MAX} are stored")
    return shape


def tensor_record(
    value: Any, record_id: str, *, kind: str | None = None, metadata: Mapping[str, Any] | None = None
) -> Record:
    """The ``tensor.v1`` record of one array or tensor, to publish with other records (its
    payload is a view of the tensor's memory; ``kind`` defaults to ``record_id``)."""
    return _tensor_record(value, record_id, record_id if kind is None else kind, metadata)[0]


def _tensor_record(
    value: Any, record_id: str, kind: str, metadata: Mapping[str, Any] | None = None
) -> tuple[Record, str, tuple[int, ...]]:
    """:func:`tensor_record` with the stored dtype name and shape."""
    _check_kind(kind)
    view, dtype, shape = tensor_bytes(value)
    meta: dict[str, Any] = dict(metadata or {})
    if "tensor" in meta:
        raise ValueError("metadata key 'tensor' is reserved for the tensor description")
    meta["tensor"] = {"dtype": dtype, "shape": list(shape), "kind": kind}
    return Record(record_id, view, TENSOR_CODEC, meta), dtype, shape


def _check_kind(kind: object) -> None:
    if not isinstance(kind, str) or not kind:
        raise ValueError(f"a tensor kind must be a non-empty string, got {kind!r}")
    if len(kind.encode("utf-8")) > KIND_BYTES_MAX:
        raise ValueError(f"tensor kind {kind[:40]!r}... is longer than {KIND_BYTES_MAX} bytes")


# --------------------------------------------------------------------------- decoding


def _describe(
    codec: str, metadata: Mapping[str, Any], length: int, record_id: str
) -> tuple[str, tuple[int, ...], str]:
    """Check a stored tensor record's description against its byte count: (dtype, shape, kind)."""
    if codec != TENSOR_CODEC:
        if codec.startswith("tensor."):
            raise UnsupportedSchema(
                f"record {record_id!r} has codec {codec!r}; this straw reads {TENSOR_CODEC}"
            )
        raise InvalidReference(f"record {record_id!r} is not a tensor (codec {codec!r})")
    info = metadata.get("tensor")
    if not isinstance(info, dict):
        raise CorruptData(f"tensor record {record_id!r} has no 'tensor' description in its metadata")
    dtype, shape, kind = info.get("dtype"), info.get("shape"), info.get("kind")
    if not isinstance(dtype, str) or dtype not in _STORAGE:
        raise UnsupportedSchema(
            f"tensor record {record_id!r} has dtype {dtype!r} (supported: {', '.join(DTYPES)})"
        )
    if (
        not isinstance(shape, list)
        or len(shape) > TENSOR_DIMS_MAX
        or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape)
    ):
        raise CorruptData(f"tensor record {record_id!r} has an invalid shape {shape!r}")
    if not isinstance(kind, str) or not kind:
        raise CorruptData(f"tensor record {record_id!r} has an invalid kind {kind!r}")
    expected = math.prod(shape) * _STORAGE[dtype].itemsize
    if expected != length:
        raise CorruptData(
            f"tensor record {record_id!r}: shape {shape} of {dtype} needs {expected} bytes, "
            f"the record stores {length}"
        )
    return dtype, tuple(shape), kind


def _located_description(located: Any) -> tuple[str, tuple[int, ...], str, int]:
    """``_describe`` of a located record (``ReadSession.locate``), and its byte count, from its
    index row: the description's canonical bytes are decoded and checked once per distinct
    description and byte count (``_description``), not once per tensor read. Anything that
    does not check out there is described from the whole entry, which raises what it raises."""
    codec, length, stored = located.index.stored(located.ordinal, "tensor")
    if type(stored) is bytes:
        # Described again below from the whole entry, whose errors name the record.
        with contextlib.suppress(CorruptData, InvalidReference, UnsupportedSchema):
            return (*_description(codec, stored, length), length)
    entry = located.entry
    return (*_describe(entry.codec, entry.metadata, entry.length, entry.record_id), entry.length)


@functools.lru_cache(maxsize=TENSOR_DESCRIPTIONS_CACHED)
def _description(codec: str, stored: bytes, length: int) -> tuple[str, tuple[int, ...], str]:
    return _describe(codec, {"tensor": decode(stored)}, length, "")


@dataclass(frozen=True)
class TensorRef:
    """A published tensor: shape, dtype, byte count, kind and where its record is.

    Small and picklable (no file handle). ``record_set`` and ``ordinal`` name the publication
    it came from when known, so :meth:`share` writes nothing. ``root`` is the mount path of
    the pool it was written to or read from: where a process looks first (it is not part of
    the reference's identity, and the RecordRef inside holds no absolute path).
    """

    record_ref: RecordRef
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    kind: str
    record_set: RecordSetRef | None = None
    ordinal: int = 0
    root: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if type(self.shape) is not tuple:  # a hand-made reference may pass a list
            object.__setattr__(self, "shape", tuple(self.shape))

    def __repr__(self) -> str:
        return (
            f"TensorRef(kind={self.kind!r}, dtype={self.dtype}, shape={list(self.shape)}, "
            f"record={self.record_ref.segment.path}#{self.record_ref.ordinal})"
        )

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a scalar tensor")
        return self.shape[0]

    @property
    def what(self) -> str:
        """How error messages name this reference."""
        return f"tensor {self.kind!r} (record {self.record_ref.ordinal} of {self.record_ref.segment.path})"

    # -- the peer's names -----------------------------------------------------------------

    @property
    def blob_set(self) -> RecordSetRef | None:
        """The publication this tensor came from (``record_set``), when known."""
        return self.record_set

    @property
    def blob_ordinal(self) -> int:
        """This tensor's ordinal in :attr:`blob_set` (``ordinal``)."""
        return self.ordinal

    @property
    def path(self) -> str:
        """The absolute path of the pack holding the tensor, in the pool this process reads it
        from (for tools; reads go through the store and verify every byte)."""
        return _pool_of(self.record_ref, self.root).backend.resolve(self.record_ref.segment.path)

    # -- checks ------------------------------------------------------------------------

    def _check(self, session: ReadSession) -> None:
        """Verify the stored record still describes this reference (index verified by the session)."""
        if self.dtype not in _STORAGE:
            raise UnsupportedSchema(f"{self.what}: dtype {self.dtype!r} is not supported")
        if math.prod(self.shape) * _STORAGE[self.dtype].itemsize != self.nbytes:
            raise CorruptData(
                f"Typed tensor reference {self.what}: shape {list(self.shape)} of {self.dtype} does not "
                f"make {self.nbytes} bytes (a damaged or edited reference)"
            )
        dtype, shape, _, length = _located_description(session.locate(self.record_ref))
        if (dtype, shape) != (self.dtype, self.shape) or length != self.nbytes:
            raise CorruptData(
                f"Typed tensor reference {self.what} says {self.dtype}{list(self.shape)} "
                f"({self.nbytes} bytes), the stored record holds {dtype}{list(shape)} "
                f"({length} bytes)"
            )

    # -- reads -------------------------------------------------------------------------

    def load(
        self, *, reader: ReadSession | SharedFilesystemStore | None = None, pin_memory: bool = False
    ) -> Any:
        """The whole tensor (CPU), verified. A large one shares the pack's pages copy-on-write
        (``ReadSession.read_mapped``); others, and ``pin_memory=True``, read into fresh storage."""
        torch = _torch()
        with naming(self.what):
            session = reader_for(self.record_ref, reader, self.root)
            self._check(session)
            mapped = None if pin_memory or not self.nbytes else session.read_mapped(self.record_ref)
            if mapped is not None:
                out = torch.from_numpy(np.frombuffer(mapped, dtype=_STORAGE[self.dtype]).reshape(self.shape))
                return out.view(torch.bfloat16) if self.dtype == "bfloat16" else out
            try:
                out = torch.empty(self.shape, dtype=getattr(torch, self.dtype), pin_memory=pin_memory)
            except RuntimeError as error:
                if not pin_memory:
                    raise
                raise ValueError(
                    f"pin_memory=True needs an accelerator PyTorch can pin for: {error}"
                ) from None
            if self.nbytes:
                storage = out.view(torch.int16) if self.dtype == "bfloat16" else out
                session.read_into(self.record_ref, storage.numpy().reshape(-1).view(np.uint8).data)
        return out

    def numpy(self, *, reader: ReadSession | SharedFilesystemStore | None = None) -> np.ndarray[Any, Any]:
        """The whole tensor as a NumPy array (no PyTorch needed; bfloat16 has no NumPy dtype)."""
        if self.dtype == "bfloat16":
            raise UnsupportedSchema(f"{self.what} is bfloat16, which NumPy lacks; use load()")
        with naming(self.what):
            session = reader_for(self.record_ref, reader, self.root)
            self._check(session)
            # Mapped pages, or memory of ordinary pages the read touches first (read_buffer says
            # why not np.empty).
            buffer = session.read_view(self.record_ref)
        return np.frombuffer(buffer, dtype=_STORAGE[self.dtype]).reshape(self.shape)

    def rows(
        self, start: int, stop: int, *, reader: ReadSession | SharedFilesystemStore | None = None
    ) -> Any:
        """Rows ``start:stop`` (clamped like Python slicing), reading only the chunks they touch."""
        return self._rows(slice(start, stop), reader)

    def __getitem__(self, rows: slice) -> Any:
        return self._rows(rows, None)

    def _rows(self, rows: object, reader: ReadSession | SharedFilesystemStore | None) -> Any:
        if not isinstance(rows, slice):
            raise TypeError(f"a TensorRef takes row slices ref[a:b], not {type(rows).__name__}")
        if rows.step not in (None, 1):
            raise ValueError(f"row slices take no step (got step {rows.step!r}); load() and slice the tensor")
        if not self.shape:
            raise ValueError(f"{self.what} is a scalar: it has no rows to slice")
        torch = _torch()
        start, stop, _ = rows.indices(self.shape[0])
        stop = max(start, stop)
        shape = (stop - start, *self.shape[1:])
        storage = _STORAGE[self.dtype]
        row_bytes = math.prod(self.shape[1:]) * storage.itemsize
        with naming(self.what):
            session = reader_for(self.record_ref, reader, self.root)
            self._check(session)
            if not row_bytes * (stop - start):
                return torch.empty(shape, dtype=getattr(torch, self.dtype))
            view = session.read_tensor_range(self.record_ref, start * row_bytes, stop * row_bytes)
        out = torch.from_numpy(np.frombuffer(view, dtype=storage).reshape(shape))
        return out.view(torch.bfloat16) if self.dtype == "bfloat16" else out

    # -- sharing and updates -----------------------------------------------------------------

    def share(self, store: SharedFilesystemStore, *, submission_id: str) -> tuple[RecordSetRef, int]:
        """A publication holding this tensor and its ordinal there, for use as a dependency.

        The publication it came from when known (checked readable through ``store``; nothing
        is written), else a new one-record set over the existing record (no tensor bytes copied).
        """
        _attach(store, kept=False)
        with naming(self.what):
            if self.record_set is not None:
                store.validate(self.record_set)
                return self.record_set, self.ordinal
            return store.record_set([self.record_ref], submission_id=submission_id), 0

    def updated(
        self,
        store: SharedFilesystemStore,
        replacement: Any,
        *,
        rows: Any = None,
        submission_id: str,
    ) -> TensorRef:
        """Publish a new tensor (same kind): ``replacement``, or this one with ``rows`` replaced.

        The original record is immutable and stays as it was.
        """
        if rows is None:
            value = replacement
        else:
            torch = _torch()
            value = self.load(reader=store)
            value[rows] = torch.as_tensor(replacement, dtype=value.dtype)
        return publish_tensors(store, {self.kind: value}, submission_id=submission_id)[0]

    # -- constructors --------------------------------------------------------------------------

    @classmethod
    def from_record_set(cls, store: SharedFilesystemStore, ref: RecordSetRef, ordinal: int = 0) -> TensorRef:
        """The tensor at ``ordinal`` of a verified record set."""
        if not isinstance(ref, RecordSetRef):
            raise InvalidReference(f"expected a RecordSetRef, got {type(ref).__name__}")
        _attach(store, kept=False)
        session = reader_for(ref.manifest, store)
        resolved = session.resolve(ref)
        if isinstance(ordinal, bool) or not isinstance(ordinal, int) or not 0 <= ordinal < len(resolved):
            raise InvalidReference(f"ordinal {ordinal!r} is not in a record set of {len(resolved)} records")
        return cls.from_located(resolved.record(ordinal), ref, ordinal, str(store.backend.root))

    @classmethod
    def from_record_set_many(
        cls, store: SharedFilesystemStore, ref: RecordSetRef, *, reader: ReadSession | None = None
    ) -> dict[int, TensorRef]:
        """Every tensor member of a record set by ordinal; other members are left out."""
        if not isinstance(ref, RecordSetRef):
            raise InvalidReference(f"expected a RecordSetRef, got {type(ref).__name__}")
        _attach(store, kept=False)
        session = reader_for(ref.manifest, reader if reader is not None else store)
        found = {}
        for ordinal, located in enumerate(session.resolve(ref).records):
            if located.codec.startswith("tensor."):
                found[ordinal] = cls.from_located(located, ref, ordinal, session.root)
        return found

    @classmethod
    def from_entry(
        cls, ref: RecordRef, entry: Any, record_set: RecordSetRef | None, ordinal: int, root: str = ""
    ) -> TensorRef:
        """A reference from a verified index entry (``ReadSession.locate(...).entry``)."""
        dtype, shape, kind = _describe(entry.codec, entry.metadata, entry.length, entry.record_id)
        return cls(ref, shape, dtype, entry.length, kind, record_set, ordinal, root)

    @classmethod
    def from_located(
        cls, located: Any, record_set: RecordSetRef | None, ordinal: int, root: str = ""
    ) -> TensorRef:
        """:meth:`from_entry` of a located record (``ReadSession.locate(...)``), without building
        its entry: the description comes from the index row (checked once per distinct one)."""
        dtype, shape, kind, length = _located_description(located)
        return cls(located.ref(), shape, dtype, length, kind, record_set, ordinal, root)


# --------------------------------------------------------------------------- publishing


def release_tensor_publications(store: SharedFilesystemStore, tensors: Iterable[TensorRef]) -> None:
    """End the staging of the publications that hold ``tensors`` (discarded results, docs/GC.md).

    Tensors that were shared into another publication keep that one staged; only the
    publications named by the refs are released.
    """
    refs: dict[tuple[str, int, int], RecordSetRef] = {}
    for tensor in tensors:
        if not isinstance(tensor, TensorRef):
            raise TypeError(f"release_tensor_publications takes TensorRef, got {type(tensor).__name__}")
        ref = tensor.record_set
        if ref is None:
            raise InvalidReference(
                f"tensor {tensor.kind!r} has no publication of its own (built from a record); "
                "release the record set that holds it instead"
            )
        key = (ref.manifest.segment.path, ref.manifest.segment.offset, ref.manifest.ordinal)
        refs[key] = ref
    if refs:
        store.release_publications(list(refs.values()))


def publish_tensors(
    store: SharedFilesystemStore,
    tensors: Mapping[str, Any],
    *,
    submission_id: str,
    metadata: Mapping[str, Any] | None = None,
) -> list[TensorRef]:
    """Publish tensors as one publication (mapping order); the name is each tensor's kind.

    Payloads are written from the tensors' own memory. ``metadata`` (ours, optional) is
    added to every record's metadata, e.g. the task and attempt a queue result belongs to.
    """
    if TENSOR_CODEC not in store.codecs:
        raise UnsupportedSchema(
            f"the store does not list codec {TENSOR_CODEC!r} (codecs: {', '.join(store.codecs)}); "
            f"open it with codecs=(..., {TENSOR_CODEC!r})"
        )
    if not isinstance(tensors, Mapping):
        raise TypeError(f"publish_tensors takes a mapping of name -> tensor, got {type(tensors).__name__}")
    records, described = [], []
    for name, value in tensors.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"tensor names must be non-empty strings, got {name!r}")
        record, dtype, shape = _tensor_record(value, name, name, metadata)
        records.append(record)
        described.append((dtype, shape, math.prod(shape) * _STORAGE[dtype].itemsize, name))
    ref = store.publish(records, submission_id=submission_id)
    _attach(store, kept=False)
    members = store.validate(ref)
    root = str(store.backend.root)
    return [
        TensorRef(member, shape, dtype, nbytes, kind, ref, ordinal, root)
        for ordinal, (member, (dtype, shape, nbytes, kind)) in enumerate(zip(members, described, strict=True))
    ]
