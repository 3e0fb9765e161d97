"""Checkpoints and resume: which state a starting job restores, and the job's own files.

A job is a save directory (``--save``) and the queue it owns, recorded in
``<save>/rollout/job.json``. :func:`resolve_checkpoint` reads the save directory (and only
reads it) and answers a :class:`RestorePlan`: start a ``new`` queue, ``resume`` the job's queue
in place (no joint commit exists yet, ROLLOUT.md section 14.8), or restore a joint commit
(``rollback`` / ``empty``, section 14.7). The controller executes the plan.

This version resolves the cases that need no joint commit: a new job (rule 1), a job without
commits and a legacy model-only directory (rule 7), and the resume checks (rule 10). Joint
commits, their step selection and the rollback procedure R0-R8 are not implemented yet: a
save directory that needs them is refused with :class:`CheckpointUnsupported`, which names what
is missing, and the controller refuses the ``rollback`` / ``empty`` modes the same way through
:func:`begin_rollback` (docs/ROLLOUT.md, "Resume before the first joint commit").
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..protocol import decode, digest, encode
from ..reporting import write_report
from .config import RolloutConfig, resolve_pool
from .dataset import DatasetCursor

__all__ = [
    "MODES",
    "CheckpointUnsupported",
    "RestorePlan",
    "begin_rollback",
    "finish_rollback",
    "initial_configuration",
    "read_job",
    "resolve_checkpoint",
    "rollout_dir",
    "state_token",
    "write_job",
]

log = logging.getLogger("straw.rollout.checkpoint")

#: What a restore plan can ask of the controller (ROLLOUT.md section 14.5).
MODES = ("new", "resume", "rollback", "empty")
JOB_FILE = "job.json"
ROLLBACK_FILE = "rollback.json"
TRACKER_COPY = "tracker.json"
TRACKER = "latest_checkpointed_iteration.txt"
COMMIT_NAME = re.compile(r"^committed_(\d+)\.json$")
DATASET_FILE = "global_dataset_state_dict_{step}.json"
#: The fields of ``job.json``'s ``initial_configuration`` (a resume must match them, rule 10).
CONFIGURATION_FIELDS = (
    "prompt_data",
    "input_key",
    "label_key",
    "metadata_key",
    "n_samples_per_prompt",
    "rollout_seed",
    "rollout_shuffle",
    "rollout_queue_run_id",
    "identity_extra",
)
NEEDS_COMMITS = (
    "joint checkpoint commits (rollout/committed_<K>.json), their step selection and the rollback "
    "procedure R0-R8 of ROLLOUT.md section 14.7 are not implemented by this version of straw.rollout"
)


class CheckpointUnsupported(NotImplementedError):
    """A save directory or restore mode needs joint-commit support this version does not have."""


@dataclasses.dataclass(frozen=True)
class RestorePlan:
    """What a starting controller restores (ROLLOUT.md section 14.5).

    ``state_token`` names the save directory's selection files as they were read; the
    controller recomputes it under the save-directory lock and refuses to start when it
    changed in between.
    """

    mode: str
    save: str | None = None
    step: int | None = None
    queue_id: str = ""
    commit: dict[str, Any] | None = None
    snapshot: dict[str, Any] | None = None
    snapshot_problem: str | None = None
    cursor: dict[str, Any] | None = None
    cursor_source: str | None = None
    initial_step: int | None = None
    state_token: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"RestorePlan.mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if not isinstance(self.queue_id, str) or not self.queue_id.startswith(("run:", "debug:")):
            raise ValueError(
                f"RestorePlan.queue_id names a run:<hex> or debug:<hex> queue, got {self.queue_id!r}"
            )
        if self.cursor is not None:
            DatasetCursor.from_dict(self.cursor)  # a malformed cursor fails here, not at refill
        if self.cursor_source not in (None, "snapshot", "file", "start"):
            raise ValueError(
                f"RestorePlan.cursor_source is snapshot, file, start or None, got {self.cursor_source!r}"
            )


# --------------------------------------------------------------------------- the save directory


def rollout_dir(save: str | os.PathLike[str]) -> Path:
    """``<save>/rollout``: the job's files (lock, job.json, snapshots' index files, markers)."""
    return Path(os.path.abspath(os.path.expanduser(os.fspath(save)))) / "rollout"


def _text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except UnicodeDecodeError:
        return path.read_bytes().hex()


def _commit_names(directory: Path) -> list[str]:
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return sorted(name for name in names if COMMIT_NAME.match(name))


def state_token(save: str | os.PathLike[str] | None) -> str | None:
    """Digest of the files that decide a restore: job, rollback intent, trackers, commit names."""
    if save is None:
        return None
    directory = rollout_dir(save)
    return digest(
        {
            "job": _text(directory / JOB_FILE),
            "rollback": _text(directory / ROLLBACK_FILE),
            "tracker": _text(directory.parent / TRACKER),
            "tracker_copy": _text(directory / TRACKER_COPY),
            "commits": _commit_names(directory),
        }
    )


def _read_json(path: Path, what: str) -> dict[str, Any] | None:
    text = _text(path)
    if text is None:
        return None
    try:
        value = json.loads(text)
    except ValueError as error:
        raise ValueError(f"{what} {path} is not JSON: {error}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{what} {path} is not a JSON object")
    return value


def read_job(save: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The job file of a save directory, or None when the directory holds no job."""
    job = _read_json(rollout_dir(save) / JOB_FILE, "Rollout job file")
    if job is None:
        return None
    if job.get("version") != 1:
        raise ValueError(
            f"Rollout job file {rollout_dir(save) / JOB_FILE} has unsupported version {job.get('version')!r}"
        )
    for key in ("queue_id", "run_id", "pool", "initial_configuration"):
        if key not in job:
            raise ValueError(f"Rollout job file {rollout_dir(save) / JOB_FILE} is missing {key}")
    return job


