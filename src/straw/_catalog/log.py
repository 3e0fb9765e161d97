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
from ..protocol import decode, encode
from .state import CatalogState, Event

CATALOG_DIR = "catalog"
LOG_FILE = "log"
LOCK_FILE = "LOCK"
TAG = frame.identity_tag("straw-pool", "catalog")


class Catalog:
    """This process's view of the pool's catalog; use it inside :meth:`locked`."""

    def __init__(self, backend: FilesystemBackend) -> None:
        self.backend = backend
        self.directory = os.path.join(str(backend.root), CATALOG_DIR)
        self.path = os.path.join(self.directory, LOG_FILE)
        self.state = CatalogState()
        self._mutex = threading.Lock()
        self._lock_fd = -1
        self._offset = 0
        self._seq = 0
        self._chain = frame.genesis_chain(TAG)
        self._held = False
        self.metrics = {"appends": 0, "syncs": 0, "frames_read": 0}

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

    def _catch_up(self) -> None:
        """Apply every frame appended since this process last looked; cut a torn tail."""
        try:
            fd = posix.open_read(self.path)
        except FileNotFoundError:
            self._create()
            return
        try:
            size = os.fstat(fd).st_size
            if size < self._offset:
                self._reset()  # the log was rewritten (not done by this version) or truncated
            if self._offset == 0:
                header = posix.pread_exact(fd, frame.SEGMENT_HEADER_BYTES, 0)
                if len(header) < frame.SEGMENT_HEADER_BYTES:
                    raise CorruptData(f"{self.path}: catalog header truncated; run `straw check`")
                found = frame.decode_segment_header(header, frame.SEGMENT_MAGIC)
                if found.tag != TAG:
                    raise UnsafeRecovery(f"{self.path} is not this pool's catalog")
                self._offset, self._chain = frame.SEGMENT_HEADER_BYTES, found.chain_in
            data = posix.pread_exact(fd, size - self._offset, self._offset)
        finally:
            posix.close_quietly(fd)
        self._apply_frames(data)

    def _apply_frames(self, data: bytes | bytearray) -> None:
        at = 0
        while True:
            verdict = frame.classify(data, at, self._seq + 1, self._chain)
            if verdict.decision is frame.Decision.FRAME and verdict.frame is not None:
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
        self._offset += at

    def _create(self) -> None:
        header = frame.encode_segment_header(frame.SEGMENT_MAGIC, 1, frame.genesis_chain(TAG), TAG)
        durable.create_file(self.path, [header], self.backend.sync_file, self.backend.sync_dir)
        self._reset()
        self._offset = frame.SEGMENT_HEADER_BYTES

    # -- appending (G3) -------------------------------------------------------------------

    def append(self, events: Sequence[Event]) -> None:
        """Durably append events (one frame) and apply them; call inside :meth:`locked`."""
        if not self._held:
            raise RuntimeError("Catalog.append outside Catalog.locked()")
        if not events:
            return
        body = encode({"events": list(events)})
        header, chain = frame.encode_frame(self._seq + 1, self._chain, body)
        fd = posix.open_append(self.path)
        try:
            self.backend.fault("before_catalog_write")
            written = posix.pwrite_all(fd, [header, body], self._offset)
            self.backend.fault("after_catalog_append")
            self.backend.sync_file(fd)
            self.backend.fault("after_catalog_sync")
        except BaseException:
            # The tail is unknown (A3): forget this view; the next section reloads from disk
            # and the lock holder then cuts or keeps the frame (retains too much, never too little).
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
            return os.path.getsize(self.path)
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
