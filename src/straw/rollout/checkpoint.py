"""Joint checkpoints and resume: what a checkpoint commits and which state a starting job restores.

A *joint commit* of step K is ``<save>/rollout/committed_K.json``, written only after K's model
files and its rollout files (the queue snapshot index, the builder state and the dataset
cursor) are durable, and naming each of them with its size (and a SHA-256 for small files):
:func:`save_checkpoint` drives a whole checkpoint, :func:`commit_checkpoint` writes the marker.

A starting job asks :func:`resolve_checkpoint`, which only reads the save directory, for a
:class:`RestorePlan`: a ``new`` queue, ``resume`` of a job that has no commit yet (ROLLOUT.md
section 14.8), or a restore of step K into the job's own queue, in place: ``rollback`` from K's
joint commit, or ``empty`` from a model-only step. The controller executes the plan; the
rollback procedure R0-R8 lives in ``straw.rollout._rollback`` (section 14.7).

Model files are opaque: straw syncs and fingerprints them, and never deletes or rewrites them.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from ..reporting import sync_tree, write_report
from ._savedir import (
    BUILDER_FILE,
    COMMIT_FILE,
    COMMIT_NAME,
    CONFIGURATION_FIELDS,
    DATASET_FILE,
    JOB_FILE,
    QUEUE_FILE,
    ROLLBACK_FILE,
    TRACKER,
    TRACKER_COPY,
    commit_steps,
    file_sha256,
    initial_configuration,
    model_dir,
    read_job,
    read_json,
    read_text,
    rollout_dir,
    rollout_files,
    state_token,
    tracker_copy,
    tracker_step,
    write_job,
    write_tracker,
)
from .config import RolloutConfig, resolve_pool
from .dataset import DatasetCursor

__all__ = [
    "CONFIGURATION_FIELDS",
    "DATASET_FILE",
    "JOB_FILE",
    "MODES",
    "ROLLBACK_FILE",
    "TRACKER",
    "TRACKER_COPY",
    "ModelSave",
    "RestorePlan",
    "begin_rollback",
    "commit_checkpoint",
    "finish_rollback",
    "initial_configuration",
    "model_dir",
    "read_commit",
    "read_job",
    "resolve_checkpoint",
    "rollout_dir",
    "save_checkpoint",
    "state_token",
    "write_job",
]

log = logging.getLogger("straw.rollout.checkpoint")

#: What a restore plan can ask of the controller (ROLLOUT.md section 14.5).
MODES = ("new", "resume", "rollback", "empty")
#: Model files whose content is fingerprinted (SHA-256) besides their size: the small index
#: and metadata files a framework rewrites when it saves again (``*.json``, ``.metadata``).
HASHED_SUFFIXES = (".json", ".metadata")
INCOMPATIBLE = "Checkpoint is incompatible or omitted optimizer/RNG state: {marker}"


# --------------------------------------------------------------------------- model saves


@dataclasses.dataclass(frozen=True)
class ModelSave:
    """Model files a framework saved for a step: a directory (or file) inside ``--save``.

    ``resumable=False`` marks a save that omitted optimizer or RNG state (a restore refuses
    it); ``required`` lists files, relative to ``path``, that must exist.
    """

    path: str
    resumable: bool = dataclasses.field(default=True, kw_only=True)
    required: tuple[str, ...] = dataclasses.field(default=(), kw_only=True)

    def __post_init__(self) -> None:
        if not isinstance(self.path, (str, os.PathLike)):
            raise TypeError(f"ModelSave.path is a path, got {type(self.path).__name__}")
        object.__setattr__(self, "path", os.fspath(self.path))
        if not isinstance(self.resumable, bool):
            raise TypeError("ModelSave.resumable is a bool")
        given: object = self.required
        if isinstance(given, str) or not isinstance(given, Iterable):
            raise TypeError("ModelSave.required is a sequence of relative file names, not one string")
        required = tuple(given)
        for name in required:
            if not isinstance(name, str) or not name or os.path.isabs(name) or ".." in Path(name).parts:
                raise ValueError(f"ModelSave.required holds relative file names, got {name!r}")
        object.__setattr__(self, "required", required)


def _save_dir(config: RolloutConfig, what: str) -> Path:
    if not isinstance(config, RolloutConfig):
        raise TypeError(f"{what} takes a RolloutConfig, got {type(config).__name__}")
    if not config.save:
        raise ValueError(f"{what} needs --save")
    return Path(os.path.abspath(os.path.expanduser(config.save)))


def _check_step(step: object) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative integer, got {step!r}")
    return step


def _models(models: object) -> list[ModelSave]:
    if isinstance(models, ModelSave):
        return [models]
    if isinstance(models, (str, bytes, os.PathLike)) or not isinstance(models, Iterable):
        raise TypeError(f"models= is a ModelSave or a list of them, got {type(models).__name__}")
    found = list(models)
    for model in found:
        if not isinstance(model, ModelSave):
            raise TypeError(f"models= holds ModelSave values, got {type(model).__name__}")
    return found


def _inside(path: Path, save: Path) -> bool:
    real, base = Path(os.path.realpath(path)), Path(os.path.realpath(save))
    return (path == save or save in path.parents) and (real == base or base in real.parents)


def _walk(path: Path) -> list[Path]:
    """The regular files below ``path`` (or ``path`` itself); a symlink anywhere is refused."""
    if path.is_symlink():
        raise ValueError(f"Checkpoint payload must not be a symlink: {path}")
    if path.is_file():
        return [path]
    files: list[Path] = []
    for directory, subdirectories, names in os.walk(path):
        for name in sorted(subdirectories) + sorted(names):
            entry = Path(directory) / name
            if entry.is_symlink():
                raise ValueError(f"Checkpoint payload must not be a symlink: {entry}")
            if name in names:
                files.append(entry)
    return files


def _model_files(save: Path, model: ModelSave) -> dict[str, dict[str, Any]]:
    """Check, sync and fingerprint one model save: ``{path relative to --save: {size, sha256?}}``."""
    given = Path(os.path.expanduser(model.path))
    path = Path(os.path.abspath(given if given.is_absolute() else save / given))
    if not _inside(path, save) or path == save:
        raise ValueError(f"Model checkpoint must be inside --save: {path}")
    if not path.exists() and not path.is_symlink():
        raise ValueError(f"Missing model checkpoint payloads: {path}")
    files = _walk(path)
    if not files or all(f.stat().st_size == 0 for f in files):
        raise ValueError(f"Missing model checkpoint payloads: {path}")
    for name in model.required:
        if not (path / name).is_file():
            raise ValueError(f"Missing required model checkpoint file: {path / name}")
    sync_tree(path)  # D0b, K1 (4): the files are durable before the marker names them (I17)
    recorded: dict[str, dict[str, Any]] = {}
    for file in files:
        entry: dict[str, Any] = {"size": file.stat().st_size}
        if file.name.endswith(HASHED_SUFFIXES):
            entry["sha256"] = file_sha256(file)
        recorded[file.relative_to(save).as_posix()] = entry
    return recorded


def _rollout_entry(path: Path) -> dict[str, Any]:
    return {"size": path.stat().st_size, "sha256": file_sha256(path)}


def commit_checkpoint(
    config: RolloutConfig,
    step: int,
    *,
    models: ModelSave | Iterable[ModelSave],
    weight_version: int | str | None = None,
    require_rollout: bool = True,
) -> Path | None:
    """Write the joint commit marker of ``step`` once its model and rollout files are durable.

    Returns the marker's path, or None for a model-only checkpoint (``require_rollout=False``
    and the rollout files are absent: a warning, no marker). The tracker is written after
    the marker, then ``tracker.json`` (ROLLOUT.md section 14.2).
    """
    save = _save_dir(config, "commit_checkpoint")
    step = _check_step(step)
    directory = rollout_dir(save)
    marker = directory / COMMIT_FILE.format(step=step)
    if os.path.lexists(marker):
        raise FileExistsError(f"Committed checkpoints are immutable: {marker}")
    saves = _models(models)
    files: dict[str, dict[str, Any]] = {}
    for model in saves:
        files.update(_model_files(save, model))
    for name in rollout_files(step):
        path = directory / name
        if not path.is_file():
            if require_rollout:
                raise FileNotFoundError(f"Missing rollout checkpoint file: {path}")
            log.warning(
                "Step %d of %s has no rollout files: a model-only checkpoint, no joint commit", step, save
            )
            return None
        files[f"rollout/{name}"] = _rollout_entry(path)
    queue_state = read_json(directory / QUEUE_FILE.format(step=step), "Queue checkpoint") or {}
    job = read_job(save) or {}
    pool = config.rollout_data_dir or resolve_pool(config).rollout_data_dir
    value = {
        "version": 1,
        "rollout_id": step,
        "files": files,
        "resumable": all(model.resumable for model in saves),
        "weight_version": step + 1 if weight_version is None else weight_version,
        "rollout_data_dir": os.path.abspath(os.path.expanduser(str(pool))),
        "run_id": queue_state.get("run_id", config.run_id),
        "queue_id": queue_state.get("queue_id", job.get("queue_id")),
    }
    write_report(marker, value)  # K1 (5): every file it names is durable (I17)
    write_tracker(save, step)  # K1 (6), after the marker: a crash in between still selects it (rule 4)
    return marker


def save_checkpoint(
    config: RolloutConfig,
    step: int,
    *,
    save_models: Callable[[], ModelSave | Iterable[ModelSave]],
    source: Any,
    builder: Any,
    runner: Any = None,
    weight_version: int | str | None = None,
) -> Path | None:
    """Save checkpoint ``step``: models, then the data source and the builder, then the commit.

    Refuses a committed step before anything is saved. Admission is paused around the data
    source's snapshot when a runner is given. Any exception stops the later steps, so no
    marker exists unless every step returned. A replay job writes no rollout files and gets a
    model-only checkpoint (None).
    """
    save = _save_dir(config, "save_checkpoint")
    step = _check_step(step)
    marker = rollout_dir(save) / COMMIT_FILE.format(step=step)
    if os.path.lexists(marker):
        raise FileExistsError(f"Refusing to overwrite a committed straw checkpoint: {marker}")
    models = _models(save_models())
    was_paused = bool(runner.pause_admission()) if runner is not None else True
    try:
        written = source.save(step)
        builder.save(step)
    finally:
        if runner is not None:
            runner.resume_admission(was_paused)
    return commit_checkpoint(
        config, step, models=models, weight_version=weight_version, require_rollout=written is not None
    )


def read_commit(path: str | os.PathLike[str], step: int | None = None) -> dict[str, Any] | None:
    """A joint commit marker: ``path`` names a marker file, or a save directory and ``step``.

    With a save directory and no step, the newest commit. None when there is none; a marker
    that is not a version 1 commit of its step raises the restore error (rule 5).
    """
    where = Path(os.path.abspath(os.path.expanduser(os.fspath(path))))
    match = COMMIT_NAME.match(where.name)
    if match is not None and not where.is_dir():
        marker, step = where, int(match.group(1))
    else:
        if step is None:
            steps = commit_steps(rollout_dir(where))
            if not steps:
                return None
            step = steps[-1]
        marker = rollout_dir(where) / COMMIT_FILE.format(step=_check_step(step))
    value = read_json(marker, "Checkpoint marker")
    if value is None:
        return None
    _check_marker(value, step, marker)
    return value


def _check_marker(marker: Mapping[str, Any], step: int, where: Path) -> None:
    if (
        marker.get("version") != 1
        or marker.get("rollout_id") != step
        or marker.get("resumable") is not True
        or not isinstance(marker.get("files"), Mapping)
    ):
        raise ValueError(INCOMPATIBLE.format(marker=where))


# --------------------------------------------------------------------------- the restore plan


@dataclasses.dataclass(frozen=True)
class RestorePlan:
    """What a starting controller restores (ROLLOUT.md section 14.5).

    ``snapshot`` is the parsed ``queue_state_<step>.json`` when that file is intact (its
    inline producer copy is a cursor source even when the snapshot is unusable);
    ``snapshot_problem`` says why the queue cannot be restored from it (then it restarts
    empty at ``cursor``). ``state_token`` names the save directory's selection files as
    they were read; the controller recomputes it under the save-directory lock and refuses
    to start when it changed in between.
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
        if self.mode in ("rollback", "empty") and not isinstance(self.step, int):
            raise ValueError(f"A {self.mode} plan names the step it restores")


