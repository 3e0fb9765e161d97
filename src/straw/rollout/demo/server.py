"""A loopback HTTP inference server for the demo policy, speaking SGLang's and vLLM's APIs.

:class:`PolicyServer` serves a :class:`~straw.rollout.demo.policy.DemoPolicy` on 127.0.0.1
(never another address) through two wire protocols, so the engine generators of
``straw.rollout.generators`` are tested against real HTTP exactly as they talk to real
engines. Requests share one engine loop that advances every running request by one token per
batched forward pass (continuous batching); an abort or a weight update therefore takes
effect between two tokens, and an aborted request answers at once with what it generated.

SGLang native API (the fields honoured; others are ignored unless listed as refused):

- ``POST /generate`` with ``input_ids`` (one prompt as a list of token ids), optional ``rid``,
  ``sampling_params`` {``max_new_tokens`` (default: up to the position limit), ``temperature``
  (1.0), ``sampling_seed``, ``stop_token_ids``, ``ignore_eos``; ``top_p`` other than 1 and
  ``top_k`` other than -1/0 are refused}, ``return_logprob``, ``return_routed_experts``,
  ``routed_experts_start_len``. ``text`` prompts, batches and ``stream`` are refused (400).
  The answer is ``{text, output_ids, meta_info}``; ``meta_info`` holds ``id``,
  ``finish_reason`` (``{"type": "stop", "matched": id}``, ``{"type": "length", "length":
  n}`` or ``{"type": "abort", "message": ...}``), ``prompt_tokens``, ``completion_tokens``,
  ``cached_tokens`` (0), ``weight_version``, ``e2e_latency``, with ``return_logprob``
  ``output_token_logprobs`` as ``[logprob, token_id, null]`` triples, and with
  ``return_routed_experts`` ``routed_experts``: base64 of the int32 routes of positions
  ``[routed_experts_start_len, prompt + output - 1)``, shape ``[rows, layers, top_k]``.
- ``POST /abort_request`` ``{"rid": ..., "abort_all": bool}``: the named (or every) running
  request stops and answers with its partial output and finish type ``abort``.
- ``GET /get_weight_version``, ``GET /get_model_info`` (``weight_version``, ``model_path``,
  ``is_generation``), ``POST /update_weight_version`` ``{"new_version",
  "abort_all_requests"}``, ``POST /update_weights_from_disk`` ``{"model_path",
  "weight_version"}`` (a ``torch.save``-d dict of tensors; running requests are aborted
  first), ``GET /health``, ``GET /health_generate``. Errors are
  ``{"object": "error", "message", "type", "code"}``.

OpenAI-compatible API, as vLLM serves it:

- ``POST /v1/completions`` with ``prompt`` (one list of token ids), optional ``model`` (must
  name the served model), ``max_tokens`` (16), ``temperature`` (1.0), ``seed``, ``logprobs``
  (k: ``token_logprobs`` and the ``top_logprobs`` of the k best tokens), ``stop_token_ids``,
  ``ignore_eos``, ``return_token_ids`` (``token_ids`` and ``prompt_token_ids`` in the
  choice), ``return_tokens_as_token_ids`` (``tokens`` as ``"token_id:<id>"``),
  ``routed_experts_prompt_start`` and ``stream`` (server-sent events ending in ``data:
  [DONE]``; ``stream_options.include_usage``). ``n`` other than 1, text prompts and batches
  are refused. A choice has ``index``, ``text``, ``logprobs`` (``text_offset``,
  ``token_logprobs``, ``tokens``, ``top_logprobs``), ``finish_reason`` (``stop``, ``length``
  or ``abort``), ``stop_reason`` and, when not streaming, ``routed_experts`` (base64 of
  ``.npy`` bytes, uint8, shape ``[prompt + output - 1 - start, layers, top_k]``). A client
  that disconnects aborts its request, as vLLM does. Errors are ``{"error": {"message",
  "type", "param", "code"}}``. ``GET /v1/models`` lists the model.

For tests the server can park requests once they have generated a given number of tokens
(:meth:`PolicyServer.park_at`, :meth:`PolicyServer.wait_parked`) and inject faults into the
next generation requests (:meth:`PolicyServer.inject`): refusal (503), an error after
generating (500), malformed JSON, or a dropped connection.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from aiohttp import web

from . import task
from .engine import BatchingEngine, EngineBusy, Job
from .policy import Decoding, DemoPolicy

__all__ = ["FAULTS", "PolicyServer"]

LOOPBACK = "127.0.0.1"

#: Faults :meth:`PolicyServer.inject` can apply to the next generation requests.
FAULTS = frozenset({"unavailable", "error_after_generate", "malformed_json", "disconnect"})

#: Request bodies remembered for tests (the most recent ones).
_SEEN_MAX = 1000


class _BadRequest(Exception):
    """A request the server refuses (HTTP 400, or the given status)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class PolicyServer:
    """Serves one policy over HTTP on 127.0.0.1 (see the module docstring for the APIs).

    Use ``async with PolicyServer(policy) as server:`` (or ``await start()`` / ``await
    close()``) inside a running event loop; ``server.url`` is the base URL. ``port=0`` picks a
    free port. At most ``max_running`` generations run at once; more are refused with 503.
    """

    def __init__(
        self,
        policy: DemoPolicy,
        *,
        weight_version: str = "0",
        model: str = "straw-demo",
        port: int = 0,
        max_running: int = 256,
    ) -> None:
        self.engine = BatchingEngine(policy, weight_version=weight_version, max_running=max_running)
        self.model = model
        self._port = port
        self._runner: web.AppRunner | None = None
        self._faults: deque[str] = deque()
        #: Bodies of the most recent generation requests, oldest first (for tests).
        self.seen: deque[tuple[str, dict[str, Any]]] = deque(maxlen=_SEEN_MAX)
        #: Counters: ``generate`` and ``completions`` requests, injected ``faults``.
        self.stats: dict[str, int] = {"generate": 0, "completions": 0, "faults": 0}

    # ------------------------------------------------------------------ lifecycle

    @property
    def policy(self) -> DemoPolicy:
        return self.engine.policy

    @property
    def weight_version(self) -> str:
        return self.engine.weight_version

    @property
    def url(self) -> str:
        if self._runner is None or not self._runner.addresses:
            raise RuntimeError("PolicyServer is not started")
        port = self._runner.addresses[0][1]
        return f"http://{LOOPBACK}:{port}"

    async def start(self) -> str:
        """Listen on 127.0.0.1 and start the engine loop; returns the base URL."""
        if self._runner is not None:
            raise RuntimeError("PolicyServer is already started")
        await self.engine.start()
        app = web.Application(client_max_size=16 * 1024 * 1024)
        app.add_routes(self._routes())
        # handler_cancellation: a client that disconnects cancels its handler, which aborts the
        # generation (what SGLang and vLLM do when a caller goes away).
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, LOOPBACK, self._port).start()
        return self.url

    async def close(self) -> None:
        """Abort every request, stop listening and stop the engine loop (idempotent)."""
        if self._runner is None:
            return
        await self.engine.close()
        await self._runner.cleanup()
        self._runner = None

    async def __aenter__(self) -> PolicyServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ controls

    async def update_weights(self, weights: Mapping[str, torch.Tensor], version: str) -> int:
        """Abort running requests, load ``weights`` between two steps, serve as ``version``."""
        return await self.engine.update_weights(weights, version)

    def park_at(self, tokens: int | None) -> None:
        """Stop advancing requests once they have ``tokens`` new tokens (None: run freely)."""
        self.engine.park_at(tokens)

    async def wait_parked(self, count: int, *, timeout: float = 30.0) -> None:
        """Wait until ``count`` requests are parked (see :meth:`park_at`)."""
        await self.engine.wait_parked(count, timeout=timeout)

    async def wait_idle(self, *, timeout: float = 30.0) -> None:
        """Wait until no request is running (every one finished or aborted)."""
        await self.engine.wait_idle(timeout=timeout)

    def inject(self, fault: str, count: int = 1) -> None:
        """Apply ``fault`` (one of :data:`FAULTS`) to the next ``count`` generation requests."""
        if fault not in FAULTS:
            raise ValueError(f"Unknown fault {fault!r}; expected one of {sorted(FAULTS)}")
        self._faults.extend([fault] * count)

    @property
    def running(self) -> int:
        return self.engine.running

    def _submit(self, decoding: Decoding, rid: str | None) -> Job:
        try:
            return self.engine.submit(decoding, rid)
        except EngineBusy as error:
            raise _BadRequest(str(error), 503) from None
        except ValueError as error:
            raise _BadRequest(str(error)) from None

    # ------------------------------------------------------------------ routes

    def _routes(self) -> list[web.RouteDef]:
        return [
            web.post("/generate", self._guard(self._generate, native=True)),
            web.put("/generate", self._guard(self._generate, native=True)),
            web.post("/abort_request", self._guard(self._abort_request, native=True)),
            web.get("/get_weight_version", self._guard(self._get_weight_version, native=True)),
            web.get("/get_model_info", self._guard(self._get_model_info, native=True)),
            web.post("/update_weight_version", self._guard(self._update_weight_version, native=True)),
            web.post("/update_weights_from_disk", self._guard(self._update_from_disk, native=True)),
            web.get("/health", self._health),
            web.get("/health_generate", self._health),
            web.post("/v1/completions", self._guard(self._completions, native=False)),
            web.get("/v1/models", self._guard(self._models, native=False)),
        ]

    def _guard(
        self, handler: Callable[[web.Request], Awaitable[web.StreamResponse]], *, native: bool
    ) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        """Turn refusals into the API's error JSON (SGLang's or OpenAI's shape)."""

        async def guarded(request: web.Request) -> web.StreamResponse:
            try:
                return await handler(request)
            except _BadRequest as error:
                return _error(str(error), error.status, native=native)

        return guarded

    async def _health(self, request: web.Request) -> web.StreamResponse:
        return web.Response(status=200)

    async def _get_weight_version(self, request: web.Request) -> web.StreamResponse:
        return web.json_response({"weight_version": self.weight_version})

    async def _get_model_info(self, request: web.Request) -> web.StreamResponse:
        return web.json_response(
            {
                "model_path": self.model,
                "tokenizer_path": None,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": self.weight_version,
            }
        )

    async def _update_weight_version(self, request: web.Request) -> web.StreamResponse:
        body = await _json_body(request)
        version = body.get("new_version")
        if not isinstance(version, str):
            raise _BadRequest("new_version must be a string")
        if body.get("abort_all_requests"):
            self.engine.abort(lambda job: True)
        self.engine.weight_version = version
        return web.json_response(
            {"success": True, "message": f"Weight version updated to {version}", "new_version": version}
        )

    async def _update_from_disk(self, request: web.Request) -> web.StreamResponse:
        body = await _json_body(request)
        path, version = body.get("model_path"), body.get("weight_version")
        if not isinstance(path, str) or (version is not None and not isinstance(version, str)):
            raise _BadRequest("model_path must be a string and weight_version a string or null")
        try:
            weights = torch.load(Path(path), map_location="cpu", weights_only=True)
            aborted = await self.update_weights(weights, version or self.weight_version)
        except (OSError, ValueError, TypeError, RuntimeError) as error:
            return web.json_response(
                {"success": False, "message": str(error), "num_paused_requests": 0}, status=400
            )
        return web.json_response(
            {"success": True, "message": f"Loaded {path}", "num_paused_requests": aborted}, status=200
        )

    async def _abort_request(self, request: web.Request) -> web.StreamResponse:
        body = await _json_body(request)
        rid = body.get("rid")
        if body.get("abort_all"):
            self.engine.abort(lambda job: True)
        elif isinstance(rid, str):
            self.engine.abort(lambda job: job.id == rid)
        elif isinstance(rid, list) and all(isinstance(x, str) for x in rid):
            wanted = set(rid)
            self.engine.abort(lambda job: job.id in wanted)
        else:
            raise _BadRequest("abort_request needs rid (a string or list of strings) or abort_all")
        return web.Response(status=200)

    async def _models(self, request: web.Request) -> web.StreamResponse:
        card = {
            "id": self.model,
            "object": "model",
            "created": 0,
            "owned_by": "straw",
            "root": self.model,
            "max_model_len": self.policy.config.max_positions,
        }
        return web.json_response({"object": "list", "data": [card]})

    # ------------------------------------------------------------------ generation

    async def _fault(self, request: web.Request, kind: str, body: dict[str, Any]) -> str | None:
        """Take the next injected fault, if any; ``unavailable`` refuses before generating."""
        self.seen.append((kind, body))
        self.stats[kind] += 1
        if not self._faults:
            return None
        fault = self._faults.popleft()
        self.stats["faults"] += 1
        if fault == "unavailable":
            raise _BadRequest("Injected fault: server unavailable", 503)
        return fault

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await _json_body(request)
        fault = await self._fault(request, "generate", body)
        decoding, start = self._native_decoding(body)
        r = self._submit(decoding, _optional_str(body, "rid"))
        await self.engine.follow(r)
        out = _native_answer(self, r, body, start)
        return _faulty(request, fault) or web.json_response(out)

    def _native_decoding(self, body: dict[str, Any]) -> tuple[Decoding, int]:
        for refused in ("text", "input_embeds", "image_data"):
            if body.get(refused) is not None:
                raise _BadRequest(f"This server takes input_ids only, not {refused}")
        if body.get("stream"):
            raise _BadRequest("stream is not supported by this server's /generate")
        tokens = _token_list(body.get("input_ids"), "input_ids", self.policy)
        params = body.get("sampling_params") or {}
        if not isinstance(params, dict):
            raise _BadRequest("sampling_params must be an object")
        _refuse_nucleus(params.get("top_p"), params.get("top_k"))
        start = _int_field(body, "routed_experts_start_len", 0)
        seed = params.get("sampling_seed")
        return (
            _decoding(
                self.policy,
                tokens,
                max_new_tokens=params.get("max_new_tokens"),
                temperature=params.get("temperature", 1.0),
                seed=seed,
                stop_token_ids=params.get("stop_token_ids"),
                ignore_eos=bool(params.get("ignore_eos", False)),
                routes_start=start if body.get("return_routed_experts") else 0,
            ),
            start,
        )

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await _json_body(request)
        fault = await self._fault(request, "completions", body)
        model = body.get("model")
        if model is not None and model != self.model:
            raise _BadRequest(f"The model `{model}` does not exist.", 404)
        if body.get("n", 1) != 1 or body.get("use_beam_search"):
            raise _BadRequest("This server generates one choice per request (n=1, no beam search)")
        prompt = body.get("prompt")
        if not isinstance(prompt, list) or (prompt and isinstance(prompt[0], list)):
            raise _BadRequest(
                "prompt must be one list of token ids (text prompts and batches are not served)"
            )
        tokens = _token_list(prompt, "prompt", self.policy)
        _refuse_nucleus(body.get("top_p"), body.get("top_k"))
        top = body.get("logprobs")
        if top is not None and (isinstance(top, bool) or not isinstance(top, int) or top < 0):
            raise _BadRequest("logprobs must be an integer >= 0")
        start = _int_field(body, "routed_experts_prompt_start", 0)
        decoding = _decoding(
            self.policy,
            tokens,
            max_new_tokens=body.get("max_tokens", 16),
            temperature=body.get("temperature", 1.0),
            seed=body.get("seed"),
            stop_token_ids=body.get("stop_token_ids"),
            ignore_eos=bool(body.get("ignore_eos", False)),
            routes_start=start,
            top_log_probs=min(top or 0, self.policy.config.vocab_size),
        )
        r = self._submit(decoding, _optional_str(body, "request_id"))
        if body.get("stream"):
            if fault == "error_after_generate":
                await self.engine.follow(r)
                return _error("Injected fault: internal error after generating", 500, native=False)
            return await _stream_completion(self, request, r, body, fault)
        await self.engine.follow(r)
        out = _completion_answer(self, r, body, start)
        return _faulty(request, fault) or web.json_response(out)


