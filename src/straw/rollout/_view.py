"""The training view's cursor algebra: which accepted positions are processed (pure, no I/O).

A position is the index of an accepted result in the queue's accepted log. The view keeps a
``processed_cursor`` (every position below it is processed), the processed positions at or
above it, and a ``fetch_cursor`` (one past the highest position ever handed to training).
Advancing over positions P (ROLLOUT.md section 10.10):

1. add P to the processed set;
2. for each *newly* processed position at or above the cursor, also add the positions its
   task replaced (``source_positions``: a delivery acknowledges what it carried again);
3. move ``processed_cursor`` through the contiguous processed prefix;
4. ``fetch_cursor = max(fetch_cursor, max(P) + 1)``;
5. forget processed positions below the cursor (the cursor says it).

The cursor never moves backwards and never passes an unprocessed position, so the view never
acknowledges a result nobody processed; a rollback disposes results instead of rewinding.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ..errors import invariant

__all__ = ["TrainingView", "check_positions"]


def check_positions(positions: object, commits: int) -> list[int]:
    """``positions`` as a list of ints naming accepted results (``0 <= p < commits``), else ValueError."""
    if isinstance(positions, (str, bytes)) or not isinstance(positions, Iterable):
        raise ValueError("Invalid accepted-output disposition")
    found = list(positions)
    for position in found:
        if isinstance(position, bool) or not isinstance(position, int) or not 0 <= position < commits:
            raise ValueError("Invalid accepted-output disposition")
    return found


@dataclasses.dataclass(frozen=True)
class TrainingView:
    """Processed positions of the accepted log: a cursor, the processed ones above it, a fetch cursor."""

    processed_cursor: int = 0
    fetch_cursor: int = 0
    processed: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        invariant(0 <= self.processed_cursor <= self.fetch_cursor, "processed_cursor <= fetch_cursor")
        invariant(
            all(p > self.processed_cursor for p in self.processed), "processed set lies above the cursor"
        )

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> TrainingView:
        """The view a saved training state records."""
        cursor, fetch = int(state["processed_cursor"]), int(state["fetch_cursor"])
        return _normal(cursor, fetch, {int(p) for p in state.get("processed_positions") or ()})

    def is_processed(self, position: int) -> bool:
        return position < self.processed_cursor or position in self.processed

    def newly(self, positions: Iterable[int]) -> list[int]:
        """The positions of ``positions`` that are not processed yet (each once, in order)."""
        return [p for p in dict.fromkeys(positions) if not self.is_processed(p)]

    def advance(self, positions: Sequence[int], sources: Mapping[int, Sequence[int]]) -> TrainingView:
        """The view after processing ``positions``; ``sources[p]`` are the positions p's task replaced."""
        processed = set(self.processed)
        for position in self.newly(positions):
            processed.add(position)
            for source in sources.get(position, ()):
                if not self.is_processed(source):
                    processed.add(source)
        fetch = max(self.fetch_cursor, max(positions) + 1 if positions else 0)
        return _normal(self.processed_cursor, fetch, processed)

    def unprocessed(self, commits: int) -> list[int]:
        """Positions below ``commits`` that are not processed, ascending."""
        return [p for p in range(self.processed_cursor, commits) if p not in self.processed]

    def unprocessed_run(self, start: int) -> tuple[int, int | None]:
        """The first unprocessed position at or after ``start``, and the next processed
        position after it (``None``: every later position is unprocessed).

        Readers of the accepted log page through these runs only: a processed position may
        already be released by garbage collection, and reading it would fail.
        """
        first = max(start, self.processed_cursor)
        while first in self.processed:  # bounded by the size of the processed set
            first += 1
        later = [p for p in self.processed if p > first]
        return first, min(later) if later else None

    def positions(self) -> list[int]:
        """The processed positions above the cursor, ascending (what a saved state lists)."""
        return sorted(self.processed)


def _normal(cursor: int, fetch: int, processed: set[int]) -> TrainingView:
    """Move the cursor through the contiguous processed prefix and keep what lies above it."""
    while cursor in processed:  # bounded by the size of the processed set
        processed.discard(cursor)
        cursor += 1
    invariant(cursor <= fetch, "the processed cursor never passes the fetch cursor")
    return TrainingView(cursor, fetch, frozenset(p for p in processed if p > cursor))
