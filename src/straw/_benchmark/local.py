"""``straw-benchmark run --local``: an end-to-end queue benchmark on this host, within a budget.

The driver makes a fresh ``--root``, opens a coordinator there and serves it with
``straw.rpc`` on 127.0.0.1 (a random token in ``<root>/rpc.token``, mode 0600), submits one
task per planned publication and seals the input, then starts one worker process. Its
writer threads take tasks through the transport, publish records of ``--record-bytes``
to the pool and complete the tasks; its reader threads follow the accepted log and read
every result back, verified. The driver checks the result (every publication accepted and
read once) and writes ``--report``.

The run is bounded: the planned volume must fit ``--max-gib`` and ``--max-files`` before
anything starts, and while the worker runs the driver counts the files and bytes under
the root; past either budget, or past ``--timeout``, it stops the worker and fails. A
failed run keeps its root untouched as evidence; ``<report>.cleanup.json`` always says
whether the workers were stopped and whether the root was removed (only after a pass).
Only ``--local`` is supported: remote hosts are out of scope.
"""

from __future__ import annotations

import argparse
import json
import secrets
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from straw.coordinator import Coordinator
from straw.limits import GiB, MiB
from straw.protocol import Lease, Record, RecordSetRef, TaskSpec
from straw.reporting import write_report
from straw.rpc import QueueClient, start_server
from straw.store import SharedFilesystemStore

__all__ = ["add_run_arguments", "add_worker_arguments", "run", "worker"]

#: Per-publication allowance for framing and the index when planning files (generous).
_OVERHEAD_BYTES = 4096
#: Files of the pool besides data packs (journal, catalog, locks, logs, reports).
_FIXED_FILES = 32
#: Seconds between two budget checks of the driver while the worker runs.
_POLL_S = 0.2
#: Longest a caught-up reader waits for a writer of its own process before asking again (writers
#: of other worker processes wake nobody here, so the wait is bounded).
_CAUGHT_UP_WAIT_S = 0.01
_RUN_ID = "benchmark"
_STOP = "STOP"


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    _workload(parser)
    parser.add_argument("--local", action="store_true", required=True, help="run one worker on this host")
    parser.add_argument("--report", required=True, help="JSON report, outside --root")
    parser.add_argument("--gib", type=float, default=1.0, help="payload volume to write (GiB)")
    parser.add_argument("--max-gib", type=float, default=64.0, help="bytes budget of --root (GiB)")
    parser.add_argument("--max-files", type=int, default=256, help="files budget of --root")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds before the run is stopped")


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    _workload(parser)
    parser.add_argument("--address", required=True, help="http://host:port of the served coordinator")


