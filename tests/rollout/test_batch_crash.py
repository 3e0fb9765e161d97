"""Faults of the batch boundary: a builder process SIGKILLed between plan and ready, or inside
``ready_batch``, leaves a state that ``begin`` / ``replay_converted`` finish without running a hook.

The controller lives in this (the parent) process and is served to the child over
``rpc_link``; the child (``batch_child.py``) plans, converts and publishes the batch through it.
The served object stops the child's ``ready_batch`` call at the point under test and tells the
parent, which kills the child there:

- ``before``: the call never reaches the controller (the conversion is published, not accepted);
- ``accepted``: the controller accepted the conversion and was interrupted before advancing
  the training view (its ``ready:advance`` fault phase raises once the child is dead);
- ``replied``: the call completed; its reply never reached the child.
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from child_io import CHILD_TIMEOUT_S, children, read_line
from rollout_helpers import finish, prompt_rows
from rpc_link import Served
from straw.protocol import RecordSetRef
from straw.rollout.batch import BatchBuilder, load_rank_batch
from straw.rollout.collection import accept_raw_rollout
from straw.rollout.config import RolloutConfig
from straw.rollout.controller import QueueController
from straw.rollout.hooks import Hooks
from straw.rollout.reader import QueueReader
from straw.rollout.refs import DiskPayloadRef, RawRolloutRef, load_groups
from straw.rollout.sample import Sample, iter_samples

pytestmark = pytest.mark.crash

CHILD = Path(__file__).with_name("batch_child.py")
HOOK_IDENTITY = "crash_tests.reward_post_process"  # as batch_child.HOOK_IDENTITY
MakeConfig = Callable[..., RolloutConfig]


class Interrupted(Exception):
    """Stands for the controller call being cut short by the crash."""


class Gate:
    """The parent's controller as the child sees it, with its ``ready_batch`` stopped at a point."""

    def __init__(self, controller: QueueController, where: str) -> None:
        self.controller = controller
        self.where = where
        self.reached = threading.Event()
        self.child_dead = threading.Event()
        self.seen: list[RecordSetRef] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.controller, name)

    def stop_here(self) -> None:
        self.reached.set()
        assert self.child_dead.wait(CHILD_TIMEOUT_S)

    def fault(self, phase: str) -> None:
        """The controller's fault hook: under ``accepted`` the child's call stops after the accept."""
        if phase == "ready:advance" and self.where == "accepted" and not self.reached.is_set():
            self.stop_here()
            raise Interrupted("the caller died between accept and advance")

    def ready_batch(self, batch_id: str, ready_ref: RecordSetRef) -> Any:
        self.seen.append(ready_ref)
        if self.where == "before":
            self.stop_here()
            raise Interrupted("never reached the controller")
        answer = self.controller.ready_batch(batch_id, ready_ref)
        self.stop_here()
        return answer


def refusing() -> Hooks:
    def never(*args: Any) -> Any:
        raise AssertionError("a hook ran while finishing the batch")

    return Hooks(reward_post_process=never, paths={"reward_post_process": HOOK_IDENTITY})


def samples_of(raw: RawRolloutRef) -> list[Sample]:
    return [s for group in load_groups(raw) for s in iter_samples(group)]


@pytest.mark.parametrize("where", ["before", "accepted", "replied"])
def test_a_killed_builder_is_finished_without_hooks(where: str, tmp_path: Path, pool: Path) -> None:
    flags = {"rollout_data_dir": str(pool), "rollout_batch_size": 2, "n_samples_per_prompt": 2}
    config = RolloutConfig.from_args(type("Flags", (), flags)())
    gate: Gate | None = None
    controller = QueueController(
        config, dataset=prompt_rows(10), fault=lambda phase: gate and gate.fault(phase)
    )
    try:
        gate = Gate(controller, where)
        reader = QueueReader(config, controller, "generator")
        try:
            groups = [reader.publish_group(finish(g), rollout_id=0) for g in reader.get_samples(2)]
        finally:
            reader.close()
        raw = accept_raw_rollout(groups, config=config, controller=controller, rollout_id=0)
        raw_file, log = tmp_path / "raw.pkl", tmp_path / "hooks.log"
        raw_file.write_bytes(pickle.dumps(raw))
        served = Served(gate)
        host, port = served.address
        command = [sys.executable, str(CHILD), host, str(port), served.authkey.hex(), json.dumps(flags)]
        child = subprocess.Popen(
            [*command, str(raw_file), str(log)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        with children(child):
            assert read_line(child) == "building\n"
            assert gate.reached.wait(CHILD_TIMEOUT_S), "the child never reached ready_batch"
            child.kill()  # SIGKILL: no handler, no flush, no goodbye
            child.wait(CHILD_TIMEOUT_S)
        gate.child_dead.set()
        served.close(CHILD_TIMEOUT_S)
        assert log.read_text() == "reward_post_process\n"  # the child converted exactly once
        (conversion,) = gate.seen
        batch_id = f"batch:{raw.receipt.commit_id}"
        planned = controller.batch(batch_id)
        assert planned is not None and planned["ready"] is (where != "before")
        samples = samples_of(raw)
        positions = sorted({raw.receipt.position, *(s._queue_receipt["position"] for s in samples)})
        view = controller.training_view()
        advanced = all(p < view["processed_cursor"] or p in view["processed_positions"] for p in positions)
        assert advanced is (where == "replied")

        builder = BatchBuilder(config, controller, hooks=refusing())
        if where == "before":
            assert builder.begin(raw, samples, rollout_id=0) is None  # the same plan, unchanged
            assert controller.batch(batch_id) == planned
            refs = builder.replay_converted(DiskPayloadRef(conversion, str(pool)), batch_id)
        else:
            refs = builder.begin(raw, samples, rollout_id=0)  # type: ignore[assignment]
            assert refs is not None
        done = controller.batch(batch_id)
        assert done is not None and done["ready"] and done["ready_ref"] == conversion
        view = controller.training_view()
        assert all(p < view["processed_cursor"] or p in view["processed_positions"] for p in positions)
        assert load_rank_batch(refs, 0)["sample_indices"] == [s.index for s in samples]
        builder.training_completed(0)
        assert controller.metrics()["accepted_unprocessed"] == {"count": 0, "bytes": 0}
        assert log.read_text() == "reward_post_process\n"  # and no hook ran since
    finally:
        controller.close()
