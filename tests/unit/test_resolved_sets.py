"""A read session verifies a record set once (docs/FORMAT.md section 5, "Verified record sets").

The memo is keyed by the whole reference and only remembers successes; these tests pin that
it saves the second verification and that it never vouches for anything it did not verify:
a forged or stale reference, a reference of another run or pool, a damaged payload, an index
frame that fell out of the index cache and was damaged meanwhile.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import straw.store as store_module
from straw import Record, RecordSetRef, SharedFilesystemStore
from straw._pack import reader
from straw.backend import FilesystemBackend
from straw.errors import CorruptData, InvalidReference
from straw.store import ReadSession

RUN = "run"


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SharedFilesystemStore]:
    with SharedFilesystemStore(tmp_path / "pool", RUN) as opened:
        yield opened


def _publish(store: SharedFilesystemStore, name: str, payload: bytes = b"payload") -> RecordSetRef:
    """Publish, then forget the process's memo of the sets it wrote (``test_written_sets.py``
    covers that one): each session here verifies what it resolves for itself."""
    ref = store.publish([Record(name, payload)], submission_id=f"s-{name}")
    store_module.WRITTEN_SETS.clear()
    return ref


def _session(store: SharedFilesystemStore, run: str = RUN) -> ReadSession:
    return ReadSession(FilesystemBackend(store.backend.root), run)


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_an_equal_reference_is_verified_once_per_session(
    store: SharedFilesystemStore, digests: list[int]
) -> None:
    ref = _publish(store, "a")
    digests[0] = 0  # publishing computed it too
    with _session(store) as session:
        first = session.resolve(ref)
        again = session.resolve(RecordSetRef.from_dict(dataclasses.asdict(ref)))  # an equal copy
        assert again is first
        assert digests[0] == 1
        assert [r.payload for r in session.read(ref)] == [b"payload"]
    with _session(store) as other:  # another session verifies for itself
        other.resolve(ref)
    assert digests[0] == 2


@pytest.mark.parametrize(
    "change",
    [
        {"digest": "0" * 64},  # forged
        {"records": 2},
        {"payload_bytes": 1},
        {"tokens": 5},
    ],
)
def test_a_reference_differing_in_any_field_is_verified_and_refused(
    store: SharedFilesystemStore, change: dict[str, Any]
) -> None:
    ref = _publish(store, "a")
    forged = dataclasses.replace(ref, **change)
    with _session(store) as session:
        session.resolve(ref)
        for _ in range(2):  # a failure is never remembered
            with pytest.raises(InvalidReference):
                session.resolve(forged)
        assert session.resolve(ref).records


def test_a_stale_reference_to_a_set_of_other_records_is_refused(store: SharedFilesystemStore) -> None:
    first, second = _publish(store, "a"), _publish(store, "b", b"other")
    stale = dataclasses.replace(first, manifest=second.manifest)  # the digest of what was there before
    with _session(store) as session:
        session.resolve(first)
        session.resolve(second)
        with pytest.raises(InvalidReference, match="forged or stale"):
            session.resolve(stale)


def test_an_equal_reference_with_a_bool_ordinal_is_still_refused(store: SharedFilesystemStore) -> None:
    ref = _publish(store, "a")
    assert ref.manifest.ordinal == 1  # record 0, then its manifest
    sneaky = dataclasses.replace(ref, manifest=dataclasses.replace(ref.manifest, ordinal=True))
    assert sneaky == ref and hash(sneaky) == hash(ref)  # True == 1: the memo's key matches
    with _session(store) as session:
        session.resolve(ref)
        with pytest.raises(InvalidReference, match="ordinal"):
            session.resolve(sneaky)


def test_references_of_another_run_or_pool_are_refused(tmp_path: Path, store: SharedFilesystemStore) -> None:
    ref = _publish(store, "a")
    other_run = dataclasses.replace(
        ref,
        manifest=dataclasses.replace(
            ref.manifest, segment=dataclasses.replace(ref.manifest.segment, run_id="other")
        ),
    )
    with SharedFilesystemStore(tmp_path / "elsewhere", RUN) as foreign_store:
        foreign = _publish(foreign_store, "a")
    with _session(store) as session:
        session.resolve(ref)
        with pytest.raises(InvalidReference, match="run"):
            session.resolve(other_run)
        with pytest.raises(InvalidReference, match="different storage"):
            session.resolve(foreign)


def test_payload_bytes_are_verified_on_every_read(store: SharedFilesystemStore) -> None:
    ref = _publish(store, "a", b"x" * 4096)
    with _session(store) as session:
        assert [r.payload for r in session.read(ref)] == [b"x" * 4096]
        located = session.resolve(ref).records[0]
        _flip(Path(store.backend.root) / ref.manifest.segment.path, located.entry.offset + 7)
        with pytest.raises(CorruptData):
            list(session.read(ref))


def test_an_index_frame_dropped_from_the_cache_is_verified_again(
    store: SharedFilesystemStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, second = _publish(store, "a"), _publish(store, "b")
    monkeypatch.setattr(reader, "INDEX_CACHE_ENTRIES_MAX", 1)  # only the newest frame stays
    with _session(store) as session:
        session.resolve(first)
        session.resolve(second)  # the first extent's index frame leaves the cache
        segment = first.manifest.segment
        _flip(Path(store.backend.root) / segment.path, segment.offset + segment.size - 3)
        with pytest.raises(CorruptData):
            session.resolve(first)
        assert session.resolve(second).records


def test_the_memo_is_bounded(
    store: SharedFilesystemStore, digests: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(store_module, "RECORD_SETS_CACHED_MAX", 2)
    refs = [_publish(store, name) for name in "abc"]
    digests[0] = 0
    with _session(store) as session:
        for ref in refs:
            session.resolve(ref)
        assert digests[0] == 3
        session.resolve(refs[2])
        session.resolve(refs[1])
        assert digests[0] == 3
        session.resolve(refs[0])  # the oldest was forgotten: verified again
        assert digests[0] == 4


def test_a_closed_session_forgets_and_refuses(store: SharedFilesystemStore) -> None:
    ref = _publish(store, "a")
    session = _session(store)
    session.resolve(ref)
    session.close()
    with pytest.raises(RuntimeError, match="closed"):
        session.resolve(ref)
