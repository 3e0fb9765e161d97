"""Prompt datasets and the producer that turns them into prompt groups, epoch after epoch.

:class:`PromptProducer` is pure: ``draw(count, cursor)`` always gives the same groups and the
same next cursor for the same dataset and cursor, so the queue can commit the cursor in the
transaction that creates the groups' tasks and re-draw after a crash with nothing skipped or
repeated (docs/ROLLOUT.md, "The dataset and the producer").
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import os
import random
from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable

from .sample import Sample

__all__ = ["Dataset", "DatasetCursor", "JsonlDataset", "PromptProducer"]

#: One line of a JSONL prompt file (a prompt with its chat history and metadata) is at most this big.
JSONL_LINE_BYTES_MAX = 64 << 20


@runtime_checkable
class Dataset(Protocol):
    """Prompts by position: a row is a mapping (``input``, ``label``, ``metadata`` columns) or a Sample.

    It may also define ``identity() -> dict`` (JSON) naming its contents, which a resume compares.
    """

    def __len__(self) -> int: ...
    def __getitem__(self, index: int) -> Mapping[str, Any] | Sample: ...


class JsonlDataset:
    """A JSONL file of prompt rows (one JSON object per line), optionally filtered by ``keep``."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        input_key: str = "input",
        label_key: str | None = None,
        metadata_key: str = "metadata",
        keep: Callable[[dict[str, Any]], bool] | None = None,
    ) -> None:
        self.path = os.path.abspath(os.fspath(path))
        self.input_key = input_key
        self.label_key = label_key
        self.metadata_key = metadata_key
        digest = hashlib.sha256()
        rows: list[dict[str, Any]] = []
        with open(self.path, "rb") as handle:
            for number, line in enumerate(handle, start=1):
                digest.update(line)
                if len(line) > JSONL_LINE_BYTES_MAX:
                    raise ValueError(
                        f"{self.path}:{number}: line is longer than {JSONL_LINE_BYTES_MAX} bytes"
                    )
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError as error:
                    raise ValueError(f"{self.path}:{number}: not a JSON object: {error}") from None
                if not isinstance(row, dict):
                    raise ValueError(
                        f"{self.path}:{number}: a row is a JSON object, got {type(row).__name__}"
                    )
                if input_key not in row:
                    raise ValueError(f"{self.path}:{number}: row has no {input_key!r} column")
                if keep is None or keep(row):
                    rows.append(row)
        self.sha256 = digest.hexdigest()
        self.rows = rows

    @classmethod
    def from_config(cls, config: Any) -> JsonlDataset:
        """The dataset of ``--prompt-data`` with the configured column names."""
        path = getattr(config, "prompt_data", None)
        if not path:
            raise ValueError("No dataset: pass dataset= or --prompt-data")
        return cls(
            path,
            input_key=getattr(config, "input_key", "input"),
            label_key=getattr(config, "label_key", None),
            metadata_key=getattr(config, "metadata_key", "metadata"),
        )

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.rows[index]

    def identity(self) -> dict[str, Any]:
        """What names this dataset's contents: the file, its hash and the column names."""
        return {
            "path": self.path,
            "sha256": self.sha256,
            "input_key": self.input_key,
            "label_key": self.label_key,
            "metadata_key": self.metadata_key,
        }


_CURSOR_KEYS = ("epoch_id", "sample_offset", "sample_group_index", "sample_index", "metadata")


@dataclasses.dataclass(frozen=True)
class DatasetCursor:
    """Where the producer stands: the epoch, the position in its order, the next ids to hand out."""

    epoch_id: int = 0
    sample_offset: int = 0
    sample_group_index: int = 0
    sample_index: int = 0
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in _CURSOR_KEYS[:4]:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"Dataset cursor {name} must be a non-negative integer, got {value!r}")
        if not isinstance(self.metadata, dict):
            raise ValueError(f"Dataset cursor metadata must be a dict, got {type(self.metadata).__name__}")

    def asdict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DatasetCursor:
        if not isinstance(data, Mapping):
            raise ValueError(f"Dataset checkpoint is not a mapping: {type(data).__name__}")
        for key in _CURSOR_KEYS:
            if key not in data:
                raise ValueError(f"Dataset checkpoint is missing {key}")
        return cls(**{key: data[key] for key in _CURSOR_KEYS})


