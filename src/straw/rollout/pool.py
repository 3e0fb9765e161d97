"""The pool binding: one cached writer per process and configuration, readers, bounded I/O.

Every publication the rollout layer makes goes through :func:`rollout_store`, which opens
one ``SharedFilesystemStore`` per process and store key and keeps it for the life of the
process (a forked child opens its own). A writer serves one call at a time, so each cached
writer comes with a re-entrant lock that every publish holds. :func:`run_io` runs such a
blocking publish off the event loop, at most ``--rollout-io-concurrency`` at a time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

from ..backend import FilesystemBackend
from ..errors import IndeterminateCommit
from ..protocol import RecordSetRef, encode
from ..store import ReadSession, SharedFilesystemStore
from .codec import STORE_CODECS, SampleCodec
from .config import RolloutConfig, resolve_pool

__all__ = [
    "RolloutStore",
    "close_rollout_stores",
    "open_reader",
    "private_store",
    "probe_roundtrip",
    "rollout_store",
    "run_io",
    "seal_rollout_store",
    "settled",
]

T = TypeVar("T")
MIB = 1 << 20


@dataclasses.dataclass(frozen=True)
class RolloutStore:
    """A process's cached writer of one pool, a codec bound to it, and the lock publishes hold."""

    store: SharedFilesystemStore
    codec: SampleCodec
    lock: threading.RLock


_Key = tuple[int, str, str, str, int | None, bool, str]
_writers: dict[_Key, tuple[SharedFilesystemStore, Any]] = {}
_writers_lock = threading.Lock()


def _declaration(config: RolloutConfig) -> dict[str, Any] | None:
    path = config.rollout_storage_declaration
    if path is None:
        return None
    try:
        with open(os.path.expanduser(path), "rb") as handle:
            value = json.loads(handle.read())
    except (OSError, ValueError) as error:
        raise ValueError(f"Cannot read --rollout-storage-declaration {path}: {error}") from error
    if not isinstance(value, dict):
        raise ValueError(f"Cannot read --rollout-storage-declaration {path}: it is not a JSON object")
    return value


def _bound(config: RolloutConfig) -> RolloutConfig:
    if not isinstance(config, RolloutConfig):
        raise TypeError(f"expected a RolloutConfig, got {type(config).__name__}")
    template = config.load_debug_rollout_data
    if config.rollout_data_dir and not (template and template.endswith(".straw.json")):
        root = os.path.abspath(os.path.expanduser(config.rollout_data_dir))
        return (
            config if root == config.rollout_data_dir else dataclasses.replace(config, rollout_data_dir=root)
        )
    return resolve_pool(config)


def _key(config: RolloutConfig, declaration: dict[str, Any] | None) -> _Key:
    root = config.rollout_data_dir
    if root is None:  # pragma: no cover - _bound always sets it
        raise ValueError("the pool is not bound")
    return (
        os.getpid(),
        root,
        config.run_id,
        config.rollout_storage_profile,
        config.rollout_queue_segment_mib,
        bool(config.rollout_queue_online_gc),
        encode(declaration).decode() if declaration is not None else "",
    )


def rollout_store(config: RolloutConfig) -> RolloutStore:
    """This process's writer for the configuration's pool (opened on first use) and a new codec.

    A configuration without a pool, or replaying a ``.straw.json`` archive (whose pool wins
    over the flags), is bound with :func:`resolve_pool` first.
    """
    config = _bound(config)
    declaration = _declaration(config)
    key = _key(config, declaration)
    with _writers_lock:
        found = _writers.get(key)
        if found is None:
            found = _writers[key] = (_open_store(config, declaration), threading.RLock())
    store, lock = found
    return RolloutStore(store, SampleCodec(store, config=config), lock)


def _open_store(config: RolloutConfig, declaration: dict[str, Any] | None) -> SharedFilesystemStore:
    root = config.rollout_data_dir
    if root is None:  # pragma: no cover - _bound always sets it
        raise ValueError("the pool is not bound")
    backend = FilesystemBackend(root, profile=config.rollout_storage_profile, declaration=declaration)
    options: dict[str, Any] = {}
    if config.rollout_queue_segment_mib is not None:  # otherwise straw's default applies
        options["segment_target_bytes"] = config.rollout_queue_segment_mib * MIB
    return SharedFilesystemStore(
        root,
        config.run_id,
        backend=backend,
        codecs=STORE_CODECS,
        online_gc=bool(config.rollout_queue_online_gc),
        **options,
    )


