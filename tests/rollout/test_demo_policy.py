"""The demo's task, MoE policy, sampling and GRPO step (straw.rollout.demo; torch on the CPU)."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from straw.rollout.demo import task  # noqa: E402
from straw.rollout.demo.grpo import GrpoConfig, GrpoTrainer, group_advantages  # noqa: E402
from straw.rollout.demo.policy import (  # noqa: E402
    Decoding,
    DemoPolicy,
    PolicyConfig,
    export_weights,
    import_weights,
)
from straw.rollout.demo.train import LoopConfig, run_plain_loop  # noqa: E402

PROMPT = task.encode_prompt("3 1 0")


# ---------------------------------------------------------------- task


def test_prompt_encoding_and_reward_rule() -> None:
    assert PROMPT == [task.BOS, 3, 1, 0, task.SEP]
    assert task.target_tokens("3 1 0") == [3, 1, 0, task.EOS]
    assert task.reward([3, 1, 0, task.EOS], "3 1 0") == 1.0
    assert task.reward([3, 2, 0, task.EOS], "3 1 0") == 0.75
    assert task.reward([3], "3 1 0") == 0.25
    assert task.reward([], "3 1 0") == 0.0
    assert task.decode([3, 1, task.EOS, task.SEP, 0]) == "3 1 0"


@pytest.mark.parametrize("text", ["", "3 x", "12 3", "３"])
def test_bad_prompt_text_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="digits separated by spaces"):
        task.encode_prompt(text)


def test_dataset_jsonl_is_deterministic_and_in_the_alphabet(tmp_path) -> None:
    small = task.CopyTask(size=20, digits=3, alphabet=4, seed=5)
    first = small.write_jsonl(tmp_path / "a" / "prompts.jsonl").read_bytes()
    second = small.write_jsonl(tmp_path / "b.jsonl").read_bytes()
    assert first == second
    rows = [json.loads(line) for line in first.decode().splitlines()]
    assert len(rows) == 20
    assert all(row["input"] == row["label"] and len(row["input"].split()) == 3 for row in rows)
    assert {int(d) for row in rows for d in row["input"].split()} <= {0, 1, 2, 3}
    assert task.CopyTask(size=20, seed=6).write_jsonl(tmp_path / "c.jsonl").read_bytes() != first
    with pytest.raises(ValueError, match="alphabet"):
        task.CopyTask(alphabet=11)


# ---------------------------------------------------------------- generation


def test_generation_is_deterministic_under_a_seed() -> None:
    policy = DemoPolicy(seed=1)
    a = policy.generate([PROMPT, PROMPT], max_new_tokens=4, seeds=[7, 8])
    b = policy.generate([PROMPT, PROMPT], max_new_tokens=4, seeds=[7, 8])
    assert [g.tokens for g in a] == [g.tokens for g in b]
    assert [g.log_probs for g in a] == [g.log_probs for g in b]
    assert all(torch.equal(x.routes, y.routes) for x, y in zip(a, b, strict=True))
    many = policy.generate([PROMPT] * 16, max_new_tokens=4, seeds=list(range(16)))
    assert len({tuple(g.tokens) for g in many}) > 1, "different seeds should explore different responses"


def test_route_shapes_follow_the_forwarded_tokens() -> None:
    config = PolicyConfig()
    policy = DemoPolicy(config, seed=2)
    for g in policy.generate([PROMPT] * 8, max_new_tokens=4, seeds=list(range(8))):
        total = len(PROMPT) + len(g.tokens)
        assert g.routes.shape == (total - 1, config.num_layers, config.top_k)
        assert g.routes.dtype == torch.int32
        assert int(g.routes.min()) >= 0 and int(g.routes.max()) < config.num_experts
        # top-k picks distinct experts per token and layer
        assert all(len(set(row.tolist())) == config.top_k for row in g.routes.reshape(-1, config.top_k))
        assert len(g.log_probs) == len(g.tokens) and all(lp <= 0 for lp in g.log_probs)
        assert g.finish in {"stop", "length"}


def test_continuation_equals_uninterrupted_generation() -> None:
    policy = DemoPolicy(seed=3)
    seeds = list(range(12))
    whole = policy.generate([PROMPT] * 12, max_new_tokens=4, seeds=seeds)
    checked = 0
    for seed, full in zip(seeds, whole, strict=True):
        for cut in range(1, len(full.tokens)):
            partial = PROMPT + full.tokens[:cut]
            (rest,) = policy.generate(
                [partial], max_new_tokens=4 - cut, seeds=[seed], routes_start=len(partial) - 1
            )
            assert rest.tokens == full.tokens[cut:]
            assert rest.log_probs == pytest.approx(full.log_probs[cut:], abs=1e-5)
            kept = full.routes[: len(partial) - 1]
            assert torch.equal(torch.cat([kept, rest.routes]), full.routes)
            assert rest.finish == full.finish
            checked += 1
    assert checked > 0


def test_other_weights_change_the_continuation_but_not_its_shape() -> None:
    full = DemoPolicy(seed=3).generate([PROMPT] * 8, max_new_tokens=4, seeds=list(range(8)))
    other = DemoPolicy(seed=4)
    partial = [PROMPT + g.tokens[:1] for g in full]
    rest = other.generate(partial, max_new_tokens=3, seeds=list(range(8)), routes_start=len(PROMPT))
    assert [r.tokens for r in rest] != [g.tokens[1:] for g in full]
    for p, r in zip(partial, rest, strict=True):
        assert r.routes.shape[0] == len(p) + len(r.tokens) - 1 - len(PROMPT)


def test_decoding_steps_and_aborts_keeping_the_partial() -> None:
    policy = DemoPolicy(seed=5)
    (full,) = policy.generate([PROMPT], max_new_tokens=4, seeds=[9], stop_tokens=())
    decoding = Decoding(policy, PROMPT, max_new_tokens=4, seed=9, stop_tokens=())
    decoding.step()
    decoding.step()
    decoding.abort()
    decoding.step()  # no-op once aborted
    result = decoding.result()
    assert result.finish == "abort"
    assert result.tokens == full.tokens[:2]
    assert result.log_probs == pytest.approx(full.log_probs[:2], abs=1e-6)
    assert torch.equal(result.routes, full.routes[: len(PROMPT) + 1])


def test_budget_zero_and_position_limit() -> None:
    policy = DemoPolicy(PolicyConfig(max_positions=7), seed=0)
    (none,) = policy.generate([PROMPT], max_new_tokens=0)
    assert none.tokens == [] and none.routes.shape[0] == 0
    (capped,) = policy.generate([PROMPT], max_new_tokens=10, seeds=[1], stop_tokens=())
    assert len(PROMPT) + len(capped.tokens) == 7 and capped.finish == "length"


@pytest.mark.parametrize(
    ("prefix", "kwargs", "message"),
    [
        ([], {}, "at least one prompt token"),
        ([99], {}, "token ids must be in"),
        ([1] * 17, {}, "exceeds max_positions"),
        (PROMPT, {"max_new_tokens": -1}, "max_new_tokens must be >= 0"),
        (PROMPT, {"routes_start": 6}, "routes_start must be in"),
        (PROMPT, {"temperature": float("nan")}, "temperature"),
    ],
)
def test_bad_generation_requests(prefix: list[int], kwargs: dict, message: str) -> None:
    options = {"max_new_tokens": 4, **kwargs}
    with pytest.raises(ValueError, match=message):
        Decoding(DemoPolicy(seed=0), prefix, **options)


def test_greedy_decoding_ignores_the_seed() -> None:
    policy = DemoPolicy(seed=6)
    a = policy.generate([PROMPT], max_new_tokens=4, temperature=0.0, seeds=[1])
    b = policy.generate([PROMPT], max_new_tokens=4, temperature=0.0, seeds=[2])
    assert a[0].tokens == b[0].tokens


# ---------------------------------------------------------------- routing replay and weights


def test_training_log_probs_match_the_rollout_under_routing_replay() -> None:
    policy = DemoPolicy(seed=7)
    (g,) = policy.generate([PROMPT], max_new_tokens=4, seeds=[3], stop_tokens=())
    sequence = torch.tensor([PROMPT + g.tokens])
    replayed, used = policy.token_log_probs(sequence, g.routes.unsqueeze(0))
    assert torch.equal(used[0], g.routes.long())
    assert replayed[0, -len(g.tokens) :].tolist() == pytest.approx(g.log_probs, abs=1e-5)


def test_replay_forces_the_given_experts() -> None:
    policy = DemoPolicy(seed=8)
    tokens = torch.tensor([PROMPT])
    _, natural = policy(tokens)
    forced = (natural + 1) % policy.config.num_experts  # a different, still distinct, choice
    logits_forced, used = policy(tokens, forced)
    logits_natural, _ = policy(tokens, natural)
    assert torch.equal(used, forced)
    assert not torch.allclose(logits_forced, logits_natural)


def test_weights_export_and_import_roundtrip() -> None:
    source, target = DemoPolicy(seed=10), DemoPolicy(seed=11)
    weights = export_weights(source)
    assert all(isinstance(v, torch.Tensor) and v.is_contiguous() for v in weights.values())
    before = target.generate([PROMPT] * 4, max_new_tokens=4, seeds=[1, 2, 3, 4])
    import_weights(target, weights)
    after = target.generate([PROMPT] * 4, max_new_tokens=4, seeds=[1, 2, 3, 4])
    expected = source.generate([PROMPT] * 4, max_new_tokens=4, seeds=[1, 2, 3, 4])
    assert [g.tokens for g in after] == [g.tokens for g in expected]
    assert [g.tokens for g in before] != [g.tokens for g in expected] or before[0].log_probs != expected[
        0
    ].log_probs
    # the export is a copy: training the source later does not change it
    with torch.no_grad():
        next(source.parameters()).add_(1.0)
    assert not torch.equal(next(iter(weights.values())), next(source.parameters()))


def test_bad_weights_are_refused_and_leave_the_policy_unchanged() -> None:
    policy = DemoPolicy(seed=12)
    kept = export_weights(policy)
    weights = export_weights(DemoPolicy(seed=13))
    name = next(iter(weights))
    with pytest.raises(ValueError, match="missing"):
        import_weights(policy, {k: v for k, v in weights.items() if k != name})
    with pytest.raises(ValueError, match="unexpected"):
        import_weights(policy, {**weights, "extra": torch.zeros(1)})
    with pytest.raises(ValueError, match="has shape"):
        import_weights(policy, {**weights, name: torch.zeros(3, 3, 3)})
    with pytest.raises(TypeError, match=r"not a torch\.Tensor"):
        import_weights(policy, {**weights, name: [0.0]})
    assert all(torch.equal(kept[k], v) for k, v in export_weights(policy).items())


# ---------------------------------------------------------------- GRPO


def test_group_advantages() -> None:
    adv = group_advantages([1.0, 0.0, 0.5, 0.5], 2)
    assert adv[0] == pytest.approx(0.5 / (0.5**0.5 + 1e-6))
    assert adv[0] == pytest.approx(-adv[1])
    assert adv[2:] == [0.0, 0.0]
    assert group_advantages([2.0, 4.0], 2, std_normalization=False) == [-1.0, 1.0]
    assert group_advantages([3.0], 1) == [0.0]
    with pytest.raises(ValueError, match="groups of 2"):
        group_advantages([1.0, 2.0, 3.0], 2)


def _batch(policy: DemoPolicy, rewards: list[float]) -> dict:
    gens = policy.generate([PROMPT] * len(rewards), max_new_tokens=4, seeds=list(range(len(rewards))))
    return {
        "tokens": [PROMPT + g.tokens for g in gens],
        "response_lengths": [len(g.tokens) for g in gens],
        "rewards": rewards,
        "loss_masks": [[1] * len(g.tokens) for g in gens],
        "rollout_log_probs": [g.log_probs for g in gens],
        "rollout_routed_experts": [g.routes for g in gens],
    }


def test_a_grpo_step_raises_the_likelihood_of_rewarded_responses() -> None:
    policy = DemoPolicy(seed=14)
    trainer = GrpoTrainer(policy, GrpoConfig(learning_rate=1e-2))
    batch = _batch(policy, [1.0, -1.0, 1.0, -1.0])
    metrics = trainer.step(batch)
    assert metrics["log_prob_gap"] < 1e-5  # replayed routes: same computation as the rollout
    assert metrics["tokens"] == sum(batch["response_lengths"])
    seqs = torch.nn.utils.rnn.pad_sequence([torch.tensor(t) for t in batch["tokens"]], batch_first=True)
    with torch.no_grad():
        lp, _ = policy.token_log_probs(seqs)
    gains = []
    for i, n in enumerate(batch["response_lengths"]):
        end = len(batch["tokens"][i]) - 1
        gains.append(float(lp[i, end - n : end].sum()) - sum(batch["rollout_log_probs"][i]))
    assert gains[0] > 0 and gains[2] > 0 and gains[1] < 0 and gains[3] < 0


def test_a_fully_masked_batch_does_not_move_the_policy() -> None:
    policy = DemoPolicy(seed=15)
    batch = _batch(policy, [1.0, -1.0])
    batch["loss_masks"] = [[0] * n for n in batch["response_lengths"]]
    kept = export_weights(policy)
    GrpoTrainer(policy).step(batch)
    assert all(torch.equal(kept[k], v) for k, v in export_weights(policy).items())


def test_average_gradients_hook_sees_every_gradient() -> None:
    policy = DemoPolicy(seed=16)
    seen: list[int] = []

    def zero(grads: list) -> None:  # a rank whose peers cancel it out entirely
        seen.append(len(grads))
        for g in grads:
            g.zero_()

    kept = export_weights(policy)
    GrpoTrainer(policy).step(_batch(policy, [1.0, -1.0]), average_gradients=zero)
    assert seen == [len(list(policy.parameters()))]
    assert all(torch.equal(kept[k], v) for k, v in export_weights(policy).items())


@pytest.mark.parametrize(
    ("edit", "error", "message"),
    [
        (lambda b: b.pop("tokens"), KeyError, "no 'tokens'"),
        (lambda b: b.pop("rewards"), KeyError, "no 'rewards'"),
        (lambda b: b.update(response_lengths=[1]), ValueError, "response lengths"),
        (lambda b: b.update(response_lengths=[99, 99]), ValueError, "does not fit"),
        (lambda b: b.update(rewards=[1.0]), ValueError, "1 rewards for 2 samples"),
        (lambda b: b["loss_masks"].__setitem__(0, [1]), ValueError, "loss_masks has 1 entries"),
        (lambda b: b["rollout_log_probs"].__setitem__(1, []), ValueError, "rollout_log_probs has 0"),
        (lambda b: b["rollout_routed_experts"].__setitem__(0, torch.zeros(2, 2, 2)), ValueError, "shape"),
        (
            lambda b: b["rollout_routed_experts"].__setitem__(0, b["rollout_routed_experts"][0] + 9),
            ValueError,
            "outside",
        ),
    ],
)
def test_bad_training_batches_are_refused(edit, error, message) -> None:
    policy = DemoPolicy(seed=17)
    batch = _batch(policy, [1.0, -1.0])
    edit(batch)
    kept = export_weights(policy)
    with pytest.raises(error, match=message):
        GrpoTrainer(policy).step(batch)
    assert all(torch.equal(kept[k], v) for k, v in export_weights(policy).items())


def test_lazy_references_and_tensors_are_accepted() -> None:
    class Lazy:
        def __init__(self, value) -> None:
            self.value = value

        def load(self):
            return self.value

    policy = DemoPolicy(seed=18)
    batch = _batch(policy, [1.0, -1.0])
    batch["tokens"] = [torch.tensor(t) for t in batch["tokens"]]
    batch["response_lengths"] = torch.tensor(batch["response_lengths"])
    batch["rollout_routed_experts"] = [Lazy(r) for r in batch["rollout_routed_experts"]]
    assert GrpoTrainer(policy).step(batch)["log_prob_gap"] < 1e-5


def test_trainer_state_roundtrip() -> None:
    policy = DemoPolicy(seed=19)
    trainer = GrpoTrainer(policy)
    trainer.step(_batch(policy, [1.0, -1.0]))
    clone = GrpoTrainer(DemoPolicy(seed=20))
    clone.load_state_dict(trainer.state_dict())
    batch = _batch(policy, [-1.0, 1.0])
    trainer.step(batch)
    clone.step(batch)
    assert all(torch.equal(a, b) for a, b in zip(policy.parameters(), clone.policy.parameters(), strict=True))


# ---------------------------------------------------------------- learning


def test_the_plain_loop_learns_the_task_on_a_fixed_seed() -> None:
    results = run_plain_loop(LoopConfig(steps=20, seed=1))
    rewards = [r.mean_reward for r in results]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last > first + 0.2, rewards
