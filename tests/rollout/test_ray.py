"""straw.rollout.ray on a real local cluster of three Ray nodes on 127.0.0.1 (scenarios 58-59).

The cluster is started once for the module (``ray.cluster_utils.Cluster``); each test opens
its own controller actor, data source and ``DistributedRollout`` over a pool under
``tmp_path`` (one run uses the two-client JuiceFS mount). Generators are the node-aware
:class:`ray_helpers.Scripted`; "every worker is generating" is awaited on the
:class:`ray_helpers.Gate` actor, never on a timer. The storage probe's wrong-mount node runs
in a mount namespace of its own, where the pool path is bound over an empty directory.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # a loopback address is not rewritten to the host's

import ray
import ray._private.ray_constants
from ray.cluster_utils import Cluster

from juicefs_mount import wait_until
from ray_helpers import PARTIAL_TOKENS, Gate, OffsetClock, Scripted
from straw.protocol import RecordSetRef
from straw.rollout.config import RolloutConfig
from straw.rollout.hooks import Hooks
from straw.rollout.ray import (
    DistributedRollout,
    RayControllerClient,
    check_rollout_storage,
    controller_actor,
    split_concurrency,
)
from straw.rollout.reader import QueueDataSource
from straw.rollout.refs import DiskPayloadRef, load_groups
from straw.rollout.sample import SampleStatus, iter_samples

TESTS = Path(__file__).resolve().parents[1]
WAIT = 60.0
NODES = 3


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    ray._private.ray_constants.ENABLE_RAY_CLUSTER = False  # in case Ray was imported before this module
    local = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "node_ip_address": "127.0.0.1", "include_dashboard": False},
    )
    try:
        for _ in range(NODES - 1):
            local.add_node(num_cpus=1, node_ip_address="127.0.0.1")
        ray.init(
            address=local.address,
            _node_ip_address="127.0.0.1",
            log_to_driver=False,
            job_config=ray.job_config.JobConfig(code_search_path=[str(TESTS), str(TESTS / "rollout")]),
        )
        local.wait_for_nodes()
        yield local
    finally:
        ray.shutdown()
        local.shutdown()


def node_ids() -> list[str]:
    nodes = [n for n in ray.nodes() if n["Alive"]]
    return [n["NodeID"] for n in sorted(nodes, key=lambda n: (n["NodeManagerAddress"], n["NodeID"]))]


class Job:
    """A controller actor, its data source and (once made) a distributed rollout; all closed at the end."""

    def __init__(self, config: RolloutConfig, clock: Callable[[], float] | None = None) -> None:
        self.client = controller_actor(
            config, dataset_factory=[{"input": f"prompt {i}"} for i in range(200)], clock=clock
        )
        self.config = self.client.config
        self.source = QueueDataSource(self.config, controller=self.client)
        self.rollout: DistributedRollout | None = None
        self.closed = False

    def start(self, factory: Callable[[], Any], **options: Any) -> DistributedRollout:
        options.setdefault("weight_version", "1")
        self.rollout = DistributedRollout(self.config, self.source, factory, **options)
        return self.rollout

    def status(self, task_id: str) -> dict[str, Any]:
        status = self.client.status(task_id)
        assert status is not None, task_id
        return status

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            if self.rollout is not None:
                self.rollout.close()
        finally:
            try:
                self.source.close()
            finally:
                self.client.close()


@pytest.fixture
def open_job(cluster: Cluster, tmp_path: Path) -> Iterator[Callable[..., Job]]:
    made: list[Job] = []

    def open_(clock: Callable[[], float] | None = None, **flags: Any) -> Job:
        flags.setdefault("rollout_data_dir", str(tmp_path / "pool"))
        job = Job(RolloutConfig.from_args(SimpleNamespace(**flags)), clock)
        made.append(job)
        return job

    yield open_
    for job in reversed(made):
        job.close()


def scripted(modes: dict[str, str], default: str = "instant", gate: Any = None) -> Callable[[], Any]:
    return functools.partial(Scripted, modes, default, gate)


def task_of(job: Job, ref: Any) -> dict[str, Any]:
    """The prompt task whose result is the group reference ``ref``."""
    (sample, *_) = iter_samples(load_groups([ref])[0])
    return job.status(f"prompt:{sample.group_index}")


# --------------------------------------------------------------------------- scenario 58


def test_scenario_58_concurrency_is_split_per_node() -> None:
    assert split_concurrency(10, 2, 2) == [3, 2]
    assert split_concurrency(10, 2, 3) == [2, 2, 1]
    with pytest.raises(ValueError, match="at least one prompt group per node"):
        split_concurrency(2, 2, 2)
    with pytest.raises(ValueError, match="total_concurrency must be a positive integer"):
        split_concurrency(0, 1, 1)


def test_scenario_58_one_worker_per_node_with_its_share(open_job: Callable[..., Job]) -> None:
    job = open_job(rollout_batch_size=2, n_samples_per_prompt=2)
    with pytest.raises(ValueError, match="at least one prompt group per node"):
        DistributedRollout(job.config, job.source, scripted({}), total_concurrency=4)  # 2 groups, 3 nodes
    with pytest.raises(ValueError, match="not supported by distributed fully-async rollout"):
        DistributedRollout(
            job.config, object(), None, hooks=Hooks(all_samples_process=print), total_concurrency=10
        )  # refused before anything else is looked at
    rollout = job.start(scripted({}), total_concurrency=10)
    info = rollout.workers_info
    assert [w["capacity"] for w in info] == [2, 2, 1]
    assert [w["node_id"] for w in info] == node_ids()  # one worker on every node, in node order
    assert [w["reader_id"] for w in info] == ["fully_async_0", "fully_async_1", "fully_async_2"]
    assert rollout.scheduler.capacity == 5
    output = rollout.generate(0)
    groups = load_groups(output.groups)
    assert len(groups) == 2 and all(len(g) == 2 for g in groups)
    assert all(s.status is SampleStatus.COMPLETED and s.weight_versions == ["1"] for g in groups for s in g)
    reports = rollout.call_generators("report")
    assert [r["node"] for r in reports] == node_ids()


def test_the_source_must_be_over_a_controller_actor(open_job: Callable[..., Job], tmp_path: Path) -> None:
    job = open_job()
    local = SimpleNamespace(reader_config=job.source.reader_config, controller=object())
    with pytest.raises(TypeError, match="RayControllerClient"):
        DistributedRollout(job.config, local, scripted({}), total_concurrency=3)
    assert isinstance(job.client, RayControllerClient)
    with pytest.raises(ValueError, match="num_samples must be nonnegative"):
        job.source.get_samples(-1)  # a controller error crosses the actor boundary unchanged


# --------------------------------------------------------------------------- a fast node fills the batch


def juicefs_config(juicefs_clients: Any, tmp_path: Path) -> dict[str, Any]:
    declaration = tmp_path / "declaration.json"
    declaration.write_text(json.dumps(juicefs_clients.declaration))
    return {"rollout_storage_profile": "juicefs", "rollout_storage_declaration": str(declaration)}


@pytest.mark.parametrize("pool", ["local", pytest.param("juicefs", marks=pytest.mark.juicefs)])
def test_a_fast_worker_fills_the_batch_while_a_slow_one_generates(
    pool: str, open_job: Callable[..., Job], tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    flags: dict[str, Any] = {"rollout_batch_size": 4}
    if pool == "juicefs":
        on_a, _ = request.getfixturevalue("juicefs_pool")
        flags.update(juicefs_config(request.getfixturevalue("juicefs_clients"), tmp_path))
        flags["rollout_data_dir"] = str(on_a / "pool")
    job = open_job(**flags)
    slow = node_ids()[0]
    gate = Gate.remote()  # type: ignore[attr-defined]
    rollout = job.start(scripted({slow: "block"}, gate=gate), total_concurrency=3)
    output = rollout.generate(0)
    assert ray.get(gate.wait_for.remote(1))
    assert slow in ray.get(gate.seen.remote())  # the slow worker is generating all along
    workers = {task_of(job, ref)["lease"]["worker_id"] for ref in output.group_refs or []}
    assert workers and "fully_async_0" not in workers  # the batch came from the fast nodes alone
    assert len(load_groups(output.groups)) == 4
    # the slow worker's group is still being generated: its task is leased by fully_async_0
    leased = [
        s
        for g in range(12)
        if (s := job.client.status(f"prompt:{g}")) is not None
        and s["state"] == "leased"
        and s["lease"]["worker_id"] == "fully_async_0"
    ]
    assert leased
    job.close()  # before the pool's fixture removes the directory


# --------------------------------------------------------------------------- pause during a weight update


def test_pause_admission_keeps_partials_and_resumes_them_under_the_new_version(
    open_job: Callable[..., Job],
) -> None:
    job = open_job(rollout_batch_size=3)
    gate = Gate.remote()  # type: ignore[attr-defined]
    rollout = job.start(scripted({}, default="interrupt", gate=gate), total_concurrency=3)
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        step = pool.submit(rollout.generate, 0)
        assert ray.get(gate.wait_for.remote(3))  # every worker is inside a generation
        was_paused = rollout.pause_admission()
        assert was_paused is False
        for g in range(3):  # each in-flight group is a pending partial now, no attempt spent
            status = job.status(f"prompt:{g}")
            assert status["state"] == "pending" and status["failures"] == 0
            assert status["spec"]["priority"] == 1 and status["spec"]["metadata"]["returned"] is True
            (partial,) = DiskPayloadRef(
                RecordSetRef.from_dict(status["spec"]["input_ref"]), str(job.config.rollout_data_dir)
            ).load()
            assert partial.response_length == PARTIAL_TOKENS and partial.weight_versions == ["1"]
        assert not step.done()
        rollout.set_weight_version("2")
        rollout.resume_admission(was_paused)
        output = step.result(WAIT)
    finally:
        pool.shutdown()
    groups = load_groups(output.groups)
    assert sorted(s.group_index for g in groups for s in g) == [0, 1, 2]
    for (sample,) in groups:
        assert sample.status is SampleStatus.COMPLETED and sample.weight_versions == ["1", "2"]
        spans = [(s["start"], s["stop"], s["reported_versions"]) for s in sample.queue_policy_segments]
        assert spans == [(0, PARTIAL_TOKENS, ["1"]), (PARTIAL_TOKENS, PARTIAL_TOKENS + 2, ["2"])]
        status = job.status(f"prompt:{sample.group_index}")
        assert status["state"] == "completed" and status["failures"] == 0


# --------------------------------------------------------------------------- losing a worker


def tasks_of(job: Job, worker: str, state: str, groups: int) -> set[int]:
    """Group indices among the first ``groups`` whose task is in ``state`` under ``worker``'s lease."""
    found = set()
    for g in range(groups):
        status = job.client.status(f"prompt:{g}")
        if status is not None and status["state"] == state and status["lease"]["worker_id"] == worker:
            found.add(g)
    return found


