"""The seeded simulation: straw's store, catalog and queue on a power-failing in-memory disk.

``Simulation(seed).run()`` installs ``FaultFS(seed)`` (straw.testing) as straw's filesystem,
opens a pool with two writer stores (online GC) and a coordinator (injected clock), and
runs random operations chosen by ``random.Random(seed)``: publish, retain, release,
release_publications, seal, collect_garbage, submit, acquire, complete (result published
first), fail, clock advances. At random points the disk loses power, between operations
or inside one (``fail_after``); every object is dropped, the pool is reopened
(``Coordinator(recover=True)``), garbage is collected, and the reference model is
checked:

* every acknowledged publication (its ``publish`` returned) reads back byte for byte while
  it is staged (its writer alive and not released) or retained by an owner not released;
* every acknowledged completion is in ``read_commits`` exactly once, at its receipt's
  position, with its digest, and its result reads back (the queue owns it);
* no task is completed twice, and nothing is accepted that was never submitted;
* the inputs of unfinished tasks read back (nothing reachable was deleted).

At other random points one I/O error (``FaultFS.fail_next``: EIO or ENOSPC on a write,
sync, open, truncate, link, rename, unlink or mkdir) is injected into the next operation.
If it fires and the operation raises, the error must be straw's (``StorageUnavailable``,
``QuotaExceeded`` for ENOSPC, ``IndeterminateCommit``, ``UnsafeRecovery``); a publish that
raised ``IndeterminateCommit`` is retried with the same submission and must return its
reference (I5); a coordinator that stopped (J3) is closed and reopened with
``recover=True`` in a fresh object, without a power loss; then the model is checked.

Operations that raised because of a power loss or an injected error are unknown: either
outcome is allowed, never half of one. Every source of randomness straw uses (``secrets``) is seeded too, so a
seed replays exactly.
"""

from __future__ import annotations

import contextlib
import errno
import random
import secrets
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import straw._journal.log as journal_log
import straw._pack.writer as pack_writer
from sim import damage as sim_damage
from straw import Coordinator, SharedFilesystemStore, TaskSpec
from straw._fs.system import installed
from straw.backend import FilesystemBackend
from straw.errors import (
    CorruptData,
    IdempotencyConflict,
    IndeterminateCommit,
    LeaseExpired,
    StaleAttempt,
    StorageUnavailable,
    UnsafeRecovery,
)
from straw.protocol import CommitReceipt, Lease, Record, RecordSetRef
from straw.testing import FaultFS

ROOT = "/sim/pool"
RUN = "run-sim"
LEASE_SECONDS = 10.0
# Domain answers a correct run may give: a lease that expired, an attempt revoked, and the
# completion of a stale attempt under a submission id the task's accepted completion used.
EXPECTED = (LeaseExpired, StaleAttempt, IdempotencyConflict)
# What an operation may raise when an injected I/O error fired inside it.
STORAGE_ERRORS = (StorageUnavailable, IndeterminateCommit, UnsafeRecovery)
# A3: a sync after a failed one proves nothing; FaultFS models exactly that (sticky sync errors).
STICKY_SYNC_ERRORS = True
FAULT_WEIGHTS = {
    "write": 4,
    "sync": 4,
    "open": 2,
    "truncate": 1,
    "link": 1,
    "rename": 1,
    "unlink": 1,
    "mkdir": 1,
}


def replay_command(seed: int) -> str:
    return f"STRAW_SIM_SEED={seed} .venv/bin/python -m pytest tests/sim"


class Clock:
    """The coordinator's injected clock."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass(eq=False)
class Pub:
    """An acknowledged publication and what keeps it alive in the model."""

    ref: RecordSetRef
    payload: bytes
    writer: str
    staged: bool = True


@dataclass
class Model:
    pubs: list[Pub] = field(default_factory=list)
    owners: dict[str, list[Pub]] = field(default_factory=dict)
    receipts: dict[str, tuple[CommitReceipt, bytes]] = field(default_factory=dict)  # task -> receipt
    maybe_completed: set[str] = field(default_factory=set)  # completions whose call raised
    submitted: dict[str, Pub | None] = field(default_factory=dict)  # acknowledged task -> input
    maybe_submitted: set[str] = field(default_factory=set)
    leases: list[Lease] = field(default_factory=list)

    def required(self) -> list[Pub]:
        """Publications that must read back now."""
        seen: dict[int, Pub] = {id(p): p for p in self.pubs if p.staged}
        for pubs in self.owners.values():
            seen.update((id(p), p) for p in pubs)
        return list(seen.values())


@contextlib.contextmanager
def seeded_straw(seed: int) -> Iterator[None]:
    """Seed straw's own randomness (writer ids, pack names) and shrink its preallocation."""
    rng = random.Random(seed ^ 0x5EED)
    saved = (secrets.token_hex, secrets.randbits, journal_log.JOURNAL_PREALLOC_BYTES)
    saved_pack = pack_writer.PACK_PREALLOC_BYTES
    secrets.token_hex = lambda n=32: rng.randbytes(n).hex()  # type: ignore[assignment]
    secrets.randbits = rng.getrandbits
    # Smaller zero-fill (J1.1, D1.2a) keeps the in-memory disk small; the logic is the same.
    journal_log.JOURNAL_PREALLOC_BYTES = 64 * 1024
    pack_writer.PACK_PREALLOC_BYTES = 16 * 1024
    try:
        yield
    finally:
        secrets.token_hex, secrets.randbits, journal_log.JOURNAL_PREALLOC_BYTES = saved  # type: ignore[assignment]
        pack_writer.PACK_PREALLOC_BYTES = saved_pack


