"""Process roles of the live ``straw check`` test (tests/test_check_live.py), one OS process each.

Run as ``python tests/live_check_roles.py <role> <pool> <seed>``. Each role prints ``ready``
once it has done some work, then works until ``stop`` arrives on stdin (or
``ROLE_SECONDS_MAX`` pass), and finally prints one JSON line with its counts. Every role
keeps the pool busy in the ways that once made ``straw check`` report false errors: packs
sealed, released and collected while check lists and scans them, journal frames and
snapshots written while check reads the journal, owners replaced while check reads the
catalog.

* ``writer``: publishes small record sets (online GC), retains them under a few rotating
  owners, releases owners and ends staging, seals every few publications.
* ``collector``: loops ``collect_garbage()``.
* ``queue``: a coordinator with two worker threads: submits tasks with inputs, workers
  complete them with results from their own stores (staging ended), the training
  consumer acknowledges accepted results, and ``collect_garbage`` runs every few tasks, so
  acknowledged results are reclaimed while check runs.
"""

from __future__ import annotations

import json
import random
import select
import sys
import threading
import time
from typing import IO, Any

from straw import Coordinator, SharedFilesystemStore, TaskSpec
from straw.errors import LeaseExpired, StaleAttempt
from straw.protocol import Record, RecordSetRef

RUN = "run-live-check"
OWNER = "live-check"
#: A role never runs longer than this, even if the test never says stop.
ROLE_SECONDS_MAX = 120.0


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def stopped(commands: IO[str], started: float) -> bool:
    """Whether ``stop`` (or EOF) arrived, without waiting, or the time bound passed."""
    if time.monotonic() - started > ROLE_SECONDS_MAX:
        return True
    ready, _, _ = select.select([commands], [], [], 0)
    return bool(ready) and (commands.readline().strip() or "stop") == "stop"


def run_writer(root: str, rng: random.Random) -> dict[str, Any]:
    counts = {"published": 0, "retained": 0, "released": 0, "sealed": 0}
    started = time.monotonic()
    with SharedFilesystemStore(root, RUN, online_gc=True, segment_target_bytes=64 * 1024) as store:
        owners: dict[str, list[RecordSetRef]] = {}
        prefix = f"{rng.randrange(1 << 32):08x}"  # owners are this writer's own
        index = 0
        while index < 10 or not stopped(sys.stdin, started):
            payload = bytes(rng.randrange(256) for _ in range(rng.randrange(64, 4096)))
            ref = store.publish([Record(f"r{index}", payload)], submission_id=f"w-{index}-{rng.random()}")
            counts["published"] += 1
            owner = f"{prefix}-owner-{rng.randrange(4)}"
            owners.setdefault(owner, []).append(ref)
            store.retain(owner, owners[owner][-3:])
            counts["retained"] += 1
            store.release_publications([ref])
            if rng.random() < 0.3 and owners:
                gone = rng.choice(sorted(owners))
                store.release(gone)
                del owners[gone]
                counts["released"] += 1
            if index % 5 == 4:
                store.seal()
                counts["sealed"] += 1
            if index == 10:
                say("ready")
            index += 1
    return counts


def run_collector(root: str, rng: random.Random) -> dict[str, Any]:
    counts = {"passes": 0, "reclaimed": 0}
    started = time.monotonic()
    with SharedFilesystemStore(root, RUN) as store:
        while counts["passes"] < 3 or not stopped(sys.stdin, started):
            counts["reclaimed"] += store.collect_garbage()["reclaimed_files"]
            counts["passes"] += 1
            if counts["passes"] == 3:
                say("ready")
    return counts


