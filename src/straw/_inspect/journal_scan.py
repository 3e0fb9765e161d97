"""Read a queue's journal without changing it (docs/DURABILITY.md J4, J7).

The walk is recovery's own (``straw._journal.scan.walk_journal``): the same
decision table, the same rules for gaps, lost segments and files cut short,
through the same ``straw._fs`` seam. Where recovery raises, this records a
finding; where recovery zeroes a torn tail, this records where it is. It is
safe beside a live coordinator: the zeros written ahead of its appends (J1.1)
end the walk like a clean end, and a frame being written at that moment shows
up as an unsettled tail that ``straw check`` reads again before it reports.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from .._fs import posix
from .._journal import scan


@dataclass
class Tail:
    """Where the last segment stops being a sequence of valid frames."""

    path: str  # pool-relative
    offset: int
    kind: str  # zeros | torn | corrupt | cut
    reason: str
    after: int = 0  # bytes from offset to the end of the file


@dataclass
class JournalScan:
    """Snapshot body, the frames after it, and findings (code, severity, path, message)."""

    snapshot: bytes | None = None
    snapshot_seq: int = 0
    frames: list[tuple[int, bytes]] = field(default_factory=list)
    last_seq: int = 0
    bytes: int = 0
    segments: int = 0
    complete: bool = True
    empty: bool = True  # no snapshot and no segment at all
    tail: Tail | None = None
    problems: list[tuple[str, str, str, str]] = field(default_factory=list)


def scan_journal(root: str, queue: str, tag: bytes) -> JournalScan:
    """Scan ``<root>/<queue>/`` (pool-relative ``queue``) against the identity ``tag``.

    Raises ``OSError`` (``FileNotFoundError`` when a live coordinator replaced a file
    while it was read: the caller reads again).
    """
    out = JournalScan()

    def load(body: bytes) -> None:
        out.snapshot = body

    walked = scan.walk_journal(
        os.path.join(root, queue), tag, lambda seq, body: out.frames.append((seq, body)), load, base=root
    )
    out.snapshot_seq = walked.snapshot_seq
    out.last_seq = walked.last_seq
    out.bytes = walked.bytes
    out.segments = len(walked.segments)
    out.empty = walked.empty
    end, path = walked.end, walked.end_path
    if end is not None and path is not None and end.kind != scan.END:
        size = posix.getsize(path)
        out.tail = Tail(os.path.relpath(path, root), end.offset, end.kind, end.reason, size - end.offset)
    problem = walked.problem
    if problem is not None:
        out.complete = False
        message = problem.message
        if problem.code == "journal.corrupt_frame":
            message += "; recovery refuses to go past it and check --fix does not touch it"
        out.problems.append((problem.code, "error", problem.path, message))
    return out
