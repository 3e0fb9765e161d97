"""Mechanical checks of STYLE.md on the library source (src/straw/**/*.py).

Each test walks the syntax trees of every module and collects every violation, so one run
lists them all as ``path:line: what``. The rules and their reasons live in STYLE.md:

* no bare ``assert`` (``python -O`` strips it; use ``straw.errors.invariant``);
* no ``print`` outside the command line (``straw/cli/``, ``straw/benchmark.py``);
* no ``sleep`` outside ``straw/_fs/`` (bounded visibility retries live there; everything
  else injects the clock);
* durable publication primitives (rename, replace, fsync, link, flock) only in ``straw/_fs/``;
* lower layers never import upper ones, and the queue core imports no I/O, clock or randomness;
* every module has a docstring.
"""

from __future__ import annotations

import ast
import functools
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src"
PACKAGE = SRC / "straw"

# Layer of each top-level component of the straw package (STYLE.md, "Layout"). A module may
# import components of its own layer or below, never above.
LAYERS: dict[str, int] = {
    "errors": 0,
    "protocol": 0,
    "limits": 0,
    "backend": 1,
    "_fs": 1,
    # Handing the C heap's free pages back (malloc_trim), after a coordinator's snapshot.
    "_memory": 1,
    "reporting": 1,
    # Payload-free I/O traces (STRAW_TRACE_DIR): used by the store and tensors.
    "tracing": 1,
    "_pack": 2,
    # The journal's framing and the ownership catalog sit below the store: the store's
    # lifetime calls (retain, release, collect_garbage) are built on the catalog, which
    # reuses the journal's chained frames. (STYLE.md draws them at L4; see docs/GC.md.)
    "_journal": 2,
    "_catalog": 2,
    "store": 3,
    "tensor": 3,
    "codec": 3,
    "_queue": 5,
    "coordinator": 6,
    "rollout": 7,
    # Read-only inspection and checking of a pool (straw inspect, straw check; docs/CHECK.md).
    "_inspect": 7,
    # The peer's offline inspector and JSON control transport, on the public API and _inspect.
    "inspect": 7,
    "rpc": 7,
    "cli": 8,
    "benchmark": 8,
    "_benchmark": 8,
    "testing": 9,
    "__init__": 9,
    "__main__": 9,
}

# The queue is a pure state machine: no filesystem, no clock, no randomness (STYLE.md habit 1).
QUEUE_FORBIDDEN_COMPONENTS = frozenset({"_fs", "backend", "store"})
QUEUE_FORBIDDEN_STDLIB = frozenset({"os", "time", "random", "datetime", "uuid", "secrets"})

# Calls that make bytes durable or visible, allowed only in straw/_fs/ (STYLE.md habit 7).
# Methods on objects (Path.rename, an injected filesystem's .rename) are not matched: without
# types they cannot be told apart from the _fs abstraction that upper layers are meant to call.
FS_ONLY_CALLS: dict[str, frozenset[str]] = {
    "os": frozenset({"rename", "renames", "replace", "fsync", "fdatasync", "link", "sync"}),
    "fcntl": frozenset({"flock", "lockf"}),
    "shutil": frozenset({"move"}),
}


@dataclass(frozen=True)
class Module:
    """One parsed source file of the straw package."""

    path: Path
    parts: tuple[str, ...]  # dotted name, e.g. ("straw", "_pack", "writer")
    is_package: bool  # an __init__.py
    tree: ast.Module

    @property
    def shown(self) -> str:
        return self.path.relative_to(REPO).as_posix()

    @property
    def component(self) -> str:
        """Top-level component: straw._pack.writer -> "_pack"; straw/__init__.py -> "__init__"."""
        return self.parts[1] if len(self.parts) > 1 else "__init__"

    def at(self, node: ast.AST) -> str:
        return f"{self.shown}:{getattr(node, 'lineno', 0)}"

    def under(self, component: str) -> bool:
        return self.component == component