def accepted_by(job: Job, worker: str, groups: int) -> set[int]:
    return tasks_of(job, worker, "completed", groups)


def leased_by(job: Job, worker: str, groups: int) -> set[int]:
    return tasks_of(job, worker, "leased", groups)


def test_a_killed_worker_loses_no_accepted_group_and_its_leases_return(
    open_job: Callable[..., Job],
) -> None:
    job = open_job(rollout_batch_size=1, rollout_queue_lease_seconds=2.0)
    nodes = node_ids()
    # fully_async_0 (2 slots) completes at once; fully_async_1 (2 slots) blocks holding its leases.
    rollout = job.start(scripted({nodes[1]: "block"}), total_concurrency=5)
    first = rollout.generate(0)
    delivered = {s.group_index for g in load_groups(first.groups) for s in g}
    # the window is closed now (no demand): the instant worker keeps its slots' results undelivered
    assert wait_until(lambda: len(accepted_by(job, "fully_async_0", 12) - delivered) >= 1, WAIT)
    assert wait_until(lambda: len(leased_by(job, "fully_async_1", 12)) == 2, WAIT)
    undelivered = accepted_by(job, "fully_async_0", 12) - delivered
    held = leased_by(job, "fully_async_1", 12)
    ray.kill(rollout.actors[0], no_restart=True)
    ray.kill(rollout.actors[1], no_restart=True)
    kept: set[int] = set()
    step = 1
    while not (undelivered <= kept and held <= accepted_by(job, "fully_async_2", 40)) and step < 30:
        kept.update(s.group_index for g in load_groups(rollout.generate(step).groups) for s in g)
        step += 1
    assert undelivered <= kept  # every accepted, undelivered group of the dead worker reached a batch
    assert rollout.scheduler.capacity == 1
    # the dead worker's leased tasks were taken again by the surviving worker and completed
    assert held <= accepted_by(job, "fully_async_2", 40)


