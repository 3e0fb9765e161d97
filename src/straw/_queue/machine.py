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
import gc
import heapq
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ..errors import (
    CorruptData,
    IdempotencyConflict,
    InvalidReference,
    LeaseExpired,
    QueueError,
    ResourceLimitExceeded,
    StaleAttempt,
    StorageUnavailable,
    UnsafeRecovery,
    UnsupportedSchema,
    invariant,
)
from ..limits import TASK_METADATA_BYTES_MAX
from ..protocol import Lease, RecordSetRef, TaskSpec, as_dict, digest, encode, unchecked
from .commits import CommitLog
from .history import History, HistoryFile, Opener, open_files
from .index import Key, PendingIndex, pending_key

Event = dict[str, Any]
NewId = Callable[[], str]
#: One entry of ``complete_tasks``: lease, submission id, result, its digest, the packs it reaches.
Completion = tuple[Lease, str, RecordSetRef, str, Iterable[str]]
#: What ``check_complete_many`` plans for an entry: its known receipt, or its place in the event.
Planned = tuple[str, Any]
R = TypeVar("R")


@dataclass(frozen=True)
class Answer:
    """A check's reply that needs no event: an idempotent repeat or a status (nothing to journal)."""

    value: Any


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


@dataclass
class Task:
    """One task's live state."""

    spec: TaskSpec
    request_id: str
    state: str = PENDING
    order: int = 0
    generation: int = 0
    failures: int = 0
    failure: str | None = None
    lease: Lease | None = None
    deadline: float = 0.0

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


#: What the training consumer acknowledges: (processed_cursor, processed_positions above it).
Acked = tuple[int, frozenset[int]]


@dataclass
class Consumer:
    owner: str
    token: str
    open: bool = True
    state: dict[str, Any] | None = None


