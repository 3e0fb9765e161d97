"""Walking a chained log: one scanner for recovery and for ``straw check`` (docs/DURABILITY.md J4, J7).

A log is a file of frames after a 64-byte header (docs/FORMAT.md section 8): a
queue's journal segment or the pool's catalog log. :func:`walk` applies the
decision table (``frame.classify``) frame after frame and then judges how the
file ends, by the rule both writers keep (J7, "a log ends in zeros"): the
newest file of a log always ends with at least ``LOG_END_ZEROS_MIN`` zero
bytes after its last frame, because the zeros ahead of an append are written
and synced before the append itself. So

* frames, then zeros to the end: a clean end (``zeros``);
* frames, then a torn or unproven damaged frame, then zeros: a crashed append
  (``torn``; the owner of the log zeroes it, never cuts it);
* frames, then the end of the file with fewer zeros than that (a file that ends
  at a frame boundary or inside a frame): the file was cut (``cut``), which no
  crash can do; it fails closed, like damage a later frame witnesses (``corrupt``).

Recovery raises on ``cut`` and ``corrupt`` and repairs ``torn``; ``straw check``
records all three as findings. Both read through ``straw._fs`` (the FaultFS seam).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

from .._fs import posix
from ..errors import CorruptData, QueueError, UnsafeRecovery, UnsupportedSchema
from ..limits import LOG_END_ZEROS_MIN
from . import frame

ZEROS, TORN, CUT, CORRUPT, END = "zeros", "torn", "cut", "corrupt", "end"


@dataclass(frozen=True)
class LogEnd:
    """How a walked file ends: ``kind`` (module docs) at ``offset``, the end of its last valid frame."""

    kind: str
    offset: int
    reason: str

    @property
    def fatal(self) -> bool:
        return self.kind in (CUT, CORRUPT)


@dataclass
class Position:
    """Where a walk stands: the last frame's sequence number and chain value, and the next offset."""

    seq: int
    chain: bytes
    at: int
    frames: int = 0


def walk(
    data: bytes | bytearray | memoryview,
    position: Position,
    visit: Callable[[frame.Frame], None],
    *,
    newest: bool,
) -> LogEnd:
    """Hand every valid frame from ``position`` on to ``visit`` (advancing ``position``); how it ends.

    ``newest`` says whether this file is the log's newest (the journal's last segment, or
    the catalog log): only there must frames be followed by zeros (J7). An older segment
    ends where its successor begins: at a frame boundary (``end``) or in zeros (``zeros``).
    A ``visit`` that raises stops the walk; the position stays before that frame.
    """
    while True:
        verdict = frame.classify(data, position.at, position.seq + 1, position.chain)
        found = verdict.frame
        if verdict.decision is not frame.Decision.FRAME or found is None:
            break
        visit(found)
        position.seq, position.chain, position.at = found.seq, found.chain, found.end
        position.frames += 1
    return _end(data, position.at, verdict, newest)


def _end(data: bytes | bytearray | memoryview, at: int, verdict: frame.Verdict, newest: bool) -> LogEnd:
    if verdict.decision is frame.Decision.CORRUPT:
        return LogEnd(CORRUPT, at, verdict.reason)
    rest = len(data) - at
    if newest and (rest < LOG_END_ZEROS_MIN or not frame.all_zero(data[len(data) - LOG_END_ZEROS_MIN :])):
        what = "a frame boundary" if verdict.decision is frame.Decision.END else "the middle of a frame"
        return LogEnd(
            CUT,
            at,
            f"the file ends at {what} (offset {at}, {rest} bytes after the last valid frame) without "
            f"the {LOG_END_ZEROS_MIN} zero bytes every writer keeps after its frames: it was cut "
            "short, and frames after this point may be lost",
        )
    if verdict.decision is frame.Decision.END:
        return LogEnd(END, at, "end of file")
    if verdict.zeros or frame.all_zero(data[at:]):
        return LogEnd(ZEROS, at, f"{rest} zero bytes after the last frame")
    return LogEnd(TORN, at, verdict.reason)


def raise_for(end: LogEnd, what: str) -> None:
    """Recovery's side of a fatal end: ``CorruptData`` naming the file (``what``)."""
    if end.kind == CUT:
        raise CorruptData(f"{what}: {end.reason}; refusing to recover (restore the file, then retry)")
    if end.kind == CORRUPT:
        raise CorruptData(f"{what}: {end.reason}; refusing to recover past damage")


# --------------------------------------------------------------------------- a queue's journal

WAL_DIR = "wal"
SNAP_DIR = "snap"
_DIGITS = 20


