"""The catalog's state and the pure garbage-collection decision (docs/GC.md).

A pack may be reclaimed only when it is sealed, no owner reaches it, and its
staging is over: every extent's publications were released, or its writer is
dead. Once it is reclaimed only its name is kept (in ``tombstones`` and
``reclaimed``): its extents and released staging go, so the state, and every
catalog snapshot, holds per-extent entries for live packs only (docs/GC.md).
Nothing here touches the filesystem.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import UnsupportedSchema, invariant
from ..protocol import digest

Event = dict[str, Any]

#: Owner names an application may not use: straw's own owners live there.
RESERVED_PREFIXES = ("queue:", "staging:", "pin:")

#: Ordinal meaning "the records of an extent without a manifest" (write_records).
RECORDS_ONLY = -1

#: Version of the catalog snapshot body (``CatalogState.to_dict``); version 1 is still read.
SNAPSHOT_VERSION = 2


def queue_owner(run_id: str, relative_directory: str) -> str:
    """The catalog owner holding a queue's roots (docs/GC.md "Queue roots"): the coordinator,
    collection's cross-check (I20) and ``straw check`` all name it this way."""
    return "queue:" + digest([run_id, relative_directory])[:32]


def writer_of(path: str) -> str:
    """The writer id in a pack path ``raw/<writer>/<segment>.pack``."""
    parts = path.split("/")
    return parts[1] if len(parts) == 3 else ""


@dataclass
class PackInfo:
    """What the catalog knows of one pack: its writer and, once sealed, its extents."""

    writer: str
    sealed: bool = False
    #: Index-frame offset -> manifest ordinals of that extent (None: sealed by a collector
    #: after the writer died, so staging is over for every extent).
    extents: dict[int, list[int]] | None = None
    #: Index-frame offset -> the manifest ordinals whose staging ended there, as a bit mask
    #: (bit ``ordinal + 1``; RECORDS_ONLY is bit 0): one int per extent, however many
    #: publications it holds, since a queue's results stay here for as long as it owns them.
    released: dict[int, int] = field(default_factory=dict)

    def release(self, offset: int, ordinal: int) -> None:
        invariant(ordinal >= RECORDS_ONLY, "a manifest ordinal or RECORDS_ONLY")
        self.released[offset] = self.released.get(offset, 0) | (1 << (ordinal + 1))

    def is_released(self, offset: int, ordinal: int) -> bool:
        return bool(self.released.get(offset, 0) >> (ordinal + 1) & 1)

    def released_pairs(self) -> list[list[int]]:
        """Every released (offset, ordinal), sorted (the catalog snapshot's form)."""
        out = []
        for offset in sorted(self.released):
            mask, bit = self.released[offset], 0
            while mask:
                if mask & 1:
                    out.append([offset, bit - 1])
                mask >>= 1
                bit += 1
        return out