class SimulationFailure(AssertionError):
    """The reference model and straw disagree (the message replays the seed)."""


class Simulation:
    """One seeded run (see the module docstring)."""

    def __init__(
        self, seed: int, steps: int = 150, *, fs: FaultFS | None = None, sticky: bool = STICKY_SYNC_ERRORS
    ) -> None:
        self.seed = seed
        self.steps = steps
        self.rng = random.Random(seed)
        self.fs = fs if fs is not None else FaultFS(seed, sticky_sync_errors=sticky)
        self.fs.makedirs_durable("/sim")
        self.clock = Clock()
        self.model = Model()
        self.trace: list[str] = []
        self.stores: list[SharedFilesystemStore] = []
        self.coord: Coordinator | None = None
        self.counter = 0
        self.crashes = 0
        self.errors = 0  # injected I/O errors that fired
        self.reopened = 0  # coordinators reopened after a fail-stop (J3) without a power loss

    # ------------------------------------------------------------------ driver

    def run(self) -> None:
        with installed(self.fs), seeded_straw(self.seed):
            try:
                self._reopen(first=True)
                for _ in range(self.steps):
                    self._step()
                self._crash("final power loss")
            except SimulationFailure:
                raise
            except BaseException as error:
                self._fail(f"unexpected {type(error).__name__}: {error}", error)

    def _fail(self, why: str, cause: BaseException | None = None) -> None:
        tail = "\n  ".join(self.trace[-40:])
        message = (
            f"simulation seed {self.seed} failed: {why}\n"
            f"replay: {replay_command(self.seed)}\n"
            f"last steps:\n  {tail}\n"
            f"last crash: {'; '.join(self.fs.last_crash[-12:])}"
        )
        raise SimulationFailure(message) from cause

    def _note(self, text: str) -> None:
        self.trace.append(f"[{len(self.trace)}] {text}")

    def _step(self) -> None:
        ops: list[tuple[int, Callable[[], None]]] = [
            (6, self._publish),
            (2, self._retain),
            (1, self._release),
            (1, self._release_publications),
            (1, self._seal),
            (1, self._collect),
            (3, self._submit),
            (5, self._work),
            (2, self._acquire_only),
            (2, self._complete_held),
            (1, self._advance),
            (1, self._check_live),
            (1, self._register_checkpoint),
            (1, self._release_checkpoint),
            (1, self._damage),
        ]
        op = self.rng.choices([f for _, f in ops], weights=[w for w, _ in ops])[0]
        roll = self.rng.random()
        if roll < 0.04:
            self._crash("power loss between operations")
            return
        if roll < 0.12:
            self.fs.fail_after(self.rng.randint(1, 12))
        elif roll < 0.24 and op not in (self._check_live, self._advance, self._damage):
            self.fs.fail_after(None)  # one fault at a time: the error's aftermath runs outside the op
            self._arm_error()
        fired = len(self.fs.injected)
        raised: BaseException | None = None
        try:
            op()
        except EXPECTED as error:
            self._note(f"  -> {type(error).__name__}")
        except BaseException as error:
            if self.fs.powered_off:
                self._note(f"  -> power lost inside the operation ({type(error).__name__})")
                self._crash("power loss inside an operation")
            elif isinstance(error, STORAGE_ERRORS) and len(self.fs.injected) > fired:
                raised = error
            else:
                raise
        finally:
            self.fs.disarm()
        if len(self.fs.injected) > fired and self.coord is not None:
            self._after_error(raised)

    # ------------------------------------------------------------------ injected I/O errors

    def _arm_error(self) -> None:
        kinds = sorted(FAULT_WEIGHTS)
        kind = self.rng.choices(kinds, weights=[FAULT_WEIGHTS[k] for k in kinds])[0]
        code = errno.ENOSPC if self.rng.random() < 0.3 else errno.EIO
        skip = self.rng.randint(0, 6)
        self._note(f"  (arm {kind} {errno.errorcode[code]} after {skip})")
        self.fs.fail_next(kind, code, skip=skip)

    def _after_error(self, error: BaseException | None) -> None:
        """An injected error fired: check what straw raised, reopen a stopped coordinator, check."""
        self.fs.disarm()
        if error is not None:
            self.errors += 1
            self._note(f"  -> {type(error).__name__} after {self.fs.injected[-1]}: {error}")
            code = getattr(error.__cause__, "errno", None)
            if code in (errno.ENOSPC, errno.EDQUOT) and type(error) is StorageUnavailable:
                self._fail(f"ENOSPC surfaced as StorageUnavailable, not QuotaExceeded: {error}", error)
        else:
            self._note(f"  -> returned although {self.fs.injected[-1]}")
        coord = self._coord()
        try:
            coord.heartbeat([])  # a call (views of a stopped coordinator still answer)
        except UnsafeRecovery:
            self._note("  coordinator stopped (J3): close, reopen with recover=True")
            coord.close()
            self.coord = None
            self.reopened += 1
            self.coord = Coordinator(
                self.stores[2],
                exclusive_owner="sim",
                recover=True,
                clock=self.clock,
                lease_seconds=LEASE_SECONDS,
            )
            self.model.leases.clear()  # recovery revokes every lease (J4.5)
        self._check()

    def _publish_to(
        self, store: SharedFilesystemStore, records: list[Record], submission_id: str
    ) -> RecordSetRef:
        """Publish; after ``IndeterminateCommit`` the same submission must return the reference (I5)."""
        try:
            return store.publish(records, submission_id=submission_id)
        except IndeterminateCommit as error:
            if self.fs.powered_off or not self.fs.injected:
                raise
            self.fs.disarm()
            self.errors += 1
            self._note(f"  -> IndeterminateCommit after {self.fs.injected[-1]}; retry {submission_id}")
            try:
                return store.publish(records, submission_id=submission_id)
            except Exception as retry:
                self._fail(f"retrying {submission_id} after IndeterminateCommit raised {retry!r}", error)
                raise

    # ------------------------------------------------------------------ lifecycle

    def _backend(self) -> FilesystemBackend:
        return FilesystemBackend(ROOT, sleep=lambda _: None, visibility_delays=())

    def _open_all(self) -> None:
        self.stores = []
        self.coord = None
        targets = (0, 2048, 16384, 1 << 20)
        for _ in range(2):
            self.stores.append(
                SharedFilesystemStore(
                    ROOT,
                    RUN,
                    backend=self._backend(),
                    segment_target_bytes=self.rng.choice(targets),
                    online_gc=True,
                )
            )
        queue_store = SharedFilesystemStore(ROOT, RUN, backend=self._backend(), online_gc=True)
        self.stores.append(queue_store)
        self.coord = Coordinator(
            queue_store, exclusive_owner="sim", recover=True, clock=self.clock, lease_seconds=LEASE_SECONDS
        )

    def _reopen(self, *, first: bool = False) -> None:
        """Open everything (crashing again inside the reopen sometimes), collect, then check."""
        for attempt in range(6):
            if attempt < 5 and not first and self.rng.random() < 0.3:
                self.fs.fail_after(self.rng.randint(1, 40))
            try:
                self._open_all()
                if not first:
                    self._coord().collect_garbage()
                self.fs.fail_after(None)
                break
            except CorruptData as error:
                if self.fs.powered_off:
                    self._note("  power lost while reopening")
                    self._reboot()
                    continue
                self._fail(f"recovery refused an unacknowledged tail: {error}", error)
            except BaseException:
                if not self.fs.powered_off:
                    raise
                self._note("  power lost while reopening")
                self._reboot()
        if not first:
            self._check()

    def _reboot(self) -> None:
        self.fs.crash()
        self.crashes += 1
        self.stores = []
        self.coord = None
        for pub in self.model.pubs:
            pub.staged = False  # every writer died with the machine; staging ends with them
        self.model.leases.clear()  # recovery revokes every lease (J4.5)

    def _crash(self, why: str) -> None:
        self._note(f"CRASH: {why}")
        self.fs.fail_after(None)
        self._reboot()
        self._reopen()

    def _coord(self) -> Coordinator:
        if self.coord is None:
            raise SimulationFailure("no coordinator is open")
        return self.coord

    def _fresh(self, what: str) -> str:
        self.counter += 1
        return f"{what}{self.counter}"

    def _writer(self) -> SharedFilesystemStore:
        return self.stores[self.rng.randrange(2)]

    # ------------------------------------------------------------------ store operations

    def _payload(self) -> bytes:
        return self.rng.randbytes(self.rng.choice((1, 40, 700, 3000, 9000)))

    def _publish(self) -> None:
        store = self._writer()
        payload = self._payload()
        name = self._fresh("p")
        self._note(f"publish {name} ({len(payload)} bytes) via {store.writer_id[:6]}")
        ref = self._publish_to(store, [Record(name, payload)], name)
        self.model.pubs.append(Pub(ref, payload, store.writer_id))

    def _retain(self) -> None:
        required = self.model.required()
        if not required:
            return
        chosen = self.rng.sample(required, min(len(required), self.rng.randint(1, 3)))
        owner = self._fresh("app-")
        self._note(f"retain {owner} {len(chosen)} publications")
        self.stores[self.rng.randrange(3)].retain(owner, [p.ref for p in chosen])
        self.model.owners[owner] = chosen

    def _release(self) -> None:
        owners = sorted(k for k in self.model.owners if not k.startswith("ckpt-"))
        if not owners:
            return
        owner = self.rng.choice(owners)
        del self.model.owners[owner]  # no longer required, whatever the call's outcome
        self._note(f"release {owner}")
        self.stores[self.rng.randrange(3)].release(owner)

    def _release_publications(self) -> None:
        staged = [p for p in self.model.pubs if p.staged]
        if not staged:
            return
        pub = self.rng.choice(staged)
        pub.staged = False
        store = next((s for s in self.stores if s.writer_id == pub.writer), None)
        if store is None:
            return
        self._note(f"release_publications {pub.ref.manifest.segment.path[-12:]}")
        store.release_publications([pub.ref])

    def _seal(self) -> None:
        store = self._writer()
        self._note(f"seal {store.writer_id[:6]}")
        store.seal()

    def _collect(self) -> None:
        if self.rng.random() < 0.5:
            self._note("store.collect_garbage")
            self._writer().collect_garbage()
        else:
            self._note("coordinator.collect_garbage")
            self._coord().collect_garbage()

    # ------------------------------------------------------------------ queue operations

    def _submit(self) -> None:
        count = self.rng.randint(1, 3)
        specs = []
        inputs: dict[str, Pub | None] = {}
        required = self.model.required()
        for _ in range(count):
            task_id = self._fresh("t")
            pub = self.rng.choice(required) if required and self.rng.random() < 0.5 else None
            inputs[task_id] = pub
            specs.append(TaskSpec(task_id, input_ref=pub.ref if pub else None))
        request = self._fresh("s")
        self._note(f"submit {request}: {sorted(inputs)}")
        self.model.maybe_submitted.update(inputs)
        self._adopted(inputs.values())
        self._coord().submit_tasks(request, specs)
        self.model.submitted.update(inputs)

    def _adopted(self, pubs: Iterable[Pub | None]) -> None:
        """A queue that takes a publication over ends its staging (docs/GC.md, "Queue adoption"):
        from then on only owners keep it (the task while unfinished, the checkpoint until
        released). Ended before the call, whatever its outcome: the model then requires less."""
        for pub in pubs:
            if pub is not None:
                pub.staged = False

    def _acquire(self) -> Lease | None:
        worker = f"w{self.rng.randrange(3)}"
        result = self._coord().acquire(worker)
        if result.status != "acquired":
            self._note(f"acquire {worker}: {result.status}")
            return None
        lease = result.assignments[0].lease
        self._note(f"acquire {worker}: {lease.task_id} attempt {lease.attempt_id[:6]}")
        return lease

    def _acquire_only(self) -> None:
        lease = self._acquire()
        if lease is not None:
            self.model.leases.append(lease)

    def _work(self) -> None:
        lease = self._acquire()
        if lease is not None:
            self._complete(lease)

    def _complete_held(self) -> None:
        if not self.model.leases:
            return
        lease = self.model.leases.pop(self.rng.randrange(len(self.model.leases)))
        if self.rng.random() < 0.2:
            self._note(f"fail {lease.task_id}")
            self._coord().fail_task(lease, request_id=self._fresh("f"), failure="simulated")
            return
        self._complete(lease)

    def _complete(self, lease: Lease) -> None:
        payload = f"result of {lease.task_id}".encode() + self._payload()
        metadata: dict[str, Any] = {"task_id": lease.task_id, "attempt_id": lease.attempt_id}
        store = self._writer()
        ref = self._publish_to(
            store,
            [Record(f"out-{lease.task_id}", payload, metadata=metadata)],
            f"r-{lease.task_id}-{lease.attempt_id}",
        )
        self._note(f"complete {lease.task_id}")
        self.model.maybe_completed.add(lease.task_id)
        receipt = self._coord().complete_task(
            lease, submission_id=f"c-{lease.task_id}", result_ref=ref, result_digest=ref.digest
        )
        self._note(f"  -> position {receipt.position}")
        self.model.receipts[lease.task_id] = (receipt, payload)

    def _register_checkpoint(self) -> None:
        """A registered checkpoint is a GC root until released (API.md section 7): model it as an owner."""
        required = self.model.required()
        if not required:
            return
        pub = self.rng.choice(required)
        checkpoint = self._fresh("ckpt-")
        self._note(f"register_checkpoint {checkpoint}")
        self._adopted([pub])
        self._coord().register_checkpoint(checkpoint, pub.ref)
        self.model.owners[checkpoint] = [pub]

    def _release_checkpoint(self) -> None:
        checkpoints = sorted(k for k in self.model.owners if k.startswith("ckpt-"))
        if not checkpoints:
            return
        checkpoint = self.rng.choice(checkpoints)
        del self.model.owners[checkpoint]  # no longer required, whatever the call's outcome
        self._note(f"release_checkpoint {checkpoint}")
        self._coord().release_checkpoint(checkpoint)

    def _advance(self) -> None:
        step = self.rng.choice((1.0, 4.0, LEASE_SECONDS + 1))
        self.clock.now += step
        self._note(f"clock +{step}")

    # ------------------------------------------------------------------ checks

    def _damage(self) -> None:
        """Issue 11: power off, damage one metadata file of a copy of the disk, check the outcomes
        there (tests/sim/damage.py); the run goes on from the undamaged disk."""
        self.fs.fail_after(None)
        self._note("DAMAGE STEP: power loss, then damage a copy of the disk")
        self._reboot()
        refs = {f"pub{i}": (p.ref, p.payload) for i, p in enumerate(self.model.required())}
        refs.update(
            {f"result-{t}": (r.result_ref, payload) for t, (r, payload) in self.model.receipts.items()}
        )
        try:
            note = sim_damage.assess(self.fs, ROOT, RUN, self.rng, refs)
        except AssertionError as error:
            self._fail(str(error), error)
        self._note(f"  {note}")
        self._reopen()

    def _check_live(self) -> None:
        self._note("check (no crash)")
        self._check()

    def _read(self, ref: RecordSetRef) -> list[bytes]:
        return [bytes(r.payload) for r in self.stores[0].read(ref)]

    def _check(self) -> None:
        for pub in self.model.required():
            got = self._read(pub.ref)
            if got != [pub.payload]:
                self._fail(f"publication {pub.ref.manifest.segment.path} reads back {len(got)} wrong records")
        self._check_commits()
        coord = self._coord()
        for task_id, pub in self.model.submitted.items():
            status = coord.task_status(task_id)
            if status is None:
                self._fail(f"acknowledged task {task_id} is missing after recovery")
            unfinished = pub is not None and status["state"] in ("pending", "leased")
            if unfinished and pub is not None and self._read(pub.ref) != [pub.payload]:
                self._fail(f"the input of unfinished task {task_id} does not read back")

    def _check_commits(self) -> None:
        commits = self._coord().read_commits(0, 100_000).commits
        seen: set[str] = set()
        for position, commit in enumerate(commits):
            if commit.position != position:
                self._fail(f"commit {commit.task_id} sits at {position} but says {commit.position}")
            if commit.task_id in seen:
                self._fail(f"task {commit.task_id} was accepted twice")
            seen.add(commit.task_id)
            if commit.task_id not in self.model.receipts and commit.task_id not in self.model.maybe_completed:
                self._fail(f"commit of {commit.task_id} was never requested")
        for task_id, (receipt, payload) in self.model.receipts.items():
            if receipt.position >= len(commits):
                self._fail(f"acknowledged completion of {task_id} (position {receipt.position}) is lost")
            found = commits[receipt.position]
            if (found.task_id, found.submission_id, found.digest) != (
                receipt.task_id,
                receipt.submission_id,
                receipt.digest,
            ):
                self._fail(f"position {receipt.position} holds {found.task_id}, not {task_id}")
            if self._read(receipt.result_ref) != [payload]:
                self._fail(f"the accepted result of {task_id} does not read back")
        if self.model.submitted.keys() - self.model.maybe_submitted:
            self._fail("model bookkeeping: a submitted task was not recorded as requested")
