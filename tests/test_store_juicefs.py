"""The record store across two real JuiceFS clients of one volume (profile ``juicefs``, A5/A6).

* A writer process on client A publishes; a reader process on client B reads every reference
  the moment it is handed over, byte-exact, while the writer keeps appending to the same
  pack. The reader keeps one read session, so its descriptor was opened before later appends
  (A6: a stale short or mismatching read is retried on a fresh descriptor).
* Damage made through client A (a flipped byte, a truncation) is reported as ``CorruptData``
  by a reader on client B: the bytes B returns are always verified (I6).

This file is also the child program: ``python tests/test_store_juicefs.py write|read ...``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import IO, Any

import numpy as np
import pytest

from child_io import CHILD_TIMEOUT_S, children, exchange
from straw._pack.reader import PackReader
from straw.backend import FilesystemBackend
from straw.errors import CorruptData
from straw.protocol import Publication, Record, RecordSetRef
from straw.store import SharedFilesystemStore
from straw.tensor import TENSOR_CODEC, publish_tensors

pytestmark = pytest.mark.juicefs

RUN = "run-juicefs"
HERE = Path(__file__).resolve()
MiB = 1 << 20


# --------------------------------------------------------------------------- the deterministic stream


def plan(index: int) -> list[list[tuple[str, int]]]:
    """Publications of write ``index`` (every 3rd is a publish_many of two): (record id, size)."""
    rng = random.Random(f"juicefs/{index}")
    sizes = [100, 5000, 300_000, MiB + 12_345]  # one to five chunks
    count = 2 if index % 3 == 2 else 1
    return [
        [(f"w{index}-p{k}-r{r}", rng.choice(sizes) + rng.randint(0, 99)) for r in range(rng.randint(1, 2))]
        for k in range(count)
    ]


def payload(record_id: str, size: int) -> bytes:
    return random.Random(record_id).randbytes(size)


def open_store(root: str | Path, declaration: dict[str, Any]) -> SharedFilesystemStore:
    backend = FilesystemBackend(root, profile="juicefs", declaration=declaration)
    return SharedFilesystemStore(root, RUN, backend=backend)


# --------------------------------------------------------------------------- child programs


def write_steps(root: str, declaration: dict[str, Any], commands: IO[str], out: IO[str]) -> None:
    """On each ``go`` line, publish the next write and print its references as one JSON line."""
    with open_store(root, declaration) as store:
        for index, _ in enumerate(commands):
            publications = [
                Publication(tuple(Record(i, payload(i, n)) for i, n in spec)) for spec in plan(index)
            ]
            refs = store.publish_many(publications, submission_id=f"write-{index}")
            out.write(json.dumps({"index": index, "refs": [dataclasses.asdict(r) for r in refs]}) + "\n")
            out.flush()


def read_steps(root: str, declaration: dict[str, Any], lines: IO[str], out: IO[str]) -> None:
    """Read each handed-over reference at once, byte-exact; print ``ok <index> <pack>``."""
    count = 0
    with open_store(root, declaration) as store, store.read_session() as session:
        for line in lines:
            item = json.loads(line)
            for spec, data in zip(plan(item["index"]), item["refs"], strict=True):
                got = [(r.record_id, bytes(r.payload)) for r in session.read(RecordSetRef.from_dict(data))]
                if got != [(i, payload(i, n)) for i, n in spec]:
                    raise AssertionError(f"write {item['index']} reads back different records")
            count += 1
            out.write(f"ok {item['index']} {item['refs'][0]['manifest']['segment']['path']}\n")
            out.flush()
    out.write(f"verified {count}\n")
    out.flush()


def main(argv: list[str]) -> None:
    command, root, declaration = argv[0], argv[1], json.loads(argv[2])
    if command == "write":
        write_steps(root, declaration, sys.stdin, sys.stdout)
    elif command == "read":
        read_steps(root, declaration, sys.stdin, sys.stdout)
    else:
        raise SystemExit(f"unknown command {command!r}")


# --------------------------------------------------------------------------- tests


def _spawn(command: str, root: Path, declaration: dict[str, Any]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(HERE), command, str(root), json.dumps(declaration)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.timeout(180)
def test_reader_on_client_b_verifies_each_reference_while_client_a_appends(
    juicefs_pool: tuple[Path, Path], juicefs_clients: Any
) -> None:
    path_a, path_b = juicefs_pool
    declaration = juicefs_clients.declaration
    writes = 9
    # The pool exists on both clients before the reader opens its store.
    open_store(path_a, declaration).close()
    writer = _spawn("write", path_a, declaration)
    reader = _spawn("read", path_b, declaration)
    with children(writer, reader):
        packs = set()
        for index in range(writes):
            line = exchange(writer, "go\n")  # the writer appends one more extent ...
            ack = exchange(reader, line).split()  # ... and client B reads it at once
            assert ack[:2] == ["ok", str(index)]
            packs.add(ack[2])
        out, err = reader.communicate(timeout=CHILD_TIMEOUT_S)
        assert reader.returncode == 0, err[-3000:]
        assert out == f"verified {writes}\n"
        writer.communicate(timeout=CHILD_TIMEOUT_S)
        assert writer.returncode == 0
    # Every extent went into the one pack the reader kept open while it grew.
    assert len(packs) == 1
    pack = packs.pop()
    assert (path_b / pack).stat().st_size > writes * 100


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as handle:
        handle.seek(offset)
        old = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([old[0] ^ 0xFF]))
        handle.flush()
        os.fsync(handle.fileno())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("damage", ["payload byte", "index byte", "truncation"])
def test_i6_damage_made_on_client_a_is_corrupt_data_on_client_b(
    juicefs_pool: tuple[Path, Path], juicefs_clients: Any, damage: str
) -> None:
    path_a, path_b = juicefs_pool
    declaration = juicefs_clients.declaration
    data = payload("victim", 600_000)
    with open_store(path_a, declaration) as writer:
        kept = writer.publish([Record("kept", payload("kept", 5000))], submission_id="kept")
        ref = writer.publish([Record("victim", data)], submission_id="victim")
        (victim,) = writer.validate(ref)
    segment = ref.manifest.segment
    reader = PackReader(FilesystemBackend(path_a, profile="juicefs", declaration=declaration), RUN)
    entry = reader.index(segment).entries[victim.ordinal]
    reader.close()
    with open_store(path_b, declaration) as before:
        assert [bytes(r.payload) for r in before.read(ref)] == [data]

    pack_a = path_a / segment.path
    if damage == "payload byte":
        _flip(pack_a, entry.offset + entry.length // 2)
        message = "payload checksum"
    elif damage == "index byte":
        _flip(pack_a, segment.offset + 50)
        message = "checksum mismatch"
    else:
        os.truncate(pack_a, segment.offset + segment.size // 2)
        message = "truncated"

    with open_store(path_b, declaration) as after:
        with pytest.raises(CorruptData, match=message):
            list(after.read(ref))
        if damage == "payload byte":
            with pytest.raises(CorruptData, match=message):
                after.read_record(victim)
            with pytest.raises(CorruptData, match=message):
                after.read_range(victim, 0, len(data))
        # The extent before the damaged one still reads on client B.
        assert [bytes(r.payload) for r in after.read(kept)] == [payload("kept", 5000)]


@pytest.mark.timeout(120)
def test_large_tensors_on_a_shared_mount_are_read_into_memory_of_their_own(
    juicefs_pool: tuple[Path, Path], juicefs_clients: Any
) -> None:
    """D5.6a: pages of a pack on a FUSE mount are never mapped (another client may collect the
    pack; a page faulted in again afterwards would be SIGBUS). The tensor is read and verified."""
    path_a, path_b = juicefs_pool
    declaration = juicefs_clients.declaration
    value = np.random.default_rng(5).integers(0, 256, size=(2048, 48, 8), dtype=np.int32)  # 3 MiB
    value = np.concatenate([value, value])  # 6 MiB: above READ_MAPPING_BYTES_MIN
    codecs = ("bytes.v1", TENSOR_CODEC)
    backend_a = FilesystemBackend(path_a, profile="juicefs", declaration=declaration)
    with SharedFilesystemStore(path_a, RUN, backend=backend_a, codecs=codecs) as writer:
        (ref,) = publish_tensors(writer, {"routes": value}, submission_id="large")
    backend_b = FilesystemBackend(path_b, profile="juicefs", declaration=declaration)
    with SharedFilesystemStore(path_b, RUN, backend=backend_b, codecs=codecs) as reader:
        assert not reader.backend.maps_reads
        loaded = ref.numpy(reader=reader)
        assert np.array_equal(loaded, value)
        with open("/proc/self/maps") as maps:
            mapped = [line for line in maps if str(path_b) in line]
        assert mapped == []


if __name__ == "__main__":
    main(sys.argv[1:])
