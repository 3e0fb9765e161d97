"""A minimal call link between a parent and a child process, for crash tests of remote callers.

The parent serves one object over a ``multiprocessing.connection`` listener on 127.0.0.1
(authenticated); the child calls its methods through :class:`Remote`. Arguments, results and
exceptions travel pickled. When the child dies, the parent's serving thread sees the
connection end and stops; the object itself (a live controller) stays with the parent, which
is the point: the caller crashed, the authority did not.
"""

from __future__ import annotations

import contextlib
import secrets
import threading
from multiprocessing.connection import Client, Connection, Listener
from typing import Any


class Remote:
    """Calls ``name(*args, **kwargs)`` on the parent's served object."""

    def __init__(self, address: tuple[str, int], authkey: bytes) -> None:
        self._conn: Connection = Client(address, authkey=authkey)
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)

        def call(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                self._conn.send((name, args, kwargs))
                kind, value = self._conn.recv()
            if kind == "error":
                raise value
            return value

        return call


class Served:
    """Serves ``target`` to one client connection in a daemon thread."""

    def __init__(self, target: Any) -> None:
        self.authkey = secrets.token_bytes(16)
        self._listener = Listener(("127.0.0.1", 0), authkey=self.authkey)
        self.address: tuple[str, int] = self._listener.address  # type: ignore[assignment]
        self._target = target
        self.ended = threading.Event()
        self._connected = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="rpc-link", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            with self._listener.accept() as conn:
                self._connected.set()
                while True:
                    try:
                        name, args, kwargs = conn.recv()
                    except (EOFError, OSError):
                        return  # the client is gone
                    try:
                        reply: tuple[str, Any] = ("ok", getattr(self._target, name)(*args, **kwargs))
                    except Exception as error:
                        reply = ("error", error)
                    try:
                        conn.send(reply)
                    except OSError:
                        return
        finally:
            self._listener.close()
            self.ended.set()

    def close(self, timeout: float) -> None:
        """Stop serving: a client that never connected is stood in for, so the thread ends."""
        if not self.ended.is_set() and not self._connected.is_set():
            with contextlib.suppress(OSError):
                Client(self.address, authkey=self.authkey).close()
        self._thread.join(timeout)