def _workload(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--root", required=True, help="a directory that does not exist yet")
    parser.add_argument(
        "--record-bytes", nargs="+", type=int, default=[MiB], help="record sizes of one publication"
    )
    parser.add_argument("--writers", type=int, default=2, help="writer threads")
    parser.add_argument("--readers", type=int, default=2, help="reader threads")
    parser.add_argument("--segment-mib", type=int, default=256, help="pack size target (MiB)")


def _plan(args: argparse.Namespace) -> int:
    """Publications to write; ``ValueError`` for a bad or over-budget request (nothing created yet)."""
    sizes = args.record_bytes
    if not sizes or any(n <= 0 for n in sizes):
        raise ValueError("--record-bytes needs positive sizes")
    if min(args.writers, args.readers, args.max_files, args.segment_mib) <= 0 or not args.timeout > 0:
        raise ValueError("--writers, --readers, --max-files, --segment-mib and --timeout must be positive")
    if not 0 < args.gib <= args.max_gib:
        raise ValueError("--gib must be positive and at most --max-gib")
    root, report = Path(args.root).resolve(), Path(args.report).resolve()
    if report.is_relative_to(root):
        raise ValueError("--report must live outside --root (a passed run removes the root)")
    if root.exists():
        raise ValueError(f"--root {root} exists: a run starts from a fresh directory")
    publication = sum(sizes)
    count = max(1, int(args.gib * GiB / publication))
    per_pack = max(1, args.segment_mib * MiB // (publication + _OVERHEAD_BYTES * (len(sizes) + 1)))
    packs = -(-count // per_pack) + args.writers - 1  # every writer may leave one partial pack
    if count * publication > args.max_gib * GiB or packs + _FIXED_FILES > args.max_files:
        raise ValueError(
            f"{count} publications of {publication} bytes need about {packs + _FIXED_FILES} files: "
            "over --max-files or --max-gib"
        )
    return count


def _usage(root: Path) -> tuple[int, int]:
    files = [p for p in root.rglob("*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


def run(args: argparse.Namespace) -> int:
    """The driver; returns the exit code (0 passed, 1 failed, 2 bad arguments)."""
    try:
        count = _plan(args)
    except ValueError as error:
        print(f"straw-benchmark: error: {error}", file=sys.stderr)
        return 2
    root, report_path = Path(args.root).resolve(), Path(args.report).resolve()
    root.mkdir(parents=True)
    token_file = root / "rpc.token"
    token_file.write_text(secrets.token_hex(32))
    token_file.chmod(0o600)
    coordinator = Coordinator(
        SharedFilesystemStore(root / "queue", _RUN_ID), exclusive_owner="benchmark driver"
    )
    server = start_server(coordinator, ("127.0.0.1", 0), token=token_file.read_text())
    process: subprocess.Popen[bytes] | None = None
    completed = False
    try:
        for start in range(0, count, 256):
            tasks = [TaskSpec(f"publication-{i}") for i in range(start, min(count, start + 256))]
            coordinator.submit_tasks(f"submit-{start}", tasks)
        coordinator.seal_input("all-submitted")
        command = [sys.executable, "-m", "straw.benchmark", "worker", "--root", str(root)]
        command += ["--address", f"http://127.0.0.1:{server.server_address[1]}"]
        command += ["--writers", str(args.writers), "--readers", str(args.readers)]
        command += ["--segment-mib", str(args.segment_mib), "--record-bytes", *map(str, args.record_bytes)]
        with (root / "worker.log").open("wb") as log:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        report = _watch(args, root, process, coordinator, count)
        write_report(report_path, report)
        print(json.dumps({k: v for k, v in report.items() if k != "coordinator"}, indent=2))
        completed = True
        return 0
    except (RuntimeError, TimeoutError, OSError, ValueError) as error:
        print(f"straw-benchmark: error: {error}; the root is kept at {root}", file=sys.stderr)
        return 1
    finally:
        stopped = _stop(root, process)
        server.shutdown()
        server.server_close()
        coordinator.close()
        files, size = _usage(root)
        cleanup = {"root": str(root), "files": files, "bytes": size, "workers_stopped": stopped}
        write_report(report_path.with_suffix(".cleanup.json"), {**cleanup, "removed": completed and stopped})
        if completed and stopped:
            shutil.rmtree(root)


def _watch(
    args: argparse.Namespace,
    root: Path,
    process: subprocess.Popen[bytes],
    coordinator: Coordinator,
    count: int,
) -> dict[str, Any]:
    """Wait for the worker while holding it to the budgets; its checked report."""
    deadline = time.monotonic() + args.timeout
    code: int | None = None
    while code is None:
        try:
            code = process.wait(timeout=_POLL_S)
        except subprocess.TimeoutExpired:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the worker did not finish within --timeout {args.timeout}s") from None
        # Checked while it runs and once more after it ended: a run over budget fails either way.
        files, size = _usage(root)
        if files > args.max_files or size > args.max_gib * GiB:
            raise RuntimeError(
                f"benchmark temporary storage limit exceeded: {files} files, {size} bytes under {root} "
                f"(budget {args.max_files} files, {args.max_gib} GiB)"
            )
    if code != 0:
        raise RuntimeError(f"the worker failed with exit code {code}; see {root / 'worker.log'}")
    worker = json.loads((root / "worker.json").read_text())
    if worker["publications"] != count or worker["read_bytes"] != worker["written_bytes"]:
        raise RuntimeError(f"the worker's counts do not match the plan of {count} publications: {worker}")
    seconds = max(worker["seconds"], 1e-9)
    return {
        "version": 1,
        "status": "passed",
        "publications": count,
        "written_bytes": worker["written_bytes"],
        "read_bytes": worker["read_bytes"],
        "seconds": worker["seconds"],
        "write_mib_s": worker["written_bytes"] / MiB / seconds,
        "read_mib_s": worker["read_bytes"] / MiB / seconds,
        "files": files,  # counted once more after the worker ended, just above
        "coordinator": coordinator.metrics(),
        "parameters": {k: v for k, v in vars(args).items() if k != "func"},
    }


def _stop(root: Path, process: subprocess.Popen[bytes] | None) -> bool:
    """Ask the worker to stop (a STOP file it polls), then end it; True once it has exited."""
    if process is None:
        return True
    (root / _STOP).touch()
    for end in (None, process.terminate, process.kill):
        if end is not None:
            end()
        try:
            process.wait(timeout=15)
            return True
        except subprocess.TimeoutExpired:
            continue
    return False


# -------------------------------------------------------------------------------- the worker


class _Worker:
    """Writer and reader threads of one worker process (all control through the transport)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.root = Path(args.root)
        self.args = args
        self.client = QueueClient(args.address, token=(self.root / "rpc.token").read_text())
        self.lock = threading.Lock()
        #: Notified when a writer of this process completes a task, so caught-up readers wait
        #: instead of asking for an empty page in a tight loop (CPU the writers need).
        self.published = threading.Condition(self.lock)
        self.counts = {"publications": 0, "written_bytes": 0, "read_bytes": 0}
        self.failures: list[BaseException] = []

    def stopped(self) -> bool:
        return bool(self.failures) or (self.root / _STOP).exists()

    def add(self, **counts: int) -> None:
        with self.lock:
            for key, value in counts.items():
                self.counts[key] += value
            if counts.get("publications"):
                self.published.notify_all()

    def write(self, rank: int) -> None:
        payloads = [bytes([(rank + n) % 251]) * size for n, size in enumerate(self.args.record_bytes)]
        with SharedFilesystemStore(
            self.root / "queue", _RUN_ID, segment_target_bytes=self.args.segment_mib * MiB
        ) as store:
            while not self.stopped():
                granted = self.client.call("acquire", worker_id=f"writer-{rank}", max_tasks=1)
                if granted["status"] == "end_of_input":
                    return
                for assignment in granted["assignments"]:
                    lease = Lease.from_dict(assignment["lease"])
                    tag = {"task_id": lease.task_id, "attempt_id": lease.attempt_id}
                    records = [
                        Record(f"{lease.task_id}/{n}", p, metadata=tag) for n, p in enumerate(payloads)
                    ]
                    ref = store.publish(records, submission_id=f"{lease.task_id}/{lease.attempt_id}")
                    self.client.call(
                        "complete_task",
                        lease=lease,
                        submission_id=f"complete-{lease.task_id}",
                        result_ref=ref,
                        result_digest=ref.digest,
                    )
                    self.add(publications=1, written_bytes=ref.payload_bytes)

    def read(self, rank: int) -> None:
        cursor = 0
        with SharedFilesystemStore(self.root / "queue", _RUN_ID) as store:
            while not self.stopped():
                page = self.client.call("read_commits", cursor=cursor, limit=256)
                for position, commit in enumerate(page["commits"], cursor):
                    if position % self.args.readers == rank:
                        ref = RecordSetRef.from_dict(commit["result_ref"])
                        self.add(read_bytes=sum(len(r.payload) for r in store.read(ref)))
                cursor = page["cursor"]
                if page["end_of_input"] and not page["commits"]:
                    return
                if not page["commits"]:
                    with self.published:
                        self.published.wait(_CAUGHT_UP_WAIT_S)

    def guarded(self, body: Any, rank: int) -> None:
        try:
            body(rank)
        except BaseException as error:
            self.failures.append(error)


def worker(args: argparse.Namespace) -> int:
    """One worker process: returns 0 once every task is done and every result read back."""
    job = _Worker(args)
    started = time.monotonic()
    threads = [threading.Thread(target=job.guarded, args=(job.write, r)) for r in range(args.writers)]
    threads += [threading.Thread(target=job.guarded, args=(job.read, r)) for r in range(args.readers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if job.failures:
        print(f"straw-benchmark worker: error: {job.failures[0]!r}", file=sys.stderr)
        return 1
    if (job.root / _STOP).exists():
        print("straw-benchmark worker: stopped by the driver", file=sys.stderr)
        return 1
    write_report(job.root / "worker.json", {**job.counts, "seconds": time.monotonic() - started})
    return 0
