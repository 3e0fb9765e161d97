"""Bad input to every public call of the controller and the readers is a clear error and changes
nothing; a full disk or a failing flush gives straw's documented error and no reference."""

from __future__ import annotations

import dataclasses
import errno
import functools
from collections.abc import Callable
from typing import Any

import pytest

import straw.rollout.pool as pool_module
from rollout_helpers import finish, interrupt, prompt_rows
from straw.backend import FilesystemBackend
from straw.errors import InvalidReference, QuotaExceeded, StaleAttempt, StorageUnavailable
from straw.protocol import Lease, RecordSetRef
from straw.rollout.config import RolloutConfig
from straw.rollout.controller import QueueController
from straw.rollout.reader import QueueDataSource, QueueReader
from straw.rollout.refs import RolloutGroupRef, load_groups, pack_payload
from straw.rollout.sample import Sample

OpenController = Callable[..., QueueController]
OpenReader = Callable[..., QueueReader]
MakeConfig = Callable[..., RolloutConfig]


def fingerprint(controller: QueueController) -> Any:
    """Everything a call could change: tasks, commits, the cursor, consumers, the training view."""
    queue = controller.queue
    return (
        queue.tasks,
        queue.commits,
        queue.producer_state("dataset"),
        queue.consumers,
        controller.training_view(),
        queue.outstanding_reads(),
    )


@dataclasses.dataclass
class World:
    controller: QueueController
    reader: QueueReader
    lease: Lease  # a current lease of reader "r"
    accepted: RolloutGroupRef  # an accepted group
    foreign_lease: Lease  # a lease of another queue
    foreign_ref: RecordSetRef  # a publication of another run in this pool
    other_pool_ref: RecordSetRef  # a publication of another pool


@pytest.fixture
def world(
    open_controller: OpenController, open_reader: OpenReader, make_config: MakeConfig, tmp_path: Any
) -> World:
    controller = open_controller()
    reader = open_reader(controller)
    first, second = reader.get_samples(2)
    accepted = reader.publish_group(finish(first), rollout_id=0)
    other = open_controller(make_config(rollout_data_dir=str(tmp_path / "other-pool")))
    foreign_lease = other.take("r", 1).assignments[0].lease
    foreign_ref = pack_payload(
        [Sample()], config=make_config(rollout_queue_run_id="other-run"), rollout_id=0
    ).manifest
    other_pool_ref = pack_payload([Sample()], config=other.config, rollout_id=0).manifest
    return World(
        controller,
        reader,
        Lease.from_dict(second[0]._queue_lease),
        accepted,
        foreign_lease,
        foreign_ref,
        other_pool_ref,
    )


