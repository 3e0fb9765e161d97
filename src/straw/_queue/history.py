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
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol, cast

import xxhash

from ..errors import CorruptData, StorageUnavailable, invariant
from ..limits import (
    HISTORY_BLOCK_ROWS,
    HISTORY_RUN_ENTRIES_MAX,
    HISTORY_RUN_FILTER_BITS,
    HISTORY_RUN_FILTER_PROBES,
    HISTORY_RUN_PAGE_ENTRIES,
    HISTORY_UNMERGED_FILES_MAX,
)
from ..protocol import decode, encode_plain

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

    def keep_open(self) -> None:
        """Keep the file open from the first read until :meth:`close`, whatever else is read
        (an index run: its file may be deleted while it is still read, J5 H3)."""

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
            # encode_plain: the canonical bytes, faster. A row's values were all journaled
            # (canonically encoded) before they reached the state, so none is a NaN.
            data = zlib.compress(encode_plain(chunk), 1)
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
        self._totals: tuple[int, int, int] | None = None  # from the meta row, once read
        _checked(self._read_trailer, source)
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

    def _row(self, entry: bytes | bytearray, *, keep: bool = True) -> Any:
        """The row an index entry names; its block stays decoded (``_block``) when ``keep``."""
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
            if keep:
                self._block = (offset, rows)
        if k >= len(rows):
            raise self._corrupt(f"an index entry names row {k} of a block of {len(rows)}")
        return rows[k]

    def forget_block(self) -> None:
        """Drop the last block read (:meth:`History._warm`); the next read of it reads it again."""
        self._block = None

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
        """The file's meta row (its packs, workers and totals), read each time it is asked for:
        it lists every pack a position reached, so keeping it decoded in every file would make
        memory grow with history (issue 12), and the callers read each file's meta once per call."""
        offset, length, checksum = self._meta_entry
        return self._row(ENTRY.pack(offset, length, 0, checksum), keep=False)

    def worker_receipts(self, worker: str) -> list[dict[str, Any]]:
        """The receipts of the positions of this file that ``worker`` completed, in order.

        Reads the meta row and the worker's rows and keeps no block decoded afterwards (a
        retire asks every file); any thread may ask (a file never changes once written)."""
        meta = self.meta()
        workers = meta.get("workers") if isinstance(meta, dict) else None
        if not isinstance(workers, dict):
            raise self._corrupt("its meta row has no worker table")
        positions = workers.get(worker, ())
        if not all(type(p) is int and self.first <= p < self.stop for p in positions):
            raise self._corrupt(f"its worker table names positions of worker {worker!r} outside its receipts")
        try:
            return [self.receipt(p)[0] for p in positions]
        finally:
            self.forget_block()

    def written(self, meta: Any) -> None:
        """Take the counts and totals of the meta row this process just wrote into the file."""
        self.counts = dict(meta["counts"])
        self._totals = _totals(meta, self._corrupt)

    def totals(self) -> tuple[int, int, int]:
        """(records, payload bytes, tokens) of the file's accepted results: read from its meta
        row once, then kept (three numbers per file)."""
        totals = self._totals
        if totals is None:
            totals = self._totals = _totals(self.meta(), self._corrupt)
        return totals

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


def _totals(meta: Any, corrupt: Callable[[str], CorruptData]) -> tuple[int, int, int]:
    """A meta row's ``totals``, checked: three non-negative integers."""
    found = meta.get("totals") if isinstance(meta, dict) else None
    if not isinstance(found, list) or len(found) != 3 or any(type(n) is not int or n < 0 for n in found):
        raise corrupt(f"its meta row's totals are not three counts: {str(found)[:80]}")
    return found[0], found[1], found[2]


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


def _checked(read_trailer: Callable[[], None], source: Source) -> None:
    """A file whose trailer fails its check is not kept: its descriptor is given up."""
    try:
        read_trailer()
    except BaseException:
        source.close()
        raise


