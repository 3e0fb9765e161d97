"""The framework's extension points: the generator protocol and the optional hooks.

A :class:`Generator` turns a group of prompt samples into generated samples; the hooks
adjust rewards, filter groups and convert samples to training data. Hooks come from the
configuration as dotted paths (``pkg.module.function``) or are passed as callables; a
hook's *identity* (its configured path, or the callable's ``module:qualname``) enters the
batch plan, so a restart with other hooks cannot silently reuse an old conversion.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from typing import Any, Protocol

from .sample import Sample, SampleStatus, _register, iter_samples

__all__ = [
    "HOOK_FLAGS",
    "DynamicFilterOutput",
    "Generator",
    "Hooks",
    "callable_identity",
    "default_dynamic_filter",
    "load_function",
]


class Generator(Protocol):
    """Generates one group under the serving weights.

    It returns as many samples as it got, with ``index`` and ``group_index`` unchanged, each
    COMPLETED, TRUNCATED or FAILED with a reward, or ABORTED with its partial tokens kept for a
    later continuation. It may also define ``abort()`` (called when admission pauses; in-flight
    calls should then return ABORTED samples soon) and ``close()``.
    """

    async def __call__(self, group: list[Sample], *, weight_version: str | None) -> list[Sample]: ...


@dataclasses.dataclass(frozen=True)
class DynamicFilterOutput:
    """A dynamic filter's verdict on one group: keep it, or drop it for ``reason``."""

    keep: bool
    reason: str | None = None


_register(DynamicFilterOutput)


def default_dynamic_filter(group: Any, config: Any = None) -> DynamicFilterOutput:
    """Keep a group unless one of its samples FAILED."""
    if any(s.status is SampleStatus.FAILED for s in iter_samples(group)):
        return DynamicFilterOutput(False, "failed")
    return DynamicFilterOutput(True)


#: Hook name -> the configuration attribute holding its dotted path (``schedule`` has no flag).
HOOK_FLAGS: dict[str, str | None] = {
    "reward_post_process": "custom_reward_post_process_path",
    "sample_filter": "rollout_sample_filter_path",
    "dynamic_filter": "dynamic_sampling_filter_path",
    "convert": "custom_convert_samples_to_train_data_path",
    "all_samples_process": "rollout_all_samples_process_path",
    "schedule": None,
}

Hook = Callable[..., Any]


def load_function(path: str) -> Hook:
    """Import ``pkg.module.attr`` (attributes may nest: ``pkg.module.Class.method``)."""
    if not isinstance(path, str) or not path.strip():
        raise ValueError(f"A hook path must be a non-empty dotted name, got {path!r}")
    text = path.strip().replace(":", ".")
    parts = text.split(".")
    if len(parts) < 2 or not all(part.isidentifier() for part in parts):
        raise ImportError(f"Cannot load hook {path!r}: expected a dotted path like pkg.module.function")
    for cut in range(len(parts) - 1, 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            found: Any = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            # A module missing *inside* an importable one is the hook's own broken import.
            if error.name is not None and not module_name.startswith(error.name):
                raise ImportError(f"Cannot load hook {path!r}: {error}") from error
            continue
        except ImportError as error:
            raise ImportError(f"Cannot load hook {path!r}: {error}") from error
        for attribute in parts[cut:]:
            try:
                found = getattr(found, attribute)
            except AttributeError:
                raise AttributeError(
                    f"Cannot load hook {path!r}: {module_name} has no attribute {attribute!r}"
                ) from None
        if not callable(found):
            raise TypeError(f"Hook {path!r} is a {type(found).__name__}, not a callable")
        return found  # type: ignore[no-any-return]
    raise ImportError(f"Cannot load hook {path!r}: no module of that path can be imported")


def callable_identity(function: object) -> str:
    """``module:qualname`` of a callable (its type's for callable objects)."""
    qualname = getattr(function, "__qualname__", None)
    module = getattr(function, "__module__", None)
    if not isinstance(qualname, str) or not isinstance(module, str):
        cls = type(function)
        module, qualname = cls.__module__, cls.__qualname__
    return f"{module}:{qualname}"


@dataclasses.dataclass
class Hooks:
    """The optional hooks; each is None (use the default) or a callable.

    - ``reward_post_process(samples, config) -> (raw_rewards, rewards)``
    - ``sample_filter(groups, config) -> None``: edits the list of groups in place
    - ``dynamic_filter(group, config) -> bool | DynamicFilterOutput``
    - ``convert(samples, config) -> dict``: replaces the whole conversion
    - ``all_samples_process(groups, config, source) -> None``: legacy, synchronous runner only
    - ``schedule(total_lengths, rollout_ids, parallel, config) -> DpSchedule``
    """

    reward_post_process: Hook | None = None
    sample_filter: Hook | None = None
    dynamic_filter: Hook | None = None
    convert: Hook | None = None
    all_samples_process: Hook | None = None
    schedule: Hook | None = None
    #: The configured dotted path of each hook loaded from the configuration.
    paths: dict[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in HOOK_FLAGS:
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise TypeError(f"Hook {name} must be callable, got {type(value).__name__}")
        unknown = sorted(set(self.paths) - set(HOOK_FLAGS))
        if unknown:
            raise ValueError(f"Unknown hook names: {', '.join(unknown)}")

    @classmethod
    def from_config(cls, config: Any, **callables: Hook | None) -> Hooks:
        """Load every configured hook path; a callable passed by keyword wins over its path."""
        unknown = sorted(set(callables) - set(HOOK_FLAGS))
        if unknown:
            raise TypeError(f"Hooks.from_config got unknown hooks: {', '.join(unknown)}")
        values: dict[str, Hook | None] = {}
        paths: dict[str, str] = {}
        for name, flag in HOOK_FLAGS.items():
            given = callables.get(name)
            if given is not None:
                values[name] = given
                continue
            path = getattr(config, flag, None) if flag is not None else None
            if path:
                values[name] = load_function(path)
                paths[name] = path
        return cls(**values, paths=paths)

    def identity(self, name: str) -> str | None:
        """The hook's identity: its configured path, else the callable's ``module:qualname``."""
        if name not in HOOK_FLAGS:
            raise KeyError(f"Unknown hook {name!r}")
        if name in self.paths:
            return self.paths[name]
        value = getattr(self, name)
        return None if value is None else callable_identity(value)

    def identities(self) -> dict[str, str | None]:
        """Every hook's identity (None where the default applies), for plan identities."""
        return {name: self.identity(name) for name in HOOK_FLAGS}

    def filter_group(self, group: Any, config: Any) -> DynamicFilterOutput:
        """Run the dynamic filter (or the default) and normalise its answer."""
        if self.dynamic_filter is None:
            return default_dynamic_filter(group, config)
        verdict = self.dynamic_filter(group, config)
        if isinstance(verdict, DynamicFilterOutput):
            return verdict
        if isinstance(verdict, bool):
            return DynamicFilterOutput(verdict)
        raise TypeError(
            f"dynamic filter {self.identity('dynamic_filter')} returned {type(verdict).__name__}; "
            "expected bool or DynamicFilterOutput"
        )
