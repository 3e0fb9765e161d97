"""TensorRef and PayloadRef cross process boundaries: pickled here, loaded byte-exact in a child.

The child is an independent interpreter (``sys.executable``). A reference is self-contained:
a child that mounts the pool at the same path loads it with no setup at all; a pool mounted
at another path is found through ``straw.tensor.attach`` or ``STRAW_POOL_ROOTS`` (a remap;
docs/FORMAT.md section 10.3). The child names the sample's classes itself (``classes=``):
straw never imports a module a document names. Another child checks that straw,
straw.tensor and straw.codec import and read NumPy data with PyTorch blocked, and import
neither torch nor PIL eagerly.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from straw import SharedFilesystemStore, codec
from straw.tensor import POOL_ROOTS_ENV, publish_tensors

RUN = "run-process-tests"
CODECS = ("bytes.v1", "json.v1", "tensor.v1", "sample.v1")

# Classes a sample refers to must be importable by name in the reading process too.
SAMPLE_TYPES = """
import dataclasses, enum
from typing import Any

class Status(enum.Enum):
    DONE = "done"

@dataclasses.dataclass
class Sample:
    tokens: list
    status: Status
    routes: Any = None
    metadata: dict = dataclasses.field(default_factory=dict)
"""

CHILD = textwrap.dedent(
    """
    import pickle, sys
    import straw.tensor
    mode, root = sys.argv[1], sys.argv[2]
    if mode == "attach":
        straw.tensor.attach(root)
    classes = {"process_sample_types:Sample", "process_sample_types:Status"}
    refs, payload = pickle.loads(sys.stdin.buffer.read())
    out = {"tensors": [], "sample": None}
    for ref in refs:
        value = ref.load()
        if str(value.dtype) == "torch.bfloat16":
            value = value.view(__import__("torch").int16)
        out["tensors"].append((str(value.dtype), tuple(value.shape), value.numpy().tobytes()))
        rows = ref[1:3]
        out.setdefault("rows", []).append(rows.clone())
    out["sample"] = payload.load(materialize=True, classes=classes)
    sys.stdout.buffer.write(pickle.dumps(out))
    """
)


def run_child(
    code: str, args: list[str], data: bytes, env: dict[str, str]
) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        input=data,
        capture_output=True,
        env=env,
        timeout=120,
        check=False,
    )


@pytest.fixture
def published(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[Path, Any, list[Any], Any, Any, dict[str, Any]]:
    pool = tmp_path / "pool"
    modules = tmp_path / "modules"
    modules.mkdir()
    (modules / "process_sample_types.py").write_text(SAMPLE_TYPES)
    monkeypatch.syspath_prepend(str(modules))
    types = importlib.import_module("process_sample_types")
    generator = torch.Generator().manual_seed(5)
    tensors = {
        "routes": torch.randint(0, 64, (300, 48, 8), dtype=torch.int32, generator=generator),
        "logprobs": torch.randn((300, 128), generator=generator),
        "bf": torch.randn((7, 3), generator=generator).to(torch.bfloat16),
        "flags": torch.tensor([True, False, True, True]),
    }
    with SharedFilesystemStore(pool, RUN, codecs=CODECS) as store:
        refs = publish_tensors(store, tensors, submission_id="tensors")
        sample = types.Sample(
            [1, 2, 3], types.Status.DONE, tensors["routes"][:10].clone(), {"k": np.arange(5)}
        )
        sample.extra = ("kept", 1.5)
        payload = codec.publish(store, sample, submission_id="sample")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(modules), os.environ.get("PYTHONPATH", "")]))
    env.pop(POOL_ROOTS_ENV, None)
    return pool, types, refs, payload, sample, {"env": env, "tensors": tensors}


def check_child_output(output: bytes, tensors: dict[str, torch.Tensor], sample: Any) -> None:
    got = pickle.loads(output)
    for (dtype, shape, raw), value in zip(got["tensors"], tensors.values(), strict=True):
        storage = value.view(torch.int16) if value.dtype == torch.bfloat16 else value
        assert (dtype, shape, raw) == (str(storage.dtype), tuple(value.shape), storage.numpy().tobytes())
    for rows, value in zip(got["rows"], tensors.values(), strict=True):
        assert torch.equal(rows.view(torch.uint8), value[1:3].view(torch.uint8))
    loaded = got["sample"]
    assert type(loaded).__name__ == "Sample" and loaded.status.value == "done"
    assert loaded.tokens == sample.tokens and loaded.extra == ("kept", 1.5)
    assert torch.equal(loaded.routes, sample.routes)
    assert loaded.metadata["k"].tobytes() == sample.metadata["k"].tobytes()


def test_refs_pickled_to_a_child_process_load_with_no_setup(
    published: tuple[Path, Any, list[Any], Any, Any, dict[str, Any]],
) -> None:
    pool, _, refs, payload, sample, extra = published
    assert POOL_ROOTS_ENV not in extra["env"]
    data = pickle.dumps((refs, payload))
    assert len(pickle.dumps(payload)) < 1024 and all(len(pickle.dumps(r)) < 1024 for r in refs)
    result = run_child(CHILD, ["none", str(pool)], data, extra["env"])
    assert result.returncode == 0, result.stderr.decode()
    check_child_output(result.stdout, extra["tensors"], sample)


@pytest.mark.parametrize("mode", ["attach", "environment"])
def test_a_pool_mounted_elsewhere_is_remapped(
    published: tuple[Path, Any, list[Any], Any, Any, dict[str, Any]], mode: str, tmp_path: Path
) -> None:
    pool, _, refs, payload, sample, extra = published
    moved = pool.rename(tmp_path / "mounted-elsewhere")
    env = dict(extra["env"])
    if mode == "environment":
        env[POOL_ROOTS_ENV] = os.pathsep.join(["/nonexistent/pool", str(moved)])
    result = run_child(CHILD, [mode, str(moved)], pickle.dumps((refs, payload)), env)
    assert result.returncode == 0, result.stderr.decode()
    check_child_output(result.stdout, extra["tensors"], sample)


def test_a_child_without_the_pool_gets_a_clear_error(
    published: tuple[Path, Any, list[Any], Any, Any, dict[str, Any]], tmp_path: Path
) -> None:
    pool, _, refs, payload, _, extra = published
    moved = pool.rename(tmp_path / "unmounted")
    result = run_child(CHILD, ["none", str(moved)], pickle.dumps((refs, payload)), extra["env"])
    assert result.returncode != 0
    assert b"InvalidReference: no pool in this process can read" in result.stderr
    assert f"its pool {str(pool)!r} is not mounted here".encode() in result.stderr
    assert b"STRAW_POOL_ROOTS" in result.stderr


NO_TORCH = textwrap.dedent(
    """
    import pickle, sys
    sys.modules["torch"] = None  # any import of torch now fails
    import numpy
    import straw, straw.tensor, straw.codec
    assert "PIL" not in sys.modules and "PIL.Image" not in sys.modules
    from straw.errors import UnsupportedSchema
    root = sys.argv[1]
    codecs = ("bytes.v1", "tensor.v1", "sample.v1")
    with straw.SharedFilesystemStore(root, "numpy-only", codecs=codecs) as store:
        ref = straw.codec.publish(store, {"ids": numpy.arange(6, dtype="int64")}, submission_id="n")
        lazy = ref.load()
        try:
            lazy["ids"].load()
        except UnsupportedSchema as error:
            message = str(error)
        else:
            raise SystemExit("load() without torch did not refuse")
        full = ref.load(materialize=True)
    sys.stdout.buffer.write(pickle.dumps((lazy["ids"].numpy().tolist(), full["ids"].tolist(), message)))
    """
)


def test_straw_reads_numpy_samples_without_torch(tmp_path: Path) -> None:
    clean = subprocess.run(
        [sys.executable, "-c", "import sys, straw, straw.tensor, straw.codec; print('torch' in sys.modules)"],
        capture_output=True,
        timeout=120,
        check=True,
    )
    assert clean.stdout.strip() == b"False"
    result = subprocess.run(
        [sys.executable, "-c", NO_TORCH, str(tmp_path)], capture_output=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr.decode()
    lazy, full, message = pickle.loads(result.stdout)
    assert lazy == full == [0, 1, 2, 3, 4, 5]
    assert "needs PyTorch" in message


def test_the_sample_types_are_plain_dataclasses(
    published: tuple[Path, Any, list[Any], Any, Any, dict[str, Any]],
) -> None:
    _, types, _, payload, sample, _ = published
    loaded = payload.load(materialize=True)
    assert isinstance(loaded, types.Sample) and dataclasses.is_dataclass(loaded)
    assert loaded.extra == sample.extra
