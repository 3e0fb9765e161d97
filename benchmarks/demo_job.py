#!/usr/bin/env python
"""The default `straw demo` run, checked: does it learn, and does it fit in three minutes? (issue 15)

Runs `straw demo` with its default settings (3 Ray nodes on 127.0.0.1, 30 steps of 8 prompts
x 8 samples, 2 trainer ranks) in a fresh directory, reads the run's summary.json and prints
the wall time, the mean reward of the first and of the last 3 steps and the step time split.
Exits 1 when the last 3 steps do not beat the first 3 by at least --min-gain, or when the
run took longer than --max-seconds.

Usage: .venv/bin/python benchmarks/demo_job.py [--dir /tmp/straw-demo-bench] [--min-gain 0.2]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dir", default="/tmp/straw-demo-bench")
    parser.add_argument("--min-gain", type=float, default=0.2)
    parser.add_argument("--max-seconds", type=float, default=180.0)
    parser.add_argument("extra", nargs="*", help="more `straw demo` flags (after --)")
    args = parser.parse_args()
    root = Path(args.dir)
    if root.exists():
        shutil.rmtree(root)
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "straw.cli", "demo", "--dir", str(root), *args.extra])
    wall = time.perf_counter() - started
    if done.returncode != 0:
        print(f"straw demo failed (exit {done.returncode})")
        return 1
    summary = json.loads((root / "summary.json").read_text())
    first, last = summary["first3_reward"], summary["last3_reward"]
    split = summary["step_split_seconds"]
    print(f"wall time (command): {wall:.1f} s   (job: {summary['wall_seconds']:.1f} s)")
    print(f"mean reward: first 3 steps {first:.3f}, last 3 steps {last:.3f}, gain {last - first:+.3f}")
    print("step split (mean ms): " + ", ".join(f"{k} {v * 1000:.0f}" for k, v in split.items()))
    ok = last - first >= args.min_gain and wall <= args.max_seconds
    print("OK" if ok else f"FAILED: need a gain >= {args.min_gain} within {args.max_seconds:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
