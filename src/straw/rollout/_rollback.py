"""The in-place rollback to step K: phases R0-R8 of ROLLOUT.md section 14.7.

A restart that restores step K rolls the job's own queue back: every live task is cancelled,
every accepted result not trained yet is disposed (so it never enters training), the groups
that were unfinished at K are issued again from their original prompts with K's cursor, and
the checkpoints, archives and dumps of later steps are removed with their owners released.

Every phase is idempotent: it checks whether its effect is present, or repeats a queue call
under a deterministic request id that the queue answers from its journal. A crash anywhere is
repaired by running the whole procedure again, which the next start does: ``rollback.json``
(written first, R0) pins the step until R8 marks it done (section 14.4 rule 4).

The controller runs R0-R2's preparation in :func:`begin` (before it opens the queue: R2 itself
is its ``Coordinator(..., recover=True)``) and R3-R8 in :func:`finish`. Test hooks run before
each phase (``rollback:R0`` ... ``rollback:R8``) and before each single effect inside R4-R7
(``rollback:R4:cancel``, ``rollback:R5:save``, ``rollback:R6:reissue``, ``rollback:R7:release``,
``rollback:R7:remove``, ``rollback:R7:archive``, ``rollback:R7:tracker``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..coordinator import Coordinator, queue_directory
from ..errors import CorruptData, InvalidReference, QueueError, UnsupportedSchema
from ..protocol import RecordSetRef, TaskSpec, as_dict, decode, encode
from ..reporting import remove_report, write_report
from ..store import SharedFilesystemStore
from ._savedir import (
    ROLLBACK_FILE,
    STEP_FILE,
    read_job,
    read_json,
    rollout_dir,
    step_files,
    write_job,
    write_tracker,
)
from .archive import archive_paths, release_owner, remove_archive
from .checkpoint import RestorePlan, cursor_origin
from .dataset import DatasetCursor
from .pool import settled
from .refs import RELEASE_CHUNK, DiskPayloadRef, release_publications
from .sample import NO_VERSION_KEY

__all__ = ["REISSUE_CHUNK", "begin", "finish"]

log = logging.getLogger("straw.rollout.checkpoint")

#: Groups re-issued per queue transaction (R6).
REISSUE_CHUNK = 64
#: The data-source identity fields a restore compares (R1).
CHECKED_CONFIGURATION = ("dataset_size", "n_samples_per_prompt", "seed", "shuffle", "run_id", "dataset")
#: How job.json's ``initial_configuration`` names some of them (used when no snapshot can be read).
_JOB_NAMES = {
    "n_samples_per_prompt": "n_samples_per_prompt",
    "seed": "rollout_seed",
    "shuffle": "rollout_shuffle",
    "run_id": "rollout_queue_run_id",
}
_UNREADABLE = (
    CorruptData,
    InvalidReference,
    UnsupportedSchema,
    QueueError,
    OSError,
    KeyError,
    TypeError,
    ValueError,
)


@dataclasses.dataclass
class _Context:
    """What one run of the procedure carries from R0 to R8."""

    step: int
    timeline: int
    resumed: bool
    body: dict[str, Any] | None = None
    cancelled: int = 0
    disposed: int = 0
    reissued: int = 0
    removed: int = 0


def _intent_path(plan: RestorePlan) -> Path:
    return rollout_dir(str(plan.save)) / ROLLBACK_FILE


def _write_intent(plan: RestorePlan, context: _Context, *, done: bool) -> None:
    value = {
        "version": 1,
        "step": context.step,
        "timeline": context.timeline,
        "queue_id": plan.queue_id,
        "done": done,
    }
    write_report(_intent_path(plan), value)


def _timeline(plan: RestorePlan) -> tuple[int, bool]:
    """R0's timeline: an unfinished rollback to the same step reuses its own; else the next one."""
    try:
        intent = read_json(_intent_path(plan), "Rollback intent file")
    except ValueError:
        intent = None
    if intent is None or not isinstance(intent.get("timeline"), int):
        return 1, False
    timeline = int(intent["timeline"])
    if intent.get("done") is False and intent.get("step") == plan.step:
        return timeline, True
    return timeline + 1, False


