"""straw.rpc: the JSON control transport, served on 127.0.0.1 in this process.

What a client sees: plain results (dataclasses as their dict forms), the coordinator's own
error classes, ``PermissionError`` for a wrong token, ``ValueError`` for a request over the
size limit (refused before its body is read), ``StorageUnavailable`` when no server listens
and ``IndeterminateCommit`` when a reply is late, cut or not a reply. Every refusal leaves
the queue as it was.
"""

from __future__ import annotations

import http.client
import http.server
import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import straw.limits
from straw import Coordinator, Record, SharedFilesystemStore, TaskSpec
from straw.errors import IdempotencyConflict, IndeterminateCommit, StaleAttempt, StorageUnavailable
from straw.protocol import Lease
from straw.rpc import QueueClient, serve, start_server

TOKEN = "secret-token"


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Coordinator, str]]:
    coordinator = Coordinator(SharedFilesystemStore(tmp_path, "rpc"), exclusive_owner="rpc test")
    server = start_server(coordinator, ("127.0.0.1", 0), token=TOKEN)
    host, port = server.server_address[:2]
    try:
        yield coordinator, f"http://{host}:{port}"
    finally:
        server.shutdown()
        server.server_close()
        coordinator.close()
        coordinator.store.close()


def test_a_task_round_trips_through_the_transport(served: tuple[Coordinator, str]) -> None:
    coordinator, address = served
    client = QueueClient(address, token=TOKEN)
    assert client.call("submit_tasks", request_id="r", tasks=[TaskSpec("t", metadata={"k": 1})]) == ["t"]
    granted = client.call("acquire", worker_id="w", max_tasks=1)
    assert granted["status"] == "acquired"
    assignment = granted["assignments"][0]
    assert assignment["task"]["metadata"] == {"k": 1}
    lease = Lease(**assignment["lease"])
    metadata = {"task_id": lease.task_id, "attempt_id": lease.attempt_id}
    ref = coordinator.store.publish([Record("t", b"out", metadata=metadata)], submission_id="out")
    receipt = client.call(
        "complete_task", lease=lease, submission_id="c", result_ref=ref, result_digest=ref.digest
    )
    assert receipt["result_ref"]["digest"] == ref.digest
    page = client.call("read_commits", cursor=0, limit=10)
    assert [c["task_id"] for c in page["commits"]] == ["t"]
    assert coordinator.task_status("t")["state"] == "completed"


def test_refusals_come_back_as_the_coordinators_error_classes(served: tuple[Coordinator, str]) -> None:
    coordinator, address = served
    client = QueueClient(address, token=TOKEN)
    client.call("submit_tasks", request_id="r", tasks=[TaskSpec("a")])
    with pytest.raises(IdempotencyConflict):
        client.call("submit_tasks", request_id="r", tasks=[TaskSpec("b")])
    lease = client.call("acquire", worker_id="w")["assignments"][0]["lease"]
    stale = {**lease, "attempt_id": "not-this-attempt"}
    metadata = {"task_id": "a", "attempt_id": "not-this-attempt"}
    ref = coordinator.store.publish([Record("a", b"out", metadata=metadata)], submission_id="out")
    assert client.call("heartbeat", leases=[lease]) == ["extended"]
    with pytest.raises(StaleAttempt):
        client.call("complete_task", lease=stale, submission_id="c", result_ref=ref, result_digest=ref.digest)
    with pytest.raises(ValueError, match="unknown control operation"):
        client.call("close")
    with pytest.raises(ValueError, match="unknown control operation"):
        client.call("__class__")
    assert coordinator.task_status("a")["state"] == "leased"
    assert coordinator.task_status("b") is None


def test_a_wrong_or_missing_token_is_refused_and_changes_nothing(served: tuple[Coordinator, str]) -> None:
    coordinator, address = served
    with pytest.raises(PermissionError, match="token"):
        QueueClient(address, token="wrong").call("submit_tasks", request_id="r", tasks=[TaskSpec("a")])
    host, port = address.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    connection.request("POST", "/", body=b'{"method":"seal_input","args":{"request_id":"s"}}')
    response = connection.getresponse()
    assert response.status == 403
    connection.close()
    assert coordinator.acquire("w").status == "empty"  # not sealed, nothing submitted


