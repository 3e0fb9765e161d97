"""straw.tensor: tensor.v1 records, lazy verified loads, row slices, sharing (API.md section 6).

docs/FORMAT.md section 10 defines the record; docs/DURABILITY.md I6 (verified reads) is what
the corruption tests check. Every round trip compares exact bytes, dtypes and shapes; the
zero-copy tests spy on the vectored system calls and check which memory they touched.
"""

from __future__ import annotations

import dataclasses
import gc
import mmap
import os
import pickle
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import queue_helpers as qh
from straw import Record, SharedFilesystemStore, protocol
from straw import tensor as tensor_module
from straw._fs import system
from straw._pack.reader import read_buffer
from straw.backend import FilesystemBackend
from straw.errors import CorruptData, InvalidReference, StorageUnavailable, UnsupportedSchema
from straw.limits import CHUNK_BYTES, READ_MAPPING_BYTES_MIN, MiB
from straw.tensor import TENSOR_CODEC, TensorRef, attach, detach, publish_tensors, tensor_bytes

RUN = "run-tensor-tests"
CODECS = ("bytes.v1", "json.v1", TENSOR_CODEC)
KiB = 1024

NUMPY_DTYPES = ["uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64", "bool"]
TORCH_DTYPES = [*NUMPY_DTYPES, "bfloat16"]


# --------------------------------------------------------------------------- helpers


