"""Environments by name: `make_env("miniwob/click-button", scale=3)` -> a `GUIEnv`.

Families register a prefix and a factory; a name is `<prefix>/<task>`. Factories import their
heavy dependencies (selenium, miniwob, OSWorld) when called, so importing this package is cheap
and works on a machine without a browser.
"""
from __future__ import annotations

import difflib
from collections.abc import Callable, Sequence
from typing import Any

from arpo_lib.envs.base import EnvError, EnvSpec, GUIEnv, Observation

__all__ = ["EnvError", "EnvSpec", "GUIEnv", "Observation", "check_env_name", "domain_of", "expand_instances",
           "expand_task_names", "is_task_set_name", "list_envs", "make_env", "register_env", "split_instance"]

_REGISTRY: dict[str, EnvSpec] = {}
_TASK_LISTERS: dict[str, Callable[[], Sequence[str]]] = {}
_DYNAMIC: set[str] = set()
PLANNED_FAMILIES: dict[str, str] = {}
"""Families that configs may name already but that cannot be built yet: prefix -> why not."""


def register_env(
    prefix: str,
    factory: Callable[..., GUIEnv],
    description: str = "",
    tasks: Sequence[str] | Callable[[], Sequence[str]] = (),
    cache_tasks: bool = True,
) -> EnvSpec:
    """Register a family: `make_env(f"{prefix}/{task}", **options)` calls `factory(task, **options)`.

    `tasks` lists the valid task names, or is a function returning them (called lazily, so a
    family can discover its tasks without importing its backend at registration). An empty list
    means any task name is passed to the factory, which validates it. `cache_tasks=False` asks
    the lister again every time (for task lists that change while a process runs: fetched data).
    """
    if not prefix or "/" in prefix:
        raise ValueError(f"prefix must be a non-empty name without '/', got {prefix!r}")
    if prefix in _REGISTRY:
        raise ValueError(f"environment family {prefix!r} is already registered")
    spec = EnvSpec(prefix=prefix, factory=factory, description=description,
                   tasks=[] if callable(tasks) else list(tasks))
    _REGISTRY[prefix] = spec
    if callable(tasks):
        _TASK_LISTERS[prefix] = tasks
        if not cache_tasks:
            _DYNAMIC.add(prefix)
    return spec


def _tasks(spec: EnvSpec) -> list[str]:
    """The family's task names, resolving a lazy lister once."""
    if spec.prefix in _DYNAMIC:
        return list(_TASK_LISTERS[spec.prefix]())
    lister = _TASK_LISTERS.pop(spec.prefix, None)
    if lister is not None:
        spec.tasks = list(lister())
    return spec.tasks


def list_envs(prefix: str | None = None) -> list[str]:
    """All registered names (`miniwob/click-button`, ...); a family without a task list shows as
    `<prefix>/*`. With `prefix`, only that family."""
    names = []
    for spec in _REGISTRY.values():
        if prefix is None or spec.prefix == prefix:
            tasks = _tasks(spec)
            names += [f"{spec.prefix}/{t}" for t in tasks] if tasks else [f"{spec.prefix}/*"]
    return names


INSTANCE_FAMILIES = ("miniwob",)
"""Families whose tasks draw a new layout from the episode seed, so that `<task>@<seed>` names
one fixed instance of them. OSWorld's tasks are fixed configurations already."""


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
    if base.partition("/")[0] not in INSTANCE_FAMILIES:
        raise ValueError(f"{name!r}: fixed instances (`@<seed>`) exist for {', '.join(INSTANCE_FAMILIES)} tasks only")
    return base, int(seed)


def expand_instances(names: Sequence[str], per_task: int) -> list[str]:
    """Every task of a family with seeded layouts that names no instance -> `per_task` fixed
    instances `<task>@0` ... `<task>@<per_task - 1>`; other names unchanged. 0: no change."""
    if per_task < 0:
        raise ValueError(f"instances per task must be >= 0, got {per_task}")
    if per_task == 0:
        return list(names)
    out: list[str] = []
    for name in names:
        if name.partition("/")[0] in INSTANCE_FAMILIES and split_instance(name)[1] is None:
            out += [f"{name}@{i}" for i in range(per_task)]
        else:
            out.append(name)
    return out


def make_env(name: str, **options: Any) -> GUIEnv:
    """Build the environment `<prefix>/<task>`; options go to the family's factory. An instance
    name (`<task>@<seed>`) builds its task's environment: the seed is given at reset.

    Raises ValueError for an unknown family or task, naming what exists.
    """
    name = split_instance(name)[0]
    prefix = name.partition("/")[0] if isinstance(name, str) else ""
    if prefix in PLANNED_FAMILIES and prefix not in _REGISTRY:
        raise ValueError(f"{name!r}: {PLANNED_FAMILIES[prefix]}")
    # A task given whole (`task_config`, e.g. a task file of one's own) need not be in the family's list.
    spec, task = check_env_name(name, listed=options.get("task_config") is None)
    return spec.factory(task, **options)


