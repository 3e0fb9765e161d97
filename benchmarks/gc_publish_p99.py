#!/usr/bin/env python
"""Publish latency while a collector runs in a loop (issue: ownership catalog and online GC).

A writer publishes 1 KiB records with ``online_gc=True`` and releases them,
sealing a small pack every few hundred publications, while a collector in
another process (as another client would be) calls ``collect_garbage`` back
to back. The table compares publish p50/p99 with and
without the collector. Collection runs under the catalog lock, which a
publish only takes when it seals a pack (rotation), so the p99 should barely
move.

Usage: .venv/bin/python benchmarks/gc_publish_p99.py [--root DIR] [--count 4000]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from straw.protocol import Record
from straw.store import SharedFilesystemStore

KiB = 1024


COLLECTOR = """
import sys
from straw.store import SharedFilesystemStore
store = SharedFilesystemStore(sys.argv[1], "gcbench", online_gc=True)
passes = reclaimed = 0
print("ready", flush=True)
while True:
    result = store.collect_garbage()
    passes += 1
    reclaimed += result["reclaimed_files"]
    if sys.stdin in __import__("select").select([sys.stdin], [], [], 0)[0]:
        break
print(passes, reclaimed, flush=True)
"""


def run(root: str, count: int, with_collector: bool) -> dict[str, float]:
    shutil.rmtree(root, ignore_errors=True)
    writer = SharedFilesystemStore(root, "gcbench", online_gc=True, segment_target_bytes=256 * KiB)
    collector = None
    if with_collector:
        collector = subprocess.Popen(
            [sys.executable, "-c", COLLECTOR, root], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert collector.stdout is not None and collector.stdout.readline().strip() == "ready"
    latencies = []
    payload = os.urandom(KiB)
    try:
        for i in range(count):
            t0 = time.perf_counter()
            ref = writer.publish([Record(f"r{i}", payload)], submission_id=f"s{i}")
            latencies.append(time.perf_counter() - t0)
            writer.release_publications([ref])
    finally:
        writer.close()
    passes = reclaimed = 0
    if collector is not None:
        out, _ = collector.communicate("stop\n", timeout=120)
        passes, reclaimed = (int(x) for x in out.split()[-2:])
    latencies.sort()
    return {
        "collector": with_collector,
        "publish_p50_ms": statistics.median(latencies) * 1e3,
        "publish_p99_ms": latencies[int(len(latencies) * 0.99) - 1] * 1e3,
        "publish_max_ms": latencies[-1] * 1e3,
        "collections": passes,
        "reclaimed_files": reclaimed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=None)
    parser.add_argument("--count", type=int, default=4000)
    args = parser.parse_args()
    base = args.root or tempfile.mkdtemp(prefix="straw-gc-p99-")
    rows = [run(os.path.join(base, f"pool{int(flag)}"), args.count, flag) for flag in (False, True)]
    print(
        f"{'collector':>10} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'collections':>12} {'reclaimed':>10}"
    )
    for row in rows:
        print(
            f"{row['collector']!s:>10} {row['publish_p50_ms']:>8.3f} {row['publish_p99_ms']:>8.3f}"
            f" {row['publish_max_ms']:>8.2f} {row['collections']:>12} {row['reclaimed_files']:>10}"
        )
    if args.root is None:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
