"""Fully asynchronous rollout across the nodes of a Ray cluster, and the startup storage probe.

This is the only module of straw that imports Ray (docs/ROLLOUT.md, "Running on a cluster"):

- :func:`controller_actor` runs the job's :class:`~straw.rollout.controller.QueueController`
  in a Ray actor pinned to the creating node; :class:`RayControllerClient` is its picklable
  client, which readers on any node use as their controller.
- :class:`GenerationWorker` is one node's generation actor: a queue reader of its own, a
  generator built on the node, and the slot loop of
  :class:`~straw.rollout.workers.SlotWorker`.
- :class:`DistributedRollout` places one worker on every alive node with a CPU, splits the
  total concurrency across them and collects rollout steps through the same
  :class:`~straw.rollout.scheduler.RolloutScheduler` that :class:`AsyncRollout` uses; a dead
  actor is the scheduler's worker-loss signal.
- :func:`check_rollout_storage` checks, once at startup, that every node reads and writes
  the same pool at the same absolute path.

Ray is imported eagerly; without it importing this module raises ``ModuleNotFoundError``
naming ``ray``. Tests and examples start Ray on 127.0.0.1 only.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import pickle
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

try:
    import ray
    from ray.exceptions import RayActorError
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
except ModuleNotFoundError as missing:  # pragma: no cover - exercised in a child without Ray
    raise ModuleNotFoundError(
        "straw.rollout.ray requires Ray: pip install 'straw[ray]'", name="ray"
    ) from missing

from ..protocol import RecordSetRef
from .collection import RolloutOutput
from .config import RolloutConfig
from .controller import ControllerClient, QueueController
from .hooks import Hooks
from .pool import private_store, probe_roundtrip, rollout_store
from .reader import QueueReaderConfig
from .refs import DiskPayloadRef, release_publications
from .runner import ScheduledRollout
from .scheduler import RolloutScheduler
from .workers import SlotWorker

__all__ = [
    "DistributedRollout",
    "GenerationWorker",
    "RayControllerClient",
    "check_rollout_storage",
    "controller_actor",
]

log = logging.getLogger("straw.rollout.ray")

#: Concurrent calls the controller actor serves (readers of every node share it).
CONTROLLER_CONCURRENCY = 4
#: Concurrent calls a generation worker serves: one control call, one next(), one more (versions).
WORKER_CONCURRENCY = 3

#: The controller methods a client may call: exactly the ControllerClient protocol.
CONTROLLER_METHODS = frozenset(
    name for name, value in vars(ControllerClient).items() if not name.startswith("_") and callable(value)
)


def _portable(error: BaseException) -> BaseException:
    """``error`` if it survives pickling (so the caller gets the same exception), else a RuntimeError."""
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")
    return error


def _this_node() -> str:
    return str(ray.get_runtime_context().get_node_id())


def _alive_nodes() -> list[dict[str, Any]]:
    """Ray's node table, alive nodes only (``ray.nodes`` is untyped)."""
    nodes: Callable[[], list[dict[str, Any]]] = ray.nodes
    return [n for n in nodes() if n.get("Alive")]


def _pinned(node_id: str) -> NodeAffinitySchedulingStrategy:
    return NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)


# --------------------------------------------------------------------------- the controller actor


