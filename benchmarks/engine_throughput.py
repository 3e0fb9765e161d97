#!/usr/bin/env python
"""Generator throughput and abort latency for the demo's engines (issue 15's engine clients).

Generates copy-task groups (8 samples, up to 4 new tokens each) with ``--concurrency`` groups
in flight, through four paths side by side over the same policy:

- ``local``: the in-process ``PolicyGenerator`` (the demo's default engine);
- ``sglang``: ``SGLangGenerator`` over real HTTP to the loopback ``PolicyServer`` (``sglang-all``:
  aborting with one ``abort_all`` request instead of one request per sample);
- ``openai-stream`` / ``openai``: ``OpenAICompletionsGenerator`` streamed and not;

and reports groups/s and the ratio to ``local`` (the HTTP overhead). Then, for each path, the
abort latency: with every group parked mid-generation, the time from ``abort()`` until every
call has returned its ABORTED partials (p50 over ``--repeats``). Client and server share one
process and one event loop here, so every HTTP exchange of an abort (one per sample for
``sglang``) is paid twice on one core: read the HTTP abort figures as upper bounds. Last, the fixed-latency
``SimulatedEngine`` with ``max_concurrency=C`` and latency L should deliver C/L groups/s; the
measured rate over that ideal checks the simulator the worker-scaling benchmark relies on.

Usage: .venv/bin/python benchmarks/engine_throughput.py [--groups 64] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from straw.rollout import Sample
from straw.rollout.demo import task
from straw.rollout.demo.local import PolicyGenerator, task_reward
from straw.rollout.demo.policy import DemoPolicy
from straw.rollout.demo.server import PolicyServer
from straw.rollout.demo.simulated import SimulatedEngine
from straw.rollout.generators import OpenAICompletionsGenerator, SGLangGenerator

TEXT = "1 3 0"


def group(index: int, n: int = 8) -> list[Sample]:
    return [Sample(index=index * n + i, group_index=index, prompt=TEXT, label=TEXT) for i in range(n)]


async def throughput(generator: Any, groups: int, concurrency: int) -> float:
    slots = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with slots:
            await generator(group(i), weight_version="0")

    started = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(groups)))
    return groups / (time.perf_counter() - started)


async def abort_latency(generator: Any, engine: Any, concurrency: int, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        engine.park_at(2)
        calls = [
            asyncio.ensure_future(generator(group(1000 + i), weight_version="0")) for i in range(concurrency)
        ]
        await engine.wait_parked(8 * concurrency)
        started = time.perf_counter()
        generator.abort()
        await asyncio.gather(*calls)
        samples.append(time.perf_counter() - started)
        engine.park_at(None)
    return statistics.median(samples)


async def simulated(concurrency: int, latency: float, groups: int) -> float:
    engine = SimulatedEngine(latency=latency, max_concurrency=concurrency)
    started = time.perf_counter()
    await asyncio.gather(*(engine(group(i), weight_version="0") for i in range(groups)))
    return groups / (time.perf_counter() - started)


async def main(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    policy = DemoPolicy(seed=0)
    async with PolicyServer(policy) as server:
        common: dict[str, Any] = {
            "max_new_tokens": 4,
            "reward": task_reward,
            "tokenize": task.encode_prompt,
            "seed": 1,
        }
        paths: dict[str, tuple[Callable[[], Any], Any]] = {
            "local": (lambda: PolicyGenerator(policy, seed=1, stop_tokens=()), None),
            "sglang": (
                lambda: SGLangGenerator(
                    server.url, routed_experts=(2, 2), sampling_params={"ignore_eos": True}, **common
                ),
                server,
            ),
            "sglang-all": (
                lambda: SGLangGenerator(
                    server.url,
                    routed_experts=(2, 2),
                    sampling_params={"ignore_eos": True},
                    abort_all=True,
                    **common,
                ),
                server,
            ),
            "openai-stream": (
                lambda: OpenAICompletionsGenerator(server.url, extra_body={"ignore_eos": True}, **common),
                server,
            ),
            "openai": (
                lambda: OpenAICompletionsGenerator(
                    server.url, stream=False, routed_experts=(2, 2), extra_body={"ignore_eos": True}, **common
                ),
                server,
            ),
        }
        print(f"{'path':<14} {'groups/s':>9} {'vs local':>9} {'abort p50 ms':>13}")
        base = None
        for name, (make, engine) in paths.items():
            generator = make()
            await generator(group(0), weight_version="0")  # bind and warm up
            rate = await throughput(generator, args.groups, args.concurrency)
            base = base or rate
            latency = await abort_latency(
                generator, engine or generator.engine, args.concurrency, args.repeats
            )
            print(f"{name:<14} {rate:>9.1f} {rate / base:>9.2f} {latency * 1000:>13.1f}")
            await generator.aclose()
    for c in (1, 4, 16):
        rate = await simulated(c, args.latency, args.groups)
        share = rate * args.latency / c
        print(f"simulated engine, max_concurrency={c:<3} {rate:>8.1f} groups/s = {share:.2f} x C/L")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--groups", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--latency", type=float, default=0.2, help="simulated engine latency, seconds")
    asyncio.run(main(parser.parse_args()))
