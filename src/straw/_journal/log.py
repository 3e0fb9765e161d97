"""The write-ahead journal of one queue: segments, snapshots, replay and group commit.

docs/DURABILITY.md steps J1-J5. Layout under the queue directory::

    wal/<first seq, 20 digits>.wal    segments of chained frames
    snap/<seq, 20 digits>.snap        snapshots of the queue state as of that seq

Appends are group-committed: callers frame their transaction in sequence order
(under the coordinator's lock), then wait; one of the waiters writes every
pending frame with one vectored write and one ``fdatasync`` and wakes the rest.
A caller returns only when its own frame is durable (J2).
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .._fs import durable, posix
from ..backend import FilesystemBackend
from ..errors import CorruptData, UnsafeRecovery, invariant
from ..limits import JOURNAL_PREALLOC_BYTES, JOURNAL_SYNCS_IN_FLIGHT
from . import frame

WAL_DIR = "wal"
SNAP_DIR = "snap"
_DIGITS = 20


def _name(seq: int, suffix: str) -> str:
    return f"{seq:0{_DIGITS}d}{suffix}"


def _listing(directory: str, suffix: str) -> list[tuple[int, str]]:
    """(seq, path) of the files in ``directory`` named by a sequence number, in order."""
    out = []
    for name in posix.listdir(directory):
        if name.endswith(suffix) and len(name) == _DIGITS + len(suffix) and name[:_DIGITS].isdigit():
            out.append((int(name[:_DIGITS]), os.path.join(directory, name)))
    return sorted(out)


@dataclass(frozen=True)
class Recovered:
    """What replay found: the snapshot body (if any) and where the journal ends."""

    snapshot: bytes | None
    snapshot_seq: int
    last_seq: int
    chain: bytes
    truncated: str | None  # why a torn tail was cut, if one was


class Journal:
    """Segments and snapshots of one queue, with group-committed appends."""

    def __init__(self, backend: FilesystemBackend, directory: str, tag: bytes) -> None:
        self.backend = backend
        self.directory = directory
        self.tag = tag
        self.wal = os.path.join(directory, WAL_DIR)
        self.snap = os.path.join(directory, SNAP_DIR)
        self._cv = threading.Condition()
        self._fd = -1
        self._offset = 0
        self._next_seq = 1
        self._chain = frame.genesis_chain(tag)
        self._durable = 0
        self._durable_end = 0  # the segment offset just past the last durable frame
        self._written = 0  # the last frame written to the file (durable once a later sync returns)
        self._pending: list[bytes] = []
        self._writing = False  # one batch is written at a time, in sequence order
        self._syncing = 0  # syncs in flight (at most JOURNAL_SYNCS_IN_FLIGHT)
        # Written batches in order, as [last seq, end offset, synced]: one is durable only once
        # it and every batch before it synced (A3: a later sync proves nothing about earlier bytes).
        self._inflight: deque[list[Any]] = deque()
        self._failed: BaseException | None = None
        self.segment_first_seq = 1
        self._allocated = 0
        self.bytes_since_snapshot = 0
        self.snapshot_bytes = 0
        self.metrics = {"appends": 0, "syncs": 0, "batches": 0, "snapshots": 0}

    # -- layout ---------------------------------------------------------------------

    def exists(self) -> bool:
        """True if any segment or snapshot is present (a fresh queue must not open over it)."""
        for sub, suffix in ((self.wal, ".wal"), (self.snap, ".snap")):
            if posix.isdir(sub) and _listing(sub, suffix):
                return True
        return False

    def create_dirs(self, stop: str) -> None:
        for sub in (self.wal, self.snap):
            durable.make_dirs(sub, stop, self.backend.sync_dir)

    def size(self) -> int:
        total = 0
        for sub, suffix in ((self.wal, ".wal"), (self.snap, ".snap")):
            for _, path in _listing(sub, suffix):
                try:
                    total += posix.getsize(path)
                except FileNotFoundError:
                    continue
        return total

    # -- recovery (J4) -----------------------------------------------------------------

    def replay(self, apply: Callable[[int, bytes], None], load: Callable[[bytes], None]) -> Recovered:
        """Hand the newest snapshot to ``load``, every later frame to ``apply``, and cut a torn tail (J4)."""
        snapshot, seq, chain = self._load_snapshot()
        if snapshot is not None:
            load(snapshot)
        segments = _listing(self.wal, ".wal")
        truncated = None
        # Segments wholly covered by the snapshot are skipped; the rest must follow each other.
        start = 0
        for i, (first, _) in enumerate(segments):
            if first <= seq + 1:
                start = i
        live = segments[start:]
        position_seq = None
        for number, (first, path) in enumerate(live):
            last_segment = number == len(live) - 1
            data = self._read_file(path)
            header = frame.decode_segment_header(data, frame.SEGMENT_MAGIC)
            self._check_tag(header.tag, path)
            if position_seq is None:
                if first > seq + 1:
                    raise CorruptData(f"journal gap: {path} starts at {first}, the snapshot ends at {seq}")
                running_seq, running_chain = first - 1, header.chain_in
            else:
                running_seq, running_chain = position_seq
                if first != running_seq + 1 or header.chain_in != running_chain:
                    raise CorruptData(f"journal segment {path} does not continue the previous segment")
            at = frame.SEGMENT_HEADER_BYTES
            while True:
                verdict = frame.classify(data, at, running_seq + 1, running_chain)
                if verdict.decision is frame.Decision.FRAME and verdict.frame is not None:
                    found = verdict.frame
                    running_seq, running_chain, at = found.seq, found.chain, found.end
                    if found.seq > seq:
                        apply(found.seq, found.body)
                        seq, chain = found.seq, found.chain
                    elif found.seq == seq and found.chain != chain:
                        raise CorruptData(
                            f"journal frame {seq} disagrees with the snapshot (foreign journal)"
                        )
                    continue
                if verdict.decision is frame.Decision.END:
                    break
                if (
                    verdict.decision is frame.Decision.TORN
                    and not last_segment
                    and not data[at:].strip(b"\0")
                ):
                    break  # zero-filled space a later segment took over from (J1.1): its end
                if verdict.decision is frame.Decision.TORN and last_segment:
                    durable.cut_tail(path, at, self.backend.sync_file)
                    truncated = f"{os.path.basename(path)}: {verdict.reason}; cut at byte {at}"
                    break
                raise CorruptData(f"journal {path}: {verdict.reason}; refusing to recover past damage")
            position_seq = (running_seq, running_chain)
        if live and truncated is None:
            # J4.3: frames a killed process wrote but never synced are in the page cache, and
            # this replay just applied them. Sync before anything is built on them, so that a
            # later power loss cannot take back what the recovered coordinator has served.
            self._sync_path(live[-1][1])
        self._next_seq = seq + 1
        self._chain = chain
        self._durable = self._written = seq
        return Recovered(snapshot, self.segment_first_seq, seq, chain, truncated)

    def _sync_path(self, path: str) -> None:
        try:
            fd = posix.open_append(path)
            try:
                self.backend.sync_file(fd)
            finally:
                posix.close_quietly(fd)
        except OSError as error:
            raise posix.storage_error(error, f"syncing journal {path}") from error

    def _check_tag(self, tag: bytes, path: str) -> None:
        if tag != self.tag:
            raise UnsafeRecovery(f"{path} belongs to another run or queue; refusing to recover from it")

    def _read_file(self, path: str) -> bytes:
        try:
            return posix.read_file(path)
        except OSError as error:
            raise posix.storage_error(error, f"reading journal {path}") from error

    def _load_snapshot(self) -> tuple[bytes | None, int, bytes]:
        snapshots = _listing(self.snap, ".snap")
        if not snapshots:
            return None, 0, frame.genesis_chain(self.tag)
        seq, path = snapshots[-1]
        data = self._read_file(path)
        header = frame.decode_segment_header(data, frame.SNAPSHOT_MAGIC)
        self._check_tag(header.tag, path)
        verdict = frame.classify(data, frame.SEGMENT_HEADER_BYTES, seq, header.chain_in)
        if (
            verdict.decision is not frame.Decision.FRAME
            or verdict.frame is None
            or verdict.frame.end != len(data)
        ):
            raise CorruptData(f"snapshot {path} is damaged ({verdict.reason}); refusing to recover")
        self.segment_first_seq = seq
        self.snapshot_bytes = len(data)
        return verdict.frame.body, seq, header.chain_in

    # -- segments (J1, J5) ------------------------------------------------------------

    def start_segment(self) -> None:
        """Begin a new segment after the last durable frame (after recovery or a snapshot)."""
        invariant(not self._pending and self._durable == self._next_seq - 1, "no frame is in flight")
        first = self._next_seq
        path = os.path.join(self.wal, _name(first, ".wal"))
        header = frame.encode_segment_header(frame.SEGMENT_MAGIC, first, self._chain, self.tag)
        if posix.exists(path):
            # A segment that starts here but holds no frame (replay ended before its first frame).
            tail = self._read_file(path)[frame.SEGMENT_HEADER_BYTES :]
            invariant(not tail.strip(b"\0"), "only an empty segment is reused")
            posix.unlink(path)
        durable.create_file(path, [header], self.backend.sync_file, self.backend.sync_dir)
        fd = posix.open_append(path)
        # J1.1: zero-fill ahead, so an append overwrites allocated blocks and its fdatasync
        # need not commit a size change (about a third faster here). Recovery cuts the zeros.
        posix.pwrite_all(fd, [bytes(JOURNAL_PREALLOC_BYTES)], frame.SEGMENT_HEADER_BYTES)
        self.backend.sync_file(fd)
        old, old_end = self._fd, self._offset
        if old >= 0 and self._allocated > old_end:
            # The previous segment ends at its last frame again (a crash before this leaves a
            # zero tail there, which replay accepts only because this segment continues it).
            posix.truncate(old, old_end)
            self.backend.sync_file(old)
        self._fd, self._offset = fd, frame.SEGMENT_HEADER_BYTES
        self._durable_end = frame.SEGMENT_HEADER_BYTES
        self._allocated = frame.SEGMENT_HEADER_BYTES + JOURNAL_PREALLOC_BYTES
        self.segment_first_seq = first
        if old >= 0:
            posix.close_quietly(old)

    def abandon(self) -> None:
        """Close the descriptor and write nothing more: what the kernel does when a process dies."""
        if self._fd >= 0:
            posix.close_quietly(self._fd)
            self._fd = -1

    def close(self) -> None:
        """Close the segment; a clean close cuts the zero-filled space after the last frame."""
        self._quiesce()
        if self._fd >= 0:
            try:
                if self._failed is not None:
                    # J3.1: frames past the last durable one were never acknowledged, and after
                    # a failed write or sync no later sync proves them durable (A3). Cut them, so
                    # a recovery in this boot does not build on bytes a power loss may revert.
                    posix.truncate(self._fd, self._durable_end)
                    self.backend.sync_file(self._fd)
                elif not self._pending and self._allocated > self._offset:
                    posix.truncate(self._fd, self._offset)
                    self.backend.sync_file(self._fd)
            except OSError:
                pass  # the zeros (or the unacknowledged frames) stay: recovery decides (J4.3)
            finally:
                posix.close_quietly(self._fd)
                self._fd = -1
                self._allocated = 0

    # -- appends (J2, J3) -----------------------------------------------------------------

    def append(self, body: bytes) -> int:
        """Frame a transaction at the next sequence number; durable once :meth:`wait` returns."""
        with self._cv:
            self._check_failed()
            seq = self._next_seq
            header, self._chain = frame.encode_frame(seq, self._chain, body, self._durable)
            self._pending += (header, body)
            self._next_seq = seq + 1
            self.metrics["appends"] += 1
            return seq

    @property
    def last_seq(self) -> int:
        return self._next_seq - 1

    @property
    def chain(self) -> bytes:
        return self._chain

    def wait(self, seq: int) -> None:
        """Return once frame ``seq`` (and every earlier one) is durable; lead a flush if none covers it."""
        with self._cv:
            while self._durable < seq:
                self._check_failed()
                if seq > self._written and not self._writing and self._syncing < JOURNAL_SYNCS_IN_FLIGHT:
                    self._flush_locked()
                else:
                    self._cv.wait()

    def _flush_locked(self) -> None:
        """J2.2 for one batch: write the pending frames, then sync them (the caller holds ``_cv``).

        Writes are serial, syncs overlap (J2.4): a batch may be written and synced while the
        previous batch's sync is still running. The durable mark moves in write order only: a
        batch whose sync returned first still waits for the earlier batch's sync, and once any
        batch fails nothing after it is acknowledged (A3, J3).
        """
        self._writing = True
        # Let threads that are about to append join this batch (one scheduler yield, no sleep).
        self._cv.release()
        os.sched_yield()
        self._cv.acquire()
        batch, last, offset, fd = self._pending, self._next_seq - 1, self._offset, self._fd
        self._pending = []
        self._cv.release()
        error: BaseException | None = None
        written = 0
        try:
            written = self._write(batch, offset)
        except BaseException as caught:
            error = caught
        self._cv.acquire()
        self._writing = False
        entry = [last, offset + written, False]
        if error is None:
            self._offset = offset + written
            self._written = last
            self.bytes_since_snapshot += written
            self._syncing += 1
            self._inflight.append(entry)
        if error is not None or self._pending:
            # Frames queued during the write may lead the next batch now (J2.4); waiters whose
            # frames were just written need this batch's sync, so they are woken after it.
            self._cv.notify_all()
        if error is None:
            self._cv.release()
            synced = False
            try:
                self.backend.sync_file(fd)
                synced = True
                self.backend.fault("after_journal_sync")
            except BaseException as caught:
                error = caught
            finally:
                self._cv.acquire()
                self._syncing -= 1
                # Durable even if something failed after the sync returned (J3 still stops),
                # but only in write order: a batch waits for every earlier batch's sync.
                entry[2] = synced
                while self._inflight and self._inflight[0][2] and self._failed is None:
                    done_last, done_end, _ = self._inflight.popleft()
                    self._durable, self._durable_end = done_last, done_end
                self._cv.notify_all()
        if error is not None:
            # J3: after a failed journal write or sync the file's state is unknown; stop (fail-stop).
            self._failed = error
            raise error
        self.metrics["syncs"] += 1
        self.metrics["batches"] += 1

    def _quiesce(self) -> None:
        """Wait until no batch is being written or synced (before the segment's descriptor changes)."""
        with self._cv:
            while self._writing or self._syncing:
                self._cv.wait()

    def _write(self, batch: list[bytes], offset: int) -> int:
        end = offset + sum(len(b) for b in batch)
        self.backend.fault("before_journal_write")
        written = posix.pwrite_all(self._fd, batch, offset)
        if end + JOURNAL_PREALLOC_BYTES // 2 > self._allocated:
            # J1.1: keep zeros ahead, written and synced together with these frames. A crash
            # may persist the zeros and not the frames: a zero tail, which recovery cuts.
            start = max(self._allocated, end)
            target = end + JOURNAL_PREALLOC_BYTES
            posix.pwrite_all(self._fd, [bytes(target - start)], start)
            self._allocated = target
        self.backend.fault("after_journal_append")
        return written

    def _check_failed(self) -> None:
        if self._failed is not None:
            raise UnsafeRecovery(
                f"the journal stopped after a storage failure ({self._failed!r}); "
                "close this coordinator and reopen the queue with recover=True"
            )

    @property
    def failed(self) -> BaseException | None:
        return self._failed

    # -- snapshots (J5) -----------------------------------------------------------------

    def write_snapshot(self, body: bytes) -> None:
        """Persist the state as of the last durable frame, start a new segment, drop the old files."""
        self._quiesce()
        invariant(not self._pending and self._durable == self._next_seq - 1, "snapshot of a durable state")
        seq, chain = self._durable, self._chain
        header = frame.encode_segment_header(frame.SNAPSHOT_MAGIC, seq, chain, self.tag)
        frame_header, _ = frame.encode_frame(seq, chain, body)
        path = os.path.join(self.snap, _name(seq, ".snap"))
        self.backend.fault("before_snapshot_write")
        durable.replace_file(
            path, [header, frame_header, body], self.backend.sync_file, self.backend.sync_dir
        )
        self.backend.fault("after_snapshot_write")
        try:
            self.start_segment()
        except BaseException as error:
            # The snapshot is durable but the next segment may be half made: stop (J3), so
            # nothing is appended to a segment a recovery would not continue from.
            self._failed = error
            raise
        # The snapshot and the new segment are durable; older files are no longer needed (J5.4).
        for old_seq, old in _listing(self.snap, ".snap"):
            if old_seq < seq:
                posix.unlink_quietly(old)
        for first, old in _listing(self.wal, ".wal"):
            if first < self.segment_first_seq:
                posix.unlink_quietly(old)
        self.backend.sync_dir(self.snap)
        self.backend.sync_dir(self.wal)
        self.bytes_since_snapshot = 0
        self.snapshot_bytes = len(header) + len(frame_header) + len(body)
        self.metrics["snapshots"] += 1
