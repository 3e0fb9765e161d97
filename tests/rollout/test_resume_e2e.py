"""End-to-end resume (issue 14 item 4): a job killed in the middle of a step resumes exactly.

A child process runs steps 0-4 of the test job (a joint commit every 2 steps, online GC, a
``.straw.json`` archive per step) and stops in the middle of step 5 holding pending, partial,
accepted-but-untrained and leased groups; the parent SIGKILLs its process group. Resuming from
step 4 must train steps 5.. on exactly the groups an uninterrupted run trains, never a group
twice and never a result generated before the resume; after GC only what the kept checkpoints,
archives and live tasks reach is left in the pool. Resuming the same job from step 2 then works
the same way.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from child_io import CHILD_TIMEOUT_S, children, read_line
from rollout_jobs import (
    Job,
    ScriptedGenerator,
    env_with_tests,
    job_config,
    pack_files,
    reached_packs,
    task_roots,
)
from straw._inspect.save_view import inspect_save
from straw._inspect.view import inspect_pool
from straw.protocol import RecordSetRef
from straw.rollout.archive import read_archive_index
from straw.rollout.pool import close_rollout_stores, rollout_store
from straw.tensor import detach

CHILD = Path(__file__).with_name("ckpt_child.py")
PAYLOAD = 20000  # response tokens per sample: results are large enough to rotate 1 MiB packs
LAST = 7


def flags(debug: Path) -> dict[str, Any]:
    return {
        "save_interval": 2,
        "rollout_queue_online_gc": True,
        "rollout_queue_segment_mib": 1,
        "refill_min_groups": 5,
        "save_debug_rollout_data": str(debug / "rollout_{rollout_id}.straw.json"),
    }


def uninterrupted(base: Path) -> dict[int, list[int]]:
    """The groups each step of an uninterrupted run of the same job trains."""
    with Job(
        job_config(base / "save", base / "pool", **flags(base / "debug")),
        ScriptedGenerator("reference", payload=PAYLOAD),
        start_gc=True,
        archive=True,
    ) as job:
        for step in range(LAST + 1):
            job.step(step)
        trained = {k: t.groups for k, t in job.trained.items()}
    close_rollout_stores()
    return trained


def retained_roots(job: Job, save: Path, debug: Path) -> list[RecordSetRef]:
    """What kept checkpoints, archives and live tasks name (the roots storage may keep)."""
    roots = task_roots(job.controller)
    rollout = save / "rollout"
    for path in sorted(rollout.glob("queue_state_*.json")):
        roots.append(RecordSetRef.from_dict(json.loads(path.read_text())["manifest"]))
    for path in sorted(rollout.glob("builder_state_*.json")):
        consumer = json.loads(path.read_text())["consumer"]
        roots += [
            RecordSetRef.from_dict(consumer[k]) for k in ("state_ref", "progress_ref") if consumer.get(k)
        ]
    for path in sorted(debug.glob("*.straw.json")):
        roots.append(RecordSetRef.from_dict(read_archive_index(path)["manifest"]))
    return roots


def assert_bounded(job: Job, save: Path, pool: Path, debug: Path) -> dict[str, Any]:
    """After a collection, every pack left is one the retained roots reach; inspect agrees."""
    store = rollout_store(job.config).store
    store.seal()
    job.controller.collect_garbage()
    needed = reached_packs(store, retained_roots(job, save, debug))
    on_disk = pack_files(pool)
    view = inspect_pool(pool)
    assert set(on_disk) <= needed, sorted(set(on_disk) - needed)
    assert view["totals"]["bytes"] == sum(on_disk.values())
    for row in view["packs"]:  # each pack is kept for a retained root (or is being written)
        assert row["live_bytes"] > 0 and (row["owners"] or row["state"] == "open")
        # The only dead bytes: the zero-filled space a killed writer had allocated ahead.
        assert row["dead_bytes"] == 0 or row["tail"] == "zeros"
    for commit in inspect_save(save)["commits"]:  # `straw inspect --save` counts the same bytes
        walked = reached_packs(store, retained_roots_of(save, commit["step"]))
        assert commit["retained_bytes"] == sum(on_disk[p] for p in walked) > 0
    return view


def retained_roots_of(save: Path, step: int) -> list[RecordSetRef]:
    rollout = save / "rollout"
    consumer = json.loads((rollout / f"builder_state_{step}.json").read_text())["consumer"]
    return [
        RecordSetRef.from_dict(json.loads((rollout / f"queue_state_{step}.json").read_text())["manifest"])
    ] + [RecordSetRef.from_dict(consumer[k]) for k in ("state_ref", "progress_ref") if consumer.get(k)]


def distinct(trained: dict[int, list[int]]) -> None:
    """No group is trained in two steps of one timeline."""
    seen: set[int] = set()
    for step in sorted(trained):
        groups = set(trained[step])
        assert not groups & seen, (step, groups & seen)
        seen |= groups


@pytest.mark.crash
def test_a_job_killed_mid_step_resumes_exactly_from_step_4_then_from_step_2(tmp_path: Path) -> None:
    expected = uninterrupted(tmp_path / "reference")
    save, pool, debug = tmp_path / "save", tmp_path / "pool", tmp_path / "debug"
    spec = {"mode": "e2e", "save": str(save), "pool": str(pool), "flags": flags(debug), "payload": PAYLOAD}
    child = subprocess.Popen(
        [sys.executable, str(CHILD), json.dumps(spec)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(env_with_tests()),
        start_new_session=True,  # its own process group: the whole tree is killed at once
    )
    first: dict[int, list[int]] = {}
    with children(child):
        for _ in range(5):
            line = json.loads(read_line(child))
            assert set(line["tags"]) == {"killed-run"}
            first[line["step"]] = line["groups"]
        ready = json.loads(read_line(child))
        os.killpg(child.pid, signal.SIGKILL)
        child.wait(timeout=CHILD_TIMEOUT_S)
    assert child.returncode == -signal.SIGKILL
    assert first == {k: expected[k] for k in range(5)}
    tasks = ready["tasks"]
    assert tasks.get("leased", 0) >= 1 and tasks.get("pending", 0) >= 2  # leased, fresh and partial
    assert ready["returned"] >= 1 and ready["unprocessed"] >= 1  # a partial; an accepted, untrained group

    # Resume in place from the newest commit, step 4.
    with Job(
        job_config(save, pool, **flags(debug)),
        ScriptedGenerator("resumed", payload=PAYLOAD),
        start_gc=True,
        archive=True,
    ) as job:
        assert job.plan.mode == "rollback" and job.plan.step == 4 and job.start == 5
        for step in range(5, LAST + 1):
            trained = job.step(step)
            assert trained.groups == expected[step]
            assert set(trained.tags) == {"resumed"}  # nothing generated before the resume is trained
        distinct({**first, **{k: t.groups for k, t in job.trained.items()}})
        assert ready["leased_group"] in set(expected[5]) | set(expected[6])
        after_four = assert_bounded(job, save, pool, debug)
    close_rollout_stores()
    detach(pool)

    # Resume the same job from an earlier step.
    with Job(
        job_config(save, pool, ckpt_step=2, **flags(debug)),
        ScriptedGenerator("again", payload=PAYLOAD),
        start_gc=True,
        archive=True,
    ) as job:
        assert job.plan.step == 2 and job.start == 3
        rollout = save / "rollout"
        assert sorted(p.name for p in rollout.glob("committed_*.json")) == [
            "committed_0.json",
            "committed_2.json",
        ]
        assert sorted(p.name for p in debug.glob("*.straw.json")) == [
            f"rollout_{k}.straw.json" for k in range(3)
        ]
        for step in range(3, LAST + 1):
            trained = job.step(step)
            assert trained.groups == expected[step] and set(trained.tags) == {"again"}
        distinct({**{k: first[k] for k in range(3)}, **{k: t.groups for k, t in job.trained.items()}})
        after_two = assert_bounded(job, save, pool, debug)
        assert sorted(p.name for p in rollout.glob("committed_*.json")) == [
            "committed_0.json", "committed_2.json", "committed_4.json", "committed_6.json"
        ]  # fmt: skip
    # The same steps and checkpoints retain about the same storage after either resume.
    assert after_two["totals"]["live_bytes"] <= 1.5 * after_four["totals"]["live_bytes"]
