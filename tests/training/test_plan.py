"""The planner (arpo_lib/training/plan.py) against the H100 runs committed in benchmarks/results,
and its advice: a configuration that does not fit is explained, the config it writes fits."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from arpo_lib.run.config import load_config
from arpo_lib.training import plan as P

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"
GIB = P.GIB


@pytest.fixture(scope="module")
def shapes(tmp_path_factory) -> dict[str, P.ModelShape]:
    """UI-TARS-1.5-7B and UI-TARS-2B from their published config values (meta device, no weights)."""
    return {"7b": P.model_shape("ByteDance-Seed/UI-TARS-1.5-7B"), "2b": P.model_shape("bytedance-research/UI-TARS-2B-SFT")}


def _h100(name: str, update: bool = False) -> float:
    """A committed H100 peak (GiB): the `ours` path's fwd+bwd, or the complete update's."""
    record = json.loads((RESULTS / name).read_text())
    if update:
        return record["update"]["peak GiB"]
    return next(r for r in record["rows"] if r["path"] == "ours")["peak GiB"]


def _frozen_vision_h100() -> float:
    record = json.loads((RESULTS / "update_7b_15shots_sdpa_vision.json").read_text())
    return next(r for r in record["rows"] if r["path"] == "ours+frozenvision")["peak GiB"]


# The benchmarks' trajectory: 15 1080p screenshots through the real chat template (41,814 tokens,
# 161,460 patches, 735 trained), one micro-batch, activation checkpointing, bf16 autocast.
BENCH = P.Workload(tokens=41814, patches=161460, trained=735)
CASES = [  # (shape, Training, H100 peak GiB, what)
    ("7b", dict(weights_bytes=2, optimizer="none"), lambda: _h100("update_7b_15shots.json"), "7B fwd+bwd, bf16 weights"),
    ("7b", dict(weights_bytes=2, optimizer="none", freeze_vision=True), _frozen_vision_h100, "7B fwd+bwd, vision frozen"),
    ("7b", dict(lora_rank=16, optimizer="adamw"), lambda: _h100("update_7b_15shots_lora16_adamw.json", True),
     "7B LoRA r16 AdamW update (48.5 GiB)"),
    ("2b", dict(weights_bytes=2, optimizer="none"), lambda: _h100("update_2b_15shots.json"), "2B fwd+bwd, bf16 weights"),
    ("2b", dict(optimizer="adamw"), lambda: _h100("update_2b_15shots_adamw.json", True), "2B AdamW update (56.1 GiB)"),
]


@pytest.mark.parametrize("shape,training,reference,what", CASES, ids=[c[3] for c in CASES])
def test_the_planner_reproduces_the_h100_peaks_within_10_percent(shapes, shape, training, reference, what):
    update = next(p for p in P.phases(shapes[shape], BENCH, P.Training(in_process=False, **training))
                  if p.name == "update")
    assert update.total / GIB == pytest.approx(reference(), rel=0.10), what


def test_the_7b_full_update_with_adafactor_is_over_80gb_as_the_h100_ran_out_of_memory(shapes):
    update = next(p for p in P.phases(shapes["7b"], BENCH, P.Training(in_process=False, optimizer="adafactor"))
                  if p.name == "update")
    assert update.total > P.usable(80 * GIB)


def test_generation_matches_the_2b_rollout_on_the_h100(shapes):
    """bench_rollout.py --shape 2b --envs 8 --steps 15 --max-new-tokens 48: kv-cached, 46.3 GiB;
    fp32 weights, 8 rows of 41.8k tokens at the last step, prefill groups of 8192 tokens."""
    record = json.loads((RESULTS / "rollout_2b_8x15.json").read_text())
    measured = next(r for r in record["rows"] if r["path"] == "kv-cached")["peak GiB"]
    context = record["final_context_tokens"] // record["envs"]
    turn = P.screenshot_tokens(shapes["2b"], (1920, 1080)) + P.TURN_TEXT_TOKENS + 49
    w = P.Workload(tokens=context, patches=0, trained=1, generation_rows=8, generation_context=context,
                   max_new_tokens=48, prefill_tokens=2 * turn, prefill_patches=2 * 4 * (turn - 79))
    # measured when the cache was kept in fp32 (now in the compute dtype: half of it)
    generation = P.phases(shapes["2b"], w, P.Training(optimizer="none", kv_bytes=4))[0]
    assert generation.name == "generation"
    assert generation.total / GIB == pytest.approx(measured, rel=0.10)


def test_a_1080p_screenshot_is_2691_tokens(shapes):
    assert P.screenshot_tokens(shapes["7b"], (1920, 1080)) == 40365 // 15


def test_a_7b_full_fine_tune_with_in_process_rollouts_does_not_fit_80gb_and_names_the_levers(shapes):
    cfg = load_config(REPO / "configs" / "osworld_sandbox.yaml",
                      ["rollout.backend=hf", "model.gradient_checkpointing=true", "model.lora_rank=0"])
    result = P.plan(cfg, 80 * GIB, 1, shape=shapes["7b"])
    assert not result.fits
    assert result.peak.total > 80 * GIB
    named = " ".join(" ".join(added) for _, added, _ in result.levers)
    assert "train.optimizer=adafactor" in named and "model.freeze_vision_tower=true" in named
    assert result.levers[-1][2] <= P.usable(80 * GIB)  # the last lever brings it under
    peaks = [peak for _, _, peak in result.levers]
    assert peaks == sorted(peaks, reverse=True)  # every lever taken lowers the peak
    report = result.report()
    assert "does NOT fit" in report and "fidelity" in report


def test_the_written_config_loads_and_fits(shapes, tmp_path):
    cfg = load_config(REPO / "configs" / "osworld_sandbox.yaml", ["rollout.backend=hf"])
    result = P.plan(cfg, 40 * GIB, 1, shape=shapes["7b"])
    assert not result.fits and result.overrides
    out = P.write_config(cfg, result, tmp_path / "fits.yaml", shape=shapes["7b"])
    again = P.plan(load_config(out), 40 * GIB, 1, shape=shapes["7b"])
    assert again.fits and not again.levers
    assert "model.lora_rank=16" in result.overrides
    text = out.read_text()
    assert text.startswith("# Written by `./workbench plan`") and "| update |" in text


def test_server_mode_has_no_generation_phase_and_a_push(shapes):
    cfg = load_config(REPO / "configs" / "osworld_sandbox.yaml", ["rollout.backend=server", "model.lora_rank=16"])
    names = [p.name for p in P.plan(cfg, 80 * GIB, 1, shape=shapes["7b"]).phases]
    assert names == ["old log-probs", "update", "update, frozen tower's forward", "weight push"]


def test_a_push_over_nccl_counts_the_tensor_being_sent_beside_the_next_one_gathered(shapes):
    """On a GPU the push's pass runs one ahead (agent/model/shards.py): over NCCL the tensor being
    sent is still on the GPU while the next is gathered; over gloo it is in host memory."""
    def push(backend: str, gpus: int) -> dict[str, float]:
        cfg = load_config(REPO / "configs" / "osworld_sandbox.yaml",
                          ["rollout.backend=server", "serve.backend=vllm", "serve.weight_sync=true",
                           "rollout.weight_sync=stream", f"rollout.stream_backend={backend}"])
        return next(p for p in P.plan(cfg, 80 * GIB, gpus, shape=shapes["7b"]).phases if p.name == "weight push").parts

    largest = shapes["7b"].largest_param
    for gpus in (1, 8):
        gloo, nccl = push("gloo", gpus), push("nccl", gpus)
        assert "the tensor being sent (NCCL)" not in gloo
        assert nccl["the tensor being sent (NCCL)"] == 2 * largest
        assert sum(nccl.values()) - sum(gloo.values()) == 2 * largest


def test_gpu_memory_is_a_cards_name_or_a_size_read_as_written():
    """`--gpu-memory A100-40GB` is what such a card reports to torch (~39.6 GiB), not 40 GiB; a
    size means its unit: 40GB is 40 x 10^9 bytes (37.3 GiB), 40GiB is 40 GiB, a bare number GiB."""
    assert P.parse_memory("A100-40GB") == pytest.approx(39.6 * GIB) and P.parse_memory("l4") == pytest.approx(22.0 * GIB)
    for name in ("A10G", "RTX4090", "H100-80GB", "h100_80gb"):
        assert 20 * GIB < P.parse_memory(name) < 80 * GIB
    assert P.parse_memory("40GB") == 40e9 and P.parse_memory("40GiB") == P.parse_memory("40") == 40 * GIB
    assert P.parse_memory("24 GB") == 24e9
    with pytest.raises(ValueError, match="A100-40GB"):
        P.parse_memory("a big one")


def test_the_cli_plans_and_writes(tmp_path, monkeypatch, capsys):
    from arpo_lib.cli import main

    monkeypatch.setenv("ARPO_PLAN_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "fits.yaml"
    assert main(["plan", "--config", str(REPO / "configs" / "smoke.yaml"), "--gpu-memory", "16GB",
                 "--write", str(out), "--json", str(tmp_path / "plan.json")]) == 0
    assert "fits" in capsys.readouterr().out
    assert out.is_file() and json.loads((tmp_path / "plan.json").read_text())["fits"]
    assert list((tmp_path / "cache").glob("shape-*.json"))  # a repeat reads the shape from here


@pytest.mark.parametrize("variant,screenshots,size", [("qwen25vl", 4, (448, 448)), ("qwen2vl", 4, (448, 448)),
                                                      ("qwen25vl", 8, (896, 672))])
def test_the_tiny_models_update_on_the_cpu_is_planned_within_20_percent(variant, screenshots, size, request):
    """A real update of the tiny model (forward, backward, AdamW's step; checkpointing, fp32 on the
    CPU) measured by torch's memory tracker, against the planner's update phase for the same
    trajectory (the pixel inputs counted). At the tiny widths the CPU attention's (heads, T, T)
    scores dominate: the planner counts them on the CPU. Measured 27.3 / 24.5 / 47.2 MiB, planned
    26.0 / 25.2 / 46.6."""
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker

    from arpo_lib.agent.hf_policy import HFPolicy, enable_activation_checkpointing, pad_segments
    from benchmarks.common import synthetic_trajectory

    path = request.getfixturevalue(f"tiny_{variant}")
    policy = HFPolicy(path, device="cpu")
    enable_activation_checkpointing(policy.model)
    policy.model.train()
    batch = pad_segments([synthetic_trajectory(policy, screenshots, size)], policy.pad_id, side="right")
    targets = batch.pop("loss_mask").bool()
    opt = torch.optim.AdamW(policy.model.parameters(), lr=1e-6, foreach=False)
    for p in policy.model.parameters():  # the optimizer's state as from the second step on
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    with MemTracker() as tracker:
        tracker.track_external(policy.model, opt, *batch.values())  # the pixels count, as on a GPU
        policy.forward_logprobs(policy.model, dict(batch), targets, 1.0).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    measured = next(iter(tracker.get_tracker_snapshot("peak").values()))
    measured = float(next(v for k, v in measured.items() if str(getattr(k, "value", k)) == "Total"))

    w = P.Workload(tokens=batch["input_ids"].shape[1], patches=batch["pixel_values"].shape[0],
                   trained=int(targets.sum()))
    cpu = P.Training(in_process=False, compute_bytes=4, attention_scores=True)
    update = next(p for p in P.phases(P.model_shape(str(path)), w, cpu) if p.name == "update")
    assert update.total == pytest.approx(measured, rel=0.20)


def test_the_planner_follows_the_fake_tensor_measurement_at_one_and_two_ranks(shapes):
    """benchmarks/results/memory_measured.json (FakeTensorMode, fake process group, FSDP2's memory
    tracker; ~9% above an H100 where both ran): every phase at 1 and 2 ranks within 12%. At 8 and 16
    ranks the planner's update is 12-23% below it (FSDP2's backward temporaries, not modelled)."""
    results = json.loads((RESULTS / "memory_measured.json").read_text())["results"]
    checked = 0
    for r in results:
        if r["shape"] not in shapes or r["world_size"] > 2:
            continue
        t = P.Training(optimizer=r["optimizer"], gpus=r["world_size"], in_process=False,
                       freeze_vision=r.get("freeze_vision", False))
        for phase in P.phases(shapes[r["shape"]], BENCH, t):
            fake = r["phases"][phase.name]["Total"]
            assert phase.total == pytest.approx(fake, rel=0.12), (r["shape"], r["optimizer"], r["world_size"], phase.name)
            checked += 1
    assert checked == 2 * 2 * 2 * 3  # 7B and 2B, AdamW and Adafactor, 1 and 2 ranks, three phases


def test_the_measured_path_confirms_the_tiny_plan_and_a_repeat_reads_the_cache(tmp_path, monkeypatch):
    """`plan.measure`: the planned trajectory through the real processor, one training step on fake
    tensors (FSDP2's memory tracker, as benchmarks/memory_measured.py). The tiny model's update:
    measured 43.5 MiB, planned 33.9 on the CPU (1,634 tokens against 1,520 assumed); the repeat is
    answered from the cache without measuring."""
    from arpo_lib.training import memory_model

    monkeypatch.setenv("ARPO_PLAN_CACHE", str(tmp_path))
    cfg = load_config(REPO / "configs" / "smoke.yaml", ["model.gradient_checkpointing=true"])
    measured = P.measure(cfg)
    shape = P.cached_shape(cfg.model.path)
    planned = {p.name: p.total for p in P.phases(shape, P.workload(cfg, shape),
                                                   P.Training(in_process=False, attention_scores=True))}
    assert measured["update"] == pytest.approx(planned["update"], rel=0.30)
    assert measured["old log-probs"] == pytest.approx(planned["old log-probs"], rel=0.30)
    assert measured["tokens"] == pytest.approx(P.workload(cfg, shape).tokens, rel=0.10)

    def no_measuring(*args, **kwargs):
        raise AssertionError("measured again instead of reading the cache")

    monkeypatch.setattr(memory_model, "measure_step", no_measuring)
    assert P.measure(cfg) == measured


def test_several_gpus_keep_a_full_copy_to_generate_with_only_in_process(shapes):
    cfg = load_config(REPO / "configs" / "osworld_sandbox.yaml",
                      ["model.gradient_checkpointing=true", "rollout.backend=server"])
    in_process = P.plan(load_config(REPO / "configs" / "osworld_sandbox.yaml",
                                    ["model.gradient_checkpointing=true", "rollout.backend=hf"]), 80 * GIB, 4,
                        shape=shapes["7b"])
    served = P.plan(cfg, 80 * GIB, 4, shape=shapes["7b"])
    update = next(p for p in in_process.phases if p.name == "update")
    assert update.parts["full copy for rollouts"] == pytest.approx(4 * shapes["7b"].params)
    assert update.parts["weights"] == pytest.approx(update.parts["full copy for rollouts"] / 4)
    assert all("full copy for rollouts" not in p.parts for p in served.phases)


def test_require_fit_stops_an_unfit_run_with_the_plan(shapes, monkeypatch):
    monkeypatch.setattr(P, "cached_shape", lambda path: shapes["7b"])
    cfg = load_config(REPO / "configs" / "osworld_sandbox.yaml", ["rollout.backend=hf"])
    with pytest.raises(P.DoesNotFit, match="does NOT fit"):
        P.require_fit(cfg, 40 * GIB)
    assert P.require_fit(cfg, 400 * GIB).fits


def test_every_live_episode_keeps_its_kv_cache_whatever_the_batch():
    """The episodes' own KV caches live as long as the episodes: as many as a GPU's environments
    (its share of env.workers), whatever `rollout.max_batch` lets generate at once; the batch only
    sizes the step's slab. Fewer workers is the lever that shrinks both."""
    from arpo_lib.run.config import load_config

    shape = P.cached_shape(load_config("configs/osworld_sandbox.yaml").model.path)

    def parts(*overrides, gpus=1):
        cfg = load_config("configs/osworld_sandbox.yaml", ["rollout.backend=hf", *overrides])
        w = P.workload(cfg, shape, gpus=gpus)
        (gen,) = [p for p in P.phases(shape, w, P.training_of(cfg, gpus, "cuda")) if p.name == "generation"]
        return w, gen.parts

    w, full = parts("env.workers=8", "rollout.group_size=8", "train.tasks_per_batch=2")
    assert (w.generation_rows, w.generation_batch) == (8, 8)
    w, batched = parts("env.workers=8", "rollout.group_size=8", "train.tasks_per_batch=2", "rollout.mode=async",
                       "rollout.max_batch=2")
    assert (w.generation_rows, w.generation_batch) == (8, 2)
    assert batched["KV cache (episodes' copies)"] == full["KV cache (episodes' copies)"]
    assert batched["KV cache (the step's slab)"] == full["KV cache (the step's slab)"] / 4
    w, fewer = parts("env.workers=2", "rollout.group_size=8", "train.tasks_per_batch=2")
    assert w.generation_rows == 2 and fewer["KV cache (episodes' copies)"] == full["KV cache (episodes' copies)"] / 4
    w, _ = parts("env.workers=8", "rollout.group_size=8", "train.tasks_per_batch=2", gpus=4)  # each GPU its share
    assert w.generation_rows == 2


def test_a_run_that_would_not_fit_the_gpu_stops_before_it_starts(tmp_path, monkeypatch):
    """The notebooks and `./workbench train` open their trainer through
    `workflows.open_trainer`, which asks the planner first on a GPU: a 7B full fine-tune with
    in-process rollouts on a 40 GB card stops at once with the planner's table and levers, before
    any model is loaded or run directory made; train.plan_check=false lets it through."""
    import types

    import torch

    from arpo_lib import build, workflows
    from arpo_lib.run.config import load_config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(total_memory=40 * 2**30))
    started = []
    trainer = types.SimpleNamespace(step=0, replay=types.SimpleNamespace(enabled=True))
    monkeypatch.setattr(build, "trainer", lambda cfg, **kw: started.append(cfg) or trainer)
    cfg = load_config("configs/osworld_sandbox.yaml", [f"out_dir={tmp_path}", "rollout.backend=hf"])
    with pytest.raises(P.DoesNotFit, match=r"(?s)does NOT fit.*levers, cheapest first.*model\.lora_rank=16.*--write"):
        workflows.open_trainer(cfg)
    assert not started and not (tmp_path / cfg.name).exists()
    assert workflows.open_trainer(load_config("configs/osworld_sandbox.yaml", [
        f"out_dir={tmp_path}", "rollout.backend=hf", "train.plan_check=false"])) is trainer
    # a model the planner cannot read is let through (said in the log); the CPU is not planned for
    assert workflows.open_trainer(load_config("configs/smoke.yaml", [
        f"out_dir={tmp_path}", "model.path=someone/unknown-model"])) is trainer
    assert workflows.open_trainer(load_config("configs/osworld_sandbox.yaml", [
        f"out_dir={tmp_path}", "rollout.backend=hf", "model.device=cpu"])) is trainer


