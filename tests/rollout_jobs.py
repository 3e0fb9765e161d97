"""A small, deterministic training job over the real rollout layer, for checkpoint tests.

``Job`` wires what a framework's driver does (ROLLOUT.md section 1, "Driver loop"):
``resolve_checkpoint`` → ``QueueController`` → ``QueueDataSource.load`` → ``BatchBuilder.load``
→ per step: ``SyncRollout.generate`` → ``accept_raw_rollout`` → ``BatchBuilder.build`` →
"train" (read rank 0's batch, record which groups it holds) → ``training_completed`` →
``save_checkpoint`` every ``--save-interval`` steps (at steps 0, N, 2N, ...), with model files
written under ``iter_<step>``.

The generator is scripted and deterministic: it completes each group with response tokens
derived from its group index, can interrupt chosen groups once (they come back as partials),
and stamps each sample with a tag naming the process that generated it, so a test can tell
results generated before a restart from those generated after.

Tests import it by name; child programs add ``tests/`` to ``sys.path`` themselves.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from straw.protocol import RecordSetRef
from straw.rollout.archive import save_debug_rollout_data
from straw.rollout.batch import BatchBuilder, load_rank_batch
from straw.rollout.checkpoint import ModelSave, RestorePlan, model_dir, resolve_checkpoint, save_checkpoint
from straw.rollout.collection import accept_raw_rollout
from straw.rollout.config import RolloutConfig
from straw.rollout.controller import QueueController
from straw.rollout.reader import QueueDataSource
from straw.rollout.refs import RawRolloutRef, load_groups
from straw.rollout.runner import SyncRollout
from straw.rollout.sample import Sample, SampleStatus, iter_samples
from straw.store import SharedFilesystemStore


def job_config(save: Path, pool: Path, **flags: Any) -> RolloutConfig:
    """The flags of the test job: a save directory, its pool, two groups of two per step."""
    values: dict[str, Any] = {
        "save": str(save),
        "save_interval": 2,
        "rollout_data_dir": str(pool),
        "rollout_batch_size": 2,
        "n_samples_per_prompt": 2,
        "global_batch_size": 4,
        "rewards_normalization": False,
        "grpo_std_normalization": False,
        "task_max_attempts": 5,
        "refill_min_groups": 4,
    }
    values.update(flags)
    return RolloutConfig.from_args(SimpleNamespace(**values))


def rows(count: int = 200) -> list[dict[str, Any]]:
    return [{"input": f"prompt {i}"} for i in range(count)]


class ScriptedGenerator:
    """Completes groups deterministically; interrupts chosen groups once; may block on one.

    ``interrupt`` lists group indices whose first attempt returns ABORTED partials;
    ``block`` is a callable deciding, from a group index, whether to wait on ``release``
    (an event nobody sets in a killed child: the group stays leased). ``calls`` records
    the group index of every call. ``payload`` adds that many response tokens, so results
    have a size that rotates small packs.
    """

    def __init__(
        self,
        tag: str,
        *,
        interrupt: Iterable[int] = (),
        block: Callable[[int], bool] | None = None,
        payload: int = 0,
        on_call: Callable[[int], None] | None = None,
        on_block: Callable[[int], None] | None = None,
        routes: bool = False,
    ) -> None:
        self.tag = tag
        self.interrupt = set(interrupt)
        self.block = block
        self.payload = payload
        self.on_call = on_call
        self.on_block = on_block
        self.routes = routes
        self.release = threading.Event()
        self.calls: list[int] = []
        self._lock = threading.Lock()

    async def __call__(self, group: list[Any], *, weight_version: str | None) -> list[Any]:
        index = int(next(iter_samples(group)).group_index)  # type: ignore[arg-type]
        with self._lock:
            self.calls.append(index)
            first = index in self.interrupt
            self.interrupt.discard(index)
        if self.on_call is not None:
            self.on_call(index)
        if self.block is not None and self.block(index):
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, self._blocked, index)
        for sample in iter_samples(group):
            extra = [index * 10 + j % 10 for j in range(2 + self.payload)]
            sample.tokens = [*sample.tokens, *extra]
            sample.response_length += len(extra)
            sample.weight_versions = [*sample.weight_versions, weight_version or "0"]
            sample.metadata = {**(sample.metadata or {}), "by": self.tag}
            if first:
                sample.status = SampleStatus.ABORTED
                continue
            sample.status = SampleStatus.COMPLETED
            sample.reward = float(index % 3)
            if self.routes:  # R3 captures: one (layer, top-2) route per token but the last
                import torch

                rows = len(sample.tokens) - 1
                sample.rollout_routed_experts = (
                    (torch.arange(rows * 2) % 4).to(torch.uint8).reshape(rows, 1, 2)
                )
        return group

    def _blocked(self, index: int) -> None:
        if self.on_block is not None:
            self.on_block(index)
        self.release.wait()


def write_model(save: Path, step: int, *, text: str | None = None) -> ModelSave:
    """Model files of a step: weights and a small metadata file (hashed by the commit)."""
    directory = model_dir(save, step)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "model.bin").write_bytes((text or f"weights of step {step}").encode() * 64)
    (directory / "meta.json").write_text(f'{{"step": {step}}}')
    return ModelSave(str(directory))


@dataclasses.dataclass
class Trained:
    """What one training step used: each sample's group index and the tag of its generator."""

    groups: list[int]
    tags: list[str]
    raw: RawRolloutRef
    samples: list[Sample] = dataclasses.field(default_factory=list)


