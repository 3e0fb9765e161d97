"""Benchmark: the sample codec (straw.codec) versus torch.save of one file per sample.

Each sample is shaped like a slime rollout sample: 8,192 tokens, MoE routing replay
int32 [8192, 48, 8] (12 MiB), top-k ids int32 [8192, 128] and top-k log-probs
float32 [8192, 128] (4 MiB each), the token ids as a Python list and a few scalars
(reward, status enum, lengths) in a dataclass.

straw: ``codec.publish`` per sample (one durable append each, fdatasync), then
``PayloadRef.load(materialize=True)`` (every byte verified) and the lazy load plus a
64-row routing-replay slice. torch: ``torch.save`` to its own file per sample, then
fsync of the file and of the directory (what makes a new file durable), and
``torch.load``. Run:

    .venv/bin/python benchmarks/codec_bench.py --root /tmp/codec-bench --samples 20
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from straw import SharedFilesystemStore, codec

MiB = 1024 * 1024


class Status(enum.Enum):
    COMPLETED = "completed"
    TRUNCATED = "truncated"


@dataclasses.dataclass
class Sample:
    index: int
    tokens: list[int]
    response_length: int
    reward: float
    status: Status
    rollout_routed_experts: torch.Tensor
    topk_ids: torch.Tensor
    topk_logprobs: torch.Tensor
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)


def make_sample(index: int, tokens: int, generator: torch.Generator) -> Sample:
    return Sample(
        index=index,
        tokens=torch.randint(0, 150_000, (tokens,), generator=generator).tolist(),
        response_length=tokens // 2,
        reward=0.25 * index,
        status=Status.COMPLETED,
        rollout_routed_experts=torch.randint(0, 64, (tokens, 48, 8), dtype=torch.int32, generator=generator),
        topk_ids=torch.randint(0, 150_000, (tokens, 128), dtype=torch.int32, generator=generator),
        topk_logprobs=torch.randn((tokens, 128), generator=generator),
        metadata={"prompt_id": f"p{index}", "weight_version": 3},
    )


def tensor_bytes(sample: Sample) -> int:
    tensors = (sample.rollout_routed_experts, sample.topk_ids, sample.topk_logprobs)
    return sum(t.numel() * t.element_size() for t in tensors)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def summary(name: str, seconds: list[float], total_bytes: int) -> str:
    per = statistics.median(seconds) * 1e3
    rate = total_bytes / MiB / sum(seconds)
    return f"  {name:38s} {rate:9.1f} MiB/s   p50 {per:8.3f} ms/sample"


def latency(name: str, seconds: list[float], unit: str) -> str:
    return f"  {name:38s} {'':15s}   p50 {statistics.median(seconds) * 1e3:8.3f} ms/{unit}"


def bench_straw(root: Path, samples: list[Sample], total: int) -> list[str]:
    store = SharedFilesystemStore(root, "codec-bench", codecs=("bytes.v1", "tensor.v1", "sample.v1"))
    publish, refs = [], []
    for i, sample in enumerate(samples):
        start = time.perf_counter()
        refs.append(
            codec.publish(
                store, sample, submission_id=f"sample-{i}", kinds={"rollout_routed_experts": "routing_replay"}
            )
        )
        publish.append(time.perf_counter() - start)
    refs[0].load(materialize=True)  # warm-up (untimed): the process's first large allocations
    loads, lazy, slices = [], [], []
    for ref, sample in zip(refs, samples, strict=True):
        start = time.perf_counter()
        loaded = ref.load(materialize=True)
        loads.append(time.perf_counter() - start)
        if not torch.equal(loaded.rollout_routed_experts, sample.rollout_routed_experts):
            raise SystemExit("straw round trip differs")
        start = time.perf_counter()
        view = ref.load()
        lazy.append(time.perf_counter() - start)
        start = time.perf_counter()
        view.rollout_routed_experts[4096 : 4096 + 64]
        slices.append(time.perf_counter() - start)
    store.close()
    return [
        summary("codec.publish (fdatasync)", publish, total),
        summary("PayloadRef.load(materialize=True)", loads, total),
        latency("PayloadRef.load() lazy", lazy, "sample"),
        latency("lazy 64-row routing-replay slice", slices, "slice"),
    ]


def bench_torch(root: Path, samples: list[Sample], total: int, dir_sync: bool) -> list[str]:
    root.mkdir(parents=True, exist_ok=True)
    saves, paths = [], []
    for i, sample in enumerate(samples):
        path = root / f"sample-{i}.pt"
        start = time.perf_counter()
        with open(path, "wb") as handle:
            torch.save(sample, handle)
            handle.flush()
            os.fsync(handle.fileno())
        if dir_sync:
            fsync_dir(root)
        saves.append(time.perf_counter() - start)
        paths.append(path)
    torch.load(paths[0], weights_only=False)  # warm-up (untimed), as for straw
    loads = []
    for path, sample in zip(paths, samples, strict=True):
        start = time.perf_counter()
        loaded = torch.load(path, weights_only=False)
        loads.append(time.perf_counter() - start)
        if not torch.equal(loaded.rollout_routed_experts, sample.rollout_routed_experts):
            raise SystemExit("torch round trip differs")
    label = "torch.save + fsync file" + (" + dir" if dir_sync else "")
    return [summary(label, saves, total), summary("torch.load", loads, total)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, required=True, help="scratch directory (emptied first)")
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--no-dir-sync", action="store_true", help="torch: fsync the file only")
    args = parser.parse_args()
    shutil.rmtree(args.root, ignore_errors=True)
    generator = torch.Generator().manual_seed(0)
    samples = [make_sample(i, args.tokens, generator) for i in range(args.samples)]
    total = sum(tensor_bytes(s) for s in samples)
    print(
        f"{args.samples} samples of {tensor_bytes(samples[0]) / MiB:.1f} MiB tensors "
        f"({args.tokens} tokens) on {args.root}; python {sys.version.split()[0]}, torch {torch.__version__}"
    )
    print("straw codec")
    for line in bench_straw(args.root / "straw", samples, total):
        print(line)
    print("torch.save, one file per sample")
    for line in bench_torch(args.root / "torch", samples, total, not args.no_dir_sync):
        print(line)
    shutil.rmtree(args.root, ignore_errors=True)


if __name__ == "__main__":
    main()
