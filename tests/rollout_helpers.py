"""Helpers shared by the rollout controller and reader tests (and their child programs).

Tests import it by name (pytest's ``pythonpath`` puts ``tests/`` on the path); child programs
started as ``python tests/rollout/<file>.py`` add ``tests/`` themselves.
"""

from __future__ import annotations

import collections
from typing import Any

from straw.coordinator import Coordinator
from straw.rollout.sample import Sample, SampleStatus, iter_samples


def prompt_rows(count: int) -> list[dict[str, Any]]:
    """A dataset of ``count`` prompt rows (``input`` = ``prompt <i>``)."""
    return [{"input": f"prompt {i}"} for i in range(count)]


def finish(group: Any, *, version: str | None = "1", reward: float = 1.0, tokens: int = 2) -> Any:
    """Complete every sample: ``tokens`` response tokens, a reward, the given weight version."""
    for sample in iter_samples(group):
        sample.tokens = [*sample.tokens, *range(100, 100 + tokens)]
        sample.response_length += tokens
        sample.reward = reward
        sample.status = SampleStatus.COMPLETED
        if version is not None:
            sample.weight_versions = [*sample.weight_versions, version]
    return group


def interrupt(group: Any, *, version: str | None = "1", tokens: int = 2) -> Any:
    """Abort every sample after ``tokens`` more response tokens (a partial to continue)."""
    for sample in iter_samples(group):
        sample.tokens = [*sample.tokens, *range(200, 200 + tokens)]
        sample.response_length += tokens
        sample.status = SampleStatus.ABORTED
        if version is not None:
            sample.weight_versions = [*sample.weight_versions, version]
    return group


def group_indices(groups: list[Any]) -> list[int]:
    """The group index of each group (its first sample's)."""
    return [next(iter_samples(group)).group_index for group in groups]  # type: ignore[misc]


def plain_group(index: int, size: int = 1) -> list[Sample]:
    return [Sample(index=index + i, group_index=index) for i in range(size)]


def fresh_group_index(task_id: str) -> int | None:
    """The group index of a fresh prompt task (``prompt:<group index>``), None for any other id:
    continuations and collections hold more fields, some of them all digits by chance."""
    rest = task_id.removeprefix("prompt:")
    return int(rest) if rest != task_id and rest.isdigit() else None


def representatives(queue: Coordinator) -> tuple[int, dict[int, int]]:
    """The producer's next group index, and per group index its live representatives.

    A representative is a pending or leased prompt task, or an accepted prompt result that no
    other prompt task replaced (names in ``source_positions``). Every issued group has exactly
    one, unless it was rejected (then none). Fresh prompt task ids must be exactly the groups
    the cursor issued.
    """
    tasks = queue.tasks
    replaced: set[int] = set()
    for task_id, status in tasks.items():
        if task_id.startswith("prompt:"):
            replaced.update(status["spec"]["metadata"].get("source_positions") or ())
    count: collections.Counter[int] = collections.Counter()
    for task_id, status in tasks.items():
        if task_id.startswith("prompt:") and status["state"] in ("pending", "leased"):
            count[status["spec"]["metadata"]["group_index"]] += 1
    for commit in queue.commits:
        if commit["task_id"].startswith("prompt:") and commit["position"] not in replaced:
            count[tasks[commit["task_id"]]["spec"]["metadata"]["group_index"]] += 1
    fresh = sorted(index for index in map(fresh_group_index, tasks) if index is not None)
    issued = int(queue.producer_state("dataset")["cursor"]["sample_group_index"])
    assert fresh == list(range(issued)), (
        f"fresh prompt tasks are exactly the groups the cursor issued: {fresh} vs {issued}"
    )
    return issued, dict(count)