@dataclass
class QueueState:
    """Everything the queue knows; rebuilt exactly by replaying its events."""

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
    commit_packs: list[list[str]] = field(default_factory=list)
    producers: dict[str, Any] = field(default_factory=dict)
    reads: dict[tuple[str, str], Lease] = field(default_factory=dict)
    #: Inputs each outstanding read was granted (and later given by save_task_progress): the
    #: holder may still read any of them, whatever the task's input is now (GC roots).
    read_inputs: dict[tuple[str, str], list[dict[str, Any]]] = field(default_factory=dict)
    consumers: dict[str, Consumer] = field(default_factory=dict)
    batches: dict[str, dict[str, Any]] = field(default_factory=dict)
    checkpoints: dict[str, dict[str, Any]] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STATES, 0))
    #: Accepted history the queue stopped owning (docs/QUEUE.md "Released history"): every
    #: position below ``released_cursor`` and those in ``released_positions`` (all above it).
    #: Set by ``collect_garbage`` to what the training consumer had acknowledged; a rewind of
    #: that consumer takes positions back (the queue owns them again).
    released_cursor: int = 0
    released_positions: frozenset[int] = frozenset()
    #: Packs each named reference reaches (``ref_key`` -> packs, or 0 for just its manifest's
    #: pack), journaled with the call that named it: collecting garbage, even right after a
    #: recovery, reads nothing to know a root's packs (docs/GC.md "Queue roots").
    ref_packs: dict[str, list[str] | int] = field(default_factory=dict)
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

    def _history_receipts(self, start: int, stop: int) -> list[dict[str, Any]]:
        return [row[0] for row in self.history.receipts(start, stop)]

    def worker_at(self, position: int) -> str:
        base = self.commits.base
        return (
            str(self.history.receipt(position)[1])
            if position < base
            else self.commit_workers[position - base]
        )

    def packs_at(self, position: int) -> list[str]:
        base = self.commits.base
        return (
            list(self.history.receipt(position)[2]) if position < base else self.commit_packs[position - base]
        )

    def spillable(self) -> tuple[list[Task], int]:
        """What can move to a history file now: terminal tasks in memory, and the accepted
        positions up to (not including) the returned count (receipts never change)."""
        done = [t for t in self.tasks.values() if t.state in (COMPLETED, FAILED, CANCELLED)]
        return done, len(self.commits)

    def spill_rows(self, tasks: Sequence[Task], stop: int) -> tuple[list[Any], list[Any], dict[str, Any]]:
        """The rows of a history file for ``tasks`` and positions ``commits.base .. stop - 1``."""
        task_rows = [(t.spec.task_id, task_row(t, self)) for t in tasks]
        receipts = []
        workers: dict[str, list[int]] = {}
        packs: dict[str, list[int]] = {}
        unknown: list[int] = []
        totals = [0, 0, 0]
        for position in range(self.commits.base, stop):
            receipt = self.commits[position]
            worker, reached = self.worker_at(position), self.packs_at(position)
            receipts.append((receipt["submission_id"], [receipt, worker, reached]))
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
        return task_rows, receipts, meta

    def attach(self, file: HistoryFile) -> None:
        """A durable history file (named by a durable snapshot) now answers for what it holds."""
        self.history.add(file)
        self.commits.history = self._history_receipts

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
            tasks[task_id] = Task(
                t.spec,
                t.request_id,
                t.state,
                t.order,
                t.generation,
                t.failures,
                t.failure,
                t.lease,
                t.deadline,
            )
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
            consumers={k: Consumer(c.owner, c.token, c.open, c.state) for k, c in self.consumers.items()},
            batches={k: dict(batch) for k, batch in self.batches.items()},
            checkpoints={k: dict(entry) for k, entry in self.checkpoints.items()},
            counts=dict(self.counts),
            released_cursor=self.released_cursor,
            released_positions=self.released_positions,
            ref_packs=dict(self.ref_packs),
            history=History(self.history.files, self.history.merged_indexes),
            unfinished=set(self.unfinished),
        )
        out.commits.history = out._history_receipts
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
        if seen is None:
            return False, None
        if seen[0] != fingerprint:
            raise IdempotencyConflict(f"request id {request_id!r} was already used for a different request")
        return True, seen

    def _remember(self, event: Event, reply: R) -> R:
        request_id = event.get("request_id")
        if request_id is not None:
            self.requests[request_id] = (event["fingerprint"], reply)
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
        held = task.lease
        if (
            task.state != LEASED
            or held is None
            or held.attempt_id != lease.attempt_id
            or held.token != lease.token
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
    ) -> Event | Answer:
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
        return {
            "op": "submit",
            "request_id": request_id,
            "fingerprint": fingerprint,
            "refs": refs,
            "tasks": rows,
            "producer_id": producer_id,
            "producer_state": producer_state,
            # Not journaled (keys starting with "_" are live-only): the checked specs themselves,
            # so applying live does not rebuild what replay must rebuild from "tasks". A spec
            # with metadata gets our own copy: the caller may mutate its dict later.
            "_specs": [
                spec
                if not spec.metadata
                else dataclasses.replace(spec, metadata=copy.deepcopy(spec.metadata))
                for spec in specs
            ],
        }

    def _apply_submit(self, event: Event) -> list[str]:
        ids = []
        specs = event.get("_specs")
        if specs is None:
            specs = _expand_specs(event["refs"], event["tasks"])
        for spec in specs:
            task = Task(spec, event["request_id"])
            self.tasks[spec.task_id] = task
            self.unfinished.add(spec.task_id)
            self.counts[PENDING] += 1
            self._enqueue(task)
            ids.append(spec.task_id)
        if event["producer_id"] is not None:
            self.producers[event["producer_id"]] = event["producer_state"]
        return self._remember(event, ids)

    # ------------------------------------------------------------------ acquire and leases

    def _live_entry(self, deadline: float, task_id: str, attempt_id: str) -> bool:
        """True if a heap entry is the current deadline of a current lease."""
        task = self.tasks.get(task_id)
        if task is None:
            return False  # a finished task moved to history: its old entries are stale
        lease = task.lease
        return (
            task.state == LEASED
            and lease is not None
            and lease.attempt_id == attempt_id
            and task.deadline == deadline
        )

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
    ) -> Event | Answer:
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
        return {
            "op": "acquire",
            "worker_id": worker_id,
            "reclaimed": reclaimed,
            "grants": grants,
            "deadline": now + lease_seconds,
        }

    def drained_input(self) -> bool:
        """Sealed, and nothing pending (control tasks included) or leased."""
        return self.sealed and not len(self.pending) and not len(self.control) and not self.counts[LEASED]

    def _idle_status(self) -> str:
        if self.drained_input():
            return "end_of_input"
        return "empty"

    def _apply_acquire(self, event: Event) -> list[Lease]:
        self._reclaim(event["reclaimed"], "lease expired")
        leases = []
        for task_id, attempt_id, token in event["grants"]:
            task = self.tasks[task_id]
            self._move(task, "acquire", LEASED)  # checks the transition before touching the index
            self._dequeue(task)
            task.generation += 1
            task.lease = Lease(
                run_id=self.run_id,
                queue_id=self.queue_id,
                task_id=task_id,
                attempt_id=attempt_id,
                generation=task.generation,
                coordinator_epoch=self.epoch,
                token=token,
                worker_id=event["worker_id"],
            )
            task.deadline = event["deadline"]
            heapq.heappush(self.expiry, (task.deadline, task_id, attempt_id))
            if task.spec.input_ref is not None:
                self.reads[(task_id, attempt_id)] = task.lease
                self.read_inputs[(task_id, attempt_id)] = [as_dict(task.spec.input_ref)]
            leases.append(task.lease)
        return leases

    def _reclaim(self, pairs: Iterable[Sequence[str]], why: str) -> None:
        """Take leases back: each spends an attempt; an exhausted task fails. Reads stay outstanding."""
        for task_id, attempt_id in pairs:
            task = self.tasks[task_id]
            invariant(
                task.lease is not None and task.lease.attempt_id == attempt_id, "reclaimed lease is current"
            )
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
    ) -> Answer | None:
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
    ) -> Event | Answer:
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
        return {
            "op": "complete",
            "task_id": lease.task_id,
            "attempt_id": lease.attempt_id,
            "submission_id": submission_id,
            "commit_id": new_id(),
            "digest": result_digest,
            "result_ref": as_dict(result_ref),
            "packs": sorted(packs),
        }

    def _apply_complete(self, event: Event) -> dict[str, Any]:
        task = self.tasks[event["task_id"]]
        invariant(task.lease is not None and task.lease.attempt_id == event["attempt_id"], "completing lease")
        self._move(task, "complete", COMPLETED)
        self._end_read((event["task_id"], event["attempt_id"]))
        receipt = {
            "commit_id": event["commit_id"],
            "task_id": event["task_id"],
            "submission_id": event["submission_id"],
            "digest": event["digest"],
            "position": len(self.commits),
            "result_ref": event["result_ref"],
        }
        self.commits.append(receipt)
        self.commit_workers.append(task.lease.worker_id if task.lease is not None else "")
        self.commit_packs.append(list(event.get("packs", ())))
        self.submissions[event["submission_id"]] = receipt["position"]
        self._prune_expiry()
        return receipt

    def check_complete_many(
        self, entries: Sequence[Completion], now: float, new_id: NewId, *, precheck: bool = False
    ) -> tuple[Event | None, list[Planned]]:
        """``complete_tasks``: each entry checked exactly as :meth:`check_complete` would, in order,
        as if the earlier entries had been applied; the first error raises and nothing is done.

        Returns the event of the entries not yet accepted (None when every one is a retry)
        and, per entry, its plan: ``("known", receipt)`` for an accepted submission, or
        ``("new", k)`` for the k-th completion of the event (a submission named twice in the
        batch, identically, is planned once). With ``precheck``, only the cheap checks of
        :meth:`precheck_complete` run (before the results are validated) and no event is made.
        """
        plans: list[Planned] = []
        completes: list[Event] = []
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
                found: Event | Answer | None
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
            if found is None:
                found = {}  # a precheck: the entry is new, its event is made after validation
            found.pop("op", None)
            fresh[submission_id] = (len(completes), lease.task_id, result_digest)
            taken.add(lease.task_id)
            plans.append(("new", len(completes)))
            completes.append(found)
        event = {"op": "complete_many", "completes": completes} if completes and not precheck else None
        return event, plans

    def _apply_complete_many(self, event: Event) -> list[dict[str, Any]]:
        """The completions of one ``complete_tasks`` transaction, in order (their receipts)."""
        return [self._apply_complete(item) for item in event["completes"]]

    # ------------------------------------------------------------------ returning work

    def check_fail(
        self, lease: Lease, request_id: str, failure: str, retryable: bool, now: float
    ) -> Event | Answer:
        fingerprint = digest(["fail", lease.task_id, lease.attempt_id, str(failure), bool(retryable)])
        seen, reply = self._request(request_id, fingerprint)
        if seen:
            return Answer(str(reply[1]))
        self.current(lease, now)
        return {
            "op": "fail",
            "request_id": request_id,
            "fingerprint": fingerprint,
            "task_id": lease.task_id,
            "attempt_id": lease.attempt_id,
            "failure": str(failure),
            "retryable": bool(retryable),
        }

    def _apply_fail(self, event: Event) -> str:
        task = self.tasks[event["task_id"]]
        task.failures += 1
        task.failure = event["failure"]
        self._end_read((event["task_id"], event["attempt_id"]))
        if not event["retryable"] or task.failures >= task.spec.max_attempts:
            self._move(task, "fail", FAILED)
        else:
            self._move(task, "fail", PENDING)
            self._enqueue(task)
        self._prune_expiry()
        return self._remember(event, task.state)

    def check_release(self, leases: Sequence[Lease], request_id: str, now: float) -> Event | Answer:
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
        return {
            "op": "release",
            "request_id": request_id,
            "fingerprint": fingerprint,
            "leases": self._lease_pairs(leases),
            "outcomes": outcomes,
        }

    def _apply_release(self, event: Event) -> list[str]:
        for (task_id, attempt_id), outcome in zip(event["leases"], event["outcomes"], strict=True):
            if outcome != "released":
                continue
            task = self.tasks[task_id]
            self._end_read((task_id, attempt_id))
            self._move(task, "release", PENDING)
            self._enqueue(task)
        self._prune_expiry()
        return self._remember(event, list(event["outcomes"]))

    def check_yield(
        self, updates: Sequence[Mapping[str, Any]], request_id: str, now: float
    ) -> Event | Answer:
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
        return {"op": "yield", "request_id": request_id, "fingerprint": fingerprint, "updates": normal}

    def _apply_yield(self, event: Event) -> list[str]:
        for item in event["updates"]:
            task = self.tasks[item["task_id"]]
            self._end_read((item["task_id"], item["attempt_id"]))
            task.spec = _replace_spec(task.spec, item)
            self._move(task, "yield", PENDING)
            self._enqueue(task)
        self._prune_expiry()
        return self._remember(event, [PENDING] * len(event["updates"]))

    def check_progress(
        self, updates: Sequence[Mapping[str, Any]], request_id: str, now: float
    ) -> Event | Answer:
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
        return {"op": "progress", "request_id": request_id, "fingerprint": fingerprint, "updates": normal}

    def _apply_progress(self, event: Event) -> list[str]:
        for item in event["updates"]:
            task = self.tasks[item["task_id"]]
            self._move(task, "progress", LEASED)
            task.spec = _replace_spec(task.spec, {"input_ref": item["input_ref"]})
            if task.lease is not None:
                key = (item["task_id"], item["attempt_id"])
                self.reads[key] = task.lease
                self.read_inputs.setdefault(key, []).append(item["input_ref"])
        return self._remember(event, [LEASED] * len(event["updates"]))

    def check_cancel(self, task_id: str, request_id: str) -> Event | Answer:
        fingerprint = digest(["cancel", task_id])
        seen, reply = self._request(request_id, fingerprint)
        if seen:
            return Answer(str(reply[1]))
        if self.find_task(task_id) is None:
            raise KeyError(f"unknown task {task_id!r}")  # changes nothing
        return {"op": "cancel", "request_id": request_id, "fingerprint": fingerprint, "task_id": task_id}

    def _apply_cancel(self, event: Event) -> str:
        task = self.find_task(event["task_id"])
        if task is None:
            raise CorruptData(f"the journal cancels task {event['task_id']!r}, which the queue never knew")
        if task.state == PENDING:
            self._dequeue(task)
            self._move(task, "cancel", CANCELLED)
        elif task.state == LEASED:
            self._move(task, "cancel", CANCELLED)
            self._prune_expiry()
        return self._remember(event, task.state)

    def check_seal(self, request_id: str) -> Event | Answer:
        fingerprint = digest(["seal"])
        seen, _ = self._request(request_id, fingerprint)
        if seen:
            return Answer(True)
        return {"op": "seal", "request_id": request_id, "fingerprint": fingerprint}

    def _apply_seal(self, event: Event) -> bool:
        self.sealed = True
        return bool(self._remember(event, True))

    def _apply_drain(self, event: Event) -> bool:
        self.draining = True
        return True

    # ------------------------------------------------------------------ workers and reads

    def check_retire(self, worker_id: str) -> Event:
        leased = [
            [t.spec.task_id, t.lease.attempt_id]
            for t in self.tasks.values()
            if t.state == LEASED and t.lease is not None and t.lease.worker_id == worker_id
        ]
        reads = [list(key) for key, lease in self.reads.items() if lease.worker_id == worker_id]
        return {"op": "retire", "worker_id": worker_id, "leased": leased, "reads": reads}

    def _apply_retire(self, event: Event) -> list[dict[str, Any]]:
        self._reclaim(event["leased"], f"worker {event['worker_id']} retired")
        for task_id, attempt_id in event["reads"]:
            self._end_read((task_id, attempt_id))
        worker = event["worker_id"]
        on_disk = [p for file in self.history.files for p in file.meta()["workers"].get(worker, ())]
        base = self.commits.base
        in_memory = [p for p, w in enumerate(self.commit_workers, base) if w == worker]
        return [self.commits[p] for p in on_disk + in_memory]

    def check_release_reads(self, leases: Sequence[Lease]) -> Event:
        return {"op": "release_reads", "reads": self._lease_pairs(list(leases))}

    def _apply_release_reads(self, event: Event) -> int:
        released = 0
        for task_id, attempt_id in event["reads"]:
            released += self._end_read((task_id, attempt_id))
        return released

    def _apply_epoch(self, event: Event) -> int:
        """Recovery: a new coordinator epoch revokes every lease (each spends an attempt)."""
        invariant(event["epoch"] > self.epoch, "epochs only grow")
        self.epoch = event["epoch"]
        leased = [
            [t.spec.task_id, t.lease.attempt_id]
            for t in self.tasks.values()
            if t.state == LEASED and t.lease is not None
        ]
        self._reclaim(leased, f"revoked by recovery (epoch {self.epoch})")
        self.draining = False
        # Recovery also ends every consumer's ownership (its token is revoked, its state kept):
        # whoever now declares itself the owner may open it.
        for consumer in self.consumers.values():
            consumer.open = False
        return self.epoch

    # ------------------------------------------------------------------ consumers, batches, checkpoints

    def check_open_consumer(self, consumer_id: str, owner: str, token: str) -> Event:
        _check_name(consumer_id, "consumer_id")
        _check_name(owner, "exclusive_owner")
        consumer = self.consumers.get(consumer_id)
        if consumer is not None and consumer.open and consumer.owner != owner:
            raise UnsafeRecovery(
                f"consumer {consumer_id!r} is open by owner {consumer.owner!r}; a second live owner is "
                "refused: close it, or recover the coordinator once that owner is known to be stopped"
            )
        return {"op": "open_consumer", "consumer_id": consumer_id, "owner": owner, "token": token}

    def _apply_open_consumer(self, event: Event) -> str:
        old = self.consumers.get(event["consumer_id"])
        state = old.state if old is not None else None
        self.consumers[event["consumer_id"]] = Consumer(event["owner"], event["token"], True, state)
        return str(event["token"])

    def consumer(self, consumer_id: str, token: str) -> Consumer:
        consumer = self.consumers.get(consumer_id)
        if consumer is None:
            raise KeyError(f"unknown consumer {consumer_id!r}; open_consumer first")
        if not consumer.open or consumer.token != token:
            raise StaleAttempt(f"token of consumer {consumer_id!r} is not current; reopen the consumer")
        return consumer

    def check_close_consumer(self, consumer_id: str, token: str) -> Event:
        self.consumer(consumer_id, token)
        return {"op": "close_consumer", "consumer_id": consumer_id}

    def _apply_close_consumer(self, event: Event) -> bool:
        self.consumers[event["consumer_id"]].open = False
        return True

    def check_save_consumer(
        self,
        consumer_id: str,
        token: str,
        request_id: str,
        state: dict[str, Any],
        acked: Acked | None = None,
        verified: frozenset[int] = frozenset(),
    ) -> Event | Answer:
        """``acked``: what the new state acknowledges, for the training consumer; ``verified``:
        released positions the caller checked are still readable and owns again (a rewind)."""
        fingerprint = digest(["consumer", consumer_id, state])
        seen, reply = self._request(request_id, fingerprint)
        if seen:
            return Answer(reply[1])
        self.consumer(consumer_id, token)
        _check_cursors(state, len(self.commits))
        event: Event = {
            "op": "save_consumer",
            "request_id": request_id,
            "fingerprint": fingerprint,
            "consumer_id": consumer_id,
            "state": state,
        }
        self._rewind_into(event, acked, verified)
        return event

    def _rewind_into(self, event: Event, acked: Acked | None, verified: frozenset[int]) -> None:
        """A rewind takes released history back: the event carries the new released set."""
        if acked is None:
            return
        back = self.reowned_by(acked)
        missing = [p for p in back if p not in verified]
        if missing:
            raise StorageUnavailable(
                f"accepted position {missing[0]} was released while this call checked the history; retry"
            )
        if back:
            cursor, positions = self.released_after(acked)
            event["released"] = [cursor, sorted(positions)]

    def _apply_save_consumer(self, event: Event) -> Any:
        self.consumers[event["consumer_id"]].state = event["state"]
        self._apply_released(event)
        return self._remember(event, event["state"])

    def _apply_released(self, event: Event) -> None:
        released = event.get("released")
        if released is not None:
            self.released_cursor, self.released_positions = int(released[0]), frozenset(released[1])

    # -- released history ----------------------------------------------------------------

    def has_released(self) -> bool:
        return bool(self.released_cursor or self.released_positions)

    def is_released(self, position: int) -> bool:
        return position < self.released_cursor or position in self.released_positions

    def first_released(self, start: int, stop: int) -> int | None:
        """The first released position in ``start..stop-1``, if any."""
        if start >= stop:
            return None
        if start < self.released_cursor:
            return start
        inside = [p for p in self.released_positions if start <= p < stop]
        return min(inside) if inside else None

    def released_after(self, acked: Acked) -> tuple[int, frozenset[int]]:
        """The released set once the training consumer acknowledges only ``acked``: what was
        released and is still acknowledged (an intersection; it never grows here)."""
        c_r, p_r = self.released_cursor, self.released_positions
        c_a, p_a = acked
        if c_r <= c_a:
            return c_r, frozenset(p for p in p_r if p < c_a or p in p_a)
        return c_a, frozenset(p for p in p_a if p < c_r or p in p_r)

    def reowned_by(self, acked: Acked) -> list[int]:
        """Released positions that ``acked`` no longer acknowledges (a rewind takes them back)."""
        c_r, p_r = self.released_cursor, self.released_positions
        c_a, p_a = acked
        back = {p for p in p_r if p >= c_a and p not in p_a}
        back.update(p for p in range(c_a, c_r) if p not in p_a)
        return sorted(back)

    def check_release_history(self, acked: Acked) -> Event | None:
        """``collect_garbage`` stops owning what the training consumer acknowledged."""
        cursor, positions = acked
        positions = frozenset(p for p in positions if p >= cursor)
        if (cursor, positions) == (self.released_cursor, self.released_positions):
            return None
        return {"op": "release_history", "released": [cursor, sorted(positions)]}

    def _apply_release_history(self, event: Event) -> None:
        self._apply_released(event)

    def check_plan_batch(self, consumer_id: str, token: str, batch: dict[str, Any]) -> Event | Answer:
        self.consumer(consumer_id, token)
        existing = self.batches.get(batch["batch_id"])
        if existing is not None:
            if {k: existing[k] for k in batch} != batch:
                raise IdempotencyConflict(f"batch {batch['batch_id']!r} was already planned differently")
            return Answer(existing)
        positions = batch["input_positions"]
        if any(
            not isinstance(p, int) or isinstance(p, bool) or not 0 <= p < len(self.commits) for p in positions
        ):
            raise ValueError(f"input_positions must name accepted results (0..{len(self.commits) - 1})")
        return {"op": "plan_batch", "batch": batch}

    def _apply_plan_batch(self, event: Event) -> dict[str, Any]:
        batch = dict(event["batch"], ready=False)
        self.batches[batch["batch_id"]] = batch
        return batch

    def check_batch_ready(
        self,
        consumer_id: str,
        token: str,
        batch_id: str,
        ready_ref: dict[str, Any],
        state: dict[str, Any],
        acked: Acked | None = None,
        verified: frozenset[int] = frozenset(),
    ) -> Event | Answer:
        consumer = self.consumer(consumer_id, token)
        batch = self.batches.get(batch_id)
        if batch is None:
            raise KeyError(f"unknown batch {batch_id!r}; plan_batch first")
        if batch["consumer_id"] != consumer_id:
            raise InvalidReference(f"batch {batch_id!r} belongs to consumer {batch['consumer_id']!r}")
        if batch["ready"]:
            if batch["ready_ref"] != ready_ref:
                raise IdempotencyConflict(f"batch {batch_id!r} is already ready with another result")
            return Answer({"batch_id": batch_id, "ready_ref": batch["ready_ref"], "state": consumer.state})
        _check_cursors(state, len(self.commits))
        event: Event = {
            "op": "batch_ready",
            "consumer_id": consumer_id,
            "batch_id": batch_id,
            "ready_ref": ready_ref,
            "state": state,
        }
        self._rewind_into(event, acked, verified)
        return event

    def _apply_batch_ready(self, event: Event) -> dict[str, Any]:
        batch = self.batches[event["batch_id"]]
        batch["ready"] = True
        batch["ready_ref"] = event["ready_ref"]
        self.consumers[event["consumer_id"]].state = event["state"]
        self._apply_released(event)
        return {"batch_id": event["batch_id"], "ready_ref": event["ready_ref"], "state": event["state"]}

    def _apply_register_checkpoint(self, event: Event) -> dict[str, Any]:
        entry = {"checkpoint_id": event["checkpoint_id"], "checkpoint_ref": event["checkpoint_ref"]}
        if event.get("batch_ids"):
            entry["batch_ids"] = list(event["batch_ids"])  # what it trained on (accounting only)
        self.checkpoints[event["checkpoint_id"]] = entry
        return entry

    def _apply_release_checkpoint(self, event: Event) -> bool:
        return self.checkpoints.pop(event["checkpoint_id"], None) is not None

    # ------------------------------------------------------------------ dispatch

    def apply(self, event: Event) -> Any:
        """Perform one event (live or replayed). Unknown ops are a bug or a newer journal."""
        handler = _APPLY.get(event.get("op", ""))
        invariant(handler is not None, f"event op {event.get('op')!r} is known")
        reply = handler(self, event)  # type: ignore[misc]
        reach = event.get("reach")
        if reach:
            self.ref_packs.update(reach)
        return reply

    # ------------------------------------------------------------------ GC roots

    def roots(
        self, acknowledged: Callable[[int], bool], finished: frozenset[str] | set[str]
    ) -> tuple[list[dict[str, Any]], set[str]]:
        """What the queue still needs (docs/GC.md "Queue roots"): references to resolve, as
        dicts, and packs already known (those of accepted results, recorded when accepted).

        ``acknowledged(position)`` says whether the training consumer processed
        that accepted result; ``finished`` names batches it finished.
        """
        refs: list[dict[str, Any]] = []
        packs: set[str] = set()
        for task in self.tasks.values():
            if task.state in (PENDING, LEASED) and task.spec.input_ref is not None:
                refs.append(as_dict(task.spec.input_ref))
        for inputs in self.read_inputs.values():
            refs += inputs
        self._history_roots(acknowledged, refs, packs)
        for position, known in enumerate(self.commit_packs, self.commits.base):
            if not acknowledged(position):
                if known:
                    packs.update(known)
                else:
                    refs.append(self.commits[position]["result_ref"])
        for consumer in self.consumers.values():
            if consumer.state is not None:
                refs += [consumer.state[k] for k in ("state_ref", "progress_ref") if k in consumer.state]
        for batch_id, batch in self.batches.items():
            if batch_id not in finished:
                refs += [batch[k] for k in ("plan_ref", "ready_ref") if batch.get(k) is not None]
        refs += [entry["checkpoint_ref"] for entry in self.checkpoints.values()]
        return refs, packs

    def _history_roots(
        self, acknowledged: Callable[[int], bool], refs: list[dict[str, Any]], packs: set[str]
    ) -> None:
        """Roots among receipts on disk: a pack is needed while any position reaching it is not
        acknowledged (each file lists its packs with their positions, read once per collection)."""
        for file in self.history.files:
            if all(acknowledged(p) for p in range(file.first, file.stop)):
                continue  # every result of this file processed (or it holds none): no read
            meta = file.meta()
            for pack, positions in meta["packs"].items():
                if pack not in packs and not all(acknowledged(p) for p in positions):
                    packs.add(pack)
            refs.extend(self.commits[p]["result_ref"] for p in meta["unknown"] if not acknowledged(p))

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

    def usage(self, acknowledged: Callable[[int], bool], finished: frozenset[str]) -> dict[str, Any]:
        """Accounting of the peer's ``_usage`` (diagnostic; nothing is refused by it): accepted
        results not yet processed, plus the estimates of leased production tasks; ready batches."""
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
            positions = range(file.first, file.stop)
            if positions and not any(acknowledged(p) for p in positions):
                add(*file.meta()["totals"])  # the usual case: nothing of the file processed
            else:
                add_results(p for p in positions if not acknowledged(p))
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
        ready = {"records": 0, "bytes": 0, "tokens": 0}
        trained = set(finished)
        for entry in self.checkpoints.values():
            trained.update(entry.get("batch_ids", ()))
        for batch_id, batch in self.batches.items():
            ref = batch.get("ready_ref")
            if batch.get("ready") and ref is not None and batch_id not in trained:
                ready["records"] += ref["records"]
                ready["bytes"] += ref["payload_bytes"]
                ready["tokens"] += ref["tokens"]
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


