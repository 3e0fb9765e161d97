#!/usr/bin/env python
"""Queue scaling benchmarks (issue: durable work queue).

1. ``acquire`` latency as the number of pending tasks grows: the pending index
   is ordered, so acquire p50 must stay flat from 1k to 1M pending tasks.
2. Recovery time after N completed tasks, with journal snapshots (the
   default) and without them (replaying the whole journal).
3. History at RL scale (issue 12's table, ``--history 100000,1000000``): 4 worker
   threads run acquire(64) -> publish_many -> complete_task over N tasks, fed in waves
   of SUBMIT_BATCH while at most BACKLOG are unfinished (as an RL job's steps do), with
   default Limits. It prints the coordinator process's RSS at the end (live) and its
   peak, the slowest and the p99 ``complete_task`` (and how many took over 100 ms), the
   journal's syncs (mean and slowest: the device's share of a ``complete_task``'s wait), the
   cycle p50 (a batch's wall time over its tasks), close() time, the queue's files per
   completed task, and, in a fresh process (so freed memory does not count), the reopen
   time, the RSS after it and ``lookup_submission`` of the first task (p50). With
   ``--batched`` each worker completes its 64 results with one ``complete_tasks`` call.
   ``--threads 1,2,4`` repeats each count with that many worker threads (default 4): the
   complete_task tail grows with the threads that share the interpreter's lock.

Usage::

    .venv/bin/python benchmarks/queue_scaling.py [--root DIR] [--pending 1000,10000,100000,1000000]
        [--completed 200000] [--history 100000] [--threads 4] [--json out.json]

Numbers are printed as a table; nothing here is a pass/fail test.
"""

from __future__ import annotations

import argparse
import array
import json
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc

from straw import coordinator as coordinator_module
from straw.coordinator import Coordinator
from straw.protocol import Lease, Publication, Record, RecordSetRef, TaskSpec
from straw.store import SharedFilesystemStore

SUBMIT_BATCH = 1000
ACQUIRE_SAMPLES = 2000
#: Unfinished tasks at most in the history benchmark (live work stays bounded, history grows).
BACKLOG = 8192
#: A complete_task slower than this counts as a stall.
STALL_S = 0.1


def publish_results(store: SharedFilesystemStore, leases: list[Lease]) -> list[RecordSetRef]:
    """One small result per lease, published as one batch (the workload's publish step)."""
    return store.publish_many(
        [
            Publication(
                (Record("r", b"x" * 64, metadata={"task_id": x.task_id, "attempt_id": x.attempt_id}),)
            )
            for x in leases
        ],
        submission_id=f"p-{leases[0].task_id}",
    )


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
                refs = publish_results(own, leases)
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


def _rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _Latencies:
    """Latencies in a fixed histogram (buckets 1% apart from 1 us), one per worker thread: the
    history runs measure the coordinator's RSS, and a C double per call (80 MB at 10M tasks)
    counted in it as if the queue held it. The maximum and the calls over STALL_S are exact;
    a percentile is its bucket's upper bound (within 1%)."""

    RATIO = 1.01
    LOW = 1e-6
    BUCKETS = 2000  # up to about 440 s

    def __init__(self) -> None:
        self.counts = array.array("Q", bytes(8 * self.BUCKETS))
        self.total = self.stalls = 0
        self.max = 0.0

    def add(self, seconds: float) -> None:
        at = 0 if seconds <= self.LOW else int(math.log(seconds / self.LOW, self.RATIO)) + 1
        self.counts[min(at, self.BUCKETS - 1)] += 1
        self.total += 1
        self.stalls += seconds > STALL_S
        self.max = max(self.max, seconds)

    def merge(self, other: _Latencies) -> None:
        for at, count in enumerate(other.counts):
            self.counts[at] += count
        self.total += other.total
        self.stalls += other.stalls
        self.max = max(self.max, other.max)

    def percentile(self, fraction: float) -> float:
        wanted, seen = min(self.total - 1, int(self.total * fraction)), 0
        for at, count in enumerate(self.counts):
            seen += count
            if seen > wanted:
                return min(self.max, self.LOW * self.RATIO**at)
        return self.max


