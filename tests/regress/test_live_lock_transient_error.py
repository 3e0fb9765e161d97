"""Regression: one transient error while a writer creates its ``LIVE`` lock must not break the store.

Found by the seeded simulation (tests/sim) with injected I/O errors. ``lock.create_locked``
(src/straw/_fs/lock.py) links a locked temporary file to ``raw/<writer>/LIVE`` and then unlinks
the temporary name. If that unlink fails (EIO, ENOSPC), the error propagates although ``LIVE``
is in place: the descriptor holding the lock is neither returned nor closed, the writer
(src/straw/_pack/writer.py, D2.1) keeps ``_live_fd = -1``, and every later publish of that store
tries to link ``LIVE`` again and fails with ``StorageUnavailable`` "[Errno 17] File exists",
forever. (A link that fails after reaching the directory has the same effect, and there
``create_locked`` also closes the descriptor, so ``LIVE`` exists unlocked while the writer
lives: a collector would take it for dead, docs/GC.md.) The failed publish is fine to raise;
the store should keep working ("a store whose pack was abandoned keeps working").
"""

from __future__ import annotations

import errno

import pytest

from straw import SharedFilesystemStore
from straw._fs.system import installed
from straw.backend import FilesystemBackend
from straw.errors import StorageUnavailable
from straw.protocol import Record
from straw.testing import FaultFS

ROOT = "/r/pool"


@pytest.mark.xfail(
    strict=True, reason="BUG: a failed unlink of LIVE's temporary name breaks the store for good"
)
def test_store_publishes_after_a_failed_live_temp_unlink() -> None:
    fs = FaultFS(0)
    fs.makedirs_durable("/r")
    with installed(fs):
        backend = FilesystemBackend(ROOT, sleep=lambda _: None, visibility_delays=())
        store = SharedFilesystemStore(ROOT, "run", backend=backend)
        fs.fail_next("unlink", errno.EIO)
        with pytest.raises(StorageUnavailable):
            store.publish([Record("a", b"x" * 64)], submission_id="a")
        assert any(".LIVE." in note for note in fs.injected)  # the error hit LIVE's temporary name
        ref = store.publish([Record("b", b"y" * 64)], submission_id="b")
        assert [bytes(r.payload) for r in store.read(ref)] == [b"y" * 64]
