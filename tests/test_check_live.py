"""Issue 11, defect 5: ``straw check`` beside a live pool reports no false errors, round after round.

Writers (online GC), a coordinator with workers and a consumer whose progress lets GC reclaim
accepted results, and a collector run as separate processes (tests/live_check_roles.py) while
this test runs ``straw check`` on the pool again and again. Before the fix most rounds reported
``owner.missing_pack`` or ``pack.unreadable``: check listed ``raw/`` before it read the catalog
and met packs a collector had unlinked meanwhile. Now it reads journals, then ownership, then
the listing, treats a pack collected while scanned as gone, and reports only what a second,
fresh pass finds again (docs/CHECK.md). Every round must exit 0; the roles must have kept
working (and collecting) through the rounds; a final check after they stop is clean too.
Bounded: ``ROUNDS`` checks, each child stopped afterwards and waited for with a timeout.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import child_io
import live_check_roles as roles
from straw._inspect.check import check_pool
from straw.cli import main

ROLES = Path(roles.__file__).resolve()
ROUNDS = 6
STOP_TIMEOUT_S = 90.0


def _start(role: str, root: Path, seed: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(ROLES), role, str(root), str(seed)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.timeout(600)
def test_check_exits_0_on_a_pool_under_live_load_in_every_round(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "pool"
    # The queue first (its coordinator creates the pool and the queue), then the others.
    queue = _start("queue", root, 1)
    with child_io.children(queue):
        assert child_io.read_line(queue, "queue") == "ready\n"
        others = [_start(role, root, n) for n, role in enumerate(("writer", "writer", "collector"), 2)]
        children = [queue, *others]
        with child_io.children(*others):
            for child in others:
                assert child_io.read_line(child) == "ready\n"
            finals = _rounds(root, children, capsys)
    counts = {final["role"] + str(i): final for i, final in enumerate(finals)}
    done = counts["queue0"]
    assert done["completed"] >= 6 and done["collections"] >= 2 and done["errors"] == 0
    assert all(c["published"] > 10 and c["released"] > 0 for k, c in counts.items() if k.startswith("writer"))
    assert sum(c.get("reclaimed", 0) for c in counts.values()) > 0, "nothing was collected meanwhile"
    report = check_pool(root)
    assert report.ok, report.remaining()


def _rounds(
    root: Path, children: list[subprocess.Popen[str]], capsys: pytest.CaptureFixture[str]
) -> list[dict[str, object]]:
    """ROUNDS checks while the children work, then stop them; their final counts."""
    for round_ in range(ROUNDS):
        if round_ % 2:
            report = check_pool(root)
            assert report.ok, (round_, report.remaining())
        else:
            code = main(["check", str(root)])
            out, err = capsys.readouterr()
            assert (code, err) == (0, ""), (round_, out)
    for child in children:
        child_io.send(child, "stop\n")
    finals = [json.loads(child_io.read_line(child)) for child in children]
    for child in children:
        assert child.wait(STOP_TIMEOUT_S) == 0
        assert child.stderr is not None and child.stderr.read() == ""
    return finals
