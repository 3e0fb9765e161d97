"""SharedFilesystemStore: the packed, checksummed record store (API.md section 5).

Writes: records are checked and hashed in memory, then one durable extent per
call is appended to this writer's pack (``straw._pack.writer``); the reference
returned names the extent's index frame by offset, size and checksum.
Reads: every reference is checked, every index frame is verified against the
checksum the reference carries and every payload chunk against the index.
Ordering and failure handling follow docs/DURABILITY.md (D1-D5, I1-I6).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import xxhash

from . import tracing
from ._catalog import collect as gc
from ._catalog.log import Catalog
from ._catalog.state import RECORDS_ONLY, RESERVED_PREFIXES, writer_of
from ._fs import durable, posix
from ._pack import frame
from ._pack.reader import (
    PACK_NAME,
    SEGMENT_KEY_FIELDS,
    SHARED_INDEXES,
    WRITER_NAME,
    PackReader,
    SharedMemo,
    segment_key,
    segment_of_key,
)
from ._pack.writer import CommitUncertain, Entry, PackWriter
from .backend import FilesystemBackend
from .errors import (
    CorruptData,
    IdempotencyConflict,
    IndeterminateCommit,
    InvalidReference,
    QueueError,
    ResourceLimitExceeded,
    StorageUnavailable,
    UnsafeRecovery,
    UnsupportedSchema,
    WriterBusy,
    invariant,
)
from .limits import (
    ADOPTIONS_PENDING_MAX,
    BUFFER_BYTES_MAX_DEFAULT,
    CODEC_NAME_BYTES_MAX,
    DEPENDENCIES_MAX,
    METADATA_BYTES_MAX,
    RECORD_BYTES_MAX,
    RECORD_ID_BYTES_MAX,
    RECORD_SETS_CACHED_MAX,
    RECORDS_PER_WRITE_MAX,
    SEGMENT_TARGET_BYTES_DEFAULT,
    SUBMISSION_ID_BYTES_MAX,
    SUBMISSIONS_REMEMBERED_MAX,
    SUBMITTED_REFS_REMEMBERED_MAX,
    TOKENS_MAX,
    WRITTEN_SETS_CACHED_MAX,
)
from .protocol import (
    Publication,
    Record,
    RecordRef,
    RecordSetRef,
    SegmentRef,
    as_dict,
    check_text,
    decode,
    digest,
    encode,
    encode_text,
    quote,
)

__all__ = ["POOL_MARKER", "Adoption", "ReadSession", "SharedFilesystemStore"]

#: File at the pool root naming the format; written once, durably (D0).
POOL_MARKER = "straw-pool.json"
POOL_FORMAT = {"format": "straw-pool", "version": frame.FORMAT_VERSION}
RUN_ID_BYTES_MAX = 256
R = TypeVar("R")


# --------------------------------------------------------------------------- logical identity


def logical_digest(
    entries: Sequence[frame.IndexEntry | Entry | frame.Row], dependency_digests: Sequence[str]
) -> str:
    """The layout-independent identity of a record set (docs/FORMAT.md section "Logical digest").

    ``digest({"v": ..., "records": [[id, codec, metadata, tokens, length, content], ...],
    "deps": [...]})``, composed from parts (keys in sorted order) so that a record's metadata
    is encoded once per write (``Entry.meta_text``) and never decoded when verifying (an index
    row's pairs give its text); property tests hold the composed text equal to the whole.
    """
    number = int.__repr__
    rows = ",".join([_record_text(e) for e in entries])
    deps = encode_text(list(dependency_digests))
    text = f'{{"deps":{deps},"records":[{rows}],"v":{number(frame.FORMAT_VERSION)}}}'
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _record_text(e: frame.IndexEntry | Entry | frame.Row) -> str:
    """One record's ``[id, codec, metadata, tokens, length, content]`` as canonical JSON text."""
    number = int.__repr__
    if isinstance(e, (Entry, frame.IndexEntry)):
        return (
            f"[{quote(e.record_id)},{quote(e.codec)},{_meta_text(e)},{number(e.tokens)},"
            f"{number(_length(e))},{quote(e.content)}]"
        )
    return (  # an index row (frame.Row)
        f"[{quote(e[0])},{quote(e[1])},{frame.row_meta_text(e)},{number(e[2])},"
        f"{number(frame.row_length(e))},{quote(e[5])}]"
    )


def _meta_text(entry: frame.IndexEntry | Entry) -> str:
    return entry.meta_text if isinstance(entry, Entry) and entry.meta_text else encode_text(entry.metadata)


def _length(entry: frame.IndexEntry | Entry) -> int:
    return entry.length if isinstance(entry, frame.IndexEntry) else entry.payload.nbytes


# --------------------------------------------------------------------------- reading


class _Located:
    """A record's verified index entry and the segment whose index lists it.

    It keeps the verified index and the entry's ordinal there, and builds the entry when asked
    (``frame.Index`` keeps its entries as rows of plain values, for the cycle collector's sake).
    """

    __slots__ = ("index", "ordinal", "segment")

    def __init__(self, segment: SegmentRef, ordinal: int, index: frame.Index) -> None:
        self.segment, self.ordinal, self.index = segment, ordinal, index

    @property
    def entry(self) -> frame.IndexEntry:
        return self.index.entry(self.ordinal)

    @property
    def codec(self) -> str:
        return self.index.codec(self.ordinal)

    @property
    def payload_entry(self) -> frame.IndexEntry:
        """The entry without its metadata (``Index.payload_entry``): for payload reads only."""
        return self.index.payload_entry(self.ordinal)

    @property
    def metadata(self) -> dict[str, Any]:
        """The entry's metadata alone, built afresh."""
        return self.index.metadata(self.ordinal)

    @property
    def chunk(self) -> int:
        return self.index.chunk_bytes

    def ref(self) -> RecordRef:
        return RecordRef(self.segment, self.ordinal)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Located):
            return NotImplemented
        return (self.segment, self.ordinal, self.chunk, self.entry) == (
            other.segment,
            other.ordinal,
            other.chunk,
            other.entry,
        )

    __hash__ = None  # type: ignore[assignment]


class _Resolved:
    """What verifying a record set found: its digest, its records located, its dependencies.

    The memos of verified sets keep thousands of these, and every object in them is one more
    for each full cycle collection to walk (issue 12). So it keeps no parsed manifest (only
    its digest is asked for again), and when every record is in one extent (the usual case)
    it keeps that extent's segment and index with a tuple of ordinals, which the collector
    untracks, and builds the located records when asked.
    """

    __slots__ = ("_index", "_ordinals", "_records", "_segment", "dependencies", "digest")

    def __init__(
        self, digest: str, records: Sequence[_Located], dependencies: tuple[RecordSetRef, ...]
    ) -> None:
        self.digest, self.dependencies = digest, dependencies
        first = records[0] if records else None
        self._segment: SegmentRef | None = None
        self._index: frame.Index | None = None
        if first is not None and all(r.index is first.index and r.segment is first.segment for r in records):
            self._segment, self._index = first.segment, first.index
            self._ordinals = tuple([r.ordinal for r in records])
            self._records: tuple[_Located, ...] | None = None
        else:
            self._ordinals = ()
            self._records = tuple(records)

    @property
    def records(self) -> tuple[_Located, ...]:
        segment, index = self._segment, self._index
        if segment is None or index is None:
            return self._records or ()
        return tuple([_Located(segment, o, index) for o in self._ordinals])

    def __len__(self) -> int:
        return len(self._ordinals) if self._index is not None else len(self._records or ())

    def record(self, number: int) -> _Located:
        """``records[number]`` (0 <= number < len(self)), without building the others."""
        segment, index = self._segment, self._index
        if segment is None or index is None:
            return (self._records or ())[number]
        return _Located(segment, self._ordinals[number], index)

    def extents(self) -> list[tuple[frame.Index, tuple[int, ...]]]:
        """The records as (index, ordinals there), without building each located record."""
        if self._index is not None:
            return [(self._index, self._ordinals)]
        return [(r.index, (r.ordinal,)) for r in self._records or ()]

    def single_extent(self) -> SegmentRef | None:
        """The one extent holding every record, if there is one (and a record at all)."""
        return self._segment

    def record_paths(self) -> set[str]:
        """The packs holding the set's records."""
        if self._segment is not None:
            return {self._segment.path}
        return {r.segment.path for r in self._records or ()}

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Resolved):
            return NotImplemented
        return (self.digest, self.records, self.dependencies) == (
            other.digest,
            other.records,
            other.dependencies,
        )

    __hash__ = None  # type: ignore[assignment]

    def row(self) -> Any:
        """This set as ``WRITTEN_SETS`` keeps it: one flat tuple of plain values when its records
        share one extent (its digest, dependencies, extent and ordinals), else itself. Flat,
        since a collection untracks a tuple only once its inner tuples are and meets the inner
        ones after it: each level of nesting is one more collection survived, and a third one
        reaches the oldest generation. The extent's index is not kept: ``of_row`` takes it from
        ``SHARED_INDEXES``, which holds what this process wrote."""
        segment = self._segment
        if segment is None or self._index is None:
            return self
        return self.row_of(self.digest, self.dependencies, segment, self._ordinals)

    @staticmethod
    def row_of(
        digest: str, dependencies: tuple[RecordSetRef, ...], segment: SegmentRef, ordinals: Sequence[int]
    ) -> tuple[Any, ...]:
        """:meth:`row` of a set whose records are ``ordinals`` of the extent ``segment``."""
        return (digest, dependencies, *segment_key(segment), *ordinals)

    @classmethod
    def of_row(cls, row: Any) -> _Resolved | None:
        """The set :meth:`row` gave ``row`` for, equal to it; None once its extent's index left
        ``SHARED_INDEXES`` (the set is then verified from disk, as one never remembered)."""
        if type(row) is not tuple:
            return row  # type: ignore[no-any-return]
        segment = segment_of_key(row[2 : 2 + SEGMENT_KEY_FIELDS])
        index = SHARED_INDEXES.get(segment)
        if index is None:
            return None
        out = cls.__new__(cls)
        out.digest, out.dependencies, out._records = row[0], row[1], None
        out._segment, out._index, out._ordinals = segment, index, row[2 + SEGMENT_KEY_FIELDS :]
        return out


