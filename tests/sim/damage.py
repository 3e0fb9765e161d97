"""The simulation's damage steps (issue 11): a metadata file of the powered-off pool is damaged.

At a random point the machine loses power; then, on a copy of the in-memory disk (the run
itself goes on from the undamaged disk), one metadata file is deleted, cut short, or given a
flipped byte: the catalog log or snapshot, ``queue.json``, a journal segment or snapshot, a
writer's ``LIVE`` file, or a pack's header. On that copy (all through ``straw._fs``):

* ``straw check`` must report a finding, unless the damage is one docs/CHECK.md lists as
  harmless (a ``LIVE`` file deleted; a log cut inside the zeros after its frames) or the
  documented blind spot (a flipped byte in a log's very last frame: a repairable torn tail);
* recovery (a store and ``Coordinator(recover=True)``) raises only straw errors;
* no collection makes an acknowledged publication or accepted result unreadable: whatever
  the model requires and read back after the damage still reads back after collecting.
"""

from __future__ import annotations

import contextlib
import copy
import os
import random
from dataclasses import dataclass

from queue_helpers import unwitnessed
from straw import Coordinator, SharedFilesystemStore
from straw._fs.system import installed
from straw._inspect.check import check_pool
from straw._inspect.layout import NotAPool
from straw._pack import frame as pframe
from straw.backend import FilesystemBackend
from straw.errors import QueueError
from straw.limits import LOG_END_ZEROS_MIN
from straw.protocol import RecordSetRef
from straw.testing import FaultFS

OPS = ("delete", "truncate", "flip")
TORN_OR_CORRUPT = {"journal.torn_tail", "catalog.torn_tail", "journal.corrupt_frame", "catalog.corrupt_frame"}


@dataclass(frozen=True)
class Damage:
    path: str
    kind: str
    op: str
    at: int


def _files(fs: FaultFS, root: str) -> list[tuple[str, str]]:
    """(path, kind) of every metadata file the pool holds now."""
    out: list[tuple[str, str]] = []

    def listing(path: str) -> list[str]:
        try:
            return sorted(fs.listdir(path))
        except OSError:
            return []

    for name in listing(f"{root}/catalog"):
        if name in ("log", "snapshot"):
            out.append((f"{root}/catalog/{name}", f"catalog-{name}"))
    queue = f"{root}/queue"
    if fs.exists(f"{queue}/queue.json"):
        out.append((f"{queue}/queue.json", "queue-identity"))
    segments = [f"{queue}/wal/{n}" for n in listing(f"{queue}/wal") if n.endswith(".wal")]
    out += [(p, "journal-newest" if p == segments[-1] else "journal-older") for p in segments]
    out += [
        (f"{queue}/snap/{n}", "journal-snapshot") for n in listing(f"{queue}/snap") if n.endswith(".snap")
    ]
    for writer in listing(f"{root}/raw"):
        for name in listing(f"{root}/raw/{writer}"):
            path = f"{root}/raw/{writer}/{name}"
            if name == "LIVE":
                out.append((path, "live"))
            elif name.endswith((".pack", ".seg")) and not name.startswith("."):
                out.append((path, "pack-header"))
    return out


def choose(fs: FaultFS, root: str, rng: random.Random) -> Damage | None:
    files = _files(fs, root)
    if not files:
        return None
    path, kind = rng.choice(files)
    size = len(fs.read_bytes(path))
    op = rng.choice(OPS if size else ("delete",))
    if kind == "pack-header" and op != "delete":
        at = rng.randrange(min(size, pframe.PACK_HEADER_BYTES))
    else:
        at = rng.randrange(size) if size else 0
    return Damage(path, kind, op, at)


