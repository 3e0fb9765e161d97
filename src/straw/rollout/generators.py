"""Generators for serving engines over HTTP: SGLang's native API and OpenAI-compatible servers.

:class:`SGLangGenerator` drives SGLang's ``/generate`` (token ids in; output ids, per-token
log-probs, the weight version and optionally routed experts out) and aborts through
``/abort_request``, which makes in-flight requests answer at once with their partial output.
:class:`OpenAICompletionsGenerator` drives ``/v1/completions`` as vLLM and SGLang serve it
(token-id prompts, ``return_token_ids``, ``logprobs``); it aborts by cancelling its in-flight
requests (the server aborts a request whose client went away). Streaming (the default) keeps
the tokens received before an abort; without streaming an aborted request keeps nothing of
that attempt, but it can return routed experts (vLLM sends them only in whole answers).

Both implement the :class:`straw.rollout.hooks.Generator` protocol (docs/ENGINES.md):

- each sample of the group is one HTTP request; at most ``max_concurrency`` run at once;
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
  only after every request of the group has an answer: a group either comes back whole or
  the call raises and the group is untouched (except rewards already computed);
- ``abort()`` (thread-safe) ends the calls in flight at that moment; later calls run normally.

Errors: :class:`EngineUnavailable` (cannot reach the server or it keeps failing),
:class:`EngineTimeout` (no answer in ``request_timeout``), :class:`EngineRequestError` (the
server refused the request: HTTP 4xx), :class:`EngineProtocolError` (malformed JSON or an
answer missing required fields). Only the first two are retried.

This module needs ``aiohttp`` (``pip install 'straw[engines]'``); ``import straw.rollout`` does
not import it.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import dataclasses
import inspect
import io
import json
import logging
import threading
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import numpy as np

try:
    import aiohttp
except ModuleNotFoundError as error:  # pragma: no cover - exercised without the extra installed
    raise ModuleNotFoundError(
        "straw.rollout.generators requires aiohttp: pip install 'straw[engines]'", name="aiohttp"
    ) from error

from .sample import Sample, SampleStatus

__all__ = [
    "EngineError",
    "EngineProtocolError",
    "EngineRequestError",
    "EngineTimeout",
    "EngineUnavailable",
    "HttpOptions",
    "OpenAICompletionsGenerator",
    "SGLangGenerator",
]

_log = logging.getLogger("straw.rollout.generators")

#: HTTP statuses worth re-sending: overload and transient server failures.
RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})

#: Longest error body quoted in an exception message.
_QUOTE_CHARS_MAX = 300

Reward = Callable[[Sample], Any]
Tokenize = Callable[[Any], Sequence[int]]


class EngineError(RuntimeError):
    """A serving engine could not generate a group; the call changed none of its samples."""


class EngineUnavailable(EngineError):
    """The engine could not be reached, or kept failing (HTTP 429/5xx) through every retry."""


class EngineTimeout(EngineUnavailable):
    """The engine did not answer within ``request_timeout`` through every retry."""


class EngineRequestError(EngineError):
    """The engine refused a request (HTTP 4xx): a wrong field, model name or prompt; not retried."""


class EngineProtocolError(EngineError):
    """The engine answered with malformed JSON or without a required field; not retried."""


@dataclasses.dataclass(frozen=True)
class HttpOptions:
    """Transport limits shared by both generators.

    ``request_timeout`` bounds one whole generation request (seconds); ``connect_timeout`` the
    connection set-up. A failed request is sent again up to ``max_retries`` times, waiting
    ``retry_backoff * 2**attempt`` seconds (at most ``retry_backoff_max``). After ``abort()``
    an in-flight request gets ``abort_timeout`` seconds to answer with its partial output
    before it is cancelled.
    """

    max_concurrency: int = 64
    request_timeout: float = 600.0
    connect_timeout: float = 10.0
    max_retries: int = 3
    retry_backoff: float = 0.5
    retry_backoff_max: float = 8.0
    abort_timeout: float = 10.0

    def __post_init__(self) -> None:
        if self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {self.max_retries}")
        for name in ("request_timeout", "connect_timeout", "abort_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.retry_backoff < 0 or self.retry_backoff_max < 0:
            raise ValueError("retry_backoff and retry_backoff_max must be >= 0")


class _Retry(Exception):
    """One attempt failed in a way worth re-sending (the cause is chained)."""


@dataclasses.dataclass
class _Outcome:
    """What one request produced, before it is applied to its sample."""

    tokens: list[int] = dataclasses.field(default_factory=list)
    log_probs: list[float] = dataclasses.field(default_factory=list)
    text: str = ""
    finish: str | None = None  # "stop" | "length" | "abort"; None while streaming
    weight_version: str | None = None
    routes: np.ndarray[Any, Any] | None = None


@dataclasses.dataclass
class _Job:
    """One sample's request: what to send and how to read the answer."""

    sample: Sample
    prompt: list[int]  # every token sent (prompt + partial response)
    remaining: int
    routes_start: int
    rid: str = ""


