"""Issue 11, items 3 and 4 and the smaller validation gaps: every journaled argument is checked
before anything durable happens, and every failure a caller meets is a straw error.

Before the fix: ``submit_tasks(..., producer_id=5)`` was journaled and later broke every
snapshot (and so ``close()`` and, past the snapshot threshold, every mutating call, across
recovery); a training ``progress_ref`` that is not a ``json.v1`` progress record was accepted
and then failed every ``collect_garbage`` and crashed ``straw check``; lists of dicts, lone
surrogates, non-string metadata keys, ``failure=None``, ``retryable="no"``, unknown update
keys, the same lease twice, unbounded ids and states, 5,000-deep metadata, a pool in ``""``,
``segment_target_bytes=True`` and ``clock=5`` were accepted or failed deep inside; and a full
disk during a snapshot (from ``close()`` or from a mutating call past the threshold) raised a
bare ``OSError``. Each case here: a clear error naming the argument, nothing changed (the
caller's view and every journal byte), and the queue still snapshots, closes and recovers.
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import queue_helpers as qh
import straw.coordinator as coordinator_module
from straw import Coordinator, SharedFilesystemStore
from straw._fs.system import installed
from straw._inspect.check import check_pool
from straw.backend import FilesystemBackend
from straw.errors import (
    IndeterminateCommit,
    QuotaExceeded,
    ResourceLimitExceeded,
    StorageUnavailable,
    UnsafeRecovery,
    UnsupportedSchema,
)
from straw.limits import FAILURE_BYTES_MAX, PRODUCER_STATE_BYTES_MAX, QUEUE_ID_BYTES_MAX
from straw.protocol import Record, RecordSetRef, TaskSpec, encode
from straw.testing import FaultFS
from straw.testing.faultfs import FAULT_KINDS

RUN = "run-inputs"


def _deep(levels: int) -> dict[str, Any]:
    top: dict[str, Any] = {}
    node = top
    for _ in range(levels):
        node["a"] = {}
        node = node["a"]
    return top


def _json(store: SharedFilesystemStore, name: str, body: object, codec: str = "json.v1") -> RecordSetRef:
    payload = body if isinstance(body, bytes) else encode(body)
    return store.publish([Record(name, payload, codec=codec)], submission_id=f"json-{name}")


@pytest.fixture
def queue(tmp_path: Path) -> Iterator[tuple[SharedFilesystemStore, Coordinator]]:
    store = SharedFilesystemStore(tmp_path / "pool", RUN)
    coord = Coordinator(store, exclusive_owner="inputs", clock=qh.Clock())
    yield store, coord
    coord.close()
    store.close()


def _refused(coord: Coordinator, error: type[BaseException], fragment: str, call: Callable[[], Any]) -> None:
    """The call raises ``error`` (message containing ``fragment``) and changes nothing."""
    before, files = qh.observe(coord), qh.directory_files(coord.directory)
    with pytest.raises(error, match=fragment):
        call()
    assert qh.observe(coord) == before, fragment
    assert qh.directory_files(coord.directory) == files, fragment


def test_producer_id_and_state_are_checked_before_they_are_journaled(
    queue: tuple[SharedFilesystemStore, Coordinator], monkeypatch: pytest.MonkeyPatch
) -> None:
    store, coord = queue
    cases: list[tuple[type[BaseException], str, Callable[[], Any]]] = [
        (ValueError, "producer_id", lambda: coord.submit_tasks("r1", [TaskSpec("t")], producer_id=5)),  # type: ignore[arg-type]
        (ValueError, "producer_id", lambda: coord.submit_tasks("r2", [TaskSpec("t")], producer_id="")),
        (ValueError, "needs a producer_id", lambda: coord.submit_tasks("r3", [], producer_state={"at": 1})),
        (
            TypeError,
            "producer_state has a key 1",
            lambda: coord.submit_tasks("r4", [], producer_id="p", producer_state={1: "x"}),
        ),
        (
            ValueError,
            "producer_state holds nan",
            lambda: coord.submit_tasks("r5", [], producer_id="p", producer_state=float("nan")),
        ),
        (
            TypeError,
            "producer_state holds a bytes",
            lambda: coord.submit_tasks("r6", [], producer_id="p", producer_state=b"cursor"),
        ),
        (
            ResourceLimitExceeded,
            "producer_state is",
            lambda: coord.submit_tasks(
                "r7", [], producer_id="p", producer_state="x" * (PRODUCER_STATE_BYTES_MAX + 1)
            ),
        ),
        (
            ResourceLimitExceeded,
            "producer_id is",
            lambda: coord.submit_tasks("r8", [], producer_id="p" * (QUEUE_ID_BYTES_MAX + 1)),
        ),
    ]
    for error, fragment, call in cases:
        _refused(coord, error, fragment, call)
    # A valid producer state survives a snapshot (forced at every call) and a recovery.
    monkeypatch.setattr(coordinator_module, "JOURNAL_SNAPSHOT_BYTES_MIN", 1)
    coord.submit_tasks("ok", [TaskSpec("t1")], producer_id="p", producer_state={"cursor": [1, "two"]})
    coord.submit_tasks("ok2", [TaskSpec("t2")])
    coord.close()
    with Coordinator(store, exclusive_owner="inputs", recover=True) as again:
        assert again.producer_state("p") == {"cursor": [1, "two"]}
        assert sorted(again.tasks) == ["t1", "t2"]


def test_task_ids_and_metadata_are_checked(queue: tuple[SharedFilesystemStore, Coordinator]) -> None:
    _, coord = queue
    cases: list[tuple[type[BaseException], str, Callable[[], Any]]] = [
        (ValueError, "task_id is not valid Unicode", lambda: coord.submit_tasks("s1", [TaskSpec("t\ud800")])),
        (
            ValueError,
            "request_id is not valid Unicode",
            lambda: coord.submit_tasks("s\udfff", [TaskSpec("t")]),
        ),
        (ResourceLimitExceeded, "task_id is", lambda: coord.submit_tasks("s2", [TaskSpec("t" * 2000)])),
        (
            TypeError,
            "metadata has a key 1",
            lambda: coord.submit_tasks("s3", [TaskSpec("t", metadata={1: "x"})]),
        ),
        (
            TypeError,
            "metadata has a key 2",
            lambda: coord.submit_tasks("s4", [TaskSpec("t", metadata={"a": [{2: "x"}]})]),
        ),
        (
            ResourceLimitExceeded,
            "nests deeper",
            lambda: coord.submit_tasks("s5", [TaskSpec("t", metadata=_deep(5000))]),
        ),
        (
            ValueError,
            "not valid Unicode",
            lambda: coord.submit_tasks("s6", [TaskSpec("t", metadata={"k": "\ud800"})]),
        ),
        (TypeError, "list of TaskSpec", lambda: coord.submit_tasks("s7", TaskSpec("t"))),  # type: ignore[arg-type]
        (TypeError, "TaskSpec objects", lambda: coord.submit_tasks("s8", [{"task_id": "t"}])),  # type: ignore[list-item]
    ]
    for error, fragment, call in cases:
        _refused(coord, error, fragment, call)
    circular: dict[str, Any] = {}
    circular["self"] = circular
    _refused(
        coord,
        ResourceLimitExceeded,
        "contains itself",
        lambda: coord.submit_tasks("s9", [TaskSpec("t", metadata=circular)]),
    )


def test_lease_lists_updates_and_failures_are_checked(
    queue: tuple[SharedFilesystemStore, Coordinator],
) -> None:
    store, coord = queue
    ref = _json(store, "input", {"x": 1})
    coord.submit_tasks("submit", [TaskSpec("a", input_ref=ref), TaskSpec("b", input_ref=ref)])
    lease = coord.acquire("w").assignments[0].lease
    cases: list[tuple[type[BaseException], str, Callable[[], Any]]] = [
        (TypeError, "item 0 is a dict", lambda: coord.release_tasks([{}], request_id="r1")),  # type: ignore[list-item]
        (TypeError, "one Lease", lambda: coord.release_tasks(lease, request_id="r2")),  # type: ignore[arg-type]
        (TypeError, "item 1 is a str", lambda: coord.release_task_reads([lease, "a"])),  # type: ignore[list-item]
        (TypeError, "item 0 is a dict", lambda: coord.heartbeat([{}])),  # type: ignore[list-item]
        (
            TypeError,
            "failure must be a string",
            lambda: coord.fail_task(lease, request_id="f1", failure=None),
        ),  # type: ignore[arg-type]
        (TypeError, "failure must be a string", lambda: coord.fail_task(lease, request_id="f2", failure=3)),  # type: ignore[arg-type]
        (
            ResourceLimitExceeded,
            "failure is",
            lambda: coord.fail_task(lease, request_id="f3", failure="x" * (FAILURE_BYTES_MAX + 1)),
        ),
        (
            TypeError,
            "retryable must be True or False",
            lambda: coord.fail_task(lease, request_id="f4", failure="x", retryable="no"),  # type: ignore[arg-type]
        ),
        (TypeError, "fail_task takes a Lease", lambda: coord.fail_task({}, request_id="f5", failure="x")),  # type: ignore[arg-type]
        (
            ValueError,
            "unknown keys \\['prio'\\]",
            lambda: coord.yield_tasks([{"lease": lease, "input_ref": None, "prio": 1}], request_id="y1"),
        ),
        (TypeError, "needs a Lease", lambda: coord.yield_tasks([{"lease": "a"}], request_id="y2")),
        (TypeError, "update 0 is a Lease", lambda: coord.yield_tasks([lease], request_id="y3")),  # type: ignore[list-item]
        (
            TypeError,
            "yield metadata has a key 1",
            lambda: coord.yield_tasks(
                [{"lease": lease, "input_ref": None, "metadata": {1: 2}}], request_id="y4"
            ),
        ),
        (
            ValueError,
            "unknown keys \\['priority'\\]",
            lambda: coord.save_task_progress_many(
                [{"lease": lease, "input_ref": ref, "priority": 1}], request_id="p1"
            ),
        ),
        (
            ValueError,
            "missing input_ref",
            lambda: coord.save_task_progress_many([{"lease": lease}], request_id="p2"),
        ),
        (
            ValueError,
            "same task twice",
            lambda: coord.save_task_progress_many(
                [{"lease": lease, "input_ref": ref}, {"lease": lease, "input_ref": ref}], request_id="p3"
            ),
        ),
        (
            TypeError,
            "complete_task takes a Lease",
            lambda: coord.complete_task(
                {},
                submission_id="c",
                result_ref=ref,
                result_digest=ref.digest,  # type: ignore[arg-type]
            ),
        ),
        (ValueError, "worker_id is not valid Unicode", lambda: coord.acquire("w\ud800")),
        (ValueError, "checkpoint_id", lambda: coord.release_checkpoint("")),
        (TypeError, "checkpoint_ref must be a RecordSetRef", lambda: coord.register_checkpoint("ck", None)),  # type: ignore[arg-type]
    ]
    for error, fragment, call in cases:
        _refused(coord, error, fragment, call)
    # The queue still works: the same lease fails cleanly, and the queue closes and recovers.
    assert coord.fail_task(lease, request_id="f-ok", failure="tried", retryable=False) == "failed"
    coord.close()
    with Coordinator(store, exclusive_owner="inputs", recover=True) as again:
        assert again.task_status("a")["failure"] == "tried"


@pytest.mark.parametrize(
    ("body", "codec", "fragment"),
    [
        (b"not json at all", "bytes.v1", "json.v1, this one is 'bytes.v1'"),
        (b"{broken", "json.v1", "holds JSON"),
        ([1, 2], "json.v1", "version: 1"),
        ({"version": 2, "processed_positions": [0]}, "json.v1", "version: 1"),
        ({"version": 1, "processed_positions": [-1]}, "json.v1", "non-negative integers"),
        ({"version": 1, "processed_positions": [1.5]}, "json.v1", "non-negative integers"),
        ({"version": 1, "processed_positions": [True]}, "json.v1", "non-negative integers"),
        ({"version": 1, "processed_positions": "0"}, "json.v1", "non-negative integers"),
        ({"version": 1, "finished_batches": [3]}, "json.v1", "batch id strings"),
    ],
)
def test_a_training_progress_record_that_gc_cannot_read_is_refused(
    tmp_path: Path, body: object, codec: str, fragment: str
) -> None:
    """Before: accepted, then every collect_garbage failed and check/inspect crashed."""
    root = tmp_path / "pool"
    store = SharedFilesystemStore(root, RUN)
    coord = Coordinator(store, exclusive_owner="inputs", clock=qh.Clock())
    coord.submit_tasks("submit", [TaskSpec("a")])
    qh.work_one(coord, "w")
    token = coord.open_consumer("training", exclusive_owner="trainer")
    state = _json(store, "state", {"s": 1})
    bad = _json(store, "progress", body, codec=codec)
    for call in (
        lambda: coord.save_consumer_state(
            "training",
            token=token,
            request_id="s",
            state_ref=state,
            fetch_cursor=1,
            processed_cursor=0,
            progress_ref=bad,
        ),
        lambda: coord.batch_ready(
            "training",
            token=token,
            batch_id="b",
            ready_ref=state,
            state_ref=state,
            fetch_cursor=1,
            processed_cursor=0,
            progress_ref=bad,
        ),
    ):
        _refused(coord, UnsupportedSchema, "progress_ref of consumer 'training'", call)
        with pytest.raises(UnsupportedSchema, match=fragment):
            call()
    good = _json(store, "good", {"version": 1, "processed_positions": [0], "finished_batches": []})
    coord.save_consumer_state(
        "training",
        token=token,
        request_id="s",
        state_ref=state,
        fetch_cursor=1,
        processed_cursor=0,
        progress_ref=good,
    )
    coord.collect_garbage()
    coord.close()
    store.close()
    assert check_pool(root).ok


def test_store_and_coordinator_arguments_are_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="root must name the pool's directory"):
        SharedFilesystemStore("", RUN)
    with pytest.raises(TypeError, match="root must be a path"):
        SharedFilesystemStore(None, RUN)  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == [], "no pool was made in the current directory"
    with pytest.raises(ValueError, match="segment_target_bytes"):
        SharedFilesystemStore(tmp_path / "pool", RUN, segment_target_bytes=True)
    unicode = SharedFilesystemStore(tmp_path / "pool", RUN)
    with pytest.raises(ValueError, match="record_id is not valid Unicode"):
        unicode.publish([Record("r\ud800", b"x")], submission_id="s")
    unicode.close()
    store = SharedFilesystemStore(tmp_path / "pool", RUN)
    for bad in (None, 7):
        with pytest.raises(TypeError, match="explain takes a pool-relative pack path"):
            store.explain(bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="clock must be a callable"):
        Coordinator(store, exclusive_owner="o", clock=5)  # type: ignore[arg-type]
    assert not (tmp_path / "pool" / "queue" / "wal").exists() or not any(
        (tmp_path / "pool" / "queue" / "wal").iterdir()
    )
    # The refused constructor left the queue free: a real one opens it.
    Coordinator(store, exclusive_owner="o").close()
    store.close()


# --------------------------------------------------------------------------- item 4: full disks


FS_ROOT = "/r/pool"


def _fs_store() -> SharedFilesystemStore:
    backend = FilesystemBackend(FS_ROOT, sleep=lambda _: None, visibility_delays=())
    return SharedFilesystemStore(FS_ROOT, RUN, backend=backend)


# Every file-system call close() or a snapshot makes can meet a full disk; the sweep fails
# each one in turn (kind, then position) until the fault no longer fires. Bounded: FaultFS is
# in memory and close() makes a few dozen calls.
SWEEP_SKIPS_MAX = 40


def _full_disk_sweep(kind: str, act: Callable[[Coordinator, FaultFS], str | None]) -> list[str]:
    """Fail the ``skip``-th ``kind`` call of ``act`` with ENOSPC for skip = 0, 1, ... until the
    fault does not fire; each time: only straw errors (a full disk as ``QuotaExceeded``), then a
    recovery that keeps every acknowledged fact. The outcome of each position."""
    outcomes: list[str] = []
    for skip in range(SWEEP_SKIPS_MAX):
        fs = FaultFS(skip, garble_probability=0.0, tear_probability=0.0, short_write_probability=0.0)
        fs.makedirs_durable("/r")
        with installed(fs):
            store = _fs_store()
            coord = Coordinator(store, exclusive_owner="o", clock=qh.Clock())
            coord.submit_tasks("submit", [TaskSpec(f"t{i}") for i in range(3)])
            receipt = qh.work_one(coord, "w")
            fs.fail_next(kind, errno.ENOSPC, skip=skip)
            try:
                extra = act(coord, fs)
                outcome = "ok"
            except (QuotaExceeded, IndeterminateCommit) as error:
                # Never a bare OSError, never StorageUnavailable hiding the full disk.
                assert "No space left" in str(error), error
                extra, outcome = None, type(error).__name__
            skipped = coord._snapshot_error  # a background snapshot that met the full disk (J5)
            if skipped is not None:
                assert isinstance(skipped, QuotaExceeded) and "No space left" in str(skipped), skipped
                outcome += "+snapshot skipped"
            if fs.disarm():
                return outcomes  # the fault no longer fires: every position was tried
            with contextlib.suppress(StorageUnavailable, UnsafeRecovery):
                coord.close()  # a stopped coordinator (J3) may refuse; reopened below
            with Coordinator(store, exclusive_owner="o", recover=True, clock=qh.Clock()) as again:
                assert again.lookup_submission("sub-t0") == receipt, (kind, skip)
                tasks = sorted(again.tasks)
                assert tasks[:3] == ["t0", "t1", "t2"], (kind, skip)
                if extra is not None:  # acknowledged by the damaged call: kept
                    assert extra in tasks, (kind, skip)
            outcomes.append(f"{skip}:{outcome}")
    raise AssertionError(f"the {kind} fault still fires after {SWEEP_SKIPS_MAX} calls")


def _close(coord: Coordinator, fs: FaultFS) -> None:
    coord.close()


@pytest.mark.parametrize("kind", FAULT_KINDS)
def test_a_full_disk_anywhere_in_close_raises_quota_exceeded_and_loses_nothing(kind: str) -> None:
    """Before: close() let a bare OSError out (ENOSPC zero-filling the next segment).

    close() writes a snapshot, starts the next segment with its zeros and records the
    queue's owner; a full disk at any of these raises ``QuotaExceeded``. Where the failed
    call only tidies (trimming the old segment's zeros, removing a leftover name, the last
    sync of a segment nothing acknowledged is in), close() returns: nothing depends on it.
    """
    outcomes = _full_disk_sweep(kind, _close)
    if kind in ("open", "write", "sync"):
        assert "0:QuotaExceeded" in outcomes, outcomes  # the snapshot's own file
    if kind == "write":  # the next segment's zero fill (issue 11's case) is the second write
        assert outcomes[:2] == ["0:QuotaExceeded", "1:QuotaExceeded"], outcomes


def _submit_past_threshold(coord: Coordinator, fs: FaultFS) -> str | None:
    """A call that starts a snapshot, run in the calling thread so that the sweep meets the
    same file-system calls in the same order every time (J5 runs in the background otherwise)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(coordinator_module, "JOURNAL_SNAPSHOT_BYTES_MIN", 1)
        patch.setattr(coordinator_module, "SNAPSHOTS_IN_BACKGROUND", False)
        try:
            coord.submit_tasks("more", [TaskSpec("t3")])
        except UnsafeRecovery as error:
            # The next segment was visible when the full disk struck: the journal stopped (J3).
            assert "No space left" in str(error), error
            return None
    return "t3"


