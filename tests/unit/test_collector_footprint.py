"""What long-lived caches and queue state cost the cycle collector (issue 12).

A full collection walks every object the collector tracks, with every thread of the process
stopped meanwhile; the store's bounded caches once held some 400k such objects at a million
tasks, and each full pass took hundreds of milliseconds. These tests pin the forms that
keep them out of its sight: rows of plain values (tuples of atoms, which a collection
untracks), one object per remembered set or answer, and bounds that hold. No timings.
"""

from __future__ import annotations

import gc
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import straw.store as store_module
from straw import Publication, Record, SharedFilesystemStore
from straw._pack import frame, reader
from straw._queue.commits import CommitLog
from straw.protocol import encode, encode_pieces
from straw.store import WRITTEN_SETS, set_key

RUN = "run"


#: Every test starts and ends with empty process-wide caches; ``store`` is conftest's.
pytestmark = pytest.mark.usefixtures("empty_memos")


def _untracked(value: Any) -> bool:
    """Whether collections stop tracking ``value``: each pass untracks a tuple whose items are
    untracked already, in the order it meets them, so a tuple of tuples may need two."""
    gc.collect()
    gc.collect()
    return not gc.is_tracked(value)


def _batch(store: SharedFilesystemStore, name: str, count: int = 8) -> list[Any]:
    return store.publish_many(
        [
            Publication(
                (Record(f"r{k}", f"{name}-{k}".encode(), metadata={"task_id": f"t{k}", "n": k, "ok": True}),)
            )
            for k in range(count)
        ],
        submission_id=name,
    )


def test_an_index_keeps_its_entries_as_untracked_rows(store: SharedFilesystemStore) -> None:
    refs = _batch(store, "b")
    nested = store.publish([Record("x", b"x", metadata={"deep": [1, {"a": 2}]})], submission_id="n")
    for ref in (refs[0], nested):
        index = reader.SHARED_INDEXES.get(ref.manifest.segment)
        assert index is not None
        assert _untracked(index.rows) and all(_untracked(row) for row in index.rows)
    # The entries built from the rows are what the frame says, metadata as published.
    with store.read_session() as session:
        parsed = session.index(nested.manifest.segment)
        assert parsed == reader.SHARED_INDEXES.get(nested.manifest.segment)
        assert _untracked(parsed.rows)
        assert parsed.entry(0).metadata == {"deep": [1, {"a": 2}]}
        assert session.index(refs[0].manifest.segment).entry(0).metadata == {
            "task_id": "t0",
            "n": 0,
            "ok": True,
        }
        assert [r.metadata for r in session.read(refs[3])] == [{"task_id": "t3", "n": 3, "ok": True}]


def test_entries_are_built_afresh_so_a_caller_cannot_change_the_cache(store: SharedFilesystemStore) -> None:
    (ref,) = _batch(store, "b", 1)
    index = reader.SHARED_INDEXES.get(ref.manifest.segment)
    assert index is not None
    index.entry(0).metadata["task_id"] = "changed"
    index.metadata(0)["n"] = 99
    assert index.entry(0).metadata == {"task_id": "t0", "n": 0, "ok": True}


def test_a_written_set_is_one_tracked_object_and_resolves_as_verified(store: SharedFilesystemStore) -> None:
    refs = _batch(store, "b")
    remembered = WRITTEN_SETS.get(set_key(refs[2]))
    assert remembered is not None
    assert _untracked(set_key(refs[2])) and _untracked(remembered._ordinals)
    assert remembered._records is None  # compact: its records share one extent
    with store.read_session() as session:
        assert session._verify(refs[2]) == remembered
        assert [located.metadata for located in remembered.records] == [{"task_id": "t2", "n": 2, "ok": True}]


def test_the_shared_index_cache_holds_only_untracked_rows(store: SharedFilesystemStore) -> None:
    # Every publication adds an index to it: kept as objects, each would be walked by every
    # full collection and, surviving, bring the next one sooner.
    refs = [ref for k in range(3) for ref in _batch(store, f"b{k}")]
    held = reader.SHARED_INDEXES._items._items._items
    assert len(held) == 3
    assert all(_untracked(key) and _untracked(row) for key, row in held.items())
    index = reader.SHARED_INDEXES.get(refs[0].manifest.segment)
    assert index is not None and index.entry(0).metadata == {"task_id": "t0", "n": 0, "ok": True}
    assert reader.SHARED_INDEXES.get(refs[-1].manifest.segment) == reader.SHARED_INDEXES.get(
        refs[-1].manifest.segment
    )


