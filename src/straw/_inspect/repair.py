"""The explicit repairs of ``straw check``: rebuild a lost catalog, forget a lost queue's owner.

docs/CHECK.md "Explicit repairs". Unlike ``--fix``, these change ownership on
an operator's word, so each one runs only with every writer and coordinator of
the pool stopped (their locks are held for the length of the repair), and
neither can make data collectable that an owner needed:

* ``rebuild_catalog``: for a pool whose catalog is missing, damaged or shorter
  than what the pool proves existed (I20). The old files are kept beside the
  new log (``catalog/*.lost-<n>``). The new catalog records every queue's owner
  with exactly its current roots (read from its journal, as ``collect_garbage``
  computes them) and makes every operator-listed owner reach **every** pack on
  disk: nothing is dropped, and each application then narrows its owners again
  (``retain`` replaces, ``release`` ends) before space is reclaimed.
* ``forget_owner``: releases one owner, refusing a queue owner whose queue is
  still in the pool and straw's staging owners.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from .._catalog.collect import queue_directories
from .._catalog.log import CATALOG_DIR, LOG_FILE, SNAPSHOT_FILE, TAG, Catalog, load_catalog
from .._catalog.state import RESERVED_PREFIXES
from .._fs import durable, lock, posix
from .._journal import frame
from ..backend import FilesystemBackend
from ..coordinator import LOCK_FILE as QUEUE_LOCK
from ..errors import QueueError
from ..limits import CATALOG_PREALLOC_BYTES, SUBMISSION_ID_BYTES_MAX
from ..protocol import encode
from .catalog_view import catalog_lock
from .gather import Pool, gather
from .layout import LIVE_FILE

__all__ = ["RepairRefused", "forget_owner", "rebuild_catalog"]


class RepairRefused(Exception):
    """An explicit repair cannot run safely (live users, nothing to repair, a bad owner name)."""


@dataclass
class Rebuilt:
    """What :func:`rebuild_catalog` recorded."""

    packs: int
    owners: list[str]
    queues: dict[str, int]  # queue owner -> packs its roots reach
    kept: list[str]  # pool-relative paths of the old catalog files, kept aside


@contextlib.contextmanager
def _quiet_pool(root: str) -> Iterator[None]:
    """Hold every lock a live user of the pool holds (writers' ``LIVE``, queues' ``LOCK``),
    refusing when one is held. ``catalog/LOCK`` is taken separately, like every client does."""
    held: list[int] = []
    try:
        for path, what in _lock_files(root):
            fd = lock.try_lock_exclusive(path)
            if fd is None:
                raise RepairRefused(
                    f"{what} is alive (it holds {os.path.relpath(path, root)}); stop it first"
                )
            held.append(fd)
        yield
    finally:
        for fd in held:
            with contextlib.suppress(OSError):
                lock.unlock(fd)


def _lock_files(root: str) -> list[tuple[str, str]]:
    out = []
    raw = os.path.join(root, "raw")
    try:
        writers = sorted(posix.listdir(raw))
    except FileNotFoundError:
        writers = []
    for writer in writers:
        live = os.path.join(raw, writer, LIVE_FILE)
        if posix.exists(live):
            out.append((live, f"writer {writer}"))
    for directory in queue_directories(root):
        path = os.path.join(root, directory, QUEUE_LOCK)
        if posix.exists(path):
            out.append((path, f"the coordinator of {directory}"))
    return out


def _check_owner_names(owners: Sequence[str]) -> list[str]:
    if not owners:
        raise RepairRefused(
            "--rebuild-catalog needs at least one --owner NAME: the owner(s) that will keep every pack "
            "until the application retains its data again (nothing is dropped)"
        )
    for owner in owners:
        if (
            not isinstance(owner, str)
            or not owner
            or len(owner.encode("utf-8", "replace")) > SUBMISSION_ID_BYTES_MAX
        ):
            raise RepairRefused(f"owner {owner!r} is not a valid owner name")
        if owner.startswith(RESERVED_PREFIXES):
            raise RepairRefused(
                f"owner {owner!r}: names starting with {', '.join(RESERVED_PREFIXES)} are straw's"
            )
    return sorted(set(owners))


def rebuild_catalog(root: str, owners: Sequence[str]) -> Rebuilt:
    """Replace a lost or damaged catalog with one that drops no owner (module docs)."""
    names = _check_owner_names(owners)
    with _quiet_pool(root):
        pool = gather(root, scan=False)  # reads the catalog under its lock, as check does
        if pool.catalog.complete and pool.catalog.present and not _lost_owners(pool):
            raise RepairRefused(
                "the catalog is intact and knows every queue's owner: there is nothing to rebuild "
                "(--rebuild-catalog replaces only a missing, damaged or shortened catalog)"
            )
        on_disk = sorted(pool.on_disk)
        events: list[dict[str, object]] = [{"op": "retain", "owner": o, "packs": on_disk} for o in names]
        queues: dict[str, int] = {}
        for view in pool.queues:
            owner = view.owner()
            if owner is None:
                continue
            roots = pool.roots.get(view.directory)
            packs = sorted(p for p in (roots.packs if roots is not None else set()) if p in pool.on_disk)
            queues[owner] = len(packs)
            events.append({"op": "retain", "owner": owner, "packs": packs})
        with catalog_lock(root, required=True):
            seen = (pool.catalog.frames, pool.catalog.log_bytes, pool.catalog.snapshot_bytes)
            again = load_catalog(os.path.join(root, CATALOG_DIR))
            if (again.frames, again.size, again.snapshot_bytes) != seen:
                raise RepairRefused("the catalog changed while the pool was read; run the repair again")
            kept = _set_aside(root)
            _write_log(root, events)
    return Rebuilt(len(on_disk), names, queues, kept)


def _lost_owners(pool: Pool) -> bool:
    """Whether a queue with a journal has no owner in the catalog (the catalog lost events)."""
    owners = pool.catalog.state.owners
    return any(
        view.owner() is not None and view.owner() not in owners and view.journal.last_seq > 0
        for view in pool.queues
    )


def _set_aside(root: str) -> list[str]:
    """Keep the old catalog files under new names (``log.lost-<n>``), never deleted."""
    directory = os.path.join(root, CATALOG_DIR)
    kept = []
    for name in (LOG_FILE, SNAPSHOT_FILE):
        path = os.path.join(directory, name)
        if not posix.exists(path):
            continue
        number = 1
        while posix.exists(f"{path}.lost-{number}"):
            number += 1
        posix.rename(path, f"{path}.lost-{number}")
        kept.append(f"{CATALOG_DIR}/{name}.lost-{number}")
    if kept:
        posix.sync_dir(directory)
    return kept


def _write_log(root: str, events: list[dict[str, object]]) -> None:
    """A new catalog log: header, one frame with every event, zeros ahead (D0, J7)."""
    genesis = frame.genesis_chain(TAG)
    header = frame.encode_segment_header(frame.SEGMENT_MAGIC, 1, genesis, TAG)
    body = encode({"events": events})
    frame_header, _ = frame.encode_frame(1, genesis, body)
    path = os.path.join(root, CATALOG_DIR, LOG_FILE)
    durable.create_file(
        path, [header, frame_header, body, bytes(CATALOG_PREALLOC_BYTES)], posix.sync_file, posix.sync_dir
    )
    loaded = load_catalog(os.path.join(root, CATALOG_DIR))
    if loaded.problem is not None:  # pragma: no cover - a bug in the lines above
        raise RepairRefused(f"the rebuilt catalog does not load: {loaded.problem.message}")


def forget_owner(root: str, owner: str) -> int:
    """Release ``owner`` (its packs become collectable unless another owner reaches them).

    Returns how many packs it reached. Refuses staging owners and the owner of a queue
    whose directory is still in the pool (that queue's collect_garbage maintains it).
    """
    if owner.startswith("staging:"):
        raise RepairRefused(f"{owner} is a staging owner: it ends with its publications or its writer")
    with _quiet_pool(root):
        pool = gather(root, scan=False)
        for view in pool.queues:
            if view.owner() == owner:
                raise RepairRefused(
                    f"{owner} is the owner of the queue in {view.directory}, which is still there"
                )
        if any(view.unidentified for view in pool.queues):
            raise RepairRefused("a queue directory has lost its queue.json: its owner cannot be told apart")
        catalog = Catalog(FilesystemBackend(root, visibility_delays=()))
        try:
            with catalog.locked() as held:
                packs = held.state.owners.get(owner)
                if packs is None:
                    raise RepairRefused(f"the catalog has no owner {owner!r}")
                held.append([{"op": "release", "owner": owner}])
                return len(packs)
        except QueueError as error:
            raise RepairRefused(f"the catalog cannot be updated: {error}") from None
        finally:
            catalog.close()
