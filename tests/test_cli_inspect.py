"""``straw inspect``: tables and JSON of real pools, ``--why PACK``, and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pool_damage import RUN, build_pool, close_pool, packs, tree_digest
from straw._inspect.view import inspect_pool, why
from straw.cli import main
from straw.coordinator import Coordinator


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["inspect", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_inspect_live_pool_shows_packs_owners_queues_and_leases(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    built = build_pool(tmp_path, tasks=5, done=2, leased=1)
    before = tree_digest(tmp_path)
    code, out, err = run(capsys, str(tmp_path))
    assert (code, err) == (0, "")
    for text in (
        "PACKS",
        "OWNERS",
        "QUEUE 'rollout'",
        "completed 2",
        "leased 1",
        "pending 2",
        "holder-0",
        "open",
    ):
        assert text in out
    data = inspect_pool(tmp_path)
    assert data["run_ids"] == [RUN]
    (queue,) = data["queues"]
    assert queue["tasks"] == {"completed": 2, "leased": 1, "pending": 2} and queue["commits"] == 2
    (lease,) = queue["leases"]
    assert (
        lease["worker_id"] == "holder-0" and lease["age_seconds"] == 0.0 and lease["frames_since_grant"] == 0
    )
    (pack,) = data["packs"]
    assert pack["state"] == "open" and pack["writer_alive"] is True and pack["owners"] == [queue["owner"]]
    assert pack["live_bytes"] + pack["dead_bytes"] == pack["size"] and pack["tail"] == "zeros"
    assert data["owners"][queue["owner"]]["packs"] == 1
    assert tree_digest(tmp_path) == before
    close_pool(built)


def test_inspect_json_includes_namespaced_queues_and_consumers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    built = build_pool(tmp_path)
    other = Coordinator(built.store, queue_id="eval", namespace=True, exclusive_owner="ns")
    token = other.open_consumer("training", exclusive_owner="trainer")
    assert token
    other.close()
    close_pool(built)
    code, out, _ = run(capsys, str(tmp_path), "--json")
    data = json.loads(out)
    assert code == 0
    by_id = {q["queue_id"]: q for q in data["queues"]}
    assert set(by_id) == {"rollout", "eval"} and by_id["eval"]["directory"].startswith("queues/")
    assert by_id["eval"]["consumers"]["training"]["owner"] == "trainer"
    assert by_id["rollout"]["journal"]["last_snapshot_seq"] is not None  # close() snapshots
    assert data["packs"][0]["state"] == "sealed"


def test_why_explains_retention(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    close_pool(build_pool(tmp_path))
    (pack,) = packs(tmp_path)
    relative = pack.relative_to(tmp_path).as_posix()
    answer = why(tmp_path, relative)
    assert answer["retained"] and answer["exists"] and answer["queues"] == ["rollout"]
    assert any(reason.startswith("owner queue:") for reason in answer["reasons"])
    code, out, _ = run(capsys, str(tmp_path), "--why", str(pack))
    assert code == 0 and "retained because:" in out and "owner queue:" in out
    code, out, _ = run(capsys, str(tmp_path), "--why", relative, "--json")
    assert code == 0 and json.loads(out)["pack"] == relative


def test_why_unknown_pack_and_not_a_pool_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, str(tmp_path))
    assert (code, out) == (2, "") and "is not a straw pool" in err
    close_pool(build_pool(tmp_path))
    code, out, err = run(capsys, str(tmp_path), "--why", "raw/" + "0" * 32 + "/" + "1" * 32 + ".pack")
    assert (code, out) == (2, "") and "is not a pack of" in err and "Traceback" not in err


def test_inspect_help_documents_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["inspect", "--help"])
    out = capsys.readouterr().out
    assert "exit codes:" in out and "--why PACK" in out
