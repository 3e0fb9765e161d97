"""A generator for SGLang's native ``/generate`` API (the API slime drives)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any

from ..sample import Sample
from ._http import HttpGenerator, decode_routes, field, numbers
from .base import EngineOptions, EngineProtocolError, Reward, Segment, SegmentRequest, describe

__all__ = ["SGLangGenerator", "parse_generate_answer"]

_log = logging.getLogger("straw.rollout.generators")


class SGLangGenerator(HttpGenerator):
    """A :class:`~straw.rollout.hooks.Generator` for SGLang's native ``/generate`` API.

    Each sample is one request ``{rid, input_ids, sampling_params: {**sampling_params,
    max_new_tokens, temperature, sampling_seed?}, return_logprob: true,
    return_routed_experts?, routed_experts_start_len?}``. From the answer,
    ``meta_info.output_token_logprobs`` gives the tokens and log-probs,
    ``meta_info.finish_reason.type`` the status, ``meta_info.weight_version`` the version
    appended to ``weight_versions`` (the call's ``weight_version`` when the server reports
    none; start SGLang with a numeric ``--weight-version`` and update it with the weights)
    and ``meta_info.routed_experts`` (base64 int32) the routes when
    ``routed_experts=(num_layers, top_k)`` is set. ``abort()`` posts ``/abort_request`` for
    each request in flight; with ``abort_all=True`` one request aborts everything the server
    runs (as slime does when it owns the servers).
    """

    endpoint = "/generate"

    def __init__(
        self,
        url: str,
        *,
        max_new_tokens: int,
        reward: Reward | None = None,
        tokenize: Callable[[Any], Any] | None = None,
        temperature: float = 1.0,
        seed: int | Callable[[Sample], int] | None = None,
        sampling_params: Mapping[str, Any] | None = None,
        routed_experts: tuple[int, int] | None = None,
        abort_all: bool = False,
        options: EngineOptions | None = None,
    ) -> None:
        super().__init__(
            url,
            max_new_tokens=max_new_tokens,
            reward=reward,
            tokenize=tokenize,
            seed=seed,
            routed_experts=routed_experts,
            options=options,
        )
        self.temperature = temperature
        self.sampling_params = dict(sampling_params or {})
        self.abort_all = abort_all

    def payload(self, request: SegmentRequest) -> dict[str, Any]:
        """The JSON body of ``request``'s ``/generate`` call."""
        params: dict[str, Any] = {
            **self.sampling_params,
            "max_new_tokens": request.max_new_tokens,
            "temperature": self.temperature,
        }
        if request.seed is not None:
            params["sampling_seed"] = request.seed
        body: dict[str, Any] = {
            "rid": request.request_id,
            "input_ids": request.tokens,
            "sampling_params": params,
            "return_logprob": True,
        }
        if self.routed_experts is not None:
            body["return_routed_experts"] = True
            body["routed_experts_start_len"] = request.routes_start
        return body

    async def generate_segment(self, request: SegmentRequest, partial: Segment) -> Segment:
        answer = await self.post_json(self.endpoint, self.payload(request))
        return parse_generate_answer(self.where, answer)

    async def abort_requests(self, request_ids: list[str]) -> bool:
        bodies: list[dict[str, Any]]
        if self.abort_all:
            bodies = [{"abort_all": True}]
        else:
            bodies = [{"rid": rid, "abort_all": False} for rid in request_ids]
        results = await asyncio.gather(
            *(self.post("/abort_request", body, control=True) for body in bodies), return_exceptions=True
        )
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed and len(failed) == len(results):
            raise failed[0]
        for error in failed:  # the others were asked; these end by cancellation after abort_timeout
            _log.warning("abort_request to %s failed: %s", self.url, describe(error))
        return True


def parse_generate_answer(url: str, answer: Any) -> Segment:
    """The segment in a ``/generate`` answer (see :class:`SGLangGenerator`)."""
    meta = field(url, answer, "meta_info", dict)
    finish = field(url, meta, "finish_reason", dict)
    kind = finish.get("type")
    if kind not in ("stop", "length", "abort"):
        raise EngineProtocolError(f"{url}: unknown finish_reason type {kind!r}")
    output_ids = numbers(url, answer.get("output_ids", []), "output_ids", int)
    pairs = meta.get("output_token_logprobs")
    if pairs is None:
        if output_ids:
            raise EngineProtocolError(f"{url}: output_ids without meta_info.output_token_logprobs")
        pairs = []
    if not isinstance(pairs, list) or any(not isinstance(p, list) or len(p) < 2 for p in pairs):
        raise EngineProtocolError(f"{url}: output_token_logprobs must be [logprob, token_id, ...] entries")
    log_probs = numbers(url, [p[0] for p in pairs], "output_token_logprobs log-probs", float)
    tokens = numbers(url, [p[1] for p in pairs], "output_token_logprobs token ids", int)
    if "output_ids" in answer and output_ids != tokens:
        raise EngineProtocolError(f"{url}: output_ids disagree with output_token_logprobs")
    text = answer.get("text")
    version = meta.get("weight_version")
    routes = meta.get("routed_experts")
    return Segment(
        tokens=tokens,
        log_probs=log_probs,
        text=text if isinstance(text, str) else "",
        finish=kind,
        weight_version=None if version is None else str(version),
        routes=None if routes is None else decode_routes(url, routes, npy=False),
    )
