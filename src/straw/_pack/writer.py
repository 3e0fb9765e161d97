"""The appending pack writer of one writer incarnation (docs/DURABILITY.md D1-D4).

A writer owns ``raw/<writer_id>/``: every pack there is written by this object
only, so offsets are tracked here and appends use positional vectored writes
straight from the callers' buffers. One call of :meth:`PackWriter.write` is one
durable extent: record frames followed by the index frame that names them.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import xxhash

from .._fs import durable, lock, posix
from ..backend import FilesystemBackend
from ..errors import WriterFenced, invariant
from ..limits import CHUNK_BYTES, PACK_PREALLOC_BYTES
from ..protocol import CHECKSUM_ALGORITHM, SegmentRef
from . import frame, reader

PACK_SUFFIX = ".pack"
STANDALONE_SUFFIX = ".seg"


class Entry(NamedTuple):
    """A record ready to frame: description plus the caller's (flat) payload view.

    A named tuple, not a dataclass: a write makes one per record, and a frozen dataclass's
    ``__init__`` (one ``object.__setattr__`` per field) cost more than the rest of its checks.
    """

    record_id: str
    codec: str
    metadata: dict[str, object]
    tokens: int
    payload: memoryview
    content: str
    chunks: str
    #: A manifest body kept inside the index frame (no record frame is written).
    inline: dict[str, object] | None = None
    #: The metadata's canonical JSON text (what the index frame and the logical digest hold)
    #: and the index row part parsed from that text (``frame.text_pairs``): what reading the
    #: index frame back gives, so the written index is shared with readers as it is. Every
    #: record the store checks has both (``SharedFilesystemStore._entry``; the layout parses
    #: the text itself for an entry made without its part); an inline manifest has neither.
    meta_text: str = ""
    pairs: tuple[Any, ...] | None = None


class CommitUncertain(Exception):
    """The extent may be durable and visible: the caller must not treat the write as failed.

    ``segment`` is the reference the write would return; ``dir_sync`` names a
    directory whose sync is still owed (the new pack's rename may not be durable).
    """

    def __init__(self, segment: SegmentRef, dir_sync: str | None, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.segment = segment
        self.dir_sync = dir_sync
        self.cause = cause


@dataclass
class _OpenPack:
    fd: int
    segment_id: str
    relative: str
    size: int
    extents: int
    #: Index-frame offset -> manifest ordinals of each extent (for the catalog's staging).
    #: Tuples of ints, which the cycle collector untracks: an open pack holds hundreds of
    #: extents, and lists of them were the most references a full collection walked.
    manifests: dict[int, tuple[int, ...]] = field(default_factory=dict)
    #: End of the zero-filled space written ahead of the frames (D1.2a); the file's size.
    allocated: int = 0


class BufferChanged(ValueError):
    """A caller changed a payload buffer while it was being published (D1.2c)."""


def _unchanged(entries: Sequence[Entry]) -> None:
    """D1.2c: every payload still hashes to what its index frame records, now that its bytes
    were written from the caller's memory; a buffer changed meanwhile would leave an extent
    whose reads fail (CorruptData), so the write is refused instead, before its sync."""
    for e in entries:
        if e.inline is None and xxhash.xxh3_128_hexdigest(e.payload) != e.content:
            raise BufferChanged(
                f"record {e.record_id!r}: its payload buffer changed during publication (while its "
                "bytes were written); nothing was published: keep the buffer unchanged and retry"
            )


#: Called with (pack path, extents) once a pack is sealed (the store records it in the catalog).
SealHook = Callable[[str, dict[int, tuple[int, ...]]], None]

#: Name of the per-writer liveness lock file (docs/GC.md): held while the writer lives.
LIVE_FILE = "LIVE"


class _Layout(NamedTuple):
    """One extent laid out at an offset: its buffers, where its index frame lies, and the index
    entries (shared with this process's readers once the extent is durable, reader.py)."""

    buffers: list[posix.Buffer]
    index_offset: int
    index_size: int
    checksum: str
    submission_id: str
    entries: list[frame.Row]


class PackWriter:
    """Appends extents to this incarnation's current pack, rotating by size."""

    def __init__(
        self, backend: FilesystemBackend, run_id: str, writer_id: str, segment_target_bytes: int
    ) -> None:
        invariant(segment_target_bytes >= 0, "segment target is non-negative")
        self.backend = backend
        self.run_id = run_id
        self.writer_id = writer_id
        self.segment_target_bytes = segment_target_bytes
        self.directory = f"raw/{writer_id}"
        self._pack: _OpenPack | None = None
        self._closed = False
        self._directory_durable = False
        self._live_fd = -1
        self.on_seal: SealHook | None = None
        #: Informational content of the LIVE file (FORMAT.md section 1), set by the store.
        self.live_note = b""
        self.packs_created = 0
        self.bytes_written = 0

    # -- public ------------------------------------------------------------------

    def write(
        self, entries: Sequence[Entry], submission_id: str, manifests: Sequence[int] = ()
    ) -> SegmentRef:
        """Durably write one extent; returns the SegmentRef of its index frame.

        Raises the original error when nothing became visible (the write failed),
        or :class:`CommitUncertain` once the extent may be visible (D2, D3).
        """
        if self._closed:
            raise WriterFenced(f"writer {self.writer_id} is closed; open a new store to write")
        self.backend.fault("before_publish")
        if self.segment_target_bytes == 0:
            return self._write_new_file(entries, submission_id, manifests, standalone=True)
        pack = self._pack
        if pack is not None:
            layout = self._layout(entries, submission_id, pack.size)
            extent_end = layout.index_offset + layout.index_size
            # D3: rotate before crossing the target, unless the pack is empty (a big extent stays whole).
            if not pack.extents or extent_end <= self.segment_target_bytes:
                return self._append(pack, layout, manifests, entries)
            self.backend.fault("before_rotate")
            self.seal()
        return self._write_new_file(entries, submission_id, manifests, standalone=False)

    def seal(self) -> None:
        """D4: append a seal frame to the current pack, sync it, and stop appending there."""
        pack = self._pack
        if pack is None:
            return
        self._pack = None
        try:
            head, body, _ = frame.encode_json_frame(frame.KIND_SEAL, frame.seal_body(pack.extents, pack.size))
            self.backend.fault("before_seal_write")
            posix.pwrite_all(pack.fd, [head, body], pack.size)
            if pack.allocated > pack.size + len(head) + len(body):
                posix.truncate(pack.fd, pack.size + len(head) + len(body))  # cut the zeros (D1.2a)
            self.backend.sync_file(pack.fd)
            self.backend.fault("after_seal_sync")
        finally:
            posix.close_quietly(pack.fd)
        if self.on_seal is not None:
            self.on_seal(pack.relative, pack.manifests)

    def abandon(self) -> None:
        """Stop appending to the current pack without writing to it (after a failed write)."""
        if self._pack is not None:
            posix.close_quietly(self._pack.fd)
            self._pack = None

    def close(self) -> None:
        """Seal the open pack and release the liveness lock (the writer is dead from here on)."""
        if self._closed:
            return
        try:
            self.seal()
        finally:
            self._closed = True
            if self._live_fd >= 0:
                lock.unlock(self._live_fd)
                self._live_fd = -1

    @property
    def closed(self) -> bool:
        return self._closed

    def finish_dir_sync(self, directory: str) -> None:
        """Redo a directory sync that an uncertain write still owes."""
        self.backend.sync_dir(directory)

    # -- internals -------------------------------------------------------------------

    def _layout(self, entries: Sequence[Entry], submission_id: str, start: int) -> _Layout:
        """Frames of one extent at ``start``, and the index rows it records (``frame.Row``)."""
        buffers: list[posix.Buffer] = []
        rows: list[frame.Row] = []
        texts: list[str] = []  # the metadata text of each row ("" for inline ones)
        position = start
        for e in entries:
            if e.inline is not None:
                rows.append(frame.inline_row(e.record_id, e.inline))
                texts.append("")
                continue
            buffers.append(frame.encode_frame_header(frame.KIND_RECORD, e.payload.nbytes, e.content))
            buffers.append(e.payload)
            position += frame.FRAME_HEADER_BYTES
            invariant(bool(e.meta_text), "a record's metadata text is made when the store checks it")
            # (from the text, as the store's check made it: what reading the frame back gives)
            pairs = e.pairs if e.pairs is not None else frame.text_pairs(e.meta_text)
            texts.append(e.meta_text)
            size = e.payload.nbytes
            rows.append((e.record_id, e.codec, e.tokens, position, size, e.content, e.chunks, None, *pairs))
            position += e.payload.nbytes
        head, body, sum_hex = frame.encode_index_frame(submission_id, rows, texts)
        buffers += [head, body]
        return _Layout(buffers, position, len(head) + len(body), sum_hex, submission_id, rows)

    def _chunk_phases(self, rows: Sequence[frame.Row]) -> None:
        """The peer's ``after_payload_chunk`` phase, once per payload chunk written (all of an
        extent is written by one vectored call, so they come together, before its sync)."""
        if not self.backend.fault_hooked:
            return
        for row in rows:
            for _ in range(frame.chunk_count(frame.row_length(row), CHUNK_BYTES)):
                self.backend.fault("after_payload_chunk")

    def _segment(self, relative: str, segment_id: str, offset: int, size: int, sum_hex: str) -> SegmentRef:
        return SegmentRef(
            run_id=self.run_id,
            path=relative,
            segment_id=segment_id,
            size=size,
            checksum=sum_hex,
            version=frame.FORMAT_VERSION,
            checksum_algorithm=CHECKSUM_ALGORITHM,
            offset=offset,
        )

    def _append(
        self, pack: _OpenPack, layout: _Layout, manifests: Sequence[int], entries: Sequence[Entry]
    ) -> SegmentRef:
        buffers, index_offset, index_size, sum_hex = layout[:4]
        segment = self._segment(pack.relative, pack.segment_id, index_offset, index_size, sum_hex)
        end = index_offset + index_size
        try:
            self.backend.fault("before_data_write")
            written = posix.pwrite_all(pack.fd, buffers, pack.size)
            if (
                end - pack.size <= PACK_PREALLOC_BYTES // 4
                and end + PACK_PREALLOC_BYTES // 2 > pack.allocated
            ):
                # D1.2a: small appends keep zeros written ahead of them, synced with this extent,
                # so the next small appends overwrite allocated blocks and their fdatasync
                # commits no size change. Seal cuts the zeros; readers never look past a reference.
                start = max(pack.allocated, end)
                posix.pwrite_all(pack.fd, [bytes(end + PACK_PREALLOC_BYTES - start)], start)
                pack.allocated = end + PACK_PREALLOC_BYTES
            self.backend.fault("after_data_write")
            self._chunk_phases(layout.entries)
            _unchanged(entries)
            self.backend.sync_file(pack.fd)
        except BaseException as error:
            # D1 failed: bytes past pack.size may be torn or unsynced. Nothing
            # names them; never append after them (docs/DURABILITY.md I3).
            if isinstance(error, BufferChanged):
                # The extent is whole but its bytes are not what its index says: cut it, so no
                # complete-looking damaged extent stays behind (nothing was synced or named).
                with contextlib.suppress(OSError):
                    posix.truncate(pack.fd, pack.size)
            self.abandon()
            raise
        pack.size += written
        pack.extents += 1
        pack.manifests[index_offset] = tuple(manifests)
        self.bytes_written += written
        invariant(pack.size == index_offset + index_size, "extent ends with its index frame")
        reader.remember_written(segment, layout.submission_id, layout.entries)
        try:
            self.backend.fault("after_data_sync")
        except BaseException as error:
            raise CommitUncertain(segment, None, error) from error
        return segment

    def _write_new_file(
        self, entries: Sequence[Entry], submission_id: str, manifests: Sequence[int], *, standalone: bool
    ) -> SegmentRef:
        """D2: write the first extent of a new pack to a temporary name, sync, rename, sync dir."""
        root = str(self.backend.root)
        directory = os.path.join(root, self.directory)
        if not self._directory_durable:
            # D2.1: create raw/<writer>/ and sync raw/ until one sync has succeeded (a failed sync
            # leaves the directory in place, so "it exists" does not mean "it is durable").
            durable.make_dirs(directory, root, self.backend.sync_dir)
            self.backend.sync_dir(os.path.dirname(directory))
            self._directory_durable = True
        if self._live_fd < 0:
            # docs/GC.md: the liveness lock exists before any file of this writer does, so a
            # collector that can take it knows the writer is dead.
            self._live_fd = lock.create_locked(os.path.join(directory, LIVE_FILE), self.live_note)
        segment_id = secrets.token_hex(16)
        suffix = STANDALONE_SUFFIX if standalone else PACK_SUFFIX
        relative = f"{self.directory}/{segment_id}{suffix}"
        final = os.path.join(root, relative)
        temp = os.path.join(directory, f".{segment_id}{suffix}.tmp")
        flags = frame.FLAG_STANDALONE if standalone else 0
        header = frame.encode_pack_header(self.run_id, segment_id, time.time_ns(), flags)
        layout = self._layout(entries, submission_id, len(header))
        buffers, index_offset, index_size, sum_hex = layout[:4]
        size = index_offset + index_size
        if standalone:
            seal_head, seal, _ = frame.encode_json_frame(frame.KIND_SEAL, frame.seal_body(1, size))
            buffers += [seal_head, seal]
        segment = self._segment(relative, segment_id, index_offset, index_size, sum_hex)
        fd = posix.create_exclusive(temp)
        self.backend.metrics["files_created"] += 1
        try:
            self.backend.fault("before_data_write")
            written = posix.pwrite_all(fd, [header, *buffers], 0)
            self.backend.fault("after_data_write")
            self._chunk_phases(layout.entries)
            _unchanged(entries)
            self.backend.sync_file(fd)
            self.backend.fault("after_data_sync")
            posix.rename(temp, final)
        except BaseException:
            posix.close_quietly(fd)
            posix.unlink_quietly(temp)
            raise
        # The pack is visible from here on: failures are uncertain, not failed (D2.5).
        self.packs_created += 1
        reader.remember_written(segment, layout.submission_id, layout.entries)
        self.bytes_written += written
        extents = {index_offset: tuple(manifests)}
        if standalone:
            posix.close_quietly(fd)
        else:
            self._pack = _OpenPack(fd, segment_id, relative, size, 1, extents, size)
        try:
            self.backend.fault("before_dir_sync")
            self.backend.sync_dir(directory)
            self.backend.fault("after_dir_sync")
            if standalone and self.on_seal is not None:
                self.on_seal(relative, extents)
        except BaseException as error:
            raise CommitUncertain(segment, directory, error) from error
        return segment
