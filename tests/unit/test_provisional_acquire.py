"""J2.5: ``acquire`` replies once its frame is written, not synced (docs/DURABILITY.md).

A lease means nothing after a restart (recovery revokes every lease, J4.5), so an acquire's
frame only has to survive the process's death (then recovery revokes it and the attempt is
spent, which is what stops a task that kills its own coordinator from being retried forever),
not a power loss: losing it then only loses a lease the new epoch refuses anyway. Every
call that acts on the lease is framed after it and waits for its own sync, which covers it.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from straw import Record, SharedFilesystemStore, TaskSpec
from straw._fs.system import installed
from straw._journal import frame as jframe
from straw._journal.log import Journal
from straw.backend import FilesystemBackend
from straw.coordinator import Coordinator
from straw.errors import StaleAttempt
from straw.protocol import Lease
from straw.testing import FaultFS

ROOT = "/r/pool"
OWNER = "test-owner"


@pytest.fixture
def journal(tmp_path: Path) -> Iterator[Journal]:
    """A new queue journal with its first segment, closed after the test."""
    opened = Journal(FilesystemBackend(str(tmp_path)), str(tmp_path), jframe.identity_tag("run", "q"))
    opened.create_dirs(str(tmp_path))
    opened.start_segment()
    try:
        yield opened
    finally:
        opened.close()


def test_a_written_frame_is_in_the_file_and_the_next_wait_makes_it_durable(journal: Journal) -> None:
    first = journal.append(b'{"op":"a"}')
    journal.wait_written(first)
    assert (journal.written_seq, journal.durable_seq, journal.metrics["syncs"]) == (first, 0, 0)
    assert b'{"op":"a"}' in Path(journal.segment_path).read_bytes()  # in the page cache
    second = journal.append(b'{"op":"b"}')
    journal.wait(second)  # one sync covers both frames
    assert (journal.durable_seq, journal.metrics["syncs"]) == (second, 1)


def test_waiting_for_a_written_frame_alone_syncs_it(journal: Journal) -> None:
    seq = journal.append(b'{"op":"a"}')
    journal.wait_written(seq)
    journal.wait(seq)  # nothing is pending: the batch is a sync only
    assert (journal.durable_seq, journal.metrics["syncs"], journal.metrics["batches"]) == (seq, 1, 1)


def test_a_segment_switch_after_unsynced_frames_syncs_them_and_completes(journal: Journal) -> None:
    seq = journal.append(b'{"op":"a"}')
    journal.wait_written(seq)
    at, _ = journal.request_switch()
    later = journal.append(b'{"op":"b"}')  # belongs to the next segment
    journal.switch()
    assert journal.durable_seq >= at == seq and journal.segment_first_seq == seq + 1
    journal.wait_written(later)
    journal.wait(later)
    assert journal.durable_seq == later


def _store() -> SharedFilesystemStore:
    backend = FilesystemBackend(ROOT, sleep=lambda _: None, visibility_delays=())
    return SharedFilesystemStore(ROOT, "run", backend=backend, online_gc=True)


def _queue(store: SharedFilesystemStore, *, recover: bool = False) -> Coordinator:
    return Coordinator(store, exclusive_owner=OWNER, recover=recover, lease_seconds=60)


def _result(lease: Lease, payload: bytes) -> Record:
    return Record("r", payload, metadata={"task_id": lease.task_id, "attempt_id": lease.attempt_id})


def _power_loss_after_acquire(seed: int, *, then_complete_other: bool) -> tuple[int, bool]:
    """Acquire t0 (and complete t1 after it, if asked), lose power, recover: t0's failures and
    whether its stale lease was refused. The run's files are simulated (FaultFS)."""
    fs = FaultFS(seed)
    fs.makedirs_durable("/r")
    with installed(fs):
        store = _store()
        queue = _queue(store)
        queue.submit_tasks("s", [TaskSpec("t0"), TaskSpec("t1")])
        (t0,) = queue.acquire("w0", 1, task_ids=["t0"]).assignments
        receipt = None
        if then_complete_other:
            (t1,) = queue.acquire("w1", 1, task_ids=["t1"]).assignments
            ref = store.publish([_result(t1.lease, b"result")], submission_id="r1")
            receipt = queue.complete_task(
                t1.lease, submission_id="c1", result_ref=ref, result_digest=ref.digest
            )
        fs.crash()
        store = _store()
        queue = _queue(store, recover=True)
        try:
            status = queue.task_status("t0")
            assert status["state"] == "pending"
            if receipt is not None:
                # The completion was acknowledged: durable, and with it every frame before it.
                assert queue.lookup_submission("c1") == receipt
                assert queue.task_status("t1")["state"] == "completed"
            ref = store.publish([_result(t0.lease, b"late")], submission_id="r0")
            with pytest.raises(StaleAttempt):
                queue.complete_task(t0.lease, submission_id="c0", result_ref=ref, result_digest=ref.digest)
            (again,) = queue.acquire("w2", 1, task_ids=["t0"]).assignments
            assert again.lease.coordinator_epoch > t0.lease.coordinator_epoch
            return int(status["failures"]), True
        finally:
            queue.close()
            store.close()


