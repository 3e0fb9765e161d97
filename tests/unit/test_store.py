"""SharedFilesystemStore behaviour: happy paths, packs, idempotency, vectored writes, visibility.

API.md section 5, docs/FORMAT.md (pack layout, logical digest) and docs/DURABILITY.md
(D1-D5, I4, A2). Failure injection and corruption are tested elsewhere; here every write
succeeds and every assertion compares exact bytes, digests, files or error classes.
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import itertools
import json
import os
import pickle
import subprocess
import sys
import threading
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash

from queue_helpers import descriptors_under
from straw import Publication, Record, RecordRef, RecordSetRef, SharedFilesystemStore
from straw._fs import posix, system
from straw._pack import frame
from straw._pack import reader as pack_reader
from straw.errors import IdempotencyConflict, InvalidReference, WriterFenced
from straw.limits import CHUNK_BYTES, OPEN_PACKS_READER_MIN
from straw.protocol import encode
from straw.store import ReadSession, _Remembered

RUN = "run-store-tests"
KiB = 1024
MiB = 1024 * KiB


# --------------------------------------------------------------------------- helpers


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SharedFilesystemStore]:
    with SharedFilesystemStore(tmp_path, RUN) as opened:
        yield opened


def described(record: Record) -> tuple[str, bytes, str, dict[str, Any], int]:
    """A record as comparable plain values (payload as bytes)."""
    return (record.record_id, bytes(record.payload), record.codec, dict(record.metadata), record.tokens)


def read_all(store: SharedFilesystemStore, ref: RecordSetRef) -> list[tuple[str, bytes, str, dict, int]]:
    return [described(r) for r in store.read(ref)]


def pack_files(root: Path, suffix: str = ".pack") -> list[Path]:
    return sorted(root.glob(f"raw/*/*{suffix}"))


def temp_files(root: Path) -> list[Path]:
    return sorted(root.glob("raw/*/.*.tmp"))


def frames(path: Path) -> list[tuple[int, frame.FrameHeader]]:
    """Walk every frame of a pack file from its header to its last byte."""
    data = path.read_bytes()
    frame.decode_pack_header(data)
    found = []
    position = frame.PACK_HEADER_BYTES
    while position < len(data):
        if not data[position:].strip(b"\0"):  # an unsealed pack's zeros ahead (DURABILITY D1.2a)
            return found
        head = frame.decode_frame_header(data[position : position + frame.FRAME_HEADER_BYTES])
        found.append((position, head))
        position += frame.FRAME_HEADER_BYTES + head.body_bytes
    assert position == len(data), f"{path} has a torn last frame"
    return found


def seal_of(path: Path) -> tuple[int, int] | None:
    """(extents, end) of the pack's seal frame, or None if the pack does not end with one."""
    walked = frames(path)
    offset, head = walked[-1]
    if head.kind != frame.KIND_SEAL:
        return None
    data = path.read_bytes()[offset:]
    body = frame.decode_json_frame(data, frame.KIND_SEAL, None)
    assert set(body) == {"v", "extents", "end"}
    extents, end = frame.parse_seal(body)
    assert end == offset
    assert extents == sum(1 for _, h in walked if h.kind == frame.KIND_INDEX)
    return extents, end


def extents_in(path: Path) -> int:
    return sum(1 for _, h in frames(path) if h.kind == frame.KIND_INDEX)


def counted(monkeypatch: pytest.MonkeyPatch, name: str) -> list[Any]:
    """Wrap ``straw._fs.posix.<name>`` so each call's first arguments are recorded."""
    real: Callable[..., Any] = getattr(posix, name)
    calls: list[Any] = []

    def spy(*args: Any) -> Any:
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(posix, name, spy)
    return calls


def sample_records() -> list[Record]:
    return [
        Record(
            "prompt-0", b"\x00\x01binary\xff", "bytes.v1", {"task_id": "t", "nested": {"ü": [1, 2.5]}}, 17
        ),
        Record("answer-0", encode({"text": "héllo"}), "json.v1", {}, 0),
        Record("empty", b"", "bytes.v1", {"note": None}, 3),
    ]


# --------------------------------------------------------------------------- round trips


def test_publish_then_read_round_trips_bytes_metadata_codec_and_tokens(
    store: SharedFilesystemStore,
) -> None:
    records = sample_records()
    ref = store.publish(records, submission_id="s1")
    assert read_all(store, ref) == [described(r) for r in records]
    assert ref.records == 3
    assert ref.payload_bytes == sum(len(r.payload) for r in records)
    assert ref.tokens == 20
    assert ref.manifest.segment.run_id == RUN
    assert ref.manifest.segment.path.startswith(f"raw/{store.writer_id}/")


def test_an_empty_publication_round_trips(store: SharedFilesystemStore) -> None:
    ref = store.publish([], submission_id="empty")
    assert (ref.records, ref.payload_bytes, ref.tokens) == (0, 0, 0)
    assert list(store.read(ref)) == []
    assert store.validate(ref) == ()


PAYLOADS: dict[str, Callable[[], tuple[object, bytes]]] = {
    "bytes": lambda: (b"plain bytes", b"plain bytes"),
    "bytearray": lambda: (bytearray(b"mutable bytes"), b"mutable bytes"),
    "memoryview-slice": lambda: (memoryview(b"0123456789")[3:7], b"3456"),
    "numpy-uint8": lambda: (np.arange(300, dtype=np.uint8), np.arange(300, dtype=np.uint8).tobytes()),
    "numpy-float32-2d": lambda: (
        np.linspace(-1, 1, 24, dtype=np.float32).reshape(4, 6),
        np.linspace(-1, 1, 24, dtype=np.float32).tobytes(),
    ),
    "numpy-int64": lambda: (np.array([-1, 2**62, 7], dtype=np.int64), np.array([-1, 2**62, 7]).tobytes()),
    "numpy-bool": lambda: (np.array([True, False, True]), b"\x01\x00\x01"),
    "numpy-0d": lambda: (np.array(2.5, dtype=np.float64), np.array(2.5).tobytes()),
    "numpy-contiguous-slice": lambda: (
        np.arange(20, dtype=np.int16)[5:9],
        np.arange(5, 9, dtype=np.int16).tobytes(),
    ),
}


@pytest.mark.parametrize("kind", sorted(PAYLOADS))
def test_payload_types_round_trip_as_their_bytes(store: SharedFilesystemStore, kind: str) -> None:
    payload, expected = PAYLOADS[kind]()
    ref = store.publish([Record("r", payload)], submission_id=kind)  # type: ignore[arg-type]
    (record,) = store.read(ref)
    assert bytes(record.payload) == expected
    assert ref.payload_bytes == len(expected)