def check_env_name(name: str, listed: bool = True) -> tuple[EnvSpec, str]:
    """(family, task) of a name, without building anything; ValueError naming what exists.
    `listed=False`: the task need not be in the family's task list."""
    if not isinstance(name, str):
        raise ValueError(f"an environment name must be a string, got {name!r}")
    name = split_instance(name)[0]
    prefix, _, task = name.partition("/")
    spec = _REGISTRY.get(prefix)
    if spec is None:
        close = difflib.get_close_matches(prefix, list(_REGISTRY), n=3)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"Unknown environment family {prefix!r} in {name!r}.{hint} "
                         f"Registered: {', '.join(sorted(_REGISTRY)) or 'none'}.")
    if not task:
        raise ValueError(f"{name!r} names no task: use '{prefix}/<task>', e.g. "
                         f"{', '.join(list_envs(prefix)[:3])}")
    tasks = _tasks(spec) if listed else []
    if tasks and task not in tasks and not _is_alias(prefix, task, tasks):
        close = difflib.get_close_matches(task, tasks, n=5, cutoff=0.5)
        hint = f" Did you mean: {', '.join(f'{prefix}/{t}' for t in close)}?" if close else ""
        raise ValueError(f"Unknown {prefix} task {task!r}.{hint} {len(tasks)} tasks exist: "
                         f"see arpo_lib.envs.list_envs({prefix!r}).")
    return spec, task


def _is_alias(prefix: str, task: str, tasks: Sequence[str]) -> bool:
    """Gymnasium-style ids (`miniwob/click-button-v1`) name the same task."""
    return prefix == "miniwob" and task.removesuffix("-v1") in tasks


# ---- built-in families ----------------------------------------------------------------------

def _make_miniwob(task: str, **options: Any) -> GUIEnv:
    from arpo_lib.envs.miniwob import MiniWoBEnv  # selenium/miniwob load only when built

    return MiniWoBEnv(task, **options)


def _miniwob_tasks() -> Sequence[str]:
    from arpo_lib.envs.miniwob import miniwob_tasks  # reads the package's files, no import

    return miniwob_tasks()


register_env(
    "miniwob",
    _make_miniwob,
    "MiniWoB++ web tasks in headless Chromium (options: scale, reward, max_steps, "
    "wait_seconds, episode_max_time_s, headless)",
    tasks=_miniwob_tasks,
)


def _make_osworld(task: str, **options: Any) -> GUIEnv:
    """`task_config=<dict>` gives the task itself (its id must be `task`), else the id is loaded."""
    from arpo_lib.envs.osworld.env import OSWorldEnv  # desktop_env loads only when an env is built

    task_config = options.pop("task_config", None)
    if task_config is not None and task_config.get("id") != task:
        raise ValueError(f"task_config is task {task_config.get('id')!r}, not {task!r}")
    return OSWorldEnv(task if task_config is None else task_config, **options)


def _osworld_tasks() -> Sequence[str]:
    """Task ids of the fetched OSWorld task data plus the fake tasks; empty (any id accepted,
    the loader says what is missing) while no data has been fetched."""
    try:
        from arpo_lib.envs.osworld.tasks import cached_task_ids  # stdlib only; [] when not fetched
    except ImportError:
        return []
    ids = list(cached_task_ids())
    from arpo_lib.envs.osworld.fake import FAKE_TASKS  # stdlib + PIL only

    return ids + [t for t in FAKE_TASKS if t not in ids] if ids else []


register_env(
    "osworld",
    _make_osworld,
    "OSWorld desktop tasks in desktop_env VMs (options: provider, screen_size, max_steps, path_to_vm, "
    "cache_root, pause_s, boot_retries, backoff_s, allow_no_kvm, desktop_env_class, task_loader, "
    "task_config)",
    tasks=_osworld_tasks,
    cache_tasks=False,  # `osworld-tasks fetch` may run while a notebook kernel lives
)


def _make_desktop(task: str, **options: Any) -> GUIEnv:
    from arpo_lib.envs.desktop.env import DesktopEnv  # the sandbox starts at the first reset

    return DesktopEnv(task, **options)


def _desktop_tasks() -> Sequence[str]:
    from arpo_lib.envs.desktop.tasks import desktop_tasks  # reads the suite's JSON files

    return desktop_tasks()


register_env(
    "desktop",
    _make_desktop,
    "Real desktop applications (text editor, terminal, file manager, Chromium) in a sandboxed X "
    "desktop, checked like OSWorld (options: screen, max_steps, settle_s, wait_s, reward, limits, isolation)",
    tasks=_desktop_tasks,
)


# ---- names beyond one task: domains and task sets ------------------------------------------

def domain_of(task: str) -> str:
    """`miniwob/click-test` -> `miniwob`; `osworld/<id>` -> its OSWorld domain (`chrome`, `gimp`,
    ...) when the task data is fetched, else `osworld`; a name without a prefix -> `default`."""
    family, _, rest = task.partition("/")
    if not rest:
        return "default"
    if family == "osworld":
        from arpo_lib.envs.osworld.tasks import cached_domain

        return cached_domain(rest)
    return family


def is_task_set_name(name: Any) -> bool:
    """`osworld/<set>` names a task set (train128, subset32, ...), not one task."""
    if not isinstance(name, str) or not name.startswith("osworld/"):
        return False
    from arpo_lib.envs.osworld.tasks import TASK_SETS

    return name.split("/", 1)[1] in TASK_SETS


def expand_task_names(names: Sequence[str]) -> list[str]:
    """Task names with task sets (`osworld/subset32`) replaced by their tasks (needs the task
    data: FileNotFoundError says how to fetch it)."""
    if not any(is_task_set_name(n) for n in names):
        return list(names)
    from arpo_lib.envs.osworld.tasks import expand_task_names as expand_osworld

    return expand_osworld(names)
