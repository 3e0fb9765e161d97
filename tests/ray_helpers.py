"""Generators and a rendezvous actor for the Ray tests (imported by the workers, so no pytest here).

A worker builds its generator from a factory on its own node; :class:`Scripted` picks its
behaviour by the node it finds itself on, so one factory gives a cluster fast and slow nodes.
:class:`Gate` is an asyncio actor that counts arrivals, so the driver can wait for "every
worker is generating" on an event instead of a timer. :class:`OffsetClock` is a queue clock
the test moves forward (a lease expires without anyone waiting for it).
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import ray

from rollout_helpers import finish, interrupt

#: Tokens a blocked generation has produced when it is aborted.
PARTIAL_TOKENS = 3


@ray.remote(num_cpus=0)
class Gate:
    """Counts arrivals by name; ``wait_for(n)`` answers once ``n`` arrived (or False at the bound)."""

    def __init__(self) -> None:
        self.arrivals: list[str] = []
        self.changed = asyncio.Event()

    async def arrive(self, name: str) -> None:
        self.arrivals.append(name)
        self.changed.set()

    async def wait_for(self, count: int, timeout: float = 60.0) -> bool:
        async def reached() -> None:
            while len(self.arrivals) < count:
                self.changed.clear()
                await self.changed.wait()

        try:
            await asyncio.wait_for(reached(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    async def seen(self) -> list[str]:
        return list(self.arrivals)


class Scripted:
    """A generator whose mode depends on its node: ``instant``, ``block`` or ``interrupt``.

    ``instant`` completes every group at once. ``block`` waits until ``abort()`` and returns
    the group ABORTED with :data:`PARTIAL_TOKENS` more tokens. ``interrupt`` blocks on a
    fresh group and completes a continued one (the paused-weight-update case). Every call
    arrives at ``gate`` (if given) with this node's id first.
    """

    def __init__(self, modes: dict[str, str], default: str = "instant", gate: Any = None) -> None:
        self.node = ray.get_runtime_context().get_node_id()
        self.mode = modes.get(self.node, default)
        self.gate = gate
        self.calls = 0
        self._aborted: asyncio.Event | None = None

    def _event(self) -> asyncio.Event:
        if self._aborted is None:
            self._aborted = asyncio.Event()
        return self._aborted

    async def __call__(self, group: list[Any], *, weight_version: str | None) -> list[Any]:
        self.calls += 1
        event = self._event()
        if self.gate is not None:
            await self.gate.arrive.remote(self.node)
        fresh = all(s.response_length == 0 for s in group)
        if self.mode == "block" or (self.mode == "interrupt" and fresh):
            await event.wait()
            return interrupt(group, version=None, tokens=PARTIAL_TOKENS)  # type: ignore[no-any-return]
        return finish(group, version=None)  # type: ignore[no-any-return]

    def abort(self) -> None:
        """End the blocked calls (they return partials); later calls block on a new event."""
        self._event().set()
        self._aborted = asyncio.Event()

    def report(self) -> dict[str, Any]:
        """Where this generator runs (node, worker process id) and what it did."""
        return {"node": self.node, "mode": self.mode, "calls": self.calls, "pid": os.getpid()}


class OffsetClock:
    """``time.monotonic()`` plus a forward jump read from a file, for a controller in another process.

    Picklable (it is only a path); :meth:`jump` moves every process's reading forward at
    once, so the queue sees leases expire while the test waits for nothing.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = str(path)

    def offset(self) -> float:
        try:
            return float(Path(self.path).read_text() or 0.0)
        except FileNotFoundError:
            return 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset()

    def jump(self, seconds: float) -> None:
        """Move the clock ``seconds`` forward (the new offset replaces the file in one rename)."""
        scratch = Path(self.path + ".new")
        scratch.write_text(repr(self.offset() + seconds))
        os.replace(scratch, self.path)
