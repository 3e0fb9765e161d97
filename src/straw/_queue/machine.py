"""The durable queue's state and its transitions (API.md section 7; docs/QUEUE.md).

Every mutating call is split in two:

- ``check_<op>(..., now, new_id) -> event``: validates the call against the
  current state and decides everything non-deterministic (which tasks an
  acquire takes, attempt ids, tokens, deadlines). It raises the caller's error
  and changes nothing.
- ``apply(event) -> reply``: performs the event. It is deterministic and is used
  both live (after the event was journaled) and when replaying the journal.

``TRANSITIONS`` is the table of every legal task-state change.
"""

from __future__ import annotations

import copy
import dataclasses
import heapq
import operator
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

from ..errors import (
    CorruptData,
    IdempotencyConflict,
    InvalidReference,
    LeaseExpired,
    QueueError,
    ResourceLimitExceeded,
    StaleAttempt,
    UnsupportedSchema,
    invariant,
)
from ..limits import TASK_METADATA_BYTES_MAX
from ..protocol import AcquireStatus, Lease, RecordSetRef, TaskSpec, as_dict, digest, encode, unchecked
from . import events as ev
from .collector import collector_paused
from .commits import CommitLog
from .events import Answer as Answer  # re-exported: the event types live in ``events``
from .events import Event as Event
from .events import Receipt
from .history import History, HistoryFile, IndexRun, Opener, close_all, open_files, open_runs
from .index import Key, PendingIndex, pending_key
from .ledger import Acked as Acked  # re-exported: the ledger's types, where callers found them
from .ledger import Consumer as Consumer
from .ledger import Ledger, check_cursors
from .progress import Acknowledged

#: What needs a GC root (``QueueState.roots``), named for messages by ``describe_root``.
Label = tuple[Any, ...]

NewId = Callable[[], str]
#: One entry of ``complete_tasks``: lease, submission id, result, its digest, the packs it reaches.
Completion = tuple[Lease, str, RecordSetRef, str, Iterable[str]]
#: What ``check_complete_many`` plans for an entry: its known receipt, or its place in the event.
Planned = tuple[str, Any]
R = TypeVar("R")


PENDING, LEASED, COMPLETED, FAILED, CANCELLED = "pending", "leased", "completed", "failed", "cancelled"
#: What ``save_task_progress(_many)`` answers (the tasks stay leased).
SAVED = "saved"
STATES = (PENDING, LEASED, COMPLETED, FAILED, CANCELLED)

#: (from state, event) -> to states. Anything else is a bug (``invariant``).
TRANSITIONS: dict[tuple[str | None, str], frozenset[str]] = {
    (None, "submit"): frozenset({PENDING}),
    (PENDING, "acquire"): frozenset({LEASED}),
    (LEASED, "reclaim"): frozenset({PENDING, FAILED}),  # lease expired, worker retired or new epoch
    (LEASED, "complete"): frozenset({COMPLETED}),
    (LEASED, "fail"): frozenset({PENDING, FAILED}),
    (LEASED, "release"): frozenset({PENDING}),
    (LEASED, "yield"): frozenset({PENDING}),
    (LEASED, "progress"): frozenset({LEASED}),
    (PENDING, "cancel"): frozenset({CANCELLED}),
    (LEASED, "cancel"): frozenset({CANCELLED}),
}

#: Heartbeat outcomes (API.md section 7).
EXTENDED = "extended"


#: A lease's fields in order, as ``Task.held`` keeps them.
LEASE_FIELDS = tuple(f.name for f in dataclasses.fields(Lease))


#: A lease as one tuple of its plain values, in ``LEASE_FIELDS`` order (what ``Task.held`` keeps).
lease_values: Callable[[Lease], tuple[Any, ...]] = operator.attrgetter(*LEASE_FIELDS)

#: Where ``Task.held`` keeps a lease's attempt, token and worker.
HELD_ATTEMPT, HELD_TOKEN, HELD_WORKER = (LEASE_FIELDS.index(n) for n in ("attempt_id", "token", "worker_id"))

#: A lease's leading fields that its task and queue imply: a snapshot or history row keeps
#: only the values after them (``_held_row``, ``_row_lease``).
_IMPLIED = ("run_id", "queue_id", "task_id")
invariant(LEASE_FIELDS[: len(_IMPLIED)] == _IMPLIED, "a lease's implied fields come first")


class Task:
    """One task's live state.

    Its current lease is kept as plain values (``held``, a tuple the cycle collector
    untracks), not as the Lease handed to the worker: the live table then holds two objects
    per task, not three, and the worker's Lease dies with the worker's reference (docs/QUEUE.md
    "The cycle collector"). ``lease`` builds an equal Lease when asked.
    """

    __slots__ = (
        "deadline",
        "failure",
        "failures",
        "generation",
        "held",
        "order",
        "request_id",
        "spec",
        "state",
    )

    def __init__(
        self,
        spec: TaskSpec,
        request_id: str,
        state: str = PENDING,
        order: int = 0,
        generation: int = 0,
        failures: int = 0,
        failure: str | None = None,
        lease: Lease | None = None,
        deadline: float = 0.0,
    ) -> None:
        self.spec, self.request_id, self.state, self.order = spec, request_id, state, order
        self.generation, self.failures, self.failure, self.deadline = generation, failures, failure, deadline
        self.held: tuple[Any, ...] | None = lease_values(lease) if lease is not None else None

    @property
    def lease(self) -> Lease | None:
        held = self.held
        return unchecked(Lease, dict(zip(LEASE_FIELDS, held, strict=True))) if held is not None else None

    def copy(self) -> Task:
        """A copy sharing the spec (immutable) and the lease values (a tuple)."""
        out = Task.__new__(Task)
        out.spec, out.request_id, out.state, out.order = self.spec, self.request_id, self.state, self.order
        out.generation, out.failures, out.failure = self.generation, self.failures, self.failure
        out.held, out.deadline = self.held, self.deadline
        return out

    def holds(self, attempt_id: str) -> bool:
        """Whether ``attempt_id`` is the task's current lease's attempt."""
        return self.held is not None and self.held[HELD_ATTEMPT] == attempt_id

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Task):
            return NotImplemented
        return all(getattr(self, name) == getattr(other, name) for name in Task.__slots__)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (
            f"Task({self.spec!r}, state={self.state!r}, generation={self.generation}, lease={self.lease!r})"
        )

    def status(self) -> dict[str, Any]:
        result: dict[str, Any] = {
            "state": self.state,
            "spec": as_dict(self.spec),
            "lease": as_dict(self.lease) if self.lease is not None else None,
            "generation": self.generation,
            "failures": self.failures,
            "pending_order": self.order,
        }
        if self.failure is not None:
            result["failure"] = self.failure
        return result


@dataclass
class Roots:
    """What the queue still needs (docs/GC.md "Queue roots"): references to resolve, as dicts,
    and packs already known (those of accepted results, recorded when accepted). Built with
    ``labels``, it also says what needs each one (``describe_root`` names a label): the
    labels ``straw check`` prints come from the very computation that decides the roots."""

    refs: list[dict[str, Any]] = field(default_factory=list)
    packs: set[str] = field(default_factory=set)
    ref_labels: list[Label] | None = None
    pack_labels: dict[str, list[Label]] | None = None

    def add(self, label: Label, ref: dict[str, Any]) -> None:
        self.refs.append(ref)
        if self.ref_labels is not None:
            self.ref_labels.append(label)

    def add_packs(self, label: Label, packs: Iterable[str]) -> None:
        self.packs.update(packs)
        if self.pack_labels is not None:
            for pack in packs:
                self.pack_labels.setdefault(pack, []).append(label)


