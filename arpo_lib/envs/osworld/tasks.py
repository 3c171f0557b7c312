"""OSWorld task data: the ARPO fork's `evaluation_examples/`, fetched once, validated, cached.

ARPO trains and evaluates on task files from its authors' OSWorld fork (FanbinLu/OSWorld, the
commit pinned by ARPO's `OSWorld` submodule). These modules bring exactly that directory onto the
machine and name the task sets the workbench uses. Standard library only: no torch, no OSWorld.

Layout of the fork's `evaluation_examples/` (and of `test_data/osworld/evaluation_examples/`):

    examples/<domain>/<task_id>.json      one task: id, snapshot, instruction, config, evaluator, ...
    test_all.json                         meta list {domain: [task_id, ...]}: all 369 test tasks
    test_success_uitars1.5_wo_impossible.json   ARPO's 128 training tasks (same format)
    test_small.json, ...                  other meta lists

Three modules: `task_cache` (where the data lives, its manifest, `verify_cache`), `task_sets`
(`train128`, `subset32`, ...: `task_set`, `expand_task_names`) and this one: fetching the data
into the cache and validating it (`fetch_tasks`, `validate_task`), and reading one task
(`load_task`, `task_domain`). Every name of the three is importable from here.

A fetch extracts into a staging directory, validates everything, writes the manifest and only
then renames the directory into place: a failed fetch leaves the previous cache (or none), never
a partial one. A fetch of the pinned commit checks that every task set has exactly its size.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import logging
import os
import shutil
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from arpo_lib.run import fetch
from arpo_lib.envs.osworld.task_cache import (  # noqa: F401 - names of the task data, importable from here
    ACTIVE, ENV_PREFIX, ENV_VAR, EXAMPLES, FETCH_HINT, MANIFEST, MANIFEST_FORMAT, OSWORLD_TASKS_COMMIT,
    OSWORLD_TASKS_REPO, OSWORLD_TASKS_URL, _activate, _read_manifest, _strip_prefix, cache_root, cached_task_ids,
    examples_dir, is_fetched, pinned_root, provenance, read_manifest, slot_for, tasks_root, verify_cache,
)
from arpo_lib.envs.osworld.task_sets import (  # noqa: F401
    LOCAL_SETUP_STEPS, SOLUTIONS, SUBSET32_LISTS, TASK_SETS, TEST_ALL_LIST, TRAIN_LIST, UNSOLVABLE, _resolve_set,
    expand_task_names, known_solutions, known_unsolvable, proportional_quota, stable_subset, task_set,
    task_set_by_domain, task_set_source,
)
from arpo_lib.run.records import atomic_write_text

log = logging.getLogger(__name__)

REQUIRED_LISTS = (TEST_ALL_LIST, TRAIN_LIST)
"""Meta lists a fetched tree must have. These and the subset lists (when present) are checked
strictly; problems in other meta lists are recorded as warnings in the manifest."""
TRAIN128_DOMAINS = {"chrome": 18, "gimp": 19, "libreoffice_calc": 12, "libreoffice_impress": 13,
                    "libreoffice_writer": 11, "multi_apps": 11, "os": 12, "thunderbird": 7, "vlc": 6, "vs_code": 19}
"""ARPO's 128 training tasks per domain: checked for any source (a different list is not ARPO's)."""

MAX_EXAMPLES_BYTES = 256 << 20
"""evaluation_examples/ is a few MB; more than this is not OSWorld task data."""


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


# ---- reading tasks --------------------------------------------------------------------------

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


# ---- validating and fetching a tree ---------------------------------------------------------

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
