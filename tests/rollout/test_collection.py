"""finalize_groups with the sample filter, and accept_raw_rollout (acceptance scenarios 14 and 25)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from rollout_helpers import finish
from straw.protocol import RecordSetRef
from straw.rollout.collection import SAMPLE_FILTER_REASON, RolloutOutput, accept_raw_rollout, finalize_groups
from straw.rollout.config import RolloutConfig
from straw.rollout.controller import QueueController
from straw.rollout.hooks import Hooks
from straw.rollout.reader import QueueReader
from straw.rollout.refs import DiskPayloadRef, RawRolloutRef, RolloutGroupRef, load_groups
from straw.rollout.sample import Sample, SampleStatus

OpenController = Callable[..., QueueController]
OpenReader = Callable[..., QueueReader]
MakeConfig = Callable[..., RolloutConfig]


def published(reader: QueueReader, count: int) -> list[RolloutGroupRef]:
    return [reader.publish_group(finish(g), rollout_id=0) for g in reader.get_samples(count)]


def training_body(controller: QueueController) -> dict[str, Any]:
    state = controller.training_state()
    assert state is not None
    body = DiskPayloadRef(
        RecordSetRef.from_dict(state["state_ref"]), str(controller.config.rollout_data_dir)
    ).load()
    assert isinstance(body, dict)
    return body


def test_scenario_14_the_sample_filter_runs_once_and_disposes_what_it_removed(
    open_controller: OpenController, open_reader: OpenReader
) -> None:
    controller = open_controller()
    reader = open_reader(controller)
    groups = reader.get_samples(3)
    reader.discard_group(groups[0], "unused")
    refs = [reader.publish_group(finish(g), rollout_id=0) for g in reversed(groups[1:])]  # indices 2, 1
    seen: list[list[int]] = []

    def sample_filter(loaded: list[Any], config: RolloutConfig) -> None:
        seen.append([g[0].index for g in loaded])
        loaded.pop()
        loaded[0][0].reward = 42

    output = finalize_groups(
        controller.config, 0, refs, hooks=Hooks(sample_filter=sample_filter), controller=controller
    )
    assert seen == [[1, 2]]
    raw = accept_raw_rollout(output, config=controller.config, controller=controller, rollout_id=0)
    (group,) = load_groups(raw)
    assert group[0].index == 1 and group[0].reward == 42
    popped = refs[0].receipt
    assert popped is not None and refs[0].index == 2
    view = controller.training_view()
    assert popped.position < view["processed_cursor"] or popped.position in view["processed_positions"]
    disposition = training_body(controller)["disposition"].load()
    assert disposition["positions"] == [popped.position] and disposition["reason"] == SAMPLE_FILTER_REASON


def test_scenario_25_every_form_is_accepted_once(
    open_controller: OpenController, open_reader: OpenReader, pool: Path
) -> None:
    controller = open_controller()
    config = controller.config
    reader = open_reader(controller)
    plain = [[Sample(index=0, group_index=0, reward=1.0, status=SampleStatus.COMPLETED)]]
    from_plain = accept_raw_rollout(plain, config=config, controller=controller, rollout_id=0)
    wrapped = accept_raw_rollout(
        RolloutOutput(published(reader, 1), metrics={"custom": 1}),
        config=config,
        controller=controller,
        rollout_id=1,
    )
    finalised = finalize_groups(config, 2, published(reader, 2), hooks=None, controller=controller)
    from_ref = accept_raw_rollout(finalised.groups, config=config, controller=controller, rollout_id=2)
    for raw in (from_plain, wrapped, from_ref):
        assert isinstance(raw, RawRolloutRef)
        assert controller.accepted(raw.receipt) == raw.receipt
        assert raw.manifest == raw.receipt.result_ref
    assert from_plain.metrics is None and from_ref.metrics is None and wrapped.metrics == {"custom": 1}
    assert [g[0].index for g in load_groups(from_ref)] == [1, 2]  # the queue's group 0 went before
    assert [g[0].reward for g in load_groups(from_plain)] == [1.0]
    sizes = {p: p.read_bytes() for p in pool.rglob("*.pack")}
    assert accept_raw_rollout(wrapped, config=config, controller=controller, rollout_id=1) is wrapped
    assert {p: p.read_bytes() for p in pool.rglob("*.pack")} == sizes  # no pack written or changed


def test_accepted_forms_are_checked(open_controller: OpenController, open_reader: OpenReader) -> None:
    controller = open_controller()
    config = controller.config
    raw = accept_raw_rollout(
        published(open_reader(controller), 1), config=config, controller=controller, rollout_id=0
    )
    other = accept_raw_rollout(
        [[Sample(index=9, reward=0.0, status=SampleStatus.COMPLETED)]],
        config=config,
        controller=controller,
        rollout_id=1,
    )
    mixed = RawRolloutRef(other.manifest, raw.root, receipt=raw.receipt)
    with pytest.raises(ValueError, match=r"^Raw rollout manifest differs from its accepted receipt$"):
        accept_raw_rollout(mixed, config=config, controller=controller, rollout_id=0)
    with pytest.raises(TypeError, match="accept_raw_rollout takes a RolloutOutput"):
        accept_raw_rollout("groups", config=config, controller=controller, rollout_id=0)
    with pytest.raises(ValueError, match="needs the job's controller"):
        accept_raw_rollout([], config=config, controller=None, rollout_id=0)  # type: ignore[arg-type]


def test_on_accepted_and_leased_groups(open_controller: OpenController, open_reader: OpenReader) -> None:
    controller = open_controller()
    reader = open_reader(controller)
    leased = [finish(g) for g in reader.get_samples(2)]
    called: list[RawRolloutRef] = []
    raw = accept_raw_rollout(
        RolloutOutput(list(reversed(leased)), on_accepted=called.append),
        config=controller.config,
        controller=controller,
        rollout_id=0,
    )
    assert called == [raw]
    # the leased groups were completed as their tasks' results first
    assert controller.status("prompt:0")["state"] == "completed"  # type: ignore[index]
    assert [g[0].index for g in load_groups(raw)] == [1, 0]  # a plain list keeps its order
