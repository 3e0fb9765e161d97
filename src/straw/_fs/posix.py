"""Thin POSIX primitives: vectored positional writes, exact reads, syncs, renames.

Nothing here knows about packs or queues. Callers add the fault hook and the
sync counters (``straw.backend``) and decide ordering (docs/DURABILITY.md).
"""

from __future__ import annotations

import contextlib
import errno
import os
import resource
import time
from collections import deque
from collections.abc import Callable, Sequence

from ..errors import QuotaExceeded, StorageUnavailable, invariant
from ..limits import IOVEC_COUNT_MAX, SYSCALL_BYTES_MAX, WRITEBACK_SLICE_BYTES
from . import system as _system

Buffer = bytes | bytearray | memoryview

_QUOTA_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
_DESCRIPTOR_ERRNOS = {errno.EMFILE, errno.ENFILE}
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)


def storage_error(error: OSError, what: str) -> StorageUnavailable:
    """Translate an OS error into straw's tree, keeping the OS text."""
    cls = QuotaExceeded if error.errno in _QUOTA_ERRNOS else StorageUnavailable
    if cls is QuotaExceeded:
        hint = "free space or raise the quota, then retry"
    elif error.errno in _DESCRIPTOR_ERRNOS:
        hint = (
            "this process or system has too many files open: raise the limit (ulimit -n), or close "
            "the stores, read sessions and straw.tensor pools (detach) it no longer uses"
        )
    else:
        hint = "check the mount, then retry"
    reason = error.strerror or str(error)
    result = cls(f"{what} failed: [Errno {error.errno}] {reason} ({hint})")
    result.__cause__ = error
    return result


def open_read(path: str) -> int:
    return _system.current.open(path, os.O_RDONLY | _O_CLOEXEC)


def create_exclusive(path: str) -> int:
    """Create a new file for writing; fails if it exists."""
    return _system.current.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_CLOEXEC, 0o644)


def open_append(path: str) -> int:
    return _system.current.open(path, os.O_WRONLY | _O_CLOEXEC)


def open_update(path: str) -> int:
    """Open an existing file to read and write (a log read, then appended to, under its lock)."""
    return _system.current.open(path, os.O_RDWR | _O_CLOEXEC)


def close_quietly(fd: int) -> None:
    with contextlib.suppress(OSError):
        _system.current.close(fd)


def pwrite_all(fd: int, buffers: Sequence[Buffer], offset: int) -> int:
    """Write every buffer at ``offset`` from the caller's memory (no concatenation).

    Groups at most IOVEC_COUNT_MAX buffers and SYSCALL_BYTES_MAX bytes per
    system call and resumes after short writes. A write over WRITEBACK_SLICE_BYTES
    goes down in slices that start their writeback as they land. Returns the bytes written.
    """
    # The common case, a few buffers in one system call, without the general loop's bookkeeping.
    views: list[Buffer] = []
    size = 0
    for buffer in buffers:
        if type(buffer) is bytes:
            views.append(buffer)
            size += len(buffer)
        else:
            view = _flat(buffer)
            views.append(view)
            size += view.nbytes
    if size > WRITEBACK_SLICE_BYTES:
        return _pwrite_loop(fd, [memoryview(v) for v in views], offset, WRITEBACK_SLICE_BYTES, writeback=True)
    if len(views) <= IOVEC_COUNT_MAX:
        written = _system.current.pwritev(fd, views, offset) if size else 0
        if written == size:
            return size
        # A short write: rewrite from the start (same bytes, same offsets) with the general loop.
    return _pwrite_loop(fd, [memoryview(v) for v in views], offset, SYSCALL_BYTES_MAX)


def _pwrite_loop(fd: int, views: list[memoryview], offset: int, cap: int, *, writeback: bool = False) -> int:
    """The general case: any number and size of buffers, at most ``cap`` bytes per call,
    resuming after short writes. With ``writeback`` each call's bytes are handed to the kernel's
    writeback as they land."""
    pending = deque(views)
    position = offset
    system = _system.current
    while pending:
        group: list[memoryview] = []
        size = 0
        for view in pending:
            if len(group) == IOVEC_COUNT_MAX or size + view.nbytes > cap:
                if len(group) < IOVEC_COUNT_MAX and size < cap:
                    group.append(view[: cap - size])
                    size = cap
                break
            group.append(view)
            size += view.nbytes
        written = system.pwritev(fd, group, position) if size else 0
        invariant(written > 0 or size == 0, "pwritev made progress")
        if writeback and written:  # docs/DURABILITY.md D1.2b: speed only
            with contextlib.suppress(OSError):
                system.start_writeback(fd, position, written)
        position += written
        while pending and (written or pending[0].nbytes == 0):
            head = pending[0]
            if head.nbytes <= written:
                written -= head.nbytes
                pending.popleft()
            else:
                pending[0] = head[written:]
                written = 0
    return position - offset


def _flat(buffer: Buffer) -> memoryview:
    view = memoryview(buffer)
    if view.ndim == 1 and view.itemsize == 1 and view.format in ("B", "b", "c"):
        return view
    return view.cast("B")


