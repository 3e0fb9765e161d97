"""straw.rollout.refs: the reference types and the payload helpers (acceptance scenario 12).

``pack_group`` and ``discard_group`` run against a real ``QueueController``: the completion,
the rejection and the dispositions are the job's own, checked in its queue and training view.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from straw.errors import InvalidReference
from straw.protocol import CommitReceipt, Lease, RecordSetRef, decode
from straw.rollout.config import RolloutConfig
from straw.rollout.controller import QueueController
from straw.rollout.pool import rollout_store, seal_rollout_store
from straw.rollout.refs import (
    DiskPayloadRef,
    RawRolloutRef,
    RolloutGroupRef,
    TrainBatchRef,
    discard_group,
    group_lease,
    inherit_queue_context,
    load_groups,
    materialize,
    pack_group,
    pack_payload,
    record_provenance,
    release_publications,
    unpack_payload,
)
from straw.rollout.sample import Sample, SampleStatus
from straw.tensor import TensorRef, publish_tensors

MakeConfig = Callable[..., RolloutConfig]


@pytest.fixture
def gc_config(make_config: MakeConfig) -> RolloutConfig:
    """The configuration of the queue tests: with online GC, so staging is visible in the catalog."""
    return make_config(rollout_queue_online_gc=True)


@pytest.fixture
def controller(gc_config: RolloutConfig) -> Iterator[QueueController]:
    queue = QueueController(gc_config, dataset=[{"input": f"p{i}"} for i in range(20)], start_gc=False)
    yield queue
    queue.close()


def lease_of(controller: QueueController) -> Lease:
    """A reader's lease on the next prompt task."""
    (assignment,) = controller.take("reader", 1).assignments
    return assignment.lease


def leased_group(lease: Lease, *, first_index: int = 0, size: int = 2) -> list[Sample]:
    group = []
    for i in range(size):
        sample = Sample(
            index=first_index + i, group_index=7, tokens=[1, 2, 3], response_length=2, reward=1.0,
            status=SampleStatus.COMPLETED, weight_versions=["4"],
        )  # fmt: skip
        sample._queue_lease = dataclasses.asdict(lease)  # type: ignore[attr-defined]
        sample._queue_generation_start = 1  # type: ignore[attr-defined]
        sample._queue_incarnation = "inc-1"  # type: ignore[attr-defined]
        group.append(sample)
    return group


# --------------------------------------------------------------------------- scenario 12


def lease_named(task: str, attempt: str) -> dict[str, Any]:
    return dataclasses.asdict(Lease("run", "q", task, attempt, 1, 1, "t" * 32, "w"))


def test_scenario_12_one_authorization_per_group() -> None:
    a, b = Sample(index=0), Sample(index=1)
    a._queue_lease = lease_named("prompt:1", "x")  # type: ignore[attr-defined]
    b._queue_lease = lease_named("prompt:1", "y")  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="one task authorization"):
        group_lease([a, [b]])
    output = Sample(index=0)
    output._queue_lease = lease_named("prompt:2", "z")  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="different queue task authorization"):
        inherit_queue_context(a, [output])


def test_group_lease() -> None:
    assert group_lease([Sample(), Sample()]) is None
    same = [Sample(), [Sample()]]
    for sample in (same[0], same[1][0]):  # type: ignore[index]
        sample._queue_lease = lease_named("prompt:3", "a")  # type: ignore[union-attr]
    lease = group_lease(same)
    assert isinstance(lease, Lease) and lease.task_id == "prompt:3"
    mixed = [same[0], Sample()]
    with pytest.raises(ValueError, match="one task authorization"):
        group_lease(mixed)
    with pytest.raises(TypeError):
        group_lease([1])


