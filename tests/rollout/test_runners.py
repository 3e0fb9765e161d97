"""SyncRollout, AsyncRollout and the scheduler over real readers (acceptance scenarios 53-57, resume).

Generators here are small async callables that follow a script; where a test needs to know
that something happened in another thread it waits on an event with a bound, never sleeps.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from rollout_helpers import finish, prompt_rows
from straw.errors import StaleAttempt
from straw.protocol import RecordSetRef, decode
from straw.rollout.checkpoint import resolve_checkpoint
from straw.rollout.collection import accept_raw_rollout
from straw.rollout.config import RolloutConfig
from straw.rollout.controller import QueueController
from straw.rollout.hooks import DynamicFilterOutput, Hooks
from straw.rollout.reader import QueueReader
from straw.rollout.refs import DiskPayloadRef, RolloutGroupRef, load_groups
from straw.rollout.runner import AsyncRollout, RolloutScheduler, SyncRollout
from straw.rollout.sample import Sample, SampleStatus, iter_samples

OpenController = Callable[..., QueueController]
OpenReader = Callable[..., QueueReader]
MakeConfig = Callable[..., RolloutConfig]
WAIT = 30.0


def completing(group: list[Any], *, weight_version: str | None) -> list[Any]:
    """Finish every sample with two tokens and a reward (the runner records the version)."""
    return finish(group, version=None)


class Finisher:
    """An async generator that completes groups, counting its calls."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []

    async def __call__(self, group: list[Any], *, weight_version: str | None) -> list[Any]:
        self.calls.append([s.index for s in iter_samples(group)])
        return completing(group, weight_version=weight_version)


def root(controller: QueueController) -> str:
    return str(controller.config.rollout_data_dir)


# --------------------------------------------------------------------------- scenario 53


def test_scenario_53_sync_rollout_publishes_each_group_as_it_completes(
    make_config: MakeConfig, open_controller: OpenController, open_reader: OpenReader
) -> None:
    controller = open_controller(make_config(rollout_batch_size=2))
    reader = open_reader(controller)
    reader.discard_group(reader.get_samples(1)[0], "skip group 0")  # the step generates groups 1 and 2
    stored: dict[int, RolloutGroupRef] = {}
    second_stored = threading.Event()
    publish = reader.publish_group

    def spying_publish(group: Any, *, rollout_id: int | str) -> RolloutGroupRef:
        ref = publish(group, rollout_id=rollout_id)
        stored[ref.index] = ref
        if ref.index == 2:
            second_stored.set()
        return ref

    reader.publish_group = spying_publish  # type: ignore[method-assign]
    readable_while_first_ran: list[Any] = []

    async def generator(group: list[Any], *, weight_version: str | None) -> list[Any]:
        if group[0].index == 1:
            loop = asyncio.get_running_loop()
            assert await loop.run_in_executor(None, second_stored.wait, WAIT)
            # group 2 is durable and accepted while group 1 is still being generated
            readable_while_first_ran.append(DiskPayloadRef(stored[2].manifest, root(controller)).load())
        return completing(group, weight_version=weight_version)

    seen: list[list[int]] = []

    def all_samples(groups: list[Any], config: RolloutConfig, source: Any) -> None:
        seen.append([g[0].index for g in groups])
        assert source is reader
        groups[0][0].reward = 7.0

    rollout = SyncRollout(
        controller.config,
        reader,
        generator,
        hooks=Hooks(all_samples_process=all_samples),
        weight_version=lambda: "3",
    )
    output = asyncio.run(rollout.generate(0))
    assert [g[0].index for g in readable_while_first_ran] == [2]
    assert seen == [[1, 2]]
    loaded = load_groups(output.groups)
    assert [g[0].index for g in loaded] == [1, 2]
    assert loaded[0][0].reward == 7.0 and loaded[0][0].weight_versions == ["3"]
    raw = controller_accept(controller, output)
    assert [g[0].reward for g in load_groups(raw)] == [7.0, 1.0]


def controller_accept(controller: QueueController, output: Any) -> Any:
    return accept_raw_rollout(output, config=controller.config, controller=controller, rollout_id=0)


