"""Version floors a config needs are checked when it loads, naming what is installed and the fix."""
from __future__ import annotations

import pytest

from arpo_lib.run import config as C


def test_activation_offload_needs_the_transformers_that_has_it(monkeypatch):
    monkeypatch.setattr(C, "installed_version", lambda name: (5, 17, 0) if name == "transformers" else (2, 14, 1))
    with pytest.raises(C.ConfigError, match=r"activation_offload.*transformers >= 5\.23 \(installed: 5\.17\.0\)"):
        C.load_config("configs/one_gpu_40gb.yaml")
    C.load_config("configs/one_gpu_40gb.yaml", ["model.activation_offload=false"])  # without the lever: loads


def test_lora_on_several_processes_needs_torch_2_8(monkeypatch):
    monkeypatch.setattr(C, "installed_version", lambda name: (2, 7, 1) if name == "torch" else (5, 23, 0))
    with pytest.raises(C.ConfigError, match=r"model.lora_rank.*torch 2\.8 on \(installed: 2\.7\.1\)"):
        C.load_config("configs/smoke.yaml", ["model.lora_rank=8", "train.nproc_per_node=2"])
    C.load_config("configs/smoke.yaml", ["model.lora_rank=8"])  # one process: fine


def test_this_environment_meets_the_floors():
    assert C.installed_version("transformers") >= C.OFFLOAD_TRANSFORMERS
    assert C.installed_version("torch") >= C.LORA_FSDP2_TORCH
