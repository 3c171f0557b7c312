"""An evaluation keeps one copy of the weights, in the compute dtype: nothing trains, so no fp32
master copy (UI-TARS-1.5-7B: 15.4 GiB in bf16 instead of 30.9)."""
from __future__ import annotations

import pytest
import torch

from arpo_lib.types import SamplingParams
from benchmarks.common import screenshot


def _bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_inference_weights_load_in_the_compute_dtype_and_generate(tiny_qwen25vl):
    from arpo_lib.agent.hf_policy import HFPolicy

    masters = HFPolicy(tiny_qwen25vl, device="cpu", compute_dtype="bfloat16")
    inference = HFPolicy(tiny_qwen25vl, device="cpu", compute_dtype="bfloat16", weights_dtype="compute")
    assert {p.dtype for p in masters.model.parameters()} == {torch.float32}
    assert {p.dtype for p in inference.model.parameters()} == {torch.bfloat16}
    assert _bytes(inference.model) * 2 == _bytes(masters.model)
    conv = inference.new_conversation("Click the button")
    conv.add_observation(screenshot(3))
    out = inference.generate([conv.current], seeds=[0], cache_keys=["e"], sampling=SamplingParams(max_new_tokens=6))
    assert out[0].token_ids and all(lp <= 0 for lp in out[0].logprobs)
    with pytest.raises(ValueError, match="inference"):
        HFPolicy(tiny_qwen25vl, device="cpu", weights_dtype="compute", lora_rank=4)


def test_the_evaluation_engine_loads_its_model_for_inference(tiny_qwen2vl, tmp_path, monkeypatch):
    """`./workbench eval` and evaluation.ipynb go through `build.engine`: its in-process policy is
    the inference one (with bf16 compute, bf16 weights)."""
    import contextlib

    from arpo_lib import build

    monkeypatch.setattr(build, "env_pool", lambda cfg: contextlib.nullcontext(None))
    monkeypatch.setattr(build, "RolloutEngine", lambda acting, pool, **kw: acting)
    cfg = build.load_config("configs/smoke.yaml", [f"model.path={tiny_qwen2vl}", f"out_dir={tmp_path}",
                                                   "model.compute_dtype=bfloat16"])
    with build.engine(cfg) as acting:
        assert {p.dtype for p in acting.model.parameters()} == {torch.bfloat16}
