"""The queue's write-ahead journal: frame encoding, the recovery decision table, replay, group commit.

* ``frame.classify`` is checked exhaustively: every combination of header state (complete,
  partial 1..63 bytes, zeroed, bad magic, bad checksum, unknown version), sequence, chain and
  body state (complete, incomplete, damaged, impossible length) against the precedence its
  docstring documents (``straw._journal.frame``: END / FRAME / TORN / CORRUPT).
* Replay of a journal whose last frame is torn at every byte (followed by the zeros written
  ahead) keeps exactly the valid prefix and zeroes the torn bytes durably; a segment cut short
  anywhere (J7) is refused and left alone; a bit flip anywhere in the last frame is never applied.
* A segment or snapshot of another queue is ``UnsafeRecovery``; a gap between segments is
  ``CorruptData``; snapshot plus tail equals a full replay.
* Group commit: concurrent appenders share syncs, and each returns only once its own frame
  is durable.
"""

from __future__ import annotations

import itertools
import os
import random
import struct
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import xxhash

from straw._journal import frame
from straw._journal.frame import Decision
from straw._journal.log import Journal
from straw._queue import events
from straw._queue.machine import Answer, new_state, state_from_dict, state_to_dict
from straw.backend import FilesystemBackend
from straw.errors import CorruptData, UnsafeRecovery, UnsupportedSchema
from straw.limits import JOURNAL_COMPANY_APPENDS, JOURNAL_SYNCS_IN_FLIGHT, LOG_CLOSE_ZEROS
from straw.protocol import TaskSpec, decode, encode

TAG = frame.identity_tag("run-journal", "rollout")
OTHER_TAG = frame.identity_tag("run-journal", "another-queue")
H = frame.FRAME_HEADER_BYTES


# --------------------------------------------------------------------------- helpers


def bodies(count: int, size: int = 24) -> list[bytes]:
    return [f"body-{i:04d}-".encode().ljust(size, b"#") for i in range(count)]


def open_journal(root: Path, tag: bytes = TAG, backend: FilesystemBackend | None = None) -> Journal:
    root.mkdir(parents=True, exist_ok=True)
    journal = Journal(backend or FilesystemBackend(root), str(root / "queue"), tag)
    journal.create_dirs(str(root))
    return journal


def write_journal(root: Path, items: list[bytes], tag: bytes = TAG) -> Journal:
    """A fresh journal holding ``items`` as frames 1.. in one segment (closed afterwards)."""
    journal = open_journal(root, tag)
    journal.start_segment()
    for body in items:
        journal.wait(journal.append(body))
    journal.close()
    return journal


def collector() -> tuple[list[tuple[int, bytes]], Callable[[int, bytes], None]]:
    """(applied frames, the replay ``apply`` callback that records them)."""
    applied: list[tuple[int, bytes]] = []

    def collect(seq: int, body: bytes) -> None:
        applied.append((seq, body))

    return applied, collect


def ignore(body: bytes) -> None:
    """A replay ``load`` callback for journals without a snapshot."""


def segment_paths(root: Path) -> list[Path]:
    return sorted((root / "queue" / "wal").glob("*.wal"))


def replay(root: Path, tag: bytes = TAG) -> tuple[list[tuple[int, bytes]], Any, Journal]:
    journal = open_journal(root, tag)
    applied: list[tuple[int, bytes]] = []
    loaded: list[bytes] = []
    recovered = journal.replay(lambda seq, body: applied.append((seq, body)), loaded.append)
    return applied, recovered, journal


# --------------------------------------------------------------------------- the decision table


def _header(
    *,
    seq: int = 2,
    length: int,
    chain: bytes,
    body_digest: bytes,
    magic: bytes = frame.FRAME_MAGIC,
    version: int = frame.JOURNAL_VERSION,
    lag: int = 0,
) -> bytes:
    head = struct.pack("<4sHHQQ16s16s", magic, version, lag, seq, length, chain, body_digest)
    return head + xxhash.xxh3_64_digest(head)


PREVIOUS = frame.next_chain(frame.genesis_chain(TAG), xxhash.xxh3_128_digest(b"first"))
BODY = b'{"op":"submit","tasks":["a","b","c"]}'

HEADERS = ("ok", "bad_magic", "bad_checksum", "bad_version", "zeroed")
SEQS = ("ok", "wrong")
CHAINS = ("ok", "wrong")
BODIES = ("ok", "incomplete_0", "incomplete_1", "incomplete_last", "bad_checksum", "too_long")


def build_tail(header: str, seq: str, chain: str, body: str) -> bytes:
    """The bytes after position ``at`` for one combination of the table's inputs."""
    number = 2 if seq == "ok" else 3
    digest = xxhash.xxh3_128_digest(BODY)
    chain_value = frame.next_chain(PREVIOUS if chain == "ok" else frame.genesis_chain(OTHER_TAG), digest)
    length = frame.FRAME_BODY_BYTES_MAX + 1 if body == "too_long" else len(BODY)
    kwargs: dict[str, Any] = {"seq": number, "length": length, "chain": chain_value, "body_digest": digest}
    if header == "bad_magic":
        kwargs["magic"] = b"SJFX"
    if header == "bad_version":
        kwargs["version"] = frame.JOURNAL_VERSION + 1
    head = _header(**kwargs)
    if header == "bad_checksum":
        head = head[:-1] + bytes([head[-1] ^ 0x01])
    if header == "zeroed":
        head = bytes(H)
    payload = BODY
    if body == "incomplete_0":
        payload = b""
    elif body == "incomplete_1":
        payload = BODY[:1]
    elif body == "incomplete_last":
        payload = BODY[:-1]
    elif body == "bad_checksum":
        payload = BODY[:5] + bytes([BODY[5] ^ 0x20]) + BODY[6:]
    return head + payload


