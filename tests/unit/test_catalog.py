"""The ownership catalog: its pure state (docs/GC.md events, the collectable decision) and its log.

* ``CatalogState``: every event kind, applied one by one, with the exact resulting state;
  an unknown event is an internal bug (``InvariantViolation``).
* ``collectable()`` enumerated over sealed x owned x staging over x tombstoned x writer dead
  (plus packs the catalog never heard of, collector seals with ``null`` extents, records-only
  extents and partly released extents) against the rule of docs/GC.md: sealed, reached by no
  owner, not tombstoned, and staging over (all extents released, or the writer is dead).
* ``to_dict``/``from_dict`` round trip through canonical JSON keeps every field and decision.
* ``Catalog`` (the log, G1-G3): two catalogs of one pool exclude each other (``flock`` on two
  descriptors of one process) and see each other's frames after ``locked()``; a torn final
  frame (every byte prefix, followed by the zeros written ahead) is zeroed by the next lock
  holder and earlier events survive; a log cut short anywhere (J7) and a flipped bit in a
  complete frame are ``CorruptData`` and nothing of them is applied or changed; a fault at
  each catalog phase leaves every event of the frame either present or absent for a fresh reader.
"""

from __future__ import annotations

import fcntl
import itertools
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from queue_helpers import descriptors_under
from straw._catalog import log as catalog_log
from straw._catalog.log import Catalog, describe
from straw._catalog.state import RECORDS_ONLY, RESERVED_PREFIXES, CatalogState, PackInfo, writer_of
from straw._journal import frame
from straw.backend import PEER_PHASES, FilesystemBackend
from straw.errors import (
    CorruptData,
    InvariantViolation,
    StorageUnavailable,
    UnsafeRecovery,
    UnsupportedSchema,
)
from straw.limits import CATALOG_PREALLOC_BYTES
from straw.protocol import decode, encode

W1 = "a" * 32
W2 = "b" * 32
P1 = f"raw/{W1}/{'1' * 32}.pack"
P2 = f"raw/{W1}/{'2' * 32}.pack"
P3 = f"raw/{W2}/{'3' * 32}.seg"
P4 = f"raw/{W2}/{'4' * 32}.pack"

CATALOG_PHASES = ("before_catalog_write", "after_catalog_append", "after_catalog_sync")


def _state(*events: dict[str, Any]) -> CatalogState:
    state = CatalogState()
    for event in events:
        state.apply(event)
    return state


# --------------------------------------------------------------------------- pure state: events


def test_writer_of_takes_the_writer_directory_of_a_pack_path() -> None:
    assert writer_of(P1) == W1
    assert writer_of(P3) == W2
    assert writer_of("catalog/log") == ""
    assert writer_of("raw/x/y/z.pack") == ""


def test_reserved_owner_prefixes_are_straws_own() -> None:
    assert RESERVED_PREFIXES == ("queue:", "staging:", "pin:")
    assert RECORDS_ONLY == -1


def test_retain_replaces_the_owners_packs() -> None:
    state = _state({"op": "retain", "owner": "o", "packs": [P1, P2]})
    assert state.owners == {"o": {P1, P2}}
    state.apply({"op": "retain", "owner": "o", "packs": [P3]})
    assert state.owners == {"o": {P3}}
    state.apply({"op": "retain", "owner": "o", "packs": []})
    assert state.owners == {"o": set()}  # an owner with no packs still exists (release is explicit)


def test_add_extends_the_owners_packs_and_creates_the_owner() -> None:
    state = _state({"op": "add", "owner": "q", "packs": [P1]})
    assert state.owners == {"q": {P1}}
    state.apply({"op": "add", "owner": "q", "packs": [P1, P2]})
    assert state.owners == {"q": {P1, P2}}


def test_release_drops_the_owner_and_ignores_an_unknown_one() -> None:
    state = _state(
        {"op": "retain", "owner": "o", "packs": [P1]}, {"op": "retain", "owner": "p", "packs": [P1]}
    )
    state.apply({"op": "release", "owner": "o"})
    assert state.owners == {"p": {P1}}
    state.apply({"op": "release", "owner": "never"})  # replaying a log must not fail on it
    assert state.owners == {"p": {P1}}


def test_seal_records_the_extents_with_integer_offsets() -> None:
    state = _state({"op": "seal", "pack": P1, "extents": {"154": [1], "900": []}})
    info = state.packs[P1]
    assert (info.writer, info.sealed, info.extents, info.released) == (W1, True, {154: [1], 900: []}, {})


def test_seal_with_null_extents_is_a_collector_seal() -> None:
    state = _state({"op": "seal", "pack": P3, "extents": None})
    assert state.packs[P3] == PackInfo(W2, True, None, {})


