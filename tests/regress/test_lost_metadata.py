"""Issue 11, data-loss defects 1 and 2: a lost catalog, a lost journal, a lost queue.json.

Before the fix, each of these lost acknowledged data, and ``straw check`` said "ok":

1. Retain publications under owners, close, remove ``catalog/``: ``straw check`` (and
   ``--fix``) exited 0, and the next ``collect_garbage()`` reclaimed every retained pack.
   Now ``check`` reports ``catalog.missing`` (exit 1), every catalog call refuses with
   ``UnsafeRecovery`` naming the repair, nothing is deleted, and only the explicit
   ``straw check --rebuild-catalog --owner NAME`` lets collection run again, dropping no owner.
2. Delete the journal segment after the last snapshot, or the whole queue directory:
   ``recover=True`` succeeded with fewer tasks (acknowledged receipts gone) or silently made
   an empty queue, and GC then deleted the acknowledged results. Now recovery fails closed,
   ``check`` reports it and nothing is reclaimed; a fresh queue starts there only with
   ``abandon_lost_queue=True``.

And a deleted ``queue/queue.json``: recovery accepted any identity and did not rewrite it.
Now it is checked against the identity the journal recorded and written again.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import queue_helpers as qh
from pool_damage import tree_digest
from straw._inspect.check import check_pool
from straw.cli import main
from straw.coordinator import Coordinator
from straw.errors import CorruptData, UnsafeRecovery
from straw.protocol import Limits, Record, RecordSetRef, TaskSpec
from straw.store import SharedFilesystemStore

RUN = "run-lost"
OWNER = "lost-test"


def _check(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["check", *args])
    out, err = capsys.readouterr()
    return code, out, err


def _raw(root: Path) -> dict[str, str]:
    return {k: v for k, v in tree_digest(root).items() if k.startswith("raw/")}


def _publish(store: SharedFilesystemStore, name: str) -> RecordSetRef:
    return store.publish([Record(name, name.encode() * 50)], submission_id=f"pub-{name}")


def _retained_pool(root: Path) -> dict[str, RecordSetRef]:
    """Publications retained by two owners, their staging over, every writer closed."""
    refs = {}
    for name in ("alpha", "beta"):
        with SharedFilesystemStore(root, RUN, online_gc=True) as store:
            refs[name] = _publish(store, name)
            store.retain(f"keep-{name}", [refs[name]])
            store.release_publications([refs[name]])
    return refs


def _reads(root: Path, refs: dict[str, RecordSetRef]) -> dict[str, bytes]:
    with SharedFilesystemStore(root, RUN) as store:
        return {name: bytes(next(iter(store.read(ref))).payload) for name, ref in refs.items()}


# --------------------------------------------------------------------------- 1: a lost catalog


def test_a_lost_catalog_is_an_error_and_collection_refuses_until_it_is_rebuilt(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "pool"
    refs = _retained_pool(root)
    shutil.rmtree(root / "catalog")
    before = _raw(root)
    for args in ((str(root),), (str(root), "--fix")):
        code, out, _ = _check(capsys, *args)
        assert code == 1 and "catalog.missing" in out, out
    with SharedFilesystemStore(root, RUN) as store:
        for call in (store.collect_garbage, lambda: store.retain("x", [refs["alpha"]])):
            with pytest.raises(UnsafeRecovery, match="--rebuild-catalog"):
                call()
    assert _raw(root) == before  # nothing was deleted
    assert _reads(root, refs) == {"alpha": b"alpha" * 50, "beta": b"beta" * 50}

    # The explicit repair: the listed owner keeps every pack; nothing is collected.
    code, _, err = _check(capsys, str(root), "--rebuild-catalog")
    assert code == 2 and "needs at least one --owner" in err
    code, out, err = _check(capsys, str(root), "--rebuild-catalog", "--owner", "restored")
    assert code == 0, out + err
    assert "rebuilt the catalog: restored keep all 2 packs" in err
    with SharedFilesystemStore(root, RUN) as store:
        assert store.collect_garbage()["reclaimed_files"] == 0
        # The application narrows ownership again; then only what nobody retains goes.
        store.retain("keep-alpha", [refs["alpha"]])
        store.release("restored")
        assert store.collect_garbage()["reclaimed_files"] == 1
        assert [r.record_id for r in store.read(refs["alpha"])] == ["alpha"]
    assert check_pool(root).ok


def test_a_catalog_cut_short_or_older_than_its_queue_refuses_collection(tmp_path: Path) -> None:
    root = tmp_path / "pool"
    refs = _retained_pool(root)
    log = root / "catalog" / "log"
    old_copy = log.read_bytes()  # a backup taken before the queue existed
    store = SharedFilesystemStore(root, RUN)
    coord = Coordinator(store, exclusive_owner=OWNER, clock=qh.Clock())
    coord.submit_tasks("submit", [TaskSpec("t0", input_ref=refs["alpha"])])
    receipt = qh.work_one(coord, "w")
    coord.close()
    store.close()
    full = log.read_bytes()
    end = len(full.rstrip(b"\0"))
    before = _raw(root)
    # Cut short at its last frame (no zeros after it, J7): refused, not read as a clean end.
    log.write_bytes(full[:end])
    with SharedFilesystemStore(root, RUN) as reader, pytest.raises(CorruptData, match="cut short"):
        reader.collect_garbage()
    assert not check_pool(root).ok
    # An older copy put back: it does not know the queue's owner (I20).
    log.write_bytes(old_copy)
    report = check_pool(root)
    assert "catalog.lost_owner" in {f.code for f in report.findings} and not report.ok
    with SharedFilesystemStore(root, RUN) as reader:
        with pytest.raises(UnsafeRecovery, match="does not know the owner of the queue"):
            reader.collect_garbage()
        with pytest.raises(UnsafeRecovery, match="catalog lost events"):
            Coordinator(reader, exclusive_owner=OWNER, recover=True)
    assert _raw(root) == before
    # The rebuild gives the queue its roots back and keeps everything else.
    assert main(["check", str(root), "--rebuild-catalog", "--owner", "restored"]) == 0
    with SharedFilesystemStore(root, RUN) as again:
        with Coordinator(again, exclusive_owner=OWNER, recover=True) as coord:
            assert coord.lookup_submission("sub-t0") == receipt
            coord.collect_garbage()
        assert [r.record_id for r in again.read(receipt.result_ref)] == ["out-t0"]
    assert _raw(root) == before


def test_rebuild_refuses_an_intact_catalog_and_a_live_writer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "pool"
    _retained_pool(root)
    code, _, err = _check(capsys, str(root), "--rebuild-catalog", "--owner", "x")
    assert code == 2 and "catalog is intact" in err
    shutil.rmtree(root / "catalog")
    live = SharedFilesystemStore(root, RUN)
    _publish(live, "gamma")  # holds its LIVE lock
    code, _, err = _check(capsys, str(root), "--rebuild-catalog", "--owner", "x")
    assert code == 2 and "is alive" in err and not (root / "catalog" / "log").exists()
    code, _, err = _check(capsys, str(root), "--rebuild-catalog", "--owner", "queue:x")
    assert code == 2 and "are straw's" in err
    live.close()


# --------------------------------------------------------------------------- 2: a lost journal


def _queue_pool(root: Path, *, snapshot: bool) -> tuple[SharedFilesystemStore, list[object]]:
    """A queue with two accepted results (their writer's staging over), reopened once."""
    store = SharedFilesystemStore(root, RUN)
    coord = Coordinator(store, exclusive_owner=OWNER, clock=qh.Clock())
    coord.submit_tasks("submit", [TaskSpec(f"t{i}") for i in range(4)])
    receipts = [qh.work_one(coord, "w") for _ in range(2)]
    if snapshot:
        coord.close()  # writes a snapshot and starts the segment after it
        coord = Coordinator(store, exclusive_owner=OWNER, recover=True, clock=qh.Clock())
        receipts.append(qh.work_one(coord, "w"))
        qh.crash(coord)
    else:
        coord.close()
    return store, receipts


def test_the_segment_after_the_snapshot_lost_fails_recovery_and_gc_keeps_the_results(tmp_path: Path) -> None:
    root = tmp_path / "pool"
    store, receipts = _queue_pool(root, snapshot=True)
    (segment,) = [p for p in (root / "queue" / "wal").iterdir()]
    segment.unlink()  # the only segment: it continued the snapshot
    with pytest.raises(CorruptData, match="no journal segment continues it"):
        Coordinator(store, exclusive_owner=OWNER, recover=True)
    report = check_pool(root)
    assert "journal.lost_segment" in {f.code for f in report.findings} and not report.ok
    store.collect_garbage()
    for receipt in receipts:
        assert [r.record_id for r in store.read(receipt.result_ref)]  # still readable
    store.close()


def test_the_newest_segment_lost_fails_recovery(tmp_path: Path) -> None:
    root = tmp_path / "pool"
    store, receipts = _queue_pool(root, snapshot=False)
    coord = Coordinator(store, exclusive_owner=OWNER, recover=True, clock=qh.Clock())
    receipts.append(qh.work_one(coord, "w"))
    qh.crash(coord)  # no snapshot: the newest segment holds the last completion
    newest = sorted((root / "queue" / "wal").iterdir())[-1]
    newest.unlink()
    with pytest.raises(CorruptData, match=r"cut short|no journal segment"):
        Coordinator(store, exclusive_owner=OWNER, recover=True)
    assert not check_pool(root).ok
    store.collect_garbage()
    assert [r.record_id for r in store.read(receipts[-1].result_ref)] == ["out-t2"]
    store.close()


def test_a_removed_queue_directory_is_refused_until_abandoned_explicitly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "pool"
    store, receipts = _queue_pool(root, snapshot=False)
    shutil.rmtree(root / "queue")
    for recover in (False, True):
        with pytest.raises(UnsafeRecovery, match="abandon_lost_queue=True"):
            Coordinator(store, exclusive_owner=OWNER, recover=recover)
    code, out, _ = _check(capsys, str(root))
    assert code == 1 and "queue.lost" in out
    store.close()  # its writer is gone: only owners keep its packs now
    with SharedFilesystemStore(root, RUN) as collector:
        collector.collect_garbage()
        for receipt in receipts:
            assert list(collector.read(receipt.result_ref))  # the lost queue's owner still keeps them
        # The explicit flag: a new queue, and the earlier one's roots are released.
        with Coordinator(collector, exclusive_owner=OWNER, abandon_lost_queue=True) as fresh:
            assert fresh.tasks == {}
            assert fresh.collect_garbage()["reclaimed_files"] >= 1
    assert check_pool(root).ok


def test_forget_owner_gives_up_a_removed_queue(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "pool"
    store, _ = _queue_pool(root, snapshot=False)
    store.close()
    reader = SharedFilesystemStore(root, RUN)
    owner = Coordinator(reader, exclusive_owner=OWNER, recover=True)
    name = owner._gc_owner
    code, _, err = _check(capsys, str(root), "--forget-owner", name)
    assert code == 2 and "is alive" in err  # the coordinator holds its queue's LOCK
    owner.close()
    code, _, err = _check(capsys, str(root), "--forget-owner", name)
    assert code == 2 and "which is still there" in err
    shutil.rmtree(root / "queue")
    code, _, err = _check(capsys, str(root), "--forget-owner", name)
    assert code == 0 and f"released owner {name}" in err
    assert reader.collect_garbage()["reclaimed_files"] >= 1
    reader.close()


# --------------------------------------------------------------------------- a lost queue.json


def test_a_lost_queue_json_is_checked_against_the_journal_and_written_again(tmp_path: Path) -> None:
    root = tmp_path / "pool"
    store, receipts = _queue_pool(root, snapshot=True)
    identity = root / "queue" / "queue.json"
    saved = identity.read_bytes()
    identity.unlink()
    assert "queue.identity" in {f.code for f in check_pool(root).findings}
    # The journal's record of the identity stands in for the lost file: a changed limit is
    # refused (exclusive_owner is a declaration, any text is taken: compatibility item 2).
    with pytest.raises(UnsafeRecovery, match="limits"):
        Coordinator(store, exclusive_owner=OWNER, recover=True, limits=Limits(metadata_bytes=1024))
    assert not identity.exists()
    with Coordinator(store, exclusive_owner=OWNER, recover=True) as coord:
        assert [coord.lookup_submission(r.submission_id) for r in receipts] == receipts
    assert identity.read_bytes() == saved
    # queue.json present but its journal gone: refused, never an empty queue.
    shutil.rmtree(root / "queue" / "wal")
    shutil.rmtree(root / "queue" / "snap")
    with pytest.raises(UnsafeRecovery, match="journal"):
        Coordinator(store, exclusive_owner=OWNER, recover=True)
    assert "journal.missing" in {f.code for f in check_pool(root).findings}
    store.close()


# --------------------------------------------------------------------------- a queue born half-way


# A coordinator process that dies (os._exit, as a kill would) right after recording its owner.
DIE_AFTER_OWNER = """
import os, sys
from straw.backend import FilesystemBackend
from straw.coordinator import Coordinator
from straw.store import SharedFilesystemStore
armed = []
def fault(phase):
    if armed and phase == "after_catalog_sync":
        os._exit(3)
root = sys.argv[1]
store = SharedFilesystemStore(root, sys.argv[2], backend=FilesystemBackend(root, fault=fault))
armed.append(True)
Coordinator(store, exclusive_owner=sys.argv[3])
os._exit(0)
"""


def test_a_coordinator_that_died_between_its_owner_and_queue_json_is_no_lost_queue(tmp_path: Path) -> None:
    """J1 writes segment 1, then the queue's owner, then ``queue.json``. A coordinator that died
    after the owner (found by the full crash campaign: ``after_catalog_sync`` #3) left a catalog
    owner check cannot name without ``queue.json``: that is not ``queue.lost``. Recovery writes
    ``queue.json`` and serves; the same directory with its journal removed is still refused."""
    root = tmp_path / "pool"
    died = subprocess.run(
        [sys.executable, "-c", DIE_AFTER_OWNER, str(root), RUN, OWNER], capture_output=True, timeout=60
    )
    assert died.returncode == 3, died.stderr
    assert not (root / "queue" / "queue.json").exists() and list((root / "queue" / "wal").iterdir())
    report = check_pool(root)
    store = SharedFilesystemStore(root, RUN)
    assert report.ok and "queue.no_identity" in {f.code for f in report.findings}, report.findings
    with Coordinator(store, exclusive_owner=OWNER, recover=True, clock=qh.Clock()) as coord:
        coord.submit_tasks("submit", [TaskSpec("t0")])
        receipt = qh.work_one(coord, "w")
    assert (root / "queue" / "queue.json").exists() and check_pool(root).ok
    # Its files removed later (the directory kept): the owner is lost, and both say so.
    for child in (root / "queue").iterdir():
        shutil.rmtree(child) if child.is_dir() else child.unlink()
    assert "queue.lost" in {f.code for f in check_pool(root).findings}
    with pytest.raises(UnsafeRecovery, match="abandon_lost_queue=True"):
        Coordinator(store, exclusive_owner=OWNER, recover=True)
    assert [r.record_id for r in store.read(receipt.result_ref)] == ["out-t0"]
    store.close()
