"""A generator for OpenAI-compatible ``/v1/completions`` servers (vLLM, SGLang), token ids in."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ..sample import Sample
from ._http import TRANSIENT, HttpGenerator, check_status, decode_json, decode_routes, field, numbers, quote
from .base import (
    EngineOptions,
    EngineProtocolError,
    EngineRequestError,
    RetryableError,
    Reward,
    Segment,
    SegmentRequest,
)

__all__ = ["OpenAICompletionsGenerator", "parse_completion_answer"]

#: ``logprobs.tokens`` entries spell token ids like this with ``return_tokens_as_token_ids``.
TOKEN_ID_PREFIX = "token_id:"


class OpenAICompletionsGenerator(HttpGenerator):
    """A :class:`~straw.rollout.hooks.Generator` for OpenAI-compatible ``/v1/completions``.

    Each sample is one request ``{**extra_body, model?, prompt: token ids, max_tokens,
    temperature, seed?, logprobs: 1, return_token_ids: true, return_tokens_as_token_ids:
    true, stream, stream_options?, routed_experts_prompt_start?}``. Token ids come from the
    choice's ``token_ids`` (vLLM's ``return_token_ids``), else from ``logprobs.tokens``
    spelled ``"token_id:<id>"``; log-probs from ``logprobs.token_logprobs``; the status from
    ``finish_reason``. These servers report no weight version, so the call's
    ``weight_version`` is recorded. ``abort()`` cancels the requests in flight (closing the
    connection makes the server drop them); with ``stream=True`` the tokens received so far are
    kept. Routed experts (vLLM's ``routed_experts``, base64 ``.npy``) need ``stream=False``.
    """

    endpoint = "/v1/completions"

    def __init__(
        self,
        url: str,
        *,
        max_new_tokens: int,
        model: str | None = None,
        reward: Reward | None = None,
        tokenize: Callable[[Any], Any] | None = None,
        temperature: float = 1.0,
        seed: int | Callable[[Sample], int] | None = None,
        extra_body: Mapping[str, Any] | None = None,
        stream: bool = True,
        routed_experts: tuple[int, int] | None = None,
        options: EngineOptions | None = None,
    ) -> None:
        if stream and routed_experts is not None:
            raise ValueError(
                "Routed experts come only in whole answers: use stream=False with routed_experts"
            )
        super().__init__(
            url,
            max_new_tokens=max_new_tokens,
            reward=reward,
            tokenize=tokenize,
            seed=seed,
            routed_experts=routed_experts,
            options=options,
        )
        self.model = model
        self.temperature = temperature
        self.extra_body = dict(extra_body or {})
        self.stream = stream

    def payload(self, request: SegmentRequest) -> dict[str, Any]:
        """The JSON body of ``request``'s ``/v1/completions`` call."""
        body: dict[str, Any] = {
            **self.extra_body,
            "prompt": request.tokens,
            "max_tokens": request.max_new_tokens,
            "temperature": self.temperature,
            # 1, not 0: some servers treat logprobs=0 as "none"; the sampled token's log-prob is
            # always in token_logprobs.
            "logprobs": 1,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            "stream": self.stream,
            "request_id": request.request_id,
        }
        if self.model is not None:
            body["model"] = self.model
        if request.seed is not None:
            body["seed"] = request.seed
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        if self.routed_experts is not None:
            body["routed_experts_prompt_start"] = request.routes_start
        return body

    async def generate_segment(self, request: SegmentRequest, partial: Segment) -> Segment:
        if not self.stream:
            answer = await self.post_json(self.endpoint, self.payload(request))
            return parse_completion_answer(self.where, answer, want_routes=self.routed_experts is not None)
        try:
            async with self.session.post(self.where, json=self.payload(request)) as response:
                if response.status != 200:
                    check_status(self.where, response.status, await response.read())
                await _read_events(self.where, response, partial)
        except TRANSIENT as error:
            raise RetryableError(str(error)) from error
        if partial.finish is None:
            raise RetryableError(f"{self.where}: the stream ended before a finish_reason")
        return partial

    # abort_requests keeps the default (False): the base cancels the requests, which closes
    # their connections, which is how OpenAI-compatible servers are told to stop.


def parse_completion_answer(url: str, answer: Any, *, want_routes: bool) -> Segment:
    """The segment in a whole ``/v1/completions`` answer (one choice)."""
    choices = field(url, answer, "choices", list)
    if len(choices) != 1:
        raise EngineProtocolError(f"{url}: expected one choice, got {len(choices)}")
    segment = Segment()
    add_choice(url, choices[0], segment)
    if segment.finish is None:
        raise EngineProtocolError(f"{url}: the choice has no finish_reason")
    routes = choices[0].get("routed_experts")
    if want_routes and routes is not None:
        segment.routes = decode_routes(url, routes, npy=True)
    return segment


def add_choice(url: str, choice: Any, segment: Segment) -> None:
    """Append one (possibly streamed) choice's tokens, log-probs, text and finish reason."""
    if not isinstance(choice, dict):
        raise EngineProtocolError(f"{url}: a choice must be an object")
    logprobs = choice.get("logprobs")
    if choice.get("token_ids") is not None:
        tokens = numbers(url, choice["token_ids"], "token_ids", int)
    elif logprobs is not None:
        tokens = [_token_id(url, name) for name in field(url, logprobs, "tokens", list)]
    else:
        tokens = []
    if tokens and logprobs is None:
        raise EngineProtocolError(f"{url}: tokens without logprobs (send logprobs)")
    token_logprobs = field(url, logprobs, "token_logprobs", list) if logprobs is not None else []
    log_probs = numbers(url, token_logprobs, "token_logprobs", float)
    if len(log_probs) != len(tokens):
        raise EngineProtocolError(f"{url}: {len(tokens)} token ids but {len(log_probs)} token_logprobs")
    finish = choice.get("finish_reason")
    if finish is not None and finish not in ("stop", "length", "abort"):
        raise EngineProtocolError(f"{url}: unknown finish_reason {finish!r}")
    # Everything is checked; now change the segment (a stream cut here keeps whole chunks only).
    segment.tokens.extend(tokens)
    segment.log_probs.extend(log_probs)
    text = choice.get("text")
    segment.text += text if isinstance(text, str) else ""
    if finish is not None:
        segment.finish = finish


def _token_id(url: str, name: Any) -> int:
    text = name if isinstance(name, str) else ""
    digits = text[len(TOKEN_ID_PREFIX) :]
    if not text.startswith(TOKEN_ID_PREFIX) or not digits.lstrip("-").isdigit():
        raise EngineProtocolError(
            f"{url}: no token ids in the answer (send return_token_ids or "
            f"return_tokens_as_token_ids), got {name!r}"
        )
    return int(digits)


async def _read_events(url: str, response: Any, segment: Segment) -> None:
    """Read server-sent events into ``segment`` until ``data: [DONE]`` (or the stream ends)."""
    async for raw in response.content:
        line = raw.strip()
        if not line or line.startswith(b":"):
            continue
        if not line.startswith(b"data:"):
            raise EngineProtocolError(f"{url}: unexpected stream line {quote(line)!r}")
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        chunk = decode_json(url, data)
        if isinstance(chunk, dict) and "error" in chunk:
            raise EngineRequestError(f"{url} failed while streaming: {chunk['error']}")
        for choice in field(url, chunk, "choices", list):
            add_choice(url, choice, segment)
