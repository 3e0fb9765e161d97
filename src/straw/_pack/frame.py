"""Pure encoders and decoders of pack bytes (docs/FORMAT.md). No I/O.

Every decoder accepts arbitrary bytes and raises only ``CorruptData`` or
``UnsupportedSchema``; a fuzz test holds it to that.
"""

from __future__ import annotations

import functools
import json
import re
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

from ..errors import CorruptData, UnsupportedSchema, invariant
from ..limits import (
    CHUNK_BYTES,
    CODEC_NAME_BYTES_MAX,
    INDEX_BYTES_MAX,
    METADATA_BYTES_MAX,
    METADATA_ROW_TEXT_CACHED_MAX,
    METADATA_ROWS_CACHED,
    PACK_BYTES_MAX,
    RECORD_ID_BYTES_MAX,
    RECORDS_PER_WRITE_MAX,
    SUBMISSION_ID_BYTES_MAX,
    TOKENS_MAX,
)
from ..protocol import decode, encode, encode_plain, encode_text, quote

FORMAT_VERSION = 1
PACK_MAGIC = b"STRWPACK"
PACK_HEADER = struct.Struct("<8sHHI16s16sQ")  # + xxh3_64 of these 56 bytes
PACK_HEADER_BYTES = PACK_HEADER.size + 8
FLAG_STANDALONE = 1

FRAME_MAGIC = b"SFRM"
FRAME_HEAD = struct.Struct("<4sB3xQ16s")  # + xxh3_64 of these 32 bytes
FRAME_HEADER_BYTES = FRAME_HEAD.size + 8
KIND_RECORD = 1
KIND_INDEX = 2
KIND_SEAL = 3
KINDS = (KIND_RECORD, KIND_INDEX, KIND_SEAL)

MANIFEST_CODEC = "straw.manifest.v1"
_HEX = re.compile(r"[0-9a-f]*")
_HEX32 = re.compile(r"[0-9a-f]{32}")

invariant(PACK_HEADER_BYTES == 64, "pack header is 64 bytes")
invariant(FRAME_HEADER_BYTES == 40, "frame header is 40 bytes")


def checksum(data: Any) -> str:
    """The reference checksum of a frame body: xxh3-128, lowercase hex."""
    return xxhash.xxh3_128_hexdigest(data)


def chunk_checksums(view: memoryview, chunk: int = CHUNK_BYTES) -> str:
    """Concatenated xxh3-64 hex digests of each ``chunk``-byte slice of ``view``."""
    digest = xxhash.xxh3_64_hexdigest
    if view.nbytes <= chunk:  # most records: one chunk (or none)
        return digest(view) if view.nbytes else ""
    return "".join(digest(view[start : start + chunk]) for start in range(0, view.nbytes, chunk))


