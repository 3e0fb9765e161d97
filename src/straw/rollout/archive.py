"""Debug rollout archives: saving a rollout step's samples, reading them back, replaying them.

An archive is an immutable index file ``<name>.straw.json`` (ROLLOUT.md section 17.4) naming
one publication in a pool, the archive's *contents*: either the samples themselves in chunks
of :data:`ARCHIVE_CHUNK_SAMPLES` (``{chunks: [DiskPayloadRef], entries}``) or, when the
rollout is already an accepted raw collection of the same pool, that collection
(``{raw: RawRolloutRef, entries}``), so nothing is written twice. A named owner
``archive:<index path>:<digest>`` keeps the contents and everything they reach alive, whatever
the queue consumes or GC collects, until :meth:`RolloutArchive.release`.

A ``.pt`` dump is the self-contained alternative: plain dicts and real tensors, readable with
``torch.load(weights_only=True)`` after the pool is gone.

A train-only replay (section 15.4) binds the pool and run of its archives
(:func:`bind_archive_pool`) and accepts their contents into a new ``debug:`` queue of that pool
(:class:`ArchiveReplay`); the source job's queue is never opened.
"""

from __future__ import annotations

import copy
import dataclasses
import glob
import json
import logging
import os
import re
import string
import threading
import uuid
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..errors import InvalidReference
from ..protocol import CommitReceipt, Lease, RecordSetRef
from ..reporting import remove_report, sync_tree, write_report
from ..store import POOL_MARKER, ReadSession, SharedFilesystemStore
from .codec import STORE_CODECS, SampleCodec, decode_value
from .config import RolloutConfig, check_debug_template
from .pool import open_reader, rollout_store
from .refs import DiskPayloadRef, RawRolloutRef
from .sample import QUEUE_ATTRIBUTES, Sample, SampleStatus, iter_samples

__all__ = [
    "ARCHIVE_CHUNK_SAMPLES",
    "ARCHIVE_FORMAT",
    "ARCHIVE_VERSION",
    "PRIVATE_POOL_DIR",
    "PRIVATE_RUN_ID",
    "ArchiveReplay",
    "RolloutArchive",
    "archive_paths",
    "bind_archive_pool",
    "debug_path",
    "load_debug_rollout_data",
    "read_archive_index",
    "save_debug_rollout_data",
]

log = logging.getLogger("straw.rollout.archive")

ARCHIVE_FORMAT = "straw.rollout-archive"
ARCHIVE_VERSION = 1
#: An archive index is a small JSON document; anything larger is not one.
ARCHIVE_INDEX_BYTES_MAX = 1 << 20
#: Samples per archive chunk publication: a lookup by key decodes one chunk, not the archive,
#: and an archive of a large rollout is a few publications, never one per sample.
ARCHIVE_CHUNK_SAMPLES = 64
#: The private pool beside an index saved without a job store, and its writers' run.
PRIVATE_POOL_DIR = "straw-data"
PRIVATE_RUN_ID = "debug-rollout"
_FIELD = re.compile(r"\{rollout_id[^}]*\}")


# --------------------------------------------------------------------------- the index


