"""Queue roots and ``Coordinator.collect_garbage`` (docs/GC.md "Queue roots", G6, I16).

Every publication here is its own standalone file written by an ``online_gc=True`` store and
released at once (``release_publications``), so only the queue's owner keeps it alive and each
root maps to exactly one file. Checked, each with the exact set of files left on disk:

* inputs of pending and leased tasks are kept; cancelled, completed and yielded-away inputs go;
* an input still being read is kept after its lease expired or a recovery revoked it, until
  ``release_task_reads`` or ``retire_worker``;
* accepted results are kept until the ``training`` consumer acknowledges them, through
  ``processed_cursor`` and the ``processed_positions`` of its ``progress_ref`` (another
  consumer acknowledges nothing); a malformed progress record fails the collection;
* consumer state and progress records, plan/ready references of batches not yet listed in
  ``finished_batches``, and registered checkpoints until ``release_checkpoint``;
* an acknowledged result still staged by a live ``online_gc=False`` writer (which records no
  seals, so adoption cannot free it early; test_queue_adoption.py) stays until the writer
  releases it or dies, and an application owner keeps it beyond that;
* G6 / I16: every reference the journal names is already reached by the queue's owner; a
  journal failure after the catalog ``add`` retains too much (the next
  ``Coordinator.collect_garbage`` trims it), a catalog failure before it journals nothing.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import queue_helpers as qh
from straw._catalog.log import Catalog
from straw._inspect.check import check_pool
from straw.backend import FilesystemBackend
from straw.coordinator import Coordinator
from straw.errors import IndeterminateCommit, InvalidReference, StorageUnavailable, UnsupportedSchema
from straw.protocol import Lease, Record, RecordSetRef, TaskSpec, encode
from straw.store import SharedFilesystemStore

RUN = "run-queue-gc"
OWNER = "gc-tests"
LEASE_S = 30.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Fault:
    """Raise ``OSError(EIO)`` at the next call of one phase."""

    def __init__(self) -> None:
        self.phase = ""

    def __call__(self, phase: str) -> None:
        if phase == self.phase:
            self.phase = ""
            raise OSError(5, f"injected at {phase}")


def _no_sleep(_: float) -> None:
    return None


class Pool:
    """A pool with a data store (online GC, one file per publication) and a coordinator."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.fault = Fault()
        self.clock = Clock()
        self.stores: list[SharedFilesystemStore] = []  # closed by the fixture
        self.data = self.store(online_gc=True, segment_target_bytes=0)
        self.coordinator_store = self.store(fault=self.fault)
        self.queue = self.open_queue(recover=False)

    def store(
        self,
        *,
        online_gc: bool = False,
        segment_target_bytes: int = 1 << 30,
        fault: Callable[[str], None] | None = None,
    ) -> SharedFilesystemStore:
        backend = FilesystemBackend(self.root, fault=fault, sleep=_no_sleep, visibility_delays=(0.0,))
        store = SharedFilesystemStore(
            self.root, RUN, backend=backend, online_gc=online_gc, segment_target_bytes=segment_target_bytes
        )
        self.stores.append(store)
        return store

    def open_queue(
        self,
        *,
        recover: bool,
        queue_id: str = "rollout",
        namespace: bool = False,
        store: SharedFilesystemStore | None = None,
    ) -> Coordinator:
        return Coordinator(
            store if store is not None else self.coordinator_store,
            queue_id=queue_id,
            namespace=namespace,
            exclusive_owner=OWNER,
            recover=recover,
            lease_seconds=LEASE_S,
            clock=self.clock,
        )

    def put(self, name: str, *, metadata: dict[str, Any] | None = None) -> RecordSetRef:
        """Publish one record and end its staging: only owners keep it from now on."""
        ref = self.data.publish(
            [Record(name, name.encode() * 20, metadata=metadata or {})], submission_id=f"put-{name}"
        )
        self.data.release_publications([ref])
        return ref

    def put_json(self, name: str, value: Any) -> RecordSetRef:
        ref = self.data.publish([Record(name, encode(value), codec="json.v1")], submission_id=f"put-{name}")
        self.data.release_publications([ref])
        return ref

    def result(self, lease: Lease, name: str) -> RecordSetRef:
        return self.put(name, metadata={"task_id": lease.task_id, "attempt_id": lease.attempt_id})

    def complete(self, lease: Lease, name: str) -> tuple[RecordSetRef, int]:
        ref = self.result(lease, name)
        receipt = self.queue.complete_task(
            lease, submission_id=f"c-{name}", result_ref=ref, result_digest=ref.digest
        )
        return ref, receipt.position

    def acquire(self, worker: str, task_id: str) -> Lease:
        result = self.queue.acquire(worker, task_ids=[task_id])
        assert result.status == "acquired", result
        return result.assignments[0].lease

    def files(self) -> set[str]:
        return {
            str(p.relative_to(self.root)) for p in self.root.glob("raw/*/*") if p.suffix in (".pack", ".seg")
        }

    def alive(self, *refs: RecordSetRef) -> list[bool]:
        return [(self.root / r.manifest.segment.path).exists() for r in refs]

    def owners_of(self, ref: RecordSetRef) -> list[str]:
        catalog = Catalog(FilesystemBackend(self.root))
        try:
            with catalog.locked() as cat:
                return sorted(cat.state.reached().get(ref.manifest.segment.path, []))
        finally:
            catalog.close()

    def crash(self) -> None:
        """Drop the coordinator as a killed process would: no snapshot, lock released by the kernel."""
        qh.crash(self.queue)


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[Pool]:
    p = Pool(tmp_path / "pool")
    yield p
    if not p.queue._closed:
        p.queue.close()
    for store in p.stores:
        store.close()


