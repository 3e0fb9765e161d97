"""straw.rollout.codec: the SampleCodec's rules (acceptance scenarios 6-11) and its bad input."""

from __future__ import annotations

import dataclasses
import os
import pickle
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from straw import SharedFilesystemStore
from straw import codec as straw_codec
from straw.codec import PayloadRef
from straw.errors import InvalidReference, ResourceLimitExceeded, UnsupportedSchema
from straw.protocol import Record, encode
from straw.rollout.codec import SampleCodec, register_type
from straw.rollout.config import RolloutConfig
from straw.rollout.hooks import DynamicFilterOutput
from straw.rollout.pool import rollout_store
from straw.rollout.refs import DiskPayloadRef, pack_payload
from straw.rollout.sample import Sample, SampleStatus
from straw.store import ReadSession
from straw.tensor import POOL_ROOTS_ENV, TensorRef, publish_tensors

MakeConfig = Callable[..., RolloutConfig]
CHILD_TIMEOUT_S = 120


@dataclasses.dataclass
class Registered:
    """A user type the rollout codec may store once register_type() allowed it."""

    name: str
    weight: float = 1.0


@dataclasses.dataclass
class NotRegistered:
    value: int = 0


register_type(Registered)


def codec_of(config: RolloutConfig) -> SampleCodec:
    return rollout_store(config).codec


# --------------------------------------------------------------------------- scenario 6

CHILD = textwrap.dedent(
    """
    import os, pickle, sys
    assert "STRAW_POOL_ROOTS" not in os.environ
    import straw.rollout
    ref = pickle.loads(sys.stdin.buffer.read())
    value = ref.load()
    routes = value["sample"].rollout_routed_experts
    out = {
        "tensor_is_alias": value["tensor"] is value["alias"],
        "tensor_type": type(value["tensor"]).__name__,
        "last": int(value["tensor"][-1]),
        "text_ok": value["text"] == "x" * 10**6,
        "routes_type": type(routes).__name__,
        "rows": routes[999990:].tolist(),
        "routes_root": routes.root,
    }
    sys.stdout.buffer.write(pickle.dumps(out))
    """
)


def test_scenario_6_a_reference_loads_in_a_fresh_process_with_no_setup(
    make_config: MakeConfig, pool: Path
) -> None:
    config = make_config()
    t = torch.arange(10**6, dtype=torch.int32)
    value = {
        "sample": Sample(tokens=[1, 2], response_length=1, rollout_routed_experts=t),
        "tensor": t,
        "alias": t,
        "text": "x" * 10**6,
    }
    ref = pack_payload(value, config=config, rollout_id=0)
    data = pickle.dumps(ref)
    assert len(data) < 1024
    env = {k: v for k, v in os.environ.items() if k != POOL_ROOTS_ENV}
    result = subprocess.run(
        [sys.executable, "-c", CHILD],
        input=data,
        capture_output=True,
        env=env,
        timeout=CHILD_TIMEOUT_S,
        check=False,
    )  # the writer is still open: rollout_store cached it
    assert result.returncode == 0, result.stderr.decode()[-3000:]
    got = pickle.loads(result.stdout)
    assert got["tensor_is_alias"] and got["tensor_type"] == "Tensor" and got["last"] == 999999
    assert got["text_ok"] and got["routes_type"] == "TensorRef"
    assert got["rows"] == list(range(999990, 10**6)) and got["routes_root"] == str(pool)


# --------------------------------------------------------------------------- scenario 7


def test_scenario_7_edge_tensors_round_trip_exactly(make_config: MakeConfig) -> None:
    codec = codec_of(make_config())
    value = {
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros((0, 3), dtype=torch.int64),
        "bf16": torch.randn(5, 4, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16),
    }
    loaded = codec.load(codec.publish(value, submission_id="edges"))
    for name, tensor in value.items():
        got = loaded[name]
        assert isinstance(got, torch.Tensor) and got.dtype == tensor.dtype and got.shape == tensor.shape
        assert got.reshape(-1).view(torch.uint8).tolist() == tensor.reshape(-1).view(torch.uint8).tolist()


# --------------------------------------------------------------------------- scenario 8


def sc_config(make_config: MakeConfig) -> RolloutConfig:
    return make_config(use_rollout_routing_replay=True, use_score_centering=True, score_centering_top_k=2)


