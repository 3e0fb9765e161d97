"""Record sets this process wrote (docs/FORMAT.md section 5; ``straw.store.WRITTEN_SETS``).

A store that has just made an extent durable remembers, for every session of the process,
what verifying each of its sets would find. These tests pin that the remembered form is
exactly the verified one, that it only spares the manifest's parse and digest (the
extent is located again, payloads verified on every read), that it never vouches for a
reference differing in any field, and that it is bounded.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest

import straw._pack.reader as reader_module
import straw.store as store_module
from straw import Publication, Record, SharedFilesystemStore
from straw.backend import FilesystemBackend
from straw.errors import CorruptData, InvalidReference, StorageUnavailable
from straw.store import WRITTEN_SETS, ReadSession, set_key

RUN = "run"


#: Every test starts and ends with empty process-wide caches; ``store`` is conftest's.
pytestmark = pytest.mark.usefixtures("empty_memos")


def _session(store: SharedFilesystemStore) -> ReadSession:
    return ReadSession(FilesystemBackend(store.backend.root), RUN)


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_fresh_session_resolves_a_set_this_process_wrote_without_its_digest(
    store: SharedFilesystemStore, digests: list[int]
) -> None:
    ref = store.publish([Record("a", b"x" * 4096, metadata={"k": 1})], submission_id="s")
    digests[0] = 0  # publishing computed it
    with _session(store) as session:
        assert [r.payload for r in session.read(ref)] == [b"x" * 4096]
        assert digests[0] == 0
        # Payload bytes are still verified on every read.
        located = session.resolve(ref).records[0]
        _flip(Path(store.backend.root) / ref.manifest.segment.path, located.entry.offset + 7)
        with pytest.raises(CorruptData):
            list(session.read(ref))


def test_the_remembered_form_is_the_verified_one(store: SharedFilesystemStore) -> None:
    base = store.publish([Record("base", b"b", tokens=3)], submission_id="base")
    refs = store.publish_many(
        [
            Publication((Record("a", b"aa", metadata={"task_id": "t", "n": 2}, tokens=5),)),
            Publication((Record("b", b"bbb"), Record("c", b"")), (0, base)),
            Publication((), (1,)),
        ],
        submission_id="many",
    )
    with _session(store) as session:
        for ref in (base, *refs):
            remembered = WRITTEN_SETS.get(set_key(ref))
            assert remembered is not None
            verified = session._verify(ref)
            assert verified == remembered
            assert verified.single_extent() == remembered.single_extent()  # None for the empty set
            assert verified.record_paths() == remembered.record_paths()


def test_a_damaged_index_frame_is_still_found_by_a_reading_session(store: SharedFilesystemStore) -> None:
    ref = store.publish([Record("a", b"payload")], submission_id="s")
    assert WRITTEN_SETS.get(set_key(ref)) is not None
    segment = ref.manifest.segment
    _flip(Path(store.backend.root) / segment.path, segment.offset + segment.size - 3)
    with _session(store) as session, pytest.raises(CorruptData):
        session.resolve(ref)


@pytest.mark.parametrize(
    "change",
    [{"digest": "0" * 64}, {"records": 2}, {"payload_bytes": 1}, {"tokens": 5}],
)
def test_a_reference_differing_in_any_field_is_verified_and_refused(
    store: SharedFilesystemStore, change: dict[str, Any]
) -> None:
    ref = store.publish([Record("a", b"payload")], submission_id="s")
    forged = dataclasses.replace(ref, **change)
    with _session(store) as session:
        for _ in range(2):
            with pytest.raises(InvalidReference):
                session.resolve(forged)
        assert session.resolve(ref).records


def test_an_equal_reference_with_a_bool_ordinal_is_refused(store: SharedFilesystemStore) -> None:
    ref = store.publish([Record("a", b"payload")], submission_id="s")
    sneaky = dataclasses.replace(ref, manifest=dataclasses.replace(ref.manifest, ordinal=True))
    assert sneaky == ref and WRITTEN_SETS.get(set_key(sneaky)) is not None  # the key matches
    with _session(store) as session, pytest.raises(InvalidReference, match="ordinal"):
        session.resolve(sneaky)


def test_a_set_with_nested_metadata_is_remembered_as_published(
    store: SharedFilesystemStore, digests: list[int]
) -> None:
    metadata: dict[str, Any] = {"task_id": "t", "nested": [1, 2]}
    ref = store.publish([Record("a", b"payload", metadata=metadata)], submission_id="s")
    metadata["nested"].append(3)  # the caller's list is not the one remembered
    assert WRITTEN_SETS.get(set_key(ref)) is not None
    digests[0] = 0
    with _session(store) as session:
        assert session.resolve(ref).records[0].entry.metadata == {"task_id": "t", "nested": [1, 2]}
    assert digests[0] == 0


def test_a_set_whose_metadata_reads_back_otherwise_is_remembered_as_it_reads_back(
    store: SharedFilesystemStore, digests: list[int]
) -> None:
    metadata: dict[str, Any] = {"task_id": "t", "pair": (1, 2)}  # stored as a list
    ref = store.publish([Record("a", b"payload", metadata=metadata)], submission_id="s")
    assert WRITTEN_SETS.get(set_key(ref)) is not None
    digests[0] = 0
    with _session(store) as session:
        remembered = session.resolve(ref).records[0].entry.metadata
    assert digests[0] == 0  # answered from memory, with the metadata in its stored form
    assert remembered == {"task_id": "t", "pair": [1, 2]}
    store_module.WRITTEN_SETS.clear()
    with _session(store) as session:
        assert session.resolve(ref).records[0].entry.metadata == remembered  # read back from disk
    assert digests[0] == 1


def test_the_memo_is_bounded(
    store: SharedFilesystemStore, digests: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(store_module, "WRITTEN_SETS_CACHED_MAX", 2)
    refs = [store.publish([Record(name, b"p")], submission_id=name) for name in "abc"]
    assert WRITTEN_SETS.get(refs[0]) is None
    digests[0] = 0
    with _session(store) as session:
        session.resolve(refs[1])
        session.resolve(refs[2])
        assert digests[0] == 0
        session.resolve(refs[0])  # the oldest was forgotten: verified
        assert digests[0] == 1


def test_a_set_of_another_pool_is_not_vouched_for(tmp_path: Path, store: SharedFilesystemStore) -> None:
    with SharedFilesystemStore(tmp_path / "elsewhere", RUN) as foreign_store:
        foreign = foreign_store.publish([Record("a", b"payload")], submission_id="s")
    assert WRITTEN_SETS.get(set_key(foreign)) is not None
    with _session(store) as session, pytest.raises(InvalidReference, match="different storage"):
        session.resolve(foreign)


def test_validation_needs_the_pack_to_exist(store: SharedFilesystemStore) -> None:
    ref = store.publish(
        [Record("a", b"payload", metadata={"task_id": "t", "attempt_id": "a"})], submission_id="s"
    )
    (Path(store.backend.root) / ref.manifest.segment.path).unlink()
    with pytest.raises(StorageUnavailable, match="no longer exists"):
        store.validate_reach(ref, task_id="t", attempt_id="a")


def test_validation_looks_for_each_pack_once_and_needs_the_dependencies_packs(
    store: SharedFilesystemStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A result and a dependency in the same pack: that pack is looked for once. A dependency
    in a pack deleted behind the store's back is refused as gone, naming the record set."""
    meta = {"task_id": "t", "attempt_id": "a"}
    part = store.publish([Record("part", b"p")], submission_id="part")
    ref = store.publish([Record("a", b"payload", metadata=meta)], submission_id="s", dependencies=[part])
    looked: list[str] = []
    exists = store_module.posix.exists

    def counted(path: str) -> bool:
        looked.append(path)
        return exists(path)

    monkeypatch.setattr(store_module.posix, "exists", counted)
    assert store.validate_reach(ref, task_id="t", attempt_id="a") == {ref.manifest.segment.path}
    assert len(looked) == 1
    with SharedFilesystemStore(store.backend.root, RUN) as other:  # another writer: another pack
        elsewhere = other.publish([Record("far", b"f")], submission_id="far")
    far = store.publish(
        [Record("b", b"payload", metadata=meta)], submission_id="s2", dependencies=[elsewhere]
    )
    (Path(store.backend.root) / elsewhere.manifest.segment.path).unlink()
    with pytest.raises(StorageUnavailable, match="holding this record set no longer exists"):
        store.validate_reach(far, task_id="t", attempt_id="a")


