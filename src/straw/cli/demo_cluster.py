"""The Ray backend of ``straw demo``: a local multi-node cluster on 127.0.0.1.

``straw.rollout`` imports Ray only in ``straw.rollout.ray``, so the demo job
(``straw.rollout.demo.job``) takes its Ray parts from here, through its ``Backend`` seam:

- :func:`local_ray_cluster`: ``ray.cluster_utils.Cluster`` with ``nodes`` logical nodes of
  :data:`NODE_CPUS` CPUs each, every address on 127.0.0.1, no dashboard;
- the job's controller in a 0-CPU actor on the driver's node (``controller_actor``), after
  ``check_rollout_storage`` has seen the pool from every node;
- the trainer ranks as Ray actors (1 CPU each, spread over the nodes);
- generation by ``straw.rollout.ray.DistributedRollout``: one worker per node, each building
  its engine with :func:`worker_generator`; new weights reach them as a pool reference
  (``call_generators("load_posted", version, ref)``), never as tensors through Ray.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

from straw.rollout.checkpoint import RestorePlan
from straw.rollout.config import RolloutConfig
from straw.rollout.demo.engines import SyncedGenerator, WeightBoard
from straw.rollout.demo.job import DemoSettings, Ranks, TrainerRank, inner_generator
from straw.rollout.refs import DiskPayloadRef

__all__ = ["NODE_CPUS", "RAY_NAMESPACE", "RayBackend", "local_ray_cluster", "worker_generator"]

log = logging.getLogger("straw.cli.demo_cluster")

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


def worker_generator(settings_values: dict[str, Any]) -> SyncedGenerator:
    """Built on each generation worker: its engine, loading the weights the driver sends it."""
    settings = DemoSettings.from_dict(settings_values)
    inner, load = inner_generator(settings)
    # Nothing to poll: the driver calls load_posted on every worker while admission is paused.
    return SyncedGenerator(inner, lambda: (-1, None), load, version=-1)


class RayGeneration:
    """``DistributedRollout``: one generation worker per Ray node, each with its own engine."""

    def __init__(self, settings: DemoSettings, config: RolloutConfig, source: Any, runner: Any) -> None:
        factory = functools.partial(worker_generator, dataclasses.asdict(settings))
        self.runner = runner(
            config,
            source,
            factory,
            total_concurrency=settings.slots * settings.nodes * settings.samples_per_prompt,
            weight_version=None,
        )

    def generate(self, rollout_id: int, *, prefetch: int = 0) -> Any:
        return self.runner.generate(rollout_id, prefetch=prefetch)

    def pause_admission(self) -> bool:
        return bool(self.runner.pause_admission())

    def resume_admission(self, was_paused: bool = False) -> None:
        self.runner.resume_admission(was_paused)

    def load_weights(self, version: int, ref: DiskPayloadRef) -> bool:
        """Every worker loads the weights from the pool (admission is paused meanwhile)."""
        self.runner.call_generators("load_posted", version, ref)
        self.runner.set_weight_version(str(version))
        return True

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

    def controller(self, config: RolloutConfig, plan: RestorePlan, dataset: Callable[[], Any]) -> Any:
        """The job's controller in a 0-CPU actor on this node; every node's mount is probed first."""
        from straw.rollout.ray import check_rollout_storage, controller_actor

        check_rollout_storage(config)
        return controller_actor(config, restore_plan=plan, dataset_factory=dataset)

    def board(self) -> WeightBoard:
        return WeightBoard(-1)  # the driver's record; workers get the weights by load_weights

    def generation(self, settings: DemoSettings, config: RolloutConfig, source: Any, board: Any) -> Any:
        from straw.rollout.ray import DistributedRollout

        return RayGeneration(settings, config, source, DistributedRollout)

    def close(self) -> None:
        self._stack.close()
