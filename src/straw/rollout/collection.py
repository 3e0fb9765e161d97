"""Finalising a rollout step's groups and accepting them as one raw collection.

``finalize_groups`` orders the kept groups by their first sample's index (a
:class:`RolloutGroupRef` carries it, so nothing is loaded), runs the sample filter when one is
configured, and publishes the list of group references as a small manifest.
``accept_raw_rollout`` turns that (or plain groups) into an accepted raw collection: one
control task per rollout step, completed with a publication naming the groups, so the
collection is a fact of the queue's accepted log (docs/ROLLOUT.md, "Runners").
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from ..protocol import CommitReceipt, Lease, RecordSetRef
from .config import RolloutConfig
from .hooks import Hooks
from .pool import rollout_store, settled
from .refs import (
    DiskPayloadRef,
    RawRolloutRef,
    RolloutGroupRef,
    group_lease,
    load_groups,
    pack_group,
    pack_payload,
    release_publications,
)
from .sample import iter_samples

__all__ = [
    "SAMPLE_FILTER_REASON",
    "CollectionController",
    "RolloutOutput",
    "accept_raw_rollout",
    "finalize_groups",
    "group_ref_from_receipt",
    "receipt_positions",
    "sort_groups",
]

#: Disposition reason of accepted groups the sample filter removed from a collection.
SAMPLE_FILTER_REASON = "rollout_sample_filter"


class CollectionController(Protocol):
    """What finalising and accepting call on the job's controller (a subset of ``ControllerClient``)."""

    def complete(self, lease: Lease, result_ref: RecordSetRef) -> CommitReceipt: ...
    def reject(self, lease: Lease, reason: str) -> Any: ...
    def record_dispositions(self, positions: Sequence[int], reason: str) -> Any: ...
    def begin_collection(self, request: str) -> Lease: ...
    def accepted(self, receipt: CommitReceipt) -> CommitReceipt: ...


@dataclasses.dataclass
class RolloutOutput:
    """A rollout step's result before acceptance.

    ``groups`` is the list of groups (or group references), or a reference to such a list;
    ``group_refs`` the index-sorted group references when ``groups`` is their manifest;
    ``on_accepted(raw_ref)`` runs once the collection is accepted.
    """

    groups: list[Any] | DiskPayloadRef
    metrics: dict[str, Any] | None = None
    group_refs: list[Any] | None = None
    on_accepted: Callable[[RawRolloutRef], Any] | None = None


def _receipt(value: Any) -> CommitReceipt:
    return value if isinstance(value, CommitReceipt) else CommitReceipt.from_dict(value)


def group_ref_from_receipt(receipt: CommitReceipt | Mapping[str, Any], root: str) -> RolloutGroupRef:
    """The reference of an accepted group known only by its receipt (recovery paths).

    The group document is decoded once (replay tensors stay lazy) to learn its first
    sample's index, which orders the collection.
    """
    receipt = _receipt(receipt)
    group = DiskPayloadRef(receipt.result_ref, root).load()
    first = next(iter_samples(group))
    if not isinstance(first.index, int):
        raise ValueError(f"The accepted group at position {receipt.position} has no integer sample index")
    return RolloutGroupRef(receipt.result_ref, root, index=first.index, receipt=receipt)


def _index(item: Any) -> tuple[int, int]:
    """Sort key of a group or group reference: its first sample's index (unindexed groups last)."""
    if isinstance(item, RolloutGroupRef):
        return (0, item.index)
    group = item.load() if isinstance(item, DiskPayloadRef) else item
    first = next(iter_samples(group), None)
    if first is None or not isinstance(first.index, int):
        return (1, 0)
    return (0, first.index)


def sort_groups(groups: Sequence[Any]) -> list[Any]:
    """Groups and group references by their first sample's index (references are not loaded)."""
    return sorted(groups, key=_index)


def receipt_positions(groups: Sequence[Any]) -> set[int]:
    """Accepted-log positions the (loaded) groups' samples carry in ``_queue_receipt``."""
    found: set[int] = set()
    for group in groups:
        for sample in iter_samples(group):
            receipt = getattr(sample, "_queue_receipt", None)
            if isinstance(receipt, CommitReceipt):
                found.add(receipt.position)
            elif isinstance(receipt, Mapping) and "position" in receipt:
                found.add(int(receipt["position"]))
    return found


