"""Fixed-width tables for ``straw inspect`` and ``straw check`` (text only; no I/O)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .check import INFO, REPAIRABLE, CheckReport


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Columns padded to their widest cell, numbers right-aligned."""
    cells = [[str(h) for h in headers]] + [["-" if v is None else str(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    numeric = [all(isinstance(row[i], int) for row in rows) and bool(rows) for i in range(len(headers))]
    lines = []
    for row in cells:
        parts = [c.rjust(w) if n else c.ljust(w) for c, w, n in zip(row, widths, numeric, strict=True)]
        lines.append("  ".join(parts).rstrip())
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def size(value: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024  # type: ignore[assignment]
    return str(value)


def render_inspect(data: dict[str, Any]) -> str:
    totals = data["totals"]
    out = [
        f"pool {data['root']}",
        f"runs: {', '.join(data['run_ids']) or '(no queue names one)'}",
        f"packs: {totals['packs']}, {size(totals['bytes'])} ({size(totals['live_bytes'])} live, "
        f"{size(totals['dead_bytes'])} dead)",
        "",
        "PACKS",
        table(
            ("pack", "size", "state", "writer", "extents", "tail", "live", "dead", "owners"),
            [
                (
                    row["pack"],
                    row["size"],
                    row["state"],
                    {True: "alive", False: "dead", None: "-"}[row["writer_alive"]],
                    row["extents"],
                    row["tail"],
                    row["live_bytes"],
                    row["dead_bytes"],
                    ", ".join(row["owners"]) or "-",
                )
                for row in data["packs"]
            ],
        ),
        "",
        "OWNERS",
        table(
            ("owner", "packs", "bytes", "missing"),
            [(name, o["packs"], o["bytes"], o["missing"]) for name, o in data["owners"].items()],
        ),
    ]
    for queue in data["queues"]:
        out += ["", *render_queue(queue)]
    return "\n".join(out)


def render_queue(queue: dict[str, Any]) -> list[str]:
    journal = queue["journal"]
    out = [
        f"QUEUE {queue['queue_id']!r} ({queue['directory']}, run {queue['run_id']!r})",
        f"  journal: {size(journal['bytes'])} in {journal['segments']} segment(s), last frame "
        f"{journal['last_seq']}, last snapshot {journal['last_snapshot_seq'] or '-'}, tail {journal['tail']}",
    ]
    if queue.get("state", True) is None:
        return [*out, "  state: unreadable (see straw check)"]
    tasks = ", ".join(f"{k} {v}" for k, v in sorted(queue["tasks"].items())) or "none"
    out += [
        f"  epoch {queue['epoch']}, sealed {queue['sealed']}, draining {queue['draining']}",
        f"  tasks: {tasks}",
        f"  accepted commits: {queue['commits']}, outstanding reads: {queue['outstanding_reads']}",
        f"  checkpoints: {len(queue['checkpoints'])} (last {queue['last_checkpoint'] or '-'})",
    ]
    if queue["leases"]:
        rows = [
            (
                lease["task_id"],
                lease["worker_id"],
                lease["attempt_id"][:12],
                lease["epoch"],
                lease["age_seconds"],
                lease["frames_since_grant"],
            )
            for lease in queue["leases"]
        ]
        out += [
            "  leases:",
            _indent(table(("task", "holder", "attempt", "epoch", "age s", "frames since"), rows)),
        ]
    if queue["consumers"]:
        consumers: list[tuple[object, ...]] = [
            (
                name,
                c["owner"],
                "open" if c["open"] else "closed",
                ", ".join(f"{k}={v}" for k, v in c["cursors"].items()) or "-",
            )
            for name, c in queue["consumers"].items()
        ]
        out += ["  consumers:", _indent(table(("consumer", "owner", "state", "cursors"), consumers))]
    return out


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())


def render_why(answer: dict[str, Any]) -> str:
    lines = [
        f"pack {answer['pack']}",
        f"  on disk: {'yes, ' + size(answer['size']) if answer['exists'] else 'no'}",
        f"  sealed: {answer['sealed']}, writer {answer['writer']} "
        f"{'dead' if answer['writer_dead'] or not answer['writer_alive'] else 'alive'}, "
        f"staging over: {answer['staging_over']}, tombstoned: {answer['tombstoned']}",
    ]
    if answer["tombstoned"]:
        lines.append("  not retained: it is tombstoned (collected, or about to be unlinked)")
    elif answer["reasons"]:
        lines += ["  retained because:"] + [f"    - {reason}" for reason in answer["reasons"]]
    else:
        lines.append("  not retained: nothing keeps it; the next collection reclaims it")
    return "\n".join(lines)


def _short(path: str, message: str) -> str:
    """The message without a leading repetition of the path column."""
    for prefix in (f"{path}: ", f"{path} "):
        if path and message.startswith(prefix):
            return message[len(prefix) :]
    return message


def render_check(report: CheckReport, *, fixed: bool, verbose: bool = False) -> str:
    """The findings table; informational notes only with ``verbose`` (else counted in one line)."""
    lines = [f"checked {report.root}"]
    shown = [f for f in report.findings if verbose or f.severity != INFO]
    hidden = len(report.findings) - len(shown)
    if shown:
        done = set(report.repaired)
        rows = [
            (
                f.severity + (" (repaired)" if f in done else ""),
                f.code,
                f.path or "(pool)",
                _short(f.path, f.message),
            )
            for f in shown
        ]
        lines.append(table(("severity", "code", "path", "message"), rows))
    if hidden:
        lines.append(f"{hidden} informational note(s); --verbose shows them")
    remaining = report.remaining()
    repairable = [f for f in remaining if f.severity == REPAIRABLE]
    if report.ok:
        lines.append(
            "ok: " + (f"{len(report.repaired)} finding(s) repaired" if report.repaired else "no problems")
        )
    else:
        lines.append(f"{len(remaining)} problem(s) remain")
        if repairable and not fixed:
            lines.append(f"{len(repairable)} can be repaired safely: run 'straw check --fix'")
    return "\n".join(lines)