def _queue_owner(pool: Pool) -> str:
    return pool.queue._gc_owner


# --------------------------------------------------------------------------- task inputs


def test_inputs_of_pending_and_leased_tasks_are_kept(pool: Pool) -> None:
    pending, leased, cancelled, done = (pool.put(n) for n in ("pending", "leased", "cancelled", "done"))
    stray = pool.put("stray")  # never named by the queue
    pool.queue.submit_tasks(
        "r1",
        [
            TaskSpec("t-pending", pending),
            TaskSpec("t-leased", leased),
            TaskSpec("t-cancel", cancelled),
            TaskSpec("t-done", done),
        ],
    )
    pool.acquire("w", "t-leased")
    pool.queue.cancel_task("t-cancel", request_id="x1")
    lease = pool.acquire("w", "t-done")
    result, _ = pool.complete(lease, "result-done")
    assert pool.owners_of(pending) == [_queue_owner(pool)]  # G6: owned since submit

    outcome = pool.queue.collect_garbage()
    assert outcome["reclaimed_files"] == 3  # cancelled, done (input) and stray
    # Roots: pending input, leased input (as a live task's and as an outstanding read), result.
    assert outcome["queue_roots"] >= 3
    assert outcome["queue_packs"] == 3
    assert pool.alive(pending, leased, cancelled, done, stray, result) == [
        True,
        True,
        False,
        False,
        False,
        True,
    ]
    assert pool.files() == {r.manifest.segment.path for r in (pending, leased, result)}
    assert [bytes(r.payload) for r in pool.store().read(pending)] == [b"pending" * 20]


def test_a_yielded_task_keeps_its_new_input_and_drops_the_old(pool: Pool) -> None:
    old, new = pool.put("old"), pool.put("new")
    pool.queue.submit_tasks("r1", [TaskSpec("t", old)])
    lease = pool.acquire("w", "t")
    pool.queue.yield_task(lease, request_id="y1", input_ref=new)
    assert pool.queue.collect_garbage()["reclaimed_files"] == 1
    assert pool.alive(old, new) == [False, True]


def test_save_task_progress_moves_the_root_to_the_new_input(pool: Pool) -> None:
    old, new = pool.put("old"), pool.put("new")
    pool.queue.submit_tasks("r1", [TaskSpec("t", old)])
    lease = pool.acquire("w", "t")
    pool.queue.save_task_progress(lease, request_id="p1", input_ref=new)
    pool.queue.collect_garbage()
    # The holder may still read the input it was granted: both stay while its read lasts.
    assert pool.alive(old, new) == [True, True]
    pool.queue.release_tasks([lease], request_id="rel")
    pool.queue.collect_garbage()
    assert pool.alive(old, new) == [False, True]


