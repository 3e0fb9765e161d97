"""The in-process demo generator: same samples as over HTTP, aborts, weight updates, threads."""

from __future__ import annotations

import asyncio
import threading

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("aiohttp")

from straw.rollout import Sample, SampleStatus  # noqa: E402
from straw.rollout.demo import task  # noqa: E402
from straw.rollout.demo.engine import BatchingEngine  # noqa: E402
from straw.rollout.demo.local import PolicyGenerator, task_reward  # noqa: E402
from straw.rollout.demo.policy import Decoding, DemoPolicy, export_weights  # noqa: E402
from straw.rollout.demo.server import PolicyServer  # noqa: E402
from straw.rollout.generators import SGLangGenerator  # noqa: E402

TEXT = "2 3 1"


def group(n: int = 4, base: int = 0) -> list[Sample]:
    return [Sample(index=base + i, group_index=base, prompt=TEXT, label=TEXT) for i in range(n)]


def test_in_process_and_http_generation_agree() -> None:
    async def main() -> None:
        policy = DemoPolicy(seed=2)
        local = PolicyGenerator(policy, seed=11)
        here = await local(group(), weight_version=None)
        async with PolicyServer(policy) as server:
            remote = SGLangGenerator(
                server.url, max_new_tokens=4, reward=task_reward, tokenize=task.encode_prompt, seed=11,
                routed_experts=(2, 2),
            )  # fmt: skip
            there = await remote(group(), weight_version=None)
            await remote.aclose()
        for a, b in zip(here, there, strict=True):
            assert a.tokens == b.tokens and a.status is b.status and a.reward == b.reward
            assert a.rollout_log_probs == pytest.approx(b.rollout_log_probs, abs=1e-6)
            assert (a.rollout_routed_experts == b.rollout_routed_experts).all()
            assert a.weight_versions == b.weight_versions == ["0"]
        await local.aclose()

    asyncio.run(main())


def test_many_groups_decode_in_one_batch_and_abort_keeps_partials() -> None:
    async def main() -> None:
        # no stop token: every sample runs to the parking point
        generator = PolicyGenerator(DemoPolicy(seed=3), seed=1, stop_tokens=())
        await generator(group(1), weight_version=None)  # binds the engine
        generator.engine.park_at(2)
        calls = [
            asyncio.ensure_future(generator(group(4, base=10 * g), weight_version=None)) for g in range(3)
        ]
        await generator.engine.wait_parked(12)
        generator.abort()
        partials = [await c for c in calls]
        assert all(s.status is SampleStatus.ABORTED and s.response_length == 2 for g in partials for s in g)
        generator.engine.park_at(None)
        done = [await generator(g, weight_version=None) for g in partials]
        fresh = PolicyGenerator(DemoPolicy(seed=3), seed=1, stop_tokens=())
        whole = [await fresh(group(4, base=10 * g), weight_version=None) for g in range(3)]
        assert [[s.tokens for s in g] for g in done] == [[s.tokens for s in g] for g in whole]
        assert all(s.rollout_routed_experts.shape[0] == len(s.tokens) - 1 for g in done for s in g)
        await generator.aclose()
        await fresh.aclose()

    asyncio.run(main())


def test_weight_updates_between_steps_and_from_another_thread() -> None:
    policy = DemoPolicy(seed=4)
    generator = PolicyGenerator(policy, seed=2, stop_tokens=())
    new = export_weights(DemoPolicy(seed=5))
    assert generator.update_weights(new, "1") == 0  # no loop yet: loaded in place
    assert generator.weight_version == "1"
    assert all(torch.equal(a, new[k]) for k, a in export_weights(policy).items())
    result: list[list[Sample]] = []
    parked = threading.Event()

    async def main() -> None:
        await generator(group(1), weight_version=None)
        generator.engine.park_at(1)
        call = asyncio.ensure_future(generator(group(2), weight_version=None))
        await generator.engine.wait_parked(2)
        parked.set()
        partial = await call  # ended by the update's abort
        generator.engine.park_at(None)
        result.append(await generator(partial, weight_version=None))
        await generator.aclose()

    thread = threading.Thread(target=lambda: asyncio.run(main()))
    thread.start()
    assert parked.wait(30)
    assert generator.update_weights(export_weights(DemoPolicy(seed=6)), "2") == 2
    thread.join(30)
    assert not thread.is_alive()
    assert all(s.weight_versions == ["1", "2"] for s in result[0])
    assert all(s.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED) for s in result[0])


