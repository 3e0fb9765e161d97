"""Rollout samples: the :class:`Sample` record, its status, and the pure helpers over groups.

A *group* is the list of samples generated for one prompt; an item of a group is a
``Sample`` or a list of ``Sample``s (one multi-turn trajectory). The helpers here decide a
group's stage (ready, partial, fresh) and its scheduling key (the oldest numeric policy
version among its tokens), which is all the queue needs to order returned work
(docs/ROLLOUT.md, "Scheduling"). Nothing here does I/O except ``Sample.to_dict``, which
loads lazy tensors so the result is self-contained.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, ClassVar

from .. import codec as straw_codec
from ..tensor import TensorRef

__all__ = [
    "INT64_MAX",
    "INT64_MIN",
    "NO_VERSION_KEY",
    "QUEUE_ATTRIBUTES",
    "REPLAY_FIELDS",
    "Sample",
    "SampleStatus",
    "group_stage",
    "iter_samples",
    "numeric_version",
    "registered_types",
    "scheduling_key",
    "staleness",
]

INT64_MAX = 2**63 - 1
INT64_MIN = -(2**63)

#: Scheduling key of a group without any numeric weight version: after every numbered policy.
NO_VERSION_KEY = INT64_MAX

#: Replay captures (R3 routes, score-centering top-k and ragged top-p). The codec always stores
#: them as typed tensor records and hands them back lazily (docs/ROLLOUT.md, "Replay fields").
REPLAY_FIELDS: tuple[str, ...] = (
    "rollout_routed_experts",
    "rollout_topk_token_ids",
    "rollout_topk_log_probs",
    "rollout_top_p_token_ids",
    "rollout_top_p_token_offsets",
    "rollout_top_p_log_probs",
)

#: Private attributes the queue layer attaches to samples in flight; the codec keeps them, archives
#: and ``.pt`` dumps drop them.
QUEUE_ATTRIBUTES: tuple[str, ...] = (
    "_queue_lease",
    "_queue_receipt",
    "_queue_source_positions",
    "_queue_generation_start",
    "_queue_prompt",
    "_queue_incarnation",
)


class SampleStatus(str, enum.Enum):
    """Where a sample's generation stands."""

    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"


# Classes whose instances the rollout codec may rebuild, by "module:qualname". Sample subclasses
# join when they are created; ``straw.rollout.codec.register_type`` adds others. The codec reads
# this table; it never imports a module because a stored document names it. Every entry is also
# registered with straw.codec, so plain ``straw.codec.load`` reads rollout documents too.
_TYPES: dict[str, type] = {}
# Reference-like classes: the field holding a RecordSetRef stored as a dependency edge, and the
# field set to the reading pool's mount path on load (straw.rollout.refs registers its four).
_EDGES: dict[type, str] = {}
_ROOTS: dict[type, str] = {}
_VERSION = [0]  # bumped on every registration, so the codec can cache its views of the tables


def _type_name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _register(cls: type, *, dependency_field: str | None = None, root_field: str | None = None) -> None:
    """Add ``cls`` to the rollout allowlist (classes defined inside functions cannot be)."""
    if "<" in cls.__qualname__:
        return  # refused with a clear error when such an object is published
    straw_codec.register(cls)
    _TYPES[_type_name(cls)] = cls
    if dependency_field is not None:
        _EDGES[cls] = dependency_field
    if root_field is not None:
        _ROOTS[cls] = root_field
    _VERSION[0] += 1


def registered_types() -> dict[str, type]:
    """The rollout allowlist: every class a rollout document may name, by ``module:qualname``."""
    return dict(_TYPES)


