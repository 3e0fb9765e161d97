"""straw.rollout.controller: taking, refilling, scheduling, leases, returns, retirement,
collections (acceptance scenarios 15-18 and 22-24 of ROLLOUT.md section 20)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest

from queue_helpers import Clock
from rollout_helpers import finish, fresh_group_index, group_indices, interrupt, prompt_rows
from straw.coordinator import Coordinator
from straw.errors import LeaseExpired, StaleAttempt
from straw.protocol import CommitReceipt, Lease, RecordSetRef, TaskSpec, decode
from straw.rollout.checkpoint import RestorePlan
from straw.rollout.config import RolloutConfig
from straw.rollout.controller import EXCLUSIVE_OWNER, QueueController
from straw.rollout.reader import QueueReader
from straw.rollout.refs import DiskPayloadRef, RolloutGroupRef, load_groups, pack_payload
from straw.rollout.sample import NO_VERSION_KEY, Sample, staleness

OpenController = Callable[..., QueueController]
OpenReader = Callable[..., QueueReader]
MakeConfig = Callable[..., RolloutConfig]


def prompt_tasks(controller: QueueController) -> list[str]:
    """The fresh prompt tasks (``prompt:<group index>``), by group index."""
    indexes = (fresh_group_index(t) for t in controller.queue.tasks)
    return [f"prompt:{index}" for index in sorted(i for i in indexes if i is not None)]


# --------------------------------------------------------------------------- scenario 15


def test_scenario_15_take_refills_tasks_and_cursor_in_one_transaction(
    open_controller: OpenController, monkeypatch: pytest.MonkeyPatch
) -> None:
    controller = open_controller()
    submits: list[tuple[str, list[str], Any]] = []
    original = controller.queue.submit_tasks

    def recorded(request_id: str, tasks: Any, **options: Any) -> list[str]:
        specs = list(tasks)
        submits.append((request_id, [s.task_id for s in specs], options.get("producer_state")))
        return original(request_id, specs, **options)

    monkeypatch.setattr(controller.queue, "submit_tasks", recorded)
    found = controller.take("r", 1)
    assert found.status == "acquired" and [a.task.task_id for a in found.assignments] == ["prompt:0"]
    assert prompt_tasks(controller) == [f"prompt:{g}" for g in range(8)]
    ((request, ids, state),) = submits  # one transaction: the tasks and the cursor together
    assert request == "dataset:0:0" and ids == [f"prompt:{g}" for g in range(8)]
    assert state["cursor"]["sample_group_index"] == 8 and state["timeline"] == 0
    assert controller.queue.producer_state("dataset") == state
    spec = found.assignments[0].task
    assert spec.metadata["stage"] == "fresh" and spec.metadata["group_index"] == 0
    assert spec.metadata["prompt"] == dataclasses.asdict(spec.input_ref)  # type: ignore[arg-type]
    assert spec.scheduling_key == NO_VERSION_KEY and spec.priority == 0 and spec.max_attempts == 3

    fresh = open_controller()
    many = fresh.take("r", 100)
    assert len(many.assignments) == 64 and len(prompt_tasks(fresh)) == 64
    assert fresh.queue.producer_state("dataset")["cursor"]["sample_group_index"] == 64

    empty = open_controller(dataset=[])
    with pytest.raises(ValueError, match=r"^Queue rollout dataset is empty after filtering$"):
        empty.take("r", 1)
    assert empty.queue.tasks == {}


def test_refill_loads_the_prompt_groups(open_controller: OpenController, make_config: MakeConfig) -> None:
    controller = open_controller(make_config(n_samples_per_prompt=2), dataset=prompt_rows(3))
    found = controller.take("r", 5)
    assert len(found.assignments) == 5  # three rows, then a second epoch (8 groups drawn)
    group = DiskPayloadRef(found.assignments[4].task.input_ref, controller.config.rollout_data_dir).load()  # type: ignore[arg-type]
    assert [s.index for s in group] == [8, 9] and group[0].group_index == 4 and group[0].prompt == "prompt 1"
    assert controller.queue.producer_state("dataset")["cursor"]["epoch_id"] == 2


def test_the_dataset_is_built_lazily_from_a_factory_or_the_flags(
    open_controller: OpenController, make_config: MakeConfig, tmp_path: Any
) -> None:
    built: list[int] = []

    def factory() -> list[dict[str, Any]]:
        built.append(1)
        return prompt_rows(4)

    controller = open_controller(dataset=factory)
    assert built == []
    controller.take("r", 1)
    controller.take("r", 1)
    assert built == [1]
    flagless = open_controller(dataset=None)
    with pytest.raises(ValueError, match=r"^No dataset: pass dataset= or --prompt-data$"):
        flagless.take("r", 1)
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"input": "a"}\n{"input": "b"}\n')
    jsonl = open_controller(make_config(prompt_data=str(path)), dataset=None)
    assert jsonl.take("r", 1).status == "acquired"
    assert jsonl.configuration()["dataset"]["path"] == str(path)
    assert jsonl.configuration()["dataset_size"] == 2


# --------------------------------------------------------------------------- scenario 16


def test_scenario_16_a_failed_submit_is_retried_with_the_same_ids_and_cursor(
    open_controller: OpenController, monkeypatch: pytest.MonkeyPatch
) -> None:
    controller = open_controller(dataset=prompt_rows(5))
    original = controller.queue.submit_tasks
    calls = {"n": 0}

    def failing_once(*args: Any, **options: Any) -> list[str]:
        calls["n"] += 1
        if calls["n"] == 1:
            raise OSError("journal device gone")
        return original(*args, **options)

    monkeypatch.setattr(controller.queue, "submit_tasks", failing_once)
    with pytest.raises(OSError, match="journal device gone"):
        controller.take("r", 1)
    assert controller.queue.tasks == {}
    assert controller.queue.producer_state("dataset")["cursor"]["sample_group_index"] == 0
    found = controller.take("r", 1)
    assert found.assignments[0].task.task_id == "prompt:0"
    assert prompt_tasks(controller) == [f"prompt:{g}" for g in range(8)]
    seen = []
    for _ in range(30):  # many refills: every group index exactly once
        taken = controller.take("r", 7)
        seen += [a.task.metadata["group_index"] for a in taken.assignments]
    seen.append(found.assignments[0].task.metadata["group_index"])
    assert sorted(seen) == list(range(len(seen)))
    assert controller.queue.producer_state("dataset")["cursor"]["sample_group_index"] == len(
        prompt_tasks(controller)
    )


# --------------------------------------------------------------------------- scenario 17


def test_scenario_17_acquisition_order_follows_stage_then_oldest_version(
    open_controller: OpenController, open_reader: OpenReader
) -> None:
    controller = open_controller()
    reader = open_reader(controller, "a")
    groups = reader.get_samples(8)
    fresh, p3, p1, r5, rnone, px, same_a, same_b = groups
    interrupt(p3, version="3")
    interrupt(p1, version="1")
    finish(r5, version="5")
    finish(rnone, version=None)
    interrupt(px, version="x")
    interrupt(same_a, version="2")
    interrupt(same_b, version="2")
    reader.add_samples([fresh, p3, p1, r5, rnone, px, same_a, same_b])
    order = [spec.metadata["group_index"] for spec in controller.queue.pending_tasks(task_prefix="prompt:")]
    names = dict(
        zip(group_indices(groups), ["fresh", "p3", "p1", "r5", "rnone", "px", "a", "b"], strict=True)
    )
    labelled = [names.get(g, f"new{g}") for g in order]
    assert labelled[:7] == ["r5", "rnone", "p1", "a", "b", "p3", "px"]  # equal keys keep return order
    assert labelled[7] == "fresh"
    other = open_reader(controller, "b")
    taken = other.get_samples(7)
    assert [names[g] for g in group_indices(taken)] == labelled[:7]
    specs = {
        a.task.task_id: a.task for a in controller.queue.acquire("c", 10, task_prefix="prompt:").assignments
    }
    assert all(spec.priority == 0 and spec.scheduling_key == NO_VERSION_KEY for spec in specs.values())
    assert staleness([Sample(weight_versions=["3", "5"])], "7") == 4
    assert staleness([Sample(weight_versions=["7"])], "7") == 0


def test_returned_groups_carry_stage_key_and_metadata(
    open_controller: OpenController, open_reader: OpenReader
) -> None:
    controller = open_controller()
    reader = open_reader(controller)
    (group,) = reader.get_samples(1)
    task_id = group[0]._queue_lease["task_id"]
    interrupt(group, version="4")
    reader.add_samples([group])
    status = controller.status(task_id)
    assert status is not None and status["state"] == "pending" and status["failures"] == 0
    spec = TaskSpec.from_dict(status["spec"])
    assert spec.priority == 1 and spec.scheduling_key == 4
    assert spec.metadata["returned"] is True and spec.metadata["stage"] == "partial"
    assert spec.metadata["source_positions"] == [] and spec.metadata["group_index"] == 0
    assert spec.metadata["prompt"] == status["spec"]["metadata"]["prompt"]
    assert controller.pending_count() == 1 and reader.get_buffer_length() == 1
    assert reader.leases() == []


# --------------------------------------------------------------------------- scenario 18


def test_scenario_18_an_expired_lease_goes_to_another_reader(
    make_config: MakeConfig, open_controller: OpenController, open_reader: OpenReader
) -> None:
    clock = Clock()
    controller = open_controller(
        make_config(rollout_queue_lease_seconds=1.0, refill_min_groups=1), clock=clock
    )
    a, b = open_reader(controller, "a"), open_reader(controller, "b")
    (group,) = a.get_samples(1)
    task_id = group[0]._queue_lease["task_id"]
    clock.advance(2.0)
    taken = b.get_samples(1)
    assert group_indices(taken) == [0] and taken[0][0]._queue_lease["worker_id"] == "b"
    status = controller.status(task_id)
    assert status is not None and status["failures"] == 1  # the expiry spent an attempt
    finish(group)
    with pytest.raises((LeaseExpired, StaleAttempt)):
        a.publish_group(group, rollout_id=0)
    assert controller.queue.commits == []
    finish(taken[0])
    ref = b.publish_group(taken[0], rollout_id=0)
    assert ref.receipt is not None and ref.receipt.position == 0


# --------------------------------------------------------------------------- leases and results


def test_complete_results_and_retries(open_controller: OpenController, open_reader: OpenReader) -> None:
    controller = open_controller()
    reader = open_reader(controller)
    (group,) = reader.get_samples(1)
    lease = Lease.from_dict(group[0]._queue_lease)
    assert controller.result(lease) is None
    finish(group)
    ref = reader.publish_group(group, rollout_id=0)
    assert isinstance(ref, RolloutGroupRef) and ref.receipt is not None
    assert controller.result(lease) == ref.receipt == controller.results([lease])[0]
    assert controller.complete(lease, ref.manifest) == ref.receipt  # a lost reply: same receipt
    assert controller.complete(dataclasses.asdict(lease), ref.manifest) == ref.receipt  # type: ignore[arg-type]
    assert controller.heartbeat([lease]) == ["StaleAttempt"]
    assert controller.accepted(ref.receipt) == ref.receipt


def test_failed_groups_are_recounted_only_when_a_task_failed_since(
    make_config: MakeConfig, open_controller: OpenController, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Counting failed groups reads every task, history too; the count holds while the queue's
    number of failed tasks does (a failed task stays failed)."""
    controller = open_controller(make_config(task_max_attempts=1))
    reads: list[int] = []
    original = Coordinator.tasks
    monkeypatch.setattr(Coordinator, "tasks", property(lambda q: (reads.append(1), original.fget(q))[1]))  # type: ignore[attr-defined]
    assert controller.metrics()["failed_groups"] == 0 and reads == []  # nothing failed: no read
    first, second = controller.take("r", 2).assignments
    assert controller.fail(first.lease, "engine crashed") == "failed"
    assert controller.metrics()["failed_groups"] == 1 and len(reads) == 1
    assert controller.metrics()["failed_groups"] == 1 and len(reads) == 1  # unchanged: no read
    assert controller.fail(second.lease, "engine crashed again") == "failed"
    assert controller.metrics()["failed_groups"] == 2 and len(reads) == 2