class _WrittenSets:
    """``WRITTEN_SETS``: a :class:`SharedMemo` of resolved sets kept as :meth:`_Resolved.row`
    tuples. Every publication adds one; kept as objects (the set, its segment and its index),
    they were walked by every full cycle collection and, surviving, brought the next one sooner."""

    def __init__(self, limit: Callable[[], int]) -> None:
        self._items: SharedMemo[SetKey, Any] = SharedMemo(limit)

    def get(self, key: SetKey) -> _Resolved | None:
        found = self._items.get(key)
        return _Resolved.of_row(found) if found is not None else None

    def put_rows(self, items: list[tuple[SetKey, Any]]) -> None:
        """Sets given as their :meth:`_Resolved.row` already."""
        self._items.put_all(items)

    def clear(self) -> None:
        self._items.clear()


#: A record set reference as the memos of verified sets key it: every field of the reference,
#: as one tuple of plain values (untracked by the cycle collector, unlike the reference).
SetKey = tuple[Any, ...]


def set_key(ref: RecordSetRef) -> SetKey:
    """The memo key of ``ref``: equal exactly when the references are equal."""
    manifest = ref.manifest
    usage = (ref.records, ref.payload_bytes, ref.tokens)
    return (*segment_key(manifest.segment), manifest.ordinal, ref.digest, *usage)


#: Record sets the stores of this process published, resolved, by their exact reference.
#:
#: docs/FORMAT.md section 5, "Record sets this process wrote": a writer that has just made
#: an extent durable knows what verifying one of its sets would find (its manifest, the
#: index entries of its records, its dependencies), since the index frame the reference's
#: checksum names holds exactly that. Every session of the process starts from it, as from
#: its own memo of verified sets: the manifest's extent is still located on each hit (the
#: segment checks, and the index frame read and verified when not cached), so only the
#: manifest's parse and the digest's recomputation are skipped. Bounded by
#: ``WRITTEN_SETS_CACHED_MAX``, oldest first out.
WRITTEN_SETS = _WrittenSets(lambda: WRITTEN_SETS_CACHED_MAX)


#: Forks this process descends from (bumped in each child): a session compares it with the
#: count when it opened, which every call checks without a ``getpid`` system call.
_FORKS = [0]


def _count_fork() -> None:
    _FORKS[0] += 1


os.register_at_fork(after_in_child=_count_fork)


