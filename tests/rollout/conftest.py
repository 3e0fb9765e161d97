"""Fixtures of the rollout-layer tests: configurations on a pool under ``tmp_path``.

``make_config(**flags)`` builds a :class:`RolloutConfig` the way a framework would, from a
namespace (``RolloutConfig.from_args(SimpleNamespace(...))``), with the pool in
``tmp_path / "pool"`` unless the flags say otherwise. Every test ends with the process's
cached rollout writers closed, so no test sees another's writer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from rollout_helpers import prompt_rows
from straw.rollout.config import RolloutConfig
from straw.rollout.controller import QueueController
from straw.rollout.pool import close_rollout_stores
from straw.rollout.reader import QueueReader

MakeConfig = Callable[..., RolloutConfig]
OpenController = Callable[..., QueueController]
OpenReader = Callable[..., QueueReader]


@pytest.fixture(autouse=True)
def closed_rollout_stores() -> Iterator[None]:
    yield
    close_rollout_stores()


@pytest.fixture
def pool(tmp_path: Path) -> Path:
    return tmp_path / "pool"


@pytest.fixture
def make_config(pool: Path) -> MakeConfig:
    def make(**flags: Any) -> RolloutConfig:
        flags.setdefault("rollout_data_dir", str(pool))
        return RolloutConfig.from_args(SimpleNamespace(**flags))

    return make


@pytest.fixture
def open_controller(make_config: MakeConfig) -> Iterator[OpenController]:
    """Open controllers (dataset: 100 prompt rows unless given); all are closed at the end."""
    made: list[QueueController] = []

    def open_(config: RolloutConfig | None = None, **options: Any) -> QueueController:
        options.setdefault("dataset", prompt_rows(100))
        controller = QueueController(config if config is not None else make_config(), **options)
        made.append(controller)
        return controller

    yield open_
    for controller in reversed(made):
        with contextlib.suppress(Exception):
            controller.close()


@pytest.fixture
def open_reader() -> Iterator[OpenReader]:
    """Open readers of a controller; all are closed at the end."""
    made: list[QueueReader] = []

    def open_(controller: QueueController, reader_id: str = "r", **options: Any) -> QueueReader:
        reader = QueueReader(controller.config, controller, reader_id, **options)
        made.append(reader)
        return reader

    yield open_
    for reader in reversed(made):
        with contextlib.suppress(Exception):
            reader.close()
