"""The collector shared by the fully asynchronous runners: workers in, index-sorted batches out.

A :class:`RolloutScheduler` drives any number of :class:`~straw.rollout.workers.WorkerHandle`s
from a background thread running an asyncio loop (docs/ROLLOUT.md, "Runners"):

- it sends ``start``/``pause`` until every worker matches the wanted state (running for a
  rollout id, or paused);
- it asks each running worker for its next result, at most one request per worker, and
  only while ``pending + ready < demand + prefetch`` (``pending``: requests in flight,
  ``ready``: kept groups waiting, ``demand``: kept groups the current ``generate`` still
  needs). A slow trainer therefore pushes back on the workers instead of piling up results;
- a worker that is lost gives its capacity up; the groups it completed but never delivered
  are recovered from the queue (``retire_reader``) and join the batch;
- any other error is latched and raised by the next call.

Callers block on a condition variable; nothing here sleeps.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from .collection import RolloutOutput, finalize_groups, group_ref_from_receipt
from .config import RolloutConfig
from .hooks import Hooks
from .pool import rollout_store
from .refs import RolloutGroupRef
from .workers import DroppedGroup, WorkerHandle, WorkerLost, resolve

__all__ = ["CLOSE_SECONDS", "RolloutScheduler", "drop_metrics"]

log = logging.getLogger("straw.rollout.scheduler")

#: Time workers get, together, to make their in-flight work durable when the scheduler closes.
CLOSE_SECONDS = 300.0


def drop_metrics(drops: dict[str, int], kept: int) -> dict[str, Any]:
    """The dynamic filter's metrics of one rollout step."""
    dropped = sum(drops.values())
    metrics: dict[str, Any] = {
        f"rollout/dynamic_filter/drop_{reason}": n for reason, n in sorted(drops.items())
    }
    metrics["rollout/dynamic_filter/dropped_groups"] = dropped
    metrics["rollout/dynamic_filter/dropped_ratio"] = dropped / (dropped + kept) if dropped + kept else 0.0
    return metrics


@dataclasses.dataclass
class _Worker:
    """The scheduler's view of one worker."""

    handle: WorkerHandle
    capacity: int
    paused: bool = True  # workers start paused
    rollout_id: int | None = None
    control: asyncio.Task[Any] | None = None  # a start/pause call in flight
    pending: asyncio.Task[Any] | None = None  # a next() call in flight
    delivered: list[int] = dataclasses.field(default_factory=list)
    lost: bool = False


