"""The suite's own leak check (tests/conftest.py): a process a test starts and leaves running
fails the session, is named with the test that started it, and is killed."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_a_leaked_process_fails_the_session_and_is_killed(tmp_path):
    (tmp_path / "test_leaky.py").write_text(
        "import subprocess\n"
        "def test_leaks():\n"
        "    subprocess.Popen(['sleep', '300'], start_new_session=True)\n")
    env = {k: v for k, v in os.environ.items() if k != "ARPO_TEST_SESSION"}
    env.update(ARPO_LEAK_GRACE_S="1", PYTHONPATH=str(REPO))
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider",
                          "--rootdir", str(tmp_path), str(tmp_path / "test_leaky.py")],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "1 passed" in run.stdout and "outlived them" in run.stdout and "sleep 300" in run.stdout
    assert "test_leaky.py::test_leaks" in run.stdout
    leftover = subprocess.run(["pgrep", "-f", "^sleep 300$"], capture_output=True, text=True).stdout.split()
    assert not [p for p in leftover if "ARPO_TEST_SESSION" in Path(f"/proc/{p}/environ").read_text(errors="ignore")]


def test_the_long_variants_of_a_test_run_only_under_the_long_flag(tmp_path):
    """`@pytest.mark.long_variants("gnome")`: the test's `gnome` variant is skipped in CI and runs
    under ARPO_LONG_TESTS=1; its other variants run in both."""
    (tmp_path / "test_variants.py").write_text(
        "import pytest\n"
        "@pytest.mark.long_variants('gnome')\n"
        "@pytest.mark.parametrize('desktop', ['openbox', 'gnome'])\n"
        "def test_attack(desktop):\n"
        "    pass\n")
    outcomes = {}
    for flag in ("0", "1"):
        env = {k: v for k, v in os.environ.items() if k != "ARPO_TEST_SESSION"}
        env.update(ARPO_LONG_TESTS=flag, PYTHONPATH=str(REPO))
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "tests.conftest", "-p", "no:cacheprovider",
                              "-c", str(REPO / "pyproject.toml"), "--rootdir", str(tmp_path), str(tmp_path / "test_variants.py")],
                             cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stdout + run.stderr
        outcomes[flag] = run.stdout
    assert "1 passed, 1 skipped" in outcomes["0"] and "a long test: ARPO_LONG_TESTS=1 runs it" in outcomes["0"]
    assert "2 passed" in outcomes["1"] and "skipped" not in outcomes["1"]