@dataclass
class QueueState:
    """Everything the queue knows; rebuilt exactly by replaying its events.

    Two parts: the task lifecycle (tasks, leases, the pending indexes, accepted receipts and
    idempotent requests) is this class; what consumers declared about accepted results
    (consumers, batches, checkpoints, released history) is its :class:`Ledger`.
    """

    run_id: str
    queue_id: str
    max_result_bytes: int = 4 * 1024**3
    max_result_tokens: int = 100_000_000
    metadata_bytes: int = 256 * 1024
    epoch: int = 0
    sealed: bool = False
    draining: bool = False
    next_order: int = 0
    tasks: dict[str, Task] = field(default_factory=dict)
    pending: PendingIndex = field(default_factory=PendingIndex)
    control: PendingIndex = field(default_factory=PendingIndex)
    expiry: list[tuple[float, str, str]] = field(default_factory=list)
    requests: dict[str, tuple[str, Any]] = field(default_factory=dict)
    submissions: dict[str, int] = field(default_factory=dict)
    commits: CommitLog = field(default_factory=CommitLog)
    commit_workers: list[str] = field(default_factory=list)
    #: Packs each accepted result reaches (known when it was validated), so GC roots need no I/O.
    #: Tuples, which a collection untracks (a list per receipt stays tracked for good).
    commit_packs: list[tuple[str, ...]] = field(default_factory=list)
    producers: dict[str, Any] = field(default_factory=dict)
    reads: dict[tuple[str, str], Lease] = field(default_factory=dict)
    #: Inputs each outstanding read was granted (and later given by save_task_progress): the
    #: holder may still read any of them, whatever the task's input is now (GC roots).
    read_inputs: dict[tuple[str, str], list[dict[str, Any]]] = field(default_factory=dict)
    ledger: Ledger = field(default_factory=Ledger)
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STATES, 0))
    #: Packs each named reference reaches (``ref_key`` -> packs, or 0 for just its manifest's
    #: pack), journaled with the call that named it: collecting garbage, even right after a
    #: recovery, reads nothing to know a root's packs (docs/GC.md "Queue roots").
    ref_packs: dict[str, list[str] | int] = field(default_factory=dict)
    #: Keys events put in ``ref_packs`` since the snapshot copy in flight was taken (live only,
    #: never encoded): the live state keeps them when it forgets what that snapshot pruned
    #: (``forget_reach``), since a replay of the journal after the snapshot puts them back.
    reach_since: set[str] = field(default_factory=set)
    #: Terminal tasks and accepted receipts moved to disk (docs/FORMAT.md 8.4): the receipts
    #: below ``commits.base``, and tasks no longer in ``tasks``. Looked up when memory misses.
    history: History = field(default_factory=History)
    #: Ids of the tasks that are pending or leased (those a later call may still change):
    #: what ``snapshot_copy`` copies, in time proportional to live work, not to ``tasks``.
    unfinished: set[str] = field(default_factory=set)

    # ------------------------------------------------------------------ history on disk

    def find_task(self, task_id: str) -> Task | None:
        """A task in memory, or rebuilt from its history file (a terminal one)."""
        task = self.tasks.get(task_id)
        if task is not None or not self.history:
            return task
        row = self.history.task(task_id)
        return task_from_row(row, self) if row is not None else None

    def position_of(self, submission_id: str) -> int | None:
        position = self.submissions.get(submission_id)
        if position is None and self.history:
            position = self.history.position(submission_id)
        return position

    def worker_at(self, position: int) -> str:
        base = self.commits.base
        return (
            str(self.history.receipt(position)[1])
            if position < base
            else self.commit_workers[position - base]
        )

    def packs_at(self, position: int) -> list[str]:
        base = self.commits.base
        return list(
            self.history.receipt(position)[2] if position < base else self.commit_packs[position - base]
        )

    def spillable(self) -> tuple[list[Task], int]:
        """What can move to a history file now: terminal tasks in memory, and the accepted
        positions up to (not including) the returned count (receipts never change)."""
        done = [t for t in self.tasks.values() if t.state in (COMPLETED, FAILED, CANCELLED)]
        return done, len(self.commits)

    def spill_rows(self, tasks: Sequence[Task], stop: int) -> tuple[_TaskRows, _ReceiptRows, dict[str, Any]]:
        """The rows of a history file for ``tasks`` and positions ``commits.base .. stop - 1``:
        rows built a block at a time when the file is (``history.Rows``), and the file's meta row."""
        workers: dict[str, list[int]] = {}
        packs: dict[str, list[int]] = {}
        unknown: list[int] = []
        totals = [0, 0, 0]
        for position in range(self.commits.base, stop):
            receipt = self.commits[position]
            worker, reached = self.worker_at(position), self.packs_at(position)
            workers.setdefault(worker, []).append(position)
            for pack in reached:
                packs.setdefault(pack, []).append(position)
            if not reached:
                unknown.append(position)
            ref = receipt["result_ref"]
            totals[0] += ref["records"]
            totals[1] += ref["payload_bytes"]
            totals[2] += ref["tokens"]
        counts: dict[str, int] = {}
        for task in tasks:
            counts[task.state] = counts.get(task.state, 0) + 1
        meta = {"workers": workers, "packs": packs, "unknown": unknown, "totals": totals, "counts": counts}
        return _TaskRows(self, tasks), _ReceiptRows(self, stop), meta

    def spill_requests(self) -> list[tuple[str, list[Any]]]:
        """Request rows for a history file: every request id in memory (an answer never changes
        once given, so all of them can move; a lookup that misses memory reads the files)."""
        return [(request_id, [request_id, seen[0], seen[1]]) for request_id, seen in self.requests.items()]

    def unneeded_reach(self) -> list[str]:
        """Keys of ``ref_packs`` that no root of this state can name any more (docs/GC.md "Queue
        roots"): what terminal tasks, ended reads and released ledger entries named. Called on a
        snapshot's copy once its history moved out: the rest of ``ref_packs`` is the inputs of
        live tasks and outstanding reads, the ledger's references and results whose packs were
        not recorded. A result of a history file whose packs were not recorded (journals older
        than ``packs``) is resolved by reading it, as it was before ``reach`` was journaled."""
        needed: set[str] = set()
        for task_id in self.unfinished:
            ref = self.tasks[task_id].spec.input_ref
            if ref is not None:
                needed.add(object_key(ref))
        for inputs in self.read_inputs.values():
            needed.update(ref_key(item) for item in inputs)
        self.ledger.roots(frozenset(), lambda _label, item: needed.add(ref_key(item)))
        for position, known in enumerate(self.commit_packs, self.commits.base):
            if not known:
                needed.add(ref_key(self.commits[position]["result_ref"]))
        return [key for key in self.ref_packs if key not in needed]

    def forget_reach(self, keys: Iterable[str]) -> None:
        """Drop what a durable snapshot pruned from ``ref_packs`` (J5 H3), except the keys an
        event put back since its copy was taken (``reach_since``): the live state then holds
        what a replay of that snapshot and the journal after it would (I10)."""
        for key in keys:
            if key not in self.reach_since:
                self.ref_packs.pop(key, None)

    def forget_requests(self, request_ids: Iterable[str]) -> None:
        """Drop request ids a durable history file now answers for (``attach`` came first)."""
        for request_id in request_ids:
            self.requests.pop(request_id, None)

    def attach(self, file: HistoryFile) -> None:
        """A durable history file (named by a durable snapshot) now answers for what it holds."""
        self.history.add(file)
        self.commits.history = self.history.receipt_dicts

    def forget_receipts(self, stop: int) -> list[str]:
        """Drop the receipts below ``stop`` from memory (``attach`` came first); their
        submission ids, which the caller then forgets with :meth:`forget_submissions`."""
        base = self.commits.base
        ids = self.commits.submission_ids(stop)
        self.commits.drop_below(stop)
        del self.commit_workers[: stop - base]
        del self.commit_packs[: stop - base]
        return ids

    def forget_submissions(self, ids: Iterable[str]) -> None:
        for submission_id in ids:
            self.submissions.pop(submission_id, None)

    def forget_tasks(self, task_ids: Iterable[str]) -> None:
        for task_id in task_ids:
            task = self.tasks.get(task_id)
            if task is not None:
                invariant(task.state in (COMPLETED, FAILED, CANCELLED), "only terminal tasks move to history")
                del self.tasks[task_id]

    def snapshot_copy(self) -> QueueState:
        """A copy to build a snapshot from (DURABILITY.md J5.1), taken with the coordinator's
        lock held: encoding and spilling it later, without the lock, must see this instant.

        Only what later calls change in place is copied; the rest is shared. Terminal tasks
        never change again (``TRANSITIONS`` has no way out of a terminal state), nor do task
        specs, leases, receipts and history files (all frozen or append-only), so containers
        are copied shallowly and only live tasks (``unfinished``), consumers, batches and outstanding reads'
        input lists are copied one level deep. The indexes a snapshot does not store
        (``pending``, ``control``, ``expiry``) stay empty: the copy is only encoded and spilled.
        """
        invariant(
            len(self.unfinished) == self.counts[PENDING] + self.counts[LEASED],
            "unfinished lists the live tasks",
        )
        tasks = dict(self.tasks)  # one C-level copy; then the live tasks, one by one
        for task_id in self.unfinished:
            t = tasks[task_id]
            tasks[task_id] = t.copy()
        out = QueueState(
            self.run_id,
            self.queue_id,
            max_result_bytes=self.max_result_bytes,
            max_result_tokens=self.max_result_tokens,
            metadata_bytes=self.metadata_bytes,
            epoch=self.epoch,
            sealed=self.sealed,
            draining=self.draining,
            next_order=self.next_order,
            tasks=tasks,
            requests=dict(self.requests),
            submissions=dict(self.submissions),
            commits=self.commits.copy(),
            commit_workers=list(self.commit_workers),
            commit_packs=list(self.commit_packs),
            producers=dict(self.producers),
            reads=dict(self.reads),
            read_inputs={key: list(inputs) for key, inputs in self.read_inputs.items()},
            ledger=self.ledger.copy(),
            counts=dict(self.counts),
            ref_packs=dict(self.ref_packs),
            history=History(self.history.files, self.history.merged_indexes, self.history.runs),
            unfinished=set(self.unfinished),
        )
        out.commits.history = out.history.receipt_dicts
        return out

    # ------------------------------------------------------------------ helpers

    def _move(self, task: Task, event: str, to: str) -> None:
        allowed = TRANSITIONS.get((task.state, event))
        invariant(
            allowed is not None and to in allowed, f"transition {task.state} --{event}--> {to} is legal"
        )
        self.counts[task.state] -= 1
        self.counts[to] += 1
        task.state = to
        if to in (COMPLETED, FAILED, CANCELLED):
            self.unfinished.discard(task.spec.task_id)  # terminal: no transition leaves it

    def _index(self, task: Task) -> PendingIndex:
        return self.control if task.spec.control else self.pending

    def _enqueue(self, task: Task) -> None:
        """Put a task at the tail of its key's FIFO."""
        task.order = self.next_order
        self.next_order += 1
        spec = task.spec
        self._index(task).add(pending_key(spec.priority, spec.scheduling_key, task.order, spec.task_id))

    def _dequeue(self, task: Task) -> None:
        self._index(task).remove(task.spec.task_id)

    def _request(self, request_id: str, fingerprint: Any) -> tuple[bool, Any]:
        """(seen, reply) for an idempotent request id; a changed request is a conflict."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        seen = self.requests.get(request_id)
        if seen is None and self.history:
            row = self.history.request(request_id)  # moved to a history file by a snapshot
            seen = (row[1], row[2]) if row is not None else None
        if seen is None:
            return False, None
        if seen[0] != fingerprint:
            raise IdempotencyConflict(f"request id {request_id!r} was already used for a different request")
        return True, seen

    def _remember(self, request_id: str, fingerprint: str, reply: R) -> R:
        self.requests[request_id] = (fingerprint, reply)
        return reply

    def task(self, task_id: str) -> Task:
        task = self.tasks.get(task_id)
        if task is None:
            raise KeyError(f"unknown task {task_id!r}")
        return task

    def current(self, lease: Lease, now: float, *, allow_expired: bool = False) -> Task:
        """The task a lease authorises, or the error saying why it does not."""
        if not isinstance(lease, Lease):
            raise TypeError(f"expected a Lease, got {type(lease).__name__}")
        if lease.run_id != self.run_id or lease.queue_id != self.queue_id:
            raise InvalidReference(
                f"lease belongs to run {lease.run_id!r} queue {lease.queue_id!r}, "
                f"not run {self.run_id!r} queue {self.queue_id!r}"
            )
        task = self.find_task(lease.task_id)  # a finished task may answer from its history file
        if task is None:
            raise InvalidReference(f"lease names unknown task {lease.task_id!r}")
        held = task.held
        if (
            task.state != LEASED
            or held is None
            or held[HELD_ATTEMPT] != lease.attempt_id
            or held[HELD_TOKEN] != lease.token
            or lease.coordinator_epoch != self.epoch
        ):
            raise StaleAttempt(
                f"attempt {lease.attempt_id!r} of task {lease.task_id!r} is no longer current "
                f"(task is {task.state}); stop working on it"
            )
        if not allow_expired and now >= task.deadline:
            raise LeaseExpired(
                f"lease of task {lease.task_id!r} attempt {lease.attempt_id!r} expired; "
                "the task may be handed to another worker"
            )
        return task

    def _end_read(self, key: tuple[str, str]) -> bool:
        self.read_inputs.pop(key, None)
        return self.reads.pop(key, None) is not None

    def _lease_pairs(self, leases: Sequence[Lease]) -> list[list[str]]:
        return [[lease.task_id, lease.attempt_id] for lease in leases]

    # ------------------------------------------------------------------ submit

    def check_submit(
        self,
        request_id: str,
        tasks: Sequence[TaskSpec],
        producer_id: str | None,
        producer_state: Any,
    ) -> ev.Submit | Answer[list[str]]:
        specs = list(tasks)
        for spec in specs:
            if not isinstance(spec, TaskSpec):
                raise TypeError(f"submit_tasks takes TaskSpec objects, got {type(spec).__name__}")
            _check_task_metadata(spec)
        if producer_state is not None and producer_id is None:
            raise ValueError("producer_state needs a producer_id")
        refs, rows = _compact_specs(specs)
        # The fingerprint names the request logically: inputs by their digest, not their location.
        fingerprint = digest(["submit", rows, [r["digest"] for r in refs], producer_id, producer_state])
        seen, reply = self._request(request_id, fingerprint)
        if seen:
            return Answer(list(reply[1]))
        ids = [spec.task_id for spec in specs]
        if len(set(ids)) != len(ids):
            raise ValueError("submit_tasks got the same task id twice")
        for task_id in ids:
            known = self.find_task(task_id)
            if known is not None:
                raise IdempotencyConflict(
                    f"task id {task_id!r} was already submitted by request {known.request_id!r}"
                )
        if self.sealed and specs:
            raise ValueError("input is sealed (seal_input was called); no new tasks are accepted")
        return ev.Submit(
            request_id=request_id,
            fingerprint=fingerprint,
            refs=refs,
            tasks=rows,
            producer_id=producer_id,
            producer_state=producer_state,
            # Live only (never journaled): the checked specs. A spec with metadata gets our
            # own copy: the caller may mutate its dict later.
            specs=[
                spec
                if not spec.metadata
                else dataclasses.replace(spec, metadata=copy.deepcopy(spec.metadata))
                for spec in specs
            ],
        )

    def _apply_submit(self, event: ev.Submit) -> list[str]:
        ids = []
        specs = event.specs
        if specs is None:
            specs = _expand_specs(event.refs, event.tasks)
        for spec in specs:
            task = Task(spec, event.request_id)
            self.tasks[spec.task_id] = task
            self.unfinished.add(spec.task_id)
            self.counts[PENDING] += 1
            self._enqueue(task)
            ids.append(spec.task_id)
        if event.producer_id is not None:
            self.producers[event.producer_id] = event.producer_state
        return self._remember(event.request_id, event.fingerprint, ids)

    # ------------------------------------------------------------------ acquire and leases

    def _live_entry(self, deadline: float, task_id: str, attempt_id: str) -> bool:
        """True if a heap entry is the current deadline of a current lease."""
        task = self.tasks.get(task_id)
        if task is None:
            return False  # a finished task moved to history: its old entries are stale
        return task.state == LEASED and task.holds(attempt_id) and task.deadline == deadline

    def expired(self, now: float) -> list[list[str]]:
        """Current leases whose deadline has passed at ``now``, earliest first.

        Walks only the heap entries with deadline <= now (a heap walk, no sort),
        so the cost follows the number of expired entries, not of leases.
        """
        heap = self.expiry
        found: list[list[str]] = []
        if not heap or heap[0][0] > now:
            return found
        walk = [(heap[0], 0)]
        while walk:
            (deadline, task_id, attempt_id), at = heapq.heappop(walk)
            if deadline > now:
                break
            if self._live_entry(deadline, task_id, attempt_id) and [task_id, attempt_id] not in found:
                found.append([task_id, attempt_id])
            for child in (2 * at + 1, 2 * at + 2):
                if child < len(heap):
                    heapq.heappush(walk, (heap[child], child))
        return found

    def _prune_expiry(self) -> None:
        """Pop heap entries that no longer name a current deadline (each entry is popped once)."""
        heap = self.expiry
        while heap and not self._live_entry(*heap[0]):
            heapq.heappop(heap)

    def check_acquire(
        self,
        worker_id: str,
        max_tasks: int,
        task_ids: Iterable[str] | None,
        task_prefix: str | None,
        control: bool,
        now: float,
        lease_seconds: float,
        new_id: NewId,
    ) -> ev.Acquire | Answer[list[Lease] | AcquireStatus]:
        """An acquire event, or the status string when nothing can be handed out."""
        if not isinstance(worker_id, str) or not worker_id:
            raise ValueError(f"worker_id must be a non-empty string, got {worker_id!r}")
        if not isinstance(max_tasks, int) or isinstance(max_tasks, bool) or max_tasks < 1:
            raise ValueError(f"max_tasks must be a positive integer, got {max_tasks!r}")
        if self.draining:
            return Answer("draining")
        reclaimed = self.expired(now)
        # Reclaimed leases rejoin the FIFO tail (in this order, as _reclaim will enqueue them)
        # before the grants are chosen, so they compete with pending tasks by their full key.
        coming_back: dict[str, Key] = {}
        order = self.next_order
        for task_id, _ in reclaimed:
            task = self.tasks[task_id]
            if task.failures + 1 < task.spec.max_attempts:
                spec = task.spec
                coming_back[task_id] = pending_key(spec.priority, spec.scheduling_key, order, task_id)
                order += 1
        index = self.control if control else self.pending
        eligible = {t: k for t, k in coming_back.items() if self.tasks[t].spec.control == control}
        if task_ids is not None:
            if isinstance(task_ids, str):
                raise TypeError("task_ids must be a collection of task ids, not one string")
            # Named tasks are granted in the order the caller named them.
            chosen = [t for t in dict.fromkeys(task_ids) if t in index or t in eligible][:max_tasks]
        else:
            head = index.with_prefix(task_prefix, max_tasks) if task_prefix else index.first(max_tasks)
            keys = [index.key(t) for t in head]
            keys += [k for t, k in eligible.items() if not task_prefix or t.startswith(task_prefix)]
            chosen = [key[3] for key in sorted(keys)[:max_tasks]]
        if not chosen and not reclaimed:
            return Answer(self._idle_status())
        grants = [[t, new_id(), new_id()] for t in chosen]
        return ev.Acquire(
            worker_id=worker_id, reclaimed=reclaimed, grants=grants, deadline=now + lease_seconds
        )

    def drained_input(self) -> bool:
        """Sealed, and nothing pending (control tasks included) or leased."""
        return self.sealed and not len(self.pending) and not len(self.control) and not self.counts[LEASED]

    def _idle_status(self) -> AcquireStatus:
        if self.drained_input():
            return "end_of_input"
        return "empty"

    def _apply_acquire(self, event: ev.Acquire) -> list[Lease]:
        self._reclaim(event.reclaimed, "lease expired")
        leases = []
        for task_id, attempt_id, token in event.grants:
            task = self.tasks[task_id]
            self._move(task, "acquire", LEASED)  # checks the transition before touching the index
            self._dequeue(task)
            task.generation += 1
            lease = Lease(
                run_id=self.run_id,
                queue_id=self.queue_id,
                task_id=task_id,
                attempt_id=attempt_id,
                generation=task.generation,
                coordinator_epoch=self.epoch,
                token=token,
                worker_id=event.worker_id,
            )
            task.held = lease_values(lease)
            task.deadline = event.deadline
            heapq.heappush(self.expiry, (task.deadline, task_id, attempt_id))
            if task.spec.input_ref is not None:
                self.reads[(task_id, attempt_id)] = lease
                self.read_inputs[(task_id, attempt_id)] = [as_dict(task.spec.input_ref)]
            leases.append(lease)
        return leases

    def _reclaim(self, pairs: Iterable[Sequence[str]], why: str) -> None:
        """Take leases back: each spends an attempt; an exhausted task fails. Reads stay outstanding."""
        for task_id, attempt_id in pairs:
            task = self.tasks[task_id]
            invariant(task.holds(attempt_id), "reclaimed lease is current")
            task.failures += 1
            if task.failures >= task.spec.max_attempts:
                task.failure = f"{why}; {task.failures} of {task.spec.max_attempts} attempts spent"
                self._move(task, "reclaim", FAILED)
            else:
                self._move(task, "reclaim", PENDING)
                self._enqueue(task)
        self._prune_expiry()

    def heartbeat(self, leases: Sequence[Lease], now: float, lease_seconds: float) -> list[str]:
        """Extend current leases in memory (not journaled: recovery revokes every lease anyway)."""
        outcomes = []
        for lease in leases:
            try:
                task = self.current(lease, now)
            except StaleAttempt:
                outcomes.append("StaleAttempt")
                continue
            except LeaseExpired:
                outcomes.append("LeaseExpired")
                continue
            except InvalidReference:
                outcomes.append("StaleAttempt")
                continue
            deadline = now + lease_seconds
            if deadline != task.deadline:
                task.deadline = deadline
                heapq.heappush(self.expiry, (deadline, lease.task_id, lease.attempt_id))
            outcomes.append(EXTENDED)
        return outcomes

    # ------------------------------------------------------------------ completion

    def precheck_complete(
        self, lease: Lease, submission_id: str, result_ref: RecordSetRef, result_digest: str, now: float
    ) -> Answer[Receipt] | None:
        """The cheap part of :meth:`check_complete`: a known submission's receipt, or the first error."""
        position = self.position_of(submission_id)
        if position is not None:
            receipt = self.commits[position]
            if (receipt["task_id"], receipt["digest"]) != (lease.task_id, result_digest):
                raise IdempotencyConflict(
                    f"submission {submission_id!r} was accepted for task {receipt['task_id']!r} with "
                    f"digest {receipt['digest'][:12]}..; this retry differs"
                )
            return Answer(receipt)
        if result_digest != result_ref.digest:
            raise InvalidReference("result_digest does not match result_ref.digest")
        self.current(lease, now)
        return None

    def check_complete(
        self,
        lease: Lease,
        submission_id: str,
        result_ref: RecordSetRef,
        result_digest: str,
        now: float,
        new_id: NewId,
        packs: Iterable[str] = (),
    ) -> ev.Complete | Answer[Receipt]:
        """A complete event, or the original receipt of a retried submission.

        ``packs`` are the packs the result reaches (the shell computed them while
        validating it); they are journaled with the event for the GC roots.
        """
        if not isinstance(submission_id, str) or not submission_id:
            raise ValueError(f"submission_id must be a non-empty string, got {submission_id!r}")
        if not isinstance(result_ref, RecordSetRef):
            raise TypeError(f"result_ref must be a RecordSetRef, got {type(result_ref).__name__}")
        known = self.precheck_complete(lease, submission_id, result_ref, result_digest, now)
        if known is not None:
            return known
        task = self.current(lease, now)
        if result_ref.records == 0 and not task.spec.allow_empty:
            raise ValueError(f"task {lease.task_id!r} does not allow an empty result (allow_empty=False)")
        return ev.Complete(
            task_id=lease.task_id,
            attempt_id=lease.attempt_id,
            submission_id=submission_id,
            commit_id=new_id(),
            digest=result_digest,
            result_ref=as_dict(result_ref),
            packs=sorted(packs),
        )

    def _apply_complete(self, event: ev.Complete) -> Receipt:
        task = self.tasks[event.task_id]
        invariant(task.holds(event.attempt_id), "completing lease")
        self._move(task, "complete", COMPLETED)
        self._end_read((event.task_id, event.attempt_id))
        receipt: Receipt = {
            "commit_id": event.commit_id,
            "task_id": event.task_id,
            "submission_id": event.submission_id,
            "digest": event.digest,
            "position": len(self.commits),
            "result_ref": event.result_ref,
        }
        self.commits.append(receipt)
        self.commit_workers.append(task.held[HELD_WORKER] if task.held is not None else "")
        self.commit_packs.append(tuple(event.packs or ()))
        self.submissions[event.submission_id] = receipt["position"]
        self._prune_expiry()
        return receipt

    def check_complete_many(
        self, entries: Sequence[Completion], now: float, new_id: NewId, *, precheck: bool = False
    ) -> tuple[ev.CompleteMany | None, list[Planned]]:
        """``complete_tasks``: each entry checked exactly as :meth:`check_complete` would, in order,
        as if the earlier entries had been applied; the first error raises and nothing is done.

        Returns the event of the entries not yet accepted (None when every one is a retry)
        and, per entry, its plan: ``("known", receipt)`` for an accepted submission, or
        ``("new", k)`` for the k-th completion of the event (a submission named twice in the
        batch, identically, is planned once). With ``precheck``, only the cheap checks of
        :meth:`precheck_complete` run (before the results are validated) and no event is made.
        """
        plans: list[Planned] = []
        completes: list[ev.Complete] = []
        new = 0  # entries planned as new (with ``precheck``, no event is made for them yet)
        fresh: dict[str, tuple[int, str, str]] = {}  # submission id -> (k, task id, digest)
        taken: set[str] = set()  # tasks completed by an earlier entry of this batch
        for number, entry in enumerate(entries):
            lease, submission_id, result_ref, result_digest, packs = entry
            try:
                earlier = fresh.get(submission_id)
                if earlier is not None:
                    if earlier[1:] != (lease.task_id, result_digest):
                        raise IdempotencyConflict(
                            f"submission {submission_id!r} is named twice in this batch, for task "
                            f"{earlier[1]!r} and task {lease.task_id!r} (or with another digest)"
                        )
                    plans.append(("new", earlier[0]))
                    continue
                if lease.task_id in taken:
                    raise StaleAttempt(
                        f"task {lease.task_id!r} is completed by an earlier entry of this batch; "
                        f"attempt {lease.attempt_id!r} is no longer current"
                    )
                found: ev.Complete | Answer[Receipt] | None
                if precheck:
                    found = self.precheck_complete(lease, submission_id, result_ref, result_digest, now)
                else:
                    found = self.check_complete(
                        lease, submission_id, result_ref, result_digest, now, new_id, packs
                    )
            except (QueueError, ValueError, TypeError) as error:
                # The same error class complete_task raises, naming the entry that caused it.
                raise type(error)(f"complete_tasks entry {number}: {error}") from None
            if isinstance(found, Answer):
                plans.append(("known", found.value))
                continue
            if found is not None:  # None: a precheck (the event is made after validation)
                completes.append(found)
            fresh[submission_id] = (new, lease.task_id, result_digest)
            taken.add(lease.task_id)
            plans.append(("new", new))
            new += 1
        event = ev.CompleteMany(completes=completes) if completes and not precheck else None
        return event, plans

    def _apply_complete_many(self, event: ev.CompleteMany) -> list[Receipt]:
        """The completions of one ``complete_tasks`` transaction, in order (their receipts)."""
        return [self._apply_complete(item) for item in event.completes]

    # ------------------------------------------------------------------ returning work

    def check_fail(
        self, lease: Lease, request_id: str, failure: str, retryable: bool, now: float
    ) -> ev.Fail | Answer[str]:
        fingerprint = digest(["fail", lease.task_id, lease.attempt_id, str(failure), bool(retryable)])
        seen, reply = self._request(request_id, fingerprint)
        if seen:
            return Answer(str(reply[1]))
        self.current(lease, now)
        return ev.Fail(
            request_id=request_id,
            fingerprint=fingerprint,
            task_id=lease.task_id,
            attempt_id=lease.attempt_id,
            failure=str(failure),
            retryable=bool(retryable),
        )

    def _apply_fail(self, event: ev.Fail) -> str:
        task = self.tasks[event.task_id]
        task.failures += 1
        task.failure = event.failure
        self._end_read((event.task_id, event.attempt_id))
        if not event.retryable or task.failures >= task.spec.max_attempts:
            self._move(task, "fail", FAILED)
        else:
            self._move(task, "fail", PENDING)
            self._enqueue(task)
        self._prune_expiry()
        return self._remember(event.request_id, event.fingerprint, task.state)

    def check_release(
        self, leases: Sequence[Lease], request_id: str, now: float
    ) -> ev.Release | Answer[list[str]]:
        leases = list(leases)
        pairs = self._lease_pairs(leases)
        if len({tuple(p) for p in pairs}) != len(pairs):
            raise ValueError("release_tasks got the same lease twice")
        fingerprint = digest(["release", pairs])
        seen, reply = self._request(request_id, fingerprint)
        if seen:
            return Answer(list(reply[1]))
        outcomes = []
        for lease in leases:
            try:
                self.current(lease, now, allow_expired=True)
                outcomes.append("released")
            except (StaleAttempt, InvalidReference):
                outcomes.append("StaleAttempt")
        return ev.Release(
            request_id=request_id,
            fingerprint=fingerprint,
            leases=self._lease_pairs(leases),
            outcomes=outcomes,
        )

    def _apply_release(self, event: ev.Release) -> list[str]:
        for (task_id, attempt_id), outcome in zip(event.leases, event.outcomes, strict=True):
            if outcome != "released":
                continue
            task = self.tasks[task_id]
            self._end_read((task_id, attempt_id))
            self._move(task, "release", PENDING)
            self._enqueue(task)
        self._prune_expiry()
        return self._remember(event.request_id, event.fingerprint, list(event.outcomes))

    def check_yield(
        self, updates: Sequence[Mapping[str, Any]], request_id: str, now: float
    ) -> ev.Yield | Answer[list[str]]:
        """All-or-nothing: every lease must be current (expired leases may still yield)."""
        normal = []
        for update in updates:
            lease = update["lease"]
            ref = update.get("input_ref")
            if ref is not None and not isinstance(ref, RecordSetRef):
                raise TypeError("yield input_ref must be a RecordSetRef or None")
            normal.append(
                {
                    "task_id": lease.task_id,
                    "attempt_id": lease.attempt_id,
                    "input_ref": as_dict(ref) if ref is not None else None,
                    "priority": update.get("priority"),
                    "scheduling_key": update.get("scheduling_key"),
                    "metadata": update.get("metadata"),
                }
            )
        fingerprint = digest(["yield", normal])
        seen, reply = self._request(request_id, fingerprint)
        if seen:
            return Answer(list(reply[1]))
        for update, item in zip(updates, normal, strict=True):
            task = self.current(update["lease"], now, allow_expired=True)
            _check_task_metadata(_replace_spec(task.spec, item))  # validates priority and metadata
        if len({item["task_id"] for item in normal}) != len(normal):
            raise ValueError("yield_tasks got the same task twice")
        return ev.Yield(request_id=request_id, fingerprint=fingerprint, updates=normal)

    def _apply_yield(self, event: ev.Yield) -> list[str]:
        for item in event.updates:
            task = self.tasks[item["task_id"]]
            self._end_read((item["task_id"], item["attempt_id"]))
            task.spec = _replace_spec(task.spec, item)
            self._move(task, "yield", PENDING)
            self._enqueue(task)
        self._prune_expiry()
        return self._remember(event.request_id, event.fingerprint, [PENDING] * len(event.updates))

    def check_progress(
        self, updates: Sequence[Mapping[str, Any]], request_id: str, now: float
    ) -> ev.Progress | Answer[list[str]]:
        normal = []
        for update in updates:
            lease, ref = update["lease"], update["input_ref"]
            if not isinstance(ref, RecordSetRef):
                raise TypeError("save_task_progress input_ref must be a RecordSetRef")
            normal.append(
                {"task_id": lease.task_id, "attempt_id": lease.attempt_id, "input_ref": as_dict(ref)}
            )
        fingerprint = digest(["progress", normal])
        seen, reply = self._request(request_id, fingerprint)
        if seen:
            return Answer(list(reply[1]))
        for update in updates:
            self.current(update["lease"], now)
        return ev.Progress(request_id=request_id, fingerprint=fingerprint, updates=normal)

    def _apply_progress(self, event: ev.Progress) -> list[str]:
        for item in event.updates:
            task = self.tasks[item["task_id"]]
            self._move(task, "progress", LEASED)
            task.spec = _replace_spec(task.spec, {"input_ref": item["input_ref"]})
            lease = task.lease
            if lease is not None:
                key = (item["task_id"], item["attempt_id"])
                self.reads[key] = lease
                self.read_inputs.setdefault(key, []).append(item["input_ref"])
        return self._remember(event.request_id, event.fingerprint, [LEASED] * len(event.updates))

    def check_cancel(self, task_id: str, request_id: str) -> ev.Cancel | Answer[str]:
        fingerprint = digest(["cancel", task_id])
        seen, reply = self._request(request_id, fingerprint)
        if seen:
            return Answer(str(reply[1]))
        if self.find_task(task_id) is None:
            raise KeyError(f"unknown task {task_id!r}")  # changes nothing
        return ev.Cancel(request_id=request_id, fingerprint=fingerprint, task_id=task_id)

    def _apply_cancel(self, event: ev.Cancel) -> str:
        task = self.find_task(event.task_id)
        if task is None:
            raise CorruptData(f"the journal cancels task {event.task_id!r}, which the queue never knew")
        if task.state == PENDING:
            self._dequeue(task)
            self._move(task, "cancel", CANCELLED)
        elif task.state == LEASED:
            self._move(task, "cancel", CANCELLED)
            self._prune_expiry()
        return self._remember(event.request_id, event.fingerprint, task.state)

    def check_seal(self, request_id: str) -> ev.Seal | Answer[bool]:
        fingerprint = digest(["seal"])
        seen, _ = self._request(request_id, fingerprint)
        if seen:
            return Answer(True)
        return ev.Seal(request_id=request_id, fingerprint=fingerprint)

    def _apply_seal(self, event: ev.Seal) -> bool:
        self.sealed = True
        return self._remember(event.request_id, event.fingerprint, True)

    def _apply_drain(self, event: ev.Drain) -> bool:
        self.draining = True
        return True

    # ------------------------------------------------------------------ workers and reads

    def check_retire(self, worker_id: str) -> ev.Retire:
        leased = [
            [t.spec.task_id, t.held[HELD_ATTEMPT]]
            for t in self.tasks.values()
            if t.state == LEASED and t.held is not None and t.held[HELD_WORKER] == worker_id
        ]
        reads = [list(key) for key, lease in self.reads.items() if lease.worker_id == worker_id]
        return ev.Retire(worker_id=worker_id, leased=leased, reads=reads)

    def _replay_retire(self, event: ev.Retire) -> list[Receipt]:
        """A retire's effect without its reply: replay discards replies, and this one reads every
        history file (recovery reads only live state, DURABILITY.md J4)."""
        self._reclaim(event.leased, f"worker {event.worker_id} retired")
        for task_id, attempt_id in event.reads:
            self._end_read((task_id, attempt_id))
        return []

    def _apply_retire(self, event: ev.Retire) -> list[Receipt]:
        self._replay_retire(event)
        worker = event.worker_id
        base = self.commits.base
        in_memory = [p for p, w in enumerate(self.commit_workers, base) if w == worker]
        return self.history.worker_receipts(worker) + [self.commits[p] for p in in_memory]

    def check_release_reads(self, leases: Sequence[Lease]) -> ev.ReleaseReads:
        return ev.ReleaseReads(reads=self._lease_pairs(list(leases)))

    def _apply_release_reads(self, event: ev.ReleaseReads) -> int:
        released = 0
        for task_id, attempt_id in event.reads:
            released += self._end_read((task_id, attempt_id))
        return released

    def _apply_epoch(self, event: ev.Epoch) -> int:
        """Recovery: a new coordinator epoch revokes every lease (each spends an attempt)."""
        invariant(event.epoch > self.epoch, "epochs only grow")
        self.epoch = event.epoch
        leased = [
            [t.spec.task_id, t.held[HELD_ATTEMPT]]
            for t in self.tasks.values()
            if t.state == LEASED and t.held is not None
        ]
        self._reclaim(leased, f"revoked by recovery (epoch {self.epoch})")
        self.draining = False
        self.ledger.revoke_owners()  # recovery also ends every consumer's ownership
        return self.epoch

    # ------------------------------------------------------------------ the ledger's calls

    def check_save_consumer(
        self,
        consumer_id: str,
        token: str,
        request_id: str,
        state: dict[str, Any],
        acked: Acked | None = None,
        verified: frozenset[int] = frozenset(),
    ) -> ev.SaveConsumer | Answer[Any]:
        """``acked``: what the new state acknowledges, for the training consumer; ``verified``:
        released positions the caller checked are still readable and owns again (a rewind)."""
        fingerprint = digest(["consumer", consumer_id, state])
        seen, reply = self._request(request_id, fingerprint)
        if seen:
            return Answer(reply[1])
        self.ledger.consumer(consumer_id, token)
        check_cursors(state, len(self.commits))
        return ev.SaveConsumer(
            request_id=request_id,
            fingerprint=fingerprint,
            consumer_id=consumer_id,
            state=state,
            released=self.ledger.rewound(acked, verified),
        )

    def _apply_save_consumer(self, event: ev.SaveConsumer) -> dict[str, Any]:
        state = self.ledger.apply_save_consumer(event)
        return self._remember(event.request_id, event.fingerprint, state)

    def check_plan_batch(
        self, consumer_id: str, token: str, batch: dict[str, Any]
    ) -> ev.PlanBatch | Answer[dict[str, Any]]:
        return self.ledger.check_plan_batch(consumer_id, token, batch, len(self.commits))

    def check_batch_ready(
        self,
        consumer_id: str,
        token: str,
        batch_id: str,
        ready_ref: dict[str, Any],
        state: dict[str, Any],
        acked: Acked | None = None,
        verified: frozenset[int] = frozenset(),
    ) -> ev.BatchReady | Answer[dict[str, Any]]:
        commits = len(self.commits)
        return self.ledger.check_batch_ready(
            consumer_id, token, batch_id, ready_ref, state, commits, acked, verified
        )

    # ------------------------------------------------------------------ dispatch

    def apply(self, event: ev.Op[R], *, replaying: bool = False) -> R:
        """Perform one event (live or replayed); its reply. Events come from a check or from
        :func:`events.decode`, which refuses unknown ops, so every type has a handler.
        ``replaying``: the same effect, but a reply replay would discard may be left out."""
        handler = (_REPLAY if replaying else _APPLY).get(type(event))
        if handler is None:
            invariant(False, f"event type {type(event).__name__} has a handler")
            return cast(R, None)  # unreachable: invariant raised
        reply = handler(self, event)
        if event.reach:
            self.ref_packs.update(event.reach)
            self.reach_since.update(event.reach)
        return cast(R, reply)

    # ------------------------------------------------------------------ GC roots

    def roots(self, acked: Acknowledged, *, labels: bool = False, ahead: HistoryNeeds | None = None) -> Roots:
        """What the queue still needs (docs/GC.md "Queue roots"): inputs of live tasks and of
        outstanding reads, accepted results ``acked`` does not cover (the training consumer's
        acknowledgement, ``Ledger.acknowledged``), and the ledger's roots. The coordinator's
        collection and ``straw check`` both call this; ``labels`` records what needs each root.
        ``ahead``: :func:`history_needs` of some history files under an acknowledgement that
        ``acked`` includes (read before the lock); those files are not read again.
        """
        out = Roots(ref_labels=[] if labels else None, pack_labels={} if labels else None)
        for task in self.tasks.values():
            if task.state in (PENDING, LEASED) and task.spec.input_ref is not None:
                out.add(("input", task.spec.task_id), as_dict(task.spec.input_ref))
        for (task_id, attempt_id), inputs in self.read_inputs.items():
            for ref in inputs:
                out.add(("read", task_id, attempt_id), ref)
        self._history_roots(acked, out, ahead or {})
        covers, packs = acked.covers, out.packs
        for position, known in enumerate(self.commit_packs, self.commits.base):
            if not covers(position):
                if not known:
                    out.add(("result", position), self.commits[position]["result_ref"])
                elif labels:
                    out.add_packs(("result", position), known)
                else:
                    packs.update(known)  # the common case, kept lean: GC holds the lock meanwhile
        self.ledger.roots(acked.finished, out.add)
        return out

    def _history_roots(self, acked: Acknowledged, out: Roots, ahead: HistoryNeeds) -> None:
        """Roots among receipts on disk: a pack is needed while any position reaching it is not
        acknowledged (each file lists its packs with their positions, read once per collection).
        A file whose every position is acknowledged is passed over without a read, and without
        a step per position (the lock is held). A file in ``ahead`` uses what was read of it:
        the packs needed under an acknowledgement that ``acked`` includes, a superset of those
        needed now (a collection then keeps a little more, never less)."""
        acknowledged = acked.covers
        for file in self.history.files:
            if acked.covers_all(file.first, file.stop):
                continue  # every result of this file processed (or it holds none): no read
            if out.pack_labels is not None:
                meta = file.meta()
                for pack, positions in meta["packs"].items():
                    for p in positions:
                        if not acknowledged(p):
                            out.add_packs(("result", p), [pack])
                unknown = meta["unknown"]
            else:
                found = ahead.get(file)
                packs, unknown = found if found is not None else _file_needs(file, acked, out.packs)
                out.packs.update(packs)
            for p in unknown:
                if not acknowledged(p):
                    out.add(("result", p), self.commits[p]["result_ref"])

    def describe_root(self, label: Label) -> str:
        """What a root label names, for messages (``straw check``)."""
        kind = label[0]
        if kind == "input":
            return f"input of task {label[1]!r}"
        if kind == "read":
            return f"input read by task {label[1]!r} attempt {label[2][:12]}"
        if kind == "result":
            task_id = self.commits[label[1]].get("task_id")
            return f"result of task {task_id!r} (accepted at position {label[1]})"
        if kind in ("consumer", "batch"):
            return f"{label[2]} of {kind} {label[1]!r}"
        return f"checkpoint {label[1]!r}"

    def known_reach(self, refs: Iterable[Mapping[str, Any]]) -> tuple[list[Mapping[str, Any]], set[str]]:
        """Split root references into those whose packs were journaled (their packs, returned)
        and those still to resolve (named before packs were journaled with references)."""
        unknown = []
        packs: set[str] = set()
        for ref in refs:
            known = self.ref_packs.get(ref_key(ref))
            if known is None:
                unknown.append(ref)
            elif known == 0:
                packs.add(ref["manifest"]["segment"]["path"])
            else:
                packs.update(known)  # type: ignore[arg-type]
        return unknown, packs

    # ------------------------------------------------------------------ views

    def files_counted_whole(self, acked: Acknowledged) -> list[HistoryFile]:
        """The history files :meth:`usage` counts by their totals (their meta rows, once read)."""
        return [file for file in self.history.files if _counted_whole(acked, file)]

    def usage(self, acked: Acknowledged) -> dict[str, Any]:
        """Accounting of the peer's ``_usage`` (diagnostic; nothing is refused by it): accepted
        results ``acked`` does not cover, plus the estimates of leased production tasks; ready
        batches (the ledger's)."""
        acknowledged = acked.covers
        unprocessed = {"records": 0, "bytes": 0, "tokens": 0}

        def add(records: int, payload_bytes: int, tokens: int) -> None:
            unprocessed["records"] += records
            unprocessed["bytes"] += payload_bytes
            unprocessed["tokens"] += tokens

        def add_results(positions: Iterable[int]) -> None:
            for position in positions:
                ref = self.commits[position]["result_ref"]
                add(ref["records"], ref["payload_bytes"], ref["tokens"])

        for file in self.history.files:
            if _counted_whole(acked, file):
                add(*file.totals())  # the usual case: its totals, kept per file
            elif not acked.covers_all(file.first, file.stop):  # the cursor is inside this file
                add_results(p for p in range(file.first, file.stop) if not acknowledged(p))
        add_results(p for p in range(self.commits.base, len(self.commits)) if not acknowledged(p))
        inflight = control = 0
        reserved = dict(unprocessed)
        for task in self.tasks.values():
            if task.state != LEASED:
                continue
            if task.spec.control:
                control += 1
                continue
            inflight += 1
            reserved["records"] += task.spec.estimated_records
            reserved["bytes"] += task.spec.estimated_bytes
            reserved["tokens"] += task.spec.estimated_tokens
        ready = self.ledger.ready(acked.finished)
        return {
            "accepted_unprocessed": unprocessed,
            **reserved,
            "inflight": inflight,
            "control_inflight": control,
            "train_ready": ready,
            "ready_bytes": ready["bytes"],
        }

    def pending_specs(self, task_prefix: str | None, min_priority: int | None) -> list[TaskSpec]:
        out = []
        for task_id in self.pending.ordered():
            spec = self.tasks[task_id].spec
            if min_priority is not None and spec.priority < min_priority:
                break  # ordered by priority descending
            if task_prefix and not task_id.startswith(task_prefix):
                continue
            out.append(spec)
        return out


