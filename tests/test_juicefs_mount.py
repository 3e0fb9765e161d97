"""Prove the JuiceFS test fixture is a real FUSE mount seen by two independent clients.

These tests pin down the cross-client behaviour straw's ``juicefs`` backend relies on:
fsync'ed data and sizes are visible through the other client at once (metadata caches are
off), and BSD ``flock`` / POSIX ``fcntl`` locks taken through one client exclude the other
client, and are released when the holder exits or is killed.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import juicefs_mount

pytestmark = pytest.mark.juicefs

#: Bound on waiting for a lock to become free after its holder went away.
LOCK_RELEASE_TIMEOUT_S = 10.0

# Child process that takes an exclusive lock of the given kind and holds it until its stdin
# is closed (or it is killed).
_HOLDER = r"""
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
if sys.argv[2] == "flock":
    fcntl.flock(fd, fcntl.LOCK_EX)
else:
    fcntl.lockf(fd, fcntl.LOCK_EX)
sys.stdout.write("locked\n")
sys.stdout.flush()
sys.stdin.read()
"""


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _read_file(path: Path) -> bytes:
    """Open ``path`` afresh and read it to the end."""
    with open(path, "rb", buffering=0) as f:
        return f.read()


def _mount_entries() -> dict[str, tuple[str, str]]:
    """mount point -> (source, fstype) from /proc/mounts."""
    entries: dict[str, tuple[str, str]] = {}
    for line in Path("/proc/mounts").read_text().splitlines():
        source, mountpoint, fstype = line.split()[:3]
        entries[mountpoint.replace("\\040", " ")] = (source, fstype)
    return entries


def _try_lock(fd: int, kind: str) -> None:
    """Non-blocking exclusive lock; raises OSError (EAGAIN/EACCES) when held elsewhere."""
    if kind == "flock":
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    else:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)


def _unlock(fd: int, kind: str) -> None:
    if kind == "flock":
        fcntl.flock(fd, fcntl.LOCK_UN)
    else:
        fcntl.lockf(fd, fcntl.LOCK_UN)


def _lock_when_free(fd: int, kind: str, timeout: float = LOCK_RELEASE_TIMEOUT_S) -> float:
    """Poll a non-blocking lock until it succeeds; returns seconds waited or fails the test."""
    start = time.monotonic()
    while True:
        try:
            _try_lock(fd, kind)
            return time.monotonic() - start
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EACCES):
                raise
        if time.monotonic() - start > timeout:
            pytest.fail(f"{kind} lock still held {timeout:.0f}s after its holder went away")
        time.sleep(0.02)


@pytest.fixture
def lock_holder() -> Iterator[list[subprocess.Popen[str]]]:
    """Collects holder child processes and makes sure none outlives the test."""
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


def _start_holder(procs: list[subprocess.Popen[str]], path: Path, kind: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(path), kind],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    procs.append(proc)
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 30.0)
    assert ready, f"lock holder did not report within 30s (exit code {proc.poll()})"
    assert proc.stdout.readline().strip() == "locked"
    return proc


# ----------------------------------------------------------------------------- mounts


def test_both_paths_are_independent_fuse_juicefs_mounts(juicefs_clients) -> None:
    mounts = _mount_entries()
    sources = set()
    for path in (juicefs_clients.a, juicefs_clients.b):
        assert os.path.ismount(path)
        source, fstype = mounts[str(path)]
        assert fstype == "fuse.juicefs", (path, fstype)
        sources.add(source)
        st = os.statvfs(path)
        assert st.f_bsize > 0 and st.f_blocks > 0 and st.f_namemax == 255
    # One volume ...
    assert sources == {f"JuiceFS:{juicefs_clients.volume_name}"}
    # ... served by two separate FUSE connections (distinct devices) and separate daemons.
    assert os.stat(juicefs_clients.a).st_dev != os.stat(juicefs_clients.b).st_dev
    assert juicefs_clients.pids_a and juicefs_clients.pids_b
    assert not juicefs_clients.pids_a & juicefs_clients.pids_b
    for pid in juicefs_clients.pids_a | juicefs_clients.pids_b:
        assert Path(f"/proc/{pid}").exists(), f"juicefs daemon {pid} is gone"


def test_declaration_matches_setup(juicefs_clients) -> None:
    decl = juicefs_clients.declaration
    assert decl["direct_mount"] is True
    assert decl["writeback"] is False
    assert decl["open_cache"] == 0
    assert decl["readdir_cache"] is False
    assert decl["client_version"].startswith("juicefs version ")
    assert decl["durability_description"]
    assert juicefs_clients.meta_url.startswith("sqlite3:///")


def test_pool_is_fresh_and_shared(juicefs_pool) -> None:
    on_a, on_b = juicefs_pool
    assert on_a.name == on_b.name and on_a.name.startswith("tests-")
    assert os.listdir(on_a) == [] and os.listdir(on_b) == []
    (on_b / "from-b").write_bytes(b"b")
    assert (on_a / "from-b").read_bytes() == b"b"


# ----------------------------------------------------------------------------- data visibility


def test_fsynced_write_on_a_reads_back_byte_exact_on_b(juicefs_pool) -> None:
    on_a, on_b = juicefs_pool
    # Spans two 4 MiB JuiceFS blocks and ends mid-block.
    payload = os.urandom(4 * 1024 * 1024 + 12345)
    fd = os.open(on_a / "data.bin", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        _write_all(fd, payload)
        os.fsync(fd)
        # Still open on A: fsync alone must make the bytes visible through B.
        assert os.stat(on_b / "data.bin").st_size == len(payload)
        assert _read_file(on_b / "data.bin") == payload
    finally:
        os.close(fd)
    assert _read_file(on_b / "data.bin") == payload


def test_append_on_a_after_b_opened_directory_is_visible_on_b(juicefs_pool) -> None:
    on_a, on_b = juicefs_pool
    first, second = os.urandom(1000), os.urandom(70_000)
    fd = os.open(on_a / "log", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        _write_all(fd, first)
        os.fsync(fd)
    finally:
        os.close(fd)

    dir_fd = os.open(on_b, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert os.listdir(dir_fd) == ["log"]
        assert os.stat("log", dir_fd=dir_fd).st_size == len(first)

        fd = os.open(on_a / "log", os.O_WRONLY | os.O_APPEND)
        try:
            _write_all(fd, second)
            os.fsync(fd)
            # B: new size through the directory it opened before the append ...
            assert os.stat("log", dir_fd=dir_fd).st_size == len(first) + len(second)
            # ... and a fresh open sees the new size and every byte.
            rfd = os.open("log", os.O_RDONLY, dir_fd=dir_fd)
            try:
                assert os.fstat(rfd).st_size == len(first) + len(second)
                chunks = []
                while chunk := os.read(rfd, 1 << 20):
                    chunks.append(chunk)
                assert b"".join(chunks) == first + second
            finally:
                os.close(rfd)
        finally:
            os.close(fd)
    finally:
        os.close(dir_fd)


# ----------------------------------------------------------------------------- locks


@pytest.mark.parametrize("kind", ["flock", "posix"])
@pytest.mark.parametrize("holder_side", ["a", "b"])
def test_lock_held_on_one_client_excludes_the_other(juicefs_pool, lock_holder, kind, holder_side) -> None:
    """JuiceFS keeps flock and POSIX locks in the metadata engine, so they are cross-client."""
    on_a, on_b = juicefs_pool
    holder_dir, contender_dir = (on_a, on_b) if holder_side == "a" else (on_b, on_a)
    (holder_dir / "lock").write_bytes(b"")

    holder = _start_holder(lock_holder, holder_dir / "lock", kind)
    fd = os.open(contender_dir / "lock", os.O_RDWR)
    try:
        with pytest.raises(OSError) as excinfo:
            _try_lock(fd, kind)
        assert excinfo.value.errno in (errno.EAGAIN, errno.EACCES)
        if kind == "flock":
            assert isinstance(excinfo.value, BlockingIOError)

        assert holder.stdin is not None
        holder.stdin.close()  # holder exits normally, its fd is closed -> lock released
        assert holder.wait(timeout=30) == 0
        _lock_when_free(fd, kind)
        _unlock(fd, kind)
    finally:
        os.close(fd)


@pytest.mark.parametrize("kind", ["flock", "posix"])
def test_lock_released_when_holder_is_killed(juicefs_pool, lock_holder, kind) -> None:
    on_a, on_b = juicefs_pool
    (on_a / "lock").write_bytes(b"")
    holder = _start_holder(lock_holder, on_a / "lock", kind)
    fd = os.open(on_b / "lock", os.O_RDWR)
    try:
        with pytest.raises(OSError):
            _try_lock(fd, kind)
        holder.send_signal(signal.SIGKILL)
        assert holder.wait(timeout=30) == -signal.SIGKILL
        _lock_when_free(fd, kind)
        _unlock(fd, kind)
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------- abandoned pairs

# Child that sets up its own pair, reports the pair's dir and daemon pids, then waits to be
# killed: SIGKILL skips close() and atexit, which is how a killed test run leaks its mounts.
_ABANDONER = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import juicefs_mount
pair = juicefs_mount.JuiceFSPair(sys.argv[2]).start()
clients = pair.clients()
sys.stdout.write(json.dumps({"base": str(pair.base), "pids": sorted(clients.pids_a | clients.pids_b)}) + "\n")
sys.stdout.flush()
sys.stdin.read()
"""