def test_scenario_8_replay_fields_are_typed_lazy_and_checked(make_config: MakeConfig) -> None:
    codec = codec_of(sc_config(make_config))
    sample = Sample(
        index=5,
        tokens=[1, 2, 3],
        response_length=2,
        status=SampleStatus.COMPLETED,
        reward=1.0,
        rollout_routed_experts=torch.zeros((2, 1, 2), dtype=torch.uint8),
        rollout_topk_token_ids=[[1, 2], [3, 4]],
        rollout_topk_log_probs=[[-0.1, -0.2], [-0.3, -0.4]],
    )
    loaded = codec.load(codec.publish([sample], submission_id="r3sc"))[0]
    fields = ("rollout_routed_experts", "rollout_topk_token_ids", "rollout_topk_log_probs")
    refs = [getattr(loaded, name) for name in fields]
    assert all(isinstance(r, TensorRef) for r in refs)
    assert len({r.record_ref.segment.path for r in refs}) == 1
    assert [r.dtype for r in refs] == ["uint8", "int32", "float32"]
    assert torch.equal(refs[1].load(), torch.tensor([[1, 2], [3, 4]], dtype=torch.int32))
    assert loaded._replay_validated == tuple(sorted(fields))
    assert not hasattr(sample, "_replay_validated")  # the caller's sample is not changed
    assert isinstance(sample.rollout_topk_token_ids, list)

    wrong = dataclasses.replace(sample, rollout_routed_experts=torch.zeros((3, 1, 2), dtype=torch.uint8))
    with pytest.raises(ValueError, match="have 3 rows") as raised:
        codec.publish([wrong], submission_id="wrong-rows")
    assert str(raised.value) == "Rollout routed experts of sample 5 have 3 rows; expected len(tokens) - 1 = 2"
    masked = dataclasses.replace(wrong, loss_mask=[0, 0])
    codec.publish([masked], submission_id="masked")  # fully masked: never trained, not checked

    aborted = Sample(
        index=6,
        tokens=[1, 2, 3],
        response_length=2,
        status=SampleStatus.ABORTED,
        rollout_topk_log_probs=[[-0.1, -0.2]],
        rollout_log_probs=[-0.5],
    )
    partial = codec.load(codec.publish([aborted], submission_id="aborted"))[0]
    assert partial.rollout_topk_log_probs.dtype == "float64"  # unvalidated partial captures stay exact
    assert torch.equal(
        partial.rollout_topk_log_probs.load(), torch.tensor([[-0.1, -0.2]], dtype=torch.float64)
    )
    assert partial.rollout_log_probs == [-0.5] and not hasattr(partial, "_replay_validated")


def test_score_centering_top_k_shapes(make_config: MakeConfig) -> None:
    codec = codec_of(sc_config(make_config))
    base = Sample(index=1, tokens=[1, 2, 3], response_length=2, status=SampleStatus.TRUNCATED, reward=0.0)
    bad_shape = dataclasses.replace(
        base, rollout_topk_token_ids=[[1, 2, 3]] * 2, rollout_topk_log_probs=[[0.0] * 3] * 2
    )
    with pytest.raises(
        ValueError,
        match=r"^Score-centering data of sample 1 is invalid: rollout_topk_token_ids has shape \(2, 3\)",
    ):
        codec.publish([bad_shape], submission_id="k3")
    half = dataclasses.replace(base, rollout_topk_token_ids=[[1, 2]] * 2)
    with pytest.raises(
        ValueError, match="Score-centering data of sample 1 is invalid: rollout_topk_log_probs is missing"
    ):
        codec.publish([half], submission_id="half")
    evaluation = codec.load(codec.publish([base], submission_id="eval"))[0]  # no capture, tokens: skipped
    assert evaluation.rollout_topk_token_ids is None
    prompt_only = dataclasses.replace(base, response_length=0, tokens=[1])
    empty = codec.load(codec.publish([prompt_only], submission_id="empty"))[0]
    assert empty.rollout_topk_token_ids.shape == (0, 2) and empty.rollout_topk_token_ids.dtype == "int32"
    assert empty.rollout_topk_log_probs.dtype == "float32"


