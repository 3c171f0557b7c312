"""Registries: register by decorator or call, duplicates refused, unknown names explained, the
owner of the built-in entries imported on first use, plug-ins imported by name."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from arpo_lib.run import registry as reg
from arpo_lib.run.config import field_docs
from arpo_lib.run.registry import PluginError, Registry, UnknownName, import_plugins, plugin_path

REPO = Path(__file__).resolve().parents[2]


def test_register_as_decorator_and_as_call():
    losses = Registry("policy loss")

    @losses.register("mine")
    def mine():
        return 1

    assert losses.register("other", len) is len
    assert losses["mine"] is mine and dict(losses) == {"mine": mine, "other": len}
    assert losses.origin("mine") == __name__


def test_a_taken_name_is_refused_naming_who_took_it():
    prompts = Registry("prompt")
    prompts.register("a", "first")
    prompts.register("a", "first")  # the same entry again (a module imported twice) is no change
    with pytest.raises(ValueError, match=f"prompt 'a' is already registered \\(by {__name__}\\)"):
        prompts.register("a", "second")
    with pytest.raises(ValueError, match="non-empty name"):
        prompts.register("", "x")


def test_an_unknown_name_names_the_kind_the_entries_and_the_closest():
    arms = Registry("comparison arm")
    for name in ("grpo", "arpo", "arpo_tis"):
        arms.register(name, {})
    with pytest.raises(UnknownName) as info:
        arms["arpo_ti"]
    assert str(info.value) == "unknown comparison arm 'arpo_ti' (did you mean arpo_tis, arpo?); registered: grpo, arpo, arpo_tis"
    assert isinstance(info.value, KeyError) and isinstance(info.value, ValueError)
    assert arms.unknown("zzz") == "unknown comparison arm 'zzz'; registered: grpo, arpo, arpo_tis"
    assert arms.get("zzz") is None and "zzz" not in arms and "grpo" in arms


def test_the_home_module_is_imported_when_the_registry_is_first_read(tmp_path, monkeypatch):
    schedules = Registry("lr schedule", home="arpo_test_schedules_home")
    (tmp_path / "arpo_test_schedules_home.py").write_text(
        "from tests.run.test_registry import HOMED\nHOMED.register('built_in', 1)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys.modules[__name__], "HOMED", schedules, raising=False)
    schedules.register("early", 0)  # a plug-in may register before the home is imported
    assert "arpo_test_schedules_home" not in sys.modules
    assert list(schedules) == ["early", "built_in"]
    assert "arpo_test_schedules_home" in sys.modules


@pytest.mark.parametrize("name", ["ADV_ESTIMATORS", "POLICY_LOSSES", "COMPARISON_ARMS", "LR_SCHEDULES", "OPTIMIZERS", "PROMPTS",
                                  "EVAL_PROTOCOLS", "ENV_FAMILIES"])
def test_every_extension_point_has_built_in_entries_and_a_config_key(name):
    registry = getattr(reg, name)
    assert len(registry) > 0 and registry.key in field_docs()
    # the home registers built-in entries itself, or through its own modules (the environment
    # families: one folder of arpo_lib.envs each, imported by the package)
    origins = {registry.origin(entry) for entry in registry}
    assert registry.home in origins or any(o.startswith(registry.home + ".") for o in origins), origins


def test_a_family_registered_by_a_plugin_is_known_as_the_plugins():
    from tests.plugins import example_plugin

    assert reg.ENV_FAMILIES.origin("example") == example_plugin.__name__
    with pytest.raises(ValueError, match=f"family 'example' is already registered \\(by {example_plugin.__name__}\\)"):
        example_plugin.register_family(example_plugin.EnvFamily("example", example_plugin.BoxEnv))


def test_plugins_are_imported_by_name_and_found_where_they_live(tmp_path, monkeypatch):
    (tmp_path / "arpo_test_plugin_here.py").write_text("LOADED = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import_plugins(["arpo_test_plugin_here"])
    assert sys.modules["arpo_test_plugin_here"].LOADED
    with pytest.raises(PluginError, match="'arpo_test_no_such_plugin' cannot be imported: ModuleNotFoundError"):
        import_plugins(["arpo_test_no_such_plugin"])
    # yaml lives in site-packages: a path entry that would bring every package along is left out
    assert plugin_path(["arpo_test_plugin_here", "tests.plugins.example_plugin", "yaml"]) == [str(tmp_path), str(REPO)]
