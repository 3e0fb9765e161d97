#!/usr/bin/env python
"""Does the demo's policy learn its task, and how fast? (issue 15, the demo's learning problem)

Runs the plain in-process GRPO loop of ``straw.rollout.demo.train`` (no queue, pool or Ray)
at the demo's default size (8 prompts x 8 samples per step) for several seeds and prints, per
seed, the mean reward of the first 3 and the last 3 steps and the loop's wall time. The full
demo adds the data plane around exactly this computation, so these numbers are the baseline
its learning curve and step time are compared against.

Usage: .venv/bin/python benchmarks/demo_learning.py [--steps 30] [--seeds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

from straw.rollout.demo.train import LoopConfig, run_plain_loop


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=LoopConfig.steps)
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    print(f"{'seed':>4} {'first 3':>8} {'last 3':>8} {'wall s':>7} {'step ms p50':>11}")
    gains = []
    for seed in range(args.seeds):
        started = time.perf_counter()
        results = run_plain_loop(LoopConfig(steps=args.steps, seed=seed))
        wall = time.perf_counter() - started
        rewards = [r.mean_reward for r in results]
        first, last = statistics.fmean(rewards[:3]), statistics.fmean(rewards[-3:])
        gains.append(last - first)
        step_ms = statistics.median(r.seconds for r in results) * 1000
        print(f"{seed:>4} {first:>8.3f} {last:>8.3f} {wall:>7.2f} {step_ms:>11.1f}")
    print(f"mean gain (last 3 - first 3): {statistics.fmean(gains):.3f}")


if __name__ == "__main__":
    main()
