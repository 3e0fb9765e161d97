"""straw.codec: nested samples as one publication (sample.v1 + tensor.v1 records), never pickle.

docs/FORMAT.md section 10 defines the document grammar. Round trips compare values with
their exact types (tuple stays tuple, np.float32 stays np.float32, dict order is kept);
bad input must raise with the path of the offending value and write nothing.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import math
import pickle
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from straw import Record, SharedFilesystemStore, codec
from straw import tensor as tensor_module
from straw.backend import FilesystemBackend
from straw.codec import PayloadRef
from straw.codec.schema import INLINE_BYTES_MAX, NESTING_DEPTH_MAX, Decoder, decode_sample, encode_sample
from straw.errors import (
    CorruptData,
    InvalidReference,
    ResourceLimitExceeded,
    StorageUnavailable,
    UnsupportedSchema,
)
from straw.limits import CHUNK_BYTES
from straw.protocol import decode, encode
from straw.tensor import TensorRef, publish_tensors

Image = pytest.importorskip("PIL.Image")

RUN = "run-codec-tests"
CODECS = ("bytes.v1", "json.v1", "tensor.v1", "sample.v1")


# --------------------------------------------------------------------------- types used by samples


class Status(enum.Enum):
    PENDING = "pending"
    DONE = "done"


class Priority(enum.IntEnum):
    LOW = 1
    HIGH = 2


class Perm(enum.Flag):
    R = 1
    W = 2


@dataclasses.dataclass
class Sample:
    tokens: list[int]
    status: Status = Status.PENDING
    reward: float | None = None
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    routes: Any = None


@dataclasses.dataclass(frozen=True)
class Frozen:
    name: str
    weight: float


@dataclasses.dataclass(slots=True)
class Slotted:
    a: int
    b: tuple[int, ...]


@dataclasses.dataclass
class Computed:
    x: int
    derived: int = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.derived = self.x * 2


@dataclasses.dataclass
class Clamped:
    """``level`` became a property with a setter after documents storing it were written."""

    name: str

    @property
    def level(self) -> int:
        return int(self.__dict__["_level"])

    @level.setter
    def level(self, value: int) -> None:
        self.__dict__["_level"] = min(value, 10)


# A load rebuilds only registered classes (publishing registers a class in the writing process
# too, but documents written by hand below name these before anything is published).
for _cls in (Status, Priority, Perm, Sample, Frozen, Slotted, Computed, Clamped):
    codec.register(_cls)


# --------------------------------------------------------------------------- helpers


@pytest.fixture(autouse=True)
def fresh_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tensor_module, "_pools", {})
    monkeypatch.setattr(tensor_module, "_writers", {})
    monkeypatch.setattr(tensor_module, "_env_seen", [None])
    monkeypatch.delenv(tensor_module.POOL_ROOTS_ENV, raising=False)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SharedFilesystemStore]:
    backend = FilesystemBackend(tmp_path, sleep=lambda seconds: None)
    with SharedFilesystemStore(tmp_path, RUN, backend=backend, codecs=CODECS) as opened:
        yield opened


def same(a: Any, b: Any) -> bool:
    """Deep equality that also compares exact types, tensors, arrays, NaN and images."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        flat_a, flat_b = a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)
        return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(flat_a, flat_b))
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))
    if isinstance(a, np.generic):
        return a.tobytes() == b.tobytes()
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, Image.Image):
        return (a.mode, a.size, a.tobytes(), a.getpalette()) == (b.mode, b.size, b.tobytes(), b.getpalette())
    if dataclasses.is_dataclass(a):
        names = [f.name for f in dataclasses.fields(a)]
        extra_a = {k: v for k, v in getattr(a, "__dict__", {}).items() if k not in names}
        extra_b = {k: v for k, v in getattr(b, "__dict__", {}).items() if k not in names}
        return all(same(getattr(a, n), getattr(b, n)) for n in names) and same(extra_a, extra_b)
    return bool(a == b)


def packs(root: Path) -> list[Path]:
    """Pack files, standalone files and files being created (what a write leaves)."""
    return sorted(
        p for pattern in ("raw/*/*.pack", "raw/*/*.seg", "raw/*/.*.tmp") for p in root.glob(pattern)
    )


def palette_image() -> Any:
    image = Image.new("P", (5, 4))
    image.putpalette([i % 256 for i in range(768)])
    image.putdata([i % 7 for i in range(20)])
    return image


