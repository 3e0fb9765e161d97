"""The fault-injecting filesystem of the simulation (straw.testing.faultfs) against its model.

What a power loss may and may not do follows docs/DURABILITY.md (A1, A2, A8): synced bytes
and synced directory entries always survive; anything later may vanish, be torn to a
prefix, or (inside the range an unsynced write covered) be garbled.
"""

from __future__ import annotations

import errno
import fcntl
import os

import pytest

from straw._fs import durable, posix, system
from straw.testing import FaultFS, SimulatedPowerLoss, SimulationDeadlock

SEEDS = range(60)
W = os.O_WRONLY | os.O_CREAT
RW = os.O_RDWR | os.O_CREAT


def fresh(seed: int, **options: float) -> FaultFS:
    fs = FaultFS(seed, **options)
    fs.makedirs_durable("/d")
    return fs


def durable_file(fs: FaultFS, path: str, data: bytes) -> int:
    """Create ``path`` with ``data``, sync it and its directory; return the open descriptor."""
    fd = fs.open(path, W, 0o644)
    write_all(fs, fd, data, 0)
    fs.fdatasync(fd)
    dfd = fs.open(os.path.dirname(path), os.O_RDONLY)
    fs.fsync(dfd)
    fs.close(dfd)
    return fd


def write_all(fs: FaultFS, fd: int, data: bytes, offset: int) -> None:
    while data:
        n = fs.pwritev(fd, [data], offset)
        data, offset = data[n:], offset + n


@pytest.mark.parametrize("seed", SEEDS)
def test_synced_data_survives_every_crash(seed: int) -> None:
    fs = fresh(seed, garble_probability=1.0)
    fd = durable_file(fs, "/d/f", b"durable" * 100)
    write_all(fs, fd, b"x" * 2000, 700)  # unsynced, after the synced bytes
    fs.crash()
    data = fs.read_bytes("/d/f")
    assert data[:700] == b"durable" * 100
    assert len(data) <= 2700


def test_unsynced_data_may_vanish_or_survive() -> None:
    outcomes = set()
    for seed in SEEDS:
        fs = fresh(seed, garble_probability=0.0, short_write_probability=0.0)
        fd = durable_file(fs, "/d/f", b"")
        fs.pwritev(fd, [b"late"], 0)
        fs.crash()
        outcomes.add(fs.read_bytes("/d/f"))
    assert b"" in outcomes and b"late" in outcomes
    assert outcomes <= {b"", b"l", b"la", b"lat", b"late"}


@pytest.mark.parametrize("seed", SEEDS)
def test_torn_write_leaves_a_prefix(seed: int) -> None:
    fs = fresh(seed, garble_probability=0.0, tear_probability=1.0, short_write_probability=0.0)
    fd = durable_file(fs, "/d/f", b"")
    payload = bytes(range(256)) * 8
    fs.pwritev(fd, [payload], 0)
    fs.crash()
    data = fs.read_bytes("/d/f")
    assert payload.startswith(data)


def test_garbling_stays_inside_the_unsynced_range() -> None:
    garbled = 0
    for seed in SEEDS:
        fs = fresh(seed, garble_probability=1.0, short_write_probability=0.0)
        fd = durable_file(fs, "/d/f", b"A" * 1500)
        fs.pwritev(fd, [b"B" * 600], 1500)
        fs.crash()
        data = fs.read_bytes("/d/f")
        assert data[:1500] == b"A" * 1500
        tail = data[1500:]
        garbled += tail != b"B" * len(tail)
        assert len(tail) <= 600
    assert garbled > 0


def test_directory_entries_need_a_directory_sync() -> None:
    survived = []
    for seed in SEEDS:
        fs = fresh(seed)
        fd = fs.open("/d/new", W, 0o644)
        write_all(fs, fd, b"data", 0)
        fs.fdatasync(fd)  # the bytes are durable, the name is not
        fs.crash()
        survived.append(fs.exists("/d/new"))
    assert any(survived) and not all(survived)
    for seed in SEEDS:
        fs = fresh(seed)
        durable_file(fs, "/d/new", b"data")
        fs.crash()
        assert fs.read_bytes("/d/new") == b"data"


