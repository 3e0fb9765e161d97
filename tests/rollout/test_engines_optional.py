"""The engines extra is optional: ``import straw.rollout`` needs neither aiohttp nor torch."""

from __future__ import annotations

import subprocess
import sys

BLOCK = "import sys\nfor name in ('aiohttp', 'torch'):\n    sys.modules[name] = None\n"


def python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", BLOCK + code], capture_output=True, text=True, timeout=120)


def test_straw_rollout_imports_without_aiohttp_or_torch() -> None:
    done = python(
        "import straw.rollout\nprint(sorted(m for m in sys.modules if m.startswith('straw.rollout')))"
    )
    assert done.returncode == 0, done.stderr
    assert "generators" not in done.stdout and "demo" not in done.stdout


def test_generators_without_aiohttp_say_which_extra_to_install() -> None:
    done = python(
        "import straw.rollout.generators as g\n"
        "print(g.EngineGenerator.__name__)\n"
        "try:\n    g.SGLangGenerator\n"
        "except ModuleNotFoundError as error:\n    print(error.name, '|', error)\n"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "EngineGenerator",
        "aiohttp | straw.rollout.generators requires aiohttp: pip install 'straw[engines]'",
    ]


def test_the_simulated_engine_needs_no_torch() -> None:
    done = python("from straw.rollout.demo.simulated import SimulatedEngine\nprint('ok')")
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
