"""Queue adoption ends staging (docs/GC.md "Queue adoption", issue 10 item 1).

A live writer (``online_gc=True``, packing several publications into one pack) publishes;
a coordinator on its own store takes the references over through submit, yield, progress,
complete, consumer state and checkpoint calls. Once the queue no longer needs them (the task
ended, the ``training`` consumer acknowledged the result, the checkpoint was released),
``Coordinator.collect_garbage`` reclaims the pack while its writer still runs, with no
``release_publications`` call. Checked as well: what adoption does not end (an explicit
``retain``, a sibling publication nobody adopted, a ``write_records`` extent named only in
part), when the end of staging reaches the catalog (never before the queue's transaction is
durable; with the next catalog frame, a full pending list, ``collect_garbage`` or ``close``),
and that a lost pending list (a killed coordinator) retains too much, never too little.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from queue_helpers import catalog_events, crash
from straw import coordinator as coordinator_module
from straw.backend import FilesystemBackend
from straw.coordinator import Coordinator
from straw.errors import IndeterminateCommit, InvalidReference, StaleAttempt, StorageUnavailable
from straw.protocol import Lease, Publication, Record, RecordSetRef, TaskSpec, encode
from straw.store import SharedFilesystemStore

RUN = "run-adoption"


class Fault:
    """Raise ``OSError(EIO)`` at the next call of one phase."""

    def __init__(self) -> None:
        self.phase = ""

    def __call__(self, phase: str) -> None:
        if phase == self.phase:
            self.phase = ""
            raise OSError(5, f"injected at {phase}")


def _no_sleep(_: float) -> None:
    return None


class Pool:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.fault = Fault()
        self.stores: list[SharedFilesystemStore] = []  # closed by the fixture
        self.writer = self.store(online_gc=True)
        self.queue_store = self.store(fault=self.fault)
        self.queue = self.open_queue(recover=False)

    def store(
        self, *, online_gc: bool = False, fault: Callable[[str], None] | None = None
    ) -> SharedFilesystemStore:
        backend = FilesystemBackend(self.root, fault=fault, sleep=_no_sleep, visibility_delays=(0.0,))
        store = SharedFilesystemStore(self.root, RUN, backend=backend, online_gc=online_gc)
        self.stores.append(store)
        return store

    def open_queue(self, *, recover: bool) -> Coordinator:
        return Coordinator(self.queue_store, exclusive_owner="adoption-tests", recover=recover)

    def put(self, name: str, *, dependencies: tuple[RecordSetRef, ...] = ()) -> RecordSetRef:
        return self.writer.publish(
            [Record(name, name.encode() * 10)], submission_id=f"put-{name}", dependencies=dependencies
        )

    def result(self, lease: Lease, name: str) -> RecordSetRef:
        meta = {"task_id": lease.task_id, "attempt_id": lease.attempt_id}
        return self.writer.publish([Record(name, b"out", metadata=meta)], submission_id=f"out-{name}")

    def lease(self, task_id: str) -> Lease:
        result = self.queue.acquire("w", task_ids=[task_id])
        assert result.status == "acquired", result
        return result.assignments[0].lease

    def packs(self) -> set[str]:
        return {str(p.relative_to(self.root)) for p in self.root.glob("raw/*/*.pack")}

    def staging_over(self, ref: RecordSetRef) -> bool:
        return bool(self.writer.explain(ref.manifest.segment.path)["staging_over"])

    def acknowledge(self, processed: int) -> None:
        token = self.queue.open_consumer("training", exclusive_owner="trainer")
        state = self.store().publish([Record("state", b"{}", "json.v1")], submission_id=f"st-{processed}")
        self.queue.save_consumer_state(
            "training",
            token=token,
            request_id=f"ack-{processed}",
            state_ref=state,
            fetch_cursor=processed,
            processed_cursor=processed,
        )


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[Pool]:
    p = Pool(tmp_path / "pool")
    yield p
    if not p.queue._closed:
        p.queue.close()
    for store in p.stores:
        store.close()


def test_a_submitted_input_is_reclaimed_once_its_task_ends_while_the_writer_lives(pool: Pool) -> None:
    data = pool.put("input")
    pool.queue.submit_tasks("r1", [TaskSpec("t", input_ref=data)])
    pool.writer.seal()
    assert pool.queue.collect_garbage()["reclaimed_files"] == 0  # the pending task needs it
    assert pool.staging_over(data)  # but its writer no longer stages it
    pool.queue.cancel_task("t", request_id="c1")
    assert pool.queue.collect_garbage()["reclaimed_files"] == 1
    assert pool.packs() == set()


def test_an_accepted_result_is_reclaimed_once_training_acknowledges_it(pool: Pool) -> None:
    pool.queue.submit_tasks("r1", [TaskSpec("t")])
    lease = pool.lease("t")
    result = pool.result(lease, "out")
    pool.queue.complete_task(lease, submission_id="c1", result_ref=result, result_digest=result.digest)
    pool.writer.seal()
    assert pool.queue.collect_garbage()["reclaimed_files"] == 0  # not yet processed
    pool.acknowledge(1)
    outcome = pool.queue.collect_garbage()
    assert outcome["reclaimed_files"] == 1
    assert result.manifest.segment.path not in pool.packs()


def test_yielded_and_progress_inputs_are_adopted(pool: Pool) -> None:
    pool.queue.submit_tasks("r1", [TaskSpec("t")])
    lease = pool.lease("t")
    first = pool.put("progress")
    pool.queue.save_task_progress(lease, request_id="p1", input_ref=first)
    second = pool.put("continuation")
    assert pool.queue.yield_task(lease, request_id="y1", input_ref=second) == "pending"
    pool.writer.seal()
    assert pool.queue.collect_garbage()["reclaimed_files"] == 0  # the continuation is pending
    assert pool.staging_over(first) and pool.staging_over(second)
    pool.queue.cancel_task("t", request_id="c1")
    assert pool.queue.collect_garbage()["reclaimed_files"] == 1


def test_dependencies_of_an_adopted_publication_are_adopted_too(pool: Pool) -> None:
    other = pool.store(online_gc=True)  # a dependency in another writer's pack
    tensor = other.publish([Record("tensor", b"t" * 100)], submission_id="tensor")
    local = pool.put("local")
    sample = pool.put("sample", dependencies=(tensor, local))
    pool.queue.submit_tasks("r1", [TaskSpec("t", input_ref=sample)])
    pool.writer.seal()
    other.seal()
    pool.queue.cancel_task("t", request_id="c1")
    assert pool.queue.collect_garbage()["reclaimed_files"] == 2
    assert pool.packs() == set()
    other.close()


def test_a_publish_many_sibling_that_nobody_adopted_keeps_the_pack(pool: Pool) -> None:
    taken, left = pool.writer.publish_many(
        [Publication((Record("a", b"a"),)), Publication((Record("b", b"b"),))], submission_id="m"
    )
    pool.queue.submit_tasks("r1", [TaskSpec("t", input_ref=taken)])
    pool.writer.seal()
    pool.queue.cancel_task("t", request_id="c1")
    assert pool.queue.collect_garbage()["reclaimed_files"] == 0
    assert not pool.staging_over(left)
    pool.writer.release_publications([left])
    assert pool.queue.collect_garbage()["reclaimed_files"] == 1


@pytest.mark.parametrize("whole", [True, False])
def test_a_record_set_ends_the_staging_of_a_write_records_extent_it_names_whole(
    pool: Pool, whole: bool
) -> None:
    records = pool.writer.write_records([Record("a", b"a"), Record("b", b"b")], submission_id="w")
    subset = pool.writer.record_set(records if whole else records[:1], submission_id="rs")
    pool.queue.submit_tasks("r1", [TaskSpec("t", input_ref=subset)])
    pool.writer.seal()
    pool.queue.cancel_task("t", request_id="c1")
    # Records named only in part may still be combined into another set: they stay staged.
    assert pool.queue.collect_garbage()["reclaimed_files"] == (1 if whole else 0)
    if not whole:
        later = pool.writer.record_set(records[1:], submission_id="rs-later")
        assert [bytes(r.payload) for r in pool.writer.read(later)] == [b"b"]


def test_an_explicit_retain_does_not_end_staging(pool: Pool) -> None:
    data = pool.put("kept")
    pool.writer.retain("app", [data])
    pool.writer.seal()
    pool.writer.release("app")
    assert pool.writer.collect_garbage()["reclaimed_files"] == 0
    assert not pool.staging_over(data)


def test_consumer_state_and_checkpoint_references_are_adopted(pool: Pool) -> None:
    token = pool.queue.open_consumer("training", exclusive_owner="trainer")
    state = pool.writer.publish([Record("state", b"{}", "json.v1")], submission_id="state")
    pool.queue.save_consumer_state(
        "training", token=token, request_id="s1", state_ref=state, fetch_cursor=0, processed_cursor=0
    )
    body = encode({"version": 1, "checkpoint_id": "ck"})
    checkpoint = pool.writer.publish([Record("ck", body, "json.v1")], submission_id="ck")
    pool.queue.register_checkpoint("ck", checkpoint)
    pool.writer.seal()
    pool.queue.release_checkpoint("ck")
    replacement = pool.store().publish([Record("state2", b"{}", "json.v1")], submission_id="state2")
    pool.queue.save_consumer_state(
        "training", token=token, request_id="s2", state_ref=replacement, fetch_cursor=0, processed_cursor=0
    )
    assert pool.queue.collect_garbage()["reclaimed_files"] == 1  # the writer's pack of both


def test_the_staging_owner_of_an_adopted_publication_is_released(pool: Pool) -> None:
    other = pool.store(online_gc=True)
    dependency = other.publish([Record("dep", b"d")], submission_id="dep")
    other.release_publications([dependency])
    sample = pool.put("sample", dependencies=(dependency,))
    staging = [o for o in pool.writer.explain(dependency.manifest.segment.path)["owners"]]
    assert len(staging) == 1 and staging[0].startswith("staging:")
    pool.queue.submit_tasks("r1", [TaskSpec("t", input_ref=sample)])
    pool.queue.collect_garbage()
    assert pool.writer.explain(dependency.manifest.segment.path)["owners"] == [pool.queue._gc_owner]
    other.close()


def test_staging_ends_only_after_the_transaction_is_durable(pool: Pool) -> None:
    data = pool.put("input")
    pool.fault.phase = "after_journal_append"
    with pytest.raises(IndeterminateCommit):
        pool.queue.submit_tasks("r1", [TaskSpec("t", input_ref=data)])
    pool.queue.close()  # a broken coordinator records no adoption, even on close
    pool.writer.seal()
    assert not pool.staging_over(data)


def test_adoptions_ride_on_the_next_catalog_frame_and_on_close(pool: Pool) -> None:
    first = pool.put("first")
    pool.queue.submit_tasks("r1", [TaskSpec("a", input_ref=first)])  # owns the pack, then adopts
    pool.writer.seal()
    assert not pool.staging_over(first)  # pending: the queue's owner keeps the pack meanwhile
    second = pool.put("second")  # a new pack: its catalog add carries the pending adoption
    pool.queue.submit_tasks("r2", [TaskSpec("b", input_ref=second)])
    assert pool.staging_over(first)
    assert not pool.writer.explain(second.manifest.segment.path)["sealed"]
    pool.writer.seal()
    assert not pool.staging_over(second)
    pool.queue.close()
    assert pool.staging_over(second)


def test_a_full_pending_list_gets_its_own_catalog_frame(pool: Pool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(coordinator_module, "ADOPTIONS_PENDING_MAX", 4)
    refs = [pool.put(f"in-{i}") for i in range(3)]
    pool.writer.seal()
    pool.queue.submit_tasks("r1", [TaskSpec(f"t{i}", input_ref=ref) for i, ref in enumerate(refs)])
    assert not any(pool.staging_over(r) for r in refs)  # 3 items and 3 owner names pending
    pool.queue.cancel_task("t0", request_id="c1")  # the next transaction flushes them first
    assert all(pool.staging_over(r) for r in refs)


def test_a_killed_coordinator_loses_pending_adoptions_and_retains_too_much(pool: Pool) -> None:
    data = pool.put("input")
    pool.queue.submit_tasks("r1", [TaskSpec("t", input_ref=data)])
    pool.writer.seal()
    crash(pool.queue)  # as a killed process: no snapshot, no catalog write, lock gone
    pool.queue = pool.open_queue(recover=True)
    pool.queue.cancel_task("t", request_id="c1")
    assert pool.queue.collect_garbage()["reclaimed_files"] == 0  # staged by its live writer
    pool.writer.close()
    assert pool.queue.collect_garbage()["reclaimed_files"] == 1  # the writer's death ends it


def test_a_writer_without_online_gc_keeps_adopted_packs_until_it_exits(pool: Pool) -> None:
    quiet = pool.store(online_gc=False)  # records no seal: its packs wait for its death
    data = quiet.publish([Record("x", b"x")], submission_id="x")
    pool.queue.submit_tasks("r1", [TaskSpec("t", input_ref=data)])
    quiet.seal()
    pool.queue.cancel_task("t", request_id="c1")
    assert pool.queue.collect_garbage()["reclaimed_files"] == 0
    quiet.close()
    assert pool.queue.collect_garbage()["reclaimed_files"] == 1


def _events(pool: Pool) -> list[dict[str, Any]]:
    return catalog_events(pool.root)


def test_a_duplicate_request_adopts_nothing_new(pool: Pool) -> None:
    data = pool.put("input")
    pool.queue.submit_tasks("r1", [TaskSpec("t", input_ref=data)])
    pool.queue.collect_garbage()
    before = len([e for e in _events(pool) if e["op"] == "unstage"])
    assert pool.queue.submit_tasks("r1", [TaskSpec("t", input_ref=data)]) == ["t"]
    pool.queue.close()
    assert len([e for e in _events(pool) if e["op"] == "unstage"]) == before


def test_a_task_whose_input_was_deleted_outside_collection_is_refused_and_not_submitted(
    pool: Pool,
) -> None:
    # The queue's store answers from what this process's writer remembers of the input (no
    # read of the pack), so the pack's existence is what catches the deletion.
    data = pool.put("input")
    pool.writer.seal()
    (pool.root / data.manifest.segment.path).unlink()
    with pytest.raises(StorageUnavailable, match="no longer exists"):
        pool.queue.submit_tasks("r1", [TaskSpec("t", input_ref=data)])
    assert pool.queue.task_status("t") is None
    fresh = pool.put("again")
    pool.queue.submit_tasks("r2", [TaskSpec("t", input_ref=fresh)])
    assert pool.queue.task_status("t") is not None


# -- owned dependencies: an owner vouches for them, so the publication stages none ---------


def _owned_result(pool: Pool, other: SharedFilesystemStore) -> tuple[Lease, RecordSetRef, RecordSetRef]:
    """A task whose input is a prompt in another writer's pack, and its result that depends
    on the prompt, published with the prompt as an owned dependency."""
    prompt = other.publish([Record("prompt", b"p" * 100)], submission_id="prompt")
    pool.queue.submit_tasks("r1", [TaskSpec("t", input_ref=prompt)])  # the queue owns it now
    other.seal()
    lease = pool.lease("t")
    meta = {"task_id": lease.task_id, "attempt_id": lease.attempt_id}
    before = len(_events(pool))
    result = pool.writer.publish(
        [Record("out", b"out", metadata=meta)],
        submission_id="out",
        dependencies=(prompt,),
        owned_dependencies=(prompt,),
    )
    assert len(_events(pool)) == before  # no staging owner, so no catalog frame
    assert pool.writer.owners("staging:") == []
    return lease, prompt, result


def test_an_owned_dependency_is_kept_by_the_queue_until_the_adopted_result_is_acknowledged(
    pool: Pool,
) -> None:
    other = pool.store(online_gc=True)
    lease, prompt, result = _owned_result(pool, other)
    pool.queue.complete_task(lease, submission_id="c1", result_ref=result, result_digest=result.digest)
    pool.writer.seal()
    assert pool.queue.collect_garbage()["reclaimed_files"] == 0  # the result reaches the prompt
    assert pool.writer.explain(prompt.manifest.segment.path)["owners"] == [pool.queue._gc_owner]
    pool.acknowledge(1)
    assert pool.queue.collect_garbage()["reclaimed_files"] == 2  # the result's pack and the prompt's
    other.close()


def test_an_owned_dependency_let_go_first_leaves_the_publication_dangling_never_accepted(
    pool: Pool,
) -> None:
    other = pool.store(online_gc=True)
    lease, prompt, result = _owned_result(pool, other)
    pool.queue.cancel_task("t", request_id="c1")
    assert pool.queue.collect_garbage()["reclaimed_files"] == 0  # the worker's read keeps the input
    pool.queue.retire_worker("w")  # its read ends: the owner the caller vouched for lets go
    assert pool.queue.collect_garbage()["reclaimed_files"] == 1  # the prompt: nothing stages it
    assert prompt.manifest.segment.path not in pool.packs()
    with pytest.raises(StaleAttempt):
        pool.queue.complete_task(lease, submission_id="c1", result_ref=result, result_digest=result.digest)
    with pytest.raises(InvalidReference, match="garbage-collected"):
        pool.writer.retain("keeper", [result])  # whoever holds it learns it is gone
    other.close()


def test_a_dependency_staged_as_usual_survives_the_same_cancel(pool: Pool) -> None:
    other = pool.store(online_gc=True)
    prompt = other.publish([Record("prompt", b"p" * 100)], submission_id="prompt")
    pool.queue.submit_tasks("r1", [TaskSpec("t", input_ref=prompt)])
    other.seal()
    pool.lease("t")
    pool.put("result", dependencies=(prompt,))  # staged: its writer keeps the prompt alive
    pool.queue.cancel_task("t", request_id="c1")
    pool.queue.retire_worker("w")
    assert pool.queue.collect_garbage()["reclaimed_files"] == 0
    other.close()


@pytest.mark.parametrize("owned", ["not among them", "a ref that is no dependency"])
def test_owned_dependencies_must_be_among_the_dependencies(pool: Pool, owned: str) -> None:
    dependency = pool.put("dependency")
    stranger = pool.put("stranger")
    bad: object = owned if owned == "not among them" else stranger
    packs = {p: (pool.root / p).stat().st_size for p in pool.packs()}
    with pytest.raises(ValueError, match="owned_dependencies must be among the dependencies"):
        pool.writer.publish(
            [Record("r", b"r")],
            submission_id="bad",
            dependencies=(dependency,),
            owned_dependencies=(bad,),  # type: ignore[arg-type]
        )
    assert {p: (pool.root / p).stat().st_size for p in pool.packs()} == packs
    # Nothing was written under the id: it is still free for other content.
    pool.writer.publish([Record("other", b"o")], submission_id="bad")
