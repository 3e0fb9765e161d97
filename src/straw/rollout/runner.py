"""Rollout production: the synchronous and the fully asynchronous runner, and what they share.

- :class:`SyncRollout` generates one rollout step at a time in the caller's event loop: it
  takes just as many groups as the step still needs, generates them concurrently and
  publishes each kept group the moment it completes (docs/ROLLOUT.md, "Runners").
- :class:`AsyncRollout` keeps ``slots`` groups generating in the background
  (:class:`~straw.rollout.workers.SlotWorker` on a thread of its own) and collects steps
  through a :class:`~straw.rollout.scheduler.RolloutScheduler`, the collector the
  distributed runner shares.
- :func:`finalize_groups` and :func:`accept_raw_rollout` turn a step's kept groups into an
  accepted raw collection.

In resume mode both runners first use the accepted groups the interrupted run left behind
(``recover_pending_rollout``), once, before generating anything new.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import time
from collections.abc import Callable
from typing import Any

from .collection import (
    RolloutOutput,
    accept_raw_rollout,
    finalize_groups,
    group_ref_from_receipt,
    receipt_positions,
    sort_groups,
)
from .config import RolloutConfig
from .hooks import Hooks
from .pool import rollout_store, run_io
from .refs import RolloutGroupRef, group_lease, load_groups
from .sample import group_stage
from .scheduler import RolloutScheduler, drop_metrics
from .workers import (
    DroppedGroup,
    LocalWorker,
    RolloutReader,
    SlotWorker,
    WorkerHandle,
    WorkerLost,
    generate_group,
    is_aborted,
)

__all__ = [
    "ALL_SAMPLES_PROCESS_REASON",
    "AsyncRollout",
    "DroppedGroup",
    "LocalWorker",
    "RolloutOutput",
    "RolloutScheduler",
    "ScheduledRollout",
    "SlotWorker",
    "SyncRollout",
    "WorkerHandle",
    "WorkerLost",
    "accept_raw_rollout",
    "finalize_groups",
    "recovered_groups",
]

log = logging.getLogger("straw.rollout.runner")

#: Disposition reason of accepted groups the legacy all-samples hook removed.
ALL_SAMPLES_PROCESS_REASON = "rollout_all_samples_process"


def _batch_size(config: RolloutConfig) -> int:
    if config.rollout_batch_size is None:
        raise ValueError("--rollout-batch-size is required")
    return config.rollout_batch_size


def recovered_groups(config: RolloutConfig, controller: Any) -> list[RolloutGroupRef]:
    """The accepted groups an interrupted run left (resume mode only; empty otherwise)."""
    if controller is None or controller.identity().get("mode") != "resume":
        return []
    root = str(rollout_store(config).store.backend.root)
    refs = [group_ref_from_receipt(r, root) for r in controller.recover_pending_rollout()]
    if refs:
        log.info("Resuming with %d accepted groups of the interrupted rollout", len(refs))
    return refs


class SyncRollout:
    """Generates rollout steps one at a time in the caller's event loop.

    ``await generate(rollout_id)`` returns the step's finalised output once
    ``--rollout-batch-size`` groups were kept. Groups the dynamic filter rejects are
    discarded and replaced; aborted groups go back to the queue as partials and are
    replaced too.
    """

    def __init__(
        self,
        config: RolloutConfig,
        reader: RolloutReader,
        generator: Any,
        *,
        hooks: Hooks | None = None,
        weight_version: Callable[[], Any] = lambda: None,
    ) -> None:
        if not callable(generator):
            raise TypeError(f"generator must be callable, got {type(generator).__name__}")
        self.config = config
        self.reader = reader
        self.generator = generator
        self.hooks = hooks if hooks is not None else Hooks.from_config(config)
        self.weight_version = weight_version
        self._recovered: collections.deque[RolloutGroupRef] | None = None

    @property
    def controller(self) -> Any:
        return self.reader.controller

    async def _take(self, count: int) -> list[Any]:
        take = getattr(self.reader, "get_samples_async", None)
        if take is not None:
            return list(await take(count))
        loop = asyncio.get_running_loop()
        return list(await loop.run_in_executor(None, self.reader.get_samples, count))

    async def _one(self, group: Any, rollout_id: int) -> Any:
        """One group through generation: a kept group's reference, a DroppedGroup, or None (aborted)."""
        if group_stage(group) != "ready":
            try:
                group = await generate_group(group, self.generator, self.weight_version)
            except Exception as error:
                await self._fail(group, error)
                raise
            if is_aborted(group):
                await run_io(self.config, self.reader.add_samples, [group])
                return None
        verdict = self.hooks.filter_group(group, self.config)
        if not verdict.keep:
            reason = verdict.reason or "filtered"
            await run_io(self.config, self.reader.discard_group, group, reason)
            return DroppedGroup(reason)
        publish = functools.partial(self.reader.publish_group, rollout_id=rollout_id)
        return await run_io(self.config, publish, group)

    async def _fail(self, group: Any, error: Exception) -> None:
        lease = group_lease(group)
        if lease is not None:
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, self.controller.fail, lease, f"{type(error).__name__}: {error}")

    async def generate(self, rollout_id: int) -> RolloutOutput:
        """Generate one rollout step; the output names its kept groups in index order."""
        size = _batch_size(self.config)
        if self._recovered is None:
            self._recovered = collections.deque(recovered_groups(self.config, self.controller))
        kept: list[Any] = []
        while self._recovered and len(kept) < size:
            kept.append(self._recovered.popleft())
        drops: collections.Counter[str] = collections.Counter()
        running: dict[asyncio.Future[Any], Any] = {}
        try:
            while len(kept) < size:
                need = size - len(kept) - len(running)
                if need > 0:
                    groups = await self._take(need)
                    if not groups and not running:
                        raise RuntimeError(
                            f"The queue supplied no rollout groups ({len(kept)} of {size} kept)"
                        )
                    running.update((asyncio.ensure_future(self._one(g, rollout_id)), g) for g in groups)
                done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    running.pop(task)
                    outcome = task.result()
                    if isinstance(outcome, DroppedGroup):
                        drops[outcome.reason] += 1
                    elif outcome is not None:
                        kept.append(outcome)
        finally:
            if running:
                await self._abandon(running)
        metrics = drop_metrics(dict(drops), len(kept))
        loop = asyncio.get_running_loop()
        if self.hooks.all_samples_process is not None:
            return await loop.run_in_executor(None, self._all_samples, kept, rollout_id, metrics)
        return await loop.run_in_executor(
            None,
            functools.partial(
                finalize_groups,
                self.config,
                rollout_id,
                kept,
                hooks=self.hooks,
                controller=self.controller,
                metrics=metrics,
            ),
        )

    async def _abandon(self, running: dict[asyncio.Future[Any], Any]) -> None:
        """After a failure, stop the other generations and return their tasks unspent."""
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        leases = [lease for group in running.values() if (lease := group_lease(group)) is not None]
        if leases:
            loop = asyncio.get_running_loop()
            try:
                await loop.run_in_executor(None, self.controller.release, leases)
            except Exception as error:  # the original failure is what the caller needs to see
                log.warning("Could not release %d abandoned groups: %s", len(leases), error)

    def _all_samples(self, kept: list[Any], rollout_id: int, metrics: dict[str, Any]) -> RolloutOutput:
        """Run the legacy hook once on the index-sorted loaded groups and keep its edits."""
        groups = load_groups(sort_groups(kept))
        before = receipt_positions(groups)
        hook = self.hooks.all_samples_process
        if hook is None:  # pragma: no cover - the caller checked
            raise ValueError("no all_samples_process hook")
        hook(groups, self.config, self.reader)
        gone = sorted(before - receipt_positions(groups))
        output = finalize_groups(
            self.config, rollout_id, groups, hooks=self.hooks, controller=self.controller, metrics=metrics
        )
        if gone:
            self.controller.record_dispositions(gone, ALL_SAMPLES_PROCESS_REASON)
        return output


