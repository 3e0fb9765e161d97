"""A background snapshot is built from a copy of the live state (DURABILITY.md J5.1, issue 12).

Until this change the snapshot of frame S was rebuilt by a read-only replay of the files up
to S. The copy taken under the lock must give the same snapshot: at the point where the
snapshot thread spills and encodes its state, the files up to S are still all there, so the
test holds the thread there, makes more calls (they change the live state the copy was
taken from), then replays the files up to S and compares the two encoded states byte for
byte, over random histories (submits, acquires, completions, failures, releases, cancels,
consumers, checkpoints). Heartbeats are left out: they are not journaled (J6), so only the
copy sees the deadlines they move.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import queue_helpers as qh
import straw.coordinator as coordinator_module
from straw import Coordinator, SharedFilesystemStore, TaskSpec
from straw._journal import frame
from straw._journal.log import Journal
from straw._queue.machine import QueueState, state_to_dict
from straw.protocol import Lease, Record, encode

RUN = "run-snapshot-copy"
OWNER = "owner-copy"
#: Bound on every wait for the other thread (a hang fails the test, it never sleeps).
WAIT_S = 30.0
#: Calls made while the snapshot thread is held.
CALLS_WHILE_HELD = 6


class Compared:
    """Wraps ``Coordinator._spill``: before the copy is spilled, the replay of the same frame."""

    def __init__(self) -> None:
        self.snapshots = 0
        self.spill = Coordinator._spill
        self.reached = threading.Event()
        self.go = threading.Event()

    def __call__(self, coord: Coordinator, state: QueueState, seq: int) -> Any:
        self.reached.set()
        if not self.go.wait(WAIT_S):
            raise AssertionError("the test never released the snapshot thread")
        self.go.clear()
        reader = Journal(
            coord.backend, coord.directory, frame.identity_tag(coord.store.run_id, coord.queue_id)
        )
        replayed, _ = coord._replay(coord._limits(), reader, seq)
        assert encode(state_to_dict(state)) == encode(state_to_dict(replayed)), f"snapshot of frame {seq}"
        replayed.history.close()
        self.snapshots += 1
        return self.spill(coord, state, seq)


@pytest.fixture
def compared(monkeypatch: pytest.MonkeyPatch) -> Iterator[Compared]:
    wrapper = Compared()

    def spill(coord: Coordinator, state: QueueState, seq: int) -> Any:
        return wrapper(coord, state, seq)

    monkeypatch.setattr(Coordinator, "_spill", spill)
    monkeypatch.setattr(coordinator_module, "JOURNAL_SNAPSHOT_BYTES_MIN", 4096)
    yield wrapper


def _step(coord: Coordinator, rng: random.Random, held: list[Lease], step: int) -> None:
    """One random call; ``held`` are the leases the workers hold."""
    choice = rng.random()
    request = f"r{step}"
    if choice < 0.2 or (not held and choice < 0.5):
        count = rng.randint(1, 6)
        coord.submit_tasks(
            request,
            [TaskSpec(f"t{step}-{i}", priority=rng.randint(0, 2), max_attempts=2) for i in range(count)],
            producer_id="producer",
            producer_state={"step": step},
        )
    elif choice < 0.45:
        held += [a.lease for a in coord.acquire(f"w{rng.randint(0, 2)}", rng.randint(1, 4)).assignments]
    elif choice < 0.7 and held:
        lease = held.pop(rng.randrange(len(held)))
        ref = qh.result_for(coord.store, lease, submission_id=f"s-{lease.task_id}")
        coord.complete_task(
            lease, submission_id=f"s-{lease.task_id}", result_ref=ref, result_digest=ref.digest
        )
    elif choice < 0.78 and held:
        lease = held.pop(rng.randrange(len(held)))
        coord.fail_task(lease, request_id=request, failure="seeded", retryable=rng.random() < 0.5)
    elif choice < 0.84 and held:
        coord.release_tasks([held.pop(rng.randrange(len(held)))], request_id=request)
    elif choice < 0.9:
        pending = [t for t, s in coord.tasks.items() if s["state"] == "pending"]
        if pending:
            coord.cancel_task(rng.choice(pending), request_id=request)
    elif choice < 0.95:
        coord.open_consumer(f"c{rng.randint(0, 1)}", exclusive_owner="trainer")
    else:
        ref = coord.store.publish([Record(f"ckpt-{step}", b"weights")], submission_id=f"ckpt-{step}")
        coord.register_checkpoint(f"k{step}", ref)


@pytest.mark.parametrize("seed", range(4))
def test_the_snapshot_of_the_copy_equals_the_snapshot_of_a_replay(
    tmp_path: Path, compared: Compared, seed: int
) -> None:
    rng = random.Random(seed)
    with (
        SharedFilesystemStore(tmp_path, RUN) as store,
        qh.coordinators(store, exclusive_owner=OWNER, clock=qh.Clock()) as make,
    ):
        coord = make()
        held: list[Lease] = []
        step = 0
        while step < 160:
            _step(coord, rng, held, step)
            step += 1
            if compared.reached.is_set():  # the snapshot thread waits in _spill
                for _ in range(CALLS_WHILE_HELD):
                    _step(coord, rng, held, step)
                    step += 1
                compared.reached.clear()
                compared.go.set()
                assert coord._await_snapshot() is None
        compared.go.set()  # a snapshot that started with the last call
        assert coord._await_snapshot() is None
        assert compared.snapshots >= 3  # several snapshots, some over earlier history files
        assert (Path(coord.directory) / "hist").is_dir()
        before = coord.tasks, coord.commits
        qh.crash(coord)
        again = make(recover=True)
        assert again.commits == before[1]
        assert {t: s["state"] for t, s in again.tasks.items()} == {
            t: s["state"] for t, s in before[0].items()
        }
