"""Line-based talk with child processes, shared by the crash and JuiceFS test files.

A child prints one line per acknowledged event (flushed); the parent reads them one at a
time. A child that ends before finishing a line fails the test with its stderr tail, and
every wait is bounded by ``CHILD_TIMEOUT_S`` so a hang fails one test, not the suite.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

#: Bound on any wait for a child process.
CHILD_TIMEOUT_S = 60.0


def start(program: Path, *args: str) -> subprocess.Popen[str]:
    """Run ``python <program> <args>`` with text pipes on stdin, stdout and stderr."""
    return subprocess.Popen(
        [sys.executable, str(program), *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


class KillAt:
    """A fault hook (``FilesystemBackend(fault=...)``) that sends its own process ``SIGKILL``
    the ``nth`` time ``phase`` is reached while ``armed`` (a child arms it after its setup)."""

    def __init__(self, phase: str, *, nth: int = 1, armed: bool = True) -> None:
        self.phase = phase
        self.nth = nth
        self.armed = armed
        self.hits = 0

    def __call__(self, reached: str) -> None:
        if self.armed and reached == self.phase:
            self.hits += 1
            if self.hits == self.nth:
                os.kill(os.getpid(), signal.SIGKILL)


def read_line(process: subprocess.Popen[str], who: str = "child") -> str:
    """The child's next complete line; its stderr in the failure if it ended first."""
    assert process.stdout is not None
    line = process.stdout.readline()
    if not line.endswith("\n"):
        process.kill()
        _, err = process.communicate(timeout=CHILD_TIMEOUT_S)
        raise AssertionError(f"{who} ended early (rc={process.returncode}): {err[-3000:]}")
    return line


def send(process: subprocess.Popen[str], line: str, who: str = "child") -> None:
    """Send one line; a child that already ended fails with its exit code and stderr."""
    assert process.stdin is not None
    try:
        process.stdin.write(line)
        process.stdin.flush()
    except BrokenPipeError:
        process.kill()
        _, err = process.communicate(timeout=CHILD_TIMEOUT_S)
        raise AssertionError(f"{who} ended early (rc={process.returncode}): {err[-3000:]}") from None


def exchange(process: subprocess.Popen[str], line: str) -> str:
    """Send one line to a child and wait for its one-line answer."""
    send(process, line)
    return read_line(process)


@contextlib.contextmanager
def children(*processes: subprocess.Popen[str]) -> Iterator[None]:
    """Kill whichever of ``processes`` still run when the block ends, however it ends."""
    try:
        yield
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=CHILD_TIMEOUT_S)