def chunk_count(length: int, chunk: int) -> int:
    return -(-length // chunk)


# --------------------------------------------------------------------------- pack header


@dataclass(frozen=True)
class PackHeader:
    version: int
    flags: int
    run_tag: bytes
    segment_id: str
    created_ns: int


def run_tag(run_id: str) -> bytes:
    return xxhash.xxh3_128_digest(run_id.encode("utf-8"))


def encode_pack_header(run_id: str, segment_id: str, created_ns: int, flags: int = 0) -> bytes:
    head = PACK_HEADER.pack(
        PACK_MAGIC,
        FORMAT_VERSION,
        flags,
        PACK_HEADER_BYTES,
        run_tag(run_id),
        bytes.fromhex(segment_id),
        created_ns,
    )
    return head + xxhash.xxh3_64_digest(head)


def decode_pack_header(data: bytes | bytearray | memoryview) -> PackHeader:
    if len(data) < PACK_HEADER_BYTES:
        raise CorruptData(f"pack header truncated: {len(data)} of {PACK_HEADER_BYTES} bytes")
    head = bytes(data[: PACK_HEADER.size])
    magic, version, flags, length, tag, segment, created = PACK_HEADER.unpack(head)
    if magic != PACK_MAGIC:
        raise CorruptData("not a straw pack (bad magic)")
    if xxhash.xxh3_64_digest(head) != bytes(data[PACK_HEADER.size : PACK_HEADER_BYTES]):
        raise CorruptData("pack header checksum mismatch")
    if version != FORMAT_VERSION:
        raise UnsupportedSchema(
            f"pack format version {version} is not supported (this straw reads {FORMAT_VERSION})"
        )
    if length != PACK_HEADER_BYTES:
        raise CorruptData(f"pack header length {length} != {PACK_HEADER_BYTES}")
    return PackHeader(version, flags, tag, segment.hex(), created)


# --------------------------------------------------------------------------- frames


@dataclass(frozen=True)
class FrameHeader:
    kind: int
    body_bytes: int
    body_checksum: str


def encode_frame_header(kind: int, body_bytes: int, body_checksum_hex: str) -> bytes:
    head = FRAME_HEAD.pack(FRAME_MAGIC, kind, body_bytes, bytes.fromhex(body_checksum_hex))
    return head + xxhash.xxh3_64_digest(head)


def decode_frame_header(data: bytes | bytearray | memoryview) -> FrameHeader:
    if len(data) < FRAME_HEADER_BYTES:
        raise CorruptData(f"frame header truncated: {len(data)} of {FRAME_HEADER_BYTES} bytes")
    head = bytes(data[: FRAME_HEAD.size])
    magic, kind, length, body_checksum = FRAME_HEAD.unpack(head)
    if magic != FRAME_MAGIC:
        raise CorruptData("bad frame magic")
    if xxhash.xxh3_64_digest(head) != bytes(data[FRAME_HEAD.size : FRAME_HEADER_BYTES]):
        raise CorruptData("frame header checksum mismatch")
    if kind not in KINDS:
        raise UnsupportedSchema(f"unknown frame kind {kind}")
    if length > PACK_BYTES_MAX:
        raise CorruptData(f"frame length {length} exceeds the pack limit")
    return FrameHeader(kind, length, body_checksum.hex())


def encode_json_frame(kind: int, value: Any) -> tuple[bytes, bytes, str]:
    """Header and body of an index or seal frame, plus the body checksum."""
    body = encode(value)
    sum_hex = checksum(body)
    return encode_frame_header(kind, len(body), sum_hex), body, sum_hex


def decode_json_frame(data: bytes | bytearray | memoryview, kind: int, expected_checksum: str | None) -> Any:
    """Verify and decode a whole index or seal frame (header + body)."""
    header = decode_frame_header(data)
    if header.kind != kind:
        raise CorruptData(f"frame kind {header.kind} where kind {kind} was expected")
    if header.body_bytes != len(data) - FRAME_HEADER_BYTES:
        raise CorruptData(
            f"frame body is {len(data) - FRAME_HEADER_BYTES} bytes, header says {header.body_bytes}"
        )
    if header.body_bytes > INDEX_BYTES_MAX:
        raise CorruptData(f"frame body of {header.body_bytes} bytes exceeds INDEX_BYTES_MAX")
    body = memoryview(data)[FRAME_HEADER_BYTES:]
    actual = checksum(body)
    if actual != header.body_checksum:
        raise CorruptData("frame body checksum mismatch (damaged index)")
    if expected_checksum is not None and actual != expected_checksum:
        raise CorruptData("index checksum does not match the reference (wrong or damaged extent)")
    return decode(body)


# --------------------------------------------------------------------------- index


@dataclass(frozen=True)
class IndexEntry:
    """One record of an index frame: its description and where its verified bytes are."""

    record_id: str
    codec: str
    metadata: dict[str, Any]
    tokens: int
    offset: int
    length: int
    content: str
    chunks: str
    #: A manifest stored inside the index instead of a record frame (FORMAT.md "Inline manifests").
    inline: dict[str, Any] | None = None


#: One index entry as an :class:`Index` keeps it, one flat tuple of plain values:
#: ``(record_id, codec, tokens, offset, length, content, chunks, inline, k1, v1, k2, v2, ...)``.
#: ``inline`` is an inline manifest's canonical JSON bytes (or None). The metadata follows as
#: keys and values; a value that is a JSON scalar is kept as it is, a list or an object as its
#: canonical JSON bytes (metadata never holds bytes, so bytes there always mean "encoded"): a
#: lookup of one key (a record's task and attempt, at every completion) decodes nothing. A
#: collection untracks a tuple whose items are all untracked: strings, numbers, bytes, but not
#: a dict, not even an empty one (CPython's ``_PyTuple_MaybeUntrack``), and a tuple nested in
#: it only once a pass has met the inner one first, hence one flat tuple per entry.
Row = tuple[Any, ...]

#: A row's metadata values kept as they are (the rest as their canonical JSON bytes).
SCALAR_TYPES = frozenset({str, int, float, bool, type(None)})
_PAIRS = 8  # where a row's metadata keys and values start


def entry_row(
    record_id: str, codec: str, metadata: dict[str, Any], tokens: int, offset: int, length: int,
    content: str, chunks: str,
) -> Row:  # fmt: skip
    """The row of a record's index entry (not an inline manifest's: :func:`inline_row`)."""
    return (record_id, codec, tokens, offset, length, content, chunks, None, *metadata_pairs(metadata))


def metadata_pairs(metadata: dict[str, Any]) -> tuple[Any, ...]:
    """A row's metadata part: keys and values in turn, each list or object value as its
    canonical JSON bytes (see :data:`Row`)."""
    out: list[Any] = []
    for key, value in metadata.items():
        out.append(key)
        # (metadata decoded from an index, or encoded whole before: its values are JSON's own)
        out.append(value if type(value) in SCALAR_TYPES else encode_plain(value, finite=False))
    return tuple(out)


def text_pairs(text: str) -> tuple[Any, ...]:
    """The row part of the metadata whose canonical text (``encode_text``) is ``text``: what
    reading an index frame that holds it gives (:func:`metadata_pairs` of the decoded dict).
    Made from the text, not from the caller's values, a written index shared with readers is
    the one they would read, whatever the caller's types were (a tuple is a list there) and
    whatever the caller changes later. The records of one write often carry equal metadata
    (the tensors of a sample): the part of a short text is made once and reused (it holds
    only immutable values: scalars, and the bytes of lists and objects)."""
    if len(text) <= METADATA_ROW_TEXT_CACHED_MAX:
        return _remembered_pairs(text)
    return _parsed_pairs(text)


def _parsed_pairs(text: str) -> tuple[Any, ...]:
    # The text is canonical JSON this process just encoded: plain parsing is exact for it.
    return metadata_pairs(json.loads(text))


_remembered_pairs = functools.lru_cache(maxsize=METADATA_ROWS_CACHED)(_parsed_pairs)


def pairs_text(pairs: Sequence[Any]) -> str:
    """The canonical JSON text of the metadata that :func:`metadata_pairs` gave ``pairs``
    (``encode_text(metadata)``), composed from them: nothing is encoded or decoded again."""
    if not pairs:
        return "{}"
    items = sorted(zip(pairs[::2], pairs[1::2], strict=True))  # (keys are unique)
    return "{" + ",".join([f"{quote(key)}:{_stored_text(value)}" for key, value in items]) + "}"


def _stored_text(stored: Any) -> str:
    """A row value's canonical text: a list's or object's bytes as they are, a scalar encoded
    (the common ones without the encoder's call; a float through it, for its checks)."""
    kind = type(stored)
    if kind is bytes:
        return bytes.decode(stored)
    if kind is str:
        return quote(stored)
    if kind is int:
        return int.__repr__(stored)
    if stored is None:
        return "null"
    if kind is bool:
        return "true" if stored else "false"
    return encode_text(stored)


def inline_row(record_id: str, body: dict[str, Any]) -> Row:
    """The row of an index entry carrying a manifest inline (see :func:`inline_entry`)."""
    return (record_id, MANIFEST_CODEC, 0, 0, 0, "", "", encode_plain(body, finite=False))


def row_length(row: Row) -> int:
    """The payload bytes of a row's record (0 for an inline manifest)."""
    return 0 if row[7] is not None else int(row[4])


def _entry_row(entry: IndexEntry) -> Row:
    if entry.inline is not None:
        return inline_row(entry.record_id, entry.inline)
    return entry_row(entry.record_id, entry.codec, entry.metadata, entry.tokens, entry.offset, entry.length,
                     entry.content, entry.chunks)  # fmt: skip


def _value(stored: Any) -> Any:
    return decode(stored) if type(stored) is bytes else stored


def row_meta_text(row: Row) -> str:
    """The canonical JSON text of a row's metadata (``encode_text(metadata)``), composed from the
    row's pairs: a list or object value is its canonical text already, so nothing is decoded
    (verifying a record set recomputes its digest from every record's metadata text)."""
    return pairs_text(row[_PAIRS:])


def _row_metadata(row: Row) -> dict[str, Any]:
    return {key: _value(stored) for key, stored in zip(row[_PAIRS::2], row[_PAIRS + 1 :: 2], strict=True)}


def _row_entry(row: Row, metadata: dict[str, Any]) -> IndexEntry:
    record_id, codec, tokens, offset, length, content, chunks, inline = row[:_PAIRS]
    inline_manifest = None if inline is None else decode(inline)
    return IndexEntry(record_id, codec, metadata, tokens, offset, length, content, chunks, inline_manifest)


class Index:
    """A decoded index frame: every record of one durable write.

    Parsed index frames are cached by the thousand (``reader.SHARED_INDEXES``, every reader's
    own cache): kept as IndexEntry objects with their metadata and inline manifests, each
    entry is up to six objects that every full cycle collection walks (the collector's
    longest pauses, issue 12). So an index keeps one :data:`Row` of plain values per entry,
    which the collector untracks, and :meth:`entry` builds the IndexEntry when one is asked
    for (metadata that nests containers and inline manifests are decoded then, each time).
    """

    __slots__ = ("chunk_bytes", "rows", "submission_id")

    def __init__(self, submission_id: str, chunk_bytes: int, entries: Sequence[IndexEntry]) -> None:
        self.submission_id = submission_id
        self.chunk_bytes = chunk_bytes
        self.rows: tuple[Row, ...] = tuple([_entry_row(e) for e in entries])

    @classmethod
    def of_rows(cls, submission_id: str, chunk_bytes: int, rows: tuple[Row, ...]) -> Index:
        index = cls.__new__(cls)
        index.submission_id, index.chunk_bytes, index.rows = submission_id, chunk_bytes, rows
        return index

    def __len__(self) -> int:
        return len(self.rows)

    def entry(self, ordinal: int) -> IndexEntry:
        """Entry ``ordinal`` (0 <= ordinal < len(self)), built afresh from its row."""
        row = self.rows[ordinal]
        return _row_entry(row, _row_metadata(row))

    def payload_entry(self, ordinal: int) -> IndexEntry:
        """Entry ``ordinal`` with its metadata left out (an empty dict): what the payload reads
        use (offset, length, chunk table, inline manifest), without decoding the metadata."""
        return _row_entry(self.rows[ordinal], {})

    def metadata(self, ordinal: int) -> dict[str, Any]:
        """Entry ``ordinal``'s metadata alone, built afresh."""
        return _row_metadata(self.rows[ordinal])

    def metadata_values(self, ordinal: int, first: str, second: str) -> tuple[Any, Any]:
        """``metadata(ordinal).get(first)`` and ``.get(second)``, decoding no other value
        (a completion checks every record's task and attempt)."""
        row = self.rows[ordinal]
        found: list[Any] = [None, None]
        for at in range(_PAIRS, len(row), 2):
            key = row[at]
            if key == first:
                found[0] = _value(row[at + 1])
            elif key == second:
                found[1] = _value(row[at + 1])
        return found[0], found[1]

    def codec(self, ordinal: int) -> str:
        """Entry ``ordinal``'s codec, without building the entry."""
        return str(self.rows[ordinal][1])

    def stored(self, ordinal: int, key: str) -> tuple[str, int, Any]:
        """Entry ``ordinal``'s codec and payload bytes, and its metadata value ``key`` as the
        row keeps it (a scalar, or a list's or object's canonical JSON bytes; None when
        absent), without building the entry (a tensor reference needs only its description)."""
        row = self.rows[ordinal]
        value = None
        for at in range(_PAIRS, len(row), 2):
            if row[at] == key:
                value = row[at + 1]
                break
        return row[1], row_length(row), value

    @property
    def entries(self) -> tuple[IndexEntry, ...]:
        """Every entry, built afresh (a walk over the whole frame: inspection, tests)."""
        return tuple([self.entry(i) for i in range(len(self.rows))])

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Index):
            return NotImplemented
        return (self.submission_id, self.chunk_bytes, self.rows) == (
            other.submission_id,
            other.chunk_bytes,
            other.rows,
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Index({self.submission_id!r}, chunk_bytes={self.chunk_bytes}, entries={len(self)})"


def index_body(submission_id: str, entries: Sequence[IndexEntry], chunk: int = CHUNK_BYTES) -> dict[str, Any]:
    return {
        "v": FORMAT_VERSION,
        "sub": submission_id,
        "chunk": chunk,
        "records": [_entry_body(e) for e in entries],
    }


def encode_index_frame(
    submission_id: str, rows: Sequence[Row], meta_texts: Sequence[str], chunk: int = CHUNK_BYTES
) -> tuple[bytes, bytes, str]:
    """:func:`encode_json_frame` of :func:`index_body` of the entries these rows hold, their
    metadata given as canonical texts (``meta_texts[i]`` is ``encode_text`` of row ``i``'s
    metadata; ignored for inline manifests).

    The same bytes, composed from parts (keys in sorted order) instead of encoding every
    metadata again; a property test holds the two equal.
    """
    number = int.__repr__
    records = []
    for row, meta in zip(rows, meta_texts, strict=True):
        record_id, codec, tokens, offset, length, content, chunks, inline = row[:_PAIRS]
        if inline is not None:
            records.append(f'{{"codec":{quote(codec)},"id":{quote(record_id)},"inline":{inline.decode()}}}')
            continue
        records.append(
            f'{{"chunks":{quote(chunks)},"codec":{quote(codec)},"hash":{quote(content)},'
            f'"id":{quote(record_id)},"len":{number(length)},"meta":{meta},'
            f'"off":{number(offset)},"tokens":{number(tokens)}}}'
        )
    text = (
        f'{{"chunk":{number(chunk)},"records":[{",".join(records)}],'
        f'"sub":{quote(submission_id)},"v":{number(FORMAT_VERSION)}}}'
    )
    body = text.encode("utf-8")
    sum_hex = checksum(body)
    return encode_frame_header(KIND_INDEX, len(body), sum_hex), body, sum_hex


def _entry_body(e: IndexEntry) -> dict[str, Any]:
    if e.inline is not None:
        return {"id": e.record_id, "codec": e.codec, "inline": e.inline}
    return {
        "id": e.record_id,
        "codec": e.codec,
        "meta": e.metadata,
        "tokens": e.tokens,
        "off": e.offset,
        "len": e.length,
        "hash": e.content,
        "chunks": e.chunks,
    }


def inline_entry(record_id: str, body: dict[str, Any]) -> IndexEntry:
    """An index entry carrying a manifest inline; its payload is the canonical encoding of ``body``.

    Length and content hash are left at zero and empty: the index digest already
    covers the body, and nothing reads them for inline entries.
    """
    return IndexEntry(record_id, MANIFEST_CODEC, {}, 0, 0, 0, "", "", body)


def _get(mapping: Mapping[str, Any], key: str, kind: type, what: str) -> Any:
    value = mapping.get(key)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise CorruptData(f"{what}: field {key!r} missing or of type {type(value).__name__}")
    return value


def _version(body: object, what: str) -> Mapping[str, Any]:
    if not isinstance(body, Mapping):
        raise CorruptData(f"{what} is not a JSON object")
    version = body.get("v")
    if not isinstance(version, int) or isinstance(version, bool):
        raise CorruptData(f"{what} has no version")
    if version != FORMAT_VERSION:
        raise UnsupportedSchema(
            f"{what} version {version} is not supported (this straw reads {FORMAT_VERSION})"
        )
    return body


def parse_index(body: object, body_bytes: int = INDEX_BYTES_MAX) -> Index:
    """Validate the shape of a decoded index body (``body_bytes``: its encoded size, which
    bounds every field in it, so small indexes skip per-record size checks)."""
    body = _version(body, "index")
    chunk = _get(body, "chunk", int, "index")
    records = _get(body, "records", list, "index")
    if chunk <= 0 or chunk % 4096 or len(records) > RECORDS_PER_WRITE_MAX:
        raise CorruptData("index: chunk size or record count out of range")
    rows = tuple([_parse_entry(item, chunk, body_bytes) for item in records])
    submission = _get(body, "sub", str, "index")
    if len(submission) > SUBMISSION_ID_BYTES_MAX:
        raise CorruptData("index: submission id longer than the format allows")
    return Index.of_rows(submission, chunk, rows)


def _parse_entry(item: object, chunk: int, body_bytes: int) -> Row:
    if type(item) is not dict:
        raise CorruptData("index record is not an object")
    record_id, codec = item.get("id"), item.get("codec")
    if type(record_id) is not str or type(codec) is not str:
        raise CorruptData("index record without id or codec")
    inline = item.get("inline")
    if inline is not None:
        if codec != MANIFEST_CODEC or type(inline) is not dict:
            raise CorruptData(f"index record {record_id!r}: only manifests are stored inline")
        return inline_row(record_id, inline)
    meta, tokens, offset, length = item.get("meta"), item.get("tokens"), item.get("off"), item.get("len")
    content, chunks = item.get("hash"), item.get("chunks")
    if (
        type(meta) is not dict
        or type(tokens) is not int
        or type(offset) is not int
        or type(length) is not int
        or type(content) is not str
        or type(chunks) is not str
    ):
        raise CorruptData(f"index record {record_id!r}: a field is missing or has the wrong type")
    if min(tokens, offset, length) < 0 or offset + length > PACK_BYTES_MAX or tokens > TOKENS_MAX:
        raise CorruptData(f"index record {record_id!r}: negative or oversized field")
    # Readers hold what they read to the writers' limits (FORMAT.md section 6).
    if len(record_id) > RECORD_ID_BYTES_MAX or len(codec) > CODEC_NAME_BYTES_MAX:
        raise CorruptData(f"index record {record_id[:64]!r}: id or codec longer than the format allows")
    if meta and body_bytes > METADATA_BYTES_MAX and len(encode(meta)) > METADATA_BYTES_MAX:
        raise CorruptData(f"index record {record_id!r}: metadata larger than METADATA_BYTES_MAX")
    if not _HEX32.fullmatch(content):
        raise CorruptData(f"index record {record_id!r}: malformed content hash")
    if len(chunks) != 16 * chunk_count(length, chunk) or not _HEX.fullmatch(chunks):
        raise CorruptData(f"index record {record_id!r}: chunk checksum table does not match its length")
    return entry_row(record_id, codec, meta, tokens, offset, length, content, chunks)


# --------------------------------------------------------------------------- manifest


@dataclass(frozen=True)
class Manifest:
    """A decoded manifest record: logical digest, record locations, dependencies.

    ``records`` holds ``(segment, ordinal)`` where segment ``-1`` means "the
    extent that holds this manifest" and other values index ``segments``.
    """

    digest: str
    records: tuple[tuple[int, int], ...]
    segments: tuple[dict[str, Any], ...]
    dependencies: tuple[dict[str, Any], ...]


def manifest_body(manifest: Manifest) -> dict[str, Any]:
    return {
        "v": FORMAT_VERSION,
        "digest": manifest.digest,
        "records": [list(pair) for pair in manifest.records],
        "segments": list(manifest.segments),
        "deps": list(manifest.dependencies),
    }


def parse_manifest(body: object) -> Manifest:
    body = _version(body, "manifest")
    what = "manifest"
    segments = _get(body, "segments", list, what)
    pairs = []
    for pair in _get(body, "records", list, what):
        if (
            not isinstance(pair, list)
            or len(pair) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in pair)
            or not -1 <= pair[0] < len(segments)
            or pair[1] < 0
        ):
            raise CorruptData("manifest: malformed record location")
        pairs.append((pair[0], pair[1]))
    deps = _get(body, "deps", list, what)
    if not all(isinstance(s, dict) for s in segments) or not all(isinstance(d, dict) for d in deps):
        raise CorruptData("manifest: segments and dependencies must be objects")
    return Manifest(_get(body, "digest", str, what), tuple(pairs), tuple(segments), tuple(deps))


# --------------------------------------------------------------------------- seal


def seal_body(extents: int, end: int) -> dict[str, Any]:
    return {"v": FORMAT_VERSION, "extents": extents, "end": end}


def parse_seal(body: object) -> tuple[int, int]:
    body = _version(body, "seal")
    return _get(body, "extents", int, "seal"), _get(body, "end", int, "seal")
