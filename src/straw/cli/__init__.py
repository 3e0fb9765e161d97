"""The ``straw`` command (console script ``straw = "straw.cli:main"``).

Subcommands:

* ``straw bench``: benchmark and verify a pool on one filesystem (``straw.benchmark``).

``straw`` alone prints this help; ``straw --version`` prints the installed version.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from straw import benchmark

__all__ = ["build_parser", "main"]


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
    bench = commands.add_parser(
        "bench",
        help="benchmark and verify a pool: bulk, small and large publications, read-back, memory",
        description=benchmark.DESCRIPTION,
        epilog=benchmark.EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    benchmark.add_arguments(bench)
    bench.set_defaults(handler=benchmark.run)
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
