"""Engine generators against the demo's loopback server over real HTTP on 127.0.0.1.

Both APIs (SGLang's native /generate and OpenAI-compatible /v1/completions, streamed and
not), aborts mid-generation with partials kept and continued, a server that is down,
malformed JSON, timeouts, retries that never append twice, and refused requests. Every
wait is on an event the server or the generator sets; nothing sleeps.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("aiohttp")

from straw.rollout import Sample, SampleStatus  # noqa: E402
from straw.rollout.demo import task  # noqa: E402
from straw.rollout.demo.policy import DemoPolicy, export_weights  # noqa: E402
from straw.rollout.demo.server import PolicyServer  # noqa: E402
from straw.rollout.generators import (  # noqa: E402
    EngineOptions,
    EngineProtocolError,
    EngineRequestError,
    EngineTimeout,
    EngineUnavailable,
    OpenAICompletionsGenerator,
    SGLangGenerator,
)

PROMPT_TEXT = "3 1 0"
PROMPT = task.encode_prompt(PROMPT_TEXT)
LAYERS_TOPK = (2, 2)
SEED = 100
FAST_RETRY = EngineOptions(max_retries=2, retry_backoff=0.01, request_timeout=30.0)


def reward(sample: Sample) -> float:
    return task.reward(sample.tokens[len(sample.tokens) - sample.response_length :], sample.label)


def group(n: int = 4, group_index: int = 0) -> list[Sample]:
    return [
        Sample(index=group_index * 100 + i, group_index=group_index, prompt=PROMPT_TEXT, label=PROMPT_TEXT)
        for i in range(n)
    ]


def sglang(url: str, **kwargs: Any) -> SGLangGenerator:
    # ignore_eos: every sample runs to the parking point of the abort tests, whatever it samples
    options = {"max_new_tokens": 4, "reward": reward, "tokenize": task.encode_prompt, "seed": SEED}
    options["sampling_params"] = {"ignore_eos": True}
    options.setdefault("options", FAST_RETRY)
    return SGLangGenerator(url, **{**options, **kwargs})


def openai(url: str, **kwargs: Any) -> OpenAICompletionsGenerator:
    options = {"max_new_tokens": 4, "reward": reward, "tokenize": task.encode_prompt, "seed": SEED}
    options["extra_body"] = {"ignore_eos": True}
    options.setdefault("options", FAST_RETRY)
    return OpenAICompletionsGenerator(url, **{**options, **kwargs})


def run(scenario: Callable[[PolicyServer], Awaitable[None]], *, policy_seed: int = 0, **server: Any) -> None:
    async def main() -> None:
        async with PolicyServer(DemoPolicy(seed=policy_seed), **server) as s:
            await scenario(s)

    asyncio.run(main())


def expected(policy: DemoPolicy, samples: list[Sample]) -> list[Any]:
    """What the policy generates in-process for these samples under the generators' seeds."""
    seeds = [SEED + s.index for s in samples]
    return policy.generate([PROMPT] * len(samples), max_new_tokens=4, seeds=seeds, stop_tokens=())


def assert_matches(samples: list[Sample], generations: list[Any], *, routes: bool) -> None:
    for s, g in zip(samples, generations, strict=True):
        assert s.tokens == PROMPT + g.tokens
        assert s.response_length == len(g.tokens)
        assert s.rollout_log_probs == pytest.approx(g.log_probs, abs=1e-5)
        assert s.status is (SampleStatus.COMPLETED if g.finish == "stop" else SampleStatus.TRUNCATED)
        assert s.reward == reward(s)
        assert s.response == "".join(task.piece(t) for t in g.tokens)
        if routes:
            assert s.rollout_routed_experts.shape == (len(s.tokens) - 1, *LAYERS_TOPK)
            assert (s.rollout_routed_experts == g.routes.numpy()).all()
        else:
            assert s.rollout_routed_experts is None


# ---------------------------------------------------------------- both APIs


def test_sglang_generates_what_the_policy_does() -> None:
    async def scenario(server: PolicyServer) -> None:
        samples = group()
        generator = sglang(server.url, routed_experts=LAYERS_TOPK)
        out = await generator(samples, weight_version="7")
        assert out is samples
        assert [s.index for s in out] == [0, 1, 2, 3] and all(s.group_index == 0 for s in out)
        assert_matches(out, expected(server.policy, out), routes=True)
        # SGLang reports its own weight version; the call's argument is only a fallback.
        assert all(s.weight_versions == ["0"] for s in out)
        assert server.stats["generate"] == 4
        await generator.aclose()

    run(scenario)