def _new_queue_id(replay: bool) -> str:
    return ("debug:" if replay else "run:") + secrets.token_hex(16)


def _non_empty_dir(path: Path) -> bool:
    try:
        return path.is_dir() and any(path.iterdir())
    except OSError:
        return False


def _select_step(directory: Path, explicit: int | None, commit: int | None, *, in_place: bool) -> int | None:
    """Rule 4: the commit file's step, ``--ckpt-step``, an unfinished rollback's, an edited
    tracker older than the newest commit, else the newest commit (None without any)."""
    if commit is not None:
        return commit
    if explicit is not None:
        return explicit
    if in_place:
        rollback = read_json(rollout_dir(directory) / ROLLBACK_FILE, "Rollback intent file")
        if rollback is not None and rollback.get("done") is False:
            step = rollback.get("step")
            if isinstance(step, int) and not isinstance(step, bool) and step >= 0:
                return step
    commits = commit_steps(rollout_dir(directory))
    tracker = tracker_step(directory)
    edited = read_text(directory / TRACKER) != tracker_copy(directory)
    if tracker is not None and commits and edited and tracker < commits[-1]:
        return tracker
    return commits[-1] if commits else None


def resolve_checkpoint(config: RolloutConfig) -> tuple[RolloutConfig, RestorePlan]:
    """Decide what a starting job restores; reads files only and creates nothing.

    Returns a copy of ``config`` with ``load``, ``ckpt_step``, ``start_rollout_id``,
    ``rollout_data_dir`` and ``update_weight_start_version`` set, and the plan (section 14.4).
    """
    if not isinstance(config, RolloutConfig):
        raise TypeError(f"resolve_checkpoint takes a RolloutConfig, got {type(config).__name__}")
    explicit_pool = config.rollout_data_dir
    resolved = resolve_pool(config)
    template = config.load_debug_rollout_data
    if template is not None and template.endswith(".straw.json"):  # rule 1: a replay
        return resolved, RestorePlan("new", save=None, queue_id=_new_queue_id(True))
    if not config.save:  # rule 1
        start = resolved.start_rollout_id if resolved.start_rollout_id is not None else 0
        plan = RestorePlan("new", save=None, queue_id=_new_queue_id(False))
        return dataclasses.replace(resolved, start_rollout_id=start), plan
    save = Path(os.path.abspath(os.path.expanduser(config.save)))
    token = state_token(save)
    job = read_job(save)
    commit: int | None = None
    if config.load is not None:
        load = Path(os.path.abspath(os.path.expanduser(config.load)))
        match = COMMIT_NAME.match(load.name)
        if match is not None:  # rule 2: an explicit commit marker
            commit = int(match.group(1))
            if config.ckpt_step is not None and config.ckpt_step != commit:
                raise ValueError("--ckpt-step differs from the explicit checkpoint marker")
            load = load.parent.parent
        if load != save:  # rule 3
            if job is not None:
                raise ValueError(
                    f"--save {save} already holds a rollout job; resume it with --load {save} or without "
                    "--load, or choose a new --save"
                )
            return _import(resolved, save, load, commit, token)
    step = _select_step(save, config.ckpt_step, commit, in_place=True)
    if step is None:  # rule 7
        if job is not None:
            return _resume(resolved, explicit_pool, save, job, token)
        legacy = tracker_step(save)
        if legacy is not None and _non_empty_dir(model_dir(save, legacy)):
            return _restore(resolved, explicit_pool, save, None, legacy, token)
        start = resolved.start_rollout_id if resolved.start_rollout_id is not None else 0
        plan = RestorePlan("new", save=str(save), queue_id=_new_queue_id(False), state_token=token)
        return dataclasses.replace(resolved, start_rollout_id=start), plan
    return _restore(resolved, explicit_pool, save, job, step, token)


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
        "resume", save=str(save), queue_id=str(job["queue_id"]), initial_step=step, state_token=token
    )
    return resolved, plan


