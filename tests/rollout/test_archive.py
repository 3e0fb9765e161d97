"""straw.rollout.archive: debug archives and .pt dumps (acceptance scenarios 48-50) and their bad input."""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from straw import SharedFilesystemStore
from straw.coordinator import Coordinator
from straw.protocol import Lease, TaskSpec
from straw.rollout.archive import (
    ARCHIVE_CHUNK_SAMPLES,
    PRIVATE_POOL_DIR,
    PRIVATE_RUN_ID,
    RolloutArchive,
    archive_paths,
    debug_path,
    load_debug_rollout_data,
    read_archive_index,
    remove_archive,
    save_debug_rollout_data,
    subsample,
)
from straw.rollout.codec import STORE_CODECS
from straw.rollout.config import RolloutConfig
from straw.rollout.pool import close_rollout_stores, rollout_store
from straw.rollout.refs import DiskPayloadRef, RawRolloutRef, RolloutGroupRef
from straw.rollout.sample import QUEUE_ATTRIBUTES, Sample, SampleStatus
from straw.tensor import TensorRef

MakeConfig = Callable[..., RolloutConfig]


def replay_config(make_config: MakeConfig, **flags: Any) -> RolloutConfig:
    return make_config(
        use_rollout_routing_replay=True, use_score_centering=True, score_centering_top_k=2, **flags
    )


def r3_sc_sample(index: int = 42) -> Sample:
    return Sample(
        index=index,
        group_index=index // 2,
        tokens=[5, 6, 7],
        response_length=2,
        status=SampleStatus.COMPLETED,
        reward=1.5,
        weight_versions=["3"],
        rollout_log_probs=[-0.25, -0.5],
        rollout_routed_experts=torch.arange(2 * 3 * 2, dtype=torch.uint8).reshape(2, 3, 2),
        rollout_topk_token_ids=[[1, 2], [3, 4]],
        rollout_topk_log_probs=[[-0.1, -0.2], [-0.3, -0.4]],
        metadata={"source": "test"},
    )


def lease_of(task_id: str) -> dict[str, Any]:
    return dataclasses.asdict(Lease("rollout", "q", task_id, "attempt-1", 1, 1, "t" * 32, "reader"))


def published(config: RolloutConfig, sample: Sample) -> tuple[Sample, Any]:
    """The sample as a reader gets it back from the pool (lazy replay tensors), and its ref."""
    bound = rollout_store(config)
    with bound.lock:
        ref = bound.codec.publish([sample], submission_id=f"source:{sample.index}")
    return bound.codec.load(ref)[0], ref


# --------------------------------------------------------------------------- scenario 48


def test_scenario_48_a_pt_dump_is_self_contained(make_config: MakeConfig, pool: Path, tmp_path: Path) -> None:
    config = replay_config(make_config)
    original = r3_sc_sample()
    loaded, _ = published(config, original)
    assert isinstance(loaded.rollout_routed_experts, TensorRef)
    loaded._queue_lease = lease_of("prompt:21")  # type: ignore[attr-defined]
    dumps = tmp_path / "dumps"
    path = save_debug_rollout_data(str(dumps / "rollout_{rollout_id}.pt"), [loaded], rollout_id=3)
    assert path == dumps / "rollout_3.pt" and path.is_file()
    close_rollout_stores()
    shutil.rmtree(pool)  # every pack is gone

    data = torch.load(path, weights_only=True)
    assert data["rollout_id"] == 3 and len(data["samples"]) == 1
    (sample,) = load_debug_rollout_data(str(dumps / "rollout_{rollout_id}.pt"), rollout_id=3)
    assert isinstance(sample.rollout_routed_experts, torch.Tensor)
    assert torch.equal(sample.rollout_routed_experts, original.rollout_routed_experts)
    assert torch.equal(sample.rollout_topk_token_ids, torch.tensor([[1, 2], [3, 4]], dtype=torch.int32))
    assert torch.equal(
        sample.rollout_topk_log_probs, torch.tensor([[-0.1, -0.2], [-0.3, -0.4]], dtype=torch.float32)
    )
    assert sample.status == SampleStatus.COMPLETED and sample.tokens == [5, 6, 7]
    assert sample.metadata == {"source": "test"} and sample.reward == 1.5
    assert not any(hasattr(sample, name) for name in QUEUE_ATTRIBUTES)
    beside = [p.name for p in dumps.rglob("*")]
    assert beside == ["rollout_3.pt"]  # no *.pack, no *.bin, no private pool

    ten = [Sample(index=i, tokens=[i]) for i in range(10)]
    save_debug_rollout_data(str(dumps / "ten_{rollout_id}.pt"), ten, rollout_id=0)
    half = load_debug_rollout_data(str(dumps / "ten_{rollout_id}.pt"), rollout_id=0, subsample_ratio=0.5)
    assert [s.index for s in half] == [0, 1, 8, 9]


