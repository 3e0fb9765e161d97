"""Terminal history of a queue on disk: sealed, checksummed, indexed files (docs/FORMAT.md 8.4).

A background snapshot (docs/DURABILITY.md J5, H1-H3) moves what can never change again
out of the queue's state into ``hist/<seq>.hist``: tasks that are completed, failed or
cancelled as of frame ``seq``, and every accepted receipt below that frame's accepted
count (a receipt is immutable once accepted). The snapshot then names the file with its
size and index checksum; the state keeps only live work plus the list of files.

A file is written once and never changed. Its rows are canonical JSON, each with its
own checksum in the index; the index (sorted 64-bit hashes of task ids and submission
ids, and one entry per accepted position) and the trailer carry a checksum of their
own. Opening a file reads only its trailer; the hashes are loaded on the first lookup
(8 bytes per task and per submission), and each answer reads one entry and one row.
Anything that does not check out raises :class:`CorruptData` naming the file; a file
that cannot be read raises :class:`StorageUnavailable`.
"""

from __future__ import annotations

import array
import bisect
import struct
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, cast

import xxhash

from ..errors import CorruptData, StorageUnavailable, invariant
from ..limits import HISTORY_BLOCK_ROWS, HISTORY_UNMERGED_FILES_MAX
from ..protocol import decode, encode

HIST_DIR = "hist"
SUFFIX = ".hist"
MAGIC = b"STRWHIST"
END_MAGIC = b"STRWHEND"
#: Version 2 adds request rows and their index (docs/FORMAT.md 8.4); version 1 is still read.
END_MAGIC_2 = b"STRWHND2"
VERSION = 2
#: magic, version, flags (0), sequence number of the snapshot frame, first accepted position.
HEADER = struct.Struct("<8sIIQQ")
#: A row's place: offset, length, reserved (0), xxh3-64 of the row's bytes.
ENTRY = struct.Struct("<QIIQ")
#: magic, p0, p1, task count, submission count, index offset, the meta row's ENTRY fields,
#: then xxh3-64 of the header, the index and the trailer bytes before it.
TRAILER = struct.Struct("<8sQQQQQQIIQQ")
#: Version 2: magic, p0, p1, task count, submission count, request count, index offset, the
#: meta row's ENTRY fields, then the checksum (as in version 1).
TRAILER_2 = struct.Struct("<8sQQQQQQQIIQQ")
_U64 = struct.Struct("<Q")


class Source(Protocol):
    """Where a history file's bytes come from (the shell's file, ``straw._journal.history_io``).
    Both raise ``FileNotFoundError`` for a missing file and ``OSError`` when it cannot be read."""

    path: str

    def size(self) -> int: ...

    def pread(self, size: int, offset: int) -> bytes | bytearray: ...

    def close(self) -> None: ...


#: Opens the source of one history file by its name (``hist/<name>``).
Opener = Callable[[str], Source]


def file_name(seq: int) -> str:
    return f"{seq:020d}{SUFFIX}"


def key_hash(key: str) -> int:
    return int(xxhash.xxh3_64_intdigest(key.encode("utf-8")))


def _row_hash(data: bytes | bytearray) -> int:
    return int(xxhash.xxh3_64_intdigest(bytes(data)))


class Rows(Protocol):
    """Rows of a history file with their keys, built only when asked for: a file's rows are
    encoded a block at a time, so the rows of a block die young instead of piling up (as
    tens of thousands of lists and dicts) for a cycle collection to walk (issue 12)."""

    def __len__(self) -> int: ...

    def key(self, at: int) -> str: ...

    def rows(self, ats: Sequence[int]) -> list[Any]: ...


class Pairs:
    """:class:`Rows` over ``(key, row)`` pairs already in memory."""

    def __init__(self, pairs: Sequence[tuple[str, Any]]) -> None:
        self._pairs = pairs

    def __len__(self) -> int:
        return len(self._pairs)

    def key(self, at: int) -> str:
        return self._pairs[at][0]

    def rows(self, ats: Sequence[int]) -> list[Any]:
        return [self._pairs[at][1] for at in ats]


