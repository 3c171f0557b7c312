"""The benchmarks run at tiny sizes on the CPU: the optimised paths must agree with the naive ones
(no timing assertions), and the FLOP formula must give the real models' parameter counts."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from benchmarks import bench_rollout, bench_update
from benchmarks.common import _spans, train_flops
from tests.conftest import LONG

REPO = Path(__file__).resolve().parents[1]


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
    layer): what benchmarks/run_gpu.py runs on a GPU, down to building the model and the
    UI-TARS-sized image processing. The update runs on the default device, `auto`, as the GPU run
    does (it once crashed there: torch.device("auto"))."""
    update = bench_update.main(["--shape", "2b", "--text-layers", "1", "--vision-layers", "1", "--screenshots", "1",
                                "--resolution", "448x336", "--repeats", "1", "--out", str(tmp_path)])
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


def test_measured_memory_follows_the_training_code(tmp_path):
    """benchmarks/memory_measured.py on the 7B's widths with one decoder layer and one vision block,
    at 2 and 8 fake ranks: the shards, AdamW's moments and the push's one-parameter-at-a-time
    gather are where the training code puts them (a push that gathered every parameter before
    sending, or a second full model at start-up, fails here)."""
    from benchmarks import memory_measured as mm

    batch = mm.trajectory_batch("7b", 1, (224, 224))
    for ranks in (2, 8):
        r = mm.measure("7b", ranks, "adamw", 1, batch=batch, text_layers=1, vision_layers=1)
        full, shards, largest = r["full_copy_bytes"], r["shard_bytes"], r["largest_bf16_param_bytes"]
        assert shards == pytest.approx(full / ranks, rel=0.01)
        update, push = r["phases"]["update"], r["phases"]["weight push"]
        assert update["OptState"] == pytest.approx(2 * shards, rel=0.01)  # AdamW's two fp32 moments
        resident = push["Sharded Param"] + push["OptState"] + push["Inputs"]
        assert push["Total"] - resident <= 3 * largest * 1.01  # one parameter gathered in fp32 + its bf16 copy
        assert push["Total"] < update["Total"]
        assert mm.without(r, "start-up") <= shards + 2 * (2 * largest) * 1.01  # no second full model
        assert r["phases"]["old log-probs"]["Total"] < update["Total"]
    rows = mm.rows([r])
    assert rows[0]["ranks"] == 8 and rows[0]["peak without the full copy"].endswith("GiB")


