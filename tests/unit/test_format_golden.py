"""Golden bytes pinning the on-disk format of docs/FORMAT.md.

Each structure is built with the pure encoders of ``straw._pack.frame`` from
fixed inputs and compared with literals written into this file. The literals
were generated once by running the code and then checked field by field against
FORMAT.md: every test below also unpacks the golden bytes with ``struct`` and
asserts each field as the document describes it, so a change to the code or a
change to the meaning of the bytes fails here. ``test_doc_*`` read FORMAT.md
itself so that the document cannot drift away from these bytes either.

The end-to-end tests publish through ``SharedFilesystemStore`` and parse the
pack with nothing but ``struct``, ``json``, ``hashlib`` and ``xxhash``, following
the document: the document alone suffices to read a pack.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from pathlib import Path
from typing import Any

import pytest
import xxhash

from straw import Publication, Record, SharedFilesystemStore
from straw._pack import frame
from straw.backend import FilesystemBackend
from straw.errors import CorruptData
from straw.limits import CODEC_NAME_BYTES_MAX, METADATA_BYTES_MAX, RECORD_ID_BYTES_MAX, TOKENS_MAX
from straw.store import logical_digest

FORMAT_MD = Path(__file__).resolve().parents[2] / "docs" / "FORMAT.md"

# ----------------------------------------------------------------------------- fixed inputs

RUN_ID = "golden-run"
SEGMENT_ID = "00112233445566778899aabbccddeeff"
CREATED_NS = 1_700_000_000_000_000_000
SUBMISSION_ID = "golden-submission-0001"

PAYLOAD_0 = b"hello, straw"
PAYLOAD_1 = b'{"x":[1,2,3]}'
# Non-ASCII metadata pins "UTF-8, ensure_ascii off": the body holds the raw bytes c3 af.
META_0 = {"step": 7, "lang": "naïve"}
RECORDS = (
    Record("rec-0", PAYLOAD_0, "bytes.v1", META_0, 3),
    Record("rec-1", PAYLOAD_1, "json.v1", {}, 0),
)

# The first extent of a pack starts right after the 64-byte pack header.
RECORD_0_FRAME_AT = 64
PAYLOAD_0_AT = RECORD_0_FRAME_AT + 40  # 104
RECORD_1_FRAME_AT = PAYLOAD_0_AT + len(PAYLOAD_0)  # 116
PAYLOAD_1_AT = RECORD_1_FRAME_AT + 40  # 156
INDEX_AT = PAYLOAD_1_AT + len(PAYLOAD_1)  # 169
INDEX_SIZE = 607
SEAL_AT = INDEX_AT + INDEX_SIZE  # 776

# ----------------------------------------------------------------------------- golden literals

GOLDEN_PACK_HEADER = bytes.fromhex(
    "535452575041434b"  # magic "STRWPACK"
    "0100"  # version 1
    "0000"  # flags
    "40000000"  # header length 64
    "c401ced55c4aeb5f4171c037ef3d01f1"  # run tag: xxh3-128("golden-run")
    "00112233445566778899aabbccddeeff"  # segment id
    "00002a36fe9c9717"  # created 1_700_000_000_000_000_000 ns
    "e1ba2038ba194c05"  # xxh3-64 of bytes 0..56
)
GOLDEN_STANDALONE_PACK_HEADER = bytes.fromhex(
    "535452575041434b01000100400000"
    "00c401ced55c4aeb5f4171c037ef3d01f100112233445566778899aabbccddeeff00002a36fe9c9717"
    "4f03ca92d5785856"
)
GOLDEN_RECORD_0_HEADER = bytes.fromhex(
    "5346524d"  # magic "SFRM"
    "01"  # kind 1: record
    "000000"  # zero
    "0c00000000000000"  # body length 12
    "6413ee80aff4f058b162366cc5a8b323"  # xxh3-128 of the payload
    "6ba287fee733bebe"  # xxh3-64 of bytes 0..32
)
GOLDEN_RECORD_1_HEADER = bytes.fromhex(
    "5346524d010000000d000000000000008fd96d51e485fc8eebc3bbabefc53e52f211d3ca7d1b39e9"
)
GOLDEN_INDEX_HEADER = bytes.fromhex(
    "5346524d"  # magic
    "02"  # kind 2: index
    "000000"  # zero
    "3702000000000000"  # body length 567
    "a070ddd36804fbec3591aed5748c5954"  # xxh3-128 of the body
    "92eec4fc8f98cf96"  # xxh3-64 of bytes 0..32
)
GOLDEN_INDEX_BODY = (
    b'{"chunk":262144,"records":['
    b'{"chunks":"2075a7e39c9cac58","codec":"bytes.v1","hash":"6413ee80aff4f058b162366cc5a8b323",'
    b'"id":"rec-0","len":12,"meta":{"lang":"na\xc3\xafve","step":7},"off":104,"tokens":3},'
    b'{"chunks":"567f7d8fa546dbdf","codec":"json.v1","hash":"8fd96d51e485fc8eebc3bbabefc53e52",'
    b'"id":"rec-1","len":13,"meta":{},"off":156,"tokens":0},'
    b'{"codec":"straw.manifest.v1","id":"manifest-0","inline":{"deps":[],'
    b'"digest":"89cc043494fddc4963d1152080989733d27481b052bf3227444a17fd19ae5a0a",'
    b'"records":[[-1,0],[-1,1]],"segments":[],"v":1}}],'
    b'"sub":"golden-submission-0001","v":1}'
)
GOLDEN_INDEX_CHECKSUM = "a070ddd36804fbec3591aed5748c5954"
GOLDEN_SEAL_FRAME = (
    bytes.fromhex("5346524d030000001d00000000000000937bb8d574169302920a717c55fe9f1066bee7872599a234")
    + b'{"end":776,"extents":1,"v":1}'
)
GOLDEN_DIGEST = "89cc043494fddc4963d1152080989733d27481b052bf3227444a17fd19ae5a0a"
GOLDEN_DIGEST_WITH_DEPS = "81c3c0b4c1220bd6c52b839908f2cf6d294690cbe4ce09da7eb1a0e2eb9bc964"
DEPENDENCY_DIGESTS = ("ab" * 32, "cd" * 32)
# 600 KiB with a period (251) that does not divide the chunk size, so all chunks differ.
CHUNKED_PAYLOAD = (bytes(range(251)) * 2448)[: 600 * 1024]
GOLDEN_CHUNK_TABLE = "19e33139f55349301b3b3cd5e2281684ede3dc1d8deb07bc"

# FORMAT.md 2.1 and 2.2 as struct layouts, trailing checksum included.
PACK_HEADER_LAYOUT = struct.Struct("<8sHHI16s16sQ8s")
FRAME_HEADER_LAYOUT = struct.Struct("<4sB3sQ16s8s")


# ----------------------------------------------------------------------------- helpers


def _canonical(value: Any) -> bytes:
    """FORMAT.md's canonical JSON, written out with the standard library only."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return text.encode("utf-8")


