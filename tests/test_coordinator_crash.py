"""Real process crashes: a coordinator killed with SIGKILL loses nothing it acknowledged.

A child process opens the queue (``recover=True``), then runs acquire -> publish -> complete
in a loop and prints each receipt as one JSON line, flushed. The parent kills it with
``SIGKILL`` mid-stream, recovers the queue itself and finds every printed receipt at the same
position with the same digest (I8); the rest of the work then completes, and the accepted
log holds exactly one result per task (no duplicate completion, no hole). While the child
lives, opening the queue from another process is refused (``UnsafeRecovery``, I9); after the
kill the lock is free.

This file is also the child program: ``python tests/test_coordinator_crash.py work <pool>``.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import IO, Any

import pytest

import queue_helpers as qh
from straw import Coordinator, SharedFilesystemStore, TaskSpec
from straw.errors import UnsafeRecovery
from straw.protocol import CommitReceipt, as_dict

pytestmark = pytest.mark.crash

RUN = "run-coordinator-crash"
OWNER = "crash-test"
HERE = Path(__file__).resolve()
#: Bound on any wait for a child process (a hang fails the test instead of the suite).
CHILD_TIMEOUT_S = 60.0
TASKS = 400


# --------------------------------------------------------------------------- the child program


def work(root: str, out: IO[str], stdin: IO[str]) -> None:
    store = SharedFilesystemStore(root, RUN)
    coord = Coordinator(store, exclusive_owner=OWNER, recover=True)
    out.write(json.dumps({"ready": coord.epoch}) + "\n")
    out.flush()
    while True:
        receipt = qh.work_one(coord, "child")
        if isinstance(receipt, str):
            out.write(json.dumps({"status": receipt}) + "\n")
            out.flush()
            stdin.readline()  # stay alive (holding the queue) until the parent kills us
            return
        out.write(json.dumps(as_dict(receipt)) + "\n")
        out.flush()


# --------------------------------------------------------------------------- helpers


def start_child(root: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(HERE), "work", str(root)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def read_line(child: subprocess.Popen[str]) -> dict[str, Any]:
    assert child.stdout is not None
    line = child.stdout.readline()
    if not line:
        child.wait(CHILD_TIMEOUT_S)
        stderr = child.stderr.read() if child.stderr is not None else ""
        pytest.fail(f"child exited early ({child.returncode}): {stderr[-2000:]}")
    return json.loads(line)  # type: ignore[no-any-return]


def kill_and_collect(child: subprocess.Popen[str]) -> list[dict[str, Any]]:
    """SIGKILL the child; every complete line it printed before dying (the pipe keeps them)."""
    child.send_signal(signal.SIGKILL)
    child.wait(CHILD_TIMEOUT_S)
    assert child.returncode == -signal.SIGKILL
    assert child.stdout is not None
    rest = child.stdout.read()
    lines = rest.split("\n")
    # The last element is either "" (all lines complete) or a line cut by the kill: not printed.
    return [json.loads(line) for line in lines[:-1]]


def open_from_another_process(root: Path) -> str:
    """Try to open the queue in a fresh interpreter; the error class name (or "opened")."""
    code = (
        "import sys\n"
        "from straw import Coordinator, SharedFilesystemStore\n"
        f"store = SharedFilesystemStore(sys.argv[1], {RUN!r})\n"
        "try:\n"
        f"    Coordinator(store, exclusive_owner={OWNER!r}, recover=True).close()\n"
        "    print('opened')\n"
        "except Exception as error:\n"
        "    print(type(error).__name__)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(root)], capture_output=True, text=True, timeout=CHILD_TIMEOUT_S
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.fixture
def pool(tmp_path: Path) -> Path:
    with SharedFilesystemStore(tmp_path, RUN) as store:
        coord = Coordinator(store, exclusive_owner=OWNER)
        coord.submit_tasks("all", [TaskSpec(f"t{i:04d}") for i in range(TASKS)])
        coord.seal_input("sealed")
        coord.close()
    return tmp_path


# --------------------------------------------------------------------------- tests


def test_i8_every_printed_receipt_survives_sigkill_and_the_work_completes_once(pool: Path) -> None:
    printed: list[dict[str, Any]] = []
    for round_number, wait_for in enumerate((3, 25)):
        child = start_child(pool)
        try:
            assert read_line(child) == {"ready": round_number + 2}  # one new epoch per recovery
            printed += [read_line(child) for _ in range(wait_for)]
            printed += kill_and_collect(child)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait(CHILD_TIMEOUT_S)
    receipts = [CommitReceipt.from_dict(r) for r in printed if "commit_id" in r]
    assert 28 <= len(receipts) < TASKS, "the child must be killed mid-stream"
    with SharedFilesystemStore(pool, RUN) as store:
        coord = Coordinator(store, exclusive_owner=OWNER, recover=True)
        assert coord.epoch == 4
        # I8: every acknowledged completion is there, unchanged.
        for receipt in receipts:
            assert coord.lookup_submission(receipt.submission_id) == receipt
            assert coord.commits[receipt.position] == as_dict(receipt)
            (record,) = store.read(receipt.result_ref)
            assert bytes(record.payload) == qh.work_payload(receipt.task_id)
        # The rest of the work completes in the parent.
        while not isinstance(status := qh.work_one(coord, "parent"), str):
            pass
        assert status == "end_of_input"
        commits = coord.commits
        assert [c["position"] for c in commits] == list(range(TASKS))
        assert sorted(c["task_id"] for c in commits) == [f"t{i:04d}" for i in range(TASKS)]
        assert coord.metrics()["tasks"] == {"completed": TASKS}
        assert coord.read_commits(TASKS - 1).end_of_input is True
        coord.close()


def test_i9_the_queue_is_refused_while_the_child_lives_and_free_after_sigkill(pool: Path) -> None:
    child = start_child(pool)
    try:
        assert read_line(child) == {"ready": 2}
        with SharedFilesystemStore(pool, RUN) as store:
            for recover in (False, True):
                with pytest.raises(UnsafeRecovery, match="held by a live coordinator"):
                    Coordinator(store, exclusive_owner=OWNER, recover=recover)
        assert open_from_another_process(pool) == "UnsafeRecovery"
        acknowledged = [read_line(child) for _ in range(2)]
        acknowledged += kill_and_collect(child)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(CHILD_TIMEOUT_S)
    with SharedFilesystemStore(pool, RUN) as store:
        coord = Coordinator(store, exclusive_owner=OWNER, recover=True)
        for line in acknowledged:
            if "commit_id" in line:
                assert coord.lookup_submission(line["submission_id"]) == CommitReceipt.from_dict(line)
        # Whatever the child was doing when it died is pending again, with an attempt spent.
        leased_then = [t for t, s in coord.tasks.items() if s["failures"]]
        assert len(leased_then) <= 1
        assert all(coord.tasks[t]["state"] == "pending" for t in leased_then)
        coord.close()
    assert open_from_another_process(pool) == "opened"


if __name__ == "__main__":
    if sys.argv[1] == "work":
        work(sys.argv[2], sys.stdout, sys.stdin)
    else:
        raise SystemExit(f"unknown command {sys.argv[1]!r}")
