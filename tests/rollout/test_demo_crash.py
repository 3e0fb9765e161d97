"""Whole-job crash test of the demo pipeline: SIGKILL at random points, restart, nothing lost.

The job is the real demo driver (``straw demo --child``: controller, data source, async
runner, batch builder, two trainer ranks, joint checkpoints, weight publication through the
pool) with the fast fake engine (``--engine copy``) and without Ray (``--local``), run as a
subprocess in a session of its own. For each seed it is SIGKILLed (every process of its
session) at a random moment after its first checkpoint, then started again in place until it
has trained every step. Afterwards, over the steps the final timeline trained:

- no group was trained twice and every dataset index the producer issued is exactly once
  either trained, still live in the queue, or accepted and waiting (nothing accepted is lost);
- every trained sample's reward came from exactly one reward-hook call, logged for its own
  accepted task, and the hook never ran for that task's sample again;
- ``straw check`` finds the pool clean.

``make test`` runs one seed (and ``--kill-at-step`` through the supervisor); the ``slow``
marker runs nine more.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("rich")

from straw.cli.demo import EVENT_PREFIX, kill_session

pytestmark = pytest.mark.crash

#: Bound on one child run (startup, steps, close).
RUN_TIMEOUT_S = 240.0
#: The killed life is asked for more steps than it can reach before its kill.
LONG_RUN_STEPS = 1000


def _command(root: Path, steps: int) -> list[str]:
    return [
        sys.executable, "-m", "straw.cli", "demo", "--child", "--local", "--engine", "copy",
        "--dir", str(root), "--steps", str(steps), "--save-interval", "2",
        "--prompts-per-step", "4", "--samples-per-prompt", "2", "--token-seconds", "0.002",
        "--reward-log", str(root / "rewards.log"),
    ]  # fmt: skip


def run_child(root: Path, steps: int, kill_after: float | None) -> tuple[list[dict[str, Any]], bool]:
    """One life of the job; with ``kill_after``, SIGKILLed that long after its first checkpoint."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "job.log", "a") as err:
        child = subprocess.Popen(
            _command(root, steps), stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True
        )
    events: list[dict[str, Any]] = []
    killed = threading.Event()
    committed = threading.Event()

    def killer() -> None:
        ready = committed.wait(RUN_TIMEOUT_S) and kill_after is not None and child.poll() is None
        # An Event as a bounded, wakeable timer: the run may end (and wake it) first.
        if ready and kill_after is not None and not killed_early.wait(kill_after):
            killed.set()
            kill_session(child)

    killed_early = threading.Event()
    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    watchdog = threading.Timer(RUN_TIMEOUT_S, lambda: kill_session(child))
    watchdog.start()
    try:
        assert child.stdout is not None
        for line in child.stdout:
            if line.startswith(EVENT_PREFIX):
                event = json.loads(line[len(EVENT_PREFIX) :])
                events.append(event)
                if event["event"] == "step" and event["checkpoint"]:
                    committed.set()
        code = child.wait()
    finally:
        watchdog.cancel()
        killed_early.set()
        committed.set()
        thread.join(10)
    if not killed.is_set():
        assert code == 0, (root / "job.log").read_text()[-4000:]
    return events, killed.is_set()


