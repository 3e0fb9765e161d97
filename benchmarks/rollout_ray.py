"""Distributed rollout benchmarks on a local Ray cluster (127.0.0.1): worker scaling and the pause.

``scaling``: a simulated engine of fixed latency (asyncio timers, no model) on every node;
groups per second of ``DistributedRollout`` with 1, 2 and 3 nodes, each node with the same
slots, against the linear ideal (one node's rate times the nodes).

``pause``: the weight-update pause with 3 nodes. ``pause_admission()`` returns once every
worker's in-flight work is durable (accepted, or back in the queue as a partial); its time
minus the engine's own abort latency is the layer's cost. After ``resume_admission()`` the
time to the first generator call on any worker (the first new group entering generation)
is measured by the engines themselves (wall clock, same host).

    .venv/bin/python benchmarks/rollout_ray.py scaling [--latency 0.5 --slots 8 --steps 4]
    .venv/bin/python benchmarks/rollout_ray.py pause [--rounds 20 --abort-latency 0.05]

Prints one JSON document. Needs the ``ray`` extra.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # keep ray.init on the loopback address

import ray
from ray.cluster_utils import Cluster

from straw.rollout.config import RolloutConfig
from straw.rollout.demo.simulated import SimulatedEngine
from straw.rollout.ray import DistributedRollout, controller_actor
from straw.rollout.reader import QueueDataSource


class TimedEngine(SimulatedEngine):
    """A SimulatedEngine that records the wall-clock start of every call."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.starts: list[float] = []

    async def __call__(self, group: Any, *, weight_version: str | None) -> Any:
        self.starts.append(time.time())
        return await super().__call__(group, weight_version=weight_version)

    def first_start_after(self, moment: float) -> float | None:
        return min((t for t in self.starts if t >= moment), default=None)


def start_cluster(nodes: int) -> Cluster:
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "node_ip_address": "127.0.0.1", "include_dashboard": False},
    )
    for _ in range(nodes - 1):
        cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1")
    ray.init(address=cluster.address, _node_ip_address="127.0.0.1", log_to_driver=False)
    cluster.wait_for_nodes()
    return cluster


@contextlib.contextmanager
def distributed(nodes: int, args: argparse.Namespace, batch: int, engine: Any) -> Iterator[tuple[Any, Any]]:
    """A cluster of ``nodes``, a job over a temporary pool and its DistributedRollout; all closed after."""
    cluster = start_cluster(nodes)
    try:
        with tempfile.TemporaryDirectory(dir=args.dir) as pool:
            config = RolloutConfig.from_args(SimpleNamespace(rollout_data_dir=pool, rollout_batch_size=batch))
            client = controller_actor(
                config, dataset_factory=[{"input": f"prompt {i}"} for i in range(100_000)]
            )
            source = QueueDataSource(client.config, controller=client)
            rollout = DistributedRollout(
                client.config, source, engine, total_concurrency=args.slots * nodes, weight_version="0"
            )
            try:
                yield client, rollout
            finally:
                rollout.close()
                source.close()
                client.close()
    finally:
        ray.shutdown()
        cluster.shutdown()


def scaling_run(nodes: int, args: argparse.Namespace) -> dict[str, Any]:
    engine = functools.partial(
        SimulatedEngine, latency=args.latency, max_concurrency=args.slots, response_length=16
    )
    with distributed(nodes, args, args.slots * nodes, engine) as (_, rollout):
        rollout.generate(0)  # warm up: workers started, first reads done
        begin = time.perf_counter()
        for step in range(1, args.steps + 1):
            rollout.generate(step)
        elapsed = time.perf_counter() - begin
    groups = args.steps * args.slots * nodes
    return {"nodes": nodes, "groups": groups, "seconds": round(elapsed, 3), "groups_per_s": groups / elapsed}


def scaling(args: argparse.Namespace) -> dict[str, Any]:
    runs = [scaling_run(n, args) for n in args.nodes]
    one = next((r["groups_per_s"] for r in runs if r["nodes"] == 1), None)
    for run in runs:
        run["ideal_groups_per_s"] = args.slots / args.latency * run["nodes"]
        if one is not None:
            run["vs_linear"] = round(run["groups_per_s"] / (one * run["nodes"]), 3)
    return {
        "benchmark": "worker scaling",
        "latency_s": args.latency,
        "slots_per_node": args.slots,
        "runs": runs,
    }


def pause(args: argparse.Namespace) -> dict[str, Any]:
    pauses: list[float] = []
    firsts: list[float] = []
    partials: list[int] = []
    engine = functools.partial(
        TimedEngine,
        latency=args.latency,
        abort_latency=args.abort_latency,
        max_concurrency=args.slots,
        response_length=16,
    )
    with distributed(3, args, 1, engine) as (client, rollout):
        for step in range(args.rounds):
            rollout.generate(step)
            threading.Event().wait(args.latency / 2)  # the slots fill with generations in flight
            begin = time.time()
            was = rollout.pause_admission()
            pauses.append(time.time() - begin - args.abort_latency)
            partials.append(client.pending_count())
            rollout.set_weight_version(str(step + 1))
            resumed = time.time()
            rollout.resume_admission(was)
            first = None
            while first is None and time.time() < resumed + 30.0:
                found = [t for t in rollout.call_generators("first_start_after", resumed) if t is not None]
                first = min(found) if found else None
            if first is not None:
                firsts.append(first - resumed)

    def summary(values: list[float]) -> dict[str, float]:
        ordered = sorted(values)
        return {
            "p50_ms": round(statistics.median(ordered) * 1000, 1),
            "p90_ms": round(ordered[int(0.9 * (len(ordered) - 1))] * 1000, 1),
            "max_ms": round(ordered[-1] * 1000, 1),
        }

    return {
        "benchmark": "weight-update pause",
        "nodes": 3,
        "engine_abort_latency_ms": args.abort_latency * 1000,
        "rounds": args.rounds,
        "pause_to_durable_beyond_abort": summary(pauses),
        "resume_to_first_generation": summary(firsts),
        "returned_partials_per_pause_median": statistics.median(partials),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="what", required=True)
    s = sub.add_parser("scaling")
    s.add_argument("--latency", type=float, default=0.5)
    s.add_argument("--slots", type=int, default=8)
    s.add_argument("--steps", type=int, default=4)
    s.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 3])
    p = sub.add_parser("pause")
    p.add_argument("--latency", type=float, default=0.5)
    p.add_argument("--abort-latency", type=float, default=0.05)
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--rounds", type=int, default=20)
    for command in (s, p):
        command.add_argument("--dir", default=None, help="where the temporary pool goes")
    args = parser.parse_args(argv)
    result = scaling(args) if args.what == "scaling" else pause(args)
    json.dump(result, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