def expectation(damage: Damage, pristine: bytes, needed: set[str]) -> str:
    """``finding`` (check must not say ok), ``harmless`` or ``torn`` (the documented blind spot).

    ``needed``: packs that acknowledged data the model requires lives in. Deleting another
    pack is deleting garbage (every writer died with the machine, so nothing stages it).
    """
    if damage.kind == "live" and damage.op in ("delete", "truncate", "flip"):
        return "harmless"  # a writer without LIVE counts as alive; its note decides nothing
    if damage.kind == "pack-header" and damage.op == "delete" and damage.path not in needed:
        return "harmless"
    if damage.kind == "journal-older" and damage.op == "truncate" and damage.at >= unwitnessed(pristine)[1]:
        return "harmless"  # an older segment's zeros (a crash before the cut, J5.2): no frame lost
    if damage.kind in ("journal-newest", "catalog-log") and damage.op in ("truncate", "flip"):
        start, end = unwitnessed(pristine)
        if damage.op == "truncate" and damage.at >= end + LOG_END_ZEROS_MIN:
            return "harmless"
        if damage.op == "flip" and start <= damage.at < end:
            return "torn"
    return "finding"


def apply(fs: FaultFS, damage: Damage) -> None:
    if damage.op == "delete":
        fs.unlink(damage.path)
        return
    flags = os.O_WRONLY
    fd = fs.open(damage.path, flags)
    try:
        if damage.op == "truncate":
            fs.ftruncate(fd, damage.at)
        else:
            byte = fs.read_bytes(damage.path)[damage.at]
            fs.pwritev(fd, [bytes([byte ^ 0x5A])], damage.at)
        fs.fdatasync(fd)
    finally:
        fs.close(fd)


def _readable(root: str, run: str, refs: dict[str, tuple[RecordSetRef, bytes]]) -> set[str]:
    try:
        store = SharedFilesystemStore(
            root, run, backend=FilesystemBackend(root, sleep=lambda _: None, visibility_delays=())
        )
    except QueueError:
        return set()
    out = set()
    with store:
        for name, (ref, payload) in refs.items():
            try:
                if [bytes(r.payload) for r in store.read(ref)] == [payload]:
                    out.add(name)
            except QueueError:
                continue
    return out


def assess(
    fs: FaultFS, root: str, run: str, rng: random.Random, refs: dict[str, tuple[RecordSetRef, bytes]]
) -> str:
    """Damage a copy of ``fs`` (powered off and rebooted) and check the outcomes; a note for the trace.

    Raises AssertionError with the reason when straw fails one of the module's rules.
    """
    scratch = copy.deepcopy(fs)
    damage = choose(scratch, root, rng)
    if damage is None:
        return "damage: nothing to damage"
    with installed(scratch):
        pristine = scratch.read_bytes(damage.path)
        apply(scratch, damage)
        needed = {f"{root}/{ref.manifest.segment.path}" for ref, _ in refs.values()}
        wanted = expectation(damage, pristine, needed)
        try:
            report = check_pool(root)
            ok, codes = report.ok, {f.code for f in report.findings if f.severity != "info"}
        except NotAPool:
            ok, codes = False, {"not-a-pool"}
        if wanted == "finding" and ok:
            raise AssertionError(f"straw check said ok over {damage}")
        # The blind spot is reported as a torn tail; when the bytes a crash left after the
        # frame show it is not the end, as damage before it (then recovery fails closed).
        if wanted == "torn" and not codes & TORN_OR_CORRUPT:
            raise AssertionError(f"straw check did not report the torn tail of {damage}: {codes}")
        before = _readable(root, run, refs)
        outcome = _recover_and_collect(root, run)
        lost = before - _readable(root, run, refs)
        if lost and wanted != "torn":
            raise AssertionError(f"after {damage} and {outcome}, {sorted(lost)[:5]} no longer read back")
    return (
        f"damage {damage.op} {damage.kind} {damage.path[-24:]}@{damage.at}: check {sorted(codes)}, {outcome}"
    )


def _recover_and_collect(root: str, run: str) -> str:
    backend = FilesystemBackend(root, sleep=lambda _: None, visibility_delays=())
    try:
        store = SharedFilesystemStore(root, run, backend=backend, online_gc=True)
    except QueueError as error:
        return f"store refused ({type(error).__name__})"
    with store:
        try:
            with Coordinator(store, exclusive_owner="sim", recover=True) as coord:
                coord.collect_garbage()
                outcome = "recovered and collected"
        except QueueError as error:
            outcome = f"refused ({type(error).__name__})"
        with contextlib.suppress(QueueError):
            store.collect_garbage()
    return outcome