def test_subsample_rules() -> None:
    ten = [Sample(index=i) for i in range(10)]
    assert [s.index for s in subsample(ten, None)] == list(range(10))
    assert [s.index for s in subsample(ten, 1.0)] == list(range(10))
    assert [s.index for s in subsample(ten, 0.7)] == [0, 1, 2, 7, 8, 9]  # int(7) // 2 = 3
    assert subsample(ten, 0.1) == []  # int(1) // 2 = 0: nothing, not everything
    for bad in (0, 1.5, -0.1, True):
        with pytest.raises(ValueError, match=r"subsample must be in \(0, 1\]"):
            subsample(ten, bad)


def test_a_pt_dump_refuses_what_weights_only_cannot_read(tmp_path: Path) -> None:
    sample = Sample(index=0, metadata={"thing": object()})
    with pytest.raises(TypeError, match=r"sample 0\['metadata'\]\['thing'\] is a builtins.object"):
        save_debug_rollout_data(str(tmp_path / "r_{rollout_id}.pt"), [sample], rollout_id=0)
    assert not (tmp_path / "r_0.pt").exists()


# --------------------------------------------------------------------------- scenario 49


def test_scenario_49_an_archive_keeps_its_samples_until_released(
    make_config: MakeConfig, pool: Path, tmp_path: Path
) -> None:
    config = replay_config(make_config, rollout_queue_online_gc=True)
    loaded, source = published(config, r3_sc_sample(42))
    loaded._queue_lease = lease_of("prompt:21")  # type: ignore[attr-defined]
    loaded._queue_generation_start = 1  # type: ignore[attr-defined]
    loaded.queue_policy_segments = [{"start": 1, "stop": 3, "incarnation": "i", "reported_versions": ["3"]}]
    routes_record = loaded.rollout_routed_experts.record_ref
    path = tmp_path / "debug" / "rollout_7.straw.json"
    assert RolloutArchive.save(path, [loaded], rollout_id=7, config=config) == path

    store = rollout_store(config).store
    store.release_publications([source])  # the source's staging ends
    store.seal()
    store.collect_garbage()
    assert (pool / routes_record.segment.path).exists()
    with RolloutArchive(path) as archive:
        assert archive.keys() == [("sample:42", "prompt:21")]
        (sample,) = archive.load_samples()
        assert not any(hasattr(sample, name) for name in QUEUE_ATTRIBUTES)
        assert sample.queue_policy_segments == loaded.queue_policy_segments  # provenance is kept
        routes = sample.rollout_routed_experts
        assert isinstance(routes, TensorRef) and routes.record_ref == routes_record  # shared, not copied
        assert torch.equal(routes.load(), r3_sc_sample().rollout_routed_experts)
        assert archive.load_samples(sample_key="sample:42", task_key="prompt:21")[0].index == 42
        assert archive.load_samples(task_key="prompt:21")[0].index == 42
        with pytest.raises(KeyError) as missing:
            archive.load_samples(sample_key="sample:43")
        assert missing.value.args[0] == ("sample:43", None)
        with pytest.raises(KeyError):
            archive.load_samples(sample_key="sample:42", task_key="prompt:22")
        exported = archive.export_pt(tmp_path / "exported_7.pt")
        assert archive.release() is True
        assert archive.release() is False  # already released
    assert path.is_file()  # the index stays
    store.seal()
    reclaimed = store.collect_garbage()
    assert reclaimed["reclaimed_files"] >= 1
    assert not (pool / routes_record.segment.path).exists()  # the pack holding the routes is gone
    (dumped,) = load_debug_rollout_data(str(tmp_path / "exported_{rollout_id}.pt"), rollout_id=7)
    assert torch.equal(dumped.rollout_routed_experts, r3_sc_sample().rollout_routed_experts)
    assert exported == tmp_path / "exported_7.pt"

    with pytest.raises(FileExistsError, match="Rollout archives are immutable; choose a new path"):
        RolloutArchive.save(path, [loaded], rollout_id=7, config=config)


