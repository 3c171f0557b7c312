"""The GPU quick start's table (docs/gpu-quickstart.md): for each recipe, the planner's peak memory
and an ESTIMATE of its time per ARPO step and in all, from the planner's workload and the figures
measured on an H100 (benchmarks/results/*.json). Nothing here ran on the recipes' GPUs: every time is
an estimate until it has.

    python scripts/gpu_recipes.py        # the markdown table; writes benchmarks/results/gpu_recipes.json (~1 min)

The time model, per ARPO step (one rollout batch and its update), stated so it can be checked:
- update: trajectories x update tokens per trajectory x the H100's measured seconds per token of a
  complete update of that model and mode (7B LoRA r16: 9.57 s, 7B full fine-tune fwd+bwd: 13.3 s,
  2B full fine-tune with AdamW: 9.83 s, each for one 41,814-token trajectory; a 2B LoRA update at the
  2B's rate times the 7B's LoRA-to-full ratio), x 4/3 for the old
  log-probs' forward, x the card's speed against an H100 (dense bf16 tensor throughput, vendor
  figures), / the training GPUs. A sliding screenshot window (model.history_images < env.max_steps)
  makes each step past the window a new segment of the whole kept context: update tokens per
  trajectory = the context x (max_steps - history_images + 1).
- rollout: in-process generation plays the episodes in waves of `env.workers` environments; each
  of the 15 steps costs an environment step (1.6 s: the desktop sandbox's OSWorld tasks,
  benchmarks/results/osworld_sandbox.json) plus a generation step, taken as the one measured on an
  H100 (2B, 8 episodes, 48 new tokens: 5.93 s per step, benchmarks/results/rollout_2b_8x15.json)
  scaled to 128-token responses and by the card's memory bandwidth against an H100 (decoding is
  bandwidth-bound). With model servers (vLLM), generation is taken at a tenth of that (vLLM's
  batched decoding; ASSUMED, not measured here).
"""
from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from arpo_lib.envs.osworld.task_sets import known_solutions  # noqa: E402
from arpo_lib.run.config import load_config  # noqa: E402
from arpo_lib.training import plan as P  # noqa: E402
from arpo_lib.training.cards import CARDS  # noqa: E402
from arpo_lib.training.workload import RESPONSE_TOKENS, cached_shape, workload  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


H100 = CARDS["H100-80GB"]
"""The card the measured figures come from."""


@dataclass(frozen=True)
class Recipe:
    key: str
    title: str
    config: str
    card: str
    gpus: int = 1
    overrides: tuple[str, ...] = ()
    evaluation_only: bool = False


RECIPES = [
    Recipe("eval-7b", "evaluate UI-TARS-1.5-7B on the sandbox's tasks", "configs/osworld_sandbox.yaml", "A100-40GB",
           evaluation_only=True),
    Recipe("colab-a100", "ARPO on a Colab A100 40 GB", "configs/one_gpu_40gb.yaml", "A100-40GB"),
    Recipe("24gb", "ARPO on a 24 GB card (UI-TARS-2B)", "configs/one_gpu_24gb.yaml", "RTX4090"),
    Recipe("1x8", "ARPO's subset run on one node of 8 GPUs", "configs/osworld_subset32.yaml", "H100-80GB", gpus=6),
    Recipe("2x8", "ARPO's full run on 2 nodes x 8 GPUs", "configs/osworld_full128.yaml", "H100-80GB", gpus=12),
]


def measured() -> dict[str, float]:
    """Seconds per trained token of one complete update on the H100, and the generation step."""
    def row(name: str, path: str = "ours") -> tuple[dict, dict]:
        data = json.loads((RESULTS / name).read_text())
        return data, next(r for r in data["rows"] if r["path"] == path)

    out = {}
    for key, name in [("7b_lora", "update_7b_15shots_lora16_adamw.json"), ("7b_full", "update_7b_15shots.json"),
                      ("2b_full", "update_2b_15shots_adamw.json")]:
        data, r = row(name)
        seconds = (data.get("update") or {}).get("s/update") or r["s/fwd+bwd"]
        out[key] = seconds / data["tokens"]
    rollout = json.loads((RESULTS / "rollout_2b_8x15.json").read_text())
    kv = next(r for r in rollout["rows"] if r["path"] == "kv-cached")
    out["gen_step_s"] = kv["s per step (mean)"] * RESPONSE_TOKENS / rollout["max_new_tokens"]
    sandbox = json.loads((RESULTS / "osworld_sandbox.json").read_text())
    out["env_step_s"] = sandbox["rows"][0]["step_s"]
    return out


