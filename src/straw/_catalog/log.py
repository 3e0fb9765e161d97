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
from dataclasses import dataclass, field
from typing import Any

from .._fs import durable, lock, posix
from .._journal import frame, scan
from .._journal.scan import Problem
from ..backend import FilesystemBackend
from ..errors import CorruptData, QueueError, UnsafeRecovery, UnsupportedSchema, invariant
from ..limits import CATALOG_COMPACT_BYTES_MIN, CATALOG_PREALLOC_BYTES
from ..protocol import decode, encode
from .state import CatalogState, Event

CATALOG_DIR = "catalog"
LOG_FILE = "log"
LOCK_FILE = "LOCK"
SNAPSHOT_FILE = "snapshot"
TAG = frame.identity_tag("straw-pool", "catalog")
#: Bytes before a view's end that a catch-up reads again to tell an append from a rewrite.
_TAIL_BYTES = 64


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
        self._size = 0  # the log file's size: frames, then zeros written ahead (J7)
        self._tail = b""  # the last bytes before _offset, as this view read or wrote them
        self._header = b""  # the log's segment header as this view last verified it
        self._fd = -1  # the log, opened by this section's catch-up (G2) for its append (G3)
        self._closed = False  # closed: sections still work, and keep no descriptor after them
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
                self._drop_fd()
                if self._closed:  # a call through a closed store: nothing stays open after it
                    posix.close_quietly(self._lock_fd)  # (closing releases the lock)
                    self._lock_fd = -1
                else:
                    lock.unlock_only(self._lock_fd)

    def _drop_fd(self) -> None:
        if self._fd >= 0:
            posix.close_quietly(self._fd)
            self._fd = -1

    def close(self) -> None:
        """Give up the lock file's descriptor. Sections may still run afterwards (a call
        through a closed store that it still answers); each then opens and closes its own."""
        with self._mutex:
            self._closed = True
            if self._lock_fd >= 0:
                posix.close_quietly(self._lock_fd)
                self._lock_fd = -1

    # -- reading (G2) -------------------------------------------------------------------

    def _reset(self) -> None:
        self.state = CatalogState()
        self._offset, self._seq, self._chain = 0, 0, frame.genesis_chain(TAG)
        self._log_first = 0
        self._skip_until = 0
        self._size = 0
        self._tail = b""
        self._header = b""
        self._drop_fd()

    def _catch_up(self) -> None:
        """Apply every frame appended since this process last looked; zero a torn tail (G2).

        The log starts with a segment header naming its first sequence number. When
        that changes, another client compacted the catalog (G7): this view reloads
        from the snapshot and the new log, with the loader ``straw check`` uses.

        The descriptor stays open for this section's append (G3): under the lock nobody
        else replaces the log, so the file read is the file appended to.
        """
        try:
            fd = posix.open_update(self.path)
        except FileNotFoundError:
            self._missing()
            return
        keep = False
        try:
            size = posix.fstat_size(fd)
            header = bytes(posix.pread_exact(fd, frame.SEGMENT_HEADER_BYTES, 0))
            # A header this view verified before is the same header; any other is decoded.
            same = bool(self._header) and header == self._header
            first = self._log_first if same else _first_seq(header)
            data: bytes | bytearray | memoryview | None = None
            if self._offset and first == self._log_first and size >= self._offset:
                # The bytes just before this view's end must still be the ones it read: a log
                # rewritten by anything but an append (a restore, a copy) is loaded afresh.
                back = len(self._tail)
                data = posix.pread_exact(fd, size - self._offset + back, self._offset - back)
                if bytes(data[:back]) != self._tail:
                    data = None
                else:
                    data = memoryview(data)[back:]
                    keep = True
        finally:
            if not keep:
                posix.close_quietly(fd)
        if data is None:
            self._reload()
            return
        self._fd, self._header = fd, header
        position = scan.Position(self._seq, self._chain, 0)
        try:
            end = scan.walk(data, position, self._visit, newest=True)
        except BaseException:
            self._reset()  # a frame's events may be half applied: reload next time
            raise
        self._seq, self._chain = position.seq, position.chain
        if end.offset:
            self._tail = bytes(data[max(0, end.offset - _TAIL_BYTES) : end.offset])
        self._finish(end, self._offset + end.offset, size)

    def _missing(self) -> None:
        """No log: create it in a pool that never had one, refuse in one that must have (I20)."""
        if posix.exists(self.snapshot_path):
            raise CorruptData(f"{self.path} is missing but a catalog snapshot exists; run `straw check`")
        found = traces(str(self.backend.root))
        if found:
            raise UnsafeRecovery(
                f"the pool's catalog ({self.path}) is missing, but {found}: who owns what is unknown, "
                "so nothing may be collected or retained. Run `straw check` on the pool, then restore "
                "the catalog or rebuild it with `straw check --rebuild-catalog --owner NAME ...` "
                "(docs/CHECK.md)"
            )
        self._create()

    def _reload(self) -> None:
        """Load the snapshot and the whole log (G2, G7), failing closed on any problem."""
        self._reset()
        try:
            loaded = load_catalog(self.directory)
        except OSError as error:
            raise posix.storage_error(error, f"reading the catalog in {self.directory}") from error
        if loaded.problem is not None:
            raise loaded.problem.error(f"{loaded.problem.message}; the catalog is damaged, run `straw check`")
        if not loaded.present:
            self._missing()
            return
        self.state = loaded.state
        self.snapshot_bytes = loaded.snapshot_bytes
        self._seq, self._chain = loaded.seq, loaded.chain
        self._log_first, self._skip_until = loaded.log_first, loaded.skip_until
        self.metrics["frames_read"] += loaded.frames
        invariant(loaded.end is not None, "a present log has an end")
        if loaded.end is not None:
            self._tail = loaded.tail
            self._finish(loaded.end, loaded.end.offset, loaded.size)

    def _visit(self, found: frame.Frame) -> None:
        if found.seq > self._skip_until:
            apply_frame(self.state, found, self.path)
        self.metrics["frames_read"] += 1

    def _finish(self, end: scan.LogEnd, offset: int, size: int) -> None:
        """How the log ends (J7): zeros are its clean end, a torn frame is zeroed, a cut or
        damage fails closed."""
        if end.kind == scan.TORN:
            # G2: a crashed appender's unacknowledged frame; the lock holder zeroes it (it never
            # cuts: the log keeps ending in zeros, J7).
            durable.zero_tail(self.path, offset, self.backend.sync_file)
        elif end.fatal:
            self._reset()
            raise CorruptData(f"{self.path}: {end.reason}; the catalog is damaged, run `straw check`")
        if self._seq < self._skip_until:
            raise CorruptData(
                f"{self.path} ends at frame {self._seq}, before its snapshot ({self._skip_until})"
            )
        self._offset, self._size = offset, size

    def _compact(self) -> None:
        """G7: snapshot the state and start a new log after it (caller holds the lock).

        A crash between the two replacements leaves the new snapshot with the old
        log, whose frames up to the snapshot are skipped on load.
        """
        self._drop_fd()  # the file this section read is about to be replaced
        seq, chain = self._seq, self._chain
        body = encode(self.state.to_dict())
        header = frame.encode_segment_header(frame.SNAPSHOT_MAGIC, seq, chain, TAG)
        frame_header, _ = frame.encode_frame(seq, chain, body)
        self.backend.fault("before_catalog_compact")
        durable.replace_file(
            self.snapshot_path, [header, frame_header, body], self.backend.sync_file, self.backend.sync_dir
        )
        log_header = frame.encode_segment_header(frame.SEGMENT_MAGIC, seq + 1, chain, TAG)
        zeros = bytes(CATALOG_PREALLOC_BYTES)
        durable.replace_file(self.path, [log_header, zeros], self.backend.sync_file, self.backend.sync_dir)
        self._offset, self._log_first, self._skip_until = frame.SEGMENT_HEADER_BYTES, seq + 1, seq
        self._size = frame.SEGMENT_HEADER_BYTES + len(zeros)
        self._tail = log_header[-_TAIL_BYTES:]
        self.snapshot_bytes = len(header) + len(frame_header) + len(body)
        self.metrics["compactions"] += 1

    def _create(self) -> None:
        header = frame.encode_segment_header(frame.SEGMENT_MAGIC, 1, frame.genesis_chain(TAG), TAG)
        zeros = bytes(CATALOG_PREALLOC_BYTES)
        durable.create_file(self.path, [header, zeros], self.backend.sync_file, self.backend.sync_dir)
        self._reset()
        self._offset, self._log_first = frame.SEGMENT_HEADER_BYTES, 1
        self._size = frame.SEGMENT_HEADER_BYTES + len(zeros)
        self._tail = header[-_TAIL_BYTES:]

    # -- appending (G3) -------------------------------------------------------------------

    def append(self, events: Sequence[Event]) -> None:
        """Durably append events (one frame) and apply them; call inside :meth:`locked`."""
        if not self._held:
            raise RuntimeError("Catalog.append outside Catalog.locked()")
        if not events:
            return
        body = encode({"events": list(events)})
        header, chain = frame.encode_frame(self._seq + 1, self._chain, body, self._seq)
        end = self._offset + len(header) + len(body)
        opened = self._fd < 0
        fd = posix.open_append(self.path) if opened else self._fd
        try:
            if end + CATALOG_PREALLOC_BYTES // 2 > self._size:
                # J7: zeros ahead of the frame, durable before it, so the log ends in zeros
                # whatever becomes of the frame (a log without them was cut short).
                target = end + CATALOG_PREALLOC_BYTES
                posix.pwrite_all(fd, [bytes(target - self._size)], self._size)
                self.backend.sync_file(fd)
                self._size = target
            self.backend.fault("before_catalog_write")
            written = posix.pwrite_all(fd, [header, body], self._offset)
            self.backend.fault("after_catalog_append")
            self.backend.sync_file(fd)
            self.backend.fault("after_catalog_sync")
        except BaseException:
            # The tail is unknown (A3): a later sync would prove nothing about it, so no frame
            # may ever chain onto it. Zero it while the lock is still held (G3): once that is
            # synced the frame is durably absent. If even that fails, forget this view; the next
            # section reloads from disk (retains too much, never too little).
            with contextlib.suppress(OSError):
                posix.pwrite_all(fd, [bytes(end - self._offset)], self._offset)
                self.backend.sync_file(fd)
            self._reset()  # closes the section's descriptor too
            raise
        finally:
            if opened:
                posix.close_quietly(fd)
        self._offset += written
        self._seq += 1
        self._chain = chain
        self._tail = (header + body)[-_TAIL_BYTES:]
        for event in events:
            self.state.apply(event)
        self.metrics["appends"] += 1
        self.metrics["syncs"] += 1

    @property
    def end(self) -> int:
        """The offset just past the log's last frame (the zeros written ahead follow it)."""
        return self._offset

    def size(self) -> int:
        try:
            return posix.getsize(self.path)
        except FileNotFoundError:
            return 0


