"""Garbage collection across two real JuiceFS clients of one volume (docs/GC.md, G1-G5, I13, I14).

* A writer process on client A publishes (sealed packs plus one open pack) while a collector
  process on client B runs: the writer holds ``LIVE`` through A, so B never finds it dead and
  reclaims nothing of it. Once the writer closes (or is ``SIGKILL``ed), B finds it dead
  exactly once and reclaims every pack no owner reaches; owned data reads back byte-exact
  through both clients.
* Two collector processes, one per client, started together and each looping
  ``collect_garbage``, serialise on the catalog's ``flock``: every dead pack is reclaimed
  exactly once (the sum of ``reclaimed_files`` is the number of collectable packs, the dead
  writer is found once) and neither collector errs.
* A reader pinning data through client A keeps it alive against a collector on client B;
  once the pin ends, B reclaims it.

This file is also the child program: ``python tests/test_gc_juicefs.py write|collect ...``.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path
from typing import IO, Any

import pytest

from child_io import CHILD_TIMEOUT_S, children, read_line, send
from queue_helpers import descriptors_under
from straw.backend import FilesystemBackend
from straw.protocol import Record, RecordSetRef, as_dict
from straw.store import SharedFilesystemStore

pytestmark = pytest.mark.juicefs

RUN = "run-gc-juicefs"
HERE = Path(__file__).resolve()


def payload(name: str) -> bytes:
    rng = random.Random(name)
    return rng.randbytes(rng.randint(1_000, 9_000))


def open_store(root: str | Path, declaration: dict[str, Any], **kwargs: Any) -> SharedFilesystemStore:
    backend = FilesystemBackend(root, profile="juicefs", declaration=declaration)
    return SharedFilesystemStore(root, RUN, backend=backend, **kwargs)


def publish(store: SharedFilesystemStore, name: str) -> RecordSetRef:
    return store.publish([Record(name, payload(name))], submission_id=name)


# --------------------------------------------------------------------------- child programs


def child_write(root: str, declaration: dict[str, Any], count: int, commands: IO[str], out: IO[str]) -> None:
    """Publish ``count`` publications (all but the last sealed in their own pack), then obey stdin."""
    store = open_store(root, declaration)
    for index in range(count):
        ref = publish(store, f"w{index}")
        if index < count - 1:
            store.seal()
        out.write(json.dumps({"name": f"w{index}", "ref": as_dict(ref)}) + "\n")
    out.write(json.dumps({"writer": store.writer_id}) + "\n")
    out.flush()
    for line in commands:
        if line.strip() == "close":
            store.close()
            out.write("closed\n")
            out.flush()
            return
    # EOF without "close": leave without closing (the kernel drops LIVE when the process ends).


def child_collect(
    root: str, declaration: dict[str, Any], loops: int, commands: IO[str], out: IO[str]
) -> None:
    """Print ``ready``, wait for ``go``, then collect ``loops`` times and print every result."""
    store = open_store(root, declaration)
    out.write("ready\n")
    out.flush()
    if commands.readline().strip() != "go":
        return
    results: list[dict[str, Any]] = []
    error = None
    try:
        for _ in range(loops):
            results.append(store.collect_garbage())
    except Exception as exc:  # reported to the parent, which fails the test with it
        error = f"{type(exc).__name__}: {exc}"
    out.write(json.dumps({"results": results, "error": error}) + "\n")
    out.flush()
    store.close()


def main(argv: list[str]) -> None:
    command, root, declaration, number = argv[0], argv[1], json.loads(argv[2]), int(argv[3])
    if command == "write":
        child_write(root, declaration, number, sys.stdin, sys.stdout)
    elif command == "collect":
        child_collect(root, declaration, number, sys.stdin, sys.stdout)
    else:
        raise SystemExit(f"unknown command {command!r}")


# --------------------------------------------------------------------------- parent side


def _spawn(command: str, root: Path, declaration: dict[str, Any], number: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(HERE), command, str(root), json.dumps(declaration), str(number)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _collect_once(root: Path, declaration: dict[str, Any]) -> dict[str, Any]:
    """One collection in a fresh process mounted through ``root``'s client."""
    process = _spawn("collect", root, declaration, 1)
    with children(process):
        assert read_line(process) == "ready\n"
        send(process, "go\n")
        answer = json.loads(read_line(process))
        process.communicate(timeout=CHILD_TIMEOUT_S)
    assert answer["error"] is None, answer["error"]
    result: dict[str, Any] = answer["results"][0]
    return result