def estimate(recipe: Recipe, rates: dict[str, float]) -> dict:
    cfg = load_config(recipe.config, list(recipe.overrides))
    card = CARDS[recipe.card]
    speed, bandwidth = card.bf16_tflops / H100.bf16_tflops, card.bandwidth_tbs / H100.bandwidth_tbs
    shape = cached_shape(cfg.model.path)
    w = workload(cfg, shape, gpus=recipe.gpus)
    p = P.plan(cfg, card.bytes, recipe.gpus)
    trajectories = cfg.train.tasks_per_batch * cfg.rollout.group_size
    window = min(cfg.model.history_images, cfg.env.max_steps)
    segments = cfg.env.max_steps - window + 1
    update_tokens = w.tokens * segments
    big = "7b" if shape.params > 4e9 else "2b"
    mode = "lora" if cfg.model.lora_rank else "full"
    # the one LoRA measurement is the 7B's: another model's LoRA update is its full update's rate
    # times the 7B's LoRA-to-full ratio
    rate = rates.get(f"{big}_{mode}") or rates[f"{big}_full"] * rates["7b_lora"] / rates["7b_full"]
    update_s = trajectories * update_tokens * rate * 4 / 3 / speed / recipe.gpus
    gen_s = rates["gen_step_s"] / bandwidth * (0.1 if cfg.rollout.backend == "server" else 1.0)
    waves = math.ceil(trajectories / max(1, cfg.env.workers * cfg.env.envs_per_worker))
    rollout_s = waves * cfg.env.max_steps * (rates["env_step_s"] + gen_s)
    if recipe.evaluation_only:
        # one copy of the weights as loaded and the episodes' KV caches: generation without the
        # trainer's optimizer state and gradients
        peak = p.evaluation.total  # the planner's standalone evaluation: one bf16 copy, the episodes' caches
        tasks = len(known_solutions())  # osworld/sandbox_solved: the tasks with a scripted solution
        episodes = tasks * cfg.eval.samples_per_task
        rollout_s = math.ceil(episodes / max(1, cfg.env.workers)) * cfg.env.max_steps * (rates["env_step_s"] + gen_s)
        return {
            "recipe": recipe.key, "title": recipe.title, "config": recipe.config, "card": card.name, "gpus": 1,
            "planned_peak_gib": round(peak / P.GIB, 1), "planned_phase": "evaluation",
            "fits": peak <= P.usable(card.bytes), "usable_gib": round(P.usable(card.bytes) / P.GIB, 1),
            "tasks": tasks, "episodes": episodes, "estimated_rollout_s_per_step": round(rollout_s),
            "estimated_update_s_per_step": 0, "estimated_hours": round(rollout_s / 3600, 1), "steps": 0,
            "estimated_gpu_hours": round(rollout_s / 3600, 1),
        }
    step_s, steps = rollout_s + update_s, cfg.train.steps
    hours = step_s * steps / 3600
    return {
        "recipe": recipe.key, "title": recipe.title, "config": recipe.config, "card": card.name,
        "gpus": recipe.gpus, "planned_peak_gib": round(p.peak.total / P.GIB, 1), "planned_phase": p.peak.name,
        "fits": p.fits, "usable_gib": round(P.usable(card.bytes) / P.GIB, 1),
        "trajectories_per_step": trajectories, "update_tokens_per_trajectory": update_tokens,
        "segments_per_trajectory": segments, "estimated_rollout_s_per_step": round(rollout_s),
        "estimated_update_s_per_step": round(update_s) if not recipe.evaluation_only else 0,
        "estimated_hours": round(hours, 1), "steps": steps,
        "estimated_gpu_hours": round(hours * recipe.gpus, 1),
    }


def table(rows: list[dict]) -> list[str]:
    """The quick start's markdown table of the recipes."""
    lines = ["| recipe | config | GPU (training GPUs) | planned peak GiB (usable) | est. s per step: rollout + update "
             "| est. hours (GPU-hours) |", "|---|---|---|---|---|---|"]
    for r in rows:
        total = (f"{r['estimated_hours']} ({r['estimated_gpu_hours']}), {r['steps']} steps" if r["steps"]
                 else f"{r['estimated_hours']} for {r['episodes']} episodes ({r['tasks']} tasks)")
        lines.append(f"| {r['title']} | `{r['config']}` | {r['card']} x {r['gpus']} | {r['planned_peak_gib']} "
                     f"({r['usable_gib']}){'' if r['fits'] else ' does NOT fit'} | {r['estimated_rollout_s_per_step']} + "
                     f"{r['estimated_update_s_per_step']} | {total} |")
    return lines


def main() -> None:
    rates = measured()
    rows = [estimate(r, rates) for r in RECIPES]
    (RESULTS / "gpu_recipes.json").write_text(json.dumps({"rates": rates, "recipes": rows}, indent=1) + "\n")
    print("\n".join(table(rows)))


if __name__ == "__main__":
    main()
