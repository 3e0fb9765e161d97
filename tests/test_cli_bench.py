"""The ``straw`` command line and ``straw bench`` (src/straw/cli/, src/straw/benchmark.py).

End-to-end runs go through real subprocesses (the installed console script and
``python -m``) with tiny sizes; the pieces that decide the outcome (verification,
the memory check, percentiles, the progress bar, sample generation) are also
driven in-process so a failing check is proven to fail.
"""

from __future__ import annotations

import importlib.metadata
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import straw
from straw import benchmark
from straw.errors import QuotaExceeded
from straw.protocol import Record

BIN = Path(sys.executable).parent
STRAW = BIN / "straw"
PUBLISH_PHASES = ("bulk publish", "small publish", "small publish_many(100)", "large publish")
READ_PHASES = ("bulk read-back", "small read-back", "large read-back")


def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=cwd)


def bench_dirs(root: Path) -> list[Path]:
    return sorted(root.glob("straw-bench-*"))


# --------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    """One `straw bench` run with tiny sizes, shared by the tests that inspect its output."""
    root = tmp_path_factory.mktemp("bench")
    out = root / "out.json"
    args = ["--root", str(root), "--mib", "8", "--small", "50", "--big-mib", "16", "--json", str(out)]
    result = run(str(STRAW), "bench", *args)
    return result, root


def test_console_script_is_declared_and_installed() -> None:
    entry = [e for e in importlib.metadata.entry_points(group="console_scripts") if e.name == "straw"]
    assert [e.value for e in entry] == ["straw.cli:main"]
    assert STRAW.is_file()


def test_tiny_bench_exits_0_and_reports_every_phase(tiny_run: tuple[Any, Path]) -> None:
    result, root = tiny_run
    assert result.returncode == 0, result.stderr + result.stdout
    report = json.loads((root / "out.json").read_text())
    phases = {p["name"]: p for p in report["phases"]}
    assert list(phases) == [
        "bulk publish",
        "bulk read-back",
        "small publish",
        "small publish_many(100)",
        "small read-back",
        "large publish",
        "large read-back",
    ]
    for name, phase in phases.items():
        assert phase["throughput_mib_s"] > 0, name
        assert phase["ops_s"] > 0, name
        assert phase["latency_ms"]["p50"] <= phase["latency_ms"]["p99"] <= phase["latency_ms"]["max"], name
        assert phase["mismatches"] == 0, name
        assert name in result.stdout, name
    for name in PUBLISH_PHASES:
        # Each publication is made durable: at least one fsync each, and batching shares them.
        assert phases[name]["fsyncs_per_publication"] > 0, name
    assert phases["small publish"]["fsyncs_per_publication"] >= 1
    assert phases["small publish_many(100)"]["fsyncs_per_publication"] < 0.1
    for name in READ_PHASES:
        assert phases[name]["verified"] is True
        assert phases[name]["fsyncs_per_publication"] == 0, name
    # 8 MiB of ~1.25 MiB samples = 7 samples; 50 + 50 small publications.
    assert phases["bulk publish"]["publications"] == 7
    assert phases["bulk read-back"]["volume_bytes"] == phases["bulk publish"]["volume_bytes"]
    assert phases["small read-back"]["publications"] == 100
    assert phases["large publish"]["volume_bytes"] == 16 * 2**20
    assert report["verification"] == {
        "checked": 7 + 100 + phases["large read-back"]["publications"],
        "mismatches": 0,
        "memory_ok": True,
        "passed": True,
        "problems": [],
    }


def test_tiny_bench_writes_packs_not_one_file_per_sample(tiny_run: tuple[Any, Path]) -> None:
    result, root = tiny_run
    report = json.loads((root / "out.json").read_text())
    pool = report["pool"]
    publications = sum(p["publications"] for p in report["phases"] if p["name"] in PUBLISH_PHASES)
    assert publications == 7 + 50 + 50 + 1
    # 25 MiB in 64 MiB packs: a single pack file holds every publication.
    assert pool["files_under_raw"] == pool["files_created"] == pool["packs_created"] == 1
    assert pool["bytes_on_disk"] >= 8 * 2**20 + 16 * 2**20
    assert f"files under raw/: {pool['files_under_raw']}" in result.stdout


