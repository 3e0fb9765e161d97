"""straw.codec additions: the class allowlist, per-tensor materialize, selection, dependency
fields, per-sample metadata, sharing or copying nested TensorRefs, and mount hints.

The allowlist is the security property: a stored document names classes by
``module:qualname``, and a load must never import a module because the bytes say so.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from straw import SharedFilesystemStore, codec
from straw import tensor as tensor_module
from straw.backend import FilesystemBackend
from straw.codec import CyclicValue, PayloadRef, UnknownClass, UnsupportedValue
from straw.errors import UnsupportedSchema
from straw.protocol import Record, RecordSetRef, encode
from straw.store import ReadSession
from straw.tensor import TensorRef, publish_tensors

RUN = "run-codec-extensions"
CODECS = ("bytes.v1", "json.v1", "tensor.v1", "sample.v1")


class Color(enum.Enum):
    RED = "red"


@dataclasses.dataclass
class Point:
    x: int
    y: int


@dataclasses.dataclass(frozen=True)
class Handle:
    """A reference-like dataclass: ``ref`` is a dependency edge, ``root`` a mount hint."""

    ref: RecordSetRef
    root: str = ""
    label: str = ""


@dataclasses.dataclass
class NeverRegistered:
    """Importable, never published or registered in this module's tests."""

    value: int = 0


codec.register(Color)
codec.register(Point)
codec.register(Handle)


@pytest.fixture(autouse=True)
def fresh_pools(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tensor_module, "_pools", {})
    monkeypatch.setattr(tensor_module, "_writers", {})
    monkeypatch.setattr(tensor_module, "_env_seen", [None])
    monkeypatch.delenv(tensor_module.POOL_ROOTS_ENV, raising=False)


def open_store(root: Path, run_id: str = RUN, **options: Any) -> SharedFilesystemStore:
    backend = FilesystemBackend(root, sleep=lambda seconds: None, visibility_delays=(0.0,))
    return SharedFilesystemStore(root, run_id, backend=backend, codecs=CODECS, **options)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SharedFilesystemStore]:
    with open_store(tmp_path / "pool") as opened:
        yield opened


def document_ref(store: SharedFilesystemStore, document: object, name: str = "doc") -> PayloadRef:
    record = Record("sample", encode(document), "sample.v1")
    return PayloadRef(store.publish([record], submission_id=name), str(store.backend.root))


# --------------------------------------------------------------------------- the allowlist


def test_a_crafted_document_naming_an_unregistered_module_imports_nothing(
    store: SharedFilesystemStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    modules = tmp_path / "modules"
    modules.mkdir()
    marker = tmp_path / "imported.marker"
    (modules / "straw_crafted_side_effect.py").write_text(
        textwrap.dedent(
            f"""
            import dataclasses
            open({str(marker)!r}, "w").write("imported")

            @dataclasses.dataclass
            class Thing:
                x: int = 0
            """
        )
    )
    monkeypatch.syspath_prepend(str(modules))
    node = {"t": "dataclass", "cls": "straw_crafted_side_effect:Thing", "fields": [["x", 1]], "attrs": []}
    crafted = document_ref(store, {"v": 1, "root": {"t": "dict", "items": [["ok", 1], ["evil", node]]}})
    with pytest.raises(UnknownClass, match="straw_crafted_side_effect:Thing may not be rebuilt") as raised:
        crafted.load()
    assert raised.value.class_name == "straw_crafted_side_effect:Thing"
    enum_node = {"t": "enum", "cls": "straw_crafted_side_effect:Thing", "v": 1}
    with pytest.raises(UnsupportedSchema, match="may not be rebuilt"):
        document_ref(store, {"v": 1, "root": enum_node}, "enum").load()
    with pytest.raises(UnsupportedSchema, match="may not be rebuilt"):
        crafted.load(classes={f"{__name__}:Point"})
    assert "straw_crafted_side_effect" not in sys.modules
    assert not marker.exists()
    # The application may choose to allow it: then (and only then) the module is imported.
    loaded = crafted.load(classes={"straw_crafted_side_effect:Thing"})
    assert loaded["evil"].x == 1 and marker.exists()
    del sys.modules["straw_crafted_side_effect"]


def test_published_classes_are_registered_in_the_writing_process(store: SharedFilesystemStore) -> None:
    name = f"{__name__}:NeverRegistered"
    node = {"t": "dataclass", "cls": name, "fields": [["value", 3]], "attrs": []}
    crafted = document_ref(store, {"v": 1, "root": node})
    was = codec.registered().pop(name, None)
    if was is None:  # another test may have published it already
        with pytest.raises(UnknownClass):
            crafted.load()
    ref = codec.publish(store, NeverRegistered(5), submission_id="publish-registers")
    assert codec.registered()[name] is NeverRegistered
    assert ref.load() == NeverRegistered(5) and crafted.load() == NeverRegistered(3)


def test_classes_restricts_the_registry(store: SharedFilesystemStore) -> None:
    ref = codec.publish(store, {"p": Point(1, 2), "c": Color.RED}, submission_id="restrict")
    allowed = {f"{__name__}:Point", f"{__name__}:Color"}
    assert ref.load(classes=allowed) == {"p": Point(1, 2), "c": Color.RED}
    with pytest.raises(UnknownClass, match=f"{__name__}:Color may not be rebuilt"):
        ref.load(classes={f"{__name__}:Point"})
    with pytest.raises(UnsupportedSchema, match="is not a dataclass"):
        document_ref(
            store,
            {"v": 1, "root": {"t": "dataclass", "cls": "collections:OrderedDict", "fields": [], "attrs": []}},
            "od",
        ).load(classes={"collections:OrderedDict"})
    with pytest.raises(UnsupportedSchema, match="not importable here"):
        ref.load(classes={"no_such_module_xyz:Thing"})
    with pytest.raises(TypeError, match="collection of 'module:qualname'"):
        ref.load(classes="straw:Thing")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="strings"):
        ref.load(classes={Point})  # type: ignore[arg-type]