# ---------------------------------------------------------------------- request parsing


async def _json_body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise _BadRequest(f"Request body is not valid JSON: {error}") from None
    if not isinstance(body, dict):
        raise _BadRequest("Request body must be a JSON object")
    return body


def _optional_str(body: Mapping[str, Any], key: str) -> str | None:
    value = body.get(key)
    if value is not None and not isinstance(value, str):
        raise _BadRequest(f"{key} must be a string")
    return value


def _int_field(body: Mapping[str, Any], key: str, default: int) -> int:
    value = body.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _BadRequest(f"{key} must be an integer >= 0")
    return value


def _token_list(value: Any, name: str, policy: DemoPolicy) -> list[int]:
    if not isinstance(value, list) or not value:
        raise _BadRequest(f"{name} must be a non-empty list of token ids")
    if any(isinstance(v, bool) or not isinstance(v, int) for v in value):
        raise _BadRequest(f"{name} must hold integers only (batched prompts are not served)")
    vocab = policy.config.vocab_size
    if any(not 0 <= v < vocab for v in value):
        raise _BadRequest(f"{name} has token ids outside [0, {vocab})")
    if len(value) >= policy.config.max_positions:
        raise _BadRequest(f"{name} has {len(value)} tokens; the model holds {policy.config.max_positions}")
    return list(value)


