"""Which filesystem holds a path, from the kernel's mount table (``/proc/self/mountinfo``).

Reads use it to decide whether a large payload may be mapped instead of copied
(docs/DURABILITY.md D5.6a): only where the kernel keeps an unlinked file's pages
for as long as a mapping holds them and nothing but this machine changes the file.
"""

from __future__ import annotations

import os

MOUNT_TABLE = "/proc/self/mountinfo"

#: Filesystems whose files this machine alone changes, and whose unlinked files stay readable
#: through an open mapping. A network or FUSE mount (JuiceFS, NFS, CephFS, ...) is missing on
#: purpose: another client may collect a pack whose pages this one has mapped, and a page
#: evicted and faulted in again would then end the process with SIGBUS instead of an error.
LOCAL_FILESYSTEMS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "tmpfs", "zfs", "f2fs", "bcachefs"})


def _unescape(field: str) -> str:
    """Mount points escape space, tab, newline and backslash as octal (``\\040``)."""
    if "\\" not in field:
        return field
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def filesystem_type(table: str, path: str) -> str | None:
    """The type of the filesystem mounted deepest above absolute ``path`` in ``table`` (the text
    of a mountinfo file); the last of several mounts on one point is the one on top."""
    best: tuple[int, str] | None = None
    for line in table.splitlines():
        fields = line.split(" ")
        if len(fields) < 10 or "-" not in fields[6:]:
            continue
        point = _unescape(fields[4])
        separator = fields.index("-", 6)
        kind = fields[separator + 1]
        inside = path == point or point == "/" or path.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= best[0]):
            best = (len(point), kind)
    return None if best is None else best[1]


def is_local(path: str) -> bool:
    """Whether ``path`` lies on a filesystem of LOCAL_FILESYSTEMS (False where the mount table
    cannot be read: on other systems every read copies)."""
    try:
        with open(MOUNT_TABLE, encoding="utf-8", errors="replace") as handle:
            table = handle.read()
    except OSError:
        return False
    kind = filesystem_type(table, os.path.realpath(path))
    return kind in LOCAL_FILESYSTEMS
