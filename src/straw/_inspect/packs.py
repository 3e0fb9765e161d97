"""Scan one pack frame by frame, verifying every checksum (docs/FORMAT.md section 2).

The scan never trusts an index to find frames: it walks the frames from the
header on, hashes every body, then checks that each index entry names a record
frame it saw. What it finds after the last complete extent is classified the
way docs/CHECK.md explains: zeros written ahead (D1.2a), an unfinished append
(torn tail: nothing can reference it), or damage.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import xxhash

from .._fs import posix
from .._journal import frame as journal_frame
from .._pack import frame
from ..errors import CorruptData, UnsupportedSchema
from ..limits import INDEX_BYTES_MAX
from ..protocol import decode

READ_BYTES = 8 * 1024 * 1024
DAMAGED = "damaged"


@dataclass
class Extent:
    """One complete extent: record frames followed by their index frame."""

    start: int  # first byte of the extent's first frame
    index_offset: int  # the SegmentRef offset
    index_size: int
    records: int
    payload_bytes: int
    manifests: list[int]


@dataclass
class PackScan:
    """What a scan of one pack found. ``problems`` are (code, severity, message)."""

    path: str
    size: int
    header: frame.PackHeader | None = None
    sealed: bool = False
    extents: list[Extent] = field(default_factory=list)
    valid_end: int = 0  # end of the last complete extent (or of the seal)
    tail: str = "none"  # none | zeros | torn | damaged
    tail_bytes: int = 0
    problems: list[tuple[str, str, str]] = field(default_factory=list)

    def add(self, code: str, severity: str, message: str) -> None:
        self.problems.append((code, severity, message))


class _File:
    """Positional reads of one open file."""

    def __init__(self, fd: int, size: int) -> None:
        self.fd, self.size = fd, size

    def read(self, size: int, offset: int) -> bytes:
        return bytes(posix.pread_exact(self.fd, size, offset))

    def digest(self, start: int, length: int) -> str:
        hasher = xxhash.xxh3_128()
        position, end = start, start + length
        while position < end:
            chunk = posix.pread_exact(self.fd, min(READ_BYTES, end - position), position)
            if not chunk:
                break
            hasher.update(chunk)
            position += len(chunk)
        return hasher.hexdigest()

    def zeros(self, start: int) -> bool:
        """True when every byte from ``start`` to the end of the file is zero."""
        position = start
        while position < self.size:
            chunk = bytes(posix.pread_exact(self.fd, min(READ_BYTES, self.size - position), position))
            if not chunk or not journal_frame.all_zero(chunk):
                return not chunk
            position += len(chunk)
        return True

    def last_byte_zero(self, end: int) -> bool:
        return end > 0 and self.read(1, end - 1) == b"\0"


def scan_pack(path: str, relative: str) -> PackScan:
    """Scan a pack; raises ``OSError`` only when the file cannot be opened or read."""
    fd = posix.open_read(path)
    try:
        size = posix.fstat_size(fd)
        scan = PackScan(relative, size)
        _scan(_File(fd, size), scan)
        return scan
    finally:
        posix.close_quietly(fd)


def _scan(file: _File, scan: PackScan) -> None:
    try:
        scan.header = frame.decode_pack_header(file.read(frame.PACK_HEADER_BYTES, 0))
    except (CorruptData, UnsupportedSchema) as error:
        what = "is empty" if file.size == 0 else f"has no valid pack header ({error})"
        scan.add("pack.header", "error", f"{scan.path} {what}; its data cannot be read")
        return
    records: dict[int, tuple[int, str]] = {}  # body offset -> (length, content hash)
    damaged: list[tuple[int, int, bool]] = []  # (offset, kind, looks torn)
    position = extent_start = scan.valid_end = frame.PACK_HEADER_BYTES
    while position < file.size:
        if scan.sealed:
            _after_seal(file, scan, position)
            return
        head = file.read(frame.FRAME_HEADER_BYTES, position)
        try:
            header = frame.decode_frame_header(head) if len(head) == frame.FRAME_HEADER_BYTES else None
        except (CorruptData, UnsupportedSchema):
            header = None
        if header is None:
            shape = "torn" if file.zeros(position + min(len(head), frame.FRAME_HEADER_BYTES)) else "damaged"
            if file.zeros(position):
                shape = "zeros"
            _stop(file, scan, position, shape, "an unreadable frame header", damaged)
            return
        body, end = (
            position + frame.FRAME_HEADER_BYTES,
            position + frame.FRAME_HEADER_BYTES + header.body_bytes,
        )
        if end > file.size:
            _stop(file, scan, position, "torn", "a frame that runs past the end of the file", damaged)
            return
        if file.digest(body, header.body_bytes) != header.body_checksum:
            torn = file.last_byte_zero(end) and file.zeros(end)
            damaged.append((position, header.kind, torn))
            if header.kind == frame.KIND_RECORD:
                records[body] = (header.body_bytes, DAMAGED)  # reported once, as pack.checksum
        elif header.kind == frame.KIND_RECORD:
            records[body] = (header.body_bytes, header.body_checksum)
        elif header.kind == frame.KIND_INDEX:
            extent = _index(file, scan, position, header, records, extent_start)
            if extent is not None:
                scan.extents.append(extent)
                scan.valid_end = extent_start = end
        else:
            scan.sealed = _seal(file, scan, position, header)
            if scan.sealed:
                scan.valid_end = end
        position = end
    _stop(file, scan, file.size, "none", "", damaged)


def _index(
    file: _File,
    scan: PackScan,
    position: int,
    header: frame.FrameHeader,
    records: dict[int, tuple[int, str]],
    start: int,
) -> Extent | None:
    """Parse a checksummed index frame and check that its entries name record frames of the pack."""
    if header.body_bytes > INDEX_BYTES_MAX:
        scan.add("pack.index", "error", f"{scan.path}: index at {position} is larger than the format allows")
        return None
    body = file.read(header.body_bytes, position + frame.FRAME_HEADER_BYTES)
    try:
        index = frame.parse_index(decode(body), len(body))
    except (CorruptData, UnsupportedSchema, ValueError) as error:
        scan.add("pack.index", "error", f"{scan.path}: index at offset {position} is malformed ({error})")
        return None
    payload = 0
    manifests = []
    for ordinal, entry in enumerate(index.entries):
        if entry.inline is not None:
            manifests.append(ordinal)
            continue
        found = records.get(entry.offset)
        if entry.length and found != (entry.length, entry.content) and (found or (0, ""))[1] != DAMAGED:
            scan.add(
                "pack.index",
                "error",
                f"{scan.path}: record {entry.record_id!r} of the index at offset {position} names "
                f"bytes {entry.offset}..{entry.offset + entry.length} that are not a matching record frame",
            )
        payload += entry.length
    size = frame.FRAME_HEADER_BYTES + header.body_bytes
    return Extent(start, position, size, len(index.entries), payload, manifests)


def _seal(file: _File, scan: PackScan, position: int, header: frame.FrameHeader) -> bool:
    try:
        extents, end = frame.parse_seal(
            decode(file.read(header.body_bytes, position + frame.FRAME_HEADER_BYTES))
        )
    except (CorruptData, UnsupportedSchema, ValueError) as error:
        scan.add("pack.seal", "error", f"{scan.path}: seal frame at offset {position} is malformed ({error})")
        return False
    if extents != len(scan.extents) or end != position:
        scan.add(
            "pack.seal",
            "error",
            f"{scan.path}: seal says {extents} extents ending at {end}, the scan found "
            f"{len(scan.extents)} ending at {position}",
        )
    return True


def _after_seal(file: _File, scan: PackScan, position: int) -> None:
    scan.tail_bytes = file.size - position
    if file.zeros(position):
        scan.tail = "zeros"
        scan.add("pack.zero_tail", "info", f"{scan.path}: {scan.tail_bytes} zero bytes after its seal")
        return
    scan.tail = "damaged"
    scan.add(
        "pack.after_seal", "error", f"{scan.path}: {scan.tail_bytes} bytes after the seal frame at {position}"
    )


def _cut_seal(file: _File, position: int) -> bool:
    """The bytes at ``position`` open a seal frame (magic and kind) that the file cuts short."""
    prefix = frame.FRAME_MAGIC + bytes([frame.KIND_SEAL])
    size = file.size - position
    if size < len(prefix) or file.read(len(prefix), position) != prefix:
        return False
    if size < frame.FRAME_HEADER_BYTES:
        return True
    try:
        header = frame.decode_frame_header(file.read(frame.FRAME_HEADER_BYTES, position))
    except (CorruptData, UnsupportedSchema):
        return False  # not a seal's header after all: damage or a torn append, judged as before
    return frame.FRAME_HEADER_BYTES + header.body_bytes > size


def _stop(
    file: _File, scan: PackScan, position: int, shape: str, what: str, damaged: list[tuple[int, int, bool]]
) -> None:
    """Classify damaged frames and whatever follows the last complete extent."""
    committed = [d for d in damaged if d[0] < scan.valid_end]
    loose = [d for d in damaged if d[0] >= scan.valid_end]
    for offset, kind, _ in committed:
        name = {frame.KIND_RECORD: "record", frame.KIND_INDEX: "index"}.get(kind, "seal")
        scan.add(
            "pack.checksum",
            "error",
            f"{scan.path}: the {name} frame at offset {offset} does not match its checksum "
            "(a complete extent is damaged)",
        )
    # A damaged index after the last extent whose body does not end in the zeros of an
    # unfinished write is damage, not a torn append (docs/CHECK.md "Packs").
    hard = [d for d in loose if d[1] != frame.KIND_RECORD and not d[2]]
    for offset, _, _ in hard:
        scan.add("pack.checksum", "error", f"{scan.path}: the index frame at offset {offset} is damaged")
    if shape == "damaged" and not hard:
        scan.add(
            "pack.corrupt_frame",
            "error",
            f"{scan.path}: {what} at offset {position} followed by non-zero bytes "
            "(damage, not an unfinished append)",
        )
    tail_start = scan.valid_end
    scan.tail_bytes = file.size - tail_start
    if _cut_seal(file, tail_start):
        # docs/CHECK.md "Packs": a seal is the writer's last, single small write; a file that
        # ends inside one was shortened after it was sealed, so the pack is not what was written.
        scan.tail = "damaged"
        scan.add(
            "pack.short_seal",
            "error",
            f"{scan.path}: the file ends {scan.tail_bytes} bytes into the seal frame at offset {tail_start} "
            "(the sealed pack was cut short after it was written)",
        )
        return
    if scan.tail_bytes == 0 or hard or shape == "damaged":
        scan.tail = "damaged" if (hard or shape == "damaged") else "none"
        return
    if file.zeros(tail_start):
        scan.tail = "zeros"
        scan.add(
            "pack.zero_tail",
            "info",
            f"{scan.path}: {scan.tail_bytes} zero bytes written ahead after its last extent (D1.2a)",
        )
        return
    scan.tail = "torn"
    scan.add(
        "pack.torn_tail",
        "info",
        f"{scan.path}: {scan.tail_bytes} bytes after the last complete extent (offset {tail_start}) are "
        "an unfinished append; nothing can reference them",
    )
