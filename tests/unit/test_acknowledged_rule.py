"""``straw._queue.progress.acknowledged``: the one acknowledgement rule the coordinator's
collection and history release and ``straw check`` share (issue 12 item 4), as the queue's
ledger applies it (``Ledger.acknowledged``) and as the labelled roots use it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from straw._queue import events
from straw._queue.machine import Answer, QueueState, new_state
from straw._queue.progress import Acknowledged, acknowledged
from straw.protocol import RecordRef, RecordSetRef, SegmentRef, TaskSpec, as_dict

LIMITS = {"max_result_bytes": 1 << 20, "max_result_tokens": 1000, "metadata_bytes": 1024}


def state(cursor: int) -> dict[str, object]:
    return {"version": 1, "fetch_cursor": cursor, "processed_cursor": cursor, "state_ref": {}}


def test_no_consumer_state_acknowledges_nothing() -> None:
    nothing = acknowledged(None, ({1, 2}, {"b"}))
    assert nothing == Acknowledged(0, frozenset(), frozenset())
    assert not nothing.covers(0)


def test_the_cursor_and_the_listed_positions_above_it_are_acknowledged() -> None:
    found = acknowledged(state(3), ({0, 4, 7}, {"batch-1"}))
    assert found == Acknowledged(3, frozenset({4, 7}), frozenset({"batch-1"}))  # 0 is below the cursor
    assert [p for p in range(9) if found.covers(p)] == [0, 1, 2, 4, 7]


def test_a_state_without_a_progress_record_acknowledges_its_cursor_only() -> None:
    found = acknowledged(state(2))
    assert [p for p in range(4) if found.covers(p)] == [0, 1] and found.finished == frozenset()


# --------------------------------------------------------------------------- the ledger applies it


def _queue_with_results() -> tuple[QueueState, list[str]]:
    """Three accepted results (each reaching its own pack), one task still pending, and the
    training consumer open; the packs of the results, by position."""
    state = new_state("run-ack", "rollout", LIMITS)
    state.apply(events.Epoch(epoch=1))
    specs = [TaskSpec(f"t{i}", input_ref=_ref(str(i), f"in-{i}")) for i in range(4)]
    state.apply(_event(state.check_submit("r", specs, None, None)))
    packs = []
    for i in range(3):
        got = state.apply(_event(state.check_acquire("w", 1, [f"t{i}"], None, False, 0.0, 30.0, _ids())))
        lease = got[0]
        result = _ref(str(i + 5), f"out-{i}")
        packs.append(result.manifest.segment.path)
        done = state.check_complete(lease, f"s{i}", result, result.digest, 0.0, _ids(), [packs[-1]])
        state.apply(_event(done))
    state.apply(state.ledger.check_open_consumer("training", "trainer", "tok"))
    return state, packs


def _save(state: QueueState, cursor: int, request_id: str) -> None:
    saved = {"version": 1, "state_ref": as_dict(_ref("c", "consumer")), "fetch_cursor": 3}
    saved["processed_cursor"] = cursor
    state.apply(_event(state.check_save_consumer("training", "tok", request_id, saved)))


def test_the_ledger_applies_the_rule_to_the_training_consumers_saved_state() -> None:
    state, _ = _queue_with_results()
    nothing = Acknowledged(0, frozenset(), frozenset())
    assert state.ledger.acknowledged(({0, 2}, {"b"})) == nothing  # open, but no state saved yet
    _save(state, 1, "r1")
    assert state.ledger.acknowledged(({0, 2}, {"b"})) == acknowledged(
        state.ledger.consumers["training"].state, ({0, 2}, {"b"})
    )
    assert [p for p in range(3) if state.ledger.acknowledged(({2}, ())).covers(p)] == [0, 2]
    assert state.ledger.progress_ref() is None  # this state names no progress record


def test_labelled_roots_are_the_same_roots_with_what_needs_each() -> None:
    state, packs = _queue_with_results()
    _save(state, 1, "r1")
    acked = state.ledger.acknowledged()
    plain, labelled = state.roots(acked), state.roots(acked, labels=True)
    assert (plain.refs, plain.packs) == (labelled.refs, labelled.packs)
    assert plain.ref_labels is None and plain.pack_labels is None
    assert labelled.packs == {packs[1], packs[2]}  # position 0 is acknowledged
    names = [state.describe_root(label) for label in labelled.ref_labels or ()]
    assert names == ["input of task 't3'", "state_ref of consumer 'training'"]
    assert {
        p: [state.describe_root(x) for x in labels] for p, labels in (labelled.pack_labels or {}).items()
    } == {
        packs[1]: ["result of task 't1' (accepted at position 1)"],
        packs[2]: ["result of task 't2' (accepted at position 2)"],
    }


def _ref(seed: str, name: str) -> RecordSetRef:
    segment = SegmentRef("run-ack", f"raw/{'a' * 32}/{name}.pack", "b" * 32, 100, "c" * 32)
    return RecordSetRef(RecordRef(segment, 0), (seed * 64)[:64], 1, 10, 1)


def _ids() -> Callable[[], str]:
    counter = iter(range(10**6))
    return lambda: f"id{next(counter)}"


def _event(decision: Any) -> Any:
    assert not isinstance(decision, Answer)
    return decision