class _Epoch:
    """The calls in flight between two ``abort()`` calls."""

    def __init__(self) -> None:
        self.aborted = asyncio.Event()
        self.inflight: dict[str, asyncio.Task[_Outcome]] = {}
        self.partials: dict[str, _Outcome] = {}


class _HttpGenerator:
    """The part both generators share: concurrency, retries, abort epochs, sample updates."""

    endpoint = ""

    def __init__(
        self,
        url: str,
        *,
        max_new_tokens: int,
        reward: Reward | None = None,
        tokenize: Tokenize | None = None,
        temperature: float = 1.0,
        seed: int | Callable[[Sample], int] | None = None,
        routed_experts: tuple[int, int] | None = None,
        options: HttpOptions | None = None,
    ) -> None:
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"Engine URL must start with http:// or https://, got {url!r}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if routed_experts is not None and (len(routed_experts) != 2 or min(routed_experts) < 1):
            raise ValueError(f"routed_experts must be (num_layers, top_k) >= 1, got {routed_experts!r}")
        self.url = url.rstrip("/")
        self.max_new_tokens = max_new_tokens
        self.reward = reward
        self.tokenize = tokenize
        self.temperature = temperature
        self.seed = seed
        self.routed_experts = routed_experts
        self.options = options or HttpOptions()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._session: aiohttp.ClientSession | None = None
        self._semaphore: asyncio.Semaphore | None = None
        self._epoch: _Epoch | None = None
        self._background: set[asyncio.Task[Any]] = set()
        self._closed = False
        self._lock = threading.Lock()  # guards the loop binding against concurrent first calls

    # ------------------------------------------------------------------ protocol

    async def __call__(self, group: list[Sample], *, weight_version: str | None) -> list[Sample]:
        if self._closed:
            raise RuntimeError("Generator is closed")
        self._bind()
        epoch = self._current_epoch()
        jobs = [self._job(sample) for sample in group]
        outcomes = await _gather_or_cancel(
            [self._generate(job, epoch) for job in jobs if job is not None and job.remaining > 0]
        )
        # Validate every answer before changing any sample: a group comes back whole or not at all.
        results = iter(outcomes)
        updates: list[tuple[Sample, dict[str, Any]]] = []
        for sample, job in zip(group, jobs, strict=True):
            if job is None:
                continue
            if job.remaining <= 0:
                updates.append((sample, {"status": SampleStatus.TRUNCATED}))
            else:
                updates.append((sample, self._update(sample, job, next(results), weight_version)))
        for sample, update in updates:
            for name, value in update.items():
                setattr(sample, name, value)
        await self._rewards(group)
        return group

    def abort(self) -> None:
        """End the calls in flight now (thread-safe); later calls generate normally."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            self._abort_now()
        else:
            loop.call_soon_threadsafe(self._abort_now)

    def close(self) -> None:
        """Close the HTTP session. From inside the generator's event loop use :meth:`aclose`."""
        self._closed = True
        loop, session = self._loop, self._session
        if session is None or loop is None or loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            task = loop.create_task(self.aclose())
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        elif loop.is_running():
            asyncio.run_coroutine_threadsafe(self.aclose(), loop).result(self.options.connect_timeout)
        else:
            loop.run_until_complete(self.aclose())

    async def aclose(self) -> None:
        """Close the HTTP session (idempotent)."""
        self._closed = True
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    # ------------------------------------------------------------------ loop binding

    def _bind(self) -> None:
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._loop is loop:
                return
            if self._loop is not None and not self._loop.is_closed() and self._loop.is_running():
                raise RuntimeError("A generator serves one event loop at a time; make one per loop")
            # First use, or the previous loop has ended (asyncio.run per call): start afresh.
            self._loop = loop
            timeout = aiohttp.ClientTimeout(
                total=self.options.request_timeout, sock_connect=self.options.connect_timeout
            )
            # Room for the abort requests on top of the generation requests.
            connector = aiohttp.TCPConnector(limit=self.options.max_concurrency + 8)
            self._session = aiohttp.ClientSession(timeout=timeout, connector=connector)
            self._semaphore = asyncio.Semaphore(self.options.max_concurrency)
            self._epoch = _Epoch()

    def _current_epoch(self) -> _Epoch:
        if self._epoch is None:
            self._epoch = _Epoch()
        return self._epoch

    def _abort_now(self) -> None:
        epoch, self._epoch = self._current_epoch(), _Epoch()
        epoch.aborted.set()
        if epoch.inflight:
            task = asyncio.get_running_loop().create_task(self._engine_abort(epoch))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    # ------------------------------------------------------------------ one sample

    def _job(self, sample: Sample) -> _Job | None:
        """The request to make for ``sample``, or None when it is already finished."""
        if not isinstance(sample, Sample):
            raise TypeError(f"A group holds Samples, got {type(sample).__name__}")
        if sample.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED, SampleStatus.FAILED):
            return None
        if sample.tokens:
            prompt = [int(t) for t in sample.tokens]
        elif self.tokenize is not None:
            prompt = [int(t) for t in self.tokenize(sample.prompt)]
        else:
            raise ValueError(
                f"Sample {sample.index} has no tokens and the generator has no tokenize function"
            )
        if not prompt:
            raise ValueError(f"Sample {sample.index} has an empty prompt")
        if sample.response_length and sample.rollout_log_probs is None:
            raise ValueError(
                f"Sample {sample.index} has {sample.response_length} response tokens but no "
                "rollout_log_probs; a continuation needs the log-probs of the partial response"
            )
        start = 0
        if self.routed_experts is not None and sample.rollout_routed_experts is not None:
            start = int(_as_array(sample.rollout_routed_experts).shape[0])
            if start > len(prompt) - 1:
                raise ValueError(
                    f"Sample {sample.index} has {start} route rows for {len(prompt)} tokens "
                    f"(at most {len(prompt) - 1})"
                )
        return _Job(sample, prompt, self.max_new_tokens - sample.response_length, start)

    async def _generate(self, job: _Job, epoch: _Epoch) -> _Outcome:
        """Send ``job`` (retrying failures) unless the epoch is aborted; never raises _Retry."""
        semaphore = self._semaphore
        if semaphore is None:
            raise RuntimeError("generator is not bound to an event loop")
        async with semaphore:
            last: BaseException | None = None
            for attempt in range(self.options.max_retries + 1):
                if epoch.aborted.is_set():
                    return _Outcome(finish="abort")
                try:
                    return await self._attempt(job, epoch)
                except _Retry as error:
                    last = error.__cause__ or error
                    if attempt == self.options.max_retries:
                        break
                    delay = min(self.options.retry_backoff * 2**attempt, self.options.retry_backoff_max)
                    _log.warning(
                        "retrying %s for sample %s in %.2fs: %s", self.endpoint, job.sample.index, delay, last
                    )
                    if await _wait_event(epoch.aborted, delay):
                        return _Outcome(finish="abort")
        where = f"{self.url}{self.endpoint}"
        tries = self.options.max_retries + 1
        if isinstance(last, asyncio.TimeoutError):
            raise EngineTimeout(
                f"{where} did not answer within {self.options.request_timeout}s ({tries} attempts)"
            ) from last
        raise EngineUnavailable(f"{where} failed {tries} attempts; last error: {_describe(last)}") from last

    async def _attempt(self, job: _Job, epoch: _Epoch) -> _Outcome:
        """One request; on abort, the engine's partial answer or what the stream had delivered."""
        job.rid = f"straw-{job.sample.index}-{uuid.uuid4().hex}"
        partial = _Outcome()
        epoch.partials[job.rid] = partial
        request = asyncio.get_running_loop().create_task(self._exchange(job, partial))
        epoch.inflight[job.rid] = request
        try:
            aborted = asyncio.ensure_future(epoch.aborted.wait())
            try:
                await asyncio.wait({request, aborted}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                aborted.cancel()
            if not request.done():
                # Aborted: the engine abort is on its way; give the request time to answer.
                await asyncio.wait({request}, timeout=self.options.abort_timeout)
            if not request.done():
                request.cancel()
                await asyncio.wait({request})
            if request.cancelled():
                partial.finish = "abort"
                return partial
            return request.result()
        except asyncio.CancelledError:
            request.cancel()
            raise
        finally:
            epoch.inflight.pop(job.rid, None)
            epoch.partials.pop(job.rid, None)

    async def _exchange(self, job: _Job, partial: _Outcome) -> _Outcome:
        raise NotImplementedError

    async def _engine_abort(self, epoch: _Epoch) -> None:
        raise NotImplementedError

    async def _post_json(self, path: str, payload: Mapping[str, Any]) -> Any:
        """POST ``payload``; the decoded JSON answer. Failures worth re-sending raise _Retry."""
        session = self._session
        if session is None:
            raise RuntimeError("generator is not bound to an event loop")
        url = f"{self.url}{path}"
        try:
            async with session.post(url, json=payload) as response:
                body = await response.read()
                _check_status(url, response.status, body)
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, asyncio.TimeoutError) as error:
            raise _Retry(str(error)) from error
        return _decode_json(url, body)

    # ------------------------------------------------------------------ applying answers

    def _update(
        self, sample: Sample, job: _Job, outcome: _Outcome, weight_version: str | None
    ) -> dict[str, Any]:
        """The sample's new field values after ``outcome`` (validated; the sample is not touched)."""
        new = outcome.tokens
        if len(outcome.log_probs) != len(new):
            raise EngineProtocolError(
                f"{self.url}{self.endpoint}: {len(new)} tokens but {len(outcome.log_probs)} log-probs"
            )
        status = {
            "stop": SampleStatus.COMPLETED,
            "length": SampleStatus.TRUNCATED,
            "abort": SampleStatus.ABORTED,
        }
        update: dict[str, Any] = {"status": status[outcome.finish or "abort"]}
        if not new:
            return update
        update["tokens"] = [*(sample.tokens or job.prompt), *new]
        update["response_length"] = sample.response_length + len(new)
        update["response"] = sample.response + outcome.text
        update["rollout_log_probs"] = [*(sample.rollout_log_probs or []), *outcome.log_probs]
        if sample.loss_mask is not None:
            update["loss_mask"] = [*sample.loss_mask, *([1] * len(new))]
        version = outcome.weight_version if outcome.weight_version is not None else weight_version
        if version is not None:
            update["weight_versions"] = [*sample.weight_versions, str(version)]
        if self.routed_experts is not None:
            routes = self._merged_routes(sample, job, outcome, len(update["tokens"]))
            if routes is not None:
                update["rollout_routed_experts"] = routes
        return update

    def _merged_routes(
        self, sample: Sample, job: _Job, outcome: _Outcome, total_tokens: int
    ) -> np.ndarray[Any, Any] | None:
        """The sample's routes with the new rows appended (rows = ``total_tokens - 1``).

        None keeps the sample's routes as they are: an aborted request that returned no routes
        leaves a shorter prefix, and the next request asks for routes from the end of it.
        """
        if self.routed_experts is None:
            return None
        layers, top_k = self.routed_experts
        if outcome.routes is None:
            if outcome.finish == "abort":
                return None
            raise EngineProtocolError(
                f"{self.url}{self.endpoint} returned no routed experts; "
                "the server must capture them (e.g. --enable-return-routed-experts)"
            )
        rows = total_tokens - 1 - job.routes_start
        try:
            new = outcome.routes.reshape(rows, layers, top_k)
        except ValueError:
            raise EngineProtocolError(
                f"{self.url}{self.endpoint}: {outcome.routes.size} routed-expert ids do not fill "
                f"[{rows}, {layers}, {top_k}] (tokens={total_tokens}, start={job.routes_start})"
            ) from None
        if job.routes_start == 0 or sample.rollout_routed_experts is None:
            return new.astype(np.int32)
        old = _as_array(sample.rollout_routed_experts).astype(np.int32)
        return np.concatenate([old[: job.routes_start], new.astype(np.int32)])

    async def _rewards(self, group: list[Sample]) -> None:
        if self.reward is None:
            return
        pending = [
            s
            for s in group
            if s.reward is None and s.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED)
        ]
        values = [self.reward(s) for s in pending]
        awaited = await asyncio.gather(*(v for v in values if inspect.isawaitable(v)))
        answers = iter(awaited)
        for sample, value in zip(pending, values, strict=True):
            sample.reward = next(answers) if inspect.isawaitable(value) else value

    def _seed_for(self, sample: Sample) -> int | None:
        """The sampling seed of a sample: the same for every segment, so continuations match."""
        if self.seed is None:
            return None
        if callable(self.seed):
            return int(self.seed(sample))
        return self.seed + (sample.index or 0)


