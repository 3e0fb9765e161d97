"""The sample.v1 schema: nested Python values <-> one tagged JSON document plus data parts.

Pure: no I/O. :func:`encode_sample` walks a value and returns the JSON document and the
parts (arrays, tensors, large byte strings, images) that become records of their own;
:func:`decode_sample` rebuilds the value from a document, asking its caller for parts and
dependencies. The grammar is normative in docs/FORMAT.md section 10. Nothing is pickled:
classes (enums, dataclasses) are named by module and qualified name and imported on load.
"""

from __future__ import annotations

import base64
import dataclasses
import enum
import importlib
import json
import math
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import CorruptData, ResourceLimitExceeded, UnsupportedSchema
from ..limits import INLINE_BYTES_MAX, NESTING_DEPTH_MAX, PART_ID_BYTES_MAX

__all__ = ["SCHEMA_VERSION", "Decoder", "Encoded", "Part", "decode_sample", "encode_sample"]

#: Version written in every sample document (``"v"``).
SCHEMA_VERSION = 1


_NUMPY_SCALARS = {
    np.dtype(name): name
    for name in ("uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64", "bool")
}


@dataclass(frozen=True)
class Part:
    """A value stored as its own record: ``kind`` is "tensor" (array/tensor) or "bytes"."""

    kind: str
    value: Any
    record_id: str
    tensor_kind: str = ""


@dataclass
class Encoded:
    """A sample document, its parts (record ordinals 1..n) and dependencies (by index)."""

    document: dict[str, Any]
    parts: list[Part] = field(default_factory=list)
    dependencies: list[Any] = field(default_factory=list)


# --------------------------------------------------------------------------- class names


def class_name(cls: type) -> str:
    """``module:qualname`` of a class that can be imported back by that name."""
    name = f"{cls.__module__}:{cls.__qualname__}"
    try:
        found = find_class(name)
    except UnsupportedSchema:
        found = None
    if found is not cls:
        raise UnsupportedSchema(
            f"class {name} cannot be imported by its name (defined in a function or replaced); "
            "define it at module level so a reader can import it"
        )
    return name


def find_class(name: str) -> type:
    """Import ``module:qualname``; UnsupportedSchema if that is not possible."""
    module_name, _, qualname = name.partition(":")
    if not module_name or not qualname or "<" in qualname:
        raise UnsupportedSchema(f"class name {name!r} is not importable (module:qualname)")
    try:
        found: Any = sys.modules.get(module_name) or importlib.import_module(module_name)
        for attribute in qualname.split("."):
            found = getattr(found, attribute)
    except (ImportError, AttributeError) as error:
        raise UnsupportedSchema(
            f"class {name} is not importable here ({error}); install or import the module that defines it"
        ) from None
    if not isinstance(found, type):
        raise UnsupportedSchema(f"{name} is not a class")
    return found


# --------------------------------------------------------------------------- encoding


_PLAIN_TYPES = frozenset({type(None), bool, int, str})


def _plain(items: list[Any] | tuple[Any, ...]) -> bool:
    """Whether a sequence holds only JSON scalars (the fast path for token ids and log-probs)."""
    types = set(map(type, items))
    if types <= _PLAIN_TYPES:
        return True
    if types <= _PLAIN_TYPES | {float}:
        return all(math.isfinite(x) for x in items if type(x) is float)
    return False


def _key_text(key: object) -> str:
    return json.dumps(key, ensure_ascii=False) if isinstance(key, str) else repr(key)