def listing(directory: str, suffix: str) -> list[tuple[int, str]]:
    """(seq, path) of the files in ``directory`` named by a sequence number, in order."""
    try:
        names = posix.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []
    out = []
    for name in names:
        if name.endswith(suffix) and len(name) == _DIGITS + len(suffix) and name[:_DIGITS].isdigit():
            out.append((int(name[:_DIGITS]), os.path.join(directory, name)))
    return sorted(out)


@dataclass(frozen=True)
class Problem:
    """Why a journal cannot be recovered: a ``straw check`` finding code, the file, a sentence,
    and the error recovery raises for it."""

    code: str
    path: str
    message: str
    error: type[QueueError]


@dataclass
class JournalWalk:
    """What one walk of a queue's journal found (J4), stopped at the first problem."""

    snapshot_seq: int = 0
    snapshot_path: str | None = None
    snapshot_bytes: int = 0
    segments: list[tuple[int, str]] = field(default_factory=list)
    live: list[tuple[int, str]] = field(default_factory=list)
    last_seq: int = 0
    chain: bytes = b""
    end: LogEnd | None = None  # how the last live segment ends
    end_path: str | None = None
    #: Older segments that still end in zeros, with the end of their frames: a switch that a
    #: crash stopped before its cut (J5.2). Recovery cuts them (J4.4).
    uncut: list[tuple[str, int]] = field(default_factory=list)
    problem: Problem | None = None
    bytes: int = 0

    @property
    def empty(self) -> bool:
        """True when there is no snapshot and no segment at all."""
        return self.snapshot_path is None and not self.segments


def walk_journal(
    directory: str,
    tag: bytes,
    apply: Callable[[int, bytes], None],
    load: Callable[[bytes], None],
    *,
    base: str = "",
    upto: int | None = None,
) -> JournalWalk:
    """Walk ``directory``'s newest snapshot and every segment after it (DURABILITY.md J4, J7).

    ``load`` gets the snapshot body, ``apply`` every later frame in order. The walk stops
    at the first problem (``JournalWalk.problem``): the caller raises it (recovery) or
    reports it (``straw check``); a torn tail of the last segment is left for the caller
    (``JournalWalk.end``). Paths in messages are relative to ``base`` when given.
    Raises ``OSError`` only when a file cannot be read. With ``upto``, segments that start
    after frame ``upto`` are not read (a live appender may be writing them; J3.2, J5.3).
    """
    return _Walker(directory, tag, apply, base, upto).run(load)


