"""Rollout references and the helpers that publish, load and account for them.

A reference is a small frozen value naming a publication in the pool (its manifest) and the
pool's mount path (``root``, a hint); it pickles in well under a KiB and loads in any process
that mounts the pool. Nested in a published value, a reference is a dependency edge of the
publication, so whatever keeps the outer value alive keeps what it names (docs/GC.md). The
four kinds: :class:`DiskPayloadRef` (any payload), :class:`RolloutGroupRef` (one accepted
group), :class:`RawRolloutRef` (one accepted raw collection), :class:`TrainBatchRef` (one
rank's view of a converted batch).
"""

from __future__ import annotations

import copy
import dataclasses
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

from ..protocol import CommitReceipt, Lease, RecordSetRef
from ..store import ReadSession, SharedFilesystemStore
from ..tensor import TensorRef, release_tensor_publications
from .codec import decode_value, register_type
from .config import RolloutConfig
from .pool import open_reader, rollout_store, settled
from .sample import QUEUE_ATTRIBUTES, Sample, iter_samples

__all__ = [
    "RELEASE_CHUNK",
    "DiskPayloadRef",
    "RawRolloutRef",
    "RolloutGroupRef",
    "TrainBatchRef",
    "discard_group",
    "group_lease",
    "inherit_queue_context",
    "load_groups",
    "materialize",
    "pack_group",
    "pack_payload",
    "record_provenance",
    "release_group_staging",
    "release_publications",
    "unpack_payload",
]

#: Staging releases are sent in chunks of this many publications (one catalog append each).
RELEASE_CHUNK = 128


class Controller(Protocol):
    """What the helpers here call on the job's queue controller (a subset of ControllerClient)."""

    def complete(self, lease: Lease, result_ref: RecordSetRef) -> CommitReceipt: ...
    def reject(self, lease: Lease, reason: str) -> Any: ...
    def record_dispositions(self, positions: Sequence[int], reason: str) -> Any: ...


# --------------------------------------------------------------------------- the types


@dataclasses.dataclass(frozen=True)
class DiskPayloadRef:
    """A published payload: its manifest, the pool's mount path, and what to take of it.

    ``path`` walks into the loaded value (an int indexes, a str takes an attribute);
    ``sample_metadata`` (one dict per sample) is merged into copies of the loaded samples.
    """

    manifest: RecordSetRef
    root: str = dataclasses.field(compare=False)
    path: tuple[int | str, ...] = dataclasses.field(default=(), kw_only=True)
    sample_metadata: tuple[dict[str, Any], ...] | None = dataclasses.field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        if not isinstance(self.manifest, RecordSetRef):
            raise TypeError(f"{type(self).__name__} holds a RecordSetRef, got {type(self.manifest).__name__}")
        if not isinstance(self.root, str):
            raise TypeError(f"{type(self).__name__}.root is a mount path, got {type(self.root).__name__}")
        if type(self.path) is not tuple:
            object.__setattr__(self, "path", tuple(self.path))
        if any(isinstance(step, bool) or not isinstance(step, (int, str)) for step in self.path):
            raise TypeError(f"{type(self).__name__}.path holds ints and strs, got {self.path!r}")
        if self.sample_metadata is not None:
            if type(self.sample_metadata) is not tuple:
                object.__setattr__(self, "sample_metadata", tuple(self.sample_metadata))
            if not all(isinstance(m, dict) for m in self.sample_metadata):
                raise TypeError(f"{type(self).__name__}.sample_metadata holds one dict per sample")

    def __repr__(self) -> str:
        where = f"{self.manifest.manifest.segment.path}#{self.manifest.manifest.ordinal}"
        return f"{type(self).__name__}({where}, digest={self.manifest.digest[:16]})"

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # Pickled as field values in declaration order (no field names), with a receipt's
        # result reference replaced by the equal manifest object, which pickle then stores
        # once: an accepted group's reference stays under a KiB.
        values = []
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, CommitReceipt) and value.result_ref == self.manifest:
                value = dataclasses.replace(value, result_ref=self.manifest)
            values.append(value)
        return (_rebuild, (type(self), tuple(values)))

    def load(
        self,
        *,
        root: str | None = None,
        selection: Mapping[Any, Sequence[int] | None] | None = None,
        reader: ReadSession | SharedFilesystemStore | None = None,
    ) -> Any:
        """Read and decode the payload (lazy replay tensors), then apply ``path`` and metadata."""
        if reader is not None:
            value = decode_value(self.manifest, reader=reader, selection=selection)
        elif root is not None:
            with open_reader(root, self.manifest.manifest.segment.run_id) as session:
                value = decode_value(self.manifest, reader=session, selection=selection)
        else:
            value = decode_value(self.manifest, root=self.root, selection=selection)
        for step in self.path:
            value = value[step] if isinstance(step, int) else getattr(value, step)
        if self.sample_metadata is not None:
            value = _with_metadata(value, self.sample_metadata)
        return value