class SGLangGenerator(_HttpGenerator):
    """A :class:`~straw.rollout.hooks.Generator` for SGLang's native ``/generate`` API.

    Each sample is one request ``{rid, input_ids, sampling_params: {max_new_tokens,
    temperature, sampling_seed?, **sampling_params}, return_logprob: true,
    return_routed_experts?, routed_experts_start_len?}``. The answer's
    ``meta_info.output_token_logprobs`` gives the tokens and log-probs, ``finish_reason.type``
    the status, ``weight_version`` the version appended to ``weight_versions`` (the call's
    ``weight_version`` when the server reports none) and ``routed_experts`` (base64 int32)
    the routes when ``routed_experts=(num_layers, top_k)`` is set. ``abort()`` posts
    ``/abort_request`` for each request in flight (``abort_all=True``: one request aborting
    everything on the server, as slime does when it owns the server).
    """

    endpoint = "/generate"

    def __init__(
        self,
        url: str,
        *,
        max_new_tokens: int,
        reward: Reward | None = None,
        tokenize: Tokenize | None = None,
        temperature: float = 1.0,
        seed: int | Callable[[Sample], int] | None = None,
        sampling_params: Mapping[str, Any] | None = None,
        routed_experts: tuple[int, int] | None = None,
        abort_all: bool = False,
        options: HttpOptions | None = None,
    ) -> None:
        super().__init__(
            url,
            max_new_tokens=max_new_tokens,
            reward=reward,
            tokenize=tokenize,
            temperature=temperature,
            seed=seed,
            routed_experts=routed_experts,
            options=options,
        )
        self.sampling_params = dict(sampling_params or {})
        self.abort_all = abort_all

    def payload(self, job: _Job) -> dict[str, Any]:
        """The JSON body of ``job``'s ``/generate`` request."""
        params: dict[str, Any] = {
            **self.sampling_params,
            "max_new_tokens": job.remaining,
            "temperature": self.temperature,
        }
        seed = self._seed_for(job.sample)
        if seed is not None:
            params["sampling_seed"] = seed
        body: dict[str, Any] = {
            "rid": job.rid,
            "input_ids": job.prompt,
            "sampling_params": params,
            "return_logprob": True,
        }
        if self.routed_experts is not None:
            body["return_routed_experts"] = True
            body["routed_experts_start_len"] = job.routes_start
        return body

    async def _exchange(self, job: _Job, partial: _Outcome) -> _Outcome:
        answer = await self._post_json(self.endpoint, self.payload(job))
        return _parse_sglang(f"{self.url}{self.endpoint}", answer)

    async def _engine_abort(self, epoch: _Epoch) -> None:
        # A request sent just before the abort may reach the engine after it (two connections),
        # which then does not know its id yet: abort what is still in flight once more soon after.
        for round_ in range(2):
            rids = list(epoch.inflight)
            if not rids:
                return
            bodies: list[dict[str, Any]]
            if self.abort_all:
                bodies = [{"abort_all": True}]
            else:
                bodies = [{"rid": rid, "abort_all": False} for rid in rids]
            results = await asyncio.gather(
                *(self._post_abort(body) for body in bodies), return_exceptions=True
            )
            for result in results:
                if isinstance(result, BaseException):
                    # The requests themselves still end: after abort_timeout they are cancelled.
                    _log.warning("abort_request to %s failed: %s", self.url, _describe(result))
            pending = list(epoch.inflight.values())
            if round_ == 0 and pending:
                await asyncio.wait(pending, timeout=min(0.5, self.options.abort_timeout / 4))

    async def _post_abort(self, body: Mapping[str, Any]) -> None:
        session = self._session
        if session is None:
            return
        timeout = aiohttp.ClientTimeout(total=self.options.abort_timeout)
        async with session.post(f"{self.url}/abort_request", json=body, timeout=timeout) as response:
            _check_status(f"{self.url}/abort_request", response.status, await response.read())


