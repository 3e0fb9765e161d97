#!/usr/bin/env python
"""Queue scaling benchmarks (issue: durable work queue).

1. ``acquire`` latency as the number of pending tasks grows: the pending index
   is ordered, so acquire p50 must stay flat from 1k to 1M pending tasks.
2. Recovery time after N completed tasks, with journal snapshots (the
   default) and without them (replaying the whole journal).

Usage::

    .venv/bin/python benchmarks/queue_scaling.py [--root DIR] [--pending 1000,10000,100000,1000000]
        [--completed 200000] [--json out.json]

Numbers are printed as a table; nothing here is a pass/fail test.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import threading
import time

from straw import coordinator as coordinator_module
from straw.coordinator import Coordinator
from straw.protocol import Publication, Record, TaskSpec
from straw.store import SharedFilesystemStore

SUBMIT_BATCH = 1000
ACQUIRE_SAMPLES = 2000


def _fresh(root: str, name: str) -> str:
    path = os.path.join(root, name)
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    return path


def acquire_flatness(root: str, sizes: list[int]) -> list[dict[str, float]]:
    """acquire(1) p50/p99 with ``size`` tasks pending (each size in a fresh queue)."""
    rows = []
    for size in sizes:
        path = _fresh(root, f"acquire-{size}")
        store = SharedFilesystemStore(path, "scale")
        queue = Coordinator(store, exclusive_owner="bench", lease_seconds=3600)
        started = time.perf_counter()
        for base in range(0, size, SUBMIT_BATCH):
            count = min(SUBMIT_BATCH, size - base)
            queue.submit_tasks(
                f"s{base}",
                [TaskSpec(f"t{base + i:09d}", priority=(base + i) % 7) for i in range(count)],
            )
        submit_s = time.perf_counter() - started
        samples = []
        for _ in range(min(ACQUIRE_SAMPLES, size)):
            t0 = time.perf_counter()
            result = queue.acquire("w", 1)
            samples.append(time.perf_counter() - t0)
            if result.status != "acquired":
                raise RuntimeError(f"acquire answered {result.status} with tasks pending")
        samples.sort()
        rows.append(
            {
                "pending": size,
                "submit_tasks_s": size / submit_s,
                "acquire_p50_ms": statistics.median(samples) * 1e3,
                "acquire_p99_ms": samples[int(len(samples) * 0.99) - 1] * 1e3,
            }
        )
        queue.close()
        store.close()
        shutil.rmtree(path, ignore_errors=True)
    return rows


def _complete_many(queue: Coordinator, store: SharedFilesystemStore, count: int, threads: int = 4) -> None:
    """Submit and complete ``count`` tasks with 4 worker threads (results 64 bytes each)."""
    for base in range(0, count, SUBMIT_BATCH):
        queue.submit_tasks(
            f"s{base}", [TaskSpec(f"t{base + i:09d}") for i in range(min(SUBMIT_BATCH, count - base))]
        )

    def worker(k: int) -> None:
        own = SharedFilesystemStore(store.backend.root, store.run_id)
        try:
            while True:
                got = queue.acquire(f"w{k}", 64)
                if got.status != "acquired":
                    return
                leases = [a.lease for a in got.assignments]
                refs = own.publish_many(
                    [
                        Publication(
                            (
                                Record(
                                    "r",
                                    b"x" * 64,
                                    metadata={"task_id": x.task_id, "attempt_id": x.attempt_id},
                                ),
                            )
                        )
                        for x in leases
                    ],
                    submission_id=f"p-{leases[0].task_id}",
                )
                for lease, ref in zip(leases, refs, strict=True):
                    queue.complete_task(
                        lease, submission_id=f"c-{lease.task_id}", result_ref=ref, result_digest=ref.digest
                    )
        finally:
            own.close()

    pool = [threading.Thread(target=worker, args=(k,)) for k in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()


def recovery(root: str, completed: int) -> list[dict[str, float]]:
    rows = []
    for snapshots in (True, False):
        path = _fresh(root, f"recovery-{int(snapshots)}")
        store = SharedFilesystemStore(path, "scale")
        saved = coordinator_module.JOURNAL_SNAPSHOT_BYTES_MIN
        if not snapshots:
            coordinator_module.JOURNAL_SNAPSHOT_BYTES_MIN = 1 << 62  # never snapshot
        try:
            queue = Coordinator(store, exclusive_owner="bench", lease_seconds=3600)
            t0 = time.perf_counter()
            _complete_many(queue, store, completed)
            work_s = time.perf_counter() - t0
            journal = queue.metrics()["journal_bytes"]
            # Simulate a crash (no close(), so no final snapshot): drop the lock and the fd.
            queue._journal.abandon()
            coordinator_module.lock.unlock(queue._lock_fd)
            t0 = time.perf_counter()
            reopened = Coordinator(store, exclusive_owner="bench", recover=True, lease_seconds=3600)
            reopen_s = time.perf_counter() - t0
            assert reopened.metrics()["commits"] == completed
            reopened.close()
        finally:
            coordinator_module.JOURNAL_SNAPSHOT_BYTES_MIN = saved
        rows.append(
            {
                "snapshots": snapshots,
                "completed": completed,
                "cycles_s": completed / work_s,
                "journal_bytes": journal,
                "recovery_s": reopen_s,
            }
        )
        store.close()
        shutil.rmtree(path, ignore_errors=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=None, help="scratch directory (default: a temporary one)")
    parser.add_argument("--pending", default="1000,10000,100000,1000000")
    parser.add_argument("--completed", type=int, default=200_000)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    root = args.root or tempfile.mkdtemp(prefix="straw-queue-scale-")
    sizes = [int(x) for x in args.pending.split(",") if x]
    flat = acquire_flatness(root, sizes)
    print(f"{'pending':>10} {'submit tasks/s':>15} {'acquire p50 ms':>15} {'acquire p99 ms':>15}")
    for row in flat:
        print(
            f"{row['pending']:>10} {row['submit_tasks_s']:>15.0f} {row['acquire_p50_ms']:>15.3f}"
            f" {row['acquire_p99_ms']:>15.3f}"
        )
    rec = recovery(root, args.completed) if args.completed else []
    print(f"{'snapshots':>10} {'completed':>10} {'cycles/s':>10} {'journal MiB':>12} {'recovery s':>11}")
    for row in rec:
        print(
            f"{row['snapshots']!s:>10} {row['completed']:>10} {row['cycles_s']:>10.0f}"
            f" {row['journal_bytes'] / 2**20:>12.1f} {row['recovery_s']:>11.3f}"
        )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"acquire": flat, "recovery": rec}, handle, indent=2)
    if args.root is None:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
