"""The exception tree of straw (API.md section 3) and the always-on invariant check.

Every failure a caller can cause or meet raises a subclass of :class:`QueueError`
(or ``ValueError``/``TypeError``/``KeyError`` for plain misuse). A broken internal
invariant raises :class:`InvariantViolation`, which deliberately is *not* a
``QueueError``: ``except QueueError`` must never hide a bug in straw itself.
"""

from __future__ import annotations

from typing import NoReturn

__all__ = [
    "CorruptData",
    "IdempotencyConflict",
    "IndeterminateCommit",
    "InvalidReference",
    "InvariantViolation",
    "LeaseExpired",
    "QueueError",
    "QuotaExceeded",
    "ResourceLimitExceeded",
    "StaleAttempt",
    "StorageUnavailable",
    "UnsafeRecovery",
    "UnsupportedSchema",
    "WriterBusy",
    "WriterFenced",
    "invariant",
]


class QueueError(RuntimeError):
    """Base class of every error straw raises for a condition a caller can meet."""


class LeaseExpired(QueueError):
    """The lease's time ran out before the call; the task may already be leased again."""


class StaleAttempt(QueueError):
    """The call names an attempt that a newer attempt or a recovery has superseded."""


class IdempotencyConflict(QueueError):
    """A request or submission id was reused with different content."""


class IndeterminateCommit(QueueError):
    """A write may or may not have become durable; retry the same submission to resolve it."""


class StorageUnavailable(QueueError):
    """The filesystem failed (I/O error, failed fsync, file not visible in time)."""


class QuotaExceeded(StorageUnavailable):
    """The filesystem is out of space or quota (ENOSPC/EDQUOT)."""


class ResourceLimitExceeded(QueueError):
    """An input exceeds a documented limit (record size, metadata size, id length, ...)."""


class CorruptData(QueueError):
    """Bytes on disk do not match their checksum, length or framing."""


class UnsupportedSchema(QueueError):
    """A format version, codec or type that this version of straw does not handle."""


class InvalidReference(QueueError):
    """A reference is malformed, unsafe, or points outside this run or pool."""


class UnsafeRecovery(QueueError):
    """Opening or recovering would risk acknowledged data (e.g. another live owner)."""


class WriterBusy(QueueError):
    """The writer is in use by another call or has an unresolved submission."""


class WriterFenced(QueueError):
    """The writer was fenced (retired or closed) and accepts no more writes."""


class InvariantViolation(Exception):
    """An internal invariant of straw failed: a bug in straw, never a caller error."""


def invariant(condition: object, why: str) -> None:
    """Check an internal invariant; unlike ``assert`` it survives ``python -O``."""
    if not condition:
        _fail(why)


def _fail(why: str) -> NoReturn:
    raise InvariantViolation(f"straw invariant violated: {why}")
