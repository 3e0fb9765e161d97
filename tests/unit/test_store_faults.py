"""Faults while the record store writes or opens files: visibility waits, injected faults, OS errors.

* Visibility (D5.2): a missing file is retried along the backend's delays through the
  injected ``sleep`` (never real waiting), then ``StorageUnavailable``; a file that appears
  during the retries is read.
* Injected faults (docs/DURABILITY.md "Fault phases"): for a first write, an append, a
  standalone file and a rotation, every phase is discovered with a recording hook and then
  made to fail. Failures before the commit point raise the hook's own exception and leave
  no reference, no visible partial file (I7) and no later append after written bytes (I3);
  failures after it raise ``IndeterminateCommit`` and block the writer until the same
  submission is retried (I4, I5). Every earlier reference keeps reading byte-exact.
* OS errors: a failing ``fdatasync``/directory ``fsync`` and a really full tmpfs map to
  ``StorageUnavailable``/``QuotaExceeded`` with the OS text, and nothing acknowledged is lost.
"""

from __future__ import annotations

import contextlib
import errno
import os
import random
import shutil
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from straw._fs import system
from straw._pack import frame
from straw.backend import JUICEFS_REQUIRED, PEER_PHASES, FilesystemBackend
from straw.errors import (
    IdempotencyConflict,
    IndeterminateCommit,
    InvalidReference,
    QuotaExceeded,
    StorageUnavailable,
    WriterBusy,
)
from straw.limits import VISIBILITY_RETRY_DELAYS
from straw.protocol import Publication, Record, RecordSetRef
from straw.store import SharedFilesystemStore

RUN = "run-faults"
Written = list[tuple[RecordSetRef, list[tuple[str, bytes]]]]


# --------------------------------------------------------------------------- helpers


class Boom(Exception):
    """The failure a fault hook injects (not an OSError, so nothing translates it)."""


def _no_sleep(delay: float) -> None:
    raise AssertionError(f"unexpected visibility wait of {delay}s")


def payload(size: int, seed: int | str) -> bytes:
    return random.Random(seed).randbytes(size)