@pytest.mark.parametrize("kind", FAULT_KINDS)
def test_a_full_disk_at_the_snapshot_threshold_never_refuses_the_call_and_loses_nothing(kind: str) -> None:
    """Before: every mutating call past the threshold let a bare OSError out of _maybe_snapshot.

    Now the snapshot never refuses the call (issue 12 item 2): a full disk before the next
    segment exists skips the snapshot (``QuotaExceeded`` kept for ``metrics()``) and the call
    goes through; once the segment is visible it stops the coordinator (``UnsafeRecovery``
    naming the full disk, J3); on the call's own journal write it is ``IndeterminateCommit``;
    never a bare ``OSError``, never a loss of an acknowledged call.
    """
    outcomes = _full_disk_sweep(kind, _submit_past_threshold)
    if kind in ("open", "write", "sync"):
        # The next segment's temporary file: nothing visible changed, the call went through.
        assert outcomes[0] == "0:ok+snapshot skipped", outcomes
    if kind == "write":  # the snapshot's own file (after the switch) is skipped too
        assert "ok+snapshot skipped" in outcomes[1], outcomes


def _fs_files(fs: FaultFS, directory: str) -> dict[str, bytes]:
    """Every journal segment and snapshot of a queue on ``fs``, with its bytes."""
    return {
        f"{sub}/{name}": fs.read_bytes(f"{directory}/{sub}/{name}")
        for sub in ("wal", "snap")
        for name in sorted(fs.listdir(f"{directory}/{sub}"))
    }


