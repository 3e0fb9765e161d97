"""Python's cycle collector paused while the queue builds many small acyclic objects.

Replaying a journal, rebuilding a snapshot's state, copying the live state for a snapshot and
building a page of receipts each allocate one object per field of many tasks or receipts. Left
on, the collector would run full collections meanwhile, each a pass over the whole heap (about
0.4 s once torch is imported), inside the call.

The collector is process-wide, so the pause is counted: threads may pause at once (a page of
``read_commits`` while the snapshot copy runs under the coordinator's lock), and the collector
comes back only when the last pause ends, and only if it was on when the first one began (an
application that turned it off keeps it off).
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_pauses = 0
_resume = False


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    global _pauses, _resume
    with _lock:
        if _pauses == 0:
            _resume = gc.isenabled()
            gc.disable()
        _pauses += 1
    try:
        yield
    finally:
        with _lock:
            _pauses -= 1
            if _pauses == 0 and _resume:
                gc.enable()
