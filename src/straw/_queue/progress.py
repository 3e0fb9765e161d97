"""The training consumer's progress record: its schema, checked in one place (pure).

API.md section 7: the ``training`` consumer's ``progress_ref`` names one
``json.v1`` record ``{version: 1, processed_positions: [...], finished_batches:
[...]}``; with ``processed_cursor`` it acknowledges accepted results for GC.
The coordinator checks it when it is saved (so a malformed record is refused
before it is journaled), garbage collection and ``straw check`` read it back
through :func:`parse_progress`, and all three agree on what it means:
:func:`acknowledged` is the one rule that turns a consumer state and its record
into the accepted results it acknowledges.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import CorruptData, UnsupportedSchema
from ..protocol import Record, decode

PROGRESS_CODEC = "json.v1"
PROGRESS_VERSION = 1
_POSITION_MAX = 2**63 - 1


def parse_progress(records: Sequence[Record]) -> tuple[set[int], set[str]]:
    """(processed positions, finished batch ids) of a progress record set, or
    :class:`UnsupportedSchema` saying what is wrong with it."""
    if len(records) != 1:
        raise UnsupportedSchema(
            f"a progress record set holds exactly one record, this one holds {len(records)}"
        )
    record = records[0]
    if record.codec != PROGRESS_CODEC:
        raise UnsupportedSchema(f"a progress record is {PROGRESS_CODEC}, this one is {record.codec!r}")
    try:
        body = decode(record.payload)
    except CorruptData as error:
        raise UnsupportedSchema(f"a progress record holds JSON ({error})") from None
    if not isinstance(body, dict) or body.get("version") != PROGRESS_VERSION:
        raise UnsupportedSchema(
            "a progress record is {version: 1, processed_positions: [...], finished_batches: [...]}, "
            f"got {str(body)[:120]}"
        )
    positions = body.get("processed_positions", [])
    finished = body.get("finished_batches", [])
    if not isinstance(positions, list) or any(
        isinstance(p, bool) or not isinstance(p, int) or not 0 <= p <= _POSITION_MAX for p in positions
    ):
        raise UnsupportedSchema("processed_positions of a progress record must be non-negative integers")
    if not isinstance(finished, list) or any(not isinstance(b, str) for b in finished):
        raise UnsupportedSchema("finished_batches of a progress record must be batch id strings")
    return set(positions), set(finished)


@dataclass(frozen=True)
class Acknowledged:
    """Accepted results the ``training`` consumer processed: every position below ``cursor``
    and those in ``positions`` (all at or above it); ``finished`` batches (API.md section 7)."""

    cursor: int
    positions: frozenset[int]
    finished: frozenset[str]
    #: ``positions`` in order, for the range questions (they hold positions above the cursor
    #: only, so this stays as small as the record's list).
    _ordered: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_ordered", tuple(sorted(self.positions)))

    def covers(self, position: int) -> bool:
        return position < self.cursor or position in self.positions

    def _listed(self, start: int, stop: int) -> int:
        """How many of ``positions`` lie in ``[start, stop)``."""
        ordered = self._ordered
        return bisect.bisect_left(ordered, stop) - bisect.bisect_left(ordered, start)

    def covers_all(self, start: int, stop: int) -> bool:
        """Whether every position in ``[start, stop)`` is acknowledged (an empty range is), in
        time independent of the range's length: history files hold thousands of positions."""
        low = max(start, self.cursor)
        return low >= stop or self._listed(low, stop) == stop - low

    def includes(self, other: Acknowledged) -> bool:
        """Whether every position ``other`` acknowledges is acknowledged here too (true when the
        consumer only moved on; false after it rewound)."""
        return self.covers_all(0, other.cursor) and all(self.covers(p) for p in other.positions)

    def covers_any(self, start: int, stop: int) -> bool:
        """Whether some position in ``[start, stop)`` is acknowledged (none of an empty range)."""
        if start >= stop:
            return False
        return start < self.cursor or self._listed(start, stop) > 0


def acknowledged(
    state: Mapping[str, Any] | None, progress: tuple[Iterable[int], Iterable[str]] = ((), ())
) -> Acknowledged:
    """What a ``training`` consumer state acknowledges: its ``processed_cursor``, plus the
    positions and batches its progress record lists (``progress``, as :func:`parse_progress`
    returns them; empty without one). The one rule the coordinator's collection, its history
    release and ``straw check`` share (docs/GC.md "Queue roots"); no state acknowledges nothing."""
    if state is None:
        return Acknowledged(0, frozenset(), frozenset())
    cursor = int(state["processed_cursor"])
    positions, finished = progress
    return Acknowledged(cursor, frozenset(p for p in positions if p >= cursor), frozenset(finished))
