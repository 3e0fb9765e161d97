"""``straw-benchmark`` (src/straw/_benchmark/): trace profiles and the local queue benchmark.

Profiles are checked on traces written by a real store (STRAW_TRACE_DIR) and on hand-made
events whose rates are worked out here; ``run --local`` goes through real processes (the
driver, its worker and straw.rpc on 127.0.0.1) with tiny sizes, passing and failing.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from queue_helpers import descriptors_under
from straw import Record, SharedFilesystemStore, tracing
from straw._benchmark.profile import build_profile
from straw.benchmark import main, profile

MiB = 1024 * 1024
BENCHMARK = Path(sys.executable).parent / "straw-benchmark"


def test_a_real_trace_profiles_to_its_publications_and_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trace = tmp_path / "trace"
    monkeypatch.setenv("STRAW_TRACE_DIR", str(trace))
    with SharedFilesystemStore(tmp_path / "pool", "traced") as store:
        one = store.publish([Record("a", b"x" * 1000), Record("b", b"y" * 24)], submission_id="one")
        store.publish([Record("c", b"z" * 500)], submission_id="two")
        assert [r.payload for r in store.read(one)] == [b"x" * 1000, b"y" * 24]
    assert descriptors_under(trace)  # the trace file stays open while tracing is on
    monkeypatch.delenv("STRAW_TRACE_DIR")
    assert not tracing.enabled()
    assert not descriptors_under(trace)  # turned off: its file is closed
    output = tmp_path / "profile.json"
    report = profile(argparse.Namespace(trace=str(trace), output=str(output)))
    assert json.loads(output.read_text()) == report
    assert report["publications"] == [[1000, 24], [500]]
    assert report["observed_write_payload_bytes"] == 1524
    assert report["observed_write_bytes"] > 1524  # extents carry framing and an index too
    assert report["observed_read_bytes"] == 1024
    assert report["checked_read_bytes"] == 1024  # whole reads check what they return
    assert report["checked_read_amplification"] == 1.0


def _event(op: str, when: float, size: int, **extra: Any) -> dict[str, Any]:
    return {"op": op, "time": when, "bytes": size, "host": "h", "seconds": 0.5, **extra}


def test_rates_are_peaks_of_wall_clock_windows_and_amplification_needs_checked_bytes() -> None:
    payload = [{"bytes": 2 * MiB, "codec": "bytes.v1"}, {"bytes": 100, "codec": "straw.manifest.v1"}]
    writes = [_event("write", t, 2 * MiB + 4096, records=payload) for t in (5.0, 5.9, 6.1, 14.0)]
    ranged = _event("read_range", 5.5, MiB, checked_bytes=3 * MiB)
    report = build_profile([*writes, ranged])
    assert report["publications"] == [[2 * MiB]] * 4  # manifests are not payload
    one, ten = report["payload_completion_rates"]
    assert one["window_seconds"] == 1 and one["write_peak_mib_s"] == 4  # 5.0 and 5.9 share [5, 6)
    assert one["extent_write_peak_mib_s"] == 4 + 2 * 4096 / MiB
    assert ten["write_peak_mib_s"] == 6 / 10  # 5.0, 5.9 and 6.1 share [0, 10)
    assert one["checked_read_peak_mib_s"] == 3 and report["checked_read_amplification"] == 3
    unchecked = build_profile([*writes, _event("read_range", 5.5, MiB)])
    assert unchecked["checked_read_bytes"] is None and unchecked["checked_read_amplification"] is None
    assert unchecked["payload_completion_rates"][0]["checked_read_peak_mib_s"] is None
    assert report["observed_seconds"] == 9.0


def test_profile_refuses_an_empty_or_malformed_trace(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no publication"):
        build_profile([_event("read", 1.0, 10)])
    trace = tmp_path / "trace"
    trace.mkdir()
    (trace / "bad.jsonl").write_text('{"op": "write"}\n')
    out = tmp_path / "p.json"
    with pytest.raises(ValueError, match=r"bad\.jsonl:1: not a trace event"):
        profile(argparse.Namespace(trace=str(trace), output=str(out)))
    assert main(["profile", "--trace", str(trace), "--output", str(out)]) == 3
    assert main(["profile", "--trace", str(tmp_path / "absent"), "--output", str(out)]) == 3
    assert not out.exists()


def _run(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    command = [str(BENCHMARK), "run", "--local", "--root", str(tmp_path / "root")]
    command += ["--report", str(tmp_path / "report.json"), "--timeout", "60", *extra]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def test_a_local_run_passes_verifies_counts_and_removes_its_root(tmp_path: Path) -> None:
    done = _run(tmp_path, "--record-bytes", "3000", "1000", "--gib", str(40 * 4000 / 1024**3))
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["status"] == "passed" and report["publications"] == 40
    assert report["written_bytes"] == report["read_bytes"] == 40 * 4000
    cleanup = json.loads((tmp_path / "report.cleanup.json").read_text())
    assert cleanup["workers_stopped"] and cleanup["removed"]
    assert not (tmp_path / "root").exists()


def test_bad_run_arguments_are_refused_before_anything_is_created(tmp_path: Path) -> None:
    inside = _run(tmp_path, "--report", str(tmp_path / "root" / "r.json"))
    assert inside.returncode == 2 and "outside --root" in inside.stderr
    over = _run(tmp_path, "--gib", "2", "--max-gib", "1")
    assert over.returncode == 2 and "at most --max-gib" in over.stderr
    files = _run(tmp_path, "--record-bytes", "8", "--gib", "0.001", "--segment-mib", "1", "--max-files", "40")
    assert files.returncode == 2 and "over --max-files" in files.stderr
    assert not (tmp_path / "root").exists() and not (tmp_path / "report.cleanup.json").exists()
    (tmp_path / "root").mkdir()
    assert _run(tmp_path).returncode == 2
    hosts = subprocess.run([str(BENCHMARK), "run", "--root", "x", "--report", "y"], capture_output=True)
    assert hosts.returncode == 2  # --local is required


def test_a_run_over_its_storage_budget_fails_and_keeps_its_root(tmp_path: Path) -> None:
    # 8 payload bytes fit the planned budget; the pool's own files (journal, index) do not.
    budget = str(10 / 1024**3)
    failed = _run(tmp_path, "--record-bytes", "8", "--gib", budget, "--max-gib", budget)
    assert failed.returncode == 1
    assert "temporary storage limit exceeded" in failed.stderr
    cleanup = json.loads((tmp_path / "report.cleanup.json").read_text())
    assert cleanup["workers_stopped"] and not cleanup["removed"]
    assert (tmp_path / "root" / "queue").is_dir() and cleanup["files"] > 0
    assert not (tmp_path / "report.json").exists()