def check_job(root: Path, runs: list[list[dict[str, Any]]], steps: int) -> None:
    trained: dict[int, dict[str, Any]] = {}
    for events in runs:  # a step trained again after a restart replaces the killed run's
        for event in events:
            # ("trained" comes before the step's checkpoint: a kill after the checkpoint's
            # commit but before the step's own event still tells what the step trained.)
            if event["event"] == "trained":
                trained[event["step"]] = event
    assert sorted(trained) == list(range(steps))
    final = runs[-1][-1]
    assert final["event"] == "final"
    groups = [g for k in sorted(trained) for g in trained[k]["group_indices"]]
    assert len(groups) == len(set(groups)), "a group was trained twice"
    live, waiting = final["live"], final["unprocessed"]
    assert sorted(groups + live + waiting) == list(range(final["issued"])), (
        "every issued index must be trained, live or accepted-and-waiting, exactly once"
    )
    calls = [json.loads(line) for line in (root / "rewards.log").read_text().splitlines()]
    by_call = Counter(c["call"] for c in calls)
    for step in trained.values():
        for call, task_id, index in step["reward_calls"]:
            assert by_call[call] == 1, f"reward call {call} logged {by_call[call]} times"
            mine = [i for i, c in enumerate(calls) if c["task"] == task_id and c["index"] == index]
            assert mine and calls[mine[-1]]["call"] == call, (
                f"sample {index} of {task_id}: its accepted reward is not the hook's last call"
            )
    check = subprocess.run(
        [sys.executable, "-m", "straw.cli", "check", str(root / "pool")],
        capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
    )  # fmt: skip
    assert check.returncode == 0, check.stdout + check.stderr


def crash_and_resume(root: Path, seed: int) -> None:
    """Kill a long job at a random moment after its first checkpoint; resume to a few steps past it."""
    rng = random.Random(seed)
    events, killed = run_child(root, LONG_RUN_STEPS, kill_after=rng.uniform(0.0, 3.0))
    assert killed, "the job ended before the kill"
    saved = max(e["step"] for e in events if e["event"] == "step" and e["checkpoint"])
    # A checkpoint the kill interrupted after its commit may be selected too (at most one more).
    steps = saved + 2 * 2 + 1
    restarted, again = run_child(root, steps, kill_after=None)
    assert not again
    start = next(e for e in restarted if e["event"] == "start")
    assert start["recovered"]["mode"] == "rollback"
    assert start["recovered"]["step"] in (saved, saved + 2)
    assert start["first_step"] == start["recovered"]["step"] + 1
    check_job(root, [events, restarted], steps)


@pytest.mark.timeout(900)  # two child runs and straw check, each bounded by RUN_TIMEOUT_S
@pytest.mark.parametrize("seed", [1])
def test_a_killed_demo_job_resumes_without_losing_or_repeating_work(tmp_path: Path, seed: int) -> None:
    crash_and_resume(tmp_path / "job", seed)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("seed", range(2, 11))
def test_a_killed_demo_job_resumes_more_seeds(tmp_path: Path, seed: int) -> None:
    crash_and_resume(tmp_path / "job", seed)


@pytest.mark.timeout(900)
def test_the_demo_kills_and_restarts_itself_at_a_step(tmp_path: Path) -> None:
    """``straw demo --kill-at-step``: the supervisor kills during the step and the job resumes."""
    root = tmp_path / "job"
    started = time.monotonic()
    done = subprocess.run(
        [
            sys.executable, "-m", "straw.cli", "demo", "--local", "--engine", "copy", "--dir", str(root),
            "--steps", "4", "--save-interval", "2", "--prompts-per-step", "4", "--samples-per-prompt", "2",
            "--kill-at-step", "3", "--no-plot",
        ],
        capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env={**os.environ, "COLUMNS": "200"},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr + (root / "job.log").read_text()[-3000:]
    assert "killed the whole job during step 3" in done.stdout
    assert "restarted (rollback from step 2), continuing at step 3" in done.stdout
    summary = json.loads((root / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["restarts"] == 1
    assert summary["recovered"][0]["mode"] == "rollback"
    assert time.monotonic() - started < RUN_TIMEOUT_S
    again = subprocess.run(
        [sys.executable, "-m", "straw.cli", "demo", "--local", "--engine", "copy", "--dir", str(root),
         "--steps", "4", "--save-interval", "2", "--prompts-per-step", "4", "--samples-per-prompt", "2"],
        capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env={**os.environ, "COLUMNS": "200"},
    )  # fmt: skip
    assert again.returncode == 0, again.stdout + again.stderr
    assert "nothing to train" in again.stdout  # the last step was checkpointed too
