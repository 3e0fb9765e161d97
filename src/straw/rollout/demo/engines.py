"""The generators the demo job runs, and how new weights reach them.

- :class:`WeightBoard` holds the newest published weights: a version and a
  :class:`~straw.rollout.refs.DiskPayloadRef` to the tensors in the pool. The driver posts to
  it after each training step.
- :class:`SyncedGenerator` wraps a generator with the version it serves:
  :meth:`~SyncedGenerator.load_posted` reads the weights a reference names from the pool and
  installs them (once per version; the driver calls it, on every distributed worker too, while
  admission is paused), and before each call it asks its ``current`` callable (a board's)
  whether a newer version was posted meanwhile.
- :class:`CopyEngine`: a fast fake engine for the copy task (no model): every sample produces
  the expected response token by token on an asyncio timer, with the rule reward, constant
  log-probs and zero routes; ``abort()`` keeps the tokens produced so far. The whole-job crash
  tests run the real pipeline with it, so that a run costs the data plane and not a model.
- :class:`LoggedReward`: a reward function that stamps each rewarded sample with a call id
  and appends ``{call, task, index}`` to a log file, so a test can tell how often the reward
  hook ran for each accepted group (across killed runs too).
"""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from ..refs import DiskPayloadRef
from ..sample import Sample, SampleStatus
from . import task
from .simulated import wait_unless_set

__all__ = ["CopyEngine", "LoggedReward", "SyncedGenerator", "WeightBoard", "queue_task_id"]


class WeightBoard:
    """The newest published weights: ``(version, reference)``; thread-safe."""

    def __init__(self, version: int = 0, ref: DiskPayloadRef | None = None) -> None:
        self._lock = threading.Lock()
        self._current: tuple[int, DiskPayloadRef | None] = (int(version), ref)

    def post(self, version: int, ref: DiskPayloadRef | None) -> None:
        with self._lock:
            if int(version) < self._current[0]:
                raise ValueError(f"Weight version {version} is older than {self._current[0]}")
            self._current = (int(version), ref)

    def current(self) -> tuple[int, DiskPayloadRef | None]:
        with self._lock:
            return self._current


class LoggedReward:
    """The copy task's rule reward, logged per call (see the module docstring)."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self._lock = threading.Lock()

    def __call__(self, sample: Sample) -> float:
        value = task.sample_reward(sample)
        if self.path is not None:
            call = uuid.uuid4().hex
            sample.metadata = {**(sample.metadata or {}), "reward_call": call}
            line = json.dumps({"call": call, "task": queue_task_id(sample), "index": sample.index}) + "\n"
            # One write per line, appended and flushed: a killed process loses at most the line
            # it was writing, never an earlier one (the page cache outlives the process).
            with self._lock, open(self.path, "a", encoding="utf-8") as handle:
                handle.write(line)
        return value


def queue_task_id(sample: Any) -> Any:
    """The queue task a sample is leased (or was accepted) under, else None.

    The lease or receipt rides on the sample as a dict or as the protocol object.
    """
    for name in ("_queue_lease", "_queue_receipt"):
        held = getattr(sample, name, None)
        if held is not None:
            return held.get("task_id") if isinstance(held, Mapping) else getattr(held, "task_id", None)
    return None


class SyncedGenerator:
    """Loads the board's newest weights into ``inner`` before generating (module docstring).

    ``current`` answers the board's ``(version, reference)`` (a blocking call: a local board's
    method or a Ray actor round trip, run off the event loop); ``load(weights, version)`` is
    awaited to install loaded weights in the engine (aborting nothing that matters: admission
    is paused while the driver publishes, so nothing of the new step runs yet).
    """

    def __init__(
        self,
        inner: Any,
        current: Callable[[], tuple[int, DiskPayloadRef | None]],
        load: Callable[[Mapping[str, Any], str], Any],
        *,
        version: int = 0,
    ) -> None:
        self.inner = inner
        self._current = current
        self._load = load
        self.version = int(version)
        self.loads = 0
        self._lock: asyncio.Lock | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def __call__(self, group: list[Any], *, weight_version: str | None) -> list[Any]:
        await self.sync()
        result: list[Any] = await self.inner(group, weight_version=str(self.version))
        return result

    async def sync(self) -> int:
        """Bring the served weights to the board's version; returns the version served."""
        loop = asyncio.get_running_loop()
        version, ref = await loop.run_in_executor(None, self._current)
        if version > self.version and ref is not None:
            return await self.load_posted(version, ref)
        return self.version

    async def load_posted(self, version: int, ref: DiskPayloadRef) -> int:
        """Load the weights ``ref`` names as ``version`` unless a newer one is served already.

        Run in the generator's event loop (a distributed worker calls it there when the driver
        asks); concurrent calls load once. Returns the version served afterwards.
        """
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._loop, self._lock = loop, asyncio.Lock()
        lock = self._lock
        if lock is None:  # pragma: no cover - set just above
            raise RuntimeError("SyncedGenerator lost its event loop binding")
        async with lock:
            if int(version) > self.version:
                weights = await loop.run_in_executor(None, ref.load)
                done = self._load(weights, str(version))
                if asyncio.iscoroutine(done):
                    await done
                self.loads += 1
                self.version = int(version)
        return self.version

    def abort(self) -> None:
        abort = getattr(self.inner, "abort", None)
        if callable(abort):
            abort()

    def close(self) -> None:
        close = getattr(self.inner, "close", None)
        if callable(close):
            close()