class _ControllerServer:
    """The body of the controller actor: one QueueController, called by name."""

    def __init__(
        self,
        config: RolloutConfig,
        restore_plan: Any,
        dataset_factory: Any,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.controller = QueueController(
            config,
            dataset=dataset_factory,
            restore_plan=restore_plan,
            clock=clock if clock is not None else time.monotonic,
        )

    def config(self) -> RolloutConfig:
        return self.controller.config

    def call(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[bool, Any]:
        """``(True, value)`` or ``(False, exception)``: errors travel as values so they keep their text."""
        if name not in CONTROLLER_METHODS:
            return False, AttributeError(f"The controller has no method {name!r}")
        try:
            return True, getattr(self.controller, name)(*args, **kwargs)
        except Exception as error:
            return False, _portable(error)


_RemoteController: Any = ray.remote(_ControllerServer)


class RayControllerClient:
    """A job controller living in a Ray actor; implements ``ControllerClient`` and pickles.

    Every protocol method is one ``ray.get`` of the actor's call; an exception the
    controller raised is raised here as the same exception. ``close()`` closes the
    controller, then kills the actor. There is no failover: a dead actor means a restart.
    """

    def __init__(self, actor: Any, config: RolloutConfig) -> None:
        self.actor = actor
        self.config = config
        self._closed = False

    def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        ok, value = ray.get(self.actor.call.remote(name, args, kwargs))
        if not ok:
            raise value
        return value

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name not in CONTROLLER_METHODS:
            raise AttributeError(name)

        def method(*args: Any, **kwargs: Any) -> Any:
            return self._call(name, *args, **kwargs)

        method.__name__ = name
        return method

    def __getstate__(self) -> dict[str, Any]:
        return {"actor": self.actor, "config": self.config}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.actor, self.config, self._closed = state["actor"], state["config"], False

    def close(self) -> None:
        """Close the controller (its queue, writer and save-directory lock), then kill the actor."""
        if self._closed:
            return
        self._closed = True
        try:
            self._call("close")
        finally:
            ray.kill(self.actor, no_restart=True)


def controller_actor(
    config: RolloutConfig,
    *,
    restore_plan: Any = None,
    dataset_factory: Any = None,
    clock: Callable[[], float] | None = None,
) -> RayControllerClient:
    """Start the job's controller in a 0-CPU actor pinned to this node and return its client.

    ``dataset_factory`` is a zero-argument callable building the ``Dataset`` on the actor
    (or a dataset itself, or None for ``--prompt-data``); it is pickled to the actor.
    ``clock`` (picklable; default ``time.monotonic`` on the actor) drives the queue's leases,
    as ``QueueController``'s does: tests move it forward to expire leases without waiting.
    """
    if not isinstance(config, RolloutConfig):
        raise TypeError(f"config= is a RolloutConfig, got {type(config).__name__}")
    actor = _RemoteController.options(
        num_cpus=0,
        max_concurrency=CONTROLLER_CONCURRENCY,
        max_restarts=0,
        scheduling_strategy=_pinned(_this_node()),
    ).remote(config, restore_plan, dataset_factory, clock)
    try:
        bound = ray.get(actor.config.remote())
    except BaseException:
        ray.kill(actor, no_restart=True)
        raise
    return RayControllerClient(actor, bound)


# --------------------------------------------------------------------------- generation workers


class GenerationWorker:
    """One node's generation actor: its own reader, a generator built here, the slot loop.

    All methods are coroutines, so the actor is an asyncio actor: the slot loop runs on the
    actor's event loop, and reads and publishes run in its threads. The serving weight
    version is set by the driver (:meth:`set_weight_version`).
    """

    def __init__(
        self,
        config: RolloutConfig,
        reader_config: QueueReaderConfig,
        generator_factory: Callable[[], Any],
        *,
        hooks: Hooks | None,
        slots: int,
        weight_version: str | None = None,
    ) -> None:
        self.version = weight_version
        self.reader = reader_config.open()
        try:
            self.generator = generator_factory()
            self.worker = SlotWorker(
                config,
                self.reader,
                self.generator,
                hooks=hooks,
                slots=slots,
                weight_version=lambda: self.version,
                owns_reader=True,
            )
        except BaseException:
            self.reader.close()
            raise

    async def ready(self) -> dict[str, Any]:
        """Where the worker runs and what it sees: reader id, slots, node id, dataset size."""
        loop = asyncio.get_running_loop()  # the controller call blocks: keep it off the event loop
        configuration = await loop.run_in_executor(None, self.reader.controller.configuration)
        size = int(configuration["dataset_size"])
        return {
            "reader_id": self.worker.reader_id,
            "capacity": self.worker.capacity,
            "node_id": _this_node(),
            "dataset_size": size,
        }

    async def start(self, rollout_id: int) -> None:
        await self.worker.start(rollout_id)

    async def pause(self) -> None:
        await self.worker.pause()

    async def next(self) -> Any:
        return await self.worker.next()

    async def set_weight_version(self, version: str | None) -> None:
        """The version recorded for tokens generated from now on."""
        self.version = None if version is None else str(version)

    async def call_generator(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Call a method of this worker's generator (e.g. to load new weights); awaited if async."""
        result = getattr(self.generator, name)(*args, **kwargs)
        if inspect.isawaitable(result):
            result = await result
        return result

    async def close(self, deadline: float | None = None) -> None:
        """Make in-flight work durable (within ``deadline`` seconds), close the reader and generator."""
        await self.worker.close(deadline)
        closer = getattr(self.generator, "close", None)
        if callable(closer):
            done = closer()
            if inspect.isawaitable(done):
                await done


_RemoteWorker: Any = ray.remote(GenerationWorker)


class _RayWorker:
    """The scheduler's handle of one generation actor: its calls answer awaitable ObjectRefs."""

    lost_errors: tuple[type[BaseException], ...] = (RayActorError,)

    def __init__(self, actor: Any, reader_id: str, capacity: int) -> None:
        self.actor = actor
        self._reader_id = reader_id
        self._capacity = capacity

    @property
    def reader_id(self) -> str:
        return self._reader_id

    @property
    def capacity(self) -> int:
        return self._capacity

    def start(self, rollout_id: int) -> Any:
        return self.actor.start.remote(rollout_id)

    def pause(self) -> Any:
        return self.actor.pause.remote()

    def next(self) -> Any:
        return self.actor.next.remote()

    def close(self, deadline: float) -> Any:
        return self._close(deadline)

    async def _close(self, deadline: float) -> None:
        try:
            await self.actor.close.remote(deadline)
        finally:
            ray.kill(self.actor, no_restart=True)


def split_concurrency(total_concurrency: int, n_samples_per_prompt: int, nodes: int) -> list[int]:
    """Groups per node: ``total // n`` groups spread evenly, the first nodes taking one more."""
    if isinstance(total_concurrency, bool) or not isinstance(total_concurrency, int) or total_concurrency < 1:
        raise ValueError(f"total_concurrency must be a positive integer, got {total_concurrency!r}")
    groups = total_concurrency // n_samples_per_prompt
    if nodes < 1 or groups < nodes:
        raise ValueError("Distributed rollout needs concurrency for at least one prompt group per node")
    per, extra = divmod(groups, nodes)
    return [per + 1 if i < extra else per for i in range(nodes)]


def generation_nodes() -> list[dict[str, Any]]:
    """Alive Ray nodes with at least one CPU, sorted by (address, node id)."""
    nodes = [n for n in _alive_nodes() if n.get("Resources", {}).get("CPU", 0) >= 1]
    return sorted(nodes, key=lambda n: (str(n.get("NodeManagerAddress")), str(n["NodeID"])))


class DistributedRollout(ScheduledRollout):
    """Fully asynchronous generation with one :class:`GenerationWorker` per Ray node.

    ``source`` is the job's ``QueueDataSource`` over a :class:`RayControllerClient`;
    ``generator_factory`` (picklable, no arguments) builds each worker's generator on its
    node. ``generate``, ``pause_admission``, ``resume_admission`` and ``close`` are the
    scheduler's, as in ``AsyncRollout``; :meth:`set_weight_version` tells every worker
    which policy serves now and :meth:`call_generators` reaches every worker's generator.
    """

    def __init__(
        self,
        config: RolloutConfig,
        source: Any,
        generator_factory: Callable[[], Any],
        *,
        hooks: Hooks | None = None,
        total_concurrency: int,
        weight_version: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.hooks = hooks if hooks is not None else Hooks.from_config(config)
        if self.hooks.all_samples_process is not None:
            raise ValueError(
                "--rollout-all-samples-process-path is not supported by distributed fully-async rollout"
            )
        if not callable(generator_factory):
            raise TypeError(f"generator_factory must be callable, got {type(generator_factory).__name__}")
        if not callable(getattr(source, "reader_config", None)):
            raise TypeError(
                "source must be a QueueDataSource (it hands out the workers' reader configurations)"
            )
        self.controller = source.controller
        if not isinstance(self.controller, RayControllerClient):
            raise TypeError(
                "DistributedRollout needs a data source over a RayControllerClient (controller_actor)"
            )
        nodes = generation_nodes()
        slots = split_concurrency(total_concurrency, config.n_samples_per_prompt, len(nodes))
        self.actors: list[Any] = []
        self.slots = slots
        self.node_ids = [str(n["NodeID"]) for n in nodes]
        try:
            for i, (node, count) in enumerate(zip(self.node_ids, slots, strict=True)):
                self.actors.append(
                    _RemoteWorker.options(
                        num_cpus=1,
                        max_concurrency=WORKER_CONCURRENCY,
                        max_restarts=0,
                        max_task_retries=0,
                        scheduling_strategy=_pinned(node),
                    ).remote(
                        config,
                        source.reader_config(f"fully_async_{i}"),
                        generator_factory,
                        hooks=hooks,
                        slots=count,
                        weight_version=weight_version,
                    )
                )
            ready = ray.get([actor.ready.remote() for actor in self.actors])
            sizes = [int(r["dataset_size"]) for r in ready]
            if any(size != len(source) for size in sizes):
                raise ValueError(f"Replicated datasets differ in size: owner={len(source)}, workers={sizes}")
            self.workers_info = ready
            handles = [
                _RayWorker(a, str(r["reader_id"]), int(r["capacity"]))
                for a, r in zip(self.actors, ready, strict=True)
            ]
            self.scheduler = RolloutScheduler(
                handles, config=config, controller=self.controller, hooks=self.hooks, clock=clock
            )
        except BaseException:
            for actor in self.actors:
                ray.kill(actor, no_restart=True)
            raise
        self._recovered = False
        log.info("Distributed rollout: %d workers with %s groups each", len(slots), slots)

    def generate(self, rollout_id: int, *, prefetch: int | None = None) -> RolloutOutput:
        """Block until the step's groups are kept (recovered groups first, in resume mode).

        ``prefetch`` defaults to one less than the live workers: then every worker can hold a
        request while the step still needs a group, so a fast worker fills the batch while a
        slow one is still generating (with less, a slow worker may hold the step's last
        request until it finishes).
        """
        if prefetch is None:
            prefetch = max(0, len(self.scheduler.live_readers()) - 1)
        return super().generate(rollout_id, prefetch=prefetch)

    def _broadcast(self, calls: Sequence[Any]) -> list[Any]:
        """Results of one call per worker; a dead worker's is None (the scheduler handles the loss)."""
        results: list[Any] = []
        for call in calls:
            try:
                results.append(ray.get(call))
            except RayActorError as error:
                log.warning("A rollout worker is gone: %s", error)
                results.append(None)
        return results

    def set_weight_version(self, version: str | None) -> None:
        """Record ``version`` for every token generated from now on, on every worker."""
        self._broadcast([actor.set_weight_version.remote(version) for actor in self.actors])

    def call_generators(self, name: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call ``name`` on every worker's generator (None for a lost worker)."""
        return self._broadcast([actor.call_generator.remote(name, args, kwargs) for actor in self.actors])

    def close(self) -> None:
        """Close the scheduler (workers make their in-flight work durable), then the actors."""
        try:
            self.scheduler.close()
        finally:
            for actor in self.actors:
                ray.kill(actor, no_restart=True)


# --------------------------------------------------------------------------- the storage probe


def _answer_probe(config: RolloutConfig, marker_ref: RecordSetRef, root: str) -> RecordSetRef:
    """On one node: load the marker through the local mount and publish it back."""
    value = DiskPayloadRef(marker_ref, root).load()
    bound = private_store(config)
    try:
        return bound.codec.publish(
            {"answer": value, "node": _this_node()}, submission_id=f"probe-answer:{uuid.uuid4().hex}"
        )
    finally:
        bound.store.close()


_remote_probe: Any = ray.remote(_answer_probe)


def check_rollout_storage(config: RolloutConfig, *, timeout: float = 60.0) -> None:
    """Check that every Ray node with CPUs or GPUs shares this job's pool (call once at startup).

    A marker is published here; a 0-CPU task pinned to each node loads it through that node's
    mount and publishes it back; each answer is loaded here and compared. Any failure raises
    ``RuntimeError("All rollout/training nodes must share the run at --rollout-data-dir=<dir>")``
    chained to the cause.
    """
    where = config.rollout_data_dir
    published: list[RecordSetRef] = []
    try:
        root = where = str(rollout_store(config).store.backend.root)
        marker = uuid.uuid4().hex
        marker_ref = probe_roundtrip(config, marker)
        published.append(marker_ref)
        nodes = [
            n for n in _alive_nodes() if any(n.get("Resources", {}).get(r, 0) > 0 for r in ("CPU", "GPU"))
        ]
        calls = [
            _remote_probe.options(
                num_cpus=0, max_retries=0, scheduling_strategy=_pinned(str(n["NodeID"]))
            ).remote(config, marker_ref, root)
            for n in nodes
        ]
        answers = ray.get(calls, timeout=timeout)
        expected = {"probe": marker}
        for answer in answers:
            if DiskPayloadRef(answer, root).load()["answer"] != expected:
                raise ValueError("Rollout storage probe content differs across nodes")
    except Exception as error:
        raise RuntimeError(
            f"All rollout/training nodes must share the run at --rollout-data-dir={where}"
        ) from error
    finally:
        if published:
            release_publications(config, published)
