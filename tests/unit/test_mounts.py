"""_fs.mounts: the filesystem type under a path, read from the kernel's mount table."""

from __future__ import annotations

from pathlib import Path

import pytest

from straw._fs import mounts
from straw.backend import FilesystemBackend

TABLE = "\n".join(
    [
        "22 27 0:21 / /proc rw,relatime - proc proc rw",
        "27 1 254:0 / / rw,relatime - ext4 /dev/vda rw,discard",
        "25 24 0:23 / /dev/shm rw,relatime - tmpfs tmpfs rw,size=24683792k",
        "30 25 0:27 / /dev/shm rw,relatime - overlay-test none rw",  # mounted on top: it wins
        "61 27 0:50 / /mnt/jfs rw,relatime shared:41 - fuse.juicefs JuiceFS:straw rw,user_id=0",
        "62 27 0:51 / /mnt/my\\040pool rw - xfs /dev/vdb rw",
        "63 27 0:52 / /data/nfs rw - nfs4 server:/export rw",
        "not a mount line",
    ]
)


@pytest.mark.parametrize(
    ("path", "kind"),
    [
        ("/", "ext4"),
        ("/work/pool", "ext4"),
        ("/proc/self", "proc"),
        ("/dev/shm/pool", "overlay-test"),
        ("/mnt/jfs", "fuse.juicefs"),
        ("/mnt/jfs/pool/raw", "fuse.juicefs"),
        ("/mnt/jfsx/pool", "ext4"),  # a longer name is not inside /mnt/jfs
        ("/mnt/my pool/a", "xfs"),  # an escaped space in the mount point
        ("/data/nfs/pool", "nfs4"),
    ],
)
def test_the_deepest_mount_above_a_path_names_its_type(path: str, kind: str) -> None:
    assert mounts.filesystem_type(TABLE, path) == kind


def test_an_unreadable_table_names_nothing() -> None:
    assert mounts.filesystem_type("", "/work") is None
    assert mounts.filesystem_type("garbage\n1 2 3", "/work") is None


def test_only_local_filesystems_map_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert {"ext4", "xfs", "tmpfs"} <= mounts.LOCAL_FILESYSTEMS
    assert not {"fuse.juicefs", "nfs4", "ceph", "fuse"} & mounts.LOCAL_FILESYSTEMS
    table = tmp_path / "mountinfo"
    table.write_text(
        f"1 0 0:1 / / rw - ext4 /dev/a rw\n2 1 0:2 / {tmp_path} rw - fuse.juicefs JuiceFS:x rw\n"
    )
    monkeypatch.setattr(mounts, "MOUNT_TABLE", str(table))
    assert not FilesystemBackend(tmp_path / "pool").maps_reads
    assert FilesystemBackend("/somewhere/else").maps_reads
    monkeypatch.setattr(mounts, "MOUNT_TABLE", str(tmp_path / "missing"))
    assert not FilesystemBackend("/somewhere/else").maps_reads  # no table: every read copies