def _rows(given: Rows | Sequence[tuple[str, Any]]) -> Rows:
    if isinstance(given, (list, tuple)):
        return Pairs(given)
    return cast(Rows, given)


def build(
    seq: int,
    first: int,
    tasks: Rows | Sequence[tuple[str, Any]],
    receipts: Rows | Sequence[tuple[str, Any]],
    meta: dict[str, Any],
    requests: Sequence[tuple[str, Any]] | None = None,
) -> tuple[list[bytes], int]:
    """The bytes of one history file (pure) and its index checksum.

    ``tasks`` are (task id, row); ``receipts`` are (submission id, row) for the accepted
    positions ``first``, ``first + 1``, ... in order; ``meta`` is the file's summary row;
    ``requests`` are (request id, row). With ``requests`` None the file is version 1 (which
    holds no requests: golden bytes and tests of older files); otherwise version 2. Tasks
    and receipts may also come as :class:`Rows`, built a block at a time.
    """
    version = 1 if requests is None else VERSION
    header = HEADER.pack(MAGIC, version, 0, seq, first)
    blocks: list[bytes] = []
    offset = len(header)

    def put(values: Rows, order: Sequence[int]) -> list[bytes]:
        """Rows in blocks of HISTORY_BLOCK_ROWS, each block compressed: the entries of the rows."""
        nonlocal offset
        entries = []
        for start in range(0, len(order), HISTORY_BLOCK_ROWS):
            chunk = values.rows(order[start : start + HISTORY_BLOCK_ROWS])
            data = zlib.compress(encode(chunk), 1)
            blocks.append(data)
            checksum = _row_hash(data)
            entries += [ENTRY.pack(offset, len(data), k, checksum) for k in range(len(chunk))]
            offset += len(data)
        return entries

    def hashed(values: Rows) -> list[tuple[int, bytes]]:
        """(key hash, entry) of every row, in hash order (the order of the rows in the file)."""
        hashes = [key_hash(values.key(at)) for at in range(len(values))]
        order = sorted(range(len(values)), key=hashes.__getitem__)
        return list(zip([hashes[at] for at in order], put(values, order), strict=True))

    task_rows, receipt_rows = _rows(tasks), _rows(receipts)
    task_index = hashed(task_rows)
    position_entries = put(receipt_rows, range(len(receipt_rows)))
    sub_index = sorted((key_hash(receipt_rows.key(k)), first + k) for k in range(len(receipt_rows)))
    request_index = hashed(Pairs(requests or ()))
    (meta_entry,) = put(Pairs([("", meta)]), [0])
    index_at = offset
    parts = [
        array.array("Q", [h for h, _ in task_index]).tobytes(),
        b"".join(e for _, e in task_index),
        array.array("Q", [h for h, _ in sub_index]).tobytes(),
        array.array("Q", [p for _, p in sub_index]).tobytes(),
        b"".join(position_entries),
    ]
    if version == 2:
        parts += [
            array.array("Q", [h for h, _ in request_index]).tobytes(),
            b"".join(e for _, e in request_index),
        ]
    index = b"".join(parts)
    invariant(array.array("Q").itemsize == 8, "array 'Q' holds 64-bit values")
    m_offset, m_length, _, m_hash = ENTRY.unpack(meta_entry)
    counts = (first, first + len(receipts), len(task_index), len(sub_index))
    meta_fields = (m_offset, m_length, 0, m_hash, 0)
    if version == 1:
        body = TRAILER.pack(END_MAGIC, *counts, index_at, *meta_fields)[: -_U64.size]
    else:
        body = TRAILER_2.pack(END_MAGIC_2, *counts, len(request_index), index_at, *meta_fields)[: -_U64.size]
    checksum = _row_hash(header + index + body)
    return [header, *blocks, index, body + _U64.pack(checksum)], checksum


