"""The command line: every command's errors are one line naming the problem, exit code 2."""
from __future__ import annotations

import pytest
import yaml

from arpo_lib import cli


def test_config_prints_the_resolved_tree(capsys):
    assert cli.main(["config", "--config", "configs/smoke.yaml", "train.steps=3", "algo.replay.enabled=false"]) == 0
    tree = yaml.safe_load(capsys.readouterr().out)
    assert tree["train"]["steps"] == 3 and tree["algo"]["replay"]["enabled"] is False


def test_config_docs_list_every_key(capsys):
    assert cli.main(["config", "--docs"]) == 0
    out = capsys.readouterr().out
    assert "algo.replay.success_threshold" in out and "train.lr" in out


def test_bad_keys_and_task_names_exit_2_naming_the_key(capsys):
    assert cli.main(["config", "train.lrr=1"]) == 2
    assert "train.lrr" in capsys.readouterr().err
    assert cli.main(["train", "--config", "configs/smoke.yaml", "env.tasks=[miniwob/click-buton]"]) == 2
    assert "env.tasks" in capsys.readouterr().err
    assert cli.main(["eval", "--config", "configs/none.yaml"]) == 2
    assert "not found" in capsys.readouterr().err


def test_train_then_resume_a_run_without_steps(tmp_path, tiny_qwen2vl, capsys):
    args = ["--config", "configs/smoke.yaml", f"model.path={tiny_qwen2vl}", f"out_dir={tmp_path}", "name=c",
            "train.steps=0", "warm_start.steps=0", "warm_start.demos_per_task=0", "train.demo_replay=0",
            "logging.progress=false"]
    assert cli.main(["train", *args]) == 0
    assert (tmp_path / "c" / "config.yaml").is_file()
    assert f"run directory: {tmp_path / 'c'}" in capsys.readouterr().out
    assert cli.main(["train", *args]) == 0  # no step recorded yet: nothing to overwrite
    (tmp_path / "c" / "metrics.jsonl").write_text("")
    assert cli.main(["train", *args]) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert cli.main(["resume", "--run", str(tmp_path / "c")]) == 0


def _launched(monkeypatch, argv):
    """The torchrun command `arpo <argv>` starts (subprocess.Popen captured, nothing run)."""
    return _launched_with_env(monkeypatch, argv)[0]


def _launched_with_env(monkeypatch, argv):
    """The torchrun command `arpo <argv>` starts and the environment it gets."""
    import subprocess

    from arpo_lib import cli

    seen = []

    class Launched:
        def __init__(self, cmd, **kw):
            seen.append((cmd, kw.get("env")))

        def wait(self, timeout=None):
            return 0

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setattr(subprocess, "Popen", Launched)
    assert cli.main(argv) == 0
    return seen[0]


def test_several_processes_start_torchrun_with_the_same_command(monkeypatch, capsys, tmp_path):
    from arpo_lib.run.config import load_config, save_config

    cmd = _launched(monkeypatch, ["train", "--config", "configs/smoke.yaml", "--nproc-per-node", "2", "train.steps=3"])
    assert cmd[1:5] == ["-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone"]
    assert cmd[5:] == ["-m", "arpo_lib", "train", "--config", "configs/smoke.yaml", "train.steps=3"]
    run = tmp_path / "x"
    run.mkdir()
    save_config(load_config("configs/smoke.yaml", [f"out_dir={tmp_path}", "name=x"]), run / "config.yaml")
    multi = _launched(monkeypatch, ["resume", "--run", str(run), "--nproc-per-node", "8", "--nnodes", "2",
                                    "--master-addr", "gpu-a", "--rdzv-id", "job7"])
    assert "--nnodes=2" in multi and "--rdzv-backend=c10d" in multi and "--rdzv-endpoint=gpu-a:29500" in multi
    assert "--rdzv-id=job7" in multi and "--standalone" not in multi
    # torchrun's parser would take `--run` for its own --run-path: a resume goes as `train --resume`
    assert multi[-5:] == ["arpo_lib", "train", "--config", str(run / "config.yaml"), "--resume"]
    # the config's train.nproc_per_node launches too; the flag wins over it
    save_config(load_config("configs/smoke.yaml", [f"out_dir={tmp_path}", "name=x", "train.nproc_per_node=3"]),
                run / "config.yaml")
    assert "--nproc-per-node=3" in _launched(monkeypatch, ["resume", "--run", str(run)])
    assert "--nproc-per-node=2" in _launched(monkeypatch, ["resume", "--run", str(run), "--nproc-per-node", "2"])