def _check_task_metadata(spec: TaskSpec) -> None:
    """A task's metadata is bounded by what a journal frame holds (TASK_METADATA_BYTES_MAX);
    ``Limits.metadata_bytes`` is an identity field of the queue, not a quota (API.md 2)."""
    size = len(encode(spec.metadata)) if spec.metadata else 2
    if size > TASK_METADATA_BYTES_MAX:
        raise ResourceLimitExceeded(
            f"task {spec.task_id!r}: metadata is {size} bytes, the limit is {TASK_METADATA_BYTES_MAX}"
        )


def ref_key(ref: Mapping[str, Any]) -> str:
    """A record set reference's identity in ``QueueState.ref_packs``: its manifest's place."""
    manifest = ref["manifest"]
    segment = manifest["segment"]
    return f"{segment['path']}@{segment['offset']}#{manifest['ordinal']}"


def object_key(ref: RecordSetRef) -> str:
    """:func:`ref_key` of a reference object (without building its dict)."""
    segment = ref.manifest.segment
    return f"{segment.path}@{segment.offset}#{ref.manifest.ordinal}"


_SPEC_FIELDS = (
    "task_id",
    "metadata",
    "allow_empty",
    "max_attempts",
    "estimated_records",
    "estimated_bytes",
    "estimated_tokens",
    "control",
    "priority",
    "scheduling_key",
)


