"""Canonical JSON composed from parts equals the canonical encoding of the whole.

The index frame and the logical digest splice each record's metadata text (encoded once per
write) into the document instead of encoding it again; their bytes must stay exactly those of
``protocol.encode`` (docs/FORMAT.md sections 4 and "Logical digest").
"""

from __future__ import annotations

import datetime
import hashlib
import math
import string
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from straw._pack import frame
from straw._pack.writer import Entry
from straw.limits import CHUNK_BYTES, METADATA_ROW_TEXT_CACHED_MAX
from straw.protocol import decode, encode, encode_plain, encode_text
from straw.store import logical_digest

_texts = st.text(
    alphabet=st.characters(blacklist_categories=["Cs"]) | st.sampled_from('"\\\n\t\x00\u2028/'), max_size=12
)
_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | _texts,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_texts, inner, max_size=3),
    max_leaves=12,
)
_hex = st.text(alphabet=string.hexdigits.lower(), min_size=0, max_size=32)
_count = st.integers(min_value=0, max_value=2**63 - 1)


@st.composite
def _index_entries(draw: st.DrawFn) -> frame.IndexEntry:
    if draw(st.integers(0, 5)) == 0:
        return frame.inline_entry(draw(_texts), draw(st.dictionaries(_texts, _json, max_size=3)))
    return frame.IndexEntry(
        draw(_texts),
        draw(_texts),
        draw(st.dictionaries(_texts, _json, max_size=4)),
        draw(_count),
        draw(_count),
        draw(_count),
        draw(_hex),
        draw(_hex),
    )


@settings(max_examples=200, deadline=None)
@given(submission=_texts, entries=st.lists(_index_entries(), max_size=6), chunk=_count)
def test_the_composed_index_frame_is_the_encoded_index_body(
    submission: str, entries: list[frame.IndexEntry], chunk: int
) -> None:
    texts = ["" if e.inline is not None else encode_text(e.metadata) for e in entries]
    rows = frame.Index(submission, chunk, entries).rows  # what the writer lays out
    composed = frame.encode_index_frame(submission, rows, texts, chunk)
    assert composed == frame.encode_json_frame(frame.KIND_INDEX, frame.index_body(submission, entries, chunk))


def _legacy_digest(rows: list[list[Any]], deps: list[str]) -> str:
    return hashlib.sha256(encode({"v": frame.FORMAT_VERSION, "records": rows, "deps": deps})).hexdigest()


@settings(max_examples=200, deadline=None)
@given(
    records=st.lists(
        st.tuples(_texts, _texts, st.dictionaries(_texts, _json, max_size=4), _count, _hex, st.booleans()),
        max_size=6,
    ),
    deps=st.lists(_hex, max_size=3),
)
def test_the_composed_logical_digest_is_the_digest_of_the_document(
    records: list[tuple[str, str, dict[str, Any], int, str, bool]], deps: list[str]
) -> None:
    entries: list[Entry] = []
    indexed: list[frame.IndexEntry] = []
    rows = []
    for record_id, codec, metadata, tokens, content, pre_encoded in records:
        payload = memoryview(content.encode())
        text = encode_text(metadata) if pre_encoded else ""
        pairs = frame.text_pairs(text) if pre_encoded else None
        entries.append(Entry(record_id, codec, metadata, tokens, payload, content, "", None, text, pairs))
        indexed.append(frame.IndexEntry(record_id, codec, metadata, tokens, 0, payload.nbytes, content, ""))
        rows.append([record_id, codec, metadata, tokens, payload.nbytes, content])
    expected = _legacy_digest(rows, deps)
    assert logical_digest(entries, deps) == expected  # a write's entries (text given or not)
    assert logical_digest(indexed, deps) == expected  # entries read back from an index
    index = frame.Index("s", CHUNK_BYTES, indexed)
    assert logical_digest(list(index.rows), deps) == expected  # an index's rows, nothing decoded
    parsed = [_as_parsed(e) for e in indexed]
    assert logical_digest(parsed, deps) == expected  # rows as an index frame's parse lays them out


@settings(max_examples=300, deadline=None)
@given(entry=_index_entries())
def test_a_rows_metadata_text_is_its_metadatas_canonical_text(entry: frame.IndexEntry) -> None:
    (row,) = frame.Index("s", CHUNK_BYTES, [entry]).rows
    assert frame.row_meta_text(row) == encode_text(frame.Index.of_rows("s", CHUNK_BYTES, (row,)).metadata(0))
    assert frame.row_meta_text(_as_parsed(entry)) == encode_text(entry.metadata)


def _as_parsed(entry: frame.IndexEntry) -> frame.Row:
    """The row parsing an index frame gives: metadata decoded from its canonical (sorted) text."""
    metadata = decode(encode(entry.metadata))
    if entry.inline is not None:
        return frame.inline_row(entry.record_id, entry.inline)
    return frame.entry_row(
        entry.record_id, entry.codec, metadata, entry.tokens, entry.offset, entry.length, entry.content,
        entry.chunks,
    )  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(metadata=st.dictionaries(_texts, _json, max_size=5))
