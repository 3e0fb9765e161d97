"""Terminal history on disk (docs/FORMAT.md 8.4, DURABILITY.md J5 H1-H4; issue 12 items 1, 3).

A snapshot after every call (in the calling thread) moves finished tasks and accepted receipts
to ``hist/`` files. Every lookup stays exact from disk, before and after a reopen; a missing,
torn or damaged history file fails closed with an error naming it, and once the file is
restored nothing was lost; an older snapshot that holds everything still opens.
"""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import threading
import tracemalloc
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import queue_helpers as qh
import straw.coordinator as coordinator_module
from straw import Coordinator, SharedFilesystemStore, TaskSpec
from straw._inspect.check import check_pool
from straw._inspect.view import inspect_pool, why
from straw._journal import history_io
from straw._queue import history
from straw._queue.machine import new_state, state_from_dict, state_to_dict
from straw._queue.progress import acknowledged
from straw.backend import FilesystemBackend
from straw.cli import main
from straw.errors import (
    CorruptData,
    IdempotencyConflict,
    IndeterminateCommit,
    InvalidReference,
    StaleAttempt,
)
from straw.inspect import inspect_run
from straw.limits import HISTORY_UNMERGED_FILES_MAX
from straw.protocol import CommitReceipt, Lease, Record, RecordSetRef, decode, encode

RUN = "run-history"
OWNER = "history"
TASKS = 12
LIMITS = {"max_result_bytes": 4 * 1024**3, "max_result_tokens": 100_000_000, "metadata_bytes": 256 * 1024}