def state_to_dict(state: QueueState) -> dict[str, Any]:
    """The whole state as JSON-ready data (a journal snapshot body, docs/FORMAT.md section 8).

    Compact on purpose (recovery time is proportional to it): task specs are
    field lists, and input references shared by many tasks are stored once.
    """
    refs, rows = _compact_specs([t.spec for t in state.tasks.values()])
    ledger = state.ledger
    tasks = [
        [
            row,
            t.request_id,
            t.state,
            t.order,
            t.generation,
            t.failures,
            t.failure,
            _held_row(t, state),
            t.deadline,
        ]
        for row, t in zip(rows, state.tasks.values(), strict=True)
    ]
    return {
        "v": SNAPSHOT_VERSION,
        "run_id": state.run_id,
        "queue_id": state.queue_id,
        "epoch": state.epoch,
        "sealed": state.sealed,
        "draining": state.draining,
        "next_order": state.next_order,
        "refs": refs,
        "tasks": tasks,
        "requests": {k: [v[0], v[1]] for k, v in state.requests.items()},
        "commits": state.commits.pack(state.run_id),
        "commit_workers": state.commit_workers,
        # A result that lives in one pack (the usual case) reaches just its manifest's pack: 0.
        "commit_packs": [
            0 if packs == (state.commits.result_path(position),) else list(packs)
            for position, packs in enumerate(state.commit_packs, state.commits.base)
        ],
        "producers": state.producers,
        "reads": [[as_dict(lease), state.read_inputs.get(key, [])] for key, lease in state.reads.items()],
        "consumers": {k: [c.owner, c.token, c.open, c.state] for k, c in ledger.consumers.items()},
        "batches": ledger.batches,
        "checkpoints": ledger.checkpoints,
        "released": [ledger.released_cursor, sorted(ledger.released_positions)],
        "ref_packs": state.ref_packs,
        "history": state.history.describe(),
        **({"history_runs": state.history.describe_runs()} if state.history.runs else {}),
    }