def test_non_contiguous_numpy_view_raises_value_error_and_writes_nothing(
    store: SharedFilesystemStore, tmp_path: Path
) -> None:
    matrix = np.arange(24, dtype=np.float32).reshape(4, 6)
    for view in (matrix[:, ::2], matrix.T, np.arange(10)[::3]):
        with pytest.raises(ValueError, match="must be C-contiguous"):
            store.publish([Record("ok", b"fine"), Record("bad", view)], submission_id="nc")
    assert pack_files(tmp_path) == []
    assert store.metrics["payload_bytes"] == 0


@pytest.mark.parametrize("payload", ["text", [1, 2], 12, None], ids=repr)
def test_non_buffer_payload_raises_type_error(store: SharedFilesystemStore, payload: object) -> None:
    with pytest.raises(TypeError, match="payload must be bytes, bytearray or a contiguous buffer"):
        store.publish([Record("bad", payload)], submission_id="tb")  # type: ignore[arg-type]


def test_read_returns_records_in_manifest_order(store: SharedFilesystemStore) -> None:
    ids = [f"id-{(i * 7) % 13:02d}" for i in range(13)]  # deliberately not sorted
    records = [Record(rid, rid.encode() * (i + 1)) for i, rid in enumerate(ids)]
    ref = store.publish(records, submission_id="order")
    assert [r.record_id for r in store.read(ref)] == ids
    assert [bytes(r.payload) for r in store.read(ref)] == [bytes(r.payload) for r in records]


def test_read_record_reads_each_record_of_a_set(store: SharedFilesystemStore) -> None:
    records = sample_records()
    ref = store.publish(records, submission_id="s")
    record_refs = store.validate(ref)
    assert all(isinstance(r, RecordRef) for r in record_refs)
    assert [described(store.read_record(r)) for r in record_refs] == [described(r) for r in records]


def test_write_records_refs_read_back_one_by_one(store: SharedFilesystemStore) -> None:
    records = sample_records()
    refs = store.write_records(records, submission_id="w")
    assert [r.ordinal for r in refs] == [0, 1, 2]
    assert [described(store.read_record(r)) for r in refs] == [described(r) for r in records]


def test_manifest_shape(store: SharedFilesystemStore) -> None:
    base = store.publish([Record("dep", b"d")], submission_id="dep")
    ref = store.publish(sample_records(), submission_id="s", dependencies=[base])
    manifest = store.manifest(ref)
    assert set(manifest) == {"version", "digest", "records", "dependencies"}
    assert manifest["version"] == 1
    assert manifest["digest"] == ref.digest
    assert manifest["records"] == [dataclasses.asdict(r) for r in store.validate(ref)]
    assert [RecordRef.from_dict(r) for r in manifest["records"]] == list(store.validate(ref))
    assert manifest["dependencies"] == [dataclasses.asdict(base)]
    json.loads(encode(manifest))  # JSON-encodable as it stands


# --------------------------------------------------------------------------- dependencies


def test_publish_many_int_dependency_names_the_earlier_publication(store: SharedFilesystemStore) -> None:
    first, second, third = store.publish_many(
        [
            Publication((Record("a", b"A"),)),
            Publication((Record("b", b"BB"),), (0,)),
            Publication((Record("c", b"CCC"),), (1, 0)),
        ],
        submission_id="many",
    )
    assert first.manifest.segment == second.manifest.segment == third.manifest.segment  # one write
    assert store.manifest(first)["dependencies"] == []
    assert store.manifest(second)["dependencies"] == [dataclasses.asdict(first)]
    assert store.manifest(third)["dependencies"] == [dataclasses.asdict(second), dataclasses.asdict(first)]
    assert [bytes(r.payload) for r in store.read(third)] == [b"CCC"]
    # The dependency returned by manifest() is itself a readable reference.
    dependency = RecordSetRef.from_dict(store.manifest(second)["dependencies"][0])
    assert [bytes(r.payload) for r in store.read(dependency)] == [b"A"]


@pytest.mark.parametrize("dependency", [0, 1, 2, -1])
def test_publish_many_int_dependency_on_itself_or_later_raises_invalid_reference(
    store: SharedFilesystemStore, tmp_path: Path, dependency: int
) -> None:
    publications = [
        Publication((Record("a", b"A"),)),
        Publication((Record("b", b"B"),), (dependency,)),
        Publication((Record("c", b"C"),)),
    ]
    if dependency == 0:
        publications[0] = Publication((Record("a", b"A"),), (0,))  # itself
    with pytest.raises(InvalidReference, match="must name an earlier publication"):
        store.publish_many(publications, submission_id="bad")
    assert pack_files(tmp_path) == []


def test_publish_many_bool_dependency_is_plain_misuse(store: SharedFilesystemStore) -> None:
    with pytest.raises((TypeError, ValueError)):
        store.publish_many(
            [Publication((Record("a", b"A"),)), Publication((Record("b", b"B"),), (True,))],
            submission_id="bool",
        )


def test_publish_many_with_record_set_ref_dependencies(tmp_path: Path) -> None:
    with SharedFilesystemStore(tmp_path, RUN) as one, SharedFilesystemStore(tmp_path, RUN) as two:
        mine = one.publish([Record("x", b"x")], submission_id="x")
        theirs = two.publish([Record("y", b"y")], submission_id="y")
        a, b = one.publish_many(
            [
                Publication((Record("a", b"A"),), (theirs, mine)),
                Publication((Record("b", b"B"),), (0, theirs)),
            ],
            submission_id="many",
        )
        assert one.manifest(a)["dependencies"] == [dataclasses.asdict(theirs), dataclasses.asdict(mine)]
        assert one.manifest(b)["dependencies"] == [dataclasses.asdict(a), dataclasses.asdict(theirs)]


def test_publish_rejects_int_and_forged_dependencies(store: SharedFilesystemStore, tmp_path: Path) -> None:
    base = store.publish([Record("a", b"A")], submission_id="a")
    size = pack_files(tmp_path)[0].stat().st_size
    with pytest.raises(TypeError, match="publish dependencies must be RecordSetRef"):
        store.publish([Record("b", b"B")], submission_id="b", dependencies=[0])  # type: ignore[list-item]
    forged = dataclasses.replace(base, digest="0" * 64)
    with pytest.raises(InvalidReference, match="does not match the manifest"):
        store.publish([Record("b", b"B")], submission_id="b", dependencies=[forged])
    miscounted = dataclasses.replace(base, records=2)
    with pytest.raises(InvalidReference, match="counts do not match"):
        store.publish([Record("b", b"B")], submission_id="b", dependencies=[miscounted])
    assert pack_files(tmp_path)[0].stat().st_size == size