#: What follows the frame under test: nothing, or a later frame (seq 3) whose lag makes it a
#: durability witness for frame 2 (lag 1: framed once 2 was durable), or not (lag 2, or 0 =
#: not recorded). Incomplete bodies are only tested at the end of the file (their definition).
AFTERS = ("none", "witness", "unproven", "unrecorded")
_LATER_BODY = b'{"op":"later"}'


def later_frame(after: str) -> bytes:
    if after == "none":
        return b""
    lag = {"witness": 1, "unproven": 2, "unrecorded": 0}[after]
    digest = xxhash.xxh3_128_digest(_LATER_BODY)
    head = _header(seq=3, length=len(_LATER_BODY), chain=bytes(16), body_digest=digest, lag=lag)
    return head + _LATER_BODY


def expected_decision(header: str, seq: str, chain: str, body: str, after: str) -> Decision | type[Exception]:
    """The documented precedence of ``classify``, written out row by row."""
    damaged = Decision.CORRUPT if after == "witness" else Decision.TORN
    if header == "zeroed":
        # A zero header is an unwritten tail if everything after it is zero too; otherwise it
        # is a damaged header like any other.
        return Decision.TORN if body == "incomplete_0" and after == "none" else damaged
    if header in ("bad_magic", "bad_checksum"):
        return damaged
    if header == "bad_version":
        return UnsupportedSchema
    if seq == "wrong":
        return Decision.CORRUPT
    if body == "too_long":
        return Decision.CORRUPT
    if body.startswith("incomplete"):
        return Decision.TORN
    if body == "bad_checksum":
        return damaged
    if chain == "wrong":
        return Decision.CORRUPT
    return Decision.FRAME


COMBINATIONS = [
    c
    for c in itertools.product(HEADERS, SEQS, CHAINS, BODIES, AFTERS)
    if c[4] == "none" or not c[3].startswith("incomplete")
]


@pytest.mark.parametrize("prefix", [b"", b"x" * 64 + b"previous frame bytes"], ids=["at-0", "at-84"])
def test_classify_decision_table_is_exhaustive(prefix: bytes) -> None:
    at = len(prefix)
    seen: dict[Any, int] = {}
    for combination in COMBINATIONS:
        later = later_frame(combination[4])
        data = prefix + build_tail(*combination[:4]) + later
        want = expected_decision(*combination)
        if isinstance(want, type):
            with pytest.raises(want, match="version"):
                frame.classify(data, at, 2, PREVIOUS)
            seen[want] = seen.get(want, 0) + 1
            continue
        verdict = frame.classify(data, at, 2, PREVIOUS)
        assert verdict.decision is want, (combination, verdict.reason)
        seen[want] = seen.get(want, 0) + 1
        if want is Decision.FRAME:
            assert verdict.frame is not None
            assert (verdict.frame.seq, verdict.frame.body) == (2, BODY)
            assert verdict.frame.end == len(data) - len(later)
            assert verdict.frame.chain == frame.next_chain(PREVIOUS, xxhash.xxh3_128_digest(BODY))
        else:
            assert verdict.frame is None
    assert set(seen) == {Decision.FRAME, Decision.TORN, Decision.CORRUPT, UnsupportedSchema}


def test_classify_empty_tail_is_end_and_partial_headers_are_torn() -> None:
    valid = build_tail("ok", "ok", "ok", "ok")
    prefix = b"p" * 70
    assert frame.classify(prefix, len(prefix), 2, PREVIOUS).decision is Decision.END
    assert frame.classify(b"", 0, 1, PREVIOUS).decision is Decision.END
    for size in range(1, H):
        for tail in (valid[:size], bytes(size), bytes([0xA5]) * size):
            verdict = frame.classify(prefix + tail, len(prefix), 2, PREVIOUS)
            assert verdict.decision is Decision.TORN, size
            assert verdict.reason == f"partial frame header ({size} bytes)"


@pytest.mark.parametrize("size", [H, H + 1, H + len(BODY), 4096])
def test_classify_zero_tail_is_torn_and_zeros_then_garbage_are_torn_unless_witnessed(size: int) -> None:
    verdict = frame.classify(b"q" * 10 + bytes(size), 10, 2, PREVIOUS)
    assert verdict.decision is Decision.TORN
    assert "zero bytes after the last frame" in verdict.reason
    damaged = b"q" * 10 + bytes(size - 1) + b"\x01"
    verdict = frame.classify(damaged, 10, 2, PREVIOUS)
    assert verdict.decision is Decision.TORN and "a torn write" in verdict.reason
    witnessed = frame.classify(damaged + later_frame("witness"), 10, 2, PREVIOUS)
    assert witnessed.decision is Decision.CORRUPT
    assert "frame 3 after it was written once frame 2 was durable" in witnessed.reason


