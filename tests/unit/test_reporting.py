"""``straw.reporting``: reports published atomically (D0), removed durably (D0a), lock files,
and ``sync_tree`` (D0b).

A report must appear complete under its name (rename of a synced temporary file), replace an
existing report, leave no temporary file behind and return the absolute path it wrote. Lock
files exclude real other processes and are freed when the holder is killed.
"""

from __future__ import annotations

import contextlib
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from child_io import CHILD_TIMEOUT_S, children, read_line, send
from straw._fs import system
from straw.errors import StorageUnavailable
from straw.protocol import encode
from straw.reporting import remove_report, sync_tree, try_lock, write_report

REPORT = {"zeta": [3, 2, 1], "alpha": {"nested": "héllo ✓", "n": 1.5}, "ok": True, "none": None}


def test_writes_canonical_json_and_a_newline(tmp_path: Path) -> None:
    target = tmp_path / "report.json"
    returned = write_report(target, REPORT)
    assert returned == target
    assert isinstance(returned, Path)
    data = target.read_bytes()
    assert data == encode(REPORT) + b"\n"
    assert data == '{"alpha":{"n":1.5,"nested":"héllo ✓"},"none":null,"ok":true,"zeta":[3,2,1]}\n'.encode()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]


def test_accepts_a_string_path_and_returns_an_absolute_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    returned = write_report("relative.json", [1, 2])
    assert returned.is_absolute()
    assert returned == tmp_path / "relative.json"
    assert returned.read_bytes() == b"[1,2]\n"


def test_replaces_an_existing_report_atomically(tmp_path: Path) -> None:
    target = tmp_path / "report.json"
    target.write_bytes(b"old content that is longer than the new one " * 100)
    old_inode = target.stat().st_ino
    with target.open("rb") as reader:  # a reader of the old file keeps seeing the old file
        write_report(target, {"v": 2})
        assert reader.read(11) == b"old content"
    assert target.read_bytes() == b'{"v":2}\n'
    assert target.stat().st_ino != old_inode  # a new file was renamed over it, not rewritten in place
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]


def test_repeated_writes_leave_no_temporary_files(tmp_path: Path) -> None:
    target = tmp_path / "report.json"
    for number in range(5):
        write_report(target, {"round": number})
    assert target.read_bytes() == b'{"round":4}\n'
    assert os.listdir(tmp_path) == ["report.json"]


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_unencodable_value_raises_value_error_and_keeps_the_old_report(tmp_path: Path, bad: float) -> None:
    target = tmp_path / "report.json"
    write_report(target, {"v": 1})
    with pytest.raises(ValueError, match="NaN and Infinity are rejected"):
        write_report(target, {"v": bad})
    assert target.read_bytes() == b'{"v":1}\n'
    assert os.listdir(tmp_path) == ["report.json"]


def test_missing_directory_raises_storage_unavailable(tmp_path: Path) -> None:
    target = tmp_path / "absent" / "report.json"
    with pytest.raises(StorageUnavailable, match="writing report") as raised:
        write_report(target, {"v": 1})
    assert "No such file or directory" in str(raised.value)
    assert not (tmp_path / "absent").exists()


# --------------------------------------------------------------------------- remove_report


def test_remove_report_unlinks_and_syncs_the_directory(tmp_path: Path) -> None:
    target = write_report(tmp_path / "gone.json", {"v": 1})
    with counting_syncs() as synced:
        assert remove_report(target) is True
    assert not target.exists()
    assert synced == [str(tmp_path)]
    assert remove_report(target) is False
    assert remove_report(str(tmp_path / "never.json")) is False


def test_remove_report_bad_input(tmp_path: Path) -> None:
    (tmp_path / "dir").mkdir()
    with pytest.raises(IsADirectoryError, match="is a directory"):
        remove_report(tmp_path / "dir")
    assert (tmp_path / "dir").is_dir()
    with pytest.raises(TypeError, match="expected a path"):
        remove_report(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="non-empty"):
        remove_report("")


# --------------------------------------------------------------------------- try_lock

LOCK_CHILD = """
import sys
from straw.reporting import try_lock
held = try_lock(sys.argv[1])
print("locked" if held is not None else "busy", flush=True)
sys.stdin.readline()
"""


