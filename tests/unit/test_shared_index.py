"""The process-wide index cache (``straw._pack.reader.SHARED_INDEXES``).

A store that makes an extent durable shares its index with the other stores of the
process, but only validation (``validate_reach``, the queue's completion check, which
returns no bytes) answers from it; reads keep verifying every index and payload byte on
disk. These tests pin both halves and the copy that keeps a caller's later changes to
its metadata out of the cache.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from straw import Publication, Record, RecordSetRef, SharedFilesystemStore
from straw._pack import reader
from straw.errors import CorruptData, InvalidReference


class _Flag(str, enum.Enum):
    ON = "on"


@pytest.fixture(autouse=True)
def _empty_cache() -> Iterator[None]:
    reader.SHARED_INDEXES.clear()
    yield
    reader.SHARED_INDEXES.clear()


def _stores(root: Path) -> tuple[SharedFilesystemStore, SharedFilesystemStore]:
    return SharedFilesystemStore(root, "run"), SharedFilesystemStore(root, "run")


def _damage_index(root: Path, ref: RecordSetRef) -> None:
    """Flip a byte inside the extent's index frame on disk."""
    segment = ref.manifest.segment
    path = root / segment.path
    data = bytearray(path.read_bytes())
    data[segment.offset + segment.size - 3] ^= 0x01
    path.write_bytes(bytes(data))


def test_validation_in_another_store_uses_the_written_index_reads_still_verify(tmp_path: Path) -> None:
    writer, coordinator_store = _stores(tmp_path)
    record = Record("r", b"payload", metadata={"task_id": "t1", "attempt_id": "a1"})
    ref = writer.publish([record], submission_id="s")
    _damage_index(tmp_path, ref)
    # Validation answers from the index the writer made durable, without reading it back.
    packs = coordinator_store.validate_reach(ref, task_id="t1", attempt_id="a1")
    assert packs == {ref.manifest.segment.path}
    # Reads promise checked bytes: they go to disk and find the damage.
    with pytest.raises(CorruptData):
        coordinator_store.read(ref)
    writer.close()
    coordinator_store.close()


def test_ownership_is_checked_against_the_metadata_as_published(tmp_path: Path) -> None:
    writer, coordinator_store = _stores(tmp_path)
    metadata = {"task_id": "t1", "attempt_id": "a1"}
    ref = writer.publish([Record("r", b"x", metadata=metadata)], submission_id="s")
    metadata["task_id"] = "changed after publish"  # the caller's dict stays theirs
    assert coordinator_store.validate_reach(ref, task_id="t1", attempt_id="a1")
    with pytest.raises(InvalidReference, match="task"):
        coordinator_store.validate_reach(ref, task_id="changed after publish", attempt_id="a1")
    writer.close()
    coordinator_store.close()


def test_nested_metadata_is_shared_as_a_copy_equal_to_the_stored_index(tmp_path: Path) -> None:
    writer, coordinator_store = _stores(tmp_path)
    metadata = {"task_id": "t1", "attempt_id": "a1", "tensor": {"shape": [2, 3], "kind": "k"}}
    ref = writer.publish([Record("r", b"x", metadata=metadata)], submission_id="s")
    shared = reader.SHARED_INDEXES.get(ref.manifest.segment)
    assert shared is not None
    metadata["tensor"]["shape"].append(4)  # the caller's nested values stay theirs
    metadata["tensor"]["kind"] = "changed"
    with coordinator_store.read_session() as session:  # a read verifies the index on disk
        stored = session.index(ref.manifest.segment)
    assert shared.entries[0].metadata == stored.entries[0].metadata
    assert shared.entries[0].metadata["tensor"] == {"shape": [2, 3], "kind": "k"}
    writer.close()
    coordinator_store.close()