class _Feed:
    """Submits tasks in waves while fewer than BACKLOG are unfinished; seals once all are in."""

    def __init__(self, queue: Coordinator, total: int) -> None:
        self.queue, self.total = queue, total
        self.submitted = self.finished = 0
        self.cv = threading.Condition()

    def run(self) -> None:
        while True:
            with self.cv:
                while self.submitted - self.finished >= BACKLOG:
                    self.cv.wait()
                if self.submitted >= self.total:
                    break
                base = self.submitted
                count = min(SUBMIT_BATCH, self.total - base)
            self.queue.submit_tasks(f"s{base}", [TaskSpec(f"t{base + i:09d}") for i in range(count)])
            with self.cv:
                self.submitted += count
                self.cv.notify_all()
        self.queue.seal_input("sealed")
        with self.cv:
            self.cv.notify_all()

    def done(self, count: int) -> None:
        with self.cv:
            self.finished += count
            self.cv.notify_all()

    def wait_for_work(self) -> bool:
        """After an ``empty`` answer: False once everything was submitted and finished."""
        with self.cv:
            seen = self.submitted
            while self.submitted == seen and self.finished < self.total:
                self.cv.wait()
            return self.finished < self.total


def _history_workers(
    queue: Coordinator, store: SharedFilesystemStore, feed: _Feed, threads: int, batched: bool
) -> dict[str, _Latencies]:
    # Latencies in fixed histograms (one per thread): a value per call would count in the RSS.
    completes = _Latencies()
    cycles = _Latencies()
    lock = threading.Lock()

    def worker(k: int) -> None:
        own_completes, own_cycles = _Latencies(), _Latencies()
        try:
            _history_worker(k, own_completes, own_cycles)
        finally:
            with lock:
                completes.merge(own_completes)
                cycles.merge(own_cycles)

    def _history_worker(k: int, completes: _Latencies, cycles: _Latencies) -> None:
        own = SharedFilesystemStore(store.backend.root, store.run_id)
        try:
            while True:
                t0 = time.perf_counter()
                got = queue.acquire(f"w{k}", 64)
                if got.status == "empty":
                    if not feed.wait_for_work():
                        return
                    continue
                if got.status != "acquired":
                    return
                leases = [a.lease for a in got.assignments]
                refs = publish_results(own, leases)
                if batched:  # one complete_tasks call (one transaction) for the whole batch
                    c0 = time.perf_counter()
                    queue.complete_tasks(
                        [
                            {
                                "lease": x,
                                "submission_id": f"c-{x.task_id}",
                                "result_ref": r,
                                "result_digest": r.digest,
                            }
                            for x, r in zip(leases, refs, strict=True)
                        ]
                    )
                    completes.add(time.perf_counter() - c0)
                else:
                    for lease, ref in zip(leases, refs, strict=True):
                        c0 = time.perf_counter()
                        queue.complete_task(
                            lease,
                            submission_id=f"c-{lease.task_id}",
                            result_ref=ref,
                            result_digest=ref.digest,
                        )
                        completes.add(time.perf_counter() - c0)
                cycles.add((time.perf_counter() - t0) / len(leases))
                feed.done(len(leases))
        finally:
            own.close()

    pool = [threading.Thread(target=worker, args=(k,)) for k in range(threads)]
    for thread in pool:
        thread.start()
    feed.run()
    for thread in pool:
        thread.join()
    return {"complete": completes, "cycle": cycles}


#: Lines of the allocation census (``--census``).
CENSUS_LINES = 25


