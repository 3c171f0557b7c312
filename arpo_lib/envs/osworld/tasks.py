"""OSWorld task data: the ARPO fork's `evaluation_examples/`, fetched once, validated, cached.

ARPO trains and evaluates on task files from its authors' OSWorld fork (FanbinLu/OSWorld, the
commit pinned by ARPO's `OSWorld` submodule). This module brings exactly that directory onto the
machine and names the task sets the workbench uses. Standard library only: no torch, no OSWorld.

Layout of the fork's `evaluation_examples/` (and of `test_data/osworld/evaluation_examples/`):

    examples/<domain>/<task_id>.json      one task: id, snapshot, instruction, config, evaluator, ...
    test_all.json                         meta list {domain: [task_id, ...]}: all 369 test tasks
    test_success_uitars1.5_wo_impossible.json   ARPO's 128 training tasks (same format)
    test_small.json, ...                  other meta lists

The cache, `~/.cache/arpo-workbench/osworld-tasks/<commit12>/` (root overridable with
`$ARPO_OSWORLD_TASKS`), holds `evaluation_examples/` and `manifest.json` (source, commit, archive
sha256, per-domain counts, sha256 of every file). A fetch extracts into a staging directory,
validates everything, writes the manifest and only then renames the directory into place: a
failed fetch leaves the previous cache (or none), never a partial one.

Task sets (`task_set(name)` -> `["osworld/<task_id>", ...]`, in the meta list's order):

- `train128`: ARPO's 128 training tasks (`test_success_uitars1.5_wo_impossible.json`).
- `test_all`: all 369 OSWorld test tasks (`test_all.json`).
- `subset32`: ARPO's subset run (`examples/osworld_subset32.sh`) trains on
  `test_success_middle_difficult.json`. Where the fetched tree has that file, `subset32` is that
  list. Where it does not, `subset32` is drawn from `train128` by a fixed rule: each domain gets
  32 x (its share of train128) tasks, rounded down, and the remaining places go to the domains
  with the largest fractional parts (ties: domain name order); within a domain the tasks with the
  smallest sha256("arpo-workbench/subset32:<task_id>") are taken. On ARPO's 128 this gives
  chrome 4, gimp 5, libreoffice_calc 3, libreoffice_impress 3, libreoffice_writer 3,
  multi_apps 3, os 3, thunderbird 2, vlc 1, vs_code 5.
- `smoke4`: 2 os + 2 chrome tasks of train128 that are quick to set up: feasible (evaluator is
  not `infeasible`) and set up only with local steps (launch, execute, command, open,
  activate_window, sleep: no download, no web tabs, no accounts), fewest setup steps first, then
  task id. On ARPO's 128 (resolved against a third-party copy of the list and task files, as the
  fork itself could not be reached when this was written) these are chrome 2ad9387a (new
  bookmarks folder), chrome 2ae9ba84 (rename the Chrome profile), os 94d95f96 (install Spotify),
  os 28cc3b7e (turn the volume up).
- `chrome10`: 10 of train128's 18 chrome tasks, those with the smallest
  sha256("arpo-workbench/chrome10:<task_id>").

A rule-based set takes all candidates when there are fewer than its size (small fixtures); a
fetch of the pinned commit checks that every set has exactly its size.

Note on the data: "wo_impossible" notwithstanding, the 128 list holds infeasible tasks
(evaluator func "infeasible": 26 of 128 in the copy checked), which score 1 when the agent's
last action is FAIL.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import hashlib
import logging
import json
import os
import re
import shutil
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from arpo_lib.envs.osworld import fetch
from arpo_lib.run.records import atomic_write_text

log = logging.getLogger(__name__)

OSWORLD_TASKS_REPO = "FanbinLu/OSWorld"
OSWORLD_TASKS_COMMIT = "7a6409d7f54e335181398b10038ddf3beda9ab33"
"""The `OSWorld` submodule commit of dvlab-research/ARPO (its only commit touching the submodule)."""
OSWORLD_TASKS_URL = f"https://codeload.github.com/{OSWORLD_TASKS_REPO}/tar.gz/{OSWORLD_TASKS_COMMIT}"
ENV_VAR = "ARPO_OSWORLD_TASKS"
"""Overrides the cache root (the directory holding one `<commit12>/` per pinned commit)."""
MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
EXAMPLES = "evaluation_examples"
ENV_PREFIX = "osworld"

TEST_ALL_LIST = "test_all.json"
TRAIN_LIST = "test_success_uitars1.5_wo_impossible.json"
SUBSET32_LISTS = ("test_subset32.json", "test_success_middle_difficult.json")
"""ARPO's 32-task subset: the fork holds `test_subset32.json` (32 tasks of the 128, none
infeasible); ARPO's examples/osworld_subset32.sh names `test_success_middle_difficult.json`,
which no public copy of the fork has. The first present is used."""
REQUIRED_LISTS = (TEST_ALL_LIST, TRAIN_LIST)
"""Meta lists a fetched tree must have. These and the subset lists (when present) are checked
strictly; problems in other meta lists are recorded as warnings in the manifest."""
TRAIN128_DOMAINS = {"chrome": 18, "gimp": 19, "libreoffice_calc": 12, "libreoffice_impress": 13,
                    "libreoffice_writer": 11, "multi_apps": 11, "os": 12, "thunderbird": 7, "vlc": 6, "vs_code": 19}
"""ARPO's 128 training tasks per domain: checked for any source (a different list is not ARPO's)."""

FETCH_HINT = ("fetch it with `./workbench osworld-tasks fetch` (or `python -m arpo_lib osworld-tasks "
              "fetch`; offline: `--source <OSWorld tarball or checkout>`)")

MAX_EXAMPLES_BYTES = 256 << 20
"""evaluation_examples/ is a few MB; more than this is not OSWorld task data."""
LOCAL_SETUP_STEPS = frozenset({"launch", "execute", "command", "open", "activate_window", "sleep"})
"""Setup steps that need nothing outside the VM (smoke4's criterion)."""


class TaskDataError(RuntimeError):
    """The task data could not be fetched or is not valid; the message says what was wrong."""


class UnknownTaskError(KeyError, ValueError):
    """A task id that the cache does not hold (both a KeyError and a ValueError)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


@dataclasses.dataclass(frozen=True)
class Expectations:
    """What a fetched tree must contain beyond internal consistency."""

    lists: Mapping[str, Mapping[str, int] | int] = dataclasses.field(default_factory=dict)
    """Meta-list file -> its per-domain counts, or its total."""
    set_sizes: Mapping[str, int] = dataclasses.field(default_factory=dict)
    """Task-set name -> the number of tasks it must resolve to."""


PINNED_EXPECTATIONS = Expectations(
    lists={TRAIN_LIST: TRAIN128_DOMAINS, TEST_ALL_LIST: 369},
    set_sizes={"train128": 128, "test_all": 369, "subset32": 32, "smoke4": 4, "chrome10": 10},
)
"""The ARPO paper's numbers; applied when the data is known to be the pinned commit."""

TASK_SETS: dict[str, str] = {
    "train128": f"ARPO's 128 training tasks ({TRAIN_LIST})",
    "subset32": f"ARPO's 32-task subset ({SUBSET32_LISTS[0]}, else {SUBSET32_LISTS[1]}); without either, "
                "the workbench's own per-domain draw of 32 feasible train128 tasks (not ARPO's)",
    "smoke4": "2 os + 2 chrome tasks of train128 with quick, local-only setup",
    "chrome10": "10 chrome tasks of train128 (fixed hash draw)",
    "test_all": f"all OSWorld test tasks ({TEST_ALL_LIST}, 369)",
    "sandbox_solved": "the OSWorld tasks with a scripted solution for the desktop sandbox "
                      "(arpo_lib/envs/osworld/sandbox_solutions.json): run offline, set up and scored there",
}
"""Task-set name -> what it is; `task_set(name)` resolves it against the cache."""

_UUID = re.compile(r"^[0-9a-fA-F]{8}(-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}$")
_SET_LIKE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


# ---- where the cache is ---------------------------------------------------------------------

def cache_root() -> Path:
    """The directory holding one `<commit12>/` per pinned commit (`$ARPO_OSWORLD_TASKS` or
    `~/.cache/arpo-workbench/osworld-tasks`)."""
    override = os.environ.get(ENV_VAR)
    if override:
        return Path(override).expanduser()
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "arpo-workbench" / "osworld-tasks"


ACTIVE = "active.json"
"""In the cache root: which slot the runs read (the last one fetched)."""


def pinned_root() -> Path:
    """The slot of the pinned commit's data."""
    return cache_root() / OSWORLD_TASKS_COMMIT[:12]


def slot_for(commit: str | None, tree_sha256: str) -> Path:
    """Where fetched data lives: one slot per commit (`<commit12>`), and data of unknown origin
    (a checkout or an archive that names no commit) in `unknown-<tree12>`, never in a commit's slot."""
    return cache_root() / (commit[:12] if commit else f"unknown-{tree_sha256[:12]}")


def tasks_root() -> Path:
    """The task data runs read: the slot the last fetch made active, else the pinned commit's.
    Holds `manifest.json` and `evaluation_examples/`."""
    try:
        slot = json.loads((cache_root() / ACTIVE).read_text())["slot"]
        if isinstance(slot, str) and slot and "/" not in slot and not slot.startswith("."):
            return cache_root() / slot
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return pinned_root()


def provenance(manifest: dict[str, Any]) -> str:
    """Where the cached data came from, in words: the commit, or that it is unknown."""
    if manifest.get("commit"):
        return f"commit {manifest['commit'][:12]}" + (" (ARPO's pinned commit)"
                                                      if manifest["commit"] == OSWORLD_TASKS_COMMIT else "")
    return f"unknown commit (from {manifest.get('source')})"


def examples_dir(root: Path | None = None) -> Path:
    """`evaluation_examples/` of the cache (what OSWorld's scripts call the examples root)."""
    return Path(root or tasks_root()) / EXAMPLES


def _read_manifest(root: Path) -> dict[str, Any]:
    path = root / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"OSWorld task data is not fetched (no {path}): {FETCH_HINT}")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        manifest = None
    usable = (isinstance(manifest, dict) and manifest.get("format") == MANIFEST_FORMAT
              and isinstance(manifest.get("tasks"), dict))
    if not usable:
        raise FileNotFoundError(f"{path} is not a usable manifest (format {MANIFEST_FORMAT}): "
                                "fetch again with `arpo osworld-tasks fetch --force`")
    return manifest


