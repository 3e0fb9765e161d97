"""The queue's pure state machine (``straw._queue.machine``), driven directly: no I/O, no clock.

Every row of ``TRANSITIONS`` is reached and every illegal apply is an ``InvariantViolation``;
acquisition order (priority descending, scheduling key ascending, FIFO, returned tasks at
the tail); ``task_ids`` / ``task_prefix`` / ``control`` filters; expiry by ``now``; attempt
accounting; idempotent request ids with no state change on any error; the snapshot
round trip ``state_to_dict -> state_from_dict``; and an acquire whose cost does not grow
with the number of pending tasks.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import asdict
from typing import Any

import pytest

from straw._queue import events, machine
from straw._queue import index as index_module
from straw._queue.machine import (
    CANCELLED,
    COMPLETED,
    FAILED,
    LEASED,
    PENDING,
    SNAPSHOT_VERSION,
    STATES,
    TRANSITIONS,
    Answer,
    QueueState,
    new_state,
    state_from_dict,
    state_to_dict,
)
from straw.errors import (
    CorruptData,
    IdempotencyConflict,
    InvalidReference,
    InvariantViolation,
    LeaseExpired,
    QueueError,
    ResourceLimitExceeded,
    StaleAttempt,
    UnsafeRecovery,
    UnsupportedSchema,
)
from straw.protocol import Lease, RecordRef, RecordSetRef, SegmentRef, TaskSpec, decode, encode

RUN = "run-machine"
QUEUE = "rollout"
LIMITS = {"max_result_bytes": 1 << 20, "max_result_tokens": 10_000, "metadata_bytes": 1024}
LEASE_S = 10.0


# --------------------------------------------------------------------------- helpers


class Ids:
    """Deterministic id factory (the coordinator passes random hex; tests need replayable ids)."""

    def __init__(self, prefix: str = "id") -> None:
        self.prefix = prefix
        self.n = 0

    def __call__(self) -> str:
        self.n += 1
        return f"{self.prefix}{self.n:06d}"


def fresh(epoch: int = 1) -> QueueState:
    state = new_state(RUN, QUEUE, LIMITS)
    state.apply(events.Epoch(epoch=epoch))
    return state


def run(state: QueueState, decision: Any) -> Any:
    """Apply a check's event, or return its answer (what the coordinator does, minus the journal)."""
    return decision.value if isinstance(decision, Answer) else state.apply(decision)


def dump(state: QueueState) -> Any:
    """The state as the JSON a snapshot would hold (tuples and lists compare equal after this)."""
    return decode(encode(state_to_dict(state)))


def fake_ref(seed: str = "r", *, records: int = 1, payload_bytes: int = 10, tokens: int = 1) -> RecordSetRef:
    """A well-formed reference; the pure machine never reads the store."""
    segment = SegmentRef(RUN, f"raw/{'a' * 32}/{'b' * 32}.pack", "b" * 32, 100, "c" * 32)
    digest = (seed * 64)[:64]
    return RecordSetRef(RecordRef(segment, 0), digest, records, payload_bytes, tokens)


def submit(state: QueueState, *specs: TaskSpec, rid: str | None = None, **kw: Any) -> list[str]:
    rid = rid if rid is not None else "submit-" + "-".join(s.task_id for s in specs)
    return list(run(state, state.check_submit(rid, list(specs), kw.get("producer"), kw.get("pstate"))))


def acquire(
    state: QueueState,
    worker: str = "w",
    n: int = 1,
    *,
    now: float = 0.0,
    ids: Callable[[], str] | None = None,
    task_ids: list[str] | None = None,
    prefix: str | None = None,
    control: bool = False,
) -> list[Lease] | str:
    """Leases granted (possibly none), or the idle status string."""
    decision = state.check_acquire(
        worker, n, task_ids, prefix, control, now, LEASE_S, ids if ids is not None else Ids(f"{worker}-")
    )
    return run(state, decision)  # type: ignore[no-any-return]


def one(state: QueueState, task_id: str, *, now: float = 0.0, worker: str = "w") -> Lease:
    leases = acquire(state, worker, task_ids=[task_id], now=now)
    assert isinstance(leases, list) and [x.task_id for x in leases] == [task_id], leases
    return leases[0]


def sweep(state: QueueState, now: float) -> Any:
    """Reclaim expired leases without granting anything (an acquire naming no task)."""
    return acquire(state, "sweeper", task_ids=[], now=now)


def complete(state: QueueState, lease: Lease, sub: str, *, now: float = 0.0) -> dict[str, Any]:
    ref = fake_ref(sub[0])
    return run(state, state.check_complete(lease, sub, ref, ref.digest, now, Ids("commit-")))  # type: ignore[no-any-return]


def order(state: QueueState) -> list[str]:
    return list(state.pending.ordered())


def statuses(state: QueueState) -> dict[str, str]:
    return {k: t.state for k, t in state.tasks.items()}


# --------------------------------------------------------------------------- the transition table


