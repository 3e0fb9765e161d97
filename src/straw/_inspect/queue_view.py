"""A queue rebuilt read-only from its snapshot and journal, beside a live coordinator or not.

The state is the pure machine's (``straw._queue.machine``): replaying durable
frames gives exactly the state the coordinator had after the last of them
(I10). Nothing here takes the queue's lock.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from .._catalog.state import queue_owner
from .._fs import posix
from .._journal import frame as journal_frame
from .._journal import history_io, scan
from .._queue import events
from .._queue.history import HistoryFile, IndexRun
from .._queue.machine import LEASED, QueueState, new_state, state_from_dict
from ..coordinator import IDENTITY_FILE, QUEUE_FORMAT, QUEUE_VERSION
from ..errors import QueueError
from ..protocol import decode
from .journal_scan import JournalScan, scan_journal

_LIMIT_KEYS = ("max_result_bytes", "max_result_tokens", "metadata_bytes")
#: Reads of a journal that a live coordinator keeps replacing files of, before giving up.
JOURNAL_READS_MAX = 5


@dataclass
class QueueView:
    """One queue directory: identity, journal scan, replayed state and problems."""

    directory: str  # pool-relative
    identity: dict[str, Any] | None = None
    journal: JournalScan = field(default_factory=JournalScan)
    state: QueueState | None = None
    granted: dict[tuple[str, str], tuple[int, float]] = field(default_factory=dict)  # -> (seq, deadline)
    newest_deadline: float | None = None
    problems: list[tuple[str, str, str, str]] = field(default_factory=list)
    unidentified: bool = False  # a journal (even one of no frames) without queue.json: no owner name

    @property
    def run_id(self) -> str | None:
        return self.identity.get("run_id") if self.identity else None

    @property
    def queue_id(self) -> str | None:
        return self.identity.get("queue_id") if self.identity else None

    def owner(self) -> str | None:
        """The queue's owner in the catalog (docs/GC.md "Queue roots"), as the coordinator names it."""
        if self.run_id is None:
            return None
        return queue_owner(self.run_id, self.directory)


def _identity(root: str, view: QueueView) -> None:
    relative = f"{view.directory}/{IDENTITY_FILE}"
    try:
        found = decode(posix.read_file(os.path.join(root, relative)))
    except FileNotFoundError:
        if scan.listing(os.path.join(root, view.directory, scan.SNAP_DIR), ".snap") or _frames_in_wal(
            root, view.directory
        ):
            view.problems.append(
                (
                    "queue.identity",
                    "error",
                    relative,
                    f"{relative} is missing but the queue's journal holds frames (queue.json was lost): "
                    "recovery checks the coordinator against the identity the journal recorded and "
                    "writes it again; restore it from a copy if the journal recorded none",
                )
            )
            view.unidentified = True
            return
        view.problems.append(
            (
                "queue.no_identity",
                "info",
                relative,
                f"{relative} is missing (a queue that never served a call)",
            )
        )
        # J1: segment 1 exists before the owner is recorded, and queue.json only after it. A
        # coordinator that died in between left this directory's owner in the catalog, under a
        # name check cannot compute without queue.json (recovery writes queue.json again).
        if scan.listing(os.path.join(root, view.directory, scan.WAL_DIR), ".wal"):
            view.unidentified = True
        return
    except Exception as error:
        view.problems.append(("queue.identity", "error", relative, f"{relative} cannot be read ({error})"))
        return
    if (
        not isinstance(found, dict)
        or found.get("format") != QUEUE_FORMAT
        or found.get("version") != QUEUE_VERSION
        or not isinstance(found.get("run_id"), str)
        or not isinstance(found.get("queue_id"), str)
    ):
        view.problems.append(
            ("queue.identity", "error", relative, f"{relative} is not a straw queue identity")
        )
        return
    view.identity = found