def test_tiny_bench_memory_check_and_machine_facts(tiny_run: tuple[Any, Path]) -> None:
    result, root = tiny_run
    report = json.loads((root / "out.json").read_text())
    memory = report["memory"]
    assert memory["array_bytes"] == 16 * 2**20
    assert memory["max_buffer_bytes"] == 512 * 2**20
    assert memory["passed"] is True
    assert 0 <= memory["peak_increase_bytes"] <= memory["max_buffer_bytes"]
    assert "(max_buffer_bytes): PASS" in result.stdout
    machine = report["machine"]
    assert machine["cpus"] == os.cpu_count()
    assert machine["straw"] == straw.__version__
    assert machine["filesystem"] == benchmark.filesystem_of(root)
    assert "verification: " in result.stdout and result.stdout.rstrip().endswith("PASS")
    assert len(result.stdout.splitlines()) < 40


def test_bench_removes_its_pool_unless_keep(tiny_run: tuple[Any, Path], tmp_path: Path) -> None:
    _, root = tiny_run
    assert bench_dirs(root) == []
    result = run(str(STRAW), "bench", "--root", str(tmp_path), "--mib", "1", "--small", "0", "--big-mib", "0")
    assert result.returncode == 0, result.stderr
    assert bench_dirs(tmp_path) == []
    kept = run(
        str(STRAW),
        "bench",
        "--root",
        str(tmp_path),
        "--mib",
        "1",
        "--small",
        "0",
        "--big-mib",
        "0",
        "--keep",
        "--quiet",
    )
    assert kept.returncode == 0, kept.stderr
    (pool,) = bench_dirs(tmp_path)
    assert (pool / "straw-pool.json").is_file()
    assert f"pool kept at {pool}" in kept.stderr
    assert kept.stderr.count("\n") == 1  # --quiet: no progress lines, only the kept-pool note


def test_python_m_benchmark_runs_without_the_large_phase(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    args = ["--root", str(tmp_path), "--mib", "4", "--small", "10", "--big-mib", "0", "--json", str(out)]
    result = run(sys.executable, "-m", "straw.benchmark", *args)
    assert result.returncode == 0, result.stderr
    names = [p["name"] for p in json.loads(out.read_text())["phases"]]
    assert names == [
        "bulk publish",
        "bulk read-back",
        "small publish",
        "small publish_many(100)",
        "small read-back",
    ]
    assert "large publish" not in result.stdout
    # Piped stderr is not a terminal: plain progress lines, no carriage returns.
    assert "\r" not in result.stderr
    assert "straw bench: bulk publish: 4/4" in result.stderr


# --------------------------------------------------------------------------- command line


def test_bench_help_documents_options_and_exit_codes() -> None:
    result = run(str(STRAW), "bench", "--help")
    assert result.returncode == 0
    for option in ("--root", "--mib", "--segment-mib", "--profile", "--declaration", "--small", "--big-mib"):
        assert option in result.stdout, option
    for option in ("--json", "--quiet", "--keep"):
        assert option in result.stdout, option
    assert "exit codes:" in result.stdout
    for code in ("0  every verification passed", "1  a verification failed", "2  usage error", "3  the run"):
        assert code in result.stdout, code


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--mib", "0"], "argument --mib: must be >= 1, got 0"),
        (["--mib", "lots"], "argument --mib: expected a whole number, got 'lots'"),
        (["--big-mib", "-1"], "argument --big-mib: must be >= 0, got -1"),
        (["--profile", "nfs"], "argument --profile: invalid choice: 'nfs'"),
        (["--no-such-option"], "unrecognized arguments: --no-such-option"),
    ],
)
def test_invalid_option_exits_2(args: list[str], message: str) -> None:
    result = run(str(STRAW), "bench", *args)
    assert result.returncode == 2
    assert message in result.stderr
    assert result.stdout == ""


def test_juicefs_profile_without_declaration_is_a_usage_error(tmp_path: Path) -> None:
    result = run(str(STRAW), "bench", "--root", str(tmp_path), "--profile", "juicefs")
    assert result.returncode == 2
    assert "straw bench: error: juicefs declaration is missing 'direct_mount'" in result.stderr
    assert bench_dirs(tmp_path) == []


