"""The demo's RL job: fully asynchronous GRPO on the copy task, through straw's pool and queue.

:func:`run_job` is the driver loop of ROLLOUT.md section 1, with every piece real:

1. startup: write the prompt set (JSONL), ``resolve_checkpoint`` → ``QueueController`` →
   ``QueueDataSource.load`` → ``BatchBuilder.load``; the trainer ranks load the model of the
   restored step; the figures of what was recovered are reported;
2. per step K: generate (generation never stops between steps: groups of the next step are
   made while this one trains) → accept the raw collection → build the batch once (each rank
   gets a ``TrainBatchRef``) → train (every rank reads only its rows, computes its gradient;
   the mean gradient is applied on every rank) → ``training_completed(K)`` → a joint
   checkpoint every ``save_interval`` steps → pause admission → publish the new weights
   through the pool (a tensor payload) → the generators load them → resume admission.

Where the parts run is one seam (:class:`Backend`): :class:`LocalBackend` keeps everything in
this process (the ranks as objects, an ``AsyncRollout``); the Ray backend of ``straw demo``
(``straw.cli.demo_cluster``, since ``straw.rollout`` never imports Ray) makes the ranks Ray
actors and generates with ``DistributedRollout``, one worker per node of a local cluster on
127.0.0.1. The generation side itself is :class:`Generation` (generate, pause and resume
admission, close).

Everything the job reports goes through ``emit`` as plain JSON-able dicts (``start``,
``generated``, ``step``, ``final``); the command line renders them (``straw demo``).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Protocol, cast

from ..batch import BatchBuilder, ParallelConfig, load_rank_batch
from ..checkpoint import ModelSave, RestorePlan, model_dir, resolve_checkpoint, save_checkpoint
from ..collection import accept_raw_rollout
from ..config import RolloutConfig
from ..controller import QueueController
from ..dataset import JsonlDataset
from ..reader import QueueDataSource
from ..refs import DiskPayloadRef, TrainBatchRef, load_groups, pack_payload, release_publications
from ..runner import AsyncRollout
from ..sample import iter_samples, staleness
from . import task
from .engines import CopyEngine, LoggedReward, SyncedGenerator, WeightBoard, queue_task_id

__all__ = [
    "Backend",
    "DemoSettings",
    "Generation",
    "LocalBackend",
    "LocalGeneration",
    "Ranks",
    "TrainerRank",
    "demo_config",
    "inner_generator",
    "run_job",
]

log = logging.getLogger("straw.rollout.demo.job")

Emit = Callable[[dict[str, Any]], None]

#: Pack rotation target of the demo's pool, in MiB.
DEMO_SEGMENT_MIB = 2
#: Step time parts, in the order the loop runs them.
PHASES = ("generate", "accept", "build", "train", "checkpoint", "sync")


@dataclasses.dataclass(frozen=True)
class DemoSettings:
    """What one demo job is; every field has a command-line flag of ``straw demo``."""

    directory: str = "straw-demo"
    pool: str | None = None
    save: str | None = None
    steps: int = 30
    nodes: int = 3
    prompts_per_step: int = 8
    samples_per_prompt: int = 8
    save_interval: int = 5
    online_gc: bool = False
    engine: str = "policy"
    distributed: bool = True
    dp_size: int = 2
    seed: int = 0
    dataset_size: int = 1024
    slots_per_node: int | None = None
    prefetch: int | None = None
    token_seconds: float = 0.001
    decode_seconds: float = 0.12
    reward_log: str | None = None
    storage_declaration: str | None = None

    def __post_init__(self) -> None:
        for name in ("steps", "nodes", "prompts_per_step", "samples_per_prompt", "save_interval"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
        if self.engine not in ("policy", "copy"):
            raise ValueError(f"engine must be 'policy' or 'copy', got {self.engine!r}")
        if self.dp_size < 1 or (self.prompts_per_step * self.samples_per_prompt) % self.dp_size:
            raise ValueError("the rows of a step must split evenly over the trainer ranks")
        if (self.slots_per_node is not None and self.slots_per_node < 1) or self.dataset_size < 1:
            raise ValueError("slots_per_node and dataset_size must be positive")
        if not 0.0 <= self.decode_seconds <= 10.0:
            raise ValueError(f"--decode-seconds must be between 0 and 10, got {self.decode_seconds!r}")

    @property
    def slots(self) -> int:
        """Groups in flight per node: about one step's worth over all nodes (staleness stays near 1)."""
        if self.slots_per_node is not None:
            return self.slots_per_node
        nodes = self.nodes if self.distributed else 1
        return max(1, -(-self.prompts_per_step // nodes))

    @property
    def root(self) -> Path:
        return Path(self.directory).absolute()

    @property
    def pool_dir(self) -> Path:
        return Path(self.pool).absolute() if self.pool else self.root / "pool"

    @property
    def save_dir(self) -> Path:
        return Path(self.save).absolute() if self.save else self.root / "save"

    @property
    def prompts(self) -> Path:
        return self.root / "prompts.jsonl"

    @property
    def copy_task(self) -> task.CopyTask:
        return task.CopyTask(size=self.dataset_size, seed=self.seed)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> DemoSettings:
        return cls(**dict(values))


def demo_config(settings: DemoSettings) -> RolloutConfig:
    """The rollout flags of the demo job (a save directory, its pool, R3 on, GRPO rewards)."""
    from .policy import PolicyConfig

    shape = PolicyConfig()
    rows = settings.prompts_per_step * settings.samples_per_prompt
    return RolloutConfig.from_args(
        SimpleNamespace(
            save=str(settings.save_dir),
            save_interval=settings.save_interval,
            rollout_data_dir=str(settings.pool_dir),
            rollout_queue_online_gc=settings.online_gc,
            # Small packs (straw's default target is 1 GiB), so that the pool's pack count moves
            # and, with --online-gc, sealed packs nobody needs any more are reclaimed during the run.
            rollout_queue_segment_mib=DEMO_SEGMENT_MIB,
            # A JuiceFS pool: the mount's verified settings select the juicefs backend profile.
            rollout_storage_profile="juicefs" if settings.storage_declaration else "local",
            rollout_storage_declaration=settings.storage_declaration,
            prompt_data=str(settings.prompts),
            input_key="input",
            label_key="label",
            n_samples_per_prompt=settings.samples_per_prompt,
            rollout_batch_size=settings.prompts_per_step,
            global_batch_size=rows,
            micro_batch_size=rows // settings.dp_size,
            use_rollout_routing_replay=True,
            num_layers=shape.num_layers,
            num_experts=shape.num_experts,
            moe_router_topk=shape.top_k,
            # A few quick lease periods: a killed job's leases are revoked by the restart's
            # new epoch anyway, so nothing here waits for an expiry.
            rollout_queue_lease_seconds=60.0,
            identity_extra={"demo": {"engine": settings.engine, "seed": settings.seed}},
        )
    )


# --------------------------------------------------------------------------- trainer ranks


class TrainerRank:
    """One data-parallel trainer rank: a policy replica, its optimiser, and its rows only.

    Every rank starts from the same seed (or the same checkpoint) and applies the same mean
    gradient, so the replicas stay equal; rank 0 exports and saves.
    """

    def __init__(self, rank: int, seed: int, threads: int = 1) -> None:
        import torch

        from .grpo import GrpoTrainer
        from .policy import DemoPolicy

        if threads:
            torch.set_num_threads(threads)  # the ranks share two cores with the generators
        self.rank = rank
        self.policy = DemoPolicy(seed=seed)
        self.trainer = GrpoTrainer(self.policy)

    def gradients(self, refs: Sequence[TrainBatchRef]) -> tuple[Any, dict[str, float]]:
        """Load this rank's rows of the batch, and answer the flat gradient of its loss."""
        import torch

        batch = load_rank_batch(list(refs), self.rank)
        self.trainer.optimizer.zero_grad(set_to_none=False)
        loss, metrics = self.trainer.loss(batch)
        torch.autograd.backward(loss)
        flat = torch.cat([_grad(p).reshape(-1) for p in self.policy.parameters()])
        metrics["rows"] = float(len(batch["tokens"]))
        return flat, metrics

    def apply(self, flat: Any) -> float:
        """Install the mean gradient, clip it, take the optimiser step; answers the grad norm."""
        import torch

        offset = 0
        for p in self.policy.parameters():
            n = p.numel()
            _grad(p).copy_(flat[offset : offset + n].reshape(p.shape))
            offset += n
        norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), self.trainer.config.max_grad_norm)
        self.trainer.optimizer.step()
        return float(norm)

    def export(self) -> dict[str, Any]:
        from .policy import export_weights

        return export_weights(self.policy)

    def save(self, path: str) -> str:
        import torch

        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        torch.save(self.trainer.state_dict(), target)
        return str(target)

    def load(self, path: str) -> None:
        import torch

        self.trainer.load_state_dict(torch.load(path, weights_only=True))


