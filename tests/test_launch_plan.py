"""`train --dry-run` (arpo_lib/workflows/launch_plan.py): the whole launch checked before anything
starts, every problem listed with its fix, and the plan printed; nothing started, no model loaded."""
from __future__ import annotations

import socket
from pathlib import Path

import pytest

from arpo_lib import cli
from arpo_lib.run.config import load_config
from arpo_lib.workflows.launch_plan import Facts, GpuCount, Launch, count_gpus, plan_launch, ray_endpoint

TWO_NODES = ["--nnodes", "2", "--master-addr", "127.0.0.1", "--gpus-per-node", "8"]


def _dry_run(capsys, *argv: str) -> tuple[int, str]:
    code = cli.main(["train", *argv, "--dry-run"])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_the_documented_full_run_on_eight_processes_is_refused_naming_the_servers_gpus_and_the_fix(capsys):
    code, out = _dry_run(capsys, "--config", "configs/osworld_full128.yaml", "--nproc-per-node", "8", *TWO_NODES)
    assert code == 2 and "launch OK" not in out
    assert "the servers' GPUs 6, 7 (serve.cuda_devices)" in out
    assert "fix: use --nproc-per-node 6 (GPUs 6, 7 serve)" in out


def test_the_documented_full_run_on_six_processes_passes_and_prints_its_plan(capsys):
    for six in (["--nproc-per-node", "6"], []):  # the flag, or the config's train.nproc_per_node
        code, out = _dry_run(capsys, "--config", "configs/osworld_full128.yaml", *six, *TWO_NODES)
        assert code == 0 and out.rstrip().endswith("launch OK"), out
        assert "6 per node x 2 node(s) = 12 ranks" in out
        assert "rank 0's node: ranks 0-5 train on GPUs 0-5; the servers on GPUs 6, 7" in out
        assert "each other node (1): ranks 6-11 train on GPUs 0-5; idle: GPUs 6, 7" in out
        assert "2 vllm server(s) on rank 0's node on GPUs 6 | 7" in out and "ARPO_SERVE_API_KEY" in out
        assert "128 (env.workers): 11 Ray actors per rank on the cluster at auto, one env_slot each" in out
        assert "must be on a file system every node shares" in out


def test_every_problem_is_listed_each_with_its_fix(capsys):
    code, out = _dry_run(capsys, "--config", "configs/osworld_full128.yaml", "--nproc-per-node", "8", *TWO_NODES,
                         "serve.api_key_env=null", "serve.announce_host=127.0.0.1")
    assert code == 2 and "problems (3):" in out and out.count("     fix: ") == 3
    assert "no key is named (serve.api_key_env)" in out and "set serve.api_key_env=ARPO_SERVE_API_KEY" in out
    assert "serve.announce_host '127.0.0.1' cannot be reached from other nodes" in out


