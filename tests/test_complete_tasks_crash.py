"""A process killed inside ``complete_tasks`` leaves the whole batch accepted or none of it.

The child recovers a queue, leases a batch of tasks, publishes their results, prints the
batch's entries (one JSON line, flushed), then calls ``complete_tasks`` with a fault hook
that sends itself ``SIGKILL`` at one journal phase. The parent recovers the queue and finds
every entry accepted at consecutive positions, or none (I8, and one transaction per batch);
it retries the printed batch: accepted entries answer their original receipts, a batch
that never became durable is refused (its leases died with the epoch) and changes nothing,
and the tasks then complete once.

This file is also the child program: ``python tests/test_complete_tasks_crash.py <pool> <phase>``.
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

import child_io
from straw import Coordinator, Record, SharedFilesystemStore, TaskSpec
from straw.backend import FilesystemBackend
from straw.errors import StaleAttempt
from straw.protocol import CommitReceipt, Lease, RecordSetRef, as_dict

pytestmark = pytest.mark.crash

RUN = "run-complete-tasks-crash"
OWNER = "batch-crash"
HERE = Path(__file__).resolve()
TASKS = 8
PHASES = ("before_journal_write", "after_journal_append", "after_journal_sync", "before_completion_reply")


def child(root: str, phase: str) -> None:
    hook = child_io.KillAt(phase, armed=False)
    store = SharedFilesystemStore(root, RUN, backend=FilesystemBackend(root, fault=hook))
    coord = Coordinator(store, exclusive_owner=OWNER, recover=True)
    leases = [a.lease for a in coord.acquire("child", TASKS).assignments]
    entries = []
    for lease in leases:
        metadata = {"task_id": lease.task_id, "attempt_id": lease.attempt_id}
        record = Record(lease.task_id, b"out " + lease.task_id.encode(), metadata=metadata)
        ref = store.publish([record], submission_id=f"p-{lease.task_id}")
        entries.append(
            {
                "lease": as_dict(lease),
                "submission_id": f"c-{lease.task_id}",
                "result_ref": as_dict(ref),
                "result_digest": ref.digest,
            }
        )
    print(json.dumps(entries), flush=True)
    hook.armed = True
    receipts = coord.complete_tasks(entries)
    print(json.dumps([as_dict(r) for r in receipts]), flush=True)
    sys.stdin.readline()


def entries_of(line: str) -> list[dict[str, Any]]:
    items = json.loads(line)
    for item in items:
        item["lease"] = Lease.from_dict(item["lease"])
        item["result_ref"] = RecordSetRef.from_dict(item["result_ref"])
    return items  # type: ignore[no-any-return]


@pytest.mark.parametrize("phase", PHASES)
def test_i8_a_batch_killed_at_any_journal_phase_is_whole_or_absent_and_retries_answer_it(
    tmp_path: Path, phase: str
) -> None:
    root = str(tmp_path)
    with SharedFilesystemStore(root, RUN) as store, Coordinator(store, exclusive_owner=OWNER) as coord:
        coord.submit_tasks("tasks", [TaskSpec(f"t{i}") for i in range(TASKS)])
    process = child_io.start(HERE, root, phase)
    with child_io.children(process):
        entries = entries_of(child_io.read_line(process))
        assert process.wait(child_io.CHILD_TIMEOUT_S) == -signal.SIGKILL
    with (
        SharedFilesystemStore(root, RUN) as store,
        Coordinator(store, exclusive_owner=OWNER, recover=True) as coord,
    ):
        found = [coord.lookup_submission(e["submission_id"]) for e in entries]
        if phase in ("after_journal_sync", "before_completion_reply"):
            assert all(r is not None for r in found)  # durable before the kill
        if phase == "before_journal_write":
            assert found == [None] * TASKS
        if found[0] is not None:
            assert [r.position for r in found if r is not None] == list(range(TASKS))
            assert coord.complete_tasks(entries) == found
            return
        assert found == [None] * TASKS  # nothing of the batch, never a part
        with pytest.raises(StaleAttempt, match="entry 0"):
            coord.complete_tasks(entries)  # the leases were revoked by the recovery's epoch
        assert coord.commits == []
        leases = [a.lease for a in coord.acquire("parent", TASKS).assignments]
        again = []
        for lease in leases:
            metadata = {"task_id": lease.task_id, "attempt_id": lease.attempt_id}
            ref = store.publish(
                [Record(lease.task_id, b"again", metadata=metadata)], submission_id=f"p2-{lease.task_id}"
            )
            again.append(
                {
                    "lease": lease,
                    "submission_id": f"c2-{lease.task_id}",
                    "result_ref": ref,
                    "result_digest": ref.digest,
                }
            )
        receipts: list[CommitReceipt] = coord.complete_tasks(again)
        assert sorted(r.task_id for r in receipts) == sorted(f"t{i}" for i in range(TASKS))
        assert [r.position for r in receipts] == list(range(TASKS))


if __name__ == "__main__":
    child(sys.argv[1], sys.argv[2])