def test_a_retain_of_data_deleted_outside_collection_is_refused_and_records_nothing(
    store: SharedFilesystemStore,
) -> None:
    """The remembered form answers without opening the pack, so a pack deleted behind the
    store's back (not by a collection) is caught by the existence check, at once."""
    with SharedFilesystemStore(store.backend.root, RUN) as other:  # another writer: another pack
        kept = other.publish([Record("kept", b"k")], submission_id="kept")
    ref = store.publish([Record("a", b"payload")], submission_id="s")
    assert WRITTEN_SETS.get(set_key(ref)) is not None
    (Path(store.backend.root) / ref.manifest.segment.path).unlink()
    with pytest.raises(StorageUnavailable, match="holding this record set no longer exists"):
        store.retain("keeper", [kept, ref])
    assert store.owners("keeper") == []
    store.retain("keeper", [kept])
    assert store.owners("keeper") == ["keeper"]


def test_a_session_used_in_a_forked_child_refuses_and_the_parent_keeps_it(
    store: SharedFilesystemStore,
) -> None:
    ref = store.publish([Record("a", b"payload")], submission_id="s")
    with _session(store) as session:
        session.resolve(ref)
        child = os.fork()
        if child == 0:  # pragma: no cover - the child reports through its exit status
            code = 3
            try:
                session.resolve(ref)
            except RuntimeError as error:
                code = 0 if "cannot be reused after fork" in str(error) else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(child, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert [r.payload for r in session.read(ref)] == [b"payload"]


def test_a_publication_naming_data_deleted_outside_collection_is_refused_and_writes_nothing(
    store: SharedFilesystemStore,
) -> None:
    """Publishing checks its dependencies from the index this process wrote or verified (D5),
    without opening their packs: a dependency whose pack was deleted behind the store's back
    is refused at once (no visibility retry), whether or not it is staged again, and no
    extent is written for the refused publication."""
    with SharedFilesystemStore(store.backend.root, RUN) as other:  # another writer: another pack
        gone = other.publish([Record("gone", b"g")], submission_id="gone")
    kept = store.publish([Record("kept", b"k")], submission_id="kept")
    (Path(store.backend.root) / gone.manifest.segment.path).unlink()
    before = store.metrics["writes"]
    for owned, what in (((), "record set"), ((gone,), "dependency")):  # staged again, or not
        with pytest.raises(StorageUnavailable, match=f"holding this {what} no longer exists"):
            store.publish(
                [Record("b", b"x")], submission_id="b", dependencies=[kept, gone], owned_dependencies=owned
            )
    assert store.metrics["writes"] == before
    ref = store.publish([Record("b", b"x")], submission_id="b", dependencies=[kept])
    assert [r.record_id for r in store.read(ref)] == ["b"]


def test_a_dependency_read_before_is_not_read_again_to_publish(
    store: SharedFilesystemStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch builder names groups it has just read: their index frames are verified once."""
    with SharedFilesystemStore(store.backend.root, RUN) as other:
        groups = [other.publish([Record(f"g{i}", b"g")], submission_id=f"g{i}") for i in range(3)]
    with store.read_session() as session:  # the builder's load reads through a session of its own
        for group in groups:
            list(session.read(group))
    frames: list[object] = []
    verified = reader_module.frame.decode_json_frame

    def counted(*args: Any) -> Any:
        frames.append(args[1])
        return verified(*args)

    monkeypatch.setattr(reader_module.frame, "decode_json_frame", counted)
    store.publish([Record("batch", b"b")], submission_id="batch", dependencies=groups)
    assert frames == []