def test_inherit_queue_context() -> None:
    source = Sample(index=0)
    source._queue_lease = lease_named("prompt:1", "x")  # type: ignore[attr-defined]
    source._queue_generation_start = 4  # type: ignore[attr-defined]
    source._queue_source_positions = [3]  # type: ignore[attr-defined]
    fresh, kept = Sample(index=1), Sample(index=2)
    kept._queue_source_positions = [9]  # type: ignore[attr-defined]
    kept._queue_lease = lease_named("prompt:1", "x")  # type: ignore[attr-defined]
    inherit_queue_context(source, [fresh, kept])
    assert fresh._queue_lease == source._queue_lease and fresh._queue_generation_start == 4  # type: ignore[attr-defined]
    assert fresh._queue_source_positions == [3] and kept._queue_source_positions == [9]  # type: ignore[attr-defined]
    assert not hasattr(fresh, "_queue_receipt")
    fresh._queue_source_positions.append(5)  # type: ignore[attr-defined]
    assert source._queue_source_positions == [3]  # copied, not shared  # type: ignore[attr-defined]


# --------------------------------------------------------------------------- provenance


def test_record_provenance_spans_each_attempt() -> None:
    sample = Sample(tokens=[1, 2, 3, 4, 5], weight_versions=["1"])
    sample._queue_generation_start = 2  # type: ignore[attr-defined]
    sample._queue_incarnation = "a"  # type: ignore[attr-defined]
    record_provenance([sample])
    assert sample.queue_policy_segments == [  # type: ignore[attr-defined]
        {"start": 0, "stop": 2, "incarnation": None, "reported_versions": None},
        {"start": 2, "stop": 5, "incarnation": "a", "reported_versions": ["1"]},
    ]
    assert sample._queue_generation_start == 5  # type: ignore[attr-defined]
    record_provenance([sample])  # nothing new: nothing recorded
    assert len(sample.queue_policy_segments) == 2  # type: ignore[attr-defined]
    sample.tokens += [6, 7]
    sample.weight_versions.append("2")
    sample._queue_incarnation = "b"  # type: ignore[attr-defined]
    record_provenance([[sample]])
    assert sample.queue_policy_segments[-1] == {  # type: ignore[attr-defined]
        "start": 5, "stop": 7, "incarnation": "b", "reported_versions": ["2"],
    }  # fmt: skip
    untracked = Sample(tokens=[1, 2])
    record_provenance([untracked])
    assert not hasattr(untracked, "queue_policy_segments")
    first = Sample(tokens=[9, 9])
    first._queue_generation_start = 0  # type: ignore[attr-defined]
    record_provenance([first])
    assert first.queue_policy_segments[0]["start"] == 0 and len(first.queue_policy_segments) == 1  # type: ignore[attr-defined]


# --------------------------------------------------------------------------- pack_group / discard_group


def test_pack_group_accepts_a_leased_group(gc_config: RolloutConfig, controller: QueueController) -> None:
    config = gc_config
    lease = lease_of(controller)
    group = leased_group(lease, first_index=14)
    ref = pack_group(group, config=config, controller=controller, rollout_id=0)
    assert isinstance(ref, RolloutGroupRef) and ref.index == 14 and ref.receipt is not None
    assert ref.manifest == ref.receipt.result_ref and ref.receipt.task_id == "prompt:0"
    assert controller.status("prompt:0")["state"] == "completed"  # type: ignore[index]
    assert controller.result(lease) == ref.receipt and controller.accepted(ref.receipt) == ref.receipt
    assert controller.metrics()["accepted_unprocessed"]["count"] == 1
    store = rollout_store(config).store
    records = list(store.read(ref.manifest))
    assert all(
        r.metadata["task_id"] == "prompt:0" and r.metadata["attempt_id"] == lease.attempt_id for r in records
    )
    loaded = ref.load()
    assert [s.index for s in loaded] == [14, 15]
    assert loaded[0].queue_policy_segments[-1] == {  # provenance was recorded before publishing
        "start": 1, "stop": 3, "incarnation": "inc-1", "reported_versions": ["4"],
    }  # fmt: skip
    seal_rollout_store(config)
    assert store.explain(ref.manifest.manifest.segment.path)["staging_over"] is True  # the queue holds it
    again = pack_group(group, config=config, controller=controller, rollout_id=0)  # a retry: same receipt
    assert again == ref


