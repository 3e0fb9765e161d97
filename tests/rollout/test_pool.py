"""straw.rollout.pool: the cached writers, readers, bounded I/O (acceptance scenarios 4 and 5)."""

from __future__ import annotations

import asyncio
import functools
import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from straw.backend import FilesystemBackend
from straw.errors import StorageUnavailable
from straw.rollout import pool as pool_module
from straw.rollout.config import RolloutConfig
from straw.rollout.pool import (
    close_rollout_stores,
    open_reader,
    probe_roundtrip,
    rollout_store,
    run_io,
    seal_rollout_store,
)
from straw.rollout.refs import pack_payload

MakeConfig = Callable[..., RolloutConfig]

WAIT_S = 30.0  # bound on every event wait


def packs(pool: Path) -> list[Path]:
    return sorted(pool.rglob("*.pack"))


# --------------------------------------------------------------------------- scenario 4


def test_scenario_4_one_cached_writer_per_key_and_segment_rotation(
    make_config: MakeConfig, pool: Path
) -> None:
    config = make_config()
    first, second = rollout_store(config), rollout_store(config)
    assert first.store is second.store and first.lock is second.lock
    assert first.codec is not second.codec and first.codec.store is first.store
    assert rollout_store(make_config(rollout_queue_online_gc=True)).store is not first.store
    assert first.store.segment_target_bytes == 2**30
    refs = [pack_payload(bytes([i]) * 400_000, config=config, rollout_id=0) for i in range(4)]
    assert len(packs(pool)) == 1
    assert [r.load() for r in refs] == [bytes([i]) * 400_000 for i in range(4)]

    small = make_config(rollout_queue_segment_mib=1)
    rotating = rollout_store(small).store
    assert rotating is not first.store and rotating.segment_target_bytes == 2**20
    more = [pack_payload(bytes([i]) * 400_000, config=small, rollout_id=1) for i in range(4)]
    assert [r.load() for r in more] == [bytes([i]) * 400_000 for i in range(4)]  # readable at once
    assert len(packs(pool)) >= 3
    seal_rollout_store(small)
    close_rollout_stores()
    assert [r.load() for r in refs + more] == [bytes([i]) * 400_000 for i in range(4)] * 2


def test_an_unbound_configuration_is_bound_to_its_save_directory(
    make_config: MakeConfig, tmp_path: Path
) -> None:
    config = make_config(rollout_data_dir=None, save=str(tmp_path / "save"), save_interval=1)
    bound = rollout_store(config)
    assert str(bound.store.backend.root) == str(tmp_path / "save" / "rollout_data")
    assert (
        rollout_store(make_config(rollout_data_dir=str(tmp_path / "save" / "rollout_data"))).store
        is bound.store
    )


def test_seal_starts_a_new_pack(make_config: MakeConfig, pool: Path) -> None:
    config = make_config()
    pack_payload(b"a" * 2000, config=config, rollout_id=0)
    seal_rollout_store(config)
    pack_payload(b"b" * 2000, config=config, rollout_id=0)
    assert len(packs(pool)) == 2
    seal_rollout_store(make_config(rollout_queue_online_gc=True))  # no such writer yet: nothing happens
    assert len(packs(pool)) == 2


# --------------------------------------------------------------------------- scenario 5


