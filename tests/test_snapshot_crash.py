"""A process killed at any phase of a background snapshot (DURABILITY.md J5) loses nothing.

The child works tasks one by one with a snapshot due after every call (so snapshots run
back to back in their thread while the calls go on) and prints each receipt, flushed. Its
fault hook sends the process ``SIGKILL`` the third time the snapshot thread reaches one
phase: before or after the segment switch or between its new segment and the old one's
cut, before or after the snapshot's own file. The
parent recovers the queue and finds every printed receipt at its position (I8), the
recovered journal well formed (I21: no lost segment, no cut tail), and the remaining work
completes once.

This file is also the child program: ``python tests/test_snapshot_crash.py <pool> <phase>``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest

import child_io
import queue_helpers as qh
import straw.coordinator as coordinator_module
from straw import Coordinator, SharedFilesystemStore, TaskSpec
from straw.backend import FilesystemBackend
from straw.protocol import CommitReceipt, Lease, RecordSetRef, as_dict

pytestmark = pytest.mark.crash

RUN = "run-snapshot-crash"
OWNER = "snapshot-crash"
HERE = Path(__file__).resolve()
#: Far more than the child works before the third arrival at a phase (about 30 tasks here), so
#: a slow snapshot thread on a loaded machine still meets its phase before the work runs out.
TASKS = 200
#: The occurrence of the phase that kills the child (earlier snapshots have finished by then).
NTH = 3
PHASES = (
    "before_segment_switch",
    "before_segment_cut",
    "after_segment_switch",
    "before_history_write",
    "after_history_write",
    "before_snapshot_write",
    "after_snapshot_write",
    "before_history_prune",
)


def child(root: str, phase: str) -> None:
    hook = child_io.KillAt(phase, nth=NTH)
    coordinator_module.JOURNAL_SNAPSHOT_BYTES_MIN = 1  # a snapshot is due after every call
    store = SharedFilesystemStore(root, RUN, backend=FilesystemBackend(root, fault=hook))
    coord = Coordinator(store, exclusive_owner=OWNER, recover=True)
    while True:
        result = coord.acquire("child")
        if result.status != "acquired":
            print(json.dumps({"status": result.status}), flush=True)
            sys.stdin.readline()
            return
        lease = result.assignments[0].lease
        ref = qh.result_for(store, lease, submission_id=f"sub-{lease.task_id}")
        receipt = coord.complete_task(
            lease, submission_id=f"sub-{lease.task_id}", result_ref=ref, result_digest=ref.digest
        )
        print(
            json.dumps({"receipt": as_dict(receipt), "lease": as_dict(lease), "ref": as_dict(ref)}),
            flush=True,
        )


@pytest.mark.timeout(120)
@pytest.mark.parametrize("phase", PHASES)
def test_i8_a_kill_at_any_snapshot_phase_keeps_every_printed_receipt(tmp_path: Path, phase: str) -> None:
    root = str(tmp_path)
    with SharedFilesystemStore(root, RUN) as store, Coordinator(store, exclusive_owner=OWNER) as coord:
        coord.submit_tasks("tasks", [TaskSpec(f"t{i:03d}") for i in range(TASKS)])
    process = child_io.start(HERE, root, phase)
    printed: list[CommitReceipt] = []
    retries: list[tuple[Lease, RecordSetRef]] = []
    with child_io.children(process):
        assert process.stdout is not None
        for line in process.stdout:
            item = json.loads(line)
            assert "status" not in item, "the child ran out of work before the phase was reached"
            printed.append(CommitReceipt.from_dict(item["receipt"]))
            retries.append((Lease.from_dict(item["lease"]), RecordSetRef.from_dict(item["ref"])))
        assert process.wait(child_io.CHILD_TIMEOUT_S) == -signal.SIGKILL
    assert printed, "the kill came before any receipt"
    with (
        SharedFilesystemStore(root, RUN) as store,
        Coordinator(store, exclusive_owner=OWNER, recover=True) as coord,
    ):
        assert coord._state.history.files, "the kill came before any history file was named"
        for receipt, (lease, ref) in zip(printed, retries, strict=True):
            assert coord.lookup_submission(receipt.submission_id) == receipt
            assert coord.task_status(receipt.task_id)["state"] == "completed"
            # A retry after a lost reply (its lease long revoked) gets the same receipt, from disk.
            again = coord.complete_task(
                lease, submission_id=receipt.submission_id, result_ref=ref, result_digest=ref.digest
            )
            assert again == receipt
        while not isinstance(qh.work_one(coord, "parent"), str):
            pass
        commits = coord.commits
        assert [c["position"] for c in commits] == list(range(TASKS))
        # J4.4: only the newest segment ends in zeros; each older one ends at its last frame,
        # so that losing the newest could never make an older one pass for it (J7).
        wal = os.path.join(coord.directory, "wal")
        older = sorted(name for name in os.listdir(wal) if name.endswith(".wal"))[:-1]
        for name in older:
            data = Path(wal, name).read_bytes()
            frames, _ = qh.log_frames(data)
            assert len(data) == frames[-1][1].end, f"{name} is not the newest but still ends in zeros"
        assert sorted(c["task_id"] for c in commits) == [f"t{i:03d}" for i in range(TASKS)]
    # A clean reopen after the clean close: the files the kill left were tidied or reused.
    with (
        SharedFilesystemStore(root, RUN) as store,
        Coordinator(store, exclusive_owner=OWNER, recover=True) as coord,
    ):
        assert len(coord.commits) == TASKS
        assert sorted(c["task_id"] for c in coord.commits) == [f"t{i:03d}" for i in range(TASKS)]
        assert all(coord.task_status(f"t{i:03d}")["state"] == "completed" for i in range(TASKS))
        # Every history file left is one the newest snapshot names (orphans of the kill pruned
        # by a later snapshot, or left for the next one: never one a snapshot still needs).
        named = coord._state.history.names()
        assert named <= set(os.listdir(os.path.join(coord.directory, "hist")))


if __name__ == "__main__":
    child(sys.argv[1], sys.argv[2])
