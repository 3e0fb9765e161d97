"""``straw inspect --save DIR``: a save directory's joint commits and what a restart would pick.

Read-only. For each ``rollout/committed_<K>.json`` it shows the step, whether its files are
intact (model files and rollout files, by size and hash), the bytes its checkpoint owners keep
in the pool (every pack they reach, and the part no other owner reaches: what releasing the
checkpoint could free), and which step ``resolve_checkpoint`` would select for a restart in
place, with the mode and why, so an operator sees what will happen before restarting.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ..rollout import _savedir as savedir
from ..rollout.checkpoint import resolve_checkpoint
from ..rollout.config import RolloutConfig
from .catalog_view import read_catalog
from .layout import NotAPool, list_pool, open_pool
from .render import size, table

__all__ = ["inspect_save", "render_save"]


def _files_state(save: Path, commit: dict[str, Any]) -> tuple[str, str]:
    """(model files state, rollout files state): ``ok``, or what is missing or changed."""
    states = {"model": [], "rollout": []}  # type: dict[str, list[str]]
    for name, entry in sorted((commit.get("files") or {}).items()):
        kind = "rollout" if str(name).startswith("rollout/") else "model"
        path = save / name
        if not path.is_file():
            states[kind].append(f"{name} missing")
        elif path.stat().st_size != entry.get("size") or (
            "sha256" in entry and savedir.file_sha256(path) != entry["sha256"]
        ):
            states[kind].append(f"{name} changed")
    return tuple("ok" if not problems else "; ".join(problems) for problems in states.values())  # type: ignore[return-value]


def _owners_of(directory: Path, step: int) -> list[str]:
    found = []
    for name in (savedir.QUEUE_FILE, savedir.BUILDER_FILE):
        try:
            value = savedir.read_json(directory / name.format(step=step), "Checkpoint file")
        except ValueError:
            value = None
        owner = (value or {}).get("storage_owner")
        if isinstance(owner, str):
            found.append(owner)
    return found


def _retention(pool: str | None) -> tuple[dict[str, set[str]], dict[str, int], str | None]:
    """The catalog's owners and their packs, the packs' sizes, or why the pool cannot be read."""
    if pool is None:
        return {}, {}, "no pool recorded"
    try:
        root = open_pool(pool)
    except NotAPool as error:
        return {}, {}, str(error)
    view, _ = read_catalog(root)
    sizes = {p.path: p.size for p in list_pool(root).packs}
    return {k: set(v) for k, v in view.state.owners.items()}, sizes, None


def _config_of(save: Path, job: dict[str, Any] | None, ckpt_step: int | None) -> RolloutConfig:
    """A configuration like the job's own (its recorded model/input identity and pool)."""
    values: dict[str, Any] = {"save": str(save), "save_interval": 1, "ckpt_step": ckpt_step}
    if job is not None:
        initial = dict(job.get("initial_configuration") or {})
        for name in savedir.CONFIGURATION_FIELDS:
            if name in initial and name != "rollout_queue_run_id":
                values[name] = initial[name]
        values["rollout_queue_run_id"] = job.get("run_id")
        values["rollout_storage_profile"] = job.get("profile") or "local"
    return RolloutConfig(**values)


def _selection(save: Path, job: dict[str, Any] | None, ckpt_step: int | None) -> dict[str, Any]:
    try:
        resolved, plan = resolve_checkpoint(_config_of(save, job, ckpt_step))
    except Exception as error:  # what a restart would fail with is the answer here
        return {"error": f"{type(error).__name__}: {error}"}
    return {
        "mode": plan.mode,
        "step": plan.step,
        "start_rollout_id": resolved.start_rollout_id,
        "queue_id": plan.queue_id,
        "pool": resolved.rollout_data_dir,
        "snapshot_problem": plan.snapshot_problem,
        "cursor_source": plan.cursor_source,
    }


