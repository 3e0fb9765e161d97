"""The rollout-to-training boundary: convert an accepted raw collection once, read it per rank.

A :class:`BatchBuilder` turns one accepted raw collection (a :class:`RawRolloutRef`) into a
training batch in three steps (docs/ROLLOUT.md, "The batch builder"):

1. ``begin`` names the batch (``batch:<commit id of the raw receipt>``), writes its *plan*
   (what was selected and how it is to be converted, with a digest) and registers it with
   the controller as a control task, before any hook runs;
2. ``convert`` runs the reward post-processing and the conversion (the hooks, or
   :func:`default_convert`);
3. ``split`` publishes the conversion once, marks the batch ready (the controller advances
   the training view over its inputs), and hands each data-parallel rank a
   :class:`TrainBatchRef` naming only its rows.

A restart or a replay that finds the plan again reuses it; a batch already ready is split
again from its stored conversion without running any hook. :func:`load_rank_batch` reads one
rank's rows and nothing else; replay captures (R3 routes) stay lazy.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from ..protocol import CommitReceipt, Lease, RecordSetRef, digest
from ..reporting import write_report
from ..tensor import TensorRef
from .config import RolloutConfig
from .hooks import Hooks
from .pool import rollout_store
from .refs import DiskPayloadRef, RawRolloutRef, TrainBatchRef, pack_payload, release_publications
from .sample import Sample, SampleStatus, iter_samples

__all__ = [
    "NORMALIZED_ESTIMATORS",
    "STD_NORMALIZED_ESTIMATORS",
    "BatchBuilder",
    "DpSchedule",
    "ParallelConfig",
    "default_convert",
    "default_reward_post_process",
    "default_schedule",
    "load_rank_batch",
]

log = logging.getLogger("straw.rollout.batch")

#: Advantage estimators whose rewards are centred on their group's mean.
NORMALIZED_ESTIMATORS = frozenset({"grpo", "gspo", "cispo", "reinforce_plus_plus_baseline"})
#: Of those, the ones also divided by the group's standard deviation.
STD_NORMALIZED_ESTIMATORS = frozenset({"grpo", "gspo", "cispo"})
#: Added to a group's standard deviation before dividing (a group of equal rewards has std 0).
STD_EPSILON = 1e-6

#: Keys of the stored conversion that are not training data: the plan (a dependency edge that
#: keeps the plan and, through it, the raw collection alive) and the field layout
#: ``{"rows": [per-row field names], "whole": [fields every rank reads whole]}``, so a stored
#: conversion can be split again without decoding anything else.
PLAN_KEY = "_plan"
FIELDS_KEY = "_fields"
#: Fields every rank reads whole, whatever its partition.
WHOLE_FIELDS = ("raw_reward", "total_lengths")

# The dtype each per-row field is stored with; TensorRefs (lazy replay captures) are kept as they are.
_DTYPES = {
    "tokens": "int64",
    "loss_masks": "int32",
    "rollout_log_probs": "float32",
    "rollout_topk_token_ids": "int32",
    "rollout_topk_log_probs": "float32",
    "rollout_top_p_token_ids": "int32",
    "rollout_top_p_token_offsets": "int32",
    "rollout_top_p_log_probs": "float32",
}


class BatchController(Protocol):
    """What the builder calls on the job's controller (a subset of ``ControllerClient``)."""

    def batch(self, batch_id: str) -> dict[str, Any] | None: ...
    def plan_batch(self, batch_id: str, positions: Sequence[int], plan_ref: RecordSetRef) -> Any: ...
    def ready_batch(self, batch_id: str, ready_ref: RecordSetRef) -> Any: ...
    def finish_batch(self, batch_id: str) -> Any: ...
    def results(self, leases: Sequence[Lease]) -> Sequence[CommitReceipt | None]: ...
    def training_state(self) -> dict[str, Any] | None: ...
    def identity(self) -> dict[str, Any]: ...


# --------------------------------------------------------------------------- parallelism and schedules


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"ParallelConfig.{name} must be a positive integer, got {value!r}")


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """The trainer's parallel layout the schedule is made for (part of the plan identity)."""

    dp_size: int = 1
    cp_size: int = 1
    vpp_size: int = 1
    microbatch_group_size_per_vp_stage: int = 1

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            _positive(field.name, getattr(self, field.name))


