"""Line-based talk with child processes, shared by the crash and JuiceFS test files.

A child prints one line per acknowledged event (flushed); the parent reads them one at a
time. A child that ends before finishing a line fails the test with its stderr tail, and
every wait is bounded by ``CHILD_TIMEOUT_S`` so a hang fails one test, not the suite.
"""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator

#: Bound on any wait for a child process.
CHILD_TIMEOUT_S = 60.0


def read_line(process: subprocess.Popen[str], who: str = "child") -> str:
    """The child's next complete line; its stderr in the failure if it ended first."""
    assert process.stdout is not None
    line = process.stdout.readline()
    if not line.endswith("\n"):
        process.kill()
        _, err = process.communicate(timeout=CHILD_TIMEOUT_S)
        raise AssertionError(f"{who} ended early (rc={process.returncode}): {err[-3000:]}")
    return line


def send(process: subprocess.Popen[str], line: str) -> None:
    assert process.stdin is not None
    process.stdin.write(line)
    process.stdin.flush()


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