def pread_exact(fd: int, size: int, offset: int) -> bytes | bytearray:
    """Read ``size`` bytes at ``offset``; a shorter result means end of file."""
    if size <= SYSCALL_BYTES_MAX:
        data = _system.current.pread(fd, size, offset)
        if len(data) == size or not data:
            return data
        got = len(data)
        buffer = bytearray(size)
        buffer[:got] = data
    else:
        buffer = bytearray(size)
        got = 0
    got += preadinto(fd, memoryview(buffer)[got:], offset + got)
    return buffer if got == size else buffer[:got]


def preadinto(fd: int, target: memoryview, offset: int) -> int:
    """Fill ``target`` from ``offset``; returns the bytes read (short only at end of file)."""
    got = 0
    total = target.nbytes
    while got < total:
        step = min(total - got, SYSCALL_BYTES_MAX)
        n = _system.current.preadv(fd, [target[got : got + step]], offset + got)
        if n == 0:
            break
        got += n
    return got


def sync_file(fd: int) -> None:
    """Flush a file's data and the metadata needed to read it back (size)."""
    _system.current.fdatasync(fd)


def fsync(fd: int) -> None:
    """Flush a file's data and all of its metadata (``sync_tree`` of checkpoint files)."""
    _system.current.fsync(fd)


def sync_dir(path: str) -> None:
    """Make entries created or renamed in ``path`` durable."""
    fs = _system.current
    fd = fs.open(path, os.O_RDONLY | _O_CLOEXEC | _O_DIRECTORY)
    try:
        fs.fsync(fd)
    finally:
        fs.close(fd)


def rename(source: str, target: str) -> None:
    """Atomically move ``source`` over ``target`` (same directory)."""
    _system.current.rename(source, target)


def link_new(source: str, target: str) -> bool:
    """Atomically give ``source`` a second name ``target``; False if ``target`` exists."""
    try:
        _system.current.link(source, target)
    except FileExistsError:
        return False
    return True


def truncate(fd: int, size: int) -> None:
    """Cut a file to ``size`` bytes (the caller syncs it)."""
    _system.current.ftruncate(fd, size)


def unlink(path: str) -> None:
    _system.current.unlink(path)


def unlink_quietly(path: str) -> None:
    with contextlib.suppress(OSError):
        _system.current.unlink(path)


def rmdir_quietly(path: str) -> bool:
    """Remove an empty directory; False if it is not there or not empty."""
    try:
        _system.current.rmdir(path)
    except OSError:
        return False
    return True


def mkdir_new(path: str) -> bool:
    """Create a directory; False if it already exists."""
    try:
        _system.current.mkdir(path, 0o755)
    except FileExistsError:
        return False
    return True


def wait(sleep: Callable[[float], None], delay: float) -> None:
    """One bounded visibility wait (D5.2): every wait of the library goes through ``_fs``, with
    the sleep function injected so tests wait for nothing."""
    sleep(delay)


def retry_open(path: str, delays: Sequence[float], sleep: Callable[[float], None] = time.sleep) -> int:
    """Open ``path`` for reading, waiting along ``delays`` while it is not yet visible."""
    for delay in delays:
        try:
            return open_read(path)
        except FileNotFoundError:
            sleep(delay)
    return open_read(path)


def close(fd: int) -> None:
    _system.current.close(fd)


def map_private(fd: int, offset: int, size: int) -> memoryview:
    """Bytes ``offset:offset + size`` of an open file as private copy-on-write pages. The
    caller checks first that the file holds them (touching a page past its end faults)."""
    return _system.current.map_private(fd, offset, size)


def fstat_size(fd: int) -> int:
    """The size of an open file."""
    return _system.current.fstat_size(fd)


def fstat_links(fd: int) -> int:
    """How many names an open file has: 0 once every one was removed (the file lives on, and
    keeps its blocks allocated, only while a descriptor holds it)."""
    return _system.current.fstat_links(fd)


def descriptor_limit() -> int | None:
    """The process's soft limit of open descriptors (RLIMIT_NOFILE); None when unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else soft


def listdir(path: str) -> list[str]:
    return _system.current.listdir(path)


def exists(path: str) -> bool:
    return _system.current.exists(path)


def isdir(path: str) -> bool:
    return _system.current.isdir(path)


def isfile(path: str) -> bool:
    """Whether ``path`` is a regular file (following links; callers check :func:`islink` first)."""
    return os.path.isfile(path)


def getsize(path: str) -> int:
    return _system.current.getsize(path)


def islink(path: str) -> bool:
    return _system.current.islink(path)


def realpath(path: str) -> str:
    return _system.current.realpath(path)


def read_file(path: str, limit: int | None = None) -> bytes:
    """The whole file at ``path`` (or its first ``limit`` bytes); raises ``OSError`` like ``open``."""
    fs = _system.current
    fd = fs.open(path, os.O_RDONLY | _O_CLOEXEC)
    try:
        size = fs.fstat_size(fd)
        if limit is not None:
            size = min(size, limit)
        return bytes(pread_exact(fd, size, 0))
    finally:
        fs.close(fd)
