"""GRPO for the demo policy: group-normalised rewards and a clipped policy-gradient step.

The training step reads a batch dict shaped like the rollout layer's conversion (ROLLOUT.md
§13.2): per sample ``tokens`` (prompt + response ids), ``response_lengths``, ``rewards``
(already group-normalised advantages, one per sample) or per-token ``advantages``,
``loss_masks`` (one entry per response token), optionally ``rollout_log_probs`` (the
behaviour policy's log-probs, one per response token) and ``rollout_routed_experts``
(``[len(tokens) - 1, num_layers, top_k]`` per sample). Values may be lists, tensors, or lazy
references with a ``load()`` method (straw ``TensorRef``).

The loss is PPO's clipped surrogate against the rollout log-probs (the samples may come from
older weights: fully asynchronous training), averaged over the unmasked response tokens of
the batch. With ``routing_replay`` the training forward uses the rollout's experts (R3), so
the ratio compares the same computation and not a different routing.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .policy import DemoPolicy

__all__ = ["GrpoConfig", "GrpoTrainer", "group_advantages"]

#: Added to a group's standard deviation before dividing (as in ROLLOUT.md §13.2).
STD_EPSILON = 1e-6


def group_advantages(
    rewards: Sequence[float], group_size: int, *, std_normalization: bool = True
) -> list[float]:
    """GRPO advantages: each reward minus its group's mean, over the group's unbiased std + 1e-6.

    Rewards come in consecutive groups of ``group_size``; a group of one has std 0.
    """
    if group_size < 1 or len(rewards) % group_size:
        raise ValueError(f"{len(rewards)} rewards do not split into groups of {group_size}")
    out: list[float] = []
    for start in range(0, len(rewards), group_size):
        group = [float(r) for r in rewards[start : start + group_size]]
        mean = sum(group) / len(group)
        centred = [r - mean for r in group]
        if std_normalization:
            var = sum(c * c for c in centred) / (len(group) - 1) if len(group) > 1 else 0.0
            centred = [c / (math.sqrt(var) + STD_EPSILON) for c in centred]
        out.extend(centred)
    return out


@dataclass(frozen=True)
class GrpoConfig:
    """Optimiser and loss settings; the defaults suit the demo policy and task."""

    learning_rate: float = 1e-2
    clip_epsilon: float = 0.2
    max_grad_norm: float = 1.0
    temperature: float = 1.0
    routing_replay: bool = True


class GrpoTrainer:
    """Owns the optimiser of one policy replica and applies one GRPO step per batch."""

    def __init__(self, policy: DemoPolicy, config: GrpoConfig | None = None) -> None:
        self.policy = policy
        self.config = config or GrpoConfig()
        self.optimizer = torch.optim.Adam(policy.parameters(), lr=self.config.learning_rate)

    def loss(self, batch: Mapping[str, Any]) -> tuple[Tensor, dict[str, float]]:
        """The clipped surrogate loss of ``batch`` and its metrics (no optimiser step)."""
        rows = _Rows.from_batch(batch, self.policy, routing_replay=self.config.routing_replay)
        self.policy.train()
        new, _ = self.policy.token_log_probs(rows.tokens, rows.routes, temperature=self.config.temperature)
        new = new * rows.response  # only response positions matter; others are zeroed below
        old = rows.old if rows.old is not None else new.detach()
        ratio = torch.exp((new - old) * rows.response)
        eps = self.config.clip_epsilon
        surrogate = torch.minimum(ratio * rows.advantages, ratio.clamp(1 - eps, 1 + eps) * rows.advantages)
        weight = rows.mask.sum().clamp(min=1)
        loss = -(surrogate * rows.mask).sum() / weight
        with torch.no_grad():
            clipped = ((ratio - 1).abs() > eps).float()
            metrics = {
                "loss": float(loss),
                "clip_fraction": float((clipped * rows.mask).sum() / weight),
                "log_prob_gap": float(((new - old).abs() * rows.mask).sum() / weight),
                "tokens": float(rows.mask.sum()),
            }
        return loss, metrics

    def step(
        self,
        batch: Mapping[str, Any],
        *,
        average_gradients: Callable[[list[Tensor]], None] | None = None,
    ) -> dict[str, float]:
        """One optimiser step on ``batch``.

        ``average_gradients`` (data parallelism) receives every parameter's gradient after the
        backward pass and must replace them in place by their mean over the ranks.
        """
        self.optimizer.zero_grad(set_to_none=False)
        loss, metrics = self.loss(batch)
        torch.autograd.backward(loss)
        if average_gradients is not None:
            average_gradients([p.grad for p in self.policy.parameters() if p.grad is not None])
        norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), self.config.max_grad_norm)
        self.optimizer.step()
        metrics["grad_norm"] = float(norm)
        return metrics

    def state_dict(self) -> dict[str, Any]:
        """A snapshot (deep copy) of the policy weights and optimiser state, ``torch.save``-able.

        A copy, so that training on afterwards (or loading it into another trainer, whose
        optimiser would otherwise share the moment buffers) never changes the snapshot.
        """
        return copy.deepcopy({"policy": self.policy.state_dict(), "optimizer": self.optimizer.state_dict()})

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.policy.load_state_dict(state["policy"])
        self.optimizer.load_state_dict(state["optimizer"])


@dataclass
class _Rows:
    """A batch as padded tensors aligned with the next-token positions ``[b, t - 1]``."""

    tokens: Tensor  # [b, t] int64, right-padded
    routes: Tensor | None  # [b, t - 1, layers, top_k] or None
    response: Tensor  # [b, t - 1] 1.0 where the predicted token is a response token
    mask: Tensor  # [b, t - 1] the loss mask on those positions
    advantages: Tensor  # [b, t - 1]
    old: Tensor | None  # [b, t - 1] rollout log-probs on response positions, else None

    @classmethod
    def from_batch(cls, batch: Mapping[str, Any], policy: DemoPolicy, *, routing_replay: bool) -> _Rows:
        sequences = [_ints(t) for t in _field(batch, "tokens")]
        lengths = [int(n) for n in _values(_field(batch, "response_lengths"))]
        if not sequences or len(lengths) != len(sequences):
            raise ValueError(f"Batch has {len(sequences)} token rows and {len(lengths)} response lengths")
        width = max(len(s) for s in sequences)
        b = len(sequences)
        tokens = torch.zeros((b, width), dtype=torch.long)
        response = torch.zeros((b, width - 1))
        mask = torch.zeros((b, width - 1))
        advantages = torch.zeros((b, width - 1))
        per_sample = _sample_advantages(batch, lengths)
        masks = batch.get("loss_masks")
        olds = batch.get("rollout_log_probs")
        old = torch.zeros((b, width - 1)) if olds is not None else None
        for i, (seq, n) in enumerate(zip(sequences, lengths, strict=True)):
            if not 0 < n < len(seq):
                raise ValueError(f"Sample {i}: response_length {n} does not fit {len(seq)} tokens")
            tokens[i, : len(seq)] = torch.tensor(seq)
            span = slice(len(seq) - n - 1, len(seq) - 1)
            response[i, span] = 1.0
            row_mask = [1.0] * n if masks is None else _floats(masks[i])
            _check_length(row_mask, n, i, "loss_masks")
            mask[i, span] = torch.tensor(row_mask)
            advantages[i, span] = torch.tensor(per_sample[i])
            if old is not None and olds is not None:
                row_old = _floats(olds[i])
                _check_length(row_old, n, i, "rollout_log_probs")
                old[i, span] = torch.tensor(row_old)
        routes = _routes(batch, sequences, width, policy) if routing_replay else None
        return cls(tokens, routes, response, mask, advantages, old)


def _routes(
    batch: Mapping[str, Any], sequences: list[list[int]], width: int, policy: DemoPolicy
) -> Tensor | None:
    """Replay routes padded to ``[b, width - 1, layers, top_k]``; None if the batch has none."""
    given = batch.get("rollout_routed_experts")
    if given is None:
        return None
    c = policy.config
    out = torch.zeros((len(sequences), width - 1, c.num_layers, c.top_k), dtype=torch.long)
    for i, seq in enumerate(sequences):
        value = _tensor(given[i]).long()
        expected = (len(seq) - 1, c.num_layers, c.top_k)
        if tuple(value.shape) != expected:
            raise ValueError(
                f"Sample {i}: rollout_routed_experts shape {tuple(value.shape)}, expected {expected}"
            )
        if value.numel() and (int(value.min()) < 0 or int(value.max()) >= c.num_experts):
            raise ValueError(
                f"Sample {i}: rollout_routed_experts names an expert outside 0..{c.num_experts - 1}"
            )
        out[i, : len(seq) - 1] = value
    return out


def _sample_advantages(batch: Mapping[str, Any], lengths: list[int]) -> list[list[float]]:
    """Per-token advantages of every sample: ``advantages`` if given, else ``rewards`` broadcast."""
    if batch.get("advantages") is not None:
        rows = [_floats(a) for a in batch["advantages"]]
        for i, (row, n) in enumerate(zip(rows, lengths, strict=True)):
            _check_length(row, n, i, "advantages")
        return rows
    rewards = [float(r) for r in _values(_field(batch, "rewards"))]
    if len(rewards) != len(lengths):
        raise ValueError(f"Batch has {len(rewards)} rewards for {len(lengths)} samples")
    return [[r] * n for r, n in zip(rewards, lengths, strict=True)]


def _field(batch: Mapping[str, Any], key: str) -> Any:
    if key not in batch:
        raise KeyError(f"Training batch has no {key!r}")
    return batch[key]


def _tensor(value: Any) -> Tensor:
    """A tensor from a list, a tensor, a numpy array or a lazy reference with ``load()``."""
    if hasattr(value, "load") and callable(value.load) and not isinstance(value, Tensor):
        value = value.load()
    return value if isinstance(value, Tensor) else torch.as_tensor(value)


def _values(value: Any) -> list[Any]:
    return _tensor(value).tolist() if not isinstance(value, list) else value


def _ints(value: Any) -> list[int]:
    return [int(v) for v in _tensor(value).reshape(-1).tolist()]


def _floats(value: Any) -> list[float]:
    return [float(v) for v in _tensor(value).reshape(-1).tolist()]


def _check_length(row: list[float], n: int, i: int, name: str) -> None:
    if len(row) != n:
        raise ValueError(f"Sample {i}: {name} has {len(row)} entries for response_length {n}")
