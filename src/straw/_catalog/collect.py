"""Garbage collection: find dead writers, tombstone what nobody needs, unlink it (G4, G5).

Runs inside the catalog lock, so collectors on several clients reclaim each
pack exactly once. Order per pack: tombstone durable in the catalog, then
unlink, then directory sync; a crash in between leaves a tombstoned file that
the next collection unlinks (ENOENT after a tombstone counts as done).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from .._fs import lock, posix
from .._pack.reader import PACK_NAME, WRITER_NAME
from ..backend import FilesystemBackend
from ..errors import UnsafeRecovery
from ..protocol import decode
from .log import Catalog, describe
from .state import CatalogState, Event, queue_owner

LIVE_FILE = "LIVE"


@dataclass
class _Scan:
    on_disk: dict[str, int] = field(default_factory=dict)  # pack path -> bytes
    temps: list[str] = field(default_factory=list)  # temporary files of dead writers
    dead_locks: list[int] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    live_writers: set[str] = field(default_factory=set)


def _scan(catalog: Catalog, backend: FilesystemBackend, own_writer: str | None) -> _Scan:
    """List every pack; decide which writers are dead (their liveness lock is free)."""
    state = catalog.state
    raw = os.path.join(str(backend.root), "raw")
    scan = _Scan()
    try:
        writers = sorted(posix.listdir(raw))
    except FileNotFoundError:
        return scan
    for writer in writers:
        if not WRITER_NAME.fullmatch(writer):
            continue
        directory = os.path.join(raw, writer)
        try:
            names = posix.listdir(directory)
        except FileNotFoundError:
            continue
        alive = _alive(writer, directory, names, own_writer, state.dead_writers, scan)
        for name in names:
            relative = f"raw/{writer}/{name}"
            if PACK_NAME.fullmatch(name):
                try:
                    scan.on_disk[relative] = posix.getsize(os.path.join(directory, name))
                except FileNotFoundError:
                    continue
                info = state.packs.get(relative)
                if not alive and (info is None or not info.sealed):
                    # G5: the writer died with this pack open; its staging ends with it.
                    scan.events.append({"op": "seal", "pack": relative, "extents": None})
            elif name.endswith(".tmp") and not alive:
                scan.temps.append(os.path.join(directory, name))
        if alive:
            scan.live_writers.add(writer)
    return scan


def _alive(
    writer: str, directory: str, names: list[str], own: str | None, dead: set[str], scan: _Scan
) -> bool:
    if writer == own:
        return True
    if writer in dead:
        return False
    if LIVE_FILE not in names:
        return True  # a writer that is starting: it takes its lock before it writes any file
    fd = lock.try_lock_exclusive(os.path.join(directory, LIVE_FILE))
    if fd is None:
        return True
    scan.dead_locks.append(fd)
    scan.events.append({"op": "writer_dead", "writer": writer})
    return False


def _dead_staging(state_owners: Iterable[str], dead: set[str]) -> list[Event]:
    """G5: the staging owners of dead writers end with them."""
    prefixes = tuple(f"staging:{writer}:" for writer in dead)
    if not prefixes:
        return []
    return [{"op": "release", "owner": o} for o in sorted(state_owners) if o.startswith(prefixes)]


def _drop_empty_writer_dirs(backend: FilesystemBackend, dead: set[str], remaining: set[str]) -> None:
    """Remove the directories of dead writers that hold nothing but their liveness file."""
    raw = os.path.join(str(backend.root), "raw")
    busy = {path.split("/")[1] for path in remaining}
    removed = False
    for writer in sorted(dead - busy):
        directory = os.path.join(raw, writer)
        try:
            names = posix.listdir(directory)
        except FileNotFoundError:
            continue
        if names and names != [LIVE_FILE]:
            continue
        posix.unlink_quietly(os.path.join(directory, LIVE_FILE))
        removed |= posix.rmdir_quietly(directory)
    if removed:
        backend.sync_dir(raw)


def queue_directories(root: str) -> list[str]:
    """Pool-relative directories of every queue (``queue``, ``queues/<digest>``)."""
    out = ["queue"] if posix.isdir(os.path.join(root, "queue")) else []
    try:
        names = sorted(posix.listdir(os.path.join(root, "queues")))
    except (FileNotFoundError, NotADirectoryError):
        names = []
    out += [f"queues/{n}" for n in names if posix.isdir(os.path.join(root, "queues", n))]
    return out


def _check_queue_owners(root: str, state: CatalogState) -> None:
    """I20: every queue's owner is in the catalog (coordinators record it before ``queue.json``).

    One that is not proves the catalog is shorter than what the pool holds (a truncated or
    older copy): collecting from it could delete what the lost events retained.
    """
    for directory in queue_directories(root):
        path = os.path.join(root, directory, "queue.json")
        try:
            identity = decode(posix.read_file(path))
        except FileNotFoundError:
            continue  # a queue that never served a call
        except Exception as error:
            raise UnsafeRecovery(
                f"cannot read {path} ({error}), so its queue's catalog owner is unknown; run `straw "
                "check`; refusing to collect garbage"
            ) from None
        run_id = identity.get("run_id") if isinstance(identity, dict) else None
        if not isinstance(run_id, str) or queue_owner(run_id, directory) not in state.owners:
            raise UnsafeRecovery(
                f"the catalog does not know the owner of the queue in {directory}: it lost events (a "
                "truncated or older copy), and collecting could delete what they retained. Run `straw "
                "check` (docs/CHECK.md); refusing to collect garbage"
            )


def collect(catalog: Catalog, backend: FilesystemBackend, own_writer: str | None) -> dict[str, Any]:
    """One collection pass; returns what it reclaimed and what it kept."""
    with catalog.locked() as cat:
        _check_queue_owners(str(backend.root), cat.state)
        scan = _scan(cat, backend, own_writer)
        try:
            cat.append(scan.events)  # G5 before G4: deaths and seals are durable first
            state = cat.state
            cat.append(_dead_staging(list(state.owners), state.dead_writers))
            leftover = sorted(p for p in scan.on_disk if p in state.tombstones)
            victims = state.collectable(scan.on_disk)
            if victims:
                backend.fault("before_tombstone")
                cat.append([{"op": "tombstone", "packs": victims}])  # G4.1
                backend.fault("after_tombstone")
            files, size, touched = 0, 0, set()
            for path in leftover + victims:
                backend.fault("before_unlink")
                try:
                    posix.unlink(os.path.join(str(backend.root), path))  # G4.2
                    files += 1
                    size += scan.on_disk[path]
                except FileNotFoundError:
                    pass  # G4.3: gone already (another client, or a stale listing): done
                touched.add(os.path.dirname(os.path.join(str(backend.root), path)))
            for directory in sorted(touched):
                backend.sync_dir(directory)
            for temp in scan.temps:
                posix.unlink_quietly(temp)
            _drop_empty_writer_dirs(
                backend, state.dead_writers, set(scan.on_disk) - set(leftover) - set(victims)
            )
            gone = {p for p in state.tombstones if p not in scan.on_disk and p not in state.reclaimed}
            done = sorted(set(leftover) | set(victims) | gone)
            if done:  # nothing to record on a pass that reclaimed nothing: the log stays put
                cat.append([{"op": "reclaimed", "packs": done}])
        finally:
            for fd in scan.dead_locks:
                lock.unlock(fd)
        kept = [p for p in scan.on_disk if p not in leftover and p not in victims]
        open_packs = sum(1 for p in kept if p not in state.packs or not state.packs[p].sealed)
        return {
            "reclaimed_files": files,
            "reclaimed_bytes": size,
            "retained_packs": len(kept) - open_packs,
            "open_packs": open_packs,
            "owners": len(state.owners),
            "tombstones": len(state.tombstones),
            "dead_writers_found": sum(1 for e in scan.events if e["op"] == "writer_dead"),
            "catalog": describe(state),
        }
