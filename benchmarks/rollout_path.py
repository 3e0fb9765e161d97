#!/usr/bin/env python
"""Rollout data path benchmark (issue 13, performance): straw's path against Ray's object store.

One rollout step of ``--groups`` groups x ``--samples`` samples with slime-shaped replay data
(per sample: routes int32 ``[response, layers, route_topk]``, score-centering top-k ids int32
and log-probs float32 ``[response, topk]``, plus tokens and sampler log-probs as lists) goes
through both paths, side by side in one run, each in a fresh process with its own Ray
(127.0.0.1 only, no dashboard):

- **straw**: a ``QueueController`` in a Ray actor (0 CPUs, as the Ray layer will place it);
  generation workers (Ray actors with a ``QueueReader`` each) take their groups
  (``get_samples``), fill them and ``publish_group`` them (publish + complete); the driver
  accepts the raw collection (``accept_raw_rollout``) and converts it once
  (``BatchBuilder.build``); each of ``--ranks`` rank actors runs ``load_rank_batch`` and reads
  its replay tensors.
- **ray** (slime's default transport): the generation workers return their groups to the
  driver (as the engines' replies reach slime's rollout manager); the driver converts them with
  the same ``default_convert``, cuts the same round-robin partitions, ``ray.put``s each rank's
  whole partition, and each rank does one ``ray.get``.

Both ranks sum every replay array they got, so each byte is really read in both paths.
Reported: step time and its ratio, the driver's peak RSS and its ratio, bytes read by each
straw rank against its share, straw's fixed cost per group with a tiny payload (in one process,
the payload write and read excluded), and the scheduling cost (``take`` + ``add_samples`` p50)
from 1k to 100k pending groups. Every path runs ``--repeat`` times, back to back in each repeat; each
run prints, then a table of the issue's targets with medians over the repeats (ratios taken within a
repeat). Numbers also go to ``--json``; nothing here is a
pass/fail test.

Usage::

    .venv/bin/pip install -e '.[ray]'
    .venv/bin/python benchmarks/rollout_path.py [--pool DIR] [--memory-pool DIR] [--groups 64]
        [--samples 8] [--response 4096] [--layers 48] [--route-topk 8] [--topk 8] [--ranks 4]
        [--workers 4] [--pending 1000,10000,100000] [--only straw,ray,overhead,scheduling]
        [--repeat 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from straw.rollout.batch import (
    BatchBuilder,
    ParallelConfig,
    default_convert,
    default_schedule,
    load_rank_batch,
)
from straw.rollout.collection import accept_raw_rollout
from straw.rollout.config import RolloutConfig
from straw.rollout.controller import QueueController
from straw.rollout.pool import close_rollout_stores
from straw.rollout.reader import QueueReader
from straw.rollout.refs import load_groups
from straw.rollout.sample import Sample, SampleStatus, iter_samples
from straw.tensor import TensorRef

REPLAY = ("rollout_routed_experts", "rollout_topk_token_ids", "rollout_topk_log_probs")


# --------------------------------------------------------------------------- shared pieces


class Prompts:
    """A synthetic prompt dataset of ``size`` rows."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"input": f"prompt {index}"}


def flags(args: SimpleNamespace, pool: str) -> dict[str, Any]:
    return {
        "rollout_data_dir": pool,
        "rollout_batch_size": args.groups,
        "n_samples_per_prompt": args.samples,
        "use_rollout_routing_replay": True,
        "use_score_centering": True,
        "score_centering_top_k": args.topk,
        "rollout_io_concurrency": 4,
    }


def config_of(values: dict[str, Any]) -> RolloutConfig:
    return RolloutConfig.from_args(SimpleNamespace(**values))


def fill(group: list[Sample], dims: dict[str, int]) -> list[Sample]:
    """Complete a group the way a serving engine would report it (deterministic, cheap to make)."""
    response, layers, route_topk, topk = dims["response"], dims["layers"], dims["route_topk"], dims["topk"]
    for sample in iter_samples(group):
        index = int(sample.index or 0)
        prompt = len(sample.tokens) or 1
        sample.tokens = [*(sample.tokens or [1]), *range(index % 1000, index % 1000 + response)]
        sample.response_length = response
        sample.rollout_log_probs = [-0.5] * response
        sample.rollout_routed_experts = np.full(
            (prompt + response - 1, layers, route_topk), index % 251, np.int32
        )
        sample.rollout_topk_token_ids = np.full((response, topk), index, np.int32)
        sample.rollout_topk_log_probs = np.full((response, topk), -1.0, np.float32)
        sample.reward = float(index % 2)
        sample.status = SampleStatus.COMPLETED
        sample.weight_versions = ["1"]
    return group