class RolloutScheduler:
    """Collects kept groups from generation workers into rollout batches (see the module text)."""

    def __init__(
        self,
        workers: Sequence[WorkerHandle],
        *,
        config: RolloutConfig,
        controller: Any = None,
        hooks: Hooks | None = None,
        clock: Callable[[], float] = time.monotonic,
        close_seconds: float = CLOSE_SECONDS,
    ) -> None:
        if not isinstance(config, RolloutConfig):
            raise TypeError(f"config= is a RolloutConfig, got {type(config).__name__}")
        handles = list(workers)
        if not handles:
            raise ValueError("A rollout scheduler needs at least one worker")
        self.config = config
        self.controller = controller
        self.hooks = hooks if hooks is not None else Hooks.from_config(config)
        self.clock = clock
        self.close_seconds = close_seconds
        self._workers = [_Worker(h, int(h.capacity)) for h in handles]
        self._cond = threading.Condition()
        self._ready: collections.deque[RolloutGroupRef] = collections.deque()
        self._drops: collections.Counter[str] = collections.Counter()
        self._paused = True
        self._rollout_id: int | None = None
        self._demand = 0
        self._prefetch = 0
        self._error: BaseException | None = None
        self._collecting = False
        self._closed = False
        self._stopping = False
        self._loop = asyncio.new_event_loop()
        self._wake: asyncio.Event | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="straw-rollout-scheduler", daemon=True)
        self._thread.start()
        self._started.wait()

    # ------------------------------------------------------------------ the background loop

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._wake = asyncio.Event()
        self._main = self._loop.create_task(self._run())
        self._started.set()
        try:
            self._loop.run_forever()
        finally:
            self._loop.close()

    def _poke(self) -> None:
        """Wake the background loop (from any thread)."""
        wake = self._wake
        if wake is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(wake.set)

    def _spawn(self, coroutine: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = self._loop.create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _run(self) -> None:
        wake = self._wake
        if wake is None:  # pragma: no cover - _serve creates it before the loop runs
            return
        while True:
            with self._cond:
                if self._stopping:
                    return
                if self._error is None:
                    self._dispatch()
            await wake.wait()
            wake.clear()

    def _live(self) -> list[_Worker]:
        return [w for w in self._workers if not w.lost]

    def _window_open(self) -> bool:
        pending = sum(1 for w in self._workers if w.pending is not None)
        return pending + len(self._ready) < self._demand + self._prefetch

    def _dispatch(self) -> None:
        """Send what brings the workers to the wanted state (called in the loop, under the lock)."""
        paused = self._paused or self._rollout_id is None
        for w in self._live():
            if w.control is not None:
                continue
            if paused and not w.paused:
                w.control = self._spawn(self._control(w, None))
            elif not paused and (w.paused or w.rollout_id != self._rollout_id):
                w.control = self._spawn(self._control(w, self._rollout_id))
        if paused:
            return
        for w in self._live():
            if not self._window_open():
                break
            if w.pending is None and w.control is None and not w.paused and w.capacity > 0:
                w.pending = self._spawn(self._next(w))

    def _is_loss(self, w: _Worker, error: BaseException) -> bool:
        kinds = (WorkerLost, *tuple(getattr(w.handle, "lost_errors", ())))
        return isinstance(error, kinds)

    async def _control(self, w: _Worker, rollout_id: int | None) -> None:
        try:
            if rollout_id is None:
                await resolve(w.handle.pause())
            else:
                await resolve(w.handle.start(rollout_id))
        except asyncio.CancelledError:
            raise
        except BaseException as error:
            with self._cond:
                w.control = None
            await self._failed(w, error)
            return
        with self._cond:
            w.control = None
            w.paused = rollout_id is None
            w.rollout_id = rollout_id
            self._cond.notify_all()
        self._poke()

    async def _next(self, w: _Worker) -> None:
        try:
            value = await resolve(w.handle.next())
        except asyncio.CancelledError:
            raise
        except BaseException as error:
            with self._cond:
                w.pending = None
            await self._failed(w, error)
            return
        with self._cond:
            w.pending = None
            if isinstance(value, DroppedGroup):
                self._drops[value.reason] += 1
            elif isinstance(value, RolloutGroupRef):
                self._ready.append(value)
                if value.receipt is not None:
                    w.delivered.append(value.receipt.position)
            elif value is not None:
                self._latch(TypeError(f"A worker's next() answered {type(value).__name__}"))
            self._cond.notify_all()
        self._poke()

    async def _failed(self, w: _Worker, error: BaseException) -> None:
        if self._is_loss(w, error):
            await self._lose(w, error)
        else:
            with self._cond:
                self._latch(error)

    def _latch(self, error: BaseException) -> None:
        """Keep the first error and cancel every call in flight (under the lock)."""
        if self._error is None:
            self._error = error
        for w in self._workers:
            for task in (w.pending, w.control):
                if task is not None and task is not asyncio.current_task(self._loop):
                    task.cancel()
            w.pending = w.control = None
        self._cond.notify_all()

    async def _lose(self, w: _Worker, error: BaseException) -> None:
        """Give a lost worker's capacity up and recover the groups it completed but never delivered."""
        with self._cond:
            if w.lost:
                return
            w.lost = True
            w.capacity = 0
            for task in (w.pending, w.control):
                if task is not None and task is not asyncio.current_task(self._loop):
                    task.cancel()
            w.pending = w.control = None
            capacity = sum(x.capacity for x in self._live())
            self._prefetch = min(self._prefetch, capacity)
            delivered = list(w.delivered)
        log.warning("Rollout worker %s was lost (%s); %d capacity left", w.handle.reader_id, error, capacity)
        self._spawn(self._close_lost(w))
        refs: list[RolloutGroupRef] = []
        try:
            if self.controller is not None:
                refs = await self._loop.run_in_executor(None, self._recover, w.handle.reader_id, delivered)
        except Exception as recover_error:
            with self._cond:
                self._latch(recover_error)
            return
        with self._cond:
            self._ready.extend(refs)
            if capacity == 0:
                self._latch(RuntimeError("All rollout workers are unavailable"))
            self._cond.notify_all()
        self._poke()

    def _recover(self, reader_id: str, delivered: list[int]) -> list[RolloutGroupRef]:
        receipts = self.controller.retire_reader(reader_id, delivered)
        root = str(rollout_store(self.config).store.backend.root)
        refs = [group_ref_from_receipt(receipt, root) for receipt in receipts]
        if refs:
            log.warning("Recovered %d accepted groups of lost worker %s", len(refs), reader_id)
        return refs

    async def _close_lost(self, w: _Worker) -> None:
        try:
            await asyncio.wait_for(resolve(w.handle.close(0.0)), self.close_seconds)
        except Exception as error:  # the worker is gone; closing it is a courtesy
            log.debug("Closing lost worker %s: %s", w.handle.reader_id, error)

    # ------------------------------------------------------------------ the caller's side

    def _raise_latched(self) -> None:
        if self._error is not None:
            raise self._error

    @property
    def capacity(self) -> int:
        """Groups the live workers can hold at once."""
        with self._cond:
            return sum(w.capacity for w in self._live())

    def live_readers(self) -> list[str]:
        """Reader ids of the workers not lost."""
        with self._cond:
            return [w.handle.reader_id for w in self._live()]

    def stats(self) -> dict[str, int]:
        """The collection window now: requests in flight, kept groups waiting, demand, prefetch, capacity."""
        with self._cond:
            return {
                "pending": sum(1 for w in self._workers if w.pending is not None),
                "ready": len(self._ready),
                "demand": self._demand,
                "prefetch": self._prefetch,
                "capacity": sum(w.capacity for w in self._live()),
            }

    def add_recovered(self, refs: Sequence[RolloutGroupRef]) -> None:
        """Put accepted groups recovered from the queue (resume) in front of the next batch."""
        with self._cond:
            self._ready.extendleft(reversed(list(refs)))
            self._cond.notify_all()
        self._poke()

    def generate(self, rollout_id: int, *, prefetch: int = 0) -> RolloutOutput:
        """Block until ``--rollout-batch-size`` kept groups are collected; finalise them.

        ``prefetch`` (at most the workers' capacity) lets results for the next step be
        collected ahead. Groups the dynamic filter rejected count as drops, never as fill.
        """
        size = self.config.rollout_batch_size
        if size is None:
            raise ValueError("--rollout-batch-size is required")
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"prefetch must be a non-negative integer, got {prefetch!r}")
        kept: list[RolloutGroupRef] = []
        with self._cond:
            self._raise_latched()
            if self._collecting:
                raise RuntimeError("A rollout batch is already being collected")
            self._collecting = True
            self._demand = size
            self._prefetch = min(prefetch, sum(w.capacity for w in self._live()))
            self._paused = False
            self._rollout_id = rollout_id
            self._poke()
            try:
                while len(kept) < size:
                    self._raise_latched()
                    if self._ready:
                        kept.append(self._ready.popleft())
                        self._demand -= 1
                        self._poke()
                        continue
                    self._cond.wait()
                drops = dict(self._drops)
                self._drops.clear()
            finally:
                self._collecting = False
                self._demand = 0
                self._poke()
        return finalize_groups(
            self.config,
            rollout_id,
            kept,
            hooks=self.hooks,
            controller=self.controller,
            metrics=drop_metrics(drops, len(kept)),
        )

    def pause(self, *, drain: bool = True) -> bool:
        """Stop admission and wait until every worker paused; answers whether it was paused already.

        With ``drain`` also wait for the results requested from workers, so everything in
        flight is durable (accepted, or back in the queue as a partial).
        """
        with self._cond:
            was_paused = self._paused
            self._paused = True
            self._poke()
            while True:
                self._raise_latched()
                live = self._live()
                settled = all(w.paused and w.control is None for w in live)
                if settled and (not drain or all(w.pending is None for w in live)):
                    return was_paused
                self._cond.wait()

    def pause_admission(self) -> bool:
        """Pause without waiting for requested results (before a weight update)."""
        return self.pause(drain=False)

    def resume_admission(self, was_paused: bool = False) -> None:
        """Resume after :meth:`pause_admission`, unless admission was paused before it."""
        if was_paused:
            return
        with self._cond:
            self._raise_latched()
            self._paused = False
            self._poke()

    def close(self) -> None:
        """Stop: wake every waiter, close the workers under one shared deadline, end the thread."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._latch(RuntimeError("Rollout scheduler is closed"))
            self._error = RuntimeError("Rollout scheduler is closed")  # whatever was latched before
        try:
            asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result()
        finally:
            asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result()
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()

    async def _stop(self) -> None:
        """End the background loop's own tasks so the loop closes with nothing pending."""
        with self._cond:
            self._stopping = True
        if self._wake is not None:
            self._wake.set()
        await asyncio.gather(self._main, return_exceptions=True)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _shutdown(self) -> None:
        deadline = self.clock() + self.close_seconds
        live = self._live()

        async def close_one(w: _Worker) -> BaseException | None:
            remaining = max(0.0, deadline - self.clock())
            try:
                await asyncio.wait_for(resolve(w.handle.close(remaining)), remaining or None)
            except Exception as error:
                log.warning("Closing rollout worker %s failed: %s", w.handle.reader_id, error)
                return error
            return None

        errors = [e for e in await asyncio.gather(*(close_one(w) for w in live)) if e is not None]
        if errors:
            raise errors[0]