class OpenAICompletionsGenerator(_HttpGenerator):
    """A :class:`~straw.rollout.hooks.Generator` for OpenAI-compatible ``/v1/completions``.

    Each sample is one request ``{model?, prompt: token ids, max_tokens, temperature, seed?,
    logprobs: 1, return_token_ids: true, return_tokens_as_token_ids: true, stream,
    **extra_body}``. Token ids come from the choice's ``token_ids`` (vLLM's
    ``return_token_ids``) or else from ``logprobs.tokens`` spelled ``"token_id:<id>"``;
    log-probs from ``logprobs.token_logprobs``; the status from ``finish_reason``. OpenAI
    servers report no weight version, so the call's ``weight_version`` is recorded.
    ``abort()`` cancels the requests in flight (the server aborts them); with ``stream=True``
    the tokens received so far are kept. Routed experts (vLLM's ``routed_experts``, base64
    ``.npy``, with ``routed_experts_prompt_start``) need ``stream=False``.
    """

    endpoint = "/v1/completions"

    def __init__(
        self,
        url: str,
        *,
        max_new_tokens: int,
        model: str | None = None,
        reward: Reward | None = None,
        tokenize: Tokenize | None = None,
        temperature: float = 1.0,
        seed: int | Callable[[Sample], int] | None = None,
        extra_body: Mapping[str, Any] | None = None,
        stream: bool = True,
        routed_experts: tuple[int, int] | None = None,
        options: HttpOptions | None = None,
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
            temperature=temperature,
            seed=seed,
            routed_experts=routed_experts,
            options=options,
        )
        self.model = model
        self.extra_body = dict(extra_body or {})
        self.stream = stream

    def payload(self, job: _Job) -> dict[str, Any]:
        """The JSON body of ``job``'s ``/v1/completions`` request."""
        body: dict[str, Any] = {
            **self.extra_body,
            "prompt": job.prompt,
            "max_tokens": job.remaining,
            "temperature": self.temperature,
            "logprobs": 1,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            "stream": self.stream,
            "request_id": job.rid,
        }
        if self.model is not None:
            body["model"] = self.model
        seed = self._seed_for(job.sample)
        if seed is not None:
            body["seed"] = seed
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        if self.routed_experts is not None:
            body["routed_experts_prompt_start"] = job.routes_start
        return body

    async def _exchange(self, job: _Job, partial: _Outcome) -> _Outcome:
        where = f"{self.url}{self.endpoint}"
        if not self.stream:
            answer = await self._post_json(self.endpoint, self.payload(job))
            return _parse_completion(where, answer, want_routes=self.routed_experts is not None)
        session = self._session
        if session is None:
            raise RuntimeError("generator is not bound to an event loop")
        try:
            async with session.post(where, json=self.payload(job)) as response:
                if response.status != 200:
                    _check_status(where, response.status, await response.read())
                await _read_events(where, response, partial)
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, asyncio.TimeoutError) as error:
            raise _Retry(str(error)) from error
        if partial.finish is None:
            raise _Retry(f"{where}: the stream ended before a finish_reason")
        return partial

    async def _engine_abort(self, epoch: _Epoch) -> None:
        # Closing the connection is the OpenAI-compatible abort: the server drops the request.
        for task in list(epoch.inflight.values()):
            task.cancel()