def inspect_save(save: str | os.PathLike[str], *, ckpt_step: int | None = None) -> dict[str, Any]:
    """A JSON-ready description of a save directory (what ``straw inspect --save --json`` prints)."""
    root = Path(os.path.abspath(os.fspath(save)))
    if not root.is_dir():
        raise NotAPool(f"{root} is not a directory")
    directory = savedir.rollout_dir(root)
    job: dict[str, Any] | None = None
    job_problem: str | None = None
    try:
        job = savedir.read_job(root)
    except ValueError as error:
        job_problem = str(error)
    commits: list[dict[str, Any]] = []
    for step in savedir.commit_steps(directory):
        try:
            commit = savedir.read_json(directory / savedir.COMMIT_FILE.format(step=step), "Checkpoint marker")
        except ValueError as error:
            commits.append({"step": step, "error": str(error)})
            continue
        commits.append({"step": step, "commit": commit or {}})
    pools = {c["commit"].get("rollout_data_dir") for c in commits if "commit" in c} | {
        (job or {}).get("pool")
    }
    pool = next((p for p in sorted(p for p in pools if p) if os.path.isdir(p)), None)
    owners, sizes, pool_problem = _retention(pool or (job or {}).get("pool"))
    rows = [_commit_row(root, directory, entry, owners, sizes) for entry in commits]
    try:
        rollback = savedir.read_json(directory / savedir.ROLLBACK_FILE, "Rollback intent file")
    except ValueError as error:
        rollback = {"error": str(error)}
    return {
        "save": str(root),
        "job": job,
        "job_problem": job_problem,
        "pool": pool,
        "pool_problem": pool_problem,
        "tracker": savedir.read_text(root / savedir.TRACKER),
        "tracker_copy": savedir.tracker_copy(root),
        "rollback": rollback,
        "commits": rows,
        "selection": _selection(root, job, ckpt_step),
    }


def _commit_row(
    save: Path, directory: Path, entry: dict[str, Any], owners: dict[str, set[str]], sizes: dict[str, int]
) -> dict[str, Any]:
    step = entry["step"]
    if "error" in entry:
        return {"step": step, "error": entry["error"]}
    commit = entry["commit"]
    model, rollout = _files_state(save, commit)
    mine = _owners_of(directory, step)
    reached = set().union(*(owners.get(o, set()) for o in mine)) if mine else set()
    others = set().union(*(packs for name, packs in owners.items() if name not in mine))
    model_bytes = sum(
        int(e.get("size", 0))
        for n, e in (commit.get("files") or {}).items()
        if not str(n).startswith("rollout/")
    )
    return {
        "step": step,
        "resumable": commit.get("resumable"),
        "weight_version": commit.get("weight_version"),
        "queue_id": commit.get("queue_id"),
        "model_files": model,
        "rollout_files": rollout,
        "model_bytes": model_bytes,
        "owners": mine,
        "owners_recorded": [o for o in mine if o in owners],
        "retained_packs": len(reached),
        "retained_bytes": sum(sizes.get(p, 0) for p in reached),
        "exclusive_bytes": sum(sizes.get(p, 0) for p in reached - others),
    }


def render_save(data: dict[str, Any]) -> str:
    """The text ``straw inspect --save`` prints."""
    job = data["job"] or {}
    out = [
        f"save {data['save']}",
        f"job: queue {job.get('queue_id', '-')}, run {job.get('run_id', '-')}"
        + (f" ({data['job_problem']})" if data["job_problem"] else ""),
        f"pool: {data['pool'] or '-'}" + (f" ({data['pool_problem']})" if data["pool_problem"] else ""),
        f"tracker: {_text(data['tracker'])} (straw wrote {_text(data['tracker_copy'])})",
    ]
    rollback = data["rollback"]
    if rollback:
        state = "done" if rollback.get("done") else "UNFINISHED: a restart finishes it first"
        out.append(
            f"last rollback: to step {rollback.get('step')}, timeline {rollback.get('timeline')}, {state}"
        )
    out += ["", "COMMITS"]
    rows = []
    for row in data["commits"]:
        if "error" in row:
            rows.append((row["step"], "-", "-", row["error"], "-", "-", "-"))
            continue
        rows.append(
            (
                row["step"],
                row["resumable"],
                row["weight_version"],
                row["model_files"]
                if row["model_files"] == row["rollout_files"]
                else f"model {row['model_files']}; rollout {row['rollout_files']}",
                size(row["model_bytes"]),
                size(row["retained_bytes"]),
                size(row["exclusive_bytes"]),
            )
        )
    out.append(
        table(("step", "resumable", "weights", "files", "model", "retained", "only this"), rows)
        if rows
        else "(none)"
    )
    selection = data["selection"]
    out.append("")
    if "error" in selection:
        out.append(f"a restart in place would fail: {selection['error']}")
    else:
        step = selection["step"]
        what = f"{selection['mode']}" + (f" to step {step}" if step is not None else "")
        out.append(f"a restart in place would: {what}, first rollout id {selection['start_rollout_id']}")
        if selection["snapshot_problem"] and selection["mode"] == "rollback":
            out.append(
                f"  no usable queue snapshot ({selection['snapshot_problem']}): the queue restarts empty"
            )
    return "\n".join(out)


def _text(value: str | None) -> str:
    return json.dumps(value.strip()) if isinstance(value, str) else "-"
