"""The transport-independent part of an engine generator: one request per sample, done right.

:class:`EngineGenerator` implements the :class:`~straw.rollout.hooks.Generator` protocol once
for every engine: it decides what each sample still needs (a fresh prompt, a continuation
after a partial response, nothing), bounds the requests in flight, re-sends failed requests,
ends the calls in flight on ``abort()``, validates every answer and only then appends it to
its sample, and rewards finished samples. A subclass says how to run one request
(:meth:`EngineGenerator.generate_segment`) and how to ask its engine to stop requests
(:meth:`EngineGenerator.abort_requests`). Nothing here needs aiohttp or torch.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import threading
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any

import numpy as np

from ..sample import Sample, SampleStatus

__all__ = [
    "EngineError",
    "EngineGenerator",
    "EngineOptions",
    "EngineProtocolError",
    "EngineRequestError",
    "EngineTimeout",
    "EngineUnavailable",
    "RetryableError",
    "Segment",
    "SegmentRequest",
    "as_array",
]

_log = logging.getLogger("straw.rollout.generators")

Reward = Callable[[Sample], Any]
Tokenize = Callable[[Any], Sequence[int]]

#: Finish reasons of a segment and the status they give a sample.
FINISH_STATUS = {
    "stop": SampleStatus.COMPLETED,
    "length": SampleStatus.TRUNCATED,
    "abort": SampleStatus.ABORTED,
}


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


class RetryableError(Exception):
    """Raised by :meth:`EngineGenerator.generate_segment` for a failure worth re-sending.

    Chain the cause (``raise RetryableError(...) from error``); a timeout as the cause makes
    the final error an :class:`EngineTimeout`.
    """


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """Limits shared by every engine generator.

    ``request_timeout`` bounds one generation request (seconds), ``connect_timeout`` the
    connection set-up. A failed request is sent again up to ``max_retries`` times, waiting
    ``retry_backoff * 2**attempt`` seconds (at most ``retry_backoff_max``) unless an abort
    comes first. After ``abort()`` a request in flight gets ``abort_timeout`` seconds to
    answer with its partial output before it is cancelled.
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


@dataclasses.dataclass
class Segment:
    """What one request produced (new tokens only), before it is appended to its sample.

    ``finish`` is ``"stop"``, ``"length"`` or ``"abort"`` (None while a stream is still
    arriving); ``routes`` holds the routed-expert ids of the rows from the request's
    ``routes_start`` on, in any shape that reshapes to ``[rows, num_layers, top_k]``.
    """

    tokens: list[int] = dataclasses.field(default_factory=list)
    log_probs: list[float] = dataclasses.field(default_factory=list)
    text: str = ""
    finish: str | None = None
    weight_version: str | None = None
    routes: np.ndarray[Any, Any] | None = None


@dataclasses.dataclass
class SegmentRequest:
    """One sample's request: every token to send and how many to generate after them.

    ``tokens`` is the prompt plus the partial response so far; ``routes_start`` is the first
    token position whose routes are wanted (the rows the sample already holds).
    ``request_id`` is fresh for every attempt.
    """

    sample: Sample
    tokens: list[int]
    max_new_tokens: int
    routes_start: int
    seed: int | None
    request_id: str = ""


class _Epoch:
    """The requests in flight between two ``abort()`` calls."""

    def __init__(self) -> None:
        self.aborted = asyncio.Event()
        self.inflight: dict[str, asyncio.Task[Segment]] = {}


