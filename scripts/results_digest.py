"""Seed-determined results of a few runs, as one JSON file: to check that a change of code that
must not change results (a refactor) does not.

    python scripts/results_digest.py --out /tmp/before.json          # on the old commit
    python scripts/results_digest.py --out /tmp/after.json           # on the new one
    python scripts/results_digest.py --compare /tmp/before.json /tmp/after.json

Runs, each from nothing with fixed seeds (about 10 minutes on a 2-core machine):
- `smoke`: configs/smoke.yaml trained in this process (warm start, 6 ARPO steps, evaluations);
- `comparison`: the learning study's stages (warm start, selection, a GRPO and an ARPO-with-TIS
  arm of 2 steps, evaluations) on two MiniWoB tasks, as tests/test_experiments.py's bit-for-bit test;
- `fsdp2`: 2 steps of the smoke config on 2 torchrun processes (FSDP2 over gloo on the CPU);
  `--no-fsdp2` leaves it out.
Every file of every run goes in: JSON and JSONL with wall-clock fields left out and the output
directory written as <out>, other files (weights, token ids, log-probs, screenshots) by their
SHA-256. Logs and report.md (wall times) are left out. Results depend on the machine's Chromium
and torch: compare digests made on the same machine.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TINY = "models/tiny-uitars-qwen2vl"  # relative: a digest made in another checkout compares equal


def _timing(key: str) -> bool:
    k = key.lower()
    return any(t in k for t in ("second", "time", "elapsed", "wall", "per_s", "duration", "started", "finished",
                                "date", "mtime", "created")) or k.endswith("_s")


def digest_tree(root: Path, out_dir: Path) -> dict[str, Any]:
    def strip(obj: Any) -> Any:
        if isinstance(obj, dict):
            return {k: strip(v) for k, v in obj.items() if not _timing(k)}
        if isinstance(obj, list):
            return [strip(v) for v in obj]
        return obj

    digest: dict[str, Any] = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = str(path.relative_to(root))
        if path.suffix == ".log" or path.name in ("report.md", "trainer_state.json") or "__pycache__" in rel:
            continue
        data = path.read_bytes()
        if path.suffix in (".json", ".jsonl", ".yaml"):
            data = data.replace(str(out_dir).encode(), b"<out>").replace(str(REPO).encode(), b"<repo>")
        try:
            if path.name == ".metadata" and path.parent.name == "optimizer_shards":
                digest[rel] = _dcp_metadata(path)
            elif path.name == "manifest.json":  # checkpoint file sizes; trainer_state.json holds wall times
                digest[rel] = {k: v for k, v in json.loads(data).items() if k != "trainer_state.json"}
            elif path.suffix == ".json":
                digest[rel] = strip(json.loads(data))
            elif path.suffix == ".jsonl":
                digest[rel] = [strip(json.loads(line)) for line in data.decode().splitlines() if line.strip()]
            else:
                digest[rel] = hashlib.sha256(data).hexdigest()
        except (json.JSONDecodeError, UnicodeDecodeError):
            digest[rel] = hashlib.sha256(data).hexdigest()
    return digest


def _dcp_metadata(path: Path) -> str:
    """torch.distributed.checkpoint's index without its `storage_meta` (a random save id and the
    absolute path it was written to: different in every run)."""
    import dataclasses
    import pickle

    meta = pickle.loads(path.read_bytes())
    if dataclasses.is_dataclass(meta) and hasattr(meta, "storage_meta"):
        meta = dataclasses.replace(meta, storage_meta=None)
    return hashlib.sha256(pickle.dumps(meta)).hexdigest()


def run_smoke(out: Path) -> None:
    from arpo_lib import build

    cfg = build.load_config(REPO / "configs" / "smoke.yaml", [f"model.path={TINY}", f"out_dir={out}", "name=smoke",
                                                              "logging.progress=false"])
    with build.trainer(cfg) as trainer:
        trainer.train()


def run_comparison(out: Path) -> None:
    from arpo_lib.experiments import run_comparison as compare
    from arpo_lib.run.config import load_config

    cfg = load_config(REPO / "configs" / "learning_miniwob_short.yaml", [
        f"model.path={TINY}", f"out_dir={out}", "name=exp", "compare.seeds=[0]", "compare.algos=[grpo,arpo_tis]",
        "train.steps=2", "eval.samples_per_task=1", "warm_start.demos_per_task=2",
        "env.tasks=[miniwob/click-test, miniwob/login-user]", "logging.progress=false"])
    compare(cfg)


def run_fsdp2(out: Path) -> None:
    cmd = [sys.executable, "-m", "arpo_lib", "train", "--config", "configs/smoke.yaml", "--nproc-per-node", "2",
           f"model.path={TINY}", f"out_dir={out}", "name=fsdp2", "train.steps=2", "warm_start.steps=20",
           "train.eval_every=0", "logging.progress=false"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode != 0:
        raise SystemExit(f"the 2-process run failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")


RUNS = {"smoke": run_smoke, "comparison": run_comparison, "fsdp2": run_fsdp2}


def make(out_file: Path, names: list[str]) -> None:
    runs = {name: RUNS[name] for name in names}
    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="digest-") as tmp:
        for name, fn in runs.items():
            out = Path(tmp) / name
            print(f"[digest] {name} ...", file=sys.stderr, flush=True)
            fn(out)
            result[name] = digest_tree(out, out)
    out_file.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    print(f"[digest] {sum(len(v) for v in result.values())} files -> {out_file}", file=sys.stderr)


def compare(a_file: Path, b_file: Path) -> int:
    a, b = json.loads(a_file.read_text()), json.loads(b_file.read_text())
    differing = []
    for run in sorted(a.keys() & b.keys()):  # runs made on one side only are not compared
        ra, rb = a.get(run, {}), b.get(run, {})
        differing += [f"{run}/{k}" for k in sorted(ra.keys() | rb.keys()) if ra.get(k) != rb.get(k)]
    if differing:
        print(f"{len(differing)} files differ:", *differing[:40], sep="\n  ")
        return 1
    print(f"identical: {sum(len(a[r]) for r in a.keys() & b.keys())} files in {', '.join(sorted(a.keys() & b.keys()))}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--compare", type=Path, nargs=2)
    parser.add_argument("--no-fsdp2", action="store_true", help="leave the 2-process run out")
    parser.add_argument("--runs", default=",".join(RUNS), help=f"which runs (default: {','.join(RUNS)})")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    os.chdir(REPO)
    if args.compare:
        return compare(*args.compare)
    if not args.out:
        parser.error("--out FILE or --compare A B")
    names = [n for n in args.runs.split(",") if n and not (args.no_fsdp2 and n == "fsdp2")]
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        parser.error(f"unknown runs {unknown}; known: {', '.join(RUNS)}")
    make(args.out, names)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
