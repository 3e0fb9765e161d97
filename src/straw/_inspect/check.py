"""``straw check``: verify a pool and, with ``fix``, make only repairs that lose nothing acknowledged.

docs/CHECK.md lists every finding code, what ``--fix`` does about it and why
that cannot lose acknowledged data. Without ``fix`` nothing in the pool
changes (locks are taken only the way every client takes them: the catalog's
for a consistent read, a dead writer's ``LIVE`` lock for a moment to tell it is
dead).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import asdict, dataclass, field

from .._catalog.log import Catalog
from .._catalog.state import CatalogState
from .._fs import durable, lock, posix
from .._journal import frame as journal_frame
from .._pack import frame as pack_frame
from ..backend import FilesystemBackend
from ..coordinator import IDENTITY_FILE, LOCK_FILE
from ..errors import QueueError
from ..limits import LOG_CLOSE_ZEROS
from .catalog_view import CatalogView, _load, catalog_lock, read_catalog
from .gather import Pool, RootSet, gather
from .journal_scan import Tail, scan_journal
from .layout import NotAPool
from .queue_view import QueueView

__all__ = ["ERROR", "INFO", "REPAIRABLE", "CheckReport", "Finding", "NotAPool", "check_pool"]

ERROR, REPAIRABLE, INFO = "error", "repairable", "info"


@dataclass(frozen=True)
class Finding:
    """One thing ``check`` noticed, with a stable dotted ``code`` (docs/CHECK.md)."""

    code: str
    severity: str  # error | repairable | info
    path: str  # pool-relative ("" for the pool)
    message: str
    repair: str | None = None
    #: For findings about a queue's roots: the roots that reach the pack (how two passes agree).
    roots: tuple[str, ...] = ()

    def agrees(self, other: Finding) -> bool:
        """The same problem seen by another pass: same code and path, and, for a queue root,
        at least one root in common (a result acknowledged meanwhile is a different root)."""
        if (self.code, self.path) != (other.code, other.path):
            return False
        return not (self.roots and other.roots) or bool(set(self.roots) & set(other.roots))


@dataclass
class CheckReport:
    """What a check found (before repairs) and what ``fix`` repaired."""

    root: str
    findings: list[Finding]
    repaired: list[Finding]
    run_ids: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when no finding of severity error or repairable remains unrepaired."""
        return not self.remaining()

    def remaining(self) -> list[Finding]:
        done = set(self.repaired)
        return [f for f in self.findings if f.severity != INFO and f not in done]

    @property
    def foreign(self) -> bool:
        """True when something in the pool belongs to another run than the one asked about."""
        return any(f.code == "pool.foreign_run" for f in self.findings)

    def to_json(self) -> dict[str, object]:
        return {
            "root": self.root,
            "ok": self.ok,
            "run_ids": list(self.run_ids),
            "findings": [asdict(f) for f in self.findings],
            "repaired": [asdict(f) for f in self.repaired],
            "remaining": len(self.remaining()),
        }


def _finding(problem: tuple[str, str, str, str], repair: str | None = None) -> Finding:
    code, severity, path, message = problem
    return Finding(code, severity, path, message, repair)


def check_pool(root: str | os.PathLike[str], *, fix: bool = False, run_id: str | None = None) -> CheckReport:
    """Check every pack, journal and catalog frame and the ownership of every root.

    Raises :class:`NotAPool` when ``root`` is not a pool. Safe beside live
    writers and coordinators; with ``fix`` it repairs only what docs/CHECK.md
    lists as repairable, never touching the journal of a queue whose coordinator is alive.
    """
    pool, findings, claims = _examine(root, run_id)
    if any(f.severity != INFO for f in findings):
        # Beside live users a pass can meet a pack collected, a segment replaced or a frame
        # being written after it read what pointed there. Damage stays put: only what a
        # second, fresh pass finds again (same code and path) is reported (docs/CHECK.md).
        first = [f for f in findings if f.severity != INFO]
        pool, findings, claims = _examine(root, run_id)
        findings = [f for f in findings if f.severity == INFO or any(f.agrees(g) for g in first)]
        claims = {f: o for f, o in claims.items() if f in findings}
    repaired = _repair(pool, findings, claims) if fix else []
    run_ids = sorted({v.run_id for v in pool.queues if v.run_id is not None})
    return CheckReport(pool.root, findings, repaired, run_ids)