def private_store(config: RolloutConfig) -> RolloutStore:
    """A writer of the configuration's pool that is not cached: the caller closes ``.store``.

    For short-lived writes in processes that do not own the cache (the storage probe's
    answers, written by a task that may share its process with other work).
    """
    config = _bound(config)
    store = _open_store(config, _declaration(config))
    return RolloutStore(store, SampleCodec(store, config=config), threading.RLock())


def settled(call: Callable[[], T]) -> T:
    """Run a publish; when its outcome is uncertain, retry the same submission once.

    A write whose sync or reply failed after its data may have become durable raises
    ``IndeterminateCommit``, and the writer refuses other submissions until that one is
    retried (docs/DURABILITY.md I5). The layer's own submission ids are often random, so
    nobody else could retry them: settling here keeps the writer usable. A second failure
    is raised to the caller, and nothing names the publication.
    """
    try:
        return call()
    except IndeterminateCommit:
        return call()


def seal_rollout_store(config: RolloutConfig) -> None:
    """Seal the cached writer of this configuration (if this process opened one), under its lock."""
    config = _bound(config)
    with _writers_lock:
        found = _writers.get(_key(config, _declaration(config)))
    if found is not None:
        store, lock = found
        with lock:
            store.seal()


def close_rollout_stores() -> None:
    """Close every cached writer of this process (tests, shutdown); the first error is raised."""
    with _writers_lock:
        mine = [(key, value) for key, value in _writers.items() if key[0] == os.getpid()]
        for key, _ in mine:
            del _writers[key]
    first: BaseException | None = None
    for _, (store, lock) in mine:
        try:
            with lock:
                store.close()
        except Exception as error:  # close the others; report the first failure
            first = first or error
    if first is not None:
        raise first


def open_reader(root: str | os.PathLike[str], run_id: str) -> ReadSession:
    """A read session of run ``run_id`` in the pool mounted at ``root`` (no writer is created).

    The caller closes it (it is a context manager).
    """
    if not isinstance(run_id, str) or not run_id:
        raise ValueError(f"run_id must be a non-empty string, got {run_id!r}")
    return ReadSession(FilesystemBackend(os.fspath(root)), run_id)


# --------------------------------------------------------------------------- bounded I/O

_semaphores: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, tuple[int, asyncio.Semaphore]] = (
    weakref.WeakKeyDictionary()
)
_semaphores_lock = threading.Lock()


def _semaphore(config: RolloutConfig, loop: asyncio.AbstractEventLoop) -> asyncio.Semaphore:
    with _semaphores_lock:
        found = _semaphores.get(loop)
        if found is None or found[0] != os.getpid():
            found = (os.getpid(), asyncio.Semaphore(config.rollout_io_concurrency))
            _semaphores[loop] = found
        return found[1]


async def run_io(config: RolloutConfig, fn: Callable[..., T], *args: Any) -> T:
    """Run a blocking call (a publish) in a worker thread, bounded per process and event loop.

    Cancellation of the caller does not abandon the call: the helper waits until the thread
    finishes (so the capacity and the input stay held until the write is durable or failed),
    then re-raises the cancellation.
    """
    loop = asyncio.get_running_loop()
    async with _semaphore(config, loop):
        future = loop.run_in_executor(None, functools.partial(fn, *args))
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            while not future.done():  # the thread cannot be stopped: wait for its outcome
                try:
                    await asyncio.shield(future)
                except asyncio.CancelledError:
                    continue
                except BaseException:  # the call failed; the cancellation is what the caller gets
                    break
            raise


def probe_roundtrip(config: RolloutConfig, marker: str) -> RecordSetRef:
    """Publish ``{"probe": marker}`` (the storage probe's marker) and return its reference."""
    if not isinstance(marker, str) or not marker:
        raise ValueError(f"marker must be a non-empty string, got {marker!r}")
    bound = rollout_store(config)
    with bound.lock:
        return bound.codec.publish({"probe": marker}, submission_id=f"probe:{marker}")
