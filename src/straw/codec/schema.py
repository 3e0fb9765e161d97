"""The sample.v1 schema: nested Python values <-> one tagged JSON document plus data parts.

Pure: no I/O. :func:`encode_sample` walks a value and returns the JSON document and the
parts (arrays, tensors, large byte strings, images) that become records of their own;
:func:`decode_sample` rebuilds the value from a document, asking its caller for parts and
dependencies. The grammar is normative in docs/FORMAT.md section 10. Nothing is pickled:
classes (enums, dataclasses) are named by module and qualified name, and a load rebuilds
only classes the application registered (:func:`register`) or listed (``classes=``);
stored bytes never make straw import a module.
"""

from __future__ import annotations

import array
import base64
import binascii
import contextlib
import dataclasses
import enum
import functools
import importlib
import json
import math
import operator
import sys
import threading
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

import numpy as np

from .. import protocol
from ..errors import CorruptData, ResourceLimitExceeded, UnsupportedSchema, invariant
from ..limits import (
    DATACLASS_LAYOUTS_CACHED,
    INLINE_BYTES_MAX,
    NESTING_DEPTH_MAX,
    PACKED_LIST_ITEMS_MIN,
    PART_ID_BYTES_MAX,
)

__all__ = [
    "SCHEMA_VERSION",
    "CyclicValue",
    "Decoder",
    "Encoded",
    "Part",
    "UnknownClass",
    "UnsupportedValue",
    "decode_sample",
    "encode_sample",
    "register",
    "registered",
]

#: Version written in every sample document (``"v"``).
SCHEMA_VERSION = 1


_NUMPY_SCALARS = {
    np.dtype(name): name
    for name in ("uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64", "bool")
}


class CyclicValue(ValueError):
    """A container of the value contains itself; ``path`` names where (nothing was written)."""

    def __init__(self, message: str, path: str) -> None:
        super().__init__(message)
        self.path = path


class UnsupportedValue(UnsupportedSchema):
    """An object the codec cannot store; ``path`` and ``type_name`` (``module.qualname``) name it."""

    def __init__(self, message: str, path: str, type_name: str) -> None:
        super().__init__(message)
        self.path = path
        self.type_name = type_name


class UnknownClass(UnsupportedSchema):
    """A document names a class this load may not rebuild; ``class_name`` is ``module:qualname``.

    Raised before anything is imported: the class must be registered or listed by the reader.
    """

    def __init__(self, message: str, class_name: str) -> None:
        super().__init__(message)
        self.class_name = class_name


class Part(NamedTuple):
    """A value stored as its own record: ``kind`` is "tensor" (array/tensor) or "bytes".

    (A named tuple: a sample's replay captures make several per sample.)
    """

    kind: str
    value: Any
    record_id: str
    tensor_kind: str = ""
    tag: str = ""  # the node tag when it is not the default for the kind ("tref": a copied TensorRef)


@dataclass
class Encoded:
    """A sample document, its parts (record ordinals 1..n) and dependencies (by index)."""

    document: dict[str, Any]
    parts: list[Part] = field(default_factory=list)
    dependencies: list[Any] = field(default_factory=list)


# --------------------------------------------------------------------------- class names

# The allowlist: classes a load may rebuild, by "module:qualname". The application registers
# its classes; publishing an object registers its class in the writing process (it is imported
# there already). straw's own reference dataclasses are registered below.
_registry: dict[str, type] = {}
_registry_lock = threading.Lock()
C = TypeVar("C", bound=type)