# --------------------------------------------------------------------------- logical digest


def test_logical_digest_is_independent_of_layout(tmp_path: Path) -> None:
    records = sample_records()
    with (
        SharedFilesystemStore(tmp_path, RUN) as one,
        SharedFilesystemStore(tmp_path, RUN) as two,
        SharedFilesystemStore(tmp_path, RUN, segment_target_bytes=0) as standalone,
    ):
        direct = one.publish(records, submission_id="direct")
        padding = one.publish([Record("pad", b"p" * 999)], submission_id="pad")  # shift offsets
        refs = one.write_records(records, submission_id="write")
        combined = one.record_set(refs, submission_id="combine")
        other_pack = two.publish(records, submission_id="direct")
        own_file = standalone.publish(records, submission_id="direct")
        # A manifest written by one writer over records in another writer's pack.
        cross = two.record_set(refs, submission_id="cross")
        # Records split over two packs, combined in a third file.
        head = one.write_records(records[:1], submission_id="head")
        tail = two.write_records(records[1:], submission_id="tail")
        split = standalone.record_set([*head, *tail], submission_id="split")

        refs_by_layout = [direct, combined, other_pack, own_file, cross, split]
        assert len({r.digest for r in refs_by_layout}) == 1
        assert len({(r.manifest.segment.path, r.manifest.segment.offset) for r in refs_by_layout}) == 6
        assert padding.digest != direct.digest
        expected = [described(r) for r in records]
        for ref in refs_by_layout:
            assert read_all(one, ref) == expected
            assert (ref.records, ref.payload_bytes, ref.tokens) == (
                direct.records,
                direct.payload_bytes,
                direct.tokens,
            )


def test_logical_digest_of_int_and_ref_dependencies_agree(store: SharedFilesystemStore) -> None:
    first, second = store.publish_many(
        [Publication((Record("a", b"A"),)), Publication((Record("b", b"B"),), (0,))],
        submission_id="many",
    )
    alone = store.publish([Record("a", b"A")], submission_id="a")
    after = store.publish([Record("b", b"B")], submission_id="b", dependencies=[alone])
    assert alone.digest == first.digest
    assert after.digest == second.digest


def _variants() -> dict[str, tuple[list[Record], int]]:
    """Record lists (and a dependency count) that must each have their own digest."""
    a = Record("a", b"one", "bytes.v1", {"k": 1}, 3)
    b = Record("b", b"two", "json.v1", {}, 0)
    return {
        "base": ([a, b], 0),
        "order": ([b, a], 0),
        "metadata": ([dataclasses.replace(a, metadata={"k": 2}), b], 0),
        "metadata-key": ([dataclasses.replace(a, metadata={"j": 1}), b], 0),
        "codec": ([dataclasses.replace(a, codec="json.v1"), b], 0),
        "tokens": ([dataclasses.replace(a, tokens=4), b], 0),
        "payload": ([dataclasses.replace(a, payload=b"onE"), b], 0),
        "payload-length": ([dataclasses.replace(a, payload=b"one "), b], 0),
        "record-id": ([dataclasses.replace(a, record_id="A"), b], 0),
        "fewer": ([a], 0),
        "dependency": ([a, b], 1),
    }


def test_logical_digest_changes_with_content_order_and_dependencies(store: SharedFilesystemStore) -> None:
    dependency = store.publish([Record("d", b"d")], submission_id="dep")
    digests = {}
    for name, (records, deps) in _variants().items():
        ref = store.publish(records, submission_id=name, dependencies=[dependency] * deps)
        digests[name] = ref.digest
    assert len(set(digests.values())) == len(digests), digests


# --------------------------------------------------------------------------- validate


def owned(task: str, attempt: str, number: int) -> Record:
    return Record(f"r{number}", b"x" * number, metadata={"task_id": task, "attempt_id": attempt, "n": number})


def test_validate_accepts_records_of_the_named_task_and_attempt(store: SharedFilesystemStore) -> None:
    ref = store.publish([owned("t1", "a1", n) for n in range(4)], submission_id="own")
    expected = store.validate(ref)
    assert len(expected) == 4
    assert store.validate(ref, task_id="t1", attempt_id="a1") == expected
    assert store.validate(ref, task_id="t1") == expected
    assert store.validate(ref, attempt_id="a1") == expected


@pytest.mark.parametrize(
    ("foreign", "task", "attempt"),
    [
        (owned("t1", "a2", 9), "t1", "a1"),
        (owned("t2", "a1", 9), "t1", "a1"),
        (Record("r9", b"x"), "t1", "a1"),
        (owned("t2", "a1", 9), "t1", None),
        (owned("t1", "a2", 9), None, "a1"),
    ],
    ids=["other-attempt", "other-task", "no-metadata", "task-only", "attempt-only"],
)
def test_validate_refuses_a_record_that_does_not_belong(
    store: SharedFilesystemStore, foreign: Record, task: str | None, attempt: str | None
) -> None:
    records = [owned("t1", "a1", 1), foreign, owned("t1", "a1", 2)]
    ref = store.publish(records, submission_id="mixed")
    with pytest.raises(InvalidReference, match="does not belong") as raised:
        store.validate(ref, task_id=task, attempt_id=attempt)
    assert "'r9'" in str(raised.value)


# --------------------------------------------------------------------------- read sessions


def test_read_session_serves_every_read_method(store: SharedFilesystemStore) -> None:
    records = sample_records()
    ref = store.publish(records, submission_id="s")
    with store.read_session() as session:
        record_refs = session.validate(ref)
        assert record_refs == store.validate(ref)
        assert session.manifest(ref) == store.manifest(ref)
        assert [described(r) for r in session.read(ref)] == [described(r) for r in records]
        assert described(session.read_record(record_refs[1])) == described(records[1])
        assert session.envelope(record_refs[0]) == store.envelope(record_refs[0])
        assert bytes(session.read_range(record_refs[0], 1, 4)) == bytes(records[0].payload)[1:4]
        with pytest.raises(InvalidReference, match="'answer-0' does not belong"):
            session.validate(ref, task_id="t")  # only the first record names task t