# --------------------------------------------------------------------------- a step's state


@dataclasses.dataclass
class _StepState:
    """What the files of one step offer a restore: the commit, the snapshot, the cursor."""

    commit: dict[str, Any] | None = None
    snapshot: dict[str, Any] | None = None
    problem: str | None = None
    cursor: dict[str, Any] | None = None
    source: str = "start"
    cursor_file: Path | None = None


def _check_components(directory: Path, marker: Mapping[str, Any]) -> None:
    """Every model file a marker lists exists with its recorded size (and hash)."""
    for name, entry in sorted(marker["files"].items()):
        if str(name).startswith("rollout/"):
            continue
        problem = _component_problem(directory, str(name), entry)
        if problem == "missing":
            raise FileNotFoundError(f"Checkpoint component missing: {name}")
        if problem is not None:
            raise ValueError(f"Checkpoint component changed: {name}")


def _component_problem(directory: Path, name: str, entry: Any) -> str | None:
    path = directory / name
    if not path.is_file() or path.is_symlink():
        return "missing"
    if not isinstance(entry, Mapping) or path.stat().st_size != entry.get("size"):
        return "changed"
    if "sha256" in entry and file_sha256(path) != entry["sha256"]:
        return "changed"
    return None


def _cursor_of(value: Any) -> dict[str, Any] | None:
    try:
        return DatasetCursor.from_dict(value).asdict()
    except (ValueError, TypeError):
        return None