def test_a_written_rows_metadata_part_is_the_one_reading_it_back_gives(metadata: dict[str, Any]) -> None:
    text = encode_text(metadata)
    pairs = frame.text_pairs(text)
    assert pairs == frame.metadata_pairs(decode(encode(metadata)))  # what the index row holds
    assert frame.pairs_text(pairs) == text  # the text composed from it
    assert frame.text_pairs(text) is pairs  # a short text's part is made once
    assert all(type(item) in frame.SCALAR_TYPES or type(item) is bytes for item in pairs)


def test_metadata_whose_stored_form_differs_gets_the_stored_forms_row_part() -> None:
    cases = [
        ({"a": (1, 2)}, ("a", b"[1,2]")),  # a tuple reads back as a list
        ({"a": {1: "x"}}, ("a", b'{"1":"x"}')),  # a non-str key reads back as a str
        ({"b": 1, "a": [1.5]}, ("a", b"[1.5]", "b", 1)),  # keys in their stored (sorted) order
    ]
    for metadata, pairs in cases:
        assert frame.text_pairs(encode_text(metadata)) == pairs


def test_a_long_metadata_text_is_parsed_each_time_not_remembered() -> None:
    metadata = {"a": "x" * (METADATA_ROW_TEXT_CACHED_MAX + 1)}
    text = encode_text(metadata)
    first, second = frame.text_pairs(text), frame.text_pairs(text)
    assert first == second == ("a", metadata["a"])
    assert first is not second


# --------------------------------------------------------------------------- encode_plain

# Floats of every magnitude, the exponents -5 to -9 (where orjson and the json module write
# differently) and big ints (orjson refuses them) weighted in.
_plain_numbers = (
    st.floats(allow_nan=False, allow_infinity=False)
    | st.builds(lambda m, e: m * 10.0**e, st.floats(-10, 10, allow_nan=False), st.integers(-12, 20))
    | st.integers()
    | st.integers(min_value=2**63 - 4, max_value=2**64 + 4)
)
_plain = st.recursive(
    st.none() | st.booleans() | _plain_numbers | _texts | st.sampled_from(["1.00001", "e-5", "0.00001"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_texts, inner, max_size=4),
    max_leaves=24,
)


@settings(max_examples=500, deadline=None)
@given(value=_plain)
def test_encode_plain_writes_the_canonical_bytes(value: Any) -> None:
    assert encode_plain(value) == encode(value)


def test_encode_plain_writes_a_sample_document_as_the_canonical_encoder_does() -> None:
    from straw.codec.schema import encode_sample
    from straw.rollout.sample import Sample

    sample = Sample(index=3, prompt="p\u00e9\n", tokens=list(range(40)), reward=2.5e-7)
    sample.rollout_log_probs = [-(10.0**-k) for k in range(12)]
    sample.metadata = {"big": 2**70, "tiny": 1e-5, "t": (1, "x"), "n": None}
    document = encode_sample(sample).document
    assert encode_plain(document) == encode(document)


def test_encode_plain_refuses_what_encode_refuses() -> None:
    cyclic: list[Any] = []
    cyclic.append(cyclic)
    for value in ({"k": object()}, cyclic, {"k": {1, 2}}):
        with pytest.raises((TypeError, ValueError)) as plain:
            encode_plain(value)
        with pytest.raises((TypeError, ValueError)) as canonical:
            encode(value)
        assert type(plain.value) is type(canonical.value)
        assert str(plain.value) == str(canonical.value)


_with_non_finite = st.recursive(
    st.none() | _plain_numbers | st.sampled_from([math.nan, math.inf, -math.inf]) | _texts,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_texts, inner, max_size=4),
    max_leaves=16,
)


@settings(max_examples=400, deadline=None)
@given(value=_with_non_finite)
def test_encode_plain_without_the_finite_promise_gives_what_encode_gives(value: Any) -> None:
    """``finite=False``: a NaN or an infinity anywhere is refused as ``encode`` refuses it (orjson
    alone would write ``null``); everything else gives the canonical bytes."""
    try:
        expected: bytes | str = encode(value)
    except ValueError as error:
        expected = str(error)
    try:
        got: bytes | str = encode_plain(value, finite=False)
    except ValueError as error:
        got = str(error)
    assert got == expected


def test_encode_plain_refuses_dates_as_encode_does() -> None:
    for value in ({"at": datetime.datetime(2026, 12, 6)}, [datetime.date(2026, 12, 6)]):
        with pytest.raises(TypeError, match="not JSON-encodable"):
            encode_plain(value, finite=False)


def test_a_journal_event_is_written_as_the_canonical_encoder_writes_it() -> None:
    from straw._queue import events as ev

    event = ev.Fail(
        request_id="r\u00e9", fingerprint="f" * 64, task_id="t-1", attempt_id="a", failure="x", retryable=True
    )
    assert ev.encode(event) == encode(ev.as_body(event))
    assert ev.decode(ev.encode(event)) == event
    clocked = ev.Acquire(worker_id="w", reclaimed=[], grants=[["t", "a", "k"]], deadline=math.nan)
    with pytest.raises(ValueError, match="NaN and Infinity are rejected"):
        ev.encode(clocked)  # an injected clock's NaN journals nothing (as before)