# ---------------------------------------------------------------------- parsing


def _check_status(url: str, status: int, body: bytes) -> None:
    if status == 200:
        return
    quoted = body[:_QUOTE_CHARS_MAX].decode("utf-8", "replace")
    if status in RETRY_STATUSES:
        raise _Retry(f"HTTP {status} from {url}: {quoted}")
    raise EngineRequestError(f"{url} refused the request with HTTP {status}: {quoted}")


def _decode_json(url: str, body: bytes) -> Any:
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        quoted = body[:_QUOTE_CHARS_MAX].decode("utf-8", "replace")
        raise EngineProtocolError(f"{url} returned malformed JSON ({error}): {quoted!r}") from None


def _field(url: str, mapping: Any, key: str, kind: type | tuple[type, ...]) -> Any:
    if not isinstance(mapping, dict) or key not in mapping:
        raise EngineProtocolError(f"{url}: the answer has no {key!r}")
    value = mapping[key]
    if not isinstance(value, kind):
        raise EngineProtocolError(f"{url}: {key!r} is {type(value).__name__}, not {_kind_name(kind)}")
    return value


def _kind_name(kind: type | tuple[type, ...]) -> str:
    return " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))


def _numbers(url: str, values: Any, what: str, kind: type) -> list[Any]:
    if not isinstance(values, list) or any(
        isinstance(v, bool) or not isinstance(v, (int, float)) for v in values
    ):
        raise EngineProtocolError(f"{url}: {what} must be a list of numbers")
    if kind is int and any(not float(v).is_integer() for v in values):
        raise EngineProtocolError(f"{url}: {what} must be integers")
    return [kind(v) for v in values]