def test_unstage_records_released_items_even_before_the_seal() -> None:
    state = _state({"op": "unstage", "items": [[P1, 154, 1], [P2, 200, RECORDS_ONLY]]})
    assert (state.packs[P1].writer, state.packs[P1].sealed, state.packs[P1].extents) == (W1, False, None)
    assert state.packs[P1].released_pairs() == [[154, 1]]
    assert state.packs[P2].released_pairs() == [[200, RECORDS_ONLY]]
    state.apply({"op": "seal", "pack": P1, "extents": {"154": [1]}})
    assert state.packs[P1].released_pairs() == [[154, 1]]  # the seal keeps what was released before it
    assert state.staging_over(P1)


def test_released_staging_is_one_int_per_extent_and_round_trips_the_snapshot() -> None:
    # A publish_many of 64 sets: 64 manifest ordinals released in one extent, then one more
    # extent of records only; released twice changes nothing.
    items = [[P1, 154, ordinal] for ordinal in range(1, 129, 2)] + [[P1, 900, RECORDS_ONLY]]
    state = _state({"op": "unstage", "items": items}, {"op": "unstage", "items": items[:3]})
    info = state.packs[P1]
    assert len(info.released) == 2 and all(isinstance(mask, int) for mask in info.released.values())
    pairs = sorted([offset, ordinal] for _, offset, ordinal in items)
    assert info.released_pairs() == pairs
    again = CatalogState.from_dict(state.to_dict())
    assert again.packs[P1] == info and again.to_dict() == state.to_dict()
    # The snapshot (version 2) holds the masks too: one entry per extent, not per publication.
    assert state.to_dict()["packs"][P1][3] == [[154, info.released[154]], [900, 1]]
    state.apply({"op": "seal", "pack": P1, "extents": {"154": list(range(1, 129, 2)), "900": []}})
    assert state.staging_over(P1)
    assert not _state(
        {"op": "seal", "pack": P1, "extents": {"154": [1, 3]}}, {"op": "unstage", "items": [[P1, 154, 1]]}
    ).staging_over(P1)


def test_writer_dead_tombstone_and_reclaimed_accumulate() -> None:
    state = _state(
        {"op": "writer_dead", "writer": W1},
        {"op": "tombstone", "packs": [P1]},
        {"op": "tombstone", "packs": [P2]},
        {"op": "reclaimed", "packs": [P1]},
        {"op": "reclaimed", "packs": []},
    )
    assert state.dead_writers == {W1}
    assert state.tombstones == {P1, P2}
    assert state.reclaimed == {P1}


def test_a_reclaimed_pack_keeps_its_name_and_drops_its_extents() -> None:
    # A long job reclaims thousands of packs of hundreds of extents each: once a pack is gone
    # from disk, the state (and so every catalog snapshot) keeps only its name.
    extents = {str(offset): [1, 3] for offset in range(64, 64 * 200, 64)}
    items = [[P1, int(offset), ordinal] for offset in extents for ordinal in (1, 3)]
    state = _state(
        {"op": "seal", "pack": P1, "extents": extents},
        {"op": "unstage", "items": items},
        {"op": "seal", "pack": P2, "extents": {"64": [1]}},
        {"op": "writer_dead", "writer": W1},
    )
    assert state.staging_over(P1) and len(state.packs[P1].released) == len(extents)
    before = state.why(P1)
    state.apply({"op": "tombstone", "packs": [P1]})
    state.apply({"op": "reclaimed", "packs": [P1]})
    assert P1 not in state.packs and P1 not in state.to_dict()["packs"]
    assert (state.tombstones, state.reclaimed) == ({P1}, {P1})
    # Explaining it still says what it was: sealed, its staging over, tombstoned.
    assert state.why(P1) == {**before, "tombstoned": True}
    # An adoption noted (or a seal replayed) after the collection does not bring it back.
    state.apply({"op": "unstage", "items": [[P1, 64, 1], [P2, 64, 1]]})
    state.apply({"op": "seal", "pack": P1, "extents": {"64": [1]}})
    assert P1 not in state.packs and state.staging_over(P2)
    assert state.collectable([P1, P2]) == [P2]  # (P1 is tombstoned: never offered again)


def test_from_dict_forgets_the_reclaimed_packs_an_older_snapshot_lists() -> None:
    data = {
        "v": 2,
        "owners": {},
        "packs": {P1: [W1, True, {"64": [1]}, [[64, 0b100]]], P2: [W1, True, {"64": [1]}, []]},
        "dead_writers": [],
        "tombstones": [P1],
        "reclaimed": [P1],
    }
    state = CatalogState.from_dict(data)
    assert list(state.packs) == [P2] and state.reclaimed == {P1}
    assert state.why(P1)["sealed"] and state.why(P1)["staging_over"]
    assert state.to_dict()["packs"] == {P2: [W1, True, {"64": [1]}, []]}