@pytest.mark.parametrize("name,card", [("one_gpu_40gb.yaml", "A100-40GB"), ("one_gpu_24gb.yaml", "L4"),
                                       ("one_gpu_24gb.yaml", "24GB")])
def test_the_one_gpu_configs_fit_the_cards_they_name(name, card):
    """configs/one_gpu_40gb.yaml (UI-TARS-1.5-7B, LoRA r16, 15 screenshots, activation offload) on
    an A100-40GB and one_gpu_24gb.yaml (UI-TARS-2B, LoRA r16, activation offload) on an L4 and on
    24e9 bytes fit by the planner, with the peak their header states; without their levers they
    would not."""
    import re

    from arpo_lib.run.config import load_config

    path = f"configs/{name}"
    cfg = load_config(path)
    result = P.plan(cfg, P.parse_memory(card), 1)
    assert result.fits and cfg.rollout.backend == "hf"
    phase, stated = re.search(r"peak: ([\w -]+), ([\d.]+) GiB", open(path).read()).groups()
    assert result.peak.name == phase and result.peak.total / 2**30 == pytest.approx(float(stated), abs=0.1)
    assert result.evaluation.total <= P.usable(P.parse_memory(card))
    bare = load_config(path, ["model.lora_rank=0", "model.history_images=15", "train.optimizer=adamw",
                              "model.freeze_vision_tower=false"])
    assert not P.plan(bare, P.parse_memory(card), 1).fits


