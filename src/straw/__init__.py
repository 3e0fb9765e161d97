"""straw: a durable, shared-filesystem data plane for RL post-training.

The public API follows the straw-queue contract (API.md). Import the pieces
from here or from their modules (``straw.store``, ``straw.protocol``, ...).
"""

from __future__ import annotations

from .coordinator import Coordinator
from .protocol import Limits, Publication, Record, RecordRef, RecordSetRef, SegmentRef, TaskSpec
from .store import SharedFilesystemStore

__all__ = [
    "Coordinator",
    "Limits",
    "Publication",
    "Record",
    "RecordRef",
    "RecordSetRef",
    "SegmentRef",
    "SharedFilesystemStore",
    "TaskSpec",
]

__version__ = "0.1.0"