@pytest.mark.parametrize("stream", [True, False])
def test_openai_completions_generate_what_the_policy_does(stream: bool) -> None:
    async def scenario(server: PolicyServer) -> None:
        samples = group()
        routes = None if stream else LAYERS_TOPK
        generator = openai(server.url, model="straw-demo", stream=stream, routed_experts=routes)
        out = await generator(samples, weight_version="7")
        assert_matches(out, expected(server.policy, out), routes=not stream)
        assert all(s.weight_versions == ["7"] for s in out)
        body = server.seen[-1][1]
        assert body["prompt"] == PROMPT and body["return_token_ids"] is True and body["stream"] is stream
        await generator.aclose()

    run(scenario)


def test_generation_is_repeatable_under_a_seed_and_varies_without_one() -> None:
    async def scenario(server: PolicyServer) -> None:
        seeded = sglang(server.url)
        a, b = await seeded(group(8), weight_version=None), await seeded(group(8), weight_version=None)
        assert [s.tokens for s in a] == [s.tokens for s in b]
        free = sglang(server.url, seed=None)
        c = await free(group(8), weight_version=None)
        d = await free(group(8), weight_version=None)
        assert [s.tokens for s in c] != [s.tokens for s in d]
        await seeded.aclose()
        await free.aclose()

    run(scenario)


def test_finished_samples_pass_through_and_a_full_budget_truncates() -> None:
    async def scenario(server: PolicyServer) -> None:
        done = Sample(index=1, prompt=PROMPT_TEXT, label=PROMPT_TEXT, tokens=[*PROMPT, 3], response_length=1)
        done.status, done.rollout_log_probs = SampleStatus.COMPLETED, [-0.5]
        full = Sample(index=2, prompt=PROMPT_TEXT, label=PROMPT_TEXT, tokens=[*PROMPT, 3, 1, 0, 2])
        full.response_length, full.rollout_log_probs, full.status = 4, [-1.0] * 4, SampleStatus.ABORTED
        generator = sglang(server.url)
        out = await generator([done, full], weight_version="3")
        assert server.stats["generate"] == 0
        assert done.status is SampleStatus.COMPLETED and done.tokens == [*PROMPT, 3] and done.reward == 0.25
        assert full.status is SampleStatus.TRUNCATED and full.reward == 0.75 and out == [done, full]
        await generator.aclose()

    run(scenario)


# ---------------------------------------------------------------- abort and continuation


def test_sglang_abort_keeps_partials_that_continue_exactly() -> None:
    async def scenario(server: PolicyServer) -> None:
        generator = sglang(server.url, routed_experts=LAYERS_TOPK)
        samples = group(3)
        server.park_at(2)
        call = asyncio.ensure_future(generator(samples, weight_version=None))
        await server.wait_parked(3)
        generator.abort()
        out = await asyncio.wait_for(call, 10)
        for s in out:
            assert s.status is SampleStatus.ABORTED and s.reward is None
            assert s.response_length == 2 and len(s.rollout_log_probs) == 2
            assert s.rollout_routed_experts.shape == (len(s.tokens) - 1, *LAYERS_TOPK)
            assert s.weight_versions == ["0"]
        assert server.engine.stats["aborted"] == 3
        server.park_at(None)
        # The next call continues after the partial response, under the same seed.
        again = await generator(out, weight_version=None)
        whole = expected(server.policy, again)
        assert_matches(again, whole, routes=True)
        assert all(s.weight_versions == ["0", "0"] for s in again)
        sent = [body for kind, body in server.seen if kind == "generate"][-3:]
        assert all(b["sampling_params"]["max_new_tokens"] == 2 and len(b["input_ids"]) == 7 for b in sent)
        assert all(b["routed_experts_start_len"] == 6 for b in sent)
        await generator.aclose()

    run(scenario)


def test_continuation_after_a_weight_update_records_both_versions() -> None:
    async def scenario(server: PolicyServer) -> None:
        generator = sglang(server.url, routed_experts=LAYERS_TOPK)
        server.park_at(1)
        call = asyncio.ensure_future(generator(group(2), weight_version=None))
        await server.wait_parked(2)
        generator.abort()
        partials = await call
        aborted = await server.update_weights(export_weights(DemoPolicy(seed=9)), "1")
        assert aborted == 0  # the generator's abort already ended them
        server.park_at(None)
        out = await generator(partials, weight_version=None)
        assert all(s.weight_versions == ["0", "1"] for s in out)
        assert all(s.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED) for s in out)
        assert all(s.rollout_routed_experts.shape[0] == len(s.tokens) - 1 for s in out)
        await generator.aclose()

    run(scenario)


