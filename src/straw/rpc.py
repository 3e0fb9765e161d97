"""A small JSON control transport for a coordinator, for hosts outside Ray (the peer's API).

``serve(coordinator, (host, port), token=..., ready=None, stop=None)`` answers HTTP ``POST`` requests
``{"method": name, "args": {...}}`` by calling that coordinator method, and replies
``{"result": ...}`` (dataclasses as their ``asdict`` forms) or, for a refused call,
``{"error": class name, "message": text}``. ``QueueClient(address, token=...)`` is the
other end: ``client.call("acquire", worker_id="w")`` returns the plain result and raises
the same straw error class the coordinator raised.

Only control messages cross it, never payloads (workers read and write the pool
themselves). Every request must carry ``Authorization: Bearer <token>`` (compared in
constant time), name one of ``METHODS``, and fit in ``RPC_REQUEST_BYTES_MAX``; each
connection has a socket timeout. Serve on a trusted network or loopback: this is plain
HTTP, the token authenticates but nothing is encrypted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hmac
import http.client
import http.server
import json
import threading
from collections.abc import Callable, Mapping
from typing import Any
from urllib.error import HTTPError, URLError
from urllib.request import ProxyHandler, Request, build_opener

from . import errors, limits
from .coordinator import Coordinator
from .limits import RPC_SOCKET_SECONDS
from .protocol import Lease, RecordSetRef, TaskSpec, encode

__all__ = ["METHODS", "QueueClient", "serve", "start_server"]

#: Coordinator methods a client may call.
METHODS = frozenset(
    {
        "submit_tasks",
        "producer_state",
        "acquire",
        "heartbeat",
        "complete_task",
        "complete_tasks",
        "fail_task",
        "release_tasks",
        "yield_task",
        "yield_tasks",
        "save_task_progress",
        "save_task_progress_many",
        "cancel_task",
        "seal_input",
        "task_status",
        "pending_tasks",
        "lookup_submission",
        "read_commits",
        "outstanding_reads",
        "release_task_reads",
        "retire_worker",
        "open_consumer",
        "close_consumer",
        "save_consumer_state",
        "load_consumer_state",
        "plan_batch",
        "batch_ready",
        "get_batch",
        "register_checkpoint",
        "release_checkpoint",
        "collect_garbage",
        "metrics",
        "drain",
    }
)
_REFS = ("result_ref", "state_ref", "ready_ref", "plan_ref", "checkpoint_ref", "input_ref", "progress_ref")
#: Errors a reply may name: straw's, and the plain misuse ones (API.md section 3).
_ERRORS: dict[str, type[Exception]] = {
    name: cls
    for name, cls in vars(errors).items()
    if isinstance(cls, type) and issubclass(cls, errors.QueueError)
}
_ERRORS.update(ValueError=ValueError, KeyError=KeyError, TypeError=TypeError, PermissionError=PermissionError)


def _arguments(method: str, args: Mapping[str, Any]) -> dict[str, Any]:
    """A request's arguments as the coordinator takes them (objects from their dict forms)."""
    if method not in METHODS:
        raise ValueError(f"unknown control operation {method!r}")
    out = dict(args)
    if isinstance(out.get("lease"), Mapping):
        out["lease"] = Lease.from_dict(out["lease"])
    if "leases" in out:
        out["leases"] = [Lease.from_dict(v) if isinstance(v, Mapping) else v for v in out["leases"]]
    if "tasks" in out:
        out["tasks"] = [TaskSpec.from_dict(v) if isinstance(v, Mapping) else v for v in out["tasks"]]
    for key in _REFS:
        if isinstance(out.get(key), Mapping):
            out[key] = RecordSetRef.from_dict(out[key])
    return out