@pytest.mark.parametrize("event", [{"op": "compact"}, {"op": 3}, {}])
def test_unknown_event_is_an_invariant_violation(event: dict[str, Any]) -> None:
    with pytest.raises(InvariantViolation, match="is known"):
        CatalogState().apply(event)


def test_reached_lists_every_owner_of_each_pack() -> None:
    state = _state(
        {"op": "retain", "owner": "o", "packs": [P1, P2]}, {"op": "add", "owner": "q", "packs": [P1]}
    )
    reached = state.reached()
    assert sorted(reached) == [P1, P2]
    assert sorted(reached[P1]) == ["o", "q"]
    assert reached[P2] == ["o"]


# --------------------------------------------------------------------------- pure state: the decision


def _decision_case(sealed: bool, owned: bool, released: bool, tombstoned: bool, dead: bool) -> CatalogState:
    """One pack P1 (two extents: a publication with two manifests, and write_records only)."""
    events: list[dict[str, Any]] = []
    if sealed:
        events.append({"op": "seal", "pack": P1, "extents": {"154": [0, 2], "700": []}})
    if released:
        events.append({"op": "unstage", "items": [[P1, 154, 0], [P1, 154, 2], [P1, 700, RECORDS_ONLY]]})
    else:
        events.append({"op": "unstage", "items": [[P1, 154, 0], [P1, 700, RECORDS_ONLY]]})  # ordinal 2 staged
    if owned:
        events.append({"op": "retain", "owner": "o", "packs": [P1]})
    else:
        events.append({"op": "retain", "owner": "o", "packs": [P2]})  # an owner of something else
    if tombstoned:
        events.append({"op": "tombstone", "packs": [P1]})
    if dead:
        events.append({"op": "writer_dead", "writer": W1})
    return _state(*events)


@pytest.mark.parametrize(
    ("sealed", "owned", "released", "tombstoned", "dead"),
    list(itertools.product([False, True], repeat=5)),
)
def test_i13_collectable_decision_table(
    sealed: bool, owned: bool, released: bool, tombstoned: bool, dead: bool
) -> None:
    state = _decision_case(sealed, owned, released, tombstoned, dead)
    want = sealed and not owned and not tombstoned and (released or dead)
    assert state.collectable([P1, P2]) == ([P1] if want else [])
    assert state.staging_over(P1) == (sealed and (released or dead))
    why = state.why(P1)
    assert why == {
        "pack": P1,
        "owners": ["o"] if owned else [],
        "sealed": sealed,
        "writer": W1,
        "writer_dead": dead,
        "staging_over": sealed and (released or dead),
        "tombstoned": tombstoned,
    }


def test_collectable_needs_the_pack_on_disk_and_known_to_the_catalog() -> None:
    state = _state({"op": "seal", "pack": P1, "extents": None})
    assert state.collectable([]) == []  # not on disk (already gone): nothing to tombstone
    assert state.collectable([P2]) == []  # on disk but never sealed in the catalog: kept
    assert state.collectable([P2, P1]) == [P1]


def test_collector_seal_ends_staging_even_with_nothing_released() -> None:
    state = _state({"op": "seal", "pack": P1, "extents": None})
    assert state.staging_over(P1)
    assert state.collectable([P1]) == [P1]


def test_records_only_extent_needs_its_records_released() -> None:
    state = _state({"op": "seal", "pack": P1, "extents": {"154": []}})
    state.apply({"op": "unstage", "items": [[P1, 154, 0]]})  # a manifest ordinal, not the records
    assert state.collectable([P1]) == []
    state.apply({"op": "unstage", "items": [[P1, 154, RECORDS_ONLY]]})
    assert state.collectable([P1]) == [P1]


def test_every_extent_must_be_released() -> None:
    state = _state({"op": "seal", "pack": P1, "extents": {"154": [1], "600": [3, 5]}})
    for item, want in (([P1, 154, 1], []), ([P1, 600, 5], []), ([P1, 600, 3], [P1])):
        state.apply({"op": "unstage", "items": [item]})
        assert state.collectable([P1]) == want


def test_an_unsealed_pack_of_a_dead_writer_waits_for_the_collector_seal() -> None:
    state = _state({"op": "writer_dead", "writer": W1}, {"op": "unstage", "items": [[P1, 154, 0]]})
    assert not state.staging_over(P1)
    assert state.collectable([P1]) == []
    state.apply({"op": "seal", "pack": P1, "extents": None})
    assert state.collectable([P1]) == [P1]


