"""The write-ahead journal of one queue: segments, snapshots, replay and group commit.

docs/DURABILITY.md steps J1-J5. Layout under the queue directory::

    wal/<first seq, 20 digits>.wal    segments of chained frames
    snap/<seq, 20 digits>.snap        snapshots of the queue state as of that seq

Appends are group-committed: callers frame their transaction in sequence order
(under the coordinator's lock), then wait; one of the waiters writes every
pending frame with one vectored write and one ``fdatasync`` and wakes the rest.
A caller returns only when its own frame is durable (J2). Each waiter sleeps on a
lock of its own: a sync wakes exactly the callers whose frames it made durable, and
a batch that can start wakes one caller to lead it, so no thread wakes only to find
its frame still in flight and sleep again (under the GIL, each such wake-up costs
every other thread a hand-over).
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .._fs import durable, posix
from ..backend import FilesystemBackend
from ..errors import UnsafeRecovery, invariant
from ..limits import (
    JOURNAL_COMPANY_APPENDS,
    JOURNAL_PREALLOC_BYTES,
    JOURNAL_SYNCS_IN_FLIGHT,
    LOG_CLOSE_ZEROS,
)
from . import frame, scan
from .scan import SNAP_DIR, WAL_DIR

_DIGITS = 20
_listing = scan.listing


def _name(seq: int, suffix: str) -> str:
    return f"{seq:0{_DIGITS}d}{suffix}"


@dataclass(frozen=True)
class Recovered:
    """What replay found: the snapshot body (if any) and where the journal ends."""

    snapshot: bytes | None
    snapshot_seq: int
    last_seq: int
    chain: bytes
    truncated: str | None  # why a torn tail was zeroed, if one was


class _Reached(Exception):
    """A read-only replay (``upto``) reached the live appender's frames."""


