"""Environments by name: `make_env("miniwob/click-button", scale=3)` -> a `GUIEnv`.

A name is `<family>/<task>`. Each family is one `EnvFamily` object in the registry
`ENV_FAMILIES` (arpo_lib/run/registry.py): how to make its environments, its task list, whether
`<task>@<seed>` names a fixed instance, its domains and task sets, its scripted demonstrator and
the interpreter its workers need. The functions below ask the family, never test its name; a
plug-in adds a family with `register_family(EnvFamily(...))`; the built-in ones are the folders
`miniwob/`, `osworld/` and `desktop/`, each registering itself in its `__init__.py`. Families import their heavy
dependencies (selenium, miniwob, OSWorld) when an environment is made, so importing this
package is cheap and works on a machine without a browser.
"""
from __future__ import annotations

import difflib
import importlib
import pkgutil
import sys
from collections.abc import Callable, Sequence
from typing import Any

from arpo_lib.envs.base import EnvError, EnvFamily, GUIEnv, Observation
from arpo_lib.run.registry import ENV_FAMILIES

__all__ = ["ENV_FAMILIES", "EnvError", "EnvFamily", "GUIEnv", "Observation", "check_env_name", "domain_of",
           "expand_instances", "expand_task_names", "family_of", "is_task_set_name", "list_envs", "make_env",
           "register_env", "register_family", "split_instance"]


def register_family(family: EnvFamily) -> EnvFamily:
    """Register a family: `make_env(f"{family.name}/{task}", **options)` calls `family.make(task, **options)`."""
    return _register(family, sys._getframe(1).f_globals.get("__name__", "?"))


def _register(family: EnvFamily, origin: str) -> EnvFamily:
    if not family.name or "/" in family.name:
        raise ValueError(f"a family's name must be non-empty and without '/', got {family.name!r}")
    return ENV_FAMILIES.register(family.name, family, origin=origin)


def register_env(
    prefix: str,
    factory: Callable[..., GUIEnv],
    description: str = "",
    tasks: Sequence[str] | Callable[[], Sequence[str]] = (),
    cache_tasks: bool = True,
) -> EnvFamily:
    """A family from a factory and its tasks only (`register_family` takes the rest too):
    `make_env(f"{prefix}/{task}", **options)` calls `factory(task, **options)`. `tasks` lists the
    valid task names, or is a function returning them (called lazily); empty means any task name is
    passed to the factory, which validates it. `cache_tasks=False` asks the lister again every time."""
    return _register(EnvFamily(prefix, factory, description, tasks, cache_tasks),
                     sys._getframe(1).f_globals.get("__name__", "?"))


def list_envs(prefix: str | None = None) -> list[str]:
    """All registered names (`miniwob/click-button`, ...); a family without a task list shows as
    `<prefix>/*`. With `prefix`, only that family."""
    names = []
    for family in ENV_FAMILIES.values():
        if prefix is None or family.name == prefix:
            tasks = family.task_names()
            names += [f"{family.name}/{t}" for t in tasks] if tasks else [f"{family.name}/*"]
    return names


def _seeded_families() -> list[str]:
    return [f.name for f in ENV_FAMILIES.values() if f.seeded_layouts]


def split_instance(name: str) -> tuple[str, int | None]:
    """`miniwob/click-test@3` -> (`miniwob/click-test`, 3): one fixed instance of a task, the
    layout its seed 3 draws, whatever the episode's seed (as an OSWorld task is one fixed
    configuration). A name without `@` -> (name, None): every episode seeds its own layout.
    ValueError for a malformed seed or a family without seeded layouts."""
    base, sep, seed = name.rpartition("@") if isinstance(name, str) else ("", "", "")
    if not sep:
        return name, None
    if not seed.isdigit():
        raise ValueError(f"{name!r}: an instance is `<task>@<seed>` with a seed >= 0, e.g. 'miniwob/click-test@3'")
    family = ENV_FAMILIES.get(base.partition("/")[0])
    if family is None or not family.seeded_layouts:
        raise ValueError(f"{name!r}: fixed instances (`@<seed>`) exist for {', '.join(_seeded_families())} "
                         "tasks only")
    return base, int(seed)


