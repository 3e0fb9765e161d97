"""Shared pytest fixtures.

JuiceFS (real two-client FUSE mount, see ``tests/juicefs_mount.py``):

* ``juicefs_clients`` (session): a :class:`juicefs_mount.JuiceFSClients` with ``.a`` / ``.b``
  (mount points of two independent clients of one volume), ``.meta_url`` and ``.declaration``
  (the straw ``juicefs`` backend profile for this setup).
* ``juicefs_pool`` (function): ``(path_on_a, path_on_b)`` of a fresh ``tests-<uuid>`` directory
  created through client A and already visible through client B; removed afterwards.

Mark tests using them ``@pytest.mark.juicefs``. Environment switch ``STRAW_JUICEFS``:
unset/anything else = use JuiceFS when possible, skip with the reason otherwise;
``0`` = always skip; ``require`` = a missing JuiceFS/FUSE is a test failure, not a skip.

Every test must give up the files it opened under the session's temporary directory and the
system's (``tempfile.gettempdir()``: ``mkdtemp`` pools, the JuiceFS pair) (``_no_descriptor_left``);
``STRAW_FD_GUARD_REPORT=1`` prints ``LEFT-OPEN`` lines instead of failing, to list every
offender of a run at once.
"""

from __future__ import annotations

import gc
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import pytest
from hypothesis import HealthCheck, settings

import juicefs_mount
import straw.tensor
from queue_helpers import open_under

# Hypothesis times each example (its deadline) and the first examples together (the too_slow
# health check) by the wall clock. No test here asserts speed (that is the benchmarks' job), and
# on a loaded 2-core machine one stall of a quarter second would fail a correct test: the
# project's profile turns both off. A test's own ``@settings`` still overrides what it names.
settings.register_profile("straw", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("straw")

#: Bound on how long a directory created through A may take to show up through B.
_POOL_VISIBILITY_TIMEOUT_S = 10.0


@pytest.fixture(autouse=True)
def _no_descriptor_left(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[None]:
    """Every test gives up the files it opened under the temporary directories (the session's
    and the system's).

    A store, coordinator, catalog or reader that keeps a descriptor after it is closed (or
    a failed open that keeps one) fails the test that did it, named with the files. The
    process-wide read sessions of ``straw.tensor`` keep packs open on purpose (bounded by
    ``OPEN_PACKS_MAX``): the pools they belong to are detached first, as a process would
    at its end. Fixtures of narrower scope (the rollout tests' cached writers) close before.
    """
    roots = (tmp_path_factory.getbasetemp(), tempfile.gettempdir())
    before = set(open_under(*roots))

    def left_open() -> dict[int, str]:
        return {fd: path for fd, path in open_under(*roots).items() if fd not in before}

    yield
    for pool_root in list(straw.tensor._pools):
        straw.tensor.detach(pool_root)
    left = left_open()
    if left:
        gc.collect()  # a cycle that holds a closed object's last reference (finalizers close)
        left = left_open()
    if left and not os.environ.get("STRAW_FD_GUARD_REPORT"):
        # (Not closed here: the object that owns a descriptor may still close it later, by
        # number, when that number names another file. The next tests count from here.)
        pytest.fail(f"the test left {len(left)} file(s) open: {sorted(set(left.values()))}", pytrace=False)
    elif left:
        print(f"\nLEFT-OPEN {request.node.nodeid}: {sorted(set(left.values()))}")


def pytest_configure(config: pytest.Config) -> None:
    # Also registered in pyproject.toml; repeated here so this file works on its own.
    config.addinivalue_line("markers", "juicefs: needs a real JuiceFS FUSE mount (two clients)")


def _juicefs_mode() -> str:
    return os.environ.get("STRAW_JUICEFS", "").strip().lower()


def _juicefs_unavailable(reason: str) -> NoReturn:
    if _juicefs_mode() == "require":
        pytest.fail(f"STRAW_JUICEFS=require but JuiceFS is unavailable: {reason}", pytrace=False)
    pytest.skip(f"JuiceFS unavailable: {reason}")


@pytest.fixture(scope="session")
def juicefs_clients() -> Iterator[juicefs_mount.JuiceFSClients]:
    """Two independent JuiceFS clients (``.a``, ``.b``) of one fresh volume, for the session."""
    if _juicefs_mode() in {"0", "off", "false", "no"}:
        pytest.skip("JuiceFS tests disabled by STRAW_JUICEFS=0")
    # Pairs left mounted by an earlier run that was killed (no teardown ran) are cleaned first.
    juicefs_mount.sweep_abandoned()
    pair = juicefs_mount.JuiceFSPair()
    try:
        pair.start()
    except juicefs_mount.JuiceFSUnavailable as exc:
        _juicefs_unavailable(exc.reason)
    try:
        yield pair.clients()
    finally:
        pair.close()


@pytest.fixture
def juicefs_pool(juicefs_clients: juicefs_mount.JuiceFSClients) -> Iterator[tuple[Path, Path]]:
    """A fresh empty directory, as ``(path_on_a, path_on_b)``; created through A, visible on B."""
    name = f"tests-{uuid.uuid4().hex}"
    on_a = juicefs_clients.a / name
    on_b = juicefs_clients.b / name
    on_a.mkdir()
    if not juicefs_mount.wait_until(on_b.is_dir, _POOL_VISIBILITY_TIMEOUT_S):
        pytest.fail(f"{on_a} created through client A is not visible as {on_b} through client B")
    try:
        yield on_a, on_b
    finally:
        shutil.rmtree(on_a, ignore_errors=True)
