"""The planner's "what fits on one GPU" table (docs/speed-and-memory.md and the README): for
80, 40, 24 and 16 GB cards (an H100, an A100-40GB, an L4, a T4: the memory each reports), UI-TARS-1.5-7B and UI-TARS-2B on OSWorld's sandbox tasks (15 1080p
screenshots kept) and on MiniWoB++, rollouts generated in this process; each cell the peak the
planner predicts with the levers it chose (cheapest first). Predictions, not measurements.

    python scripts/one_gpu_table.py            # the markdown table, also written to benchmarks/results/one_gpu_table.md
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from arpo_lib.run.config import load_config  # noqa: E402
from arpo_lib.training import plan as P  # noqa: E402

MODELS = {"UI-TARS-1.5-7B": "ByteDance-Seed/UI-TARS-1.5-7B", "UI-TARS-2B": "bytedance-research/UI-TARS-2B-SFT"}
SETTINGS = {  # (config, overrides): the shipped configs with the model swapped, generation in this process
    "OSWorld": ("configs/osworld_sandbox.yaml", ["rollout.backend=hf", "model.gradient_checkpointing=true"]),
    "MiniWoB": ("configs/subset_miniwob.yaml", ["model.gradient_checkpointing=true", "env.max_steps=5",
                                                "model.history_images=5", "rollout.group_size=4"]),
}
CARDS = ("H100-80GB", "A100-40GB", "L4", "T4")
"""Cards of 80, 40, 24 and 16 GB, planned against the memory each reports (`training.cards`)."""

WORDS = {  # an override as the table says it
    "train.optimizer=adafactor": "Adafactor", "model.freeze_vision_tower=true": "vision frozen",
    "model.lora_rank=16": "LoRA r16", "model.activation_offload=true": "offload",
}


def describe(overrides: list[str]) -> str:
    words = []
    for item in overrides:
        key, value = item.split("=", 1)
        if item in WORDS:
            words.append(WORDS[item])
        elif key == "model.history_images":
            words.append(f"{value} screenshots")
        elif key == "env.workers":
            words.append(f"{value} environment{'s' if value != '1' else ''}")
    return ", ".join(dict.fromkeys(words)) or "as configured"


def cell(model: str, setting: str, card: str) -> str:
    path, overrides = SETTINGS[setting]
    cfg = load_config(path, [*overrides, f"model.path={MODELS[model]}",
                             f"model.coord_mode={'qwen25vl' if '1.5' in model else 'qwen2vl'}"])
    memory = P.parse_memory(card)
    result = P.plan(cfg, memory, 1)
    if not result.fits_with_levers:
        return "does not fit"
    after = P.plan(P.fitted(cfg, result), memory, 1)
    return f"{describe(result.overrides)}: {after.peak.total / P.GIB:.1f}"


OUT = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "one_gpu_table.md"


def main() -> None:
    columns = [(m, s) for s in SETTINGS for m in MODELS]
    lines = ["| GPU | " + " | ".join(f"{m}, {s}" for m, s in columns) + " |", "|---|" + "---|" * len(columns)]
    for card in CARDS:
        lines.append(f"| {card} | " + " | ".join(cell(m, s, card) for m, s in columns) + " |")
    print("\n".join(lines))
    OUT.write_text("The planner's predictions (GiB at the peak with the levers it chose; not measurements), written by\n"
                   "`python scripts/one_gpu_table.py`.\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