@dataclasses.dataclass(frozen=True)
class DpSchedule:
    """Which rows each data-parallel rank trains on, in which micro-batches, in how many steps.

    ``partitions[r]`` lists the batch rows of rank ``r``; ``micro_batch_indices[r]`` lists
    that rank's micro-batches over all optimizer steps, each a list of positions *within its
    partition*; ``num_microbatches[s]`` is the number of micro-batches of step ``s`` (equal on
    every rank); ``global_batch_sizes[s]`` the rows of step ``s`` over all ranks.
    """

    partitions: list[list[int]]
    micro_batch_indices: list[list[list[int]]]
    num_microbatches: list[int]
    global_batch_sizes: list[int]

    @classmethod
    def coerce(cls, value: Any, rows: int, parallel: ParallelConfig) -> DpSchedule:
        """A schedule hook's answer (a DpSchedule or a 4-tuple) as a checked DpSchedule."""
        if isinstance(value, DpSchedule):
            parts = (value.partitions, value.micro_batch_indices, value.num_microbatches)
            sizes = value.global_batch_sizes
        elif isinstance(value, (tuple, list)) and len(value) == 4:
            parts, sizes = (value[0], value[1], value[2]), value[3]
        else:
            raise TypeError(
                "A schedule answers a DpSchedule or (partitions, micro_batch_indices, num_microbatches, "
                f"global_batch_sizes), got {type(value).__name__}"
            )
        schedule = cls(
            [[int(i) for i in p] for p in parts[0]],
            [[[int(i) for i in mb] for mb in rank] for rank in parts[1]],
            [int(n) for n in parts[2]],
            [int(n) for n in sizes],
        )
        schedule.check(rows, parallel)
        return schedule

    def check(self, rows: int, parallel: ParallelConfig) -> None:
        """Every row on exactly one rank, micro-batches inside their partition, steps consistent."""
        if len(self.partitions) != parallel.dp_size or len(self.micro_batch_indices) != parallel.dp_size:
            raise ValueError(
                f"A schedule needs one partition and one micro-batch list per DP rank ({parallel.dp_size})"
            )
        placed = sorted(i for partition in self.partitions for i in partition)
        if placed != list(range(rows)):
            raise ValueError(f"A schedule must place each of the {rows} rows on exactly one rank")
        if len(self.num_microbatches) != len(self.global_batch_sizes):
            raise ValueError("A schedule needs one micro-batch count per global batch size")
        if sum(self.global_batch_sizes) != rows:
            raise ValueError(f"The global batch sizes {self.global_batch_sizes} do not add up to {rows} rows")
        for rank, (partition, batches) in enumerate(
            zip(self.partitions, self.micro_batch_indices, strict=True)
        ):
            steps = sum(self.num_microbatches)
            if len(batches) != steps:
                raise ValueError(f"Rank {rank} has {len(batches)} micro-batches; the steps need {steps}")
            if any(not 0 <= i < len(partition) for mb in batches for i in mb):
                raise ValueError(f"Rank {rank} has a micro-batch index outside its partition")


def _global_batch_size(config: RolloutConfig, rows: int) -> int:
    if config.global_batch_size is not None:
        return config.global_batch_size
    if config.rollout_batch_size is not None:
        return config.rollout_batch_size * config.n_samples_per_prompt
    return rows


