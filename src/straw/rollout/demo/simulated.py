"""A simulated serving engine of fixed latency, for scaling and pause benchmarks (no model).

:class:`SimulatedEngine` implements the :class:`~straw.rollout.hooks.Generator` protocol:
every sample of a group "generates" ``response_length`` tokens in ``latency`` seconds, waited
on an asyncio timer (the event loop stays free, as with a remote engine). At most
``max_concurrency`` groups generate at once per engine, so an engine's throughput is
``max_concurrency / latency`` groups per second and N workers with one engine each should
reach N times that: the worker-scaling benchmark measures how close the rollout layer gets.

``abort()`` (thread-safe) ends the groups in flight after ``abort_latency`` seconds (the
engine's own abort latency): each sample keeps the tokens "generated" so far, in proportion
to the elapsed time, and comes back ABORTED; a later call continues it and takes only the
remaining share of the latency. Tokens, log-probs and (optionally) routes are deterministic
functions of the sample index and position, so a continued sample equals an uninterrupted
one. Nothing here needs torch.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from ..sample import Sample, SampleStatus

__all__ = ["SimulatedEngine"]

#: Token ids the simulated engine emits cycle through this many values.
_VOCAB = 1000


class SimulatedEngine:
    """A fixed-latency stand-in for a serving engine (see the module docstring)."""

    def __init__(
        self,
        *,
        latency: float,
        response_length: int = 8,
        prompt_length: int = 8,
        max_concurrency: int | None = None,
        abort_latency: float = 0.0,
        reward: float | Callable[[Sample], Any] = 1.0,
        routed_experts: tuple[int, int] | None = None,
        version: str | None = None,
    ) -> None:
        if not latency > 0 or not math.isfinite(latency):
            raise ValueError(f"latency must be a finite number of seconds > 0, got {latency}")
        if response_length < 1 or prompt_length < 1:
            raise ValueError("response_length and prompt_length must be >= 1")
        if max_concurrency is not None and max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1 or None, got {max_concurrency}")
        if abort_latency < 0:
            raise ValueError(f"abort_latency must be >= 0, got {abort_latency}")
        self.latency = latency
        self.response_length = response_length
        self.prompt_length = prompt_length
        self.max_concurrency = max_concurrency
        self.abort_latency = abort_latency
        self.reward = reward
        self.routed_experts = routed_experts
        self.version = version
        #: Counters: groups generated to the end, groups aborted, calls made.
        self.stats = {"completed": 0, "aborted": 0, "calls": 0}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._aborted: asyncio.Event | None = None
        self._slots: asyncio.Semaphore | None = None

    async def __call__(self, group: list[Sample], *, weight_version: str | None) -> list[Sample]:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._loop, self._aborted = loop, asyncio.Event()
            self._slots = asyncio.Semaphore(self.max_concurrency) if self.max_concurrency else None
        aborted = self._aborted
        if aborted is None:
            raise RuntimeError("SimulatedEngine lost its event loop binding")
        self.stats["calls"] += 1
        if self._slots is None:
            return await self._generate(group, weight_version, aborted, loop)
        async with self._slots:
            return await self._generate(group, weight_version, aborted, loop)

    def abort(self) -> None:
        """End the groups in flight (after ``abort_latency``); later calls run normally."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            self._abort_now()
        else:
            loop.call_soon_threadsafe(self._abort_now)

    def close(self) -> None:
        """Nothing to release; present for the protocol."""

    def _abort_now(self) -> None:
        if self._aborted is not None:
            self._aborted.set()
        self._aborted = asyncio.Event()

    async def _generate(
        self,
        group: list[Sample],
        weight_version: str | None,
        aborted: asyncio.Event,
        loop: asyncio.AbstractEventLoop,
    ) -> list[Sample]:
        todo = [s for s in group if s.status not in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED)]
        have = min((s.response_length for s in todo), default=self.response_length)
        duration = self.latency * max(0.0, 1.0 - have / self.response_length)
        started = loop.time()
        was_aborted = aborted.is_set() or await wait_unless_set(aborted, duration)
        elapsed = min(loop.time() - started, duration)
        if was_aborted and self.abort_latency:
            await wait_unless_set(asyncio.Event(), self.abort_latency)  # the engine's own abort latency
        fraction = 1.0 if not was_aborted else (elapsed / duration if duration > 0 else 0.0)
        for sample in todo:
            self._advance(sample, fraction, was_aborted, weight_version)
        self.stats["aborted" if was_aborted else "completed"] += 1
        return group

    def _advance(self, sample: Sample, fraction: float, aborted: bool, weight_version: str | None) -> None:
        """Append this call's share of ``sample``'s tokens; finish it unless aborted."""
        if not sample.tokens:
            sample.tokens = [(sample.index or 0) % _VOCAB] * self.prompt_length
        have = sample.response_length
        target = self.response_length if not aborted else have + int((self.response_length - have) * fraction)
        new = [_token(sample, position) for position in range(have, target)]
        if new:
            sample.tokens = [*sample.tokens, *new]
            sample.response_length = target
            sample.rollout_log_probs = [*(sample.rollout_log_probs or []), *(-0.5 for _ in new)]
            if sample.loss_mask is not None:
                sample.loss_mask = [*sample.loss_mask, *([1] * len(new))]
            version = self.version if self.version is not None else weight_version
            if version is not None:
                sample.weight_versions.append(str(version))
            if self.routed_experts is not None:
                layers, top_k = self.routed_experts
                sample.rollout_routed_experts = np.zeros(
                    (len(sample.tokens) - 1, layers, top_k), dtype=np.int32
                )
        if aborted and sample.response_length < self.response_length:
            sample.status = SampleStatus.ABORTED
            return
        sample.status = SampleStatus.COMPLETED
        reward = self.reward
        sample.reward = reward(sample) if callable(reward) else float(reward)


def _token(sample: Sample, position: int) -> int:
    """The simulated token at response ``position``: fixed by the sample index, so continuations match."""
    return ((sample.index or 0) * 31 + position * 7) % _VOCAB


async def wait_unless_set(event: asyncio.Event, seconds: float) -> bool:
    """Wait up to ``seconds`` (an asyncio timer) unless ``event`` is set first; True if it was."""
    if seconds <= 0:
        return event.is_set()
    try:
        await asyncio.wait_for(event.wait(), seconds)
    except asyncio.TimeoutError:
        return False
    return True