def is_fetched(root: Path | None = None) -> bool:
    """Whether a complete cache (one with a manifest) exists. Never raises."""
    try:
        _read_manifest(Path(root or tasks_root()))
        return True
    except Exception:  # noqa: BLE001 - a yes/no question about the disk
        return False


def cached_task_ids(root: Path | None = None) -> list[str]:
    """Every task id under `examples/` of the cache, sorted; [] when nothing is fetched.
    Never raises (the environment registry calls it to list `osworld/<id>` names)."""
    try:
        tasks = _read_manifest(Path(root or tasks_root()))["tasks"]
        return sorted(str(t) for t in tasks)
    except Exception:  # noqa: BLE001 - listing must not break the registry
        return []


# ---- reading tasks --------------------------------------------------------------------------

def _strip_prefix(task_id: str) -> str:
    return task_id[len(ENV_PREFIX) + 1:] if task_id.startswith(ENV_PREFIX + "/") else task_id


def task_domain(task_id: str, root: Path | None = None) -> str:
    """The domain (examples/ subdirectory) of a task id or `osworld/<id>` name."""
    task_id = _strip_prefix(task_id)
    tasks = _read_manifest(Path(root or tasks_root()))["tasks"]
    if task_id not in tasks:
        close = difflib.get_close_matches(task_id, list(tasks), n=3, cutoff=0.6)
        hint = f" Close: {', '.join(close)}." if close else ""
        raise UnknownTaskError(f"unknown OSWorld task id {task_id!r}.{hint} The cache holds "
                               f"{len(tasks)} tasks (arpo osworld-tasks list).")
    return tasks[task_id]


