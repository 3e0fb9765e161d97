"""straw.rollout.sample: the Sample record, group stages, version numbers, keys and staleness."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from straw import SharedFilesystemStore
from straw.rollout.sample import (
    INT64_MAX,
    INT64_MIN,
    NO_VERSION_KEY,
    QUEUE_ATTRIBUTES,
    REPLAY_FIELDS,
    Sample,
    SampleStatus,
    group_stage,
    iter_samples,
    numeric_version,
    registered_types,
    scheduling_key,
    staleness,
)
from straw.tensor import publish_tensors


@dataclasses.dataclass
class ScoredSample(Sample):
    """A module-level subclass: registered for the codec when the class is created."""

    score: float = 0.0


def test_status_enum_and_alias() -> None:
    assert Sample.Status is SampleStatus
    assert [s.value for s in SampleStatus] == ["pending", "completed", "truncated", "aborted", "failed"]
    assert SampleStatus("aborted") is SampleStatus.ABORTED
    assert isinstance(SampleStatus.COMPLETED, str)


def test_defaults_are_fresh_objects() -> None:
    a, b = Sample(), Sample()
    a.tokens.append(1)
    a.metadata["k"] = 1
    assert b.tokens == [] and b.metadata == {} and b.weight_versions == []
    assert a.status is SampleStatus.PENDING and a.prompt == "" and a.reward is None
    assert "Status" not in {f.name for f in dataclasses.fields(Sample)}


def test_constants() -> None:
    assert NO_VERSION_KEY == 2**63 - 1
    assert len(REPLAY_FIELDS) == 6 and all(hasattr(Sample(), name) for name in REPLAY_FIELDS)
    assert QUEUE_ATTRIBUTES == (
        "_queue_lease",
        "_queue_receipt",
        "_queue_source_positions",
        "_queue_generation_start",
        "_queue_prompt",
        "_queue_incarnation",
    )


def test_subclasses_register_when_created() -> None:
    types = registered_types()
    assert types[f"{__name__}:ScoredSample"] is ScoredSample
    assert types["straw.rollout.sample:Sample"] is Sample
    assert types["straw.rollout.sample:SampleStatus"] is SampleStatus


def test_reward_values() -> None:
    assert Sample(reward=1).get_reward_value() == 1.0
    assert Sample(reward={"acc": 0.5, "len": 2}).get_reward_value("acc") == 0.5
    with pytest.raises(ValueError, match="Sample 3 has no reward"):
        Sample(index=3).get_reward_value()
    with pytest.raises(KeyError, match="Sample 4 has no reward 'f1'"):
        Sample(index=4, reward={"acc": 1.0}).get_reward_value("f1")
    with pytest.raises(KeyError, match="reward-key"):
        Sample(index=5, reward={"acc": 1.0}).get_reward_value()
    with pytest.raises(TypeError, match="reward of type str"):
        Sample(index=6, reward="good").get_reward_value()  # type: ignore[arg-type]


def test_to_dict_from_dict_round_trip(tmp_path: Path) -> None:
    with SharedFilesystemStore(tmp_path, "run", codecs=("tensor.v1",)) as store:
        (ref,) = publish_tensors(store, {"routes": torch.arange(6, dtype=torch.int32)}, submission_id="t")
    sample = Sample(index=1, tokens=[1, 2], status=SampleStatus.COMPLETED, rollout_routed_experts=ref)
    sample.metadata = {"nested": [ref]}
    sample.extra = "kept"  # type: ignore[attr-defined]
    sample._private = "dropped"  # type: ignore[attr-defined]
    data = sample.to_dict()
    assert data["status"] == "completed" and data["extra"] == "kept" and "_private" not in data
    assert isinstance(data["rollout_routed_experts"], torch.Tensor)
    assert data["rollout_routed_experts"].tolist() == list(range(6))
    assert isinstance(data["metadata"]["nested"][0], torch.Tensor)
    back = Sample.from_dict(data)
    assert back.status is SampleStatus.COMPLETED and back.extra == "kept"  # type: ignore[attr-defined]
    assert back.tokens == [1, 2] and back.index == 1
    scored = ScoredSample.from_dict({"score": 2.5, "index": 9, "unknown_key": 1})
    assert type(scored) is ScoredSample and scored.score == 2.5 and scored.unknown_key == 1  # type: ignore[attr-defined]


def test_from_dict_bad_input() -> None:
    with pytest.raises(TypeError, match="takes a mapping"):
        Sample.from_dict([("index", 1)])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not an attribute name"):
        Sample.from_dict({"not a name": 1})
    with pytest.raises(ValueError):
        Sample.from_dict({"status": "bogus"})


def test_iter_samples_depth_first() -> None:
    a, b, c, d = (Sample(index=i) for i in range(4))
    assert [s.index for s in iter_samples([a, [b, (c,)], d])] == [0, 1, 2, 3]
    assert list(iter_samples(a)) == [a]
    assert list(iter_samples([])) == []
    with pytest.raises(TypeError, match="got dict"):
        list(iter_samples([a, {"x": 1}]))
    with pytest.raises(TypeError, match="got int"):
        list(iter_samples(3))


def done(reward: float | None = 1.0, status: SampleStatus = SampleStatus.COMPLETED) -> Sample:
    return Sample(status=status, reward=reward, response_length=2)


def test_group_stage() -> None:
    assert group_stage([done(), [done(status=SampleStatus.TRUNCATED)]]) == "ready"
    assert group_stage([done(), done(reward=None)]) == "partial"
    assert group_stage([done(), Sample(status=SampleStatus.ABORTED, response_length=3)]) == "partial"
    assert group_stage([Sample(), Sample()]) == "fresh"
    assert group_stage([Sample(status=SampleStatus.FAILED, reward=0.0)]) == "fresh"
    with pytest.raises(ValueError, match="at least one Sample"):
        group_stage([])


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("0", 0),
        ("-0", 0),
        ("7", 7),
        ("-12", -12),
        ("007", 7),
        ("9223372036854775807", INT64_MAX),
        ("9223372036854775808", INT64_MAX),
        ("-9223372036854775808", INT64_MIN),
        ("-9223372036854775809", INT64_MIN),
        ("1" * 5000, INT64_MAX),  # longer than int()'s digit limit: saturates without int()
        ("-" + "9" * 5000, INT64_MIN),
        ("0" * 5000 + "5", 5),
    ],
)
def test_numeric_versions(text: str, value: int) -> None:
    assert numeric_version(text) == value


@pytest.mark.parametrize(
    "text", ["+5", " 7", "7 ", "1_0", "٣", "１", "", "-", "--1", "1.0", "1e3", "v1", "7\n", None, 7, True]
)
def test_not_numeric_versions(text: object) -> None:
    assert numeric_version(text) is None


@given(st.integers(min_value=-(2**70), max_value=2**70))
def test_numeric_version_saturates_any_integer(n: int) -> None:
    assert numeric_version(str(n)) == max(INT64_MIN, min(INT64_MAX, n))


def versions(*per_sample: list[str]) -> list[Sample]:
    return [Sample(weight_versions=list(v)) for v in per_sample]


def test_scheduling_key() -> None:
    assert scheduling_key(versions(["5", "3"], ["4"])) == 3
    assert scheduling_key(versions(["x"], [])) == NO_VERSION_KEY
    assert scheduling_key(versions([])) == NO_VERSION_KEY
    assert scheduling_key([versions(["9"]), Sample(weight_versions=["x", "-2"])]) == -2
    assert scheduling_key(versions(["1" * 40])) == INT64_MAX
    with pytest.raises(ValueError):
        scheduling_key([])


def test_staleness() -> None:
    assert staleness(versions(["3", "5"]), "7") == 4
    assert staleness(versions(["7"]), "7") == 0
    assert staleness(versions(["policy-a"]), "policy-a") == 0
    assert staleness(versions(["policy-a"]), "7") is None
    assert staleness(versions(["3"]), "latest") is None
    assert staleness(versions([]), "7") is None
    assert staleness(versions(["x", "2"], ["4"]), "10") == 8