def test_release_fail_and_failed_groups(make_config: MakeConfig, open_controller: OpenController) -> None:
    controller = open_controller(make_config(task_max_attempts=2))
    first = controller.take("r", 2).assignments
    assert controller.release([a.lease for a in first]) == ["released", "released"]
    assert controller.status("prompt:0")["failures"] == 0  # type: ignore[index]
    assert controller.release([first[0].lease]) == ["StaleAttempt"]
    (again,) = controller.queue.acquire("r", 1, task_ids=["prompt:0"]).assignments
    assert controller.fail(again.lease, "engine crashed") == "pending"
    (last,) = controller.queue.acquire("r", 1, task_ids=["prompt:0"]).assignments
    assert controller.fail(last.lease, "engine crashed") == "failed"
    status = controller.status("prompt:0")
    assert status is not None and decode(status["failure"].encode()) == {
        "category": "GeneratorError",
        "reason": "engine crashed",
    }
    assert controller.metrics()["failed_groups"] == 1
    assert controller.fail(last.lease, "engine crashed") == "failed"  # a retry answers the same


# --------------------------------------------------------------------------- scenario 22


def test_scenario_22_deliveries_acknowledge_what_they_carry(
    open_controller: OpenController, open_reader: OpenReader
) -> None:
    controller = open_controller()
    reader = open_reader(controller)
    one, two, three = reader.get_samples(3)
    refs = [reader.publish_group(finish(g), rollout_id=0) for g in (one, two)]
    p = refs[0].receipt.position  # type: ignore[union-attr]
    loaded = load_groups(refs)
    reader.add_samples([loaded[0]])
    deliveries = [t for t in controller.queue.tasks if t.startswith("prompt:delivery:")]
    assert len(deliveries) == 1
    status = controller.status(deliveries[0])
    assert status is not None and status["spec"]["metadata"]["source_positions"] == [p]
    assert status["spec"]["priority"] == 2 and status["spec"]["metadata"]["group_index"] == 0
    assert status["spec"]["metadata"]["prompt"] == dataclasses.asdict(one[0]._queue_prompt.manifest)
    # Training on the delivery's result also processes what it replaced.
    (again,) = reader.get_samples(1)
    assert again[0]._queue_source_positions == [p]
    ref = reader.publish_group(again, rollout_id=1)
    position = ref.receipt.position  # type: ignore[union-attr]
    controller.record_dispositions([position], "trained")
    view = controller.training_view()
    assert view["processed_cursor"] == 1 and view["processed_positions"] == [position]
    # Rejecting a delivery disposes what it carried.
    reader.add_samples([load_groups([refs[1]])[0]])
    (carried,) = reader.get_samples(1)
    reader.discard_group(carried, "stale")
    view = controller.training_view()
    assert view["processed_cursor"] == 3 and view["processed_positions"] == []  # 0, 1 and 2 processed
    # discard_group of a leased fresh task: Filtered.
    task = three[0]._queue_lease["task_id"]
    reader.discard_group(three, "dup")
    status = controller.status(task)
    assert status is not None and status["state"] == "failed"
    assert decode(status["failure"].encode()) == {"category": "Filtered", "reason": "dup"}
    assert controller.metrics()["failed_groups"] == 0  # a filtered group is not a failure