def test_why_of_an_unknown_pack() -> None:
    assert CatalogState().why(P3) == {
        "pack": P3,
        "owners": [],
        "sealed": False,
        "writer": W2,
        "writer_dead": False,
        "staging_over": False,
        "tombstoned": False,
    }


def test_collectable_is_sorted_and_excludes_tombstones() -> None:
    state = _state(
        {"op": "seal", "pack": P3, "extents": None},
        {"op": "seal", "pack": P2, "extents": None},
        {"op": "seal", "pack": P1, "extents": None},
        {"op": "tombstone", "packs": [P2]},
    )
    assert state.collectable([P3, P2, P1]) == [P1, P3]


# --------------------------------------------------------------------------- pure state: snapshot


def _rich_state() -> CatalogState:
    return _state(
        {"op": "retain", "owner": "o", "packs": [P1, P2]},
        {"op": "add", "owner": "queue:x", "packs": [P3]},
        {"op": "retain", "owner": "empty", "packs": []},
        {"op": "seal", "pack": P1, "extents": {"154": [1], "700": []}},
        {"op": "seal", "pack": P3, "extents": None},
        {"op": "unstage", "items": [[P1, 154, 1], [P2, 10, RECORDS_ONLY]]},
        {"op": "writer_dead", "writer": W2},
        {"op": "tombstone", "packs": [P2]},
        {"op": "seal", "pack": P4, "extents": {"64": [1]}},
        {"op": "unstage", "items": [[P4, 64, 1]]},
        {"op": "tombstone", "packs": [P4]},
        {"op": "reclaimed", "packs": [P4]},
    )


def test_to_dict_from_dict_round_trip_keeps_every_field_and_decision() -> None:
    state = _rich_state()
    data = state.to_dict()
    assert data == {
        "v": 2,
        "owners": {"o": [P1, P2], "queue:x": [P3], "empty": []},
        "packs": {
            P1: [W1, True, {"154": [1], "700": []}, [[154, 0b100]]],  # ordinal 1 is bit 2
            P2: [W1, False, None, [[10, 0b1]]],  # RECORDS_ONLY is bit 0
            P3: [W2, True, None, []],
        },
        "dead_writers": [W2],
        "tombstones": [P2, P4],
        "reclaimed": [P4],  # a reclaimed pack is a name only: no entry in "packs"
    }
    back = CatalogState.from_dict(decode(encode(data)))  # through canonical JSON, as stored
    assert back.to_dict() == data
    assert back.owners == state.owners
    assert back.packs == state.packs
    assert (back.dead_writers, back.tombstones, back.reclaimed) == (
        state.dead_writers,
        state.tombstones,
        state.reclaimed,
    )
    for path in (P1, P2, P3, P4):
        assert back.why(path) == state.why(path)
    assert back.collectable([P1, P2, P3, P4]) == state.collectable([P1, P2, P3, P4])


def test_from_dict_of_an_empty_state() -> None:
    empty = CatalogState()
    assert CatalogState.from_dict(empty.to_dict()).to_dict() == empty.to_dict()


# --------------------------------------------------------------------------- the log


@pytest.fixture
def pool(tmp_path: Path) -> Path:
    root = tmp_path / "pool"
    root.mkdir()
    return root


#: Catalogs the test made; each gives its lock file up when the test ends.
_made: list[Catalog] = []


def _tracked(catalog: Catalog) -> Catalog:
    _made.append(catalog)
    return catalog


@pytest.fixture(autouse=True)
def _close_made_catalogs() -> Iterator[None]:
    yield
    while _made:
        _made.pop().close()


def _catalog(root: Path, fault: Callable[[str], None] | None = None) -> Catalog:
    return _tracked(Catalog(FilesystemBackend(root, fault=fault)))


def _append(catalog: Catalog, *events: dict[str, Any]) -> None:
    with catalog.locked() as cat:
        cat.append(list(events))


def _fresh_state(root: Path) -> CatalogState:
    fresh = _catalog(root)
    try:
        with fresh.locked() as cat:
            return cat.state
    finally:
        fresh.close()


def _frames(path: Path) -> list[list[dict[str, Any]]]:
    """Decode the log independently: the events of every complete frame."""
    data = path.read_bytes()
    header = frame.decode_segment_header(data[: frame.SEGMENT_HEADER_BYTES], frame.SEGMENT_MAGIC)
    assert header.tag == catalog_log.TAG
    at, seq, chain, out = frame.SEGMENT_HEADER_BYTES, 1, header.chain_in, []
    while True:
        verdict = frame.classify(data, at, seq, chain)
        if verdict.decision is not frame.Decision.FRAME or verdict.frame is None:
            assert not data[at:].strip(b"\0"), verdict.reason  # the zeros written ahead (J7)
            return out
        out.append(decode(verdict.frame.body)["events"])
        at, seq, chain = verdict.frame.end, seq + 1, verdict.frame.chain


