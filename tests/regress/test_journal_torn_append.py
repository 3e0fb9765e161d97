"""Regression: a torn journal append over the zero-filled space ahead (J1.1) must read as TORN.

Found by the seeded simulation (tests/sim): a power loss tears the last, unacknowledged
append; only a prefix of its bytes reaches the disk. Because J1.1 keeps synced zeros after
the last frame, the file does not end where the write stopped: the frame header (or the
body) is followed by zeros, so ``classify`` reports "damaged frame header" or "body checksum
mismatch" (CORRUPT) instead of TORN, and ``Coordinator(recover=True)`` refuses the queue
with ``CorruptData``. DURABILITY.md promises the opposite (fault phase
``after_journal_append``: "after recovery the frame is present or absent, never partial").
Fixed by the durability witness (DURABILITY.md, journal recovery decision table): damage that
no later frame proves durable is a torn write and is removed (zeroed since J7, so the segment
keeps ending in zeros).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from straw._fs import posix
from straw._journal import frame
from straw._journal.log import WAL_DIR, Journal
from straw.backend import FilesystemBackend


def _journal(root: Path) -> Journal:
    journal = Journal(FilesystemBackend(root), str(root / "queue"), frame.identity_tag("run", "q"))
    journal.create_dirs(str(root))
    return journal


@pytest.mark.parametrize("kept", [frame.FRAME_HEADER_BYTES // 2, frame.FRAME_HEADER_BYTES + 10])
def test_i11_torn_last_append_is_removed_not_refused(tmp_path: Path, kept: int) -> None:
    journal = _journal(tmp_path)
    journal.start_segment()
    journal.wait(journal.append(b"first"))
    start = journal._offset
    journal.wait(journal.append(b"second" * 50))
    end = journal._offset
    posix.close_quietly(journal._fd)  # a crash: no clean close, the zeros ahead stay
    # The power loss kept only the first `kept` bytes of the second append.
    segment = next((tmp_path / "queue" / WAL_DIR).iterdir())
    data = bytearray(segment.read_bytes())
    data[start + kept : end] = bytes(end - start - kept)
    segment.write_bytes(data)

    applied: list[bytes] = []
    recovered = _journal(tmp_path).replay(lambda seq, body: applied.append(body), lambda body: None)
    assert applied == [b"first"]
    assert recovered.truncated is not None
    after = segment.read_bytes()
    assert len(after) == len(data) and not after[start:].strip(b"\0")