def test_openai_streaming_abort_keeps_what_was_received() -> None:
    async def scenario(server: PolicyServer) -> None:
        generator = openai(server.url, stream=True)
        samples = group(3)
        server.park_at(2)
        call = asyncio.ensure_future(generator(samples, weight_version="5"))
        await server.wait_parked(3)
        generator.abort()
        out = await asyncio.wait_for(call, 10)
        assert all(s.status is SampleStatus.ABORTED and s.response_length <= 2 for s in out)
        assert all(len(s.rollout_log_probs or []) == s.response_length for s in out)
        await server.wait_idle()  # the server dropped the requests whose client went away
        server.park_at(None)
        again = await generator(out, weight_version="5")
        assert_matches(again, expected(server.policy, again), routes=False)
        await generator.aclose()

    run(scenario)


def test_openai_abort_without_streaming_keeps_the_sample_as_it_was() -> None:
    async def scenario(server: PolicyServer) -> None:
        generator = openai(server.url, stream=False)
        samples = group(2)
        server.park_at(2)
        call = asyncio.ensure_future(generator(samples, weight_version="5"))
        await server.wait_parked(2)
        generator.abort()
        out = await asyncio.wait_for(call, 10)
        assert all(
            s.status is SampleStatus.ABORTED and s.response_length == 0 and s.tokens == [] for s in out
        )
        await server.wait_idle()
        assert server.engine.stats["aborted"] == 2
        await generator.aclose()

    run(scenario)


def test_abort_from_another_thread() -> None:
    async def scenario(server: PolicyServer) -> None:
        generator = sglang(server.url)
        server.park_at(1)
        result: list[list[Sample]] = []
        started = threading.Event()

        def worker() -> None:
            async def call() -> None:
                started.set()
                result.append(await generator(group(2), weight_version=None))
                await generator.aclose()

            asyncio.run(call())

        thread = threading.Thread(target=worker)
        thread.start()
        await asyncio.get_running_loop().run_in_executor(None, started.wait)
        await server.wait_parked(2)
        generator.abort()  # this thread runs the server's loop, not the generator's
        await asyncio.get_running_loop().run_in_executor(None, thread.join, 10)
        assert not thread.is_alive()
        assert [s.status for s in result[0]] == [SampleStatus.ABORTED] * 2
        assert all(s.response_length == 1 for s in result[0])

    run(scenario)


def test_abort_ends_only_the_calls_in_flight() -> None:
    async def scenario(server: PolicyServer) -> None:
        generator = sglang(server.url)
        generator.abort()  # nothing in flight, nothing bound yet: a no-op
        first = await generator(group(2), weight_version=None)
        generator.abort()
        second = await generator(group(2), weight_version=None)
        assert all(s.status is not SampleStatus.ABORTED for s in first + second)
        await generator.aclose()

    run(scenario)


def test_concurrency_is_bounded() -> None:
    async def scenario(server: PolicyServer) -> None:
        generator = sglang(server.url, options=EngineOptions(max_concurrency=2))
        server.park_at(1)
        call = asyncio.ensure_future(generator(group(6), weight_version=None))
        await server.wait_parked(2)
        assert server.running == 2
        server.park_at(None)
        out = await call
        assert all(s.status is not SampleStatus.ABORTED for s in out)
        assert server.stats["generate"] == 6
        await generator.aclose()

    run(scenario)


# ---------------------------------------------------------------- failures


def test_a_server_that_is_down_is_a_clear_error_and_changes_nothing() -> None:
    async def main() -> None:
        async with PolicyServer(DemoPolicy(seed=0)) as server:
            url = server.url
        for generator in (sglang(url), openai(url)):
            samples = group(2)
            with pytest.raises(EngineUnavailable, match=r"failed 3 attempts; last error: .*Connect"):
                await generator(samples, weight_version=None)
            assert all(s.tokens == [] and s.status is SampleStatus.PENDING for s in samples)
            await generator.aclose()

    asyncio.run(main())


@pytest.mark.parametrize("make", [sglang, openai])
def test_malformed_json_is_a_protocol_error_and_not_retried(make) -> None:
    async def scenario(server: PolicyServer) -> None:
        server.inject("malformed_json")
        generator = make(server.url, stream=False) if make is openai else make(server.url)
        samples = group(1)
        with pytest.raises(EngineProtocolError, match="malformed JSON"):
            await generator(samples, weight_version=None)
        assert len(server.seen) == 1
        assert samples[0].tokens == [] and samples[0].status is SampleStatus.PENDING
        await generator.aclose()

    run(scenario)