# --------------------------------------------------------------------------- R0-R2 (before the queue opens)


def begin(controller: Any, plan: RestorePlan) -> None:
    """R0 intent, R1 configuration and snapshot checks, R2's choice of queue (a lost one is replaced)."""
    if plan.save is None or plan.step is None:
        raise ValueError("A rollback needs the save directory and the step it restores")
    controller._fault("rollback:R0")
    timeline, resumed = _timeline(plan)
    context = _Context(plan.step, timeline, resumed)
    _write_intent(plan, context, done=False)  # R0, K3: the step is pinned from here on (I19)
    controller._rollback_context = context
    if read_job(str(plan.save)) is None:  # a save directory restored without its job file
        write_job(controller.config, plan)
    controller._fault("rollback:R1")
    _check_configuration(controller, plan)
    plan = _check_snapshot(controller, plan, context)
    controller._fault("rollback:R2")
    root = str(controller._bound.store.backend.root)
    if not os.path.isdir(queue_directory(root, plan.queue_id, True)):
        plan = _replace_lost_queue(controller, plan, context)
    controller.plan = plan


def _canonical(value: Any) -> Any:
    try:
        return decode(encode(value))
    except (TypeError, ValueError):
        return repr(value)


def _check_configuration(controller: Any, plan: RestorePlan) -> None:
    """R1: the data source must be the checkpoint's (an error, never a fallback)."""
    current = controller.data_configuration()
    saved = (plan.snapshot or {}).get("configuration")
    if isinstance(saved, Mapping):
        keys = [k for k in CHECKED_CONFIGURATION if k in saved]
        recorded = {k: saved[k] for k in keys}
    else:
        job = read_job(str(plan.save)) or {}
        initial = job.get("initial_configuration") or {}
        keys = [k for k, name in _JOB_NAMES.items() if name in initial]
        recorded = {k: initial[_JOB_NAMES[k]] for k in keys}
    for key in keys:
        if _canonical(recorded[key]) != _canonical(current[key]):
            raise ValueError(f"Data source checkpoint differs in {key}")


def _unusable(plan: RestorePlan, problem: str) -> RestorePlan:
    log.warning(
        "Checkpoint step %d has no usable queue snapshot (%s): the queue restarts empty; "
        "dataset cursor from %s",
        plan.step,
        problem,
        cursor_origin(plan.cursor_source, plan.save, plan.step),
    )
    return dataclasses.replace(plan, snapshot_problem=problem)


def _check_snapshot(controller: Any, plan: RestorePlan, context: _Context) -> RestorePlan:
    """R1: load the snapshot payload and validate every prompt it names; any failure makes it unusable."""
    if plan.snapshot_problem is not None or plan.snapshot is None:
        return plan
    bound = controller._bound
    try:
        manifest = RecordSetRef.from_dict(plan.snapshot["manifest"])
        with bound.lock:
            body = bound.codec.load(manifest)
        if not isinstance(body, dict) or body.get("version") != 1 or body.get("step") != plan.step:
            raise ValueError(f"it is not a version 1 snapshot of step {plan.step}")
        if body.get("queue_id") != plan.queue_id:
            raise ValueError(f"it names queue {body.get('queue_id')}, not {plan.queue_id}")
        cursor = DatasetCursor.from_dict(body["producer"]["cursor"]).asdict()
        for entry in body["unfinished"]:
            prompt = entry["prompt"]
            if not isinstance(prompt, DiskPayloadRef) or isinstance(entry["group_index"], bool):
                raise ValueError("an unfinished group has no prompt reference")
            int(entry["group_index"])
            bound.store.validate(prompt.manifest)
    except _UNREADABLE as error:
        return _unusable(plan, f"its snapshot payload cannot be used: {error}")
    context.body = body
    return dataclasses.replace(plan, cursor=cursor, cursor_source="snapshot")