def plain_group(group_index: int, samples: int) -> list[Sample]:
    first = group_index * samples
    return [
        Sample(index=first + i, group_index=group_index, prompt=f"prompt {group_index}")
        for i in range(samples)
    ]


def checksum(arrays: list[Any]) -> tuple[int, int]:
    """(sum of every element, bytes) over arrays; summing reads each byte."""
    total, size = 0, 0
    for array in arrays:
        total += int(np.asarray(array).sum(dtype=np.int64))
        size += int(np.asarray(array).nbytes)
    return total, size


def bytes_brought_in() -> int:
    """Bytes this process has read by system call plus file pages it has mapped in (large
    tensors share the pack's pages instead of reading them: docs/DURABILITY.md D5.6a)."""
    with open("/proc/self/io") as handle:
        read = next((int(line.split()[1]) for line in handle if line.startswith("rchar:")), 0)
    with open("/proc/self/status") as handle:
        mapped = sum(
            int(line.split()[1]) * 1024 for line in handle if line.startswith(("RssFile:", "RssShmem:"))
        )
    return read + mapped


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def start_ray(object_store: int) -> Any:
    import ray

    ray.init(
        address="local",  # always a private instance, never a cluster another process started
        _node_ip_address="127.0.0.1",
        include_dashboard=False,
        num_cpus=16,
        object_store_memory=object_store,
        log_to_driver=False,
        configure_logging=False,
    )
    return ray


# --------------------------------------------------------------------------- the straw path


def straw_path(args: SimpleNamespace) -> dict[str, Any]:
    ray = start_ray(256 << 20)
    values = flags(args, args.pool)
    dims = {k: getattr(args, k) for k in ("response", "layers", "route_topk", "topk")}

    @ray.remote(num_cpus=0, max_concurrency=16)
    class Controller:
        def __init__(self, values: dict[str, Any], size: int) -> None:
            self.controller = QueueController(config_of(values), dataset=Prompts(size))

        def call(self, name: str, *a: Any, **k: Any) -> Any:
            return getattr(self.controller, name)(*a, **k)

        def rss(self) -> int:
            return peak_rss()

    class Client:
        """The reader's and the builder's view of the controller actor."""

        def __init__(self, actor: Any) -> None:
            self.actor = actor

        def __getattr__(self, name: str) -> Any:
            if name.startswith("_"):
                raise AttributeError(name)
            return lambda *a, **k: ray.get(self.actor.call.remote(name, *a, **k))

    @ray.remote(num_cpus=1)
    class Generation:
        def __init__(self, values: dict[str, Any], client: Any, reader_id: str) -> None:
            self.reader = QueueReader(config_of(values), client, reader_id)

        def generate(self, count: int) -> tuple[list[Any], list[float]]:
            refs, straw_seconds = [], []
            started = time.perf_counter()
            groups = self.reader.get_samples(count)
            taken = time.perf_counter() - started
            for group in groups:
                fill(group, dims)
                started = time.perf_counter()
                refs.append(self.reader.publish_group(group, rollout_id=0))
                straw_seconds.append(time.perf_counter() - started + taken / len(groups))
            return refs, straw_seconds

    @ray.remote(num_cpus=1)
    class Rank:
        def __init__(self) -> None:
            import torch  # noqa: F401 - imported before the clock starts, as a trainer has it

        def load(self, refs: list[Any], rank: int) -> dict[str, Any]:
            before, started = bytes_brought_in(), time.perf_counter()
            data = load_rank_batch(refs, rank)
            arrays = [t.numpy() if isinstance(t, TensorRef) else t for key in REPLAY for t in data[key]]
            arrays += list(data["tokens"])
            total, size = checksum(arrays)
            seconds, read = time.perf_counter() - started, bytes_brought_in() - before
            return {
                "seconds": seconds,
                "read": read,
                "share": size,
                "checksum": total,
                "rows": len(data["tokens"]),
            }

    controller = Controller.remote(values, args.groups * 4)
    client = Client(controller)
    workers = [Generation.remote(values, client, f"generation-{i}") for i in range(args.workers)]
    ranks = [Rank.remote() for _ in range(args.ranks)]
    ray.get(controller.rss.remote())
    ray.get([rank.__ray_ready__.remote() for rank in ranks])
    counts = [len(range(i, args.groups, args.workers)) for i in range(args.workers)]
    config = config_of(values)
    started = time.perf_counter()
    produced = ray.get([w.generate.remote(n) for w, n in zip(workers, counts, strict=True)])
    generated = time.perf_counter()
    refs = [ref for part, _ in produced for ref in part]
    raw = accept_raw_rollout(refs, config=config, controller=client, rollout_id=0)
    samples = [s for group in load_groups(raw) for s in iter_samples(group)]
    builder = BatchBuilder(config, client, parallel=ParallelConfig(dp_size=args.ranks))  # type: ignore[arg-type]
    train = builder.build(raw, samples, rollout_id=0)
    built = time.perf_counter()
    loads = ray.get([rank.load.remote(train, r) for r, rank in enumerate(ranks)])
    finished = time.perf_counter()
    builder.training_completed(0)
    result = {
        "step_s": finished - started,
        "generate_s": generated - started,
        "build_s": built - generated,
        "load_s": finished - built,
        "driver_peak_rss": peak_rss(),
        "controller_peak_rss": ray.get(controller.rss.remote()),
        "ranks": loads,
        "group_straw_ms_p50": 1e3 * statistics.median(s for _, part in produced for s in part),
    }
    ray.shutdown()
    return result


