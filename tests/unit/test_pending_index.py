"""PendingIndex.with_prefix: the first tasks of an id prefix, in acquisition order, without a scan.

Compared against the plain definition (sort every matching task's key) on seeded random
indexes: dense prefixes (the walk of the acquisition order), sparse ones (the ranked id
range), prefixes ending in the highest code point, and counts from 0 to more than match.
"""

from __future__ import annotations

import random

import pytest

from straw._queue.index import PendingIndex, pending_key

PREFIXES = ["prompt:", "prompt:delivery:", "collection:", "batch:", "p", "x\U0010ffff", "q"]


@pytest.mark.parametrize("seed", range(40))
def test_with_prefix_matches_sorting_every_match(seed: int) -> None:
    rng = random.Random(seed)
    index = PendingIndex()
    ids: set[str] = set()
    weights = [rng.random() for _ in PREFIXES]
    for order in range(rng.randint(0, 300)):
        task_id = rng.choices(PREFIXES, weights)[0] + str(rng.randint(0, 10**6))
        if task_id in ids:
            continue
        ids.add(task_id)
        index.add(pending_key(rng.randint(0, 2), rng.randint(0, 5), order, task_id))
    for task_id in rng.sample(sorted(ids), len(ids) // 4):  # removals keep both views in step
        index.remove(task_id)
        ids.discard(task_id)
    for prefix in [*PREFIXES, "prompt:d", "x", "z"]:
        for count in (0, 1, 3, 17, 1000):
            expected = sorted(index.key(t) for t in ids if t.startswith(prefix))[:count]
            assert index.with_prefix(prefix, count) == [key[3] for key in expected]


def test_a_dense_prefix_is_served_in_acquisition_order() -> None:
    index = PendingIndex()
    for order in range(1000):
        index.add(pending_key(0, 1000 - order, order, f"prompt:{order}"))
    index.add(pending_key(5, 0, 1000, "batch:b"))
    assert index.with_prefix("prompt:", 3) == ["prompt:999", "prompt:998", "prompt:997"]
    assert index.with_prefix("batch:", 3) == ["batch:b"]
    assert index.with_prefix("", 2) == ["batch:b", "prompt:999"]