def _xxh3_64_be(data: bytes) -> bytes:
    return xxhash.xxh3_64_intdigest(data).to_bytes(8, "big")


def _xxh3_128_be(data: bytes) -> bytes:
    return xxhash.xxh3_128_intdigest(data).to_bytes(16, "big")


def _chunk_table(payload: bytes, chunk: int) -> str:
    return "".join(
        f"{xxhash.xxh3_64_intdigest(payload[i : i + chunk]):016x}" for i in range(0, len(payload), chunk)
    )


def _index_entries() -> list[frame.IndexEntry]:
    out = []
    for record, offset in zip(RECORDS, (PAYLOAD_0_AT, PAYLOAD_1_AT), strict=True):
        payload = bytes(record.payload)
        out.append(
            frame.IndexEntry(
                record.record_id,
                record.codec,
                record.metadata,
                record.tokens,
                offset,
                len(payload),
                xxhash.xxh3_128_hexdigest(payload),
                frame.chunk_checksums(memoryview(payload)),
            )
        )
    return out


def _golden_index_value() -> dict[str, Any]:
    entries = _index_entries()
    manifest = frame.Manifest(GOLDEN_DIGEST, ((-1, 0), (-1, 1)), (), ())
    entries.append(frame.inline_entry("manifest-0", frame.manifest_body(manifest)))
    return frame.index_body(SUBMISSION_ID, entries)


def _doc_section(title: str) -> str:
    text = FORMAT_MD.read_text(encoding="utf-8")
    start = text.index(title)
    end = text.find("\n#", start + len(title))
    return text[start : end if end >= 0 else len(text)]