# --------------------------------------------------------------------------- Ray's object store


def ray_path(args: SimpleNamespace) -> dict[str, Any]:
    per_sample = 4 * args.response * (args.layers * args.route_topk + 2 * args.topk) + 16 * args.response
    ray = start_ray(int(per_sample * args.groups * args.samples * 2.3) + (512 << 20))
    config = config_of(flags(args, args.pool))
    dims = {k: getattr(args, k) for k in ("response", "layers", "route_topk", "topk")}

    @ray.remote(num_cpus=1)
    class Generation:
        def generate(self, group_indices: list[int]) -> list[list[Sample]]:
            return [fill(plain_group(g, args.samples), dims) for g in group_indices]

    @ray.remote(num_cpus=1)
    class Rank:
        def __init__(self) -> None:
            import torch  # noqa: F401 - as in the straw path

        def load(self, box: list[Any]) -> dict[str, Any]:
            started = time.perf_counter()
            data = ray.get(box[0])  # one get of the whole partition
            arrays = [a for key in REPLAY for a in data[key]] + [np.asarray(t) for t in data["tokens"]]
            total, size = checksum(arrays)
            return {"seconds": time.perf_counter() - started, "share": size, "checksum": total}

    workers = [Generation.remote() for _ in range(args.workers)]
    ranks = [Rank.remote() for _ in range(args.ranks)]
    ray.get([w.generate.remote([]) for w in workers])
    ray.get([rank.__ray_ready__.remote() for rank in ranks])
    started = time.perf_counter()
    parts = ray.get(
        [w.generate.remote(list(range(i, args.groups, args.workers))) for i, w in enumerate(workers)]
    )
    generated = time.perf_counter()
    groups = sorted((g for part in parts for g in part), key=lambda g: g[0].index)
    samples = [s for group in groups for s in group]
    data = default_convert(samples, config)
    lengths = [len(t) for t in data["tokens"]]
    schedule = default_schedule(lengths, data["rollout_ids"], ParallelConfig(dp_size=args.ranks), config)
    rows = [k for k, v in data.items() if isinstance(v, list) and len(v) == len(samples)]
    handles = []
    for partition in schedule.partitions:
        handles.append(ray.put({k: [data[k][i] for i in partition] for k in rows}))
    built = time.perf_counter()
    loads = ray.get([rank.load.remote([handle]) for rank, handle in zip(ranks, handles, strict=True)])
    finished = time.perf_counter()
    result = {
        "step_s": finished - started,
        "generate_s": generated - started,
        "build_s": built - generated,
        "load_s": finished - built,
        "driver_peak_rss": peak_rss(),
        "ranks": loads,
    }
    ray.shutdown()
    return result


# --------------------------------------------------------------------------- straw's own cost