def test_pack_group_without_a_lease_or_a_controller(
    gc_config: RolloutConfig, controller: QueueController
) -> None:
    config = gc_config
    plain = [Sample(index=1)]
    assert pack_group(plain, config=config, controller=None, rollout_id=0) is plain
    group = leased_group(lease_of(controller))
    writes = rollout_store(config).store.metrics["writes"]
    with pytest.raises(ValueError, match=r"^Queue group has a lease but no coordinator binding$"):
        pack_group(group, config=config, controller=None, rollout_id=0)
    group[0].index = None
    group[1].index = None
    with pytest.raises(ValueError, match="needs an integer index"):
        pack_group(group, config=config, controller=controller, rollout_id=0)
    assert rollout_store(config).store.metrics["writes"] == writes
    assert controller.queue.commits == []


def test_discard_group_rejects_or_disposes(gc_config: RolloutConfig, controller: QueueController) -> None:
    config = gc_config
    store = rollout_store(config).store
    lease = lease_of(controller)
    group = leased_group(lease)
    (routes,) = publish_tensors(store, {"rollout_routed_experts": torch.zeros(2, 1)}, submission_id="routes")
    group[0].rollout_routed_experts = routes
    discard_group(group, config=config, controller=controller, reason="dup")
    status = controller.status(lease.task_id)
    assert status is not None and status["state"] == "failed"
    assert decode(status["failure"].encode()) == {"category": "Filtered", "reason": "dup"}
    seal_rollout_store(config)
    assert store.explain(routes.record_ref.segment.path)["staging_over"] is True

    positions = [
        pack_group(
            leased_group(lease_of(controller)), config=config, controller=controller, rollout_id=0
        ).receipt.position
        for _ in range(3)
    ]
    assert positions == [0, 1, 2]
    delivered = [Sample(index=0), Sample(index=1), Sample(index=2)]
    for sample, position in zip(delivered, (2, 1, 2), strict=True):
        sample._queue_receipt = {"position": position}  # type: ignore[attr-defined]
    discard_group(delivered, config=config, controller=controller, reason="rollout_sample_filter")
    view = controller.training_view()
    assert view["processed_cursor"] == 0 and view["processed_positions"] == [1, 2]
    state = controller.training_state()
    assert state is not None
    body = rollout_store(config).codec.load(RecordSetRef.from_dict(state["state_ref"]))
    assert body["disposition"].load() == {
        "version": 1, "positions": [1, 2], "reason": "rollout_sample_filter", "detail": None,
    }  # fmt: skip
    discard_group([Sample()], config=config, controller=None, reason="unleased")  # only staging to end
    with pytest.raises(ValueError, match="non-empty reason"):
        discard_group([Sample()], config=config, controller=controller, reason="")
    with pytest.raises(ValueError, match="no coordinator binding"):
        discard_group(delivered, config=config, controller=None, reason="x")
    unknown = [Sample(index=5)]
    unknown[0]._queue_receipt = {"position": 9}  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match=r"^Invalid accepted-output disposition$"):
        discard_group(unknown, config=config, controller=controller, reason="x")
    assert controller.training_view() == view


# --------------------------------------------------------------------------- payloads and groups


def test_pack_payload_and_unpack(make_config: MakeConfig, pool: Path) -> None:
    config = make_config()
    ref = pack_payload({"n": 1}, config=config, rollout_id=3, metadata={"task_id": "x"})
    assert ref.root == str(pool) and ref.load() == {"n": 1}
    assert pack_payload(ref, config=config, rollout_id=3) is ref
    named = pack_payload([1], config=config, rollout_id=3, submission_id="fixed-id")
    assert pack_payload([1], config=config, rollout_id=3, submission_id="fixed-id") == named
    outer = pack_payload(ref, config=config, rollout_id=3)
    assert unpack_payload(pack_payload([ref], config=config, rollout_id=3)) == [ref]
    assert unpack_payload(outer) == {"n": 1} and unpack_payload(5) == 5
    foreign = pack_payload({"n": 2}, config=make_config(rollout_queue_run_id="other"), rollout_id=0)
    with pytest.raises(InvalidReference):
        pack_payload(foreign, config=config, rollout_id=0)