def test_sync_rollout_replaces_dropped_and_aborted_groups(
    make_config: MakeConfig, open_controller: OpenController, open_reader: OpenReader
) -> None:
    controller = open_controller(make_config(rollout_batch_size=2))
    reader = open_reader(controller)
    calls: list[int] = []

    async def generator(group: list[Any], *, weight_version: str | None) -> list[Any]:
        index = group[0].index
        calls.append(index)
        if index == 0 and calls.count(0) == 1:  # interrupted once: back to the queue as a partial
            for sample in group:
                sample.tokens = [*sample.tokens, 5]
                sample.response_length += 1
                sample.status = SampleStatus.ABORTED
            return group
        return completing(group, weight_version=weight_version)

    def zero_std(group: Any, config: RolloutConfig) -> DynamicFilterOutput:
        return DynamicFilterOutput(group[0].index != 1, "zero_std")

    rollout = SyncRollout(controller.config, reader, generator, hooks=Hooks(dynamic_filter=zero_std))
    output = asyncio.run(rollout.generate(0))
    assert [r.index for r in output.group_refs or []] == [0, 2]
    assert calls.count(0) == 2  # the partial came back and was continued
    assert output.metrics["rollout/dynamic_filter/drop_zero_std"] == 1  # type: ignore[index]
    status = controller.status("prompt:1")
    assert status is not None and status["state"] == "failed"
    assert decode(status["failure"].encode())["category"] == "Filtered"
    (group,) = load_groups([output.group_refs[0]])  # type: ignore[index]
    assert group[0].tokens[-3:] == [5, 100, 101]  # continued from the partial tokens


# --------------------------------------------------------------------------- scenario 54


class CountingReader(QueueReader):
    """A reader that records each request: how many groups, and how many results were accepted by then."""

    requests: list[tuple[int, int]]

    def get_samples(self, num_groups: int) -> list[Any]:
        accepted = sum(1 for c in self.controller.queue.commits if c["task_id"].startswith("prompt:"))
        self.requests.append((num_groups, accepted))
        return super().get_samples(num_groups)


def test_scenario_54_async_rollout_stores_before_asking_and_counts_drops(
    make_config: MakeConfig, open_controller: OpenController
) -> None:
    controller = open_controller(make_config(rollout_batch_size=2))
    reader = CountingReader(controller.config, controller, "async")
    reader.requests = []

    def zero_std(group: Any, config: RolloutConfig) -> DynamicFilterOutput:
        return DynamicFilterOutput(group[0].index != 0, "zero_std")

    rollout = AsyncRollout(
        controller.config, reader, Finisher(), hooks=Hooks(dynamic_filter=zero_std), slots=1
    )
    try:
        output = rollout.generate(0)
        assert [r.index for r in output.group_refs or []] == [1, 2]
        assert output.metrics["rollout/dynamic_filter/drop_zero_std"] == 1  # type: ignore[index]
        assert output.metrics["rollout/dynamic_filter/dropped_groups"] == 1  # type: ignore[index]
        # one group at a time (one slot), and each kept group was accepted before the next request
        assert reader.requests[:3] == [(1, 0), (1, 0), (1, 1)]
        status = controller.status("prompt:0")
        assert status is not None and status["state"] == "failed"
        assert decode(status["failure"].encode()) == {"category": "Filtered", "reason": "zero_std"}
    finally:
        rollout.close()
        reader.close()


# --------------------------------------------------------------------------- scenario 55


class Interruptible:
    """Blocks until abort() on its first call, then returns 3 partial tokens; completes later calls."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.calls: list[int] = []
        self._aborted: asyncio.Event | None = None

    def abort(self) -> None:
        if self._aborted is not None:
            self._aborted.set()

    async def __call__(self, group: list[Any], *, weight_version: str | None) -> list[Any]:
        self.calls.append(group[0].index)
        if len(self.calls) > 1:
            return completing(group, weight_version=weight_version)
        self._aborted = asyncio.Event()
        self.started.set()
        await self._aborted.wait()
        for sample in group:
            sample.tokens = [*sample.tokens, 7, 8, 9]
            sample.response_length += 3
            sample.rollout_log_probs = [-0.1, -0.2, -0.3]
            sample.status = SampleStatus.ABORTED
        return group


def test_scenario_55_a_paused_group_continues_under_the_next_version(
    make_config: MakeConfig, open_controller: OpenController, open_reader: OpenReader
) -> None:
    controller = open_controller(make_config(rollout_batch_size=1))
    reader = open_reader(controller, "async")
    generator = Interruptible()
    version = ["1"]
    rollout = AsyncRollout(controller.config, reader, generator, slots=1, weight_version=lambda: version[0])
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        step = pool.submit(rollout.generate, 0)
        assert generator.started.wait(WAIT)
        was_paused = rollout.pause_admission()
        assert was_paused is False
        status = controller.status("prompt:0")
        assert status is not None and status["state"] == "pending"
        assert status["spec"]["priority"] == 1 and status["failures"] == 0
        assert status["spec"]["metadata"]["returned"] is True
        (partial,) = DiskPayloadRef(
            RecordSetRef.from_dict(status["spec"]["input_ref"]), root(controller)
        ).load()
        assert partial.tokens == [7, 8, 9] and partial.weight_versions == ["1"]
        version[0] = "2"
        rollout.resume_admission(was_paused)
        output = step.result(WAIT)
    finally:
        rollout.close()
        pool.shutdown()
    ((sample,),) = load_groups(output.groups)
    assert sample.status is SampleStatus.COMPLETED and sample.tokens == [7, 8, 9, 100, 101]
    assert sample.weight_versions == ["1", "2"]
    spans = sample.queue_policy_segments
    assert [(s["start"], s["stop"], s["reported_versions"]) for s in spans] == [(0, 3, ["1"]), (3, 5, ["2"])]
    status = controller.status("prompt:0")
    assert status is not None and status["state"] == "completed" and status["failures"] == 0
    assert generator.calls[:2] == [0, 0]  # interrupted, then continued (the worker may go on to group 1)


# --------------------------------------------------------------------------- scenario 56


class Gone(Exception):
    """This test's worker-loss signal."""