def _parse_sglang(url: str, answer: Any) -> _Outcome:
    meta = _field(url, answer, "meta_info", dict)
    finish = _field(url, meta, "finish_reason", dict)
    kind = finish.get("type")
    if kind not in ("stop", "length", "abort"):
        raise EngineProtocolError(f"{url}: unknown finish_reason type {kind!r}")
    output_ids = _numbers(url, answer.get("output_ids", []), "output_ids", int)
    if "output_token_logprobs" not in meta:
        if output_ids:
            raise EngineProtocolError(f"{url}: output_ids without meta_info.output_token_logprobs")
        pairs = []
    else:
        pairs = meta["output_token_logprobs"]
    if not isinstance(pairs, list) or any(not isinstance(p, list) or len(p) < 2 for p in pairs):
        raise EngineProtocolError(f"{url}: output_token_logprobs must be [logprob, token_id, ...] entries")
    log_probs = _numbers(url, [p[0] for p in pairs], "output_token_logprobs log-probs", float)
    tokens = _numbers(url, [p[1] for p in pairs], "output_token_logprobs token ids", int)
    if "output_ids" in answer and output_ids != tokens:
        raise EngineProtocolError(f"{url}: output_ids disagree with output_token_logprobs")
    text = answer.get("text") or ""
    version = meta.get("weight_version")
    routes = None
    if "routed_experts" in meta and meta["routed_experts"] is not None:
        routes = _base64_array(url, meta["routed_experts"], npy=False)
    return _Outcome(
        tokens,
        log_probs,
        text if isinstance(text, str) else "",
        kind,
        None if version is None else str(version),
        routes,
    )


