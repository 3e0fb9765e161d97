"""Read the pool's ownership catalog without changing it, and repair only its torn tail.

The loader is the catalog's own (``straw._catalog.log.load_catalog``: snapshot,
then the log's frames, docs/DURABILITY.md G2, G7 and J7) through the same
``straw._fs`` seam; where a catalog client raises, this records a finding. It
zeroes a torn tail only when asked to (``--fix``), under ``catalog/LOCK`` as
every catalog client does.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

from .._catalog.log import CATALOG_DIR, LOCK_FILE, LOG_FILE, load_catalog, traces
from .._catalog.state import CatalogState
from .._fs import durable, lock, posix
from .._journal import scan


@dataclass
class CatalogView:
    """The catalog state as far as it could be read, and what was wrong with it."""

    state: CatalogState = field(default_factory=CatalogState)
    present: bool = False
    frames: int = 0
    log_bytes: int = 0
    snapshot_bytes: int = 0
    complete: bool = True  # False when damage stopped the load (the state is partial)
    torn_at: int | None = None  # offset of a torn tail of the log
    problems: list[tuple[str, str, str, str]] = field(default_factory=list)  # code, severity, path, message


@contextlib.contextmanager
def catalog_lock(root: str, *, create: bool = False, required: bool = False) -> Iterator[None]:
    """Hold ``catalog/LOCK`` (G1) when it exists (or ``create``); a pool without one has no catalog.

    ``required`` is for a repair that writes the catalog: its directory is made, and a lock
    that cannot be taken is an error, never a write without it.
    """
    path = os.path.join(root, CATALOG_DIR, LOCK_FILE)
    if required:
        durable.make_dirs(os.path.join(root, CATALOG_DIR), root, posix.sync_dir)
    elif not create and not posix.exists(path):
        yield
        return
    try:
        fd = lock.open_lock_file(path)
    except OSError:
        if required:
            raise
        yield  # a read-only mount: read without the lock (a live appender's tail may look torn)
        return
    try:
        lock.lock_exclusive(fd)
        yield
    finally:
        with contextlib.suppress(OSError):
            lock.unlock(fd)


def read_catalog(root: str, *, fix: bool = False) -> tuple[CatalogView, list[tuple[str, str, str, str]]]:
    """Load the catalog (under its lock when it has one); with ``fix`` zero a torn log tail.

    Returns the view and the problems that were repaired.
    """
    directory = os.path.join(root, CATALOG_DIR)
    view = CatalogView(present=posix.isdir(directory))
    repaired: list[tuple[str, str, str, str]] = []
    with catalog_lock(root):
        _load(root, view)
        if fix and view.torn_at is not None:
            durable.zero_tail(os.path.join(directory, LOG_FILE), view.torn_at, posix.sync_file)
            repaired += [p for p in view.problems if p[0] == "catalog.torn_tail"]
    return view, repaired


def _load(root: str, view: CatalogView) -> None:
    log_rel = f"{CATALOG_DIR}/{LOG_FILE}"
    loaded = load_catalog(os.path.join(root, CATALOG_DIR), CATALOG_DIR)
    view.state, view.frames = loaded.state, loaded.frames
    view.log_bytes, view.snapshot_bytes = loaded.size, loaded.snapshot_bytes
    view.present = loaded.present or loaded.snapshot_bytes > 0
    if loaded.problem is not None:
        problem = loaded.problem
        view.problems.append((problem.code, "error", problem.path, problem.message))
        view.complete = False
        return
    if not loaded.present:
        found = traces(root)
        if found:
            view.problems.append(
                (
                    "catalog.missing",
                    "error",
                    log_rel,
                    f"{log_rel} is missing but {found}: ownership is lost, and every pack would be "
                    "collectable; collection refuses until the catalog is restored or rebuilt "
                    "(straw check --rebuild-catalog, docs/CHECK.md)",
                )
            )
            view.complete = False
        return
    end = loaded.end
    if end is not None and end.kind == scan.TORN:
        view.torn_at = end.offset
        view.problems.append(
            (
                "catalog.torn_tail",
                "repairable",
                log_rel,
                f"{log_rel}: {end.reason} at offset {end.offset}, left by an appender that crashed before "
                "its frame was acknowledged",
            )
        )
