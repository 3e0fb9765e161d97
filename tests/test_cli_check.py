"""``straw check``: real pools built with the store and coordinator, then damaged (docs/CHECK.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pool_damage import (
    RUN,
    build_pool,
    close_pool,
    drop_queue_ownership,
    flip,
    packs,
    result_pool,
    segments,
    tree_digest,
)
from queue_helpers import crash
from straw._fs import lock
from straw._inspect.check import check_pool
from straw._journal import frame as journal_frame
from straw.backend import FilesystemBackend
from straw.cli import main
from straw.coordinator import Coordinator
from straw.protocol import Record
from straw.store import SharedFilesystemStore

REPO = Path(__file__).resolve().parents[1]


def codes(report: object) -> dict[str, str]:
    return {f.code: f.severity for f in report.findings}  # type: ignore[attr-defined]


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["check", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_clean_live_pool_is_ok_and_check_changes_no_byte(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    built = build_pool(tmp_path)  # a live writer (open pack, zeros ahead) and a live coordinator
    before = tree_digest(tmp_path)
    code, out, err = run(capsys, str(tmp_path))
    assert (code, err) == (0, "")
    assert "ok: no problems" in out
    assert "pack.open" not in out and "informational note(s); --verbose shows them" in out
    report = check_pool(tmp_path)
    notes = len(report.findings)
    assert f"{notes} informational note(s)" in out
    code, out, _ = run(capsys, str(tmp_path), "--verbose")
    assert code == 0 and "pack.open" in out and "journal.zero_tail" in out and "--verbose shows" not in out
    code, out, _ = run(capsys, str(tmp_path), "--json")
    assert code == 0 and len(json.loads(out)["findings"]) == notes
    assert report.ok and {"pack.open", "pack.zero_tail", "journal.zero_tail"} <= set(codes(report))
    assert all(f.severity == "info" for f in report.findings)
    assert tree_digest(tmp_path) == before
    close_pool(built)
    code, out, _ = run(capsys, str(tmp_path), "--json")
    document = json.loads(out)
    assert code == 0 and document["ok"] is True and document["findings"] == []
    assert document["run_ids"] == [RUN]


def test_flipped_record_byte_is_pack_checksum_and_fix_leaves_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    close_pool(build_pool(tmp_path))
    pack = packs(tmp_path)[0]
    flip(pack, 150)  # inside the first record frame's body
    before = tree_digest(tmp_path)
    code, out, _ = run(capsys, str(tmp_path))
    assert code == 1 and "pack.checksum" in out and "1 problem(s) remain" in out
    assert tree_digest(tmp_path) == before
    code, _, _ = run(capsys, str(tmp_path), "--fix")
    assert code == 1 and tree_digest(tmp_path) == before
    report = check_pool(tmp_path)
    assert codes(report) == {"pack.checksum": "error"}
    assert "offset 64" in report.findings[0].message


@pytest.mark.parametrize("cut", [1, 3, 30, 60])
def test_a_sealed_pack_cut_inside_its_seal_is_damage(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], cut: int
) -> None:
    # Issue 10: the seal is the writer's last write; a file ending inside it was shortened
    # afterwards (a copy, a truncation), even though every extent before it still reads.
    built = build_pool(tmp_path)
    built.store.close()
    pack = packs(tmp_path)[0]
    with open(pack, "r+b") as handle:
        handle.truncate(pack.stat().st_size - cut)
    report = check_pool(tmp_path)
    assert codes(report)["pack.short_seal"] == "error"
    assert not report.ok
    code, out, _ = run(capsys, str(tmp_path))
    assert code == 1 and "pack.short_seal" in out and "cut short" in out
    crash(built.coordinator)


def test_an_unsealed_pack_with_a_torn_append_is_only_noted(tmp_path: Path) -> None:
    built = build_pool(tmp_path)
    built.store.close()
    pack = packs(tmp_path)[0]
    seal_start = _seal_offset(pack)
    with open(pack, "r+b") as handle:
        # No seal at all, then half a record frame: what a writer that died mid-append leaves.
        handle.truncate(seal_start)
        handle.seek(seal_start)
        handle.write(b"SFRM\x01" + b"\x07" * 20)
    report = check_pool(tmp_path)
    assert codes(report)["pack.torn_tail"] == "info"
    assert "pack.short_seal" not in codes(report)
    assert report.ok  # nothing after the last complete extent can be referenced
    crash(built.coordinator)


def _seal_offset(pack: Path) -> int:
    data = pack.read_bytes()
    at = data.rfind(b"SFRM\x03")
    assert at > 0
    return at


def test_tombstoned_pack_left_on_disk_is_unlinked_by_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def fault(phase: str) -> None:
        if phase == "before_unlink":
            raise OSError("simulated crash between tombstone and unlink")

    store = SharedFilesystemStore(tmp_path, RUN, backend=FilesystemBackend(tmp_path, fault=fault))
    ref = store.publish([Record("r", b"x" * 64)], submission_id="s1")
    store.release_publications([ref])
    store.close()
    with pytest.raises(Exception, match="simulated crash"):
        store.collect_garbage()
    (pack,) = packs(tmp_path)
    before = tree_digest(tmp_path)
    code, out, _ = run(capsys, str(tmp_path))
    assert code == 1 and "pack.tombstoned_present" in out and "straw check --fix" in out
    assert tree_digest(tmp_path) == before
    code, out, _ = run(capsys, str(tmp_path), "--fix")
    assert code == 0 and "(repaired)" in out and not pack.exists()
    assert check_pool(tmp_path).findings == []


def _partial_frame(segment: Path, seq: int) -> int:
    """Write an unacknowledged frame whose body never fully reached the disk at the journal's end
    (into the zeros written ahead, J1.1: the segment keeps its size and still ends in zeros, J7)."""
    data = segment.read_bytes()
    end = len(data.rstrip(b"\0"))  # after a crash the zeros written ahead follow the last frame
    body = b'{"op":"seal","request_id":"never-acknowledged"}'
    header, _ = journal_frame.encode_frame(seq, bytes(16), body)
    with open(segment, "r+b") as handle:
        handle.seek(end)
        handle.write(header + body[:10])
    assert segment.stat().st_size == len(data) > end + len(header) + 10 + 64
    return end


def _zeroed_from(path: Path, end: int, size: int) -> bool:
    """The file kept its size and holds only zeros from ``end`` on (a zeroed torn tail, J4.3)."""
    data = path.read_bytes()
    return len(data) == size and not data[end:].strip(b"\0")


def test_torn_journal_tail_is_cut_by_fix_and_recovery_keeps_every_completion(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    built = build_pool(tmp_path, done=3)
    commits = built.coordinator.commits
    last = built.coordinator._journal.last_seq
    crash(built.coordinator)
    segment = segments(tmp_path)[-1]
    size = segment.stat().st_size
    end = _partial_frame(segment, last + 1)
    report = check_pool(tmp_path)
    assert codes(report)["journal.torn_tail"] == "repairable" and not report.ok
    code, out, _ = run(capsys, str(tmp_path), "--fix")
    assert code == 0 and "journal.torn_tail" in out
    assert _zeroed_from(segment, end, size)
    reopened = Coordinator(built.store, exclusive_owner="check-test", recover=True)
    assert reopened.commits == commits and len(commits) == 3
    reopened.close()
    built.store.close()
    assert check_pool(tmp_path).ok


def test_fix_never_touches_the_journal_of_a_live_coordinator(tmp_path: Path) -> None:
    built = build_pool(tmp_path)
    last = built.coordinator._journal.last_seq
    crash(built.coordinator)
    _partial_frame(segments(tmp_path)[-1], last + 1)
    fd = lock.try_lock_exclusive(str(tmp_path / "queue" / "LOCK"))  # stands for a live coordinator
    assert fd is not None
    before = tree_digest(tmp_path)
    report = check_pool(tmp_path, fix=True)
    lock.unlock(fd)
    assert "journal.torn_tail" in codes(report) and report.repaired == [] and not report.ok
    assert tree_digest(tmp_path) == before
    built.store.close()


def test_flipped_byte_inside_a_journal_frame_is_an_error_fix_does_not_touch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    built = build_pool(tmp_path)
    crash(built.coordinator)
    built.store.close()
    segment = segments(tmp_path)[-1]
    flip(segment, 64 + 64 + 5)  # the body of the first frame
    before = tree_digest(tmp_path)
    code, out, _ = run(capsys, str(tmp_path), "--fix")
    assert code == 1 and "journal.corrupt_frame" in out and "does not touch" in out
    assert tree_digest(tmp_path) == before


def test_torn_catalog_tail_is_zeroed_by_fix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    close_pool(build_pool(tmp_path))
    log = tmp_path / "catalog" / "log"
    data = log.read_bytes()
    end = len(data.rstrip(b"\0"))
    with open(log, "r+b") as handle:
        handle.seek(end)
        handle.write(b"SJFR" + bytes(20) + b"\x07")  # a crashed appender's partial header, in the zeros
    report = check_pool(tmp_path)
    assert codes(report) == {"catalog.torn_tail": "repairable"}
    code, _, _ = run(capsys, str(tmp_path), "--fix")
    assert code == 0 and _zeroed_from(log, end, len(data))
    assert check_pool(tmp_path).findings == []


def test_deleted_owned_pack_is_owner_missing_pack(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    close_pool(build_pool(tmp_path))
    (pack,) = packs(tmp_path)
    pack.unlink()
    code, out, _ = run(capsys, str(tmp_path), "--json")
    found = {f["code"] for f in json.loads(out)["findings"]}
    assert code == 1 and {"owner.missing_pack", "root.unreadable", "root.missing_pack"} <= found


def test_half_deleted_pack_is_reported_clearly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    close_pool(build_pool(tmp_path))
    (pack,) = packs(tmp_path)
    with open(pack, "r+b") as handle:
        handle.truncate(0)
    code, out, err = run(capsys, str(tmp_path))
    assert code == 1 and "pack.header" in out and "is empty; its data cannot be read" in out
    assert "Traceback" not in out + err


def test_not_a_pool_exits_2_with_a_message(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "some-file").write_text("x")
    code, out, err = run(capsys, str(tmp_path))
    assert (code, out) == (2, "") and "is not a straw pool (no straw-pool.json)" in err
    code, _, err = run(capsys, str(tmp_path / "missing"))
    assert code == 2 and "is not a directory" in err
    (tmp_path / "straw-pool.json").write_text('{"format": "other"}')
    code, _, err = run(capsys, str(tmp_path))
    assert code == 2 and "is not a straw pool marker" in err and "Traceback" not in err


def test_foreign_run_id_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    close_pool(build_pool(tmp_path))
    code, _, _ = run(capsys, str(tmp_path), "--run-id", RUN)
    assert code == 0
    code, out, err = run(capsys, str(tmp_path), "--run-id", "another-run")
    assert code == 2 and "pool.foreign_run" in out and "another run than 'another-run'" in err
    assert "belongs to run 'run-check', not 'another-run'" in out


def test_help_documents_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["check", "--help"])
    out = capsys.readouterr().out
    assert "exit codes:" in out and "2  cannot check" in out and "--fix" in out


def test_console_script_runs(tmp_path: Path) -> None:
    close_pool(build_pool(tmp_path))
    script = Path(sys.executable).parent / "straw"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "straw"]
    done = subprocess.run([*command, "check", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "ok: no problems" in done.stdout
    missing = subprocess.run(
        [*command, "check", os.fspath(tmp_path / "nope")], capture_output=True, text=True, timeout=60
    )
    assert missing.returncode == 2 and "Traceback" not in missing.stderr


def test_final_frame_with_zero_body_is_a_torn_write_fix_zeroes_it(tmp_path: Path) -> None:
    built = build_pool(tmp_path, done=2)
    commits = built.coordinator.commits
    last = built.coordinator._journal.last_seq
    crash(built.coordinator)
    segment = segments(tmp_path)[-1]
    size = segment.stat().st_size
    end = len(segment.read_bytes().rstrip(b"\0"))
    body = b'{"op":"seal","request_id":"lost"}'
    header, _ = journal_frame.encode_frame(last + 1, bytes(16), body)
    with open(segment, "r+b") as handle:  # the header reached the disk, the body did not
        handle.seek(end)
        handle.write(header + bytes(len(body) + 4096))  # its body lies in zeros written ahead (J1.1)
    report = check_pool(tmp_path)
    (finding,) = [f for f in report.findings if f.code == "journal.torn_tail"]
    assert "a torn write" in finding.message and finding.severity == "repairable"
    fixed = check_pool(tmp_path, fix=True)
    assert fixed.ok and _zeroed_from(segment, end, size)
    reopened = Coordinator(built.store, exclusive_owner="check-test", recover=True)
    assert reopened.commits == commits
    reopened.close()
    built.store.close()


def test_unowned_queue_root_is_owned_again_by_fix_and_survives_collection(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    built, ref, pack = result_pool(tmp_path)
    drop_queue_ownership(built, pack)
    close_pool(built)
    before = tree_digest(tmp_path)
    code, out, _ = run(capsys, str(tmp_path))
    assert code == 1 and "root.unowned" in out and "straw check --fix" in out
    assert "result of task 't1' (accepted at position 1)" in out
    assert tree_digest(tmp_path) == before
    (finding,) = check_pool(tmp_path).findings
    assert (finding.code, finding.severity, finding.path) == ("root.unowned", "repairable", pack)
    code, out, _ = run(capsys, str(tmp_path), "--fix")
    assert code == 0 and "repairable (repaired)" in out and "1 finding(s) repaired" in out
    assert check_pool(tmp_path).findings == []
    store = SharedFilesystemStore(tmp_path, RUN)
    owner = built.coordinator._gc_owner
    assert pack in store._owned(owner)
    store.collect_garbage()
    assert (tmp_path / pack).exists()
    assert [r.payload for r in store.read(ref)] == [b"r" * 300]
    store.close()
    assert check_pool(tmp_path).ok


def test_fix_owns_a_root_beside_a_live_coordinator(tmp_path: Path) -> None:
    built, ref, pack = result_pool(tmp_path)
    drop_queue_ownership(built, pack)
    report = check_pool(tmp_path, fix=True)  # the coordinator holds its queue's lock throughout
    assert [f.code for f in report.repaired] == ["root.unowned"] and report.ok
    built.coordinator.collect_garbage()  # replaces the owner's set with exactly its roots
    assert [r.payload for r in built.store.read(ref)] == [b"r" * 300]
    assert check_pool(tmp_path).ok
    close_pool(built)


def test_tombstoned_queue_root_stays_an_error_after_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def fault(phase: str) -> None:
        if phase == "before_unlink":
            raise OSError("simulated crash between tombstone and unlink")

    built, _, pack = result_pool(tmp_path)
    drop_queue_ownership(built, pack)
    close_pool(built)
    collector = SharedFilesystemStore(tmp_path, RUN, backend=FilesystemBackend(tmp_path, fault=fault))
    with pytest.raises(Exception, match="simulated crash"):
        collector.collect_garbage()
    collector.close()
    assert (tmp_path / pack).exists()
    report = check_pool(tmp_path)
    assert codes(report) == {"pack.tombstoned_present": "repairable", "root.unowned": "error"}
    (lost,) = [f for f in report.findings if f.code == "root.unowned"]
    assert "garbage-collected" in lost.message and "lost: result of task 't1'" in lost.message
    code, out, _ = run(capsys, str(tmp_path), "--fix")
    assert code == 1 and "root.unowned" in out and "1 problem(s) remain" in out
    assert not (tmp_path / pack).exists()  # the interrupted unlink was finished
    store = SharedFilesystemStore(tmp_path, RUN)
    assert pack not in store._owned(built.coordinator._gc_owner)  # a tombstone is never retained
    store.close()
    after = check_pool(tmp_path, fix=True)
    assert codes(after) == {"root.missing_pack": "error"} and not after.ok
    assert "was garbage-collected; lost: result of task 't1'" in after.findings[0].message