def test_activation_offload_moves_the_kept_layer_inputs_to_host_memory(shapes):
    """model.activation_offload: the update's checkpointed layer inputs leave the GPU's total for
    the host's (the same bytes), nothing else changes; the planner tries it right after
    checkpointing and before any lever that costs fidelity; it needs checkpointing (the config
    says so) and does nothing on the CPU."""
    from arpo_lib.run.config import ConfigError

    cfg = load_config(REPO / "configs" / "one_gpu_40gb.yaml", ["model.activation_offload=false"])
    on = load_config(REPO / "configs" / "one_gpu_40gb.yaml")
    w = P.workload(cfg, shapes["7b"])
    off_phases = {p.name: p for p in P.phases(shapes["7b"], w, P.training_of(cfg))}
    on_phases = {p.name: p for p in P.phases(shapes["7b"], w, P.training_of(on))}
    kept = off_phases["update"].parts["kept layer inputs"]
    assert kept == 4 * w.tokens * shapes["7b"].hidden * shapes["7b"].layers  # fp32 (the residual stream), one row
    assert on_phases["update"].host == {"kept layer inputs (pinned)": kept}
    assert off_phases["update"].total - on_phases["update"].total == kept
    assert all(on_phases[n].parts == off_phases[n].parts for n in ("generation", "old log-probs"))
    assert not P.training_of(on, device="cpu").offload
    names = [lever.name for lever in P.LEVERS]
    assert names.index("model.gradient_checkpointing=true") < names.index("model.activation_offload=true") \
        < names.index("train.optimizer=adafactor")
    advice = P.plan(load_config(REPO / "configs" / "osworld_sandbox.yaml", ["rollout.backend=hf"]), 40 * GIB,
                    1, shape=shapes["7b"])
    # checkpointing, then offload (which brings checkpointing with it: the first went again as unneeded)
    assert advice.levers[0][0].name == "model.activation_offload=true"
    assert {"model.activation_offload=true", "model.gradient_checkpointing=true"} <= set(advice.overrides)
    assert "GiB pinned (model.activation_offload)" in P.plan(on, 40 * GIB, 1, shape=shapes["7b"]).report()
    with pytest.raises(ConfigError, match="model.activation_offload"):
        load_config(REPO / "configs" / "one_gpu_40gb.yaml", ["model.gradient_checkpointing=false"])


