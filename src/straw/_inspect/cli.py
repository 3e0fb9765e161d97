"""Argument parsing and handlers of ``straw inspect`` and ``straw check`` (printing lives here)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..errors import QueueError
from .check import CheckReport, check_pool
from .layout import NotAPool, open_pool
from .render import render_check, render_inspect, render_why
from .repair import RepairRefused, forget_owner, rebuild_catalog
from .save_view import inspect_save, render_save
from .view import UnknownPack, inspect_pool, why

CHECK_DESCRIPTION = """\
Verify a pool: every pack frame and checksum, every journal and catalog frame,
that every live root of every queue is owned and every owned pack exists.
Read-only unless --fix, which only makes repairs that cannot lose acknowledged
data (docs/CHECK.md): finishing the unlink of a tombstoned pack, zeroing a torn
journal or catalog tail, recording a queue root its queue's owner lost. Journals
of queues whose coordinator is alive are never touched.

Explicit repairs (docs/CHECK.md), only with every writer and coordinator stopped:
--rebuild-catalog --owner NAME [--owner NAME ...] replaces a missing, damaged or
shortened catalog with one where every queue owns exactly its roots and each
listed owner keeps every pack on disk (nothing is dropped; retain or release
them again afterwards); --forget-owner OWNER releases the owner of a queue whose
files are gone.
"""

CHECK_EXIT_CODES = """\
exit codes:
  0  clean (or every finding was repaired by --fix); notes of severity info may remain
  1  findings remain (errors, or repairable findings without --fix)
  2  cannot check: not a pool, unreadable, a foreign run (--run-id), or bad usage
"""

INSPECT_DESCRIPTION = """\
Describe a pool: packs (size, sealed or open, live and dead bytes, owners),
owners and what they retain, and every queue (tasks by state, leases with age
and holder, accepted commits, consumers and cursors, journal size and last
snapshot). Read-only; safe beside live writers and coordinators.

With --save DIR (and no POOL), describe a rollout job's save directory instead:
its joint commits (step, intact files, bytes each retains in the pool) and what a
restart in place would select (--ckpt-step K: what that flag would select).
"""

INSPECT_EXIT_CODES = """\
exit codes:
  0  printed
  2  not a pool, unreadable, an unknown pack for --why, or bad usage
"""


def add_check_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("pool", help="the pool's root directory")
    parser.add_argument("--fix", action="store_true", help="make the safe repairs (docs/CHECK.md)")
    parser.add_argument("--run-id", metavar="RUN", help="assert that the pool belongs to run RUN")
    parser.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="list informational notes too (hidden from the table by default; --json has them all)",
    )
    repairs = parser.add_mutually_exclusive_group()
    repairs.add_argument(
        "--rebuild-catalog",
        action="store_true",
        help="replace a lost or damaged catalog (needs --owner; docs/CHECK.md)",
    )
    repairs.add_argument("--forget-owner", metavar="OWNER", help="release the owner of a lost queue")
    parser.add_argument(
        "--owner",
        action="append",
        default=[],
        metavar="NAME",
        help="with --rebuild-catalog: an owner that keeps every pack (repeatable)",
    )


def add_inspect_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("pool", nargs="?", help="the pool's root directory")
    parser.add_argument("--save", metavar="DIR", help="describe a rollout job's save directory instead")
    parser.add_argument(
        "--ckpt-step", type=int, metavar="K", help="with --save: what --ckpt-step K would select"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    parser.add_argument(
        "--why", metavar="PACK", help="explain why a pack (raw/<writer>/<segment>.pack) is kept"
    )


Outcome = tuple[int, str, str]  # exit code, text for stdout, text for stderr


def _fail(message: str) -> Outcome:
    return 2, "", f"straw: {message}"


def _json(document: Any) -> str:
    return json.dumps(document, indent=2, sort_keys=True)


def _explicit_repair(options: argparse.Namespace) -> str:
    """Run ``--rebuild-catalog`` or ``--forget-owner``; what it did, as a sentence ("" for none)."""
    if options.owner and not options.rebuild_catalog:
        raise RepairRefused("--owner is only meaningful with --rebuild-catalog")
    if options.rebuild_catalog:
        root = open_pool(options.pool)
        done = rebuild_catalog(root, options.owner)
        queues = ", ".join(f"{o} ({n} packs)" for o, n in sorted(done.queues.items())) or "none"
        kept = ", ".join(done.kept) or "nothing (no old catalog file)"
        return (
            f"straw: rebuilt the catalog: {', '.join(done.owners)} keep all {done.packs} packs; queue "
            f"owners with their roots: {queues}; the old catalog is kept as {kept}"
        )
    if options.forget_owner:
        packs = forget_owner(open_pool(options.pool), options.forget_owner)
        return f"straw: released owner {options.forget_owner} (it reached {packs} packs)"
    return ""


def run_check(options: argparse.Namespace) -> Outcome:
    """``straw check``; the command line prints the texts (no printing below straw/cli/)."""
    try:
        note = _explicit_repair(options)
    except NotAPool as error:
        return _fail(str(error))
    except RepairRefused as error:
        return _fail(f"repair refused: {error}")
    except (OSError, QueueError) as error:
        return _fail(f"cannot repair {options.pool}: {error}")
    try:
        report: CheckReport = check_pool(options.pool, fix=options.fix, run_id=options.run_id)
    except NotAPool as error:
        return _fail(str(error))
    except (OSError, QueueError) as error:
        return _fail(f"cannot check {options.pool}: {error}")
    if options.json:
        text = _json(report.to_json())
    else:
        text = render_check(report, fixed=options.fix, verbose=options.verbose)
    if report.foreign:
        return 2, text, f"straw: {options.pool} holds data of another run than {options.run_id!r}"
    return (0 if report.ok else 1), text, note


def run_inspect(options: argparse.Namespace) -> Outcome:
    """``straw inspect``."""
    if options.save is not None or options.pool is None:
        return _inspect_save(options)
    try:
        if options.why:
            answer = why(options.pool, options.why)
            return 0, _json(answer) if options.json else render_why(answer), ""
        data = inspect_pool(options.pool)
    except (NotAPool, UnknownPack) as error:
        return _fail(str(error))
    except (OSError, QueueError) as error:
        return _fail(f"cannot inspect {options.pool}: {error}")
    return 0, _json(data) if options.json else render_inspect(data), ""


def _inspect_save(options: argparse.Namespace) -> Outcome:
    if options.save is None or options.pool is not None or options.why:
        return _fail("give a POOL, or --save DIR alone (--why needs a POOL)")
    try:
        data = inspect_save(options.save, ckpt_step=options.ckpt_step)
    except NotAPool as error:
        return _fail(str(error))
    except (OSError, QueueError) as error:
        return _fail(f"cannot inspect {options.save}: {error}")
    return 0, _json(data) if options.json else render_save(data), ""