BAD_CALLS: list[tuple[str, Callable[[World], Any], type[BaseException] | tuple[type[BaseException], ...]]] = [
    ("take without a reader", lambda w: w.controller.take("", 1), ValueError),
    ("take with a number as reader", lambda w: w.controller.take(5, 1), ValueError),  # type: ignore[arg-type]
    ("take as the manager", lambda w: w.controller.take("manager", 1), ValueError),
    ("take zero", lambda w: w.controller.take("r", 0), ValueError),
    ("take a negative count", lambda w: w.controller.take("r", -3), ValueError),
    ("take a text count", lambda w: w.controller.take("r", "2"), TypeError),  # type: ignore[arg-type]
    ("take a bool count", lambda w: w.controller.take("r", True), TypeError),
    ("take a float count", lambda w: w.controller.take("r", 1.5), TypeError),  # type: ignore[arg-type]
    ("heartbeat one lease", lambda w: w.controller.heartbeat(w.lease), TypeError),  # type: ignore[arg-type]
    ("heartbeat numbers", lambda w: w.controller.heartbeat([1]), TypeError),  # type: ignore[list-item]
    ("heartbeat a partial lease", lambda w: w.controller.heartbeat([{"task_id": "x"}]), ValueError),  # type: ignore[list-item]
    ("complete a text lease", lambda w: w.controller.complete("lease", w.accepted.manifest), TypeError),  # type: ignore[arg-type]
    ("complete a dict result", lambda w: w.controller.complete(w.lease, {"digest": "x"}), TypeError),  # type: ignore[arg-type]
    (
        "complete another queue's lease",
        lambda w: w.controller.complete(w.foreign_lease, w.accepted.manifest),
        InvalidReference,
    ),
    (
        "complete another run's result",
        lambda w: w.controller.complete(w.lease, w.foreign_ref),
        InvalidReference,
    ),
    (
        "complete another pool's result",
        lambda w: w.controller.complete(w.lease, w.other_pool_ref),
        (InvalidReference, StorageUnavailable),
    ),
    (
        "complete another attempt's result",
        lambda w: w.controller.complete(w.lease, w.accepted.manifest),
        InvalidReference,
    ),
    ("result of a text", lambda w: w.controller.result("lease"), TypeError),  # type: ignore[arg-type]
    ("results of a lease", lambda w: w.controller.results(w.lease), TypeError),  # type: ignore[arg-type]
    ("release one lease", lambda w: w.controller.release(w.lease), TypeError),  # type: ignore[arg-type]
    ("release the same lease twice", lambda w: w.controller.release([w.lease, w.lease]), ValueError),
    ("fail without a reason", lambda w: w.controller.fail(w.lease, ""), ValueError),
    ("fail with a number", lambda w: w.controller.fail(w.lease, 3), ValueError),  # type: ignore[arg-type]
    ("fail another queue's lease", lambda w: w.controller.fail(w.foreign_lease, "x"), InvalidReference),
    ("reject without a reason", lambda w: w.controller.reject(w.lease, None), ValueError),  # type: ignore[arg-type]
    ("reject another queue's lease", lambda w: w.controller.reject(w.foreign_lease, "x"), InvalidReference),
    ("status of a number", lambda w: w.controller.status(3), ValueError),  # type: ignore[arg-type]
    ("return a dict", lambda w: w.controller.return_groups({"lease": w.lease}, []), TypeError),  # type: ignore[arg-type]
    ("return a list of leases", lambda w: w.controller.return_groups([w.lease], []), TypeError),  # type: ignore[list-item]
    (
        "return an unknown field",
        lambda w: w.controller.return_groups(
            [{"lease": w.lease, "input_ref": w.accepted.manifest, "x": 1}], []
        ),
        ValueError,
    ),
    ("return without input", lambda w: w.controller.return_groups([{"lease": w.lease}], []), ValueError),
    (
        "return a text input",
        lambda w: w.controller.return_groups([{"lease": w.lease, "input_ref": "x"}], []),
        TypeError,
    ),
    (
        "return a text priority",
        lambda w: w.controller.return_groups(
            [{"lease": w.lease, "input_ref": w.accepted.manifest, "priority": "1"}], []
        ),
        TypeError,
    ),
    (
        "return negative sources",
        lambda w: w.controller.return_groups(
            [{"lease": w.lease, "input_ref": w.accepted.manifest, "metadata": {"source_positions": [-1]}}], []
        ),
        ValueError,
    ),
    (
        "return odd metadata",
        lambda w: w.controller.return_groups(
            [{"lease": w.lease, "input_ref": w.accepted.manifest, "metadata": {"x": object()}}], []
        ),
        TypeError,
    ),
    (
        "return another queue's lease",
        lambda w: w.controller.return_groups(
            [{"lease": w.foreign_lease, "input_ref": w.accepted.manifest}], []
        ),
        InvalidReference,
    ),
    (
        "return another run's input",
        lambda w: w.controller.return_groups([{"lease": w.lease, "input_ref": w.foreign_ref}], []),
        InvalidReference,
    ),
    (
        "deliver another run's input",
        lambda w: w.controller.return_groups([], [{"input_ref": w.foreign_ref}]),
        InvalidReference,
    ),
    (
        "deliver an unknown field",
        lambda w: w.controller.return_groups([], [{"input_ref": w.accepted.manifest, "lease": w.lease}]),
        ValueError,
    ),
    (
        "deliver twice",
        lambda w: w.controller.return_groups([], [{"input_ref": w.accepted.manifest}] * 2),
        ValueError,
    ),
    ("retire nobody", lambda w: w.controller.retire_reader(""), ValueError),
    ("retire the manager", lambda w: w.controller.retire_reader("manager"), ValueError),
    ("retire with negative deliveries", lambda w: w.controller.retire_reader("r", [-1]), ValueError),
    ("retire with text deliveries", lambda w: w.controller.retire_reader("r", "0"), TypeError),
    ("retire a prefix of nothing", lambda w: w.controller.retire_readers(""), ValueError),
    ("collect without a request", lambda w: w.controller.begin_collection(""), ValueError),
    ("accept a text", lambda w: w.controller.accepted("receipt"), TypeError),  # type: ignore[arg-type]
    (
        "accept another's receipt",
        lambda w: w.controller.accepted(dataclasses.replace(w.accepted.receipt, position=7)),
        ValueError,
    ),  # type: ignore[arg-type]
    ("batch of a number", lambda w: w.controller.batch(1), ValueError),  # type: ignore[arg-type]
    ("plan an odd id", lambda w: w.controller.plan_batch("x", [0], w.accepted.manifest), ValueError),
    (
        "plan unknown positions",
        lambda w: w.controller.plan_batch("batch:x", [0, 5], w.accepted.manifest),
        ValueError,
    ),
    (
        "plan text positions",
        lambda w: w.controller.plan_batch("batch:x", "0", w.accepted.manifest),
        TypeError,
    ),
    ("plan a text plan", lambda w: w.controller.plan_batch("batch:x", [0], "plan"), TypeError),
    (
        "plan another run's plan",
        lambda w: w.controller.plan_batch("batch:x", [0], w.foreign_ref),
        InvalidReference,
    ),
    (
        "ready an unplanned batch",
        lambda w: w.controller.ready_batch("batch:x", w.accepted.manifest),
        ValueError,
    ),
    ("ready a text", lambda w: w.controller.ready_batch("batch:x", "ref"), TypeError),
    ("finish an unknown batch", lambda w: w.controller.finish_batch("batch:x"), ValueError),
    ("dispose unknown positions", lambda w: w.controller.record_dispositions([9], "x"), ValueError),
    ("snapshot a negative step", lambda w: w.controller.checkpoint_snapshot(-1), ValueError),
    ("snapshot a text step", lambda w: w.controller.checkpoint_snapshot("1"), ValueError),  # type: ignore[arg-type]
    ("metadata of nobody", lambda w: w.controller.reader_metadata(""), ValueError),
    ("metadata of a list", lambda w: w.controller.reader_metadata("r", [1]), TypeError),  # type: ignore[arg-type]
    ("metadata of an object", lambda w: w.controller.reader_metadata("r", {"x": object()}), TypeError),
    ("reader takes a text count", lambda w: w.reader.get_samples("1"), TypeError),  # type: ignore[arg-type]
    ("reader takes a negative count", lambda w: w.reader.get_samples(-1), ValueError),
    ("reader returns numbers", lambda w: w.reader.add_samples([[1]]), TypeError),
    (
        "reader publishes an unleased group",
        lambda w: w.reader.publish_group([Sample(index=0)], rollout_id=0),
        ValueError,
    ),
    ("reader discards without a reason", lambda w: w.reader.discard_group([Sample(index=0)], ""), ValueError),
]


