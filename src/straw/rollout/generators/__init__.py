"""Generators for serving engines over HTTP: SGLang's native API and OpenAI-compatible servers.

:class:`SGLangGenerator` drives SGLang's ``/generate`` (token ids in; output ids, per-token
log-probs, the weight version and optionally routed experts out) and aborts through
``/abort_request``, which makes in-flight requests answer at once with their partial output.
:class:`OpenAICompletionsGenerator` drives ``/v1/completions`` as vLLM and SGLang serve it
(token-id prompts, ``return_token_ids``, ``logprobs``); it aborts by cancelling its in-flight
requests (the server aborts a request whose client went away). Streaming (the default) keeps
the tokens received before an abort; without streaming an aborted request keeps nothing of
that attempt, but it can return routed experts (vLLM sends them only in whole answers).

Both implement the :class:`straw.rollout.hooks.Generator` protocol (docs/ROLLOUT.md, "Connecting
your engine"):

- each sample of the group is one HTTP request (trajectories, lists inside a group, are not
  supported); at most ``max_concurrency`` run at once;
- a sample that is already COMPLETED, TRUNCATED or FAILED is returned as is (it gets a reward
  if it has none); an ABORTED or PENDING one is generated, continuing after its partial
  response: the request carries ``tokens`` (prompt + partial response) and asks for the
  remaining ``max_new_tokens - response_length`` tokens;
- on success the new tokens, text, log-probs, routes and the weight version are appended and
  the status set from the finish reason (stop → COMPLETED, length → TRUNCATED, abort →
  ABORTED); finished samples get ``reward(sample)``;
- a failed request (connection refused or reset, timeout, HTTP 429/5xx) is re-sent up to
  ``max_retries`` times with exponential backoff; the retry resends the same generation from
  the sample's state before the call, so nothing is appended twice and nothing is published
  or completed (that is the runner's job, after the generator returns). Samples are changed
  only after every request of the group has a valid answer: a group either comes back whole
  or the call raises and its samples are as they were (a reward function that raises
  afterwards leaves the generated tokens in place);
- ``abort()`` (thread-safe) ends the calls in flight at that moment; later calls run normally.

Errors: :class:`EngineUnavailable` (cannot reach the server or it keeps failing),
:class:`EngineTimeout` (no answer in ``request_timeout``), :class:`EngineRequestError` (the
server refused the request: HTTP 4xx), :class:`EngineProtocolError` (malformed JSON or an
answer missing required fields). Only the first two are retried.

The HTTP generators need ``aiohttp`` (``pip install 'straw[engines]'``): importing this
package does not, and naming one of them without aiohttp raises ``ModuleNotFoundError`` with
that instruction. :class:`EngineGenerator` (``straw.rollout.generators.base``) is the base to
build another engine's generator on (docs/ROLLOUT.md, "Connecting your engine").
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .base import (
    EngineError,
    EngineGenerator,
    EngineOptions,
    EngineProtocolError,
    EngineRequestError,
    EngineTimeout,
    EngineUnavailable,
    RetryableError,
    Segment,
    SegmentRequest,
)

if TYPE_CHECKING:
    from ._http import HttpGenerator
    from .openai import OpenAICompletionsGenerator
    from .sglang import SGLangGenerator

__all__ = [
    "EngineError",
    "EngineGenerator",
    "EngineOptions",
    "EngineProtocolError",
    "EngineRequestError",
    "EngineTimeout",
    "EngineUnavailable",
    "HttpGenerator",
    "OpenAICompletionsGenerator",
    "RetryableError",
    "SGLangGenerator",
    "Segment",
    "SegmentRequest",
]

# The HTTP generators import aiohttp; they load when first named (PEP 562).
_LAZY = {
    "HttpGenerator": "._http",
    "OpenAICompletionsGenerator": ".openai",
    "SGLangGenerator": ".sglang",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module, __name__), name)
