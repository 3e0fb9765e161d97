"""The shell's side of queue history files (``straw._queue.history``): reading one by ``pread``.

The pure format reads through :class:`FileSource`; the descriptor opens at the first read
and is shared by every lookup (one lock, since lookups come from calls and from a snapshot
thread alike). At most HISTORY_OPEN_FILES_MAX history files of the process hold a descriptor
at once (:class:`OpenFiles`): the least recently read gives its up and reopens when read
again. Index runs keep theirs (``keep_open``, DURABILITY.md J5 H3).
Writing a file is D0 (``straw._fs.durable``), done by the coordinator.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable

from .._fs import posix
from ..limits import HISTORY_OPEN_FILES_MAX

#: Where a queue keeps its history files (``straw._queue.history.HIST_DIR`` is the same name).
HIST_DIR = "hist"


class OpenFiles:
    """The sources holding a descriptor, least recently read first, at most ``limit`` of them."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._open: OrderedDict[FileSource, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._open)

    def read(self, source: FileSource) -> list[FileSource]:
        """Note that ``source`` was just read (its descriptor open); the sources that must give
        theirs up now, which the caller closes without holding any source's lock."""
        with self._lock:
            self._open[source] = None
            self._open.move_to_end(source)
            over = len(self._open) - self.limit
            return [self._open.popitem(last=False)[0] for _ in range(max(0, over))]

    def forget(self, source: FileSource) -> None:
        with self._lock:
            self._open.pop(source, None)


#: Every history source of the process (a reopen costs one ``open``; a descriptor per file
#: read costs one of the process's descriptors for as long as the queue lives).
OPEN = OpenFiles(HISTORY_OPEN_FILES_MAX)


class FileSource:
    """One history file on disk. A missing file raises ``FileNotFoundError``; any other OS
    error is translated here (``QuotaExceeded``, ``StorageUnavailable``), naming the file.
    ``close`` gives the descriptor up; a later read opens the file again. Unless
    :meth:`keep_open` was called, ``files`` may take the descriptor back between reads."""

    def __init__(self, path: str, files: OpenFiles = OPEN) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._files: OpenFiles | None = files

    def keep_open(self) -> None:
        files, self._files = self._files, None
        if files is not None:
            files.forget(self)

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
                data = posix.pread_exact(self._fd, size, offset)
        except FileNotFoundError:
            raise
        except OSError as error:  # a full disk stays QuotaExceeded, anything else StorageUnavailable
            raise posix.storage_error(error, f"reading queue history file {self.path}") from error
        if self._files is not None:
            for other in self._files.read(self):
                other._release()  # (never this source: it was just moved to the newest end)
        return data

    def _release(self) -> None:
        with self._lock:
            if self._fd is not None:
                posix.close_quietly(self._fd)
                self._fd = None

    def close(self) -> None:
        if self._files is not None:
            self._files.forget(self)
        self._release()


def opener(directory: str) -> Callable[[str], FileSource]:
    """Opens the history files of the queue in ``directory`` by name."""
    return lambda name: FileSource(os.path.join(directory, HIST_DIR, name))