def cached_domain(task_id: str) -> str:
    """The domain of a task of the fetched data; `osworld` when unknown (not fetched, no such task)."""
    return _cached_domain(task_id, str(tasks_root()))


@functools.lru_cache(maxsize=4096)
def _cached_domain(task_id: str, root: str) -> str:
    try:
        return task_domain(task_id, Path(root))
    except (OSError, KeyError, ValueError):
        return "osworld"


def load_task(task_id: str, root: Path | None = None) -> dict[str, Any]:
    """The task's JSON as OSWorld's `DesktopEnv.reset(task_config=...)` takes it.

    FileNotFoundError (with the fetch command) when the data is not fetched; UnknownTaskError
    (a ValueError and a KeyError) naming close ids when the id is unknown.
    """
    root = Path(root or tasks_root())
    task_id = _strip_prefix(task_id)
    domain = task_domain(task_id, root)
    path = examples_dir(root) / "examples" / domain / f"{task_id}.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is listed in the manifest but missing: the cache is damaged; "
                                "run `arpo osworld-tasks verify`, then `arpo osworld-tasks fetch --force`")
    task = json.loads(path.read_text())
    if task.get("id") != task_id:  # the file name is the id (ARPO's loader does the same)
        task["original_id"], task["id"] = task.get("id"), task_id
    return task


# ---- the task schema ------------------------------------------------------------------------

def _steps_problems(steps: Any, where: str) -> list[str]:
    if not isinstance(steps, list):
        return [f"{where} must be a list of {{type, parameters}}, got {type(steps).__name__}"]
    problems = []
    for i, step in enumerate(steps):
        if not isinstance(step, dict):
            problems.append(f"{where}[{i}] must be an object, got {type(step).__name__}")
            continue
        if not isinstance(step.get("type"), str) or not step.get("type"):
            problems.append(f"{where}[{i}].type must be a non-empty string")
        if "parameters" in step and not isinstance(step["parameters"], dict):
            problems.append(f"{where}[{i}].parameters must be an object")
    return problems


