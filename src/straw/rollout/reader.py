"""Queue readers: one process's client of the job's controller, and the job-level data source.

A :class:`QueueReader` holds only the leases it is executing: it takes prompt groups from the
controller, loads their inputs from the pool itself, keeps their leases alive from a daemon
heartbeat thread, and either publishes a finished group (``publish_group``) or returns it
(``add_samples``: a continuation replacing the task's input, or a delivery of an accepted group).
Returned work lives in the queue, never in the reader. :class:`QueueDataSource` is the job's own
reader (id ``owner``), owns the registered consumers and writes the data source's part of a
checkpoint (ROLLOUT.md section 11, docs/ROLLOUT.md "Readers").
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from ..errors import (
    CorruptData,
    InvalidReference,
    LeaseExpired,
    StaleAttempt,
    StorageUnavailable,
    UnsupportedSchema,
)
from ..protocol import Assignment, CommitReceipt, Lease, RecordSetRef, as_dict
from ..reporting import write_report
from ..store import ReadSession
from .checkpoint import rollout_dir
from .config import RolloutConfig, resolve_pool
from .controller import ControllerClient, QueueController
from .pool import open_reader, rollout_store, settled
from .refs import (
    DiskPayloadRef,
    RolloutGroupRef,
    discard_group,
    group_lease,
    materialize,
    pack_group,
    record_provenance,
    release_group_staging,
    release_publications,
)
from .sample import group_stage, iter_samples, scheduling_key

__all__ = ["QueueDataSource", "QueueReader", "QueueReaderConfig", "SourceRestore"]

log = logging.getLogger("straw.rollout.reader")

#: Groups per ``take`` and per ``return_groups`` call; leases per heartbeat or release call.
TAKE_CHUNK = 64
RETURN_CHUNK = 64
LEASE_CHUNK = 128
#: How long an idle reader waits before asking again when the queue had nothing to hand out.
IDLE_WAIT_SECONDS = 0.05
PRIORITY = {"ready": 2, "partial": 1, "fresh": 0}
OWNER = "owner"


def _rows(value: Any) -> int | None:
    """Rows of a capture (list, array, tensor or TensorRef); None when nothing was captured."""
    if value is None:
        return None
    shape = getattr(value, "shape", None)
    if shape is not None:
        return int(shape[0]) if len(shape) else 0
    return len(value)


class QueueReader:
    """One process's reader of a job's queue (ROLLOUT.md section 11.1).

    ``dataset_size`` answers ``len(reader)`` without asking the controller; ``incarnation``
    is recorded in the provenance of tokens generated through this reader (default: the
    controller's). ``clock`` stamps heartbeats.
    """

    def __init__(
        self,
        config: RolloutConfig,
        controller: ControllerClient,
        reader_id: str,
        *,
        dataset_size: int | None = None,
        incarnation: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not isinstance(config, RolloutConfig):
            raise TypeError(f"QueueReader takes a RolloutConfig, got {type(config).__name__}")
        if not isinstance(reader_id, str) or not reader_id:
            raise ValueError(f"reader_id must be a non-empty string, got {reader_id!r}")
        if dataset_size is not None and (isinstance(dataset_size, bool) or not isinstance(dataset_size, int)):
            raise TypeError(f"dataset_size must be an integer or None, got {type(dataset_size).__name__}")
        self.config = config if config.rollout_data_dir else resolve_pool(config)
        self.controller = controller
        self.reader_id = reader_id
        self._dataset_size = dataset_size
        self._incarnation = incarnation
        self._clock = clock
        self._leases: dict[str, Lease] = {}
        self._lock = threading.Lock()
        # One read session for every input this reader loads (its verified index frames and
        # record sets are reused from take to take); one loading thread at a time uses it.
        self._read_lock = threading.Lock()
        self._session: ReadSession | None = None
        self._closed = False
        self._closing = threading.Event()
        self._heartbeat_error: BaseException | None = None
        self.last_heartbeat: float | None = None
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="straw-reader")
        self._interval = max(0.1, float(config.rollout_queue_lease_seconds) / 3)
        self._thread = threading.Thread(
            target=self._heartbeat_loop, name="straw-reader-heartbeat", daemon=True
        )
        self._thread.start()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.reader_id!r}, leases={len(self._leases)})"

    # ------------------------------------------------------------------ leases

    def leases(self) -> list[Lease]:
        """The leases this reader currently executes."""
        with self._lock:
            return list(self._leases.values())

    def _drop(self, leases: Iterable[Lease | None]) -> None:
        with self._lock:
            for lease in leases:
                if lease is not None and self._leases.get(lease.task_id) == lease:
                    del self._leases[lease.task_id]

    def heartbeat(self) -> None:
        """Extend every local lease once (the heartbeat thread calls this every lease/3 s).

        ``StaleAttempt`` drops a lease locally; any other outcome latches
        ``LeaseExpired`` and stops the heartbeat: the reader can no longer vouch for its work.
        """
        with self._lock:
            held = list(self._leases.values())
        for start in range(0, len(held), LEASE_CHUNK):
            chunk = held[start : start + LEASE_CHUNK]
            outcomes = self.controller.heartbeat(chunk)
            for lease, outcome in zip(chunk, outcomes, strict=True):
                with self._lock:
                    if self._leases.get(lease.task_id) != lease:
                        continue  # released (and maybe re-acquired) meanwhile
                    if outcome == "extended":
                        continue
                    if outcome == "StaleAttempt":
                        del self._leases[lease.task_id]
                        continue
                error = LeaseExpired(f"Reader lost lease for {lease.task_id}: {outcome}")
                self._latch(error)
                raise error
        self.last_heartbeat = self._clock()

    def _latch(self, error: BaseException) -> None:
        if self._heartbeat_error is None:
            self._heartbeat_error = error
            log.error("Queue reader %s stopped heartbeating: %s", self.reader_id, error)

    def _heartbeat_loop(self) -> None:
        while not self._closing.wait(self._interval):
            if self._heartbeat_error is not None:
                return
            try:
                self.heartbeat()
            except BaseException as error:  # latched: get_samples raises it from now on
                self._latch(error)
                return

    def _open(self) -> None:
        if self._closed:
            raise RuntimeError("Queue reader is closed")

    def _check(self) -> None:
        self._open()
        if self._heartbeat_error is not None:
            raise RuntimeError("Queue lease heartbeat failed") from self._heartbeat_error

    # ------------------------------------------------------------------ taking groups

    def _incarnation_id(self) -> str:
        if self._incarnation is None:
            self._incarnation = str(self.controller.identity()["incarnation"])
        return self._incarnation

    def get_samples(self, num_groups: int) -> list[Any]:
        """Lease and load up to ``num_groups`` groups (fewer only when the queue drains)."""
        if isinstance(num_groups, bool) or not isinstance(num_groups, int):
            raise TypeError(f"num_samples must be an integer, got {type(num_groups).__name__}")
        if num_groups < 0:
            raise ValueError("num_samples must be nonnegative")
        self._check()
        groups: list[Any] = []
        while len(groups) < num_groups:  # ends when filled, drained, closed or failed
            self._check()
            found = self.controller.take(self.reader_id, min(num_groups - len(groups), TAKE_CHUNK))
            if found.assignments:
                groups += self._load(found.assignments)
            elif found.status in ("end_of_input", "draining"):
                break
            elif found.status in ("empty", "backpressured"):
                self._closing.wait(IDLE_WAIT_SECONDS)
            else:
                raise RuntimeError(f"Queue cannot supply rollout inputs: {found.status}")
        return groups

    async def get_samples_async(self, num_groups: int) -> list[Any]:
        """``get_samples`` on the reader's own thread (input reads never block the event loop)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self.get_samples, num_groups)

    def _load(self, assignments: Iterable[Assignment]) -> list[Any]:
        items = list(assignments)
        with self._lock:
            for item in items:  # re-inserted, so the local order is the order of taking
                self._leases.pop(item.lease.task_id, None)
                self._leases[item.lease.task_id] = item.lease
        try:
            incarnation = self._incarnation_id()
            root = str(self.config.rollout_data_dir)
            groups = []
            with self._read_lock:
                session = self._reading(root)
                for item in items:
                    if item.task.input_ref is None:
                        raise ValueError(f"prompt task {item.task.task_id} has no input")
                    group = DiskPayloadRef(item.task.input_ref, root).load(reader=session)
                    _attach(group, item, incarnation, root)
                    groups.append(group)
            return groups
        except BaseException:
            leases = [item.lease for item in items]
            self._drop(leases)
            self.controller.release(leases)  # the tasks go back with their inputs, no attempt spent
            raise

    def _reading(self, root: str) -> ReadSession:
        """This reader's read session (the caller holds ``_read_lock``); a forked child opens its own."""
        if self._closed:
            raise RuntimeError("Queue reader is closed")  # _load gives the leases back
        if self._session is None or self._session.forked:
            self._session = open_reader(root, self.config.run_id)
        return self._session

    # ------------------------------------------------------------------ finishing groups

    def publish_group(self, group: Any, *, rollout_id: int | str) -> RolloutGroupRef:
        """Publish a leased group as its task's result (``pack_group``); the lease ends locally.

        A latched heartbeat failure does not stop this: the controller decides whether the
        lease still holds (``StaleAttempt`` / ``LeaseExpired`` when it does not).
        """
        self._open()
        lease = group_lease(group)
        if lease is None:
            raise ValueError("publish_group takes a leased group; add_samples returns other groups")
        try:
            ref = pack_group(group, config=self.config, controller=self.controller, rollout_id=rollout_id)
        except (StaleAttempt, LeaseExpired):
            self._drop([lease])  # someone else owns the task now
            raise
        self._drop([lease])
        return ref  # type: ignore[no-any-return]

    def discard_group(self, group: Any, reason: str) -> None:
        """Drop a group for good: reject its task, or dispose the accepted results it carries."""
        lease = group_lease(group)
        discard_group(group, config=self.config, controller=self.controller, reason=reason)
        self._drop([lease])

    def add_samples(self, groups: Iterable[Any]) -> None:
        """Return groups to the queue (``RETURN_CHUNK`` per call), kept as continuations.

        A leased group continues its task; an accepted one (or one without a lease) becomes a
        delivery. A partial whose replay captures do not cover its tokens cannot be
        continued: its task retries from its last durable input instead (with a warning).
        """
        self._open()
        items = list(groups)
        checked = [(group, self._continuation_problems(group)) for group in items]
        for group, problems in checked:
            if problems and group_lease(group) is None:
                raise ValueError(f"Incomplete continuation has no durable task input to retry: {problems}")
        broken = [(group, problems) for group, problems in checked if problems]
        if broken:
            self._requeue(broken)
        rest = [group for group, problems in checked if not problems]
        for start in range(0, len(rest), RETURN_CHUNK):
            self._return(rest[start : start + RETURN_CHUNK])

    def _continuation_problems(self, group: Any) -> list[tuple[Any, str, int, int]]:
        """(sample index, field, rows found, rows expected) for each capture a partial lacks."""
        config = self.config
        problems: list[tuple[Any, str, int, int]] = []
        for sample in iter_samples(group):
            if sample.response_length <= 0:
                continue
            expected = {}
            if config.use_rollout_routing_replay:
                expected["rollout_routed_experts"] = len(sample.tokens) - 1
            if config.use_score_centering and config.rollout_top_p == 1:
                expected["rollout_topk_token_ids"] = sample.response_length
                expected["rollout_topk_log_probs"] = sample.response_length
            for field, rows in expected.items():
                found = _rows(getattr(sample, field))
                if found is not None and found != rows:
                    problems.append((sample.index, field, found, rows))
        return problems

    def _requeue(self, broken: list[tuple[Any, list[tuple[Any, str, int, int]]]]) -> None:
        leases = []
        for group, _ in broken:
            release_group_staging(group, config=self.config)
            leases.append(group_lease(group))
        held = [lease for lease in leases if lease is not None]
        for start in range(0, len(held), LEASE_CHUNK):
            self.controller.release(held[start : start + LEASE_CHUNK])
        self._drop(held)
        first = [problem for _, problems in broken for problem in problems][:8]
        log.warning(
            "Requeued %d incomplete continuations from their last durable inputs; "
            "(sample, field, actual, expected): %s",
            len(broken),
            first,
        )

    def _return(self, groups: list[Any]) -> None:
        leases = [group_lease(group) for group in groups]
        leased = [lease for lease in leases if lease is not None]
        existing = dict(
            zip([lease.task_id for lease in leased], self.controller.results(leased), strict=True)
        )
        receipts: list[CommitReceipt | None] = []
        for group, lease in zip(groups, leases, strict=True):
            record_provenance(group)
            receipt = existing.get(lease.task_id) if lease is not None else None
            if receipt is not None:  # accepted already (a lost reply): it travels as a delivery
                for sample in iter_samples(group):
                    sample.__dict__.pop("_queue_lease", None)
                    sample._queue_receipt = as_dict(receipt)  # type: ignore[attr-defined]
            receipts.append(receipt)
        bound = rollout_store(self.config)
        with bound.lock:
            names = [f"continuation:{uuid.uuid4().hex}" for _ in groups]
            refs = settled(lambda: bound.codec.publish_many(groups, submission_ids=names))
        updates, deliveries = [], []
        for group, lease, receipt, ref in zip(groups, leases, receipts, refs, strict=True):
            fields = _return_fields(group, ref)
            if lease is not None and receipt is None:
                updates.append({"lease": lease, **fields})
            else:
                deliveries.append({**fields, "estimated_tokens": ref.tokens})
        try:
            self.controller.return_groups(updates, deliveries)
        finally:
            # Either the queue's tasks hold the continuations now, or nothing ever will (their
            # ids are random, nobody retries them): in both cases their staging is over.
            release_publications(self.config, refs)
        self._drop(leases)

    # ------------------------------------------------------------------ the rest

    def materialize_samples(self, samples: Any) -> Any:
        """Copies of ``samples`` with every lazy tensor loaded."""
        return materialize(samples)

    def get_buffer_length(self) -> int:
        """Returned groups waiting in the queue."""
        return self.controller.pending_count()

    def update_metadata(self, metadata: Mapping[str, Any]) -> None:
        self.controller.reader_metadata(self.reader_id, metadata)

    def get_metadata(self) -> dict[str, Any]:
        return self.controller.reader_metadata(self.reader_id)

    def __len__(self) -> int:
        if self._dataset_size is None:
            self._dataset_size = int(self.controller.configuration()["dataset_size"])
        return self._dataset_size

    def save(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("Save queue readers through their owning data source")

    def load(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("Restore queue readers through their owning data source")

    def close(self) -> None:
        """Stop reading, give local leases back (no attempt spent), stop the heartbeat. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._closing.set()
        self._executor.shutdown(wait=True)
        try:
            held = self.leases()
            for start in range(0, len(held), LEASE_CHUNK):
                self.controller.release(held[start : start + LEASE_CHUNK])
            self._drop(held)
        finally:
            if self._thread is not threading.current_thread():
                self._thread.join()
            with self._read_lock:
                session, self._session = self._session, None
            if session is not None and not session.forked:
                session.close()


def _attach(group: Any, item: Assignment, incarnation: str, root: str) -> None:
    """Give a loaded input's samples the queue context of the attempt that leased it."""
    metadata = item.task.metadata or {}
    lease = as_dict(item.lease)
    prompt = metadata.get("prompt")
    prompt_ref = DiskPayloadRef(RecordSetRef.from_dict(prompt), root) if prompt is not None else None
    sources = [int(p) for p in metadata.get("source_positions") or ()]
    for sample in iter_samples(group):
        sample.__dict__.pop("_queue_receipt", None)
        sample._queue_lease = dict(lease)  # type: ignore[attr-defined]
        sample._queue_generation_start = len(sample.tokens)  # type: ignore[attr-defined]
        sample._queue_incarnation = incarnation  # type: ignore[attr-defined]
        sample._queue_source_positions = list(sources)  # type: ignore[attr-defined]
        sample._queue_prompt = prompt_ref  # type: ignore[attr-defined]


def _return_fields(group: Any, ref: RecordSetRef) -> dict[str, Any]:
    """Input, priority, key and metadata of a returned group's task (section 11.1 step 2)."""
    samples = list(iter_samples(group))
    stage = group_stage(group)
    sources: set[int] = set()
    for sample in samples:
        sources.update(int(p) for p in getattr(sample, "_queue_source_positions", None) or ())
        receipt = getattr(sample, "_queue_receipt", None)
        if isinstance(receipt, Mapping):
            sources.add(int(receipt["position"]))
    prompt = getattr(samples[0], "_queue_prompt", None)
    prompt_ref = prompt.manifest if isinstance(prompt, DiskPayloadRef) else ref
    metadata = {
        "stage": stage,
        "returned": True,
        "source_positions": sorted(sources),
        "group_index": samples[0].group_index,
        "prompt": as_dict(prompt_ref),
    }
    return {
        "input_ref": ref,
        "priority": PRIORITY[stage],
        "scheduling_key": scheduling_key(group),
        "metadata": metadata,
    }


@dataclasses.dataclass(frozen=True)
class QueueReaderConfig:
    """What a worker process needs to open its reader (frozen and picklable with a picklable controller)."""

    config: RolloutConfig
    controller: ControllerClient
    reader_id: str
    dataset_size: int | None
    incarnation: str | None = None

    def open(self) -> QueueReader:
        return QueueReader(
            self.config,
            self.controller,
            self.reader_id,
            dataset_size=self.dataset_size,
            incarnation=self.incarnation,
        )


@dataclasses.dataclass(frozen=True)
class SourceRestore:
    """What ``QueueDataSource.load`` restored: the controller's mode, the step, the timeline."""

    mode: str
    step: int | None
    timeline: int


class QueueDataSource(QueueReader):
    """The job-level data source: the reader ``owner`` (or ``<prefix>:owner``) and its consumers.

    Without ``controller`` it creates and owns one from ``config``, ``dataset`` and
    ``restore_plan`` (ROLLOUT.md section 11.2). Consumers (runners) registered here are paused
    around a checkpoint and closed with the source.
    """

    def __init__(
        self,
        config: RolloutConfig,
        *,
        controller: ControllerClient | None = None,
        dataset: Any = None,
        restore_plan: Any = None,
        reader_prefix: str = "",
    ) -> None:
        if not isinstance(reader_prefix, str):
            raise TypeError(f"reader_prefix must be a string, got {type(reader_prefix).__name__}")
        owned = controller is None
        if controller is None:
            made = QueueController(config, dataset=dataset, restore_plan=restore_plan)
            config, controller = made.config, made
        self.reader_prefix = reader_prefix
        self._owns_controller = owned
        self._consumers: dict[str, Any] = {}
        self._started = False
        try:
            super().__init__(config, controller, self._name(OWNER))
        except BaseException:
            if owned:
                controller.close()
            raise

    def _name(self, reader_id: str) -> str:
        return f"{self.reader_prefix}:{reader_id}" if self.reader_prefix else reader_id

    def reader_config(self, reader_id: str) -> QueueReaderConfig:
        """The configuration of another reader of this job (its id gets the source's prefix)."""
        if not isinstance(reader_id, str) or not reader_id:
            raise ValueError(f"reader_id must be a non-empty string, got {reader_id!r}")
        if reader_id == OWNER:
            raise ValueError("Reader ID 'owner' is reserved")
        self._started = True
        return QueueReaderConfig(
            self.config, self.controller, self._name(reader_id), len(self), self._incarnation_id()
        )

    def get_samples(self, num_groups: int) -> list[Any]:
        self._started = True
        return super().get_samples(num_groups)

    def register_consumer(self, name: str, consumer: Any) -> None:
        """Add a consumer (``pause``, ``resume``, ``state_dict``, ``close``, optional ``load_state_dict``)."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"a consumer name is a non-empty string, got {name!r}")
        if name in self._consumers:
            raise ValueError(f"Consumer '{name}' already registered")
        missing = [
            m for m in ("pause", "resume", "state_dict", "close") if not callable(getattr(consumer, m, None))
        ]
        if missing:
            raise TypeError(f"Consumer '{name}' lacks {', '.join(missing)}")
        self._consumers[name] = consumer

    def save(self, step: int) -> Path | None:
        """Write the data source's part of checkpoint ``step`` (section 14.3 step 3).

        Consumers are paused; the snapshot is published and retained under
        ``checkpoint:<abs path of queue_state_<step>.json>:<digest>`` (its staging released),
        then ``global_dataset_state_dict_<step>.json``, then ``queue_state_<step>.json`` last;
        consumers that were running are resumed. A replay job (``debug:`` queue) writes nothing.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        identity = self.controller.identity()
        if str(identity["queue_id"]).startswith("debug:"):
            return None
        if not self.config.save:
            raise ValueError("QueueDataSource.save needs --save")
        running = {name: consumer.pause() is not True for name, consumer in self._consumers.items()}
        try:
            states = {name: consumer.state_dict() for name, consumer in self._consumers.items()}
            return self._write_checkpoint(step, identity, states)
        finally:
            for name, consumer in self._consumers.items():
                if running[name]:
                    consumer.resume()

    def _write_checkpoint(self, step: int, identity: Mapping[str, Any], states: dict[str, Any]) -> Path:
        directory = rollout_dir(str(self.config.save))
        queue_file = directory / f"queue_state_{step}.json"
        ref = self.controller.checkpoint_snapshot(step, consumers=states)
        owner = f"checkpoint:{queue_file}:{ref.digest}"
        bound = rollout_store(self.config)
        bound.store.retain(owner, [ref])
        release_publications(self.config, [ref])  # the checkpoint owner holds it now
        with bound.lock:
            head = bound.codec.load(ref, selection={"producer": None, "configuration": None})
        producer = head["producer"]
        cursor = dict(producer["cursor"])
        write_report(
            directory / f"global_dataset_state_dict_{step}.json",
            {"version": 1, "step": step, "timeline": producer["timeline"], **cursor},
        )
        write_report(
            queue_file,
            {
                "version": 1,
                "step": step,
                "queue_id": identity["queue_id"],
                "run_id": identity["run_id"],
                "root": str(bound.store.backend.root),
                "manifest": as_dict(ref),
                "storage_owner": owner,
                "producer": producer,
                "configuration": head["configuration"],
            },
        )
        return queue_file

    def load(self, step: int | None = None) -> SourceRestore:
        """What the controller restored; saved consumer states go to consumers that take them.

        Reader metadata is restored by the controller's rollback itself; here only the
        consumers' own states are handed back (from the snapshot of ``step``, when the
        controller restored one).
        """
        if self._started:
            raise RuntimeError("Restore before starting rollout consumers")
        identity = self.controller.identity()
        mode = str(identity["mode"])
        restored = step if mode in ("rollback", "empty") else None
        if restored is not None and self.config.save:
            for name, state in self._saved_consumers(restored).items():
                consumer = self._consumers.get(name)
                if consumer is not None and callable(getattr(consumer, "load_state_dict", None)):
                    consumer.load_state_dict(state)
        return SourceRestore(mode, restored, int(identity["timeline"]))

    def _saved_consumers(self, step: int) -> dict[str, Any]:
        plan = getattr(self.controller, "plan", None)
        if getattr(plan, "snapshot_problem", None) is not None:
            return {}  # the restore found no usable snapshot: the consumers start fresh
        path = rollout_dir(str(self.config.save)) / f"queue_state_{step}.json"
        if not path.exists():
            return {}
        bound = rollout_store(self.config)
        try:
            index = json.loads(path.read_text(encoding="utf-8"))
            with bound.lock:
                head = bound.codec.load(
                    RecordSetRef.from_dict(index["manifest"]), selection={"consumers": None}
                )
        except (
            CorruptData,
            StorageUnavailable,
            InvalidReference,
            UnsupportedSchema,
            KeyError,
            ValueError,
        ) as error:
            # A proxied controller does not tell its plan; the snapshot was unusable to it too.
            log.warning(
                "Consumer states of step %d cannot be read (%s): the consumers start fresh", step, error
            )
            return {}
        return dict(head.get("consumers") or {})

    def close(self) -> None:
        """Close the consumers, then the reader, then the controller if this source made it."""
        if self._closed:
            return
        errors: list[BaseException] = []
        for consumer in self._consumers.values():
            try:
                consumer.close()
            except Exception as error:  # close the rest; raise the first
                errors.append(error)
        try:
            super().close()
        except Exception as error:
            errors.append(error)
        if self._owns_controller:
            try:
                self.controller.close()
            except Exception as error:
                errors.append(error)
        if errors:
            raise errors[0]