class HistoryFile:
    """One sealed history file, read lazily (trailer at open, hashes at the first lookup)."""

    def __init__(self, name: str, source: Source, size: int, checksum: int) -> None:
        self.path = source.path
        self.name = name
        self.size = size
        self.checksum = checksum
        self._source = source
        self._block: tuple[int, list[Any]] | None = None  # the last block read, decoded
        self._hashes: tuple[array.array[int], array.array[int], array.array[int]] | None = None
        self._read_trailer()
        source.close()  # a file is read again only when a lookup needs it (it may never)

    def describe(self) -> list[Any]:
        """How a snapshot names this file: [name, size, index checksum, p0, p1, counts]."""
        return [self.name, self.size, self.checksum, self.first, self.stop, self.counts]

    def _corrupt(self, why: str) -> CorruptData:
        return CorruptData(f"queue history file {self.path} is damaged: {why}")

    def _missing(self) -> CorruptData:
        return CorruptData(
            f"queue history file {self.path} named by the queue's snapshot is missing: the "
            "terminal tasks and receipts it holds cannot be answered (restore it from a copy)"
        )

    def _unreadable(self, error: OSError) -> StorageUnavailable:
        return StorageUnavailable(f"reading queue history file {self.path}: {error}")

    def _pread(self, size: int, offset: int) -> bytes | bytearray:
        try:
            data = self._source.pread(size, offset)
        except FileNotFoundError:
            raise self._missing() from None
        except OSError as error:
            raise self._unreadable(error) from error
        if len(data) != size:
            raise self._corrupt(f"{size} bytes at {offset} are past its end (torn or truncated)")
        return data

    def close(self) -> None:
        self._source.close()

    def _read_trailer(self) -> None:
        try:
            actual = self._source.size()
        except FileNotFoundError:
            raise self._missing() from None
        except OSError as error:
            raise self._unreadable(error) from error
        if actual != self.size:
            raise self._corrupt(f"it holds {actual} bytes, its snapshot recorded {self.size}")
        if self.size < HEADER.size + TRAILER.size:
            raise self._corrupt("too short to hold a header and a trailer")
        # A version 2 trailer is longer and starts with a magic of its own (a version 1 file's
        # index bytes at that place would have to spell it, and then its checksum would still
        # have to be the snapshot's); anything else is read as a version 1 trailer.
        self.version, self.trailer_size, requests = 1, TRAILER.size, 0
        fields: tuple[Any, ...] = ()
        if self.size >= HEADER.size + TRAILER_2.size:
            longer = TRAILER_2.unpack(bytes(self._pread(TRAILER_2.size, self.size - TRAILER_2.size)))
            if longer[0] == END_MAGIC_2:
                self.version, self.trailer_size, requests = 2, TRAILER_2.size, longer[5]
                fields = longer[:5] + longer[6:]  # the version 1 fields, in their order
        if not fields:
            fields = TRAILER.unpack(bytes(self._pread(TRAILER.size, self.size - TRAILER.size)))
            if fields[0] != END_MAGIC:
                raise self._corrupt("no trailer (a torn write)")
        _, first, stop, tasks, subs, index_at, m_off, m_len, _, m_hash, checksum = fields
        if checksum != self.checksum:
            raise self._corrupt(
                f"trailer checksum {checksum:016x}, its snapshot recorded {self.checksum:016x}"
            )
        self.first, self.stop, self.tasks, self.subs, self.index_at = first, stop, tasks, subs, index_at
        self.requests = requests
        self._meta_entry = (m_off, m_len, m_hash)
        expected = self._requests_at() + (8 + ENTRY.size) * requests
        if expected + self.trailer_size != self.size:
            raise self._corrupt("its trailer's counts do not match its size")
        self.counts: dict[str, int] = {}

    def load(self) -> tuple[array.array[int], array.array[int], array.array[int]]:
        """The index, checked once against the trailer's checksum: the hashes of task ids,
        submission ids and request ids (none in version 1) stay in memory."""
        hashes = self._hashes  # once: another thread may unload them
        if hashes is not None:
            return hashes
        header = bytes(self._pread(HEADER.size, 0))
        end = self.size - self.trailer_size
        index = self._pread(end - self.index_at, self.index_at)
        body = bytes(self._pread(self.trailer_size - _U64.size, end))
        if _row_hash(header + bytes(index) + body) != self.checksum:
            raise self._corrupt("its index does not match its checksum")
        magic, version, _, _, first = HEADER.unpack(header)
        if magic != MAGIC or version != self.version or first != self.first:
            raise self._corrupt(f"header magic {magic!r} version {version} is not a straw history file")
        tasks = array.array("Q")
        tasks.frombytes(bytes(index[: 8 * self.tasks]))
        at = (8 + ENTRY.size) * self.tasks
        subs = array.array("Q")
        subs.frombytes(bytes(index[at : at + 8 * self.subs]))
        at = self._requests_at() - self.index_at
        requests = array.array("Q")
        requests.frombytes(bytes(index[at : at + 8 * self.requests]))
        self._hashes = (tasks, subs, requests)
        return self._hashes

    def _requests_at(self) -> int:
        """Where the request hashes start (version 2; the end of the index in version 1)."""
        return int(
            self.index_at
            + (8 + ENTRY.size) * self.tasks
            + 16 * self.subs
            + ENTRY.size * (self.stop - self.first)
        )

    def _row(self, entry: bytes | bytearray) -> Any:
        offset, length, k, checksum = ENTRY.unpack(entry)
        if not HEADER.size <= offset <= offset + length <= self.index_at:
            raise self._corrupt(f"an index entry points outside its rows ({offset}+{length})")
        cached = self._block
        if cached is not None and cached[0] == offset:
            rows = cached[1]  # paging (read_commits) reads a block's rows one after another
        else:
            data = self._pread(length, offset)
            if _row_hash(data) != checksum:
                raise self._corrupt(f"the block at offset {offset} does not match its checksum")
            try:
                rows = decode(zlib.decompress(bytes(data)))
            except (CorruptData, zlib.error) as error:
                raise self._corrupt(
                    f"the block at offset {offset} is not compressed JSON ({error})"
                ) from None
            if not isinstance(rows, list):
                raise self._corrupt(f"the block at offset {offset} is not a list of rows")
            self._block = (offset, rows)
        if k >= len(rows):
            raise self._corrupt(f"an index entry names row {k} of a block of {len(rows)}")
        return rows[k]

    def unload(self) -> None:
        """Drop the hashes from memory (a merged index covers this file); ``load`` reads them again."""
        self._hashes = None

    def task(self, task_id: str, wanted: int | None = None) -> Any | None:
        """The row of task ``task_id`` (its first element is the id), or None. ``wanted``: the
        id's :func:`key_hash`, when the caller has it."""
        return _probe(self.load()[0], task_id, wanted, self.task_at)

    def task_at(self, at: int, task_id: str) -> Any | None:
        """The row at place ``at`` of the task index if it is task ``task_id``'s (hashes collide)."""
        invariant(0 <= at < self.tasks, "a place of the task index")
        row = self._row(self._pread(ENTRY.size, self.index_at + 8 * self.tasks + ENTRY.size * at))
        return row if row[0] == task_id else None

    def position(self, submission_id: str, wanted: int | None = None) -> int | None:
        """The accepted position of ``submission_id`` if this file holds its receipt."""
        found: int | None = _probe(self.load()[1], submission_id, wanted, self.position_at)
        return found

    def position_at(self, at: int, submission_id: str) -> int | None:
        """The position at place ``at`` of the submission index if it is ``submission_id``'s."""
        invariant(0 <= at < self.subs, "a place of the submission index")
        base = self.index_at + (8 + ENTRY.size) * self.tasks + 8 * self.subs
        (position,) = _U64.unpack(self._pread(8, base + 8 * at))
        if not self.first <= position < self.stop:
            raise self._corrupt(f"its submission index names position {position}, outside its receipts")
        return int(position) if self.receipt(position)[0]["submission_id"] == submission_id else None

    def request(self, request_id: str, wanted: int | None = None) -> Any | None:
        """The row ``[request_id, fingerprint, reply]`` of a request this file holds, or None."""
        return _probe(self.load()[2], request_id, wanted, self.request_at)

    def request_at(self, at: int, request_id: str) -> Any | None:
        """The row at place ``at`` of the request index if it is request ``request_id``'s."""
        invariant(0 <= at < self.requests, "a place of the request index")
        base = self._requests_at() + 8 * self.requests
        row = self._row(self._pread(ENTRY.size, base + ENTRY.size * at))
        if not isinstance(row, list) or len(row) != 3:
            raise self._corrupt(f"the request row at place {at} is not [id, fingerprint, reply]")
        return row if row[0] == request_id else None

    def receipt(self, position: int) -> Any:
        """The row of accepted ``position``: [receipt, worker, packs]."""
        return self.receipts(position, position + 1)[0]

    def receipts(self, start: int, stop: int) -> list[Any]:
        """The rows of accepted positions ``start .. stop - 1``: their entries in one read, each
        block read and inflated once (paging asks for a run of positions at a time)."""
        invariant(self.first <= start < stop <= self.stop, "the positions are in this file")
        base = self.index_at + (8 + ENTRY.size) * self.tasks + 16 * self.subs
        entries = self._pread(ENTRY.size * (stop - start), base + ENTRY.size * (start - self.first))
        rows = []
        for position, at in zip(range(start, stop), range(0, len(entries), ENTRY.size), strict=True):
            row = self._row(entries[at : at + ENTRY.size])
            if not isinstance(row, list) or len(row) != 3 or row[0].get("position") != position:
                raise self._corrupt(f"the receipt row of position {position} names another position")
            rows.append(row)
        return rows

    def meta(self) -> Any:
        offset, length, checksum = self._meta_entry
        return self._row(ENTRY.pack(offset, length, 0, checksum))

    def task_rows(self) -> Iterator[Any]:
        """Every task row, in hash order (views over the whole history)."""
        base = self.index_at + 8 * self.tasks
        entries = self._pread(ENTRY.size * self.tasks, base)
        for k in range(self.tasks):
            yield self._row(entries[ENTRY.size * k : ENTRY.size * (k + 1)])

    def verify(self) -> None:
        """Every byte checked (``straw check``): the index, then every row by its checksum."""
        self.load()
        for _ in self.task_rows():
            pass
        for position in range(self.first, self.stop):
            self.receipt(position)
        base = self._requests_at() + 8 * self.requests
        entries = self._pread(ENTRY.size * self.requests, base)
        for k in range(self.requests):
            self._row(entries[ENTRY.size * k : ENTRY.size * (k + 1)])
        self.meta()