def _rebuild(cls: type[DiskPayloadRef], values: tuple[Any, ...]) -> DiskPayloadRef:
    """Unpickle a reference from its field values (see ``DiskPayloadRef.__reduce__``)."""
    obj = object.__new__(cls)
    for field, value in zip(dataclasses.fields(cls), values, strict=True):
        object.__setattr__(obj, field.name, value)
    return obj


def _with_metadata(value: Any, metadata: tuple[dict[str, Any], ...]) -> Any:
    single = isinstance(value, Sample)
    samples = [value] if single else list(value)
    if len(samples) != len(metadata):
        raise ValueError(f"sample_metadata has {len(metadata)} entries for {len(samples)} samples")
    out = []
    for sample, extra in zip(samples, metadata, strict=True):
        if not isinstance(sample, Sample):
            raise TypeError(f"sample_metadata applies to Samples, got {type(sample).__name__}")
        copied = copy.copy(sample)
        copied.metadata = {**(sample.metadata or {}), **extra.get("metadata", {})}
        for key, item in extra.items():
            if key != "metadata":
                setattr(copied, key, item)
        out.append(copied)
    return out[0] if single else out


@dataclasses.dataclass(frozen=True)
class RolloutGroupRef(DiskPayloadRef):
    """One accepted group: its result, the first sample's index, and the accepting receipt."""

    index: int
    receipt: CommitReceipt | None = None
    source_positions: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.index, bool) or not isinstance(self.index, int):
            raise TypeError(f"RolloutGroupRef.index is the first sample's index, got {self.index!r}")
        if self.receipt is not None and not isinstance(self.receipt, CommitReceipt):
            raise TypeError("RolloutGroupRef.receipt is a CommitReceipt or None")
        if self.source_positions is not None and type(self.source_positions) is not tuple:
            object.__setattr__(self, "source_positions", tuple(self.source_positions))


@dataclasses.dataclass(frozen=True)
class RawRolloutRef(DiskPayloadRef):
    """One accepted raw collection (a rollout step's groups) and the receipt that accepted it."""

    receipt: CommitReceipt
    metrics: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.receipt, CommitReceipt):
            raise TypeError("RawRolloutRef needs the CommitReceipt that accepted it")


@dataclasses.dataclass(frozen=True)
class TrainBatchRef(DiskPayloadRef):
    """One rank's part of a converted batch: the rows ``selection`` names and its schedule."""

    batch_id: str
    rank: int
    plan_digest: str
    selection: dict[str, Any] | None = dataclasses.field(default=None, kw_only=True)
    schedule: dict[str, Any] | None = dataclasses.field(default=None, kw_only=True)

    def load(
        self,
        *,
        root: str | None = None,
        selection: Mapping[Any, Sequence[int] | None] | None = None,
        reader: ReadSession | SharedFilesystemStore | None = None,
    ) -> Any:
        """This rank's rows (its ``selection`` unless another is given), with the schedule merged in."""
        chosen = self.selection if selection is None else selection
        data = super().load(root=root, selection=chosen, reader=reader)
        if self.schedule is not None:
            if not isinstance(data, dict):
                raise TypeError("a TrainBatchRef with a schedule names a dict payload")
            data = {**data, **self.schedule}
        return data


for _cls in (DiskPayloadRef, RolloutGroupRef, RawRolloutRef, TrainBatchRef):
    register_type(_cls, dependency_field="manifest", root_field="root")


# --------------------------------------------------------------------------- payloads


def _reference(value: Any) -> RecordSetRef:
    if isinstance(value, DiskPayloadRef):
        return value.manifest
    if isinstance(value, RecordSetRef):
        return value
    raise TypeError(f"expected a DiskPayloadRef or a RecordSetRef, got {type(value).__name__}")


def pack_payload(
    value: Any,
    *,
    config: RolloutConfig,
    rollout_id: int | str,
    metadata: Mapping[str, Any] | None = None,
    submission_id: str | None = None,
) -> DiskPayloadRef:
    """Publish ``value`` and return its reference; a reference is checked and returned as is."""
    bound = rollout_store(config)
    if isinstance(value, DiskPayloadRef) and value.root:
        bound.store.validate(value.manifest)
        return value
    name = submission_id if submission_id is not None else f"payload:{rollout_id}:{uuid.uuid4().hex}"
    with bound.lock:
        manifest = settled(lambda: bound.codec.publish(value, submission_id=name, metadata=metadata))
    return DiskPayloadRef(manifest, str(bound.store.backend.root))


def unpack_payload(value: Any) -> Any:
    """Load ``value`` while it is a reference (a reference to a reference loads both)."""
    while isinstance(value, DiskPayloadRef):
        value = value.load()
    return value