@pytest.mark.parametrize("seed", SEEDS)
def test_rename_is_atomic_across_a_crash(seed: int) -> None:
    fs = fresh(seed)
    durable_file(fs, "/d/target", b"old")
    durable_file(fs, "/d/.temp", b"new")
    fs.rename("/d/.temp", "/d/target")
    fs.crash()
    assert fs.read_bytes("/d/target") in (b"old", b"new")
    assert fs.exists("/d/.temp") == (fs.read_bytes("/d/target") == b"old")


def test_crash_makes_descriptors_stale_and_drops_locks() -> None:
    fs = fresh(0)
    fd = durable_file(fs, "/d/LOCK", b"")
    fs.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    other = fs.open("/d/LOCK", os.O_RDWR)
    with pytest.raises(BlockingIOError):
        fs.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    with pytest.raises(SimulationDeadlock):
        fs.flock(other, fcntl.LOCK_EX)
    fs.crash()
    with pytest.raises(OSError) as stale:
        fs.pread(fd, 1, 0)
    assert stale.value.errno == errno.EBADF
    fs.close(fd)  # closing a descriptor of the old generation does nothing
    again = fs.open("/d/LOCK", os.O_RDWR)
    fs.flock(again, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the crash released the old holder
    fs.close(again)
    with pytest.raises(OSError) as double:
        fs.close(again)
    assert double.value.errno == errno.EBADF
    assert fd >= 1 << 20  # a stray real os call on a fake descriptor fails


def test_link_count_of_an_open_file_follows_its_names() -> None:
    fs = fresh(0)
    fs.close(durable_file(fs, "/d/a", b"x"))
    fd = fs.open("/d/a", os.O_RDONLY)
    assert fs.fstat_links(fd) == 1
    fs.link("/d/a", "/d/b")
    assert fs.fstat_links(fd) == 2
    fs.unlink("/d/a")
    fs.unlink("/d/b")
    assert fs.fstat_links(fd) == 0  # deleted, still open: its bytes are still readable
    assert fs.pread(fd, 1, 0) == b"x"
    fs.close(fd)


def test_fail_after_loses_power_inside_an_operation() -> None:
    fs = fresh(0)
    fs.fail_after(2)
    fd = fs.open("/d/f", W, 0o644)  # mutating call 1
    with pytest.raises(SimulatedPowerLoss):
        fs.pwritev(fd, [b"x"], 0)  # call 2: power is lost before it takes effect
    with pytest.raises(SimulatedPowerLoss):
        fs.exists("/d/f")  # the machine is off until it reboots
    fs.crash()
    assert not fs.powered_off
    assert fs.exists("/d") and (not fs.exists("/d/f") or fs.read_bytes("/d/f") == b"")


def test_close_after_a_power_loss_has_nothing_to_close() -> None:
    """Cleanup that runs on after the power loss (a finally, a finalizer) does not raise."""
    fs = fresh(0)
    fd = durable_file(fs, "/d/f", b"x")
    fs.fail_after(1)
    with pytest.raises(SimulatedPowerLoss):
        fs.pwritev(fd, [b"y"], 0)
    fs.close(fd)
    with pytest.raises(SimulatedPowerLoss):
        fs.pread(fd, 1, 0)
    fs.crash()
    assert fs.read_bytes("/d/f") == b"x"


def test_one_machines_descriptor_never_names_a_file_of_another() -> None:
    """A descriptor closed late (by a finalizer, after its simulation ended) on the next
    machine finds nothing of that machine's to close."""
    first, second = fresh(0), fresh(1)
    old = durable_file(first, "/d/f", b"first")
    new = durable_file(second, "/d/f", b"second")
    assert old != new
    with pytest.raises(OSError) as unknown:
        second.close(old)
    assert unknown.value.errno == errno.EBADF
    assert second.fstat_size(new) == len(b"second")  # still open
    second.close(new)
    first.close(old)


def test_a_crash_leaves_its_own_descriptors_closable_once_and_no_others() -> None:
    """After a crash, each descriptor the old kernel had open closes once (cleanup that runs
    on); a second close, or a close of another machine's descriptor drawn meanwhile, is EBADF."""
    first, second = fresh(0), fresh(1)
    old = durable_file(first, "/d/f", b"first")
    other = durable_file(second, "/d/g", b"second")  # drawn after `old`, before the crash
    first.crash()
    first.close(old)
    for fd in (old, other):
        with pytest.raises(OSError) as refused:
            first.close(fd)
        assert refused.value.errno == errno.EBADF
    assert second.fstat_size(other) == len(b"second")  # untouched
    second.close(other)


def _history(seed: int) -> list[object]:
    fs = fresh(seed)
    fd = durable_file(fs, "/d/f", b"base")
    for i in range(20):
        write_all(fs, fd, bytes([i]) * 700, 4 + i * 300)
        if i % 7 == 0:
            fs.fdatasync(fd)
    fs.mkdir("/d/sub", 0o755)
    fs.crash()
    return [fs.read_bytes("/d/f"), fs.exists("/d/sub"), fs.last_crash]


def test_same_seed_same_crash() -> None:
    assert _history(7) == _history(7)
    assert len({repr(_history(s)) for s in range(8)}) > 1


def test_straw_primitives_run_on_the_installed_system() -> None:
    fs = fresh(3, short_write_probability=0.5)
    before = system.current
    with system.installed(fs):
        assert system.current is fs
        durable.make_dirs("/d/pool/sub", "/d", posix.sync_dir)
        durable.replace_file("/d/pool/sub/file", [b"hello ", b"world" * 300], posix.sync_file, posix.sync_dir)
        assert posix.read_file("/d/pool/sub/file") == b"hello " + b"world" * 300
        assert posix.listdir("/d/pool/sub") == ["file"]
        assert posix.getsize("/d/pool/sub/file") == 1506
    assert system.current is before
    fs.crash()
    assert fs.read_bytes("/d/pool/sub/file") == b"hello " + b"world" * 300  # D0 made it durable


# -- injected I/O errors (fail_next) ------------------------------------------------------


def test_fail_next_rejects_unknown_kinds_and_negative_skips() -> None:
    fs = fresh(0)
    with pytest.raises(ValueError, match="kind must be one of"):
        fs.fail_next("read")
    with pytest.raises(ValueError, match="skip must be >= 0"):
        fs.fail_next("write", skip=-1)


@pytest.mark.parametrize("seed", SEEDS)
def test_failed_write_writes_nothing_or_a_prefix_once(seed: int) -> None:
    fs = fresh(seed, short_write_probability=0.0)
    fd = fs.open("/d/f", RW, 0o644)
    fs.fail_next("write", errno.ENOSPC)
    with pytest.raises(OSError) as caught:
        fs.pwritev(fd, [b"abcdefgh"], 0)
    assert caught.value.errno == errno.ENOSPC
    assert b"abcdefgh".startswith(fs.read_bytes("/d/f"))
    assert fs.injected[-1].startswith("write: ENOSPC")
    assert fs.pwritev(fd, [b"abcdefgh"], 0) == 8  # once only
    assert fs.read_bytes("/d/f") == b"abcdefgh"


def test_skip_lets_matching_calls_through_first() -> None:
    fs = fresh(0, short_write_probability=0.0)
    fd = fs.open("/d/f", RW, 0o644)
    fs.fail_next("write", skip=2)
    fs.pwritev(fd, [b"a"], 0)
    fs.fdatasync(fd)  # another kind does not count
    fs.pwritev(fd, [b"b"], 1)
    with pytest.raises(OSError) as caught:
        fs.pwritev(fd, [b"c"], 2)
    assert caught.value.errno == errno.EIO
    assert not fs.disarm()


def test_disarm_and_crash_drop_an_armed_fault() -> None:
    fs = fresh(0)
    fs.fail_next("open")
    assert fs.disarm()
    fs.close(fs.open("/d/f", W, 0o644))
    fs.fail_next("open")
    fs.crash()
    fs.close(fs.open("/d/g", W, 0o644))
    assert fs.injected == []


@pytest.mark.parametrize("kind", ["open", "unlink", "mkdir", "truncate"])
def test_failing_calls_change_nothing(kind: str) -> None:
    fs = fresh(0)
    fd = durable_file(fs, "/d/f", b"keep")
    fs.fail_next(kind, errno.EIO)
    with pytest.raises(OSError) as caught:
        if kind == "open":
            fs.open("/d/new", W, 0o644)
        elif kind == "unlink":
            fs.unlink("/d/f")
        elif kind == "mkdir":
            fs.mkdir("/d/sub")
        else:
            fs.ftruncate(fd, 0)
    assert caught.value.errno == errno.EIO
    assert sorted(fs.listdir("/d")) == ["f"]
    assert fs.read_bytes("/d/f") == b"keep"


@pytest.mark.parametrize("kind", ["link", "rename"])
def test_failed_link_or_rename_may_have_happened(kind: str) -> None:
    outcomes = set()
    for seed in SEEDS:
        fs = fresh(seed)
        durable_file(fs, "/d/src", b"x")
        fs.fail_next(kind)
        with pytest.raises(OSError):
            (fs.link if kind == "link" else fs.rename)("/d/src", "/d/dst")
        names = tuple(sorted(fs.listdir("/d")))
        outcomes.add(names)
        assert fs.read_bytes("/d/" + names[0]) == b"x"
        fs.crash()  # an unsynced change: the directory holds the old or the new entries
        assert tuple(sorted(fs.listdir("/d"))) in {("src",), names}
    changed = ("dst", "src") if kind == "link" else ("dst",)
    assert outcomes == {("src",), changed}


@pytest.mark.parametrize("seed", SEEDS)
def test_failed_sync_leaves_the_writes_unsynced(seed: int) -> None:
    fs = fresh(seed, garble_probability=0.0, tear_probability=0.0, short_write_probability=0.0)
    fd = durable_file(fs, "/d/f", b"old!")
    fs.pwritev(fd, [b"NEW!"], 0)
    fs.fail_next("sync")
    with pytest.raises(OSError):
        fs.fdatasync(fd)
    assert fs.read_bytes("/d/f") == b"NEW!"  # the page cache still has them (A2)
    fs.crash()
    assert fs.read_bytes("/d/f") in (b"old!", b"NEW!")


def test_a_later_sync_does_not_vouch_for_a_failed_one() -> None:
    """A3, sticky: bytes a failed sync left may revert even after a later sync returned."""
    outcomes = set()
    for seed in SEEDS:
        fs = fresh(seed, garble_probability=0.0, tear_probability=0.0, short_write_probability=0.0)
        fd = durable_file(fs, "/d/f", b"old!old!")
        fs.pwritev(fd, [b"NEW!"], 0)
        fs.fail_next("sync")
        with pytest.raises(OSError):
            fs.fdatasync(fd)
        fs.pwritev(fd, [b"late"], 4)  # written after the failure: the next sync makes it durable
        fs.fdatasync(fd)
        fs.crash()
        data = fs.read_bytes("/d/f")
        assert data[4:] == b"late"
        outcomes.add(data[:4])
    assert outcomes == {b"old!", b"NEW!"}


def test_a_crash_ends_the_doubt() -> None:
    fs = fresh(0, garble_probability=0.0, tear_probability=0.0, short_write_probability=0.0)
    fd = durable_file(fs, "/d/f", b"old!")
    fs.pwritev(fd, [b"NEW!"], 0)
    fs.fail_next("sync")
    with pytest.raises(OSError):
        fs.fdatasync(fd)
    fs.crash()
    after = fs.read_bytes("/d/f")
    for _ in range(10):
        fs.crash()
        assert fs.read_bytes("/d/f") == after


def test_straw_maps_injected_errors_to_its_own() -> None:
    from straw import SharedFilesystemStore
    from straw.backend import FilesystemBackend
    from straw.errors import QuotaExceeded, StorageUnavailable
    from straw.protocol import Record

    fs = fresh(0)
    with system.installed(fs):
        backend = FilesystemBackend("/d/pool", sleep=lambda _: None, visibility_delays=())
        store = SharedFilesystemStore("/d/pool", "run", backend=backend)
        fs.fail_next("write", errno.ENOSPC)
        with pytest.raises(QuotaExceeded, match="No space left"):
            store.publish([Record("a", b"x" * 100)], submission_id="a")
        fs.fail_next("sync", errno.EIO)
        with pytest.raises(StorageUnavailable, match="Input/output error"):
            store.publish([Record("b", b"y" * 100)], submission_id="b")
        ref = store.publish([Record("c", b"z" * 100)], submission_id="c")  # the store keeps working
        assert [bytes(r.payload) for r in store.read(ref)] == [b"z" * 100]