def test_an_archive_index_names_its_pool_and_owner(
    make_config: MakeConfig, pool: Path, tmp_path: Path
) -> None:
    config = make_config(rollout_queue_online_gc=True)
    path = tmp_path / "rollout_1.straw.json"
    RolloutArchive.save(
        path, [Sample(index=0), Sample(index=None), Sample(index=None)], rollout_id=1, config=config
    )
    index = read_archive_index(path)
    assert index["format"] == "straw.rollout-archive" and index["version"] == 1
    assert index["root"] == str(pool) and index["run_id"] == "rollout" and index["samples"] == 3
    assert index["rollout_id"] == 1 and index["evaluation"] is False
    owner = index["storage_owner"]
    assert owner == f"archive:{path}:{index['manifest']['digest']}"
    assert rollout_store(config).store.owners(f"archive:{path}:") == [owner]
    with RolloutArchive(path) as archive:
        assert archive.keys() == [("sample:0", None), ("position:1", None), ("position:2", None)]
        assert len(archive) == 3 and archive.reference() is None


def test_a_crash_before_the_index_leaves_an_owner_the_next_save_releases(
    make_config: MakeConfig, tmp_path: Path
) -> None:
    config = make_config(rollout_queue_online_gc=True)
    store = rollout_store(config).store
    path = tmp_path / "rollout_2.straw.json"
    bound = rollout_store(config)
    with bound.lock:
        leftover = bound.codec.publish({"x": 1}, submission_id="leftover")
    store.retain(f"archive:{path}:deadbeef", [leftover])  # as a crash after retain would leave it
    RolloutArchive.save(path, [Sample(index=1)], rollout_id=2, config=config)
    assert store.owners(f"archive:{path}:") == [read_archive_index(path)["storage_owner"]]


# --------------------------------------------------------------------------- scenario 50


def test_scenario_50_a_key_lookup_decodes_one_chunk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    samples = [Sample(index=min(i, 128), tokens=[i]) for i in range(130)]
    path = tmp_path / "rollout_0.straw.json"
    RolloutArchive.save(path, samples, rollout_id=0)  # no job store: a private pool beside the index
    assert ARCHIVE_CHUNK_SAMPLES == 64
    decoded: list[Any] = []
    real = DiskPayloadRef.load

    def counting(self: DiskPayloadRef, **kwargs: Any) -> Any:
        decoded.append(self.manifest.digest)
        return real(self, **kwargs)

    monkeypatch.setattr(DiskPayloadRef, "load", counting)
    with RolloutArchive(path) as archive:
        found = archive.load_samples(sample_key="sample:128")
        assert [s.tokens for s in found] == [[128], [129]]
        assert len(decoded) == 1
        assert len(archive.chunk_refs()) == 3
        assert [s.tokens[0] for s in archive.load_samples()] == list(range(130))


def test_an_archive_without_a_job_store_has_a_private_pool(
    make_config: MakeConfig, pool: Path, tmp_path: Path
) -> None:
    config = replay_config(make_config)
    loaded, _ = published(config, r3_sc_sample(3))
    path = tmp_path / "debug" / "rollout_5.straw.json"
    RolloutArchive.save(path, [loaded], rollout_id=5)
    index = read_archive_index(path)
    private = tmp_path / "debug" / PRIVATE_POOL_DIR
    assert index["root"] == str(private) and index["run_id"] == PRIVATE_RUN_ID
    close_rollout_stores()
    shutil.rmtree(pool)  # the tensors were copied into the private pool
    with RolloutArchive(path) as archive:
        (sample,) = archive.load_samples()
        routes = sample.rollout_routed_experts
        assert isinstance(routes, TensorRef) and routes.root == str(private)
        assert torch.equal(routes.load(), r3_sc_sample().rollout_routed_experts)
    # The private writer was closed: a new writer of that pool collects nothing still owned.
    with SharedFilesystemStore(private, "gc", codecs=STORE_CODECS, online_gc=True) as store:
        store.collect_garbage()
        with RolloutArchive(path) as archive:
            assert archive.load_samples()[0].rollout_routed_experts.load().shape == (2, 3, 2)
            assert archive.release() is True
        assert store.collect_garbage()["reclaimed_files"] >= 1