def test_one_gpu_keeps_one_copy_of_the_weights_and_frees_the_kv_caches_before_the_update(tiny_qwen25vl):
    """The one-GPU set-up's memory, measured on the tiny model with LoRA in this process:
    4 episodes of 3 KV-cached steps through the policy's own `generate`, every storage an operation
    makes counted. No tensor of a base weight's shape is made (no merged second copy: the adapters
    are applied in the forward, on the frozen base the update trains beside); the KV caches alive
    between steps are the planner's "episodes' copies" (1.82 MiB measured and planned); after
    `free_generation_memory` (what the rollout source calls before the update) nothing that
    generation made is alive; the generation peak is within 35% of the planner's phase (measured
    8.9 MiB, planned 6.8: the CPU's transient prefill at tiny widths is what it undercounts)."""
    import gc

    import torch

    from arpo_lib.agent.hf_policy import HFPolicy
    from arpo_lib.types import SamplingParams
    from benchmarks.bench_one_gpu import LiveBytes
    from benchmarks.common import screenshot

    policy = HFPolicy(tiny_qwen25vl, device="cpu", lora_rank=4, gradient_checkpointing=True)
    trained = [p for p in policy.model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=1e-6)
    for p in trained:  # the optimizer's state exists from the first update on
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    resident = sum(p.numel() * p.element_size() for p in policy.model.parameters())
    resident += sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if torch.is_tensor(v))

    tracker, new_tokens, episodes = LiveBytes(), 16, 4
    convs = [policy.new_conversation(f"Click button {i}") for i in range(episodes)]
    for step in range(3):
        for i, conv in enumerate(convs):
            conv.add_observation(screenshot(10 * i + step, size=(448, 448)))
        with tracker:
            out = policy.generate([c.current for c in convs], sampling=SamplingParams(max_new_tokens=new_tokens),
                                  seeds=list(range(episodes)), cache_keys=list(range(episodes)))
        for conv, g in zip(convs, out):
            conv.add_response(g.text, g.token_ids, g.logprobs)
    kept = tracker.live
    base_shapes = {tuple(m.weight.shape) for m in policy.model.modules() if hasattr(m, "base_layer")}
    assert base_shapes and not base_shapes & tracker.shapes
    policy.free_generation_memory()
    gc.collect()
    assert kept > 0 and tracker.live == 0

    seg = convs[0].current
    per_image = int(seg.image_grid_thw[0].prod()) // 4
    context = max(len(c.current) for c in convs)
    w = P.Workload(tokens=context, patches=sum(int(x.shape[0]) for x in seg.pixel_values), trained=3 * new_tokens,
                   generation_rows=episodes, generation_batch=episodes, generation_context=context,
                   max_new_tokens=new_tokens, prefill_tokens=per_image + P.TURN_TEXT_TOKENS + new_tokens,
                   prefill_patches=4 * per_image)
    cpu = P.Training(lora_rank=4, compute_bytes=4, frozen_bytes=4, kv_bytes=4, attention_scores=True)
    generation = next(p for p in P.phases(P.model_shape(str(tiny_qwen25vl)), w, cpu) if p.name == "generation")
    assert generation.parts["KV cache (episodes' copies)"] == pytest.approx(kept, rel=0.05)
    assert generation.total == pytest.approx(resident + tracker.peak, rel=0.35)