@pytest.mark.parametrize("path", sorted(Path("configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_gets_a_plan_or_a_message_never_a_traceback(path, capsys):
    for gpus in ([], ["--gpus-per-node", "8"]):
        code, out = _dry_run(capsys, "--config", str(path), *gpus)
        assert code in (0, 2), out
        assert "launch plan for" in out or out.startswith("error: "), out
        assert "Traceback" not in out


def test_a_resume_is_checked_the_same_way(tmp_path, capsys):
    from arpo_lib.run.config import save_config

    run = tmp_path / "r"
    run.mkdir()
    save_config(load_config("configs/osworld_full128.yaml", [f"out_dir={tmp_path}", "name=r"]), run / "config.yaml")
    assert cli.main(["resume", "--run", str(run), "--dry-run", "--nproc-per-node", "8", "--gpus-per-node", "8"]) == 2
    assert "use --nproc-per-node 6" in capsys.readouterr().out


def test_a_ray_head_that_does_not_answer_and_a_master_that_does_not_resolve_are_problems(capsys):
    with socket.socket() as s:  # a port nothing listens on (bound, then closed)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code, out = _dry_run(capsys, "--config", "configs/osworld_full128.yaml", "--nnodes", "2",
                         "--master-addr", "no-such-node.invalid", "--gpus-per-node", "8",
                         f"env.ray_address=127.0.0.1:{port}")
    assert code == 2
    assert f"env.ray_address 127.0.0.1:{port}: the Ray head does not answer" in out and "scripts/ray_head.sh" in out
    assert "--master-addr no-such-node.invalid does not resolve here" in out
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        code, out = _dry_run(capsys, "--config", "configs/osworld_full128.yaml", *TWO_NODES,
                             f"env.ray_address=127.0.0.1:{listening.getsockname()[1]}")
    assert code == 0, out


def test_the_gpus_per_node_come_from_the_flag_slurm_cuda_or_nvidia_smi(tmp_path):
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: a)'\necho 'GPU 1: NVIDIA H200 (UUID: b)'\n")
    smi.chmod(0o755)
    broken = tmp_path / "broken-smi"
    broken.write_text("#!/bin/sh\nexit 9\n")
    broken.chmod(0o755)
    env = {"SLURM_GPUS_PER_NODE": "h100:4", "CUDA_VISIBLE_DEVICES": "2,3"}
    assert count_gpus(8, env, str(smi)) == GpuCount(8, "--gpus-per-node")
    assert count_gpus(None, env, str(smi)) == GpuCount(4, "SLURM_GPUS_PER_NODE")
    visible = count_gpus(None, {"CUDA_VISIBLE_DEVICES": "2,3"}, str(smi))
    assert visible == GpuCount(2, "CUDA_VISIBLE_DEVICES", ["2", "3"])
    assert count_gpus(None, {}, str(smi)) == GpuCount(2, "nvidia-smi -L")
    assert count_gpus(None, {}, str(broken)).count is None


def test_the_training_processes_take_the_gpus_cuda_visible_devices_lists():
    cfg = load_config("configs/osworld_full128.yaml")
    visible = GpuCount(4, "CUDA_VISIBLE_DEVICES", ["0", "1", "6", "7"])
    plan = plan_launch(cfg, Launch(nproc_per_node=2), Facts(visible))
    assert plan.ok and plan.nodes[0].training_gpus == ["0", "1"]
    plan = plan_launch(cfg, Launch(nproc_per_node=3), Facts(visible))
    assert [p.fix for p in plan.problems] == ["use --nproc-per-node 2 (GPUs 6, 7 serve)"]


def test_processes_gpus_and_tensor_parallel_servers_are_checked_against_the_node():
    cfg = load_config("configs/osworld_full128.yaml", ["serve.tensor_parallel_size=2"])
    plan = plan_launch(cfg, Launch(nproc_per_node=10), Facts(GpuCount(8, "--gpus-per-node")))
    whats = " | ".join(p.what for p in plan.problems)
    assert "10 training processes per node, but a node has 8 GPUs" in whats
    assert "serve.cuda_devices[0] gives replica 0 1 GPU(s) (6), serve.tensor_parallel_size is 2" in whats
    plan = plan_launch(load_config("configs/osworld_full128.yaml"), Launch(), Facts(GpuCount(6, "--gpus-per-node")))
    assert any("names GPU(s) 6, 7, but a node has 6 GPUs" in p.what for p in plan.problems)


def test_a_gpu_run_whose_own_servers_have_no_gpus_named_is_refused_and_a_cpu_run_is_not():
    cfg = load_config("configs/smoke.yaml", ["rollout.backend=server", "serve.backend=vllm"])
    plan = plan_launch(cfg, Launch(), Facts(GpuCount(8, "--gpus-per-node")))
    assert [p.what.split(":")[0] for p in plan.problems] == ["serve.cuda_devices"]
    assert plan_launch(cfg, Launch(), Facts(GpuCount(0, "nvidia-smi -L"))).ok


def test_environments_are_planned_per_rank_and_where_they_run():
    cfg = load_config("configs/smoke.yaml", ["env.workers=5"])
    plan = plan_launch(cfg, Launch(nproc_per_node=2), Facts(GpuCount(None, "unknown")))
    assert plan.environments == "5 (env.workers): 3 local worker processes per rank"
    ray = load_config("configs/smoke.yaml", ["env.backend=ray"])
    plan = plan_launch(ray, Launch(nproc_per_node=2), Facts(GpuCount(None, "unknown")))
    assert any("every rank starts a private Ray on its own node" in n for n in plan.notes)


def test_ray_addresses_name_the_port_to_try():
    assert ray_endpoint("auto") is None
    assert ray_endpoint("10.0.0.1:6380") == ("10.0.0.1", 6380)
    assert ray_endpoint("head") == ("head", 6379)
    assert ray_endpoint("ray://head:10001") == ("head", 10001)
    assert ray_endpoint("[fd00::1]:6379") == ("fd00::1", 6379)
