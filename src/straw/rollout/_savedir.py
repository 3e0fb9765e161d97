"""The files of a save directory that straw reads and writes (ROLLOUT.md section 17.2).

A job is a save directory ``--save``: the caller's model files (``iter_<step:07d>/`` and
other directories, opaque to straw), the tracker ``latest_checkpointed_iteration.txt``, and
straw's own files under ``<save>/rollout/``. Everything here is a small helper over those
files: their names, reading them without creating anything, and writing the job file and the
trackers with ``write_report`` (canonical JSON, atomic and durable, docs/DURABILITY.md D0).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

from ..protocol import decode, digest, encode
from ..reporting import write_report
from .config import RolloutConfig

__all__ = [
    "BUILDER_FILE",
    "COMMIT_FILE",
    "CONFIGURATION_FIELDS",
    "DATASET_FILE",
    "JOB_FILE",
    "QUEUE_FILE",
    "ROLLBACK_FILE",
    "TRACKER",
    "TRACKER_COPY",
    "commit_steps",
    "file_sha256",
    "initial_configuration",
    "model_dir",
    "read_job",
    "read_json",
    "read_text",
    "rollout_dir",
    "rollout_files",
    "state_token",
    "step_files",
    "tracker_step",
    "write_job",
    "write_tracker",
]

JOB_FILE = "job.json"
ROLLBACK_FILE = "rollback.json"
TRACKER_COPY = "tracker.json"
TRACKER = "latest_checkpointed_iteration.txt"
COMMIT_FILE = "committed_{step}.json"
QUEUE_FILE = "queue_state_{step}.json"
BUILDER_FILE = "builder_state_{step}.json"
DATASET_FILE = "global_dataset_state_dict_{step}.json"
COMMIT_NAME = re.compile(r"^committed_(\d+)\.json$")
#: Every per-step file straw writes in ``<save>/rollout/`` (a rollback removes them for later steps).
STEP_FILE = re.compile(r"^(committed|queue_state|builder_state|global_dataset_state_dict)_(\d+)\.json$")
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
#: Files straw reads in a save directory are small JSON documents; anything larger is not one.
SAVE_FILE_BYTES_MAX = 16 << 20


def _absolute(path: str | os.PathLike[str]) -> Path:
    return Path(os.path.abspath(os.path.expanduser(os.fspath(path))))


def rollout_dir(save: str | os.PathLike[str]) -> Path:
    """``<save>/rollout``: the job's files (lock, job.json, snapshots' index files, markers)."""
    return _absolute(save) / "rollout"


def model_dir(save: str | os.PathLike[str], step: int, sub: str = "") -> Path:
    """Where a framework saves the model files of ``step``: ``<save>/<sub>/iter_<step:07d>``."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative integer, got {step!r}")
    if not isinstance(sub, str) or os.path.isabs(sub) or ".." in Path(sub).parts:
        raise ValueError(f"sub is a relative directory inside --save, got {sub!r}")
    base = _absolute(save)
    return (base / sub if sub else base) / f"iter_{step:07d}"


def rollout_files(step: int) -> tuple[str, str, str]:
    """The rollout files of a step's checkpoint, relative to ``<save>/rollout``."""
    return (QUEUE_FILE.format(step=step), BUILDER_FILE.format(step=step), DATASET_FILE.format(step=step))


def read_text(path: Path) -> str | None:
    """A file's text (None when absent); undecodable bytes come back as hex, never raise."""
    try:
        with open(path, "rb") as handle:
            data = handle.read(SAVE_FILE_BYTES_MAX + 1)
    except FileNotFoundError:
        return None
    except IsADirectoryError:
        return "<a directory>"
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return data.hex()


def read_json(path: Path, what: str) -> dict[str, Any] | None:
    """A JSON object file, None when absent; ``ValueError`` naming ``what`` when it is not one."""
    text = read_text(path)
    if text is None:
        return None
    try:
        value = json.loads(text)
    except ValueError as error:
        raise ValueError(f"{what} {path} is not JSON: {error}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{what} {path} is not a JSON object")
    return value


def file_sha256(path: Path) -> str:
    """SHA-256 of a file's bytes, read in bounded chunks."""
    hasher = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            hasher.update(chunk)
    return hasher.hexdigest()


def commit_steps(directory: Path) -> list[int]:
    """The steps of the ``committed_<K>.json`` markers in a rollout directory, ascending."""
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(int(m.group(1)) for name in names if (m := COMMIT_NAME.match(name)))


def step_files(directory: Path) -> list[tuple[int, Path]]:
    """Every per-step file straw wrote in a rollout directory, as ``(step, path)``."""
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted((int(m.group(2)), directory / name) for name in names if (m := STEP_FILE.match(name)))


def state_token(save: str | os.PathLike[str] | None) -> str | None:
    """Digest of the files that decide a restore: job, rollback intent, trackers, commit names."""
    if save is None:
        return None
    directory = rollout_dir(save)
    return digest(
        {
            "job": read_text(directory / JOB_FILE),
            "rollback": read_text(directory / ROLLBACK_FILE),
            "tracker": read_text(directory.parent / TRACKER),
            "tracker_copy": read_text(directory / TRACKER_COPY),
            "commits": [COMMIT_FILE.format(step=k) for k in commit_steps(directory)],
        }
    )


def read_job(save: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The job file of a save directory, or None when the directory holds no job."""
    path = rollout_dir(save) / JOB_FILE
    job = read_json(path, "Rollout job file")
    if job is None:
        return None
    if job.get("version") != 1:
        raise ValueError(f"Rollout job file {path} has unsupported version {job.get('version')!r}")
    for key in ("queue_id", "run_id", "pool", "initial_configuration"):
        if key not in job:
            raise ValueError(f"Rollout job file {path} is missing {key}")
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


def write_job(config: RolloutConfig, plan: Any) -> Path:
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


def tracker_step(save: Path) -> int | None:
    """The tracker's stripped integer, or None (absent or not an integer: ignored, rule 4)."""
    text = read_text(save / TRACKER)
    if text is None:
        return None
    try:
        return int(text.strip())
    except ValueError:
        return None


def write_tracker(save: Path, step: int) -> None:
    """Write the tracker (``<step>\\n``), then ``tracker.json`` naming that text, in this order.

    A crash between the two leaves a tracker that differs from ``tracker.json``'s copy, which
    resolution reads as "not edited by the user" only when it is the newest commit (rule 4).
    """
    write_report(save / TRACKER, step)
    write_report(rollout_dir(save) / TRACKER_COPY, {"version": 1, "text": f"{step}\n"})


def tracker_copy(save: Path) -> str | None:
    """The tracker text straw last wrote (``tracker.json``), or None."""
    try:
        found = read_json(rollout_dir(save) / TRACKER_COPY, "Tracker copy")
    except ValueError:
        return None
    text = (found or {}).get("text")
    return text if isinstance(text, str) else None
