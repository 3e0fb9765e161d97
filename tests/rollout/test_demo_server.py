"""The demo's loopback inference server: SGLang's and vLLM's request and answer shapes over HTTP."""

from __future__ import annotations

import asyncio
import base64
import io
import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")
aiohttp = pytest.importorskip("aiohttp")
np = pytest.importorskip("numpy")

from straw.rollout.demo import task  # noqa: E402
from straw.rollout.demo.policy import DemoPolicy, export_weights  # noqa: E402
from straw.rollout.demo.server import PolicyServer  # noqa: E402

PROMPT = task.encode_prompt("2 0 1")
# Requests that are parked mid-generation must not finish early on a sampled end token.
NO_STOP = {"sampling_params": {"ignore_eos": True}}


def run(scenario: Callable[[PolicyServer, Any], Awaitable[None]], **server: Any) -> None:
    async def main() -> None:
        async with PolicyServer(DemoPolicy(seed=0), **server) as s, aiohttp.ClientSession() as client:
            await scenario(s, client)

    asyncio.run(main())


async def post(client: Any, url: str, body: Any) -> tuple[int, Any]:
    async with client.post(url, json=body) as response:
        return response.status, await response.json(content_type=None)


def test_listens_on_loopback_only_and_closes_idempotently() -> None:
    async def main() -> None:
        server = PolicyServer(DemoPolicy(seed=0))
        with pytest.raises(RuntimeError, match="not started"):
            _ = server.url
        url = await server.start()
        assert url.startswith("http://127.0.0.1:")
        with pytest.raises(RuntimeError, match="already started"):
            await server.start()
        await server.close()
        await server.close()

    asyncio.run(main())


def test_native_generate_answer_shape() -> None:
    async def scenario(server: PolicyServer, client: Any) -> None:
        body = {
            "rid": "r1",
            "input_ids": PROMPT,
            "sampling_params": {
                "max_new_tokens": 4,
                "temperature": 1.0,
                "sampling_seed": 5,
                "ignore_eos": True,
            },
            "return_logprob": True,
            "return_routed_experts": True,
        }
        status, out = await post(client, f"{server.url}/generate", body)
        assert status == 200
        meta = out["meta_info"]
        assert meta["id"] == "r1" and meta["weight_version"] == "0"
        assert meta["finish_reason"] == {"type": "length", "length": 4}
        assert meta["prompt_tokens"] == len(PROMPT) and meta["completion_tokens"] == 4
        tokens = [t for _, t, _ in meta["output_token_logprobs"]]
        assert tokens == out["output_ids"] and len(tokens) == 4
        (g,) = server.policy.generate([PROMPT], max_new_tokens=4, seeds=[5], stop_tokens=())
        assert tokens == g.tokens
        assert [lp for lp, _, _ in meta["output_token_logprobs"]] == pytest.approx(g.log_probs, abs=1e-5)
        routes = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype=np.int32)
        assert routes.reshape(-1, 2, 2).tolist() == g.routes.tolist()
        assert out["text"] == "".join(task.piece(t) for t in tokens)
        # a continuation asks for routes from where it already has them
        body = {**body, "input_ids": PROMPT + tokens[:2], "routed_experts_start_len": len(PROMPT) + 1}
        body["sampling_params"] = {**body["sampling_params"], "max_new_tokens": 2}
        body["rid"] = "r2"
        status, rest = await post(client, f"{server.url}/generate", body)
        assert status == 200 and rest["output_ids"] == tokens[2:]
        tail = np.frombuffer(base64.b64decode(rest["meta_info"]["routed_experts"]), dtype=np.int32)
        assert tail.reshape(-1, 2, 2).tolist() == g.routes[len(PROMPT) + 1 :].tolist()

    run(scenario)


def test_stop_token_finish_reason() -> None:
    async def scenario(server: PolicyServer, client: Any) -> None:
        everything = list(range(task.VOCAB_SIZE))
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4, "stop_token_ids": everything}}
        _, out = await post(client, f"{server.url}/generate", body)
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": out["output_ids"][0]}
        assert "output_token_logprobs" not in out["meta_info"]  # not asked for

    run(scenario)


def test_abort_request_by_rid_and_all() -> None:
    async def scenario(server: PolicyServer, client: Any) -> None:
        server.park_at(1)
        calls = [
            asyncio.ensure_future(
                post(client, f"{server.url}/generate", {"rid": rid, "input_ids": PROMPT, **NO_STOP})
            )
            for rid in ("a", "b", "c")
        ]
        await server.wait_parked(3)
        assert (await client.post(f"{server.url}/abort_request", json={"rid": "a"})).status == 200
        _, a = await calls[0]
        assert a["meta_info"]["finish_reason"]["type"] == "abort" and len(a["output_ids"]) == 1
        assert server.running == 2
        assert (await client.post(f"{server.url}/abort_request", json={"abort_all": True})).status == 200
        answers = [await c for c in calls[1:]]
        assert all(out["meta_info"]["finish_reason"]["type"] == "abort" for _, out in answers)
        status, error = await post(client, f"{server.url}/abort_request", {"rid": 3})
        assert status == 400 and error["object"] == "error" and "rid" in error["message"]

    run(scenario)