def close_all(opened: Iterable[HistoryFile | IndexRun]) -> None:
    """Give up the descriptors of history files and runs (a later read opens them again)."""
    for item in opened:
        item.close()


def open_files(opener: Opener, described: Sequence[Sequence[Any]]) -> list[HistoryFile]:
    """The files a snapshot names (trailers read and checked; indexes loaded when used)."""
    files: list[HistoryFile] = []
    try:
        for name, size, checksum, first, stop, counts in described:
            found = HistoryFile(str(name), opener(str(name)), int(size), int(checksum))
            files.append(found)
            if (found.first, found.stop) != (first, stop):
                raise found._corrupt(
                    f"it holds positions {found.first}..{found.stop}, its snapshot says {first}..{stop}"
                )
            found.counts = dict(counts)
    except BaseException:
        close_all(files)  # a snapshot that fails to open keeps no descriptor
        raise
    return files


class Merged:
    """One sorted index over the task (``which`` 0), submission (1) or request (2) hashes of the
    files ``start .. count - 1`` of a history: each hash with its file's number and its place in
    that file's index. Built in memory from checked indexes, never changed (a new one replaces
    it): only for files no index run covers yet (after a reopen of a queue whose snapshot names
    no runs, or while writing one fails); the snapshot thread writes runs instead."""

    __slots__ = ("count", "hashes", "last", "owners", "places", "start")

    def __init__(
        self,
        last: HistoryFile,
        count: int,
        hashes: array.array[int],
        owners: array.array[int],
        places: array.array[int],
        start: int = 0,
    ) -> None:
        self.last, self.count, self.hashes, self.owners, self.places = last, count, hashes, owners, places
        self.start = start

    def find(self, wanted: int) -> Iterator[tuple[int, int]]:
        """(file number, place) of each entry whose hash is ``wanted``."""
        at = bisect.bisect_left(self.hashes, wanted)
        while at < len(self.hashes) and self.hashes[at] == wanted:
            yield self.owners[at], self.places[at]
            at += 1


def merge(base: Merged | None, files: Sequence[HistoryFile], which: int, start: int = 0) -> Merged:
    """``base`` extended to the files ``start ..`` of ``files`` (``base``, if it starts there too,
    covers a prefix of them): the new files' hashes are appended and the whole is sorted stably,
    which timsort does as a merge of sorted runs."""
    import numpy as np  # only the first lookups after a reopen merge in memory

    invariant(start < len(files), "a merged index covers at least one file")
    invariant(array.array("I").itemsize == 4, "array 'I' holds 32-bit values")
    if base is not None and base.start != start:
        base = None
    begin = base.count if base is not None else start
    hashes, owners, places = [], [], []
    if base is not None:
        hashes.append(np.frombuffer(base.hashes, dtype=np.uint64))
        owners.append(np.frombuffer(base.owners, dtype=np.uint32))
        places.append(np.frombuffer(base.places, dtype=np.uint32))
    for number in range(begin, len(files)):
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
        start,
    )


#: The merged indexes of a history: task ids, submission ids, request ids.
MergedIndexes = tuple[Merged, Merged, Merged]


