"""Child program of the checkpoint crash tests: it SIGKILLs itself at a chosen point.

``python ckpt_child.py '<json>'`` with ``{"save", "pool", "flags", "mode", ...}``:

* ``mode: "restart"``: start the test job (a restore: the rollback runs in the controller's
  constructor) with a fault hook that kills the process at the ``occurrence``-th call of
  ``phase``; prints ``completed`` if the phase never came.
* ``mode: "e2e"``: run steps 0-4 of the end-to-end job (one JSON line per trained step), then
  step 5 until it holds pending, partial, accepted-but-untrained and leased groups, print
  ``{"ready": ...}`` with the queue's counts, and wait to be killed.
* ``mode: "run"``: run steps ``0..steps-1`` of a new job, checkpointing every step, and kill the
  process inside the checkpoint of step ``kill_step``: ``before-marker`` (model and rollout
  files saved, no commit marker) or ``before-tracker`` (marker written, tracker not).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollout_helpers import interrupt
from rollout_jobs import Job, ScriptedGenerator, job_config
from straw.rollout import checkpoint
from straw.rollout.reader import QueueReader

#: Bound on the wait for step 5's first group to be accepted.
WAIT_S = 120.0


def die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def restart(spec: dict[str, Any]) -> None:
    seen = {"count": 0}

    def fault(name: str) -> None:
        if name == spec["phase"]:
            seen["count"] += 1
            if seen["count"] == spec["occurrence"]:
                die()

    config = job_config(Path(spec["save"]), Path(spec["pool"]), **spec["flags"])
    with Job(config, ScriptedGenerator("crash", payload=spec.get("payload", 0)), fault=fault):
        print("completed", flush=True)


def run(spec: dict[str, Any]) -> None:
    kill_step, where = spec["kill_step"], spec["where"]
    write_report, write_tracker = checkpoint.write_report, checkpoint.write_tracker

    def marker_first(path: Any, value: Any) -> Any:
        if where == "before-marker" and Path(path).name == f"committed_{kill_step}.json":
            die()
        return write_report(path, value)

    def tracker_next(save: Any, step: int) -> None:
        if where == "before-tracker" and step == kill_step:
            die()
        write_tracker(save, step)

    checkpoint.write_report = marker_first  # type: ignore[assignment]
    checkpoint.write_tracker = tracker_next  # type: ignore[assignment]
    config = job_config(Path(spec["save"]), Path(spec["pool"]), **spec["flags"])
    with Job(config, ScriptedGenerator("before")) as job:
        for step in range(spec["steps"]):
            job.step(step, checkpoint=True)
    print("completed", flush=True)


def e2e(spec: dict[str, Any]) -> None:
    config = job_config(Path(spec["save"]), Path(spec["pool"]), **spec["flags"])
    generator = ScriptedGenerator("killed-run", payload=spec["payload"])
    job = Job(config, generator, start_gc=True, archive=True)
    for step in range(5):
        trained = job.step(step)
        print(json.dumps({"step": step, "groups": trained.groups, "tags": trained.tags}), flush=True)
    accepted = threading.Event()
    publish = job.source.publish_group

    def spying(group: Any, *, rollout_id: int | str) -> Any:
        ref = publish(group, rollout_id=rollout_id)
        accepted.set()
        return ref

    job.source.publish_group = spying  # type: ignore[method-assign]
    calls = {"count": 0}

    def second_call(index: int) -> bool:
        calls["count"] += 1
        return calls["count"] == 2  # step 5's second group stays leased

    def hold(index: int) -> None:
        if not accepted.wait(WAIT_S):
            raise RuntimeError("step 5's first group was not accepted")
        side = QueueReader(job.config, job.controller, "side")
        group = side.get_samples(1)[0]
        side.add_samples([interrupt(group)])  # a partial back in the queue
        metrics = job.controller.metrics()
        print(
            json.dumps(
                {
                    "ready": True,
                    "tasks": metrics["tasks"],
                    "unprocessed": metrics["accepted_unprocessed"]["count"],
                    "returned": metrics["pending_returned"],
                    "leased_group": index,
                    "partial_group": group[0].group_index,
                }
            ),
            flush=True,
        )

    generator.block, generator.on_block = second_call, hold
    job.step(5)  # never returns: the parent kills the process group


if __name__ == "__main__":
    options = json.loads(sys.argv[1])
    {"restart": restart, "run": run, "e2e": e2e}[options["mode"]](options)
