"""Generation workers: the generator contract, the slot loop, and the worker handle protocol.

A :class:`SlotWorker` is one worker's generation loop (docs/ROLLOUT.md, "Runners"): up to
``slots`` groups are generated at once, each taken from the queue through a reader,
generated, filtered, and either published as its task's result, discarded (rejected by the
dynamic filter) or returned to the queue as a partial (aborted). It lives in one asyncio event
loop and is driven by four coroutines: ``start``, ``pause``, ``next`` and ``close``.

A :class:`WorkerHandle` is how a :class:`~straw.rollout.scheduler.RolloutScheduler` drives a
worker it may not share a process with. Each method returns a plain value, an awaitable or a
``concurrent.futures.Future``; the scheduler accepts all three, so an in-process
:class:`LocalWorker` and a remote actor's method calls (whose results are awaitable) plug in
alike. A handle signals the loss of its worker by raising :class:`WorkerLost` or one of the
exception types in its ``lost_errors`` attribute.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import inspect
import logging
import threading
from collections import deque
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Protocol, TypeVar

from ..errors import LeaseExpired, StaleAttempt
from .config import RolloutConfig
from .hooks import Hooks
from .pool import run_io
from .refs import group_lease, inherit_queue_context
from .sample import Sample, SampleStatus, group_stage, iter_samples

__all__ = [
    "READ_GROUPS_MAX",
    "REBUFFER_GROUPS_MAX",
    "DroppedGroup",
    "LocalWorker",
    "RolloutReader",
    "SlotWorker",
    "WorkerHandle",
    "WorkerLost",
    "check_generation",
    "generate_group",
    "is_aborted",
    "resolve",
]

log = logging.getLogger("straw.rollout.workers")

#: A worker asks its reader for at most this many groups at a time.
READ_GROUPS_MAX = 64
#: Aborted groups go back to the queue at most this many per ``add_samples`` call.
REBUFFER_GROUPS_MAX = 64

T = TypeVar("T")


class WorkerLost(RuntimeError):
    """A generation worker is gone (its process or actor died); raised by its handle."""


@dataclasses.dataclass(frozen=True)
class DroppedGroup:
    """A worker's answer for a group the dynamic filter rejected (already discarded in the queue)."""

    reason: str
    index: int | None = None


class WorkerHandle(Protocol):
    """How the scheduler drives one generation worker (in-process or remote).

    ``start(rollout_id)`` lets it generate (results are published for that rollout);
    ``pause()`` stops admission, aborts in-flight generation and answers once nothing is
    running any more; ``next()`` answers the next kept group's :class:`RolloutGroupRef`, a
    :class:`DroppedGroup`, or None once a paused worker has nothing left; ``close(deadline)``
    stops it, allowing ``deadline`` seconds for its durable writes. Each may return a value,
    an awaitable or a ``concurrent.futures.Future``.
    """

    @property
    def reader_id(self) -> str: ...
    @property
    def capacity(self) -> int: ...
    def start(self, rollout_id: int) -> Any: ...
    def pause(self) -> Any: ...
    def next(self) -> Any: ...
    def close(self, deadline: float) -> Any: ...


class RolloutReader(Protocol):
    """What a worker calls on its queue reader (``straw.rollout.reader.QueueReader``)."""

    reader_id: str
    controller: Any

    def get_samples(self, num_groups: int) -> list[Any]: ...
    def publish_group(self, group: Any, *, rollout_id: int | str) -> Any: ...
    def add_samples(self, groups: Sequence[Any]) -> Any: ...
    def discard_group(self, group: Any, reason: str) -> Any: ...


async def resolve(value: Any) -> Any:
    """The result of a handle call: awaited if awaitable, waited for if a concurrent Future."""
    if isinstance(value, concurrent.futures.Future):
        return await asyncio.wrap_future(value)
    if inspect.isawaitable(value):
        return await value
    return value


# --------------------------------------------------------------------------- the generator contract


