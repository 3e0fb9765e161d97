"""The simulated fixed-latency engine: timers, bounded concurrency, abort with partials, continuation.

Latencies are short asyncio timers; the assertions on elapsed time are lower bounds (a timer
never fires early), never speed targets.
"""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from straw.rollout import Sample, SampleStatus
from straw.rollout.demo.simulated import SimulatedEngine


def group(n: int = 3, base: int = 0) -> list[Sample]:
    return [Sample(index=base + i, group_index=base) for i in range(n)]


def test_a_group_takes_the_latency_and_comes_back_finished() -> None:
    async def main() -> None:
        engine = SimulatedEngine(latency=0.05, response_length=5, prompt_length=3, routed_experts=(2, 2))
        loop = asyncio.get_running_loop()
        started = loop.time()
        out = await engine(group(), weight_version="4")
        assert loop.time() - started >= 0.045
        for s in out:
            assert s.status is SampleStatus.COMPLETED and s.reward == 1.0
            assert s.response_length == 5 and len(s.tokens) == 8 and len(s.rollout_log_probs) == 5
            assert s.weight_versions == ["4"]
            assert s.rollout_routed_experts.shape == (7, 2, 2) and s.rollout_routed_experts.dtype == np.int32
        assert engine.stats == {"completed": 1, "aborted": 0, "calls": 1}

    asyncio.run(main())


def test_concurrency_is_bounded_per_engine() -> None:
    async def main() -> None:
        engine = SimulatedEngine(latency=0.05, max_concurrency=2)
        loop = asyncio.get_running_loop()
        started = loop.time()
        await asyncio.gather(*(engine(group(base=10 * i), weight_version=None) for i in range(4)))
        assert loop.time() - started >= 0.095  # two waves of two

    asyncio.run(main())


def test_abort_keeps_a_partial_that_continues_to_the_same_tokens() -> None:
    async def main() -> None:
        # The abort comes at a quarter of the latency: only a stall of the loop longer than the
        # rest (1.5 s) could let the generation finish first.
        engine = SimulatedEngine(latency=2.0, response_length=8, reward=lambda s: float(s.response_length))
        loop = asyncio.get_running_loop()
        loop.call_later(0.5, engine.abort)
        partial = await engine(group(2), weight_version="1")
        have = partial[0].response_length
        assert all(s.status is SampleStatus.ABORTED and s.reward is None for s in partial)
        assert 0 < have < 8 and all(s.response_length == have for s in partial)
        started = loop.time()
        done = await engine(partial, weight_version="2")
        assert loop.time() - started >= 0.9 * 2.0 * (8 - have) / 8
        whole = await SimulatedEngine(latency=0.01, response_length=8)(group(2), weight_version="2")
        assert [s.tokens for s in done] == [s.tokens for s in whole]
        assert all(s.weight_versions == ["1", "2"] and s.reward == 8.0 for s in done)
        assert engine.stats["aborted"] == 1 and engine.stats["completed"] == 1

    asyncio.run(main())


def test_abort_latency_and_only_calls_in_flight() -> None:
    async def main() -> None:
        engine = SimulatedEngine(latency=0.02, abort_latency=0.05)
        engine.abort()  # not bound yet: nothing to do
        first = await engine(group(), weight_version=None)
        engine.abort()  # nothing in flight
        second = await engine(group(base=5), weight_version=None)
        assert all(s.status is SampleStatus.COMPLETED for s in first + second)
        loop = asyncio.get_running_loop()
        long = SimulatedEngine(latency=5.0, abort_latency=0.05)
        call = asyncio.ensure_future(long(group(), weight_version=None))
        loop.call_later(0.01, long.abort)
        started = loop.time()
        out = await call
        assert loop.time() - started >= 0.05
        assert all(s.status is SampleStatus.ABORTED for s in out)

    asyncio.run(main())


def test_abort_from_another_thread() -> None:
    engine = SimulatedEngine(latency=30.0)
    result: list[list[Sample]] = []
    bound = threading.Event()

    async def call() -> None:
        asyncio.get_running_loop().call_soon(bound.set)
        result.append(await engine(group(), weight_version=None))

    thread = threading.Thread(target=lambda: asyncio.run(call()))
    thread.start()
    assert bound.wait(10)
    engine.abort()
    thread.join(10)
    assert not thread.is_alive() and all(s.status is SampleStatus.ABORTED for s in result[0])


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="latency"):
        SimulatedEngine(latency=0)
    with pytest.raises(ValueError, match="max_concurrency"):
        SimulatedEngine(latency=1, max_concurrency=0)
    with pytest.raises(ValueError, match="abort_latency"):
        SimulatedEngine(latency=1, abort_latency=-1)
    with pytest.raises(ValueError, match="response_length"):
        SimulatedEngine(latency=1, response_length=0)