def test_an_input_read_after_its_lease_expired_is_kept_until_release_task_reads(pool: Pool) -> None:
    data = pool.put("input")
    pool.queue.submit_tasks("r1", [TaskSpec("t", data, max_attempts=1)])
    lease = pool.acquire("slow-worker", "t")
    pool.clock.now += LEASE_S + 1
    assert pool.queue.acquire("other").status == "empty"  # reclaims the expired lease: task failed
    assert pool.queue.task_status("t")["state"] == "failed"  # type: ignore[index]
    assert pool.queue.outstanding_reads() == (lease,)
    assert pool.queue.collect_garbage()["reclaimed_files"] == 0
    assert pool.alive(data) == [True]
    assert pool.queue.release_task_reads([lease]) == 1
    assert pool.queue.collect_garbage()["reclaimed_files"] == 1
    assert pool.alive(data) == [False]


def test_an_input_read_across_a_recovery_is_kept_until_retire_worker(pool: Pool) -> None:
    data = pool.put("input")
    pool.queue.submit_tasks("r1", [TaskSpec("t", data, max_attempts=1)])
    lease = pool.acquire("worker-1", "t")
    pool.crash()
    pool.queue = pool.open_queue(recover=True)  # a new epoch revokes the lease: the task fails
    assert pool.queue.task_status("t")["state"] == "failed"  # type: ignore[index]
    assert pool.queue.outstanding_reads() == (lease,)
    assert pool.queue.collect_garbage()["reclaimed_files"] == 0
    assert pool.alive(data) == [True]
    assert pool.queue.retire_worker("worker-1") == []
    assert pool.queue.outstanding_reads() == ()
    assert pool.queue.collect_garbage()["reclaimed_files"] == 1


def test_an_expired_holder_keeps_reading_the_input_it_was_granted(pool: Pool) -> None:
    first_input, second_input = pool.put("first"), pool.put("second")
    pool.queue.submit_tasks("r1", [TaskSpec("t", first_input)])
    first = pool.acquire("worker-a", "t")
    pool.clock.now += LEASE_S + 1
    second = pool.acquire("worker-b", "t")  # the expired lease is reclaimed, then re-granted
    pool.queue.save_task_progress(second, request_id="p1", input_ref=second_input)
    assert first in pool.queue.outstanding_reads()
    pool.queue.collect_garbage()
    assert pool.alive(first_input, second_input) == [True, True]


def test_the_holders_own_complete_fail_and_release_end_its_read(pool: Pool) -> None:
    inputs = {name: pool.put(name) for name in ("c", "f", "r")}
    pool.queue.submit_tasks("r1", [TaskSpec(f"t-{n}", ref, max_attempts=1) for n, ref in inputs.items()])
    pool.complete(pool.acquire("w", "t-c"), "out-c")
    pool.queue.fail_task(pool.acquire("w", "t-f"), request_id="f1", failure="boom", retryable=False)
    lease = pool.acquire("w", "t-r")
    pool.queue.release_tasks([lease], request_id="rel1")
    pool.queue.cancel_task("t-r", request_id="cancel-r")
    assert pool.queue.outstanding_reads() == ()
    pool.queue.collect_garbage()
    assert pool.alive(*inputs.values()) == [False, False, False]


# --------------------------------------------------------------------------- results and acknowledgement


def _three_results(pool: Pool) -> list[RecordSetRef]:
    pool.queue.submit_tasks("r1", [TaskSpec(f"t{i}") for i in range(3)])
    results = []
    for i in range(3):
        ref, position = pool.complete(pool.acquire("w", f"t{i}"), f"result-{i}")
        assert position == i
        results.append(ref)
    return results


def test_results_are_kept_until_the_training_consumer_acknowledges_them(pool: Pool) -> None:
    results = _three_results(pool)
    assert pool.queue.collect_garbage()["reclaimed_files"] == 0

    # Another consumer's progress acknowledges nothing.
    token = pool.queue.open_consumer("eval", exclusive_owner="e")
    eval_state = pool.put("eval-state")
    pool.queue.save_consumer_state(
        "eval", token=token, request_id="e1", state_ref=eval_state, fetch_cursor=3, processed_cursor=3
    )
    assert pool.queue.collect_garbage()["reclaimed_files"] == 0

    token = pool.queue.open_consumer("training", exclusive_owner="trainer")
    state1 = pool.put("state-1")
    progress1 = pool.put_json(
        "progress-1", {"version": 1, "processed_positions": [2], "finished_batches": []}
    )
    pool.queue.save_consumer_state(
        "training",
        token=token,
        request_id="s1",
        state_ref=state1,
        fetch_cursor=3,
        processed_cursor=1,
        progress_ref=progress1,
    )
    outcome = pool.queue.collect_garbage()
    assert outcome["reclaimed_files"] == 2  # position 0 (cursor) and 2 (processed_positions)
    assert pool.alive(*results) == [False, True, False]
    assert pool.alive(state1, progress1, eval_state) == [True, True, True]

    state2 = pool.put("state-2")
    pool.queue.save_consumer_state(
        "training", token=token, request_id="s2", state_ref=state2, fetch_cursor=3, processed_cursor=3
    )
    assert pool.queue.collect_garbage()["reclaimed_files"] == 3  # result 1, state 1, progress 1
    assert pool.alive(*results, state1, progress1, state2, eval_state) == [False] * 5 + [True, True]


