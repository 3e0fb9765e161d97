"""Helpers shared by the rollout controller and reader tests (and their child programs).

Tests import it by name (pytest's ``pythonpath`` puts ``tests/`` on the path); child programs
started as ``python tests/rollout/<file>.py`` add ``tests/`` themselves.
"""

from __future__ import annotations

from typing import Any

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
