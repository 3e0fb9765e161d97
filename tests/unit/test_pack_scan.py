"""Damage a real pack byte by byte and cut it at every length: reads are exact or refused.

One pool holds one sealed pack written by ``SharedFilesystemStore``: about
thirty publications of mixed sizes (an empty payload, an empty publication, a
700 KiB record spanning three chunks, a ``publish_many`` with an in-extent
dependency, an external dependency and a ``record_set`` over records of other
extents). Then, in place and restored after each case:

* one byte is changed (every byte of the pack header, of every frame header,
  index and seal frame, and a stride through the payloads), and the
  references are read through a fresh store: one whose read covers the byte
  raises CorruptData, InvalidReference or UnsupportedSchema, every other one
  returns exactly the original records (I6: never wrong data, never another
  exception). Every reference is read for every case except inside index
  bodies, where references not covering the byte are read every 7th byte to
  keep the run under ~20 s;
* the pack is truncated (every frame boundary and a stride): a reference whose
  bytes lie before the cut still reads, every other one raises CorruptData.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from straw import Publication, Record, RecordRef, RecordSetRef, SegmentRef, SharedFilesystemStore
from straw._pack import frame
from straw.backend import FilesystemBackend
from straw.errors import CorruptData, InvalidReference, UnsupportedSchema
from straw.limits import CHUNK_BYTES

RUN_ID = "scan-run"
REFUSALS = (CorruptData, InvalidReference, UnsupportedSchema)
PAYLOAD_STRIDE = 997
TRUNCATION_STRIDE = 1009
INDEX_FULL_READ_EVERY = 7
# make test damages every byte of the pack header and every SAMPLE_EVERY-th of the
# other cases (~18k, each opening a store), reading the targets that do not cover the
# byte for one in SAMPLE_EVERY of those; `-m slow` runs every case.
SAMPLE_EVERY = 8
BIG_BYTES = 700 * 1024

Span = tuple[int, int]
Expected = list[tuple[str, bytes, str, dict[str, Any], int]]


def _no_sleep(seconds: float) -> None:
    raise AssertionError(f"a read waited {seconds}s for a file that exists")


def _expected(records: list[Record]) -> Expected:
    return [(r.record_id, bytes(r.payload), r.codec, dict(r.metadata), r.tokens) for r in records]


@dataclass
class _Target:
    """One reference, what reading it must return, and the byte spans a read of it covers."""

    name: str
    ref: RecordSetRef | RecordRef
    expected: Expected
    spans: list[Span]
    #: Bytes of dependencies: the current reader does not read them, a future one may.
    maybe_spans: list[Span]

    def covers(self, offset: int) -> bool:
        return any(lo <= offset < hi for lo, hi in self.spans)

    def maybe_covers(self, offset: int) -> bool:
        return any(lo <= offset < hi for lo, hi in self.maybe_spans)

    def end(self) -> int:
        return max(hi for _, hi in self.spans + self.maybe_spans)


@dataclass
class _Pack:
    pool: Path
    path: Path
    data: bytes
    targets: list[_Target]
    frames: list[tuple[int, int, int]]  # offset, kind, total size


# ----------------------------------------------------------------------------- building the pack


def _records(rng: random.Random, number: int, count: int) -> list[Record]:
    sizes = (0, 1, 13, 200, 1500, 4096, 9000)
    out = []
    for j in range(count):
        size = sizes[(number + j) % len(sizes)]
        out.append(
            Record(
                f"p{number}r{j}",
                rng.randbytes(size),
                "json.v1" if (number + j) % 5 == 0 else "bytes.v1",
                {"n": number, "é": j} if j else {"n": number},
                number * 10 + j,
            )
        )
    return out


def _index(data: bytes, segment: SegmentRef) -> frame.Index:
    raw = data[segment.offset : segment.offset + segment.size]
    return frame.parse_index(frame.decode_json_frame(raw, frame.KIND_INDEX, segment.checksum))


def _record_spans(data: bytes, ref: RecordRef) -> list[Span]:
    segment = ref.segment
    entry = _index(data, segment).entries[ref.ordinal]
    spans = [(0, frame.PACK_HEADER_BYTES), (segment.offset, segment.offset + segment.size)]
    if entry.inline is None and entry.length:
        spans.append((entry.offset, entry.offset + entry.length))
    return spans


def _set_spans(data: bytes, ref: RecordSetRef, store: SharedFilesystemStore) -> tuple[list[Span], list[Span]]:
    spans = _record_spans(data, ref.manifest)
    for record in store.manifest(ref)["records"]:
        spans += _record_spans(data, RecordRef(SegmentRef(**record["segment"]), record["ordinal"]))
    maybe: list[Span] = []
    for dependency in store.manifest(ref)["dependencies"]:
        dep = RecordSetRef.from_dict(dependency)
        inner, inner_maybe = _set_spans(data, dep, store)
        maybe += inner + inner_maybe
    return spans, maybe


def _frames(data: bytes) -> list[tuple[int, int, int]]:
    frames = []
    position = frame.PACK_HEADER_BYTES
    while position < len(data):
        header = frame.decode_frame_header(data[position : position + frame.FRAME_HEADER_BYTES])
        size = frame.FRAME_HEADER_BYTES + header.body_bytes
        frames.append((position, header.kind, size))
        position += size
    assert position == len(data)
    return frames


def _build(pool: Path) -> _Pack:
    rng = random.Random(20_240_601)
    store = SharedFilesystemStore(pool, RUN_ID, backend=FilesystemBackend(pool, sleep=_no_sleep))
    sets: list[tuple[str, RecordSetRef, list[Record]]] = []
    records: list[tuple[str, RecordRef, Record]] = []

    def publish(name: str, recs: list[Record], deps: tuple[RecordSetRef, ...] = ()) -> RecordSetRef:
        ref = store.publish(recs, submission_id=name, dependencies=deps)
        sets.append((name, ref, recs))
        return ref

    for number in range(20):
        publish(f"pub-{number}", _records(rng, number, 1 + (number % 4 == 0)))
    publish("empty-payload", [Record("empty", b"", "bytes.v1", {}, 0)])
    publish("empty-set", [])
    big = Record("big", rng.randbytes(BIG_BYTES), "bytes.v1", {"big": True}, 123)
    big_ref = publish("big", [big])
    many = [Publication(tuple(_records(rng, 100 + i, 2)), (i - 1,) if i else ()) for i in range(3)]
    for i, ref in enumerate(store.publish_many(many, submission_id="many")):
        sets.append((f"many-{i}", ref, list(many[i].records)))
    publish("with-dependency", _records(rng, 200, 2), (big_ref,))
    loose = _records(rng, 300, 3)
    loose_refs = store.write_records(loose, submission_id="loose")
    for i, (ref, record) in enumerate(zip(loose_refs, loose, strict=True)):
        records.append((f"loose-{i}", ref, record))
    more = _records(rng, 400, 2)
    more_refs = store.write_records(more, submission_id="more")
    chosen = [loose_refs[2], more_refs[0], loose_refs[0]]
    combined = store.record_set(chosen, submission_id="combined", dependencies=(sets[0][1],))
    sets.append(("combined", combined, [loose[2], more[0], loose[0]]))
    store.close()

    (path,) = pool.glob("raw/*/*.pack")
    data = path.read_bytes()
    reader = SharedFilesystemStore(pool, RUN_ID, backend=FilesystemBackend(pool, sleep=_no_sleep))
    targets = []
    for name, ref, recs in sets:
        spans, maybe = _set_spans(data, ref, reader)
        targets.append(_Target(name, ref, _expected(recs), spans, maybe))
    for name, ref, record in records:
        targets.append(_Target(name, ref, _expected([record]), _record_spans(data, ref), []))
    reader.close()
    return _Pack(pool, path, data, targets, _frames(data))


@pytest.fixture(scope="module")
def pack(tmp_path_factory: pytest.TempPathFactory) -> _Pack:
    return _build(tmp_path_factory.mktemp("scan") / "pool")


# ----------------------------------------------------------------------------- reading


def _read(store: SharedFilesystemStore, target: _Target) -> Expected:
    if isinstance(target.ref, RecordSetRef):
        records = list(store.read(target.ref))
    else:
        records = [store.read_record(target.ref)]
    return _expected(records)


def _outcomes(pack: _Pack, targets: list[_Target]) -> list[Expected | Exception]:
    """Read ``targets`` through a fresh store (no cached descriptor or index): records or refusal."""
    store = SharedFilesystemStore(pack.pool, RUN_ID, backend=FilesystemBackend(pack.pool, sleep=_no_sleep))
    out: list[Expected | Exception] = []
    try:
        for target in targets:
            try:
                out.append(_read(store, target))
            except REFUSALS as error:
                out.append(error)
    finally:
        store.close()
    return out


# ----------------------------------------------------------------------------- cases


def _flip_offsets(pack: _Pack) -> list[tuple[int, bool]]:
    """Offsets to damage, each with whether every target is read (else only those reading it).

    Every byte of the pack header and of every frame header, index and seal frame
    is damaged; payloads on a stride plus their ends and chunk boundaries. Reading
    all ~30 targets costs ~2 ms, so inside index bodies (~15k bytes) only every
    ``INDEX_FULL_READ_EVERY``-th case reads the targets that do not cover the byte.
    """
    offsets = dict.fromkeys(range(frame.PACK_HEADER_BYTES), True)
    for position, kind, size in pack.frames:
        body, end = position + frame.FRAME_HEADER_BYTES, position + size
        offsets.update(dict.fromkeys(range(position, body), True))
        if kind == frame.KIND_RECORD:
            samples = set(range(body, end, PAYLOAD_STRIDE)) | {body + 1, end - 2, end - 1}
            for boundary in range(body + CHUNK_BYTES, end, CHUNK_BYTES):
                samples |= {boundary - 1, boundary}
            offsets.update(dict.fromkeys((o for o in samples if body <= o < end), True))
        elif kind == frame.KIND_INDEX:
            offsets.update({o: (o - body) % INDEX_FULL_READ_EVERY == 0 for o in range(body, end)})
        else:
            offsets.update(dict.fromkeys(range(body, end), True))
    return sorted(offsets.items())


def _sampled(cases: list[tuple[int, bool]], every: int) -> list[tuple[int, bool]]:
    """Every pack-header case, and every ``every``-th other case (reading all for 1 in ``every``)."""
    if every == 1:
        return cases
    header = [case for case in cases if case[0] < frame.PACK_HEADER_BYTES]
    rest = [case for case in cases if case[0] >= frame.PACK_HEADER_BYTES][::every]
    return header + [(offset, read_all and n % every == 0) for n, (offset, read_all) in enumerate(rest)]


def _truncation_lengths(pack: _Pack) -> list[int]:
    lengths = set(range(0, len(pack.data), TRUNCATION_STRIDE))
    lengths.update({1, frame.PACK_HEADER_BYTES - 1, frame.PACK_HEADER_BYTES})
    for position, _, size in pack.frames:
        for edge in (position, position + frame.FRAME_HEADER_BYTES, position + size):
            lengths.update({edge - 1, edge, edge + 1})
    return sorted(n for n in lengths if 0 <= n < len(pack.data))


def test_pack_holds_every_kind_of_extent(pack: _Pack) -> None:
    kinds = [kind for _, kind, _ in pack.frames]
    assert kinds[-1] == frame.KIND_SEAL and kinds.count(frame.KIND_SEAL) == 1
    assert kinds.count(frame.KIND_INDEX) == 28
    assert len(pack.targets) == 31
    assert _outcomes(pack, pack.targets) == [t.expected for t in pack.targets]
    big = next(t for t in pack.targets if t.name == "big")
    assert len(big.expected[0][1]) == BIG_BYTES > 2 * CHUNK_BYTES
    combined = next(t for t in pack.targets if t.name == "combined")
    # Pack header, its own index, the indexes of "loose" and "more", three payloads.
    assert len(set(combined.spans)) == 7
    assert combined.maybe_spans


@pytest.mark.parametrize(
    "every", [pytest.param(SAMPLE_EVERY, id="sampled"), pytest.param(1, id="every", marks=pytest.mark.slow)]
)
def test_i6_every_damaged_byte_reads_exactly_or_is_refused(pack: _Pack, every: int) -> None:
    fd = os.open(pack.path, os.O_RDWR)
    masks = (0x01, 0x02, 0x04, 0x08, 0x10, 0x20, 0x40, 0x80, 0xFF)
    cases = _sampled(_flip_offsets(pack), every)
    refused = exact = 0
    try:
        for offset, read_all in cases:
            targets = [t for t in pack.targets if read_all or t.covers(offset) or t.maybe_covers(offset)]
            original = pack.data[offset]
            os.pwrite(fd, bytes([original ^ masks[offset % len(masks)]]), offset)
            try:
                outcomes = _outcomes(pack, targets)
            finally:
                os.pwrite(fd, bytes([original]), offset)
            for target, outcome in zip(targets, outcomes, strict=True):
                if target.covers(offset):
                    assert isinstance(outcome, REFUSALS), (offset, target.name, "damage not detected")
                    refused += 1
                elif not target.maybe_covers(offset):
                    assert outcome == target.expected, (offset, target.name, outcome)
                    exact += 1
                else:
                    assert isinstance(outcome, REFUSALS) or outcome == target.expected, (offset, target.name)
    finally:
        os.close(fd)
    assert pack.path.read_bytes() == pack.data
    assert len(cases) > 15_000 // every and refused > len(cases) and exact > 100_000 // every**2


def test_every_truncation_keeps_earlier_references_and_refuses_later_ones(pack: _Pack) -> None:
    fd = os.open(pack.path, os.O_RDWR)
    lengths = _truncation_lengths(pack)
    try:
        for length in lengths:
            os.ftruncate(fd, length)
            try:
                outcomes = _outcomes(pack, pack.targets)
            finally:
                os.pwrite(fd, pack.data[length:], length)
            for target, outcome in zip(pack.targets, outcomes, strict=True):
                if target.end() <= length:
                    assert outcome == target.expected, (length, target.name, outcome)
                else:
                    assert isinstance(outcome, CorruptData), (length, target.name, outcome)
    finally:
        os.close(fd)
    assert pack.path.read_bytes() == pack.data
    assert len(lengths) > 500
