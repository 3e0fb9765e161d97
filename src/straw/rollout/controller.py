"""The job-owned queue authority: ``QueueController`` (ROLLOUT.md section 10).

One controller per job owns the job's ``Coordinator``, the only dataset producer, the training
view, the save-directory lock and the online GC thread. Readers load their inputs from the pool
themselves; every method here takes and returns small JSON-able or picklable values, so a
controller can be proxied to other processes (:class:`ControllerClient` lists what readers,
runners and the batch builder call).

Three locks order the work: the *producer lock* serialises refills, returns and retirements
(everything that creates prompt tasks or decides which results a reader still owes), the
*training lock* serialises the training view (batches, dispositions), and the snapshot takes
both, producer first. The Coordinator itself is thread safe; every queue transaction is durable
before its call returns (docs/DURABILITY.md J1-J5).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import secrets
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol

from ..coordinator import Coordinator, queue_directory
from ..errors import CorruptData, InvalidReference, StaleAttempt, UnsafeRecovery, invariant
from ..protocol import (
    AcquireResult,
    CommitReceipt,
    Lease,
    Record,
    RecordSetRef,
    TaskSpec,
    as_dict,
    digest,
    encode,
)
from ..reporting import FileLock, try_lock
from . import checkpoint
from ._arguments import (
    _category,
    _count,
    _failure,
    _int,
    _items,
    _lease,
    _leases,
    _manifest,
    _metadata,
    _positions,
    _reason,
    _text,
    _update,
    _update_fields,
)
from ._view import TrainingView, check_positions
from .checkpoint import RestorePlan, resolve_checkpoint, rollout_dir, state_token, write_job
from .config import RolloutConfig, resolve_pool
from .dataset import Dataset, DatasetCursor, JsonlDataset, PromptProducer
from .pool import rollout_store, seal_rollout_store, settled
from .refs import RELEASE_CHUNK, DiskPayloadRef, release_publications
from .sample import NO_VERSION_KEY

__all__ = ["EXCLUSIVE_OWNER", "MANAGER", "ControllerClient", "QueueController"]

log = logging.getLogger("straw.rollout.controller")

#: The Coordinator's ``exclusive_owner`` for every incarnation of every job (recovery compares it).
EXCLUSIVE_OWNER = "straw.rollout job controller"
#: The worker id that holds control tasks (collections and batches).
MANAGER = "manager"
TRAINING = "training"
PRODUCER = "dataset"
PROMPT = "prompt:"
READER_CONSUMER = "reader:"
RETIRED = "Reader was retired by the scheduler"
GC_FAILED = "Straw online GC failed; queue work has stopped"
CLOSED = "Queue controller is closed"
CONVERSION_STARTED = (
    "Queue-only recovery is limited to an interrupted first rollout; restore matching model/optimizer "
    "and rollout checkpoints after batch conversion begins"
)
#: A reader takes at most this many groups per call; a page of the accepted log is this long.
COMMIT_PAGE = 1024
FaultHook = Callable[[str], None]


class ControllerClient(Protocol):
    """What readers, runners and the batch builder call on a job's controller (in process or proxied)."""

    def identity(self) -> dict[str, Any]: ...
    def configuration(self) -> dict[str, Any]: ...
    def take(self, reader_id: str, count: int) -> AcquireResult: ...
    def heartbeat(self, leases: Sequence[Lease]) -> list[str]: ...
    def complete(self, lease: Lease, result_ref: RecordSetRef) -> CommitReceipt: ...
    def result(self, lease: Lease) -> CommitReceipt | None: ...
    def results(self, leases: Sequence[Lease]) -> list[CommitReceipt | None]: ...
    def release(self, leases: Sequence[Lease]) -> list[str]: ...
    def fail(self, lease: Lease, reason: str) -> str: ...
    def reject(self, lease: Lease, reason: str) -> str: ...
    def status(self, task_id: str) -> dict[str, Any] | None: ...
    def pending_count(self) -> int: ...
    def return_groups(
        self, updates: Sequence[Mapping[str, Any]], deliveries: Sequence[Mapping[str, Any]]
    ) -> dict[str, Any]: ...
    def retire_reader(self, reader_id: str, delivered: Iterable[int] = ()) -> list[CommitReceipt]: ...
    def retire_readers(self, prefix: str, delivered: Iterable[int] = ()) -> list[CommitReceipt]: ...
    def recover_pending_rollout(self) -> list[CommitReceipt]: ...
    def begin_collection(self, request: str) -> Lease: ...
    def accepted(self, receipt: CommitReceipt) -> CommitReceipt: ...
    def batch(self, batch_id: str) -> dict[str, Any] | None: ...
    def plan_batch(self, batch_id: str, positions: Sequence[int], plan_ref: Any) -> dict[str, Any]: ...
    def ready_batch(self, batch_id: str, ready_ref: Any) -> CommitReceipt: ...
    def finish_batch(self, batch_id: str) -> None: ...
    def record_dispositions(
        self, positions: Sequence[int], reason: str, *, detail: Any = None
    ) -> RecordSetRef | None: ...
    def training_state(self) -> dict[str, Any] | None: ...
    def metrics(self) -> dict[str, Any]: ...
    def checkpoint_snapshot(
        self, step: int, *, consumers: Mapping[str, Any] | None = None
    ) -> RecordSetRef: ...
    def reader_metadata(
        self, reader_id: str, metadata: Mapping[str, Any] | None = None
    ) -> dict[str, Any]: ...
    def close(self) -> None: ...


def _sources_of(metadata: Mapping[str, Any] | None) -> set[int]:
    """The accepted positions a task carries (its metadata's ``source_positions``)."""
    return {int(p) for p in (metadata or {}).get("source_positions") or ()}


def task_id_for(group_index: int, timeline: int) -> str:
    """The task id of fresh prompt group ``group_index`` on a timeline (section 10.1)."""
    return f"{PROMPT}{group_index}" if timeline == 0 else f"{PROMPT}{group_index}:t{timeline}"


@dataclasses.dataclass
class _Training:
    """The training state this controller keeps in memory and saves with every change."""

    view: TrainingView = dataclasses.field(default_factory=TrainingView)
    batches: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    conversion_started: bool = False
    disposition: DiskPayloadRef | None = None
    rollback: dict[str, Any] | None = None

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "version": 1,
            "processed_cursor": self.view.processed_cursor,
            "fetch_cursor": self.view.fetch_cursor,
            "processed_positions": self.view.positions(),
            "batches": [dict(self.batches[b], batch_id=b) for b in sorted(self.batches)],
        }
        if self.conversion_started:
            body["conversion_started"] = True
        if self.disposition is not None:
            body["disposition"] = self.disposition
        if self.rollback is not None:
            body["rollback"] = self.rollback
        return body

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> _Training:
        if not isinstance(body, Mapping) or body.get("version") != 1:
            raise CorruptData("the training state is not a version 1 training view")
        batches = {
            str(b["batch_id"]): {k: v for k, v in b.items() if k != "batch_id"} for b in body["batches"]
        }
        return cls(
            TrainingView.from_state(body),
            batches,
            bool(body.get("conversion_started")),
            body.get("disposition"),
            body.get("rollback"),
        )