FIRST_NODE = __import__("socket").gethostname()
"""The fake SLURM job's first node: this machine's name, so that the launch check resolves it."""


def _fake_slurm(tmp_path, gpus_per_node: str) -> dict[str, str]:
    """The environment of a two-node SLURM job (FIRST_NODE, gpu-b) whose `srun` writes the command
    it would run on each node to tmp_path/cmd instead, and the servers' key it passes on to
    tmp_path/key."""
    import os

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f"#!/bin/sh\nprintf '{FIRST_NODE}\\ngpu-b\\n'\n")
    (bin_dir / "srun").write_text(f"#!/bin/sh\nprintf '%s' \"$4\" > {tmp_path}/cmd\n"  # srun OPT bash -c CMD
                                  f"printf '%s' \"$ARPO_SERVE_API_KEY\" > {tmp_path}/key\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("ARPO_SERVE_API_KEY", "ARPO_NPROC_PER_NODE")}
    return {**env, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "gpu-[a-b]",
            "SLURM_NNODES": "2", "SLURM_GPUS_PER_NODE": gpus_per_node, "SLURM_JOB_ID": "4242"}


def _on_a_node(tmp_path, address: str = "10.1.2.3") -> list[str]:
    """The arpo arguments the recorded srun command runs with on a node whose first address
    (`hostname -I`) is `address`: the command run by bash, printing its arguments instead."""
    import os
    import subprocess

    cmd = (tmp_path / "cmd").read_text()
    python = f"{os.getcwd()}/.venv/bin/python"
    assert cmd.startswith(f"exec '{python}' -m arpo_lib train ")
    node_bin = tmp_path / "node-bin"
    node_bin.mkdir(exist_ok=True)
    (node_bin / "hostname").write_text(f"#!/bin/sh\necho '{address} 172.17.0.1 '\n")
    (node_bin / "hostname").chmod(0o755)
    done = subprocess.run(["bash", "-c", cmd.replace(f"exec '{python}'", "printf '%s\\n'", 1)], check=True,
                          env={**os.environ, "PATH": f"{node_bin}:{os.environ['PATH']}"}, capture_output=True, text=True)
    return done.stdout.splitlines()[2:]  # past `-m arpo_lib`


def test_the_slurm_script_launches_every_node_into_one_c10d_rendezvous(tmp_path, monkeypatch):
    """The config's processes per node (osworld_full128.yaml: 6 beside two servers on GPUs 6 and 7),
    ARPO_NPROC_PER_NODE over them; one generated key for every node, never printed; each node
    announces rank 0's servers at its own address (rank 0 lands on whichever node c10d says)."""
    import subprocess

    env = _fake_slurm(tmp_path, gpus_per_node="h100:8")
    done = subprocess.run(["bash", "scripts/slurm_train.sh", "configs/osworld_full128.yaml", "train.steps=60"],
                          env=env, check=True, capture_output=True, text=True)
    key = (tmp_path / "key").read_text()
    assert len(key) == 32 and key not in done.stdout + done.stderr and "launch OK" in done.stdout
    argv = _on_a_node(tmp_path, "10.1.2.3")
    assert argv[-2:] == ["train.steps=60", "serve.announce_host=10.1.2.3"]
    subprocess.run(["bash", "scripts/slurm_train.sh", "configs/osworld_full128.yaml"],
                   env={**env, "ARPO_NPROC_PER_NODE": "4", "ARPO_SERVE_API_KEY": "k" * 40}, check=True)
    assert (tmp_path / "key").read_text() == "k" * 40  # a key set beforehand is kept
    four = _on_a_node(tmp_path)
    launch = _launched(monkeypatch, argv)  # (from here on subprocess.Popen is a fake)
    assert "--nproc-per-node=6" in launch and "--rdzv-backend=c10d" in launch
    assert f"--rdzv-endpoint={FIRST_NODE}:29500" in launch and "--rdzv-id=4242" in launch
    assert launch[-6:] == ["train", "--config", "configs/osworld_full128.yaml", "--resume", "train.steps=60",
                           "serve.announce_host=10.1.2.3"]
    assert "--nproc-per-node=4" in _launched(monkeypatch, four)


def test_the_slurm_script_stops_before_srun_when_the_launch_would_be_refused(tmp_path):
    """8 processes per node beside servers on GPUs 6 and 7: the launch check in the batch script
    names the clash and its fix, and no node starts anything."""
    import subprocess

    env = _fake_slurm(tmp_path, gpus_per_node="8")
    done = subprocess.run(["bash", "scripts/slurm_train.sh", "configs/osworld_full128.yaml"],
                          env={**env, "ARPO_NPROC_PER_NODE": "8"}, capture_output=True, text=True)
    assert done.returncode == 2 and not (tmp_path / "cmd").exists()
    assert "GPUs 6, 7" in done.stdout and "use --nproc-per-node 6" in done.stdout
    assert "nothing was started" in done.stderr


def test_on_several_nodes_gloo_and_nccl_get_the_interface_that_reaches_the_master(tmp_path, monkeypatch):
    """Without GLOO_SOCKET_IFNAME the control group of a two-node run can bind to an
    address the other node cannot reach and wait 2 hours. Each node's launch (slurm_train.sh's
    command on every node) sets it, and NCCL_SOCKET_IFNAME, to the interface that reaches the
    master, here from a fake route table; a value the user exported is kept; one node: unset."""
    import subprocess

    from arpo_lib.training import distributed

    monkeypatch.setattr(distributed, "interface_towards",
                        lambda host, interfaces=None: {FIRST_NODE: "ib0"}.get(host))
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    env = _fake_slurm(tmp_path, gpus_per_node="8")
    subprocess.run(["bash", "scripts/slurm_train.sh"], env=env, check=True)
    argv = _on_a_node(tmp_path)
    _, launched_env = _launched_with_env(monkeypatch, argv)
    assert launched_env["GLOO_SOCKET_IFNAME"] == "ib0" and launched_env["NCCL_SOCKET_IFNAME"] == "ib0"
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "eth1")
    _, launched_env = _launched_with_env(monkeypatch, argv)
    assert launched_env["GLOO_SOCKET_IFNAME"] == "ib0" and launched_env["NCCL_SOCKET_IFNAME"] == "eth1"
    monkeypatch.delenv("NCCL_SOCKET_IFNAME")
    _, one_node = _launched_with_env(monkeypatch, ["train", "--config", "configs/smoke.yaml", "--nproc-per-node", "2"])
    assert "GLOO_SOCKET_IFNAME" not in one_node and "NCCL_SOCKET_IFNAME" not in one_node