def test_timeouts_retry_then_fail_and_the_server_drops_the_requests() -> None:
    async def scenario(server: PolicyServer) -> None:
        server.park_at(0)  # never generate anything
        # A timeout long enough that the parked server has recorded each request before it ends,
        # even on a loaded machine (client and server share this event loop).
        options = EngineOptions(request_timeout=1.0, max_retries=1, retry_backoff=0.01)
        generator = sglang(server.url, options=options)
        samples = group(1)
        with pytest.raises(EngineTimeout, match=r"did not answer within 1.0s \(2 attempts\)"):
            await generator(samples, weight_version=None)
        assert len(server.seen) == 2 and samples[0].tokens == []
        await server.wait_idle()
        await generator.aclose()

    run(scenario)


@pytest.mark.parametrize("fault", ["unavailable", "error_after_generate", "disconnect"])
@pytest.mark.parametrize("make", [sglang, openai])
def test_a_retry_resends_the_same_generation_and_never_appends_twice(fault: str, make) -> None:
    async def scenario(server: PolicyServer) -> None:
        server.inject(fault)
        generator = make(server.url)
        samples = group(2)
        out = await generator(samples, weight_version="2")
        assert_matches(out, expected(server.policy, out), routes=False)
        assert all(len(s.weight_versions) == 1 for s in out)
        bodies = [body for _, body in server.seen]
        assert len(bodies) == 3  # two samples, one of them sent twice
        key = "input_ids" if make is sglang else "prompt"
        assert all(b[key] == PROMPT for b in bodies)
        await generator.aclose()

    run(scenario)


def test_retries_give_up_with_the_last_status() -> None:
    async def scenario(server: PolicyServer) -> None:
        server.inject("unavailable", count=3)
        generator = sglang(server.url)
        with pytest.raises(EngineUnavailable, match="HTTP 503"):
            await generator(group(1), weight_version=None)
        await generator.aclose()

    run(scenario)


def test_refused_requests_are_not_retried() -> None:
    async def scenario(server: PolicyServer) -> None:
        wrong_model = openai(server.url, model="other")
        with pytest.raises(EngineRequestError, match="HTTP 404"):
            await wrong_model(group(1), weight_version=None)
        unsupported = sglang(server.url, sampling_params={"top_p": 0.5})
        with pytest.raises(EngineRequestError, match="top_p"):
            await unsupported(group(1), weight_version=None)
        assert len(server.seen) == 2
        await wrong_model.aclose()
        await unsupported.aclose()

    run(scenario)


def test_wrong_route_shape_is_a_protocol_error() -> None:
    async def scenario(server: PolicyServer) -> None:
        generator = sglang(server.url, routed_experts=(3, 2))
        samples = group(1)
        with pytest.raises(EngineProtocolError, match="do not fill"):
            await generator(samples, weight_version=None)
        assert samples[0].tokens == []
        await generator.aclose()

    run(scenario)


def test_bad_samples_and_options_are_refused_before_any_request() -> None:
    async def scenario(server: PolicyServer) -> None:
        generator = sglang(server.url)
        no_logprobs = Sample(index=0, tokens=[*PROMPT, 1], response_length=1, status=SampleStatus.ABORTED)
        with pytest.raises(ValueError, match="no rollout_log_probs"):
            await generator([no_logprobs], weight_version=None)
        untokenized = sglang(server.url, tokenize=None)
        with pytest.raises(ValueError, match="no tokenize function"):
            await untokenized(group(1), weight_version=None)
        with pytest.raises(TypeError, match="holds Samples"):
            await generator([[Sample()]], weight_version=None)  # type: ignore[list-item]
        assert len(server.seen) == 0
        await generator.aclose()
        await untokenized.aclose()

    run(scenario)
    with pytest.raises(ValueError, match="http://"):
        SGLangGenerator("127.0.0.1:1", max_new_tokens=4)
    with pytest.raises(ValueError, match="stream=False"):
        OpenAICompletionsGenerator("http://127.0.0.1:1", max_new_tokens=4, routed_experts=(2, 2))
    with pytest.raises(ValueError, match="max_concurrency"):
        EngineOptions(max_concurrency=0)


def test_a_closed_generator_refuses_calls() -> None:
    async def scenario(server: PolicyServer) -> None:
        generator = sglang(server.url)
        await generator(group(1), weight_version=None)
        generator.close()  # from inside the loop: scheduled
        with pytest.raises(RuntimeError, match="closed"):
            await generator(group(1), weight_version=None)

    run(scenario)


def test_concurrent_first_calls_bind_once() -> None:
    async def scenario(server: PolicyServer) -> None:
        generator = sglang(server.url)
        first, second = await asyncio.gather(
            generator(group(2), weight_version=None), generator(group(2, group_index=1), weight_version=None)
        )
        assert all(s.status is SampleStatus.TRUNCATED for s in first + second)
        assert server.stats["generate"] == 4
        await generator.aclose()

    run(scenario)
