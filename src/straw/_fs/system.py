"""The filesystem seam: every primitive straw asks of the operating system, in one protocol.

Production code always runs on :class:`OsSystem` (``os`` and ``fcntl``). The seeded
simulation (``straw.testing.faultfs``) installs an in-memory, fault-injecting system
with :func:`installed` for the length of a test; nothing else ever swaps it.

Callers reach the active system as ``system.current.<primitive>(...)``: one module
attribute lookup per call, and ``OsSystem``'s primitives are the ``os`` functions
themselves, so the hot path pays no extra Python frame.
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Protocol

Buffer = bytes | bytearray | memoryview


class System(Protocol):
    """The file-system primitives straw uses (POSIX semantics, errors as ``OSError``)."""

    def open(self, path: str, flags: int, mode: int = 0o777, /) -> int: ...
    def close(self, fd: int, /) -> None: ...
    def pwritev(self, fd: int, buffers: Sequence[Buffer], offset: int, /) -> int: ...
    def pread(self, fd: int, size: int, offset: int, /) -> bytes: ...
    def preadv(self, fd: int, buffers: Sequence[memoryview], offset: int, /) -> int: ...
    def fdatasync(self, fd: int, /) -> None: ...
    def start_writeback(self, fd: int, offset: int, size: int, /) -> None: ...
    def fsync(self, fd: int, /) -> None: ...
    def ftruncate(self, fd: int, size: int, /) -> None: ...
    def fstat_size(self, fd: int, /) -> int: ...
    def fstat_links(self, fd: int, /) -> int: ...
    def map_private(self, fd: int, offset: int, size: int, /) -> memoryview: ...
    def flock(self, fd: int, operation: int, /) -> None: ...
    def rename(self, source: str, target: str, /) -> None: ...
    def link(self, source: str, target: str, /) -> None: ...
    def unlink(self, path: str, /) -> None: ...
    def mkdir(self, path: str, mode: int = 0o777, /) -> None: ...
    def rmdir(self, path: str, /) -> None: ...
    def listdir(self, path: str, /) -> list[str]: ...
    def exists(self, path: str, /) -> bool: ...
    def isdir(self, path: str, /) -> bool: ...
    def getsize(self, path: str, /) -> int: ...
    def islink(self, path: str, /) -> bool: ...
    def realpath(self, path: str, /) -> str: ...


def _fstat_size(fd: int) -> int:
    return os.fstat(fd).st_size


def _fstat_links(fd: int) -> int:
    return os.fstat(fd).st_nlink


def _realpath(path: str) -> str:
    return os.path.realpath(path)


def _writeback_call() -> Callable[[int, int, int, int], int] | None:
    """Linux's ``sync_file_range`` from the C library (Python's ``os`` does not offer it)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


def _map_private(fd: int, offset: int, size: int) -> memoryview:
    """Bytes ``offset:offset + size`` of a file as private copy-on-write pages: reading them
    shares the page cache, writing one copies that page for this process only."""
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    mapping = mmap.mmap(
        fd, size + offset - start, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=start
    )
    return memoryview(mapping)[offset - start :]


_SYNC_FILE_RANGE = _writeback_call()
_SYNC_FILE_RANGE_WRITE = 2  # start writeback of the range's dirty pages; wait for nothing


def _start_writeback(fd: int, offset: int, size: int) -> None:
    """Ask the kernel to begin writing a range out now (a hint: durability is still only what
    ``fdatasync`` gives, and a refusal or a missing call changes nothing but speed)."""
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, offset, size, _SYNC_FILE_RANGE_WRITE)  # (ctypes releases the GIL)


class OsSystem:
    """The real filesystem: each primitive is the ``os`` (or ``fcntl``) function itself."""

    open = staticmethod(os.open)
    close = staticmethod(os.close)
    pwritev = staticmethod(os.pwritev)
    pread = staticmethod(os.pread)
    preadv = staticmethod(os.preadv)
    # macOS has no fdatasync; fsync is the (stronger) substitute there.
    fdatasync = staticmethod(getattr(os, "fdatasync", os.fsync))
    fsync = staticmethod(os.fsync)
    start_writeback = staticmethod(_start_writeback)
    ftruncate = staticmethod(os.ftruncate)
    fstat_size = staticmethod(_fstat_size)
    fstat_links = staticmethod(_fstat_links)
    map_private = staticmethod(_map_private)
    flock = staticmethod(fcntl.flock)
    rename = staticmethod(os.rename)
    link = staticmethod(os.link)
    unlink = staticmethod(os.unlink)
    mkdir = staticmethod(os.mkdir)
    rmdir = staticmethod(os.rmdir)
    listdir = staticmethod(os.listdir)
    exists = staticmethod(os.path.exists)
    isdir = staticmethod(os.path.isdir)
    getsize = staticmethod(os.path.getsize)
    islink = staticmethod(os.path.islink)
    realpath = staticmethod(_realpath)


#: The active filesystem. Only :func:`installed` changes it.
current: System = OsSystem()


@contextmanager
def installed(replacement: System) -> Iterator[System]:
    """Run the block with ``replacement`` as the filesystem of every straw call (simulation only).

    Not thread-safe and not meant for production: the simulator installs one system
    around a whole single-threaded scenario and restores the previous one afterwards.
    """
    global current
    previous = current
    current = replacement
    try:
        yield replacement
    finally:
        current = previous