def test_an_archive_opens_at_another_mount_path(tmp_path: Path) -> None:
    path = tmp_path / "a" / "rollout_0.straw.json"
    RolloutArchive.save(path, [Sample(index=9, tokens=[1])], rollout_id=0)
    moved = tmp_path / "b"
    shutil.copytree(tmp_path / "a", moved)
    shutil.rmtree(tmp_path / "a")
    with RolloutArchive(moved / "rollout_0.straw.json", root=moved / PRIVATE_POOL_DIR) as archive:
        assert archive.load_samples()[0].index == 9


# --------------------------------------------------------------------------- the reference form


def accepted_collection(config: RolloutConfig, groups: list[list[Sample]]) -> RawRolloutRef:
    """A raw collection of group results accepted by a real queue, as the runner makes one."""
    bound = rollout_store(config)
    root = str(bound.store.backend.root)
    queue = Coordinator(
        bound.store, queue_id="archive-tests", namespace=True, exclusive_owner="archive tests"
    )
    try:
        refs = []
        for number, group in enumerate(groups):
            task = f"prompt:{number}"
            queue.submit_tasks(f"submit:{task}", [TaskSpec(task, allow_empty=True)])
            lease = queue.acquire("reader", task_ids=[task]).assignments[0].lease
            for sample in group:
                sample._queue_lease = dataclasses.asdict(lease)  # type: ignore[attr-defined]
            meta = {"task_id": task, "attempt_id": lease.attempt_id}
            with bound.lock:
                manifest = bound.codec.publish(group, submission_id=f"group:{task}", metadata=meta)
            receipt = queue.complete_task(
                lease, submission_id=f"r:{task}", result_ref=manifest, result_digest=manifest.digest
            )
            refs.append(RolloutGroupRef(manifest, root, index=group[0].index, receipt=receipt))
        queue.submit_tasks("submit:collection", [TaskSpec("collection:0", allow_empty=True, control=True)])
        lease = queue.acquire("manager", task_ids=["collection:0"], control=True).assignments[0].lease
        meta = {"task_id": "collection:0", "attempt_id": lease.attempt_id}
        with bound.lock:
            manifest = bound.codec.publish(refs, submission_id="collection", metadata=meta)
        receipt = queue.complete_task(
            lease, submission_id="r:collection", result_ref=manifest, result_digest=manifest.digest
        )
        return RawRolloutRef(manifest, root, receipt=receipt)
    finally:
        queue.close()


def test_an_archive_of_an_accepted_collection_republishes_nothing(
    make_config: MakeConfig, tmp_path: Path
) -> None:
    config = replay_config(make_config, rollout_queue_online_gc=True)
    groups = [[r3_sc_sample(0), r3_sc_sample(1)], [r3_sc_sample(2), r3_sc_sample(3)]]
    raw = accepted_collection(config, groups)
    store = rollout_store(config).store
    before = store.metrics["payload_bytes"]
    path = tmp_path / "rollout_4.straw.json"
    flat = [s for g in groups for s in g]
    RolloutArchive.save(path, flat, rollout_id=4, config=config, reference=raw)
    assert store.metrics["payload_bytes"] - before < 4096  # only the small contents record
    with RolloutArchive(path) as archive:
        assert archive.reference() == raw
        assert archive.keys() == [("sample:0", "prompt:0"), ("sample:1", "prompt:0"),
                                  ("sample:2", "prompt:1"), ("sample:3", "prompt:1")]  # fmt: skip
        found = archive.load_samples(task_key="prompt:1")
        assert [s.index for s in found] == [2, 3]
        assert not any(hasattr(s, name) for s in found for name in QUEUE_ATTRIBUTES)
        assert isinstance(found[0].rollout_routed_experts, TensorRef)
        with pytest.raises(ValueError, match="holds an accepted raw collection"):
            archive.chunk_refs()

    with pytest.raises(ValueError, match="must hold exactly the archived samples"):
        RolloutArchive.save(
            tmp_path / "wrong.straw.json", flat[:3], rollout_id=4, config=config, reference=raw
        )
    other = make_config(rollout_data_dir=str(tmp_path / "other-pool"))
    with pytest.raises(ValueError, match="An archive reference must belong to its storage pool"):
        RolloutArchive.save(tmp_path / "other.straw.json", flat, rollout_id=4, config=other, reference=raw)
    with pytest.raises(ValueError, match="An archive reference must belong to its storage pool"):
        RolloutArchive.save(tmp_path / "private.straw.json", flat, rollout_id=4, reference=raw)
    assert not (tmp_path / "wrong.straw.json").exists() and not (tmp_path / "other.straw.json").exists()


# --------------------------------------------------------------------------- templates and paths