#: CPU time spent between two probe syncs in the "isolated" probe: about what a group's own work
#: puts between its syncs. Some devices (virtual disks among them) answer a flush that follows
#: another at once far faster than one that follows a pause, so both are reported.
SYNC_PROBE_GAP_S = 0.001


def sync_p50_ms(directory: str, count: int = 200, gap: float = 0.0) -> float:
    """A bare 4 KiB append plus ``fdatasync`` in ``directory``, p50, each after ``gap`` seconds of
    busy CPU: what one of the syncs in the per-group cost costs on this disk at this moment (it
    varies with the machine's I/O load, and on some devices with the pause before it)."""
    path = os.path.join(directory, "sync-probe")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    times = []
    try:
        for _ in range(count):
            until = time.perf_counter() + gap
            while time.perf_counter() < until:
                pass
            started = time.perf_counter()
            os.write(fd, bytes(4096))
            os.fdatasync(fd)
            times.append(time.perf_counter() - started)
    finally:
        os.close(fd)
        os.unlink(path)
    return 1e3 * statistics.median(times)


def overhead(args: SimpleNamespace) -> dict[str, Any]:
    """Per-group cost of straw's calls with a tiny payload (one process): take, publish+complete,
    and the manager's accept + build + rank loads spread over the groups."""
    dims = {"response": 8, "layers": 2, "route_topk": 2, "topk": args.topk}
    values = {**flags(args, args.pool), "rollout_batch_size": args.groups}
    config = config_of(values)
    controller = QueueController(config, dataset=Prompts(10_000))
    reader = QueueReader(config, controller, "overhead")
    per_group, manager = [], []
    try:
        for step in range(args.overhead_steps + 1):  # step 0 warms up (imports, first packs)
            if step == 1:
                per_group, manager = [], []
            refs = []
            for _ in range(args.groups):
                started = time.perf_counter()
                (group,) = reader.get_samples(1)
                taken = time.perf_counter() - started
                fill(group, dims)
                started = time.perf_counter()
                refs.append(reader.publish_group(group, rollout_id=step))
                per_group.append(taken + time.perf_counter() - started)
            started = time.perf_counter()
            raw = accept_raw_rollout(refs, config=config, controller=controller, rollout_id=step)
            samples = [s for g in load_groups(raw) for s in iter_samples(g)]
            builder = BatchBuilder(config, controller, parallel=ParallelConfig(dp_size=args.ranks))
            train = builder.build(raw, samples, rollout_id=step)
            for rank in range(args.ranks):
                load_rank_batch(train, rank)
            builder.training_completed(step)
            manager.append((time.perf_counter() - started) / args.groups)
    finally:
        reader.close()
        controller.close()
    return {
        "group_ms_p50": 1e3 * statistics.median(per_group),
        "sync_ms_p50": sync_p50_ms(args.pool),
        "sync_isolated_ms_p50": sync_p50_ms(args.pool, gap=SYNC_PROBE_GAP_S),
        "group_ms_p90": 1e3 * statistics.quantiles(per_group, n=10)[-1],
        "manager_ms_per_group": 1e3 * statistics.median(manager),
    }


def scheduling(args: SimpleNamespace) -> dict[str, Any]:
    """``take`` + ``add_samples`` p50 with N returned groups pending, N from 1k to 100k."""
    config = config_of({"rollout_data_dir": args.pool, "n_samples_per_prompt": 1})
    controller = QueueController(config, dataset=Prompts(1_000_000))
    reader = QueueReader(config, controller, "scheduling")

    def partial(group: list[Sample]) -> list[Sample]:
        for sample in group:
            sample.tokens = [*sample.tokens, 7]
            sample.response_length += 1
            sample.status = SampleStatus.ABORTED
            sample.weight_versions = [*sample.weight_versions, str(len(sample.tokens))]
        return group

    out: dict[str, Any] = {}
    try:
        for level in args.pending:
            # The queue serves returned partials before fresh prompts, so the level is built by
            # taking ``level`` groups (the pending partials first, then fresh ones) and
            # returning them all.
            held = reader.get_samples(level)
            reader.add_samples([partial(g) for g in held])
            del held
            takes, adds = [], []
            for _ in range(args.scheduling_samples):
                started = time.perf_counter()
                (group,) = reader.get_samples(1)
                middle = time.perf_counter()
                reader.add_samples([partial(group)])
                takes.append(middle - started)
                adds.append(time.perf_counter() - middle)
            out[str(level)] = {
                "pending": controller.pending_count(),
                "take_ms_p50": 1e3 * statistics.median(takes),
                "add_ms_p50": 1e3 * statistics.median(adds),
                "sum_ms_p50": 1e3 * statistics.median([a + b for a, b in zip(takes, adds, strict=True)]),
            }
    finally:
        reader.close()
        controller.close()
    return out


