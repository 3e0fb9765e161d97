"""Durable small files beside a pool: JSON reports, their removal, lock files, synced trees.

``write_report(path, value)`` (API.md section 1) makes a canonical JSON file appear atomically,
complete and durably (docs/DURABILITY.md D0); ``remove_report`` removes one durably (D0a);
``try_lock`` takes a non-blocking exclusive lock file that the kernel frees when its holder
dies; ``sync_tree`` makes a directory of files written by someone else durable (D0b), e.g. a
model checkpoint before a commit marker names it. Every sync goes through ``straw._fs``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ._fs import durable, lock, posix
from .protocol import encode

__all__ = ["FileLock", "remove_report", "sync_tree", "try_lock", "write_report"]


def _absolute(path: str | os.PathLike[str]) -> Path:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"expected a path, got {type(path).__name__}")
    text = os.fspath(path)
    if not isinstance(text, str) or not text:
        raise ValueError(f"expected a non-empty text path, got {text!r}")
    return Path(os.path.abspath(text))


def write_report(path: str | os.PathLike[str], value: Any) -> Path:
    """Write ``value`` as canonical JSON to ``path`` atomically and durably; returns the path."""
    target = _absolute(path)
    data = encode(value) + b"\n"
    try:
        durable.replace_file(str(target), [data], posix.sync_file, posix.sync_dir)
    except OSError as error:
        raise posix.storage_error(error, f"writing report {target}") from error
    return target


def remove_report(path: str | os.PathLike[str]) -> bool:
    """Unlink ``path`` and fsync its directory; False when it was already absent.

    Refuses directories (``IsADirectoryError``): only files are reports.
    """
    target = _absolute(path)
    if posix.isdir(str(target)) and not posix.islink(str(target)):
        raise IsADirectoryError(f"remove_report removes files, {target} is a directory")
    try:
        return durable.remove_file(str(target), posix.sync_dir)
    except OSError as error:
        raise posix.storage_error(error, f"removing report {target}") from error


class FileLock:
    """An exclusive ``flock`` held on a lock file until :meth:`release` (or the process dies).

    A forked child inherits the descriptor, and releasing a ``flock`` from it would release
    the parent's lock too; so only the process that took the lock unlocks it, a child merely
    closes its copy.
    """

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd
        self._pid = os.getpid()

    def __repr__(self) -> str:
        return f"FileLock({str(self.path)!r}, held={self.held})"

    @property
    def held(self) -> bool:
        return self._fd is not None and self._pid == os.getpid()

    def release(self) -> None:
        """Release the lock and close its descriptor; repeated calls do nothing."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        if self._pid == os.getpid():
            lock.unlock(fd)
        else:
            posix.close_quietly(fd)

    def __enter__(self) -> FileLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def try_lock(path: str | os.PathLike[str]) -> FileLock | None:
    """Create ``path`` if needed and lock it exclusively without waiting; None if it is held.

    The lock excludes other processes (and other JuiceFS clients, A8); another attempt from
    the same process on another descriptor is refused too. The parent directory must exist.
    """
    target = _absolute(path)
    try:
        fd = lock.try_lock_exclusive(str(target))
    except FileNotFoundError:
        raise FileNotFoundError(f"cannot create lock file {target}: its directory does not exist") from None
    except OSError as error:
        raise posix.storage_error(error, f"locking {target}") from error
    return None if fd is None else FileLock(target, fd)


def sync_tree(path: str | os.PathLike[str]) -> dict[str, int]:
    """fsync every regular file below ``path`` and every directory deepest first (D0b).

    Returns ``{relative POSIX path: size}``; for a single file, ``{its name: size}``. A symlink
    anywhere (or ``path`` itself) raises ``ValueError`` naming the first one met, before any
    sync; a missing path raises ``FileNotFoundError``.
    """
    target = _absolute(path)
    try:
        return durable.sync_tree(str(target))
    except (ValueError, FileNotFoundError):
        raise
    except OSError as error:
        raise posix.storage_error(error, f"syncing {target}") from error