def describe(state: CatalogState) -> dict[str, Any]:
    """Counts for ``collect_garbage`` results and inspection. ``known_packs`` counts the packs
    whose seal or staging the catalog holds; a reclaimed pack is only a tombstone."""
    return {
        "owners": len(state.owners),
        "tombstones": len(state.tombstones),
        "known_packs": len(state.packs),
        "dead_writers": len(state.dead_writers),
    }


# --------------------------------------------------------------------------- loading, shared with check


def traces(root: str) -> str:
    """What in a pool proves it had a catalog ("" if nothing): a writer's directory under
    ``raw/`` or a queue directory. Stores and coordinators make the catalog exist before they
    create either (I20), so either one without a catalog means the catalog was lost."""
    try:
        writers = [n for n in posix.listdir(os.path.join(root, "raw")) if not n.startswith(".")]
    except (FileNotFoundError, NotADirectoryError):
        writers = []
    if writers:
        return f"raw/ holds {len(writers)} writer director{'y' if len(writers) == 1 else 'ies'}"
    if posix.isdir(os.path.join(root, "queue")):
        return "the pool holds a queue (queue/)"
    try:
        if posix.listdir(os.path.join(root, "queues")):
            return "the pool holds queues (queues/)"
    except (FileNotFoundError, NotADirectoryError):
        pass
    return ""