def test_score_centering_ragged_top_p(make_config: MakeConfig) -> None:
    config = make_config(use_score_centering=True, rollout_top_p=0.9)
    codec = codec_of(config)
    base = Sample(index=2, tokens=[1, 2, 3], response_length=2, status=SampleStatus.COMPLETED, reward=1.0)
    good = dataclasses.replace(
        base,
        rollout_top_p_token_ids=[5, 6, 7],
        rollout_top_p_token_offsets=[0, 1, 3],
        rollout_top_p_log_probs=[-0.1, -0.2, -0.3],
    )
    loaded = codec.load(codec.publish([good], submission_id="topp"))[0]
    assert loaded.rollout_top_p_token_offsets.dtype == "int32"
    assert loaded.rollout_top_p_log_probs.dtype == "float32"
    assert loaded.rollout_top_p_token_offsets.load().tolist() == [0, 1, 3]
    cases = [
        ({"rollout_top_p_token_offsets": [0, 3]}, "has 2 entries; expected response_length \\+ 1 = 3"),
        ({"rollout_top_p_token_offsets": [1, 2, 3]}, "must start at 0 and never decrease"),
        ({"rollout_top_p_token_offsets": [0, 2, 1]}, "must start at 0 and never decrease"),
        ({"rollout_top_p_token_offsets": [0, 1, 2]}, "the last offset is 2, but there are 3 ids"),
        ({"rollout_top_p_log_probs": None}, "rollout_top_p_log_probs missing"),
        ({"rollout_top_p_token_ids": [[5], [6], [7]]}, "must be 1-D"),
    ]
    for change, message in cases:
        with pytest.raises(ValueError, match=rf"^Score-centering data of sample 2 is invalid: .*{message}"):
            codec.publish([dataclasses.replace(good, **change)], submission_id="bad-topp")
    empty = codec.load(
        codec.publish([dataclasses.replace(base, response_length=0, tokens=[1])], submission_id="e")
    )[0]
    assert empty.rollout_top_p_token_offsets.load().tolist() == [0]
    assert empty.rollout_top_p_token_ids.shape == (0,) and empty.rollout_top_p_log_probs.dtype == "float32"
    skipped = codec.load(codec.publish([base], submission_id="skip"))[0]
    assert skipped.rollout_top_p_token_ids is None


def test_without_a_configuration_nothing_is_checked(pool: Path) -> None:
    with SharedFilesystemStore(pool, "plain", codecs=("sample.v1", "tensor.v1")) as store:
        codec = SampleCodec(store)
        sample = Sample(
            index=1,
            tokens=[1, 2],
            status=SampleStatus.COMPLETED,
            reward=1.0,
            rollout_routed_experts=[[1], [2], [3]],
        )
        loaded = codec.load(codec.publish(sample, submission_id="unchecked"))
        assert loaded.rollout_routed_experts.dtype == "int64"  # not validated: not narrowed


# --------------------------------------------------------------------------- scenario 9


def test_scenario_9_unsupported_and_cyclic_values_write_nothing(make_config: MakeConfig) -> None:
    bound = rollout_store(make_config())
    codec = bound.codec
    with pytest.raises(TypeError, match=r"Unsupported durable Sample field type: builtins.object") as raised:
        codec.publish(Sample(metadata={"x": object()}), submission_id="object")
    assert (
        str(raised.value) == 'Unsupported durable Sample field type: builtins.object at sample.metadata["x"]'
    )
    assert isinstance(raised.value.__cause__, UnsupportedSchema)
    cyclic: dict[str, Any] = {}
    cyclic["self"] = cyclic
    with pytest.raises(TypeError, match="Cyclic custom fields") as cycle:
        codec.publish(Sample(metadata=cyclic), submission_id="cycle")
    assert str(cycle.value).startswith(
        "Cyclic custom fields are not supported by the durable Sample codec: sample.metadata"
    )
    assert isinstance(cycle.value.__cause__, ValueError)
    with pytest.raises(TypeError, match=f"Unsupported durable Sample field type: {__name__}.NotRegistered"):
        codec.publish({"x": NotRegistered()}, submission_id="unregistered")
    with pytest.raises(TypeError, match=r"Unsupported durable Sample field type: builtins.set"):
        codec.publish_many([{"ok": 1}, {"bad": {1}}], submission_ids=["m1", "m2"])
    assert bound.store.metrics["payload_bytes"] == 0 and bound.store.metrics["writes"] == 0