class _Encoder:
    def __init__(
        self,
        name: str,
        kinds: Mapping[str, str],
        special: Callable[[Any], tuple[str, Any] | None],
    ) -> None:
        self.path: list[str] = [name]
        self.kinds = kinds
        self.special = special
        self.active: dict[int, int] = {}  # id of a container on the current path -> path length
        self.memo: dict[int, tuple[Any, dict[str, Any]]] = {}  # id of a stored part -> (value, node)
        self.parts: list[Part] = []
        self.dependencies: list[Any] = []
        self.dependency_index: dict[Any, int] = {}

    def where(self) -> str:
        return "".join(self.path)

    # -- helpers --------------------------------------------------------------------------

    def child(self, component: str, value: Any, depth: int) -> Any:
        self.path.append(component)
        try:
            return self.node(value, depth + 1)
        finally:
            self.path.pop()

    def enter(self, value: Any, depth: int) -> None:
        if depth > NESTING_DEPTH_MAX:
            raise ResourceLimitExceeded(f"{self.where()} nests deeper than {NESTING_DEPTH_MAX} levels")
        ancestor = self.active.get(id(value))
        if ancestor is not None:
            raise ValueError(
                f"cycle: {self.where()} is the same {type(value).__name__} as its ancestor "
                f"{''.join(self.path[:ancestor])}; the sample codec stores trees"
            )
        self.active[id(value)] = len(self.path)

    def leave(self, value: Any) -> None:
        del self.active[id(value)]

    def dependency(self, reference: Any) -> int:
        index = self.dependency_index.get(reference)
        if index is None:
            index = self.dependency_index[reference] = len(self.dependencies)
            self.dependencies.append(reference)
        return index

    def part(
        self, value: Any, kind: str, node: dict[str, Any], tensor_kind: str = "", source: Any = None
    ) -> dict[str, Any]:
        """Store ``value`` as the next record; ``node`` gets its ordinal.

        Memoised by the identity of ``source`` (default ``value``): the same object referenced
        twice is stored once and every reference shares one node.
        """
        source = value if source is None else source
        seen = self.memo.get(id(source))
        if seen is not None:
            return seen[1]
        record_id = self.where()
        if len(record_id.encode("utf-8")) > PART_ID_BYTES_MAX:
            record_id = record_id.encode("utf-8")[:PART_ID_BYTES_MAX].decode("utf-8", "ignore")
        self.parts.append(Part(kind, value, record_id, tensor_kind))
        node["r"] = len(self.parts)  # ordinal 0 is the document itself
        self.memo[id(source)] = (source, node)  # keep the source alive so its id stays unique
        return node

    def tensor_kind(self) -> str:
        """``kinds`` by path relative to the sample, else by the last name, else that name."""
        relative = "".join(self.path[1:])
        last = ""
        for component in reversed(self.path):
            if component.startswith("."):
                last = component[1:]
                break
            if component.startswith('["'):
                last = json.loads(component[1:-1])
                break
        return self.kinds.get(relative) or self.kinds.get(last) or last or "tensor"

    # -- the walk ------------------------------------------------------------------------------

    def node(self, value: Any, depth: int) -> Any:
        kind = type(value)
        if value is None or kind is bool or kind is str or kind is int:
            return value
        if kind is float:
            return value if math.isfinite(value) else {"t": "float", "v": repr(value)}
        if kind is list:
            if _plain(value):
                return list(value)
            self.enter(value, depth)
            out = [self.child(f"[{i}]", item, depth) for i, item in enumerate(value)]
            self.leave(value)
            return out
        if kind is tuple:
            if _plain(value):
                return {"t": "tuple", "items": list(value)}
            self.enter(value, depth)
            items = [self.child(f"[{i}]", item, depth) for i, item in enumerate(value)]
            self.leave(value)
            return {"t": "tuple", "items": items}
        if kind is dict:
            return self.mapping(value, depth)
        if kind is bytes or kind is bytearray:
            tag = kind.__name__
            if len(value) <= INLINE_BYTES_MAX:
                return {"t": tag, "b64": base64.b64encode(value).decode("ascii")}
            return self.part(value, "bytes", {"t": tag})
        return self.other(value, depth)

    def mapping(self, value: dict[Any, Any], depth: int) -> dict[str, Any]:
        self.enter(value, depth)
        items = []
        for key, item in value.items():
            key_node = self.child(f"[{_key_text(key)}]", key, depth) if type(key) is not str else key
            items.append([key_node, self.child(f"[{_key_text(key)}]", item, depth)])
        self.leave(value)
        return {"t": "dict", "items": items}

    def other(self, value: Any, depth: int) -> Any:
        if isinstance(value, enum.Enum):
            cls = self.named(type(value))
            return {"t": "enum", "cls": cls, "v": self.child(".value", value.value, depth)}
        if type(value) is np.ndarray:
            return self.part(value, "tensor", {"t": "ndarray"}, self.tensor_kind())
        if isinstance(value, np.generic):
            name = _NUMPY_SCALARS.get(value.dtype)
            if name is None:
                raise UnsupportedSchema(
                    f"{self.where()}: NumPy scalar of dtype {value.dtype} is not supported"
                )
            return {"t": "npscalar", "dtype": name, "v": self.node(value.item(), depth + 1)}
        special = self.special(value)
        if special is not None:
            tag, payload = special
            if tag == "tensor":
                return self.part(value, "tensor", {"t": "tensor"}, self.tensor_kind())
            if tag == "pil":
                if id(value) in self.memo:
                    return self.memo[id(value)][1]
                data, extra = payload()
                return self.part(data, "bytes", {"t": "pil", **extra}, source=value)
            if tag in ("tref", "payload"):
                reference, extra = payload
                return {"t": tag, "d": self.dependency(reference), **extra}
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return self.dataclass(value, depth)
        kind = type(value)
        raise UnsupportedSchema(
            f"{self.where()}: cannot store an object of type {kind.__module__}.{kind.__qualname__} "
            "(supported: None, bool, int, float, str, bytes, list, tuple, dict, NumPy arrays and scalars, "
            "torch tensors, PIL images, enums, dataclasses, TensorRef, PayloadRef)"
        )

    def named(self, cls: type) -> str:
        try:
            return class_name(cls)
        except UnsupportedSchema as error:
            raise UnsupportedSchema(f"{self.where()}: {error}") from None

    def dataclass(self, value: Any, depth: int) -> dict[str, Any]:
        cls = self.named(type(value))
        self.enter(value, depth)
        names = [f.name for f in dataclasses.fields(value)]
        fields = []
        missing = object()
        for name in names:
            item = getattr(value, name, missing)
            if item is not missing:  # an init=False field without a default may be unset
                fields.append([name, self.child(f".{name}", item, depth)])
        extra = [
            [name, self.child(f".{name}", item, depth)]
            for name, item in getattr(value, "__dict__", {}).items()
            if name not in names
        ]
        self.leave(value)
        return {"t": "dataclass", "cls": cls, "fields": fields, "attrs": extra}