class PromptProducer:
    """Draws prompt groups from a dataset: ``n_samples_per_prompt`` copies of each prompt.

    Epoch ``e`` visits the rows in order, or with ``shuffle`` in the order
    ``random.Random(seed + e).shuffle(list(range(len)))`` (stable across processes and
    Python versions). Group and sample ids count up globally and are never reused.
    """

    def __init__(
        self,
        dataset: Dataset,
        *,
        n_samples_per_prompt: int,
        shuffle: bool,
        seed: int,
        input_key: str | None = None,
        label_key: str | None = None,
        metadata_key: str | None = None,
    ) -> None:
        if isinstance(n_samples_per_prompt, bool) or not isinstance(n_samples_per_prompt, int):
            raise ValueError(f"n_samples_per_prompt must be a positive integer, got {n_samples_per_prompt!r}")
        if n_samples_per_prompt <= 0:
            raise ValueError(f"n_samples_per_prompt must be a positive integer, got {n_samples_per_prompt!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an integer, got {seed!r}")
        self.dataset = dataset
        self.n_samples_per_prompt = n_samples_per_prompt
        self.shuffle = bool(shuffle)
        self.seed = seed
        self.input_key: str = input_key or str(getattr(dataset, "input_key", "input"))
        self.label_key: str | None = (
            label_key if label_key is not None else getattr(dataset, "label_key", None)
        )
        self.metadata_key: str = metadata_key or str(getattr(dataset, "metadata_key", "metadata"))
        self._orders: dict[tuple[int, int], list[int]] = {}  # (epoch, size) -> order; the last one kept

    def order(self, epoch: int, size: int) -> list[int]:
        """The row order of one epoch."""
        key = (epoch, size)
        found = self._orders.get(key)
        if found is None:
            found = list(range(size))
            if self.shuffle:
                random.Random(self.seed + epoch).shuffle(found)
            self._orders = {key: found}
        return found

    def prompt(self, row: Mapping[str, Any] | Sample) -> Sample:
        if isinstance(row, Sample):
            return row
        if not isinstance(row, Mapping):
            raise TypeError(f"a dataset row is a mapping or a Sample, got {type(row).__name__}")
        if self.input_key not in row:
            raise KeyError(f"dataset row has no {self.input_key!r} column")
        label = row.get(self.label_key) if self.label_key is not None else None
        return Sample(
            prompt=row[self.input_key], label=label, metadata=dict(row.get(self.metadata_key) or {})
        )

    def draw(self, count: int, cursor: DatasetCursor) -> tuple[list[list[Sample]], DatasetCursor]:
        """``count`` groups from ``cursor`` on, and the cursor after them (wrapping epochs)."""
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"count must be a non-negative integer, got {count!r}")
        if not isinstance(cursor, DatasetCursor):
            raise TypeError(f"draw takes a DatasetCursor, got {type(cursor).__name__}")
        size = len(self.dataset)
        if size <= 0:
            raise ValueError("Queue rollout dataset is empty after filtering")
        epoch, offset = cursor.epoch_id, cursor.sample_offset
        group_index, sample_index = cursor.sample_group_index, cursor.sample_index
        groups: list[list[Sample]] = []
        for _ in range(count):
            if offset >= size:
                epoch, offset = epoch + 1, 0
            row = self.dataset[self.order(epoch, size)[offset]]
            prompt = self.prompt(row)
            group = []
            for _ in range(self.n_samples_per_prompt):
                sample = copy.deepcopy(prompt) if isinstance(row, Sample) else _fresh(prompt)
                sample.group_index = group_index
                sample.index = sample_index
                sample_index += 1
                group.append(sample)
            groups.append(group)
            group_index += 1
            offset += 1
        if offset >= size:  # the epoch is used up: the cursor names the next one
            epoch, offset = epoch + 1, 0
        after = DatasetCursor(epoch, offset, group_index, sample_index, copy.deepcopy(cursor.metadata))
        return groups, after


def _fresh(prompt: Sample) -> Sample:
    """A new Sample equal to ``copy.deepcopy(prompt)`` for a prompt that sets only its prompt,
    label and metadata (as :meth:`PromptProducer.prompt` makes them): those three are copied
    deeply and every other field is its default, without walking the whole dataclass."""
    return Sample(
        prompt=copy.deepcopy(prompt.prompt),
        label=copy.deepcopy(prompt.label),
        metadata=copy.deepcopy(prompt.metadata),
    )