def test_first_lock_creates_the_log_with_its_header_and_zeros_ahead(pool: Path) -> None:
    catalog = _catalog(pool)
    with catalog.locked() as cat:
        assert cat is catalog
        assert cat.state.to_dict() == CatalogState().to_dict()
    log = pool / "catalog" / "log"
    data = log.read_bytes()
    assert len(data) == frame.SEGMENT_HEADER_BYTES + CATALOG_PREALLOC_BYTES
    assert not data[frame.SEGMENT_HEADER_BYTES :].strip(b"\0")  # J7: zeros ahead of the frames
    assert (pool / "catalog" / "LOCK").exists()
    assert catalog.end == frame.SEGMENT_HEADER_BYTES
    assert _frames(log) == []
    catalog.close()


def test_append_outside_locked_is_refused(pool: Path) -> None:
    catalog = _catalog(pool)
    with pytest.raises(RuntimeError, match=r"outside Catalog.locked\(\)"):
        catalog.append([{"op": "release", "owner": "o"}])
    with catalog.locked():
        pass
    with pytest.raises(RuntimeError, match="outside"):
        catalog.append([{"op": "release", "owner": "o"}])
    catalog.close()


def test_empty_append_writes_nothing(pool: Path) -> None:
    catalog = _catalog(pool)
    with catalog.locked() as cat:
        cat.append([])
    assert catalog.end == frame.SEGMENT_HEADER_BYTES
    assert catalog.size() == frame.SEGMENT_HEADER_BYTES + CATALOG_PREALLOC_BYTES
    assert catalog.metrics["appends"] == 0
    catalog.close()


def test_one_frame_per_append_with_its_events_in_order(pool: Path) -> None:
    catalog = _catalog(pool)
    first = [{"op": "retain", "owner": "o", "packs": [P1]}, {"op": "seal", "pack": P1, "extents": None}]
    second = [{"op": "release", "owner": "o"}]
    _append(catalog, *first)
    _append(catalog, *second)
    assert _frames(pool / "catalog" / "log") == [first, second]
    assert catalog.metrics["appends"] == 2
    assert catalog.metrics["syncs"] == 2
    catalog.close()


def test_a_closed_catalog_still_runs_sections_and_keeps_nothing_open_after_them(pool: Path) -> None:
    catalog = _catalog(pool)
    _append(catalog, {"op": "retain", "owner": "before", "packs": [P1]})
    assert descriptors_under(pool / "catalog")  # the lock file stays open between sections
    catalog.close()
    assert not descriptors_under(pool / "catalog")
    _append(catalog, {"op": "retain", "owner": "after", "packs": [P2]})  # (a call through a closed store)
    assert not descriptors_under(pool / "catalog")
    assert sorted(_fresh_state(pool).owners) == ["after", "before"]
    other = _catalog(pool)  # the closed catalog's section released the lock
    _append(other, {"op": "release", "owner": "after"})
    other.close()


def test_two_catalogs_on_one_pool_exclude_each_other_and_see_each_others_events(pool: Path) -> None:
    one, two = _catalog(pool), _catalog(pool)
    _append(one, {"op": "retain", "owner": "from-one", "packs": [P1]})
    with two.locked() as cat:
        assert cat.state.owners == {"from-one": {P1}}
        # While two holds the lock, another descriptor (even in this process) cannot take it.
        probe = os.open(pool / "catalog" / "LOCK", os.O_RDWR)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(probe)
        cat.append([{"op": "add", "owner": "from-two", "packs": [P2]}])
    with one.locked() as cat:
        assert cat.state.owners == {"from-one": {P1}, "from-two": {P2}}
        assert one.metrics["frames_read"] == 1  # only two's frame was new to one
    probe = os.open(pool / "catalog" / "LOCK", os.O_RDWR)
    try:
        fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released after the block
        fcntl.flock(probe, fcntl.LOCK_UN)
    finally:
        os.close(probe)
    one.close()
    two.close()


def test_describe_counts(pool: Path) -> None:
    # (P4 is reclaimed: a tombstone, no longer a known pack)
    assert describe(_rich_state()) == {"owners": 3, "tombstones": 2, "known_packs": 3, "dead_writers": 1}