def _probe(
    hashes: array.array[int], key: str, wanted: int | None, at: Callable[[int, str], Any | None]
) -> Any | None:
    """What ``at(place, key)`` answers at the first place of ``hashes`` holding ``key``'s hash
    whose row is ``key``'s (hashes collide: each candidate's row names its key), else None."""
    wanted = key_hash(key) if wanted is None else wanted
    place = bisect.bisect_left(hashes, wanted)
    while place < len(hashes) and hashes[place] == wanted:  # bounded by the equal hashes
        found = at(place, key)
        if found is not None:
            return found
        place += 1
    return None


def open_files(opener: Opener, described: Sequence[Sequence[Any]]) -> list[HistoryFile]:
    """The files a snapshot names (trailers read and checked; indexes loaded when used)."""
    files = []
    for name, size, checksum, first, stop, counts in described:
        found = HistoryFile(str(name), opener(str(name)), int(size), int(checksum))
        if (found.first, found.stop) != (first, stop):
            raise found._corrupt(
                f"it holds positions {found.first}..{found.stop}, its snapshot says {first}..{stop}"
            )
        found.counts = dict(counts)
        files.append(found)
    return files


class Merged:
    """One sorted index over the task (``which`` 0), submission (1) or request (2) hashes of the first
    ``count`` files of a history: each hash with its file's number and its place in that file's
    index. Built from checked indexes, never changed (a new one replaces it), so a snapshot
    thread may build it while calls read the one before."""

    __slots__ = ("count", "hashes", "last", "owners", "places")

    def __init__(
        self,
        last: HistoryFile,
        count: int,
        hashes: array.array[int],
        owners: array.array[int],
        places: array.array[int],
    ) -> None:
        self.last, self.count, self.hashes, self.owners, self.places = last, count, hashes, owners, places

    def find(self, wanted: int) -> Iterator[tuple[int, int]]:
        """(file number, place) of each entry whose hash is ``wanted``."""
        at = bisect.bisect_left(self.hashes, wanted)
        while at < len(self.hashes) and self.hashes[at] == wanted:
            yield self.owners[at], self.places[at]
            at += 1