@pytest.mark.slow
def test_osworld_sandbox_benchmark_runs_small(tmp_path, osworld_python):
    """benchmarks/bench_osworld_sandbox.py in the OSWorld interpreter, one environment, one episode
    of a real OSWorld task file, its desktop handed over prestarted; the reset split into the
    desktop's part and the task's set-up, and the density row. (A desktop reset in place, the
    default, is what every other sandbox test resets with; the prestarted hand-over's own test is in
    tests/envs/osworld/test_sandbox_provider.py.)"""
    import subprocess

    done = subprocess.run([osworld_python, "benchmarks/bench_osworld_sandbox.py", "--envs", "1", "--episodes", "1",
                           "--tasks-dir", "test_data/osworld_tasks", "--prestart", "on", "--out", str(tmp_path)],
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads((tmp_path / "osworld_sandbox.json").read_text())
    (row,) = result["rows"]
    assert row["prestart"] is True and row["envs"] == 1 and not row["errors"] and row["success"] == 1.0
    assert 10 < row["pss_mib"] <= row["rss_mib"] and row["first_reset_s"] > 0 and row["step_s"] > 0
    assert 0 <= row["reset_desktop_s"] < row["reset_s"] and row["reset_setup_s"] > 0
    assert [(d["desktop"], d["prestart"], d["envs_before_step_doubles"]) for d in result["density"]] == [
        ("gnome", True, 1)]


@pytest.mark.slow
def test_desktop_benchmark_runs_small(tmp_path):
    from desktop_sandbox.sandbox import desktop_unavailable
    from benchmarks import bench_desktop

    if desktop_unavailable():
        pytest.skip(desktop_unavailable())
    result = bench_desktop.main(["--envs", "2", "--episodes", "1", "--screen", "960x600", "--out", str(tmp_path)])
    (row,) = result["rows"]
    assert row["envs"] == 2 and not row["errors"] and row["success"] == 1.0
    assert row["rss_mib"] > 10 and row["reset_s"] > 0 and row["episodes_per_min"] > 0
    assert [e["task"] for e in row["per_env"]] == ["editor-type-save", "terminal-mkdir"]
    assert (tmp_path / "desktop_envs.json").is_file()


@pytest.mark.slow
def test_gpu_plan_parts_fit_a_ten_minute_command_and_rehearse_on_cpu(tmp_path):
    """benchmarks/run_gpu.py: each part's estimate fits a 10-minute command with room,
    and every step (both benchmarks, every lever path, the profile, the GPU tests) runs shrunk on
    the CPU and leaves its results file."""
    from benchmarks import run_gpu

    for part, steps in run_gpu.PARTS.items():
        assert sum(minutes for _, minutes, _ in steps) <= 8.5, part
        assert len(steps) + 2 <= 8  # one JSON per step, the log and the status: 8 files at most
    if not LONG:  # ~2 min of CI: a long variant (the 2B paths run shrunk above in every CI run)
        pytest.skip("the full rehearsal of benchmarks/run_gpu.py runs under ARPO_LONG_TESTS=1 (before a GPU run)")
    statuses = run_gpu.main(["all", "--rehearse", "--out", str(tmp_path)])
    assert [s["step"] for s in statuses] == [name for steps in run_gpu.PARTS.values() for name, _, _ in steps]
    assert all(s["status"] == "ok" for s in statuses), statuses
    written = {p.name for p in tmp_path.glob("*.json")}
    assert {"update_tiny25_1shots.json", "update_tiny_1shots.json", "update_tiny_1shots_adamw.json",
            "update_tiny25_1shots_lora16_adamw.json", "update_tiny_1shots_adafactor.json",
            "update_tiny25_1shots_compile.json", "update_tiny25_1shots_sdpa_vision.json",
            "update_tiny25_1shots_adafactor_frozenvision.json"} <= written, written
    levers = json.loads((tmp_path / "update_tiny25_1shots_compile.json").read_text())
    assert [r["path"] for r in levers["rows"]] == ["ours", "ours+compile"]
    assert levers["rows"][1]["max |dlogprob|"] < 1e-5 and levers["profile"]["categories"]
    assert (tmp_path / "part2.log").read_text().count("passed") >= 1


def test_the_one_gpu_part_rehearses_on_cpu_measured_beside_the_planner(tmp_path):
    """benchmarks/run_gpu.py part 5: the import probe, both one-GPU configs at the tiny shapes of
    their architectures and the KV-cache probe (~40 s): each phase (one rollout batch, old
    log-probs, the update) has its measured peak, seconds, the planner's prediction and the ratio;
    no cap on the CPU, said so."""
    from benchmarks import run_gpu

    # the part's estimates add up to 8 minutes at most: one 10-minute command with room for start-up
    assert sum(minutes for _, minutes, _ in run_gpu.PARTS["5"]) <= 8
    statuses = run_gpu.main(["5", "--rehearse", "--out", str(tmp_path)])
    assert [(s["step"], s["status"]) for s in statuses] == [
        ("imports", "ok"), ("one_gpu_24gb", "ok"), ("one_gpu_40gb", "ok"), ("kv_probe", "ok")], statuses
    imports = json.loads((tmp_path / "imports.json").read_text())
    assert imports["floors_met"] and all(m["ok"] for m in imports["modules"].values()), imports
    kv = json.loads((tmp_path / "kv_probe.json").read_text())["kv_dtype"]
    assert kv["same_tokens"] and kv["ratio"] == pytest.approx(0.5), kv  # the cache kept in bf16, same tokens
    for name, shape in (("one_gpu_40gb", "tiny25"), ("one_gpu_24gb", "tiny")):
        r = json.loads((tmp_path / f"{name}.json").read_text())
        assert r["shape"] == shape and r["oom"] is False and r["cap"]["applied"] is False
        assert [p["phase"] for p in r["phases"]] == ["generation", "old log-probs", "update"]
        for p in r["phases"]:
            assert p["measured_bytes"] > 0 and p["seconds"] > 0 and p["predicted_bytes"] > 0, p
            assert p["ratio"] == pytest.approx(p["measured_bytes"] / p["predicted_bytes"])
            assert p["ratio_as_run"] > 0
        assert r["settings"]["trajectories"] == 2 and r["update_metrics"]["optimizer_steps"] == 2
    lora = json.loads((tmp_path / "one_gpu_40gb.json").read_text())
    assert lora["settings"]["lora_rank"] == 16 and lora["build"]["trainable"] < lora["build"]["params"] / 10
    from benchmarks.report import one_gpu_section

    assert "| update |" in one_gpu_section(lora) and "no memory cap" in one_gpu_section(lora)


def test_path_levers_parse_and_unknown_ones_are_refused():
    spec = bench_update.parse_path("ours+compile+ckpt2+cudnn")
    assert (spec["base"], spec["compile"], spec["ckpt"], spec["sdpa"], spec["chunk"]) == ("ours", True, 2, "cudnn", 1024)
    assert bench_update.parse_path("naive")["vision"] == "loop"
    with pytest.raises(ValueError, match="unknown lever 'fast'"):
        bench_update.parse_path("ours+fast")
    with pytest.raises(ValueError, match="base"):
        bench_update.parse_path("best+compile")


def _gpu_update(shape, rows=(), update=None, reference="naive"):
    return {"benchmark": "update", "device": "NVIDIA H100 80GB HBM3", "shape": shape, "screenshots": 15,
            "rows": list(rows), "update": update, "reference_path": reference, "text_layers": None,
            "vision_layers": None}


def test_goals_table_says_met_missed_or_not_measured():
    from benchmarks.report import goals

    assert goals([]).count("not measured") == 4
    results = [
        _gpu_update("7b", [{"path": "naive", "s/fwd+bwd": 38.7, "MFU": 0.09},
                           {"path": "ours", "s/fwd+bwd": 11.0, "speed-up": 3.5, "MFU": 0.33}]),
        _gpu_update("7b", [{"path": "ours", "MFU": 0.33}, {"path": "ours+compile", "MFU": 0.41}], reference="ours"),
        _gpu_update("2b", update={"optimizer": "adamw", "lora_rank": 0, "peak GiB": 38.5}),
        _gpu_update("7b", update={"optimizer": "adafactor", "lora_rank": 0, "status": "out of memory"}),
        _gpu_update("7b", update={"optimizer": "adamw", "lora_rank": 16, "peak GiB": 31.0}),
    ]
    lines = {line.split(" | ")[0].strip("| "): line for line in goals(results).splitlines() if line.startswith("| ")}
    assert lines["7B update fwd+bwd at least 3x the naive path"].endswith("| 3.50x | met |")
    assert "41.0% (ours+compile) | met" in lines["7B update at least 40% MFU"]
    assert lines["2B complete update (AdamW) under 40 GB"].endswith("| missed |")  # 38.5 GiB = 41.3 GB
    assert "adamw LoRA r16: 31.0 GiB; adafactor: out of memory | met" in lines[
        "a 7B configuration that trains on one 80 GB GPU"]
    # a frozen vision tower is named beside the best path that trains the whole model
    results.append(_gpu_update("7b", [{"path": "ours", "MFU": 0.27}, {"path": "ours+frozenvision", "MFU": 0.38}],
                               reference="ours"))
    lines = {line.split(" | ")[0].strip("| "): line for line in goals(results).splitlines() if line.startswith("| ")}
    assert "41.0% (ours+compile) | met" in lines["7B update at least 40% MFU"]
    results[1]["rows"][1]["MFU"] = 0.30
    lines = {line.split(" | ")[0].strip("| "): line for line in goals(results).splitlines() if line.startswith("| ")}
    assert lines["7B update at least 40% MFU"].endswith(
        "| 38.0% (ours+frozenvision); training the whole model 33.0% (ours) | missed |")


def test_mfu_counts_the_flops_a_path_runs():
    """A frozen vision tower runs its forward only (1/3); LoRA's frozen base weights skip their
    weight gradients (4/6 of the linears), its vision tower frozen too; attention keeps 6x."""
    from benchmarks.common import executed_flops

    flops = {"text_linear": 600.0, "text_attention": 300.0, "lm_head": 6.0, "vision_linear": 120.0,
             "vision_attention": 30.0}
    flops["total"] = sum(flops.values())
    assert executed_flops(flops) == flops["total"]
    assert executed_flops(flops, frozen_vision=True) == pytest.approx(600 + 300 + 6 + 50)
    assert executed_flops(flops, frozen_linears=True) == pytest.approx(400 + 300 + 4 + 50)


def test_report_renders_every_committed_result_and_a_gpu_goals_table(tmp_path):
    """benchmarks/report.py over the committed results (the memory table and desktop results are
    not its business), then over a copy with one result marked as taken on a GPU."""
    import shutil

    from benchmarks import report
    from benchmarks.common import RESULTS_DIR

    text = report.main(RESULTS_DIR, tmp_path / "RESULTS.md")
    committed = [json.loads(p.read_text()) for p in RESULTS_DIR.glob("*.json")]
    rendered = [r for r in committed if r.get("benchmark") in ("update", "rollout")]
    assert text.count("\n## Update: ") + text.count("\n## Rollout generation: ") == len(rendered)
    assert ("## The goals" in text) == any(not r["device"].startswith("CPU") for r in rendered)
    # the async results: the ratios, and where the idle CPU was measured the bound it sets, on one line
    osworld = json.loads((RESULTS_DIR / "async_osworld.json").read_text())
    line = next(t for t in text.splitlines() if t.startswith("steps per hour over lockstep: async_s1 "
                                                             f"{osworld['steps_per_hour_ratio']['async_s1']:.2f}x"))
    assert f"could make on these cores: {osworld['cpu_bound_speedup']:.2f}x" in line
    results = tmp_path / "results"
    shutil.copytree(RESULTS_DIR, results)
    for path in results.glob("*.json"):  # the CPU results alone
        if json.loads(path.read_text()).get("device", "CPU").startswith("CPU") is False:
            path.unlink()
    text = report.main(results, tmp_path / "RESULTS.md")
    assert "No GPU figures yet" in text and "## Update: tiny25" in text and "## The goals" not in text
    update = json.loads((results / "update_7b_L1V2_1shots.json").read_text())
    update.update(device="NVIDIA H100 80GB HBM3", screenshots=15, text_layers=None, vision_layers=None,
                  reference_path="naive")
    (results / "update_7b_L1V2_1shots.json").write_text(json.dumps(update))
    text = report.main(results, tmp_path / "RESULTS.md")
    assert "No GPU figures yet" not in text
    assert "| 7B update fwd+bwd at least 3x the naive path | 1.03x | missed |" in text


@pytest.mark.slow
def test_settle_benchmark_runs_small(tmp_path):
    from desktop_sandbox import gnome
    from desktop_sandbox.sandbox import desktop_unavailable
    from benchmarks import bench_settle

    if desktop_unavailable() or gnome.unavailable():
        pytest.skip(desktop_unavailable() or gnome.unavailable())
    result = bench_settle.main(["--repeats", "1", "--timeout", "4", "--out", str(tmp_path)])
    rows = {r["set-up"]: r for r in result["rows"]}
    assert set(rows) == set(bench_settle.SETUPS)
    assert rows["a command, no window"]["before_s"] >= 4  # the old wait ran out: nothing opened a window
    assert (tmp_path / "settle.json").is_file()


def test_the_async_projection_is_a_schedule_not_a_guess(tmp_path):
    """benchmarks/project_async.py (asynchronous ARPO's GPU-scale projection): with identical environments
    and no update the two schedules take the same time (nothing to overlap, no one to wait for);
    with varied steps and an update, async with staleness 1 makes more steps per hour and keeps the
    environments busier, staleness 2 at least as many; the result file carries its inputs."""
    from benchmarks import project_async as pa

    flat = pa.Setting(envs=8, episodes_per_batch=8, step_s=(1.0, 1.0), reset_s=(2.0, 2.0), slow_reset=(0.0, 0.0),
                      gen_s=0.5, update_s=0.0, success=0.0, batches=3)
    rows = {r["arm"]: r for r in pa.project(flat)}
    assert rows["lockstep"]["wall_s"] == rows["async_s1"]["wall_s"] == 3 * (2.0 + 15 * 1.5)
    varied = pa.Setting(envs=8, episodes_per_batch=8, update_s=30.0, batches=6)
    rows = {r["arm"]: r for r in pa.project(varied)}
    assert rows["async_s1"]["steps_per_hour_ratio"] > 1.2
    assert rows["async_s2"]["steps_per_hour"] >= rows["async_s1"]["steps_per_hour"] * 0.999
    assert 0 < rows["lockstep"]["env_busy_fraction"] < rows["async_s1"]["env_busy_fraction"] <= 1
    assert pa.main(["--envs", "8", "--episodes", "8", "--batches", "3", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "async_projection.json").read_text())
    assert result["kind"].startswith("a simulation") and result["setting"]["envs"] == 8
    assert set(result["steps_per_hour_ratio"]) == {"async_s1", "async_s2"}


@pytest.mark.slow
@pytest.mark.long
def test_ray_cluster_benchmark_runs_small(tmp_path, chromium_available):
    """benchmarks/bench_ray_cluster.py at its small size: one step of the tiny model with local
    workers and with actors on the two worker nodes of a Ray test cluster, then a node lost."""
    from benchmarks import bench_ray_cluster

    result = bench_ray_cluster.main(["--small", "--arms", "local_lockstep", "cluster_lockstep", "--calls", "20",
                                     "--out", str(tmp_path)])
    local, cluster = result["arms"]
    assert (local["arm"], cluster["arm"]) == ("local_lockstep", "cluster_lockstep")
    assert local["steps"] == cluster["steps"] == 1 and local["env_errors"] == cluster["env_errors"] == 0
    assert cluster["actors_per_node"] == [2, 2] and local["actors_per_node"] is None
    lost = result["node_loss"]
    assert lost["error"].startswith("environment node lost") and lost["left_running"] == 0
    assert lost["actors_per_node_after"] == [2] and lost["processes_of_the_lost_actor"] >= 3
    assert set(result["call_round_trip"]) == {"local_worker_ms", "actor_on_a_worker_node_ms"}
    assert (tmp_path / "ray_cluster_small.json").is_file()
