"""``straw inspect --save DIR``: a save directory's commits, their bytes and the step a restart picks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollout_jobs import Job, ScriptedGenerator, job_config, pack_files, reached_packs
from straw import SharedFilesystemStore
from straw._inspect.save_view import inspect_save
from straw.cli import main
from straw.protocol import RecordSetRef
from straw.rollout.pool import close_rollout_stores


def commit_roots(save: Path, step: int) -> list[RecordSetRef]:
    rollout = save / "rollout"
    queue = json.loads((rollout / f"queue_state_{step}.json").read_text())
    builder = json.loads((rollout / f"builder_state_{step}.json").read_text())["consumer"]
    return [RecordSetRef.from_dict(queue["manifest"])] + [
        RecordSetRef.from_dict(builder[k]) for k in ("state_ref", "progress_ref")
    ]


def test_inspect_save_lists_commits_bytes_and_the_selection(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    save, pool = tmp_path / "save", tmp_path / "pool"
    config = job_config(
        save, pool, save_interval=1, rollout_queue_online_gc=True, rollout_queue_segment_mib=1
    )
    with Job(config, ScriptedGenerator("x", payload=20000)) as job:
        for step in range(3):
            job.step(step)
    close_rollout_stores()
    data = inspect_save(save)
    assert [row["step"] for row in data["commits"]] == [0, 1, 2]
    assert data["pool"] == str(pool) and data["selection"]["mode"] == "rollback"
    assert data["selection"]["step"] == 2 and data["selection"]["start_rollout_id"] == 3
    sizes = pack_files(pool)
    with SharedFilesystemStore(pool, "rollout") as store:
        for row in data["commits"]:
            assert row["model_files"] == "ok" and row["rollout_files"] == "ok" and row["resumable"] is True
            assert len(row["owners_recorded"]) == 2
            walked = reached_packs(store, commit_roots(save, row["step"]))
            assert row["retained_bytes"] == sum(sizes[p] for p in walked) > 0
            assert 0 <= row["exclusive_bytes"] <= row["retained_bytes"]
    assert main(["inspect", "--save", str(save)]) == 0
    out = capsys.readouterr().out
    assert "COMMITS" in out and "a restart in place would: rollback to step 2, first rollout id 3" in out
    assert main(["inspect", "--save", str(save), "--ckpt-step", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["selection"]["step"] == 1

    (save / "latest_checkpointed_iteration.txt").write_text("0\n")  # the user picks step 0
    assert inspect_save(save)["selection"]["step"] == 0
    (save / "iter_0000000" / "meta.json").write_text('{"step": 9}')
    damaged = inspect_save(save)
    assert damaged["commits"][0]["model_files"] == "iter_0000000/meta.json changed"
    assert "Checkpoint component changed" in damaged["selection"]["error"]
    assert main(["inspect", "--save", str(save)]) == 0
    assert (
        "a restart in place would fail: ValueError: Checkpoint component changed" in capsys.readouterr().out
    )


def test_inspect_save_bad_usage(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "--save", str(tmp_path / "missing")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert main(["inspect", str(tmp_path), "--save", str(tmp_path)]) == 2
    assert "give a POOL, or --save DIR alone" in capsys.readouterr().err
    assert main(["inspect"]) == 2
    empty = inspect_save(tmp_path)
    assert empty["commits"] == [] and empty["selection"]["mode"] == "new"