def load_groups(value: Any) -> list[Any]:
    """The groups a (reference to a) list of group references names, loaded, nesting kept.

    A reference whose payload is itself a reference is followed; a group whose payload is
    itself a list of references is expanded in place. Samples of
    a :class:`RolloutGroupRef` with a receipt are marked accepted: ``_queue_receipt`` is
    the receipt (as a dict), ``_queue_lease`` is dropped, ``_queue_source_positions`` comes
    from the reference when it has them.
    """
    items = unpack_payload(value)  # a reference to a reference (an accepted manifest) unwraps too
    if not isinstance(items, (list, tuple)):
        raise TypeError(f"load_groups takes a list of groups or group references, got {type(items).__name__}")
    groups: list[Any] = []
    pending: list[Any] = list(reversed(items))
    while pending:  # bounded by the references the payloads hold (each is loaded once)
        item = pending.pop()
        if not isinstance(item, DiskPayloadRef):
            groups.append(item)
            continue
        loaded = item.load()
        if isinstance(loaded, list) and loaded and all(isinstance(x, DiskPayloadRef) for x in loaded):
            pending.extend(reversed(loaded))
            continue
        if isinstance(item, RolloutGroupRef) and item.receipt is not None:
            _mark_accepted(loaded, item)
        groups.append(loaded)
    return groups


def _mark_accepted(group: Any, ref: RolloutGroupRef) -> None:
    receipt = dataclasses.asdict(ref.receipt)  # type: ignore[arg-type]
    for sample in iter_samples(group):
        sample._queue_receipt = receipt  # type: ignore[attr-defined]
        sample.__dict__.pop("_queue_lease", None)
        if ref.source_positions is not None:
            sample._queue_source_positions = list(ref.source_positions)  # type: ignore[attr-defined]


# --------------------------------------------------------------------------- queue context


def group_lease(group: Any) -> Lease | None:
    """The lease every sample of the group carries, or None when none carries one."""
    leases = [_as_dict(getattr(sample, "_queue_lease", None)) for sample in iter_samples(group)]
    present = [lease for lease in leases if lease is not None]
    if not present:
        return None
    if len(present) != len(leases) or any(lease != present[0] for lease in present):
        raise ValueError("A queue group must preserve one task authorization across all trajectories")
    return Lease.from_dict(present[0])


def _as_dict(value: Any) -> Any:
    return dataclasses.asdict(value) if isinstance(value, (Lease, CommitReceipt)) else value


def inherit_queue_context(source: Sample, outputs: Iterable[Sample]) -> None:
    """Give samples a hook produced the queue attributes of the sample they came from.

    Lease and receipt always (an output holding a different one is refused), the other
    queue attributes where the output lacks them.
    """
    for output in outputs:
        for name in ("_queue_lease", "_queue_receipt"):
            theirs = getattr(source, name, None)
            mine = getattr(output, name, None)
            if mine is not None and _as_dict(mine) != _as_dict(theirs):
                raise ValueError("A generation hook returned a different queue task authorization")
            if theirs is not None:
                setattr(output, name, theirs)
        for name in QUEUE_ATTRIBUTES:
            if (
                name not in ("_queue_lease", "_queue_receipt")
                and hasattr(source, name)
                and not hasattr(output, name)
            ):
                setattr(output, name, copy.copy(getattr(source, name)))


def record_provenance(group: Any) -> None:
    """Append to each sample's ``queue_policy_segments`` the tokens generated in this attempt.

    A segment is ``{start, stop, incarnation, reported_versions}``: the token span, the
    controller incarnation that leased it, and the weight versions the generator reported
    for it (those of ``weight_versions`` not claimed by an earlier segment). Samples without
    a generation start (never leased through a reader) are left alone.
    """
    for sample in iter_samples(group):
        start = getattr(sample, "_queue_generation_start", None)
        if not isinstance(start, int) or isinstance(start, bool):
            continue
        stop = len(sample.tokens)
        if stop <= start:
            continue
        segments = list(getattr(sample, "queue_policy_segments", None) or [])
        if not segments and start > 0:
            segments.append({"start": 0, "stop": start, "incarnation": None, "reported_versions": None})
        claimed = sum(len(s.get("reported_versions") or ()) for s in segments)
        segments.append(
            {
                "start": start,
                "stop": stop,
                "incarnation": getattr(sample, "_queue_incarnation", None),
                "reported_versions": [str(v) for v in sample.weight_versions[claimed:]],
            }
        )
        sample.queue_policy_segments = segments  # type: ignore[attr-defined]
        sample._queue_generation_start = stop  # type: ignore[attr-defined]