def test_sweep_cleans_a_pair_whose_owner_was_killed(juicefs_clients, tmp_path) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", _ABANDONER, str(Path(__file__).parent), str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        ready, _, _ = select.select([child.stdout], [], [], 120.0)
        assert ready, f"child did not set up its pair within 120 s (exit code {child.poll()})"
        report = json.loads(child.stdout.readline())
        base, pids = Path(report["base"]), report["pids"]
        # While the owner lives, the sweep leaves its pair (and the session's) alone.
        assert juicefs_mount.sweep_abandoned(tmp_path) == []
        assert os.path.ismount(base / "mnt-a") and os.path.ismount(base / "mnt-b")
    finally:
        child.kill()
        child.wait(timeout=30)
    # The owner is gone without teardown: both mounts and their daemons are still there.
    assert os.path.ismount(base / "mnt-a") and os.path.ismount(base / "mnt-b")
    assert pids and all(Path(f"/proc/{pid}").exists() for pid in pids)

    assert juicefs_mount.sweep_abandoned(tmp_path) == [base]
    mounted = _mount_entries()
    assert str(base / "mnt-a") not in mounted and str(base / "mnt-b") not in mounted
    assert not base.exists()
    assert juicefs_mount.wait_until(lambda: not any(juicefs_mount._is_live_juicefs(p) for p in pids), 10.0)
    # The session's own pair, whose owner is this process, was never touched.
    assert os.path.ismount(juicefs_clients.a) and os.path.ismount(juicefs_clients.b)
    assert juicefs_mount.sweep_abandoned(tmp_path) == []


def test_sweep_leaves_dirs_without_a_provably_dead_owner(tmp_path) -> None:
    no_owner = tmp_path / f"{juicefs_mount.PAIR_DIR_PREFIX}none"
    no_owner.mkdir()
    unreadable = tmp_path / f"{juicefs_mount.PAIR_DIR_PREFIX}junk"
    unreadable.mkdir()
    (unreadable / juicefs_mount.OWNER_FILE).write_text("{not json")
    live = tmp_path / f"{juicefs_mount.PAIR_DIR_PREFIX}live"
    live.mkdir()
    juicefs_mount._write_owner(live)
    reused = tmp_path / f"{juicefs_mount.PAIR_DIR_PREFIX}reused"
    reused.mkdir()
    # This process's pid with another start time: the pid was reused, the owner is dead.
    (reused / juicefs_mount.OWNER_FILE).write_text(json.dumps({"pid": os.getpid(), "start_time": -1}))
    (tmp_path / "unrelated").mkdir()

    assert juicefs_mount.sweep_abandoned(tmp_path) == [reused]
    assert not reused.exists()
    assert no_owner.is_dir() and unreadable.is_dir() and live.is_dir() and (tmp_path / "unrelated").is_dir()