def _grad(parameter: Any) -> Any:
    """A parameter's gradient (zeroed, never None: the optimiser zeroes without freeing)."""
    grad = parameter.grad
    if grad is None:
        raise RuntimeError("A policy parameter has no gradient after the backward pass")
    return grad


class Ranks:
    """The trainer ranks, local objects or Ray actors, behind one calling convention."""

    def __init__(self, handles: list[Any], ray: Any = None) -> None:
        self.handles = handles
        self.ray = ray

    def call(self, method: str, *args: Any, ranks: Sequence[int] | None = None) -> list[Any]:
        chosen = [self.handles[i] for i in (ranks if ranks is not None else range(len(self.handles)))]
        if self.ray is None:
            return [getattr(h, method)(*args) for h in chosen]
        return list(self.ray.get([getattr(h, method).remote(*args) for h in chosen]))

    def train(self, refs: Sequence[TrainBatchRef]) -> dict[str, float]:
        results = self.call("gradients", list(refs))
        mean = sum(flat for flat, _ in results) / len(results)
        norms = self.call("apply", mean)
        metrics = {k: sum(m[k] for _, m in results) / len(results) for k in ("loss", "clip_fraction")}
        metrics["rows_per_rank"] = min(m["rows"] for _, m in results)
        metrics["grad_norm"] = float(norms[0])
        return metrics


