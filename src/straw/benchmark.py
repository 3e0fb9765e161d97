"""``straw bench``: the end-to-end benchmark and self-check of a pool on one filesystem.

Every phase runs against one fresh pool and is verified, so the same command
answers "how fast is this mount?" and "does straw return the exact bytes it was
given?":

1. bulk publish: RL-rollout-shaped samples (a 1 KiB ``json.v1`` record plus
   token ids, log-probs and a routing-replay array, ~1.25 MiB in all), each one
   publication, payloads passed zero-copy as memoryviews of numpy arrays;
2. bulk read-back: every sample read with verification and compared byte for
   byte with a regenerated copy;
3. small publications: 1 KiB records published one per call, then the same
   count with ``publish_many`` in batches, then all of them read back;
4. one large publication: its resident-memory increase while publishing is
   checked against the store's ``max_buffer_bytes``, then slices are read back
   with ``read_range``.

Run it as ``straw bench`` or ``python -m straw.benchmark``; ``--help`` lists the
options and exit codes.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import platform
import resource
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import numpy.typing as npt

from straw._benchmark import local
from straw._benchmark.profile import profile
from straw.backend import PROFILES, FilesystemBackend
from straw.errors import CorruptData, InvalidReference, QueueError
from straw.protocol import Publication, Record, RecordRef, RecordSetRef, encode
from straw.reporting import write_report
from straw.store import SharedFilesystemStore

__all__ = ["EXIT_CODES", "SUBCOMMANDS", "add_arguments", "build_parser", "main", "profile", "run"]

KiB = 1024
MiB = 1024 * KiB

#: Seed of every generated payload: a rerun writes the same bytes.
SEED = 20240611
#: Tokens of one rollout (prompt + response) and the vocabulary they are drawn from.
SAMPLE_TOKENS = 8192
VOCAB = 151_936
#: Size of the JSON description record of a sample, and the target size of a whole sample.
JSON_RECORD_BYTES = 1 * KiB
SAMPLE_BYTES_TARGET = 1280 * KiB
#: Routing replay: per token, the expert ids chosen in every MoE layer (layers × top-k,
#: flattened), as many columns as bring a sample to SAMPLE_BYTES_TARGET.
ROUTING_COLUMNS = round((SAMPLE_BYTES_TARGET - JSON_RECORD_BYTES - 8 * SAMPLE_TOKENS) / (4 * SAMPLE_TOKENS))
EXPERTS = 128
#: Token ids of the prompt and of the response quoted in the JSON record.
QUOTED_IDS = 48
BULK_MIB_DEFAULT = 512
SMALL_BYTES = 1 * KiB
SMALL_BATCH = 100
#: A full verified read of the large publication doubles its memory; only small ones get one.
FULL_READ_MIB_MAX = 256
RANGE_SLICES = 8

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_ERROR = 0, 1, 2, 3
EXIT_CODES = """\
exit codes:
  0  every verification passed (bytes read back equal the bytes published, and the
     large publication stayed within max_buffer_bytes of extra resident memory)
  1  a verification failed: a mismatch or checksum error on read-back, or the
     memory check failed (the summary says which)
  2  usage error: bad option, unreadable or invalid --declaration, missing --root
  3  the run stopped on a storage error (e.g. StorageUnavailable, disk full)
