"""The speed levers on a CUDA device (skipped without one: CI has no GPU). fp32 compute keeps the
paths comparable token for token; bf16 numerics are the benchmarks' business."""
from __future__ import annotations


import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")



def test_kv_cached_generation_on_cuda(tmp_path):
    from benchmarks import bench_rollout

    result = bench_rollout.main(["--shape", "tiny25", "--envs", "4", "--steps", "5", "--max-new-tokens", "8",
                                 "--device", "cuda", "--out", str(tmp_path)])
    assert result["same_tokens"] is True and result["prefill_reduction"] > 2


def test_update_paths_agree_on_cuda(tmp_path):
    from benchmarks import bench_update

    result = bench_update.main(["--shape", "2b", "--text-layers", "2", "--vision-layers", "2", "--screenshots", "2",
                                "--device", "cuda", "--weights", "fp32", "--repeats", "1", "--pack", "2",
                                "--update", "--lora-rank", "8", "--out", str(tmp_path)])
    assert all(r["status"] == "ok" for r in result["rows"])
    assert result["max_abs_logprob_diff"] < 1e-2
    assert result["update"]["peak GiB"] > 0