def rich_sample() -> Sample:
    routes = torch.randint(0, 64, (32, 4, 2), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    sample = Sample(
        tokens=list(range(50)),
        status=Status.DONE,
        reward=0.5,
        metadata={
            "text": "héllo ✓",
            "big": 2**100,
            "floats": [1.0, -0.0, float("nan"), float("inf"), -float("inf"), 1e300],
            "nested": {"tuple": (1, (2, 3), []), "empty": {}, "none": None, "flag": True},
            3: "int key",
            (1, "a"): "tuple key",
            None: "none key",
            Priority.HIGH: "enum key",
            "small": b"\x00\x01",
            "large": bytes(range(256)) * 20,
            "mutable": bytearray(b"abc"),
            "np": np.arange(6, dtype=np.int16).reshape(2, 3),
            "np_scalars": [np.float32(1.5), np.int64(-3), np.bool_(True), np.uint8(200)],
            "bf16": torch.ones(3, dtype=torch.bfloat16) / 3,
            "scalar_tensor": torch.tensor(2.5),
            "empty_tensor": torch.empty(0, 7),
            "images": [Image.new("RGB", (3, 2), (9, 8, 7)), Image.new("L", (2, 2), 5), palette_image()],
            "rgba": Image.new("RGBA", (2, 1), (1, 2, 3, 4)),
            "i16": Image.new("I;16", (2, 2), 1000),
            "enums": [Priority.LOW, Perm.R | Perm.W, Status.PENDING],
            "frozen": Frozen("f", 2.0),
            "slotted": Slotted(1, (2, 3)),
            "computed": Computed(4),
        },
        routes=routes,
    )
    sample.extra_attribute = {"added": [1, 2]}  # type: ignore[attr-defined]
    return sample


# --------------------------------------------------------------------------- round trips


def test_a_rich_sample_round_trips_with_exact_types(store: SharedFilesystemStore) -> None:
    sample = rich_sample()
    ref = codec.publish(store, sample, submission_id="rich")
    loaded = ref.load(materialize=True)
    assert same(loaded, sample)
    assert loaded.extra_attribute == {"added": [1, 2]}
    assert type(loaded.metadata["nested"]["tuple"][1]) is tuple
    assert type(loaded.metadata["np_scalars"][0]) is np.float32
    assert list(loaded.metadata) == list(sample.metadata)


def test_tensors_load_lazily_unless_materialized(store: SharedFilesystemStore) -> None:
    sample = rich_sample()
    loaded = codec.publish(store, sample, submission_id="lazy").load()
    routes = loaded.routes
    assert isinstance(routes, TensorRef)
    assert (routes.kind, routes.dtype, routes.shape) == ("routes", "int32", (32, 4, 2))
    assert torch.equal(routes[3:9], sample.routes[3:9])
    assert isinstance(loaded.metadata["np"], TensorRef)
    assert loaded.metadata["np"].numpy().tolist() == [[0, 1, 2], [3, 4, 5]]
    assert same(loaded.metadata["images"][0], sample.metadata["images"][0])  # images load eagerly
    assert loaded.metadata["large"] == sample.metadata["large"]


def test_the_same_tensor_twice_is_stored_once_and_loads_as_one_object(store: SharedFilesystemStore) -> None:
    shared = torch.arange(10)
    array = np.ones(4)
    sample = {"a": shared, "b": [shared, {"again": shared}], "arr": (array, array), "copy": shared.clone()}
    ref = codec.publish(store, sample, submission_id="dedup")
    assert ref.ref.records == 1 + 3  # document, shared, array, copy
    lazy = ref.load()
    assert lazy["a"] is lazy["b"][0] is lazy["b"][1]["again"]
    assert lazy["arr"][0] is lazy["arr"][1]
    assert lazy["copy"] is not lazy["a"]
    full = ref.load(materialize=True)
    assert full["a"] is full["b"][0] is full["b"][1]["again"]
    assert torch.equal(full["a"], shared) and isinstance(full["arr"][0], np.ndarray)


def test_tensor_kinds_come_from_names_or_hints(store: SharedFilesystemStore) -> None:
    sample = Sample(tokens=[1], routes=torch.zeros(2), metadata={"topk": [np.zeros(3)], "x": np.ones(1)})
    kinds = {"routes": "routing_replay", '.metadata["x"]': "special"}
    ref = codec.publish(store, sample, submission_id="kinds", kinds=kinds)
    found = TensorRef.from_record_set_many(store, ref.ref)
    assert sorted(t.kind for t in found.values()) == ["routing_replay", "special", "topk"]
    anonymous = codec.publish(store, [torch.zeros(1)], submission_id="anon").load()
    assert anonymous[0].kind == "tensor"


def test_empty_and_scalar_roots(store: SharedFilesystemStore) -> None:
    for number, value in enumerate([None, 0, "", [], {}, (), b"", 3.25, torch.tensor(7)]):
        loaded = codec.publish(store, value, submission_id=f"root-{number}").load(materialize=True)
        assert same(loaded, value)


def test_publish_many_is_one_durable_write(store: SharedFilesystemStore) -> None:
    samples = [Sample(tokens=[i], routes=torch.full((4,), i)) for i in range(20)]
    codec.publish(store, None, submission_id="warm")  # later writes append to the open pack
    before = store.metrics
    refs = codec.publish_many(store, samples, submission_id="many")
    after = store.metrics
    assert after["writes"] - before["writes"] == 1
    assert after["syncs"] - before["syncs"] == 1
    assert after["publications"] - before["publications"] == 20
    assert len({r.ref.manifest.segment for r in refs}) == 1
    for i, ref in enumerate(refs):
        assert same(ref.load(materialize=True), samples[i])


def test_metadata_and_tokens_reach_the_records(store: SharedFilesystemStore) -> None:
    owner = {"task_id": "t1", "attempt_id": "a1"}
    ref = codec.publish(
        store, {"r": torch.zeros(2), "b": bytes(2000)}, submission_id="own", metadata=owner, tokens=42
    )
    assert len(store.validate(ref.ref, task_id="t1", attempt_id="a1")) == 3
    assert ref.ref.tokens == 42
    with pytest.raises(InvalidReference, match="does not belong"):
        store.validate(ref.ref, task_id="t2")


# --------------------------------------------------------------------------- references


def test_a_payload_ref_pickles_small_and_loads_from_its_record_set(
    store: SharedFilesystemStore, tmp_path: Path
) -> None:
    ref = codec.publish(store, rich_sample(), submission_id="p")
    assert ref.root == str(tmp_path)
    data = pickle.dumps(ref)
    assert len(data) < 1024
    assert data.count(str(tmp_path).encode()) == 1  # the mount hint; the RecordSetRef holds no path
    assert str(tmp_path) not in encode(dataclasses.asdict(ref.ref)).decode()
    assert pickle.loads(data) == ref
    assert same(codec.load(ref.ref, materialize=True), rich_sample())


def test_a_payload_ref_holds_a_record_set_ref() -> None:
    with pytest.raises(TypeError, match="holds a RecordSetRef"):
        PayloadRef("raw/x.pack")  # type: ignore[arg-type]


def test_a_list_of_group_refs_nests_without_loading_the_groups(store: SharedFilesystemStore) -> None:
    groups = [
        codec.publish(store, [Sample(tokens=[g, i]) for i in range(3)], submission_id=f"g{g}")
        for g in range(4)
    ]
    batch = codec.publish(store, {"groups": groups, "first": groups[0]}, submission_id="batch")
    assert batch.ref.records == 1  # only the document: the groups are dependencies
    own = sum(store.envelope(r)["payload_bytes"] for r in store.validate(batch.ref))
    assert own < 1024  # nothing of the groups is copied into the document
    # Usage counts what the set reaches: the document plus each dependency once (per edge).
    assert batch.ref.payload_bytes == own + sum(g.ref.payload_bytes for g in groups)
    manifest = store.manifest(batch.ref)
    assert [d["digest"] for d in manifest["dependencies"]] == [g.ref.digest for g in groups]
    loaded = batch.load()
    assert loaded["groups"] == groups and loaded["first"] is loaded["groups"][0]
    assert [s.tokens for s in loaded["groups"][2].load()] == [[2, 0], [2, 1], [2, 2]]


def test_a_tensor_ref_nests_as_a_reference_to_its_publication(store: SharedFilesystemStore) -> None:
    (routes,) = publish_tensors(store, {"routes": torch.arange(12).reshape(3, 4)}, submission_id="t")
    ref = codec.publish(store, {"r": routes, "again": routes}, submission_id="reuse")
    own = sum(store.envelope(r)["payload_bytes"] for r in store.validate(ref.ref))
    assert ref.ref.records == 1 and own < 1024
    assert ref.ref.payload_bytes == own + routes.nbytes  # the tensor's publication, once
    lazy = ref.load()
    assert lazy["r"] == routes and lazy["r"] is lazy["again"]
    assert torch.equal(ref.load(materialize=True)["r"], torch.arange(12).reshape(3, 4))


# --------------------------------------------------------------------------- bad input at publish


def test_a_cycle_raises_naming_its_path_and_writes_nothing(
    store: SharedFilesystemStore, tmp_path: Path
) -> None:
    sample = Sample(tokens=[1])
    sample.metadata["a"] = [sample]
    with pytest.raises(
        ValueError, match=r'cycle: sample\.metadata\["a"\]\[0\] is the same Sample as its ancestor sample;'
    ):
        codec.publish(store, sample, submission_id="cycle")
    loop: list[Any] = [1]
    loop.append({"k": (loop,)})
    with pytest.raises(
        ValueError, match=r'samples\[1\]\[1\]\["k"\]\[0\] is the same list as its ancestor samples\[1\]'
    ):
        codec.publish_many(store, [{"ok": 1}, loop], submission_id="cycle-many")
    assert packs(tmp_path) == []


def test_shared_subtrees_that_are_not_cycles_are_stored(store: SharedFilesystemStore) -> None:
    shared = {"x": [1, 2, {"deep": True}]}
    loaded = codec.publish(store, [shared, shared, (shared,)], submission_id="dag").load()
    assert loaded == [shared, shared, (shared,)]


@pytest.mark.parametrize(
    ("value", "where", "type_name"),
    [
        ({"a": [1, {2, 3}]}, r'sample\["a"\]\[1\]', "builtins.set"),
        ({"f": len}, r'sample\["f"\]', "builtins.builtin_function_or_method"),
        ([OrderedDict(a=1)], r"sample\[0\]", "collections.OrderedDict"),
        ({"obj": np.array([object()])}, r'sample\["obj"\]', "NumPy dtype object"),
        ({"c": torch.zeros(2, dtype=torch.complex64)}, r'sample\["c"\]', "torch dtype torch.complex64"),
        ({"z": np.complex64(1)}, r'sample\["z"\]', "NumPy scalar of dtype complex64"),
        (Sample(tokens=[1], metadata={"k": object()}), r'sample\.metadata\["k"\]', "builtins.object"),
    ],
)
def test_an_unsupported_object_raises_naming_type_and_path(
    store: SharedFilesystemStore, tmp_path: Path, value: Any, where: str, type_name: str
) -> None:
    with pytest.raises(UnsupportedSchema, match=rf"{where}: .*{type_name}"):
        codec.publish(store, value, submission_id="bad")
    assert packs(tmp_path) == []


def test_classes_that_cannot_be_imported_by_name_are_refused(
    store: SharedFilesystemStore, tmp_path: Path
) -> None:
    @dataclasses.dataclass
    class Local:
        x: int

    class LocalEnum(enum.Enum):
        A = 1

    with pytest.raises(UnsupportedSchema, match=r"sample\[0\]: class .*Local cannot be imported"):
        codec.publish(store, [Local(1)], submission_id="local")
    with pytest.raises(UnsupportedSchema, match=r'sample\["e"\]: class .*LocalEnum cannot be imported'):
        codec.publish(store, {"e": LocalEnum.A}, submission_id="local-enum")
    assert packs(tmp_path) == []


def test_nesting_deeper_than_the_limit_is_refused(store: SharedFilesystemStore) -> None:
    deep: list[Any] = []
    cursor = deep
    for _ in range(NESTING_DEPTH_MAX + 5):
        cursor.append(["x", []])
        cursor = cursor[-1][-1]
    with pytest.raises(ResourceLimitExceeded, match="nests deeper"):
        codec.publish(store, deep, submission_id="deep")


def test_the_store_must_list_the_codecs_a_sample_needs(tmp_path: Path) -> None:
    with SharedFilesystemStore(tmp_path, RUN, codecs=("bytes.v1", "sample.v1")) as partial:
        with pytest.raises(UnsupportedSchema, match=r"tensor\.v1"):
            codec.publish(partial, {"t": np.zeros(1)}, submission_id="x")
        assert codec.publish(partial, {"b": bytes(5000)}, submission_id="y").load() == {"b": bytes(5000)}
    assert len(packs(tmp_path)) == 1


# --------------------------------------------------------------------------- bad data at load


_documents = itertools.count()


def document_ref(store: SharedFilesystemStore, document: Any, codec_name: str = "sample.v1") -> PayloadRef:
    raw = document if isinstance(document, bytes) else encode(document)
    tensor_module.attach(store)
    return PayloadRef(
        store.publish([Record("sample", raw, codec_name)], submission_id=f"doc-{next(_documents)}")
    )


def test_an_unknown_schema_version_is_unsupported(tmp_path: Path) -> None:
    with SharedFilesystemStore(tmp_path, RUN, codecs=(*CODECS, "sample.v2")) as store:
        with pytest.raises(UnsupportedSchema, match="sample schema version 2"):
            document_ref(store, {"v": 2, "root": None}).load()
        with pytest.raises(UnsupportedSchema, match=r"codec 'sample\.v2'"):
            document_ref(store, {"v": 1, "root": None}, "sample.v2").load()
        with pytest.raises(InvalidReference, match="not a sample publication"):
            document_ref(store, {"v": 1, "root": None}, "json.v1").load()


@pytest.mark.parametrize(
    ("document", "message"),
    [
        (b"{not json", "invalid canonical JSON"),
        ([1, 2], "an object with 'v' and 'root'"),
        ({"v": 1, "root": {"t": "mystery"}}, "unknown node tag 'mystery'"),
        ({"v": 1, "root": {"t": "tuple"}}, "malformed 'tuple' node"),
        ({"v": 1, "root": {"t": "float", "v": "1.5"}}, "malformed 'float' node"),
        ({"v": 1, "root": {"t": "tensor", "r": 1}}, "names part 1, the publication has 1 records"),
        ({"v": 1, "root": {"t": "payload", "d": 0}}, "names dependency 0"),
        ({"v": 1, "root": {"t": "bytes", "b64": "@@@"}}, "malformed 'bytes' node"),
        ({"v": 1, "root": {"t": "dict", "items": [[[1], 2]]}}, "malformed 'dict' node"),
        *(
            ({"v": 1, "root": {"t": "dataclass", "cls": f"{__name__}:Sample", **parts}}, message)
            for parts, message in (
                ({"fields": [{"tokens": [7]}], "attrs": []}, "a field is a \\[name, node\\] pair, got dict"),
                ({"fields": ["to"], "attrs": []}, "a field is a \\[name, node\\] pair, got str"),
                ({"fields": [["tokens", [7], 1]], "attrs": []}, "a list of another length"),
                ({"fields": [[1, [7]]], "attrs": []}, "expected a string, got int"),
                ({"fields": [["tokens", [7]]], "attrs": [["tokens", [8]]]}, "named twice"),
                ({"fields": [["tokens", [7]]], "attrs": {}}, "expected a JSON array, got dict"),
                ({"cls": 3, "fields": [], "attrs": []}, "expected a string, got int"),
            )
        ),
    ],
)
def test_malformed_documents_are_corrupt(store: SharedFilesystemStore, document: Any, message: str) -> None:
    with pytest.raises(CorruptData, match=message):
        document_ref(store, document).load()


@pytest.mark.parametrize(
    ("node", "message"),
    [
        (
            {"t": "dataclass", "cls": "no_such_module_xyz:Thing", "fields": [], "attrs": []},
            "no_such_module_xyz:Thing may not be rebuilt",
        ),
        (
            {"t": "dataclass", "cls": "collections:OrderedDict", "fields": [], "attrs": []},
            "collections:OrderedDict may not be rebuilt",
        ),
        ({"t": "enum", "cls": f"{__name__}:Frozen", "v": 1}, "is not an Enum"),
        ({"t": "enum", "cls": f"{__name__}:Status", "v": "gone"}, "has no member with value 'gone'"),
        ({"t": "enum", "cls": "os:<locals>.x", "v": 1}, "may not be rebuilt"),
        ({"t": "npscalar", "dtype": "complex64", "v": 1}, "not supported"),
        (
            {"t": "dataclass", "cls": f"{__name__}:Slotted", "fields": [["a", 1]], "attrs": [["gone", 2]]},
            "Slotted has no attribute 'gone' \\(the class changed",
        ),
    ],
)
def test_classes_that_cannot_be_rebuilt_are_unsupported(
    store: SharedFilesystemStore, node: Any, message: str
) -> None:
    with pytest.raises(UnsupportedSchema, match=message):
        document_ref(store, {"v": 1, "root": node}).load()


def test_a_stored_attribute_that_is_now_a_descriptor_goes_through_it(store: SharedFilesystemStore) -> None:
    fields, attrs = [["name", "a"]], [["level", 42]]
    node = {"t": "dataclass", "cls": f"{__name__}:Clamped", "fields": fields, "attrs": attrs}
    loaded = document_ref(store, {"v": 1, "root": node}).load()
    assert loaded.name == "a" and loaded.level == 10  # the setter ran, as attribute assignment would
    assert "level" not in vars(loaded)


def test_a_field_added_to_the_class_since_publication_gets_its_default(store: SharedFilesystemStore) -> None:
    node = {"t": "dataclass", "cls": f"{__name__}:Sample", "fields": [["tokens", [7]]], "attrs": []}
    loaded = document_ref(store, {"v": 1, "root": node}).load()
    assert loaded == Sample(tokens=[7])


def test_i6_a_corrupted_tensor_chunk_fails_only_reads_that_touch_it(store: SharedFilesystemStore) -> None:
    routes = torch.arange(4 * CHUNK_BYTES // 8, dtype=torch.int64).reshape(-1, 64)  # 4 chunks, 512 B rows
    ref = codec.publish(store, Sample(tokens=[1], routes=routes), submission_id="c")
    lazy = ref.load()
    with store.read_session() as session:
        offset = session.locate(lazy.routes.record_ref).entry.offset
    path = store.backend.path(lazy.routes.record_ref.segment.path)
    with open(path, "r+b") as handle:
        handle.seek(offset + 2 * CHUNK_BYTES + 3)
        handle.write(b"\xee")
    rows_per_chunk = CHUNK_BYTES // 512
    assert torch.equal(lazy.routes[0:rows_per_chunk], routes[0:rows_per_chunk])
    with pytest.raises(CorruptData, match=r"payload checksum mismatch .*chunk 2"):
        lazy.routes[2 * rows_per_chunk : 2 * rows_per_chunk + 1]
    with pytest.raises(CorruptData, match="payload checksum"):
        ref.load(materialize=True)


def test_a_corrupted_document_is_corrupt(store: SharedFilesystemStore) -> None:
    ref = codec.publish(store, {"text": "x" * 100}, submission_id="doc")
    with store.read_session() as session:
        resolved = session.resolve(ref.ref)
        offset = resolved.records[0].entry.offset
    path = store.backend.path(ref.ref.manifest.segment.path)
    with open(path, "r+b") as handle:
        handle.seek(offset + 20)
        handle.write(b"y")
    with pytest.raises(CorruptData, match="payload checksum"):
        ref.load()


def test_loading_after_the_data_was_deleted_names_the_reference(store: SharedFilesystemStore) -> None:
    ref = codec.publish(store, {"x": 1}, submission_id="gone")
    tensor_module.detach(store.backend.root)
    tensor_module.attach(store)
    store.backend.path(ref.ref.manifest.segment.path).unlink()
    with pytest.raises(
        StorageUnavailable, match=rf"sample {ref.ref.digest[:16]} .* cannot be read: .*not visible"
    ):
        ref.load()


# --------------------------------------------------------------------------- the pure schema


class _Parts(Decoder):
    def __init__(self, parts: list[Any]) -> None:
        self.parts = parts

    def part(self, ordinal: int, tag: str, node: Any) -> Any:
        return self.parts[ordinal - 1].value

    def dependency(self, index: int, tag: str, node: Any) -> Any:  # pragma: no cover - no references here
        raise AssertionError("no dependencies in these documents")


scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20)
    | st.binary(max_size=INLINE_BYTES_MAX + 50)
)
keys = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.text(max_size=10)
    | st.tuples(st.integers(), st.text(max_size=3))
)
values = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=5)
        | st.tuples(children, children)
        | st.dictionaries(keys, children, max_size=5)
    ),
    max_leaves=30,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(values)
def test_plain_values_survive_the_document_exactly(value: Any) -> None:
    encoded = encode_sample(value)
    assert not encoded.dependencies
    document = decode(encode(encoded.document))
    assert same(decode_sample(document, _Parts(encoded.parts)), value)