def encode_sample(
    value: Any,
    *,
    name: str = "sample",
    kinds: Mapping[str, str] | None = None,
    special: Callable[[Any], tuple[str, Any] | None] = lambda value: None,
) -> Encoded:
    """The sample.v1 document of ``value``; raises before anything is written.

    ``special`` recognises the types this pure module does not import (torch tensors,
    PIL images, TensorRef, PayloadRef) and returns ``(tag, payload)`` or ``None``.
    A cycle raises ``ValueError`` and an unsupported object ``UnsupportedSchema``, both
    naming the path (``sample.metadata["a"][0]``).
    """
    encoder = _Encoder(name, kinds or {}, special)
    root = encoder.node(value, 0)
    return Encoded({"v": SCHEMA_VERSION, "root": root}, encoder.parts, encoder.dependencies)


# --------------------------------------------------------------------------- decoding


class Decoder:
    """Rebuilds values; the caller supplies parts (by ordinal) and dependencies (by index)."""

    def part(self, ordinal: int, tag: str, node: Mapping[str, Any]) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def dependency(self, index: int, tag: str, node: Mapping[str, Any]) -> Any:  # pragma: no cover
        raise NotImplementedError


def decode_sample(document: object, decoder: Decoder) -> Any:
    """Rebuild the value of a sample document (verified bytes, parsed JSON)."""
    if not isinstance(document, dict) or "v" not in document or "root" not in document:
        raise CorruptData("a sample document is an object with 'v' and 'root'")
    if document["v"] != SCHEMA_VERSION:
        raise UnsupportedSchema(
            f"sample schema version {document['v']!r} is not supported (this straw reads {SCHEMA_VERSION})"
        )
    return _Reader(decoder).node(document["root"], 0)


class _Reader:
    def __init__(self, decoder: Decoder) -> None:
        self.decoder = decoder
        self.memo: dict[tuple[str, int, int], Any] = {}

    def node(self, node: Any, depth: int) -> Any:
        if depth > NESTING_DEPTH_MAX:
            raise CorruptData(f"sample document nests deeper than {NESTING_DEPTH_MAX} levels")
        if node is None or isinstance(node, (bool, int, float, str)):
            return node
        if isinstance(node, list):
            if _plain(node):  # token ids, log-probs: JSON scalars decode to themselves
                return node
            return [self.node(item, depth + 1) for item in node]
        if not isinstance(node, dict):
            raise CorruptData(f"sample document holds a {type(node).__name__} where a node belongs")
        tag = node.get("t")
        handler = _HANDLERS.get(tag) if isinstance(tag, str) else None
        if handler is None:
            raise CorruptData(f"sample document holds an unknown node tag {tag!r}")
        try:
            return handler(self, node, depth + 1)
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise CorruptData(f"malformed {tag!r} node in a sample document: {error!r}") from None

    def referenced(self, node: Mapping[str, Any], key: str, kind: str, load: Callable[[int], Any]) -> Any:
        number = node[key]
        if type(number) is not int:
            raise CorruptData(f"{kind} node has a non-integer {key!r}")
        memo_key = (kind, number, node.get("o", 0) if kind == "tref" else 0)
        if memo_key not in self.memo:
            self.memo[memo_key] = load(number)
        return self.memo[memo_key]


