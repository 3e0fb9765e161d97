"""A Hypothesis state machine drives a QueueController with readers that take, return partials
and ready groups, deliver accepted groups, complete, reject, train, close, crash, are retired,
let their leases expire, and a controller that restarts in ``resume`` mode; a plain model says
what must hold after every step:

- every dataset group is issued exactly once (fresh task ids follow the cursor without a gap)
  and has exactly one live representative until it is rejected;
- no accepted group is lost (the model's accepted, unreplaced results are the queue's) or
  trained twice (training only ever processes what the model holds as accepted);
- the training view processes exactly the positions the model processed, never another;
- the pending order follows ROLLOUT.md section 10.3 (ready > partial > fresh, then the oldest
  version, then return order), and each take hands out the best pending groups.

``make test`` runs a bounded number of examples; the ``slow`` marker runs many more.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from queue_helpers import Clock
from rollout_helpers import finish, interrupt, prompt_rows, representatives
from straw.rollout.checkpoint import RestorePlan
from straw.rollout.config import RolloutConfig
from straw.rollout.controller import QueueController
from straw.rollout.pool import close_rollout_stores
from straw.rollout.reader import QueueReader
from straw.rollout.refs import RolloutGroupRef, load_groups
from straw.rollout.sample import NO_VERSION_KEY, group_stage, iter_samples, scheduling_key

LEASE_SECONDS = 3000.0  # readers' heartbeat threads (every lease/3 s) never run during an example
REFILL_MIN, REFILL_MAX = 2, 4
PRIORITY = {"ready": 2, "partial": 1, "fresh": 0}
Key = tuple[int, int, int]


def group_of(group: Any) -> int:
    return int(next(iter_samples(group)).group_index)  # type: ignore[arg-type]


class QueueMachine(RuleBasedStateMachine):
    """The controller and its readers on one side, a model of groups on the other."""

    def __init__(self) -> None:
        super().__init__()
        self.directory = tempfile.mkdtemp(prefix="straw-model-")
        self.clock = Clock()
        self.config = RolloutConfig.from_args(
            SimpleNamespace(
                rollout_data_dir=f"{self.directory}/pool",
                rollout_queue_lease_seconds=LEASE_SECONDS,
                refill_min_groups=REFILL_MIN,
                refill_max_groups=REFILL_MAX,
                task_max_attempts=1000,
            )
        )
        self.controller = QueueController(
            self.config, dataset=prompt_rows(5), clock=self.clock, start_gc=False
        )
        self.readers: dict[str, QueueReader] = {}
        self.hands: dict[str, list[Any]] = {}  # groups a live reader holds
        self.names = 0
        # The model. Each issued group is pending, leased (by a reader), accepted, or done.
        self.pending: dict[int, Key] = {}  # group -> (-priority, key, seq)
        self.returned: set[int] = set()  # pending groups a reader returned
        self.leased: dict[int, str] = {}  # group -> reader holding the lease
        self.accepted: dict[int, tuple[int, str, RolloutGroupRef]] = {}  # position -> (group, reader, ref)
        self.sources: dict[int, list[int]] = {}  # position -> what its task replaced
        self.rejected: set[int] = set()
        self.processed: set[int] = set()
        self.issued = 0
        self.seq = 0
        self.held_keys: dict[int, Key] = {}  # a leased group's queue key, should it come back as is
        self.held_returned: set[int] = set()

    def teardown(self) -> None:
        for reader in self.readers.values():
            with contextlib.suppress(Exception):
                reader.close()
        with contextlib.suppress(Exception):
            self.controller.close()
        close_rollout_stores()
        shutil.rmtree(self.directory, ignore_errors=True)

    # ------------------------------------------------------------------ helpers

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def enqueue(self, group: int, priority: int, key: int, *, returned: bool, seq: int | None = None) -> None:
        self.pending[group] = (-priority, key, self.next_seq() if seq is None else seq)
        self.leased.pop(group, None)
        if returned:
            self.returned.add(group)
        else:
            self.returned.discard(group)

    def reclaim(self, groups: list[int]) -> None:
        """Leases taken back together (expiry, retirement, recovery) rejoin the queue as a tie."""
        seq = self.next_seq()
        for group in groups:
            negative, key, _ = self.held_keys.pop(group)
            self.enqueue(group, -negative, key, returned=group in self.held_returned, seq=seq)
            self.held_returned.discard(group)

    def lease(self, group: int, reader: str) -> None:
        self.held_keys[group] = self.pending.pop(group)
        if group in self.returned:
            self.held_returned.add(group)
            self.returned.discard(group)
        self.leased[group] = reader

    def new_reader(self) -> str:
        self.names += 1
        name = f"r{self.names}"
        self.readers[name] = QueueReader(self.controller.config, self.controller, name)
        self.hands[name] = []
        return name

    def drop_reader(self, name: str) -> None:
        reader = self.readers.pop(name)
        self.hands.pop(name, None)
        with contextlib.suppress(Exception):
            reader.close()

    def holders(self) -> list[str]:
        return [name for name, hand in self.hands.items() if hand]

    # ------------------------------------------------------------------ rules

    @precondition(lambda self: len(self.readers) < 2 and not self.holders())
    @rule()
    def open_reader(self) -> None:
        self.new_reader()

    @precondition(lambda self: sum(len(hand) for hand in self.hands.values()) < 6)
    @rule(count=st.integers(1, 5), data=st.data())
    def take(self, count: int, data: st.DataObject) -> None:
        if not self.readers:
            self.new_reader()
        name = data.draw(st.sampled_from(sorted(self.readers)))
        before = dict(self.pending)
        groups = self.readers[name].get_samples(count)
        got = [group_of(g) for g in groups]
        assert len(got) == count and len(set(got)) == count
        old = [g for g in got if g in before]
        self.check_best(count, old, before)
        # A take that empties the queue refills min(max(need, 2), 4) groups, again and again.
        need, first = count - len(old), self.issued
        while need > 0:
            drawn = min(max(need, REFILL_MIN), REFILL_MAX)
            for group in range(self.issued, self.issued + drawn):
                self.pending[group] = (0, NO_VERSION_KEY, self.next_seq())
            self.issued += drawn
            need -= min(need, drawn)
        new = [g for g in got if g not in before]
        assert new == list(range(first, first + len(new))), "refills continue the cursor, in order"
        for group in got:
            self.lease(group, name)
        self.hands[name] += groups

    def check_best(self, count: int, old: list[int], before: dict[int, Key]) -> None:
        """The pending groups handed out were the best ones (section 10.3); refills only after."""
        assert len(old) == min(count, len(before)), "a refill only happens when the queue is empty"
        if old:
            worst = max(before[g] for g in old)
            assert all(key >= worst for g, key in before.items() if g not in old), "a better group was left"

    @precondition(lambda self: self.holders())
    @rule(data=st.data())
    def complete(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(self.holders()))
        for _ in range(data.draw(st.integers(1, len(self.hands[name])))):
            group = self.hands[name].pop(0)
            sources = list(group[0]._queue_source_positions)
            ref = self.readers[name].publish_group(finish(group), rollout_id=0)
            assert ref.receipt is not None
            g = group_of(group)
            self.leased.pop(g)
            self.held_keys.pop(g)
            self.held_returned.discard(g)
            self.accepted[ref.receipt.position] = (g, name, ref)
            self.sources[ref.receipt.position] = sources

    @precondition(lambda self: self.holders())
    @rule(data=st.data(), version=st.sampled_from(["1", "2", "3", "x", None]), ready=st.booleans())
    def give_back(self, data: st.DataObject, version: str | None, ready: bool) -> None:
        name, group = self.pick_held(data)
        (finish if ready else interrupt)(group, version=version)
        stage = group_stage(group)
        assert stage == ("ready" if ready else "partial")
        self.readers[name].add_samples([group])
        g = group_of(group)
        self.held_keys.pop(g)
        self.held_returned.discard(g)
        self.enqueue(g, PRIORITY[stage], scheduling_key(group), returned=True)

    @precondition(lambda self: self.accepted and self.readers)
    @rule(data=st.data())
    def deliver(self, data: st.DataObject) -> None:
        position = data.draw(st.sampled_from(sorted(self.accepted)))
        name = data.draw(st.sampled_from(sorted(self.readers)))
        g, _, ref = self.accepted.pop(position)
        (loaded,) = load_groups([ref])
        self.readers[name].add_samples([loaded])
        self.enqueue(g, PRIORITY["ready"], scheduling_key(loaded), returned=True)

    @precondition(lambda self: self.holders())
    @rule(data=st.data())
    def reject(self, data: st.DataObject) -> None:
        name, group = self.pick_held(data)
        sources = list(group[0]._queue_source_positions)
        self.readers[name].discard_group(group, "filtered")
        g = group_of(group)
        self.leased.pop(g)
        self.held_keys.pop(g)
        self.held_returned.discard(g)
        self.rejected.add(g)
        self.process(sources)

    @precondition(lambda self: len(self.accepted) >= 2)
    @rule(data=st.data())
    def train(self, data: st.DataObject) -> None:
        chosen = data.draw(st.lists(st.sampled_from(sorted(self.accepted)), min_size=1, unique=True))
        self.controller.record_dispositions(chosen, "trained")
        for position in chosen:
            del self.accepted[position]
        self.process(chosen)

    def process(self, positions: list[int]) -> None:
        for position in positions:
            if position not in self.processed:
                self.processed.add(position)
                self.processed.update(self.sources.get(position, ()))

    @precondition(lambda self: self.holders())
    @rule(data=st.data())
    def close_reader(self, data: st.DataObject) -> None:
        """A clean close gives the reader's leases back in the order it took them."""
        name = data.draw(st.sampled_from(self.holders()))
        held = [group_of(g) for g in self.hands[name]]
        self.drop_reader(name)
        for g in held:
            negative, key, _ = self.held_keys.pop(g)
            self.enqueue(g, -negative, key, returned=g in self.held_returned)
            self.held_returned.discard(g)

    @precondition(lambda self: self.holders())
    @rule(data=st.data())
    def crash_reader(self, data: st.DataObject) -> None:
        """The reader's process dies: its leases stay with its name until retired or expired."""
        name = data.draw(st.sampled_from(self.holders()))
        reader = self.readers.pop(name)
        self.hands.pop(name)
        # A dead process releases nothing: only this object's threads are stopped (test-only access).
        reader._closed = True
        reader._closing.set()
        reader._executor.shutdown(wait=True)
        reader._thread.join()

    @precondition(lambda self: self.leased)
    @rule(data=st.data())
    def retire(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(set(self.leased.values()))))
        mine = sorted(p for p, (_, who, _) in self.accepted.items() if who == name)
        delivered = data.draw(st.lists(st.sampled_from(mine), unique=True)) if mine else []
        found = self.controller.retire_reader(name, delivered)
        assert sorted(r.position for r in found) == sorted(set(mine) - set(delivered))
        if name in self.readers:
            self.drop_reader(name)
        self.reclaim(sorted(g for g, who in self.leased.items() if who == name))

    @precondition(lambda self: len(self.leased) >= 3)
    @rule()
    def expire(self) -> None:
        self.clock.advance(LEASE_SECONDS + 1)
        self.controller.queue.acquire("sweeper", 1, task_ids=[])  # reclaims every expired lease
        for name in list(self.readers):
            self.hands[name] = []  # their leases are gone; they would only get StaleAttempt
        self.reclaim(sorted(self.leased))

    @precondition(lambda self: self.accepted or self.leased)
    @rule()
    def restart(self) -> None:
        """The job's process restarts: a new controller in resume mode on the same queue."""
        queue_id = self.controller.plan.queue_id
        self.controller.close()
        for name in list(self.readers):
            self.drop_reader(name)
        self.controller = QueueController(
            self.config,
            dataset=prompt_rows(5),
            restore_plan=RestorePlan("resume", queue_id=queue_id),
            clock=self.clock,
            start_gc=False,
        )
        self.reclaim(sorted(self.leased))  # the new epoch revoked every lease
        recovered = self.controller.recover_pending_rollout()
        assert sorted(r.position for r in recovered) == sorted(self.accepted)
        assert self.controller.recover_pending_rollout() == []

    def pick_held(self, data: st.DataObject) -> tuple[str, Any]:
        name = data.draw(st.sampled_from(self.holders()))
        hand = self.hands[name]
        group = hand.pop(data.draw(st.integers(0, len(hand) - 1)))
        return name, group

    # ------------------------------------------------------------------ what must hold

    @invariant()
    def each_group_once(self) -> None:
        issued, count = representatives(self.controller.queue)
        assert issued == self.issued
        expected = {g: 1 for g in range(issued) if g not in self.rejected}
        assert count == expected

    @invariant()
    def the_queue_matches_the_model(self) -> None:
        queue = self.controller.queue
        pending = queue.pending_tasks(task_prefix="prompt:")
        groups = [spec.metadata["group_index"] for spec in pending]
        assert sorted(groups) == sorted(self.pending)
        for spec in pending:
            negative, key, _ = self.pending[spec.metadata["group_index"]]
            assert (spec.priority, spec.scheduling_key) == (-negative, key)
        keys = [self.pending[g] for g in groups]
        assert keys == sorted(keys), "ready > partial > fresh, oldest version first, then return order"
        assert self.controller.pending_count() == len(self.returned)
        leased = {
            s["spec"]["metadata"]["group_index"]: s["lease"]["worker_id"]
            for t, s in queue.tasks.items()
            if t.startswith("prompt:") and s["state"] == "leased"
        }
        assert leased == self.leased

    @invariant()
    def accepted_and_processed_match(self) -> None:
        view = self.controller.training_view()
        commits = len(self.controller.queue.commits)
        cursor = view["processed_cursor"]
        real = set(range(cursor)) | set(view["processed_positions"])
        assert real == self.processed, "the view processes exactly what the model processed"
        metrics = self.controller.metrics()
        live = set(self.accepted)
        unprocessed = {p for p in range(commits) if p not in self.processed}
        replaced = unprocessed - live
        assert all(p in self.sources_named() for p in replaced)
        assert metrics["accepted_unprocessed"]["count"] == len(unprocessed)

    def sources_named(self) -> set[int]:
        named: set[int] = set()
        for status in self.controller.queue.tasks.values():
            named.update(status["spec"]["metadata"].get("source_positions") or ())
        return named


BOUNDED = settings(
    max_examples=20, stateful_step_count=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestQueueMachine = QueueMachine.TestCase
TestQueueMachine.settings = BOUNDED


@pytest.mark.slow
class TestQueueMachineLonger(QueueMachine.TestCase):  # type: ignore[name-defined,misc]
    settings = settings(
        max_examples=300, stateful_step_count=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
    )
