"""Which desktop_env scored a result (envs/osworld/build_info.py): read in the interpreter that
runs the environment workers, recorded in results and runs, and mixed builds warned about."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


import pytest

from arpo_lib.envs.osworld import build_info
from arpo_lib.envs.osworld.build_info import desktop_env_build, same_build

REPO = Path(__file__).resolve().parents[3]


def _stand_in_fork(root: Path) -> Path:
    """A desktop_env tree shaped like the fork's (pause() in desktop_env.py), not its code."""
    pkg = root / "desktop_env"
    (pkg / "evaluators" / "metrics").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "desktop_env.py").write_text("class DesktopEnv:\n    def pause(self):\n        pass\n")
    (pkg / "evaluators" / "metrics" / "table.py").write_text("def compare_table(a, b):\n    return 1.0\n")
    return root


def test_the_tests_osworld_environment_is_pypis_1_0_2(osworld_python):
    build = desktop_env_build(osworld_python)
    assert build["label"] == "pypi desktop-env 1.0.2" and build["source"] == "pypi", build
    assert build["version"] == "1.0.2" and build["has_pause"] is False
    assert build["evaluators_sha256"] == "7f939d663086cc2a"  # KNOWN_EVALUATORS names it without the marker
    assert "1.0.2" in build_info.KNOWN_EVALUATORS[build["evaluators_sha256"]]


def test_a_desktop_env_on_the_path_is_read_and_told_apart(tmp_path, monkeypatch):
    build_info._probe.cache_clear()
    monkeypatch.setenv("PYTHONPATH", str(_stand_in_fork(tmp_path)))
    fork_like = desktop_env_build(sys.executable)
    assert fork_like["installed"] and fork_like["has_pause"] and fork_like["source"] == "unknown"
    assert fork_like["label"].startswith("desktop_env None installed by hand (evaluators ")
    pypi = {"installed": True, "evaluators_sha256": "7f939d663086cc2a", "has_pause": False}
    assert not same_build(fork_like, pypi) and same_build(fork_like, dict(fork_like))
    assert not same_build(fork_like, None)  # a result from before builds were recorded: unknown
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "nothing-here"))
    build_info._probe.cache_clear()
    assert desktop_env_build(sys.executable)["label"].startswith("no desktop_env")
    assert desktop_env_build(sys.executable, provider="fake")["source"] == "fake"


def test_the_setup_scripts_choice_is_checked_before_anything_is_built(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "ARPO_OSWORLD_VENV": str(tmp_path / "venv")}

    def setup(*args: str, **extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "scripts/setup_osworld.sh", *args], cwd=REPO, env={**env, **extra},
                              capture_output=True, text=True, timeout=60)

    done = setup("--desktop-env=github")
    assert done.returncode != 0 and "fork (ARPO's, the default) or pypi" in done.stderr
    done = setup("--desktop-env=fork", ARPO_DESKTOP_ENV_SOURCE=str(tmp_path / "missing"))
    assert done.returncode != 0 and "does not exist" in done.stderr
    (tmp_path / "not-osworld").mkdir()
    done = setup(ARPO_DESKTOP_ENV_SOURCE=str(tmp_path / "not-osworld"))  # fork is the default
    assert done.returncode != 0 and "is not an OSWorld tree" in done.stderr
    assert not (tmp_path / "venv").exists()
    assert "--desktop-env=fork (default)" in setup("--help").stderr


def test_a_comparison_across_protocols_or_desktop_envs_warns():
    from arpo_lib.viz.plots import compare_eval

    def result(protocol: str, build: dict | None) -> dict:
        return {"protocol": protocol, "desktop_env": build, "success_rate": 0.5, "pass_at_k": 0.5,
                "tasks": [{"task": "osworld/a", "success_rate": 0.5, "pass_at_k": 0.5, "samples": 2}]}

    fork = {"installed": True, "evaluators_sha256": "b8033a29b2441506", "has_pause": True, "label": "fork X@7a6409d"}
    pypi = {"installed": True, "evaluators_sha256": "7f939d663086cc2a", "has_pause": False,
            "label": "pypi desktop-env 1.0.2"}
    assert "WARNING" not in compare_eval(result("osworld_uitars", fork), result("osworld_uitars", dict(fork)))
    text = compare_eval(result("osworld_uitars", fork), result("osworld_uitars", pypi))
    assert "WARNING: the OSWorld checkers differ: trained scored by fork X@7a6409d, baseline by pypi desktop-env " \
           "1.0.2" in text
    text = compare_eval(result("osworld_uitars", fork), result("run", None))
    assert "protocol 'osworld_uitars'" in text and "baseline by not recorded" in text
    assert "WARNING" not in compare_eval(result("run", None), result("run", None))  # MiniWoB: nothing to say


def test_a_run_records_its_desktop_env_and_keeps_a_changed_one(tmp_path, monkeypatch):
    from arpo_lib import build
    from arpo_lib.run.config import load_config

    cfg = load_config(REPO / "configs" / "osworld_smoke4.yaml", [f"out_dir={tmp_path}", "name=r"])
    builds = iter([{"installed": True, "evaluators_sha256": "1", "has_pause": True, "label": "fork A"},
                   {"installed": True, "evaluators_sha256": "1", "has_pause": True, "label": "fork A"},
                   {"installed": True, "evaluators_sha256": "2", "has_pause": False, "label": "pypi B"}])
    monkeypatch.setattr(build_info, "desktop_env_of", lambda cfg: next(builds))
    assert build.record_desktop_env(cfg)["label"] == "fork A"
    assert build.record_desktop_env(cfg)["previous"] == []  # the same build: the record stands
    record = build.record_desktop_env(cfg)
    assert record["label"] == "pypi B" and [p["label"] for p in record["previous"]] == ["fork A"]
    assert json.loads((tmp_path / "r" / "desktop_env.json").read_text()) == record
    miniwob = load_config(REPO / "configs" / "smoke.yaml", [f"out_dir={tmp_path}"])
    monkeypatch.undo()
    assert build.record_desktop_env(miniwob) is None


@pytest.mark.slow
def test_setup_osworld_names_the_offline_choices_when_the_fork_cannot_be_fetched(tmp_path):
    """The fork comes from GitHub; where it cannot be reached, the failure says what to do instead
    (PyPI's desktop-env, or a local copy of the fork), not pip's error alone."""
    env = {**os.environ, "ARPO_OSWORLD_VENV": str(tmp_path / "venv"), "PIP_NO_INDEX": "1",
           "https_proxy": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9", "PIP_RETRIES": "0",
           "PIP_TIMEOUT": "5"}
    done = subprocess.run(["bash", str(REPO / "scripts" / "setup_osworld.sh"), "--light"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode != 0
    assert "--desktop-env=pypi" in done.stderr and "ARPO_DESKTOP_ENV_SOURCE" in done.stderr, done.stderr[-2000:]
