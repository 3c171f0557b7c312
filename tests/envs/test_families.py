"""Each environment family is one folder of arpo_lib/envs that registers itself: the package names
none of them, and a new folder is a new family."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import arpo_lib.envs as envs
from arpo_lib.run.registry import ENV_FAMILIES

ENVS = Path(envs.__file__).parent


def test_the_built_in_families_are_the_folders_and_the_package_names_none():
    folders = sorted(p.name for p in ENVS.iterdir() if (p / "__init__.py").is_file() and p.name not in envs.NOT_FAMILIES)
    assert folders == ["desktop", "miniwob", "osworld"]
    assert set(folders) <= set(ENV_FAMILIES)
    for name in folders:  # each folder's own __init__ registers its family
        assert ENV_FAMILIES.origin(name) == f"arpo_lib.envs.{name}", name
    tree = ast.parse((ENVS / "__init__.py").read_text())
    named = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    assert not named & set(folders), named & set(folders)  # no family's name in the package's code
    assert not [p.name for p in ENVS.glob("*.py") if p.stem not in ("__init__", "base")]  # the contract and registry only


def test_a_new_folder_is_a_new_family(tmp_path, monkeypatch):
    folder = tmp_path / "toyfamily"
    folder.mkdir()
    (folder / "__init__.py").write_text(
        "from arpo_lib.envs import register_family\n"
        "from arpo_lib.envs.base import EnvFamily\n"
        "register_family(EnvFamily('toyfamily', lambda task, **o: None, 'a toy', tasks=('a', 'b')))\n")
    monkeypatch.setattr(envs, "__path__", [*envs.__path__, str(tmp_path)])
    try:
        envs._import_families()
        assert envs.list_envs("toyfamily") == ["toyfamily/a", "toyfamily/b"]
        assert envs.check_env_name("toyfamily/b")[1] == "b"
    finally:
        ENV_FAMILIES._entries.pop("toyfamily", None)  # the registry has no public removal: tests only
        sys.modules.pop("arpo_lib.envs.toyfamily", None)
    assert "toyfamily" not in ENV_FAMILIES
