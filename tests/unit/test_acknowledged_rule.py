"""``straw._queue.progress.acknowledged``: the one acknowledgement rule the coordinator's
collection and history release and ``straw check`` share (issue 12 item 4)."""

from __future__ import annotations

from straw._queue.progress import Acknowledged, acknowledged


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