def _first_seq(header: bytes | bytearray) -> int:
    try:
        return frame.decode_segment_header(header, frame.SEGMENT_MAGIC).first_seq
    except (CorruptData, UnsupportedSchema):
        return -1


def apply_frame(state: CatalogState, found: frame.Frame, path: str) -> None:
    """Apply one catalog frame's events; a body that is not one raises CorruptData."""
    try:
        body = decode(found.body)
        events = body["events"]
        if not isinstance(events, list):
            raise TypeError("events is not a list")
        for event in events:
            state.apply(event)
    except (QueueError, KeyError, TypeError, ValueError, AttributeError) as error:
        raise CorruptData(f"{path}: frame {found.seq} holds a malformed event ({error!r})") from None


@dataclass
class CatalogLoad:
    """A whole catalog read from disk (snapshot, then log), stopped at the first problem."""

    state: CatalogState = field(default_factory=CatalogState)
    present: bool = False  # the log exists
    seq: int = 0
    chain: bytes = field(default_factory=lambda: frame.genesis_chain(TAG))
    log_first: int = 0
    skip_until: int = 0
    size: int = 0  # of the log
    snapshot_bytes: int = 0
    frames: int = 0
    end: scan.LogEnd | None = None
    problem: Problem | None = None
    tail: bytes = b""  # the bytes just before end.offset