class History:
    """The history files of one queue, oldest first: together they hold the accepted positions
    ``0 .. base - 1`` (each file a contiguous range) and every task moved out of the state.

    A lookup that misses memory must search every file (a new task id or submission id always
    does). The index runs (docs/FORMAT.md 8.5) cover the files ``0 .. run_stop - 1``: a miss
    probes each run's filter in memory and reads a page of a run only when the filter lets it
    through, so memory holds about 1.3 bytes per entry whatever the history's size. The snapshot
    thread writes a run once more than HISTORY_UNMERGED_FILES_MAX files are outside the runs;
    until then (or after a reopen of a queue whose snapshot names no runs) those files are
    searched one by one, or merged in memory (:class:`Merged`) once more than that many are.
    """

    def __init__(
        self,
        files: Sequence[HistoryFile] = (),
        merged: MergedIndexes | None = None,
        runs: Sequence[IndexRun] = (),
    ) -> None:
        self.files: list[HistoryFile] = list(files)
        self._firsts = [f.first for f in self.files]
        self.runs: list[IndexRun] = list(runs)
        self._merged = merged
        self._last_read: HistoryFile | None = None
        #: worker -> its receipts in some files, read ahead of the coordinator's lock (read_ahead)
        self._ahead: dict[str, dict[HistoryFile, list[dict[str, Any]]]] = {}

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
    def run_stop(self) -> int:
        """Files ``0 .. run_stop - 1`` are covered by the index runs."""
        return self.runs[-1].stop if self.runs else 0

    @property
    def merged_indexes(self) -> MergedIndexes | None:
        """The in-memory merged indexes in use, if any (immutable: a copy of the state shares them)."""
        return self._merged

    def _outside(self) -> int:
        """The first file neither the runs nor the in-memory merged indexes cover."""
        return self._merged[0].count if self._merged is not None else self.run_stop

    def merge_due(self) -> bool:
        """Whether more than HISTORY_UNMERGED_FILES_MAX files are outside the runs and merged indexes."""
        return len(self.files) - self._outside() > HISTORY_UNMERGED_FILES_MAX

    def extended(self) -> MergedIndexes:
        """In-memory merged indexes over every file the runs do not cover (the fallback)."""
        merged, start = self._merged, self.run_stop
        return (
            merge(merged[0] if merged else None, self.files, 0, start),
            merge(merged[1] if merged else None, self.files, 1, start),
            merge(merged[2] if merged else None, self.files, 2, start),
        )

    def merged(self) -> MergedIndexes | None:
        """The in-memory merged indexes a lookup uses, extended now if :meth:`merge_due`; None
        while the files outside the runs are few."""
        if self.merge_due():
            self.adopt(self.extended())
        return self._merged

    def adopt(self, merged: MergedIndexes | None) -> None:
        """Use in-memory indexes merged over this history's files after its runs; the files they
        cover drop their own hashes."""
        if merged is None:
            return
        count = merged[0].count
        current = self._outside()
        if count <= current or count > len(self.files) or merged[0].last is not self.files[count - 1]:
            return  # older than the one in use, or over files this history does not list
        if merged[0].start != self.run_stop:
            return
        self._merged = merged
        for file in self.files[merged[0].start : count]:
            file.unload()

    # ------------------------------------------------------------------ index runs

    def run_plan(self) -> tuple[list[IndexRun], int, int] | None:
        """The next run to write if one is due: (the newest runs it absorbs, its first and stop
        file among those no run covers). Runs double as they merge, up to HISTORY_RUN_ENTRIES_MAX
        entries, so there are about log2(max / file) small runs plus one per full run."""
        start = self.run_stop
        if len(self.files) - start <= HISTORY_UNMERGED_FILES_MAX:
            return None
        stop, total = start, 0
        while stop < len(self.files):
            size = _file_entries(self.files[stop])
            if stop > start and total + size > HISTORY_RUN_ENTRIES_MAX:
                break
            total, stop = total + size, stop + 1
        absorbed: list[IndexRun] = []
        for run in reversed(self.runs):
            if run.entries > total or run.entries + total > HISTORY_RUN_ENTRIES_MAX:
                break
            absorbed.insert(0, run)
            total += run.entries
        return absorbed, start, stop

    def use_runs(self, runs: Sequence[IndexRun]) -> None:
        """Take over index runs covering more of this history's files (a snapshot thread wrote
        them over the same file objects): the runs they replace are closed, the in-memory merged
        indexes dropped and the newly covered files' hashes unloaded."""
        runs = list(runs)
        stop = runs[-1].stop if runs else 0
        if stop <= self.run_stop or stop > len(self.files):
            return
        old = self.run_stop
        keep = {id(run) for run in runs}
        for run in self.runs:
            if id(run) not in keep:
                run.close()
        self.runs = runs
        self._merged = None
        for file in self.files[old:stop]:
            file.unload()

    def _covered(self) -> tuple[MergedIndexes | None, Sequence[HistoryFile], int]:
        merged = self.merged()
        start = self._outside()
        return merged, self.files[start:], start

    def task(self, task_id: str) -> Any | None:
        """A task's row, or None (usually from the runs' filters alone, no read)."""
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
        """``key`` in hash index ``index`` (tasks, submissions, requests): each run's candidates,
        then the in-memory merged index's, then each file neither covers, newest first."""
        wanted = key_hash(key)
        merged, rest, _ = self._covered()
        # A run's filter first (no generator for the runs it rules out: every miss asks them all).
        candidates = [run.find(index, wanted) for run in reversed(self.runs) if run.holds(index, wanted)]
        if merged is not None:
            candidates.insert(0, merged[index].find(wanted))
        for found_at in candidates:
            for number, place in found_at:
                found = at(self.files[number], place, key)
                self._warm(self.files[number])
                if found is not None:
                    return found
        for file in reversed(rest):
            found = probe(file, key, wanted)
            if found is not None:
                self._warm(file)
                return found
        return None

    def task_rows(self) -> Iterator[Any]:
        for file in self.files:
            yield from file.task_rows()

    def receipt(self, position: int) -> Any:
        """[receipt, worker, packs] of an accepted position below ``base``."""
        return self.receipts(position, position + 1)[0]

    def receipt_dicts(self, start: int, stop: int) -> list[dict[str, Any]]:
        """The receipts of the accepted positions ``start .. stop - 1`` (what ``CommitLog``
        reads below its base: this object's bound method, which holds no QueueState, so a
        dropped state or snapshot copy is freed by reference counting, not by a full
        collection of the cycle collector)."""
        return [row[0] for row in self.receipts(start, stop)]

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
                self._warm(file)
                start = end
            at += 1
        return rows

    def _warm(self, file: HistoryFile) -> None:
        """Only the file read last keeps its last block decoded (paging reads a block's rows one
        after another): reading every file once must not leave a block in each (issue 12)."""
        last = self._last_read
        if last is not None and last is not file:
            last.forget_block()
        self._last_read = file

    def read_ahead(self, worker: str, files: Sequence[HistoryFile]) -> None:
        """Read ``worker``'s receipts in ``files`` for its next :meth:`worker_receipts`.

        The coordinator calls this without its lock (a retire would otherwise read every file
        under it: about a millisecond per file); files written since are read by
        :meth:`worker_receipts` itself. :meth:`drop_ahead` forgets what was not used."""
        self._ahead[worker] = {file: file.worker_receipts(worker) for file in files}

    def drop_ahead(self, worker: str) -> None:
        self._ahead.pop(worker, None)

    def worker_receipts(self, worker: str) -> list[dict[str, Any]]:
        """Every receipt of ``worker`` held in history files, in position order (what it read
        ahead is used once, then forgotten)."""
        ahead = self._ahead.pop(worker, {})
        out: list[dict[str, Any]] = []
        for file in self.files:
            found = ahead.get(file)
            out += file.worker_receipts(worker) if found is None else found
        return out

    def counts(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for file in self.files:
            for state, count in file.counts.items():
                total[state] = total.get(state, 0) + count
        return total

    def describe(self) -> list[list[Any]]:
        return [file.describe() for file in self.files]

    def memory_bytes(self) -> int:
        """Bytes of index data this history holds in memory: the runs' fences and filters, the
        in-memory merged indexes and the hashes of files loaded (a structure-level footprint)."""
        total = 0
        for run in self.runs:
            total += run.memory_bytes()
        for merged in self._merged or ():
            total += sum(len(a) * a.itemsize for a in (merged.hashes, merged.owners, merged.places))
        for file in self.files:
            total += sum(len(a) * a.itemsize for a in file._hashes or ())
        return total

    def describe_runs(self) -> list[list[Any]]:
        return [run.describe() for run in self.runs]

    def names(self) -> set[str]:
        return {file.name for file in self.files} | {run.name for run in self.runs}

    def close(self) -> None:
        close_all([*self.files, *self.runs])


def _file_entries(file: HistoryFile) -> int:
    return int(file.tasks + file.subs + file.requests)


# ---------------------------------------------------------------------- index runs (FORMAT.md 8.5)

RUN_SUFFIX = ".hidx"
RUN_MAGIC = b"STRWHIDX"
RUN_END_MAGIC = b"STRWHIXE"
RUN_VERSION = 1
#: magic, version, flags (0), number of the first file covered, files covered.
RUN_HEADER = struct.Struct("<8sIIQQ")
#: A run's entry: the key hash, then the file number (low 32 bits) and the place in that
#: file's index (high 32 bits) as one u64.
RUN_ENTRY = struct.Struct("<QQ")
#: A page's first hash and the xxh3-64 of its entries' bytes.
RUN_FENCE = struct.Struct("<QQ")
#: magic, entries of each index (tasks, submissions, requests), filter bytes of each index,
#: digest of the covered files' checksums, then the run's checksum.
RUN_TRAILER = struct.Struct("<8sQQQQQQQQ")
#: The three indexes of a run, in their order in the file.
KINDS = 3


def run_name(seq: int, stop: int) -> str:
    """``hist/<S>-<stop>.hidx``: written by the snapshot of frame S, covering files up to ``stop``."""
    return f"{seq:020d}-{stop:010d}{RUN_SUFFIX}"


def covered_digest(files: Sequence[HistoryFile]) -> int:
    """What binds a run to the files it indexes: xxh3-64 of their checksums (u64 each, in order)."""
    return _row_hash(array.array("Q", [f.checksum for f in files]).tobytes())


def filter_bytes(keys: int) -> int:
    """Bytes of a filter over ``keys`` hashes: HISTORY_RUN_FILTER_BITS per key, whole u64 words."""
    return 8 * max(1, -(-keys * HISTORY_RUN_FILTER_BITS // 64))


#: Hashes a filter build handles at once: its temporaries stay a few MiB whatever the run's size.
_FILTER_CHUNK = 1 << 16


def build_filter(hashes: Any, size: int) -> bytes:
    """The membership filter over ``hashes`` (a numpy u64 array): ``size`` bytes, bit ``p`` is
    bit ``p % 8`` of byte ``p // 8``; hash ``h`` sets ``(lo + k * hi) % bits`` for each probe
    ``k`` with ``lo`` its low 32 bits and ``hi`` its high 32 bits with the lowest bit set."""
    import numpy as np

    bits = np.zeros(size, dtype=np.uint8)
    total = np.uint64(size * 8)
    for start in range(0, len(hashes), _FILTER_CHUNK):
        chunk = hashes[start : start + _FILTER_CHUNK]
        at = chunk & np.uint64(0xFFFFFFFF)
        step = (chunk >> np.uint64(32)) | np.uint64(1)
        for _ in range(HISTORY_RUN_FILTER_PROBES):
            at %= total
            masks = np.left_shift(np.uint8(1), (at & np.uint64(7)).astype(np.uint8))
            np.bitwise_or.at(bits, (at >> np.uint64(3)).astype(np.intp), masks)
            at += step
    return bits.tobytes()


def filter_holds(bits: bytes, wanted: int) -> bool:
    """Whether ``wanted`` may be among the hashes of filter ``bits`` (never False for one that is)."""
    size = len(bits) << 3
    at, step = wanted & 0xFFFFFFFF, (wanted >> 32) | 1
    for _ in range(HISTORY_RUN_FILTER_PROBES):
        at %= size
        if not bits[at >> 3] >> (at & 7) & 1:
            return False
        at += step
    return True


def build_run(
    first: int, files: Sequence[HistoryFile], entries: Iterable[Any], digest: int
) -> tuple[list[bytes], int]:
    """The bytes of an index run (pure) over ``files`` numbered from ``first``, and its checksum.
    ``entries`` yields, per index, a numpy (n, 2) u64 array of entries sorted by hash."""
    import numpy as np

    header = RUN_HEADER.pack(RUN_MAGIC, RUN_VERSION, 0, first, len(files))
    pages, fences, filters, sizes = [], [], [], []
    for table in entries:  # one index's array at a time (``run_entries`` yields them)
        data = table.tobytes()
        del table  # its bytes are all a build needs from here (less memory at once)
        hashes = np.frombuffer(data, dtype=np.uint64)[0::2]
        step = RUN_ENTRY.size * HISTORY_RUN_PAGE_ENTRIES
        pages.append(data)
        for at in range(0, len(data), step):
            fences.append(RUN_FENCE.pack(int(hashes[at // RUN_ENTRY.size]), _row_hash(data[at : at + step])))
        filters.append(build_filter(hashes, filter_bytes(len(hashes))))
        sizes.append(len(hashes))
        del hashes
    counts = sizes + [len(f) for f in filters]
    body = RUN_TRAILER.pack(RUN_END_MAGIC, *counts, digest, 0)[: -_U64.size]
    fence_bytes, filter_blob = b"".join(fences), b"".join(filters)
    checksum = _row_hash(header + fence_bytes + filter_blob + body)
    return [header, *pages, fence_bytes, filter_blob, body + _U64.pack(checksum)], checksum


class IndexRun:
    """One index run: sorted (hash, file, place) entries of the task, submission and request
    indexes of ``count`` history files from file number ``first`` (docs/FORMAT.md 8.5).
    Opening reads the trailer; the first lookup reads the fences and filters (checked against
    the checksum), which are all it keeps in memory; each lookup the filter lets through reads
    one page, checked against its fence."""

    def __init__(self, name: str, source: Source, size: int, checksum: int, first: int, count: int) -> None:
        self.name, self.path, self.size, self.checksum = name, source.path, size, checksum
        self.first, self.count = first, count
        self._source = source
        self._loaded: tuple[list[array.array[int]], list[array.array[int]], list[bytes]] | None = None
        # J5 H3: a run the snapshot thread absorbed is read until the live state takes the new
        # one over, and H4 may delete its file meanwhile: the descriptor its trailer read opens
        # stays open until close().
        source.keep_open()
        _checked(self._read_trailer, source)

    @property
    def stop(self) -> int:
        return self.first + self.count

    @property
    def entries(self) -> int:
        return sum(self.counts)

    def describe(self) -> list[Any]:
        """How a snapshot names this run: [name, size, checksum, first file, files]."""
        return [self.name, self.size, self.checksum, self.first, self.count]

    def _corrupt(self, why: str) -> CorruptData:
        return CorruptData(f"queue history index {self.path} is damaged: {why}")

    def _pread(self, size: int, offset: int) -> bytes:
        try:
            data = self._source.pread(size, offset)
        except FileNotFoundError:
            raise CorruptData(
                f"queue history index {self.path} named by the queue's snapshot is missing "
                "(restore it from a copy)"
            ) from None
        except OSError as error:
            raise StorageUnavailable(f"reading queue history index {self.path}: {error}") from error
        if len(data) != size:
            raise self._corrupt(f"{size} bytes at {offset} are past its end (torn or truncated)")
        return bytes(data)

    def _read_trailer(self) -> None:
        if self.size < RUN_HEADER.size + RUN_TRAILER.size:
            raise self._corrupt("too short to hold a header and a trailer")
        fields = RUN_TRAILER.unpack(self._pread(RUN_TRAILER.size, self.size - RUN_TRAILER.size))
        magic, counts, filters, self.digest, checksum = (
            fields[0],
            fields[1:4],
            fields[4:7],
            fields[7],
            fields[8],
        )
        if magic != RUN_END_MAGIC:
            raise self._corrupt("no trailer (a torn write)")
        if checksum != self.checksum:
            raise self._corrupt(
                f"trailer checksum {checksum:016x}, its snapshot recorded {self.checksum:016x}"
            )
        self.counts, self.filters = tuple(int(c) for c in counts), tuple(int(f) for f in filters)
        pages = sum(-(-c // HISTORY_RUN_PAGE_ENTRIES) for c in self.counts)
        self._fences_at = RUN_HEADER.size + RUN_ENTRY.size * sum(self.counts)
        expected = self._fences_at + RUN_FENCE.size * pages + sum(self.filters) + RUN_TRAILER.size
        sizes = zip(self.filters, self.counts, strict=True)
        if expected != self.size or any(f != filter_bytes(c) for f, c in sizes):
            raise self._corrupt("its trailer's counts do not match its size")

    def load(self) -> tuple[list[array.array[int]], list[array.array[int]], list[bytes]]:
        """Per index: the first hash of each page, each page's checksum, the filter (checked once)."""
        loaded = self._loaded
        if loaded is not None:
            return loaded
        header = self._pread(RUN_HEADER.size, 0)
        end = self.size - RUN_TRAILER.size
        middle = self._pread(end - self._fences_at, self._fences_at)
        body = self._pread(RUN_TRAILER.size - _U64.size, end)
        if _row_hash(header + middle + body) != self.checksum:
            raise self._corrupt("its fences and filters do not match its checksum")
        magic, version, _, first, count = RUN_HEADER.unpack(header)
        if magic != RUN_MAGIC or version != RUN_VERSION or (first, count) != (self.first, self.count):
            raise self._corrupt(f"header magic {magic!r} version {version} is not this run's")
        words = array.array("Q")
        words.frombytes(middle[: len(middle) - sum(self.filters)])
        firsts, sums, filters = [], [], []
        at, blob = 0, len(words) * 8
        for count_k, size in zip(self.counts, self.filters, strict=True):
            pages = -(-count_k // HISTORY_RUN_PAGE_ENTRIES)
            firsts.append(words[2 * at : 2 * (at + pages) : 2])
            sums.append(words[2 * at + 1 : 2 * (at + pages) : 2])
            filters.append(middle[blob : blob + size])
            at, blob = at + pages, blob + size
        self._loaded = (firsts, sums, filters)
        return self._loaded

    def _entries_at(self, kind: int) -> int:
        return RUN_HEADER.size + RUN_ENTRY.size * sum(self.counts[:kind])

    def _page(self, kind: int, page: int) -> memoryview:
        """The entries of one page as u64 words (hash, file | place << 32, ...), checked."""
        _, sums, _ = self.load()
        start = page * HISTORY_RUN_PAGE_ENTRIES
        count = min(HISTORY_RUN_PAGE_ENTRIES, self.counts[kind] - start)
        data = self._pread(RUN_ENTRY.size * count, self._entries_at(kind) + RUN_ENTRY.size * start)
        if _row_hash(data) != sums[kind][page]:
            raise self._corrupt(f"page {page} of index {kind} does not match its checksum")
        return memoryview(data).cast("Q")

    def holds(self, kind: int, wanted: int) -> bool:
        """Whether index ``kind`` may hold ``wanted`` (its filter, in memory once loaded)."""
        return filter_holds((self._loaded or self.load())[2][kind], wanted)

    def find(self, kind: int, wanted: int) -> Iterator[tuple[int, int]]:
        """(file number, place) of each entry of index ``kind`` whose hash is ``wanted``."""
        firsts, _, filters = self.load()
        if not filter_holds(filters[kind], wanted):
            return
        fences = firsts[kind]
        page = max(0, bisect.bisect_left(fences, wanted) - 1)  # equal hashes may start a page early
        while page < len(fences) and fences[page] <= wanted:  # bounded by the pages of equal hashes
            words = self._page(kind, page)
            hashes = words[0::2]
            at = bisect.bisect_left(hashes, wanted)
            while at < len(hashes) and hashes[at] == wanted:
                where = words[2 * at + 1]
                number = where & 0xFFFFFFFF
                if not self.first <= number < self.stop:
                    raise self._corrupt(f"an entry names file {number}, outside the files it covers")
                yield number, where >> 32
                at += 1
            page += 1

    def read(self, kind: int) -> Any:
        """Every entry of index ``kind`` as a numpy (n, 2) u64 array, each page checked (a merge)."""
        import numpy as np

        _, sums, _ = self.load()
        data = self._pread(RUN_ENTRY.size * self.counts[kind], self._entries_at(kind))
        step = RUN_ENTRY.size * HISTORY_RUN_PAGE_ENTRIES
        for page, at in enumerate(range(0, len(data), step)):
            if _row_hash(data[at : at + step]) != sums[kind][page]:
                raise self._corrupt(f"page {page} of index {kind} does not match its checksum")
        return np.frombuffer(data, dtype="<u8").reshape(-1, 2)

    def memory_bytes(self) -> int:
        """Bytes of its fences, checksums and filters once loaded (nothing before)."""
        if self._loaded is None:
            return 0
        firsts, sums, filters = self._loaded
        return sum(len(a) * a.itemsize for a in (*firsts, *sums)) + sum(len(f) for f in filters)

    def verify(self) -> None:
        """Every byte checked (``straw check``)."""
        for kind in range(KINDS):
            self.read(kind)

    def close(self) -> None:
        self._source.close()


def run_entries(runs: Sequence[IndexRun], files: Sequence[HistoryFile], start: int) -> Iterator[Any]:
    """The entries of a run covering ``runs`` (each read back) and then ``files`` numbered from
    ``start`` (their checked indexes), per index sorted by hash; equal hashes keep file order.
    One index at a time, so a build holds one index's temporaries at once."""
    import numpy as np

    for kind in range(KINDS):
        parts = [run.read(kind) for run in runs]
        for number, file in enumerate(files, start):
            own = np.frombuffer(file.load()[kind], dtype=np.uint64)
            part = np.empty((len(own), 2), dtype=np.uint64)
            part[:, 0] = own
            part[:, 1] = np.uint64(number) | (np.arange(len(own), dtype=np.uint64) << np.uint64(32))
            parts.append(part)
        joined = np.concatenate(parts) if parts else np.empty((0, 2), dtype=np.uint64)
        del parts  # the runs' bytes read back: freed before the sort
        order = np.argsort(joined[:, 0], kind="stable")
        table = joined[order]
        del joined, order
        yield table
        del table


def open_runs(
    opener: Opener, described: Sequence[Sequence[Any]], files: Sequence[HistoryFile]
) -> list[IndexRun]:
    """The runs a snapshot names, each checked to cover contiguous files it lists (trailers read)."""
    runs: list[IndexRun] = []
    try:
        for name, size, checksum, first, count in described:
            run = IndexRun(str(name), opener(str(name)), int(size), int(checksum), int(first), int(count))
            expected = runs[-1].stop if runs else 0
            runs.append(run)
            if run.first != expected or run.stop > len(files):
                raise run._corrupt(
                    f"it covers files {run.first}..{run.stop}, the snapshot's history {expected}.."
                )
            if run.digest != covered_digest(files[run.first : run.stop]):
                raise run._corrupt("it indexes other history files than the snapshot names")
    except BaseException:
        close_all(runs)
        raise
    return runs