def test_encode_frame_records_the_lag_only_when_it_fits() -> None:
    chain = frame.genesis_chain(TAG)
    lags = {}
    for durable in (None, 9, 10, 0, 10 - frame.FRAME_LAG_MAX, 9 - frame.FRAME_LAG_MAX):
        head, _ = frame.encode_frame(10, chain, b"{}", durable)
        lags[durable] = struct.unpack_from("<H", head, 6)[0]
    assert lags == {
        None: 0,
        9: 1,
        10: 0,  # a frame is never durable before it is written: not a lag, not recorded
        0: 10,
        10 - frame.FRAME_LAG_MAX: frame.FRAME_LAG_MAX,
        9 - frame.FRAME_LAG_MAX: 0,
    }


def test_classify_walks_a_chain_of_frames() -> None:
    chain = frame.genesis_chain(TAG)
    data = b""
    for seq, body in enumerate(bodies(5), start=1):
        head, chain = frame.encode_frame(seq, chain, body)
        data += head + body
    at, previous = 0, frame.genesis_chain(TAG)
    for seq, body in enumerate(bodies(5), start=1):
        verdict = frame.classify(data, at, seq, previous)
        assert verdict.decision is Decision.FRAME and verdict.frame is not None
        assert (verdict.frame.seq, verdict.frame.body) == (seq, body)
        at, previous = verdict.frame.end, verdict.frame.chain
    assert at == len(data)
    assert frame.classify(data, at, 6, previous).decision is Decision.END
    # Frames out of order or from another chain are corrupt, never skipped.
    assert frame.classify(data, 0, 2, frame.genesis_chain(TAG)).decision is Decision.CORRUPT
    assert frame.classify(data, 0, 1, frame.genesis_chain(OTHER_TAG)).decision is Decision.CORRUPT


def test_segment_header_round_trip_and_damage() -> None:
    head = frame.encode_segment_header(frame.SEGMENT_MAGIC, 17, PREVIOUS, TAG)
    assert len(head) == frame.SEGMENT_HEADER_BYTES == 64
    decoded = frame.decode_segment_header(head, frame.SEGMENT_MAGIC)
    assert (decoded.first_seq, decoded.chain_in, decoded.tag) == (17, PREVIOUS, TAG)
    with pytest.raises(CorruptData, match="magic"):
        frame.decode_segment_header(head, frame.SNAPSHOT_MAGIC)
    with pytest.raises(CorruptData, match="truncated"):
        frame.decode_segment_header(head[:63], frame.SEGMENT_MAGIC)
    for offset in range(64):
        damaged = bytearray(head)
        damaged[offset] ^= 0x10
        with pytest.raises(CorruptData):
            frame.decode_segment_header(bytes(damaged), frame.SEGMENT_MAGIC)


# --------------------------------------------------------------------------- replay of damaged tails


@pytest.fixture
def journal_bytes(tmp_path: Path) -> tuple[Path, bytes, int, list[bytes]]:
    """(segment path, its bytes, offset of its last frame, bodies) of a 6-frame journal.

    A closed segment keeps LOG_CLOSE_ZEROS zero bytes after its last frame (J7).
    """
    items = bodies(6, size=40)
    write_journal(tmp_path, items)
    (path,) = segment_paths(tmp_path)
    data = path.read_bytes()
    end = len(data) - LOG_CLOSE_ZEROS
    assert not data[end:].strip(b"\0") and data[end - 1] != 0
    last = end - (H + len(items[-1]))
    return path, data, last, items


def test_replay_of_an_intact_journal_applies_every_frame(tmp_path: Path, journal_bytes: Any) -> None:
    items = journal_bytes[3]
    applied, recovered, _ = replay(tmp_path)
    assert applied == list(enumerate(items, start=1))
    assert (recovered.last_seq, recovered.truncated, recovered.snapshot) == (6, None, None)


def test_i11_replay_of_a_torn_last_frame_keeps_the_prefix_and_zeroes_the_rest(
    tmp_path: Path, journal_bytes: Any
) -> None:
    path, data, last, items = journal_bytes
    end = len(data) - LOG_CLOSE_ZEROS
    for cut in range(last, end + 1):
        path.write_bytes(data[:cut] + bytes(len(data) - cut))  # the frame landed up to ``cut``
        backend = FilesystemBackend(tmp_path)
        journal = open_journal(tmp_path, backend=backend)
        applied, collect = collector()
        recovered = journal.replay(collect, ignore)
        if cut == end:
            assert applied == list(enumerate(items, start=1))
            assert recovered.truncated is None
            continue
        assert applied == list(enumerate(items[:-1], start=1)), cut
        assert recovered.last_seq == 5
        assert path.read_bytes() == data[:last] + bytes(len(data) - last), cut  # torn bytes zeroed
        if cut == last:
            assert recovered.truncated is None
        else:
            assert recovered.truncated is not None and f"zeroed from byte {last}" in recovered.truncated
            assert backend.metrics["file_syncs"] == 1  # the zeroing was made durable
    # A recovered journal continues after the prefix, in a new segment.
    path.write_bytes(data[:last] + bytes(len(data) - last))
    journal = open_journal(tmp_path)
    journal.replay(lambda seq, body: None, ignore)
    journal.start_segment()
    journal.wait(journal.append(b"after-recovery"))
    journal.close()
    applied, recovered, _ = replay(tmp_path)
    assert applied == [*enumerate(items[:-1], start=1), (6, b"after-recovery")]


