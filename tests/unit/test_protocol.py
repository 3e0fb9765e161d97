"""Canonical JSON and the control dataclasses of ``straw.protocol`` (API.md section 2).

encode/decode/digest are pinned against the standard library's JSON and SHA-256, every
dataclass must survive ``asdict`` -> JSON -> ``from_dict`` unchanged, references stay small
and relative, and malformed input raises the documented error class.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from straw.errors import CorruptData, InvalidReference
from straw.protocol import (
    AcquireResult,
    Assignment,
    CommitPage,
    CommitReceipt,
    Lease,
    Limits,
    RecordRef,
    RecordSetRef,
    SegmentRef,
    TaskSpec,
    as_dict,
    decode,
    digest,
    encode,
)

WRITER = "0123456789abcdef0123456789abcdef"
SEGMENT = "fedcba9876543210fedcba9876543210"


def segment_ref(**changes: object) -> SegmentRef:
    values: dict[str, object] = {
        "run_id": "run-ü",
        "path": f"raw/{WRITER}/{SEGMENT}.pack",
        "segment_id": SEGMENT,
        "size": 411,
        "checksum": "ec990192a33205ceead317896321e2e1",
        "offset": 91546,
    }
    values.update(changes)
    return SegmentRef(**values)  # type: ignore[arg-type]


def record_set_ref() -> RecordSetRef:
    return RecordSetRef(
        manifest=RecordRef(segment_ref(), 7),
        digest=hashlib.sha256(b"x").hexdigest(),
        records=7,
        payload_bytes=12_345_678_901,
        tokens=2**40,
    )


def lease() -> Lease:
    return Lease(
        run_id="run",
        queue_id="rollout",
        task_id="t-1",
        attempt_id="a-1",
        generation=3,
        coordinator_epoch=2,
        token="tok",
        worker_id="w-0",
    )


def receipt() -> CommitReceipt:
    return CommitReceipt(
        commit_id="c-1",
        task_id="t-1",
        submission_id="s-1",
        digest=record_set_ref().digest,
        position=12,
        result_ref=record_set_ref(),
    )


# --------------------------------------------------------------------------- encode


def test_encode_sorts_keys_and_is_compact() -> None:
    value = {"b": [1, 2, {"z": None, "a": True}], "a": 1.5, "c": "x"}
    assert encode(value) == b'{"a":1.5,"b":[1,2,{"a":true,"z":null}],"c":"x"}'


def test_encode_equals_stdlib_canonical_form() -> None:
    value = {f"k{i * 7 % 11}": [i, str(i), {"n": -i}] for i in range(11)}
    expected = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    assert encode(value) == expected.encode("utf-8")
    assert b" " not in encode(value)


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(_JSON)
def test_encode_is_the_stdlib_canonical_form_for_any_json_value(value: object) -> None:
    # encode reuses one C encoder across calls; it must agree with a fresh json.dumps.
    expected = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    assert encode(value) == expected.encode("utf-8")


def test_encode_reports_a_circular_value_and_keeps_working() -> None:
    loop: list[object] = [1]
    loop.append({"again": loop})
    with pytest.raises(ValueError, match="circular"):
        encode({"x": loop})
    with pytest.raises(TypeError, match="set is not JSON-encodable"):
        encode([{"a": 1}, {2}])
    # Failed calls leave nothing behind in the shared encoder.
    assert encode({"x": [1, {"again": 2}]}) == b'{"x":[1,{"again":2}]}'


def test_encode_writes_utf8_not_ascii_escapes() -> None:
    encoded = encode({"名前": "héllo ✓"})
    assert encoded == '{"名前":"héllo ✓"}'.encode()
    assert b"\\u" not in encoded


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_encode_rejects_nan_and_infinity(bad: float) -> None:
    with pytest.raises(ValueError, match="NaN and Infinity are rejected"):
        encode({"nested": [1, bad]})


def test_encode_rejects_non_json_types() -> None:
    with pytest.raises(TypeError, match="set is not JSON-encodable"):
        encode({"a": {1, 2}})


def test_encode_accepts_dataclasses_as_their_dict() -> None:
    ref = record_set_ref()
    assert encode(ref) == encode(dataclasses.asdict(ref))
    assert encode([ref, {"x": ref.manifest}]) == encode(
        [dataclasses.asdict(ref), {"x": dataclasses.asdict(ref.manifest)}]
    )


# --------------------------------------------------------------------------- decode / digest


@pytest.mark.parametrize(
    "value",
    [
        {"a": [1, 2.5, None, True, False, "ü"], "b": {"c": {}}},
        [],
        "plain",
        -(2**63),
        2**64,
        0.1,
    ],
)
def test_decode_round_trips_encode(value: object) -> None:
    assert decode(encode(value)) == value
    assert decode(bytearray(encode(value))) == value
    assert decode(memoryview(encode(value))) == value


@pytest.mark.parametrize(
    "data",
    [b"\xff\xfe", b'{"a":"\xc3"}', b"{", b'{"a":1,}', b"", b"[1] [2]", b"'single'"],
    ids=["bad-utf8", "truncated-utf8", "unclosed", "trailing-comma", "empty", "two-values", "quotes"],
)
def test_decode_rejects_invalid_input_with_corrupt_data(data: bytes) -> None:
    with pytest.raises(CorruptData, match="invalid canonical JSON"):
        decode(data)


@pytest.mark.parametrize("token", [b"NaN", b"Infinity", b"-Infinity"])
def test_decode_rejects_nan_tokens(token: bytes) -> None:
    with pytest.raises(CorruptData, match="never contains"):
        decode(b'{"a":[1,' + token + b"]}")


def test_decode_rejects_numbers_that_overflow_to_infinity() -> None:
    with pytest.raises(CorruptData):
        decode(b"[1e999]")


def test_decode_rejects_deep_nesting_with_corrupt_data() -> None:
    with pytest.raises(CorruptData):
        decode(b"[" * 100_000 + b"]" * 100_000)


def _json_module_decode(data: bytes, check_floats: bool) -> Any:
    """What decode gives by the json module alone (its path before orjson took the fast one)."""

    def finite(text: str) -> float:
        value = float(text)
        if not math.isfinite(value):
            raise CorruptData("overflow")
        return value

    def constant(name: str) -> Any:
        raise CorruptData(name)

    try:
        text = data.decode("utf-8")
        if check_floats:
            return json.loads(text, parse_constant=constant, parse_float=finite)
        return json.loads(text, parse_constant=constant)
    except (ValueError, RecursionError):
        raise CorruptData("invalid") from None


_json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=2**63 - 3, max_value=2**64 + 3)
    | st.integers(max_value=-(2**63) + 3, min_value=-(2**63) - 3)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
    | st.sampled_from(["1234567890123456789", r"\ud800", "0.000123456789012345678"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
    max_leaves=16,
)
_json_noise = st.sampled_from(
    [b" ", b"NaN", b"1e999", b"-", b"\\ud800", b'"', b"]", b"\xff", b"12345678901234567890", b"-0", b"1E5"]
)


def _same(data: bytes, check_floats: bool) -> None:
    try:
        expected = _json_module_decode(data, check_floats)
    except CorruptData:
        with pytest.raises(CorruptData):
            decode(data, check_floats=check_floats)
        return
    got = decode(data, check_floats=check_floats)
    assert json.dumps(got, sort_keys=True) == json.dumps(expected, sort_keys=True)
    assert repr(got) == repr(expected)  # the same types too: an int stays an int


@settings(max_examples=400, deadline=None)
@given(value=_json_values, check_floats=st.booleans())
def test_decode_gives_what_the_json_module_gives(value: Any, check_floats: bool) -> None:
    _same(encode(value), check_floats)
    _same(json.dumps(value, indent=1).encode(), check_floats)  # not canonical, still JSON


@settings(max_examples=400, deadline=None)
@given(value=_json_values, cut=st.integers(min_value=0), noise=_json_noise)
def test_decode_of_damaged_json_fails_or_succeeds_as_the_json_module_does(
    value: Any, cut: int, noise: bytes
) -> None:
    data = encode(value)
    at = cut % (len(data) + 1)
    _same(data[:at] + noise + data[at:], True)
    _same(data[:at] + noise + data[at:], False)


def test_decode_keeps_ints_beyond_64_bits_exact() -> None:
    for value in (2**64, 2**64 + 1, -(2**63) - 1, 10**30, [1, {"a": -(10**25)}]):
        assert repr(decode(encode(value))) == repr(value)
    assert decode(b'"12345678901234567890"') == "12345678901234567890"  # a false alarm: still right


def test_digest_is_sha256_hex_of_encode() -> None:
    value = {"z": [3, 2, 1], "a": "ü", "ref": record_set_ref()}
    assert digest(value) == hashlib.sha256(encode(value)).hexdigest()
    assert digest({"a": 1, "b": 2}) == digest({"b": 2, "a": 1})
    assert digest({"a": 1}) != digest({"a": 2})


# --------------------------------------------------------------------------- dataclass round trips


ROUND_TRIP = [
    pytest.param(SegmentRef, segment_ref(), id="SegmentRef"),
    pytest.param(RecordRef, RecordRef(segment_ref(), 3), id="RecordRef"),
    pytest.param(RecordSetRef, record_set_ref(), id="RecordSetRef"),
    pytest.param(TaskSpec, TaskSpec("t-1"), id="TaskSpec-plain"),
    pytest.param(
        TaskSpec,
        TaskSpec(
            "t-2",
            input_ref=record_set_ref(),
            metadata={"prompt": "ü", "n": [1, 2]},
            allow_empty=True,
            max_attempts=5,
            estimated_records=4,
            estimated_bytes=1 << 40,
            estimated_tokens=99,
            control=True,
            priority=-(2**63),
            scheduling_key=2**63 - 1,
        ),
        id="TaskSpec-input_ref",
    ),
    pytest.param(CommitReceipt, receipt(), id="CommitReceipt"),
    pytest.param(Lease, lease(), id="Lease"),
    pytest.param(Limits, Limits(), id="Limits-default"),
    pytest.param(Limits, Limits(pending_tasks=1, accepted_tokens=1e8, metadata_bytes=7), id="Limits"),
]


@pytest.mark.parametrize(("cls", "value"), ROUND_TRIP)
def test_from_dict_of_asdict_rebuilds_an_equal_object(cls: type, value: object) -> None:
    plain = dataclasses.asdict(value)  # type: ignore[call-overload]
    assert cls.from_dict(plain) == value  # type: ignore[attr-defined]


@pytest.mark.parametrize(("cls", "value"), ROUND_TRIP)
def test_asdict_survives_json_and_back(cls: type, value: object) -> None:
    wire = encode(dataclasses.asdict(value))  # type: ignore[call-overload]
    assert json.loads(wire) == dataclasses.asdict(value)  # type: ignore[call-overload]
    assert cls.from_dict(decode(wire)) == value  # type: ignore[attr-defined]


def test_composite_types_are_json_encodable_with_asdict() -> None:
    task = TaskSpec("t-1", input_ref=record_set_ref())
    values = [
        Assignment(task, lease()),
        AcquireResult("acquired", (Assignment(task, lease()),)),
        AcquireResult("empty"),
        CommitPage((receipt(), receipt()), cursor=13, end_of_input=False),
    ]
    for value in values:
        plain = dataclasses.asdict(value)
        assert json.loads(encode(plain)) == json.loads(json.dumps(plain))


def test_from_dict_accepts_already_built_nested_references() -> None:
    ref = record_set_ref()
    assert RecordSetRef.from_dict({**dataclasses.asdict(ref), "manifest": ref.manifest}) == ref
    assert RecordRef.from_dict({"segment": ref.manifest.segment, "ordinal": 7}) == ref.manifest


def test_segment_ref_from_dict_fills_defaults() -> None:
    plain = dataclasses.asdict(segment_ref(offset=0))
    for name in ("version", "checksum_algorithm", "offset"):
        del plain[name]
    assert SegmentRef.from_dict(plain) == segment_ref(offset=0)


def test_record_set_ref_is_small_and_has_no_absolute_path(tmp_path: object) -> None:
    ref = record_set_ref()
    wire = encode(dataclasses.asdict(ref))
    assert len(wire) < 1024
    assert not ref.manifest.segment.path.startswith("/")
    assert str(tmp_path).encode() not in wire
    assert b'"/' not in wire


# --------------------------------------------------------------------------- malformed references


MALFORMED = [
    pytest.param(SegmentRef, {}, "missing field 'run_id'", id="segment-empty"),
    pytest.param(
        SegmentRef,
        {k: v for k, v in dataclasses.asdict(segment_ref()).items() if k != "checksum"},
        "missing field 'checksum'",
        id="segment-no-checksum",
    ),
    pytest.param(
        SegmentRef, {**dataclasses.asdict(segment_ref()), "size": "411"}, "size has type str", id="size-str"
    ),
    pytest.param(
        SegmentRef, {**dataclasses.asdict(segment_ref()), "offset": True}, "offset has type bool", id="bool"
    ),
    pytest.param(SegmentRef, ["run", "path"], "must be a mapping", id="segment-list"),
    pytest.param(RecordRef, {"ordinal": 1}, "missing field 'segment'", id="record-no-segment"),
    pytest.param(RecordRef, {"segment": "raw/x.pack", "ordinal": 1}, "segment has type str", id="seg-str"),
    pytest.param(
        RecordRef,
        {"segment": dataclasses.asdict(segment_ref()), "ordinal": 1.0},
        "ordinal has type float",
        id="ordinal-float",
    ),
    pytest.param(RecordRef, {"segment": {"path": "x"}, "ordinal": 0}, "missing field", id="segment-partial"),
    pytest.param(RecordSetRef, None, "must be a mapping", id="set-none"),
    pytest.param(
        RecordSetRef,
        {k: v for k, v in dataclasses.asdict(record_set_ref()).items() if k != "digest"},
        "missing field 'digest'",
        id="set-no-digest",
    ),
    pytest.param(
        RecordSetRef,
        {**dataclasses.asdict(record_set_ref()), "records": None},
        "records has type NoneType",
        id="set-records-none",
    ),
    pytest.param(
        RecordSetRef,
        {**dataclasses.asdict(record_set_ref()), "manifest": 5},
        "manifest has type int",
        id="set-manifest-int",
    ),
]


@pytest.mark.parametrize(("cls", "data", "message"), MALFORMED)
def test_from_dict_of_malformed_reference_raises_invalid_reference(
    cls: type, data: object, message: str
) -> None:
    with pytest.raises(InvalidReference, match=message):
        cls.from_dict(data)  # type: ignore[attr-defined]


def test_task_spec_from_dict_with_malformed_input_ref_raises_invalid_reference() -> None:
    with pytest.raises(InvalidReference, match="missing field 'manifest'"):
        TaskSpec.from_dict({"task_id": "t", "input_ref": {"digest": "d"}})


def test_commit_receipt_from_dict_with_malformed_result_ref_raises_invalid_reference() -> None:
    plain = dataclasses.asdict(receipt())
    plain["result_ref"]["manifest"]["segment"]["size"] = "big"
    with pytest.raises(InvalidReference, match="size has type str"):
        CommitReceipt.from_dict(plain)


def test_task_spec_from_dict_rejects_unknown_fields() -> None:
    with pytest.raises(ValueError, match="unknown fields \\['colour'\\]"):
        TaskSpec.from_dict({"task_id": "t", "colour": "red"})


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize("name", [f.name for f in dataclasses.fields(Limits)])
@pytest.mark.parametrize("bad", [0, -1, -0.5, math.nan, math.inf])
def test_limits_rejects_non_positive_or_non_finite_fields(name: str, bad: float) -> None:
    with pytest.raises(ValueError, match=rf"Limits\.{name} must be"):
        Limits(**{name: bad})  # type: ignore[arg-type]


def test_limits_rejects_bool_and_string_fields() -> None:
    with pytest.raises(ValueError, match=r"Limits\.pending_tasks"):
        Limits(pending_tasks=True)
    with pytest.raises(ValueError, match=r"Limits\.ready_bytes"):
        Limits(ready_bytes="1")  # type: ignore[arg-type]


@pytest.mark.parametrize("task_id", ["", None, 7])
def test_task_spec_rejects_empty_or_non_string_id(task_id: object) -> None:
    with pytest.raises(ValueError, match="task_id must be a non-empty string"):
        TaskSpec(task_id)  # type: ignore[arg-type]


@pytest.mark.parametrize("attempts", [0, -3, True, 1.5])
def test_task_spec_rejects_max_attempts_below_one(attempts: object) -> None:
    with pytest.raises(ValueError, match="max_attempts must be a positive integer"):
        TaskSpec("t", max_attempts=attempts)  # type: ignore[arg-type]


@pytest.mark.parametrize("field_name", ["priority", "scheduling_key"])
@pytest.mark.parametrize("value", [2**63, -(2**63) - 1, 10**30, 1.0, False])
def test_task_spec_rejects_values_outside_signed_64_bit(field_name: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"{field_name} must be a signed 64-bit integer"):
        TaskSpec("t", **{field_name: value})  # type: ignore[arg-type]


@pytest.mark.parametrize("field_name", ["priority", "scheduling_key"])
def test_task_spec_accepts_signed_64_bit_bounds(field_name: str) -> None:
    assert getattr(TaskSpec("t", **{field_name: 2**63 - 1}), field_name) == 2**63 - 1
    assert getattr(TaskSpec("t", **{field_name: -(2**63)}), field_name) == -(2**63)


@pytest.mark.parametrize("field_name", ["estimated_records", "estimated_bytes", "estimated_tokens"])
def test_task_spec_rejects_negative_estimates(field_name: str) -> None:
    with pytest.raises(ValueError, match=f"{field_name} must be a non-negative integer"):
        TaskSpec("t", **{field_name: -1})  # type: ignore[arg-type]


def test_task_spec_rejects_non_reference_input_ref() -> None:
    with pytest.raises(TypeError, match="input_ref must be a RecordSetRef"):
        TaskSpec("t", input_ref=dataclasses.asdict(record_set_ref()))  # type: ignore[arg-type]


def test_dataclasses_are_frozen() -> None:
    ref = record_set_ref()
    with pytest.raises(dataclasses.FrozenInstanceError):
        ref.digest = "other"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        TaskSpec("t").priority = 3  # type: ignore[misc]


_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=4),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.lists(inner, max_size=3).map(tuple)
        | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=12,
)


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(st.text(max_size=4), _JSON, max_size=4))
def test_as_dict_of_a_task_spec_equals_asdict_and_shares_no_container(metadata: dict[str, Any]) -> None:
    spec = TaskSpec("t", metadata=metadata)
    fast = as_dict(spec)
    assert fast == dataclasses.asdict(spec)
    containers = []
    todo: list[Any] = [fast["metadata"]]
    while todo:  # every dict and list of the copy is a new object
        item = todo.pop()
        if isinstance(item, (dict, list)):
            containers.append(id(item))
            todo.extend(item.values() if isinstance(item, dict) else item)
    originals = []
    todo = [spec.metadata]
    while todo:
        item = todo.pop()
        if isinstance(item, (dict, list)):
            originals.append(id(item))
            todo.extend(item.values() if isinstance(item, dict) else item)
    assert not set(containers) & set(originals)
