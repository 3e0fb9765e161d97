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
Fixed: a leftover temporary name is tolerated, and a link error after the link was made
counts as made (only this writer names its LIVE, A4).
"""

from __future__ import annotations

import errno

import pytest

from straw import SharedFilesystemStore
from straw._fs import lock
from straw._fs.system import installed
from straw.backend import FilesystemBackend
from straw.errors import StorageUnavailable
from straw.protocol import Record
from straw.testing import FaultFS

ROOT = "/r/pool"


def _store() -> SharedFilesystemStore:
    backend = FilesystemBackend(ROOT, sleep=lambda _: None, visibility_delays=())
    return SharedFilesystemStore(ROOT, "run", backend=backend)


def _live_is_held(store: SharedFilesystemStore) -> bool:
    """A collector's view: can it take the writer's LIVE lock? (It must not while the writer lives.)"""
    fd = lock.try_lock_exclusive(f"{ROOT}/raw/{store.writer_id}/LIVE")
    if fd is None:
        return True
    lock.unlock(fd)
    return False


def test_store_publishes_after_a_failed_live_temp_unlink() -> None:
    fs = FaultFS(0)
    fs.makedirs_durable("/r")
    with installed(fs):
        store = _store()
        fs.fail_next("unlink", errno.EIO)
        # LIVE is in place and locked: the leftover temporary name is harmless, the publish stands.
        ref = store.publish([Record("a", b"x" * 64)], submission_id="a")
        assert any(".LIVE." in note for note in fs.injected)  # the error hit LIVE's temporary name
        assert _live_is_held(store)
        again = store.publish([Record("b", b"y" * 64)], submission_id="b")
        assert [bytes(r.payload) for r in store.read(ref)] == [b"x" * 64]
        assert [bytes(r.payload) for r in store.read(again)] == [b"y" * 64]


@pytest.mark.parametrize("seed", range(8))
def test_a_link_error_after_the_link_was_made_still_holds_live(seed: int) -> None:
    # FaultFS makes a failed link change the directory or not, by seed: both must leave a
    # store that publishes, with LIVE locked by the living writer.
    fs = FaultFS(seed)
    fs.makedirs_durable("/r")
    with installed(fs):
        store = _store()
        fs.fail_next("link", errno.EIO, path=f"{ROOT}/raw/{store.writer_id}/LIVE")
        try:
            store.publish([Record("a", b"x" * 64)], submission_id="a")
        except StorageUnavailable:
            assert not fs.exists(f"{ROOT}/raw/{store.writer_id}/LIVE")  # the link was not made
        assert len(fs.injected) == 1 and "LIVE" in fs.injected[0]
        ref = store.publish([Record("b", b"y" * 64)], submission_id="b")
        assert _live_is_held(store)
        assert [bytes(r.payload) for r in store.read(ref)] == [b"y" * 64]