def _doc_table(title: str) -> list[tuple[int, int, str]]:
    rows = re.findall(r"^\| (\d+) \| (\d+) \| (.+) \|$", _doc_section(title), flags=re.MULTILINE)
    return [(int(offset), int(size), field) for offset, size, field in rows]


# ----------------------------------------------------------------------------- pack header


def test_pack_header_matches_golden_bytes() -> None:
    assert frame.encode_pack_header(RUN_ID, SEGMENT_ID, CREATED_NS) == GOLDEN_PACK_HEADER
    assert (
        frame.encode_pack_header(RUN_ID, SEGMENT_ID, CREATED_NS, frame.FLAG_STANDALONE)
        == GOLDEN_STANDALONE_PACK_HEADER
    )


def test_pack_header_fields_follow_format_md() -> None:
    assert len(GOLDEN_PACK_HEADER) == 64
    magic, version, flags, length, tag, segment, created, check = PACK_HEADER_LAYOUT.unpack(
        GOLDEN_PACK_HEADER
    )
    assert magic == b"STRWPACK"
    assert version == 1
    assert flags == 0
    assert length == 64
    assert tag == _xxh3_128_be(RUN_ID.encode("utf-8"))
    assert tag == xxhash.xxh3_128_digest(b"golden-run")
    assert segment == bytes.fromhex(SEGMENT_ID)
    assert created == CREATED_NS
    assert GOLDEN_PACK_HEADER[48:56] == CREATED_NS.to_bytes(8, "little")
    assert check == _xxh3_64_be(GOLDEN_PACK_HEADER[:56])
    # Standalone: only bit 0 of the flags and the checksum differ.
    standalone = PACK_HEADER_LAYOUT.unpack(GOLDEN_STANDALONE_PACK_HEADER)
    assert standalone[2] == 1
    assert GOLDEN_STANDALONE_PACK_HEADER[:10] == GOLDEN_PACK_HEADER[:10]
    assert GOLDEN_STANDALONE_PACK_HEADER[12:56] == GOLDEN_PACK_HEADER[12:56]
    assert standalone[7] == _xxh3_64_be(GOLDEN_STANDALONE_PACK_HEADER[:56])


def test_pack_header_decodes_to_its_fields() -> None:
    header = frame.decode_pack_header(GOLDEN_PACK_HEADER)
    assert header == frame.PackHeader(1, 0, _xxh3_128_be(b"golden-run"), SEGMENT_ID, CREATED_NS)
    assert header.run_tag == frame.run_tag(RUN_ID)


# ----------------------------------------------------------------------------- frame headers


def test_record_frame_headers_match_golden_bytes() -> None:
    for payload, golden in ((PAYLOAD_0, GOLDEN_RECORD_0_HEADER), (PAYLOAD_1, GOLDEN_RECORD_1_HEADER)):
        encoded = frame.encode_frame_header(
            frame.KIND_RECORD, len(payload), xxhash.xxh3_128_hexdigest(payload)
        )
        assert encoded == golden


@pytest.mark.parametrize(
    ("golden", "kind", "body"),
    [
        (GOLDEN_RECORD_0_HEADER, 1, PAYLOAD_0),
        (GOLDEN_RECORD_1_HEADER, 1, PAYLOAD_1),
        (GOLDEN_INDEX_HEADER, 2, GOLDEN_INDEX_BODY),
        (GOLDEN_SEAL_FRAME[:40], 3, GOLDEN_SEAL_FRAME[40:]),
    ],
)
def test_frame_header_fields_follow_format_md(golden: bytes, kind: int, body: bytes) -> None:
    assert len(golden) == 40
    magic, got_kind, zero, length, body_digest, check = FRAME_HEADER_LAYOUT.unpack(golden)
    assert magic == b"SFRM"
    assert got_kind == kind
    assert zero == b"\x00\x00\x00"
    assert length == len(body)
    assert golden[8:16] == len(body).to_bytes(8, "little")
    assert body_digest == _xxh3_128_be(body)
    assert check == _xxh3_64_be(golden[:32])
    header = frame.decode_frame_header(golden)
    assert header == frame.FrameHeader(kind, len(body), xxhash.xxh3_128_hexdigest(body))


# ----------------------------------------------------------------------------- index frame