def pack_group(
    group: Any, *, config: RolloutConfig, controller: Controller | None, rollout_id: int | str
) -> Any:
    """Publish a leased group as its task's result and accept it; an unleased group is returned as is."""
    lease = group_lease(group)
    if lease is None:
        return group
    if controller is None:
        raise ValueError("Queue group has a lease but no coordinator binding")
    first = next(iter_samples(group))
    if not isinstance(first.index, int):
        raise ValueError("A queue group's first sample needs an integer index")
    record_provenance(group)
    bound = rollout_store(config)
    metadata = {"task_id": lease.task_id, "attempt_id": lease.attempt_id}
    name = f"group:{lease.attempt_id}"
    # The prompt is reached from the task's input, which the queue keeps while this attempt's
    # read is outstanding, until the completion that adopts the result ends it: the result
    # needs no staging of it (the store's owned_dependencies, DURABILITY.md G6.3). If the lease
    # is lost, completion fails and the publication is never used.
    owned = _leased_prompts(group)
    with bound.lock:
        manifest = settled(
            lambda: bound.codec.publish(group, submission_id=name, metadata=metadata, owned=owned)
        )
    receipt = controller.complete(lease, manifest)
    release_publications(config, [manifest])  # the queue's accepted log holds it now
    return RolloutGroupRef(
        receipt.result_ref, str(bound.store.backend.root), index=first.index, receipt=receipt
    )


def _leased_prompts(group: Any) -> set[RecordSetRef]:
    """The original prompts (``_queue_prompt``) of a group's samples."""
    prompts = (getattr(sample, "_queue_prompt", None) for sample in iter_samples(group))
    return {prompt.manifest for prompt in prompts if isinstance(prompt, DiskPayloadRef)}


def _tensor_refs(group: Any) -> list[TensorRef]:
    found: list[TensorRef] = []
    stack: list[Any] = [vars(sample) for sample in iter_samples(group)]
    while stack:  # bounded by the group's own values
        value = stack.pop()
        if isinstance(value, TensorRef):
            if value.record_set is not None:
                found.append(value)
        elif isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, (list, tuple)):
            stack.extend(item for item in value if not isinstance(item, (int, float, str)))
    return found


def release_group_staging(group: Any, *, config: RolloutConfig) -> None:
    """End the staging of the tensor publications a group's samples reference (of this run).

    A group that will never be published (discarded, or requeued from its last durable
    input) must not keep its replay captures alive through its writer's staging.
    """
    store = rollout_store(config).store
    tensors = [t for t in _tensor_refs(group) if t.record_ref.segment.run_id == store.run_id]
    if tensors:
        release_tensor_publications(store, tensors)


def discard_group(group: Any, *, config: RolloutConfig, controller: Controller | None, reason: str) -> None:
    """Drop a group: end the staging of its tensors, then reject its task or dispose its results."""
    if not isinstance(reason, str) or not reason:
        raise ValueError("discard_group needs a non-empty reason")
    lease = group_lease(group)
    receipts = sorted(
        {
            int(receipt["position"])
            for sample in iter_samples(group)
            if isinstance(receipt := getattr(sample, "_queue_receipt", None), dict)
        }
    )
    if (lease is not None or receipts) and controller is None:
        raise ValueError("Queue group has a lease but no coordinator binding")
    release_group_staging(group, config=config)
    if lease is not None:
        controller.reject(lease, reason)  # type: ignore[union-attr]
    elif receipts:
        controller.record_dispositions(receipts, reason)  # type: ignore[union-attr]


def release_publications(config: RolloutConfig, refs: Iterable[Any]) -> None:
    """End this process's writer staging of publications a durable owner has adopted.

    Takes RecordSetRefs or rollout references (None entries are skipped); sends them in
    chunks of :data:`RELEASE_CHUNK`. The owner keeps them already, so the end rides with the
    writer's next catalog frame (``defer=True``, docs/DURABILITY.md G6.2) instead of costing
    a synced frame per call: one per published group otherwise.
    """
    manifests = [_reference(ref) for ref in refs if ref is not None]
    if not manifests:
        return
    store = rollout_store(config).store
    for start in range(0, len(manifests), RELEASE_CHUNK):
        store.release_publications(manifests[start : start + RELEASE_CHUNK], defer=True)


def materialize(value: Any) -> Any:
    """A copy of ``value`` with every TensorRef (in dicts, lists, tuples and Samples) loaded."""
    memo: dict[int, Any] = {}

    def walk(item: Any) -> Any:
        if isinstance(item, TensorRef):
            key = id(item)
            if key not in memo:
                memo[key] = item.load()
            return memo[key]
        if isinstance(item, Sample):
            copied = copy.copy(item)
            for name, field in vars(item).items():
                object.__setattr__(copied, name, walk(field))
            return copied
        if type(item) is list:
            return [walk(x) for x in item]
        if type(item) is tuple:
            return tuple(walk(x) for x in item)
        if type(item) is dict:
            return {k: walk(v) for k, v in item.items()}
        return item

    return walk(value)