class ReaderWorker:
    """A WorkerHandle around a real reader: next() generates and publishes one group in a thread.

    ``lose_after`` makes the worker vanish right after it published its n-th group (before
    delivering it), as a node dying between its write and its reply would.
    """

    lost_errors = (Gone,)

    def __init__(
        self, reader: QueueReader, *, lose_after: int | None = None, gate_after: int | None = None
    ) -> None:
        self.reader = reader
        self.lose_after = lose_after
        self.gate_after = gate_after  # requests after this many wait for ``gate``
        self.gate = threading.Event()
        self.published: list[RolloutGroupRef] = []
        self.outstanding = 0
        self.max_outstanding = 0
        self.windows: list[dict[str, int]] = []
        self.scheduler: RolloutScheduler | None = None
        self.pool = concurrent.futures.ThreadPoolExecutor(1)
        self.lock = threading.Lock()

    @property
    def reader_id(self) -> str:
        return self.reader.reader_id

    @property
    def capacity(self) -> int:
        return 1

    def start(self, rollout_id: int) -> None:
        pass

    def pause(self) -> None:
        pass

    def next(self) -> concurrent.futures.Future[RolloutGroupRef]:
        with self.lock:
            self.outstanding += 1
            self.max_outstanding = max(self.max_outstanding, self.outstanding)
            if self.scheduler is not None:
                self.windows.append(self.scheduler.stats())
        return self.pool.submit(self._one)

    def _one(self) -> RolloutGroupRef:
        try:
            if self.gate_after is not None and len(self.published) >= self.gate_after:
                self.gate.wait(WAIT)
            (group,) = self.reader.get_samples(1)
            ref = self.reader.publish_group(finish(group), rollout_id=0)
            self.published.append(ref)
            if self.lose_after is not None and len(self.published) >= self.lose_after:
                raise Gone(f"{self.reader_id} died after publishing {ref.index}")
            return ref
        finally:
            with self.lock:
                self.outstanding -= 1

    def close(self, deadline: float) -> None:
        self.pool.shutdown(wait=False)


def test_scenario_56_a_lost_workers_undelivered_group_still_reaches_the_batch(
    make_config: MakeConfig, open_controller: OpenController, open_reader: OpenReader
) -> None:
    config = make_config(rollout_batch_size=2)
    controller = open_controller(config)
    lossy = ReaderWorker(open_reader(controller, "lossy"), lose_after=1)
    steady = ReaderWorker(open_reader(controller, "steady"), gate_after=1)  # one group, then it waits
    scheduler = RolloutScheduler([lossy, steady], config=config, controller=controller)
    for worker in (lossy, steady):
        worker.scheduler = scheduler
    try:
        assert scheduler.capacity == 2
        output = scheduler.generate(0, prefetch=2)
        (lost,) = lossy.published
        (delivered,) = steady.published
        # the lost group was recovered from the queue (it was never delivered)
        assert [r.index for r in output.group_refs or []] == sorted([lost.index, delivered.index])
        assert scheduler.capacity == 1
        with pytest.raises(StaleAttempt, match="Reader was retired by the scheduler"):
            lossy.reader.get_samples(1)  # the lost worker's reader was retired
        steady.lose_after = len(steady.published) + 1
        steady.gate.set()
        with pytest.raises(RuntimeError, match=r"^All rollout workers are unavailable$"):
            scheduler.generate(1)
    finally:
        scheduler.close()
    for worker in (lossy, steady):
        assert worker.max_outstanding == 1
        for window in worker.windows:
            assert window["pending"] + window["ready"] <= window["demand"] + window["prefetch"]


# --------------------------------------------------------------------------- scenario 57