class Journal:
    """Segments and snapshots of one queue, with group-committed appends."""

    def __init__(self, backend: FilesystemBackend, directory: str, tag: bytes) -> None:
        self.backend = backend
        self.directory = directory
        self.tag = tag
        self.wal = os.path.join(directory, WAL_DIR)
        self.snap = os.path.join(directory, SNAP_DIR)
        self._cv = threading.Condition()  # guards everything below; its waiters: _quiesce, switch
        #: Callers of :meth:`wait` asleep until their frame is durable or they may lead a
        #: batch, as [seq, lock held until woken]; ``_wake_locked`` releases exactly those.
        self._waiters: list[list[Any]] = []
        self._fd = -1
        self._offset = 0
        self._next_seq = 1
        self._chain = frame.genesis_chain(tag)
        self._durable = 0
        self._durable_end = 0  # the segment offset just past the last durable frame
        self._written = 0  # the last frame written to the file (durable once a later sync returns)
        self._covered = 0  # the last frame a sync in flight or done covers (>= _durable)
        self._pending: list[bytes] = []
        self._writing = False  # one batch is written at a time, in sequence order
        #: The thread that framed the last frame, and how many more frames count as "others
        #: are about" since a different thread framed one (the group-commit yield, J2.2).
        self._appender = 0
        self._company = 0
        self._syncing = 0  # syncs in flight (at most JOURNAL_SYNCS_IN_FLIGHT)
        # Written batches in order, as [last seq, end offset, synced]: one is durable only once
        # it and every batch before it synced (A3: a later sync proves nothing about earlier bytes).
        self._inflight: deque[list[Any]] = deque()
        self._failed: BaseException | None = None
        #: A segment switch in progress (J5.1): the last frame of the current segment and the
        #: chain after it. Frames after it are written only once :meth:`switch` started the next.
        self._switch_at: int | None = None
        self._switch_chain = b""
        self.segment_first_seq = 1
        self._allocated = 0
        self.bytes_since_snapshot = 0
        self.snapshot_bytes = 0
        #: Segments a replay found ending in zeros, with the end of their frames: the last one
        #: walked, and any older one whose switch a crash stopped before its cut (J5.2). Each is
        #: cut there once the next segment exists, so it never again looks like a newest one
        #: (J4.4, J7).
        self._to_cut: list[tuple[str, int]] = []
        self.walked: scan.JournalWalk | None = None
        #: ``sleeps``: times a caller of :meth:`wait` slept (once per frame another caller's
        #: batch makes durable; more only when a batch it could lead had to wait for another).
        #: ``sync_us_total`` / ``sync_us_max``: microseconds the journal's syncs took in all and
        #: at most (with ``syncs``, the device's share of a caller's wait for durability).
        self.metrics = {
            "appends": 0,
            "syncs": 0,
            "batches": 0,
            "snapshots": 0,
            "sleeps": 0,
            "sync_us_total": 0,
            "sync_us_max": 0,
        }
        #: Times the syncs (a simulated clock in tests).
        self.clock: Callable[[], float] = time.perf_counter

    # -- layout ---------------------------------------------------------------------

    def exists(self) -> bool:
        """True if any segment or snapshot is present (a fresh queue must not open over it)."""
        return any(_listing(sub, suffix) for sub, suffix in ((self.wal, ".wal"), (self.snap, ".snap")))

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

    def replay(
        self, apply: Callable[[int, bytes], None], load: Callable[[bytes], None], *, upto: int | None = None
    ) -> Recovered:
        """Hand the newest snapshot to ``load``, every later frame to ``apply``; zero a torn tail (J4).

        The walk is ``scan.walk_journal``, the one ``straw check`` uses; recovery raises its
        first problem (J4.3, J7) and repairs only a torn tail of the last segment. With
        ``upto``, a read-only look at the durable history of a journal still open for appends:
        the walk stops after frame ``upto``, nothing is zeroed or synced, this object is unchanged.
        """
        snapshot: list[bytes] = []
        applied = [0]  # the last frame handed to ``apply``

        def loaded(body: bytes) -> None:
            snapshot.append(body)
            load(body)

        def applying(seq: int, body: bytes) -> None:
            if upto is not None and seq > upto:
                raise _Reached  # frames past the durable position belong to the live appender
            apply(seq, body)
            applied[0] = seq

        try:
            walked = scan.walk_journal(self.directory, self.tag, applying, loaded, upto=upto)
        except _Reached:
            return Recovered(
                snapshot[-1] if snapshot else None, self.segment_first_seq, applied[0], b"", None
            )
        except OSError as error:
            raise posix.storage_error(error, f"reading journal {self.directory}") from error
        if walked.problem is not None:
            raise walked.problem.error(walked.problem.message)
        if upto is not None:
            body = snapshot[-1] if snapshot else None
            return Recovered(body, walked.snapshot_seq, walked.last_seq, walked.chain, None)
        self.walked = walked
        if walked.snapshot_path is not None:
            self.segment_first_seq = walked.snapshot_seq
            self.snapshot_bytes = walked.snapshot_bytes
        truncated = None
        end, path = walked.end, walked.end_path
        self._to_cut = list(walked.uncut)
        if end is not None and path is not None:
            if end.kind == scan.TORN:
                # J4.3: a crashed append's frame, never acknowledged; zeroed (not cut), so the
                # segment still ends in zeros (J7) if this recovery dies before its own segment.
                durable.zero_tail(path, end.offset, self.backend.sync_file)
                truncated = f"{os.path.basename(path)}: {end.reason}; zeroed from byte {end.offset}"
            else:
                # J4.3: frames a killed process wrote but never synced are in the page cache, and
                # this replay just applied them. Sync before anything is built on them, so that a
                # later power loss cannot take back what the recovered coordinator serves.
                self._sync_path(path)
            self._to_cut.append((path, end.offset))
        self._next_seq = walked.last_seq + 1
        self._chain = walked.chain
        self._durable = self._written = self._covered = walked.last_seq
        body = snapshot[-1] if snapshot else None
        return Recovered(body, self.segment_first_seq, walked.last_seq, walked.chain, truncated)

    def _sync_path(self, path: str) -> None:
        try:
            fd = posix.open_append(path)
            try:
                self.backend.sync_file(fd)
            finally:
                posix.close_quietly(fd)
        except OSError as error:
            raise posix.storage_error(error, f"syncing journal {path}") from error

    def _read_file(self, path: str) -> bytes:
        try:
            return posix.read_file(path)
        except OSError as error:
            raise posix.storage_error(error, f"reading journal {path}") from error

    # -- segments (J1, J5) ------------------------------------------------------------

    def start_segment(self) -> None:
        """Begin a new segment after the last durable frame (after recovery or a snapshot)."""
        invariant(not self._pending and self._durable == self._next_seq - 1, "no frame is in flight")
        first = self._next_seq
        fd, allocated = self._create_segment(first, self._chain)
        self._replace_segment(fd, allocated, first)

    def _create_segment(self, first: int, chain: bytes) -> tuple[int, int]:
        """J1.1: segment ``first`` made durable with its zeros ahead; its descriptor and size."""
        path = os.path.join(self.wal, _name(first, ".wal"))
        header = frame.encode_segment_header(frame.SEGMENT_MAGIC, first, chain, self.tag)
        allocated = frame.SEGMENT_HEADER_BYTES + JOURNAL_PREALLOC_BYTES
        if posix.exists(path):
            # A segment that starts here but holds no frame (replay ended before its first frame):
            # it is the segment this would create, so it is used as it is. Removing it first
            # would let a crash in between leave the previous segment as the newest, cut at its
            # last frame (J7), which recovery then refuses.
            data = self._read_file(path)
            invariant(frame.all_zero(data[frame.SEGMENT_HEADER_BYTES :]), "only an empty segment is reused")
            if data[: frame.SEGMENT_HEADER_BYTES] != header or len(data) < allocated // 2:
                durable.replace_file(
                    path,
                    [header, bytes(JOURNAL_PREALLOC_BYTES)],
                    self.backend.sync_file,
                    self.backend.sync_dir,
                )
            else:
                allocated = len(data)
                # Its name may not be durable yet (a switch stopped inside D0): it must be before
                # an older segment is cut behind it (J4.4).
                self.backend.sync_dir(self.wal)
        else:
            # J1.1, J7: the segment is made visible with its zeros written ahead, in one D0, so no
            # segment is ever seen without zeros after its frames. Appends then overwrite allocated
            # blocks and their fdatasync need not commit a size change (about a third faster here).
            durable.create_file(
                path, [header, bytes(JOURNAL_PREALLOC_BYTES)], self.backend.sync_file, self.backend.sync_dir
            )
        return posix.open_append(path), allocated

    def _replace_segment(self, fd: int, allocated: int, first: int) -> None:
        """Append to segment ``first`` (``fd``) from now on; the previous one ends at its last frame."""
        path = os.path.join(self.wal, _name(first, ".wal"))
        old, old_end = self._fd, self._offset
        try:
            if old >= 0 and self._allocated > old_end:
                # The previous segment ends at its last frame again (a crash before this leaves a
                # zero tail there, which replay accepts only because this segment continues it,
                # and recovery cuts, J4.4).
                self.backend.fault("before_segment_cut")
                posix.truncate(old, old_end)
                self.backend.sync_file(old)
            elif old < 0:
                # The same after a recovery (J4.4, J7): if this new segment were ever lost, no
                # older one may pass for the newest, so each ends at its last frame from now on:
                # the one replayed last, and any whose switch a crash stopped before its cut
                # (J5.2; then the segment reused here, holding no frame, follows it). Without
                # that cut, frames acknowledged here would vanish unnoticed with this segment.
                for older, end in self._to_cut:
                    if older != path:
                        durable.cut_tail(older, end, self.backend.sync_file)
        except BaseException:
            posix.close_quietly(fd)  # never written: the failed switch stops the journal (J3)
            raise
        self._to_cut = []
        self._fd, self._offset = fd, frame.SEGMENT_HEADER_BYTES
        self._durable_end = frame.SEGMENT_HEADER_BYTES
        self._allocated = allocated
        self.segment_first_seq = first
        if old >= 0:
            posix.close_quietly(old)

    @property
    def segment_path(self) -> str:
        """The segment frames are appended to now."""
        return os.path.join(self.wal, _name(self.segment_first_seq, ".wal"))

    @property
    def written_seq(self) -> int:
        """The sequence number of the last frame in the file (durable or about to be, J2.5)."""
        with self._cv:
            return self._written

    @property
    def durable_seq(self) -> int:
        """The sequence number of the last frame known durable."""
        with self._cv:
            return self._durable

    def abandon(self) -> None:
        """Close the descriptor and write nothing more: what the kernel does when a process dies."""
        if self._fd >= 0:
            posix.close_quietly(self._fd)
            self._fd = -1

    def close(self) -> None:
        """Close the segment; a clean close cuts the zeros after the last frame to LOG_CLOSE_ZEROS."""
        self._quiesce()
        if self._fd >= 0:
            try:
                if self._failed is not None:
                    # J3.1: frames past the last durable one were never acknowledged, and after
                    # a failed write or sync no later sync proves them durable (A3). Zero them
                    # (the segment keeps its zeros, J7), so a recovery in this boot does not
                    # build on bytes a power loss may revert.
                    zeros = max(self._allocated - self._durable_end, LOG_CLOSE_ZEROS)
                    posix.pwrite_all(self._fd, [bytes(zeros)], self._durable_end)
                    self.backend.sync_file(self._fd)
                elif not self._pending and self._allocated > self._offset + LOG_CLOSE_ZEROS:
                    # J7: the newest segment keeps zeros after its frames, even closed.
                    posix.truncate(self._fd, self._offset + LOG_CLOSE_ZEROS)
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
            ident = threading.get_ident()
            if ident != self._appender:
                # Another thread framed the last frame (none did before the first one).
                self._company = JOURNAL_COMPANY_APPENDS if self._appender else 0
                self._appender = ident
            elif self._company:
                self._company -= 1
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
                if seq > self._covered and self._may_flush():
                    self._flush_locked()
                    continue
                # Asleep until _wake_locked releases this lock: once the frame is durable, the
                # journal failed, or a batch may start that this caller is the first to need.
                self._sleep_locked(seq, False)

    def wait_written(self, seq: int) -> None:
        """Return once frame ``seq`` (and every earlier one) is in the file, synced or not (J2.5):
        it survives this process's death, and the next sync of any caller makes it durable.
        Writes the pending frames itself when no batch is being written."""
        with self._cv:
            while self._written < seq:
                self._check_failed()
                if self._may_write():
                    self._write_locked()
                    continue
                self._sleep_locked(seq, True)

    def _sleep_locked(self, seq: int, written: bool) -> None:
        """Sleep (``_cv`` held, released meanwhile) until ``_wake_locked`` releases this caller."""
        woken = threading.Lock()
        woken.acquire()
        self._waiters.append([seq, woken, written])
        self.metrics["sleeps"] += 1
        self._cv.release()
        try:
            woken.acquire()
        finally:
            self._cv.acquire()

    def _switch_blocks(self) -> bool:
        """Whether a segment switch keeps the pending frames out of this segment (J5.2): every
        frame up to its point is written, the rest wait for the next segment."""
        return self._switch_at is not None and self._written >= self._switch_at

    def _may_write(self) -> bool:
        """Whether the pending frames may be written now (``_cv`` held): no other batch is being
        written and no segment switch keeps them out of this segment."""
        return not self._writing and not self._switch_blocks()

    def _may_flush(self) -> bool:
        """Whether a batch may start now (``_cv`` held): no batch is being written, fewer than
        JOURNAL_SYNCS_IN_FLIGHT syncs run (J2.4), and there is something to write, or frames
        written without a sync (J2.5) that a sync alone makes durable (also during a switch)."""
        if self._writing or self._syncing >= JOURNAL_SYNCS_IN_FLIGHT:
            return False
        return self._covered < self._written or (bool(self._pending) and not self._switch_blocks())

    def _wake_locked(self) -> None:
        """Wake the waiters that can go on (``_cv`` held): every one whose frame is durable, or
        written for a caller of :meth:`wait_written` (all of them once the journal failed); each
        caller of ``wait_written`` whose frame a write may start for; and, when a batch may
        start, the first caller of :meth:`wait` whose frame no sync covers yet, to lead it. The
        rest sleep on: nothing they wait for has happened."""
        waiters = self._waiters
        if not waiters:
            return
        durable, written, covered = self._durable, self._written, self._covered
        failed = self._failed is not None
        keep: list[list[Any]] = []
        leader: list[Any] | None = None
        may_write = not failed and bool(self._pending) and self._may_write()
        may_lead = not failed and self._may_flush()
        for entry in waiters:
            seq = entry[0]
            if failed or seq <= durable or (entry[2] and (seq <= written or may_write)):
                entry[1].release()
            elif may_lead and not entry[2] and seq > covered and (leader is None or seq < leader[0]):
                if leader is not None:
                    keep.append(leader)
                leader = entry
            else:
                keep.append(entry)
        if leader is not None:
            leader[1].release()
        self._waiters = keep

    def _flush_locked(self) -> None:
        """J2.2 for one batch: write the pending frames, then sync them (the caller holds ``_cv``).

        Writes are serial, syncs overlap (J2.4): a batch may be written and synced while the
        previous batch's sync is still running. The durable mark moves in write order only: a
        batch whose sync returned first still waits for the earlier batch's sync, and once any
        batch fails nothing after it is acknowledged (A3, J3).
        """
        self._writing = True
        if self._company or self._waiters:
            # Let threads that are about to append join this batch (one scheduler yield, no
            # sleep). Only while other threads are framing too: a caller alone gains nothing
            # from it, and on a busy machine the yield can hand the core to another process.
            self._cv.release()
            os.sched_yield()
            self._cv.acquire()
        fd = self._fd
        error, entry = self._write_batch_locked()
        if error is None:
            # Frames written earlier without a sync (J2.5) are in this file before the batch:
            # this sync covers them too.
            self._covered = entry[0]
            self._syncing += 1
            self._inflight.append(entry)
        # Frames queued during the write may lead the next batch now (J2.4); waiters whose
        # frames were just written need this batch's sync, so they are woken after it.
        self._wake_locked()
        self._cv.notify_all()  # _quiesce and switch wait for the writer role to be free
        if error is None:
            self._cv.release()
            synced = False
            started = self.clock()
            try:
                self.backend.sync_file(fd)
                synced = True
                spent = round(1e6 * (self.clock() - started))
                self.backend.fault("after_journal_sync")
            except BaseException as caught:
                error = caught
            finally:
                self._cv.acquire()
                self._syncing -= 1
                if synced:
                    self.metrics["sync_us_total"] += spent
                    self.metrics["sync_us_max"] = max(self.metrics["sync_us_max"], spent)
                # Durable even if something failed after the sync returned (J3 still stops),
                # but only in write order: a batch waits for every earlier batch's sync.
                entry[2] = synced
                while self._inflight and self._inflight[0][2] and self._failed is None:
                    done_last, done_end, _ = self._inflight.popleft()
                    self._durable, self._durable_end = done_last, done_end
                if error is not None:
                    self._failed = self._failed or error  # J3, before anyone is woken
                self._wake_locked()
                self._cv.notify_all()
        if error is not None:
            # J3: after a failed journal write or sync the file's state is unknown; stop (fail-stop).
            self._failed = self._failed or error
            raise error
        self.metrics["syncs"] += 1
        self.metrics["batches"] += 1

    def _write_locked(self) -> None:
        """J2.5: write the pending frames without a sync (the caller holds ``_cv``)."""
        self._writing = True
        error, _ = self._write_batch_locked()
        self._wake_locked()
        self._cv.notify_all()
        if error is not None:
            raise error  # J3: _failed is set, the journal stops

    def _write_batch_locked(self) -> tuple[BaseException | None, list[Any]]:
        """Write every pending frame up to a segment switch point with one vectored write
        (``_cv`` held, released during the write; the caller took the writer role, this gives
        it back). Returns the error, if any (then the journal has failed, J3), and the batch's
        [last seq, end offset, synced=False]."""
        batch, last, offset = self._pending, self._next_seq - 1, self._offset
        self._pending = []
        if self._switch_at is not None and last > self._switch_at:
            # J5.2: this segment ends at the switch point; the rest waits for the next one.
            cut = 2 * (self._switch_at - self._written)  # a header and a body per frame
            batch, self._pending, last = batch[:cut], batch[cut:], self._switch_at
        self._cv.release()
        error: BaseException | None = None
        written = 0
        try:
            written = self._write(batch, offset) if batch else 0
        except BaseException as caught:
            error = caught
        self._cv.acquire()
        self._writing = False
        if error is None:
            self._offset = offset + written
            self._written = last
            self.bytes_since_snapshot += written
        else:
            self._failed = error  # J3, before anyone is woken: no waiter may lead another batch
        return error, [last, offset + written, False]

    def _quiesce(self) -> None:
        """Wait until no batch is being written or synced (before the segment's descriptor changes)."""
        with self._cv:
            while self._writing or self._syncing:
                self._cv.wait()

    def _write(self, batch: list[bytes], offset: int) -> int:
        end = offset + sum(len(b) for b in batch)
        self.backend.fault("before_journal_write")
        if end + JOURNAL_PREALLOC_BYTES // 2 > self._allocated:
            # J1.1, J7: keep zeros ahead, written and synced before the frames that land in
            # them, so a crash can never leave a frame at the end of the file: whatever the
            # frames' fate, zeros follow them (a file cut short is damage, not a crash).
            target = end + JOURNAL_PREALLOC_BYTES
            posix.pwrite_all(self._fd, [bytes(target - self._allocated)], self._allocated)
            self.backend.sync_file(self._fd)
            self._allocated = target
        written = posix.pwrite_all(self._fd, batch, offset)
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

    def request_switch(self) -> tuple[int, bytes]:
        """J5.1, no I/O (the coordinator's lock is held): the current segment ends with the last
        frame framed so far; frames framed from now on go to the next segment, which
        :meth:`switch` starts. Returns that last frame's sequence number and chain value."""
        with self._cv:
            self._check_failed()
            invariant(self._switch_at is None, "one segment switch at a time")
            self._switch_at, self._switch_chain = self._next_seq - 1, self._chain
            self.bytes_since_snapshot = 0
            return self._switch_at, self._switch_chain

    def switch(self) -> None:
        """J5.2: once every frame up to the switch point is durable, start the next segment by
        D0 and cut this one at its last frame. Frames after the point wait only for this, and
        appends go on meanwhile. A failure before the next segment's name exists gives the
        switch up (frames go on here); any later one stops the journal (J3): the next segment
        may be half made, and nothing may be appended where a recovery would not continue."""
        with self._cv:
            at, chain = self._switch_at, self._switch_chain
        if at is None:
            return  # no switch requested
        try:
            self.wait(at)
            with self._cv:
                while self._writing or self._syncing:  # the old descriptor's syncs end first
                    self._check_failed()
                    self._cv.wait()
                self._check_failed()
                self._writing = True
        except BaseException as error:
            with self._cv:
                self._failed = self._failed or error
                self._wake_locked()
                self._cv.notify_all()
            raise
        first, created = at + 1, False
        try:
            self.backend.fault("before_segment_switch")
            try:
                fd, allocated = self._create_segment(first, chain)
            except BaseException:
                created = self._visible(first)
                raise
            created = True
            self._replace_segment(fd, allocated, first)  # the writer role keeps others out
            self.backend.fault("after_segment_switch")
        except BaseException as error:
            if created:
                with self._cv:
                    self._failed = error
            # Else nothing visible changed (a full disk making the segment's temporary file):
            # the switch is given up and frames go on in this segment.
            raise
        finally:
            with self._cv:
                self._writing = False
                self._switch_at = None
                self._wake_locked()  # frames after the switch point may lead a batch now
                self._cv.notify_all()

    def _visible(self, first: int) -> bool:
        """Whether segment ``first`` may exist (True when that cannot even be checked)."""
        try:
            return posix.exists(os.path.join(self.wal, _name(first, ".wal")))
        except OSError:
            return True

    def write_snapshot_at(self, seq: int, chain: bytes, body: bytes) -> None:
        """J5.4-J5.5, after :meth:`switch` started segment ``seq + 1``: persist the state as of
        frame ``seq`` (``chain`` after it) by D0, then drop the files it makes redundant. A
        failure before the snapshot is durable changes nothing; the tidying may fail silently."""
        written = self._persist_snapshot(seq, chain, body)
        with self._cv:
            self.snapshot_bytes = written
            self.metrics["snapshots"] += 1
        self._prune(seq, seq + 1)

    def _persist_snapshot(self, seq: int, chain: bytes, body: bytes) -> int:
        """D0: ``snap/<seq>.snap`` holds the state as of frame ``seq``; its size in bytes."""
        header = frame.encode_segment_header(frame.SNAPSHOT_MAGIC, seq, chain, self.tag)
        frame_header, _ = frame.encode_frame(seq, chain, body)
        path = os.path.join(self.snap, _name(seq, ".snap"))
        self.backend.fault("before_snapshot_write")
        durable.replace_file(
            path, [header, frame_header, body], self.backend.sync_file, self.backend.sync_dir
        )
        self.backend.fault("after_snapshot_write")
        return len(header) + len(frame_header) + len(body)

    def _prune(self, snapshot_seq: int, first_kept: int) -> None:
        """J5.5: delete snapshots before ``snapshot_seq`` and segments before ``first_kept``."""
        for old_seq, old in _listing(self.snap, ".snap"):
            if old_seq < snapshot_seq:
                posix.unlink_quietly(old)
        for first, old in _listing(self.wal, ".wal"):
            if first < first_kept:
                posix.unlink_quietly(old)
        self.backend.sync_dir(self.snap)
        self.backend.sync_dir(self.wal)

    def write_snapshot(self, body: bytes) -> None:
        """Persist the state as of the last frame, start a new segment, drop the old files."""
        self.wait(self._next_seq - 1)  # every frame durable, those written without a sync too (J2.5)
        self._quiesce()
        invariant(not self._pending and self._durable == self._next_seq - 1, "snapshot of a durable state")
        seq, chain = self._durable, self._chain
        written = self._persist_snapshot(seq, chain, body)
        try:
            self.start_segment()
        except BaseException as error:
            # The snapshot is durable but the next segment may be half made: stop (J3), so
            # nothing is appended to a segment a recovery would not continue from.
            self._failed = error
            raise
        # The snapshot and the new segment are durable; older files are no longer needed (J5.5).
        self._prune(seq, self.segment_first_seq)
        self.bytes_since_snapshot = 0
        self.snapshot_bytes = written
        self.metrics["snapshots"] += 1
