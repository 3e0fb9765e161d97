"""Regression: after a failed catalog sync, later appends must not chain onto the unsynced frame.

Found by the seeded simulation (tests/sim) once FaultFS modelled A3 as DURABILITY.md states it:
"A failed fsync/fdatasync leaves the file's unsynced bytes in an unknown state; retrying the
sync proves nothing. straw never relies on those bytes." The catalog's G3 append
(src/straw/_catalog/log.py, ``Catalog.append``) forgets its view when the sync fails; the next
locked section re-reads ``catalog/log`` from the page cache, which still shows the unsynced
frame N, so the next append frames N+1 after it and syncs. That sync proves nothing about frame
N (A3): after a power loss frame N's bytes may be gone while frame N+1, a durability witness,
is intact, and the catalog refuses to load with ``CorruptData`` ("damaged frame header ...
although frame N+1 after it was written once frame N was durable"). Every store of the pool is
then unusable until an operator repairs the catalog. It should load: the failed append was
never acknowledged, so frame N may be present or absent, never fatal. (The queue's journal
has the same shape: after a J3 fail-stop, J4.3 syncs the replayed frames in the same boot;
a power loss may then revert them, and the next recovery refuses the queue because the newer
segment "does not continue the previous segment": tests/sim/test_sim.py,
test_sim_with_sticky_sync_errors, seed 3.)
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


def _store() -> SharedFilesystemStore:
    backend = FilesystemBackend(ROOT, sleep=lambda _: None, visibility_delays=())
    return SharedFilesystemStore(ROOT, "run", backend=backend, online_gc=True)


def _run(seed: int) -> None:
    fs = FaultFS(seed, garble_probability=0.0, tear_probability=0.0, short_write_probability=0.0)
    fs.makedirs_durable("/r")
    with installed(fs):
        store = _store()
        ref = store.publish([Record("a", b"x" * 64)], submission_id="a")
        store.retain("first", [ref])
        fs.fail_next("sync", errno.EIO, path=f"{ROOT}/catalog/log")
        with pytest.raises(StorageUnavailable):
            store.retain("lost", [ref])
        store.retain("second", [ref])  # acknowledged: its frame follows the unsynced one
        fs.crash()
        reopened = _store()
        reopened.collect_garbage()  # loads the catalog
        assert [bytes(r.payload) for r in reopened.read(ref)] == [b"x" * 64]


def test_catalog_survives_a_crash_after_a_failed_sync() -> None:
    for seed in range(16):
        _run(seed)