def test_classes_resolve_the_live_binding_of_a_registered_name(
    store: SharedFilesystemStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    ref = codec.publish(store, {"p": Point(1, 2)}, submission_id="rebound")
    allowed = {f"{__name__}:Point", f"{__name__}:Color"}

    @dataclasses.dataclass
    class Replacement:  # the module's binding replaced (a reload, a slots=True rebuild)
        x: int
        y: int

    Replacement.__module__, Replacement.__qualname__ = __name__, "Point"
    monkeypatch.setattr(sys.modules[__name__], "Point", Replacement)
    loaded = ref.load(classes=allowed)["p"]
    assert type(loaded) is Replacement and (loaded.x, loaded.y) == (1, 2)


def test_register_bad_input() -> None:
    @dataclasses.dataclass
    class Local:
        x: int = 0

    with pytest.raises(TypeError, match="takes a class"):
        codec.register(Point(1, 2))  # type: ignore[type-var]
    with pytest.raises(TypeError, match="Enum subclass or a dataclass"):
        codec.register(dict)
    with pytest.raises(TypeError, match="inside a function"):
        codec.register(Local)
    assert codec.register(Point) is Point  # usable as a decorator; registering again is harmless


def test_encoding_errors_carry_the_path(store: SharedFilesystemStore) -> None:
    cyclic: dict[str, Any] = {}
    cyclic["self"] = [cyclic]
    with pytest.raises(CyclicValue) as cycle:
        codec.publish(store, {"m": cyclic}, submission_id="cycle")
    assert cycle.value.path == 'sample["m"]["self"][0]' and isinstance(cycle.value, ValueError)
    with pytest.raises(UnsupportedValue) as unsupported:
        codec.publish(store, {"m": [object()]}, submission_id="object")
    assert unsupported.value.path == 'sample["m"][0]' and unsupported.value.type_name == "builtins.object"
    assert store.metrics["payload_bytes"] == 0


# --------------------------------------------------------------------------- materialize and select


def test_materialize_callable_decides_per_tensor(store: SharedFilesystemStore) -> None:
    (shared,) = publish_tensors(store, {"routes": torch.arange(4)}, submission_id="shared")
    value = {"logits": torch.ones(3), "ids": np.arange(3), "routes": shared, "keep_lazy": torch.zeros(2)}
    ref = codec.publish(store, value, submission_id="materialize")
    asked: list[tuple[str, str]] = []

    def decide(kind: str, node: str) -> bool:
        asked.append((kind, node))
        return kind != "keep_lazy" and node != "tref"

    loaded = ref.load(materialize=decide)
    assert sorted(asked) == [
        ("ids", "ndarray"),
        ("keep_lazy", "tensor"),
        ("logits", "tensor"),
        ("routes", "tref"),
    ]
    assert isinstance(loaded["logits"], torch.Tensor) and isinstance(loaded["ids"], np.ndarray)
    assert isinstance(loaded["keep_lazy"], TensorRef) and isinstance(loaded["routes"], TensorRef)
    with pytest.raises(TypeError, match="bool or a callable"):
        ref.load(materialize="yes")  # type: ignore[arg-type]


def test_select_decodes_only_the_selected_columns(
    store: SharedFilesystemStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    t0, t1 = torch.arange(3), torch.arange(3, 6)
    other = codec.publish(store, {"big": b"x" * 5000}, submission_id="other")
    value = {"a": [t0, t1, "plain"], "b": b"y" * 5000, "c": other, "d": [1, 2, 3]}
    ref = codec.publish(store, value, submission_id="select")
    read: list[int] = []
    resolved: list[str] = []
    original_read, original_resolve = ReadSession.read_record, ReadSession.resolve

    def spy_read(self: ReadSession, record: Any) -> Any:
        read.append(record.ordinal)
        return original_read(self, record)

    def spy_resolve(self: ReadSession, set_ref: RecordSetRef) -> Any:
        resolved.append(set_ref.digest)
        return original_resolve(self, set_ref)

    monkeypatch.setattr(ReadSession, "read_record", spy_read)
    monkeypatch.setattr(ReadSession, "resolve", spy_resolve)
    got = ref.load(select={"a": [1, 0], "d": None}, materialize=True)
    assert list(got) == ["a", "d"] and got["d"] == [1, 2, 3]
    assert torch.equal(got["a"][0], t1) and torch.equal(got["a"][1], t0)
    assert read == [0]  # the document only: no bytes part of "b"
    assert resolved == [ref.ref.digest]  # the dependency of "c" was never opened
    assert ref.load(select={"d": [2]}) == {"d": [3]}
    assert ref.load(select={"c": None})["c"] == other


def test_select_bad_input(store: SharedFilesystemStore) -> None:
    ref = codec.publish(store, {"a": [1, 2], "s": "text"}, submission_id="select-bad")
    listed = codec.publish(store, [1, 2], submission_id="select-list")
    with pytest.raises(
        ValueError, match=r"^A column selection requires a dictionary payload \(the root is a list"
    ):
        listed.load(select={"a": None})
    with pytest.raises(KeyError, match="'missing'"):
        ref.load(select={"missing": None})
    with pytest.raises(ValueError, match="holds index 5; the list has 2"):
        ref.load(select={"a": [5]})
    with pytest.raises(ValueError, match="that value is not a list"):
        ref.load(select={"s": [0]})
    with pytest.raises(ValueError, match="non-negative integers"):
        ref.load(select={"a": [-1]})
    with pytest.raises(TypeError, match="sequence of indices or None"):
        ref.load(select={"a": "0"})
    with pytest.raises(TypeError, match="maps a key"):
        ref.load(select=["a"])  # type: ignore[arg-type]


# --------------------------------------------------------------------------- dependency fields


def test_dependency_fields_store_an_edge_and_root_fields_rebind(
    store: SharedFilesystemStore, tmp_path: Path
) -> None:
    inner = codec.publish(store, {"payload": b"z" * 3000}, submission_id="inner")
    handle = Handle(inner.ref, root="/written/here", label="g1")
    outer = codec.publish(
        store, {"h": handle, "again": handle}, submission_id="outer", dependency_fields={Handle: "ref"}
    )
    manifest = store.manifest(outer.ref)
    assert [d["digest"] for d in manifest["dependencies"]] == [inner.ref.digest]
    assert store.reach([outer.ref]) >= store.reach([inner.ref])  # retaining outer keeps inner
    loaded = outer.load()
    assert loaded["h"] == handle and loaded["h"].root == "/written/here"
    rebound = outer.load(root_fields={Handle: "root"})
    assert rebound["h"].root == str(store.backend.root) and rebound["h"].label == "g1"
    assert codec.load(rebound["h"].ref, reader=store) == {"payload": b"z" * 3000}
    # Without the option the reference is stored as plain data: no dependency.
    plain = codec.publish(store, {"h": handle}, submission_id="plain")
    assert store.manifest(plain.ref)["dependencies"] == []


def test_dependency_fields_bad_input(store: SharedFilesystemStore) -> None:
    inner = codec.publish(store, {"x": 1}, submission_id="inner-bad")
    with pytest.raises(ValueError, match="'nope' is not a field"):
        codec.publish(store, Handle(inner.ref), submission_id="b1", dependency_fields={Handle: "nope"})
    with pytest.raises(TypeError, match="keys are dataclass types"):
        codec.publish(store, Handle(inner.ref), submission_id="b2", dependency_fields={dict: "x"})
    with pytest.raises(TypeError, match="holds a RecordSetRef, got str"):
        codec.publish(store, Handle("not a ref"), submission_id="b3", dependency_fields={Handle: "ref"})  # type: ignore[arg-type]
    assert store.metrics["payload_bytes"] == len(encode({"v": 1, "root": {"t": "dict", "items": [["x", 1]]}}))


# --------------------------------------------------------------------------- publish_many metadata


def test_publish_many_takes_per_sample_metadata(store: SharedFilesystemStore) -> None:
    refs = codec.publish_many(
        store,
        [{"t": torch.ones(2)}, {"t": torch.zeros(2)}, {"n": 1}],
        submission_id="many",
        metadata=[{"task_id": "a"}, None, {"task_id": "c"}],
        tokens=[2, 0, 5],
    )
    metas = [[r.metadata.get("task_id") for r in store.read(ref.ref)] for ref in refs]
    assert metas == [["a", "a"], [None, None], ["c"]]
    assert [ref.ref.tokens for ref in refs] == [2, 0, 5]
    shared = codec.publish_many(store, [{"n": 1}, {"n": 2}], submission_id="many-shared", metadata={"k": 1})
    assert all(next(iter(store.read(r.ref))).metadata == {"k": 1} for r in shared)


def test_publish_many_bad_metadata_writes_nothing(store: SharedFilesystemStore) -> None:
    with pytest.raises(ValueError, match="2 entries for 3 samples"):
        codec.publish_many(store, [1, 2, 3], submission_id="m1", metadata=[{}, {}])
    with pytest.raises(TypeError, match="mappings or None"):
        codec.publish_many(store, [1], submission_id="m2", metadata=["x"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="1 counts for 2 samples"):
        codec.publish_many(store, [1, 2], submission_id="m3", tokens=[1])
    with pytest.raises(ValueError, match="non-negative integer"):
        codec.publish_many(store, [1], submission_id="m4", tokens=[-1])
    with pytest.raises(TypeError, match="sequence of samples"):
        codec.publish_many(store, "abc", submission_id="m5")
    assert store.metrics["payload_bytes"] == 0 and store.metrics["writes"] == 0


# --------------------------------------------------------------------------- TensorRefs and roots


def test_a_tensor_ref_of_another_pool_is_copied_and_one_of_this_pool_shared(
    store: SharedFilesystemStore, tmp_path: Path
) -> None:
    with open_store(tmp_path / "other") as foreign_store:
        (foreign,) = publish_tensors(
            foreign_store, {"routes": torch.arange(1000, dtype=torch.int32)}, submission_id="f"
        )
    (local,) = publish_tensors(store, {"routes": torch.arange(10)}, submission_id="l")
    before = store.metrics["payload_bytes"]
    ref = codec.publish(store, {"foreign": foreign, "alias": foreign, "local": local}, submission_id="mixed")
    grown = store.metrics["payload_bytes"] - before
    assert foreign.nbytes <= grown < foreign.nbytes + 1024  # copied once, aliases share it
    assert [d["digest"] for d in store.manifest(ref.ref)["dependencies"]] == [local.record_set.digest]  # type: ignore[union-attr]
    loaded = ref.load()
    assert loaded["foreign"] is loaded["alias"] and isinstance(loaded["foreign"], TensorRef)
    assert loaded["foreign"].root == str(store.backend.root) and loaded["foreign"].kind == "routes"
    assert loaded["foreign"].record_ref.segment.path == ref.ref.manifest.segment.path
    assert torch.equal(loaded["foreign"].load(), torch.arange(1000, dtype=torch.int32))
    assert loaded["local"] == local
    assert torch.equal(ref.load(materialize=True)["foreign"], torch.arange(1000, dtype=torch.int32))
    with open_store(tmp_path / "pool", run_id="another-run") as other_run:
        moved = codec.publish(other_run, {"local": local}, submission_id="other-run")
        assert other_run.manifest(moved.ref)["dependencies"] == []  # another run: copied


def test_decoded_references_carry_the_readers_mount_path(
    store: SharedFilesystemStore, tmp_path: Path
) -> None:
    (tensor,) = publish_tensors(store, {"x": torch.arange(3)}, submission_id="t")
    inner = codec.publish(store, {"n": 1}, submission_id="inner-root")
    ref = codec.publish(store, {"t": tensor, "p": inner, "own": torch.ones(1)}, submission_id="roots")
    alias = tmp_path / "alias-mount"
    alias.symlink_to(store.backend.root)
    with ReadSession(FilesystemBackend(alias), RUN) as session:
        assert session.root == str(alias) and session.run_id == RUN
        loaded = ref.load(reader=session)
    assert loaded["t"].root == loaded["own"].root == loaded["p"].root == str(alias)
    assert loaded["t"] == tensor and loaded["p"] == inner  # the mount hint is not part of identity
    assert os.path.samefile(loaded["t"].root, tensor.root)