def _refuse_nucleus(top_p: Any, top_k: Any) -> None:
    """Refuse sampling filters this engine does not implement, rather than ignore them."""
    if top_p is not None and top_p != 1 and top_p != 1.0:
        raise _BadRequest(f"top_p={top_p} is not supported (only 1.0)")
    if top_k is not None and top_k not in (-1, 0):
        raise _BadRequest(f"top_k={top_k} is not supported (only -1 or 0)")


def _decoding(
    policy: DemoPolicy,
    tokens: list[int],
    *,
    max_new_tokens: Any,
    temperature: Any,
    seed: Any,
    stop_token_ids: Any,
    ignore_eos: bool,
    routes_start: int,
    top_log_probs: int = 0,
) -> Decoding:
    room = policy.config.max_positions - len(tokens)
    if max_new_tokens is None:
        max_new_tokens = room
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise _BadRequest("max_new_tokens / max_tokens must be an integer >= 0")
    if temperature is None:
        temperature = 1.0
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise _BadRequest("temperature must be a number")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise _BadRequest("the sampling seed must be an integer")
    stops = set() if ignore_eos else {task.EOS}
    if stop_token_ids is not None:
        if not isinstance(stop_token_ids, list) or any(not isinstance(t, int) for t in stop_token_ids):
            raise _BadRequest("stop_token_ids must be a list of integers")
        stops |= set(stop_token_ids)
    if routes_start > len(tokens):
        raise _BadRequest(
            f"the routed-experts start ({routes_start}) exceeds the prompt ({len(tokens)} tokens)"
        )
    try:
        return Decoding(
            policy,
            tokens,
            max_new_tokens=min(max_new_tokens, room),
            temperature=float(temperature),
            seed=seed,
            stop_tokens=sorted(stops),
            routes_start=routes_start,
            top_log_probs=top_log_probs,
        )
    except ValueError as error:
        raise _BadRequest(str(error)) from None


