"""``straw demo`` end to end with tiny settings (a real local Ray cluster), and its bad inputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("ray")
pytest.importorskip("matplotlib")

from straw.cli import main

#: Bound on the whole demo run (cluster start, steps, shutdown).
DEMO_TIMEOUT_S = 540


@pytest.mark.timeout(600)  # a Ray cluster starts slowly on a loaded 2-core machine
def test_the_demo_runs_end_to_end_and_writes_its_plot_and_summary(tmp_path: Path) -> None:
    root = tmp_path / "demo"
    done = subprocess.run(
        [
            sys.executable, "-m", "straw.cli", "demo", "--dir", str(root), "--steps", "3", "--nodes", "2",
            "--prompts-per-step", "2", "--samples-per-prompt", "4", "--save-interval", "2",
            # Online GC between checkpoints (test_batch_builder pins the case that once crashed
            # the first checkpoint of a longer run: released positions above the processed cursor).
            "--online-gc",
        ],
        capture_output=True, text=True, timeout=DEMO_TIMEOUT_S, env={**os.environ, "COLUMNS": "200"},
    )  # fmt: skip
    log = (root / "job.log").read_text() if (root / "job.log").exists() else ""
    assert done.returncode == 0, done.stdout + done.stderr + log[-4000:]
    assert "2 Ray node(s) on 127.0.0.1, 2 trainer ranks" in done.stdout
    assert f"plot: {root / 'demo.png'}" in done.stdout
    assert "step time split" in done.stdout and "generate" in done.stdout
    assert (root / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((root / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["restarts"] == 0
    assert set(summary["step_split_seconds"]) == {
        "generate",
        "accept",
        "build",
        "train",
        "checkpoint",
        "sync",
    }
    assert [s["step"] for s in summary["per_step"]] == [0, 1, 2]
    assert all(0.0 <= s["mean_reward"] <= 1.0 for s in summary["per_step"])
    events = [json.loads(line) for line in (root / "events.jsonl").read_text().splitlines()]
    steps = [e for e in events if e["event"] == "step"]
    assert [e["weight_version"] for e in steps] == [1, 2, 3]  # one publication per step
    assert [e["checkpoint"] for e in steps] == [True, False, True]  # every 2nd, and the last
    assert all(e["rows_per_rank"] == 4 for e in steps)  # 2 prompts x 4 samples over 2 ranks
    assert (root / "save" / "rollout" / "committed_2.json").exists()
    assert (root / "prompts.jsonl").exists() and any((root / "pool").rglob("*.pack"))
    check = subprocess.run(
        [sys.executable, "-m", "straw.cli", "check", str(root / "pool")], capture_output=True
    )
    assert check.returncode == 0, check.stdout


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--kill-at-step", "0"], "--kill-at-step K needs 1 <= K < --steps"),
        (["--kill-at-step", "5", "--steps", "5"], "--kill-at-step K needs 1 <= K < --steps"),
        (["--steps", "0"], "--steps must be a positive integer"),
        (["--nodes", "0"], "--nodes must be a positive integer"),
        (["--prompts-per-step", "3", "--samples-per-prompt", "1"], "split evenly over the trainer ranks"),
        (["--decode-seconds", "-1"], "--decode-seconds must be between 0 and 10"),
    ],
)
def test_bad_demo_arguments_are_refused_before_anything_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    root = tmp_path / "demo"
    assert main(["demo", "--dir", str(root), *argv]) == 2
    assert message in capsys.readouterr().err
    assert not root.exists()


def test_the_child_gets_every_setting_the_supervisor_was_given(tmp_path: Path) -> None:
    """Every flag the supervisor accepts, given a value other than its default, reaches the child
    unchanged, so a flag added later and not forwarded fails here (as --storage-declaration once
    did)."""
    import argparse

    from straw.cli import build_parser, demo

    supervisor_only = {"child", "fresh", "kill_at_step", "no_plot", "help"}
    flags = argparse.ArgumentParser(add_help=False)
    demo.add_arguments(flags)
    given = ["demo"]
    for action in flags._actions:
        if action.dest in supervisor_only:
            continue
        flag = action.option_strings[0]
        if isinstance(action, argparse._StoreTrueAction):
            given.append(flag)
        elif action.choices:
            given += [flag, next(str(c) for c in action.choices if c != action.default)]
        elif action.type in (int, float):
            given += [flag, str(action.default * 2 if action.default else 1)]
        else:
            given += [flag, str(tmp_path / action.dest)]
    options = build_parser().parse_args(given)
    child = build_parser().parse_args([*demo._argv(options), "--child"])
    assert demo._settings(child) == demo._settings(options)
    differing = {
        name: (value, getattr(child, name))
        for name, value in vars(options).items()
        if name not in supervisor_only and getattr(child, name) != value
    }
    assert differing == {}
    assert child.storage_declaration == str(tmp_path / "storage_declaration")