def test_j7_replay_refuses_a_last_segment_cut_short_anywhere(tmp_path: Path, journal_bytes: Any) -> None:
    """A crash always leaves zeros after the last frame (J7): a segment that ends inside a frame
    or exactly at one was cut, and acknowledged frames may be gone. Before the fix a cut inside
    the last frame passed for a torn write and a cut at a frame boundary for a clean end."""
    path, data, last, _ = journal_bytes
    end = len(data) - LOG_CLOSE_ZEROS
    for cut in [frame.SEGMENT_HEADER_BYTES, *range(last - 3, end + 1), end + 10]:
        path.write_bytes(data[:cut])
        _, collect = collector()
        with pytest.raises(CorruptData, match="cut short"):
            open_journal(tmp_path).replay(collect, ignore)
        assert path.read_bytes() == data[:cut], cut  # fail closed: nothing cut or repaired


def test_j4_recovery_cuts_a_segment_whose_switch_a_crash_stopped_before_its_cut(tmp_path: Path) -> None:
    """A crash between a switch's new segment and its cut (J5.2) leaves the old segment ending in
    zeros and the new one holding no frame. Recovery reuses the new one; it must also cut the old
    one (J4.4): otherwise, should the new segment be lost with the frames acknowledged in it, the
    old one would pass for the newest and recovery would go on without them. (Found by simulation
    seed 1756: `straw check` said ok after the newest segment was deleted.)"""
    journal = open_journal(tmp_path)
    journal.start_segment()
    for body in bodies(3):
        journal.append(body)
    journal.request_switch()
    journal.switch()
    journal.wait(3)
    wal = tmp_path / "queue" / "wal"
    old, new = sorted(wal.iterdir())
    frames_end = old.stat().st_size  # the switch cut it at its last frame
    journal.abandon()
    os.truncate(old, frames_end + 4096)  # as before the cut: frames, then zeros
    assert frame.all_zero(old.read_bytes()[frames_end:])

    recovering = open_journal(tmp_path)
    applied, collect = collector()
    recovering.replay(collect, ignore)
    assert [seq for seq, _ in applied] == [1, 2, 3]
    recovering.start_segment()
    assert recovering.segment_path == str(new)  # the frameless segment is reused
    assert old.stat().st_size == frames_end  # and the one before it ends at its last frame again
    recovering.wait(recovering.append(b"acknowledged-after-recovery"))
    recovering.abandon()

    new.unlink()  # lost: the old segment now ends at a frame, which no crash leaves (J7)
    _, collect = collector()
    with pytest.raises(CorruptData, match="cut short"):
        open_journal(tmp_path).replay(collect, ignore)


def test_i11_replay_never_applies_a_bit_flip_in_the_last_frame(tmp_path: Path, journal_bytes: Any) -> None:
    path, data, last, items = journal_bytes
    end = len(data) - LOG_CLOSE_ZEROS
    outcomes = {"corrupt": 0, "prefix": 0}
    for offset in range(last, end):
        for bit in range(8):
            damaged = bytearray(data)
            damaged[offset] ^= 1 << bit
            path.write_bytes(bytes(damaged))
            journal = open_journal(tmp_path)
            applied, collect = collector()
            try:
                journal.replay(collect, ignore)
            except CorruptData as error:
                assert "refusing to recover past damage" in str(error)
                assert path.read_bytes() == bytes(damaged)  # fail closed: nothing cut or repaired
                outcomes["corrupt"] += 1
            else:
                assert path.read_bytes() == data[:last] + bytes(len(data) - last)  # looked torn: zeroed
                outcomes["prefix"] += 1
            assert applied == list(enumerate(items[:-1], start=1)), (offset, bit)
    assert sum(outcomes.values()) == 8 * (end - last)
    # Nothing follows the last frame, so nothing proves it was durable: under A1 its damage is
    # a torn write and recovery keeps the prefix (DURABILITY.md, durability witness). Never
    # is the damaged frame applied.
    assert outcomes == {"corrupt": 0, "prefix": 8 * (end - last)}


def test_i11_replay_refuses_damage_before_the_last_frame(tmp_path: Path, journal_bytes: Any) -> None:
    path, data, last, items = journal_bytes
    damaged = bytearray(data)
    damaged[last - 5] ^= 0x01  # inside the body of frame 5
    path.write_bytes(bytes(damaged))
    applied: list[tuple[int, bytes]] = []
    with pytest.raises(CorruptData, match="body checksum mismatch"):
        open_journal(tmp_path).replay(lambda seq, body: applied.append((seq, body)), lambda body: None)
    assert applied == list(enumerate(items[:4], start=1))
    assert path.read_bytes() == bytes(damaged)


