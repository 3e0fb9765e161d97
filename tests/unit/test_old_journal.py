"""Journals written before the typed events (docs/FORMAT.md 8.3, event version 1) stay readable.

``tests/fixtures/queue-v1-events`` is a pool written by straw at main a1cb5a0 (events were
plain dicts then) with ``tests/fixtures/make_old_queue.py``: every journal op through the
public Coordinator, then a crash (no snapshot), so reopening replays every frame. Its frames
are the golden bytes: each one must decode to a typed event that encodes to the very same
bytes, replaying them must give the state that straw's snapshot body held (byte for byte:
``queue-v1-events.state``, the snapshot format is unchanged too), and the recovered queue must
hold what that workload made.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from straw import Coordinator, SharedFilesystemStore
from straw._journal import frame as journal_frame
from straw._journal.log import Journal
from straw._queue import events
from straw._queue.machine import new_state, state_to_dict
from straw.backend import FilesystemBackend
from straw.protocol import encode

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "queue-v1-events"
RUN, OWNER = "fixture-run", "fixture-owner"


def _frames(root: Path) -> list[bytes]:
    journal = Journal(
        FilesystemBackend(root), str(root / "queue"), journal_frame.identity_tag(RUN, "rollout")
    )
    bodies: list[bytes] = []
    snapshots: list[bytes] = []
    journal.replay(lambda seq, body: bodies.append(bytes(body)), snapshots.append)
    assert not snapshots  # the workload crashed before any snapshot: everything is in frames
    return bodies


def test_every_frame_of_an_old_journal_decodes_and_encodes_to_the_same_bytes(tmp_path: Path) -> None:
    root = tmp_path / "pool"
    shutil.copytree(FIXTURE, root)
    bodies = _frames(root)
    ops = []
    for body in bodies:
        event = events.decode(body)
        assert events.encode(event) == body
        ops.append(event.OP)
    assert set(ops) == set(events.OPS)  # the fixture holds every op there is


def test_replaying_an_old_journal_gives_the_state_its_writer_had_byte_for_byte(tmp_path: Path) -> None:
    root = tmp_path / "pool"
    shutil.copytree(FIXTURE, root)
    limits = {"max_result_bytes": 4 * 1024**3, "max_result_tokens": 100_000_000, "metadata_bytes": 256 * 1024}
    state = new_state(RUN, "rollout", limits)
    for body in _frames(root):
        state.apply(events.decode(body))
    assert encode(state_to_dict(state)) == FIXTURE.with_name("queue-v1-events.state").read_bytes()


def test_a_queue_written_by_the_dict_events_recovers_with_its_state(tmp_path: Path) -> None:
    root = tmp_path / "pool"
    shutil.copytree(FIXTURE, root)
    with SharedFilesystemStore(root, RUN) as store:
        coord = Coordinator(store, exclusive_owner=OWNER, recover=True, clock=lambda: 200.0)
        try:
            assert coord.epoch == 2  # the fixture's epoch 1, then this recovery's
            states = {task_id: status["state"] for task_id, status in coord.tasks.items()}
            assert states == {
                "t1": "completed",
                "t2": "completed",
                "t3": "completed",
                "t4": "failed",
                "t5": "pending",
                "t6": "pending",
                "t7": "cancelled",
            }
            assert [c["submission_id"] for c in coord.commits] == ["sub-t1", "sub-t2", "sub-t3"]
            found = coord.lookup_submission("sub-t2")
            assert found is not None and found.position == 1
            assert coord.producer_state("producer") == {"next": 8}
            training = coord.consumers["training"]
            assert training["open"] is False
            assert training["state"]["processed_cursor"] == 2
            assert set(coord.checkpoints) == {"c2"}
            batch = coord.get_batch("b1")
            assert batch is not None and batch["ready"] is True
            # The pool's roots are what they were: a collection keeps what the queue still needs.
            assert coord.collect_garbage()["queue_roots"] > 0
            # Recovery ends the drain; the input stays sealed, the two returned tasks are handed out.
            result = coord.acquire("w9", 5)
            assert result.status == "acquired"
            given = {a.lease.task_id: a.task for a in result.assignments}
            assert sorted(given) == ["t5", "t6"]
            assert given["t6"].input_ref is not None  # the continuation the yield recorded
            assert coord.acquire("w9").status == "empty"  # sealed, but two tasks are still leased
        finally:
            coord.close()
