"""Store lifetime calls and pool-wide collection (API.md sections 5 and 8, docs/GC.md, G4-G5, I13-I15).

* Return shapes of ``retain``, ``release``, ``release_publications``, ``pin``, ``seal`` and
  ``collect_garbage``; ``explain`` answers owners, seal, writer, staging, tombstone, existence.
* Exactly what is sealed, unowned and released is reclaimed (files and bytes counted exactly);
  everything else reads back byte-exact from a fresh store afterwards (I13).
* Owners reach packs transitively: dependencies in other packs and other writers' packs,
  records of a ``record_set`` written elsewhere, ``RecordRef`` roots.
* A live writer's open pack is never reclaimed; ``online_gc=False`` packs are reclaimed only
  once the writer closed (its ``LIVE`` lock is free), ``online_gc=True`` packs once sealed and
  released while the writer lives.
* Bad input: unknown owner, reserved owner names, tombstoned and foreign references.
* Faults: a corrupt catalog frame fails the collection with ``CorruptData`` before anything is
  deleted; a fault at ``before_tombstone``/``after_tombstone``/``before_unlink`` deletes nothing
  reachable and the next collection finishes (I14), ENOENT after a tombstone counts as done.
* Readers: a session that already has a pack open keeps reading it after collection; a new
  reader gets ``StorageUnavailable`` naming the file.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import straw._pack.writer as writer_module
from queue_helpers import descriptors_under
from straw._catalog.log import Catalog
from straw._fs import lock
from straw.backend import FilesystemBackend
from straw.errors import CorruptData, InvalidReference, StorageUnavailable
from straw.protocol import Publication, Record, RecordRef, RecordSetRef
from straw.store import SharedFilesystemStore

RUN = "run-gc"
RESULT_KEYS = {
    "reclaimed_files",
    "reclaimed_bytes",
    "retained_packs",
    "open_packs",
    "owners",
    "tombstones",
    "dead_writers_found",
    "catalog",
}
GC_PHASES = ("before_tombstone", "after_tombstone", "before_unlink")


# --------------------------------------------------------------------------- helpers


def app_owners(answer: dict[str, Any]) -> list[str]:
    """The application owners in an explain() answer (a live writer's staging owners left out)."""
    return [o for o in answer["owners"] if not o.startswith("staging:")]


def _no_sleep(_: float) -> None:
    return None


def open_store(
    root: Path,
    *,
    run_id: str = RUN,
    online_gc: bool = False,
    fault: Callable[[str], None] | None = None,
    segment_target_bytes: int = 1 << 30,
) -> SharedFilesystemStore:
    backend = FilesystemBackend(root, fault=fault, sleep=_no_sleep, visibility_delays=(0.0,))
    store = SharedFilesystemStore(
        root, run_id, backend=backend, online_gc=online_gc, segment_target_bytes=segment_target_bytes
    )
    _opened.append(store)
    return store


#: Stores the test opened; each is closed (again) when it ends, the readers made inline too.
_opened: list[SharedFilesystemStore] = []


@pytest.fixture(autouse=True)
def _close_opened_stores() -> Iterator[None]:
    yield
    while _opened:
        with contextlib.suppress(Exception):  # a store a fault left unusable has nothing more to give up
            _opened.pop().close()


def payload(name: str, size: int = 300) -> bytes:
    return random.Random(name).randbytes(size)


def pub(store: SharedFilesystemStore, name: str, *, deps: tuple[RecordSetRef, ...] = ()) -> RecordSetRef:
    records = [Record(f"{name}-0", payload(f"{name}-0")), Record(f"{name}-1", payload(f"{name}-1", 77))]
    return store.publish(records, submission_id=f"sub-{name}", dependencies=deps)


def want(name: str) -> list[tuple[str, bytes]]:
    return [(f"{name}-0", payload(f"{name}-0")), (f"{name}-1", payload(f"{name}-1", 77))]


def got(store: SharedFilesystemStore, ref: RecordSetRef) -> list[tuple[str, bytes]]:
    return [(r.record_id, bytes(r.payload)) for r in store.read(ref)]


def pack(ref: RecordSetRef | RecordRef) -> str:
    segment = ref.manifest.segment if isinstance(ref, RecordSetRef) else ref.segment
    return segment.path


def on_disk(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.glob("raw/*/*") if p.suffix in (".pack", ".seg"))


def sizes(root: Path, paths: list[str]) -> int:
    return sum((root / p).stat().st_size for p in paths)


def catalog_state(root: Path) -> Any:
    catalog = Catalog(FilesystemBackend(root))
    try:
        with catalog.locked() as cat:
            return cat.state
    finally:
        catalog.close()


class Fault:
    """Raise ``OSError(EIO)`` at the ``nth`` call of one phase (once)."""

    def __init__(self) -> None:
        self.phase = ""
        self.nth = 1
        self.calls = 0

    def arm(self, phase: str, nth: int = 1) -> None:
        self.phase, self.nth, self.calls = phase, nth, 0

    def __call__(self, phase: str) -> None:
        if phase == self.phase:
            self.calls += 1
            if self.calls == self.nth:
                self.phase = ""
                raise OSError(5, f"injected at {phase}")


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "pool"


def _sealed_packs(store: SharedFilesystemStore, names: list[str]) -> list[RecordSetRef]:
    """One publication per pack: publish, then seal."""
    refs = []
    for name in names:
        refs.append(pub(store, name))
        store.seal()
    return refs


# --------------------------------------------------------------------------- shapes


def test_lifetime_calls_return_shapes(root: Path) -> None:
    store = open_store(root, online_gc=True)
    ref = pub(store, "a")
    assert store.retain("app-owner", [ref]) is None
    assert store.release("app-owner") is None
    assert store.seal() is None
    assert store.release_publications([ref]) is None
    with store.pin([ref]) as owner:
        assert re.fullmatch(r"pin:[0-9a-f]{32}", owner)
        assert store.explain(pack(ref))["owners"] == [owner]
    with store.pin([ref], owner="named") as owner:
        assert owner == "named"
    result = store.collect_garbage()
    assert set(result) == RESULT_KEYS
    assert all(isinstance(result[k], int) for k in RESULT_KEYS - {"catalog"})
    # (the reclaimed pack is a tombstone only, no longer a known pack)
    assert result["catalog"] == {"owners": 0, "tombstones": 1, "known_packs": 0, "dead_writers": 0}
    assert (result["reclaimed_files"], result["owners"], result["tombstones"]) == (1, 0, 1)
    store.close()


def test_explain_answers_owners_seal_writer_staging_and_tombstone(root: Path) -> None:
    store = open_store(root, online_gc=True)
    a = pub(store, "a")
    path = pack(a)
    assert store.explain(path) == {
        "pack": path,
        "owners": [],
        "sealed": False,
        "writer": store.writer_id,
        "writer_dead": False,
        "staging_over": False,
        "tombstoned": False,
        "exists": True,
    }
    store.retain("o2", [a])
    store.retain("o1", [a])
    store.seal()
    answer = store.explain(path)
    assert (answer["owners"], answer["sealed"], answer["staging_over"]) == (["o1", "o2"], True, False)
    store.release_publications([a])
    assert store.explain(path)["staging_over"] is True
    store.release("o1")
    store.release("o2")
    assert store.collect_garbage()["reclaimed_files"] == 1
    answer = store.explain(path)
    assert (answer["owners"], answer["tombstoned"], answer["exists"]) == ([], True, False)
    assert (answer["sealed"], answer["staging_over"]) == (True, True)  # kept as a name only
    fresh = Catalog(store.backend)  # another view, reading the log from disk
    with fresh.locked() as catalog:
        assert path in catalog.state.reclaimed and path not in catalog.state.packs
    fresh.close()
    with pytest.raises(InvalidReference):
        store.explain("../outside.pack")
    store.close()


# --------------------------------------------------------------------------- what is reclaimed


def test_i13_exactly_the_sealed_unowned_released_packs_are_reclaimed(root: Path) -> None:
    store = open_store(root, online_gc=True)
    owned, released1, released2, staged = _sealed_packs(store, ["owned", "rel1", "rel2", "staged"])
    open_ref = pub(store, "open")  # stays in the open pack
    store.retain("keeper", [owned])
    store.release_publications([owned, released1, released2, open_ref])
    victims = sorted([pack(released1), pack(released2)])
    victim_bytes = sizes(root, victims)
    before = on_disk(root)
    assert len(before) == 5

    result = store.collect_garbage()
    assert result["reclaimed_files"] == 2
    assert result["reclaimed_bytes"] == victim_bytes
    assert result["retained_packs"] == 2  # owned + staged
    assert result["open_packs"] == 1
    assert result["owners"] == 1
    assert result["tombstones"] == 2
    assert result["dead_writers_found"] == 0
    assert on_disk(root) == sorted(set(before) - set(victims))

    fresh = open_store(root)  # no cached descriptors: reads the files as they are now
    for ref, name in ((owned, "owned"), (staged, "staged"), (open_ref, "open")):
        assert got(fresh, ref) == want(name)
    with pytest.raises(StorageUnavailable, match=re.escape(pack(released1))):
        list(fresh.read(released1))

    # Collection is idempotent, then releasing the owner frees its pack.
    again = store.collect_garbage()
    assert (again["reclaimed_files"], again["reclaimed_bytes"], again["tombstones"]) == (0, 0, 2)
    store.release("keeper")
    last = store.collect_garbage()
    assert last["reclaimed_files"] == 1 and last["reclaimed_bytes"] > 0
    assert on_disk(root) == sorted([pack(staged), pack(open_ref)])
    fresh.close()
    store.close()


def test_i13_owned_data_is_byte_exact_after_its_writer_is_collected(root: Path) -> None:
    writer = open_store(root, segment_target_bytes=0)  # one standalone .seg file per publication
    refs = [pub(writer, f"p{i}") for i in range(6)]
    writer.close()
    collector = open_store(root)
    collector.retain("keep", refs[::2])
    result = collector.collect_garbage()
    assert (result["reclaimed_files"], result["retained_packs"], result["dead_writers_found"]) == (3, 3, 1)
    assert on_disk(root) == sorted(pack(r) for r in refs[::2])
    reader = open_store(root)
    for i in range(0, 6, 2):
        assert got(reader, refs[i]) == want(f"p{i}")
    collector.close()
    reader.close()


def test_owner_reaches_a_dependency_in_another_pack_transitively(root: Path) -> None:
    first = open_store(root)
    base = pub(first, "base")
    first.seal()
    mid = pub(first, "mid", deps=(base,))
    first.close()
    second = open_store(root)
    top = pub(second, "top", deps=(mid,))  # a dependency in another writer's pack
    second.close()
    assert len({pack(base), pack(mid), pack(top)}) == 3
    collector = open_store(root)
    collector.retain("model", [top])
    for ref in (base, mid, top):
        assert app_owners(collector.explain(pack(ref))) == ["model"]
    result = collector.collect_garbage()
    assert (result["reclaimed_files"], result["retained_packs"], result["dead_writers_found"]) == (0, 3, 2)
    reader = open_store(root)
    assert [got(reader, r) for r in (base, mid, top)] == [want("base"), want("mid"), want("top")]
    # Retaining only the middle one keeps it and its dependency, not the top.
    collector.retain("model", [mid])
    result = collector.collect_garbage()
    assert result["reclaimed_files"] == 1
    assert on_disk(root) == sorted([pack(base), pack(mid)])
    collector.close()
    reader.close()


def test_owner_reaches_record_set_records_and_record_refs(root: Path) -> None:
    writer = open_store(root)
    records = writer.write_records(
        [Record("r0", payload("r0")), Record("r1", payload("r1"))], submission_id="records"
    )
    writer.seal()
    loose = writer.write_records([Record("loose", payload("loose"))], submission_id="loose")
    writer.seal()
    manifest = writer.record_set(records, submission_id="set")
    writer.close()
    collector = open_store(root)
    collector.retain("set-owner", [manifest])
    collector.retain("record-owner", [loose[0]])
    assert app_owners(collector.explain(pack(records[0]))) == ["set-owner"]
    assert app_owners(collector.explain(pack(loose[0]))) == ["record-owner"]
    assert collector.collect_garbage()["reclaimed_files"] == 0
    collector.release("record-owner")
    assert collector.collect_garbage()["reclaimed_files"] == 1
    reader = open_store(root)
    assert [(r.record_id, bytes(r.payload)) for r in reader.read(manifest)] == [
        ("r0", payload("r0")),
        ("r1", payload("r1")),
    ]
    with pytest.raises(StorageUnavailable):
        reader.read_record(loose[0])
    collector.close()
    reader.close()


def test_retain_replaces_the_owners_roots(root: Path) -> None:
    writer = open_store(root, segment_target_bytes=0)
    a, b = pub(writer, "a"), pub(writer, "b")
    writer.close()
    store = open_store(root)
    store.retain("o", [a])
    store.retain("o", [b])
    assert store.explain(pack(a))["owners"] == []
    assert store.explain(pack(b))["owners"] == ["o"]
    assert store.collect_garbage()["reclaimed_files"] == 1
    assert on_disk(root) == [pack(b)]
    store.close()


def test_owners_lists_the_catalogs_owners_by_prefix(root: Path) -> None:
    writer = open_store(root, segment_target_bytes=0)
    a, b = pub(writer, "a"), pub(writer, "b")
    store = open_store(root)
    store.retain("checkpoint:/save/rollout/queue_state_2.json:x", [a])
    store.retain("checkpoint:/save/rollout/queue_state_10.json:y", [b])
    store.retain("archive:/dbg/rollout_1.straw.json:z", [a])
    assert store.owners("checkpoint:/save/rollout/") == [
        "checkpoint:/save/rollout/queue_state_10.json:y",
        "checkpoint:/save/rollout/queue_state_2.json:x",
    ]
    everything = store.owners()
    assert "archive:/dbg/rollout_1.straw.json:z" in everything and everything == sorted(everything)
    # Another store of the pool sees the same catalog; a release is visible at once.
    writer.release("archive:/dbg/rollout_1.straw.json:z")
    assert store.owners("archive:") == []
    assert store.owners("no-such-prefix") == []
    with pytest.raises(TypeError, match="text prefix"):
        store.owners(None)  # type: ignore[arg-type]
    writer.close()
    store.close()


def test_pin_keeps_data_alive_for_the_block_and_releases_on_error(root: Path) -> None:
    writer = open_store(root, segment_target_bytes=0)
    a = pub(writer, "a")
    writer.close()
    store = open_store(root)
    with pytest.raises(KeyboardInterrupt), store.pin([a]) as owner:
        assert store.collect_garbage()["reclaimed_files"] == 0
        assert got(open_store(root), a) == want("a")
        raise KeyboardInterrupt
    assert store.explain(pack(a))["owners"] == []
    assert owner not in catalog_state(root).owners  # the pin's owner is gone
    assert store.collect_garbage()["reclaimed_files"] == 1
    store.close()


# --------------------------------------------------------------------------- writers


def test_a_live_writers_open_pack_is_never_reclaimed(root: Path) -> None:
    for online_gc in (False, True):
        pool = root / f"gc-{online_gc}"
        writer = open_store(pool, online_gc=online_gc)
        ref = pub(writer, "open")
        writer.release_publications([ref])
        for collector in (writer, open_store(pool)):
            result = collector.collect_garbage()
            assert (result["reclaimed_files"], result["open_packs"], result["dead_writers_found"]) == (
                0,
                1,
                0,
            )
        assert collector.explain(pack(ref))["writer_dead"] is False
        assert got(open_store(pool), ref) == want("open")
        more = pub(writer, "more")  # the writer keeps appending to the same pack
        assert pack(more) == pack(ref)
        assert got(open_store(pool), more) == want("more")
        writer.close()
        collector.close()


def test_offline_writer_packs_are_reclaimed_only_after_it_closes(root: Path) -> None:
    writer = open_store(root, online_gc=False)
    refs = _sealed_packs(writer, ["a", "b"])
    writer.release_publications(refs)  # recorded, but the seals are not (online_gc=False)
    collector = open_store(root)
    result = collector.collect_garbage()
    assert (result["reclaimed_files"], result["retained_packs"], result["open_packs"]) == (0, 0, 2)
    assert collector.explain(pack(refs[0]))["sealed"] is False
    writer.close()
    result = collector.collect_garbage()
    assert (result["reclaimed_files"], result["dead_writers_found"]) == (2, 1)
    assert result["catalog"]["dead_writers"] == 1
    assert on_disk(root) == []
    answer = collector.explain(pack(refs[1]))
    assert (answer["sealed"], answer["writer_dead"], answer["staging_over"], answer["tombstoned"]) == (
        True,
        True,
        True,
        True,
    )
    # The dead writer is recorded once: later collections do not find it again.
    assert collector.collect_garbage()["dead_writers_found"] == 0
    collector.close()


def test_offline_writer_unreleased_data_is_collectable_after_death(root: Path) -> None:
    writer = open_store(root, online_gc=False)
    refs = _sealed_packs(writer, ["a", "b"])
    open_ref = pub(writer, "open")
    writer.close()
    collector = open_store(root)
    collector.retain("keep", [refs[0]])
    result = collector.collect_garbage()
    assert (result["reclaimed_files"], result["retained_packs"], result["open_packs"]) == (2, 1, 0)
    assert on_disk(root) == [pack(refs[0])]
    assert got(open_store(root), refs[0]) == want("a")
    assert not (root / pack(open_ref)).exists()
    collector.close()


def test_online_writer_packs_are_reclaimed_while_it_lives(root: Path) -> None:
    writer = open_store(root, online_gc=True)
    a = pub(writer, "a")
    b = pub(writer, "b")
    writer.release_publications([a])
    assert writer.collect_garbage()["reclaimed_files"] == 0  # not sealed yet
    writer.seal()
    assert writer.collect_garbage()["reclaimed_files"] == 0  # b is still staged in the same pack
    writer.release_publications([b])
    collector = open_store(root)  # any client may collect it
    result = collector.collect_garbage()
    assert (result["reclaimed_files"], result["dead_writers_found"]) == (1, 0)
    assert on_disk(root) == []
    c = pub(writer, "c")  # the writer is still alive and writes a new pack
    assert pack(c) != pack(a)
    assert got(open_store(root), c) == want("c")
    writer.close()
    collector.close()


def test_g6_2_deferred_release_rides_the_writers_next_catalog_frame(root: Path) -> None:
    writer = open_store(root, online_gc=True)
    base = pub(writer, "base")
    a = pub(writer, "a", deps=(base,))  # staged with an owner of its own (it reaches base)
    writer.seal()
    writer.release_publications([base])
    frames = writer._catalog.metrics["appends"]
    writer.release_publications([a], defer=True)
    assert writer._catalog.metrics["appends"] == frames  # nothing written yet
    state = catalog_state(root)  # another client still sees a staged
    assert (pack(a), a.manifest.segment.offset, a.manifest.ordinal) not in {
        (path, *item) for path, info in state.packs.items() for item in info.released_pairs()
    }
    assert open_store(root).collect_garbage()["reclaimed_files"] == 0  # retained, never lost
    b = pub(writer, "b", deps=(base,))  # its staging frame carries the deferred end as well
    assert writer._catalog.metrics["appends"] == frames + 1
    writer.release_publications([b], defer=True)
    assert writer.explain(pack(a))["staging_over"] is True  # this store's own view flushes first
    assert writer._catalog.metrics["appends"] == frames + 2
    collector = open_store(root)
    assert collector.collect_garbage()["reclaimed_files"] == 1  # base's and a's pack
    with pytest.raises(InvalidReference):
        writer.release_publications([RecordSetRef(a.manifest, "0" * 32, 2, 1, 0)], defer=True)
    c = pub(writer, "c")
    writer.release_publications([c], defer=True)
    writer.close()  # close writes what is still deferred (and the seal)
    assert collector.collect_garbage()["reclaimed_files"] == 1
    assert on_disk(root) == []
    collector.close()


def test_online_writer_rotation_records_each_seal(root: Path) -> None:
    writer = open_store(root, online_gc=True, segment_target_bytes=1500)
    refs = [pub(writer, f"r{i}") for i in range(5)]  # each ~1 KiB: one publication per pack
    paths = sorted({pack(r) for r in refs})
    assert len(paths) == 5
    state = catalog_state(root)
    sealed = sorted(p for p, info in state.packs.items() if info.sealed)
    assert sealed == sorted(pack(r) for r in refs[:4])  # rotation sealed all but the open one
    writer.release_publications(refs)
    result = writer.collect_garbage()
    assert (result["reclaimed_files"], result["open_packs"]) == (4, 1)
    writer.close()  # close seals the last pack in the catalog
    assert writer.collect_garbage()["reclaimed_files"] == 1
    assert on_disk(root) == []


def test_two_writers_one_closed_its_unowned_data_is_collectable(root: Path) -> None:
    alive = open_store(root)
    gone = open_store(root)
    alive_refs = _sealed_packs(alive, ["alive-0", "alive-1"])
    gone_refs = _sealed_packs(gone, ["gone-0", "gone-1", "gone-2"])
    gone.retain("keep", [gone_refs[1]])
    gone.close()
    result = alive.collect_garbage()
    assert (result["reclaimed_files"], result["dead_writers_found"]) == (2, 1)
    assert on_disk(root) == sorted([pack(alive_refs[0]), pack(alive_refs[1]), pack(gone_refs[1])])
    # The same collection run by a third store (not the live writer itself) spares the live one too.
    third = open_store(root)
    result = third.collect_garbage()
    assert (result["reclaimed_files"], result["dead_writers_found"], result["open_packs"]) == (0, 0, 2)
    reader = open_store(root)
    assert [got(reader, r) for r in alive_refs] == [want("alive-0"), want("alive-1")]
    assert got(reader, gone_refs[1]) == want("gone-1")
    alive.close()
    third.close()


def test_g5_dead_writer_temporary_files_are_deleted_live_ones_kept(root: Path) -> None:
    alive = open_store(root)
    dead = open_store(root)
    pub(alive, "a")
    pub(dead, "d")
    alive_tmp = root / "raw" / alive.writer_id / f".{'e' * 32}.pack.tmp"
    dead_tmp = root / "raw" / dead.writer_id / f".{'f' * 32}.pack.tmp"
    alive_tmp.write_bytes(b"partial")
    dead_tmp.write_bytes(b"partial")
    dead.close()
    assert open_store(root).collect_garbage()["dead_writers_found"] == 1
    assert alive_tmp.exists()
    assert not dead_tmp.exists()
    alive.close()


def test_foreign_names_under_raw_are_ignored(root: Path) -> None:
    store = open_store(root, segment_target_bytes=0)
    pub(store, "x")
    store.close()
    stray = root / "raw" / "not-a-writer"
    stray.mkdir()
    (stray / f"{'1' * 32}.pack").write_bytes(b"x")
    (root / "raw" / store.writer_id / "notes.txt").write_bytes(b"x")
    result = open_store(root).collect_garbage()
    assert result["reclaimed_files"] == 1
    assert (stray / f"{'1' * 32}.pack").exists()
    assert (root / "raw" / store.writer_id / "notes.txt").exists()


def test_g5_a_writer_between_creating_and_locking_live_is_not_declared_dead(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    collector = open_store(root)
    collector.collect_garbage()  # creates the catalog
    real = lock.try_lock_exclusive
    armed = [True]

    def interleaved(path: str) -> int | None:
        if armed[0] and path.endswith("/LIVE"):
            armed[0] = False
            os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o644))  # the writer's open() ...
            collector.collect_garbage()  # ... a collector runs here ...
        return real(path)  # ... then the writer's flock()

    monkeypatch.setattr(writer_module.lock, "try_lock_exclusive", interleaved)
    writer = open_store(root)
    ref = pub(writer, "live")  # must not fail, and the writer must stay alive for collectors
    monkeypatch.setattr(writer_module.lock, "try_lock_exclusive", real)
    result = collector.collect_garbage()
    assert (result["reclaimed_files"], result["open_packs"]) == (0, 1)
    assert got(open_store(root), ref) == want("live")
    writer.close()