def test_every_transition_row_is_reached_and_no_other(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: set[tuple[str | None, str, str]] = set()
    real_move = QueueState._move

    def recording(self: QueueState, task: Any, event: str, to: str) -> None:
        seen.add((task.state, event, to))
        real_move(self, task, event, to)

    monkeypatch.setattr(QueueState, "_move", recording)
    s = fresh()
    ids = [*"abcdefghij"]
    specs = [TaskSpec(t) for t in ids] + [TaskSpec("once", max_attempts=1)]
    submit(s, *specs)
    assert statuses(s) == dict.fromkeys([*ids, "once"], PENDING)  # (None, submit) -> pending
    complete(s, one(s, "a"), "sub-a")  # acquire, complete
    one(s, "b", now=0.0)
    one(s, "once", now=0.0)
    sweep(s, now=LEASE_S)  # reclaim -> pending (b) and reclaim -> failed (once: 1 of 1 attempts)
    assert (s.tasks["b"].state, s.tasks["once"].state) == (PENDING, FAILED)
    run(s, s.check_fail(one(s, "c", now=20), "f-c", "boom", True, 20))  # fail -> pending
    run(s, s.check_fail(one(s, "d", now=20), "f-d", "boom", False, 20))  # fail -> failed
    run(s, s.check_release([one(s, "e", now=20)], "r-e", 20))  # release
    run(s, s.check_yield([{"lease": one(s, "f", now=20), "input_ref": None}], "y-f", 20))  # yield
    lease_g = one(s, "g", now=20)
    run(s, s.check_progress([{"lease": lease_g, "input_ref": fake_ref("p")}], "p-g", 20))  # progress
    run(s, s.check_cancel("h", "c-h"))  # cancel pending
    run(s, s.check_cancel("g", "c-g"))  # cancel leased
    expected = {(frm, ev, to) for (frm, ev), tos in TRANSITIONS.items() if frm is not None for to in tos}
    assert seen == expected
    assert set(TRANSITIONS) == {(frm, ev) for frm, ev, _ in seen} | {(None, "submit")}


def _task_in_every_state() -> QueueState:
    s = fresh()
    submit(s, TaskSpec("p"), TaskSpec("l"), TaskSpec("c"), TaskSpec("f"), TaskSpec("x"), TaskSpec("r"))
    one(s, "l")
    complete(s, one(s, "c"), "sub-c")
    run(s, s.check_fail(one(s, "f"), "fail-f", "boom", False, 0))
    run(s, s.check_cancel("x", "cancel-x"))
    run(s, s.check_release([one(s, "r")], "release-r", 0))  # pending again, but with a last lease
    assert statuses(s) == {
        "p": PENDING,
        "l": LEASED,
        "c": COMPLETED,
        "f": FAILED,
        "x": CANCELLED,
        "r": PENDING,
    }
    return s


def _event(op: str, task_id: str, attempt: str) -> dict[str, Any]:
    ref = asdict(fake_ref("q"))
    return {
        "acquire": {
            "op": "acquire",
            "worker_id": "w2",
            "reclaimed": [],
            "grants": [[task_id, "a2", "t2"]],
            "deadline": 5.0,
        },
        "reclaim": {"op": "retire", "worker_id": "w", "leased": [[task_id, attempt]], "reads": []},
        "complete": {
            "op": "complete",
            "task_id": task_id,
            "attempt_id": attempt,
            "submission_id": f"s-{task_id}-late",
            "commit_id": "c2",
            "digest": "e" * 64,
            "result_ref": ref,
        },
        "fail": {
            "op": "fail",
            "request_id": f"rq-{task_id}",
            "fingerprint": "f",
            "task_id": task_id,
            "attempt_id": attempt,
            "failure": "boom",
            "retryable": True,
        },
        "release": {
            "op": "release",
            "request_id": f"rq-{task_id}",
            "fingerprint": "f",
            "leases": [[task_id, attempt]],
            "outcomes": ["released"],
        },
        "yield": {
            "op": "yield",
            "request_id": f"rq-{task_id}",
            "fingerprint": "f",
            "updates": [
                {
                    "task_id": task_id,
                    "attempt_id": attempt,
                    "input_ref": None,
                    "priority": None,
                    "scheduling_key": None,
                    "metadata": None,
                }
            ],
        },
        "progress": {
            "op": "progress",
            "request_id": f"rq-{task_id}",
            "fingerprint": "f",
            "updates": [{"task_id": task_id, "attempt_id": attempt, "input_ref": ref}],
        },
    }[op]


_STATE_TASK = {PENDING: "p", LEASED: "l", COMPLETED: "c", FAILED: "f", CANCELLED: "x"}
_EVENTS = ("acquire", "reclaim", "complete", "fail", "release", "yield", "progress")
_ILLEGAL = [(state, event) for state in STATES for event in _EVENTS if (state, event) not in TRANSITIONS] + [
    ("pending-with-old-lease", event) for event in _EVENTS if (PENDING, event) not in TRANSITIONS
]


def _illegal_params() -> Iterator[Any]:
    for state, event in _ILLEGAL:
        yield pytest.param(state, event, id=f"{state}-{event}")


@pytest.mark.parametrize(("state_name", "event"), list(_illegal_params()))
def test_illegal_apply_is_an_invariant_violation(state_name: str, event: str) -> None:
    s = _task_in_every_state()
    task_id = "r" if state_name == "pending-with-old-lease" else _STATE_TASK[state_name]
    lease = s.tasks[task_id].lease
    attempt = lease.attempt_id if lease is not None else "never-leased"
    with pytest.raises(InvariantViolation, match="straw invariant violated"):
        s.apply(events.from_body(_event(event, task_id, attempt)))


def test_cancel_of_a_finished_task_is_a_documented_no_op() -> None:
    s = _task_in_every_state()
    before = dump(s)
    for task_id, state in (("c", COMPLETED), ("f", FAILED), ("x", CANCELLED)):
        assert run(s, s.check_cancel(task_id, f"again-{task_id}")) == state
    after = dump(s)
    assert after["tasks"] == before["tasks"]
    assert after["next_order"] == before["next_order"]


@pytest.mark.parametrize("epoch", [1, 0], ids=["same-epoch", "older-epoch"])
def test_backward_epochs_are_invariant_violations(epoch: int) -> None:
    s = fresh()  # epochs only grow
    with pytest.raises(InvariantViolation):
        s.apply(events.Epoch(epoch=epoch))


# --------------------------------------------------------------------------- ordering


def test_order_is_priority_desc_then_scheduling_key_asc_then_fifo() -> None:
    rng = random.Random(7)
    specs = [
        TaskSpec(
            f"t{i:03d}",
            priority=rng.choice([-(2**63), -1, 0, 3, 2**63 - 1]),
            scheduling_key=rng.choice([-5, 0, 9]),
        )
        for i in range(120)
    ]
    s = fresh()
    # Several requests, so FIFO order spans requests too.
    for start in range(0, 120, 17):
        submit(s, *specs[start : start + 17], rid=f"batch-{start}")
    expected = [
        s.task_id
        for _, s in sorted(enumerate(specs), key=lambda p: (-p[1].priority, p[1].scheduling_key, p[0]))
    ]
    assert [x.task_id for x in s.pending_specs(None, None)] == expected
    got: list[str] = []
    while True:
        leases = acquire(s, n=rng.randint(1, 7))
        if isinstance(leases, str):
            break
        got += [x.task_id for x in leases]
    assert got == expected
    assert leases == "empty"


def test_min_priority_and_prefix_views_keep_acquisition_order() -> None:
    s = fresh()
    submit(s, *(TaskSpec(f"{'ab'[i % 2]}{i}", priority=i % 3) for i in range(12)))
    full = [x.task_id for x in s.pending_specs(None, None)]
    assert [x.task_id for x in s.pending_specs("a", None)] == [t for t in full if t.startswith("a")]
    assert [x.task_id for x in s.pending_specs(None, 1)] == [t for t in full if s.tasks[t].spec.priority >= 1]


@pytest.mark.parametrize("how", ["release", "fail", "yield", "expiry", "recovery", "retire"])
def test_returned_tasks_go_to_the_tail_of_their_priority_and_key(how: str) -> None:
    s = fresh()
    submit(
        s,
        TaskSpec("hi", priority=5),
        TaskSpec("a"),
        TaskSpec("b"),
        TaskSpec("c"),
        TaskSpec("lo", priority=-1),
    )
    lease = one(s, "a", worker="w1")
    if how == "release":
        run(s, s.check_release([lease], "rel", 1))
    elif how == "fail":
        assert run(s, s.check_fail(lease, "fail", "oops", True, 1)) == PENDING
    elif how == "yield":
        run(s, s.check_yield([{"lease": lease, "input_ref": None}], "yld", 1))
    elif how == "expiry":
        sweep(s, now=LEASE_S)
    elif how == "recovery":
        s.apply(events.Epoch(epoch=s.epoch + 1))
    else:
        run(s, s.check_retire("w1"))
    assert order(s) == ["hi", "b", "c", "a", "lo"]


def test_yield_with_a_new_priority_moves_the_task_to_that_tail() -> None:
    s = fresh()
    submit(s, TaskSpec("x", priority=9), TaskSpec("a"), TaskSpec("b", priority=9, scheduling_key=1))
    lease = one(s, "a")
    run(s, s.check_yield([{"lease": lease, "input_ref": fake_ref("n"), "priority": 9}], "y", 0))
    assert order(s) == ["x", "a", "b"]  # priority 9, key 0 after x; key 1 after all key 0
    assert s.tasks["a"].spec.input_ref == fake_ref("n")
    assert s.tasks["a"].failures == 0


def test_tasks_reclaimed_by_acquire_are_granted_in_priority_order() -> None:
    s = fresh()
    submit(s, TaskSpec("hi", priority=5))
    one(s, "hi", now=0.0)
    submit(s, TaskSpec("lo"), rid="later")
    leases = acquire(s, n=1, now=LEASE_S)
    assert isinstance(leases, list)
    assert [x.task_id for x in leases] == ["hi"]


def test_tasks_reclaimed_together_are_granted_in_fifo_order() -> None:
    s = fresh()
    names = [f"t{i:02d}" for i in range(64)]
    submit(s, *(TaskSpec(n) for n in names))
    acquire(s, n=64, now=0.0)  # one deadline for all
    leases = acquire(s, n=3, now=LEASE_S)
    assert isinstance(leases, list)
    assert [x.task_id for x in leases] == names[:3]


def test_reclaim_in_acquire_matches_a_separate_sweep_when_priorities_are_equal() -> None:
    """With one priority and key, reclaim-then-grant equals the documented FIFO tail order."""
    s = fresh()
    submit(s, TaskSpec("a"), TaskSpec("b"))
    one(s, "a", now=0.0)
    leases = acquire(s, n=2, now=LEASE_S)
    assert isinstance(leases, list)
    assert [x.task_id for x in leases] == ["b", "a"]
    assert s.tasks["a"].failures == 1


# --------------------------------------------------------------------------- filters


def test_task_ids_filter_takes_only_named_acquirable_tasks_in_the_given_order() -> None:
    s = fresh()
    submit(s, *(TaskSpec(t) for t in "abcdef"), TaskSpec("ctl", control=True))
    one(s, "c")
    leases = acquire(s, n=3, task_ids=["e", "nope", "c", "ctl", "a", "a", "b"])
    assert isinstance(leases, list)
    assert [x.task_id for x in leases] == ["e", "a", "b"]  # unknown, leased and control skipped; capped
    assert acquire(s, task_ids=["nope"]) == "empty"
    with pytest.raises(TypeError, match="not one string"):
        s.check_acquire("w", 1, "abc", None, False, 0.0, LEASE_S, Ids())


def test_task_prefix_filter_takes_matching_tasks_in_acquisition_order() -> None:
    s = fresh()
    submit(
        s,
        TaskSpec("job-2"),
        TaskSpec("other"),
        TaskSpec("job-1", priority=1),
        TaskSpec("jo"),
        TaskSpec("job-3"),
    )
    leases = acquire(s, n=2, prefix="job-")
    assert isinstance(leases, list)
    assert [x.task_id for x in leases] == ["job-1", "job-2"]
    leases = acquire(s, n=5, prefix="job-")
    assert isinstance(leases, list)
    assert [x.task_id for x in leases] == ["job-3"]
    assert acquire(s, prefix="job-") == "empty"
    assert order(s) == ["other", "jo"]


def test_control_tasks_only_with_control_true_and_never_otherwise() -> None:
    s = fresh()
    submit(s, TaskSpec("c1", control=True, priority=9), TaskSpec("n1"), TaskSpec("c2", control=True))
    normal = acquire(s, n=5)
    assert isinstance(normal, list)
    assert [x.task_id for x in normal] == ["n1"]
    assert acquire(s, n=5) == "empty"
    control = acquire(s, n=5, control=True)
    assert isinstance(control, list)
    assert [x.task_id for x in control] == ["c1", "c2"]
    assert acquire(s, control=True) == "empty"
    assert [x.task_id for x in s.pending_specs(None, None)] == []


# --------------------------------------------------------------------------- expiry and attempts


def test_expiry_follows_now_and_heartbeats_extend_it() -> None:
    s = fresh()
    submit(s, TaskSpec("a"), TaskSpec("b"))
    lease = one(s, "a", now=100.0)
    assert s.tasks["a"].deadline == 100.0 + LEASE_S
    assert s.expired(109.999) == []
    assert s.heartbeat([lease], 105.0, LEASE_S) == ["extended"]
    assert s.expired(110.0) == []  # extended to 115
    with pytest.raises(LeaseExpired, match="expired"):
        s.current(lease, 115.0)  # the deadline itself is already expired
    assert s.current(lease, 114.9).spec.task_id == "a"
    assert s.expired(115.0) == [["a", lease.attempt_id]]
    assert s.heartbeat([lease], 115.0, LEASE_S) == ["LeaseExpired"]
    # Until an acquire reclaims it, an expired lease is still the task's lease.
    assert s.tasks["a"].state == LEASED
    got = acquire(s, n=1, now=115.0)
    assert isinstance(got, list)
    assert [x.task_id for x in got] == ["b"]
    assert s.tasks["a"].state == PENDING and s.tasks["a"].failures == 1
    assert s.heartbeat([lease], 115.0, LEASE_S) == ["StaleAttempt"]


def test_heartbeat_at_the_same_instant_does_not_double_reclaim() -> None:
    s = fresh()
    submit(s, TaskSpec("a"))
    lease = one(s, "a", now=0.0)
    assert s.heartbeat([lease], 0.0, LEASE_S) == ["extended"]
    sweep(s, now=LEASE_S)
    assert (s.tasks["a"].state, s.tasks["a"].failures) == (PENDING, 1)


def test_expiry_reclaims_spend_attempts_until_the_task_fails() -> None:
    s = fresh()
    submit(s, TaskSpec("a", max_attempts=3))
    now = 0.0
    for spent in (1, 2):
        one(s, "a", now=now)
        now += LEASE_S
        sweep(s, now)
        assert (s.tasks["a"].state, s.tasks["a"].failures) == (PENDING, spent)
    one(s, "a", now=now)
    sweep(s, now + LEASE_S)
    task = s.tasks["a"]
    assert (task.state, task.failures) == (FAILED, 3)
    assert "lease expired; 3 of 3 attempts spent" in (task.failure or "")
    assert s.counts[FAILED] == 1 and s.counts[PENDING] == 0


def test_a_grant_spends_no_attempt_and_generation_counts_grants() -> None:
    s = fresh()
    submit(s, TaskSpec("a", max_attempts=1))
    for gen in (1, 2, 3):
        lease = one(s, "a")
        assert (lease.generation, s.tasks["a"].failures) == (gen, 0)
        run(s, s.check_release([lease], f"rel-{gen}", 0))
    assert s.tasks["a"].state == PENDING


def test_acquire_does_not_regrant_a_task_its_own_reclaim_exhausts() -> None:
    s = fresh()
    submit(s, TaskSpec("a", max_attempts=1))
    one(s, "a", now=0.0)
    assert acquire(s, task_ids=["a"], now=LEASE_S) == []  # a reclaim-only event, no grant
    assert s.tasks["a"].state == FAILED


def test_fail_spends_an_attempt_and_non_retryable_fails_at_once() -> None:
    s = fresh()
    submit(s, TaskSpec("a", max_attempts=2), TaskSpec("b", max_attempts=5))
    assert run(s, s.check_fail(one(s, "a"), "f1", "first", True, 0)) == PENDING
    assert run(s, s.check_fail(one(s, "a"), "f2", "second", True, 0)) == FAILED
    assert (s.tasks["a"].failures, s.tasks["a"].failure) == (2, "second")
    assert run(s, s.check_fail(one(s, "b"), "f3", "fatal", False, 0)) == FAILED
    assert s.tasks["b"].failures == 1


def test_new_epoch_revokes_every_lease_and_spends_an_attempt() -> None:
    s = fresh()
    submit(s, TaskSpec("a"), TaskSpec("b", max_attempts=1), TaskSpec("c"))
    la, lb = one(s, "a"), one(s, "b")
    s.draining = True
    assert s.apply(events.Epoch(epoch=2)) == 2
    assert (s.tasks["a"].state, s.tasks["a"].failures) == (PENDING, 1)
    assert (s.tasks["b"].state, s.tasks["b"].failures) == (FAILED, 1)
    assert "revoked by recovery (epoch 2)" in (s.tasks["b"].failure or "")
    assert not s.draining
    for lease in (la, lb):
        with pytest.raises(StaleAttempt):
            s.current(lease, 0.0)
    new = one(s, "a")
    assert new.coordinator_epoch == 2


def test_retire_spends_attempts_ends_reads_and_returns_the_workers_receipts() -> None:
    s = fresh()
    submit(s, TaskSpec("a"), TaskSpec("b", input_ref=fake_ref("i")), TaskSpec("c"))
    receipt = complete(s, one(s, "a", worker="w1"), "sub-a")
    lb = one(s, "b", worker="w1")
    one(s, "c", worker="w2")
    assert (lb.task_id, lb.attempt_id) in s.reads
    assert run(s, s.check_retire("w1")) == [receipt]
    assert (s.tasks["b"].state, s.tasks["b"].failures) == (PENDING, 1)
    assert s.tasks["c"].state == LEASED
    assert s.reads == {}


# --------------------------------------------------------------------------- idempotency and errors


def _busy_state() -> tuple[QueueState, dict[str, Lease]]:
    s = fresh()
    submit(s, *(TaskSpec(t) for t in "abcdefg"), rid="first")
    leases = {t: one(s, t, now=0.0) for t in "abcde"}
    return s, leases


def test_same_request_id_gives_the_same_answer_without_an_event() -> None:
    s, leases = _busy_state()
    cases: list[tuple[str, Callable[[], Any]]] = [
        ("submit", lambda: s.check_submit("first", [TaskSpec(t) for t in "abcdefg"], None, None)),
        ("fail", lambda: s.check_fail(leases["a"], "rq-fail", "x", True, 1.0)),
        ("release", lambda: s.check_release([leases["b"]], "rq-rel", 1.0)),
        ("yield", lambda: s.check_yield([{"lease": leases["c"], "input_ref": None}], "rq-y", 1.0)),
        (
            "progress",
            lambda: s.check_progress([{"lease": leases["d"], "input_ref": fake_ref("p")}], "rq-p", 1.0),
        ),
        ("cancel", lambda: s.check_cancel("f", "rq-cancel")),
        ("seal", lambda: s.check_seal("rq-seal")),
    ]
    for name, check in cases:
        if name != "submit":
            first = run(s, check())
        else:
            first = ["a", "b", "c", "d", "e", "f", "g"]
        before = dump(s)
        again = check()
        assert isinstance(again, Answer), name
        assert again.value == first, name
        assert dump(s) == before, name


def test_releasing_the_same_lease_twice_in_one_call_releases_it_once() -> None:
    s = fresh()
    submit(s, TaskSpec("a"))
    lease = one(s, "a")
    before = dump(s)
    try:
        decision = s.check_release([lease, lease], "rel-twice", 0.0)
    except ValueError:
        assert dump(s) == before  # rejected like yield_tasks does: nothing changed
        return
    assert run(s, decision) == ["released", "StaleAttempt"]
    assert (s.tasks["a"].state, order(s)) == (PENDING, ["a"])


def test_completion_retry_returns_the_receipt_and_a_changed_digest_conflicts() -> None:
    s, leases = _busy_state()
    receipt = complete(s, leases["a"], "sub-a")
    before = dump(s)
    ref = fake_ref("s")
    again = s.check_complete(leases["a"], "sub-a", ref, receipt["digest"], 5.0, Ids())
    assert isinstance(again, Answer) and again.value == receipt
    with pytest.raises(IdempotencyConflict, match="sub-a"):
        s.check_complete(leases["a"], "sub-a", ref, "0" * 64, 5.0, Ids())
    with pytest.raises(IdempotencyConflict, match="sub-a"):
        s.check_complete(leases["b"], "sub-a", ref, receipt["digest"], 5.0, Ids())  # other task
    assert dump(s) == before


def _error_cases(
    s: QueueState, leases: dict[str, Lease]
) -> list[tuple[type[BaseException], str, Callable[[], Any]]]:
    run(s, s.check_fail(leases["e"], "used-by-fail", "x", True, 1.0))  # e is pending again; request id used
    stale = leases["e"]
    foreign = Lease(RUN, "other-queue", "a", leases["a"].attempt_id, 1, 1, leases["a"].token, "w")
    other_run = Lease("other-run", QUEUE, "a", leases["a"].attempt_id, 1, 1, leases["a"].token, "w")
    unknown = Lease(RUN, QUEUE, "ghost", "att", 1, 1, "tok", "w")
    forged = Lease(RUN, QUEUE, "a", leases["a"].attempt_id, 1, 1, "not-the-token", "w")
    old_epoch = Lease(RUN, QUEUE, "a", leases["a"].attempt_id, 1, 0, leases["a"].token, "w")
    ref = fake_ref("r")
    empty = fake_ref("m", records=0, payload_bytes=0, tokens=0)
    ids = Ids()
    token = run(s, s.ledger.check_open_consumer("c", "owner", "tok-c"))
    ref_dict = asdict(fake_ref("c"))

    def cursors(fetch: int, processed: int) -> dict[str, Any]:
        return {"version": 1, "state_ref": ref_dict, "fetch_cursor": fetch, "processed_cursor": processed}

    return [
        (
            IdempotencyConflict,
            "different request",
            lambda: s.check_submit("first", [TaskSpec("zz")], None, None),
        ),
        (
            IdempotencyConflict,
            "already submitted",
            lambda: s.check_submit("new", [TaskSpec("a")], None, None),
        ),
        (IdempotencyConflict, "different request", lambda: s.check_cancel("a", "used-by-fail")),
        (
            ValueError,
            "same task id twice",
            lambda: s.check_submit("dup", [TaskSpec("q"), TaskSpec("q")], None, None),
        ),
        (
            ValueError,
            "needs a producer_id",
            lambda: s.check_submit("p", [TaskSpec("q")], None, {"cursor": 1}),
        ),
        (ValueError, "request_id", lambda: s.check_seal("")),
        (TypeError, "TaskSpec", lambda: s.check_submit("t", ["not-a-spec"], None, None)),  # type: ignore[list-item]
        (KeyError, "unknown task", lambda: s.check_cancel("ghost", "cancel-ghost")),
        (StaleAttempt, "no longer current", lambda: s.check_fail(stale, "f-stale", "x", True, 1.0)),
        (
            StaleAttempt,
            "no longer current",
            lambda: s.check_complete(stale, "s-stale", ref, ref.digest, 1.0, ids),
        ),
        (
            StaleAttempt,
            "no longer current",
            lambda: s.check_complete(forged, "s-forged", ref, ref.digest, 1.0, ids),
        ),
        (StaleAttempt, "no longer current", lambda: s.check_fail(old_epoch, "f-old", "x", True, 1.0)),
        (LeaseExpired, "expired", lambda: s.check_fail(leases["a"], "f-exp", "x", True, LEASE_S)),
        (
            LeaseExpired,
            "expired",
            lambda: s.check_complete(leases["a"], "s-exp", ref, ref.digest, LEASE_S, ids),
        ),
        (
            LeaseExpired,
            "expired",
            lambda: s.check_progress([{"lease": leases["a"], "input_ref": ref}], "p-exp", LEASE_S),
        ),
        (InvalidReference, "other-queue", lambda: s.check_fail(foreign, "f-foreign", "x", True, 1.0)),
        (
            InvalidReference,
            "other-run",
            lambda: s.check_complete(other_run, "s-run", ref, ref.digest, 1.0, ids),
        ),
        (InvalidReference, "unknown task", lambda: s.check_fail(unknown, "f-unknown", "x", True, 1.0)),
        (
            InvalidReference,
            "does not match",
            lambda: s.check_complete(leases["a"], "s-dig", ref, "f" * 64, 1.0, ids),
        ),
        (
            ValueError,
            "allow_empty",
            lambda: s.check_complete(leases["a"], "s-empty", empty, empty.digest, 1.0, ids),
        ),
        (
            ValueError,
            "64-bit",
            lambda: s.check_yield(
                [{"lease": leases["b"], "input_ref": None, "priority": 2**63}], "y-big", 1.0
            ),
        ),
        (
            ValueError,
            "same task twice",
            lambda: s.check_yield([{"lease": leases["b"], "input_ref": None}] * 2, "y-dup", 1.0),
        ),
        (
            StaleAttempt,
            "no longer current",
            lambda: s.check_yield(
                [{"lease": leases["b"], "input_ref": None}, {"lease": stale, "input_ref": None}],
                "y-mixed",
                1.0,
            ),
        ),
        (ValueError, "max_tasks", lambda: s.check_acquire("w", 0, None, None, False, 1.0, LEASE_S, ids)),
        (ValueError, "worker_id", lambda: s.check_acquire("", 1, None, None, False, 1.0, LEASE_S, ids)),
        (StaleAttempt, "not current", lambda: s.ledger.check_close_consumer("c", "bad-token")),
        (UnsafeRecovery, "is open by owner", lambda: s.ledger.check_open_consumer("c", "intruder", "t2")),
        (KeyError, "unknown consumer", lambda: s.ledger.check_close_consumer("nobody", "tok")),
        (ValueError, "processed_cursor", lambda: s.check_save_consumer("c", token, "sc1", cursors(0, 1))),
        (ValueError, "fetch_cursor", lambda: s.check_save_consumer("c", token, "sc2", cursors(1, 0))),
    ]


def test_limits_are_identity_not_quotas_but_task_metadata_has_a_journal_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    s, leases = _busy_state()
    # Limits(metadata_bytes=1024, max_result_bytes=1 MiB) here: neither refuses anything (issue 10 item 8).
    run(s, s.check_submit("m", [TaskSpec("q", metadata={"x": "y" * 2000})], None, None))
    big = fake_ref("b", payload_bytes=LIMITS["max_result_bytes"] + 1)
    run(s, s.check_complete(leases["a"], "s-big", big, big.digest, 1.0, Ids()))
    monkeypatch.setattr(machine, "TASK_METADATA_BYTES_MAX", 100)
    before = dump(s)
    with pytest.raises(ResourceLimitExceeded, match="metadata is 2008 bytes, the limit is 100"):
        s.check_submit("m2", [TaskSpec("q2", metadata={"x": "y" * 2000})], None, None)
    assert dump(s) == before


def test_every_rejected_call_changes_nothing() -> None:
    s, leases = _busy_state()
    cases = _error_cases(s, leases)
    for error, fragment, call in cases:
        before = dump(s)
        with pytest.raises(error, match=fragment):
            call()
        assert dump(s) == before, (error, fragment)


# --------------------------------------------------------------------------- snapshot round trip


def _workload(s: QueueState, rng: random.Random, ids: Ids, steps: int, clock: list[float]) -> None:
    """Random valid and invalid calls; every rejected call must leave the state unchanged."""
    leases: list[Lease] = []
    counter = [0]

    def rid() -> str:
        counter[0] += 1
        return f"{ids.prefix}rq{counter[0]}"

    for _ in range(steps):
        roll = rng.random()
        before = dump(s)
        try:
            if roll < 0.15 and not s.sealed:
                specs = [
                    TaskSpec(
                        f"{rng.choice('ab')}{ids()}",
                        priority=rng.randint(-1, 2),
                        scheduling_key=rng.randint(0, 2),
                        max_attempts=rng.randint(1, 3),
                        control=rng.random() < 0.1,
                        input_ref=fake_ref("i") if rng.random() < 0.3 else None,
                    )
                    for _ in range(rng.randint(1, 4))
                ]
                run(s, s.check_submit(rid(), specs, "prod", {"cursor": counter[0]}))
            elif roll < 0.35:
                got = run(
                    s,
                    s.check_acquire(
                        f"w{rng.randint(1, 3)}",
                        rng.randint(1, 3),
                        None,
                        rng.choice([None, "a", "b"]),
                        rng.random() < 0.1,
                        clock[0],
                        LEASE_S,
                        ids,
                    ),
                )
                if isinstance(got, list):
                    leases += got
            elif roll < 0.5 and leases:
                lease = rng.choice(leases)
                ref = fake_ref(rng.choice("0123456789"))
                run(s, s.check_complete(lease, rid(), ref, ref.digest, clock[0], ids))
            elif roll < 0.58 and leases:
                run(s, s.check_fail(rng.choice(leases), rid(), "boom", rng.random() < 0.7, clock[0]))
            elif roll < 0.64 and leases:
                run(s, s.check_release([rng.choice(leases)], rid(), clock[0]))
            elif roll < 0.7 and leases:
                update = {
                    "lease": rng.choice(leases),
                    "input_ref": fake_ref("y"),
                    "priority": rng.randint(0, 3),
                }
                run(s, s.check_yield([update], rid(), clock[0]))
            elif roll < 0.74 and leases:
                run(
                    s,
                    s.check_progress(
                        [{"lease": rng.choice(leases), "input_ref": fake_ref("g")}], rid(), clock[0]
                    ),
                )
            elif roll < 0.8 and leases:
                if rng.random() < 0.5:
                    clock[0] += 0.25  # otherwise a heartbeat at the grant's instant (same deadline)
                s.heartbeat([rng.choice(leases)], clock[0], LEASE_S)
            elif roll < 0.84 and s.tasks:
                run(s, s.check_cancel(rng.choice(sorted(s.tasks)), rid()))
            elif roll < 0.88:
                run(s, s.check_retire(f"w{rng.randint(1, 3)}"))
            elif roll < 0.9:
                run(s, s.ledger.check_open_consumer("training", "owner", ids()))
            elif roll < 0.92:
                run(s, s.check_release_reads([rng.choice(leases)] if leases else []))
            elif roll < 0.93:
                s.apply(events.Epoch(epoch=s.epoch + 1))
            else:
                clock[0] += rng.choice([0.5, 3.0, LEASE_S])
        except (QueueError, KeyError, ValueError) as error:
            assert dump(s) == before, f"rejected call changed the state: {error!r}"


def test_a_snapshot_of_another_version_or_malformed_is_refused_by_name() -> None:
    s = fresh()
    data = decode(encode(state_to_dict(s)))
    assert data["v"] == SNAPSHOT_VERSION
    with pytest.raises(UnsupportedSchema, match="queue snapshot version 1 is not supported"):
        state_from_dict({**data, "v": 1}, LIMITS)
    broken = {k: v for k, v in data.items() if k != "commits"}
    with pytest.raises(CorruptData, match=r"queue snapshot is malformed \(KeyError"):
        state_from_dict(broken, LIMITS)


@pytest.mark.parametrize("seed", range(6))
def test_state_round_trips_through_its_snapshot_dict(seed: int) -> None:
    rng = random.Random(seed)
    s = fresh()
    clock = [0.0]
    _workload(s, rng, Ids(f"s{seed}-"), 250, clock)
    if seed % 2:
        run(s, s.check_seal(f"seal-{seed}"))
    data = decode(encode(state_to_dict(s)))
    rebuilt = state_from_dict(data, LIMITS)
    assert dump(rebuilt) == dump(s)
    assert rebuilt.counts == s.counts
    assert rebuilt.submissions == s.submissions
    assert list(rebuilt.pending.ordered()) == list(s.pending.ordered())
    assert list(rebuilt.control.ordered()) == list(s.control.ordered())
    assert rebuilt.expired(clock[0] + 1e9) == s.expired(clock[0] + 1e9)
    # Both continue identically: same random calls, same ids, same clock.
    clock_a, clock_b = [clock[0]], [clock[0]]
    _workload(s, random.Random(seed + 100), Ids("next-"), 120, clock_a)
    _workload(rebuilt, random.Random(seed + 100), Ids("next-"), 120, clock_b)
    assert dump(rebuilt) == dump(s)


# --------------------------------------------------------------------------- acquire cost


class CountingTasks(dict):  # type: ignore[type-arg]
    """The task table, counting lookups."""

    lookups = 0

    def __getitem__(self, key: Any) -> Any:
        CountingTasks.lookups += 1
        return super().__getitem__(key)

    def get(self, key: Any, default: Any = None) -> Any:
        CountingTasks.lookups += 1
        return super().get(key, default)


@pytest.mark.parametrize("pending", [10, 1_000, 20_000])
def test_acquire_touches_a_constant_number_of_tasks(monkeypatch: pytest.MonkeyPatch, pending: int) -> None:
    s = fresh()
    submit(s, *(TaskSpec(f"t{i:06d}", priority=i % 5, scheduling_key=i % 7) for i in range(pending)))
    requested: list[int] = []
    real_first = index_module.PendingIndex.first

    def first(self: Any, count: int) -> list[str]:
        requested.append(count)
        return real_first(self, count)

    def forbidden(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("acquire walked the whole pending index")

    monkeypatch.setattr(index_module.PendingIndex, "first", first)
    monkeypatch.setattr(index_module.PendingIndex, "ordered", forbidden)
    monkeypatch.setattr(index_module.PendingIndex, "__iter__", forbidden, raising=False)
    s.tasks = CountingTasks(s.tasks)
    CountingTasks.lookups = 0
    event = s.check_acquire("w", 3, None, None, False, 0.0, LEASE_S, Ids())
    assert requested == [3]
    assert CountingTasks.lookups <= 3
    CountingTasks.lookups = 0
    leases = s.apply(event)
    best = sorted(range(pending), key=lambda i: (-(i % 5), i % 7, i))[:3]
    assert [x.task_id for x in leases] == [f"t{i:06d}" for i in best]
    assert CountingTasks.lookups <= 3 * 2