def test_supported_types_round_trip(make_config: MakeConfig) -> None:
    pil = pytest.importorskip("PIL.Image")
    codec = codec_of(make_config())
    image = pil.new("RGB", (3, 2), (10, 20, 30))
    value = {
        1: None,
        (2, 3): [True, 1.5, float("inf"), b"raw", bytearray(b"ba"), np.int32(4), np.arange(3)],
        "status": SampleStatus.FAILED,
        "verdict": DynamicFilterOutput(False, "zero_std"),
        "user": Registered("r", 2.0),
        "image": image,
        "sample": Sample(index=1, tokens=[1], metadata={"deep": {"k": [1, 2]}}),
    }
    value["sample"].extra_attribute = ("kept", 1)  # type: ignore[attr-defined]
    value["sample"]._private_attribute = "kept too"  # type: ignore[attr-defined]
    loaded = codec.load(codec.publish(value, submission_id="types"))
    assert list(loaded) == [1, (2, 3), "status", "verdict", "user", "image", "sample"]
    assert loaded[(2, 3)][:5] == [True, 1.5, float("inf"), b"raw", bytearray(b"ba")]
    assert type(loaded[(2, 3)][5]) is np.int32 and isinstance(loaded[(2, 3)][6], np.ndarray)
    assert loaded["status"] is SampleStatus.FAILED and loaded["verdict"] == DynamicFilterOutput(
        False, "zero_std"
    )
    assert loaded["user"] == Registered("r", 2.0) and loaded["image"].tobytes() == image.tobytes()
    assert (
        loaded["sample"].extra_attribute == ("kept", 1) and loaded["sample"]._private_attribute == "kept too"
    )


def test_record_tokens_count_every_sample(make_config: MakeConfig) -> None:
    codec = codec_of(make_config())
    group = [Sample(tokens=[1, 2, 3]), [Sample(tokens=[4]), Sample(tokens=[5, 6])]]
    ref = codec.publish({"group": group, "again": group[0]}, submission_id="tokens")
    assert ref.tokens == 6


# --------------------------------------------------------------------------- scenario 10


def test_scenario_10_same_pool_refs_are_shared_other_pools_copied(
    make_config: MakeConfig, tmp_path: Path
) -> None:
    bound = rollout_store(make_config())
    codec, store = bound.codec, bound.store
    routes = torch.arange(50_000, dtype=torch.int32).reshape(-1, 10)
    sample = Sample(index=1, tokens=[1, 2], rollout_routed_experts=routes)
    loaded = codec.load(codec.publish(sample, submission_id="first"))
    assert isinstance(loaded.rollout_routed_experts, TensorRef)
    before = store.metrics["payload_bytes"]
    again = codec.load(codec.publish(loaded, submission_id="again"))
    assert store.metrics["payload_bytes"] - before < 4096
    assert again.rollout_routed_experts.record_ref == loaded.rollout_routed_experts.record_ref

    with SharedFilesystemStore(
        tmp_path / "other-pool", "rollout", codecs=("sample.v1", "tensor.v1")
    ) as other:
        (foreign,) = publish_tensors(other, {"rollout_routed_experts": routes}, submission_id="foreign")
    before = store.metrics["payload_bytes"]
    copied = codec.load(codec.publish(Sample(index=2, rollout_routed_experts=foreign), submission_id="copy"))
    assert store.metrics["payload_bytes"] - before >= foreign.nbytes
    assert copied.rollout_routed_experts.record_ref != foreign.record_ref
    assert torch.equal(copied.rollout_routed_experts.load(), routes)


# --------------------------------------------------------------------------- scenario 11


