"""The task sets the workbench names (`osworld/train128`, ...), resolved against the task cache.

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

import difflib
import functools
import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from arpo_lib.envs.osworld.task_cache import ENV_PREFIX, _read_manifest, _strip_prefix, examples_dir, tasks_root

TEST_ALL_LIST = "test_all.json"
TRAIN_LIST = "test_success_uitars1.5_wo_impossible.json"
SUBSET32_LISTS = ("test_subset32.json", "test_success_middle_difficult.json")
"""ARPO's 32-task subset: the fork holds `test_subset32.json` (32 tasks of the 128, none
infeasible); ARPO's examples/osworld_subset32.sh names `test_success_middle_difficult.json`,
which no public copy of the fork has. The first present is used."""
LOCAL_SETUP_STEPS = frozenset({"launch", "execute", "command", "open", "activate_window", "sleep"})
"""Setup steps that need nothing outside the VM (smoke4's criterion)."""

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
