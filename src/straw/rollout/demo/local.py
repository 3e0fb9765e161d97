"""The demo policy as a Generator in this process: no HTTP, the same engine loop as the server.

:class:`PolicyGenerator` is what a generation worker of the demo can run when it holds the
policy itself: every sample of every group in flight decodes in one continuous batch
(:class:`~straw.rollout.demo.engine.BatchingEngine`), aborts end generations between two
tokens and keep their partials, and new weights load between two steps. It is an
:class:`~straw.rollout.generators.base.EngineGenerator`, so it fills samples exactly as the
HTTP generators do (tokens, log-probs, R3 routes, weight versions, status, reward).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ..generators.base import EngineGenerator, EngineOptions, EngineRequestError, Segment, SegmentRequest
from ..sample import Sample
from . import task
from .engine import BatchingEngine, EngineBusy
from .policy import Decoding, DemoPolicy, import_weights

__all__ = ["PolicyGenerator", "task_reward"]


#: The copy task's rule reward of a sample (:func:`straw.rollout.demo.task.sample_reward`).
task_reward = task.sample_reward


class PolicyGenerator(EngineGenerator):
    """Generates with a :class:`DemoPolicy` held in this process (see the module docstring).

    Prompts are tokenized with the task's encoder, finished samples rewarded with
    :func:`task_reward` unless ``reward`` is given, and routes recorded for routing replay
    unless ``routed_experts=False``. ``seed`` fixes sampling per sample index, so a partial
    continued under the same weights ends exactly as an uninterrupted generation; a sample
    stops at one of ``stop_tokens`` or after ``max_new_tokens``. ``step_seconds`` paces the
    engine's decoding steps (see :class:`~straw.rollout.demo.engine.BatchingEngine`).
    """

    where = "the in-process demo policy"

    def __init__(
        self,
        policy: DemoPolicy,
        *,
        max_new_tokens: int = task.CopyTask().max_new_tokens,
        reward: Callable[[Sample], Any] | None = task_reward,
        temperature: float = 1.0,
        seed: int | Callable[[Sample], int] | None = None,
        stop_tokens: Sequence[int] = (task.EOS,),
        weight_version: str = "0",
        routed_experts: bool = True,
        max_running: int = 256,
        step_seconds: float = 0.0,
        options: EngineOptions | None = None,
    ) -> None:
        shape = (policy.config.num_layers, policy.config.top_k) if routed_experts else None
        super().__init__(
            max_new_tokens=max_new_tokens,
            reward=reward,
            tokenize=task.encode_prompt,
            seed=seed,
            routed_experts=shape,
            # Nothing here fails transiently, so nothing is retried.
            options=options or EngineOptions(max_concurrency=max_running, max_retries=0),
        )
        self.policy = policy
        self.temperature = temperature
        self.stop_tokens = tuple(stop_tokens)
        self.max_running = max_running
        self.step_seconds = step_seconds
        self._version = weight_version
        self._engine: BatchingEngine | None = None

    @property
    def weight_version(self) -> str:
        return self._engine.weight_version if self._engine is not None else self._version

    @property
    def engine(self) -> BatchingEngine:
        """The engine loop of the current event loop (exists once the generator was called)."""
        if self._engine is None:
            raise RuntimeError("PolicyGenerator has not generated yet")
        return self._engine

    async def open(self) -> None:
        # Engine loops belong to one event loop: a new loop gets a new engine on the same policy.
        self._engine = BatchingEngine(
            self.policy,
            weight_version=self.weight_version,
            max_running=self.max_running,
            step_seconds=self.step_seconds,
        )
        await self._engine.start()

    async def aclose(self) -> None:
        await super().aclose()
        engine, self._engine = self._engine, None
        if engine is not None:
            self._version = engine.weight_version
            await engine.close()

    async def generate_segment(self, request: SegmentRequest, partial: Segment) -> Segment:
        try:
            decoding = Decoding(
                self.policy,
                request.tokens,
                max_new_tokens=min(
                    request.max_new_tokens, self.policy.config.max_positions - len(request.tokens)
                ),
                temperature=self.temperature,
                seed=request.seed,
                stop_tokens=self.stop_tokens,
                routes_start=request.routes_start,
            )
            job = self.engine.submit(decoding, request.request_id)
        except (ValueError, EngineBusy) as error:
            raise EngineRequestError(f"{self.where} refused sample {request.sample.index}: {error}") from None
        await self.engine.follow(job)
        result = decoding.result()
        return Segment(
            tokens=result.tokens,
            log_probs=result.log_probs,
            text="".join(task.piece(t) for t in result.tokens),
            finish=result.finish,
            weight_version=job.version,
            routes=None if result.routes is None else result.routes.numpy(),
        )

    async def abort_requests(self, request_ids: list[str]) -> bool:
        wanted = set(request_ids)
        self.engine.abort(lambda job: job.id in wanted)
        return True

    async def aupdate_weights(self, weights: Mapping[str, torch.Tensor], version: str) -> int:
        """Load new weights between two steps (aborting what runs); returns how many were aborted."""
        if self._engine is None:
            self._load_in_place(weights, version)
            return 0
        return await self._engine.update_weights(weights, version)

    def update_weights(
        self, weights: Mapping[str, torch.Tensor], version: str, *, timeout: float = 60.0
    ) -> int:
        """:meth:`aupdate_weights` from another thread than the generator's event loop."""
        loop = self._loop
        if loop is None or loop.is_closed() or not loop.is_running():
            self._load_in_place(weights, version)  # no engine loop is stepping
            return 0
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            raise RuntimeError("Inside the generator's event loop, await aupdate_weights() instead")
        return asyncio.run_coroutine_threadsafe(self.aupdate_weights(weights, version), loop).result(timeout)

    def _load_in_place(self, weights: Mapping[str, torch.Tensor], version: str) -> None:
        import_weights(self.policy, weights)
        self._version = str(version)
        if self._engine is not None:
            self._engine.weight_version = str(version)
