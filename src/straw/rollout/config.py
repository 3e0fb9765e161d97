"""The rollout layer's configuration: one dataclass, its command-line flags and their checks.

``add_arguments`` registers the flags (slime's names where slime has them) on a framework's
parser; ``RolloutConfig.from_args`` reads them back from any namespace, with defaults for the
attributes it lacks; ``validate`` checks them without touching the disk; ``resolve_pool``
binds the pool (docs/ROLLOUT.md, "Configuration" and "The pool").
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import string
from collections.abc import Collection, Mapping, Sequence
from typing import Any

__all__ = [
    "IDENTITY_ATTRIBUTES",
    "PLAN_ATTRIBUTES",
    "REMOVED_FLAGS",
    "RolloutConfig",
    "add_arguments",
    "check_debug_template",
    "from_args",
    "resolve_pool",
]

log = logging.getLogger("straw.rollout.config")

#: Flags of earlier rollout queues, refused by the parser with the reason.
REMOVED_FLAGS: Mapping[str, str] = {
    "--rollout-queue-resume": "resume and the checkpoint it starts from are chosen automatically",
    "--rollout-queue-fork": "resume is in place; the checkpoint it starts from is chosen automatically",
    "--rollout-queue-max-pending": "queue limits are not quotas; the queue holds any amount of work",
    "--rollout-queue-max-inflight": "queue limits are not quotas; readers take what they ask for",
    "--disable-rollout-global-dataset": "the dataset cursor is always global and committed with the queue",
}

#: Framework attributes that identify the model and its inputs (a resume must match them).
IDENTITY_ATTRIBUTES = (
    "hf_checkpoint",
    "ref_load",
    "apply_chat_template",
    "tool_key",
    "multimodal_keys",
    "rollout_max_prompt_len",
    "rollout_function_path",
    "custom_generate_function_path",
    "custom_rm_path",
)

#: Framework attributes that shape a training batch's conversion (part of its plan identity).
PLAN_ATTRIBUTES = (
    "use_dynamic_batch_size",
    "balance_data",
    "balance_by_flops",
    "num_layers",
    "num_experts",
    "moe_router_topk",
)

BUFFER_FILTER_REFUSED = (
    "--buffer-filter-path is not supported by straw; the queue prioritizes ready groups, partials, "
    "then fresh prompts, using older weight versions first within each stage"
)
NO_POOL = "Straw rollout transport requires --rollout-data-dir or --save on shared storage"
DEFAULT_RUN_ID = "rollout"


@dataclasses.dataclass
class RolloutConfig:
    """Every rollout setting, under the attribute name of its flag (``--save`` -> ``save``)."""

    # the pool and the writers
    rollout_data_dir: str | None = None
    rollout_queue_run_id: str | None = None
    rollout_storage_profile: str = "local"
    rollout_storage_declaration: str | None = None
    rollout_queue_segment_mib: int | None = None
    rollout_io_concurrency: int = 4
    rollout_queue_lease_seconds: float = 300.0
    rollout_queue_online_gc: bool = False
    # the job, checkpoints and replays
    save: str | None = None
    load: str | None = None
    ckpt_step: int | None = None
    save_interval: int | None = None
    start_rollout_id: int | None = None
    save_debug_rollout_data: str | None = None
    load_debug_rollout_data: str | None = None
    load_debug_rollout_data_subsample: float | None = None
    # the dataset
    prompt_data: str | None = None
    input_key: str = "input"
    label_key: str | None = None
    metadata_key: str = "metadata"
    rollout_shuffle: bool = False
    rollout_seed: int = 42
    # batches
    n_samples_per_prompt: int = 1
    rollout_batch_size: int | None = None
    global_batch_size: int | None = None
    micro_batch_size: int = 1
    # replay captures
    use_rollout_routing_replay: bool = False
    use_score_centering: bool = False
    score_centering_top_k: int | None = None
    rollout_top_p: float = 1.0
    # rewards
    reward_key: str | None = None
    advantage_estimator: str = "grpo"
    rewards_normalization: bool = True
    grpo_std_normalization: bool = True
    # hooks (dotted paths)
    custom_reward_post_process_path: str | None = None
    custom_convert_samples_to_train_data_path: str | None = None
    rollout_sample_filter_path: str | None = None
    dynamic_sampling_filter_path: str | None = None
    rollout_all_samples_process_path: str | None = None
    # refused or without effect
    buffer_filter_path: str | None = None
    buffer_sort_by_staleness: bool = False
    # no flags: tuning and identities
    update_weight_start_version: int | None = None
    gc_interval_seconds: float = 60.0
    task_max_attempts: int = 3
    refill_min_groups: int = 8
    refill_max_groups: int = 64
    identity_extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    plan_extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def run_id(self) -> str:
        """The straw run of the writers (``--rollout-queue-run-id``, default ``rollout``)."""
        return self.rollout_queue_run_id or DEFAULT_RUN_ID

    @classmethod
    def from_args(cls, namespace: object) -> RolloutConfig:
        """Read every field from ``namespace`` by attribute name (defaults where absent), then validate."""
        transport = getattr(namespace, "rollout_data_transport", None)
        if transport is not None and transport != "straw":
            raise ValueError("straw.rollout requires --rollout-data-transport straw")
        values: dict[str, Any] = {}
        for field in dataclasses.fields(cls):
            if hasattr(namespace, field.name):
                values[field.name] = getattr(namespace, field.name)
        for name in ("identity_extra", "plan_extra"):
            if not isinstance(values.get(name) or {}, Mapping):
                raise ValueError(f"{name} must be a dict")
        identity = dict(values.get("identity_extra") or {})
        plan = dict(values.get("plan_extra") or {})
        identity.update({k: getattr(namespace, k) for k in IDENTITY_ATTRIBUTES if hasattr(namespace, k)})
        plan.update({k: getattr(namespace, k) for k in PLAN_ATTRIBUTES if hasattr(namespace, k)})
        values["identity_extra"], values["plan_extra"] = identity, plan
        config = cls(**values)
        config.validate()
        return config

    def validate(self) -> None:
        """Check every setting; raises ``ValueError`` naming the flag. Creates nothing on disk."""
        if self.buffer_filter_path:
            raise ValueError(BUFFER_FILTER_REFUSED)
        _check_choice("--rollout-storage-profile", self.rollout_storage_profile, ("local", "juicefs"))
        for flag, value, required in (
            ("--rollout-queue-segment-mib", self.rollout_queue_segment_mib, False),
            ("--rollout-io-concurrency", self.rollout_io_concurrency, True),
            ("--n-samples-per-prompt", self.n_samples_per_prompt, True),
            ("--rollout-batch-size", self.rollout_batch_size, False),
            ("--global-batch-size", self.global_batch_size, False),
            ("--micro-batch-size", self.micro_batch_size, True),
            ("task_max_attempts", self.task_max_attempts, True),
            ("refill_min_groups", self.refill_min_groups, True),
            ("refill_max_groups", self.refill_max_groups, True),
        ):
            if value is not None or required:
                _check_positive_int(flag, value)
        for flag, number in (
            ("--rollout-queue-lease-seconds", self.rollout_queue_lease_seconds),
            ("gc_interval_seconds", self.gc_interval_seconds),
        ):
            _check_positive_number(flag, number)
        if self.refill_min_groups > self.refill_max_groups:
            raise ValueError("refill_min_groups must not exceed refill_max_groups")
        if self.save and (not _is_int(self.save_interval) or self.save_interval <= 0):  # type: ignore[operator]
            raise ValueError("--save requires a positive --save-interval")
        if self.save_interval is not None:
            _check_positive_int("--save-interval", self.save_interval)
        self._validate_batches()
        self._validate_replay()
        for template in (self.save_debug_rollout_data, self.load_debug_rollout_data):
            if template is not None:
                check_debug_template(template)
        for flag, step in (("--ckpt-step", self.ckpt_step), ("--start-rollout-id", self.start_rollout_id)):
            if step is not None and (not _is_int(step) or step < 0):
                raise ValueError(f"{flag} must be a non-negative integer, got {step!r}")
        for name in ("identity_extra", "plan_extra"):
            if not isinstance(getattr(self, name), dict):
                raise ValueError(f"{name} must be a dict")
        if self.buffer_sort_by_staleness:
            log.warning(
                "--buffer-sort-by-staleness has no effect with straw: the queue always orders returned "
                "groups by stage, then by their oldest weight version"
            )

    def _validate_batches(self) -> None:
        if self.global_batch_size is not None and self.rollout_batch_size is not None:
            rows = self.rollout_batch_size * self.n_samples_per_prompt
            if rows % self.global_batch_size:
                raise ValueError(
                    "--global-batch-size must divide --rollout-batch-size × --n-samples-per-prompt"
                )

    def _validate_replay(self) -> None:
        top_p = self.rollout_top_p
        if not _is_number(top_p) or not 0 < top_p <= 1:
            raise ValueError(f"--rollout-top-p must be in (0, 1], got {top_p!r}")
        if self.score_centering_top_k is not None:
            _check_positive_int("--score-centering-top-k", self.score_centering_top_k)
        if self.use_score_centering and top_p == 1 and self.score_centering_top_k is None:
            raise ValueError(
                "--use-score-centering with --rollout-top-p 1 needs a positive --score-centering-top-k"
            )
        ratio = self.load_debug_rollout_data_subsample
        if ratio is not None and (not _is_number(ratio) or not 0 < ratio <= 1):
            raise ValueError(f"--load-debug-rollout-data-subsample must be in (0, 1], got {ratio!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)  # type: ignore[arg-type]


def _check_positive_int(flag: str, value: object) -> None:
    if not _is_int(value) or value <= 0:  # type: ignore[operator]
        raise ValueError(f"{flag} must be positive (an integer), got {value!r}")


def _check_positive_number(flag: str, value: object) -> None:
    if not _is_number(value) or value <= 0:  # type: ignore[operator]
        raise ValueError(f"{flag} must be positive, got {value!r}")


def _check_choice(flag: str, value: object, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"{flag} must be one of {', '.join(choices)}, got {value!r}")


def check_debug_template(template: object) -> str:
    """A debug archive path template: ``.pt`` or ``.straw.json`` with exactly one ``{rollout_id}`` field."""
    problem = (
        "Debug rollout data path must end in .pt or .straw.json and contain one {rollout_id} field: "
        f"{template}"
    )
    if not isinstance(template, str) or not template.endswith((".pt", ".straw.json")):
        raise ValueError(problem)
    try:
        fields = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError:
        raise ValueError(problem) from None
    if fields != ["rollout_id"]:
        raise ValueError(problem)
    return template


def from_args(namespace: object) -> RolloutConfig:
    """The module-level spelling of :meth:`RolloutConfig.from_args`."""
    return RolloutConfig.from_args(namespace)


# --------------------------------------------------------------------------- the parser


class _Removed(argparse.Action):
    """A flag that no longer exists: the parser stops with the reason."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        kwargs.setdefault("nargs", "?")
        super().__init__(option_strings, dest, **kwargs)

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: Any, values: Any, option: str | None = None
    ) -> None:
        flag = option or self.option_strings[0]
        parser.error(f"{flag} was removed: {REMOVED_FLAGS[flag]}")