@pytest.mark.parametrize(
    ("extra", "stored"),
    [
        ((1, 2), [1, 2]),
        ({"nested": ("a",)}, {"nested": ["a"]}),
        ({1: "int key"}, {"1": "int key"}),
        (_Flag.ON, "on"),
    ],
    ids=["tuple", "nested tuple", "int key", "str enum"],
)
def test_metadata_is_shared_in_its_stored_form(tmp_path: Path, extra: object, stored: object) -> None:
    """A tuple is read back as a list, an enum as its value: the shared index holds what is read
    back, not the caller's objects, so validation from it and from disk agree."""
    writer, coordinator_store = _stores(tmp_path)
    metadata = {"task_id": "t1", "attempt_id": "a1", "extra": extra}
    ref = writer.publish([Record("r", b"x", metadata=metadata)], submission_id="s")
    shared = reader.SHARED_INDEXES.get(ref.manifest.segment)
    assert shared is not None
    with coordinator_store.read_session() as session:
        on_disk = session.index(ref.manifest.segment)
    assert shared.entries[0].metadata == on_disk.entries[0].metadata
    assert on_disk.entries[0].metadata["extra"] == stored
    assert type(shared.entries[0].metadata["extra"]) is type(stored)
    assert shared.rows == on_disk.rows  # row for row, key order included
    writer.close()
    coordinator_store.close()


def test_the_shared_cache_is_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    writer = SharedFilesystemStore(tmp_path, "run")
    first = writer.publish([Record("r", b"x")], submission_id="s0")
    shared = reader.SHARED_INDEXES._items._items
    frame_bytes = shared._total  # one record and its manifest, as the bound counts them
    assert frame_bytes > 2 * 100  # bytes, not entries
    monkeypatch.setattr(reader, "SHARED_INDEX_BYTES_MAX", 5 * frame_bytes + frame_bytes // 2)
    refs = [first] + [writer.publish([Record("r", b"x")], submission_id=f"s{i}") for i in range(1, 12)]
    kept = [ref for ref in refs if reader.SHARED_INDEXES.get(ref.manifest.segment) is not None]
    assert kept == refs[-5:]  # the oldest go first
    assert shared._total == 5 * frame_bytes
    # Counted in bytes, not frames: one frame of 64 publications leaves room for no other.
    many = writer.publish_many([Publication((Record("r", b"y"),)) for _ in range(64)], submission_id="many")
    assert reader.SHARED_INDEXES.get(many[0].manifest.segment) is not None  # the newest stays
    assert all(reader.SHARED_INDEXES.get(ref.manifest.segment) is None for ref in refs)
    writer.close()


def test_small_entries_weigh_less_than_large_ones(tmp_path: Path) -> None:
    """The bound is the rows' estimated bytes: a frame whose entries carry more metadata weighs
    more, so a cache of small entries holds more of them."""
    writer = SharedFilesystemStore(tmp_path, "run")
    shared = reader.SHARED_INDEXES._items._items
    small = writer.publish_many([Publication((Record(f"g{i}", b"x"),)) for i in range(8)], submission_id="a")
    small_bytes = shared._total
    assert reader.SHARED_INDEXES.get(small[0].manifest.segment) is not None
    metadata = {"task_id": "t" * 40, "attempt_id": "a" * 32, "notes": ["x" * 100]}
    writer.publish_many(
        [Publication((Record(f"g{i}", b"x", metadata=metadata),)) for i in range(8)], submission_id="b"
    )
    large_bytes = shared._total - small_bytes
    assert large_bytes > small_bytes + 8 * (40 + 32 + 100)  # at least the metadata's characters
    writer.close()


def test_a_frame_weighs_the_same_when_it_leaves(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bound's running total stays exact: a frame's weight depends on its rows' lengths,
    not on what Python has cached in them since (a non-ASCII string grows by its UTF-8 form
    once an encoder asks for it), or the total would drift and the bound with it."""
    writer = SharedFilesystemStore(tmp_path, "run")
    shared = reader.SHARED_INDEXES._items._items
    metadata = {"task_id": "t-\u00e9t\u00e9", "note": "\u65e5\u672c\u8a9e" * 20}
    ref = writer.publish([Record("r\u00e9sultat", b"x", metadata=metadata)], submission_id="s")
    kept = next(iter(shared._items.values()))
    weight = shared._total
    for item in (x for row in kept[2:] for x in row if type(x) is str):
        orjson.dumps(item)  # gives the string its cached UTF-8 form
    assert reader._kept_bytes(kept) == weight
    monkeypatch.setattr(reader, "SHARED_INDEX_BYTES_MAX", 1)  # each put leaves the newest only
    others = [writer.publish([Record("o", b"y")], submission_id=f"o{i}") for i in range(3)]
    assert reader.SHARED_INDEXES.get(ref.manifest.segment) is None
    assert shared._total == sum(reader._kept_bytes(v) for v in shared._items.values()) > 0
    assert reader.SHARED_INDEXES.get(others[-1].manifest.segment) is not None
    writer.close()