def journal_body(event: Event) -> bytes:
    """The bytes journaled for an event: canonical JSON without its live-only ``_`` keys."""
    return encode({k: v for k, v in event.items() if not k.startswith("_")})


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
    tasks = [
        [
            row,
            t.request_id,
            t.state,
            t.order,
            t.generation,
            t.failures,
            t.failure,
            _lease_row(t.lease, state, t.spec.task_id) if t.lease is not None else None,
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
            0 if packs == [state.commits.result_path(position)] else packs
            for position, packs in enumerate(state.commit_packs, state.commits.base)
        ],
        "producers": state.producers,
        "reads": [[as_dict(lease), state.read_inputs.get(key, [])] for key, lease in state.reads.items()],
        "consumers": {k: [c.owner, c.token, c.open, c.state] for k, c in state.consumers.items()},
        "batches": state.batches,
        "checkpoints": state.checkpoints,
        "released": [state.released_cursor, sorted(state.released_positions)],
        "ref_packs": state.ref_packs,
        "history": state.history.describe(),
    }


def task_row(task: Task, state: QueueState) -> list[Any]:
    """A task as a history file row: its id first, then what ``state_to_dict`` keeps of it."""
    refs, rows = _compact_specs([task.spec])
    lease = _lease_row(task.lease, state, task.spec.task_id) if task.lease is not None else None
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
        Lease(state.run_id, state.queue_id, task_id, *lease) if lease is not None else None,
        deadline,
    )


