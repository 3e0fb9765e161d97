"""Snapshots past the threshold run in the background (DURABILITY.md J5, issue 12 item 2).

A fault hook holds the snapshot thread at one phase (an event, never a sleep; the clock is
injected): while it is held, ``heartbeat`` and ``complete_task`` answer, the group commit
goes on, and the snapshot that lands afterwards is the state as of its switch point, with
the calls made meanwhile in the segment after it. A fault at each phase of J5 changes
nothing acknowledged: before the next segment exists the snapshot is skipped and the
queue goes on, once it exists the queue stops (J3), and recovery finds every acknowledged
call either way.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import queue_helpers as qh
import straw.coordinator as coordinator_module
from straw import Coordinator, SharedFilesystemStore, TaskSpec
from straw._journal import frame
from straw._journal.log import Journal
from straw.backend import FilesystemBackend
from straw.errors import UnsafeRecovery
from straw.protocol import Lease

RUN = "run-snapshot-background"
OWNER = "owner-snap"
LEASE_S = 30.0
#: Bound on every wait for the other thread (a hang fails the test, it never sleeps).
WAIT_S = 30.0


class InjectedFault(Exception):
    """Raised by the hook at the armed phase."""


class Hook:
    """A fault hook: ``hold`` blocks the thread reaching that phase until ``go``; ``fail`` raises."""

    def __init__(self) -> None:
        self.hold: str | None = None
        self.fail: str | None = None
        self.reached = threading.Event()
        self.go = threading.Event()
        self.seen: list[str] = []

    def __call__(self, phase: str) -> None:
        self.seen.append(phase)
        if phase == self.hold:
            self.hold = None
            self.reached.set()
            if not self.go.wait(WAIT_S):
                raise AssertionError(f"the test never released {phase}")
        if phase == self.fail:
            self.fail = None
            raise InjectedFault(phase)


@pytest.fixture
def hook() -> Hook:
    return Hook()


@pytest.fixture
def store(tmp_path: Path, hook: Hook) -> Iterator[SharedFilesystemStore]:
    with SharedFilesystemStore(tmp_path, RUN, backend=FilesystemBackend(tmp_path, fault=hook)) as opened:
        yield opened


@pytest.fixture
def make(store: SharedFilesystemStore, hook: Hook) -> Iterator[Callable[..., Coordinator]]:
    with qh.coordinators(store, exclusive_owner=OWNER, clock=qh.Clock(), lease_seconds=LEASE_S) as factory:
        yield factory
        hook.go.set()  # never leave a snapshot thread held


def leases(coord: Coordinator, count: int) -> list[Lease]:
    coord.submit_tasks("tasks", [TaskSpec(f"t{i}") for i in range(count)])
    return [a.lease for a in coord.acquire("w1", count).assignments]


def complete(coord: Coordinator, lease: Lease) -> Any:
    ref = qh.result_for(coord.store, lease, submission_id=f"s-{lease.task_id}")
    return coord.complete_task(
        lease, submission_id=f"s-{lease.task_id}", result_ref=ref, result_digest=ref.digest
    )


def snapshots(coord: Coordinator) -> list[int]:
    return sorted(int(p.stem) for p in (Path(coord.directory) / "snap").glob("*.snap"))


def segments(coord: Coordinator) -> list[int]:
    return sorted(int(p.stem) for p in (Path(coord.directory) / "wal").glob("*.wal"))


def due(monkeypatch: pytest.MonkeyPatch) -> None:
    """From here on every mutating call finds a snapshot due (the first has no size to beat)."""
    monkeypatch.setattr(coordinator_module, "JOURNAL_SNAPSHOT_BYTES_MIN", 1)


@pytest.mark.timeout(60)
def test_a_snapshot_in_progress_blocks_neither_heartbeat_nor_complete_task(
    make: Any, hook: Hook, monkeypatch: pytest.MonkeyPatch
) -> None:
    coord = make()
    first, second, third = leases(coord, 3)
    early = complete(coord, first)
    due(monkeypatch)
    hook.hold = "before_snapshot_write"
    switch_point = coord.journal.sequence
    coord.release_task_reads([])  # starts the snapshot of frame switch_point, returns
    assert hook.reached.wait(WAIT_S)  # the snapshot thread is held inside J5
    # Calls go on while it is held: none of them waits for the snapshot.
    assert coord.heartbeat([second, third]) == ["extended", "extended"]
    during = complete(coord, second)
    assert during.position == 1
    assert coord.lookup_submission("s-t1") == during
    assert coord.metrics()["journal"]["snapshots"] == 0 and snapshots(coord) == []
    assert segments(coord) == [1, switch_point + 1]  # the switch came first (J5.2)
    hook.go.set()
    assert coord._await_snapshot() is None
    assert snapshots(coord) == [switch_point]  # the state as of the switch point
    assert segments(coord) == [switch_point + 1]  # older segments are gone (J5.5)
    last = complete(coord, third)
    qh.crash(coord)
    again = make(recover=True)
    assert [again.lookup_submission(f"s-t{i}") for i in range(3)] == [early, during, last]
    assert [c["position"] for c in again.commits] == [0, 1, 2]


@pytest.mark.timeout(60)
def test_a_segment_switch_in_progress_does_not_block_heartbeat(
    make: Any, hook: Hook, monkeypatch: pytest.MonkeyPatch
) -> None:
    coord = make()
    (lease,) = leases(coord, 1)
    due(monkeypatch)
    hook.hold = "before_segment_switch"
    caller = threading.Thread(target=coord.release_task_reads, args=([],))
    caller.start()  # its frame follows the switch point: it waits for the next segment
    assert hook.reached.wait(WAIT_S)
    assert coord.heartbeat([lease]) == ["extended"]  # heartbeats take only the coordinator lock
    hook.go.set()
    caller.join(WAIT_S)
    assert not caller.is_alive()
    assert coord._await_snapshot() is None
    assert complete(coord, lease).position == 0


def _trigger(coord: Coordinator) -> BaseException | None:
    """One mutating call that starts a snapshot; what it raised, once the snapshot ended."""
    raised: BaseException | None = None
    try:
        coord.submit_tasks("trigger", [TaskSpec("late")])
    except UnsafeRecovery as error:
        raised = error
    coord._await_snapshot()
    return raised


@pytest.mark.parametrize(
    "phase",
    [
        "before_segment_switch",
        "before_segment_cut",
        "after_segment_switch",
        "before_snapshot_write",
        "after_snapshot_write",
    ],
)
@pytest.mark.timeout(60)
def test_j5_a_fault_at_each_snapshot_phase_loses_nothing_acknowledged(
    make: Any, hook: Hook, monkeypatch: pytest.MonkeyPatch, phase: str
) -> None:
    coord = make()
    first, second = leases(coord, 2)
    receipt = complete(coord, first)
    due(monkeypatch)
    hook.fail = phase
    raised = _trigger(coord)
    assert hook.fail is None, "the phase was reached"
    assert coord.metrics()["counters"]["snapshots_failed"] == 1
    assert "InjectedFault" in str(coord.metrics()["snapshot_error"])
    if phase in ("before_segment_cut", "after_segment_switch"):
        # The next segment exists: the journal stops (J3); the call waiting for it learns so.
        assert isinstance(raised, UnsafeRecovery)
        with pytest.raises(UnsafeRecovery, match="stopped"):
            complete(coord, second)
        assert coord.lookup_submission("s-t0") == receipt  # views answer the durable state (J3.2)
        coord.close()
        assert qh.descriptors_under(coord.directory) == []  # the new segment's too
        again = make(recover=True)
        assert again.lookup_submission("s-t0") == receipt
        assert "late" not in again.tasks  # its frame was never written
        return
    assert raised is None  # the call never learns of the snapshot
    assert "late" in coord.tasks
    if phase == "before_segment_switch":
        assert segments(coord) == [1] and snapshots(coord) == []  # given up: frames go on here
    if phase == "after_snapshot_write":
        assert len(snapshots(coord)) == 1 and segments(coord)[0] == 1  # durable, not yet tidied
    during = complete(coord, second)
    qh.crash(coord)
    again = make(recover=True)
    assert again.lookup_submission("s-t0") == receipt
    assert again.lookup_submission("s-t1") == during
    assert again.tasks["late"]["state"] == "pending"


def test_a_switch_writes_the_frames_after_its_point_to_the_next_segment(tmp_path: Path) -> None:
    backend = FilesystemBackend(tmp_path)
    tag = frame.identity_tag("run", "q")
    journal = Journal(backend, str(tmp_path / "queue"), tag)
    journal.create_dirs(str(tmp_path))
    journal.start_segment()
    for i in range(3):
        journal.append(b'{"n":%d}' % i)
    at, chain = journal.request_switch()
    assert at == 3
    seq = [journal.append(b'{"n":%d}' % i) for i in range(3, 5)]  # framed before the switch
    journal.switch()  # writes frames 1-3 to segment 1, then starts segment 4
    journal.wait(seq[-1])
    assert journal.segment_first_seq == 4
    names = sorted(p.name for p in (tmp_path / "queue" / "wal").iterdir())
    assert [int(n.split(".")[0]) for n in names] == [1, 4]
    journal.write_snapshot_at(at, chain, b'{"state":3}')
    journal.close()
    applied: list[int] = []
    loaded: list[bytes] = []
    reader = Journal(backend, str(tmp_path / "queue"), tag)
    recovered = reader.replay(lambda s, body: applied.append(s), loaded.append)
    assert loaded == [b'{"state":3}'] and applied == [4, 5] and recovered.last_seq == 5
    assert sorted(p.name for p in (tmp_path / "queue" / "wal").iterdir()) == [names[1]]


@pytest.mark.timeout(60)
def test_close_abandons_a_background_snapshot_instead_of_waiting_for_its_rebuild(
    make: Any, store: SharedFilesystemStore, hook: Hook, monkeypatch: pytest.MonkeyPatch
) -> None:
    coord = make()
    (lease,) = leases(coord, 1)
    receipt = complete(coord, lease)
    due(monkeypatch)
    hook.hold = "after_segment_switch"  # the thread is held before its rebuild (J5.3)
    switch_point = coord.journal.sequence
    caller = threading.Thread(target=coord.release_task_reads, args=([],))
    caller.start()  # its frame follows the switch point: it waits for the next segment
    assert hook.reached.wait(WAIT_S)
    waiting = threading.Event()
    real_await = coord._await_snapshot

    def awaiting() -> BaseException | None:
        waiting.set()  # close() has marked the coordinator closed and now waits for the thread
        return real_await()

    monkeypatch.setattr(coord, "_await_snapshot", awaiting)
    closer = threading.Thread(target=coord.close)
    closer.start()
    assert waiting.wait(WAIT_S)
    hook.go.set()
    closer.join(WAIT_S)
    caller.join(WAIT_S)
    assert not closer.is_alive() and not caller.is_alive()
    # The thread wrote nothing (close() writes its own snapshot if anything came after the
    # switch): no snapshot of the switch point, no failure counted.
    assert switch_point not in snapshots(coord)
    assert coord._counters["snapshots_failed"] == 0 and coord._snapshot_error is None
    again = make(recover=True)
    assert again.lookup_submission("s-t0") == receipt


@pytest.mark.timeout(120)
def test_threads_working_through_back_to_back_snapshots_lose_nothing(
    make: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four threads acquire and complete while a snapshot is due after every call, so the
    switch point, the batch split and the segment switch meet concurrent group commits."""
    import straw._journal.log as journal_log

    monkeypatch.setattr(journal_log, "JOURNAL_PREALLOC_BYTES", 64 * 1024)  # small segments
    coord = make()
    count, threads = 120, 4
    coord.submit_tasks("tasks", [TaskSpec(f"t{i:03d}") for i in range(count)])
    due(monkeypatch)
    receipts: list[Any] = []
    errors: list[BaseException] = []

    def work() -> None:
        try:
            while True:
                got = coord.acquire(threading.current_thread().name, 2)
                if got.status != "acquired":
                    return
                for assignment in got.assignments:
                    receipts.append(complete(coord, assignment.lease))
        except BaseException as error:  # reported by the test thread
            errors.append(error)

    pool = [threading.Thread(target=work, name=f"w{k}") for k in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join(WAIT_S * 3)
    assert not errors and not any(t.is_alive() for t in pool)
    assert coord._await_snapshot() is None
    assert coord.metrics()["journal"]["snapshots"] >= 2
    assert sorted(r.position for r in receipts) == list(range(count))
    qh.crash(coord)
    again = make(recover=True)
    assert [again.lookup_submission(r.submission_id) for r in receipts] == receipts
    assert {t["state"] for t in again.tasks.values()} == {"completed"}


@pytest.mark.timeout(60)
def test_a_background_snapshot_hands_free_memory_back_once_its_copy_is_gone(
    make: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/QUEUE.md "The C allocator": after each background snapshot the thread returns the
    C heap's free pages (malloc_trim), with the state copy it wrote already freed."""
    import gc
    import weakref

    from straw import _memory
    from straw._queue.machine import QueueState

    copies: list[weakref.ref[QueueState]] = []
    copy = QueueState.snapshot_copy

    def snapshot_copy(state: QueueState) -> QueueState:
        made = copy(state)
        copies.append(weakref.ref(made))
        return made

    alive_at_release: list[bool] = []

    def release() -> bool:
        gc.collect()
        alive_at_release.append(any(ref() is not None for ref in copies))
        return True

    monkeypatch.setattr(QueueState, "snapshot_copy", snapshot_copy)
    monkeypatch.setattr(_memory, "release_free_memory", release)
    coord = make()
    (lease,) = leases(coord, 1)
    due(monkeypatch)
    complete(coord, lease)  # starts the snapshot, returns
    assert coord._await_snapshot() is None and snapshots(coord)
    assert len(copies) == 1 and alive_at_release == [False]  # once, with the copy already gone


def test_releasing_free_memory_works_where_the_c_library_is_glibc() -> None:
    import platform

    from straw import _memory

    glibc = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"
    assert _memory.release_free_memory() is glibc
