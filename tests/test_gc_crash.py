"""Real process deaths during collection and writing (docs/GC.md, G4, G5, I13, I14).

* A collector process dies (``os._exit(1)`` from its backend's fault hook) right after its
  tombstones became durable, or before its first or second unlink. The parent then finds the
  tombstoned packs still on disk (except any the collector unlinked before dying), nothing
  reachable touched, and the next collection, in a new process, unlinks exactly the rest.
* A writer process is ``SIGKILL``ed mid-stream. While it lived, collectors left all of its
  packs alone; afterwards a collector in another process finds it dead
  (``dead_writers_found == 1``), seals its open pack in the catalog, deletes its temporary
  files and reclaims every pack no owner reaches, while the owned publications read back
  byte-exact.

This file is also the child program: ``python tests/test_gc_crash.py collect|write ...``.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from child_io import CHILD_TIMEOUT_S, read_line
from straw._catalog.log import Catalog
from straw.backend import FilesystemBackend
from straw.protocol import Record, RecordSetRef, as_dict
from straw.store import SharedFilesystemStore

pytestmark = pytest.mark.crash

RUN = "run-gc-crash"
HERE = Path(__file__).resolve()
#: A writer stops by itself after this many publications if nobody kills it (it is killed
#: while still writing, long before: each publication is a few KB).
WRITES_MAX = 50_000
#: Small packs so a short stream spans several of them.
SEGMENT_TARGET = 24_000


def payload(name: str) -> bytes:
    rng = random.Random(name)
    return rng.randbytes(rng.randint(2_000, 7_000))


def _no_sleep(_: float) -> None:
    return None


def open_store(root: str | Path, **kwargs: Any) -> SharedFilesystemStore:
    fault = kwargs.pop("fault", None)
    backend = FilesystemBackend(root, fault=fault, sleep=_no_sleep, visibility_delays=(0.0,))
    return SharedFilesystemStore(root, RUN, backend=backend, **kwargs)


# --------------------------------------------------------------------------- child programs


def child_collect(root: str, phase: str, nth: int) -> None:
    """Collect with a hook that kills this process at the ``nth`` call of ``phase``."""
    calls = [0]

    def die(name: str) -> None:
        if name == phase:
            calls[0] += 1
            if calls[0] == nth:
                os._exit(1)

    store = open_store(root, fault=die)
    result = store.collect_garbage()
    print(json.dumps(result), flush=True)
    store.close()


def child_write(root: str, online_gc: bool) -> None:
    """Publish forever (bounded), printing each reference once publish returned."""
    store = open_store(root, online_gc=online_gc, segment_target_bytes=SEGMENT_TARGET)
    for index in range(WRITES_MAX):
        name = f"w{index}"
        ref = store.publish([Record(name, payload(name))], submission_id=name)
        print(json.dumps({"name": name, "ref": as_dict(ref)}), flush=True)
    store.close()


def main(argv: list[str]) -> None:
    command, root = argv[0], argv[1]
    if command == "collect":
        child_collect(root, argv[2], int(argv[3]))
    elif command == "write":
        child_write(root, argv[2] == "online")
    else:
        raise SystemExit(f"unknown command {command!r}")


# --------------------------------------------------------------------------- parent side


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(HERE), *args],
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
        check=False,
    )


def _collect_in_child(root: Path, phase: str = "none", nth: int = 1) -> dict[str, Any] | None:
    """Run a collector process; its result, or None when the fault hook killed it."""
    done = _run("collect", str(root), phase, str(nth))
    if done.returncode == 1 and not done.stdout:
        return None
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def _packs(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.glob("raw/*/*") if p.suffix in (".pack", ".seg")}


def _catalog(root: Path) -> Any:
    catalog = Catalog(FilesystemBackend(root))
    try:
        with catalog.locked() as cat:
            return cat.state
    finally:
        catalog.close()


def _read(root: Path, ref: RecordSetRef) -> list[tuple[str, bytes]]:
    with open_store(root) as store:
        return [(r.record_id, bytes(r.payload)) for r in store.read(ref)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("phase", "nth", "unlinked_before_death"),
    [("after_tombstone", 1, 0), ("before_unlink", 1, 0), ("before_unlink", 3, 2)],
)
def test_i14_collector_killed_between_tombstone_and_unlink_the_next_one_finishes(
    tmp_path: Path, phase: str, nth: int, unlinked_before_death: int
) -> None:
    root = tmp_path / "pool"
    writer = open_store(root, segment_target_bytes=0)  # one file per publication
    refs = [writer.publish([Record(f"p{i}", payload(f"p{i}"))], submission_id=f"p{i}") for i in range(6)]
    writer.close()
    owner = open_store(root)
    kept = refs[::3]  # p0, p3
    owner.retain("keep", kept)
    owner.close()
    kept_paths = {r.manifest.segment.path for r in kept}
    victims = {r.manifest.segment.path for r in refs} - kept_paths

    assert _collect_in_child(root, phase, nth) is None  # the collector died mid-collection
    state = _catalog(root)
    assert state.tombstones == victims  # I14: durable before any unlink
    assert state.reclaimed == set()
    on_disk = _packs(root)
    assert kept_paths <= on_disk  # I13: nothing reachable was touched
    assert len(victims - on_disk) == unlinked_before_death
    assert len(on_disk) == 6 - unlinked_before_death

    result = _collect_in_child(root)
    assert result is not None
    assert result["reclaimed_files"] == 4 - unlinked_before_death
    assert (result["tombstones"], result["dead_writers_found"], result["retained_packs"]) == (4, 0, 2)
    assert _packs(root) == kept_paths
    assert _catalog(root).reclaimed == victims
    for index in (0, 3):
        assert _read(root, refs[index]) == [(f"p{index}", payload(f"p{index}"))]
    # A third collection has nothing left to do.
    again = _collect_in_child(root)
    assert again is not None and again["reclaimed_files"] == 0


def _line(process: subprocess.Popen[str]) -> dict[str, Any]:
    item: dict[str, Any] = json.loads(read_line(process, "writer"))
    return item


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["offline", "online"])
def test_g5_sigkilled_writer_is_found_dead_and_only_its_unowned_data_reclaimed(
    tmp_path: Path, mode: str
) -> None:
    root = tmp_path / "pool"
    writer = subprocess.Popen(
        [sys.executable, str(HERE), "write", str(root), mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        items = [_line(writer) for _ in range(30)]
        refs = {item["name"]: RecordSetRef.from_dict(item["ref"]) for item in items}
        paths = {ref.manifest.segment.path for ref in refs.values()}
        assert len(paths) >= 4  # the stream spans several packs
        keeper = open_store(root)
        kept = [refs["w1"], refs["w17"], refs["w29"]]
        keeper.retain("keep", kept)

        # While the writer lives, another process's collection leaves all of its packs alone.
        alive = _collect_in_child(root)
        assert alive is not None
        assert (alive["reclaimed_files"], alive["dead_writers_found"]) == (0, 0)
        assert writer.poll() is None
    finally:
        if writer.poll() is None:
            os.kill(writer.pid, signal.SIGKILL)
        writer.communicate(timeout=CHILD_TIMEOUT_S)
    assert writer.returncode == -signal.SIGKILL

    on_disk = _packs(root)
    kept_paths = {ref.manifest.segment.path for ref in kept}
    assert kept_paths <= on_disk and paths <= on_disk
    before = _catalog(root)
    unsealed = {p for p in on_disk if p not in before.packs or not before.packs[p].sealed}
    if mode == "offline":
        assert unsealed == on_disk  # an online_gc=False writer records no seals
    else:
        # The pack it was appending to, unless it died while rotating (old pack sealed in the
        # catalog, the new one not renamed into place yet).
        assert len(unsealed) <= 1
    result = _collect_in_child(root)
    assert result is not None
    assert result["dead_writers_found"] == 1
    assert result["reclaimed_files"] == len(on_disk - kept_paths)
    assert (result["retained_packs"], result["open_packs"]) == (len(kept_paths), 0)
    assert _packs(root) == kept_paths
    writer_dir = root / "raw" / next(iter(kept_paths)).split("/")[1]
    assert sorted(p.name for p in writer_dir.iterdir() if p.name.endswith(".tmp")) == []
    state = _catalog(root)
    assert all(state.packs[p].sealed for p in kept_paths)
    for path in unsealed & kept_paths:  # G5: sealed in the catalog by the collector (null extents)
        assert state.packs[path].sealed and state.packs[path].extents is None
    for path in on_disk - kept_paths:  # reclaimed: a name only, its staging forgotten
        assert path in state.reclaimed and path not in state.packs
    for name in ("w1", "w17", "w29"):
        assert _read(root, refs[name]) == [(name, payload(name))]
    keeper.release("keep")
    final = _collect_in_child(root)
    assert final is not None and final["reclaimed_files"] == len(kept_paths)
    assert _packs(root) == set()
    keeper.close()


if __name__ == "__main__":
    main(sys.argv[1:])
