"""Coordinator: the durable work queue over a write-ahead journal (API.md section 7).

A thin shell around the pure state machine of ``straw._queue.machine``: each
call is checked against the state, journaled as one transaction, applied, and
answered only once its transaction is durable (group commit, docs/DURABILITY.md
J1-J5). The live coordinator holds an exclusive ``flock`` on its queue, so a
second one, in any process or on any client of a shared mount, is refused.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import os
import random
import resource
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from . import _memory as memory
from ._catalog.state import queue_owner
from ._fs import durable, lock, posix
from ._journal import frame as journal_frame
from ._journal import history_io
from ._journal.log import Journal
from ._queue import events as ev
from ._queue import history as history_files
from ._queue import validate
from ._queue.collector import collector_paused
from ._queue.ledger import TRAINING as TRAINING  # the consumer whose progress acknowledges
from ._queue.machine import (
    COMPLETED,
    LEASED,
    PENDING,
    SAVED,
    Answer,
    Planned,
    QueueState,
    history_needs,
    new_state,
    ref_key,
    state_from_dict,
    state_to_dict,
    task_from_row,
)
from ._queue.progress import Acknowledged, acknowledged, parse_progress
from .errors import (
    CorruptData,
    IndeterminateCommit,
    InvalidReference,
    QueueError,
    StorageUnavailable,
    UnsafeRecovery,
    UnsupportedSchema,
)
from .limits import (
    ADOPTIONS_PENDING_MAX,
    HISTORY_FORGET_PER_CALL,
    JOURNAL_SNAPSHOT_BYTES_MIN,
    TASK_METADATA_BYTES_MAX,
)
from .protocol import (
    AcquireResult,
    AcquireStatus,
    Assignment,
    CommitPage,
    CommitReceipt,
    Lease,
    Limits,
    Record,
    RecordSetRef,
    TaskSpec,
    as_dict,
    decode,
    digest,
    encode,
    encode_pieces,
)
from .store import Adoption, SharedFilesystemStore

__all__ = ["Coordinator"]

R = TypeVar("R")

IDENTITY_FILE = "queue.json"
LOCK_FILE = "LOCK"
QUEUE_FORMAT = "straw-queue"
QUEUE_VERSION = 1
#: Snapshots past the threshold run in a thread of their own (J5). Tests that need one order
#: of file-system calls run them in the calling thread instead.
SNAPSHOTS_IN_BACKGROUND = True


def queue_directory(root: str, queue_id: str, namespace: bool) -> str:
    """Where a queue's files live: ``queue/`` at the pool root, or ``queues/<digest>/``."""
    if namespace:
        return os.path.join(root, "queues", digest(queue_id)[:32])
    return os.path.join(root, "queue")


def _text(value: object, what: str) -> str:
    """An id argument: a non-empty string UTF-8 can encode, at most QUEUE_ID_BYTES_MAX bytes."""
    return validate.text(value, what)


def _required_ref(ref: object, what: str) -> None:
    if not isinstance(ref, RecordSetRef):
        raise TypeError(f"{what} must be a RecordSetRef, got {type(ref).__name__}")


def _accepted(receipt: Mapping[str, Any], result_ref: RecordSetRef) -> CommitReceipt:
    """A new completion's receipt: the accepted reference is the caller's own (validated)
    object, so it is not rebuilt from the receipt's dict form."""
    return CommitReceipt(
        receipt["commit_id"],
        receipt["task_id"],
        receipt["submission_id"],
        receipt["digest"],
        receipt["position"],
        result_ref,
    )


def _as_objects(updates: Iterable[object]) -> Iterable[object]:
    """Updates of ``yield_tasks`` / ``save_task_progress_many`` with ``lease`` and ``input_ref``
    as objects: callers may pass the objects or their ``dataclasses.asdict`` forms (the peer
    accepts both). Anything else is left for ``validate.updates`` to name."""
    if isinstance(updates, (str, bytes, Mapping)):
        return updates
    out: list[object] = []
    for update in updates:
        if isinstance(update, Mapping):
            item = dict(update)
            try:
                if isinstance(item.get("lease"), Mapping):
                    item["lease"] = Lease.from_dict(item["lease"])
                if isinstance(item.get("input_ref"), Mapping):
                    item["input_ref"] = RecordSetRef.from_dict(item["input_ref"])
            except (KeyError, TypeError, ValueError) as error:
                raise TypeError(f"an update's lease or input_ref dict is not one: {error!r}") from None
            update = item
        out.append(update)
    return out


@dataclass
class _Spilled:
    """A durable history file the live state has yet to take over (J5 H3)."""

    file: history_files.HistoryFile
    stop: int
    task_ids: list[str]
    #: Request ids the file holds (FORMAT.md 8.4 version 2), forgotten like the tasks.
    request_ids: list[str]
    #: ``ref_packs`` keys the snapshot pruned (no root names them), forgotten like the tasks.
    reach_keys: list[str]
    #: The copy's index runs (docs/FORMAT.md 8.5) once it wrote a new one over the files so far.
    runs: list[history_files.IndexRun] | None = None
    #: The runs this snapshot wrote (closed if it never becomes durable).
    written: list[history_files.IndexRun] = field(default_factory=list)


class _Abandoned(Exception):
    """A background snapshot given up because the coordinator is closing (not a failure)."""


@dataclass
class _Taken(Adoption):
    """What a call's references are: their adoption, and the packs each one reaches."""

    reach: dict[str, list[str] | int] = field(default_factory=dict)


class JournalView:
    """Read-only facts about a coordinator's journal: ``path`` (the segment being appended, a
    ``pathlib.Path``) and ``sequence`` (the last durable transaction's number; it grows by
    one per journaled call, a repeated request journals nothing)."""

    def __init__(self, journal: Journal) -> None:
        self._journal = journal

    @property
    def path(self) -> Path:
        return Path(self._journal.segment_path)

    @property
    def sequence(self) -> int:
        return self._journal.written_seq

    @property
    def directory(self) -> Path:
        return Path(self._journal.directory)

    def __repr__(self) -> str:
        return f"JournalView(path={str(self.path)!r}, sequence={self.sequence})"


