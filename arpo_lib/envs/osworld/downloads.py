"""One download cache per machine for the files OSWorld task set-ups download.

75 of ARPO's 128 training tasks download files in their set-up (100 downloads, many from Google
Drive). desktop-env's set-up controller saves each one as
`<cache_dir>/<task id>/<uuid5(NAMESPACE_URL, url)>_<basename of the VM path>` and skips the
download when that file exists. Every environment here has its own cache_dir (its VM state and
the files the checkers fetch from the VM must not be shared), so without help every episode of
every environment downloads again.

`DownloadCache` is the shared part: a machine-wide directory of finished downloads under those
same names. Before a task's set-up the files it will download are linked (or copied) into the
environment's own directory from the shared one (`prefill`); after a set-up the files desktop-env
downloaded are added to the shared one (`harvest`), atomically and under a lock, so the next
environment finds them. `prefetch` fills it ahead of a run (resumable, checksummed, failures
reported per task): `./workbench osworld-tasks prefetch [SET]`.

Standard library only (it runs in OSWorld's interpreter).
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

INDEX = "downloads.json"
"""In the cache: file name -> {url, sha256, size, tasks}."""


ENV_VAR = "ARPO_OSWORLD_DOWNLOADS"
"""Overrides the machine's download cache directory."""


def default_download_cache() -> Path:
    """`$ARPO_OSWORLD_DOWNLOADS`, else ~/.cache/arpo-workbench/osworld-downloads."""
    if os.environ.get(ENV_VAR):
        return Path(os.environ[ENV_VAR]).expanduser()
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "arpo-workbench" / "osworld-downloads"


def task_downloads(task: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(url, cache file name) of every file a task's set-up downloads, in desktop-env's naming."""
    out = []
    for step in task.get("config") or []:
        if not isinstance(step, Mapping) or step.get("type") != "download":
            continue
        for f in (step.get("parameters") or {}).get("files") or []:
            url, path = f.get("url"), f.get("path")
            if isinstance(url, str) and isinstance(path, str) and url and path:
                out.append((url, f"{uuid.uuid5(uuid.NAMESPACE_URL, url)}_{os.path.basename(path)}"))
    return out


@dataclass
class PrefetchReport:
    downloaded: list[str] = field(default_factory=list)
    cached: list[str] = field(default_factory=list)
    failed: dict[str, list[str]] = field(default_factory=dict)
    """task id -> the errors of its downloads that failed."""

    def summary(self) -> str:
        lines = [f"{len(self.downloaded)} downloaded, {len(self.cached)} already cached, "
                 f"{sum(len(v) for v in self.failed.values())} failed"]
        for task, errors in sorted(self.failed.items()):
            lines.append(f"  {task}: " + "; ".join(errors))
        return "\n".join(lines)


class DownloadCache:
    """A directory of finished downloads shared by every OSWorld environment of a machine."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def path(self, name: str) -> Path:
        return self.root / name

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.root.mkdir(parents=True, exist_ok=True)
        try:
            import fcntl
        except ImportError:  # no advisory locks on this platform: atomic renames still hold
            yield
            return
        with open(self.root / ".lock", "w") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def prefill(self, task: Mapping[str, Any], task_dir: Path) -> int:
        """Put the cached downloads of `task` where desktop-env looks for them (`task_dir` =
        `<cache_dir>/<task id>`); returns how many. Hard links where possible, else copies."""
        placed = 0
        for _, name in task_downloads(task):
            source, target = self.path(name), Path(task_dir) / name
            if not source.is_file() or target.exists():
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(source, target)
            except OSError:
                shutil.copyfile(source, target)
            placed += 1
        return placed

    def harvest(self, task: Mapping[str, Any], task_dir: Path) -> int:
        """Add the files desktop-env downloaded for `task` (in `task_dir`) to the shared cache;
        returns how many were new. A file appears in the cache whole or not at all."""
        added = 0
        for url, name in task_downloads(task):
            source = Path(task_dir) / name
            if not source.is_file() or source.stat().st_size == 0 or self.path(name).exists():
                continue
            with self._locked():
                if self.path(name).exists():
                    continue
                self._store(source, name, url, str(task.get("id")))
                added += 1
        return added

    def _store(self, source: Path, name: str, url: str, task_id: str) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".tmp-")
        os.close(fd)
        shutil.copyfile(source, tmp)
        os.replace(tmp, self.path(name))
        self._index(name, url, task_id)

    def _index(self, name: str, url: str, task_id: str) -> None:
        from arpo_lib.run.fetch import sha256_file

        index = self.index()
        entry = index.setdefault(name, {"url": url, "tasks": []})
        entry.update(sha256=sha256_file(self.path(name)), size=self.path(name).stat().st_size)
        if task_id not in entry["tasks"]:
            entry["tasks"].append(task_id)
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".tmp-")
        with os.fdopen(fd, "w") as fh:
            json.dump(index, fh, indent=1, sort_keys=True)
        os.replace(tmp, self.root / INDEX)

    def index(self) -> dict[str, Any]:
        try:
            return json.loads((self.root / INDEX).read_text())
        except (OSError, ValueError):
            return {}

    def verify(self, name: str) -> bool:
        """The cached file matches its recorded sha256 (a damaged one is removed)."""
        from arpo_lib.run.fetch import sha256_file

        entry, path = self.index().get(name), self.path(name)
        if not path.is_file() or not entry:
            return False
        if sha256_file(path) != entry.get("sha256"):
            path.unlink(missing_ok=True)
            return False
        return True

    def prefetch(self, tasks: Sequence[Mapping[str, Any]], progress: bool = True) -> PrefetchReport:
        """Download every file these tasks' set-ups need into the cache; files already cached
        (and intact) are skipped, so an interrupted prefetch resumes where it stopped."""
        from arpo_lib.run import fetch

        report = PrefetchReport()
        for task in tasks:
            task_id = str(task.get("id"))
            for url, name in task_downloads(task):
                if self.verify(name):
                    report.cached.append(name)
                    continue
                self.root.mkdir(parents=True, exist_ok=True)
                fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".tmp-")
                os.close(fd)
                try:
                    fetch.download(url, Path(tmp), progress, max_bytes=4 << 30, desc=name[:40])
                    with self._locked():
                        os.replace(tmp, self.path(name))
                        self._index(name, url, task_id)
                    report.downloaded.append(name)
                except fetch.FetchError as exc:
                    report.failed.setdefault(task_id, []).append(f"{url}: {exc}"[:300])
                finally:
                    Path(tmp).unlink(missing_ok=True)
        return report