# ---------------------------------------------------------------------- answers


def _error(message: str, status: int, *, native: bool) -> web.Response:
    if native:
        body: dict[str, Any] = {
            "object": "error",
            "message": message,
            "type": _reason(status),
            "code": status,
        }
    else:
        kind = "invalid_request_error" if status < 500 else "server_error"
        body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return web.json_response(body, status=status)


def _reason(status: int) -> str:
    return {400: "BadRequest", 404: "NotFound", 503: "ServiceUnavailable"}.get(status, "Error")


def _faulty(request: web.Request, fault: str | None) -> web.StreamResponse | None:
    """The response an injected post-generation fault replaces the real one with."""
    if fault == "error_after_generate":
        return _error("Injected fault: internal error after generating", 500, native=True)
    if fault == "malformed_json":
        return web.Response(status=200, text='{"text": "truncated', content_type="application/json")
    if fault == "disconnect":
        if request.transport is not None:
            request.transport.abort()
        return web.Response(status=200)
    return None


def _routes_of(r: Job) -> np.ndarray[Any, Any]:
    routes = r.decoding.result().routes
    if routes is None:
        return np.zeros((0, 0, 0), dtype=np.int32)
    return routes.numpy().astype(np.int32)


def _native_finish(r: Job) -> dict[str, Any]:
    d = r.decoding
    if d.finish == "stop":
        return {"type": "stop", "matched": d.new_tokens[-1]}
    if d.finish == "abort":
        return {"type": "abort", "message": "Abort request"}
    return {"type": "length", "length": len(d.new_tokens)}