def merge(base: Merged | None, files: Sequence[HistoryFile], which: int) -> Merged:
    """``base`` extended to every file of ``files`` (``base`` covers a prefix of them): the new
    files' hashes are appended and the whole is sorted stably, which timsort does as a merge of
    sorted runs (linear in the entries, plus a log factor in the files merged at once)."""
    import numpy as np  # only the snapshot thread and the first lookup after a reopen merge

    invariant(bool(files), "a merged index covers at least one file")
    invariant(array.array("I").itemsize == 4, "array 'I' holds 32-bit values")
    start = base.count if base is not None else 0
    hashes, owners, places = [], [], []
    if base is not None:
        hashes.append(np.frombuffer(base.hashes, dtype=np.uint64))
        owners.append(np.frombuffer(base.owners, dtype=np.uint32))
        places.append(np.frombuffer(base.places, dtype=np.uint32))
    for number in range(start, len(files)):
        own = np.frombuffer(files[number].load()[which], dtype=np.uint64)
        hashes.append(own)
        owners.append(np.full(len(own), number, dtype=np.uint32))
        places.append(np.arange(len(own), dtype=np.uint32))
    joined = np.concatenate(hashes)  # never empty: one part per file at least
    order = np.argsort(joined, kind="stable")

    def pack(code: str, values: Any) -> array.array[int]:
        out = array.array(code)
        out.frombytes(values[order].tobytes())
        return out

    return Merged(
        files[-1],
        len(files),
        pack("Q", joined),
        pack("I", np.concatenate(owners)),
        pack("I", np.concatenate(places)),
    )