"""

DESCRIPTION = """\
Benchmark and verify a straw pool on one filesystem. A fresh pool is created in a
new straw-bench-* directory under --root (default: the system temporary directory)
and removed at the end unless --keep. Phases: RL-sample-shaped bulk publish,
verified read-back of every sample, small 1 KiB publications (single and batched),
and one large publication with a resident-memory check. Progress goes to stderr,
the summary table to stdout."""


# --------------------------------------------------------------------------- options


def _count(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be >= {least}, got {value}")
    return value


def _positive(text: str) -> int:
    return _count(text, 1)


def _non_negative(text: str) -> int:
    return _count(text, 0)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``straw bench`` (shared by the ``straw`` command and ``python -m``)."""
    parser.add_argument(
        "--root",
        metavar="DIR",
        help="existing directory on the filesystem to measure; the pool goes in a fresh "
        "straw-bench-* directory inside it (default: the system temporary directory)",
    )
    # 512 MiB by default ("a few hundred MiB" of RL-shaped samples). On these VMs the first few
    # hundred MiB of synced writes may land in the host's cache (~900 MiB/s); pass --mib 2048 to
    # see the sustained rate (~350 MiB/s).
    parser.add_argument(
        "--mib",
        type=_positive,
        default=BULK_MIB_DEFAULT,
        metavar="N",
        help=f"volume of the bulk phase in MiB, ~1.25 MiB per sample (default {BULK_MIB_DEFAULT})",
    )
    parser.add_argument(
        "--segment-mib", type=_positive, default=64, metavar="N", help="pack rotation size (default 64)"
    )
    parser.add_argument(
        "--profile", choices=PROFILES, default="local", help="backend profile (default local)"
    )
    parser.add_argument(
        "--declaration", metavar="FILE", help="JSON deployment declaration (required for --profile juicefs)"
    )
    parser.add_argument(
        "--small",
        type=_non_negative,
        default=2000,
        metavar="N",
        help="number of 1 KiB publications, made one per call and then again in publish_many "
        "batches (default 2000)",
    )
    parser.add_argument(
        "--big-mib",
        type=_non_negative,
        default=1024,
        metavar="N",
        help="size of the large publication of the memory check (default 1024; 0 skips it)",
    )
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON to FILE")
    parser.add_argument("--quiet", action="store_true", help="no progress output (the summary still prints)")
    parser.add_argument("--keep", action="store_true", help="keep the pool directory afterwards")


def build_parser(prog: str = "straw bench") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description=DESCRIPTION,
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    return parser


# --------------------------------------------------------------------------- progress