def default_schedule(
    total_lengths: Sequence[int], rollout_ids: Sequence[Any], parallel: ParallelConfig, config: RolloutConfig
) -> DpSchedule:
    """Round-robin rows over DP ranks; micro-batches of ``--micro-batch-size`` rows per step.

    Rank ``r`` gets rows ``r, r + dp, r + 2 dp, ...``. An optimizer step takes
    ``--global-batch-size`` rows (the last one the rest), which must split evenly over the
    ranks, so every rank runs the same number of micro-batches per step. With virtual
    pipeline stages the count per step must also be a multiple of
    ``microbatch_group_size_per_vp_stage``.
    """
    rows = len(total_lengths)
    if rows == 0:
        raise ValueError("Cannot schedule an empty training batch")
    dp = parallel.dp_size
    size = _global_batch_size(config, rows)
    if size % dp:
        raise ValueError(f"--global-batch-size {size} must be a multiple of dp_size {dp}")
    sizes = [min(size, rows - start) for start in range(0, rows, size)]
    if sizes[-1] % dp:
        raise ValueError(
            f"The last optimizer step has {sizes[-1]} rows, which do not split evenly over dp_size {dp}"
        )
    partitions = [list(range(rank, rows, dp)) for rank in range(dp)]
    micro = config.micro_batch_size
    counts = [math.ceil(step // dp / micro) for step in sizes]
    if parallel.vpp_size > 1 and any(n % parallel.microbatch_group_size_per_vp_stage for n in counts):
        raise ValueError(
            f"Micro-batches per step {counts} must be multiples of microbatch_group_size_per_vp_stage "
            f"{parallel.microbatch_group_size_per_vp_stage} with virtual pipeline stages"
        )
    batches: list[list[list[int]]] = [[] for _ in range(dp)]
    local = 0
    for step in sizes:
        per_rank = step // dp
        for start in range(0, per_rank, micro):
            chunk = list(range(local + start, local + min(start + micro, per_rank)))
            for rank in range(dp):
                batches[rank].append(list(chunk))
        local += per_rank
    return DpSchedule(partitions, batches, counts, sizes)


# --------------------------------------------------------------------------- rewards


def _episodes(samples: Sequence[Sample], config: RolloutConfig) -> list[list[int]]:
    """Row indices of each normalisation group (by ``group_index``, else fixed-size groups)."""
    marked = [s.group_index is not None for s in samples]
    if any(marked) and not all(marked):
        raise ValueError("Reward normalization requires group_index on every sample or on none of them")
    if all(marked) and samples:
        groups: dict[Any, list[int]] = {}
        for row, sample in enumerate(samples):
            groups.setdefault(sample.group_index, []).append(row)
        return list(groups.values())
    n = config.n_samples_per_prompt
    if len(samples) % n:
        raise ValueError("Reward normalization requires group_index for uneven groups or split rollouts")
    return [list(range(start, start + n)) for start in range(0, len(samples), n)]


def _episode_rewards(samples: Sequence[Sample], rows: list[int], raw: Sequence[float]) -> list[float]:
    """One reward per episode of a group: rows sharing a ``rollout_id`` count once (and must agree)."""
    seen: dict[Any, float] = {}
    values: list[float] = []
    for row in rows:
        episode = samples[row].rollout_id
        if episode is None:
            values.append(raw[row])
            continue
        if episode in seen:
            if seen[episode] != raw[row]:
                raise ValueError(f"Inconsistent rewards for group_index={samples[row].group_index}")
            continue
        seen[episode] = raw[row]
        values.append(raw[row])
    return values


def default_reward_post_process(
    samples: Sequence[Sample], config: RolloutConfig
) -> tuple[list[float], list[float]]:
    """``(raw_rewards, rewards)``: the scalar rewards, and those normalised per prompt group.

    For the estimators of :data:`NORMALIZED_ESTIMATORS` with ``--rewards-normalization``,
    each group's mean is subtracted; for those of :data:`STD_NORMALIZED_ESTIMATORS` with
    ``--grpo-std-normalization`` too, the result is divided by the group's unbiased standard
    deviation plus 1e-6 (a group of one episode has std 0). Rows of one episode (one
    ``rollout_id``) count once.
    """
    samples = list(samples)
    raw = [s.get_reward_value(config.reward_key) for s in samples]
    rewards = list(raw)
    estimator = config.advantage_estimator
    if not (estimator in NORMALIZED_ESTIMATORS and config.rewards_normalization):
        return raw, rewards
    divide = estimator in STD_NORMALIZED_ESTIMATORS and config.grpo_std_normalization
    for rows in _episodes(samples, config):
        values = _episode_rewards(samples, rows, raw)
        mean = math.fsum(values) / len(values)
        std = 0.0
        if len(values) > 1:
            std = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (len(values) - 1))
        for row in rows:
            centred = raw[row] - mean
            rewards[row] = centred / (std + STD_EPSILON) if divide else centred
    return raw, rewards


# --------------------------------------------------------------------------- conversion


def _rollout_ids(samples: Sequence[Sample]) -> list[int]:
    """Each sample's episode id; missing ones get the smallest integers not used by any sample."""
    used = {s.rollout_id for s in samples if s.rollout_id is not None}
    out: list[int] = []
    candidate = 0
    for sample in samples:
        if sample.rollout_id is not None:
            out.append(sample.rollout_id)
            continue
        while candidate in used:
            candidate += 1
        used.add(candidate)
        out.append(candidate)
    return out


def _loss_mask(sample: Sample) -> list[int]:
    length = sample.response_length
    if sample.loss_mask is None:
        mask = [1] * length
    else:
        mask = [int(v) for v in sample.loss_mask]
        if len(mask) != length:
            raise ValueError(
                f"Sample {sample.index} has a loss mask of {len(mask)} entries; "
                f"expected response_length = {length}"
            )
    return [0] * length if sample.remove_sample else mask


def _length(value: Any) -> int:
    if isinstance(value, TensorRef):
        return value.shape[0] if value.shape else 0
    shape = getattr(value, "shape", None)
    if shape is not None:
        return int(shape[0]) if len(shape) else 0
    return len(value)


def _score_centering(samples: Sequence[Sample], config: RolloutConfig, data: dict[str, Any]) -> None:
    for sample in samples:
        probs = sample.rollout_log_probs
        if probs is None or _length(probs) != sample.response_length:
            raise ValueError("Score centering requires sampler logprobs for every response token.")
    if config.rollout_top_p == 1:
        names = ["rollout_topk_token_ids", "rollout_topk_log_probs"]
    else:
        names = ["rollout_top_p_token_ids", "rollout_top_p_token_offsets", "rollout_top_p_log_probs"]
    for name in names:
        values = [getattr(s, name) for s in samples]
        missing = [s.index for s, v in zip(samples, values, strict=True) if v is None]
        if missing:
            raise ValueError(f"Score-centering data of sample {missing[0]} is invalid: {name} is missing")
        data[name] = values


def _zero_routes(sample: Sample, config: RolloutConfig) -> Any:
    import torch

    extra = config.plan_extra
    sizes = [extra.get(k) for k in ("num_layers", "moe_router_topk", "num_experts")]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in sizes):
        raise ValueError(
            "Zero routes for fully masked samples need positive num_layers, num_experts and moe_router_topk"
        )
    layers, topk, experts = (int(v or 0) for v in sizes)
    dtype = torch.uint8 if experts <= 256 else torch.int32
    return torch.zeros((max(len(sample.tokens) - 1, 0), layers, topk), dtype=dtype)