async def pending_result(group: list[Any], *, weight_version: str | None) -> list[Any]:
    finish(group)
    group[0].status = SampleStatus.PENDING
    return group


async def reindexing(group: list[Any], *, weight_version: str | None) -> list[Any]:
    finish(group)
    group[0].index = 999
    return group


async def fewer(group: list[Any], *, weight_version: str | None) -> list[Any]:
    return finish(group)[:-1]


@pytest.mark.parametrize(
    ("generator", "message"),
    [
        (pending_result, r"^Generator returned unfinished samples without ABORTED status: \[\d+\]$"),
        (reindexing, r"^Generation must preserve the source sample index$"),
        (fewer, r"^Generation must preserve the source sample index$"),
    ],
)
def test_scenario_57_the_generator_contract(
    generator: Any,
    message: str,
    make_config: MakeConfig,
    open_controller: OpenController,
    open_reader: OpenReader,
) -> None:
    controller = open_controller(make_config(rollout_batch_size=1, n_samples_per_prompt=2))
    rollout = SyncRollout(controller.config, open_reader(controller), generator)
    with pytest.raises(ValueError, match=message):
        asyncio.run(rollout.generate(0))
    status = controller.status("prompt:0")
    assert (
        status is not None and status["failures"] == 1 and status["state"] == "pending"
    )  # the attempt failed
    decoded = decode(status["failure"].encode())
    assert decoded["category"] == "GeneratorError" and decoded["reason"].startswith("ValueError: ")

    async_rollout = AsyncRollout(controller.config, open_reader(controller, "async"), generator, slots=1)
    try:
        with pytest.raises(ValueError, match=message):
            async_rollout.generate(0)
        with pytest.raises(ValueError, match=message):
            async_rollout.generate(1)  # latched
    finally:
        async_rollout.close()


# --------------------------------------------------------------------------- resume


@pytest.fixture
def interrupted_job(make_config: MakeConfig, tmp_path: Path) -> RolloutConfig:
    """A job that accepted groups 0 and 1 and stopped before its first batch."""
    config = make_config(rollout_batch_size=3, save=str(tmp_path / "job"), save_interval=1)
    resolved, plan = resolve_checkpoint(config)
    with QueueController(resolved, dataset=prompt_rows(50), restore_plan=plan) as controller:
        reader = QueueReader(resolved, controller, "before")
        try:
            for group in reader.get_samples(2):
                reader.publish_group(finish(group), rollout_id=0)
        finally:
            reader.close()
    return config


def resumed(config: RolloutConfig) -> QueueController:
    resolved, plan = resolve_checkpoint(config)
    assert plan.mode == "resume"
    return QueueController(resolved, dataset=prompt_rows(50), restore_plan=plan)


def test_sync_rollout_resumes_with_the_accepted_groups_first(interrupted_job: RolloutConfig) -> None:
    with resumed(interrupted_job) as controller:
        reader = QueueReader(controller.config, controller, "after")
        try:
            generator = Finisher()
            output = asyncio.run(SyncRollout(controller.config, reader, generator).generate(0))
            assert [r.index for r in output.group_refs or []] == [0, 1, 2]
            assert generator.calls == [[2]]  # only the missing group was generated
            second = asyncio.run(SyncRollout(controller.config, reader, generator).generate(1))
            assert [r.index for r in second.group_refs or []] == [3, 4, 5]  # recovered once only
        finally:
            reader.close()


def test_async_rollout_resumes_with_the_accepted_groups_first(interrupted_job: RolloutConfig) -> None:
    with resumed(interrupted_job) as controller:
        reader = QueueReader(controller.config, controller, "after")
        generator = Finisher()
        rollout = AsyncRollout(controller.config, reader, generator, slots=1)
        try:
            output = rollout.generate(0)
            assert [r.index for r in output.group_refs or []] == [0, 1, 2]
            assert generator.calls[0] == [2]
        finally:
            rollout.close()
            reader.close()


def test_runner_arguments(
    make_config: MakeConfig, open_controller: OpenController, open_reader: OpenReader
) -> None:
    controller = open_controller(make_config())
    reader = open_reader(controller)
    with pytest.raises(ValueError, match=r"^--rollout-batch-size is required$"):
        asyncio.run(SyncRollout(controller.config, reader, Finisher()).generate(0))
    with pytest.raises(TypeError, match="generator must be callable"):
        SyncRollout(controller.config, reader, "gen")
    with pytest.raises(ValueError, match="slots must be a positive integer"):
        AsyncRollout(controller.config, reader, Finisher(), slots=0)
    sample = Sample(index=0)
    assert sample.status is SampleStatus.PENDING
