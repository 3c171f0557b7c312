"""The machine's OSWorld download cache: desktop-env's file names, prefill and harvest, and
`osworld-tasks prefetch` against a local HTTP server (resumable, checksummed, failures per task)."""
from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

from arpo_lib import cli
from arpo_lib.envs.osworld import tasks as ot
from arpo_lib.envs.osworld.downloads import DownloadCache, task_downloads
from tests.envs.osworld.test_tasks import FIXTURE_EXPECT, serve

FIXTURE = Path(__file__).resolve().parents[3] / "test_data" / "osworld"


def _task(url: str, vm_path: str = "/home/user/data.xlsx") -> dict:
    return {"id": "t1", "config": [{"type": "launch", "parameters": {"command": ["x"]}},
                                   {"type": "download", "parameters": {"files": [{"url": url, "path": vm_path}]}}]}


def test_file_names_are_desktop_envs():
    url = "https://drive.google.com/uc?id=abc&export=download"
    assert task_downloads(_task(url)) == [(url, f"{uuid.uuid5(uuid.NAMESPACE_URL, url)}_data.xlsx")]
    assert task_downloads({"config": [{"type": "open", "parameters": {"path": "/x"}}]}) == []


def test_prefill_and_harvest(tmp_path):
    cache = DownloadCache(tmp_path / "shared")
    task = _task("http://h/a.xlsx")
    (_, name), = task_downloads(task)
    env_dir = tmp_path / "env1" / "t1"
    env_dir.mkdir(parents=True)
    (env_dir / name).write_bytes(b"sheet")
    assert cache.harvest(task, env_dir) == 1 and cache.harvest(task, env_dir) == 0
    assert cache.verify(name) and cache.index()[name]["url"] == "http://h/a.xlsx"
    other = tmp_path / "env2" / "t1"
    assert cache.prefill(task, other) == 1 and (other / name).read_bytes() == b"sheet"
    (tmp_path / "shared" / name).write_bytes(b"damaged")
    assert not cache.verify(name) and not (tmp_path / "shared" / name).exists()  # removed, refetched later


def test_prefetch_cli_downloads_resumes_and_reports_failures(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(ot.ENV_VAR, str(tmp_path / "tasks"))
    checkout = tmp_path / "checkout"
    shutil.copytree(FIXTURE / "evaluation_examples", checkout / "evaluation_examples")
    with serve({"/a.xlsx": b"A" * 100, "/b.xlsx": b"B" * 50}) as (base, state):
        wanted = []
        for path in sorted((checkout / "evaluation_examples" / "examples").rglob("*.json")):
            task = json.loads(path.read_text())
            changed = False
            for step in task.get("config", []):
                if step.get("type") == "download":
                    for i, f in enumerate(step["parameters"]["files"]):
                        f["url"] = f"{base}/{'a' if not wanted else 'missing'}.xlsx"
                        wanted.append(f["url"])
                        changed = True
            if changed:
                path.write_text(json.dumps(task))
        assert len(wanted) >= 2
        ot.fetch_tasks(checkout, expect=FIXTURE_EXPECT, progress=False)
        downloads = tmp_path / "downloads"
        assert cli.main(["osworld-tasks", "prefetch", "test_all", "--cache", str(downloads), "--no-progress"]) == 1
        out = capsys.readouterr().out
        assert "1 downloaded, 0 already cached" in out and "404" in out  # the missing file, named per task
        assert cli.main(["osworld-tasks", "prefetch", "test_all", "--cache", str(downloads), "--no-progress"]) == 1
        assert "0 downloaded, 1 already cached" in capsys.readouterr().out  # resumed: nothing fetched twice
    cache = DownloadCache(downloads)
    assert [e["size"] for e in cache.index().values()] == [100]