# --------------------------------------------------------------------------- the parent


CHILDREN = {"straw": straw_path, "ray": ray_path, "overhead": overhead, "scheduling": scheduling}


def run_child(kind: str, args: argparse.Namespace, pool: str) -> dict[str, Any]:
    shutil.rmtree(pool, ignore_errors=True)
    os.makedirs(pool)
    options = {**vars(args), "pool": pool, "child": kind}
    try:
        done = subprocess.run(
            [sys.executable, __file__, "--child-json", json.dumps(options)],
            capture_output=True,
            text=True,
            check=False,
        )
    finally:
        shutil.rmtree(pool, ignore_errors=True)
    if done.returncode != 0:
        raise RuntimeError(f"{kind} run failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def median_of(runs: list[dict[str, Any]], pick: Any) -> float:
    return float(statistics.median(pick(run) for run in runs))


def rank_read_ratio(run: dict[str, Any]) -> float:
    """The worst rank's bytes read over its share."""
    return max(rank["read"] / rank["share"] for rank in run["ranks"])


def report_runs(results: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> None:
    """Each run's figures, then the medians over the repeats."""
    data_bytes = (
        args.groups * args.samples * 4 * args.response * (args.layers * args.route_topk + 2 * args.topk)
    )
    print(f"step: {args.groups} groups x {args.samples} samples, replay data {data_bytes / 2**30:.2f} GiB")
    for name in ("ray", "straw", "straw_memory"):
        for i, run in enumerate(results.get(name, [])):
            where = {"ray": "convert+put", "straw": "accept+build", "straw_memory": "accept+build"}[name]
            line = (
                f"{name} #{i + 1}: step {run['step_s']:.2f} s (generate {run['generate_s']:.2f}, "
                f"{where} {run['build_s']:.2f}, rank loads {run['load_s']:.2f}), "
                f"driver peak RSS {run['driver_peak_rss'] / 2**20:.0f} MiB"
            )
            if name != "ray":
                line += f", rank reads/share {rank_read_ratio(run):.3f}x"
            print(line)
    for name in ("overhead", "overhead_memory"):
        for i, o in enumerate(results.get(name, [])):
            print(
                f"{name} #{i + 1}: per group p50 {o['group_ms_p50']:.2f} ms (p90 {o['group_ms_p90']:.2f}), "
                f"manager {o['manager_ms_per_group']:.2f} ms per group; "
                f"a bare append + fdatasync there: {o.get('sync_ms_p50', float('nan')):.3f} ms back to back, "
                f"{o.get('sync_isolated_ms_p50', float('nan')):.3f} ms after "
                f"{SYNC_PROBE_GAP_S * 1e3:g} ms of work"
            )
    for i, levels in enumerate(results.get("scheduling", [])):
        cells = ", ".join(
            f"{int(level)}: {row['take_ms_p50']:.2f} + {row['add_ms_p50']:.2f} = {row['sum_ms_p50']:.2f} ms"
            for level, row in levels.items()
        )
        print(f"scheduling #{i + 1} (take + add_samples p50 by pending groups): {cells}")


def targets(results: dict[str, list[dict[str, Any]]]) -> list[tuple[str, str, str, str]]:
    """(target, limit, measured median, met) rows; ratios are taken within each repeat (the two
    paths ran back to back), then the median over the repeats."""
    rows: list[tuple[str, str, str, str]] = []
    ray_runs = results.get("ray", [])

    def paired(name: str, pick: Any) -> float | None:
        runs = results.get(name, [])
        pairs = list(zip(runs, ray_runs, strict=False))
        if not pairs:
            return None
        return float(statistics.median(pick(a) / pick(b) for a, b in pairs))

    for name, label in (("straw", "disk"), ("straw_memory", "tmpfs")):
        step = paired(name, lambda run: run["step_s"])
        if step is not None:
            rows.append(
                (f"step time vs object store ({label})", "<= 1.10x", f"{step:.2f}x", _met(step <= 1.1))
            )
    rss = paired("straw", lambda run: run["driver_peak_rss"])
    if rss is not None:
        rows.append(("driver peak RSS vs object store", "<= 0.25x", f"{rss:.3f}x", _met(rss <= 0.25)))
    if results.get("straw"):
        read = median_of(results["straw"], rank_read_ratio)
        rows.append(("bytes read per rank / its share", "<= 1.10x", f"{read:.3f}x", _met(read <= 1.1)))
    for name, label in (("overhead", "disk"), ("overhead_memory", "tmpfs")):
        if results.get(name):
            ms = median_of(results[name], lambda o: o["group_ms_p50"])
            rows.append(
                (f"straw's own cost per group, p50 ({label})", "<= 2 ms", f"{ms:.2f} ms", _met(ms <= 2))
            )
    if results.get("scheduling"):
        levels = list(results["scheduling"][0])
        p50 = {
            lvl: median_of(results["scheduling"], lambda r, lvl=lvl: r[lvl]["sum_ms_p50"]) for lvl in levels
        }
        spread = max(p50.values()) / min(p50.values())
        cells = " / ".join(f"{p50[lvl]:.2f}" for lvl in levels)
        rows.append(
            (f"take + add_samples p50 at {' / '.join(levels)} pending (max/min)", "<= 1.5x",
             f"{cells} ms ({spread:.2f}x)", _met(spread <= 1.5))
        )  # fmt: skip
    return rows


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def report_targets(results: dict[str, list[dict[str, Any]]], repeats: int) -> None:
    rows = targets(results)
    if not rows:
        return
    print(f"\nissue 13 targets (medians of {repeats} repeat(s)):")
    width = max(len(r[0]) for r in rows)
    for target, limit, value, met in rows:
        print(f"  {target:<{width}}  {limit:>9}  {value:>24}  {met}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--child-json", help=argparse.SUPPRESS)
    parser.add_argument("--pool", default=None, help="pool directory on disk (default: a temp dir)")
    parser.add_argument(
        "--memory-pool", default="/dev/shm", help="a tmpfs directory for the in-memory pool runs"
    )
    parser.add_argument("--groups", type=int, default=64)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--response", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--route-topk", type=int, default=8)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--overhead-steps", type=int, default=4)
    parser.add_argument("--pending", default="1000,10000,100000")
    parser.add_argument("--scheduling-samples", type=int, default=200)
    parser.add_argument("--only", default="straw,ray,overhead,scheduling")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each path; medians are reported")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.child_json:
        import torch  # noqa: F401 - a driver has it loaded before the step starts

        options = json.loads(args.child_json)
        options["pending"] = [int(x) for x in str(options["pending"]).split(",")]
        ns = SimpleNamespace(**options)
        result = CHILDREN[ns.child](ns)
        close_rollout_stores()
        print(json.dumps(result))
        return
    base = args.pool or tempfile.mkdtemp(prefix="straw-rollout-bench-")
    memory = os.path.join(args.memory_pool, f"straw-rollout-bench-{os.getpid()}")
    wanted = args.only.split(",")
    results: dict[str, list[dict[str, Any]]] = {}
    runs = [
        ("ray", "ray", os.path.join(base, "ray")),
        ("straw", "straw", os.path.join(base, "straw")),
        ("straw_memory", "straw", memory),
        ("overhead", "overhead", os.path.join(base, "overhead")),
        ("overhead_memory", "overhead", memory),
        ("scheduling", "scheduling", memory),
    ]
    # Each repeat runs every path once, back to back, so a ratio compares runs that saw about
    # the same load of the shared machine; the report takes medians over the repeats.
    for repeat in range(args.repeat):
        for name, kind, pool in runs:
            if kind in wanted:
                print(f"repeat {repeat + 1}/{args.repeat}: running {name} ...", file=sys.stderr, flush=True)
                results.setdefault(name, []).append(run_child(kind, args, pool))
    if args.pool is None:
        shutil.rmtree(base, ignore_errors=True)
    report_runs(results, args)
    report_targets(results, args.repeat)
    if args.json:
        Path(args.json).write_text(json.dumps({"arguments": vars(args), "results": results}, indent=2))


if __name__ == "__main__":
    asyncio.set_event_loop_policy(None)
    main()
