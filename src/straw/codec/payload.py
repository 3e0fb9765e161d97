"""Samples as publications: ``publish``/``publish_many`` and the picklable :class:`PayloadRef`.

One sample is one publication: record 0 is the sample.v1 document (codec ``sample.v1``),
records 1..n its parts (``tensor.v1`` for arrays and tensors, ``bytes.v1`` for large byte
strings and image pixels), and its dependencies are the publications of the TensorRefs and
PayloadRefs it nests. Layout and grammar: docs/FORMAT.md section 10.
"""

from __future__ import annotations

import base64
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import CorruptData, InvalidReference, UnsupportedSchema
from ..protocol import Publication, Record, RecordSetRef, decode, encode
from ..store import ReadSession, SharedFilesystemStore
from ..tensor import TENSOR_CODEC, TensorRef, attach, is_torch_tensor, naming, reader_for, tensor_record
from .schema import Decoder, decode_sample, encode_sample

__all__ = ["BYTES_CODEC", "SAMPLE_CODEC", "PayloadRef", "load", "publish", "publish_many"]

#: Codec of the record holding a sample's document.
SAMPLE_CODEC = "sample.v1"
#: Codec of records holding large byte strings and image pixels.
BYTES_CODEC = "bytes.v1"

Reader = ReadSession | SharedFilesystemStore | None


@dataclass(frozen=True)
class PayloadRef:
    """A published sample (or list of samples): small, picklable, loadable in any process.

    ``ref`` is the publication. Loading needs the pool: ``reader=``, or a pool attached
    in this process (``straw.tensor.attach(<mount path>)`` or ``STRAW_POOL_ROOTS``).
    """

    ref: RecordSetRef
    #: The pool's mount path where it was published: read from there when no attached pool
    #: (or STRAW_POOL_ROOTS) holds it, so a pickled reference loads in a fresh process.
    root: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.ref, RecordSetRef):
            raise TypeError(f"a PayloadRef holds a RecordSetRef, got {type(self.ref).__name__}")

    def __repr__(self) -> str:
        manifest = self.ref.manifest
        return f"PayloadRef({manifest.segment.path}#{manifest.ordinal}, digest={self.ref.digest[:16]})"

    def load(self, *, reader: Reader = None, materialize: bool = False) -> Any:
        """The sample, checksum-verified. Tensors come back as lazy TensorRefs unless ``materialize``."""
        what = f"sample {self.ref.digest[:16]} ({self.ref.manifest.segment.path}#{self.ref.manifest.ordinal})"
        with naming(what):
            session = reader_for(self.ref.manifest, reader, self.root)
            resolved = session.resolve(self.ref)
            if not resolved.records:
                raise InvalidReference(f"{what} is an empty record set, not a sample")
            head = resolved.records[0]
            codec = head.entry.codec
            if codec != SAMPLE_CODEC:
                if codec.startswith("sample."):
                    raise UnsupportedSchema(f"{what} has codec {codec!r}; this straw reads {SAMPLE_CODEC}")
                raise InvalidReference(f"{what} is not a sample publication (its first record is {codec!r})")
            document = decode(session.read_record(head.ref()).payload)
            return decode_sample(document, _StoreDecoder(session, self.ref, resolved, materialize, self.root))


def load(ref: PayloadRef | RecordSetRef, *, reader: Reader = None, materialize: bool = False) -> Any:
    """Load a published sample from a PayloadRef or the RecordSetRef of its publication."""
    if isinstance(ref, RecordSetRef):
        ref = PayloadRef(ref)
    if not isinstance(ref, PayloadRef):
        raise TypeError(f"expected a PayloadRef or RecordSetRef, got {type(ref).__name__}")
    return ref.load(reader=reader, materialize=materialize)


# --------------------------------------------------------------------------- publishing


def _special(value: Any) -> tuple[str, Any] | None:
    """Types the pure schema does not import: torch tensors, PIL images, TensorRef, PayloadRef."""
    if is_torch_tensor(value):
        return "tensor", None
    if isinstance(value, TensorRef):
        if value.record_set is None:
            raise UnsupportedSchema(f"{value!r} does not name its publication; share() it first")
        return "tref", (value.record_set, {"o": value.ordinal})
    if isinstance(value, PayloadRef):
        return "payload", (value.ref, {})
    image_module = sys.modules.get("PIL.Image")
    if image_module is not None and isinstance(value, image_module.Image):
        return "pil", lambda: _image_parts(value)
    return None


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
    sample: Any, name: str, kinds: Mapping[str, str] | None, metadata: Mapping[str, Any] | None, tokens: int
) -> tuple[Publication, set[str]]:
    encoded = encode_sample(sample, name=name, kinds=kinds, special=_special)
    meta = dict(metadata or {})
    records = [Record("sample", encode(encoded.document), SAMPLE_CODEC, meta, tokens)]
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
) -> PayloadRef:
    """Publish one sample (any supported nested value) as one publication.

    ``kinds`` maps a path relative to the sample (``.routes``, ``.metadata["topk"]``) or a
    bare field or key name (``routes``) to a tensor kind; by default a tensor's kind is the
    name of the field or key holding it. ``metadata`` is added to every record (e.g. the
    task and attempt of a queue result); ``tokens`` is counted on the sample's record.
    A cycle (``ValueError``) or an unsupported object (``UnsupportedSchema``) raises with
    its path before anything is written.
    """
    publication, codecs = _publication(sample, "sample", kinds, metadata, tokens)
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
    metadata: Mapping[str, Any] | None = None,
) -> list[PayloadRef]:
    """Publish many samples, each its own publication, in one durable write."""
    publications, codecs = [], set()
    for number, sample in enumerate(samples):
        publication, needed = _publication(sample, f"samples[{number}]", kinds, metadata, 0)
        publications.append(publication)
        codecs |= needed
    _check_codecs(store, codecs)
    refs = store.publish_many(publications, submission_id=submission_id)
    attach(store)
    root = str(store.backend.root)
    return [PayloadRef(ref, root) for ref in refs]


# --------------------------------------------------------------------------- loading


class _StoreDecoder(Decoder):
    def __init__(
        self, session: ReadSession, ref: RecordSetRef, resolved: Any, materialize: bool, root: str | None
    ) -> None:
        self.root = root
        self.session = session
        self.ref = ref
        self.records = resolved.records
        self.dependencies = resolved.dependencies
        self.materialize = materialize

    def part(self, ordinal: int, tag: str, node: Mapping[str, Any]) -> Any:
        if not 1 <= ordinal < len(self.records):
            raise CorruptData(
                f"sample document names part {ordinal}, the publication has {len(self.records)} records"
            )
        located = self.records[ordinal]
        if tag in ("ndarray", "tensor"):
            tensor = TensorRef.from_entry(located.ref(), located.entry, self.ref, ordinal, self.root)
            if not self.materialize:
                return tensor
            return tensor.numpy(reader=self.session) if tag == "ndarray" else tensor.load(reader=self.session)
        if located.entry.codec != BYTES_CODEC:
            raise CorruptData(f"sample part {ordinal} should be {BYTES_CODEC}, it is {located.entry.codec!r}")
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
        ordinal = node["o"]
        records = self.session.resolve(dependency).records
        if type(ordinal) is not int or not 0 <= ordinal < len(records):
            raise CorruptData(
                f"sample document names tensor {ordinal!r} of a publication of {len(records)} records"
            )
        located = records[ordinal]
        tensor = TensorRef.from_entry(located.ref(), located.entry, dependency, ordinal, self.root)
        return tensor.load(reader=self.session) if self.materialize else tensor


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
