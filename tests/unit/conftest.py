"""Fixtures shared by the unit tests of the store's record-set memos."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import straw.store as store_module
from straw import SharedFilesystemStore
from straw._pack import reader

#: The run of ``memo_store``.
MEMO_RUN = "run"


@pytest.fixture
def digests(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts manifest digest recomputations (one per verification of a set)."""
    calls = [0]
    original = store_module.logical_digest

    def counted(*args: Any) -> str:
        calls[0] += 1
        return original(*args)

    monkeypatch.setattr(store_module, "logical_digest", counted)
    return calls


@pytest.fixture
def empty_memos() -> Iterator[None]:
    """The process-wide caches of written sets and shared indexes, empty before and after."""
    store_module.WRITTEN_SETS.clear()
    reader.SHARED_INDEXES.clear()
    yield
    store_module.WRITTEN_SETS.clear()
    reader.SHARED_INDEXES.clear()


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SharedFilesystemStore]:
    """A store of run ``MEMO_RUN`` on a fresh pool (a test module's own ``store`` wins)."""
    with SharedFilesystemStore(tmp_path / "pool", MEMO_RUN) as opened:
        yield opened
