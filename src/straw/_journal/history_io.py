"""The shell's side of queue history files (``straw._queue.history``): reading one by ``pread``.

The pure format reads through :class:`FileSource`; the descriptor opens at the first read
and is shared by every lookup (one lock, since lookups come from calls and from a snapshot
thread alike). Writing a file is D0 (``straw._fs.durable``), done by the coordinator.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

from .._fs import posix

#: Where a queue keeps its history files (``straw._queue.history.HIST_DIR`` is the same name).
HIST_DIR = "hist"


class FileSource:
    """One history file on disk. A missing file raises ``FileNotFoundError``; any other OS
    error is translated here (``QuotaExceeded``, ``StorageUnavailable``), naming the file."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._fd: int | None = None

    def size(self) -> int:
        try:
            return posix.getsize(self.path)
        except FileNotFoundError:
            raise  # the format names the missing file (CorruptData)
        except OSError as error:
            raise posix.storage_error(error, f"reading queue history file {self.path}") from error

    def pread(self, size: int, offset: int) -> bytes | bytearray:
        try:
            with self._lock:
                if self._fd is None:
                    self._fd = posix.open_read(self.path)
                return posix.pread_exact(self._fd, size, offset)
        except FileNotFoundError:
            raise
        except OSError as error:  # a full disk stays QuotaExceeded, anything else StorageUnavailable
            raise posix.storage_error(error, f"reading queue history file {self.path}") from error

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                posix.close_quietly(self._fd)
                self._fd = None


def opener(directory: str) -> Callable[[str], FileSource]:
    """Opens the history files of the queue in ``directory`` by name."""
    return lambda name: FileSource(os.path.join(directory, HIST_DIR, name))
