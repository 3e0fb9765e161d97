"""Offline inspection of a stopped pool and explicit cleanup of its orphans (the peer's API).

``inspect_run(root)`` reads a pool whose one queue lives at the pool root and reports
what its journal names (conservatively: every reference the queue's state holds, finished
tasks and acknowledged results included), what is on disk that nothing names, and whether
anything named is missing or damaged. ``cleanup_orphans(root, report,
all_participants_stopped=True)`` deletes the orphans of such a report, only if a fresh
inspection gives the same report and allows deletion.

This is the tool for pools that are not collected online. A pool whose writers use
``online_gc=True`` (its catalog records their seals, owners or tombstones, or a writer's
``LIVE`` note says so) or that holds namespaced queues is refused with ``UnsafeRecovery``:
there ``Coordinator.collect_garbage`` and ``straw check`` decide, with every owner's say.
Neither function takes the queue's lock: the caller vouches that the run is stopped.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from typing import Any

from ._catalog.log import Catalog
from ._fs import posix
from ._inspect.gather import Pool, close_histories, gather
from ._inspect.layout import LIVE_FILE, NotAPool
from ._inspect.queue_view import QueueView
from ._queue.machine import task_from_row
from .backend import FilesystemBackend
from .errors import InvalidReference, QueueError, UnsafeRecovery
from .protocol import RecordRef, RecordSetRef, as_dict, decode
from .store import ReadSession

__all__ = ["cleanup_orphans", "inspect_run"]

REPORT_VERSION = 1


def inspect_run(root: str | os.PathLike[str]) -> dict[str, Any]:
    """Report what a stopped pool's queue retains and which packs nobody names (see module doc)."""
    try:
        pool = gather(root)
    except NotAPool as error:
        raise InvalidReference(str(error)) from None
    _require_offline(pool)
    view = pool.queues[0] if pool.queues else None
    retained: set[str] = set()
    failures: list[dict[str, str]] = []
    if view is not None:
        try:
            _journal_roots(pool, view, retained, failures)
        finally:
            close_histories(pool.queues)
    for packs in pool.catalog.state.owners.values():
        retained |= packs
    on_disk = pool.on_disk
    for pack in sorted(retained):
        scan = pool.scans.get(pack)
        if pack not in on_disk:
            failures.append({"root": pack, "error": "StorageUnavailable", "message": f"{pack} is missing"})
        elif pack in pool.unreadable:
            failures.append({"root": pack, "error": "StorageUnavailable", "message": pool.unreadable[pack]})
        elif scan is not None:
            failures += [
                {"root": pack, "error": "CorruptData", "message": text}
                for _, severity, text in scan.problems
                if severity == "error"
            ]
    orphans = sorted(p for p in on_disk if p not in retained)
    sealed = [p for p in orphans if (scan := pool.scans.get(p)) is not None and scan.sealed]
    tail = _tail_bytes(pool, view)
    return {
        "version": REPORT_VERSION,
        "run_id": view.run_id if view is not None else None,
        "retained_paths": sorted(retained),
        "unaccepted_sealed": sealed,
        "partial": sorted([p for p in orphans if p not in sealed] + pool.layout.temps),
        "retained_dependency_errors": failures,
        "incomplete_journal_tail_bytes": tail,
        "journal_sha256": _journal_digest(pool.root, view),
        "deletion_allowed": not failures and not tail,
        "requires_stopped_run": True,
    }


def cleanup_orphans(
    root: str | os.PathLike[str], report: dict[str, Any], *, all_participants_stopped: bool
) -> list[str]:
    """Delete the orphans ``report`` lists, once a fresh inspection confirms it; returns them.

    Each pack is tombstoned in the catalog before it is unlinked (G4), so nothing can
    retain it again; temporary files are simply removed.
    """
    if all_participants_stopped is not True:
        raise UnsafeRecovery(
            "offline cleanup needs the coordinator, every writer and every reader stopped; "
            "say so with all_participants_stopped=True"
        )
    current = inspect_run(root)
    if current != report or not current["deletion_allowed"]:
        raise UnsafeRecovery(
            "the pool changed since the report, or the report does not allow deletion (missing or "
            "damaged retained data, or a torn journal tail); nothing was deleted"
        )
    paths = list(current["unaccepted_sealed"]) + list(current["partial"])
    backend = FilesystemBackend(root)
    packs = [p for p in paths if not p.endswith(".tmp")]
    catalog = Catalog(backend)
    try:
        with catalog.locked() as cat:
            if packs:
                cat.append([{"op": "tombstone", "packs": packs}])  # G4.1 before any unlink
            touched: set[str] = set()
            for relative in paths:
                path = backend.resolve(relative)
                with contextlib.suppress(FileNotFoundError):  # G4.3: gone already
                    posix.unlink(path)
                touched.add(os.path.dirname(path))
            for directory in sorted(touched):  # G4.2: one sync per directory, as online GC does
                backend.sync_dir(directory)
            if packs:
                cat.append([{"op": "reclaimed", "packs": packs}])
    except OSError as error:
        raise posix.storage_error(error, f"deleting orphans of {backend.root}") from error
    finally:
        catalog.close()
    return paths


