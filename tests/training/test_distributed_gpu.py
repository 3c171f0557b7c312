"""FSDP2 on the GPU: the sharded training step of the tiny model equals the whole model's, over
NCCL on one CUDA device (skipped without one: CI has no GPU) and, as the same script's check on
every machine, over gloo with two CPU processes."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def _run(kind: str, nproc: int, model: Path, *flags: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
                           str(HERE / "fsdp_step_ranks.py"), kind, str(model), *flags],
                          capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("flags", [(), ("frozen-vision",)])
def test_two_gloo_ranks_step_like_the_whole_model(tiny_qwen25vl, flags):
    gaps = _run("cpu", 2, tiny_qwen25vl, *flags)
    assert gaps["world_size"] == 2 and gaps["compute_dtype"] == "torch.float32"
    assert (gaps["trained_tensors"] < gaps["tensors"]) == bool(flags)  # the vision tensors frozen
    assert gaps["logprob_gap"] < 1e-4 and gaps["grad_gap"] < 1e-3
    assert gaps["first_ratio_gap"] == 0.0  # old log-probs from the shards on the same plan: ratio exactly 1
    assert gaps["moved"] > 0.5 * gaps["lr"] and gaps["weight_gap"] <= 2 * gaps["lr"] + 1e-6


@pytest.mark.slow
def test_two_gloo_ranks_with_bf16_parameters_and_fp32_reduction_start_at_ratio_1(tiny_qwen25vl):
    """bf16 shards (FSDP2's mixed precision, fp32 gradient reduction) on two ranks, as on
    GPUs. The old log-probs come from the shards on the update's own plan, so the first
    micro-batch's ratio is exactly 1 (from the whole model under autocast they differed by bf16
    noise); against the whole model the gaps are bf16-sized."""
    gaps = _run("cpu", 2, tiny_qwen25vl, "bf16")
    assert gaps["world_size"] == 2 and gaps["compute_dtype"] == "torch.bfloat16"
    assert gaps["first_ratio_gap"] == 0.0
    assert 0 < gaps["logprob_gap"] < 0.1 and gaps["grad_gap"] < 0.1
    assert gaps["moved"] > 0.5 * gaps["lr"] and gaps["weight_gap"] <= 2 * gaps["lr"] + 1e-6


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_nccl_fsdp2_step_on_the_gpu_like_the_whole_model(tiny_qwen25vl):
    """bf16 compute on both sides (FSDP2's param dtype vs autocast): bf16-sized gaps."""
    gaps = _run("cuda", 1, tiny_qwen25vl)
    assert gaps["compute_dtype"] == "torch.bfloat16" and gaps["first_ratio_gap"] == 0.0
    assert gaps["logprob_gap"] < 0.1 and gaps["grad_gap"] < 0.1
    assert gaps["moved"] > 0.5 * gaps["lr"] and gaps["weight_gap"] <= 2 * gaps["lr"] + 1e-6


@pytest.mark.slow
def test_without_a_full_copy_the_shards_step_save_and_stream_like_the_whole_model(tiny_qwen2vl, tmp_path):
    """With model servers no rank keeps the full model (keep_full_model=False): it is
    dropped to the meta device when the update starts, the shards take the same step as the whole
    model, the saved model (rank 0 writes, every rank gathers) is the whole model's in the same
    checkpoint names, and a push's pass hands over one gathered parameter at a time."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                           str(HERE / "no_full_copy_ranks.py"), str(tiny_qwen2vl), str(tmp_path)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    r = json.loads(done.stdout.strip().splitlines()[-1])
    assert r["world_size"] == 2 and r["whole_at_start"] and r["dropped"]
    assert r["saved_keys_equal"] and r["processor_saved"]
    assert r["moved"] > 0.5 * r["lr"] and r["weight_gap"] <= 2 * r["lr"] + 1e-6
    assert r["gap_norm"] < 0.01 * r["moved_norm"], r  # the same step, up to float noise
    assert r["pushed_tensors"] == r["tensors"] and r["push_gap"] <= 2 * r["lr"] + 1e-6
    assert r["most_alive_at_a_handover"] == 0  # the previous one was dropped before the next was gathered
