"""Issue 11, defect 6: ``straw check`` said "ok" over damage that owners reach.

* A dead writer's unsealed pack truncated to its header while an owner retained extents in
  it: the pack scan found a header and nothing after it (a legal empty tail) and the owner
  check only asked whether the file exists. An owner reaches a pack only through a reference
  to a complete extent, so an owned pack without one lost the owner's data:
  ``owner.lost_extents`` (error).
* A pack replaced by a symbolic link that leaves the pool: every read refuses it (D5.1), and
  check read through the link as if nothing were wrong. straw never writes links:
  ``pack.symlink`` (error), and garbage collection never touches the link's target.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from straw._inspect.check import check_pool
from straw._pack import frame
from straw.errors import InvalidReference
from straw.protocol import Record, RecordSetRef
from straw.store import SharedFilesystemStore

RUN = "run-owned-damage"

# A writer process that publishes, retains and ends staging, then dies without sealing.
DIE_UNSEALED = """
import os, sys, json
from straw.store import SharedFilesystemStore
from straw.protocol import Record, as_dict
store = SharedFilesystemStore(sys.argv[1], sys.argv[2], online_gc=True)
ref = store.publish([Record("kept", b"k" * 300)], submission_id="kept")
store.retain("keeper", [ref])
store.release_publications([ref])
print(json.dumps(as_dict(ref)), flush=True)
os._exit(0)
"""


def test_an_owned_unsealed_pack_of_a_dead_writer_cut_to_its_header_is_an_error(tmp_path: Path) -> None:
    root = tmp_path / "pool"
    done = subprocess.run(
        [sys.executable, "-c", DIE_UNSEALED, str(root), RUN],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    ref = RecordSetRef.from_dict(__import__("json").loads(done.stdout))
    pack = root / ref.manifest.segment.path
    assert check_pool(root).ok  # a dead writer's unsealed pack is only a note
    with open(pack, "r+b") as handle:
        handle.truncate(frame.PACK_HEADER_BYTES)
    report = check_pool(root)
    found = {(f.code, f.severity) for f in report.findings}
    assert ("owner.lost_extents", "error") in found and not report.ok, report.findings
    with SharedFilesystemStore(root, RUN) as store:
        store.collect_garbage()  # seals the dead writer's pack in the catalog; keeps it (owned)
        assert pack.exists()
    assert not check_pool(root).ok


def test_a_pack_replaced_by_a_link_out_of_the_pool_is_an_error(tmp_path: Path) -> None:
    root = tmp_path / "pool"
    with SharedFilesystemStore(root, RUN) as store:
        ref = store.publish([Record("linked", b"l" * 300)], submission_id="linked")
        store.retain("keeper", [ref])
    pack = root / ref.manifest.segment.path
    outside = tmp_path / "elsewhere.pack"
    os.replace(pack, outside)
    os.symlink(outside, pack)
    report = check_pool(root)
    found = {(f.code, f.severity) for f in report.findings}
    assert ("pack.symlink", "error") in found and not report.ok
    assert any("outside the pool" in f.message for f in report.findings)
    with SharedFilesystemStore(root, RUN) as store:
        with pytest.raises(InvalidReference, match="symlink"):
            list(store.read(ref))
        store.release("keeper")
        store.collect_garbage()
    assert outside.read_bytes().startswith(frame.PACK_MAGIC)  # never followed by a collection
