"""Samples as publications: ``publish``/``publish_many`` and the picklable :class:`PayloadRef`.

One sample is one publication: record 0 is the sample.v1 document (codec ``sample.v1``),
records 1..n its parts (``tensor.v1`` for arrays and tensors, ``bytes.v1`` for large byte
strings and image pixels), and its dependencies are the publications of the TensorRefs and
PayloadRefs it nests. Layout and grammar: docs/FORMAT.md section 10.
"""

from __future__ import annotations

import base64
import os
import sys
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import CorruptData, InvalidReference, UnsupportedSchema
from ..protocol import Publication, Record, RecordSetRef, decode, encode_plain
from ..store import ReadSession, SharedFilesystemStore
from ..tensor import TENSOR_CODEC, TensorRef, attach, is_torch_tensor, naming, reader_for, tensor_record
from .schema import Decoder, Selection, allowed_classes, check_selection, decode_sample, encode_sample

__all__ = [
    "BYTES_CODEC",
    "SAMPLE_CODEC",
    "Materialize",
    "NotASample",
    "PayloadRef",
    "encode_publications",
    "load",
    "publish",
    "publish_many",
]

#: ``materialize=``: a bool for every tensor, or a callable deciding per tensor from its kind and
#: its node: ``"tensor"`` (a torch tensor), ``"ndarray"`` (a NumPy array) or ``"tref"`` (a
#: TensorRef nested in the sample). True means a loaded value, False a lazy TensorRef.
Materialize = bool | Callable[[str, str], bool]

#: Codec of the record holding a sample's document.
SAMPLE_CODEC = "sample.v1"
#: Codec of records holding large byte strings and image pixels.
BYTES_CODEC = "bytes.v1"

Reader = ReadSession | SharedFilesystemStore | None


class NotASample(InvalidReference):
    """The publication a sample load was given does not start with a sample document."""


@dataclass(frozen=True)
class PayloadRef:
    """A published sample (or list of samples): small, picklable, loadable in any process.

    ``ref`` is the publication; ``root`` the pool's mount path where it was written or read
    (a hint, not part of its identity). A process that mounts the pool at the same path
    loads it with no setup; ``STRAW_POOL_ROOTS`` remaps a pool mounted elsewhere, and
    ``reader=`` names the pool explicitly (docs/FORMAT.md section 10.3).
    """

    ref: RecordSetRef
    root: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.ref, RecordSetRef):
            raise TypeError(f"a PayloadRef holds a RecordSetRef, got {type(self.ref).__name__}")

    def __repr__(self) -> str:
        manifest = self.ref.manifest
        return f"PayloadRef({manifest.segment.path}#{manifest.ordinal}, digest={self.ref.digest[:16]})"

    def load(
        self,
        *,
        reader: Reader = None,
        materialize: Materialize = False,
        select: Selection | None = None,
        classes: Collection[str] | None = None,
        root_fields: Mapping[type, str] | None = None,
    ) -> Any:
        """The sample, checksum-verified. Tensors come back as lazy TensorRefs unless ``materialize``.

        ``select={key: indices | None}`` decodes only those keys of a dict root (for a list
        value only those elements, in that order; None: the whole value), opening no part or
        dependency of anything else. ``classes`` (``module:qualname`` names) replaces the
        registry as the classes the document may name; a document naming another class raises
        ``UnsupportedSchema`` before anything is imported. ``root_fields={cls: field}`` sets
        that field of rebuilt ``cls`` instances to the reader's pool root.
        """
        materialize = _check_materialize(materialize)
        select = check_selection(select)
        allowed = allowed_classes(classes)
        what = f"sample {self.ref.digest[:16]} ({self.ref.manifest.segment.path}#{self.ref.manifest.ordinal})"
        with naming(what):
            session = reader_for(self.ref.manifest, reader, self.root)
            resolved = session.resolve(self.ref)
            if not resolved.records:
                raise NotASample(f"{what} is an empty record set, not a sample")
            head = resolved.records[0]
            codec = head.entry.codec
            if codec != SAMPLE_CODEC:
                if codec.startswith("sample."):
                    raise UnsupportedSchema(f"{what} has codec {codec!r}; this straw reads {SAMPLE_CODEC}")
                raise NotASample(f"{what} is not a sample publication (its first record is {codec!r})")
            document = decode_document(session.read_record(head.ref()).payload)
            decoder = _StoreDecoder(session, self.ref, resolved, materialize)
            return decode_sample(document, decoder, classes=allowed, select=select, root_fields=root_fields)


