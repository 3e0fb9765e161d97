"""The encoder's per-type template (all fields read at once) and its one-by-one fallback.

A dataclass whose fields are all set is read through one getter; one with an ``init=False``
field left unset, or with a single field, takes the field-by-field path. Both must give the
documents the field-by-field walk gives: unset fields absent, the others in declaration order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import pytest

from straw import codec
from straw.codec.schema import Decoder, decode_sample, encode_sample
from straw.protocol import encode


@dataclasses.dataclass
class Unset:
    a: int
    later: int = dataclasses.field(init=False)
    b: str = "x"


@dataclasses.dataclass
class Single:
    only: list[int]


@dataclasses.dataclass
class Nested:
    inner: Single
    value: float
    name: str | None = None


for _cls in (Unset, Single, Nested):
    codec.register(_cls)


class _NoParts(Decoder):
    def part(self, ordinal: int, tag: str, node: Mapping[str, Any]) -> Any:
        raise AssertionError("no parts in these documents")

    def dependency(self, index: int, tag: str, node: Mapping[str, Any]) -> Any:
        raise AssertionError("no dependencies in these documents")


def _fields(document: dict[str, Any]) -> list[list[Any]]:
    return document["root"]["fields"]  # type: ignore[no-any-return]


def test_an_unset_init_false_field_is_left_out_and_the_rest_keep_their_order() -> None:
    document = encode_sample(Unset(1)).document
    assert _fields(document) == [["a", 1], ["b", "x"]]
    rebuilt = decode_sample(document, _NoParts())
    assert (rebuilt.a, rebuilt.b, hasattr(rebuilt, "later")) == (1, "x", False)


def test_a_set_init_false_field_is_stored_in_declaration_order() -> None:
    value = Unset(1)
    value.later = 7
    assert _fields(encode_sample(value).document) == [["a", 1], ["later", 7], ["b", "x"]]


def test_single_field_and_nested_dataclasses_round_trip() -> None:
    value = Nested(Single([1, 2]), 0.5)
    document = encode_sample([value, Nested(Single([]), float("inf"), "n")]).document
    first, second = document["root"]
    assert first["fields"] == [
        ["inner", {"t": "dataclass", "cls": f"{__name__}:Single", "fields": [["only", [1, 2]]], "attrs": []}],
        ["value", 0.5],
        ["name", None],
    ]
    assert second["fields"][1] == ["value", {"t": "float", "v": "inf"}]
    assert decode_sample(document, _NoParts()) == [value, Nested(Single([]), float("inf"), "n")]


def test_every_instance_of_a_type_shares_one_template_but_keeps_its_own_attributes() -> None:
    plain, extra = Single([1]), Single([2])
    extra.note = "kept"  # type: ignore[attr-defined]
    first, second = encode_sample([plain, extra]).document["root"]
    assert (first["attrs"], second["attrs"]) == ([], [["note", "kept"]])


def test_a_non_reference_in_a_dependency_field_is_refused_with_its_path() -> None:
    with pytest.raises(TypeError, match=r"sample\[0\]\.only: a dependency field holds a RecordSetRef"):
        encode_sample([Single([1])], dependency_fields={Single: "only"})


def test_one_dataclass_met_twice_gives_the_same_node_at_both_places_and_two_equal_values() -> None:
    shared = Single([4, 5])
    value = [Nested(shared, 1.0), Nested(shared, 2.0), {"again": shared}]
    document = encode_sample(value).document
    first, second, mapping = document["root"]
    node = first["fields"][0][1]
    assert second["fields"][0][1] == node == mapping["items"][0][1]
    apart = [Nested(Single([4, 5]), 1.0), Nested(Single([4, 5]), 2.0), {"again": Single([4, 5])}]
    assert encode(document) == encode(encode_sample(apart).document)
    rebuilt = decode_sample(document, _NoParts())
    assert rebuilt[0].inner == rebuilt[1].inner == rebuilt[2]["again"] == shared
    assert rebuilt[0].inner is not rebuilt[1].inner  # documents store trees: each place its own copy


def test_a_dict_of_leaves_still_counts_towards_the_nesting_limit() -> None:
    from straw.errors import ResourceLimitExceeded
    from straw.limits import NESTING_DEPTH_MAX

    value: Any = {"leaf": 1}
    for _ in range(NESTING_DEPTH_MAX + 1):  # the dict one level below the deepest allowed
        value = [value]
    with pytest.raises(ResourceLimitExceeded, match="nests deeper than"):
        encode_sample(value)
    encode_sample(value[0])  # one level less is accepted


def test_a_dict_whose_cycle_comes_after_its_leaves_is_still_a_cycle() -> None:
    looped: dict[str, Any] = {"a": 1, "b": "x"}
    looped["self"] = [looped]
    with pytest.raises(codec.CyclicValue, match=r"sample\[\"self\"\]\[0\] is the same dict"):
        encode_sample(looped)


def test_a_dataclass_met_again_deeper_is_held_to_the_nesting_limit_there() -> None:
    from straw.errors import ResourceLimitExceeded
    from straw.limits import NESTING_DEPTH_MAX

    shared = Nested(Single([1]), 0.5)  # its subtree is two levels deep
    deep: Any = shared
    for _ in range(NESTING_DEPTH_MAX - 1):  # its inner list would sit past the limit here
        deep = [deep]
    with pytest.raises(ResourceLimitExceeded, match="nests deeper than"):
        encode_sample([shared, deep])  # met first near the root, then too deep
    encode_sample([shared, deep[0]])  # one level less is accepted