class _Walker:
    """One walk of a journal directory (the state :func:`walk_journal` threads through segments)."""

    def __init__(
        self, directory: str, tag: bytes, apply: Callable[[int, bytes], None], base: str, upto: int | None
    ) -> None:
        self.directory, self.tag, self.apply, self.base = directory, tag, apply, base
        self.upto = upto
        self.result = JournalWalk(chain=frame.genesis_chain(tag))
        self.continued = False  # a segment starts right after the snapshot, or holds its frame
        self.snapshot_chain = self.result.chain

    def name(self, path: str) -> str:
        return os.path.relpath(path, self.base) if self.base else path

    def stop(self, code: str, path: str, message: str, error: type[QueueError] = CorruptData) -> JournalWalk:
        self.result.problem = Problem(code, self.name(path), message, error)
        return self.result

    def run(self, load: Callable[[bytes], None]) -> JournalWalk:
        result = self.result
        snapshots = listing(os.path.join(self.directory, SNAP_DIR), ".snap")
        result.segments = listing(os.path.join(self.directory, WAL_DIR), ".wal")
        for _, path in snapshots + result.segments:
            result.bytes += _size(path)
        if snapshots:
            seq, path = snapshots[-1]
            result.snapshot_seq, result.snapshot_path = seq, path
            loaded = _snapshot(path, seq, self.tag, self.name(path))
            if isinstance(loaded, Problem):
                result.problem = loaded
                return result
            body, result.chain, result.snapshot_bytes = loaded
            self.snapshot_chain, result.last_seq = result.chain, seq
            load(body)
        # Segments wholly covered by the snapshot are skipped; the rest must follow each other.
        start = 0
        for i, (first, _) in enumerate(result.segments):
            if first <= result.last_seq + 1:
                start = i
        result.live = result.segments[start:]
        running: Position | None = None
        for number, (first, path) in enumerate(result.live):
            if self.upto is not None and first > self.upto:
                break  # a segment of frames past ``upto``: never read (module docs)
            running = self.segment(first, path, running, number == len(result.live) - 1)
            if running is None:
                return result
        if result.snapshot_path is not None and not self.continued:
            # J5.2 makes the next segment durable before anything older is deleted (J5.5): a snapshot
            # that no segment continues lost the segment holding the frames after it.
            where = result.live[-1][1] if result.live else result.snapshot_path
            return self.stop(
                "journal.lost_segment",
                where,
                f"snapshot {self.name(result.snapshot_path)} ends at frame {result.snapshot_seq}, but "
                f"no journal segment continues it (the journal stops at frame {result.last_seq}): a "
                "segment was lost; refusing to recover",
            )
        return result

    def segment(self, first: int, path: str, running: Position | None, newest: bool) -> Position | None:
        """Walk one segment; the position at its end, or None once a problem stopped the walk."""
        result = self.result
        data = posix.read_file(path)
        label = self.name(path)
        try:
            header = frame.decode_segment_header(data, frame.SEGMENT_MAGIC)
        except (CorruptData, UnsupportedSchema) as error:
            self.stop("journal.corrupt_frame", path, f"journal {label}: {error}", type(error))
            return None
        if header.tag != self.tag:
            message = f"{label} belongs to another run or queue; refusing to recover from it"
            self.stop("journal.foreign", path, message, UnsafeRecovery)
            return None
        if running is None:
            if first > result.last_seq + 1:
                message = f"journal gap: {label} starts at {first}, the snapshot ends at {result.last_seq}"
                self.stop("journal.gap", path, message)
                return None
            position = Position(first - 1, header.chain_in, frame.SEGMENT_HEADER_BYTES)
        elif first != running.seq + 1 or header.chain_in != running.chain:
            self.stop("journal.gap", path, f"journal segment {label} does not continue the previous segment")
            return None
        else:
            position = Position(running.seq, running.chain, frame.SEGMENT_HEADER_BYTES)
        self.continued = self.continued or first == result.snapshot_seq + 1
        try:
            end = walk(data, position, self.visit, newest=newest)
        except UnsupportedSchema as error:
            self.stop("journal.corrupt_frame", path, f"journal {label}: {error}", UnsupportedSchema)
            return None
        except _Disagrees as error:
            self.stop(
                "journal.foreign",
                path,
                f"journal frame {error.seq} disagrees with the snapshot (foreign journal)",
            )
            return None
        if newest:
            result.end, result.end_path = end, path
        elif end.kind == ZEROS:
            result.uncut.append((path, end.offset))
        if end.kind == CUT:
            self.stop("journal.truncated", path, f"journal {label}: {end.reason}; refusing to recover")
            return None
        if end.kind == CORRUPT or (end.kind == TORN and not newest):
            reason = end.reason if newest else f"{end.reason} (a torn tail before the last segment)"
            self.stop(
                "journal.corrupt_frame", path, f"journal {label}: {reason}; refusing to recover past damage"
            )
            return None
        return position

    def visit(self, found: frame.Frame) -> None:
        result = self.result
        if found.seq > result.last_seq:
            self.apply(found.seq, found.body)
            result.last_seq, result.chain = found.seq, found.chain
        elif found.seq == result.snapshot_seq:
            self.continued = True
            if result.snapshot_path is not None and found.chain != self.snapshot_chain:
                raise _Disagrees(found.seq)


class _Disagrees(Exception):
    """Ends a walk from inside ``visit``: a frame that contradicts the snapshot."""

    def __init__(self, seq: int) -> None:
        super().__init__(seq)
        self.seq = seq


def _size(path: str) -> int:
    try:
        return posix.getsize(path)
    except FileNotFoundError:
        return 0


def _snapshot(path: str, seq: int, tag: bytes, label: str) -> tuple[bytes, bytes, int] | Problem:
    """(body, chain, size) of a snapshot file, or the problem with it (J4.1)."""
    data = posix.read_file(path)
    try:
        header = frame.decode_segment_header(data, frame.SNAPSHOT_MAGIC)
    except (CorruptData, UnsupportedSchema) as error:
        return Problem(
            "journal.snapshot_corrupt",
            label,
            f"snapshot {label} is damaged ({error}); refusing to recover",
            type(error),
        )
    if header.tag != tag:
        return Problem(
            "journal.foreign",
            label,
            f"{label} belongs to another run or queue; refusing to recover from it",
            UnsafeRecovery,
        )
    try:
        verdict = frame.classify(data, frame.SEGMENT_HEADER_BYTES, seq, header.chain_in)
    except UnsupportedSchema as error:
        return Problem("journal.snapshot_corrupt", label, f"snapshot {label}: {error}", UnsupportedSchema)
    if (
        verdict.decision is not frame.Decision.FRAME
        or verdict.frame is None
        or verdict.frame.end != len(data)
    ):
        return Problem(
            "journal.snapshot_corrupt",
            label,
            f"snapshot {label} is damaged ({verdict.reason}); refusing to recover",
            CorruptData,
        )
    return verdict.frame.body, header.chain_in, len(data)