@functools.cache
def modules() -> tuple[Module, ...]:
    if not PACKAGE.is_dir():
        pytest.fail(
            f"{PACKAGE} does not exist: the library source must live in src/straw/ (src layout)",
            pytrace=False,
        )
    found: list[Module] = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(SRC).with_suffix("").parts
        is_package = rel[-1] == "__init__"
        parts = rel[:-1] if is_package else rel
        source = path.read_text(encoding="utf-8")
        try:
            tree = ast.parse(source, filename=str(path))
        except SyntaxError as exc:
            error = f"{path.relative_to(REPO).as_posix()}:{exc.lineno}: cannot parse: {exc.msg}"
        else:
            found.append(Module(path, parts, is_package, tree))
            continue
        pytest.fail(error, pytrace=False)
    return tuple(found)


def report(violations: list[str], rule: str) -> None:
    """Fail with every violation, ordered by file and line ("path:line: what")."""

    def where(line: str) -> tuple[str, int]:
        path, lineno, _ = line.split(":", 2)
        return path, int(lineno)

    if violations:
        ordered = sorted(violations, key=where)
        pytest.fail(f"{rule}:\n  " + "\n  ".join(ordered), pytrace=False)


def module_aliases(tree: ast.Module) -> dict[str, str]:
    """Local names bound by ``import x`` / ``import x as y`` -> module name."""
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    aliases[alias.asname] = alias.name
                else:
                    top = alias.name.split(".")[0]
                    aliases[top] = top
    return aliases


def calls(tree: ast.Module) -> Iterator[ast.Call]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            yield node


# ---------------------------------------------------------------- statements and calls


def test_no_bare_assert() -> None:
    found = [
        f"{m.at(node)}: bare assert (stripped by python -O); use straw.errors.invariant(cond, why)"
        for m in modules()
        for node in ast.walk(m.tree)
        if isinstance(node, ast.Assert)
    ]
    report(found, "bare assert in src/")


def test_no_print_outside_cli() -> None:
    found: list[str] = []
    for m in modules():
        if m.under("cli") or m.under("benchmark") or m.under("_benchmark"):  # command-line programs
            continue
        for call in calls(m.tree):
            if isinstance(call.func, ast.Name) and call.func.id == "print":
                found.append(f"{m.at(call)}: print() in library code; return data or raise instead")
    report(found, "print outside straw/cli/, straw/benchmark.py and straw/_benchmark/")


def test_no_sleep_outside_fs() -> None:
    found: list[str] = []
    for m in modules():
        if m.under("_fs"):
            continue
        for call in calls(m.tree):
            func = call.func
            if (isinstance(func, ast.Attribute) and func.attr == "sleep") or (
                isinstance(func, ast.Name) and func.id == "sleep"
            ):
                found.append(f"{m.at(call)}: sleep call; inject the clock (bounded waits live in _fs/)")
        for node in ast.walk(m.tree):
            if isinstance(node, ast.ImportFrom) and any(a.name == "sleep" for a in node.names):
                found.append(f"{m.at(node)}: imports sleep; inject the clock (bounded waits live in _fs/)")
    report(found, "sleep outside straw/_fs/")


