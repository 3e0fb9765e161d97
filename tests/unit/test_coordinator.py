"""The Coordinator (API.md section 7): every call and its return shape, the chosen semantics,
refusals that change nothing, recovery, snapshots, namespaced queues and journal faults.

Semantics chosen where the contract is silent (tested as written): ``coordinator_epoch``
starts at 1 and grows by one per recovery; a grant spends no attempt, while expiry reclaim,
recovery revocation, ``retire_worker`` and ``fail_task`` spend one; released and yielded
tasks spend none; returned tasks go to the FIFO tail of their priority and key;
``end_of_input`` once sealed and nothing is pending or leased; ``draining`` after ``drain()``
until recovery; heartbeats are not journaled; ``complete_task`` checks the submission id,
then the digest, then the lease, then result ownership; a journal failure stops the
coordinator until it is reopened with ``recover=True``. Time is an injected clock.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import queue_helpers as qh
import straw.coordinator as coordinator_module
from straw import Coordinator, Limits, Record, RecordSetRef, SharedFilesystemStore, TaskSpec
from straw._queue import events
from straw._queue.machine import QueueState
from straw.backend import FilesystemBackend
from straw.errors import (
    CorruptData,
    IdempotencyConflict,
    InvalidReference,
    LeaseExpired,
    StaleAttempt,
    UnsafeRecovery,
)
from straw.protocol import (
    AcquireResult,
    Assignment,
    CommitPage,
    CommitReceipt,
    Lease,
    SegmentRef,
    decode,
    digest,
    encode,
)

RUN = "run-coordinator"
OWNER = "owner-1"
LEASE_S = 30.0


# --------------------------------------------------------------------------- fixtures and helpers


@pytest.fixture
def clock() -> Any:
    return qh.Clock()


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SharedFilesystemStore]:
    with SharedFilesystemStore(tmp_path, RUN) as opened:
        yield opened


@pytest.fixture
def opened() -> Iterator[list[Coordinator]]:
    """Coordinators to close after the test (closing twice or after a crash is harmless)."""
    items: list[Coordinator] = []
    yield items
    for item in items:
        with contextlib.suppress(Exception):
            item.close()


@pytest.fixture
def make(store: SharedFilesystemStore, clock: Any, opened: list[Coordinator]) -> Callable[..., Coordinator]:
    def factory(**kw: Any) -> Coordinator:
        kw.setdefault("exclusive_owner", OWNER)
        kw.setdefault("clock", clock)
        kw.setdefault("lease_seconds", LEASE_S)
        target = kw.pop("store", store)
        coordinator = Coordinator(target, **kw)
        opened.append(coordinator)
        return coordinator

    return factory


def lease_of(result: AcquireResult) -> Lease:
    assert result.status == "acquired" and len(result.assignments) == 1, result
    return result.assignments[0].lease


def take(coord: Coordinator, task_id: str, worker: str = "w1") -> Lease:
    return lease_of(coord.acquire(worker, task_ids=[task_id]))


def finish(coord: Coordinator, lease: Lease, sub: str, payload: bytes = b"result") -> CommitReceipt:
    ref = qh.result_for(coord.store, lease, submission_id=sub, payload=payload)
    return coord.complete_task(lease, submission_id=sub, result_ref=ref, result_digest=ref.digest)


def json_ref(store: SharedFilesystemStore, name: str, value: Any) -> RecordSetRef:
    return store.publish([Record(name, encode(value), codec="json.v1")], submission_id=f"json-{name}")


def states(coord: Coordinator) -> dict[str, str]:
    return {k: v["state"] for k, v in coord.tasks.items()}


def pending_ids(coord: Coordinator) -> list[str]:
    return [s.task_id for s in coord.pending_tasks()]


# --------------------------------------------------------------------------- the calls and their shapes


def test_fresh_queue_attributes(make: Any, store: SharedFilesystemStore, clock: Any, tmp_path: Path) -> None:
    coord = make()
    assert coord.store is store
    assert (coord.queue_id, coord.lease_seconds, coord.clock) == ("rollout", LEASE_S, clock)
    assert isinstance(coord.recovery_seconds, float) and coord.recovery_seconds >= 0
    assert coord.epoch == 1
    assert coord.directory == str(tmp_path / "queue")
    assert sorted(os.listdir(coord.directory)) == ["LOCK", "queue.json", "snap", "wal"]
    identity = decode((tmp_path / "queue" / "queue.json").read_bytes())
    assert (identity["run_id"], identity["queue_id"], identity["exclusive_owner"]) == (RUN, "rollout", OWNER)
    assert (coord.tasks, coord.commits, coord.checkpoints, coord.consumers) == ({}, [], {}, {})
    metrics = coord.metrics()
    assert metrics["tasks"] == {} and metrics["epoch"] == 1
    assert metrics["journal_bytes"] == sum(len(b) for b in qh.directory_files(coord.directory).values())
    assert metrics["recovery_seconds"] == coord.recovery_seconds


def test_submit_acquire_complete_return_shapes(make: Any, store: SharedFilesystemStore) -> None:
    coord = make()
    specs = [TaskSpec("a", metadata={"prompt": "x"}), TaskSpec("b", priority=2)]
    assert coord.submit_tasks("req-1", specs) == ["a", "b"]
    result = coord.acquire("worker-1", max_tasks=5)
    assert isinstance(result, AcquireResult) and result.status == "acquired"
    assert [type(a) for a in result.assignments] == [Assignment, Assignment]
    assert [a.task for a in result.assignments] == [specs[1], specs[0]]
    lease = result.assignments[1].lease
    assert isinstance(lease, Lease)
    assert (lease.run_id, lease.queue_id, lease.task_id, lease.generation, lease.coordinator_epoch) == (
        RUN,
        "rollout",
        "a",
        1,
        1,
    )
    assert lease.worker_id == "worker-1" and len(lease.attempt_id) == 32 and len(lease.token) == 32
    status = coord.task_status("a")
    assert status is not None
    assert (status["state"], status["spec"], status["lease"]) == (
        "leased",
        dataclasses.asdict(specs[0]),
        dataclasses.asdict(lease),
    )
    assert (status["generation"], status["failures"]) == (1, 0)
    assert coord.task_status("nope") is None
    ref = qh.result_for(store, lease, submission_id="s-a")
    receipt = coord.complete_task(lease, submission_id="s-a", result_ref=ref, result_digest=ref.digest)
    assert isinstance(receipt, CommitReceipt)
    assert (receipt.task_id, receipt.submission_id, receipt.digest, receipt.position, receipt.result_ref) == (
        "a",
        "s-a",
        ref.digest,
        0,
        ref,
    )
    assert len(receipt.commit_id) == 32
    assert coord.lookup_submission("s-a") == receipt
    assert coord.lookup_submission("unknown") is None
    assert coord.commits == [dataclasses.asdict(receipt)]
    page = coord.read_commits()
    assert isinstance(page, CommitPage)
    assert (page.commits, page.cursor, page.end_of_input) == ((receipt,), 1, False)
    assert coord.task_status("a")["state"] == "completed"  # type: ignore[index]
    assert coord.metrics()["tasks"] == {"leased": 1, "completed": 1}
    assert coord.pending_tasks() == []


def test_producer_state_commits_with_its_tasks(make: Any) -> None:
    coord = make()
    assert coord.producer_state("dataset") is None
    coord.submit_tasks("r1", [TaskSpec("a")], producer_id="dataset", producer_state={"cursor": 1})
    coord.submit_tasks(
        "r2", [TaskSpec("b"), TaskSpec("c")], producer_id="dataset", producer_state={"cursor": 3}
    )
    assert coord.producer_state("dataset") == {"cursor": 3}
    assert coord.submit_tasks("r1", [TaskSpec("a")], producer_id="dataset", producer_state={"cursor": 1}) == [
        "a"
    ]
    assert coord.producer_state("dataset") == {"cursor": 3}  # a repeated request changes nothing
    with pytest.raises(ValueError, match="producer_id"):
        coord.submit_tasks("r3", [TaskSpec("d")], producer_state={"cursor": 4})


def test_j6_heartbeat_outcomes_and_heartbeats_are_not_journaled(make: Any, clock: Any) -> None:
    coord = make()
    coord.submit_tasks("r", [TaskSpec("a"), TaskSpec("b"), TaskSpec("c")])
    la, lb = take(coord, "a"), take(coord, "b")
    clock.advance(LEASE_S - 1)
    journal = coord.metrics()["journal"]
    appends, size = journal["appends"], coord.metrics()["journal_bytes"]
    # Every sync so far is counted with the time it took (the device's share of the waits).
    assert journal["syncs"] > 0 and 0 <= journal["sync_us_max"] <= journal["sync_us_total"]
    assert coord.heartbeat([la]) == ["extended"]
    assert coord.metrics()["journal"]["appends"] == appends
    assert coord.metrics()["journal_bytes"] == size
    clock.advance(2)  # b expired, a extended to now - 1 + LEASE_S
    assert coord.heartbeat([la, lb]) == ["extended", "LeaseExpired"]
    assert take(coord, "c").task_id == "c"  # this acquire reclaims b
    foreign = dataclasses.replace(la, queue_id="elsewhere")
    assert coord.heartbeat([lb, foreign]) == ["StaleAttempt", "StaleAttempt"]
    assert coord.task_status("b")["failures"] == 1  # type: ignore[index]


def test_fail_release_yield_progress_cancel_seal_shapes(make: Any, store: SharedFilesystemStore) -> None:
    coord = make()
    coord.submit_tasks("r", [TaskSpec(t) for t in "abcdefg"])
    assert coord.fail_task(take(coord, "a"), request_id="f-a", failure="oops") == "pending"
    assert coord.fail_task(take(coord, "b"), request_id="f-b", failure="fatal", retryable=False) == "failed"
    assert coord.task_status("b")["failure"] == "fatal"  # type: ignore[index]
    lc, ld = take(coord, "c"), take(coord, "d")
    assert coord.release_tasks([lc, ld], request_id="rel") == ["released", "released"]
    assert coord.release_tasks([lc], request_id="rel-again") == ["StaleAttempt"]
    new_input = json_ref(store, "continuation", {"turn": 2})
    le = take(coord, "e")
    assert coord.yield_task(le, request_id="y-e", input_ref=new_input) == "pending"
    assert coord.task_status("e")["spec"]["input_ref"] == dataclasses.asdict(new_input)  # type: ignore[index]
    lf, lg = take(coord, "f"), take(coord, "g")
    assert (
        coord.yield_tasks(
            [{"lease": lf, "input_ref": None, "priority": 7, "scheduling_key": 3, "metadata": {"k": 1}}],
            request_id="y-f",
        )
        == "pending"
    )
    spec_f = coord.task_status("f")["spec"]  # type: ignore[index]
    assert (spec_f["priority"], spec_f["scheduling_key"], spec_f["metadata"]) == (7, 3, {"k": 1})
    assert coord.save_task_progress(lg, request_id="p-g", input_ref=new_input) == "saved"
    many = [{"lease": lg, "input_ref": new_input}]
    assert coord.save_task_progress_many(many, request_id="p-g2") == "saved"
    assert coord.task_status("g")["state"] == "leased"  # type: ignore[index]
    assert coord.task_status("g")["spec"]["input_ref"] == dataclasses.asdict(new_input)  # type: ignore[index]
    assert coord.cancel_task("g", request_id="c-g") == "cancelled"
    assert coord.cancel_task("b", request_id="c-b") == "failed"  # a finished task keeps its state
    assert coord.seal_input("seal") is True
    assert coord.seal_input("seal") is True
    assert {k: v["failures"] for k, v in coord.tasks.items()} == dict(
        a=1, b=1, c=0, d=0, e=0, f=0, g=0
    )  # release, yield and progress spend nothing


def test_outstanding_reads_and_release_task_reads(
    make: Any, store: SharedFilesystemStore, clock: Any
) -> None:
    coord = make()
    source = json_ref(store, "input", {"prompt": "hi"})
    coord.submit_tasks("r", [TaskSpec("a", input_ref=source), TaskSpec("b", input_ref=source), TaskSpec("c")])
    la, lb, _ = take(coord, "a"), take(coord, "b"), take(coord, "c")
    assert set(coord.outstanding_reads()) == {la, lb}  # c has no input to read
    finish(coord, la, "s-a")
    assert coord.outstanding_reads() == (lb,)
    clock.advance(LEASE_S)
    coord.acquire("w2", task_ids=[])  # reclaims b: its holder may still be reading
    assert coord.task_status("b")["state"] == "pending"  # type: ignore[index]
    assert coord.outstanding_reads() == (lb,)
    assert coord.release_task_reads([lb]) == 1
    assert coord.release_task_reads([lb]) == 0
    assert coord.outstanding_reads() == ()


def test_retire_worker_fences_it_and_returns_its_receipts(make: Any) -> None:
    coord = make()
    coord.submit_tasks("r", [TaskSpec(t) for t in "abc"])
    done = finish(coord, take(coord, "a", "w1"), "s-a")
    lb = take(coord, "b", "w1")
    lc = take(coord, "c", "w2")
    assert coord.retire_worker("w1") == [dataclasses.asdict(done)]
    assert (coord.task_status("b")["state"], coord.task_status("b")["failures"]) == ("pending", 1)  # type: ignore[index]
    with pytest.raises(StaleAttempt):
        finish(coord, lb, "s-b")
    assert coord.task_status("c")["state"] == "leased"  # type: ignore[index]
    assert coord.retire_worker("nobody") == []
    assert coord.heartbeat([lc]) == ["extended"]


def test_consumers_batches_and_checkpoints(make: Any, store: SharedFilesystemStore) -> None:
    coord = make()
    coord.submit_tasks("r", [TaskSpec("a"), TaskSpec("b")])
    finish(coord, take(coord, "a"), "s-a")
    finish(coord, take(coord, "b"), "s-b")
    token = coord.open_consumer("training", exclusive_owner="trainer-1")
    assert isinstance(token, str) and len(token) == 32
    with pytest.raises(UnsafeRecovery, match="trainer-1"):
        coord.open_consumer("training", exclusive_owner="trainer-2")
    assert coord.load_consumer_state("training") is None
    state_ref = json_ref(store, "state", {"step": 1})
    progress = json_ref(store, "progress", {"version": 1, "processed_positions": [0], "finished_batches": []})
    saved = coord.save_consumer_state(
        "training",
        token=token,
        request_id="save-1",
        state_ref=state_ref,
        fetch_cursor=2,
        processed_cursor=1,
        progress_ref=progress,
    )
    assert saved == {
        "version": 1,
        "state_ref": dataclasses.asdict(state_ref),
        "fetch_cursor": 2,
        "processed_cursor": 1,
        "progress_ref": dataclasses.asdict(progress),
    }
    assert coord.load_consumer_state("training") == saved
    # A checkpoint restored moves the cursors back (issue 10 item 3); then forward again.
    rewound = coord.save_consumer_state(
        "training", token=token, request_id="save-2", state_ref=state_ref, fetch_cursor=1, processed_cursor=0
    )
    assert (rewound["fetch_cursor"], rewound["processed_cursor"]) == (1, 0)
    assert (
        coord.save_consumer_state(
            "training",
            token=token,
            request_id="save-2b",
            state_ref=state_ref,
            fetch_cursor=2,
            processed_cursor=1,
            progress_ref=progress,
        )
        == saved
    )
    with pytest.raises(ValueError, match="fetch_cursor"):
        coord.save_consumer_state(
            "training",
            token=token,
            request_id="save-3",
            state_ref=state_ref,
            fetch_cursor=3,
            processed_cursor=1,
        )
    plan_ref = json_ref(store, "plan", {"rows": [0, 1]})
    batch = coord.plan_batch(
        "training", token=token, batch_id="b1", input_positions=[0, 1], plan_ref=plan_ref
    )
    assert batch == {
        "batch_id": "b1",
        "consumer_id": "training",
        "input_positions": [0, 1],
        "plan_ref": dataclasses.asdict(plan_ref),
        "ready": False,
    }
    assert (
        coord.plan_batch("training", token=token, batch_id="b1", input_positions=[0, 1], plan_ref=plan_ref)
        == batch
    )
    with pytest.raises(IdempotencyConflict, match="b1"):
        coord.plan_batch("training", token=token, batch_id="b1", input_positions=[1], plan_ref=plan_ref)
    with pytest.raises(ValueError, match="input_positions"):
        coord.plan_batch("training", token=token, batch_id="b2", input_positions=[2], plan_ref=plan_ref)
    ready_ref = json_ref(store, "ready", {"tensor": "x"})
    ready = coord.batch_ready(
        "training",
        token=token,
        batch_id="b1",
        ready_ref=ready_ref,
        state_ref=state_ref,
        fetch_cursor=2,
        processed_cursor=2,
    )
    assert ready["batch_id"] == "b1" and ready["ready_ref"] == dataclasses.asdict(ready_ref)
    assert ready["state"]["processed_cursor"] == 2
    got = coord.get_batch("b1")
    assert got is not None and got["ready"] is True and got["ready_ref"] == dataclasses.asdict(ready_ref)
    assert coord.get_batch("nope") is None
    checkpoint = json_ref(store, "ckpt", {"weights": "w"})
    entry = coord.register_checkpoint("ck-1", checkpoint)
    assert entry == {"checkpoint_id": "ck-1", "checkpoint_ref": dataclasses.asdict(checkpoint)}
    assert coord.register_checkpoint("ck-1", checkpoint) == entry
    with pytest.raises(InvalidReference, match="another reference"):
        coord.register_checkpoint("ck-1", plan_ref)
    assert coord.checkpoints == {"ck-1": entry}
    assert coord.release_checkpoint("ck-1") is True
    assert coord.release_checkpoint("ck-1") is False
    assert coord.checkpoints == {}
    assert coord.consumers == {"training": {"owner": "trainer-1", "open": True, "state": ready["state"]}}
    assert coord.close_consumer("training", token) is True
    with pytest.raises(StaleAttempt, match="not current"):
        coord.save_consumer_state(
            "training",
            token=token,
            request_id="save-4",
            state_ref=state_ref,
            fetch_cursor=2,
            processed_cursor=2,
        )
    token2 = coord.open_consumer("training", exclusive_owner="trainer-2")
    assert token2 != token
    assert coord.load_consumer_state("training") == ready["state"]  # the state survives owners


def test_metrics_drain_snapshot_close_and_context_manager(make: Any, store: SharedFilesystemStore) -> None:
    coord = make()
    coord.submit_tasks("r", [TaskSpec("a"), TaskSpec("b"), TaskSpec("c")])
    la = take(coord, "a")
    finish(coord, take(coord, "b"), "s-b")
    metrics = coord.metrics()
    assert metrics["tasks"] == {"pending": 1, "leased": 1, "completed": 1}
    assert {"journal_bytes", "recovery_seconds", "epoch", "commits", "sealed", "draining"} <= set(metrics)
    assert coord.drain() == {"pending": 1, "leased": 1, "completed": 1}
    assert coord.acquire("w").status == "draining"
    assert coord.metrics()["draining"] is True
    finish(coord, la, "s-a")  # leased work can still finish while draining
    ref = coord.snapshot()
    assert isinstance(ref, RecordSetRef)
    (record,) = list(store.read(ref))
    assert record.codec == "json.v1" and record.metadata["queue_id"] == "rollout"
    state = decode(bytes(record.payload))
    assert [t[0][0] for t in state["tasks"]] == ["a", "b", "c"]  # compact snapshot: spec field lists
    assert len(state["commits"]["rows"]) == 2  # packed: rows, their segments, the packs they name
    coord.close()
    coord.close()  # idempotent
    with pytest.raises(UnsafeRecovery, match="closed"):
        coord.acquire("w")
    with make(recover=True) as again:
        assert again.epoch == 2
        assert again.acquire("w").status == "acquired"  # recovery clears draining
    with pytest.raises(UnsafeRecovery, match="closed"):
        _ = again.tasks


def test_read_commits_pages_and_end_of_input(make: Any) -> None:
    coord = make()
    coord.submit_tasks("r", [TaskSpec(f"t{i}") for i in range(5)])
    receipts = [finish(coord, take(coord, f"t{i}"), f"s{i}") for i in range(4)]
    coord.seal_input("seal")
    page = coord.read_commits(0, 3)
    assert (page.commits, page.cursor, page.end_of_input) == (tuple(receipts[:3]), 3, False)
    page = coord.read_commits(3, 3)
    assert (page.commits, page.cursor, page.end_of_input) == ((receipts[3],), 4, False)  # t4 pending
    assert coord.acquire("w", task_ids=["t9"]).status == "empty"
    last = finish(coord, take(coord, "t4"), "s4")
    page = coord.read_commits(4)
    assert (page.commits, page.cursor, page.end_of_input) == ((last,), 5, True)
    assert coord.read_commits(5) == CommitPage((), 5, True)
    assert coord.read_commits(0, 2).end_of_input is False  # more to read
    for bad in ({"cursor": -1}, {"limit": 0}, {"cursor": True}):
        with pytest.raises(ValueError):
            coord.read_commits(**bad)


# --------------------------------------------------------------------------- chosen semantics


def test_epoch_starts_at_one_and_grows_by_one_per_recovery(make: Any) -> None:
    coord = make()
    assert coord.epoch == 1
    for expected in (2, 3, 4):
        coord.close()
        coord = make(recover=True)
        assert coord.epoch == coord.metrics()["epoch"] == expected
    qh.crash(coord)
    assert make(recover=True).epoch == 5


def test_attempts_spent_by_expiry_retire_recovery_and_fail_not_by_grants(make: Any, clock: Any) -> None:
    coord = make()
    coord.submit_tasks("r", [TaskSpec("a", max_attempts=4), TaskSpec("g", max_attempts=1)])
    for _ in range(3):  # grants and releases spend nothing
        coord.release_tasks([take(coord, "g")], request_id=f"rel-{clock.now}")
        clock.advance(1)
    assert coord.task_status("g")["failures"] == 0  # type: ignore[index]
    take(coord, "a")
    clock.advance(LEASE_S)
    coord.acquire("w", task_ids=[])  # expiry
    take(coord, "a", worker="doomed")
    coord.retire_worker("doomed")  # retire
    take(coord, "a")
    coord.close()
    coord = make(recover=True)  # recovery
    assert (coord.task_status("a")["state"], coord.task_status("a")["failures"]) == ("pending", 3)  # type: ignore[index]
    assert coord.fail_task(take(coord, "a"), request_id="f", failure="last") == "failed"  # fail: 4 of 4
    assert coord.task_status("a")["failures"] == 4  # type: ignore[index]


def test_control_tasks_only_for_control_acquires(make: Any) -> None:
    coord = make()
    coord.submit_tasks("r", [TaskSpec("ctl", control=True, priority=100), TaskSpec("work")])
    got = coord.acquire("w", max_tasks=10)
    assert [a.task.task_id for a in got.assignments] == ["work"]
    assert coord.acquire("w", max_tasks=10).status == "empty"
    got = coord.acquire("w", max_tasks=10, control=True)
    assert [a.task.task_id for a in got.assignments] == ["ctl"]
    assert coord.acquire("w", control=True).status == "empty"


def test_empty_until_sealed_then_end_of_input_once_nothing_is_pending_or_leased(make: Any) -> None:
    coord = make()
    assert coord.acquire("w").status == "empty"
    coord.seal_input("seal")
    assert coord.acquire("w").status == "end_of_input"
    assert coord.submit_tasks("empty-after-seal", []) == []
    with pytest.raises(ValueError, match="sealed"):
        coord.submit_tasks("late", [TaskSpec("late")])


def test_leased_work_keeps_the_queue_open_after_seal(make: Any) -> None:
    coord = make()
    coord.submit_tasks("r", [TaskSpec("a")])
    coord.seal_input("seal")
    lease = take(coord, "a")
    assert coord.acquire("w").status == "empty"
    coord.release_tasks([lease], request_id="rel")
    assert coord.acquire("w").status == "acquired"
    assert coord.acquire("w").status == "empty"


def test_a_pending_control_task_keeps_the_queue_open_after_seal(make: Any) -> None:
    coord = make()
    coord.submit_tasks("r", [TaskSpec("ctl", control=True)])
    coord.seal_input("seal")
    assert coord.acquire("w").status == "empty"
    assert coord.read_commits().end_of_input is False


def test_cancel_of_an_unknown_task_is_a_key_error_and_changes_nothing(make: Any) -> None:
    coord = make()
    coord.submit_tasks("r", [TaskSpec("a")])
    before = qh.observe(coord)
    with pytest.raises(KeyError, match="ghost"):
        coord.cancel_task("ghost", request_id="c")
    assert qh.observe(coord) == before
    assert coord.cancel_task("a", request_id="c") == "cancelled"  # the request id is still free


def test_i9_a_second_live_coordinator_is_refused_even_with_recover(
    make: Any, store: SharedFilesystemStore
) -> None:
    coord = make()
    coord.submit_tasks("r", [TaskSpec("a")])
    for recover in (False, True):
        with pytest.raises(UnsafeRecovery, match="held by a live coordinator"):
            make(recover=recover)
    with pytest.raises(UnsafeRecovery, match="held by a live coordinator"):
        make(recover=True, store=SharedFilesystemStore(store.backend.root, RUN))
    assert states(coord) == {"a": "pending"}  # the live one is untouched
    coord.close()
    assert states(make(recover=True)) == {"a": "pending"}


def test_reopening_needs_recover_true(make: Any) -> None:
    make().close()
    with pytest.raises(UnsafeRecovery, match="recover=True"):
        make()
    assert make(recover=True).epoch == 2


def test_recover_true_on_a_new_queue_creates_it(make: Any) -> None:
    assert make(recover=True).epoch == 1


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ({"limits": Limits(pending_tasks=7)}, "limits"),
        ({"queue_id": "another"}, "queue_id"),
        ({"store": "other-run"}, "run_id"),
    ],
    ids=["limits", "queue_id", "run_id"],
)
def test_recovering_with_another_identity_is_refused(
    make: Any, store: SharedFilesystemStore, change: dict[str, Any], fragment: str
) -> None:
    coord = make()
    coord.submit_tasks("r", [TaskSpec("a")])
    coord.close()
    before = qh.directory_files(coord.directory)
    if change.get("store") == "other-run":
        change = {"store": SharedFilesystemStore(store.backend.root, "other-run")}
    with pytest.raises(UnsafeRecovery, match=fragment):
        make(recover=True, **change)
    if "store" in change:
        change["store"].close()
    assert qh.directory_files(coord.directory) == before
    assert states(make(recover=True)) == {"a": "pending"}


def test_recovery_accepts_a_new_exclusive_owner_and_records_it(make: Any) -> None:
    coord = make()
    coord.submit_tasks("r", [TaskSpec("a")])
    coord.close()
    again = make(recover=True, exclusive_owner="the restarted job")
    assert states(again) == {"a": "pending"}
    identity = decode((Path(coord.directory) / "queue.json").read_bytes())
    assert identity["exclusive_owner"] == "the restarted job"
    again.close()
    assert states(make(recover=True)) == {"a": "pending"}  # and back again


@pytest.mark.parametrize("owner", [False, None, "", 0, True])
def test_a_missing_exclusive_owner_declaration_is_unsafe_recovery(make: Any, owner: Any) -> None:
    with pytest.raises(UnsafeRecovery, match="exclusive_owner"):
        make(exclusive_owner=owner)


def test_close_writes_a_snapshot(make: Any) -> None:
    coord = make()
    coord.submit_tasks("r", [TaskSpec("a")])
    last = coord._journal.last_seq
    coord.close()
    snaps = os.listdir(os.path.join(coord.directory, "snap"))
    assert snaps == [f"{last:020d}.snap"]
    applied = []
    real_apply = QueueState.apply

    def counting(self: QueueState, event: events.Event, **options: bool) -> Any:
        applied.append(event.OP)
        return real_apply(self, event, **options)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(QueueState, "apply", counting)
        make(recover=True)
    assert applied == ["epoch"]  # the snapshot held everything; only the new epoch is applied


# --------------------------------------------------------------------------- refusals change nothing


def test_complete_checks_submission_then_digest_then_lease_then_ownership(
    make: Any, store: SharedFilesystemStore, clock: Any
) -> None:
    coord = make()
    coord.submit_tasks("r", [TaskSpec("a"), TaskSpec("b"), TaskSpec("c")])
    la = take(coord, "a")
    ra = qh.result_for(store, la, submission_id="s-a")
    receipt = coord.complete_task(la, submission_id="s-a", result_ref=ra, result_digest=ra.digest)
    lb = take(coord, "b")
    foreign = qh.result_for(store, lb, submission_id="foreign", attempt_id="someone-else")
    # A physically re-laid-out, logically identical result (same records, new pack extent).
    relaid = qh.result_for(store, la, submission_id="s-a-again")
    assert relaid != ra and relaid.digest == ra.digest
    cases: list[tuple[Any, str, Callable[[], Any]]] = [
        # 1. the submission id: a retry answers with the receipt, even with a stale lease ...
        (
            None,
            "",
            lambda: coord.complete_task(
                la, submission_id="s-a", result_ref=relaid, result_digest=relaid.digest
            ),
        ),
        # ... and a changed digest conflicts before the digest is compared with the reference.
        (
            IdempotencyConflict,
            "s-a",
            lambda: coord.complete_task(la, submission_id="s-a", result_ref=ra, result_digest="0" * 64),
        ),
        # 2. (the digest, see the next test) 3. the lease, before ownership (the result is someone else's).
        (
            StaleAttempt,
            "no longer current",
            lambda: coord.complete_task(
                la, submission_id="new-2", result_ref=foreign, result_digest=foreign.digest
            ),
        ),
        # 4. ownership, with a current lease.
        (
            InvalidReference,
            "does not belong",
            lambda: coord.complete_task(
                lb, submission_id="new-3", result_ref=foreign, result_digest=foreign.digest
            ),
        ),
        (
            InvalidReference,
            "does not belong",
            lambda: coord.complete_task(lb, submission_id="new-4", result_ref=ra, result_digest=ra.digest),
        ),
    ]
    for error, fragment, call in cases:
        before = qh.observe(coord)
        if error is None:
            assert call() == receipt
        else:
            with pytest.raises(error, match=fragment):
                call()
        assert qh.observe(coord) == before
    clock.advance(LEASE_S)
    before = qh.observe(coord)
    with pytest.raises(LeaseExpired, match="expired"):  # an expired lease, before ownership
        coord.complete_task(lb, submission_id="new-5", result_ref=foreign, result_digest=foreign.digest)
    assert qh.observe(coord) == before
    assert coord.lookup_submission("s-a") == receipt and len(coord.commits) == 1


def test_complete_checks_the_digest_before_the_lease(make: Any, store: SharedFilesystemStore) -> None:
    coord = make()
    coord.submit_tasks("r", [TaskSpec("a")])
    lease = take(coord, "a")
    finish(coord, lease, "s-a")  # the lease is stale from now on
    ref = qh.result_for(store, lease, submission_id="other")
    before = qh.observe(coord)
    with pytest.raises(InvalidReference, match="does not match"):
        coord.complete_task(lease, submission_id="new-1", result_ref=ref, result_digest="0" * 64)
    assert qh.observe(coord) == before


def test_rejected_calls_raise_named_errors_and_change_nothing(
    make: Any, store: SharedFilesystemStore, clock: Any
) -> None:
    coord = make(limits=Limits(max_result_bytes=64, metadata_bytes=128))
    coord.submit_tasks("first", [TaskSpec(t) for t in "abcde"])
    la, lb, lc = take(coord, "a"), take(coord, "b"), take(coord, "c")
    coord.fail_task(lc, request_id="fail-c", failure="x")  # lc is now stale
    other_queue = dataclasses.replace(la, queue_id="another-queue")
    other_run = dataclasses.replace(la, run_id="another-run")
    forged = dataclasses.replace(la, token="f" * 32)
    big = store.publish(
        [Record("big", b"x" * 65, metadata={"task_id": "a", "attempt_id": la.attempt_id})],
        submission_id="big",
    )
    empty = store.publish([], submission_id="empty-result")
    ra = qh.result_for(store, la, submission_id="ok-a")
    forged_ref = dataclasses.replace(json_ref(store, "input", {"x": 1}), digest="0" * 64)
    token = coord.open_consumer("training", exclusive_owner="trainer")
    cases: list[tuple[type[BaseException], str, Callable[[], Any]]] = [
        (
            InvalidReference,
            "digest does not match",
            lambda: coord.submit_tasks("forged", [TaskSpec("q", input_ref=forged_ref)]),
        ),
        (
            InvalidReference,
            "digest does not match",
            lambda: coord.yield_task(lb, request_id="y-forged", input_ref=forged_ref),
        ),
        (InvalidReference, "digest does not match", lambda: coord.register_checkpoint("ck", forged_ref)),
        (
            InvalidReference,
            "digest does not match",
            lambda: coord.save_consumer_state(
                "training",
                token=token,
                request_id="sv",
                state_ref=forged_ref,
                fetch_cursor=0,
                processed_cursor=0,
            ),
        ),
        (IdempotencyConflict, "different request", lambda: coord.submit_tasks("first", [TaskSpec("z")])),
        (IdempotencyConflict, "already submitted", lambda: coord.submit_tasks("second", [TaskSpec("a")])),
        (IdempotencyConflict, "different request", lambda: coord.cancel_task("d", request_id="fail-c")),
        (IdempotencyConflict, "different request", lambda: coord.release_tasks([la], request_id="fail-c")),
        (ValueError, "same task id twice", lambda: coord.submit_tasks("dup", [TaskSpec("q"), TaskSpec("q")])),
        (KeyError, "unknown task", lambda: coord.cancel_task("ghost", request_id="cancel-ghost")),
        (StaleAttempt, "no longer current", lambda: coord.fail_task(lc, request_id="f2", failure="x")),
        (StaleAttempt, "no longer current", lambda: coord.fail_task(forged, request_id="f3", failure="x")),
        (StaleAttempt, "no longer current", lambda: coord.yield_task(lc, request_id="y1", input_ref=None)),
        (
            StaleAttempt,
            "no longer current",
            lambda: coord.save_task_progress(lc, request_id="p1", input_ref=ra),
        ),
        (
            InvalidReference,
            "another-queue",
            lambda: coord.fail_task(other_queue, request_id="f4", failure="x"),
        ),
        (
            InvalidReference,
            "another-queue",
            lambda: coord.complete_task(
                other_queue, submission_id="s1", result_ref=ra, result_digest=ra.digest
            ),
        ),
        (
            InvalidReference,
            "another-run",
            lambda: coord.complete_task(
                other_run, submission_id="s2", result_ref=ra, result_digest=ra.digest
            ),
        ),
        (
            InvalidReference,
            "does not match",
            lambda: coord.complete_task(la, submission_id="s3", result_ref=ra, result_digest=big.digest),
        ),
        (
            ValueError,
            "allow_empty",
            lambda: coord.complete_task(la, submission_id="s5", result_ref=empty, result_digest=empty.digest),
        ),
        (
            ValueError,
            "64-bit",
            lambda: coord.yield_tasks([{"lease": lb, "input_ref": None, "priority": 2**63}], request_id="y2"),
        ),
        (
            ValueError,
            "same task twice",
            lambda: coord.yield_tasks([{"lease": lb, "input_ref": None}] * 2, request_id="y3"),
        ),
        (
            StaleAttempt,
            "no longer current",
            lambda: coord.yield_tasks(
                [{"lease": lb, "input_ref": None}, {"lease": lc, "input_ref": None}], request_id="y4"
            ),
        ),
        (
            InvalidReference,  # a dict is read as a reference's asdict form
            "RecordSetRef",
            lambda: coord.yield_task(lb, request_id="y5", input_ref={"not": "a ref"}),  # type: ignore[arg-type]
        ),
        (
            TypeError,
            "RecordSetRef",
            lambda: coord.yield_task(lb, request_id="y6", input_ref=42),  # type: ignore[arg-type]
        ),
        (ValueError, "max_tasks", lambda: coord.acquire("w", max_tasks=0)),
        (ValueError, "worker_id", lambda: coord.acquire("")),
        (TypeError, "not one string", lambda: coord.acquire("w", task_ids="abc")),
        (
            ValueError,
            "submission_id",
            lambda: coord.complete_task(la, submission_id="", result_ref=ra, result_digest=ra.digest),
        ),
        (KeyError, "unknown consumer", lambda: coord.close_consumer("nobody", "token")),
    ]
    for error, fragment, call in cases:
        before = qh.observe(coord)
        with pytest.raises(error, match=fragment):
            call()
        assert qh.observe(coord) == before, (error, fragment)
    clock.advance(LEASE_S)
    before = qh.observe(coord)
    with pytest.raises(LeaseExpired):
        coord.fail_task(la, request_id="f-late", failure="x")
    with pytest.raises(LeaseExpired):
        coord.complete_task(la, submission_id="s-late", result_ref=ra, result_digest=ra.digest)
    assert qh.observe(coord) == before


def test_priorities_outside_int64_are_value_errors_at_task_spec() -> None:
    for kwargs in (
        {"priority": 2**63},
        {"priority": -(2**63) - 1},
        {"scheduling_key": 2**63},
        {"priority": 1.5},
        {"priority": True},
    ):
        with pytest.raises(ValueError, match="signed 64-bit"):
            TaskSpec("x", **kwargs)
    assert TaskSpec("x", priority=2**63 - 1, scheduling_key=-(2**63)).priority == 2**63 - 1


def test_a_journal_of_another_queue_is_unsafe_recovery(make: Any) -> None:
    one = make(queue_id="q1", namespace=True)
    two = make(queue_id="q2", namespace=True)
    one.submit_tasks("r", [TaskSpec("from-q1")])
    two.submit_tasks("r", [TaskSpec("from-q2")])
    qh.crash(one)
    qh.crash(two)
    wal_one = Path(one.directory) / "wal"
    wal_two = Path(two.directory) / "wal"
    for path in wal_two.iterdir():
        path.unlink()
    for path in wal_one.iterdir():
        shutil.copy(path, wal_two / path.name)
    before = qh.directory_files(two.directory)
    with pytest.raises(UnsafeRecovery, match="another run or queue"):
        make(queue_id="q2", namespace=True, recover=True)
    assert qh.directory_files(two.directory) == before
    assert states(make(queue_id="q1", namespace=True, recover=True)) == {"from-q1": "pending"}


def test_i11_a_corrupt_journal_is_corrupt_data_and_is_left_as_found(make: Any) -> None:
    coord = make()
    coord.submit_tasks("r1", [TaskSpec("a")])
    coord.submit_tasks("r2", [TaskSpec("b")])
    coord.submit_tasks("r3", [TaskSpec("c")])
    qh.crash(coord)
    (segment,) = (Path(coord.directory) / "wal").iterdir()
    data = bytearray(segment.read_bytes())
    data[64 + 64 + 10] ^= 0x01  # inside the body of frame 1 (the epoch)
    segment.write_bytes(bytes(data))
    before = qh.directory_files(coord.directory)
    for _ in range(2):  # the refusal releases the lock: a second attempt gets the same answer
        with pytest.raises(CorruptData, match="refusing to recover past damage"):
            make(recover=True)
    assert qh.directory_files(coord.directory) == before


def test_a_damaged_identity_file_is_corrupt_data(make: Any) -> None:
    coord = make()
    coord.close()
    Path(coord.directory, "queue.json").write_bytes(b"{not json")
    with pytest.raises(CorruptData):
        make(recover=True)


# --------------------------------------------------------------------------- recovery


def _rich_queue(coord: Coordinator, store: SharedFilesystemStore) -> dict[str, Any]:
    """A queue with every kind of acknowledged fact; returns the leases still held."""
    coord.submit_tasks(
        "r1",
        [TaskSpec(f"t{i}", priority=i % 3, scheduling_key=i % 2, max_attempts=2) for i in range(8)],
        producer_id="dataset",
        producer_state={"cursor": 8, "epoch": 0},
    )
    finish(coord, take(coord, "t0"), "s0")
    finish(coord, take(coord, "t1"), "s1", payload=b"other")
    coord.fail_task(take(coord, "t2"), request_id="f2", failure="fatal", retryable=False)
    coord.fail_task(take(coord, "t3"), request_id="f3", failure="retry me")
    coord.cancel_task("t4", request_id="c4")
    coord.release_tasks([take(coord, "t6")], request_id="rel6")
    held = take(coord, "t5", worker="w-held")
    token = coord.open_consumer("training", exclusive_owner="trainer")
    coord.save_consumer_state(
        "training",
        token=token,
        request_id="save",
        state_ref=json_ref(store, "state", {"step": 3}),
        fetch_cursor=2,
        processed_cursor=1,
    )
    coord.plan_batch(
        "training",
        token=token,
        batch_id="b1",
        input_positions=[0, 1],
        plan_ref=json_ref(store, "plan", [0, 1]),
    )
    coord.batch_ready(
        "training",
        token=token,
        batch_id="b1",
        ready_ref=json_ref(store, "ready", "r"),
        state_ref=json_ref(store, "state2", {"step": 4}),
        fetch_cursor=2,
        processed_cursor=2,
    )
    coord.plan_batch(
        "training", token=token, batch_id="b2", input_positions=[1], plan_ref=json_ref(store, "plan2", [1])
    )
    coord.register_checkpoint("ck", json_ref(store, "ckpt", {"w": 1}))
    coord.seal_input("seal")
    return {"held": held, "token": token}


def _facts(coord: Coordinator) -> dict[str, Any]:
    return {
        "tasks": coord.tasks,
        "commits": coord.commits,
        "producer": coord.producer_state("dataset"),
        "consumer": coord.load_consumer_state("training"),
        "consumers": coord.consumers,
        "batches": [coord.get_batch("b1"), coord.get_batch("b2")],
        "checkpoints": coord.checkpoints,
        "sealed": coord.metrics()["sealed"],
        "pending": pending_ids(coord),
        "receipts": [coord.lookup_submission(s) for s in ("s0", "s1")],
    }


@pytest.mark.parametrize("how", ["close", "crash"])
def test_i8_i12_recovery_keeps_every_acknowledged_fact_and_kills_old_leases(
    make: Any, store: SharedFilesystemStore, how: str
) -> None:
    coord = make()
    held = _rich_queue(coord, store)["held"]
    before = _facts(coord)
    if how == "close":
        coord.close()
    else:
        qh.crash(coord)
    again = make(recover=True)
    after = _facts(again)
    assert again.epoch == 2
    # The one lease held at the crash was revoked (an attempt spent) and joined the FIFO tail.
    revoked = after["tasks"].pop("t5")
    original = before["tasks"].pop("t5")
    assert (revoked["state"], revoked["failures"], revoked["spec"]) == ("pending", 1, original["spec"])
    assert (revoked["lease"], revoked["generation"]) == (original["lease"], 1)
    # t5 has priority 2, above every task still pending (t3, t6: 0; t7: 1), so it comes first.
    assert after["pending"] == ["t5", *before["pending"]]
    # Recovery ends every consumer's ownership (issue 10 item 4) and keeps its state.
    assert {k: dict(c, open=True) for k, c in after["consumers"].items()} == before["consumers"]
    assert all(not c["open"] for c in after["consumers"].values())
    for key in (
        "tasks",
        "commits",
        "producer",
        "consumer",
        "batches",
        "checkpoints",
        "sealed",
        "receipts",
    ):
        assert after[key] == before[key], key
    with pytest.raises(StaleAttempt):
        finish(again, held, "s5")
    assert again.heartbeat([held]) == ["StaleAttempt"]
    # The queue goes on: the remaining work completes and the input ends.
    while (result := again.acquire("w", max_tasks=4)).status == "acquired":
        for assignment in result.assignments:
            finish(again, assignment.lease, f"late-{assignment.task.task_id}")
    assert result.status == "end_of_input"
    assert again.read_commits(0, 100).end_of_input


def test_pending_order_is_identical_after_recovery(make: Any) -> None:
    coord = make()
    coord.submit_tasks("r", [TaskSpec(f"t{i:02d}", priority=i % 4, scheduling_key=i % 3) for i in range(30)])
    for task_id in ("t03", "t07", "t11", "t20"):  # returned tasks move to their tails
        coord.release_tasks([take(coord, task_id)], request_id=f"rel-{task_id}")
    coord.yield_tasks([{"lease": take(coord, "t05"), "input_ref": None, "priority": 9}], request_id="y")
    order = pending_ids(coord)
    coord.close()
    coord = make(recover=True)
    assert pending_ids(coord) == order
    qh.crash(coord)
    coord = make(recover=True)
    assert pending_ids(coord) == order
    got = [a.task.task_id for a in coord.acquire("w", max_tasks=100).assignments]
    assert got == order


def test_revoked_leases_join_the_tail_in_submission_order(make: Any) -> None:
    coord = make()
    coord.submit_tasks("r", [TaskSpec(f"t{i}") for i in range(6)])
    take(coord, "t4")
    take(coord, "t1")
    order = pending_ids(coord)
    qh.crash(coord)
    assert pending_ids(make(recover=True)) == [*order, "t1", "t4"]


def test_i12_completion_retry_after_recovery_returns_the_original_receipt(
    make: Any, store: SharedFilesystemStore
) -> None:
    coord = make()
    coord.submit_tasks("r", [TaskSpec("a")])
    lease = take(coord, "a")
    receipt = finish(coord, lease, "s-a")
    qh.crash(coord)
    again = make(recover=True)
    relaid = qh.result_for(store, lease, submission_id="s-a-relaid")  # a logically identical copy
    assert (
        again.complete_task(lease, submission_id="s-a", result_ref=relaid, result_digest=relaid.digest)
        == receipt
    )
    with pytest.raises(IdempotencyConflict):
        again.complete_task(lease, submission_id="s-a", result_ref=relaid, result_digest="1" * 64)
    assert again.commits == [dataclasses.asdict(receipt)]


# --------------------------------------------------------------------------- snapshots


def test_j5_snapshots_bound_what_recovery_replays(make: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(coordinator_module, "JOURNAL_SNAPSHOT_BYTES_MIN", 1)
    coord = make()
    receipts = {}
    leases = {}
    for i in range(12):
        coord.submit_tasks(f"r{i}", [TaskSpec(f"t{i}")])
        leases[i] = take(coord, f"t{i}")
        receipts[i] = finish(coord, leases[i], f"s{i}")
        # Snapshots run in the background (J5), one at a time: waiting for each makes the next
        # call start another, whatever the machine's load.
        assert coord._await_snapshot() is None
    coord.submit_tasks("tail", [TaskSpec("tail")])
    assert coord._await_snapshot() is None
    snapshots = coord.metrics()["journal"]["snapshots"]
    assert snapshots >= 3
    snap_dir = Path(coord.directory) / "snap"
    (snap,) = snap_dir.iterdir()  # older snapshots were deleted
    snap_seq = int(snap.stem)
    last_seq = coord._journal.last_seq
    assert last_seq > snap_seq
    firsts = [int(p.stem) for p in (Path(coord.directory) / "wal").iterdir()]
    assert firsts and min(firsts) == snap_seq + 1  # segments before the snapshot were deleted
    qh.crash(coord)
    applied: list[str] = []
    real_apply = QueueState.apply

    def counting(self: QueueState, event: events.Event, **options: bool) -> Any:
        applied.append(event.OP)
        return real_apply(self, event, **options)

    monkeypatch.setattr(QueueState, "apply", counting)
    again = make(recover=True)
    assert len(applied) == last_seq - snap_seq + 1  # the tail, then the new epoch
    assert applied[-1] == "epoch"
    monkeypatch.setattr(QueueState, "apply", real_apply)
    for i in range(12):
        assert again.lookup_submission(f"s{i}") == receipts[i]
        ref = qh.result_for(again.store, leases[i], submission_id=f"s{i}")
        assert (
            again.complete_task(leases[i], submission_id=f"s{i}", result_ref=ref, result_digest=ref.digest)
            == receipts[i]
        )
    assert [c["position"] for c in again.commits] == list(range(12))
    assert states(again)["tail"] == "pending"


# --------------------------------------------------------------------------- namespaces


def test_namespaced_queues_share_a_pool_and_are_independent(
    make: Any, store: SharedFilesystemStore, tmp_path: Path
) -> None:
    one = make(queue_id="q1", namespace=True)
    two = make(queue_id="q2", namespace=True)
    plain = make()  # the pool-root queue coexists
    assert one.directory == str(tmp_path / "queues" / digest("q1")[:32])
    assert two.directory == str(tmp_path / "queues" / digest("q2")[:32])
    for coord in (one, two, plain):
        coord.submit_tasks("same-request-id", [TaskSpec("same-task")])
    l1 = take(one, "same-task")
    with pytest.raises(InvalidReference, match="q1"):
        two.fail_task(l1, request_id="f", failure="x")
    r1 = finish(one, l1, "same-submission")
    assert two.lookup_submission("same-submission") is None
    assert states(two) == states(plain) == {"same-task": "pending"}
    r2 = finish(two, take(two, "same-task"), "same-submission", payload=b"two")
    assert r1.digest != r2.digest and r1.position == r2.position == 0
    with pytest.raises(UnsafeRecovery, match="held by a live coordinator"):
        make(queue_id="q1", namespace=True, recover=True)
    one.close()
    two.close()
    assert make(queue_id="q1", namespace=True, recover=True).commits == [dataclasses.asdict(r1)]
    assert make(queue_id="q2", namespace=True, recover=True).commits == [dataclasses.asdict(r2)]


# --------------------------------------------------------------------------- fail-stop and faults


class InjectedFault(Exception):
    """Raised by the fault hook (not a QueueError, like an unexpected crash)."""


class Faults:
    """A backend fault hook that raises once at the armed phase."""

    def __init__(self) -> None:
        self.armed: str | None = None
        self.hits: list[str] = []

    def __call__(self, phase: str) -> None:
        if phase == self.armed:
            self.armed = None
            self.hits.append(phase)
            raise InjectedFault(phase)


@pytest.fixture
def faults() -> Faults:
    return Faults()


@pytest.fixture
def faulty_store(tmp_path: Path, faults: Faults) -> Iterator[SharedFilesystemStore]:
    backend = FilesystemBackend(tmp_path, fault=faults)
    with SharedFilesystemStore(tmp_path, RUN, backend=backend) as opened:
        yield opened


def test_j3_a_journal_failure_stops_the_coordinator_until_recovery(
    make: Any, faulty_store: SharedFilesystemStore, faults: Faults
) -> None:
    coord = make(store=faulty_store)
    coord.submit_tasks("r", [TaskSpec("a"), TaskSpec("b")])
    lease = take(coord, "a")
    faults.armed = "after_journal_sync"
    with pytest.raises(InjectedFault):
        coord.submit_tasks("r2", [TaskSpec("c")])
    calls: list[Callable[[], Any]] = [
        lambda: coord.submit_tasks("r3", [TaskSpec("d")]),
        lambda: coord.acquire("w"),
        lambda: coord.heartbeat([lease]),
        lambda: coord.fail_task(lease, request_id="f", failure="x"),
        lambda: coord.seal_input("s"),
        lambda: finish(coord, lease, "s-a"),
    ]
    for call in calls:
        with pytest.raises(UnsafeRecovery, match="recover=True"):
            call()
    # Views still answer, from the journal's durable state (read back once; nothing written).
    assert coord.task_status("a")["state"] == "leased"  # type: ignore[index]
    assert set(coord.tasks) <= {"a", "b", "c"} and {"a", "b"} <= set(coord.tasks)
    assert coord.commits == [] and coord.read_commits().commits == ()
    assert coord.lookup_submission("x") is None
    assert [t.task_id for t in coord.pending_tasks()] in (["b"], ["b", "c"])
    assert coord.metrics()["commits"] == 0
    with pytest.raises(UnsafeRecovery, match="held by a live coordinator"):
        make(store=faulty_store, recover=True)  # the stopped one still holds the queue
    coord.close()  # releases the lock without writing a snapshot
    again = make(store=faulty_store, recover=True)
    assert states(again) == {"a": "pending", "b": "pending", "c": "pending"}  # c was durable


JOURNAL_PHASES = ["before_journal_write", "after_journal_append", "after_journal_sync"]
#: Whether the faulting call's transaction is in the journal afterwards. (Snapshots past the
#: threshold never make a call raise: tests/unit/test_snapshot_background.py.)
PRESENT = {
    "before_journal_write": False,  # nothing was written
    "after_journal_append": True,  # written but unsynced: still in the file for a process crash
    "after_journal_sync": True,  # durable, only the reply was lost
    "before_completion_reply": True,  # durable, only the reply was lost
}


def _fault_params() -> Iterator[Any]:
    for release in ("close", "crash"):
        for phase in JOURNAL_PHASES:
            for call in ("complete", "submit"):
                yield pytest.param(phase, call, release, id=f"{phase}-{call}-{release}")
        yield pytest.param(
            "before_completion_reply", "complete", release, id=f"before_completion_reply-complete-{release}"
        )


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("phase", "call", "release"), list(_fault_params()))
def test_i8_a_fault_at_any_journal_phase_loses_nothing_acknowledged_and_half_applies_nothing(
    make: Any,
    faulty_store: SharedFilesystemStore,
    faults: Faults,
    monkeypatch: pytest.MonkeyPatch,
    phase: str,
    call: str,
    release: str,
) -> None:
    store = faulty_store
    coord = make(store=store)
    coord.submit_tasks("r1", [TaskSpec("a"), TaskSpec("b"), TaskSpec("c")], producer_id="p", producer_state=1)
    acked = finish(coord, take(coord, "a"), "sub-a")
    lb = take(coord, "b")
    ref_b = qh.result_for(store, lb, submission_id="sub-b")
    before = coord.tasks
    faults.armed = phase
    with pytest.raises(InjectedFault):
        if call == "complete":
            coord.complete_task(lb, submission_id="sub-b", result_ref=ref_b, result_digest=ref_b.digest)
        else:
            coord.submit_tasks("r2", [TaskSpec("d")], producer_id="p", producer_state=2)
    assert faults.hits == [phase]
    if phase == "before_completion_reply":
        # The transaction was durable; the live coordinator answers the retry with the receipt.
        retry = coord.complete_task(lb, submission_id="sub-b", result_ref=ref_b, result_digest=ref_b.digest)
        assert retry.position == 1
    if release == "close":
        coord.close()
    else:
        qh.crash(coord)
    again = make(store=store, recover=True)
    tasks = again.tasks
    # Everything acknowledged before the fault is intact.
    assert again.lookup_submission("sub-a") == acked
    assert again.commits[0] == dataclasses.asdict(acked)
    assert tasks["a"] == before["a"] and tasks["c"]["state"] == "pending"
    present = PRESENT[phase]
    if phase == "after_journal_append" and release == "close":
        present = False  # J3.1: closing the stopped coordinator cuts the unacknowledged frame
    if call == "complete":
        receipt = again.lookup_submission("sub-b")
        if present:
            assert receipt is not None and receipt.position == 1 and receipt.digest == ref_b.digest
            assert receipt.result_ref == ref_b
            assert (tasks["b"]["state"], len(again.commits)) == ("completed", 2)
            assert (
                again.complete_task(lb, submission_id="sub-b", result_ref=ref_b, result_digest=ref_b.digest)
                == receipt
            )
        else:
            assert receipt is None and len(again.commits) == 1
            assert (tasks["b"]["state"], tasks["b"]["failures"]) == ("pending", 1)  # revoked by recovery
            with pytest.raises(StaleAttempt):
                again.complete_task(lb, submission_id="sub-b", result_ref=ref_b, result_digest=ref_b.digest)
    else:
        assert ("d" in tasks) is present
        assert again.producer_state("p") == (2 if present else 1)
        assert again.submit_tasks("r2", [TaskSpec("d")], producer_id="p", producer_state=2) == ["d"]
        assert again.producer_state("p") == 2
    assert again.metrics()["tasks"].get("leased", 0) == 0


def test_close_of_a_stopped_coordinator_does_not_hang_and_frees_the_queue(
    make: Any, faulty_store: SharedFilesystemStore, faults: Faults
) -> None:
    coord = make(store=faulty_store)
    faults.armed = "before_journal_write"
    with pytest.raises(InjectedFault):
        coord.submit_tasks("r", [TaskSpec("a")])
    snaps_before = os.listdir(Path(coord.directory) / "snap")
    coord.close()
    assert os.listdir(Path(coord.directory) / "snap") == snaps_before  # no snapshot of a doubtful state
    again = make(store=faulty_store, recover=True)
    assert again.tasks == {}
    assert again.submit_tasks("r", [TaskSpec("a")]) == ["a"]


# --------------------------------------------------------------------------- regressions


def test_a_heartbeat_at_the_grant_instant_does_not_stop_the_coordinator(make: Any, clock: Any) -> None:
    coord = make()
    coord.submit_tasks("r", [TaskSpec("a"), TaskSpec("b")])
    lease = take(coord, "a")
    assert coord.heartbeat([lease]) == ["extended"]  # same instant as the grant
    clock.advance(LEASE_S)
    assert [a.task.task_id for a in coord.acquire("w", max_tasks=2).assignments] == ["b", "a"]
    assert coord.task_status("a")["failures"] == 1  # type: ignore[index]


def test_releasing_one_lease_twice_in_a_call_does_not_stop_the_coordinator(make: Any) -> None:
    coord = make()
    coord.submit_tasks("r", [TaskSpec("a")])
    lease = take(coord, "a")
    before = qh.observe(coord)
    with pytest.raises(ValueError, match="same lease twice"):
        coord.release_tasks([lease, lease], request_id="twice")
    assert qh.observe(coord) == before
    assert coord.release_tasks([lease], request_id="twice") == ["released"]  # the id is still free
    assert coord.acquire("w").status == "acquired"


def test_j3_an_apply_failure_stops_the_coordinator_and_leaves_no_half_transaction(
    make: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    coord = make()
    coord.submit_tasks("r1", [TaskSpec("a")])
    real_apply = QueueState.apply

    def half_apply(self: QueueState, event: events.Event, **options: bool) -> Any:
        if isinstance(event, events.Submit) and event.request_id == "r2":
            self.tasks.clear()  # damage the live state, then fail like a bug would
            raise RuntimeError("apply bug")
        return real_apply(self, event, **options)

    monkeypatch.setattr(QueueState, "apply", half_apply)
    with pytest.raises(RuntimeError, match="apply bug"):
        coord.submit_tasks("r2", [TaskSpec("b"), TaskSpec("c")])
    try:
        view: set[str] | None = set(coord.tasks)  # read back from the journal's durable frames
    except UnsafeRecovery as error:
        assert "stopped after" in str(error)
        view = None
    assert view in (None, {"a"}, {"a", "b", "c"})  # the damaged live state is never served
    coord.close()
    monkeypatch.setattr(QueueState, "apply", real_apply)
    again = make(recover=True)
    assert set(again.tasks) in ({"a"}, {"a", "b", "c"})  # all of the transaction or none of it
    assert again.tasks["a"]["state"] == "pending"


def test_collect_garbage_returns_its_report_and_keeps_unacknowledged_results(
    make: Any, store: SharedFilesystemStore
) -> None:
    coord = make()
    coord.submit_tasks("r", [TaskSpec("a")])
    receipt = finish(coord, take(coord, "a"), "s-a")
    report = coord.collect_garbage()
    assert {
        "reclaimed_files",
        "reclaimed_bytes",
        "retained_packs",
        "open_packs",
        "owners",
        "tombstones",
    } <= set(report)
    (record,) = store.read(receipt.result_ref)
    assert bytes(record.payload) == b"result"


def test_i8_concurrent_workers_each_get_a_durable_receipt_and_every_task_completes_once(
    make: Any, tmp_path: Path
) -> None:
    coord = make()
    tasks = [f"t{i:03d}" for i in range(120)]
    coord.submit_tasks("all", [TaskSpec(t) for t in tasks])
    coord.seal_input("sealed")
    receipts: list[CommitReceipt] = []
    errors: list[BaseException] = []
    guard = threading.Lock()

    def worker(number: int) -> None:
        try:
            with SharedFilesystemStore(tmp_path, RUN) as own:  # one store per writer thread
                while (result := coord.acquire(f"w{number}", max_tasks=2)).status == "acquired":
                    for assignment in result.assignments:
                        lease = assignment.lease
                        ref = qh.result_for(own, lease, submission_id=f"s-{lease.task_id}")
                        receipt = coord.complete_task(
                            lease,
                            submission_id=f"s-{lease.task_id}",
                            result_ref=ref,
                            result_digest=ref.digest,
                        )
                        with guard:
                            receipts.append(receipt)
                assert result.status in ("empty", "end_of_input")
        except BaseException as error:  # pragma: no cover - reported below
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []
    assert sorted(r.task_id for r in receipts) == tasks
    assert sorted(r.position for r in receipts) == list(range(len(tasks)))
    for receipt in receipts:
        assert coord.lookup_submission(receipt.submission_id) == receipt
    journal = coord.metrics()["journal"]
    assert journal["syncs"] <= journal["appends"]
    qh.crash(coord)
    again = make(recover=True)
    assert again.commits == [dataclasses.asdict(r) for r in sorted(receipts, key=lambda r: r.position)]
    assert again.acquire("w").status == "end_of_input"


@pytest.mark.parametrize("phase", JOURNAL_PHASES)
def test_a_failed_recovery_releases_the_queue_and_the_next_recovery_keeps_everything(
    make: Any, faulty_store: SharedFilesystemStore, faults: Faults, phase: str
) -> None:
    coord = make(store=faulty_store)
    coord.submit_tasks("r", [TaskSpec("a"), TaskSpec("b")])
    receipt = finish(coord, take(coord, "a"), "s-a")
    take(coord, "b")
    coord.close()
    faults.armed = phase  # the new epoch's transaction fails
    with pytest.raises(InjectedFault):
        make(store=faulty_store, recover=True)
    assert qh.descriptors_under(coord.directory) == []  # its journal segment, history and lock too
    again = make(store=faulty_store, recover=True)
    # The failed open's epoch frame is in the file unless the fault came before the write.
    assert again.epoch == (2 if phase == "before_journal_write" else 3)
    assert again.commits == [dataclasses.asdict(receipt)]
    assert states(again) == {"a": "completed", "b": "pending"}
    assert again.task_status("b")["failures"] == 1  # type: ignore[index]  # revoked exactly once


def test_read_commits_pages_equal_validated_receipts_before_and_after_a_snapshot(make: Any) -> None:
    coord = make()
    coord.submit_tasks("r", [TaskSpec(t) for t in ("a", "b", "c", "d")])
    accepted = [finish(coord, take(coord, t), f"sub-{t}") for t in ("a", "b")]
    coord.close()  # writes a snapshot: its accepted log is reloaded as packed rows
    again = make(recover=True)
    accepted += [finish(again, take(again, t), f"sub-{t}") for t in ("c", "d")]
    page = again.read_commits(0, 10)
    # Paging builds receipts without re-validating them; they must equal validated ones.
    assert page.commits == tuple(accepted)
    assert page.commits == tuple(CommitReceipt.from_dict(c) for c in again.commits)
    assert len({hash(c) for c in page.commits}) == 4
    assert [type(c.result_ref.manifest.segment) for c in page.commits] == [SegmentRef] * 4
    assert again.read_commits(3, 10).commits == (accepted[3],)