def _step_state(directory: Path, step: int, job: Mapping[str, Any] | None) -> _StepState:
    """Rule 5's rollout half: which of the step's rollout files can be trusted, and the cursor.

    A listed rollout file that is missing, changed, of another version or of another queue
    makes the snapshot unusable (never an error); the cursor then comes from the intact
    ``queue_state`` file's inline copy, else the cursor file, else the start.
    """
    state = _StepState()
    marker_path = rollout_dir(directory) / COMMIT_FILE.format(step=step)
    state.commit = read_json(marker_path, "Checkpoint marker")
    files: Mapping[str, Any] = state.commit["files"] if state.commit is not None else {}
    problems: list[str] = []
    trusted: dict[str, bool] = {}
    for name in rollout_files(step):
        key = f"rollout/{name}"
        if key not in files:
            problems.append(f"{key} is not in the commit")
            trusted[name] = False
            continue
        problem = _component_problem(directory, key, files[key])
        trusted[name] = problem is None
        if problem is not None:
            problems.append(f"{key} is {problem}")
    queue_name, _, dataset_name = rollout_files(step)
    if trusted[queue_name]:
        snapshot = read_json(rollout_dir(directory) / queue_name, "Queue checkpoint")
        producer = (snapshot or {}).get("producer") or {}
        cursor = _cursor_of(producer.get("cursor")) if isinstance(producer, Mapping) else None
        if snapshot is None or snapshot.get("version") != 1 or snapshot.get("step") != step or cursor is None:
            problems.append(f"rollout/{queue_name} is not a version 1 queue checkpoint of step {step}")
        else:
            state.snapshot, state.cursor, state.source = snapshot, cursor, "snapshot"
            if job is not None and snapshot.get("queue_id") != job.get("queue_id"):
                problems.append(
                    f"the snapshot names queue {snapshot.get('queue_id')}, the job {job.get('queue_id')}"
                )
    if state.cursor is None and trusted[dataset_name]:
        state.cursor_file = rollout_dir(directory) / dataset_name
        found = _cursor_of(read_json(state.cursor_file, "Dataset cursor file"))
        if found is not None:
            state.cursor, state.source = found, "file"
    if state.cursor is None:
        state.cursor, state.source = DatasetCursor().asdict(), "start"
    state.problem = "; ".join(problems) or None
    return state


