"""Read the pool's ownership catalog without changing it, and repair only its torn tail.

Mirrors ``straw._catalog.log.Catalog`` loading (snapshot, then the log's frames,
docs/DURABILITY.md G2 and G7) but reports what it finds instead of raising, and
cuts a torn tail only when asked to (``--fix``), under ``catalog/LOCK`` as
every catalog client does.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

from .._catalog.log import CATALOG_DIR, LOCK_FILE, LOG_FILE, SNAPSHOT_FILE, TAG
from .._catalog.state import CatalogState
from .._fs import durable, lock, posix
from .._journal import frame
from ..errors import CorruptData, UnsupportedSchema
from ..protocol import decode


@dataclass
class CatalogView:
    """The catalog state as far as it could be read, and what was wrong with it."""

    state: CatalogState = field(default_factory=CatalogState)
    present: bool = False
    frames: int = 0
    log_bytes: int = 0
    snapshot_bytes: int = 0
    complete: bool = True  # False when damage stopped the load (the state is partial)
    torn_at: int | None = None  # offset of a torn tail of the log
    problems: list[tuple[str, str, str, str]] = field(default_factory=list)  # code, severity, path, message


@contextlib.contextmanager
def catalog_lock(root: str, *, create: bool = False) -> Iterator[None]:
    """Hold ``catalog/LOCK`` (G1) when it exists (or ``create``); a pool without one has no catalog."""
    path = os.path.join(root, CATALOG_DIR, LOCK_FILE)
    if not create and not os.path.exists(path):
        yield
        return
    try:
        fd = lock.open_lock_file(path)
    except OSError:
        yield  # a read-only mount: read without the lock (a live appender's tail may look torn)
        return
    try:
        lock.lock_exclusive(fd)
        yield
    finally:
        with contextlib.suppress(OSError):
            lock.unlock(fd)


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as handle:
            return handle.read()
    except FileNotFoundError:
        return None


def _load_snapshot(view: CatalogView, path: str, relative: str) -> tuple[int, bytes] | None:
    """(seq, chain) after the snapshot, or None when there is none or it is unusable."""
    data = _read(path)
    if data is None:
        return None
    view.snapshot_bytes = len(data)
    try:
        header = frame.decode_segment_header(data, frame.SNAPSHOT_MAGIC)
        if header.tag != TAG:
            view.problems.append(
                ("catalog.foreign", "error", relative, f"{relative} is not this pool's catalog")
            )
            view.complete = False
            return None
        verdict = frame.classify(data, frame.SEGMENT_HEADER_BYTES, header.first_seq, header.chain_in)
        if verdict.frame is None or verdict.frame.end != len(data):
            raise CorruptData(verdict.reason)
        view.state = CatalogState.from_dict(decode(verdict.frame.body))
    except (CorruptData, UnsupportedSchema, KeyError, TypeError, ValueError) as error:
        view.problems.append(
            ("catalog.snapshot_corrupt", "error", relative, f"{relative} is damaged ({error})")
        )
        view.complete = False
        return None
    return header.first_seq, header.chain_in


def read_catalog(root: str, *, fix: bool = False) -> tuple[CatalogView, list[tuple[str, str, str, str]]]:
    """Load the catalog (under its lock when it has one); with ``fix`` cut a torn log tail.

    Returns the view and the problems that were repaired.
    """
    directory = os.path.join(root, CATALOG_DIR)
    view = CatalogView(present=os.path.isdir(directory))
    repaired: list[tuple[str, str, str, str]] = []
    if not view.present:
        return view, repaired
    with catalog_lock(root):
        _load(root, view)
        if fix and view.torn_at is not None:
            path = os.path.join(directory, LOG_FILE)
            durable.cut_tail(path, view.torn_at, posix.sync_file)
            repaired += [p for p in view.problems if p[0] == "catalog.torn_tail"]
    return view, repaired


def _load(root: str, view: CatalogView) -> None:
    log_rel = f"{CATALOG_DIR}/{LOG_FILE}"
    snap_rel = f"{CATALOG_DIR}/{SNAPSHOT_FILE}"
    after = _load_snapshot(view, os.path.join(root, snap_rel), snap_rel)
    data = _read(os.path.join(root, log_rel))
    if data is None:
        if after is not None or view.snapshot_bytes:
            view.problems.append(("catalog.missing_log", "error", log_rel, f"{log_rel} is missing"))
        return
    view.log_bytes = len(data)
    try:
        header = frame.decode_segment_header(data, frame.SEGMENT_MAGIC)
    except (CorruptData, UnsupportedSchema) as error:
        view.problems.append(("catalog.corrupt_frame", "error", log_rel, f"{log_rel}: {error}"))
        view.complete = False
        return
    if header.tag != TAG:
        view.problems.append(("catalog.foreign", "error", log_rel, f"{log_rel} is not this pool's catalog"))
        view.complete = False
        return
    skip = after[0] if after is not None else 0
    if header.first_seq > skip + 1:
        view.problems.append(
            ("catalog.gap", "error", log_rel, f"{log_rel} starts at frame {header.first_seq} after {skip}")
        )
        view.complete = False
        return
    _frames(view, data, header.first_seq - 1, header.chain_in, skip, log_rel)


def _frames(view: CatalogView, data: bytes, seq: int, chain: bytes, skip: int, log_rel: str) -> None:
    at = frame.SEGMENT_HEADER_BYTES
    while True:
        verdict = frame.classify(data, at, seq + 1, chain)
        if verdict.decision is frame.Decision.FRAME and verdict.frame is not None:
            if verdict.frame.seq > skip:
                try:
                    for event in decode(verdict.frame.body)["events"]:
                        view.state.apply(event)
                except Exception as error:
                    view.problems.append(
                        (
                            "catalog.bad_event",
                            "error",
                            log_rel,
                            f"{log_rel}: frame {verdict.frame.seq}: {error!r}",
                        )
                    )
                    view.complete = False
                    return
            seq, chain, at = verdict.frame.seq, verdict.frame.chain, verdict.frame.end
            view.frames += 1
            continue
        if verdict.decision is frame.Decision.TORN:
            view.torn_at = at
            view.problems.append(
                (
                    "catalog.torn_tail",
                    "repairable",
                    log_rel,
                    f"{log_rel}: {verdict.reason} at offset {at}, left by an appender that crashed before "
                    "its frame was acknowledged",
                )
            )
        elif verdict.decision is frame.Decision.CORRUPT:
            view.problems.append(("catalog.corrupt_frame", "error", log_rel, f"{log_rel}: {verdict.reason}"))
            view.complete = False
        break
    if seq < skip:
        view.problems.append(
            ("catalog.gap", "error", log_rel, f"{log_rel} ends at frame {seq}, before its snapshot ({skip})")
        )