def group_indices(output: Any) -> list[int]:
    """The prompt group of every group of a rollout step, in batch order (one entry per group)."""
    return [next(iter(iter_samples(group))).group_index for group in load_groups(output.groups)]


def test_a_frozen_workers_leases_are_taken_again_only_after_they_expire(
    open_job: Callable[..., Job], tmp_path: Path
) -> None:
    """A worker that stops without dying is noticed by nobody; only its leases' expiry frees its tasks.

    SIGSTOP freezes two workers' processes: Ray still sees them alive and the scheduler's calls
    to them just wait, so nobody retires them or revokes their leases (a killed actor, by
    contrast, is reported at once and retired). fully_async_1 holds two leased groups it is
    generating, fully_async_0 holds accepted groups no batch has taken. The survivor serves
    the steps; the queue's clock then passes the leases' deadline, the survivor takes the frozen
    worker's tasks again and completes them. SIGKILL finally ends the frozen processes: the
    scheduler sees the loss and recovers fully_async_0's accepted groups. Every group reaches a
    batch exactly once.
    """
    lease = 30.0  # longer than the test: no lease expires unless the queue's clock is moved
    clock = OffsetClock(tmp_path / "queue-clock")
    job = open_job(rollout_batch_size=1, rollout_queue_lease_seconds=lease, clock=clock)
    nodes = node_ids()
    # fully_async_0 (2 slots) completes at once; fully_async_1 (2 slots) blocks holding its leases.
    rollout = job.start(scripted({nodes[1]: "block"}), total_concurrency=5)
    pids = [int(report["pid"]) for report in rollout.call_generators("report")]
    readers = ["fully_async_0", "fully_async_1", "fully_async_2"]
    kept = group_indices(rollout.generate(0))
    assert wait_until(lambda: len(accepted_by(job, "fully_async_0", 12) - set(kept)) >= 1, WAIT)
    assert wait_until(lambda: len(leased_by(job, "fully_async_1", 12)) == 2, WAIT)
    frozen = pids[:2]
    for pid in frozen:
        os.kill(pid, signal.SIGSTOP)
    try:
        undelivered = accepted_by(job, "fully_async_0", 12) - set(kept)
        held = {g: job.status(f"prompt:{g}") for g in leased_by(job, "fully_async_1", 12)}
        for step in range(1, 4):  # the survivor serves these steps alone, taking fresh groups
            kept += group_indices(rollout.generate(step))
        assert rollout.scheduler.live_readers() == readers and rollout.scheduler.capacity == 5
        for g, before in held.items():  # untouched: nobody revoked them and they have not expired
            now = job.status(f"prompt:{g}")
            assert now["state"] == "leased" and now["lease"] == before["lease"] and now["failures"] == 0
        # The survivor holds no lease of its own now (its slot holds a finished group), so moving
        # the queue's clock past every deadline expires only the frozen worker's leases.
        assert wait_until(lambda: not leased_by(job, "fully_async_2", 40), WAIT)
        clock.jump(lease + 1.0)

        def taken_again() -> bool:
            return all(job.status(f"prompt:{g}")["lease"]["worker_id"] == "fully_async_2" for g in held)

        step, bound = 4, time.monotonic() + WAIT
        while not taken_again() and step < 40 and time.monotonic() < bound:
            kept += group_indices(rollout.generate(step))
            step += 1
        assert taken_again()
        for g, before in held.items():
            after = job.status(f"prompt:{g}")
            old, new = before["lease"], after["lease"]
            assert after["failures"] == 1  # the expired attempt was spent, as an expiry spends one
            assert after["generation"] == before["generation"] + 1
            assert new["attempt_id"] != old["attempt_id"]
            assert new["coordinator_epoch"] == old["coordinator_epoch"]  # no recovery revoked it
        # still nobody retired the frozen workers: expiry alone gave their tasks to the survivor
        assert rollout.scheduler.live_readers() == readers
    finally:
        for pid in frozen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def settled() -> bool:  # both killed workers noticed (each when the scheduler next needs it)
        covered = (undelivered | set(held)) <= set(kept)
        return covered and rollout.scheduler.live_readers() == ["fully_async_2"]

    bound = time.monotonic() + WAIT
    while not settled() and step < 80 and time.monotonic() < bound:
        kept += group_indices(rollout.generate(step))
        step += 1
    assert undelivered <= set(kept)  # the dead worker's accepted, undelivered groups reached a batch
    assert set(held) <= set(kept)  # the expired tasks were completed by the survivor and trained
    assert len(kept) == len(set(kept))  # no group reached two batches
    assert rollout.scheduler.live_readers() == ["fully_async_2"] and rollout.scheduler.capacity == 1
    for g in held:
        assert job.status(f"prompt:{g}")["state"] == "completed"