def _native_answer(server: PolicyServer, r: Job, body: Mapping[str, Any], start: int) -> dict[str, Any]:
    d = r.decoding
    meta: dict[str, Any] = {
        "id": r.id,
        "finish_reason": _native_finish(r),
        "prompt_tokens": d.prefix_length,
        "completion_tokens": len(d.new_tokens),
        "cached_tokens": 0,
        "weight_version": r.version or server.weight_version,
        "e2e_latency": time.monotonic() - r.created,
    }
    if body.get("return_logprob"):
        meta["output_token_logprobs"] = [
            [lp, t, None] for lp, t in zip(d.log_probs, d.new_tokens, strict=True)
        ]
        meta["input_token_logprobs"] = []
    if body.get("return_routed_experts") and d.new_tokens:
        meta["routed_experts"] = base64.b64encode(_routes_of(r).tobytes()).decode("ascii")
        meta["routed_experts_start_len"] = start
    return {
        "text": "".join(task.piece(t) for t in d.new_tokens),
        "output_ids": list(d.new_tokens),
        "meta_info": meta,
    }


def _openai_finish(r: Job) -> tuple[str, int | None]:
    d = r.decoding
    if d.finish == "stop":
        return "stop", d.new_tokens[-1]
    return ("abort" if d.finish == "abort" else "length"), None


