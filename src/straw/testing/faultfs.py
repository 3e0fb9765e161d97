"""An in-memory filesystem that loses, tears and garbles unsynced data on a seeded power loss.

``FaultFS(seed)`` implements :class:`straw._fs.system.System`. Install it with
``straw._fs.system.installed(fs)`` and every file-system call straw makes lands
here. It models exactly the assumptions docs/DURABILITY.md states (A1, A2, A8):

* Reads see every completed write at once (A2: one page cache).
* ``fdatasync``/``fsync`` of a file makes its bytes and size durable (A1).
* ``fsync`` of a directory makes the entries created, renamed, linked or
  removed in it durable (A1); until then each change may or may not survive.
  A rename within one directory is one atomic change: after a crash the target
  names the old file or the new one (A1).
* ``flock`` excludes every other open file description, and a crash releases
  every lock (A8).

:meth:`FaultFS.crash` is a power loss. For each file it keeps the synced bytes
plus a seeded prefix of the later writes in their order, tears the next write
at a random byte, and sometimes garbles one 512-byte sector inside a range an
unsynced write covered (never a byte no unsynced write touched: synced bytes
that nothing overwrote stay intact, per A1). Directory changes made since the
directory's last sync survive independently, each with even odds. Every open
descriptor becomes stale: a later call on it raises ``OSError(EBADF)``,
closing it does nothing (once). :meth:`FaultFS.fail_after` turns the n-th mutating
call into a :class:`SimulatedPowerLoss`, so a crash lands inside an operation;
until :meth:`FaultFS.crash` every call raises it but ``close``, which has
nothing left to close. Descriptor numbers are unique across the machines of a
process: one machine's descriptor never names an open file of another.

:meth:`FaultFS.fail_next` makes one chosen primitive raise ``OSError`` once
(``EIO``, or ``ENOSPC`` for a full disk), as a real disk may:

* ``write``: ``pwritev`` writes nothing or a seeded prefix, then raises;
* ``sync``: ``fsync``/``fdatasync`` raises and the file's unsynced changes stay
  unsynced. The failure is sticky (A3: retrying the sync proves nothing): a
  later successful sync of that file does not make those changes durable; at
  the next power loss each of them may still revert to the bytes that were
  durable before, except where a write made after the failure covered them
  (``sticky_sync_errors=False``: the next successful sync makes them durable);
* ``open``, ``truncate``, ``unlink``, ``mkdir``: raises, nothing changed;
* ``link``, ``rename``: raises; with even odds the change was made first (in
  the page cache, unsynced), as an error after the operation reached the disk.

Not modelled: several machines (one page cache only), crashes that reorder
synced data, a disk that stays full, bit rot of synced bytes, and permissions.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .._fs.system import System

Buffer = bytes | bytearray | memoryview

SECTOR_BYTES = 512
#: Fake descriptors start here so that a stray real ``os`` call on one fails (EBADF).
FIRST_FD = 1 << 20
#: Every simulated machine of the process draws its descriptor numbers from this one sequence,
#: so a descriptor of one machine (closed by a finalizer after its test ended, say) never names
#: an open file of the next.
_DESCRIPTOR_NUMBERS = itertools.count(FIRST_FD)
_ACCESS = os.O_RDONLY | os.O_WRONLY | os.O_RDWR
#: The primitives :meth:`FaultFS.fail_next` can make fail.
FAULT_KINDS = ("open", "write", "sync", "truncate", "link", "rename", "unlink", "mkdir")


class SimulatedPowerLoss(BaseException):
    """Raised by every call once :meth:`FaultFS.fail_after` fired: the machine lost power.

    A ``BaseException``, so ``except Exception`` (and straw's ``except OSError``) in the
    code under test cannot swallow it; the simulator catches it and calls ``crash()``.
    """


class SimulationDeadlock(RuntimeError):
    """A blocking ``flock`` would wait forever: the single-threaded simulation holds the lock."""


@dataclass(eq=False)
class _File:
    data: bytearray = field(default_factory=bytearray)
    synced: bytes = b""
    # Changes since the last sync, in order: (offset, bytes) for a write, an int for a truncate.
    pending: list[tuple[int, bytes] | int] = field(default_factory=list)
    # A3: writes left unsynced by a failed sync, the durable image they may revert to, and the
    # ranges written since the failure (those are certain once a later sync succeeds).
    doubtful: list[tuple[int, bytes]] = field(default_factory=list)
    doubt_base: bytes = b""
    since_doubt: list[tuple[int, int]] = field(default_factory=list)


@dataclass(eq=False)
class _Dir:
    entries: dict[str, _File | _Dir] = field(default_factory=dict)
    synced: dict[str, _File | _Dir] = field(default_factory=dict)
    # Changes since the last sync, in order; each maps names to their new node (None: removed)
    # and is atomic (a rename changes two names at once).
    pending: list[dict[str, _File | _Dir | None]] = field(default_factory=list)


@dataclass
class _Fault:
    kind: str
    code: int
    skip: int
    path: str | None


@dataclass(eq=False)
class _Handle:
    node: _File | _Dir
    readable: bool
    writable: bool
    path: str


def _error(code: int, path: str | None = None) -> OSError:
    if path is None:
        return OSError(code, os.strerror(code))
    return OSError(code, os.strerror(code), path)


class FaultFS:
    """A seeded, in-memory, single-process filesystem with power-loss faults (see module docs)."""

    def __init__(
        self,
        seed: int,
        *,
        garble_probability: float = 0.25,
        tear_probability: float = 0.5,
        short_write_probability: float = 0.05,
        sticky_sync_errors: bool = True,
    ) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.garble_probability = garble_probability
        self.tear_probability = tear_probability
        self.short_write_probability = short_write_probability
        #: A3 as written: a later sync does not vouch for what a failed one left (module docs).
        #: False models a kernel whose next successful sync writes those bytes after all.
        self.sticky_sync_errors = sticky_sync_errors
        self.root = _Dir()
        self._fds: dict[int, _Handle] = {}
        #: Descriptors that were open when the machine last crashed: each may still be closed once.
        self._gone: set[int] = set()
        self._locks: dict[_File | _Dir, int] = {}
        self._countdown: int | None = None
        self.powered_off = False
        #: Mutating calls so far (writes, syncs, truncates, directory changes, creations).
        self.mutations = 0
        self.crashes = 0
        #: What the last crash did, for failure messages: per path, "kept k of n", "torn", "garbled".
        self.last_crash: list[str] = []
        self._fault: _Fault | None = None
        #: Every error :meth:`fail_next` injected so far: "kind: errno name on path".
        self.injected: list[str] = []

    # -- fault control ---------------------------------------------------------------

    def fail_after(self, calls: int | None) -> None:
        """Lose power at the ``calls``-th mutating call from now (1 = the next); None disarms."""
        if calls is not None and calls < 1:
            raise ValueError(f"calls must be >= 1, got {calls}")
        self._countdown = calls

    def fail_next(self, kind: str, code: int = errno.EIO, *, skip: int = 0, path: str | None = None) -> None:
        """Make the next ``kind`` call (after ``skip`` others) raise ``OSError(code)`` once (module docs).

        With ``path``, only calls on that path count (for descriptors: the path they were
        opened by; for rename and link: the target). One fault is armed at a time; arming
        replaces it. :meth:`crash` disarms it.
        """
        if kind not in FAULT_KINDS:
            raise ValueError(f"kind must be one of {FAULT_KINDS}, got {kind!r}")
        if skip < 0:
            raise ValueError(f"skip must be >= 0, got {skip}")
        self._fault = _Fault(kind, code, skip, None if path is None else os.path.normpath(path))

    def disarm(self) -> bool:
        """Drop the armed fault; True if one was armed and had not fired."""
        armed = self._fault is not None
        self._fault = None
        return armed

    def _fires(self, kind: str, path: str) -> int | None:
        """The errno to raise if the armed fault fires at this ``kind`` call on ``path``, else None."""
        fault = self._fault
        if fault is None or fault.kind != kind:
            return None
        if fault.path is not None and fault.path != os.path.normpath(path):
            return None
        if fault.skip > 0:
            fault.skip -= 1
            return None
        self._fault = None
        return fault.code

    def _injected(self, kind: str, code: int, path: str, note: str = "", *, named: bool = True) -> OSError:
        self.injected.append(f"{kind}: {errno.errorcode.get(code, code)} on {path}{note}")
        return _error(code, path if named else None)

    def _mutate(self) -> None:
        self._alive()
        self.mutations += 1
        if self._countdown is not None:
            self._countdown -= 1
            if self._countdown == 0:
                self._countdown = None
                self.powered_off = True
                raise SimulatedPowerLoss(f"simulated power loss at mutating call {self.mutations}")

    def _alive(self) -> None:
        if self.powered_off:
            raise SimulatedPowerLoss("the simulated machine has lost power; call crash() to reboot")

    def crash(self) -> None:
        """Power loss and reboot: keep what is durable plus a seeded part of the rest (module docs)."""
        self.crashes += 1
        self.last_crash = []
        files: list[tuple[str, _File]] = []
        dirs: list[tuple[str, _Dir]] = []
        self._collect("/", self.root, files, dirs, set())
        for path, node in files:
            self._crash_file(path, node)
        for path, directory in dirs:
            self._crash_dir(path, directory)
        self._gone |= self._fds.keys()
        self._fds.clear()
        self._locks.clear()
        self._countdown = None
        self._fault = None
        self.powered_off = False

    def _collect(
        self,
        path: str,
        directory: _Dir,
        files: list[tuple[str, _File]],
        dirs: list[tuple[str, _Dir]],
        seen: set[int],
    ) -> None:
        """Every node reachable now, as of the last sync, or through an unsynced change."""
        if id(directory) in seen:
            return
        seen.add(id(directory))
        dirs.append((path, directory))
        children: dict[str, _File | _Dir] = {}
        for change in directory.pending:
            children.update((k, v) for k, v in change.items() if v is not None)
        children.update(directory.synced)
        children.update(directory.entries)
        for name in sorted(children):
            node = children[name]
            child = os.path.join(path, name)
            if isinstance(node, _Dir):
                self._collect(child, node, files, dirs, seen)
            elif id(node) not in seen:
                seen.add(id(node))
                files.append((child, node))

    def _crash_file(self, path: str, node: _File) -> None:
        if node.doubtful:
            self._revert_doubtful(path, node)
        if not node.pending:
            node.data = bytearray(node.synced)
            return
        rng = self.rng
        image = bytearray(node.synced)
        count = len(node.pending)
        kept = rng.randint(0, count)
        note = f"{path}: kept {kept} of {count} unsynced changes"
        for change in node.pending[:kept]:
            _apply(image, change)
        if kept < count and rng.random() < self.tear_probability:
            change = node.pending[kept]
            if isinstance(change, tuple) and len(change[1]) > 1:
                offset, data = change
                cut = rng.randrange(1, len(data))
                _apply(image, (offset, data[:cut]))
                note += f", tore the next write at byte {cut} of {len(data)}"
        writes = [c for c in node.pending if isinstance(c, tuple) and c[1]]
        if writes and rng.random() < self.garble_probability:
            offset, data = rng.choice(writes)
            sector = rng.randrange(offset // SECTOR_BYTES, (offset + len(data) - 1) // SECTOR_BYTES + 1)
            start = max(offset, sector * SECTOR_BYTES)
            end = min(offset + len(data), (sector + 1) * SECTOR_BYTES, len(image))
            if start < end:
                image[start:end] = rng.randbytes(end - start)
                note += f", garbled bytes {start}..{end}"
        node.data = image
        node.synced = bytes(image)
        node.pending = []
        self.last_crash.append(note)

    def _revert_doubtful(self, path: str, node: _File) -> None:
        """A3: changes a failed sync left behind may revert in the durable image, unless rewritten."""
        image = bytearray(node.synced)
        reverted = 0
        for offset, data in node.doubtful:
            if self.rng.random() < 0.5:
                continue
            reverted += 1
            for i in range(offset, min(offset + len(data), len(image))):
                if not any(start <= i < end for start, end in node.since_doubt):
                    image[i] = node.doubt_base[i] if i < len(node.doubt_base) else 0
        self.last_crash.append(f"{path}: {reverted} of {len(node.doubtful)} writes of a failed sync reverted")
        node.synced = bytes(image)
        node.doubtful = []
        node.since_doubt = []
        node.doubt_base = b""

    def _crash_dir(self, path: str, directory: _Dir) -> None:
        entries = dict(directory.synced)
        survived = 0
        for change in directory.pending:
            if self.rng.random() < 0.5:
                continue
            survived += 1
            for name, node in change.items():
                if node is None:
                    entries.pop(name, None)
                else:
                    entries[name] = node
        if directory.pending:
            self.last_crash.append(f"{path}/: {survived} of {len(directory.pending)} entry changes survived")
        directory.entries = entries
        directory.synced = dict(entries)
        directory.pending = []

    # -- paths -------------------------------------------------------------------------

    def _lookup(self, path: str) -> _File | _Dir:
        node: _File | _Dir = self.root
        for part in _parts(path):
            if not isinstance(node, _Dir):
                raise _error(errno.ENOTDIR, path)
            found = node.entries.get(part)
            if found is None:
                raise _error(errno.ENOENT, path)
            node = found
        return node

    def _parent(self, path: str) -> tuple[_Dir, str]:
        parts = _parts(path)
        if not parts:
            raise _error(errno.EBUSY, path)
        parent = self._lookup("/" + "/".join(parts[:-1]))
        if not isinstance(parent, _Dir):
            raise _error(errno.ENOTDIR, path)
        return parent, parts[-1]

    @staticmethod
    def _change(directory: _Dir, change: dict[str, _File | _Dir | None]) -> None:
        for name, node in change.items():
            if node is None:
                directory.entries.pop(name, None)
            else:
                directory.entries[name] = node
        directory.pending.append(change)

    # -- descriptors -------------------------------------------------------------------

    def _handle(self, fd: int) -> _Handle:
        self._alive()
        handle = self._fds.get(fd)
        if handle is None:
            raise _error(errno.EBADF)
        return handle

    def _file(self, fd: int, *, write: bool) -> _File:
        handle = self._handle(fd)
        if not isinstance(handle.node, _File):
            raise _error(errno.EISDIR)
        if not (handle.writable if write else handle.readable):
            raise _error(errno.EBADF)
        return handle.node

    def open(self, path: str, flags: int, mode: int = 0o777, /) -> int:
        self._alive()
        code = self._fires("open", path)
        if code is not None:
            raise self._injected("open", code, path)
        access = flags & _ACCESS
        try:
            node = self._lookup(path)
        except FileNotFoundError:
            if not flags & os.O_CREAT:
                raise
            parent, name = self._parent(path)
            self._mutate()
            node = _File()
            self._change(parent, {name: node})
        else:
            if flags & os.O_CREAT and flags & os.O_EXCL:
                raise _error(errno.EEXIST, path)
            if isinstance(node, _Dir) and access != os.O_RDONLY:
                raise _error(errno.EISDIR, path)
            if isinstance(node, _File) and flags & getattr(os, "O_DIRECTORY", 0):
                raise _error(errno.ENOTDIR, path)
            if isinstance(node, _File) and flags & os.O_TRUNC and access != os.O_RDONLY:
                self._mutate()
                _apply(node.data, 0)
                node.pending.append(0)
        fd = next(_DESCRIPTOR_NUMBERS)
        self._fds[fd] = _Handle(node, access != os.O_WRONLY, access != os.O_RDONLY, os.path.normpath(path))
        return fd

    def close(self, fd: int, /) -> None:
        if self.powered_off:
            # The descriptor went down with the machine (as after crash(), below): cleanup that
            # runs on after the power loss (a finally, a finalizer) has nothing left to close.
            return
        handle = self._fds.pop(fd, None)
        if handle is None:
            if fd in self._gone:
                self._gone.discard(fd)  # open before the last crash: already gone with the old kernel
                return
            raise _error(errno.EBADF)
        if self._locks.get(handle.node) == fd:
            del self._locks[handle.node]

    def pwritev(self, fd: int, buffers: Sequence[Buffer], offset: int, /) -> int:
        node = self._file(fd, write=True)
        data = b"".join(bytes(b) for b in buffers)
        if len(data) > 1 and self.rng.random() < self.short_write_probability:
            data = data[: self.rng.randrange(1, len(data))]  # a legal short write: callers resume
        code = self._fires("write", self._fds[fd].path)
        if code is not None:
            data = data[: self.rng.randrange(len(data) + 1)] if self.rng.random() < 0.5 else b""
            if data:
                self._mutate()
                self._record_write(node, (offset, data))
            raise self._injected("write", code, self._fds[fd].path, f" after {len(data)} bytes", named=False)
        self._mutate()
        self._record_write(node, (offset, data))
        return len(data)

    @staticmethod
    def _record_write(node: _File, change: tuple[int, bytes]) -> None:
        _apply(node.data, change)
        node.pending.append(change)
        if node.doubtful:
            node.since_doubt.append((change[0], change[0] + len(change[1])))

    def pread(self, fd: int, size: int, offset: int, /) -> bytes:
        node = self._file(fd, write=False)
        return bytes(node.data[offset : offset + size])

    def preadv(self, fd: int, buffers: Sequence[memoryview], offset: int, /) -> int:
        node = self._file(fd, write=False)
        total = 0
        for buffer in buffers:
            view = memoryview(buffer).cast("B")
            chunk = node.data[offset + total : offset + total + view.nbytes]
            view[: len(chunk)] = chunk
            total += len(chunk)
            if len(chunk) < view.nbytes:
                break
        return total

    def fdatasync(self, fd: int, /) -> None:
        self.fsync(fd)

    def start_writeback(self, fd: int, offset: int, size: int, /) -> None:
        self._file(fd, write=True)  # a hint: nothing becomes durable before a sync

    def fsync(self, fd: int, /) -> None:
        handle = self._handle(fd)
        node = handle.node
        code = self._fires("sync", handle.path)
        if code is not None:
            if self.sticky_sync_errors and isinstance(node, _File) and node.pending:
                if not node.doubtful:
                    node.doubt_base = node.synced
                node.doubtful.extend(c for c in node.pending if isinstance(c, tuple) and c[1])
            raise self._injected("sync", code, handle.path, named=False)
        self._mutate()
        if isinstance(node, _File):
            node.synced = bytes(node.data)
        else:
            node.synced = dict(node.entries)
        node.pending = []

    def ftruncate(self, fd: int, size: int, /) -> None:
        node = self._file(fd, write=True)
        if size < 0:
            raise _error(errno.EINVAL)
        code = self._fires("truncate", self._fds[fd].path)
        if code is not None:
            raise self._injected("truncate", code, self._fds[fd].path, named=False)
        self._mutate()
        _apply(node.data, size)
        node.pending.append(size)

    def fstat_size(self, fd: int, /) -> int:
        node = self._handle(fd).node
        return len(node.data) if isinstance(node, _File) else 4096

    def fstat_links(self, fd: int, /) -> int:
        """The names the open node has in the current tree (hard links counted)."""
        node = self._handle(fd).node
        if isinstance(node, _Dir):
            return 1
        count, todo = 0, [self.root]
        while todo:  # bounded by the simulated tree
            for child in todo.pop().entries.values():
                if child is node:
                    count += 1
                elif isinstance(child, _Dir):
                    todo.append(child)
        return count

    def map_private(self, fd: int, offset: int, size: int, /) -> memoryview:
        node = self._file(fd, write=False)  # a private copy, as a copy-on-write mapping behaves
        if offset + size > len(node.data):
            raise _error(errno.EINVAL)  # (a real mapping past the end would fault when touched)
        return memoryview(bytearray(node.data[offset : offset + size]))

    def flock(self, fd: int, operation: int, /) -> None:
        node = self._handle(fd).node
        holder = self._locks.get(node)
        if operation & fcntl.LOCK_UN:
            if holder == fd:
                del self._locks[node]
            return
        if not operation & fcntl.LOCK_EX:
            raise NotImplementedError("FaultFS models exclusive flock only")
        if holder is None or holder == fd:
            self._locks[node] = fd
            return
        if operation & fcntl.LOCK_NB:
            raise BlockingIOError(errno.EWOULDBLOCK, os.strerror(errno.EWOULDBLOCK))
        raise SimulationDeadlock("a blocking flock on a lock this single-threaded simulation holds")

    # -- names ---------------------------------------------------------------------------

    def rename(self, source: str, target: str, /) -> None:
        self._alive()
        node = self._lookup(source)
        source_dir, source_name = self._parent(source)
        target_dir, target_name = self._parent(target)
        existing = target_dir.entries.get(target_name)
        if existing is node:
            return
        if isinstance(existing, _Dir) or (existing is not None and isinstance(node, _Dir)):
            raise _error(errno.EISDIR, target)
        code = self._fires("rename", target)
        if code is not None and self.rng.random() < 0.5:
            raise self._injected("rename", code, target, " (not renamed)")
        self._mutate()
        if source_dir is target_dir:
            self._change(source_dir, {source_name: None, target_name: node})
        else:
            self._change(target_dir, {target_name: node})
            self._change(source_dir, {source_name: None})
        if code is not None:
            raise self._injected("rename", code, target, " (renamed)")

    def link(self, source: str, target: str, /) -> None:
        self._alive()
        node = self._lookup(source)
        if isinstance(node, _Dir):
            raise _error(errno.EPERM, source)
        directory, name = self._parent(target)
        if name in directory.entries:
            raise _error(errno.EEXIST, target)
        code = self._fires("link", target)
        if code is not None and self.rng.random() < 0.5:
            raise self._injected("link", code, target, " (not linked)")
        self._mutate()
        self._change(directory, {name: node})
        if code is not None:
            raise self._injected("link", code, target, " (linked)")

    def unlink(self, path: str, /) -> None:
        self._alive()
        node = self._lookup(path)
        if isinstance(node, _Dir):
            raise _error(errno.EISDIR, path)
        directory, name = self._parent(path)
        code = self._fires("unlink", path)
        if code is not None:
            raise self._injected("unlink", code, path)
        self._mutate()
        self._change(directory, {name: None})

    def mkdir(self, path: str, mode: int = 0o777, /) -> None:
        self._alive()
        directory, name = self._parent(path)
        if name in directory.entries:
            raise _error(errno.EEXIST, path)
        code = self._fires("mkdir", path)
        if code is not None:
            raise self._injected("mkdir", code, path)
        self._mutate()
        self._change(directory, {name: _Dir()})

    def rmdir(self, path: str, /) -> None:
        self._alive()
        node = self._lookup(path)
        if not isinstance(node, _Dir):
            raise _error(errno.ENOTDIR, path)
        if node.entries:
            raise _error(errno.ENOTEMPTY, path)
        directory, name = self._parent(path)
        self._mutate()
        self._change(directory, {name: None})

    def listdir(self, path: str, /) -> list[str]:
        self._alive()
        node = self._lookup(path)
        if not isinstance(node, _Dir):
            raise _error(errno.ENOTDIR, path)
        names = sorted(node.entries)
        self.rng.shuffle(names)  # no caller may depend on the order of a listing
        return names

    def exists(self, path: str, /) -> bool:
        self._alive()
        try:
            self._lookup(path)
        except OSError:
            return False
        return True

    def isdir(self, path: str, /) -> bool:
        self._alive()
        try:
            return isinstance(self._lookup(path), _Dir)
        except OSError:
            return False

    def getsize(self, path: str, /) -> int:
        self._alive()
        node = self._lookup(path)
        return len(node.data) if isinstance(node, _File) else 4096

    def islink(self, path: str, /) -> bool:
        """No symbolic links exist here (the simulation never makes one)."""
        self._alive()
        return False

    def realpath(self, path: str, /) -> str:
        self._alive()
        return os.path.normpath(path)

    # -- test helpers ----------------------------------------------------------------------

    def read_bytes(self, path: str) -> bytes:
        """The current content of a file (a test's view, no descriptor)."""
        node = self._lookup(path)
        if not isinstance(node, _File):
            raise _error(errno.EISDIR, path)
        return bytes(node.data)

    def makedirs_durable(self, path: str) -> None:
        """Create ``path`` and its parents as if they had existed before the simulation began."""
        node = self.root
        for part in _parts(path):
            child = node.entries.get(part)
            if child is None:
                child = _Dir()
                node.entries[part] = child
                node.synced[part] = child
            if not isinstance(child, _Dir):
                raise _error(errno.ENOTDIR, path)
            node = child


def _parts(path: str) -> list[str]:
    if not path.startswith("/"):
        raise ValueError(f"FaultFS needs absolute paths, got {path!r}")
    return [p for p in os.path.normpath(path).split("/") if p]


def _apply(image: bytearray, change: tuple[int, bytes] | int) -> None:
    if isinstance(change, int):
        del image[change:]
        if len(image) < change:
            image.extend(bytes(change - len(image)))
        return
    offset, data = change
    if len(image) < offset:
        image.extend(bytes(offset - len(image)))
    image[offset : offset + len(data)] = data


if TYPE_CHECKING:
    _CONFORMS: System = FaultFS(0)  # mypy checks that FaultFS implements the whole protocol