@pytest.mark.parametrize(("name", "call", "error"), BAD_CALLS, ids=[name for name, _, _ in BAD_CALLS])
def test_bad_input_is_a_clear_error_and_changes_nothing(
    world: World, name: str, call: Callable[[World], Any], error: type[BaseException]
) -> None:
    before = fingerprint(world.controller)
    with pytest.raises(error) as raised:
        call(world)
    assert str(raised.value), f"{name}: the error says what was wrong"
    assert fingerprint(world.controller) == before


def test_foreign_leases_are_stale_where_a_call_answers_per_lease(world: World) -> None:
    before = fingerprint(world.controller)
    assert world.controller.heartbeat([world.foreign_lease]) == ["StaleAttempt"]
    assert world.controller.release([world.foreign_lease]) == ["StaleAttempt"]
    assert world.controller.result(world.foreign_lease) is None
    assert fingerprint(world.controller) == before


def test_a_retired_reader_is_fenced(world: World) -> None:
    world.controller.retire_reader("r")
    before = fingerprint(world.controller)
    with pytest.raises(StaleAttempt):
        world.controller.take("r", 1)
    assert fingerprint(world.controller) == before


def test_constructors_check_their_arguments(make_config: MakeConfig, open_controller: OpenController) -> None:
    with pytest.raises(TypeError):
        QueueController("config", dataset=prompt_rows(2))  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        QueueController(make_config(), dataset=prompt_rows(2), restore_plan="new")  # type: ignore[arg-type]
    controller = open_controller(dataset=5)
    with pytest.raises(TypeError, match="a Dataset or a factory"):
        controller.take("r", 1)
    assert controller.queue.tasks == {}
    with pytest.raises(TypeError):
        QueueReader("config", controller, "r")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        QueueReader(controller.config, controller, "")
    with pytest.raises(TypeError):
        QueueReader(controller.config, controller, "r", dataset_size="3")  # type: ignore[arg-type]
    source = QueueDataSource(controller.config, controller=controller)
    try:
        with pytest.raises(ValueError):
            source.reader_config("")
        with pytest.raises(ValueError):
            source.register_consumer("", object())
        with pytest.raises(ValueError):
            source.save(-1)
    finally:
        source.close()
    with pytest.raises(TypeError):
        QueueDataSource(controller.config, controller=controller, reader_prefix=3)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- full disk, failing flush