# --------------------------------------------------------------------------- the controller


class QueueController:
    """The job's queue authority (ROLLOUT.md section 10); one per job, in one process.

    ``dataset`` is a Dataset or a zero-argument factory of one (None: ``--prompt-data``);
    ``restore_plan`` comes from :func:`~straw.rollout.checkpoint.resolve_checkpoint` (None:
    resolved here). ``clock`` drives the queue's leases. ``fault(phase)`` is a test hook run
    before the named phases (``lock``, ``job-files``, ``coordinator``, ``gc``, and the steps of
    refill, return, complete, plan and ready listed in docs/ROLLOUT.md); what it raises leaves
    the state a crash there would.
    """

    def __init__(
        self,
        config: RolloutConfig,
        *,
        dataset: Dataset | Callable[[], Dataset] | None = None,
        restore_plan: RestorePlan | None = None,
        clock: Callable[[], float] = time.monotonic,
        fault: FaultHook | None = None,
        start_gc: bool = True,
    ) -> None:
        if not isinstance(config, RolloutConfig):
            raise TypeError(f"QueueController takes a RolloutConfig, got {type(config).__name__}")
        if restore_plan is None:
            config, restore_plan = resolve_checkpoint(config)
        elif not isinstance(restore_plan, RestorePlan):
            raise TypeError(f"restore_plan must be a RestorePlan, got {type(restore_plan).__name__}")
        elif not config.rollout_data_dir:
            config = resolve_pool(config)
        self.incarnation = secrets.token_hex(8)
        self.config = config
        self.plan = restore_plan
        self._dataset_source = dataset
        self._producer: PromptProducer | None = None
        self._clock = clock
        self._fault_hook = fault
        self._start_gc = bool(start_gc)
        self._save_lock: FileLock | None = None
        self._coordinator: Coordinator | None = None
        self._closed = False
        self._producer_lock = threading.RLock()
        self._training_lock = threading.RLock()
        self._state_lock = threading.Lock()  # the small in-memory sets below
        self._gc_lock = threading.Lock()
        self._gc_error: BaseException | None = None
        self._gc_runs = 0
        self._gc_last: dict[str, Any] | None = None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._retired: set[str] = set()
        self._active: set[str] = set()
        self._superseded: set[int] = set()
        self._failed_count: tuple[int, int] | None = None  # (failed tasks, failed groups): metrics
        self._manager_leases: dict[str, Lease] = {}
        self._reader_tokens: dict[str, str] = {}
        self._training = _Training()
        self._training_token = ""
        self._recovered = False
        self._rolls_back = False
        self._planned = False
        try:
            self._start()
        except BaseException:
            self._undo()
            raise

    # ------------------------------------------------------------------ startup

    def _fault(self, phase: str) -> None:
        if self._fault_hook is not None:
            self._fault_hook(phase)

    def _start(self) -> None:
        """Constructor steps 1-8 (ROLLOUT.md section 10.2); ``_undo`` reverts a failure."""
        config = self.config
        template = config.load_debug_rollout_data
        replay = template is not None and template.endswith(".straw.json")
        if replay and not self.plan.queue_id.startswith("debug:"):  # 1: a replay gets its own queue
            self.plan = RestorePlan("new", queue_id="debug:" + secrets.token_hex(16))
        if config.save:  # 2: the save-directory lock, then the selection must be unchanged
            self._fault("lock")
            self._lock_save_dir(config.save)
        self._fault("job-files")  # 3: the store and the job files
        self._bound = rollout_store(config)
        self._root = str(self._bound.store.backend.root)
        mode = self.plan.mode
        # A legacy model-only directory restores as "empty" without a queue to roll back: it
        # starts like a new job on the plan's cursor (section 14.7, last paragraph).
        self._rolls_back = mode == "rollback" or (mode == "empty" and self._has_job())
        if self._rolls_back:
            checkpoint.begin_rollback(self, self.plan)
        elif config.save and not replay and (mode in ("new", "empty") or not self._has_job()):
            write_job(config, dataclasses.replace(self.plan, save=config.save))
        self._fault("coordinator")  # 4
        self._open_queue()
        self._mode_work()  # 5 and 6
        queue = self._usable()
        self._training_token = queue.open_consumer(TRAINING, exclusive_owner=EXCLUSIVE_OWNER)  # 7
        self._fault("gc")  # 8
        self._start_threads()

    def _lock_save_dir(self, save: str) -> None:
        directory = rollout_dir(save)
        directory.mkdir(parents=True, exist_ok=True)
        held = try_lock(directory / "session.lock")
        if held is None:
            raise RuntimeError(f"Another training job owns save directory {save}")
        self._save_lock = held
        if self.plan.state_token is not None and state_token(save) != self.plan.state_token:
            raise RuntimeError(
                f"Checkpoint selection for {save} changed during startup; restart to resolve it again"
            )

    def _has_job(self) -> bool:
        return self.config.save is not None and checkpoint.read_job(self.config.save) is not None

    def _open_queue(self) -> None:
        store = self._bound.store
        exists = os.path.isdir(queue_directory(self._root, self.plan.queue_id, True))
        try:
            self._coordinator = Coordinator(
                store,
                queue_id=self.plan.queue_id,
                namespace=True,
                exclusive_owner=EXCLUSIVE_OWNER,
                recover=exists,
                lease_seconds=self.config.rollout_queue_lease_seconds,
                clock=self._clock,
            )
        except (CorruptData, UnsafeRecovery) as error:
            raise type(error)(f"{error}; inspect the pool with `straw check {self._root}`") from error

    def _mode_work(self) -> None:
        """Steps 5 and 6: the restore mode's work, then cancelling older collections.

        A resume is refused before it changes anything (beyond the new epoch of opening).
        """
        queue = self._usable()
        if self._rolls_back:
            checkpoint.finish_rollback(self, self.plan)
        self._training = self._load_training(queue)
        stale = self._scan_tasks(queue)
        if self.plan.mode == "resume" and (self._planned or self._training.conversion_started):
            raise RuntimeError(CONVERSION_STARTED)
        if queue.producer_state(PRODUCER) is None:  # a new queue (or one never initialised)
            cursor = self.plan.cursor if self.plan.cursor is not None else DatasetCursor().asdict()
            state = {"version": 1, "timeline": 0, "cursor": DatasetCursor.from_dict(cursor).asdict()}
            queue.submit_tasks("dataset:init", [], producer_id=PRODUCER, producer_state=state)
        if self.plan.mode == "resume":
            reads = list(queue.outstanding_reads())
            for start in range(0, len(reads), RELEASE_CHUNK):
                queue.release_task_reads(reads[start : start + RELEASE_CHUNK])
        for task_id in stale:
            queue.cancel_task(task_id, request_id=f"abandon:{self.incarnation}:{task_id}")

    def _scan_tasks(self, queue: Coordinator) -> list[str]:
        """Index superseded positions and planned batches; the older collections still pending.

        Every task a later call needs to know about is created by this controller, so one
        scan at startup plus incremental updates keep the indexes exact.
        """
        mine = f"collection:{self.incarnation}:"
        stale = []
        for task_id, status in queue.tasks.items():
            metadata = status["spec"].get("metadata") or {}
            self._superseded.update(_sources_of(metadata))
            self._planned = self._planned or task_id.startswith("batch:")
            if (
                task_id.startswith("collection:")
                and not task_id.startswith(mine)
                and status["state"] in ("pending", "leased")
            ):
                stale.append(task_id)
        return stale

    def _start_threads(self) -> None:
        targets: list[tuple[str, Callable[[], None]]] = [("keeper", self._keep_manager_leases)]
        if self._start_gc and self.config.rollout_queue_online_gc:
            targets.append(("gc", self._gc_loop))
        for name, target in targets:
            thread = threading.Thread(target=target, name=f"straw-rollout-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def _undo(self) -> None:
        """Revert a failed start: threads stopped, Coordinator closed, lock released.

        The caller keeps the exception (and its traceback, which holds this object), so
        nothing here may wait for the object to be collected.
        """
        self._closed = True
        self._stop.set()
        for thread in self._threads:
            thread.join()
        try:
            if self._coordinator is not None:
                with contextlib.suppress(Exception):  # the start's error is the one to report
                    self._coordinator.close()
        finally:
            if self._save_lock is not None:
                self._save_lock.release()

    # ------------------------------------------------------------------ state checks

    def _usable(self) -> Coordinator:
        if self._gc_error is not None:
            raise RuntimeError(GC_FAILED) from self._gc_error
        if self._closed or self._coordinator is None:
            raise RuntimeError(CLOSED)
        return self._coordinator

    @property
    def queue(self) -> Coordinator:
        """The job's Coordinator (read task states, producer state and commits from it)."""
        return self._usable()

    def identity(self) -> dict[str, Any]:
        self._usable()
        return {
            "run_id": self.config.run_id,
            "queue_id": self.plan.queue_id,
            "incarnation": self.incarnation,
            "timeline": self._timeline(),
            "mode": self.plan.mode,
        }

    def configuration(self) -> dict[str, Any]:
        """The data source's identity a restore compares (section 10.2)."""
        self._usable()
        return self.data_configuration()

    def data_configuration(self) -> dict[str, Any]:
        """``configuration()`` without the queue: a rollback checks it before the queue opens."""
        producer = self._prompt_producer()
        dataset = producer.dataset
        named = getattr(dataset, "identity", None)
        identity = named() if callable(named) else {}
        return {
            "dataset_size": len(dataset),
            "n_samples_per_prompt": self.config.n_samples_per_prompt,
            "seed": self.config.rollout_seed,
            "shuffle": bool(self.config.rollout_shuffle),
            "run_id": self.config.run_id,
            "queue_id": self.plan.queue_id,
            "dataset": identity,
        }

    def _timeline(self) -> int:
        state = self._usable().producer_state(PRODUCER)
        return int(state["timeline"]) if isinstance(state, Mapping) else 0

    def _prompt_producer(self) -> PromptProducer:
        with self._producer_lock:
            if self._producer is None:
                source = self._dataset_source
                if source is None:
                    dataset: Dataset = JsonlDataset.from_config(self.config)
                elif isinstance(source, Dataset):
                    dataset = source
                elif callable(source):
                    dataset = source()
                else:
                    raise TypeError(f"dataset must be a Dataset or a factory, got {type(source).__name__}")
                self._producer = PromptProducer(
                    dataset,
                    n_samples_per_prompt=self.config.n_samples_per_prompt,
                    shuffle=self.config.rollout_shuffle,
                    seed=self.config.rollout_seed,
                )
            return self._producer

    # ------------------------------------------------------------------ taking work

    def take(self, reader_id: str, count: int) -> AcquireResult:
        """Lease up to ``count`` prompt groups to ``reader_id``, refilling from the dataset when empty."""
        reader = _text(reader_id, "reader_id")
        if reader == MANAGER:
            raise ValueError(f"Reader ID {MANAGER!r} is reserved for control tasks")
        wanted = _count(count, "count")
        queue = self._usable()
        with self._state_lock:
            if reader in self._retired:
                raise StaleAttempt(RETIRED)
            self._active.add(reader)
        found = queue.acquire(reader, wanted, task_prefix=PROMPT)
        if found.status != "empty":
            return found
        with self._producer_lock:
            found = queue.acquire(reader, wanted, task_prefix=PROMPT)  # another reader may have refilled
            if found.status != "empty":
                return found
            self._refill(queue, wanted)
        return queue.acquire(reader, wanted, task_prefix=PROMPT)

    def _refill(self, queue: Coordinator, wanted: int) -> None:
        """Section 10.4 step 4: publish the next groups, then submit them with the new cursor.

        The draw starts from the *committed* cursor, so a crash (or a failure) anywhere before
        ``submit_tasks`` leaves only unreferenced publications and the retry draws the same
        groups again: nothing skipped, nothing issued twice (G1).
        """
        state = queue.producer_state(PRODUCER)
        if not isinstance(state, Mapping) or state.get("version") != 1:
            raise CorruptData(f"the dataset producer state of queue {self.plan.queue_id!r} is {state!r}")
        timeline = int(state["timeline"])
        config = self.config
        count = min(max(wanted, config.refill_min_groups), config.refill_max_groups)
        groups, after = self._prompt_producer().draw(count, DatasetCursor.from_dict(state["cursor"]))
        ids = [task_id_for(int(group[0].group_index), timeline) for group in groups]  # type: ignore[arg-type]
        self._fault("refill:publish")
        # The ids name the queue and the draw's size as well as the task: the same draw
        # retried on this writer returns the same publications, while another queue of the
        # pool, or a retry drawing another number of groups, never reuses an id.
        names = [f"input:{self.plan.queue_id}:{count}:{t}" for t in ids]
        with self._bound.lock:
            refs = settled(lambda: self._bound.codec.publish_many(groups, submission_ids=names))
        tasks = [
            TaskSpec(
                task_id,
                ref,
                metadata={"group_index": group[0].group_index, "prompt": as_dict(ref), "stage": "fresh"},
                estimated_tokens=ref.tokens,
                max_attempts=config.task_max_attempts,
                scheduling_key=NO_VERSION_KEY,
            )
            for task_id, ref, group in zip(ids, refs, groups, strict=True)
        ]
        self._fault("refill:submit")
        queue.submit_tasks(
            f"dataset:{timeline}:{groups[0][0].group_index}",
            tasks,
            producer_id=PRODUCER,
            producer_state={"version": 1, "timeline": timeline, "cursor": after.asdict()},
        )
        self._fault("refill:release")
        release_publications(config, refs)  # the queue's tasks hold the inputs now

    # ------------------------------------------------------------------ leases and results

    def heartbeat(self, leases: Sequence[Lease]) -> list[str]:
        """Extend leases: ``extended``, ``StaleAttempt`` or ``LeaseExpired`` for each."""
        items = _leases(leases)
        return self._usable().heartbeat(items)

    def complete(self, lease: Lease, result_ref: RecordSetRef) -> CommitReceipt:
        """Accept a leased group's result; a retry after a lost reply returns the same receipt."""
        held = _lease(lease)
        ref = _manifest(result_ref, "result_ref")
        queue = self._usable()
        submission = f"result:{held.attempt_id}"
        with self._state_lock:
            retired = held.worker_id in self._retired
        if retired and queue.lookup_submission(submission) is None:
            raise StaleAttempt(RETIRED)
        self._fault("complete")
        return queue.complete_task(held, submission_id=submission, result_ref=ref, result_digest=ref.digest)

    def result(self, lease: Lease) -> CommitReceipt | None:
        """The receipt that accepted this attempt's result, or None."""
        held = _lease(lease)
        return self._usable().lookup_submission(f"result:{held.attempt_id}")

    def results(self, leases: Sequence[Lease]) -> list[CommitReceipt | None]:
        items = _leases(leases)
        queue = self._usable()
        return [queue.lookup_submission(f"result:{lease.attempt_id}") for lease in items]

    def release(self, leases: Sequence[Lease]) -> list[str]:
        """Give leased tasks back with their inputs, no attempt spent (128 per transaction)."""
        items = _leases(leases)
        queue = self._usable()
        outcomes: list[str] = []
        for start in range(0, len(items), RELEASE_CHUNK):
            chunk = items[start : start + RELEASE_CHUNK]
            request = "release:" + digest([[lease.task_id, lease.attempt_id] for lease in chunk])
            outcomes += queue.release_tasks(chunk, request_id=request)
        return outcomes

    def fail(self, lease: Lease, reason: str) -> str:
        """The generator failed this attempt: the task retries, or fails when out of attempts."""
        held = _lease(lease)
        why = _reason(reason)
        state = self._usable().fail_task(
            held,
            request_id=f"fail:{held.attempt_id}",
            failure=_failure("GeneratorError", why),
            retryable=True,
        )
        if state == "failed":
            log.warning("Rollout task %s failed on its last attempt: %s", held.task_id, why)
        return state

    def reject(self, lease: Lease, reason: str) -> str:
        """Filter a leased group out for good; what its task replaced is dispositioned too."""
        held = _lease(lease)
        why = _reason(reason)
        queue = self._usable()
        status = queue.task_status(held.task_id)
        state = queue.fail_task(
            held, request_id=f"reject:{held.attempt_id}", failure=_failure("Filtered", why), retryable=False
        )
        metadata = (status or {}).get("spec", {}).get("metadata") or {}
        sources = list(metadata.get("source_positions") or ())
        if sources:
            self.record_dispositions(sources, why)
        return state

    def status(self, task_id: str) -> dict[str, Any] | None:
        return self._usable().task_status(_text(task_id, "task_id"))

    def pending_count(self) -> int:
        """Pending prompt tasks that readers returned (the buffer length a runner reports)."""
        pending = self._usable().pending_tasks(task_prefix=PROMPT)
        return sum(1 for spec in pending if spec.metadata.get("returned"))

    # ------------------------------------------------------------------ returning work

    def return_groups(
        self, updates: Sequence[Mapping[str, Any]], deliveries: Sequence[Mapping[str, Any]]
    ) -> dict[str, Any]:
        """Yield leased groups with their continuations; turn accepted groups into deliveries.

        Both halves are idempotent after a lost reply: the yield by its request id (a digest
        of the updates), each delivery by its task id (a digest of its fields). Updates whose
        lease is no longer current are left out and answered under ``stale``.
        """
        yields = [_update(item) for item in _items(updates, "updates")]
        specs = [self._delivery(item) for item in _items(deliveries, "deliveries")]
        if len({spec.task_id for spec in specs}) != len(specs):
            raise ValueError("return_groups got the same delivery twice")
        queue = self._usable()
        with self._producer_lock:
            outcomes: list[str] = []
            stale = self._stale(queue, yields)
            current = [item for item in yields if item["lease"].task_id not in stale]
            if current:
                request = "return:" + digest([_update_fields(item) for item in current])
                self._fault("return:yield")
                # One answer for the whole yield ("pending", as the peer); one entry per update here.
                outcomes = [queue.yield_tasks(current, request_id=request)] * len(current)
                self._note_superseded(item.get("metadata") for item in current)
            fresh, carried = self._uncarried(
                [spec for spec in specs if queue.task_status(spec.task_id) is None]
            )
            if carried:
                log.warning(
                    "Skipped %d returned accepted groups that another task already carries "
                    "(source positions %s); each accepted group is delivered once",
                    len(carried),
                    sorted({p for spec in carried for p in _sources_of(spec.metadata)}),
                )
            if fresh:
                self._fault("return:deliver")
                queue.submit_tasks("deliver:" + digest([spec.task_id for spec in fresh]), fresh)
                self._note_superseded(spec.metadata for spec in fresh)
            self._fault("return:done")
        return {
            "yielded": outcomes,
            "stale": sorted(stale),
            "delivered": [spec.task_id for spec in specs if spec not in carried],
            "carried": [spec.task_id for spec in carried],
        }

    def _uncarried(self, specs: list[TaskSpec]) -> tuple[list[TaskSpec], list[TaskSpec]]:
        """New deliveries split into those to submit and those all of whose accepted positions
        an earlier task (or an earlier one of ``specs``) already carries: the same accepted
        group returned twice, which a second delivery would have trained twice."""
        with self._state_lock:
            seen = set(self._superseded)
        fresh, carried = [], []
        for spec in specs:
            sources = _sources_of(spec.metadata)
            if sources and sources <= seen:
                carried.append(spec)
            else:
                fresh.append(spec)
                seen |= sources
        return fresh, carried

    def _stale(self, queue: Coordinator, yields: list[dict[str, Any]]) -> set[str]:
        """Tasks of updates whose lease is no longer current (the task moved on without it).

        A yield is all or nothing; one lease that expired and went to another reader must
        not keep a whole batch of partials from returning, so those updates are left out
        (their continuations are simply not adopted). A lease of another queue is an error.
        """
        for item in yields:
            lease = item["lease"]
            if (lease.run_id, lease.queue_id) != (self.config.run_id, self.plan.queue_id):
                where = f"run {lease.run_id!r} queue {lease.queue_id!r}"
                raise InvalidReference(f"lease of task {lease.task_id!r} belongs to {where}")
        leases = [item["lease"] for item in yields]
        outcomes = queue.heartbeat(leases) if leases else []
        return {
            lease.task_id
            for lease, outcome in zip(leases, outcomes, strict=True)
            if outcome == "StaleAttempt"
        }

    def _delivery(self, item: Mapping[str, Any]) -> TaskSpec:
        allowed = {"input_ref", "priority", "scheduling_key", "metadata", "estimated_tokens"}
        unknown = set(item) - allowed
        if unknown:
            raise ValueError(f"a delivery has unknown fields {sorted(unknown)}")
        ref = _manifest(item.get("input_ref"), "a delivery's input_ref")
        metadata = _metadata(item.get("metadata"))
        fields = {
            "input_ref": as_dict(ref),
            "priority": _int(item.get("priority", 0), "priority"),
            "scheduling_key": _int(item.get("scheduling_key", NO_VERSION_KEY), "scheduling_key"),
            "metadata": metadata,
            "estimated_tokens": _int(item.get("estimated_tokens", ref.tokens), "estimated_tokens"),
        }
        return TaskSpec(
            "prompt:delivery:" + digest(fields),
            ref,
            metadata=metadata,
            priority=fields["priority"],
            scheduling_key=fields["scheduling_key"],
            estimated_tokens=fields["estimated_tokens"],
            max_attempts=self.config.task_max_attempts,
        )

    def _note_superseded(self, metadatas: Iterable[Mapping[str, Any] | None]) -> None:
        with self._state_lock:
            for metadata in metadatas:
                self._superseded.update(_sources_of(metadata))

    # ------------------------------------------------------------------ retirement and recovery

    def retire_reader(self, reader_id: str, delivered: Iterable[int] = ()) -> list[CommitReceipt]:
        """Fence a lost reader; return its accepted results nobody has received or processed yet."""
        reader = _text(reader_id, "reader_id")
        if reader == MANAGER:
            raise ValueError(f"Reader ID {MANAGER!r} is reserved for control tasks")
        given = set(_positions(delivered, "delivered"))
        queue = self._usable()
        with self._producer_lock:
            with self._state_lock:
                self._retired.add(reader)
                self._active.discard(reader)
            receipts = [CommitReceipt.from_dict(r) for r in queue.retire_worker(reader)]
            with self._training_lock, self._state_lock:
                view = self._training.view
                return [
                    r
                    for r in receipts
                    if r.position not in given
                    and not view.is_processed(r.position)
                    and r.position not in self._superseded
                ]

    def retire_readers(self, prefix: str, delivered: Iterable[int] = ()) -> list[CommitReceipt]:
        """``retire_reader`` for every active reader whose id starts with ``<prefix>:``."""
        start = _text(prefix, "prefix") + ":"
        given = _positions(delivered, "delivered")
        with self._state_lock:
            readers = sorted(r for r in self._active if r.startswith(start))
        found: list[CommitReceipt] = []
        for reader in readers:
            found += self.retire_reader(reader, given)
        return found

    def recover_pending_rollout(self) -> list[CommitReceipt]:
        """Resume mode: the accepted prompt groups no batch took and nobody processed (once)."""
        if self.plan.mode != "resume":
            raise RuntimeError("Whole-job replay requires automatic WAL recovery selection")
        queue = self._usable()
        with self._producer_lock, self._training_lock:
            if self._recovered:
                return []
            with self._state_lock:
                superseded = set(self._superseded)
            found = [
                r
                for r in self._unprocessed(queue)
                if r.task_id.startswith(PROMPT) and r.position not in superseded
            ]
            self._recovered = True
            return found

    def _unprocessed(self, queue: Coordinator) -> Iterator[CommitReceipt]:
        """Accepted results the training view has not processed, in position order.

        Pages never cover a processed position: with online GC it may be released already.
        """
        view = self._training.view
        cursor = view.processed_cursor
        while True:  # bounded by the accepted log's length
            start, stop = view.unprocessed_run(cursor)
            limit = COMMIT_PAGE if stop is None else min(COMMIT_PAGE, stop - start)
            page = queue.read_commits(start, limit)
            yield from page.commits
            if len(page.commits) < limit:  # the log ends (a processed position never lies past it)
                return
            cursor = page.cursor

    # ------------------------------------------------------------------ collections

    def begin_collection(self, request: str) -> Lease:
        """The manager's lease on this incarnation's raw-collection task for ``request`` (idempotent)."""
        name = _text(request, "request")
        task_id = f"collection:{self.incarnation}:{name}"
        queue = self._usable()
        with self._training_lock:
            status = queue.task_status(task_id)
            if status is None:
                spec = TaskSpec(
                    task_id,
                    control=True,
                    allow_empty=True,
                    estimated_records=0,
                    max_attempts=self.config.task_max_attempts,
                )
                queue.submit_tasks(f"submit:{task_id}", [spec])
                status = queue.task_status(task_id)
            held = self._manager_lease(queue, task_id, status)
            if held is not None:
                return held
            state = status["state"] if status is not None else "unknown"
            raise RuntimeError(f"Collection task is not available: {task_id} ({state})")

    def _manager_lease(
        self, queue: Coordinator, task_id: str, status: Mapping[str, Any] | None
    ) -> Lease | None:
        """The manager's current (or completing) lease on a control task, acquiring a pending one."""
        if status is None:
            return None
        lease: dict[str, Any] = status.get("lease") or {}
        state = status["state"]
        if lease.get("worker_id") == MANAGER and (
            state == "completed" or (state == "leased" and lease["coordinator_epoch"] == queue.epoch)
        ):
            return Lease.from_dict(lease)
        if state == "pending":
            found = queue.acquire(MANAGER, 1, task_ids=[task_id], control=True)
            if found.assignments:
                held = found.assignments[0].lease
                with self._state_lock:
                    self._manager_leases[task_id] = held
                return held
        return None

    def accepted(self, receipt: CommitReceipt) -> CommitReceipt:
        """Confirm that ``receipt`` is in this queue's accepted log and its result is readable."""
        if not isinstance(receipt, CommitReceipt):
            raise TypeError(f"accepted takes a CommitReceipt, got {type(receipt).__name__}")
        found = self._usable().lookup_submission(receipt.submission_id)
        if found != receipt:
            raise ValueError("Raw rollout reference is not in this run's accepted log")
        self._bound.store.validate(receipt.result_ref)
        return found

    # ------------------------------------------------------------------ batches

    def batch(self, batch_id: str) -> dict[str, Any] | None:
        """A conversion control task: ``{plan_ref, input_positions, lease, ready, ready_ref, position}``."""
        queue = self._usable()
        status = queue.task_status(_text(batch_id, "batch_id"))
        if status is None:
            return None
        spec, lease = status["spec"], status.get("lease")
        ready = status["state"] == "completed"
        held = None
        if lease is not None and (
            ready or (status["state"] == "leased" and lease["coordinator_epoch"] == queue.epoch)
        ):
            held = Lease.from_dict(lease)
        receipt = queue.lookup_submission(f"result:{held.attempt_id}") if ready and held is not None else None
        return {
            "plan_ref": RecordSetRef.from_dict(spec["input_ref"]) if spec.get("input_ref") else None,
            "input_positions": list((spec.get("metadata") or {}).get("source_positions") or ()),
            "lease": held,
            "ready": ready,
            "ready_ref": receipt.result_ref if receipt is not None else None,
            "position": receipt.position if receipt is not None else None,
            "state": status["state"],
        }

    def plan_batch(self, batch_id: str, positions: Sequence[int], plan_ref: Any) -> dict[str, Any]:
        """Record a conversion's plan and inputs as a control task the manager holds (idempotent)."""
        name = _text(batch_id, "batch_id")
        if not name.startswith("batch:"):
            raise ValueError(f"a batch id starts with 'batch:', got {name!r}")
        inputs = sorted(set(_positions(positions, "positions")))
        ref = _manifest(plan_ref, "plan_ref")
        queue = self._usable()
        with self._training_lock:
            self._check_known(queue, inputs, "Batch input positions must name accepted results")
            status = queue.task_status(name)
            if status is None:
                spec = TaskSpec(
                    name,
                    ref,
                    control=True,
                    estimated_records=0,
                    metadata={"source_positions": inputs},
                    max_attempts=self.config.task_max_attempts,
                )
                self._fault("plan:submit")
                queue.submit_tasks(f"plan:{name}", [spec])
                self._note_superseded([spec.metadata])
                status = queue.task_status(name)
            elif (
                RecordSetRef.from_dict(status["spec"]["input_ref"]).digest != ref.digest
                or list(status["spec"]["metadata"].get("source_positions") or ()) != inputs
            ):
                raise ValueError(f"Batch {name} was already planned with another plan or other inputs")
            if status is not None and status["state"] == "pending":
                self._fault("plan:acquire")
                self._manager_lease(queue, name, status)
            if not self._training.conversion_started:
                self._fault("plan:state")
                self._save_training(queue, self._changed(conversion_started=True))
        found = self.batch(name)
        invariant(found is not None, "a planned batch has a task")
        return found  # type: ignore[return-value]

    def ready_batch(self, batch_id: str, ready_ref: Any) -> CommitReceipt:
        """Accept a conversion, *then* advance the training view over its inputs.

        Accept first, advance second: a crash in between leaves an accepted, unprocessed
        conversion that the next ``ready_batch`` (or a rollback) reconciles; the reverse
        order could let GC reclaim a conversion the queue never accepted.
        """
        name = _text(batch_id, "batch_id")
        ref = _manifest(ready_ref, "ready_ref")
        queue = self._usable()
        with self._training_lock:
            status = queue.task_status(name)
            if status is None or not name.startswith("batch:"):
                raise ValueError(f"Cannot publish an unplanned training batch: {name}")
            receipt = self._ready_receipt(queue, name, status, ref)
            self._fault("ready:advance")
            if name not in self._training.batches and not self._training.view.is_processed(receipt.position):
                inputs = [int(p) for p in status["spec"]["metadata"].get("source_positions") or ()]
                training = self._changed(view=self._advanced(queue, inputs))
                conversion = DiskPayloadRef(receipt.result_ref, self._root)
                training.batches[name] = {"position": receipt.position, "conversion": conversion}
                self._save_training(queue, training)
            return receipt

    def _ready_receipt(
        self, queue: Coordinator, name: str, status: Mapping[str, Any], ref: RecordSetRef
    ) -> CommitReceipt:
        if status["state"] == "completed":
            lease = Lease.from_dict(status["lease"])
            existing = queue.lookup_submission(f"result:{lease.attempt_id}")
            if existing is None:
                raise CorruptData(f"batch {name} is completed but its result is not in the accepted log")
            if existing.result_ref.digest != ref.digest:
                raise ValueError("Batch was already published with another ready reference")
            return existing
        held = self._manager_lease(queue, name, status)
        if held is None:
            raise ValueError(f"Cannot publish training batch {name}: its task is {status['state']}")
        self._fault("ready:complete")
        receipt = queue.complete_task(
            held, submission_id=f"result:{held.attempt_id}", result_ref=ref, result_digest=ref.digest
        )
        with self._state_lock:
            self._manager_leases.pop(name, None)
        release_publications(self.config, [ref])  # the accepted log holds the conversion now
        return receipt

    def finish_batch(self, batch_id: str) -> None:
        """Training finished this conversion: process its position; with online GC, collect once."""
        name = _text(batch_id, "batch_id")
        queue = self._usable()
        with self._training_lock:
            entry = self._training.batches.get(name)
            if entry is None:
                found = self.batch(name)
                if (
                    found is not None
                    and found["ready"]
                    and self._training.view.is_processed(found["position"])
                ):
                    return  # finished before: nothing to do
                raise ValueError("Cannot finish an unknown or unready training batch")
            self._fault("finish:advance")
            training = self._changed(view=self._advanced(queue, [int(entry["position"])]))
            del training.batches[name]
            self._save_training(queue, training)
        if self.config.rollout_queue_online_gc:
            self.collect_garbage()

    # ------------------------------------------------------------------ the training view

    def _check_known(self, queue: Coordinator, positions: Sequence[int], message: str) -> None:
        """Every position names an accepted result (the log is append-only: the highest suffices)."""
        if positions and not queue.read_commits(max(positions), 1).commits:
            raise ValueError(message)

    def _sources(self, queue: Coordinator, positions: Iterable[int]) -> dict[int, list[int]]:
        """For each position, the earlier positions its task replaced (``metadata.source_positions``)."""
        found: dict[int, list[int]] = {}
        for position in positions:
            (receipt,) = queue.read_commits(position, 1).commits
            status = queue.task_status(receipt.task_id)
            metadata = (status or {}).get("spec", {}).get("metadata") or {}
            sources = [int(p) for p in metadata.get("source_positions") or ()]
            if sources:
                found[position] = sources
        return found

    def _advanced(self, queue: Coordinator, positions: Sequence[int]) -> TrainingView:
        """The view after processing ``positions`` (nothing changes until it is saved)."""
        view = self._training.view
        return view.advance(list(positions), self._sources(queue, view.newly(positions)))

    def _changed(self, **changes: Any) -> _Training:
        """A copy of the training state with ``changes`` (its batches dict copied too)."""
        current = self._training
        return dataclasses.replace(current, **{"batches": dict(current.batches), **changes})

    def _save_training(self, queue: Coordinator, training: _Training) -> None:
        """Publish the training state and its progress record, then save the ``training`` consumer.

        The state is a sample.v1 publication, so the conversions and the disposition it names
        are its dependencies and stay retained with it; the json.v1 progress record lists the
        processed positions above the cursor for the queue's GC roots (docs/GC.md).
        """
        self._usable()  # a latched GC error stops saves before anything is written
        body = training.body()
        name = uuid.uuid4().hex
        with self._bound.lock:
            state_ref = settled(
                lambda: self._bound.codec.publish(body, submission_id=f"training-state:{name}")
            )
            progress = {
                "version": 1,
                "processed_positions": body["processed_positions"],
                "finished_batches": [],
            }
            record = Record("training-progress", encode(progress), codec="json.v1")
            progress_ref = settled(
                lambda: self._bound.store.publish(
                    [record], submission_id=f"training-progress:{name}", dependencies=[state_ref]
                )
            )
        view = training.view
        request = (
            "state:"
            + self.incarnation
            + ":"
            + digest([as_dict(state_ref), as_dict(progress_ref), view.fetch_cursor, view.processed_cursor])
        )
        queue.save_consumer_state(
            TRAINING,
            token=self._training_token,
            request_id=request,
            state_ref=state_ref,
            fetch_cursor=view.fetch_cursor,
            processed_cursor=view.processed_cursor,
            progress_ref=progress_ref,
        )
        with self._state_lock:
            self._training = training  # durable now: the in-memory view follows
        release_publications(self.config, [state_ref, progress_ref])

    def _load_training(self, queue: Coordinator) -> _Training:
        state = queue.load_consumer_state(TRAINING)
        if state is None:
            return _Training()
        with self._bound.lock:
            body = self._bound.codec.load(RecordSetRef.from_dict(state["state_ref"]))
        return _Training.from_body(body)

    def record_dispositions(
        self, positions: Sequence[int], reason: str, *, detail: Any = None
    ) -> RecordSetRef | None:
        """Record why accepted positions will never be trained, and process them (section 10.10).

        Gaps in the accepted order therefore never pin storage. An empty list records nothing.
        """
        if not isinstance(reason, str) or not reason:
            raise ValueError("Invalid accepted-output disposition")
        queue = self._usable()
        with self._training_lock:
            found = check_positions(positions, self._commit_count(queue))
            if not found:
                return None
            body = {"version": 1, "positions": found, "reason": reason, "detail": detail}
            with self._bound.lock:
                name = f"disposition:{uuid.uuid4().hex}"
                ref = settled(lambda: self._bound.codec.publish(body, submission_id=name))
            view = self._advanced(queue, found)
            self._save_training(queue, self._changed(view=view, disposition=DiskPayloadRef(ref, self._root)))
            release_publications(self.config, [ref])  # the training state depends on it
            return ref

    def _commit_count(self, queue: Coordinator) -> int:
        return int(queue.metrics()["commits"])

    def training_state(self) -> dict[str, Any] | None:
        """The ``training`` consumer's saved state (cursors and the state/progress references)."""
        return self._usable().load_consumer_state(TRAINING)

    def training_view(self) -> dict[str, Any]:
        """The training view as this controller holds it: cursors, processed positions, batches."""
        self._usable()
        with self._training_lock:
            body = self._training.body()
        return {k: body[k] for k in ("processed_cursor", "fetch_cursor", "processed_positions", "batches")}

    def unprocessed_receipts(self) -> list[CommitReceipt]:
        """The accepted results the training view has not processed, in position order."""
        queue = self._usable()
        with self._training_lock:
            return list(self._unprocessed(queue))

    def metrics(self) -> dict[str, Any]:
        """Tasks by state, commits, unprocessed accepted results, returned groups, failures, GC."""
        queue = self._usable()
        base = queue.metrics()
        with self._training_lock:
            unprocessed = list(self._unprocessed(queue))
        failed = self._failed_groups(queue, int(base["tasks"].get("failed", 0)))
        return {
            "tasks": dict(base["tasks"]),
            "commits": base["commits"],
            "accepted_unprocessed": {
                "count": len(unprocessed),
                "bytes": sum(r.result_ref.payload_bytes for r in unprocessed),
            },
            "pending_returned": self.pending_count(),
            "failed_groups": failed,
            "gc": {
                "runs": self._gc_runs,
                "last": self._gc_last,
                "error": repr(self._gc_error) if self._gc_error is not None else None,
            },
        }

    def _failed_groups(self, queue: Coordinator, failed_tasks: int) -> int:
        """Failed prompt tasks but filtered ones. Counting them reads every task, history too,
        so the count is kept with the queue's number of failed tasks it was made at: a failed
        task stays failed, so while that number holds, so does the count."""
        with self._state_lock:
            known = self._failed_count
        if known is not None and known[0] == failed_tasks:
            return known[1]
        failed = 0
        if failed_tasks:
            for task_id, status in queue.tasks.items():
                if task_id.startswith(PROMPT) and status["state"] == "failed":
                    failed += _category(status.get("failure")) != "Filtered"
        with self._state_lock:
            self._failed_count = (failed_tasks, failed)  # a failure meanwhile: recounted next time
        return failed

    # ------------------------------------------------------------------ checkpoints and readers

    def checkpoint_snapshot(self, step: int, *, consumers: Mapping[str, Any] | None = None) -> RecordSetRef:
        """Publish the queue's checkpoint payload for ``step`` (sections 10.12 and 17.3).

        It names every unfinished group by its original *prompt* (not continuations or
        results), so a kept checkpoint pins only prompts; a lease completing after the
        snapshot is still listed and is regenerated by a rollback. ``consumers`` are the data
        source's consumer states, handed back to them on restore. The caller retains it.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        extra = dict(consumers) if consumers is not None else {}
        queue = self._usable()
        with self._producer_lock, self._training_lock:
            producer = queue.producer_state(PRODUCER)
            view = self._training.view
            body = {
                "version": 1,
                "step": step,
                "timeline": int(producer["timeline"]),
                "queue_id": self.plan.queue_id,
                "producer": producer,
                "unfinished": self._unfinished(queue),
                "training": {
                    "processed_cursor": view.processed_cursor,
                    "fetch_cursor": view.fetch_cursor,
                    "processed_positions": view.positions(),
                },
                "readers": self._readers_metadata(queue),
                "consumers": extra,
                "configuration": self.configuration(),
            }
            with self._bound.lock:
                name = f"snapshot:{self.plan.queue_id}:{step}:{uuid.uuid4().hex}"
                return settled(lambda: self._bound.codec.publish(body, submission_id=name))

    def _unfinished(self, queue: Coordinator) -> list[dict[str, Any]]:
        """Pending or leased prompt tasks, then accepted unprocessed prompt results, one per group."""
        found: dict[Any, dict[str, Any]] = {}
        for task_id, status in queue.live_tasks(task_prefix=PROMPT).items():  # not the history
            entry = self._unfinished_entry(task_id, status, "", None)
            if entry is not None:
                found.setdefault(entry["group_index"], entry)
        for receipt in self._unprocessed(queue):
            if not receipt.task_id.startswith(PROMPT):
                continue
            accepted = queue.task_status(receipt.task_id)
            if accepted is not None:
                entry = self._unfinished_entry(receipt.task_id, accepted, "ready", receipt.position)
                if entry is not None:
                    found.setdefault(entry["group_index"], entry)
        return sorted(found.values(), key=lambda e: (e["group_index"], e["task_id"]))

    def _unfinished_entry(
        self, task_id: str, status: Mapping[str, Any], stage: str, position: int | None
    ) -> dict[str, Any] | None:
        metadata = status["spec"].get("metadata") or {}
        prompt = metadata.get("prompt")
        group = metadata.get("group_index")
        if prompt is None or isinstance(group, bool) or not isinstance(group, int):
            log.warning(
                "Task %s has no original prompt or group index; a rollback cannot reissue it", task_id
            )
            return None
        return {
            "group_index": group,
            "task_id": task_id,
            "stage": stage or str(metadata.get("stage", "fresh")),
            "prompt": DiskPayloadRef(RecordSetRef.from_dict(prompt), self._root),
            "position": position,
        }

    def _readers_metadata(self, queue: Coordinator) -> dict[str, Any]:
        readers: dict[str, Any] = {}
        for name, consumer in queue.consumers.items():
            if name.startswith(READER_CONSUMER) and consumer["state"] is not None:
                readers[name.removeprefix(READER_CONSUMER)] = self._reader_value(consumer["state"])
        return readers

    def _reader_value(self, state: Mapping[str, Any]) -> dict[str, Any]:
        with self._bound.lock:
            value = self._bound.codec.load(RecordSetRef.from_dict(state["state_ref"]))
        return dict(value["metadata"])

    def reader_metadata(self, reader_id: str, metadata: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Get (no ``metadata``) or set a reader's metadata, kept as consumer ``reader:<id>``."""
        reader = _text(reader_id, "reader_id")
        consumer = READER_CONSUMER + reader
        queue = self._usable()
        if metadata is None:
            state = queue.load_consumer_state(consumer)
            return self._reader_value(state) if state is not None else {}
        if not isinstance(metadata, Mapping):
            raise TypeError(f"reader metadata is a mapping, got {type(metadata).__name__}")
        value = dict(metadata)
        name = f"reader-metadata:{uuid.uuid4().hex}"
        with self._bound.lock:
            ref = settled(lambda: self._bound.codec.publish({"metadata": value}, submission_id=name))
        with self._state_lock:
            token = self._reader_tokens.get(consumer)
        if token is None:
            token = queue.open_consumer(consumer, exclusive_owner=EXCLUSIVE_OWNER)
            with self._state_lock:
                self._reader_tokens[consumer] = token
        queue.save_consumer_state(
            consumer,
            token=token,
            request_id=f"reader:{reader}:" + digest(as_dict(ref)),
            state_ref=ref,
            fetch_cursor=0,
            processed_cursor=0,
        )
        release_publications(self.config, [ref])
        return value

    # ------------------------------------------------------------------ background work

    def collect_garbage(self) -> dict[str, Any]:
        """One online collection pass now; a failure is latched (queue work stops) and raised."""
        queue = self._usable()
        with self._gc_lock:
            try:
                result = queue.collect_garbage()
            except BaseException as error:
                self._latch(error)
                raise RuntimeError(GC_FAILED) from error
            self._gc_runs += 1
            self._gc_last = result
        log.info("straw_online_gc: %s", result)
        return result

    def _latch(self, error: BaseException) -> None:
        if self._gc_error is None:
            self._gc_error = error
            log.error("straw online GC failed; retained storage must be inspected", exc_info=error)
        self._stop.set()

    def _gc_loop(self) -> None:
        while not self._stop.wait(self.config.gc_interval_seconds):
            try:
                self.collect_garbage()
            except BaseException:  # latched by collect_garbage (or the controller closed): stop
                return

    def _keep_manager_leases(self) -> None:
        """Heartbeat the control tasks the manager holds, so a long collection or conversion
        keeps its lease (the manager never heartbeats itself)."""
        interval = max(0.1, self.config.rollout_queue_lease_seconds / 3)
        while not self._stop.wait(interval):
            with self._state_lock:
                held = dict(self._manager_leases)
            if not held or self._gc_error is not None:
                continue
            try:
                outcomes = self._usable().heartbeat(list(held.values()))
            except Exception as error:  # closing, or a broken queue: nothing left to keep
                log.warning("Control task heartbeat stopped: %s", error)
                return
            with self._state_lock:
                for (task_id, lease), outcome in zip(held.items(), outcomes, strict=True):
                    if outcome != "extended" and self._manager_leases.get(task_id) == lease:
                        del self._manager_leases[task_id]

    # ------------------------------------------------------------------ closing

    def close(self) -> None:
        """Stop the threads, close the queue, seal the writer; the save lock is released last.

        The lock is held through the queue's close and the seal even when they fail, so no
        other job starts on this save directory before this one's writes are finished. A
        latched GC error is raised after everything is closed. Idempotent.
        """
        if self._closed:
            return
        self._closed = True
        try:
            self._stop.set()
            for thread in self._threads:
                if thread is not threading.current_thread():
                    thread.join()
            try:
                if self._coordinator is not None:
                    self._coordinator.close()
            finally:
                seal_rollout_store(self.config)
            if self._gc_error is not None:
                raise RuntimeError(GC_FAILED) from self._gc_error
        finally:
            if self._save_lock is not None:
                self._save_lock.release()

    def __enter__(self) -> QueueController:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        plan = self.plan
        return (
            f"QueueController(queue_id={plan.queue_id!r}, mode={plan.mode!r}, incarnation={self.incarnation})"
        )