def _examine(
    root: str | os.PathLike[str], run_id: str | None
) -> tuple[Pool, list[Finding], dict[Finding, str]]:
    """One pass: read the pool, and every finding about it (nothing is changed)."""
    pool = gather(root)
    catalog_repair = "zero the torn frame under catalog/LOCK (what the next lock holder does, G2)"
    findings = [_finding(p, catalog_repair if p[1] == REPAIRABLE else None) for p in pool.catalog.problems]
    findings += _pack_findings(pool, run_id)
    findings += _owner_findings(pool)
    findings += _queue_owner_findings(pool)
    claims: dict[Finding, str] = {}  # root.unowned finding -> the queue owner that should reach it
    for view in pool.queues:
        findings += _queue_findings(pool, view, run_id, claims)
    return pool, findings, claims


# --------------------------------------------------------------------------- packs


def _pack_findings(pool: Pool, run_id: str | None) -> list[Finding]:
    out: list[Finding] = []
    state = pool.catalog.state
    tag = pack_frame.run_tag(run_id) if run_id is not None else None
    for pack in pool.layout.packs:
        if pack.path in state.tombstones:
            out.append(
                Finding(
                    "pack.tombstoned_present",
                    REPAIRABLE,
                    pack.path,
                    f"{pack.path} was tombstoned but is still on disk (a collection stopped between "
                    "its tombstone and the unlink)",
                    "unlink it: its tombstone is durable, so nothing may reference it (I14, I15)",
                )
            )
            continue
        if pack.path in pool.unreadable:
            out.append(
                Finding(
                    "pack.unreadable",
                    ERROR,
                    pack.path,
                    f"{pack.path} cannot be read: {pool.unreadable[pack.path]}",
                )
            )
            continue
        scan = pool.scans.get(pack.path)
        if scan is None:
            continue
        for code, severity, message in scan.problems:
            out.append(Finding(code, severity, pack.path, message))
        if tag is not None and scan.header is not None and scan.header.run_tag != tag:
            out.append(
                Finding(
                    "pool.foreign_run",
                    ERROR,
                    pack.path,
                    f"{pack.path} was written by another run than {run_id!r}",
                )
            )
        out += _seal_findings(
            pool, pack.path, pack.writer, scan.sealed, {e.index_offset for e in scan.extents}
        )
    out += _link_findings(pool)
    for temp in pool.layout.temps:
        out.append(
            Finding(
                "pack.temp", INFO, temp, f"{temp} is a temporary file (a write in progress or a crashed one)"
            )
        )
    for stray in pool.layout.strays:
        out.append(Finding("pool.stray", INFO, stray, f"{stray} is not a file straw writes"))
    return out


def _link_findings(pool: Pool) -> list[Finding]:
    """straw never writes a link under raw/: one is a bad copy or tampering (one leading out
    of the pool is refused by every read, D5.1)."""
    out = []
    base = posix.realpath(pool.root)
    packs = set(pool.on_disk)
    for path in pool.layout.links:
        target = posix.realpath(os.path.join(pool.root, path))
        where = "outside the pool" if not target.startswith(base + os.sep) else "elsewhere in the pool"
        what = "reads refuse one that leaves the pool" if path in packs else "writes would go through it"
        out.append(
            Finding(
                "pack.symlink" if path in packs else "pool.symlink",
                ERROR,
                path,
                f"{path} is a symbolic link to {where} ({target}); straw never writes links, and {what}: "
                "restore the file itself",
            )
        )
    return out


