"""straw.rollout.checkpoint without joint commits: RestorePlan, resolve_checkpoint for a new job,
a job without commits (resume) and a legacy model-only directory; job.json (ROLLOUT.md section
14.4 rules 1, 3, 7 and 10, sections 14.5 and 14.8). Joint commits and rollbacks:
test_commit.py and test_rollback.py."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from rollout_helpers import prompt_rows
from straw.rollout.checkpoint import (
    RestorePlan,
    initial_configuration,
    read_job,
    resolve_checkpoint,
    state_token,
)
from straw.rollout.config import RolloutConfig
from straw.rollout.controller import QueueController

MakeConfig = Callable[..., RolloutConfig]


@pytest.fixture
def save(tmp_path: Path) -> Path:
    return tmp_path / "save"


def files_under(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*")) if path.exists() else []


def test_rule_1_without_a_save_directory_a_job_is_new(make_config: MakeConfig) -> None:
    config = make_config()
    resolved, plan = resolve_checkpoint(config)
    assert plan.mode == "new" and plan.save is None and plan.queue_id.startswith("run:")
    assert len(plan.queue_id) == len("run:") + 32 and plan.state_token is None
    assert resolved.start_rollout_id == 0 and config.start_rollout_id is None
    assert resolve_checkpoint(config)[1].queue_id != plan.queue_id


def test_rule_1_a_replay_gets_its_own_debug_queue_and_the_archives_pool(
    make_config: MakeConfig, tmp_path: Path
) -> None:
    archive_pool = tmp_path / "archive-pool"
    index = tmp_path / "rollout_7.straw.json"
    index.write_text(
        json.dumps(
            {"format": "straw.rollout-archive", "version": 1, "root": str(archive_pool), "run_id": "old"}
        )
    )
    config = make_config(
        save=str(tmp_path / "save"),
        save_interval=1,
        load_debug_rollout_data=str(tmp_path / "rollout_{rollout_id}.straw.json"),
    )
    resolved, plan = resolve_checkpoint(config)
    assert plan.mode == "new" and plan.queue_id.startswith("debug:")
    assert resolved.rollout_data_dir == str(archive_pool) and resolved.run_id == "old"
    with QueueController(resolved, dataset=prompt_rows(4), restore_plan=plan) as controller:
        assert controller.identity()["queue_id"] == plan.queue_id and controller.identity()["run_id"] == "old"
        assert controller.take("r", 1).status == "acquired"
    assert not (tmp_path / "save" / "rollout" / "job.json").exists()  # a replay is not the job
    assert not (tmp_path / "pool").exists()  # the configured pool is never created


def test_resolution_creates_nothing(make_config: MakeConfig, save: Path, tmp_path: Path) -> None:
    before = files_under(tmp_path)
    resolved, plan = resolve_checkpoint(make_config(save=str(save), save_interval=1))
    assert plan.mode == "new" and plan.save == str(save) and plan.state_token == state_token(save)
    assert files_under(tmp_path) == before
    assert resolved.rollout_data_dir == str(tmp_path / "pool")


def test_a_new_job_writes_its_job_file(make_config: MakeConfig, save: Path) -> None:
    config = make_config(save=str(save), save_interval=1, hf_checkpoint="/models/base", rollout_seed=7)
    with QueueController(config, dataset=prompt_rows(4)) as controller:
        job = read_job(save)
        assert job == {
            "version": 1, "queue_id": controller.plan.queue_id, "run_id": "rollout",
            "pool": config.rollout_data_dir, "profile": "local", "initial_load": None, "initial_step": None,
            "initial_configuration": initial_configuration(config),
        }  # fmt: skip
    configuration = initial_configuration(config)
    assert configuration["identity_extra"] == {"hf_checkpoint": "/models/base"}
    assert configuration["rollout_seed"] == 7 and configuration["rollout_queue_run_id"] == "rollout"
    assert sorted(configuration) == sorted(
        ["prompt_data", "input_key", "label_key", "metadata_key", "n_samples_per_prompt", "rollout_seed",
         "rollout_shuffle", "rollout_queue_run_id", "identity_extra"]
    )  # fmt: skip


def test_rule_7_and_10_a_job_without_commits_resumes(
    make_config: MakeConfig, save: Path, tmp_path: Path
) -> None:
    config = make_config(save=str(save), save_interval=1, hf_checkpoint="/models/base")
    with QueueController(config, dataset=prompt_rows(4)) as first:
        queue_id = first.plan.queue_id
        first.take("r", 2)
    token = state_token(save)
    for load in (None, str(save), str(save) + "/"):
        resolved, plan = resolve_checkpoint(
            make_config(save=str(save), save_interval=1, load=load, hf_checkpoint="/models/base")
        )
        assert plan.mode == "resume" and plan.queue_id == queue_id and plan.state_token == token
        assert resolved.load is None and resolved.ckpt_step is None and resolved.start_rollout_id == 0
        assert resolved.rollout_data_dir == config.rollout_data_dir
    # Without an explicit pool the job's pool is used; an explicit other pool is refused.
    moved = RolloutConfig(save=str(save), save_interval=1, identity_extra={"hf_checkpoint": "/models/base"})
    assert resolve_checkpoint(moved)[0].rollout_data_dir == config.rollout_data_dir
    with pytest.raises(ValueError, match=r"^Interrupted run requires its original straw pool$"):
        resolve_checkpoint(
            make_config(
                save=str(save),
                save_interval=1,
                rollout_data_dir=str(tmp_path / "p2"),
                hf_checkpoint="/models/base",
            )
        )
    changes = [{"hf_checkpoint": "/models/other"}, {"n_samples_per_prompt": 2}, {"rollout_seed": 1},
               {"rollout_shuffle": True}, {"rollout_queue_run_id": "r2"}, {"input_key": "text"}]  # fmt: skip
    for change in changes:
        flags = {"save": str(save), "save_interval": 1, "hf_checkpoint": "/models/base", **change}
        with pytest.raises(
            ValueError, match=r"^Initial model/input configuration differs from the interrupted run$"
        ):
            resolve_checkpoint(make_config(**flags))
    with QueueController(resolve_checkpoint(config)[0], dataset=prompt_rows(4)) as again:
        assert again.plan.mode == "resume" and again.plan.queue_id == queue_id
        assert again.queue.metrics()["tasks"] == {"pending": 8}  # the leases were revoked


def test_rule_3_another_load_directory(make_config: MakeConfig, save: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    with pytest.raises(FileNotFoundError, match="No committed model/rollout checkpoint in"):
        resolve_checkpoint(make_config(save=str(save), save_interval=1, load=str(other)))
    with QueueController(make_config(save=str(save), save_interval=1), dataset=prompt_rows(4)):
        pass
    with pytest.raises(
        ValueError, match=r"already holds a rollout job; resume it with --load .* or choose a new --save$"
    ):
        resolve_checkpoint(make_config(save=str(save), save_interval=1, load=str(other)))


def test_rule_7_a_legacy_model_directory_starts_empty_at_its_tracker(
    make_config: MakeConfig, save: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (save / "iter_0000007").mkdir(parents=True)
    (save / "iter_0000007" / "model.bin").write_bytes(b"weights")
    (save / "latest_checkpointed_iteration.txt").write_text("7\n")
    config = make_config(save=str(save), save_interval=1)
    with caplog.at_level(logging.WARNING, logger="straw.rollout.checkpoint"):
        resolved, plan = resolve_checkpoint(config)
    assert (
        "step 7 has no queue snapshot: starting a new empty queue; dataset restarts at offset 0"
        in caplog.text
    )
    assert plan.mode == "empty" and plan.step == 7 and plan.cursor_source == "start"
    assert (
        resolved.start_rollout_id == 8
        and resolved.ckpt_step == 7
        and resolved.update_weight_start_version == 8
    )
    with pytest.raises(ValueError, match=r"^--start-rollout-id differs from the checkpoint$"):
        resolve_checkpoint(make_config(save=str(save), save_interval=1, start_rollout_id=3))
    cursor = {"epoch_id": 1, "sample_offset": 2, "sample_group_index": 6, "sample_index": 6, "metadata": {}}
    (save / "rollout").mkdir()
    (save / "rollout" / "global_dataset_state_dict_7.json").write_text(
        json.dumps({"step": 7, "timeline": 0, **cursor})
    )
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="straw.rollout.checkpoint"):
        resolved, plan = resolve_checkpoint(config)
    assert "starting a new empty queue; restore dataset cursor from" in caplog.text
    assert plan.cursor == cursor and plan.cursor_source == "file"
    with QueueController(
        resolved, dataset=prompt_rows(4), restore_plan=plan
    ) as controller:  # no queue yet: as new
        assert controller.identity()["mode"] == "empty"
        assert controller.queue.producer_state("dataset") == {"version": 1, "timeline": 0, "cursor": cursor}
        assert controller.take("r", 1).assignments[0].task.task_id == "prompt:6"
    assert (save / "iter_0000007" / "model.bin").read_bytes() == b"weights"
    job = read_job(save)
    assert job is not None and job["initial_step"] == 7
    again, resumed = resolve_checkpoint(config)
    assert resumed.mode == "resume" and again.start_rollout_id == 8 and again.ckpt_step == 7


def test_restore_plans_check_their_fields() -> None:
    with pytest.raises(ValueError, match="mode must be one of"):
        RestorePlan("fork", queue_id="run:1")
    with pytest.raises(ValueError, match="names a run:<hex> or debug:<hex> queue"):
        RestorePlan("new", queue_id="rollout")
    with pytest.raises(ValueError, match="Dataset checkpoint is missing"):
        RestorePlan("empty", queue_id="run:1", cursor={"epoch_id": 0})
    with pytest.raises(ValueError, match="cursor_source"):
        RestorePlan("empty", queue_id="run:1", cursor_source="tape")
    with pytest.raises(TypeError):
        resolve_checkpoint("config")  # type: ignore[arg-type]
    plan = RestorePlan("new", queue_id="run:1")
    with pytest.raises(AttributeError):
        plan.mode = "resume"  # type: ignore[misc]


def test_the_state_token_names_the_selection_files(make_config: MakeConfig, save: Path) -> None:
    assert state_token(None) is None
    empty = state_token(save)
    (save / "rollout").mkdir(parents=True)
    (save / "rollout" / "job.json").write_text("{}")
    with_job = state_token(save)
    (save / "latest_checkpointed_iteration.txt").write_text("3\n")
    with_tracker = state_token(save)
    (save / "rollout" / "committed_3.json").write_text("{}")
    assert len({empty, with_job, with_tracker, state_token(save)}) == 4
    os.remove(save / "rollout" / "committed_3.json")
    assert state_token(save) == with_tracker


def test_a_damaged_job_file_is_an_error(make_config: MakeConfig, save: Path) -> None:
    (save / "rollout").mkdir(parents=True)
    (save / "rollout" / "job.json").write_text('{"version": 2}')
    with pytest.raises(ValueError, match="unsupported version 2"):
        resolve_checkpoint(make_config(save=str(save), save_interval=1))
    (save / "rollout" / "job.json").write_text("not json")
    with pytest.raises(ValueError, match="is not JSON"):
        resolve_checkpoint(make_config(save=str(save), save_interval=1))
