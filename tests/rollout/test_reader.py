"""straw.rollout.reader: QueueReader (heartbeats, taking, returning, continuations) and
QueueDataSource (reader configs, consumers, save and load); acceptance scenarios 19-21."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import straw.rollout.reader as reader_module
from queue_helpers import catalog_events
from rollout_helpers import finish, group_indices, interrupt, prompt_rows
from straw.errors import CorruptData, LeaseExpired
from straw.protocol import Lease, RecordSetRef, TaskSpec
from straw.rollout.config import RolloutConfig
from straw.rollout.controller import QueueController
from straw.rollout.pool import rollout_store
from straw.rollout.reader import QueueDataSource, QueueReader, QueueReaderConfig, SourceRestore
from straw.rollout.refs import DiskPayloadRef, load_groups
from straw.rollout.sample import Sample
from straw.tensor import TensorRef

OpenController = Callable[..., QueueController]
OpenReader = Callable[..., QueueReader]
MakeConfig = Callable[..., RolloutConfig]


def test_get_samples_attaches_the_queue_context(
    open_controller: OpenController, open_reader: OpenReader
) -> None:
    controller = open_controller()
    reader = open_reader(controller)
    groups = reader.get_samples(3)
    assert group_indices(groups) == [0, 1, 2] and len(reader.leases()) == 3
    sample = groups[1][0]
    lease = Lease.from_dict(sample._queue_lease)
    assert lease.task_id == "prompt:1" and lease.worker_id == "r"
    assert sample._queue_generation_start == 0 and sample._queue_source_positions == []
    assert sample._queue_incarnation == controller.incarnation
    assert isinstance(sample._queue_prompt, DiskPayloadRef)
    assert sample._queue_prompt.manifest == RecordSetRef.from_dict(
        controller.status("prompt:1")["spec"]["input_ref"]
    )  # type: ignore[index]
    assert reader.get_samples(0) == []
    assert len(reader) == 100
    assert len(open_reader(controller, "sized", dataset_size=7)) == 7


def test_get_samples_async_runs_on_the_reader_thread(
    open_controller: OpenController, open_reader: OpenReader
) -> None:
    reader = open_reader(open_controller())
    groups = asyncio.run(reader.get_samples_async(2))
    assert group_indices(groups) == [0, 1]


def test_many_groups_are_taken_in_chunks(open_controller: OpenController, open_reader: OpenReader) -> None:
    controller = open_controller()
    groups = open_reader(controller).get_samples(130)
    assert group_indices(groups) == list(range(130))


def test_inputs_load_through_one_read_session_closed_with_the_reader(
    open_controller: OpenController, open_reader: OpenReader, monkeypatch: pytest.MonkeyPatch
) -> None:
    opened: list[Any] = []
    original = reader_module.open_reader

    def counted(root: Any, run_id: str) -> Any:
        opened.append(original(root, run_id))
        return opened[-1]

    monkeypatch.setattr(reader_module, "open_reader", counted)
    controller = open_controller()
    reader = open_reader(controller)
    assert group_indices(reader.get_samples(2) + reader.get_samples(3)) == [0, 1, 2, 3, 4]
    assert len(opened) == 1  # index frames and verified inputs are reused from take to take
    reader.close()
    with pytest.raises(RuntimeError, match="closed"):
        opened[0].resolve(RecordSetRef.from_dict(controller.status("prompt:0")["spec"]["input_ref"]))
    with pytest.raises(RuntimeError, match="closed"):
        reader.get_samples(1)


def test_a_damaged_input_is_refused_through_the_reused_session(
    open_controller: OpenController, open_reader: OpenReader, pool: Path
) -> None:
    controller = open_controller()
    reader = open_reader(controller)
    reader.get_samples(1)  # the session now holds verified frames of the prompt pack
    ref = RecordSetRef.from_dict(controller.status("prompt:1")["spec"]["input_ref"])
    path = pool / ref.manifest.segment.path
    data = bytearray(path.read_bytes())
    document = None
    with rollout_store(controller.config).store.read_session() as session:
        document = session.resolve(ref).records[0].entry
    data[document.offset + 2] ^= 0x01  # a byte of group 1's sample document
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptData):
        reader.get_samples(1)
    assert reader.leases() == [] or all(lease.task_id != "prompt:1" for lease in reader.leases())


# --------------------------------------------------------------------------- scenario 19


def test_scenario_19_a_lost_lease_stops_the_reader(
    open_controller: OpenController, open_reader: OpenReader, monkeypatch: pytest.MonkeyPatch
) -> None:
    controller = open_controller()
    reader = open_reader(controller)
    reader.get_samples(1)
    monkeypatch.setattr(controller, "heartbeat", lambda leases: ["LeaseExpired" for _ in leases])
    with pytest.raises(LeaseExpired, match=r"^Reader lost lease for prompt:0: LeaseExpired$"):
        reader.heartbeat()
    with pytest.raises(RuntimeError, match=r"^Queue lease heartbeat failed$") as failed:
        reader.get_samples(1)
    assert isinstance(failed.value.__cause__, LeaseExpired)
    assert str(failed.value.__cause__).startswith("Reader lost lease for prompt:")
    with pytest.raises(ValueError, match=r"^num_samples must be nonnegative$"):
        reader.get_samples(-1)
    with pytest.raises(TypeError):
        reader.get_samples("2")  # type: ignore[arg-type]
    reader.close()
    with pytest.raises(RuntimeError, match="Queue reader is closed"):
        reader.get_samples(1)


def test_heartbeats_extend_and_drop_stale_leases(
    open_controller: OpenController, open_reader: OpenReader
) -> None:
    controller = open_controller()
    reader = open_reader(controller)
    reader.get_samples(2)
    controller.queue.cancel_task("prompt:1", request_id="test:cancel")
    reader.heartbeat()
    assert [lease.task_id for lease in reader.leases()] == ["prompt:0"]
    assert reader.last_heartbeat is not None


def test_close_releases_local_leases(open_controller: OpenController, open_reader: OpenReader) -> None:
    controller = open_controller()
    reader = open_reader(controller)
    reader.get_samples(2)
    reader.close()
    reader.close()
    assert controller.status("prompt:0")["state"] == "pending"  # type: ignore[index]
    assert controller.status("prompt:0")["failures"] == 0  # type: ignore[index]


# --------------------------------------------------------------------------- scenario 20


def test_scenario_20_a_returned_partial_continues(
    open_controller: OpenController, open_reader: OpenReader
) -> None:
    controller = open_controller()
    reader = open_reader(controller)
    (group,) = reader.get_samples(1)
    interrupt(group, version="7", tokens=2)
    reader.add_samples([group])
    status = controller.status("prompt:0")
    assert status is not None and status["state"] == "pending" and status["failures"] == 0
    spec = TaskSpec.from_dict(status["spec"])
    assert spec.priority == 1 and spec.scheduling_key == 7 and spec.metadata["returned"] is True
    continuation = DiskPayloadRef(spec.input_ref, controller.config.rollout_data_dir).load()  # type: ignore[arg-type]
    assert continuation[0].tokens == [200, 201]
    assert controller.pending_count() == 1
    (again,) = reader.get_samples(1)
    assert again[0].tokens == [200, 201] and again[0].response_length == 2
    assert again[0]._queue_generation_start == 2
    segments = again[0].queue_policy_segments
    assert segments == [
        {"start": 0, "stop": 2, "incarnation": controller.incarnation, "reported_versions": ["7"]}
    ]


def test_returning_an_accepted_leased_group_delivers_it(
    open_controller: OpenController, open_reader: OpenReader
) -> None:
    controller = open_controller()
    reader = open_reader(controller)
    (group,) = reader.get_samples(1)
    finish(group)
    ref = reader.publish_group(group, rollout_id=0)
    assert ref.receipt is not None and "_queue_lease" in vars(group[0])
    reader.add_samples([group])  # as if the reply was lost: the lease still sits on the samples
    (delivery,) = [t for t in controller.queue.tasks if t.startswith("prompt:delivery:")]
    assert controller.status(delivery)["spec"]["metadata"]["source_positions"] == [0]  # type: ignore[index]


def test_an_accepted_group_returned_twice_is_delivered_once(
    open_controller: OpenController, open_reader: OpenReader, caplog: pytest.LogCaptureFixture
) -> None:
    controller = open_controller()
    reader = open_reader(controller)
    (group,) = reader.get_samples(1)
    finish(group)
    reader.publish_group(group, rollout_id=0)
    reader.add_samples([group])
    with caplog.at_level(logging.WARNING, logger="straw.rollout.controller"):
        reader.add_samples([group])  # the same group again: it would be trained twice
    deliveries = [t for t in controller.queue.live_tasks() if t.startswith("prompt:delivery:")]
    assert len(deliveries) == 1
    assert "already carries (source positions [0])" in caplog.text
    # Two copies in one call: the first is delivered, the second is not. (The reader takes
    # the delivery first; finished again, it is accepted at 1, carrying 0 as well.)
    (again,) = reader.get_samples(1)
    assert again[0]._queue_source_positions == [0]
    finish(again)
    reader.publish_group(again, rollout_id=0)
    reader.add_samples([again, again])
    deliveries = [t for t in controller.queue.tasks if t.startswith("prompt:delivery:")]
    sources = [controller.status(t)["spec"]["metadata"]["source_positions"] for t in deliveries]  # type: ignore[index]
    assert sorted(sources) == [[0], [0, 1]]


def test_a_published_group_stages_no_owner_for_its_prompt(
    open_controller: OpenController, open_reader: OpenReader
) -> None:
    """The queue keeps the prompt through the lease's read (docs/GC.md "Staging and writers"),
    so the result vouches for it; the accepted result then keeps it alive."""
    controller = open_controller()
    reader = open_reader(controller)
    (group,) = reader.get_samples(1)
    prompt = group[0]._queue_prompt.manifest
    finish(group)
    root = Path(controller.config.rollout_data_dir)
    ref = reader.publish_group(group, rollout_id=0)
    store = rollout_store(controller.config).store
    assert store.owners("staging:") == []  # (flushes the deferred release of the result)
    retains = [e["owner"] for e in catalog_events(root) if e["op"] == "retain"]
    assert not [owner for owner in retains if owner.startswith("staging:")]
    (accepted,) = load_groups([ref])
    assert accepted[0]._queue_prompt.manifest == prompt  # still a dependency edge of the result
    assert prompt.manifest.segment.path in store.reach([ref.manifest])


# --------------------------------------------------------------------------- scenario 21


def test_scenario_21_an_incomplete_continuation_is_requeued(
    make_config: MakeConfig,
    open_controller: OpenController,
    open_reader: OpenReader,
    caplog: pytest.LogCaptureFixture,
) -> None:
    controller = open_controller(make_config(use_rollout_routing_replay=True))
    reader = open_reader(controller)
    good, bad = reader.get_samples(2)
    for group, rows in ((good, 1), (bad, 3)):
        interrupt(group, tokens=2)
        group[0].rollout_routed_experts = torch.zeros(rows, 1, 2, dtype=torch.uint8)
    before = controller.status("prompt:1")["spec"]["input_ref"]  # type: ignore[index]
    with caplog.at_level(logging.WARNING, logger="straw.rollout.reader"):
        reader.add_samples([good, bad])
    assert "Requeued 1 incomplete continuations from their last durable inputs" in caplog.text
    assert "(1, 'rollout_routed_experts', 3, 1)" in caplog.text
    status = controller.status("prompt:1")
    assert status is not None and status["state"] == "pending" and status["spec"]["input_ref"] == before
    assert status["failures"] == 0 and "returned" not in status["spec"]["metadata"]
    assert controller.status("prompt:0")["spec"]["metadata"]["returned"] is True  # type: ignore[index]
    assert reader.leases() == []
    orphan = [Sample(index=5, group_index=5, tokens=[1, 2, 3], response_length=2)]
    orphan[0].rollout_routed_experts = torch.zeros(4, 1, 2)
    with pytest.raises(ValueError, match=r"^Incomplete continuation has no durable task input to retry: "):
        reader.add_samples([orphan])


def test_a_score_centering_continuation_must_cover_its_response(
    make_config: MakeConfig, open_controller: OpenController, open_reader: OpenReader
) -> None:
    config = make_config(use_score_centering=True, score_centering_top_k=2)
    controller = open_controller(config)
    reader = open_reader(controller)
    (group,) = reader.get_samples(1)
    interrupt(group, tokens=2)
    group[0].rollout_topk_token_ids = [[1, 2]]
    group[0].rollout_topk_log_probs = [[0.1, 0.2], [0.1, 0.2]]
    reader.add_samples([group])
    assert "returned" not in controller.status("prompt:0")["spec"]["metadata"]  # type: ignore[index]


def test_returned_replay_tensors_stay_lazy(
    make_config: MakeConfig, open_controller: OpenController, open_reader: OpenReader
) -> None:
    controller = open_controller(make_config(use_rollout_routing_replay=True))
    reader = open_reader(controller)
    (group,) = reader.get_samples(1)
    interrupt(group, tokens=3)
    group[0].rollout_routed_experts = torch.arange(4, dtype=torch.int32).reshape(2, 1, 2)
    reader.add_samples([group])
    (again,) = reader.get_samples(1)
    routes = again[0].rollout_routed_experts
    assert isinstance(routes, TensorRef) and routes.shape == (2, 1, 2)
    loaded = reader.materialize_samples(again)
    assert torch.equal(loaded[0].rollout_routed_experts, torch.arange(4, dtype=torch.int32).reshape(2, 1, 2))
    assert isinstance(again[0].rollout_routed_experts, TensorRef)


def test_unleased_and_plain_groups_become_deliveries(
    open_controller: OpenController, open_reader: OpenReader
) -> None:
    controller = open_controller()
    reader = open_reader(controller)
    plain = [Sample(index=50, group_index=50, prompt="p")]
    reader.add_samples([plain])
    (delivery,) = [t for t in controller.queue.tasks if t.startswith("prompt:delivery:")]
    status = controller.status(delivery)
    assert status is not None and status["spec"]["metadata"]["source_positions"] == []
    assert status["spec"]["metadata"]["prompt"] == status["spec"]["input_ref"]  # its own input stands in


def test_publish_group_needs_a_lease(open_controller: OpenController, open_reader: OpenReader) -> None:
    reader = open_reader(open_controller())
    with pytest.raises(ValueError, match="takes a leased group"):
        reader.publish_group([Sample(index=0)], rollout_id=0)


def test_readers_refuse_save_and_load(open_controller: OpenController, open_reader: OpenReader) -> None:
    reader = open_reader(open_controller())
    with pytest.raises(RuntimeError, match=r"^Save queue readers through their owning data source$"):
        reader.save()
    with pytest.raises(RuntimeError, match=r"^Restore queue readers through their owning data source$"):
        reader.load()


# --------------------------------------------------------------------------- the data source


class Consumer:
    def __init__(self, paused: bool = False) -> None:
        self.paused = paused
        self.calls: list[str] = []
        self.loaded: Any = None

    def pause(self) -> bool:
        self.calls.append("pause")
        was, self.paused = self.paused, True
        return was

    def resume(self) -> None:
        self.calls.append("resume")
        self.paused = False

    def state_dict(self) -> dict[str, Any]:
        self.calls.append("state_dict")
        return {"seen": 4}

    def load_state_dict(self, state: Any) -> None:
        self.loaded = state

    def close(self) -> None:
        self.calls.append("close")


def test_data_source_reader_configs(make_config: MakeConfig) -> None:
    source = QueueDataSource(make_config(), dataset=prompt_rows(10), reader_prefix="job")
    try:
        assert source.reader_id == "job:owner" and len(source) == 10
        with pytest.raises(ValueError, match=r"^Reader ID 'owner' is reserved$"):
            source.reader_config("owner")
        reader_config = source.reader_config("w1")
        assert reader_config.reader_id == "job:w1" and reader_config.dataset_size == 10
        assert reader_config.incarnation == source.controller.identity()["incarnation"]  # type: ignore[attr-defined]
        reader = reader_config.open()
        try:
            assert group_indices(reader.get_samples(1)) == [0]
        finally:
            reader.close()
        assert source.get_samples(1)[0][0]._queue_lease["worker_id"] == "job:owner"
        picklable = QueueReaderConfig(reader_config.config, "proxy", "w2", 3)  # type: ignore[arg-type]
        assert pickle.loads(pickle.dumps(picklable)) == picklable
    finally:
        source.close()
    with pytest.raises(RuntimeError, match="closed"):
        source.controller.take("x", 1)


def test_data_source_consumers_save_and_load(make_config: MakeConfig, tmp_path: Path) -> None:
    save = tmp_path / "save"
    config = make_config(save=str(save), save_interval=1)
    source = QueueDataSource(config, dataset=prompt_rows(10))
    running, paused = Consumer(), Consumer(paused=True)
    source.register_consumer("runner", running)
    source.register_consumer("other", paused)
    with pytest.raises(ValueError, match=r"^Consumer 'runner' already registered$"):
        source.register_consumer("runner", Consumer())
    with pytest.raises(TypeError, match="lacks"):
        source.register_consumer("bad", object())
    assert source.load(None) == SourceRestore("new", None, 0)
    groups = source.get_samples(2)
    source.publish_group(finish(groups[0]), rollout_id=0)
    path = source.save(3)
    assert path == save / "rollout" / "queue_state_3.json"
    assert running.calls == ["pause", "state_dict", "resume"] and paused.calls == ["pause", "state_dict"]
    index = json.loads(path.read_text())
    controller = source.controller
    assert index["version"] == 1 and index["step"] == 3 and index["queue_id"] == controller.plan.queue_id  # type: ignore[attr-defined]
    assert index["run_id"] == "rollout" and index["root"] == config.rollout_data_dir
    ref = RecordSetRef.from_dict(index["manifest"])
    assert index["storage_owner"] == f"checkpoint:{path}:{ref.digest}"
    store = rollout_store(source.config).store
    assert store.owners("checkpoint:") == [index["storage_owner"]]
    body = rollout_store(source.config).codec.load(ref)
    assert body["consumers"] == {"runner": {"seen": 4}, "other": {"seen": 4}}
    assert index["producer"] == body["producer"] and index["configuration"] == body["configuration"]
    cursor = json.loads((save / "rollout" / "global_dataset_state_dict_3.json").read_text())
    assert cursor == {"version": 1, "step": 3, "timeline": 0, **body["producer"]["cursor"]}
    with pytest.raises(RuntimeError, match=r"^Restore before starting rollout consumers$"):
        source.load(3)
    source.close()
    assert running.calls[-1] == "close" and paused.calls[-1] == "close"


def test_a_replay_source_saves_nothing(make_config: MakeConfig, tmp_path: Path) -> None:
    config = make_config(save=str(tmp_path / "save"), save_interval=1)
    controller = QueueController(config, dataset=prompt_rows(4))
    try:
        controller.plan = dataclasses.replace(controller.plan, queue_id="debug:" + "0" * 32)
        source = QueueDataSource(config, controller=controller)
        assert source.save(0) is None
        assert not (tmp_path / "save" / "rollout" / "queue_state_0.json").exists()
        source.close()
        assert controller.take("r", 1).status == "acquired"  # not owned: still open
    finally:
        controller.close()


def test_load_groups_of_returned_and_accepted_groups(
    open_controller: OpenController, open_reader: OpenReader
) -> None:
    controller = open_controller()
    reader = open_reader(controller)
    (group,) = reader.get_samples(1)
    ref = reader.publish_group(finish(group), rollout_id=0)
    (loaded,) = load_groups([ref])
    assert loaded[0]._queue_receipt["position"] == 0 and not hasattr(loaded[0], "_queue_lease")