def _evaluator_problems(ev: Any) -> list[str]:
    if not isinstance(ev, dict):
        return [f"evaluator must be an object, got {type(ev).__name__}"]
    func = ev.get("func")
    problems = []
    if isinstance(func, list):
        n = len(func)
        if n == 0 or not all(isinstance(f, str) and f for f in func):
            problems.append("evaluator.func must be a non-empty string or a non-empty list of strings")
        for key in ("result", "expected", "options"):
            value = ev.get(key)
            if key == "result" and value is None:
                problems.append("evaluator.result is required when evaluator.func is a list")
            elif value is not None and not (key == "options" and isinstance(value, dict)):
                if not isinstance(value, list) or len(value) != n:
                    problems.append(f"evaluator.{key} must be a list of {n} items, one per func")
        if ev.get("conj", "and") not in ("and", "or"):
            problems.append(f"evaluator.conj must be 'and' or 'or', got {ev.get('conj')!r}")
    elif isinstance(func, str) and func:
        if func != "infeasible" and not isinstance(ev.get("result"), dict):
            problems.append(f"evaluator.result must be an object (func {func!r})")
        for key in ("expected", "options"):
            if key in ev and not isinstance(ev[key], dict):
                problems.append(f"evaluator.{key} must be an object")
    else:
        problems.append("evaluator.func must be a non-empty string or a non-empty list of strings")
    if "postconfig" in ev:
        problems += _steps_problems(ev["postconfig"], "evaluator.postconfig")
    return problems


def validate_task(d: Any) -> list[str]:
    """Problems with one task JSON (empty: valid).

    Required: id, snapshot, instruction (non-empty strings) and evaluator {func, result, ...}
    (result may be absent only for func "infeasible"; list-valued func needs result/expected of
    the same length). Optional but typed: source (string or list), config and
    evaluator.postconfig (lists of {type, parameters}), related_apps (list of strings),
    trajectory (string), proxy and fixed_ip (booleans), possibility_of_env_change (string).
    """
    if not isinstance(d, dict):
        return [f"a task must be a JSON object, got {type(d).__name__}"]
    problems = []
    for key in ("id", "snapshot", "instruction"):
        if not isinstance(d.get(key), str) or not d.get(key).strip():
            problems.append(f"{key} must be a non-empty string")
    if "evaluator" not in d:
        problems.append("evaluator is missing")
    else:
        problems += _evaluator_problems(d["evaluator"])
    if "config" in d:
        problems += _steps_problems(d["config"], "config")
    source = d.get("source", "")
    if not (isinstance(source, str) or (isinstance(source, list) and all(isinstance(s, str) for s in source))):
        problems.append("source must be a string or a list of strings")
    apps = d.get("related_apps", [])
    if not (isinstance(apps, list) and all(isinstance(a, str) for a in apps)):
        problems.append("related_apps must be a list of strings")
    for key, typ in (("trajectory", str), ("proxy", bool), ("fixed_ip", bool), ("possibility_of_env_change", str)):
        if key in d and not isinstance(d[key], typ):
            problems.append(f"{key} must be a {typ.__name__}")
    return problems


# ---- task sets ------------------------------------------------------------------------------

def _stable_rank(salt: str, task_id: str) -> str:
    return hashlib.sha256(f"{salt}:{task_id}".encode()).hexdigest()


