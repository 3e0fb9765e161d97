"""Ordered index of pending tasks: priority descending, scheduling key ascending, FIFO.

Backed by a sorted list, so taking the next task, inserting and removing cost
O(log n) whatever the number of pending tasks (API.md section 7: acquire must
not scan), and taking by id prefix costs O(count) when most pending tasks carry
the prefix.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator

from sortedcontainers import SortedList

from ..errors import invariant

Key = tuple[int, int, int, str]


def pending_key(priority: int, scheduling_key: int, order: int, task_id: str) -> Key:
    return (-priority, scheduling_key, order, task_id)


class PendingIndex:
    """Pending tasks in acquisition order, with a by-id view for prefix filters."""

    def __init__(self) -> None:
        self._order: SortedList = SortedList()
        self._by_id: SortedList = SortedList()
        self._keys: dict[str, Key] = {}

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, task_id: object) -> bool:
        return task_id in self._keys

    def add(self, key: Key) -> None:
        task_id = key[3]
        invariant(task_id not in self._keys, "a task is pending at most once")
        self._keys[task_id] = key
        self._order.add(key)
        self._by_id.add(task_id)

    def add_many(self, keys: list[Key]) -> None:
        """Add many tasks at once (recovery): one sort instead of one insertion each."""
        for key in keys:
            invariant(key[3] not in self._keys, "a task is pending at most once")
            self._keys[key[3]] = key
        self._order.update(keys)
        self._by_id.update(key[3] for key in keys)

    def remove(self, task_id: str) -> None:
        key = self._keys.pop(task_id)
        self._order.remove(key)
        self._by_id.remove(task_id)

    def first(self, count: int) -> list[str]:
        return [key[3] for key in self._order.islice(0, count)]

    def with_prefix(self, prefix: str, count: int) -> list[str]:
        """The first ``count`` pending tasks whose id starts with ``prefix``, in acquisition order.

        Usually nearly every pending task carries the prefix (a rollout queue's prompt
        tasks), so the acquisition order is walked and the walk stops after ``count``
        matches: O(count) however many tasks are pending. The walk is bounded by how dense
        the prefix is; past that bound (a rare prefix) the matching tasks are ranked by id
        range instead, O(matches).
        """
        if not prefix:
            return self.first(count)
        if count <= 0:
            return []
        start = self._by_id.bisect_left(prefix)
        matching = self._prefix_count(prefix, start)
        if matching == 0:
            return []
        budget = 4 * count * (len(self._keys) // matching + 1)
        found: list[str] = []
        for key in self._order.islice(0, budget):
            if key[3].startswith(prefix):
                found.append(key[3])
                if len(found) == count:
                    return found
        if len(found) == matching or budget >= len(self._keys):
            return found
        ranked = heapq.nsmallest(count, (self._keys[t] for t in self._by_id.islice(start, start + matching)))
        return [key[3] for key in ranked]

    def _prefix_count(self, prefix: str, start: int) -> int:
        """How many pending ids start with ``prefix`` (``start``: where the first would be)."""
        last = ord(prefix[-1])
        if last < 0x10FFFF:  # every id with the prefix sorts below the prefix with its last char + 1
            return int(self._by_id.bisect_left(prefix[:-1] + chr(last + 1))) - start
        found = 0
        for task_id in self._by_id.islice(start):
            if not task_id.startswith(prefix):
                break
            found += 1
        return found

    def ordered(self) -> Iterator[str]:
        return (key[3] for key in self._order)

    def key(self, task_id: str) -> Key:
        return self._keys[task_id]