def test_weight_version_endpoints_and_updates(tmp_path) -> None:
    async def scenario(server: PolicyServer, client: Any) -> None:
        async with client.get(f"{server.url}/get_weight_version") as response:
            assert await response.json() == {"weight_version": "0"}
        status, out = await post(client, f"{server.url}/update_weight_version", {"new_version": "4"})
        assert status == 200 and out["success"] and out["new_version"] == "4"
        async with client.get(f"{server.url}/get_model_info") as response:
            info = await response.json()
        assert info["weight_version"] == "4" and info["is_generation"] and info["model_path"] == "straw-demo"
        other = DemoPolicy(seed=3)
        path = tmp_path / "weights.pt"
        torch.save(export_weights(other), path)
        status, out = await post(
            client, f"{server.url}/update_weights_from_disk", {"model_path": str(path), "weight_version": "5"}
        )
        assert status == 200 and out["success"] and server.weight_version == "5"
        assert all(
            torch.equal(a, b) for a, b in zip(server.policy.parameters(), other.parameters(), strict=True)
        )
        _, answer = await post(client, f"{server.url}/generate", {"input_ids": PROMPT})
        assert answer["meta_info"]["weight_version"] == "5"
        status, out = await post(
            client, f"{server.url}/update_weights_from_disk", {"model_path": str(tmp_path / "missing.pt")}
        )
        assert status == 400 and not out["success"] and server.weight_version == "5"
        status, out = await post(client, f"{server.url}/update_weight_version", {"new_version": 6})
        assert status == 400

    run(scenario)


def test_update_weights_aborts_running_requests_first() -> None:
    async def scenario(server: PolicyServer, client: Any) -> None:
        server.park_at(2)
        call = asyncio.ensure_future(post(client, f"{server.url}/generate", {"input_ids": PROMPT, **NO_STOP}))
        await server.wait_parked(1)
        assert await server.update_weights(export_weights(DemoPolicy(seed=4)), "9") == 1
        _, out = await call
        # its tokens came from the old weights, and it says so
        assert out["meta_info"]["finish_reason"]["type"] == "abort"
        assert out["meta_info"]["weight_version"] == "0"
        server.park_at(None)
        _, fresh = await post(client, f"{server.url}/generate", {"input_ids": PROMPT})
        assert fresh["meta_info"]["weight_version"] == "9"

    run(scenario)


