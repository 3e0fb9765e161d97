"""straw.rollout: the rollout layer of an RL loop, built on straw's public API.

Prompt groups, partial generations, accepted groups and training batches live in the pool
and the job's queue instead of process memory (docs/ROLLOUT.md). This package imports only
straw's public modules; torch and PIL are imported where used, and Ray only by
``straw.rollout.ray``.
"""

from __future__ import annotations

from .hooks import DynamicFilterOutput, Generator, Hooks, load_function
from .sample import (
    NO_VERSION_KEY,
    QUEUE_ATTRIBUTES,
    REPLAY_FIELDS,
    Sample,
    SampleStatus,
    group_stage,
    iter_samples,
    numeric_version,
    scheduling_key,
    staleness,
)

__all__ = [
    "NO_VERSION_KEY",
    "QUEUE_ATTRIBUTES",
    "REPLAY_FIELDS",
    "DynamicFilterOutput",
    "Generator",
    "Hooks",
    "Sample",
    "SampleStatus",
    "group_stage",
    "iter_samples",
    "load_function",
    "numeric_version",
    "scheduling_key",
    "staleness",
]
