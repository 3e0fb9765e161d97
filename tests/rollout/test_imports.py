"""``import straw.rollout`` needs only straw's core dependencies (acceptance scenario 60, first part).

A child interpreter blocks torch, PIL and Ray (an import of them fails) and imports every
module of the package; none of them may import the three eagerly.
"""

from __future__ import annotations

import pkgutil
import subprocess
import sys
import textwrap

import straw.rollout

CHILD = textwrap.dedent(
    """
    import importlib, sys
    for blocked in ("torch", "PIL", "ray"):
        sys.modules[blocked] = None  # any import of it now raises ImportError
    names = sys.argv[1:]
    for name in names:
        importlib.import_module(name)
    import straw.rollout
    assert straw.rollout.Sample().status.value == "pending"
    print(len(names))
    """
)


def rollout_modules() -> list[str]:
    names = [f"straw.rollout.{info.name}" for info in pkgutil.iter_modules(straw.rollout.__path__)]
    return [name for name in sorted(names) if name != "straw.rollout.ray"]


def test_every_rollout_module_imports_without_torch_pil_or_ray() -> None:
    names = rollout_modules()
    assert "straw.rollout.codec" in names and "straw.rollout.refs" in names
    result = subprocess.run(
        [sys.executable, "-c", CHILD, *names], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == str(len(names))
