"""Advisory whole-file locks (flock) used to fence owners across processes and clients.

``flock`` rather than ``fcntl`` byte-range locks: JuiceFS is known to report
false EDEADLK for ``fcntl`` locks, while its BSD locks exclude across clients
(tests/test_juicefs_mount.py checks it). The kernel drops the lock when the
holder dies, which is what makes ``recover=True`` possible after a crash.
"""

from __future__ import annotations

import contextlib
import fcntl
import os

from . import system as _system

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def try_lock_exclusive(path: str) -> int | None:
    """Open (creating) ``path`` and take an exclusive lock without waiting; None if held elsewhere."""
    fs = _system.current
    fd = fs.open(path, os.O_RDWR | os.O_CREAT | _O_CLOEXEC, 0o644)
    try:
        fs.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fs.close(fd)
        return None
    except BaseException:
        fs.close(fd)
        raise
    return fd


def unlock(fd: int) -> None:
    """Release a lock taken by :func:`try_lock_exclusive` and close its descriptor."""
    fs = _system.current
    try:
        fs.flock(fd, fcntl.LOCK_UN)
    finally:
        fs.close(fd)


def lock_exclusive(fd: int) -> None:
    """Wait for an exclusive lock on an open descriptor (cross-client on JuiceFS, A8)."""
    _system.current.flock(fd, fcntl.LOCK_EX)


def unlock_only(fd: int) -> None:
    """Release a lock taken by :func:`lock_exclusive`, keeping the descriptor open."""
    _system.current.flock(fd, fcntl.LOCK_UN)


def open_lock_file(path: str) -> int:
    return _system.current.open(path, os.O_RDWR | os.O_CREAT | _O_CLOEXEC, 0o644)


def create_locked(path: str, note: bytes = b"") -> int:
    """Create ``path`` already locked: lock a temporary file, then link it into place.

    Nobody can see ``path`` unlocked, so a collector that takes its lock knows the
    holder is gone (docs/GC.md, writer liveness). Fails if ``path`` exists. ``note``
    is informational content (never synced, never trusted for a decision).
    """
    fs = _system.current
    directory, name = os.path.split(path)
    temp = os.path.join(directory, f".{name}.{os.getpid()}.{id(path):x}.tmp")
    fd = fs.open(temp, os.O_RDWR | os.O_CREAT | os.O_EXCL | _O_CLOEXEC, 0o644)
    try:
        fs.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if note:
            fs.pwritev(fd, [note], 0)
        _link(fs, temp, path)
    except BaseException:
        fs.close(fd)
        with contextlib.suppress(OSError):
            fs.unlink(temp)
        raise
    # The lock is in place under its name; a temporary name left behind by a failed unlink is
    # harmless (collection removes a dead writer's temporary files, FORMAT.md section 1).
    with contextlib.suppress(OSError):
        fs.unlink(temp)
    return fd


def _link(fs: _system.System, temp: str, path: str) -> None:
    """Link ``temp`` to ``path``; an error after the link was made still counts as made.

    A link can fail after the directory changed (an I/O error on the way back). Only this
    writer ever names ``path`` (A4: one writer per directory), so if it exists it is ours,
    and it refers to the descriptor we hold locked.
    """
    try:
        fs.link(temp, path)
    except FileExistsError:
        raise
    except OSError:
        if not fs.exists(path):
            raise