def _name_of(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def register(cls: C) -> C:
    """Allow loads in this process to rebuild ``cls`` (an Enum subclass or a dataclass).

    Usable as a class decorator. The class must be defined at module level, so that the
    writing and the reading process name it alike; registering another class under the same
    name (a reloaded module) replaces the earlier one.
    """
    if not isinstance(cls, type):
        raise TypeError(f"register() takes a class, got {type(cls).__name__}")
    if not (issubclass(cls, enum.Enum) or dataclasses.is_dataclass(cls)):
        raise TypeError(f"register() takes an Enum subclass or a dataclass, got {_name_of(cls)}")
    if "<" in cls.__qualname__:
        raise TypeError(f"{_name_of(cls)} is defined inside a function; define it at module level")
    with _registry_lock:
        _registry[_name_of(cls)] = cls
    return cls


def registered() -> dict[str, type]:
    """The classes registered in this process, by ``module:qualname``."""
    with _registry_lock:
        return dict(_registry)


for _cls in (
    protocol.SegmentRef,
    protocol.RecordRef,
    protocol.RecordSetRef,
    protocol.TaskSpec,
    protocol.Lease,
    protocol.CommitReceipt,
    protocol.Limits,
):
    register(_cls)


def class_name(cls: type) -> str:
    """``module:qualname`` of a class a reader can name; registers it in this process."""
    name = _name_of(cls)
    if _registry.get(name) is cls:
        return name
    try:
        found = find_class(name)
    except UnsupportedSchema:
        found = None
    if found is not cls:
        raise UnsupportedSchema(
            f"class {name} cannot be imported by its name (defined in a function or replaced); "
            "define it at module level so a reader can import it"
        )
    with _registry_lock:
        _registry[name] = cls
    return name


def find_class(name: str) -> type:
    """Import ``module:qualname``; UnsupportedSchema if that is not possible.

    Only for names the application chose (a class being published, a name in ``classes=``),
    never for a name read from a document.
    """
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


def _live(name: str, cls: type) -> type:
    """The class now bound to ``name`` in its (already imported) module, else ``cls``.

    A dataclass built with ``slots=True`` replaces the class object its ``__init_subclass__``
    registered, and a reloaded module rebinds its classes; the module's current binding is
    the one the application means. No import happens here.
    """
    module_name, _, qualname = name.partition(":")
    found: Any = sys.modules.get(module_name)
    for attribute in qualname.split("."):
        found = getattr(found, attribute, None)
    return found if isinstance(found, type) and _name_of(found) == name else cls


class _Allowed(Mapping[str, type]):
    """The classes a ``classes=`` set names, each registered one resolved on first use.

    A load meets a few of the names a large allowlist holds; resolving each registered name's
    live binding (:func:`_live`) only when the document names it keeps a load's cost
    independent of the allowlist's size. Names not registered were imported up front.
    """

    def __init__(self, registered: dict[str, type], imported: dict[str, type]) -> None:
        self._registered = registered
        self._resolved = imported

    def __getitem__(self, name: str) -> type:
        found: type | None = self.get(name)
        if found is None:
            raise KeyError(name)  # not named
        return found

    def get(self, name: str, default: Any = None) -> Any:  # (Mapping's own goes through a raise)
        found = self._resolved.get(name)
        if found is None:
            known = self._registered.get(name)
            if known is None:
                return default
            found = self._resolved[name] = _live(name, known)
        return found

    def __iter__(self) -> Iterator[str]:
        return iter({**self._registered, **self._resolved})

    def __len__(self) -> int:
        return len(self._registered.keys() | self._resolved.keys())


def allowed_classes(classes: Collection[str] | None) -> Mapping[str, type] | None:
    """Resolve a ``classes=`` set (names the caller chose) to classes; None means the registry.

    Names not registered are imported here (an error names them at once); registered names
    are resolved to their live binding when a document names them (``get``).
    """
    if classes is None:
        return None
    if isinstance(classes, str) or not isinstance(classes, Collection):
        raise TypeError("classes= takes a collection of 'module:qualname' names")
    registered: dict[str, type] = {}
    imported: dict[str, type] = {}
    for name in classes:
        if not isinstance(name, str):
            raise TypeError(f"classes= names are 'module:qualname' strings, got {type(name).__name__}")
        known = _registry.get(name)
        if known is not None:
            registered[name] = known
        else:
            imported[name] = find_class(name)
    return _Allowed(registered, imported)


def unknown_class(name: str) -> UnknownClass:
    return UnknownClass(
        f"class {name} may not be rebuilt by this load: register it with straw.codec.register() in "
        "the reading process or list it in classes= (straw never imports a module a document names)",
        name,
    )


# --------------------------------------------------------------------------- encoding


#: JSON scalars that are their own node, encoded and decoded as themselves (a float is one
#: only when finite, so each use checks floats apart).
_PLAIN_TYPES = frozenset({type(None), bool, int, str})
_SUMMABLE = frozenset({bool, int, float})


def _plain(items: list[Any] | tuple[Any, ...], types: set[type] | None = None) -> bool:
    """Whether a sequence holds only JSON scalars (the fast path for token ids and log-probs)."""
    if types is None:
        types = set(map(type, items))
    if types <= _PLAIN_TYPES:
        return True
    if not types <= _PLAIN_TYPES | {float}:
        return False
    if types <= _SUMMABLE:
        # One C-level sum instead of a Python call per element (log-probs are long): a NaN or
        # an infinity makes the sum non-finite, so a finite sum proves every element finite.
        # A non-finite sum of finite elements (overflow) falls through to the exact check.
        try:
            if math.isfinite(sum(items)):
                return True
        except OverflowError:  # an int too large for a float
            pass
    return all(math.isfinite(x) for x in items if type(x) is float)


_NOT_LEAF = object()

#: A packed list's dtype (docs/FORMAT.md section 10.5) and the ``array`` type code holding it.
_PACKED = {"i4": "i", "i8": "q", "f8": "d"}
invariant(
    all(array.array(code).itemsize == int(dtype[1]) for dtype, code in _PACKED.items()),
    "array type codes have the sizes the packed dtypes name",
)


def _packed(dtype: str, values: array.array[Any]) -> dict[str, Any]:
    if sys.byteorder == "big":
        values.byteswap()  # stored little-endian
    return {"t": "list", "dtype": dtype, "b64": binascii.b2a_base64(values, newline=False).decode("ascii")}


def _scalar_list(items: list[Any]) -> Any:
    """The node of a list that is a leaf, else ``_NOT_LEAF``. A long list of only ints (each
    within int64) or only floats is packed: its little-endian binary in base64, which encodes
    and decodes several times faster than JSON numbers (log-probs: about 10x). Shorter lists
    of JSON scalars are themselves."""
    types = set(map(type, items))
    if len(items) >= PACKED_LIST_ITEMS_MIN and len(types) == 1:
        kind = next(iter(types))
        if kind is float:
            return _packed("f8", array.array("d", items))
        if kind is int:
            for dtype in ("i4", "i8"):
                with contextlib.suppress(OverflowError):
                    return _packed(dtype, array.array(_PACKED[dtype], items))
    return list(items) if _plain(items, types) else _NOT_LEAF


def _leaf(value: Any) -> Any:
    """The node of a value that needs no path, memo or cycle check (``_NOT_LEAF`` otherwise).

    The same node :meth:`_Encoder.node` gives: JSON scalars and lists of them are most of a
    sample's fields (token ids, log-probs, lease and provenance entries), and walking them
    one call per field was most of the encoding time.
    """
    kind = type(value)
    if value is None or kind is bool or kind is str or kind is int:
        return value
    if kind is float:
        return value if math.isfinite(value) else _NOT_LEAF
    if kind is list:
        return _scalar_list(value)
    return _NOT_LEAF


def _key_text(key: object) -> str:
    if isinstance(key, str):
        # An identifier needs no escaping: the same text json.dumps gives, without its cost
        # (encoding walks every key of every sample).
        return f'"{key}"' if key.isidentifier() else json.dumps(key, ensure_ascii=False)
    return repr(key)


class _Encoder:
    def __init__(
        self,
        name: str,
        kinds: Mapping[str, str],
        special: Callable[[Any], tuple[str, Any] | None],
        dependency_fields: Mapping[type, str],
        classes: Collection[str] | None,
    ) -> None:
        self.path: list[str] = [name]
        self.classes = classes
        self.kinds = kinds
        self.special = special
        self.dependency_fields = dependency_fields
        self.active: dict[int, int] = {}  # id of a container on the current path -> path length
        self.memo: dict[int, tuple[Any, dict[str, Any]]] = {}  # id of a stored part -> (value, node)
        self.parts: list[Part] = []
        self.dependencies: list[Any] = []
        self.dependency_index: dict[Any, int] = {}
        self.layouts: dict[type, _Layout] = {}  # see layout()
        self.enums: dict[type, str] = {}  # enum type -> its checked name (named())
        self.dataclasses: set[type] = set()  # dataclass types that are not special (other())
        #: id of an encoded dataclass -> (it, its node, the depth it was encoded at)
        self.finished: dict[int, tuple[Any, dict[str, Any], int]] = {}

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
            raise CyclicValue(
                f"cycle: {self.where()} is the same {type(value).__name__} as its ancestor "
                f"{''.join(self.path[:ancestor])}; the sample codec stores trees",
                self.where(),
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
        self,
        value: Any,
        kind: str,
        node: dict[str, Any],
        tensor_kind: str = "",
        source: Any = None,
        tag: str = "",
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
        self.parts.append(Part(kind, value, record_id, tensor_kind, tag))
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
            leaf = _scalar_list(value)
            if leaf is not _NOT_LEAF:
                return leaf
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
        if depth > NESTING_DEPTH_MAX:
            self.enter(value, depth)  # raises
        entered = False  # a dict of leaves is on no cycle: it enters the path at its first non-leaf
        items = []
        for key, item in value.items():
            if type(key) is str:
                leaf = _leaf(item)
                if leaf is not _NOT_LEAF:
                    items.append([key, leaf])
                    continue
            if not entered:
                self.enter(value, depth)
                entered = True
            component = f"[{_key_text(key)}]"
            key_node = self.child(component, key, depth) if type(key) is not str else key
            items.append([key_node, self.child(component, item, depth)])
        if entered:
            self.leave(value)
        return {"t": "dict", "items": items}

    def other(self, value: Any, depth: int) -> Any:
        if type(value) in self.dataclasses:  # a type met before: no other check applies to it
            return self.dataclass(value, depth)
        if isinstance(value, enum.Enum):
            kind = type(value)
            cls = self.enums.get(kind)
            if cls is None:
                cls = self.enums[kind] = self.named(kind)
            member = value.value
            if type(member) is str or type(member) is int:  # most enums: their value is its own node
                return {"t": "enum", "cls": cls, "v": member}
            return {"t": "enum", "cls": cls, "v": self.child(".value", member, depth)}
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
            if tag == "tref-copy":  # a TensorRef the store cannot share: its bytes become a part
                if id(value) in self.memo:
                    return self.memo[id(value)][1]
                loaded, kind = payload()
                return self.part(loaded, "tensor", {"t": "tref"}, kind, source=value, tag="tref")
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            # special() and the checks above depend on the type only: its next instances come
            # straight here (every sample of a publication is one).
            self.dataclasses.add(type(value))
            return self.dataclass(value, depth)
        kind = type(value)
        type_name = f"{kind.__module__}.{kind.__qualname__}"
        raise UnsupportedValue(
            f"{self.where()}: cannot store an object of type {type_name} "
            "(supported: None, bool, int, float, str, bytes, list, tuple, dict, NumPy arrays and scalars, "
            "torch tensors, PIL images, enums, dataclasses, TensorRef, PayloadRef)",
            self.where(),
            type_name,
        )

    def named(self, cls: type) -> str:
        type_name = f"{cls.__module__}.{cls.__qualname__}"
        try:
            name = class_name(cls)
        except UnsupportedSchema as error:
            raise UnsupportedValue(f"{self.where()}: {error}", self.where(), type_name) from None
        if self.classes is not None and name not in self.classes:
            raise UnsupportedValue(
                f"{self.where()}: class {name} is not among the classes this publication may store",
                self.where(),
                type_name,
            )
        return name

    def dependency_field(self, kind: type) -> str | None:
        for cls in kind.__mro__:
            found = self.dependency_fields.get(cls)
            if found is not None:
                return found
        return None

    def layout(self, kind: type) -> _Layout:
        """A dataclass type's template: its name, field names (in order, and as a set), its
        dependency field and one getter of every field; worked out once per type and call
        (every sample of a publication shares one)."""
        found = self.layouts.get(kind)
        if found is None:
            cls = self.named(kind)
            names, known, getter = _fields_of(kind)
            edge = self.dependency_field(kind) if self.dependency_fields else None
            if edge is not None and edge not in known:
                raise ValueError(f"{self.where()}: dependency field {edge!r} is not a field of {cls}")
            found = self.layouts[kind] = _Layout(cls, names, known, edge, getter)
        return found

    def dataclass(self, value: Any, depth: int) -> dict[str, Any]:
        done = self.finished.get(id(value))
        if done is not None and depth <= done[2]:
            # The same object met again (a group's samples share their prompt reference), no
            # deeper than where it was encoded: its node is the one already built, which is
            # what encoding it again would give (its parts and dependencies are memoised, a
            # finished node is no ancestor, and its subtree stays within the nesting limit).
            return done[1]
        layout = self.layout(type(value))
        self.enter(value, depth)
        names, edge = layout.names, layout.edge
        values: Sequence[Any] | None = None
        if layout.getter is not None:
            try:  # every field at once, in one C call
                values = layout.getter(value)
            except AttributeError:  # an init=False field without a default is unset: one by one
                values = None
        fields: list[list[Any]] = []
        simple = _PLAIN_TYPES
        if values is not None:
            for name, item in zip(names, values, strict=True):
                kind = type(item)
                if name == edge:
                    fields.append([name, self.field(name, item, edge, depth)])
                elif kind in simple:  # most fields: their own node (_leaf's)
                    fields.append([name, item])
                elif kind is list:  # token ids, log-probs, versions: _leaf's node, directly
                    leaf = _scalar_list(item)
                    if leaf is _NOT_LEAF:
                        leaf = self.child(f".{name}", item, depth)
                    fields.append([name, leaf])
                elif kind is np.ndarray:  # replay captures: other()'s part, directly
                    self.path.append(f".{name}")
                    # (tensor_kind() of a field path is the field's name when no kinds are given)
                    tensor_kind = self.tensor_kind() if self.kinds else name
                    fields.append([name, self.part(item, "tensor", {"t": "ndarray"}, tensor_kind)])
                    self.path.pop()
                elif kind in self.enums:  # a status: other()'s enum node, directly
                    member = item.value
                    if type(member) is str or type(member) is int:
                        fields.append([name, {"t": "enum", "cls": self.enums[kind], "v": member}])
                    else:
                        fields.append([name, self.child(f".{name}", item, depth)])
                else:
                    fields.append([name, self.field(name, item, edge, depth)])
        else:
            missing = object()
            for name in names:
                item = getattr(value, name, missing)
                if item is not missing:
                    fields.append([name, self.field(name, item, edge, depth)])
        extra: list[list[Any]] = []
        known = layout.known
        for name, item in getattr(value, "__dict__", {}).items():
            if name not in known:
                leaf = _leaf(item)
                extra.append([name, leaf if leaf is not _NOT_LEAF else self.child(f".{name}", item, depth)])
        self.leave(value)
        node = {"t": "dataclass", "cls": layout.cls, "fields": fields, "attrs": extra}
        self.finished[id(value)] = (value, node, depth)  # (the value kept alive: its id stays unique)
        return node

    def field(self, name: str, item: Any, edge: str | None, depth: int) -> Any:
        """The node of one dataclass field (the dependency field's is an ``rset`` node)."""
        if name == edge:
            if not isinstance(item, protocol.RecordSetRef):
                raise TypeError(
                    f"{self.where()}.{name}: a dependency field holds a RecordSetRef, "
                    f"got {type(item).__name__}"
                )
            return {"t": "rset", "d": self.dependency(item)}
        leaf = _leaf(item)
        return leaf if leaf is not _NOT_LEAF else self.child(f".{name}", item, depth)


@functools.lru_cache(maxsize=DATACLASS_LAYOUTS_CACHED)
def _fields_of(kind: type) -> tuple[tuple[str, ...], frozenset[str], Callable[[Any], tuple[Any, ...]] | None]:
    """A dataclass type's field names (in order, and as a set) and one getter of them all: a
    function of the type alone, worked out once per type (every publication of samples
    needs it)."""
    names = tuple(f.name for f in dataclasses.fields(kind))
    # attrgetter of one name returns the value itself, not a 1-tuple.
    return names, frozenset(names), operator.attrgetter(*names) if len(names) > 1 else None


@dataclass(frozen=True)
class _Layout:
    """What encoding a dataclass type needs, once per type and encoding call."""

    cls: str  # its module:qualname
    names: tuple[str, ...]  # its fields, in declaration order
    known: frozenset[str]  # the same, as a set (other attributes are stored apart)
    edge: str | None  # its dependency field, if any
    getter: Callable[[Any], tuple[Any, ...]] | None  # all fields at once (None: fewer than two)


def encode_sample(
    value: Any,
    *,
    name: str = "sample",
    kinds: Mapping[str, str] | None = None,
    special: Callable[[Any], tuple[str, Any] | None] = lambda value: None,
    dependency_fields: Mapping[type, str] | None = None,
    classes: Collection[str] | None = None,
) -> Encoded:
    """The sample.v1 document of ``value``; raises before anything is written.

    ``special`` recognises the types this pure module does not import (torch tensors,
    PIL images, TensorRef, PayloadRef) and returns ``(tag, payload)`` or ``None``; whether it
    returns ``None`` depends on the value's type only (a dataclass type it declined once is not
    offered to it again within the call).
    ``dependency_fields`` maps a dataclass type to the field whose ``RecordSetRef`` is stored
    as a dependency of the publication (an ``rset`` node) instead of as data.
    A cycle raises :class:`CyclicValue` (a ``ValueError``) and an unsupported object
    :class:`UnsupportedValue` (an ``UnsupportedSchema``), both naming the path
    (``sample.metadata["a"][0]``). ``classes`` (``module:qualname`` names), when given, are
    the only enums and dataclasses the value may hold (others are :class:`UnsupportedValue`).
    """
    if classes is not None and (isinstance(classes, str) or not isinstance(classes, Collection)):
        raise TypeError("classes= takes a collection of 'module:qualname' names")
    encoder = _Encoder(name, kinds or {}, special, _check_dependency_fields(dependency_fields), classes)
    root = encoder.node(value, 0)
    return Encoded({"v": SCHEMA_VERSION, "root": root}, encoder.parts, encoder.dependencies)


def _check_dependency_fields(fields: Mapping[type, str] | None) -> Mapping[type, str]:
    if not fields:
        return {}
    if not isinstance(fields, Mapping):
        raise TypeError("dependency_fields= maps a dataclass type to the name of its RecordSetRef field")
    for cls, name in fields.items():
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            raise TypeError(f"dependency_fields= keys are dataclass types, got {cls!r}")
        if not isinstance(name, str) or name not in _fields_of(cls)[1]:
            raise ValueError(f"dependency_fields=: {name!r} is not a field of {_name_of(cls)}")
    return fields


# --------------------------------------------------------------------------- decoding


class Decoder:
    """Rebuilds values; the caller supplies parts (by ordinal) and dependencies (by index).

    ``root`` is the mount path of the pool being read (references decoded get it).
    """

    root: str = ""

    def part(self, ordinal: int, tag: str, node: Mapping[str, Any]) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def dependency(self, index: int, tag: str, node: Mapping[str, Any]) -> Any:  # pragma: no cover
        raise NotImplementedError


Selection = Mapping[Any, Sequence[int] | None]


def check_selection(select: object) -> Selection | None:
    """Validate a ``select=`` argument before anything is read."""
    if select is None:
        return None
    if not isinstance(select, Mapping):
        raise TypeError("select= maps a key of the root dict to a list of element indices or None")
    for key, indices in select.items():
        if indices is None:
            continue
        if isinstance(indices, (str, bytes)) or not isinstance(indices, Sequence):
            raise TypeError(f"select=[{key!r}] must be a sequence of indices or None")
        for index in indices:
            if type(index) is not int or index < 0:
                raise ValueError(f"select=[{key!r}] holds {index!r}; indices are non-negative integers")
    return select


def decode_sample(
    document: object,
    decoder: Decoder,
    *,
    classes: Mapping[str, type] | None = None,
    select: Selection | None = None,
    root_fields: Mapping[type, str] | None = None,
) -> Any:
    """Rebuild the value of a sample document (verified bytes, parsed JSON).

    ``classes`` (resolved names, see :func:`allowed_classes`) replaces the registry as the
    set of classes the document may name. ``select`` decodes only some keys of a dict root
    (and of a list value, only some elements, in the order given), so the parts and
    dependencies of everything else are never asked for. ``root_fields`` names, per
    dataclass type, a field set to ``decoder.root`` after the rebuild (a mount hint).
    A non-finite number among the nodes it reads is ``CorruptData`` (a document parsed by
    ``straw.codec.payload.decode_document`` turns a number that overflows into one), so no
    value it returns holds one that the document did not tag as such.
    """
    if not isinstance(document, dict) or "v" not in document or "root" not in document:
        raise CorruptData("a sample document is an object with 'v' and 'root'")
    if isinstance(document["v"], float) and not math.isfinite(document["v"]):
        raise CorruptData("sample document holds a number too large for a float")
    if document["v"] != SCHEMA_VERSION:
        raise UnsupportedSchema(
            f"sample schema version {document['v']!r} is not supported (this straw reads {SCHEMA_VERSION})"
        )
    reader = _Reader(decoder, classes, root_fields or {})
    if select is None:
        return reader.node(document["root"], 0)
    return reader.selected(document["root"], select)


class _Reader:
    def __init__(
        self, decoder: Decoder, classes: Mapping[str, type] | None, root_fields: Mapping[type, str]
    ) -> None:
        self.decoder = decoder
        self.classes = classes
        self.root_fields = root_fields
        self.memo: dict[tuple[str, int, int], Any] = {}
        self.resolved: dict[str, type] = {}  # this load's answers of resolve()

    def resolve(self, name: str) -> type:
        """The class a document names, from the allowlist only (nothing is imported here)."""
        found = self.resolved.get(name)
        if found is None:
            found = self.resolved[name] = self._resolve(name)
        return found

    def _resolve(self, name: str) -> type:
        if self.classes is not None:
            found = self.classes.get(name)
        else:
            known = _registry.get(name)
            found = None if known is None else _live(name, known)
        if found is None:
            raise unknown_class(name)
        return found

    def rebuilt(self, obj: Any) -> Any:
        if self.root_fields:
            for cls in type(obj).__mro__:
                name = self.root_fields.get(cls)
                if name is not None:
                    object.__setattr__(obj, name, self.decoder.root)
                    break
        return obj

    def selected(self, node: Any, select: Selection) -> dict[Any, Any]:
        """Only the selected keys of a dict root; for list values only the selected elements."""
        if not (isinstance(node, dict) and node.get("t") == "dict"):
            shown = (
                "a list"
                if isinstance(node, list)
                else f"a {node.get('t')!r} node"
                if isinstance(node, dict)
                else type(node).__name__
            )
            raise ValueError(f"A column selection requires a dictionary payload (the root is {shown})")
        out: dict[Any, Any] = {}
        found: set[Any] = set()
        try:
            items = _list(node["items"])
            for pair in items:
                key_node, value_node = _list(pair)
                key = self.node(key_node, 1)
                if key not in select:
                    continue
                found.add(key)
                indices = select[key]
                if indices is None:
                    out[key] = self.node(value_node, 1)
                    continue
                packed = isinstance(value_node, dict) and value_node.get("t") == "list"
                if packed:
                    value_node = self.node(value_node, 1)  # a packed list: its items are values already
                if not isinstance(value_node, list):
                    raise ValueError(f"select=[{key!r}] lists indices, but that value is not a list")
                for index in indices:
                    if index >= len(value_node):
                        raise ValueError(
                            f"select=[{key!r}] holds index {index}; the list has {len(value_node)}"
                        )
                if packed:
                    out[key] = [value_node[index] for index in indices]
                else:
                    out[key] = [self.node(value_node[index], 2) for index in indices]
        except (KeyError, TypeError) as error:
            raise CorruptData(f"malformed dict root in a sample document: {error!r}") from None
        missing = [key for key in select if key not in found]
        if missing:
            raise KeyError(f"selected keys not in the payload: {missing!r}")
        return out

    def node(self, node: Any, depth: int) -> Any:
        if depth > NESTING_DEPTH_MAX:
            raise CorruptData(f"sample document nests deeper than {NESTING_DEPTH_MAX} levels")
        if node is None or isinstance(node, (bool, int, str)):
            return node
        if isinstance(node, float):
            if not math.isfinite(node):  # a JSON number that overflowed (payload.decode_document)
                raise CorruptData("sample document holds a number too large for a float")
            return node
        if isinstance(node, list):
            if _plain(node):  # token ids, log-probs: JSON scalars (finite numbers) decode to themselves
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


def _packed_list(reader: _Reader, node: Mapping[str, Any], depth: int) -> list[Any]:
    values = array.array(_PACKED[_text(node["dtype"])])
    values.frombytes(base64.b64decode(_text(node["b64"]), validate=True))  # ValueError: not whole items
    if sys.byteorder == "big":
        values.byteswap()
    return values.tolist()


def _part(reader: _Reader, node: Mapping[str, Any], depth: int) -> Any:
    tag = node["t"]
    return reader.referenced(node, "r", "part", lambda r: reader.decoder.part(r, tag, node))


def _dependency(reader: _Reader, node: Mapping[str, Any], depth: int) -> Any:
    tag = node["t"]
    return reader.referenced(node, "d", tag, lambda d: reader.decoder.dependency(d, tag, node))


def _tensor_ref(reader: _Reader, node: Mapping[str, Any], depth: int) -> Any:
    """A nested TensorRef: shared (a dependency, ``d``) or copied into this publication (``r``)."""
    return _part(reader, node, depth) if "r" in node else _dependency(reader, node, depth)


def _npscalar(reader: _Reader, node: Mapping[str, Any], depth: int) -> Any:
    name = node["dtype"]
    if name not in _NUMPY_SCALARS.values():
        raise UnsupportedSchema(f"NumPy scalar dtype {name!r} is not supported")
    return np.dtype(name).type(reader.node(node["v"], depth))


def _enum(reader: _Reader, node: Mapping[str, Any], depth: int) -> Any:
    cls = reader.resolve(_text(node["cls"]))
    if not issubclass(cls, enum.Enum):
        raise UnsupportedSchema(f"{node['cls']} is not an Enum")
    value = reader.node(node["v"], depth)
    if type(value) is str or type(value) is int:  # most members: found by value without a call
        member = cls._value2member_map_.get(value)
        if member is not None:
            return member
    try:
        return cls(value)
    except ValueError:
        raise UnsupportedSchema(f"enum {node['cls']} has no member with value {value!r}") from None


#: Per dataclass: its fields' (name, default, default factory), in declaration order.
_DEFAULTS: dict[type, tuple[tuple[str, Any, Any], ...]] = {}


def _defaults(cls: type) -> tuple[tuple[str, Any, Any], ...]:
    found = _DEFAULTS.get(cls)
    if found is None:  # a class's fields never change once it is made
        found = _DEFAULTS[cls] = tuple(
            (f.name, f.default, f.default_factory) for f in dataclasses.fields(cls)
        )
    return found


#: Per class: the names of data descriptors (slots, properties) its instances' attributes
#: would go through; an instance with a ``__dict__`` and none of these names is filled at once.
_DESCRIPTORS: dict[type, frozenset[str]] = {}


def _descriptors(cls: type) -> frozenset[str]:
    found = _DESCRIPTORS.get(cls)
    if found is None:
        found = _DESCRIPTORS[cls] = frozenset(
            name
            for klass in cls.__mro__[:-1]  # not object's own attributes
            for name, attribute in vars(klass).items()
            if hasattr(type(attribute), "__set__") or hasattr(type(attribute), "__delete__")
        )
    return found


#: Per dataclass: its field names, as a set (a node naming all of them needs no defaults).
_FIELD_NAMES: dict[type, frozenset[str]] = {}


def _field_names(cls: type) -> frozenset[str] | None:
    """The field names of ``cls``, or None when it is not a dataclass."""
    found = _FIELD_NAMES.get(cls)
    if found is None:
        if not dataclasses.is_dataclass(cls):
            return None
        found = _FIELD_NAMES[cls] = frozenset(name for name, _, _ in _defaults(cls))
    return found


def _pairs(pairs: list[Any]) -> dict[str, Any]:
    """A dataclass node's ``[name, node]`` pairs as a dict (built in one C call), each name once."""
    if not set(map(type, pairs)) <= _LIST_ONLY:
        kind = next(type(pair) for pair in pairs if type(pair) is not list)
        raise TypeError(f"a field is a [name, node] pair, got {kind.__name__}")
    try:
        values = dict(pairs)
    except ValueError:  # a pair of another length
        raise TypeError("a field is a [name, node] pair, got a list of another length") from None
    if not set(map(type, values)) <= _STR_ONLY:
        kind = next(type(key) for key in values if type(key) is not str)
        raise TypeError(f"expected a string, got {kind.__name__}")
    if len(values) != len(pairs):
        raise TypeError("a field or attribute is named twice")
    return values


_LIST_ONLY = frozenset({list})
_STR_ONLY = frozenset({str})


def _dataclass(reader: _Reader, node: Mapping[str, Any], depth: int) -> Any:
    name = _text(node["cls"])
    cls = reader.resolve(name)
    names = _field_names(cls)
    if names is None:
        raise UnsupportedSchema(f"{name} is not a dataclass")
    try:
        obj: Any = object.__new__(cls)
    except TypeError as error:
        raise UnsupportedSchema(f"cannot rebuild {name} without calling it: {error}") from None
    values = _pairs(_list(node["fields"]) + _list(node["attrs"]))
    deep = depth > NESTING_DEPTH_MAX  # a field at the nesting limit goes through node(), which refuses it
    for key, value in values.items():  # (values of present keys change: the size does not)
        kind = type(value)
        # A scalar, or a list of scalars (token ids, log-probs), is node()'s answer for itself.
        if deep or (kind not in _PLAIN_TYPES and (kind is not list or not _plain(value))):
            values[key] = reader.node(value, depth)
    for field_name, default, factory in () if values.keys() >= names else _defaults(cls):
        # (only a class that gained fields since publication has some missing)
        if field_name in values:
            continue
        if default is not dataclasses.MISSING:
            values[field_name] = default
        elif factory is not dataclasses.MISSING:
            values[field_name] = factory()
    attributes = getattr(obj, "__dict__", None)
    if attributes is not None and _descriptors(cls).isdisjoint(values):
        attributes.update(values)  # what object.__setattr__ of each would do, in one call
    else:  # slots or descriptors: each attribute through object.__setattr__
        for key, item in values.items():
            try:
                object.__setattr__(obj, key, item)
            except AttributeError:
                raise UnsupportedSchema(
                    f"{name} has no attribute {key!r} (the class changed since publication)"
                ) from None
    return reader.rebuilt(obj)


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
    "list": _packed_list,
    "tuple": _tuple,
    "dict": _dict,
    "bytes": _bytes,
    "bytearray": _bytes,
    "ndarray": _part,
    "tensor": _part,
    "pil": _part,
    "tref": _tensor_ref,
    "payload": _dependency,
    "rset": _dependency,
    "npscalar": _npscalar,
    "enum": _enum,
    "dataclass": _dataclass,
}
