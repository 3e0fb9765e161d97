"""Verified reads of packs: every byte returned has matched its checksum.

A reader caches open file descriptors and parsed index frames (both bounded).
On a shared mount a cached descriptor can show a stale size or stale pages
after another client appended, so a short or mismatching read is retried once
on a freshly opened descriptor before it is reported (docs/DURABILITY.md A6).
"""

from __future__ import annotations

import contextlib
import mmap
import operator
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, NoReturn, TypeVar

import xxhash

from .._fs import posix
from ..backend import FilesystemBackend
from ..errors import CorruptData, InvalidReference, StorageUnavailable, UnsupportedSchema, invariant
from ..limits import (
    CHUNK_BYTES,
    INDEX_BYTES_MAX,
    INDEX_CACHE_ENTRIES_MAX,
    OPEN_PACKS_MAX,
    OPEN_PACKS_PROCESS_MAX,
    OPEN_PACKS_READER_MIN,
    PACK_BYTES_MAX,
    READ_MAPPING_BYTES_MIN,
    SHARED_INDEX_BYTES_MAX,
    WRITERS_CACHED_MAX,
)
from ..protocol import CHECKSUM_ALGORITHM, SEGMENT_FIELDS, SegmentRef, encode, unchecked
from . import frame

#: A writer directory's name under ``raw/`` and a pack's file name in it (FORMAT.md section 1).
WRITER_NAME = re.compile(r"[0-9a-f]{32}")
PACK_NAME = re.compile(r"[0-9a-f]{32}\.(pack|seg)")
_PATH = re.compile(r"raw/([0-9a-f]{32})/([0-9a-f]{32})\.(pack|seg)")


K = TypeVar("K")
V = TypeVar("V")


def _index_weight(index: frame.Index) -> int:
    """What a parsed index frame weighs in the caches bounded in entries (at least 1)."""
    return max(1, len(index))


class Bounded(Generic[K, V]):
    """A map whose items weigh at most ``limit()`` in all (each weighs 1 unless ``weight`` says
    otherwise), oldest first out; ``get(key, touch=True)`` makes an item the newest (least
    recently used first out). The bound is read on each insertion, so it is the named limit's
    current value; the newest item always stays. Not locked: see :class:`SharedMemo`."""

    def __init__(self, limit: Callable[[], int], weight: Callable[[V], int] | None = None) -> None:
        self._limit = limit
        self._weight = weight
        self._items: OrderedDict[K, V] = OrderedDict()
        #: Each item's weight as it was when it came (weighed once: what leaves is what came).
        self._weights: dict[K, int] = {}
        self._total = 0

    def get(self, key: K, *, touch: bool = False) -> V | None:
        found = self._items.get(key)
        if found is not None and touch:
            self._items.move_to_end(key)
        return found

    def put(self, key: K, value: V) -> None:
        self.put_all(((key, value),))

    def put_all(self, items: Iterable[tuple[K, V]]) -> None:
        weights, weight = self._weights, self._weight
        for key, value in items:
            if self._items.pop(key, None) is not None:
                self._total -= weights.pop(key, 1)
            self._items[key] = value
            if weight is None:
                self._total += 1  # (unweighted items keep no entry in ``weights``)
            else:
                weights[key] = weighed = weight(value)
                self._total += weighed
        limit = self._limit()
        while self._total > limit and len(self._items) > 1:
            dropped, _ = self._items.popitem(last=False)
            self._total -= weights.pop(dropped, 1)

    def clear(self) -> None:
        self._items.clear()
        self._weights.clear()
        self._total = 0


class SharedMemo(Generic[K, V]):
    """A process-wide :class:`Bounded` map of what verifying immutable bytes found, by their
    exact reference, shared by the threads of the process (each call takes its lock)."""

    def __init__(self, limit: Callable[[], int], weight: Callable[[V], int] | None = None) -> None:
        self._lock = threading.Lock()
        self._items: Bounded[K, V] = Bounded(limit, weight)

    def get(self, key: K) -> V | None:
        with self._lock:
            return self._items.get(key)

    def put(self, key: K, value: V) -> None:
        self.put_all(((key, value),))

    def put_all(self, items: Iterable[tuple[K, V]]) -> None:
        with self._lock:
            self._items.put_all(items)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()