def test_durable_primitives_only_in_fs() -> None:
    found: list[str] = []
    for m in modules():
        if m.under("_fs"):
            continue
        aliases = module_aliases(m.tree)
        for call in calls(m.tree):
            func = call.func
            if not isinstance(func, ast.Attribute):
                continue
            if isinstance(func.value, ast.Name):
                owner = aliases.get(func.value.id, func.value.id)
                if func.attr in FS_ONLY_CALLS.get(owner, ()):
                    found.append(f"{m.at(call)}: {owner}.{func.attr}() outside _fs/; use the _fs helpers")
        for node in ast.walk(m.tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in FS_ONLY_CALLS:
                for alias in node.names:
                    if alias.name in FS_ONLY_CALLS[node.module]:
                        found.append(f"{m.at(node)}: imports {node.module}.{alias.name} outside _fs/")
    report(found, "rename/replace/fsync/link/flock outside straw/_fs/ (STYLE.md habit 7)")


# Issue 11: recovery and `straw check` read a pool only through straw._fs (the seam FaultFS
# replaces), so check runs in the simulation and sees the files exactly as recovery does.
SEAM_READERS = frozenset({"_inspect", "_journal", "_catalog"})
# What of `os` such a module may use: path arithmetic, never a call that touches a file.
SEAM_OS_ALLOWED = frozenset({"path", "fspath", "sep", "PathLike", "sched_yield"})
SEAM_FORBIDDEN_IMPORTS = frozenset({"io", "pathlib", "shutil", "glob", "mmap"})
# `straw inspect --save DIR` reads a training job's save directory (the rollout layer's files
# beside the pool, docs/ROLLOUT.md), not the pool that check and recovery read.
SEAM_EXEMPT = frozenset({("straw", "_inspect", "save_view")})


def test_check_and_recovery_read_only_through_the_fs_seam() -> None:
    found: list[str] = []
    for m in modules():
        if m.component not in SEAM_READERS or m.parts in SEAM_EXEMPT:
            continue
        aliases = module_aliases(m.tree)
        for node in ast.walk(m.tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "open":
                found.append(f"{m.at(node)}: builtin open(); read through straw._fs.posix")
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                if aliases.get(node.value.id) == "os" and node.attr not in SEAM_OS_ALLOWED:
                    found.append(f"{m.at(node)}: os.{node.attr}; go through straw._fs")
            elif isinstance(node, ast.Import | ast.ImportFrom):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and node.module == "os":
                    names += [f"os.{a.name}" for a in node.names if a.name not in SEAM_OS_ALLOWED]
                for name in names:
                    if name.split(".")[0] in SEAM_FORBIDDEN_IMPORTS or name.startswith("os."):
                        found.append(f"{m.at(node)}: imports {name}; go through straw._fs")
    report(found, "file access outside the straw._fs seam in check or recovery (issue 11)")


def test_the_seam_rule_catches_violations(monkeypatch: pytest.MonkeyPatch) -> None:
    source = "import os\nimport pathlib\ndef f(p):\n    os.listdir(p)\n    return open(p).read()\n"
    fake = Module(PACKAGE / "_inspect" / "fake.py", ("straw", "_inspect", "fake"), False, ast.parse(source))
    monkeypatch.setattr(sys.modules[__name__], "modules", lambda: (fake,))
    with pytest.raises(pytest.fail.Exception) as failed:
        test_check_and_recovery_read_only_through_the_fs_seam()
    text = str(failed.value)
    assert "builtin open()" in text and "os.listdir" in text and "imports pathlib" in text


def test_every_module_has_a_docstring() -> None:
    found = [
        f"{m.shown}:1: no module docstring; say what the module is for"
        for m in modules()
        if not (ast.get_docstring(m.tree) or "").strip()
    ]
    report(found, "module without docstring")


# ---------------------------------------------------------------- layers


def named_component(name: str) -> str:
    """Component reached by ``from straw import name``: a submodule, else the package itself."""
    if name in LAYERS or (PACKAGE / name).is_dir() or (PACKAGE / f"{name}.py").is_file():
        return name
    return "__init__"


def straw_imports(m: Module, problems: list[str]) -> Iterator[tuple[ast.stmt, str]]:
    """Every import of a straw component in ``m``, at any depth, as (node, component).

    A relative import that climbs above the straw package is added to ``problems``.
    """
    for node in ast.walk(m.tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "straw":
                    yield node, parts[1] if len(parts) > 1 else "__init__"
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                base: tuple[str, ...] = ()
            else:
                package = m.parts if m.is_package else m.parts[:-1]
                keep = len(package) - (node.level - 1)
                if keep < 1:
                    problems.append(f"{m.at(node)}: relative import climbs above the straw package")
                    continue
                base = package[:keep]
            target = base + tuple(node.module.split(".")) if node.module else base
            if not target or target[0] != "straw":
                continue
            if len(target) > 1:
                yield node, target[1]
            else:
                for alias in node.names:
                    yield node, named_component(alias.name)


def shown_component(component: str) -> str:
    return "the straw package (__init__)" if component == "__init__" else component


def test_no_upward_imports() -> None:
    found: list[str] = []
    for m in modules():
        own = LAYERS.get(m.component)
        if own is None:
            found.append(
                f"{m.shown}:1: component {m.component!r} has no layer; add it to LAYERS in tests/test_tidy.py"
            )
            continue
        for node, component in straw_imports(m, found):
            if component == m.component:
                continue
            layer = LAYERS.get(component)
            if layer is None:
                found.append(
                    f"{m.at(node)}: imports component {component!r} that has no layer; "
                    "add it to LAYERS in tests/test_tidy.py"
                )
            elif layer > own:
                found.append(
                    f"{m.at(node)}: {m.component} (L{own}) imports {shown_component(component)} (L{layer}); "
                    "lower layers never import upper ones"
                )
    report(found, "upward import (STYLE.md, Layout)")


def test_queue_core_is_pure() -> None:
    found: list[str] = []
    for m in modules():
        if not m.under("_queue"):
            continue
        for node, component in straw_imports(m, found):
            if component in QUEUE_FORBIDDEN_COMPONENTS:
                found.append(
                    f"{m.at(node)}: _queue imports straw.{component}; effects belong to the coordinator"
                )
        for stmt in ast.walk(m.tree):
            if isinstance(stmt, ast.Import):
                names = [alias.name for alias in stmt.names]
            elif isinstance(stmt, ast.ImportFrom) and stmt.level == 0 and stmt.module:
                names = [stmt.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top in QUEUE_FORBIDDEN_STDLIB:
                    found.append(
                        f"{m.at(stmt)}: _queue imports {name}; the pure core takes time and ids as inputs"
                    )
    report(found, "impure import in straw._queue (no I/O, no clock, no randomness)")


# ---------------------------------------------------------------- the rollout layer

# straw.rollout is built on straw's public API only, stays framework neutral, and needs Ray
# only in its Ray module (docs/ROLLOUT.md, "Imports").
ROLLOUT_FORBIDDEN_TOP = frozenset({"slime", "megatron", "sglang", "vllm"})
ROLLOUT_RAY_MODULE = ("straw", "rollout", "ray")


def imported_names(m: Module) -> Iterator[tuple[ast.stmt, str]]:
    """Every absolute module name ``m`` imports (relative imports resolved inside straw)."""
    for node in ast.walk(m.tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                if node.module:
                    yield node, node.module
                continue
            package = m.parts if m.is_package else m.parts[:-1]
            base = package[: len(package) - (node.level - 1)]
            target = ".".join(base + tuple(node.module.split("."))) if node.module else ".".join(base)
            if node.module:
                yield node, target
            else:
                for alias in node.names:
                    yield node, f"{target}.{alias.name}"


def test_rollout_imports_only_public_straw_and_no_framework() -> None:
    found: list[str] = []
    for m in modules():
        if not m.under("rollout"):
            continue
        for node, name in imported_names(m):
            parts = name.split(".")
            if parts[0] == "straw" and len(parts) > 1 and parts[1].startswith("_"):
                found.append(f"{m.at(node)}: imports {name}; straw.rollout uses straw's public modules only")
            if parts[0] in ROLLOUT_FORBIDDEN_TOP:
                found.append(f"{m.at(node)}: imports {name}; straw.rollout imports no training framework")
            if parts[0] == "ray" and m.parts != ROLLOUT_RAY_MODULE:
                found.append(f"{m.at(node)}: imports {name}; only straw.rollout.ray may import Ray")
    report(found, "straw.rollout import rule")


def test_the_rollout_import_rule_catches_violations() -> None:
    source = (
        "import ray\nfrom straw._fs import posix\nfrom .. import _pack\nimport vllm.engine\n"
        "from slime.utils import x\nfrom straw import codec\n"
    )
    fake = Module(PACKAGE / "rollout" / "fake.py", ("straw", "rollout", "fake"), False, ast.parse(source))
    names = [name for _, name in imported_names(fake)]
    assert names == ["ray", "straw._fs", "straw._pack", "vllm.engine", "slime.utils", "straw"]