#: The merged indexes of a history: task ids, submission ids, request ids.
MergedIndexes = tuple[Merged, Merged, Merged]


class History:
    """The history files of one queue, oldest first: together they hold the accepted positions
    ``0 .. base - 1`` (each file a contiguous range) and every task moved out of the state.

    A lookup that misses memory must search every file (a new task id or submission id always
    does). Once more than HISTORY_UNMERGED_FILES_MAX files are outside the merged index, the
    next lookup merges them in (the snapshot thread usually did it already, :meth:`merged`),
    so a miss costs one bisect of the merged hashes plus one per file not yet merged.
    """

    def __init__(self, files: Sequence[HistoryFile] = (), merged: MergedIndexes | None = None) -> None:
        self.files: list[HistoryFile] = list(files)
        self._firsts = [f.first for f in self.files]
        self._merged = merged

    def __bool__(self) -> bool:
        return bool(self.files)

    def add(self, file: HistoryFile) -> None:
        invariant(file.first == self.base, "history files hold contiguous accepted positions")
        self.files.append(file)
        self._firsts.append(file.first)

    @property
    def base(self) -> int:
        return self.files[-1].stop if self.files else 0

    @property
    def merged_indexes(self) -> MergedIndexes | None:
        """The merged indexes in use (immutable: a copy of the state shares them)."""
        return self._merged

    def merge_due(self) -> bool:
        """Whether more than HISTORY_UNMERGED_FILES_MAX files are outside the merged indexes."""
        covered = self._merged[0].count if self._merged is not None else 0
        return len(self.files) - covered > HISTORY_UNMERGED_FILES_MAX

    def extended(self) -> MergedIndexes:
        """The merged indexes (tasks, submissions, requests) extended to every file, changing
        nothing here: the snapshot thread builds them on its copy for the live state to :meth:`adopt`."""
        merged = self._merged
        return (
            merge(merged[0] if merged else None, self.files, 0),
            merge(merged[1] if merged else None, self.files, 1),
            merge(merged[2] if merged else None, self.files, 2),
        )

    def merged(self) -> MergedIndexes | None:
        """The merged indexes a lookup uses, extended now if :meth:`merge_due` (after a reopen,
        or when no snapshot thread did it); None while the files are few."""
        if self.merge_due():
            self.adopt(self.extended())
        return self._merged

    def adopt(self, merged: MergedIndexes | None) -> None:
        """Use indexes merged over this history's first files (the snapshot thread's copy lists
        the same file objects); the files they cover drop their own hashes."""
        if merged is None:
            return
        count = merged[0].count
        current = self._merged[0].count if self._merged is not None else 0
        if count <= current or count > len(self.files) or merged[0].last is not self.files[count - 1]:
            return  # older than the one in use, or over files this history does not list
        self._merged = merged
        for file in self.files[:count]:
            file.unload()

    def _covered(self) -> tuple[MergedIndexes | None, Sequence[HistoryFile]]:
        merged = self.merged()
        return merged, self.files[merged[0].count :] if merged is not None else self.files

    def task(self, task_id: str) -> Any | None:
        """A task's row, or None (usually from the in-memory hashes alone, no read)."""
        return self._lookup(0, task_id, HistoryFile.task_at, HistoryFile.task)

    def position(self, submission_id: str) -> int | None:
        found: int | None = self._lookup(1, submission_id, HistoryFile.position_at, HistoryFile.position)
        return found

    def request(self, request_id: str) -> Any | None:
        """A request's row ``[request_id, fingerprint, reply]``, or None (docs/QUEUE.md
        "Idempotency": request ids live in history files once a snapshot moved them)."""
        return self._lookup(2, request_id, HistoryFile.request_at, HistoryFile.request)

    def _lookup(
        self,
        index: int,
        key: str,
        at: Callable[[HistoryFile, int, str], Any | None],
        probe: Callable[[HistoryFile, str, int], Any | None],
    ) -> Any | None:
        """``key`` in hash index ``index`` (tasks, submissions, requests): the merged index's
        candidates first, then each file it does not cover, newest first."""
        wanted = key_hash(key)
        merged, rest = self._covered()
        if merged is not None:
            for number, place in merged[index].find(wanted):
                found = at(self.files[number], place, key)
                if found is not None:
                    return found
        for file in reversed(rest):
            found = probe(file, key, wanted)
            if found is not None:
                return found
        return None

    def task_rows(self) -> Iterator[Any]:
        for file in self.files:
            yield from file.task_rows()

    def receipt(self, position: int) -> Any:
        """[receipt, worker, packs] of an accepted position below ``base``."""
        return self.receipts(position, position + 1)[0]

    def receipts(self, start: int, stop: int) -> list[Any]:
        """The rows of the accepted positions ``start .. stop - 1``, all below ``base``."""
        invariant(0 <= start <= stop <= self.base, "positions on disk")
        rows: list[Any] = []
        at = bisect.bisect_right(self._firsts, start) - 1
        while at > 0 and not start < self.files[at].stop:
            at -= 1  # a file without receipts shares its first position with the next one
        while start < stop:
            file = self.files[at]
            end = min(stop, file.stop)
            if start < end:
                rows += file.receipts(start, end)
                start = end
            at += 1
        return rows

    def counts(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for file in self.files:
            for state, count in file.counts.items():
                total[state] = total.get(state, 0) + count
        return total

    def describe(self) -> list[list[Any]]:
        return [file.describe() for file in self.files]

    def names(self) -> set[str]:
        return {file.name for file in self.files}

    def close(self) -> None:
        for file in self.files:
            file.close()