class _Queue:
    """The coordinator and its bookkeeping, shared by the worker threads."""

    def __init__(self, root: str, rng: random.Random) -> None:
        self.store = SharedFilesystemStore(root, RUN, online_gc=True, segment_target_bytes=64 * 1024)
        self.coord = Coordinator(self.store, exclusive_owner=OWNER, lease_seconds=600)
        self.token = self.coord.open_consumer("training", exclusive_owner="trainer")
        self.rng = rng
        self.lock = threading.Lock()
        self.acknowledging = threading.Lock()  # the one trainer (acknowledge)
        self.counts = {"submitted": 0, "completed": 0, "acknowledged": 0, "collections": 0, "reclaimed": 0}
        self.errors: list[str] = []

    def submit(self, batch: int) -> None:
        with self.lock:
            first = self.counts["submitted"]
            self.counts["submitted"] += batch
        specs = []
        for i in range(first, first + batch):
            ref = self.store.publish([Record(f"in-{i}", b"prompt %d" % i)], submission_id=f"in-{i}")
            self.store.release_publications([ref])
            specs.append(TaskSpec(f"t{i}", input_ref=ref))
        self.coord.submit_tasks(f"submit-{first}", specs)

    def acknowledge(self) -> None:
        """The training consumer processed every accepted result so far.

        One trainer: the workers acknowledge one at a time, so the cursor only moves forward
        (a smaller cursor saved after a larger one is a rewind, which the queue refuses once
        the results in between were collected)."""
        with self.acknowledging:
            commits = len(self.coord.commits)
            if commits <= self.counts["acknowledged"]:
                return
            state = self.store.publish([Record("state", b"%d" % commits)], submission_id=f"state-{commits}")
            self.store.release_publications([state])
            self.coord.save_consumer_state(
                "training",
                token=self.token,
                request_id=f"ack-{commits}",
                state_ref=state,
                fetch_cursor=commits,
                processed_cursor=commits,
            )
            result = self.coord.collect_garbage()
            with self.lock:
                self.counts["acknowledged"] = commits
                self.counts["collections"] += 1
                self.counts["reclaimed"] += result["reclaimed_files"]

    def work(self, name: str, stop: threading.Event) -> None:
        with SharedFilesystemStore(self.store.backend.root, RUN, online_gc=True) as mine:
            while not stop.is_set():
                acquired = self.coord.acquire(name)
                if acquired.status != "acquired":
                    self.submit(4)
                    continue
                lease = acquired.assignments[0].lease
                metadata = {"task_id": lease.task_id, "attempt_id": lease.attempt_id}
                ref = mine.publish(
                    [Record(f"out-{lease.task_id}", b"result " * 20, metadata=metadata)],
                    submission_id=f"out-{lease.task_id}-{lease.attempt_id}",
                )
                try:
                    self.coord.complete_task(
                        lease, submission_id=f"sub-{lease.task_id}", result_ref=ref, result_digest=ref.digest
                    )
                except (StaleAttempt, LeaseExpired) as error:
                    self.errors.append(repr(error))
                mine.release_publications([ref])
                with self.lock:
                    self.counts["completed"] += 1
                    due = self.counts["completed"] % 3 == 0
                if due:
                    self.acknowledge()


def run_queue(root: str, rng: random.Random) -> dict[str, Any]:
    queue = _Queue(root, rng)
    started = time.monotonic()
    stop = threading.Event()
    failures: list[BaseException] = []

    def guarded(name: str) -> None:
        try:
            queue.work(name, stop)
        except BaseException as error:  # reported in the final line, failing the test
            failures.append(error)
            stop.set()

    threads = [threading.Thread(target=guarded, args=(f"worker-{n}",)) for n in range(2)]
    queue.submit(8)
    for thread in threads:
        thread.start()
    readied = False
    while not stop.is_set():
        if not readied and queue.counts["collections"] >= 2:
            say("ready")
            readied = True
        if stopped(sys.stdin, started):
            break
        select.select([sys.stdin], [], [], 0.05)  # wait for stdin a little, not a sleep loop
    stop.set()
    for thread in threads:
        thread.join(60)
    queue.coord.close()
    queue.store.close()
    if failures:
        raise failures[0]
    return dict(queue.counts, errors=len(queue.errors))


ROLES = {"writer": run_writer, "collector": run_collector, "queue": run_queue}


def main(argv: list[str]) -> None:
    role, root, seed = argv[1], argv[2], int(argv[3])
    counts = ROLES[role](root, random.Random(seed))
    say(json.dumps({"role": role, **counts}, sort_keys=True))


if __name__ == "__main__":
    main(sys.argv)
