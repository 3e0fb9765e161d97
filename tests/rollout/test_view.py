"""The training view's cursor algebra (straw.rollout._view), pure: unit tests and a property test
against a plain set model."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from straw.errors import InvariantViolation
from straw.rollout._view import TrainingView, check_positions


def test_a_contiguous_prefix_moves_the_cursor() -> None:
    view = TrainingView().advance([0, 1], {})
    assert (view.processed_cursor, view.fetch_cursor, view.positions()) == (2, 2, [])


def test_gaps_keep_positions_above_the_cursor() -> None:
    view = TrainingView().advance([1, 3], {})
    assert (view.processed_cursor, view.fetch_cursor, view.positions()) == (0, 4, [1, 3])
    assert not view.is_processed(0) and view.is_processed(1) and not view.is_processed(2)
    assert view.unprocessed(5) == [0, 2, 4]
    filled = view.advance([0], {})
    assert (filled.processed_cursor, filled.fetch_cursor, filled.positions()) == (2, 4, [3])
    assert filled.advance([2], {}).processed_cursor == 4


def test_unprocessed_runs_step_around_processed_positions() -> None:
    view = TrainingView().advance([1, 2, 5], {})  # cursor 0, processed 1, 2, 5
    assert view.unprocessed_run(0) == (0, 1)
    assert view.unprocessed_run(1) == (3, 5)  # 1 and 2 are skipped
    assert view.unprocessed_run(5) == (6, None)
    assert TrainingView().advance([0, 1], {}).unprocessed_run(0) == (2, None)  # from the cursor


@settings(max_examples=200, deadline=None)
@given(st.sets(st.integers(0, 40), max_size=20), st.integers(0, 45))
def test_runs_cover_exactly_the_unprocessed_positions(processed: set[int], log: int) -> None:
    """Paging through runs from the cursor, as the controller reads the accepted log, meets every
    unprocessed position below ``log`` once and never a processed one."""
    view = TrainingView().advance(sorted(processed), {})
    met, cursor = [], view.processed_cursor
    while cursor < log:  # each run ends at a processed position or at the log's end
        start, stop = view.unprocessed_run(cursor)
        end = log if stop is None else min(stop, log)
        met += range(start, end)
        cursor = max(end, start + 1) if stop is not None else log
    assert met == view.unprocessed(log)
    assert not any(view.is_processed(p) for p in met)


def test_a_newly_processed_position_processes_what_its_task_replaced() -> None:
    view = TrainingView().advance([3], {3: [0, 1]})
    assert view.processed_cursor == 2 and view.positions() == [3]
    assert view.advance([2], {2: [0]}).processed_cursor == 4
    # Only newly processed positions bring their sources along.
    again = TrainingView().advance([3], {}).advance([3], {3: [0]})
    assert again.processed_cursor == 0 and again.positions() == [3]


def test_advancing_is_idempotent_and_never_moves_back() -> None:
    view = TrainingView().advance([0, 1, 5], {})
    assert view.advance([0, 1, 5], {}) == view
    assert view.advance([], {}) == view
    assert view.advance([0], {}).processed_cursor == 2
    assert view.newly([0, 2, 2, 5, 6]) == [2, 6]


def test_fetch_cursor_is_one_past_the_highest_position() -> None:
    view = TrainingView().advance([7], {7: [2]})
    assert view.fetch_cursor == 8
    assert view.advance([3], {}).fetch_cursor == 8


def test_from_state_normalises_a_saved_state() -> None:
    view = TrainingView.from_state(
        {"processed_cursor": 1, "fetch_cursor": 6, "processed_positions": [1, 2, 4]}
    )
    assert (view.processed_cursor, view.fetch_cursor, view.positions()) == (3, 6, [4])
    assert TrainingView.from_state({"processed_cursor": 0, "fetch_cursor": 0}) == TrainingView()


def test_inconsistent_views_are_refused() -> None:
    with pytest.raises(InvariantViolation):
        TrainingView(3, 2)
    with pytest.raises(InvariantViolation):
        TrainingView(2, 5, frozenset({1}))
    with pytest.raises(InvariantViolation):
        TrainingView.from_state({"processed_cursor": 0, "fetch_cursor": 1, "processed_positions": [0, 1, 2]})


def test_check_positions() -> None:
    assert check_positions([0, 2], 3) == [0, 2]
    assert check_positions((p for p in [1]), 2) == [1]
    for bad in ([3], [-1], [True], ["1"], "12", None, 5):
        with pytest.raises(ValueError, match=r"^Invalid accepted-output disposition$"):
            check_positions(bad, 3)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.lists(st.integers(0, 30), max_size=5),
            st.dictionaries(st.integers(0, 30), st.lists(st.integers(0, 30), max_size=3), max_size=4),
        ),
        max_size=12,
    )
)
def test_the_view_matches_a_plain_set_model(steps: list[tuple[list[int], dict[int, list[int]]]]) -> None:
    view, model, fetch = TrainingView(), set(), 0
    for positions, sources in steps:
        # A task only replaces earlier positions: keep the model's sources below their position.
        earlier = {p: [s for s in found if s < p] for p, found in sources.items()}
        newly = [p for p in dict.fromkeys(positions) if p not in model]  # before this call
        for position in newly:
            model.add(position)
            model.update(earlier.get(position, ()))
        fetch = max([fetch, *(p + 1 for p in positions)])
        before = view.processed_cursor
        view = view.advance(positions, earlier)
        cursor = 0
        while cursor in model:
            cursor += 1
        assert view.processed_cursor == cursor >= before  # never backwards, never past a gap
        assert set(view.positions()) == {p for p in model if p > cursor}
        assert view.fetch_cursor == max(fetch, cursor)
        assert all(view.is_processed(p) == (p in model) for p in range(32))