def test_scenario_11_selection_allowlist_and_foreign_readers(
    make_config: MakeConfig, pool: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bound = rollout_store(make_config())
    codec, store = bound.codec, bound.store
    t0, t1 = torch.arange(3), torch.arange(3, 6)
    big = torch.ones(1_000_000, dtype=torch.float32)
    ref = codec.publish({"a": [t0, t1], "b": big}, submission_id="columns")
    touched: list[int] = []
    original = ReadSession.read_into

    def spy(self: ReadSession, record: Any, target: memoryview) -> None:
        touched.append(target.nbytes)
        original(self, record, target)

    monkeypatch.setattr(ReadSession, "read_into", spy)
    got = codec.load(ref, selection={"a": [1]})
    assert list(got) == ["a"] and len(got["a"]) == 1 and torch.equal(got["a"][0], t1)
    assert touched == [t1.nbytes]  # "b" (4 MB) was never read
    monkeypatch.undo()

    listed = codec.publish([t0], submission_id="list-root")
    with pytest.raises(ValueError, match=r"^A column selection requires a dictionary payload"):
        codec.load(listed, selection={"a": None})

    modules = tmp_path / "modules"
    modules.mkdir()
    marker = tmp_path / "imported"
    (modules / "nonexistent_mod.py").write_text(
        f"import dataclasses\nopen({str(marker)!r}, 'w').close()\n\n"
        "@dataclasses.dataclass\nclass Thing:\n    x: int = 0\n"
    )
    monkeypatch.syspath_prepend(str(modules))
    document = {"v": 1, "root": {"t": "dataclass", "cls": "nonexistent_mod:Thing", "fields": [], "attrs": []}}
    crafted = store.publish(
        [Record("sample", encode(document), "sample.v1")],
        submission_id="crafted",
    )
    with pytest.raises(
        UnsupportedSchema, match=r"^Unknown rollout type: nonexistent_mod:Thing; import the module"
    ):
        codec.load(crafted)
    assert "nonexistent_mod" not in sys.modules and not marker.exists()

    with SharedFilesystemStore(pool, "another-run", codecs=("sample.v1", "tensor.v1")) as other_run:
        with (
            other_run.read_session() as session,
            pytest.raises(
                InvalidReference, match=r"^Sample reader belongs to a different storage root or run$"
            ),
        ):
            codec.load(ref, reader=session)
        with pytest.raises(InvalidReference, match="different storage root or run"):
            codec.load(ref, reader=other_run)
        theirs = SampleCodec(other_run).publish({"n": 1}, submission_id="theirs")
        assert codec.load(theirs) == {"n": 1}  # a ref of another run in this pool: its own session
    with (
        SharedFilesystemStore(
            tmp_path / "elsewhere", "rollout", codecs=("sample.v1", "tensor.v1")
        ) as elsewhere,
        pytest.raises(InvalidReference, match="different storage root or run"),
    ):
        codec.load(ref, reader=elsewhere)


def test_a_record_set_that_is_not_a_sample_is_refused(make_config: MakeConfig) -> None:
    bound = rollout_store(make_config())
    raw = bound.store.publish([Record("r", b"bytes")], submission_id="raw")
    with pytest.raises(UnsupportedSchema, match=r"^Expected one sample.v1 collection record$"):
        bound.codec.load(raw)
    with pytest.raises(UnsupportedSchema, match=r"Expected one sample.v1 collection record"):
        DiskPayloadRef(raw, str(bound.store.backend.root)).load()


# --------------------------------------------------------------------------- publish_many and construction


def test_publish_many_bundles_in_as_few_writes_as_allowed(make_config: MakeConfig) -> None:
    bound = rollout_store(make_config())
    codec, store = bound.codec, bound.store
    values = [{"t": torch.full((2,), i)} for i in range(5)]  # 2 records + a manifest each
    store.max_records_per_write = 7  # two values per write
    writes = store.metrics["writes"]
    refs = codec.publish_many(values, submission_ids=[f"v{i}" for i in range(5)], metadata={"task_id": "t"})
    assert store.metrics["writes"] - writes == 3
    assert [int(codec.load(r)["t"][0]) for r in refs] == [0, 1, 2, 3, 4]
    again = codec.publish_many(values, submission_ids=[f"v{i}" for i in range(5)], metadata={"task_id": "t"})
    assert again == refs and store.metrics["writes"] - writes == 3  # a retry writes nothing
    store.max_records_per_write = 2  # one value per write, even when it alone is over the limit
    with pytest.raises(ResourceLimitExceeded):
        codec.publish_many(values[:1], submission_ids=["solo"])
    per_value = codec.publish_many(
        [{"n": 1}, {"n": 2}], submission_ids=["p1", "p2"], metadata=[{"k": 1}, None]
    )
    assert [next(iter(store.read(r))).metadata for r in per_value] == [{"k": 1}, {}]
    assert codec.publish_many([], submission_ids=[]) == []


def test_publish_many_bad_input(make_config: MakeConfig) -> None:
    bound = rollout_store(make_config())
    codec = bound.codec
    with pytest.raises(ValueError, match="2 submission ids for 1 values"):
        codec.publish_many([1], submission_ids=["a", "b"])
    with pytest.raises(TypeError, match="sequence of strings"):
        codec.publish_many([1], submission_ids="a")
    with pytest.raises(ValueError, match="non-empty strings"):
        codec.publish_many([1], submission_ids=[""])
    with pytest.raises(TypeError, match="sequence of values"):
        codec.publish_many("ab", submission_ids=["a", "b"])
    with pytest.raises(TypeError, match="metadata= is a mapping"):
        codec.publish(1, submission_id="m", metadata=[1])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="takes a RecordSetRef"):
        codec.load(PayloadRef(codec.publish(1, submission_id="x")))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="ReadSession or a SharedFilesystemStore"):
        codec.load(codec.publish(1, submission_id="x"), reader="pool")  # type: ignore[arg-type]
    assert bound.store.metrics["payload_bytes"] > 0  # only the two good publications