class ScheduledRollout:
    """What the fully asynchronous runners share: a scheduler in front, recovered groups first.

    Subclasses set ``config``, ``controller`` and ``scheduler`` (and ``_recovered = False``).
    """

    config: RolloutConfig
    controller: Any
    scheduler: RolloutScheduler
    _recovered: bool

    def generate(self, rollout_id: int, *, prefetch: int = 0) -> RolloutOutput:
        """Block until the step's groups are kept (recovered groups first, in resume mode)."""
        if not self._recovered:
            self._recovered = True
            self.scheduler.add_recovered(recovered_groups(self.config, self.controller))
        return self.scheduler.generate(rollout_id, prefetch=prefetch)

    def pause(self, *, drain: bool = True) -> bool:
        return self.scheduler.pause(drain=drain)

    def pause_admission(self) -> bool:
        return self.scheduler.pause_admission()

    def resume_admission(self, was_paused: bool = False) -> None:
        self.scheduler.resume_admission(was_paused)


class AsyncRollout(ScheduledRollout):
    """Fully asynchronous generation in this process: ``slots`` groups generating at all times.

    One :class:`SlotWorker` on a thread of its own feeds a :class:`RolloutScheduler`;
    ``generate``, ``pause_admission``, ``resume_admission`` and ``close`` are the
    scheduler's. ``source`` is a ``QueueDataSource`` (the worker then reads through a reader
    of its own, ``fully_async_0``) or a reader used as it is.
    """

    def __init__(
        self,
        config: RolloutConfig,
        source: Any,
        generator: Any,
        *,
        hooks: Hooks | None = None,
        slots: int,
        weight_version: Callable[[], Any] = lambda: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.hooks = hooks if hooks is not None else Hooks.from_config(config)
        opener = getattr(source, "reader_config", None)
        owns = callable(opener)
        reader = opener("fully_async_0").open() if owns else source  # type: ignore[misc]
        self.reader = reader
        self.controller = reader.controller
        try:
            self.worker = SlotWorker(
                config,
                reader,
                generator,
                hooks=self.hooks,
                slots=slots,
                weight_version=weight_version,
                owns_reader=owns,
            )
            self.handle = LocalWorker(self.worker)
            self.scheduler = RolloutScheduler(
                [self.handle], config=config, controller=self.controller, hooks=self.hooks, clock=clock
            )
        except BaseException:
            if owns:
                reader.close()
            raise
        self._recovered = False

    def close(self) -> None:
        """Close the scheduler (the worker makes its in-flight work durable first)."""
        try:
            self.scheduler.close()
        finally:
            self.handle.join()