def test_a_lever_that_a_stronger_one_made_unneeded_is_taken_back(shapes):
    """The levers are applied cheapest first until the config fits; then each one the config
    still fits without goes again, the costliest first: UI-TARS-2B on OSWorld's sandbox tasks on
    40 GB keeps AdamW and needs only the frozen vision tower (the greedy pass had also applied
    offload and Adafactor); every kept lever's peak is on top of the ones above it."""
    cfg = load_config(REPO / "configs" / "osworld_sandbox.yaml",
                      ["rollout.backend=hf", "model.gradient_checkpointing=true",
                       "model.path=bytedance-research/UI-TARS-2B-SFT", "model.coord_mode=qwen2vl"])
    advice = P.plan(cfg, 40 * GIB, 1, shape=shapes["2b"])
    assert not advice.fits and advice.overrides == ["model.freeze_vision_tower=true"]
    assert [added for _, added, _ in advice.levers] == [["model.freeze_vision_tower=true"]]
    after = P.plan(P.fitted(cfg, advice), 40 * GIB, 1, shape=shapes["2b"])
    assert after.fits and advice.levers[-1][2] == after.peak.total


def test_the_one_gpu_table_script_prints_the_cards_rows(capsys):
    """scripts/one_gpu_table.py: the table docs/speed-and-memory.md and the README show."""
    import runpy

    runpy.run_path(str(REPO / "scripts" / "one_gpu_table.py"), run_name="__main__")
    rows = {line.split(" | ")[0].strip("| "): line for line in capsys.readouterr().out.splitlines()}
    assert set(rows) >= {"H100-80GB", "A100-40GB", "L4", "T4"}
    assert "LoRA r16" in rows["A100-40GB"].split(" | ")[1] and rows["L4"].split(" | ")[1] == "does not fit"


def test_a_sliding_screenshot_window_plans_a_whole_context_prefill(shapes):
    """With fewer screenshots kept than steps, each step past the window is a new segment (the
    oldest screenshot dropped) whose cache cannot be reused: its whole kept context is prefilled,
    one row alone over the budget (kv_generation's `_batches`). With all kept, a step prefills
    its new turn only."""
    cfg = load_config(REPO / "configs" / "one_gpu_40gb.yaml", ["model.history_images=8"])
    w = P.workload(cfg, shapes["7b"])
    assert cfg.model.history_images < cfg.env.max_steps
    assert (w.prefill_tokens, w.prefill_patches) == (w.tokens, w.patches)
    kept = P.workload(load_config(REPO / "configs" / "one_gpu_40gb.yaml", ["model.history_images=15"]), shapes["7b"])
    turn = P.screenshot_tokens(shapes["7b"], (1920, 1080)) + P.TURN_TEXT_TOKENS + P.RESPONSE_TOKENS + 1
    assert kept.prefill_tokens == 2 * turn < kept.tokens  # 2 environments' new turns in one forward
