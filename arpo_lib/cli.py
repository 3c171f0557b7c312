"""Command line: `python -m arpo_lib <command>` (or `./workbench <command>`).

    build-tiny-model --variant qwen2vl --out models/tiny-uitars-qwen2vl
    train   --config configs/smoke.yaml [key=value ...]     start a run
    resume  --run runs/smoke                                continue a run from its last checkpoint
    eval    --config configs/smoke.yaml [--model DIR] [key=value ...]
    smoke   [key=value ...]                                 execute notebooks/smoke_test.ipynb headlessly
    notebook NAME [config=F] [overrides='[k=v, ...]'] [run_name=N]   execute any notebook headlessly
    config  [--config FILE] [key=value ...]                 print the resolved config and field docs
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def _cmd_build_tiny_model(args: argparse.Namespace) -> int:
    from arpo_lib.tiny_model import build_tiny_model

    path = build_tiny_model(args.out, variant=args.variant, seed=args.seed, overwrite=True)
    print(f"built {path}")
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from arpo_lib.config import load_config
    from arpo_lib.trainer import Trainer

    cfg = load_config(args.config, args.overrides)
    with Trainer(cfg, resume=args.resume) as trainer:
        trainer.train()
    print(f"run directory: {cfg.run_dir}")
    return 0


def _cmd_resume(args: argparse.Namespace) -> int:
    from arpo_lib.config import load_config
    from arpo_lib.trainer import Trainer

    config_path = Path(args.run) / "config.yaml"
    cfg = load_config(config_path, args.overrides)
    with Trainer(cfg, resume=True) as trainer:
        trainer.train()
    print(f"run directory: {cfg.run_dir}")
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    from arpo_lib.config import load_config
    from arpo_lib.workflows import run_evaluation

    overrides = list(args.overrides) + ([f"model.path={args.model}"] if args.model else [])
    cfg = load_config(args.config, overrides)
    out = Path(args.out) if args.out else cfg.run_dir / "eval" / time.strftime("%Y%m%d-%H%M%S")
    result = run_evaluation(cfg, out)
    print(result.table())
    print(f"results: {out}")
    return 0


def _cmd_smoke(args: argparse.Namespace) -> int:
    from arpo_lib.workflows import execute_notebook

    from arpo_lib.workflows import format_summary

    out = execute_notebook("notebooks/smoke_test.ipynb", {"overrides": list(args.overrides)}, run_name=args.name)
    summary = json.loads((out.parent / "summary.json").read_text())
    print(format_summary(summary))
    print(f"executed notebook: {out}")
    return 0


def _cmd_notebook(args: argparse.Namespace) -> int:
    import yaml

    from arpo_lib.workflows import execute_notebook

    name = args.name if args.name.endswith(".ipynb") else f"{args.name}.ipynb"
    path = Path("notebooks") / Path(name).name
    params = {}
    for item in args.parameters:
        if "=" not in item:
            print(f"error: parameter {item!r}: expected name=value (e.g. run_name=my-run)", file=sys.stderr)
            return 2
        key, raw = item.split("=", 1)
        params[key] = yaml.safe_load(raw)
    run_name = params.pop("run_name", None)
    try:
        out = execute_notebook(path, params, run_name=run_name)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"executed notebook: {out}")
    return 0


def _cmd_config(args: argparse.Namespace) -> int:
    import yaml

    from arpo_lib.config import field_docs, load_config

    cfg = load_config(args.config, args.overrides)
    if args.docs:
        for key, doc in field_docs().items():
            print(f"{key:<36} {doc}")
    else:
        print(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="arpo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("build-tiny-model", help="build a tiny UI-TARS-architecture checkpoint")
    p.add_argument("--variant", default="qwen2vl", choices=["qwen2vl", "qwen25vl"])
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_cmd_build_tiny_model)

    p = sub.add_parser("train", help="train with ARPO (or GRPO: algo.replay.enabled=false)")
    p.add_argument("--config", default="configs/smoke.yaml")
    p.add_argument("--resume", action="store_true", help="continue the run of the same name if it exists")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=5")
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser("resume", help="continue a run from its last complete checkpoint")
    p.add_argument("--run", required=True, help="run directory (holds config.yaml)")
    p.add_argument("overrides", nargs="*")
    p.set_defaults(func=_cmd_resume)

    p = sub.add_parser("eval", help="evaluate a model on a task set")
    p.add_argument("--config", default="configs/smoke.yaml")
    p.add_argument("--model", help="model directory (e.g. runs/x/checkpoints/step_000010/model)")
    p.add_argument("--out", help="output directory (default: <run>/eval/<time>)")
    p.add_argument("overrides", nargs="*")
    p.set_defaults(func=_cmd_eval)

    p = sub.add_parser("smoke", help="the CPU smoke run: executes notebooks/smoke_test.ipynb")
    p.add_argument("--name", default=None, help="run name (default: smoke-<time>)")
    p.add_argument("overrides", nargs="*")
    p.set_defaults(func=_cmd_smoke)

    p = sub.add_parser("notebook", help="execute a notebook headlessly (papermill) into its run directory")
    p.add_argument("name", help="smoke_test, subset_training, evaluation or gpu_inference_server")
    p.add_argument("parameters", nargs="*", help="config=FILE, overrides='[a.b=1, c=2]', run_name=NAME")
    p.set_defaults(func=_cmd_notebook)

    p = sub.add_parser("config", help="print the resolved config (or --docs: every key with its doc)")
    p.add_argument("--config", default=None)
    p.add_argument("--docs", action="store_true")
    p.add_argument("overrides", nargs="*")
    p.set_defaults(func=_cmd_config)

    args = parser.parse_args(argv)
    from arpo_lib.config import ConfigError

    try:
        return args.func(args)
    except (ConfigError, FileNotFoundError, FileExistsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