def _completed(
    groups: Sequence[Any], config: RolloutConfig, controller: Any, rollout_id: int | str
) -> list[Any]:
    """The groups with every still-leased plain group completed as its task's result."""
    out = []
    for group in groups:
        if not isinstance(group, DiskPayloadRef) and group_lease(group) is not None:
            group = pack_group(group, config=config, controller=controller, rollout_id=rollout_id)
        out.append(group)
    return out


def finalize_groups(
    config: RolloutConfig,
    rollout_id: int | str,
    groups: Sequence[Any],
    *,
    hooks: Hooks | None,
    controller: CollectionController | None,
    metrics: dict[str, Any] | None = None,
) -> RolloutOutput:
    """Order the kept groups by index and publish their manifest (running the sample filter).

    Group references are ordered by ``RolloutGroupRef.index`` without loading them. With a
    ``sample_filter`` hook the groups are loaded, the hook runs once on the index-sorted list,
    the result is published once, and accepted groups it removed are recorded as disposed
    (reason :data:`SAMPLE_FILTER_REASON`) so they never hold storage.
    """
    items = sort_groups(_completed(list(groups), config, controller, rollout_id))
    sample_filter = hooks.sample_filter if hooks is not None else None
    if sample_filter is None:
        manifest = pack_payload(
            items,
            config=config,
            rollout_id=rollout_id,
            submission_id=f"groups:{rollout_id}:{uuid.uuid4().hex}",
        )
        return RolloutOutput(manifest, metrics, group_refs=items)
    loaded = load_groups(items)
    before = receipt_positions(loaded)
    sample_filter(loaded, config)
    if not isinstance(loaded, list):
        raise TypeError("The sample filter must edit the list of groups in place")
    manifest = pack_payload(
        loaded,
        config=config,
        rollout_id=rollout_id,
        submission_id=f"filtered:{rollout_id}:{uuid.uuid4().hex}",
    )
    gone = sorted(before - receipt_positions(loaded))
    if gone:
        if controller is None:
            raise ValueError("Accepted groups were filtered out, but there is no controller to record it")
        controller.record_dispositions(gone, SAMPLE_FILTER_REASON)
    return RolloutOutput(manifest, metrics)


def accept_raw_rollout(
    output: Any, *, config: RolloutConfig, controller: CollectionController, rollout_id: int | str
) -> RawRolloutRef:
    """Accept a rollout step's groups as one raw collection and return its reference.

    ``output`` is a :class:`RolloutOutput`, a finalised manifest (a :class:`DiskPayloadRef`),
    a plain list of groups, or an accepted :class:`RawRolloutRef` (checked against the
    accepted log and returned as the same object; nothing is written).
    """
    if controller is None:
        raise ValueError("accept_raw_rollout needs the job's controller")
    if isinstance(output, RawRolloutRef):
        accepted = controller.accepted(output.receipt)
        if output.manifest != output.receipt.result_ref or output.manifest != _receipt(accepted).result_ref:
            raise ValueError("Raw rollout manifest differs from its accepted receipt")
        return output
    if not isinstance(output, RolloutOutput):
        if not isinstance(output, (list, tuple, DiskPayloadRef)):
            raise TypeError(
                "accept_raw_rollout takes a RolloutOutput, a finalised reference, a list of groups "
                f"or a RawRolloutRef, got {type(output).__name__}"
            )
        output = RolloutOutput(list(output) if isinstance(output, tuple) else output)
    value: Any = output.group_refs if output.group_refs is not None else output.groups
    if isinstance(value, (list, tuple)):
        value = _completed(list(value), config, controller, rollout_id)
    lease = controller.begin_collection(str(rollout_id))
    bound = rollout_store(config)
    metadata = {"task_id": lease.task_id, "attempt_id": lease.attempt_id}
    name = f"collection:{lease.attempt_id}"
    with bound.lock:
        manifest = settled(lambda: bound.codec.publish(value, submission_id=name, metadata=metadata))
    receipt = controller.complete(lease, manifest)
    release_publications(config, [manifest])  # the accepted log holds it now
    raw = RawRolloutRef(
        receipt.result_ref, str(bound.store.backend.root), receipt=receipt, metrics=output.metrics
    )
    if output.on_accepted is not None:
        output.on_accepted(raw)
    return raw
