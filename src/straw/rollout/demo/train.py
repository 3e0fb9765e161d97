"""A plain in-process GRPO loop on the copy task (no queue, no pool, no Ray).

It is the reference the full demo is measured against: the same task, policy, sampling and
training step, with none of straw's machinery, so "does the policy learn, and how fast" has
an answer independent of the data plane. ``benchmarks/demo_learning.py`` runs the default
size and reports the mean reward of the first and last steps and the wall time.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from . import task
from .grpo import GrpoConfig, GrpoTrainer, group_advantages
from .policy import DemoPolicy, PolicyConfig

__all__ = ["LoopConfig", "StepResult", "run_plain_loop"]


@dataclass(frozen=True)
class LoopConfig:
    """Size of the loop; the defaults are the demo's (8 prompts x 8 samples per step)."""

    steps: int = 30
    prompts_per_step: int = 8
    samples_per_prompt: int = 8
    seed: int = 0
    task: task.CopyTask = field(default_factory=task.CopyTask)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    grpo: GrpoConfig = field(default_factory=GrpoConfig)


@dataclass(frozen=True)
class StepResult:
    step: int
    mean_reward: float
    seconds: float
    metrics: dict[str, float]


def run_plain_loop(
    config: LoopConfig | None = None,
    *,
    clock: Callable[[], float] = time.perf_counter,
) -> list[StepResult]:
    """Generate, reward, normalise per group and train, ``config.steps`` times."""
    config = config or LoopConfig()
    policy = DemoPolicy(config.policy, seed=config.seed)
    trainer = GrpoTrainer(policy, config.grpo)
    rows = list(config.task.rows())
    order = random.Random(config.seed)
    results = []
    for step in range(config.steps):
        started = clock()
        prompts = [order.choice(rows) for _ in range(config.prompts_per_step)]
        batch, mean_reward = _rollout(policy, config, prompts, step)
        metrics = trainer.step(batch)
        results.append(StepResult(step, mean_reward, clock() - started, metrics))
    return results


def _rollout(
    policy: DemoPolicy, config: LoopConfig, prompts: list[dict[str, Any]], step: int
) -> tuple[dict[str, Any], float]:
    """One step's samples as a training batch (the §13.2 conversion's keys) and their mean reward."""
    n = config.samples_per_prompt
    prefixes = [task.encode_prompt(row["input"]) for row in prompts for _ in range(n)]
    seeds = [(config.seed << 40) ^ (step << 20) ^ i for i in range(len(prefixes))]
    policy.eval()
    generations = policy.generate(
        prefixes,
        max_new_tokens=config.task.max_new_tokens,
        temperature=config.grpo.temperature,
        seeds=seeds,
    )
    labels = [row["label"] for row in prompts for _ in range(n)]
    raw = [task.reward(g.tokens, label) for g, label in zip(generations, labels, strict=True)]
    batch = {
        "tokens": [p + g.tokens for p, g in zip(prefixes, generations, strict=True)],
        "response_lengths": [len(g.tokens) for g in generations],
        "rewards": group_advantages(raw, n),
        "loss_masks": [[1] * len(g.tokens) for g in generations],
        "rollout_log_probs": [g.log_probs for g in generations],
        "rollout_routed_experts": [g.routes for g in generations],
    }
    return batch, sum(raw) / len(raw)
