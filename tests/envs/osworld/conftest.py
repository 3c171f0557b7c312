"""The interpreter with OSWorld's desktop_env, for the tests that run OSWorld's own code."""
from __future__ import annotations

import os
import subprocess
import sysconfig
from pathlib import Path

import pytest

from arpo_lib.envs.desktop.sandbox import desktop_unavailable
from arpo_lib.envs.osworld import env as osworld

REPO = Path(__file__).resolve().parents[3]
TEST_VENV = osworld.workbench_cache() / "test-venv-osworld"


@pytest.fixture(scope="session")
def osworld_python() -> str:
    """$ARPO_OSWORLD_PYTHON where set; else the tests' own OSWorld environment, built by
    `setup_osworld.sh --light` (desktop-env 1.0.2 and what its evaluator imports, ~1.5 GB, about a
    minute the first time on a machine; torch borrowed from this environment)."""
    if desktop_unavailable():
        pytest.skip(desktop_unavailable() or "")
    if os.environ.get("ARPO_OSWORLD_PYTHON"):
        return os.environ["ARPO_OSWORLD_PYTHON"]
    env = {**os.environ, "ARPO_OSWORLD_VENV": str(TEST_VENV), "ARPO_OSWORLD_TORCH_FROM": sysconfig.get_paths()["purelib"]}
    done = subprocess.run(["bash", str(REPO / "scripts" / "setup_osworld.sh"), "--light"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]