def test_openai_completion_answer_shape() -> None:
    async def scenario(server: PolicyServer, client: Any) -> None:
        body = {
            "model": "straw-demo",
            "prompt": PROMPT,
            "max_tokens": 3,
            "seed": 8,
            "logprobs": 2,
            "return_token_ids": True,
            "ignore_eos": True,
        }
        status, out = await post(client, f"{server.url}/v1/completions", body)
        assert status == 200 and out["object"] == "text_completion" and out["model"] == "straw-demo"
        (choice,) = out["choices"]
        (g,) = server.policy.generate([PROMPT], max_new_tokens=3, seeds=[8], stop_tokens=())
        assert choice["token_ids"] == g.tokens and choice["prompt_token_ids"] == PROMPT
        assert choice["finish_reason"] == "length" and choice["stop_reason"] is None
        logprobs = choice["logprobs"]
        assert logprobs["token_logprobs"] == pytest.approx(g.log_probs, abs=1e-5)
        assert logprobs["tokens"] == [task.token_name(t) for t in g.tokens]
        assert all(len(top) == 2 for top in logprobs["top_logprobs"])
        assert out["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
        routes = np.load(io.BytesIO(base64.b64decode(choice["routed_experts"])), allow_pickle=False)
        assert routes.shape == (len(PROMPT) + 2, 2, 2) and routes.tolist() == g.routes.tolist()
        ids = {**body, "return_token_ids": False, "return_tokens_as_token_ids": True}
        _, out = await post(client, f"{server.url}/v1/completions", ids)
        assert out["choices"][0]["logprobs"]["tokens"] == [f"token_id:{t}" for t in g.tokens]
        assert "token_ids" not in out["choices"][0]
        async with client.get(f"{server.url}/v1/models") as response:
            models = await response.json()
        assert [m["id"] for m in models["data"]] == ["straw-demo"]

    run(scenario)


def test_openai_stream_chunks_add_up_to_the_whole_answer() -> None:
    async def scenario(server: PolicyServer, client: Any) -> None:
        body = {
            "prompt": PROMPT,
            "max_tokens": 4,
            "seed": 2,
            "logprobs": 0,
            "return_token_ids": True,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        async with client.post(f"{server.url}/v1/completions", json=body) as response:
            assert response.headers["Content-Type"].startswith("text/event-stream")
            lines = [line.strip() async for line in response.content if line.strip()]
        assert lines[-1] == b"data: [DONE]"
        chunks = [json.loads(line[5:]) for line in lines[:-1]]
        tokens = [t for c in chunks for choice in c["choices"] for t in choice["token_ids"]]
        (g,) = server.policy.generate([PROMPT], max_new_tokens=4, seeds=[2], stop_tokens=())
        assert tokens == g.tokens
        assert chunks[0]["choices"][0]["prompt_token_ids"] == PROMPT
        finishes = [choice["finish_reason"] for c in chunks for choice in c["choices"]]
        assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4

    run(scenario)


def test_a_client_that_goes_away_aborts_its_request() -> None:
    async def scenario(server: PolicyServer, client: Any) -> None:
        server.park_at(1)
        body = {"prompt": PROMPT, "ignore_eos": True}
        call = asyncio.ensure_future(post(client, f"{server.url}/v1/completions", body))
        await server.wait_parked(1)
        call.cancel()
        await server.wait_idle()
        assert server.engine.stats["aborted"] == 1

    run(scenario)


@pytest.mark.parametrize(
    ("path", "body", "status", "message"),
    [
        ("/generate", {"text": "2 0 1"}, 400, "input_ids only"),
        ("/generate", {"input_ids": [PROMPT, PROMPT]}, 400, "integers only"),
        ("/generate", {"input_ids": [99]}, 400, "outside"),
        ("/generate", {"input_ids": [1] * 16}, 400, "the model holds 16"),
        ("/generate", {"input_ids": PROMPT, "stream": True}, 400, "stream"),
        ("/generate", {"input_ids": PROMPT, "sampling_params": {"top_p": 0.9}}, 400, "top_p"),
        ("/generate", {"input_ids": PROMPT, "sampling_params": {"top_k": 5}}, 400, "top_k"),
        (
            "/generate",
            {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": -1}},
            400,
            "max_new_tokens",
        ),
        ("/generate", {"input_ids": PROMPT, "sampling_params": {"sampling_seed": "x"}}, 400, "seed"),
        ("/generate", {"input_ids": PROMPT, "sampling_params": {"temperature": "hot"}}, 400, "temperature"),
        ("/generate", [1, 2], 400, "JSON object"),
        ("/v1/completions", {"prompt": "2 0 1"}, 400, "list of token ids"),
        ("/v1/completions", {"prompt": [PROMPT]}, 400, "batches"),
        ("/v1/completions", {"prompt": PROMPT, "n": 2}, 400, "n=1"),
        ("/v1/completions", {"prompt": PROMPT, "model": "other"}, 404, "does not exist"),
        ("/v1/completions", {"prompt": PROMPT, "logprobs": -1}, 400, "logprobs"),
    ],
)
def test_refused_requests(path: str, body: Any, status: int, message: str) -> None:
    async def scenario(server: PolicyServer, client: Any) -> None:
        got, error = await post(client, f"{server.url}{path}", body)
        assert got == status
        text = error["message"] if path == "/generate" else error["error"]["message"]
        assert message in text
        assert server.running == 0

    run(scenario)


def test_invalid_json_and_a_busy_server() -> None:
    async def scenario(server: PolicyServer, client: Any) -> None:
        async with client.post(f"{server.url}/generate", data=b"{nope") as response:
            assert response.status == 400 and "not valid JSON" in (await response.json())["message"]
        server.park_at(1)
        first = asyncio.ensure_future(
            post(client, f"{server.url}/generate", {"input_ids": PROMPT, **NO_STOP})
        )
        await server.wait_parked(1)
        status, error = await post(client, f"{server.url}/generate", {"input_ids": PROMPT})
        assert status == 503 and "busy" in error["message"]
        server.park_at(None)
        assert (await first)[0] == 200

    run(scenario, max_running=1)


def test_injected_faults() -> None:
    async def scenario(server: PolicyServer, client: Any) -> None:
        with pytest.raises(ValueError, match="Unknown fault"):
            server.inject("explode")
        server.inject("unavailable")
        server.inject("error_after_generate")
        server.inject("malformed_json")
        assert (await post(client, f"{server.url}/generate", {"input_ids": PROMPT}))[0] == 503
        assert (await post(client, f"{server.url}/generate", {"input_ids": PROMPT}))[0] == 500
        async with client.post(f"{server.url}/generate", json={"input_ids": PROMPT}) as response:
            with pytest.raises(json.JSONDecodeError):
                json.loads(await response.read())
        server.inject("disconnect")
        with pytest.raises(aiohttp.ClientError):
            await post(client, f"{server.url}/generate", {"input_ids": PROMPT})
        assert server.stats["faults"] == 4
        assert (await post(client, f"{server.url}/generate", {"input_ids": PROMPT}))[0] == 200

    run(scenario)