# --------------------------------------------------------------------------- the storage probe (scenario 59)


def test_scenario_59_probe_failure_names_the_pool(
    open_job: Callable[..., Job], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    config = RolloutConfig.from_args(SimpleNamespace(rollout_data_dir=str(tmp_path / "probe")))
    check_rollout_storage(config)  # every node of the cluster shares the pool

    def missing(*args: Any, **kwargs: Any) -> Any:
        raise FileNotFoundError("no such mount")

    monkeypatch.setattr(ray, "nodes", lambda: [])
    monkeypatch.setattr(ray, "get", missing)
    with pytest.raises(RuntimeError, match="All rollout/training nodes must share the run") as caught:
        check_rollout_storage(config)
    assert f"--rollout-data-dir={tmp_path / 'probe'}" in str(caught.value)
    assert isinstance(caught.value.__cause__, FileNotFoundError)


#: A child that starts one Ray worker node (what ``Cluster.add_node`` does) and keeps it until stdin closes.
NODE_CHILD = """
import os, sys
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
import ray._private.node, ray._private.parameter
params = ray._private.parameter.RayParams(
    gcs_address=sys.argv[1], node_ip_address="127.0.0.1", num_cpus=1, num_gpus=0,
    object_store_memory=150 << 20, min_worker_port=0, max_worker_port=0,
    include_log_monitor=False, node_manager_port=0,
)
params.dashboard_agent_listen_port = None
node = ray._private.node.Node(params, head=False, shutdown_at_exit=True, spawn_reaper=True)
sys.stdin.read()
node.kill_all_processes(check_alive=False, allow_graceful=True)
"""


def alive() -> int:
    return len([n for n in ray.nodes() if n["Alive"]])


@contextlib.contextmanager
def node_with_wrong_mount(cluster: Cluster, pool: Path, tmp_path: Path) -> Iterator[None]:
    """One more Ray node whose processes see an empty directory at ``pool`` (own mount namespace)."""
    empty = tmp_path / "elsewhere"
    empty.mkdir()
    if shutil.which("unshare") is None:
        pytest.skip("unshare is not available: cannot give one node another mount")
    script = f'mount --make-rprivate / && mount --bind "{empty}" "{pool}" && exec "$0" -c "$1" "$2"'
    before = alive()
    process = subprocess.Popen(
        ["unshare", "-m", "sh", "-c", script, sys.executable, NODE_CHILD, cluster.address],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        if not wait_until(lambda: alive() > before or process.poll() is not None, WAIT) or process.poll():
            process.kill()
            _, err = process.communicate(timeout=WAIT)
            pytest.skip(f"cannot start a node in its own mount namespace: {err.decode()[-500:]}")
        yield
    finally:
        if process.stdin is not None:
            process.stdin.close()  # the child stops its node and exits
        process.wait(WAIT)
        assert wait_until(lambda: alive() == before, WAIT)


def test_the_probe_fails_when_a_nodes_mount_is_wrong(cluster: Cluster, tmp_path: Path) -> None:
    pool = tmp_path / "pool"
    config = RolloutConfig.from_args(SimpleNamespace(rollout_data_dir=str(pool)))
    check_rollout_storage(config)  # creates the pool; every node sees it
    with node_with_wrong_mount(cluster, pool, tmp_path):
        with pytest.raises(RuntimeError, match="All rollout/training nodes must share the run") as caught:
            check_rollout_storage(config, timeout=WAIT)
        assert f"--rollout-data-dir={pool}" in str(caught.value)
    check_rollout_storage(config)  # the node is gone: the probe passes again