def _mutating_calls(coord: Coordinator, store: SharedFilesystemStore) -> dict[str, Callable[[], Any]]:
    """One call of each kind that journals, set up so that it would succeed (heartbeats are not
    journaled, J6)."""
    held = coord.acquire("holder").assignments[0].lease
    meta = {"task_id": held.task_id, "attempt_id": held.attempt_id}
    ref = store.publish([Record("out", b"o" * 40, metadata=meta)], submission_id="out")
    return {
        "acquire": lambda: coord.acquire("w2"),
        "release_tasks": lambda: coord.release_tasks([held], request_id="rel"),
        "fail_task": lambda: coord.fail_task(held, request_id="fail", failure="x"),
        "complete_task": lambda: coord.complete_task(
            held, submission_id="done", result_ref=ref, result_digest=ref.digest
        ),
        "submit_tasks": lambda: coord.submit_tasks("more", [TaskSpec("t9")]),
        "register_checkpoint": lambda: coord.register_checkpoint("ck", ref),
    }


@pytest.mark.parametrize(
    "call",
    [
        "acquire",
        "release_tasks",
        "fail_task",
        "complete_task",
        "submit_tasks",
        "register_checkpoint",
    ],
)
def test_every_mutating_call_past_the_threshold_goes_through_a_full_disk_in_its_snapshot(
    call: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk where the snapshot (J5) starts the next segment gives the snapshot up and
    changes no file but the call's own frame: the call succeeds, the error is kept for
    ``metrics()``, and once space is back the next snapshot goes through."""
    fs = FaultFS(1, garble_probability=0.0, tear_probability=0.0, short_write_probability=0.0)
    fs.makedirs_durable("/r")
    with installed(fs):
        store = _fs_store()
        coord = Coordinator(store, exclusive_owner="o", clock=qh.Clock())
        coord.submit_tasks("submit", [TaskSpec(f"t{i}") for i in range(3)])
        act = _mutating_calls(coord, store)[call]
        monkeypatch.setattr(coordinator_module, "JOURNAL_SNAPSHOT_BYTES_MIN", 1)
        monkeypatch.setattr(coordinator_module, "SNAPSHOTS_IN_BACKGROUND", False)
        files = _fs_files(fs, coord.directory)
        fs.fail_next("write", errno.ENOSPC)
        act()
        assert not fs.disarm(), "the snapshot met the full disk"
        assert isinstance(coord._snapshot_error, QuotaExceeded)
        assert "QuotaExceeded" in coord.metrics()["snapshot_error"]
        assert sorted(_fs_files(fs, coord.directory)) == sorted(files)  # no segment, no snapshot
        coord.release_task_reads([])  # space again: this call's snapshot goes through
        assert coord._snapshot_error is None
        assert any(name.startswith("snap/") for name in _fs_files(fs, coord.directory))
        coord.close()


@pytest.mark.parametrize(
    "body",
    [b"not json", {"version": 1, "processed_positions": [-1]}, {"version": 1, "processed_positions": ["x"]}],
)
def test_a_bad_progress_record_already_journaled_is_a_finding_not_a_crash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: object
) -> None:
    """A journal written before the check (simulated by skipping it): collection fails closed,
    ``straw check`` reports an error and ``straw inspect`` prints the pool (before: tracebacks)."""
    from straw._inspect.view import inspect_pool

    root = tmp_path / "pool"
    store = SharedFilesystemStore(root, RUN)
    coord = Coordinator(store, exclusive_owner="inputs", clock=qh.Clock())
    coord.submit_tasks("submit", [TaskSpec("a")])
    receipt = qh.work_one(coord, "w")
    token = coord.open_consumer("training", exclusive_owner="trainer")
    monkeypatch.setattr(Coordinator, "_check_progress", lambda *args: None)
    coord.save_consumer_state(
        "training",
        token=token,
        request_id="s",
        state_ref=_json(store, "state", {"s": 1}),
        fetch_cursor=1,
        processed_cursor=0,
        progress_ref=_json(store, "progress", body),
    )
    with pytest.raises(UnsupportedSchema, match="progress record"):
        coord.collect_garbage()
    coord.close()
    store.close()
    report = check_pool(root)
    codes = {(f.code, f.severity) for f in report.findings}
    assert ("root.unreadable", "error") in codes and not report.ok
    assert any("progress record cannot be used" in f.message for f in report.findings)
    assert inspect_pool(root)["queues"][0]["commits"] == 1
    with SharedFilesystemStore(root, RUN) as reader:
        assert [r.record_id for r in reader.read(receipt.result_ref)] == ["out-a"]