def test_index_frame_matches_golden_bytes() -> None:
    head, body, sum_hex = frame.encode_json_frame(frame.KIND_INDEX, _golden_index_value())
    assert head == GOLDEN_INDEX_HEADER
    assert body == GOLDEN_INDEX_BODY
    assert sum_hex == GOLDEN_INDEX_CHECKSUM
    assert len(head) + len(body) == INDEX_SIZE


def test_index_body_fields_follow_format_md() -> None:
    # Canonical JSON: UTF-8, sorted keys, compact separators, no escapes of non-ASCII text.
    assert _canonical(json.loads(GOLDEN_INDEX_BODY)) == GOLDEN_INDEX_BODY
    assert "naïve".encode() in GOLDEN_INDEX_BODY
    assert xxhash.xxh3_128_hexdigest(GOLDEN_INDEX_BODY) == GOLDEN_INDEX_CHECKSUM
    body = json.loads(GOLDEN_INDEX_BODY)
    assert set(body) == {"v", "sub", "chunk", "records"}
    assert body["v"] == 1
    assert body["sub"] == SUBMISSION_ID
    assert body["chunk"] == 262_144
    first, second, manifest = body["records"]
    assert first == {
        "id": "rec-0",
        "codec": "bytes.v1",
        "meta": {"lang": "naïve", "step": 7},
        "tokens": 3,
        "off": PAYLOAD_0_AT,
        "len": 12,
        "hash": xxhash.xxh3_128_hexdigest(PAYLOAD_0),
        "chunks": f"{xxhash.xxh3_64_intdigest(PAYLOAD_0):016x}",
    }
    assert second == {
        "id": "rec-1",
        "codec": "json.v1",
        "meta": {},
        "tokens": 0,
        "off": PAYLOAD_1_AT,
        "len": 13,
        "hash": xxhash.xxh3_128_hexdigest(PAYLOAD_1),
        "chunks": f"{xxhash.xxh3_64_intdigest(PAYLOAD_1):016x}",
    }
    # The record frame header repeats the index: body length and content hash.
    assert GOLDEN_RECORD_0_HEADER[16:32].hex() == first["hash"]
    assert GOLDEN_RECORD_1_HEADER[16:32].hex() == second["hash"]
    assert manifest == {
        "id": "manifest-0",
        "codec": "straw.manifest.v1",
        "inline": {
            "v": 1,
            "digest": GOLDEN_DIGEST,
            "records": [[-1, 0], [-1, 1]],
            "segments": [],
            "deps": [],
        },
    }


def test_index_frame_decodes_to_its_entries() -> None:
    data = GOLDEN_INDEX_HEADER + GOLDEN_INDEX_BODY
    body = frame.decode_json_frame(data, frame.KIND_INDEX, GOLDEN_INDEX_CHECKSUM)
    index = frame.parse_index(body)
    assert index.submission_id == SUBMISSION_ID
    assert index.chunk_bytes == 262_144
    assert list(index.entries[:2]) == _index_entries()
    assert index.entries[2].inline == json.loads(GOLDEN_INDEX_BODY)["records"][2]["inline"]
    manifest = frame.parse_manifest(index.entries[2].inline)
    assert manifest == frame.Manifest(GOLDEN_DIGEST, ((-1, 0), (-1, 1)), (), ())
    with pytest.raises(CorruptData, match="does not match the reference"):
        frame.decode_json_frame(data, frame.KIND_INDEX, "0" * 32)


# ----------------------------------------------------------------------------- seal frame


def test_seal_frame_matches_golden_bytes() -> None:
    head, body, _ = frame.encode_json_frame(frame.KIND_SEAL, frame.seal_body(1, SEAL_AT))
    assert head + body == GOLDEN_SEAL_FRAME


def test_seal_frame_fields_follow_format_md() -> None:
    body = GOLDEN_SEAL_FRAME[40:]
    assert json.loads(body) == {"v": 1, "extents": 1, "end": SEAL_AT}
    assert _canonical(json.loads(body)) == body
    assert frame.parse_seal(frame.decode_json_frame(GOLDEN_SEAL_FRAME, frame.KIND_SEAL, None)) == (1, SEAL_AT)


# ----------------------------------------------------------------------------- digests and chunks


def _format_md_digest(records: list[list[Any]], deps: list[str]) -> str:
    """FORMAT.md section 4 written out independently of straw."""
    return hashlib.sha256(_canonical({"v": 1, "records": records, "deps": deps})).hexdigest()


