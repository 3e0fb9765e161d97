"""Handing the C heap's free pages back to the operating system (docs/QUEUE.md "The C allocator").

A coordinator's background snapshot allocates large temporaries in its thread's malloc arena
(the state copy's containers, the snapshot's pieces, history blocks and index runs). glibc
keeps the pages of freed chunks that are not at the top of an arena, so without help the
process's resident size grows with the history it has written even though its live state
does not. ``malloc_trim(0)`` returns every whole free page of every arena (``madvise``); it
runs off the coordinator's lock, after a snapshot's temporaries are gone, and ctypes releases
the GIL for it. On a C library without it (not glibc) this does nothing.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable


def _trim_call() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_size_t]
    function.restype = ctypes.c_int
    return function


_MALLOC_TRIM = _trim_call()


def release_free_memory() -> bool:
    """Return the C heap's free pages to the system; whether this C library could (glibc)."""
    if _MALLOC_TRIM is None:
        return False
    _MALLOC_TRIM(0)
    return True