def read_archive_index(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The parsed index of an archive; ``ValueError`` when it is not a version 1 archive index."""
    where = os.fspath(path)
    problem = f"Unsupported straw rollout archive: {where}"
    with open(where, "rb") as handle:
        data = handle.read(ARCHIVE_INDEX_BYTES_MAX + 1)
    if len(data) > ARCHIVE_INDEX_BYTES_MAX:
        raise ValueError(problem)
    try:
        index = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        raise ValueError(problem) from None
    if (
        not isinstance(index, dict)
        or index.get("format") != ARCHIVE_FORMAT
        or index.get("version") != ARCHIVE_VERSION
    ):
        raise ValueError(problem)
    root, run_id = index.get("root"), index.get("run_id")
    if not isinstance(root, str) or not os.path.isabs(root) or not isinstance(run_id, str) or not run_id:
        raise ValueError(problem)
    return index


def _index_manifest(index: Mapping[str, Any], where: str) -> RecordSetRef:
    try:
        return RecordSetRef.from_dict(index["manifest"])
    except (KeyError, TypeError, ValueError, InvalidReference):
        raise ValueError(f"Unsupported straw rollout archive: {where}") from None


def bind_archive_pool(config: RolloutConfig) -> RolloutConfig:
    """``config`` bound to the pool and run of the archive its replay template names.

    The template is formatted with ``--start-rollout-id`` when set; otherwise its field is
    globbed and the first match in sorted order is read. The flags' pool and run are
    overridden; the argument is never changed.
    """
    template = config.load_debug_rollout_data
    if template is None or not template.endswith(".straw.json"):
        raise ValueError("bind_archive_pool needs a --load-debug-rollout-data template ending in .straw.json")
    check_debug_template(template)
    if config.start_rollout_id is not None:
        path = os.path.expanduser(template.format(rollout_id=config.start_rollout_id))
        if not os.path.isfile(path):
            raise FileNotFoundError(f"No Straw rollout archive matches {template}")
    else:
        pattern = _FIELD.sub("*", glob.escape(template))
        matches = sorted(glob.glob(os.path.expanduser(pattern)))
        if not matches:
            raise FileNotFoundError(f"No Straw rollout archive matches {template}")
        path = matches[0]
    index = read_archive_index(path)
    return dataclasses.replace(
        config, rollout_data_dir=os.path.abspath(index["root"]), rollout_queue_run_id=index["run_id"]
    )


# --------------------------------------------------------------------------- paths


def _field_spec(template: str) -> str:
    check_debug_template(template)
    for _, name, spec, conversion in string.Formatter().parse(template):
        if name == "rollout_id":
            return (spec or "") + (f"!{conversion}" if conversion else "")
    return ""  # pragma: no cover - check_debug_template found the field


def debug_path(template: str, rollout_id: int, *, evaluation: bool = False) -> Path:
    """The file a debug template names for a rollout id (``eval_<id>`` for an evaluation)."""
    if isinstance(rollout_id, bool) or not isinstance(rollout_id, int) or rollout_id < 0:
        raise ValueError(f"rollout_id must be a non-negative integer, got {rollout_id!r}")
    if evaluation:
        if _field_spec(template):
            raise ValueError(
                f"Evaluation archives need a {{rollout_id}} field without a format spec: {template}"
            )
        text = template.format(rollout_id=f"eval_{rollout_id}")
    else:
        check_debug_template(template)
        text = template.format(rollout_id=rollout_id)
    return Path(os.path.abspath(os.path.expanduser(text)))


def archive_paths(template: str) -> list[tuple[int, bool, Path]]:
    """Every existing file a debug template names: ``(rollout id, evaluation, path)``, sorted.

    Used by a rollback to remove the archives and dumps of later steps (ROLLOUT.md R7).
    """
    check_debug_template(template)
    expanded = os.path.expanduser(template)
    (before, after) = _FIELD.split(expanded, maxsplit=1)
    pattern = re.compile(re.escape(before) + r"(eval_)?(\d+)" + re.escape(after) + r"\Z")
    found = []
    for name in glob.glob(glob.escape(before) + "*" + glob.escape(after)):
        match = pattern.match(name)
        if match is not None:
            found.append((int(match.group(2)), match.group(1) is not None, Path(os.path.abspath(name))))
    return sorted(found)


# --------------------------------------------------------------------------- entries


def _flatten(samples: Any) -> list[Sample]:
    """The samples of a list, nested lists, or an evaluation dict ``{name: {"samples": [...]}}``."""
    if isinstance(samples, Mapping):
        flat: list[Sample] = []
        for name, value in samples.items():
            if not isinstance(value, Mapping) or "samples" not in value:
                raise TypeError(f"evaluation data {name!r} must be a dict with a 'samples' list")
            flat.extend(iter_samples(list(value["samples"])))
        return flat
    if isinstance(samples, Sample):
        return [samples]
    if not isinstance(samples, (list, tuple)):
        raise TypeError(f"expected a list of Samples, got {type(samples).__name__}")
    return list(iter_samples(samples))


def _task_key(sample: Sample) -> str | None:
    for name in ("_queue_receipt", "_queue_lease"):
        value = getattr(sample, name, None)
        if isinstance(value, (Lease, CommitReceipt)):
            return value.task_id
        if isinstance(value, Mapping) and isinstance(value.get("task_id"), str):
            return str(value["task_id"])
    return None


def _sample_key(sample: Sample, ordinal: int) -> str:
    index = sample.index
    if isinstance(index, int) and not isinstance(index, bool):
        return f"sample:{index}"
    return f"position:{ordinal}"


def _stripped(sample: Sample) -> Sample:
    """A shallow copy without the queue's private attributes (provenance is public and kept)."""
    if not any(name in vars(sample) for name in QUEUE_ATTRIBUTES):
        return sample
    out = copy.copy(sample)
    for name in QUEUE_ATTRIBUTES:
        out.__dict__.pop(name, None)
    return out


def _entries(samples: Sequence[Sample], locations: Sequence[tuple[int, int]]) -> list[dict[str, Any]]:
    return [
        {"sample_key": _sample_key(sample, ordinal), "task_key": _task_key(sample), "chunk": c, "offset": o}
        for ordinal, (sample, (c, o)) in enumerate(zip(samples, locations, strict=True))
    ]


def _resolve_list(value: Any, reader: ReadSession | SharedFilesystemStore) -> list[Any]:
    """A raw collection's payload as a list: references to lists are followed."""
    for _ in range(ARCHIVE_CHUNK_SAMPLES):  # a collection is at most a reference to a list
        if not isinstance(value, DiskPayloadRef):
            break
        value = value.load(reader=reader)
    if not isinstance(value, list):
        raise ValueError(f"A raw rollout collection holds a list, got {type(value).__name__}")
    return value


def _unit_samples(item: Any, reader: ReadSession | SharedFilesystemStore) -> list[Sample]:
    """The samples of one item of a raw collection (a group reference, a group, a Sample)."""
    pending: list[Any] = [item]
    out: list[Sample] = []
    while pending:  # bounded by the references the payloads hold (each is loaded once)
        value = pending.pop()
        if isinstance(value, DiskPayloadRef):
            pending.append(value.load(reader=reader))
        elif isinstance(value, Sample):
            out.append(value)
        elif isinstance(value, (list, tuple)):
            pending.extend(reversed(value))
        else:
            raise TypeError(f"a raw rollout collection holds groups of Samples, got {type(value).__name__}")
    return out


# --------------------------------------------------------------------------- the archive


class _ArchiveCodec:
    """Loads publications of an archive's pool through its read session (no writer is opened)."""

    def __init__(self, session: ReadSession) -> None:
        self.session = session

    def load(self, ref: RecordSetRef, *, selection: Mapping[Any, Sequence[int] | None] | None = None) -> Any:
        return decode_value(ref, reader=self.session, selection=selection)


class RolloutArchive:
    """One archived rollout step, opened for reading (ROLLOUT.md section 15.2).

    ``RolloutArchive(path, root=None)`` reads the index and opens a reader at ``root`` (a
    mount path of the archive's pool, default the one the index records). Closing closes the
    reader only; the data stays retained until :meth:`release`.
    """

    def __init__(self, path: str | os.PathLike[str], *, root: str | os.PathLike[str] | None = None) -> None:
        self.path = Path(os.path.abspath(os.path.expanduser(os.fspath(path))))
        self.index = read_archive_index(self.path)
        self.manifest = _index_manifest(self.index, str(self.path))
        self.root = os.path.abspath(os.fspath(root)) if root is not None else str(self.index["root"])
        self._session = open_reader(self.root, self.manifest.manifest.segment.run_id)
        self.codec = _ArchiveCodec(self._session)
        self._entries: list[dict[str, Any]] | None = None
        self._raw: list[Any] | None = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"RolloutArchive({str(self.path)!r}, samples={self.index.get('samples')})"

    def __enter__(self) -> RolloutArchive:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the reader; nothing is released."""
        self._session.close()

    # -- saving ------------------------------------------------------------------------

    @classmethod
    def save(
        cls,
        path: str | os.PathLike[str],
        samples: Any,
        *,
        rollout_id: int,
        evaluation: bool = False,
        config: RolloutConfig | None = None,
        reference: RawRolloutRef | None = None,
    ) -> Path:
        """Archive ``samples`` under the index ``path`` and return the index path.

        With ``config`` the job's writer stores the chunks (lazy tensors already in its pool
        are shared, not copied); without, a private pool ``<index dir>/straw-data`` does.
        ``reference`` (an accepted raw collection of that pool holding these samples) is
        archived as is: nothing is republished.
        """
        target = Path(os.path.abspath(os.path.expanduser(os.fspath(path))))
        if isinstance(rollout_id, bool) or not isinstance(rollout_id, int):
            raise TypeError(f"rollout_id must be an integer, got {rollout_id!r}")
        if os.path.lexists(target):
            raise FileExistsError(f"Rollout archives are immutable; choose a new path: {target}")
        flat = _flatten(samples)
        if reference is not None and not isinstance(reference, RawRolloutRef):
            raise TypeError(f"reference= is an accepted RawRolloutRef, got {type(reference).__name__}")
        target.parent.mkdir(parents=True, exist_ok=True)
        if config is not None:
            bound = rollout_store(config)
            store, codec, lock, private = bound.store, bound.codec, bound.lock, False
        else:
            pool = target.parent / PRIVATE_POOL_DIR
            store = SharedFilesystemStore(pool, PRIVATE_RUN_ID, codecs=STORE_CODECS, online_gc=True)
            codec, lock, private = SampleCodec(store), threading.RLock(), True
        try:
            return _save(target, flat, store, codec, lock, rollout_id, evaluation, reference)
        finally:
            if private:
                store.close()

    # -- reading -----------------------------------------------------------------------

    def _all_entries(self) -> list[dict[str, Any]]:
        with self._lock:
            if self._entries is None:
                value = self.codec.load(self.manifest, selection={"entries": None})
                entries = value["entries"]
                if not isinstance(entries, list):
                    raise ValueError(f"Unsupported straw rollout archive: {self.path}")
                self._entries = entries
            return self._entries

    def keys(self) -> list[tuple[str, str | None]]:
        """``(sample key, task key or None)`` of every archived sample, in archive order."""
        return [(e["sample_key"], e["task_key"]) for e in self._all_entries()]

    def __len__(self) -> int:
        return len(self._all_entries())

    def _is_raw(self) -> bool:
        with self._lock:
            if self._raw is None:
                try:
                    value = self.codec.load(self.manifest, selection={"raw": None})
                except KeyError:
                    self._raw = []
                else:
                    raw = value["raw"]
                    if not isinstance(raw, RawRolloutRef):
                        raise ValueError(f"Unsupported straw rollout archive: {self.path}")
                    self._raw = [raw]
            return bool(self._raw)

    def reference(self) -> RawRolloutRef | None:
        """The accepted raw collection this archive holds by reference, or None (chunks)."""
        return self._raw[0] if self._is_raw() and self._raw else None

    def chunk_refs(self, chunks: Iterable[int] | None = None) -> list[DiskPayloadRef]:
        """The chunk publications (all, or those listed), for an archive saved as chunks."""
        if self._is_raw():
            raise ValueError(f"Archive {self.path} holds an accepted raw collection, not chunks")
        selection = None if chunks is None else list(chunks)
        value = self.codec.load(self.manifest, selection={"chunks": selection})
        return list(value["chunks"])

    def _load_units(self, units: list[int]) -> dict[int, list[Sample]]:
        loaded: dict[int, list[Sample]] = {}
        if not units:
            return loaded
        if self._is_raw():
            raw = self.reference()
            items = _resolve_list(raw, self._session)
            for unit in units:
                loaded[unit] = _unit_samples(items[unit], self._session)
            return loaded
        refs = self.chunk_refs(units)
        for unit, ref in zip(units, refs, strict=True):
            chunk = ref.load(reader=self._session)
            if not isinstance(chunk, list):
                raise ValueError(f"Unsupported straw rollout archive chunk in {self.path}")
            loaded[unit] = chunk
        return loaded

    def load_samples(self, *, sample_key: str | None = None, task_key: str | None = None) -> list[Sample]:
        """The archived samples matching every key given (all of them without keys).

        Always a list (compact trajectories share an index). Only the chunks holding the
        matches are decoded; tensors stay lazy TensorRefs naming the archived records; the
        queue's private attributes are removed. Keys given and nothing found: ``KeyError``.
        """
        entries = self._all_entries()
        chosen = [
            e
            for e in entries
            if (sample_key is None or e["sample_key"] == sample_key)
            and (task_key is None or e["task_key"] == task_key)
        ]
        if (sample_key is not None or task_key is not None) and not chosen:
            raise KeyError((sample_key, task_key))
        loaded = self._load_units(sorted({int(e["chunk"]) for e in chosen}))
        out = []
        for entry in chosen:
            samples = loaded[int(entry["chunk"])]
            offset = int(entry["offset"])
            if not 0 <= offset < len(samples):
                raise ValueError(f"Archive {self.path} names sample {offset} of a chunk of {len(samples)}")
            out.append(_stripped(samples[offset]))
        return out

    def export_pt(self, path: str | os.PathLike[str]) -> Path:
        """Write every sample to a self-contained ``.pt`` dump (real tensors); returns its path."""
        rollout_id = self.index.get("rollout_id")
        return _save_pt(Path(os.fspath(path)), self.load_samples(), rollout_id)

    def release(self) -> bool:
        """Release the archive's owner; False when it was already released. The index stays.

        Payloads no other owner (a checkpoint, a queue, another archive) reaches become
        collectable.
        """
        owner = self.index.get("storage_owner")
        if not isinstance(owner, str) or not owner:
            raise ValueError(f"Unsupported straw rollout archive: {self.path}")
        if not os.path.isfile(os.path.join(self.root, POOL_MARKER)):
            return False  # the pool is gone (or not mounted here): nothing is retained in it
        store = SharedFilesystemStore(self.root, self.manifest.manifest.segment.run_id, codecs=STORE_CODECS)
        try:
            return release_owner(store, owner)
        finally:
            store.close()


def release_owner(store: SharedFilesystemStore, owner: str) -> bool:
    """Release a named owner; False when the catalog no longer records it."""
    try:
        store.release(owner)
    except KeyError:
        return False
    return True


def _check_reference(reference: RawRolloutRef, store: SharedFilesystemStore) -> None:
    same_pool = os.path.realpath(reference.root or "") == os.path.realpath(str(store.backend.root))
    if not same_pool or reference.manifest.manifest.segment.run_id != store.run_id:
        raise ValueError("An archive reference must belong to its storage pool")
    store.validate(reference.manifest)


def _reference_locations(
    reference: RawRolloutRef, flat: Sequence[Sample], store: SharedFilesystemStore
) -> tuple[list[Sample], list[tuple[int, int]]]:
    """The stored samples of an archived raw collection and where each one lies in it."""
    items = _resolve_list(reference, store)
    stored: list[Sample] = []
    locations: list[tuple[int, int]] = []
    for unit, item in enumerate(items):
        samples = _unit_samples(item, store)
        stored.extend(samples)
        locations.extend((unit, offset) for offset in range(len(samples)))
    given = [_sample_key(s, i) for i, s in enumerate(flat)]
    if given != [_sample_key(s, i) for i, s in enumerate(stored)]:
        raise ValueError(
            "An archive reference must hold exactly the archived samples "
            f"({len(stored)} stored, {len(flat)} given)"
        )
    return stored, locations


def _save(
    target: Path,
    flat: list[Sample],
    store: SharedFilesystemStore,
    codec: SampleCodec,
    lock: threading.RLock,
    rollout_id: int,
    evaluation: bool,
    reference: RawRolloutRef | None,
) -> Path:
    """Publish the contents, retain them, end their staging, then write the index (last)."""
    prefix = f"archive:{target}:"
    for stale in store.owners(prefix):  # a crash before an earlier index write left them
        release_owner(store, stale)
    root = str(store.backend.root)
    staged: list[RecordSetRef] = []
    with lock:
        if reference is not None:
            _check_reference(reference, store)
            stored, locations = _reference_locations(reference, flat, store)
            contents: dict[str, Any] = {"raw": reference, "entries": _entries(stored, locations)}
        else:
            chunks = [
                [_stripped(s) for s in flat[start : start + ARCHIVE_CHUNK_SAMPLES]]
                for start in range(0, len(flat), ARCHIVE_CHUNK_SAMPLES)
            ]
            ids = [f"debug-chunk:{uuid.uuid4().hex}" for _ in chunks]
            staged = codec.publish_many(chunks, submission_ids=ids) if chunks else []
            locations = [(c, o) for c, chunk in enumerate(chunks) for o in range(len(chunk))]
            contents = {
                "chunks": [DiskPayloadRef(r, root) for r in staged],
                "entries": _entries(flat, locations),
            }
        manifest = codec.publish(contents, submission_id=f"debug-index:{uuid.uuid4().hex}")
    owner = f"{prefix}{manifest.digest}"
    store.retain(owner, [manifest])  # K2: retained before the index names it (I18)
    store.release_publications([*staged, manifest])
    index = {
        "format": ARCHIVE_FORMAT,
        "version": ARCHIVE_VERSION,
        "rollout_id": rollout_id,
        "evaluation": bool(evaluation),
        "root": root,
        "run_id": store.run_id,
        "manifest": dataclasses.asdict(manifest),
        "storage_owner": owner,
        "samples": len(contents["entries"]),
    }
    return write_report(target, index)  # K2: the index last


# --------------------------------------------------------------------------- .pt dumps


def _portable(value: Any, where: str) -> Any:
    """``value`` as what ``torch.load(weights_only=True)`` reads: containers, scalars, tensors."""
    import numpy as np
    import torch

    from ..tensor import TensorRef

    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    if isinstance(value, SampleStatus):
        return value.value
    if isinstance(value, TensorRef):
        return value.load()
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(value).copy())
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, list):
        return [_portable(item, f"{where}[{i}]") for i, item in enumerate(value)]
    if isinstance(value, tuple):
        return tuple(_portable(item, f"{where}[{i}]") for i, item in enumerate(value))
    if isinstance(value, dict):
        return {key: _portable(item, f"{where}[{key!r}]") for key, item in value.items()}
    raise TypeError(
        f"A .pt rollout dump holds plain values and tensors; {where} is a {type(value).__module__}."
        f"{type(value).__qualname__} (use a .straw.json archive)"
    )


def _save_pt(path: Path, samples: Sequence[Sample], rollout_id: Any) -> Path:
    import torch

    target = Path(os.path.abspath(os.path.expanduser(os.fspath(path))))
    dicts = [_portable(sample.to_dict(), f"sample {i}") for i, sample in enumerate(samples)]
    target.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"rollout_id": rollout_id, "samples": dicts}, str(target))
    sync_tree(target)  # durable before anyone is told it exists
    return target


# --------------------------------------------------------------------------- save / load


def save_debug_rollout_data(
    template: str | None,
    samples: Any,
    *,
    rollout_id: int,
    evaluation: bool = False,
    config: RolloutConfig | None = None,
    reference: RawRolloutRef | None = None,
) -> Path | None:
    """Save a rollout step's samples where ``template`` says; None without a template.

    ``.straw.json`` writes a :class:`RolloutArchive` (``config`` and ``reference`` as there);
    ``.pt`` a self-contained dump. Evaluation data (``{name: {"samples": [...]}}``) is
    flattened and saved as ``eval_<id>``.
    """
    if template is None:
        return None
    path = debug_path(template, rollout_id, evaluation=evaluation)
    if template.endswith(".straw.json"):
        return RolloutArchive.save(
            path, samples, rollout_id=rollout_id, evaluation=evaluation, config=config, reference=reference
        )
    return _save_pt(path, [_stripped(s) for s in _flatten(samples)], rollout_id)


def subsample(samples: Sequence[Sample], ratio: float | None) -> list[Sample]:
    """The first and last ``int(len × ratio) // 2`` samples (all of them without a ratio)."""
    if ratio is None:
        return list(samples)
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
        raise ValueError(f"--load-debug-rollout-data-subsample must be in (0, 1], got {ratio!r}")
    half = int(len(samples) * ratio) // 2
    if half == 0:
        return []
    return [*samples[:half], *samples[len(samples) - half :]]