def check_generation(
    sources: Sequence[Sample],
    before: Sequence[tuple[Any, Any, int, int]],
    result: Any,
    weight_version: str | None,
) -> Any:
    """Enforce the generator contract on ``result`` and complete what the generator may leave out.

    ``before`` holds each source sample's ``(index, group_index, len(tokens),
    len(weight_versions))`` taken before generation. The result must hold as many samples
    with the same indices, none PENDING. A sample whose tokens grew without a new weight
    version gets the serving version; samples the generator made anew inherit the queue
    attributes of the sample they replace.
    """
    try:
        outputs = list(iter_samples(result))
    except TypeError as error:
        raise TypeError(f"A generator returns a list of Samples: {error}") from None
    if len(outputs) != len(sources) or any(
        (out.index, out.group_index) != (index, group)
        for out, (index, group, _, _) in zip(outputs, before, strict=False)
    ):
        raise ValueError("Generation must preserve the source sample index")
    pending = [out.index for out in outputs if out.status is SampleStatus.PENDING]
    if pending:
        raise ValueError(f"Generator returned unfinished samples without ABORTED status: {pending}")
    for source, out, (_, _, tokens, versions) in zip(sources, outputs, before, strict=True):
        if out is not source:
            inherit_queue_context(source, [out])
        if weight_version is not None and len(out.tokens) > tokens and len(out.weight_versions) <= versions:
            out.weight_versions = [*out.weight_versions, str(weight_version)]
    return result


async def generate_group(group: Any, generator: Any, weight_version: Callable[[], Any]) -> Any:
    """Generate one group under the current serving version and check the result."""
    sources = list(iter_samples(group))
    before = [(s.index, s.group_index, len(s.tokens), len(s.weight_versions)) for s in sources]
    version = weight_version()
    version = None if version is None else str(version)
    result = generator(group, weight_version=version)
    if inspect.isawaitable(result):
        result = await result
    return check_generation(sources, before, result, version)


def is_aborted(group: Any) -> bool:
    """True when any sample was interrupted (the group goes back to the queue as a partial)."""
    return any(s.status is SampleStatus.ABORTED for s in iter_samples(group))


def _first_index(group: Any) -> int | None:
    first = next(iter_samples(group), None)
    return first.index if first is not None else None