def _text(default: str | None, help: str) -> dict[str, Any]:
    return {"type": str, "default": default, "help": help}


def _on(help: str) -> dict[str, Any]:
    return {"action": "store_true", "default": False, "help": help}


def _flags() -> list[tuple[tuple[str, ...], dict[str, Any]]]:
    """Each flag as (option strings, add_argument keywords); the first string is its name."""
    text, on = _text, _on
    return [
        (("--rollout-data-dir",), text(None, "the shared pool (default <save>/rollout_data)")),
        (("--rollout-queue-run-id",), text(None, "straw run id of the writers (default rollout)")),
        (
            ("--rollout-storage-profile",),
            {"choices": ("local", "juicefs"), "default": "local", "help": "backend profile of the pool"},
        ),
        (("--rollout-storage-declaration",), text(None, "JSON file of the verified mount settings")),
        (
            ("--rollout-queue-segment-mib",),
            {"type": int, "default": None, "help": "pack rotation target (MiB)"},
        ),
        (
            ("--rollout-io-concurrency",),
            {"type": int, "default": 4, "help": "concurrent publishes per process"},
        ),
        (("--rollout-queue-lease-seconds",), {"type": float, "default": 300.0, "help": "lease length"}),
        (("--rollout-queue-online-gc",), on("collect garbage while the job runs")),
        (("--save",), text(None, "the job's save directory")),
        (("--load",), text(None, "a save directory or a rollout/committed_<K>.json")),
        (("--ckpt-step",), {"type": int, "default": None, "help": "checkpoint step to restore"}),
        (("--save-interval",), {"type": int, "default": None, "help": "checkpoint every N steps"}),
        (("--start-rollout-id",), {"type": int, "default": None, "help": "first rollout id"}),
        (("--save-debug-rollout-data",), text(None, "archive template (.pt or .straw.json)")),
        (("--load-debug-rollout-data",), text(None, "replay template (.pt or .straw.json)")),
        (("--load-debug-rollout-data-subsample",), {"type": float, "default": None, "help": "replay ratio"}),
        (("--prompt-data",), text(None, "JSONL prompts")),
        (("--input-key",), text("input", "prompt column")),
        (("--label-key",), text(None, "label column")),
        (("--metadata-key",), text("metadata", "metadata column")),
        (("--rollout-shuffle",), on("shuffle prompts per epoch")),
        (("--rollout-seed",), {"type": int, "default": 42, "help": "shuffle seed"}),
        (("--n-samples-per-prompt",), {"type": int, "default": 1, "help": "group size"}),
        (("--rollout-batch-size",), {"type": int, "default": None, "help": "groups per rollout step"}),
        (("--global-batch-size",), {"type": int, "default": None, "help": "rows per optimizer step"}),
        (("--micro-batch-size",), {"type": int, "default": 1, "help": "rows per micro-batch"}),
        (("--use-rollout-routing-replay",), on("R3: persist and check routed experts")),
        (("--use-score-centering",), on("persist and check score-centering captures")),
        (("--score-centering-top-k",), {"type": int, "default": None, "help": "top-k of score centering"}),
        (("--rollout-top-p",), {"type": float, "default": 1.0, "help": "top-p of generation"}),
        (("--reward-key",), text(None, "key of a dict reward")),
        (("--advantage-estimator",), text("grpo", "advantage family (grpo, gspo, cispo, ...)")),
        (
            ("--rewards-normalization", "--no-rewards-normalization", "--disable-rewards-normalization"),
            {"default": True, "help": "subtract the group mean"},
        ),
        (
            ("--grpo-std-normalization", "--no-grpo-std-normalization", "--disable-grpo-std-normalization"),
            {"default": True, "help": "divide by the group std"},
        ),
        (("--custom-reward-post-process-path",), text(None, "reward hook")),
        (("--custom-convert-samples-to-train-data-path",), text(None, "conversion hook")),
        (("--rollout-sample-filter-path",), text(None, "sample filter hook")),
        (("--dynamic-sampling-filter-path",), text(None, "dynamic filter hook")),
        (("--rollout-all-samples-process-path",), text(None, "legacy all-samples hook")),
        (("--buffer-filter-path",), text(None, "not supported with straw")),
        (("--buffer-sort-by-staleness",), on("no effect with straw")),
    ]


