"""FilesystemBackend: profiles, the JuiceFS declaration (A5), path safety, fault phases and sync counters.

API.md section 4 and docs/DURABILITY.md ("Fault phases"). Path checks must refuse everything
that could leave the pool before any I/O happens (InvalidReference).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from straw import Record, SharedFilesystemStore
from straw.backend import JUICEFS_REQUIRED, PEER_PHASES, FilesystemBackend
from straw.errors import InvalidReference

VALID_JUICEFS: dict[str, Any] = {
    "direct_mount": True,
    "writeback": False,
    "open_cache": 0,
    "readdir_cache": False,
    "client_version": "juicefs version 1.2.3+2024-01-01",
    "durability_description": "Redis metadata with AOF fsync always; object store with read-after-write",
}


# --------------------------------------------------------------------------- profiles


def test_default_profile_is_local_and_root_is_absolute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    backend = FilesystemBackend("pool")
    assert backend.profile == "local"
    assert isinstance(backend.root, Path)
    assert backend.root.is_absolute()
    assert backend.root == tmp_path / "pool"
    assert backend.diagnostics()["profile"] == "local"


def test_root_is_normalised(tmp_path: Path) -> None:
    backend = FilesystemBackend(str(tmp_path / "a" / ".." / "pool"))
    assert backend.root == tmp_path / "pool"


@pytest.mark.parametrize("profile", ["nfs", "JUICEFS", ""])
def test_unknown_profile_raises_value_error(tmp_path: Path, profile: str) -> None:
    with pytest.raises(ValueError, match=f"unknown profile {profile!r}"):
        FilesystemBackend(tmp_path, profile=profile)


def test_declaration_must_be_a_mapping(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="declaration must be a mapping"):
        FilesystemBackend(tmp_path, profile="juicefs", declaration=[("direct_mount", True)])  # type: ignore[arg-type]


def test_juicefs_requires_a_declaration(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="missing 'direct_mount'"):
        FilesystemBackend(tmp_path, profile="juicefs")


@pytest.mark.parametrize("key", sorted(VALID_JUICEFS))
def test_a5_juicefs_declaration_missing_key_is_named(tmp_path: Path, key: str) -> None:
    declaration = {k: v for k, v in VALID_JUICEFS.items() if k != key}
    with pytest.raises(ValueError, match=repr(key)):
        FilesystemBackend(tmp_path, profile="juicefs", declaration=declaration)


WRONG_VALUES = [
    ("direct_mount", False),
    ("direct_mount", 1),
    ("direct_mount", "true"),
    ("writeback", True),
    ("writeback", 0),
    ("writeback", None),
    ("open_cache", 1),
    ("open_cache", False),
    ("open_cache", 0.0),
    ("open_cache", "0"),
    ("readdir_cache", True),
    ("readdir_cache", 0),
    ("client_version", ""),
    ("client_version", "   "),
    ("client_version", 1.2),
    ("durability_description", ""),
    ("durability_description", None),
    ("durability_description", ["fsync"]),
]


@pytest.mark.parametrize(("key", "value"), WRONG_VALUES)
def test_a5_juicefs_declaration_wrong_value_is_named(tmp_path: Path, key: str, value: object) -> None:
    declaration = {**VALID_JUICEFS, key: value}
    with pytest.raises(ValueError, match=key) as raised:
        FilesystemBackend(tmp_path, profile="juicefs", declaration=declaration)
    if key in JUICEFS_REQUIRED:
        assert f"{key}={JUICEFS_REQUIRED[key]!r}" in str(raised.value)


def test_a5_valid_juicefs_declaration_is_recorded_not_verified(tmp_path: Path) -> None:
    declaration = {**VALID_JUICEFS, "extra_note": "two clients, one volume"}
    backend = FilesystemBackend(tmp_path, profile="juicefs", declaration=declaration)
    info = backend.diagnostics()
    assert info["profile"] == "juicefs"
    assert info["declaration"] == declaration
    assert info["declaration_verified"] is False
    assert info["root"] == str(tmp_path)
    # The recorded copy is the backend's own: changing the caller's dict does not change it.
    declaration["client_version"] = "changed"
    assert backend.diagnostics()["declaration"]["client_version"] == VALID_JUICEFS["client_version"]


def test_diagnostics_report_the_visibility_bound(tmp_path: Path) -> None:
    backend = FilesystemBackend(tmp_path, visibility_delays=(0.5, 0.25))
    assert backend.diagnostics()["visibility_retry_seconds"] == 0.75


# --------------------------------------------------------------------------- path safety


@pytest.mark.parametrize(
    "relative",
    [
        "/etc/passwd",
        "/",
        "..",
        "../outside",
        "raw/../../outside",
        "raw/..",
        ".",
        "./raw",
        "raw/./x.pack",
        "",
        "raw//x.pack",
        "raw/",
        "/raw/x.pack",
        "raw\\x.pack",
        "..\\outside",
        "raw/x\x00.pack",
    ],
    ids=repr,
)
def test_path_refuses_unsafe_relative_paths(tmp_path: Path, relative: str) -> None:
    backend = FilesystemBackend(tmp_path)
    with pytest.raises(InvalidReference, match="unsafe path"):
        backend.path(relative)
    with pytest.raises(InvalidReference, match="unsafe path"):
        backend.resolve(relative)


@pytest.mark.parametrize("relative", [None, b"raw/x.pack", 3])
def test_path_refuses_non_strings(tmp_path: Path, relative: object) -> None:
    with pytest.raises(InvalidReference, match="path must be a string"):
        FilesystemBackend(tmp_path).path(relative)  # type: ignore[arg-type]


def test_path_maps_a_safe_path_inside_the_root(tmp_path: Path) -> None:
    backend = FilesystemBackend(tmp_path)
    assert backend.path("raw/w/s.pack") == tmp_path / "raw" / "w" / "s.pack"
    assert backend.resolve("raw/w/s.pack") == str(tmp_path / "raw" / "w" / "s.pack")
    # Names that merely contain dots are not '..' components.
    assert backend.path("raw/..x/.hidden..pack") == tmp_path / "raw" / "..x" / ".hidden..pack"


def test_path_refuses_a_symlink_leading_outside_the_pool(tmp_path: Path) -> None:
    pool = tmp_path / "pool"
    outside = tmp_path / "outside"
    (pool / "raw").mkdir(parents=True)
    outside.mkdir()
    (outside / "secret.pack").write_bytes(b"not yours")
    (pool / "raw" / "escape").symlink_to(outside, target_is_directory=True)
    (pool / "raw" / "file-link.pack").symlink_to(outside / "secret.pack")
    backend = FilesystemBackend(pool)
    with pytest.raises(InvalidReference, match="symlink leads outside the pool"):
        backend.path("raw/escape/secret.pack")
    with pytest.raises(InvalidReference, match="symlink leads outside the pool"):
        backend.path("raw/file-link.pack")


def test_path_refuses_a_symlink_to_a_sibling_sharing_the_root_prefix(tmp_path: Path) -> None:
    pool = tmp_path / "pool"
    sibling = tmp_path / "pool-other"
    pool.mkdir()
    sibling.mkdir()
    (pool / "link").symlink_to(sibling, target_is_directory=True)
    with pytest.raises(InvalidReference, match="symlink leads outside the pool"):
        FilesystemBackend(pool).path("link/x.pack")


def test_path_refuses_a_dangling_symlink_pointing_outside(tmp_path: Path) -> None:
    pool = tmp_path / "pool"
    pool.mkdir()
    (pool / "dangling").symlink_to(tmp_path / "does-not-exist")
    with pytest.raises(InvalidReference, match="symlink leads outside the pool"):
        FilesystemBackend(pool).path("dangling")


def test_path_accepts_a_symlink_that_stays_inside_the_pool(tmp_path: Path) -> None:
    pool = tmp_path / "pool"
    (pool / "raw" / "real").mkdir(parents=True)
    (pool / "raw" / "real" / "x.pack").write_bytes(b"ok")
    (pool / "raw" / "alias").symlink_to(pool / "raw" / "real", target_is_directory=True)
    (pool / "relative-alias").symlink_to("raw/real", target_is_directory=True)
    backend = FilesystemBackend(pool)
    assert backend.path("raw/alias/x.pack").read_bytes() == b"ok"
    assert backend.path("relative-alias/x.pack").read_bytes() == b"ok"


def test_path_works_when_the_root_itself_is_reached_through_a_symlink(tmp_path: Path) -> None:
    real = tmp_path / "real-pool"
    (real / "raw").mkdir(parents=True)
    (real / "raw" / "x.pack").write_bytes(b"data")
    (tmp_path / "pool-link").symlink_to(real, target_is_directory=True)
    backend = FilesystemBackend(tmp_path / "pool-link")
    assert backend.path("raw/x.pack").read_bytes() == b"data"


# --------------------------------------------------------------------------- fault hook


def test_fault_calls_the_hook_with_the_phase_name(tmp_path: Path) -> None:
    phases: list[str] = []
    backend = FilesystemBackend(tmp_path, fault=phases.append)
    backend.fault("before_publish")
    backend.fault("anything")
    assert phases == ["before_publish", "anything"]
    FilesystemBackend(tmp_path).fault("before_publish")  # no hook: a no-op


NEW_PACK = [
    "before_publish",
    "before_data_write",
    "after_data_write",
    "after_data_sync",
    "before_dir_sync",
    "after_dir_sync",
    "after_publish",
]
APPEND = ["before_publish", "before_data_write", "after_data_write", "after_data_sync", "after_publish"]
SEAL = ["before_seal_write", "after_seal_sync"]


class OwnPhases(list[str]):
    """A hook recording straw's own phase names (the peer's aliases are tested below)."""

    def __call__(self, phase: str) -> None:
        if phase not in PEER_PHASES:
            self.append(phase)


def test_fault_hook_receives_the_documented_phases_of_every_store_operation(tmp_path: Path) -> None:
    phases = OwnPhases()
    backend = FilesystemBackend(tmp_path, fault=phases)
    store = SharedFilesystemStore(tmp_path, "run", backend=backend, segment_target_bytes=4096)
    assert phases == []  # opening the pool is not a durable write of records

    store.publish([Record("a", b"x" * 100)], submission_id="s1")
    assert phases == NEW_PACK
    phases.clear()

    store.publish([Record("b", b"x" * 100)], submission_id="s2")
    assert phases == APPEND
    phases.clear()

    store.publish([Record("c", b"x" * 5000)], submission_id="s3")  # crosses 4 KiB: rotate
    assert phases == ["before_publish", "before_rotate", *SEAL, *NEW_PACK[1:]]
    phases.clear()

    store.publish([Record("c", b"x" * 5000)], submission_id="s3")  # idempotent retry: no durable write
    assert phases == []

    store.close()
    assert phases == SEAL


def test_fault_hook_phases_of_a_standalone_file(tmp_path: Path) -> None:
    phases = OwnPhases()
    backend = FilesystemBackend(tmp_path, fault=phases)
    with SharedFilesystemStore(tmp_path, "run", backend=backend, segment_target_bytes=0) as store:
        store.publish([Record("a", b"x")], submission_id="s1")
        store.publish([Record("b", b"x")], submission_id="s2")
    assert phases == NEW_PACK + NEW_PACK  # nothing to seal on close: each file carries its seal


def test_the_peer_phase_names_are_heard_at_the_equivalent_points(tmp_path: Path) -> None:
    phases: list[str] = []
    backend = FilesystemBackend(tmp_path)
    store = SharedFilesystemStore(tmp_path, "run", backend=backend, segment_target_bytes=1 << 20)
    backend.fault = phases.append  # assigned as the peer's tests do
    store.publish([Record("a", b"x" * (256 * 1024 + 1))], submission_id="s1")  # two payload chunks
    written = ["before_data_write", "after_segment_header"]
    written += ["after_data_write", "after_record", "before_footer"]
    chunks = ["after_payload_chunk"] * 2
    dirs = ["before_directory_sync"] * 2  # the writer's first file: raw/ and its LIVE lock (D2.1)
    syncs = ["before_file_sync", "after_data_sync", "before_dir_sync", "before_directory_sync"]
    assert phases == ["before_publish", *dirs, *written, *chunks, *syncs, "after_dir_sync", "after_publish"]
    phases.clear()
    store.publish([Record("b", b"")], submission_id="s2")  # an append of an empty payload: no chunk
    assert phases == ["before_publish", *written, "before_file_sync", "after_data_sync", "after_publish"]
    backend.fault = None
    store.publish([Record("c", b"c")], submission_id="s3")
    assert len(phases) == 9  # no hook: nothing more heard
    store.close()


# --------------------------------------------------------------------------- metrics


def test_metrics_count_file_and_directory_syncs(tmp_path: Path) -> None:
    backend = FilesystemBackend(tmp_path)
    assert backend.metrics == {"syncs": 0, "file_syncs": 0, "dir_syncs": 0, "files_created": 0}
    path = tmp_path / "f"
    path.write_bytes(b"x")
    fd = os.open(path, os.O_RDONLY)
    try:
        backend.sync_file(fd)
        backend.sync_file(fd)
    finally:
        os.close(fd)
    backend.sync_dir(tmp_path)
    assert backend.metrics == {"syncs": 3, "file_syncs": 2, "dir_syncs": 1, "files_created": 0}


def test_metrics_count_the_syncs_of_store_writes(tmp_path: Path) -> None:
    backend = FilesystemBackend(tmp_path)
    store = SharedFilesystemStore(tmp_path, "run", backend=backend)
    before = dict(backend.metrics)
    store.publish([Record("a", b"x")], submission_id="s1")
    first = dict(backend.metrics)
    # D2: the new pack is synced, and its directory (plus raw/ for the new writer directory).
    assert first["file_syncs"] - before["file_syncs"] == 1
    assert first["dir_syncs"] - before["dir_syncs"] >= 1
    assert first["files_created"] - before["files_created"] == 1
    assert first["syncs"] - before["syncs"] == (first["file_syncs"] - before["file_syncs"]) + (
        first["dir_syncs"] - before["dir_syncs"]
    )
    for number in range(5):  # D1: an append costs exactly one file sync, no directory sync
        store.publish([Record("b", b"y")], submission_id=f"append-{number}")
    after = dict(backend.metrics)
    assert after["syncs"] - first["syncs"] == 5
    assert after["file_syncs"] - first["file_syncs"] == 5
    assert after["dir_syncs"] == first["dir_syncs"]
    assert after["files_created"] == first["files_created"]
    assert store.metrics["syncs"] == after["syncs"]
    store.close()
