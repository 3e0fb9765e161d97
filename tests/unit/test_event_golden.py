"""Golden bytes of every queue journal op (docs/FORMAT.md 8.3).

A fixed workload drives a real ``QueueState`` through its checks (deterministic ids and
clock) and keeps the first event of each op; the events the coordinator makes itself
(epoch, drain, checkpoints) are built as it builds them. Each one must encode to the line
FORMAT.md shows for its op, that line must decode back to an equal event, and every op
class must have a line: a new op without a golden example fails here.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from straw._queue import events
from straw._queue.machine import Answer, QueueState, new_state
from straw.errors import CorruptData, UnsupportedSchema
from straw.protocol import Lease, RecordRef, RecordSetRef, SegmentRef, TaskSpec, as_dict, decode, encode

FORMAT_MD = Path(__file__).resolve().parents[2] / "docs" / "FORMAT.md"
RUN, QUEUE = "golden-run", "rollout"
LIMITS = {"max_result_bytes": 1 << 20, "max_result_tokens": 1000, "metadata_bytes": 1024}
PACK = f"raw/{'a' * 32}/{'b' * 32}.pack"


def _ref(seed: str) -> RecordSetRef:
    segment = SegmentRef(RUN, PACK, "b" * 32, 100, "c" * 32)
    return RecordSetRef(RecordRef(segment, 0), seed * 64, 1, 10, 2)


class _Workload:
    """Applies each check's event, keeping the first event of each op."""

    def __init__(self) -> None:
        self.state: QueueState = new_state(RUN, QUEUE, LIMITS)
        self.found: dict[str, events.Event] = {}
        self._count = 0

    def new_id(self) -> str:
        self._count += 1
        return f"id{self._count:02d}"

    def step(self, decision: Any) -> Any:
        assert decision is not None and not isinstance(decision, Answer)
        self.found.setdefault(decision.OP, decision)
        return self.state.apply(decision)

    def lease(self, task_id: str, worker: str = "w1") -> Lease:
        got = self.step(self.state.check_acquire(worker, 1, [task_id], None, False, 1.0, 30.0, self.new_id))
        assert [x.task_id for x in got] == [task_id]
        return got[0]  # type: ignore[no-any-return]


def _workload() -> dict[str, events.Event]:
    w = _Workload()
    s = w.state
    w.step(events.Epoch(epoch=1, identity={"format": "straw-queue", "queue_id": QUEUE, "run_id": RUN}))
    specs = [TaskSpec("t1", metadata={"step": 1}, input_ref=_ref("1")), TaskSpec("t2", priority=2)]
    w.step(s.check_submit("r-submit", specs, "producer", {"next": 2}))
    w.step(s.check_acquire("w1", 2, None, None, False, 0.0, 30.0, w.new_id))
    w.step(s.check_submit("r-more", [TaskSpec(f"t{i}") for i in range(3, 7)], None, None))
    t1, t2 = (s.tasks[t].lease for t in ("t1", "t2"))
    assert t1 is not None and t2 is not None
    progress = s.check_progress([{"lease": t1, "input_ref": _ref("2")}], "r-progress", 1.0)
    assert isinstance(progress, events.Progress)
    w.step(dataclasses.replace(progress, reach={f"{PACK}@100#0": 0}))
    result = _ref("3")
    w.step(s.check_complete(t1, "sub-1", result, result.digest, 1.0, w.new_id, [PACK]))
    update = {"lease": t2, "input_ref": _ref("4"), "priority": 3, "scheduling_key": None, "metadata": None}
    w.step(s.check_yield([update], "r-yield", 1.0))
    t2 = w.lease("t2")
    entries = [(t2, "sub-2", _ref("5"), "5" * 64, [PACK])]
    w.step(s.check_complete_many(entries, 1.0, w.new_id)[0])
    w.step(s.check_fail(w.lease("t3"), "r-fail", "worker crashed", True, 1.0))
    w.step(s.check_release([w.lease("t4")], "r-release", 1.0))
    w.step(s.check_cancel("t5", "r-cancel"))
    w.step(s.check_seal("r-seal"))
    w.lease("t6", "w2")
    w.step(s.check_retire("w2"))
    w.step(s.check_release_reads([t1]))
    w.step(s.ledger.check_open_consumer("training", "trainer", "tok"))
    consumer_state = {"version": 1, "state_ref": as_dict(_ref("6")), "fetch_cursor": 2, "processed_cursor": 1}
    w.step(s.check_save_consumer("training", "tok", "r-save", consumer_state))
    batch = {
        "batch_id": "b1",
        "consumer_id": "training",
        "input_positions": [0, 1],
        "plan_ref": as_dict(_ref("7")),
    }
    w.step(s.check_plan_batch("training", "tok", batch))
    w.step(s.check_batch_ready("training", "tok", "b1", as_dict(_ref("8")), consumer_state))
    w.step(s.ledger.check_release_history((1, frozenset())))
    w.step(s.ledger.check_close_consumer("training", "tok"))
    # The coordinator's own events (Coordinator.drain, register_checkpoint, release_checkpoint).
    w.step(events.Drain())
    w.step(events.RegisterCheckpoint(checkpoint_id="c1", checkpoint_ref=as_dict(_ref("9")), batch_ids=["b1"]))
    w.step(events.ReleaseCheckpoint(checkpoint_id="c1"))
    return w.found