class _TaskRows:
    """Terminal tasks as history file rows (``history.Rows``), each built when its block is."""

    def __init__(self, state: QueueState, tasks: Sequence[Task]) -> None:
        self._state, self._tasks = state, tasks

    def __len__(self) -> int:
        return len(self._tasks)

    def key(self, at: int) -> str:
        return self._tasks[at].spec.task_id

    def rows(self, ats: Sequence[int]) -> list[Any]:
        return [task_row(self._tasks[at], self._state) for at in ats]


class _ReceiptRows:
    """Accepted positions ``commits.base .. stop - 1`` as history file rows (``history.Rows``):
    ``[receipt, worker, packs reached]``, each built when its block is."""

    def __init__(self, state: QueueState, stop: int) -> None:
        self._state, self._base = state, state.commits.base
        self._ids = state.commits.submission_ids(stop)

    def __len__(self) -> int:
        return len(self._ids)

    def key(self, at: int) -> str:
        return self._ids[at]

    def rows(self, ats: Sequence[int]) -> list[Any]:
        state, base = self._state, self._base
        return [
            [state.commits[base + at], state.worker_at(base + at), state.packs_at(base + at)] for at in ats
        ]


def task_row(task: Task, state: QueueState) -> list[Any]:
    """A task as a history file row: its id first, then what ``state_to_dict`` keeps of it."""
    refs, rows = _compact_specs([task.spec])
    lease = _held_row(task, state)
    return [
        task.spec.task_id,
        task.request_id,
        task.state,
        task.order,
        task.generation,
        task.failures,
        task.failure,
        lease,
        task.deadline,
        refs,
        rows[0],
    ]