def _plain(value: Any) -> Any:
    """A result as JSON data: dataclasses (receipts, pages, assignments) as their asdict forms."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _handler(
    coordinator: Coordinator, token: str, request_bytes_max: int
) -> type[http.server.BaseHTTPRequestHandler]:
    expected = f"Bearer {token}".encode()

    class Handler(http.server.BaseHTTPRequestHandler):
        # A silent or trickling client loses its connection after this long (each socket
        # operation), so one client cannot hold a server thread forever.
        timeout = RPC_SOCKET_SECONDS

        def do_POST(self) -> None:
            if not hmac.compare_digest(self.headers.get("Authorization", "").encode(), expected):
                self._reply(403, {"error": "PermissionError", "message": "bad or missing token"})
                return
            try:
                length = int(self.headers.get("Content-Length", ""))
            except ValueError:
                length = -1
            if not 0 < length <= request_bytes_max:
                # Refused before reading a byte of the body: memory stays bounded.
                message = f"a request needs a Content-Length of 1..{request_bytes_max} bytes (got {length})"
                self._reply(413, {"error": "ValueError", "message": message})
                return
            try:
                request = json.loads(self.rfile.read(length))
                if not isinstance(request, dict):
                    raise TypeError("a request is {'method': name, 'args': {...}}")
                method, args = request.get("method"), request.get("args", {})
                if not isinstance(method, str) or not isinstance(args, dict):
                    raise TypeError("a request is {'method': name, 'args': {...}}")
                arguments = _arguments(method, args)  # checks the name first
                result = getattr(coordinator, method)(**arguments)
                self._reply(200, {"result": _plain(result)})
            except (errors.QueueError, ValueError, KeyError, TypeError) as error:
                # The nearest class a client knows (JSONDecodeError is a ValueError).
                name = next(c.__name__ for c in type(error).__mro__ if c.__name__ in _ERRORS)
                self._reply(409, {"error": name, "message": str(error)})
            except Exception as error:  # a bug: say so to the client instead of dropping it
                self._reply(500, {"error": "InternalError", "message": f"{type(error).__name__}: {error}"})

        def _reply(self, status: int, body: Mapping[str, Any]) -> None:
            data = encode(dict(body))
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            with contextlib.suppress(OSError):  # a client gone: it retries by its own id
                self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            return  # no output: the library prints nothing

    return Handler


class _Server(http.server.ThreadingHTTPServer):
    """One thread per connection; a connection that fails (timeout, reset) is dropped quietly."""

    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        return  # the client sees its connection end and decides (IndeterminateCommit)


def _server(coordinator: Coordinator, address: tuple[str, int], token: str) -> _Server:
    if not isinstance(token, str) or not token:
        raise ValueError("serve needs a non-empty token shared with the clients")
    return _Server(address, _handler(coordinator, token, limits.RPC_REQUEST_BYTES_MAX))


def start_server(coordinator: Coordinator, address: tuple[str, int], *, token: str) -> _Server:
    """A started server (its own thread) answering for ``coordinator``; ``shutdown()`` then
    ``server_close()`` stop it. ``server_address`` is the bound ``(host, port)``."""
    server = _server(coordinator, address, token)
    threading.Thread(target=server.serve_forever, name="straw-rpc", daemon=True).start()
    return server


def serve(
    coordinator: Coordinator,
    address: tuple[str, int],
    *,
    token: str,
    ready: Callable[[tuple[str, int]], object] | None = None,
    stop: threading.Event | None = None,
) -> None:
    """Answer control requests for ``coordinator`` at ``address`` until the process ends, or
    until ``stop`` is set (an extension: then it returns with its socket closed).

    ``ready`` is called with the bound ``(host, port)`` once requests are accepted (port 0
    picks a free one).
    """
    if stop is not None and not isinstance(stop, threading.Event):
        raise TypeError(f"stop is a threading.Event, got {type(stop).__name__}")
    if stop is None:
        with _server(coordinator, address, token) as server:
            _report_ready(server, ready)
            server.serve_forever()
        return
    server = start_server(coordinator, address, token=token)
    try:
        _report_ready(server, ready)
        stop.wait()
    finally:
        server.shutdown()
        server.server_close()


def _report_ready(server: _Server, ready: Callable[[tuple[str, int]], object] | None) -> None:
    if ready is not None:
        host, port = server.server_address[:2]
        ready((str(host), int(port)))


class QueueClient:
    """Calls a served coordinator: ``call(method, **args)`` returns its plain result.

    A refused call raises the coordinator's error class. A server that cannot be reached
    raises ``StorageUnavailable`` (nothing was delivered); a reply that never comes within
    ``timeout`` seconds, is cut or is not a reply raises ``IndeterminateCommit`` (the call may
    have taken effect: retry it with the same request or submission id). A server-side bug
    raises ``RuntimeError``. ``metadata_bytes`` is accepted for compatibility and limits nothing.
    """

    def __init__(
        self, address: str, *, token: str, timeout: float = 30, metadata_bytes: int | None = None
    ) -> None:
        if not isinstance(address, str) or not address.startswith(("http://", "https://")):
            raise ValueError(f"address {address!r} must be an http:// URL of a served coordinator")
        if not isinstance(token, str) or not token:
            raise ValueError("QueueClient needs the non-empty token the server was started with")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self.address = address
        self.token = token
        self.timeout = float(timeout)
        self._opener = build_opener(ProxyHandler({}))  # never through an HTTP proxy

    def call(self, method: str, **args: Any) -> Any:
        body = encode({"method": method, "args": {k: _plain(v) for k, v in args.items()}})
        request = Request(
            self.address,
            data=body,
            headers={"Authorization": f"Bearer {self.token}", "Content-Type": "application/json"},
        )
        try:
            response = self._opener.open(request, timeout=self.timeout)
        except HTTPError as error:
            response = error  # a refusal: its body names the error
        except URLError as error:  # raised while connecting or sending: nothing was done
            raise errors.StorageUnavailable(
                f"cannot reach the coordinator at {self.address}: {error.reason}"
            ) from error
        except (OSError, http.client.HTTPException) as error:
            raise self._uncertain(method, error) from error
        try:
            with response:
                value = json.loads(response.read())
        except (OSError, http.client.HTTPException, ValueError) as error:
            raise self._uncertain(method, error) from error
        if not isinstance(value, dict) or not ("result" in value or "error" in value):
            raise self._uncertain(method, ValueError(f"not a control reply: {str(value)[:200]!r}"))
        if "error" in value:
            name, message = str(value["error"]), str(value.get("message", ""))
            if name == "InternalError":
                raise RuntimeError(f"the coordinator at {self.address} failed on {method}: {message}")
            raise _ERRORS.get(name, errors.QueueError)(message)
        return value["result"]

    def _uncertain(self, method: str, error: BaseException) -> errors.IndeterminateCommit:
        return errors.IndeterminateCommit(
            f"{method} to {self.address} got no usable reply within {self.timeout}s ({error!r}): "
            "it may or may not have taken effect; retry it with the same request or submission id"
        )