class Job:
    """One life of the test job (resolve, controller, data source, builder, runner)."""

    def __init__(
        self,
        config: RolloutConfig,
        generator: ScriptedGenerator,
        *,
        dataset: Any = None,
        fault: Callable[[str], None] | None = None,
        start_gc: bool = False,
        archive: bool = False,
    ) -> None:
        resolved, plan = resolve_checkpoint(config)
        self.config: RolloutConfig = resolved
        self.plan: RestorePlan = plan
        self.generator = generator
        self.archive = archive
        self.controller = QueueController(
            resolved,
            dataset=dataset if dataset is not None else rows(),
            restore_plan=plan,
            fault=fault,
            start_gc=start_gc,
        )
        try:
            self.source = QueueDataSource(resolved, controller=self.controller)
            self.restore = self.source.load(resolved.ckpt_step)
            self.builder = BatchBuilder(resolved, self.controller)
            if resolved.ckpt_step is not None:
                self.builder.load(resolved.ckpt_step)
            self.runner = SyncRollout(resolved, self.source, generator, weight_version=self.version)
        except BaseException:
            self.controller.close()
            raise
        self.weights = resolved.update_weight_start_version or 0
        self.trained: dict[int, Trained] = {}

    def version(self) -> str:
        return str(self.weights)

    @property
    def start(self) -> int:
        return int(self.config.start_rollout_id or 0)

    def step(self, rollout_id: int, *, checkpoint: bool | None = None) -> Trained:
        """Generate, accept, convert, train and complete one step; checkpoint on the interval."""
        output = asyncio.run(self.runner.generate(rollout_id))
        raw = accept_raw_rollout(
            output, config=self.config, controller=self.controller, rollout_id=rollout_id
        )
        samples = [s for group in load_groups(raw) for s in iter_samples(group)]
        refs = self.builder.build(raw, samples, rollout_id=rollout_id)
        batch = load_rank_batch(refs, 0)
        assert len(batch["tokens"]) == len(samples)  # rank 0 of one rank holds every row
        trained = Trained(
            [int(s.group_index) for s in samples],  # type: ignore[arg-type]
            [str((s.metadata or {}).get("by")) for s in samples],
            raw,
            samples,
        )
        self.trained[rollout_id] = trained
        if self.archive and self.config.save_debug_rollout_data:
            save_debug_rollout_data(
                self.config.save_debug_rollout_data, samples, rollout_id=rollout_id, config=self.config
            )
        self.builder.training_completed(rollout_id)
        interval = int(self.config.save_interval or 0)
        if checkpoint or (checkpoint is None and interval and rollout_id % interval == 0):
            self.checkpoint(rollout_id)
        self.weights += 1
        return trained

    def checkpoint(self, step: int) -> Path | None:
        save = Path(str(self.config.save))
        return save_checkpoint(
            self.config,
            step,
            save_models=lambda: write_model(save, step),
            source=self.source,
            builder=self.builder,
        )

    def close(self) -> None:
        try:
            self.source.close()
        finally:
            self.controller.close()

    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------- observing a job