def load_queue(root: str, directory: str) -> QueueView:
    """Read one queue directory (``queue`` or ``queues/<digest>``) without taking its lock."""
    view = QueueView(directory)
    _identity(root, view)
    if view.identity is None:
        return view
    tag = journal_frame.identity_tag(view.identity["run_id"], view.identity["queue_id"])
    for attempt in range(JOURNAL_READS_MAX):
        try:
            view.journal = scan_journal(root, directory, tag)
            break
        except FileNotFoundError:
            # A live coordinator replaced a segment or snapshot between the listing and the
            # read (J5.5): read the journal again from its new listing.
            if attempt == JOURNAL_READS_MAX - 1:
                raise
    view.problems += view.journal.problems
    if view.journal.empty:
        relative = f"{directory}/{IDENTITY_FILE}"
        view.problems.append(
            (
                "journal.missing",
                "error",
                relative,
                f"{relative} exists but the queue has no journal segment or snapshot: its journal was "
                "lost (a queue writes segment 1 before queue.json); recovery refuses it",
            )
        )
        return view
    _replay(view, root)
    return view


def _frames_in_wal(root: str, directory: str) -> bool:
    """Whether any journal segment of the queue holds more than its header and zeros."""
    for _, path in scan.listing(os.path.join(root, directory, scan.WAL_DIR), ".wal"):
        try:
            data = posix.read_file(path)
        except FileNotFoundError:
            continue
        if not journal_frame.all_zero(data[journal_frame.SEGMENT_HEADER_BYTES :]):
            return True
    return False


def _replay(view: QueueView, root: str) -> None:
    identity = view.identity or {}
    raw = identity.get("limits")
    limits = {k: raw[k] for k in _LIMIT_KEYS if isinstance(raw, dict) and k in raw}
    if len(limits) != len(_LIMIT_KEYS):
        limits = {
            "max_result_bytes": 4 * 1024**3,
            "max_result_tokens": 100_000_000,
            "metadata_bytes": 256 * 1024,
        }
    seq = view.journal.snapshot_seq
    recorded: Any = None
    try:
        state = new_state(identity["run_id"], identity["queue_id"], limits)
        if view.journal.snapshot is not None:
            data = decode(view.journal.snapshot)
            recorded = data.get("identity") if isinstance(data, dict) else None
            state = state_from_dict(data, limits, history_io.opener(os.path.join(root, view.directory)))
        for seq, body in view.journal.frames:
            event = events.decode(body)
            state.apply(event, replaying=True)
            if isinstance(event, events.Epoch) and event.identity is not None:
                recorded = event.identity
            if isinstance(event, events.Acquire):
                for task_id, attempt_id, _ in event.grants:
                    view.granted[(task_id, attempt_id)] = (seq, float(event.deadline))
                view.newest_deadline = float(event.deadline)
    except Exception as error:
        view.problems.append(
            (
                "queue.replay",
                "error",
                view.directory,
                f"journal frame {seq} of {view.directory} cannot be replayed ({error!r})",
            )
        )
        return
    view.state = state
    _check_history(view, state, root)
    _compare_identity(view, recorded)


def _check_history(view: QueueView, state: QueueState, root: str) -> None:
    """Every history file and index run the snapshot names, read whole: a damaged row or page
    fails here, not later."""
    named: list[HistoryFile | IndexRun] = [*state.history.files, *state.history.runs]
    for file in named:
        try:
            file.verify()
        except QueueError as error:
            view.problems.append(("queue.history", "error", os.path.relpath(file.path, root), str(error)))


def _compare_identity(view: QueueView, recorded: Any) -> None:
    """I21: queue.json must say what the journal last recorded (recovery refuses otherwise)."""
    identity = view.identity or {}
    if not isinstance(recorded, dict):
        return
    differ = [
        k for k in ("run_id", "queue_id", "exclusive_owner", "limits") if identity.get(k) != recorded.get(k)
    ]
    if differ:
        relative = f"{view.directory}/{IDENTITY_FILE}"
        view.problems.append(
            (
                "queue.identity",
                "error",
                relative,
                f"{relative} disagrees with the identity the queue's journal recorded ({', '.join(differ)}): "
                "it was changed or damaged; recovery refuses it",
            )
        )