@pytest.fixture
def faults(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Store backends of the controller's pool raise ``failing["error"]`` at ``failing["phase"]``."""
    failing: dict[str, Any] = {"phase": None, "error": None, "times": None}

    def fault(phase: str) -> None:
        if phase == failing["phase"] and failing["times"] != 0:
            if failing["times"] is not None:
                failing["times"] -= 1
            raise failing["error"]

    monkeypatch.setattr(pool_module, "FilesystemBackend", functools.partial(FilesystemBackend, fault=fault))
    return failing


#: (name, phase, error raised there, straw error expected): a write that runs out of space, a
#: flush that fails before the commit point (docs/DURABILITY.md D1.3).
DISK_FAULTS = [
    ("full disk", "before_data_write", OSError(errno.ENOSPC, "No space left on device"), QuotaExceeded),
    (
        "failing flush",
        "after_data_write",
        OSError(errno.EIO, "shared storage flush failed"),
        StorageUnavailable,
    ),
]
IDS = [d[0] for d in DISK_FAULTS]


@pytest.mark.parametrize(("name", "phase", "error", "raised"), DISK_FAULTS, ids=IDS)
def test_a_refill_on_a_failing_disk_references_nothing(
    faults: dict[str, Any],
    open_controller: OpenController,
    name: str,
    phase: str,
    error: OSError,
    raised: type[Exception],
) -> None:
    controller = open_controller()
    faults.update(phase=phase, error=error)
    with pytest.raises(raised):
        controller.take("r", 1)
    assert controller.queue.tasks == {}
    assert controller.queue.producer_state("dataset")["cursor"]["sample_group_index"] == 0
    faults["phase"] = None
    assert controller.take("r", 1).assignments[0].task.task_id == "prompt:0"


@pytest.mark.parametrize(("name", "phase", "error", "raised"), DISK_FAULTS, ids=IDS)
def test_publishing_on_a_failing_disk_references_nothing(
    faults: dict[str, Any],
    open_controller: OpenController,
    open_reader: OpenReader,
    name: str,
    phase: str,
    error: OSError,
    raised: type[Exception],
) -> None:
    controller = open_controller()
    reader = open_reader(controller)
    first, second, third = reader.get_samples(3)
    accepted = reader.publish_group(finish(third), rollout_id=0)
    faults.update(phase=phase, error=error)
    before = fingerprint(controller)
    with pytest.raises(raised):
        reader.publish_group(finish(first), rollout_id=0)
    with pytest.raises(raised):
        reader.add_samples([interrupt(second)])
    with pytest.raises(raised):
        controller.record_dispositions([accepted.receipt.position], "x")  # type: ignore[union-attr]
    with pytest.raises(raised):
        controller.checkpoint_snapshot(0)
    with pytest.raises(raised):
        reader.update_metadata({"a": 1})
    assert fingerprint(controller) == before  # no task, commit or consumer names a failed write
    faults["phase"] = None
    assert reader.publish_group(first, rollout_id=0).receipt.position == 1  # type: ignore[union-attr]
    reader.add_samples([second])
    assert controller.status("prompt:1")["spec"]["metadata"]["returned"] is True  # type: ignore[index]
    assert load_groups([accepted])[0][0].index == 2


def test_an_uncertain_write_is_settled_and_the_writer_stays_usable(
    faults: dict[str, Any], open_controller: OpenController, open_reader: OpenReader
) -> None:
    controller = open_controller()
    reader = open_reader(controller)
    first, second = reader.get_samples(2)
    faults.update(phase="after_data_sync", error=OSError(errno.EIO, "reply lost after the sync"), times=1)
    ref = reader.publish_group(finish(first), rollout_id=0)  # the uncertain write is retried once
    assert faults["times"] == 0 and ref.receipt is not None and ref.load()[0].index == first[0].index
    reader.add_samples([interrupt(second)])  # the writer is not left busy
    assert controller.record_dispositions([ref.receipt.position], "x") is not None