def decode_document(data: bytes | bytearray | memoryview) -> Any:
    """The parsed JSON of a sample document, for :func:`decode_sample` only.

    :func:`straw.protocol.decode` with ``check_floats=False``: where the json module parses
    it (orjson, which refuses an overflowing number, takes most documents), numbers go through
    the C float parser instead of a Python callback each (a sample's log-probs are thousands
    of floats): a number too large for a float becomes an infinity there, and ``decode_sample`` refuses
    every non-finite number it meets (``CorruptData``), as the canonical decoder would.
    Invalid JSON or UTF-8, and the NaN and Infinity literals, are ``CorruptData`` at once.
    """
    return decode(data, check_floats=False)


def _check_materialize(materialize: object) -> Materialize:
    if isinstance(materialize, bool) or callable(materialize):
        return materialize
    raise TypeError(f"materialize= is a bool or a callable(kind, node), got {type(materialize).__name__}")


def load(
    ref: PayloadRef | RecordSetRef,
    *,
    reader: Reader = None,
    materialize: Materialize = False,
    select: Selection | None = None,
    classes: Collection[str] | None = None,
    root_fields: Mapping[type, str] | None = None,
) -> Any:
    """Load a published sample from a PayloadRef or the RecordSetRef of its publication.

    The keywords are :meth:`PayloadRef.load`'s. A bare RecordSetRef carries no mount path:
    it is read through ``reader=`` or a pool attached in this process.
    """
    if isinstance(ref, RecordSetRef):
        ref = PayloadRef(ref)
    if not isinstance(ref, PayloadRef):
        raise TypeError(f"expected a PayloadRef or RecordSetRef, got {type(ref).__name__}")
    return ref.load(
        reader=reader, materialize=materialize, select=select, classes=classes, root_fields=root_fields
    )


# --------------------------------------------------------------------------- publishing


class _Special:
    """Types the pure schema does not import: torch tensors, PIL images, TensorRef, PayloadRef.

    A TensorRef of this store's run whose pack is in this store's pool is shared (a dependency,
    no bytes copied); one of another pool or run is read and stored as a part of the new
    publication, so the publication never depends on data its pool does not hold.
    """

    def __init__(self, store: SharedFilesystemStore) -> None:
        self.store = store
        self.local: dict[str, bool] = {}  # pack path -> it exists in this store's pool

    def shares(self, ref: TensorRef) -> bool:
        segment = ref.record_ref.segment
        if segment.run_id != self.store.run_id:
            return False
        known = self.local.get(segment.path)
        if known is None:
            try:
                known = os.path.isfile(self.store.backend.resolve(segment.path))
            except InvalidReference:
                known = False
            self.local[segment.path] = known
        return known

    def __call__(self, value: Any) -> tuple[str, Any] | None:
        if is_torch_tensor(value):
            return "tensor", None
        if isinstance(value, TensorRef):
            if not self.shares(value):
                return "tref-copy", lambda: (_read_tensor(value), value.kind)
            if value.record_set is None:
                raise UnsupportedSchema(f"{value!r} does not name its publication; share() it first")
            return "tref", (value.record_set, {"o": value.ordinal})
        if isinstance(value, PayloadRef):
            return "payload", (value.ref, {})
        image_module = sys.modules.get("PIL.Image")
        if image_module is not None and isinstance(value, image_module.Image):
            return "pil", lambda: _image_parts(value)
        return None


def _read_tensor(ref: TensorRef) -> Any:
    """A foreign TensorRef's values (NumPy when torch is absent and the dtype allows)."""
    if "torch" in sys.modules or ref.dtype == "bfloat16":
        return ref.load()
    return ref.numpy()


def _image_parts(image: Any) -> tuple[bytes, dict[str, Any]]:
    extra: dict[str, Any] = {"mode": image.mode, "size": list(image.size)}
    if image.mode in ("P", "PA") and image.palette is not None:
        mode = image.palette.mode
        extra["palette"] = {
            "mode": mode,
            "b64": base64.b64encode(bytes(image.getpalette(mode))).decode("ascii"),
        }
    return image.tobytes(), extra


def _publication(
    sample: Any,
    name: str,
    kinds: Mapping[str, str] | None,
    metadata: Mapping[str, Any] | None,
    tokens: int,
    special: _Special,
    dependency_fields: Mapping[type, str] | None,
    classes: Collection[str] | None,
) -> tuple[Publication, set[str]]:
    encoded = encode_sample(
        sample,
        name=name,
        kinds=kinds,
        special=special,
        dependency_fields=dependency_fields,
        classes=classes,
    )
    meta = dict(metadata or {})
    records = [Record("sample", encode_plain(encoded.document), SAMPLE_CODEC, meta, tokens)]
    codecs = {SAMPLE_CODEC}
    for part in encoded.parts:
        if part.kind == "tensor":
            try:
                record = tensor_record(part.value, part.record_id, kind=part.tensor_kind, metadata=meta)
            except UnsupportedSchema as error:
                raise UnsupportedSchema(f"{part.record_id}: {error}") from None
            codecs.add(TENSOR_CODEC)
        else:
            record = Record(part.record_id, part.value, BYTES_CODEC, dict(meta))
            codecs.add(BYTES_CODEC)
        records.append(record)
    return Publication(tuple(records), tuple(encoded.dependencies)), codecs