#: Per history file, what :func:`history_needs` found: the packs some position of it that the
#: acknowledgement does not cover reaches, and its positions whose packs were not recorded.
HistoryNeeds = dict[HistoryFile, tuple[set[str], list[int]]]


def history_needs(files: Sequence[HistoryFile], acked: Acknowledged) -> HistoryNeeds:
    """What :meth:`QueueState.roots` needs of each of ``files`` not wholly covered by ``acked``.

    It reads each file's meta row and no live state (a file never changes once written), so the
    coordinator calls it before taking its lock (a collection over a thousand files would
    otherwise read about a second under it)."""
    return {
        file: _file_needs(file, acked, frozenset())
        for file in files
        if not acked.covers_all(file.first, file.stop)
    }


def _file_needs(file: HistoryFile, acked: Acknowledged, known: Collection[str]) -> tuple[set[str], list[int]]:
    """One file's part of :func:`history_needs` (packs already in ``known`` are not looked at)."""
    meta = file.meta()
    acknowledged = acked.covers
    packs = {
        pack
        for pack, positions in meta["packs"].items()
        if pack not in known and not all(acknowledged(p) for p in positions)
    }
    return packs, list(meta["unknown"])


def _counted_whole(acked: Acknowledged, file: HistoryFile) -> bool:
    """A history file that holds results none of which ``acked`` covers: it counts whole."""
    return file.stop > file.first and not acked.covers_any(file.first, file.stop)


