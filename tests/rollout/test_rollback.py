"""The in-place rollback to a joint commit (acceptance scenarios 39-42; ROLLOUT.md 14.6, 14.7).

One job runs steps 0-3 with a joint commit and a ``.straw.json`` archive at every step, then
leaves work behind: a leased group, an accepted group nobody trained and a returned partial.
That state is kept as a template; each test restores it (at the same absolute paths, since
the job's files name them) and restarts the job on step 1.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from child_io import CHILD_TIMEOUT_S
from rollout_helpers import finish, interrupt
from rollout_jobs import (
    Job,
    ScriptedGenerator,
    env_with_tests,
    job_config,
    owners,
    pack_files,
    queue_state,
    reached_packs,
    save_files,
    task_roots,
)
from straw.errors import StaleAttempt
from straw.protocol import Lease, RecordSetRef
from straw.rollout.archive import PRIVATE_POOL_DIR, RolloutArchive, read_archive_index
from straw.rollout.config import RolloutConfig
from straw.rollout.pool import close_rollout_stores, rollout_store
from straw.rollout.refs import DiskPayloadRef
from straw.tensor import detach

PHASES = [f"rollback:R{i}" for i in range(9)]
#: Faults inside the phases: (phase, which call of it), between single cancels, saves, files.
INNER = [
    ("rollback:R4:cancel", 1),
    ("rollback:R4:cancel", 3),
    ("rollback:R5:save", 1),
    ("rollback:R6:reissue", 1),
    ("rollback:R7:release", 2),
    ("rollback:R7:remove", 1),
    ("rollback:R7:remove", 6),
    ("rollback:R7:archive", 1),
    ("rollback:R7:tracker", 1),
]


@dataclasses.dataclass
class Template:
    base: Path
    save: Path
    pool: Path
    debug: Path
    stored: Path
    lease: Lease
    unfinished: list[dict[str, Any]]
    cursor: dict[str, Any]
    live: list[str] = dataclasses.field(default_factory=list)

    def config(self, **flags: Any) -> RolloutConfig:
        return job_config(self.save, self.pool, **{**self.flags(), **flags})

    def flags(self) -> dict[str, Any]:
        return {
            "save_interval": 1,
            "rollout_queue_segment_mib": 1,
            "rollout_queue_online_gc": True,
            "refill_min_groups": 6,
            "save_debug_rollout_data": str(self.debug / "rollout_{rollout_id}.straw.json"),
        }

    def restore(self) -> None:
        """Put the pre-restart state back at the job's own paths."""
        close_rollout_stores()
        for pool in (self.pool, self.debug / PRIVATE_POOL_DIR):
            detach(pool)  # this process's cached readers would still see the replaced files
        for name in ("save", "pool", "debug"):
            shutil.rmtree(self.base / name, ignore_errors=True)
            shutil.copytree(self.stored / name, self.base / name, symlinks=True)


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Template]:
    base = tmp_path_factory.mktemp("rollback")
    made = Template(base, base / "save", base / "pool", base / "debug", base / "stored", None, [], {})  # type: ignore[arg-type]
    with Job(made.config(), ScriptedGenerator("before", payload=20000), archive=True) as job:
        for step in range(4):
            job.step(step)
        source = job.source
        leased = source.get_samples(1)[0]  # stays leased
        made.lease = Lease.from_dict(leased[0]._queue_lease)
        extra = job.controller.take("other", 1).assignments  # another reader's lease
        assert extra
        accepted = source.get_samples(1)[0]
        source.publish_group(finish(accepted), rollout_id=4)  # accepted, never trained
        partial = source.get_samples(1)[0]
        source.add_samples([interrupt(partial)])  # a returned partial
        bound = rollout_store(job.config)
        snapshot = json.loads((made.save / "rollout" / "queue_state_1.json").read_text())
        with bound.lock:
            body = bound.codec.load(RecordSetRef.from_dict(snapshot["manifest"]))
        made.unfinished = body["unfinished"]
        made.cursor = body["producer"]["cursor"]
        made.live = sorted(
            t for t, s in job.controller.queue.tasks.items() if s["state"] in ("pending", "leased")
        )
    close_rollout_stores()
    for name in ("save", "pool", "debug"):
        shutil.copytree(base / name, made.stored / name, symlinks=True)
    yield made
    close_rollout_stores()


@dataclasses.dataclass
class Outcome:
    state: dict[str, Any]
    files: dict[str, bytes]
    owners: list[str]
    debug: list[str]


def observe(job: Job, template: Template) -> Outcome:
    store = rollout_store(job.config).store
    return Outcome(
        queue_state(job.controller),
        save_files(template.save),
        owners(store, template.save),
        sorted(p.name for p in template.debug.iterdir()),
    )