def _lease_row(lease: Lease, state: QueueState, task_id: str) -> list[Any]:
    """A task's lease as the values its task and queue do not already give (snapshots only)."""
    invariant(
        (lease.run_id, lease.queue_id, lease.task_id) == (state.run_id, state.queue_id, task_id),
        "a task's lease was minted by its own queue",
    )
    return [lease.attempt_id, lease.generation, lease.coordinator_epoch, lease.token, lease.worker_id]


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
    collecting = gc.isenabled()
    gc.disable()
    try:
        state = _state_from_dict(data, limits)
        for file in files:
            state.attach(file)
        for status, count in state.history.counts().items():
            state.counts[status] += count
        invariant(state.history.base == state.commits.base, "history files hold the receipts below base")
        return state
    except (KeyError, IndexError, TypeError, ValueError) as error:
        # The frame's checksum held, so only a writer bug produces this; never guess past it.
        raise CorruptData(f"queue snapshot is malformed ({type(error).__name__}: {error})") from None
    finally:
        if collecting:
            gc.enable()


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
            Lease(state.run_id, state.queue_id, spec.task_id, *lease) if lease is not None else None,
            deadline,
        )
        state.tasks[spec.task_id] = task
        state.counts[status] += 1
        if status in (PENDING, LEASED):
            state.unfinished.add(spec.task_id)
        if status == PENDING:
            key = pending_key(spec.priority, spec.scheduling_key, order, spec.task_id)
            (control if spec.control else pending).append(key)
        elif status == LEASED and task.lease is not None:
            heapq.heappush(state.expiry, (deadline, spec.task_id, task.lease.attempt_id))
    state.pending.add_many(pending)
    state.control.add_many(control)
    state.requests = {k: (v[0], v[1]) for k, v in data["requests"].items()}
    state.commits = CommitLog.unpack(data["commits"], state.run_id)
    state.commit_workers = list(data["commit_workers"])
    state.commit_packs = [
        [state.commits.result_path(position)] if packs == 0 else list(packs)
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
    state.consumers = {k: Consumer(v[0], v[1], v[2], v[3]) for k, v in data["consumers"].items()}
    state.batches = dict(data["batches"])
    state.checkpoints = dict(data["checkpoints"])
    state.ref_packs = dict(data.get("ref_packs", {}))  # absent in older snapshots: roots are read
    released = data.get("released", [0, []])  # absent in snapshots written before released history
    state.released_cursor, state.released_positions = int(released[0]), frozenset(released[1])
    return state


_APPLY: dict[str, Callable[[QueueState, Event], Any]] = {
    "submit": QueueState._apply_submit,
    "acquire": QueueState._apply_acquire,
    "complete": QueueState._apply_complete,
    "complete_many": QueueState._apply_complete_many,
    "fail": QueueState._apply_fail,
    "release": QueueState._apply_release,
    "yield": QueueState._apply_yield,
    "progress": QueueState._apply_progress,
    "cancel": QueueState._apply_cancel,
    "seal": QueueState._apply_seal,
    "drain": QueueState._apply_drain,
    "retire": QueueState._apply_retire,
    "release_reads": QueueState._apply_release_reads,
    "epoch": QueueState._apply_epoch,
    "open_consumer": QueueState._apply_open_consumer,
    "close_consumer": QueueState._apply_close_consumer,
    "save_consumer": QueueState._apply_save_consumer,
    "plan_batch": QueueState._apply_plan_batch,
    "batch_ready": QueueState._apply_batch_ready,
    "register_checkpoint": QueueState._apply_register_checkpoint,
    "release_checkpoint": QueueState._apply_release_checkpoint,
    "release_history": QueueState._apply_release_history,
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


def _check_name(value: object, what: str) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{what} must be a non-empty string, got {value!r}")


def _check_cursors(state: Mapping[str, Any], commits: int) -> None:
    """Cursors name accepted positions; either may move back (a checkpoint restored)."""
    fetch, processed = state["fetch_cursor"], state["processed_cursor"]
    for name, value in (("fetch_cursor", fetch), ("processed_cursor", processed)):
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= commits:
            raise ValueError(f"{name} must be an integer in 0..{commits} (accepted results), got {value!r}")
    if processed > fetch:
        raise ValueError(f"processed_cursor {processed} is ahead of fetch_cursor {fetch}")