def cursor_origin(plan_source: str | None, save: str | None, step: int | None) -> str:
    """How a warning names where the cursor of an empty restart comes from."""
    if plan_source == "snapshot":
        return f"the inline copy in queue_state_{step}.json"
    if plan_source == "file" and save is not None:
        return str(rollout_dir(save) / DATASET_FILE.format(step=step))
    return "the start (offset 0; not exact data replay)"


def _legacy_cursor(directory: Path, step: int) -> tuple[dict[str, Any], str, Path]:
    path = rollout_dir(directory) / DATASET_FILE.format(step=step)
    try:
        found = _cursor_of(read_json(path, "Dataset cursor file"))
    except ValueError:
        found = None
    if found is not None:
        return found, "file", path
    return DatasetCursor().asdict(), "start", path


def _check_start(config: RolloutConfig, step: int) -> None:
    if config.start_rollout_id is not None and config.start_rollout_id != step + 1:
        raise ValueError("--start-rollout-id differs from the checkpoint")


def _restore(
    config: RolloutConfig,
    explicit_pool: str | None,
    save: Path,
    job: Mapping[str, Any] | None,
    step: int,
    token: str | None,
) -> tuple[RolloutConfig, RestorePlan]:
    """Rules 5, 6 and 9 in place: a rollback to a joint commit, or an empty queue at a model step."""
    marker_path = rollout_dir(save) / COMMIT_FILE.format(step=step)
    if not marker_path.is_file():
        return _empty(config, explicit_pool, save, job, step, token)
    state = _step_state(save, step, job)
    marker = state.commit
    if marker is None:  # pragma: no cover - checked above; a race with a rollback's R7
        raise FileNotFoundError(f"No committed model/rollout checkpoint for step {step} in {save}")
    _check_marker(marker, step, marker_path)
    _check_components(save, marker)
    _check_start(config, step)
    if marker.get("run_id") != config.run_id:
        raise ValueError("Checkpoint belongs to another straw run")
    pool, problem = _restore_pool(
        explicit_pool, str(marker.get("rollout_data_dir") or config.rollout_data_dir)
    )
    if problem is not None:
        state.problem = "; ".join(p for p in (state.problem, problem) if p)
    queue_id = str(job["queue_id"]) if job is not None else str(marker.get("queue_id"))
    if state.problem is not None:
        log.warning(
            "Checkpoint step %d has no usable queue snapshot (%s): the queue restarts empty; "
            "dataset cursor from %s",
            step,
            state.problem,
            cursor_origin(state.source, str(save), step),
        )
    weight = marker.get("weight_version")
    resolved = dataclasses.replace(
        config,
        load=str(save),
        ckpt_step=step,
        start_rollout_id=step + 1,
        rollout_data_dir=pool,
        update_weight_start_version=weight if isinstance(weight, int) else step + 1,
    )
    plan = RestorePlan(
        "rollback",
        save=str(save),
        step=step,
        queue_id=queue_id,
        commit=dict(marker),
        snapshot=state.snapshot,
        snapshot_problem=state.problem,
        cursor=state.cursor,
        cursor_source=state.source,
        initial_step=(job or {}).get("initial_step"),
        state_token=token,
    )
    return resolved, plan