@pytest.fixture(scope="module")
def reference(template: Template) -> Outcome:
    """The outcome of an uninterrupted rollback to step 1."""
    template.restore()
    with Job(template.config(ckpt_step=1), ScriptedGenerator("after")) as job:
        outcome = observe(job, template)
    close_rollout_stores()
    return outcome


# --------------------------------------------------------------------------- scenario 39


def test_scenario_39_a_rollback_restores_step_1_in_place(template: Template, reference: Outcome) -> None:
    template.restore()
    models = {p: p.read_bytes() for p in template.save.rglob("iter_*/*")}
    kept = {n: (template.save / "rollout" / n).read_bytes() for n in os.listdir(template.save / "rollout")
            if n.endswith(("_0.json", "_1.json"))}  # fmt: skip
    store = rollout_store(template.config()).store
    later = [o for o in store.owners("checkpoint:") if "_2.json:" in o or "_3.json:" in o]
    archived = {
        n: read_archive_index(template.debug / f"rollout_{n}.straw.json")["storage_owner"] for n in range(4)
    }
    assert len(later) == 4
    with Job(template.config(ckpt_step=1), ScriptedGenerator("after")) as job:
        controller = job.controller
        assert job.plan.mode == "rollback" and job.config.start_rollout_id == 2
        rollout = template.save / "rollout"
        for n in (2, 3):
            for name in ("committed", "queue_state", "builder_state", "global_dataset_state_dict"):
                assert not (rollout / f"{name}_{n}.json").exists()
            assert not (template.debug / f"rollout_{n}.straw.json").exists()
        assert {p: p.read_bytes() for p in template.save.rglob("iter_*/*")} == models
        assert {n: (rollout / n).read_bytes() for n in kept} == kept
        assert store.owners("checkpoint:") and not [o for o in store.owners("checkpoint:") if o in later]
        assert store.owners(archived[2]) == [] and store.owners(archived[3]) == []
        assert store.owners(archived[1]) == [archived[1]]
        assert (template.save / "latest_checkpointed_iteration.txt").read_text() == "1\n"
        assert json.loads((rollout / "rollback.json").read_text()) == {
            "version": 1, "step": 1, "timeline": 1, "queue_id": job.plan.queue_id, "done": True,
        }  # fmt: skip
        tasks = controller.queue.tasks
        assert template.live and all(tasks[t]["state"] == "cancelled" for t in template.live)
        reissued = {t: s for t, s in tasks.items() if s["state"] in ("pending", "leased")}
        expected = {f"prompt:{e['group_index']}:t1": e for e in template.unfinished}
        assert sorted(reissued) == sorted(expected) and expected
        for task_id, entry in expected.items():
            spec = reissued[task_id]["spec"]
            assert spec["input_ref"] == dataclasses.asdict(entry["prompt"].manifest)
            assert spec["metadata"]["stage"] == "fresh" and spec["metadata"]["reissued"] == 1
            prompt = DiskPayloadRef(entry["prompt"].manifest, str(template.pool)).load()
            assert {s.group_index for s in prompt} == {entry["group_index"]}
        assert controller.queue.producer_state("dataset") == {
            "version": 1,
            "timeline": 1,
            "cursor": template.cursor,
        }
        metrics = controller.metrics()
        assert metrics["accepted_unprocessed"]["count"] == 0
        assert controller.heartbeat([template.lease]) == ["StaleAttempt"]
        with pytest.raises(StaleAttempt):
            controller.complete(template.lease, RecordSetRef.from_dict(reissued_input(reissued)))
        assert observe(job, template) == reference
        trained = job.step(2)  # step 2 again: the unfinished groups of step 1 come first
        assert trained.groups[0] == min(e["group_index"] for e in template.unfinished)
        assert set(trained.tags) == {"after"}
        assert (rollout / "committed_2.json").exists()


def reissued_input(tasks: dict[str, Any]) -> dict[str, Any]:
    return next(iter(tasks.values()))["spec"]["input_ref"]  # type: ignore[no-any-return]


# --------------------------------------------------------------------------- scenario 40


class Crash(Exception):
    """A fault injected before a rollback phase (it leaves what a crash there would)."""


def crash_at(phase: str, occurrence: int = 1) -> Any:
    seen = {"count": 0}

    def fault(name: str) -> None:
        if name == phase:
            seen["count"] += 1
            if seen["count"] == occurrence:
                raise Crash(f"{phase} #{occurrence}")

    return fault


def faults() -> list[tuple[str, int]]:
    return [(phase, 1) for phase in PHASES] + INNER