def _check_tokens(tokens: object) -> int:
    if type(tokens) is not int or tokens < 0:
        raise ValueError(f"tokens= is a non-negative integer, got {tokens!r}")
    return tokens


def _check_codecs(store: SharedFilesystemStore, needed: Iterable[str]) -> None:
    missing = sorted(set(needed) - set(store.codecs))
    if missing:
        raise UnsupportedSchema(
            f"the store does not list codec(s) {', '.join(missing)} (codecs: {', '.join(store.codecs)}); "
            "open it with codecs including them"
        )


def publish(
    store: SharedFilesystemStore,
    sample: Any,
    *,
    submission_id: str,
    kinds: Mapping[str, str] | None = None,
    metadata: Mapping[str, Any] | None = None,
    tokens: int = 0,
    dependency_fields: Mapping[type, str] | None = None,
    classes: Collection[str] | None = None,
) -> PayloadRef:
    """Publish one sample (any supported nested value) as one publication.

    ``kinds`` maps a path relative to the sample (``.routes``, ``.metadata["topk"]``) or a
    bare field or key name (``routes``) to a tensor kind; by default a tensor's kind is the
    name of the field or key holding it. ``metadata`` is added to every record (e.g. the
    task and attempt of a queue result); ``tokens`` is counted on the sample's record.
    ``dependency_fields={cls: field}`` stores the RecordSetRef in ``field`` of every ``cls``
    instance as a dependency of this publication (so whatever keeps the publication keeps
    it) and the instance's other fields as data. ``classes`` (``module:qualname`` names),
    when given, limits the enums and dataclasses the sample may hold. A cycle
    (``CyclicValue``, a ``ValueError``) or an unsupported object (``UnsupportedValue``, an
    ``UnsupportedSchema``) raises with its path before anything is written.
    """
    special = _Special(store)
    publication, codecs = _publication(
        sample, "sample", kinds, metadata, _check_tokens(tokens), special, dependency_fields, classes
    )
    _check_codecs(store, codecs)
    dependencies = [d for d in publication.dependencies if isinstance(d, RecordSetRef)]
    ref = store.publish(publication.records, submission_id=submission_id, dependencies=dependencies)
    attach(store)
    return PayloadRef(ref, str(store.backend.root))


def publish_many(
    store: SharedFilesystemStore,
    samples: Sequence[Any],
    *,
    submission_id: str,
    kinds: Mapping[str, str] | None = None,
    metadata: Mapping[str, Any] | Sequence[Mapping[str, Any] | None] | None = None,
    tokens: Sequence[int] | None = None,
    dependency_fields: Mapping[type, str] | None = None,
    classes: Collection[str] | None = None,
) -> list[PayloadRef]:
    """Publish many samples, each its own publication, in one durable write.

    ``metadata`` is one mapping for every record of every sample, or a sequence with one
    mapping (or None) per sample; ``tokens`` likewise one count per sample. The other
    keywords are :func:`publish`'s.
    """
    publications = encode_publications(
        store,
        samples,
        kinds=kinds,
        metadata=metadata,
        tokens=tokens,
        dependency_fields=dependency_fields,
        classes=classes,
    )
    refs = store.publish_many(publications, submission_id=submission_id)
    attach(store)
    root = str(store.backend.root)
    return [PayloadRef(ref, root) for ref in refs]


def encode_publications(
    store: SharedFilesystemStore,
    samples: Sequence[Any],
    *,
    names: Sequence[str] | None = None,
    kinds: Mapping[str, str] | None = None,
    metadata: Mapping[str, Any] | Sequence[Mapping[str, Any] | None] | None = None,
    tokens: Sequence[int] | None = None,
    dependency_fields: Mapping[type, str] | None = None,
    classes: Collection[str] | None = None,
) -> list[Publication]:
    """The publications :func:`publish_many` would write, encoded and checked, nothing written.

    For callers that split many samples over several writes (``store.publish_many``) after
    encoding all of them, so that a bad sample anywhere writes nothing. Payloads are views of
    the samples' own memory: keep the samples unchanged until the write returns. ``names``
    (default ``samples[<i>]``) start the paths that part record ids and errors show.
    """
    if not isinstance(samples, Sequence) or isinstance(samples, (str, bytes)):
        raise TypeError(f"publish_many takes a sequence of samples, got {type(samples).__name__}")
    per_sample = _per_sample(metadata, len(samples))
    counts = [0] * len(samples) if tokens is None else [_check_tokens(n) for n in tokens]
    if len(counts) != len(samples):
        raise ValueError(f"tokens= has {len(counts)} counts for {len(samples)} samples")
    if names is not None and len(names) != len(samples):
        raise ValueError(f"names= has {len(names)} entries for {len(samples)} samples")
    special = _Special(store)
    publications, codecs = [], set()
    for number, sample in enumerate(samples):
        name = names[number] if names is not None else f"samples[{number}]"
        publication, needed = _publication(
            sample, name, kinds, per_sample[number], counts[number], special, dependency_fields, classes
        )
        publications.append(publication)
        codecs |= needed
    _check_codecs(store, codecs)
    return publications