def _logprobs_block(
    d: Decoding, first: int, body: Mapping[str, Any], text_before: str
) -> dict[str, Any] | None:
    """The ``logprobs`` object for new tokens ``first..`` (None when not asked for)."""
    if body.get("logprobs") is None:
        return None
    as_ids = bool(body.get("return_tokens_as_token_ids"))

    def name(token: int) -> str:
        return f"token_id:{token}" if as_ids else task.token_name(token)

    tokens = d.new_tokens[first:]
    offsets, text = [], text_before
    for t in tokens:
        offsets.append(len(text))
        text += task.piece(t)
    top: list[dict[str, float] | None] = [
        {name(i): v for i, v in d.top[first + k]} if d.top_log_probs else None for k in range(len(tokens))
    ]
    return {
        "text_offset": offsets,
        "token_logprobs": d.log_probs[first:],
        "tokens": [name(t) for t in tokens],
        "top_logprobs": top,
    }


def _usage(d: Decoding) -> dict[str, int]:
    return {
        "prompt_tokens": d.prefix_length,
        "completion_tokens": len(d.new_tokens),
        "total_tokens": d.prefix_length + len(d.new_tokens),
    }


def _completion_answer(server: PolicyServer, r: Job, body: Mapping[str, Any], start: int) -> dict[str, Any]:
    d = r.decoding
    finish, stop_reason = _openai_finish(r)
    choice: dict[str, Any] = {
        "index": 0,
        "text": "".join(task.piece(t) for t in d.new_tokens),
        "logprobs": _logprobs_block(d, 0, body, ""),
        "finish_reason": finish,
        "stop_reason": stop_reason,
    }
    if body.get("return_token_ids"):
        choice["token_ids"] = list(d.new_tokens)
        choice["prompt_token_ids"] = d.sequence[: d.prefix_length]
    if d.new_tokens:
        buffer = io.BytesIO()
        np.save(buffer, _routes_of(r).astype(np.uint8), allow_pickle=False)
        choice["routed_experts"] = base64.b64encode(buffer.getvalue()).decode("ascii")
    return {
        "id": f"cmpl-{r.id}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": server.model,
        "choices": [choice],
        "usage": _usage(d),
    }