# --------------------------------------------------------------------------- generation


class Generation(Protocol):
    """The generation side of the job (a local or a distributed runner)."""

    def generate(self, rollout_id: int, *, prefetch: int = 0) -> Any: ...
    def pause_admission(self) -> bool: ...
    def resume_admission(self, was_paused: bool = False) -> None: ...
    def load_weights(self, version: int, ref: DiskPayloadRef) -> bool: ...
    def close(self) -> None: ...


def inner_generator(settings: DemoSettings) -> tuple[Any, Callable[[Mapping[str, Any], str], Any]]:
    """The engine of one generation worker, and how new weights are installed in it."""
    reward = LoggedReward(settings.reward_log)
    if settings.engine == "copy":
        engine = CopyEngine(token_seconds=settings.token_seconds, reward=reward)
        return engine, engine.load
    import torch

    from .local import PolicyGenerator
    from .policy import DemoPolicy

    torch.set_num_threads(1)
    generator = PolicyGenerator(
        DemoPolicy(seed=settings.seed),
        seed=settings.seed * 1_000_003,
        reward=reward,
        # Paced like a serving engine's decoding step, so a weight update finds generations in
        # flight and the partials it keeps finish under the new weights (partials continued).
        step_seconds=settings.decode_seconds,
    )
    return generator, generator.aupdate_weights