def test_load_groups_marks_accepted_groups_and_expands(
    gc_config: RolloutConfig, controller: QueueController
) -> None:
    config = gc_config
    accepted = pack_group(leased_group(lease_of(controller), first_index=0), config=config,
                          controller=controller, rollout_id=0)  # fmt: skip
    delivered = dataclasses.replace(accepted, source_positions=(5, 6))
    plain_group = [Sample(index=9)]
    plain_ref = pack_payload(plain_group, config=config, rollout_id=0)
    nested = pack_payload([plain_ref, plain_ref], config=config, rollout_id=0)
    manifest = pack_payload([accepted, nested, plain_group, delivered], config=config, rollout_id=0)
    groups = load_groups(manifest)
    assert [[s.index for s in g] for g in groups] == [[0, 1], [9], [9], [9], [0, 1]]
    receipt = dataclasses.asdict(accepted.receipt)  # type: ignore[arg-type]
    assert all(s._queue_receipt == receipt and not hasattr(s, "_queue_lease") for s in groups[0])
    assert all(s._queue_source_positions == [5, 6] for s in groups[4])
    assert not hasattr(groups[1][0], "_queue_receipt")
    with pytest.raises(TypeError, match="list of groups"):
        load_groups(pack_payload({"not": "a list"}, config=config, rollout_id=0))


def test_references_pickle_small_and_name_their_pool(make_config: MakeConfig, tmp_path: Path) -> None:
    long_pool = tmp_path / ("p" * max(1, 100 - len(str(tmp_path)) - 1))
    assert len(str(long_pool)) == 100 or len(str(tmp_path)) >= 99
    config = make_config(rollout_data_dir=str(long_pool))
    base = pack_payload([Sample(index=3)], config=config, rollout_id=0)
    receipt = CommitReceipt("c" * 32, "prompt:12345", "result:" + "a" * 32, "d" * 64, 123, base.manifest)
    group = RolloutGroupRef(base.manifest, base.root, index=3, receipt=receipt, source_positions=[1, 2])
    raw = RawRolloutRef(base.manifest, base.root, receipt=receipt, metrics={"reward": 1.0})
    partition = list(range(0, 512, 4))
    batch = TrainBatchRef(
        base.manifest, base.root, "batch:" + "c" * 32, 3, "e" * 64,
        selection={"tokens": partition, "raw_reward": None, "total_lengths": None},
        schedule={"partition": partition, "global_batch_sizes": [128], "num_microbatches": 4},
    )  # fmt: skip
    for ref, limit in ((base, 1024), (group, 1024), (raw, 1024), (batch, 2048)):
        data = pickle.dumps(ref)
        assert len(data) < limit, (type(ref).__name__, len(data))
        copy = pickle.loads(data)
        assert copy == ref and type(copy) is type(ref) and copy.root == ref.root
    assert group.source_positions == (1, 2)
    # Nested in a published value, references are dependency edges and decode with the reader's root.
    store = rollout_store(config).store
    outer = pack_payload({"g": group, "raw": raw}, config=config, rollout_id=0)
    assert [d["digest"] for d in store.manifest(outer.manifest)["dependencies"]] == [base.manifest.digest]
    alias = tmp_path / "alias"
    alias.symlink_to(long_pool)
    loaded = outer.load(root=str(alias))
    assert (
        loaded["g"] == group and loaded["g"].root == str(alias) and loaded["raw"].metrics == {"reward": 1.0}
    )
    assert isinstance(loaded["g"].receipt, CommitReceipt)


def test_reference_types_check_their_fields(make_config: MakeConfig) -> None:
    base = pack_payload([Sample()], config=make_config(), rollout_id=0)
    with pytest.raises(TypeError, match="holds a RecordSetRef"):
        DiskPayloadRef("raw/x.pack", "/pool")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="root is a mount path"):
        DiskPayloadRef(base.manifest, None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="path holds ints and strs"):
        DiskPayloadRef(base.manifest, base.root, path=(1.5,))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="one dict per sample"):
        DiskPayloadRef(base.manifest, base.root, sample_metadata=([1],))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="first sample's index"):
        RolloutGroupRef(base.manifest, base.root, index="0")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="CommitReceipt that accepted it"):
        RawRolloutRef(base.manifest, base.root, receipt=None)  # type: ignore[arg-type]