def load_pt(path: str | os.PathLike[str]) -> list[Sample]:
    """The samples of a ``.pt`` dump (read with ``weights_only=True``: nothing is unpickled)."""
    import torch

    data = torch.load(os.fspath(path), weights_only=True)
    if not isinstance(data, dict) or not isinstance(data.get("samples"), list):
        raise ValueError(f"{os.fspath(path)} is not a rollout dump (a dict with a 'samples' list)")
    return [Sample.from_dict(item) for item in data["samples"]]


def load_debug_rollout_data(
    template: str, *, rollout_id: int, subsample_ratio: float | None = None
) -> list[Sample]:
    """The samples a debug template names for ``rollout_id``, optionally subsampled."""
    path = debug_path(template, rollout_id)
    if template.endswith(".straw.json"):
        with RolloutArchive(path) as archive:
            samples = archive.load_samples()
    else:
        samples = load_pt(path)
    return subsample(samples, subsample_ratio)


def remove_archive(path: Path, store: SharedFilesystemStore | None = None) -> bool:
    """Release an archive's owner and remove its index (or remove a ``.pt`` dump).

    ``store`` (a writer of the job's pool) releases the owner when the archive lives in that
    pool; an archive of another pool is released through a store of its own. Returns whether
    the file existed. A rollback calls it for the archives of later steps (ROLLOUT.md R7).
    """
    if path.name.endswith(".straw.json"):
        try:
            index = read_archive_index(path)
        except FileNotFoundError:
            return False
        except ValueError:
            index = {}  # not an index we wrote: nothing to release, the file still goes
        owner = index.get("storage_owner")
        if isinstance(owner, str) and owner:
            if store is not None and os.path.realpath(str(index["root"])) == os.path.realpath(
                str(store.backend.root)
            ):
                release_owner(store, owner)
            else:
                with RolloutArchive(path) as archive:
                    archive.release()
    return remove_report(path)