def test_read_session_opens_a_pack_once_for_many_publications(
    store: SharedFilesystemStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    refs = [store.publish([Record(f"r{i}", bytes([i]) * (i + 1))], submission_id=f"s{i}") for i in range(50)]
    assert len({r.manifest.segment.path for r in refs}) == 1
    opens = counted(monkeypatch, "open_read")
    with store.read_session() as session:
        for i, ref in enumerate(refs):
            (record,) = session.read(ref)
            assert bytes(record.payload) == bytes([i]) * (i + 1)
            session.validate(ref)
            session.manifest(ref)
    assert len(opens) == 1
    with store.read_session() as session:  # a new session has its own cache
        session.validate(refs[0])
    assert len(opens) == 2


def test_read_session_caches_parsed_indexes(
    store: SharedFilesystemStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    ref = store.publish(sample_records(), submission_id="s")
    reads = counted(monkeypatch, "pread_exact")
    with store.read_session() as session:
        record_refs = session.validate(ref)
        first = len(reads)
        assert first == 2  # the pack header when opened, then the index frame
        for _ in range(3):
            session.validate(ref)
            session.manifest(ref)
            session.envelope(record_refs[0])
        assert len(reads) == first  # verified index reused: no I/O
        bytes(session.read_record(record_refs[0]).payload)
        assert len(reads) == first + 1  # only the payload itself


def test_store_reads_reuse_a_cache_too(store: SharedFilesystemStore, monkeypatch: pytest.MonkeyPatch) -> None:
    refs = [store.publish([Record("r", bytes([i]))], submission_id=f"s{i}") for i in range(20)]
    opens = counted(monkeypatch, "open_read")
    for i, ref in enumerate(refs):
        assert [bytes(r.payload) for r in store.read(ref)] == [bytes([i])]
    assert len(opens) <= 1


def test_envelope_describes_a_record_without_its_payload(
    store: SharedFilesystemStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    payload = bytes(range(256)) * 5
    ref = store.publish(
        [Record("env", payload, "json.v1", {"task_id": "t", "ü": [1]}, 42)], submission_id="env"
    )
    (record_ref,) = store.validate(ref)
    reads = counted(monkeypatch, "pread_exact")
    envelope = store.envelope(record_ref)
    assert reads == []  # the index was verified already; the payload is not read
    assert envelope == {
        "record_id": "env",
        "codec": "json.v1",
        "metadata": {"task_id": "t", "ü": [1]},
        "tokens": 42,
        "payload_bytes": len(payload),
        "checksum": xxhash.xxh3_128_hexdigest(payload),
        "chunk_bytes": CHUNK_BYTES,
    }


def test_envelope_of_a_manifest_matches_its_payload(store: SharedFilesystemStore) -> None:
    ref = store.publish([Record("a", b"A")], submission_id="s")
    envelope = store.envelope(ref.manifest)
    payload = bytes(store.read_record(ref.manifest).payload)
    assert envelope["codec"] == "straw.manifest.v1"
    assert envelope["payload_bytes"] == len(payload)
    assert json.loads(payload)["digest"] == ref.digest


# --------------------------------------------------------------------------- byte ranges


@pytest.fixture
def large(store: SharedFilesystemStore) -> tuple[SharedFilesystemStore, RecordRef, bytes]:
    payload = np.random.default_rng(7).bytes(int(3.5 * CHUNK_BYTES))
    ref = store.publish([Record("large", payload)], submission_id="large")
    (record_ref,) = store.validate(ref)
    return store, record_ref, payload


C = CHUNK_BYTES
RANGES = [
    (0, int(3.5 * C)),
    (0, 1),
    (C - 1, C + 1),
    (C, 2 * C),
    (10, 3 * C + 5),
    (3 * C, int(3.5 * C)),
    (int(3.5 * C) - 1, int(3.5 * C)),
    (2 * C - 7, 2 * C - 3),
]


@pytest.mark.parametrize(("start", "stop"), RANGES)
def test_read_range_returns_exact_bytes_reading_only_touched_chunks(
    large: tuple[SharedFilesystemStore, RecordRef, bytes],
    monkeypatch: pytest.MonkeyPatch,
    start: int,
    stop: int,
) -> None:
    store, ref, payload = large
    reads = counted(monkeypatch, "pread_exact")
    assert bytes(store.read_range(ref, start, stop)) == payload[start:stop]
    first, last = start // C, (stop - 1) // C
    touched = min(len(payload), (last + 1) * C) - first * C
    assert [size for _, size, _ in reads] == [touched]


@pytest.mark.parametrize("at", [0, C, int(3.5 * C)])
def test_read_range_of_an_empty_range_is_empty(
    large: tuple[SharedFilesystemStore, RecordRef, bytes], at: int
) -> None:
    store, ref, _ = large
    assert bytes(store.read_range(ref, at, at)) == b""


@pytest.mark.parametrize(
    ("start", "stop"), [(-1, 5), (5, 4), (0, int(3.5 * C) + 1), (int(3.5 * C) + 1, int(3.5 * C) + 2)]
)
def test_read_range_outside_the_payload_raises_value_error(
    large: tuple[SharedFilesystemStore, RecordRef, bytes], start: int, stop: int
) -> None:
    store, ref, _ = large
    with pytest.raises(ValueError, match="outside a payload"):
        store.read_range(ref, start, stop)


def test_read_range_of_a_manifest_agrees_with_read_record(store: SharedFilesystemStore) -> None:
    ref = store.publish([Record("a", b"A")], submission_id="s")
    payload = bytes(store.read_record(ref.manifest).payload)
    assert bytes(store.read_range(ref.manifest, 0, len(payload))) == payload


# --------------------------------------------------------------------------- packs


def test_a_pack_holds_many_publications(store: SharedFilesystemStore, tmp_path: Path) -> None:
    refs = [store.publish([Record(f"r{i}", b"p" * i)], submission_id=f"s{i}") for i in range(20)]
    packs = pack_files(tmp_path)
    assert len(packs) == 1
    assert packs[0].parent == tmp_path / "raw" / store.writer_id
    assert {r.manifest.segment.path for r in refs} == {packs[0].relative_to(tmp_path).as_posix()}
    assert extents_in(packs[0]) == 20
    assert pack_files(tmp_path, ".seg") == []
    assert temp_files(tmp_path) == []
    assert store.metrics["packs_created"] == 1
    for i, ref in enumerate(refs):
        assert [bytes(r.payload) for r in store.read(ref)] == [b"p" * i]


def test_pack_rotates_before_crossing_the_target(tmp_path: Path) -> None:
    target = 64 * KiB
    with SharedFilesystemStore(tmp_path, RUN, segment_target_bytes=target) as store:
        rng = np.random.default_rng(1)
        payloads = [rng.bytes(20 * KiB) for _ in range(10)]
        refs = [store.publish([Record(f"r{i}", p)], submission_id=f"s{i}") for i, p in enumerate(payloads)]
        order = list(dict.fromkeys(r.manifest.segment.path for r in refs))  # packs in creation order
        packs = [tmp_path / p for p in order]
        assert sorted(packs) == pack_files(tmp_path)
        assert len(packs) == store.metrics["packs_created"] > 1
        for path in packs:
            assert path.stat().st_size <= target or extents_in(path) == 1
        for path in packs[:-1]:
            assert seal_of(path) is not None
        assert seal_of(packs[-1]) is None  # still open for appends
        # Rotation is not premature: the next pack's first extent did not fit.
        for earlier, later in itertools.pairwise(packs):
            first_extent = next(r for r in refs if tmp_path / r.manifest.segment.path == later)
            extent_bytes = first_extent.manifest.segment.offset + first_extent.manifest.segment.size
            extent_bytes -= frame.PACK_HEADER_BYTES
            end = seal_of(earlier)
            assert end is not None
            assert end[1] + extent_bytes > target
        for ref, payload in zip(refs, payloads, strict=True):
            assert [bytes(r.payload) for r in store.read(ref)] == [payload]


def test_pack_rotation_counts_the_index_frame(tmp_path: Path) -> None:
    target = 64 * KiB
    with SharedFilesystemStore(tmp_path, RUN, segment_target_bytes=target) as store:
        for i in range(6):
            store.publish([Record(f"r{i}", b"x", metadata={"m": "y" * 30_000})], submission_id=f"s{i}")
    for path in pack_files(tmp_path):
        assert path.stat().st_size <= target or extents_in(path) == 1


def test_an_oversized_publication_stays_whole_in_one_pack(tmp_path: Path) -> None:
    target = 64 * KiB
    with SharedFilesystemStore(tmp_path, RUN, segment_target_bytes=target) as store:
        small = store.publish([Record("small", b"s" * KiB)], submission_id="small")
        big_records = [Record(f"big{i}", bytes([i]) * (40 * KiB)) for i in range(3)]
        big = store.publish(big_records, submission_id="big")
        after = store.publish([Record("after", b"a" * KiB)], submission_id="after")
        paths = [r.manifest.segment.path for r in (small, big, after)]
        assert len(set(paths)) == 3
        big_pack = tmp_path / big.manifest.segment.path
        assert big_pack.stat().st_size > target
        assert extents_in(big_pack) == 1
        assert seal_of(big_pack) == (1, big.manifest.segment.offset + big.manifest.segment.size)
        assert {r.segment.path for r in store.validate(big)} == {big.manifest.segment.path}
        assert read_all(store, big) == [described(r) for r in big_records]


def test_segment_target_zero_writes_each_publication_as_its_own_file(tmp_path: Path) -> None:
    with SharedFilesystemStore(tmp_path, RUN, segment_target_bytes=0) as store:
        refs = [store.publish([Record(f"r{i}", b"z" * i)], submission_id=f"s{i}") for i in range(3)]
        files = pack_files(tmp_path, ".seg")
        assert pack_files(tmp_path) == []
        assert len(files) == 3 == store.metrics["packs_created"]
        assert {tmp_path / r.manifest.segment.path for r in refs} == set(files)
        for path in files:
            header = frame.decode_pack_header(path.read_bytes())
            assert header.flags & frame.FLAG_STANDALONE
            assert header.segment_id == path.stem
            assert seal_of(path) is not None
            assert extents_in(path) == 1
        for i, ref in enumerate(refs):
            assert [bytes(r.payload) for r in store.read(ref)] == [b"z" * i]


def test_seal_then_publish_opens_a_new_pack(store: SharedFilesystemStore, tmp_path: Path) -> None:
    store.seal()  # nothing open yet: a no-op
    before = store.publish([Record("a", b"A")], submission_id="a")
    store.seal()
    store.seal()  # sealing twice is harmless
    after = store.publish([Record("b", b"B")], submission_id="b")
    assert before.manifest.segment.path != after.manifest.segment.path
    assert len(pack_files(tmp_path)) == 2
    assert seal_of(tmp_path / before.manifest.segment.path) == (
        1,
        before.manifest.segment.offset + before.manifest.segment.size,
    )
    assert seal_of(tmp_path / after.manifest.segment.path) is None
    assert [bytes(r.payload) for r in store.read(before)] == [b"A"]


def test_close_fences_the_writer_but_reads_still_work(tmp_path: Path) -> None:
    store = SharedFilesystemStore(tmp_path, RUN)
    ref = store.publish([Record("a", b"A")], submission_id="a")
    refs = store.write_records([Record("w", b"W")], submission_id="w")
    store.close()
    store.close()  # idempotent
    (pack,) = pack_files(tmp_path)
    assert seal_of(pack) == (2, refs[0].segment.offset + refs[0].segment.size)
    with pytest.raises(WriterFenced, match="closed"):
        store.publish([Record("b", b"B")], submission_id="b")
    with pytest.raises(WriterFenced):
        store.publish_many([Publication((Record("b", b"B"),))], submission_id="m")
    with pytest.raises(WriterFenced):
        store.write_records([Record("b", b"B")], submission_id="w2")
    with pytest.raises(WriterFenced):
        store.record_set(refs, submission_id="rs")
    assert pack_files(tmp_path) == [pack]
    assert [bytes(r.payload) for r in store.read(ref)] == [b"A"]
    # An idempotent retry of a completed submission still answers after close.
    assert store.publish([Record("a", b"A")], submission_id="a") == ref
    store.close()  # gives up what the reads after close opened


def test_context_manager_closes_the_store(tmp_path: Path) -> None:
    with SharedFilesystemStore(tmp_path, RUN) as store:
        ref = store.publish([Record("a", b"A")], submission_id="a")
    assert seal_of(tmp_path / ref.manifest.segment.path) is not None
    with pytest.raises(WriterFenced):
        store.publish([Record("b", b"B")], submission_id="b")


def test_i4_two_stores_on_one_root_write_to_their_own_directories(tmp_path: Path) -> None:
    with SharedFilesystemStore(tmp_path, RUN) as one, SharedFilesystemStore(tmp_path, RUN) as two:
        assert one.writer_id != two.writer_id
        for writer in (one.writer_id, two.writer_id):
            assert len(writer) == 32 and int(writer, 16) >= 0
        a = one.publish([Record("a", b"A")], submission_id="same-id")
        b = two.publish([Record("a", b"A")], submission_id="same-id")
        assert a.manifest.segment.path.startswith(f"raw/{one.writer_id}/")
        assert b.manifest.segment.path.startswith(f"raw/{two.writer_id}/")
        assert sorted(p.name for p in (tmp_path / "raw").iterdir()) == sorted([one.writer_id, two.writer_id])
        assert a.digest == b.digest
        # Each store reads the other's packs.
        assert read_all(one, b) == read_all(two, a)


def test_metrics_payload_bytes_counts_this_instance_only(tmp_path: Path) -> None:
    with SharedFilesystemStore(tmp_path, RUN) as store, SharedFilesystemStore(tmp_path, RUN) as other:
        assert store.metrics["payload_bytes"] == 0
        store.publish([Record("a", b"x" * 10), Record("b", b"y" * 20)], submission_id="p")
        assert store.metrics["payload_bytes"] == 30
        store.publish_many(
            [Publication((Record("c", b"c" * 5),)), Publication((Record("d", b"d" * 7),), (0,))],
            submission_id="m",
        )
        assert store.metrics["payload_bytes"] == 42
        refs = store.write_records([Record("e", b"e" * 100)], submission_id="w")
        assert store.metrics["payload_bytes"] == 142
        store.record_set(refs, submission_id="rs")  # a manifest only
        assert store.metrics["payload_bytes"] == 142
        before = store.metrics
        store.publish([Record("a", b"x" * 10), Record("b", b"y" * 20)], submission_id="p")  # retry
        assert store.metrics["payload_bytes"] == 142
        assert store.metrics["bytes_written"] == before["bytes_written"]
        other.publish([Record("z", b"z" * 1000)], submission_id="z")
        assert store.metrics["payload_bytes"] == 142
        assert other.metrics["payload_bytes"] == 1000
        assert store.metrics["records"] == 5
        assert store.metrics["publications"] == 4


# --------------------------------------------------------------------------- idempotency (I4)


def _write_kinds() -> dict[str, Callable[[SharedFilesystemStore, str, bytes], object]]:
    return {
        "publish": lambda s, sid, p: s.publish([Record("a", p)], submission_id=sid),
        "publish_many": lambda s, sid, p: s.publish_many(
            [Publication((Record("a", p),)), Publication((Record("b", p),), (0,))], submission_id=sid
        ),
        "write_records": lambda s, sid, p: s.write_records([Record("a", p)], submission_id=sid),
    }


@pytest.mark.parametrize("kind", sorted(_write_kinds()))
def test_i4_same_submission_same_content_returns_equal_reference_without_writing(
    store: SharedFilesystemStore, tmp_path: Path, kind: str
) -> None:
    write = _write_kinds()[kind]
    first = write(store, "sub", b"payload")
    (pack,) = pack_files(tmp_path)
    size = pack.stat().st_size
    metrics = store.metrics
    again = write(store, "sub", bytearray(b"payload"))  # equal content, another buffer
    assert again == first
    assert pack.stat().st_size == size
    after = store.metrics
    assert after["idempotent_hits"] == metrics["idempotent_hits"] + 1
    del after["idempotent_hits"], metrics["idempotent_hits"]
    assert after == metrics


def test_i4_record_set_retry_returns_equal_reference(store: SharedFilesystemStore, tmp_path: Path) -> None:
    refs = store.write_records(sample_records(), submission_id="w")
    first = store.record_set(refs, submission_id="rs")
    size = pack_files(tmp_path)[0].stat().st_size
    assert store.record_set(list(refs), submission_id="rs") == first
    assert pack_files(tmp_path)[0].stat().st_size == size
    with pytest.raises(IdempotencyConflict):
        store.record_set(refs[:1], submission_id="rs")


@pytest.mark.parametrize(
    "changed",
    [
        [Record("a", b"payloaD")],
        [Record("a", b"payload", metadata={"k": 1})],
        [Record("a", b"payload", codec="json.v1")],
        [Record("a", b"payload", tokens=1)],
        [Record("A", b"payload")],
        [Record("a", b"payload"), Record("b", b"")],
    ],
    ids=["payload", "metadata", "codec", "tokens", "record-id", "extra-record"],
)
def test_i4_same_submission_other_content_conflicts_and_writes_nothing(
    store: SharedFilesystemStore, tmp_path: Path, changed: list[Record]
) -> None:
    store.publish([Record("a", b"payload")], submission_id="sub")
    size = pack_files(tmp_path)[0].stat().st_size
    metrics = store.metrics
    with pytest.raises(IdempotencyConflict, match="'sub' was already used for different content"):
        store.publish(changed, submission_id="sub")
    assert pack_files(tmp_path)[0].stat().st_size == size
    assert store.metrics == metrics


def test_i4_same_submission_other_dependencies_conflicts(store: SharedFilesystemStore) -> None:
    dep = store.publish([Record("d", b"d")], submission_id="dep")
    store.publish([Record("a", b"A")], submission_id="sub")
    with pytest.raises(IdempotencyConflict):
        store.publish([Record("a", b"A")], submission_id="sub", dependencies=[dep])


def test_i4_one_submission_id_for_two_kinds_of_write_conflicts(
    store: SharedFilesystemStore, tmp_path: Path
) -> None:
    records = [Record("a", b"A")]
    store.publish(records, submission_id="sub")
    size = pack_files(tmp_path)[0].stat().st_size
    with pytest.raises(IdempotencyConflict):
        store.publish_many([Publication(tuple(records))], submission_id="sub")
    with pytest.raises(IdempotencyConflict):
        store.write_records(records, submission_id="sub")
    refs = store.write_records(records, submission_id="w")
    with pytest.raises(IdempotencyConflict):
        store.publish(records, submission_id="w")
    with pytest.raises(IdempotencyConflict):
        store.record_set(refs, submission_id="w")
    assert pack_files(tmp_path)[0].stat().st_size > size  # only the write_records call wrote


def test_i4_same_content_under_a_new_id_is_a_logically_identical_copy(
    store: SharedFilesystemStore,
) -> None:
    first = store.publish(sample_records(), submission_id="one")
    second = store.publish(sample_records(), submission_id="two")
    assert first.digest == second.digest
    assert first.manifest != second.manifest


# --------------------------------------------------------------------------- vectored writes


def test_d1_payload_is_written_from_the_callers_memory(
    store: SharedFilesystemStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    store.publish([Record("warm", b"w")], submission_id="warm")  # later writes are appends
    calls: list[list[memoryview]] = []
    real = os.pwritev

    def spy(fd: int, buffers: list[Any], offset: int) -> int:
        calls.append([memoryview(b) for b in buffers])
        return real(fd, buffers, offset)

    monkeypatch.setattr(system.current, "pwritev", spy)
    payload = bytearray(np.random.default_rng(3).bytes(4 * MiB))
    written_before = store.metrics["bytes_written"]
    ref = store.publish([Record("big", payload), Record("small", b"tiny")], submission_id="big")
    buffers = [b for call in calls for b in call]
    caller = np.frombuffer(payload, dtype=np.uint8)
    sharing = [b for b in buffers if np.shares_memory(np.frombuffer(b, dtype=np.uint8), caller)]
    assert len(sharing) == 1
    assert sharing[0].obj is payload
    assert sharing[0].nbytes == len(payload)
    assert max(b.nbytes for b in buffers) <= len(payload)  # nothing concatenated around it
    assert sum(b.nbytes for b in buffers) == store.metrics["bytes_written"] - written_before
    assert [bytes(r.payload) for r in store.read(ref)] == [bytes(payload), b"tiny"]


def test_d1_publishing_a_large_payload_allocates_little(tmp_path: Path) -> None:
    payload = np.random.default_rng(4).bytes(64 * MiB)
    with SharedFilesystemStore(tmp_path, RUN) as store:
        store.publish([Record("warm", b"w")], submission_id="warm")
        tracemalloc.start()
        try:
            ref = store.publish([Record("huge", payload)], submission_id="huge")
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 4 * MiB, f"publishing 64 MiB allocated {peak} bytes"
        (record_ref,) = store.validate(ref)
        tail = len(payload) - 3 * CHUNK_BYTES
        assert bytes(store.read_range(record_ref, tail, len(payload))) == payload[tail:]
        assert store.envelope(record_ref)["checksum"] == xxhash.xxh3_128_hexdigest(payload)


# --------------------------------------------------------------------------- other processes (A2)


CHILD = r"""
import hashlib, json, sys
from straw import SharedFilesystemStore
from straw.protocol import RecordSetRef, decode
with SharedFilesystemStore(sys.argv[1], sys.argv[2]) as store:
    print("ready", flush=True)
    for line in sys.stdin:
        ref = RecordSetRef.from_dict(decode(line.strip().encode("utf-8")))
        out = [[r.record_id, r.codec, r.metadata, r.tokens, hashlib.sha256(bytes(r.payload)).hexdigest(),
                len(r.payload)] for r in store.read(ref)]
        print(json.dumps(out), flush=True)
"""


def _expected(records: list[Record]) -> list[list[Any]]:
    return [
        [
            r.record_id,
            r.codec,
            r.metadata,
            r.tokens,
            hashlib.sha256(bytes(r.payload)).hexdigest(),
            len(r.payload),
        ]
        for r in records
    ]


def test_a2_another_process_reads_each_reference_while_the_pack_grows(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    with SharedFilesystemStore(tmp_path, RUN) as store:
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(tmp_path), RUN],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert child.stdin is not None and child.stdout is not None and child.stderr is not None

        def ask(ref: RecordSetRef) -> list[list[Any]]:
            child.stdin.write(encode(dataclasses.asdict(ref)).decode("utf-8") + "\n")  # type: ignore[union-attr]
            child.stdin.flush()  # type: ignore[union-attr]
            line = child.stdout.readline()  # type: ignore[union-attr]
            if not line:
                child.wait(timeout=30)
                pytest.fail(f"child died: {child.stderr.read()}")  # type: ignore[union-attr]
            return json.loads(line)  # type: ignore[no-any-return]

        try:
            assert child.stdout.readline() == "ready\n", child.stderr.read()
            published: list[tuple[RecordSetRef, list[Record]]] = []
            for i in range(24):
                size = [0, 17, 4096, CHUNK_BYTES + 3][i % 4]
                records = [
                    Record(f"r{i}", rng.bytes(size), metadata={"i": i, "ü": "x"}, tokens=i),
                    Record(f"s{i}", encode({"i": i}), "json.v1"),
                ]
                ref = store.publish(records, submission_id=f"s{i}")
                published.append((ref, records))
                assert ask(ref) == _expected(records)  # read at once, while the pack stays open
            assert len({ref.manifest.segment.path for ref, _ in published}) == 1
            for ref, records in published:  # older references still read after more appends
                assert ask(ref) == _expected(records)
        finally:
            child.stdin.close()
            code = child.wait(timeout=30)
            errors = child.stderr.read()
            child.stdout.close()
            child.stderr.close()
        assert code == 0, errors


def test_record_set_ref_pickles_and_still_reads(store: SharedFilesystemStore) -> None:
    ref = store.publish(sample_records(), submission_id="p")
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        copy = pickle.loads(pickle.dumps(ref, protocol=protocol))
        assert copy == ref
        assert hash(copy) == hash(ref)
    assert read_all(store, pickle.loads(pickle.dumps(ref))) == [described(r) for r in sample_records()]


# --------------------------------------------------------------------------- remembered submissions


def test_I4_remembered_answers_are_bounded_by_references_not_only_submissions(
    store: SharedFilesystemStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker publishing results in batches must not keep every answer it ever gave: the
    remembered references stay within SUBMITTED_REFS_REMEMBERED_MAX, oldest forgotten first,
    and a retry of a remembered batch still answers its original references."""
    import straw.store as store_module

    monkeypatch.setattr(store_module, "SUBMITTED_REFS_REMEMBERED_MAX", 20)
    batches = [
        store.publish_many(
            [Publication((Record("r", f"{b}-{k}".encode()),)) for k in range(8)], submission_id=f"b{b}"
        )
        for b in range(10)
    ]
    remembered = store._submissions
    assert list(remembered) == ["b8", "b9"]  # 16 references; a third batch would make 24
    assert store._remembered_refs == sum(len(_Remembered.of_row(r).result) for r in remembered.values()) == 16
    assert (
        store.publish_many(
            [Publication((Record("r", f"9-{k}".encode()),)) for k in range(8)], submission_id="b9"
        )
        == batches[9]
    )  # a remembered retry: the same references, nothing written
    again = store.publish_many(
        [Publication((Record("r", f"0-{k}".encode()),)) for k in range(8)], submission_id="b0"
    )
    assert [r.digest for r in again] == [r.digest for r in batches[0]]  # forgotten: a logical copy
    # One submission larger than the bound is still remembered (the newest always is).
    big = store.publish_many(
        [Publication((Record("r", f"x{k}".encode()),)) for k in range(30)], submission_id="big"
    )
    assert list(store._submissions) == ["big"] and store._remembered_refs == 30
    assert (
        store.publish_many(
            [Publication((Record("r", f"x{k}".encode()),)) for k in range(30)], submission_id="big"
        )
        == big
    )


_OUT_OF_DESCRIPTORS = """
import os, resource, sys
from straw import Record, SharedFilesystemStore
from straw.errors import StorageUnavailable
root = sys.argv[1]
writer = SharedFilesystemStore(root, "fds", segment_target_bytes=0)
refs = [writer.publish([Record(f"r{i}", b"x" * 100)], submission_id=f"s{i}") for i in range(4)]
writer.close()
reader = SharedFilesystemStore(root, "fds")
list(reader.read(refs[0]))  # the first pack is open: every later read needs another descriptor
hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")), hard))
try:
    for ref in refs[1:]:
        list(reader.read(ref))
except StorageUnavailable as error:
    print(error)
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors through /proc")
def test_running_out_of_descriptors_is_storage_unavailable_naming_the_limit(tmp_path: Path) -> None:
    """EMFILE is not a mount problem: the error says to raise the limit or close what is unused."""
    done = subprocess.run(
        [sys.executable, "-c", _OUT_OF_DESCRIPTORS, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert "Errno 24" in done.stdout, done.stdout + done.stderr
    assert "too many files open: raise the limit (ulimit -n)" in done.stdout
    assert "check the mount" not in done.stdout


def _single_record_packs(root: Path, count: int) -> tuple[SharedFilesystemStore, list[RecordSetRef]]:
    """A store and ``count`` references, each to a record alone in its own pack."""
    store = SharedFilesystemStore(root, "fds", segment_target_bytes=0)
    records = [[Record(f"r{i}", f"payload {i}".encode())] for i in range(count)]
    return store, [store.publish(one, submission_id=f"s{i}") for i, one in enumerate(records)]


def _pack_descriptors(root: Path) -> list[str]:
    return [path for path in descriptors_under(root / "raw") if path.endswith((".pack", ".seg"))]


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors through /proc")
def test_the_readers_of_a_process_keep_at_most_a_shared_budget_of_descriptors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """D5.2c: several sessions, each reading more packs than the process's budget, keep the
    budget in all (each closing its own least recently used), but for the few packs each
    reader keeps however many the others hold; every read stays right."""
    monkeypatch.setattr(pack_reader, "OPEN_PACKS_PROCESS_MAX", 24)
    store, refs = _single_record_packs(tmp_path, 40)
    baseline = pack_reader.CACHED_DESCRIPTORS.count
    sessions = [store.read_session() for _ in range(4)]
    try:
        opened = [context.__enter__() for context in sessions]
        for _ in range(2):
            for session in opened:
                for i, ref in enumerate(refs):
                    (record,) = session.read(ref)
                    assert bytes(record.payload) == f"payload {i}".encode()
                held = len(_pack_descriptors(tmp_path))
                assert held <= 24 + OPEN_PACKS_READER_MIN * len(opened), held  # 4 x 40 without it
        assert pack_reader.CACHED_DESCRIPTORS.count - baseline == len(_pack_descriptors(tmp_path))
        # Each reader kept its newest packs open: the last one it read is still cached.
        last = refs[-1].manifest.segment.path
        assert all(last in session._reader._files for session in opened)
    finally:
        for context in sessions:
            context.__exit__(None, None, None)
        store.close()
    assert pack_reader.CACHED_DESCRIPTORS.count == baseline  # closed readers counted nothing back
    assert _pack_descriptors(tmp_path) == []


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors through /proc")
def test_a_thread_that_ends_gives_back_the_descriptors_of_its_store_sessions(tmp_path: Path) -> None:
    """A store's per-thread sessions end with their thread (closing their packs), not with the
    store: a long-lived store read from short-lived threads would otherwise keep every pack
    each of them opened, and the process's budget would go to threads that are gone."""
    store, refs = _single_record_packs(tmp_path, 12)
    try:
        before = _pack_descriptors(tmp_path)
        seen: list[int] = []

        def read_all() -> None:
            for ref in refs:
                list(store.read(ref))
            store.validate(refs[0])  # (through the thread's validating session too)
            seen.append(len(_pack_descriptors(tmp_path)))

        for _ in range(3):
            thread = threading.Thread(target=read_all)
            thread.start()
            thread.join()
        gc.collect()  # (a thread's locals go when it ends; a cycle through them, here)
        assert seen and min(seen) >= len(before) + len(refs)  # each thread had them all open
        assert _pack_descriptors(tmp_path) == before
        (record,) = store.read(refs[3])  # this thread's own session reads as before
        assert bytes(record.payload) == b"payload 3"
    finally:
        store.close()


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors through /proc")
def test_a_read_session_dropped_without_closing_gives_its_descriptors_back(tmp_path: Path) -> None:
    """A session thrown away unclosed (a rollout reader a crashed worker left behind, a
    forgotten ``ReadSession``) closes its cached packs when it is collected."""
    store, refs = _single_record_packs(tmp_path, 6)
    try:
        before = _pack_descriptors(tmp_path)
        session = ReadSession(store.backend, store.run_id)
        for ref in refs:
            list(session.read(ref))
        assert len(_pack_descriptors(tmp_path)) == len(before) + len(refs)
        del session
        gc.collect()
        assert _pack_descriptors(tmp_path) == before
    finally:
        store.close()


_THREADS_UNDER_A_LOW_LIMIT = """
import os, resource, sys, threading
import numpy as np
from straw import SharedFilesystemStore
from straw.tensor import publish_tensors
root, threads = sys.argv[1], int(sys.argv[2])
codecs = ("bytes.v1", "json.v1", "tensor.v1")
store = SharedFilesystemStore(root, "fds", segment_target_bytes=0, codecs=codecs)
refs = [publish_tensors(store, {"x": np.full(4, i, np.int32)}, submission_id=f"t{i}")[0] for i in range(64)]
hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
errors, done = [], threading.Barrier(threads)
def read():
    try:
        for i, ref in enumerate(refs):
            assert int(ref.numpy()[0]) == i
    except Exception as error:
        errors.append(repr(error))
    done.wait()  # every thread holds its sessions until all have read
workers = [threading.Thread(target=read) for _ in range(threads)]
for worker in workers:
    worker.start()
for worker in workers:
    worker.join()
store.close()
print("errors", len(errors), errors[:1])
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors through /proc")
def test_many_reading_threads_stay_within_a_low_descriptor_limit(tmp_path: Path) -> None:
    """Eight threads each reading 64 packs through straw.tensor under a limit of 256
    descriptors: without the process's budget (D5.2c) their sessions would want 512."""
    done = subprocess.run(
        [sys.executable, "-c", _THREADS_UNDER_A_LOW_LIMIT, str(tmp_path), "8"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert "errors 0 []" in done.stdout, done.stdout + done.stderr