def test_logical_digest_matches_golden() -> None:
    rows = [
        [r.record_id, r.codec, r.metadata, r.tokens, len(r.payload), xxhash.xxh3_128_hexdigest(r.payload)]
        for r in RECORDS
    ]
    assert logical_digest(_index_entries(), []) == GOLDEN_DIGEST
    assert _format_md_digest(rows, []) == GOLDEN_DIGEST
    assert logical_digest(_index_entries(), DEPENDENCY_DIGESTS) == GOLDEN_DIGEST_WITH_DEPS
    assert _format_md_digest(rows, list(DEPENDENCY_DIGESTS)) == GOLDEN_DIGEST_WITH_DEPS
    # Layout-independent: other offsets give the same digest, other order does not.
    moved = [frame.IndexEntry(**{**vars(e), "offset": e.offset + 4096}) for e in _index_entries()]
    assert logical_digest(moved, []) == GOLDEN_DIGEST
    assert logical_digest(_index_entries()[::-1], []) != GOLDEN_DIGEST


def test_chunk_table_matches_golden() -> None:
    assert len(CHUNKED_PAYLOAD) == 600 * 1024
    table = frame.chunk_checksums(memoryview(CHUNKED_PAYLOAD))
    assert table == GOLDEN_CHUNK_TABLE
    assert frame.chunk_count(len(CHUNKED_PAYLOAD), 262_144) == 3
    assert len(table) == 16 * math.ceil(len(CHUNKED_PAYLOAD) / 262_144) == 48
    assert table == _chunk_table(CHUNKED_PAYLOAD, 262_144)
    # The last chunk is the short one (88 KiB).
    assert table[32:] == f"{xxhash.xxh3_64_intdigest(CHUNKED_PAYLOAD[512 * 1024 :]):016x}"
    assert frame.chunk_checksums(memoryview(b"")) == ""


# ----------------------------------------------------------------------------- the document itself


def test_doc_pack_header_table_matches_golden_layout() -> None:
    rows = _doc_table("### 2.1 Pack header (64 bytes)")
    assert [(o, s) for o, s, _ in rows] == [
        (0, 8),
        (8, 2),
        (10, 2),
        (12, 4),
        (16, 16),
        (32, 16),
        (48, 8),
        (56, 8),
    ]
    fields = [f for _, _, f in rows]
    for field, words in zip(
        fields,
        (
            ["`STRWPACK`"],
            ["version", "`1`"],
            ["flags", "bit 0 = standalone"],
            ["header length", "`64`"],
            ["run tag", "xxh3-128", "big-endian", "run id in UTF-8"],
            ["segment id"],
            ["creation time", "nanoseconds"],
            ["xxh3-64", "big-endian", "bytes 0..56"],
        ),
        strict=True,
    ):
        for word in words:
            assert word in field, (word, field)
    assert "All integers are little-endian" in FORMAT_MD.read_text(encoding="utf-8")


def test_doc_frame_header_table_matches_golden_layout() -> None:
    rows = _doc_table("### 2.2 Frame header (40 bytes)")
    assert [(o, s) for o, s, _ in rows] == [(0, 4), (4, 1), (5, 3), (8, 8), (16, 16), (32, 8)]
    fields = [f for _, _, f in rows]
    for field, words in zip(
        fields,
        (
            ["`SFRM`"],
            ["1 record", "2 index", "3 seal"],
            ["zero"],
            ["body length"],
            ["xxh3-128", "body", "big-endian"],
            ["xxh3-64", "bytes 0..32"],
        ),
        strict=True,
    ):
        for word in words:
            assert word in field, (word, field)


def test_doc_index_seal_and_digest_shapes_match_golden_bodies() -> None:
    index = _doc_section("### 2.4 Index frame (kind 2)")
    assert '{"v": 1, "sub": <submission id>, "chunk": <chunk bytes>, "records": [<entry>, ...]}' in index
    for key in ('"id": str', '"codec": str', '"meta": {...}', '"tokens": int', '"off"', '"len"', '"hash"'):
        assert key in index
    assert '"chunks": <chunk table>' in index
    assert '{"id": str, "codec": "straw.manifest.v1", "inline": <manifest object>}' in index
    assert "262,144" in index
    seal = _doc_section("### 2.5 Seal frame (kind 3)")
    assert '{"v": 1, "extents": <count>, "end": <offset of the seal frame>}' in seal
    manifests = _doc_section("## 3. Manifests")
    assert '"records": [[<segment index>, <ordinal>], ...]' in manifests
    digest = _doc_section("## 4. Logical digest")
    assert '"records": [[id, codec, metadata, tokens, len, content hash], ...]' in digest
    assert "sha256_hex" in digest


