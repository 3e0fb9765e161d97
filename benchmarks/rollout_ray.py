"""Distributed rollout benchmarks on a local Ray cluster (127.0.0.1): worker scaling and the pause.

``scaling``: a simulated engine of fixed latency (asyncio timers, no model) on every node;
groups per second of ``DistributedRollout`` with 1, 2 and 3 nodes, each node with the same
slots, against the linear ideal (one node's rate times the nodes). Each run also reports
the CPU the job used (the driver and every Ray process it started, from /proc) and how busy
the whole machine was over the measured window, in cores: when the job's own processes need
about as many cores as the machine has, the run is CPU-bound and cannot scale further here.

``pause``: the weight-update pause with 3 nodes, every slot busy. Each round collects a batch
of every slot's group, lets the slots start the next groups, waits ``--in-flight`` of the
engine latency and calls ``pause_admission()``, which returns once every worker's in-flight
work is durable (accepted, or back in the queue as a partial); its time minus the engine's own
abort latency is the layer's cost. The partials returned per pause are counted from the
queue. After ``resume_admission()`` the time to the first generator call on any worker (the
first new group entering generation) is measured by the engines themselves (wall clock, same
host).

    .venv/bin/python benchmarks/rollout_ray.py scaling [--latency 0.5 --slots 8 --steps 10]
    .venv/bin/python benchmarks/rollout_ray.py pause [--rounds 20 --abort-latency 0.05]

Prints one JSON document. Needs the ``ray`` extra; the CPU figures need Linux's /proc.
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


def _tree_cpu_seconds() -> float:
    """CPU seconds (user + system) of this process and all its descendants (the Ray processes)."""
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except OSError:  # the process ended meanwhile
            continue
        parents[int(entry)] = int(fields[1])
        times[int(entry)] = (int(fields[11]) + int(fields[12])) / tick
    children: dict[int, list[int]] = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    total, todo = 0.0, [os.getpid()]
    while todo:
        pid = todo.pop()
        total += times.get(pid, 0.0)
        todo += children.get(pid, [])
    return total


def _machine_busy_seconds() -> float:
    """CPU seconds all processes of the machine spent busy (every core), from /proc/stat."""
    with open("/proc/stat", encoding="ascii") as handle:
        fields = [int(v) for v in handle.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle and iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


class CpuWindow:
    """The job's and the machine's CPU use over a window, in cores (seconds of CPU per second)."""

    def __enter__(self) -> CpuWindow:
        self.load_before = os.getloadavg()[0]
        self.job, self.machine, self.wall = _tree_cpu_seconds(), _machine_busy_seconds(), time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        wall = time.perf_counter() - self.wall
        self.figures = {
            "job_cpu_cores": round((_tree_cpu_seconds() - self.job) / wall, 2),
            "machine_busy_cores": round((_machine_busy_seconds() - self.machine) / wall, 2),
            "machine_cores": os.cpu_count(),
            "load_average_1min_before": round(self.load_before, 2),
        }


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
        with CpuWindow() as cpu:
            begin = time.perf_counter()
            for step in range(1, args.steps + 1):
                rollout.generate(step)
            elapsed = time.perf_counter() - begin
    groups = args.steps * args.slots * nodes
    return {
        "nodes": nodes,
        "groups": groups,
        "seconds": round(elapsed, 3),
        "groups_per_s": round(groups / elapsed, 2),
        **cpu.figures,
        "job_cpu_ms_per_group": round(cpu.figures["job_cpu_cores"] * elapsed / groups * 1000, 1),
    }


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
    nodes = 3
    # A batch of every slot's group: collecting it frees every slot, so all of them are
    # generating the next groups when the pause comes (a full engine at a weight update).
    with distributed(nodes, args, args.slots * nodes, engine) as (client, rollout), CpuWindow() as cpu:
        for step in range(args.rounds):
            rollout.generate(step)
            threading.Event().wait(args.latency * args.in_flight)  # the slots' generations run
            begin = time.time()
            was = rollout.pause_admission()
            pauses.append(time.time() - begin - args.abort_latency)
            partials.append(client.pending_count())  # durable already: pause_admission returned
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
        "slots": args.slots * nodes,
        "in_flight_fraction_at_pause": args.in_flight,
        "returned_partials_per_pause_median": statistics.median(partials),
        "returned_partials_per_pause_min": min(partials),
        **cpu.figures,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="what", required=True)
    s = sub.add_parser("scaling")
    s.add_argument("--latency", type=float, default=0.5)
    s.add_argument("--slots", type=int, default=8)
    s.add_argument("--steps", type=int, default=10)
    s.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 3])
    p = sub.add_parser("pause")
    p.add_argument("--latency", type=float, default=0.5)
    p.add_argument("--abort-latency", type=float, default=0.05)
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument(
        "--in-flight", type=float, default=0.5, help="pause this fraction of the latency after a batch"
    )
    for command in (s, p):
        command.add_argument("--dir", default=None, help="where the temporary pool goes")
    args = parser.parse_args(argv)
    result = scaling(args) if args.what == "scaling" else pause(args)
    json.dump(result, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