def _routes(samples: Sequence[Sample], masks: Sequence[list[int]], config: RolloutConfig) -> list[Any]:
    out: list[Any] = []
    missing: list[Any] = []
    for sample, mask in zip(samples, masks, strict=True):
        routes = sample.rollout_routed_experts
        if routes is not None:
            out.append(routes)
        elif not any(mask):
            out.append(_zero_routes(sample, config))
        else:
            missing.append(sample.index)
            out.append(None)
    if missing:
        raise ValueError(f"Rollout routed experts are missing for live sample indices {missing}")
    return out


def _optional(samples: Sequence[Sample], name: str) -> list[Any] | None:
    values = [getattr(s, name, None) for s in samples]
    return values if any(v is not None for v in values) else None


def default_convert(
    samples: Sequence[Sample],
    config: RolloutConfig,
    *,
    reward_post_process: Callable[..., Any] | None = None,
) -> dict[str, Any]:
    """The training data of a flat list of samples: one list entry per sample for each field.

    Rewards come from ``reward_post_process`` (or :func:`default_reward_post_process`).
    Fields: ``tokens``, ``response_lengths``, ``rewards``, ``raw_reward`` (a sample's
    ``metadata["raw_reward"]`` wins), ``truncated``, ``sample_indices``, ``rollout_ids``,
    ``loss_masks``, ``rollout_mask_sums`` (the loss-mask total of the row's episode),
    ``rollout_log_probs`` when every sample has them, the score-centering captures, the R3
    routes, ``train_metadata`` and ``multimodal_train_inputs`` when any sample has them.
    """
    samples = list(iter_samples(list(samples)))
    if not samples:
        raise ValueError("Cannot convert an empty rollout")
    post = reward_post_process or default_reward_post_process
    raw, rewards = post(samples, config)
    raw, rewards = list(raw), list(rewards)
    if len(raw) != len(samples) or len(rewards) != len(samples):
        raise ValueError(
            f"reward_post_process returned {len(raw)} raw rewards and {len(rewards)} rewards "
            f"for {len(samples)} samples"
        )
    masks = [_loss_mask(s) for s in samples]
    ids = _rollout_ids(samples)
    episode_sums: dict[int, int] = {}
    for episode, mask in zip(ids, masks, strict=True):
        episode_sums[episode] = episode_sums.get(episode, 0) + sum(mask)
    data: dict[str, Any] = {
        "tokens": [list(s.tokens) for s in samples],
        "response_lengths": [s.response_length for s in samples],
        "rewards": rewards,
        "raw_reward": [
            s.metadata["raw_reward"] if "raw_reward" in (s.metadata or {}) else r
            for s, r in zip(samples, raw, strict=True)
        ],
        "truncated": [1 if s.status is SampleStatus.TRUNCATED else 0 for s in samples],
        "sample_indices": [s.index for s in samples],
        "rollout_ids": ids,
        "loss_masks": masks,
        "rollout_mask_sums": [episode_sums[e] for e in ids],
    }
    probs = [s.rollout_log_probs for s in samples]
    if any(p is not None for p in probs):
        if any(p is None for p in probs):
            raise ValueError("rollout_log_probs must be set on every sample or on none of them")
        data["rollout_log_probs"] = probs
    if config.use_score_centering:
        _score_centering(samples, config, data)
    elif config.rollout_top_p != 1:
        for name in ("rollout_top_p_token_ids", "rollout_top_p_token_offsets", "rollout_top_p_log_probs"):
            values = [getattr(s, name) for s in samples]
            if all(v is not None for v in values):
                data[name] = values
    if config.use_rollout_routing_replay:
        data["rollout_routed_experts"] = _routes(samples, masks, config)
    for name in ("train_metadata", "multimodal_train_inputs"):
        present = _optional(samples, name)
        if present is not None:
            data[name] = present
    return data