def _float(reader: _Reader, node: Mapping[str, Any], depth: int) -> float:
    text = node["v"]
    if text not in ("nan", "inf", "-inf"):
        raise ValueError(f"float node holds {text!r}")
    return float(text)


def _tuple(reader: _Reader, node: Mapping[str, Any], depth: int) -> tuple[Any, ...]:
    return tuple(reader.node(item, depth) for item in _list(node["items"]))


def _dict(reader: _Reader, node: Mapping[str, Any], depth: int) -> dict[Any, Any]:
    out = {}
    for pair in _list(node["items"]):
        key, value = _list(pair)
        out[reader.node(key, depth)] = reader.node(value, depth)
    return out


def _bytes(reader: _Reader, node: Mapping[str, Any], depth: int) -> bytes | bytearray:
    if "b64" in node:
        data = base64.b64decode(node["b64"], validate=True)
    else:
        data = reader.referenced(node, "r", node["t"], lambda r: reader.decoder.part(r, "bytes", node))
    return bytearray(data) if node["t"] == "bytearray" else bytes(data)


def _part(reader: _Reader, node: Mapping[str, Any], depth: int) -> Any:
    tag = node["t"]
    return reader.referenced(node, "r", "part", lambda r: reader.decoder.part(r, tag, node))


def _dependency(reader: _Reader, node: Mapping[str, Any], depth: int) -> Any:
    tag = node["t"]
    return reader.referenced(node, "d", tag, lambda d: reader.decoder.dependency(d, tag, node))


def _npscalar(reader: _Reader, node: Mapping[str, Any], depth: int) -> Any:
    name = node["dtype"]
    if name not in _NUMPY_SCALARS.values():
        raise UnsupportedSchema(f"NumPy scalar dtype {name!r} is not supported")
    return np.dtype(name).type(reader.node(node["v"], depth))


def _enum(reader: _Reader, node: Mapping[str, Any], depth: int) -> Any:
    cls = find_class(_text(node["cls"]))
    if not issubclass(cls, enum.Enum):
        raise UnsupportedSchema(f"{node['cls']} is not an Enum")
    value = reader.node(node["v"], depth)
    try:
        return cls(value)
    except ValueError:
        raise UnsupportedSchema(f"enum {node['cls']} has no member with value {value!r}") from None


def _dataclass(reader: _Reader, node: Mapping[str, Any], depth: int) -> Any:
    name = _text(node["cls"])
    cls = find_class(name)
    if not dataclasses.is_dataclass(cls):
        raise UnsupportedSchema(f"{name} is not a dataclass")
    try:
        obj = object.__new__(cls)
    except TypeError as error:
        raise UnsupportedSchema(f"cannot rebuild {name} without calling it: {error}") from None
    stored = set()
    for pair in _list(node["fields"]) + _list(node["attrs"]):
        key, value = _list(pair)
        try:
            object.__setattr__(obj, _text(key), reader.node(value, depth))
        except AttributeError:
            raise UnsupportedSchema(
                f"{name} has no attribute {key!r} (the class changed since publication)"
            ) from None
        stored.add(key)
    for f in dataclasses.fields(cls):  # fields added to the class since publication
        if f.name in stored:
            continue
        if f.default is not dataclasses.MISSING:
            object.__setattr__(obj, f.name, f.default)
        elif f.default_factory is not dataclasses.MISSING:
            object.__setattr__(obj, f.name, f.default_factory())
    return obj


def _list(value: object) -> list[Any]:
    if not isinstance(value, list):
        raise TypeError(f"expected a JSON array, got {type(value).__name__}")
    return value


def _text(value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {type(value).__name__}")
    return value


_HANDLERS: dict[str, Callable[[_Reader, Mapping[str, Any], int], Any]] = {
    "float": _float,
    "tuple": _tuple,
    "dict": _dict,
    "bytes": _bytes,
    "bytearray": _bytes,
    "ndarray": _part,
    "tensor": _part,
    "pil": _part,
    "tref": _dependency,
    "payload": _dependency,
    "npscalar": _npscalar,
    "enum": _enum,
    "dataclass": _dataclass,
}