def _parse_completion(url: str, answer: Any, *, want_routes: bool) -> _Outcome:
    choices = _field(url, answer, "choices", list)
    if len(choices) != 1:
        raise EngineProtocolError(f"{url}: expected one choice, got {len(choices)}")
    outcome = _Outcome()
    _add_choice(url, choices[0], outcome)
    if outcome.finish is None:
        raise EngineProtocolError(f"{url}: the choice has no finish_reason")
    routes = choices[0].get("routed_experts")
    if want_routes and routes is not None:
        outcome.routes = _base64_array(url, routes, npy=True)
    return outcome


def _add_choice(url: str, choice: Any, outcome: _Outcome) -> None:
    """Append one (possibly streamed) choice's tokens, log-probs, text and finish reason."""
    if not isinstance(choice, dict):
        raise EngineProtocolError(f"{url}: a choice must be an object")
    logprobs = choice.get("logprobs")
    token_logprobs = _field(url, logprobs, "token_logprobs", list) if logprobs is not None else []
    if choice.get("token_ids") is not None:
        tokens = _numbers(url, choice["token_ids"], "token_ids", int)
    elif logprobs is not None:
        tokens = [_token_id(url, name) for name in _field(url, logprobs, "tokens", list)]
    else:
        tokens = []
    if tokens and logprobs is None:
        raise EngineProtocolError(f"{url}: tokens without logprobs")
    log_probs = _numbers(url, token_logprobs, "token_logprobs", float)
    if len(log_probs) != len(tokens):
        raise EngineProtocolError(f"{url}: {len(tokens)} token ids but {len(log_probs)} token_logprobs")
    outcome.tokens.extend(tokens)
    outcome.log_probs.extend(log_probs)
    text = choice.get("text")
    outcome.text += text if isinstance(text, str) else ""
    finish = choice.get("finish_reason")
    if finish is not None:
        if finish not in ("stop", "length", "abort"):
            raise EngineProtocolError(f"{url}: unknown finish_reason {finish!r}")
        outcome.finish = finish


