"""finalize_groups without a controller: ordering by reference, the manifest, plain groups (scenario 13)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from straw.rollout.collection import finalize_groups, sort_groups
from straw.rollout.config import RolloutConfig
from straw.rollout.refs import DiskPayloadRef, RolloutGroupRef, load_groups, pack_payload
from straw.rollout.sample import Sample, SampleStatus

MakeConfig = Callable[..., RolloutConfig]


def group(index: int, response: str = "") -> list[Sample]:
    return [
        Sample(index=index, group_index=index, response=response, reward=1.0, status=SampleStatus.COMPLETED)
    ]


def test_scenario_13_references_are_ordered_without_loading_them(
    make_config: MakeConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = make_config()
    big = "r" * 10**6
    refs = []
    for index in (2, 1):
        ref = pack_payload(group(index, big), config=config, rollout_id=0)
        refs.append(RolloutGroupRef(ref.manifest, ref.root, index=index))
    original_load = DiskPayloadRef.load

    def refuse(self: DiskPayloadRef, **kwargs: Any) -> Any:
        raise AssertionError("finalize_groups loaded a payload")

    monkeypatch.setattr(DiskPayloadRef, "load", refuse)
    output = finalize_groups(config, 0, refs, hooks=None, controller=None)
    monkeypatch.setattr(DiskPayloadRef, "load", original_load)
    assert [r.index for r in output.group_refs or []] == [1, 2]
    assert isinstance(output.groups, DiskPayloadRef)
    # It names the groups and holds none of their bytes: payload_bytes counts dependencies
    # (issue 10 item 5), so its own share is the total less the groups' own totals.
    own = output.groups.manifest.payload_bytes - sum(r.manifest.payload_bytes for r in refs)
    assert 0 < own < 8 * 1024
    assert pack_payload(output.groups, config=config, rollout_id=0) is output.groups
    loaded = load_groups(output.groups)
    assert [g[0].index for g in loaded] == [1, 2]
    assert all(g[0].response == big for g in loaded)


def test_plain_groups_are_ordered_by_their_first_index(make_config: MakeConfig) -> None:
    config = make_config()
    unindexed = [Sample(reward=0.0, status=SampleStatus.COMPLETED)]
    items = [group(4), unindexed, [group(3)[0], group(9)[0]]]
    assert sort_groups(items) == [items[2], items[0], items[1]]  # no index sorts last
    output = finalize_groups(config, 3, items, hooks=None, controller=None, metrics={"m": 1})
    assert output.metrics == {"m": 1}
    assert [[s.index for s in g] for g in load_groups(output.groups)] == [[3, 9], [4], [None]]


def test_a_leased_group_needs_a_controller(make_config: MakeConfig) -> None:
    config = make_config()
    leased = group(0)
    leased[0]._queue_lease = {  # type: ignore[attr-defined]
        "run_id": "rollout",
        "queue_id": "q",
        "task_id": "prompt:0",
        "attempt_id": "a",
        "generation": 1,
        "coordinator_epoch": 1,
        "token": "t",
        "worker_id": "w",
    }
    with pytest.raises(ValueError, match="Queue group has a lease but no coordinator binding"):
        finalize_groups(config, 0, [leased], hooks=None, controller=None)