def _print_census(completed: int) -> None:
    """The live allocations at the end of a history run grouped by where they were made, to
    stderr; with ``--census`` each run also saves its snapshot, and the second run's census
    lists what grew against the first (what grows with completed history)."""
    snapshot = tracemalloc.take_snapshot().filter_traces(
        (tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.Filter(False, "<frozen *>"))
    )
    total = sum(stat.size for stat in snapshot.statistics("filename"))
    out = sys.stderr
    out.write(f"census at {completed} completed: {total / 2**20:.1f} MiB traced\n")
    for stat in snapshot.statistics("lineno")[:CENSUS_LINES]:
        out.write(f"  {stat.size / 2**20:8.2f} MiB {stat.count:>9} blocks  {stat.traceback[0]}\n")
    previous = _CENSUS.get("last")
    if previous is not None:
        before, count = previous
        grown = snapshot.compare_to(before, "traceback")
        out.write(f"grew from {count} to {completed} completed (bytes per added task):\n")
        for diff in grown[:CENSUS_LINES]:
            per = diff.size_diff / max(1, completed - count)
            out.write(
                f"  {diff.size_diff / 2**20:+8.2f} MiB {per:7.1f} B/task  {diff.count_diff:+9} blocks\n"
            )
            for frame in diff.traceback.format()[-2 * CENSUS_FRAMES :]:
                out.write(f"      {frame}\n")
    _CENSUS["last"] = (snapshot, completed)
    if _CENSUS_DUMP:
        snapshot.dump(f"{_CENSUS_DUMP[0]}.{completed}")  # compare runs of separate processes later
    out.flush()


#: Frames kept per allocation by ``--census`` (the census groups by these tracebacks).
CENSUS_FRAMES = 4
_CENSUS: dict[str, tuple[tracemalloc.Snapshot, int]] = {}
_CENSUS_DUMP: list[str] = []


def _queue_bytes(directory: str) -> int:
    total = 0
    for base, _, names in os.walk(directory):
        total += sum(os.path.getsize(os.path.join(base, name)) for name in names)
    return total


def history(root: str, completed: int, threads: int = 4, batched: bool = False) -> dict[str, float]:
    """Issue 12's table for ``completed`` tasks (module docs, item 3). ``batched``: each worker
    completes its 64 results with one ``complete_tasks`` call (its latency is that call's)."""
    path = _fresh(root, f"history-{completed}")
    store = SharedFilesystemStore(path, "scale")
    queue = Coordinator(store, exclusive_owner="bench", lease_seconds=3600)
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    times = _history_workers(queue, store, _Feed(queue, completed), threads, batched)
    work_s = time.perf_counter() - t0
    rss_live = _rss_bytes()
    if tracemalloc.is_tracing():
        _print_census(completed)
    metrics = queue.metrics()
    snapshots = metrics["journal"]["snapshots"]  # taken during the run (close adds one)
    # The longest copy of the state a snapshot took under the lock (J5.1; absent before it).
    copy_ms = metrics.get("snapshot_copy_seconds_max", float("nan")) * 1e3
    # The device's share of a complete_task's wait: what the journal's syncs took.
    journal = metrics["journal"]
    sync_mean_ms = journal["sync_us_total"] / max(1, journal["syncs"]) / 1e3
    sync_max_ms = journal["sync_us_max"] / 1e3
    completes, cycles = times["complete"], times["cycle"]
    t0 = time.perf_counter()
    queue.close()
    close_s = time.perf_counter() - t0
    store.close()
    row: dict[str, float] = {
        "completed": completed,
        "threads": threads,
        "batched": batched,
        "rss_live_mib": rss_live / 2**20,
        "rss_peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "complete_max_ms": completes.max * 1e3,
        "complete_p99_ms": completes.percentile(0.99) * 1e3,
        "stalls_over_100ms": completes.stalls,
        "cycle_p50_ms": cycles.percentile(0.5) * 1e3,
        "tasks_s": completed / work_s,
        "close_s": close_s,
        "queue_bytes_per_task": _queue_bytes(queue.directory) / completed,
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
        "snapshots": snapshots,
        "snapshot_copy_max_ms": copy_ms,
        "journal_sync_mean_ms": sync_mean_ms,
        "journal_sync_max_ms": sync_max_ms,
    }
    reopened = subprocess.run(
        [sys.executable, __file__, "--reopen", path], check=True, capture_output=True, text=True
    )
    row.update(json.loads(reopened.stdout.splitlines()[-1]))
    shutil.rmtree(path, ignore_errors=True)
    return row