def _log_with_last_frame(pool: Path) -> tuple[Path, int, int]:
    """A log of three frames; returns (path, start of the last frame, its end)."""
    catalog = _catalog(pool)
    _append(catalog, {"op": "retain", "owner": "early", "packs": [P1]})
    _append(catalog, {"op": "seal", "pack": P1, "extents": {"154": [0]}})
    start = catalog.end
    _append(catalog, {"op": "retain", "owner": "late", "packs": [P2]}, {"op": "release", "owner": "early"})
    end = catalog.end
    catalog.close()
    return pool / "catalog" / "log", start, end


def test_g2_torn_tail_at_every_byte_is_zeroed_and_earlier_events_survive(pool: Path) -> None:
    """A crashed append leaves a prefix of its frame in the zeros written ahead (J7)."""
    log, start, end = _log_with_last_frame(pool)
    full = log.read_bytes()
    assert end - start > frame.FRAME_HEADER_BYTES and not full[end:].strip(b"\0")
    for cut in range(start, end):
        log.write_bytes(full[:cut] + bytes(len(full) - cut))
        catalog = _catalog(pool)
        with catalog.locked() as cat:
            assert cat.state.owners == {"early": {P1}}, cut
            assert cat.state.packs[P1].extents == {154: [0]}
        # The lock holder zeroed the torn frame (the log keeps its size and its zeros).
        assert log.read_bytes() == full[:start] + bytes(len(full) - start), cut
        # The next frame continues the chain where the torn one would have been.
        _append(catalog, {"op": "add", "owner": "after", "packs": [P3]})
        catalog.close()
        assert _fresh_state(pool).owners == {"early": {P1}, "after": {P3}}
        assert len(_frames(log)) == 3


def test_j7_a_log_cut_short_anywhere_fails_closed_and_is_left_alone(pool: Path) -> None:
    """No crash leaves a log without zeros after its frames: a file cut at a frame boundary or
    inside a frame lost frames that were acknowledged (before the fix it was taken for a torn
    write and cut further, or for a clean end)."""
    log, start, end = _log_with_last_frame(pool)
    full = log.read_bytes()
    for cut in [frame.SEGMENT_HEADER_BYTES, start - 1, start, start + 10, end - 1, end, end + 10]:
        log.write_bytes(full[:cut])
        with pytest.raises(CorruptData, match="cut short"):
            _fresh_state(pool)
        assert log.read_bytes() == full[:cut], cut


def test_g2_zero_filled_tail_is_torn(pool: Path) -> None:
    log, start, _ = _log_with_last_frame(pool)
    full = log.read_bytes()
    log.write_bytes(full[:start] + bytes(len(full) - start))
    assert _fresh_state(pool).owners == {"early": {P1}}
    assert log.read_bytes() == full[:start] + bytes(len(full) - start)


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("where", ["header", "body", "last-body-byte"])
def test_g2_bit_flip_in_the_last_frame_is_cut_as_a_torn_write_never_applied(pool: Path, where: str) -> None:
    # Nothing after the last frame proves it was durable, so under A1 its damage is a torn
    # write (DURABILITY.md, durability witness): the lock holder zeroes it, never applies it.
    log, start, end = _log_with_last_frame(pool)
    size = log.stat().st_size
    offset = {"header": start + 9, "body": start + frame.FRAME_HEADER_BYTES + 3, "last-body-byte": end - 1}
    _flip(log, offset[where])
    catalog = _catalog(pool)
    with catalog.locked() as cat:
        assert cat.state.owners == {"early": {P1}}
    catalog.close()
    data = log.read_bytes()
    assert len(data) == size and not data[start:].strip(b"\0")


@pytest.mark.parametrize("where", ["header", "body"])
def test_g2_bit_flip_in_a_frame_a_later_frame_witnesses_is_corrupt_data(pool: Path, where: str) -> None:
    log, start, _ = _log_with_last_frame(pool)
    before = log.read_bytes()
    frames = _frames(log)
    assert len(frames) == 3
    # The second frame (the seal) ends where the last begins; the last frame's lag (1) says
    # the second was durable when it was framed, so damage there is not a torn write.
    second_start = start - len(encode({"events": frames[1]})) - frame.FRAME_HEADER_BYTES
    offset = {"header": second_start + 9, "body": start - 1}
    _flip(log, offset[where])
    damaged = log.read_bytes()
    catalog = _catalog(pool)
    with pytest.raises(CorruptData, match="catalog is damaged"), catalog.locked():
        raise AssertionError("the section must not be entered")
    # Nothing of the damaged frame was applied, and the file was not "repaired" by truncation.
    assert "late" not in catalog.state.owners
    assert log.read_bytes() == damaged and len(damaged) == len(before)
    with pytest.raises(CorruptData, match="durable"):
        _fresh_state(pool)
    catalog.close()


