"""Joint commits and step selection (acceptance scenarios 34-38, 43, 44, 46, 47; ROLLOUT.md 14.1-14.4)."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from rollout_jobs import Job, ScriptedGenerator, job_config, rows, save_files, write_model
from straw.rollout.checkpoint import (
    ModelSave,
    commit_checkpoint,
    model_dir,
    read_commit,
    resolve_checkpoint,
    save_checkpoint,
)
from straw.rollout.controller import QueueController
from straw.rollout.pool import close_rollout_stores


@pytest.fixture
def save(tmp_path: Path) -> Path:
    return tmp_path / "save"


@pytest.fixture
def pool(tmp_path: Path) -> Path:
    return tmp_path / "pool"


def run_job(
    save: Path, pool: Path, steps: int, *, checkpoint: bool | None = None, **flags: Any
) -> dict[int, list[int]]:
    """Steps 0..steps-1 of the test job, checkpointing on its interval; the trained groups."""
    with Job(job_config(save, pool, **flags), ScriptedGenerator("first")) as job:
        for step in range(steps):
            job.step(step, checkpoint=checkpoint)
        trained = {k: t.groups for k, t in job.trained.items()}
    close_rollout_stores()
    return trained


def tree(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*")) if path.exists() else []


class Failing:
    """A data source or builder whose ``save`` fails."""

    def save(self, step: int) -> Path:
        raise OSError("disk went away")


# --------------------------------------------------------------------------- scenario 34


def test_scenario_34_a_checkpoint_commits_only_when_every_part_is_saved(save: Path, pool: Path) -> None:
    config = job_config(save, pool, save_interval=10)
    with Job(config, ScriptedGenerator("first")) as job:
        job.step(0, checkpoint=False)

        def failing_models() -> ModelSave:
            raise OSError("model save failed")

        with pytest.raises(OSError, match="model save failed"):
            save_checkpoint(job.config, 0, save_models=failing_models, source=job.source, builder=job.builder)
        with pytest.raises(OSError, match="disk went away"):
            save_checkpoint(
                job.config, 0, save_models=lambda: write_model(save, 0), source=Failing(), builder=job.builder
            )
        with pytest.raises(OSError, match="disk went away"):
            save_checkpoint(
                job.config, 0, save_models=lambda: write_model(save, 0), source=job.source, builder=Failing()
            )
        marker = save / "rollout" / "committed_0.json"
        assert not marker.exists() and not (save / "latest_checkpointed_iteration.txt").exists()
        assert job.checkpoint(0) == marker
    commit = json.loads(marker.read_text())
    assert sorted(commit["files"]) == [
        "iter_0000000/meta.json",
        "iter_0000000/model.bin",
        "rollout/builder_state_0.json",
        "rollout/global_dataset_state_dict_0.json",
        "rollout/queue_state_0.json",
    ]
    assert set(commit["files"]["iter_0000000/meta.json"]) == {"size", "sha256"}
    assert set(commit["files"]["iter_0000000/model.bin"]) == {"size"}  # large files: size only
    assert commit["weight_version"] == 1 and commit["resumable"] is True and commit["rollout_id"] == 0
    assert commit["rollout_data_dir"] == str(pool) and commit["run_id"] == "rollout"
    assert commit["queue_id"] == json.loads((save / "rollout" / "job.json").read_text())["queue_id"]
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "0\n"
    assert json.loads((save / "rollout" / "tracker.json").read_text()) == {"version": 1, "text": "0\n"}
    queue_state = json.loads((save / "rollout" / "queue_state_0.json").read_text())
    cursor_file = json.loads((save / "rollout" / "global_dataset_state_dict_0.json").read_text())
    cursor = queue_state["producer"]["cursor"]
    assert {k: cursor_file[k] for k in cursor} == cursor
    assert read_commit(save) == commit == read_commit(marker) == read_commit(save, 0)
    assert read_commit(save, 3) is None


# --------------------------------------------------------------------------- scenario 35


def test_scenario_35_commits_are_immutable(save: Path, pool: Path) -> None:
    run_job(save, pool, 1)
    config = job_config(save, pool)
    called: list[int] = []

    def models() -> ModelSave:
        called.append(1)
        return write_model(save, 0)

    with pytest.raises(FileExistsError, match="Refusing to overwrite a committed straw checkpoint"):
        save_checkpoint(config, 0, save_models=models, source=Failing(), builder=Failing())
    assert called == []
    with pytest.raises(FileExistsError, match="Committed checkpoints are immutable"):
        commit_checkpoint(config, 0, models=[ModelSave(str(model_dir(save, 0)))])


# --------------------------------------------------------------------------- scenario 36


def test_scenario_36_model_saves_are_checked(save: Path, pool: Path, tmp_path: Path) -> None:
    run_job(save, pool, 1, checkpoint=False)  # no checkpoint: step 0's rollout files are absent
    config = job_config(save, pool)
    write_model(save, 0)
    assert (
        commit_checkpoint(config, 0, models=ModelSave(str(model_dir(save, 0))), require_rollout=False) is None
    )
    assert not (save / "rollout" / "committed_0.json").exists()
    with pytest.raises(FileNotFoundError, match=r"Missing rollout checkpoint file: .*queue_state_0\.json"):
        commit_checkpoint(config, 0, models=ModelSave(str(model_dir(save, 0))))

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "w.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="Model checkpoint must be inside --save"):
        commit_checkpoint(config, 0, models=ModelSave(str(outside)))
    with pytest.raises(ValueError, match="Missing model checkpoint payloads"):
        commit_checkpoint(config, 0, models=ModelSave(str(save / "iter_0000009")))
    (save / "empty").mkdir()
    with pytest.raises(ValueError, match="Missing model checkpoint payloads"):
        commit_checkpoint(config, 0, models=ModelSave("empty"))  # relative to --save
    linked = save / "linked"
    linked.mkdir()
    (linked / "real.bin").write_bytes(b"x")
    os.symlink(outside / "w.bin", linked / "alias.bin")
    with pytest.raises(ValueError, match=r"Checkpoint payload must not be a symlink: .*alias\.bin"):
        commit_checkpoint(config, 0, models=ModelSave(str(linked)))
    os.symlink(outside, save / "escape")
    with pytest.raises(ValueError, match="Model checkpoint must be inside --save"):
        commit_checkpoint(config, 0, models=ModelSave(str(save / "escape")))
    with pytest.raises(
        ValueError, match=r"Missing required model checkpoint file: .*opt_param_scheduler\.pt"
    ):
        commit_checkpoint(
            config, 0, models=ModelSave(str(model_dir(save, 0)), required=("opt_param_scheduler.pt",))
        )
    assert not (save / "rollout" / "committed_0.json").exists()

    second = job_config(save / "second", pool / "second")
    with Job(second, ScriptedGenerator("x")) as job:
        job.step(0, checkpoint=False)
        job.source.save(0)
        job.builder.save(0)
        write_model(save / "second", 0)
        marker = commit_checkpoint(
            job.config,
            0,
            models=[ModelSave(str(model_dir(save / "second", 0)), resumable=False)],
            weight_version=7,
        )
    assert marker is not None
    commit = json.loads(marker.read_text())
    assert commit["resumable"] is False and commit["weight_version"] == 7
    close_rollout_stores()
    with pytest.raises(ValueError, match="omitted optimizer/RNG"):
        resolve_checkpoint(second)
    with pytest.raises(TypeError):
        ModelSave(str(save), required="one.pt")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="relative file names"):
        ModelSave(str(save), required=("/abs.pt",))
    with pytest.raises(TypeError, match="models= holds ModelSave"):
        commit_checkpoint(config, 0, models=[str(save)])  # type: ignore[list-item]


# --------------------------------------------------------------------------- scenario 37


def test_scenario_37_an_unfinished_model_save_never_wins(save: Path, pool: Path, tmp_path: Path) -> None:
    run_job(save, pool, 3, save_interval=1, rollout_data_dir=str(pool))
    os.remove(save / "rollout" / "committed_0.json")  # commits 1 and 2 remain
    write_model(save, 3)
    (save / "latest_checkpointed_iteration.txt").write_text("3\n")  # the model save got that far
    before = tree(tmp_path)
    resolved, plan = resolve_checkpoint(job_config(save, pool, rollout_data_dir=None))
    assert tree(tmp_path) == before  # nothing created
    assert plan.mode == "rollback" and plan.step == 2 and plan.snapshot_problem is None
    assert resolved.start_rollout_id == 3 and resolved.update_weight_start_version == 3
    assert resolved.ckpt_step == 2 and resolved.rollout_data_dir == str(pool)
    assert resolved.load == str(save)


# --------------------------------------------------------------------------- scenario 38


def test_scenario_38_step_precedence(save: Path, pool: Path) -> None:
    run_job(save, pool, 3, save_interval=1)
    config = job_config(save, pool)
    tracker = save / "latest_checkpointed_iteration.txt"
    assert resolve_checkpoint(config)[1].step == 2
    tracker.write_text("0\n")  # the user edited the tracker
    assert resolve_checkpoint(config)[1].step == 0
    assert resolve_checkpoint(job_config(save, pool, ckpt_step=1))[1].step == 1
    marker = str(save / "rollout" / "committed_2.json")
    assert resolve_checkpoint(job_config(save, pool, ckpt_step=None, load=marker))[1].step == 2
    with pytest.raises(ValueError, match="--ckpt-step differs from the explicit checkpoint marker"):
        resolve_checkpoint(job_config(save, pool, ckpt_step=1, load=marker))
    tracker.write_text("zero\n")  # not an integer: ignored
    assert resolve_checkpoint(config)[1].step == 2
    # A crash between the marker of 2 and its tracker: tracker and tracker.json still say 1.
    tracker.write_text("1\n")
    (save / "rollout" / "tracker.json").write_text(json.dumps({"version": 1, "text": "1\n"}))
    assert resolve_checkpoint(config)[1].step == 2
    tracker.write_text("5\n")  # newer than every commit: an unfinished model save
    assert resolve_checkpoint(config)[1].step == 2


# --------------------------------------------------------------------------- scenario 43


def test_scenario_43_a_legacy_directory_restores_an_empty_queue(
    save: Path, pool: Path, caplog: pytest.LogCaptureFixture
) -> None:
    write_model(save, 7)
    model = (save / "iter_0000007" / "model.bin").read_bytes()
    (save / "latest_checkpointed_iteration.txt").write_text("7\n")
    config = job_config(save, pool)
    with caplog.at_level(logging.WARNING, logger="straw.rollout.checkpoint"):
        resolved, plan = resolve_checkpoint(config)
    assert plan.mode == "empty" and plan.step == 7 and resolved.start_rollout_id == 8
    assert "new empty queue" in caplog.text and "offset 0" in caplog.text
    cursor = {
        "epoch_id": 0,
        "sample_offset": 30,
        "sample_group_index": 30,
        "sample_index": 60,
        "metadata": {},
    }
    (save / "rollout").mkdir()
    (save / "rollout" / "global_dataset_state_dict_7.json").write_text(json.dumps({"step": 7, **cursor}))
    with Job(config, ScriptedGenerator("x")) as job:
        assert job.plan.mode == "empty" and job.plan.cursor == cursor
        assert job.step(8, checkpoint=False).groups == [30, 30, 31, 31]
    close_rollout_stores()
    assert (save / "iter_0000007" / "model.bin").read_bytes() == model
    resolved, plan = resolve_checkpoint(config)
    assert plan.mode == "resume" and resolved.start_rollout_id == 8  # a restart before any commit


# --------------------------------------------------------------------------- scenario 44


def test_scenario_44_an_explicit_step_needs_a_commit_or_model_files(save: Path, pool: Path) -> None:
    run_job(save, pool, 3, save_interval=1)
    (save / "rollout" / "queue_state_5.json").write_text("{}")
    with pytest.raises(
        ValueError, match="without a complete joint commit; refusing empty-queue fallback: step 5"
    ):
        resolve_checkpoint(job_config(save, pool, ckpt_step=5))
    with pytest.raises(FileNotFoundError, match="No committed model/rollout checkpoint for step 8"):
        resolve_checkpoint(job_config(save, pool, ckpt_step=8))
    write_model(save, 8)
    resolved, plan = resolve_checkpoint(job_config(save, pool, ckpt_step=8))
    assert plan.mode == "empty" and plan.step == 8 and resolved.start_rollout_id == 9
    assert plan.queue_id == json.loads((save / "rollout" / "job.json").read_text())["queue_id"]


# --------------------------------------------------------------------------- scenario 46


def test_scenario_46_a_model_import_starts_a_new_job(save: Path, pool: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    run_job(other, pool, 3, save_interval=2)  # commits 0 and 2
    snapshot = save_files(other)
    run_job(save, pool, 1)
    with pytest.raises(ValueError, match="already holds a rollout job"):
        resolve_checkpoint(job_config(save, pool, load=str(other)))
    fresh = tmp_path / "fresh"
    config = job_config(fresh, pool, load=str(other))
    resolved, plan = resolve_checkpoint(config)
    assert plan.mode == "new" and plan.initial_step == 2 and plan.cursor_source == "snapshot"
    assert resolved.start_rollout_id == 3 and resolved.ckpt_step == 2 and resolved.load == str(other)
    queue_state = json.loads((other / "rollout" / "queue_state_2.json").read_text())
    assert plan.cursor == queue_state["producer"]["cursor"]
    with Job(config, ScriptedGenerator("import")) as job:
        assert job.plan.queue_id != queue_state["queue_id"]
        assert job.controller.queue.producer_state("dataset")["cursor"] == plan.cursor
        job.step(3, checkpoint=False)
    job_file = json.loads((fresh / "rollout" / "job.json").read_text())
    assert job_file["initial_step"] == 2 and job_file["initial_load"] == str(other)
    assert save_files(other) == snapshot  # the load directory is never written
    close_rollout_stores()
    marker = str(other / "rollout" / "committed_0.json")
    assert resolve_checkpoint(job_config(tmp_path / "f2", pool, load=marker))[1].initial_step == 0


# --------------------------------------------------------------------------- scenario 47


def test_scenario_47_restore_checks_the_run_the_pool_and_the_data(
    save: Path, pool: Path, tmp_path: Path
) -> None:
    run_job(save, pool, 2, save_interval=1)
    with pytest.raises(ValueError, match="--start-rollout-id differs from the checkpoint"):
        resolve_checkpoint(job_config(save, pool, ckpt_step=1, start_rollout_id=5))
    assert resolve_checkpoint(job_config(save, pool, ckpt_step=1, start_rollout_id=2))[1].step == 1
    with pytest.raises(ValueError, match="Checkpoint belongs to another straw run"):
        resolve_checkpoint(job_config(save, pool, rollout_queue_run_id="other-run"))
    (tmp_path / "pool2").mkdir()
    with pytest.raises(ValueError, match="Checkpoint restoration requires the original shared straw pool"):
        resolve_checkpoint(job_config(save, tmp_path / "pool2"))
    changed = job_config(save, pool, n_samples_per_prompt=4, global_batch_size=8)
    with pytest.raises(ValueError, match="Data source checkpoint differs in n_samples_per_prompt"):
        QueueController(changed, dataset=rows())
    with pytest.raises(ValueError, match="Data source checkpoint differs in dataset_size"):
        QueueController(job_config(save, pool), dataset=rows(150))
    with Job(job_config(save, pool), ScriptedGenerator("fixed")) as job:  # the right data: it starts
        assert job.plan.mode == "rollback" and job.plan.step == 1


def test_a_lost_pool_restores_into_another_pool_without_the_queue(
    save: Path, pool: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    trained = run_job(save, pool, 3, save_interval=2)
    shutil.rmtree(pool)
    elsewhere = tmp_path / "new-pool"
    config = job_config(save, elsewhere)
    with (
        caplog.at_level(logging.WARNING, logger="straw.rollout"),
        Job(config, ScriptedGenerator("after")) as job,
    ):
        assert job.plan.mode == "rollback" and job.plan.step == 2
        assert job.controller.plan.snapshot_problem is not None
        assert "no usable queue snapshot" in caplog.text
        # The unfinished groups of step 2 are not reissued: the queue restarts at the cursor.
        assert job.step(3).groups[0] > max(g for groups in trained.values() for g in groups)
    assert json.loads((save / "rollout" / "job.json").read_text())["pool"] == str(elsewhere)
