"""The accepted-results log: receipts by position, packed rows until someone reads them.

A snapshot stores the log as rows of values plus a table of the result segments they
name (many results share an extent) and a table of pack paths (many segments share a
pack). A segment row holds only what differs between segments: its path's slot, size,
checksum and offset; the run id, segment id (the file name's stem), format version and
checksum algorithm follow from the queue and the path unless the row says otherwise.
Loading a snapshot keeps those rows as they are: a receipt dict is built only when a
position is read (``read_commits``, a retried completion), which keeps recovery time and
memory proportional to what is used, not to the whole history. Receipts accepted after
the load are kept as flat tuples of their values (``_flat``), which the cycle collector
untracks, where a receipt dict with its nested reference was three tracked dicts (issue 12:
every full collection walked each receipt accepted since the last snapshot).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, overload

from ..errors import invariant
from ..protocol import (
    CHECKSUM_ALGORITHM,
    SEGMENT_FIELDS,
    CommitReceipt,
    RecordRef,
    RecordSetRef,
    SegmentRef,
    unchecked,
)

_FORMAT_VERSION = 1

# Row layout: commit id, task id, submission id, digest, segment slot, manifest ordinal,
# the reference's digest (0 when it equals the receipt's), records, payload bytes, tokens.
_SUBMISSION = 2
_SLOT = 4

#: Flat receipt layout (a receipt accepted since the load): commit id, task id, submission id,
#: digest, the segment's fields (``SEGMENT_FIELDS``), manifest ordinal, the reference's
#: digest, records, payload bytes, tokens.
_FLAT_PATH = 5
_FLAT_REF = 4 + len(SEGMENT_FIELDS)


def _flat(receipt: dict[str, Any]) -> tuple[Any, ...] | dict[str, Any]:
    """A receipt as one tuple of plain values; one of another shape is kept as it is."""
    ref = receipt["result_ref"]
    try:
        manifest = ref["manifest"]
        segment = manifest["segment"]
        if len(segment) != len(SEGMENT_FIELDS) or (len(receipt), len(ref), len(manifest)) != (6, 5, 2):
            return receipt
        values = tuple([segment[name] for name in SEGMENT_FIELDS])
        return (
            receipt["commit_id"], receipt["task_id"], receipt["submission_id"], receipt["digest"],
            *values, manifest["ordinal"], ref["digest"], ref["records"], ref["payload_bytes"], ref["tokens"],
        )  # fmt: skip
    except (KeyError, TypeError):
        return receipt


def _unflat(row: tuple[Any, ...] | dict[str, Any], position: int) -> dict[str, Any]:
    """The receipt dict of a flat receipt (built afresh), or the kept dict itself."""
    if isinstance(row, dict):
        return row
    ordinal, ref_digest, records, size, tokens = row[_FLAT_REF:]
    return {
        "commit_id": row[0],
        "task_id": row[1],
        "submission_id": row[2],
        "digest": row[3],
        "position": position,
        "result_ref": {
            "manifest": {
                "segment": dict(zip(SEGMENT_FIELDS, row[4:_FLAT_REF], strict=True)),
                "ordinal": ordinal,
            },
            "digest": ref_digest,
            "records": records,
            "payload_bytes": size,
            "tokens": tokens,
        },
    }


def _receipt_object(row: tuple[Any, ...], position: int) -> CommitReceipt:
    """``CommitReceipt.from_journal(_unflat(row, position))`` without the dicts in between
    (a page of ``read_commits`` builds one per receipt)."""
    ordinal, ref_digest, records, size, tokens = row[_FLAT_REF:]
    segment = unchecked(SegmentRef, dict(zip(SEGMENT_FIELDS, row[4:_FLAT_REF], strict=True)))
    manifest = unchecked(RecordRef, {"segment": segment, "ordinal": ordinal})
    usage = {"records": records, "payload_bytes": size, "tokens": tokens}
    ref = unchecked(RecordSetRef, {"manifest": manifest, "digest": ref_digest, **usage})
    return unchecked(
        CommitReceipt,
        {
            "commit_id": row[0],
            "task_id": row[1],
            "submission_id": row[2],
            "digest": row[3],
            "position": position,
            "result_ref": ref,
        },
    )


class CommitLog:
    """Receipts in position order: loaded rows first, then receipts appended since."""

    def __init__(self, run_id: str = "", packed: Mapping[str, Any] | None = None) -> None:
        self._run_id = run_id
        self._paths: list[str] = list(packed["paths"]) if packed else []
        self._segments: list[list[Any]] = list(packed["segments"]) if packed else []
        # Rows as tuples: a collection untracks them (lists from JSON stay tracked for good).
        self._rows: list[tuple[Any, ...]] = [tuple(row) for row in packed["rows"]] if packed else []
        self._new: list[tuple[Any, ...] | dict[str, Any]] = []  # see ``_flat``
        #: Positions below ``base`` moved to history files (docs/FORMAT.md 8.4): ``history``
        #: reads such receipts back, a run of positions ``start .. stop - 1`` at a time.
        self.base: int = int(packed.get("base", 0)) if packed else 0
        self.history: Callable[[int, int], list[dict[str, Any]]] | None = None

    @classmethod
    def unpack(cls, packed: Mapping[str, Any], run_id: str) -> CommitLog:
        return cls(run_id, packed)

    def __len__(self) -> int:
        return self.base + len(self._rows) + len(self._new)

    @overload
    def __getitem__(self, position: int) -> dict[str, Any]: ...
    @overload
    def __getitem__(self, position: slice) -> list[dict[str, Any]]: ...

    def __getitem__(self, position: int | slice) -> dict[str, Any] | list[dict[str, Any]]:
        if isinstance(position, slice):
            start, stop, step = position.indices(len(self))
            loaded = self.base + len(self._rows)
            if step == 1 and start >= loaded:  # no loaded rows
                return [
                    _unflat(row, p)
                    for p, row in enumerate(self._new[start - loaded : max(start, stop) - loaded], start)
                ]
            if step == 1 and start < min(stop, self.base):
                cut = min(stop, self.base)  # the part on disk in one read, then the rest
                return self._from_history(start, cut) + [self._receipt(p) for p in range(cut, stop)]
            return [self._receipt(p) for p in range(start, stop, step)]
        if position < 0:
            position += len(self)
        if not 0 <= position < len(self):
            raise IndexError(f"commit position {position} out of range")
        return self._receipt(position)

    def receipts(self, start: int, stop: int) -> list[CommitReceipt]:
        """The receipts of positions ``start .. stop - 1`` (clipped to the log) as objects."""
        stop = min(stop, len(self))
        loaded = self.base + len(self._rows)
        if start < loaded:
            return [CommitReceipt.from_journal(c) for c in self[start:stop]]
        return [
            _receipt_object(row, p) if type(row) is tuple else CommitReceipt.from_journal(_unflat(row, p))
            for p, row in enumerate(self._new[start - loaded : max(start, stop) - loaded], start)
        ]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return (self._receipt(p) for p in range(len(self)))

    def append(self, receipt: dict[str, Any]) -> None:
        invariant(receipt["position"] == len(self), "a receipt is appended at its position")
        self._new.append(_flat(receipt))

    def submissions(self) -> dict[str, int]:
        """Submission id -> position (of those in memory), without building receipts."""
        out = {row[_SUBMISSION]: p for p, row in enumerate(self._rows, self.base)}
        base = self.base + len(self._rows)
        for offset, row in enumerate(self._new):
            out[row["submission_id"] if isinstance(row, dict) else row[_SUBMISSION]] = base + offset
        return out

    def result_path(self, position: int) -> str:
        """The pack holding the manifest of the result at ``position``."""
        position -= self.base
        invariant(position >= 0, "the result's receipt is in memory")
        if position < len(self._rows):
            return self._paths[self._segments[self._rows[position][_SLOT]][0]]
        row = self._new[position - len(self._rows)]
        return str(
            row["result_ref"]["manifest"]["segment"]["path"] if isinstance(row, dict) else row[_FLAT_PATH]
        )

    def submission_ids(self, stop: int) -> list[str]:
        """Submission ids of the positions from ``base`` to ``stop`` (in memory)."""
        count = stop - self.base
        out = [row[_SUBMISSION] for row in self._rows[:count]]
        out += [
            c["submission_id"] if isinstance(c, dict) else c[_SUBMISSION]
            for c in self._new[: max(0, count - len(self._rows))]
        ]
        return out

    def drop_below(self, cut: int) -> None:
        """Forget the receipts below ``cut``: a history file holds them now."""
        count = cut - self.base
        invariant(0 <= count <= len(self) - self.base, "dropped receipts are in memory")
        if count <= len(self._rows):
            self._rows = self._rows[count:]
        else:
            self._new = self._new[count - len(self._rows) :]
            self._rows = []
        self.base = cut

    def copy(self) -> CommitLog:
        """A log that later appends and drops of this one leave alone (rows are never changed
        in place, so the lists are copied, not their rows)."""
        out = CommitLog(self._run_id)
        out._paths, out._segments = list(self._paths), list(self._segments)
        out._rows, out._new = list(self._rows), list(self._new)
        out.base, out.history = self.base, self.history
        return out

    def pack(self, run_id: str) -> dict[str, Any]:
        """The snapshot form: loaded rows as they are, later receipts packed after them."""
        paths = list(self._paths)
        path_slots = {path: slot for slot, path in enumerate(paths)}
        segments = list(self._segments)
        slots = {(row[0], row[3]): slot for slot, row in enumerate(segments)}
        rows: list[Any] = list(self._rows)
        for p, row in enumerate(self._new, self.base + len(self._rows)):
            c = _unflat(row, p)
            ref = c["result_ref"]
            segment = ref["manifest"]["segment"]
            path = segment["path"]
            path_slot = path_slots.get(path)
            if path_slot is None:
                path_slot = path_slots[path] = len(paths)
                paths.append(path)
            key = (path_slot, segment["offset"])
            slot = slots.get(key)
            if slot is None:
                slot = slots[key] = len(segments)
                segments.append(_segment_row(segment, path_slot, run_id))
            rows.append(
                (
                    c["commit_id"],
                    c["task_id"],
                    c["submission_id"],
                    c["digest"],
                    slot,
                    ref["manifest"]["ordinal"],
                    0 if ref["digest"] == c["digest"] else ref["digest"],
                    ref["records"],
                    ref["payload_bytes"],
                    ref["tokens"],
                )
            )
        return {"paths": paths, "segments": segments, "rows": [list(row) for row in rows], "base": self.base}

    def _receipt(self, position: int) -> dict[str, Any]:
        at = position - self.base
        if at < 0:
            return self._from_history(position, position + 1)[0]
        if at >= len(self._rows):
            return _unflat(self._new[at - len(self._rows)], position)
        commit_id, task_id, submission_id, commit_digest, slot, ordinal, ref_digest, records, size, tokens = (
            self._rows[at]
        )
        ref = {
            "manifest": {"segment": self._segment(slot), "ordinal": ordinal},
            "digest": commit_digest if ref_digest == 0 else ref_digest,
            "records": records,
            "payload_bytes": size,
            "tokens": tokens,
        }
        return {
            "commit_id": commit_id,
            "task_id": task_id,
            "submission_id": submission_id,
            "digest": commit_digest,
            "position": position,
            "result_ref": ref,
        }

    def _from_history(self, start: int, stop: int) -> list[dict[str, Any]]:
        invariant(self.history is not None, "receipts below base are read from history")
        return self.history(start, stop)  # type: ignore[misc]

    def _segment(self, slot: int) -> dict[str, Any]:
        path_slot, size, checksum, offset, *extra = self._segments[slot]
        path = self._paths[path_slot]
        segment = {
            "run_id": self._run_id,
            "path": path,
            "segment_id": _stem(path),
            "size": size,
            "checksum": checksum,
            "version": _FORMAT_VERSION,
            "checksum_algorithm": CHECKSUM_ALGORITHM,
            "offset": offset,
        }
        if extra:
            segment.update(extra[0])
        return segment


def _stem(path: str) -> str:
    return path.rsplit("/", 1)[-1].split(".", 1)[0]


def _segment_row(segment: Mapping[str, Any], path_slot: int, run_id: str) -> list[Any]:
    """A segment as [path slot, size, checksum, offset] plus the fields that are not implied."""
    implied = {
        "run_id": run_id,
        "segment_id": _stem(segment["path"]),
        "version": _FORMAT_VERSION,
        "checksum_algorithm": CHECKSUM_ALGORITHM,
    }
    extra = {name: segment[name] for name, value in implied.items() if segment[name] != value}
    row = [path_slot, segment["size"], segment["checksum"], segment["offset"]]
    return [*row, extra] if extra else row