class LocalGeneration:
    """An ``AsyncRollout`` in this process, reading the board directly."""

    def __init__(
        self, settings: DemoSettings, config: RolloutConfig, source: Any, board: WeightBoard
    ) -> None:
        inner, load = inner_generator(settings)
        self.generator = SyncedGenerator(inner, board.current, load, version=-1)
        self.runner = AsyncRollout(
            config,
            source,
            self.generator,
            slots=settings.slots,
            weight_version=lambda: str(self.generator.version),
        )
        self.workers = 1

    def generate(self, rollout_id: int, *, prefetch: int = 0) -> Any:
        return self.runner.generate(rollout_id, prefetch=prefetch)

    def pause_admission(self) -> bool:
        return self.runner.pause_admission()

    def resume_admission(self, was_paused: bool = False) -> None:
        self.runner.resume_admission(was_paused)

    def load_weights(self, version: int, ref: DiskPayloadRef) -> bool:
        """Load the posted weights into the engine now, while admission is paused (thread-safe)."""
        inner = self.generator.inner
        install = getattr(inner, "update_weights", None) or inner.load
        install(ref.load(), str(version))  # PolicyGenerator.update_weights runs on its own loop
        self.generator.version = max(self.generator.version, version)
        self.generator.loads += 1
        return True

    def close(self) -> None:
        # Drain first (everything in flight becomes durable and the worker idles), then stop the
        # engine loop from this thread while the worker's event loop still runs, then the runner.
        try:
            self.runner.pause(drain=True)
            self.generator.close()
        finally:
            self.runner.close()


# --------------------------------------------------------------------------- backends


class Backend(Protocol):
    """Where the job's parts run: this process (:class:`LocalBackend`) or a Ray cluster.

    ``straw.rollout`` never imports Ray (only ``straw.rollout.ray`` does); the Ray backend of
    ``straw demo`` lives with the command line (``straw.cli.demo_cluster``).
    """

    nodes: int

    def controller(self, config: RolloutConfig, plan: RestorePlan, dataset: Callable[[], Any]) -> Any: ...
    def ranks(self, settings: DemoSettings) -> Ranks: ...
    def board(self) -> Any: ...
    def generation(self, settings: DemoSettings, config: RolloutConfig, source: Any, board: Any) -> Any: ...
    def close(self) -> None: ...


class LocalBackend:
    """Everything in this process: the ranks as objects, ``AsyncRollout``, a plain board."""

    nodes = 1

    def controller(
        self, config: RolloutConfig, plan: RestorePlan, dataset: Callable[[], Any]
    ) -> QueueController:
        return QueueController(config, dataset=dataset(), restore_plan=plan)

    def ranks(self, settings: DemoSettings) -> Ranks:
        return Ranks([TrainerRank(r, settings.seed, threads=0) for r in range(settings.dp_size)])

    def board(self) -> WeightBoard:
        return WeightBoard(-1)

    def generation(self, settings: DemoSettings, config: RolloutConfig, source: Any, board: Any) -> Any:
        return LocalGeneration(settings, config, source, board)

    def close(self) -> None:
        """Nothing to stop."""


# --------------------------------------------------------------------------- the job


@dataclasses.dataclass
class _Job:
    settings: DemoSettings
    config: RolloutConfig
    plan: RestorePlan
    controller: Any
    source: QueueDataSource
    builder: BatchBuilder
    ranks: Ranks
    board: Any
    generation: Any = None
    version: int = 0
    weights_ref: DiskPayloadRef | None = None


def _start(
    settings: DemoSettings, backend: Backend, stack: ExitStack
) -> tuple[RolloutConfig, RestorePlan, Any]:
    settings.root.mkdir(parents=True, exist_ok=True)
    settings.copy_task.write_jsonl(settings.prompts)  # the same bytes every start (same seed)
    config, plan = resolve_checkpoint(demo_config(settings))
    dataset = functools.partial(JsonlDataset, str(settings.prompts), input_key="input", label_key="label")
    controller = backend.controller(config, plan, dataset)
    stack.callback(controller.close)
    return controller.config, plan, controller