class ReadSession:
    """Verified reads sharing one cache of open packs and parsed index frames.

    Not an ownership pin: it keeps nothing alive (API.md section 5).
    """

    def __init__(self, backend: FilesystemBackend, run_id: str, *, shared: bool = False) -> None:
        self._reader = PackReader(backend, run_id, shared=shared)
        self._pid = os.getpid()
        self._forks = _FORKS[0]
        self._closed = False
        # A session dropped without close() (a thread's that ended, a reader object thrown
        # away) still gives its descriptors back (D5.2c). The finalizer holds the reader, not
        # the session, which it would keep alive.
        weakref.finalize(self, self._reader.close)
        # Record sets this session verified, by their exact reference (see ``resolve``).
        self._resolved: OrderedDict[SetKey, _Resolved] = OrderedDict()

    @property
    def forked(self) -> bool:
        """Whether this process is a fork of the one that opened the session."""
        return _FORKS[0] != self._forks

    def _usable(self) -> None:
        """A session serves the process that opened it, until closed (checked before any I/O,
        so a forked child's refused call changes nothing of its parent's session)."""
        if _FORKS[0] != self._forks:
            raise RuntimeError(
                f"this read session was opened in process {self._pid}; it cannot be reused after fork: "
                "open a new one (store.read_session()) in this process"
            )
        if self._closed:
            raise RuntimeError("this read session is closed; open a new one with store.read_session()")

    def close(self) -> None:
        if _FORKS[0] != self._forks:
            self._usable()  # a child closing its parent's descriptors would hurt the parent
        self._closed = True
        self._resolved.clear()
        self._reader.close()

    @property
    def root(self) -> str:
        """The mount path of the pool this session reads."""
        return str(self._reader.backend.root)

    @property
    def run_id(self) -> str:
        """The run whose packs this session reads."""
        return self._reader.run_id

    def __enter__(self) -> ReadSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- locating ------------------------------------------------------------------

    def index(self, segment: SegmentRef) -> frame.Index:
        """The verified index frame a segment reference names."""
        self._usable()
        return self._reader.index(segment)

    def locate(self, ref: RecordRef) -> _Located:
        self._usable()
        if not isinstance(ref, RecordRef):
            raise InvalidReference(f"expected a RecordRef, got {type(ref).__name__}")
        index = self._reader.index(ref.segment)
        ordinal = ref.ordinal
        if not isinstance(ordinal, int) or isinstance(ordinal, bool) or not 0 <= ordinal < len(index):
            raise InvalidReference(f"record ordinal {ordinal!r} is not in an extent of {len(index)} records")
        return _Located(ref.segment, ordinal, index)

    def resolve(self, ref: RecordSetRef) -> _Resolved:
        """Verify a record set reference down to its records' index entries.

        A set verified before in this session is answered from memory (docs/FORMAT.md section
        5, "Verified record sets"): the key is the whole reference, so a reference differing
        in any field (a forged or stale digest, another extent, other counts) is verified
        afresh; and the manifest's extent is located again first, which re-checks the
        reference's segment and ordinal and re-reads its index frame when that fell out of
        the index cache. Packs are immutable once written (I1), so what was verified stays
        true of those bytes; payload bytes are still verified on every read.
        """
        self._usable()
        if not isinstance(ref, RecordSetRef):
            raise InvalidReference(f"expected a RecordSetRef, got {type(ref).__name__}")
        key = set_key(ref)
        known = self._resolved.get(key)
        if known is not None:
            self.locate(ref.manifest)
            self._resolved.move_to_end(key)
            return known
        known = WRITTEN_SETS.get(key)
        if known is not None:
            self.locate(ref.manifest)  # as for a set of the memo: the extent is located again
            return known
        resolved = self._verify(ref)
        self._resolved[key] = resolved
        while len(self._resolved) > RECORD_SETS_CACHED_MAX:
            self._resolved.popitem(last=False)
        return resolved

    def _verify(self, ref: RecordSetRef) -> _Resolved:
        top = self.locate(ref.manifest)
        head = top.entry
        if head.codec != frame.MANIFEST_CODEC:
            raise InvalidReference(f"record {head.record_id!r} is not a manifest")
        body = head.inline
        if body is None:
            body = decode(self._reader.payload(top.segment, head, top.chunk))
        manifest = frame.parse_manifest(body)
        if manifest.digest != ref.digest:
            raise InvalidReference(
                "the reference's digest does not match the manifest it points to (forged or stale)"
            )
        segments = [self._segment(s) for s in manifest.segments]
        records = []
        for seg_index, ordinal in manifest.records:
            segment = top.segment if seg_index < 0 else segments[seg_index]
            try:
                records.append(self.locate(RecordRef(segment, ordinal)))
            except InvalidReference as error:
                raise CorruptData(f"manifest names a record that does not exist: {error}") from None
        dependencies = tuple(self._dependency(d, top.segment) for d in manifest.dependencies)
        rows = [r.index.rows[r.ordinal] for r in records]  # (no entry is built: nothing decoded)
        if logical_digest(rows, [d.digest for d in dependencies]) != manifest.digest:
            raise CorruptData("manifest digest does not match its records (damaged manifest)")
        # Usage counts what the set reaches: its records plus each dependency, once per edge.
        payload = sum(map(frame.row_length, rows)) + sum(d.payload_bytes for d in dependencies)
        tokens = sum(row[2] for row in rows) + sum(d.tokens for d in dependencies)
        if (ref.records, ref.payload_bytes, ref.tokens) != (len(rows), payload, tokens):
            raise InvalidReference(
                "the reference's usage counts do not match its manifest (records, payload bytes, tokens)"
            )
        return _Resolved(manifest.digest, tuple(records), dependencies)

    @staticmethod
    def _segment(data: Mapping[str, Any]) -> SegmentRef:
        try:
            return SegmentRef.from_dict(data)
        except (InvalidReference, TypeError) as error:
            raise CorruptData(f"manifest holds a malformed segment: {error}") from None

    @staticmethod
    def _dependency(data: Mapping[str, Any], here: SegmentRef) -> RecordSetRef:
        try:
            if "self" in data:
                return RecordSetRef(
                    manifest=RecordRef(here, data["self"]),
                    digest=data["digest"],
                    records=data["records"],
                    payload_bytes=data["payload_bytes"],
                    tokens=data["tokens"],
                )
            return RecordSetRef.from_dict(data["ref"])
        except (KeyError, InvalidReference, TypeError) as error:
            raise CorruptData(f"manifest holds a malformed dependency: {error}") from None

    # -- public reads ----------------------------------------------------------------

    def read(self, ref: RecordSetRef) -> Iterator[Record]:
        """Records of a set in manifest order; the reference is verified before this returns."""
        resolved = self.resolve(ref)
        return (self._record(located) for located in resolved.records)

    def read_record(self, ref: RecordRef) -> Record:
        return self._record(self.locate(ref))

    def _record(self, located: _Located) -> Record:
        e = located.entry
        began = time.perf_counter()
        payload = self._reader.payload(located.segment, e, located.chunk)
        if tracing.enabled():
            tracing.emit("read", root=self._reader.backend.root, size=len(payload),
                         seconds=time.perf_counter() - began)  # fmt: skip
        return Record(e.record_id, payload, e.codec, dict(e.metadata), e.tokens)

    def manifest(self, ref: RecordSetRef) -> dict[str, Any]:
        resolved = self.resolve(ref)
        return {
            "version": frame.FORMAT_VERSION,
            "digest": resolved.digest,
            "records": [as_dict(r.ref()) for r in resolved.records],
            "dependencies": [as_dict(d) for d in resolved.dependencies],
        }

    def validate(
        self, ref: RecordSetRef, *, task_id: str | None = None, attempt_id: str | None = None
    ) -> tuple[RecordRef, ...]:
        """Verify a record set's structure (not payload bytes); with task/attempt, check ownership."""
        resolved = self.resolve(ref)
        self.check_ownership(resolved, task_id, attempt_id)
        return tuple(r.ref() for r in resolved.records)

    @staticmethod
    def check_ownership(resolved: _Resolved, task_id: str | None, attempt_id: str | None) -> None:
        """Every record's metadata must name the task and attempt (API.md section 5, validate)."""
        if task_id is not None or attempt_id is not None:
            for index, ordinals in resolved.extents():
                for ordinal in ordinals:
                    task, attempt = index.metadata_values(ordinal, "task_id", "attempt_id")
                    if (task_id is not None and task != task_id) or (
                        attempt_id is not None and attempt != attempt_id
                    ):
                        raise InvalidReference(
                            f"record {index.entry(ordinal).record_id!r} does not belong to this "
                            f"task/attempt (task {task_id!r} attempt {attempt_id!r}; its metadata "
                            f"names task {task!r} attempt {attempt!r})"
                        )

    def envelope(self, ref: RecordRef) -> dict[str, Any]:
        """A record's verified description without its payload."""
        located = self.locate(ref)
        e = located.entry
        length = len(encode(e.inline)) if e.inline is not None else e.length
        return {
            "record_id": e.record_id,
            "codec": e.codec,
            "metadata": dict(e.metadata),
            "tokens": e.tokens,
            "payload_bytes": length,
            "checksum": e.content,
            "chunk_bytes": located.chunk,
        }

    def read_range(
        self,
        ref: RecordRef,
        start: int,
        stop: int,
        *,
        chunk_bytes: int | None = None,
        checksums: Sequence[str] | None = None,
    ) -> memoryview:
        """Payload bytes ``start:stop``, reading and verifying only the chunks they touch.

        With ``checksums`` (SHA-256 hex digests of consecutive ``chunk_bytes`` pieces of the
        whole payload, as a caller recorded them), the pieces covering the range are also
        checked against those: a mismatch is ``CorruptData``.
        """
        began = time.perf_counter()
        located = self.locate(ref)
        entry, chunk = located.entry, located.chunk
        if checksums is None:
            data = self._reader.payload_range(located.segment, entry, chunk, start, stop)
            checked = _covered(start, stop, chunk, entry.length)
        else:
            data, checked = self._range_against(located, start, stop, chunk_bytes, list(checksums))
        tracing.emit("read_range", root=self._reader.backend.root, size=len(data),
                     seconds=time.perf_counter() - began, checked_bytes=checked)  # fmt: skip
        return data

    def _range_against(
        self, located: _Located, start: int, stop: int, piece: int | None, sums: list[str]
    ) -> tuple[memoryview, int]:
        """``read_range`` checked against a caller's SHA-256 table of ``piece``-byte pieces."""
        entry = located.entry
        length = entry.length
        if isinstance(piece, bool) or not isinstance(piece, int) or piece <= 0:
            raise ValueError(f"chunk_bytes must be a positive integer with checksums, got {piece!r}")
        if len(sums) != -(-length // piece):
            raise ValueError(f"{len(sums)} checksums do not cover a payload of {length} bytes in {piece}")
        if not 0 <= start <= stop <= length:
            raise ValueError(f"range {start}:{stop} outside a payload of {length} bytes")
        if start == stop:
            return memoryview(b""), 0
        first, last = start // piece, (stop - 1) // piece
        low, high = first * piece, min(length, (last + 1) * piece)
        data = self._reader.payload_range(located.segment, entry, located.chunk, low, high)
        for number in range(first, last + 1):
            part = data[(number - first) * piece : (number + 1 - first) * piece]
            if hashlib.sha256(part).hexdigest() != sums[number]:
                raise CorruptData(
                    f"record {entry.record_id!r}: bytes of piece {number} ({piece} bytes each) "
                    "do not match the caller's checksum"
                )
        return data[start - low : stop - low], high - low

    def inspect_segment(self, segment: SegmentRef, *, verify_payload: bool = False) -> dict[str, Any]:
        """What one extent holds, from its verified index frame; ``verify_payload`` also reads
        and checks every payload chunk. Each record's ``offset`` is where its frame starts,
        relative to ``segment.offset`` (negative: records precede their index; ``None`` for a
        manifest kept inside the index)."""
        index = self.index(segment)
        records = []
        for ordinal, e in enumerate(index.entries):
            if verify_payload and e.inline is None:
                for low in range(0, e.length, _VERIFY_BYTES):
                    self._reader.payload_range(
                        segment, e, index.chunk_bytes, low, min(e.length, low + _VERIFY_BYTES)
                    )
            length = len(encode(e.inline)) if e.inline is not None else e.length
            offset = None if e.inline is not None else e.offset - frame.FRAME_HEADER_BYTES - segment.offset
            envelope = {"record_id": e.record_id, "codec": e.codec, "metadata": dict(e.metadata),
                        "tokens": e.tokens, "length": length, "checksum": e.content,
                        "version": frame.FORMAT_VERSION}  # fmt: skip
            records.append({"ordinal": ordinal, "offset": offset, "envelope": envelope})
        return {
            "run_id": segment.run_id,
            "segment_id": segment.segment_id,
            "version": frame.FORMAT_VERSION,
            "submission_id": index.submission_id,
            "chunk_bytes": index.chunk_bytes,
            "records": records,
        }

    def read_into(self, ref: RecordRef, target: memoryview) -> None:
        """Fill ``target`` (a flat byte view of exactly the payload's size) with the verified payload.

        One positional read straight into the caller's memory, then every chunk is checked
        there: a tensor loads into its own freshly allocated storage with no intermediate copy.
        """
        located = self.locate(ref)
        entry = located.payload_entry
        if target.nbytes != entry.length:
            raise ValueError(
                f"target holds {target.nbytes} bytes, record {entry.record_id!r} has {entry.length}"
            )
        self._reader.payload_into(located.segment, entry, located.chunk, target)

    def read_mapped(self, ref: RecordRef) -> memoryview | None:
        """The whole verified payload as the pack's pages mapped copy-on-write, or None where it
        is not mapped (under READ_MAPPING_BYTES_MIN, or the pool is not on a local filesystem:
        docs/DURABILITY.md D5.6a). Nothing is copied, and changing the view changes only this
        process's pages; a tensor's array can be made over it directly."""
        located = self.locate(ref)
        return self._reader.payload_mapped(located.segment, located.payload_entry, located.chunk)

    def read_view(self, ref: RecordRef) -> memoryview:
        """The whole verified payload in writable memory of its own: :meth:`read_mapped`'s pages
        where it maps them, else a fresh read buffer filled by one read (a tensor's array views it)."""
        located = self.locate(ref)
        return self._reader.payload_view(located.segment, located.payload_entry, located.chunk)

    def read_tensor_range(self, ref: RecordRef, start: int, stop: int) -> memoryview:
        """Payload bytes ``start:stop`` in fresh writable memory, reading and verifying only the chunks
        they touch (like :meth:`read_range`, but the result may back a tensor without a copy)."""
        located = self.locate(ref)
        entry, chunk = located.payload_entry, located.chunk
        if entry.inline is not None or not 0 <= start <= stop <= entry.length:
            raise ValueError(f"range {start}:{stop} outside a payload of {entry.length} bytes")
        if start == stop:
            return memoryview(bytearray())
        began = time.perf_counter()
        first = start // chunk
        low = first * chunk
        high = min(entry.length, ((stop - 1) // chunk + 1) * chunk)
        buffer = self._reader.payload_view(located.segment, entry, chunk, first, high)
        if tracing.enabled():
            tracing.emit("read_range", root=self._reader.backend.root, size=stop - start,
                         seconds=time.perf_counter() - began, checked_bytes=high - low)  # fmt: skip
        return buffer[start - low : stop - low]


#: Bytes of one payload ``inspect_segment(verify_payload=True)`` reads at a time.
_VERIFY_BYTES = 64 * 1024 * 1024


class LiveSessions:
    """Read sessions of a store's or a pool's threads, for as long as each lives (D5.2c): a
    thread that ends drops its sessions, and a session's finalizer closes its descriptors."""

    def __init__(self) -> None:
        self._sessions: weakref.WeakSet[ReadSession] = weakref.WeakSet()
        self._lock = threading.Lock()  # (a weak set changed while another thread lists it raises)

    def add(self, session: ReadSession) -> ReadSession:
        with self._lock:
            self._sessions.add(session)
        return session

    def members(self) -> list[ReadSession]:
        with self._lock:
            return list(self._sessions)


def _share_written(
    refs: Sequence[RecordSetRef], manifests: Sequence[frame.Manifest], publications: Sequence[Publication]
) -> None:
    """Remember what verifying these just published sets would find (``WRITTEN_SETS``).

    Built from the index the writer shares once the extent is durable (``remember_written``,
    which shares only entries whose metadata nothing the caller holds can change); without it
    (such metadata, or already evicted) the sets are verified when first resolved. Each set's
    dependencies are the references the caller gave (an earlier publication of the call: its
    reference), equal to what parsing the manifest would give.
    """
    if not refs:
        return
    segment = refs[0].manifest.segment
    if not SHARED_INDEXES.holds(segment):
        return
    items = []
    for ref, manifest, publication in zip(refs, manifests, publications, strict=True):
        deps = tuple([refs[d] if isinstance(d, int) else d for d in publication.dependencies])
        ordinals = [o for s, o in manifest.records if s < 0]  # (all of a publication's are here)
        row = _Resolved.row_of(manifest.digest, deps, segment, ordinals) if ordinals else None
        items.append((set_key(ref), row or _Resolved(manifest.digest, (), deps).row()))
    WRITTEN_SETS.put_rows(items)


def _usage(dependency: Mapping[str, Any], field: str) -> int:
    """A manifest dependency's usage count (a local one carries it, an external one in its ref)."""
    value = dependency[field] if "self" in dependency else dependency["ref"][field]
    return int(value)


def _covered(start: int, stop: int, chunk: int, length: int) -> int:
    """Bytes of the whole chunks a read of ``start:stop`` verifies."""
    if start >= stop:
        return 0
    return min(length, ((stop - 1) // chunk + 1) * chunk) - (start // chunk) * chunk


# --------------------------------------------------------------------------- writing helpers


class _Remembered:
    """A submission's answer kept for retries (I4), in a form the cycle collector skips.

    A store remembers up to SUBMITTED_REFS_REMEMBERED_MAX references; kept as objects, each
    is a RecordSetRef and a RecordRef, two tracked objects that every full collection walks
    (some 130k for four workers publishing in batches). Every reference of one answer names
    the same extent, so it is kept as that SegmentRef and a tuple of plain values per
    reference (tuples of atoms are untracked by the collector), and rebuilt, equal, on a retry.
    """

    __slots__ = ("_other", "_rows", "_segment", "_shape", "fingerprint", "kind")

    def __init__(self, kind: str, fingerprint: str, result: Any) -> None:
        self.kind, self.fingerprint = kind, fingerprint
        self._shape, segment, self._rows, self._other = _compact(result)
        # Its SegmentRef as plain values too: an object here outlived every publication.
        self._segment = segment_key(segment) if segment is not None else None

    def row(self) -> tuple[Any, ...]:
        """How a store's submissions keep it: one tuple of plain values (for an answer of
        references), which the collector untracks; an object per publication outlived them all."""
        return (self.kind, self.fingerprint, self._shape, self._segment, self._rows, self._other)

    @classmethod
    def of_row(cls, row: tuple[Any, ...]) -> _Remembered:
        """The answer :meth:`row` gave ``row`` for."""
        out = cls.__new__(cls)
        out.kind, out.fingerprint, out._shape, out._segment, out._rows, out._other = row
        return out

    @property
    def result(self) -> Any:
        """The answer as the call returned it (fresh containers, equal references)."""
        shape, key, rows = self._shape, self._segment, self._rows
        if key is None:
            return self._other
        segment = segment_of_key(key)
        if shape == "records":
            return tuple(RecordRef(segment, ordinal) for ordinal in rows)
        refs = [_set_ref(segment, rows, at) for at in range(0, len(rows), _SET_ROW)]
        return refs[0] if shape == "set" else refs

    @property
    def references(self) -> int:
        """References the answer holds: a list of them (``publish_many``, ``write_records``) or one."""
        if self._shape == "other":
            return len(self._other) if isinstance(self._other, (list, tuple)) else 1
        return len(self._rows) if self._shape == "records" else len(self._rows) // _SET_ROW


#: Values a remembered set reference keeps, one after another in one flat tuple (a tuple of
#: tuples is untracked only once a collection met the inner ones first).
_SET_ROW = 5


def _set_ref(segment: SegmentRef, rows: tuple[Any, ...], at: int) -> RecordSetRef:
    return RecordSetRef(RecordRef(segment, rows[at]), rows[at + 1], rows[at + 2], rows[at + 3], rows[at + 4])


def _set_row(ref: RecordSetRef) -> tuple[int, str, int, int, int]:
    return (ref.manifest.ordinal, ref.digest, ref.records, ref.payload_bytes, ref.tokens)


def _compact(result: Any) -> tuple[str, SegmentRef | None, tuple[Any, ...], Any]:
    """``_Remembered``'s form of an answer: its shape, the extent its references name, a row of
    plain values per reference; anything else (none yet, references to several extents) as is."""
    if type(result) is RecordSetRef:
        return "set", result.manifest.segment, _set_row(result), None
    if result and type(result) in (list, tuple):
        first = result[0]
        if type(result) is list and all(type(r) is RecordSetRef for r in result):
            segment = first.manifest.segment
            if all(r.manifest.segment == segment for r in result):
                return "sets", segment, tuple([x for r in result for x in _set_row(r)]), None
        if (
            type(result) is tuple
            and all(type(r) is RecordRef for r in result)
            and all(r.segment == first.segment for r in result)
        ):
            return "records", first.segment, tuple([r.ordinal for r in result]), None
    return "other", None, (), result


@dataclass(frozen=True)
class _Pending:
    """A submission whose outcome is uncertain (docs/DURABILITY.md I5)."""

    submission_id: str
    remembered: _Remembered
    dir_sync: str | None


def _flat_view(payload: object, record_id: str) -> memoryview:
    try:
        view = memoryview(payload)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(
            f"record {record_id!r}: payload must be bytes, bytearray or a contiguous buffer, "
            f"got {type(payload).__name__}"
        ) from None
    if not view.c_contiguous:
        raise ValueError(f"record {record_id!r}: payload buffer must be C-contiguous")
    if view.ndim == 1 and view.itemsize == 1:
        return view if view.format == "B" else view.cast("B")
    if view.ndim == 0:
        return memoryview(view.tobytes())
    return view.cast("B")


def _check_root(root: object) -> None:
    """A pool root is a non-empty path: ``""`` would make a pool in the current directory."""
    if not isinstance(root, (str, os.PathLike)):
        raise TypeError(f"root must be a path, got {type(root).__name__}")
    text = os.fspath(root)
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"root must name the pool's directory, got {text!r}")


@dataclass
class Adoption:
    """Publications a durable owner (a queue) took over: their writer's staging of them ends.

    docs/GC.md "Queue adoption". ``items`` are catalog ``unstage`` items (pack, index
    offset, manifest ordinal or ``RECORDS_ONLY``); ``owners`` the staging owners that kept
    what those publications reach outside their own extent.
    """

    items: set[tuple[str, int, int]] = field(default_factory=set)
    owners: set[str] = field(default_factory=set)

    def __bool__(self) -> bool:
        return bool(self.items or self.owners)

    def update(self, other: Adoption) -> None:
        self.items |= other.items
        self.owners |= other.owners


# --------------------------------------------------------------------------- the store


class SharedFilesystemStore:
    """Immutable records appended to per-writer packs in a pool on a mounted filesystem."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        run_id: str,
        *,
        backend: FilesystemBackend | None = None,
        codecs: Iterable[str] = ("bytes.v1", "json.v1"),
        max_record_bytes: int = RECORD_BYTES_MAX,
        max_buffer_bytes: int = BUFFER_BYTES_MAX_DEFAULT,
        segment_target_bytes: int = SEGMENT_TARGET_BYTES_DEFAULT,
        online_gc: bool = False,
    ) -> None:
        self.run_id = check_text(run_id, "run_id", RUN_ID_BYTES_MAX)
        _check_root(root)
        if backend is None:
            backend = FilesystemBackend(root)
        elif os.path.abspath(os.fspath(root)) != str(backend.root):
            raise ValueError(
                f"root {os.fspath(root)!r} differs from the backend's root {str(backend.root)!r}"
            )
        self.backend = backend
        self._root_text = str(backend.root)
        self.codecs = self._check_codecs(codecs)
        for name, value in (("max_record_bytes", max_record_bytes), ("max_buffer_bytes", max_buffer_bytes)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if (
            not isinstance(segment_target_bytes, int)
            or isinstance(segment_target_bytes, bool)
            or segment_target_bytes < 0
        ):
            raise ValueError(
                f"segment_target_bytes must be a non-negative integer, got {segment_target_bytes!r}"
            )
        self.max_record_bytes = max_record_bytes
        self.max_buffer_bytes = max_buffer_bytes
        #: Records (manifests included) one write may hold; callers that split large batches
        #: read it here, and tests may lower it on an instance.
        self.max_records_per_write = RECORDS_PER_WRITE_MAX
        self.segment_target_bytes = segment_target_bytes
        # Recorded for the ownership catalog (docs/DURABILITY.md, "Lifetime").
        self.online_gc = bool(online_gc)
        self.writer_id = secrets.token_hex(16)
        self._open_pool()
        self._writer = PackWriter(backend, self.run_id, self.writer_id, segment_target_bytes)
        self._catalog = Catalog(backend)
        self._catalog_ready = False
        with contextlib.suppress(QueueError):
            self._ensure_catalog()  # early, where it can; a failure here is met again at the first write
        if self.online_gc:
            # docs/GC.md: with online GC the writer records every sealed pack and its extents,
            # so released data becomes collectable while the writer still lives.
            self._writer.on_seal = self._record_seal
            # Tools learn from it that this pool is collected online (straw.inspect refuses then).
            self._writer.live_note = encode({"online_gc": True})
        self._lock = threading.Lock()
        self._submissions: OrderedDict[str, tuple[Any, ...]] = OrderedDict()  # _Remembered rows
        self._remembered_refs = 0  # references the remembered answers hold (``references``)
        self._pending: _Pending | None = None
        # Staging ends released with defer=True, written with this store's next catalog frame
        # (docs/DURABILITY.md G6.2); guarded by its own lock, taken inside the catalog's.
        self._deferred = Adoption()
        self._deferred_lock = threading.Lock()
        self._local = threading.local()
        self._sessions = LiveSessions()
        self._counts = {
            "payload_bytes": 0,
            "records": 0,
            "publications": 0,
            "writes": 0,
            "idempotent_hits": 0,
        }

    def __repr__(self) -> str:
        root = str(self.backend.root)
        return f"SharedFilesystemStore({root!r}, run_id={self.run_id!r}, writer={self.writer_id})"

    @staticmethod
    def _check_codecs(codecs: Iterable[str]) -> tuple[str, ...]:
        if isinstance(codecs, str):
            raise TypeError("codecs must be a sequence of codec names, not one string")
        names = tuple(codecs)
        for name in names:
            check_text(name, "codec name", CODEC_NAME_BYTES_MAX)
            if "pickle" in name.lower():
                raise UnsupportedSchema(f"codec {name!r}: straw never stores or loads pickle")
            if name.startswith("straw."):
                raise ValueError(f"codec {name!r}: names starting with 'straw.' are reserved")
        return names

    def _open_pool(self) -> None:
        """Create the pool directory and marker on first use, or check the existing marker."""
        root = str(self.backend.root)
        marker = os.path.join(root, POOL_MARKER)
        try:
            parent = os.path.dirname(root)
            durable.make_dirs(parent, "", None)  # above the pool: not ours to sync
            durable.make_dirs(root, parent, self.backend.sync_dir)
            if not posix.exists(marker):
                durable.create_file(
                    marker, [encode(POOL_FORMAT)], self.backend.sync_file, self.backend.sync_dir
                )
            found = decode(posix.read_file(marker, 4096))
            durable.make_dirs(os.path.join(root, "raw"), root, self.backend.sync_dir)
            # D0: an earlier open may have created these entries and then failed to sync them;
            # syncing both directories on every open makes "exists" imply "durable".
            self.backend.sync_dir(parent)
            self.backend.sync_dir(root)
        except OSError as error:
            raise posix.storage_error(error, f"opening pool {root}") from error
        if not isinstance(found, dict) or found.get("format") != POOL_FORMAT["format"]:
            raise CorruptData(f"{marker} is not a straw pool marker")
        if found.get("version") != POOL_FORMAT["version"]:
            raise UnsupportedSchema(f"pool format version {found.get('version')!r} is not supported")

    # -- context -------------------------------------------------------------------------

    def __enter__(self) -> SharedFilesystemStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def metrics(self) -> dict[str, Any]:
        counts: dict[str, Any] = dict(self._counts)
        counts.update(
            packs_created=self._writer.packs_created,
            bytes_written=self._writer.bytes_written,
            syncs=self.backend.metrics["syncs"],
            files_created=self.backend.metrics["files_created"],
        )
        return counts

    # -- writing: public -------------------------------------------------------------------

    def publish(
        self,
        records: Iterable[Record],
        *,
        submission_id: str,
        dependencies: Iterable[RecordSetRef] = (),
        owned_dependencies: Iterable[RecordSetRef] = (),
    ) -> RecordSetRef:
        """Durably publish one record set; returns its reference (D1/D2).

        ``owned_dependencies`` (ours, a subset of ``dependencies``) are dependencies an owner
        already keeps alive until a queue adopts this publication or the caller drops it, such
        as the input of the task this publication completes, which the queue keeps while the
        caller's read of it is outstanding: they are not staged again, which saves a catalog
        frame and its sync (docs/GC.md "Staging and writers", DURABILITY.md G6.3). Should that
        owner let them go first, the publication is left dangling: reaching it fails.
        """
        publication = Publication(tuple(records), tuple(dependencies))
        for dep in publication.dependencies:
            if not isinstance(dep, RecordSetRef):
                raise TypeError(f"publish dependencies must be RecordSetRef, got {type(dep).__name__}")
        owned = tuple(owned_dependencies)
        for dep in owned:
            if not isinstance(dep, RecordSetRef) or dep not in publication.dependencies:
                raise ValueError(f"owned_dependencies must be among the dependencies, got {dep!r}")
        return self._publish("publish", [publication], submission_id, owned=frozenset(owned))[0]

    def publish_many(
        self, publications: Iterable[Publication], *, submission_id: str
    ) -> tuple[RecordSetRef, ...]:
        """Many logical record sets in one durable write."""
        return tuple(self._publish("publish_many", list(publications), submission_id))

    def write_records(self, records: Iterable[Record], *, submission_id: str) -> tuple[RecordRef, ...]:
        """Durably write records without a manifest; combine them later with :meth:`record_set`."""
        check_text(submission_id, "submission_id", SUBMISSION_ID_BYTES_MAX)
        entries = [self._entry(r) for r in records]
        self._check_count(len(entries))
        fingerprint = logical_digest(entries, [])

        def result(segment: SegmentRef) -> tuple[RecordRef, ...]:
            return tuple(RecordRef(segment, i) for i in range(len(entries)))

        return self._commit("write_records", submission_id, fingerprint, entries, result, [])

    def record_set(
        self, refs: Iterable[RecordRef], *, submission_id: str, dependencies: Iterable[RecordSetRef] = ()
    ) -> RecordSetRef:
        """Publish a manifest over records already written (same digest as publishing them directly)."""
        check_text(submission_id, "submission_id", SUBMISSION_ID_BYTES_MAX)
        session = self._session()
        located = [session.locate(r) for r in refs]
        self._check_count(len(located))
        deps = self._external_dependencies(list(dependencies))
        entries = [x.entry for x in located]
        segment_ids: dict[tuple[str, int], int] = {}
        segments: list[dict[str, Any]] = []
        pairs = []
        for x in located:
            key = (x.segment.path, x.segment.offset)
            if key not in segment_ids:
                segment_ids[key] = len(segments)
                segments.append(as_dict(x.segment))
            pairs.append((segment_ids[key], x.ordinal))
        set_digest = logical_digest(entries, [d["digest"] for d in deps])
        manifest = frame.Manifest(set_digest, tuple(pairs), tuple(segments), tuple(deps))
        manifest_entry = self._manifest_entry(manifest, "manifest")
        payload = sum(e.length for e in entries) + sum(_usage(d, "payload_bytes") for d in deps)
        tokens = sum(e.tokens for e in entries) + sum(_usage(d, "tokens") for d in deps)

        def result(segment: SegmentRef) -> RecordSetRef:
            return RecordSetRef(RecordRef(segment, 0), set_digest, len(entries), payload, tokens)

        # The records live in other extents: staging must keep them too (docs/GC.md).
        self._stage(submission_id, {0: [x.ref() for x in located] + list(dependencies)})
        return self._commit("record_set", submission_id, set_digest, [manifest_entry], result, [0])

    # -- writing: machinery -------------------------------------------------------------

    def _check_count(self, count: int) -> None:
        if count > self.max_records_per_write:
            raise ResourceLimitExceeded(f"{count} records in one write exceeds {self.max_records_per_write}")

    def _entry(self, record: Record) -> Entry:
        """Check one record against every limit and hash it; nothing is written yet."""
        if not isinstance(record, Record):
            raise TypeError(f"expected a straw Record, got {type(record).__name__}")
        record_id = check_text(record.record_id, "record_id", RECORD_ID_BYTES_MAX)
        if record.codec not in self.codecs:
            raise UnsupportedSchema(
                f"record {record_id!r}: codec {record.codec!r} is not registered with this store "
                f"(registered: {', '.join(self.codecs)}; pickle is never accepted)"
            )
        metadata = record.metadata
        if not isinstance(metadata, dict) or not all(isinstance(key, str) for key in metadata):
            raise TypeError(f"record {record_id!r}: metadata must be a dict with string keys")
        meta_text = encode_text(metadata)
        encoded = len(meta_text) if meta_text.isascii() else len(meta_text.encode("utf-8"))
        if encoded > METADATA_BYTES_MAX:
            raise ResourceLimitExceeded(
                f"record {record_id!r}: metadata is {encoded} bytes, the limit is {METADATA_BYTES_MAX}"
            )
        pairs = frame.text_pairs(meta_text)  # parsed from the text: the index and the text agree
        tokens = record.tokens
        if not isinstance(tokens, int) or isinstance(tokens, bool) or not 0 <= tokens <= TOKENS_MAX:
            raise ValueError(
                f"record {record_id!r}: tokens must be a non-negative 64-bit integer, got {tokens!r}"
            )
        view = _flat_view(record.payload, record_id)
        if view.nbytes > RECORD_BYTES_MAX:  # max_record_bytes is kept for compatibility only
            raise ResourceLimitExceeded(
                f"record {record_id!r}: payload of {view.nbytes} bytes exceeds the record limit of "
                f"{RECORD_BYTES_MAX} bytes (RECORD_BYTES_MAX)"
            )
        content = xxhash.xxh3_128_hexdigest(view)
        chunks = frame.chunk_checksums(view)
        return Entry(record_id, record.codec, metadata, tokens, view, content, chunks, None, meta_text, pairs)

    def _manifest_entry(self, manifest: frame.Manifest, record_id: str) -> Entry:
        empty = memoryview(b"")
        return Entry(record_id, frame.MANIFEST_CODEC, {}, 0, empty, "", "", frame.manifest_body(manifest))

    def _external_dependencies(
        self, dependencies: list[RecordSetRef], unstaged: frozenset[RecordSetRef] = frozenset()
    ) -> list[dict[str, Any]]:
        """Verify dependencies outside this call; their manifests must exist and match (I1).

        It returns no bytes, so, like ``reach``, it may use the index frames a store of this
        process wrote or verified (docs/DURABILITY.md D5): a training batch names the groups
        its builder has just read. Every pack a dependency names must then still be there:
        ``_stage``'s ``reach`` looks for those of the dependencies it stages, this for the
        ``unstaged`` ones (``owned_dependencies``), so each pack is looked for once.
        """
        if len(dependencies) > DEPENDENCIES_MAX:
            raise ResourceLimitExceeded(f"{len(dependencies)} dependencies exceed {DEPENDENCIES_MAX}")
        session = self._session(shared=True)
        out = []
        packs: set[str] = set()
        for dep in dependencies:
            if not isinstance(dep, RecordSetRef):
                raise TypeError(f"dependency must be a RecordSetRef, got {type(dep).__name__}")
            resolved = session.resolve(dep)
            if dep in unstaged:
                packs.add(dep.manifest.segment.path)
                packs |= resolved.record_paths()
            out.append({"digest": dep.digest, "ref": as_dict(dep)})
        self._check_present(packs, "dependency")
        return out

    def _publish(
        self,
        kind: str,
        publications: list[Publication],
        submission_id: str,
        owned: frozenset[RecordSetRef] = frozenset(),
    ) -> list[RecordSetRef]:
        check_text(submission_id, "submission_id", SUBMISSION_ID_BYTES_MAX)
        entries: list[Entry] = []
        sets: list[tuple[int, str, int, int, int]] = []  # manifest ordinal, digest, records, bytes, tokens
        manifests: list[frame.Manifest] = []
        for number, publication in enumerate(publications):
            if not isinstance(publication, Publication):
                raise TypeError(f"publish_many takes Publication objects, got {type(publication).__name__}")
            records = [self._entry(r) for r in publication.records]
            deps = self._publication_dependencies(publication.dependencies, number, sets, owned)
            set_digest = logical_digest(records, [d["digest"] for d in deps])
            first = len(entries)
            pairs = tuple((-1, first + i) for i in range(len(records)))
            entries.extend(records)
            manifest = frame.Manifest(set_digest, pairs, (), tuple(deps))
            manifests.append(manifest)
            entries.append(self._manifest_entry(manifest, f"manifest-{number}"))
            # Usage counts what the set reaches: its records plus each dependency, once per edge.
            payload = sum(e.payload.nbytes for e in records) + sum(_usage(d, "payload_bytes") for d in deps)
            tokens = sum(e.tokens for e in records) + sum(_usage(d, "tokens") for d in deps)
            sets.append((len(entries) - 1, set_digest, len(records), payload, tokens))
            self._check_count(len(entries))
        fingerprint = kind + ":" + ",".join(s[1] for s in sets)
        staged = {
            sets[number][0]: [
                d for d in publication.dependencies if isinstance(d, RecordSetRef) and d not in owned
            ]
            for number, publication in enumerate(publications)
        }
        self._stage(submission_id, staged)

        def result(segment: SegmentRef) -> list[RecordSetRef]:
            return [RecordSetRef(RecordRef(segment, s[0]), s[1], s[2], s[3], s[4]) for s in sets]

        refs = self._commit(kind, submission_id, fingerprint, entries, result, [x[0] for x in sets])
        _share_written(refs, manifests, publications)
        return refs

    def _publication_dependencies(
        self,
        dependencies: Sequence[RecordSetRef | int],
        number: int,
        earlier: list[tuple[int, str, int, int, int]],
        owned: frozenset[RecordSetRef],
    ) -> list[dict[str, Any]]:
        for dep in dependencies:
            if isinstance(dep, bool) or not isinstance(dep, (int, RecordSetRef)):
                raise TypeError(f"a dependency is a RecordSetRef or an int, got {type(dep).__name__}")
        external = [d for d in dependencies if not isinstance(d, int)]
        resolved = iter(self._external_dependencies(external, owned))
        out = []
        for dep in dependencies:
            if isinstance(dep, bool) or not isinstance(dep, int):
                out.append(next(resolved))
                continue
            if not 0 <= dep < number:
                raise InvalidReference(
                    f"publication {number}: int dependency {dep} must name an earlier publication "
                    "of the same call"
                )
            ordinal, set_digest, records, payload, tokens = earlier[dep]
            out.append(
                {
                    "digest": set_digest,
                    "self": ordinal,
                    "records": records,
                    "payload_bytes": payload,
                    "tokens": tokens,
                }
            )
        return out

    def _commit(
        self,
        kind: str,
        submission_id: str,
        fingerprint: str,
        entries: list[Entry],
        result: Callable[[SegmentRef], R],
        manifests: list[int],
    ) -> R:
        """Idempotency, uncertainty and the durable write of one extent (D1/D2, I4/I5)."""
        remembered = _Remembered(kind, fingerprint, None)
        with self._lock:
            row = self._submissions.get(submission_id)
            if row is not None:
                known = _Remembered.of_row(row)
                if (known.kind, known.fingerprint) != (kind, fingerprint):
                    raise IdempotencyConflict(
                        f"submission {submission_id!r} was already used for different content; use a new id"
                    )
                self._counts["idempotent_hits"] += 1
                return cast(R, known.result)
            pending = self._pending
            if pending is not None:
                return cast(R, self._resolve_pending(pending, submission_id, remembered))
            self._ensure_catalog()
            began, written_before = time.perf_counter(), self._writer.bytes_written
            try:
                segment = self._writer.write(entries, submission_id, manifests)
            except CommitUncertain as uncertain:
                value = result(uncertain.segment)
                self._pending = _Pending(
                    submission_id, _Remembered(kind, fingerprint, value), uncertain.dir_sync
                )
                self._account(entries, kind)
                raise IndeterminateCommit(
                    f"submission {submission_id!r} may or may not be durable ({uncertain.cause!r}); "
                    "retry the same submission to resolve it"
                ) from uncertain.cause
            except OSError as error:
                raise posix.storage_error(error, f"publishing submission {submission_id!r}") from error
            value = result(segment)
            self._account(entries, kind)
            if tracing.enabled():
                self._trace_write(entries, self._writer.bytes_written - written_before, began)
            remembered = _Remembered(kind, fingerprint, value)
            try:
                self.backend.fault("after_publish")
            except OSError as error:
                # The extent is durable; an I/O error now only clouds the reply. Check it once
                # more from the file itself: readable means published (as the peer does).
                self._recheck(segment, submission_id, remembered, error)
            except BaseException:
                # Durable all the same: remember it, so the retry answers with this reference.
                self._remember(submission_id, remembered)
                raise
            self._remember(submission_id, remembered)
            return value

    def _trace_write(self, entries: Sequence[Entry], extent_bytes: int, began: float) -> None:
        """One ``write`` trace event: the extent's bytes and each record's size, codec and tokens
        (manifests under their ``straw.`` codec, which profiles leave out of payload bytes)."""
        sizes = [(len(encode(e.inline)) if e.inline is not None else e.payload.nbytes, e.codec, e.tokens)
                 for e in entries]  # fmt: skip
        tracing.emit("write", root=self.backend.root, size=extent_bytes,
                     seconds=time.perf_counter() - began, records=sizes)  # fmt: skip

    def _recheck(
        self, segment: SegmentRef, submission_id: str, remembered: _Remembered, error: OSError
    ) -> None:
        """After an I/O error at the reply: read the extent's index frame back (a fresh reader,
        no cache); if that fails too the outcome is uncertain (I5)."""
        reader = PackReader(self.backend, self.run_id)
        try:
            reader.index(segment)
        except (QueueError, OSError):
            self._pending = _Pending(submission_id, remembered, None)
            raise IndeterminateCommit(
                f"submission {submission_id!r} is durable but could not be read back after {error!r}; "
                "retry the same submission to get its reference"
            ) from error
        finally:
            reader.close()

    def _resolve_pending(self, pending: _Pending, submission_id: str, attempt: _Remembered) -> Any:
        if pending.submission_id != submission_id:
            raise WriterBusy(
                f"submission {pending.submission_id!r} has an uncertain outcome; retry it before writing "
                f"{submission_id!r}"
            )
        known = pending.remembered
        if (known.kind, known.fingerprint) != (attempt.kind, attempt.fingerprint):
            raise IdempotencyConflict(
                f"submission {submission_id!r} is retried with other content than its uncertain write"
            )
        if pending.dir_sync is not None:
            try:
                self._writer.finish_dir_sync(pending.dir_sync)
            except OSError as error:
                raise posix.storage_error(error, f"resolving submission {submission_id!r}") from error
        self._pending = None
        self._remember(submission_id, known)
        return known.result

    def _remember(self, submission_id: str, remembered: _Remembered) -> None:
        """I4: remember an answer for retries, oldest forgotten first, within both
        SUBMISSIONS_REMEMBERED_MAX submissions and SUBMITTED_REFS_REMEMBERED_MAX references."""
        known = self._submissions.pop(submission_id, None)
        if known is not None:
            self._remembered_refs -= _Remembered.of_row(known).references
        self._submissions[submission_id] = remembered.row()
        self._remembered_refs += remembered.references
        while len(self._submissions) > 1 and (
            len(self._submissions) > SUBMISSIONS_REMEMBERED_MAX
            or self._remembered_refs > SUBMITTED_REFS_REMEMBERED_MAX
        ):
            _, oldest = self._submissions.popitem(last=False)
            self._remembered_refs -= _Remembered.of_row(oldest).references

    def _account(self, entries: list[Entry], kind: str) -> None:
        data = [e for e in entries if e.codec != frame.MANIFEST_CODEC]
        self._counts["payload_bytes"] += sum(e.payload.nbytes for e in data)
        self._counts["records"] += len(data)
        self._counts["writes"] += 1
        self._counts["publications"] += len(entries) - len(data)

    # -- lifecycle ---------------------------------------------------------------------------

    def seal(self) -> None:
        """Close the current pack for appends; the next write opens a new pack (D4)."""
        with self._lock:
            try:
                self._writer.seal()
            except OSError as error:
                raise posix.storage_error(error, "sealing the current pack") from error

    def close(self) -> None:
        """Seal and release the writer; reads through this object stay possible until GC."""
        with self._lock:
            try:
                try:
                    self._flush_deferred()  # G6.2; if it fails, the writer's death ends them (G5)
                finally:
                    self._writer.close()
            except OSError as error:
                raise posix.storage_error(error, "closing the writer") from error
            finally:
                for session in self._sessions.members():
                    session._reader.close()  # descriptors only: reads through the store still work
                self._catalog.close()

    # -- lifetime (API.md sections 5 and 8; docs/GC.md) ----------------------------------------

    def _ensure_catalog(self) -> None:
        """I20: the pool's catalog exists before this store creates anything under ``raw/``
        (and a coordinator before its queue directory), so a pool that holds writers or
        queues but no catalog has lost it, and every catalog call then fails closed."""
        if self._catalog_ready:
            return
        if not posix.exists(self._catalog.path):
            try:
                with self._catalog.locked():
                    pass  # creates the log in a pool that never had one
            except UnsafeRecovery:
                # The pool lost its catalog: nothing here may recreate it (that would drop every
                # owner). Writing new packs stays possible; every catalog call fails closed.
                return
        self._catalog_ready = True

    def _record_seal(self, relative: str, extents: dict[int, tuple[int, ...]]) -> None:
        with self._catalog.locked() as catalog:
            seal = {"op": "seal", "pack": relative, "extents": {str(k): list(v) for k, v in extents.items()}}
            catalog.append([seal, *self._take_deferred(catalog)])

    def validate_reach(
        self, ref: RecordSetRef, *, task_id: str, attempt_id: str, adoption: Adoption | None = None
    ) -> set[str]:
        """``validate`` with ownership plus ``reach`` in one resolution (the queue's complete path).

        It returns no bytes, so it may use index frames that a store of this process wrote
        and made durable without reading them back (``SHARED_INDEXES``). With ``adoption``,
        it also notes what the result's staging is (docs/GC.md "Queue adoption").
        """
        session = self._session(shared=True)
        resolved = session.resolve(ref)
        session.check_ownership(resolved, task_id, attempt_id)
        if adoption is not None:
            self._note_adoption(session, ref, resolved, adoption)
        packs = {ref.manifest.segment.path} | resolved.record_paths()
        self._check_present(packs, "result")
        if resolved.dependencies:
            more = self._reach(resolved.dependencies, adoption) - packs  # each pack looked at once
            self._check_present(more, "record set")
            packs |= more
        return packs

    def reach(
        self, refs: Iterable[RecordSetRef | RecordRef], *, adoption: Adoption | None = None
    ) -> set[str]:
        """Every pack the references reach: records, manifests and dependencies, transitively.

        With ``adoption``, every record set met (dependencies included) is noted as taken
        over by the caller, which will end its staging once it owns it durably.

        It returns no bytes, so, like completion validation, it may use the index frames a
        store of this process made durable (docs/DURABILITY.md D5): ``retain`` and the
        queue's ownership of inputs and results mostly name what this process just wrote.
        """
        packs = self._reach(refs, adoption)
        self._check_present(packs, "record set")
        return packs

    def _reach(self, refs: Iterable[RecordSetRef | RecordRef], adoption: Adoption | None) -> set[str]:
        """:meth:`reach` before its packs are looked for on disk."""
        session = self._session(shared=True)
        packs: set[str] = set()
        seen: set[tuple[str, int, int]] = set()
        todo: list[RecordSetRef | RecordRef] = list(refs)
        while todo:
            ref = todo.pop()
            if isinstance(ref, RecordRef):
                session.locate(ref)
                packs.add(ref.segment.path)
                continue
            if not isinstance(ref, RecordSetRef):
                raise TypeError(f"expected a RecordSetRef or RecordRef, got {type(ref).__name__}")
            key = (ref.manifest.segment.path, ref.manifest.segment.offset, ref.manifest.ordinal)
            if key in seen:
                continue
            seen.add(key)
            resolved = session.resolve(ref)
            if adoption is not None:
                self._note_adoption(session, ref, resolved, adoption)
            packs.add(ref.manifest.segment.path)
            packs |= resolved.record_paths()  # (no located record built per ordinal)
            todo.extend(resolved.dependencies)
        return packs

    def _check_present(self, packs: Iterable[str], what: str) -> None:
        """A shared index (or a session's open descriptor) answers without looking at the file:
        the data must still be there, or a retain, a task input or a result would be owned
        while unreadable. The paths passed the reference checks (raw/<writer>/<segment>.pack)
        and this only asks whether a file is there (nothing is read), so the symlink walk of
        ``backend.resolve`` is not needed. A pack a collection removed is named as such
        (the catalog's tombstones, caught up; never called with the catalog locked)."""
        root = self._root_text
        for path in packs:
            if not posix.exists(os.path.join(root, path)):
                self._refuse_collected({path}, catch_up=True)
                raise StorageUnavailable(f"{path} holding this {what} no longer exists; its data is gone")

    def _note_adoption(
        self, session: ReadSession, ref: RecordSetRef, resolved: _Resolved, adoption: Adoption
    ) -> None:
        """What ends a publication's staging: its manifest, its staging owner, and the
        ``write_records`` extents it names whole (an extent it names only in part may still
        be combined into another set, so its staging goes on)."""
        segment = ref.manifest.segment
        ordinal = ref.manifest.ordinal
        adoption.items.add((segment.path, segment.offset, ordinal))
        submission = session.index(segment).submission_id
        adoption.owners.add(self._staging_owner(writer_of(segment.path), submission, ordinal))
        outside: dict[tuple[str, int], tuple[SegmentRef, set[int]]] = {}
        only = resolved.single_extent()
        if only is not None and (only.path, only.offset) == (segment.path, segment.offset):
            return  # every record is in the manifest's own extent (a usual publication)
        for located in resolved.records:
            where = (located.segment.path, located.segment.offset)
            if where != (segment.path, segment.offset):
                outside.setdefault(where, (located.segment, set()))[1].add(located.ordinal)
        for (path, offset), (records_segment, ordinals) in outside.items():
            if len(ordinals) == len(session.index(records_segment)):
                adoption.items.add((path, offset, RECORDS_ONLY))

    @staticmethod
    def _check_owner(owner: str) -> str:
        check_text(owner, "owner", SUBMISSION_ID_BYTES_MAX)
        if owner.startswith(RESERVED_PREFIXES):
            raise ValueError(
                f"owner {owner!r}: names starting with {', '.join(RESERVED_PREFIXES)} are straw's own; "
                "choose another name"
            )
        return owner

    def _own(self, owner: str, packs: set[str], *, replace: bool, adopted: Adoption | None = None) -> None:
        """G3: record an owner's packs, refusing any pack already tombstoned. No name check:
        straw's own layers (the queue's ``queue:`` owner) call it directly. ``adopted`` ends
        the staging of publications that owner took over, in the same catalog frame."""
        with self._catalog.locked() as catalog:
            gone = sorted(packs & catalog.state.tombstones)
            if gone:
                raise InvalidReference(
                    f"cannot retain {gone[0]}: it was garbage-collected (reclaimed); republish the data"
                )
            events = [{"op": "retain" if replace else "add", "owner": owner, "packs": sorted(packs)}]
            if adopted:
                events += self._unstage_events(catalog, adopted)
            catalog.append(events + self._take_deferred(catalog))

    def _end_staging(self, adopted: Adoption) -> None:
        """Record that an owner took these publications over (docs/GC.md "Queue adoption")."""
        if adopted:
            with self._catalog.locked() as catalog:
                catalog.append(self._unstage_events(catalog, adopted) + self._take_deferred(catalog))

    @staticmethod
    def _unstage_events(catalog: Catalog, adopted: Adoption) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if adopted.items:
            events.append({"op": "unstage", "items": [list(x) for x in sorted(adopted.items)]})
        owners = catalog.state.owners
        events += [{"op": "release", "owner": o} for o in sorted(adopted.owners) if o in owners]
        return events

    def _take_deferred(self, catalog: Catalog) -> list[dict[str, Any]]:
        """G6.2: the staging ends released with ``defer=True`` so far, as events of the frame
        being written (with the catalog lock held). Items of packs already tombstoned are
        dropped: an owner took them over and they were collected, nothing is staged there.
        If that frame fails, they are lost, which retains too much, never too little."""
        with self._deferred_lock:
            deferred, self._deferred = self._deferred, Adoption()
        if not deferred:
            return []
        gone = catalog.state.tombstones
        deferred.items = {item for item in deferred.items if item[0] not in gone}
        return self._unstage_events(catalog, deferred)

    def _flush_deferred(self) -> None:
        """Write the deferred staging ends now (before this store reads the catalog's state)."""
        with self._deferred_lock:
            if not self._deferred:
                return
        with self._catalog.locked() as catalog:
            catalog.append(self._take_deferred(catalog))

    def _reach_live(self, refs: Iterable[RecordSetRef | RecordRef]) -> set[str]:
        """``reach``, but data already collected is named as such (not as "not visible").

        Only a message: the decision is ``_own``'s, under the lock (G3, I15). Tombstones are
        never withdrawn, so this process's view of the catalog names a collected pack without
        a locked section of its own; a view that never caught up catches up first, and a
        reach that fails asks the caught-up catalog before it reports the failure.
        """
        items = list(refs)
        for ref in items:
            if not isinstance(ref, (RecordSetRef, RecordRef)):
                raise TypeError(f"expected a RecordSetRef or RecordRef, got {type(ref).__name__}")
        direct = {r.manifest.segment.path if isinstance(r, RecordSetRef) else r.segment.path for r in items}
        self._refuse_collected(direct, catch_up=not self._catalog.end)
        try:
            return self.reach(items)
        except QueueError:
            self._refuse_collected(direct, catch_up=True)
            raise

    def _refuse_collected(self, packs: set[str], *, catch_up: bool) -> None:
        if catch_up:
            with self._catalog.locked() as catalog:
                gone = sorted(packs & catalog.state.tombstones)
        else:
            gone = sorted(packs & self._catalog.state.tombstones)
        if gone:
            raise InvalidReference(
                f"cannot retain {gone[0]}: it was garbage-collected (reclaimed); republish the data"
            )

    def retain(self, owner: str, refs: Iterable[RecordSetRef | RecordRef]) -> None:
        """Make ``owner`` the (only) reason to keep exactly what ``refs`` reach; replaces its roots."""
        self._own(self._check_owner(owner), self._reach_live(refs), replace=True)

    def release(self, owner: str) -> None:
        """Drop an owner; what only it reached becomes collectable."""
        self._check_owner(owner)
        self._release(owner)

    def _release(self, owner: str) -> None:
        with self._catalog.locked() as catalog:
            if owner not in catalog.state.owners:
                raise KeyError(f"unknown owner {owner!r}: it was never retained or is already released")
            catalog.append([{"op": "release", "owner": owner}, *self._take_deferred(catalog)])

    def _staging_owner(self, writer: str, submission_id: str, ordinal: int) -> str:
        return f"staging:{writer}:{digest(submission_id)[:32]}:{ordinal}"

    def _stage(self, submission_id: str, outside: Mapping[int, Sequence[RecordSetRef | RecordRef]]) -> None:
        """docs/GC.md "Staging": what a publication reaches outside its own extent stays alive
        with it. Recorded before the write, refusing data already collected (G3, G6.3)."""
        events = []
        with_outside = {ordinal: refs for ordinal, refs in outside.items() if refs}
        if not with_outside:
            return
        owned: dict[str, set[str]] = {}
        for ordinal, refs in with_outside.items():
            owned[self._staging_owner(self.writer_id, submission_id, ordinal)] = self.reach(refs)
        with self._catalog.locked() as catalog:
            for owner, packs in owned.items():
                gone = sorted(packs & catalog.state.tombstones)
                if gone:
                    raise InvalidReference(
                        f"a dependency in {gone[0]} was garbage-collected (reclaimed); republish it"
                    )
                events.append({"op": "retain", "owner": owner, "packs": sorted(packs)})
            catalog.append(events + self._take_deferred(catalog))

    def release_publications(self, refs: Iterable[RecordSetRef], *, defer: bool = False) -> None:
        """End the staging of publications (they stay alive only through owners from now on).

        Records written by ``write_records`` stay staged with their writer (another record
        set may still name them); see docs/GC.md. With ``defer=True`` the end is written with
        this store's next catalog frame instead of one of its own (docs/DURABILITY.md G6.2):
        for publications an owner has already taken over, whose staging only makes them
        collectable a little sooner.
        """
        # It returns no bytes, so, like completion validation, it may trust the index frames
        # this process wrote (docs/DURABILITY.md D5): a writer releases what it just wrote.
        session = self._session(shared=True)
        items: set[tuple[str, int, int]] = set()
        owners: set[str] = set()
        for ref in refs:
            if not isinstance(ref, RecordSetRef):
                raise TypeError(f"release_publications takes RecordSetRef, got {type(ref).__name__}")
            session.resolve(ref)
            segment = ref.manifest.segment
            items.add((segment.path, segment.offset, ref.manifest.ordinal))
            index = session.index(segment)
            owners.add(
                self._staging_owner(writer_of(segment.path), index.submission_id, ref.manifest.ordinal)
            )
        if not items:
            return
        if defer:
            with self._deferred_lock:
                self._deferred.update(Adoption(items, owners))
                due = len(self._deferred.items) + len(self._deferred.owners) >= ADOPTIONS_PENDING_MAX
            if due:
                self._flush_deferred()
            return
        with self._catalog.locked() as catalog:
            events: list[dict[str, Any]] = [{"op": "unstage", "items": [list(x) for x in sorted(items)]}]
            events += [{"op": "release", "owner": o} for o in sorted(owners) if o in catalog.state.owners]
            catalog.append(events + self._take_deferred(catalog))

    @contextlib.contextmanager
    def pin(self, refs: Iterable[RecordSetRef | RecordRef], *, owner: str | None = None) -> Iterator[str]:
        """Keep what ``refs`` reach alive for the ``with`` block (an owner released on exit)."""
        name = self._check_owner(owner) if owner is not None else f"pin:{secrets.token_hex(16)}"
        self._own(name, self._reach_live(refs), replace=True)
        try:
            yield name
        finally:
            self._release(name)

    def collect_garbage(self) -> dict[str, Any]:
        """Reclaim sealed packs that no owner reaches and whose staging is over (G4, G5)."""
        try:
            self._flush_deferred()
            return gc.collect(
                self._catalog, self.backend, self.writer_id if not self._writer.closed else None
            )
        except OSError as error:
            raise posix.storage_error(error, "collecting garbage") from error

    def explain(self, pack: str) -> dict[str, Any]:
        """Why a pack (``raw/<writer>/<segment>.pack``) is kept: its owners, seal and staging."""
        if not isinstance(pack, str):
            raise TypeError(f"explain takes a pool-relative pack path, got {type(pack).__name__}")
        path = self.backend.resolve(pack)  # refuses empty, absolute and escaping paths first
        self._flush_deferred()
        with self._catalog.locked() as catalog:
            answer = catalog.state.why(pack)
        answer["exists"] = posix.exists(path)
        return answer

    def unowned(self, packs: Iterable[str]) -> set[str]:
        """Those of ``packs`` that no owner in the catalog holds right now."""
        wanted = set(packs)
        with self._catalog.locked() as catalog:
            for held in catalog.state.owners.values():
                wanted -= held
        return wanted

    def owners(self, prefix: str = "") -> list[str]:
        """Names of the owners the pool's catalog records now whose name starts with ``prefix``.

        Sorted; straw's own owners (``staging:``, ``queue:``, ``pin:``) are listed too, so a
        prefix naming an application's owners (``checkpoint:<dir>/``) is the usual call.
        """
        if not isinstance(prefix, str):
            raise TypeError(f"owners() takes a text prefix, got {type(prefix).__name__}")
        self._flush_deferred()
        with self._catalog.locked() as catalog:
            return sorted(name for name in catalog.state.owners if name.startswith(prefix))

    def _owned(self, owner: str) -> set[str]:
        self._flush_deferred()
        return self._owner_packs(owner) or set()

    def _owner_packs(self, owner: str) -> set[str] | None:
        """The packs ``owner`` reaches, or None when the catalog does not know it."""
        with self._catalog.locked() as catalog:
            packs = catalog.state.owners.get(owner)
            return set(packs) if packs is not None else None

    # -- reading -----------------------------------------------------------------------------

    def _session(self, *, shared: bool = False) -> ReadSession:
        """This thread's session; ``shared`` also trusts index frames this process wrote (reader.py)."""
        name = "validator" if shared else "session"
        session: ReadSession | None = getattr(self._local, name, None)
        if session is None or session.forked:  # a forked child reads through sessions of its own
            session = ReadSession(self.backend, self.run_id, shared=shared)
            setattr(self._local, name, self._sessions.add(session))
        return session

    @contextlib.contextmanager
    def read_session(self) -> Iterator[ReadSession]:
        """A reader that caches open packs and parsed indices across reads (not a pin)."""
        session = ReadSession(self.backend, self.run_id)
        try:
            yield session
        finally:
            session.close()

    def read(self, ref: RecordSetRef) -> Iterator[Record]:
        return self._session().read(ref)

    def read_record(self, ref: RecordRef) -> Record:
        return self._session().read_record(ref)

    def manifest(self, ref: RecordSetRef) -> dict[str, Any]:
        return self._session().manifest(ref)

    def validate(
        self, ref: RecordSetRef, *, task_id: str | None = None, attempt_id: str | None = None
    ) -> tuple[RecordRef, ...]:
        return self._session().validate(ref, task_id=task_id, attempt_id=attempt_id)

    def envelope(self, ref: RecordRef) -> dict[str, Any]:
        return self._session().envelope(ref)

    def read_range(
        self,
        ref: RecordRef,
        start: int,
        stop: int,
        *,
        chunk_bytes: int | None = None,
        checksums: Sequence[str] | None = None,
    ) -> memoryview:
        return self._session().read_range(ref, start, stop, chunk_bytes=chunk_bytes, checksums=checksums)

    def inspect_segment(self, segment: SegmentRef, *, verify_payload: bool = False) -> dict[str, Any]:
        return self._session().inspect_segment(segment, verify_payload=verify_payload)

    def discover(self, partition: str) -> Iterator[SegmentRef]:
        """Every extent of the sealed packs of one writer directory ``raw/<partition>/`` (a
        writer id), index frames verified; packs still open for appends are skipped. Finding
        an extent says nothing of whether anything references or owns it."""
        if not isinstance(partition, str) or not WRITER_NAME.fullmatch(partition):
            raise InvalidReference(f"partition {partition!r} is not a writer directory of raw/")
        directory = self.backend.resolve(f"raw/{partition}")
        try:
            names = sorted(posix.listdir(directory))
        except FileNotFoundError:
            return
        except OSError as error:
            raise posix.storage_error(error, f"listing {directory}") from error
        reader = PackReader(self.backend, self.run_id)
        try:
            for name in names:
                if PACK_NAME.fullmatch(name):
                    try:
                        found = reader.sealed_extents(f"raw/{partition}/{name}")
                    except OSError as error:
                        raise posix.storage_error(error, f"reading raw/{partition}/{name}") from error
                    yield from found or ()
        finally:
            reader.close()


invariant(frame.MANIFEST_CODEC.startswith("straw."), "internal codecs live in the reserved namespace")
