"""Helpers of the ``straw check`` and ``straw inspect`` tests: real pools, then damage.

Tests import it by name (pytest's ``pythonpath`` puts ``tests/`` on the path).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from queue_helpers import work_one
from straw.coordinator import Coordinator
from straw.protocol import Record, RecordSetRef, TaskSpec
from straw.store import SharedFilesystemStore

RUN = "run-check"


@dataclass
class Built:
    root: Path
    store: SharedFilesystemStore
    coordinator: Coordinator
    receipts: list[object]


def build_pool(
    root: Path, *, tasks: int = 4, done: int = 2, leased: int = 1, namespace: bool = False
) -> Built:
    """A pool with a queue: ``done`` completions, ``leased`` live leases, the rest pending."""
    store = SharedFilesystemStore(root, RUN)
    coordinator = Coordinator(store, exclusive_owner="check-test", namespace=namespace, queue_id="rollout")
    ref = store.publish([Record("prompt", b"p" * 200, metadata={"i": 1})], submission_id="input-1")
    coordinator.submit_tasks("submit-1", [TaskSpec(f"t{i}", input_ref=ref) for i in range(tasks)])
    receipts = [work_one(coordinator, f"w{i}") for i in range(done)]
    for i in range(leased):
        coordinator.acquire(f"holder-{i}")
    return Built(root, store, coordinator, receipts)


def close_pool(built: Built) -> None:
    """A clean shutdown: the coordinator snapshots, the store seals its pack."""
    built.coordinator.close()
    built.store.close()


def tree_digest(root: Path) -> dict[str, str]:
    """SHA-256 of every file under ``root`` (to prove a read-only check changed no byte)."""
    out = {}
    for folder, _, names in os.walk(root):
        for name in names:
            path = os.path.join(folder, name)
            with open(path, "rb") as handle:
                out[os.path.relpath(path, root)] = hashlib.sha256(handle.read()).hexdigest()
    return out


def packs(root: Path) -> list[Path]:
    return sorted(root.glob("raw/*/*.pack"))


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([byte[0] ^ 0x40]))


def segments(root: Path, queue: str = "queue") -> list[Path]:
    return sorted((root / queue / "wal").glob("*.wal"))


def result_pool(root: Path) -> tuple[Built, RecordSetRef, str]:
    """A pool whose queue accepted a result published by a second (closed) writer.

    The result's staging is over (``release_publications``), so once the queue's owner no
    longer reaches its pack, nothing keeps it. Returns the pool, the result and its pack.
    """
    built = build_pool(root, tasks=2, done=1, leased=0)
    worker = SharedFilesystemStore(root, RUN)
    lease = built.coordinator.acquire("w-other").assignments[0].lease
    metadata = {"task_id": lease.task_id, "attempt_id": lease.attempt_id}
    ref = worker.publish([Record("out", b"r" * 300, metadata=metadata)], submission_id="result-other")
    built.coordinator.complete_task(
        lease, submission_id="sub-other", result_ref=ref, result_digest=ref.digest
    )
    worker.release_publications([ref])
    worker.close()
    return built, ref, ref.manifest.segment.path


def drop_queue_ownership(built: Built, pack: str) -> None:
    """Damage: the queue's owner stops reaching ``pack`` (a retain event without it)."""
    owner = built.coordinator._gc_owner
    with built.store._catalog.locked() as catalog:
        packs = set(catalog.state.owners[owner])
        assert pack in packs
        catalog.append([{"op": "retain", "owner": owner, "packs": sorted(packs - {pack})}])
