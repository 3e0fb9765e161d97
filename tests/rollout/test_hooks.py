"""straw.rollout.hooks: loading hooks by dotted path, identities and the default dynamic filter."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from straw.rollout.hooks import (
    DynamicFilterOutput,
    Hooks,
    callable_identity,
    default_dynamic_filter,
    load_function,
)
from straw.rollout.sample import Sample, SampleStatus


def module_hook(group: Any, config: Any) -> bool:
    return len(group) > 1


@pytest.fixture
def hook_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    package = tmp_path / "hookpkg_rollout_tests"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "hooks.py").write_text(
        textwrap.dedent(
            """
            def convert(samples, config):
                return {"n": len(samples)}

            class Holder:
                @staticmethod
                def reward(samples, config):
                    return [1.0], [0.0]

            NOT_CALLABLE = 3
            """
        )
    )
    (package / "broken.py").write_text("import missing_dependency_of_hook_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "hookpkg_rollout_tests"
    for name in [n for n in sys.modules if n.startswith("hookpkg_rollout_tests")]:
        del sys.modules[name]


def test_load_function(hook_module: str) -> None:
    convert = load_function(f"{hook_module}.hooks.convert")
    assert convert([1, 2], None) == {"n": 2}
    reward = load_function(f"{hook_module}.hooks.Holder.reward")
    assert reward([], None) == ([1.0], [0.0])
    assert load_function(f"{hook_module}.hooks:convert") is convert


def test_load_function_errors_name_the_path(hook_module: str) -> None:
    with pytest.raises(ImportError, match=r"no_such_pkg_xyz\.mod\.f"):
        load_function("no_such_pkg_xyz.mod.f")
    with pytest.raises(AttributeError, match=rf"{hook_module}.hooks.missing.*no attribute 'missing'"):
        load_function(f"{hook_module}.hooks.missing")
    with pytest.raises(ImportError, match=rf"{hook_module}.broken.f.*missing_dependency_of_hook_xyz"):
        load_function(f"{hook_module}.broken.f")
    with pytest.raises(TypeError, match="not a callable"):
        load_function(f"{hook_module}.hooks.NOT_CALLABLE")
    with pytest.raises(ImportError, match="dotted path"):
        load_function("convert")
    with pytest.raises(ImportError, match="dotted path"):
        load_function("a..b")
    with pytest.raises(ValueError, match="non-empty"):
        load_function("")
    with pytest.raises(ValueError, match="non-empty"):
        load_function(None)  # type: ignore[arg-type]


def test_from_config_paths_and_identities(hook_module: str) -> None:
    config = SimpleNamespace(
        custom_convert_samples_to_train_data_path=f"{hook_module}.hooks.convert",
        custom_reward_post_process_path=f"{hook_module}.hooks.Holder.reward",
    )
    hooks = Hooks.from_config(config, dynamic_filter=module_hook)
    assert hooks.convert is not None and hooks.convert([1], None) == {"n": 1}
    assert hooks.identity("convert") == f"{hook_module}.hooks.convert"
    assert hooks.identity("dynamic_filter") == f"{__name__}:module_hook"
    assert hooks.identity("sample_filter") is None
    assert hooks.identities()["reward_post_process"] == f"{hook_module}.hooks.Holder.reward"
    # A callable passed directly wins over the configured path, and its identity is its own.
    direct = Hooks.from_config(config, convert=module_hook)
    assert direct.convert is module_hook and direct.identity("convert") == f"{__name__}:module_hook"


def test_from_config_bad_input(hook_module: str) -> None:
    with pytest.raises(ImportError, match="no_such_pkg_xyz"):
        Hooks.from_config(SimpleNamespace(rollout_sample_filter_path="no_such_pkg_xyz.f"))
    with pytest.raises(TypeError, match="unknown hooks: bogus"):
        Hooks.from_config(SimpleNamespace(), bogus=module_hook)
    with pytest.raises(TypeError, match="must be callable"):
        Hooks(convert=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="Unknown hook names"):
        Hooks(paths={"nope": "x.y"})
    with pytest.raises(KeyError):
        Hooks().identity("nope")


def test_callable_identity_of_objects() -> None:
    class Local:
        def __call__(self) -> None: ...

    assert callable_identity(module_hook) == f"{__name__}:module_hook"
    assert callable_identity(Local()).endswith("test_callable_identity_of_objects.<locals>.Local")


def test_default_dynamic_filter() -> None:
    ok = [Sample(status=SampleStatus.COMPLETED), [Sample(status=SampleStatus.TRUNCATED)]]
    assert default_dynamic_filter(ok) == DynamicFilterOutput(True, None)
    bad = [Sample(status=SampleStatus.COMPLETED), [Sample(status=SampleStatus.FAILED)]]
    assert default_dynamic_filter(bad) == DynamicFilterOutput(False, "failed")


def test_filter_group_normalises() -> None:
    group = [Sample(), Sample()]
    assert Hooks().filter_group([Sample(status=SampleStatus.FAILED)], None).reason == "failed"
    assert Hooks(dynamic_filter=module_hook).filter_group(group, None) == DynamicFilterOutput(True)
    assert Hooks(dynamic_filter=module_hook).filter_group(group[:1], None) == DynamicFilterOutput(False)
    verdict = DynamicFilterOutput(False, "zero_std")
    assert Hooks(dynamic_filter=lambda g, c: verdict).filter_group(group, None) is verdict
    with pytest.raises(TypeError, match="expected bool or DynamicFilterOutput"):
        Hooks(dynamic_filter=lambda g, c: "yes").filter_group(group, None)
