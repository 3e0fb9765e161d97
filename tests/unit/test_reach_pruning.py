"""``QueueState.ref_packs`` holds what live roots name, not every reference ever named
(docs/GC.md "Queue roots", DURABILITY.md J5 H2-H3; issue 12).

Each event that names references journals what they reach (``reach``) and the state keeps it,
so a collection reads nothing to know a root's packs. Once a task is finished its input is no
root any more: a background snapshot prunes such keys from its copy, and the live state forgets
the same keys when it takes the history file over, keeping those an event named again since the
copy (a replay of the snapshot and the journal after it puts them back). The tests count
entries as history grows, compare the live map with a replay of the files after every call, and
check that collection still keeps every live input.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import queue_helpers as qh
import straw.coordinator as coordinator_module
from straw import Coordinator, Record, SharedFilesystemStore, TaskSpec
from straw._journal import frame
from straw._journal.log import Journal
from straw._queue.machine import QueueState, object_key, ref_key
from straw.protocol import RecordSetRef

RUN = "run-reach"
OWNER = "reach"


@pytest.fixture(autouse=True)
def _snapshot_every_call(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(coordinator_module, "JOURNAL_SNAPSHOT_BYTES_MIN", 1)
    monkeypatch.setattr(coordinator_module, "SNAPSHOTS_IN_BACKGROUND", False)
    yield


def _replayed(coord: Coordinator) -> QueueState:
    reader = Journal(coord.backend, coord.directory, frame.identity_tag(coord.store.run_id, coord.queue_id))
    state, _ = coord._replay(coord._limits(), reader, coord._journal.durable_seq)
    for file in state.history.files:
        file.close()
    return state


def _input(store: SharedFilesystemStore, name: str) -> RecordSetRef:
    return store.publish([Record("prompt", name.encode())], submission_id=f"input-{name}")


def _finish(coord: Coordinator, worker: str = "w") -> None:
    lease = coord.acquire(worker).assignments[0].lease
    ref = qh.result_for(coord.store, lease, submission_id=f"sub-{lease.task_id}")
    coord.complete_task(lease, submission_id=f"sub-{lease.task_id}", result_ref=ref, result_digest=ref.digest)


def test_forget_reach_keeps_the_keys_an_event_named_since_the_copy() -> None:
    state = QueueState("r", "q")
    state.ref_packs = {"a": 0, "b": ["p1", "p2"], "c": 0}
    state.reach_since = {"b"}
    state.forget_reach(["a", "b"])
    assert state.ref_packs == {"b": ["p1", "p2"], "c": 0}


def test_ref_packs_stay_bounded_by_live_work_as_history_grows(tmp_path: Path) -> None:
    """Count entries, not time: 120 tasks with inputs of their own finish one by one, and the
    map never holds more than the live inputs plus those named since the last snapshot."""
    root = str(tmp_path)
    total = 120
    with SharedFilesystemStore(root, RUN) as store, Coordinator(store, exclusive_owner=OWNER) as coord:
        most = 0
        for k in range(total):
            coord._journal.snapshot_bytes = 0  # a snapshot at the next call
            coord.submit_tasks(f"s{k}", [TaskSpec(f"t{k:03d}", input_ref=_input(store, f"t{k:03d}"))])
            _finish(coord)
            most = max(most, len(coord._state.ref_packs), len(coord._state.snapshot_copy().ref_packs))
        assert most <= 3 < total
        assert coord.metrics()["tasks"] == {"completed": total}
        live = [_input(store, f"live{k}") for k in range(3)]
        coord.submit_tasks("live", [TaskSpec(f"live{k}", input_ref=ref) for k, ref in enumerate(live)])
        coord.metrics()  # a call: the last snapshot's history is taken over
        keys = {object_key(ref) for ref in live}
        assert keys <= set(coord._state.ref_packs)
        # Collection still owns every live input without reading it (its reach is known).
        roots = coord._state.roots(coord._acknowledgements())
        unknown, packs = coord._state.known_reach(roots.refs)
        assert unknown == [] and {ref.manifest.segment.path for ref in live} <= packs
        coord.collect_garbage()
        for ref in live:
            assert list(store.read(ref))  # still there
    with (
        SharedFilesystemStore(root, RUN) as store,
        Coordinator(store, exclusive_owner=OWNER, recover=True) as coord,
    ):
        assert keys <= set(coord._state.ref_packs) and len(coord._state.ref_packs) <= 4


def test_the_live_map_equals_a_replay_after_every_call_also_when_an_input_is_named_again(
    tmp_path: Path,
) -> None:
    """I10 for ref_packs: a finished task's input is pruned by the snapshot taken at the next
    call, while that very call names the same input again for a new task; the live state must
    keep it (a replay does), and later drop it once nothing names it."""
    root = str(tmp_path)
    with SharedFilesystemStore(root, RUN) as store, Coordinator(store, exclusive_owner=OWNER) as coord:
        shared = _input(store, "shared")
        key = ref_key({"manifest": {"segment": {"path": shared.manifest.segment.path,
                                                "offset": shared.manifest.segment.offset},
                                    "ordinal": shared.manifest.ordinal}})  # fmt: skip
        assert key == object_key(shared)
        steps = [
            lambda: coord.submit_tasks("a", [TaskSpec("a", input_ref=shared)]),
            lambda: _finish(coord),
            lambda: coord.submit_tasks("b", [TaskSpec("b", input_ref=shared)]),  # named again
            lambda: coord.metrics(),
            lambda: coord.metrics(),
            lambda: _finish(coord),
            lambda: coord.submit_tasks("c", [TaskSpec("c", input_ref=_input(store, "other"))]),
            lambda: coord.metrics(),
            lambda: coord.metrics(),
        ]
        present = []
        for step in steps:
            coord._journal.snapshot_bytes = 0  # the next call snapshots (the last one's size is forgotten)
            step()
            with coord._lock:  # H3 of the snapshot this call made durable (the next call does it)
                coord._take_history(1_000_000)
            assert coord._state.ref_packs == _replayed(coord).ref_packs
            present.append(key in coord._state.ref_packs)
        assert present[2:5] == [True, True, True]  # task b is live: its input stays known
        assert present[-1] is False  # nothing names it any more