def task_from_row(row: Sequence[Any], state: QueueState) -> Task:
    """The :class:`Task` a history row holds (not put back in the state: it is finished)."""
    task_id, request_id, status, order, generation, failures, failure, lease, deadline, refs, spec = row
    (built,) = _expand_specs(refs, [spec])
    invariant(built.task_id == task_id, "a history row names its own task")
    return Task(
        built,
        request_id,
        status,
        order,
        generation,
        failures,
        failure,
        _row_lease(state, task_id, lease),
        deadline,
    )


def _held_row(task: Task, state: QueueState) -> list[Any] | None:
    """A task's lease as the values its task and queue do not already give (snapshots only)."""
    held = task.held
    if held is None:
        return None
    invariant(
        held[: len(_IMPLIED)] == (state.run_id, state.queue_id, task.spec.task_id),
        "a task's lease was minted by its own queue",
    )
    return list(held[len(_IMPLIED) :])


def _row_lease(state: QueueState, task_id: str, row: Sequence[Any] | None) -> Lease | None:
    """The lease :func:`_held_row` kept as ``row`` (checked as any Lease is)."""
    return Lease(state.run_id, state.queue_id, task_id, *row) if row is not None else None


#: Version of the snapshot body (``state_to_dict``). 2: the accepted log as rows, segment rows
#: and a path table (``straw._queue.commits``), task leases without implied fields. 3: terminal
#: history in files the snapshot names (``history``, docs/FORMAT.md 8.4); 2 is still read.
SNAPSHOT_VERSION = 3
SNAPSHOT_VERSIONS = (2, 3)


def new_state(run_id: str, queue_id: str, limits: Mapping[str, int]) -> QueueState:
    """An empty queue with the per-item limits of its identity (``Limits``)."""
    return QueueState(
        run_id,
        queue_id,
        max_result_bytes=limits["max_result_bytes"],
        max_result_tokens=limits["max_result_tokens"],
        metadata_bytes=limits["metadata_bytes"],
    )


