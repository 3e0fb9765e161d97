"""The damage campaign (issue 11): every metadata file of a pool deleted, cut, flipped, linked.

One pool is built once with everything straw keeps metadata for: writers that sealed and
closed, a writer that died with its pack open, owners and released staging, a catalog that
was compacted (``catalog/snapshot`` plus ``catalog/log``), a queue with a snapshot, two
segments (the newest left by a crashed coordinator, zeros after its frames), accepted
results, a training consumer's progress and a checkpoint, and a collection that tombstoned
and reclaimed a pack. Then, for every metadata file (the pool marker, the catalog log and
snapshot, ``queue.json``, each journal segment and snapshot, every ``LIVE`` file, and in
every pack its header, each index frame and its seal frame), the file is restored and then
deleted, cut short, given a flipped byte, or replaced by a symbolic link to an identical copy
outside the pool. After each case:

* ``straw check`` reports a finding (exit 1 or 2, never "ok"), except where the damage is
  provably harmless and documented as such (docs/CHECK.md "Damage and outcomes": the
  content of a ``LIVE`` file means nothing, and a writer without one counts as alive);
* recovery (``Coordinator(recover=True)``) either fails closed with a straw error, or keeps
  every acknowledged completion (the same receipt for each submission);
* no call raises anything but straw's errors, and garbage collection (the coordinator's and a
  plain store's) never makes an acknowledged publication or result unreadable: whatever read
  back after the damage still reads back, byte for byte, after every collection;
* where DURABILITY.md documents a blind spot (a flipped byte in the very last frame of a
  log, which nothing after it proves durable, is removed like a torn write), check must
  still report it (a repairable torn tail), so the operator is told.

``make test`` runs a sample (each kind of file with each kind of damage, once; for packs, one
sealed pack, one a dead writer left open and one standalone segment, each with its header, its
first index frame and its seal); ``make crash`` (``STRAW_CRASH_FULL=1``) runs every file, every
index frame and every LIVE file at several positions.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import queue_helpers as qh
import straw._catalog.log as catalog_log
from straw._fs import lock, posix
from straw._inspect.check import check_pool
from straw._inspect.layout import NotAPool
from straw._inspect.packs import scan_pack
from straw._journal import frame as jframe
from straw._pack import frame as pframe
from straw.backend import FilesystemBackend
from straw.coordinator import Coordinator
from straw.errors import QueueError
from straw.limits import LOG_END_ZEROS_MIN
from straw.protocol import CommitReceipt, Record, RecordSetRef, TaskSpec, encode
from straw.store import SharedFilesystemStore

pytestmark = pytest.mark.crash

RUN = "run-damage"
OWNER = "damage-test"
FULL = os.environ.get("STRAW_CRASH_FULL", "") not in ("", "0")
OPS = ("delete", "truncate", "flip", "symlink")


# --------------------------------------------------------------------------- the pool


@dataclass
class Facts:
    """What was acknowledged while the pool was built, and must survive every damage."""

    retained: dict[str, tuple[RecordSetRef, bytes]] = field(default_factory=dict)  # name -> ref, bytes
    receipts: list[CommitReceipt] = field(default_factory=list)
    #: Receipts whose results the training consumer has not acknowledged (still queue roots).
    unacknowledged: list[CommitReceipt] = field(default_factory=list)


def _die(store: SharedFilesystemStore) -> None:
    """The writer's process ends: its pack stays open (unsealed), its LIVE lock is released."""
    writer = store._writer
    if writer._pack is not None:
        posix.close_quietly(writer._pack.fd)
    lock.unlock(writer._live_fd)


def _keep(store: SharedFilesystemStore, facts: Facts, owner: str, names: list[str]) -> None:
    refs = []
    for name in names:
        payload = (name.encode() + b"-") * 40
        ref = store.publish([Record(name, payload)], submission_id=f"pub-{name}")
        facts.retained[name] = (ref, payload)
        refs.append(ref)
    store.retain(owner, refs)
    store.release_publications(refs)