@dataclass
class CatalogState:
    owners: dict[str, set[str]] = field(default_factory=dict)
    packs: dict[str, PackInfo] = field(default_factory=dict)
    dead_writers: set[str] = field(default_factory=set)
    tombstones: set[str] = field(default_factory=set)
    reclaimed: set[str] = field(default_factory=set)

    # -- events ------------------------------------------------------------------

    def apply(self, event: Mapping[str, Any]) -> None:
        op = event.get("op")
        handler = _HANDLERS.get(op if isinstance(op, str) else "")
        invariant(handler is not None, f"catalog event {op!r} is known")
        handler(self, event)  # type: ignore[misc]

    def _retain(self, event: Mapping[str, Any]) -> None:
        self.owners[event["owner"]] = set(event["packs"])

    def _add(self, event: Mapping[str, Any]) -> None:
        self.owners.setdefault(event["owner"], set()).update(event["packs"])

    def _release(self, event: Mapping[str, Any]) -> None:
        self.owners.pop(event["owner"], None)

    def _pack(self, path: str) -> PackInfo:
        info = self.packs.get(path)
        if info is None:
            info = self.packs[path] = PackInfo(writer_of(path))
        return info

    def _seal(self, event: Mapping[str, Any]) -> None:
        if event["pack"] in self.reclaimed:
            return  # gone from disk: nothing about it decides anything any more
        info = self._pack(event["pack"])
        info.sealed = True
        extents = event.get("extents")
        info.extents = {int(k): list(v) for k, v in extents.items()} if extents is not None else None

    def _unstage(self, event: Mapping[str, Any]) -> None:
        reclaimed = self.reclaimed
        for path, offset, ordinal in event["items"]:
            if path not in reclaimed:  # (an adoption noted after a collection removed the pack)
                self._pack(path).release(offset, ordinal)

    def _writer_dead(self, event: Mapping[str, Any]) -> None:
        self.dead_writers.add(event["writer"])

    def _tombstone(self, event: Mapping[str, Any]) -> None:
        self.tombstones.update(event["packs"])

    def _reclaimed(self, event: Mapping[str, Any]) -> None:
        """The packs are gone from disk: their names stay, their per-extent staging goes (a
        long job reclaims thousands of packs of hundreds of extents each)."""
        self.reclaimed.update(event["packs"])
        for path in event["packs"]:
            self.packs.pop(path, None)

    # -- decisions ---------------------------------------------------------------------

    def reached(self) -> dict[str, list[str]]:
        """Pack -> owners that reach it."""
        out: dict[str, list[str]] = {}
        for owner, packs in self.owners.items():
            for path in packs:
                out.setdefault(path, []).append(owner)
        return out

    def staging_over(self, path: str) -> bool:
        info = self.packs.get(path)
        if info is None or not info.sealed:
            return False
        if info.writer in self.dead_writers or info.extents is None:
            return True
        for offset, manifests in info.extents.items():
            needed = manifests if manifests else [RECORDS_ONLY]
            if not all(info.is_released(offset, ordinal) for ordinal in needed):
                return False
        return True

    def collectable(self, on_disk: Iterable[str]) -> list[str]:
        """Packs present on disk that may be tombstoned now (sealed, unowned, staging over)."""
        reached = self.reached()
        return sorted(
            path
            for path in on_disk
            if path not in self.tombstones and path not in reached and self.staging_over(path)
        )

    def why(self, path: str) -> dict[str, Any]:
        """Why a pack is (or is not) retained: the owners that reach it and its staging."""
        info = self.packs.get(path)
        gone = path in self.reclaimed  # (only a sealed pack whose staging was over is reclaimed)
        return {
            "pack": path,
            "owners": sorted(self.reached().get(path, [])),
            "sealed": gone or bool(info and info.sealed),
            "writer": writer_of(path),
            "writer_dead": (info is not None or gone) and writer_of(path) in self.dead_writers,
            "staging_over": gone or self.staging_over(path),
            "tombstoned": path in self.tombstones,
        }

    # -- snapshot --------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The snapshot body (version 2; docs/GC.md "The catalog"): a pack's released staging as
        ``[offset, mask]`` per extent, the bit mask ``PackInfo.released`` holds, so compaction
        and loading cost one entry per extent, not one per publication."""
        return {
            "v": SNAPSHOT_VERSION,
            "owners": {k: sorted(v) for k, v in self.owners.items()},
            "packs": {
                k: [
                    i.writer,
                    i.sealed,
                    {str(o): m for o, m in i.extents.items()} if i.extents is not None else None,
                    [[offset, i.released[offset]] for offset in sorted(i.released)],
                ]
                for k, i in self.packs.items()
            },
            "dead_writers": sorted(self.dead_writers),
            "tombstones": sorted(self.tombstones),
            "reclaimed": sorted(self.reclaimed),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CatalogState:
        """A state from a snapshot body of either version (1 listed each released publication
        as ``[offset, ordinal]``; 2 lists ``[offset, mask]`` per extent)."""
        version = data.get("v")
        if version not in (1, SNAPSHOT_VERSION):
            raise UnsupportedSchema(
                f"catalog snapshot version {version!r} is not supported (this straw reads 1, 2)"
            )
        state = cls()
        state.owners = {k: set(v) for k, v in data["owners"].items()}
        state.reclaimed = set(data["reclaimed"])
        for path, (writer, sealed, extents, released) in data["packs"].items():
            if path in state.reclaimed:
                continue  # a snapshot written before reclaimed packs were forgotten lists them
            info = state.packs[path] = PackInfo(
                writer,
                sealed,
                {int(o): list(m) for o, m in extents.items()} if extents is not None else None,
            )
            if version == 1:
                for offset, ordinal in released:
                    info.release(offset, ordinal)
                continue
            for offset, mask in released:
                if not isinstance(mask, int) or isinstance(mask, bool) or mask <= 0:
                    raise ValueError(f"catalog snapshot: released mask {mask!r} of {path}@{offset}")
                info.released[int(offset)] = mask
        state.dead_writers = set(data["dead_writers"])
        state.tombstones = set(data["tombstones"])
        return state


_HANDLERS = {
    "retain": CatalogState._retain,
    "add": CatalogState._add,
    "release": CatalogState._release,
    "seal": CatalogState._seal,
    "unstage": CatalogState._unstage,
    "writer_dead": CatalogState._writer_dead,
    "tombstone": CatalogState._tombstone,
    "reclaimed": CatalogState._reclaimed,
}