def _seal_findings(pool: Pool, path: str, writer: str, sealed: bool, offsets: set[int]) -> list[Finding]:
    info = pool.catalog.state.packs.get(path)
    out = []
    if info is not None and info.sealed and info.extents is not None and not sealed:
        # The writer records its seal in the catalog only after the seal frame is durable (D4).
        out.append(
            Finding(
                "pack.missing_seal",
                ERROR,
                path,
                f"{path}: the catalog recorded its writer's seal, but the pack ends without its seal "
                "frame: it was cut short (extents after the cut are lost)",
            )
        )
    if info is not None and info.sealed and info.extents is not None:
        missing = sorted(set(info.extents) - offsets)
        if missing:
            out.append(
                Finding(
                    "pack.missing_extent",
                    ERROR,
                    path,
                    f"{path}: the catalog recorded extents at offsets {missing} that the pack "
                    "no longer holds",
                )
            )
    if not sealed and (info is None or not info.sealed):
        if pool.alive.get(writer, True):
            out.append(Finding("pack.open", INFO, path, f"{path} is the open pack of a live writer"))
        else:
            out.append(
                Finding(
                    "pack.unsealed_dead",
                    INFO,
                    path,
                    f"{path} was left unsealed by a writer that died; the next collection "
                    "seals it in the catalog",
                )
            )
    return out


# --------------------------------------------------------------------------- owners


def _owner_findings(pool: Pool) -> list[Finding]:
    state: CatalogState = pool.catalog.state
    if not pool.catalog.complete:
        return []  # ownership is unknown past catalog damage (already reported)
    on_disk = pool.on_disk
    out = []
    for owner in sorted(state.owners):
        for path in sorted(state.owners[owner]):
            scan = pool.scans.get(path)
            if path in on_disk and path not in state.tombstones and scan is not None and not scan.extents:
                # An owner reaches a pack only through a reference to a complete extent, so a
                # reached pack without one lost what the owner retained (a truncated or damaged
                # pack, e.g. a dead writer's unsealed pack cut to its header).
                message = (
                    f"owner {owner!r} reaches {path}, which holds no complete extent any more: what "
                    "the owner retained there is gone (restore the pack)"
                )
                out.append(Finding("owner.lost_extents", ERROR, path, message))
                continue
            if path in on_disk and path not in state.tombstones:
                continue
            if path in state.tombstones:
                message = f"owner {owner!r} reaches {path}, which was garbage-collected (I15 broken)"
            else:
                message = f"owner {owner!r} reaches {path}, which is not on disk"
            out.append(Finding("owner.missing_pack", ERROR, path, message))
    return out


def _queue_owner_findings(pool: Pool) -> list[Finding]:
    """I20, I21: every queue's owner is in the catalog, and every queue owner has its queue."""
    state = pool.catalog.state
    if not pool.catalog.complete or not pool.catalog.present:
        return []
    out = []
    known = set()
    for view in pool.queues:
        owner = view.owner()
        if owner is None:
            continue
        known.add(owner)
        if owner not in state.owners and view.journal.last_seq > 0:
            out.append(
                Finding(
                    "catalog.lost_owner",
                    ERROR,
                    f"{view.directory}/{IDENTITY_FILE}",
                    f"queue {view.queue_id!r} in {view.directory} has a journal, but the catalog does not "
                    f"know its owner {owner}: the catalog lost events (a truncated or older copy), so "
                    "it may have lost other owners too. Collection refuses; restore the catalog or "
                    "rebuild it (straw check --rebuild-catalog, docs/CHECK.md)",
                )
            )
    if any(view.unidentified for view in pool.queues):
        return out  # a queue without queue.json: its owner cannot be named, so none is "lost"
    for owner in sorted(o for o in state.owners if o.startswith("queue:") and o not in known):
        reach = len(state.owners[owner])
        out.append(
            Finding(
                "queue.lost",
                ERROR,
                "",
                f"catalog owner {owner} reaches {reach} pack(s), but no queue directory of the pool "
                "uses it: an earlier queue's files were removed. Its data is kept; to start a new "
                'queue there, open it with abandon_lost_queue=True (docs/QUEUE.md "Lost queues"), '
                f"or give the data up with straw check --forget-owner {owner}",
            )
        )
    return out


