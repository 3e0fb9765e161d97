"""``Coordinator.complete_tasks``: many completions as one journal transaction (issue 12 item 5).

Each entry is checked exactly as ``complete_task`` checks it, in order; the batch is all
or nothing (a refused entry raises ``complete_task``'s error naming the entry, and nothing
is accepted or written); receipts come back in entry order, retries of accepted
submissions answer their original receipts (after a lost reply and after a recovery), and
the accepted results take consecutive positions, paying one journal frame for the batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import queue_helpers as qh
import straw._queue.validate as validate_module
from straw import Coordinator, Record, RecordSetRef, SharedFilesystemStore, TaskSpec
from straw.backend import FilesystemBackend
from straw.errors import (
    IdempotencyConflict,
    InvalidReference,
    LeaseExpired,
    ResourceLimitExceeded,
    StaleAttempt,
    UnsafeRecovery,
)
from straw.protocol import CommitReceipt, Lease
from straw.rpc import QueueClient, start_server

RUN = "run-complete-tasks"
OWNER = "owner-batch"
LEASE_S = 30.0


class InjectedFault(Exception):
    """Raised by the fault hook at the armed phase."""


class Faults:
    def __init__(self) -> None:
        self.armed: str | None = None

    def __call__(self, phase: str) -> None:
        if phase == self.armed:
            self.armed = None
            raise InjectedFault(phase)


@pytest.fixture
def clock() -> qh.Clock:
    return qh.Clock()


@pytest.fixture
def faults() -> Faults:
    return Faults()


@pytest.fixture
def store(tmp_path: Path, faults: Faults) -> Iterator[SharedFilesystemStore]:
    with SharedFilesystemStore(tmp_path, RUN, backend=FilesystemBackend(tmp_path, fault=faults)) as opened:
        yield opened


@pytest.fixture
def make(store: SharedFilesystemStore, clock: qh.Clock) -> Iterator[Callable[..., Coordinator]]:
    with qh.coordinators(store, exclusive_owner=OWNER, clock=clock, lease_seconds=LEASE_S) as factory:
        yield factory


def leased(coord: Coordinator, count: int, prefix: str = "t") -> list[Lease]:
    coord.submit_tasks(f"submit-{prefix}", [TaskSpec(f"{prefix}{i}") for i in range(count)])
    got = coord.acquire("w1", count)
    assert got.status == "acquired"
    return [a.lease for a in got.assignments]


def entry(store: SharedFilesystemStore, lease: Lease, sub: str, **over: Any) -> dict[str, Any]:
    ref = qh.result_for(store, lease, submission_id=sub, payload=f"out {sub}".encode())
    out: dict[str, Any] = {
        "lease": lease,
        "submission_id": sub,
        "result_ref": ref,
        "result_digest": ref.digest,
    }
    out.update(over)
    return out


def test_a_batch_is_one_transaction_with_receipts_in_order(make: Any, store: SharedFilesystemStore) -> None:
    coord = make()
    leases = leased(coord, 4)
    entries = [entry(store, lease, f"s{i}") for i, lease in enumerate(leases)]
    seq, appends = coord.journal.sequence, coord.metrics()["journal"]["appends"]
    receipts = coord.complete_tasks(entries)
    assert coord.journal.sequence == seq + 1  # one frame for the whole batch
    assert coord.metrics()["journal"]["appends"] == appends + 1
    assert [r.task_id for r in receipts] == [lease.task_id for lease in leases]
    assert [r.submission_id for r in receipts] == ["s0", "s1", "s2", "s3"]
    assert [r.position for r in receipts] == [0, 1, 2, 3]
    assert [r.result_ref for r in receipts] == [e["result_ref"] for e in entries]
    assert all(isinstance(r, CommitReceipt) for r in receipts)
    for receipt in receipts:
        assert coord.lookup_submission(receipt.submission_id) == receipt
        assert coord.task_status(receipt.task_id)["state"] == "completed"
    assert list(coord.read_commits(0, 10).commits) == receipts


def test_a_retry_after_a_lost_reply_or_a_recovery_answers_the_original_receipts(
    make: Any, store: SharedFilesystemStore
) -> None:
    coord = make()
    leases = leased(coord, 3)
    entries = [entry(store, lease, f"s{i}") for i, lease in enumerate(leases)]
    receipts = coord.complete_tasks(entries)
    seq = coord.journal.sequence
    assert coord.complete_tasks(entries) == receipts  # the reply was lost: the same receipts
    assert coord.journal.sequence == seq  # nothing journaled for a retry
    assert coord.metrics()["counters"]["duplicate_completions"] == 3
    qh.crash(coord)
    again = make(recover=True)
    # The leases are of the old epoch, but accepted submissions are answered first.
    assert again.complete_tasks(entries) == receipts
    assert [c["position"] for c in again.commits] == [0, 1, 2]


def test_entries_already_accepted_one_by_one_keep_their_receipts(
    make: Any, store: SharedFilesystemStore
) -> None:
    coord = make()
    leases = leased(coord, 3)
    entries = [entry(store, lease, f"s{i}") for i, lease in enumerate(leases)]
    first = coord.complete_task(**entries[1])
    receipts = coord.complete_tasks(entries)
    assert receipts[1] == first and first.position == 0
    assert [r.position for r in receipts] == [1, 0, 2]
    assert len(coord.commits) == 3


def test_the_dict_forms_of_leases_and_references_are_accepted(
    make: Any, store: SharedFilesystemStore
) -> None:
    coord = make()
    (lease,) = leased(coord, 1)
    item = entry(store, lease, "s")
    plain = {**item, "lease": dataclasses.asdict(lease), "result_ref": dataclasses.asdict(item["result_ref"])}
    (receipt,) = coord.complete_tasks([plain])
    assert receipt.result_ref == item["result_ref"] and receipt.task_id == lease.task_id


def test_an_empty_batch_accepts_nothing_and_writes_nothing(make: Any) -> None:
    coord = make()
    seq = coord.journal.sequence
    assert coord.complete_tasks([]) == []
    assert coord.journal.sequence == seq


def test_one_submission_named_twice_identically_is_accepted_once(
    make: Any, store: SharedFilesystemStore
) -> None:
    coord = make()
    (lease,) = leased(coord, 1)
    item = entry(store, lease, "s")
    first, second = coord.complete_tasks([item, dict(item)])
    assert first == second and first.position == 0
    assert len(coord.commits) == 1


def bad_batches(store: SharedFilesystemStore, clock: qh.Clock, leases: list[Lease]) -> list[tuple[Any, ...]]:
    """(why, entries, error class, message part): each batch has a refused entry 1 after a good entry 0."""
    good = entry(store, leases[0], "good")
    other = entry(store, leases[1], "other")
    stale = dataclasses.replace(leases[1], attempt_id="not-this-attempt")
    foreign = qh.result_for(store, leases[1], submission_id="foreign", task_id="someone-else")
    return [
        ("digest", [good, {**other, "result_digest": "0" * 64}], InvalidReference, "entry 1"),
        ("stale", [good, {**other, "lease": stale}], StaleAttempt, "entry 1"),
        (
            "foreign",
            [good, {**other, "result_ref": foreign, "result_digest": foreign.digest}],
            InvalidReference,
            "entry 1",
        ),
        ("conflict", [good, {**other, "submission_id": "good"}], IdempotencyConflict, "entry 1"),
        ("same task", [good, {**entry(store, leases[0], "again")}], StaleAttempt, "entry 1"),
        ("not a mapping", [good, "s1"], TypeError, "entry 1"),
        ("unknown key", [good, {**other, "extra": 1}], ValueError, "entry 1"),
        (
            "missing key",
            [good, {k: v for k, v in other.items() if k != "result_digest"}],
            ValueError,
            "entry 1",
        ),
        ("lease type", [good, {**other, "lease": "lease"}], TypeError, "entry 1"),
        ("ref type", [good, {**other, "result_ref": 7}], TypeError, "entry 1"),
        ("digest type", [good, {**other, "result_digest": 7}], TypeError, "entry 1"),
        ("bad lease dict", [good, {**other, "lease": {"task_id": "x"}}], TypeError, "entry 1"),
        ("empty submission", [good, {**other, "submission_id": ""}], ValueError, "entry 1"),
        ("one mapping", good, TypeError, "list"),
    ]


def test_a_refused_entry_refuses_the_batch_and_changes_nothing(
    make: Any, store: SharedFilesystemStore, clock: qh.Clock
) -> None:
    coord = make()
    leases = leased(coord, 2)
    for why, batch, error, message in bad_batches(store, clock, leases):
        before, files = qh.observe(coord), qh.directory_files(coord.directory)
        with pytest.raises(error, match=message):
            coord.complete_tasks(batch)
        assert qh.observe(coord) == before, why
        assert qh.directory_files(coord.directory) == files, why
    # Both leases are still good: the batch goes through once its entries are.
    receipts = coord.complete_tasks([entry(store, leases[0], "good"), entry(store, leases[1], "other")])
    assert [r.position for r in receipts] == [0, 1]


def test_an_expired_lease_refuses_the_batch(make: Any, store: SharedFilesystemStore, clock: qh.Clock) -> None:
    coord = make()
    leases = leased(coord, 2)
    entries = [entry(store, lease, f"s{i}") for i, lease in enumerate(leases)]
    clock.advance(LEASE_S + 1)
    with pytest.raises(LeaseExpired, match="entry 0"):
        coord.complete_tasks(entries)
    assert coord.commits == []


def test_a_batch_over_the_limit_is_refused(
    make: Any, store: SharedFilesystemStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(validate_module, "COMPLETIONS_PER_CALL_MAX", 2)
    coord = make()
    leases = leased(coord, 3)
    with pytest.raises(ResourceLimitExceeded, match="at most 2"):
        coord.complete_tasks([entry(store, lease, f"s{i}") for i, lease in enumerate(leases)])
    assert coord.commits == []


def test_a_fault_before_the_reply_leaves_the_batch_durable_and_a_retry_answers_it(
    make: Any, store: SharedFilesystemStore, faults: Faults
) -> None:
    coord = make()
    leases = leased(coord, 2)
    entries = [entry(store, lease, f"s{i}") for i, lease in enumerate(leases)]
    faults.armed = "before_completion_reply"
    with pytest.raises(InjectedFault):
        coord.complete_tasks(entries)
    receipts = coord.complete_tasks(entries)
    assert [r.position for r in receipts] == [0, 1]


def test_a_journal_fault_stops_the_coordinator_and_the_batch_is_whole_or_absent_after_recovery(
    make: Any, store: SharedFilesystemStore, faults: Faults
) -> None:
    for phase in ("before_journal_write", "after_journal_append", "after_journal_sync"):
        coord = make(recover=bool(phase != "before_journal_write"))
        leases = leased(coord, 2, prefix=phase)
        entries = [entry(store, lease, f"{phase}-{i}") for i, lease in enumerate(leases)]
        faults.armed = phase
        with pytest.raises(InjectedFault):
            coord.complete_tasks(entries)
        with pytest.raises(UnsafeRecovery):
            coord.complete_tasks(entries)
        coord.close()
        again = make(recover=True)
        found = [again.lookup_submission(e["submission_id"]) for e in entries]
        assert found == [None, None] or all(r is not None for r in found), phase
        if phase == "after_journal_sync":
            assert all(r is not None for r in found)
            assert again.complete_tasks(entries) == found  # the retry answers from the journal
        again.close()


def test_the_control_transport_carries_a_batch(make: Any, store: SharedFilesystemStore) -> None:
    coord = make()
    leases = leased(coord, 2)
    server = start_server(coord, ("127.0.0.1", 0), token="t")
    host, port = server.server_address[:2]
    try:
        client = QueueClient(f"http://{host}:{port}", token="t")
        entries = [entry(store, lease, f"s{i}") for i, lease in enumerate(leases)]
        replies = client.call("complete_tasks", completions=entries)
        assert [r["position"] for r in replies] == [0, 1]
        assert [RecordSetRef.from_dict(r["result_ref"]) for r in replies] == [
            e["result_ref"] for e in entries
        ]
        late = entry(store, leases[0], "late")
        late["lease"] = {**dataclasses.asdict(leases[0]), "attempt_id": "x"}
        with pytest.raises(StaleAttempt, match="entry 0"):
            client.call("complete_tasks", completions=[late])
    finally:
        server.shutdown()
        server.server_close()


def test_an_empty_result_needs_allow_empty(make: Any, store: SharedFilesystemStore) -> None:
    coord = make()
    coord.submit_tasks("r", [TaskSpec("e")])
    (lease,) = [a.lease for a in coord.acquire("w1", 1).assignments]
    empty = store.publish([], submission_id="empty")
    item = {"lease": lease, "submission_id": "s", "result_ref": empty, "result_digest": empty.digest}
    with pytest.raises(ValueError, match="allow_empty"):
        coord.complete_tasks([item])
    assert coord.commits == []


def test_records_of_the_batch_are_checked_for_ownership(make: Any, store: SharedFilesystemStore) -> None:
    coord = make()
    leases = leased(coord, 2)
    wrong = store.publish(
        [Record("x", b"y", metadata={"task_id": leases[1].task_id, "attempt_id": "other"})],
        submission_id="wrong",
    )
    batch = [
        entry(store, leases[0], "a"),
        {"lease": leases[1], "submission_id": "b", "result_ref": wrong, "result_digest": wrong.digest},
    ]
    with pytest.raises(InvalidReference, match="does not belong"):
        coord.complete_tasks(batch)
    assert coord.commits == []
