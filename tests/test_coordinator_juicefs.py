"""The coordinator across two real JuiceFS clients of one volume (profile ``juicefs``, A5, A8).

* A coordinator on client A holds the queue; a coordinator on client B (the same pool through
  the other mount) is refused with ``UnsafeRecovery``, with or without ``recover=True`` (I9).
  After A closes, B recovers and sees every commit, the pending order and the results' bytes.
* A coordinator process on client A is killed with ``SIGKILL`` mid-stream; while it lived B
  was refused; afterwards B recovers and finds every receipt the process printed, then
  finishes the work with exactly one result per task (I8).

This file is also the child program: ``python tests/test_coordinator_juicefs.py work <pool> <declaration>``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO, Any

import pytest

import queue_helpers as qh
from straw import Coordinator, SharedFilesystemStore, TaskSpec
from straw._fs import lock
from straw.backend import FilesystemBackend
from straw.errors import UnsafeRecovery
from straw.protocol import CommitReceipt, as_dict

pytestmark = pytest.mark.juicefs

RUN = "run-coordinator-juicefs"
OWNER = "juicefs-test"
HERE = Path(__file__).resolve()
CHILD_TIMEOUT_S = 60.0
#: Bound on how long the JuiceFS session may take to drop a dead holder's flock.
LOCK_RELEASE_TIMEOUT_S = 30.0
TASKS = 40


def open_store(root: str | Path, declaration: dict[str, Any]) -> SharedFilesystemStore:
    backend = FilesystemBackend(root, profile="juicefs", declaration=declaration)
    return SharedFilesystemStore(root, RUN, backend=backend)


def open_queue(store: SharedFilesystemStore, *, recover: bool) -> Coordinator:
    return Coordinator(store, exclusive_owner=OWNER, recover=recover)


def wait_for_lock_release(lock_path: Path) -> None:
    """Block (in a helper thread, bounded) until nobody holds the queue's flock, then drop it."""
    fd = lock.open_lock_file(str(lock_path))
    taken = threading.Event()

    def take() -> None:
        lock.lock_exclusive(fd)
        taken.set()

    waiter = threading.Thread(target=take, daemon=True)
    waiter.start()
    try:
        assert taken.wait(LOCK_RELEASE_TIMEOUT_S), "the killed holder's lock was never released"
        lock.unlock_only(fd)
    finally:
        if taken.is_set():
            os.close(fd)


# --------------------------------------------------------------------------- the child program


def work(root: str, declaration: dict[str, Any], out: IO[str], stdin: IO[str]) -> None:
    coord = open_queue(open_store(root, declaration), recover=True)
    out.write(json.dumps({"ready": coord.epoch}) + "\n")
    out.flush()
    while not isinstance(receipt := qh.work_one(coord, "child"), str):
        out.write(json.dumps(as_dict(receipt)) + "\n")
        out.flush()
    out.write(json.dumps({"status": receipt}) + "\n")
    out.flush()
    stdin.readline()  # keep holding the queue until killed


# --------------------------------------------------------------------------- tests


def test_i9_client_b_is_refused_while_client_a_holds_the_queue_then_sees_every_commit(
    juicefs_pool: tuple[Path, Path], juicefs_clients: Any
) -> None:
    on_a, on_b = juicefs_pool
    declaration = juicefs_clients.declaration
    with open_store(on_a, declaration) as store_a, open_store(on_b, declaration) as store_b:
        coord_a = open_queue(store_a, recover=False)
        coord_a.submit_tasks("all", [TaskSpec(f"t{i:03d}", priority=i % 3) for i in range(12)])
        receipts = [qh.work_one(coord_a, "a") for _ in range(5)]
        coord_a.seal_input("sealed")
        for recover in (False, True):
            with pytest.raises(UnsafeRecovery, match="held by a live coordinator"):
                open_queue(store_b, recover=recover)
        commits, pending = coord_a.commits, [s.task_id for s in coord_a.pending_tasks()]
        coord_a.close()
        coord_b = open_queue(store_b, recover=True)
        assert coord_b.epoch == 2
        assert coord_b.commits == commits
        assert [s.task_id for s in coord_b.pending_tasks()] == pending
        for receipt in receipts:
            assert isinstance(receipt, CommitReceipt)
            assert coord_b.lookup_submission(receipt.submission_id) == receipt
            (record,) = store_b.read(receipt.result_ref)  # bytes written through A, read through B
            assert bytes(record.payload) == qh.work_payload(receipt.task_id)
        while not isinstance(status := qh.work_one(coord_b, "b"), str):
            pass
        assert status == "end_of_input"
        assert sorted(c["task_id"] for c in coord_b.commits) == [f"t{i:03d}" for i in range(12)]
        coord_b.close()


def test_i8_after_sigkill_on_client_a_client_b_recovers_every_printed_commit(
    juicefs_pool: tuple[Path, Path], juicefs_clients: Any
) -> None:
    on_a, on_b = juicefs_pool
    declaration = juicefs_clients.declaration
    with open_store(on_a, declaration) as store_a:
        coord = open_queue(store_a, recover=False)
        coord.submit_tasks("all", [TaskSpec(f"t{i:03d}") for i in range(TASKS)])
        coord.seal_input("sealed")
        directory = Path(coord.directory)
        coord.close()
    child = subprocess.Popen(
        [sys.executable, str(HERE), "work", str(on_a), json.dumps(declaration)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    printed: list[dict[str, Any]] = []
    try:
        assert child.stdout is not None
        first = child.stdout.readline()
        assert first, child.stderr.read() if child.stderr is not None else ""
        assert json.loads(first) == {"ready": 2}
        with (
            open_store(on_b, declaration) as store_b,
            pytest.raises(UnsafeRecovery, match="held by a live coordinator"),
        ):
            open_queue(store_b, recover=True)
        for _ in range(4):
            line = child.stdout.readline()
            assert line, child.stderr.read() if child.stderr is not None else ""
            printed.append(json.loads(line))
        child.send_signal(signal.SIGKILL)
        assert child.wait(CHILD_TIMEOUT_S) == -signal.SIGKILL
        printed += [json.loads(line) for line in child.stdout.read().split("\n")[:-1]]
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(CHILD_TIMEOUT_S)
    receipts = [CommitReceipt.from_dict(r) for r in printed if "commit_id" in r]
    assert 4 <= len(receipts) < TASKS
    wait_for_lock_release(on_b / directory.relative_to(on_a) / "LOCK")
    with open_store(on_b, declaration) as store_b:
        coord_b = open_queue(store_b, recover=True)
        assert coord_b.epoch == 3
        for receipt in receipts:
            assert coord_b.lookup_submission(receipt.submission_id) == receipt
            assert coord_b.commits[receipt.position] == as_dict(receipt)
        while not isinstance(status := qh.work_one(coord_b, "b"), str):
            pass
        assert status == "end_of_input"
        commits = coord_b.commits
        assert [c["position"] for c in commits] == list(range(TASKS))
        assert sorted(c["task_id"] for c in commits) == [f"t{i:03d}" for i in range(TASKS)]
        coord_b.close()


if __name__ == "__main__":
    if sys.argv[1] == "work":
        work(sys.argv[2], json.loads(sys.argv[3]), sys.stdout, sys.stdin)
    else:
        raise SystemExit(f"unknown command {sys.argv[1]!r}")
