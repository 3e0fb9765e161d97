"""What the HTTP generators share: the aiohttp session, JSON requests and status handling."""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import json
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

try:
    import aiohttp
except ModuleNotFoundError as error:
    raise ModuleNotFoundError(
        "straw.rollout.generators requires aiohttp: pip install 'straw[engines]'", name="aiohttp"
    ) from error

from ..sample import Sample
from .base import (
    EngineGenerator,
    EngineOptions,
    EngineProtocolError,
    EngineRequestError,
    RetryableError,
    Reward,
)

__all__ = [
    "RETRY_STATUSES",
    "HttpGenerator",
    "check_status",
    "decode_json",
    "decode_routes",
    "field",
    "numbers",
]

#: HTTP statuses worth re-sending: overload and transient server failures.
RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})

#: Longest part of an answer quoted in an error message.
QUOTE_CHARS_MAX = 300

#: Connections of the control session (abort requests), apart from the generation requests so
#: that an abort never waits for a connection that a generation holds.
CONTROL_CONNECTIONS_MAX = 64

#: Errors of one HTTP exchange that are worth re-sending it for.
TRANSIENT = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, asyncio.TimeoutError)


class HttpGenerator(EngineGenerator):
    """An engine generator that talks to ``url`` over HTTP with one aiohttp session per loop."""

    endpoint = ""

    def __init__(
        self,
        url: str,
        *,
        max_new_tokens: int,
        reward: Reward | None = None,
        tokenize: Callable[[Any], Any] | None = None,
        seed: int | Callable[[Sample], int] | None = None,
        routed_experts: tuple[int, int] | None = None,
        options: EngineOptions | None = None,
    ) -> None:
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"Engine URL must start with http:// or https://, got {url!r}")
        super().__init__(
            max_new_tokens=max_new_tokens,
            reward=reward,
            tokenize=tokenize,
            seed=seed,
            routed_experts=routed_experts,
            options=options,
        )
        self.url = url.rstrip("/")
        self.where = f"{self.url}{self.endpoint}"
        self._session: aiohttp.ClientSession | None = None
        self._control: aiohttp.ClientSession | None = None

    async def open(self) -> None:
        # Sessions belong to one event loop; the sessions of an ended loop are simply dropped.
        options = self.options
        timeout = aiohttp.ClientTimeout(total=options.request_timeout, sock_connect=options.connect_timeout)
        connector = aiohttp.TCPConnector(limit=options.max_concurrency)
        self._session = aiohttp.ClientSession(timeout=timeout, connector=connector)
        control = aiohttp.ClientTimeout(total=options.abort_timeout, sock_connect=options.connect_timeout)
        connector = aiohttp.TCPConnector(limit=CONTROL_CONNECTIONS_MAX)
        self._control = aiohttp.ClientSession(timeout=control, connector=connector)

    async def aclose(self) -> None:
        await super().aclose()
        sessions = (self._session, self._control)
        self._session = self._control = None
        for session in sessions:
            if session is not None:
                await session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        """The session of generation requests (at most ``max_concurrency`` connections)."""
        if self._session is None:
            raise RuntimeError("generator is not bound to an event loop")
        return self._session

    async def post(self, path: str, payload: Mapping[str, Any], *, control: bool = False) -> bytes:
        """POST ``payload`` as JSON; the answer's bytes. Transient failures raise RetryableError.

        ``control=True`` sends it on the control session (abort requests, ``abort_timeout``).
        """
        url = f"{self.url}{path}"
        session = self._control if control else self._session
        if session is None:
            raise RuntimeError("generator is not bound to an event loop")
        try:
            async with session.post(url, json=payload) as response:
                body = await response.read()
                check_status(url, response.status, body)
        except TRANSIENT as error:
            raise RetryableError(str(error)) from error
        return body

    async def post_json(self, path: str, payload: Mapping[str, Any]) -> Any:
        """POST ``payload`` and decode the JSON answer (see :meth:`post`)."""
        return decode_json(f"{self.url}{path}", await self.post(path, payload))


def quote(body: bytes) -> str:
    return body[:QUOTE_CHARS_MAX].decode("utf-8", "replace")


def check_status(url: str, status: int, body: bytes) -> None:
    """Nothing for 200; RetryableError for 429/5xx; EngineRequestError for other refusals."""
    if status == 200:
        return
    if status in RETRY_STATUSES:
        raise RetryableError(f"HTTP {status} from {url}: {quote(body)}")
    raise EngineRequestError(f"{url} refused the request with HTTP {status}: {quote(body)}")


def decode_json(url: str, body: bytes) -> Any:
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise EngineProtocolError(f"{url} returned malformed JSON ({error}): {quote(body)!r}") from None


def field(url: str, mapping: Any, key: str, kind: type) -> Any:
    """``mapping[key]``, which must exist and be a ``kind``."""
    if not isinstance(mapping, dict) or key not in mapping:
        raise EngineProtocolError(f"{url}: the answer has no {key!r}")
    value = mapping[key]
    if not isinstance(value, kind):
        raise EngineProtocolError(f"{url}: {key!r} is {type(value).__name__}, not {kind.__name__}")
    return value


def numbers(url: str, values: Any, what: str, kind: type) -> list[Any]:
    """A list of ints or floats from JSON, refusing booleans and non-integral ids."""
    if not isinstance(values, list) or any(
        isinstance(v, bool) or not isinstance(v, (int, float)) for v in values
    ):
        raise EngineProtocolError(f"{url}: {what} must be a list of numbers")
    if kind is int and any(not float(v).is_integer() for v in values):
        raise EngineProtocolError(f"{url}: {what} must be integers")
    return [kind(v) for v in values]


def decode_routes(url: str, text: Any, *, npy: bool) -> np.ndarray[Any, Any]:
    """Routed experts from base64: raw int32 (SGLang) or ``.npy`` bytes (vLLM)."""
    if not isinstance(text, str):
        raise EngineProtocolError(f"{url}: routed_experts must be a base64 string")
    try:
        raw = base64.b64decode(text, validate=True)
        array = np.load(io.BytesIO(raw), allow_pickle=False) if npy else np.frombuffer(raw, dtype=np.int32)
    except (binascii.Error, ValueError, OSError) as error:
        raise EngineProtocolError(f"{url}: routed_experts cannot be decoded: {error}") from None
    if array.dtype.kind not in "iu":
        raise EngineProtocolError(f"{url}: routed_experts must hold integers, got {array.dtype}")
    return np.asarray(array)