@pytest.fixture(autouse=True)
def fresh_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test sees only the pools it attaches (the registry is per process)."""
    monkeypatch.setattr(tensor_module, "_pools", {})
    monkeypatch.setattr(tensor_module, "_writers", {})
    monkeypatch.setattr(tensor_module, "_kept", set())
    monkeypatch.setattr(tensor_module, "_env_seen", [None])
    monkeypatch.delenv(tensor_module.POOL_ROOTS_ENV, raising=False)


@pytest.fixture
def sleeps() -> list[float]:
    return []


@pytest.fixture
def store(tmp_path: Path, sleeps: list[float]) -> Iterator[SharedFilesystemStore]:
    backend = FilesystemBackend(tmp_path, sleep=sleeps.append)
    with SharedFilesystemStore(tmp_path, RUN, backend=backend, codecs=CODECS) as opened:
        yield opened


def numpy_value(dtype: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray[Any, Any]:
    rng = np.random.default_rng(seed)
    if dtype == "bool":
        return rng.integers(0, 2, size=shape).astype(bool)
    if dtype.startswith("float"):
        return rng.standard_normal(shape).astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)


def torch_value(dtype: str, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    if dtype == "bfloat16":
        return torch.from_numpy(numpy_value("float32", shape, seed)).to(torch.bfloat16)
    return torch.from_numpy(numpy_value(dtype, shape, seed))


def raw(value: torch.Tensor) -> bytes:
    """The little-endian bytes of a CPU tensor."""
    if value.dtype == torch.bfloat16:
        value = value.view(torch.int16)
    return value.contiguous().numpy().tobytes()


def written(root: Path) -> list[Path]:
    """Pack files, standalone files and files being created (what a write leaves)."""
    return sorted(
        p for pattern in ("raw/*/*.pack", "raw/*/*.seg", "raw/*/.*.tmp") for p in root.glob(pattern)
    )


def payload_offset(store: SharedFilesystemStore, ref: TensorRef) -> tuple[Path, int]:
    with store.read_session() as session:
        entry = session.locate(ref.record_ref).entry
    return store.backend.path(ref.record_ref.segment.path), entry.offset


def flip_byte(path: Path, position: int) -> None:
    with open(path, "r+b") as handle:
        handle.seek(position)
        byte = handle.read(1)
        handle.seek(position)
        handle.write(bytes([byte[0] ^ 0xFF]))


def preadv_spy(monkeypatch: pytest.MonkeyPatch) -> list[tuple[list[memoryview], int]]:
    calls: list[tuple[list[memoryview], int]] = []
    real = os.preadv

    def spy(fd: int, buffers: list[Any], offset: int) -> int:
        calls.append(([memoryview(b) for b in buffers], offset))
        return real(fd, buffers, offset)

    monkeypatch.setattr(system.current, "preadv", spy)
    return calls


def shares(buffer: memoryview, value: torch.Tensor | np.ndarray[Any, Any]) -> bool:
    array = value if isinstance(value, np.ndarray) else value.view(torch.uint8).numpy()
    return bool(np.shares_memory(np.frombuffer(buffer, dtype=np.uint8), array))


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("dtype", TORCH_DTYPES)
@pytest.mark.parametrize("shape", [(5, 3, 2), (7,), (), (0, 4)], ids=["3d", "1d", "scalar", "empty"])
def test_torch_tensors_round_trip_exactly(
    store: SharedFilesystemStore, dtype: str, shape: tuple[int, ...]
) -> None:
    value = torch_value(dtype, shape)
    (ref,) = publish_tensors(store, {"x": value}, submission_id=f"{dtype}-{shape}")
    assert (ref.dtype, ref.shape, ref.nbytes, ref.kind) == (
        dtype,
        shape,
        value.numel() * value.element_size(),
        "x",
    )
    loaded = ref.load()
    assert loaded.dtype == value.dtype and tuple(loaded.shape) == shape
    assert raw(loaded) == raw(value)
    if dtype != "bfloat16":
        array = ref.numpy()
        assert array.dtype == np.dtype(dtype) and array.shape == shape
        assert array.tobytes() == raw(value)


@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
def test_numpy_arrays_round_trip_exactly(store: SharedFilesystemStore, dtype: str) -> None:
    value = numpy_value(dtype, (4, 6), seed=1)
    (ref,) = publish_tensors(store, {"a": value}, submission_id=dtype)
    assert ref.load().numpy().tobytes() == value.tobytes()
    assert ref.numpy().tobytes() == value.tobytes()
    assert ref.numpy().dtype == value.dtype


def test_record_holds_raw_little_endian_bytes_and_the_documented_metadata(
    store: SharedFilesystemStore,
) -> None:
    value = torch.arange(6, dtype=torch.int32).reshape(2, 3)
    refs = publish_tensors(
        store, {"routes": value, "ids": np.array([1, 2], dtype=np.int64)}, submission_id="m"
    )
    record = store.read_record(refs[0].record_ref)
    assert record.codec == "tensor.v1"
    assert record.record_id == "routes"
    assert record.metadata == {"tensor": {"dtype": "int32", "shape": [2, 3], "kind": "routes"}}
    assert bytes(record.payload) == b"".join(i.to_bytes(4, "little") for i in range(6))
    assert [r.kind for r in refs] == ["routes", "ids"]
    assert [r.ordinal for r in refs] == [0, 1]
    assert refs[0].record_set == refs[1].record_set
    assert store.manifest(refs[0].record_set)["records"] == [dataclasses.asdict(r.record_ref) for r in refs]


def test_non_contiguous_and_big_endian_inputs_are_stored_little_endian(store: SharedFilesystemStore) -> None:
    base = torch.arange(24, dtype=torch.int16).reshape(4, 6)
    big = np.arange(5, dtype=">i4")
    transposed, strided = base.t(), np.arange(20, dtype=np.float32)[::3]
    refs = publish_tensors(store, {"t": transposed, "s": strided, "b": big}, submission_id="layouts")
    assert torch.equal(refs[0].load(), transposed)
    assert refs[1].numpy().tobytes() == np.ascontiguousarray(strided).tobytes()
    assert bytes(store.read_record(refs[2].record_ref).payload) == np.arange(5, dtype="<i4").tobytes()
    assert refs[2].numpy().tolist() == [0, 1, 2, 3, 4]


def test_a_tensor_that_requires_grad_is_stored_detached(store: SharedFilesystemStore) -> None:
    value = torch.ones(3, requires_grad=True)
    (ref,) = publish_tensors(store, {"w": value}, submission_id="grad")
    loaded = ref.load()
    assert torch.equal(loaded, value.detach()) and not loaded.requires_grad


@pytest.mark.parametrize(
    "value",
    [
        np.zeros(3, dtype=np.uint16),
        np.zeros(3, dtype=np.complex64),
        np.array(["a"], dtype=object),
        torch.zeros(3, dtype=torch.complex64),
        torch.zeros(3, dtype=torch.uint16),
        [1, 2, 3],
    ],
    ids=["np-uint16", "np-complex", "np-object", "torch-complex", "torch-uint16", "list"],
)
def test_unsupported_dtypes_raise_before_anything_is_written(
    store: SharedFilesystemStore, tmp_path: Path, value: Any
) -> None:
    with pytest.raises(UnsupportedSchema, match=r"not supported|expected a NumPy array"):
        publish_tensors(store, {"ok": np.zeros(2), "bad": value}, submission_id="bad")
    assert written(tmp_path) == []


def test_publish_requires_the_tensor_codec(tmp_path: Path) -> None:
    with SharedFilesystemStore(tmp_path, RUN) as plain, pytest.raises(UnsupportedSchema, match=r"tensor\.v1"):
        publish_tensors(plain, {"x": np.zeros(2)}, submission_id="no-codec")
    assert written(tmp_path) == []


def test_publish_is_one_publication_in_mapping_order_and_idempotent(store: SharedFilesystemStore) -> None:
    tensors = {name: torch.full((2,), i) for i, name in enumerate(["c", "a", "b"])}
    first = publish_tensors(store, tensors, submission_id="order")
    writes = store.metrics["writes"]
    again = publish_tensors(store, tensors, submission_id="order")
    assert store.metrics["writes"] == writes
    assert first == again
    assert [r.kind for r in first] == ["c", "a", "b"]
    assert first[0].record_set is not None and first[0].record_set.records == 3
    assert [int(r.load()[0]) for r in first] == [0, 1, 2]


def test_extra_metadata_reaches_every_record_and_validate_sees_it(store: SharedFilesystemStore) -> None:
    refs = publish_tensors(
        store,
        {"x": np.zeros(1), "y": np.ones(1)},
        submission_id="owned",
        metadata={"task_id": "t", "attempt_id": "a"},
    )
    assert refs[0].record_set is not None
    assert len(store.validate(refs[0].record_set, task_id="t", attempt_id="a")) == 2
    with pytest.raises(ValueError, match="reserved"):
        publish_tensors(store, {"x": np.zeros(1)}, submission_id="r", metadata={"tensor": 1})


# --------------------------------------------------------------------------- zero copy


def test_d1_publish_writes_from_the_tensors_own_memory(
    store: SharedFilesystemStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    store.publish([Record("warm", b"w")], submission_id="warm")
    calls: list[memoryview] = []
    real = os.pwritev

    def spy(fd: int, buffers: list[Any], offset: int) -> int:
        calls.extend(memoryview(b) for b in buffers)
        return real(fd, buffers, offset)

    monkeypatch.setattr(system.current, "pwritev", spy)
    routes = torch_value("int32", (1024, 48, 8))
    logprobs = numpy_value("float32", (1024, 128))
    bf = torch_value("bfloat16", (64, 64))
    publish_tensors(store, {"routes": routes, "logprobs": logprobs, "bf": bf}, submission_id="zero-copy")
    for value in (routes, logprobs, bf):
        sharing = [b for b in calls if shares(b, value)]
        nbytes = value.nbytes if isinstance(value, np.ndarray) else value.numel() * value.element_size()
        assert len(sharing) == 1 and sharing[0].nbytes == nbytes


def test_load_reads_once_straight_into_the_new_tensor(
    store: SharedFilesystemStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    value = torch_value("float32", (512, 1024))  # 2 MiB: eight chunks
    (ref,) = publish_tensors(store, {"v": value}, submission_id="load")
    ref.load()  # the index is cached from here on
    calls = preadv_spy(monkeypatch)
    loaded = ref.load()
    assert len(calls) == 1
    (target,), _ = calls[0]
    assert target.nbytes == ref.nbytes and shares(target, loaded)
    assert torch.equal(loaded, value)


def test_a_64_row_slice_reads_at_most_two_chunks(
    store: SharedFilesystemStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    value = torch_value("int32", (8192, 48, 8))
    (ref,) = publish_tensors(store, {"routes": value}, submission_id="slice")
    ref[0:1]
    calls = preadv_spy(monkeypatch)
    for start in (0, 100, 170, 8128):
        calls.clear()
        part = ref[start : start + 64]
        assert torch.equal(part, value[start : start + 64])
        read = sum(b.nbytes for buffers, _ in calls for b in buffers)
        assert 64 * 48 * 8 * 4 <= read <= 2 * CHUNK_BYTES


@pytest.mark.parametrize("nbytes", [0, 1, READ_MAPPING_BYTES_MIN - 1, READ_MAPPING_BYTES_MIN, 9 * MiB + 3])
def test_read_buffers_are_writable_memory_of_exactly_the_size_asked(nbytes: int) -> None:
    buffer = read_buffer(nbytes)
    assert buffer.nbytes == nbytes and not buffer.readonly and buffer.format == "B"
    mapped = isinstance(buffer.obj, mmap.mmap)
    assert mapped == (nbytes >= READ_MAPPING_BYTES_MIN)  # large ones are a private mapping of their own
    if nbytes:
        buffer[0] = buffer[nbytes - 1] = 0xA5
        assert buffer[0] == buffer[nbytes - 1] == 0xA5


def test_numpy_reads_a_small_tensor_straight_into_the_array_it_returns(
    store: SharedFilesystemStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    value = numpy_value("int32", (64, 48, 8))  # 96 KiB: below READ_MAPPING_BYTES_MIN
    (ref,) = publish_tensors(store, {"routes": value}, submission_id="numpy-small")
    ref.numpy()  # the index is cached from here on
    calls = preadv_spy(monkeypatch)
    loaded = ref.numpy()
    assert len(calls) == 1
    (target,), _ = calls[0]
    assert target.nbytes == ref.nbytes and shares(target, loaded)
    assert loaded.dtype == np.int32 and loaded.shape == (64, 48, 8) and np.array_equal(loaded, value)
    loaded[0, 0, 0] = -7  # a writable array of its own: the next read is unaffected
    assert np.array_equal(ref.numpy(), value)


def mapped_file(array: np.ndarray[Any, Any]) -> str | None:
    """The file whose pages hold the array's first byte, from this process's memory map."""
    address = array.__array_interface__["data"][0]
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            low, high = (int(x, 16) for x in fields[0].split("-"))
            if low <= address < high:
                return fields[5].strip() if len(fields) == 6 and fields[5].startswith("/") else None
    return None


def test_a_large_tensor_shares_the_packs_pages_copy_on_write(
    store: SharedFilesystemStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """D5.6a: no copy and no read call; writes to the result stay this process's own."""
    value = numpy_value("int32", (8192, 48, 8))  # 12 MiB
    (ref,) = publish_tensors(store, {"routes": value}, submission_id="numpy-large")
    ref.numpy()  # the index is cached from here on
    calls = preadv_spy(monkeypatch)
    as_numpy, as_torch, rows = ref.numpy(), ref.load(), ref[1000:7000]
    assert calls == []
    path, offset = payload_offset(store, ref)
    for array in (as_numpy, as_torch.numpy(), rows.numpy()):
        assert mapped_file(array) == str(path) and array.flags.writeable
    assert np.array_equal(as_numpy, value) and np.array_equal(rows.numpy(), value[1000:7000])
    assert as_torch.dtype == torch.int32 and torch.equal(as_torch, torch.from_numpy(value))
    as_numpy[:] = -7
    as_torch.fill_(5)
    rows.zero_()
    with open(path, "rb") as handle:
        handle.seek(offset)
        assert handle.read(ref.nbytes) == value.tobytes()
    assert np.array_equal(ref.numpy(), value)