# --------------------------------------------------------------------------- queues


def _queue_findings(
    pool: Pool, view: QueueView, run_id: str | None, claims: dict[Finding, str]
) -> list[Finding]:
    out = [_finding(p) for p in view.problems]
    if run_id is not None and view.run_id is not None and view.run_id != run_id:
        out.append(
            Finding(
                "pool.foreign_run",
                ERROR,
                view.directory,
                f"queue {view.queue_id!r} in {view.directory} belongs to run {view.run_id!r}, not {run_id!r}",
            )
        )
    tail = view.journal.tail
    if tail is not None and tail.kind == "torn":
        if _settled(pool.root, view, tail):
            out.append(
                Finding(
                    "journal.torn_tail",
                    REPAIRABLE,
                    tail.path,
                    f"{tail.path}: {tail.reason} at offset {tail.offset} (a final frame whose write never "
                    "completed, so never acknowledged)",
                    "zero the segment from there, as recovery does (J4.3); "
                    "skipped while a coordinator holds the queue",
                )
            )
        else:
            out.append(Finding("journal.live_tail", INFO, tail.path, f"{tail.path} is being written"))
    elif tail is not None and tail.kind == "zeros" and tail.after > LOG_CLOSE_ZEROS:
        # A closed segment keeps LOG_CLOSE_ZEROS zeros after its frames (J7): only more is news.
        out.append(
            Finding(
                "journal.zero_tail",
                INFO,
                tail.path,
                f"{tail.path} ends with {tail.after} bytes of zero-filled space after its last frame "
                "(J1.1: a live coordinator's, or a crashed one's)",
            )
        )
    roots = pool.roots.get(view.directory)
    if roots is None or not pool.catalog.complete:
        return out
    for path, message in roots.unreadable:
        out.append(
            Finding(
                "root.unreadable",
                ERROR,
                path,
                f"queue {view.queue_id!r} names data it cannot read: {message}",
                roots=tuple(sorted(roots.unreadable_by.get((path, message), ()))),
            )
        )
    return out + _root_findings(pool, view, roots, claims)


def _root_findings(pool: Pool, view: QueueView, roots: RootSet, claims: dict[Finding, str]) -> list[Finding]:
    """Packs the queue needs that are gone, or that its owner does not reach (I16)."""
    out = []
    owner = view.owner() or ""
    owned = pool.catalog.state.owners.get(owner, set())
    tombstones = pool.catalog.state.tombstones
    on_disk = pool.on_disk
    queue = f"queue {view.queue_id!r}"
    for path in sorted(roots.packs):
        lost = f"lost: {roots.lost(path)}"
        names = tuple(sorted(roots.reached_by.get(path, ())))
        if path not in on_disk:
            how = "was garbage-collected" if path in tombstones else "is gone"
            message = f"{queue} still needs {path}, which {how}; {lost}"
            out.append(Finding("root.missing_pack", ERROR, path, message, roots=names))
        elif path in tombstones:
            message = (
                f"{queue} needs {path} but it was garbage-collected (tombstoned; it can never be "
                f"retained again, I15); {lost}"
            )
            out.append(Finding("root.unowned", ERROR, path, message, roots=names))
        elif path not in owned:
            finding = Finding(
                "root.unowned",
                REPAIRABLE,
                path,
                f"{queue} needs {path} ({roots.lost(path)}) but its owner {owner} does not reach it (I16)",
                "record it under the queue's owner (an add event under catalog/LOCK, refusing tombstoned "
                "packs): retains more, never less",
                roots=names,
            )
            claims[finding] = owner
            out.append(finding)
    return out