def expand_instances(names: Sequence[str], per_task: int) -> list[str]:
    """Every task of a family with seeded layouts that names no instance -> `per_task` fixed
    instances `<task>@0` ... `<task>@<per_task - 1>`; other names unchanged. 0: no change."""
    if per_task < 0:
        raise ValueError(f"instances per task must be >= 0, got {per_task}")
    if per_task == 0:
        return list(names)
    seeded = _seeded_families()
    out: list[str] = []
    for name in names:
        if name.partition("/")[0] in seeded and split_instance(name)[1] is None:
            out += [f"{name}@{i}" for i in range(per_task)]
        else:
            out.append(name)
    return out


def make_env(name: str, **options: Any) -> GUIEnv:
    """Build the environment `<prefix>/<task>`; options go to the family's `make`. An instance
    name (`<task>@<seed>`) builds its task's environment: the seed is given at reset.

    Raises ValueError for an unknown family or task, naming what exists.
    """
    # A task given whole (`task_config`, e.g. a task file of one's own) need not be in the family's list.
    family, task = check_env_name(name, listed=options.get("task_config") is None)
    return family.make(task, **options)


def family_of(name: str) -> EnvFamily:
    """The family of a task name; ValueError naming the registered ones."""
    return check_env_name(name, listed=False)[0]


def check_env_name(name: str, listed: bool = True) -> tuple[EnvFamily, str]:
    """(family, task) of a name, without building anything; ValueError naming what exists.
    `listed=False`: the task need not be in the family's task list."""
    if not isinstance(name, str):
        raise ValueError(f"an environment name must be a string, got {name!r}")
    name = split_instance(name)[0]
    prefix, _, task = name.partition("/")
    family = ENV_FAMILIES.get(prefix)
    if family is None:
        close = difflib.get_close_matches(prefix, list(ENV_FAMILIES), n=3)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"Unknown environment family {prefix!r} in {name!r}.{hint} "
                         f"Registered: {', '.join(sorted(ENV_FAMILIES)) or 'none'}.")
    if not task:
        raise ValueError(f"{name!r} names no task: use '{prefix}/<task>', e.g. "
                         f"{', '.join(list_envs(prefix)[:3])}")
    tasks = family.task_names() if listed else []
    if tasks and task not in tasks and not (family.alias and family.alias(task) in tasks):
        close = difflib.get_close_matches(task, tasks, n=5, cutoff=0.5)
        hint = f" Did you mean: {', '.join(f'{prefix}/{t}' for t in close)}?" if close else ""
        raise ValueError(f"Unknown {prefix} task {task!r}.{hint} {len(tasks)} tasks exist: "
                         f"see arpo_lib.envs.list_envs({prefix!r}).")
    return family, task


# ---- names beyond one task: domains and task sets ------------------------------------------

def domain_of(task: str) -> str:
    """The domain results are grouped under: the family's (`osworld/<id>` -> `chrome`, `gimp`, ...
    once the task data is fetched), else the family's name; a name without a prefix -> `default`."""
    prefix, _, rest = task.partition("/")
    if not rest:
        return "default"
    family = ENV_FAMILIES.get(prefix)
    return family.domain(rest) if family is not None and family.domain is not None else prefix


def is_task_set_name(name: Any) -> bool:
    """`<family>/<set>` names one of the family's task sets (`osworld/subset32`), not one task."""
    if not isinstance(name, str) or "/" not in name:
        return False
    prefix, _, rest = name.partition("/")
    family = ENV_FAMILIES.get(prefix)
    return family is not None and family.task_sets is not None and rest in family.task_sets()


def expand_task_names(names: Sequence[str]) -> list[str]:
    """Task names with task sets (`osworld/subset32`) replaced by their tasks (that may need the
    task data: FileNotFoundError says how to fetch it)."""
    out: list[str] = []
    for name in names:
        if is_task_set_name(name):
            prefix, _, rest = name.partition("/")
            out += ENV_FAMILIES[prefix].expand_task_set(rest)
        else:
            out.append(name)
    return out


# ---- the families: each folder of this package but `workers` registers itself when imported -------

def _import_families() -> None:
    """Import every family folder (`miniwob/`, `osworld/`, `desktop/`, ...): its `__init__` registers
    it. A new family is one folder with its registration; nothing here names it."""
    for info in pkgutil.iter_modules(__path__):
        if info.ispkg and info.name not in NOT_FAMILIES:
            importlib.import_module(f"{__name__}.{info.name}")


NOT_FAMILIES = ("workers",)
"""Folders of this package that hold no family (the worker processes and pools)."""

_import_families()