# --------------------------------------------------------------------------- scenario 23


def test_scenario_23_retiring_a_reader_returns_only_what_nobody_has(
    open_controller: OpenController, open_reader: OpenReader
) -> None:
    controller = open_controller()
    r = open_reader(controller, "R")
    groups = r.get_samples(5)
    refs = [r.publish_group(finish(g), rollout_id=0) for g in groups[:4]]
    assert [ref.receipt.position for ref in refs] == [0, 1, 2, 3]  # type: ignore[union-attr]
    controller.record_dispositions([1], "trained")
    helper = open_reader(controller, "helper")
    helper.add_samples([load_groups([refs[2]])[0]])  # position 2 is superseded by a delivery
    late = Lease.from_dict(groups[4][0]._queue_lease)
    receipts = controller.retire_reader("R", delivered=[0])
    assert [rc.position for rc in receipts] == [3] and isinstance(receipts[0], CommitReceipt)
    with pytest.raises(StaleAttempt, match=r"^Reader was retired by the scheduler$"):
        controller.take("R", 1)
    manifest = pack_payload(finish(groups[4]), config=controller.config, rollout_id=0).manifest
    with pytest.raises(StaleAttempt, match=r"^Reader was retired by the scheduler$"):
        controller.complete(late, manifest)
    done = Lease.from_dict(groups[0][0]._queue_lease)
    assert controller.complete(done, refs[0].manifest) == refs[0].receipt  # an accepted retry still answers
    assert controller.status(late.task_id)["state"] == "pending"  # type: ignore[index]


