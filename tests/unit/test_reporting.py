"""``straw.reporting.write_report``: canonical JSON plus a newline, published atomically (D0).

The file must appear complete under its name (rename of a synced temporary file), replace an
existing report, leave no temporary file behind and return the absolute path it wrote.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

from straw.errors import StorageUnavailable
from straw.protocol import encode
from straw.reporting import write_report

REPORT = {"zeta": [3, 2, 1], "alpha": {"nested": "héllo ✓", "n": 1.5}, "ok": True, "none": None}


def test_writes_canonical_json_and_a_newline(tmp_path: Path) -> None:
    target = tmp_path / "report.json"
    returned = write_report(target, REPORT)
    assert returned == target
    assert isinstance(returned, Path)
    data = target.read_bytes()
    assert data == encode(REPORT) + b"\n"
    assert data == '{"alpha":{"n":1.5,"nested":"héllo ✓"},"none":null,"ok":true,"zeta":[3,2,1]}\n'.encode()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]


def test_accepts_a_string_path_and_returns_an_absolute_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    returned = write_report("relative.json", [1, 2])
    assert returned.is_absolute()
    assert returned == tmp_path / "relative.json"
    assert returned.read_bytes() == b"[1,2]\n"


def test_replaces_an_existing_report_atomically(tmp_path: Path) -> None:
    target = tmp_path / "report.json"
    target.write_bytes(b"old content that is longer than the new one " * 100)
    old_inode = target.stat().st_ino
    with target.open("rb") as reader:  # a reader of the old file keeps seeing the old file
        write_report(target, {"v": 2})
        assert reader.read(11) == b"old content"
    assert target.read_bytes() == b'{"v":2}\n'
    assert target.stat().st_ino != old_inode  # a new file was renamed over it, not rewritten in place
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]


def test_repeated_writes_leave_no_temporary_files(tmp_path: Path) -> None:
    target = tmp_path / "report.json"
    for number in range(5):
        write_report(target, {"round": number})
    assert target.read_bytes() == b'{"round":4}\n'
    assert os.listdir(tmp_path) == ["report.json"]


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_unencodable_value_raises_value_error_and_keeps_the_old_report(tmp_path: Path, bad: float) -> None:
    target = tmp_path / "report.json"
    write_report(target, {"v": 1})
    with pytest.raises(ValueError, match="NaN and Infinity are rejected"):
        write_report(target, {"v": bad})
    assert target.read_bytes() == b'{"v":1}\n'
    assert os.listdir(tmp_path) == ["report.json"]


def test_missing_directory_raises_storage_unavailable(tmp_path: Path) -> None:
    target = tmp_path / "absent" / "report.json"
    with pytest.raises(StorageUnavailable, match="writing report") as raised:
        write_report(target, {"v": 1})
    assert "No such file or directory" in str(raised.value)
    assert not (tmp_path / "absent").exists()