def test_task_reward_and_a_prompt_the_policy_cannot_hold() -> None:
    sample = Sample(prompt=TEXT, label=TEXT, tokens=[*task.encode_prompt(TEXT), 2, 3, 1, task.EOS])
    sample.response_length = 4
    assert task_reward(sample) == 1.0
    assert task_reward(Sample(label=TEXT)) == 0.0

    async def main() -> None:
        generator = PolicyGenerator(DemoPolicy(seed=0))
        long = Sample(index=0, prompt=" ".join(["1"] * 20), label="1")
        with pytest.raises(Exception, match="refused sample 0"):
            await generator([long], weight_version=None)
        await generator.aclose()

    asyncio.run(main())


def test_the_task_jsonl_feeds_the_generator_and_the_trainer(tmp_path) -> None:
    from straw.rollout.dataset import DatasetCursor, JsonlDataset, PromptProducer
    from straw.rollout.demo.grpo import GrpoTrainer, group_advantages

    path = task.CopyTask(size=16, seed=3).write_jsonl(tmp_path / "prompts.jsonl")
    dataset = JsonlDataset(path, input_key="input", label_key="label")
    producer = PromptProducer(dataset, n_samples_per_prompt=4, shuffle=True, seed=1)
    groups, _ = producer.draw(2, DatasetCursor())
    policy = DemoPolicy(seed=7)

    async def main() -> list[list[Sample]]:
        generator = PolicyGenerator(policy, seed=5)
        out = [await generator(g, weight_version="0") for g in groups]
        await generator.aclose()
        return out

    done = asyncio.run(main())
    samples = [s for g in done for s in g]
    assert all(s.reward == task_reward(s) and s.label == s.prompt for s in samples)
    batch = {
        "tokens": [s.tokens for s in samples],
        "response_lengths": [s.response_length for s in samples],
        "rewards": group_advantages([s.reward for s in samples], 4),
        "loss_masks": [[1] * s.response_length for s in samples],
        "rollout_log_probs": [s.rollout_log_probs for s in samples],
        "rollout_routed_experts": [s.rollout_routed_experts for s in samples],
    }
    metrics = GrpoTrainer(policy).step(batch)
    assert metrics["log_prob_gap"] < 1e-5  # the generator's routes and log-probs replay exactly


def test_a_paced_engine_holds_each_decoding_step_and_an_abort_ends_the_wait() -> None:
    async def main() -> None:
        policy = DemoPolicy(seed=3)
        with pytest.raises(ValueError, match="step_seconds must be a finite number"):
            BatchingEngine(policy, step_seconds=-0.1)
        engine = BatchingEngine(policy, step_seconds=3600.0)  # a step far longer than the test
        await engine.start()
        decoding = Decoding(policy, task.encode_prompt(TEXT), max_new_tokens=4, seed=1, stop_tokens=())
        job = engine.submit(decoding)
        await asyncio.wait_for(job.progress.wait(), 30)  # the first step ran
        job.progress.clear()
        # Unpaced, the other three tokens would follow within milliseconds; paced, the loop waits.
        done, _ = await asyncio.wait([asyncio.ensure_future(job.progress.wait())], timeout=0.3)
        assert not done and len(decoding.new_tokens) == 1 and not job.finished
        engine.abort(lambda j: True)
        await asyncio.wait_for(engine.follow(job), 30)  # ended at once, with the token it had
        assert len(decoding.new_tokens) == 1 and engine.stats["aborted"] == 1
        again = engine.submit(Decoding(policy, task.encode_prompt(TEXT), max_new_tokens=4, seed=2))
        await asyncio.wait_for(again.progress.wait(), 30)
        await asyncio.wait_for(engine.close(), 30)  # closing ends a paced wait too
        assert again.finished

    asyncio.run(main())