def test_retire_readers_by_prefix(open_controller: OpenController) -> None:
    controller = open_controller()
    for reader in ("w:1", "w:2", "wx", "other"):
        controller.take(reader, 1)
    assert controller.retire_readers("w") == []
    for reader in ("w:1", "w:2"):
        with pytest.raises(StaleAttempt):
            controller.take(reader, 1)
    assert controller.take("wx", 1).status == "acquired"
    assert controller.queue.metrics()["tasks"]["pending"] >= 2  # the retired readers' tasks came back


# --------------------------------------------------------------------------- scenario 24


def test_scenario_24_collections(open_controller: OpenController, make_config: MakeConfig) -> None:
    config = make_config()
    first = open_controller(config)
    lease = first.begin_collection("0")
    assert first.begin_collection("0") == lease and lease.worker_id == "manager"
    task_id = f"collection:{first.incarnation}:0"
    assert lease.task_id == task_id and first.status(task_id)["state"] == "leased"  # type: ignore[index]
    other = open_controller(make_config(rollout_data_dir=config.rollout_data_dir + "-other"))
    foreign = other.begin_collection("0")
    payload = pack_payload(
        [],
        config=other.config,
        rollout_id=0,
        metadata={"task_id": foreign.task_id, "attempt_id": foreign.attempt_id},
    )
    receipt = other.complete(foreign, payload.manifest)
    with pytest.raises(ValueError, match="not in this run's accepted log"):
        first.accepted(receipt)
    with pytest.raises(TypeError):
        first.accepted("receipt")  # type: ignore[arg-type]
    mine = pack_payload(
        [], config=config, rollout_id=0, metadata={"task_id": task_id, "attempt_id": lease.attempt_id}
    )
    accepted = first.complete(lease, mine.manifest)
    assert first.accepted(accepted) == accepted
    assert first.begin_collection("0") == lease  # completed: the same lease
    second = first.begin_collection("1")
    queue_id = first.plan.queue_id
    first.close()
    plan = RestorePlan("resume", queue_id=queue_id)
    restarted = open_controller(config, restore_plan=plan)
    assert restarted.status(second.task_id)["state"] == "cancelled"  # type: ignore[index]
    assert restarted.status(task_id)["state"] == "completed"  # type: ignore[index]
    assert restarted.accepted(accepted) == accepted
    lease2 = restarted.begin_collection("1")
    assert lease2.task_id == f"collection:{restarted.incarnation}:1"