@pytest.mark.parametrize(("phase", "occurrence"), faults(), ids=[f"{p}#{n}" for p, n in faults()])
def test_scenario_40_a_fault_in_any_phase_is_repaired_by_a_restart(
    template: Template, reference: Outcome, phase: str, occurrence: int
) -> None:
    for explicit in (True, False) if phase != "rollback:R0" else (True,):
        template.restore()
        with pytest.raises(Crash):
            Job(template.config(ckpt_step=1), ScriptedGenerator("crash"), fault=crash_at(phase, occurrence))
        # The same command again; or, once the intent is durable (R0 done), no --ckpt-step at all.
        again = template.config(ckpt_step=1) if explicit else template.config()
        with Job(again, ScriptedGenerator("after")) as job:
            assert job.plan.step == 1
            assert observe(job, template) == reference


# --------------------------------------------------------------------------- scenario 41


def test_scenario_41_gc_after_a_rollback_keeps_only_what_is_reached(template: Template) -> None:
    template.restore()
    before = set(pack_files(template.pool))
    with Job(template.config(ckpt_step=1), ScriptedGenerator("after")) as job:
        store = rollout_store(job.config).store
        store.seal()
        result = job.controller.collect_garbage()
        after = set(pack_files(template.pool))
        assert result["reclaimed_files"] > 0 and before - after  # packs of the later steps went
        roots = task_roots(job.controller)
        for n in (0, 1):
            queue_file = json.loads((template.save / "rollout" / f"queue_state_{n}.json").read_text())
            roots.append(RecordSetRef.from_dict(queue_file["manifest"]))
            builder = json.loads((template.save / "rollout" / f"builder_state_{n}.json").read_text())
            roots += [RecordSetRef.from_dict(builder["consumer"][k]) for k in ("state_ref", "progress_ref")]
            roots.append(
                RecordSetRef.from_dict(
                    read_archive_index(template.debug / f"rollout_{n}.straw.json")["manifest"]
                )
            )
        needed = reached_packs(store, roots)
        assert after - needed == set()  # nothing kept that no checkpoint, archive or live task reaches
        for entry in template.unfinished:  # step 1's prompts still load
            assert entry["prompt"].load(root=str(template.pool))
        with RolloutArchive(template.debug / "rollout_1.straw.json") as archive:
            samples = archive.load_samples()
            assert samples and all(s.tokens for s in samples)


# --------------------------------------------------------------------------- scenario 42


def damaged_restart(template: Template, caplog: pytest.LogCaptureFixture) -> tuple[Job, dict[str, Any]]:
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="straw.rollout"):
        job = Job(template.config(ckpt_step=1), ScriptedGenerator("after"))
    assert "no usable queue snapshot" in caplog.text
    tasks = job.controller.queue.tasks
    assert not [t for t in tasks if t.endswith(":t1")]  # nothing re-issued
    assert all(tasks[t]["state"] == "cancelled" for t in template.live)
    return job, job.controller.queue.producer_state("dataset")


def test_scenario_42_a_damaged_snapshot_restarts_an_empty_queue(
    template: Template, caplog: pytest.LogCaptureFixture
) -> None:
    rollout = template.save / "rollout"
    cursor_file = {
        "epoch_id": 0,
        "sample_offset": 13,
        "sample_group_index": 13,
        "sample_index": 26,
        "metadata": {},
    }
    # A rewritten queue_state_1.json: its cursor is not trusted; the cursor file is.
    template.restore()
    text = (rollout / "queue_state_1.json").read_text()
    (rollout / "queue_state_1.json").write_text(text.replace('"step":1', '"step": 1'))
    dataset = json.loads((rollout / "global_dataset_state_dict_1.json").read_text())
    job, producer = damaged_restart(template, caplog)
    with job:
        assert job.plan.cursor_source == "file"
        assert producer["cursor"] == {k: dataset[k] for k in cursor_file}
        assert "global_dataset_state_dict_1.json" in caplog.text
    # A deleted snapshot pack: the queue_state file's inline copy is the cursor.
    template.restore()
    index = json.loads((rollout / "queue_state_1.json").read_text())
    os.remove(template.pool / index["manifest"]["manifest"]["segment"]["path"])
    job, producer = damaged_restart(template, caplog)
    with job:
        assert job.controller.plan.snapshot_problem is not None
        assert producer["cursor"] == index["producer"]["cursor"]
        assert "inline copy" in caplog.text
        # A data source whose controller does not tell its plan (a proxy) reads the damaged
        # snapshot for its consumers' states: a warning, and they start fresh.
        job.controller.plan = dataclasses.replace(job.controller.plan, snapshot_problem=None)
        assert job.source._saved_consumers(1) == {}
        assert "Consumer states of step 1 cannot be read" in caplog.text
    # Removed rollout files: the dataset starts over.
    template.restore()
    for name in ("queue_state_1.json", "builder_state_1.json", "global_dataset_state_dict_1.json"):
        os.remove(rollout / name)
    job, producer = damaged_restart(template, caplog)
    with job:
        assert producer["cursor"]["sample_offset"] == 0 and producer["cursor"]["epoch_id"] == 0
        assert "offset 0" in caplog.text
    # A changed model file stays an error (nothing restarts empty over damaged weights).
    template.restore()
    meta = template.save / "iter_0000001" / "meta.json"
    meta.write_text(meta.read_text().replace("1", "7"))
    with pytest.raises(ValueError, match=r"Checkpoint component changed: iter_0000001/meta\.json"):
        Job(template.config(ckpt_step=1), ScriptedGenerator("after"))
    os.remove(meta)
    with pytest.raises(FileNotFoundError, match=r"Checkpoint component missing: iter_0000001/meta\.json"):
        Job(template.config(ckpt_step=1), ScriptedGenerator("after"))