def _replace_lost_queue(controller: Any, plan: RestorePlan, context: _Context) -> RestorePlan:
    """R2: the job's queue is gone (a lost or new pool): a new queue, recorded in job.json first."""
    queue_id = "run:" + secrets.token_hex(16)
    log.warning(
        "The queue %s of %s is missing from the pool %s: starting a new queue %s at the checkpoint's cursor",
        plan.queue_id,
        plan.save,
        controller._bound.store.backend.root,
        queue_id,
    )
    job = read_job(str(plan.save))
    replaced = dataclasses.replace(plan, queue_id=queue_id)
    if job is not None:
        write_report(
            rollout_dir(str(plan.save)) / "job.json",
            {**job, "queue_id": queue_id, "pool": controller.config.rollout_data_dir},
        )
    else:
        write_job(controller.config, replaced)
    _write_intent(replaced, context, done=False)
    context.body = None
    if replaced.snapshot_problem is None:
        return _unusable(replaced, "the job's queue is missing from the pool")
    return replaced


# --------------------------------------------------------------------------- R3-R8 (the queue is open)


def finish(controller: Any, plan: RestorePlan) -> None:
    """R3 fence, R4 cancel, R5 dispose, R6 reissue, R7 files, R8 done."""
    context: _Context = controller._rollback_context
    queue: Coordinator = controller._usable()
    plan = controller.plan
    state = queue.producer_state("dataset")
    live = int(state["timeline"]) if isinstance(state, Mapping) else 0
    if live > context.timeline or (not context.resumed and live >= context.timeline):
        context.timeline = live + 1  # rollback.json was lost or edited: never reuse a timeline
        _write_intent(plan, context, done=False)
    controller._fault("rollback:R3")
    reads = list(queue.outstanding_reads())
    for start in range(0, len(reads), RELEASE_CHUNK):
        queue.release_task_reads(reads[start : start + RELEASE_CHUNK])
    controller._fault("rollback:R4")
    _cancel(controller, queue, context)
    controller._fault("rollback:R5")
    _dispose(controller, queue, context)
    controller._fault("rollback:R6")
    _reissue(controller, queue, plan, context)
    controller._fault("rollback:R7")
    _remove_later_steps(controller, plan, context)
    controller._fault("rollback:R8")
    _write_intent(plan, context, done=True)
    log.info(
        "Rolled back %s to step %d (timeline %d): cancelled %d tasks, disposed %d results, "
        "re-issued %d groups, removed %d files",
        plan.save,
        context.step,
        context.timeline,
        context.cancelled,
        context.disposed,
        context.reissued,
        context.removed,
    )


def _cancel(controller: Any, queue: Coordinator, context: _Context) -> None:
    """R4: every live task not issued by this rollback; nothing created after K survives."""
    mine = f":t{context.timeline}"
    rb = f"rollback:{context.timeline}"
    for task_id in sorted(queue.live_tasks()):
        if not task_id.endswith(mine):
            controller._fault("rollback:R4:cancel")
            queue.cancel_task(task_id, request_id=f"{rb}:cancel:{task_id}")
            context.cancelled += 1


def _dispose(controller: Any, queue: Coordinator, context: _Context) -> None:
    """R5: every accepted result the training view has not processed is disposed, once."""
    training = controller._load_training(queue)
    controller._training = training
    if (training.rollback or {}).get("timeline") == context.timeline:
        return  # done by an earlier run of this rollback
    controller._training_token = queue.open_consumer("training", exclusive_owner=_exclusive_owner())
    view = training.view
    commits = int(queue.metrics()["commits"])
    unprocessed = [p for p in range(view.processed_cursor, commits) if not view.is_processed(p)]
    body = {
        "version": 1,
        "reason": f"rolled back to step {context.step}",
        "step": context.step,
        "timeline": context.timeline,
        "positions": unprocessed,
    }
    bound = controller._bound
    with bound.lock:
        name = f"rollback:{context.timeline}:disposition:{uuid.uuid4().hex}"
        ref = settled(lambda: bound.codec.publish(body, submission_id=name))
    root = str(bound.store.backend.root)
    changed = controller._changed(
        view=controller._advanced(queue, unprocessed),
        batches={},
        disposition=DiskPayloadRef(ref, root),
        rollback={"step": context.step, "timeline": context.timeline},
    )
    controller._fault("rollback:R5:save")
    controller._save_training(queue, changed)
    release_publications(controller.config, [ref])  # the training state depends on it now
    context.disposed = len(unprocessed)