async def _stream_completion(
    server: PolicyServer, request: web.Request, r: Job, body: Mapping[str, Any], fault: str | None
) -> web.StreamResponse:
    """Server-sent events: one chunk per new token, a final chunk with the finish reason.

    An injected ``malformed_json`` fault sends a broken chunk first; ``disconnect`` drops the
    connection after the first chunk (a stream cut mid-generation).
    """
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    sent, text = 0, ""
    base = {
        "id": f"cmpl-{r.id}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": server.model,
    }
    try:
        while True:
            r.progress.clear()
            # The engine thread appends to the decoding during a step; the lock it holds then
            # makes this snapshot consistent (tokens, log-probs and finish reason together).
            async with server.engine.consistent():
                finished = r.finished
                choice = _stream_choice(r, body, sent, text, finished)
            if choice is not None:
                text += choice["text"]
                sent += len(choice.pop("_tokens"))
                if fault == "malformed_json":
                    await response.write(b'data: {"choices": [\n\n')
                await _send_event(response, {**base, "choices": [choice]})
                if fault == "disconnect":
                    server.engine.abort(lambda job: job is r)
                    if request.transport is not None:
                        request.transport.abort()
                    return response
            if finished:
                break
            await r.progress.wait()
        options = body.get("stream_options") or {}
        if isinstance(options, dict) and options.get("include_usage"):
            await _send_event(response, {**base, "choices": [], "usage": _usage(r.decoding)})
        await response.write(b"data: [DONE]\n\n")
    except asyncio.CancelledError:
        server.engine.abort(lambda job: job is r)
        raise
    except ConnectionResetError:  # the client went away mid-stream: stop generating for it
        server.engine.abort(lambda job: job is r)
        return response
    await response.write_eof()
    return response


def _stream_choice(
    r: Job, body: Mapping[str, Any], sent: int, text: str, finished: bool
) -> dict[str, Any] | None:
    """The next chunk's choice (new tokens since ``sent``), or None when there is nothing new."""
    d = r.decoding
    new = d.new_tokens[sent:]
    if not new and not finished:
        return None
    finish = _openai_finish(r) if finished else (None, None)
    choice: dict[str, Any] = {
        "index": 0,
        "text": "".join(task.piece(t) for t in new),
        "logprobs": _logprobs_block(d, sent, body, text),
        "finish_reason": finish[0],
        "stop_reason": finish[1],
        "_tokens": new,
    }
    if body.get("return_token_ids"):
        choice["token_ids"] = list(new)
        if sent == 0:
            choice["prompt_token_ids"] = d.sequence[: d.prefix_length]
    return choice


async def _send_event(response: web.StreamResponse, payload: Mapping[str, Any]) -> None:
    await response.write(b"data: " + json.dumps(payload).encode() + b"\n\n")
