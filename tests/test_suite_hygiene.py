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