def add_arguments(parser: argparse.ArgumentParser, *, exclude: Collection[str] = frozenset()) -> None:
    """Add the rollout flags to ``parser``, except those named in ``exclude``.

    A framework that defines some of them already (``--save``) excludes those and keeps its
    own. The removed flags of :data:`REMOVED_FLAGS` are registered to fail with their reason.
    """
    if not isinstance(parser, argparse.ArgumentParser):
        raise TypeError(f"add_arguments takes an argparse.ArgumentParser, got {type(parser).__name__}")
    if isinstance(exclude, str):
        raise TypeError("exclude= is a collection of option strings, not one string")
    group = parser.add_argument_group("straw rollout")
    for options, keywords in _flags():
        if options[0] in exclude:
            continue
        if len(options) == 3:  # an on/off pair with a --disable- alias
            dest = options[0].removeprefix("--").replace("-", "_")
            group.add_argument(
                options[0], dest=dest, action="store_true", default=True, help=keywords["help"]
            )
            group.add_argument(
                options[1], options[2], dest=dest, action="store_false", help=argparse.SUPPRESS
            )
            continue
        group.add_argument(*options, **keywords)
    for flag in REMOVED_FLAGS:
        if flag not in exclude:
            group.add_argument(flag, action=_Removed, help=argparse.SUPPRESS)


# --------------------------------------------------------------------------- the pool


def resolve_pool(config: RolloutConfig) -> RolloutConfig:
    """A copy of ``config`` with its pool bound (the argument is never changed).

    A ``.straw.json`` replay template binds the archive's pool and run; else an explicit
    ``--rollout-data-dir``; else ``<save>/rollout_data``. The path is ``~``-expanded and
    made absolute.
    """
    if not isinstance(config, RolloutConfig):
        raise TypeError(f"resolve_pool takes a RolloutConfig, got {type(config).__name__}")
    template = config.load_debug_rollout_data
    if template is not None and template.endswith(".straw.json"):
        from .archive import bind_archive_pool

        return bind_archive_pool(config)
    if config.rollout_data_dir:
        pool = config.rollout_data_dir
    elif config.save:
        pool = os.path.join(config.save, "rollout_data")
    else:
        raise ValueError(NO_POOL)
    return dataclasses.replace(config, rollout_data_dir=os.path.abspath(os.path.expanduser(pool)))
