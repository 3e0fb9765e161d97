"""Real process crashes: a writer killed with SIGKILL mid-stream loses nothing it acknowledged.

A writer process publishes a stream of publications (100 B to 2 MiB records, some
``publish_many`` calls with in-call dependencies) and prints each returned reference as one
JSON line, flushed. The test kills it with ``SIGKILL`` at several points; a separate, fresh
reader process then reads every printed reference back byte-exact (I1: a reference is
returned only after its bytes are durable; I2: they never change). Payloads are derived
from the record ids, so the reader regenerates them without any shared state.

A second test pipes the writer straight into a reader process that verifies each
reference the moment it arrives, while the writer keeps appending to the same pack.

This file is also the child program: ``python tests/test_store_crash.py write|verify ...``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path
from typing import IO, Any

import pytest

from child_io import CHILD_TIMEOUT_S, read_line
from straw._pack import frame
from straw.errors import CorruptData
from straw.protocol import Publication, Record, RecordSetRef
from straw.store import SharedFilesystemStore

pytestmark = pytest.mark.crash

RUN = "run-crash"
HERE = Path(__file__).resolve()
#: A writer stops by itself after this many writes if nobody kills it.
WRITES_MAX = 500


# --------------------------------------------------------------------------- the deterministic stream


def _record_size(rng: random.Random) -> int:
    roll = rng.random()
    if roll < 0.6:
        return rng.randint(100, 4000)
    if roll < 0.9:
        return rng.randint(4000, 300_000)  # one or two chunks
    return rng.randint(1 << 20, 2 << 20)  # 4 to 8 chunks


def plan(index: int) -> list[list[tuple[str, int]]]:
    """Publications of write number ``index``: every 4th write is a publish_many of three."""
    rng = random.Random(f"plan/{index}")
    count = 3 if index % 4 == 3 else 1
    return [
        [(f"w{index}-p{k}-r{r}", _record_size(rng)) for r in range(rng.randint(1, 3))] for k in range(count)
    ]


def payload(record_id: str, size: int) -> bytes:
    return random.Random(record_id).randbytes(size)


def _records(spec: list[tuple[str, int]]) -> tuple[Record, ...]:
    return tuple(Record(record_id, payload(record_id, size), tokens=size // 7) for record_id, size in spec)


# --------------------------------------------------------------------------- child programs


def write_stream(root: str, run_id: str, start: int, count: int, out: IO[str]) -> None:
    """Publish writes ``start .. start+count`` and print each result as a JSON line once returned."""
    with SharedFilesystemStore(root, run_id) as store:
        for index in range(start, start + count):
            publications = [_records(spec) for spec in plan(index)]
            if len(publications) == 1:
                refs: tuple[RecordSetRef, ...] = (
                    store.publish(publications[0], submission_id=f"write-{index}"),
                )
            else:
                many = [
                    Publication(records, dependencies=tuple(range(k)))
                    for k, records in enumerate(publications)
                ]
                refs = store.publish_many(many, submission_id=f"write-{index}")
            line = json.dumps({"index": index, "refs": [dataclasses.asdict(r) for r in refs]})
            out.write(line + "\n")
            out.flush()


def verify_stream(root: str, run_id: str, lines: IO[str], out: IO[str]) -> None:
    """Read every reference of every line back, byte-exact; print ``ok <index> <pack>`` per line."""
    store = SharedFilesystemStore(root, run_id)
    count = 0
    # One session for the whole stream: its cached descriptor sees later appends (A2).
    with store.read_session() as session:
        for line in lines:
            if not line.endswith("\n"):
                break  # a line cut by the kill was never fully handed over
            item = json.loads(line)
            specs = plan(item["index"])
            assert len(item["refs"]) == len(specs), item
            usage: list[int] = []  # publication k depends on every earlier one: counted per edge
            for spec, data in zip(specs, item["refs"], strict=True):
                ref = RecordSetRef.from_dict(data)
                got = [(r.record_id, bytes(r.payload)) for r in session.read(ref)]
                want = [(record_id, payload(record_id, size)) for record_id, size in spec]
                if got != want:
                    raise AssertionError(f"write {item['index']}: records differ from what was published")
                usage.append(sum(s for _, s in spec) + sum(usage))
                assert ref.records == len(spec) and ref.payload_bytes == usage[-1]
            count += 1
            out.write(f"ok {item['index']} {item['refs'][0]['manifest']['segment']['path']}\n")
            out.flush()
    out.write(f"verified {count}\n")
    out.flush()


def main(argv: list[str]) -> None:
    command, root, run_id = argv[:3]
    if command == "write":
        write_stream(root, run_id, int(argv[3]), int(argv[4]), sys.stdout)
    elif command == "verify":
        verify_stream(root, run_id, sys.stdin, sys.stdout)
    else:
        raise SystemExit(f"unknown command {command!r}")


# --------------------------------------------------------------------------- parent side


def _spawn(*args: str, stdin: Any = subprocess.DEVNULL) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(HERE), *args],
        stdin=stdin,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _kill(process: subprocess.Popen[str]) -> list[str]:
    """SIGKILL a writer; return the complete lines it printed that were not read yet."""
    os.kill(process.pid, signal.SIGKILL)
    rest, _ = process.communicate(timeout=CHILD_TIMEOUT_S)
    assert process.returncode == -signal.SIGKILL
    return [line + "\n" for line in rest.split("\n")[:-1]]


def _verify(root: Path, lines: list[str]) -> list[str]:
    """A fresh reader process reads every reference of ``lines``; returns its ``ok`` lines."""
    result = subprocess.run(
        [sys.executable, str(HERE), "verify", str(root), RUN],
        input="".join(lines),
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout.splitlines()
    assert out[-1] == f"verified {len(lines)}"
    return out[:-1]


def _run_writer(root: Path, start: int, count: int) -> list[str]:
    result = subprocess.run(
        [sys.executable, str(HERE), "write", str(root), RUN, str(start), str(count)],
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines(keepends=True)
    assert len(lines) == count
    return lines


def _visible_packs(root: Path) -> list[Path]:
    return sorted(root.glob("raw/*/*.pack"))


def _complete_extents(data: bytes) -> int:
    """Index frames that are wholly inside ``data``, scanning frames until a torn tail."""
    frame.decode_pack_header(data)
    position, extents = frame.PACK_HEADER_BYTES, 0
    while position + frame.FRAME_HEADER_BYTES <= len(data):
        if not data[position:].strip(b"\0"):
            break  # the zeros an unsealed pack keeps ahead of its frames (DURABILITY D1.2a)
        try:
            header = frame.decode_frame_header(data[position : position + frame.FRAME_HEADER_BYTES])
            end = position + frame.FRAME_HEADER_BYTES + header.body_bytes
            if end > len(data):
                break  # the torn tail of a write the kill interrupted
            if header.kind == frame.KIND_INDEX:
                frame.decode_json_frame(data[position:end], frame.KIND_INDEX, None)
                extents += 1
        except CorruptData:
            break  # a write the kill interrupted inside the zero-filled space: a torn tail too
        position = end
    return extents


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kill_after", [1, 5, 13])
def test_i1_references_printed_before_sigkill_read_back_in_a_fresh_process(
    tmp_path: Path, kill_after: int
) -> None:
    root = tmp_path / "pool"
    writer = _spawn("write", str(root), RUN, "0", str(WRITES_MAX))
    try:
        lines = [read_line(writer) for _ in range(kill_after)]
    except BaseException:
        writer.kill()
        raise
    lines += _kill(writer)
    assert len(lines) < WRITES_MAX, "the writer finished before it was killed"
    indexes = [json.loads(line)["index"] for line in lines]
    assert indexes == list(range(len(lines)))

    # A fresh process reads every acknowledged reference back.
    oks = _verify(root, lines)
    assert [int(ok.split()[1]) for ok in oks] == indexes
    # I7: every visible pack holds at least one complete extent; .tmp leftovers are allowed.
    packs = _visible_packs(root)
    assert packs
    for pack in packs:
        assert _complete_extents(pack.read_bytes()) >= 1, pack

    # A new writer on the same pool works, and nothing before it is disturbed.
    new_lines = _run_writer(root, 1000, 5)
    assert {json.loads(line)["refs"][0]["manifest"]["segment"]["path"] for line in new_lines}.isdisjoint(
        {json.loads(line)["refs"][0]["manifest"]["segment"]["path"] for line in lines}
    )
    assert len(_verify(root, lines + new_lines)) == len(lines) + 5


@pytest.mark.timeout(120)
def test_i1_reader_verifies_each_reference_while_the_writer_appends(tmp_path: Path) -> None:
    root = tmp_path / "pool"
    writer = _spawn("write", str(root), RUN, "0", str(WRITES_MAX))
    assert writer.stdout is not None
    reader = _spawn("verify", str(root), RUN, stdin=writer.stdout)
    writer.stdout.close()  # the reader now holds the only read end: it sees EOF when the writer dies
    try:
        acks = [read_line(reader) for _ in range(10)]
        # The reader verified ten references while the writer was still running.
        assert writer.poll() is None
        os.kill(writer.pid, signal.SIGKILL)
        writer.wait(timeout=CHILD_TIMEOUT_S)
        out, err = reader.communicate(timeout=CHILD_TIMEOUT_S)
    finally:
        for process in (writer, reader):
            if process.poll() is None:
                process.kill()
                process.wait(timeout=CHILD_TIMEOUT_S)
    assert writer.returncode == -signal.SIGKILL
    assert reader.returncode == 0, err[-3000:]
    acks += out.splitlines(keepends=True)
    total = int(acks[-1].split()[1])
    assert acks[-1] == f"verified {total}\n" and total >= 10
    oks = [line.split() for line in acks[:-1]]
    assert [int(ok[1]) for ok in oks] == list(range(total))
    # All of them came from the one pack the writer kept appending to.
    assert len({ok[2] for ok in oks}) == 1
    # And a fresh reader afterwards agrees, together with a new writer's data.
    new_lines = _run_writer(root, 2000, 3)
    assert len(_verify(root, new_lines)) == 3


if __name__ == "__main__":
    main(sys.argv[1:])