# --------------------------------------------------------------------------- staging reaches its data


def test_i13_releasing_one_record_set_keeps_the_records_of_another_staged_set(root: Path) -> None:
    store = open_store(root, online_gc=True)
    records = store.write_records([Record("r", payload("r"))], submission_id="records")
    store.seal()
    first = store.record_set(records, submission_id="first")
    second = store.record_set(records, submission_id="second")
    store.seal()
    store.release_publications([first])
    store.collect_garbage()
    assert got(open_store(root), second) == [("r", payload("r"))]
    store.close()


def test_i13_a_staged_publication_keeps_its_dependency(root: Path) -> None:
    store = open_store(root, online_gc=True)
    base = pub(store, "base")
    store.seal()
    top = pub(store, "top", deps=(base,))
    store.seal()
    store.release_publications([base])
    store.collect_garbage()
    other = open_store(root)
    other.retain("late-owner", [top])  # top was never released: it must still be retainable
    assert got(other, base) == want("base")
    store.close()


# --------------------------------------------------------------------------- bad input


def test_releasing_an_unknown_owner_is_a_key_error(root: Path) -> None:
    store = open_store(root)
    with pytest.raises(KeyError, match="unknown owner 'nobody'"):
        store.release("nobody")
    ref = pub(store, "a")
    store.retain("once", [ref])
    store.release("once")
    with pytest.raises(KeyError, match="already released"):
        store.release("once")
    store.close()