def _published_by_a_dead_writer(root: Path, declaration: dict[str, Any], count: int) -> list[RecordSetRef]:
    """``p0``..``p<count-1>``, each in its own pack, by a writer that has closed since."""
    writer = open_store(root, declaration, segment_target_bytes=0)
    refs = [publish(writer, f"p{i}") for i in range(count)]
    writer.close()
    return refs


def _packs(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.glob("raw/*/*") if p.suffix in (".pack", ".seg")}


def _start_writer(
    root: Path, declaration: dict[str, Any], count: int
) -> tuple[subprocess.Popen[str], dict[str, RecordSetRef], str]:
    writer = _spawn("write", root, declaration, count)
    refs = {}
    for _ in range(count):
        item = json.loads(read_line(writer))
        refs[item["name"]] = RecordSetRef.from_dict(item["ref"])
    writer_id = json.loads(read_line(writer))["writer"]
    return writer, refs, writer_id


def _read(store: SharedFilesystemStore, ref: RecordSetRef) -> list[tuple[str, bytes]]:
    return [(r.record_id, bytes(r.payload)) for r in store.read(ref)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ending", ["close", "sigkill"])
def test_g5_writer_alive_on_a_is_never_dead_to_a_collector_on_b(
    juicefs_pool: tuple[Path, Path], juicefs_clients: Any, ending: str
) -> None:
    path_a, path_b = juicefs_pool
    declaration = juicefs_clients.declaration
    open_store(path_a, declaration).close()  # the pool exists on both clients
    writer, refs, writer_id = _start_writer(path_a, declaration, 5)
    with children(writer):
        paths = {name: ref.manifest.segment.path for name, ref in refs.items()}
        assert len(set(paths.values())) == 5
        owner = open_store(path_b, declaration)
        owner.retain("keep", [refs["w1"], refs["w4"]])  # w4 is in the writer's open pack

        alive = _collect_once(path_b, declaration)
        assert (alive["reclaimed_files"], alive["dead_writers_found"]) == (0, 0)
        assert (alive["open_packs"], alive["retained_packs"]) == (5, 0)  # online_gc=False: no seals
        assert owner.explain(paths["w0"])["writer_dead"] is False
        assert _packs(path_b) == set(paths.values())
        assert writer.poll() is None

        if ending == "close":
            send(writer, "close\n")
            assert read_line(writer) == "closed\n"
            writer.communicate(timeout=CHILD_TIMEOUT_S)
            assert writer.returncode == 0
        else:
            os.kill(writer.pid, signal.SIGKILL)
            writer.communicate(timeout=CHILD_TIMEOUT_S)
            assert writer.returncode == -signal.SIGKILL

    dead = _collect_once(path_b, declaration)
    assert (dead["dead_writers_found"], dead["reclaimed_files"], dead["retained_packs"]) == (1, 3, 2)
    kept = {paths["w1"], paths["w4"]}
    assert _packs(path_b) == kept
    assert _packs(path_a) == kept
    answer = owner.explain(paths["w4"])
    assert (answer["writer"], answer["writer_dead"], answer["sealed"], answer["owners"]) == (
        writer_id,
        True,
        True,
        ["keep"],
    )
    reader_a, reader_b = open_store(path_a, declaration), open_store(path_b, declaration)
    for name in ("w1", "w4"):
        assert _read(reader_a, refs[name]) == [(name, payload(name))]
        assert _read(reader_b, refs[name]) == [(name, payload(name))]
    owner.release("keep")
    assert _collect_once(path_a, declaration)["reclaimed_files"] == 2
    assert _packs(path_b) == set()
    for store in (owner, reader_a, reader_b):
        store.close()


@pytest.mark.timeout(120)
def test_g4_concurrent_collectors_on_both_clients_reclaim_each_dead_pack_once(
    juicefs_pool: tuple[Path, Path], juicefs_clients: Any
) -> None:
    path_a, path_b = juicefs_pool
    declaration = juicefs_clients.declaration
    victims_count, loops = 16, 3
    writer = open_store(path_a, declaration, segment_target_bytes=0)  # one file per publication
    refs = [publish(writer, f"p{i}") for i in range(victims_count + 4)]
    writer.close()
    owner = open_store(path_a, declaration)
    kept = refs[::5]  # 4 kept
    owner.retain("keep", kept)
    kept_paths = {r.manifest.segment.path for r in kept}
    victims = {r.manifest.segment.path for r in refs} - kept_paths
    assert len(victims) == victims_count
    victim_bytes = sum((path_a / p).stat().st_size for p in victims)

    collectors = [_spawn("collect", path, declaration, loops) for path in (path_a, path_b)]
    with children(*collectors):
        for process in collectors:
            assert read_line(process) == "ready\n"
        for process in collectors:  # both start at once
            send(process, "go\n")
        answers = [json.loads(read_line(process)) for process in collectors]
        for process in collectors:
            process.communicate(timeout=CHILD_TIMEOUT_S)
            assert process.returncode == 0
    assert [a["error"] for a in answers] == [None, None]
    results = [r for a in answers for r in a["results"]]
    assert len(results) == 2 * loops
    assert sum(r["reclaimed_files"] for r in results) == victims_count
    assert sum(r["reclaimed_bytes"] for r in results) == victim_bytes
    assert sum(r["dead_writers_found"] for r in results) == 1
    assert {r["tombstones"] for r in results[loops - 1 :: loops]} == {victims_count}  # each one's last
    assert _packs(path_a) == kept_paths
    assert _packs(path_b) == kept_paths
    reader = open_store(path_b, declaration)
    for index in range(0, len(refs), 5):
        assert _read(reader, refs[index]) == [(f"p{index}", payload(f"p{index}"))]
    reader.close()
    owner.close()


@pytest.mark.timeout(120)
def test_i13_a_pin_on_client_a_keeps_data_alive_against_a_collector_on_b(
    juicefs_pool: tuple[Path, Path], juicefs_clients: Any
) -> None:
    path_a, path_b = juicefs_pool
    declaration = juicefs_clients.declaration
    refs = _published_by_a_dead_writer(path_a, declaration, 3)
    pinned = refs[1].manifest.segment.path
    reader = open_store(path_a, declaration)
    with reader.pin([refs[1]]) as pin_owner:
        result = _collect_once(path_b, declaration)
        assert (result["reclaimed_files"], result["owners"], result["dead_writers_found"]) == (2, 1, 1)
        assert _packs(path_a) == {pinned}
        assert reader.explain(pinned)["owners"] == [pin_owner]
        with reader.read_session() as session:  # a new descriptor, opened after the collection
            assert [(r.record_id, bytes(r.payload)) for r in session.read(refs[1])] == [("p1", payload("p1"))]
    result = _collect_once(path_b, declaration)
    assert (result["reclaimed_files"], result["owners"]) == (1, 0)
    assert _packs(path_a) == set()
    reader.close()


def test_d5_2b_a_reader_on_a_lets_go_of_a_pack_a_collector_on_b_removed(
    juicefs_pool: tuple[Path, Path], juicefs_clients: Any
) -> None:
    """An open descriptor keeps a removed file's chunks in the volume: client A's reader closes
    it once it sees (through A's fresh attributes) that client B's collection unlinked it."""
    path_a, path_b = juicefs_pool
    declaration = juicefs_clients.declaration
    refs = _published_by_a_dead_writer(path_a, declaration, 2)
    gone = refs[0].manifest.segment.path
    reader = open_store(path_a, declaration)
    with reader.pin([refs[1]]), reader.read_session() as session:
        assert [bytes(r.payload) for r in session.read(refs[0])] == [payload("p0")]
        assert _collect_once(path_b, declaration)["reclaimed_files"] == 1
        assert _packs(path_a) == {refs[1].manifest.segment.path}
        assert [path for path in descriptors_under(path_a) if gone in path]
        assert [bytes(r.payload) for r in session.read(refs[1])] == [payload("p1")]
        assert not [path for path in descriptors_under(path_a) if gone in path]
    reader.close()


if __name__ == "__main__":
    main(sys.argv[1:])
