"""Child program of the rollout controller's process tests: run a job and stop where told.

Every command takes the JSON of the job's configuration flags first.

- ``hold CONFIG``: start a controller, print ``ready``, wait until killed.
- ``accept CONFIG N``: start (or resume) the job, lease N + 1 groups, accept N of them, print
  ``accepted <positions>``, wait until killed (a job killed before planning a batch).
- ``plan CONFIG``: like ``accept 2``, then collect and plan a batch; print ``planned``.
- ``crash CONFIG OPERATION PHASE``: set the job up for OPERATION (``refill``, ``complete``,
  ``return``, ``plan``, ``ready``), then run it with PHASE armed: a controller fault phase, or
  ``backend:<phase>`` for a store backend phase. At the first arrival the child prints
  ``at PHASE`` and waits to be killed; if it never arrives it prints ``done``.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: rollout_helpers

import straw.rollout.pool as pool_module
from rollout_helpers import finish, interrupt, prompt_rows
from straw.backend import FilesystemBackend
from straw.rollout.config import RolloutConfig
from straw.rollout.controller import QueueController
from straw.rollout.reader import QueueReader
from straw.rollout.refs import DiskPayloadRef, load_groups, pack_payload

#: Every job of these tests draws from this many prompt rows.
DATASET_ROWS = 40


def config_from(text: str) -> RolloutConfig:
    return RolloutConfig.from_args(SimpleNamespace(**json.loads(text)))


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def wait_to_be_killed() -> None:
    sys.stdin.read()
    raise SystemExit(3)  # the parent closed our stdin instead of killing us


def hold(config: RolloutConfig) -> None:
    QueueController(config, dataset=prompt_rows(DATASET_ROWS))
    say("ready")
    wait_to_be_killed()


def accept(config: RolloutConfig, count: str) -> None:
    controller = QueueController(config, dataset=prompt_rows(DATASET_ROWS))
    reader = QueueReader(controller.config, controller, "worker")
    groups = reader.get_samples(int(count) + 1)
    refs = [reader.publish_group(finish(group), rollout_id=0) for group in groups[: int(count)]]
    say("accepted " + " ".join(str(ref.receipt.position) for ref in refs))  # type: ignore[union-attr]
    wait_to_be_killed()


def collection(controller: QueueController, reader: QueueReader) -> tuple[str, list[int], DiskPayloadRef]:
    """Accept two groups and a raw collection of them; the batch id, its inputs and a plan."""
    refs = [reader.publish_group(finish(group), rollout_id=0) for group in reader.get_samples(2)]
    lease = controller.begin_collection("0")
    metadata = {"task_id": lease.task_id, "attempt_id": lease.attempt_id}
    raw = pack_payload(refs, config=controller.config, rollout_id=0, metadata=metadata)
    receipt = controller.complete(lease, raw.manifest)
    positions = [receipt.position, *(ref.receipt.position for ref in refs)]  # type: ignore[union-attr]
    plan_ref = pack_payload({"raw": receipt.commit_id}, config=controller.config, rollout_id=0)
    return f"batch:{receipt.commit_id}", positions, plan_ref


def plan(config: RolloutConfig) -> None:
    controller = QueueController(config, dataset=prompt_rows(DATASET_ROWS))
    reader = QueueReader(controller.config, controller, "worker")
    controller.plan_batch(*collection(controller, reader))
    say("planned")
    wait_to_be_killed()


def crash(config: RolloutConfig, operation: str, phase: str) -> None:
    armed = {"on": False}

    def arrive(name: str) -> None:
        if armed["on"] and name == phase:
            armed["on"] = False
            say(f"at {name}")
            wait_to_be_killed()

    backend = functools.partial(FilesystemBackend, fault=lambda at: arrive("backend:" + at))
    pool_module.FilesystemBackend = backend  # type: ignore[misc]
    controller = QueueController(config, dataset=prompt_rows(DATASET_ROWS), fault=arrive)
    reader = QueueReader(controller.config, controller, "worker")
    run = OPERATIONS[operation](controller, reader)
    armed["on"] = True
    run()
    armed["on"] = False
    say("done")
    wait_to_be_killed()


def setup_refill(controller: QueueController, reader: QueueReader) -> Any:
    return lambda: reader.get_samples(2)


def setup_complete(controller: QueueController, reader: QueueReader) -> Any:
    group, _ = reader.get_samples(2)
    finish(group)
    return lambda: reader.publish_group(group, rollout_id=0)


def setup_return(controller: QueueController, reader: QueueReader) -> Any:
    first, second, _ = reader.get_samples(3)
    (accepted,) = load_groups([reader.publish_group(finish(first), rollout_id=0)])
    interrupt(second, version="3")
    return lambda: reader.add_samples([second, accepted])


def setup_plan(controller: QueueController, reader: QueueReader) -> Any:
    batch = collection(controller, reader)
    return lambda: controller.plan_batch(*batch)


def setup_ready(controller: QueueController, reader: QueueReader) -> Any:
    batch_id, positions, plan_ref = collection(controller, reader)
    controller.plan_batch(batch_id, positions, plan_ref)
    lease = controller.batch(batch_id)["lease"]  # type: ignore[index]
    metadata = {"task_id": batch_id, "attempt_id": lease.attempt_id}
    conversion = pack_payload({"tokens": [[1, 2]]}, config=controller.config, rollout_id=0, metadata=metadata)
    return lambda: controller.ready_batch(batch_id, conversion)


OPERATIONS = {
    "refill": setup_refill,
    "complete": setup_complete,
    "return": setup_return,
    "plan": setup_plan,
    "ready": setup_ready,
}


def main(argv: list[str]) -> None:
    command, config = argv[0], config_from(argv[1])
    commands: dict[str, Any] = {"hold": hold, "accept": accept, "plan": plan, "crash": crash}
    commands[command](config, *argv[2:])


if __name__ == "__main__":
    main(sys.argv[1:])