def state_from_dict(
    data: Mapping[str, Any], limits: Mapping[str, int], opener: Opener | None = None
) -> QueueState:
    """Rebuild a state (and its indexes) from :func:`state_to_dict` output.

    Python's cycle collector is paused meanwhile: the rebuild allocates one object per
    field of every task and would otherwise trigger full collections over a growing heap.
    """
    version = data.get("v") if isinstance(data, Mapping) else None
    if version not in SNAPSHOT_VERSIONS:
        raise UnsupportedSchema(
            f"queue snapshot version {version!r} is not supported (this straw reads {SNAPSHOT_VERSIONS})"
        )
    described = data.get("history") or []
    files: list[HistoryFile] = []
    if described:
        if opener is None:
            raise UnsupportedSchema("this queue snapshot names history files; open it with its directory")
        files = open_files(opener, described)  # trailers only: CorruptData names a bad file
    runs: list[IndexRun] = []
    try:
        if opener is not None:
            runs = open_runs(opener, data.get("history_runs") or [], files)
        return _attached(data, limits, files, runs)
    except BaseException:
        close_all([*files, *runs])  # a state that is not built keeps no descriptor
        raise


def _attached(
    data: Mapping[str, Any], limits: Mapping[str, int], files: list[HistoryFile], runs: list[IndexRun]
) -> QueueState:
    try:
        with collector_paused():
            state = _state_from_dict(data, limits)
            for file in files:
                state.attach(file)
            state.history.use_runs(runs)
            for status, count in state.history.counts().items():
                state.counts[status] += count
        invariant(state.history.base == state.commits.base, "history files hold the receipts below base")
        return state
    except (KeyError, IndexError, TypeError, ValueError) as error:
        # The frame's checksum held, so only a writer bug produces this; never guess past it.
        raise CorruptData(f"queue snapshot is malformed ({type(error).__name__}: {error})") from None


def _state_from_dict(data: Mapping[str, Any], limits: Mapping[str, int]) -> QueueState:
    state = new_state(data["run_id"], data["queue_id"], limits)
    state.epoch, state.sealed, state.draining = data["epoch"], data["sealed"], data["draining"]
    state.next_order = data["next_order"]
    refs = [RecordSetRef.from_dict(item) for item in data["refs"]]
    pending: list[Key] = []
    control: list[Key] = []
    for row, request_id, status, order, generation, failures, failure, lease, deadline in data["tasks"]:
        *fields, slot = row  # _SPEC_FIELDS values, then the input ref's slot (see _compact_specs)
        spec = _trusted_spec(fields, refs[slot] if slot is not None else None)
        task = Task(
            spec,
            request_id,
            status,
            order,
            generation,
            failures,
            failure,
            _row_lease(state, spec.task_id, lease),
            deadline,
        )
        state.tasks[spec.task_id] = task
        state.counts[status] += 1
        if status in (PENDING, LEASED):
            state.unfinished.add(spec.task_id)
        if status == PENDING:
            key = pending_key(spec.priority, spec.scheduling_key, order, spec.task_id)
            (control if spec.control else pending).append(key)
        elif status == LEASED and task.held is not None:
            heapq.heappush(state.expiry, (deadline, spec.task_id, task.held[HELD_ATTEMPT]))
    state.pending.add_many(pending)
    state.control.add_many(control)
    state.requests = {k: (v[0], v[1]) for k, v in data["requests"].items()}
    state.commits = CommitLog.unpack(data["commits"], state.run_id)
    state.commit_workers = list(data["commit_workers"])
    state.commit_packs = [
        (state.commits.result_path(position),) if packs == 0 else tuple(packs)
        for position, packs in enumerate(data["commit_packs"], state.commits.base)
    ]
    invariant(
        len(state.commit_packs) == len(state.commits) - state.commits.base,
        "one pack list per accepted result",
    )
    state.submissions = state.commits.submissions()
    state.producers = dict(data["producers"])
    for item, inputs in data["reads"]:
        lease = Lease.from_dict(item)
        state.reads[(lease.task_id, lease.attempt_id)] = lease
        state.read_inputs[(lease.task_id, lease.attempt_id)] = list(inputs)
    ledger = state.ledger
    ledger.consumers = {k: Consumer(v[0], v[1], v[2], v[3]) for k, v in data["consumers"].items()}
    ledger.batches = dict(data["batches"])
    ledger.checkpoints = dict(data["checkpoints"])
    state.ref_packs = dict(data.get("ref_packs", {}))  # absent in older snapshots: roots are read
    released = data.get("released", [0, []])  # absent in snapshots written before released history
    ledger.released_cursor, ledger.released_positions = int(released[0]), frozenset(released[1])
    return state


def _on_ledger(handler: Callable[[Ledger, Any], object]) -> Callable[[QueueState, Any], object]:
    """A ledger op's handler, applied to the state's ledger."""
    return lambda state, event: handler(state.ledger, event)


#: Dispatch by event type. Each handler takes its own event class: the table is what pairs
#: them, so its value type is erased (``apply`` restores the reply type from the event's).
_APPLY: dict[type[Event], Callable[[QueueState, Any], object]] = {
    ev.Submit: QueueState._apply_submit,
    ev.Acquire: QueueState._apply_acquire,
    ev.Complete: QueueState._apply_complete,
    ev.CompleteMany: QueueState._apply_complete_many,
    ev.Fail: QueueState._apply_fail,
    ev.Release: QueueState._apply_release,
    ev.Yield: QueueState._apply_yield,
    ev.Progress: QueueState._apply_progress,
    ev.Cancel: QueueState._apply_cancel,
    ev.Seal: QueueState._apply_seal,
    ev.Drain: QueueState._apply_drain,
    ev.Retire: QueueState._apply_retire,
    ev.ReleaseReads: QueueState._apply_release_reads,
    ev.Epoch: QueueState._apply_epoch,
    ev.OpenConsumer: _on_ledger(Ledger.apply_open_consumer),
    ev.CloseConsumer: _on_ledger(Ledger.apply_close_consumer),
    ev.SaveConsumer: QueueState._apply_save_consumer,
    ev.PlanBatch: _on_ledger(Ledger.apply_plan_batch),
    ev.BatchReady: _on_ledger(Ledger.apply_batch_ready),
    ev.RegisterCheckpoint: _on_ledger(Ledger.apply_register_checkpoint),
    ev.ReleaseCheckpoint: _on_ledger(Ledger.apply_release_checkpoint),
    ev.ReleaseHistory: _on_ledger(Ledger.apply_release_history),
}
invariant(_APPLY.keys() == set(ev.OPS.values()), "every journal op has a handler")

#: Replay's handlers: the same effects, without replies that cost more than the effect and
#: that replay would discard (a retire's receipts read the whole history).
_REPLAY: dict[type[Event], Callable[[QueueState, Any], object]] = {
    **_APPLY,
    ev.Retire: QueueState._replay_retire,
}


# ---------------------------------------------------------------------- spec helpers


def _compact_specs(specs: Sequence[TaskSpec]) -> tuple[list[dict[str, Any]], list[list[Any]]]:
    """Specs as field lists (``_SPEC_FIELDS`` + an index into shared input refs), for events."""
    refs: list[dict[str, Any]] = []
    slots: dict[tuple[str, int, int, str], int] = {}
    rows = []
    for spec in specs:
        ref = spec.input_ref
        slot = None
        if ref is not None:
            key = (ref.manifest.segment.path, ref.manifest.segment.offset, ref.manifest.ordinal, ref.digest)
            slot = slots.get(key)
            if slot is None:
                slot = slots[key] = len(refs)
                refs.append(as_dict(ref))
        rows.append([getattr(spec, name) for name in _SPEC_FIELDS] + [slot])
    return refs, rows


def _expand_specs(refs: Sequence[Mapping[str, Any]], rows: Sequence[Sequence[Any]]) -> list[TaskSpec]:
    shared = [RecordSetRef.from_dict(item) for item in refs]
    specs = []
    for *fields, slot in rows:
        specs.append(_trusted_spec(fields, shared[slot] if slot is not None else None))
    return specs


def _trusted_spec(fields: Sequence[Any], input_ref: RecordSetRef | None) -> TaskSpec:
    """A TaskSpec rebuilt from our own journal or snapshot, whose values were checked when the
    task was submitted: skips ``__post_init__`` (recovery time is proportional to this)."""
    return unchecked(TaskSpec, {**dict(zip(_SPEC_FIELDS, fields, strict=True)), "input_ref": input_ref})


def _replace_spec(spec: TaskSpec, item: Mapping[str, Any]) -> TaskSpec:
    """The spec with the event's new input and, where given, priority, key and metadata."""
    data: dict[str, Any] = as_dict(spec)
    if "input_ref" in item:
        data["input_ref"] = item["input_ref"]
    for name in ("priority", "scheduling_key", "metadata"):
        if item.get(name) is not None:
            data[name] = item[name]
    return TaskSpec.from_dict(data)