#: What :class:`SharedIndexes` keeps of an index frame and of its SegmentRef: tuples of plain
#: values, which the cycle collector untracks (an object per entry was walked by every full
#: collection and, made by every publication, brought the next one sooner: issue 12).
_IndexRow = tuple[Any, ...]  # (submission_id, chunk_bytes, *rows): flat, as ``store._Resolved.row``
_SegmentKey = tuple[str, str, str, int, str, int, str, int]
#: Values in a :func:`segment_key`.
SEGMENT_KEY_FIELDS = len(SEGMENT_FIELDS)


#: A SegmentRef as a tuple of its plain values, in ``SEGMENT_FIELDS`` order (equal exactly when
#: the references are).
segment_key: Callable[[SegmentRef], _SegmentKey] = operator.attrgetter(*SEGMENT_FIELDS)


def segment_of_key(key: _SegmentKey) -> SegmentRef:
    """The SegmentRef ``segment_key`` gave ``key`` for (its values were checked when it was made)."""
    return unchecked(SegmentRef, dict(zip(SEGMENT_FIELDS, key, strict=True)))


def _row_bytes(row: frame.Row) -> int:
    """About what a row takes in memory (CPython's object sizes): the tuple and each of its
    items, an item shared with other rows counted in each. A function of the row's lengths
    only, so a frame weighs the same whenever it is weighed (``sys.getsizeof`` of a string
    grows once its UTF-8 form has been asked for)."""
    size = 56 + 8 * len(row)
    for item in row:
        kind = type(item)
        if kind is str:
            size += 49 + len(item)
        elif kind is bytes:
            size += 33 + len(item)
        else:
            size += 32  # a number, a flag or None
    return size


def _kept_bytes(kept: _IndexRow) -> int:
    """What a kept index frame weighs in SHARED_INDEX_BYTES_MAX: its rows times the mean size
    of its first and last one (a frame's rows are alike: its records, then its manifests), so
    weighing a frame of thousands of entries costs two rows' worth of work."""
    count = len(kept) - 2
    if count <= 0:
        return 1
    return count * (_row_bytes(kept[2]) + _row_bytes(kept[-1])) // 2


class SharedIndexes:
    """A :class:`SharedMemo` of parsed index frames by SegmentRef, kept as plain tuples (an
    :class:`frame.Index` is rebuilt on each ``get``, sharing the row tuples), bounded in
    their estimated bytes."""

    def __init__(self, limit: Callable[[], int]) -> None:
        self._items: SharedMemo[_SegmentKey, _IndexRow] = SharedMemo(limit, _kept_bytes)

    def get(self, segment: SegmentRef) -> frame.Index | None:
        found = self._items.get(segment_key(segment))
        return frame.Index.of_rows(found[0], found[1], found[2:]) if found is not None else None

    def holds(self, segment: SegmentRef) -> bool:
        """Whether the index of ``segment`` is here (nothing is built)."""
        return self._items.get(segment_key(segment)) is not None

    def put(self, segment: SegmentRef, index: frame.Index) -> None:
        self.put_rows(segment, index.submission_id, index.chunk_bytes, index.rows)

    def put_rows(
        self, segment: SegmentRef, submission_id: str, chunk_bytes: int, rows: Iterable[frame.Row]
    ) -> None:
        self._items.put(segment_key(segment), (submission_id, chunk_bytes, *rows))

    def clear(self) -> None:
        self._items.clear()


#: Parsed index frames that any store of this process wrote or verified, by SegmentRef.
#:
#: A SegmentRef names an immutable extent by path, offset, size and checksum (I1), so an
#: index verified once, or built by the writer that just made it durable, describes those
#: bytes for every store of the process. A coordinator validating a result that a worker
#: thread of the same process published then skips re-reading and re-parsing it. Only
#: readers made with ``shared=True`` consult it (validation, which returns no bytes).
SHARED_INDEXES = SharedIndexes(lambda: SHARED_INDEX_BYTES_MAX)


def remember_written(segment: SegmentRef, submission_id: str, rows: Sequence[frame.Row]) -> None:
    """Share the index of an extent this process just made durable (the writer calls it).

    The writer calls it only with rows whose metadata part was parsed from the metadata's
    canonical text (``frame.text_pairs``): they equal what reading the index frame back gives.
    """
    SHARED_INDEXES.put_rows(segment, submission_id, CHUNK_BYTES, rows)