def _doc_lines() -> dict[str, bytes]:
    """The golden block of FORMAT.md 8.3: one canonical JSON body per line, named by its op."""
    text = FORMAT_MD.read_text(encoding="utf-8")
    block = re.search(r"```json queue-events\n(.*?)\n```", text, re.S)
    assert block is not None, "FORMAT.md 8.3 has a ```json queue-events block"
    out: dict[str, bytes] = {}
    for line in block.group(1).splitlines():
        op = re.match(r'.*?"op":"([a-z_]+)"', line)
        assert op is not None, line
        assert op.group(1) not in out, f"two examples of {op.group(1)}"
        out[op.group(1)] = line.encode("utf-8")
    return out


WORKLOAD = _workload()
DOC = _doc_lines()


def test_every_op_class_has_one_golden_example() -> None:
    assert set(events.OPS) == set(DOC) == set(WORKLOAD)


def _ops() -> Iterator[Any]:
    for op in sorted(events.OPS):
        yield pytest.param(op, id=op)


@pytest.mark.parametrize("op", list(_ops()))
def test_each_op_encodes_to_its_golden_bytes_and_decodes_back(op: str) -> None:
    event = WORKLOAD[op]
    assert events.encode(event) == DOC[op]
    back = events.decode(DOC[op])
    assert type(back) is events.OPS[op]
    assert back == event
    assert events.encode(back) == DOC[op]


def test_the_live_only_specs_of_a_submit_are_not_journaled() -> None:
    event = WORKLOAD["submit"]
    assert isinstance(event, events.Submit) and event.specs is not None
    assert b"specs" not in events.encode(event)
    assert events.decode(events.encode(event)).specs is None  # type: ignore[attr-defined]


# --------------------------------------------------------------------------- refused bodies


def _body(op: str, **changes: Any) -> bytes:
    """The golden body of ``op`` with fields replaced (a value None drops the field)."""
    data = decode(DOC[op])
    for name, value in changes.items():
        if value is None:
            del data[name]
        else:
            data[name] = value
    return encode(data)


@pytest.mark.parametrize(
    ("body", "match"),
    [
        (b"[1, 2]", "an object with an op"),
        (b'{"epoch": 1}', "an object with an op"),
        (b'{"op": 7}', "an object with an op"),
        (b"{not json", "invalid canonical JSON"),
        (_body("complete", task_id=None), "lacks field 'task_id'"),
        (_body("fail", retryable="yes"), "field 'retryable' is ill-typed"),
        (_body("acquire", deadline=True), "field 'deadline' is ill-typed"),
        (_body("acquire", grants=[["t1", "a1"]]), "field 'grants' is ill-typed"),
        (_body("release_history", released=[1]), "field 'released' is ill-typed"),
        (_body("epoch", epoch=1.5), "field 'epoch' is ill-typed"),
        (_body("submit", _specs=[]), r"unknown fields \['_specs'\]"),
        (_body("complete_many", completes=[{"task_id": "t"}]), "complete_many entry"),
    ],
    ids=[
        "not-an-object",
        "no-op",
        "op-not-a-string",
        "not-json",
        "missing-field",
        "bool-as-string",
        "bool-as-number",
        "short-grant",
        "bad-released",
        "float-epoch",
        "unknown-field",
        "bad-nested-complete",
    ],
)
def test_a_malformed_body_is_refused_as_corrupt(body: bytes, match: str) -> None:
    with pytest.raises(CorruptData, match=match):
        events.decode(body)


def test_an_unknown_op_is_refused_as_a_newer_schema() -> None:
    with pytest.raises(UnsupportedSchema, match="'compact_history' is not known"):
        events.decode(b'{"op":"compact_history","upto":3}')


def test_fields_added_by_later_writers_may_be_absent() -> None:
    """Bodies from before ``packs``/``identity``/``batch_ids`` were journaled read the same."""
    for op, name in (("complete", "packs"), ("epoch", "identity"), ("register_checkpoint", "batch_ids")):
        body = _body(op, **{name: None})
        event = events.decode(body)
        assert getattr(event, name) is None
        assert events.encode(event) == body  # and they are not written back