@dataclasses.dataclass
class Sample:
    """One generated response and what training needs of it (field names follow slime's)."""

    Status: ClassVar[type[SampleStatus]] = SampleStatus

    index: int | None = None
    group_index: int | None = None
    rollout_id: int | None = None
    prompt: str | list[dict[str, Any]] = ""
    tokens: list[int] = dataclasses.field(default_factory=list)
    response: str = ""
    response_length: int = 0
    label: Any = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    status: SampleStatus = SampleStatus.PENDING
    weight_versions: list[str] = dataclasses.field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    rollout_routed_experts: Any = None
    rollout_topk_token_ids: Any = None
    rollout_topk_log_probs: Any = None
    rollout_top_p_token_ids: Any = None
    rollout_top_p_token_offsets: Any = None
    rollout_top_p_log_probs: Any = None
    remove_sample: bool = False
    multimodal_train_inputs: Any = None
    train_metadata: Any = None
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # dataclass() builds the final class after this hook runs; registering the class object
        # now is still right, because @dataclass modifies it in place.
        _register(cls)

    def get_reward_value(self, reward_key: str | None = None) -> float:
        """The scalar reward: a number as is, or ``reward[reward_key]`` of a dict reward."""
        reward = self.reward
        if reward is None:
            raise ValueError(f"Sample {self.index} has no reward")
        if isinstance(reward, Mapping):
            if reward_key is None:
                raise KeyError(
                    f"Sample {self.index} has a dict reward (keys {sorted(map(str, reward))}); "
                    "set --reward-key to choose one"
                )
            if reward_key not in reward:
                raise KeyError(f"Sample {self.index} has no reward {reward_key!r}")
            return float(reward[reward_key])
        if isinstance(reward, bool) or not isinstance(reward, (int, float)):
            raise TypeError(f"Sample {self.index} has a reward of type {type(reward).__name__}")
        return float(reward)

    def to_dict(self) -> dict[str, Any]:
        """Every field and public attribute; ``status`` as text, lazy tensors loaded."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            out[f.name] = _materialized(getattr(self, f.name))
        names = {f.name for f in dataclasses.fields(self)}
        for name, value in vars(self).items():
            if name not in names and not name.startswith("_"):
                out[name] = _materialized(value)
        status = out.get("status")
        if isinstance(status, SampleStatus):
            out["status"] = status.value
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Sample:
        """The inverse of :meth:`to_dict`; keys that are not fields become attributes."""
        if not isinstance(data, Mapping):
            raise TypeError(f"Sample.from_dict takes a mapping, got {type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls) if f.init}
        known = {k: v for k, v in data.items() if k in names}
        if "status" in known and not isinstance(known["status"], SampleStatus):
            known["status"] = SampleStatus(known["status"])
        sample = cls(**known)
        for key, value in data.items():
            if key not in names:
                if not isinstance(key, str) or not key.isidentifier():
                    raise ValueError(f"Sample.from_dict: {key!r} is not an attribute name")
                setattr(sample, key, value)
        return sample


_register(Sample)
_register(SampleStatus)


def _materialized(value: Any) -> Any:
    """``value`` with every TensorRef inside lists, tuples and dicts loaded (a new container)."""
    if isinstance(value, TensorRef):
        return value.load()
    if type(value) is list:
        return [_materialized(item) for item in value]
    if type(value) is tuple:
        return tuple(_materialized(item) for item in value)
    if type(value) is dict:
        return {key: _materialized(item) for key, item in value.items()}
    return value


# --------------------------------------------------------------------------- groups


def iter_samples(value: Any) -> Iterator[Sample]:
    """The Samples of a Sample or of nested lists/tuples of them, depth first."""
    if isinstance(value, Sample):
        yield value
        return
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"expected a Sample or a list of Samples, got {type(value).__name__}")
    stack: list[Iterator[Any]] = [iter(value)]
    while stack:
        for item in stack[-1]:
            if isinstance(item, Sample):
                yield item
            elif isinstance(item, (list, tuple)):
                stack.append(iter(item))
                break
            else:
                raise TypeError(f"a group holds Samples or lists of Samples, got {type(item).__name__}")
        else:
            stack.pop()


def _group_samples(group: Any) -> list[Sample]:
    samples = list(iter_samples(group))
    if not samples:
        raise ValueError("A group must hold at least one Sample")
    return samples


_FINISHED = (SampleStatus.COMPLETED, SampleStatus.TRUNCATED)


def group_stage(group: Any) -> str:
    """``ready`` (all finished with a reward), else ``partial`` (some tokens generated), else ``fresh``."""
    samples = _group_samples(group)
    if all(s.status in _FINISHED and s.reward is not None for s in samples):
        return "ready"
    if any(s.response_length > 0 for s in samples):
        return "partial"
    return "fresh"


_NUMERIC = re.compile(r"-?[0-9]+")


def numeric_version(text: object) -> int | None:
    """The integer a weight version names, saturated to int64; None when it is not numeric.

    Numeric means exactly ``-?[0-9]+`` in ASCII: ``"-0"`` is 0, while ``"+5"``, ``" 7"``,
    ``"1_0"`` and non-ASCII digits are not numbers here (``int()`` would accept them).
    """
    if not isinstance(text, str) or _NUMERIC.fullmatch(text) is None:
        return None
    negative = text.startswith("-")
    digits = text.lstrip("-").lstrip("0") or "0"
    # 19 digits always fit int64's magnitude check below; longer strings saturate without int(),
    # which refuses very long digit strings (sys.int_info.str_digits_check_threshold).
    if len(digits) > 19:
        return INT64_MIN if negative else INT64_MAX
    value = -int(digits) if negative else int(digits)
    return max(INT64_MIN, min(INT64_MAX, value))


def _versions(group: Any) -> Iterable[object]:
    for sample in _group_samples(group):
        yield from sample.weight_versions


def scheduling_key(group: Any) -> int:
    """The oldest numeric weight version in the group (int64), or :data:`NO_VERSION_KEY`."""
    numbers = [n for n in map(numeric_version, _versions(group)) if n is not None]
    return min(numbers) if numbers else NO_VERSION_KEY


def staleness(group: Any, serving_version: object) -> int | None:
    """How many versions the group's oldest token lags the serving policy.

    0 when every segment was generated by the serving version itself; None when it cannot be
    told (no numeric version in the group, or a non-numeric serving version).
    """
    versions = list(_versions(group))
    if versions and all(v == serving_version for v in versions):
        return 0
    serving = numeric_version(serving_version)
    numbers = [n for n in map(numeric_version, versions) if n is not None]
    if serving is None or not numbers:
        return None
    return serving - min(numbers)