def _settled(root: str, view: QueueView, tail: Tail) -> bool:
    """Read the journal again: a tail that changed in between is a live coordinator's write."""
    if view.identity is None:
        return True
    tag = journal_frame.identity_tag(view.identity["run_id"], view.identity["queue_id"])
    again = scan_journal(root, view.directory, tag).tail
    return again is not None and (again.path, again.offset, again.kind) == (tail.path, tail.offset, tail.kind)


# --------------------------------------------------------------------------- repairs


def _repair(pool: Pool, findings: list[Finding], claims: dict[Finding, str]) -> list[Finding]:
    repaired: list[Finding] = []
    torn = [f for f in findings if f.code == "catalog.torn_tail"]
    if torn:
        # Read again under catalog/LOCK and zero only a torn tail still there (G2).
        _, done = read_catalog(pool.root, fix=True)
        if done:
            repaired += torn
    if claims:
        repaired += _own_roots(pool.root, claims)
    tombstoned = [f for f in findings if f.code == "pack.tombstoned_present"]
    if tombstoned:
        repaired += _unlink_tombstoned(pool.root, tombstoned)
    for finding in findings:
        if finding.code == "journal.torn_tail":
            view = next(v for v in pool.queues if finding.path.startswith(v.directory + "/"))
            if _cut_journal(pool.root, view):
                repaired.append(finding)
    return repaired


def _own_roots(root: str, claims: dict[Finding, str]) -> list[Finding]:
    """Record unowned queue roots under their queue's owner, as the store's ``_own`` does (G3).

    Under ``catalog/LOCK`` with the state caught up, a pack is added only when it is not
    tombstoned and still on disk; the others stay errors. Adding retains more, never less,
    so it is safe beside a live coordinator (its next collection replaces the set with
    exactly its roots). A catalog that cannot be locked or read leaves every finding.
    """
    done: list[Finding] = []
    catalog = Catalog(FilesystemBackend(root, visibility_delays=()))
    try:
        with catalog.locked() as held:
            wanted: dict[str, set[str]] = {}
            for finding, owner in claims.items():
                path = finding.path
                if path in held.state.tombstones or not posix.exists(os.path.join(root, path)):
                    continue
                if path not in held.state.owners.get(owner, set()):
                    wanted.setdefault(owner, set()).add(path)
                done.append(finding)
            events = [{"op": "add", "owner": o, "packs": sorted(p)} for o, p in sorted(wanted.items())]
            if events:
                held.append(events)
    except (QueueError, OSError):
        return []
    finally:
        catalog.close()
    return done


def _unlink_tombstoned(root: str, findings: list[Finding]) -> list[Finding]:
    """Finish interrupted unlinks (G4.2) under the catalog lock, after reading the tombstones again."""
    done = []
    with catalog_lock(root, create=True):
        view = CatalogView(present=True)
        _load(root, view)
        directories = set()
        for finding in findings:
            if finding.path not in view.state.tombstones:
                continue
            with contextlib.suppress(FileNotFoundError):
                posix.unlink(os.path.join(root, finding.path))
            directories.add(os.path.dirname(os.path.join(root, finding.path)))
            done.append(finding)
        for directory in sorted(directories):
            posix.sync_dir(directory)
    return done


def _cut_journal(root: str, view: QueueView) -> bool:
    """Cut a torn journal tail while holding the queue's lock; False if a coordinator holds it."""
    fd = lock.try_lock_exclusive(os.path.join(root, view.directory, LOCK_FILE))
    if fd is None:
        return False
    try:
        if view.identity is None:
            return False
        tag = journal_frame.identity_tag(view.identity["run_id"], view.identity["queue_id"])
        tail = scan_journal(root, view.directory, tag).tail
        if tail is None or tail.kind != "torn":
            return False
        durable.zero_tail(os.path.join(root, tail.path), tail.offset, posix.sync_file)
        return True
    finally:
        lock.unlock(fd)
