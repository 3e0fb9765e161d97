"""The controller's training side: collections to batches (plan, ready, finish), the training view
it saves, dispositions, metrics, the checkpoint snapshot and reader metadata (ROLLOUT.md 10.8-10.13)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from rollout_helpers import finish, group_indices, interrupt
from straw.coordinator import Coordinator
from straw.protocol import CommitReceipt, RecordSetRef, decode
from straw.rollout.checkpoint import RestorePlan
from straw.rollout.config import RolloutConfig
from straw.rollout.controller import EXCLUSIVE_OWNER, QueueController
from straw.rollout.pool import rollout_store
from straw.rollout.reader import QueueReader
from straw.rollout.refs import DiskPayloadRef, RolloutGroupRef, load_groups, pack_payload

OpenController = Callable[..., QueueController]
OpenReader = Callable[..., QueueReader]
MakeConfig = Callable[..., RolloutConfig]


def collect(
    controller: QueueController, reader: QueueReader, count: int, request: str = "0"
) -> CommitReceipt:
    """Generate ``count`` groups, accept them, accept a raw collection of their references."""
    refs: list[RolloutGroupRef] = [
        reader.publish_group(finish(g), rollout_id=0) for g in reader.get_samples(count)
    ]
    lease = controller.begin_collection(request)
    metadata = {"task_id": lease.task_id, "attempt_id": lease.attempt_id}
    raw = pack_payload(refs, config=controller.config, rollout_id=0, metadata=metadata)
    return controller.complete(lease, raw.manifest)


def plan(controller: QueueController, raw: CommitReceipt) -> tuple[str, list[int], DiskPayloadRef]:
    batch_id = f"batch:{raw.commit_id}"
    groups = load_groups(DiskPayloadRef(raw.result_ref, controller.config.rollout_data_dir))  # type: ignore[arg-type]
    positions = [raw.position, *(s._queue_receipt["position"] for g in groups for s in g[:1])]
    plan_ref = pack_payload({"raw": raw.commit_id}, config=controller.config, rollout_id=0)
    return batch_id, positions, plan_ref


def convert(controller: QueueController, batch_id: str, data: Any = None) -> DiskPayloadRef:
    found = controller.batch(batch_id)
    assert found is not None and found["lease"] is not None
    lease = found["lease"]
    value = data if data is not None else {"tokens": [[1, 2]], "total_lengths": [2]}
    metadata = {"task_id": batch_id, "attempt_id": lease.attempt_id}
    return pack_payload(value, config=controller.config, rollout_id=0, metadata=metadata)


def test_a_batch_from_plan_to_finish(open_controller: OpenController, open_reader: OpenReader) -> None:
    controller = open_controller()
    reader = open_reader(controller)
    raw = collect(controller, reader, 2)
    assert raw.position == 2
    batch_id, positions, plan_ref = plan(controller, raw)
    assert controller.batch(batch_id) is None
    planned = controller.plan_batch(batch_id, positions, plan_ref)
    assert planned["ready"] is False and planned["input_positions"] == [0, 1, 2]
    assert planned["plan_ref"] == plan_ref.manifest and planned["lease"].worker_id == "manager"
    assert controller.plan_batch(batch_id, positions, plan_ref.manifest) == planned  # idempotent
    assert controller.batch(batch_id) == planned
    state = controller.training_state()
    assert state is not None
    body = rollout_store(controller.config).codec.load(RecordSetRef.from_dict(state["state_ref"]))
    assert body["conversion_started"] is True and body["processed_cursor"] == 0
    with pytest.raises(ValueError, match="already planned with another plan"):
        controller.plan_batch(batch_id, [0], plan_ref)

    conversion = convert(controller, batch_id)
    receipt = controller.ready_batch(batch_id, conversion)
    assert receipt.position == 3 and receipt.task_id == batch_id
    ready = controller.batch(batch_id)
    assert (
        ready is not None
        and ready["ready"]
        and ready["ready_ref"] == conversion.manifest
        and ready["position"] == 3
    )
    view = controller.training_view()
    assert view["processed_cursor"] == 3 and view["fetch_cursor"] == 3
    assert [b["batch_id"] for b in view["batches"]] == [batch_id]
    assert view["batches"][0]["conversion"] == conversion and view["batches"][0]["position"] == 3
    assert controller.ready_batch(batch_id, conversion) == receipt  # idempotent
    other = convert(controller, batch_id, {"tokens": [[9]], "total_lengths": [1]})
    with pytest.raises(ValueError, match=r"^Batch was already published with another ready reference$"):
        controller.ready_batch(batch_id, other)
    assert controller.metrics()["accepted_unprocessed"]["count"] == 1  # the conversion itself

    controller.finish_batch(batch_id)
    view = controller.training_view()
    assert view["processed_cursor"] == 4 and view["batches"] == []
    metrics = controller.metrics()
    assert metrics["accepted_unprocessed"] == {"count": 0, "bytes": 0} and metrics["commits"] == 4
    assert controller.queue.checkpoints == {}
    controller.finish_batch(batch_id)  # finished already: nothing to do
    with pytest.raises(ValueError, match=r"^Cannot finish an unknown or unready training batch$"):
        controller.finish_batch("batch:unknown")
    second = collect(controller, reader, 1, request="1")
    assert second.position == 5 and controller.queue.read_commits(0).cursor == 6


def test_an_unready_batch_cannot_be_finished_and_an_unplanned_one_not_published(
    open_controller: OpenController, open_reader: OpenReader
) -> None:
    controller = open_controller()
    raw = collect(controller, open_reader(controller), 1)
    batch_id, positions, plan_ref = plan(controller, raw)
    with pytest.raises(ValueError, match=r"^Cannot publish an unplanned training batch: batch:"):
        controller.ready_batch(batch_id, plan_ref)
    controller.plan_batch(batch_id, positions, plan_ref)
    with pytest.raises(ValueError, match=r"^Cannot finish an unknown or unready training batch$"):
        controller.finish_batch(batch_id)
    for bad in (["x"], [-1], [99]):
        with pytest.raises((TypeError, ValueError)):
            controller.plan_batch("batch:other", bad, plan_ref)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="starts with 'batch:'"):
        controller.plan_batch("conversion", positions, plan_ref)
    assert controller.status("batch:other") is None


def test_with_online_gc_finishing_a_batch_collects(
    make_config: MakeConfig, open_controller: OpenController, open_reader: OpenReader
) -> None:
    controller = open_controller(make_config(rollout_queue_online_gc=True), start_gc=False)
    raw = collect(controller, open_reader(controller), 2)
    batch_id, positions, plan_ref = plan(controller, raw)
    controller.plan_batch(batch_id, positions, plan_ref)
    controller.ready_batch(batch_id, convert(controller, batch_id))
    controller.finish_batch(batch_id)
    assert controller.metrics()["gc"]["runs"] == 1


def test_dispositions(open_controller: OpenController, open_reader: OpenReader) -> None:
    controller = open_controller()
    reader = open_reader(controller)
    for group in reader.get_samples(4):
        reader.publish_group(finish(group), rollout_id=0)
    for bad in ([-1], [4], ["0"], [True], "0", None):
        with pytest.raises(ValueError, match=r"^Invalid accepted-output disposition$"):
            controller.record_dispositions(bad, "why")  # type: ignore[arg-type]
    for reason in ("", None, 3):
        with pytest.raises(ValueError, match=r"^Invalid accepted-output disposition$"):
            controller.record_dispositions([0], reason)  # type: ignore[arg-type]
    assert controller.training_state() is None  # nothing changed
    assert controller.record_dispositions([], "nothing") is None
    ref = controller.record_dispositions([1, 3], "filtered", detail={"by": "test"})
    assert ref is not None
    stored = rollout_store(controller.config).codec.load(ref)
    assert stored == {"version": 1, "positions": [1, 3], "reason": "filtered", "detail": {"by": "test"}}
    view = controller.training_view()
    assert (
        view["processed_cursor"] == 0 and view["processed_positions"] == [1, 3] and view["fetch_cursor"] == 4
    )
    controller.record_dispositions([0], "filtered")
    assert controller.training_view()["processed_cursor"] == 2
    state = controller.training_state()
    assert state is not None and state["processed_cursor"] == 2 and state["fetch_cursor"] == 4
    body = rollout_store(controller.config).codec.load(RecordSetRef.from_dict(state["state_ref"]))
    assert body["disposition"].load()["positions"] == [0]
    progress = list(
        rollout_store(controller.config).store.read(RecordSetRef.from_dict(state["progress_ref"]))
    )
    assert decode(progress[0].payload) == {"version": 1, "processed_positions": [3], "finished_batches": []}
    assert controller.metrics()["accepted_unprocessed"]["count"] == 1
    # A restart reloads the view (a resume keeps the queue).
    queue_id, config = controller.plan.queue_id, controller.config
    controller.close()
    restarted = open_controller(config, restore_plan=RestorePlan("resume", queue_id=queue_id))
    assert restarted.training_view() == {
        "processed_cursor": 2, "fetch_cursor": 4, "processed_positions": [3], "batches": [],
    }  # fmt: skip


def test_the_checkpoint_snapshot(open_controller: OpenController, open_reader: OpenReader) -> None:
    controller = open_controller()
    reader = open_reader(controller)
    groups = reader.get_samples(4)
    accepted = reader.publish_group(finish(groups[0]), rollout_id=0)
    reader.publish_group(finish(groups[1]), rollout_id=0)
    controller.record_dispositions([1], "trained")
    reader.add_samples([interrupt(groups[2])])
    reader.add_samples(load_groups([accepted]))  # a pending delivery of group 0
    reader.update_metadata({"epoch": 3})
    ref = controller.checkpoint_snapshot(5, consumers={"runner": {"seen": 2}})
    body = rollout_store(controller.config).codec.load(ref)
    assert body["version"] == 1 and body["step"] == 5 and body["timeline"] == 0
    assert body["queue_id"] == controller.plan.queue_id
    assert body["producer"] == controller.queue.producer_state("dataset")
    unfinished = body["unfinished"]
    assert [u["group_index"] for u in unfinished] == [0, 2, 3, 4, 5, 6, 7]  # 1 is processed
    by_group = {u["group_index"]: u for u in unfinished}
    assert by_group[0]["task_id"].startswith("prompt:delivery:") and by_group[0]["position"] is None
    assert by_group[2]["stage"] == "partial" and by_group[3]["task_id"] == "prompt:3"
    prompt = by_group[2]["prompt"]
    assert isinstance(prompt, DiskPayloadRef) and [s.tokens for s in prompt.load()] == [
        []
    ]  # the original prompt
    assert body["training"] == {"processed_cursor": 0, "fetch_cursor": 2, "processed_positions": [1]}
    assert body["readers"] == {"r": {"epoch": 3}} and body["consumers"] == {"runner": {"seen": 2}}
    assert body["configuration"] == controller.configuration()
    with pytest.raises(ValueError):
        controller.checkpoint_snapshot(-1)


def test_an_accepted_unprocessed_group_is_unfinished_with_its_position(
    open_controller: OpenController, open_reader: OpenReader
) -> None:
    controller = open_controller()
    reader = open_reader(controller)
    (group,) = reader.get_samples(1)
    ref = reader.publish_group(finish(group), rollout_id=0)
    body = rollout_store(controller.config).codec.load(controller.checkpoint_snapshot(0))
    entry = next(u for u in body["unfinished"] if u["group_index"] == 0)
    assert entry["position"] == ref.receipt.position and entry["stage"] == "ready"  # type: ignore[union-attr]


def test_reader_metadata(open_controller: OpenController, open_reader: OpenReader) -> None:
    controller = open_controller()
    assert controller.reader_metadata("a") == {}
    assert controller.reader_metadata("a", {"x": [1, 2]}) == {"x": [1, 2]}
    assert controller.reader_metadata("a", {"x": 3}) == {"x": 3}
    assert controller.reader_metadata("a") == {"x": 3} and controller.reader_metadata("b") == {}
    reader = open_reader(controller, "b")
    reader.update_metadata({"y": 1})
    assert reader.get_metadata() == {"y": 1}
    with pytest.raises(TypeError):
        controller.reader_metadata("a", [1])  # type: ignore[arg-type]
    queue_id, config = controller.plan.queue_id, controller.config
    controller.close()
    restarted = open_controller(config, restore_plan=RestorePlan("resume", queue_id=queue_id))
    assert restarted.reader_metadata("a") == {"x": 3}


def test_metrics(open_controller: OpenController, open_reader: OpenReader) -> None:
    controller = open_controller()
    reader = open_reader(controller)
    groups = reader.get_samples(3)
    ref = reader.publish_group(finish(groups[0]), rollout_id=0)
    reader.add_samples([interrupt(groups[1])])
    metrics = controller.metrics()
    assert metrics["tasks"] == {"pending": 6, "leased": 1, "completed": 1} and metrics["commits"] == 1
    assert metrics["accepted_unprocessed"] == {"count": 1, "bytes": ref.manifest.payload_bytes}
    assert metrics["pending_returned"] == 1 and metrics["failed_groups"] == 0
    assert group_indices(reader.get_samples(1)) == [1]


def test_an_interrupted_plan_or_ready_is_reconciled_by_the_next_call(
    open_controller: OpenController, open_reader: OpenReader
) -> None:
    failing: dict[str, str | None] = {"phase": None}

    def fault(phase: str) -> None:
        if phase == failing["phase"]:
            raise OSError(f"interrupted at {phase}")

    controller = open_controller(fault=fault)
    raw = collect(controller, open_reader(controller), 2)
    batch_id, positions, plan_ref = plan(controller, raw)
    failing["phase"] = "plan:state"  # the plan is recorded, the training state not yet saved
    with pytest.raises(OSError, match="interrupted at plan:state"):
        controller.plan_batch(batch_id, positions, plan_ref)
    assert controller.batch(batch_id) is not None and controller.training_state() is None
    failing["phase"] = None
    assert controller.plan_batch(batch_id, positions, plan_ref)["input_positions"] == [0, 1, 2]
    assert controller.training_state() is not None
    conversion = convert(controller, batch_id)
    failing["phase"] = "ready:advance"  # accepted, not yet advanced
    with pytest.raises(OSError, match="interrupted at ready:advance"):
        controller.ready_batch(batch_id, conversion)
    found = controller.batch(batch_id)
    assert found is not None and found["ready"] and controller.training_view()["processed_cursor"] == 0
    failing["phase"] = None
    receipt = controller.ready_batch(batch_id, conversion)
    assert receipt.position == 3 and controller.training_view()["processed_cursor"] == 3
    assert [b["batch_id"] for b in controller.training_view()["batches"]] == [batch_id]


def test_a_refused_resume_changes_nothing_it_could_avoid(
    open_controller: OpenController, open_reader: OpenReader
) -> None:
    controller = open_controller()
    raw = collect(controller, open_reader(controller), 2)
    controller.plan_batch(*plan(controller, raw))
    pending = controller.begin_collection("1")
    queue_id, config = controller.plan.queue_id, controller.config
    controller.close()
    with pytest.raises(
        RuntimeError, match=r"^Queue-only recovery is limited to an interrupted first rollout"
    ):
        QueueController(
            config, dataset=[{"input": "x"}], restore_plan=RestorePlan("resume", queue_id=queue_id)
        )
    later = open_controller(
        config, restore_plan=RestorePlan("new", queue_id=queue_id.replace("run:", "run:0"))
    )
    assert later.take("r", 1).status == "acquired"  # the lock and the writer were left usable
    store = rollout_store(config).store
    with Coordinator(
        store, queue_id=queue_id, namespace=True, exclusive_owner=EXCLUSIVE_OWNER, recover=True
    ) as queue:
        status = queue.task_status(pending.task_id)
        assert status is not None and status["state"] == "pending"  # not cancelled by the refused start