def lock_child(path: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", LOCK_CHILD, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_try_lock_excludes_other_processes_until_released_or_killed(tmp_path: Path) -> None:
    path = tmp_path / "session.lock"
    held = try_lock(path)
    assert held is not None and held.held and path.exists()
    child = lock_child(path)
    with children(child):
        assert read_line(child) == "busy\n"
        send(child, "\n")
        child.wait(timeout=CHILD_TIMEOUT_S)
    held.release()
    held.release()  # idempotent
    assert not held.held
    owner = lock_child(path)
    with children(owner):
        assert read_line(owner) == "locked\n"
        assert try_lock(path) is None  # the child holds it
        owner.kill()  # the kernel releases a dead holder's lock
        owner.wait(timeout=CHILD_TIMEOUT_S)
    with try_lock(path) as again:
        assert again is not None and again.held
        assert try_lock(path) is None  # a second descriptor of this process is refused too
    assert not again.held
    last = try_lock(path)
    assert last is not None
    last.release()


def test_try_lock_bad_input(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="directory does not exist"):
        try_lock(tmp_path / "absent" / "x.lock")
    assert not (tmp_path / "absent").exists()
    with pytest.raises(TypeError, match="expected a path"):
        try_lock(None)  # type: ignore[arg-type]


def test_forked_child_does_not_release_the_parents_lock(tmp_path: Path) -> None:
    path = tmp_path / "fork.lock"
    held = try_lock(path)
    assert held is not None
    pid = os.fork()
    if pid == 0:  # the child: releasing must only close its inherited descriptor
        held.release()
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    child = lock_child(path)
    with children(child):
        assert read_line(child) == "busy\n"
        send(child, "\n")
    held.release()


# --------------------------------------------------------------------------- sync_tree


@contextlib.contextmanager
def counting_syncs() -> Iterator[list[str]]:
    """Record the path of every fsync/fdatasync made through straw's filesystem seam."""
    synced: list[str] = []

    class Counting(system.OsSystem):
        @staticmethod
        def fsync(fd: int) -> None:
            synced.append(os.readlink(f"/proc/self/fd/{fd}"))
            os.fsync(fd)

        @staticmethod
        def fdatasync(fd: int) -> None:
            synced.append(os.readlink(f"/proc/self/fd/{fd}"))
            os.fdatasync(fd)

    with system.installed(Counting()):
        yield synced


def test_sync_tree_syncs_files_then_directories_deepest_first(tmp_path: Path) -> None:
    root = tmp_path / "iter_0000001"
    (root / "model" / "shard").mkdir(parents=True)
    (root / "model" / "shard" / "w.bin").write_bytes(b"x" * 100)
    (root / "model" / "meta.json").write_bytes(b"{}")
    (root / "empty").mkdir()
    (root / "top.txt").write_bytes(b"")
    with counting_syncs() as synced:
        sizes = sync_tree(root)
    assert sizes == {"model/shard/w.bin": 100, "model/meta.json": 2, "top.txt": 0}
    files = [str(root / name) for name in sizes]
    assert sorted(synced[: len(files)]) == sorted(files)
    directories = synced[len(files) :]
    assert set(directories) == {str(root / d) for d in ("model/shard", "model", "empty")} | {
        str(root),
        str(tmp_path),
    }
    depth = [d.count(os.sep) for d in directories]
    assert depth == sorted(depth, reverse=True)


def test_sync_tree_of_one_file(tmp_path: Path) -> None:
    (tmp_path / "model.pt").write_bytes(b"abc")
    with counting_syncs() as synced:
        assert sync_tree(str(tmp_path / "model.pt")) == {"model.pt": 3}
    assert synced == [str(tmp_path / "model.pt"), str(tmp_path)]


def test_sync_tree_refuses_symlinks_before_syncing(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    (root / "a").mkdir(parents=True)
    (root / "a" / "real.bin").write_bytes(b"1")
    (root / "a" / "zlink").symlink_to(root / "a" / "real.bin")
    with counting_syncs() as synced, pytest.raises(ValueError, match=r"symlink: .*a/zlink"):
        sync_tree(root)
    assert synced == []
    (root / "a" / "zlink").unlink()
    (tmp_path / "linked").symlink_to(root)
    with pytest.raises(ValueError, match=r"symlink: .*linked"):
        sync_tree(tmp_path / "linked")
    with pytest.raises(FileNotFoundError):
        sync_tree(tmp_path / "absent")
    os.mkfifo(root / "fifo")
    with pytest.raises(ValueError, match="regular files"):
        sync_tree(root)
