"""Filesystem backend: profiles, path safety, the fault hook and sync counters (API.md section 4).

The backend is the store's only view of the filesystem's declared properties.
It maps reference paths to files (refusing any path that could leave the
pool), records the deployment declaration of shared mounts, counts syncs, and
calls the test ``fault(phase)`` hook at the named phases of docs/DURABILITY.md.
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ._fs import mounts, posix
from .errors import InvalidReference
from .limits import VISIBILITY_RETRY_DELAYS

__all__ = ["JUICEFS_REQUIRED", "PEER_ALIASES", "PEER_PHASES", "PROFILES", "FilesystemBackend"]

PROFILES = ("local", "juicefs")

#: Settings a JuiceFS deployment must declare (docs/DURABILITY.md, assumption A5).
JUICEFS_REQUIRED: Mapping[str, object] = {
    "direct_mount": True,
    "writeback": False,
    "open_cache": 0,
    "readdir_cache": False,
}
_JUICEFS_TEXT = ("client_version", "durability_description")

FaultHook = Callable[[str], object]

#: The peer library's names for points where straw has a phase of its own (docs/DURABILITY.md,
#: "Fault phases"): the hook hears straw's name, then each of these at the same point. Code
#: written against the peer (slime's tests inject at ``before_directory_sync``) keeps working.
PEER_ALIASES: Mapping[str, tuple[str, ...]] = {
    "before_data_write": ("after_segment_header",),
    "after_data_write": ("after_record", "before_footer"),
    "after_journal_append": ("after_journal_part",),
    "before_completion_reply": ("before_complete_reply",),
    "before_catalog_write": ("before_storage_catalog_write",),
    "after_catalog_sync": ("after_storage_catalog_sync",),
    "after_tombstone": ("after_gc_tombstone",),
    "before_unlink": ("before_gc_unlink",),
}
#: Peer phases straw calls at points of their own: before every file and directory sync, and
#: once per written payload chunk (after the extent's bytes are written, before its sync).
PEER_PHASES = frozenset(
    {"before_file_sync", "before_directory_sync", "after_payload_chunk"}
    | {alias for names in PEER_ALIASES.values() for alias in names}
)


def _check_declaration(profile: str, declaration: Mapping[str, Any] | None) -> dict[str, Any]:
    if profile not in PROFILES:
        raise ValueError(f"unknown profile {profile!r}; choose one of {', '.join(PROFILES)}")
    if declaration is not None and not isinstance(declaration, Mapping):
        raise ValueError(f"declaration must be a mapping, got {type(declaration).__name__}")
    values = dict(declaration or {})
    if profile != "juicefs":
        return values
    for key, wanted in JUICEFS_REQUIRED.items():
        if key not in values:
            raise ValueError(f"juicefs declaration is missing {key!r} (it must be {wanted!r})")
        value = values[key]
        if type(value) is not type(wanted) or value != wanted:
            raise ValueError(f"juicefs declaration has {key}={value!r}; straw requires {key}={wanted!r}")
    for key in _JUICEFS_TEXT:
        text = values.get(key)
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"juicefs declaration needs a non-empty string {key!r}")
    return values


class FilesystemBackend:
    """A mounted POSIX filesystem holding one pool under ``root``."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        profile: str = "local",
        declaration: Mapping[str, Any] | None = None,
        fault: FaultHook | None = None,
        sleep: Callable[[float], None] | None = None,
        visibility_delays: Sequence[float] = VISIBILITY_RETRY_DELAYS,
    ) -> None:
        self.root = Path(os.path.abspath(os.fspath(root)))
        self._root_text = str(self.root)  # the hot path joins text, not Path objects
        self.profile = profile
        self.declaration = _check_declaration(profile, declaration)
        self._fault = fault
        # Injected so tests drive the visibility retry without real waiting (STYLE.md habit 10).
        self.sleep = sleep if sleep is not None else time.sleep
        self.visibility_delays = tuple(visibility_delays)
        self.metrics: dict[str, int] = {"syncs": 0, "file_syncs": 0, "dir_syncs": 0, "files_created": 0}
        self._real_root: str | None = None
        self._maps_reads: bool | None = None

    def __repr__(self) -> str:
        return f"FilesystemBackend({str(self.root)!r}, profile={self.profile!r})"

    # -- test hook -------------------------------------------------------------

    @property
    def fault(self) -> Callable[[str], None]:
        """Call with a phase name to reach the injected hook (docs/DURABILITY.md lists the
        phases); assign a callable (or None) to replace the hook, as the peer's tests do."""
        return self._call_fault

    @fault.setter
    def fault(self, hook: FaultHook | None) -> None:
        self._fault = hook

    @property
    def fault_hooked(self) -> bool:
        """Whether a hook is installed (hot paths skip phase bookkeeping without one)."""
        return self._fault is not None

    def _call_fault(self, phase: str) -> None:
        hook = self._fault
        if hook is not None:
            hook(phase)
            for alias in PEER_ALIASES.get(phase, ()):
                hook(alias)

    # -- paths -----------------------------------------------------------------

    def path(self, relative: str) -> Path:
        """Map a reference path to a file in the pool, refusing anything that escapes it."""
        return Path(self.resolve(relative))

    def resolve(self, relative: str) -> str:
        """Like :meth:`path` but returns ``str`` (the hot read path uses this)."""
        if not isinstance(relative, str):
            raise InvalidReference(f"path must be a string, got {type(relative).__name__}")
        if not relative or relative.startswith("/") or "\\" in relative or "\x00" in relative:
            raise InvalidReference(f"unsafe path {relative!r}: must be relative, POSIX, non-empty")
        parts = relative.split("/")
        if any(part in ("", ".", "..") for part in parts):
            raise InvalidReference(f"unsafe path {relative!r}: empty, '.' or '..' component")
        full = os.path.join(self._root_text, relative)
        if self._no_link_inside(parts):
            return full  # then the real path is the pool's real root joined with ``relative``
        real = os.path.realpath(full)
        base = self.real_root()
        if real != full and not real.startswith(base + os.sep):
            raise InvalidReference(f"unsafe path {relative!r}: a symlink leads outside the pool")
        return full

    def _no_link_inside(self, parts: list[str]) -> bool:
        """Whether no existing component of the path below the root is a symlink: only such a
        link can lead outside the pool, so ``realpath`` (which also walks the root's own
        components, on every call) is needed only when one is found."""
        path = self._root_text
        for part in parts:
            path = os.path.join(path, part)
            try:
                if stat.S_ISLNK(os.lstat(path).st_mode):
                    return False
            except FileNotFoundError:
                return True  # nothing below a missing component exists, links included
            except OSError:
                return False  # let realpath decide, as before
        return True

    def real_root(self) -> str:
        if self._real_root is None:
            self._real_root = os.path.realpath(self.root)
        return self._real_root

    @property
    def maps_reads(self) -> bool:
        """Whether large reads may share the pack's pages instead of copying them: the pool is on
        a local filesystem (``_fs.mounts.LOCAL_FILESYSTEMS``; docs/DURABILITY.md D5.6a)."""
        if self._maps_reads is None:
            self._maps_reads = mounts.is_local(self._root_text)
        return self._maps_reads

    # -- counted syncs (the only way the store reaches fsync) ----------------------

    def sync_file(self, fd: int) -> None:
        if self._fault is not None:
            self._fault("before_file_sync")
        posix.sync_file(fd)
        self.metrics["syncs"] += 1
        self.metrics["file_syncs"] += 1

    def sync_dir(self, path: str | os.PathLike[str]) -> None:
        if self._fault is not None:
            self._fault("before_directory_sync")
        posix.sync_dir(os.fspath(path))
        self.metrics["syncs"] += 1
        self.metrics["dir_syncs"] += 1

    def open_visible(self, path: str) -> int:
        """Open a file for reading, waiting a bounded time for it to become visible."""
        return posix.retry_open(path, self.visibility_delays, self.sleep)

    def diagnostics(self) -> dict[str, Any]:
        return {
            "root": str(self.root),
            "profile": self.profile,
            "declaration": dict(self.declaration),
            "declaration_verified": False,
            # The peer's names for the same facts: the declaration is recorded, not checked, and
            # nothing here certifies a multi-machine deployment.
            "mount_options_automatically_verified": False,
            "multi_machine_admission": "not_verified",
            "directory_sync": "after every file creation or rename; errors are fatal",
            "file_sync": "fdatasync before a reference is returned",
            "visibility_retry_seconds": sum(self.visibility_delays),
        }
