"""A continuous-batching engine loop for the demo policy, shared by its server and its generator.

Every running generation is a :class:`~straw.rollout.demo.policy.Decoding`; the loop advances
all of them by one token per batched forward pass, on one engine thread so the event loop
stays free. Aborts, weight updates and new requests take effect between two steps: an aborted
generation ends at once with what it generated, and a weight update never changes the weights
under a running step. For tests the loop can park generations once they have a given number
of tokens, which makes "abort in the middle of generating" a deterministic state.

``step_seconds`` paces the loop like a serving engine, whose decoding step takes tens of
milliseconds on its device while the host waits: a step that computed faster waits out the
rest on an asyncio timer (the CPU stays free, an abort ends the wait). The tiny demo policy
computes a step in about a millisecond, so without pacing a whole response is generated long
before the trainer's next weight update and a pause would find nothing in flight to continue.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any

import torch

from .policy import Decoding, DemoPolicy, import_weights, step_together
from .simulated import wait_unless_set

__all__ = ["BatchingEngine", "EngineBusy", "Job"]

_log = logging.getLogger("straw.rollout.demo.engine")


class EngineBusy(RuntimeError):
    """The engine already runs ``max_running`` generations (or is shutting down)."""


@dataclass
class Job:
    """One generation in the engine loop."""

    id: str
    decoding: Decoding
    done: asyncio.Future[None]
    #: Set after every step that advanced this job (and when it ends).
    progress: asyncio.Event = field(default_factory=asyncio.Event)
    #: The weight version of its tokens, fixed at its first step (weights never change under a job).
    version: str | None = None
    abort_requested: bool = False
    created: float = field(default_factory=time.monotonic)

    @property
    def finished(self) -> bool:
        return self.done.done()


class BatchingEngine:
    """Runs many generations of one policy together (see the module docstring).

    ``await start()`` inside the event loop that will use it, ``await close()`` at the end.
    """

    def __init__(
        self,
        policy: DemoPolicy,
        *,
        weight_version: str = "0",
        max_running: int = 256,
        step_seconds: float = 0.0,
    ) -> None:
        if max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {max_running}")
        if not 0.0 <= step_seconds < float("inf"):
            raise ValueError(f"step_seconds must be a finite number of seconds >= 0, got {step_seconds}")
        self.policy = policy
        self.weight_version = weight_version
        self.max_running = max_running
        self.step_seconds = float(step_seconds)
        #: Counters: generations ``finished`` and ``aborted``.
        self.stats: dict[str, int] = {"finished": 0, "aborted": 0}
        self._executor: ThreadPoolExecutor | None = None
        self._task: asyncio.Task[None] | None = None
        self._changed = asyncio.Event()
        self._interrupted = asyncio.Event()  # set by an abort or close: a paced wait ends early
        self._watch = asyncio.Condition()
        self._model_lock = asyncio.Lock()
        self._loading = False
        self._closing = False
        self._running: dict[str, Job] = {}
        self._park_at: int | None = None
        self._ids = itertools.count()

    # ------------------------------------------------------------------ lifecycle

    @property
    def started(self) -> bool:
        return self._task is not None

    async def start(self) -> None:
        if self._task is not None:
            raise RuntimeError("BatchingEngine is already started")
        self._closing = False
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="straw-demo-engine")
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def close(self) -> None:
        """Abort every generation and stop the loop (idempotent)."""
        task = self._task
        if task is None:
            return
        self._closing = True
        self.abort(lambda job: True)
        await task
        self._task = None
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    # ------------------------------------------------------------------ generations

    def submit(self, decoding: Decoding, job_id: str | None = None) -> Job:
        """Admit one generation; await :meth:`follow` (or watch ``progress``) for its end."""
        if self._closing or self._task is None:
            raise EngineBusy("Engine is not running")
        if len(self._running) >= self.max_running:
            raise EngineBusy(f"Engine busy: {self.max_running} generations running")
        job_id = job_id or f"{uuid.uuid4().hex}-{next(self._ids)}"
        if job_id in self._running:
            raise ValueError(f"Request id {job_id!r} is already running")
        job = Job(job_id, decoding, asyncio.get_running_loop().create_future())
        if decoding.done:  # nothing to generate (budget 0 or position limit)
            job.version = self.weight_version
            job.done.set_result(None)
            return job
        self._running[job_id] = job
        self._changed.set()
        return job

    async def follow(self, job: Job) -> None:
        """Wait for ``job`` to end; if the waiter is cancelled (a client went away), abort it."""
        try:
            await asyncio.shield(job.done)
        except asyncio.CancelledError:
            self.abort(lambda j: j is job)
            raise

    def abort(self, match: Callable[[Job], bool]) -> int:
        """Make every running generation ``match`` accepts end before the next step."""
        count = 0
        for job in self._running.values():
            if not job.finished and not job.abort_requested and match(job):
                job.abort_requested = True
                count += 1
        self._changed.set()
        self._interrupted.set()
        return count

    def consistent(self) -> AbstractAsyncContextManager[Any]:
        """Hold this while reading a running decoding: no step changes it meanwhile."""
        return self._model_lock

    async def update_weights(self, weights: Mapping[str, torch.Tensor], version: str) -> int:
        """Abort the running generations, load ``weights`` between two steps, serve ``version``.

        Returns how many generations were aborted; ones submitted meanwhile start afterwards.
        """
        self._loading = True
        try:
            aborted = self.abort(lambda job: True)
            async with self._model_lock:
                await self._in_engine(import_weights, self.policy, weights)
                self.weight_version = str(version)
        finally:
            self._loading = False
            self._changed.set()
        return aborted

    # ------------------------------------------------------------------ test controls

    @property
    def running(self) -> int:
        return len(self._running)

    def park_at(self, tokens: int | None) -> None:
        """Stop advancing generations once they have ``tokens`` new tokens (None: run freely)."""
        if tokens is not None and tokens < 0:
            raise ValueError(f"park_at takes a token count >= 0 or None, got {tokens}")
        self._park_at = tokens
        self._changed.set()

    async def wait_parked(self, count: int, *, timeout: float = 30.0) -> None:
        """Wait until ``count`` generations are parked (see :meth:`park_at`)."""
        await self._wait_until(lambda: self._parked() >= count, timeout)

    async def wait_idle(self, *, timeout: float = 30.0) -> None:
        """Wait until no generation is running."""
        await self._wait_until(lambda: not self._running, timeout)

    async def _wait_until(self, condition: Callable[[], bool], timeout: float) -> None:
        async with self._watch:
            await asyncio.wait_for(self._watch.wait_for(condition), timeout)

    # ------------------------------------------------------------------ the loop

    def _parked(self) -> int:
        limit = self._park_at
        if limit is None:
            return 0
        return sum(
            1 for j in self._running.values() if len(j.decoding.new_tokens) >= limit and not j.finished
        )

    def _runnable(self) -> list[Job]:
        limit = self._park_at
        return [
            j
            for j in self._running.values()
            if not j.finished and (limit is None or len(j.decoding.new_tokens) < limit)
        ]

    async def _loop(self) -> None:
        while True:
            self._changed.clear()
            # Cleared before the step, not before its paced wait: an abort that lands while the
            # step computes (off the loop, in the executor) still ends that wait at once.
            self._interrupted.clear()
            self._apply_aborts()
            if self._closing and not self._running:
                await self._notify()
                return
            batch = [] if self._loading else self._runnable()
            await self._notify()
            if not batch:
                await self._changed.wait()
                continue
            began = asyncio.get_running_loop().time()
            async with self._model_lock:
                for job in batch:
                    job.version = job.version or self.weight_version
                try:
                    await self._in_engine(step_together, self.policy, [j.decoding for j in batch])
                except Exception as error:  # a broken step fails its generations, not the engine
                    _log.exception("generation step failed")
                    for job in batch:
                        self._running.pop(job.id, None)
                        job.done.set_exception(error)
                        job.progress.set()
                    continue
            for job in batch:
                job.progress.set()
                if job.decoding.done:
                    self._finish(job)
            await self._pace(began)

    async def _pace(self, began: float) -> None:
        """Wait out the rest of ``step_seconds`` since ``began``, unless an abort comes first."""
        rest = self.step_seconds - (asyncio.get_running_loop().time() - began)
        if rest > 0 and not self._closing:
            await wait_unless_set(self._interrupted, rest)

    async def _notify(self) -> None:
        async with self._watch:
            self._watch.notify_all()

    async def _in_engine(self, function: Callable[..., Any], *args: Any) -> Any:
        """Run model code on the engine thread (one call at a time, off the event loop)."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, function, *args)

    def _apply_aborts(self) -> None:
        for job in list(self._running.values()):
            if job.abort_requested and not job.finished:
                job.decoding.abort()
                self.stats["aborted"] += 1
                self._finish(job)

    def _finish(self, job: Job) -> None:
        self._running.pop(job.id, None)
        if not job.finished:
            job.version = job.version or self.weight_version
            job.done.set_result(None)
            self.stats["finished"] += 1
        job.progress.set()
