"""Vectored positional writes: every byte lands in order, however the buffers are cut, and a
large write hands each slice to the kernel's writeback as it lands (limits.WRITEBACK_SLICE_BYTES)."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from straw._fs import posix, system
from straw.limits import WRITEBACK_SLICE_BYTES
from straw.testing.faultfs import FaultFS


@contextmanager
def recording_writeback() -> Iterator[list[tuple[int, int]]]:
    """The real filesystem, noting each writeback hint (offset, size) before passing it on."""
    started: list[tuple[int, int]] = []

    class Recording(system.OsSystem):
        @staticmethod
        def start_writeback(fd: int, offset: int, size: int) -> None:
            started.append((offset, size))
            system.OsSystem.start_writeback(fd, offset, size)

    with system.installed(Recording()):
        yield started


def write_file(path: Path, buffers: Sequence[bytes | bytearray | memoryview], offset: int = 0) -> int:
    fd = posix.create_exclusive(str(path))
    try:
        return posix.pwrite_all(fd, buffers, offset)
    finally:
        posix.close_quietly(fd)


def test_a_large_write_lands_whole_and_starts_writeback_slice_by_slice(tmp_path: Path) -> None:
    head = b"h" * 1000
    body = bytearray(os.urandom(1 << 16)) * (WRITEBACK_SLICE_BYTES * 2 // (1 << 16))
    tail = memoryview(b"t" * 12345)
    with recording_writeback() as started:
        written = write_file(tmp_path / "big", [head, body, tail], offset=7)
    expected = head + bytes(body) + bytes(tail)
    assert written == len(expected)
    assert (tmp_path / "big").read_bytes() == b"\0" * 7 + expected
    # The slices cover the write exactly, in order, each at most one slice long.
    assert started[0][0] == 7
    assert all(a + n == b for (a, n), (b, _) in itertools.pairwise(started))
    assert started[-1][0] + started[-1][1] == 7 + len(expected)
    assert all(0 < n <= WRITEBACK_SLICE_BYTES for _, n in started)
    assert len(started) == -(-len(expected) // WRITEBACK_SLICE_BYTES)


def test_a_small_write_is_one_call_and_no_hint(tmp_path: Path) -> None:
    with recording_writeback() as started:
        assert write_file(tmp_path / "small", [b"a" * 100, b"", b"b" * 50]) == 150
    assert (tmp_path / "small").read_bytes() == b"a" * 100 + b"b" * 50
    assert started == []


def test_a_refused_hint_changes_nothing_but_speed(tmp_path: Path) -> None:
    class Refusing(system.OsSystem):
        @staticmethod
        def start_writeback(fd: int, offset: int, size: int) -> None:
            raise OSError(38, "Function not implemented")

    data = os.urandom(WRITEBACK_SLICE_BYTES + 3)
    with system.installed(Refusing()):
        assert write_file(tmp_path / "refused", [data]) == len(data)
    assert (tmp_path / "refused").read_bytes() == data


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 300), min_size=1, max_size=12),
    slice_bytes=st.integers(1, 64),
    seed=st.integers(0, 2**16),
)
def test_any_cut_of_buffers_and_short_writes_resume_in_order(
    sizes: list[int], slice_bytes: int, seed: int
) -> None:
    # A tiny slice makes every cut reachable; the simulated filesystem makes short writes legal.
    buffers = [bytes((i * 31 + j) % 251 for j in range(n)) for i, n in enumerate(sizes)]
    fs = FaultFS(seed, short_write_probability=0.3)
    with pytest.MonkeyPatch.context() as patch, system.installed(fs):
        patch.setattr(posix, "WRITEBACK_SLICE_BYTES", slice_bytes)
        fs.mkdir("/d")
        fd = posix.create_exclusive("/d/f")
        written = posix.pwrite_all(fd, buffers, 5)
        posix.close_quietly(fd)
        assert written == sum(sizes)
        data = b"".join(buffers)
        assert posix.read_file("/d/f") == (b"\0" * 5 + data if data else b"")  # nothing written, no hole
