"""Read a queue's journal without changing it (docs/DURABILITY.md J4, decision table).

``straw._journal.log.Journal.replay`` recovers a queue and cuts its torn tail;
this module walks the same files and the same decision table (``classify``) but
only records what it finds, so it is safe beside a live coordinator: the
coordinator's zero-filled space (J1.1) ends the scan like a clean end, and a
frame being written at that moment shows up as an unsettled tail that is
re-read once before anything is reported.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from .._journal import frame
from .._journal.log import SNAP_DIR, WAL_DIR
from ..errors import CorruptData, UnsupportedSchema

_DIGITS = 20


@dataclass
class Tail:
    """Where the last segment stops being a sequence of valid frames."""

    path: str  # pool-relative
    offset: int
    kind: str  # zeros | torn | corrupt
    reason: str


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
    tail: Tail | None = None
    problems: list[tuple[str, str, str, str]] = field(default_factory=list)


def _listing(directory: str, suffix: str) -> list[tuple[int, str]]:
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        if name.endswith(suffix) and len(name) == _DIGITS + len(suffix) and name[:_DIGITS].isdigit():
            out.append((int(name[:_DIGITS]), name))
    return sorted(out)


def _read(path: str) -> bytes:
    with open(path, "rb") as handle:
        return handle.read()


def scan_journal(root: str, queue: str, tag: bytes) -> JournalScan:
    """Scan ``<root>/<queue>/`` (pool-relative ``queue``) against the identity ``tag``."""
    scan = JournalScan()
    directory = os.path.join(root, queue)
    snaps = _listing(os.path.join(directory, SNAP_DIR), ".snap")
    for _, name in snaps:
        scan.bytes += _size(os.path.join(directory, SNAP_DIR, name))
    chain = frame.genesis_chain(tag)
    if snaps:
        seq, name = snaps[-1]
        loaded = _snapshot(scan, root, f"{queue}/{SNAP_DIR}/{name}", seq, tag)
        if loaded is None:
            scan.complete = False
            return scan
        chain = loaded
        scan.snapshot_seq = scan.last_seq = seq
    segments = _listing(os.path.join(directory, WAL_DIR), ".wal")
    scan.segments = len(segments)
    start = 0
    for i, (first, _) in enumerate(segments):
        scan.bytes += _size(os.path.join(directory, WAL_DIR, segments[i][1]))
        if first <= scan.last_seq + 1:
            start = i
    live = segments[start:]
    running: tuple[int, bytes] | None = None
    for number, (first, name) in enumerate(live):
        relative = f"{queue}/{WAL_DIR}/{name}"
        running = _segment(scan, root, relative, first, running, tag, number == len(live) - 1, chain)
        if running is None:
            scan.complete = False
            return scan
    return scan


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except FileNotFoundError:
        return 0


def _snapshot(scan: JournalScan, root: str, relative: str, seq: int, tag: bytes) -> bytes | None:
    try:
        data = _read(os.path.join(root, relative))
        header = frame.decode_segment_header(data, frame.SNAPSHOT_MAGIC)
        if header.tag != tag:
            scan.problems.append(
                ("journal.foreign", "error", relative, f"{relative} belongs to another run or queue")
            )
            return None
        verdict = frame.classify(data, frame.SEGMENT_HEADER_BYTES, seq, header.chain_in)
        if verdict.frame is None or verdict.frame.end != len(data):
            raise CorruptData(verdict.reason)
    except (CorruptData, UnsupportedSchema) as error:
        scan.problems.append(
            ("journal.snapshot_corrupt", "error", relative, f"{relative} is damaged ({error})")
        )
        return None
    scan.snapshot = verdict.frame.body
    return header.chain_in


def _segment(
    scan: JournalScan,
    root: str,
    relative: str,
    first: int,
    running: tuple[int, bytes] | None,
    tag: bytes,
    last: bool,
    snapshot_chain: bytes,
) -> tuple[int, bytes] | None:
    """Walk one segment; returns (seq, chain) at its end, or None when the scan must stop."""
    path = os.path.join(root, relative)
    data = _read(path)
    try:
        header = frame.decode_segment_header(data, frame.SEGMENT_MAGIC)
    except (CorruptData, UnsupportedSchema) as error:
        scan.problems.append(("journal.corrupt_frame", "error", relative, f"{relative}: {error}"))
        return None
    if header.tag != tag:
        scan.problems.append(
            ("journal.foreign", "error", relative, f"{relative} belongs to another run or queue")
        )
        return None
    if running is None:
        if first > scan.last_seq + 1:
            scan.problems.append(
                (
                    "journal.gap",
                    "error",
                    relative,
                    f"{relative} starts at {first}, the snapshot ends at {scan.last_seq}",
                )
            )
            return None
        seq, chain = first - 1, header.chain_in
    else:
        seq, chain = running
        if first != seq + 1 or header.chain_in != chain:
            scan.problems.append(
                ("journal.gap", "error", relative, f"{relative} does not continue the previous segment")
            )
            return None
    at = frame.SEGMENT_HEADER_BYTES
    while True:
        verdict = frame.classify(data, at, seq + 1, chain)
        found = verdict.frame
        if verdict.decision is frame.Decision.FRAME and found is not None:
            if found.seq > scan.last_seq:
                scan.frames.append((found.seq, found.body))
                scan.last_seq = found.seq
            elif (
                found.seq == scan.snapshot_seq and scan.snapshot is not None and found.chain != snapshot_chain
            ):
                scan.problems.append(
                    ("journal.foreign", "error", relative, f"frame {found.seq} disagrees with the snapshot")
                )
                return None
            seq, chain, at = found.seq, found.chain, found.end
            continue
        if verdict.decision is frame.Decision.END:
            return seq, chain
        return _bad_position(scan, data, relative, at, verdict, last, seq, chain)


def _bad_position(
    scan: JournalScan,
    data: bytes,
    relative: str,
    at: int,
    verdict: frame.Verdict,
    last: bool,
    seq: int,
    chain: bytes,
) -> tuple[int, bytes] | None:
    """A position that is not a valid frame: a zero tail, a torn tail, or damage."""
    zeros = not data[at:].strip(b"\0")
    if zeros:
        # J1.1 space written ahead: a live coordinator's, or one a recovery will cut.
        if last:
            scan.tail = Tail(relative, at, "zeros", verdict.reason)
        return seq, chain
    if last and verdict.decision is frame.Decision.TORN:
        scan.tail = Tail(relative, at, "torn", verdict.reason)
        return seq, chain
    if last:
        scan.tail = Tail(relative, at, "corrupt", verdict.reason)
    scan.problems.append(
        (
            "journal.corrupt_frame",
            "error",
            relative,
            f"{relative}: {verdict.reason} at offset {at}; recovery refuses to go past it "
            "and check --fix does not touch it",
        )
    )
    return None