def test_a_malformed_progress_record_is_refused_and_deletes_nothing(
    pool: Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 11: a progress record GC cannot parse is refused when saved (nothing journaled).
    One already in a journal (written by an older straw, simulated by skipping the check)
    makes collection fail closed: nothing is deleted."""
    _three_results(pool)
    stray = pool.put("stray")
    token = pool.queue.open_consumer("training", exclusive_owner="trainer")
    progress = pool.put_json("bad-progress", {"version": 2, "processed_positions": [0]})
    state = pool.put("state")

    def save() -> object:
        return pool.queue.save_consumer_state(
            "training",
            token=token,
            request_id="s1",
            state_ref=state,
            fetch_cursor=3,
            processed_cursor=0,
            progress_ref=progress,
        )

    with pytest.raises(UnsupportedSchema, match=r"progress_ref of consumer 'training'.*version: 1"):
        save()
    assert pool.queue.load_consumer_state("training") is None
    monkeypatch.setattr(Coordinator, "_check_progress", lambda *args: None)
    save()
    before = pool.files()
    with pytest.raises(UnsupportedSchema, match=r"a progress record is \{version: 1"):
        pool.queue.collect_garbage()
    assert pool.files() == before
    assert pool.alive(stray) == [True]


def test_unfinished_batches_keep_plan_and_ready_refs(pool: Pool) -> None:
    _three_results(pool)
    token = pool.queue.open_consumer("training", exclusive_owner="trainer")
    plan, ready, state = pool.put("plan"), pool.put("ready"), pool.put("state")
    pool.queue.plan_batch("training", token=token, batch_id="b1", input_positions=[0, 1], plan_ref=plan)
    pool.queue.batch_ready(
        "training",
        token=token,
        batch_id="b1",
        ready_ref=ready,
        state_ref=state,
        fetch_cursor=2,
        processed_cursor=0,
    )
    pool.queue.collect_garbage()
    assert pool.alive(plan, ready, state) == [True, True, True]
    finished = pool.put_json(
        "progress", {"version": 1, "processed_positions": [], "finished_batches": ["b1"]}
    )
    pool.queue.save_consumer_state(
        "training",
        token=token,
        request_id="s2",
        state_ref=state,
        fetch_cursor=2,
        processed_cursor=0,
        progress_ref=finished,
    )
    pool.queue.collect_garbage()
    assert pool.alive(plan, ready, state, finished) == [False, False, True, True]


def test_registered_checkpoints_are_kept_until_released(pool: Pool) -> None:
    checkpoint = pool.put("ckpt")
    pool.queue.register_checkpoint("step-100", checkpoint)
    assert pool.queue.collect_garbage()["reclaimed_files"] == 0
    assert pool.alive(checkpoint) == [True]
    assert pool.queue.release_checkpoint("step-100") is True
    assert pool.queue.collect_garbage()["reclaimed_files"] == 1
    assert pool.alive(checkpoint) == [False]


def test_an_acknowledged_result_goes_only_once_its_writer_and_owners_let_it(pool: Pool) -> None:
    worker = pool.store(online_gc=False)  # a live worker process: its data is staged while it lives
    pool.queue.submit_tasks("r1", [TaskSpec("t")])
    lease = pool.acquire("w", "t")
    result = worker.publish(
        [Record("out", b"out" * 30, metadata={"task_id": "t", "attempt_id": lease.attempt_id})],
        submission_id="out",
    )
    pool.queue.complete_task(lease, submission_id="c1", result_ref=result, result_digest=result.digest)
    token = pool.queue.open_consumer("training", exclusive_owner="trainer")
    pool.queue.save_consumer_state(
        "training", token=token, request_id="s1", state_ref=pool.put("s"), fetch_cursor=1, processed_cursor=1
    )
    pool.data.retain("dataset-export", [result])  # an application owner besides the queue
    assert pool.queue.collect_garbage()["reclaimed_files"] == 0  # the writer lives: staged
    worker.close()
    outcome = pool.queue.collect_garbage()
    assert (outcome["reclaimed_files"], outcome["dead_writers_found"]) == (0, 1)  # the app owner
    assert pool.owners_of(result) == ["dataset-export"]
    pool.data.release("dataset-export")
    assert pool.queue.collect_garbage()["reclaimed_files"] == 1
    assert pool.alive(result) == [False]


def test_collection_after_recovery_reads_no_root_and_check_reports_a_missing_one(pool: Pool) -> None:
    # Issue 10 item 12: the packs a root reaches are journaled with the call that named it, so
    # collecting (even right after a recovery, with no descriptor cached) opens no root. A
    # root lost outside straw therefore does not stop the collection of others; `straw check`
    # is what reports it.
    data, stray = pool.put("input"), pool.put("stray")
    pool.queue.submit_tasks("r1", [TaskSpec("t", data)])
    os.unlink(pool.root / data.manifest.segment.path)  # lost outside straw
    pool.queue.close()
    pool.queue = pool.open_queue(recover=True, store=pool.store())
    outcome = pool.queue.collect_garbage()
    assert (outcome["reclaimed_files"], outcome["queue_roots"], outcome["queue_packs"]) == (1, 1, 1)
    assert pool.alive(stray) == [False]
    assert pool.owners_of(data) == [_queue_owner(pool)]  # still owned: the root is kept
    report = check_pool(pool.root)
    assert "root.missing_pack" in {f.code for f in report.findings if f.path == data.manifest.segment.path}
    assert not report.ok


def test_i15_a_collected_input_is_refused_and_nothing_is_journaled(pool: Pool) -> None:
    data = pool.put("input")
    assert [r.record_id for r in pool.coordinator_store.read(data)] == ["input"]  # cached there
    assert pool.queue.collect_garbage()["reclaimed_files"] == 1
    with pytest.raises(InvalidReference, match=r"garbage-collected \(reclaimed\); republish"):
        pool.queue.submit_tasks("r1", [TaskSpec("t", data)])
    assert pool.queue.task_status("t") is None
    assert pool.queue.submit_tasks("r2", [TaskSpec("t2")]) == ["t2"]  # the queue still works


def test_namespaced_queues_own_their_roots_separately(pool: Pool) -> None:
    other = pool.open_queue(recover=False, queue_id="eval", namespace=True)
    mine, theirs = pool.put("mine"), pool.put("theirs")
    pool.queue.submit_tasks("r1", [TaskSpec("t", mine)])
    other.submit_tasks("r1", [TaskSpec("t", theirs)])
    assert pool.owners_of(theirs) == [other._gc_owner] != [_queue_owner(pool)]
    pool.queue.collect_garbage()
    assert pool.alive(mine, theirs) == [True, True]
    other.cancel_task("t", request_id="c")
    pool.queue.collect_garbage()  # only the other queue's own collection drops its roots
    assert pool.alive(theirs) == [True]
    other.collect_garbage()
    assert pool.alive(mine, theirs) == [True, False]
    other.close()


# --------------------------------------------------------------------------- G6 and I16


def _named_refs(queue: Coordinator) -> list[RecordSetRef]:
    """Every reference the queue's state names, read through the public views."""
    refs = []
    for status in queue.tasks.values():
        if status["spec"].get("input_ref") is not None:
            refs.append(RecordSetRef.from_dict(status["spec"]["input_ref"]))
    refs += [RecordSetRef.from_dict(c["result_ref"]) for c in queue.commits]
    for consumer in queue.consumers.values():
        if consumer["state"] is not None:
            refs += [
                RecordSetRef.from_dict(consumer["state"][k])
                for k in ("state_ref", "progress_ref")
                if k in consumer["state"]
            ]
    refs += [RecordSetRef.from_dict(c["checkpoint_ref"]) for c in queue.checkpoints.values()]
    return refs


def test_i16_every_reference_the_journal_names_is_already_owned(pool: Pool) -> None:
    owner = _queue_owner(pool)
    steps: list[Callable[[], Any]] = [
        lambda: pool.queue.submit_tasks(
            "r1", [TaskSpec("a", pool.put("in-a")), TaskSpec("b", pool.put("in-b"))]
        ),
        lambda: pool.queue.yield_task(pool.acquire("w", "a"), request_id="y", input_ref=pool.put("in-a2")),
        lambda: pool.complete(pool.acquire("w", "b"), "out-b"),
        lambda: pool.queue.register_checkpoint("ck", pool.put("ckpt")),
    ]
    for step in steps:
        step()
        for ref in _named_refs(pool.queue):  # without any collect_garbage in between
            assert owner in pool.owners_of(ref), ref.manifest.segment.path
    token = pool.queue.open_consumer("training", exclusive_owner="t")
    pool.queue.save_consumer_state(
        "training", token=token, request_id="s", state_ref=pool.put("st"), fetch_cursor=1, processed_cursor=0
    )
    for ref in _named_refs(pool.queue):
        assert owner in pool.owners_of(ref)
    # A plain store collection (no queue reconciliation) never removes a queue root.
    pool.store().collect_garbage()
    assert all(pool.alive(*_named_refs(pool.queue)))


@pytest.mark.parametrize("phase", ["before_journal_write", "after_journal_append", "after_journal_sync"])
def test_g6_a_journal_failure_after_the_catalog_add_retains_too_much_never_too_little(
    pool: Pool, phase: str
) -> None:
    data = pool.put("input")
    pool.fault.phase = phase
    with pytest.raises(IndeterminateCommit, match=f"injected at {phase}"):
        pool.queue.submit_tasks("r1", [TaskSpec("t", data)])
    owner = _queue_owner(pool)
    assert pool.owners_of(data) == [owner]  # the catalog add happened before the journal
    pool.store().collect_garbage()
    assert pool.alive(data) == [True]
    pool.crash()
    pool.queue = pool.open_queue(recover=True)
    journaled = pool.queue.task_status("t") is not None
    assert journaled == (phase != "before_journal_write")
    outcome = pool.queue.collect_garbage()  # roots replaced by exactly what the journal names
    assert outcome["reclaimed_files"] == (0 if journaled else 1)
    assert pool.alive(data) == [journaled]
    if journaled:
        assert pool.owners_of(data) == [owner]
        assert [bytes(r.payload) for r in pool.store().read(data)] == [b"input" * 20]


@pytest.mark.parametrize("phase", ["before_catalog_write", "after_catalog_append"])
def test_g6_a_catalog_failure_journals_nothing_and_the_queue_keeps_working(pool: Pool, phase: str) -> None:
    data = pool.put("input")
    pool.fault.phase = phase
    # (A raw OSError today; StorageUnavailable is what test_gc.py expects of catalog errors.)
    with pytest.raises((OSError, StorageUnavailable), match=f"injected at {phase}"):
        pool.queue.submit_tasks("r1", [TaskSpec("t", data)])
    assert pool.queue.task_status("t") is None
    assert pool.queue.submit_tasks("r1", [TaskSpec("t", data)]) == ["t"]  # not broken: retry works
    assert pool.owners_of(data) == [_queue_owner(pool)]
    pool.queue.collect_garbage()
    assert pool.alive(data) == [True]


def _catalog_end(root: Path) -> int:
    """Where the catalog log's frames end (the zeros written ahead follow, DURABILITY.md J7)."""
    catalog = Catalog(FilesystemBackend(root))
    try:
        with catalog.locked():
            return catalog.end
    finally:
        catalog.close()


def test_g6_a_complete_whose_result_pack_is_already_owned_writes_no_catalog_event(pool: Pool) -> None:
    shared = pool.store(online_gc=True)  # one pack for every result of this worker
    pool.queue.submit_tasks("r1", [TaskSpec("t0"), TaskSpec("t1")])
    sizes = []
    for i in range(2):
        lease = pool.acquire("w", f"t{i}")
        ref = shared.publish(
            [Record(f"o{i}", b"x", metadata={"task_id": f"t{i}", "attempt_id": lease.attempt_id})],
            submission_id=f"o{i}",
        )
        before = _catalog_end(pool.root)
        pool.queue.complete_task(lease, submission_id=f"c{i}", result_ref=ref, result_digest=ref.digest)
        sizes.append(_catalog_end(pool.root) - before)
    assert sizes[0] > 0  # the first result of the pack: one add event
    assert sizes[1] == 0  # the pack is already owned: no catalog write
    shared.close()