def load_catalog(directory: str, label: str = "") -> CatalogLoad:
    """Read ``directory``'s catalog snapshot and log (G2, G7, J7) through ``straw._fs``.

    The one loader: :class:`Catalog` raises its problem, ``straw check`` reports it. A torn
    tail is left to the caller (``CatalogLoad.end``). Raises ``OSError`` only for I/O errors.
    """
    out = CatalogLoad()
    log_path, snap_path = os.path.join(directory, LOG_FILE), os.path.join(directory, SNAPSHOT_FILE)
    log_name = f"{label}/{LOG_FILE}" if label else log_path
    snap_name = f"{label}/{SNAPSHOT_FILE}" if label else snap_path

    def stop(code: str, name: str, message: str, error: type[QueueError] = CorruptData) -> CatalogLoad:
        out.problem = Problem(code, name, message, error)
        return out

    try:
        snapshot: bytes | None = posix.read_file(snap_path)
    except FileNotFoundError:
        snapshot = None
    if snapshot is not None:
        out.snapshot_bytes = len(snapshot)
        problem = _load_snapshot(out, snapshot, snap_name)
        if problem is not None:
            out.problem = problem
            return out
    try:
        data = posix.read_file(log_path)
    except FileNotFoundError:
        if snapshot is not None:
            return stop(
                "catalog.missing_log", log_name, f"{log_name} is missing but a catalog snapshot exists"
            )
        return out
    out.present, out.size = True, len(data)
    try:
        header = frame.decode_segment_header(data, frame.SEGMENT_MAGIC)
    except (CorruptData, UnsupportedSchema) as error:
        return stop("catalog.corrupt_frame", log_name, f"{log_name}: {error}", type(error))
    if header.tag != TAG:
        return stop("catalog.foreign", log_name, f"{log_name} is not this pool's catalog", UnsafeRecovery)
    if header.first_seq > out.seq + 1:
        return stop(
            "catalog.gap", log_name, f"{log_name} starts at frame {header.first_seq} after snapshot {out.seq}"
        )
    # Frames up to the snapshot are checked (chain) but not applied again.
    out.skip_until, out.log_first = out.seq, header.first_seq
    position = scan.Position(header.first_seq - 1, header.chain_in, frame.SEGMENT_HEADER_BYTES)

    def visit(found: frame.Frame) -> None:
        if found.seq > out.skip_until:
            apply_frame(out.state, found, log_name)

    try:
        end = scan.walk(data, position, visit, newest=True)
    except CorruptData as error:
        return stop("catalog.bad_event", log_name, str(error))
    except UnsupportedSchema as error:
        return stop("catalog.corrupt_frame", log_name, f"{log_name}: {error}", UnsupportedSchema)
    out.seq, out.chain, out.frames, out.end = position.seq, position.chain, position.frames, end
    out.tail = bytes(data[max(0, end.offset - _TAIL_BYTES) : end.offset])
    if end.kind == scan.CUT:
        return stop("catalog.truncated", log_name, f"{log_name}: {end.reason}")
    if end.kind == scan.CORRUPT:
        return stop("catalog.corrupt_frame", log_name, f"{log_name}: {end.reason}")
    if out.seq < out.skip_until:
        return stop(
            "catalog.gap",
            log_name,
            f"{log_name} ends at frame {out.seq}, before its snapshot ({out.skip_until})",
        )
    return out


def _load_snapshot(out: CatalogLoad, data: bytes, name: str) -> Problem | None:
    try:
        header = frame.decode_segment_header(data, frame.SNAPSHOT_MAGIC)
        if header.tag != TAG:
            return Problem(
                "catalog.foreign", name, f"{name} is not this pool's catalog snapshot", UnsafeRecovery
            )
        verdict = frame.classify(data, frame.SEGMENT_HEADER_BYTES, header.first_seq, header.chain_in)
        if verdict.frame is None or verdict.frame.end != len(data):
            raise CorruptData(verdict.reason)
        out.state = CatalogState.from_dict(decode(verdict.frame.body))
    except (CorruptData, UnsupportedSchema, KeyError, TypeError, ValueError, AttributeError) as error:
        return Problem("catalog.snapshot_corrupt", name, f"{name} is damaged ({error})", CorruptData)
    out.seq, out.chain = header.first_seq, header.chain_in
    return None