# --------------------------------------------------------------------------- real crashes (issue 14 item 3)

CHILD = Path(__file__).with_name("ckpt_child.py")
#: The kills `make test` runs; every other phase and inner point runs under the slow marker.
CRASH_SAMPLE = {("rollback:R2", 1), ("rollback:R5", 1), ("rollback:R4:cancel", 3), ("rollback:R7:remove", 6)}


def run_child(spec: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(CHILD), json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S * 4,
        check=False,
        env=dict(env_with_tests()),
    )


def crash_cases() -> list[Any]:
    return [
        pytest.param(
            phase, n, id=f"{phase}#{n}", marks=() if (phase, n) in CRASH_SAMPLE else pytest.mark.slow
        )
        for phase, n in faults()
    ]


@pytest.mark.crash
@pytest.mark.parametrize(("phase", "occurrence"), crash_cases())
def test_a_rollback_killed_anywhere_ends_like_an_uninterrupted_one(
    template: Template, reference: Outcome, phase: str, occurrence: int
) -> None:
    for explicit in (True, False) if phase != "rollback:R0" else (True,):
        template.restore()
        spec = {
            "mode": "restart",
            "save": str(template.save),
            "pool": str(template.pool),
            "flags": {**template.flags(), "ckpt_step": 1},
            "phase": phase,
            "occurrence": occurrence,
        }
        result = run_child(spec)
        assert result.returncode == -signal.SIGKILL, result.stderr[-3000:]
        again = template.config(ckpt_step=1) if explicit else template.config()
        with Job(again, ScriptedGenerator("after")) as job:
            assert job.plan.step == 1
            assert observe(job, template) == reference


@pytest.mark.crash
def test_a_crash_before_the_commit_marker_leaves_an_unselectable_step(tmp_path: Path) -> None:
    save, pool = tmp_path / "save", tmp_path / "pool"
    flags = {"save_interval": 1, "rollout_queue_online_gc": True}
    spec = {"mode": "run", "save": str(save), "pool": str(pool), "flags": flags, "steps": 3,
            "kill_step": 2, "where": "before-marker"}  # fmt: skip
    result = run_child(spec)
    assert result.returncode == -signal.SIGKILL, result.stderr[-3000:]
    rollout = save / "rollout"
    assert (rollout / "queue_state_2.json").exists() and not (rollout / "committed_2.json").exists()
    model = (save / "iter_0000002" / "model.bin").read_bytes()
    config = job_config(save, pool, **flags)
    with Job(config, ScriptedGenerator("after")) as job:
        assert job.plan.step == 1
        store = rollout_store(job.config).store
        for name in ("queue_state_2.json", "builder_state_2.json", "global_dataset_state_dict_2.json"):
            assert not (rollout / name).exists()
            assert store.owners(f"checkpoint:{rollout / name}:") == []
        assert (save / "iter_0000002" / "model.bin").read_bytes() == model  # model files are never touched
        job.step(2)
        assert (rollout / "committed_2.json").exists()


@pytest.mark.crash
def test_a_crash_between_the_marker_and_the_tracker_selects_the_commit(tmp_path: Path) -> None:
    save, pool = tmp_path / "save", tmp_path / "pool"
    flags = {"save_interval": 1}
    spec = {"mode": "run", "save": str(save), "pool": str(pool), "flags": flags, "steps": 3,
            "kill_step": 2, "where": "before-tracker"}  # fmt: skip
    result = run_child(spec)
    assert result.returncode == -signal.SIGKILL, result.stderr[-3000:]
    assert (save / "rollout" / "committed_2.json").exists()
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "1\n"
    with Job(job_config(save, pool, **flags), ScriptedGenerator("after")) as job:
        assert job.plan.step == 2 and job.config.start_rollout_id == 3
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "2\n"
