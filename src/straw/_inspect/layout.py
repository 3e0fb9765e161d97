"""Where things are in a pool (docs/FORMAT.md section 1) and whether a directory is one."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from .._catalog.collect import queue_directories
from .._fs import lock, posix
from .._pack.reader import PACK_NAME, WRITER_NAME
from ..store import POOL_FORMAT, POOL_MARKER

LIVE_FILE = "LIVE"


class NotAPool(Exception):
    """The directory given is not a straw pool (no or a foreign ``straw-pool.json``), or unreadable."""


@dataclass(frozen=True)
class PackFile:
    """One pack (or standalone segment) found on disk."""

    path: str  # pool-relative, raw/<writer>/<segment>.pack
    writer: str
    size: int


@dataclass
class Layout:
    """What a listing of the pool found."""

    root: str
    packs: list[PackFile] = field(default_factory=list)
    temps: list[str] = field(default_factory=list)  # pool-relative temporary files
    writers: list[str] = field(default_factory=list)
    queues: list[str] = field(default_factory=list)  # pool-relative queue directories
    strays: list[str] = field(default_factory=list)  # names under raw/ that straw never writes
    links: list[str] = field(default_factory=list)  # packs and metadata files that are symbolic links


def open_pool(root: str | os.PathLike[str]) -> str:
    """The absolute root of a pool, or :class:`NotAPool` saying why it is not one."""
    path = os.path.abspath(os.fspath(root))
    if not posix.isdir(path):
        raise NotAPool(f"{path} is not a directory")
    marker = os.path.join(path, POOL_MARKER)
    try:
        text = posix.read_file(marker, 4096)
    except FileNotFoundError:
        raise NotAPool(f"{path} is not a straw pool (no {POOL_MARKER})") from None
    except OSError as error:
        raise NotAPool(f"cannot read {marker}: {error.strerror or error}") from None
    try:
        found = json.loads(text)
    except ValueError:
        found = None
    if not isinstance(found, dict) or found.get("format") != POOL_FORMAT["format"]:
        raise NotAPool(f"{marker} is not a straw pool marker")
    if found.get("version") != POOL_FORMAT["version"]:
        raise NotAPool(f"{path}: pool format version {found.get('version')!r} is not supported")
    return path


def _listdir(path: str) -> list[str]:
    try:
        return sorted(posix.listdir(path))
    except (FileNotFoundError, NotADirectoryError):
        return []


def list_pool(root: str) -> Layout:
    """Every pack, temporary file and queue directory of the pool (one listing, no locks)."""
    layout = Layout(root)
    raw = os.path.join(root, "raw")
    for writer in _listdir(raw):
        if not WRITER_NAME.fullmatch(writer):
            layout.strays.append(f"raw/{writer}")
            continue
        layout.writers.append(writer)
        for name in _listdir(os.path.join(raw, writer)):
            relative = f"raw/{writer}/{name}"
            if PACK_NAME.fullmatch(name):
                full = os.path.join(root, relative)
                try:
                    size = posix.getsize(full)
                except FileNotFoundError:
                    continue  # collected while we listed
                if posix.islink(full):
                    layout.links.append(relative)
                layout.packs.append(PackFile(relative, writer, size))
            elif name.endswith(".tmp"):
                layout.temps.append(relative)
            elif name != LIVE_FILE:
                layout.strays.append(relative)
    layout.queues = queue_directories(root)
    layout.links += _metadata_links(root, layout)
    return layout


def _metadata_links(root: str, layout: Layout) -> list[str]:
    """Pool-relative metadata files that are symbolic links (straw never makes one)."""
    names = [POOL_MARKER]
    names += [f"catalog/{n}" for n in _listdir(os.path.join(root, "catalog"))]
    names += [f"raw/{w}/{LIVE_FILE}" for w in layout.writers]
    for queue in layout.queues:
        names += [f"{queue}/{n}" for n in _listdir(os.path.join(root, queue))]
        for sub in ("wal", "snap"):
            names += [f"{queue}/{sub}/{n}" for n in _listdir(os.path.join(root, queue, sub))]
    return [name for name in names if posix.islink(os.path.join(root, name))]


def writer_alive(root: str, writer: str, dead: set[str]) -> bool:
    """Whether a writer still lives: its ``LIVE`` lock is held (docs/GC.md, writer liveness).

    The lock is tried without waiting and released at once; a writer creates its
    ``LIVE`` file already locked, so probing never makes a live writer look dead.
    A writer without a ``LIVE`` file is starting (or was never one) and counts as alive.
    """
    if writer in dead:
        return False
    path = os.path.join(root, "raw", writer, LIVE_FILE)
    if not posix.exists(path):
        return True
    try:
        fd = lock.try_lock_exclusive(path)
    except OSError:
        return True  # cannot probe (read-only mount or permissions): assume the writer lives
    if fd is None:
        return True
    lock.unlock(fd)
    return False
