"""``straw inspect``: what a pool holds and why each pack is kept (read-only).

Live and dead bytes are per pack, not per extent: the catalog records which
packs an owner reaches, not which extents (docs/GC.md). A pack counts as live
(all of its valid bytes) while anything keeps it (an owner, its staging, an
open or unsealed state); its torn or zero-filled tail is always dead. A pack
nothing keeps is all dead: the next collection reclaims it.
"""

from __future__ import annotations

import os
from typing import Any

from .._pack import frame as pack_frame
from .gather import Pool, gather
from .queue_view import describe

__all__ = ["UnknownPack", "inspect_pool", "why"]


class UnknownPack(Exception):
    """``--why PACK`` names a pack that is neither on disk nor known to the catalog."""


def _run_names(pool: Pool) -> dict[bytes, str]:
    return {pack_frame.run_tag(v.run_id): v.run_id for v in pool.queues if v.run_id is not None}


def _pack_row(
    pool: Pool, path: str, size: int, reached: dict[str, list[str]], runs: dict[bytes, str]
) -> dict[str, Any]:
    state = pool.catalog.state
    scan = pool.scans.get(path)
    info = state.packs.get(path)
    sealed = bool((scan is not None and scan.sealed) or (info is not None and info.sealed))
    writer = path.split("/")[1]
    owners = sorted(reached.get(path, []))
    alive = pool.alive.get(writer)
    tombstoned = path in state.tombstones
    kept = not tombstoned and (bool(owners) or not sealed or not state.staging_over(path))
    valid = scan.valid_end if scan is not None else 0
    run = None
    if scan is not None and scan.header is not None:
        run = runs.get(scan.header.run_tag, scan.header.run_tag.hex())
    return {
        "pack": path,
        "writer": writer,
        "size": size,
        "state": "tombstoned" if tombstoned else ("sealed" if sealed else "open"),
        "writer_alive": alive,
        "extents": len(scan.extents) if scan is not None else None,
        "tail": scan.tail if scan is not None else None,
        "live_bytes": valid if kept else 0,
        "dead_bytes": size - (valid if kept else 0),
        "owners": owners,
        "staging_over": state.staging_over(path),
        "run": run,
    }


def inspect_pool(root: str | os.PathLike[str]) -> dict[str, Any]:
    """A JSON-ready description of the pool (what ``straw inspect --json`` prints)."""
    pool = gather(root)
    state = pool.catalog.state
    reached = state.reached()
    runs = _run_names(pool)
    packs = [_pack_row(pool, p.path, p.size, reached, runs) for p in pool.layout.packs]
    sizes = {row["pack"]: row for row in packs}
    owners = {}
    for owner, reach in sorted(state.owners.items()):
        present = [p for p in reach if p in sizes]
        owners[owner] = {
            "packs": len(reach),
            "bytes": sum(sizes[p]["size"] for p in present),
            "missing": len(reach) - len(present),
        }
    queues = []
    for view in pool.queues:
        row = describe(view)
        roots = pool.roots.get(view.directory)
        row["root_packs"] = len(roots.packs) if roots is not None else None
        queues.append(row)
    return {
        "root": pool.root,
        "run_ids": sorted(set(runs.values())),
        "catalog": {
            "log_bytes": pool.catalog.log_bytes,
            "snapshot_bytes": pool.catalog.snapshot_bytes,
            "frames": pool.catalog.frames,
            "owners": len(state.owners),
            "tombstones": len(state.tombstones),
            "dead_writers": len(state.dead_writers),
        },
        "totals": {
            "packs": len(packs),
            "bytes": sum(r["size"] for r in packs),
            "live_bytes": sum(r["live_bytes"] for r in packs),
            "dead_bytes": sum(r["dead_bytes"] for r in packs),
        },
        "packs": packs,
        "owners": owners,
        "queues": queues,
    }


def why(root: str | os.PathLike[str], pack: str) -> dict[str, Any]:
    """Why a pack is kept (``straw inspect --why``): ``CatalogState.why`` plus what is on disk.

    ``pack`` is pool-relative (``raw/<writer>/<segment>.pack``) or a path to the file.
    """
    pool = gather(root, scan=False)
    relative = _relative(pool.root, pack)
    state = pool.catalog.state
    on_disk = pool.on_disk
    if relative not in on_disk and relative not in state.packs and relative not in state.tombstones:
        raise UnknownPack(f"{pack} is not a pack of {pool.root} (neither on disk nor in its catalog)")
    answer = state.why(relative)
    answer["exists"] = relative in on_disk
    answer["size"] = on_disk.get(relative)
    writer = answer["writer"]
    answer["writer_alive"] = pool.alive.get(writer, not answer["writer_dead"])
    queues = [v.queue_id for v in pool.queues if relative in (pool.roots.get(v.directory) or _Empty).packs]
    answer["queues"] = queues
    answer["reasons"] = _reasons(answer)
    answer["retained"] = bool(answer["exists"]) and not answer["tombstoned"] and bool(answer["reasons"])
    return answer


class _Empty:
    packs: frozenset[str] = frozenset()


def _relative(root: str, pack: str) -> str:
    if os.path.isabs(pack) or pack.startswith("."):
        full = os.path.abspath(pack)
        if full.startswith(root + os.sep):
            return os.path.relpath(full, root).replace(os.sep, "/")
    return pack.strip("/")


def _reasons(answer: dict[str, Any]) -> list[str]:
    """Readable sentences: what keeps the pack (empty when nothing does)."""
    if answer["tombstoned"]:
        return []
    out = [f"owner {owner} reaches it" for owner in answer["owners"]]
    if not answer["sealed"]:
        out.append(
            "it is not sealed (its writer may still append; a collector seals it once the writer is dead)"
        )
    elif not answer["staging_over"]:
        out.append("its publications are still staged (not released, and the writer is alive)")
    out += [f"queue {q!r} still needs it" for q in answer["queues"] if not answer["owners"]]
    return out