def test_unreadable_declaration_and_missing_root_are_usage_errors(tmp_path: Path) -> None:
    bad = tmp_path / "decl.json"
    bad.write_text("{not json")
    result = run(str(STRAW), "bench", "--root", str(tmp_path), "--declaration", str(bad))
    assert result.returncode == 2
    assert f"cannot read --declaration {bad}" in result.stderr
    assert bench_dirs(tmp_path) == []
    missing = tmp_path / "nowhere"
    result = run(str(STRAW), "bench", "--root", str(missing))
    assert result.returncode == 2
    assert f"--root {missing} is not an existing directory" in result.stderr


def test_straw_without_command_prints_help_and_version_matches_package() -> None:
    result = run(str(STRAW))
    assert result.returncode == 0
    assert result.stdout.startswith("usage: straw")
    assert "bench" in result.stdout
    version = run(str(STRAW), "--version")
    assert version.returncode == 0
    assert version.stdout.strip() == f"straw {straw.__version__}"
    module = run(sys.executable, "-m", "straw", "--version")
    assert module.stdout == version.stdout


# --------------------------------------------------------------------------- failing checks, in-process

SMALL_RUN = ["--mib", "2", "--small", "3", "--big-mib", "0", "--quiet"]


def test_payload_mismatch_on_read_back_exits_1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    original = benchmark.small_record
    calls: dict[int, int] = {}

    def drifting(index: int) -> Record:
        # The second generation of publication 4 (the read-back's expectation) differs by one byte.
        calls[index] = calls.get(index, 0) + 1
        record = original(index)
        if index == 4 and calls[index] == 2:
            payload = bytearray(record.payload)
            payload[100] ^= 1
            return Record(record.record_id, bytes(payload), record.codec, record.metadata)
        return record

    monkeypatch.setattr(benchmark, "small_record", drifting)
    out = tmp_path / "r.json"
    code = benchmark.main(["--root", str(tmp_path), *SMALL_RUN, "--json", str(out)])
    assert code == 1
    stdout = capsys.readouterr().out
    assert "small read-back" in stdout and "1 BAD" in stdout
    assert "problem: small read-back: small 4: record 'event' payload bytes differ" in stdout
    assert ", 1 mismatches: FAIL\n  problem:" in stdout
    verification = json.loads(out.read_text())["verification"]
    assert (verification["mismatches"], verification["passed"]) == (1, False)


def test_memory_check_over_max_buffer_bytes_exits_1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Pretend the peak resident memory after publishing is 600 MiB above the level before it.
    monkeypatch.setattr(benchmark, "_rss_bytes", lambda: 100 * 2**20)
    monkeypatch.setattr(benchmark, "_peak_rss_bytes", lambda: 700 * 2**20)
    args = ["--root", str(tmp_path), "--mib", "1", "--small", "0", "--big-mib", "1", "--quiet"]
    assert benchmark.main(args) == 1
    stdout = capsys.readouterr().out
    assert "peak RSS +600.0 MiB while publishing, limit 512.0 MiB (max_buffer_bytes): FAIL" in stdout
    assert "resident memory grew by 600.0 MiB" in stdout
    assert "0 mismatches: FAIL" in stdout