def _per_sample(metadata: object, count: int) -> list[Mapping[str, Any] | None]:
    if metadata is None or isinstance(metadata, Mapping):
        return [metadata] * count
    if isinstance(metadata, (str, bytes)) or not isinstance(metadata, Sequence):
        raise TypeError("metadata= is a mapping, or a sequence with one mapping (or None) per sample")
    if len(metadata) != count:
        raise ValueError(f"metadata= has {len(metadata)} entries for {count} samples")
    for item in metadata:
        if item is not None and not isinstance(item, Mapping):
            raise TypeError(f"metadata= entries are mappings or None, got {type(item).__name__}")
    return list(metadata)


# --------------------------------------------------------------------------- loading


class _StoreDecoder(Decoder):
    def __init__(
        self, session: ReadSession, ref: RecordSetRef, resolved: Any, materialize: Materialize
    ) -> None:
        self.session = session
        self.root = session.root
        self.ref = ref
        self.records = resolved.records
        self.dependencies = resolved.dependencies
        self.materialize = materialize

    def loads(self, tensor: TensorRef, tag: str) -> bool:
        """Whether this tensor comes back loaded (``materialize``) or as a lazy TensorRef."""
        if isinstance(self.materialize, bool):
            return self.materialize
        return bool(self.materialize(tensor.kind, tag))

    def part(self, ordinal: int, tag: str, node: Mapping[str, Any]) -> Any:
        if not 1 <= ordinal < len(self.records):
            raise CorruptData(
                f"sample document names part {ordinal}, the publication has {len(self.records)} records"
            )
        located = self.records[ordinal]
        if tag in ("ndarray", "tensor", "tref"):
            tensor = TensorRef.from_located(located, self.ref, ordinal, self.root)
            if not self.loads(tensor, tag):
                return tensor
            return tensor.numpy(reader=self.session) if tag == "ndarray" else tensor.load(reader=self.session)
        if located.codec != BYTES_CODEC:
            raise CorruptData(f"sample part {ordinal} should be {BYTES_CODEC}, it is {located.codec!r}")
        data = self.session.read_record(located.ref()).payload
        if tag == "pil":
            return _image(data, node)
        return data

    def dependency(self, index: int, tag: str, node: Mapping[str, Any]) -> Any:
        if not 0 <= index < len(self.dependencies):
            raise CorruptData(
                f"sample document names dependency {index}, the publication has {len(self.dependencies)}"
            )
        dependency = self.dependencies[index]
        if tag == "payload":
            return PayloadRef(dependency, self.root)
        if tag == "rset":
            return dependency
        ordinal = node["o"]
        resolved = self.session.resolve(dependency)
        if type(ordinal) is not int or not 0 <= ordinal < len(resolved):
            raise CorruptData(
                f"sample document names tensor {ordinal!r} of a publication of {len(resolved)} records"
            )
        tensor = TensorRef.from_located(resolved.record(ordinal), dependency, ordinal, self.root)
        return tensor.load(reader=self.session) if self.loads(tensor, "tref") else tensor


def _image(data: bytes | bytearray | memoryview, node: Mapping[str, Any]) -> Any:
    try:
        from PIL import Image
    except ImportError:
        raise UnsupportedSchema("this sample holds a PIL image; install Pillow to load it") from None
    mode, size = node["mode"], node["size"]
    if not isinstance(mode, str) or not isinstance(size, list) or len(size) != 2:
        raise CorruptData("malformed image node in a sample document")
    try:
        image = Image.frombytes(mode, (size[0], size[1]), bytes(data))
        palette = node.get("palette")
        if palette is not None:
            image.putpalette(base64.b64decode(palette["b64"], validate=True), rawmode=palette["mode"])
    except (ValueError, TypeError, KeyError) as error:
        raise CorruptData(f"image node does not match its pixels: {error}") from None
    return image
