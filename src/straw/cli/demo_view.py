"""What ``straw demo`` shows: the live progress bar, the summary table, the split and the plot.

:class:`View` takes the job's events (``straw.rollout.demo.job``): ``start`` (and what a
restart recovered), ``step`` (one per trained step; a step trained again after a restart
replaces the earlier figures) and ``final``. rich draws the bar and the tables (plain lines
when the output is not a terminal); matplotlib (Agg, no display) draws the plot.
"""

from __future__ import annotations

import contextlib
import json
import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from straw.rollout.demo.job import PHASES

__all__ = ["View", "write_plot"]


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover - the loop returns


class View:
    """Renders the events of one demo (across restarts)."""

    def __init__(self, settings: Any, console: Console | None = None) -> None:
        self.settings = settings
        self.console = console or Console()
        self.steps: dict[int, dict[str, Any]] = {}
        self.runs: list[dict[str, Any]] = []
        self.final: dict[str, Any] | None = None
        self.progress = Progress(
            TextColumn("[bold]step"),
            MofNCompleteColumn(),
            BarColumn(),
            TextColumn("{task.fields[line]}"),
            TimeElapsedColumn(),
            console=self.console,
            transient=False,
        )
        self.task = self.progress.add_task("steps", total=settings.steps, line="starting the job…")

    @contextlib.contextmanager
    def live(self) -> Iterator[None]:
        with self.progress:
            yield

    def handle(self, event: dict[str, Any]) -> None:
        kind = event["event"]
        if kind == "start":
            self.runs.append(event)
            self._started(event)
        elif kind == "step":
            self.steps[int(event["step"])] = event
            self.progress.update(self.task, completed=len(self.steps), line=self._line(event))
            if not self.console.is_terminal:
                self.console.print(f"step {event['step']:>3}  {self._line(event)}")
        elif kind == "final":
            self.final = event

    def _started(self, event: dict[str, Any]) -> None:
        if len(self.runs) == 1:
            self.console.print(
                f"straw demo: {event['nodes']} Ray node(s) on 127.0.0.1, {event['dp_size']} trainer ranks; "
                f"pool {event['pool']}, save {event['save']}"
            )
        recovered = event["recovered"]
        if recovered["mode"] != "new":
            self.console.print(
                f"[bold]restarted[/bold] ({recovered['mode']} from step {recovered['step']}), "
                f"continuing at step {event['first_step']}: "
                f"accepted groups reused {recovered['accepted_reused']}, "
                f"partials continued {recovered['partials_pending']}, "
                f"prompts re-issued {recovered['reissued']}"
            )

    def killed(self, step: int, processes: int) -> None:
        self.console.print(
            f"[bold red]killed[/bold red] the whole job during step {step} ({processes} processes, SIGKILL); "
            "restarting in place"
        )

    @staticmethod
    def _line(e: dict[str, Any]) -> str:
        return (
            f"reward {e['mean_reward']:.3f}  "
            f"staleness max {e['staleness_max']} mean {e['staleness_mean']:.2f}  "
            f"{e['groups_per_s']:.1f} groups/s  partials continued {e['partials_continued']}  "
            f"pool {e['packs']} packs {_bytes(e['pool_bytes'])}"
        )

    # ------------------------------------------------------------------ the end

    def summary(self, wall: float) -> dict[str, Any]:
        steps = [self.steps[k] for k in sorted(self.steps)]
        rewards = [s["mean_reward"] for s in steps]
        split = {p: statistics.fmean(s["times"].get(p, 0.0) for s in steps) for p in PHASES} if steps else {}
        return {
            "wall_seconds": wall,
            "steps": len(steps),
            "first3_reward": statistics.fmean(rewards[:3]) if rewards else None,
            "last3_reward": statistics.fmean(rewards[-3:]) if rewards else None,
            "mean_step_seconds": statistics.fmean(s["seconds"] for s in steps) if steps else None,
            "step_split_seconds": split,
            "staleness_max": max((s["staleness_max"] for s in steps), default=0),
            "partials_continued": sum(s["partials_continued"] for s in steps),
            "restarts": len(self.runs) - 1,
            "recovered": [r["recovered"] for r in self.runs[1:]],
            "pool_packs": steps[-1]["packs"] if steps else 0,
            "pool_bytes": steps[-1]["pool_bytes"] if steps else 0,
            "per_step": [
                {k: s[k] for k in ("step", "mean_reward", "staleness_max", "staleness_mean", "groups_per_s")}
                for s in steps
            ],
        }

    def finish(self, wall: float, *, plot: bool = True) -> dict[str, Any]:
        root = self.settings.root
        summary = self.summary(wall)
        (root / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
        if not self.steps:
            self.console.print(
                f"nothing to train: the job in {root} has trained {self.settings.steps} steps already "
                "(raise --steps to go on, or --fresh to start over)"
            )
            return summary
        self.console.print(self._table(summary))
        self.console.print(self._split(summary))
        if plot:
            path = write_plot([self.steps[k] for k in sorted(self.steps)], root / "demo.png")
            self.console.print(f"plot: {path}")
        self.console.print(f"summary: {root / 'summary.json'}")
        pool, save = self.settings.pool_dir, self.settings.save_dir
        self.console.print(f"look inside: straw inspect {pool}  |  straw inspect --save {save}")
        return summary

    @staticmethod
    def _table(summary: dict[str, Any]) -> Table:
        table = Table(title="straw demo: summary")
        table.add_column("figure")
        table.add_column("value", justify="right")
        rows = [
            ("wall time", f"{summary['wall_seconds']:.1f} s"),
            ("steps trained", str(summary["steps"])),
            ("mean reward, first 3 steps", f"{summary['first3_reward']:.3f}"),
            ("mean reward, last 3 steps", f"{summary['last3_reward']:.3f}"),
            ("mean step time", f"{summary['mean_step_seconds']:.2f} s"),
            ("staleness max", str(summary["staleness_max"])),
            ("partials continued", str(summary["partials_continued"])),
            ("restarts", str(summary["restarts"])),
            ("pool", f"{summary['pool_packs']} packs, {_bytes(summary['pool_bytes'])}"),
        ]
        for name, value in rows:
            table.add_row(name, value)
        return table

    @staticmethod
    def _split(summary: dict[str, Any]) -> Table:
        split = summary["step_split_seconds"]
        total = sum(split.values()) or 1.0
        table = Table(title="step time split (mean per step)")
        for phase in PHASES:
            table.add_column(phase, justify="right")
        table.add_row(*(f"{split[p] * 1000:.0f} ms ({split[p] / total:.0%})" for p in PHASES))
        return table


def write_plot(steps: list[dict[str, Any]], path: Path) -> Path:
    """Reward, staleness and throughput per step, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    x = [s["step"] for s in steps]
    figure, axes = pyplot.subplots(3, 1, figsize=(7, 8), sharex=True)
    axes[0].plot(x, [s["mean_reward"] for s in steps], marker="o")
    axes[0].set_ylabel("mean reward")
    axes[1].plot(x, [s["staleness_max"] for s in steps], label="max", marker=".")
    axes[1].plot(x, [s["staleness_mean"] for s in steps], label="mean", marker=".")
    axes[1].set_ylabel("staleness (versions)")
    axes[1].legend()
    axes[2].plot(x, [s["groups_per_s"] for s in steps], marker=".")
    axes[2].set_ylabel("groups/s")
    axes[2].set_xlabel("step")
    figure.suptitle("straw demo: GRPO on the copy task")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    pyplot.close(figure)
    return path
