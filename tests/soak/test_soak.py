"""The multi-client soak (issue 6, item 5): every role at once on two JuiceFS clients of one pool.

Roles run as separate OS processes (``tests/soak/soak_roles.py``), each printing one JSON
line per acknowledged event:

* a coordinator process on client A owns the queue and serves three worker processes (one
  on A, two on B) over pipe pairs; the workers publish their results through their own
  stores on their own clients and complete them through the coordinator;
* writer processes on both clients publish record sets and tensors with ``online_gc=True``,
  retain most of them under group owners, end every publication's staging, release owners
  at random and seal packs as they go;
* a collector process on client A loops ``collect_garbage()``.

Midway one worker on client B is ``SIGKILL``ed while it holds a lease (its result
published, not completed); the coordinator then retires it, which must return every
receipt that worker printed, and the lost lease goes back to pending for another worker.
When the time is up the writers stop, the coordinator seals its input and drains, the
collector stops, and the test checks the pool:

* ``straw check`` (the module and the console script) finds no error;
* after a ``Coordinator(recover=True)`` reopen on client B every receipt a worker printed
  is in ``read_commits`` at its position, identical, every submitted task was accepted
  exactly once and every result reads back;
* every publication a live owner still reaches reads back identically through client B;
* reclaimed bytes match what was released (see :func:`check_reclaimed`).

``make test`` runs a short variant (~20 s of load); ``make soak`` also runs the long one
(``STRAW_SOAK_SECONDS``, default 150 s of load).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import numpy as np
import pytest

from soak import soak_roles as roles
from straw import Coordinator
from straw.protocol import CommitReceipt, RecordSetRef
from straw.store import SharedFilesystemStore
from straw.tensor import TENSOR_CODEC, TensorRef

pytestmark = pytest.mark.juicefs

ROLES = Path(roles.__file__).resolve()
#: Bound on any single wait for a role's answer (startup, stop, drain, retire).
ANSWER_TIMEOUT_S = 90.0
LONG_SECONDS = float(os.environ.get("STRAW_SOAK_SECONDS", "150"))
SHORT_SECONDS = 15.0
VICTIM = "wk-x"


@dataclasses.dataclass
class Role:
    """One role process and every event it printed so far."""

    name: str
    process: subprocess.Popen[str]
    stderr: Path
    events: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    ended: bool = False

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["ev"] == kind]


class Soak:
    """Spawns role processes and pumps their event lines through one queue (no sleeping)."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.roles: dict[str, Role] = {}
        self.lines: queue.Queue[tuple[str, dict[str, Any] | None]] = queue.Queue()
        self.killed: set[str] = set()

    def spawn(self, name: str, role: str, config: dict[str, Any], fds: tuple[int, ...] = ()) -> Role:
        stderr = self.logs / f"{name}.stderr"
        with open(stderr, "w") as err:
            process = subprocess.Popen(
                [sys.executable, str(ROLES), role, json.dumps(config)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                pass_fds=fds,
            )
        self.roles[name] = Role(name, process, stderr)
        threading.Thread(target=self._read, args=(name, process.stdout), daemon=True).start()
        return self.roles[name]

    def _read(self, name: str, stdout: IO[str] | None) -> None:
        assert stdout is not None
        for line in stdout:
            self.lines.put((name, json.loads(line)))
        self.lines.put((name, None))

    def _fail(self, name: str, why: str) -> None:
        role = self.roles[name]
        tail = role.stderr.read_text()[-4000:] if role.stderr.exists() else ""
        pytest.fail(f"role {name}: {why}\n--- stderr ---\n{tail}", pytrace=False)

    def pump(self, deadline: float) -> None:
        """Take one event (waiting at most until ``deadline``) and file it under its role."""
        try:
            name, event = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            return
        role = self.roles[name]
        if event is None:
            role.ended = True
            if name not in self.killed and not role.of("closed") and not role.of("stopped"):
                self._fail(name, "ended without finishing")
            return
        role.events.append(event)
        if event["ev"] in ("error", "complete_error"):
            self._fail(name, f"reported {event}")

    def run_until(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            self.pump(deadline)

    def wait_for(self, what: str, predicate: Callable[[], bool], timeout: float = ANSWER_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() >= deadline:
                pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}", pytrace=False)
            self.pump(deadline)

    def send(self, name: str, line: str) -> None:
        stdin = self.roles[name].process.stdin
        assert stdin is not None
        stdin.write(line + "\n")
        stdin.flush()

    def close(self) -> None:
        for role in self.roles.values():
            if role.process.poll() is None:
                role.process.kill()
            role.process.wait(ANSWER_TIMEOUT_S)


@contextlib.contextmanager
def soak_processes(logs: Path) -> Iterator[Soak]:
    soak = Soak(logs)
    try:
        yield soak
    finally:
        soak.close()


def open_store(root: Path, declaration: dict[str, Any]) -> SharedFilesystemStore:
    codecs = ("bytes.v1", "json.v1", TENSOR_CODEC)
    return roles.open_store(str(root), declaration, codecs=codecs)


# --------------------------------------------------------------------------- the run


@dataclasses.dataclass
class Plan:
    seconds: float
    writers: dict[str, Path]
    pubs_per_pack: int
    batch: int
    collect_interval: float


def start(soak: Soak, plan: Plan, on_a: Path, on_b: Path, declaration: dict[str, Any]) -> None:
    """Coordinator and collector on A, workers on A and B (the victim on B), writers as planned."""
    workers = {"wk-a": on_a, "wk-b": on_b, VICTIM: on_b}
    channels, ends = [], {}
    for worker in workers:
        requests_r, requests_w = os.pipe()
        replies_r, replies_w = os.pipe()
        channels.append({"id": worker, "requests": requests_r, "replies": replies_w})
        ends[worker] = (requests_w, replies_r)
    coordinator_fds = tuple(fd for c in channels for fd in (c["requests"], c["replies"]))
    base = {"declaration": declaration}
    soak.spawn(
        "coordinator",
        "coordinator",
        {**base, "root": str(on_a), "workers": channels, "batch": plan.batch},
        coordinator_fds,
    )
    for worker, root in workers.items():
        requests_w, replies_r = ends[worker]
        config = {**base, "root": str(root), "requests": requests_w, "replies": replies_r}
        soak.spawn(worker, "worker", config, (requests_w, replies_r))
    for fd in coordinator_fds + tuple(fd for pair in ends.values() for fd in pair):
        os.close(fd)  # each end now lives only in its role, so a dead worker's channel ends
    for name, root in plan.writers.items():
        config = {**base, "root": str(root), "name": name, "pubs_per_pack": plan.pubs_per_pack}
        soak.spawn(name, "writer", config)
    soak.spawn("collector", "collector", {**base, "root": str(on_a), "interval": plan.collect_interval})
    for name, role in soak.roles.items():
        soak.wait_for(f"{name} to start", lambda role=role: bool(role.of("ready")))


def run(soak: Soak, plan: Plan) -> None:
    """Load for ``plan.seconds``; kill and retire the victim at 40 %; stop every role in order."""
    began = time.monotonic()
    soak.run_until(began + 0.4 * plan.seconds)
    victim, coordinator = soak.roles[VICTIM], soak.roles["coordinator"]
    soak.send(VICTIM, "hold")
    soak.wait_for("the victim to hold a lease", lambda: bool(victim.of("holding")))
    soak.killed.add(VICTIM)
    os.kill(victim.process.pid, signal.SIGKILL)
    assert victim.process.wait(ANSWER_TIMEOUT_S) == -signal.SIGKILL
    soak.send("coordinator", f"retire {VICTIM}")
    soak.wait_for("the retirement", lambda: bool(coordinator.of("retired")))
    soak.run_until(began + plan.seconds)
    writers = [soak.roles[name] for name in plan.writers]
    for writer in writers:
        soak.send(writer.name, "stop")
    for writer in writers:
        soak.wait_for(f"{writer.name} to close", lambda w=writer: bool(w.of("closed")))
    soak.send("coordinator", "stop")
    for name in ("coordinator", "wk-a", "wk-b"):
        soak.wait_for(f"{name} to close", lambda r=soak.roles[name]: bool(r.of("closed")))
    soak.send("collector", "stop")
    soak.wait_for("the collector to stop", lambda: bool(soak.roles["collector"].of("stopped")))
    soak.wait_for("every stdout to end", lambda: all(r.ended for r in soak.roles.values()))
    for role in soak.roles.values():
        expected = -signal.SIGKILL if role.name == VICTIM else 0
        assert role.process.wait(ANSWER_TIMEOUT_S) == expected, role.name


# --------------------------------------------------------------------------- the checks


def check_pool_is_clean(root: Path) -> None:
    """``straw check`` through the module and through the console script."""
    from straw._inspect.check import check_pool

    report = check_pool(root)
    errors = [f for f in report.findings if f.severity == "error"]
    assert report.ok and not errors, errors
    script = Path(sys.executable).parent / "straw"
    done = subprocess.run([str(script), "check", str(root)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def check_receipts(soak: Soak, on_b: Path, declaration: dict[str, Any]) -> list[CommitReceipt]:
    """Every printed receipt is accepted at its position; each task exactly once; results read back."""
    printed = {
        name: [CommitReceipt.from_dict(e["receipt"]) for e in soak.roles[name].of("receipt")]
        for name in ("wk-a", "wk-b", VICTIM)
    }
    (retired,) = soak.roles["coordinator"].of("retired")
    retired_receipts = [CommitReceipt.from_dict(r) for r in retired["receipts"]]
    assert set(printed[VICTIM]) <= set(retired_receipts)
    assert printed[VICTIM], "the victim was killed before it completed anything"
    (closed,) = soak.roles["coordinator"].of("closed")
    with open_store(on_b, declaration) as store:
        coordinator = Coordinator(store, exclusive_owner=roles.OWNER, recover=True)
        commits: list[CommitReceipt] = []
        while True:
            page = coordinator.read_commits(len(commits), 100)
            commits += page.commits
            if not page.commits:
                break
        assert page.end_of_input
        assert [c.position for c in commits] == list(range(len(commits)))
        for receipt in (r for receipts in [*printed.values(), retired_receipts] for r in receipts):
            assert commits[receipt.position] == receipt
        # The victim's lost lease went back to pending and another worker completed the
        # task; no other task ever lost a lease.
        (held,) = soak.roles[VICTIM].of("holding")
        retried = {t: s for t, s in coordinator.tasks.items() if s["failures"]}
        assert list(retried) == [held["task_id"]], retried
        status = retried[held["task_id"]]
        assert (status["state"], status["failures"]) == ("completed", 1), status
        assert status["lease"]["worker_id"] != VICTIM, status
        coordinator.close()
        assert sorted(c.task_id for c in commits) == [f"t{n:06d}" for n in range(closed["submitted"])]
        with store.read_session() as session:
            for commit in commits:
                (record,) = session.read(commit.result_ref)
                assert bytes(record.payload) == roles.result_payload(commit.task_id)
                assert record.metadata["task_id"] == commit.task_id
    return commits


@dataclasses.dataclass
class Ledger:
    """What the writers printed: owners' packs, releases, sealed pack sizes, publications."""

    reach: dict[str, set[str]] = dataclasses.field(default_factory=dict)
    released: set[str] = dataclasses.field(default_factory=set)
    sealed: dict[str, int] = dataclasses.field(default_factory=dict)
    publications: list[tuple[str, dict[str, Any]]] = dataclasses.field(default_factory=list)

    @classmethod
    def of(cls, soak: Soak, writers: list[str]) -> Ledger:
        ledger = cls()
        for name in writers:
            for event in soak.roles[name].events:
                if event["ev"] == "retain":  # replaces the owner's packs, as retain does
                    ledger.reach[event["owner"]] = set(event["packs"])
                elif event["ev"] == "release":
                    ledger.released.add(event["owner"])
                elif event["ev"] == "sealed":
                    ledger.sealed[event["pack"]] = event["bytes"]
                elif event["ev"] == "publish":
                    ledger.publications.append((name, event))
        return ledger

    def released_packs(self) -> set[str]:
        """Sealed packs that no unreleased owner reaches (every pack had a guard owner)."""
        live = set().union(*(p for o, p in self.reach.items() if o not in self.released))
        return set(self.sealed) - live


def check_reclaimed(
    soak: Soak,
    ledger: Ledger,
    commits: list[CommitReceipt],
    pool: tuple[Path, Path],
    declaration: dict[str, Any],
) -> int:
    """Reclaimed bytes match what was released (returns how many packs were reclaimed).

    Comparable quantities: every writer pack had a guard owner from its first publication
    until the writer had sealed it and printed its final size, and every publication's
    staging ended right after it was written, so a writer pack becomes collectable exactly
    when every owner that the printed ``retain`` events say reaches it has a printed
    ``release``; its reclaimed size is the printed sealed size (seal cuts the zeros ahead,
    nothing is appended after). Every worker pack holds accepted results, which the queue
    owns, so none is reclaimed: the others only publish what they complete, and the victim
    (one pack) was killed after its first receipt, its last result published but never
    completed. Hence the bytes of every collector pass plus a
    final collection equal the printed sizes of the released packs, the files equal their
    number, and exactly the other packs remain on disk.
    """
    on_a, on_b = pool
    passes = soak.roles["collector"].of("collect")
    (retired,) = soak.roles["coordinator"].of("retired")
    victim_subs = {r["submission_id"] for r in retired["receipts"]}
    (victim_pack,) = {c.result_ref.manifest.segment.path for c in commits if c.submission_id in victim_subs}
    (held,) = soak.roles[VICTIM].of("holding")
    assert RecordSetRef.from_dict(held["ref"]).manifest.segment.path == victim_pack
    with open_store(on_b, declaration) as store:
        final = store.collect_garbage()
        again = store.collect_garbage()
        why = store.explain(victim_pack)
    # The victim's pack was sealed by a collector that found it dead; the queue owns it.
    assert (why["writer_dead"], why["sealed"], why["exists"]) == (True, True, True), why
    assert [o for o in why["owners"] if o.startswith("queue:")], why
    assert (again["reclaimed_files"], again["reclaimed_bytes"]) == (0, 0)
    expected = ledger.released_packs()
    assert expected, "nothing was released: the soak exercised no reclamation"
    files = sum(p["reclaimed_files"] for p in passes) + final["reclaimed_files"]
    size = sum(p["reclaimed_bytes"] for p in passes) + final["reclaimed_bytes"]
    assert (files, size) == (len(expected), sum(ledger.sealed[p] for p in expected))
    assert sum(p["reclaimed_files"] for p in passes) > 0, "the collector loop reclaimed nothing"
    worker_packs = {c.result_ref.manifest.segment.path for c in commits}
    on_disk = {str(p.relative_to(on_a)) for p in on_a.glob("raw/*/*.pack")}
    assert on_disk == (set(ledger.sealed) - expected) | worker_packs
    return len(expected)


def check_owned_reads(ledger: Ledger, on_b: Path, declaration: dict[str, Any]) -> int:
    """Every publication a live owner still reaches reads back identically through client B."""
    checked = 0
    with open_store(on_b, declaration) as store:
        for writer, event in ledger.publications:
            owner = event["owner"]
            if owner is None or owner in ledger.released:
                continue
            ref = RecordSetRef.from_dict(event["ref"])
            if event["kind"] == "tensor":
                array = TensorRef.from_record_set(store, ref, 0).numpy(reader=store)
                assert np.array_equal(array, roles.tensor_array(writer, event["index"]))
            else:
                got = [(r.record_id, bytes(r.payload)) for r in store.read(ref)]
                assert got == roles.record_payloads(writer, event["index"])
            checked += 1
    return checked


def soak_once(plan: Plan, clients: Any, pool: tuple[Path, Path], logs: Path) -> None:
    on_a, on_b = pool
    declaration = clients.declaration
    open_store(on_a, declaration).close()  # the pool exists before the roles race to use it
    with soak_processes(logs) as soak:
        start(soak, plan, on_a, on_b, declaration)
        run(soak, plan)
    commits = check_receipts(soak, on_b, declaration)
    ledger = Ledger.of(soak, list(plan.writers))
    reclaimed = check_reclaimed(soak, ledger, commits, pool, declaration)
    owned = check_owned_reads(ledger, on_b, declaration)
    assert owned > 0
    summary = {
        "publications": len(ledger.publications),
        "owned_read_back": owned,
        "packs_sealed": len(ledger.sealed),
        "packs_reclaimed": reclaimed,
        "collector_passes": soak.roles["collector"].of("stopped")[0]["passes"],
        "commits": len(commits),
        "victim_receipts": len(soak.roles[VICTIM].of("receipt")),
    }
    print(f"soak summary: {json.dumps(summary)}")
    check_pool_is_clean(on_a)


def test_soak_short(juicefs_clients: Any, juicefs_pool: tuple[Path, Path], tmp_path: Path) -> None:
    on_a, on_b = juicefs_pool
    plan = Plan(SHORT_SECONDS, {"wr-a": on_a, "wr-b": on_b}, pubs_per_pack=5, batch=8, collect_interval=0.2)
    soak_once(plan, juicefs_clients, juicefs_pool, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(LONG_SECONDS + 300)
def test_soak_long(juicefs_clients: Any, juicefs_pool: tuple[Path, Path], tmp_path: Path) -> None:
    on_a, on_b = juicefs_pool
    writers = {"wr-a": on_a, "wr-b": on_b, "wr-c": on_b}
    plan = Plan(LONG_SECONDS, writers, pubs_per_pack=12, batch=16, collect_interval=0.5)
    soak_once(plan, juicefs_clients, juicefs_pool, tmp_path)