def _exclusive_owner() -> str:
    from .controller import EXCLUSIVE_OWNER

    return EXCLUSIVE_OWNER


def _reissue(controller: Any, queue: Coordinator, plan: RestorePlan, context: _Context) -> None:
    """R6: K's unfinished groups again from their original prompts, committed with K's cursor."""
    n = context.timeline
    rb = f"rollback:{n}"
    cursor = DatasetCursor.from_dict(plan.cursor or DatasetCursor().asdict()).asdict()
    producer = {"version": 1, "timeline": n, "cursor": cursor}
    body = context.body if plan.snapshot_problem is None else None
    groups: dict[int, DiskPayloadRef] = {}
    for entry in (body or {}).get("unfinished", ()):
        groups.setdefault(int(entry["group_index"]), entry["prompt"])
    ordered = sorted(groups.items())
    config = controller.config
    for number, start in enumerate(range(0, len(ordered), REISSUE_CHUNK)):
        tasks = [
            TaskSpec(
                f"prompt:{g}:t{n}",
                prompt.manifest,
                metadata={
                    "group_index": g,
                    "prompt": as_dict(prompt.manifest),
                    "stage": "fresh",
                    "reissued": context.step,
                },
                estimated_tokens=prompt.manifest.tokens,
                max_attempts=config.task_max_attempts,
                scheduling_key=NO_VERSION_KEY,
            )
            for g, prompt in ordered[start : start + REISSUE_CHUNK]
        ]
        controller._fault("rollback:R6:reissue")
        queue.submit_tasks(f"{rb}:reissue:{number}", tasks, producer_id="dataset", producer_state=producer)
    if not ordered:
        queue.submit_tasks(f"{rb}:cursor", [], producer_id="dataset", producer_state=producer)
    context.reissued = len(ordered)
    for reader, metadata in sorted(((body or {}).get("readers") or {}).items()):
        if controller.reader_metadata(reader) != metadata:
            controller.reader_metadata(reader, metadata)


def _owner_step(owner: str, prefix: str) -> int | None:
    name = owner[len(prefix) :].split(":", 1)[0]
    match = STEP_FILE.match(name)
    return int(match.group(2)) if match is not None else None


def _remove_later_steps(controller: Any, plan: RestorePlan, context: _Context) -> None:
    """R7: checkpoints, archives and dumps of steps after K go, their owners first; tracker K."""
    store: SharedFilesystemStore = controller._bound.store
    save = Path(str(plan.save))
    directory = rollout_dir(save)
    later = [(n, path) for n, path in step_files(directory) if n > context.step]
    owners = set()
    for _, path in later:  # the owners the files name (a copied directory's are not under its prefix)
        if path.name.startswith(("queue_state_", "builder_state_")):
            try:
                named = (read_json(path, "Checkpoint file") or {}).get("storage_owner")
            except ValueError:
                named = None
            if isinstance(named, str) and named:
                owners.add(named)
    prefix = f"checkpoint:{directory}/"
    owners.update(
        o for o in store.owners(prefix) if (n := _owner_step(o, prefix)) is not None and n > context.step
    )
    for owner in sorted(owners):
        controller._fault("rollback:R7:release")
        release_owner(store, owner)
    # A marker goes before the files it names (unreference before delete).
    for _, path in sorted(later, key=lambda item: (item[0], not item[1].name.startswith("committed_"))):
        controller._fault("rollback:R7:remove")
        context.removed += remove_report(path)
    template = controller.config.save_debug_rollout_data
    if template:
        for rollout_id, _, path in archive_paths(template):
            if rollout_id > context.step:
                controller._fault("rollback:R7:archive")
                context.removed += remove_archive(path, store)
    controller._fault("rollback:R7:tracker")
    write_tracker(save, context.step)
