"""``straw demo``: the end-to-end RL job, its live progress, its summary and its plot.

The command supervises the job (``straw.rollout.demo.job``) as a child process in a session
of its own: the child writes one JSON event per line on its standard output (lines starting
with ``@straw-demo``), its logs and Ray's go to ``<dir>/job.log``, and this process renders
the events: a live progress bar per step, then a summary table, the step time split and a
PNG plot. ``--kill-at-step K`` SIGKILLs every process of the child's session (the driver, the
Ray nodes and their workers) during step K, starts the job again in place and prints what
the restart recovered. Events of every run are kept in ``<dir>/events.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["DESCRIPTION", "EXIT_CODES", "add_arguments", "run"]

EVENT_PREFIX = "@straw-demo "

DESCRIPTION = """\
Run a complete, fully asynchronous RL job on this machine: a local Ray cluster on 127.0.0.1
(generation workers on every node, two data-parallel trainer ranks), a small mixture-of-experts
policy learning a copy task with GRPO on the CPU, and every prompt, partial rollout, accepted
group, training batch and weight update going through a straw pool. The pool, the save
directory (joint checkpoints), the prompt set, the job's log, the events and the plot stay in
--dir afterwards: try `straw inspect <dir>/pool` and `straw inspect --save <dir>/save`.
"""

EXIT_CODES = """\
exit codes:
  0  the job trained every step
  1  the job failed (the tail of <dir>/job.log is printed)
  2  bad arguments
"""

#: How long the supervisor waits for a killed session's processes to be gone.
KILL_WAIT_S = 30.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from straw.rollout.demo.job import DemoSettings

    d = DemoSettings()
    parser.add_argument("--steps", type=int, default=d.steps, help=f"rollout steps (default {d.steps})")
    parser.add_argument(
        "--nodes", type=int, default=d.nodes, help=f"Ray nodes on 127.0.0.1 (default {d.nodes})"
    )
    parser.add_argument("--dir", default=d.directory, help=f"where everything goes (default ./{d.directory})")
    parser.add_argument(
        "--pool", default=None, help="the straw pool, e.g. on a JuiceFS mount (default <dir>/pool)"
    )
    parser.add_argument("--save", default=None, help="the job's save directory (default <dir>/save)")
    parser.add_argument("--online-gc", action="store_true", help="reclaim pool space while the job runs")
    parser.add_argument(
        "--storage-declaration", default=None, metavar="FILE",
        help="for a JuiceFS pool: JSON of the mount's verified settings; selects the juicefs profile",
    )  # fmt: skip
    parser.add_argument(
        "--kill-at-step", type=int, default=None, metavar="K",
        help="SIGKILL the whole job during step K (>= 1), restart it in place from its last checkpoint",
    )  # fmt: skip
    parser.add_argument("--save-interval", type=int, default=d.save_interval, help="checkpoint every N steps")
    parser.add_argument("--prompts-per-step", type=int, default=d.prompts_per_step)
    parser.add_argument("--samples-per-prompt", type=int, default=d.samples_per_prompt)
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument(
        "--decode-seconds", type=float, default=d.decode_seconds, metavar="S",
        help=f"seconds per decoding step of the policy's engine, as on a serving engine "
        f"(default {d.decode_seconds}; 0: as fast as the CPU computes)",
    )  # fmt: skip
    parser.add_argument("--fresh", action="store_true", help="delete an earlier job in --dir first")
    # For the tests: a fake engine, no Ray, a reward log, and the child mode itself.
    parser.add_argument("--engine", choices=("policy", "copy"), default=d.engine, help=argparse.SUPPRESS)
    parser.add_argument("--local", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--reward-log", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--token-seconds", type=float, default=d.token_seconds, help=argparse.SUPPRESS)
    parser.add_argument("--no-plot", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--ray-address", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)


def _settings(options: argparse.Namespace) -> Any:
    from straw.rollout.demo.job import DemoSettings

    return DemoSettings(
        directory=options.dir,
        pool=options.pool,
        save=options.save,
        steps=options.steps,
        nodes=options.nodes,
        prompts_per_step=options.prompts_per_step,
        samples_per_prompt=options.samples_per_prompt,
        save_interval=options.save_interval,
        online_gc=options.online_gc,
        engine=options.engine,
        distributed=not options.local,
        seed=options.seed,
        token_seconds=options.token_seconds,
        decode_seconds=options.decode_seconds,
        reward_log=os.path.abspath(options.reward_log) if options.reward_log else None,
        storage_declaration=os.path.abspath(options.storage_declaration)
        if options.storage_declaration
        else None,
    )


def run(options: argparse.Namespace) -> int:
    try:
        settings = _settings(options)
        if options.kill_at_step is not None and not 1 <= options.kill_at_step < options.steps:
            raise ValueError("--kill-at-step K needs 1 <= K < --steps (step 0's checkpoint is the first)")
    except ValueError as error:
        print(f"straw demo: {error}", file=sys.stderr)
        return 2
    if options.child:
        return _child(settings, options)
    return _supervise(settings, options)


def _child(settings: Any, options: argparse.Namespace) -> int:
    """The job itself: events on stdout, everything else (logging) on stderr."""
    import logging

    from straw.rollout.demo.job import LocalBackend, run_job

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    def emit(event: dict[str, Any]) -> None:
        print(EVENT_PREFIX + json.dumps(event), flush=True)

    if settings.distributed:
        from straw.cli.demo_cluster import RayBackend

        run_job(settings, emit, RayBackend(settings.nodes, address=options.ray_address))
    else:
        run_job(settings, emit, LocalBackend())
    return 0


# --------------------------------------------------------------------------- supervising


def _spawn(options: argparse.Namespace, log: Path) -> subprocess.Popen[str]:
    """Start the job in a session of its own, so that killing it reaches every process it made."""
    command = [sys.executable, "-m", "straw.cli", *_argv(options), "--child"]
    with open(log, "a", encoding="utf-8") as err:
        return subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True, bufsize=1
        )


def _argv(options: argparse.Namespace) -> list[str]:
    """The child's command line: the same settings, spelled out."""
    argv = ["demo", "--dir", options.dir, "--steps", str(options.steps), "--nodes", str(options.nodes)]
    argv += ["--save-interval", str(options.save_interval), "--seed", str(options.seed)]
    argv += ["--prompts-per-step", str(options.prompts_per_step)]
    argv += ["--samples-per-prompt", str(options.samples_per_prompt), "--engine", options.engine]
    argv += ["--token-seconds", str(options.token_seconds), "--decode-seconds", str(options.decode_seconds)]
    for flag, value in (
        ("--pool", options.pool),
        ("--save", options.save),
        ("--reward-log", options.reward_log),
        ("--storage-declaration", options.storage_declaration),
    ):
        if value:
            argv += [flag, os.path.abspath(value)]
    if options.online_gc:
        argv.append("--online-gc")
    if options.local:
        argv.append("--local")
    if options.ray_address:
        argv += ["--ray-address", options.ray_address]
    return argv


