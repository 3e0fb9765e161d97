"""BatchBuilder against a real QueueController: plans, conversion, split, rank loads, completion,
checkpoints (acceptance scenarios 28-33)."""

from __future__ import annotations

import json
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from rollout_helpers import finish
from straw.errors import InvalidReference
from straw.protocol import RecordSetRef
from straw.rollout import batch as batch_module
from straw.rollout.batch import BatchBuilder, ParallelConfig, load_rank_batch
from straw.rollout.collection import accept_raw_rollout
from straw.rollout.config import RolloutConfig
from straw.rollout.controller import QueueController
from straw.rollout.hooks import Hooks
from straw.rollout.reader import QueueReader
from straw.rollout.refs import DiskPayloadRef, RawRolloutRef, TrainBatchRef, load_groups
from straw.rollout.sample import Sample, SampleStatus, iter_samples
from straw.tensor import TensorRef

OpenController = Callable[..., QueueController]
OpenReader = Callable[..., QueueReader]
MakeConfig = Callable[..., RolloutConfig]


def packs(pool: Path) -> set[Path]:
    return set(pool.rglob("*.pack"))


def accepted_rollout(
    controller: QueueController, reader: QueueReader, groups: int, *, rollout_id: int = 0, **finished: Any
) -> tuple[RawRolloutRef, list[Sample]]:
    """Generate ``groups`` groups through the reader, accept them, and load the samples back."""
    refs = [
        reader.publish_group(finish(group, **finished), rollout_id=rollout_id)
        for group in reader.get_samples(groups)
    ]
    raw = accept_raw_rollout(refs, config=controller.config, controller=controller, rollout_id=rollout_id)
    return raw, [s for group in load_groups(raw) for s in iter_samples(group)]