# --------------------------------------------------------------------------- train-only replay


class ArchiveReplay:
    """Feeds archived rollouts to a train-only job instead of generating them (section 15.4).

    ``collect(rollout_id)`` returns the archived samples and an accepted raw collection of
    the replay's own queue (a ``debug:`` queue in the archive's pool). A whole ``.straw.json``
    archive is accepted by reference: the collection's record only names the archive's raw
    collection or chunk records, so no Sample is encoded again and no tensor is read. With
    ``--load-debug-rollout-data-subsample``, or from a ``.pt`` dump, the samples are loaded and
    accepted as a new collection. The BatchBuilder then converts the collection as usual.
    """

    def __init__(self, config: RolloutConfig, controller: Any) -> None:
        if not isinstance(config, RolloutConfig):
            raise TypeError(f"ArchiveReplay takes a RolloutConfig, got {type(config).__name__}")
        template = config.load_debug_rollout_data
        if template is None:
            raise ValueError("ArchiveReplay needs --load-debug-rollout-data")
        check_debug_template(template)
        if controller is None:
            raise ValueError("ArchiveReplay needs the replay job's controller")
        self.config = config
        self.controller = controller
        self.template = template

    def collect(self, rollout_id: int) -> tuple[list[Sample], RawRolloutRef]:
        """The samples archived for ``rollout_id`` and their accepted raw collection."""
        from .collection import accept_raw_rollout

        ratio = self.config.load_debug_rollout_data_subsample
        if self.template.endswith(".straw.json") and ratio is None:
            with RolloutArchive(debug_path(self.template, rollout_id)) as archive:
                self._check_pool(archive)
                samples = archive.load_samples()
                reference = archive.reference()
                contents: list[Any] = [reference] if reference is not None else archive.chunk_refs()
        else:
            samples = load_debug_rollout_data(self.template, rollout_id=rollout_id, subsample_ratio=ratio)
            contents = list(samples)
        raw = accept_raw_rollout(
            contents, config=self.config, controller=self.controller, rollout_id=rollout_id
        )
        return samples, raw

    def _check_pool(self, archive: RolloutArchive) -> None:
        pool = self.config.rollout_data_dir
        same_pool = pool is not None and os.path.realpath(archive.root) == os.path.realpath(pool)
        if not same_pool or archive.manifest.manifest.segment.run_id != self.config.run_id:
            raise ValueError("Debug rollout archives must belong to the same Straw storage pool and run")