def _slurm_checkout(tmp_path, venv: bool):
    """A copy of slurm_train.sh in a directory where ./workbench and scripts/setup.sh only leave a
    mark, beside fake srun (runs its command), scontrol, sudo, apt-get and pip (leave a mark) and,
    with `venv`, a .venv/bin/python that records its arguments."""
    import os
    import shutil

    repo, bin_dir, marks = tmp_path / "repo", tmp_path / "bin", tmp_path / "marks"
    (repo / "scripts").mkdir(parents=True)
    bin_dir.mkdir()
    marks.mkdir()
    shutil.copy("scripts/slurm_train.sh", repo / "scripts" / "slurm_train.sh")
    scripts = {repo / "workbench": "workbench", repo / "scripts" / "setup.sh": "setup.sh",
               bin_dir / "sudo": "sudo", bin_dir / "apt-get": "apt-get", bin_dir / "pip": "pip"}
    for path, name in scripts.items():
        path.write_text(f"#!/bin/sh\ntouch {marks}/{name}\n")
    (bin_dir / "scontrol").write_text("#!/bin/sh\nprintf 'gpu-a\\ngpu-b\\n'\n")
    (bin_dir / "srun").write_text(f"#!/bin/sh\ntouch {marks}/srun\nshift\nexec \"$@\"\n")  # srun OPT bash -c CMD
    if venv:
        (repo / ".venv" / "bin").mkdir(parents=True)
        (repo / ".venv" / "bin" / "python").write_text(f"#!/bin/sh\necho \"$@\" > {marks}/python\n")
    for path in [*scripts, bin_dir / "scontrol", bin_dir / "srun", repo / ".venv" / "bin" / "python"]:
        if path.exists():
            path.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "gpu-[a-b]",
           "SLURM_NNODES": "2", "SLURM_GPUS_PER_NODE": "8", "SLURM_JOB_ID": "4242"}
    return repo, marks, env