# --------------------------------------------------------------------------- helpers


def _require_offline(pool: Pool) -> None:
    """Refuse pools collected online or shared by several queues (see the module doc)."""
    if any(q != "queue" for q in pool.layout.queues):
        raise UnsafeRecovery(
            "this pool holds namespaced queues sharing its packs; the offline inspector handles one "
            "queue at the pool root: use Coordinator.collect_garbage (the pool's catalog) instead"
        )
    state = pool.catalog.state
    online = (
        bool(state.tombstones)
        or any(not owner.startswith("queue:") for owner in state.owners)
        or any(info.sealed and info.extents is not None for info in state.packs.values())
        or any(_live_note(pool.root, writer).get("online_gc") for writer in pool.layout.writers)
    )
    if online:
        raise UnsafeRecovery(
            "this pool is collected online through its catalog (online_gc writers, owners or "
            "tombstones); the offline inspector cannot delete from it: use "
            "Coordinator.collect_garbage or straw check"
        )


def _live_note(root: str, writer: str) -> dict[str, Any]:
    try:
        text = posix.read_file(os.path.join(root, "raw", writer, LIVE_FILE), 4096)
        note = decode(text) if text else {}
    except (OSError, QueueError):
        return {}
    return note if isinstance(note, dict) else {}


def _journal_roots(pool: Pool, view: QueueView, retained: set[str], failures: list[dict[str, str]]) -> None:
    """Every pack a reference in the queue's state reaches (the state holds the whole history
    that matters: inputs of every task, every accepted result, consumers, batches, checkpoints)."""
    state = view.state
    if state is None:
        failures.append(
            {"root": view.directory, "error": "CorruptData", "message": "the journal cannot be read"}
        )
        return
    refs: list[dict[str, Any]] = [as_dict(t.spec.input_ref) for t in state.tasks.values() if t.spec.input_ref]
    for row in state.history.task_rows():  # finished tasks in history files (their inputs too)
        spec = task_from_row(row, state).spec
        if spec.input_ref is not None:
            refs.append(as_dict(spec.input_ref))
    for inputs in state.read_inputs.values():
        refs += inputs
    for position in range(len(state.commits)):
        refs.append(state.commits[position]["result_ref"])
        retained.update(state.packs_at(position))
    # The ledger's roots with no batch counted as finished: every batch's references too.
    state.ledger.roots(frozenset(), lambda label, ref: refs.append(ref))
    backend = FilesystemBackend(pool.root, visibility_delays=())
    session = ReadSession(backend, view.run_id or "")
    try:
        seen: set[tuple[str, int, int]] = set()
        for item in refs:
            _walk(session, item, seen, retained, failures)
    finally:
        session.close()


def _walk(
    session: ReadSession,
    item: dict[str, Any],
    seen: set[tuple[str, int, int]],
    retained: set[str],
    failures: list[dict[str, str]],
) -> None:
    todo: list[Any] = [item]
    while todo:
        entry = todo.pop()
        try:
            ref = RecordSetRef.from_dict(entry) if isinstance(entry, dict) else entry
            key = (ref.manifest.segment.path, ref.manifest.segment.offset, ref.manifest.ordinal)
            if key in seen:
                continue
            seen.add(key)
            retained.add(ref.manifest.segment.path)
            resolved = session.resolve(ref)
        except (QueueError, OSError, KeyError, TypeError, ValueError) as error:
            path = _path_of(entry)
            if path:
                retained.add(path)  # a damaged root never makes its pack look like an orphan
            failures.append({"root": path, "error": type(error).__name__, "message": str(error)})
            continue
        for record in resolved.records:
            retained.add(record.segment.path)
        todo.extend(resolved.dependencies)


def _path_of(entry: Any) -> str:
    if isinstance(entry, (RecordSetRef, RecordRef)):
        segment = entry.manifest.segment if isinstance(entry, RecordSetRef) else entry.segment
        return str(segment.path)
    try:
        return str(entry["manifest"]["segment"]["path"])
    except (KeyError, TypeError):
        return ""


def _tail_bytes(pool: Pool, view: QueueView | None) -> int:
    """Bytes after the journal's last complete frame that are not zeros written ahead."""
    tail = view.journal.tail if view is not None else None
    if tail is None or tail.kind == "zeros":
        return 0
    try:
        data = posix.read_file(os.path.join(pool.root, tail.path))
    except OSError:
        return 0
    # A closed segment ends in zeros (DURABILITY.md J7); bytes written after them are the tail.
    return len(data[tail.offset :].lstrip(b"\0"))


def _journal_digest(root: str, view: QueueView | None) -> str:
    """SHA-256 over the queue's snapshot and segment files, in order (the report's identity)."""
    digest = hashlib.sha256()
    if view is None:
        return digest.hexdigest()
    for sub in ("snap", "wal"):
        directory = os.path.join(root, view.directory, sub)
        try:
            names = sorted(posix.listdir(directory))
        except FileNotFoundError:
            continue
        for name in names:
            digest.update(name.encode())
            digest.update(posix.read_file(os.path.join(directory, name)))
    return digest.hexdigest()