@pytest.mark.parametrize("owner", ["queue:x", "staging:x", "pin:x"])
def test_reserved_owner_names_are_refused(root: Path, owner: str) -> None:
    store = open_store(root)
    ref = pub(store, "a")
    with pytest.raises(ValueError, match="straw's own"):
        store.retain(owner, [ref])
    with pytest.raises(ValueError, match="straw's own"):
        store.release(owner)
    with pytest.raises(ValueError, match="straw's own"), store.pin([ref], owner=owner):
        raise AssertionError("not entered")
    assert catalog_state(root).owners == {}
    store.close()


def test_wrong_types_are_refused_before_the_catalog(root: Path) -> None:
    store = open_store(root)
    ref = pub(store, "a")
    with pytest.raises(TypeError, match="RecordSetRef"):
        store.release_publications([ref.manifest])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="RecordSetRef or RecordRef"):
        store.retain("o", ["not a ref"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="owner"):
        store.retain("", [ref])
    assert catalog_state(root).owners == {}
    store.close()


def test_i15_retaining_a_tombstoned_reference_the_store_still_caches(root: Path) -> None:
    store = open_store(root, online_gc=True)
    ref = pub(store, "a")
    store.seal()
    store.release_publications([ref])
    assert store.collect_garbage()["reclaimed_files"] == 1
    with pytest.raises(InvalidReference, match=r"garbage-collected \(reclaimed\); republish"):
        store.retain("late", [ref])
    with pytest.raises(InvalidReference, match="garbage-collected"), store.pin([ref]):
        raise AssertionError("not entered")
    assert catalog_state(root).owners == {}
    store.close()


def test_i15_retaining_a_tombstoned_reference_from_a_fresh_store(root: Path) -> None:
    store = open_store(root, online_gc=True)
    ref = pub(store, "a")
    store.seal()
    store.release_publications([ref])
    assert store.collect_garbage()["reclaimed_files"] == 1
    fresh = open_store(root)
    with pytest.raises(InvalidReference, match="garbage-collected"):
        fresh.retain("late", [ref])
    store.close()


def test_i15_a_tombstone_is_refused_even_while_its_file_remains(root: Path) -> None:
    fault = Fault()
    store = open_store(root, online_gc=True, fault=fault)
    ref = pub(store, "a")
    store.seal()
    store.release_publications([ref])
    fault.arm("after_tombstone")
    with pytest.raises(StorageUnavailable, match="injected at after_tombstone"):
        store.collect_garbage()
    assert (root / pack(ref)).exists()
    fresh = open_store(root)
    with pytest.raises(InvalidReference, match=r"garbage-collected \(reclaimed\); republish"):
        fresh.retain("late", [ref])
    store.close()


def test_retaining_a_reference_of_another_run_is_invalid(root: Path) -> None:
    other = open_store(root, run_id="other-run")
    ref = pub(other, "a")
    other.close()
    store = open_store(root)
    with pytest.raises(InvalidReference, match="belongs to run 'other-run'"):
        store.retain("o", [ref])
    with pytest.raises(InvalidReference, match="belongs to run"):
        store.release_publications([ref])
    assert catalog_state(root).owners == {}
    store.close()


def test_retaining_a_damaged_reference_is_invalid(root: Path) -> None:
    store = open_store(root)
    ref = pub(store, "a")
    segment = ref.manifest.segment
    bad_path = RecordSetRef(
        RecordRef(type(segment)(**{**segment.__dict__, "path": "../x.pack"}), ref.manifest.ordinal),
        ref.digest,
        ref.records,
        ref.payload_bytes,
        ref.tokens,
    )
    with pytest.raises(InvalidReference):
        store.retain("o", [bad_path])
    assert catalog_state(root).owners == {}
    store.close()


# --------------------------------------------------------------------------- faults


def _collectable_pool(
    root: Path, fault: Fault
) -> tuple[SharedFilesystemStore, list[RecordSetRef], RecordSetRef]:
    """Three collectable packs of a dead writer plus one owned pack; returns (collector, victims, kept)."""
    writer = open_store(root, segment_target_bytes=0)
    victims = [pub(writer, f"v{i}") for i in range(3)]
    kept = pub(writer, "kept")
    writer.close()
    collector = open_store(root, fault=fault)
    collector.retain("keep", [kept])
    return collector, victims, kept


def test_corrupt_catalog_frame_fails_collection_and_deletes_nothing(root: Path) -> None:
    fault = Fault()
    collector, _, kept = _collectable_pool(root, fault)
    # A later frame witnesses that the "keep" frame was durable (DURABILITY.md decision
    # table), so damage to it is not a torn write: the catalog must fail closed.
    collector.retain("witness", [kept])
    collector.close()
    log = root / "catalog" / "log"
    data = bytearray(log.read_bytes())
    data[data.index(b'"owner":"keep"') + 9] ^= 0x01
    log.write_bytes(bytes(data))
    before = on_disk(root)
    fresh = open_store(root)
    with pytest.raises(CorruptData, match="catalog is damaged"):
        fresh.collect_garbage()
    with pytest.raises(CorruptData):
        fresh.retain("o", [kept])
    with pytest.raises(CorruptData):
        fresh.explain(pack(kept))
    assert on_disk(root) == before
    assert log.read_bytes() == bytes(data)  # not truncated or rewritten
    assert len(before) == 4


@pytest.mark.parametrize("phase", GC_PHASES)
def test_i14_fault_during_collection_deletes_nothing_reachable_and_the_next_finishes(
    root: Path, phase: str
) -> None:
    fault = Fault()
    collector, victims, kept = _collectable_pool(root, fault)
    victim_paths = sorted(pack(v) for v in victims)
    fault.arm(phase)
    with pytest.raises(StorageUnavailable, match=f"injected at {phase}"):
        collector.collect_garbage()
    assert sorted(on_disk(root)) == sorted([*victim_paths, pack(kept)])  # nothing unlinked yet
    state = catalog_state(root)
    assert state.tombstones == (set() if phase == "before_tombstone" else set(victim_paths))
    assert state.dead_writers  # G5 was durable before the tombstones
    result = collector.collect_garbage()
    assert result["reclaimed_files"] == 3
    assert result["tombstones"] == 3
    assert on_disk(root) == [pack(kept)]
    assert catalog_state(root).reclaimed == set(victim_paths)
    assert got(open_store(root), kept) == want("kept")
    collector.close()


def test_i14_fault_between_two_unlinks_the_next_collection_unlinks_the_rest(root: Path) -> None:
    fault = Fault()
    collector, victims, kept = _collectable_pool(root, fault)
    fault.arm("before_unlink", nth=2)
    with pytest.raises(StorageUnavailable, match="before_unlink"):
        collector.collect_garbage()
    assert len(on_disk(root)) == 3  # one victim went, two tombstoned ones remain
    result = collector.collect_garbage()
    assert (result["reclaimed_files"], result["tombstones"]) == (2, 3)
    assert on_disk(root) == [pack(kept)]
    assert catalog_state(root).reclaimed == {pack(v) for v in victims}
    collector.close()


def test_g4_enoent_after_a_tombstone_counts_as_done(root: Path) -> None:
    fault = Fault()
    collector, victims, kept = _collectable_pool(root, fault)
    fault.arm("after_tombstone")
    with pytest.raises(StorageUnavailable):
        collector.collect_garbage()
    os.unlink(root / pack(victims[0]))  # another client unlinked it meanwhile
    result = collector.collect_garbage()
    assert result["reclaimed_files"] == 2
    assert catalog_state(root).reclaimed == {pack(v) for v in victims}
    assert on_disk(root) == [pack(kept)]
    collector.close()


@pytest.mark.parametrize("phase", ["before_catalog_write", "after_catalog_append", "after_catalog_sync"])
def test_catalog_fault_during_retain_never_loses_an_owner_it_had(root: Path, phase: str) -> None:
    fault = Fault()
    collector, victims, kept = _collectable_pool(root, fault)
    fault.arm(phase)
    with pytest.raises((OSError, StorageUnavailable), match=phase):
        collector.retain("keep", [victims[0]])  # replaces keep's roots, or does not
    # G3: the failed append was cut back out under the lock, so keep's roots are unchanged.
    assert catalog_state(root).owners["keep"] == {pack(kept)}
    result = collector.collect_garbage()
    assert result["reclaimed_files"] == 3
    assert on_disk(root) == [pack(kept)]
    collector.close()


@pytest.mark.parametrize("call", ["retain", "release", "release_publications", "pin"])
def test_a_catalog_storage_error_in_a_lifetime_call_is_storage_unavailable(root: Path, call: str) -> None:
    fault = Fault()
    store = open_store(root, online_gc=True, fault=fault)
    ref = pub(store, "a")
    store.retain("o", [ref])
    fault.arm("before_catalog_write")
    with pytest.raises(StorageUnavailable, match=r"\[Errno 5\] injected at before_catalog_write"):
        if call == "retain":
            store.retain("o", [ref])
        elif call == "release":
            store.release("o")
        elif call == "release_publications":
            store.release_publications([ref])
        else:
            with store.pin([ref]):
                pass
    store.close()


# --------------------------------------------------------------------------- readers


def test_a_reader_with_the_pack_open_keeps_reading_a_new_reader_is_refused(root: Path) -> None:
    writer = open_store(root, segment_target_bytes=0)
    ref = pub(writer, "a")
    writer.close()
    reader = open_store(root)
    with reader.read_session() as session:
        assert [bytes(r.payload) for r in session.read(ref)] == [p for _, p in want("a")]
        assert open_store(root).collect_garbage()["reclaimed_files"] == 1
        assert [bytes(r.payload) for r in session.read(ref)] == [p for _, p in want("a")]
    # The dead writer's directory went with its last pack: nothing of it is in the pool any more.
    with pytest.raises(InvalidReference, match=re.escape(pack(ref)) + ".*garbage-collected"):
        list(open_store(root).read(ref))


def test_a_reader_lets_go_of_a_collected_pack_once_it_opens_another(root: Path) -> None:
    """D5.2b: a cached descriptor does not keep a collected pack's blocks allocated for long."""
    writer = open_store(root, segment_target_bytes=0, online_gc=True)
    gone, kept = pub(writer, "a"), pub(writer, "b")
    assert pack(gone) != pack(kept)
    with open_store(root).read_session() as session:
        assert [bytes(r.payload) for r in session.read(gone)] == [p for _, p in want("a")]
        writer.release_publications([gone])
        assert writer.collect_garbage()["reclaimed_files"] == 1
        held = [path for path in descriptors_under(root) if pack(gone) in path]
        assert held and all(path.endswith("(deleted)") for path in held)
        # Until it opens another pack the session still reads the one it has open ...
        assert [bytes(r.payload) for r in session.read(gone)] == [p for _, p in want("a")]
        assert [bytes(r.payload) for r in session.read(kept)] == [p for _, p in want("b")]
        # ... and then no descriptor holds the collected file: its space is free.
        assert not [path for path in descriptors_under(root) if pack(gone) in path]
        assert [path for path in descriptors_under(root) if pack(kept) in path]
        with pytest.raises(StorageUnavailable, match=re.escape(pack(gone))):
            list(session.read(gone))
    writer.close()


def test_a_new_reader_of_a_collected_pack_whose_writer_has_others_gets_storage_unavailable(
    root: Path,
) -> None:
    writer = open_store(root, segment_target_bytes=0, online_gc=True)
    ref, kept = pub(writer, "a"), pub(writer, "b")
    writer.release_publications([ref])
    assert writer.collect_garbage()["reclaimed_files"] == 1
    with pytest.raises(StorageUnavailable, match=re.escape(pack(ref))):
        list(open_store(root).read(ref))
    assert [bytes(r.payload) for r in open_store(root).read(kept)] == [p for _, p in want("b")]
    writer.close()


def test_publish_many_publications_in_one_pack_need_every_release(root: Path) -> None:
    store = open_store(root, online_gc=True)
    refs = store.publish_many(
        [
            Publication((Record("x", payload("x")),)),
            Publication((Record("y", payload("y")),), dependencies=(0,)),
        ],
        submission_id="many",
    )
    store.seal()
    store.release_publications([refs[1]])
    assert store.collect_garbage()["reclaimed_files"] == 0
    store.release_publications([refs[0]])
    assert store.collect_garbage()["reclaimed_files"] == 1
    store.close()
