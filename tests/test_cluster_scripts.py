"""scripts/ray_head.sh and scripts/ray_env_node.sh: a Ray cluster for the environments, here a
head and an environment node on this machine (each with its own temporary directory and ports),
checked through Ray itself, then stopped by the scripts without a process of theirs left over.
Under a fake SLURM whose srun runs each node's command here: scripts/slurm_env_nodes.sh (the
environment nodes as an allocation of their own) and scripts/slurm_train.sh's Ray part (the head
beside rank 0 in a heterogeneous job, or a head elsewhere; the training nodes joining it)."""
from __future__ import annotations

import json
import os
import shutil
import signal
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
@pytest.mark.long  # both SLURM recipes below start and stop the same two scripts in CI
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
             "from arpo_lib.envs.workers.ray_pool import use_token_when_there_is_one\n"
             "use_token_when_there_is_one()\n"
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


# ---- under SLURM: a fake srun that runs each node's command on this machine ---------------------

FIRST_NODE = socket.gethostname()
"""The fake job's first node: this machine, so that the launch check resolves it."""


def _fake_slurm(tmp_path: Path, env: dict[str, str], temp: Path, **job: str) -> dict[str, str]:
    """`env` for a SLURM job on this machine: `scontrol` names it the first of two nodes; `srun` runs
    an environment node's command here in the background-able foreground with a Ray temporary
    directory of its own (as on another machine), and writes a training command to tmp_path/train
    instead of running it."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f"#!/bin/sh\nprintf '{FIRST_NODE}\\ngpu-b\\n'\n")
    (bin_dir / "srun").write_text(
        "#!/bin/bash\n"
        'while [ "${1#--}" != "$1" ]; do shift; done\n'  # srun's options
        f'if [ "$1 $2" = "bash -c" ]; then printf %s "$3" > {tmp_path}/train; exit 0; fi\n'
        f'export ARPO_RAY_START_ARGS="--temp-dir {temp}/node --num-cpus 1 --object-store-memory {100 * 2**20}"\n'
        'exec "$@"\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return {**env, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "gpu-[a-b]", "SLURM_NNODES": "2",
            "SLURM_GPUS_PER_NODE": "8", "SLURM_JOB_ID": "4242",
            "ARPO_RAY_START_ARGS": f"--temp-dir {temp}/head --num-cpus 1 --object-store-memory {100 * 2**20} "
                                   "--include-dashboard=false", **job}


def _cluster_facts(address: str, env: dict[str, str]) -> tuple[float, int]:
    """(env_slots offered, nodes alive) as a driver attached at `address` sees them."""
    probe = subprocess.run(
        [sys.executable, "-c",
         "import json, sys, ray\n"
         "from arpo_lib.envs.workers.ray_pool import use_token_when_there_is_one\n"
         "use_token_when_there_is_one()\n"
         "ray.init(address=sys.argv[1], log_to_driver=False, logging_level='WARNING')\n"
         "print(json.dumps([ray.cluster_resources().get('env_slot', 0), sum(n['Alive'] for n in ray.nodes())]))\n"
         "ray.shutdown()\n", address], env=env, capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr
    slots, alive = json.loads(probe.stdout.strip().splitlines()[-1])
    return slots, alive


def _gone(tag: str, within_s: float = 60) -> list[str]:
    deadline = time.monotonic() + within_s
    while _marked(tag) and time.monotonic() < deadline:
        time.sleep(0.5)
    return _marked(tag)


@needs_ray_cli
@pytest.mark.slow
def test_environment_nodes_of_their_own_allocation_and_a_training_job_that_joins_them(script_env, tmp_path):
    """The second-allocation recipe: scripts/slurm_env_nodes.sh (2 nodes) starts the head on its first
    node and the other node's `ray_env_node.sh --block` through srun, and writes the head's address;
    scripts/slurm_train.sh, given that file (ARPO_RAY_HEAD), waits for it, checks the head answers
    and has every training node join with no slots before it trains at that address. The recorded
    training command, run here as far as its join, adds a node without slots; the environment job
    ended as scancel ends it (SIGTERM) leaves no process of any node."""
    tag, env = script_env
    temp = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))
    address_file = tmp_path / "runs" / "ray-head.address"
    env = _fake_slurm(tmp_path, env, temp, ARPO_ENV_SLOTS="2", ARPO_RAY_ADDRESS_FILE=str(address_file),
                      ARPO_RAY_PORT=str(_free_port()))
    log = tmp_path / "slurm-envs.out"
    with open(log, "w") as out:
        env_job = subprocess.Popen(["bash", str(REPO / "scripts" / "slurm_env_nodes.sh")], cwd=REPO, env=env,
                                   stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        train = subprocess.run(["bash", "scripts/slurm_train.sh", "configs/osworld_full128.yaml", "train.steps=60"],
                               cwd=REPO, env={**env, "ARPO_RAY_HEAD": str(address_file)}, capture_output=True,
                               text=True, timeout=300)
        assert train.returncode == 0, train.stdout + train.stderr
        address = address_file.read_text().strip()
        assert _eventually_offered(address, env, slots=4, nodes=2), log.read_text()  # 2 slots on each node
        command = (tmp_path / "train").read_text()
        join, _, training = command.partition(" && ")
        assert join == f"bash {REPO}/scripts/ray_env_node.sh {address} --slots 0"
        assert training.startswith(f"exec '{REPO}/.venv/bin/python' -m arpo_lib train ")
        assert f"'env.ray_address={address}'" in training and "'train.steps=60'" in training
        joined = subprocess.run(["bash", "-c", join], env={**env, "ARPO_RAY_START_ARGS": f"--temp-dir {temp}/gpu "
                                                                "--num-cpus 1 --object-store-memory 104857600"},
                                capture_output=True, text=True, timeout=180)
        assert joined.returncode == 0, joined.stderr
        assert _cluster_facts(address, env) == (4.0, 3)  # a training node: one more node, no more slots
        assert _script("ray_env_node.sh", "--stop", env=env).returncode == 0
    finally:
        os.killpg(env_job.pid, signal.SIGTERM)  # as scancel ends a job
        env_job.wait(timeout=120)
        left = _gone(tag)
        shutil.rmtree(temp, ignore_errors=True)
    assert f"the head runs at {address}" in log.read_text() and not address_file.exists()
    assert not left, left


def _eventually_offered(address: str, env: dict[str, str], slots: float, nodes: int, within_s: float = 120) -> bool:
    deadline = time.monotonic() + within_s
    while _cluster_facts(address, env) != (slots, nodes):
        if time.monotonic() > deadline:
            return False
        time.sleep(2)
    return True


@needs_ray_cli
@pytest.mark.slow
def test_a_heterogeneous_job_starts_the_head_beside_rank_0_and_waits_for_its_environment_nodes(script_env, tmp_path):
    """ARPO_RAY_HEAD=here in a heterogeneous job: the head starts on the batch node (rank 0's
    rendezvous host), the second component's nodes join with their slots (`--het-group=1`), the
    run waits until they offer env.workers slots, and every training node but the head's joins
    before it trains; when the job's script ends, the head and the environment nodes stop."""
    tag, env = script_env
    temp = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))
    env = _fake_slurm(tmp_path, env, temp, SLURM_HET_SIZE="2", SLURM_JOB_NODELIST_HET_GROUP_0="gpu-[a-b]",
                      SLURM_NNODES_HET_GROUP_0="2", ARPO_RAY_HEAD="here", ARPO_ENV_SLOTS="4", ARPO_RAY_WAIT_S="120",
                      ARPO_RAY_PORT=str(_free_port()))
    try:
        done = subprocess.run(["bash", "scripts/slurm_train.sh", "configs/osworld_full128.yaml", "env.workers=4"],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
        left = _gone(tag)
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "offers 4 env_slot (the run needs 4)" in done.stdout
    address = next(line.split("Ray head running at ")[1].split()[0] for line in done.stderr.splitlines()
                   if "Ray head running at" in line)
    command = (tmp_path / "train").read_text()
    assert command.startswith(f'[ "$(hostname -s)" = {socket.gethostname().split(".")[0]} ] || '
                              f"bash {REPO}/scripts/ray_env_node.sh {address} --slots 0 && exec ")
    assert f"'env.ray_address={address}'" in command
    assert "stopped the head" in done.stderr and not left, left