def test_path_and_sample_metadata(make_config: MakeConfig) -> None:
    config = make_config()
    samples = [Sample(index=0, metadata={"a": 1}), Sample(index=1)]
    ref = pack_payload([[samples]], config=config, rollout_id=0)
    group = DiskPayloadRef(ref.manifest, ref.root, path=(0, 0))
    assert [s.index for s in group.load()] == [0, 1]
    tagged = DiskPayloadRef(
        ref.manifest, ref.root, path=(0, 0),
        sample_metadata=({"metadata": {"b": 2}, "rollout_id": 5}, {"label": "x"}),
    )  # fmt: skip
    loaded = tagged.load()
    assert loaded[0].metadata == {"a": 1, "b": 2} and loaded[0].rollout_id == 5 and loaded[1].label == "x"
    assert group.load()[0].metadata == {"a": 1}  # copies were changed, not what is stored
    one = DiskPayloadRef(ref.manifest, ref.root, path=(0, 0, 1), sample_metadata=({"label": "y"},))
    assert one.load().label == "y"
    attribute = DiskPayloadRef(ref.manifest, ref.root, path=(0, 0, 0, "metadata"))
    assert attribute.load() == {"a": 1}
    wrong = DiskPayloadRef(ref.manifest, ref.root, path=(0, 0), sample_metadata=({},))
    with pytest.raises(ValueError, match="1 entries for 2 samples"):
        wrong.load()


def test_train_batch_ref_reads_its_rows_and_schedule(make_config: MakeConfig) -> None:
    config = make_config()
    data = {"tokens": [[1], [2], [3], [4]], "total_lengths": [1, 1, 1, 1], "raw_reward": [0.1, 0.2, 0.3, 0.4]}
    ref = pack_payload(data, config=config, rollout_id=0)
    batch = TrainBatchRef(
        ref.manifest, ref.root, "batch:1", 1, "digest",
        selection={"tokens": [1, 3], "total_lengths": None}, schedule={"partition": [1, 3]},
    )  # fmt: skip
    assert batch.load() == {"tokens": [[2], [4]], "total_lengths": [1, 1, 1, 1], "partition": [1, 3]}
    assert batch.load(selection={"raw_reward": [0]}) == {"raw_reward": [0.1], "partition": [1, 3]}


def test_materialize_loads_every_tensor_ref(make_config: MakeConfig) -> None:
    config = make_config()
    store = rollout_store(config).store
    (routes,) = publish_tensors(store, {"r": torch.arange(4)}, submission_id="m")
    sample = Sample(index=1, rollout_routed_experts=routes, metadata={"more": [routes, (routes,)]})
    sample._queue_lease = {"k": routes}  # type: ignore[attr-defined]
    out = materialize({"s": [sample], "t": routes, "n": 3})
    copy = out["s"][0]
    assert copy is not sample and isinstance(copy.rollout_routed_experts, torch.Tensor)
    assert copy.rollout_routed_experts is copy.metadata["more"][0] is copy.metadata["more"][1][0]
    assert isinstance(copy._queue_lease["k"], torch.Tensor) and torch.equal(out["t"], torch.arange(4))
    assert isinstance(sample.rollout_routed_experts, TensorRef) and out["n"] == 3


def test_release_publications_in_chunks(make_config: MakeConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    config = make_config(rollout_queue_online_gc=True)
    store = rollout_store(config).store
    refs = [pack_payload({"i": i, "pad": "x" * 2000}, config=config, rollout_id=0) for i in range(300)]
    calls: list[int] = []
    original = store.release_publications

    def counted(items: Any, **options: Any) -> None:
        items = list(items)
        calls.append(len(items))
        assert options == {"defer": True}  # the owner holds them: the end rides a later frame
        original(items, **options)

    monkeypatch.setattr(store, "release_publications", counted)
    release_publications(config, [*refs[:150], None, *(r.manifest for r in refs[150:])])
    assert calls == [128, 128, 44]
    release_publications(config, [])
    assert calls == [128, 128, 44]
    with pytest.raises(TypeError, match="DiskPayloadRef or a RecordSetRef"):
        release_publications(config, ["raw/x.pack"])
    seal_rollout_store(config)
    assert store.collect_garbage()["reclaimed_files"] == 1  # nothing else holds them: collected
    assert not os.path.exists(store.backend.resolve(refs[0].manifest.manifest.segment.path))