def session_processes(sid: int) -> list[int]:
    """Every process of session ``sid`` (read from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # gone meanwhile
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 3 and int(fields[3]) == sid:
            found.append(int(entry.name))
    return found


def kill_session(child: subprocess.Popen[str]) -> int:
    """SIGKILL every process of the child's session (the job's whole process tree)."""
    killed: set[int] = set()
    deadline = time.monotonic() + KILL_WAIT_S
    while time.monotonic() < deadline:  # bounded: processes may fork while we kill
        pids = [pid for pid in session_processes(child.pid) if pid not in killed or _alive(pid)]
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            except ProcessLookupError:
                pass
        child.poll()  # reap the direct child; the others are reaped by init
    child.wait(timeout=KILL_WAIT_S)
    return len(killed)


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a killed process lingers as a zombie until reaped)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return state[state.rfind(")") + 2 :].split()[0] != "Z"


def _supervise(settings: Any, options: argparse.Namespace) -> int:
    from straw.cli import demo_view

    root = settings.root
    if options.fresh and root.exists():
        import shutil

        shutil.rmtree(root)
    root.mkdir(parents=True, exist_ok=True)
    log = root / "job.log"
    view = demo_view.View(settings)
    started = time.monotonic()
    kill_at = options.kill_at_step
    with view.live(), open(root / "events.jsonl", "a", encoding="utf-8") as record:
        while True:  # at most two runs: the first, and the restart after a kill
            child = _spawn(options, log)
            killed = False
            stdout = child.stdout
            if stdout is None:  # pragma: no cover - stdout=PIPE
                raise RuntimeError("the job's output pipe is missing")
            for line in stdout:
                if not line.startswith(EVENT_PREFIX):
                    continue
                event = json.loads(line[len(EVENT_PREFIX) :])
                record.write(json.dumps(event) + "\n")
                record.flush()
                view.handle(event)
                if kill_at is not None and event["event"] == "generated" and event["step"] == kill_at:
                    count = kill_session(child)
                    view.killed(kill_at, count)
                    killed, kill_at = True, None
                    break
            code = child.wait()
            if not killed:
                break
    if code != 0:
        print(f"straw demo: the job failed (exit {code}); the end of {log}:", file=sys.stderr)
        print(_tail(log), file=sys.stderr)
        return 1
    view.finish(time.monotonic() - started, plot=not options.no_plot)
    return 0


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])
    except OSError as error:
        return f"(cannot read it: {error})"
