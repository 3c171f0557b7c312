"""The OSWorld task cache: where the fetched task data lives, its manifest, and checks of it.

The cache, `~/.cache/arpo-workbench/osworld-tasks/<commit12>/` (root overridable with
`$ARPO_OSWORLD_TASKS`), holds `evaluation_examples/` and `manifest.json` (source, commit, archive
sha256, per-domain counts, sha256 of every file). It has one slot per commit; `active.json` in its
root names the slot runs read (the last one fetched). Fetching into it and validating what is
fetched: `tasks.fetch_tasks`. Standard library only.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from arpo_lib.run import fetch
from arpo_lib.run.records import atomic_write_text

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

FETCH_HINT = ("fetch it with `./workbench osworld-tasks fetch` (or `python -m arpo_lib osworld-tasks "
              "fetch`; offline: `--source <OSWorld tarball or checkout>`)")


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


def read_manifest(root: Path | None = None) -> dict[str, Any]:
    """The cache's manifest (FileNotFoundError with the fetch command when nothing is fetched)."""
    return _read_manifest(Path(root or tasks_root()))


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


def _activate(slot: Path) -> None:
    """Make `slot` the data runs read (tasks_root)."""
    atomic_write_text(cache_root() / ACTIVE, json.dumps({"slot": slot.name}) + "\n")


def _strip_prefix(task_id: str) -> str:
    return task_id[len(ENV_PREFIX) + 1:] if task_id.startswith(ENV_PREFIX + "/") else task_id