def test_storage_error_exits_3(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def full(*_: object, **__: object) -> None:
        raise QuotaExceeded("disk quota exceeded (simulated)")

    monkeypatch.setattr(benchmark.SharedFilesystemStore, "publish", full)
    assert benchmark.main(["--root", str(tmp_path), *SMALL_RUN]) == 3
    captured = capsys.readouterr()
    assert "the run stopped: QuotaExceeded: disk quota exceeded (simulated)" in captured.err
    assert captured.out == ""
    assert bench_dirs(tmp_path) == []


# --------------------------------------------------------------------------- pieces


def test_samples_are_deterministic_rl_shaped_and_zero_copy() -> None:
    first, again, other = (
        benchmark.sample_records(3),
        benchmark.sample_records(3),
        benchmark.sample_records(4),
    )
    assert [r.record_id for r in first] == ["sample", "tokens", "logprobs", "routing"]
    assert [bytes(r.payload) for r in first] == [bytes(r.payload) for r in again]
    assert bytes(first[1].payload) != bytes(other[1].payload)
    description = json.loads(first[0].payload)
    assert len(first[0].payload) == 1024 and first[0].codec == "json.v1"
    assert description["task_id"] == "task-000003" and description["attempt_id"] == "attempt-0"
    tokens = np.frombuffer(first[1].payload, dtype=np.int32)
    assert tokens.size == 8192 and description["prompt_ids"] == tokens[:48].tolist()
    prompt = description["prompt_tokens"]
    assert description["response_ids"] == tokens[prompt : prompt + 48].tolist()
    for record in first[1:]:
        assert isinstance(record.payload, memoryview) and isinstance(record.payload.obj, np.ndarray)
        assert record.metadata["task_id"] == "task-000003"
    assert first[2].metadata["dtype"] == "float32" and first[3].metadata["shape"] == [8192, 38]
    total = sum(memoryview(r.payload).nbytes for r in first)
    assert abs(total - 1.25 * 2**20) < 4096


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(100, 0, -1)]
    assert [benchmark._percentile(values, q) for q in (50, 90, 99, 100)] == [50.0, 90.0, 99.0, 100.0]
    assert benchmark._percentile([7.0], 99) == 7.0
    assert benchmark._percentile([], 50) == 0.0


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_redraws_one_line_on_a_terminal_and_prints_lines_otherwise() -> None:
    now = [0.0]
    tty = Terminal()
    bar = benchmark.Progress("bulk publish", 4, stream=tty, clock=lambda: now[0])
    for _ in range(4):
        now[0] += 1.0
        bar.advance(1, 2**20)
    bar.close()
    text = tty.getvalue()
    assert text.count("\r") == 6 and text.endswith("\n") and text.count("\n") == 1
    assert "[########################] 4/4  4 MiB  1 MiB/s" in text

    now[0] = 0.0
    plain = io.StringIO()
    bar = benchmark.Progress("small publish", 10, stream=plain, clock=lambda: now[0])
    for _ in range(10):
        now[0] += 1.0
        bar.advance()
    bar.close()
    assert "\r" not in plain.getvalue()
    assert plain.getvalue().splitlines() == [
        "straw bench: small publish: 5/10 (50%, 5.0 s)",
        "straw bench: small publish: 10/10 (100%, 10.0 s)",
    ]

    quiet = io.StringIO()
    bar = benchmark.Progress("x", 1, stream=quiet, enabled=False)
    bar.advance()
    bar.close()
    assert quiet.getvalue() == ""


def test_filesystem_of_finds_the_longest_mount_prefix(tmp_path: Path) -> None:
    found = benchmark.filesystem_of(tmp_path)
    if not Path("/proc/mounts").exists():
        pytest.skip("no /proc/mounts on this platform")
    real = os.path.realpath(tmp_path)
    assert real == found["mount"] or real.startswith(found["mount"].rstrip("/") + "/")
    assert os.stat(found["mount"]).st_dev == os.stat(real).st_dev
    assert found["type"] != "unknown"


@pytest.mark.juicefs
def test_bench_on_juicefs_with_a_declaration(
    juicefs_clients: Any, juicefs_pool: tuple[Path, Path], tmp_path: Path
) -> None:
    on_a, _ = juicefs_pool
    declaration = tmp_path / "declaration.json"
    declaration.write_text(json.dumps(juicefs_clients.declaration))
    out = tmp_path / "r.json"
    sizes = ["--mib", "4", "--small", "20", "--big-mib", "8", "--json", str(out)]
    args = ["--root", str(on_a), "--profile", "juicefs", "--declaration", str(declaration), *sizes]
    result = run(str(STRAW), "bench", *args)
    assert result.returncode == 0, result.stderr + result.stdout
    report = json.loads(out.read_text())
    assert report["machine"]["filesystem"]["type"].startswith("fuse")
    assert report["options"]["profile"] == "juicefs"
    assert report["verification"]["passed"] is True
    assert "profile juicefs" in result.stdout
    assert bench_dirs(on_a) == []
