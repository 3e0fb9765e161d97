"""The one way straw makes a whole file visible: write, fsync, rename or link, fsync dir.

docs/DURABILITY.md step D0. A crash at any point leaves either the old state
or the new complete file, plus at most an invisible temporary file.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable, Sequence

from . import posix

Sync = Callable[[int], None]
SyncDir = Callable[[str], None]


def _temp_name(path: str) -> str:
    head, tail = os.path.split(path)
    return os.path.join(head, f".{tail}.{secrets.token_hex(6)}.tmp")


def _write_temp(path: str, chunks: Sequence[posix.Buffer], sync_file: Sync) -> str:
    temp = _temp_name(path)
    fd = posix.create_exclusive(temp)
    try:
        posix.pwrite_all(fd, chunks, 0)
        sync_file(fd)
    except BaseException:
        posix.close_quietly(fd)
        posix.unlink_quietly(temp)
        raise
    posix.close(fd)
    return temp


def replace_file(path: str, chunks: Sequence[posix.Buffer], sync_file: Sync, sync_dir: SyncDir) -> None:
    """Atomically replace (or create) ``path`` with ``chunks``, durably."""
    temp = _write_temp(path, chunks, sync_file)
    try:
        posix.rename(temp, path)
    except BaseException:
        posix.unlink_quietly(temp)
        raise
    sync_dir(os.path.dirname(path))


def create_file(path: str, chunks: Sequence[posix.Buffer], sync_file: Sync, sync_dir: SyncDir) -> bool:
    """Durably create ``path`` with ``chunks`` unless it exists; True if this call created it."""
    temp = _write_temp(path, chunks, sync_file)
    try:
        created = posix.link_new(temp, path)
    finally:
        posix.unlink_quietly(temp)
    sync_dir(os.path.dirname(path))
    return created


def make_dirs(path: str, stop: str, sync_dir: SyncDir | None) -> None:
    """Create ``path`` and missing parents below ``stop``, syncing each parent that gained an entry
    (``sync_dir=None``: directories outside the pool, created without syncs)."""
    missing: list[str] = []
    current = path
    while current != stop and not posix.isdir(current):
        missing.append(current)
        current = os.path.dirname(current)
    for directory in reversed(missing):
        if posix.mkdir_new(directory) and sync_dir is not None:
            sync_dir(os.path.dirname(directory))


def cut_tail(path: str, size: int, sync_file: Sync) -> None:
    """Durably truncate ``path`` to ``size`` bytes (a torn log tail; DURABILITY.md J4.3, G2)."""
    fd = posix.open_append(path)
    try:
        posix.truncate(fd, size)
        sync_file(fd)
    finally:
        posix.close_quietly(fd)


def zero_tail(path: str, offset: int, sync_file: Sync) -> None:
    """Durably overwrite ``path`` with zeros from ``offset`` to its end, keeping its size.

    How a torn log tail is repaired (DURABILITY.md J4.3, G2, J7): the crashed append's
    bytes are gone, and the log still ends in zeros, as only a cut-short file does not.
    """
    fd = posix.open_append(path)
    try:
        size = posix.fstat_size(fd)
        if size > offset:
            posix.pwrite_all(fd, [bytes(size - offset)], offset)
        sync_file(fd)
    finally:
        posix.close_quietly(fd)