def test_an_oversized_request_is_refused_before_its_body_is_read(
    served: tuple[Coordinator, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    coordinator, address = served
    host, port = address.removeprefix("http://").split(":")
    # A declared length over the limit: refused from the headers alone (no body is sent).
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    connection.putrequest("POST", "/")
    connection.putheader("Authorization", f"Bearer {TOKEN}")
    connection.putheader("Content-Length", str(straw.limits.RPC_REQUEST_BYTES_MAX + 1))
    connection.endheaders()
    response = connection.getresponse()
    assert response.status == 413
    assert "Content-Length" in json.loads(response.read())["message"]
    connection.close()
    # Through the client, with the limit shrunk for a server started afterwards.
    monkeypatch.setattr(straw.limits, "RPC_REQUEST_BYTES_MAX", 512)
    small = start_server(coordinator, ("127.0.0.1", 0), token=TOKEN)
    try:
        client = QueueClient(f"http://127.0.0.1:{small.server_address[1]}", token=TOKEN)
        with pytest.raises(ValueError, match=r"1\.\.512 bytes"):
            client.call("submit_tasks", request_id="big", tasks=[TaskSpec("t", metadata={"x": "y" * 600})])
        assert client.call("submit_tasks", request_id="fits", tasks=[TaskSpec("u")]) == ["u"]
    finally:
        small.shutdown()
        small.server_close()
    assert coordinator.task_status("t") is None
    assert coordinator.task_status("u")["state"] == "pending"


def test_malformed_requests_get_a_clear_refusal(served: tuple[Coordinator, str]) -> None:
    _, address = served
    host, port = address.removeprefix("http://").split(":")
    for body, expected in [
        (b"not json", "ValueError"),
        (b"[1, 2]", "TypeError"),
        (b'{"method": 3}', "TypeError"),
        (b'{"method": "acquire", "args": {"no_such_argument": 1}}', "TypeError"),
    ]:
        connection = http.client.HTTPConnection(host, int(port), timeout=10)
        connection.request("POST", "/", body=body, headers={"Authorization": f"Bearer {TOKEN}"})
        response = connection.getresponse()
        assert (response.status, json.loads(response.read())["error"]) == (409, expected)
        connection.close()


def test_no_server_listening_is_storage_unavailable() -> None:
    with socket.socket() as probe:  # a port that was free a moment ago and has no listener
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    client = QueueClient(f"http://127.0.0.1:{port}", token=TOKEN, timeout=5)
    with pytest.raises(StorageUnavailable, match="cannot reach"):
        client.call("acquire", worker_id="w")


class _Fake(http.server.BaseHTTPRequestHandler):
    """A server that answers every POST with a configured raw reply (or none at all)."""

    reply: bytes | None = None
    answered = threading.Event()

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        if self.reply is None:
            self.answered.wait(10)  # never replies until the test ends
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.reply)))
        self.end_headers()
        self.wfile.write(self.reply)

    def log_message(self, format: str, *args: Any) -> None:
        return


@pytest.mark.parametrize("reply", [b"<html>proxy error</html>", b"[1]", b'{"neither": 1}', None])
def test_a_late_or_malformed_reply_is_indeterminate(reply: bytes | None) -> None:
    handler = type("Handler", (_Fake,), {"reply": reply, "answered": threading.Event()})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        client = QueueClient(f"http://127.0.0.1:{server.server_address[1]}", token=TOKEN, timeout=0.5)
        with pytest.raises(IndeterminateCommit, match="retry it with the same"):
            client.call("submit_tasks", request_id="r", tasks=[])
    finally:
        handler.answered.set()
        server.shutdown()
        server.server_close()


def test_bad_client_and_server_arguments_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="token"):
        QueueClient("http://127.0.0.1:1", token="")
    with pytest.raises(ValueError, match="http"):
        QueueClient("127.0.0.1:1", token=TOKEN)
    with pytest.raises(ValueError, match="timeout"):
        QueueClient("http://127.0.0.1:1", token=TOKEN, timeout=0)
    coordinator = Coordinator(SharedFilesystemStore(tmp_path, "rpc"), exclusive_owner="rpc test")
    try:
        with pytest.raises(ValueError, match="token"):
            serve(coordinator, ("127.0.0.1", 0), token="")
    finally:
        coordinator.close()
        coordinator.store.close()


def test_serve_reports_its_bound_address_and_answers(tmp_path: Path) -> None:
    coordinator = Coordinator(SharedFilesystemStore(tmp_path, "rpc"), exclusive_owner="rpc test")
    bound: list[tuple[str, int]] = []
    ready = threading.Event()

    def on_ready(address: tuple[str, int]) -> None:
        bound.append(address)
        ready.set()

    stop = threading.Event()
    thread = threading.Thread(
        target=serve,
        args=(coordinator, ("127.0.0.1", 0)),
        kwargs={"token": TOKEN, "ready": on_ready, "stop": stop},
    )
    thread.daemon = True
    thread.start()
    assert ready.wait(10)
    host, port = bound[0]
    assert host == "127.0.0.1" and port > 0
    client = QueueClient(f"http://{host}:{port}", token=TOKEN, timeout=5)
    assert client.call("seal_input", request_id="s") is not None
    assert coordinator.acquire("w").status == "end_of_input"
    stop.set()  # serve returns, its socket closed: nothing answers there any more
    thread.join(10)
    assert not thread.is_alive()
    with pytest.raises(StorageUnavailable):
        client.call("metrics")
    with pytest.raises(TypeError, match=r"stop is a threading\.Event"):
        serve(coordinator, ("127.0.0.1", 0), token=TOKEN, stop=True)  # type: ignore[arg-type]
    coordinator.close()
    coordinator.store.close()


def test_a_server_side_bug_is_a_runtime_error_not_a_queue_error(
    served: tuple[Coordinator, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    coordinator, address = served

    def broken() -> None:
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(coordinator, "metrics", broken)
    with pytest.raises(RuntimeError, match="ZeroDivisionError: a bug") as raised:
        QueueClient(address, token=TOKEN).call("metrics")
    assert type(raised.value) is RuntimeError