def _token_id(url: str, name: Any) -> int:
    text = name if isinstance(name, str) else ""
    if not text.startswith("token_id:") or not text[9:].lstrip("-").isdigit():
        raise EngineProtocolError(
            f"{url}: no token ids in the answer (send return_token_ids or "
            f"return_tokens_as_token_ids), got {name!r}"
        )
    return int(text[9:])


async def _read_events(url: str, response: aiohttp.ClientResponse, outcome: _Outcome) -> None:
    """Read server-sent events into ``outcome`` until ``data: [DONE]`` (or the stream ends)."""
    async for raw in response.content:
        line = raw.strip()
        if not line or line.startswith(b":"):
            continue
        if not line.startswith(b"data:"):
            raise EngineProtocolError(f"{url}: unexpected stream line {line[:_QUOTE_CHARS_MAX]!r}")
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        chunk = _decode_json(url, data)
        if isinstance(chunk, dict) and "error" in chunk:
            raise EngineRequestError(f"{url} failed while streaming: {chunk['error']}")
        for choice in _field(url, chunk, "choices", list):
            _add_choice(url, choice, outcome)


def _base64_array(url: str, text: Any, *, npy: bool) -> np.ndarray[Any, Any]:
    """Routed experts: base64 of raw int32 (SGLang) or of ``.npy`` bytes (vLLM)."""
    if not isinstance(text, str):
        raise EngineProtocolError(f"{url}: routed_experts must be a base64 string")
    try:
        raw = base64.b64decode(text, validate=True)
        if npy:
            array = np.load(io.BytesIO(raw), allow_pickle=False)
        else:
            array = np.frombuffer(raw, dtype=np.int32)
    except (binascii.Error, ValueError, OSError) as error:
        raise EngineProtocolError(f"{url}: routed_experts cannot be decoded: {error}") from None
    if array.dtype.kind not in "iu":
        raise EngineProtocolError(f"{url}: routed_experts must hold integers, got {array.dtype}")
    return np.asarray(array)


def _as_array(value: Any) -> np.ndarray[Any, Any]:
    """An array from routes held as an ndarray, a tensor, a list or a lazy TensorRef."""
    if hasattr(value, "load") and callable(value.load) and not isinstance(value, np.ndarray):
        value = value.load()
    if hasattr(value, "numpy") and callable(value.numpy):
        value = value.numpy()
    return np.asarray(value)


async def _wait_event(event: asyncio.Event, seconds: float) -> bool:
    """Wait up to ``seconds`` for ``event``; True if it was set (no sleeping: abort cuts it short)."""
    if event.is_set():
        return True
    try:
        await asyncio.wait_for(event.wait(), seconds)
    except asyncio.TimeoutError:
        return False
    return True


async def _gather_or_cancel(calls: list[Awaitable[_Outcome]]) -> list[_Outcome]:
    """Run ``calls`` together; if one raises, cancel the others and raise the first error."""
    tasks = [asyncio.ensure_future(call) for call in calls]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def _describe(error: BaseException | None) -> str:
    if error is None:
        return "unknown error"
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
