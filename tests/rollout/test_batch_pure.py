"""straw.rollout.batch, its pure parts: the default schedule, reward normalisation, conversion, plan identity.

Nothing here touches a pool: these are functions of their inputs (the plan identity of a
builder is computed from a reference value and the configuration only).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

from straw.protocol import CommitReceipt, RecordRef, RecordSetRef, SegmentRef, digest
from straw.rollout.batch import (
    BatchBuilder,
    DpSchedule,
    ParallelConfig,
    default_convert,
    default_reward_post_process,
    default_schedule,
    tensorize,
)
from straw.rollout.config import RolloutConfig
from straw.rollout.hooks import Hooks
from straw.rollout.refs import RawRolloutRef
from straw.rollout.sample import Sample, SampleStatus

MakeConfig = Callable[..., RolloutConfig]


def rows(n: int) -> list[int]:
    return [4] * n


# --------------------------------------------------------------------------- default_schedule


def test_default_schedule_deals_rows_round_robin_in_micro_batches(make_config: MakeConfig) -> None:
    config = make_config(
        rollout_batch_size=4, n_samples_per_prompt=2, global_batch_size=4, micro_batch_size=1
    )
    schedule = default_schedule(rows(8), list(range(8)), ParallelConfig(dp_size=2), config)
    assert schedule.partitions == [[0, 2, 4, 6], [1, 3, 5, 7]]
    # two optimizer steps of 4 rows: 2 rows per rank per step, micro-batches of one row
    assert schedule.global_batch_sizes == [4, 4]
    assert schedule.num_microbatches == [2, 2]
    assert schedule.micro_batch_indices == [[[0], [1], [2], [3]], [[0], [1], [2], [3]]]


def test_default_schedule_micro_batches_stay_inside_their_step(make_config: MakeConfig) -> None:
    config = make_config(
        rollout_batch_size=3, n_samples_per_prompt=4, global_batch_size=6, micro_batch_size=2
    )
    schedule = default_schedule(rows(12), list(range(12)), ParallelConfig(dp_size=2), config)
    assert schedule.partitions[1] == [1, 3, 5, 7, 9, 11]
    # 3 rows per rank per step: micro-batches [0, 1], [2] then [3, 4], [5]
    assert schedule.num_microbatches == [2, 2]
    assert schedule.micro_batch_indices[0] == [[0, 1], [2], [3, 4], [5]]


def test_default_schedule_defaults_to_one_step_of_the_whole_batch(make_config: MakeConfig) -> None:
    schedule = default_schedule(rows(3), [0, 1, 2], ParallelConfig(), make_config())
    assert schedule.partitions == [[0, 1, 2]]
    assert schedule.global_batch_sizes == [3]
    assert schedule.micro_batch_indices == [[[0], [1], [2]]]
    schedule = default_schedule(rows(6), list(range(6)), ParallelConfig(), make_config(rollout_batch_size=1))
    assert schedule.global_batch_sizes == [1] * 6


def test_default_schedule_keeps_a_short_last_step_when_it_splits_evenly(make_config: MakeConfig) -> None:
    config = make_config(rollout_batch_size=2, n_samples_per_prompt=4, global_batch_size=4)
    schedule = default_schedule(rows(6), list(range(6)), ParallelConfig(dp_size=2), config)
    assert schedule.global_batch_sizes == [4, 2]
    assert schedule.num_microbatches == [2, 1]
    schedule.check(6, ParallelConfig(dp_size=2))


def test_default_schedule_refusals(make_config: MakeConfig) -> None:
    config = make_config(rollout_batch_size=3, n_samples_per_prompt=1, global_batch_size=3)
    with pytest.raises(ValueError, match="must be a multiple of dp_size 2"):
        default_schedule(rows(3), [0, 1, 2], ParallelConfig(dp_size=2), config)
    config = make_config(rollout_batch_size=2, n_samples_per_prompt=2, global_batch_size=2)
    with pytest.raises(ValueError, match="last optimizer step has 1 rows"):
        default_schedule(rows(5), list(range(5)), ParallelConfig(dp_size=2), config)
    with pytest.raises(ValueError, match="empty training batch"):
        default_schedule([], [], ParallelConfig(), make_config())
    vpp = ParallelConfig(vpp_size=2, microbatch_group_size_per_vp_stage=2)
    with pytest.raises(ValueError, match="multiples of microbatch_group_size_per_vp_stage 2"):
        default_schedule(rows(3), [0, 1, 2], vpp, make_config())
    assert default_schedule(rows(4), list(range(4)), vpp, make_config()).num_microbatches == [4]


def test_parallel_config_and_schedule_checks() -> None:
    with pytest.raises(ValueError, match="dp_size must be a positive integer"):
        ParallelConfig(dp_size=0)
    with pytest.raises(ValueError, match="cp_size must be a positive integer"):
        ParallelConfig(cp_size=True)  # type: ignore[arg-type]
    two = ParallelConfig(dp_size=2)
    good = DpSchedule.coerce(([[1], [0]], [[[0]], [[0]]], [1], [2]), 2, two)
    assert good == DpSchedule([[1], [0]], [[[0]], [[0]]], [1], [2])
    for bad, match in [
        (([[0, 1]], [[[0]]], [1], [2]), "one partition and one micro-batch list per DP rank"),
        (([[0], [0]], [[[0]], [[0]]], [1], [2]), "each of the 2 rows on exactly one rank"),
        (([[0], [1]], [[[0]], [[0]]], [1, 1], [2]), "one micro-batch count per global batch size"),
        (([[0], [1]], [[[0]], [[0]]], [1], [3]), "do not add up to 2 rows"),
        (([[0], [1]], [[[0]], [[0], [0]]], [1], [2]), "Rank 1 has 2 micro-batches"),
        (([[0], [1]], [[[0]], [[1]]], [1], [2]), "Rank 1 has a micro-batch index outside its partition"),
    ]:
        with pytest.raises(ValueError, match=match):
            DpSchedule.coerce(bad, 2, two)
    with pytest.raises(TypeError, match="A schedule answers a DpSchedule"):
        DpSchedule.coerce("nope", 2, two)


# --------------------------------------------------------------------------- rewards


def grouped(rewards: list[Any], group_of: list[Any], **fields: Any) -> list[Sample]:
    return [
        Sample(index=i, group_index=g, reward=r, **{k: v[i] for k, v in fields.items()})
        for i, (r, g) in enumerate(zip(rewards, group_of, strict=True))
    ]


def test_grpo_centres_and_scales_each_group(make_config: MakeConfig) -> None:
    samples = grouped([1.0, 0.0, 3.0, 3.0], [0, 0, 1, 1])
    raw, rewards = default_reward_post_process(samples, make_config(grpo_std_normalization=False))
    assert raw == [1.0, 0.0, 3.0, 3.0]
    assert rewards == [0.5, -0.5, 0.0, 0.0]
    raw, rewards = default_reward_post_process(samples, make_config())
    std = torch.tensor([1.0, 0.0]).std().item()  # torch's default: the unbiased estimate
    assert std == pytest.approx(0.7071, abs=1e-4)
    assert rewards[:2] == pytest.approx([0.5 / (std + 1e-6), -0.5 / (std + 1e-6)])
    assert rewards[2:] == [0.0, 0.0]  # equal rewards: std 0, the epsilon keeps the division finite


def test_normalisation_follows_the_estimator(make_config: MakeConfig) -> None:
    samples = grouped([2.0, 0.0], [7, 7])
    for estimator in ("gspo", "cispo"):
        _, rewards = default_reward_post_process(samples, make_config(advantage_estimator=estimator))
        assert rewards[0] == pytest.approx(1.0 / (math.sqrt(2.0) + 1e-6))
    _, rewards = default_reward_post_process(
        samples, make_config(advantage_estimator="reinforce_plus_plus_baseline")
    )
    assert rewards == [1.0, -1.0]  # mean only, never divided
    _, rewards = default_reward_post_process(samples, make_config(advantage_estimator="ppo"))
    assert rewards == [2.0, 0.0]
    _, rewards = default_reward_post_process(samples, make_config(rewards_normalization=False))
    assert rewards == [2.0, 0.0]


def test_a_group_of_one_has_standard_deviation_zero(make_config: MakeConfig) -> None:
    _, rewards = default_reward_post_process(grouped([5.0], [0]), make_config())
    assert rewards == [0.0]


def test_rows_of_one_episode_count_once(make_config: MakeConfig) -> None:
    # Episode 10 has three rows (a compact trajectory) of reward 1; episode 11 one row of 0.
    samples = grouped([1.0, 1.0, 1.0, 0.0], [0, 0, 0, 0], rollout_id=[10, 10, 10, 11])
    _, rewards = default_reward_post_process(samples, make_config(grpo_std_normalization=False))
    assert rewards == [0.5, 0.5, 0.5, -0.5]  # mean over episodes (1 + 0) / 2, not over rows
    bad = grouped([1.0, 0.5], [3, 3], rollout_id=[4, 4])
    with pytest.raises(ValueError, match=r"^Inconsistent rewards for group_index=3$"):
        default_reward_post_process(bad, make_config())


def test_group_index_on_all_or_none(make_config: MakeConfig) -> None:
    samples = grouped([1.0, 0.0], [0, None])
    with pytest.raises(
        ValueError, match=r"^Reward normalization requires group_index on every sample or on none of them$"
    ):
        default_reward_post_process(samples, make_config())
    plain = [Sample(index=i, reward=r) for i, r in enumerate([1.0, 0.0, 4.0, 2.0])]
    _, rewards = default_reward_post_process(
        plain, make_config(n_samples_per_prompt=2, grpo_std_normalization=False)
    )
    assert rewards == [0.5, -0.5, 1.0, -1.0]  # fixed groups of n_samples_per_prompt
    with pytest.raises(
        ValueError, match=r"^Reward normalization requires group_index for uneven groups or split rollouts$"
    ):
        default_reward_post_process(plain[:3], make_config(n_samples_per_prompt=2))


def test_rewards_are_picked_by_reward_key(make_config: MakeConfig) -> None:
    samples = [Sample(index=0, group_index=0, reward={"acc": 1.0, "len": 9.0})]
    raw, _ = default_reward_post_process(samples, make_config(reward_key="acc"))
    assert raw == [1.0]
    with pytest.raises(KeyError, match="set --reward-key"):
        default_reward_post_process(samples, make_config())
    with pytest.raises(ValueError, match="Sample 3 has no reward"):
        default_reward_post_process([Sample(index=3, group_index=0)], make_config())


# --------------------------------------------------------------------------- conversion


def finished(index: int, response: int = 2, **fields: Any) -> Sample:
    fields.setdefault("reward", float(index))
    fields.setdefault("status", SampleStatus.COMPLETED)
    return Sample(
        index=index,
        group_index=index // 2,
        tokens=list(range(3 + response)),
        response_length=response,
        **fields,
    )


def test_default_convert_fields(make_config: MakeConfig) -> None:
    config = make_config(n_samples_per_prompt=2, rewards_normalization=False)
    samples = [
        finished(0, rollout_id=7),
        finished(1, status=SampleStatus.TRUNCATED, loss_mask=[1, 0]),
        finished(2, remove_sample=True, metadata={"raw_reward": -3.0}),
        finished(3, response=1, train_metadata={"k": 1}),
    ]
    data = default_convert(samples, config)
    assert data["tokens"][3] == [0, 1, 2, 3]
    assert data["response_lengths"] == [2, 2, 2, 1]
    assert data["rewards"] == [0.0, 1.0, 2.0, 3.0]
    assert data["raw_reward"] == [0.0, 1.0, -3.0, 3.0]
    assert data["truncated"] == [0, 1, 0, 0]
    assert data["sample_indices"] == [0, 1, 2, 3]
    assert data["rollout_ids"] == [7, 0, 1, 2]  # missing ids: the smallest unused integers
    assert data["loss_masks"] == [[1, 1], [1, 0], [0, 0], [1]]
    assert data["rollout_mask_sums"] == [2, 1, 0, 1]
    assert data["train_metadata"] == [None, None, None, {"k": 1}]
    assert "rollout_log_probs" not in data and "multimodal_train_inputs" not in data
    assert "rollout_routed_experts" not in data


def test_default_convert_episode_mask_sums_and_log_probs(make_config: MakeConfig) -> None:
    config = make_config(n_samples_per_prompt=2)
    samples = [finished(0, rollout_id=5, reward=1.0, rollout_log_probs=[-0.1, -0.2])]
    samples.append(finished(1, rollout_id=5, reward=1.0, response=1, rollout_log_probs=[-0.3]))
    data = default_convert(samples, config)
    assert data["rollout_mask_sums"] == [3, 3]
    assert data["rollout_log_probs"] == [[-0.1, -0.2], [-0.3]]
    samples[1].rollout_log_probs = None
    with pytest.raises(ValueError, match="rollout_log_probs must be set on every sample or on none"):
        default_convert(samples, config)


def test_default_convert_refusals(make_config: MakeConfig) -> None:
    config = make_config(n_samples_per_prompt=1)
    with pytest.raises(
        ValueError, match="Sample 0 has a loss mask of 1 entries; expected response_length = 2"
    ):
        default_convert([finished(0, loss_mask=[1])], config)
    with pytest.raises(ValueError, match="empty rollout"):
        default_convert([], config)

    def short(samples: list[Sample], config: RolloutConfig) -> tuple[list[float], list[float]]:
        return [1.0], []

    with pytest.raises(ValueError, match="returned 1 raw rewards and 0 rewards for 1 samples"):
        default_convert([finished(0)], config, reward_post_process=short)


def test_score_centering_needs_log_probs_and_captures(make_config: MakeConfig) -> None:
    config = make_config(use_score_centering=True, score_centering_top_k=2)
    sample = finished(0, rollout_topk_token_ids=[[1, 2], [3, 4]], rollout_topk_log_probs=[[0.0, -1.0]] * 2)
    with pytest.raises(
        ValueError, match=r"^Score centering requires sampler logprobs for every response token\.$"
    ):
        default_convert([sample], config)
    sample.rollout_log_probs = [-0.5, -0.6]
    data = default_convert([sample], config)
    assert data["rollout_topk_token_ids"] == [[[1, 2], [3, 4]]]
    sample.rollout_topk_log_probs = None
    with pytest.raises(ValueError, match="rollout_topk_log_probs is missing"):
        default_convert([sample], config)
    top_p = make_config(use_score_centering=True, rollout_top_p=0.9)
    sample = finished(
        0,
        rollout_log_probs=[-0.5, -0.6],
        rollout_top_p_token_ids=[1, 2, 3],
        rollout_top_p_token_offsets=[0, 1, 3],
        rollout_top_p_log_probs=[-0.1, -0.2, -0.3],
    )
    data = default_convert([sample], top_p)
    assert data["rollout_top_p_token_offsets"] == [[0, 1, 3]]
    assert "rollout_topk_token_ids" not in data
    plain_top_p = default_convert([sample], make_config(rollout_top_p=0.9))
    assert plain_top_p["rollout_top_p_token_ids"] == [[1, 2, 3]]


def test_routing_replay_routes_and_zero_routes(make_config: MakeConfig) -> None:
    routes = torch.ones((4, 2, 3), dtype=torch.int32)
    live = finished(0, rollout_routed_experts=routes)
    masked = finished(1, loss_mask=[0, 0])
    config = make_config(
        use_rollout_routing_replay=True,
        num_layers=2,
        moe_router_topk=3,
        num_experts=64,
    )
    data = default_convert([live, masked], config)
    assert data["rollout_routed_experts"][0] is routes
    zeros = data["rollout_routed_experts"][1]
    assert zeros.shape == (4, 2, 3) and zeros.dtype == torch.uint8 and not zeros.any()
    wide = make_config(use_rollout_routing_replay=True, num_layers=2, moe_router_topk=3, num_experts=512)
    assert default_convert([masked], wide)["rollout_routed_experts"][0].dtype == torch.int32
    with pytest.raises(
        ValueError, match=r"^Rollout routed experts are missing for live sample indices \[0, 2\]$"
    ):
        default_convert([finished(0), finished(2), masked], config)
    with pytest.raises(ValueError, match="need positive num_layers, num_experts and moe_router_topk"):
        default_convert([masked], make_config(use_rollout_routing_replay=True))


def test_tensorize_fixes_the_dtypes_and_keeps_references(make_config: MakeConfig) -> None:
    data = default_convert(
        [finished(0, rollout_log_probs=[-0.1, -0.2]), finished(1, rollout_log_probs=[0.0, 0.0])],
        make_config(n_samples_per_prompt=2),
    )
    out = tensorize(data)
    assert out["tokens"][0].dtype == torch.int64 and out["tokens"][0].tolist() == [0, 1, 2, 3, 4]
    assert out["loss_masks"][1].dtype == torch.int32
    assert out["rollout_log_probs"][0].dtype == torch.float32
    assert out["rewards"] == data["rewards"]  # scalars stay plain lists
    assert data["tokens"][0] == [0, 1, 2, 3, 4]  # the input is not changed


_FIELD_DTYPES = {"tokens": torch.int64, "loss_masks": torch.int32, "rollout_log_probs": torch.float32}


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ([3, 1, 4, 1, 5], "tokens"),
        ([True, False, 7], "loss_masks"),
        ([], "tokens"),
        ([], "rollout_log_probs"),
        ([-0.5, 1, True, 1e-45, 3.4028235e38, 0.1], "rollout_log_probs"),
        ([1e40, -1e40], "rollout_log_probs"),  # overflows to infinities, as torch.tensor does
        ([2**62, -(2**63)], "tokens"),
        ([[1, 2], [3, 4]], "tokens"),  # nested: torch.tensor itself
        ([1.7, -1.7], "tokens"),  # floats into ints: torch.tensor itself
    ],
)
def test_tensorize_gives_what_torch_tensor_gives(values: list[Any], field: str) -> None:
    (got,) = tensorize({field: [values]})[field]
    expected = torch.tensor(values, dtype=_FIELD_DTYPES[field])
    assert got.dtype == expected.dtype and got.shape == expected.shape
    assert torch.equal(got, expected)


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ([2**31], "loss_masks"),  # out of int32's range
        ([2**63], "tokens"),  # out of int64's range
        (["1", 2], "tokens"),  # NumPy would parse the string; torch refuses it
        ([None, 1.0], "rollout_log_probs"),  # NumPy would make a NaN; torch refuses it
    ],
)
def test_tensorize_refuses_what_torch_tensor_refuses(values: list[Any], field: str) -> None:
    with pytest.raises(Exception) as expected:
        torch.tensor(values, dtype=_FIELD_DTYPES[field])
    with pytest.raises(type(expected.value)) as got:
        tensorize({field: [values]})
    assert str(got.value) == str(expected.value)


# --------------------------------------------------------------------------- the plan identity


def raw_ref(digest_text: str = "d" * 64, commit: str = "c1") -> RawRolloutRef:
    segment = SegmentRef("rollout", "raw/w/0.pack", "s", 10, "x")
    manifest = RecordSetRef(RecordRef(segment, 0), digest_text, 1, 10, 0)
    receipt = CommitReceipt(commit, "collection:i:0", "collection:a", digest_text, 0, manifest)
    return RawRolloutRef(manifest, "/pool", receipt=receipt)


def custom_reward(samples: list[Sample], config: RolloutConfig) -> tuple[list[float], list[float]]:
    return [0.0] * len(samples), [0.0] * len(samples)


def test_plan_identity_names_selection_configuration_and_layout(make_config: MakeConfig) -> None:
    config = make_config(rollout_batch_size=2, n_samples_per_prompt=2, global_batch_size=2)
    samples = [finished(i, rollout_id=i) for i in range(4)]
    builder = BatchBuilder(config)
    identity = builder.plan_identity(raw_ref(), samples)
    assert set(identity) == {
        "version",
        "raw_digest",
        "sample_indices",
        "rollout_ids",
        "configuration",
        "parallel",
    }
    assert "rng" not in str(sorted(identity)) and "rng" not in identity["configuration"]
    assert identity["sample_indices"] == [0, 1, 2, 3] and identity["raw_digest"] == "d" * 64
    assert identity["parallel"] == {
        "dp_size": 1,
        "cp_size": 1,
        "vpp_size": 1,
        "microbatch_group_size_per_vp_stage": 1,
    }
    base = digest(identity)
    assert digest(BatchBuilder(config).plan_identity(raw_ref(), samples)) == base  # deterministic

    def changed(builder: BatchBuilder, **ref: Any) -> str:
        return digest(builder.plan_identity(raw_ref(**ref), samples))

    other_gbs = make_config(rollout_batch_size=2, n_samples_per_prompt=2, global_batch_size=4)
    assert changed(BatchBuilder(other_gbs)) != base
    assert changed(BatchBuilder(config, parallel=ParallelConfig(dp_size=2))) != base
    assert changed(BatchBuilder(config, hooks=Hooks(reward_post_process=custom_reward))) != base
    assert changed(builder, digest_text="e" * 64) != base
    assert changed(builder, commit="c2") == base  # the batch id names the commit, the plan does not
    assert digest(builder.plan_identity(raw_ref(), samples[:3])) != base
    hooked = BatchBuilder(config, hooks=Hooks(reward_post_process=custom_reward)).configuration()
    assert hooked["hooks"]["reward_post_process"] == f"{__name__}:custom_reward"