def build(root: Path) -> Facts:
    facts = Facts()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(catalog_log, "CATALOG_COMPACT_BYTES_MIN", 4000)  # so the catalog compacts
        with SharedFilesystemStore(root, RUN, online_gc=True, segment_target_bytes=2000) as sealed:
            _keep(sealed, facts, "keep-a", ["a1", "a2", "a3"])
            _keep(sealed, facts, "keep-b", ["b1"])
            scrap = sealed.publish([Record("scrap", b"s" * 100)], submission_id="scrap")
            sealed.release_publications([scrap])  # unowned: the collection below reclaims its pack
            sealed.seal()
        dead = SharedFilesystemStore(root, RUN, online_gc=True)
        _keep(dead, facts, "keep-d", ["d1"])
        _die(dead)
        store = SharedFilesystemStore(root, RUN, online_gc=True)
        worker = SharedFilesystemStore(root, RUN, online_gc=True, segment_target_bytes=0)
        coord = Coordinator(store, exclusive_owner=OWNER, clock=qh.Clock())
        inputs = [store.publish([Record(f"in{i}", b"i" * 64)], submission_id=f"in{i}") for i in range(5)]
        store.release_publications(inputs)
        coord.submit_tasks("submit", [TaskSpec(f"t{i}", input_ref=inputs[i]) for i in range(5)])
        facts.receipts.append(_complete(coord, worker))
        coord.register_checkpoint("ckpt", facts.retained["a1"][0])
        coord.close()  # a snapshot, and the segment after it
        coord = Coordinator(store, exclusive_owner=OWNER, recover=True, clock=qh.Clock())
        facts.receipts.append(_complete(coord, worker))
        _acknowledge(coord, store, 1)
        coord.collect_garbage()  # tombstones and reclaims what nobody keeps
        qh.crash(coord)
        coord = Coordinator(store, exclusive_owner=OWNER, recover=True, clock=qh.Clock())
        facts.receipts.append(_complete(coord, worker))  # in the newest segment
        qh.crash(coord)  # the newest segment keeps its zeros after the last frame
        facts.unacknowledged = facts.receipts[1:]  # position 0 was acknowledged, and collected
        worker.close()
        store.close()
    return facts


def _complete(coord: Coordinator, worker: SharedFilesystemStore) -> CommitReceipt:
    lease = coord.acquire("w").assignments[0].lease
    ref = qh.result_for(worker, lease, submission_id=lease.task_id, payload=lease.task_id.encode() * 30)
    worker.release_publications([ref])
    return coord.complete_task(
        lease, submission_id=f"sub-{lease.task_id}", result_ref=ref, result_digest=ref.digest
    )


def _acknowledge(coord: Coordinator, store: SharedFilesystemStore, processed: int) -> None:
    token = coord.open_consumer("training", exclusive_owner="trainer")
    state = store.publish([Record("state", b"s")], submission_id=f"state-{processed}")
    body = {"version": 1, "processed_positions": [], "finished_batches": []}
    progress = store.publish([Record("p", encode(body), codec="json.v1")], submission_id=f"prog-{processed}")
    store.release_publications([state, progress])
    coord.save_consumer_state(
        "training",
        token=token,
        request_id=f"ack-{processed}",
        state_ref=state,
        fetch_cursor=processed,
        processed_cursor=processed,
        progress_ref=progress,
    )


# --------------------------------------------------------------------------- the cases


@dataclass(frozen=True)
class Case:
    kind: str  # what the file is (docs/CHECK.md "Damage and outcomes")
    path: str  # pool-relative
    op: str
    at: int = 0  # byte position for truncate/flip (region start for packs)
    length: int = 0  # region length (packs)

    #: The path with its random writer and pack names replaced by what they hold (_labels), so
    #: a case's id names the same damage in every run.
    label: str = ""

    @property
    def id(self) -> str:
        return f"{self.kind}:{self.op}@{self.at}:{self.label or self.path}"


def _log_frames(data: bytes) -> list[tuple[int, int]]:
    """(start, end) of every valid frame of a journal segment or catalog log."""
    return [(start, found.end) for start, found in qh.log_frames(data)[0]]


def _pack_regions(root: Path, relative: str) -> list[tuple[str, int, int]]:
    """(kind, start, length) of a pack's header, index frames and seal frame."""
    scan = scan_pack(str(root / relative), relative)
    out = [("pack-header", 0, pframe.PACK_HEADER_BYTES)]
    out += [("pack-index", e.index_offset, e.index_size) for e in scan.extents]
    if scan.sealed and scan.extents:
        end = scan.extents[-1].index_offset + scan.extents[-1].index_size
        out.append(("pack-seal", end, scan.valid_end - end))
    return out


