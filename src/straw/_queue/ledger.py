"""The training side's ledger: consumers, batches, checkpoints and released history (pure).

``QueueState`` splits in two: the task lifecycle (tasks, leases, the pending index, accepted
receipts) and this ledger, what consumers declared about the accepted results (their states
and cursors, planned and ready batches, retained checkpoints) and which accepted history the
queue no longer owns. The ledger never looks at a task; the lifecycle hands it the number of
accepted results where a check needs it.

:meth:`Ledger.acknowledged` is the one acknowledgement rule: the coordinator's collection,
its history release, its usage view and ``straw check`` all ask it (docs/GC.md "Queue roots").
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import IdempotencyConflict, InvalidReference, StaleAttempt, StorageUnavailable, UnsafeRecovery
from . import events as ev
from .progress import Acknowledged, acknowledged

#: The consumer whose progress acknowledges accepted results for GC (API.md section 7).
TRAINING = "training"

#: What the training consumer acknowledges: (processed_cursor, processed_positions above it).
Acked = tuple[int, frozenset[int]]


@dataclass
class Consumer:
    owner: str
    token: str
    open: bool = True
    state: dict[str, Any] | None = None


@dataclass
class Ledger:
    """Consumers, batches, checkpoints and released history; rebuilt by replaying their events."""

    consumers: dict[str, Consumer] = field(default_factory=dict)
    batches: dict[str, dict[str, Any]] = field(default_factory=dict)
    checkpoints: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: Accepted history the queue stopped owning (docs/QUEUE.md "Released history"): every
    #: position below ``released_cursor`` and those in ``released_positions`` (all above it).
    #: Set by ``collect_garbage`` to what the training consumer had acknowledged; a rewind of
    #: that consumer takes positions back (the queue owns them again).
    released_cursor: int = 0
    released_positions: frozenset[int] = frozenset()

    def copy(self) -> Ledger:
        """A copy for a snapshot (``QueueState.snapshot_copy``): what later calls change in place
        (consumers, batches, checkpoint entries) one level deep; consumer states are replaced,
        never changed, so they are shared."""
        return Ledger(
            {k: Consumer(c.owner, c.token, c.open, c.state) for k, c in self.consumers.items()},
            {k: dict(batch) for k, batch in self.batches.items()},
            {k: dict(entry) for k, entry in self.checkpoints.items()},
            self.released_cursor,
            self.released_positions,
        )

    # ------------------------------------------------------------------ acknowledgement

    def progress_ref(self) -> dict[str, Any] | None:
        """The reference of the training consumer's progress record, if its state names one:
        what the shell reads (and parses with ``progress.parse_progress``) for :meth:`acknowledged`."""
        consumer = self.consumers.get(TRAINING)
        state = consumer.state if consumer is not None else None
        ref = state.get("progress_ref") if state is not None else None
        return ref if isinstance(ref, dict) else None

    def acknowledged(self, progress: tuple[Iterable[int], Iterable[str]] = ((), ())) -> Acknowledged:
        """What the training consumer acknowledges: its saved ``processed_cursor`` plus the
        positions and batches of its progress record (``progress``, as ``parse_progress``
        returns it; empty without one). The one rule GC, history release, usage and
        ``straw check`` share; no training state acknowledges nothing."""
        consumer = self.consumers.get(TRAINING)
        return acknowledged(consumer.state if consumer is not None else None, progress)

    # ------------------------------------------------------------------ consumers

    def consumer(self, consumer_id: str, token: str) -> Consumer:
        consumer = self.consumers.get(consumer_id)
        if consumer is None:
            raise KeyError(f"unknown consumer {consumer_id!r}; open_consumer first")
        if not consumer.open or consumer.token != token:
            raise StaleAttempt(f"token of consumer {consumer_id!r} is not current; reopen the consumer")
        return consumer

    def check_open_consumer(self, consumer_id: str, owner: str, token: str) -> ev.OpenConsumer:
        _check_name(consumer_id, "consumer_id")
        _check_name(owner, "exclusive_owner")
        consumer = self.consumers.get(consumer_id)
        if consumer is not None and consumer.open and consumer.owner != owner:
            raise UnsafeRecovery(
                f"consumer {consumer_id!r} is open by owner {consumer.owner!r}; a second live owner is "
                "refused: close it, or recover the coordinator once that owner is known to be stopped"
            )
        return ev.OpenConsumer(consumer_id=consumer_id, owner=owner, token=token)

    def apply_open_consumer(self, event: ev.OpenConsumer) -> str:
        old = self.consumers.get(event.consumer_id)
        state = old.state if old is not None else None
        self.consumers[event.consumer_id] = Consumer(event.owner, event.token, True, state)
        return event.token

    def check_close_consumer(self, consumer_id: str, token: str) -> ev.CloseConsumer:
        self.consumer(consumer_id, token)
        return ev.CloseConsumer(consumer_id=consumer_id)

    def apply_close_consumer(self, event: ev.CloseConsumer) -> bool:
        self.consumers[event.consumer_id].open = False
        return True

    def revoke_owners(self) -> None:
        """Recovery ends every consumer's ownership (its token is revoked, its state kept):
        whoever now declares itself the owner may open it."""
        for consumer in self.consumers.values():
            consumer.open = False

    def apply_save_consumer(self, event: ev.SaveConsumer) -> dict[str, Any]:
        self.consumers[event.consumer_id].state = event.state
        self.apply_released(event.released)
        return event.state

    # ------------------------------------------------------------------ batches and checkpoints

    def check_plan_batch(
        self, consumer_id: str, token: str, batch: dict[str, Any], commits: int
    ) -> ev.PlanBatch | ev.Answer[dict[str, Any]]:
        """``commits``: how many results were accepted (a plan names accepted positions)."""
        self.consumer(consumer_id, token)
        existing = self.batches.get(batch["batch_id"])
        if existing is not None:
            if {k: existing[k] for k in batch} != batch:
                raise IdempotencyConflict(f"batch {batch['batch_id']!r} was already planned differently")
            return ev.Answer(existing)
        positions = batch["input_positions"]
        if any(not isinstance(p, int) or isinstance(p, bool) or not 0 <= p < commits for p in positions):
            raise ValueError(f"input_positions must name accepted results (0..{commits - 1})")
        return ev.PlanBatch(batch=batch)

    def apply_plan_batch(self, event: ev.PlanBatch) -> dict[str, Any]:
        batch = dict(event.batch, ready=False)
        self.batches[batch["batch_id"]] = batch
        return batch

    def check_batch_ready(
        self,
        consumer_id: str,
        token: str,
        batch_id: str,
        ready_ref: dict[str, Any],
        state: dict[str, Any],
        commits: int,
        acked: Acked | None = None,
        verified: frozenset[int] = frozenset(),
    ) -> ev.BatchReady | ev.Answer[dict[str, Any]]:
        consumer = self.consumer(consumer_id, token)
        batch = self.batches.get(batch_id)
        if batch is None:
            raise KeyError(f"unknown batch {batch_id!r}; plan_batch first")
        if batch["consumer_id"] != consumer_id:
            raise InvalidReference(f"batch {batch_id!r} belongs to consumer {batch['consumer_id']!r}")
        if batch["ready"]:
            if batch["ready_ref"] != ready_ref:
                raise IdempotencyConflict(f"batch {batch_id!r} is already ready with another result")
            return ev.Answer({"batch_id": batch_id, "ready_ref": batch["ready_ref"], "state": consumer.state})
        check_cursors(state, commits)
        return ev.BatchReady(
            consumer_id=consumer_id,
            batch_id=batch_id,
            ready_ref=ready_ref,
            state=state,
            released=self.rewound(acked, verified),
        )

    def apply_batch_ready(self, event: ev.BatchReady) -> dict[str, Any]:
        batch = self.batches[event.batch_id]
        batch["ready"] = True
        batch["ready_ref"] = event.ready_ref
        self.consumers[event.consumer_id].state = event.state
        self.apply_released(event.released)
        return {"batch_id": event.batch_id, "ready_ref": event.ready_ref, "state": event.state}

    def apply_register_checkpoint(self, event: ev.RegisterCheckpoint) -> dict[str, Any]:
        entry: dict[str, Any] = {"checkpoint_id": event.checkpoint_id, "checkpoint_ref": event.checkpoint_ref}
        if event.batch_ids:
            entry["batch_ids"] = list(event.batch_ids)  # what it trained on (accounting only)
        self.checkpoints[event.checkpoint_id] = entry
        return entry

    def apply_release_checkpoint(self, event: ev.ReleaseCheckpoint) -> bool:
        return self.checkpoints.pop(event.checkpoint_id, None) is not None

    # ------------------------------------------------------------------ released history

    def rewound(self, acked: Acked | None, verified: frozenset[int]) -> ev.Released | None:
        """A rewind takes released history back: the new released set the event carries.
        ``acked``: what the new state acknowledges, for the training consumer; ``verified``:
        released positions the caller checked are still readable and owns again."""
        if acked is None:
            return None
        back = self.reowned_by(acked)
        missing = [p for p in back if p not in verified]
        if missing:
            raise StorageUnavailable(
                f"accepted position {missing[0]} was released while this call checked the history; retry"
            )
        if not back:
            return None
        cursor, positions = self.released_after(acked)
        return [cursor, sorted(positions)]

    def apply_released(self, released: ev.Released | None) -> None:
        if released is not None:
            self.released_cursor, self.released_positions = int(released[0]), frozenset(released[1])

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

    def check_release_history(self, acked: Acked) -> ev.ReleaseHistory | None:
        """``collect_garbage`` stops owning what the training consumer acknowledged."""
        cursor, positions = acked
        positions = frozenset(p for p in positions if p >= cursor)
        if (cursor, positions) == (self.released_cursor, self.released_positions):
            return None
        return ev.ReleaseHistory(released=[cursor, sorted(positions)])

    def apply_release_history(self, event: ev.ReleaseHistory) -> None:
        self.apply_released(event.released)

    # ------------------------------------------------------------------ roots and accounting

    def roots(self, finished: frozenset[str], add: Callable[[tuple[Any, ...], dict[str, Any]], None]) -> None:
        """The ledger's GC roots, each handed to ``add(label, ref)``: consumer states and
        progress records, batches not finished (``finished``), retained checkpoints."""
        for consumer_id, consumer in self.consumers.items():
            if consumer.state is not None:
                for key in ("state_ref", "progress_ref"):
                    if key in consumer.state:
                        add(("consumer", consumer_id, key), consumer.state[key])
        for batch_id, batch in self.batches.items():
            if batch_id not in finished:
                for key in ("plan_ref", "ready_ref"):
                    if batch.get(key) is not None:
                        add(("batch", batch_id, key), batch[key])
        for checkpoint_id, entry in self.checkpoints.items():
            add(("checkpoint", checkpoint_id), entry["checkpoint_ref"])

    def ready(self, finished: frozenset[str]) -> dict[str, int]:
        """Totals of ready batches no finished batch or checkpoint accounts for (``usage``)."""
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
        return ready


def _check_name(value: object, what: str) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{what} must be a non-empty string, got {value!r}")


def check_cursors(state: Mapping[str, Any], commits: int) -> None:
    """Cursors name accepted positions; either may move back (a checkpoint restored)."""
    fetch, processed = state["fetch_cursor"], state["processed_cursor"]
    for name, value in (("fetch_cursor", fetch), ("processed_cursor", processed)):
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= commits:
            raise ValueError(f"{name} must be an integer in 0..{commits} (accepted results), got {value!r}")
    if processed > fetch:
        raise ValueError(f"processed_cursor {processed} is ahead of fetch_cursor {fetch}")
