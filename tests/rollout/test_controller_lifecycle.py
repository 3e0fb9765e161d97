"""The controller's life: the save-directory lock, a failing start undone, the online GC thread
and its latched error, close (acceptance scenarios 26 and 27 of ROLLOUT.md section 20)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import straw.rollout.controller as controller_module
from child_io import CHILD_TIMEOUT_S, children, read_line
from rollout_helpers import prompt_rows
from straw.errors import CorruptData
from straw.reporting import try_lock
from straw.rollout.checkpoint import resolve_checkpoint
from straw.rollout.config import RolloutConfig
from straw.rollout.controller import GC_FAILED, QueueController

OpenController = Callable[..., QueueController]
MakeConfig = Callable[..., RolloutConfig]
HERE = Path(__file__).resolve().parent


@pytest.fixture
def save(tmp_path: Path) -> Path:
    return tmp_path / "save"


@pytest.fixture
def job_config(make_config: MakeConfig, save: Path) -> RolloutConfig:
    return make_config(save=str(save), save_interval=1)


def lock_is_free(save: Path) -> bool:
    if not (save / "rollout").is_dir():
        return True
    held = try_lock(save / "rollout" / "session.lock")
    if held is None:
        return False
    held.release()
    return True


# --------------------------------------------------------------------------- scenario 27


def test_scenario_27_one_controller_per_save_directory(
    job_config: RolloutConfig, open_controller: OpenController, save: Path
) -> None:
    first = open_controller(job_config)
    with pytest.raises(RuntimeError, match=r"^Another training job owns save directory "):
        QueueController(job_config, dataset=prompt_rows(4))
    job = json.loads((save / "rollout" / "job.json").read_text())
    assert job["queue_id"] == first.plan.queue_id and job["version"] == 1
    first.close()
    assert lock_is_free(save)


def test_scenario_27_a_stale_plan_is_refused(job_config: RolloutConfig, save: Path) -> None:
    config, plan = resolve_checkpoint(job_config)
    assert plan.mode == "new" and plan.state_token is not None
    with QueueController(config, dataset=prompt_rows(4), restore_plan=plan):
        pass
    with pytest.raises(RuntimeError, match=r"^Checkpoint selection for .* changed during startup; restart"):
        QueueController(config, dataset=prompt_rows(4), restore_plan=plan)
    assert lock_is_free(save)
    _, fresh = resolve_checkpoint(job_config)
    assert fresh.mode == "resume" and fresh.queue_id == plan.queue_id


@pytest.mark.parametrize("phase", ["lock", "job-files", "coordinator", "gc"])
def test_scenario_27_a_failing_start_is_undone(
    phase: str, make_config: MakeConfig, save: Path, open_controller: OpenController
) -> None:
    config = make_config(save=str(save), save_interval=1, rollout_queue_online_gc=True)

    def fault(at: str) -> None:
        if at == phase:
            raise OSError(f"injected at {phase}")

    with pytest.raises(OSError, match=f"injected at {phase}") as kept:
        QueueController(config, dataset=prompt_rows(4), fault=fault)
    assert kept.traceback  # the caller keeps the traceback (and through it, the object)
    assert lock_is_free(save)
    threads = [t.name for t in threading.enumerate() if t.name.startswith("straw-rollout-")]
    assert threads == []
    fresh = open_controller(config)  # the queue is closed and the lock released
    expected = "resume" if phase in ("coordinator", "gc") else "new"
    assert fresh.plan.mode == expected
    assert fresh.take("r", 1).status == "acquired"


def test_scenario_27_the_lock_is_held_through_a_failing_seal(
    job_config: RolloutConfig, save: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    controller = QueueController(job_config, dataset=prompt_rows(4))
    seen: list[str] = []

    def failing_seal(config: RolloutConfig) -> None:
        try:
            QueueController(job_config, dataset=prompt_rows(4))
        except RuntimeError as error:
            seen.append(str(error))
        raise OSError("seal failed")

    monkeypatch.setattr(controller_module, "seal_rollout_store", failing_seal)
    with pytest.raises(OSError, match="seal failed"):
        controller.close()
    assert len(seen) == 1 and seen[0].startswith("Another training job owns save directory")
    assert lock_is_free(save)
    controller.close()  # idempotent


def test_scenario_27_a_killed_controller_frees_the_lock(job_config: RolloutConfig, save: Path) -> None:
    child = subprocess.Popen(
        [sys.executable, str(HERE / "controller_child.py"), "hold", json.dumps(_config_args(job_config))],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    with children(child):
        assert read_line(child).strip() == "ready"
        assert not lock_is_free(save)
        child.kill()
        child.wait(timeout=CHILD_TIMEOUT_S)
    assert lock_is_free(save)
    with QueueController(job_config, dataset=prompt_rows(4)) as controller:
        assert controller.plan.mode == "resume"


def _config_args(config: RolloutConfig) -> dict[str, Any]:
    return {
        k: v for k, v in vars(config).items() if v is not None and k not in ("identity_extra", "plan_extra")
    }


# --------------------------------------------------------------------------- scenario 26


@pytest.fixture
def failing_gc(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """Coordinator.collect_garbage fails once (then works), recording its calls."""
    state: dict[str, Any] = {"calls": 0, "error": OSError("pool catalog unreadable")}
    original = controller_module.Coordinator.collect_garbage

    def collect(self: Any) -> dict[str, Any]:
        state["calls"] += 1
        if state["calls"] == 1:
            raise state["error"]
        return original(self)

    monkeypatch.setattr(controller_module.Coordinator, "collect_garbage", collect)
    yield state


def gc_thread() -> threading.Thread:
    (thread,) = [t for t in threading.enumerate() if t.name == "straw-rollout-gc"]
    return thread


def test_scenario_26_a_failed_gc_pass_stops_queue_work(
    make_config: MakeConfig, save: Path, failing_gc: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    config = make_config(
        save=str(save), save_interval=1, rollout_queue_online_gc=True, gc_interval_seconds=0.01
    )
    controller = QueueController(config, dataset=prompt_rows(4))
    gc_thread().join(timeout=CHILD_TIMEOUT_S)  # the first pass fails and the thread stops
    assert failing_gc["calls"] == 1
    for call in (
        lambda: controller.take("r", 1),
        lambda: controller.queue,
        lambda: controller.identity(),
        lambda: controller.metrics(),
        lambda: controller.record_dispositions([], "x"),
        lambda: controller.checkpoint_snapshot(0),
    ):
        with pytest.raises(RuntimeError, match=rf"^{GC_FAILED}$") as raised:
            call()
        assert raised.value.__cause__ is failing_gc["error"]
    assert "straw online GC failed; retained storage must be inspected" in caplog.text
    with pytest.raises(RuntimeError, match=rf"^{GC_FAILED}$") as closing:
        controller.close()
    assert closing.value.__cause__ is failing_gc["error"]
    assert lock_is_free(save)
    assert os.path.isdir(config.rollout_data_dir)  # nothing was deleted or reset  # type: ignore[arg-type]


def test_online_gc_passes_run_and_are_counted(
    make_config: MakeConfig, open_controller: OpenController
) -> None:
    config = make_config(rollout_queue_online_gc=True, gc_interval_seconds=3600.0)
    controller = open_controller(config)
    controller.take("r", 1)
    result = controller.collect_garbage()
    assert result["queue_roots"] >= 1
    gc = controller.metrics()["gc"]
    assert gc["runs"] == 1 and gc["last"] == result and gc["error"] is None


def test_a_direct_gc_pass_failure_is_latched(
    make_config: MakeConfig, open_controller: OpenController, failing_gc: dict[str, Any]
) -> None:
    controller = open_controller(make_config(rollout_queue_online_gc=True), start_gc=False)
    with pytest.raises(RuntimeError, match=rf"^{GC_FAILED}$"):
        controller.collect_garbage()
    with pytest.raises(RuntimeError, match=rf"^{GC_FAILED}$"):
        controller.take("r", 1)


def test_close_is_idempotent_and_later_calls_fail(open_controller: OpenController) -> None:
    controller = open_controller()
    controller.close()
    controller.close()
    with pytest.raises(RuntimeError, match=r"^Queue controller is closed$"):
        controller.take("r", 1)


def test_a_damaged_queue_is_reported_with_straw_check(make_config: MakeConfig, save: Path) -> None:
    config = make_config(save=str(save), save_interval=1)
    with QueueController(config, dataset=prompt_rows(4)) as controller:
        controller.take("r", 3)
        directory = Path(controller.queue.directory)
    (snapshot,) = (directory / "snap").glob("*.snap")  # closing wrote one
    data = bytearray(snapshot.read_bytes())
    data[len(data) // 2] ^= 0xFF
    snapshot.write_bytes(bytes(data))
    with pytest.raises(CorruptData, match=rf"inspect the pool with `straw check {config.rollout_data_dir}`$"):
        QueueController(config, dataset=prompt_rows(4))
    assert lock_is_free(save)
    assert snapshot.read_bytes() == bytes(data)  # never replaced silently