class Progress:
    """A dependency-free progress bar on stderr.

    On a terminal it redraws one line with ``\\r`` a few times a second; otherwise
    (a pipe, a CI log) it prints a plain line every few seconds and one at the end.
    """

    BAR = 24

    def __init__(
        self,
        label: str,
        total: int,
        *,
        stream: TextIO | None = None,
        enabled: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.label = label
        self.total = max(total, 0)
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.clock = clock
        self.tty = enabled and self.stream.isatty()
        self.interval = 0.1 if self.tty else 5.0
        self.done = 0
        self.nbytes = 0
        self.started = clock()
        self.drawn = self.started
        self.width = 0
        self.drawn_done = -1
        if self.tty:
            self._draw(final=False)  # a long single operation shows its bar from the start

    def advance(self, count: int = 1, nbytes: int = 0) -> None:
        self.done += count
        self.nbytes += nbytes
        if self.enabled and self.clock() - self.drawn >= self.interval:
            self._draw(final=False)

    def close(self) -> None:
        # A terminal line always gets its final state and newline; a log gets no repeated line.
        if self.tty or (self.enabled and self.done != self.drawn_done):
            self._draw(final=True)

    def _line(self) -> str:
        elapsed = max(self.clock() - self.started, 1e-9)
        share = min(self.done / self.total, 1.0) if self.total else 1.0
        counts = f"{self.done}/{self.total}"
        if self.nbytes:
            counts += f"  {self.nbytes / MiB:,.0f} MiB  {self.nbytes / MiB / elapsed:,.0f} MiB/s"
        if self.tty:
            filled = int(self.BAR * share)
            return f"{self.label:<24} [{'#' * filled}{'.' * (self.BAR - filled)}] {counts}  {elapsed:.1f} s"
        return f"straw bench: {self.label}: {counts} ({100 * share:.0f}%, {elapsed:.1f} s)"

    def _draw(self, *, final: bool) -> None:
        self.drawn = self.clock()
        self.drawn_done = self.done
        line = self._line()
        if self.tty:
            # Pad over what a longer previous line left on the terminal.
            self.stream.write("\r" + line.ljust(self.width) + ("\n" if final else ""))
            self.width = len(line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


# --------------------------------------------------------------------------- results


@dataclass
class Phase:
    """Counters of one phase; ``busy`` is the time spent inside straw calls."""

    name: str
    verified: bool = False
    volume: int = 0
    publications: int = 0
    busy: float = 0.0
    latencies: list[float] = field(default_factory=list)
    syncs: int = 0
    mismatches: int = 0

    @contextlib.contextmanager
    def timed(self) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - start
            self.busy += elapsed
            self.latencies.append(elapsed)

    def as_dict(self) -> dict[str, Any]:
        busy = self.busy if self.busy > 0 else float("inf")
        return {
            "name": self.name,
            "volume_bytes": self.volume,
            "publications": self.publications,
            "operations": len(self.latencies),
            "seconds": round(self.busy, 6),
            "throughput_mib_s": round(self.volume / MiB / busy, 3),
            "ops_s": round(self.publications / busy, 3),
            "latency_ms": {f"p{q}": round(_percentile(self.latencies, q) * 1e3, 4) for q in (50, 90, 99)}
            | {"max": round(max(self.latencies, default=0.0) * 1e3, 4)},
            "fsyncs": self.syncs,
            "fsyncs_per_publication": round(self.syncs / self.publications, 4) if self.publications else 0,
            "verified": self.verified,
            "mismatches": self.mismatches,
        }


def _percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile; 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[min(int(rank), len(ordered)) - 1]


@dataclass
class Bench:
    """One benchmark run: the store, the options and everything measured."""

    store: SharedFilesystemStore
    options: argparse.Namespace
    phases: list[Phase] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    memory: dict[str, Any] = field(default_factory=dict)

    def progress(self, label: str, total: int) -> Progress:
        return Progress(label, total, enabled=not self.options.quiet)

    @contextlib.contextmanager
    def phase(self, name: str, *, verified: bool = False) -> Iterator[Phase]:
        phase = Phase(name, verified)
        syncs = self.store.backend.metrics["syncs"]
        try:
            yield phase
        finally:
            phase.syncs = self.store.backend.metrics["syncs"] - syncs
            self.phases.append(phase)

    def mismatch(self, phase: Phase, what: str) -> None:
        phase.mismatches += 1
        if len(self.problems) < 20:
            self.problems.append(f"{phase.name}: {what}")


# --------------------------------------------------------------------------- RL-shaped samples


def _task(index: int) -> dict[str, str]:
    return {"task_id": f"task-{index:06d}", "attempt_id": "attempt-0"}


def sample_records(index: int) -> list[Record]:
    """The records of sample ``index``, generated deterministically (the same on every call).

    Shaped like one RL rollout: a 1 KiB JSON description quoting prompt and response
    token ids, the token ids (int32), their log-probs (float32) and a routing-replay
    array (int32, tokens × ROUTING_COLUMNS). Array payloads are zero-copy memoryviews.
    """
    rng = np.random.default_rng([SEED, index])
    tokens = rng.integers(0, VOCAB, size=SAMPLE_TOKENS, dtype=np.int32)
    logprobs = rng.standard_exponential(SAMPLE_TOKENS, dtype=np.float32)
    np.negative(logprobs, out=logprobs)
    routing = rng.integers(0, EXPERTS, size=(SAMPLE_TOKENS, ROUTING_COLUMNS), dtype=np.int32)
    prompt = int(rng.integers(256, 2048))
    task = _task(index)
    description = {
        **task,
        "sample": index,
        "prompt_tokens": prompt,
        "response_tokens": SAMPLE_TOKENS - prompt,
        "reward": round(float(rng.random()), 6),
        "prompt_ids": tokens[:QUOTED_IDS].tolist(),
        "response_ids": tokens[prompt : prompt + QUOTED_IDS].tolist(),
        "pad": "",
    }
    description["pad"] = "." * max(0, JSON_RECORD_BYTES - len(encode(description)))
    return [
        Record("sample", encode(description), "json.v1", {**task, "kind": "sample"}, SAMPLE_TOKENS),
        _array_record("tokens", tokens, task),
        _array_record("logprobs", logprobs, task),
        _array_record("routing", routing, task),
    ]


def _array_record(name: str, array: npt.NDArray[Any], task: dict[str, str]) -> Record:
    metadata = {**task, "kind": name, "dtype": str(array.dtype), "shape": list(array.shape)}
    # ndarray.data is the zero-copy memoryview of the array.
    return Record(name, array.data, "bytes.v1", metadata)


def _payload_bytes(records: Sequence[Record]) -> int:
    return sum(memoryview(r.payload).nbytes for r in records)


Payload = bytes | bytearray | memoryview


def _same_payload(got: Payload, expected: Payload) -> bool:
    a = np.frombuffer(memoryview(got).cast("B"), dtype=np.uint8)
    b = np.frombuffer(memoryview(expected).cast("B"), dtype=np.uint8)
    return a.shape == b.shape and bool(np.array_equal(a, b))


def _compare(bench: Bench, phase: Phase, label: str, got: Sequence[Record], want: Sequence[Record]) -> None:
    if len(got) != len(want):
        bench.mismatch(phase, f"{label}: {len(got)} records read back, {len(want)} published")
        return
    for g, w in zip(got, want, strict=True):
        same = (g.record_id, g.codec, g.metadata, g.tokens) == (w.record_id, w.codec, w.metadata, w.tokens)
        if not same:
            bench.mismatch(phase, f"{label}: record {w.record_id!r} has a different id, codec or metadata")
        elif not _same_payload(g.payload, w.payload):
            bench.mismatch(phase, f"{label}: record {w.record_id!r} payload bytes differ")


def _read_back(bench: Bench, phase: Phase, label: str, ref: RecordSetRef) -> list[Record] | None:
    """Read one publication inside the phase's timer; a checksum or reference error is a mismatch."""
    try:
        with phase.timed():
            return list(bench.store.read(ref))
    except (CorruptData, InvalidReference) as error:
        bench.mismatch(phase, f"{label}: {type(error).__name__}: {error}")
        return None


# --------------------------------------------------------------------------- phases


def bulk_publish(bench: Bench) -> list[RecordSetRef]:
    target = bench.options.mib * MiB
    count = -(-target // _payload_bytes(sample_records(0)))
    refs: list[RecordSetRef] = []
    bar = bench.progress("bulk publish", count)
    with bench.phase("bulk publish") as phase:
        for index in range(count):
            records = sample_records(index)
            with phase.timed():
                refs.append(bench.store.publish(records, submission_id=f"bulk-{index}"))
            size = _payload_bytes(records)
            phase.volume += size
            phase.publications += 1
            bar.advance(1, size)
    bar.close()
    return refs


def bulk_verify(bench: Bench, refs: Sequence[RecordSetRef]) -> None:
    bar = bench.progress("bulk read-back", len(refs))
    with bench.phase("bulk read-back", verified=True) as phase:
        for index, ref in enumerate(refs):
            want = sample_records(index)
            got = _read_back(bench, phase, f"sample {index}", ref)
            if got is not None:
                _compare(bench, phase, f"sample {index}", got, want)
                phase.volume += _payload_bytes(got)
            phase.publications += 1
            bar.advance(1, _payload_bytes(want))
    bar.close()


def small_record(index: int) -> Record:
    payload = np.random.default_rng([SEED, 1, index]).bytes(SMALL_BYTES)
    return Record("event", payload, "bytes.v1", {**_task(index), "kind": "event"})


def small_publish(bench: Bench) -> list[tuple[int, RecordSetRef]]:
    count = bench.options.small
    published: list[tuple[int, RecordSetRef]] = []
    bar = bench.progress("small publish", count)
    with bench.phase("small publish") as phase:
        for index in range(count):
            record = small_record(index)
            with phase.timed():
                published.append((index, bench.store.publish([record], submission_id=f"small-{index}")))
            phase.volume += SMALL_BYTES
            phase.publications += 1
            bar.advance()
    bar.close()
    bar = bench.progress(f"small publish_many({SMALL_BATCH})", count)
    with bench.phase(f"small publish_many({SMALL_BATCH})") as phase:
        for first in range(count, 2 * count, SMALL_BATCH):
            indices = range(first, min(first + SMALL_BATCH, 2 * count))
            batch = [Publication((small_record(i),)) for i in indices]
            with phase.timed():
                refs = bench.store.publish_many(batch, submission_id=f"many-{first}")
            published.extend(zip(indices, refs, strict=True))
            phase.volume += SMALL_BYTES * len(batch)
            phase.publications += len(batch)
            bar.advance(len(batch))
    bar.close()
    return published


def small_verify(bench: Bench, published: Sequence[tuple[int, RecordSetRef]]) -> None:
    bar = bench.progress("small read-back", len(published))
    with bench.phase("small read-back", verified=True) as phase:
        for index, ref in published:
            got = _read_back(bench, phase, f"small {index}", ref)
            if got is not None:
                _compare(bench, phase, f"small {index}", got, [small_record(index)])
                phase.volume += _payload_bytes(got)
            phase.publications += 1
            bar.advance()
    bar.close()


def big_publication(bench: Bench) -> None:
    """Publish one large record and check the resident memory it costs (RSS vs max_buffer_bytes)."""
    size = bench.options.big_mib * MiB
    array = np.arange(size // 8, dtype=np.uint64)  # writes, so every page is resident
    array *= np.uint64(0x9E3779B97F4A7C15)  # golden-ratio mixing: no two slices look alike
    view = array.data.cast("B")
    rss_before = _rss_bytes()
    maxrss_before = _maxrss_bytes()
    hwm_reset = _reset_peak_rss()
    bar = bench.progress("large publish", 1)
    with bench.phase("large publish") as phase, phase.timed():
        ref = bench.store.publish([Record("big", view, "bytes.v1", _task(0))], submission_id="big")
    phase.volume, phase.publications = size, 1
    bar.advance(1, size)
    bar.close()
    maxrss_after = _maxrss_bytes()
    peak_after = _peak_rss_bytes() if hwm_reset else None
    peak = peak_after if peak_after is not None else maxrss_after
    increase = max(0, peak - rss_before) if rss_before is not None else None
    limit = bench.store.max_buffer_bytes
    bench.memory = {
        "array_bytes": size,
        "rss_before_bytes": rss_before,
        "ru_maxrss_before_bytes": maxrss_before,
        "ru_maxrss_after_bytes": maxrss_after,
        "peak_rss_after_bytes": peak_after,
        "method": "VmHWM reset before publish" if peak_after is not None else "ru_maxrss",
        "peak_increase_bytes": increase,
        "max_buffer_bytes": limit,
        "passed": None if increase is None else increase <= limit,
    }
    if increase is not None and increase > limit:
        bench.problems.append(
            f"large publish: resident memory grew by {increase / MiB:.1f} MiB while publishing "
            f"{size / MiB:.0f} MiB, more than max_buffer_bytes ({limit / MiB:.0f} MiB)"
        )
    big_read_back(bench, ref, view)


def big_read_back(bench: Bench, ref: RecordSetRef, expected: memoryview) -> None:
    size = expected.nbytes
    record: RecordRef = bench.store.validate(ref)[0]
    step = max(1, size // RANGE_SLICES)
    length = min(MiB + 3, size)
    starts = sorted({min(size - length, i * step + i * 4099) for i in range(RANGE_SLICES)} | {size - length})
    full = size <= FULL_READ_MIB_MAX * MiB
    bar = bench.progress("large read-back", len(starts) + full)
    with bench.phase("large read-back", verified=True) as phase:
        for start in starts:
            label = f"large read_range {start}:{start + length}"
            try:
                with phase.timed():
                    got = bench.store.read_range(record, start, start + length)
            except CorruptData as error:
                bench.mismatch(phase, f"{label}: {error}")
                continue
            if not _same_payload(got, expected[start : start + length]):
                bench.mismatch(phase, f"{label}: bytes differ")
            phase.volume += length
            phase.publications += 1
            bar.advance(1, length)
        if full:
            got_all = _read_back(bench, phase, "large full read", ref)
            if got_all is not None:
                _compare(
                    bench, phase, "large full read", got_all, [Record("big", expected, "bytes.v1", _task(0))]
                )
                phase.volume += size
            phase.publications += 1
            bar.advance(1, size)
    bar.close()


# --------------------------------------------------------------------------- machine facts


def _rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm", "rb") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _maxrss_bytes() -> int:
    # ru_maxrss is in KiB on Linux (bytes on macOS).
    scale = 1 if sys.platform == "darwin" else KiB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) so the next reading covers only what follows."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
    except OSError:
        return False
    return _peak_rss_bytes() is not None


def _peak_rss_bytes() -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * KiB
    except (OSError, ValueError, IndexError):
        pass
    return None


def filesystem_of(path: str | os.PathLike[str]) -> dict[str, str]:
    """Mount point, type and device of the filesystem holding ``path`` (from /proc/mounts)."""
    real = os.path.realpath(path)
    best = {"mount": "?", "type": "unknown", "device": "?"}
    try:
        with open("/proc/mounts", encoding="utf-8", errors="replace") as handle:
            lines = handle.read().splitlines()
    except OSError:
        return best
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        mount = fields[1].encode().decode("unicode_escape")  # /proc/mounts escapes spaces as \040
        inside = real == mount or real.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best["mount"].replace("?", "")):
            best = {"mount": mount, "type": fields[2], "device": fields[0]}
    return best


def straw_version() -> str:
    try:
        return importlib.metadata.version("straw")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def machine_facts(root: str) -> dict[str, Any]:
    return {
        "cpus": os.cpu_count() or 0,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "straw": straw_version(),
        "numpy": np.__version__,
        "filesystem": filesystem_of(root),
    }


def pool_facts(store: SharedFilesystemStore) -> dict[str, Any]:
    root = Path(store.backend.root)
    # Data files only: each writer directory also holds its liveness lock file (docs/GC.md).
    raw_files = sum(1 for p in (root / "raw").rglob("*") if p.is_file() and p.suffix in (".pack", ".seg"))
    apparent = allocated = 0
    for path in root.rglob("*"):
        if path.is_file():
            stat = path.stat()
            apparent += stat.st_size
            allocated += stat.st_blocks * 512
    metrics = store.metrics
    return {
        "files_under_raw": raw_files,
        "files_created": store.backend.metrics["files_created"],
        "packs_created": metrics["packs_created"],
        "bytes_written": metrics["bytes_written"],
        "bytes_apparent": apparent,
        "bytes_on_disk": allocated,
        "fsyncs": store.backend.metrics["syncs"],
    }


# --------------------------------------------------------------------------- summary


def _size(nbytes: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", KiB)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"


def _number(value: float) -> str:
    """Three significant digits or more, never wider than needed (0.31, 12.4, 3236)."""
    if value >= 100:
        return f"{value:,.0f}"
    return f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def summary(report: dict[str, Any]) -> str:
    """The human-readable result table (well under 40 lines, under 100 columns)."""
    m = report["machine"]
    fs = m["filesystem"]
    opts = report["options"]
    rule = "-" * 99
    lines = [
        f"straw bench: straw {m['straw']}, Python {m['python']}, numpy {m['numpy']}, {m['cpus']} CPUs",
        f"pool {report['pool_root']}",
        f"  on {fs['type']} ({fs['device']} at {fs['mount']}), profile {opts['profile']}, "
        f"packs rotate at {opts['segment_mib']} MiB",
        "",
        f"{'phase':<24}{'volume':>10}{'pubs':>6}{'MiB/s':>8}{'ops/s':>9}"
        f"{'p50 ms':>8}{'p90 ms':>8}{'p99 ms':>8}{'max ms':>8}{'fsync/pub':>10}  check",
        rule,
    ]
    for p in report["phases"]:
        lat = p["latency_ms"]
        check = "-" if not p["verified"] else ("ok" if not p["mismatches"] else f"{p['mismatches']} BAD")
        lines.append(
            f"{p['name']:<24}{_size(p['volume_bytes']):>10}{p['publications']:>6}"
            f"{_number(p['throughput_mib_s']):>8}{_number(p['ops_s']):>9}{_number(lat['p50']):>8}"
            f"{_number(lat['p90']):>8}{_number(lat['p99']):>8}{_number(lat['max']):>8}"
            f"{p['fsyncs_per_publication']:>10.2f}  {check}"
        )
    pool = report["pool"]
    lines += [
        rule,
        "MiB/s and ops/s count time inside straw calls only; latency is per call (reads verify",
        f"checksums; one publish_many call carries {SMALL_BATCH} publications). Wall time "
        f"{report['wall_seconds']:.1f} s.",
        f"pack files under raw/: {pool['files_under_raw']} (files_created {pool['files_created']}, "
        f"packs {pool['packs_created']}), on disk {_size(pool['bytes_on_disk'])}, fsyncs {pool['fsyncs']}",
    ]
    mem = report["memory"]
    if mem:
        increase = mem["peak_increase_bytes"]
        verdict = {True: "PASS", False: "FAIL", None: "n/a"}[mem["passed"]]
        grown = "unknown" if increase is None else _size(increase)
        lines.append(
            f"large publication of {_size(mem['array_bytes'])}: peak RSS +{grown} while publishing, "
            f"limit {_size(mem['max_buffer_bytes'])} (max_buffer_bytes): {verdict}"
        )
    v = report["verification"]
    lines.append(
        f"verification: {v['checked']} reads compared byte for byte, {v['mismatches']} mismatches: "
        + ("PASS" if v["passed"] else "FAIL")
    )
    lines += [f"  problem: {problem}" for problem in v["problems"][:5]]
    return "\n".join(lines)


# --------------------------------------------------------------------------- running


class UsageError(Exception):
    """An option combination or file the benchmark cannot use (exit code 2)."""


def _backend(options: argparse.Namespace, pool: str) -> FilesystemBackend:
    declaration = None
    if options.declaration:
        try:
            with open(options.declaration, encoding="utf-8") as handle:
                declaration = json.load(handle)
        except (OSError, ValueError) as error:
            raise UsageError(f"cannot read --declaration {options.declaration}: {error}") from None
    try:
        return FilesystemBackend(pool, profile=options.profile, declaration=declaration)
    except ValueError as error:
        raise UsageError(str(error)) from None


def _make_pool_dir(options: argparse.Namespace) -> str:
    """A fresh, empty ``straw-bench-*`` directory under ``--root`` (or the temporary directory)."""
    parent = options.root if options.root else tempfile.gettempdir()
    if not os.path.isdir(parent):
        raise UsageError(f"--root {parent} is not an existing directory")
    try:
        return tempfile.mkdtemp(prefix="straw-bench-", dir=parent)
    except OSError as error:
        raise UsageError(f"cannot create a pool directory in {parent}: {error}") from None


def _measure(bench: Bench) -> None:
    refs = bulk_publish(bench)
    bulk_verify(bench, refs)
    if bench.options.small:
        small_verify(bench, small_publish(bench))
    if bench.options.big_mib:
        big_publication(bench)


def _report(bench: Bench, pool: str, wall: float) -> dict[str, Any]:
    phases = [p.as_dict() for p in bench.phases]
    mismatches = sum(p.mismatches for p in bench.phases)
    memory_ok = bench.memory.get("passed") is not False
    options = {k: v for k, v in vars(bench.options).items() if k not in ("handler", "command")}
    return {
        "version": 1,
        "machine": machine_facts(pool),
        "options": options,
        "pool_root": pool,
        "wall_seconds": round(wall, 3),
        "phases": phases,
        "pool": pool_facts(bench.store),
        "memory": bench.memory,
        "verification": {
            "checked": sum(p.publications for p in bench.phases if p.verified),
            "mismatches": mismatches,
            "memory_ok": memory_ok,
            "passed": mismatches == 0 and memory_ok and not bench.problems,
            "problems": bench.problems,
        },
    }


def run(options: argparse.Namespace) -> int:
    """Run the benchmark described by parsed ``options``; returns the exit code."""
    try:
        pool = _make_pool_dir(options)
        try:
            backend = _backend(options, pool)
        except UsageError:
            shutil.rmtree(pool, ignore_errors=True)
            raise
    except UsageError as error:
        print(f"straw bench: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    try:
        report = _run_in(pool, backend, options)
    except (QueueError, OSError) as error:
        print(f"straw bench: error: the run stopped: {type(error).__name__}: {error}", file=sys.stderr)
        return EXIT_ERROR
    finally:
        if options.keep:
            print(f"straw bench: pool kept at {pool}", file=sys.stderr)
        else:
            shutil.rmtree(pool, ignore_errors=True)
    print(summary(report), flush=True)
    if options.json:
        try:
            write_report(options.json, report)
        except (QueueError, OSError) as error:
            print(f"straw bench: error: cannot write --json {options.json}: {error}", file=sys.stderr)
            return EXIT_ERROR
    return EXIT_OK if report["verification"]["passed"] else EXIT_FAILED


def _run_in(pool: str, backend: FilesystemBackend, options: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    store = SharedFilesystemStore(
        pool, "bench", backend=backend, segment_target_bytes=options.segment_mib * MiB
    )
    with store:
        bench = Bench(store, options)
        _measure(bench)
    # Counted after close, so the seal of the last pack is on disk too.
    return _report(bench, pool, time.perf_counter() - started)


#: Subcommands of ``straw-benchmark`` / ``python -m straw.benchmark`` (the peer's entry point);
#: without one, the arguments are those of ``straw bench``.
SUBCOMMANDS = ("profile", "run", "worker")


def _subcommand(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="straw-benchmark", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    extract = sub.add_parser("profile", help="a workload profile from a directory of I/O traces")
    extract.add_argument("--trace", required=True, help="directory of STRAW_TRACE_DIR files")
    extract.add_argument("--output", required=True, help="profile JSON to write")
    local.add_run_arguments(sub.add_parser("run", help="the queue benchmark on this host (--local)"))
    local.add_worker_arguments(sub.add_parser("worker", help="(started by run) one worker process"))
    args = parser.parse_args(argv)
    if args.command == "profile":
        try:
            profile(args)
        except (ValueError, OSError, QueueError) as error:
            print(f"straw-benchmark profile: error: {error}", file=sys.stderr)
            return EXIT_ERROR
        return EXIT_OK
    return int(local.run(args) if args.command == "run" else local.worker(args))


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m straw.benchmark [options]`` (``straw bench``), or a subcommand of SUBCOMMANDS."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments and arguments[0] in SUBCOMMANDS:
        return _subcommand(arguments)
    return run(build_parser("python -m straw.benchmark").parse_args(arguments))


if __name__ == "__main__":
    sys.exit(main())
