"""Fixtures shared by the unit tests of the store's record-set memos."""

from __future__ import annotations

from typing import Any

import pytest

import straw.store as store_module


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