def records_for(name: str, size: int = 3000) -> list[Record]:
    return [Record(f"{name}-0", payload(size, f"{name}/0")), Record(f"{name}-1", payload(size // 3, name))]


def expected(records: list[Record]) -> list[tuple[str, bytes]]:
    return [(r.record_id, bytes(r.payload)) for r in records]


def read_all(store: SharedFilesystemStore, ref: RecordSetRef) -> list[tuple[str, bytes]]:
    return [(r.record_id, bytes(r.payload)) for r in store.read(ref)]


_OPENED: list[SharedFilesystemStore] = []


def _close_all() -> None:
    while _OPENED:
        with contextlib.suppress(Exception):
            _OPENED.pop().close()


@pytest.fixture(autouse=True)
def _close_stores() -> Iterator[None]:
    """Close every store a test opened: their descriptors are plain fds that GC does not close."""
    yield
    _close_all()


def open_store(
    root: Path,
    hook: Callable[[str], object] | None = None,
    *,
    backend: FilesystemBackend | None = None,
    **options: Any,
) -> SharedFilesystemStore:
    if backend is None:
        backend = FilesystemBackend(root, fault=hook, sleep=_no_sleep)
    store = SharedFilesystemStore(root, RUN, backend=backend, **options)
    _OPENED.append(store)
    return store


def publish(store: SharedFilesystemStore, name: str, written: Written, size: int = 3000) -> RecordSetRef:
    records = records_for(name, size)
    ref = store.publish(records, submission_id=name)
    written.append((ref, expected(records)))
    return ref


def assert_all_read(root: Path, written: Written) -> None:
    """Every reference returned so far reads back byte-exact through a fresh store."""
    reader = open_store(root)
    for ref, records in written:
        assert read_all(reader, ref) == records


def files(root: Path, suffixes: tuple[str, ...]) -> set[str]:
    """Names (relative to root) of every file under ``root/raw`` ending in one of ``suffixes``."""
    found = set()
    for directory, _, names in os.walk(root / "raw"):
        for name in names:
            if name.endswith(suffixes):
                found.add(os.path.relpath(os.path.join(directory, name), root))
    return found


def visible(root: Path) -> set[str]:
    return files(root, (".pack", ".seg"))


def temporaries(root: Path) -> set[str]:
    return files(root, (".tmp",))


def path_of(ref: RecordSetRef) -> str:
    return ref.manifest.segment.path


@dataclass
class FaultAt:
    """Fault hook: records every phase; raises :class:`Boom` at ``phase`` of write number ``write``."""

    phase: str | None = None
    write: int = 1
    writes: int = 0
    fired: bool = False
    seen: list[list[str]] = field(default_factory=lambda: [[]])

    def __call__(self, phase: str) -> None:
        if phase in PEER_PHASES:
            return  # the peer's names for these points (test_backend.py checks them)
        if phase == "before_publish":
            self.writes += 1
            self.seen.append([])
        self.seen[-1].append(phase)
        if not self.fired and phase == self.phase and self.writes == self.write:
            self.fired = True
            raise Boom(f"injected at {phase} of write {self.write}")


# --------------------------------------------------------------------------- visibility (D5.2)


def _missing_ref(root: Path) -> RecordSetRef:
    """A well-formed reference to a file that does not exist (yet)."""
    with open_store(root) as store:
        ref = store.publish(records_for("gone"), submission_id="gone")
    os.unlink(root / path_of(ref))
    return ref


@pytest.mark.parametrize("delays", [None, (0.125, 0.25, 0.5)], ids=["default-delays", "custom-delays"])
def test_missing_file_waits_along_the_delays_then_raises_storage_unavailable(
    tmp_path: Path, delays: tuple[float, ...] | None
) -> None:
    root = tmp_path / "pool"
    ref = _missing_ref(root)
    slept: list[float] = []
    options = {} if delays is None else {"visibility_delays": delays}
    backend = FilesystemBackend(root, sleep=slept.append, **options)
    store = open_store(root, backend=backend)
    with pytest.raises(StorageUnavailable, match="is not visible after") as caught:
        read_all(store, ref)
    assert slept == list(delays if delays is not None else VISIBILITY_RETRY_DELAYS)
    assert path_of(ref) in str(caught.value)
    assert type(caught.value) is StorageUnavailable
    # Each read waits again (nothing is cached about a missing file).
    slept.clear()
    with pytest.raises(StorageUnavailable, match=path_of(ref)):
        store.read_record(ref.manifest)
    assert slept == list(delays if delays is not None else VISIBILITY_RETRY_DELAYS)


def test_a_missing_writer_directory_is_different_storage_at_once_on_a_local_disk(tmp_path: Path) -> None:
    root = tmp_path / "pool"
    ref = _missing_ref(root)
    shutil.rmtree((root / path_of(ref)).parent)  # the pack is gone; the writer's LIVE file goes too
    slept: list[float] = []
    store = open_store(root, backend=FilesystemBackend(root, sleep=slept.append))
    with pytest.raises(InvalidReference, match="different storage"):
        read_all(store, ref)
    assert slept == []  # D2.1: a writer's directory is durable before any of its packs


def test_a_missing_writer_directory_waits_on_a_shared_mount_then_is_different_storage(tmp_path: Path) -> None:
    root = tmp_path / "pool"
    ref = _missing_ref(root)
    shutil.rmtree((root / path_of(ref)).parent)
    slept: list[float] = []
    declaration = {**JUICEFS_REQUIRED, "client_version": "test", "durability_description": "test"}
    backend = FilesystemBackend(root, profile="juicefs", declaration=declaration, sleep=slept.append)
    with pytest.raises(InvalidReference, match="different storage"):
        read_all(open_store(root, backend=backend), ref)
    assert slept == list(VISIBILITY_RETRY_DELAYS)  # the directory may show up late on this client


@pytest.mark.parametrize("appear_after", [1, 2, len(VISIBILITY_RETRY_DELAYS)])
def test_file_appearing_during_the_retries_is_read(tmp_path: Path, appear_after: int) -> None:
    root = tmp_path / "pool"
    records = records_for("late", 70_000)
    with open_store(root) as writer:
        ref = writer.publish(records, submission_id="late")
    final = root / path_of(ref)
    hidden = tmp_path / "hidden.pack"
    os.rename(final, hidden)
    slept: list[float] = []

    def sleep(delay: float) -> None:
        slept.append(delay)
        if len(slept) == appear_after:
            os.rename(hidden, final)  # the file becomes visible during this wait

    store = open_store(root, backend=FilesystemBackend(root, sleep=sleep))
    assert read_all(store, ref) == expected(records)
    assert slept == list(VISIBILITY_RETRY_DELAYS[:appear_after])


# --------------------------------------------------------------------------- injected faults

FIRST_WRITE = [
    "before_publish",
    "before_data_write",
    "after_data_write",
    "after_data_sync",
    "before_dir_sync",
    "after_dir_sync",
    "after_publish",
]
APPEND = ["before_publish", "before_data_write", "after_data_write", "after_data_sync", "after_publish"]
ROTATE = ["before_publish", "before_rotate", "before_seal_write", "after_seal_sync", *FIRST_WRITE[1:]]


@dataclass(frozen=True)
class Scenario:
    """Which write fails and what docs/DURABILITY.md says about each of its phases."""

    options: dict[str, Any]
    prior: int  # writes by the failing store before the failing one
    phases: list[str]  # phases of the failing write, in order
    uncertain: frozenset[str]  # phases after the commit point: IndeterminateCommit (after_publish
    # is after it too, but the reference is known good there: see _check_durable)
    new_file: bool  # the failing write creates a file (I7 applies)
    owes_dir_sync: frozenset[str] = frozenset()  # a retry repeats the directory sync


DIR_PHASES = frozenset({"before_dir_sync", "after_dir_sync"})
SCENARIOS = {
    "first-write": Scenario({}, 0, FIRST_WRITE, DIR_PHASES, True, DIR_PHASES),
    "append": Scenario({}, 2, APPEND, frozenset({"after_data_sync"}), False),
    "standalone": Scenario({"segment_target_bytes": 0}, 2, FIRST_WRITE, DIR_PHASES, True, DIR_PHASES),
    "rotate": Scenario({"segment_target_bytes": 6000}, 1, ROTATE, DIR_PHASES, True, DIR_PHASES),
}
CASES = [(name, phase) for name, scenario in SCENARIOS.items() for phase in scenario.phases]


def _earlier_writes(root: Path) -> Written:
    """References of another writer in the same pool, written before the faulty store exists."""
    written: Written = []
    with open_store(root) as other:
        publish(other, "other-0", written)
        publish(other, "other-1", written, size=300_000)
    return written


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_fault_phases_of_each_write_are_the_documented_ones(tmp_path: Path, name: str) -> None:
    scenario = SCENARIOS[name]
    root = tmp_path / "pool"
    hook = FaultAt()
    store = open_store(root, hook, **scenario.options)
    written: Written = []
    for i in range(scenario.prior + 1):
        publish(store, f"w{i}", written)
    assert hook.seen[scenario.prior + 1] == scenario.phases
    assert_all_read(root, written)


@pytest.mark.parametrize(("name", "phase"), CASES)
def test_fault_at_each_phase_loses_nothing_acknowledged(tmp_path: Path, name: str, phase: str) -> None:
    scenario = SCENARIOS[name]
    root = tmp_path / "pool"
    written = _earlier_writes(root)
    hook = FaultAt(phase, write=scenario.prior + 1)
    store = open_store(root, hook, **scenario.options)
    for i in range(scenario.prior):
        publish(store, f"prior-{i}", written)
    files_before = visible(root)
    records = records_for("failing")

    if phase == "after_publish":
        _check_durable(root, store, records, written)
    elif phase in scenario.uncertain:
        _check_uncertain(root, store, scenario, phase, records, written)
    else:
        _check_failed(root, store, scenario, phase, records, written, files_before)
    assert hook.fired
    # A fresh store (a new writer) on the same pool works, and nothing earlier is lost.
    with open_store(root, **scenario.options) as fresh:
        publish(fresh, "fresh", written)
    assert_all_read(root, written)
    assert temporaries(root) == set()


def _check_failed(
    root: Path,
    store: SharedFilesystemStore,
    scenario: Scenario,
    phase: str,
    records: list[Record],
    written: Written,
    files_before: set[str],
) -> None:
    """Before the commit point: the hook's error, no reference, no visible partial file."""
    with pytest.raises(Boom, match=f"injected at {phase}"):
        store.publish(records, submission_id="failing")
    assert_all_read(root, written)
    assert temporaries(root) == set()
    if scenario.new_file:
        assert visible(root) == files_before  # I7: the failed first extent never became visible
    last = path_of(written[-1][0])
    # The same submission id, never acknowledged, now writes the same content.
    ref = store.publish(records, submission_id="failing")
    written.append((ref, expected(records)))
    assert read_all(open_store(root), ref) == expected(records)
    if scenario.new_file or phase in ("before_data_write", "after_data_write"):
        # I3: after bytes may have been written, the writer never appends to that pack again.
        assert path_of(ref) not in {path_of(r) for r, _ in written[:-1]}
    elif phase == "before_publish":
        assert path_of(ref) == last  # nothing was written: the open pack is still used
    publish(store, "after", written)


def _check_durable(root: Path, store: SharedFilesystemStore, records: list[Record], written: Written) -> None:
    """At ``after_publish`` the extent is durable and known: the hook's own error reaches the
    caller unchanged (an OSError there is rechecked instead, test below), the retry answers
    with the reference and writes nothing, and other writes are not held back."""
    with pytest.raises(Boom, match="injected at after_publish"):
        store.publish(records, submission_id="failing")
    writes = store.metrics["writes"]
    ref = store.publish(records, submission_id="failing")
    assert store.metrics["writes"] == writes
    written.append((ref, expected(records)))
    assert read_all(open_store(root), ref) == expected(records)
    publish(store, "after", written)


def test_an_io_error_after_publish_is_rechecked_and_the_reference_returned(tmp_path: Path) -> None:
    root = tmp_path / "pool"
    store = open_store(root)
    written: Written = []
    publish(store, "first", written)

    def fault(phase: str) -> None:
        if phase == "after_publish":
            raise OSError(5, "reply lost")

    store.backend.fault = fault
    ref = publish(store, "second", written)
    store.backend.fault = None
    assert store.publish(records_for("second"), submission_id="second") == ref
    assert_all_read(root, written)


def test_an_io_error_after_publish_with_an_unreadable_extent_is_indeterminate(tmp_path: Path) -> None:
    root = tmp_path / "pool"
    store = open_store(root, backend=FilesystemBackend(root, sleep=lambda _: None, visibility_delays=(0.0,)))
    written: Written = []
    first = publish(store, "first", written)
    pack = root / path_of(first)

    def fault(phase: str) -> None:
        if phase == "after_publish":
            pack.rename(pack.with_suffix(".hidden"))
            raise OSError(5, "reply lost")

    store.backend.fault = fault
    with pytest.raises(IndeterminateCommit, match="could not be read back"):
        store.publish(records_for("second"), submission_id="second")
    store.backend.fault = None
    pack.with_suffix(".hidden").rename(pack)
    ref = store.publish(records_for("second"), submission_id="second")
    assert read_all(open_store(root), ref) == expected(records_for("second"))


def _check_uncertain(
    root: Path,
    store: SharedFilesystemStore,
    scenario: Scenario,
    phase: str,
    records: list[Record],
    written: Written,
) -> None:
    """After the commit point: IndeterminateCommit, then only the same submission resolves it (I5)."""
    with pytest.raises(IndeterminateCommit, match="retry the same submission") as caught:
        store.publish(records, submission_id="failing")
    assert isinstance(caught.value.__cause__, Boom)
    assert_all_read(root, written)
    with pytest.raises(WriterBusy, match="'failing' has an uncertain outcome"):
        store.publish(records_for("other"), submission_id="other")
    with pytest.raises(WriterBusy):
        store.write_records(records_for("other"), submission_id="other-records")
    with pytest.raises(IdempotencyConflict, match="other content"):
        store.publish(records_for("different"), submission_id="failing")
    with pytest.raises(IdempotencyConflict):
        store.write_records(records, submission_id="failing")  # same records, other kind of write

    dir_syncs = store.backend.metrics["dir_syncs"]
    ref = store.publish(records, submission_id="failing")
    assert store.backend.metrics["dir_syncs"] == dir_syncs + (phase in scenario.owes_dir_sync)
    written.append((ref, expected(records)))
    assert read_all(store, ref) == expected(records)
    assert read_all(open_store(root), ref) == expected(records)
    # Resolved: the id now answers idempotently and other writes work again.
    assert store.publish(records, submission_id="failing") == ref
    publish(store, "after", written)
    if scenario.new_file:
        assert (root / path_of(ref)).is_file()


def test_i3_failed_append_leaves_a_torn_tail_that_nothing_references(tmp_path: Path) -> None:
    root = tmp_path / "pool"
    hook = FaultAt("after_data_write", write=2)
    store = open_store(root, hook)
    written: Written = []
    first = publish(store, "first", written)
    pack = root / path_of(first)
    end = first.manifest.segment.offset + first.manifest.segment.size
    assert pack.stat().st_size == end
    with pytest.raises(Boom):
        publish(store, "torn", written, size=50_000)
    # The written but never-synced extent is still in the file: a crash could have torn it.
    assert pack.stat().st_size > end
    second = publish(store, "second", written)
    assert path_of(second) != path_of(first)
    assert pack.stat().st_size > end  # nobody appended after the torn bytes either
    store.close()
    assert_all_read(root, written)


# --------------------------------------------------------------------------- seal faults (D4)


def _seal_tail(pack: Path, end: int) -> tuple[int, int] | None:
    """The (extents, end) of the seal frame after byte ``end``, or None when there is none."""
    data = pack.read_bytes()[end:]
    if not data.strip(b"\0"):  # nothing, or the zeros an unsealed pack keeps ahead (D1.2a)
        return None
    return frame.parse_seal(frame.decode_json_frame(data, frame.KIND_SEAL, None))


@pytest.mark.parametrize(("phase", "sealed"), [("before_seal_write", False), ("after_seal_sync", True)])
@pytest.mark.parametrize("how", ["rotation", "seal", "close"])
def test_seal_fault_closes_the_pack_and_the_next_write_uses_a_new_one(
    tmp_path: Path, phase: str, sealed: bool, how: str
) -> None:
    root = tmp_path / "pool"
    hook = FaultAt()
    store = open_store(root, hook, segment_target_bytes=9000)
    written: Written = []
    publish(store, "a", written)
    last = publish(store, "b", written, size=300)
    pack = root / path_of(last)
    end = last.manifest.segment.offset + last.manifest.segment.size
    hook.phase, hook.write = phase, hook.writes + (how == "rotation")
    with pytest.raises(Boom, match=phase):
        if how == "rotation":
            publish(store, "c", written)
        elif how == "seal":
            store.seal()
        else:
            store.close()
    assert _seal_tail(pack, end) == ((2, end) if sealed else None)
    assert_all_read(root, written)
    if how == "close":
        return
    ref = publish(store, "d", written)
    assert path_of(ref) != path_of(last)
    assert _seal_tail(pack, end) == ((2, end) if sealed else None)  # never appended to again
    assert_all_read(root, written)


def test_fault_before_rotate_writes_nothing_and_the_retry_rotates(tmp_path: Path) -> None:
    root = tmp_path / "pool"
    hook = FaultAt("before_rotate", write=2)
    store = open_store(root, hook, segment_target_bytes=5000)
    written: Written = []
    first = publish(store, "first", written)
    pack = root / path_of(first)
    size = pack.stat().st_size
    files_before = visible(root)
    with pytest.raises(Boom):
        publish(store, "second", written)
    assert pack.stat().st_size == size and visible(root) == files_before
    second = publish(store, "second", written)
    assert path_of(second) != path_of(first)
    assert _seal_tail(pack, size) == (1, size)
    assert_all_read(root, written)


# --------------------------------------------------------------------------- OS errors


@dataclass
class FailingSync:
    """Replacement for ``os.fdatasync``/``os.fsync`` that fails with ``code`` while armed."""

    real: Callable[[int], None]
    code: int
    armed: bool = False
    calls: int = 0

    def __call__(self, fd: int) -> None:
        if self.armed:
            self.calls += 1
            raise OSError(self.code, os.strerror(self.code))
        self.real(fd)


@pytest.fixture
def failing_fdatasync(monkeypatch: pytest.MonkeyPatch) -> Callable[[int], FailingSync]:
    def install(code: int) -> FailingSync:
        fake = FailingSync(system.current.fdatasync, code)
        monkeypatch.setattr(system.current, "fdatasync", fake)
        return fake

    return install


ERRNOS = [
    (errno.EIO, StorageUnavailable, "Input/output error"),
    (errno.ENOSPC, QuotaExceeded, "No space left on device"),
    (errno.EDQUOT, QuotaExceeded, "Disk quota exceeded"),
]


@pytest.mark.parametrize(("code", "error", "text"), ERRNOS, ids=["EIO", "ENOSPC", "EDQUOT"])
@pytest.mark.parametrize("name", ["first-write", "append", "standalone"])
def test_failed_fdatasync_raises_storage_unavailable_and_loses_nothing(
    tmp_path: Path,
    failing_fdatasync: Callable[[int], FailingSync],
    name: str,
    code: int,
    error: type[StorageUnavailable],
    text: str,
) -> None:
    scenario = SCENARIOS[name]
    root = tmp_path / "pool"
    written = _earlier_writes(root)
    store = open_store(root, **scenario.options)
    for i in range(scenario.prior):
        publish(store, f"prior-{i}", written)
    files_before = visible(root)
    sync = failing_fdatasync(code)
    sync.armed = True
    with pytest.raises(StorageUnavailable) as caught:
        publish(store, "failing", written)
    assert type(caught.value) is error
    assert text in str(caught.value) and "'failing'" in str(caught.value)
    assert isinstance(caught.value.__cause__, OSError) and caught.value.__cause__.errno == code
    assert sync.calls == 1
    sync.armed = False
    assert temporaries(root) == set()
    if scenario.new_file:
        assert visible(root) == files_before  # I7
    assert_all_read(root, written)
    # A3/I3: the unsynced bytes are never built upon; the next write goes to a new file.
    ref = publish(store, "failing", written)
    assert path_of(ref) not in {path_of(r) for r, _ in written[:-1]}
    assert_all_read(root, written)


def test_failed_fdatasync_while_sealing_raises_storage_unavailable(
    tmp_path: Path, failing_fdatasync: Callable[[int], FailingSync]
) -> None:
    root = tmp_path / "pool"
    store = open_store(root)
    written: Written = []
    first = publish(store, "first", written)
    sync = failing_fdatasync(errno.EIO)
    sync.armed = True
    with pytest.raises(StorageUnavailable, match=r"sealing the current pack failed.*Input/output error"):
        store.seal()
    sync.armed = False
    second = publish(store, "second", written)
    assert path_of(second) != path_of(first)
    assert_all_read(root, written)


def test_failed_directory_fsync_after_rename_is_indeterminate_until_retried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "pool"
    store = open_store(root, segment_target_bytes=0)
    written: Written = []
    publish(store, "first", written)  # the writer directory exists from here on
    sync = FailingSync(system.current.fsync, errno.EIO)
    monkeypatch.setattr(system.current, "fsync", sync)
    sync.armed = True
    records = records_for("uncertain")
    with pytest.raises(IndeterminateCommit, match="'uncertain' may or may not be durable"):
        store.publish(records, submission_id="uncertain")
    # Retrying while the directory sync still fails reports the OS error and stays uncertain.
    with pytest.raises(StorageUnavailable, match=r"resolving submission 'uncertain'.*Input/output error"):
        store.publish(records, submission_id="uncertain")
    with pytest.raises(WriterBusy):
        publish(store, "other", written)
    sync.armed = False
    ref = store.publish(records, submission_id="uncertain")
    written.append((ref, expected(records)))
    publish(store, "other", written)
    assert_all_read(root, written)


# --------------------------------------------------------------------------- a really full disk


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Any:
    """A 2 MiB tmpfs mounted at ``tmp_path/small`` (root only); unmounted afterwards."""
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {result.stderr.strip() or result.returncode}")
    try:
        yield mount_point
    finally:
        _close_all()  # an open descriptor would keep the mount busy
        done = subprocess.run(["umount", str(mount_point)], capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            subprocess.run(["umount", "-l", str(mount_point)], capture_output=True, timeout=30, check=False)
            pytest.fail(f"tmpfs {mount_point} was still busy: {done.stderr.strip()}")


def test_full_disk_raises_quota_exceeded_and_loses_nothing(small_tmpfs: Path) -> None:
    spare = small_tmpfs / "spare"
    spare.write_bytes(bytes(400_000))
    root = small_tmpfs / "pool"
    store = open_store(root)
    written: Written = []
    caught: QuotaExceeded | None = None
    for i in range(100):  # 2 MiB / 100 KB: the disk is full long before
        try:
            publish(store, f"fill-{i}", written, size=100_000)
        except QuotaExceeded as error:
            caught = error
            break
    assert caught is not None, "a 2 MiB tmpfs never filled up"
    assert "No space left on device" in str(caught)
    assert "free space or raise the quota" in str(caught)
    assert len(written) >= 5
    assert_all_read(root, written)
    spare.unlink()
    ref = publish(store, "after", written, size=100_000)
    assert path_of(ref) not in {path_of(r) for r, _ in written[:-1]}  # I3
    assert_all_read(root, written)
    with open_store(root) as fresh:
        publish(fresh, "fresh", written, size=10_000)
    assert_all_read(root, written)


def test_full_disk_on_a_publish_many_loses_nothing(small_tmpfs: Path) -> None:
    root = small_tmpfs / "pool"
    store = open_store(root, segment_target_bytes=0)
    written: Written = []
    publish(store, "small", written, size=1000)
    big = [Publication(tuple(records_for(f"many-{i}", 500_000))) for i in range(4)]
    with pytest.raises(QuotaExceeded, match="No space left on device"):
        store.publish_many(big, submission_id="many")
    assert temporaries(root) == set()
    assert visible(root) == {path_of(written[0][0])}
    assert_all_read(root, written)
    refs = store.publish_many(big[:1], submission_id="one")
    written.append((refs[0], expected(list(big[0].records))))
    assert_all_read(root, written)


def test_i1_failed_sync_of_the_new_writer_directory_is_redone_before_a_reference(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "pool"
    store = open_store(root)
    sync = FailingSync(system.current.fsync, errno.EIO)
    monkeypatch.setattr(system.current, "fsync", sync)
    sync.armed = True
    with pytest.raises(StorageUnavailable, match="Input/output error"):
        publish(store, "first", [])
    assert sync.calls == 1 and (root / "raw" / store.writer_id).is_dir()
    sync.armed = False
    synced: list[str] = []
    real_sync_dir = store.backend.sync_dir

    def recording(path: str | os.PathLike[str]) -> None:
        synced.append(os.fspath(path))
        real_sync_dir(path)

    monkeypatch.setattr(store.backend, "sync_dir", recording)
    written: Written = []
    publish(store, "second", written)
    assert_all_read(root, written)
    # The directory entry of raw/<writer> lives in raw/: it must have been synced now.
    assert str(root / "raw") in synced