@pytest.fixture(autouse=True)
def _snapshot_every_call(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(coordinator_module, "JOURNAL_SNAPSHOT_BYTES_MIN", 1)
    monkeypatch.setattr(coordinator_module, "SNAPSHOTS_IN_BACKGROUND", False)
    yield


Worked = list[tuple[CommitReceipt, Lease, RecordSetRef]]


def _work(coord: Coordinator, count: int, worker: str = "w") -> Worked:
    done: Worked = []
    for _ in range(count):
        lease = coord.acquire(worker).assignments[0].lease
        ref = qh.result_for(coord.store, lease, submission_id=f"sub-{lease.task_id}")
        receipt = coord.complete_task(
            lease, submission_id=f"sub-{lease.task_id}", result_ref=ref, result_digest=ref.digest
        )
        done.append((receipt, lease, ref))
    return done


def _build(root: str) -> Worked:
    with SharedFilesystemStore(root, RUN) as store, Coordinator(store, exclusive_owner=OWNER) as coord:
        coord.submit_tasks("tasks", [TaskSpec(f"t{i:02d}") for i in range(TASKS)])
        done = _work(coord, TASKS - 2, "w1")
        coord.cancel_task("t11", request_id="cancel-11")
        assert coord._state.history.files and len(coord._state.tasks) < TASKS  # spilled
    return done


def _hist_files(root: str) -> list[Path]:
    return sorted((Path(root) / "queue" / "hist").glob("*.hist"))


def _assert_exact(coord: Coordinator, done: Worked) -> None:
    for receipt, lease, ref in done:
        assert coord.lookup_submission(receipt.submission_id) == receipt
        assert coord.task_status(receipt.task_id)["state"] == "completed"  # type: ignore[index]
        again = coord.complete_task(
            lease, submission_id=receipt.submission_id, result_ref=ref, result_digest=ref.digest
        )
        assert again == receipt  # a retry after a lost reply: the same receipt, from disk
    page = coord.read_commits(0, 100)
    assert list(page.commits) == [r for r, _, _ in done]
    assert coord.task_status("t11")["state"] == "cancelled"  # type: ignore[index]
    assert {k: v["state"] for k, v in coord.tasks.items()} == {
        **{f"t{i:02d}": "completed" for i in range(TASKS - 2)},
        "t10": "pending",
        "t11": "cancelled",
    }
    assert [r["position"] for r in coord.retire_worker("w1")] == list(range(TASKS - 2))


def test_every_lookup_is_exact_from_disk_live_and_after_reopen(tmp_path: Path) -> None:
    root = str(tmp_path)
    done = _build(root)
    with (
        SharedFilesystemStore(root, RUN) as store,
        Coordinator(store, exclusive_owner=OWNER, recover=True) as coord,
    ):
        assert coord._state.commits.base > 0 and coord._state.history.files
        _assert_exact(coord, done)
        lease = done[0][1]
        with pytest.raises(IdempotencyConflict, match="already submitted by request 'tasks'"):
            coord.submit_tasks("again", [TaskSpec("t00")])
        assert coord.heartbeat([lease]) == ["StaleAttempt"]
        with pytest.raises(StaleAttempt, match="task is completed"):
            coord.fail_task(lease, request_id="f", failure="x")
        assert coord.cancel_task("t00", request_id="cancel-0") == "completed"
        assert coord.metrics()["tasks"] == {"completed": TASKS - 2, "pending": 1, "cancelled": 1}


def test_pages_of_any_size_and_cursor_cross_files_and_memory_exactly(tmp_path: Path) -> None:
    root = str(tmp_path)
    done = _build(root)
    with (
        SharedFilesystemStore(root, RUN) as store,
        Coordinator(store, exclusive_owner=OWNER, recover=True) as coord,
    ):
        more = _work(coord, 1, "w2")  # in memory, after the positions on disk
        receipts = [r for r, _, _ in done + more]
        state = coord._state
        assert len(state.history.files) > 2 and 0 < state.commits.base < len(receipts)
        for limit in (1, 2, 3, 7, 100):
            for cursor in range(len(receipts) + 1):
                page = coord.read_commits(cursor, limit)
                assert list(page.commits) == receipts[cursor : cursor + limit], (cursor, limit)
                assert page.cursor == min(len(receipts), cursor + limit)
        # Paging across every file leaves a decoded block in the file read last only.
        assert sum(f._block is not None for f in state.history.files) <= 1
        # A run of positions is one read of its entries per file, in position order.
        rows = state.history.receipts(0, state.commits.base)
        assert [row[0]["position"] for row in rows] == list(range(state.commits.base))
        assert state.history.receipts(1, 1) == []


def test_paging_leaves_the_cycle_collector_as_the_caller_had_it(tmp_path: Path) -> None:
    root = str(tmp_path)
    _build(root)
    with (
        SharedFilesystemStore(root, RUN) as store,
        Coordinator(store, exclusive_owner=OWNER, recover=True) as coord,
    ):
        assert gc.isenabled()
        assert len(coord.read_commits(0, 100).commits) == TASKS - 2
        assert gc.isenabled()
        gc.disable()
        try:
            assert len(coord.read_commits(0, 100).commits) == TASKS - 2
            assert not gc.isenabled()  # the caller's choice stays
        finally:
            gc.enable()


def _unloaded(files: list[history.HistoryFile]) -> bool:
    return all(f._hashes is None for f in files)


def _run_files(root: str) -> set[str]:
    return {p.name for p in (Path(root) / "queue" / "hist").glob("*" + history.RUN_SUFFIX)}


def test_files_are_indexed_by_runs_on_disk_off_the_lock_and_a_miss_reads_no_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(history, "HISTORY_RUN_ENTRIES_MAX", 24)  # several runs, merged as they double
    root = str(tmp_path)
    with SharedFilesystemStore(root, RUN) as store, Coordinator(store, exclusive_owner=OWNER) as coord:
        coord.submit_tasks("tasks", [TaskSpec(f"t{i:02d}") for i in range(4 * TASKS)])
        done = _work(coord, 4 * TASKS, "w1")
        hist = coord._state.history
        assert len(hist.runs) > 1 and hist.merged_indexes is None  # written by the snapshot job (H3)
        assert [r.first for r in hist.runs] == [0, *(r.stop for r in hist.runs[:-1])]
        assert len(hist.files) - hist.run_stop <= HISTORY_UNMERGED_FILES_MAX < len(hist.files)
        assert _unloaded(hist.files[: hist.run_stop])  # the runs replace their hashes
        for run in hist.runs:
            covered = hist.files[run.first : run.stop]
            assert run.counts[0] == sum(f.tasks for f in covered)
            assert run.counts[1] == sum(f.subs for f in covered)
            hashes = run.read(0)[:, 0].tolist()
            assert hashes == sorted(hashes)
        # New ids miss: the runs' filters answer from memory, no covered file is read.
        assert coord.task_status("never") is None and coord.lookup_submission("never") is None
        assert _unloaded(hist.files[: hist.run_stop])
        for receipt, _, _ in done:
            assert coord.lookup_submission(receipt.submission_id) == receipt
            assert coord.task_status(receipt.task_id)["state"] == "completed"  # type: ignore[index]
    names = {r.name for r in hist.runs}
    assert _run_files(root) == names  # close() took every run over; absorbed runs were pruned (H4)
    with (
        SharedFilesystemStore(root, RUN) as store,
        Coordinator(store, exclusive_owner=OWNER, recover=True) as coord,
    ):
        hist = coord._state.history
        assert {r.name for r in hist.runs} == names  # named by the snapshot, opened by their trailers
        assert hist.merged_indexes is None
        assert coord.task_status("never") is None
        assert hist.merged_indexes is None  # the few files after the runs are searched one by one
        for receipt, _, _ in done:
            assert coord.lookup_submission(receipt.submission_id) == receipt


def test_a_snapshot_that_names_no_runs_still_answers_and_merges_in_memory(tmp_path: Path) -> None:
    """Queues written before index runs (no ``history_runs`` in the snapshot) open unchanged:
    their files are merged in memory at the first lookup, until a snapshot writes runs."""
    root = str(tmp_path)
    done = _build(root)
    with (
        SharedFilesystemStore(root, RUN) as store,
        Coordinator(store, exclusive_owner=OWNER, recover=True) as coord,
    ):
        state = coord._state
        assert state.history.runs
        older = state_to_dict(state)
        del older["history_runs"]
        opened = state_from_dict(older, LIMITS, history_io.opener(coord.directory))
        assert not opened.history.runs and opened.history.merge_due()
        assert opened.find_task("never") is None
        assert opened.history.merged_indexes is not None  # the fallback, built at the first lookup
        for receipt, _, _ in done:
            assert opened.position_of(receipt.submission_id) == receipt.position
            assert opened.find_task(receipt.task_id).state == "completed"  # type: ignore[union-attr]
        opened.history.close()


def test_hashes_that_collide_across_files_still_answer_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every id of the same length hashes alike: each lookup walks a run of equal hashes in
    # the index runs, across their pages, and in each file, comparing the row's own key.
    monkeypatch.setattr(history, "key_hash", lambda key: len(key))
    monkeypatch.setattr(history, "HISTORY_RUN_PAGE_ENTRIES", 2)
    root = str(tmp_path)
    done = _build(root)
    with (
        SharedFilesystemStore(root, RUN) as store,
        Coordinator(store, exclusive_owner=OWNER, recover=True) as coord,
    ):
        _assert_exact(coord, done)
        assert coord._state.history.runs
        assert coord.task_status("t99") is None  # same hash as every task id, in no file
        assert coord.lookup_submission("sub-t99") is None


def test_recovery_reads_only_live_state_and_opens_history_files_lazily(tmp_path: Path) -> None:
    root = str(tmp_path)
    _build(root)
    with (
        SharedFilesystemStore(root, RUN) as store,
        Coordinator(store, exclusive_owner=OWNER, recover=True) as coord,
    ):
        state = coord._state
        # Live work in memory (the pending task; the cancel came after the last background
        # snapshot, close() snapshots what it has), none of the completed ones.
        assert set(state.tasks) == {"t10", "t11"}
        assert state.commits.base == TASKS - 2 and not state.submissions
        assert all(f._hashes is None for f in state.history.files)  # trailers only so far
        assert coord.task_status("t03")["state"] == "completed"  # type: ignore[index]


def test_a_retire_in_the_journal_tail_is_replayed_without_reading_history(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A retire answers with every receipt of the worker, history files included; replaying the
    same retire after a crash only revokes and ends (the reply is discarded), so recovery reads
    no history file, and the retire's answer after it is still exact."""
    root = str(tmp_path)
    _build(root)
    store = SharedFilesystemStore(root, RUN)
    coord = Coordinator(store, exclusive_owner=OWNER, recover=True)
    lease = coord.acquire("w1").assignments[0].lease  # t10, leased to the worker that retires
    answered = coord.retire_worker("w1")
    assert [r["position"] for r in answered] == list(range(TASKS - 2))
    qh.crash(coord)  # the retire's frame is in the journal tail: no snapshot after it
    reads: list[str] = []
    meta = history.HistoryFile.meta

    def counted(file: history.HistoryFile) -> Any:
        reads.append(file.name)
        return meta(file)

    monkeypatch.setattr(history.HistoryFile, "meta", counted)
    with Coordinator(store, exclusive_owner=OWNER, recover=True) as again:
        assert reads == [], "recovery read history files"
        assert again.task_status("t10")["state"] == "pending"  # type: ignore[index]
        assert again.heartbeat([lease]) == ["StaleAttempt"]
        assert [r["position"] for r in again.retire_worker("w1")] == list(range(TASKS - 2))
        assert reads  # the live retire does read them
    store.close()


@pytest.mark.parametrize("damage", ["missing", "torn", "trailer"])
def test_a_missing_or_torn_history_file_fails_closed_naming_it_and_nothing_is_lost(
    tmp_path: Path, damage: str
) -> None:
    root = str(tmp_path)
    done = _build(root)
    victim = _hist_files(root)[0]
    kept = tmp_path / "kept.hist"
    shutil.copyfile(victim, kept)
    if damage == "missing":
        victim.unlink()
    elif damage == "torn":
        os.truncate(victim, victim.stat().st_size - 7)
    else:
        data = bytearray(victim.read_bytes())
        data[-3] ^= 0xFF  # the trailer's checksum
        victim.write_bytes(bytes(data))
    with SharedFilesystemStore(root, RUN) as store, pytest.raises(CorruptData, match=victim.name):
        Coordinator(store, exclusive_owner=OWNER, recover=True)
    assert qh.descriptors_under(root) == []  # the refused recovery keeps no file of it open
    shutil.copyfile(kept, victim)  # restored from a copy: every answer is back
    with (
        SharedFilesystemStore(root, RUN) as store,
        Coordinator(store, exclusive_owner=OWNER, recover=True) as coord,
    ):
        _assert_exact(coord, done)


def test_a_damaged_row_fails_its_lookup_and_straw_check_names_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = str(tmp_path)
    done = _build(root)
    # The largest file holds tasks and receipts (the first may hold only the submit request).
    victim = max(_hist_files(root), key=lambda p: p.stat().st_size)
    original = victim.read_bytes()
    data = bytearray(original)
    data[history.HEADER.size + 2] ^= 0x01  # inside the first row (the index still checks)
    victim.write_bytes(bytes(data))
    assert main(["check", root]) == 1
    out = capsys.readouterr().out
    assert "queue.history" in out and victim.name in out and "does not match its checksum" in out
    with (
        SharedFilesystemStore(root, RUN) as store,
        Coordinator(store, exclusive_owner=OWNER, recover=True) as coord,
        pytest.raises(CorruptData, match=victim.name),
    ):
        _assert_exact(coord, done)  # the answer that needs the row refuses, never guesses
    victim.write_bytes(original)
    assert main(["check", root]) == 0


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors through /proc")
def test_checking_and_inspecting_a_pool_over_and_over_keeps_no_history_file_open(tmp_path: Path) -> None:
    """``straw check`` and ``straw inspect`` read every history file and index run; a process
    that runs them again and again (a monitor) must not keep a descriptor per file."""
    root = str(tmp_path)
    _build(root)
    assert any(p.name.endswith(history.RUN_SUFFIX) for p in (tmp_path / "queue" / "hist").iterdir())
    for _ in range(3):
        assert check_pool(root).ok
        described = inspect_pool(root)
        assert described["queues"][0]["root_packs"] > 0
        assert why(root, described["packs"][0]["pack"])["exists"]
        assert inspect_run(root)["retained_dependency_errors"] == []
        assert qh.descriptors_under(root) == []


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors through /proc")
def test_a_coordinator_stopped_by_a_journal_failure_still_answers_and_closes_every_file(
    tmp_path: Path,
) -> None:
    """After a failed journal write, views answer the durable state read back from disk (J3.2);
    the state it replaces keeps its files (a call may still be reading one) until close()."""
    root = str(tmp_path)
    done = _build(root)
    armed = {"on": False}

    def fault(phase: str) -> None:
        if armed["on"] and phase == "before_journal_write":
            raise OSError(5, "Input/output error")

    backend = FilesystemBackend(root, fault=fault)
    with SharedFilesystemStore(root, RUN, backend=backend) as store:
        coord = Coordinator(store, exclusive_owner=OWNER, recover=True)
        _assert_exact(coord, done)  # reads every history file and run
        runs = [p for p in (tmp_path / "queue" / "hist").iterdir() if p.name.endswith(history.RUN_SUFFIX)]
        assert runs and _history_descriptors(history.RUN_SUFFIX, root) == len(runs)
        armed["on"] = True
        with pytest.raises(IndeterminateCommit):
            coord.submit_tasks("late", [TaskSpec("late")])
        armed["on"] = False
        receipt = done[0][0]
        assert coord.lookup_submission(receipt.submission_id) == receipt  # from the state read back
        assert coord.task_status("late") is None  # never durable
        with contextlib.suppress(Exception):
            coord.close()
        assert qh.descriptors_under(tmp_path / "queue") == []


def test_live_tasks_answer_from_live_state_without_reading_history(tmp_path: Path) -> None:
    """``tasks`` lists every task ever submitted, from the history files too; ``live_tasks``
    (what a checkpoint or a rollback needs) only the pending and leased ones, from memory."""
    root = str(tmp_path)
    _build(root)
    for victim in _hist_files(root):  # every file's first row damaged: reading history fails
        data = bytearray(victim.read_bytes())
        data[history.HEADER.size + 2] ^= 0x01
        victim.write_bytes(bytes(data))
    with (
        SharedFilesystemStore(root, RUN) as store,
        Coordinator(store, exclusive_owner=OWNER, recover=True) as coord,
    ):
        coord.submit_tasks("more", [TaskSpec("u0"), TaskSpec("u1")])
        coord.acquire("w2", task_ids=["u1"])
        live = coord.live_tasks()
        assert {k: v["state"] for k, v in live.items()} == {"t10": "pending", "u0": "pending", "u1": "leased"}
        assert live["u1"] == coord.task_status("u1")
        assert list(coord.live_tasks(task_prefix="u")) == ["u0", "u1"]
        with pytest.raises(CorruptData):
            coord.tasks  # noqa: B018 - the property reads the damaged history
        with pytest.raises(ValueError):
            coord.live_tasks(task_prefix="")


def test_a_damaged_index_fails_the_first_lookup_naming_the_file(tmp_path: Path) -> None:
    root = str(tmp_path)
    done = _build(root)
    victim = max(_hist_files(root), key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[-history.TRAILER_2.size - 1] ^= 0x10  # the last byte of the index
    victim.write_bytes(bytes(data))
    with (
        SharedFilesystemStore(root, RUN) as store,
        Coordinator(store, exclusive_owner=OWNER, recover=True) as coord,
        # A file an index run covers is reached through the run, so the damaged entry fails the
        # block it names; either way the error names the file.
        pytest.raises(CorruptData, match=f"{victim.name}.*(index|block)"),
    ):
        _assert_exact(coord, done)


def test_a_snapshot_that_holds_everything_still_opens() -> None:
    """Queues written before history files (snapshot version 2) open unchanged."""
    state = new_state("r", "q", LIMITS)
    body = state_to_dict(state)
    old = {k: v for k, v in body.items() if k != "history"}
    old["v"] = 2
    assert state_to_dict(state_from_dict(old, LIMITS))["tasks"] == []
    body["history"] = [["00000000000000000001.hist", 112, 0, 0, 0, {}]]
    with pytest.raises(Exception, match="directory"):
        state_from_dict(body, LIMITS)


def test_golden_bytes_of_a_tiny_history_file() -> None:
    """docs/FORMAT.md 8.4 shows these bytes: one task row, no receipt (zlib level 1 output, as
    CPython's bundled zlib writes it)."""
    chunks, checksum = history.build(7, 0, [("t", ["t"])], [], {"counts": {"failed": 1}})
    data = b"".join(chunks)
    assert data.hex() == GOLDEN
    assert checksum == int.from_bytes(data[-8:], "little")
    first_block = zlib.decompress(data[history.HEADER.size : history.HEADER.size + 15])
    assert decode(first_block) == [["t"]]  # one block of one task row


def test_golden_bytes_of_a_tiny_version_2_history_file_with_a_request() -> None:
    """docs/FORMAT.md 8.4, version 2: the same file plus one request row and its index."""
    chunks, checksum = history.build(
        7, 0, [("t", ["t"])], [], {"counts": {"failed": 1}}, [("r", ["r", "f", True])]
    )
    data = b"".join(chunks)
    assert data.hex() == GOLDEN_2
    assert checksum == int.from_bytes(data[-8:], "little")
    assert data[-history.TRAILER_2.size :][:8] == history.END_MAGIC_2


GOLDEN_2 = (
    "5354525748495354020000000000000007000000000000000000000000000000"
    "78018b8e562a518a8d0500089d022978018b8e562a52d2514a53d229292a4d8d"
    "8d0500267104e978018bae564ace2fcd2b2956b2aa564a4bcccc494d51b232ac"
    "ad8d0500747f08d72df9acf0853e037620000000000000000f00000000000000"
    "1819b4af93d74017350bafb4f7387bbd2f000000000000001800000000000000"
    "6cc7ce5e01c9c42853545257484e443200000000000000000000000000000000"
    "0100000000000000000000000000000001000000000000006800000000000000"
    "47000000000000002100000000000000cd2c51c8c2d6e1f833dfaee75988ad6f"
)


def _open(tmp_path: Path, chunks: list[bytes], checksum: int) -> history.HistoryFile:
    path = tmp_path / history.file_name(7)
    path.write_bytes(b"".join(chunks))
    return history.HistoryFile(path.name, history_io.FileSource(str(path)), path.stat().st_size, checksum)


def test_both_versions_answer_their_lookups_and_version_1_holds_no_requests(tmp_path: Path) -> None:
    """Files written before request rows (version 1) open and answer as before; version 2
    files answer requests too, and verify() reads every row of both."""
    receipt = {"submission_id": "s", "position": 0}
    rows = ([("t", ["t", "req"])], [("s", [receipt, "w", []])], {"counts": {"completed": 1}})
    old = _open(tmp_path, *history.build(7, 0, *rows))
    assert (old.version, old.requests) == (1, 0)
    assert old.task("t") == ["t", "req"] and old.position("s") == 0 and old.request("req") is None
    old.verify()
    old.close()
    (tmp_path / history.file_name(7)).unlink()
    requests = [(f"r{k}", [f"r{k}", f"fp{k}", [k]]) for k in range(200)]
    new = _open(tmp_path, *history.build(7, 0, *rows, requests))
    assert (new.version, new.requests) == (2, 200)
    assert new.task("t") == ["t", "req"] and new.position("s") == 0
    assert all(new.request(f"r{k}") == [f"r{k}", f"fp{k}", [k]] for k in range(200))
    assert new.request("r200") is None and new.request("t") is None
    new.verify()
    new.close()
    with pytest.raises(CorruptData, match="trailer checksum"):  # not the file its snapshot named
        history.HistoryFile(new.name, history_io.FileSource(new.path), new.size, new.checksum ^ 1)
    assert qh.descriptors_under(tmp_path) == []  # the refused file's too


def test_request_ids_move_to_history_files_and_stay_exact_live_and_after_reopen(tmp_path: Path) -> None:
    """A repeated request answers its first answer from disk, and a changed one is a conflict,
    once the request id left memory; memory keeps only the ids since the last snapshot."""
    root = str(tmp_path)
    _build(root)
    for reopen in (False, True):
        with (
            SharedFilesystemStore(root, RUN) as store,
            Coordinator(store, exclusive_owner=OWNER, recover=True) as coord,
        ):
            state = coord._state
            coord.metrics()  # a call: the live state takes the last file over (H3)
            assert "tasks" not in state.requests  # cancel-11 came last: close() kept it in memory
            assert state.history.request("tasks") is not None
            specs = [TaskSpec(f"t{i:02d}") for i in range(TASKS)]
            assert coord.submit_tasks("tasks", specs) == [f"t{i:02d}" for i in range(TASKS)]
            with pytest.raises(IdempotencyConflict, match="'tasks' was already used"):
                coord.submit_tasks("tasks", [TaskSpec("new")])
            assert coord.cancel_task("t11", request_id="cancel-11") == "cancelled"
            with pytest.raises(IdempotencyConflict, match="'cancel-11' was already used"):
                coord.cancel_task("t10", request_id="cancel-11")
            if reopen:
                assert coord._state.history.files


def test_request_ids_in_memory_stay_bounded_as_history_grows(tmp_path: Path) -> None:
    """Count entries, not time: the request ids in memory (and in each snapshot copy) stay
    bounded by what the calls since the last snapshot made, however many requests the queue
    has seen, and every one of them still answers exactly (live and after a reopen)."""
    root = str(tmp_path)
    calls = 600
    with SharedFilesystemStore(root, RUN) as store, Coordinator(store, exclusive_owner=OWNER) as coord:
        seen: list[int] = []
        for k in range(calls):
            coord.submit_tasks(f"submit-{k}", [])  # a request that adds no live work
            seen.append(max(len(coord._state.requests), len(coord._state.snapshot_copy().requests)))
        # Snapshots come once the journal outgrows the last snapshot, whose list of files grows
        # by a row per file: a few more calls between snapshots late on, never the history.
        assert max(seen) <= 32 < calls
        assert len(coord._state.history.files) >= calls // 16
        for k in range(0, calls, 7):
            assert coord.submit_tasks(f"submit-{k}", []) == []
            with pytest.raises(IdempotencyConflict):
                coord.submit_tasks(f"submit-{k}", [TaskSpec("other")])
    with (
        SharedFilesystemStore(root, RUN) as store,
        Coordinator(store, exclusive_owner=OWNER, recover=True) as coord,
    ):
        assert len(coord._state.requests) <= 32
        for k in range(0, calls, 11):
            assert coord.submit_tasks(f"submit-{k}", []) == []
            with pytest.raises(IdempotencyConflict):
                coord.submit_tasks(f"submit-{k}", [TaskSpec("other")])


GOLDEN = (
    "5354525748495354010000000000000007000000000000000000000000000000"
    "78018b8e562a518a8d0500089d022978018bae564ace2fcd2b2956b2aa564a4b"
    "cccc494d51b232acad8d0500747f08d72df9acf0853e03762000000000000000"
    "0f000000000000001819b4af93d740175354525748454e440000000000000000"
    "0000000000000000010000000000000000000000000000005000000000000000"
    "2f000000000000002100000000000000cd2c51c8c2d6e1f8f7955046ba3f7d18"
)


def test_the_shell_and_the_format_name_the_same_directory() -> None:
    assert history_io.HIST_DIR == history.HIST_DIR


def test_a_rewind_takes_back_history_that_lives_on_disk(tmp_path: Path) -> None:
    """The training consumer acknowledges everything, GC releases it, snapshots move it to disk;
    a rewind to a checkpoint that kept the results makes that history readable again, from
    the history files, before and after a reopen."""
    root = str(tmp_path)
    with SharedFilesystemStore(root, RUN, online_gc=True) as store:
        coord = Coordinator(store, exclusive_owner=OWNER)
        coord.submit_tasks("tasks", [TaskSpec(f"t{i:02d}") for i in range(4)])
        done = _work(coord, 4)
        kept = store.publish(
            [Record("ckpt", b"c")], submission_id="ckpt", dependencies=[r.result_ref for r, _, _ in done]
        )
        store.retain("checkpoint", [kept])
        token = coord.open_consumer("training", exclusive_owner="trainer")
        state = store.publish([Record("state", b"s")], submission_id="state")

        def save(name: str, cursor: int) -> None:
            coord.save_consumer_state(
                "training",
                token=token,
                request_id=name,
                state_ref=state,
                fetch_cursor=cursor,
                processed_cursor=cursor,
            )

        save("advance", 4)
        coord.collect_garbage()
        coord.seal_input("seal")  # a few more calls: snapshots move the history to disk
        assert coord._state.commits.base == 4
        with pytest.raises(InvalidReference, match="released"):
            coord.read_commits(0, 4)
        save("restore", 0)
        assert list(coord.read_commits(0, 4).commits) == [r for r, _, _ in done]
        coord.close()
        with Coordinator(store, exclusive_owner=OWNER, recover=True) as again:
            assert list(again.read_commits(0, 4).commits) == [r for r, _, _ in done]
            assert again.collect_garbage()["queue_packs"] >= 1  # the results are roots again
            assert all(len(list(store.read(r.result_ref))) == 1 for r, _, _ in done)


class _Bytes:
    """A history Source over bytes in memory (golden tests)."""

    def __init__(self, name: str, data: bytes) -> None:
        self.path, self._data = name, data

    def size(self) -> int:
        return len(self._data)

    def pread(self, size: int, offset: int) -> bytes:
        return self._data[offset : offset + size]

    def keep_open(self) -> None:
        pass

    def close(self) -> None:
        pass


def _tiny_run() -> tuple[list[bytes], int, history.HistoryFile]:
    chunks, checksum = history.build(
        7, 0, [("t", ["t"])], [], {"counts": {"failed": 1}}, [("r", ["r", "f", True])]
    )
    data = b"".join(chunks)
    file = history.HistoryFile(history.file_name(7), _Bytes("7", data), len(data), checksum)
    entries = history.run_entries([], [file], 0)
    run_chunks, run_checksum = history.build_run(0, [file], entries, history.covered_digest([file]))
    return run_chunks, run_checksum, file


def test_golden_bytes_of_a_tiny_index_run() -> None:
    """docs/FORMAT.md 8.5 shows these bytes: the run over the version 2 golden file (one task,
    no submission, one request)."""
    chunks, checksum, _ = _tiny_run()
    data = b"".join(chunks)
    assert data.hex() == GOLDEN_RUN
    assert checksum == int.from_bytes(data[-8:], "little")
    run = history.IndexRun("r", _Bytes("r", data), len(data), checksum, 0, 1)
    assert run.counts == (1, 0, 1) and run.filters == (8, 8, 8)
    assert list(run.find(0, history.key_hash("t"))) == [(0, 0)]
    assert list(run.find(2, history.key_hash("r"))) == [(0, 0)]
    assert list(run.find(1, history.key_hash("s"))) == [] and list(run.find(0, history.key_hash("u"))) == []
    run.verify()


GOLDEN_RUN = (
    "5354525748494458010000000000000000000000000000000100000000000000"
    "2df9acf0853e03760000000000000000350bafb4f7387bbd0000000000000000"
    "2df9acf0853e037672d84e317251bbaf350bafb4f7387bbd2449bfa993fb6544"
    "0000000000208410000000000000000000000004081020005354525748495845"
    "0100000000000000000000000000000001000000000000000800000000000000"
    "08000000000000000800000000000000ac14a75a476c108136f9366327f4cf80"
)


def test_index_runs_refuse_damage_and_answer_every_key_of_many_pages(tmp_path: Path) -> None:
    """A run over files of thousands of keys answers each key's (file, place) through its pages;
    a flipped byte anywhere fails its load, its page or its trailer with CorruptData naming it."""
    files = []
    for number in range(3):
        keys = [f"k{number}-{i}" for i in range(1500)]
        chunks, checksum = history.build(number, 0, [(k, [k]) for k in keys], [], {"counts": {}}, [])
        data = b"".join(chunks)
        files.append(history.HistoryFile(f"f{number}", _Bytes(f"f{number}", data), len(data), checksum))
    chunks, checksum = history.build_run(
        0, files, history.run_entries([], files, 0), history.covered_digest(files)
    )
    data = b"".join(chunks)
    run = history.IndexRun("r", _Bytes("r", data), len(data), checksum, 0, 3)
    for number, file in enumerate(files):
        hashes = file.load()[0]
        for place in range(0, 1500, 7):
            assert (number, place) in list(run.find(0, hashes[place]))
    misses = sum(1 for i in range(2000) if list(run.find(0, history.key_hash(f"miss-{i}"))))
    assert misses == 0
    # The filter lets about one miss in 80 through to a page read (10 bits per key, 4 probes).
    maybe = sum(run.holds(0, history.key_hash(f"other-{i}")) for i in range(20000))
    assert maybe < 20000 * 0.03
    for at in (5, history.RUN_HEADER.size + 100, len(data) - history.RUN_TRAILER.size - 3, len(data) - 1):
        bad = bytearray(data)
        bad[at] ^= 0x04
        with pytest.raises(CorruptData, match="index r is damaged"):
            damaged = history.IndexRun("r", _Bytes("r", bytes(bad)), len(data), checksum, 0, 3)
            damaged.verify()


def test_the_index_held_in_memory_stays_small_as_completed_history_grows(tmp_path: Path) -> None:
    """Issue 12, counted on structures, not timed: the index the live state holds for the history
    on disk (runs' fences and filters, merged or loaded hashes) grows by under 3 bytes per
    completed task (the in-memory merged index held 32: a task hash and a submission hash with
    their file and place), and the live maps stay bounded by the work since the last snapshot."""
    root = str(tmp_path)
    batch, rounds = 64, 60
    footprint: list[tuple[int, int, int, int]] = []
    with SharedFilesystemStore(root, RUN) as store, Coordinator(store, exclusive_owner=OWNER) as coord:
        for k in range(rounds):
            coord.submit_tasks(f"s{k}", [TaskSpec(f"t{k:03d}-{i:02d}") for i in range(batch)])
            leases = [a.lease for a in coord.acquire("w", batch).assignments]
            refs = [qh.result_for(store, x, submission_id=f"c-{x.task_id}") for x in leases]
            coord.complete_tasks(
                [
                    {
                        "lease": x,
                        "submission_id": f"c-{x.task_id}",
                        "result_ref": r,
                        "result_digest": r.digest,
                    }
                    for x, r in zip(leases, refs, strict=True)
                ]
            )
            assert coord.task_status(f"never-{k}") is None and coord.lookup_submission(f"never-{k}") is None
            state = coord._state
            hist = state.history
            live = len(state.tasks) + len(state.submissions) + len(state.requests)
            # The few files no run covers yet keep their hashes: bounded by the files per run.
            newest = history.History(hist.files[hist.run_stop :]).memory_bytes()
            footprint.append(((k + 1) * batch, hist.memory_bytes() - newest, newest, live))
        assert hist.runs and hist.merged_indexes is None
    (half, at_half, _, _), (full, at_full, _, _) = footprint[rounds // 2 - 1], footprint[-1]
    assert (at_full - at_half) / (full - half) < 3
    assert max(newest for _, _, newest, _ in footprint) <= (HISTORY_UNMERGED_FILES_MAX + 1) * 3 * 8 * batch
    assert max(live for _, _, _, live in footprint) <= 16 * batch  # not the 3840 tasks completed


def test_a_run_that_fails_to_be_written_skips_its_snapshot_and_loses_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """J5 H1 for runs: a full disk while writing an index run fails that snapshot (counted); the
    live state keeps what it had, lookups stay exact, and a later snapshot writes the run."""
    root = str(tmp_path)
    real = coordinator_module.durable.replace_file
    failing = {"on": True}

    def replace_file(path: str, *args: object, **kwargs: object) -> None:
        if failing["on"] and path.endswith(history.RUN_SUFFIX):
            raise OSError(28, "No space left on device")
        real(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(coordinator_module.durable, "replace_file", replace_file)
    with SharedFilesystemStore(root, RUN) as store, Coordinator(store, exclusive_owner=OWNER) as coord:
        coord.submit_tasks("tasks", [TaskSpec(f"t{i:02d}") for i in range(TASKS)])
        done = _work(coord, TASKS - 2, "w1")
        assert coord.metrics()["counters"]["snapshots_failed"] > 0
        assert not coord._state.history.runs and not _run_files(root)
        for receipt, _, _ in done:
            assert coord.lookup_submission(receipt.submission_id) == receipt
        failing["on"] = False
        coord._journal.snapshot_bytes = 0
        done += _work(coord, 1, "w1")
        assert coord._state.history.runs
    assert qh.descriptors_under(root) == []  # the history files of the failed snapshots too
    with (
        SharedFilesystemStore(root, RUN) as store,
        Coordinator(store, exclusive_owner=OWNER, recover=True) as coord,
    ):
        for receipt, _, _ in done:
            assert coord.lookup_submission(receipt.submission_id) == receipt
            assert coord.task_status(receipt.task_id)["state"] == "completed"  # type: ignore[index]


def test_building_a_run_holds_about_twice_its_bytes_at_once() -> None:
    """Counted with tracemalloc, not timed: a run build (the snapshot thread's transient, bounded
    by HISTORY_RUN_ENTRIES_MAX) holds under 40 bytes per entry at its peak plus a constant, the
    run's own 16 included (one index's temporaries at a time, its filter built in chunks,
    absorbed runs freed before the sort); the build held about 60 before."""
    files = []
    for number in range(4):
        keys = [f"k{number}-{i}" for i in range(25_000)]
        chunks, checksum = history.build(number, 0, [(k, [k]) for k in keys], [], {"counts": {}}, [])
        data = b"".join(chunks)
        files.append(history.HistoryFile(f"f{number}", _Bytes(f"f{number}", data), len(data), checksum))
        files[-1].load()
    first = history.build_run(
        0, files[:2], history.run_entries([], files[:2], 0), history.covered_digest(files[:2])
    )
    data = b"".join(first[0])
    absorbed = history.IndexRun("r", _Bytes("r", data), len(data), first[1], 0, 2)
    absorbed.load()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        chunks, _ = history.build_run(
            0, files, history.run_entries([absorbed], files[2:], 2), history.covered_digest(files)
        )
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    entries = 4 * 25_000
    assert sum(len(c) for c in chunks) > 16 * entries
    assert peak < 40 * entries + 4 * 2**20  # plus the filter's chunk of temporaries, a constant


def test_a_state_reading_history_files_is_freed_without_the_cycle_collector(tmp_path: Path) -> None:
    """The commit log reads receipts below its base through the History, not through its
    QueueState: a dropped state or snapshot copy holds no reference cycle, so reference counting
    frees it, with its copies of every live task, at once. (Through the state, each dropped
    snapshot copy waited for a full collection, which paused every thread of the process.)"""
    import weakref

    root = str(tmp_path)
    _build(root)
    with (
        SharedFilesystemStore(root, RUN) as store,
        Coordinator(store, exclusive_owner=OWNER, recover=True) as coord,
    ):
        state = coord._state
        assert state.commits.base > 0 and state.history.files
        copy = state.snapshot_copy()
        assert copy.commits[0] == state.commits[0]  # read from a history file through the copy
        dropped = weakref.ref(copy)
        gc.disable()
        try:
            del copy
            assert dropped() is None
        finally:
            gc.enable()


@settings(max_examples=300, deadline=None)
@given(
    cursor=st.integers(0, 40),
    positions=st.frozensets(st.integers(0, 60), max_size=12),
    start=st.integers(0, 60),
    length=st.integers(0, 25),
)
def test_range_questions_agree_with_asking_every_position(
    cursor: int, positions: frozenset[int], start: int, length: int
) -> None:
    """``covers_all`` / ``covers_any`` answer what asking ``covers`` for each position of the
    range would (an empty range is all acknowledged and has none acknowledged)."""
    acked = acknowledged({"processed_cursor": cursor}, (positions, ()))
    stop = start + length
    each = [acked.covers(p) for p in range(start, stop)]
    assert acked.covers_all(start, stop) == all(each)
    assert acked.covers_any(start, stop) == any(each)


def test_usage_and_roots_over_history_files_are_exact_and_keep_no_file_decoded(tmp_path: Path) -> None:
    """Unprocessed results on disk count exactly in ``metrics()`` (files wholly processed,
    untouched and cut by the training cursor or a listed position), and neither that nor a
    collection leaves a file's meta row decoded in memory: each file keeps only three totals."""
    root = str(tmp_path)
    with SharedFilesystemStore(root, RUN) as store, Coordinator(store, exclusive_owner=OWNER) as coord:
        coord.submit_tasks("tasks", [TaskSpec(f"t{i:02d}") for i in range(12)])
        refs: dict[int, RecordSetRef] = {}
        for _ in range(4):  # one call, one snapshot, one history file of three positions
            leases = [a.lease for a in coord.acquire("w", 3).assignments]
            entries = []
            for lease in leases:
                ref = qh.result_for(store, lease, submission_id=f"sub-{lease.task_id}")
                entries.append(
                    {
                        "lease": lease,
                        "submission_id": f"sub-{lease.task_id}",
                        "result_ref": ref,
                        "result_digest": ref.digest,
                    }
                )
            for receipt, entry in zip(coord.complete_tasks(entries), entries, strict=True):
                refs[receipt.position] = entry["result_ref"]
        coord.seal_input("seal")  # another snapshot: the first nine positions are on disk
        files = coord._state.history.files
        assert [(f.first, f.stop) for f in files if f.stop > f.first] == [(0, 3), (3, 6), (6, 9)]
        assert coord._state.commits.base == 9  # the last three still in memory

        def unprocessed() -> dict[str, int]:
            used = coord.metrics()["usage_with_reservations"]["accepted_unprocessed"]
            return {k: used[k] for k in ("records", "bytes", "tokens")}

        def expected(acked: set[int]) -> dict[str, int]:
            rest = [r for p, r in refs.items() if p not in acked]
            return {
                "records": sum(r.records for r in rest),
                "bytes": sum(r.payload_bytes for r in rest),
                "tokens": sum(r.tokens for r in rest),
            }

        assert unprocessed() == expected(set())
        token = coord.open_consumer("training", exclusive_owner="trainer")
        state = store.publish([Record("state", b"s")], submission_id="state")
        progress = store.publish(
            [
                Record(
                    "p",
                    encode({"version": 1, "processed_positions": [7, 10], "finished_batches": []}),
                    codec="json.v1",
                )
            ],
            submission_id="progress",
        )
        coord.save_consumer_state(
            "training",
            token=token,
            request_id="save",
            state_ref=state,
            fetch_cursor=12,
            processed_cursor=4,
            progress_ref=progress,
        )
        # File (0, 3) wholly processed, (3, 6) cut by the cursor, (6, 9) by a listed position, and
        # the same for the positions still in memory (10).
        assert unprocessed() == expected({0, 1, 2, 3, 7, 10})
        coord.collect_garbage()
        files = coord._state.history.files
        kept = [f for f in files if f._block is not None]
        assert len(kept) <= 1, "only the file a lookup read last keeps a block (History._warm)"
        assert all(f._block[0] != f._meta_entry[0] for f in kept), "no file keeps its meta row"
        for p, ref in refs.items():  # what is not processed is still readable (a root)
            if p not in {0, 1, 2, 3, 7, 10}:
                assert len(list(store.read(ref))) == 1


def test_a_retire_reads_history_files_without_the_lock_and_answers_work_done_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A retire reads the worker's receipts in history files before taking the coordinator's
    lock: while that read is held, other calls go on, even ones that write a new history file;
    the answer still names every receipt of the worker (the new file is read under the lock)
    and no file is read twice."""
    root = str(tmp_path)
    _build(root)
    store = SharedFilesystemStore(root, RUN)
    coord = Coordinator(store, exclusive_owner=OWNER, recover=True)
    reads: list[str] = []
    entered, release = threading.Event(), threading.Event()
    original = history.HistoryFile.worker_receipts

    def held(file: history.HistoryFile, worker: str) -> list[dict[str, Any]]:
        reads.append(file.name)
        if len(reads) == 1:
            entered.set()
            assert release.wait(30), "the test never released the read"
        return original(file, worker)

    monkeypatch.setattr(history.HistoryFile, "worker_receipts", held)
    files_before = len(coord._state.history.files)
    answers: list[list[dict[str, Any]]] = []
    retiring = threading.Thread(target=lambda: answers.append(coord.retire_worker("w1")))
    retiring.start()
    try:
        assert entered.wait(30)

        # The retire is reading: a worker acquires and completes under the lock meanwhile, and
        # the snapshots of the next calls move the result to a new history file.
        def meanwhile() -> None:
            _work(coord, 1, "w1")
            for more in range(4):  # (a file is written by one snapshot, taken in by a later one)
                coord.submit_tasks(f"more-{more}", [TaskSpec(f"m{more}")])

        other = threading.Thread(target=meanwhile)
        other.start()
        other.join(30)
        assert not other.is_alive(), "a call waited for the retire's reading of history"
        assert len(coord._state.history.files) > files_before
    finally:
        release.set()
        retiring.join(30)
    assert not retiring.is_alive()
    assert [r["position"] for r in answers[0]] == list(range(TASKS - 1))
    assert sorted(reads) == sorted(f.name for f in coord._state.history.files)  # each file once
    assert coord.heartbeat([]) == []
    coord.close()
    store.close()


def test_a_worker_table_naming_positions_outside_its_file_fails_the_retire_closed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A history file whose worker table names positions it does not hold fails the retire with
    CorruptData naming the file, before anything is journaled: the worker's lease still holds."""
    root = str(tmp_path)
    _build(root)
    store = SharedFilesystemStore(root, RUN)
    with Coordinator(store, exclusive_owner=OWNER, recover=True) as coord:
        lease = coord.acquire("w1").assignments[0].lease
        first = coord._state.history.files[0]
        meta = history.HistoryFile.meta

        def damaged(file: history.HistoryFile) -> Any:
            row = meta(file)
            if file is first:
                row = {**row, "workers": {"w1": [file.stop + 5]}}
            return row

        monkeypatch.setattr(history.HistoryFile, "meta", damaged)
        with pytest.raises(CorruptData, match=first.name):
            coord.retire_worker("w1")
        monkeypatch.setattr(history.HistoryFile, "meta", meta)
        assert coord.heartbeat([lease]) == ["extended"]  # the retire did not happen
        assert [r["position"] for r in coord.retire_worker("w1")] == list(range(TASKS - 2))
        assert coord.heartbeat([lease]) == ["StaleAttempt"]
    store.close()


@settings(max_examples=200, deadline=None)
@given(
    st.integers(0, 30),
    st.frozensets(st.integers(0, 40), max_size=8),
    st.integers(0, 30),
    st.frozensets(st.integers(0, 40), max_size=8),
)
def test_includes_agrees_with_asking_every_position(
    cursor: int, positions: frozenset[int], other_cursor: int, other_positions: frozenset[int]
) -> None:
    """``a.includes(b)``: every position ``b`` acknowledges, ``a`` acknowledges too."""
    a = acknowledged({"processed_cursor": cursor}, (positions, ()))
    b = acknowledged({"processed_cursor": other_cursor}, (other_positions, ()))
    assert a.includes(b) == all(a.covers(p) for p in range(50) if b.covers(p))


def _separate_packs(root: str, coord: Coordinator, count: int) -> dict[int, RecordSetRef]:
    """``count`` results, each published by a store of its own (a pack of its own)."""
    refs: dict[int, RecordSetRef] = {}
    for _ in range(count):
        lease = coord.acquire("w").assignments[0].lease
        with SharedFilesystemStore(root, RUN) as own:
            ref = qh.result_for(own, lease, submission_id=f"sub-{lease.task_id}")
        receipt = coord.complete_task(
            lease, submission_id=f"sub-{lease.task_id}", result_ref=ref, result_digest=ref.digest
        )
        refs[receipt.position] = ref
    return refs


def _acknowledge(coord: Coordinator, token: str, cursor: int, request_id: str) -> None:
    state = coord.store.publish([Record("state", b"s")], submission_id=f"state-{request_id}")
    coord.save_consumer_state(
        "training",
        token=token,
        request_id=request_id,
        state_ref=state,
        fetch_cursor=cursor,
        processed_cursor=cursor,
    )


def test_a_collection_reads_history_before_the_lock_and_a_rewind_meanwhile_keeps_everything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A collection reads what history files need before taking the coordinator's lock, and
    other calls go on meanwhile; it collects what it would have collected reading them under
    the lock. A consumer that rewinds in between makes it read them again under the lock: the
    results the rewind gave back to the queue keep their packs."""
    root = str(tmp_path)
    with SharedFilesystemStore(root, RUN) as store, Coordinator(store, exclusive_owner=OWNER) as coord:
        coord.submit_tasks("tasks", [TaskSpec(f"t{i:02d}") for i in range(8)])
        refs = _separate_packs(root, coord, 6)
        token = coord.open_consumer("training", exclusive_owner="trainer")
        _acknowledge(coord, token, 4, "ack-4")
        assert coord._state.history.base >= 4  # positions 0-3 live in history files
        packs = {p: ref.manifest.segment.path for p, ref in refs.items()}
        assert len(set(packs.values())) == len(packs)
        original = coordinator_module.history_needs
        seen: list[Any] = []

        # 1. A rewind between the reading and the lock: what was read (under cursor 4, so
        # without the packs of positions 0-3) is not used, and every result keeps its pack.
        def rewinding(files: Any, acked: Any) -> Any:
            found = original(files, acked)
            seen.append(found)
            _acknowledge(coord, token, 0, "rewind-0")
            return found

        monkeypatch.setattr(coordinator_module, "history_needs", rewinding)
        coord.collect_garbage()
        assert not {packs[p] for p in range(4)} & set().union(*(n[0] for n in seen[0].values()))
        assert {packs[p] for p in range(6)} <= set(coord._owned)
        for ref in refs.values():
            assert list(store.read(ref))
        _acknowledge(coord, token, 4, "ack-4-again")

        # 2. The reading is held: a call goes on meanwhile.
        entered, release = threading.Event(), threading.Event()

        def held(files: Any, acked: Any) -> Any:
            entered.set()
            assert release.wait(30)
            return original(files, acked)

        monkeypatch.setattr(coordinator_module, "history_needs", held)
        collecting = threading.Thread(target=coord.collect_garbage)
        collecting.start()
        try:
            assert entered.wait(30)
            other = threading.Thread(target=lambda: coord.heartbeat([]))
            other.start()
            other.join(30)
            assert not other.is_alive(), "a call waited for the collection's reading of history"
        finally:
            release.set()
            collecting.join(30)
        assert not collecting.is_alive()
        with_ahead = set(coord._owned)
        assert not {packs[p] for p in range(4)} & with_ahead  # processed: no longer the queue's
        assert {packs[p] for p in range(4, 6)} <= with_ahead

        # 3. The same collection reading every file under the lock owns the same packs.
        monkeypatch.setattr(coordinator_module, "history_needs", lambda files, acked: {})
        coord.collect_garbage()
        assert set(coord._owned) == with_ahead


def _history_descriptors(suffix: str, under: str) -> int:
    """Descriptors of this process open on queue history files (``suffix``: or index runs)
    under the directory ``under`` (a deleted file's link ends with " (deleted)")."""
    inside = f"{os.sep}{history.HIST_DIR}{os.sep}"
    held = qh.descriptors_under(under)
    return sum(inside in t and t.removesuffix(" (deleted)").endswith(suffix) for t in held)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors through /proc")
def test_walking_every_history_file_keeps_a_bounded_number_of_descriptors_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = str(tmp_path)  # (descriptors are counted under it: other tests' queues may be open)
    done = _build(root)
    limit = 3
    monkeypatch.setattr(history_io.OPEN, "limit", limit)
    with (
        SharedFilesystemStore(root, RUN) as store,
        Coordinator(store, exclusive_owner=OWNER, recover=True) as coord,
    ):
        files = coord._state.history.files
        assert len(files) > limit + 2  # each walk below reads more files than may stay open
        receipts = [r for r, _, _ in done]
        for cursor in range(len(receipts)):  # paging through history reads every file in turn
            assert list(coord.read_commits(cursor, 1).commits) == receipts[cursor : cursor + 1]
            assert _history_descriptors(history.SUFFIX, root) <= limit
        assert [r["position"] for r in coord.retire_worker("w1")] == list(range(TASKS - 2))
        assert _history_descriptors(history.SUFFIX, root) <= limit
        coord.collect_garbage()
        assert _history_descriptors(history.SUFFIX, root) <= limit
        _assert_exact(coord, done)  # files given up are read again, answers unchanged
        assert 0 < _history_descriptors(history.SUFFIX, root) <= limit
    assert _history_descriptors(history.SUFFIX, root) == 0  # close gives up every descriptor left


def test_sources_giving_up_descriptors_to_each_other_read_exact_bytes_from_many_threads(
    tmp_path: Path,
) -> None:
    """Readers of more files than may stay open at once close each other's descriptors as they
    go (never one in use: each read holds its source's lock): every read still returns the
    file's bytes, and no more than the limit stay open."""
    files = history_io.OpenFiles(limit=2)
    contents = [bytes([n]) * 4096 + os.urandom(4096) for n in range(7)]
    sources = []
    for n, data in enumerate(contents):
        path = tmp_path / f"{n}.hist"
        path.write_bytes(data)
        sources.append(history_io.FileSource(str(path), files))
    errors: list[str] = []
    start = threading.Barrier(4)

    def reader(seed: int) -> None:
        start.wait()
        for step in range(300):  # bounded: 4 threads x 300 reads
            n = (seed * 7 + step * (seed + 1)) % len(sources)
            offset = (step * 512) % 4096
            got = bytes(sources[n].pread(512, offset + 4096 * (step % 2)))
            if got != contents[n][offset + 4096 * (step % 2) :][:512]:
                errors.append(f"file {n} at {offset}: wrong bytes")

    threads = [threading.Thread(target=reader, args=(k,)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == [] and not any(thread.is_alive() for thread in threads)
    assert len(files) <= 2
    assert sum(source._fd is not None for source in sources) <= 2
    for source in sources:
        source.close()
    assert len(files) == 0 and all(source._fd is None for source in sources)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors through /proc")
def test_a_run_keeps_its_descriptor_while_other_files_give_theirs_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """H3: the live state reads the runs a snapshot thread absorbed until it takes the new ones
    over, and H4 may prune their files meanwhile; such a run answers through the descriptor it
    opened for its trailer. Files giving their descriptors up (HISTORY_OPEN_FILES_MAX) must not
    take a run's: here the run files are deleted, every history file is walked with room for
    one descriptor, and every lookup through the runs still answers."""
    monkeypatch.setattr(history, "HISTORY_RUN_ENTRIES_MAX", 24)
    root = str(tmp_path)
    with SharedFilesystemStore(root, RUN) as store, Coordinator(store, exclusive_owner=OWNER) as coord:
        coord.submit_tasks("tasks", [TaskSpec(f"t{i:02d}") for i in range(4 * TASKS)])
        done = _work(coord, 4 * TASKS, "w1")
    monkeypatch.setattr(history_io.OPEN, "limit", 1)
    with (
        SharedFilesystemStore(root, RUN) as store,
        Coordinator(store, exclusive_owner=OWNER, recover=True) as coord,
    ):
        hist = coord._state.history
        assert hist.runs and len(hist.files) > 2
        for run in hist.runs:
            os.unlink(run.path)  # as H4 prunes an absorbed run the live state still reads
        receipts = [r for r, _, _ in done]
        assert list(coord.read_commits(0, len(receipts)).commits) == receipts  # every file read
        assert _history_descriptors(history.SUFFIX, root) <= 1
        assert _history_descriptors(history.RUN_SUFFIX, root) == len(hist.runs)  # each keeps its own
        for receipt in receipts:
            assert coord.lookup_submission(receipt.submission_id) == receipt