def _failure(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


# --------------------------------------------------------------------------- the slot loop


class SlotWorker:
    """One worker's generation loop: ``slots`` groups at a time, fed by one reader.

    A group taken from the queue counts against the slots until ``next()`` hands its result
    on, so a worker never holds more than ``slots`` groups (generating, or done and waiting);
    a slow consumer therefore stops the worker from taking more work. Paused, the worker
    takes nothing; groups that arrive after a pause go back to the queue ungenerated.
    """

    def __init__(
        self,
        config: RolloutConfig,
        reader: RolloutReader,
        generator: Any,
        *,
        hooks: Hooks | None = None,
        slots: int,
        weight_version: Callable[[], Any] = lambda: None,
        owns_reader: bool = False,
    ) -> None:
        if isinstance(slots, bool) or not isinstance(slots, int) or slots <= 0:
            raise ValueError(f"slots must be a positive integer, got {slots!r}")
        if not callable(generator):
            raise TypeError(f"generator must be callable, got {type(generator).__name__}")
        self.config = config
        self.reader = reader
        self.generator = generator
        self.hooks = hooks if hooks is not None else Hooks.from_config(config)
        self.capacity = slots
        self.reader_id = str(reader.reader_id)
        self.weight_version = weight_version
        self.owns_reader = owns_reader
        self._paused = True
        self._closed = False
        self._exhausted = False  # the reader answered nothing: wait for the next start()
        self._rollout_id: int | None = None
        self._results: deque[Any] = deque()
        self._admitted = 0  # groups taken and not yet handed on by next()
        self._busy = 0  # reads, generations and returns under way
        self._generating = 0  # generator calls under way
        self._fetching = False
        self._flushing = False
        self._rebuffer: list[Any] = []
        self._error: BaseException | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._changed: asyncio.Event | None = None

    # ------------------------------------------------------------------ plumbing

    def _event(self) -> asyncio.Event:
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed

    def _notify(self) -> None:
        self._event().set()

    async def _wait_until(self, ready: Callable[[], bool]) -> None:
        event = self._event()
        while not ready():
            event.clear()
            await event.wait()

    def _spawn(self, coroutine: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _thread(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(None, functools.partial(fn, *args))

    def _latch(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
            log.error("Rollout worker %s stopped: %s", self.reader_id, _failure(error))
        self._notify()

    # ------------------------------------------------------------------ the handle's coroutines

    async def start(self, rollout_id: int) -> None:
        """Generate (again) for ``rollout_id``."""
        if self._closed:
            raise RuntimeError("Rollout worker is closed")
        self._rollout_id = rollout_id
        self._paused = False
        self._exhausted = False
        self._feed()
        self._notify()

    async def pause(self) -> None:
        """Stop taking work, abort in-flight generation, and return once nothing runs any more.

        What was in flight is then durable: published and accepted, discarded, or back in
        the queue as a partial.
        """
        self._paused = True
        abort = getattr(self.generator, "abort", None)
        if callable(abort) and self._generating:
            done = abort()
            if inspect.isawaitable(done):
                await done
        self._notify()
        await self._wait_until(lambda: self._busy == 0)

    async def next(self) -> Any:
        """The next result (a group reference or a DroppedGroup); None once paused with nothing left."""
        while True:
            if self._error is not None:
                raise self._error
            if self._results:
                item = self._results.popleft()
                self._admitted -= 1
                self._feed()
                self._notify()
                return item
            if (self._paused or self._closed) and self._busy == 0:
                return None
            event = self._event()
            event.clear()
            await event.wait()

    async def close(self, deadline: float | None = None) -> None:
        """Pause (allowing ``deadline`` seconds for in-flight work to become durable), then stop."""
        if self._closed:
            return
        self._closed = True
        try:
            await asyncio.wait_for(self.pause(), deadline)
        except asyncio.TimeoutError:
            log.warning("Rollout worker %s closed with work in flight after %ss", self.reader_id, deadline)
        for task in list(self._tasks):
            task.cancel()
        if self.owns_reader:
            await self._thread(self.reader.close)  # type: ignore[attr-defined]

    # ------------------------------------------------------------------ taking work

    def _feed(self) -> None:
        """Start one read for the free slots (at most one read at a time)."""
        if self._fetching or self._paused or self._closed or self._exhausted or self._error is not None:
            return
        free = self.capacity - self._admitted
        if free <= 0:
            return
        self._fetching = True
        self._busy += 1
        self._spawn(self._fetch(min(free, READ_GROUPS_MAX)))

    async def _fetch(self, count: int) -> None:
        groups: list[Any] = []
        try:
            groups = list(await self._thread(self.reader.get_samples, count))
        except Exception as error:
            self._latch(error)
        self._admitted += len(groups)
        self._busy += len(groups)
        for group in groups:
            self._spawn(self._slot(group))
        self._exhausted = not groups and self._error is None
        self._fetching = False
        self._busy -= 1
        self._feed()
        self._notify()

    async def _slot(self, group: Any) -> None:
        try:
            await self._run_group(group)
        except Exception as error:
            self._admitted -= 1
            await self._generation_failed(group, error)
        finally:
            self._busy -= 1
            self._feed()
            self._notify()

    async def _run_group(self, group: Any) -> None:
        if self._paused or self._closed:
            self._give_back(group)
            return
        if group_stage(group) != "ready":  # a ready group (a delivery) is not generated again
            self._generating += 1
            try:
                group = await generate_group(group, self.generator, self.weight_version)
            finally:
                self._generating -= 1
            if is_aborted(group):
                self._give_back(group)
                return
        verdict = self.hooks.filter_group(group, self.config)
        try:
            if not verdict.keep:
                reason = verdict.reason or "filtered"
                await run_io(self.config, self.reader.discard_group, group, reason)
                self._results.append(DroppedGroup(reason, _first_index(group)))
                return
            rollout_id = self._rollout_id if self._rollout_id is not None else "async"
            publish = functools.partial(self.reader.publish_group, rollout_id=rollout_id)
            self._results.append(await run_io(self.config, publish, group))
        except (LeaseExpired, StaleAttempt) as error:
            # Another attempt owns the task now; its result is that attempt's business.
            log.warning("Rollout worker %s dropped group %s: %s", self.reader_id, _first_index(group), error)
            self._admitted -= 1

    async def _generation_failed(self, group: Any, error: Exception) -> None:
        """Fail the task's attempt (it is retried elsewhere) and stop the worker with the error."""
        lease = None
        with contextlib.suppress(ValueError):  # mixed leases: nothing to fail; the error says why
            lease = group_lease(group)
        if lease is not None:
            try:
                await self._thread(self.reader.controller.fail, lease, _failure(error))
            except Exception as fail_error:
                log.warning(
                    "Rollout worker %s could not fail %s: %s", self.reader_id, lease.task_id, fail_error
                )
        self._latch(error)

    # ------------------------------------------------------------------ giving work back

    def _give_back(self, group: Any) -> None:
        """Return an aborted (or ungenerated) group to the queue, batching the returns."""
        self._admitted -= 1
        self._rebuffer.append(group)
        if not self._flushing:
            self._flushing = True
            self._busy += 1
            self._spawn(self._flush())

    async def _flush(self) -> None:
        try:
            while self._rebuffer:
                chunk = self._rebuffer[:REBUFFER_GROUPS_MAX]
                del self._rebuffer[:REBUFFER_GROUPS_MAX]
                await run_io(self.config, self.reader.add_samples, chunk)
        except Exception as error:
            self._latch(error)
        finally:
            self._flushing = False
            self._busy -= 1
            self._feed()
            self._notify()


# --------------------------------------------------------------------------- the in-process handle


class LocalWorker:
    """A :class:`WorkerHandle` running a :class:`SlotWorker` on an event loop thread of its own.

    Its methods return ``concurrent.futures.Future``s, like a remote worker's calls return
    awaitables, so the scheduler treats both the same way.
    """

    lost_errors: tuple[type[BaseException], ...] = (WorkerLost,)

    def __init__(self, worker: SlotWorker) -> None:
        self.worker = worker
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._serve, name=f"straw-rollout-worker-{worker.reader_id}", daemon=True
        )
        self._stopped = False
        self._thread.start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_forever()
        finally:
            self._loop.close()

    @property
    def reader_id(self) -> str:
        return self.worker.reader_id

    @property
    def capacity(self) -> int:
        return self.worker.capacity

    def _submit(self, coroutine: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        if self._stopped:
            coroutine.close()
            raise WorkerLost(f"Rollout worker {self.reader_id} is closed")
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop)

    def start(self, rollout_id: int) -> concurrent.futures.Future[None]:
        return self._submit(self.worker.start(rollout_id))

    def pause(self) -> concurrent.futures.Future[None]:
        return self._submit(self.worker.pause())

    def next(self) -> concurrent.futures.Future[Any]:
        return self._submit(self.worker.next())

    def close(self, deadline: float) -> concurrent.futures.Future[None]:
        """Close the worker (``deadline`` seconds for durable writes), then stop its thread."""
        future = self._submit(self._shutdown(deadline))
        self._stopped = True
        return future

    async def _shutdown(self, deadline: float) -> None:
        try:
            await self.worker.close(deadline)
            await self._loop.shutdown_default_executor()
        finally:
            self._loop.call_soon(self._loop.stop)

    def join(self, timeout: float | None = None) -> None:
        """Wait for the worker's thread to end (after ``close``)."""
        self._thread.join(timeout)
