"""Everything check and inspect read from a pool, read once and in a safe order.

Queue journals are read before the catalog: a coordinator records ownership of
a reference in the catalog before its journal names it (G6), so a catalog read
after the journal covers every reference that journal read found (I16).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from .._catalog.collect import queue_directories
from .._queue.progress import parse_progress
from ..backend import FilesystemBackend
from ..errors import QueueError
from ..protocol import RecordRef, RecordSetRef
from ..store import ReadSession
from .catalog_view import CatalogView, read_catalog
from .layout import Layout, list_pool, open_pool, writer_alive
from .packs import PackScan, scan_pack
from .queue_view import QueueView, labelled_roots, load_queue, progress_ref, ref_key


@dataclass
class RootSet:
    """The packs one queue's roots reach, and the roots that could not be resolved."""

    refs: int = 0
    packs: set[str] = field(default_factory=set)
    unreadable: list[tuple[str, str]] = field(default_factory=list)  # (pack or "", message)
    unreadable_by: dict[tuple[str, str], set[str]] = field(default_factory=dict)  # -> names of roots
    reached_by: dict[str, set[str]] = field(default_factory=dict)  # pack -> names of roots reaching it

    def lost(self, pack: str, limit: int = 5) -> str:
        """The roots that reach ``pack``, for a message (at most ``limit`` named)."""
        names = sorted(self.reached_by.get(pack, ()))
        if not names:
            return "a queue reference"
        more = f" and {len(names) - limit} more" if len(names) > limit else ""
        return ", ".join(names[:limit]) + more


@dataclass
class Pool:
    root: str
    layout: Layout
    catalog: CatalogView
    queues: list[QueueView]
    scans: dict[str, PackScan] = field(default_factory=dict)
    unreadable: dict[str, str] = field(default_factory=dict)  # pack -> OS error text
    alive: dict[str, bool] = field(default_factory=dict)  # writer -> alive
    roots: dict[str, RootSet] = field(default_factory=dict)  # queue directory -> roots
    vanished: set[str] = field(default_factory=set)  # listed packs gone before they were scanned

    @property
    def on_disk(self) -> dict[str, int]:
        return {p.path: p.size for p in self.layout.packs if p.path not in self.vanished}


def gather(root: str | os.PathLike[str], *, scan: bool = True) -> Pool:
    """Read the pool; raises :class:`NotAPool` for a directory that is not one.

    Order matters beside live users: journals first (a coordinator owns before its journal
    names a reference, G6), then the catalog (ownership), then the listing of ``raw/`` (so a
    pack the catalog saw owned and a collector removed since is a pack a second pass does
    not see owned), then the packs (one collected while scanned is "vanished", not damaged).
    """
    path = open_pool(root)
    queues: list[QueueView] = []
    try:
        for directory in queue_directories(path):
            queues.append(load_queue(path, directory))
        return _gather(path, queues, scan)
    finally:
        # What the description needs from the queues' history files (their check, the roots)
        # is read by now: their descriptors are given up, or a process that checks or inspects
        # pools over and over would keep one per file. A caller that reads more closes again.
        close_histories(queues)


def close_histories(queues: list[QueueView]) -> None:
    """Give up the descriptors of the queues' history files (a later read opens them again)."""
    for view in queues:
        if view.state is not None:
            view.state.history.close()


def _gather(path: str, queues: list[QueueView], scan: bool) -> Pool:
    catalog, _ = read_catalog(path)
    layout = list_pool(path)
    pool = Pool(path, layout, catalog, queues)
    dead = catalog.state.dead_writers
    for pack in layout.packs:
        if pack.writer not in pool.alive:
            info = catalog.state.packs.get(pack.path)
            if info is None or not info.sealed or pack.writer in dead:
                pool.alive[pack.writer] = writer_alive(path, pack.writer, dead)
        if scan and pack.path not in catalog.state.tombstones:
            try:
                pool.scans[pack.path] = scan_pack(os.path.join(path, pack.path), pack.path)
            except FileNotFoundError:
                pool.vanished.add(pack.path)  # collected after the listing
            except OSError as error:
                pool.unreadable[pack.path] = error.strerror or str(error)
    for view in queues:
        if view.state is not None and view.run_id is not None:
            pool.roots[view.directory] = _resolve_roots(path, view)
    return pool


def _resolve_roots(root: str, view: QueueView) -> RootSet:
    """Resolve a queue's roots to packs as ``Coordinator.collect_garbage`` does, reading only indexes.

    Each distinct root reference is walked on its own so that every pack knows which roots
    reach it (``RootSet.reached_by``, named in messages about lost data).
    """
    out = RootSet()
    backend = FilesystemBackend(root, visibility_delays=())
    session = ReadSession(backend, view.run_id or "")
    try:
        refs, packs, by_ref, by_pack = labelled_roots(view, _acknowledgements(session, view, out))
        out.refs = len(refs) + len(packs)
        for pack in packs:
            _reach(out, pack, by_pack.get(pack, ["an accepted result"]))
        tops: dict[str, RecordSetRef] = {}
        for item in refs:
            try:
                tops.setdefault(ref_key(item), RecordSetRef.from_dict(item))
            except (KeyError, TypeError, ValueError) as error:
                out.unreadable.append(("", f"a root reference is malformed ({error!r})"))
        for key, top in tops.items():
            _walk(session, top, by_ref.get(key, [f"reference {key}"]), out)
    finally:
        session.close()
    return out


def _reach(out: RootSet, pack: str, names: list[str]) -> None:
    out.packs.add(pack)
    out.reached_by.setdefault(pack, set()).update(names)


def _walk(session: ReadSession, top: RecordSetRef, names: list[str], out: RootSet) -> None:
    """Every pack one root reference reaches (its manifest, records and dependencies)."""
    seen: set[tuple[str, int, int]] = set()
    todo: list[Any] = [top]
    while todo:
        ref = todo.pop()
        try:
            if isinstance(ref, RecordRef):
                session.locate(ref)
                _reach(out, ref.segment.path, names)
                continue
            key = (ref.manifest.segment.path, ref.manifest.segment.offset, ref.manifest.ordinal)
            if key in seen:
                continue
            seen.add(key)
            resolved = session.resolve(ref)
        except (QueueError, OSError) as error:
            path = ref.segment.path if isinstance(ref, RecordRef) else ref.manifest.segment.path
            _reach(out, path, names)
            if (path, str(error)) not in out.unreadable:
                out.unreadable.append((path, str(error)))
            out.unreadable_by.setdefault((path, str(error)), set()).update(names)
            continue
        _reach(out, ref.manifest.segment.path, names)
        for record in resolved.records:
            _reach(out, record.segment.path, names)
        todo.extend(resolved.dependencies)


def _acknowledgements(session: ReadSession, view: QueueView, out: RootSet) -> tuple[set[int], set[str]]:
    """Positions and batches the training consumer's progress record acknowledges.

    Read with the coordinator's own parser (``parse_progress``): a record it would refuse is
    a finding here, never a crash, and acknowledges nothing (every result stays a root).
    """
    ref = progress_ref(view)
    if ref is None:
        return set(), set()
    path = ""
    try:
        top = RecordSetRef.from_dict(ref)
        path = top.manifest.segment.path
        return parse_progress(list(session.read(top)))
    except (QueueError, OSError, KeyError, TypeError, ValueError) as error:
        out.unreadable.append((path, f"the training consumer's progress record cannot be used: {error}"))
        return set(), set()
