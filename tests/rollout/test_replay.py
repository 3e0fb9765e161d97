"""Train-only replay of debug archives into new isolated queues (acceptance scenarios 51, 52)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from rollout_jobs import Job, ScriptedGenerator, job_config, rows
from straw.rollout import codec as rollout_codec
from straw.rollout.archive import ArchiveReplay, RolloutArchive, save_debug_rollout_data
from straw.rollout.batch import BatchBuilder
from straw.rollout.checkpoint import resolve_checkpoint
from straw.rollout.config import RolloutConfig
from straw.rollout.controller import QueueController
from straw.rollout.pool import close_rollout_stores, rollout_store
from straw.rollout.refs import materialize
from straw.rollout.sample import QUEUE_ATTRIBUTES, Sample
from straw.tensor import TensorRef

STEPS = (7, 8)
KINDS = ("reference", "chunks", "standalone")
R3 = {"use_rollout_routing_replay": True, "num_layers": 1, "moe_router_topk": 2, "num_experts": 4}


@dataclasses.dataclass
class Source:
    """A job that trained steps 7 and 8 and archived each of them three ways."""

    pool: Path
    archives: Path
    samples: dict[int, list[Sample]]
    job: Job

    def template(self, kind: str, suffix: str = ".straw.json") -> str:
        return str(self.archives / kind / f"rollout_{{rollout_id}}{suffix}")


@pytest.fixture
def source(tmp_path: Path) -> Iterator[Source]:
    config = job_config(tmp_path / "save", tmp_path / "pool", rollout_batch_size=1, global_batch_size=2, **R3)
    job = Job(config, ScriptedGenerator("source", routes=True))
    archives = tmp_path / "archives"
    made = Source(tmp_path / "pool", archives, {}, job)
    try:
        for step in STEPS:
            trained = job.step(step, checkpoint=False)
            made.samples[step] = trained.samples
            RolloutArchive.save(
                archives / "reference" / f"rollout_{step}.straw.json",
                trained.samples,
                rollout_id=step,
                config=job.config,
                reference=trained.raw,
            )
            save_debug_rollout_data(
                made.template("chunks"), trained.samples, rollout_id=step, config=job.config
            )
            save_debug_rollout_data(made.template("standalone"), trained.samples, rollout_id=step)
            save_debug_rollout_data(made.template("dumps", ".pt"), trained.samples, rollout_id=step)
        yield made
    finally:
        job.close()


def replay_config(template: str, tmp_path: Path, **flags: Any) -> RolloutConfig:
    values = {
        "load_debug_rollout_data": template,
        "rollout_data_dir": str(tmp_path / "unused-pool"),
        "rollout_batch_size": 1,
        "n_samples_per_prompt": 2,
        "global_batch_size": 2,
        "rewards_normalization": False,
        "grpo_std_normalization": False,
        **R3,
        **flags,
    }
    return RolloutConfig.from_args(SimpleNamespace(**values))


class Counting:
    """Counts Sample encodes and TensorRef loads while active."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.encoded = 0
        self.loaded = 0
        run, load = rollout_codec._SamplePrep.run, TensorRef.load

        def counted_run(prep: Any) -> Any:
            self.encoded += 1
            return run(prep)

        def counted_load(ref: TensorRef, **kwargs: Any) -> Any:
            self.loaded += 1
            return load(ref, **kwargs)

        monkeypatch.setattr(rollout_codec._SamplePrep, "run", counted_run)
        monkeypatch.setattr(TensorRef, "load", counted_load)