# ----------------------------------------------------------------------------- limits on read


@pytest.mark.parametrize(
    "field",
    [
        {"id": "x" * (RECORD_ID_BYTES_MAX + 1)},
        {"codec": "c" * (CODEC_NAME_BYTES_MAX + 1)},
        {"meta": {"blob": "m" * METADATA_BYTES_MAX}},
        {"tokens": TOKENS_MAX + 1},
    ],
    ids=["id", "codec", "meta", "tokens"],
)
def test_reader_rejects_index_fields_beyond_writer_limits(field: dict[str, Any]) -> None:
    body = json.loads(GOLDEN_INDEX_BODY)
    body["records"][0].update(field)
    with pytest.raises(CorruptData):
        frame.parse_index(body)


# ----------------------------------------------------------------------------- end to end


def _parse_pack(data: bytes) -> tuple[tuple[Any, ...], list[tuple[int, int, bytes]]]:
    """Read a whole pack with struct/xxhash per FORMAT.md 2.1-2.2: header fields and (offset, kind, body)."""
    header = PACK_HEADER_LAYOUT.unpack(data[:64])
    assert header[0] == b"STRWPACK" and header[1] == 1 and header[3] == 64
    assert header[7] == _xxh3_64_be(data[:56])
    frames = []
    position = 64
    while position < len(data):
        magic, kind, zero, length, body_digest, check = FRAME_HEADER_LAYOUT.unpack(
            data[position : position + 40]
        )
        assert (magic, zero) == (b"SFRM", b"\x00\x00\x00")
        assert check == _xxh3_64_be(data[position : position + 32])
        body = data[position + 40 : position + 40 + length]
        assert len(body) == length
        assert body_digest == _xxh3_128_be(body)
        frames.append((position, kind, body))
        position += 40 + length
    assert position == len(data)
    return header, frames


def _check_extent(data: bytes, frames: list[tuple[int, int, bytes]], index_at: int) -> dict[str, Any]:
    """Check one extent's index against its record frames, chunk tables and manifests (FORMAT.md 2.3-4)."""
    by_offset = {offset: (kind, body) for offset, kind, body in frames}
    kind, raw = by_offset[index_at]
    assert kind == 2
    index = json.loads(raw)
    assert _canonical(index) == raw
    assert index["v"] == 1 and index["chunk"] > 0 and index["chunk"] % 4096 == 0
    rows = []
    for entry in index["records"]:
        if "inline" in entry:
            assert entry["codec"] == "straw.manifest.v1"
            rows.append(None)
            continue
        payload = data[entry["off"] : entry["off"] + entry["len"]]
        # The payload is the body of the record frame that starts 40 bytes before it.
        assert by_offset[entry["off"] - 40] == (1, payload)
        assert entry["hash"] == xxhash.xxh3_128_hexdigest(payload)
        assert entry["chunks"] == _chunk_table(payload, index["chunk"])
        assert len(entry["chunks"]) == 16 * math.ceil(entry["len"] / index["chunk"])
        rows.append(
            [entry["id"], entry["codec"], entry["meta"], entry["tokens"], entry["len"], entry["hash"]]
        )
    for entry in index["records"]:
        if "inline" in entry:
            manifest = entry["inline"]
            assert manifest["segments"] == []
            named = [rows[ordinal] for segment, ordinal in manifest["records"]]
            assert all(segment == -1 for segment, _ in manifest["records"])
            deps = [d["digest"] for d in manifest["deps"]]
            assert manifest["digest"] == _format_md_digest(named, deps)
    return index


def _pack_file(pool: Path, suffix: str) -> Path:
    (path,) = pool.glob(f"raw/*/*{suffix}")
    assert re.fullmatch(r"[0-9a-f]{32}", path.parent.name) and re.fullmatch(r"[0-9a-f]{32}", path.stem)
    return path