@dataclass
class _File:
    fd: int
    header: frame.PackHeader


Data = bytes | bytearray
T = TypeVar("T")


def _checked(data: Data, size: int, offset: int, relative: str, check: Callable[[Data], T]) -> T:
    if len(data) != size:
        raise CorruptData(
            f"truncated: {relative} ends before byte {offset + size} (read {len(data)} of {size})"
        )
    return check(data)


class _CachedDescriptors:
    """How many pack descriptors the readers of this process keep cached in all (D5.2c)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.count = 0

    def change(self, delta: int) -> None:
        """Count ``delta`` more (or fewer) cached descriptors."""
        with self._lock:
            self.count += delta
            invariant(self.count >= 0, "a reader gave up a descriptor it never counted")

    def after_fork(self) -> None:
        """In a forked child: a lock another thread of the parent held stays held; a new one."""
        self._lock = threading.Lock()


CACHED_DESCRIPTORS = _CachedDescriptors()
os.register_at_fork(after_in_child=CACHED_DESCRIPTORS.after_fork)


def descriptor_budget() -> int:
    """D5.2c: the most pack descriptors the readers of this process keep cached together."""
    limit = posix.descriptor_limit()
    budget = OPEN_PACKS_PROCESS_MAX if limit is None else min(OPEN_PACKS_PROCESS_MAX, limit // 2)
    return max(budget, OPEN_PACKS_READER_MIN)


class PackReader:
    """Reads index frames and payloads of one run's packs, verifying checksums."""

    def __init__(
        self, backend: FilesystemBackend, run_id: str, max_open: int = OPEN_PACKS_MAX, *, shared: bool = False
    ) -> None:
        self.backend = backend
        # Also answer from SHARED_INDEXES: only for callers that return no bytes (validation),
        # since reads promise every index and payload byte was checked on disk.
        self.shared = shared
        self.run_id = run_id
        self.run_tag = frame.run_tag(run_id)
        self.max_open = max_open
        self._files: OrderedDict[str, _File] = OrderedDict()
        #: Parsed index frames, least recently used first out, bounded in entries.
        self._indexes: Bounded[tuple[str, int, str], frame.Index] = Bounded(
            lambda: INDEX_CACHE_ENTRIES_MAX, _index_weight
        )
        self._checked: SegmentRef | None = None
        self._writers: set[str] = set()  # writer directories seen in this pool (a cache)

    def close(self) -> None:
        while self._files:
            _, handle = self._files.popitem()
            self._close(handle)
        self._indexes.clear()

    @staticmethod
    def _close(handle: _File) -> None:
        """Close a descriptor this reader had cached (and no longer does)."""
        CACHED_DESCRIPTORS.change(-1)
        posix.close_quietly(handle.fd)

    # -- reference checks ----------------------------------------------------------

    def check_segment(self, segment: SegmentRef) -> None:
        """Reject a reference that is malformed, foreign or unsafe before any I/O."""
        if not isinstance(segment, SegmentRef):
            raise InvalidReference(f"expected a SegmentRef, got {type(segment).__name__}")
        if segment.run_id != self.run_id:
            raise InvalidReference(
                f"reference belongs to run {segment.run_id!r}, this store reads run {self.run_id!r} "
                "(different storage)"
            )
        if segment.version != frame.FORMAT_VERSION:
            raise UnsupportedSchema(f"reference format version {segment.version} is not supported")
        if segment.checksum_algorithm != CHECKSUM_ALGORITHM:
            raise UnsupportedSchema(f"checksum algorithm {segment.checksum_algorithm!r} is not supported")
        match = _PATH.fullmatch(segment.path) if isinstance(segment.path, str) else None
        if match is None:
            self.backend.resolve(segment.path)  # names the unsafe part when there is one
            raise InvalidReference(
                f"path {segment.path!r} is not a straw pack path (raw/<writer>/<segment>.pack)"
            )
        if match.group(2) != segment.segment_id:
            raise InvalidReference(f"segment id {segment.segment_id!r} does not match path {segment.path!r}")
        for name in ("offset", "size"):
            value = getattr(segment, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise InvalidReference(f"segment {name} {value!r} is not an integer")
        if not 0 <= segment.offset <= PACK_BYTES_MAX:
            raise InvalidReference(f"segment offset {segment.offset!r} is out of range")
        # A size that no index frame can have is a damaged reference, like one a byte off (CorruptData).
        if not frame.FRAME_HEADER_BYTES < segment.size <= frame.FRAME_HEADER_BYTES + INDEX_BYTES_MAX:
            raise CorruptData(f"segment size {segment.size} cannot hold an index frame (damaged reference)")
        if segment.offset < frame.PACK_HEADER_BYTES:
            raise InvalidReference(f"segment offset {segment.offset} lies inside the pack header")

    # -- files -------------------------------------------------------------------------

    def _open(self, relative: str, segment_id: str) -> _File:
        handle = self._files.get(relative)
        if handle is not None:
            self._files.move_to_end(relative)
            return handle
        self._let_go_of_collected()
        self._make_room()
        path = self.backend.resolve(relative)
        try:
            fd = self._open_file(path, relative)
        except OSError as error:
            raise posix.storage_error(error, f"opening {relative}") from error
        try:
            header = frame.decode_pack_header(self._header_bytes(fd, relative))
            if header.run_tag != self.run_tag:
                raise InvalidReference(f"{relative} belongs to another run than {self.run_id!r}")
            if header.segment_id != segment_id:
                raise InvalidReference(f"{relative} holds segment {header.segment_id}, not {segment_id}")
        except BaseException:
            posix.close_quietly(fd)
            raise
        handle = _File(fd, header)
        self._files[relative] = handle
        CACHED_DESCRIPTORS.change(1)
        return handle

    def _make_room(self) -> None:
        """Before opening another pack: keep this reader within ``max_open`` and, D5.2c, the
        process's readers within their shared budget, closing this reader's own least recently
        used descriptors (down to OPEN_PACKS_READER_MIN; another reader's may be in use)."""
        files = self._files
        while len(files) >= self.max_open:
            self._close(files.popitem(last=False)[1])
        if len(files) >= OPEN_PACKS_READER_MIN:
            over = CACHED_DESCRIPTORS.count + 1 - descriptor_budget()
            while over > 0 and len(files) >= OPEN_PACKS_READER_MIN:
                self._close(files.popitem(last=False)[1])
                over -= 1

    def _open_file(self, path: str, relative: str) -> int:
        """D5.2: open a pack, waiting a bounded time for it to become visible. A reference whose
        writer directory is not in this pool names different storage (another pool or run, or
        a writer whose data was all collected): that is refused at once, not waited for."""
        writer = os.path.dirname(path)
        if writer not in self._writers:
            if not posix.isdir(writer) and not self._appears(writer):
                raise InvalidReference(
                    f"{relative}: its writer directory is not in the pool at {self.backend.root} "
                    "(different storage: a reference of another pool or run, or of data "
                    "garbage-collected since)"
                )
            if len(self._writers) >= WRITERS_CACHED_MAX:
                self._writers.clear()
            self._writers.add(writer)
        try:
            return self.backend.open_visible(path)
        except FileNotFoundError:
            raise StorageUnavailable(
                f"{relative} is not visible after {sum(self.backend.visibility_delays):.1f}s "
                "(not yet published on this client, or collected); retry later"
            ) from None

    def _appears(self, directory: str) -> bool:
        """On a shared mount a new writer's directory may show up on this client a moment late
        (D5.2); a local filesystem shows it at once (D2.1 made it durable before any pack)."""
        if self.backend.profile == "local":
            return False
        for delay in self.backend.visibility_delays:
            posix.wait(self.backend.sleep, delay)
            if posix.isdir(directory):
                return True
        return False

    def _header_bytes(self, fd: int, relative: str) -> bytes | bytearray:
        """The pack header; zeros where it should be are bytes not yet visible (D5.2a)."""
        data = self._pread(fd, frame.PACK_HEADER_BYTES, 0, relative)
        for delay in self.backend.visibility_delays:
            if len(data) < frame.PACK_HEADER_BYTES or any(data):
                break  # a short file is truncated, not late: only zeros of full length wait
            posix.wait(self.backend.sleep, delay)
            data = self._pread(fd, frame.PACK_HEADER_BYTES, 0, relative)
        return data

    def _let_go_of_collected(self) -> None:
        """Close the cached descriptors of packs that no longer have a name (a collection
        unlinked them, G4). A descriptor keeps a deleted file's blocks allocated (on JuiceFS,
        its chunks), so a long-lived reader (a trainer rank, a tensor session) would otherwise
        hold up to ``max_open`` collected packs' space until it opened that many others. Looked
        at each time another pack is opened: one ``fstat`` per cached descriptor (D5.2b)."""
        gone = []
        for relative, handle in self._files.items():
            try:
                if posix.fstat_links(handle.fd) == 0:
                    gone.append(relative)
            except OSError:
                gone.append(relative)  # a descriptor that cannot be looked at is no use to reads
        for relative in gone:
            self._forget(relative)

    def _forget(self, relative: str) -> None:
        handle = self._files.pop(relative, None)
        if handle is not None:
            self._close(handle)

    @staticmethod
    def _pread(fd: int, size: int, offset: int, relative: str) -> bytes | bytearray:
        try:
            return posix.pread_exact(fd, size, offset)
        except OSError as error:
            raise posix.storage_error(error, f"reading {relative}") from error

    def _verified(
        self, relative: str, segment_id: str, size: int, offset: int, check: Callable[[Data], T]
    ) -> T:
        """Read and check ``size`` bytes; on a short or bad read retry once on a fresh descriptor
        (A6), and while the frame reads as zeros (its bytes not yet visible on this client, D5.2a)
        along the visibility delays, before the damage is reported."""
        handle = self._open(relative, segment_id)
        delays = iter((0.0, *self.backend.visibility_delays))  # the same retries as payload_into
        while True:
            data = self._pread(handle.fd, size, offset, relative)
            try:
                return _checked(data, size, offset, relative, check)
            except CorruptData:
                delay = next(delays, None)
                if delay is None or (delay and not (len(data) == size and _unwritten(data))):
                    raise
            self._forget(relative)
            if delay:
                posix.wait(self.backend.sleep, delay)
            handle = self._open(relative, segment_id)

    # -- index frames -------------------------------------------------------------------

    def index(self, segment: SegmentRef) -> frame.Index:
        """The verified, parsed index frame a SegmentRef points to (cached)."""
        # Check the reference before the cache: a cached index must not vouch for a forged copy.
        # (A SegmentRef is immutable: the one checked last needs no second check.)
        if segment is not self._checked:
            self.check_segment(segment)
            self._checked = segment
        key = (segment.path, segment.offset, segment.checksum)
        cached = self._indexes.get(key, touch=True)
        if cached is not None:
            return cached
        shared = SHARED_INDEXES.get(segment) if self.shared else None
        if shared is not None:
            # Not copied into this reader's cache: the shared one keeps it as long as it is in
            # use somewhere, and a copy per validating thread kept some 16k entries each alive.
            return shared

        def check(data: bytes | bytearray) -> frame.Index:
            body = frame.decode_json_frame(data, frame.KIND_INDEX, segment.checksum)
            return frame.parse_index(body, len(data))

        parsed = self._verified(segment.path, segment.segment_id, segment.size, segment.offset, check)
        self._indexes.put(key, parsed)
        SHARED_INDEXES.put(segment, parsed)
        return parsed

    # -- discovery ---------------------------------------------------------------------------

    def sealed_extents(self, relative: str) -> list[SegmentRef] | None:
        """Every extent of a sealed pack, in order, each index frame verified; None when the pack
        is still open for appends (it ends without a seal frame, in zeros or at its end).

        Walks the frames from the header (each frame header is checksummed), so it finds the
        extents without trusting any reference. Damage before the seal is ``CorruptData``.
        """
        match = _PATH.fullmatch(relative)
        if match is None:
            raise InvalidReference(f"path {relative!r} is not a straw pack path")
        segment_id = match.group(2)
        handle = self._open(relative, segment_id)
        size = posix.fstat_size(handle.fd)
        position = frame.PACK_HEADER_BYTES
        found: list[SegmentRef] = []
        while position + frame.FRAME_HEADER_BYTES <= size:
            head = self._pread(handle.fd, frame.FRAME_HEADER_BYTES, position, relative)
            if not any(head):
                return None  # zeros written ahead of an open pack's next append (D1.2a)
            header = frame.decode_frame_header(head)
            end = position + frame.FRAME_HEADER_BYTES + header.body_bytes
            if end > size:
                return None  # an append still being written: the pack is open
            if header.kind == frame.KIND_INDEX:
                segment = SegmentRef(
                    self.run_id, relative, segment_id, end - position, header.body_checksum,
                    frame.FORMAT_VERSION, CHECKSUM_ALGORITHM, position,
                )  # fmt: skip
                self.index(segment)
                found.append(segment)
            elif header.kind == frame.KIND_SEAL:
                body = self._pread(
                    handle.fd, header.body_bytes, position + frame.FRAME_HEADER_BYTES, relative
                )
                extents, sealed_at = frame.parse_seal(
                    frame.decode_json_frame(head + body, frame.KIND_SEAL, None)
                )
                if (extents, sealed_at) != (len(found), position):
                    raise CorruptData(
                        f"{relative}: its seal names {extents} extents ending at {sealed_at}, "
                        f"the pack holds {len(found)} ending at {position}"
                    )
                return found
            position = end
        return None

    # -- payloads --------------------------------------------------------------------------

    def payload(self, segment: SegmentRef, entry: frame.IndexEntry, chunk: int) -> bytes | bytearray:
        """The whole verified payload of one record."""

        def check(data: bytes | bytearray) -> bytes | bytearray:
            _verify_chunks(memoryview(data), entry, chunk, 0, segment.path)
            return data

        if entry.inline is not None:
            return encode(entry.inline)
        if entry.length == 0:
            return b""
        return self._verified(segment.path, segment.segment_id, entry.length, entry.offset, check)

    def payload_range(
        self, segment: SegmentRef, entry: frame.IndexEntry, chunk: int, start: int, stop: int
    ) -> memoryview:
        """Bytes ``start:stop`` of a payload, reading and verifying only the chunks they touch."""
        if entry.inline is not None:
            data = encode(entry.inline)
            if not 0 <= start <= stop <= len(data):
                raise ValueError(f"range {start}:{stop} outside a payload of {len(data)} bytes")
            return memoryview(data)[start:stop]
        if not 0 <= start <= stop <= entry.length:
            raise ValueError(f"range {start}:{stop} outside a payload of {entry.length} bytes")
        if start == stop:
            return memoryview(b"")
        first = start // chunk
        last = (stop - 1) // chunk
        lo = first * chunk
        hi = min(entry.length, (last + 1) * chunk)

        def check(data: bytes | bytearray) -> bytes | bytearray:
            _verify_chunks(memoryview(data), entry, chunk, first, segment.path)
            return data

        chunks = self._verified(segment.path, segment.segment_id, hi - lo, entry.offset + lo, check)
        return memoryview(chunks)[start - lo : stop - lo]

    def payload_mapped(
        self, segment: SegmentRef, entry: frame.IndexEntry, chunk: int, first: int = 0, end: int = -1
    ) -> memoryview | None:
        """Payload bytes from chunk ``first`` to ``end`` (a chunk boundary or the payload's end;
        -1 for the end) as the pack file's own pages mapped copy-on-write, every chunk verified
        there (docs/DURABILITY.md D5.6a): no copy and no fresh memory.

        None unless the range is READ_MAPPING_BYTES_MIN or more, the pool is on a local
        filesystem, the file holds the whole range and it verifies. The caller then reads
        (:meth:`payload_into`), which retries and raises as every read does.
        """
        start = first * chunk
        end = entry.length if end < 0 else end
        large = end - start >= READ_MAPPING_BYTES_MIN
        if not (
            large and entry.inline is None and 0 <= start <= end <= entry.length and self.backend.maps_reads
        ):
            return None
        handle = self._open(segment.path, segment.segment_id)
        with contextlib.suppress(OSError, CorruptData):
            if posix.fstat_size(handle.fd) >= entry.offset + end:
                view = posix.map_private(handle.fd, entry.offset + start, end - start)
                _verify_chunks(view, entry, chunk, first, segment.path)
                return view
        return None

    def payload_view(
        self, segment: SegmentRef, entry: frame.IndexEntry, chunk: int, first: int = 0, end: int = -1
    ) -> memoryview:
        """Payload bytes from chunk ``first`` to ``end``, verified, in writable memory of their
        own: mapped where :meth:`payload_mapped` maps them, else read into a read buffer."""
        view = self.payload_mapped(segment, entry, chunk, first, end)
        if view is None:
            view = read_buffer((entry.length if end < 0 else end) - first * chunk)
            self.payload_into(segment, entry, chunk, view, first)
        return view

    def payload_into(
        self, segment: SegmentRef, entry: frame.IndexEntry, chunk: int, target: memoryview, first: int = 0
    ) -> None:
        """Fill ``target`` with payload bytes from chunk ``first`` on, verifying every chunk it holds.

        The bytes land straight in the caller's memory (one positional vectored read, no
        intermediate object). ``target`` must be a flat byte view that ends on a chunk boundary
        or at the payload's end, so that every chunk it holds is whole and can be checked.
        """
        if entry.inline is not None:
            raise ValueError(f"record {entry.record_id!r} is an inline manifest, not a stored payload")
        start = first * chunk
        end = start + target.nbytes
        if first < 0 or end > entry.length or (end != entry.length and end % chunk):
            raise ValueError(
                f"target of {target.nbytes} bytes at chunk {first} does not cover whole chunks of a "
                f"payload of {entry.length} bytes"
            )
        if not target.nbytes:
            return
        handle = self._open(segment.path, segment.segment_id)
        delays = iter((0.0, *self.backend.visibility_delays))
        while True:
            try:
                got = posix.preadinto(handle.fd, target, entry.offset + start)
            except OSError as error:
                raise posix.storage_error(error, f"reading {segment.path}") from error
            try:
                if got != target.nbytes:
                    raise CorruptData(
                        f"truncated: {segment.path} ends before byte {entry.offset + end} "
                        f"(read {got} of {target.nbytes})"
                    )
                _verify_chunks(target, entry, chunk, first, segment.path)
                return
            except CorruptData:
                # A6: a stale descriptor on a shared mount: retry once on a fresh one at once;
                # bytes not yet visible (zeros, D5.2a) get the visibility delays as well.
                delay = next(delays, None)
                if delay is None or (delay and not _unwritten(target)):
                    raise
            self._forget(segment.path)
            if delay:
                posix.wait(self.backend.sleep, delay)
            handle = self._open(segment.path, segment.segment_id)


def read_buffer(nbytes: int) -> memoryview:
    """Fresh writable memory for ``nbytes`` that a read will fill (its contents are undefined).

    From READ_MAPPING_BYTES_MIN on it is an anonymous private mapping of ordinary pages, each
    first touched by the read that fills it: no zero-filling pass (a bytearray writes every
    byte once before the read writes it again) and no transparent huge pages (NumPy madvises
    them for large arrays; where free memory is fragmented each one waits for compaction:
    reading one trainer rank's 0.78 GiB of replay tensors cost 1.4 s of system time into
    ``np.empty`` against 0.7 s into such a mapping, benchmarks/rollout_path.py shapes). The
    mapping is private to this process and unmapped when the last view of it goes.
    """
    if nbytes < READ_MAPPING_BYTES_MIN:
        return memoryview(bytearray(nbytes))
    return memoryview(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS))


def _unwritten(data: Data | memoryview) -> bool:
    """Whether a failed read looks like space whose bytes are not yet visible on this client
    (D5.2a): it starts with four zero bytes, where a frame's magic or a payload belongs."""
    head = memoryview(data)[:4]
    return len(head) == 4 and not any(head)


def _verify_chunks(view: memoryview, entry: frame.IndexEntry, chunk: int, first: int, path: str) -> None:
    digest = xxhash.xxh3_64_hexdigest
    table = entry.chunks
    if view.nbytes <= chunk:  # the common case: one chunk
        if digest(view) == table[16 * first : 16 * first + 16]:
            return
        _mismatch(entry, first, path)
    position = 16 * first
    for start in range(0, view.nbytes, chunk):
        if digest(view[start : start + chunk]) != table[position : position + 16]:
            _mismatch(entry, position // 16, path)
        position += 16


def _mismatch(entry: frame.IndexEntry, number: int, path: str) -> NoReturn:
    raise CorruptData(
        f"payload checksum mismatch in record {entry.record_id!r} (chunk {number}) of {path}; "
        "the stored bytes are damaged"
    )