def initial_configuration(config: RolloutConfig) -> dict[str, Any]:
    """The model and input identity a resume must match (ROLLOUT.md section 14.4 rule 10)."""
    values: dict[str, Any] = {name: getattr(config, name) for name in CONFIGURATION_FIELDS}
    if values["prompt_data"]:
        values["prompt_data"] = os.path.abspath(os.path.expanduser(values["prompt_data"]))
    values["rollout_queue_run_id"] = config.run_id
    values["identity_extra"] = dict(config.identity_extra)
    try:
        return dict(decode(encode(values)))  # canonical JSON: what job.json stores is what we compare
    except (TypeError, ValueError) as error:
        raise ValueError(f"The model/input configuration is not JSON-encodable: {error}") from error


def write_job(config: RolloutConfig, plan: RestorePlan) -> Path:
    """Write ``<save>/rollout/job.json`` for a job starting on ``plan``'s queue (section 17.2)."""
    if plan.save is None:
        raise ValueError("A job file needs --save")
    value = {
        "version": 1,
        "queue_id": plan.queue_id,
        "run_id": config.run_id,
        "pool": config.rollout_data_dir,
        "profile": config.rollout_storage_profile,
        "initial_load": config.load,
        "initial_step": plan.initial_step,
        "initial_configuration": initial_configuration(config),
    }
    return write_report(rollout_dir(plan.save) / JOB_FILE, value)


# --------------------------------------------------------------------------- resolution


def _new_queue_id(replay: bool) -> str:
    return ("debug:" if replay else "run:") + secrets.token_hex(16)


def _tracker_step(save: Path) -> int | None:
    text = _text(save / TRACKER)
    if text is None:
        return None
    try:
        return int(text.strip())
    except ValueError:
        return None  # a non-integer tracker is ignored (rule 4)


def _non_empty_dir(path: Path) -> bool:
    try:
        return path.is_dir() and any(path.iterdir())
    except OSError:
        return False


def resolve_checkpoint(config: RolloutConfig) -> tuple[RolloutConfig, RestorePlan]:
    """Decide what a starting job restores; reads files only and creates nothing.

    Returns a copy of ``config`` with ``load``, ``ckpt_step``, ``start_rollout_id``,
    ``rollout_data_dir`` and ``update_weight_start_version`` set, and the plan.
    """
    if not isinstance(config, RolloutConfig):
        raise TypeError(f"resolve_checkpoint takes a RolloutConfig, got {type(config).__name__}")
    explicit_pool = config.rollout_data_dir
    resolved = resolve_pool(config)
    template = config.load_debug_rollout_data
    replay = template is not None and template.endswith(".straw.json")
    if replay:  # rule 1: a replay's ids come from its archives (the template binds them)
        return resolved, RestorePlan("new", save=None, queue_id=_new_queue_id(True))
    if not config.save:  # rule 1
        start = resolved.start_rollout_id if resolved.start_rollout_id is not None else 0
        plan = RestorePlan("new", save=None, queue_id=_new_queue_id(False))
        return dataclasses.replace(resolved, start_rollout_id=start), plan
    save = Path(os.path.abspath(os.path.expanduser(config.save)))
    token = state_token(save)
    directory = save / "rollout"
    job = read_job(save)
    if config.load is not None:
        load = Path(os.path.abspath(os.path.expanduser(config.load)))
        if COMMIT_NAME.match(load.name):  # rule 2: an explicit commit marker
            raise CheckpointUnsupported(f"--load {config.load} names a joint commit; {NEEDS_COMMITS}")
        if load != save:  # rule 3
            if job is not None:
                raise ValueError(
                    f"--save {save} already holds a rollout job; resume it with --load {save} or without "
                    "--load, or choose a new --save"
                )
            raise CheckpointUnsupported(
                f"--load {config.load} imports another job's models (rule 8); {NEEDS_COMMITS}"
            )
    rollback = _read_json(directory / ROLLBACK_FILE, "Rollback intent file")
    commits = _commit_names(directory)
    if config.ckpt_step is not None or commits or (rollback is not None and not rollback.get("done")):
        what = (
            f"--ckpt-step {config.ckpt_step}" if config.ckpt_step is not None else f"{save} has joint commits"
        )
        raise CheckpointUnsupported(f"{what}; {NEEDS_COMMITS}")
    if job is not None:  # rule 7: a job without commits resumes in place
        return _resume(resolved, explicit_pool, save, job, token)
    legacy = _tracker_step(save)
    if legacy is not None and _non_empty_dir(save / f"iter_{legacy:07d}"):
        return _legacy(resolved, save, legacy, token)
    start = resolved.start_rollout_id if resolved.start_rollout_id is not None else 0
    plan = RestorePlan("new", save=str(save), queue_id=_new_queue_id(False), state_token=token)
    return dataclasses.replace(resolved, start_rollout_id=start), plan