def test_a_segment_of_another_queue_is_unsafe_recovery(tmp_path: Path) -> None:
    write_journal(tmp_path, bodies(3), tag=OTHER_TAG)
    applied: list[Any] = []
    with pytest.raises(UnsafeRecovery, match="belongs to another run or queue"):
        open_journal(tmp_path, TAG).replay(lambda seq, body: applied.append(body), lambda body: None)
    assert applied == []


def test_a_snapshot_of_another_queue_is_unsafe_recovery(tmp_path: Path) -> None:
    other = tmp_path / "other"
    journal = open_journal(other, OTHER_TAG)
    journal.start_segment()
    journal.wait(journal.append(b"x"))
    journal.write_snapshot(b'{"state":"other"}')
    journal.close()
    write_journal(tmp_path, bodies(2))
    (snap,) = (other / "queue" / "snap").glob("*.snap")
    (tmp_path / "queue" / "snap" / snap.name).write_bytes(snap.read_bytes())
    with pytest.raises(UnsafeRecovery, match="another run or queue"):
        open_journal(tmp_path).replay(lambda seq, body: None, lambda body: None)


def _segments(tmp_path: Path, sizes: list[int]) -> list[bytes]:
    """A journal with one segment per entry of ``sizes`` (that many frames each)."""
    journal = open_journal(tmp_path)
    items = bodies(sum(sizes))
    it = iter(items)
    for count in sizes:
        journal.start_segment()
        for _ in range(count):
            journal.wait(journal.append(next(it)))
    journal.close()
    return items


def test_replay_crosses_segments(tmp_path: Path) -> None:
    items = _segments(tmp_path, [3, 2, 4])
    assert [p.name for p in segment_paths(tmp_path)] == [f"{n:020d}.wal" for n in (1, 4, 6)]
    applied, recovered, _ = replay(tmp_path)
    assert applied == list(enumerate(items, start=1))
    assert recovered.last_seq == 9


def test_a_gap_between_segments_is_corrupt_data(tmp_path: Path) -> None:
    _segments(tmp_path, [3, 2, 4])
    segment_paths(tmp_path)[1].unlink()
    with pytest.raises(CorruptData, match="does not continue the previous segment"):
        replay(tmp_path)


def test_a_missing_first_segment_is_corrupt_data(tmp_path: Path) -> None:
    _segments(tmp_path, [3, 2])
    segment_paths(tmp_path)[0].unlink()
    with pytest.raises(CorruptData, match="journal gap"):
        replay(tmp_path)


def test_a_segment_with_a_foreign_chain_is_corrupt_data(tmp_path: Path) -> None:
    _segments(tmp_path, [3, 2])
    second = segment_paths(tmp_path)[1]
    data = bytearray(second.read_bytes())
    forged = frame.encode_segment_header(frame.SEGMENT_MAGIC, 4, frame.genesis_chain(OTHER_TAG), TAG)
    data[:64] = forged
    second.write_bytes(bytes(data))
    with pytest.raises(CorruptData, match="does not continue"):
        replay(tmp_path)


def test_a_torn_tail_in_a_segment_that_is_not_the_last_is_corrupt_data(tmp_path: Path) -> None:
    _segments(tmp_path, [3, 2])
    first = segment_paths(tmp_path)[0]
    first.write_bytes(first.read_bytes()[:-3])
    with pytest.raises(CorruptData, match="incomplete"):
        replay(tmp_path)


# --------------------------------------------------------------------------- snapshots


def _events(count: int) -> tuple[list[bytes], list[Any]]:
    """Journal bodies of a real queue workload, and the state after each of them."""
    limits = {"max_result_bytes": 1 << 20, "max_result_tokens": 1000, "metadata_bytes": 1024}
    state = new_state("run-journal", "rollout", limits)
    counter = iter(range(10**6))
    out: list[bytes] = []
    snapshots: list[Any] = []
    rng = random.Random(3)

    def push(decision: Any) -> None:
        if isinstance(decision, Answer):
            return
        out.append(events.encode(decision))
        state.apply(decision)
        snapshots.append(encode(state_to_dict(state)))

    push(events.Epoch(epoch=1))
    now = 0.0
    while len(out) < count:
        if rng.random() < 0.5:
            specs = [
                TaskSpec(f"t{next(counter)}", priority=rng.randint(0, 2)) for _ in range(rng.randint(1, 3))
            ]
            push(state.check_submit(f"rq{next(counter)}", specs, None, None))
        else:
            now += rng.choice([0.0, 4.0])
            push(state.check_acquire("w", 2, None, None, False, now, 5.0, lambda: f"id{next(counter)}"))
    return out, snapshots