def test_what_a_publication_leaves_in_the_memos_is_untracked_before_the_oldest_generation(
    store: SharedFilesystemStore,
) -> None:
    # An object reaches the oldest generation through a collection of the middle one, and each
    # object moved there brings the next full collection sooner. Every publication leaves an
    # entry in three memos: each must be untracked by the two collections it meets before.
    refs = _batch(store, "young")
    shared = next(reversed(reader.SHARED_INDEXES._items._items._items.values()))
    written = WRITTEN_SETS._items._items._items[set_key(refs[3])]
    remembered = store._submissions["young"]
    gc.collect(0)  # its first collection: survivors move to the middle generation
    gc.collect(1)  # the second: survivors would move to the oldest
    assert [gc.is_tracked(kept) for kept in (shared, written, remembered)] == [False] * 3
    again = WRITTEN_SETS.get(set_key(refs[3]))
    assert again is not None and again.digest == refs[3].digest
    assert [located.metadata for located in again.records] == [{"task_id": "t3", "n": 3, "ok": True}]


def test_a_written_set_whose_index_left_the_shared_memo_is_verified_again(
    store: SharedFilesystemStore,
) -> None:
    refs = _batch(store, "gone")
    assert WRITTEN_SETS.get(set_key(refs[0])) is not None
    reader.SHARED_INDEXES.clear()  # the set's row names its extent, whose index is gone
    assert WRITTEN_SETS.get(set_key(refs[0])) is None
    with store.read_session() as session:
        assert [bytes(r.payload) for r in session.read(refs[0])] == [
            b"gone-0"
        ]  # verified from the pack, as if never written here


def test_an_open_pack_lists_its_extents_manifests_as_untracked_rows(store: SharedFilesystemStore) -> None:
    # An open pack collects hundreds of extents before it is sealed; each one's manifest
    # ordinals (for the catalog's staging) stay out of the collector's sight.
    for k in range(3):
        _batch(store, f"b{k}")
    pack = store._writer._pack
    assert pack is not None and len(pack.manifests) == 3
    assert all(_untracked(ordinals) for ordinals in pack.manifests.values())
    assert [list(ordinals) for ordinals in pack.manifests.values()] == [[1, 3, 5, 7, 9, 11, 13, 15]] * 3


def test_remembered_answers_are_untracked_rows_rebuilt_equal(store: SharedFilesystemStore) -> None:
    refs = _batch(store, "b")
    single = store.publish([Record("s", b"s")], submission_id="one")
    records = store.write_records([Record("w", b"w"), Record("v", b"v")], submission_id="w")
    for name, answer in (("b", refs), ("one", (single,)), ("w", records)):
        row = store._submissions[name]
        assert _untracked(row)  # the answer, its segment and its references: plain values
        got = store_module._Remembered.of_row(
            row
        ).result  # publish_many's list, which the public call returns as a tuple
        assert (tuple(got) if isinstance(got, list) else got) == answer and got is not answer
    assert (
        store.publish_many(
            [
                Publication(
                    (Record(f"r{k}", f"b-{k}".encode(), metadata={"task_id": f"t{k}", "n": k, "ok": True}),)
                )
                for k in range(8)
            ],
            submission_id="b",
        )
        == refs
    )
    assert store._remembered_refs == 8 + 1 + 2