class CopyEngine:
    """A fast fake engine for the copy task (see the module docstring)."""

    def __init__(
        self,
        *,
        token_seconds: float = 0.001,
        reward: Callable[[Sample], Any] | None = None,
        routes: tuple[int, int] = (2, 2),
        max_new_tokens: int = task.CopyTask().max_new_tokens,
    ) -> None:
        if token_seconds < 0:
            raise ValueError(f"token_seconds must be >= 0, got {token_seconds}")
        self.token_seconds = token_seconds
        self.reward = reward if reward is not None else LoggedReward(None)
        self.routes = routes
        self.max_new_tokens = max_new_tokens
        self.version = "0"
        self._abort: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def load(self, weights: Mapping[str, Any], version: str) -> None:
        """Nothing to load: a fake engine only takes the version on."""
        self.version = str(version)

    async def __call__(self, group: list[Sample], *, weight_version: str | None) -> list[Sample]:
        loop = asyncio.get_running_loop()
        if self._loop is not loop or self._abort is None:
            self._loop, self._abort = loop, asyncio.Event()
        aborted = self._abort
        for sample in group:
            if sample.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED):
                continue
            if not sample.tokens:
                sample.tokens = task.encode_prompt(str(sample.prompt))
            target = task.target_tokens(str(sample.label))[: self.max_new_tokens]
            new: list[int] = []
            while sample.response_length + len(new) < len(target):
                if aborted.is_set() or await wait_unless_set(aborted, self.token_seconds):
                    break
                position = sample.response_length + len(new)
                new.append(_token(target[position], sample.index or 0, position))
            self._append(sample, new, weight_version)
            if sample.response_length < len(target):
                sample.status = SampleStatus.ABORTED
                continue
            sample.status = SampleStatus.COMPLETED
            sample.reward = float(self.reward(sample))
        return group

    def _append(self, sample: Sample, new: list[int], weight_version: str | None) -> None:
        if not new:
            return
        import numpy as np

        sample.tokens = [*sample.tokens, *new]
        sample.response_length += len(new)
        sample.rollout_log_probs = [*(sample.rollout_log_probs or []), *([-1.0] * len(new))]
        sample.weight_versions = [*sample.weight_versions, str(weight_version or self.version)]
        layers, top_k = self.routes
        sample.rollout_routed_experts = np.zeros((len(sample.tokens) - 1, layers, top_k), dtype=np.int32)

    def abort(self) -> None:
        """End the calls in flight soon (thread-safe); later calls run normally."""
        loop, event = self._loop, self._abort
        if loop is None or event is None or loop.is_closed():
            return
        fresh = asyncio.Event()

        def swap() -> None:
            event.set()
            self._abort = fresh

        loop.call_soon_threadsafe(swap)

    def close(self) -> None:
        """Nothing to release."""


def _token(right: int, index: int, position: int) -> int:
    """The engine's token: usually the right one, a wrong digit for about one in four (index, position)."""
    if (index * 7 + position * 3) % 4 == 0 and right < task.DIGITS:
        return (right + 1) % task.DIGITS
    return right