def test_scenario_51_whole_archives_replay_by_reference_into_their_own_queues(
    source: Source, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tasks_before = {t: s["state"] for t, s in source.job.controller.queue.tasks.items()}
    queues: list[str] = []
    counting = Counting(monkeypatch)
    for kind in KINDS:
        for start in (None, 7):
            config = replay_config(source.template(kind), tmp_path, start_rollout_id=start)
            resolved, plan = resolve_checkpoint(config)
            with RolloutArchive(source.archives / kind / "rollout_7.straw.json") as archive:
                assert resolved.rollout_data_dir == archive.root
                assert resolved.run_id == archive.index["run_id"]
            archived: dict[int, list[Sample]] = {}
            assert plan.queue_id.startswith("debug:")
            with QueueController(resolved, dataset=rows(), restore_plan=plan) as controller:
                queues.append(controller.identity()["queue_id"])
                replay = ArchiveReplay(resolved, controller)
                builder = BatchBuilder(resolved, controller)
                store = rollout_store(resolved).store
                for step in STEPS:
                    with RolloutArchive(source.archives / kind / f"rollout_{step}.straw.json") as archive:
                        archived[step] = archive.load_samples()
                    before = (store.metrics["payload_bytes"], counting.encoded, counting.loaded)
                    samples, raw = replay.collect(step)
                    assert store.metrics["payload_bytes"] - before[0] < 10_000
                    assert (counting.encoded, counting.loaded) == before[1:]  # no encode, no tensor read
                    assert [s.index for s in samples] == [s.index for s in source.samples[step]]
                    assert not any(hasattr(s, name) for s in samples for name in QUEUE_ATTRIBUTES)
                    routes = [s.rollout_routed_experts.record_ref for s in samples]
                    assert routes == [s.rollout_routed_experts.record_ref for s in archived[step]]
                    refs = builder.build(raw, samples, rollout_id=step)
                    batch = controller.batch(refs[0].batch_id)
                    assert batch is not None and batch["input_positions"] == [0 if step == 7 else 2]
                    builder.training_completed(step)
                assert controller.training_view()["processed_cursor"] == 4
            close_rollout_stores()
    assert len(set(queues)) == len(queues)  # every replay is a queue of its own
    assert {t: s["state"] for t, s in source.job.controller.queue.tasks.items()} == tasks_before
    assert not (tmp_path / "unused-pool").exists()


def test_scenario_52_one_replay_reads_one_pool_and_run(source: Source, tmp_path: Path) -> None:
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    for step, kind in ((7, "chunks"), (8, "standalone")):
        (mixed / f"rollout_{step}.straw.json").write_bytes(
            (source.archives / kind / f"rollout_{step}.straw.json").read_bytes()
        )
    config = replay_config(str(mixed / "rollout_{rollout_id}.straw.json"), tmp_path)
    resolved, plan = resolve_checkpoint(config)
    with QueueController(resolved, dataset=rows(), restore_plan=plan) as controller:
        replay = ArchiveReplay(resolved, controller)
        kept = dataclasses.asdict(replay.config)
        replay.collect(7)
        with pytest.raises(ValueError, match="same Straw storage pool and run"):
            replay.collect(8)
        assert dataclasses.asdict(replay.config) == kept
    with pytest.raises(ValueError, match="needs --load-debug-rollout-data"):
        ArchiveReplay(dataclasses.replace(resolved, load_debug_rollout_data=None), controller)


def one_sgd_step(data: dict[str, Any]) -> torch.Tensor:
    """One CPU SGD step of a tiny model on a converted batch; returns the new weights."""
    torch.manual_seed(0)
    embedding = torch.nn.Embedding(1000, 3)
    optimizer = torch.optim.SGD(embedding.parameters(), lr=0.1)
    loss = torch.zeros(())
    for tokens, reward, routes in zip(
        data["tokens"], data["rewards"], data["rollout_routed_experts"], strict=True
    ):
        ids = torch.as_tensor(tokens).long() % 1000
        route = routes.load() if isinstance(routes, TensorRef) else torch.as_tensor(routes)
        loss = loss + embedding(ids).sum() * float(reward) + embedding(route.long().flatten()).mean()
    loss.backward()
    optimizer.step()
    return embedding.weight.detach().clone()


def test_scenario_52_pt_and_archive_replays_train_the_same(source: Source, tmp_path: Path) -> None:
    converted = {}
    for name, template, pool in (
        ("archive", source.template("chunks"), None),
        ("pt", source.template("dumps", ".pt"), str(tmp_path / "pt-pool")),
    ):
        flags = {"rollout_data_dir": pool} if pool else {}
        resolved, plan = resolve_checkpoint(replay_config(template, tmp_path, **flags))
        with QueueController(resolved, dataset=rows(), restore_plan=plan) as controller:
            samples, raw = ArchiveReplay(resolved, controller).collect(7)
            builder = BatchBuilder(resolved, controller)
            converted[name] = materialize(builder.convert(samples))
            builder.build(raw, samples, rollout_id=7)
        close_rollout_stores()
    archive, dump = converted["archive"], converted["pt"]
    assert sorted(archive) == sorted(dump)
    for key in archive:
        left, right = archive[key], dump[key]
        if isinstance(left, list) and left and isinstance(left[0], torch.Tensor):
            assert all(torch.equal(a, torch.as_tensor(b)) for a, b in zip(left, right, strict=True)), key
        else:
            assert left == right, key
    assert torch.equal(one_sgd_step(archive), one_sgd_step(dump))