def describe(view: QueueView) -> dict[str, Any]:
    """What ``straw inspect`` shows of one queue (JSON-ready)."""
    out: dict[str, Any] = {
        "directory": view.directory,
        "queue_id": view.queue_id,
        "run_id": view.run_id,
        "owner": view.owner(),
        "journal": {
            "bytes": view.journal.bytes,
            "segments": view.journal.segments,
            "last_seq": view.journal.last_seq,
            "last_snapshot_seq": view.journal.snapshot_seq or None,
            "tail": view.journal.tail.kind if view.journal.tail else "clean",
        },
    }
    state = view.state
    if state is None:
        out["state"] = None
        return out
    out.update(
        epoch=state.epoch,
        sealed=state.sealed,
        draining=state.draining,
        tasks={k: v for k, v in state.counts.items() if v},
        leases=_leases(view, state),
        commits=len(state.commits),
        outstanding_reads=len(state.reads),
        consumers=_consumers(state),
        checkpoints=sorted(state.ledger.checkpoints),
        last_checkpoint=next(reversed(state.ledger.checkpoints), None),
    )
    return out


def _leases(view: QueueView, state: QueueState) -> list[dict[str, Any]]:
    """Leases with holder and age: seconds between the grant and the newest grant recorded in the
    journal (both on the coordinator's clock, A9), and journal frames since the grant."""
    out = []
    for task in state.tasks.values():
        if task.state != LEASED or task.lease is None:
            continue
        lease = task.lease
        seq, _ = view.granted.get((lease.task_id, lease.attempt_id), (None, task.deadline))
        age = view.newest_deadline - task.deadline if view.newest_deadline is not None else None
        out.append(
            {
                "task_id": lease.task_id,
                "attempt_id": lease.attempt_id,
                "worker_id": lease.worker_id,
                "epoch": lease.coordinator_epoch,
                "deadline": task.deadline,
                "age_seconds": round(age, 3) if age is not None and seq is not None else None,
                "frames_since_grant": view.journal.last_seq - seq if seq is not None else None,
            }
        )
    return out


def _consumers(state: QueueState) -> dict[str, dict[str, Any]]:
    out = {}
    for name, consumer in state.ledger.consumers.items():
        cursors = {}
        if consumer.state is not None:
            cursors = {k: v for k, v in consumer.state.items() if k.endswith("cursor")}
        out[name] = {"owner": consumer.owner, "open": consumer.open, "cursors": cursors}
    return out


def progress_ref(view: QueueView) -> dict[str, Any] | None:
    """The ``training`` consumer's progress record reference, if it saved one."""
    return view.state.ledger.progress_ref() if view.state is not None else None


def labelled_roots(
    view: QueueView, progress: tuple[set[int], set[str]]
) -> tuple[list[dict[str, Any]], set[str], dict[str, list[str]], dict[str, list[str]]]:
    """The queue's GC roots exactly as the coordinator computes them (``QueueState.roots`` with
    what ``Ledger.acknowledged`` makes of the training consumer's progress record, read by the
    caller as ``progress``): references to resolve and packs already known, then the names of
    what needs each one, by reference (``ref_key``) and by pack, from the same computation."""
    state = view.state
    if state is None:
        return [], set(), {}, {}
    roots = state.roots(state.ledger.acknowledged(progress), labels=True)
    by_ref: dict[str, list[str]] = {}
    for label, ref in zip(roots.ref_labels or (), roots.refs, strict=True):
        by_ref.setdefault(ref_key(ref), []).append(state.describe_root(label))
    by_pack = {
        pack: [state.describe_root(label) for label in labels]
        for pack, labels in (roots.pack_labels or {}).items()
    }
    return roots.refs, roots.packs, by_ref, by_pack


def ref_key(ref: Any) -> str:
    """A reference's identity for matching: its manifest's pack, offset and ordinal (or its record's)."""
    if not isinstance(ref, dict):
        return repr(ref)
    manifest = ref.get("manifest", ref)
    segment = manifest.get("segment", {}) if isinstance(manifest, dict) else {}
    if not isinstance(segment, dict):
        return repr(ref)
    return f"{segment.get('path')}@{segment.get('offset')}#{manifest.get('ordinal', ref.get('index'))}"
