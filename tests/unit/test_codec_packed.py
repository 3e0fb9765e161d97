"""Packed number lists in sample documents (docs/FORMAT.md section 10.5, the ``list`` node).

A list of PACKED_LIST_ITEMS_MIN or more ints (each within int64) or floats is stored as its
little-endian binary in base64; it must decode to an equal list of the same Python types, every
float bit for bit (NaN payloads, signed zeros and infinities included), and anything else keeps
the JSON form. A damaged packed node is ``CorruptData``.
"""

from __future__ import annotations

import base64
import json
import math
import struct
from collections.abc import Mapping
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from straw.codec.payload import decode_document
from straw.codec.schema import Decoder, decode_sample, encode_sample
from straw.errors import CorruptData
from straw.limits import PACKED_LIST_ITEMS_MIN
from straw.protocol import encode
from straw.rollout.sample import Sample

N = PACKED_LIST_ITEMS_MIN


class _NoParts(Decoder):
    def part(self, ordinal: int, tag: str, node: Mapping[str, Any]) -> Any:
        raise AssertionError("no parts in these documents")

    def dependency(self, index: int, tag: str, node: Mapping[str, Any]) -> Any:
        raise AssertionError("no dependencies in these documents")


def document(value: Any) -> dict[str, Any]:
    return json.loads(encode(encode_sample(value, classes=None).document))


def round_trip(value: Any, select: Any = None) -> Any:
    data = encode(encode_sample(value, classes=None).document)
    return decode_sample(decode_document(data), _NoParts(), select=select)


def bits(values: list[Any]) -> list[tuple[type, Any]]:
    """Each element's type and exact value (a float's IEEE bits, so NaN and -0.0 compare)."""
    return [(type(v), struct.pack("<d", v) if type(v) is float else v) for v in values]


def test_the_packed_node_in_golden_form() -> None:
    assert document(list(range(N)))["root"] == {
        "t": "list",
        "dtype": "i4",
        "b64": base64.b64encode(struct.pack(f"<{N}i", *range(N))).decode(),
    }
    assert document([0.5] * N)["root"] == {
        "t": "list",
        "dtype": "f8",
        "b64": base64.b64encode(struct.pack("<d", 0.5) * N).decode(),
    }
    assert document([2**40] * N)["root"]["dtype"] == "i8"


@pytest.mark.parametrize(
    "value",
    [
        list(range(N - 1)),  # too short
        [0.5] * (N - 1),
        [1] * (N - 1) + [1.5],  # ints and floats mixed
        [True] * N,  # bools are not ints here
        [2**63] * N,  # past int64
        ["a"] * N,
    ],
    ids=["short-ints", "short-floats", "mixed", "bools", "past-int64", "strings"],
)
def test_other_lists_keep_the_json_form(value: list[Any]) -> None:
    assert document(value)["root"] == value
    assert bits(round_trip(value)) == bits(value)


def test_every_float_survives_bit_for_bit() -> None:
    special = [math.nan, -math.nan, math.inf, -math.inf, -0.0, 0.0, 5e-324, 1.7976931348623157e308]
    value = (special * N)[:N]
    assert document(value)["root"]["t"] == "list"
    assert bits(round_trip(value)) == bits(value)


@settings(max_examples=60, deadline=None)
@given(
    st.one_of(
        st.lists(st.integers(-(2**63), 2**63 - 1), min_size=N, max_size=3 * N),
        st.lists(st.floats(allow_nan=True, allow_infinity=True), min_size=N, max_size=3 * N),
        st.lists(st.integers(-(2**70), 2**70), min_size=N, max_size=2 * N),
    )
)
def test_any_long_number_list_round_trips_exactly(value: list[Any]) -> None:
    assert bits(round_trip(value)) == bits(value)
    assert bits(round_trip({"k": value})["k"]) == bits(value)


def test_a_samples_tokens_and_log_probs_are_packed_and_come_back_as_lists() -> None:
    tokens, log_probs = list(range(100, 100 + 2 * N)), [-0.001 * i for i in range(2 * N)]
    sample = Sample(index=3, tokens=tokens, rollout_log_probs=log_probs, response_length=2 * N)
    fields = dict(document(sample)["root"]["fields"])
    assert fields["tokens"]["t"] == fields["rollout_log_probs"]["t"] == "list"
    back = round_trip(sample)
    assert back.tokens == tokens and bits(back.rollout_log_probs) == bits(log_probs)
    assert type(back.tokens) is list and type(back.rollout_log_probs) is list


def test_a_selection_picks_elements_of_a_packed_list() -> None:
    value = {"a": [math.nan] + [float(i) for i in range(1, N)], "b": list(range(N))}
    got = round_trip(value, select={"a": [0, 5], "b": [N - 1, 2]})
    assert math.isnan(got["a"][0]) and got["a"][1] == 5.0 and got["b"] == [N - 1, 2]
    with pytest.raises(ValueError, match=f"holds index {N}"):
        round_trip(value, select={"b": [N]})


@pytest.mark.parametrize(
    ("node", "why"),
    [
        ({"t": "list", "dtype": "i2", "b64": "AAAA"}, "unknown dtype"),
        ({"t": "list", "dtype": "i4", "b64": "AAAAAAA="}, "not whole items"),
        ({"t": "list", "dtype": "f8", "b64": "not base64!"}, "bad base64"),
        ({"t": "list", "dtype": "f8"}, "no data"),
        ({"t": "list", "dtype": 4, "b64": ""}, "dtype not text"),
    ],
)
def test_a_damaged_packed_node_is_corrupt_data(node: dict[str, Any], why: str) -> None:
    text = encode({"v": 1, "root": node})
    with pytest.raises(CorruptData, match="malformed 'list' node"):
        decode_sample(decode_document(text), _NoParts())
    assert why