def test_g2_damage_in_an_earlier_frame_fails_closed(pool: Path) -> None:
    log, _, _ = _log_with_last_frame(pool)
    _flip(log, frame.SEGMENT_HEADER_BYTES + frame.FRAME_HEADER_BYTES + 2)
    with pytest.raises(CorruptData, match="catalog"):
        _fresh_state(pool)


def test_truncated_header_is_corrupt_and_a_foreign_log_is_refused(pool: Path) -> None:
    log, _, _ = _log_with_last_frame(pool)
    full = log.read_bytes()
    log.write_bytes(full[:10])
    with pytest.raises(CorruptData, match="header truncated"):
        _fresh_state(pool)
    other = frame.identity_tag("straw-pool", "journal")
    log.write_bytes(frame.encode_segment_header(frame.SEGMENT_MAGIC, 1, frame.genesis_chain(other), other))
    with pytest.raises(UnsafeRecovery, match="is not this pool's catalog"):
        _fresh_state(pool)


class _Fault:
    """Raise once at one named phase, once armed."""

    def __init__(self, phase: str) -> None:
        self.phase = phase
        self.armed = False
        self.seen: list[str] = []

    def __call__(self, phase: str) -> None:
        if phase in PEER_PHASES:
            return  # the peer's names for these points (test_backend.py checks them)
        self.seen.append(phase)
        if self.armed and phase == self.phase:
            self.armed = False
            raise OSError(5, f"injected at {phase}")


@pytest.mark.parametrize("phase", CATALOG_PHASES)
def test_g3_fault_at_each_catalog_phase_leaves_the_frame_whole_or_absent(pool: Path, phase: str) -> None:
    fault = _Fault(phase)
    catalog = _catalog(pool, fault)
    _append(catalog, {"op": "retain", "owner": "before", "packs": [P1]})  # the fault is not at append 1
    fault.armed = True
    fault.seen.clear()
    # A catalog I/O error reaches the caller as StorageUnavailable (an OSError's text kept).
    with pytest.raises(StorageUnavailable, match=f"injected at {phase}"), catalog.locked() as cat:
        cat.append(
            [{"op": "retain", "owner": "x", "packs": [P2]}, {"op": "retain", "owner": "y", "packs": [P3]}]
        )
    assert fault.seen[-1] == phase
    fresh = _fresh_state(pool)
    present = {"x", "y"} & set(fresh.owners)
    assert present in (set(), {"x", "y"})  # never half a frame
    # G3: whatever failed, the appender zeroed its frame (and synced that) before giving up the
    # lock, so no later frame chains onto it.
    assert present == set()
    assert fresh.owners["before"] == {P1}
    # The failed catalog forgot its view; its next section reloads and agrees with a fresh reader.
    with catalog.locked() as cat:
        assert cat.state.to_dict() == fresh.to_dict()
        cat.append([{"op": "release", "owner": "before"}])
    catalog.close()
    again = _fresh_state(pool)
    assert set(again.owners) == present
    assert [e["op"] for f in _frames(pool / "catalog" / "log") for e in f][-1] == "release"


def test_g3_state_applies_only_after_the_frame_is_written(pool: Path) -> None:
    seen: list[tuple[str, bool]] = []
    catalog: Catalog

    def hook(phase: str) -> None:
        if phase not in PEER_PHASES:
            seen.append((phase, "z" in catalog.state.owners))

    catalog = _catalog(pool, hook)
    _append(catalog, {"op": "retain", "owner": "z", "packs": [P1]})
    assert seen == [(p, False) for p in CATALOG_PHASES]
    assert catalog.state.owners == {"z": {P1}}
    catalog.close()


def test_catch_up_after_a_rewrite_to_a_shorter_log_reloads(pool: Path) -> None:
    catalog = _catalog(pool)
    _append(catalog, {"op": "retain", "owner": "o", "packs": [P1]})
    _append(catalog, {"op": "retain", "owner": "p", "packs": [P2]})
    log = pool / "catalog" / "log"
    other = _catalog(pool)
    with other.locked():
        pass
    # Replace the log with a shorter one holding a single different frame (as a rewrite would).
    log.unlink()
    _append(_catalog(pool), {"op": "retain", "owner": "only", "packs": [P3]})
    with other.locked() as cat:
        assert cat.state.owners == {"only": {P3}}
    other.close()
    catalog.close()


def test_a_large_frame_round_trips(pool: Path) -> None:
    catalog = _catalog(pool)
    _append(catalog, *[{"op": "add", "owner": f"o{i}", "packs": [P1]} for i in range(200)])
    assert len(_fresh_state(pool).owners) == 200
    catalog.close()