def reopen(path: str) -> None:
    """The child side of ``history``: reopen the queue, measure, print one JSON line."""
    store = SharedFilesystemStore(path, "scale")
    t0 = time.perf_counter()
    queue = Coordinator(store, exclusive_owner="bench", recover=True, lease_seconds=3600)
    reopen_s = time.perf_counter() - t0
    rss = _rss_bytes()
    samples = []
    for _ in range(200):
        s0 = time.perf_counter()
        found = queue.lookup_submission("c-t000000000")
        samples.append(time.perf_counter() - s0)
        if found is None or found.task_id != "t000000000":
            raise RuntimeError("the first task's receipt is missing after reopen")
    queue.close()
    store.close()
    print(
        json.dumps(
            {
                "reopen_s": reopen_s,
                "rss_reopen_mib": rss / 2**20,
                "lookup_first_p50_ms": statistics.median(samples) * 1e3,
            }
        )
    )


HISTORY_COLUMNS = (
    ("completed", "completed", "{:.0f}"),
    ("threads", "threads", "{:.0f}"),
    ("batched", "complete_tasks(64)", "{!s}"),
    ("rss_live_mib", "RSS live MiB", "{:.0f}"),
    ("rss_peak_mib", "RSS peak MiB", "{:.0f}"),
    ("rss_reopen_mib", "RSS reopen MiB", "{:.0f}"),
    ("reopen_s", "reopen s", "{:.2f}"),
    ("complete_max_ms", "slowest complete ms", "{:.1f}"),
    ("complete_p99_ms", "complete p99 ms", "{:.2f}"),
    ("journal_sync_mean_ms", "journal sync mean ms", "{:.2f}"),
    ("journal_sync_max_ms", "journal sync max ms", "{:.1f}"),
    ("stalls_over_100ms", "over 100 ms", "{:.0f}"),
    ("cycle_p50_ms", "cycle p50 ms", "{:.3f}"),
    ("tasks_s", "tasks/s", "{:.0f}"),
    ("close_s", "close s", "{:.2f}"),
    ("queue_bytes_per_task", "queue B/task", "{:.0f}"),
    ("lookup_first_p50_ms", "lookup first p50 ms", "{:.3f}"),
    ("snapshots", "snapshots in run", "{:.0f}"),
    ("snapshot_copy_max_ms", "longest copy ms", "{:.1f}"),
    ("load_before", "load before", "{:.1f}"),
    ("load_after", "load after", "{:.1f}"),
)


def print_history(rows: list[dict[str, float]]) -> None:
    print(" | ".join(title for _, title, _ in HISTORY_COLUMNS))
    for row in rows:
        print(" | ".join(form.format(row[key]) for key, _, form in HISTORY_COLUMNS))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=None, help="scratch directory (default: a temporary one)")
    parser.add_argument("--pending", default="1000,10000,100000,1000000")
    parser.add_argument("--completed", type=int, default=200_000)
    parser.add_argument("--history", default="", help="completed-task counts for the history table")
    parser.add_argument(
        "--snapshot-mib",
        type=float,
        default=None,
        help="snapshot threshold for the history runs (default: JOURNAL_SNAPSHOT_BYTES_MIN), to meet "
        "mid-run snapshots at smaller counts",
    )
    parser.add_argument("--batched", action="store_true", help="history runs complete with complete_tasks")
    parser.add_argument(
        "--threads", default="4", help="worker threads of the history runs (a list repeats them)"
    )
    parser.add_argument(
        "--census",
        action="store_true",
        help="trace allocations (slower) and print, after each history run, the top live allocations "
        "by file:line and what grew since the previous run",
    )
    parser.add_argument(
        "--census-dump", default=None, help="with --census: save each snapshot to PATH.<count>"
    )
    parser.add_argument("--reopen", default=None, help=argparse.SUPPRESS)  # the history child
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.reopen:
        reopen(args.reopen)
        return
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
    if args.snapshot_mib is not None:
        coordinator_module.JOURNAL_SNAPSHOT_BYTES_MIN = int(args.snapshot_mib * 2**20)
    if args.census:
        tracemalloc.start(CENSUS_FRAMES)
        if args.census_dump:
            _CENSUS_DUMP.append(args.census_dump)
    hist = [
        history(root, int(n), threads=int(k), batched=args.batched)
        for n in args.history.split(",")
        if n
        for k in args.threads.split(",")
        if k
    ]
    if hist:
        print_history(hist)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"acquire": flat, "recovery": rec, "history": hist}, handle, indent=2)
    if args.root is None:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