def queue_state(controller: QueueController) -> dict[str, Any]:
    """What a rollback must reproduce exactly: tasks, producer state, processed set, owners."""
    queue = controller.queue
    tasks = {
        task_id: {
            "state": status["state"],
            "input": (status["spec"].get("input_ref") or {}).get("digest"),
            "metadata": status["spec"].get("metadata"),
        }
        for task_id, status in queue.tasks.items()
    }
    view = controller.training_view()
    return {
        "tasks": tasks,
        "producer": queue.producer_state("dataset"),
        "processed_cursor": view["processed_cursor"],
        "processed": view["processed_positions"],
        "commits": queue.metrics()["commits"],
    }


def save_files(save: Path) -> dict[str, bytes]:
    """The bytes of every file of a save directory (the lock file excluded)."""
    return {
        str(p.relative_to(save)): p.read_bytes()
        for p in sorted(save.rglob("*"))
        if p.is_file() and p.name != "session.lock" and "rollout_data" not in p.parts
    }


def owners(store: SharedFilesystemStore, save: Path) -> list[str]:
    """The application owners of the job (checkpoints and archives), sorted."""
    return sorted(o for o in store.owners() if o.startswith(("checkpoint:", "archive:")))


def reached_packs(store: SharedFilesystemStore, roots: Iterable[RecordSetRef]) -> set[str]:
    """Every pack a set of publications reaches through their records and dependencies.

    Walked with the public ``manifest()`` view, independently of the catalog, so a test can
    compare what GC kept with what the roots need.
    """
    seen: set[Any] = set()
    packs: set[str] = set()
    stack = list(roots)
    while stack:  # bounded by the publications reachable from the roots
        ref = stack.pop()
        key = ref.manifest  # a pack holds many extents, each numbering its records from 0
        if key in seen:
            continue
        seen.add(key)
        packs.add(ref.manifest.segment.path)
        manifest = store.manifest(ref)
        for record in manifest["records"]:
            packs.add(record["segment"]["path"])
        stack.extend(RecordSetRef.from_dict(d) for d in manifest["dependencies"])
    return packs


def task_roots(controller: QueueController) -> list[RecordSetRef]:
    """Inputs of live tasks and the training consumer's state (the queue's roots)."""
    queue = controller.queue
    found = [
        RecordSetRef.from_dict(status["spec"]["input_ref"])
        for status in queue.tasks.values()
        if status["state"] in ("pending", "leased") and status["spec"].get("input_ref")
    ]
    state = queue.load_consumer_state("training")
    if state is not None:
        found.append(RecordSetRef.from_dict(state["state_ref"]))
        if state.get("progress_ref"):
            found.append(RecordSetRef.from_dict(state["progress_ref"]))
    return found


def pack_files(pool: Path) -> dict[str, int]:
    """Every pack file of a pool and its size."""
    return {str(p.relative_to(pool)): p.stat().st_size for p in sorted((pool / "raw").rglob("*.pack"))}


def samples_of(groups: Any) -> list[Sample]:
    return [s for g in groups for s in iter_samples(g)]


def env_with_tests() -> Mapping[str, str]:
    tests = str(Path(__file__).parent)
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": tests + (os.pathsep + path if path else "")}