def test_published_pack_is_readable_from_format_md_alone(tmp_path: Path) -> None:
    pool = tmp_path / "pool"
    store = SharedFilesystemStore(pool, RUN_ID, backend=FilesystemBackend(pool, sleep=lambda _: None))
    ref = store.publish(list(RECORDS), submission_id=SUBMISSION_ID)
    store.close()
    assert (pool / "straw-pool.json").read_bytes() == b'{"format":"straw-pool","version":1}'
    path = _pack_file(pool, ".pack")
    data = path.read_bytes()

    header, frames = _parse_pack(data)
    _, _, flags, _, tag, segment, created, _ = header
    assert flags == 0
    assert tag == _xxh3_128_be(RUN_ID.encode("utf-8"))
    assert segment.hex() == path.stem
    assert created > 0
    assert [(offset, kind) for offset, kind, _ in frames] == [
        (RECORD_0_FRAME_AT, 1),
        (RECORD_1_FRAME_AT, 1),
        (INDEX_AT, 2),
        (SEAL_AT, 3),
    ]
    index = _check_extent(data, frames, INDEX_AT)
    assert index["sub"] == SUBMISSION_ID
    # Everything after the (random) segment id and time is the golden extent and seal.
    golden = (
        GOLDEN_RECORD_0_HEADER
        + PAYLOAD_0
        + GOLDEN_RECORD_1_HEADER
        + PAYLOAD_1
        + GOLDEN_INDEX_HEADER
        + GOLDEN_INDEX_BODY
        + GOLDEN_SEAL_FRAME
    )
    assert data[64:] == golden
    assert json.loads(frames[3][2]) == {"v": 1, "extents": 1, "end": SEAL_AT}

    # The reference names the index frame: offset, total size, body checksum.
    segment_ref = ref.manifest.segment
    assert segment_ref.path == path.relative_to(pool).as_posix()
    assert segment_ref.segment_id == path.stem
    assert segment_ref.run_id == RUN_ID
    assert (segment_ref.offset, segment_ref.size) == (INDEX_AT, INDEX_SIZE)
    assert segment_ref.checksum == xxhash.xxh3_128_hexdigest(data[INDEX_AT + 40 : INDEX_AT + INDEX_SIZE])
    assert segment_ref.checksum == GOLDEN_INDEX_CHECKSUM
    assert (segment_ref.checksum_algorithm, segment_ref.version) == ("xxh3-128", 1)
    assert ref.manifest.ordinal == 2
    assert index["records"][2]["inline"]["digest"] == ref.digest == GOLDEN_DIGEST
    assert (ref.records, ref.payload_bytes, ref.tokens) == (2, len(PAYLOAD_0) + len(PAYLOAD_1), 3)


def test_standalone_file_is_readable_from_format_md_alone(tmp_path: Path) -> None:
    pool = tmp_path / "pool"
    store = SharedFilesystemStore(
        pool, RUN_ID, backend=FilesystemBackend(pool, sleep=lambda _: None), segment_target_bytes=0
    )
    big = Record("big", CHUNKED_PAYLOAD, "bytes.v1", {"n": 1}, 5)
    empty = Record("empty", b"", "bytes.v1", {}, 0)
    first, second = store.publish_many(
        [Publication((big,)), Publication((empty,), (0,))], submission_id="standalone-1"
    )
    store.close()
    path = _pack_file(pool, ".seg")
    data = path.read_bytes()
    header, frames = _parse_pack(data)
    assert header[2] == 1  # flags bit 0: standalone
    assert header[5].hex() == path.stem
    assert [kind for _, kind, _ in frames] == [1, 1, 2, 3]
    index_at = frames[2][0]
    index = _check_extent(data, frames, index_at)
    assert [e["id"] for e in index["records"]] == ["big", "manifest-0", "empty", "manifest-1"]
    assert index["records"][0]["chunks"] == GOLDEN_CHUNK_TABLE
    assert index["records"][2]["chunks"] == ""
    dependency = index["records"][3]["inline"]["deps"]
    assert dependency == [
        {"digest": first.digest, "self": 1, "records": 1, "payload_bytes": len(CHUNKED_PAYLOAD), "tokens": 5}
    ]
    assert json.loads(frames[3][2]) == {"v": 1, "extents": 1, "end": frames[3][0]}
    for ref in (first, second):
        assert (ref.manifest.segment.offset, ref.manifest.segment.size) == (index_at, 40 + len(frames[2][2]))
        assert ref.manifest.segment.checksum == xxhash.xxh3_128_hexdigest(frames[2][2])
    assert (first.manifest.ordinal, second.manifest.ordinal) == (1, 3)
