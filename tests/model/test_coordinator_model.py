"""Model-based test: a real Coordinator against a plain reference model (dicts and lists).

A Hypothesis ``RuleBasedStateMachine`` drives one queue (fresh pool per example, injected
clock) through submit, acquire (random ``max_tasks``, prefixes, control), complete (with a
result published through the store, metadata naming the task and attempt), fail, release,
yield, heartbeat, clock advances, cancel, seal, drain, completion retries, crash-and-recover
(journal descriptor closed and lock dropped without ``close()``), clean reopen and
``read_commits``. After every step the queue must agree with the model: task states and
attempts, the pending order, the accepted log (consecutive positions, every acknowledged
completion exactly once with its digest), and the pending order after recovery (I8, I10, I12).
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import queue_helpers as qh
import straw._queue.history as history_module
import straw.coordinator as coordinator_module
from straw import Coordinator, SharedFilesystemStore, TaskSpec
from straw.errors import LeaseExpired, StaleAttempt
from straw.protocol import CommitReceipt, Lease, RecordSetRef

RUN = "run-model"
LEASE_S = 10.0
INDEX = st.integers(min_value=0, max_value=10_000)


@dataclass
class Model:
    """One task as the reference model sees it."""

    task_id: str
    priority: int
    key: int
    control: bool
    max_attempts: int
    state: str = "pending"
    failures: int = 0
    order: int = 0
    lease: Lease | None = None
    deadline: float = 0.0


@dataclass
class Acked:
    lease: Lease
    ref: RecordSetRef
    receipt: CommitReceipt


class CoordinatorModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.root = tempfile.mkdtemp(prefix="straw-model-")
        self.clock = qh.Clock()
        self.store = SharedFilesystemStore(self.root, RUN)
        self.coord = self._open(recover=False)
        self.tasks: dict[str, Model] = {}
        self.next_order = 0
        self.commits: list[tuple[str, str, str]] = []  # (task_id, submission_id, digest)
        self.acked: dict[str, Acked] = {}
        self.leases: list[Lease] = []  # every lease ever granted (most are stale)
        self.submits: dict[str, list[TaskSpec]] = {}
        self.sealed = False
        self.draining = False
        self.epoch = 1
        self.counter = 0

    def _open(self, *, recover: bool) -> Coordinator:
        return Coordinator(
            self.store, exclusive_owner="model", recover=recover, clock=self.clock, lease_seconds=LEASE_S
        )

    def teardown(self) -> None:
        try:
            self.coord.close()
            self.store.close()
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    # ------------------------------------------------------------------ model helpers

    def _fresh(self, what: str) -> str:
        self.counter += 1
        return f"{what}-{self.counter}"

    def _enqueue(self, task: Model) -> None:
        task.state = "pending"
        task.order = self.next_order
        self.next_order += 1

    def _pending(self, control: bool, prefix: str | None = None) -> list[Model]:
        found = [
            t
            for t in self.tasks.values()
            if t.state == "pending" and t.control == control and (not prefix or t.task_id.startswith(prefix))
        ]
        return sorted(found, key=lambda t: (-t.priority, t.key, t.order))

    def _spend(self, task: Model) -> None:
        """An attempt taken back (expiry, recovery): fail when attempts run out, else the tail."""
        task.failures += 1
        if task.failures >= task.max_attempts:
            task.state = "failed"
        else:
            self._enqueue(task)

    def _current(self, lease: Lease) -> Model | None:
        task = self.tasks.get(lease.task_id)
        if task is None or task.state != "leased" or task.lease != lease:
            return None
        return task

    def _leased(self) -> list[Model]:
        return [t for t in self.tasks.values() if t.state == "leased"]

    def _pick_lease(self, index: int, stale: bool) -> Lease | None:
        """A current lease, or (``stale``) any lease ever granted."""
        pool = self.leases if stale else [t.lease for t in self._leased() if t.lease is not None]
        return pool[index % len(pool)] if pool else None

    # ------------------------------------------------------------------ rules

    @initialize(
        params=st.lists(
            st.tuples(
                st.sampled_from("ab"), st.integers(0, 2), st.integers(0, 1), st.integers(1, 3), st.booleans()
            ),
            min_size=3,
            max_size=6,
        )
    )
    def start(self, params: list[tuple[str, int, int, int, bool]]) -> None:
        """Every example starts with a few tasks, so leases exist early."""
        self.submit(len(params), params)

    @rule(
        count=st.integers(0, 3),
        params=st.lists(
            st.tuples(
                st.sampled_from("ab"), st.integers(0, 2), st.integers(0, 1), st.integers(1, 3), st.booleans()
            ),
            min_size=3,
            max_size=3,
        ),
    )
    def submit(self, count: int, params: list[tuple[str, int, int, int, bool]]) -> None:
        specs = []
        for family, priority, key, attempts, control_roll in params[:count]:
            specs.append(
                TaskSpec(
                    self._fresh(family),
                    priority=priority,
                    scheduling_key=key,
                    max_attempts=attempts,
                    control=control_roll and priority == 2,
                )
            )
        request = self._fresh("submit")
        if self.sealed and specs:
            with pytest.raises(ValueError, match="sealed"):
                self.coord.submit_tasks(request, specs)
            return
        assert self.coord.submit_tasks(request, specs) == [s.task_id for s in specs]
        self.submits[request] = specs
        for spec in specs:
            task = Model(spec.task_id, spec.priority, spec.scheduling_key, spec.control, spec.max_attempts)
            self.tasks[spec.task_id] = task
            self._enqueue(task)

    @rule(index=INDEX, completion=st.booleans())
    def repeat(self, index: int, completion: bool) -> None:
        """Repeat an acknowledged call: the same answer, nothing changes (idempotent ids)."""
        if completion and self.acked:
            self._retry_completion(index)
            return
        if not self.submits:
            return
        request = sorted(self.submits)[index % len(self.submits)]
        specs = self.submits[request]
        assert self.coord.submit_tasks(request, specs) == [s.task_id for s in specs]

    @rule(
        max_tasks=st.integers(1, 3),
        prefix=st.sampled_from([None, "a", "b", "zzz"]),
        control=st.booleans(),
        worker=st.sampled_from(["w1", "w2"]),
    )
    def acquire(self, max_tasks: int, prefix: str | None, control: bool, worker: str) -> None:
        result = self.coord.acquire(worker, max_tasks, task_prefix=prefix, control=control)
        if self.draining:
            assert (result.status, result.assignments) == ("draining", ())
            return
        now = self.clock.now
        expired = sorted(
            (t for t in self._leased() if t.deadline <= now), key=lambda t: (t.deadline, t.task_id)
        )
        for task in expired:
            self._spend(task)
        wanted = self._pending(control, prefix)[:max_tasks]
        got = [a.task.task_id for a in result.assignments]
        assert got == [t.task_id for t in wanted]
        if wanted:
            assert result.status == "acquired"
        elif not any(t.state == "pending" and t.control for t in self.tasks.values()):
            # (A pending control task: see test_a_pending_control_task_keeps_the_queue_open_after_seal.)
            nothing_left = not self._pending(False) and not self._leased()
            assert result.status == ("end_of_input" if self.sealed and nothing_left else "empty")
        for assignment, task in zip(result.assignments, wanted, strict=True):
            lease = assignment.lease
            assert (lease.task_id, lease.coordinator_epoch, lease.worker_id) == (
                task.task_id,
                self.epoch,
                worker,
            )
            task.state, task.lease, task.deadline = "leased", lease, now + LEASE_S
            self.leases.append(lease)

    @rule(
        max_tasks=st.integers(1, 3),
        prefix=st.sampled_from([None, "a", "b"]),
        control=st.booleans(),
        worker=st.sampled_from(["w1", "w2"]),
    )
    def acquire_again(self, max_tasks: int, prefix: str | None, control: bool, worker: str) -> None:
        """A second acquire rule: acquires are the heart of the queue, so draw them twice as often."""
        self.acquire(max_tasks, prefix, control, worker)

    @rule(index=INDEX, stale=st.booleans())
    def complete(self, index: int, stale: bool) -> None:
        lease = self._pick_lease(index, stale)
        if lease is None:
            return
        submission = self._fresh("sub")
        ref = qh.result_for(self.store, lease, submission_id=submission, payload=submission.encode())
        task = self._current(lease)

        def call() -> CommitReceipt:
            return self.coord.complete_task(
                lease, submission_id=submission, result_ref=ref, result_digest=ref.digest
            )

        if task is None:
            with pytest.raises(StaleAttempt):
                call()
        elif self.clock.now >= task.deadline:
            with pytest.raises(LeaseExpired):
                call()
        else:
            receipt = call()
            assert (receipt.position, receipt.task_id, receipt.digest) == (
                len(self.commits),
                task.task_id,
                ref.digest,
            )
            self.commits.append((task.task_id, submission, ref.digest))
            self.acked[submission] = Acked(lease, ref, receipt)
            task.state = "completed"

    @rule(indexes=st.lists(INDEX, min_size=1, max_size=4), stale=st.booleans(), retries=st.integers(0, 2))
    def complete_many(self, indexes: list[int], stale: bool, retries: int) -> None:
        """``complete_tasks``: all entries accepted in order at consecutive positions, or the
        first refused entry's error and nothing accepted; accepted submissions in the batch
        (``retries`` of them, at the front) answer their original receipts."""
        leases = [lease for lease in (self._pick_lease(i, stale) for i in indexes) if lease is not None]
        old = sorted(self.acked)[:retries]
        entries: list[dict[str, Any]] = []
        expected: list[CommitReceipt | None] = []
        for submission in old:
            acked = self.acked[submission]
            entries.append(
                {
                    "lease": acked.lease,
                    "submission_id": submission,
                    "result_ref": acked.ref,
                    "result_digest": acked.ref.digest,
                }
            )
            expected.append(acked.receipt)
        refused: type[Exception] | None = None
        taken: set[str] = set()
        for lease in leases:
            submission = self._fresh("sub")
            ref = qh.result_for(self.store, lease, submission_id=submission, payload=submission.encode())
            entries.append(
                {"lease": lease, "submission_id": submission, "result_ref": ref, "result_digest": ref.digest}
            )
            expected.append(None)
            task = self._current(lease)
            if refused is None and (task is None or lease.task_id in taken):
                refused = StaleAttempt
            elif refused is None and self.clock.now >= task.deadline:  # type: ignore[union-attr]
                refused = LeaseExpired
            taken.add(lease.task_id)
        if refused is not None:
            with pytest.raises(refused, match="complete_tasks entry"):
                self.coord.complete_tasks(entries)
            return
        receipts = self.coord.complete_tasks(entries)
        assert len(receipts) == len(entries)
        for item, receipt, known in zip(entries, receipts, expected, strict=True):
            if known is not None:
                assert receipt == known
                continue
            task = self.tasks[item["lease"].task_id]
            assert (receipt.position, receipt.task_id, receipt.digest) == (
                len(self.commits),
                task.task_id,
                item["result_digest"],
            )
            self.commits.append((task.task_id, item["submission_id"], item["result_digest"]))
            self.acked[item["submission_id"]] = Acked(item["lease"], item["result_ref"], receipt)
            task.state = "completed"

    def _retry_completion(self, index: int) -> None:
        submission = sorted(self.acked)[index % len(self.acked)]
        acked = self.acked[submission]
        again = self.coord.complete_task(
            acked.lease, submission_id=submission, result_ref=acked.ref, result_digest=acked.ref.digest
        )
        assert again == acked.receipt

    @rule(index=INDEX, stale=st.booleans(), retryable=st.booleans())
    def fail(self, index: int, stale: bool, retryable: bool) -> None:
        lease = self._pick_lease(index, stale)
        if lease is None:
            return
        task = self._current(lease)
        request = self._fresh("fail")
        if task is None:
            with pytest.raises(StaleAttempt):
                self.coord.fail_task(lease, request_id=request, failure="boom", retryable=retryable)
            return
        if self.clock.now >= task.deadline:
            with pytest.raises(LeaseExpired):
                self.coord.fail_task(lease, request_id=request, failure="boom", retryable=retryable)
            return
        answer = self.coord.fail_task(lease, request_id=request, failure="boom", retryable=retryable)
        task.failures += 1
        if not retryable or task.failures >= task.max_attempts:
            task.state = "failed"
        else:
            self._enqueue(task)
        assert answer == task.state

    @rule(
        index=INDEX,
        stale=st.booleans(),
        how=st.sampled_from(["release", "yield", "yield-priority-0", "yield-priority-2"]),
    )
    def give_back(self, index: int, stale: bool, how: str) -> None:
        """Release a lease, or yield it (optionally with a new priority): no attempt spent."""
        if how == "release":
            self._release(index, stale)
        else:
            self._yield(index, stale, None if how == "yield" else int(how[-1]))

    def _release(self, index: int, stale: bool) -> None:
        lease = self._pick_lease(index, stale)
        if lease is None:
            return
        task = self._current(lease)
        answer = self.coord.release_tasks([lease], request_id=self._fresh("release"))
        if task is None:
            assert answer == ["StaleAttempt"]
        else:
            assert answer == ["released"]  # an expired lease may still give its task back
            self._enqueue(task)

    def _yield(self, index: int, stale: bool, priority: int | None) -> None:
        lease = self._pick_lease(index, stale)
        if lease is None:
            return
        task = self._current(lease)
        update: dict[str, Any] = {"lease": lease, "input_ref": None}
        if priority is not None:
            update["priority"] = priority
        if task is None:
            with pytest.raises(StaleAttempt):
                self.coord.yield_tasks([update], request_id=self._fresh("yield"))
            return
        assert self.coord.yield_tasks([update], request_id=self._fresh("yield")) == "pending"
        if priority is not None:
            task.priority = priority
        self._enqueue(task)

    @rule(indexes=st.lists(INDEX, min_size=1, max_size=3, unique=True), tick=st.booleans())
    def heartbeat(self, indexes: list[int], tick: bool) -> None:
        if not self.leases:
            return
        if tick:
            self.clock.advance(0.5)
        now = self.clock.now
        chosen = list(dict.fromkeys(self.leases[i % len(self.leases)] for i in indexes))
        expected = []
        for lease in chosen:
            task = self._current(lease)
            if task is None:
                expected.append("StaleAttempt")
            elif now >= task.deadline:
                expected.append("LeaseExpired")
            else:
                expected.append("extended")
                task.deadline = now + LEASE_S
        assert self.coord.heartbeat(chosen) == expected

    @rule(seconds=st.sampled_from([0.5, 4.0, LEASE_S, 11.0]))
    def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)

    @rule(index=INDEX, ghost=st.booleans())
    def cancel(self, index: int, ghost: bool) -> None:
        request = self._fresh("cancel")
        if ghost or not self.tasks:
            with pytest.raises(KeyError):
                self.coord.cancel_task("ghost", request_id=request)
            return
        task = list(self.tasks.values())[index % len(self.tasks)]
        if task.state in ("pending", "leased"):
            task.state = "cancelled"
        assert self.coord.cancel_task(task.task_id, request_id=request) == task.state

    @rule(what=st.sampled_from(["nothing", "nothing", "nothing", "seal", "drain"]))
    def lifecycle(self, what: str) -> None:
        """Seal the input or drain the queue, rarely (so most examples keep feeding the queue)."""
        if what == "seal":
            assert self.coord.seal_input(self._fresh("seal")) is True
            self.sealed = True
        elif what == "drain":
            counts = self.coord.drain()
            states = [t.state for t in self.tasks.values()]
            assert counts == {s: states.count(s) for s in ("pending", "leased", "completed")}
            self.draining = True

    def _recovered(self) -> None:
        """What a new epoch does: every lease revoked (an attempt spent), in submission order."""
        self.coord = self._open(recover=True)
        self.epoch += 1
        self.draining = False
        for task in self._leased():
            self._spend(task)
        assert self.coord.epoch == self.epoch

    @rule(crash=st.booleans())
    def restart(self, crash: bool) -> None:
        """Crash (journal descriptor closed, lock dropped, no close()) or close; then recover."""
        if crash:
            qh.crash(self.coord)
        else:
            self.coord.close()
        self._recovered()

    @rule(cursor=st.integers(0, 12), limit=st.integers(1, 5))
    def read_commits(self, cursor: int, limit: int) -> None:
        page = self.coord.read_commits(cursor, limit)
        wanted = self.commits[cursor : cursor + limit]
        assert [(c.task_id, c.submission_id, c.digest) for c in page.commits] == wanted
        assert [c.position for c in page.commits] == list(range(cursor, cursor + len(wanted)))
        assert page.cursor == cursor + len(wanted)

    # ------------------------------------------------------------------ invariants

    @invariant()
    def tasks_match(self) -> None:
        seen = {k: (v["state"], v["failures"]) for k, v in self.coord.tasks.items()}
        assert seen == {k: (t.state, t.failures) for k, t in self.tasks.items()}

    @invariant()
    def pending_order_matches(self) -> None:
        assert [s.task_id for s in self.coord.pending_tasks()] == [t.task_id for t in self._pending(False)]

    @invariant()
    def accepted_log_matches(self) -> None:
        commits = self.coord.commits
        assert [c["position"] for c in commits] == list(range(len(commits)))
        assert [(c["task_id"], c["submission_id"], c["digest"]) for c in commits] == self.commits
        submissions = [c["submission_id"] for c in commits]
        assert len(set(submissions)) == len(submissions)
        assert len({c["task_id"] for c in commits}) == len(commits)  # no task completed twice
        for submission, acked in self.acked.items():
            assert commits[acked.receipt.position]["submission_id"] == submission


CoordinatorModel.TestCase.settings = settings(
    max_examples=50,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestCoordinatorModel = CoordinatorModel.TestCase


class SpillingCoordinatorModel(CoordinatorModel):
    """The same model with a snapshot at every call that no takeover (H3) holds back, in the
    calling thread (``snapshot_at_the_next_call``): what turns
    terminal moves to history files at once (docs/FORMAT.md 8.4), so every lookup below is
    answered from disk for most of history, and must stay exact (issue 12 item 1). Files go
    into an index run as soon as two are outside the runs, and runs hold a few entries at
    most, so lookups go through several runs the snapshot job wrote, merged as they double,
    live and after each recovery."""

    def __init__(self) -> None:
        self._saved = (
            coordinator_module.JOURNAL_SNAPSHOT_BYTES_MIN,
            coordinator_module.SNAPSHOTS_IN_BACKGROUND,
            history_module.HISTORY_UNMERGED_FILES_MAX,
            history_module.HISTORY_RUN_ENTRIES_MAX,
        )
        coordinator_module.JOURNAL_SNAPSHOT_BYTES_MIN = 1
        coordinator_module.SNAPSHOTS_IN_BACKGROUND = False
        history_module.HISTORY_UNMERGED_FILES_MAX = 1
        history_module.HISTORY_RUN_ENTRIES_MAX = 8
        super().__init__()

    def teardown(self) -> None:
        try:
            super().teardown()
        finally:
            (
                coordinator_module.JOURNAL_SNAPSHOT_BYTES_MIN,
                coordinator_module.SNAPSHOTS_IN_BACKGROUND,
                history_module.HISTORY_UNMERGED_FILES_MAX,
                history_module.HISTORY_RUN_ENTRIES_MAX,
            ) = self._saved

    @invariant()
    def snapshot_at_the_next_call(self) -> None:
        # The threshold is the larger of JOURNAL_SNAPSHOT_BYTES_MIN (1 here) and the size of the
        # last snapshot, which alone would allow one snapshot every few calls: forgetting that
        # size makes the next call snapshot (unless a takeover is still under way, H3).
        self.coord._journal.snapshot_bytes = 0

    @invariant()
    def lookups_exact(self) -> None:
        for task_id, task in self.tasks.items():
            status = self.coord.task_status(task_id)
            assert status is not None and (status["state"], status["failures"]) == (task.state, task.failures)
        for submission, acked in self.acked.items():
            assert self.coord.lookup_submission(submission) == acked.receipt
        history = self.coord._state.history
        SPILLED.append((len(history.files), history.run_stop))


#: History files, and those the index runs cover, seen after each step (the test below checks
#: the model did reach the disk and the runs).
SPILLED: list[tuple[int, int]] = []


def test_the_spilling_model_reaches_history_files_and_index_runs() -> None:
    _SpillingCase("runTest").runTest()
    assert max(files for files, _ in SPILLED) > 0
    assert max(merged for _, merged in SPILLED) > 1


SpillingCoordinatorModel.TestCase.settings = settings(
    max_examples=25,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
_SpillingCase = SpillingCoordinatorModel.TestCase  # run (and checked) by the test above
