"""The crash campaign (issue 6): torn and damaged log frames, and abrupt exits at every durable phase.

Part A, frames. A child process (tests/crash_campaign_child.py) runs a real workload and
ends abruptly right after an acknowledged call, so the last frame of the queue's journal
(or of the pool's catalog log) is that call's. Then, for every byte prefix of that frame
and for one bit flip at every byte of it, the test rewrites the file and reopens the pool:

* a prefix followed by the zeros written ahead of appends (DURABILITY.md J1.1) is a torn
  write: recovery keeps exactly the state before the frame and zeroes the torn bytes (I11, G2);
* a file that ends inside the frame or right after it, without those zeros, was cut short,
  which no crash does (J7): the open fails closed with ``CorruptData`` and changes nothing;
* a bit flip anywhere in that last frame is damage no later frame proves durable: the
  decision table cuts it like a torn write (its documented blind spot); it is never applied;
* a bit flip in the frame before it, which the last frame's recorded lag proves durable,
  fails closed: ``CorruptData``, nothing on disk changed, and ``straw check`` reports an
  error that ``--fix`` leaves alone;
* only the intact frame gives the state after the call.

States are compared through the public API (task status, commits, submissions; the
catalog's ``explain`` answers) plus the catalog's full state.

Part B, phases. The child is ended with ``os._exit(137)`` inside the backend's fault hook at
the N-th time it reaches a named durable phase (docs/DURABILITY.md "Fault phases"): publish,
rotate and seal, journal appends, completion replies, journal snapshots, catalog appends,
and the tombstones and unlinks of a collection. It prints every acknowledged operation
first, flushed. The parent then recovers (new store, ``Coordinator(recover=True)``), finds
every acknowledged operation present (publications read back byte-exact, receipts at the
same position with the same digest, retained owners still retain, released owners gone,
collected packs absent), collects garbage, finds the acknowledged data that is still owned
intact, runs ``straw check`` (``check_pool``: no error), then finishes the remaining work and
checks the pool again.

``make test`` samples (every 7th byte plus the first and last 8 and each header field
boundary; about 30 phase occurrences); ``make crash`` (``STRAW_CRASH_FULL=1``) covers every
byte and every occurrence of every phase.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import crash_campaign_child as child
import queue_helpers as qh
from straw._catalog.log import Catalog
from straw._journal import frame as jframe
from straw.backend import FilesystemBackend
from straw.coordinator import Coordinator
from straw.errors import CorruptData
from straw.protocol import CommitReceipt, Record, RecordSetRef, TaskSpec, as_dict
from straw.store import SharedFilesystemStore

pytestmark = pytest.mark.crash

CHILD = Path(child.__file__).resolve()
CHILD_TIMEOUT_S = 60.0
FULL = os.environ.get("STRAW_CRASH_FULL", "") not in ("", "0")
FULL_REASON = "the full crash campaign runs under `make crash` (STRAW_CRASH_FULL=1)"
#: Sampled byte positions in `make test`: every 7th (fewer in a frame longer than about
#: 1 KiB, so a sample stays near this many), plus the edges and field boundaries below.
SAMPLE_STRIDE = 7
SAMPLE_POSITIONS_MAX = 160
EDGE_BYTES = 8
#: Field boundaries of a journal frame header (FORMAT.md 8.2): magic, version, zero, seq,
#: length, chain, body digest, header checksum, body.
HEADER_FIELDS = (0, 4, 6, 8, 16, 24, 40, 56, 64)
#: Zeros after the last frame in the rewritten files (the space written ahead, J1.1).
ZERO_TAIL = 8192
H = jframe.FRAME_HEADER_BYTES

#: How often the child's complete workload reaches each fault phase (checked by a test).
PHASE_COUNTS = {
    "after_catalog_append": 19,
    "after_catalog_sync": 19,
    "after_data_sync": 16,
    "after_data_write": 16,
    "after_dir_sync": 8,
    "after_journal_append": 15,
    "after_journal_sync": 9,
    "after_publish": 16,
    "after_seal_sync": 4,
    "after_snapshot_write": 2,
    "after_tombstone": 1,
    "before_catalog_write": 19,
    "before_completion_reply": 6,
    "before_data_write": 16,
    "before_dir_sync": 8,
    "before_journal_write": 15,
    "before_publish": 16,
    "before_rotate": 3,
    "before_segment_cut": 2,
    "before_seal_write": 4,
    "before_snapshot_write": 2,
    "before_tombstone": 1,
    "before_unlink": 4,
}
#: Phases of the fault table the workload does not reach: catalog compaction needs a
#: 16 MiB catalog log (CATALOG_COMPACT_BYTES_MIN), too slow for a child run; a background
#: snapshot's segment switch needs the journal threshold lowered, which
#: tests/test_snapshot_crash.py does (it kills a child at each J5 phase).
UNREACHED_PHASES = {"before_catalog_compact", "before_segment_switch", "after_segment_switch"}
#: The occurrences `make test` runs: each phase at least once, at a point inside the
#: workload (input packs, the scratch writer, results, rotation, the final seal, the first
#: and the reopened coordinator, the collection's tombstone and unlinks).
SAMPLED_PHASES = [
    ("before_publish", 3),
    ("before_publish", 11),
    ("before_rotate", 2),
    ("before_data_write", 2),
    ("after_data_write", 8),
    ("after_data_sync", 1),
    ("after_data_sync", 2),
    ("after_data_sync", 13),
    ("before_dir_sync", 2),
    ("after_dir_sync", 6),
    ("after_publish", 9),
    ("after_publish", 15),
    ("before_seal_write", 2),
    ("after_seal_sync", 4),
    ("before_journal_write", 2),
    ("after_journal_append", 4),
    ("after_journal_sync", 2),
    ("after_journal_sync", 9),
    ("before_completion_reply", 2),
    ("before_completion_reply", 6),
    ("before_segment_cut", 1),
    ("before_snapshot_write", 1),
    ("after_snapshot_write", 1),
    ("before_catalog_write", 3),
    ("before_catalog_write", 11),
    ("after_catalog_append", 8),
    ("after_catalog_sync", 11),
    ("before_tombstone", 1),
    ("after_tombstone", 1),
    ("before_unlink", 1),
    ("before_unlink", 4),
]

_FULL_MARKS = [pytest.mark.slow, pytest.mark.skipif(not FULL, reason=FULL_REASON)]
COVERAGE = [pytest.param("sampled"), pytest.param("full", marks=_FULL_MARKS)]


def phase_params() -> list[Any]:
    sampled = [pytest.param(p, n, id=f"{p}-{n}") for p, n in SAMPLED_PHASES]
    chosen = set(SAMPLED_PHASES)
    full = [
        pytest.param(p, n, id=f"{p}-{n}-full", marks=_FULL_MARKS)
        for p, count in PHASE_COUNTS.items()
        for n in range(1, count + 1)
        if (p, n) not in chosen
    ]
    return sampled + full


# --------------------------------------------------------------------------- the child


def run_child(
    root: Path, phase: str = "none", nth: int = 0, stop: int = 0
) -> tuple[int, list[dict[str, Any]]]:
    """Run the workload; its exit status and every complete line it printed.

    The child imports ``queue_helpers`` from beside itself (a script's directory is on its path).
    """
    done = subprocess.run(
        [sys.executable, str(CHILD), str(root), phase, str(nth), str(stop)],
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
        check=False,
    )
    if done.returncode not in (0, child.CRASH_STATUS) or done.stderr:
        pytest.fail(f"child failed (rc={done.returncode}): {done.stderr[-3000:]}")
    # A line is acknowledged only once complete (the last element is "" or a cut line).
    return done.returncode, [json.loads(line) for line in done.stdout.split("\n")[:-1]]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The lines of one complete, uninterrupted run of the workload."""
    status, lines = run_child(tmp_path_factory.mktemp("reference") / "pool")
    assert status == 0
    return lines


def line_number(lines: list[dict[str, Any]], op: str, owner: str | None = None) -> int:
    """The 1-based number of the first line of ``op`` (and ``owner``)."""
    for number, line in enumerate(lines, start=1):
        if line["op"] == op and (owner is None or line.get("owner") == owner):
            return number
    raise AssertionError(f"the workload prints no {op} line")


def test_the_workload_reaches_every_phase_as_often_as_the_campaign_expects(
    reference: list[dict[str, Any]],
) -> None:
    *ops, last = reference
    assert last["op"] == "phases"
    assert last["counts"] == PHASE_COUNTS
    # Every phase of the fault table but those in UNREACHED_PHASES is reached.
    table = (Path(__file__).resolve().parents[1] / "docs" / "DURABILITY.md").read_text()
    named = {name for name in PHASE_COUNTS if f"`{name}`" in table}
    assert named == set(PHASE_COUNTS)
    assert all(f"`{name}`" in table for name in UNREACHED_PHASES)
    assert [line["op"] for line in ops].count("complete") == child.INPUTS
    assert ops[-1] == {"op": "end"}


# --------------------------------------------------------------------------- part A helpers


class NoSyncBackend(FilesystemBackend):
    """A backend that skips fsync: the frame cases test recovery's decisions on the bytes
    of a file, not durability, and reopen the pool hundreds of times."""

    def sync_file(self, fd: int) -> None:
        return None

    def sync_dir(self, path: str | os.PathLike[str]) -> None:
        return None


def quick_store(root: Path) -> SharedFilesystemStore:
    return child.open_store(root, NoSyncBackend(root, sleep=child.no_sleep, visibility_delays=(0.0,)))


def frame_extents(data: bytes) -> tuple[list[tuple[int, int]], jframe.Verdict]:
    """(start, end) of every valid frame of a segment or catalog log, and the verdict after them."""
    frames, verdict = qh.log_frames(data)
    return [(start, found.end) for start, found in frames], verdict


def positions(length: int, coverage: str) -> list[int]:
    """Byte positions ``0 .. length-1`` to try: all of them, or the sample."""
    if coverage == "full":
        return list(range(length))
    stride = max(SAMPLE_STRIDE, -(-length // SAMPLE_POSITIONS_MAX))
    picks = set(range(0, length, stride))
    picks |= set(range(EDGE_BYTES)) | set(range(length - EDGE_BYTES, length))
    picks |= {b + d for b in HEADER_FIELDS for d in (-1, 0, 1)}
    return sorted(p for p in picks if 0 <= p < length)


class PoolImage:
    """The bytes of every file under some directories of a pool, put back between cases."""

    def __init__(self, root: Path, subdirs: tuple[str, ...]) -> None:
        self.root = root
        self.subdirs = subdirs
        self.files = {p: p.read_bytes() for p in self._walk()}

    def _walk(self) -> Iterator[Path]:
        for sub in self.subdirs:
            yield from (p for p in sorted((self.root / sub).rglob("*")) if p.is_file())

    def restore(self, replaced: dict[Path, bytes]) -> None:
        for path in self._walk():
            if path not in self.files:
                path.unlink()
        for path, data in self.files.items():
            wanted = replaced.get(path, data)
            if path.read_bytes() != wanted:  # rewriting only what changed keeps a case fast
                path.write_bytes(wanted)


def flip(data: bytes, position: int) -> bytes:
    """``data`` with one bit of byte ``position`` inverted (the bit varies with the position)."""
    damaged = bytearray(data)
    damaged[position] ^= 1 << (position % 8)
    return bytes(damaged)


class FrameCampaign:
    """The last frame of one log file of a crashed pool, and the cases built from it."""

    def __init__(self, root: Path, path: Path, subdirs: tuple[str, ...], zero_tail_expected: bool) -> None:
        self.path = path
        self.zeros = bytes(ZERO_TAIL if zero_tail_expected else 0)
        data = path.read_bytes()
        extents, verdict = frame_extents(data)
        self.start, self.end = extents[-1]
        # The newest frame the last frame's header records as durable (its lag): the frame
        # before it, or an earlier one when frames between were written without a sync (J2.5).
        lag = jframe._FRAME.unpack_from(data, self.start)[2]
        assert 0 < lag < len(extents), lag
        self.previous_start, self.previous_end = extents[-1 - lag]
        self.length = self.end - self.start
        tail = data[self.end :]
        # After an abrupt exit both logs keep the zeros written ahead of their appends (J1.1,
        # J7): the last frame is followed by nothing but zeros.
        assert bool(tail) == zero_tail_expected and not tail.strip(b"\0"), verdict
        self.head = data[: self.start]
        self.frame = data[self.start : self.end]
        self.image = PoolImage(root, subdirs)

    def write(self, data: bytes) -> bytes:
        self.image.restore({self.path: data})
        return data

    def truncated(self, size: int) -> bytes:
        """The file ending after ``size`` bytes of the frame, without zeros: cut short (J7)."""
        return self.write(self.head + self.frame[:size])

    def zero_filled(self, size: int) -> bytes:
        """``size`` bytes of the frame landed, the rest of it and beyond are the zeros written ahead."""
        return self.write(self.head + self.frame[:size] + bytes(self.length - size + ZERO_TAIL))

    def flipped(self, position: int) -> bytes:
        """The whole frame with one bit flipped (and the zeros after it, where the file has them)."""
        return self.write(flip(self.head + self.frame + self.zeros, self.start + position))

    def flipped_previous(self, position: int) -> bytes:
        """One bit flipped in the newest frame the last one says was durable."""
        return self.write(flip(self.head + self.frame + self.zeros, self.previous_start + position))


def run_cases(
    campaign: FrameCampaign, coverage: str, reopen: Callable[[], Any], refusal: str
) -> tuple[Any, Any]:
    """Run every prefix and flip case of the campaign's frames; the two reference views.

    ``reopen`` opens the pool as a new client would: the refusal (``CorruptData``, whose
    message contains ``refusal``) or what it finds. The references are the frame absent (its
    bytes still zeros) and the whole frame, both followed by the zeros written ahead. The
    decision table (DURABILITY.md) decides each case:

    * the last frame, torn anywhere and followed by zeros, is a torn write: the prefix is
      kept and the torn bytes become zeros again (no longer part of any frame);
    * the file cut short inside the last frame, or right after it, is not a crash (J7): the
      open fails closed and changes nothing;
    * a bit flip in the last frame is damage that no later frame proves durable: removed the
      same way (the table's one blind spot, documented: a damaged frame is never applied);
    * a bit flip in the frame before it, which the last frame's lag proves durable, is
      damage to acknowledged data: the open fails closed and changes nothing;
    * only the intact frame gives the state after the call.
    """
    start, length = campaign.start, campaign.length
    campaign.zero_filled(0)
    before = reopen()
    campaign.zero_filled(length)
    after = reopen()
    assert not isinstance(before, CorruptData) and not isinstance(after, CorruptData)
    assert before != after, "the last frame changes nothing a client can see"
    outcomes = {"before": 0, "after": 0, "refused": 0, "cut": 0}

    def expect(outcome: str, case: str, written: bytes) -> None:
        found = reopen()
        if outcome in ("refused", "cut"):
            assert isinstance(found, CorruptData), (case, found)
            wanted = "cut short" if outcome == "cut" else "was durable"
            assert refusal in str(found) and wanted in str(found), (case, found)
            assert campaign.path.read_bytes() == written, f"{case}: the refusal changed the file"
        else:
            assert not isinstance(found, CorruptData), (case, found)
            assert found == (after if outcome == "after" else before), case
            # A torn frame (or the zeros after the last frame) is gone: the frame's bytes are
            # zeros (or cut off once a new segment continues the journal), or the whole frame.
            data = campaign.path.read_bytes()
            assert data[:start] == campaign.head, case
            if outcome == "after":
                assert data[start : campaign.end] == campaign.frame, case
            else:
                assert not data[start : campaign.end].strip(b"\0"), case
        outcomes[outcome] += 1

    for size in positions(length + 1, coverage):
        expect(
            "after" if size == length else "before", f"{size} bytes then zeros", campaign.zero_filled(size)
        )
        expect("cut", f"cut short after {size} bytes", campaign.truncated(size))
    for position in positions(length, coverage):
        expect("before", f"bit flip at byte {position}", campaign.flipped(position))
    previous = positions(campaign.previous_end - campaign.previous_start, coverage)
    for position in previous:
        expect(
            "refused", f"bit flip at byte {position} of the frame before", campaign.flipped_previous(position)
        )
    tried, flips = len(positions(length + 1, coverage)), len(positions(length, coverage))
    assert outcomes == {"before": tried - 1 + flips, "after": 1, "refused": len(previous), "cut": tried}
    return before, after


# --------------------------------------------------------------------------- part A: the journal


def recover_queue(root: Path) -> Any:
    """Reopen the queue after the crash: what a caller sees of it, or the refusal."""
    store = quick_store(root)
    try:
        try:
            coord = Coordinator(store, exclusive_owner=child.OWNER, recover=True, clock=qh.Clock())
        except CorruptData as error:
            return error
        try:
            tasks, commits, counts, pending, _, _ = qh.observe(coord)
            subs = [coord.lookup_submission(f"sub-{t}") for t in child.task_ids()]
            return {"tasks": tasks, "commits": commits, "counts": counts, "pending": pending, "subs": subs}
        finally:
            qh.crash(coord)  # leave the journal as it is: the next case restores it anyway
    finally:
        store.close()


@pytest.mark.parametrize("last_op", ["submit", "complete"])
@pytest.mark.parametrize("coverage", COVERAGE)
def test_i11_journal_torn_or_flipped_last_frame_is_cut_and_damage_before_it_refused(
    tmp_path: Path, reference: list[dict[str, Any]], last_op: str, coverage: str
) -> None:
    root = tmp_path / "pool"
    status, lines = run_child(root, stop=line_number(reference, last_op))
    assert status == child.CRASH_STATUS and lines[-1]["op"] == last_op
    (segment,) = sorted((root / "queue" / "wal").iterdir())  # no snapshot yet: one segment
    campaign = FrameCampaign(root, segment, ("queue", "catalog"), zero_tail_expected=True)
    assert json.loads(campaign.frame[H:])["op"] == last_op

    before, after = run_cases(campaign, coverage, lambda: recover_queue(root), "refusing to recover")
    # The frame is exactly the acknowledged call: present after, absent before.
    if last_op == "submit":
        assert (before["tasks"], sorted(after["tasks"])) == ({}, child.task_ids())
        assert after["counts"] == {"pending": child.INPUTS}
    else:
        receipt = CommitReceipt.from_dict(lines[-1]["receipt"])
        assert (before["subs"][0], after["subs"][0]) == (None, receipt)
        assert (before["commits"], after["commits"]) == ([], [as_dict(receipt)])
        assert before["tasks"]["t0"]["state"] == "pending"  # its lease was revoked by recovery
        assert after["tasks"]["t0"]["state"] == "completed"


# --------------------------------------------------------------------------- part A: the catalog


def catalog_view(root: Path, packs: list[str]) -> Any:
    """What a new client of the pool finds in the catalog, or the refusal."""
    store = quick_store(root)
    try:
        try:
            answers = [store.explain(p) for p in packs]
        except CorruptData as error:
            return error
        catalog = Catalog(store.backend)
        try:
            with catalog.locked() as cat:
                state = cat.state.to_dict()
        finally:
            catalog.close()
        return answers, state
    finally:
        store.close()


@pytest.mark.parametrize("last_op", ["retain", "release"])
@pytest.mark.parametrize("coverage", COVERAGE)
def test_g2_catalog_torn_or_flipped_last_frame_is_cut_and_damage_before_it_refused(
    tmp_path: Path, reference: list[dict[str, Any]], last_op: str, coverage: str
) -> None:
    root = tmp_path / "pool"
    status, lines = run_child(root, stop=line_number(reference, last_op, child.KEEP_SCRATCH))
    assert status == child.CRASH_STATUS and lines[-1]["op"] == last_op
    campaign = FrameCampaign(root, root / "catalog" / "log", ("catalog",), zero_tail_expected=True)
    assert json.loads(campaign.frame[H:])["events"] == [{"op": last_op, **campaign_event(lines[-1])}]
    packs = sorted(child.on_disk(root))
    scratch = {p for p in packs if p.endswith(".seg")}  # the scratch writer's one-file packs
    assert len(scratch) == child.SCRATCH

    before, after = run_cases(campaign, coverage, lambda: catalog_view(root, packs), "the catalog is damaged")

    def scratch_owners(view: Any) -> set[str]:
        answers, _ = view
        return {o for a in answers if a["pack"] in scratch for o in a["owners"]}

    owners = (scratch_owners(before), scratch_owners(after))
    if last_op == "retain":
        assert owners == (set(), {child.KEEP_SCRATCH})
    else:
        assert owners == ({child.KEEP_SCRATCH}, set())


def campaign_event(line: dict[str, Any]) -> dict[str, Any]:
    """The catalog event an acknowledged retain or release line stands for (docs/GC.md)."""
    if line["op"] == "release":
        return {"owner": line["owner"]}
    packs = sorted(RecordSetRef.from_dict(r).manifest.segment.path for r in line["refs"])
    return {"owner": line["owner"], "packs": packs}


@pytest.mark.parametrize("where", ["header", "body", "last byte"])
@pytest.mark.parametrize("log", ["journal", "catalog"])
def test_check_reports_a_damaged_durable_frame_and_fix_leaves_it_alone(
    tmp_path: Path, reference: list[dict[str, Any]], log: str, where: str
) -> None:
    """A bit flip in a frame that a later frame proves durable is damage to acknowledged data
    (recovery refuses it, above): ``straw check`` reports an error and ``--fix`` does not cut
    it, which would silently drop an acknowledged call."""
    from straw._inspect.check import check_pool

    root = tmp_path / "pool"
    if log == "journal":
        status, _ = run_child(root, stop=line_number(reference, "complete"))
        (path,) = sorted((root / "queue" / "wal").iterdir())
    else:
        status, _ = run_child(root, stop=line_number(reference, "retain", child.KEEP_SCRATCH))
        path = root / "catalog" / "log"
    assert status == child.CRASH_STATUS
    campaign = FrameCampaign(root, path, ("queue", "catalog"), zero_tail_expected=True)
    length = campaign.previous_end - campaign.previous_start
    damaged = campaign.flipped_previous(
        {"header": 20, "body": H + length // 2, "last byte": length - 1}[where]
    )

    report = check_pool(root)
    assert [f.severity for f in report.findings if f.path == str(path.relative_to(root))] == ["error"]
    assert not report.ok
    check_pool(root, fix=True)
    assert path.read_bytes() == damaged, "check --fix cut a durable frame"


# --------------------------------------------------------------------------- part B: abrupt exits


class Acknowledged:
    """What the child's printed lines say was acknowledged before it died."""

    def __init__(self, lines: list[dict[str, Any]], in_flight: dict[str, Any]) -> None:
        # The call the child was making when it died (the next line of a complete run) may or
        # may not have taken effect: a release in flight leaves its owner's fate open.
        self.in_flight = in_flight
        self.published: dict[str, RecordSetRef] = {}
        self.receipts: list[CommitReceipt] = []
        self.owners: dict[str, list[RecordSetRef]] = {}
        self.released: set[str] = set()
        self.submitted: list[str] = []
        self.gone: list[str] = []
        self.epochs: list[int] = []
        for line in lines:
            op = line["op"]
            if op == "publish":
                self.published[line["name"]] = RecordSetRef.from_dict(line["ref"])
            elif op == "complete":
                self.receipts.append(CommitReceipt.from_dict(line["receipt"]))
            elif op == "retain":
                self.owners[line["owner"]] = [RecordSetRef.from_dict(r) for r in line["refs"]]
            elif op == "release":
                self.released.add(line["owner"])
                del self.owners[line["owner"]]
            elif op == "submit":
                self.submitted = line["tasks"]
            elif op == "collect":
                self.gone = line["gone"]
            elif op == "open":
                self.epochs.append(line["epoch"])

    def releasing(self, owner: str) -> bool:
        return self.in_flight["op"] == "release" and self.in_flight["owner"] == owner


def read_back(store: SharedFilesystemStore, ref: RecordSetRef) -> list[tuple[str, bytes]]:
    return [(r.record_id, bytes(r.payload)) for r in store.read(ref)]


def must_read(ack: Acknowledged, coord: Coordinator, name: str, collected: bool) -> bool:
    """Whether an acknowledged publication must still read back.

    Before any collection after the crash, all of them (scratch data excepted once its owner's
    release was acknowledged: the child's own collection may have taken it). After one, only
    what an owner keeps: inputs of tasks not completed, and the input a live owner retains.
    """
    if name.startswith("scratch"):
        if not collected:
            return child.KEEP_SCRATCH not in ack.released
        return child.KEEP_SCRATCH in ack.owners and not ack.releasing(child.KEEP_SCRATCH)
    if not collected or (child.KEEP_INPUT in ack.owners and name == child.input_name("t0")):
        return True
    status = coord.task_status(name.removeprefix("in-"))
    return status is not None and status["state"] != "completed"


def verify_acknowledged(
    store: SharedFilesystemStore, coord: Coordinator, ack: Acknowledged, *, collected: bool
) -> None:
    """Every acknowledged operation is present after recovery (and after a collection)."""
    for name, ref in ack.published.items():
        if must_read(ack, coord, name, collected):
            assert read_back(store, ref) == [(name, child.payload(name))], name
    commits = coord.commits
    for receipt in ack.receipts:
        assert coord.lookup_submission(receipt.submission_id) == receipt
        assert commits[receipt.position] == as_dict(receipt)
        assert read_back(store, receipt.result_ref) == [
            (f"out-{receipt.task_id}", qh.work_payload(receipt.task_id))
        ]
    for task_id in ack.submitted:
        status = coord.task_status(task_id)
        assert status is not None, task_id
        assert status["spec"]["input_ref"] == as_dict(ack.published[child.input_name(task_id)])
    for owner, refs in ack.owners.items():
        if ack.releasing(owner):
            continue
        for pack in store.reach(refs):
            assert owner in store.explain(pack)["owners"], (owner, pack)
    for owner in ack.released:
        assert not any(owner in store.explain(p)["owners"] for p in child.on_disk(store.backend.root))
    for pack in ack.gone:
        assert not (store.backend.root / pack).exists(), pack
        assert store.explain(pack)["tombstoned"], pack
    assert all(coord.epoch > epoch for epoch in ack.epochs)


def check_in_flight(store: SharedFilesystemStore, coord: Coordinator, ack: Acknowledged, phase: str) -> None:
    """Where the fault table decides the fate of the call in flight, it is that one."""
    call = ack.in_flight
    if call["op"] == "submit" and phase in ("before_journal_write", "after_journal_sync"):
        # Its one journal frame never written, or durable.
        assert (coord.task_status("t0") is not None) == (phase == "after_journal_sync")
    if phase == "before_completion_reply":
        # The completion is durable: the same task at the same position (the digest differs
        # between runs: the result's metadata names a random attempt id).
        wanted = CommitReceipt.from_dict(call["receipt"])
        found = coord.lookup_submission(wanted.submission_id)
        assert found is not None and (found.task_id, found.position) == (wanted.task_id, wanted.position)
        assert read_back(store, found.result_ref) == [
            (f"out-{found.task_id}", qh.work_payload(found.task_id))
        ]
    if call["op"] == "release" and phase in ("before_catalog_write", "after_catalog_sync"):
        # Its one catalog frame never written, or durable.
        refs = ack.owners[call["owner"]]
        owners = {o for pack in store.reach(refs) for o in store.explain(pack)["owners"]}
        assert (call["owner"] in owners) == (phase == "before_catalog_write")


def assert_clean(root: Path, *, before_recovery: bool = False) -> None:
    """``straw check`` finds no error; after recovery and GC, nothing left to repair either."""
    from straw._inspect.check import check_pool

    report = check_pool(root)
    errors = [f for f in report.findings if f.severity == "error"]
    assert not errors, errors
    if not before_recovery:
        assert report.ok, report.remaining()


def finish(store: SharedFilesystemStore, coord: Coordinator) -> None:
    """Do what the dead child did not: submit (if that never became durable), work every task."""
    if coord.task_status("t0") is None:
        specs = []
        for task_id in child.task_ids():
            name = child.input_name(task_id)
            ref = store.publish([Record(name, child.payload(name))], submission_id=f"again-{name}")
            specs.append(TaskSpec(task_id, input_ref=ref))
        coord.submit_tasks(child.SUBMIT_REQUEST, specs)
    while not isinstance(qh.work_one(coord, "parent"), str):
        pass


def recover_check_and_finish(root: Path, ack: Acknowledged, phase: str) -> None:
    """Recover, find everything acknowledged, collect, check; then finish the work and check."""
    with child.open_store(root) as store:
        coord = child.open_coordinator(store)
        verify_acknowledged(store, coord, ack, collected=False)
        check_in_flight(store, coord, ack, phase)
        coord.collect_garbage()
        verify_acknowledged(store, coord, ack, collected=True)
        coord.close()
    assert_clean(root)

    # The queue is usable: the rest of the work completes, each task exactly once.
    with child.open_store(root) as store:
        coord = child.open_coordinator(store)
        finish(store, coord)
        verify_acknowledged(store, coord, ack, collected=True)
        commits = coord.commits
        assert [c["position"] for c in commits] == list(range(child.INPUTS))
        assert sorted(c["task_id"] for c in commits) == child.task_ids()
        assert coord.metrics()["tasks"] == {"completed": child.INPUTS}
        coord.collect_garbage()
        coord.close()
    assert_clean(root)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("phase", "nth"), phase_params())
def test_abrupt_exit_at_a_durable_phase_loses_nothing_acknowledged_and_check_is_clean(
    tmp_path: Path, reference: list[dict[str, Any]], phase: str, nth: int
) -> None:
    root = tmp_path / "pool"
    status, lines = run_child(root, phase, nth)
    assert status == child.CRASH_STATUS, f"the workload never reached {phase} #{nth}"
    ack = Acknowledged(lines, reference[len(lines)])
    # A freshly crashed pool is never damaged: at most something recovery or GC tidies up.
    assert_clean(root, before_recovery=True)
    recover_check_and_finish(root, ack, phase)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("first", "second"),
    [
        (("after_journal_append", 6), "before_journal_write"),
        (("after_journal_append", 6), "after_journal_append"),
        (("after_data_sync", 13), "after_journal_sync"),
        (("before_unlink", 2), "before_unlink"),
        (("after_catalog_sync", 11), "before_tombstone"),
        (("after_catalog_sync", 11), "after_tombstone"),
    ],
    ids=lambda value: value if isinstance(value, str) else f"{value[0]}-{value[1]}",
)
def test_a_recovery_that_dies_too_is_recovered_again_without_loss(
    tmp_path: Path, reference: list[dict[str, Any]], first: tuple[str, int], second: str
) -> None:
    """J4 and G4 twice: the workload dies, then the recovery (its epoch frame, or its
    collection's tombstones and unlinks) dies as well; the third process finds everything."""
    root = tmp_path / "pool"
    status, lines = run_child(root, *first)
    assert status == child.CRASH_STATUS
    ack = Acknowledged(lines, reference[len(lines)])
    done = subprocess.run(
        [sys.executable, str(CHILD), str(root), second, "1", "0", "recover"],
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
        check=False,
    )
    assert (done.returncode, done.stderr) == (child.CRASH_STATUS, ""), f"the recovery never reached {second}"
    assert_clean(root, before_recovery=True)
    recover_check_and_finish(root, ack, first[0])