def test_an_unavailable_collection_task(open_controller: OpenController) -> None:
    controller = open_controller()
    lease = controller.begin_collection("x")
    controller.queue.cancel_task(lease.task_id, request_id="test:cancel")
    with pytest.raises(
        RuntimeError, match=r"^Collection task is not available: collection:.*:x \(cancelled\)$"
    ):
        controller.begin_collection("x")


def test_the_training_consumer_and_identity(open_controller: OpenController) -> None:
    controller = open_controller()
    consumer = controller.queue.consumers["training"]
    assert consumer["owner"] == EXCLUSIVE_OWNER and consumer["open"]
    identity = controller.identity()
    assert identity["mode"] == "new" and identity["timeline"] == 0 and identity["run_id"] == "rollout"
    assert identity["queue_id"].startswith("run:") and identity["incarnation"] == controller.incarnation
    configuration = controller.configuration()
    assert configuration == {
        "dataset_size": 100, "n_samples_per_prompt": 1, "seed": 42, "shuffle": False,
        "run_id": "rollout", "queue_id": identity["queue_id"], "dataset": {},
    }  # fmt: skip
    assert controller.training_state() is None


def test_a_stale_lease_does_not_keep_other_groups_from_returning(
    open_controller: OpenController, open_reader: OpenReader
) -> None:
    controller = open_controller()
    reader = open_reader(controller, "a")
    first, second = reader.get_samples(2)
    controller.queue.cancel_task("prompt:0", request_id="test:cancel")  # first's lease is stale now
    reader.add_samples([interrupt(first), interrupt(second)])
    assert controller.status("prompt:1")["spec"]["metadata"]["returned"] is True  # type: ignore[index]
    status = controller.status("prompt:0")
    assert status is not None and status["state"] == "cancelled"
    assert "returned" not in status["spec"]["metadata"]  # the stale continuation was not adopted
    assert reader.leases() == []
    lease = Lease.from_dict(second[0]._queue_lease)
    answer = controller.return_groups(
        [{"lease": lease, "input_ref": status_input(controller, "prompt:1")}], []
    )
    assert answer["stale"] == ["prompt:1"] and answer["yielded"] == []  # a repeat: already yielded


def status_input(controller: QueueController, task_id: str) -> RecordSetRef:
    return RecordSetRef.from_dict(controller.status(task_id)["spec"]["input_ref"])  # type: ignore[index]
