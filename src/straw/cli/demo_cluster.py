"""The Ray backend of ``straw demo``: a local multi-node cluster on 127.0.0.1.

``straw.rollout`` imports Ray only in ``straw.rollout.ray``, so the demo job
(``straw.rollout.demo.job``) takes its Ray parts from here, through its ``Backend`` seam:

- :func:`local_ray_cluster`: ``ray.cluster_utils.Cluster`` with ``nodes`` logical nodes of
  :data:`NODE_CPUS` CPUs each, every address on 127.0.0.1, no dashboard;
- the trainer ranks as Ray actors (1 CPU each, spread over the nodes);
- the weight board as a named 0-CPU actor that every node's generator asks;
- generation by ``straw.rollout.ray.DistributedRollout`` (one worker per node, each building
  its engine with :func:`worker_generator`), or by an ``AsyncRollout`` in the driver when that
  module is not installed.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any, cast

from straw.rollout.config import RolloutConfig
from straw.rollout.demo.engines import SyncedGenerator, WeightBoard
from straw.rollout.demo.job import DemoSettings, LocalGeneration, Ranks, TrainerRank, inner_generator
from straw.rollout.refs import DiskPayloadRef

__all__ = ["BOARD_ACTOR", "NODE_CPUS", "RAY_NAMESPACE", "RayBackend", "local_ray_cluster", "worker_generator"]

log = logging.getLogger("straw.cli.demo_cluster")

#: Name of the Ray actor that holds the newest weights (in namespace :data:`RAY_NAMESPACE`).
BOARD_ACTOR = "straw-demo-weights"
RAY_NAMESPACE = "straw-demo"
#: Logical CPUs per Ray node: one generation worker and room for a trainer rank.
NODE_CPUS = 2


@contextmanager
def local_ray_cluster(nodes: int) -> Iterator[Any]:
    """A Ray cluster of ``nodes`` logical nodes on 127.0.0.1, connected; shut down afterwards."""
    # Ray replaces a loopback bootstrap address by the machine's outward address unless it
    # believes it runs without cluster support; this keeps every connection on 127.0.0.1.
    # It is read when Ray is imported, and the cluster's processes inherit it.
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": NODE_CPUS, "node_ip_address": "127.0.0.1", "include_dashboard": False},
    )
    try:
        for _ in range(nodes - 1):
            cluster.add_node(num_cpus=NODE_CPUS, node_ip_address="127.0.0.1")
        ray.init(address=cluster.address, namespace=RAY_NAMESPACE, log_to_driver=False)
        try:
            yield ray
        finally:
            ray.shutdown()
    finally:
        cluster.shutdown()  # type: ignore[no-untyped-call]


@contextmanager
def connected(address: str) -> Iterator[Any]:
    """Connected to the Ray cluster at ``address`` (on 127.0.0.1), disconnected afterwards."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # as in local_ray_cluster
    import ray

    ray.init(address=address, namespace=RAY_NAMESPACE, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


class BoardActor:
    """The weight board as a Ray actor: ``post`` from the driver, ``current`` from the generators."""

    def __init__(self) -> None:
        self.board = WeightBoard(-1)

    def post(self, version: int, ref: DiskPayloadRef | None) -> None:
        self.board.post(version, ref)

    def current(self) -> tuple[int, DiskPayloadRef | None]:
        return self.board.current()


class RemoteBoard:
    """The driver's and the local generator's view of the board actor."""

    def __init__(self, ray: Any, actor: Any) -> None:
        self.ray, self.actor = ray, actor

    def post(self, version: int, ref: DiskPayloadRef | None) -> None:
        self.ray.get(self.actor.post.remote(version, ref))

    def current(self) -> tuple[int, DiskPayloadRef | None]:
        return cast("tuple[int, DiskPayloadRef | None]", self.ray.get(self.actor.current.remote()))


def worker_generator(settings_values: dict[str, Any]) -> SyncedGenerator:
    """Built on each generation worker: its engine, synced with the board actor."""
    import ray

    settings = DemoSettings.from_dict(settings_values)
    board = RemoteBoard(ray, ray.get_actor(BOARD_ACTOR, namespace=RAY_NAMESPACE))
    inner, load = inner_generator(settings)
    return SyncedGenerator(inner, board.current, load, version=-1)


class RayGeneration:
    """``DistributedRollout``: one generation worker per Ray node, each with its own engine."""

    def __init__(self, settings: DemoSettings, config: RolloutConfig, source: Any, runner: Any) -> None:
        factory = functools.partial(worker_generator, dataclasses.asdict(settings))
        self.runner = runner(
            config,
            source,
            factory,
            total_concurrency=settings.slots * settings.nodes * settings.samples_per_prompt,
        )

    def generate(self, rollout_id: int, *, prefetch: int = 0) -> Any:
        return self.runner.generate(rollout_id, prefetch=prefetch)

    def pause_admission(self) -> bool:
        return bool(self.runner.pause_admission())

    def resume_admission(self, was_paused: bool = False) -> None:
        self.runner.resume_admission(was_paused)

    def load_weights(self, version: int, ref: DiskPayloadRef) -> bool:
        """Each worker's generator loads the posted weights itself, before its next group."""
        return False

    def close(self) -> None:
        self.runner.close()


class RayBackend:
    """The demo's parts on a local Ray cluster (see the module docstring)."""

    def __init__(self, nodes: int, address: str | None = None) -> None:
        self._stack = ExitStack()
        if address is None:
            self.ray = self._stack.enter_context(local_ray_cluster(nodes))
            self.nodes = nodes
        else:  # an existing cluster (the tests share one): its nodes are the job's
            self.ray = self._stack.enter_context(connected(address))
            self.nodes = sum(1 for n in self.ray.nodes() if n.get("Alive"))

    def ranks(self, settings: DemoSettings) -> Ranks:
        actor = self.ray.remote(num_cpus=1, max_restarts=0)(TrainerRank)
        handles = [
            actor.options(scheduling_strategy="SPREAD").remote(rank, settings.seed)
            for rank in range(settings.dp_size)
        ]
        return Ranks(handles, self.ray)

    def board(self) -> RemoteBoard:
        actor = self.ray.remote(num_cpus=0)(BoardActor).options(name=BOARD_ACTOR).remote()
        return RemoteBoard(self.ray, actor)

    def generation(self, settings: DemoSettings, config: RolloutConfig, source: Any, board: Any) -> Any:
        try:
            from straw.rollout.ray import DistributedRollout  # type: ignore[import-not-found,unused-ignore]
        except ImportError:  # the distributed runner is not installed: generate in the driver
            log.warning("straw.rollout.ray is unavailable; generating in the driver process")
            return LocalGeneration(settings, config, source, board)
        return RayGeneration(settings, config, source, DistributedRollout)

    def close(self) -> None:
        self._stack.close()