def test_a_validating_reader_keeps_shared_indexes_out_of_its_own_cache(
    store: SharedFilesystemStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    shared = reader.SHARED_INDEXES._items._items
    batches = [_batch(store, "b0")]  # 16 entries per frame
    frame_bytes = shared._total
    monkeypatch.setattr(reader, "SHARED_INDEX_BYTES_MAX", 2 * frame_bytes + frame_bytes // 2)
    batches += [_batch(store, f"b{n}") for n in range(1, 6)]  # frames of the same size
    assert shared._total == 2 * frame_bytes  # the two newest frames
    for refs in batches[-2:]:
        store.reach(refs)
    validator = store._session(shared=True)._reader
    assert validator._indexes._total == 0  # served from the shared cache, not copied
    store.reach(batches[0])  # evicted there: read back, kept by this reader (and shared again)
    assert validator._indexes._total == 16 and shared._total == 2 * frame_bytes


def _receipt(position: int) -> dict[str, Any]:
    path = f"raw/{'a' * 32}/{'1' * 32}.pack"
    return {
        "commit_id": f"c{position}",
        "task_id": f"t{position}",
        "submission_id": f"s{position}",
        "digest": f"{position:064x}",
        "position": position,
        "result_ref": {
            "manifest": {
                "segment": {
                    "run_id": RUN,
                    "path": path,
                    "segment_id": "1" * 32,
                    "size": 300,
                    "checksum": "0" * 32,
                    "version": 1,
                    "checksum_algorithm": "xxh3-128",
                    "offset": 64 * position,
                },
                "ordinal": 1,
            },
            "digest": f"{position:064x}",
            "records": 1,
            "payload_bytes": 64,
            "tokens": 0,
        },
    }


def test_receipts_accepted_since_the_load_are_untracked_rows() -> None:
    log = CommitLog(RUN)
    for position in range(5):
        log.append(_receipt(position))
    assert all(_untracked(row) for row in log._new)
    assert list(log) == [_receipt(p) for p in range(5)]
    log[0]["task_id"] = "changed"  # a receipt read is a copy
    assert log[0] == _receipt(0)
    reloaded = CommitLog.unpack(log.pack(RUN), RUN)
    assert list(reloaded) == list(log) and all(_untracked(row) for row in reloaded._rows)


def _nested(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.lists(inner, max_size=8) | st.dictionaries(st.text(max_size=4), inner, max_size=8)


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    _nested,
    max_leaves=60,
)


@settings(max_examples=200, deadline=None)
@given(value=_json, items=st.integers(min_value=1, max_value=5))
def test_encoding_in_pieces_gives_the_canonical_bytes(value: Any, items: int) -> None:
    assert b"".join(encode_pieces(value, items)) == encode(value)


def test_a_snapshot_body_is_encoded_a_bounded_number_of_items_per_call() -> None:
    body = {"tasks": [[f"t{k}", k] for k in range(5000)], "ref_packs": {f"k{k}": 0 for k in range(3000)}}
    pieces = encode_pieces(body, 1000)
    assert b"".join(pieces) == encode(body)
    assert len(pieces) >= 5 + 3


def test_index_rows_and_entries_round_trip_through_a_frame() -> None:
    entries = [
        frame.IndexEntry("a", "bytes.v1", {"k": "v", "n": 1.5}, 2, 100, 3, "0" * 32, "0" * 16),
        frame.IndexEntry("b", "bytes.v1", {"nested": {"x": [1]}}, 0, 200, 0, "1" * 32, ""),
        frame.inline_entry("m", {"v": 1, "digest": "d", "records": [[-1, 0]], "segments": [], "deps": []}),
    ]
    index = frame.Index("sub", frame.CHUNK_BYTES, entries)
    assert index.entries == tuple(entries) and len(index) == 3
    body = frame.index_body("sub", entries)
    assert frame.parse_index(body) == index
    assert store_module._Located is not None  # the store builds its located records from these rows


class _CountingRows:
    """``history.Rows`` that records how many rows each request builds."""

    def __init__(self, pairs: list[tuple[str, Any]]) -> None:
        self.pairs, self.asked = pairs, []

    def __len__(self) -> int:
        return len(self.pairs)

    def key(self, at: int) -> str:
        return self.pairs[at][0]

    def rows(self, ats: Any) -> list[Any]:
        self.asked.append(len(ats))
        return [self.pairs[at][1] for at in ats]


def test_a_history_file_is_built_a_block_of_rows_at_a_time() -> None:
    from straw._queue import history
    from straw.limits import HISTORY_BLOCK_ROWS

    tasks = [(f"t{k}", [f"t{k}", {"n": k}]) for k in range(300)]
    receipts = [(f"s{k}", [{"submission_id": f"s{k}"}, "w", []]) for k in range(200)]
    requests = [("r1", ["r1", "x", "y"])]
    meta = {"counts": {"completed": 300}}
    lazy_tasks, lazy_receipts = _CountingRows(tasks), _CountingRows(receipts)
    assert history.build(9, 40, lazy_tasks, lazy_receipts, meta, requests) == history.build(
        9, 40, tasks, receipts, meta, requests
    )
    assert max(lazy_tasks.asked + lazy_receipts.asked) == HISTORY_BLOCK_ROWS
    assert sum(lazy_tasks.asked) == 300 and sum(lazy_receipts.asked) == 200


def test_a_task_keeps_its_lease_as_untracked_values(store: SharedFilesystemStore) -> None:
    import weakref

    from straw import Coordinator, TaskSpec

    queue = Coordinator(store, exclusive_owner="footprint", lease_seconds=60)
    try:
        queue.submit_tasks("s", [TaskSpec("plain"), TaskSpec("fed", input_ref=_batch(store, "in", 1)[0])])
        granted = {a.lease.task_id: a.lease for a in queue.acquire("w", 2).assignments}
        tasks = queue._state.tasks
        for task_id, lease in granted.items():
            assert tasks[task_id].lease == lease and tasks[task_id].lease is not lease
            assert _untracked(tasks[task_id].held)
        # The worker's Lease is the worker's: dropped, it is freed at once, unless an
        # outstanding read of the task's input names it.
        plain, fed = weakref.ref(granted.pop("plain")), weakref.ref(granted.pop("fed"))
        assert plain() is None and fed() is not None
        assert queue.outstanding_reads() == (fed(),)
        # The queue still reports the attempt from those values.
        status = queue.task_status("plain")
        assert status["state"] == "leased" and status["lease"]["worker_id"] == "w"
    finally:
        queue.close()