def test_scenario_5_a_failing_flush_gives_no_reference_and_no_pack(
    make_config: MakeConfig, pool: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    failing = {"on": True}

    def fault(phase: str) -> None:
        # The peer calls this point before_directory_sync; ours names the sync of a new pack's data.
        if failing["on"] and phase in ("before_directory_sync", "after_data_sync"):
            raise OSError("shared storage flush failed")

    monkeypatch.setattr(pool_module, "FilesystemBackend", functools.partial(FilesystemBackend, fault=fault))
    config = make_config()
    with pytest.raises(StorageUnavailable, match="shared storage flush failed"):
        pack_payload({"text": "x" * 5000}, config=config, rollout_id=0)
    assert packs(pool) == []
    failing["on"] = False
    ref = pack_payload({"text": "y" * 5000}, config=config, rollout_id=0)
    assert ref.load() == {"text": "y" * 5000}


def test_scenario_5_juicefs_without_a_declaration_fails_before_any_file(
    make_config: MakeConfig, pool: Path
) -> None:
    config = make_config(rollout_storage_profile="juicefs")
    with pytest.raises(ValueError, match="juicefs declaration is missing 'direct_mount'"):
        rollout_store(config)
    assert not pool.exists()


def test_declarations_are_read_and_checked(make_config: MakeConfig, pool: Path, tmp_path: Path) -> None:
    absent = tmp_path / "absent.json"
    with pytest.raises(ValueError, match=rf"^Cannot read --rollout-storage-declaration {absent}: "):
        rollout_store(make_config(rollout_storage_declaration=str(absent)))
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(ValueError, match=r"Cannot read --rollout-storage-declaration .*broken.json"):
        rollout_store(make_config(rollout_storage_declaration=str(broken)))
    listed = tmp_path / "list.json"
    listed.write_text("[1]")
    with pytest.raises(ValueError, match="not a JSON object"):
        rollout_store(make_config(rollout_storage_declaration=str(listed)))
    wrong = tmp_path / "wrong.json"
    wrong.write_text(
        json.dumps({"direct_mount": True, "writeback": True, "open_cache": 0, "readdir_cache": False})
    )
    with pytest.raises(ValueError, match="writeback=True; straw requires writeback=False"):
        rollout_store(make_config(rollout_storage_profile="juicefs", rollout_storage_declaration=str(wrong)))
    assert not pool.exists()
    good = tmp_path / "good.json"
    declaration = {
        "direct_mount": True,
        "writeback": False,
        "open_cache": 0,
        "readdir_cache": False,
        "client_version": "1.2",
        "durability_description": "local test",
    }
    good.write_text(json.dumps(declaration))
    config = make_config(rollout_storage_profile="juicefs", rollout_storage_declaration=str(good))
    store = rollout_store(config).store
    assert store.backend.profile == "juicefs" and store.backend.declaration == declaration
    assert rollout_store(config).store is store


def test_rollout_store_bad_input() -> None:
    with pytest.raises(TypeError, match="expected a RolloutConfig"):
        rollout_store({"rollout_data_dir": "/x"})  # type: ignore[arg-type]


# --------------------------------------------------------------------------- readers and probes


def test_open_reader_creates_no_writer(make_config: MakeConfig, pool: Path) -> None:
    config = make_config()
    ref = pack_payload([1, 2, 3], config=config, rollout_id=0)
    writers = sorted(p.name for p in (pool / "raw").iterdir())
    with open_reader(pool, "rollout") as session:
        assert ref.load(reader=session) == [1, 2, 3]
        assert session.root == str(pool) and session.run_id == "rollout"
    assert sorted(p.name for p in (pool / "raw").iterdir()) == writers
    with pytest.raises(ValueError, match="run_id must be a non-empty string"):
        open_reader(pool, "")


def test_probe_roundtrip(make_config: MakeConfig) -> None:
    config = make_config()
    ref = probe_roundtrip(config, "marker-123")
    assert rollout_store(config).codec.load(ref) == {"probe": "marker-123"}
    assert probe_roundtrip(config, "marker-123") == ref  # the same marker is the same submission
    with pytest.raises(ValueError, match="non-empty string"):
        probe_roundtrip(config, "")


# --------------------------------------------------------------------------- run_io


def test_run_io_bounds_concurrency_per_event_loop(make_config: MakeConfig) -> None:
    config = make_config(rollout_io_concurrency=2)
    lock = threading.Lock()
    state = {"active": 0, "peak": 0, "started": 0}
    two_started = threading.Event()
    release = threading.Event()

    def work(n: int) -> int:
        with lock:
            state["active"] += 1
            state["started"] += 1
            state["peak"] = max(state["peak"], state["active"])
            if state["started"] == 2:
                two_started.set()
        try:
            if not release.wait(WAIT_S):
                raise TimeoutError("never released")
            return n * 10
        finally:
            with lock:
                state["active"] -= 1

    async def main() -> list[int]:
        loop = asyncio.get_running_loop()
        tasks = [asyncio.create_task(run_io(config, work, n)) for n in range(5)]
        assert await loop.run_in_executor(None, two_started.wait, WAIT_S)
        for _ in range(20):
            await asyncio.sleep(0)  # let every task reach the semaphore
        assert state["started"] == 2
        release.set()
        return list(await asyncio.gather(*tasks))

    assert asyncio.run(main()) == [0, 10, 20, 30, 40]
    assert state["peak"] == 2


def test_run_io_waits_for_the_thread_when_cancelled(make_config: MakeConfig) -> None:
    config = make_config()
    started, release = threading.Event(), threading.Event()
    finished: list[str] = []

    def publish() -> str:
        started.set()
        if not release.wait(WAIT_S):
            raise TimeoutError("never released")
        finished.append("durable")
        return "ref"

    async def main() -> None:
        loop = asyncio.get_running_loop()
        task = asyncio.create_task(run_io(config, publish))
        assert await loop.run_in_executor(None, started.wait, WAIT_S)
        task.cancel()
        for _ in range(20):
            await asyncio.sleep(0)
        assert not task.done()  # still holding its slot while the write runs
        task.cancel()  # a second cancellation does not abandon it either
        for _ in range(5):
            await asyncio.sleep(0)
        assert not task.done()
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert finished == ["durable"]

    asyncio.run(main())


def test_run_io_passes_errors_and_results(make_config: MakeConfig) -> None:
    config = make_config()

    def fails(message: str) -> Any:
        raise StorageUnavailable(message)

    async def main() -> None:
        assert await run_io(config, lambda a, b: a + b, 2, 3) == 5
        with pytest.raises(StorageUnavailable, match="disk gone"):
            await run_io(config, fails, "disk gone")

    asyncio.run(main())


def test_an_archive_replay_writes_to_the_archives_pool(make_config: MakeConfig, tmp_path: Path) -> None:
    archive_pool = tmp_path / "archive-pool"
    index = {
        "format": "straw.rollout-archive",
        "version": 1,
        "root": str(archive_pool),
        "run_id": "debug-run",
    }
    (tmp_path / "rollout_3.straw.json").write_text(json.dumps(index))
    config = make_config(load_debug_rollout_data=str(tmp_path / "rollout_{rollout_id}.straw.json"))
    store = rollout_store(config).store
    assert (str(store.backend.root), store.run_id) == (str(archive_pool), "debug-run")
    assert not Path(config.rollout_data_dir or "").exists()  # the flags' pool is never created
