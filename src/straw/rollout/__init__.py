"""straw.rollout: the rollout layer of an RL loop, built on straw's public API.

Prompt groups, partial generations, accepted groups and training batches live in the pool
and the job's queue instead of process memory (docs/ROLLOUT.md). This package imports only
straw's public modules; torch and PIL are imported where used, and Ray only by
``straw.rollout.ray``.
"""

from __future__ import annotations

from .archive import (
    ArchiveReplay,
    RolloutArchive,
    bind_archive_pool,
    load_debug_rollout_data,
    save_debug_rollout_data,
)
from .checkpoint import (
    ModelSave,
    RestorePlan,
    commit_checkpoint,
    model_dir,
    read_commit,
    resolve_checkpoint,
    save_checkpoint,
)
from .codec import SampleCodec, register_type
from .config import REMOVED_FLAGS, RolloutConfig, add_arguments, from_args, resolve_pool
from .controller import EXCLUSIVE_OWNER, ControllerClient, QueueController
from .dataset import Dataset, DatasetCursor, JsonlDataset, PromptProducer
from .hooks import DynamicFilterOutput, Generator, Hooks, load_function
from .pool import (
    RolloutStore,
    close_rollout_stores,
    open_reader,
    probe_roundtrip,
    rollout_store,
    run_io,
    seal_rollout_store,
    settled,
)
from .reader import QueueDataSource, QueueReader, QueueReaderConfig, SourceRestore
from .refs import (
    DiskPayloadRef,
    RawRolloutRef,
    RolloutGroupRef,
    TrainBatchRef,
    discard_group,
    group_lease,
    inherit_queue_context,
    load_groups,
    materialize,
    pack_group,
    pack_payload,
    record_provenance,
    release_group_staging,
    release_publications,
    unpack_payload,
)
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
    "EXCLUSIVE_OWNER",
    "NO_VERSION_KEY",
    "QUEUE_ATTRIBUTES",
    "REMOVED_FLAGS",
    "REPLAY_FIELDS",
    "ArchiveReplay",
    "ControllerClient",
    "Dataset",
    "DatasetCursor",
    "DiskPayloadRef",
    "DynamicFilterOutput",
    "Generator",
    "Hooks",
    "JsonlDataset",
    "ModelSave",
    "PromptProducer",
    "QueueController",
    "QueueDataSource",
    "QueueReader",
    "QueueReaderConfig",
    "RawRolloutRef",
    "RestorePlan",
    "RolloutArchive",
    "RolloutConfig",
    "RolloutGroupRef",
    "RolloutStore",
    "Sample",
    "SampleCodec",
    "SampleStatus",
    "SourceRestore",
    "TrainBatchRef",
    "add_arguments",
    "bind_archive_pool",
    "close_rollout_stores",
    "commit_checkpoint",
    "discard_group",
    "from_args",
    "group_lease",
    "group_stage",
    "inherit_queue_context",
    "iter_samples",
    "load_debug_rollout_data",
    "load_function",
    "load_groups",
    "materialize",
    "model_dir",
    "numeric_version",
    "open_reader",
    "pack_group",
    "pack_payload",
    "probe_roundtrip",
    "read_commit",
    "record_provenance",
    "register_type",
    "release_group_staging",
    "release_publications",
    "resolve_checkpoint",
    "resolve_pool",
    "rollout_store",
    "run_io",
    "save_checkpoint",
    "save_debug_rollout_data",
    "scheduling_key",
    "seal_rollout_store",
    "settled",
    "staleness",
    "unpack_payload",
]
