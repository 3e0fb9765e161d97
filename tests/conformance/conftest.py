"""Fixtures of the conformance suite: whatever ``straw`` this interpreter imports is under test.

The suite uses only the public API (API.md), so it runs unchanged against straw and against
straw-queue (``make compat``). Every expectation here must hold for both.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import straw


def implementation() -> str:
    """Which library answers: its distribution, told apart by the peer's native core."""
    return "straw-queue" if hasattr(straw, "_native") else "straw"


def pytest_report_header() -> str:
    return f"conformance: straw from {Path(straw.__file__).parent} ({implementation()})"


@pytest.fixture
def pool(tmp_path: Path) -> Path:
    return tmp_path / "pool"