#: Python number types a flat list may hold to be converted through NumPy, per target kind.
_INTEGRAL = frozenset({int, bool})
_NUMERIC = frozenset({int, float, bool})


def _tensor(value: Any, dtype: str) -> Any:
    """A per-row value as a torch tensor of ``dtype``; TensorRefs stay lazy references."""
    import numpy as np
    import torch

    if value is None or isinstance(value, TensorRef):
        return value
    target = getattr(torch, dtype)
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().to(target)
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(value)).to(target)
    if type(value) is list and set(map(type, value)) <= (_INTEGRAL if dtype.startswith("int") else _NUMERIC):
        # A flat list of Python numbers (token ids, log-probs: most of a conversion) converts
        # several times faster through NumPy, to the same values: ints exactly, floats by the
        # same C cast (an overflow to infinity included, hence no warning). Anything else, and
        # an int out of the dtype's range, goes to torch.tensor, which converts or refuses it.
        try:
            with np.errstate(over="ignore"):
                return torch.from_numpy(np.array(value, dtype=dtype))
        except OverflowError:
            pass
    return torch.tensor(value, dtype=target)


def tensorize(data: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of converted data with the per-row sequences as tensors of their fixed dtypes."""
    out = dict(data)
    for name, dtype in _DTYPES.items():
        values = out.get(name)
        if isinstance(values, (list, tuple)):
            out[name] = [_tensor(v, dtype) for v in values]
    return out


def _row_count(data: Mapping[str, Any]) -> int:
    tokens = data.get("tokens")
    if not isinstance(tokens, (list, tuple)):
        raise ValueError("A converted training batch needs a 'tokens' list with one entry per row")
    return len(tokens)


def _row_fields(data: Mapping[str, Any], rows: int) -> list[str]:
    """The fields holding one entry per row (each rank reads only its entries of these)."""
    return [
        key
        for key, value in data.items()
        if isinstance(key, str)
        and not key.startswith("_")
        and key not in WHOLE_FIELDS
        and isinstance(value, (list, tuple))
        and len(value) == rows
    ]


# --------------------------------------------------------------------------- the builder


def _record_set(value: Any) -> RecordSetRef:
    if isinstance(value, RecordSetRef):
        return value
    if isinstance(value, DiskPayloadRef):
        return value.manifest
    if isinstance(value, Mapping):
        return RecordSetRef.from_dict(value)
    raise TypeError(f"expected a RecordSetRef, got {type(value).__name__}")


def _lease(value: Any) -> Lease:
    return value if isinstance(value, Lease) else Lease.from_dict(value)


def _position(receipt: Any) -> int | None:
    if isinstance(receipt, CommitReceipt):
        return receipt.position
    if isinstance(receipt, Mapping) and "position" in receipt:
        return int(receipt["position"])
    return None


class BatchBuilder:
    """Converts accepted raw collections into per-rank training batches (one at a time).

    State: ``rollout_id`` (-1 before the first batch), ``raw_ref``, ``batch_id`` and
    ``plan_digest`` (the digest of the active batch's plan identity).
    """

    def __init__(
        self,
        config: RolloutConfig,
        controller: BatchController | None = None,
        *,
        hooks: Hooks | None = None,
        parallel: ParallelConfig | None = None,
    ) -> None:
        if not isinstance(config, RolloutConfig):
            raise TypeError(f"BatchBuilder takes a RolloutConfig, got {type(config).__name__}")
        if parallel is not None and not isinstance(parallel, ParallelConfig):
            raise TypeError(f"parallel= is a ParallelConfig, got {type(parallel).__name__}")
        self.config = config
        self.controller = controller
        self.hooks = hooks if hooks is not None else Hooks.from_config(config)
        self.parallel = parallel or ParallelConfig()
        self.rollout_id: int = -1
        self.raw_ref: RawRolloutRef | None = None
        self.batch_id: str | None = None
        self.plan_digest: str | None = None

    # ------------------------------------------------------------------ identities

    def configuration(self) -> dict[str, Any]:
        """The settings a conversion depends on (part of every plan identity)."""
        c = self.config
        return {
            "hooks": self.hooks.identities(),
            "advantage_estimator": c.advantage_estimator,
            "rewards_normalization": c.rewards_normalization,
            "grpo_std_normalization": c.grpo_std_normalization,
            "reward_key": c.reward_key,
            "global_batch_size": c.global_batch_size,
            "micro_batch_size": c.micro_batch_size,
            "n_samples_per_prompt": c.n_samples_per_prompt,
            "rollout_batch_size": c.rollout_batch_size,
            "use_score_centering": c.use_score_centering,
            "use_rollout_routing_replay": c.use_rollout_routing_replay,
            "plan_extra": dict(c.plan_extra),
        }

    def plan_identity(self, raw_ref: RawRolloutRef, samples: Sequence[Sample]) -> dict[str, Any]:
        """What the batch selects and how it is converted; its digest names the plan (no RNG state)."""
        return {
            "version": 1,
            "raw_digest": raw_ref.manifest.digest,
            "sample_indices": [s.index for s in samples],
            "rollout_ids": [s.rollout_id for s in samples],
            "configuration": self.configuration(),
            "parallel": dataclasses.asdict(self.parallel),
        }

    # ------------------------------------------------------------------ begin

    def _controller(self) -> BatchController:
        if self.controller is None:
            raise ValueError("A queued training batch needs the job's controller")
        return self.controller

    def _root(self) -> str:
        return str(rollout_store(self.config).store.backend.root)

    def _load_plan(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        plan = DiskPayloadRef(_record_set(batch["plan_ref"]), self._root()).load()
        if not isinstance(plan, dict) or plan.get("version") != 1 or "digest" not in plan:
            raise ValueError(f"The stored plan of batch {batch.get('batch_id')} is not a version 1 plan")
        return plan

    def _input_positions(self, raw_ref: RawRolloutRef, samples: Sequence[Sample]) -> list[int]:
        positions = {raw_ref.receipt.position}
        leases: dict[str, Lease] = {}
        for sample in samples:
            positions.update(int(p) for p in getattr(sample, "_queue_source_positions", None) or ())
            found = _position(getattr(sample, "_queue_receipt", None))
            if found is not None:
                positions.add(found)
            lease = getattr(sample, "_queue_lease", None)
            if lease is not None:
                lease = _lease(lease)
                leases[lease.attempt_id] = lease
        if leases:
            for receipt in self._controller().results(list(leases.values())):
                found = _position(receipt)
                if found is not None:
                    positions.add(found)
        return sorted(positions)

    def begin(
        self, raw_ref: RawRolloutRef | None, samples: Any, *, rollout_id: int, replay: bool = False
    ) -> list[TrainBatchRef] | None:
        """Name and plan the batch of ``raw_ref``; the refs when it was converted before, else None.

        Without a raw reference the conversion stays in memory (None). A batch planned
        before keeps its plan: another plan digest is refused unless ``replay`` (which reuses
        the retained plan even after a parallelism change); a batch already ready is split
        again from its stored conversion, running no hook and writing no pack.
        """
        flat = list(iter_samples(list(samples))) if samples is not None else []
        self.rollout_id = rollout_id
        self.raw_ref = raw_ref
        if raw_ref is None:
            self.batch_id = self.plan_digest = None
            return None
        if not isinstance(raw_ref, RawRolloutRef):
            raise TypeError(f"begin() takes an accepted RawRolloutRef, got {type(raw_ref).__name__}")
        controller = self._controller()
        batch_id = f"batch:{raw_ref.receipt.commit_id}"
        identity = self.plan_identity(raw_ref, flat)
        plan_digest = digest(identity)
        existing = controller.batch(batch_id)
        if existing is not None:
            plan = self._load_plan(existing)
            if plan["digest"] != plan_digest and not replay:
                raise ValueError(
                    "An existing batch ID cannot be reused with a different selection or conversion plan"
                )
            self.batch_id, self.plan_digest = batch_id, str(plan["digest"])
            if existing.get("ready"):
                return self._split_ready(existing)
            return None
        positions = self._input_positions(raw_ref, flat)
        plan = {**identity, "digest": plan_digest, "raw": raw_ref, "input_positions": positions}
        plan_ref = pack_payload(
            plan,
            config=self.config,
            rollout_id=rollout_id,
            submission_id=f"plan:{batch_id}:{uuid.uuid4().hex}",
        )
        controller.plan_batch(batch_id, positions, plan_ref.manifest)
        release_publications(self.config, [plan_ref])  # the batch's control task holds it now
        self.batch_id, self.plan_digest = batch_id, plan_digest
        return None

    # ------------------------------------------------------------------ convert and split

    def convert(self, samples: Any) -> dict[str, Any]:
        """The training data of the samples: the ``convert`` hook, else :func:`default_convert`."""
        flat = list(iter_samples(list(samples)))
        if self.hooks.convert is not None:
            data = self.hooks.convert(flat, self.config)
            if not isinstance(data, dict):
                raise TypeError(f"The convert hook returned {type(data).__name__}; expected a dict")
            return data
        return default_convert(flat, self.config, reward_post_process=self.hooks.reward_post_process)

    def _publish(self, data: Mapping[str, Any]) -> DiskPayloadRef:
        """Publish the conversion with its plan embedded and mark the batch ready (accept, then advance)."""
        controller = self._controller()
        if self.batch_id is None:
            raise ValueError("split() needs a planned batch: call begin() first")
        batch = controller.batch(self.batch_id)
        if batch is None:
            raise RuntimeError(f"Retained conversion has no queue plan: {self.batch_id}")
        rows = _row_count(data)
        if not isinstance(data.get("rollout_ids"), (list, tuple)) or len(data["rollout_ids"]) != rows:
            raise ValueError("A converted training batch needs 'rollout_ids' with one entry per row")
        stored = tensorize(data)
        stored["total_lengths"] = [_length(t) for t in stored["tokens"]]
        stored[FIELDS_KEY] = {
            "rows": _row_fields(stored, rows),
            "whole": [name for name in WHOLE_FIELDS if name in stored],
        }
        stored[PLAN_KEY] = DiskPayloadRef(_record_set(batch["plan_ref"]), self._root())
        lease = batch.get("lease")
        attempt = _lease(lease).attempt_id if lease is not None else None
        ref = pack_payload(
            stored,
            config=self.config,
            rollout_id=self.rollout_id,
            metadata={"task_id": self.batch_id, "attempt_id": attempt},
            submission_id=f"conversion:{self.batch_id}:{uuid.uuid4().hex}",
        )
        controller.ready_batch(self.batch_id, ref.manifest)
        release_publications(self.config, [ref])  # the ready batch holds it now
        return ref

    def _split_ready(self, batch: Mapping[str, Any]) -> list[TrainBatchRef]:
        """Split a batch accepted before from its stored conversion, running no hook.

        ``ready_batch`` is repeated first: it is idempotent, and it finishes the training
        view's advance over the batch's inputs if a crash interrupted it after the accept.
        """
        ready = DiskPayloadRef(_record_set(batch["ready_ref"]), self._root())
        self._controller().ready_batch(str(self.batch_id), ready.manifest)
        return self.split(ready)

    def split(self, data: Any) -> list[TrainBatchRef]:
        """Publish ``data`` (unless it is a stored conversion) and give each DP rank its reference."""
        reference = data if isinstance(data, DiskPayloadRef) else self._publish(data)
        if self.batch_id is None:
            raise ValueError("split() needs a planned batch: call begin() first")
        head = reference.load(selection={"total_lengths": None, "rollout_ids": None, FIELDS_KEY: None})
        lengths = list(head["total_lengths"])
        fields, whole = list(head[FIELDS_KEY]["rows"]), list(head[FIELDS_KEY]["whole"])
        schedule_fn = self.hooks.schedule or default_schedule
        schedule = DpSchedule.coerce(
            schedule_fn(lengths, list(head["rollout_ids"]), self.parallel, self.config),
            len(lengths),
            self.parallel,
        )
        schedule_digest = digest(
            {
                "conversion": reference.manifest.digest,
                "partitions": schedule.partitions,
                "micro_batch_indices": schedule.micro_batch_indices,
                "global_batch_sizes": schedule.global_batch_sizes,
            }
        )
        refs = []
        for rank, partition in enumerate(schedule.partitions):
            # One list object for every field: a pickled reference stores it once.
            selection: dict[str, Any] = dict.fromkeys(fields, partition)
            selection.update(dict.fromkeys(whole))
            refs.append(
                TrainBatchRef(
                    reference.manifest,
                    reference.root,
                    self.batch_id,
                    rank,
                    schedule_digest,
                    selection=selection,
                    schedule={
                        "partition": partition,
                        "global_batch_sizes": schedule.global_batch_sizes,
                        "num_microbatches": schedule.num_microbatches,
                        "micro_batch_indices": schedule.micro_batch_indices[rank],
                    },
                )
            )
        return refs

    def build(self, raw_ref: RawRolloutRef | None, samples: Any, *, rollout_id: int) -> Any:
        """``begin``, then ``convert`` and ``split`` unless the batch was converted before.

        Returns the per-rank references, or (without a raw reference) the converted data.
        """
        refs = self.begin(raw_ref, samples, rollout_id=rollout_id)
        if refs is not None:
            return refs
        data = self.convert(samples)
        if raw_ref is None:
            return data
        return self.split(data)

    def replay_converted(self, data: Any, batch_id: str) -> list[TrainBatchRef]:
        """Finish a planned batch from a conversion made before, running no hook.

        ``data`` is converted data or a stored conversion (a :class:`DiskPayloadRef`). A
        batch already ready is split from its own stored conversion.
        """
        controller = self._controller()
        batch = controller.batch(batch_id)
        if batch is None:
            raise RuntimeError(f"Retained conversion has no queue plan: {batch_id}")
        plan = self._load_plan(batch)
        self.batch_id, self.plan_digest = batch_id, str(plan["digest"])
        raw = plan.get("raw")
        self.raw_ref = raw if isinstance(raw, RawRolloutRef) else self.raw_ref
        if batch.get("ready"):
            return self._split_ready(batch)
        if isinstance(data, DiskPayloadRef):
            controller.ready_batch(batch_id, data.manifest)
            release_publications(self.config, [data])
        return self.split(data)

    # ------------------------------------------------------------------ completion and checkpoints

    def training_completed(self, rollout_id: int) -> None:
        """The active batch was trained on: the controller finishes it (its inputs become collectable)."""
        if rollout_id != self.rollout_id:
            raise ValueError("Training completion does not match the current batch")
        if self.controller is not None and self.batch_id is not None:
            self.controller.finish_batch(self.batch_id)

    def _state_path(self, directory: str, step: int) -> Path:
        return Path(os.path.abspath(directory)) / "rollout" / f"builder_state_{step}.json"

    def save(self, step: int) -> Path | None:
        """Write ``builder_state_<step>.json`` and retain the training view it names (§13.5).

        Nothing without a controller, without a training view, or in a replay job.
        """
        if self.controller is None:
            return None
        state = self.controller.training_state()
        if state is None:
            return None
        identity = self.controller.identity()
        if str(identity.get("queue_id", "")).startswith("debug:"):
            return None
        if not self.config.save:
            raise ValueError("BatchBuilder.save needs --save")
        path = self._state_path(self.config.save, step)
        refs = [RecordSetRef.from_dict(state["state_ref"])]
        if state.get("progress_ref") is not None:
            refs.append(RecordSetRef.from_dict(state["progress_ref"]))
        owner = f"checkpoint:{path}:{digest(state)}"
        bound = rollout_store(self.config)
        with bound.lock:
            bound.store.retain(owner, refs)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_report(
            path,
            {
                "version": 1,
                "step": step,
                "run_id": self.config.run_id,
                "queue_id": identity.get("queue_id"),
                "rollout_id": self.rollout_id,
                "consumer": {
                    "state_ref": state["state_ref"],
                    "progress_ref": state.get("progress_ref"),
                    "fetch_cursor": state["fetch_cursor"],
                    "processed_cursor": state["processed_cursor"],
                },
                "storage_owner": owner,
            },
        )
        return path

    def load(self, step: int) -> dict[str, Any] | None:
        """Read ``builder_state_<step>.json`` of the checkpoint being restored; sets ``rollout_id``.

        Nothing without ``--load`` or when the file is absent. The training view itself is
        restored by the controller, never rewound here.
        """
        load = self.config.load
        if not load:
            return None
        directory = Path(os.path.abspath(load))
        if directory.name.startswith("committed_") and directory.suffix == ".json":
            directory = directory.parent.parent
        path = self._state_path(str(directory), step)
        if not path.exists():
            return None
        state = json.loads(path.read_bytes())
        if (
            not isinstance(state, dict)
            or state.get("version") != 1
            or state.get("run_id") != self.config.run_id
        ):
            raise ValueError("BatchBuilder checkpoint run/schema differs")
        self.rollout_id = step
        return state


# --------------------------------------------------------------------------- ranks


def load_rank_batch(refs: Sequence[TrainBatchRef], rank: int) -> dict[str, Any]:
    """Rank ``rank``'s rows of a batch, with ``total_lengths``, ``local_raw_reward`` and its schedule.

    Only ``refs[rank]`` is read, and of it only the rank's entries of each per-row field
    (plus the whole ``raw_reward`` and ``total_lengths``, which are small). Replay captures
    stay lazy TensorRefs; a CP/TP rank reads its slice with ``ref[a:b]``.
    """
    refs = list(refs)
    if not refs or not all(isinstance(r, TrainBatchRef) for r in refs):
        raise TypeError("load_rank_batch takes the TrainBatchRefs of one batch")
    if len({(r.batch_id, r.plan_digest) for r in refs}) != 1:
        raise ValueError("Train batch references have inconsistent batch identities")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < len(refs):
        raise ValueError(f"rank must be in [0, {len(refs)}), got {rank!r}")
    ref = refs[rank]
    if ref.rank != rank:
        raise ValueError(f"refs[{rank}] names rank {ref.rank}; pass the references in rank order")
    data: dict[str, Any] = ref.load()
    partition = list((ref.schedule or {}).get("partition", []))
    lengths = data.get("total_lengths")
    if isinstance(lengths, (list, tuple)):
        data["total_lengths"] = [lengths[i] for i in partition]
    raw = data.get("raw_reward")
    if isinstance(raw, (list, tuple)):
        data["local_raw_reward"] = [raw[i] for i in partition]
    return data