def test_a_power_loss_may_lose_an_acquire_and_its_lease_is_refused_either_way() -> None:
    outcomes = {_power_loss_after_acquire(seed, then_complete_other=False)[0] for seed in range(24)}
    # Kept (replayed, then revoked by the new epoch: one attempt spent) or lost (never
    # leased: nothing spent). Both happen across seeds; neither breaks anything.
    assert outcomes == {0, 1}


def test_an_acknowledged_call_after_an_acquire_makes_the_acquire_durable() -> None:
    for seed in range(12):
        failures, _ = _power_loss_after_acquire(seed, then_complete_other=True)
        assert failures == 1, seed  # t0's acquire is always replayed, then revoked


CHILD = textwrap.dedent(
    """
    import os, sys
    from straw import SharedFilesystemStore, TaskSpec
    from straw.coordinator import Coordinator
    store = SharedFilesystemStore(sys.argv[1], "run")
    queue = Coordinator(store, exclusive_owner="test-owner", lease_seconds=60)
    queue.submit_tasks("s", [TaskSpec("t0")])
    syncs = queue._journal.metrics["syncs"]
    (a,) = queue.acquire("w0", 1).assignments
    print(a.lease.attempt_id, queue._journal.metrics["syncs"] - syncs, flush=True)
    os.kill(os.getpid(), 9)
    """
)


def test_an_acquire_survives_its_process_being_killed(tmp_path: Path) -> None:
    pool = tmp_path / "pool"
    pool.mkdir()
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(pool)], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == -signal.SIGKILL, done.stderr
    attempt, syncs = done.stdout.split()
    assert syncs == "0"  # the acquire replied without a sync of its own
    with SharedFilesystemStore(str(pool), "run") as store, _queue(store, recover=True) as queue:
        status = queue.task_status("t0")
        # Replayed from the page cache, then revoked by recovery: the attempt is spent, so a
        # task that kills its coordinator's process runs out of attempts instead of looping.
        assert (status["state"], status["failures"]) == ("pending", 1)
        assert status["lease"]["attempt_id"] == attempt  # the attempt the child was handed


def test_threads_mixing_written_and_durable_waits_all_finish_in_order(journal: Journal) -> None:
    """Bounded: 4 threads x 150 rounds of a provisional frame then a durable one, with segment
    switches requested meanwhile; every wait returns, and each durable wait saw its frame durable."""
    import threading

    lock = threading.Lock()  # stands for the coordinator's lock: frames are framed one at a time
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        try:
            for i in range(150):
                with lock:
                    seq = journal.append(b'{"op":"acquire","k":%d,"i":%d}' % (k, i))
                journal.wait_written(seq)
                assert journal.written_seq >= seq
                with lock:
                    seq = journal.append(b'{"op":"complete","k":%d,"i":%d}' % (k, i))
                journal.wait(seq)
                assert journal.durable_seq >= seq
                if k == 0 and i % 50 == 25:
                    with lock:
                        journal.request_switch()
                    journal.switch()
        except BaseException as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads), "a wait never returned"
    assert not errors, errors
    assert journal.durable_seq == journal.written_seq == journal.last_seq == 4 * 150 * 2


def test_a_clean_close_right_after_an_acquire_makes_it_durable(tmp_path: Path) -> None:
    with SharedFilesystemStore(str(tmp_path), "run") as store:
        with _queue(store) as queue:
            queue.submit_tasks("s", [TaskSpec("t0")])
            syncs = queue._journal.metrics["syncs"]
            (granted,) = queue.acquire("w0", 1).assignments
            assert queue._journal.metrics["syncs"] == syncs  # no sync of its own
        # close() synced the frame before its snapshot, which therefore holds the grant
        with _queue(store, recover=True) as queue:
            status = queue.task_status("t0")
            assert (status["failures"], status["lease"]["attempt_id"]) == (1, granted.lease.attempt_id)
