"""The sample codec: whole nested samples as one publication, never pickle.

``publish(store, sample, submission_id=...)`` stores nested dicts, lists, tuples, scalars,
bytes, NumPy arrays and scalars, torch tensors, PIL images, enums and dataclasses (with
extra instance attributes) as one sample.v1 document plus typed tensor records, and returns
a small picklable :class:`PayloadRef`; ``PayloadRef.load()`` rebuilds the sample, with
tensors as lazy ``TensorRef``s unless ``materialize=True``. A load rebuilds only classes
registered with :func:`register` (or listed in ``classes=``): stored bytes never make straw
import a module. Format: docs/FORMAT.md section 10.
"""

from __future__ import annotations

from .payload import (
    BYTES_CODEC,
    SAMPLE_CODEC,
    Materialize,
    NotASample,
    PayloadRef,
    encode_publications,
    load,
    publish,
    publish_many,
)
from .schema import (
    SCHEMA_VERSION,
    CyclicValue,
    UnknownClass,
    UnsupportedValue,
    decode_sample,
    encode_sample,
    register,
    registered,
)

__all__ = [
    "BYTES_CODEC",
    "SAMPLE_CODEC",
    "SCHEMA_VERSION",
    "CyclicValue",
    "Materialize",
    "NotASample",
    "PayloadRef",
    "UnknownClass",
    "UnsupportedValue",
    "decode_sample",
    "encode_publications",
    "encode_sample",
    "load",
    "publish",
    "publish_many",
    "register",
    "registered",
]
