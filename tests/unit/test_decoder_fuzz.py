"""Every decoder of straw's bytes meets arbitrary input with CorruptData or UnsupportedSchema only.

FORMAT.md and STYLE.md habit 9: the decoders (``straw.protocol.decode`` and
the ``decode_*``/``parse_*`` functions of ``straw._pack.frame``) are fed
arbitrary bytes, frames with valid checksums around arbitrary bodies, arbitrary
JSON values and mutations of valid bodies. Any other exception (KeyError,
TypeError, ValueError, IndexError, RecursionError, ...) is a bug. Exhaustive
truncations and single bit flips of valid encodings must be rejected or decode
to exactly the original value: a damaged byte never yields a different value.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import pytest
import xxhash
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from straw._pack import frame
from straw.errors import CorruptData, UnsupportedSchema
from straw.protocol import decode, encode

ALLOWED = (CorruptData, UnsupportedSchema)
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

RUN_ID = "fuzz-run"
SEGMENT_ID = "00112233445566778899aabbccddeeff"
CREATED_NS = 1_700_000_000_000_000_000

# Keys of every body straw writes, so that generated objects often look almost valid.
KNOWN_KEYS = [
    "v",
    "sub",
    "chunk",
    "records",
    "id",
    "codec",
    "meta",
    "tokens",
    "off",
    "len",
    "hash",
    "chunks",
    "inline",
    "digest",
    "segments",
    "deps",
    "extents",
    "end",
    "self",
    "ref",
]
SPECIAL_INTS = [-(2**63), -2, -1, 0, 1, 2, 4095, 4096, 262_144, 2**62, 2**62 + 1, 2**63, 2**64]
SPECIAL_TEXT = [
    "",
    "0" * 16,
    "a" * 32,
    "0123456789abcdef" * 2,
    "straw.manifest.v1",
    "bytes.v1",
    "\x00",
]

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.sampled_from(SPECIAL_INTS)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=40)
    | st.sampled_from(SPECIAL_TEXT)
)
json_keys = st.sampled_from(KNOWN_KEYS) | st.text(max_size=8)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(json_keys, inner, max_size=6),
    max_leaves=25,
)


@st.composite
def mutated(draw: st.DrawFn, value: Any, depth: int = 0) -> Any:
    """``value`` with one random structural change somewhere inside (replace, delete, insert)."""
    containers = isinstance(value, (dict, list)) and len(value) > 0
    if depth > 6 or not containers or draw(st.integers(0, 4)) == 0:
        return draw(json_values)
    value = copy.copy(value)
    if isinstance(value, dict):
        key = draw(st.sampled_from(sorted(value)))
        action = draw(st.sampled_from(["descend", "delete", "add"]))
        if action == "delete":
            del value[key]
        elif action == "add":
            value[draw(json_keys)] = draw(json_values)
        else:
            value[key] = draw(mutated(value[key], depth + 1))
        return value
    position = draw(st.integers(0, len(value) - 1))
    action = draw(st.sampled_from(["descend", "delete", "insert"]))
    if action == "delete":
        del value[position]
    elif action == "insert":
        value.insert(position, draw(json_values))
    else:
        value[position] = draw(mutated(value[position], depth + 1))
    return value


# ----------------------------------------------------------------------------- valid encodings


def _payload_entry(record_id: str, payload: bytes, offset: int) -> frame.IndexEntry:
    view = memoryview(payload)
    return frame.IndexEntry(
        record_id,
        "bytes.v1",
        {"step": 1, "tag": "x"},
        7,
        offset,
        len(payload),
        xxhash.xxh3_128_hexdigest(payload),
        frame.chunk_checksums(view),
    )


MANIFEST = frame.Manifest(
    "ab" * 32,
    ((-1, 0), (-1, 1), (0, 4)),
    (
        {
            "run_id": RUN_ID,
            "path": f"raw/{'1' * 32}/{SEGMENT_ID}.pack",
            "segment_id": SEGMENT_ID,
            "size": 100,
            "checksum": "c" * 32,
            "version": 1,
            "checksum_algorithm": "xxh3-128",
            "offset": 64,
        },
    ),
    ({"digest": "cd" * 32, "self": 2, "records": 1, "payload_bytes": 3, "tokens": 0},),
)
INDEX_VALUE = frame.index_body(
    "sub-1",
    [
        _payload_entry("a", b"hello", 104),
        _payload_entry("b", b"", 149),
        frame.inline_entry("manifest-0", frame.manifest_body(MANIFEST)),
    ],
)
SEAL_VALUE = frame.seal_body(3, 4096)
INDEX_HEAD, INDEX_BODY, INDEX_SUM = frame.encode_json_frame(frame.KIND_INDEX, INDEX_VALUE)
INDEX_FRAME = INDEX_HEAD + INDEX_BODY
SEAL_HEAD, SEAL_BODY, SEAL_SUM = frame.encode_json_frame(frame.KIND_SEAL, SEAL_VALUE)
SEAL_FRAME = SEAL_HEAD + SEAL_BODY
PACK_HEADER = frame.encode_pack_header(RUN_ID, SEGMENT_ID, CREATED_NS)
RECORD_HEADER = frame.encode_frame_header(frame.KIND_RECORD, 5, xxhash.xxh3_128_hexdigest(b"hello"))


def _outcome(decoder: Callable[[], Any]) -> Any:
    """Run a decoder: its value, or the allowed exception it raised. Anything else propagates."""
    try:
        return decoder()
    except ALLOWED as error:
        return error


def _with_header_checksum(head: bytes) -> bytes:
    return head + xxhash.xxh3_64_digest(head)


def _frame_around(kind: int, body: bytes) -> bytes:
    return frame.encode_frame_header(kind, len(body), xxhash.xxh3_128_hexdigest(body)) + body


# ----------------------------------------------------------------------------- protocol.decode


@FUZZ
@given(st.binary(max_size=200))
@example(b"[" * 100_000)
@example(b"NaN")
@example(b"-Infinity")
@example(b"\xff\xfe")
@example(b'"\\ud800"')
@example(b"[1e400]")
def test_protocol_decode_raises_only_corrupt_data_on_bytes(data: bytes) -> None:
    _outcome(lambda: decode(data))


@FUZZ
@given(json_values, st.integers(0, 2**32), st.integers(0, 255))
def test_protocol_decode_raises_only_corrupt_data_on_damaged_json(value: Any, where: int, byte: int) -> None:
    data = bytearray(encode(value))
    assert decode(bytes(data)) == value
    if data:
        data[where % len(data)] = byte
    _outcome(lambda: decode(bytes(data)))
    _outcome(lambda: decode(bytes(data[: where % (len(data) + 1)])))


@FUZZ
@given(st.text(alphabet=st.sampled_from('[]{}",:0123456789.-+eE \\utrunlfaxN'), max_size=80))
def test_protocol_decode_raises_only_corrupt_data_on_json_like_text(text: str) -> None:
    _outcome(lambda: decode(text.encode("utf-8")))


def test_protocol_decode_rejects_huge_integer_with_corrupt_data() -> None:
    with pytest.raises(CorruptData):
        decode(b"1" * 5000)
    # The same escapes frame.decode_json_frame for a checksummed body (a crafted or buggy index).
    with pytest.raises(CorruptData):
        frame.decode_json_frame(_frame_around(frame.KIND_INDEX, b"1" * 5000), frame.KIND_INDEX, None)


def test_protocol_decode_rejects_overflowing_float_with_corrupt_data() -> None:
    # Canonical JSON has no Infinity; 1e400 would otherwise decode to float("inf").
    with pytest.raises(CorruptData, match="overflows"):
        decode(b"1e400")
    with pytest.raises(CorruptData, match="overflows"):
        decode(b'{"meta":[-1e999]}')


# ----------------------------------------------------------------------------- headers


@FUZZ
@given(st.binary(max_size=80))
def test_decode_pack_header_raises_only_allowed_errors_on_bytes(data: bytes) -> None:
    _outcome(lambda: frame.decode_pack_header(data))


@FUZZ
@given(
    st.sampled_from([frame.PACK_MAGIC, b"STRWPACX"]) | st.binary(min_size=8, max_size=8),
    st.integers(0, 2**16 - 1),
    st.integers(0, 2**16 - 1),
    st.sampled_from([64, 0, 63, 65, 2**32 - 1]) | st.integers(0, 2**32 - 1),
    st.binary(min_size=32, max_size=32),
    st.integers(0, 2**64 - 1),
)
def test_decode_pack_header_with_valid_checksum_checks_every_field(
    magic: bytes, version: int, flags: int, length: int, ids: bytes, created: int
) -> None:
    head = frame.PACK_HEADER.pack(magic, version, flags, length, ids[:16], ids[16:], created)
    result = _outcome(lambda: frame.decode_pack_header(_with_header_checksum(head)))
    if isinstance(result, frame.PackHeader):
        assert (magic, version, length) == (frame.PACK_MAGIC, 1, 64)
        assert result == frame.PackHeader(version, flags, ids[:16], ids[16:].hex(), created)
    elif magic == frame.PACK_MAGIC and version != 1:
        assert isinstance(result, UnsupportedSchema)
    else:
        assert isinstance(result, CorruptData)


@FUZZ
@given(st.binary(max_size=60))
def test_decode_frame_header_raises_only_allowed_errors_on_bytes(data: bytes) -> None:
    _outcome(lambda: frame.decode_frame_header(data))


@FUZZ
@given(
    st.sampled_from([frame.FRAME_MAGIC, b"SFRN"]) | st.binary(min_size=4, max_size=4),
    st.integers(0, 255),
    st.binary(min_size=3, max_size=3),
    st.sampled_from([0, 2**62, 2**62 + 1, 2**64 - 1]) | st.integers(0, 2**64 - 1),
    st.binary(min_size=16, max_size=16),
)
def test_decode_frame_header_with_valid_checksum_checks_every_field(
    magic: bytes, kind: int, reserved: bytes, length: int, body_sum: bytes
) -> None:
    head = magic + bytes([kind]) + reserved + length.to_bytes(8, "little") + body_sum
    result = _outcome(lambda: frame.decode_frame_header(_with_header_checksum(head)))
    if isinstance(result, frame.FrameHeader):
        assert magic == frame.FRAME_MAGIC and kind in frame.KINDS and length <= 2**62
        assert result == frame.FrameHeader(kind, length, body_sum.hex())
    elif magic == frame.FRAME_MAGIC and kind not in frame.KINDS:
        assert isinstance(result, UnsupportedSchema)
    else:
        assert isinstance(result, CorruptData)


# ----------------------------------------------------------------------------- JSON frames

expected_checksums = st.none() | st.sampled_from([INDEX_SUM, SEAL_SUM]) | st.text(max_size=40)


@FUZZ
@given(st.binary(max_size=120), st.sampled_from([frame.KIND_INDEX, frame.KIND_SEAL]), expected_checksums)
def test_decode_json_frame_raises_only_allowed_errors_on_bytes(
    data: bytes, kind: int, expected: str | None
) -> None:
    _outcome(lambda: frame.decode_json_frame(data, kind, expected))


@FUZZ
@given(
    st.binary(max_size=120) | json_values.map(encode),
    st.sampled_from(frame.KINDS),
    st.sampled_from([frame.KIND_INDEX, frame.KIND_SEAL]),
    st.booleans(),
    expected_checksums,
)
def test_decode_json_frame_raises_only_allowed_errors_on_checksummed_bodies(
    body: bytes, written_kind: int, kind: int, use_true_checksum: bool, expected: str | None
) -> None:
    data = _frame_around(written_kind, body)
    if use_true_checksum:
        expected = xxhash.xxh3_128_hexdigest(body)
    result = _outcome(lambda: frame.decode_json_frame(data, kind, expected))
    if not isinstance(result, Exception):
        assert written_kind == kind
        assert expected is None or expected == xxhash.xxh3_128_hexdigest(body)
        assert result == json.loads(body.decode("utf-8"))


@FUZZ
@given(json_values)
def test_decode_json_frame_returns_any_checksummed_json_value(value: Any) -> None:
    data = _frame_around(frame.KIND_SEAL, encode(value))
    assert frame.decode_json_frame(data, frame.KIND_SEAL, xxhash.xxh3_128_hexdigest(encode(value))) == value


# ----------------------------------------------------------------------------- parse_*

PARSERS: dict[str, tuple[Callable[[object], Any], Any]] = {
    "index": (frame.parse_index, INDEX_VALUE),
    "manifest": (frame.parse_manifest, frame.manifest_body(MANIFEST)),
    "seal": (frame.parse_seal, SEAL_VALUE),
}


def _check_parsed(name: str, result: Any) -> None:
    """A value a parser accepted has the types its callers rely on."""
    if name == "index":
        assert isinstance(result.submission_id, str) and isinstance(result.chunk_bytes, int)
        for e in result.entries:
            assert isinstance(e.record_id, str) and isinstance(e.codec, str)
            if e.inline is None:
                assert isinstance(e.metadata, dict) and min(e.tokens, e.offset, e.length) >= 0
                assert len(e.chunks) == 16 * frame.chunk_count(e.length, result.chunk_bytes)
                assert len(e.content) == 32
            else:
                assert isinstance(e.inline, dict) and e.codec == frame.MANIFEST_CODEC
    elif name == "manifest":
        assert isinstance(result.digest, str)
        assert all(-1 <= s < len(result.segments) and o >= 0 for s, o in result.records)
        assert all(isinstance(s, dict) for s in result.segments + result.dependencies)
    else:
        assert all(type(x) is int for x in result)


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_parsers_accept_the_valid_bodies(name: str) -> None:
    parse, body = PARSERS[name]
    _check_parsed(name, parse(json.loads(encode(body))))


@pytest.mark.parametrize("name", sorted(PARSERS))
@FUZZ
@given(value=json_values)
def test_parsers_raise_only_allowed_errors_on_any_json_value(name: str, value: Any) -> None:
    parse, _ = PARSERS[name]
    result = _outcome(lambda: parse(value))
    if not isinstance(result, Exception):
        _check_parsed(name, result)


@pytest.mark.parametrize("name", sorted(PARSERS))
@FUZZ
@given(data=st.data())
def test_parsers_raise_only_allowed_errors_on_mutated_valid_bodies(name: str, data: st.DataObject) -> None:
    parse, body = PARSERS[name]
    value = data.draw(mutated(json.loads(encode(body))))
    if name == "index" and data.draw(st.booleans()):
        # Also reach inside the inline manifest through the parser that reads it.
        inline = data.draw(mutated(json.loads(encode(frame.manifest_body(MANIFEST)))))
        value = copy.deepcopy(INDEX_VALUE)
        value["records"][2]["inline"] = inline
        _outcome(lambda: frame.parse_manifest(inline))
    result = _outcome(lambda: parse(value))
    if not isinstance(result, Exception):
        _check_parsed(name, result)


@FUZZ
@given(
    st.lists(st.integers(0, 600_000), max_size=4),
    st.sampled_from([4096, 65_536, 262_144]),
    st.integers(0, 2**40),
)
def test_parse_index_accepts_every_well_formed_entry(lengths: list[int], chunk: int, offset: int) -> None:
    entries = [
        frame.IndexEntry(f"r{i}", "bytes.v1", {}, i, offset, n, "0" * 32, "0123456789abcdef" * -(-n // chunk))
        for i, n in enumerate(lengths)
    ]
    parsed = frame.parse_index(json.loads(encode(frame.index_body("s", entries, chunk))))
    assert parsed == frame.Index("s", chunk, tuple(entries))


# ----------------------------------------------------------------------------- damaged valid encodings


def _flips(data: bytes) -> list[bytes]:
    out = []
    for position in range(len(data)):
        for bit in range(8):
            damaged = bytearray(data)
            damaged[position] ^= 1 << bit
            out.append(bytes(damaged))
    return out


def _damaged_versions(data: bytes) -> list[bytes]:
    """Every truncation, every single bit flip and one appended byte."""
    return [data[:n] for n in range(len(data))] + _flips(data) + [data + b"\x00"]


def _decode_index_frame(data: bytes, expected: str | None) -> frame.Index:
    return frame.parse_index(frame.decode_json_frame(data, frame.KIND_INDEX, expected))


def _decode_seal_frame(data: bytes, expected: str | None) -> tuple[int, int]:
    return frame.parse_seal(frame.decode_json_frame(data, frame.KIND_SEAL, expected))


def test_damaged_pack_header_is_rejected_or_identical() -> None:
    original = frame.decode_pack_header(PACK_HEADER)
    for damaged in _damaged_versions(PACK_HEADER):
        result = _outcome(lambda d=damaged: frame.decode_pack_header(d))
        # Only the appended byte (beyond the 64 header bytes) may decode, to the same header.
        assert isinstance(result, ALLOWED) or (result == original and damaged[:64] == PACK_HEADER)


def test_damaged_frame_headers_are_rejected_or_identical() -> None:
    for head in (RECORD_HEADER, INDEX_HEAD, SEAL_HEAD):
        original = frame.decode_frame_header(head)
        for damaged in _damaged_versions(head):
            result = _outcome(lambda d=damaged: frame.decode_frame_header(d))
            assert isinstance(result, ALLOWED) or (result == original and damaged[:40] == head)


@pytest.mark.parametrize("expected", [None, INDEX_SUM], ids=["no-reference-checksum", "reference-checksum"])
def test_damaged_index_frame_is_rejected(expected: str | None) -> None:
    original = _decode_index_frame(INDEX_FRAME, expected)
    assert original == frame.parse_index(INDEX_VALUE)
    for damaged in _damaged_versions(INDEX_FRAME):
        result = _outcome(lambda d=damaged: _decode_index_frame(d, expected))
        assert isinstance(result, CorruptData), (len(damaged), result)


def test_damaged_seal_frame_is_rejected() -> None:
    assert _decode_seal_frame(SEAL_FRAME, SEAL_SUM) == (3, 4096)
    for damaged in _damaged_versions(SEAL_FRAME):
        result = _outcome(lambda d=damaged: _decode_seal_frame(d, None))
        assert isinstance(result, CorruptData), (len(damaged), result)


def test_frame_of_one_kind_is_not_read_as_another() -> None:
    with pytest.raises(CorruptData, match="kind 3 where kind 2 was expected"):
        frame.decode_json_frame(SEAL_FRAME, frame.KIND_INDEX, None)
    with pytest.raises(CorruptData, match="kind 2 where kind 3 was expected"):
        frame.decode_json_frame(INDEX_FRAME, frame.KIND_SEAL, None)