def test_a_large_bfloat16_tensor_loads_mapped(store: SharedFilesystemStore) -> None:
    value = torch_value("bfloat16", (4096, 1024))  # 8 MiB
    (ref,) = publish_tensors(store, {"v": value}, submission_id="bf16-large")
    loaded = ref.load()
    assert loaded.dtype == torch.bfloat16 and torch.equal(loaded, value)
    assert torch.equal(ref[100:200], value[100:200])


def test_a_mapped_tensor_outlives_its_packs_deletion(store: SharedFilesystemStore) -> None:
    """A collection unlinks whole packs; an array made before keeps its verified bytes."""
    value = numpy_value("float32", (2048, 1024), seed=3)  # 8 MiB
    (ref,) = publish_tensors(store, {"v": value}, submission_id="outlives")
    loaded = ref.numpy()
    store.close()
    store.backend.path(ref.record_ref.segment.path).unlink()
    gc.collect()
    assert np.array_equal(loaded, value)


def test_a_refused_mapping_reads_into_fresh_memory(
    store: SharedFilesystemStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(fd: int, offset: int, size: int) -> memoryview:
        raise OSError(19, "No such device")  # a filesystem without mmap

    value = numpy_value("int64", (1024, 1024))  # 8 MiB
    (ref,) = publish_tensors(store, {"v": value}, submission_id="refused")
    monkeypatch.setattr(system.current, "map_private", refuse)
    calls = preadv_spy(monkeypatch)
    loaded = ref.numpy()
    assert np.array_equal(loaded, value) and len(calls) == 1 and shares(calls[0][0][0], loaded)


def test_a_large_tensor_of_a_cut_pack_is_a_clear_error_not_a_fault(store: SharedFilesystemStore) -> None:
    """A file shorter than its reference is never mapped (touching past its end would SIGBUS)."""
    value = numpy_value("int32", (8192, 48, 8))
    (ref,) = publish_tensors(store, {"routes": value}, submission_id="cut")
    ref[0:1]  # the index (after the payload, so cut off below) is cached from here on
    path, offset = payload_offset(store, ref)
    os.truncate(path, offset + ref.nbytes // 2)
    with pytest.raises(CorruptData, match="truncated"):
        ref.numpy()
    with pytest.raises(CorruptData, match="truncated"):
        ref.load()
    with pytest.raises(CorruptData, match="truncated"):
        ref[8000:8192]
    assert torch.equal(ref[0:100], torch.from_numpy(value[0:100]))  # the chunks still there read


def test_damage_to_a_pack_after_a_large_read_is_caught_by_the_next_read(
    store: SharedFilesystemStore,
) -> None:
    value = numpy_value("int32", (8192, 48, 8))  # 12 MiB: every read below is mapped
    (ref,) = publish_tensors(store, {"routes": value}, submission_id="private")
    ref.numpy()
    path, offset = payload_offset(store, ref)
    with open(path, "r+b") as handle:  # overwrite the whole payload in place, from outside straw
        handle.seek(offset)
        handle.write(bytes(ref.nbytes))
    with pytest.raises(CorruptData, match="payload checksum"):
        ref.numpy()
    with pytest.raises(CorruptData, match="payload checksum"):
        ref.load()
    with pytest.raises(CorruptData, match="payload checksum"):
        ref[0:6000]


@pytest.mark.parametrize(
    "rows",
    [
        slice(3, 9),
        slice(-4, None),
        slice(None, -95),
        slice(90, 200),
        slice(-500, 2),
        slice(7, 3),
        slice(None),
    ],
)
def test_row_slices_follow_python_slicing(store: SharedFilesystemStore, rows: slice) -> None:
    value = torch_value("float64", (100, 700))  # rows straddle chunk boundaries
    (ref,) = publish_tensors(store, {"v": value}, submission_id="rows")
    part = ref[rows]
    assert part.dtype == value.dtype and part.shape == value[rows].shape
    assert torch.equal(part, value[rows])
    assert torch.equal(
        ref.rows(rows.start or 0, rows.stop if rows.stop is not None else 100), value[rows.start : rows.stop]
    )


def test_slices_of_bfloat16_and_bool_and_zero_width_rows(store: SharedFilesystemStore) -> None:
    bf = torch_value("bfloat16", (40, 3))
    flags = torch_value("bool", (40,))
    wide_empty = torch.empty((10, 0), dtype=torch.int8)
    refs = publish_tensors(store, {"bf": bf, "flags": flags, "w": wide_empty}, submission_id="misc")
    assert raw(refs[0][5:9]) == raw(bf[5:9])
    assert torch.equal(refs[1][::1], flags)
    assert refs[2][2:5].shape == (3, 0)
    slice_ = refs[0][1:2]
    slice_[0, 0] = 1.0  # the result is a writable tensor of its own
    assert raw(refs[0][1:2]) == raw(bf[1:2])


def test_slices_with_a_step_or_of_a_scalar_are_refused(store: SharedFilesystemStore) -> None:
    vector, scalar = publish_tensors(
        store, {"v": torch.arange(10), "s": torch.tensor(1.5)}, submission_id="bad"
    )
    with pytest.raises(ValueError, match="step"):
        vector[::2]
    with pytest.raises(ValueError, match="step"):
        vector[1:8:3]
    with pytest.raises(ValueError, match="scalar"):
        scalar[0:1]
    with pytest.raises(TypeError, match="row slices"):
        vector[3]  # type: ignore[index]
    with pytest.raises(TypeError, match="scalar"):
        len(scalar)
    assert len(vector) == 10


# --------------------------------------------------------------------------- bad data


def test_i6_a_corrupted_chunk_fails_only_the_reads_that_touch_it(store: SharedFilesystemStore) -> None:
    value = torch_value("int32", (8192, 48, 8))  # 1536 bytes a row, 12 MiB
    (ref,) = publish_tensors(store, {"routes": value}, submission_id="corrupt")
    path, offset = payload_offset(store, ref)
    chunk = 5
    flip_byte(path, offset + chunk * CHUNK_BYTES + 17)
    row_bytes = 48 * 8 * 4
    first_row = chunk * CHUNK_BYTES // row_bytes  # the row holding the chunk's first byte
    with pytest.raises(CorruptData, match=r"payload checksum mismatch .*chunk 5"):
        ref[first_row : first_row + 64]
    with pytest.raises(CorruptData, match="payload checksum"):
        ref.load()
    with pytest.raises(CorruptData, match="payload checksum"):
        ref.numpy()
    clean_before = slice(0, (chunk * CHUNK_BYTES) // row_bytes - 1)
    clean_after = slice(((chunk + 1) * CHUNK_BYTES) // row_bytes + 1, 8192)
    assert torch.equal(ref[clean_before], value[clean_before])
    assert torch.equal(ref[clean_after], value[clean_after])


def test_a_record_whose_shape_does_not_match_its_bytes_is_corrupt(store: SharedFilesystemStore) -> None:
    meta = {"tensor": {"dtype": "int32", "shape": [3, 4], "kind": "x"}}
    ref = store.publish([Record("x", bytes(40), TENSOR_CODEC, meta)], submission_id="short")
    with pytest.raises(CorruptData, match=r"needs 48 bytes, the record stores 40"):
        TensorRef.from_record_set(store, ref, 0)
    with pytest.raises(CorruptData, match="needs 48 bytes"):
        TensorRef.from_record_set_many(store, ref)


def test_a_description_checked_before_does_not_vouch_for_a_record_of_other_bytes(
    store: SharedFilesystemStore,
) -> None:
    """Descriptions are checked once per distinct one and byte count (a batch's tensors share a
    few): a record of the same description and the wrong size is still corrupt, and named."""
    meta = {"tensor": {"dtype": "int32", "shape": [3, 4], "kind": "x"}}
    good = store.publish(
        [Record(f"ok{i}", bytes(48), TENSOR_CODEC, meta) for i in range(5)], submission_id="good"
    )
    before = tensor_module._description.cache_info()
    assert [t.shape for t in TensorRef.from_record_set_many(store, good).values()] == [(3, 4)] * 5
    assert TensorRef.from_record_set(store, good, 2).nbytes == 48
    after = tensor_module._description.cache_info()
    assert after.misses - before.misses <= 1  # one description, decoded and checked once
    short = store.publish([Record("short-one", bytes(40), TENSOR_CODEC, meta)], submission_id="short")
    with pytest.raises(CorruptData, match=r"record 'short-one': shape \[3, 4\] of int32 needs 48 bytes"):
        TensorRef.from_record_set(store, short, 0)
    bad = {"tensor": {"dtype": "int33", "shape": [3, 4], "kind": "x"}}
    odd = store.publish([Record("odd", bytes(48), TENSOR_CODEC, bad)], submission_id="odd")
    with pytest.raises(UnsupportedSchema, match="tensor record 'odd' has dtype 'int33'"):
        TensorRef.from_record_set(store, odd, 0)


def test_a_reference_that_disagrees_with_its_record_is_corrupt(store: SharedFilesystemStore) -> None:
    (ref,) = publish_tensors(store, {"x": torch.zeros(3, 4, dtype=torch.int32)}, submission_id="x")
    with pytest.raises(CorruptData, match="does not make"):
        dataclasses.replace(ref, shape=(5,)).load()
    with pytest.raises(CorruptData, match=r"the stored record holds int32\[3, 4\]"):
        dataclasses.replace(ref, shape=(4, 3)).load()
    with pytest.raises(CorruptData, match="the stored record holds"):
        dataclasses.replace(ref, dtype="float32")[0:1]
    with pytest.raises(UnsupportedSchema, match="complex64"):
        dataclasses.replace(ref, dtype="complex64").load()


def test_unknown_tensor_schema_versions_and_dtypes_are_unsupported(tmp_path: Path) -> None:
    with SharedFilesystemStore(tmp_path, RUN, codecs=(*CODECS, "tensor.v2")) as store:
        meta = {"tensor": {"dtype": "int8", "shape": [2], "kind": "x"}}
        v2 = store.publish([Record("x", b"ab", "tensor.v2", meta)], submission_id="v2")
        with pytest.raises(UnsupportedSchema, match=r"tensor\.v2"):
            TensorRef.from_record_set(store, v2, 0)
        with pytest.raises(UnsupportedSchema, match=r"tensor\.v2"):
            TensorRef.from_record_set_many(store, v2)
        odd = {"tensor": {"dtype": "complex32", "shape": [1], "kind": "x"}}
        strange = store.publish([Record("x", b"abcd", TENSOR_CODEC, odd)], submission_id="dtype")
        with pytest.raises(UnsupportedSchema, match="complex32"):
            TensorRef.from_record_set(store, strange, 0)
        plain = store.publish([Record("b", b"abcd")], submission_id="bytes")
        with pytest.raises(InvalidReference, match="not a tensor"):
            TensorRef.from_record_set(store, plain, 0)
        with pytest.raises(InvalidReference, match="ordinal 3"):
            TensorRef.from_record_set(store, plain, 3)


def test_loading_after_the_pack_was_deleted_names_the_reference(
    store: SharedFilesystemStore, sleeps: list[float]
) -> None:
    (ref,) = publish_tensors(store, {"routes": torch.arange(8)}, submission_id="gone")
    detach(store.backend.root)  # a new reader: nothing cached
    attach(store)
    store.backend.path(ref.record_ref.segment.path).unlink()
    message = rf"tensor 'routes' \(record 0 of {ref.record_ref.segment.path}\) cannot be read: .*not visible"
    with pytest.raises(StorageUnavailable, match=message):
        ref.load()
    with pytest.raises(StorageUnavailable, match=message):
        ref[0:2]
    assert sleeps == list(store.backend.visibility_delays) * 2


# --------------------------------------------------------------------------- references and pools


def test_a_reference_pickles_small_with_only_its_mount_hint(
    store: SharedFilesystemStore, tmp_path: Path
) -> None:
    # Issue 10 item 15: a reference names the mount path it was published under, so it
    # loads in a process that attached nothing.
    (ref,) = publish_tensors(store, {"routes": torch.arange(4)}, submission_id="pickle")
    assert ref.root == str(tmp_path)
    data = pickle.dumps(ref)
    assert len(data) < 1024
    assert data.count(str(tmp_path).encode()) == 1  # the root; the record reference has no path
    assert str(tmp_path) not in protocol.encode(dataclasses.asdict(ref.record_ref)).decode()
    copy = pickle.loads(data)
    assert copy == ref and torch.equal(copy.load(), torch.arange(4))


def test_a_reference_reads_its_own_pool_without_setup(store: SharedFilesystemStore, tmp_path: Path) -> None:
    (ref,) = publish_tensors(store, {"x": torch.arange(3)}, submission_id="pools")
    detach(tmp_path)
    assert torch.equal(ref.load(), torch.arange(3))  # through ref.root: no attach, no environment
    detach(tmp_path)
    anonymous = dataclasses.replace(ref, root="")  # a reference made by hand, without a mount hint
    with pytest.raises(InvalidReference, match=r"no pool in this process can read.*STRAW_POOL_ROOTS"):
        anonymous.load()
    moved = dataclasses.replace(ref, root=str(tmp_path / "elsewhere"))
    with pytest.raises(InvalidReference, match=r"elsewhere' is not mounted here"):
        moved.load()
    with store.read_session() as session:
        assert torch.equal(anonymous.load(reader=session), torch.arange(3))
    assert torch.equal(anonymous.load(reader=store), torch.arange(3))
    detach(tmp_path)
    attach(str(tmp_path))
    assert torch.equal(anonymous.load(), torch.arange(3))
    assert anonymous == ref  # the mount hint is not part of the reference's identity


def test_the_environment_names_pools_for_other_processes(
    store: SharedFilesystemStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (ref,) = publish_tensors(store, {"x": torch.arange(3)}, submission_id="env")
    detach(tmp_path)
    monkeypatch.setenv(tensor_module.POOL_ROOTS_ENV, os.pathsep.join(["/nonexistent/pool", str(tmp_path)]))
    assert torch.equal(ref.load(), torch.arange(3))


def test_with_several_pools_the_one_holding_the_writer_is_chosen(tmp_path: Path) -> None:
    stores = [SharedFilesystemStore(tmp_path / name, RUN, codecs=CODECS) for name in ("a", "b")]
    refs = [
        publish_tensors(s, {"x": torch.full((2,), i)}, submission_id="p")[0] for i, s in enumerate(stores)
    ]
    for i, ref in enumerate(refs):
        assert torch.equal(ref.load(), torch.full((2,), i))
    for s in stores:
        s.close()
    detach(tmp_path / "a")
    attach(tmp_path / "c")
    assert torch.equal(refs[0].load(), torch.full((2,), 0))  # its own root still holds it
    detach(tmp_path / "a")
    with pytest.raises(InvalidReference, match="none of the attached pools"):
        dataclasses.replace(refs[0], root="").load()


def test_pools_attached_on_their_own_are_bounded_and_attach_keeps_a_pool(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tensor_module, "ATTACHED_POOLS_MAX", 2)
    roots = [tmp_path / name for name in ("a", "b", "c", "d")]
    refs = []
    for i, root in enumerate(roots):
        with SharedFilesystemStore(root, RUN, codecs=CODECS) as writer:
            refs.append(publish_tensors(writer, {"x": torch.full((2,), i)}, submission_id="p")[0])
        detach(root)
    attach(roots[3])  # kept: it does not count and is never forgotten on its own
    for i, ref in enumerate(refs):  # each read attaches its reference's own root
        assert torch.equal(ref.load(), torch.full((2,), i))
    assert list(tensor_module._pools) == [str(roots[3]), str(roots[1]), str(roots[2])]
    gc.collect()  # the forgotten pool's sessions close their descriptors once unreferenced
    assert not qh.descriptors_under(roots[0])
    assert qh.descriptors_under(roots[1]) and qh.descriptors_under(roots[3])
    assert torch.equal(refs[0].load(), torch.full((2,), 0))  # attached again on its next read
    assert list(tensor_module._pools) == [str(roots[3]), str(roots[2]), str(roots[0])]
    for root in roots:
        detach(root)
    assert not any(qh.descriptors_under(root) for root in roots)


def test_a_reader_of_another_run_is_refused(store: SharedFilesystemStore, tmp_path: Path) -> None:
    (ref,) = publish_tensors(store, {"x": torch.arange(3)}, submission_id="run")
    with (
        SharedFilesystemStore(tmp_path, "other-run", codecs=CODECS) as other,
        other.read_session() as session,
        pytest.raises(InvalidReference, match="belongs to run"),
    ):
        ref.load(reader=session)
    with pytest.raises(TypeError, match="reader must be"):
        ref.load(reader="nope")  # type: ignore[arg-type]


def test_pin_memory_without_an_accelerator_says_so(store: SharedFilesystemStore) -> None:
    (ref,) = publish_tensors(store, {"x": torch.arange(3)}, submission_id="pin")
    if torch.cuda.is_available():  # pragma: no cover - GPU machines
        assert ref.load(pin_memory=True).is_pinned()
        return
    with pytest.raises(ValueError, match="pin_memory=True needs an accelerator"):
        ref.load(pin_memory=True)


# --------------------------------------------------------------------------- share, update, record sets


def test_share_returns_the_source_publication_without_writing(store: SharedFilesystemStore) -> None:
    refs = publish_tensors(store, {"a": torch.arange(2), "b": torch.arange(3)}, submission_id="src")
    writes = store.metrics["writes"]
    assert refs[1].share(store, submission_id="s") == (refs[0].record_set, 1)
    assert store.metrics["writes"] == writes
    bare = dataclasses.replace(refs[1], record_set=None, ordinal=0)
    shared, ordinal = bare.share(store, submission_id="bare")
    assert (ordinal, shared.records, shared.payload_bytes) == (0, 1, refs[1].nbytes)
    rebuilt = TensorRef.from_record_set(store, shared, 0)
    assert rebuilt.record_ref == refs[1].record_ref and torch.equal(rebuilt.load(), torch.arange(3))


def test_share_into_another_run_is_refused(store: SharedFilesystemStore, tmp_path: Path) -> None:
    (ref,) = publish_tensors(store, {"a": torch.arange(2)}, submission_id="src")
    with (
        SharedFilesystemStore(tmp_path, "other-run", codecs=CODECS) as other,
        pytest.raises(InvalidReference, match="belongs to run"),
    ):
        ref.share(other, submission_id="x")


def test_updated_writes_a_new_tensor_and_leaves_the_original(store: SharedFilesystemStore) -> None:
    original = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    (ref,) = publish_tensors(store, {"logprobs": original}, submission_id="orig")
    rows = ref.updated(store, torch.zeros(2, 3), rows=slice(1, 3), submission_id="rows")
    whole = ref.updated(store, np.ones((2, 2), dtype=np.int8), submission_id="whole")
    expected = original.clone()
    expected[1:3] = 0
    assert torch.equal(rows.load(), expected)
    assert torch.equal(whole.load(), torch.ones(2, 2, dtype=torch.int8))
    assert (rows.kind, whole.kind) == ("logprobs", "logprobs")
    assert torch.equal(ref.load(), original)
    assert rows.record_ref != ref.record_ref


def test_from_record_set_many_maps_tensor_ordinals_only(store: SharedFilesystemStore) -> None:
    tensor_record = tensor_module.tensor_record(np.arange(4, dtype=np.int16), "t", kind="topk")
    ref = store.publish(
        [Record("note", b"hello"), tensor_record, Record("more", b"x")], submission_id="mixed"
    )
    with store.read_session() as session:
        found = TensorRef.from_record_set_many(store, ref, reader=session)
    assert list(found) == [1]
    assert found[1].kind == "topk" and found[1].ordinal == 1 and found[1].record_set == ref
    assert found[1].numpy().tolist() == [0, 1, 2, 3]
    assert TensorRef.from_record_set(store, ref, 1) == found[1]


# --------------------------------------------------------------------------- the reader additions


def test_read_tensor_range_equals_read_range_across_chunk_edges(store: SharedFilesystemStore) -> None:
    payload = np.random.default_rng(7).bytes(3 * CHUNK_BYTES + 1000)
    ref = store.publish([Record("p", payload)], submission_id="p")
    (record,) = store.validate(ref)
    edges = [0, 1, CHUNK_BYTES - 1, CHUNK_BYTES, CHUNK_BYTES + 1, 3 * CHUNK_BYTES, len(payload)]
    with store.read_session() as session:
        for start in edges:
            for stop in edges:
                if start <= stop:
                    got = session.read_tensor_range(record, start, stop)
                    assert not got.readonly
                    assert bytes(got) == payload[start:stop] == bytes(session.read_range(record, start, stop))
        with pytest.raises(ValueError, match="outside"):
            session.read_tensor_range(record, 5, len(payload) + 1)
        target = bytearray(len(payload))
        session.read_into(record, memoryview(target))
        assert bytes(target) == payload
        with pytest.raises(ValueError, match="target holds"):
            session.read_into(record, memoryview(bytearray(10)))


def test_payload_into_refuses_a_target_that_splits_a_chunk(store: SharedFilesystemStore) -> None:
    ref = store.publish([Record("p", bytes(2 * CHUNK_BYTES + 5))], submission_id="p")
    (record,) = store.validate(ref)
    with store.read_session() as session:
        located = session.locate(record)
        reader = session._reader
        with pytest.raises(ValueError, match="whole chunks"):
            reader.payload_into(located.segment, located.entry, located.chunk, memoryview(bytearray(100)))
        tail = bytearray(CHUNK_BYTES + 5)
        reader.payload_into(located.segment, located.entry, located.chunk, memoryview(tail), first=1)
        assert bytes(tail) == bytes(CHUNK_BYTES + 5)


def test_a_thread_that_ends_releases_its_descriptors(store: SharedFilesystemStore) -> None:
    (ref,) = publish_tensors(store, {"x": torch.arange(3)}, submission_id="thread")
    fds = Path("/proc/self/fd")
    if not fds.is_dir():  # pragma: no cover - not Linux
        pytest.skip("needs /proc/self/fd")
    root = str(store.backend.root)

    def into_pool() -> int:  # (only this pool's: other tests may leave descriptors of their own)
        count = 0
        for fd in fds.iterdir():
            try:
                count += os.readlink(fd).startswith(root)
            except OSError:
                continue  # closed meanwhile (the listing's own descriptor)
        return count

    before = into_pool()
    results: list[torch.Tensor] = []
    for _ in range(5):
        worker = threading.Thread(target=lambda: results.append(ref.load()))
        worker.start()
        worker.join()
    gc.collect()
    assert [r.tolist() for r in results] == [[0, 1, 2]] * 5
    assert into_pool() <= before


def test_a_store_as_reader_reads_only_its_own_run(store: SharedFilesystemStore, tmp_path: Path) -> None:
    (ref,) = publish_tensors(store, {"x": torch.arange(3)}, submission_id="own-run")
    with SharedFilesystemStore(tmp_path, "other-run", codecs=CODECS) as other:
        with pytest.raises(InvalidReference, match="belongs to run"):
            ref.load(reader=other)
        with pytest.raises(InvalidReference, match="belongs to run"):
            TensorRef.from_record_set(other, ref.record_set, 0)  # type: ignore[arg-type]


def test_release_tensor_publications_makes_discarded_tensors_collectable(tmp_path: Path) -> None:
    root = tmp_path / "gc-pool"
    with SharedFilesystemStore(root, "run", codecs=("bytes.v1", TENSOR_CODEC), online_gc=True) as gc_store:
        kept = publish_tensors(gc_store, {"keep": np.arange(64, dtype=np.int32)}, submission_id="keep")
        gc_store.retain("app:kept", [kept[0].record_set])
        gc_store.seal()
        dropped = publish_tensors(
            gc_store, {"a": np.ones((8, 4), np.float32), "b": np.zeros(3, np.int64)}, submission_id="drop"
        )
        gc_store.seal()
        # Both tensors of the discarded publication name the same record set: released once.
        tensor_module.release_tensor_publications(gc_store, dropped)
        gc_store.release_publications([kept[0].record_set])
        result = gc_store.collect_garbage()
        assert result["reclaimed_files"] == 1
        assert not os.path.exists(root / dropped[0].record_ref.segment.path)
        np.testing.assert_array_equal(kept[0].numpy(reader=gc_store), np.arange(64, dtype=np.int32))


def test_release_tensor_publications_refuses_refs_without_a_publication(store: SharedFilesystemStore) -> None:
    (ref,) = publish_tensors(store, {"x": np.arange(4, dtype=np.int16)}, submission_id="x")
    bare = dataclasses.replace(ref, record_set=None)
    with pytest.raises(InvalidReference, match="no publication of its own"):
        tensor_module.release_tensor_publications(store, [bare])
    with pytest.raises(TypeError, match="TensorRef"):
        tensor_module.release_tensor_publications(store, [ref.record_ref])  # type: ignore[list-item]


_STORED = {"u1": "uint8", "i1": "int8", "i2": "int16", "i4": "int32", "i8": "int64", "f2": "float16"}
_STORED |= {"f4": "float32", "f8": "float64", "b1": "bool"}


@settings(max_examples=150, deadline=None)
@given(
    array=st.sampled_from(sorted(_STORED)).flatmap(
        lambda code: hnp.arrays(
            st.sampled_from([np.dtype(code), np.dtype(code).newbyteorder(">")]),
            hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4),
        )
    ),
    layout=st.sampled_from(["as is", "fortran", "reversed", "masked"]),
)
def test_tensor_bytes_are_the_little_endian_c_order_bytes(array: np.ndarray, layout: str) -> None:
    value = {
        "as is": array,
        "fortran": np.asfortranarray(array),
        "reversed": array[::-1] if array.ndim else array,
        "masked": np.ma.masked_array(array),
    }[layout]
    view, name, shape = tensor_bytes(value)
    expected = np.ascontiguousarray(value, dtype=np.dtype(array.dtype.str[1:]).newbyteorder("<"))
    assert name == _STORED[array.dtype.str[1:]]
    assert shape == value.shape and all(type(n) is int for n in shape)
    assert view.format == "B" and view.ndim == 1 and view.nbytes == expected.nbytes
    assert bytes(view) == expected.tobytes()
