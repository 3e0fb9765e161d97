"""The filesystem seam: every primitive straw asks of the operating system, in one protocol.

Production code always runs on :class:`OsSystem` (``os`` and ``fcntl``). The seeded
simulation (``straw.testing.faultfs``) installs an in-memory, fault-injecting system
with :func:`installed` for the length of a test; nothing else ever swaps it.

Callers reach the active system as ``system.current.<primitive>(...)``: one module
attribute lookup per call, and ``OsSystem``'s primitives are the ``os`` functions
themselves, so the hot path pays no extra Python frame.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator, Sequence
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
    def fsync(self, fd: int, /) -> None: ...
    def ftruncate(self, fd: int, size: int, /) -> None: ...
    def fstat_size(self, fd: int, /) -> int: ...
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


def _realpath(path: str) -> str:
    return os.path.realpath(path)


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
    ftruncate = staticmethod(os.ftruncate)
    fstat_size = staticmethod(_fstat_size)
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