def test_codec_construction_is_checked(pool: Path) -> None:
    with (
        SharedFilesystemStore(pool, "r", codecs=("bytes.v1", "json.v1")) as plain,
        pytest.raises(
            ValueError, match=r"^SampleCodec requires explicit sample.v1 and tensor.v1 store codecs$"
        ),
    ):
        SampleCodec(plain)
    with pytest.raises(TypeError, match="takes a SharedFilesystemStore"):
        SampleCodec("pool")  # type: ignore[arg-type]


def test_register_type_bad_input() -> None:
    @dataclasses.dataclass
    class Local:
        x: int = 0

    with pytest.raises(TypeError, match="dataclass or an Enum"):
        register_type(dict)
    with pytest.raises(TypeError, match="inside a function"):
        register_type(Local)
    with pytest.raises(ValueError, match="'nope' is not a field"):
        register_type(Registered, dependency_field="nope")
    assert register_type(Registered) is Registered


def test_rollout_publications_are_plain_straw_codec_publications(make_config: MakeConfig) -> None:
    bound = rollout_store(make_config())
    sample = Sample(index=4, tokens=[1, 2], status=SampleStatus.COMPLETED, reward=0.5)
    sample.rollout_routed_experts = torch.ones((1, 2), dtype=torch.uint8)
    ref = bound.codec.publish(
        {
            "group": [sample],
            "ref": DiskPayloadRef(
                bound.codec.publish([1], submission_id="inner"), str(bound.store.backend.root)
            ),
        },
        submission_id="plain",
    )
    value = straw_codec.load(ref, reader=bound.store)
    assert type(value["group"][0]) is Sample and value["group"][0].status is SampleStatus.COMPLETED
    assert isinstance(value["group"][0].rollout_routed_experts, TensorRef)
    assert isinstance(value["ref"], DiskPayloadRef) and value["ref"].load() == [1]


@dataclasses.dataclass
class CopyCountingSample(Sample):
    """A Sample subclass with its own copy hook (module level, so the codec can name it)."""

    copies: int = 0

    def __copy__(self) -> CopyCountingSample:
        out = dataclasses.replace(self, copies=self.copies + 1)
        out.__dict__.update({k: v for k, v in self.__dict__.items() if k.startswith("_")})
        return out


def test_converted_replay_leaves_the_callers_samples_alone(make_config: MakeConfig) -> None:
    codec = codec_of(sc_config(make_config))

    def finished(cls: type[Sample], index: int) -> Sample:
        sample = cls(
            index=index,
            tokens=[1, 2, 3],
            response_length=2,
            status=SampleStatus.COMPLETED,
            rollout_routed_experts=np.zeros((2, 1, 2), np.int32),
            rollout_topk_token_ids=[[1, 2], [3, 4]],
            rollout_topk_log_probs=[[-0.1, -0.2], [-0.3, -0.4]],
        )
        sample.__dict__["_extra"] = {"kept": index}  # an attribute beyond the fields travels too
        return sample

    plain, custom = finished(Sample, 1), finished(CopyCountingSample, 2)
    before = [dict(vars(plain)), dict(vars(custom))]
    loaded = codec.load(codec.publish([plain, custom], submission_id="copies"))
    assert [dict(vars(plain)), dict(vars(custom))] == before  # converted on copies only
    assert type(loaded[0]) is Sample and type(loaded[1]) is CopyCountingSample
    assert loaded[1].copies == 1  # a subclass's own copy hook was used for its converted copy
    assert loaded[0]._extra == {"kept": 1} and loaded[1]._extra == {"kept": 2}
    assert loaded[0].rollout_topk_token_ids.dtype == "int32"