def recovery_figures(controller: Any, plan: RestorePlan) -> dict[str, Any]:
    """What a restart found: mode, step, and the groups reused, continued and re-issued.

    Read from the controller's metrics right after startup, before anything is taken: a
    rollback cancelled every live task, so the pending ones are exactly its re-issues.
    """
    metrics = controller.metrics()
    pending = int(metrics["tasks"].get("pending", 0))
    return {
        "mode": plan.mode,
        "step": plan.step,
        "accepted_reused": int(metrics["accepted_unprocessed"]["count"]) if plan.mode == "resume" else 0,
        "partials_pending": int(metrics.get("pending_returned", 0)),
        "reissued": pending if plan.mode in ("rollback", "empty") else 0,
    }


def queue_facts(controller: Any) -> dict[str, Any]:
    """Where every issued group is at the end: for the crash tests' bookkeeping.

    Needs the controller object itself (its queue); a controller behind a client answers {}.
    """
    if not isinstance(controller, QueueController):
        return {}
    queue = controller.queue

    def group_of(status: Mapping[str, Any] | None) -> int | None:
        meta = (status or {}).get("spec", {}).get("metadata") or {}
        value = meta.get("group_index")
        return int(value) if value is not None else None

    live = [
        g
        for status in queue.live_tasks(task_prefix="prompt:").values()
        if (g := group_of(status)) is not None
    ]
    unprocessed = [
        group
        for receipt in controller.unprocessed_receipts()
        if receipt.task_id.startswith("prompt:")
        if (group := group_of(queue.task_status(receipt.task_id))) is not None
    ]
    state = queue.producer_state("dataset") or {}
    issued = int((state.get("cursor") or {}).get("sample_group_index", 0))
    return {"issued": issued, "live": sorted(live), "unprocessed": sorted(unprocessed)}


def pool_usage(pool: Path) -> tuple[int, int]:
    """Pack files in the pool and their bytes."""
    packs = [p.stat().st_size for p in pool.rglob("*.pack") if p.is_file()]
    return len(packs), sum(packs)


def _publish_weights(job: _Job, version: int) -> DiskPayloadRef:
    """Publish rank 0's weights through the pool and post them on the board; answers their reference."""
    weights = job.ranks.call("export", ranks=[0])[0]
    ref = pack_payload(weights, config=job.config, rollout_id=f"weights-{version}")
    job.board.post(version, ref)
    if job.weights_ref is not None:
        # The previous version is no longer posted: every generator that had not loaded it
        # loads the new one instead, so its staging can end and GC may reclaim it.
        release_publications(job.config, [job.weights_ref])
    job.weights_ref, job.version = ref, version
    return ref


def _save_models(job: _Job, step: int) -> ModelSave:
    directory = model_dir(str(job.config.save), step)
    job.ranks.call("save", str(directory / "policy.pt"), ranks=[0])
    return ModelSave(str(directory))


