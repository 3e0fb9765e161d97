"""RolloutScheduler with in-test worker handles: the window, drops, pausing, errors, loss, close.

``ScriptedWorker`` is a :class:`WorkerHandle` whose ``next()`` answers with whatever the test
hands it (a group reference, a DroppedGroup, an exception), as a ``concurrent.futures.Future``
like a remote worker's call. It records every call and, at each ``next()``, the scheduler's
window, so the tests can check the backpressure rule at every moment it matters. Waits are
on events with a bound, never sleeps.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from straw.rollout.config import RolloutConfig
from straw.rollout.refs import RolloutGroupRef, load_groups, pack_payload
from straw.rollout.sample import Sample, SampleStatus
from straw.rollout.scheduler import RolloutScheduler
from straw.rollout.workers import DroppedGroup, WorkerLost

MakeConfig = Callable[..., RolloutConfig]
WAIT = 30.0


class Gone(Exception):
    """The loss signal of ScriptedWorker (a handle may declare its own, like Ray's actor errors)."""


class ScriptedWorker:
    lost_errors = (Gone,)

    def __init__(self, name: str, capacity: int = 2) -> None:
        self._name = name
        self._capacity = capacity
        self.calls: list[tuple[Any, ...]] = []
        self.lock = threading.Lock()
        self.waiting: deque[concurrent.futures.Future[Any]] = deque()
        self.answers: deque[Any] = deque()
        self.max_outstanding = 0
        self.windows: list[dict[str, int]] = []
        self.scheduler: RolloutScheduler | None = None
        self.asked = threading.Event()
        self.closed_with: list[float] = []

    @property
    def reader_id(self) -> str:
        return self._name

    @property
    def capacity(self) -> int:
        return self._capacity

    def start(self, rollout_id: int) -> None:
        self.calls.append(("start", rollout_id))

    def pause(self) -> concurrent.futures.Future[None]:
        self.calls.append(("pause",))
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        done.set_result(None)
        return done

    def next(self) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self.lock:
            self.calls.append(("next",))
            self.waiting = deque(f for f in self.waiting if not f.done())  # cancelled ones are gone
            self.max_outstanding = max(self.max_outstanding, len(self.waiting) + 1)
            if self.scheduler is not None:
                self.windows.append(self.scheduler.stats())
            if self.answers:
                self._answer(future, self.answers.popleft())
            else:
                self.waiting.append(future)
        self.asked.set()
        return future

    def _answer(self, future: concurrent.futures.Future[Any], value: Any) -> None:
        try:
            if isinstance(value, BaseException):
                future.set_exception(value)
            else:
                future.set_result(value)
        except concurrent.futures.InvalidStateError:
            pass  # the scheduler cancelled the request meanwhile

    def give(self, *values: Any) -> None:
        """Answer waiting next() calls in order; the rest answer the next calls."""
        with self.lock:
            for value in values:
                self.waiting = deque(f for f in self.waiting if not f.done())
                if self.waiting:
                    self._answer(self.waiting.popleft(), value)
                else:
                    self.answers.append(value)

    def close(self, deadline: float) -> None:
        self.closed_with.append(deadline)
        with self.lock:
            for future in self.waiting:
                if not future.done():
                    self._answer(future, None)
            self.waiting.clear()


@pytest.fixture
def config(make_config: MakeConfig) -> RolloutConfig:
    return make_config(rollout_batch_size=2, n_samples_per_prompt=1)


@pytest.fixture
def refs(config: RolloutConfig) -> Callable[[int], RolloutGroupRef]:
    def make(index: int) -> RolloutGroupRef:
        group = [Sample(index=index, group_index=index, reward=1.0, status=SampleStatus.COMPLETED)]
        ref = pack_payload(group, config=config, rollout_id=0)
        return RolloutGroupRef(ref.manifest, ref.root, index=index)

    return make


@pytest.fixture
def scheduled(config: RolloutConfig) -> Iterator[Callable[..., RolloutScheduler]]:
    made: list[RolloutScheduler] = []

    def make(*workers: ScriptedWorker, **options: Any) -> RolloutScheduler:
        scheduler = RolloutScheduler(list(workers), config=options.pop("config", config), **options)
        for worker in workers:
            worker.scheduler = scheduler
        made.append(scheduler)
        return scheduler

    yield make
    for scheduler in made:
        scheduler.close()


def in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as error:
            box["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


def asked(worker: ScriptedWorker) -> None:
    assert worker.asked.wait(WAIT), f"{worker.reader_id} was never asked for a result"
    worker.asked.clear()


def test_generate_collects_the_batch_in_index_order(
    scheduled: Callable[..., RolloutScheduler], refs: Callable[[int], RolloutGroupRef]
) -> None:
    a, b = ScriptedWorker("a"), ScriptedWorker("b")
    scheduler = scheduled(a, b)
    a.give(refs(5))
    b.give(refs(3))
    output = scheduler.generate(0)
    assert [g[0].index for g in load_groups(output.groups)] == [3, 5]
    assert [r.index for r in output.group_refs or []] == [3, 5]
    assert ("start", 0) in a.calls and ("start", 0) in b.calls
    assert output.metrics == {
        "rollout/dynamic_filter/dropped_groups": 0,
        "rollout/dynamic_filter/dropped_ratio": 0.0,
    }


def test_the_window_bounds_requests_and_results(
    scheduled: Callable[..., RolloutScheduler], refs: Callable[[int], RolloutGroupRef]
) -> None:
    a, b = ScriptedWorker("a", capacity=4), ScriptedWorker("b", capacity=4)
    scheduler = scheduled(a, b)
    for i in range(6):
        (a if i % 2 else b).give(refs(i))
    outputs = [scheduler.generate(0), scheduler.generate(1, prefetch=1), scheduler.generate(2, prefetch=1)]
    batches = [[r.index for r in output.group_refs or []] for output in outputs]
    assert all(batch == sorted(batch) and len(batch) == 2 for batch in batches)
    assert sorted(i for batch in batches for i in batch) == list(range(6))
    for worker in (a, b):
        assert worker.max_outstanding == 1  # never more than one request per worker
        for window in worker.windows:
            # taken when a request is sent: the request itself is counted in pending
            assert window["pending"] + window["ready"] <= window["demand"] + window["prefetch"]
    # Between steps (no demand) only the prefetch window may be filled: one result at most.
    stats = scheduler.stats()
    assert stats["demand"] == 0 and stats["pending"] + stats["ready"] <= 1


def test_without_demand_nothing_is_requested(
    scheduled: Callable[..., RolloutScheduler], refs: Callable[[int], RolloutGroupRef]
) -> None:
    a = ScriptedWorker("a", capacity=3)
    scheduler = scheduled(a)
    a.give(refs(0), refs(1))
    scheduler.generate(0)
    requests = a.calls.count(("next",))
    assert requests == 2
    a.give(refs(2))
    assert scheduler.pause() is False  # a full round trip through the background loop
    scheduler.resume_admission(False)  # running again, but no demand and no prefetch
    assert scheduler.pause() is False
    assert scheduler.stats() == {"pending": 0, "ready": 0, "demand": 0, "prefetch": 0, "capacity": 3}
    assert a.calls.count(("next",)) == requests


def test_drops_count_but_never_fill(
    scheduled: Callable[..., RolloutScheduler], refs: Callable[[int], RolloutGroupRef]
) -> None:
    a = ScriptedWorker("a")
    scheduler = scheduled(a)
    a.give(
        DroppedGroup("zero_std", 0), refs(1), DroppedGroup("zero_std", 2), DroppedGroup("failed", 3), refs(4)
    )
    output = scheduler.generate(0)
    assert [r.index for r in output.group_refs or []] == [1, 4]
    assert output.metrics == {
        "rollout/dynamic_filter/drop_failed": 1,
        "rollout/dynamic_filter/drop_zero_std": 2,
        "rollout/dynamic_filter/dropped_groups": 3,
        "rollout/dynamic_filter/dropped_ratio": 3 / 5,
    }


def test_one_collection_at_a_time(
    scheduled: Callable[..., RolloutScheduler], refs: Callable[[int], RolloutGroupRef]
) -> None:
    a = ScriptedWorker("a")
    scheduler = scheduled(a)
    thread, box = in_thread(lambda: scheduler.generate(0))
    asked(a)
    with pytest.raises(RuntimeError, match=r"^A rollout batch is already being collected$"):
        scheduler.generate(1)
    a.give(refs(0), refs(1))
    thread.join(WAIT)
    assert [r.index for r in box["value"].group_refs] == [0, 1]


def test_a_worker_error_is_latched(
    scheduled: Callable[..., RolloutScheduler], refs: Callable[[int], RolloutGroupRef]
) -> None:
    a = ScriptedWorker("a")
    scheduler = scheduled(a)
    a.give(refs(0), ValueError("generator exploded"))
    with pytest.raises(ValueError, match="generator exploded"):
        scheduler.generate(0)
    with pytest.raises(ValueError, match="generator exploded"):
        scheduler.generate(1)
    with pytest.raises(ValueError, match="generator exploded"):
        scheduler.pause()


def test_losing_workers_gives_their_capacity_up(
    scheduled: Callable[..., RolloutScheduler], refs: Callable[[int], RolloutGroupRef]
) -> None:
    a, b = ScriptedWorker("a", capacity=2), ScriptedWorker("b", capacity=3)
    scheduler = scheduled(a, b)
    a.give(Gone("node died"))
    b.give(refs(0), refs(1))
    output = scheduler.generate(0, prefetch=5)
    assert [r.index for r in output.group_refs or []] == [0, 1]
    assert scheduler.capacity == 3 and a.closed_with  # the lost worker was closed
    assert scheduler.stats()["prefetch"] <= 3
    b.give(WorkerLost("the second one too"))
    with pytest.raises(RuntimeError, match=r"^All rollout workers are unavailable$"):
        scheduler.generate(1)


def test_pause_and_resume(
    scheduled: Callable[..., RolloutScheduler], refs: Callable[[int], RolloutGroupRef]
) -> None:
    a = ScriptedWorker("a")
    scheduler = scheduled(a)
    assert scheduler.pause() is True  # never started: paused already, nothing sent
    assert ("pause",) not in a.calls
    a.give(refs(0), refs(1))
    scheduler.generate(0)
    assert scheduler.pause_admission() is False
    assert a.calls[-1] == ("pause",)
    scheduler.resume_admission(True)  # it was paused before: stays paused
    assert a.calls[-1] == ("pause",)
    scheduler.resume_admission(False)
    a.give(refs(2), refs(3))
    assert [r.index for r in scheduler.generate(1).group_refs or []] == [2, 3]
    assert a.calls.count(("start", 0)) == 2 and ("start", 1) in a.calls


def test_pause_with_drain_waits_for_requested_results(
    scheduled: Callable[..., RolloutScheduler], refs: Callable[[int], RolloutGroupRef]
) -> None:
    a = ScriptedWorker("a")
    scheduler = scheduled(a)
    thread, box = in_thread(lambda: scheduler.generate(0))
    asked(a)
    a.give(refs(0))
    asked(a)  # the second request is in flight
    with pytest.raises(RuntimeError, match="already being collected"):
        scheduler.generate(9)
    paused, pause_box = in_thread(lambda: scheduler.pause(drain=True))
    paused.join(0.2)
    assert paused.is_alive()  # still waiting for the requested result
    a.give(refs(1))
    paused.join(WAIT)
    assert pause_box["value"] is False
    thread.join(WAIT)
    assert [r.index for r in box["value"].group_refs] == [0, 1]


def test_close_wakes_waiters_and_closes_workers_under_one_deadline(
    config: RolloutConfig, refs: Callable[[int], RolloutGroupRef]
) -> None:
    a, b = ScriptedWorker("a"), ScriptedWorker("b")
    now = [1000.0]
    scheduler = RolloutScheduler([a, b], config=config, clock=lambda: now[0], close_seconds=42.0)
    thread, box = in_thread(lambda: scheduler.generate(0))
    asked(a)
    scheduler.close()
    thread.join(WAIT)
    assert isinstance(box["error"], RuntimeError) and str(box["error"]) == "Rollout scheduler is closed"
    assert a.closed_with == [42.0] and b.closed_with == [42.0]
    with pytest.raises(RuntimeError, match=r"^Rollout scheduler is closed$"):
        scheduler.generate(1)
    scheduler.close()  # idempotent


def test_arguments_are_checked(config: RolloutConfig, make_config: MakeConfig) -> None:
    with pytest.raises(ValueError, match="at least one worker"):
        RolloutScheduler([], config=config)
    scheduler = RolloutScheduler([ScriptedWorker("a")], config=make_config())
    try:
        with pytest.raises(ValueError, match=r"^--rollout-batch-size is required$"):
            scheduler.generate(0)
    finally:
        scheduler.close()
    scheduler = RolloutScheduler([ScriptedWorker("a")], config=config)
    try:
        with pytest.raises(ValueError, match="prefetch must be a non-negative integer"):
            scheduler.generate(0, prefetch=-1)
    finally:
        scheduler.close()
