"""Child program of the checkpoint crash tests: it SIGKILLs itself at a chosen point.

``python ckpt_child.py '<json>'`` with ``{"save", "pool", "flags", "mode", ...}``:

* ``mode: "restart"``: start the test job (a restore: the rollback runs in the controller's
  constructor) with a fault hook that kills the process at the ``occurrence``-th call of
  ``phase``; prints ``completed`` if the phase never came.
* ``mode: "run"``: run steps ``0..steps-1`` of a new job, checkpointing every step, and kill the
  process inside the checkpoint of step ``kill_step``: ``before-marker`` (model and rollout
  files saved, no commit marker) or ``before-tracker`` (marker written, tracker not).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollout_jobs import Job, ScriptedGenerator, job_config
from straw.rollout import checkpoint


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


if __name__ == "__main__":
    options = json.loads(sys.argv[1])
    {"restart": restart, "run": run}[options["mode"]](options)