class EngineGenerator:
    """A :class:`~straw.rollout.hooks.Generator` over one request per sample (see the module).

    Subclasses implement :meth:`generate_segment` and may override :meth:`abort_requests`,
    :meth:`open` and :meth:`aclose`. ``reward(sample)`` (sync or async) rewards finished
    samples; ``tokenize(prompt)`` turns a sample's prompt into token ids when it has no
    ``tokens`` yet; ``seed`` (an int, added to the sample index, or a function of the sample)
    fixes sampling so a continuation draws as the uninterrupted generation would have;
    ``routed_experts=(num_layers, top_k)`` asks for and checks R3 routes.
    """

    #: Shown in errors and logs (an endpoint URL for HTTP engines).
    where = "engine"

    def __init__(
        self,
        *,
        max_new_tokens: int,
        reward: Reward | None = None,
        tokenize: Tokenize | None = None,
        seed: int | Callable[[Sample], int] | None = None,
        routed_experts: tuple[int, int] | None = None,
        options: EngineOptions | None = None,
    ) -> None:
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if routed_experts is not None and (len(routed_experts) != 2 or min(routed_experts) < 1):
            raise ValueError(f"routed_experts must be (num_layers, top_k) >= 1, got {routed_experts!r}")
        self.max_new_tokens = max_new_tokens
        self.reward = reward
        self.tokenize = tokenize
        self.seed = seed
        self.routed_experts = routed_experts
        self.options = options or EngineOptions()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._semaphore: asyncio.Semaphore | None = None
        self._epoch = _Epoch()
        self._background: set[asyncio.Task[Any]] = set()
        self._closed = False
        self._bind_lock = threading.Lock()
        self._ready: asyncio.Event | None = None  # set once open() has run in the bound loop

    # ------------------------------------------------------------------ to implement

    async def generate_segment(self, request: SegmentRequest, partial: Segment) -> Segment:
        """Run one request to its end and return what it produced.

        A streaming engine may fill ``partial`` as tokens arrive and return it: when the call
        is cancelled (an abort the engine cannot do itself, or a timeout) the tokens already in
        ``partial`` are kept. Raise :class:`RetryableError` for a transient failure,
        :class:`EngineRequestError` or :class:`EngineProtocolError` otherwise.
        """
        raise NotImplementedError

    async def abort_requests(self, request_ids: list[str]) -> bool:
        """Ask the engine to end these requests early; True if it was asked.

        After True the requests get ``abort_timeout`` seconds to answer (with finish reason
        ``abort`` and their partial output); after False they are cancelled at once.
        """
        return False

    async def open(self) -> None:
        """Acquire per-loop resources (an HTTP session); called on first use in a loop."""

    async def aclose(self) -> None:
        """Release what :meth:`open` acquired (idempotent)."""
        self._closed = True

    # ------------------------------------------------------------------ protocol

    async def __call__(self, group: list[Sample], *, weight_version: str | None) -> list[Sample]:
        if self._closed:
            raise RuntimeError("Generator is closed")
        await self._bind()
        epoch = self._epoch
        requests = [self._request(sample) for sample in group]
        segments = await _gather_or_cancel(
            [self._generate(r, epoch) for r in requests if r is not None and r.max_new_tokens > 0]
        )
        # Validate every answer before changing any sample: a group comes back whole or not at all.
        answers = iter(segments)
        updates: list[tuple[Sample, dict[str, Any]]] = []
        for sample, request in zip(group, requests, strict=True):
            if request is None:
                continue
            if request.max_new_tokens <= 0:
                updates.append((sample, {"status": SampleStatus.TRUNCATED}))
            else:
                updates.append((sample, self._update(sample, request, next(answers), weight_version)))
        for sample, update in updates:
            for name, value in update.items():
                setattr(sample, name, value)
        await self._rewards(group)
        return group

    def abort(self) -> None:
        """End the requests in flight now (thread-safe); later calls generate normally."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        if _running_loop() is loop:
            self._abort_now()
        else:
            loop.call_soon_threadsafe(self._abort_now)

    def close(self) -> None:
        """Release resources; from inside the generator's event loop prefer ``await aclose()``."""
        self._closed = True
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        if _running_loop() is loop:
            self._spawn(loop, self.aclose())
        elif loop.is_running():
            asyncio.run_coroutine_threadsafe(self.aclose(), loop).result(self.options.connect_timeout)
        else:
            loop.run_until_complete(self.aclose())

    # ------------------------------------------------------------------ internals

    async def _bind(self) -> None:
        loop = asyncio.get_running_loop()
        with self._bind_lock:
            opening = self._loop is not loop
            if opening:
                if self._loop is not None and not self._loop.is_closed() and self._loop.is_running():
                    raise RuntimeError("A generator serves one event loop at a time; make one per loop")
                # First use, or the previous loop has ended (asyncio.run per call): start afresh.
                self._loop = loop
                self._semaphore = asyncio.Semaphore(self.options.max_concurrency)
                self._epoch = _Epoch()
                self._ready = asyncio.Event()
            ready = self._ready
        if ready is None:
            raise RuntimeError("generator lost its event loop binding")
        if opening:
            try:
                await self.open()
            finally:
                ready.set()  # calls waiting for open() go on (and fail on their own if it failed)
        else:
            await ready.wait()

    def _spawn(self, loop: asyncio.AbstractEventLoop, coroutine: Coroutine[Any, Any, Any]) -> None:
        task = loop.create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _abort_now(self) -> None:
        epoch, self._epoch = self._epoch, _Epoch()
        epoch.aborted.set()
        if epoch.inflight:
            self._spawn(asyncio.get_running_loop(), self._abort_epoch(epoch))

    async def _abort_epoch(self, epoch: _Epoch) -> None:
        """Ask the engine to end the epoch's requests; cancel what still runs after abort_timeout."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.options.abort_timeout
        # A request sent just before the abort may reach the engine after it (two connections)
        # and be unknown to it then: what is still in flight a moment later is asked again.
        recheck = min(0.5, self.options.abort_timeout / 4)
        for round_ in range(2):
            ids = list(epoch.inflight)
            if not ids:
                return
            try:
                asked = await self.abort_requests(ids)
            except Exception as error:  # the requests still end: they are cancelled below
                _log.warning("aborting requests at %s failed: %s", self.where, describe(error))
                asked = False
            if not asked:
                break
            pending = list(epoch.inflight.values())
            if pending:
                wait = recheck if round_ == 0 else max(0.0, deadline - loop.time())
                await asyncio.wait(pending, timeout=wait)
        for task in list(epoch.inflight.values()):
            task.cancel()

    def _request(self, sample: Sample) -> SegmentRequest | None:
        """What ``sample`` still needs, or None when it is already finished."""
        if not isinstance(sample, Sample):
            raise TypeError(f"A group holds Samples, got {type(sample).__name__}")
        if sample.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED, SampleStatus.FAILED):
            return None
        if sample.tokens:
            tokens = [int(t) for t in sample.tokens]
        elif self.tokenize is not None:
            tokens = [int(t) for t in self.tokenize(sample.prompt)]
        else:
            raise ValueError(
                f"Sample {sample.index} has no tokens and the generator has no tokenize function"
            )
        if not tokens:
            raise ValueError(f"Sample {sample.index} has an empty prompt")
        if sample.response_length and sample.rollout_log_probs is None:
            raise ValueError(
                f"Sample {sample.index} has {sample.response_length} response tokens but no "
                "rollout_log_probs; a continuation needs the log-probs of the partial response"
            )
        start = 0
        if self.routed_experts is not None and sample.rollout_routed_experts is not None:
            start = int(as_array(sample.rollout_routed_experts).shape[0])
            if start > len(tokens) - 1:
                raise ValueError(
                    f"Sample {sample.index} has {start} route rows for {len(tokens)} tokens "
                    f"(at most {len(tokens) - 1})"
                )
        remaining = self.max_new_tokens - sample.response_length
        return SegmentRequest(sample, tokens, remaining, start, self._seed_for(sample))

    def _seed_for(self, sample: Sample) -> int | None:
        """The sampling seed of a sample: the same for every segment, so continuations match."""
        if self.seed is None:
            return None
        if callable(self.seed):
            return int(self.seed(sample))
        return self.seed + (sample.index or 0)

    async def _generate(self, request: SegmentRequest, epoch: _Epoch) -> Segment:
        """``request``'s segment, re-sending failures, unless the epoch is aborted first."""
        semaphore = self._semaphore
        if semaphore is None:
            raise RuntimeError("generator is not bound to an event loop")
        async with semaphore:
            last: BaseException | None = None
            for attempt in range(self.options.max_retries + 1):
                if epoch.aborted.is_set():
                    return Segment(finish="abort")
                try:
                    return await self._attempt(request, epoch)
                except RetryableError as error:
                    last = error.__cause__ or error
                    if attempt == self.options.max_retries:
                        break
                    delay = min(self.options.retry_backoff * 2**attempt, self.options.retry_backoff_max)
                    index = request.sample.index
                    _log.warning(
                        "retrying %s for sample %s in %.2fs: %s", self.where, index, delay, describe(last)
                    )
                    if await wait_event(epoch.aborted, delay):
                        return Segment(finish="abort")
        tries = self.options.max_retries + 1
        if isinstance(last, asyncio.TimeoutError):
            raise EngineTimeout(
                f"{self.where} did not answer within {self.options.request_timeout}s ({tries} attempts)"
            ) from last
        raise EngineUnavailable(
            f"{self.where} failed {tries} attempts; last error: {describe(last)}"
        ) from last

    async def _attempt(self, request: SegmentRequest, epoch: _Epoch) -> Segment:
        """One request; if it is cancelled by an abort, what it had delivered so far."""
        request.request_id = f"straw-{request.sample.index}-{uuid.uuid4().hex}"
        partial = Segment()
        task = asyncio.get_running_loop().create_task(self.generate_segment(request, partial))
        epoch.inflight[request.request_id] = task
        try:
            await asyncio.wait({task})
        except asyncio.CancelledError:
            task.cancel()
            raise
        finally:
            epoch.inflight.pop(request.request_id, None)
        if task.cancelled():
            partial.finish = "abort"
            return partial
        return task.result()

    def _update(
        self, sample: Sample, request: SegmentRequest, segment: Segment, weight_version: str | None
    ) -> dict[str, Any]:
        """The sample's new field values after ``segment`` (validated; the sample is not touched)."""
        new = segment.tokens
        if len(segment.log_probs) != len(new):
            raise EngineProtocolError(
                f"{self.where}: {len(new)} tokens but {len(segment.log_probs)} log-probs"
            )
        if segment.finish not in FINISH_STATUS:
            raise EngineProtocolError(f"{self.where}: unknown finish reason {segment.finish!r}")
        update: dict[str, Any] = {"status": FINISH_STATUS[segment.finish]}
        if not new:
            return update
        update["tokens"] = [*(sample.tokens or request.tokens), *new]
        update["response_length"] = sample.response_length + len(new)
        update["response"] = sample.response + segment.text
        update["rollout_log_probs"] = [*(sample.rollout_log_probs or []), *segment.log_probs]
        if sample.loss_mask is not None:
            update["loss_mask"] = [*sample.loss_mask, *([1] * len(new))]
        version = segment.weight_version if segment.weight_version is not None else weight_version
        if version is not None:
            update["weight_versions"] = [*sample.weight_versions, str(version)]
        if self.routed_experts is not None:
            routes = self._merged_routes(sample, request, segment, len(update["tokens"]))
            if routes is not None:
                update["rollout_routed_experts"] = routes
        return update

    def _merged_routes(
        self, sample: Sample, request: SegmentRequest, segment: Segment, total_tokens: int
    ) -> np.ndarray[Any, Any] | None:
        """The sample's routes with the new rows appended (rows = ``total_tokens - 1``).

        None keeps the sample's routes as they are: an aborted request that returned no routes
        leaves a shorter prefix, and the next request asks for routes from the end of it.
        """
        if self.routed_experts is None:
            return None
        layers, top_k = self.routed_experts
        if segment.routes is None:
            if segment.finish == "abort":
                return None
            raise EngineProtocolError(
                f"{self.where} returned no routed experts; the engine must capture them "
                "(e.g. SGLang --enable-return-routed-experts)"
            )
        rows = total_tokens - 1 - request.routes_start
        try:
            new = np.asarray(segment.routes).reshape(rows, layers, top_k)
        except ValueError:
            raise EngineProtocolError(
                f"{self.where}: {segment.routes.size} routed-expert ids do not fill "
                f"[{rows}, {layers}, {top_k}] (tokens={total_tokens}, start={request.routes_start})"
            ) from None
        if request.routes_start == 0 or sample.rollout_routed_experts is None:
            return new.astype(np.int32)
        old = as_array(sample.rollout_routed_experts).astype(np.int32)
        return np.concatenate([old[: request.routes_start], new.astype(np.int32)])

    async def _rewards(self, group: list[Sample]) -> None:
        if self.reward is None:
            return
        finished = (SampleStatus.COMPLETED, SampleStatus.TRUNCATED)
        pending = [s for s in group if s.reward is None and s.status in finished]
        values = [self.reward(s) for s in pending]
        awaited = iter(await asyncio.gather(*(v for v in values if inspect.isawaitable(v))))
        for sample, value in zip(pending, values, strict=True):
            sample.reward = next(awaited) if inspect.isawaitable(value) else value


# ---------------------------------------------------------------------- helpers


def as_array(value: Any) -> np.ndarray[Any, Any]:
    """An array from routes held as an ndarray, a tensor, a list or a lazy TensorRef."""
    if hasattr(value, "load") and callable(value.load) and not isinstance(value, np.ndarray):
        value = value.load()
    if hasattr(value, "numpy") and callable(value.numpy):
        value = value.numpy()
    return np.asarray(value)


async def wait_event(event: asyncio.Event, seconds: float) -> bool:
    """Wait up to ``seconds`` for ``event`` (a timer, cut short by it); True if it was set."""
    if event.is_set():
        return True
    try:
        await asyncio.wait_for(event.wait(), seconds)
    except asyncio.TimeoutError:
        return False
    return True


def describe(error: BaseException | None) -> str:
    if error is None:
        return "unknown error"
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


async def _gather_or_cancel(calls: list[Awaitable[Segment]]) -> list[Segment]:
    """Run ``calls`` together; if one raises, cancel the others and raise the first error."""
    tasks = [asyncio.ensure_future(call) for call in calls]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