# --------------------------------------------------------------------------- compaction (G7)


def _retain_events(catalog: Catalog, count: int, start: int = 0) -> None:
    for i in range(start, start + count):
        with catalog.locked() as cat:
            cat.append([{"op": "retain", "owner": f"o{i}", "packs": [f"raw/{'a' * 32}/{i:032x}.pack"]}])
            if i % 2:
                cat.append([{"op": "release", "owner": f"o{i - 1}"}])


def test_g7_compaction_keeps_every_client_view_equal(pool: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(catalog_log, "CATALOG_COMPACT_BYTES_MIN", 1500)
    backend = FilesystemBackend(pool)
    first, second = _tracked(Catalog(backend)), _tracked(Catalog(backend))
    for round_ in range(4):
        _retain_events(first, 40, start=round_ * 80)
        _retain_events(second, 40, start=round_ * 80 + 40)
    assert first.metrics["compactions"] + second.metrics["compactions"] >= 3
    views = []
    for catalog in (first, second, _tracked(Catalog(backend))):
        with catalog.locked() as cat:
            views.append(cat.state.to_dict())
    assert views[0] == views[1] == views[2]
    assert sorted(views[0]["owners"]) == sorted(f"o{i}" for i in range(320) if i % 2)
    # The log restarts after every snapshot: it stays small however many events were written.
    assert os.path.getsize(pool / "catalog" / "log") < 4000 + CATALOG_PREALLOC_BYTES


def test_g7_crash_between_snapshot_and_new_log_skips_the_old_frames(pool: Path) -> None:
    backend = FilesystemBackend(pool)
    catalog = _tracked(Catalog(backend))
    _retain_events(catalog, 10)
    with catalog.locked() as cat:
        want = cat.state.to_dict()
        seq, chain = cat._seq, cat._chain
        body = encode(cat.state.to_dict())
        header = frame.encode_segment_header(frame.SNAPSHOT_MAGIC, seq, chain, catalog_log.TAG)
        frame_header, _ = frame.encode_frame(seq, chain, body)
        # The first of G7's two replacements only: the old log still holds every frame.
        (pool / "catalog" / "snapshot").write_bytes(header + frame_header + body)
    fresh = _tracked(Catalog(backend))
    with fresh.locked() as cat:
        assert cat.state.to_dict() == want
        cat.append([{"op": "release", "owner": "o9"}])
    with catalog.locked() as cat:  # the older view follows the new frame, not a replay
        assert "o9" not in cat.state.owners


def test_g7_damaged_snapshot_fails_closed(pool: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(catalog_log, "CATALOG_COMPACT_BYTES_MIN", 500)
    backend = FilesystemBackend(pool)
    _retain_events(_tracked(Catalog(backend)), 30)
    snapshot = pool / "catalog" / "snapshot"
    data = bytearray(snapshot.read_bytes())
    data[-5] ^= 0x01
    snapshot.write_bytes(bytes(data))
    with pytest.raises(CorruptData, match="snapshot"), _tracked(Catalog(backend)).locked():
        pass


def test_a_version_1_snapshot_body_still_loads_to_the_same_state() -> None:
    """Catalog snapshots written before version 2 listed each released publication as
    [offset, ordinal]: they load to the same state, and compact to version 2."""
    state = _rich_state()
    old = state.to_dict()
    old["v"] = 1
    for info in old["packs"].values():
        info[3] = [
            [offset, ordinal]
            for offset, mask in info[3]
            for ordinal in range(-1, mask.bit_length() - 1)
            if mask >> (ordinal + 1) & 1
        ]
    assert old["packs"][P1][3] == [[154, 1]] and old["packs"][P2][3] == [[10, -1]]
    back = CatalogState.from_dict(decode(encode(old)))
    assert back.packs == state.packs and back.to_dict() == state.to_dict()
    with pytest.raises(UnsupportedSchema):
        CatalogState.from_dict({**old, "v": 3})


def test_compaction_costs_one_entry_per_extent_not_per_publication() -> None:
    """Count entries, not time: a pack with 64 publications released in each of 500 extents
    snapshots 500 released entries (version 1 wrote 32000), and they load back exactly."""
    state = CatalogState()
    info = state.packs[P1] = PackInfo(W1)
    for extent in range(500):
        for ordinal in range(64):
            info.release(1000 * extent, ordinal)
    data = state.to_dict()
    assert len(data["packs"][P1][3]) == 500
    back = CatalogState.from_dict(decode(encode(data)))
    assert back.packs[P1].released == info.released
    assert len(back.packs[P1].released_pairs()) == 500 * 64
