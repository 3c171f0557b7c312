"""The benchmarks run at tiny sizes on the CPU: the optimised paths must agree with the naive ones
(no timing assertions), and the FLOP formula must give the real models' parameter counts."""
from __future__ import annotations


import pytest
import torch

from benchmarks import bench_rollout, bench_update
from benchmarks.common import REAL_SHAPES, _spans, train_flops


@pytest.mark.parametrize("shape", ["tiny", "tiny25"])
def test_update_benchmark_paths_agree(shape, tmp_path):
    result = bench_update.main(["--shape", shape, "--screenshots", "2", "--device", "cpu", "--repeats", "1",
                                "--update", "--optimizer", "adafactor", "--out", str(tmp_path)])
    assert [r["status"] for r in result["rows"]] == ["ok", "ok"]
    assert result["max_abs_logprob_diff"] < 1e-4 and result["max_rel_grad_diff"] < 1e-3
    assert result["update"]["optimizer"] == "adafactor" and result["update"]["s/update"] > 0
    assert result["flops"]["total"] > 0 and result["image_tokens"] > 0
    assert (tmp_path / "update_{}_2shots_adafactor.json".format(shape)).is_file()


def test_rollout_benchmark_same_tokens_fewer_prefill(tmp_path):
    result = bench_rollout.main(["--shape", "tiny25", "--envs", "2", "--steps", "4", "--max-new-tokens", "8",
                                 "--device", "cpu", "--out", str(tmp_path)])
    assert result["same_tokens"] is True
    assert result["prefill_reduction"] > 2
    rows = {r["path"]: r for r in result["rows"]}
    assert rows["kv-cached"]["screenshots encoded"] == 2 * 4
    assert rows["re-prefill"]["screenshots encoded"] == 2 * (1 + 2 + 3 + 4)


def _meta_model(shape):
    from benchmarks.common import meta_model

    return meta_model(shape)


@pytest.mark.parametrize("shape,total_b,text_linear_b,vision_b", [("2b", 2.2, 1.3, 0.66), ("7b", 8.3, 6.5, 0.67)])
def test_real_shapes_and_flop_formula(shape, total_b, text_linear_b, vision_b):
    """Parameter counts of the published models (2.2B / 8.3B) come out of our shape table, and
    the FLOP terms scale as the docstring says."""
    from arpo_lib.agent.prompt import Segment

    model = _meta_model(shape)
    total = sum(p.numel() for p in model.parameters()) / 1e9
    assert total == pytest.approx(total_b, rel=0.05)
    seg = Segment(input_ids=[0] * 3000, mm_token_type_ids=[0] * 3000, loss_mask=[0] * 2950 + [1] * 50,
                  image_grid_thw=[torch.tensor([1, 78, 138])])
    flops = train_flops(model, seg)
    assert flops["text_linear"] / (6 * 3000) / 1e9 == pytest.approx(text_linear_b, rel=0.1)
    assert flops["vision_linear"] / (6 * 78 * 138) / 1e9 == pytest.approx(vision_b, rel=0.1)
    assert flops["total"] == pytest.approx(sum(v for k, v in flops.items() if k != "total"))
    if shape == "7b":  # windowed layers cost far less attention than full ones
        assert flops["vision_attention"] < 6 * 2 * 1280 * 32 * (78 * 138) ** 2


def test_window_spans():
    assert _spans(10, 4) == [4, 4, 2] and _spans(8, 4) == [4, 4]


@pytest.mark.slow
def test_real_shape_paths_run_shrunk_on_cpu(tmp_path):
    """The 2B shape's real widths and vocabulary (random weights, one decoder and one vision
    layer): what benchmarks/run_gpu.sh runs on a GPU, down to building the model and the
    UI-TARS-sized image processing."""
    update = bench_update.main(["--shape", "2b", "--text-layers", "1", "--vision-layers", "1", "--screenshots", "1",
                                "--resolution", "448x336", "--device", "cpu", "--repeats", "1", "--out", str(tmp_path)])
    assert [r["status"] for r in update["rows"]] == ["ok", "ok"]
    assert update["max_abs_logprob_diff"] < 1e-4
    assert update["image_tokens"] == (448 // 28) * (336 // 28)  # one 448x336 screenshot, not downscaled
    rollout = bench_rollout.main(["--shape", "2b", "--text-layers", "1", "--vision-layers", "1", "--envs", "2",
                                  "--steps", "2", "--max-new-tokens", "4", "--resolution", "448x336",
                                  "--device", "cpu", "--out", str(tmp_path)])
    assert rollout["same_tokens"] is True and rollout["prefill_reduction"] > 1


def test_memory_table_parts_follow_the_documented_formula():
    from benchmarks.memory_table import Counts, per_gpu_bytes

    c = Counts(total=1000, root=100, largest_unit=50, text_linear=600, factored=40, lora_per_rank=3)
    assert per_gpu_bytes(c, 1, "full-adamw") == {"weights": 4000, "gradients": 4000, "optimizer": 8000}
    two = per_gpu_bytes(c, 2, "full-adamw")
    assert two["weights"] == two["gradients"] == 2000 and two["optimizer"] == 4000
    assert two["gathered units and unreduced root gradients"] == 2 * (100 + 100) + 6 * 100
    assert two["full model for rollouts and old log-probs"] == 4000
    lora = per_gpu_bytes(c, 1, "lora-adamw", lora_rank=2)  # 6 adapter parameters
    assert lora == {"weights": 2 * 600 + 4 * 400 + 4 * 6, "gradients": 24, "optimizer": 48}
    assert per_gpu_bytes(c, 1, "full-adafactor")["optimizer"] == 160
    adafactor = per_gpu_bytes(c, 2, "full-adafactor")  # sharded weights and gradients, whole statistics
    assert adafactor["weights"] == adafactor["gradients"] == 2000 and adafactor["optimizer"] == 160
    with pytest.raises(ValueError, match="unknown mode"):
        per_gpu_bytes(c, 2, "full-sgd")


def test_memory_table_of_the_real_shapes(tmp_path):
    from benchmarks import memory_table

    result = memory_table.main(["--out", str(tmp_path)])
    seven = result["counts"]["7b"]
    assert seven["total"] / 1e9 == pytest.approx(8.3, rel=0.05)
    assert seven["root"] < seven["total"] / 4 and seven["largest_unit"] < seven["root"]
    row = next(r for r in result["rows"] if r["shape"] == "7b" and r["update"] == "full-adamw")
    assert row["1 GPU"] == f"{16 * seven['total'] / 2 ** 30:.1f} GiB"
    assert (tmp_path / "memory_computed.json").is_file()


@pytest.mark.slow
def test_desktop_benchmark_runs_small(tmp_path):
    from arpo_lib.envs.desktop.sandbox import desktop_unavailable
    from benchmarks import bench_desktop

    if desktop_unavailable():
        pytest.skip(desktop_unavailable())
    result = bench_desktop.main(["--envs", "2", "--episodes", "1", "--screen", "960x600", "--out", str(tmp_path)])
    (row,) = result["rows"]
    assert row["envs"] == 2 and not row["errors"] and row["success"] == 1.0
    assert row["rss_mib"] > 10 and row["reset_s"] > 0 and row["episodes_per_min"] > 0
    assert [e["task"] for e in row["per_env"]] == ["editor-type-save", "terminal-mkdir"]
    assert (tmp_path / "desktop_envs.json").is_file()