def test_i10_snapshot_plus_tail_equals_a_full_replay(tmp_path: Path) -> None:
    items, states = _events(40)
    limits = {"max_result_bytes": 1 << 20, "max_result_tokens": 1000, "metadata_bytes": 1024}

    def rebuild(root: Path) -> tuple[Any, int]:
        holder = [new_state("run-journal", "rollout", limits)]
        count = [0]

        def apply(seq: int, body: bytes) -> None:
            holder[0].apply(events.decode(body))
            count[0] += 1

        def load(body: bytes) -> None:
            holder[0] = state_from_dict(decode(body), limits)

        open_journal(root).replay(apply, load)
        return decode(encode(state_to_dict(holder[0]))), count[0]

    full = tmp_path / "full"
    write_journal(full, items)
    snapped = tmp_path / "snapped"
    journal = open_journal(snapped)
    journal.start_segment()
    for number, body in enumerate(items, start=1):
        journal.wait(journal.append(body))
        if number == 25:
            journal.write_snapshot(states[24])
    journal.close()
    # The snapshot replaced everything before it: one snapshot, one segment starting after it.
    assert [p.name for p in (snapped / "queue" / "snap").iterdir()] == [f"{25:020d}.snap"]
    assert [p.name for p in segment_paths(snapped)] == [f"{26:020d}.wal"]
    full_state, full_count = rebuild(full)
    snap_state, snap_count = rebuild(snapped)
    assert (full_count, snap_count) == (40, 15)
    assert snap_state == full_state == decode(states[-1])


def test_a_damaged_snapshot_is_corrupt_data(tmp_path: Path) -> None:
    journal = open_journal(tmp_path)
    journal.start_segment()
    journal.wait(journal.append(b"one"))
    journal.write_snapshot(b'{"v":1}')
    journal.close()
    (snap,) = (tmp_path / "queue" / "snap").glob("*.snap")
    data = bytearray(snap.read_bytes())
    for offset in (10, 70, len(data) - 2):
        damaged = bytearray(data)
        damaged[offset] ^= 0x04
        snap.write_bytes(bytes(damaged))
        with pytest.raises(CorruptData):
            replay(tmp_path)
    snap.write_bytes(bytes(data[:-1]))
    with pytest.raises(CorruptData, match="snapshot"):
        replay(tmp_path)


# --------------------------------------------------------------------------- group commit


def test_j2_4_a_second_batch_is_synced_while_the_first_sync_is_still_running(tmp_path: Path) -> None:
    backend = FilesystemBackend(tmp_path)
    journal = open_journal(tmp_path, backend=backend)
    journal.start_segment()
    first_entered, release_first, second_synced = threading.Event(), threading.Event(), threading.Event()
    real_sync = backend.sync_file
    calls = [0]

    def sync_file(fd: int) -> None:
        calls[0] += 1
        if calls[0] == 1:
            first_entered.set()
            assert release_first.wait(30), "the test never released the first sync"
        real_sync(fd)
        if calls[0] == 2:
            second_synced.set()

    backend.sync_file = sync_file  # type: ignore[method-assign]
    first = journal.append(b"first batch")
    leader = threading.Thread(target=journal.wait, args=(first,))
    leader.start()
    assert first_entered.wait(30)
    second = journal.append(b"second batch")
    follower = threading.Thread(target=journal.wait, args=(second,))
    follower.start()
    # The second batch is written and synced while the first sync is still held (overlap)...
    assert second_synced.wait(30)
    # ...but acknowledged only in write order, once the first batch's sync returned (A3).
    assert follower.is_alive() and journal._durable == 0
    release_first.set()
    leader.join(30)
    follower.join(30)
    assert not leader.is_alive() and not follower.is_alive()
    journal.close()
    assert journal.metrics["syncs"] == 2
    applied, _, _ = replay(tmp_path)
    assert [body for _, body in applied] == [b"first batch", b"second batch"]


def test_j3_after_a_failed_sync_no_later_sync_acknowledges_and_close_cuts_the_rest(tmp_path: Path) -> None:
    backend = FilesystemBackend(tmp_path)
    journal = open_journal(tmp_path, backend=backend)
    journal.start_segment()
    journal.wait(journal.append(b"durable"))
    durable_end = journal._offset
    first_entered, second_synced = threading.Event(), threading.Event()
    real_sync = backend.sync_file
    calls = [0]

    def sync_file(fd: int) -> None:
        calls[0] += 1
        if calls[0] == 1:  # the first batch's sync fails, after the second batch's sync returned
            first_entered.set()
            assert second_synced.wait(30), "the second sync never ran"
            raise OSError(5, "injected: first sync failed")
        real_sync(fd)
        second_synced.set()

    backend.sync_file = sync_file  # type: ignore[method-assign]
    outcomes: list[str] = []

    def leader() -> None:
        with pytest.raises(OSError, match="first sync failed"):
            journal.wait(journal.append(b"first batch"))
        outcomes.append("first refused")

    thread = threading.Thread(target=leader)
    thread.start()
    assert first_entered.wait(30)
    # The second batch's own sync returns, but under A3 it proves nothing about the first
    # batch's bytes: it is acknowledged only after the first batch's sync, which fails.
    with pytest.raises(UnsafeRecovery):
        journal.wait(journal.append(b"second batch"))
    thread.join(30)
    assert outcomes == ["first refused"] and calls[0] == 2
    journal.close()
    # J3.1: the close zeroed both unacknowledged batches, durably (the segment keeps its zeros, J7).
    segment = next((tmp_path / "queue" / "wal").iterdir())
    assert not segment.read_bytes()[durable_end:].strip(b"\0")
    applied, _, _ = replay(tmp_path)
    assert [body for _, body in applied] == [b"durable"]