def _restore_pool(explicit: str | None, recorded: str) -> tuple[str, str | None]:
    """Rule 9's pool: the recorded one; an explicit other one only when the recorded one is gone."""
    recorded = os.path.abspath(os.path.expanduser(recorded))
    if explicit is None:
        return recorded, None
    chosen = os.path.abspath(os.path.expanduser(explicit))
    if chosen == recorded:
        return recorded, None
    if os.path.isdir(recorded):
        raise ValueError("Checkpoint restoration requires the original shared straw pool")
    log.warning("The checkpoint's pool %s is gone: restoring into %s without its queue", recorded, chosen)
    return chosen, f"its pool {recorded} is gone"


def _empty(
    config: RolloutConfig,
    explicit_pool: str | None,
    save: Path,
    job: Mapping[str, Any] | None,
    step: int,
    token: str | None,
) -> tuple[RolloutConfig, RestorePlan]:
    """Rule 6: a step without a commit restores an empty queue only from model files alone."""
    directory = rollout_dir(save)
    if any((directory / name.format(step=step)).exists() for name in (QUEUE_FILE, BUILDER_FILE)):
        raise ValueError(
            "Queue snapshot exists without a complete joint commit; refusing empty-queue fallback: "
            f"step {step}"
        )
    if not _non_empty_dir(model_dir(save, step)):
        raise FileNotFoundError(f"No committed model/rollout checkpoint for step {step} in {save}")
    _check_start(config, step)
    if job is not None and job.get("run_id") != config.run_id:
        raise ValueError("Checkpoint belongs to another straw run")
    cursor, source, path = _legacy_cursor(save, step)
    if source == "file":
        log.warning(
            "%s step %d has no queue snapshot: starting a new empty queue; restore dataset cursor from %s",
            save,
            step,
            path,
        )
    else:
        log.warning(
            "%s step %d has no queue snapshot: starting a new empty queue; dataset restarts at offset 0 "
            "(not exact data replay)",
            save,
            step,
        )
    pool = config.rollout_data_dir
    problem = None
    if job is not None:
        pool, problem = _restore_pool(explicit_pool, str(job["pool"]))
    resolved = dataclasses.replace(
        config,
        load=str(save),
        ckpt_step=step,
        start_rollout_id=step + 1,
        rollout_data_dir=pool,
        update_weight_start_version=step + 1,
    )
    plan = RestorePlan(
        "empty",
        save=str(save),
        step=step,
        queue_id=str(job["queue_id"]) if job is not None else _new_queue_id(False),
        snapshot_problem=problem or "the step has no joint commit",
        cursor=cursor,
        cursor_source=source,
        initial_step=job.get("initial_step") if job is not None else step,
        state_token=token,
    )
    return resolved, plan