def _step(job: _Job, step: int, emit: Emit) -> None:
    settings, config = job.settings, job.config
    times: dict[str, float] = {}
    clock = time.perf_counter
    started = mark = clock()

    def lap(name: str) -> None:
        nonlocal mark
        now = clock()
        times[name] = now - mark
        mark = now

    prefetch = settings.prefetch if settings.prefetch is not None else 0
    output = job.generation.generate(step, prefetch=prefetch)
    lap("generate")
    emit({"event": "generated", "step": step})
    raw = accept_raw_rollout(output, config=config, controller=job.controller, rollout_id=step)
    lap("accept")
    groups = load_groups(raw)
    samples = [s for group in groups for s in iter_samples(group)]
    refs = job.builder.build(raw, samples, rollout_id=step)
    lap("build")
    metrics = job.ranks.train(refs)
    job.builder.training_completed(step)
    lap("train")
    trained = {
        "group_indices": [int(g[0].group_index) for g in groups],
        "reward_calls": [
            [str((s.metadata or {}).get("reward_call")), str(queue_task_id(s)), s.index] for s in samples
        ],
    }
    # Before the checkpoint: a kill after its commit but before the step's own event still
    # leaves a record of what this step trained (the restart continues after the step).
    emit({"event": "trained", "step": step, **trained})
    saved = step % settings.save_interval == 0 or step == settings.steps - 1
    if saved:
        save_checkpoint(
            config,
            step,
            save_models=functools.partial(_save_models, job, step),
            source=job.source,
            builder=job.builder,
            runner=job.generation,
        )
    lap("checkpoint")
    serving = str(job.version)
    was_paused = job.generation.pause_admission()
    job.generation.load_weights(job.version, _publish_weights(job, job.version + 1))
    job.generation.resume_admission(was_paused)
    lap("sync")
    seconds = clock() - started
    lags = [s for s in (staleness(g, serving) for g in groups) if s is not None]
    packs, pool_bytes = pool_usage(settings.pool_dir)
    rewards = [float(cast(float, s.reward or 0.0)) for s in samples]
    emit(
        {
            "event": "step",
            "step": step,
            "mean_reward": sum(rewards) / len(rewards),
            "staleness_max": max(lags, default=0),
            "staleness_mean": sum(lags) / len(lags) if lags else 0.0,
            "groups": len(groups),
            "seconds": seconds,
            "groups_per_s": len(groups) / max(seconds, 1e-9),
            "partials_continued": sum(
                1 for g in groups if any(len(s.weight_versions) > 1 for s in iter_samples(g))
            ),
            "packs": packs,
            "pool_bytes": pool_bytes,
            "times": times,
            "checkpoint": saved,
            "weight_version": job.version,
            "loss": metrics["loss"],
            "rows_per_rank": metrics["rows_per_rank"],
            **trained,
        }
    )


def run_job(settings: DemoSettings, emit: Emit, backend: Backend | None = None) -> dict[str, Any]:
    """Run (or resume) the demo job until ``settings.steps`` steps are trained."""
    facts: dict[str, Any] = {}
    backend = backend if backend is not None else LocalBackend()
    with ExitStack() as stack:
        stack.callback(backend.close)
        config, plan, controller = _start(settings, backend, stack)
        source = QueueDataSource(config, controller=controller)
        stack.callback(source.close)
        source.load(config.ckpt_step)
        builder = BatchBuilder(config, controller, parallel=ParallelConfig(dp_size=settings.dp_size))
        if config.ckpt_step is not None:
            builder.load(config.ckpt_step)
        recovered = recovery_figures(controller, plan)
        ranks, board = backend.ranks(settings), backend.board()
        job = _Job(settings, config, plan, controller, source, builder, ranks, board)
        if config.ckpt_step is not None and plan.mode in ("rollback", "empty"):
            ranks.call("load", str(model_dir(str(config.save), config.ckpt_step) / "policy.pt"))
        first = int(config.start_rollout_id or 0)
        weights = _publish_weights(job, int(config.update_weight_start_version or 0))
        job.generation = backend.generation(settings, config, source, board)
        job.generation.load_weights(job.version, weights)  # restored (or initial) weights, before any group
        emit(
            {
                "event": "start",
                "first_step": first,
                "steps": settings.steps,
                "nodes": backend.nodes,
                "dp_size": settings.dp_size,
                "pool": str(settings.pool_dir),
                "save": str(settings.save_dir),
                "recovered": recovered,
            }
        )
        try:
            for step in range(first, settings.steps):
                _step(job, step, emit)
        finally:
            job.generation.close()
        facts = queue_facts(controller)
    emit({"event": "final", **facts})
    return facts
