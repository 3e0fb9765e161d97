"""The catalog log: one chained, checksummed file shared by every client of a pool.

docs/DURABILITY.md G1-G5. ``<pool>/catalog/log`` starts with a segment header
(docs/FORMAT.md section 8.1, tag of the pool's catalog) followed by journal
frames (section 8.2) whose bodies are ``{"events": [...]}``. Every reader and
writer holds ``<pool>/catalog/LOCK`` (``flock``, A8) while it catches up with
the log and appends, so all clients apply the same events in the same order.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from .._fs import durable, lock, posix
from .._journal import frame
from ..backend import FilesystemBackend
from ..errors import CorruptData, UnsafeRecovery
from ..limits import CATALOG_COMPACT_BYTES_MIN
from ..protocol import decode, encode
from .state import CatalogState, Event

CATALOG_DIR = "catalog"
LOG_FILE = "log"
LOCK_FILE = "LOCK"
SNAPSHOT_FILE = "snapshot"
TAG = frame.identity_tag("straw-pool", "catalog")


class Catalog:
    """This process's view of the pool's catalog; use it inside :meth:`locked`."""

    def __init__(self, backend: FilesystemBackend) -> None:
        self.backend = backend
        self.directory = os.path.join(str(backend.root), CATALOG_DIR)
        self.path = os.path.join(self.directory, LOG_FILE)
        self.snapshot_path = os.path.join(self.directory, SNAPSHOT_FILE)
        self.snapshot_bytes = 0
        self._log_first = 0
        self._skip_until = 0
        self.state = CatalogState()
        self._mutex = threading.Lock()
        self._lock_fd = -1
        self._offset = 0
        self._seq = 0
        self._chain = frame.genesis_chain(TAG)
        self._held = False
        self.metrics = {"appends": 0, "syncs": 0, "frames_read": 0, "compactions": 0}

    # -- the exclusive section (G1) ---------------------------------------------------

    @contextlib.contextmanager
    def locked(self) -> Iterator[Catalog]:
        """Hold the pool-wide catalog lock, with the state caught up to the end of the log."""
        with self._mutex:
            if self._lock_fd < 0:
                try:
                    durable.make_dirs(self.directory, str(self.backend.root), self.backend.sync_dir)
                    self._lock_fd = lock.open_lock_file(os.path.join(self.directory, LOCK_FILE))
                except OSError as error:
                    raise posix.storage_error(error, f"opening the catalog in {self.directory}") from error
            try:
                lock.lock_exclusive(self._lock_fd)
            except OSError as error:
                raise posix.storage_error(error, f"locking {self.directory}") from error
            self._held = True
            try:
                self._catch_up()
                # G7 runs before the caller's work, so its failure changes nothing the caller did.
                if self._offset > max(CATALOG_COMPACT_BYTES_MIN, 2 * self.snapshot_bytes):
                    self._compact()
                yield self
            except OSError as error:
                # Every catalog failure reaches the caller as straw's storage error (API.md section 8).
                raise posix.storage_error(error, f"updating the catalog in {self.directory}") from error
            finally:
                self._held = False
                lock.unlock_only(self._lock_fd)

    def close(self) -> None:
        with self._mutex:
            if self._lock_fd >= 0:
                posix.close_quietly(self._lock_fd)
                self._lock_fd = -1

    # -- reading (G2) -------------------------------------------------------------------

    def _reset(self) -> None:
        self.state = CatalogState()
        self._offset, self._seq, self._chain = 0, 0, frame.genesis_chain(TAG)
        self._log_first = 0
        self._skip_until = 0

    def _catch_up(self) -> None:
        """Apply every frame appended since this process last looked; cut a torn tail (G2).

        The log starts with a segment header naming its first sequence number. When
        that changes, another client compacted the catalog (G7): this view reloads
        from the snapshot and the new log.
        """
        try:
            fd = posix.open_read(self.path)
        except FileNotFoundError:
            if posix.exists(self.snapshot_path):
                raise CorruptData(
                    f"{self.path} is missing but a catalog snapshot exists; run `straw check`"
                ) from None
            self._create()
            return
        try:
            size = posix.fstat_size(fd)
            header = posix.pread_exact(fd, frame.SEGMENT_HEADER_BYTES, 0)
            if len(header) < frame.SEGMENT_HEADER_BYTES:
                raise CorruptData(f"{self.path}: catalog header truncated; run `straw check`")
            found = frame.decode_segment_header(header, frame.SEGMENT_MAGIC)
            if found.tag != TAG:
                raise UnsafeRecovery(f"{self.path} is not this pool's catalog")
            if self._offset == 0 or found.first_seq != self._log_first or size < self._offset:
                self._load_snapshot()
                if found.first_seq > self._seq + 1:
                    raise CorruptData(
                        f"{self.path} starts at frame {found.first_seq} after snapshot {self._seq}"
                    )
                # Frames up to the snapshot are checked (chain) but not applied again.
                self._skip_until = self._seq
                self._seq, self._chain = found.first_seq - 1, found.chain_in
                self._offset, self._log_first = frame.SEGMENT_HEADER_BYTES, found.first_seq
            data = posix.pread_exact(fd, size - self._offset, self._offset)
        finally:
            posix.close_quietly(fd)
        self._apply_frames(data)

    def _load_snapshot(self) -> None:
        self._reset()
        try:
            data = posix.read_file(self.snapshot_path)
        except FileNotFoundError:
            return
        header = frame.decode_segment_header(data, frame.SNAPSHOT_MAGIC)
        if header.tag != TAG:
            raise UnsafeRecovery(f"{self.snapshot_path} is not this pool's catalog snapshot")
        verdict = frame.classify(data, frame.SEGMENT_HEADER_BYTES, header.first_seq, header.chain_in)
        if verdict.frame is None or verdict.frame.end != len(data):
            raise CorruptData(f"{self.snapshot_path} is damaged ({verdict.reason}); run `straw check`")
        self.state = CatalogState.from_dict(decode(verdict.frame.body))
        self._seq, self._chain = header.first_seq, header.chain_in

    def _apply_frames(self, data: bytes | bytearray) -> None:
        at = 0
        while True:
            verdict = frame.classify(data, at, self._seq + 1, self._chain)
            if verdict.decision is frame.Decision.FRAME and verdict.frame is not None:
                if verdict.frame.seq > self._skip_until:
                    for event in decode(verdict.frame.body)["events"]:
                        self.state.apply(event)
                self._seq, self._chain, at = verdict.frame.seq, verdict.frame.chain, verdict.frame.end
                self.metrics["frames_read"] += 1
                continue
            if verdict.decision is frame.Decision.TORN:
                # G2: a crashed appender's unacknowledged frame; the lock holder cuts it.
                durable.cut_tail(self.path, self._offset + at, self.backend.sync_file)
            elif verdict.decision is frame.Decision.CORRUPT:
                raise CorruptData(f"{self.path}: {verdict.reason}; the catalog is damaged, run `straw check`")
            break
        if self._seq < self._skip_until:
            raise CorruptData(
                f"{self.path} ends at frame {self._seq}, before its snapshot ({self._skip_until})"
            )
        self._offset += at

    def _compact(self) -> None:
        """G7: snapshot the state and start a new log after it (caller holds the lock).

        A crash between the two replacements leaves the new snapshot with the old
        log, whose frames up to the snapshot are skipped on load.
        """
        seq, chain = self._seq, self._chain
        body = encode(self.state.to_dict())
        header = frame.encode_segment_header(frame.SNAPSHOT_MAGIC, seq, chain, TAG)
        frame_header, _ = frame.encode_frame(seq, chain, body)
        self.backend.fault("before_catalog_compact")
        durable.replace_file(
            self.snapshot_path, [header, frame_header, body], self.backend.sync_file, self.backend.sync_dir
        )
        log_header = frame.encode_segment_header(frame.SEGMENT_MAGIC, seq + 1, chain, TAG)
        durable.replace_file(self.path, [log_header], self.backend.sync_file, self.backend.sync_dir)
        self._offset, self._log_first, self._skip_until = frame.SEGMENT_HEADER_BYTES, seq + 1, seq
        self.snapshot_bytes = len(header) + len(frame_header) + len(body)
        self.metrics["compactions"] += 1

    def _create(self) -> None:
        header = frame.encode_segment_header(frame.SEGMENT_MAGIC, 1, frame.genesis_chain(TAG), TAG)
        durable.create_file(self.path, [header], self.backend.sync_file, self.backend.sync_dir)
        self._reset()
        self._offset, self._log_first = frame.SEGMENT_HEADER_BYTES, 1

    # -- appending (G3) -------------------------------------------------------------------

    def append(self, events: Sequence[Event]) -> None:
        """Durably append events (one frame) and apply them; call inside :meth:`locked`."""
        if not self._held:
            raise RuntimeError("Catalog.append outside Catalog.locked()")
        if not events:
            return
        body = encode({"events": list(events)})
        header, chain = frame.encode_frame(self._seq + 1, self._chain, body, self._seq)
        fd = posix.open_append(self.path)
        try:
            self.backend.fault("before_catalog_write")
            written = posix.pwrite_all(fd, [header, body], self._offset)
            self.backend.fault("after_catalog_append")
            self.backend.sync_file(fd)
            self.backend.fault("after_catalog_sync")
        except BaseException:
            # The tail is unknown (A3): a later sync would prove nothing about it, so no frame
            # may ever chain onto it. Cut it while the lock is still held (G3.4): once the cut is
            # synced the frame is durably absent. If even that fails, forget this view; the next
            # section reloads from disk (retains too much, never too little).
            with contextlib.suppress(OSError):
                posix.truncate(fd, self._offset)
                self.backend.sync_file(fd)
            self._reset()
            raise
        finally:
            posix.close_quietly(fd)
        self._offset += written
        self._seq += 1
        self._chain = chain
        for event in events:
            self.state.apply(event)
        self.metrics["appends"] += 1
        self.metrics["syncs"] += 1

    def size(self) -> int:
        try:
            return posix.getsize(self.path)
        except FileNotFoundError:
            return 0


def describe(state: CatalogState) -> dict[str, Any]:
    """Counts for ``collect_garbage`` results and inspection."""
    return {
        "owners": len(state.owners),
        "tombstones": len(state.tombstones),
        "known_packs": len(state.packs),
        "dead_writers": len(state.dead_writers),
    }