class Coordinator:
    """The single live owner of one durable queue in a pool."""

    def __init__(
        self,
        store: SharedFilesystemStore,
        *,
        queue_id: str = "rollout",
        namespace: bool = False,
        exclusive_owner: str,
        recover: bool = False,
        limits: Limits | None = None,
        lease_seconds: float = 300,
        clock: Callable[[], float] = time.monotonic,
        abandon_lost_queue: bool = False,
    ) -> None:
        """``abandon_lost_queue=True`` (ours, docs/QUEUE.md "Lost queues") lets a new queue start
        where an earlier one lost its journal: its roots are released, never recovered."""
        started = time.perf_counter()
        if not isinstance(store, SharedFilesystemStore):
            raise TypeError(f"store must be a SharedFilesystemStore, got {type(store).__name__}")
        self.store = store
        self.queue_id = _text(queue_id, "queue_id")
        self.exclusive_owner = self._declared_owner(exclusive_owner)
        if isinstance(lease_seconds, bool) or not isinstance(lease_seconds, (int, float)):
            raise ValueError(f"lease_seconds must be a positive number, got {lease_seconds!r}")
        if not (math.isfinite(lease_seconds) and lease_seconds > 0):
            raise ValueError(f"lease_seconds must be a positive number, got {lease_seconds!r}")
        self.lease_seconds = float(lease_seconds)
        self.limits = limits if limits is not None else Limits()
        if not isinstance(self.limits, Limits):
            raise TypeError(f"limits must be a straw Limits, got {type(self.limits).__name__}")
        if not callable(clock):
            raise TypeError(f"clock must be a callable returning seconds, got {clock!r}")
        self._abandon = validate.flag(abandon_lost_queue, "abandon_lost_queue")
        self.clock = clock
        self.namespace = bool(namespace)
        self.backend = store.backend
        root = str(self.backend.root)
        self.directory = queue_directory(root, self.queue_id, self.namespace)
        self._lock = threading.Lock()
        self._ids = random.Random(secrets.randbits(256))
        self._broken: BaseException | None = None
        self._closed = False
        self._viewing_durable = False  # the state was reloaded from disk after a journal failure
        self._paused: StorageUnavailable | None = None  # set when accepted data was found missing
        self._counters = {"duplicate_completions": 0, "duplicate_requests": 0, "snapshots_failed": 0}
        self._snapshotter: threading.Thread | None = None  # the background snapshot (J5), if any
        self._snapshot_error: BaseException | None = None
        #: History files a background snapshot made durable (J5 H3), for the live state to
        #: take over: (file, accepted count it holds up to, ids of the tasks it holds).
        self._spilled: collections.deque[_Spilled] = collections.deque()
        #: What a read-back after a journal failure replaced (J3.2), whose files close() closes.
        self._replaced: list[QueueState] = []
        #: Snapshots it had not taken over then: closed by close() too.
        self._dropped: list[_Spilled] = []
        #: Longest copy of the state a snapshot took under the lock (J5.1), in seconds.
        self._copy_seconds_max = 0.0
        store._ensure_catalog()  # I20: before the queue directory exists
        try:
            durable.make_dirs(self.directory, root, self.backend.sync_dir)
            self._lock_fd = self._take_lock()
        except OSError as error:
            raise posix.storage_error(error, f"opening queue directory {self.directory}") from error
        # docs/GC.md "Queue roots": this queue's owner in the pool's catalog, and the packs it
        # is known to own (a reference into an owned pack needs no catalog write).
        self._gc_owner = queue_owner(store.run_id, os.path.relpath(self.directory, root))
        # docs/GC.md "Queue adoption": publications taken over by durable calls whose staging
        # has not yet been ended in the catalog (recorded with the next catalog write).
        self._adopted = Adoption()
        #: Adoptions of calls that became durable, handed over without taking the lock again
        #: (deque appends are atomic); merged into ``_adopted`` by the next locked catalog write.
        self._handed: collections.deque[Adoption] = collections.deque()
        try:
            owned = store._owner_packs(self._gc_owner)
            self._registered = owned is not None
            self._owned = set(owned or ())
            self._journal = Journal(
                self.backend, self.directory, journal_frame.identity_tag(store.run_id, queue_id)
            )
            self._state = self._open(recover)
            self.journal = JournalView(self._journal)
        except OSError as error:
            self._failed_open()
            raise posix.storage_error(
                error, f"opening queue {self.queue_id!r} in {self.directory}"
            ) from error
        except BaseException:
            self._failed_open()
            raise
        self.recovery_seconds = time.perf_counter() - started

    def _failed_open(self) -> None:
        """A failed open leaves what a killed process leaves (nothing more is written) and keeps
        no descriptor: the journal segment, the history files read and the queue's lock are
        let go, so a process may try again as often as it likes."""
        journal: Journal | None = getattr(self, "_journal", None)
        if journal is not None:
            journal.abandon()
        if getattr(self, "_state", None) is not None:
            self._let_go_of_history()
        lock.unlock(self._lock_fd)

    # ------------------------------------------------------------------ opening

    @staticmethod
    def _declared_owner(owner: object) -> str:
        """``exclusive_owner`` declares who guarantees a single live coordinator (a scheduler, an
        operator): any non-empty text. It is recorded, not an identity that recovery must match."""
        if not isinstance(owner, str) or not owner:
            raise UnsafeRecovery(
                f"exclusive_owner must name the external guarantee that only one coordinator of this "
                f"queue runs (non-empty text), got {owner!r}"
            )
        return _text(owner, "exclusive_owner")

    def _take_lock(self) -> int:
        path = os.path.join(self.directory, LOCK_FILE)
        fd = lock.try_lock_exclusive(path)
        if fd is None:
            holder = ""
            with contextlib.suppress(OSError):
                holder = posix.read_file(path).decode(errors="replace").strip()
            raise UnsafeRecovery(
                f"queue {self.queue_id!r} is held by a live coordinator ({holder or 'unknown holder'}); "
                "stop it first (its lock is released when it exits, then recover=True works)"
            )
        note = encode({"owner": self.exclusive_owner, "pid": os.getpid(), "host": socket.gethostname()})
        try:
            posix.truncate(fd, 0)
            posix.pwrite_all(fd, [note], 0)  # informational only: never synced, never trusted
        except OSError:
            pass
        return fd

    def _identity(self) -> dict[str, Any]:
        return {
            "format": QUEUE_FORMAT,
            "version": QUEUE_VERSION,
            "run_id": self.store.run_id,
            "queue_id": self.queue_id,
            "exclusive_owner": self.exclusive_owner,
            "limits": as_dict(self.limits),
        }

    def _open(self, recover: bool) -> QueueState:
        """J1/J4: a new queue where nothing of an earlier one exists, else recovery (I21)."""
        identity_path = os.path.join(self.directory, IDENTITY_FILE)
        has_identity = posix.exists(identity_path)
        has_journal = self._journal.exists()
        if (has_identity or has_journal) and not recover and not (self._abandon and not has_journal):
            raise UnsafeRecovery(
                f"queue {self.queue_id!r} already exists in {self.directory}; reopen it with recover=True"
            )
        limits = self._limits()
        if has_journal:
            state = self._recover(identity_path, has_identity, limits)
        else:
            self._refuse_lost(has_identity)
            state = self._create(identity_path, limits)
        self._state = state
        # J4.5: a new epoch, durable before serving, revokes every lease of the old one. It
        # records the identity too, so a lost queue.json can be checked and rewritten (I21).
        self._commit(lambda: ev.Epoch(epoch=state.epoch + 1, identity=self._identity()))
        return state

    def _refuse_lost(self, has_identity: bool) -> None:
        """I21: no journal here. A fresh queue may start only if nothing of an earlier one is left
        (its ``queue.json``, or its owner in the catalog), or with ``abandon_lost_queue=True``."""
        traces = []
        if has_identity:
            traces.append(f"{IDENTITY_FILE} of a queue whose journal (wal/, snap/) is gone")
        if self._registered:
            traces.append(f"catalog owner {self._gc_owner} (reaching {len(self._owned)} packs)")
        if not traces or self._abandon:
            return
        raise UnsafeRecovery(
            f"queue {self.queue_id!r} in {self.directory} has no journal, but an earlier queue there "
            f"left {' and '.join(traces)}: its acknowledged tasks and results would be lost. Restore "
            "the queue's files and open it with recover=True; or, to give that queue up and start a "
            'new one, pass abandon_lost_queue=True (docs/QUEUE.md "Lost queues")'
        )

    def _create(self, identity_path: str, limits: Mapping[str, int]) -> QueueState:
        """J1: segment 1, then the owner, then ``queue.json``: each one proves the one before (I21)."""
        self._journal.create_dirs(str(self.backend.root))
        self._journal.start_segment()
        # The owner exists from the start (an empty add), so a catalog that lost it is told
        # from a queue that never held a reference; abandoning an earlier queue releases its roots.
        self.store._own(self._gc_owner, set(), replace=self._abandon)
        self._registered = True
        if self._abandon:
            self._owned = set()
            durable.replace_file(
                identity_path, [encode(self._identity())], self.backend.sync_file, self.backend.sync_dir
            )
        else:
            durable.create_file(
                identity_path, [encode(self._identity())], self.backend.sync_file, self.backend.sync_dir
            )
        return new_state(self.store.run_id, self.queue_id, limits)

    def _recover(self, identity_path: str, has_identity: bool, limits: Mapping[str, int]) -> QueueState:
        """J4, I21: replay the journal; the identity must agree with ``queue.json`` and with what
        the journal recorded, and the catalog must know the queue's owner."""
        if has_identity:
            self._check_identity(identity_path, self._read_identity(identity_path))
        self._journal.create_dirs(str(self.backend.root))
        state, recorded = self._replay(limits)
        self._state = state  # (a refusal from here on lets its history files go: _failed_open)
        served = self._journal.last_seq > 0
        if recorded is not None:
            self._check_identity(identity_path, recorded, recorded=True)
        if not has_identity:
            if served and recorded is None:
                raise UnsafeRecovery(
                    f"{identity_path} is missing and the journal does not record the queue's identity "
                    "(exclusive owner, limits): restore queue.json from a copy; refusing to recover"
                )
            # Crashed before queue.json became durable (nothing served), or it was lost and the
            # journal's record of it matches this coordinator: write it again (D0).
            durable.create_file(
                identity_path, [encode(self._identity())], self.backend.sync_file, self.backend.sync_dir
            )
        if not self._registered:
            if served:
                raise UnsafeRecovery(
                    f"the pool's catalog does not know owner {self._gc_owner} of queue {self.queue_id!r}, "
                    f"whose journal holds {self._journal.last_seq} frames: the catalog lost events (a "
                    "truncated or older copy). Run `straw check` (--fix records the queue's roots "
                    "again; docs/CHECK.md); refusing to open"
                )
            self.store._own(self._gc_owner, set(), replace=False)
            self._registered = True
        self._journal.start_segment()
        return state

    def _read_identity(self, path: str) -> dict[str, Any]:
        try:
            found = decode(posix.read_file(path))
        except OSError as error:
            raise posix.storage_error(error, f"reading {path}") from error
        if not isinstance(found, dict) or found.get("format") != QUEUE_FORMAT:
            raise CorruptData(f"{path} is not a straw queue identity file")
        if found.get("version") != QUEUE_VERSION:
            raise UnsupportedSchema(f"queue format version {found.get('version')!r} is not supported")
        return found

    def _check_identity(self, path: str, found: Mapping[str, Any], *, recorded: bool = False) -> None:
        where = "its journal recorded" if recorded else f"{os.path.basename(path)} says"
        wanted = self._identity()
        for key in ("run_id", "queue_id", "limits"):
            if found.get(key) != wanted[key]:
                raise UnsafeRecovery(
                    f"queue in {self.directory} was created with {key}={found.get(key)!r} ({where}), "
                    f"this coordinator has {key}={wanted[key]!r}; refusing to recover another identity"
                )
        if found.get("exclusive_owner") != wanted["exclusive_owner"]:
            # A new declaration of who keeps this coordinator single (a restarted job, another
            # scheduler): recorded by D0, so the identity file always names the latest one.
            try:
                durable.replace_file(path, [encode(wanted)], self.backend.sync_file, self.backend.sync_dir)
            except OSError as error:
                raise posix.storage_error(error, f"recording the new exclusive_owner in {path}") from error

    def _limits(self) -> dict[str, int]:
        return {
            "max_result_bytes": self.limits.max_result_bytes,
            "max_result_tokens": self.limits.max_result_tokens,
            "metadata_bytes": self.limits.metadata_bytes,
        }

    def _replay(
        self,
        limits: Mapping[str, int],
        journal: Journal | None = None,
        upto: int | None = None,
    ) -> tuple[QueueState, dict[str, Any] | None]:
        """The state after the journal's last durable frame (or frame ``upto``, read-only from
        ``journal``), and the identity it last recorded."""
        holder: list[QueueState] = [new_state(self.store.run_id, self.queue_id, limits)]
        identity: list[dict[str, Any] | None] = [None]

        def apply(seq: int, body: bytes) -> None:
            event = ev.decode(body)
            if isinstance(event, ev.Epoch) and event.identity is not None:
                identity[0] = event.identity
            holder[0].apply(event, replaying=True)

        def load(body: bytes) -> None:
            data = decode(body)
            found = data.get("identity") if isinstance(data, dict) else None
            identity[0] = found if isinstance(found, dict) else None
            loaded = state_from_dict(data, limits, history_io.opener(self.directory))
            holder[0].history.close()
            holder[0] = loaded

        # Replay allocates many small objects: pause the cycle collector meanwhile (as
        # state_from_dict does) so recovery time stays proportional to the journal.
        try:
            with collector_paused():
                recovered = (journal or self._journal).replay(apply, load, upto=upto)
        except BaseException:
            holder[0].history.close()  # a state nobody gets keeps no descriptor
            raise
        if upto is None:
            self.truncated_tail = recovered.truncated
        return holder[0], identity[0]

    def _durable_view(self) -> None:
        """After a journal failure (lock held): views answer the durable state, not calls that were
        applied in memory but never made durable (J3.2). Read from disk once; nothing is written."""
        if self._viewing_durable:
            return
        # A background snapshot may still be pruning the files this reads (J5.5); it takes
        # no coordinator lock, so waiting for it here cannot deadlock.
        self._await_snapshot()
        reader = Journal(
            self.backend, self.directory, journal_frame.identity_tag(self.store.run_id, self.queue_id)
        )
        try:
            replaced = self._state
            self._state, _ = self._replay(self._limits(), reader, self._journal.durable_seq)
            # The replaced state keeps its files open until close(): a call still reading it
            # outside the lock must not find one that H4 deleted meanwhile (J5 H3).
            self._replaced.append(replaced)
            self._dropped.extend(self._spilled)
            self._spilled.clear()  # the state read back names the history its snapshot names
        except Exception as error:
            raise UnsafeRecovery(
                f"coordinator of queue {self.queue_id!r} stopped after {self._broken!r} and its durable "
                f"state cannot be read back ({error!r}); close it and reopen the queue with recover=True"
            ) from error
        self._viewing_durable = True

    # ------------------------------------------------------------------ the call path

    def _usable(self) -> None:
        if self._closed:
            raise UnsafeRecovery(f"coordinator of queue {self.queue_id!r} is closed")
        if self._broken is not None:
            raise UnsafeRecovery(
                f"coordinator of queue {self.queue_id!r} stopped after {self._broken!r}; "
                "close it and reopen the queue with recover=True"
            )

    def _commit(
        self,
        check: Callable[[], ev.Op[R] | Answer[R]],
        packs: set[str] | None = None,
        adopted: Adoption | None = None,
        *,
        provisional: bool = False,
    ) -> R:
        """Check, own, journal, apply under the lock; return once the transaction is durable (J2),
        or, ``provisional``, once it is written (J2.5: only ``acquire``, whose leases no restart
        keeps anyway; the next sync makes it durable).

        ``packs`` are the packs the call's references reach: they are owned by the
        queue in the catalog before the journal names them (G6), so a crash
        retains too much, never too little. ``adopted`` are the publications the
        call takes over: their staging ends only after the transaction is durable.
        """
        with self._lock:
            self._usable()
            self._take_history(HISTORY_FORGET_PER_CALL)
            self._maybe_snapshot()
            result = check()
            reply: R
            if isinstance(result, Answer):
                seq = self._journal.last_seq
                reply = result.value
                self._counters["duplicate_requests"] += 1
            else:
                self._own_before_naming(packs or set())
                if isinstance(adopted, _Taken) and adopted.reach:
                    # What each named reference reaches (GC roots), journaled with the event.
                    result = dataclasses.replace(result, reach=adopted.reach)
                seq, reply = self._journal_locked(result)
        self._wait_durable(seq, provisional=provisional and not isinstance(result, Answer))
        if adopted and not isinstance(result, Answer):
            self._handed.append(adopted)  # G6.1: durable now; the next catalog frame ends its staging
        return reply

    def _journal_locked(self, event: ev.Op[R]) -> tuple[int, R]:
        """Append one transaction and apply it (lock held): its frame's seq, and its reply."""
        body = ev.encode(event)  # an event that cannot be encoded journals nothing, breaks nothing
        try:
            seq = self._journal.append(body)
            reply = self._state.apply(event)
        except BaseException as error:
            self._broken = error
            raise
        return seq, reply

    def _wait_durable(self, seq: int, *, provisional: bool = False) -> None:
        """Wait until frame ``seq`` is durable (``provisional``: written, J2.5); a journal failure
        stops the coordinator (J3)."""
        try:
            if provisional:
                self._journal.wait_written(seq)
            else:
                self._journal.wait(seq)
        except OSError as error:
            # J3: the frame may or may not be durable. Recovery decides; retries are idempotent.
            self._broken = error
            raise IndeterminateCommit(
                f"journal write failed ({posix.storage_error(error, 'journal')}); this call may or may "
                "not have taken effect: reopen with recover=True and retry it with the same id"
            ) from error
        except BaseException as error:
            self._broken = error
            raise

    def _own_before_naming(self, packs: set[str]) -> None:
        """G6, with the lock held: the queue's owner reaches ``packs`` before the journal names
        them. Pending adoptions ride along in the same catalog frame; when there are many and
        no frame is due, they get one of their own (a failure here has journaled nothing)."""
        new = packs - self._owned
        adopted = self._take_handed()
        if new:
            self.store._own(self._gc_owner, new, replace=False, adopted=adopted)
            self._owned |= new
        elif len(adopted.items) + len(adopted.owners) >= ADOPTIONS_PENDING_MAX:
            self.store._end_staging(adopted)
        else:
            return
        self._adopted = Adoption()

    def _take_handed(self) -> Adoption:
        """The pending adoptions with those of every call handed over since (lock held)."""
        adopted, handed = self._adopted, self._handed
        while handed:
            adopted.update(handed.popleft())
        return adopted

    def _query(self, read: Callable[[], R]) -> R:
        """Answer from the state, once everything it may reflect is durable. A coordinator that
        stopped after a journal failure still answers, from its durable state (read once)."""
        with self._lock:
            if self._closed:
                self._usable()
            if self._broken is not None:
                self._durable_view()
                return read()
            value = read()
            seq = self._journal.last_seq
        self._wait_durable(seq)
        return value

    def _maybe_snapshot(self) -> None:
        """J5.1 (lock held, no file I/O): past the threshold, the state is copied and a snapshot
        of the copy starts in the background."""
        journal = self._journal
        if journal.bytes_since_snapshot < max(JOURNAL_SNAPSHOT_BYTES_MIN, journal.snapshot_bytes):
            return
        running = self._snapshotter
        if (running is not None and running.is_alive()) or journal.failed is not None:
            return
        if self._spilled:
            return  # H3 still under way: the copy would hold entries the last file holds too
        seq, chain = journal.request_switch()
        # The copy allocates one object per live task: the cycle collector is paused meanwhile
        # (as replay does), so a full collection of the whole heap never runs under the lock.
        started = time.perf_counter()
        with collector_paused():
            state = self._state.snapshot_copy()  # the state after frame seq: every frame is applied
        self._state.reach_since = set()  # H3 of this snapshot keeps what events name from here on
        self._copy_seconds_max = max(self._copy_seconds_max, time.perf_counter() - started)
        if not SNAPSHOTS_IN_BACKGROUND:
            self._snapshotter = None
            self._snapshot_job(seq, chain, state)
            return
        thread = threading.Thread(
            target=self._snapshot_in_background,
            args=(seq, chain, [state]),
            name=f"straw-snapshot-{self.queue_id}",
            daemon=True,
        )
        self._snapshotter = thread
        thread.start()

    def _snapshot_in_background(self, seq: int, chain: bytes, holder: list[QueueState]) -> None:
        """The snapshot thread: :meth:`_snapshot_job`, then, with the copy and every temporary
        of it freed, the C heap's free pages go back to the system (docs/QUEUE.md "The C
        allocator"). ``holder`` is emptied here: the thread's arguments would keep the copy."""
        self._snapshot_job(seq, chain, holder.pop())
        memory.release_free_memory()

    def _snapshot_job(self, seq: int, chain: bytes, state: QueueState) -> None:
        """J5.2-J5.5 without the coordinator's lock: calls go on while the snapshot of frame ``seq``
        is encoded from ``state`` (the copy J5.1 took) and written. Frames after ``seq`` wait
        only for the segment switch (J5.2)."""
        spilled: _Spilled | None = None
        try:
            self._journal.switch()
            if self._closed:
                raise _Abandoned  # close() writes its own snapshot, of everything
            spilled = self._spill(state, seq)
            body = self._snapshot_bytes(state)
            if self._closed:
                raise _Abandoned  # close() writes its own snapshot, of everything
            self._journal.write_snapshot_at(seq, chain, body)
            # H3: the snapshot naming the file is durable; the live state may now forget what
            # the file holds (it does so bit by bit, in later calls: _take_history).
            if spilled is not None:
                self._spilled.append(spilled)  # the live state shares the copy's file objects
                spilled = None
            self._prune_history(state.history.names())
            self._snapshot_error = None
        except _Abandoned:
            self._drop_orphan(spilled)
            return  # closing: not a failure, nothing was written since the switch
        except BaseException as error:
            self._drop_orphan(spilled)
            # Before the snapshot is durable nothing changed, and the next one is due after as
            # many journal bytes again. A failed switch stops the coordinator like a failed
            # journal write (J3): recovery continues from the files. Nobody waits for this
            # thread's answer, so the error is kept for metrics() and close().
            self._counters["snapshots_failed"] += 1
            if isinstance(error, OSError):
                error = posix.storage_error(error, f"writing a snapshot of queue {self.queue_id!r}")
            self._snapshot_error = error
            if self._journal.failed is not None and self._broken is None:
                self._broken = error

    @staticmethod
    def _drop_orphan(spilled: _Spilled | None) -> None:
        """Close a spilled history file and the runs its snapshot wrote: an orphan no durable
        snapshot names (H1; H4 of the next snapshot deletes the file), or anything spilled
        once the coordinator ends."""
        if spilled is not None:
            spilled.file.close()
            for run in spilled.written:
                run.close()

    def _snapshot_bytes(self, state: QueueState) -> bytes:
        body = state_to_dict(state)
        body["identity"] = self._identity()  # I21: what queue.json says, kept where replay finds it
        # In pieces: one C encoder call over the whole state would hold the GIL throughout,
        # stopping every caller while this background thread encodes (issue 12).
        return b"".join(encode_pieces(body))

    def _spill(self, state: QueueState, seq: int) -> _Spilled | None:
        """J5 H1-H2: what is terminal as of frame ``seq`` goes to ``hist/<seq>.hist`` (written,
        synced and named by D0), and the rebuilt ``state`` keeps only live work plus the file."""
        tasks, stop = state.spillable()
        first = state.commits.base
        requests = state.spill_requests()
        if not tasks and stop == first and not requests:
            return None
        task_rows, receipts, meta = state.spill_rows(tasks, stop)
        chunks, checksum = history_files.build(seq, first, task_rows, receipts, meta, requests)
        directory = os.path.join(self.directory, history_files.HIST_DIR)
        path = os.path.join(directory, history_files.file_name(seq))
        durable.make_dirs(directory, str(self.backend.root), self.backend.sync_dir)
        self.backend.fault("before_history_write")
        durable.replace_file(path, chunks, self.backend.sync_file, self.backend.sync_dir)
        self.backend.fault("after_history_write")
        name = os.path.basename(path)
        file = history_files.HistoryFile(
            name, history_io.FileSource(path), sum(len(c) for c in chunks), checksum
        )
        file.written(meta)  # its counts and totals, known here without reading them back
        file.load()  # here, off the lock: the first lookup of a call then reads no index
        task_ids = [t.spec.task_id for t in tasks]
        request_ids = [request_id for request_id, _ in requests]
        state.attach(file)
        state.forget_submissions(state.forget_receipts(stop))
        state.forget_tasks(task_ids)
        state.forget_requests(request_ids)
        # What no root of the copy names any more leaves ref_packs too (the live state forgets
        # the same keys at H3, keeping those an event named again since the copy).
        reach_keys = state.unneeded_reach()
        state.forget_reach(reach_keys)
        # Here, off the lock: the hashes of the files so far go to index runs on disk, which the
        # live state takes over with the file (H3), so its lookups never merge under the lock and
        # its memory holds only the runs' filters and fences, not a hash per entry.
        before = {id(run) for run in state.history.runs}
        try:
            runs = self._write_runs(state, seq)
        except BaseException:
            file.close()  # an orphan as well (H1): no snapshot will name it
            raise
        written = [run for run in runs or () if id(run) not in before]
        return _Spilled(file, stop, task_ids, request_ids, reach_keys, runs, written)

    def _write_runs(self, state: QueueState, seq: int) -> list[history_files.IndexRun] | None:
        """J5 H1 for index runs: while more than HISTORY_UNMERGED_FILES_MAX history files of the
        copy are outside its runs, the next run (docs/FORMAT.md 8.5) is written, synced and named
        by D0, absorbing the newest runs no bigger than it; None if none was due."""
        history = state.history
        written: list[history_files.IndexRun] = []
        try:
            while (plan := history.run_plan()) is not None:
                written.append(self._write_run(state, seq, plan))
        except BaseException:
            for run in written:
                run.close()  # orphans: H4 of a later snapshot deletes their files
            raise
        return list(history.runs) if written else None

    def _write_run(
        self, state: QueueState, seq: int, plan: tuple[list[history_files.IndexRun], int, int]
    ) -> history_files.IndexRun:
        """One run of :meth:`_write_runs`: written by D0, listed by the copy in place of the runs
        it absorbs."""
        history = state.history
        absorbed, start, stop = plan
        first = absorbed[0].first if absorbed else start
        covered = history.files[first:stop]
        entries = history_files.run_entries(absorbed, history.files[start:stop], start)
        chunks, checksum = history_files.build_run(
            first, covered, entries, history_files.covered_digest(covered)
        )
        del entries
        name = history_files.run_name(seq, stop)
        path = os.path.join(self.directory, history_files.HIST_DIR, name)
        self.backend.fault("before_history_write")
        durable.replace_file(path, chunks, self.backend.sync_file, self.backend.sync_dir)
        run = history_files.IndexRun(
            name, history_io.FileSource(path), sum(len(c) for c in chunks), checksum, first, stop - first
        )
        del chunks
        kept = history.runs[: len(history.runs) - len(absorbed)]
        history.runs = [*kept, run]  # the copy's list; the live state takes it over at H3
        return run

    def _prune_history(self, named: set[str]) -> None:
        """J5 H4, once the snapshot naming ``named`` is durable: history files it does not name
        (written by a snapshot that never became durable) are deleted. Failures are harmless."""
        directory = os.path.join(self.directory, history_files.HIST_DIR)
        self.backend.fault("before_history_prune")
        try:
            for name in posix.listdir(directory):
                ours = name.endswith(history_files.SUFFIX) or name.endswith(history_files.RUN_SUFFIX)
                if ours and name not in named:
                    posix.unlink_quietly(os.path.join(directory, name))
        except OSError:
            return  # the next snapshot tries again; an extra file costs only disk space

    def _take_history(self, budget: int) -> None:
        """J5 H3 (lock held): the live state takes over durable history files in order, forgetting
        at most ``budget`` entries per call, so no call waits for a whole file's worth."""
        while self._spilled and budget > 0:
            spilled = self._spilled[0]
            state = self._state
            if spilled.file not in state.history.files:
                state.attach(spilled.file)
                if spilled.runs is not None:
                    state.history.use_runs(spilled.runs)
            while budget > 0 and state.commits.base < spilled.stop:
                cut = min(spilled.stop, state.commits.base + budget)
                ids = state.forget_receipts(cut)
                state.forget_submissions(ids)
                budget -= len(ids)
            pending = (
                (spilled.task_ids, state.forget_tasks),
                (spilled.request_ids, state.forget_requests),
                (spilled.reach_keys, state.forget_reach),
            )
            for keys, forget in pending:
                if budget > 0 and keys:
                    chunk = keys[-budget:]
                    del keys[-budget:]
                    forget(chunk)
                    budget -= len(chunk)
            if state.commits.base == spilled.stop and not any(keys for keys, _ in pending):
                self._spilled.popleft()

    def _await_snapshot(self) -> BaseException | None:
        """Wait for a background snapshot to end (close, tests); the last snapshot's error, if any."""
        running = self._snapshotter
        if running is not None:
            running.join()
        return self._snapshot_error

    def _snapshot_locked(self) -> None:
        """J5 at ``close()``: persist the state so reopening replays only what follows (lock held)."""
        self._journal.wait(self._journal.last_seq)
        body = state_to_dict(self._state)
        body["identity"] = self._identity()  # I21: what queue.json says, kept where replay finds it
        self._journal.write_snapshot(encode(body))

    def _new_id(self) -> str:
        # Ids (attempts, lease tokens, commits) must be unique, not secret: whoever can read the
        # pool can read the journal. A generator seeded from the OS once per coordinator avoids a
        # getrandom system call per id, which would hand the GIL to another thread each time.
        return f"{self._ids.getrandbits(128):032x}"

    # ------------------------------------------------------------------ tasks

    def submit_tasks(
        self,
        request_id: str,
        tasks: Iterable[TaskSpec],
        *,
        producer_id: str | None = None,
        producer_state: Any = None,
    ) -> list[str]:
        """Add tasks atomically (with the producer's new state); a repeated request returns the same ids."""
        _text(request_id, "request_id")
        specs = self._check_specs(tasks)
        validate.producer(producer_id, producer_state)
        packs, adopted = self._verify_inputs(spec.input_ref for spec in specs)
        return list(
            self._commit(
                lambda: self._state.check_submit(request_id, specs, producer_id, producer_state),
                packs,
                adopted,
            )
        )

    def _check_specs(self, tasks: Iterable[TaskSpec]) -> list[TaskSpec]:
        """Task specs whose ids and metadata survive the journal (docs/QUEUE.md "Arguments")."""
        if isinstance(tasks, (str, bytes, TaskSpec)) or not isinstance(tasks, Iterable):
            raise TypeError(f"submit_tasks takes a list of TaskSpec objects, got {type(tasks).__name__}")
        specs = list(tasks)
        for spec in specs:
            if not isinstance(spec, TaskSpec):
                raise TypeError(f"submit_tasks takes TaskSpec objects, got {type(spec).__name__}")
            _text(spec.task_id, "task_id")
            if not isinstance(spec.metadata, dict):
                raise TypeError(f"task {spec.task_id!r}: metadata must be a dict")
            validate.json_value(spec.metadata, f"task {spec.task_id!r} metadata", TASK_METADATA_BYTES_MAX)
        return specs

    def producer_state(self, producer_id: str) -> Any:
        return self._query(lambda: self._state.producers.get(producer_id))

    def acquire(
        self,
        worker_id: str,
        max_tasks: int = 1,
        *,
        task_ids: Iterable[str] | None = None,
        task_prefix: str | None = None,
        control: bool = False,
    ) -> AcquireResult:
        """Lease up to ``max_tasks`` tasks in priority / scheduling-key / FIFO order (one transaction)."""
        _text(worker_id, "worker_id")
        if task_prefix is not None:
            _text(task_prefix, "task_prefix")
        ids = list(task_ids) if task_ids is not None and not isinstance(task_ids, str) else task_ids
        if self._paused is not None:
            raise StorageUnavailable(
                f"scheduling is paused after a storage failure ({self._paused}); make the pool healthy, "
                "then reopen the queue with recover=True (calls on leased work still answer)"
            )
        now = self.clock()
        reply: list[Lease] | AcquireStatus = self._commit(
            lambda: self._state.check_acquire(
                worker_id, max_tasks, ids, task_prefix, bool(control), now, self.lease_seconds, self._new_id
            ),
            provisional=True,  # J2.5: a lease is worth nothing after a restart (J4.5)
        )
        if isinstance(reply, str):
            return AcquireResult(reply)
        if not reply:
            return AcquireResult(self._query(self._state._idle_status))
        assignments = tuple(Assignment(self._state.tasks[lease.task_id].spec, lease) for lease in reply)
        return AcquireResult("acquired", assignments)

    def heartbeat(self, leases: Iterable[Lease]) -> list[str]:
        """Extend current leases: ``extended``, ``StaleAttempt`` or ``LeaseExpired`` for each.

        Heartbeats are not journaled: recovery revokes every lease, so deadlines
        never need to survive a crash (docs/DURABILITY.md J6).
        """
        items = validate.leases(leases, "heartbeat")
        with self._lock:
            self._usable()
            return self._state.heartbeat(items, self.clock(), self.lease_seconds)

    def complete_task(
        self, lease: Lease, *, submission_id: str, result_ref: RecordSetRef, result_digest: str
    ) -> CommitReceipt:
        """Accept a result for a leased attempt at the next position; retries return the original receipt."""
        _text(submission_id, "submission_id")
        if not isinstance(lease, Lease):
            raise TypeError(f"complete_task takes a Lease, got {type(lease).__name__}")
        if not isinstance(result_digest, str):
            raise TypeError(f"result_digest must be a string, got {type(result_digest).__name__}")
        with self._lock:
            self._usable()
            if not isinstance(result_ref, RecordSetRef):
                raise TypeError(f"result_ref must be a RecordSetRef, got {type(result_ref).__name__}")
            early = self._state.precheck_complete(
                lease, submission_id, result_ref, result_digest, self.clock()
            )
        if early is not None:
            self._counters["duplicate_completions"] += 1
            receipt = self._query(lambda: early.value)
        else:
            # The records must belong to this task and attempt (API.md section 5, validate);
            # this reads packs, so it runs outside the lock and the lease is checked again after.
            adopted = Adoption()
            packs = self._validate_result(lease, result_ref, adopted)
            receipt = self._commit(
                lambda: self._state.check_complete(
                    lease, submission_id, result_ref, result_digest, self.clock(), self._new_id, packs
                ),
                packs,
                adopted,
            )
            self.backend.fault("before_completion_reply")
            return _accepted(receipt, result_ref)
        self.backend.fault("before_completion_reply")
        return CommitReceipt.from_dict(receipt)

    def complete_tasks(self, completions: Iterable[Mapping[str, Any]]) -> list[CommitReceipt]:
        """Many :meth:`complete_task` calls as one transaction (ours, additive to API.md section 7).

        Each entry is a mapping of ``complete_task``'s arguments (``lease``, ``submission_id``,
        ``result_ref``, ``result_digest``; the objects or their ``asdict`` forms) and is
        checked exactly as ``complete_task`` checks it, in order. All or nothing: the first
        entry that ``complete_task`` would refuse raises that error, naming the entry, and
        nothing is accepted. Otherwise the receipts come back in entry order: accepted
        submissions answer their original receipts (a retry after a lost reply), the others
        are accepted at consecutive positions, paying one journal sync for the whole batch.
        """
        entries = validate.completions(completions)
        with self._lock:
            self._usable()
            _, early = self._state.check_complete_many(
                [(*e, ()) for e in entries], self.clock(), self._new_id, precheck=True
            )
        # The records must belong to each task and attempt (as in complete_task): this reads
        # packs, so it runs outside the lock, and every entry is checked again under it after.
        adopted = Adoption()
        reached: dict[str, set[str]] = {}
        for number, ((lease, submission_id, ref, _), (kind, _)) in enumerate(
            zip(entries, early, strict=True)
        ):
            if kind == "new" and submission_id not in reached:
                reached[submission_id] = self._validate_result(lease, ref, adopted, number)
        plans: list[Planned] = []  # set by check(), which _commit runs once under the lock

        def check() -> ev.CompleteMany | Answer[list[ev.Receipt]]:
            planned = [
                (lease, submission_id, ref, result_digest, reached.get(submission_id, ()))
                for lease, submission_id, ref, result_digest in entries
            ]
            event, found = self._state.check_complete_many(planned, self.clock(), self._new_id)
            plans.extend(found)
            return event if event is not None else Answer([])

        accepted = self._commit(check, set().union(*reached.values()), adopted)
        receipts = []
        for (_, _, ref, _), (kind, value) in zip(entries, plans, strict=True):
            if kind == "known":
                self._counters["duplicate_completions"] += 1
                receipts.append(CommitReceipt.from_dict(value))
            else:
                receipts.append(_accepted(accepted[value], ref))
        self.backend.fault("before_completion_reply")
        return receipts

    def _validate_result(
        self, lease: Lease, ref: RecordSetRef, adopted: Adoption, number: int | None = None
    ) -> set[str]:
        """The store's ownership check of a result (API.md section 5; outside the lock: it reads
        packs); the packs it reaches. ``number`` is the ``complete_tasks`` entry, which the
        errors then name; ``complete_task`` raises the store's errors as they are."""
        try:
            return self.store.validate_reach(
                ref, task_id=lease.task_id, attempt_id=lease.attempt_id, adoption=adopted
            )
        except QueueError as error:
            if isinstance(error, StorageUnavailable):
                # Item 7: a result whose data is gone is refused, and no new work is handed out
                # from here on: the pool is not healthy (recovery, a new coordinator, resumes).
                with self._lock:
                    self._paused = error
            if number is None:
                raise
            raise type(error)(f"complete_tasks entry {number}: {error}") from error

    def fail_task(self, lease: Lease, *, request_id: str, failure: str, retryable: bool = True) -> str:
        """Spend an attempt; the task is pending again, or ``failed`` when attempts run out."""
        _text(request_id, "request_id")
        validate.failure(failure, retryable)
        if not isinstance(lease, Lease):
            raise TypeError(f"fail_task takes a Lease, got {type(lease).__name__}")
        now = self.clock()
        return self._commit(lambda: self._state.check_fail(lease, request_id, failure, retryable, now))

    def release_tasks(self, leases: Iterable[Lease], *, request_id: str) -> list[str]:
        """Give leased tasks back without spending an attempt (stale leases are reported, not fatal)."""
        _text(request_id, "request_id")
        items = validate.leases(leases, "release_tasks")
        now = self.clock()
        return list(self._commit(lambda: self._state.check_release(items, request_id, now)))

    def yield_task(self, lease: Lease, *, request_id: str, input_ref: RecordSetRef | None) -> str:
        """Return a task with new input (a continuation) to the tail of its FIFO; no attempt spent."""
        return self.yield_tasks([{"lease": lease, "input_ref": input_ref}], request_id=request_id)

    def yield_tasks(self, updates: Iterable[Mapping[str, Any]], *, request_id: str) -> str:
        """All-or-nothing :meth:`yield_task` of many leases, with optional new priority, key, metadata.

        Each update's ``lease`` and ``input_ref`` may be the objects or their ``asdict`` forms.
        Answers ``"pending"`` (every task is pending again), as the API contract's peer does.
        """
        _text(request_id, "request_id")
        items = validate.updates(_as_objects(updates), "yield_tasks", validate.YIELD_KEYS, ("lease",))
        for item in items:
            if item.get("metadata") is not None:
                validate.json_value(item["metadata"], "yield metadata", TASK_METADATA_BYTES_MAX)
        packs, adopted = self._verify_inputs(u.get("input_ref") for u in items)
        now = self.clock()
        self._commit(lambda: self._state.check_yield(items, request_id, now), packs, adopted)
        return PENDING

    def save_task_progress(self, lease: Lease, *, request_id: str, input_ref: RecordSetRef) -> str:
        """Record new input for a task while keeping its lease; answers ``"saved"``."""
        return self.save_task_progress_many([{"lease": lease, "input_ref": input_ref}], request_id=request_id)

    def save_task_progress_many(self, updates: Iterable[Mapping[str, Any]], *, request_id: str) -> str:
        """All-or-nothing :meth:`save_task_progress` of many leases (objects or ``asdict`` forms)."""
        _text(request_id, "request_id")
        items = validate.updates(
            _as_objects(updates), "save_task_progress_many", validate.PROGRESS_KEYS, ("lease", "input_ref")
        )
        packs, adopted = self._verify_inputs(u.get("input_ref") for u in items)
        now = self.clock()
        self._commit(lambda: self._state.check_progress(items, request_id, now), packs, adopted)
        return SAVED

    def _verify_inputs(self, refs: Iterable[RecordSetRef | None]) -> tuple[set[str], Adoption]:
        """Verify references through the store; returns the packs they reach (to own them) and
        the publications the call takes over (docs/GC.md "Queue adoption"). What each reference
        reaches is journaled with the call (``_reach``), so collection need not read it again."""
        found: dict[str, RecordSetRef] = {}
        for ref in refs:
            if ref is not None:
                if not isinstance(ref, RecordSetRef):
                    raise TypeError(f"expected a RecordSetRef, got {type(ref).__name__}")
                found.setdefault(ref_key(as_dict(ref)), ref)
        adopted = _Taken()
        packs: set[str] = set()
        for key, ref in found.items():
            reached = self.store.reach([ref], adoption=adopted)
            packs |= reached
            adopted.reach[key] = 0 if reached == {ref.manifest.segment.path} else sorted(reached)
        return packs, adopted

    def cancel_task(self, task_id: str, *, request_id: str) -> str:
        """Cancel a pending or leased task; a finished task keeps its state (returned)."""
        _text(request_id, "request_id")
        _text(task_id, "task_id")
        return self._commit(lambda: self._state.check_cancel(task_id, request_id))

    def seal_input(self, request_id: str) -> bool:
        """No more tasks will be submitted; ``acquire`` answers ``end_of_input`` once all are done."""
        _text(request_id, "request_id")
        return self._commit(lambda: self._state.check_seal(request_id))

    def task_status(self, task_id: str) -> dict[str, Any] | None:
        def read() -> dict[str, Any] | None:
            task = self._state.find_task(task_id)  # a finished one may answer from its history file
            return task.status() if task is not None else None

        return self._query(read)

    def pending_tasks(
        self, *, task_prefix: str | None = None, min_priority: int | None = None
    ) -> list[TaskSpec]:
        return list(self._query(lambda: self._state.pending_specs(task_prefix, min_priority)))

    def lookup_submission(self, submission_id: str) -> CommitReceipt | None:
        def read() -> dict[str, Any] | None:
            position = self._state.position_of(submission_id)
            return self._state.commits[position] if position is not None else None

        found = self._query(read)
        return CommitReceipt.from_dict(found) if found is not None else None

    def read_commits(self, cursor: int = 0, limit: int = 100) -> CommitPage:
        """Accepted results from ``cursor`` (a position), at most ``limit`` of them."""
        if isinstance(cursor, bool) or not isinstance(cursor, int) or cursor < 0:
            raise ValueError(f"cursor must be a non-negative integer, got {cursor!r}")
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"limit must be a positive integer, got {limit!r}")

        def read() -> tuple[list[CommitReceipt], bool]:
            state = self._state
            page = state.commits.receipts(cursor, cursor + limit)
            released = state.ledger.first_released(cursor, cursor + len(page))
            if released is not None:
                raise InvalidReference(
                    f"accepted position {released} was acknowledged by the training consumer and "
                    "released by garbage collection; rewind the consumer (save_consumer_state with an "
                    "earlier processed_cursor) to read that history again"
                )
            return page, state.drained_input() and cursor + len(page) >= len(state.commits)

        # A page builds several objects per receipt (more when they are decoded from history
        # files): without the pause, paging through a long log runs full collections.
        with collector_paused():
            page, done = self._query(read)
        return CommitPage(tuple(page), cursor + len(page), done)

    # ------------------------------------------------------------------ reads and workers

    def outstanding_reads(self) -> tuple[Lease, ...]:
        """Leases whose holders may still be reading their task's input (expiry does not end a read)."""
        return tuple(self._query(lambda: list(self._state.reads.values())))

    def release_task_reads(self, leases: Iterable[Lease]) -> int:
        items = validate.leases(leases, "release_task_reads")
        return self._commit(lambda: self._state.check_release_reads(items))

    def retire_worker(self, worker_id: str) -> list[dict[str, Any]]:
        """Fence a stopped worker: its leases are revoked and its reads end; returns its receipts."""
        _text(worker_id, "worker_id")
        # Its receipts in history files are read before the lock (files never change once
        # written): at ten million tasks they are a thousand files, a second of reading that
        # would stop every other call. Files written meanwhile are read under it.
        history, files = self._query(lambda: (self._state.history, tuple(self._state.history.files)))
        history.read_ahead(worker_id, files)
        try:
            return list(self._commit(lambda: self._state.check_retire(worker_id)))
        finally:
            history.drop_ahead(worker_id)

    # ------------------------------------------------------------------ consumers and batches

    def open_consumer(self, consumer_id: str, *, exclusive_owner: str) -> str:
        _text(consumer_id, "consumer_id")
        _text(exclusive_owner, "exclusive_owner")
        token = self._new_id()
        return self._commit(
            lambda: self._state.ledger.check_open_consumer(consumer_id, exclusive_owner, token)
        )

    def close_consumer(self, consumer_id: str, token: str) -> bool:
        return self._commit(lambda: self._state.ledger.check_close_consumer(consumer_id, token))

    def _consumer_state(
        self,
        state_ref: RecordSetRef,
        fetch_cursor: int,
        processed_cursor: int,
        progress_ref: RecordSetRef | None,
    ) -> dict[str, Any]:
        state: dict[str, Any] = {
            "version": 1,
            "state_ref": as_dict(state_ref),
            "fetch_cursor": fetch_cursor,
            "processed_cursor": processed_cursor,
        }
        if progress_ref is not None:
            state["progress_ref"] = as_dict(progress_ref)
        return state

    def save_consumer_state(
        self,
        consumer_id: str,
        *,
        token: str,
        request_id: str,
        state_ref: RecordSetRef,
        fetch_cursor: int,
        processed_cursor: int,
        progress_ref: RecordSetRef | None = None,
    ) -> dict[str, Any]:
        _text(consumer_id, "consumer_id")
        _text(request_id, "request_id")
        _required_ref(state_ref, "state_ref")
        state = self._consumer_state(state_ref, fetch_cursor, processed_cursor, progress_ref)
        packs, adopted = self._verify_inputs([state_ref, progress_ref])
        acked, verified, history = self._rewind(self._check_progress(consumer_id, state))
        return dict(
            self._commit(
                lambda: self._state.check_save_consumer(
                    consumer_id, token, request_id, state, acked, verified
                ),
                packs | history,
                adopted,
            )
        )

    def _check_progress(self, consumer_id: str, state: Mapping[str, Any]) -> Acknowledged | None:
        """What a ``training`` state acknowledges, read once; its progress record must parse
        (GC reads it on every collection). Other consumers' states acknowledge nothing."""
        if consumer_id != TRAINING:
            return None
        try:
            return self._progress(state)
        except UnsupportedSchema as error:
            raise UnsupportedSchema(f"progress_ref of consumer {TRAINING!r}: {error}") from None

    def _rewind(
        self, progress: Acknowledged | None
    ) -> tuple[tuple[int, frozenset[int]] | None, frozenset[int], set[str]]:
        """A training state that acknowledges less than was released (a checkpoint restored)
        takes that history back: each result must still be readable (verified here, without
        the lock), and its packs are owned again before the journal names the state (G6).

        ``progress`` is what a training state acknowledges (None for other consumers).
        Returns that, the positions verified and their packs.
        """
        if progress is None or not self._query(self._state.ledger.has_released):
            return None, frozenset(), set()  # nothing was released: nothing to take back
        acked = (progress.cursor, progress.positions)
        back = self._query(lambda: self._state.ledger.reowned_by(acked))
        if not back:
            return acked, frozenset(), set()
        receipts = self._query(lambda: [(self._state.commits[p], self._state.packs_at(p)) for p in back])
        refs = [RecordSetRef.from_dict(receipt["result_ref"]) for receipt, _ in receipts]
        packs = self.store.reach(refs)  # missing -> StorageUnavailable, damaged -> CorruptData
        # Only history something still protects (a retained checkpoint owns its packs) can be
        # taken back: bytes that merely survived, unowned, may be collected at any moment (as
        # the peer decides). Checked before the journal or any owner changes.
        unowned = self.store.unowned(packs)
        if unowned:
            raise InvalidReference(
                f"cannot restore positions {sorted(back)}: their results were released and nothing "
                f"owns {sorted(unowned)[:3]} (retain a checkpoint that depends on them before acknowledging)"
            )
        for _, known in receipts:
            packs.update(known)
        return acked, frozenset(back), packs

    def load_consumer_state(self, consumer_id: str) -> dict[str, Any] | None:
        def read() -> dict[str, Any] | None:
            consumer = self._state.ledger.consumers.get(consumer_id)
            return dict(consumer.state) if consumer is not None and consumer.state is not None else None

        return self._query(read)

    def plan_batch(
        self,
        consumer_id: str,
        *,
        token: str,
        batch_id: str,
        input_positions: Sequence[int],
        plan_ref: RecordSetRef,
    ) -> dict[str, Any]:
        _text(consumer_id, "consumer_id")
        _text(batch_id, "batch_id")
        _required_ref(plan_ref, "plan_ref")
        if isinstance(input_positions, (str, bytes)) or not isinstance(input_positions, Iterable):
            raise TypeError(
                f"input_positions must be a list of positions, got {type(input_positions).__name__}"
            )
        packs, adopted = self._verify_inputs([plan_ref])
        batch = {
            "batch_id": batch_id,
            "consumer_id": consumer_id,
            "input_positions": list(input_positions),
            "plan_ref": as_dict(plan_ref),
        }
        return dict(
            self._commit(lambda: self._state.check_plan_batch(consumer_id, token, batch), packs, adopted)
        )

    def batch_ready(
        self,
        consumer_id: str,
        *,
        token: str,
        batch_id: str,
        ready_ref: RecordSetRef,
        state_ref: RecordSetRef,
        fetch_cursor: int,
        processed_cursor: int,
        progress_ref: RecordSetRef | None = None,
    ) -> dict[str, Any]:
        _text(consumer_id, "consumer_id")
        _text(batch_id, "batch_id")
        _required_ref(ready_ref, "ready_ref")
        _required_ref(state_ref, "state_ref")
        packs, adopted = self._verify_inputs([ready_ref, state_ref, progress_ref])
        state = self._consumer_state(state_ref, fetch_cursor, processed_cursor, progress_ref)
        ready = as_dict(ready_ref)
        acked, verified, history = self._rewind(self._check_progress(consumer_id, state))
        return dict(
            self._commit(
                lambda: self._state.check_batch_ready(
                    consumer_id, token, batch_id, ready, state, acked, verified
                ),
                packs | history,
                adopted,
            )
        )

    def get_batch(self, batch_id: str) -> dict[str, Any] | None:
        def read() -> dict[str, Any] | None:
            batch = self._state.ledger.batches.get(batch_id)
            return dict(batch) if batch is not None else None

        return self._query(read)

    def register_checkpoint(self, checkpoint_id: str, checkpoint_ref: RecordSetRef) -> dict[str, Any]:
        """Record a training checkpoint's reference; it is a GC root until released."""
        _text(checkpoint_id, "checkpoint_id")
        _required_ref(checkpoint_ref, "checkpoint_ref")
        packs, adopted = self._verify_inputs([checkpoint_ref])
        ref = as_dict(checkpoint_ref)
        batches = self._checkpointed_batches(checkpoint_ref)

        def check() -> ev.RegisterCheckpoint | Answer[dict[str, Any]]:
            existing = self._state.ledger.checkpoints.get(checkpoint_id)
            if existing is not None:
                if existing["checkpoint_ref"] != ref:
                    raise InvalidReference(
                        f"checkpoint {checkpoint_id!r} is registered with another reference"
                    )
                return Answer(existing)
            return ev.RegisterCheckpoint(
                checkpoint_id=checkpoint_id, checkpoint_ref=ref, batch_ids=batches or None
            )

        return dict(self._commit(check, packs, adopted))

    def _checkpointed_batches(self, ref: RecordSetRef) -> list[str]:
        """Batches a checkpoint says it trained on: a checkpoint that is one ``json.v1`` record
        ``{..., "batch_ids": [...]}`` (the layout slime writes) lists them; any other record
        names none. Their ready data no longer counts as waiting for training (``_usage``)."""
        records = list(self.store.read(ref)) if ref.records == 1 else []
        if len(records) != 1 or records[0].codec != "json.v1":
            return []
        try:
            body = decode(records[0].payload)
        except CorruptData:
            return []
        ids = body.get("batch_ids") if isinstance(body, dict) else None
        return [str(b) for b in ids] if isinstance(ids, list) else []

    def release_checkpoint(self, checkpoint_id: str) -> bool:
        _text(checkpoint_id, "checkpoint_id")

        def check() -> ev.ReleaseCheckpoint | Answer[bool]:
            if checkpoint_id not in self._state.ledger.checkpoints:
                return Answer(False)
            return ev.ReleaseCheckpoint(checkpoint_id=checkpoint_id)

        return self._commit(check)

    # ------------------------------------------------------------------ garbage collection

    def _progress(self, state: Mapping[str, Any] | None) -> Acknowledged:
        """What a new ``training`` consumer state would acknowledge (``progress.acknowledged``,
        the rule ``Ledger.acknowledged`` applies to the saved one), its record read here."""
        return acknowledged(state, self._read_progress(state.get("progress_ref") if state else None))

    def _read_progress(self, ref: Mapping[str, Any] | None) -> tuple[set[int], set[str]]:
        """The positions and batches a progress record lists (none without one; read from the store)."""
        if ref is None:
            return set(), set()
        return parse_progress(list(self.store.read(RecordSetRef.from_dict(ref))))

    def _progress_ahead(self) -> tuple[Mapping[str, Any] | None, tuple[set[int], set[str]]]:
        """The ``training`` consumer's progress record read without the lock, with the
        reference it was read by (for :meth:`_acknowledgements`)."""
        ref = self._query(lambda: self._state.ledger.progress_ref())
        return ref, self._read_progress(ref)

    def _acknowledgements(
        self, ahead: tuple[Mapping[str, Any] | None, tuple[set[int], set[str]]] | None = None
    ) -> Acknowledged:
        """What the ``training`` consumer processed (lock held: reads the current state). A
        record read ahead (:meth:`_progress_ahead`) is used while the consumer still names it."""
        ledger = self._state.ledger
        ref = ledger.progress_ref()
        progress = ahead[1] if ahead is not None and ahead[0] == ref else self._read_progress(ref)
        return ledger.acknowledged(progress)

    def _usage(self) -> dict[str, Any]:
        """The peer's accounting view (``metrics()["usage_with_reservations"]``): accepted results
        the training consumer has not processed, plus what leased tasks estimate; ready batches.

        Diagnostic only: nothing is refused by it (``Limits`` are identity fields, not quotas).
        """
        # The record is read without the lock; what it acknowledges is then judged by the ledger.
        progress = self._progress_ahead()
        # The totals of the files usage counts whole are read (once per process) off the lock.
        for file in self._query(lambda: self._state.files_counted_whole(self._acknowledgements(progress))):
            file.totals()
        return self._query(lambda: self._state.usage(self._acknowledgements(progress)))

    def collect_garbage(self) -> dict[str, Any]:
        """Own exactly this queue's roots in the catalog, then collect the pool (docs/GC.md).

        The queue pauses while its roots are computed and recorded, so no call
        can name a reference in between (G6).
        """
        # The progress record and what history files need are read before the lock, under the
        # acknowledgement of that moment; under the lock they are used only if the record is
        # still the same one and the acknowledgement then includes that one (after a rewind in
        # between, the files are read again under the lock; DURABILITY.md G6).
        progress = self._progress_ahead()
        before, files = self._query(
            lambda: (self._acknowledgements(progress), tuple(self._state.history.files))
        )
        ahead = history_needs(files, before)
        with self._lock:
            self._usable()
            acked = self._acknowledgements(progress)
            # The history the queue stops owning is journaled as released first (read_commits
            # then names it); the frame need not be durable before the catalog drops it, since
            # losing it only turns that message into a missing-file error.
            release = self._state.ledger.check_release_history((acked.cursor, acked.positions))
            seq = self._journal_locked(release)[0] if release is not None else None
            roots = self._state.roots(acked, ahead=ahead if acked.includes(before) else None)
            listed, packs = roots.refs, roots.packs
            unknown, known = self._state.known_reach(listed)  # item 12: no reads for these
            refs = [RecordSetRef.from_dict(d) for d in unknown]
            packs |= known | self.store.reach(refs)
            # Pending adoptions end with the same frame: from here on only owners keep those.
            self.store._own(self._gc_owner, packs, replace=True, adopted=self._take_handed())
            self._owned = set(packs)
            self._adopted = Adoption()
        if seq is not None:
            self._wait_durable(seq)
        result = self.store.collect_garbage()
        result["queue_roots"] = len(listed)
        result["queue_packs"] = len(packs)
        return result

    # ------------------------------------------------------------------ views and lifecycle

    @property
    def epoch(self) -> int:
        return self._state.epoch

    @property
    def tasks(self) -> dict[str, dict[str, Any]]:
        def read() -> dict[str, dict[str, Any]]:
            state = self._state
            # Every task ever submitted: the finished ones in history files too (in file order).
            found = {row[0]: task_from_row(row, state).status() for row in state.history.task_rows()}
            found.update((k, t.status()) for k, t in state.tasks.items())
            return found

        return dict(self._query(read))

    def live_tasks(self, *, task_prefix: str | None = None) -> dict[str, dict[str, Any]]:
        """Pending and leased tasks (task id -> status, as ``tasks`` gives), optionally only
        ids starting with ``task_prefix`` (ours). ``tasks`` lists every task ever submitted,
        reading terminal history from disk; this answers from live state alone, so its cost
        follows live work, not the queue's age."""
        if task_prefix is not None:
            _text(task_prefix, "task_prefix")
        prefix = task_prefix or ""

        def read() -> dict[str, dict[str, Any]]:
            state = self._state  # in submission order, as ``tasks`` lists them
            live = state.unfinished
            return {k: t.status() for k, t in state.tasks.items() if k in live and k.startswith(prefix)}

        return dict(self._query(read))

    @property
    def commits(self) -> list[dict[str, Any]]:
        return list(self._query(lambda: [dict(c) for c in self._state.commits]))

    @property
    def checkpoints(self) -> dict[str, dict[str, Any]]:
        return dict(self._query(lambda: {k: dict(v) for k, v in self._state.ledger.checkpoints.items()}))

    @property
    def consumers(self) -> dict[str, dict[str, Any]]:
        def read() -> dict[str, dict[str, Any]]:
            return {
                k: {"owner": c.owner, "open": c.open, "state": c.state}
                for k, c in self._state.ledger.consumers.items()
            }

        return dict(self._query(read))

    def metrics(self) -> dict[str, Any]:
        def read() -> dict[str, Any]:
            state = self._state
            return {
                "tasks": {k: v for k, v in state.counts.items() if v},
                "commits": len(state.commits),
                "epoch": state.epoch,
                "sealed": state.sealed,
                "draining": state.draining,
                "outstanding_reads": len(state.reads),
                "journal_bytes": self._journal.size(),
                "journal": dict(self._journal.metrics),
                "recovery_seconds": self.recovery_seconds,
                "counters": dict(self._counters),
                "snapshot_error": repr(self._snapshot_error) if self._snapshot_error else None,
                "snapshot_copy_seconds_max": self._copy_seconds_max,
            }

        out = dict(self._query(read))
        out["usage_with_reservations"] = self._usage()
        out["process_cpu_seconds"] = time.process_time()
        out["process_rss_high_water_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return out

    def drain(self) -> dict[str, int]:
        """Stop handing out tasks (``acquire`` answers ``draining``); leased work can still finish."""

        def check() -> ev.Drain | Answer[bool]:
            if self._state.draining:
                return Answer(True)
            return ev.Drain()

        self._commit(check)
        counts = self._query(lambda: dict(self._state.counts))
        return {"pending": counts[PENDING], "leased": counts[LEASED], "completed": counts[COMPLETED]}

    def snapshot(self) -> RecordSetRef:
        """Publish the current state as a ``json.v1`` record (inspection only; recovery uses the journal)."""
        body, seq = self._query(lambda: (encode(state_to_dict(self._state)), self._journal.last_seq))
        record = Record(
            "queue-state", body, codec="json.v1", metadata={"queue_id": self.queue_id, "seq": seq}
        )
        return self.store.publish([record], submission_id=f"queue-snapshot-{self.queue_id}-{self._new_id()}")

    def close(self) -> None:
        """Write a snapshot (so reopening is fast), release the queue lock. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        # A background snapshot ends before the journal closes: once the segment switch is
        # done it gives up before spilling, or after encoding its copy (J5.3): both are
        # bounded by live work.
        self._await_snapshot()
        with self._lock:
            try:
                if self._broken is None:
                    state = self._state
                    entries = (
                        len(state.tasks) + len(state.commits) + len(state.requests) + len(state.ref_packs)
                    )
                    self._take_history(entries + 1)
                if (
                    self._broken is None
                    and self._journal.failed is None
                    and self._journal.bytes_since_snapshot
                ):
                    self._snapshot_locked()
                # Adoptions whose staging is not yet ended in the catalog (they were durable).
                self.store._end_staging(self._take_handed())
                self._adopted = Adoption()
            except OSError as error:
                # The journal holds every acknowledged call whatever the snapshot's fate (J5):
                # reopening with recover=True replays it. The caller still learns why.
                self._counters["snapshots_failed"] += 1
                raise posix.storage_error(error, f"closing queue {self.queue_id!r}") from error
            finally:
                self._journal.close()
                self._let_go_of_history()
                lock.unlock(self._lock_fd)

    def _let_go_of_history(self) -> None:
        """Close the history files and runs the state holds, and those of durable snapshots it
        has not taken over yet (a later read of any of them opens it again)."""
        for state in (self._state, *self._replaced):
            state.history.close()
        for spilled in (*self._spilled, *self._dropped):
            self._drop_orphan(spilled)  # (its other runs are the state's, closed above)

    def __enter__(self) -> Coordinator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        where = f"queue_id={self.queue_id!r}, directory={self.directory!r}"
        return f"Coordinator({where}, epoch={self._state.epoch})"
