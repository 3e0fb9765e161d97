"""Sample documents parsed with the C float parser (``straw.codec.payload.decode_document``).

The parse must give what ``straw.protocol.decode`` gives for every finite document, refuse
what it refuses at once (bad JSON or UTF-8, NaN and Infinity literals), and a number that
overflows to an infinity there must be refused by ``decode_sample`` wherever it sits.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from straw.codec.payload import decode_document
from straw.codec.schema import Decoder, decode_sample, encode_sample
from straw.errors import CorruptData
from straw.protocol import decode, encode
from straw.rollout.sample import Sample

_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8), inner, max_size=6),
    max_leaves=40,
)


class _NoParts(Decoder):
    def part(self, ordinal: int, tag: str, node: Mapping[str, Any]) -> Any:
        raise AssertionError("no parts in these documents")

    def dependency(self, index: int, tag: str, node: Mapping[str, Any]) -> Any:
        raise AssertionError("no dependencies in these documents")


@given(_json)
def test_it_parses_what_the_canonical_decoder_parses(value: Any) -> None:
    data = encode(value)
    assert decode_document(memoryview(data)) == decode(data)
    assert encode(decode_document(data)) == data


@pytest.mark.parametrize(
    "text",
    [
        b'{"v": NaN}',
        b"[Infinity]",
        b"[-Infinity]",
        b'{"v": 1',  # truncated
        b'{"v": "\xff"}',  # not UTF-8
        b"[" * 100_000 + b"]" * 100_000,  # nesting past the recursion limit
    ],
)
def test_invalid_input_is_corrupt_data_at_once(text: bytes) -> None:
    with pytest.raises(CorruptData):
        decode(text)
    with pytest.raises(CorruptData):
        decode_document(text)


def _document() -> dict[str, Any]:
    sample = Sample(index=1, tokens=[1, 2, 3], rollout_log_probs=[-0.125, -0.375], reward=0.75)
    sample.metadata = {"score": 1.5, "tags": [("a", 2.5)]}
    return json.loads(encode(encode_sample(sample, classes=None).document))


def _places(document: dict[str, Any]) -> list[tuple[str, Any]]:
    """(where, a copy of the document with one finite number replaced by the text 1e999)."""
    text = encode(document).decode()
    out = []
    for where, number in (
        ("a float field", "0.75"),
        ("a list of floats", "-0.375"),
        ("a dict value", "1.5"),
        ("inside a tuple", "2.5"),
    ):
        assert text.count(number) == 1, (where, number)
        out.append((where, text.replace(number, "1e999")))
    out.append(("the version", text.replace('"v":1', '"v":1e999', 1)))
    return out


def test_a_number_that_overflows_is_refused_wherever_it_sits() -> None:
    document = _document()
    assert decode_sample(decode_document(encode(document)), _NoParts()).reward == 0.75
    for where, text in _places(document):
        with pytest.raises(CorruptData, match=r"(?i)overflow|too large"):
            decode(text.encode())
        parsed = decode_document(text.encode())  # the fast parse lets it through as inf ...
        with pytest.raises(CorruptData, match="too large for a float"):  # ... decoding does not
            decode_sample(parsed, _NoParts())
        assert where


_number = st.builds(
    lambda sign, digits, fraction, exponent: (
        sign
        + digits
        + (f".{fraction}" if fraction else "")
        + (f"e{exponent}" if exponent is not None else "")
    ),
    st.sampled_from(["", "-"]),
    st.from_regex(r"[1-9][0-9]{0,320}", fullmatch=True) | st.just("0"),
    st.from_regex(r"[0-9]{0,20}", fullmatch=True),
    st.none() | st.integers(min_value=-500, max_value=500).map(str) | st.just("+0400"),
)


@given(st.lists(_number, min_size=1, max_size=4))
def test_any_number_list_is_refused_by_both_or_decoded_alike(numbers: list[str]) -> None:
    inner = "[" + ",".join(numbers) + "]"
    text = ('{"v":1,"root":' + inner + "}").encode()
    try:
        expected: Any = decode(text)
    except CorruptData:
        with pytest.raises(CorruptData):
            decode_sample(decode_document(text), _NoParts())
        return
    assert decode_sample(decode_document(text), _NoParts()) == expected["root"]
