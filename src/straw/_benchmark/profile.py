"""``straw-benchmark profile``: a workload profile from a directory of I/O traces.

The traces are the JSON lines ``straw.tracing`` writes (one file per process, any number of
hosts). The profile keeps the payload sizes of every publication, so ``run --profile`` can
replay the same shapes, and reports what the trace observed: bytes written and read, read
amplification of range reads (bytes checked per byte returned) and peak completion rates in
wall-clock windows. Rates credit an operation's bytes at its completion time, so they need
host clocks in step and say nothing of the filesystem's physical bandwidth.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from straw.limits import MiB
from straw.reporting import write_report

__all__ = ["build_profile", "load_events", "profile"]

#: Window lengths (seconds) of the peak completion rates.
WINDOWS_S = (1, 10)
#: Codec prefixes of manifests (ours, and the peer's in its traces): not payload.
_MANIFEST_CODECS = ("straw.", "record-set.")
_READS = ("read", "read_range")


def load_events(directory: str | Path) -> list[dict[str, Any]]:
    """Every event of every ``*.jsonl`` file in ``directory``; a line that is not an object is an error."""
    events = []
    for path in sorted(Path(directory).glob("*.jsonl")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            event = json.loads(line)
            if not isinstance(event, dict) or not {"op", "time", "bytes"} <= event.keys():
                raise ValueError(f"{path}:{number}: not a trace event (needs op, time and bytes)")
            events.append(event)
    return events


def _payload_sizes(event: Mapping[str, Any]) -> list[int]:
    return [
        int(r["bytes"]) for r in event.get("records", ()) if not str(r["codec"]).startswith(_MANIFEST_CODECS)
    ]


def _peak_mib_s(timed: Iterable[tuple[float, int]], window: int) -> float:
    """Largest byte total completed in one window aligned to the wall clock, in MiB/s."""
    buckets: dict[int, int] = {}
    for when, size in timed:
        bucket = int(when // window)
        buckets[bucket] = buckets.get(bucket, 0) + size
    return max(buckets.values(), default=0) / window / MiB


def _p99(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[int(0.99 * (len(ordered) - 1))] if ordered else 0.0


def build_profile(events: Sequence[Mapping[str, Any]], source: str = "") -> dict[str, Any]:
    """The profile of ``events``; ``ValueError`` when they hold no publication with payload."""
    writes = [e for e in events if e["op"] == "write"]
    reads = [e for e in events if e["op"] in _READS]
    publications = [sizes for sizes in map(_payload_sizes, writes) if sum(sizes) > 0]
    if not publications:
        raise ValueError("the trace holds no publication with payload bytes: nothing to profile")
    write_bytes = sum(int(e["bytes"]) for e in writes)
    read_bytes = sum(int(e["bytes"]) for e in reads)
    # Checked bytes are known only if every range read reported them (a full read checks what it returns).
    known = all(e["op"] != "read_range" or "checked_bytes" in e for e in reads)
    checked = sum(int(e.get("checked_bytes", e["bytes"])) for e in reads) if known else None
    payload_timed = [(float(e["time"]), sum(_payload_sizes(e))) for e in writes]
    rates = []
    for window in WINDOWS_S:
        rates.append(
            {
                "window_seconds": window,
                "write_peak_mib_s": _peak_mib_s(payload_timed, window),
                "extent_write_peak_mib_s": _peak_mib_s(((e["time"], e["bytes"]) for e in writes), window),
                "read_peak_mib_s": _peak_mib_s(((e["time"], e["bytes"]) for e in reads), window),
                "checked_read_peak_mib_s": (
                    _peak_mib_s(((e["time"], e.get("checked_bytes", e["bytes"])) for e in reads), window)
                    if known
                    else None
                ),
            }
        )
    times = [float(e["time"]) for e in events]
    return {
        "version": 1,
        "source_trace": source,
        "publications": publications,
        "observed_write_bytes": write_bytes,
        "observed_write_payload_bytes": sum(map(sum, publications)),
        "write_bytes_semantics": "bytes of the extents published (payload, framing, index, manifests)",
        "observed_read_bytes": read_bytes,
        "read_bytes_semantics": "payload bytes returned to readers",
        "checked_read_bytes": checked,
        "observed_seconds": max(times) - min(times),
        "hosts": sorted({str(e.get("host", "")) for e in events}),
        "read_to_extent_write_ratio": read_bytes / max(1, write_bytes),
        "checked_read_amplification": checked / read_bytes if checked is not None and read_bytes else None,
        "write_p99_seconds": _p99([float(e.get("seconds", 0.0)) for e in writes]),
        "payload_completion_rates": rates,
        "completion_rates_semantics": "bytes credited when each operation completed, in windows "
        "aligned to the wall clock (host clocks must agree); not the filesystem's bandwidth",
    }


def profile(args: argparse.Namespace) -> dict[str, Any]:
    """``profile --trace DIR --output FILE``: write the profile of a trace directory (and return it)."""
    trace = Path(args.trace)
    if not trace.is_dir():
        raise ValueError(f"--trace {trace} is not a directory of trace files")
    report = build_profile(load_events(trace), str(trace.resolve()))
    write_report(args.output, report)
    return report
