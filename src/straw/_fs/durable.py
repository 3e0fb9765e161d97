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


def remove_file(path: str, sync_dir: SyncDir) -> bool:
    """Durably remove ``path`` (unlink, then fsync its directory); False if it was absent (D0a)."""
    try:
        posix.unlink(path)
    except FileNotFoundError:
        return False
    sync_dir(os.path.dirname(path))
    return True


def sync_tree(path: str) -> dict[str, int]:
    """fsync every regular file below ``path`` and then every directory, deepest first (D0b).

    Returns ``{relative POSIX path: size}`` (a single file maps its own name). Symlinks and
    special files are refused with ``ValueError`` naming the first one met, before any sync:
    a checkpoint that follows a link could record bytes that live outside it.
    """
    if posix.islink(path):
        raise ValueError(f"Checkpoint payload must not be a symlink: {path}")
    if not posix.isdir(path):
        if not posix.isfile(path):
            raise FileNotFoundError(f"No such file or directory: {path}")
        size = _sync_regular(path)
        posix.sync_dir(os.path.dirname(path))
        return {os.path.basename(path): size}
    files: list[tuple[str, str]] = []
    directories = [path]
    pending = [path]
    while pending:  # bounded by the tree: every directory is listed once (no links are followed)
        directory = pending.pop()
        for name in sorted(posix.listdir(directory)):
            full = os.path.join(directory, name)
            relative = os.path.relpath(full, path).replace(os.sep, "/")
            if posix.islink(full):
                raise ValueError(f"Checkpoint payload must not be a symlink: {full}")
            if posix.isdir(full):
                directories.append(full)
                pending.append(full)
            elif posix.isfile(full):
                files.append((relative, full))
            else:
                raise ValueError(f"Checkpoint payload must be regular files and directories: {full}")
    sizes = {relative: _sync_regular(full) for relative, full in sorted(files)}
    for directory in sorted(directories, key=lambda d: d.count(os.sep), reverse=True):
        posix.sync_dir(directory)
    posix.sync_dir(os.path.dirname(os.path.abspath(path)))
    return sizes


def _sync_regular(path: str) -> int:
    fd = posix.open_read(path)
    try:
        posix.fsync(fd)
        return posix.fstat_size(fd)
    finally:
        posix.close_quietly(fd)