def test_evaluation_archives_and_templates(make_config: MakeConfig, tmp_path: Path) -> None:
    config = make_config()
    assert save_debug_rollout_data(None, [Sample()], rollout_id=0) is None
    template = str(tmp_path / "rollout_{rollout_id}.straw.json")
    evaluation = {"math": {"samples": [Sample(index=0)]}, "code": {"samples": [Sample(index=1)]}}
    path = save_debug_rollout_data(template, evaluation, rollout_id=7, evaluation=True, config=config)
    assert path == tmp_path / "rollout_eval_7.straw.json"
    assert read_archive_index(path)["evaluation"] is True
    with RolloutArchive(path) as archive:
        assert archive.keys() == [("sample:0", None), ("sample:1", None)]
    save_debug_rollout_data(template, [Sample(index=3)], rollout_id=8, config=config)
    save_debug_rollout_data(str(tmp_path / "rollout_{rollout_id}.pt"), [Sample(index=3)], rollout_id=9)
    assert archive_paths(template) == [
        (7, True, tmp_path / "rollout_eval_7.straw.json"),
        (8, False, tmp_path / "rollout_8.straw.json"),
    ]
    assert archive_paths(str(tmp_path / "rollout_{rollout_id}.pt")) == [(9, False, tmp_path / "rollout_9.pt")]

    padded = str(tmp_path / "r_{rollout_id:07d}.straw.json")
    assert debug_path(padded, 12) == tmp_path / "r_0000012.straw.json"
    with pytest.raises(
        ValueError, match=r"Evaluation archives need a \{rollout_id\} field without a format spec"
    ):
        save_debug_rollout_data(padded, evaluation, rollout_id=1, evaluation=True)
    with pytest.raises(ValueError, match=r"Debug rollout data path must end in \.pt or \.straw\.json"):
        save_debug_rollout_data(str(tmp_path / "r_{rollout_id}.json"), [Sample()], rollout_id=1)
    with pytest.raises(TypeError, match="must be a dict with a 'samples' list"):
        save_debug_rollout_data(template, {"math": [Sample()]}, rollout_id=1, evaluation=True)
    assert not list(tmp_path.glob("rollout_eval_1*"))


def test_remove_archive_releases_and_removes(make_config: MakeConfig, tmp_path: Path) -> None:
    config = make_config(rollout_queue_online_gc=True)
    store = rollout_store(config).store
    job = RolloutArchive.save(tmp_path / "a.straw.json", [Sample(index=0)], rollout_id=0, config=config)
    private = RolloutArchive.save(tmp_path / "p" / "b.straw.json", [Sample(index=0)], rollout_id=0)
    dump = save_debug_rollout_data(str(tmp_path / "c_{rollout_id}.pt"), [Sample(index=0)], rollout_id=0)
    assert dump is not None
    owner = read_archive_index(job)["storage_owner"]
    assert remove_archive(job, store) is True and not job.exists()
    assert store.owners(owner) == []
    assert remove_archive(private, store) is True  # released through a store of its own pool
    with SharedFilesystemStore(tmp_path / "p" / PRIVATE_POOL_DIR, "x", codecs=STORE_CODECS) as other:
        assert other.owners("archive:") == []
    assert remove_archive(dump, store) is True and remove_archive(dump, store) is False
    assert remove_archive(job, store) is False


def test_bad_archive_indices(tmp_path: Path) -> None:
    path = tmp_path / "rollout_0.straw.json"
    for content in (
        "not json",
        json.dumps([1]),
        json.dumps({"format": "straw.rollout-archive", "version": 2}),
    ):
        path.write_text(content)
        with pytest.raises(ValueError, match="Unsupported straw rollout archive"):
            RolloutArchive(path)
    index = {"format": "straw.rollout-archive", "version": 1, "root": str(tmp_path), "run_id": "r"}
    path.write_text(json.dumps({**index, "manifest": {"bad": 1}}))
    with pytest.raises(ValueError, match="Unsupported straw rollout archive"):
        RolloutArchive(path)
    with pytest.raises(FileNotFoundError):
        RolloutArchive(tmp_path / "missing.straw.json")
    with pytest.raises(TypeError, match="rollout_id must be an integer"):
        RolloutArchive.save(tmp_path / "x.straw.json", [], rollout_id="1")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="expected a list of Samples"):
        RolloutArchive.save(tmp_path / "x.straw.json", 5, rollout_id=1)
    assert not (tmp_path / "x.straw.json").exists()