def test_the_slurm_script_trains_with_the_venv_and_never_runs_the_set_up(tmp_path):
    """On the GPU nodes only the venv's python runs: ./workbench would first run scripts/setup.sh
    (apt with sudo, pip into the shared .venv) on every node at once."""
    import subprocess

    repo, marks, env = _slurm_checkout(tmp_path, venv=True)
    done = subprocess.run(["bash", "scripts/slurm_train.sh", "configs/osworld_full128.yaml", "train.steps=60"],
                          cwd=repo, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in marks.iterdir()) == ["python", "srun"]  # no workbench, setup.sh, sudo, apt-get, pip
    assert (marks / "python").read_text().split()[:5] == ["-m", "arpo_lib", "train", "--config",
                                                          "configs/osworld_full128.yaml"]


def test_the_slurm_script_without_a_venv_says_to_run_the_set_up_once(tmp_path):
    import subprocess

    repo, marks, env = _slurm_checkout(tmp_path, venv=False)
    done = subprocess.run(["bash", "scripts/slurm_train.sh"], cwd=repo, env=env, capture_output=True, text=True)
    assert done.returncode == 1 and "./workbench setup" in done.stderr and ".venv/bin/python" in done.stderr
    assert not any(marks.iterdir())  # nothing started, nothing installed


def test_smoke_takes_a_config_and_the_desktop_config_is_valid(monkeypatch, tmp_path):
    import json

    from arpo_lib import workflows
    from arpo_lib.run.config import load_config

    seen = {}

    def fake_execute(path, params, run_name=None):
        seen.update(path=path, params=params)
        (tmp_path / "summary.json").write_text(json.dumps({}))
        return tmp_path / "smoke_test.ipynb"

    monkeypatch.setattr(workflows, "execute_notebook", fake_execute)
    monkeypatch.setattr(workflows, "format_summary", lambda summary: "summary")
    assert cli.main(["smoke", "--config", "configs/desktop_smoke.yaml", "train.steps=1"]) == 0
    assert seen["params"] == {"config": "configs/desktop_smoke.yaml", "overrides": ["train.steps=1"]}
    cfg = load_config("configs/desktop_smoke.yaml")
    assert all(t.startswith("desktop/") for t in cfg.env.tasks) and cfg.env.options["screen"] == [960, 600]


