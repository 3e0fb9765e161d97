"""The ``straw`` command (console script ``straw = "straw.cli:main"``).

Subcommands:

* ``straw demo``: the end-to-end RL job on a local Ray cluster (``straw.cli.demo``).
* ``straw bench``: benchmark and verify a pool on one filesystem (``straw.benchmark``).
* ``straw inspect POOL``: describe packs, owners and queues (``straw._inspect``).
* ``straw check POOL [--fix]``: verify a pool and make only safe repairs (docs/CHECK.md).

``straw`` alone prints this help; ``straw --version`` prints the installed version.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

from straw import benchmark
from straw._inspect import cli as inspect_cli
from straw.cli import demo

__all__ = ["build_parser", "main"]


def _printing(
    run: Callable[[argparse.Namespace], inspect_cli.Outcome],
) -> Callable[[argparse.Namespace], int]:
    """A handler that prints what ``run`` returns: the report on stdout, messages on stderr."""

    def handler(options: argparse.Namespace) -> int:
        code, out, err = run(options)
        if out:
            print(out)
        if err:
            print(err, file=sys.stderr)
        return code

    return handler


def _command(
    commands: Any,
    name: str,
    summary: str,
    texts: tuple[str, str],
    add_arguments: Callable[[argparse.ArgumentParser], None],
    handler: Callable[[argparse.Namespace], int],
) -> None:
    """One subcommand: its one-line help, description and exit codes, options and handler."""
    description, exit_codes = texts
    command = commands.add_parser(
        name,
        help=summary,
        description=description,
        epilog=exit_codes,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(command)
    command.set_defaults(handler=handler)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="straw",
        description="straw: a durable shared-filesystem data plane for RL post-training.",
        epilog="Run 'straw COMMAND --help' for a command's options and exit codes.",
    )
    # The version comes from the installed distribution: the top-level package is a higher
    # layer than the command line (tests/test_tidy.py), so it is not imported here.
    parser.add_argument("--version", action="version", version=f"straw {benchmark.straw_version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    _command(
        commands,
        "demo",
        "run the end-to-end RL job: Ray on 127.0.0.1, GRPO on the CPU, everything through a straw pool",
        (demo.DESCRIPTION, demo.EXIT_CODES),
        demo.add_arguments,
        demo.run,
    )
    _command(
        commands,
        "bench",
        "benchmark and verify a pool: bulk, small and large publications, read-back, memory",
        (benchmark.DESCRIPTION, benchmark.EXIT_CODES),
        benchmark.add_arguments,
        benchmark.run,
    )
    _command(
        commands,
        "inspect",
        "describe a pool: packs, owners, queues (--json for tools, --why PACK)",
        (inspect_cli.INSPECT_DESCRIPTION, inspect_cli.INSPECT_EXIT_CODES),
        inspect_cli.add_inspect_arguments,
        _printing(inspect_cli.run_inspect),
    )
    _command(
        commands,
        "check",
        "verify every frame, checksum and owner of a pool; --fix makes only safe repairs",
        (inspect_cli.CHECK_DESCRIPTION, inspect_cli.CHECK_EXIT_CODES),
        inspect_cli.add_check_arguments,
        _printing(inspect_cli.run_check),
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``straw`` console script; returns the process exit code."""
    parser = build_parser()
    options = parser.parse_args(argv)
    if options.command is None:
        parser.print_help()
        return 0
    code: int = options.handler(options)
    return code