def _resume(
    config: RolloutConfig, explicit_pool: str | None, save: Path, job: Mapping[str, Any], token: str | None
) -> tuple[RolloutConfig, RestorePlan]:
    """Rule 10: the interrupted job's configuration must match; its pool, load and step win."""
    if dict(job["initial_configuration"]) != initial_configuration(config):
        raise ValueError("Initial model/input configuration differs from the interrupted run")
    pool = str(job["pool"])
    if explicit_pool is not None and os.path.abspath(os.path.expanduser(explicit_pool)) != pool:
        raise ValueError("Interrupted run requires its original straw pool")
    step = job.get("initial_step")
    resolved = dataclasses.replace(
        config,
        load=job.get("initial_load"),
        ckpt_step=step,
        rollout_data_dir=pool,
        start_rollout_id=step + 1 if isinstance(step, int) else 0,
        update_weight_start_version=step + 1 if isinstance(step, int) else config.update_weight_start_version,
    )
    plan = RestorePlan(
        "resume",
        save=str(save),
        step=None,
        queue_id=str(job["queue_id"]),
        initial_step=step,
        state_token=token,
    )
    return resolved, plan


def _legacy(
    config: RolloutConfig, save: Path, step: int, token: str | None
) -> tuple[RolloutConfig, RestorePlan]:
    """Rule 7: a model-only directory (tracker and model files, no job) restores as an empty queue."""
    if config.start_rollout_id is not None and config.start_rollout_id != step + 1:
        raise ValueError("--start-rollout-id differs from the checkpoint")
    cursor_file = save / "rollout" / DATASET_FILE.format(step=step)
    found = _read_json(cursor_file, "Dataset cursor file")
    if found is not None:
        cursor, source = DatasetCursor.from_dict(found).asdict(), "file"
        log.warning(
            "%s step %d has no queue snapshot: starting a new empty queue; restore dataset cursor from %s",
            save,
            step,
            cursor_file,
        )
    else:
        cursor, source = DatasetCursor().asdict(), "start"
        log.warning(
            "%s step %d has no queue snapshot: starting a new empty queue; dataset restarts at offset 0 "
            "(not exact data replay)",
            save,
            step,
        )
    resolved = dataclasses.replace(
        config, ckpt_step=step, start_rollout_id=step + 1, update_weight_start_version=step + 1
    )
    plan = RestorePlan(
        "empty",
        save=str(save),
        step=step,
        queue_id=_new_queue_id(False),
        cursor=cursor,
        cursor_source=source,
        initial_step=step,
        state_token=token,
    )
    return resolved, plan


# --------------------------------------------------------------------------- the rollback slot


def begin_rollback(controller: Any, plan: RestorePlan) -> None:
    """Phases R0-R1 of a rollback (intent, configuration check), run before the queue opens.

    Not implemented in this version: a plan asking to restore a joint commit into an existing
    job's queue is refused here, before anything is written.
    """
    raise CheckpointUnsupported(
        f"Restoring step {plan.step} of {plan.save} in mode {plan.mode!r} needs the rollback procedure; "
        f"{NEEDS_COMMITS}"
    )


def finish_rollback(controller: Any, plan: RestorePlan) -> None:
    """Phases R3-R8 of a rollback (fence, cancel, dispose, reissue, files, done); see begin_rollback."""
    raise CheckpointUnsupported(f"Rollback phases R3-R8 are missing; {NEEDS_COMMITS}")
