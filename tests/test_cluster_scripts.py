"""scripts/ray_head.sh and scripts/ray_env_node.sh: a Ray cluster for the environments, here a
head and an environment node on this machine (each with its own temporary directory and ports),
checked through Ray itself, then stopped by the scripts without a process of theirs left over."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RAY = REPO / ".venv" / "bin" / "ray"
MARK = "ARPO_RAY_SCRIPTS_TEST"
"""Set in the scripts' environment: every process of the nodes they start inherits it."""

needs_ray_cli = pytest.mark.skipif(not RAY.exists(), reason="no ray in .venv (./workbench setup)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _marked(tag: str) -> list[str]:
    """Command lines of live processes (not zombies) whose environment carries MARK=tag."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if f"{MARK}={tag}".encode() not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            found.append((entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:160])
        except OSError:
            continue
    return found


def _script(name: str, *args: str, env: dict[str, str], timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(REPO / "scripts" / name), *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture
def script_env(tmp_path):
    tag = uuid.uuid4().hex
    env = {**os.environ, MARK: tag, "ARPO_RAY_STATE_DIR": str(tmp_path / "state"), "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    return tag, env


@needs_ray_cli
@pytest.mark.slow
def test_a_head_and_an_environment_node_make_a_cluster_with_the_slots_asked_for(script_env):
    tag, env = script_env
    # Ray's socket paths must stay short (AF_UNIX): a short directory of its own, not pytest's tmp_path
    temp = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))
    small = ["--", "--object-store-memory", str(100 * 2**20)]
    try:
        head = _script("ray_head.sh", "--port", str(_free_port()), "--num-cpus", "1", "--temp-dir", str(temp / "h"),
                       *small, "--include-dashboard=false", env=env)
        assert head.returncode == 0, head.stderr
        address = head.stdout.strip().splitlines()[-1]
        assert "env.ray_address=" + address in head.stderr
        node = _script("ray_env_node.sh", address, "--slots", "2", "--num-cpus", "1", "--temp-dir", str(temp / "n"),
                       *small, env=env)
        assert node.returncode == 0, node.stderr
        again = _script("ray_env_node.sh", address, "--slots", "2", env=env)
        assert again.returncode == 1 and "still runs" in again.stderr  # one node per name and state directory
        probe = subprocess.run(
            [sys.executable, "-c",
             "import json, sys, ray\n"
             "ray.init(address=sys.argv[1], log_to_driver=False, logging_level='WARNING')\n"
             "print(json.dumps([ray.cluster_resources().get('env_slot'), sum(n['Alive'] for n in ray.nodes())]))\n"
             "ray.shutdown()\n", address],
            env=env, capture_output=True, text=True, timeout=120)
        assert probe.returncode == 0, probe.stderr
        assert probe.stdout.strip().splitlines()[-1] == "[2.0, 2]"  # the environment node's 2 slots, 2 nodes alive
    finally:
        stopped = [_script("ray_env_node.sh", "--stop", env=env), _script("ray_head.sh", "--stop", env=env)]
        deadline = time.monotonic() + 20
        while _marked(tag) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = _marked(tag)
        shutil.rmtree(temp, ignore_errors=True)
    assert all(s.returncode == 0 for s in stopped), [s.stderr for s in stopped]
    assert "stopped the env-node" in stopped[0].stderr and "stopped the head" in stopped[1].stderr
    assert not left, left  # no raylet, control store or worker of these nodes is left


@needs_ray_cli
def test_the_scripts_say_what_is_wrong_before_starting_anything(script_env):
    tag, env = script_env
    no_address = _script("ray_env_node.sh", "--slots", "2", env=env)
    assert no_address.returncode == 1 and "give the head's ADDRESS" in no_address.stderr
    bad_slots = _script("ray_head.sh", "--slots", "many", env=env)
    assert bad_slots.returncode == 1 and "--slots takes a number" in bad_slots.stderr
    nothing = _script("ray_head.sh", "--stop", env=env)
    assert nothing.returncode == 0 and "no head started here is running" in nothing.stderr
    assert not _marked(tag)