class Counting:
    """Hooks that count their calls (a replay must run none of them)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def hooks(self) -> Hooks:
        def reward(samples: list[Sample], config: RolloutConfig) -> tuple[list[float], list[float]]:
            self.calls.append("reward_post_process")
            return [s.get_reward_value() for s in samples], [0.5 for _ in samples]

        return Hooks(reward_post_process=reward)


def refusing(like: Hooks | None = None) -> Hooks:
    """Hooks that fail if called, with the identities of ``like`` (a restart configures the same hooks)."""

    def never(*args: Any) -> Any:
        raise AssertionError("a hook ran during a replay")

    identities = {name: path for name, path in (like or Hooks()).identities().items() if path is not None}
    if like is None:
        return Hooks(reward_post_process=never, convert=never)
    return Hooks(**dict.fromkeys(identities, never), paths=identities)


# --------------------------------------------------------------------------- scenario 28


def test_scenario_28_begin_plans_once_and_a_replay_finishes_without_hooks(
    make_config: MakeConfig, open_controller: OpenController, open_reader: OpenReader
) -> None:
    config = make_config(rollout_batch_size=2, n_samples_per_prompt=2)
    controller = open_controller(config)
    raw, samples = accepted_rollout(controller, open_reader(controller), 2)
    counting = Counting()
    hooks = counting.hooks()
    builder = BatchBuilder(config, controller, hooks=hooks)
    assert builder.begin(raw, samples, rollout_id=0) is None
    batch_id = f"batch:{raw.receipt.commit_id}"
    assert builder.batch_id == batch_id
    planned = controller.batch(batch_id)
    assert planned is not None and planned["ready"] is False
    plan = DiskPayloadRef(planned["plan_ref"], str(config.rollout_data_dir)).load()
    assert "rng" not in plan and "rng" not in plan["configuration"]
    assert plan["digest"] == builder.plan_digest and plan["raw"] == raw
    # inputs: the raw collection and the two accepted groups it names
    assert plan["input_positions"] == sorted(
        {raw.receipt.position, *(s._queue_receipt["position"] for s in samples)}
    )
    assert builder.begin(raw, samples, rollout_id=0) is None
    assert controller.batch(batch_id) == planned
    # The conversion ran, then the process stopped before the batch was marked ready.
    converted = builder.convert(samples)
    assert counting.calls == ["reward_post_process"]
    restarted = BatchBuilder(config, controller, hooks=refusing(hooks))
    assert restarted.begin(raw, samples, rollout_id=0) is None  # the same plan, still not ready
    refs = restarted.replay_converted(converted, batch_id)
    done = controller.batch(batch_id)
    assert done is not None and done["ready"] is True
    assert [r.rank for r in refs] == [0] and refs[0].batch_id == batch_id
    assert load_rank_batch(refs, 0)["rewards"] == [0.5] * 4


def test_replay_of_a_stored_conversion_and_of_an_unplanned_batch(
    make_config: MakeConfig, open_controller: OpenController, open_reader: OpenReader
) -> None:
    config = make_config(rollout_batch_size=1, n_samples_per_prompt=2)
    controller = open_controller(config)
    raw, samples = accepted_rollout(controller, open_reader(controller), 1)
    builder = BatchBuilder(config, controller)
    builder.begin(raw, samples, rollout_id=0)
    first = builder.split(builder.convert(samples))
    again = BatchBuilder(config, controller, hooks=refusing()).replay_converted(
        {"ignored": True}, first[0].batch_id
    )
    assert again == first  # ready already: split again from the stored conversion
    with pytest.raises(RuntimeError, match=r"^Retained conversion has no queue plan: batch:nope$"):
        builder.replay_converted(DiskPayloadRef(first[0].manifest, first[0].root), "batch:nope")


# --------------------------------------------------------------------------- scenario 29


SPLIT_DATA: dict[str, Any] = {
    "tokens": [[10, 11], [20, 21, 22]],
    "rollout_ids": [0, 1],
    "response_lengths": [1, 2],
    "loss_masks": [[1], [0, 1]],
    "rollout_top_p_token_ids": [[11], [21, 22]],
    "rollout_top_p_token_offsets": [[0, 1], [0, 1, 2]],
    "rollout_top_p_log_probs": [[-0.2], [-0.3, -0.4]],
    "raw_reward": [1.0, 2.0],
    "rewards": [-1.0, 1.0],
}


def swapped(total_lengths: list[int], rollout_ids: list[int], parallel: ParallelConfig, config: Any) -> Any:
    return ([[1], [0]], [[[0]], [[0]]], [1], [2])


def test_scenario_29_split_gives_each_rank_its_rows(
    make_config: MakeConfig, open_controller: OpenController, open_reader: OpenReader
) -> None:
    config = make_config(rollout_batch_size=1, n_samples_per_prompt=2)
    controller = open_controller(config)
    raw, samples = accepted_rollout(controller, open_reader(controller), 1)
    builder = BatchBuilder(
        config, controller, hooks=Hooks(schedule=swapped), parallel=ParallelConfig(dp_size=2)
    )
    builder.begin(raw, samples, rollout_id=0)
    data = {**SPLIT_DATA, "multimodal_train_inputs": [None, {"pixel_values": torch.ones(3, 20, 20)}]}
    refs = builder.split(data)
    assert controller.batch(refs[0].batch_id)["ready"] is True  # type: ignore[index]
    assert len({r.batch_id for r in refs}) == 1 and [r.rank for r in refs] == [0, 1]
    for ref in refs:
        assert isinstance(ref, TrainBatchRef) and len(pickle.dumps(ref)) < 2048
        assert pickle.loads(pickle.dumps(ref)) == ref
    rank0 = load_rank_batch(refs, 0)
    assert [t.tolist() for t in rank0["tokens"]] == [[20, 21, 22]]
    assert rank0["tokens"][0].dtype == torch.int64
    assert [m.tolist() for m in rank0["loss_masks"]] == [[0, 1]]
    assert rank0["total_lengths"] == [3]
    assert rank0["local_raw_reward"] == [2.0]
    assert rank0["raw_reward"] == [1.0, 2.0]  # every rank sees the whole batch's raw rewards
    # replay captures stay lazy references: a rank reads them when (and as far as) it needs them
    (offsets,) = rank0["rollout_top_p_token_offsets"]
    assert isinstance(offsets, TensorRef) and offsets.load().tolist() == [0, 1, 2]
    assert rank0["rollout_top_p_log_probs"][0].load().tolist() == pytest.approx([-0.3, -0.4])
    assert rank0["multimodal_train_inputs"][0]["pixel_values"].shape == (3, 20, 20)
    assert rank0["partition"] == [1] and rank0["micro_batch_indices"] == [[0]]
    assert rank0["num_microbatches"] == [1] and rank0["global_batch_sizes"] == [2]
    rank1 = load_rank_batch(refs, 1)
    assert [t.tolist() for t in rank1["tokens"]] == [[10, 11]] and rank1["multimodal_train_inputs"] == [None]
    other = TrainBatchRef(refs[1].manifest, refs[1].root, "batch:other", 1, refs[1].plan_digest)
    with pytest.raises(ValueError, match="inconsistent batch identities"):
        load_rank_batch([refs[0], other], 0)
    with pytest.raises(ValueError, match="rank must be in"):
        load_rank_batch(refs, 2)


def test_a_rank_reads_only_its_rows(
    make_config: MakeConfig,
    open_controller: OpenController,
    open_reader: OpenReader,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = make_config(rollout_batch_size=2, n_samples_per_prompt=2)
    controller = open_controller(config)
    raw, samples = accepted_rollout(controller, open_reader(controller), 2)
    builder = BatchBuilder(config, controller, parallel=ParallelConfig(dp_size=2))
    refs = builder.build(raw, samples, rollout_id=0)
    assert isinstance(refs, list) and [r.schedule["partition"] for r in refs] == [[0, 2], [1, 3]]  # type: ignore[index]
    seen: list[Any] = []
    original = DiskPayloadRef.load

    def spy(self: DiskPayloadRef, **kwargs: Any) -> Any:
        seen.append(kwargs.get("selection"))
        return original(self, **kwargs)

    monkeypatch.setattr(DiskPayloadRef, "load", spy)
    data = load_rank_batch(refs, 1)
    (selection,) = seen
    assert selection["tokens"] == [1, 3] and selection["raw_reward"] is None and "_plan" not in selection
    assert data["sample_indices"] == [samples[1].index, samples[3].index]
    assert "_plan" not in data and "_fields" not in data


def test_split_needs_a_plan_and_tokens(
    make_config: MakeConfig, open_controller: OpenController, open_reader: OpenReader
) -> None:
    config = make_config(rollout_batch_size=1)
    controller = open_controller(config)
    with pytest.raises(ValueError, match="call begin"):
        BatchBuilder(config, controller).split(SPLIT_DATA)
    raw, samples = accepted_rollout(controller, open_reader(controller), 1)
    builder = BatchBuilder(config, controller)
    builder.begin(raw, samples, rollout_id=0)
    with pytest.raises(ValueError, match="needs a 'tokens' list"):
        builder.split({"rewards": [1.0]})
    assert controller.batch(builder.batch_id)["ready"] is False  # type: ignore[arg-type, index]


# --------------------------------------------------------------------------- scenario 30


def test_scenario_30_begin_after_ready_returns_the_same_refs_and_writes_nothing(
    make_config: MakeConfig,
    open_controller: OpenController,
    open_reader: OpenReader,
    pool: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = make_config(rollout_batch_size=2, n_samples_per_prompt=2)
    controller = open_controller(config)
    raw, samples = accepted_rollout(controller, open_reader(controller), 2)
    refs = BatchBuilder(config, controller, parallel=ParallelConfig(dp_size=2)).build(
        raw, samples, rollout_id=0
    )
    before = {p: p.stat().st_size for p in packs(pool)}

    def never(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("converted again")

    monkeypatch.setattr(batch_module, "default_convert", never)
    monkeypatch.setattr(batch_module, "default_reward_post_process", never)
    again = BatchBuilder(config, controller, parallel=ParallelConfig(dp_size=2)).begin(
        raw, samples, rollout_id=0
    )
    assert again == refs
    assert {p: p.stat().st_size for p in packs(pool)} == before


# --------------------------------------------------------------------------- scenario 31


def test_scenario_31_positions_completion_and_the_training_view(
    make_config: MakeConfig, open_controller: OpenController
) -> None:
    config = make_config(rollout_batch_size=1, n_samples_per_prompt=2)
    controller = open_controller(config)
    plain = [[Sample(index=i, group_index=0, reward=float(i), status=SampleStatus.COMPLETED) for i in (0, 1)]]
    raw = accept_raw_rollout(plain, config=config, controller=controller, rollout_id=0)
    assert raw.receipt.position == 0 and raw.metrics is None
    builder = BatchBuilder(config, controller)
    refs = builder.build(raw, load_groups(raw), rollout_id=0)
    batch = controller.batch(refs[0].batch_id)
    assert batch is not None and batch["position"] == 1
    assert controller.metrics()["accepted_unprocessed"]["count"] == 1  # the conversion, until trained
    builder.training_completed(0)
    assert controller.metrics()["accepted_unprocessed"] == {"count": 0, "bytes": 0}
    assert controller.queue.checkpoints == {}
    second = accept_raw_rollout(plain, config=config, controller=controller, rollout_id=1)
    assert second.receipt.position == 2
    assert controller.queue.read_commits().cursor == 3
    builder.build(second, load_groups(second), rollout_id=1)
    assert controller.batch(builder.batch_id)["position"] == 3  # type: ignore[arg-type, index]
    with pytest.raises(ValueError, match="does not match the current batch"):
        builder.training_completed(5)


def test_online_gc_releases_trained_positions_above_a_group_left_for_later(
    make_config: MakeConfig, open_controller: OpenController, open_reader: OpenReader
) -> None:
    """An accepted group left for a later step holds the processed cursor back while later
    positions are trained and collected: the controller's own reads of the accepted log (its
    metrics, a checkpoint's payload) page around the released positions (`straw demo
    --online-gc` failed at its first checkpoint)."""
    config = make_config(
        rollout_batch_size=1, n_samples_per_prompt=2, rollout_queue_online_gc=True, gc_interval_seconds=3600.0
    )
    controller = open_controller(config)
    reader = open_reader(controller)
    left, trained = reader.get_samples(2)
    reader.publish_group(finish(left), rollout_id=0)  # position 0, not in this step's rollout
    ref = reader.publish_group(finish(trained), rollout_id=0)  # position 1
    raw = accept_raw_rollout([ref], config=config, controller=controller, rollout_id=0)  # 2
    builder = BatchBuilder(config, controller)
    builder.build(raw, load_groups(raw), rollout_id=0)  # the conversion: position 3
    builder.training_completed(0)  # 1, 2 and 3 processed; the online pass releases them
    with pytest.raises(InvalidReference, match="released by garbage collection"):
        controller.queue.read_commits(0, 4)
    assert controller.metrics()["accepted_unprocessed"]["count"] == 1
    assert [r.position for r in controller.unprocessed_receipts()] == [0]
    payload = DiskPayloadRef(controller.checkpoint_snapshot(1), str(config.rollout_data_dir)).load()
    assert payload["training"]["processed_cursor"] == 0
    assert payload["training"]["processed_positions"] == [1, 2, 3]
    accepted = [(e["stage"], e["position"]) for e in payload["unfinished"] if e["position"] is not None]
    assert accepted == [("ready", 0)]  # the group left for later; fresh prompts are listed too


def test_in_memory_conversion_without_a_raw_reference(make_config: MakeConfig) -> None:
    config = make_config(n_samples_per_prompt=2)
    plain = [
        Sample(index=i, group_index=0, reward=float(i), tokens=[1, 2], response_length=1) for i in (0, 1)
    ]
    builder = BatchBuilder(config)
    data = builder.build(None, plain, rollout_id=4)
    assert isinstance(data, dict) and data["rewards"] == pytest.approx(
        [-1 / (2**0.5 + 1e-6), 1 / (2**0.5 + 1e-6)]
    )
    assert builder.rollout_id == 4 and builder.batch_id is None
    builder.training_completed(4)  # nothing to finish without a controller
    with pytest.raises(ValueError, match="needs the job's controller"):
        BatchBuilder(config).begin(
            RawRolloutRef(RecordSetRef.from_dict(_fake_manifest()), "/p", receipt=_fake_receipt()),
            plain,
            rollout_id=0,
        )


def _fake_manifest() -> dict[str, Any]:
    segment = {"run_id": "rollout", "path": "raw/w/0.pack", "segment_id": "s", "size": 1, "checksum": "x"}
    return {
        "manifest": {"segment": segment, "ordinal": 0},
        "digest": "d",
        "records": 1,
        "payload_bytes": 1,
        "tokens": 0,
    }


def _fake_receipt() -> Any:
    from straw.protocol import CommitReceipt

    return CommitReceipt("c", "t", "s", "d", 0, RecordSetRef.from_dict(_fake_manifest()))


# --------------------------------------------------------------------------- scenario 32


def test_scenario_32_a_changed_plan_is_refused_unless_replaying(
    make_config: MakeConfig, open_controller: OpenController, open_reader: OpenReader
) -> None:
    config = make_config(rollout_batch_size=2, n_samples_per_prompt=2, global_batch_size=2)
    controller = open_controller(config)
    raw, samples = accepted_rollout(controller, open_reader(controller), 2)
    first = BatchBuilder(config, controller)
    first.begin(raw, samples, rollout_id=0)
    wider = make_config(rollout_batch_size=2, n_samples_per_prompt=2, global_batch_size=4)
    with pytest.raises(
        ValueError,
        match="An existing batch ID cannot be reused with a different selection or conversion plan",
    ):
        BatchBuilder(wider, controller).begin(raw, samples, rollout_id=0)
    with pytest.raises(ValueError, match="different selection or conversion plan"):
        BatchBuilder(config, controller, parallel=ParallelConfig(dp_size=2)).begin(raw, samples, rollout_id=0)
    replay = BatchBuilder(config, controller, parallel=ParallelConfig(dp_size=2))
    assert replay.begin(raw, samples, rollout_id=0, replay=True) is None
    assert replay.plan_digest == first.plan_digest  # the retained plan
    refs = replay.split(replay.convert(samples))
    assert [r.schedule["partition"] for r in refs] == [[0, 2], [1, 3]]  # type: ignore[index]
    assert refs[0].schedule["global_batch_sizes"] == [2, 2]  # type: ignore[index]


# --------------------------------------------------------------------------- scenario 33


def test_scenario_33_grpo_rewards_through_the_builder(
    make_config: MakeConfig, open_controller: OpenController, open_reader: OpenReader
) -> None:
    config = make_config(rollout_batch_size=1, n_samples_per_prompt=2, grpo_std_normalization=False)
    controller = open_controller(config)
    reader = open_reader(controller)
    (group,) = reader.get_samples(1)
    finish(group)
    group[0].reward, group[1].reward = 1.0, 0.0
    raw = accept_raw_rollout(
        [reader.publish_group(group, rollout_id=0)], config=config, controller=controller, rollout_id=0
    )
    samples = [s for g in load_groups(raw) for s in iter_samples(g)]
    assert BatchBuilder(config, controller).convert(samples)["rewards"] == [0.5, -0.5]
    scaled = BatchBuilder(make_config(rollout_batch_size=1, n_samples_per_prompt=2), controller).convert(
        samples
    )
    std = torch.tensor([1.0, 0.0]).std().item()
    assert scaled["rewards"] == pytest.approx([0.5 / (std + 1e-6), -0.5 / (std + 1e-6)])
    samples[1].group_index = None
    with pytest.raises(ValueError, match="group_index on every sample or on none of them"):
        BatchBuilder(config, controller).convert(samples)


# --------------------------------------------------------------------------- checkpoints


def test_save_and_load_the_builder_state(
    make_config: MakeConfig, open_controller: OpenController, open_reader: OpenReader, tmp_path: Path
) -> None:
    save = tmp_path / "job"
    config = make_config(rollout_batch_size=1, n_samples_per_prompt=2, save=str(save), save_interval=1)
    controller = open_controller(config)
    builder = BatchBuilder(config, controller)
    raw, samples = accepted_rollout(controller, open_reader(controller), 1)
    builder.build(raw, samples, rollout_id=0)
    builder.training_completed(0)
    path = builder.save(0)
    assert path == save.absolute() / "rollout" / "builder_state_0.json"
    state = json.loads(path.read_bytes())
    training = controller.training_state()
    assert training is not None
    assert state["version"] == 1 and state["step"] == 0 and state["rollout_id"] == 0
    assert state["run_id"] == config.run_id and state["queue_id"] == controller.identity()["queue_id"]
    assert state["consumer"] == {
        "state_ref": training["state_ref"],
        "progress_ref": training["progress_ref"],
        "fetch_cursor": training["fetch_cursor"],
        "processed_cursor": training["processed_cursor"],
    }
    owner = state["storage_owner"]
    assert owner.startswith(f"checkpoint:{path}:")
    from straw.rollout.pool import rollout_store

    assert rollout_store(config).store.owners(f"checkpoint:{path}:") == [owner]
    loader = BatchBuilder(
        make_config(rollout_batch_size=1, n_samples_per_prompt=2, load=str(save)), controller
    )
    assert loader.load(7) is None and loader.rollout_id == -1  # no such file: nothing
    assert loader.load(0) == state and loader.rollout_id == 0
    assert BatchBuilder(config, controller).load(0) is None  # nothing without --load
    other_run = make_config(
        rollout_batch_size=1, n_samples_per_prompt=2, load=str(save), rollout_queue_run_id="other"
    )
    with pytest.raises(ValueError, match=r"^BatchBuilder checkpoint run/schema differs$"):
        BatchBuilder(other_run, controller).load(0)
    marker = save / "rollout" / "committed_0.json"
    by_marker = make_config(rollout_batch_size=1, n_samples_per_prompt=2, load=str(marker))
    assert BatchBuilder(by_marker, controller).load(0) == state


def test_save_without_a_training_view_writes_nothing(
    make_config: MakeConfig, open_controller: OpenController, tmp_path: Path
) -> None:
    config = make_config(save=str(tmp_path / "job"), save_interval=1)
    controller = open_controller(config)
    assert controller.training_state() is None  # a new job has saved no training view yet
    assert BatchBuilder(config, controller).save(3) is None
    assert not (tmp_path / "job" / "rollout" / "builder_state_3.json").exists()
    assert BatchBuilder(config).save(3) is None  # no controller: nothing either