def _first_submission(root: Path, relative: str) -> str:
    """The submission id of a pack's first extent (what its writer wrote first), random ids
    left out."""
    extents = scan_pack(str(root / relative), relative).extents
    if not extents:
        return "empty"
    first = extents[0]
    data = (root / relative).read_bytes()[first.index_offset : first.index_offset + first.index_size]
    submission = str(pframe.decode_json_frame(data, pframe.KIND_INDEX, None)["sub"])
    # (a result's submission names its attempt, a random id: that part is not the build's)
    return re.sub(r"[0-9a-f]{16,}", "*", submission)


def _labels(root: Path) -> dict[str, str]:
    """A stable name for each writer directory's pack and LIVE file: a pack is named by its
    first submission, a writer by its packs' first submission in order (writer and pack names
    are random; what they hold is the build's)."""
    labels: dict[str, str] = {}
    for writer in (root / "raw").iterdir():
        packs = {
            str(p.relative_to(root)): _first_submission(root, str(p.relative_to(root)))
            for p in [*writer.glob("*.pack"), *writer.glob("*.seg")]
        }
        name = f"w[{min(packs.values(), default='none')}]"
        labels[str((writer / "LIVE").relative_to(root))] = f"raw/{name}/LIVE"
        for path, first in packs.items():
            labels[path] = f"raw/{name}/p[{first}]{os.path.splitext(path)[1]}"
    assert len(set(labels.values())) == len(labels), f"two files of the pool got one label: {labels}"
    return labels


