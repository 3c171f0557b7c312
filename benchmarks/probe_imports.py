"""Before a GPU run: what the machine's Python has, and whether the configs can run with it.

  python benchmarks/probe_imports.py --out "$OUT"      # writes imports.json (seconds)

Each module the one-GPU run imports, with its version or its error (matplotlib, yaml, PIL, peft,
transformers, and arpo_lib's build, which imports them); the floors the configs need
(transformers for activation offload, torch for LoRA on several processes); the GPU's name and
memory. Exit 0 whatever it finds: the JSON says what is missing, and the steps after it would
fail on it."""
from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODULES = ("torch", "transformers", "peft", "accelerate", "matplotlib", "yaml", "PIL", "numpy", "arpo_lib.build")


def probe() -> dict:
    found: dict = {}
    for name in MODULES:
        try:
            module = importlib.import_module(name)
            found[name] = {"ok": True, "version": getattr(module, "__version__", None)}
        except Exception as exc:  # noqa: BLE001 (what a run would meet)
            found[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
    record: dict = {"benchmark": "imports", "modules": found}
    try:
        from arpo_lib.run.config import LORA_FSDP2_TORCH, OFFLOAD_TRANSFORMERS, installed_version

        record["floors"] = {
            "transformers_for_activation_offload": {"needs": list(OFFLOAD_TRANSFORMERS),
                                                    "has": list(installed_version("transformers"))},
            "torch_for_lora_on_fsdp2": {"needs": list(LORA_FSDP2_TORCH), "has": list(installed_version("torch"))}}
        record["floors_met"] = all(tuple(v["has"]) >= tuple(v["needs"]) for v in record["floors"].values())
    except Exception as exc:  # noqa: BLE001
        record["floors_error"] = f"{type(exc).__name__}: {exc}"[:300]
    try:
        import torch

        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            record["gpu"] = {"name": props.name, "total_gib": props.total_memory / 2**30, "count": torch.cuda.device_count()}
        else:
            record["gpu"] = None
    except Exception as exc:  # noqa: BLE001
        record["gpu_error"] = str(exc)[:300]
    return record


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    record = probe()
    text = json.dumps(record, indent=1)
    print(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "imports.json").write_text(text + "\n")
    return record


if __name__ == "__main__":
    main()
