"""Payload-free I/O traces for profiling (the peer's ``straw.tracing``; API.md section 9).

When the environment variable ``STRAW_TRACE_DIR`` names a directory, every publish and
verified read of a store appends one JSON line to ``<dir>/<host>-<pid>.jsonl``: the
operation (``write``, ``read``, ``read_range``), wall time, pool root, bytes moved, seconds
taken, and for reads of a range the bytes that were checked (whole chunks). Writes also
list each record's payload size, codec and tokens. No payload bytes, ids or metadata are
traced. Traces are observations, not part of any durable state: a trace file is appended
without syncs and a failure to write one is not an error of the traced call.

``straw.benchmark.profile`` turns a directory of traces into rates and read amplification.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Iterable
from typing import IO, Any

__all__ = ["TRACE_DIR_ENV", "emit", "enabled"]

#: Environment variable naming the trace directory; unset or empty turns tracing off.
TRACE_DIR_ENV = "STRAW_TRACE_DIR"

_lock = threading.Lock()
_open: dict[str, Any] = {"key": None, "stream": None}


def enabled() -> bool:
    """Whether tracing is on; once it is turned off, the open trace file is closed."""
    if os.environ.get(TRACE_DIR_ENV):
        return True
    if _open["stream"] is not None:
        with _lock:
            stream = _open["stream"]
            _open.update(key=None, stream=None)
        if stream is not None:
            with contextlib.suppress(OSError):
                stream.close()
    return False


def _stream(directory: str) -> IO[str]:
    """This process's trace file in ``directory`` (reopened after a fork or a new directory)."""
    key = (directory, os.getpid())
    stream: IO[str] | None = _open["stream"]
    if _open["key"] != key or stream is None:
        if stream is not None:
            stream.close()
        os.makedirs(directory, exist_ok=True)
        name = f"{socket.gethostname()}-{os.getpid()}.jsonl"
        stream = open(os.path.join(directory, name), "a", buffering=1, encoding="utf-8")  # noqa: SIM115
        _open.update(key=key, stream=stream)
    return stream


def emit(
    op: str,
    *,
    root: object,
    size: int,
    seconds: float,
    checked_bytes: int | None = None,
    records: Iterable[tuple[int, str, int]] | None = None,
) -> None:
    """Append one event when tracing is on; ``records`` are (payload bytes, codec, tokens)."""
    directory = os.environ.get(TRACE_DIR_ENV)
    if not directory:
        return
    event: dict[str, Any] = {
        "op": op,
        "time": time.time(),
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "root": str(root),
        "bytes": size,
        "seconds": seconds,
    }
    if checked_bytes is not None:
        event["checked_bytes"] = checked_bytes
    if records is not None:
        event["records"] = [{"bytes": n, "codec": codec, "tokens": tokens} for n, codec, tokens in records]
    line = json.dumps(event, separators=(",", ":")) + "\n"
    try:
        with _lock:
            _stream(directory).write(line)
    except OSError:
        return  # an observation lost is not the traced call's failure