def test_smoke_seeds_runs_each_seed_and_checks_every_gain(monkeypatch, tmp_path, capsys):
    """`smoke --seeds 0,1,2`: one notebook run per seed (train.seed=<seed>, its own run name), a
    table of success before -> after, and exit status 1 when a seed gained less than --min-gain."""
    import json

    from arpo_lib import workflows

    made, runs = [], []
    monkeypatch.setattr(cli, "_make_prebuilt", lambda path: made.append(path))
    after = {0: 0.5, 1: 0.375, 2: 0.25}

    def fake_execute(path, params, run_name=None):
        seed = int(params["overrides"][-1].split("=")[1])
        runs.append((run_name, params["overrides"]))
        out = tmp_path / run_name
        out.mkdir()
        (out / "summary.json").write_text(json.dumps({
            "success_before": 0.25, "success_after": after[seed], "train_success_per_step": [0.25, after[seed]],
            "seconds_total": 100.0, "eval_episodes": 24, "eval_temperature": 1.0}))
        return out / "smoke_test.ipynb"

    monkeypatch.setattr(workflows, "execute_notebook", fake_execute)
    assert cli.main(["smoke", "--name", "s", "--seeds", "0,1", "train.steps=2"]) == 0
    assert made == ["models/small-uitars-qwen2vl-smoke"]  # the default config's warm start, made first
    assert runs == [("s-s0", ["train.steps=2", "train.seed=0"]), ("s-s1", ["train.steps=2", "train.seed=1"])]
    out = capsys.readouterr().out
    assert "success before -> after RL: 0.250 -> 0.500 (+25.0 points" in out
    assert "| 1 | 0.250 | 0.375 | +12.5 pts | 0.25 0.38 | 100.0 |" in out
    assert "Every seed gained at least 10 points: yes (2 of 2; mean gain +18.8 points)" in out
    runs.clear()
    assert cli.main(["smoke", "--name", "t", "--seeds", "0,2"]) == 1  # seed 2: no gain
    out = capsys.readouterr().out
    assert "| 2 | 0.250 | 0.250 | +0.0 pts (short) |" in out and "Every seed gained at least 10 points: NO (1 of 2" in out


def test_a_run_on_the_smoke_warm_start_before_it_is_made_says_how_to_make_it(monkeypatch, tmp_path):
    from arpo_lib.workflows import prepare

    monkeypatch.setattr(prepare, "REPO_ROOT", tmp_path)
    with pytest.raises(FileNotFoundError, match=r"run `./workbench setup` \(or `./workbench build-warm-start`\)"):
        prepare.ensure_prebuilt_model("./models/small-uitars-qwen2vl-smoke")
    (tmp_path / "models" / "small-uitars-qwen2vl-smoke").mkdir(parents=True)
    (tmp_path / "models" / "small-uitars-qwen2vl-smoke" / ".complete").touch()
    prepare.ensure_prebuilt_model("models/small-uitars-qwen2vl-smoke")
    prepare.ensure_prebuilt_model("models/tiny-uitars-qwen2vl")  # not one the workbench makes: not its business


@pytest.mark.parametrize("when", ["loading", "evaluating"])
def test_sigterm_stops_the_model_server_the_command_started(tmp_path, tiny_qwen2vl, chromium_available, when):
    """A stopped command (SIGTERM: a scheduler, `kill`, `timeout`) ends with its clean-up: the model
    server it started (in a process group of its own) goes with it, whether the stop comes while
    the server loads or while the evaluation runs. Python's default SIGTERM skipped every `finally`
    and left the server running; and the engine started its server outside its clean-up."""
    import json
    import os
    import signal
    import subprocess
    import sys
    import time

    if when == "evaluating" and not chromium_available:
        pytest.skip("needs chromium")
    run = tmp_path / "stopped"
    command = [sys.executable, "-m", "arpo_lib", "eval", "--config", "configs/smoke.yaml", f"model.path={tiny_qwen2vl}",
               f"out_dir={tmp_path}", "name=stopped", "rollout.backend=server", "serve.backend=hf", "env.workers=1",
               "eval.samples_per_task=20", "logging.progress=false"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 180
        info = run / "server.json"
        while not info.exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert info.exists(), process.communicate(timeout=30)[0][-3000:]
        server = json.loads(info.read_text())["pid"]
        if when == "evaluating":  # an episode's trajectory on disk: the server answered, the evaluation runs
            while (process.poll() is None and not list(run.rglob("traj.jsonl"))
                   and time.monotonic() < deadline):
                time.sleep(0.1)
            assert list(run.rglob("traj.jsonl")), process.communicate(timeout=30)[0][-3000:]
        os.kill(server, 0)  # alive before the stop
        process.send_signal(signal.SIGTERM)
        output = process.communicate(timeout=120)[0]
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 128 + signal.SIGTERM, output[-3000:]
    gone = time.monotonic() + 30
    while time.monotonic() < gone and _alive(server):
        time.sleep(0.1)
    assert not _alive(server), f"the server (pid {server}) outlived the stopped command"


def _alive(pid: int) -> bool:
    import os
    from pathlib import Path

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purposes
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False