def test_i8_group_commit_shares_syncs_and_returns_only_when_durable(tmp_path: Path) -> None:
    threads_n = 8
    size = 48
    backend = FilesystemBackend(tmp_path)
    journal = open_journal(tmp_path, backend=backend)
    journal.start_segment()
    all_appended = threading.Event()
    appended = [0]
    guard = threading.Lock()
    synced_size = [frame.SEGMENT_HEADER_BYTES]
    real_sync = backend.sync_file
    syncs = [0]

    def sync_file(fd: int) -> None:
        # Frames end where the zero-filled space ahead of them (J1.1) begins.
        with open(f"/proc/self/fd/{fd}", "rb") as handle:  # the journal's own fd is write-only
            size_before = len(handle.read().rstrip(b"\0"))
        if syncs[0] == 0:
            # Hold the first sync until every thread has framed its transaction.
            assert all_appended.wait(30), "appenders did not arrive"
        real_sync(fd)
        with guard:
            syncs[0] += 1
            synced_size[0] = max(synced_size[0], size_before)

    backend.sync_file = sync_file  # type: ignore[method-assign]
    errors: list[str] = []

    def worker(number: int) -> None:
        try:
            seq = journal.append(f"thread-{number}".encode().ljust(size, b"."))
            with guard:
                appended[0] += 1
                if appended[0] == threads_n:
                    all_appended.set()
            journal.wait(seq)
            end = frame.SEGMENT_HEADER_BYTES + seq * (H + size)
            with guard:
                if synced_size[0] < end:
                    errors.append(f"seq {seq} returned before its frame was synced")
        except BaseException as error:  # pragma: no cover - reported below
            errors.append(repr(error))

    pool = [threading.Thread(target=worker, args=(n,)) for n in range(threads_n)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join(60)
    synced_by_flushes = syncs[0]
    journal.close()
    assert errors == []
    assert journal.metrics["appends"] == threads_n
    # The first sync covered what was framed when it started; while it was held, a second batch
    # could be written and synced beside it (JOURNAL_SYNCS_IN_FLIGHT); one more covered the rest.
    assert JOURNAL_SYNCS_IN_FLIGHT == 2
    assert journal.metrics["syncs"] == synced_by_flushes
    assert 2 <= synced_by_flushes <= 3 < threads_n
    applied, _, _ = replay(tmp_path)
    assert sorted(body for _, body in applied) == sorted(
        f"thread-{n}".encode().ljust(size, b".") for n in range(threads_n)
    )


class _Watched(dict[str, int]):
    """Journal metrics that tell a test each time a counter moves (no polling, no sleeps)."""

    def __init__(self, initial: dict[str, int]) -> None:
        super().__init__(initial)
        self.changed = threading.Condition()

    def __setitem__(self, key: str, value: int) -> None:
        with self.changed:
            super().__setitem__(key, value)
            self.changed.notify_all()

    def reach(self, key: str, value: int) -> bool:
        with self.changed:
            return self.changed.wait_for(lambda: self.get(key, 0) >= value, 30)


def test_j2_a_sync_wakes_only_the_callers_it_made_durable(tmp_path: Path) -> None:
    """Each waiter sleeps on its own: a sync wakes the callers whose frames it made durable, and a
    batch that may start wakes one caller to lead it; nobody else wakes only to sleep again."""
    backend = FilesystemBackend(tmp_path)
    journal = open_journal(tmp_path, backend=backend)
    journal.start_segment()
    metrics = journal.metrics = _Watched(journal.metrics)
    gates = [threading.Event(), threading.Event()]  # the first two syncs are held
    entered = [threading.Event(), threading.Event()]
    real_sync = backend.sync_file
    calls = [0]

    def sync_file(fd: int) -> None:
        number = calls[0]
        calls[0] += 1
        if number < len(gates):
            entered[number].set()
            assert gates[number].wait(30), "the test never released this sync"
        real_sync(fd)

    backend.sync_file = sync_file  # type: ignore[method-assign]
    errors: list[str] = []

    def caller(body: bytes) -> threading.Thread:
        def run() -> None:
            try:
                journal.wait(journal.append(body))
            except BaseException as error:  # pragma: no cover - reported below
                errors.append(repr(error))

        thread = threading.Thread(target=run)
        thread.start()
        return thread

    pool = [caller(b"a")]  # leads batch 1, whose sync is held
    assert entered[0].wait(30)
    pool.append(caller(b"b"))  # leads batch 2 beside it (JOURNAL_SYNCS_IN_FLIGHT), held too
    assert entered[1].wait(30)
    assert JOURNAL_SYNCS_IN_FLIGHT == 2
    pool += [caller(body) for body in (b"c", b"d", b"e")]  # no batch may start: all three sleep
    assert metrics.reach("sleeps", 3)
    # Batch 2's sync returns: nothing is durable yet (batch 1 is not), so only the first caller
    # whose frame is unwritten wakes, to lead batch 3 (c, d, e). It and b then sleep until batch 1.
    gates[1].set()
    assert metrics.reach("sleeps", 5) and metrics.reach("syncs", 2)
    assert journal._durable == 0 and all(thread.is_alive() for thread in pool)
    gates[0].set()
    for thread in pool:
        thread.join(30)
    assert errors == [] and not any(thread.is_alive() for thread in pool)
    # d and e slept once each: the syncs of batches 2 and 3 and the writes before them woke
    # nobody whose frame they had not made durable (a broadcast would have woken them each time).
    assert metrics["syncs"] == 3 and metrics["sleeps"] == 5
    journal.close()
    applied, _, _ = replay(tmp_path)
    assert sorted(body for _, body in applied) == [b"a", b"b", b"c", b"d", b"e"]


def test_j2_the_leader_yields_only_while_other_threads_frame_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lone caller commits without a scheduler yield; once another thread frames, the leader
    yields (so callers about to append may join) for the next JOURNAL_COMPANY_APPENDS frames."""
    yields = [0]
    real_yield = os.sched_yield

    def counted() -> None:
        yields[0] += 1
        real_yield()

    monkeypatch.setattr(os, "sched_yield", counted)
    journal = open_journal(tmp_path)
    journal.start_segment()

    def commit(body: bytes) -> None:
        journal.wait(journal.append(body))

    for body in bodies(20):
        commit(body)
    assert yields[0] == 0
    other = threading.Thread(target=commit, args=(b"from another thread",))
    other.start()
    other.join(30)
    assert yields[0] == 1  # that thread framed after this one: company, so its leader yielded
    for body in bodies(2 * JOURNAL_COMPANY_APPENDS):
        commit(body)
    assert yields[0] == 1 + JOURNAL_COMPANY_APPENDS  # then alone again: no more yields
    journal.close()
    applied, _, _ = replay(tmp_path)
    assert len(applied) == 21 + 2 * JOURNAL_COMPANY_APPENDS


def test_j3_a_failed_journal_write_stops_the_journal(tmp_path: Path) -> None:
    fail = {"armed": True}

    def hook(phase: str) -> None:
        if phase == "after_journal_append" and fail["armed"]:
            fail["armed"] = False
            raise OSError("injected")

    journal = open_journal(tmp_path, backend=FilesystemBackend(tmp_path, fault=hook))
    journal.start_segment()
    seq = journal.append(b"doomed")
    with pytest.raises(OSError, match="injected"):
        journal.wait(seq)
    assert isinstance(journal.failed, OSError)
    with pytest.raises(UnsafeRecovery, match="stopped after a storage failure"):
        journal.append(b"later")
    with pytest.raises(UnsafeRecovery):
        journal.wait(seq)
    journal.close()


def _frames(data: bytes) -> Iterator[frame.Frame]:
    at, seq, chain = frame.SEGMENT_HEADER_BYTES, 1, frame.genesis_chain(TAG)
    while True:
        verdict = frame.classify(data, at, seq, chain)
        if verdict.frame is None:
            return
        yield verdict.frame
        at, seq, chain = verdict.frame.end, seq + 1, verdict.frame.chain


def test_segment_bytes_follow_the_documented_layout(tmp_path: Path) -> None:
    items = bodies(3)
    write_journal(tmp_path, items)
    (path,) = segment_paths(tmp_path)
    data = path.read_bytes()
    header = frame.decode_segment_header(data, frame.SEGMENT_MAGIC)
    assert (header.first_seq, header.chain_in, header.tag) == (1, frame.genesis_chain(TAG), TAG)
    assert [f.body for f in _frames(data)] == items
    # A clean close keeps LOG_CLOSE_ZEROS zero bytes after the last frame (J7).
    assert len(data) == 64 + sum(H + len(b) for b in items) + LOG_CLOSE_ZEROS
    assert not data[-LOG_CLOSE_ZEROS:].strip(b"\0")


def test_metrics_count_the_time_the_journal_syncs_take(tmp_path: Path) -> None:
    """``sync_us_total`` and ``sync_us_max`` add up what each batch's sync took (a simulated
    clock: the sync seam moves it), so a caller's wait can be told apart from the device's."""
    backend = FilesystemBackend(tmp_path)
    journal = open_journal(tmp_path, backend=backend)
    journal.start_segment()
    now = [100.0]
    journal.clock = lambda: now[0]
    takes = iter([0.0003, 0.0007, 0.0002])
    real_sync = backend.sync_file

    def sync_file(fd: int) -> None:
        real_sync(fd)
        now[0] += next(takes)

    backend.sync_file = sync_file  # type: ignore[method-assign]
    for body in (b"a", b"b", b"c"):
        journal.wait(journal.append(body))
    metrics = journal.metrics
    assert (metrics["syncs"], metrics["sync_us_total"], metrics["sync_us_max"]) == (3, 1200, 700)

    def failing(fd: int) -> None:
        now[0] += 5.0
        raise OSError(5, "Input/output error")

    backend.sync_file = failing  # type: ignore[method-assign]
    with pytest.raises(OSError):
        journal.wait(journal.append(b"d"))
    # A failed sync made nothing durable: it is not counted among the syncs' times.
    assert (metrics["sync_us_total"], metrics["sync_us_max"]) == (1200, 700)
    journal.close()