def proportional_quota(counts: Mapping[str, int], k: int) -> dict[str, int]:
    """How many of k places each domain gets: k x its share rounded down, then one more for the
    domains with the largest remainders (ties: domain name). k >= total gives every task."""
    total = sum(counts.values())
    if k >= total:
        return dict(counts)
    quota = {d: k * n // total for d, n in counts.items()}
    by_remainder = sorted(counts, key=lambda d: (-(k * counts[d] % total), d))
    for d in by_remainder[: k - sum(quota.values())]:
        quota[d] += 1
    return quota


def stable_subset(by_domain: Mapping[str, Sequence[str]], k: int, salt: str) -> dict[str, list[str]]:
    """A reproducible k-task subset, proportional per domain (`proportional_quota`); within a
    domain the tasks with the smallest sha256(f"{salt}:{task_id}"). Keeps the input order."""
    quota = proportional_quota({d: len(ids) for d, ids in by_domain.items()}, k)
    out = {}
    for domain, ids in by_domain.items():
        keep = set(sorted(ids, key=lambda t: _stable_rank(salt, t))[: quota[domain]])
        if keep:
            out[domain] = [t for t in ids if t in keep]
    return out


def _read_meta(ee: Path, name: str) -> dict[str, list[str]]:
    path = ee / name
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist")
    return json.loads(path.read_text())


def _is_feasible(ee: Path, domain: str, task_id: str) -> bool:
    task = json.loads((ee / "examples" / domain / f"{task_id}.json").read_text())
    return task.get("evaluator", {}).get("func") != "infeasible"


def _is_quick_local(task: dict[str, Any]) -> bool:
    feasible = task.get("evaluator", {}).get("func") != "infeasible"
    return feasible and all(step.get("type") in LOCAL_SETUP_STEPS for step in task.get("config", []))


def _resolve_set(ee: Path, name: str) -> dict[str, list[str]]:
    """domain -> task ids of a set, read from an `evaluation_examples/` directory."""
    if name == "train128":
        return _read_meta(ee, TRAIN_LIST)
    if name == "test_all":
        return _read_meta(ee, TEST_ALL_LIST)
    if name == "subset32":
        for listed in SUBSET32_LISTS:
            if (ee / listed).is_file():
                return _read_meta(ee, listed)
        feasible = {d: [t for t in ids if _is_feasible(ee, d, t)] for d, ids in _read_meta(ee, TRAIN_LIST).items()}
        return stable_subset({d: ids for d, ids in feasible.items() if ids}, 32, "arpo-workbench/subset32")
    if name == "chrome10":
        chrome = _read_meta(ee, TRAIN_LIST).get("chrome", [])
        return stable_subset({"chrome": chrome}, 10, "arpo-workbench/chrome10") if chrome else {}
    if name == "smoke4":
        train = _read_meta(ee, TRAIN_LIST)
        out = {}
        for domain in ("os", "chrome"):
            tasks = {t: json.loads((ee / "examples" / domain / f"{t}.json").read_text())
                     for t in train.get(domain, [])}
            quick = sorted((t for t, task in tasks.items() if _is_quick_local(task)),
                           key=lambda t: (len(tasks[t].get("config", [])), t))[:2]
            if quick:
                out[domain] = [t for t in train[domain] if t in quick]
        return {d: out[d] for d in train if d in out}
    if name == "sandbox_solved":
        solved = known_solutions()
        out = {}
        for domain, ids in _read_meta(ee, TEST_ALL_LIST).items():
            kept = [t for t in ids if t in solved]
            if kept:
                out[domain] = kept
        return out
    raise ValueError(f"unknown OSWorld task set {name!r}; sets: {', '.join(TASK_SETS)}")


UNSOLVABLE = Path(__file__).with_name("sandbox_unsolvable.json")
SOLUTIONS = Path(__file__).with_name("sandbox_solutions.json")
"""Our scripted solutions of OSWorld's own task files (they carry none), by task id."""


@functools.lru_cache(maxsize=1)
def known_solutions() -> dict[str, dict[str, Any]]:
    """sandbox_solutions.json's entries by task id (read once)."""
    return {k: v for k, v in json.loads(SOLUTIONS.read_text()).items() if not k.startswith("_")}


def known_unsolvable() -> dict[str, str]:
    """sandbox_unsolvable.json: feasible, network-free OSWorld task files that cannot be solved in
    the sandbox, by task id, with the reason (the census's "solvable here" column)."""
    return {k: v for k, v in json.loads(UNSOLVABLE.read_text()).items() if not k.startswith("_")}


def task_set_by_domain(name: str, root: Path | None = None) -> dict[str, list[str]]:
    """domain -> task ids of a set (`train128`, `subset32`, ...; `osworld/<set>` works too)."""
    name = _strip_prefix(name)
    if name not in TASK_SETS:
        close = difflib.get_close_matches(name, list(TASK_SETS), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown OSWorld task set {name!r}.{hint} Sets: {', '.join(TASK_SETS)}")
    root = Path(root or tasks_root())
    _read_manifest(root)  # FileNotFoundError with the fetch hint when nothing is fetched
    return _resolve_set(examples_dir(root), name)


def task_set_source(name: str, root: Path | None = None) -> str:
    """Where a set comes from in this cache: its meta-list file, or the rule that draws it."""
    name = _strip_prefix(name)
    sources = {"train128": TRAIN_LIST, "test_all": TEST_ALL_LIST,
               "subset32": f"the workbench's own draw, NOT ARPO's subset: 32 feasible tasks per domain from "
                           f"{TRAIN_LIST} (neither {' nor '.join(SUBSET32_LISTS)} is in this data)",
               "smoke4": f"rule: 2 os + 2 chrome quick local-setup tasks of {TRAIN_LIST}",
               "chrome10": f"rule: 10 chrome tasks of {TRAIN_LIST} by sha256 rank",
               "sandbox_solved": f"the tasks of {TEST_ALL_LIST} with a scripted solution in sandbox_solutions.json"}
    if name == "subset32":
        for listed in SUBSET32_LISTS:
            if (examples_dir(root) / listed).is_file():
                return listed
    if name not in sources:
        raise ValueError(f"unknown OSWorld task set {name!r}; sets: {', '.join(TASK_SETS)}")
    return sources[name]


def task_set(name: str, root: Path | None = None) -> list[str]:
    """Env names `osworld/<task_id>` of a set, in its meta list's order (domain by domain)."""
    return [f"{ENV_PREFIX}/{t}" for ids in task_set_by_domain(name, root).values() for t in ids]


def expand_task_names(names: Sequence[str], root: Path | None = None) -> list[str]:
    """Replace every `osworld/<set>` by the set's env names, in place in the list.

    `osworld/<task_id>` and names of other families (`miniwob/...`) pass through untouched, as do
    duplicates. An `osworld/` name that looks like a set name (letters, digits, underscores)
    but is not one raises ValueError listing the sets; the data is read only for set names.
    """
    out: list[str] = []
    for name in names:
        family, _, rest = name.partition("/")
        if family == ENV_PREFIX and rest in TASK_SETS:
            out += task_set(rest, root)
        elif family == ENV_PREFIX and _SET_LIKE.match(rest) and not _UUID.match(rest):
            close = difflib.get_close_matches(rest, list(TASK_SETS), n=1)
            hint = f" Did you mean 'osworld/{close[0]}'?" if close else ""
            raise ValueError(f"unknown OSWorld task set {name!r}.{hint} Sets: "
                             f"{', '.join(f'osworld/{s}' for s in TASK_SETS)}; or name a task as osworld/<task_id>")
        else:
            out.append(name)
    return out


# ---- validation and manifest ----------------------------------------------------------------

def _meta_shape_problem(data: Any) -> str | None:
    if not isinstance(data, dict) or not all(
            isinstance(k, str) and isinstance(v, list) and all(isinstance(t, str) for t in v) for k, v in data.items()):
        return "is not a meta list {domain: [task_id, ...]}"
    return None


def _counts_problem(name: str, got: Mapping[str, list[str]], want: Mapping[str, int] | int) -> str | None:
    total = sum(len(v) for v in got.values())
    if isinstance(want, int):
        return None if total == want else f"{name}: {total} tasks, expected {want}"
    counts = {d: len(v) for d, v in got.items() if v}
    if counts != {d: n for d, n in want.items() if n}:
        return f"{name}: per-domain counts {counts} differ from the expected {dict(want)}"
    return None


def _validate_tree(ee: Path, expect: Expectations) -> dict[str, Any]:
    """Check a staged `evaluation_examples/`; raise TaskDataError listing every problem.
    Returns the manifest's data fields (tasks, domains, meta_lists, warnings)."""
    problems: list[str] = []
    warnings: list[str] = []
    tasks: dict[str, str] = {}
    id_mismatches: dict[str, Any] = {}
    examples = ee / "examples"
    if not examples.is_dir():
        raise TaskDataError(f"{EXAMPLES}/examples/ is missing: this is not OSWorld task data")
    for path in sorted(examples.rglob("*")):
        rel = path.relative_to(ee).as_posix()
        if path.is_dir():
            continue
        if path.parent.parent != examples:
            warnings.append(f"{rel}: not in examples/<domain>/, ignored")
            continue
        if path.suffix != ".json":
            warnings.append(f"{rel}: not a .json file, ignored")
            continue
        try:
            task = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            problems.append(f"{rel}: invalid JSON ({exc})")
            continue
        problems += [f"{rel}: {p}" for p in validate_task(task)]
        if isinstance(task, dict) and task.get("id") != path.stem:
            # The fork has such files (15 thunderbird tasks carry other tasks' ids); ARPO's loader
            # uses the file name as the id, and so does this cache.
            id_mismatches[path.stem] = task.get("id")
        if path.stem in tasks:
            problems.append(f"{rel}: task id also in examples/{tasks[path.stem]}/")
        tasks.setdefault(path.stem, path.parent.name)
    if not tasks:
        problems.append(f"{EXAMPLES}/examples/ holds no task files")

    meta_lists: dict[str, dict[str, Any]] = {}
    metas: dict[str, dict[str, list[str]]] = {}
    strict = set(REQUIRED_LISTS) | set(SUBSET32_LISTS) | set(expect.lists)
    for name in REQUIRED_LISTS:
        if not (ee / name).is_file():
            problems.append(f"{EXAMPLES}/{name} is missing")
    for path in sorted(ee.glob("*.json")):
        name = path.name
        report = problems if name in strict else warnings
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            report.append(f"{name}: invalid JSON ({exc})")
            continue
        shape = _meta_shape_problem(data)
        if shape:
            report.append(f"{name} {shape}")
            continue
        own = []
        for domain, ids in data.items():
            for t in ids:
                if tasks.get(t) != domain:
                    where = f"it is in examples/{tasks[t]}/" if t in tasks else "no such task file"
                    own.append(f"{name}: {domain}/{t} is listed but examples/{domain}/{t}.json "
                               f"does not exist ({where})")
            if len(set(ids)) != len(ids):
                own.append(f"{name}: {domain} lists a task twice")
        report += own
        if not own:
            metas[name] = data
        meta_lists[name] = {"total": sum(len(v) for v in data.values()),
                            "domains": {d: len(v) for d, v in data.items()}}
    if TRAIN_LIST in metas and TEST_ALL_LIST in metas:
        test_all = {t for ids in metas[TEST_ALL_LIST].values() for t in ids}
        extra = [t for ids in metas[TRAIN_LIST].values() for t in ids if t not in test_all]
        if extra:
            problems.append(f"{TRAIN_LIST}: {len(extra)} tasks are not in {TEST_ALL_LIST}, e.g. {extra[0]}")
    for name, want in expect.lists.items():
        if name in metas:
            problem = _counts_problem(name, metas[name], want)
            if problem:
                problems.append(problem)
        elif not (ee / name).is_file() and name not in REQUIRED_LISTS:
            problems.append(f"{EXAMPLES}/{name} is missing")
    if not problems:
        for name, size in expect.set_sizes.items():
            got = sum(len(v) for v in _resolve_set(ee, name).values())
            if got != size:
                problems.append(f"task set {name} resolves to {got} tasks, expected {size}")
    if problems:
        shown = "\n  ".join(problems[:20]) + (f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else "")
        raise TaskDataError(f"the OSWorld task data is not valid ({len(problems)} problems):\n  {shown}")
    domains: dict[str, int] = {}
    for domain in tasks.values():
        domains[domain] = domains.get(domain, 0) + 1
    if id_mismatches:
        warnings.insert(0, f"{len(id_mismatches)} task files carry an `id` other than their file name (the "
                           f"file name is the task id, as in ARPO's loader): "
                           + ", ".join(f"{stem[:8]} (id {str(i)[:8]})" for stem, i in sorted(id_mismatches.items())))
    return {"tasks": dict(sorted(tasks.items())), "domains": dict(sorted(domains.items())),
            "meta_lists": meta_lists, "warnings": warnings, "id_mismatches": dict(sorted(id_mismatches.items()))}


def verify_cache(root: Path | None = None) -> list[str]:
    """Re-check the cache against its manifest: every file present with its sha256, no extra
    files, the tree hash, the task index. Returns the problems (empty: intact)."""
    root = Path(root or tasks_root())
    try:
        manifest = _read_manifest(root)
        want = manifest["files"]
    except (FileNotFoundError, KeyError) as exc:
        return [f"no usable manifest: {exc}"]
    ee = examples_dir(root)
    got = fetch.file_hashes(ee, EXAMPLES) if ee.is_dir() else {}
    problems = [f"{p}: missing" for p in want if p not in got]
    problems += [f"{p}: modified (sha256 {got[p][:12]}..., manifest {want[p][:12]}...)"
                 for p in want if p in got and got[p] != want[p]]
    problems += [f"{p}: not in the manifest" for p in got if p not in want]
    if fetch.tree_sha256(want) != manifest.get("tree_sha256"):
        problems.append("manifest: its tree_sha256 does not match its own file list")
    for task_id, domain in manifest.get("tasks", {}).items():
        if f"{EXAMPLES}/examples/{domain}/{task_id}.json" not in want:
            problems.append(f"manifest: task {domain}/{task_id} has no file entry")
    return problems


# ---- fetching -------------------------------------------------------------------------------

def _resolve_source(source: str | os.PathLike[str] | None) -> tuple[str, str | Path]:
    """("url", url) | ("tar", path) | ("dir", evaluation_examples path)."""
    if source is None:
        return "url", OSWORLD_TASKS_URL
    text = os.fspath(source)
    scheme = urllib.parse.urlparse(text).scheme.lower()
    if scheme in ("http", "https"):
        return "url", text
    if scheme == "file":
        text = urllib.request.url2pathname(urllib.parse.urlparse(text).path)
    path = Path(text).expanduser()
    if path.is_dir():
        if (path / EXAMPLES).is_dir():
            return "dir", path / EXAMPLES
        if path.name == EXAMPLES and (path / "examples").is_dir():
            return "dir", path
        raise TaskDataError(f"{path} is a directory without {EXAMPLES}/: give an OSWorld checkout, a tarball or a URL")
    if path.is_file():
        return "tar", path
    raise TaskDataError(f"source {text!r} is neither an http(s) URL nor an existing file or directory")


def fetch_tasks(
    source: str | os.PathLike[str] | None = None,
    dest: str | os.PathLike[str] | None = None,
    force: bool = False,
    progress: bool = True,
    expect: Expectations | None = None,
) -> Path:
    """Fetch, validate and cache the OSWorld task data; returns the cache directory (now active).

    source: None (the pinned commit's GitHub tarball), an http(s) URL, a `file://` URL or path of
        a tarball (gz/bz2/xz/plain; `evaluation_examples/` at its root or under one top dir), or
        a checkout directory containing `evaluation_examples/`.
    dest: the cache directory (default: the slot of the data's commit, `slot_for`; data whose
        commit is unknown gets an `unknown-<tree hash>` slot, never the pinned commit's).
    force: replace a complete cache; otherwise a complete cache makes this a no-op.
    expect: counts to check; default: for the pinned commit PINNED_EXPECTATIONS; for any other
        data the per-domain counts of the 128-task list (ARPO's training set), so that a tree
        whose list is not ARPO's is refused.

    Only `evaluation_examples/` is extracted; every task and the strict meta lists are
    validated; the manifest is written; then the directory is renamed into place. On any
    failure the previous cache (or none) is left as it was and TaskDataError says why. Task
    files whose `id` is not their file name are accepted (the file name is the id, as ARPO's
    loader has it) and listed in the manifest and its warnings.
    """
    if dest is None and source is None and not force and is_fetched(pinned_root()):
        _activate(pinned_root())
        return pinned_root()
    if dest is not None and not force and is_fetched(Path(dest)):
        return Path(dest)  # a complete cache where asked: the source is not even read
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    lock_name = Path(dest).name if dest is not None else "fetch"
    with fetch.locked(Path(dest).parent if dest is not None else root, lock_name):
        staging = (Path(dest).parent if dest is not None else root) / f".staging-{uuid.uuid4().hex[:8]}"
        staging.mkdir(parents=True)
        try:
            kind, where = _resolve_source(source)
            archive_sha, commit = None, None
            if kind == "url":
                archive = staging / "archive.tar"
                archive_sha, _ = fetch.download(str(where), archive, progress, desc="OSWorld tasks", hint=(
                    f"Without access to GitHub, fetch the archive elsewhere (or `git archive` a checkout of "
                    f"{OSWORLD_TASKS_REPO} at {OSWORLD_TASKS_COMMIT}) and run "
                    f"`arpo osworld-tasks fetch --source <file.tar.gz or checkout dir>`"))
                commit = OSWORLD_TASKS_COMMIT if source is None else None
                commit = fetch.extract_subtree(archive, staging, EXAMPLES, MAX_EXAMPLES_BYTES) or commit
                archive.unlink()
            elif kind == "tar":
                archive_sha = fetch.sha256_file(Path(where))
                commit = fetch.extract_subtree(Path(where), staging, EXAMPLES, MAX_EXAMPLES_BYTES)
            else:
                fetch.copy_tree(Path(where), staging, EXAMPLES, MAX_EXAMPLES_BYTES)
            pinned = commit == OSWORLD_TASKS_COMMIT
            if expect is None:
                expect = PINNED_EXPECTATIONS if pinned else Expectations(lists={TRAIN_LIST: TRAIN128_DOMAINS})
            info = _validate_tree(staging / EXAMPLES, expect)
            files = fetch.file_hashes(staging / EXAMPLES, EXAMPLES)
            tree = fetch.tree_sha256(files)
            target = Path(dest) if dest is not None else slot_for(commit, tree)
            if not force and is_fetched(target):  # the same data is cached already
                log.info("already cached: %s (the same data; --force fetches again)", target)
                _activate(target)
                return target
            manifest = {
                "format": MANIFEST_FORMAT,
                "repo": OSWORLD_TASKS_REPO if pinned else None,
                "commit": commit,
                "source": str(where) if kind != "dir" else str(Path(where).resolve()),
                "archive_sha256": archive_sha,
                "fetched_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "expectations": dataclasses.asdict(expect),
                "domains": info["domains"],
                "task_count": len(info["tasks"]),
                "file_count": len(files),
                "tree_sha256": tree,
                "meta_lists": info["meta_lists"],
                "warnings": info["warnings"],
                "id_mismatches": info["id_mismatches"],
                "tasks": info["tasks"],
                "files": files,
            }
            atomic_write_text(staging / MANIFEST, json.dumps(manifest, indent=1) + "\n")
            target.parent.mkdir(parents=True, exist_ok=True)
            fetch.swap_into_place(staging, target)
        except fetch.FetchError as exc:
            raise TaskDataError(str(exc)) from exc
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)
    if dest is None or Path(dest).parent == root:
        _activate(target)
    return target


def _activate(slot: Path) -> None:
    """Make `slot` the data runs read (tasks_root)."""
    atomic_write_text(cache_root() / ACTIVE, json.dumps({"slot": slot.name}) + "\n")


def read_manifest(root: Path | None = None) -> dict[str, Any]:
    """The cache's manifest (FileNotFoundError with the fetch command when nothing is fetched)."""
    return _read_manifest(Path(root or tasks_root()))
