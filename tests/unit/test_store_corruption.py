"""Bad input to the record store: damaged packs, forged references, refused codecs and limits.

Every case shows a clear error of the documented class (docs/FORMAT.md, API.md section 5)
and that nothing already acknowledged is lost or changed:

* damaged or truncated bytes -> ``CorruptData`` (I6: every byte returned was verified);
* references that are unsafe, foreign or edited -> ``InvalidReference``;
* versions and algorithms this straw does not know -> ``UnsupportedSchema``;
* records that break a codec rule or a limit -> refused before anything is written.

Byte positions come from the references themselves (``SegmentRef.offset``/``size``) and from
a verified index read (``PackReader``), never from hard-coded offsets.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import shutil
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash

import straw.store as store_module
from straw._pack import frame
from straw._pack.reader import PackReader
from straw.backend import FilesystemBackend
from straw.errors import (
    CorruptData,
    InvalidReference,
    ResourceLimitExceeded,
    UnsupportedSchema,
)
from straw.limits import METADATA_BYTES_MAX, RECORD_ID_BYTES_MAX
from straw.protocol import Publication, Record, RecordRef, RecordSetRef, SegmentRef
from straw.store import SharedFilesystemStore

RUN = "run-a"
OTHER_RUN = "run-b"


# --------------------------------------------------------------------------- helpers


def _no_sleep(delay: float) -> None:
    raise AssertionError(f"unexpected visibility wait of {delay}s: every file here exists")


_OPENED: list[SharedFilesystemStore] = []


@pytest.fixture(autouse=True)
def _close_stores() -> Iterator[None]:
    """Close every store a test opened: their descriptors are plain fds that GC does not close."""
    yield
    while _OPENED:
        with contextlib.suppress(Exception):
            _OPENED.pop().close()


def open_store(root: Path, run: str = RUN, **options: Any) -> SharedFilesystemStore:
    """A store whose backend fails the test instead of waiting for a missing file."""
    store = SharedFilesystemStore(root, run, backend=FilesystemBackend(root, sleep=_no_sleep), **options)
    _OPENED.append(store)
    return store


def payload(size: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(size)


def pack_file(root: Path, ref: RecordSetRef | RecordRef | SegmentRef) -> Path:
    segment = _segment(ref)
    return root / segment.path


def _segment(ref: RecordSetRef | RecordRef | SegmentRef) -> SegmentRef:
    if isinstance(ref, RecordSetRef):
        return ref.manifest.segment
    if isinstance(ref, RecordRef):
        return ref.segment
    return ref


def index_entry(root: Path, run: str, ref: RecordRef) -> frame.IndexEntry:
    """The verified index entry of a record, read by a reader independent of any store."""
    reader = PackReader(FilesystemBackend(root, sleep=_no_sleep), run)
    try:
        return reader.index(ref.segment).entries[ref.ordinal]
    finally:
        reader.close()


def flip(path: Path, offset: int) -> None:
    """Invert every bit of one byte of a file (bit rot)."""
    with open(path, "r+b") as handle:
        handle.seek(offset)
        old = handle.read(1)
        assert len(old) == 1, f"{path} has no byte {offset}"
        handle.seek(offset)
        handle.write(bytes([old[0] ^ 0xFF]))


def truncate(path: Path, size: int) -> None:
    assert size < path.stat().st_size
    os.truncate(path, size)


def snapshot(root: Path) -> dict[str, int]:
    """Every directory (-1) and file (its size) under ``root``."""
    found: dict[str, int] = {}
    for directory, dirs, files in os.walk(root):
        for name in dirs:
            found[os.path.relpath(os.path.join(directory, name), root)] = -1
        for name in files:
            path = os.path.join(directory, name)
            found[os.path.relpath(path, root)] = os.path.getsize(path)
    return found


def read_all(store: SharedFilesystemStore, ref: RecordSetRef) -> list[tuple[str, bytes]]:
    return [(r.record_id, bytes(r.payload)) for r in store.read(ref)]


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "pool"


@pytest.fixture
def published(root: Path) -> tuple[RecordSetRef, list[tuple[str, bytes]]]:
    """One publication of two records in a fresh pool (the store is closed afterwards)."""
    records = [("r0", payload(1000, 1)), ("r1", payload(3000, 2))]
    with open_store(root) as store:
        ref = store.publish([Record(i, p) for i, p in records], submission_id="one")
    return ref, records


# --------------------------------------------------------------------------- corruption (I6)


def test_i6_flipped_payload_byte_raises_corrupt_data(
    root: Path, published: tuple[RecordSetRef, list[tuple[str, bytes]]]
) -> None:
    ref, records = published
    store = open_store(root)
    r0, r1 = store.validate(ref)
    entry = index_entry(root, RUN, r1)
    flip(pack_file(root, ref), entry.offset + entry.length // 2)

    with pytest.raises(CorruptData, match="payload checksum") as caught:
        read_all(store, ref)
    assert "'r1'" in str(caught.value) and ref.manifest.segment.path in str(caught.value)
    with pytest.raises(CorruptData, match="payload checksum"):
        store.read_record(r1)
    # The undamaged record of the same extent still reads byte-exact.
    assert bytes(store.read_record(r0).payload) == records[0][1]


def test_i6_damaged_chunk_fails_only_the_ranges_touching_it(root: Path) -> None:
    with open_store(root) as writer:
        probe = writer.write_records([Record("probe", b"x")], submission_id="probe")[0]
        chunk = writer.envelope(probe)["chunk_bytes"]
        data = payload(2 * chunk + 1000, 3)  # three chunks, the last one short
        (rr,) = writer.write_records([Record("big", data)], submission_id="big")
    entry = index_entry(root, RUN, rr)
    assert len(entry.chunks) == 3 * 16
    flip(pack_file(root, rr), entry.offset + chunk + 10)  # inside chunk 1

    store = open_store(root)
    assert bytes(store.read_range(rr, 0, chunk)) == data[:chunk]
    assert bytes(store.read_range(rr, 100, 200)) == data[100:200]
    assert bytes(store.read_range(rr, 2 * chunk, len(data))) == data[2 * chunk :]
    for start, stop in [
        (chunk, chunk + 1),
        (chunk - 1, chunk + 1),
        (0, len(data)),
        (chunk + 5, 2 * chunk + 5),
    ]:
        with pytest.raises(CorruptData, match=r"payload checksum mismatch in record 'big' \(chunk 1\)"):
            store.read_range(rr, start, stop)
    with pytest.raises(CorruptData, match="payload checksum"):
        store.read_record(rr)
    assert bytes(store.read_record(probe).payload) == b"x"


@pytest.mark.parametrize(
    ("where", "message"),
    [
        ("magic", "bad frame magic"),
        ("length", "frame header checksum mismatch"),
        ("header checksum", "frame header checksum mismatch"),
        ("body", "frame body checksum mismatch"),
        ("last body byte", "frame body checksum mismatch"),
    ],
)
def test_i6_flipped_index_frame_byte_raises_corrupt_data(
    root: Path, published: tuple[RecordSetRef, list[tuple[str, bytes]]], where: str, message: str
) -> None:
    ref, _ = published
    segment = ref.manifest.segment
    delta = {
        "magic": 1,
        "length": 8,
        "header checksum": 35,
        "body": frame.FRAME_HEADER_BYTES + 20,
        "last body byte": segment.size - 1,
    }[where]
    flip(pack_file(root, ref), segment.offset + delta)
    store = open_store(root)
    for read in (lambda: read_all(store, ref), lambda: store.manifest(ref), lambda: store.validate(ref)):
        with pytest.raises(CorruptData, match=message):
            read()
    with pytest.raises(CorruptData, match=message):
        store.read_record(RecordRef(segment, 0))


@pytest.mark.parametrize(
    ("offset", "message"),
    [
        (0, "bad magic"),
        (8, "pack header checksum mismatch"),  # version
        (10, "pack header checksum mismatch"),  # flags
        (20, "pack header checksum mismatch"),  # run tag
        (40, "pack header checksum mismatch"),  # segment id
        (60, "pack header checksum mismatch"),  # the checksum itself
    ],
)
def test_i6_flipped_pack_header_byte_raises_corrupt_data(
    root: Path, published: tuple[RecordSetRef, list[tuple[str, bytes]]], offset: int, message: str
) -> None:
    ref, _ = published
    assert offset < frame.PACK_HEADER_BYTES <= ref.manifest.segment.offset
    flip(pack_file(root, ref), offset)
    store = open_store(root)
    with pytest.raises(CorruptData, match=message):
        read_all(store, ref)
    with pytest.raises(CorruptData, match=message):
        store.validate(ref)


def _two_extents(root: Path) -> tuple[RecordSetRef, bytes, RecordSetRef, bytes]:
    first, second = payload(5000, 4), payload(70_000, 5)
    with open_store(root) as store:
        ref1 = store.publish([Record("first", first)], submission_id="1")
        ref2 = store.publish([Record("second", second)], submission_id="2")
    assert ref1.manifest.segment.path == ref2.manifest.segment.path
    return ref1, first, ref2, second


def test_i6_pack_truncated_inside_a_payload_raises_truncated(root: Path) -> None:
    ref1, first, ref2, _ = _two_extents(root)
    r2 = open_store(root).validate(ref2)[0]
    entry = index_entry(root, RUN, r2)
    truncate(pack_file(root, ref2), entry.offset + entry.length // 2)

    store = open_store(root)
    with pytest.raises(CorruptData, match="truncated") as caught:
        read_all(store, ref2)
    assert ref2.manifest.segment.path in str(caught.value)
    with pytest.raises(CorruptData, match="truncated"):
        store.read_record(r2)
    # The extent before the cut is untouched and still verifies.
    assert read_all(store, ref1) == [("first", first)]


@pytest.mark.parametrize("cut", ["index header", "index body", "last byte"])
def test_i6_pack_truncated_before_the_end_of_the_index_raises_truncated(root: Path, cut: str) -> None:
    ref1, first, ref2, _ = _two_extents(root)
    segment = ref2.manifest.segment
    size = {"index header": 10, "index body": frame.FRAME_HEADER_BYTES + 5, "last byte": segment.size - 1}
    truncate(pack_file(root, ref2), segment.offset + size[cut])

    store = open_store(root)
    with pytest.raises(CorruptData, match="truncated"):
        read_all(store, ref2)
    assert read_all(store, ref1) == [("first", first)]


def test_i6_pack_truncated_inside_its_header_raises_corrupt_data(
    root: Path, published: tuple[RecordSetRef, list[tuple[str, bytes]]]
) -> None:
    ref, _ = published
    truncate(pack_file(root, ref), frame.PACK_HEADER_BYTES - 1)
    with pytest.raises(CorruptData, match="pack header truncated"):
        read_all(open_store(root), ref)


def _count_opens(store: SharedFilesystemStore) -> list[str]:
    opened: list[str] = []
    real = store.backend.open_visible

    def counting(path: str) -> int:
        opened.append(path)
        return real(path)

    store.backend.open_visible = counting  # type: ignore[method-assign]
    return opened


def test_i6_retry_on_a_fresh_descriptor_does_not_hide_damage(
    root: Path, published: tuple[RecordSetRef, list[tuple[str, bytes]]]
) -> None:
    ref, records = published
    # A reader that has the pack open and its index cached from before the damage.
    warm = open_store(root)
    assert read_all(warm, ref) == records
    r1 = warm.validate(ref)[1]
    entry = index_entry(root, RUN, r1)
    flip(pack_file(root, ref), entry.offset + 7)

    opened = _count_opens(warm)
    with pytest.raises(CorruptData, match="payload checksum"):
        warm.read_record(r1)
    # A6: the mismatch was retried once on a freshly opened descriptor, and still reported.
    assert opened == [str(pack_file(root, ref))]

    for fresh in (open_store(root), open_store(root, segment_target_bytes=0)):
        with pytest.raises(CorruptData, match="payload checksum"):
            read_all(fresh, ref)
        with fresh.read_session() as session, pytest.raises(CorruptData, match="payload checksum"):
            session.read_record(r1)
    # Reading again through the same reader reports the same damage again.
    with pytest.raises(CorruptData, match="payload checksum"):
        warm.read_record(r1)


def test_i6_damaged_pack_leaves_other_packs_readable(root: Path) -> None:
    with open_store(root) as store_a, open_store(root) as store_b:
        good = payload(2000, 6)
        ref_a = store_a.publish([Record("a", payload(2000, 7))], submission_id="a")
        ref_b = store_b.publish([Record("b", good)], submission_id="b")
    assert pack_file(root, ref_a) != pack_file(root, ref_b)
    flip(pack_file(root, ref_a), ref_a.manifest.segment.offset + frame.FRAME_HEADER_BYTES + 3)
    reader = open_store(root)
    with pytest.raises(CorruptData):
        read_all(reader, ref_a)
    assert read_all(reader, ref_b) == [("b", good)]


# --------------------------------------------------------------------------- forged references


def _forge_path(ref: RecordSetRef, path: str, segment_id: str | None = None) -> RecordSetRef:
    segment = dataclasses.replace(ref.manifest.segment, path=path)
    if segment_id is not None:
        segment = dataclasses.replace(segment, segment_id=segment_id)
    return dataclasses.replace(ref, manifest=RecordRef(segment, ref.manifest.ordinal))


def _forge_segment(ref: RecordSetRef, **changes: Any) -> RecordSetRef:
    segment = dataclasses.replace(ref.manifest.segment, **changes)
    return dataclasses.replace(ref, manifest=RecordRef(segment, ref.manifest.ordinal))


@pytest.mark.parametrize(
    ("make_path", "message"),
    [
        (lambda p: "raw/../" + p, r"unsafe path .*'\.\.' component"),
        (lambda p: p.replace("raw/", "raw/x/../"), r"unsafe path .*'\.\.' component"),
        (lambda p: "/" + p, "unsafe path .*must be relative"),
        (lambda p: "/etc/passwd", "unsafe path .*must be relative"),
        (lambda p: p.replace("raw/", "raw//"), "unsafe path .*empty"),
        (lambda p: "./" + p, "unsafe path"),
        (lambda p: p.replace("/", "\\"), "unsafe path"),
        (lambda p: p + "\x00", "unsafe path"),
        (lambda p: "", "unsafe path"),
        (lambda p: "straw-pool.json", "not a straw pack path"),
        (lambda p: p[: -len(".pack")] + ".txt", "not a straw pack path"),
        (lambda p: p.replace(".pack", ".pack.tmp"), "not a straw pack path"),
        (lambda p: p.upper(), "not a straw pack path"),
        (lambda p: "raw/" + p.split("/")[2], "not a straw pack path"),
    ],
)
def test_forged_unsafe_or_foreign_path_raises_invalid_reference(
    root: Path,
    published: tuple[RecordSetRef, list[tuple[str, bytes]]],
    make_path: Callable[[str], str],
    message: str,
) -> None:
    ref, records = published
    forged = _forge_path(ref, make_path(ref.manifest.segment.path))
    store = open_store(root)
    with pytest.raises(InvalidReference, match=message):
        read_all(store, forged)
    with pytest.raises(InvalidReference, match=message):
        store.read_record(forged.manifest)
    assert read_all(store, ref) == records


def test_forged_symlink_inside_raw_leaving_the_pool_raises_invalid_reference(
    tmp_path: Path, root: Path, published: tuple[RecordSetRef, list[tuple[str, bytes]]]
) -> None:
    ref, records = published
    segment = ref.manifest.segment
    # A perfect copy of the pack outside the pool: only the symlink check can refuse it.
    outside = tmp_path / "outside.pack"
    shutil.copyfile(pack_file(root, ref), outside)
    writer = "f" * 32
    (root / "raw" / writer).mkdir()
    link = root / "raw" / writer / f"{segment.segment_id}.pack"
    link.symlink_to(outside)
    forged = _forge_path(ref, f"raw/{writer}/{segment.segment_id}.pack")

    store = open_store(root)
    with pytest.raises(InvalidReference, match="symlink leads outside the pool"):
        read_all(store, forged)
    assert read_all(store, ref) == records


def test_forged_symlinked_writer_directory_leaving_the_pool_raises_invalid_reference(
    tmp_path: Path, root: Path, published: tuple[RecordSetRef, list[tuple[str, bytes]]]
) -> None:
    ref, _ = published
    segment = ref.manifest.segment
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.copyfile(pack_file(root, ref), outside / f"{segment.segment_id}.pack")
    writer = "e" * 32
    (root / "raw" / writer).symlink_to(outside, target_is_directory=True)
    forged = _forge_path(ref, f"raw/{writer}/{segment.segment_id}.pack")
    with pytest.raises(InvalidReference, match="symlink leads outside the pool"):
        read_all(open_store(root), forged)


def test_reference_of_another_run_raises_invalid_reference(
    root: Path, published: tuple[RecordSetRef, list[tuple[str, bytes]]]
) -> None:
    ref, records = published
    other = open_store(root, OTHER_RUN)
    with pytest.raises(InvalidReference, match=f"belongs to run '{RUN}'.*reads run '{OTHER_RUN}'"):
        read_all(other, ref)
    with pytest.raises(InvalidReference, match="belongs to run"):
        other.read_record(ref.manifest)
    # The run id edited to match: the pack header's run tag still tells them apart.
    with pytest.raises(InvalidReference, match=f"belongs to another run than '{OTHER_RUN}'"):
        read_all(other, _forge_segment(ref, run_id=OTHER_RUN))
    assert read_all(open_store(root), ref) == records


@pytest.mark.parametrize("same_segment_id", [True, False], ids=["same-segment-id", "new-segment-id"])
def test_pack_copied_into_another_runs_pool_raises_invalid_reference(
    tmp_path: Path,
    root: Path,
    published: tuple[RecordSetRef, list[tuple[str, bytes]]],
    same_segment_id: bool,
) -> None:
    ref, _ = published
    segment = ref.manifest.segment
    pool_b = tmp_path / "pool-b"
    with open_store(pool_b, OTHER_RUN) as store_b:
        store_b.publish([Record("b", b"run b's own data")], submission_id="b")
    segment_id = segment.segment_id if same_segment_id else "0123456789abcdef" * 2
    writer = "c" * 32
    (pool_b / "raw" / writer).mkdir()
    shutil.copyfile(pack_file(root, ref), pool_b / "raw" / writer / f"{segment_id}.pack")
    forged = _forge_segment(
        ref, run_id=OTHER_RUN, path=f"raw/{writer}/{segment_id}.pack", segment_id=segment_id
    )
    with pytest.raises(InvalidReference, match=f"belongs to another run than '{OTHER_RUN}'"):
        read_all(open_store(pool_b, OTHER_RUN), forged)


def test_edited_segment_id_raises_invalid_reference(
    root: Path, published: tuple[RecordSetRef, list[tuple[str, bytes]]]
) -> None:
    ref, _ = published
    store = open_store(root)
    with pytest.raises(InvalidReference, match="does not match path"):
        read_all(store, _forge_segment(ref, segment_id="0" * 32))
    with pytest.raises(InvalidReference, match="does not match path"):
        read_all(store, _forge_segment(ref, segment_id=ref.manifest.segment.segment_id.upper()))


def test_pack_renamed_to_another_segment_id_raises_invalid_reference(
    root: Path, published: tuple[RecordSetRef, list[tuple[str, bytes]]]
) -> None:
    ref, _ = published
    segment = ref.manifest.segment
    writer = segment.path.split("/")[1]
    new_id = "a" * 32
    shutil.copyfile(pack_file(root, ref), root / "raw" / writer / f"{new_id}.pack")
    forged = _forge_segment(ref, path=f"raw/{writer}/{new_id}.pack", segment_id=new_id)
    with pytest.raises(InvalidReference, match=f"holds segment {segment.segment_id}, not {new_id}"):
        read_all(open_store(root), forged)


@pytest.mark.parametrize("ordinal", [2, 3, 1000, -1])
def test_record_ordinal_out_of_range_raises_invalid_reference(
    root: Path, published: tuple[RecordSetRef, list[tuple[str, bytes]]], ordinal: int
) -> None:
    ref, _ = published
    # The extent holds r0, r1 and the manifest (ordinals 0..2); 2 is the manifest, which reads.
    store = open_store(root)
    record = RecordRef(ref.manifest.segment, ordinal)
    if ordinal == 2:
        assert store.read_record(record).codec == frame.MANIFEST_CODEC
        return
    with pytest.raises(InvalidReference, match=f"ordinal {ordinal} is not in an extent of 3 records"):
        store.read_record(record)
    with pytest.raises(InvalidReference, match="ordinal"):
        read_all(store, dataclasses.replace(ref, manifest=record))


@pytest.mark.parametrize(
    ("field", "message"),
    [
        ("digest", "digest does not match the manifest"),
        ("records", "counts do not match"),
        ("payload_bytes", "counts do not match"),
        ("tokens", "counts do not match"),
    ],
)
def test_edited_record_set_ref_raises_invalid_reference(
    root: Path, published: tuple[RecordSetRef, list[tuple[str, bytes]]], field: str, message: str
) -> None:
    ref, _ = published
    value = getattr(ref, field)
    forged = dataclasses.replace(ref, **{field: "0" * 64 if field == "digest" else value + 1})
    store = open_store(root)
    for read in (
        lambda: read_all(store, forged),
        lambda: store.manifest(forged),
        lambda: store.validate(forged),
    ):
        with pytest.raises(InvalidReference, match=message):
            read()


def test_record_set_ref_naming_a_data_record_raises_invalid_reference(
    root: Path, published: tuple[RecordSetRef, list[tuple[str, bytes]]]
) -> None:
    ref, _ = published
    forged = dataclasses.replace(ref, manifest=RecordRef(ref.manifest.segment, 0))
    with pytest.raises(InvalidReference, match="'r0' is not a manifest"):
        read_all(open_store(root), forged)


def test_wrong_reference_type_raises_invalid_reference(
    root: Path, published: tuple[RecordSetRef, list[tuple[str, bytes]]]
) -> None:
    ref, _ = published
    store = open_store(root)
    for read in (store.read, store.manifest, store.validate):
        with pytest.raises(InvalidReference, match="expected a RecordSetRef, got RecordRef"):
            read(ref.manifest)  # type: ignore[arg-type]
        with pytest.raises(InvalidReference, match="expected a RecordSetRef, got dict"):
            read(dataclasses.asdict(ref))  # type: ignore[arg-type]
    for read_one in (store.read_record, store.envelope):
        with pytest.raises(InvalidReference, match="expected a RecordRef, got RecordSetRef"):
            read_one(ref)  # type: ignore[arg-type]


def test_record_ref_with_a_non_segment_raises_invalid_reference(
    root: Path, published: tuple[RecordSetRef, list[tuple[str, bytes]]]
) -> None:
    ref, _ = published
    forged = RecordRef(dataclasses.asdict(ref.manifest.segment), 0)  # type: ignore[arg-type]
    with pytest.raises(InvalidReference, match="expected a SegmentRef"):
        open_store(root).read_record(forged)


@pytest.mark.parametrize(
    ("changes", "error", "message"),
    [
        ({"checksum": "0" * 32}, CorruptData, "does not match the reference"),
        ({"offset_delta": 1}, CorruptData, "bad frame magic"),
        ({"offset_delta": -40}, CorruptData, "bad frame magic"),
        ({"record_frame": 1}, CorruptData, "frame kind 1 where kind 2 was expected"),
        ({"size_delta": -1}, CorruptData, "header says"),
        ({"size_delta": 1}, CorruptData, "header says"),  # the seal frame follows
        ({"offset": 0}, InvalidReference, "inside the pack header"),
        ({"offset": 63}, InvalidReference, "inside the pack header"),
        ({"size": 40}, CorruptData, "cannot hold an index frame"),
        ({"size": -5}, CorruptData, "cannot hold an index frame"),
        ({"offset": 2**63}, InvalidReference, "out of range"),
        ({"offset": 10**12}, CorruptData, "truncated"),
    ],
)
def test_edited_extent_location_or_checksum_is_refused(
    root: Path,
    published: tuple[RecordSetRef, list[tuple[str, bytes]]],
    changes: dict[str, Any],
    error: type[Exception],
    message: str,
) -> None:
    ref, records = published
    segment = ref.manifest.segment
    changes = dict(changes)
    if "offset_delta" in changes:
        changes["offset"] = segment.offset + changes.pop("offset_delta")
    if "size_delta" in changes:
        changes["size"] = segment.size + changes.pop("size_delta")
    store = open_store(root)
    if "record_frame" in changes:
        # Point the reference at a record frame (valid header and body, wrong kind).
        entry = index_entry(root, RUN, RecordRef(segment, changes.pop("record_frame")))
        changes.update(
            offset=entry.offset - frame.FRAME_HEADER_BYTES,
            size=frame.FRAME_HEADER_BYTES + entry.length,
            checksum=entry.content,
        )
    with pytest.raises(error, match=message):
        read_all(store, _forge_segment(ref, **changes))
    assert read_all(store, ref) == records


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"version": 2}, "reference format version 2 is not supported"),
        ({"version": 0}, "reference format version 0 is not supported"),
        ({"checksum_algorithm": "sha256"}, "checksum algorithm 'sha256' is not supported"),
        ({"checksum_algorithm": "XXH3-128"}, "checksum algorithm 'XXH3-128' is not supported"),
    ],
)
def test_unknown_reference_version_or_algorithm_raises_unsupported_schema(
    root: Path, published: tuple[RecordSetRef, list[tuple[str, bytes]]], changes: dict[str, Any], message: str
) -> None:
    ref, _ = published
    store = open_store(root)
    forged = _forge_segment(ref, **changes)
    with pytest.raises(UnsupportedSchema, match=message):
        read_all(store, forged)
    with pytest.raises(UnsupportedSchema, match=message):
        store.read_record(forged.manifest)
    # The same through the JSON form a reference travels in.
    decoded = RecordSetRef.from_dict(dataclasses.asdict(forged))
    with pytest.raises(UnsupportedSchema, match=message):
        read_all(store, decoded)


def test_pack_header_with_unknown_version_raises_unsupported_schema(
    root: Path, published: tuple[RecordSetRef, list[tuple[str, bytes]]]
) -> None:
    ref, _ = published
    path = pack_file(root, ref)
    with open(path, "r+b") as handle:
        head = bytearray(handle.read(frame.PACK_HEADER_BYTES))
        assert struct.unpack_from("<H", head, 8) == (1,)
        struct.pack_into("<H", head, 8, 2)
        # docs/FORMAT.md 2.1: bytes 56..64 are the xxh3-64 digest (big-endian) of bytes 0..56.
        head[56:64] = xxhash.xxh3_64_digest(bytes(head[:56]))
        handle.seek(0)
        handle.write(head)
    with pytest.raises(UnsupportedSchema, match="pack format version 2 is not supported"):
        read_all(open_store(root), ref)


# --------------------------------------------------------------------------- codecs and limits


def test_unregistered_codec_is_refused_before_anything_is_written(root: Path) -> None:
    store = open_store(root)
    before = snapshot(root)
    with pytest.raises(UnsupportedSchema, match=r"codec 'msgpack\.v1' is not registered"):
        store.publish([Record("r", b"x", codec="msgpack.v1")], submission_id="s")
    assert snapshot(root) == before
    assert not (root / "raw" / store.writer_id).exists()
    # With a pack already open, its size does not change either.
    ref = store.publish([Record("ok", b"fine")], submission_id="ok")
    before = snapshot(root)
    with pytest.raises(UnsupportedSchema, match="not registered"):
        store.write_records([Record("a", b"1"), Record("b", b"2", codec="npy.v1")], submission_id="w")
    assert snapshot(root) == before
    # A codec the store does register is accepted.
    custom = open_store(root, codecs=("bytes.v1", "npy.v1"))
    (rr,) = custom.write_records([Record("n", b"\x93NUMPY", codec="npy.v1")], submission_id="n")
    assert open_store(root).read_record(rr).codec == "npy.v1"
    assert read_all(open_store(root), ref) == [("ok", b"fine")]


@pytest.mark.parametrize("codecs", [("pickle",), ("pickle.v1",), ("bytes.v1", "PICKLE.v5"), ("cloudpickle",)])
def test_store_refuses_pickle_codecs(tmp_path: Path, codecs: tuple[str, ...]) -> None:
    root = tmp_path / "pool"
    with pytest.raises(UnsupportedSchema, match="never stores or loads pickle"):
        SharedFilesystemStore(root, RUN, codecs=codecs)
    assert not root.exists()


def test_pickle_record_is_refused_by_a_default_store(root: Path) -> None:
    store = open_store(root)
    before = snapshot(root)
    with pytest.raises(UnsupportedSchema, match="pickle is never accepted"):
        store.publish([Record("p", b"\x80\x04N.", codec="pickle.v1")], submission_id="p")
    assert snapshot(root) == before


MAX_RECORD = 1024

BAD_RECORDS: dict[str, tuple[Callable[[], Record], type[Exception], str]] = {
    "id-too-long": (
        lambda: Record("x" * (RECORD_ID_BYTES_MAX + 1), b"p"),
        ResourceLimitExceeded,
        f"record_id is longer than {RECORD_ID_BYTES_MAX} bytes",
    ),
    "id-too-long-in-utf8": (
        lambda: Record("é" * (RECORD_ID_BYTES_MAX // 2 + 1), b"p"),
        ResourceLimitExceeded,
        "record_id is longer",
    ),
    "id-empty": (lambda: Record("", b"p"), ValueError, "record_id must be a non-empty string"),
    "metadata-too-large": (
        lambda: Record("m", b"p", metadata={"k": "x" * METADATA_BYTES_MAX}),
        ResourceLimitExceeded,
        f"metadata is {METADATA_BYTES_MAX + 8} bytes, the limit is {METADATA_BYTES_MAX}",
    ),
    "metadata-nan": (lambda: Record("m", b"p", metadata={"x": float("nan")}), ValueError, "NaN"),
    "metadata-int-key": (lambda: Record("m", b"p", metadata={1: "a"}), TypeError, "string keys"),
    "payload-too-large": (  # RECORD_BYTES_MAX is shrunk to MAX_RECORD for these tests
        lambda: Record("big", bytes(MAX_RECORD + 1)),
        ResourceLimitExceeded,
        f"payload of {MAX_RECORD + 1} bytes exceeds the record limit of {MAX_RECORD} bytes",
    ),
    "payload-not-contiguous": (
        lambda: Record("nc", np.arange(64, dtype=np.uint8)[::2]),
        ValueError,
        "C-contiguous",
    ),
    "payload-str": (lambda: Record("s", "text"), TypeError, "payload must be bytes"),  # type: ignore[arg-type]
    "tokens-negative": (lambda: Record("t", b"p", tokens=-1), ValueError, "tokens must be a non-negative"),
    "tokens-too-large": (lambda: Record("t", b"p", tokens=2**63), ValueError, "tokens must be"),
    "tokens-bool": (lambda: Record("t", b"p", tokens=True), ValueError, "tokens must be"),
}


@pytest.mark.parametrize("api", ["publish", "publish_many", "write_records"])
@pytest.mark.parametrize("case", sorted(BAD_RECORDS))
def test_record_breaking_a_limit_is_refused_and_nothing_is_written(
    root: Path, case: str, api: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    make, error, message = BAD_RECORDS[case]
    monkeypatch.setattr(store_module, "RECORD_BYTES_MAX", MAX_RECORD)
    store = open_store(root)
    earlier = store.publish([Record("earlier", b"kept")], submission_id="earlier")
    before = snapshot(root)
    good = Record("good", b"g")
    with pytest.raises(error, match=message):
        if api == "publish":
            store.publish([good, make()], submission_id="sub")
        elif api == "publish_many":
            store.publish_many([Publication((good,)), Publication((make(),))], submission_id="sub")
        else:
            store.write_records([good, make()], submission_id="sub")
    assert snapshot(root) == before
    assert store.metrics["writes"] == 1
    # The refused submission id was not consumed: it can carry valid content now.
    retried = store.publish([good], submission_id="sub")
    fresh = open_store(root)
    assert read_all(fresh, retried) == [("good", b"g")]
    assert read_all(fresh, earlier) == [("earlier", b"kept")]


def test_max_record_bytes_is_kept_for_compatibility_and_caps_nothing(root: Path) -> None:
    store = open_store(root, max_record_bytes=16)
    ref = store.publish([Record("big", payload(1000, 3))], submission_id="big")
    assert read_all(open_store(root), ref) == [("big", payload(1000, 3))]
    assert store.max_record_bytes == 16


def test_records_exactly_at_the_limits_are_accepted(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store_module, "RECORD_BYTES_MAX", MAX_RECORD)
    store = open_store(root)
    metadata = {"k": "x" * (METADATA_BYTES_MAX - 8)}
    records = [
        Record("i" * RECORD_ID_BYTES_MAX, payload(MAX_RECORD, 8)),
        Record("m", b"", metadata=metadata, tokens=2**63 - 1),
    ]
    ref = store.publish(records, submission_id="edge")
    got = list(open_store(root).read(ref))
    assert [(r.record_id, bytes(r.payload), r.metadata, r.tokens) for r in got] == [
        (r.record_id, bytes(r.payload), r.metadata, r.tokens) for r in records
    ]


def test_file_with_a_pack_name_but_other_content_raises_corrupt_data(
    root: Path, published: tuple[RecordSetRef, list[tuple[str, bytes]]]
) -> None:
    ref, records = published
    segment = ref.manifest.segment
    writer, new_id = "d" * 32, "b" * 32
    (root / "raw" / writer).mkdir()
    not_a_pack = root / "raw" / writer / f"{new_id}.pack"
    store = open_store(root)
    forged = _forge_segment(ref, path=f"raw/{writer}/{new_id}.pack", segment_id=new_id)
    shutil.copyfile(root / "straw-pool.json", not_a_pack)
    with pytest.raises(CorruptData, match="pack header truncated"):
        read_all(store, forged)
    not_a_pack.write_bytes(b"PK\x03\x04" + bytes(segment.offset + segment.size))
    with pytest.raises(CorruptData, match="not a straw pack"):
        read_all(open_store(root), forged)
    assert read_all(store, ref) == records


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.pop("digest"), "missing field 'digest'"),
        (lambda d: d.update(records="2"), "RecordSetRef.records has type str"),
        (lambda d: d.update(tokens=True), "RecordSetRef.tokens has type bool"),
        (lambda d: d["manifest"].pop("ordinal"), "missing field 'ordinal'"),
        (lambda d: d["manifest"].update(segment=[1, 2]), "RecordRef.segment has type list"),
        (lambda d: d["manifest"]["segment"].update(size=1.5), "SegmentRef.size has type float"),
        (lambda d: d["manifest"]["segment"].update(version="1"), "SegmentRef.version has type str"),
        (lambda d: d["manifest"]["segment"].pop("path"), "missing field 'path'"),
        (lambda d: d.update(manifest=None), "RecordSetRef.manifest has type NoneType"),
    ],
)
def test_malformed_reference_json_raises_invalid_reference(
    published: tuple[RecordSetRef, list[tuple[str, bytes]]],
    edit: Callable[[dict[str, Any]], Any],
    message: str,
) -> None:
    ref, _ = published
    data = dataclasses.asdict(ref)
    edit(data)
    with pytest.raises(InvalidReference, match=message):
        RecordSetRef.from_dict(data)


@pytest.mark.parametrize(("start", "stop"), [(-1, 5), (5, 4), (0, 1001), (1001, 1002)])
def test_read_range_outside_the_payload_raises_value_error(
    root: Path, published: tuple[RecordSetRef, list[tuple[str, bytes]]], start: int, stop: int
) -> None:
    ref, records = published
    store = open_store(root)
    r0 = store.validate(ref)[0]
    with pytest.raises(ValueError, match=f"range {start}:{stop} outside a payload of 1000 bytes"):
        store.read_range(r0, start, stop)
    assert bytes(store.read_range(r0, 0, 1000)) == records[0][1]


def test_forged_references_given_to_writes_are_refused_and_nothing_is_written(
    root: Path, published: tuple[RecordSetRef, list[tuple[str, bytes]]]
) -> None:
    ref, _ = published
    store = open_store(root)
    (good,) = store.write_records([Record("g", b"good")], submission_id="good")
    before = snapshot(root)
    record = Record("n", b"new")
    with pytest.raises(InvalidReference, match="digest does not match"):
        store.publish([record], submission_id="s1", dependencies=[dataclasses.replace(ref, digest="0" * 64)])
    # The same store refuses the forged copy even though its reader already verified ``ref``.
    with pytest.raises(InvalidReference, match="belongs to run"):
        store.publish([record], submission_id="s2", dependencies=[_forge_segment(ref, run_id="x")])
    bad_dep = Publication((record,), dependencies=(dataclasses.replace(ref, tokens=7),))
    with pytest.raises(InvalidReference, match="counts do not match"):
        store.publish_many([Publication((record,)), bad_dep], submission_id="s3")
    with pytest.raises(InvalidReference, match="ordinal 9"):
        store.record_set([good, RecordRef(good.segment, 9)], submission_id="s4")
    with pytest.raises(InvalidReference, match=r"unsafe path .*'\.\.'"):
        store.record_set([_forge_segment_ref(good, path="raw/../x.pack")], submission_id="s5")
    assert snapshot(root) == before
    # A damaged extent cannot be built upon either.
    entry = index_entry(root, RUN, good)
    flip(pack_file(root, good), good.segment.offset + frame.FRAME_HEADER_BYTES + 1)
    fresh = open_store(root)
    before = snapshot(root)
    with pytest.raises(CorruptData, match="frame body checksum mismatch"):
        fresh.record_set([good], submission_id="s6")
    assert snapshot(root) == before
    assert entry.length == 4


def _forge_segment_ref(ref: RecordRef, **changes: Any) -> RecordRef:
    return RecordRef(dataclasses.replace(ref.segment, **changes), ref.ordinal)


@pytest.mark.parametrize(
    ("changes", "error"),
    [
        ({"run_id": OTHER_RUN}, InvalidReference),
        ({"segment_id": "0" * 32}, InvalidReference),
        ({"version": 2}, UnsupportedSchema),
        ({"checksum_algorithm": "sha256"}, UnsupportedSchema),
    ],
    ids=["run_id", "segment_id", "version", "checksum_algorithm"],
)
def test_forged_reference_is_refused_after_the_genuine_one_was_read(
    root: Path,
    published: tuple[RecordSetRef, list[tuple[str, bytes]]],
    changes: dict[str, Any],
    error: type[Exception],
) -> None:
    ref, records = published
    store = open_store(root)
    assert read_all(store, ref) == records
    with pytest.raises(error):
        read_all(store, _forge_segment(ref, **changes))
