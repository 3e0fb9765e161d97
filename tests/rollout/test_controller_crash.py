"""Crashes of a job's process (SIGKILL) at every step of refill, return, complete, plan and ready,
then a restart in ``resume`` mode (ROLLOUT.md sections 14.8 and 19); and a job killed after
accepting groups (acceptance scenario 45, the controller's side).

A child process (``controller_child.py``) sets a job up, arms one named phase (a controller
fault phase, or a store backend phase), runs the operation and, arriving at the phase, tells
the parent, which kills it. The parent then restarts the job and checks that every dataset
group issued so far has exactly one live representative (a pending or leased task, or an
accepted result nothing replaced): none skipped, none duplicated, nothing accepted lost.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from child_io import children, read_line
from rollout_helpers import finish, group_indices, prompt_rows, representatives
from straw.coordinator import Coordinator
from straw.rollout.checkpoint import resolve_checkpoint
from straw.rollout.config import RolloutConfig
from straw.rollout.controller import CONVERSION_STARTED, EXCLUSIVE_OWNER, QueueController
from straw.rollout.pool import rollout_store
from straw.rollout.reader import QueueReader

pytestmark = pytest.mark.crash
MakeConfig = Callable[..., RolloutConfig]
HERE = Path(__file__).resolve().parent
CHILD = HERE / "controller_child.py"
DATASET_ROWS = 40

BACKEND = ["backend:before_publish", "backend:after_data_sync", "backend:before_journal_write",
           "backend:after_journal_append", "backend:after_catalog_append"]  # fmt: skip
#: Every (operation, phase) a child is stopped at; each of them is reached (the test checks).
CRASH_POINTS = [
    *(("refill", p) for p in ["refill:publish", "refill:submit", "refill:release", *BACKEND]),
    # A group's publish writes no catalog frame: its one dependency, the prompt, is owned (GC.md).
    *(("complete", p) for p in ["complete", *BACKEND[:-1], "backend:before_completion_reply"]),
    *(("return", p) for p in ["return:yield", "return:deliver", "return:done", *BACKEND]),
    *(("plan", p) for p in ["plan:submit", "plan:acquire", "plan:state", *BACKEND]),
    *(("ready", p) for p in ["ready:complete", "ready:advance", *BACKEND, "backend:before_completion_reply"]),
]


@pytest.fixture
def job(make_config: MakeConfig, tmp_path: Path) -> RolloutConfig:
    return make_config(save=str(tmp_path / "save"), save_interval=1)


def flags(config: RolloutConfig) -> str:
    values = {
        k: v for k, v in vars(config).items() if v is not None and k not in ("identity_extra", "plan_extra")
    }
    return json.dumps(values)


def kill_at(*args: str) -> str:
    """Run the child until its first line, then kill it (SIGKILL); the line."""
    child = subprocess.Popen(
        [sys.executable, str(CHILD), *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    with children(child):  # kills the child on the way out
        return read_line(child).strip()


def check_exactly_once(queue: Coordinator) -> int:
    issued, count = representatives(queue)
    assert count == dict.fromkeys(range(issued), 1), f"each issued group once: {count}"
    return issued


def continue_job(config: RolloutConfig) -> None:
    """Restart in resume mode and finish every issued group plus a few new ones."""
    resolved, plan = resolve_checkpoint(config)
    assert plan.mode == "resume"
    with QueueController(resolved, dataset=prompt_rows(DATASET_ROWS), restore_plan=plan) as controller:
        assert controller.queue.outstanding_reads() == ()  # recovery fenced the dead child's reads
        issued = check_exactly_once(controller.queue)
        recovered = {r.position for r in controller.recover_pending_rollout()}
        assert controller.recover_pending_rollout() == []  # once
        reader = QueueReader(controller.config, controller, "after")
        try:
            taken = reader.get_samples(issued + 3)
            for group in taken:
                reader.publish_group(finish(group), rollout_id=1)
        finally:
            reader.close()
        total = check_exactly_once(controller.queue)
        assert total >= issued + 3
        accepted = [c for c in controller.queue.commits if c["task_id"].startswith("prompt:")]
        assert recovered <= {c["position"] for c in accepted}


def check_refused(config: RolloutConfig) -> None:
    """A restart after a durable plan is refused (resume covers only a first rollout); the queue
    it refuses to serve still holds every group exactly once."""
    resolved, plan = resolve_checkpoint(config)
    with pytest.raises(RuntimeError, match=rf"^{CONVERSION_STARTED}$"):
        QueueController(resolved, dataset=prompt_rows(DATASET_ROWS), restore_plan=plan)
    store = rollout_store(resolved).store
    with Coordinator(
        store, queue_id=plan.queue_id, namespace=True, exclusive_owner=EXCLUSIVE_OWNER, recover=True
    ) as queue:
        check_exactly_once(queue)
        assert any(t.startswith("batch:") for t in queue.tasks)


@pytest.mark.parametrize(("operation", "phase"), CRASH_POINTS, ids=[f"{o}-{p}" for o, p in CRASH_POINTS])
def test_a_crash_at_every_step_resumes_with_nothing_skipped_or_duplicated(
    job: RolloutConfig, operation: str, phase: str
) -> None:
    line = kill_at("crash", flags(job), operation, phase)
    assert line == f"at {phase}", f"the child never reached {phase}: {line}"
    planned = _plan_durable(job)
    if phase == "plan:submit":
        assert not planned
    if operation == "ready" or phase in ("plan:acquire", "plan:state"):
        assert planned
    if planned:
        check_refused(job)
    else:
        continue_job(job)


def _plan_durable(config: RolloutConfig) -> bool:
    resolved, plan = resolve_checkpoint(config)
    store = rollout_store(resolved).store
    with Coordinator(
        store, queue_id=plan.queue_id, namespace=True, exclusive_owner=EXCLUSIVE_OWNER, recover=True
    ) as queue:
        return any(t.startswith("batch:") for t in queue.tasks)


# --------------------------------------------------------------------------- scenario 45


def test_scenario_45_a_killed_first_rollout_resumes_and_recovers_its_groups(
    job: RolloutConfig, make_config: MakeConfig
) -> None:
    line = kill_at("accept", flags(job), "2")
    positions = [int(p) for p in line.split()[1:]]
    assert line.startswith("accepted ") and positions == [0, 1]
    queue_id = json.loads((Path(job.save) / "rollout" / "job.json").read_text())["queue_id"]  # type: ignore[arg-type]
    for load in (None, job.save):
        config = make_config(save=job.save, save_interval=1, load=load)
        resolved, plan = resolve_checkpoint(config)
        assert plan.mode == "resume" and plan.queue_id == queue_id
        assert resolved.rollout_data_dir == job.rollout_data_dir and resolved.start_rollout_id == 0
        with QueueController(resolved, dataset=prompt_rows(DATASET_ROWS), restore_plan=plan) as controller:
            assert controller.identity()["mode"] == "resume" and controller.identity()["queue_id"] == queue_id
            recovered = controller.recover_pending_rollout()
            assert [r.position for r in recovered] == [0, 1]
            assert [r.task_id for r in recovered] == ["prompt:0", "prompt:1"]
            assert controller.recover_pending_rollout() == []
            status = controller.status("prompt:2")
            assert status is not None and status["state"] == "pending" and status["failures"] == 1
    changed = make_config(save=job.save, save_interval=1, hf_checkpoint="/models/other")
    with pytest.raises(
        ValueError, match=r"^Initial model/input configuration differs from the interrupted run$"
    ):
        resolve_checkpoint(changed)


def test_scenario_45_after_a_plan_a_restart_is_refused(job: RolloutConfig) -> None:
    assert kill_at("plan", flags(job)) == "planned"
    check_refused(job)


def test_recover_pending_rollout_needs_resume_mode(job: RolloutConfig) -> None:
    with (
        QueueController(job, dataset=prompt_rows(4)) as controller,
        pytest.raises(RuntimeError, match=r"^Whole-job replay requires automatic WAL recovery selection$"),
    ):
        controller.recover_pending_rollout()


def test_a_resumed_job_keeps_partials_and_continues_numbering(job: RolloutConfig) -> None:
    with QueueController(job, dataset=prompt_rows(DATASET_ROWS)) as first:
        reader = QueueReader(first.config, first, "w")
        groups = reader.get_samples(3)
        groups[0][0].tokens = [5, 6]
        groups[0][0].response_length = 2
        reader.add_samples([groups[0]])
        reader.close()
    resolved, plan = resolve_checkpoint(job)
    with QueueController(resolved, dataset=prompt_rows(DATASET_ROWS), restore_plan=plan) as again:
        reader = QueueReader(again.config, again, "w2")
        taken = reader.get_samples(9)
        assert group_indices(taken)[0] == 0 and taken[0][0].tokens == [5, 6]
        assert sorted(group_indices(taken)) == list(range(9))
        reader.close()