def cases(root: Path, full: bool) -> list[Case]:
    out: list[Case] = []
    labels = _labels(root)
    files = ["straw-pool.json", "catalog/log", "catalog/snapshot", "queue/queue.json"]
    files += sorted(str(p.relative_to(root)) for p in (root / "queue").glob("*/*.wal"))
    files += sorted(str(p.relative_to(root)) for p in (root / "queue").glob("*/*.snap"))
    files += sorted((str(p.relative_to(root)) for p in root.glob("raw/*/LIVE")), key=labels.__getitem__)
    newest = files[4 + len(list((root / "queue").glob("*/*.wal"))) - 1]
    if not full:  # the sample: one LIVE file stands for all of them
        lives = [f for f in files if f.endswith("/LIVE")]
        files = [f for f in files if not f.endswith("/LIVE")] + lives[:1]
    for path in files:
        kind = _kind(path, newest)
        data = (root / path).read_bytes()
        for op in OPS:
            for at in _positions(kind, op, data, full):
                out.append(Case(kind, path, op, at, label=labels.get(path, "")))
    packs = sorted(
        (str(p.relative_to(root)) for p in [*root.glob("raw/*/*.pack"), *root.glob("raw/*/*.seg")]),
        key=labels.__getitem__,
    )
    for pack in packs if full else _one_of_each(root, packs):
        label = labels[pack]
        regions = _pack_regions(root, pack)
        if not full:  # the sample: a pack's first index frame stands for all of them
            indexes = [r for r in regions if r[0] == "pack-index"]
            regions = [r for r in regions if r[0] != "pack-index"] + indexes[:1]
        out.append(Case("pack", pack, "delete", label=label))
        out.append(Case("pack", pack, "symlink", label=label))
        for kind, start, length in regions:
            spots = [start, start + length // 2, start + length - 1] if full else [start + length // 2]
            out += [Case(kind, pack, "flip", spot, length, label) for spot in spots]
            out.append(Case(kind, pack, "truncate", start + (length // 2 if full else 0), length, label))
    return out


def _one_of_each(root: Path, packs: list[str]) -> list[str]:
    """The sample's packs: one sealed pack, one unsealed (its writer died), one standalone segment;
    the first of each kind in ``packs``' order (by label: the same ones in every run)."""
    chosen: dict[tuple[bool, bool], str] = {}
    for pack in packs:
        sealed = scan_pack(str(root / pack), pack).sealed
        chosen.setdefault((pack.endswith(".seg"), sealed), pack)
    return list(chosen.values())


def _kind(path: str, newest: str) -> str:
    if path.endswith(".wal"):
        return "journal-newest" if path == newest else "journal-older"
    if path.endswith(".snap"):
        return "journal-snapshot"
    if path.endswith("/LIVE"):
        return "live"
    return {
        "straw-pool.json": "marker",
        "catalog/log": "catalog-log",
        "catalog/snapshot": "catalog-snapshot",
    }.get(path, "queue-identity")


def _positions(kind: str, op: str, data: bytes, full: bool) -> list[int]:
    if op in ("delete", "symlink"):
        return [0]
    if not data:
        return []  # an empty file (LIVE): nothing to cut or flip
    if kind in ("journal-newest", "journal-older", "catalog-log") and len(data) > 64:
        frames = _log_frames(data)
        if op == "truncate":
            ends = [end for _, end in frames]
            spots = (
                [0, 10, 64, *[e - 7 for e in ends], *ends]
                if full
                else [len(data) // 2, ends[-1] if ends else 64]
            )
            return sorted({s for s in spots if 0 <= s < len(data)})
        starts = [s for s, _ in frames]
        spots = (
            [5, *[s + 3 for s in starts], *[s + 70 for s in starts]]
            if full
            else [5, starts[0] + 70 if starts else 5]
        )
        return sorted({s for s in spots if s < len(data)})
    if op == "truncate":
        return sorted({0, len(data) // 2, max(len(data) - 1, 0)}) if full else [len(data) // 2]
    return sorted({0, len(data) // 2, len(data) - 1}) if full else [len(data) // 2]


# --------------------------------------------------------------------------- damage and verdicts


def damage(root: Path, case: Case, outside: Path) -> None:
    path = root / case.path
    if case.op == "delete":
        path.unlink()
    elif case.op == "truncate":
        with open(path, "r+b") as handle:
            handle.truncate(case.at)
    elif case.op == "flip":
        with open(path, "r+b") as handle:
            handle.seek(case.at)
            byte = handle.read(1)
            handle.seek(case.at)
            handle.write(bytes([byte[0] ^ 0x5A]))
    else:
        copy = outside / case.path.replace("/", "_")
        shutil.copy2(path, copy)
        path.unlink()
        os.symlink(copy, path)


def _harmless(case: Case, pristine: bytes) -> bool:
    """Damage docs/CHECK.md lists as provably harmless: a writer without its LIVE file counts as
    alive (its packs are kept), and a LIVE file's content is an informational note nothing
    decides by; a log cut inside the zeros after its frames, still ending in at least
    LOG_END_ZEROS_MIN of them, lost no frame. A link is never harmless."""
    if case.kind == "live" and case.op in ("delete", "truncate", "flip"):
        return True
    if case.op == "truncate" and case.kind in ("journal-newest", "journal-older", "catalog-log"):
        frames = _log_frames(pristine)
        end = frames[-1][1] if frames else jframe.SEGMENT_HEADER_BYTES
        # An older segment may keep zeros after its frames (a crash before the cut, J5.2).
        return case.at >= end + (0 if case.kind == "journal-older" else LOG_END_ZEROS_MIN)
    return False


def _blind_spot(case: Case, pristine: bytes) -> bool:
    """A flipped byte in a frame the log's last frame does not witness (its lag, DURABILITY.md
    "durability witness"): the last frame itself, and in the journal the acquire frames written
    without a sync just before it (J2.5). Nothing proves such a frame durable, so recovery
    removes it like a torn write, and the frames after it; check must still report the torn tail."""
    if case.op != "flip" or case.kind not in ("journal-newest", "catalog-log"):
        return False
    start, end = qh.unwitnessed(pristine)
    return start <= case.at < end


def _store(root: Path) -> SharedFilesystemStore:
    """A store that does not wait for a missing pack to appear (VISIBILITY_RETRY_DELAYS)."""
    return SharedFilesystemStore(root, RUN, backend=FilesystemBackend(root, visibility_delays=()))


def readable(root: Path, facts: Facts) -> dict[str, bytes | None]:
    """What reads back exactly now: retained publications and accepted results (None: refused)."""
    out: dict[str, bytes | None] = {}
    try:
        store = _store(root)
    except QueueError:
        return dict.fromkeys(list(facts.retained) + [r.submission_id for r in facts.unacknowledged])
    with store:
        wanted = {name: (ref, payload) for name, (ref, payload) in facts.retained.items()}
        for receipt in facts.unacknowledged:
            task = receipt.task_id
            wanted[receipt.submission_id] = (receipt.result_ref, task.encode() * 30)
        for name, (ref, payload) in wanted.items():
            try:
                records = list(store.read(ref))
            except QueueError:
                out[name] = None
                continue
            got = bytes(records[0].payload) if len(records) == 1 else b""
            assert got == payload, f"{name} read back different bytes"
            out[name] = got
    return out


def recover_and_collect(root: Path, facts: Facts, forgiven: set[str]) -> str:
    """Recovery, then every collection; the outcome's name. Only straw errors may come out.

    ``forgiven``: submissions a documented blind spot may lose (the last frame of a journal).
    """
    try:
        store = _store(root)
    except QueueError as error:
        return f"store refused: {type(error).__name__}"
    with store:
        try:
            coord = Coordinator(store, exclusive_owner=OWNER, recover=True, clock=qh.Clock())
        except QueueError as error:
            outcome = f"recovery refused: {type(error).__name__}"
        else:
            with coord:
                for receipt in facts.receipts:
                    if receipt.submission_id not in forgiven:
                        assert coord.lookup_submission(receipt.submission_id) == receipt, receipt
                try:
                    coord.collect_garbage()
                    outcome = "recovered"
                except QueueError as error:
                    outcome = f"recovered, collection refused: {type(error).__name__}"
        with contextlib.suppress(QueueError):
            store.collect_garbage()
    return outcome


def _verdict(root: Path) -> tuple[bool, set[str]]:
    try:
        report = check_pool(root)
    except NotAPool:
        return False, {"not-a-pool"}
    return report.ok, {f.code for f in report.findings if f.severity != "info"}


_BUILT: list[tuple[Path, Facts]] = []


def _built() -> tuple[Path, Facts]:
    """The pool, built once per run (at collection: the cases name its files, whose names are
    random), and what it acknowledged. Every case damages a fresh copy of it."""
    if not _BUILT:
        import tempfile

        directory = tempfile.mkdtemp(prefix="straw-damage-")
        atexit.register(shutil.rmtree, directory, True)
        root = Path(directory) / "pool"
        facts = build(root)
        _BUILT.append((root, facts))
    return _BUILT[0]


@pytest.fixture(scope="module")
def pristine() -> tuple[Path, Facts]:
    root, facts = _built()
    report = check_pool(root)
    assert report.ok, report.remaining()
    return root, facts


def run_case(pristine: tuple[Path, Facts], case: Case, tmp_path: Path) -> None:
    source, facts = pristine
    root = tmp_path / "pool"
    shutil.copytree(source, root, symlinks=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    data = (root / case.path).read_bytes()
    before_damage = readable(root, facts)
    assert all(v is not None for v in before_damage.values())
    damage(root, case, outside)
    ok, codes = _verdict(root)
    forgiven: set[str] = set()
    if _blind_spot(case, data):
        assert "journal.torn_tail" in codes or "catalog.torn_tail" in codes, (case.id, codes)
        if case.kind == "journal-newest":  # the frames from the flip on hold the last completion
            forgiven.add(facts.receipts[-1].submission_id)
    elif not _harmless(case, data):
        assert not ok, f"{case.id}: straw check said ok over damage"
    after_damage = readable(root, facts)
    outcome = recover_and_collect(root, facts, forgiven)
    after_collection = readable(root, facts)
    lost = [
        name
        for name, got in after_damage.items()
        if got is not None and after_collection[name] is None and name not in forgiven
    ]
    assert not lost, f"{case.id}: {outcome}, and then {lost} no longer read back"


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "case" not in metafunc.fixturenames:
        return
    root, _ = _built()
    chosen = cases(root, full=metafunc.function.__name__.endswith("_full"))
    metafunc.parametrize("case", chosen, ids=[c.id for c in chosen])


def test_damage_sampled(pristine: tuple[Path, Facts], case: Case, tmp_path: Path) -> None:
    run_case(pristine, case, tmp_path)


@pytest.mark.slow
@pytest.mark.skipif(not FULL, reason="the full damage campaign runs under `make crash` (STRAW_CRASH_FULL=1)")
def test_damage_full(pristine: tuple[Path, Facts], case: Case, tmp_path: Path) -> None:
    run_case(pristine, case, tmp_path)


def test_the_campaign_covers_every_kind_of_metadata_file(pristine: tuple[Path, Facts]) -> None:
    root, _ = pristine
    kinds = {(c.kind, c.op) for c in cases(root, full=False)}
    for kind in (
        "marker",
        "catalog-log",
        "catalog-snapshot",
        "queue-identity",
        "journal-newest",
        "journal-older",
        "journal-snapshot",
    ):
        assert {(kind, op) for op in OPS} <= kinds, kind
    assert {("live", "delete"), ("live", "symlink")} <= kinds  # content damage needs a note in it
    for kind in ("pack-header", "pack-index", "pack-seal"):
        assert {(kind, "flip"), (kind, "truncate")} <= kinds, kind
    assert {("pack", "delete"), ("pack", "symlink")} <= kinds
    assert (root / "catalog" / "snapshot").exists() and len(list((root / "queue").glob("wal/*.wal"))) == 2