def _import(
    config: RolloutConfig, save: Path, load: Path, commit: int | None, token: str | None
) -> tuple[RolloutConfig, RestorePlan]:
    """Rule 8: models of another directory start a new job (its queue is not resumed).

    The step is chosen in the load directory by rules 2 and 4-6 (without the rollback
    rule); the new queue starts at that step's dataset cursor. The load directory is only
    read.
    """
    step = _select_step(load, config.ckpt_step, commit, in_place=False)
    if step is None:
        legacy = tracker_step(load)
        if legacy is not None and _non_empty_dir(model_dir(load, legacy)):
            step = legacy
    if step is None:
        raise FileNotFoundError(f"No committed model/rollout checkpoint in {load}")
    marker_path = rollout_dir(load) / COMMIT_FILE.format(step=step)
    weight: Any = step + 1
    if marker_path.is_file():
        state = _step_state(load, step, None)
        marker = state.commit or {}
        _check_marker(marker, step, marker_path)
        _check_components(load, marker)
        cursor, source = state.cursor, state.source
        weight = marker.get("weight_version", weight)
    else:
        directory = rollout_dir(load)
        if any((directory / name.format(step=step)).exists() for name in (QUEUE_FILE, BUILDER_FILE)):
            raise ValueError(
                "Queue snapshot exists without a complete joint commit; refusing empty-queue fallback: "
                f"step {step}"
            )
        if not _non_empty_dir(model_dir(load, step)):
            raise FileNotFoundError(f"No committed model/rollout checkpoint for step {step} in {load}")
        cursor, source, _ = _legacy_cursor(load, step)
    _check_start(config, step)
    log.warning(
        "--load %s is another job: its step %d models are imported and its queue is not resumed; "
        "the new queue starts at its dataset cursor (%s)",
        load,
        step,
        cursor_origin(source, str(load), step),
    )
    resolved = dataclasses.replace(
        config,
        load=str(load),
        ckpt_step=step,
        start_rollout_id=step + 1,
        update_weight_start_version=weight if isinstance(weight, int) else step + 1,
    )
    plan = RestorePlan(
        "new",
        save=str(save),
        queue_id=_new_queue_id(False),
        cursor=cursor,
        cursor_source=source,
        initial_step=step,
        state_token=token,
    )
    return resolved, plan


# --------------------------------------------------------------------------- the rollback


def begin_rollback(controller: Any, plan: RestorePlan) -> None:
    """Phases R0-R2's preparation (intent, configuration check, a lost queue) before the queue opens."""
    from . import _rollback

    _rollback.begin(controller, plan)


def finish_rollback(controller: Any, plan: RestorePlan) -> None:
    """Phases R3-R8 (fence, cancel, dispose, reissue, files, done) once the queue is open."""
    from . import _rollback

    _rollback.finish(controller, plan)
