"""Fixtures of the rollout-layer tests: configurations on a pool under ``tmp_path``.

``make_config(**flags)`` builds a :class:`RolloutConfig` the way a framework would, from a
namespace (``RolloutConfig.from_args(SimpleNamespace(...))``), with the pool in
``tmp_path / "pool"`` unless the flags say otherwise. Every test ends with the process's
cached rollout writers closed, so no test sees another's writer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from straw.rollout.config import RolloutConfig
from straw.rollout.pool import close_rollout_stores

MakeConfig = Callable[..., RolloutConfig]


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
