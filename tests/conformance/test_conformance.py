"""The behaviours straw shares with straw-queue (issue 10), stated once and proven on both.

Run by ``make test`` against straw and by ``make compat`` against straw and the peer venv.
Only the public API is used; nothing here reads file names or bytes of either format.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from straw import Coordinator, Limits, Publication, Record, SharedFilesystemStore, TaskSpec
from straw.errors import CorruptData, InvalidReference, StorageUnavailable, UnsafeRecovery

TRAINING = "training"


# ------------------------------------------------------------------------------ helpers


def tagged(lease: Any, record_id: str, payload: bytes) -> Record:
    """A result record naming the task and attempt it belongs to (the queue checks it)."""
    return Record(record_id, payload, metadata={"task_id": lease.task_id, "attempt_id": lease.attempt_id})


def run_task(queue: Coordinator, store: SharedFilesystemStore, name: str) -> Any:
    """Submit, take and complete one task with a fresh result publication; its receipt."""
    queue.submit_tasks(f"submit-{name}", [TaskSpec(name)])
    lease = queue.acquire(f"worker-{name}").assignments[0].lease
    ref = store.publish([tagged(lease, name, f"out-{name}".encode())], submission_id=f"out-{name}")
    return queue.complete_task(lease, submission_id=f"done-{name}", result_ref=ref, result_digest=ref.digest)


def progress_state(store: SharedFilesystemStore, name: str) -> Any:
    return store.publish([Record(name, b"trainer state")], submission_id=name)


def acknowledge(queue: Coordinator, token: str, state: Any, name: str, cursor: int) -> Any:
    return queue.save_consumer_state(
        TRAINING, token=token, request_id=name, state_ref=state, fetch_cursor=cursor, processed_cursor=cursor
    )


def readable(store: SharedFilesystemStore, ref: Any) -> bool:
    try:
        list(store.read(ref))
    except (InvalidReference, StorageUnavailable, CorruptData):
        return False
    return True


@pytest.fixture
def queue(pool: Path) -> Any:
    store = SharedFilesystemStore(pool, "conformance", online_gc=True)
    coordinator = Coordinator(store, exclusive_owner="conformance test")
    yield coordinator
    coordinator.close()
    store.close()


# --------------------------------------------------------------- 1. adoption ends staging


def test_an_acknowledged_result_is_reclaimed_while_its_writer_lives(queue: Coordinator, pool: Path) -> None:
    worker = SharedFilesystemStore(pool, "conformance", online_gc=True, segment_target_bytes=0)
    receipt = run_task(queue, worker, "a")  # the worker never calls release_publications
    states = SharedFilesystemStore(pool, "conformance", online_gc=True)
    token = queue.open_consumer(TRAINING, exclusive_owner="trainer")
    acknowledge(queue, token, progress_state(states, "s1"), "ack", 1)
    queue.collect_garbage()
    assert not readable(worker, receipt.result_ref)
    worker.close()
    states.close()


def test_an_explicit_retain_keeps_the_result_after_acknowledgement(queue: Coordinator, pool: Path) -> None:
    worker = SharedFilesystemStore(pool, "conformance", online_gc=True, segment_target_bytes=0)
    receipt = run_task(queue, worker, "a")
    worker.retain("kept", [receipt.result_ref])
    token = queue.open_consumer(TRAINING, exclusive_owner="trainer")
    acknowledge(queue, token, progress_state(worker, "s1"), "ack", 1)
    queue.collect_garbage()
    assert next(worker.read(receipt.result_ref)).payload == b"out-a"
    worker.close()


# ------------------------------------------------- 2 and 4. recovery, owners and consumers


def test_recovery_takes_any_owner_text_but_not_changed_limits(pool: Path) -> None:
    store = SharedFilesystemStore(pool, "conformance")
    first = Coordinator(store, exclusive_owner="first owner", limits=Limits(pending_tasks=50))
    first.submit_tasks("s", [TaskSpec("t")])
    first.close()
    with pytest.raises((UnsafeRecovery, ValueError)):
        Coordinator(store, exclusive_owner="x", limits=Limits(pending_tasks=60), recover=True)
    second = Coordinator(store, exclusive_owner="a new owner", limits=Limits(pending_tasks=50), recover=True)
    assert second.task_status("t")["state"] == "pending"
    second.close()
    store.close()


def test_a_consumer_has_one_live_owner_until_recovery(pool: Path) -> None:
    store = SharedFilesystemStore(pool, "conformance")
    first = Coordinator(store, exclusive_owner="first")
    first.open_consumer(TRAINING, exclusive_owner="trainer one")
    with pytest.raises(UnsafeRecovery):
        first.open_consumer(TRAINING, exclusive_owner="trainer two")
    first.close()
    recovered = Coordinator(store, exclusive_owner="second", recover=True)
    assert isinstance(recovered.open_consumer(TRAINING, exclusive_owner="trainer two"), str)
    recovered.close()
    store.close()


def test_recovery_without_a_declared_owner_is_unsafe(pool: Path) -> None:
    store = SharedFilesystemStore(pool, "conformance")
    Coordinator(store, exclusive_owner="first").close()
    with pytest.raises(UnsafeRecovery):
        Coordinator(store, exclusive_owner="", recover=True)
    store.close()


# ---------------------------------------------------------------------- 3. consumer rewind


def _history(queue: Coordinator, pool: Path, *, checkpoint: bool) -> tuple[Any, Any, str, Any]:
    worker = SharedFilesystemStore(pool, "conformance", online_gc=True, segment_target_bytes=0)
    receipt = run_task(queue, worker, "a")
    states = SharedFilesystemStore(pool, "conformance", online_gc=True)
    if checkpoint:
        saved = states.publish(
            [Record("ckpt", b"c")], submission_id="ckpt", dependencies=[receipt.result_ref]
        )
        states.retain("checkpoint", [saved])
    token = queue.open_consumer(TRAINING, exclusive_owner="trainer")
    state = progress_state(states, "state")
    acknowledge(queue, token, state, "advance", 1)
    queue.collect_garbage()
    worker.close()
    return states, receipt, token, state


def test_a_rewind_to_a_checkpoint_makes_its_history_readable_again(queue: Coordinator, pool: Path) -> None:
    states, receipt, token, state = _history(queue, pool, checkpoint=True)
    with pytest.raises(InvalidReference, match="released"):
        queue.read_commits(0, 1)
    acknowledge(queue, token, state, "restore", 0)
    assert queue.read_commits(0, 1).commits == (receipt,)
    states.release("checkpoint")  # the queue owns the history again: it outlives the checkpoint
    queue.collect_garbage()
    assert next(states.read(receipt.result_ref)).payload == b"out-a"
    assert queue.load_consumer_state(TRAINING)["processed_cursor"] == 0
    states.close()


def test_a_rewind_over_reclaimed_history_is_refused_and_changes_nothing(
    queue: Coordinator, pool: Path
) -> None:
    states, _, token, state = _history(queue, pool, checkpoint=False)
    with pytest.raises((InvalidReference, StorageUnavailable)):
        acknowledge(queue, token, state, "restore", 0)
    assert queue.load_consumer_state(TRAINING)["processed_cursor"] == 1
    states.close()


# --------------------------------------------------------------------------- 5. accounting


def test_payload_bytes_and_tokens_count_every_dependency_edge(pool: Path) -> None:
    with SharedFilesystemStore(pool, "conformance") as store:
        blob = store.publish([Record("blob", b"12345", tokens=3)], submission_id="blob")
        top = store.publish([Record("top", b"ab", tokens=1)], submission_id="top", dependencies=[blob, blob])
        assert (top.payload_bytes, top.tokens) == (2 + 5 + 5, 1 + 3 + 3)
        local = store.publish_many(
            [Publication((Record("x", b"xyz"),)), Publication((Record("y", b"y"),), (0,))],
            submission_id="local",
        )
        assert local[1].payload_bytes == 4


# --------------------------------------------------------------- 6. call forms and values


def test_task_updates_take_objects_or_their_dict_forms(queue: Coordinator, pool: Path) -> None:
    store = queue.store
    first = store.publish([Record("in", b"input")], submission_id="in")
    queue.submit_tasks("s", [TaskSpec("a", input_ref=first), TaskSpec("b", input_ref=first)])
    leases = {a.lease.task_id: a.lease for a in queue.acquire("w", max_tasks=2).assignments}
    saved = {
        name: store.publish([Record(name, b"partial")], submission_id=f"partial-{name}") for name in leases
    }
    updates = [
        {"lease": dataclasses.asdict(leases["a"]), "input_ref": dataclasses.asdict(saved["a"])},
        {"lease": leases["b"], "input_ref": saved["b"]},
    ]
    assert queue.save_task_progress_many(updates, request_id="p") == "saved"
    later = {name: store.publish([Record(name, b"later")], submission_id=f"later-{name}") for name in leases}
    again = [{"lease": dataclasses.asdict(leases["a"]), "input_ref": dataclasses.asdict(later["a"])}]
    again.append({"lease": leases["b"], "input_ref": later["b"]})
    assert queue.yield_tasks(again, request_id="y") == "pending"
    assert queue.task_status("a")["state"] == "pending"
    assert queue.acquire("w2", max_tasks=1).assignments


def test_a_failure_may_be_text_or_a_json_object(queue: Coordinator, pool: Path) -> None:
    queue.submit_tasks("s", [TaskSpec("a"), TaskSpec("b")])
    first, second = (a.lease for a in queue.acquire("w", max_tasks=2).assignments)
    queue.fail_task(first, request_id="f1", failure={"reason": "engine down", "code": 7}, retryable=False)
    queue.fail_task(second, request_id="f2", failure="plain words", retryable=False)
    assert {queue.task_status(t)["state"] for t in ("a", "b")} == {"failed"}


# ----------------------------------------------------------------- 7. results whose data is gone


def test_a_result_whose_pack_is_gone_is_refused(queue: Coordinator, pool: Path) -> None:
    worker = SharedFilesystemStore(pool, "conformance", online_gc=True, segment_target_bytes=0)
    queue.submit_tasks("s", [TaskSpec("a")])
    lease = queue.acquire("w").assignments[0].lease
    ref = worker.publish([tagged(lease, "a", b"lost")], submission_id="lost")
    (pool / ref.manifest.segment.path).unlink()
    with pytest.raises(StorageUnavailable):
        queue.complete_task(lease, submission_id="c", result_ref=ref, result_digest=ref.digest)
    assert queue.read_commits().commits == ()
    worker.close()


# ------------------------------------------------------------------------- 8. no low caps


def test_large_publications_and_metadata_are_accepted(queue: Coordinator, pool: Path) -> None:
    store = queue.store
    many = store.publish([Record(str(i), b"") for i in range(10_001)], submission_id="many")
    assert many.records == 10_001
    blob = store.publish([Record("blob", b"x")], submission_id="blob")
    wide = store.publish([Record("top", b"")], submission_id="wide", dependencies=[blob] * 10_001)
    assert wide.payload_bytes == 10_001
    metadata = {"text": "m" * (1024 * 1024)}
    queue.submit_tasks("big", [TaskSpec("t", metadata=metadata)])
    assert queue.acquire("w").assignments[0].task.metadata == metadata


# ----------------------------------------------------------------- 9. buffers changed mid-publish


def test_a_buffer_changed_during_publication_is_refused(pool: Path) -> None:
    payload = bytearray(b"a" * (8 * 1024 * 1024))
    store = SharedFilesystemStore(pool, "conformance")
    changed = threading.Event()

    def fault(phase: str) -> None:
        if phase == "after_payload_chunk" and not changed.is_set():
            changed.set()
            payload[-1] = ord("b")

    store.backend.fault = fault
    with pytest.raises(ValueError, match="changed"):
        store.publish([Record("r", payload)], submission_id="r")
    assert changed.is_set()
    store.backend.fault = lambda phase: None
    ref = store.publish([Record("r", bytes(payload))], submission_id="r2")
    assert next(store.read(ref)).payload == bytes(payload)
    store.close()


# --------------------------------------------------------------------------- 10. read sessions


def test_a_closed_read_session_refuses_use(pool: Path) -> None:
    with SharedFilesystemStore(pool, "conformance") as store:
        ref = store.publish([Record("r", b"v")], submission_id="r")
        with store.read_session() as session:
            assert next(session.read(ref)).payload == b"v"
        with pytest.raises(RuntimeError, match="closed"):
            list(session.read(ref))


def test_a_reference_of_another_run_fails_at_once(pool: Path) -> None:
    with SharedFilesystemStore(pool, "conformance") as store:
        ref = store.publish([Record("r", b"v")], submission_id="r")
    with SharedFilesystemStore(pool, "another-run") as other, pytest.raises(InvalidReference):
        list(other.read(ref))


# ---------------------------------------------------------------------------- 13. error classes


def test_a_local_dependency_must_precede_its_publication(pool: Path) -> None:
    with SharedFilesystemStore(pool, "conformance") as store, pytest.raises(InvalidReference):
        store.publish_many(
            [Publication((Record("a", b"a"),), (1,)), Publication((Record("b", b"b"),))],
            submission_id="forward",
        )


def test_a_reference_with_a_wrong_size_is_corrupt(pool: Path) -> None:
    with SharedFilesystemStore(pool, "conformance") as store:
        (ref,) = store.write_records([Record("r", b"value")], submission_id="r")
        wrong = dataclasses.replace(ref, segment=dataclasses.replace(ref.segment, size=ref.segment.size + 1))
        with pytest.raises(CorruptData):
            store.read_record(wrong)


# ----------------------------------------------------------------------------- 14. fault phases


def test_publication_passes_the_named_fault_phases(pool: Path) -> None:
    seen: list[str] = []
    with SharedFilesystemStore(pool, "conformance", segment_target_bytes=0) as store:
        store.backend.fault = seen.append
        store.publish([Record("r", b"v" * 100)], submission_id="r")
    phases = [
        "before_publish",
        "after_segment_header",
        "after_record",
        "after_payload_chunk",
        "before_footer",
    ]
    phases += ["before_file_sync", "after_data_sync", "before_directory_sync", "after_publish"]
    assert set(phases) <= set(seen)


def test_an_io_error_after_publish_is_rechecked_not_indeterminate(pool: Path) -> None:
    failed: list[str] = []

    def fault(phase: str) -> None:
        if phase == "after_publish" and not failed:
            failed.append(phase)
            raise OSError(5, "reply lost")

    with SharedFilesystemStore(pool, "conformance", segment_target_bytes=0) as store:
        store.backend.fault = fault
        ref = store.publish([Record("r", b"payload")], submission_id="r")
        assert failed and next(store.read(ref)).payload == b"payload"


# ------------------------------------------------------------------- 15. self-contained refs


def test_a_pickled_tensor_reference_loads_in_a_fresh_process(pool: Path) -> None:
    torch = pytest.importorskip("torch")
    from straw.tensor import publish_tensors

    with SharedFilesystemStore(pool, "conformance", codecs=("tensor.v1",)) as store:
        (ref,) = publish_tensors(store, {"w": torch.arange(12).reshape(3, 4)}, submission_id="t")
    program = "import pickle, sys; print(pickle.loads(sys.stdin.buffer.read()).load().sum().item())"
    env = {k: v for k, v in os.environ.items() if k != "STRAW_POOL_ROOTS"}
    done = subprocess.run(
        [sys.executable, "-c", program], input=pickle.dumps(ref), capture_output=True, timeout=120, env=env
    )
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout.decode().strip() == str(sum(range(12)))


# ------------------------------------------------------------------------ 16. public surface


def test_the_public_surface_exists(queue: Coordinator, pool: Path) -> None:
    from straw import inspect, rpc, tracing  # noqa: F401
    from straw.benchmark import profile  # noqa: F401
    from straw.tensor import CHUNK_BYTES, tensor_record  # noqa: F401

    assert CHUNK_BYTES > 0
    assert isinstance(queue.journal.sequence, int) and queue.journal.path.exists()
    run_task(queue, queue.store, "a")
    assert queue._usage()["accepted_unprocessed"]["records"] == 1
    diagnostics = queue.store.backend.diagnostics()
    for key in ("profile", "directory_sync", "declaration", "multi_machine_admission"):
        assert key in diagnostics
    assert diagnostics["mount_options_automatically_verified"] is False


def test_inspect_finds_orphans_and_cleans_only_when_everyone_stopped(pool: Path) -> None:
    from straw.inspect import cleanup_orphans, inspect_run

    store = SharedFilesystemStore(pool, "conformance")
    queue = Coordinator(store, exclusive_owner="inspect test")
    receipt = run_task(queue, store, "a")
    queue.close()
    store.close()
    stray = SharedFilesystemStore(pool, "conformance")
    orphan = stray.publish([Record("o", b"nobody wants this")], submission_id="o")
    stray.close()
    report = inspect_run(pool)
    assert orphan.manifest.segment.path in report["unaccepted_sealed"]
    assert receipt.result_ref.manifest.segment.path in report["retained_paths"]
    with pytest.raises(UnsafeRecovery):
        cleanup_orphans(pool, report, all_participants_stopped=False)
    removed = cleanup_orphans(pool, report, all_participants_stopped=True)
    assert orphan.manifest.segment.path in removed
    with SharedFilesystemStore(pool, "conformance") as reader:
        assert next(reader.read(receipt.result_ref)).payload == b"out-a"


def _serve(pool: str, pipe: Any) -> None:
    from straw.rpc import serve

    store = SharedFilesystemStore(pool, "conformance")
    serve(Coordinator(store, exclusive_owner="rpc"), ("127.0.0.1", 0), token="t0ken", ready=pipe.send)


def test_the_control_transport_round_trips_on_loopback(pool: Path) -> None:
    import multiprocessing

    from straw.rpc import QueueClient

    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    server = context.Process(target=_serve, args=(str(pool), child), daemon=True)
    server.start()
    try:
        assert parent.poll(60)
        host, port = parent.recv()
        client = QueueClient(f"http://{host}:{port}", token="t0ken")
        assert client.call("submit_tasks", request_id="r", tasks=[TaskSpec("t", metadata={"k": 1})]) == ["t"]
        assignment = client.call("acquire", worker_id="w", max_tasks=1)["assignments"][0]
        assert assignment["task"]["metadata"] == {"k": 1}
        json.dumps(assignment)  # plain data
    finally:
        server.kill()
        server.join(10)
