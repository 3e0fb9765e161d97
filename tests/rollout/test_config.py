"""straw.rollout.config: flags, validation, the pool binding (acceptance scenarios 1-3), archive binding."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from straw.rollout.archive import bind_archive_pool, read_archive_index
from straw.rollout.config import (
    REMOVED_FLAGS,
    RolloutConfig,
    add_arguments,
    check_debug_template,
    from_args,
    resolve_pool,
)


def config_of(**flags: Any) -> RolloutConfig:
    return RolloutConfig.from_args(SimpleNamespace(**flags))


def tree(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


# --------------------------------------------------------------------------- scenario 1


def test_scenario_1_resolve_pool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bare = config_of()
    with pytest.raises(ValueError, match="--rollout-data-dir or --save"):
        resolve_pool(bare)
    save = tmp_path / "save"
    saved = config_of(save=str(save), save_interval=1)
    bound = resolve_pool(saved)
    assert bound.rollout_data_dir == str(save / "rollout_data")
    assert saved.rollout_data_dir is None  # the input is never changed
    explicit = config_of(save=str(save), save_interval=1, rollout_data_dir=str(tmp_path / "pool"))
    assert resolve_pool(explicit).rollout_data_dir == str(tmp_path / "pool")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    home = resolve_pool(config_of(rollout_data_dir="~/p"))
    assert home.rollout_data_dir == str(tmp_path / "home" / "p") and os.path.isabs(home.rollout_data_dir)
    monkeypatch.chdir(tmp_path)
    assert resolve_pool(config_of(rollout_data_dir="rel/pool")).rollout_data_dir == str(
        tmp_path / "rel" / "pool"
    )
    assert tree(tmp_path) == []  # resolution creates nothing


def test_resolve_pool_bad_input() -> None:
    with pytest.raises(TypeError, match="takes a RolloutConfig"):
        resolve_pool(SimpleNamespace(rollout_data_dir="/x"))  # type: ignore[arg-type]


# --------------------------------------------------------------------------- scenario 2


def test_scenario_2_validation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"rollout-queue-segment-mib.*positive"):
        config_of(rollout_queue_segment_mib=0)
    with pytest.raises(
        ValueError,
        match=r"^--buffer-filter-path is not supported by straw; the queue prioritizes ready groups, "
        "partials, then fresh prompts, using older weight versions first within each stage$",
    ):
        config_of(buffer_filter_path="pkg.filter")
    with pytest.raises(ValueError, match=r"^--save requires a positive --save-interval$"):
        config_of(save=str(tmp_path / "save"))
    with pytest.raises(ValueError, match="--save requires a positive --save-interval"):
        config_of(save=str(tmp_path / "save"), save_interval=0)
    with pytest.raises(ValueError, match="requires --rollout-data-transport straw"):
        from_args(SimpleNamespace(rollout_data_transport="object-store"))
    assert config_of(rollout_data_transport="straw").rollout_data_dir is None
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"rollout_io_concurrency": 0}, "^--rollout-io-concurrency must be positive"),
        ({"rollout_queue_lease_seconds": 0.0}, "^--rollout-queue-lease-seconds must be positive"),
        ({"rollout_queue_lease_seconds": float("nan")}, "^--rollout-queue-lease-seconds must be positive"),
        ({"n_samples_per_prompt": -1}, "^--n-samples-per-prompt must be positive"),
        ({"rollout_batch_size": 0}, "^--rollout-batch-size must be positive"),
        ({"global_batch_size": 0}, "^--global-batch-size must be positive"),
        ({"micro_batch_size": 0}, "^--micro-batch-size must be positive"),
        ({"rollout_io_concurrency": "4"}, "^--rollout-io-concurrency must be positive"),
        ({"rollout_io_concurrency": True}, "^--rollout-io-concurrency must be positive"),
        (
            {"rollout_batch_size": 3, "n_samples_per_prompt": 2, "global_batch_size": 4},
            "^--global-batch-size must divide --rollout-batch-size × --n-samples-per-prompt$",
        ),
        ({"rollout_top_p": 0.0}, "--rollout-top-p must be in \\(0, 1\\]"),
        ({"rollout_top_p": 1.5}, "--rollout-top-p must be in \\(0, 1\\]"),
        ({"use_score_centering": True}, "needs a positive --score-centering-top-k"),
        (
            {"use_score_centering": True, "score_centering_top_k": 0},
            "--score-centering-top-k must be positive",
        ),
        ({"load_debug_rollout_data_subsample": 0.0}, "subsample must be in \\(0, 1\\]"),
        ({"load_debug_rollout_data_subsample": 1.01}, "subsample must be in \\(0, 1\\]"),
        ({"ckpt_step": -1}, "--ckpt-step must be a non-negative integer"),
        ({"start_rollout_id": -2}, "--start-rollout-id must be a non-negative integer"),
        ({"rollout_storage_profile": "nfs"}, "--rollout-storage-profile must be one of local, juicefs"),
        ({"refill_min_groups": 9, "refill_max_groups": 8}, "refill_min_groups must not exceed"),
        ({"task_max_attempts": 0}, "task_max_attempts must be positive"),
        ({"gc_interval_seconds": -1}, "gc_interval_seconds must be positive"),
        ({"save_interval": -1}, "--save-interval must be positive"),
        ({"identity_extra": ["x"]}, "identity_extra must be a dict"),
    ],
)
def test_validation_errors_name_the_flag(flags: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        config_of(**flags)


@pytest.mark.parametrize(
    "template",
    [
        "/d/rollout.pt",
        "/d/rollout_{rollout_id}.json",
        "/d/{rollout_id}_{rollout_id}.pt",
        "/d/{other}.pt",
        "/d/{rollout_id}{x}.straw.json",
        "/d/{rollout_id.real}.pt",
        "/d/{rollout_id.pt",
        "/d/{}.pt",
    ],
)
def test_debug_templates_are_checked(template: str) -> None:
    message = "Debug rollout data path must end in .pt or .straw.json and contain one {rollout_id} field: "
    for flag in ("save_debug_rollout_data", "load_debug_rollout_data"):
        with pytest.raises(ValueError) as raised:
            config_of(**{flag: template})
        assert str(raised.value) == message + template


def test_good_debug_templates() -> None:
    assert check_debug_template("/d/rollout_{rollout_id}.pt") == "/d/rollout_{rollout_id}.pt"
    assert check_debug_template("/d/r_{rollout_id:07d}.straw.json")
    config = config_of(save_debug_rollout_data="/d/rollout_{rollout_id}.straw.json")
    assert config.save_debug_rollout_data == "/d/rollout_{rollout_id}.straw.json"


def test_buffer_sort_by_staleness_only_warns(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="straw.rollout.config"):
        config = config_of(buffer_sort_by_staleness=True)
    assert config.buffer_sort_by_staleness is True
    assert [r.message for r in caplog.records if "has no effect" in r.message]


# --------------------------------------------------------------------------- scenario 3


def parser_with(*, exclude: set[str] = frozenset()) -> argparse.ArgumentParser:  # type: ignore[assignment]
    parser = argparse.ArgumentParser(prog="train", exit_on_error=False)
    add_arguments(parser, exclude=exclude)
    return parser


@pytest.mark.parametrize("flag", sorted(REMOVED_FLAGS))
def test_scenario_3_removed_flags_stop_the_parser(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    parser = parser_with()
    for argv in ([flag], [flag, "7"]):
        with pytest.raises(SystemExit) as exited:
            parser.parse_args(argv)
        assert exited.value.code == 2
        err = capsys.readouterr().err
        assert f"{flag} was removed: {REMOVED_FLAGS[flag]}" in err


def test_scenario_3_exclude_keeps_the_frameworks_flag_and_defaults_fill_in() -> None:
    parser = argparse.ArgumentParser(prog="train")
    parser.add_argument("--save", type=str, default="/framework/default")
    add_arguments(parser, exclude={"--save"})
    args = parser.parse_args(
        ["--rollout-data-dir", "/pool", "--save-interval", "5", "--no-rewards-normalization"]
    )
    assert args.save == "/framework/default"
    config = from_args(args)
    assert config.save == "/framework/default" and config.save_interval == 5
    assert config.rewards_normalization is False and config.grpo_std_normalization is True
    defaults = from_args(SimpleNamespace())
    assert defaults == RolloutConfig()
    assert defaults.rollout_io_concurrency == 4 and defaults.rollout_queue_lease_seconds == 300.0
    assert defaults.run_id == "rollout" and defaults.input_key == "input" and defaults.rollout_seed == 42


def test_parser_round_trip_of_every_flag(tmp_path: Path) -> None:
    parser = parser_with()
    args = parser.parse_args(
        [
            "--rollout-data-dir", "/pool", "--rollout-queue-run-id", "run-a",
            "--rollout-storage-profile", "juicefs", "--rollout-storage-declaration", "/decl.json",
            "--rollout-queue-segment-mib", "8", "--rollout-io-concurrency", "2",
            "--rollout-queue-lease-seconds", "30", "--rollout-queue-online-gc",
            "--save", "/save", "--save-interval", "2", "--load", "/save", "--ckpt-step", "3",
            "--start-rollout-id", "4", "--save-debug-rollout-data", "/d/r_{rollout_id}.pt",
            "--prompt-data", "/p.jsonl", "--input-key", "q", "--label-key", "a", "--metadata-key", "m",
            "--rollout-shuffle", "--rollout-seed", "7", "--n-samples-per-prompt", "4",
            "--rollout-batch-size", "8", "--global-batch-size", "16", "--micro-batch-size", "2",
            "--use-rollout-routing-replay", "--use-score-centering", "--score-centering-top-k", "5",
            "--rollout-top-p", "1.0", "--reward-key", "acc", "--advantage-estimator", "gspo",
            "--disable-grpo-std-normalization", "--dynamic-sampling-filter-path", "m.f",
        ]
    )  # fmt: skip
    config = from_args(args)
    assert (config.rollout_queue_run_id, config.run_id) == ("run-a", "run-a")
    assert config.rollout_storage_profile == "juicefs" and config.rollout_queue_segment_mib == 8
    assert config.rollout_queue_online_gc and config.rollout_shuffle and config.use_score_centering
    assert (config.ckpt_step, config.start_rollout_id, config.rollout_seed) == (3, 4, 7)
    assert (config.input_key, config.label_key, config.metadata_key) == ("q", "a", "m")
    assert config.grpo_std_normalization is False and config.rewards_normalization is True
    assert config.dynamic_sampling_filter_path == "m.f" and config.advantage_estimator == "gspo"


def test_from_args_reads_framework_identities() -> None:
    namespace = SimpleNamespace(hf_checkpoint="/models/a", num_layers=4, moe_router_topk=2, unrelated=1)
    config = from_args(namespace)
    assert config.identity_extra == {"hf_checkpoint": "/models/a"}
    assert config.plan_extra == {"num_layers": 4, "moe_router_topk": 2}
    namespace.identity_extra = {"extra": 1}
    assert from_args(namespace).identity_extra == {"extra": 1, "hf_checkpoint": "/models/a"}


def test_add_arguments_bad_input() -> None:
    with pytest.raises(TypeError, match=r"argparse.ArgumentParser"):
        add_arguments(SimpleNamespace())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="not one string"):
        add_arguments(argparse.ArgumentParser(), exclude="--save")


# --------------------------------------------------------------------------- archive binding


def write_index(path: Path, root: str, run_id: str, **extra: Any) -> None:
    index = {"format": "straw.rollout-archive", "version": 1, "rollout_id": 0, "evaluation": False}
    index.update(root=root, run_id=run_id, manifest={}, storage_owner="archive:x", samples=1, **extra)
    path.write_text(json.dumps(index))


def test_a_straw_json_replay_template_binds_the_archives_pool(tmp_path: Path) -> None:
    archives = tmp_path / "archives"
    archives.mkdir()
    write_index(archives / "rollout_7.straw.json", "/pools/seven", "run-7")
    write_index(archives / "rollout_8.straw.json", "/pools/eight", "run-8")
    template = str(archives / "rollout_{rollout_id}.straw.json")
    config = config_of(
        load_debug_rollout_data=template, rollout_data_dir="/ignored", rollout_queue_run_id="x"
    )
    bound = resolve_pool(config)
    assert (bound.rollout_data_dir, bound.run_id) == ("/pools/seven", "run-7")  # first sorted match
    assert config.rollout_data_dir == "/ignored"
    eight = resolve_pool(dataclasses.replace(config, start_rollout_id=8))
    assert (eight.rollout_data_dir, eight.run_id) == ("/pools/eight", "run-8")
    assert bind_archive_pool(dataclasses.replace(config, start_rollout_id=8)) == eight
    with pytest.raises(FileNotFoundError, match="No Straw rollout archive matches"):
        resolve_pool(dataclasses.replace(config, start_rollout_id=9))
    missing = config_of(load_debug_rollout_data=str(tmp_path / "none_{rollout_id}.straw.json"))
    with pytest.raises(FileNotFoundError, match=r"No Straw rollout archive matches .*none_\{rollout_id\}"):
        resolve_pool(missing)
    # A .pt replay does not bind anything: the flags' pool applies.
    pt = config_of(load_debug_rollout_data=str(archives / "r_{rollout_id}.pt"), rollout_data_dir="/flags")
    assert resolve_pool(pt).rollout_data_dir == "/flags"


@pytest.mark.parametrize(
    "content",
    [
        "not json",
        json.dumps([1]),
        json.dumps({"format": "other", "version": 1, "root": "/p", "run_id": "r"}),
        json.dumps({"format": "straw.rollout-archive", "version": 2, "root": "/p", "run_id": "r"}),
        json.dumps({"format": "straw.rollout-archive", "version": 1, "root": "relative", "run_id": "r"}),
        json.dumps({"format": "straw.rollout-archive", "version": 1, "root": "/p", "run_id": ""}),
    ],
)
def test_a_bad_archive_index_is_refused(tmp_path: Path, content: str) -> None:
    path = tmp_path / "rollout_0.straw.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=rf"^Unsupported straw rollout archive: {path}$"):
        read_archive_index(path)
    config = config_of(load_debug_rollout_data=str(tmp_path / "rollout_{rollout_id}.straw.json"))
    with pytest.raises(ValueError, match="Unsupported straw rollout archive"):
        resolve_pool(config)
    with pytest.raises(ValueError, match=r"ending in .straw.json"):
        bind_archive_pool(config_of())
