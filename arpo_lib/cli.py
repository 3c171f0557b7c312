"""Command line: `python -m arpo_lib <command>` (or `./workbench <command>`).

    build-tiny-model --variant qwen2vl --out models/tiny-uitars-qwen2vl
    train   --config configs/smoke.yaml [key=value ...]     start a run
            [--nproc-per-node N [--nnodes M --master-addr A [--rdzv-id ID]]]   on N processes per node (torchrun)
            [--dry-run [--gpus-per-node G]]                     check the whole launch, print its plan, start nothing
    resume  --run runs/smoke [--nproc-per-node N ...]       continue a run from its last checkpoint
    eval    --config configs/smoke.yaml [--model DIR] [key=value ...]
    smoke   [--config FILE] [--seeds 0,1,2,3,4] [key=value ...]   execute notebooks/smoke_test.ipynb headlessly
    build-warm-start [--out DIR] [--config F]               make a warm-started model once (the smoke's)
    notebook NAME [config=F] [overrides='[k=v, ...]'] [run_name=N]   execute any notebook headlessly
    config  [--config FILE] [key=value ...]                 print the resolved config and field docs
    plan    --config F [--gpu-memory 40GB] [--gpus N] [--write OUT.yaml] [key=value ...]   will it fit the GPU?
    osworld-tasks fetch [--source S] [--force] | list [SET] [--ids] | verify | prefetch [SET]   OSWorld task data
    select-tasks --config F [--out DIR] [key=value ...]      ARPO's task selection (select.k rollouts per task)
    export-osworld EVAL_DIR [--model NAME] [--out DIR]     an evaluation in OSWorld's result layout
    compare --config configs/learning_miniwob.yaml [--report-only] [key=value ...]   ARPO vs GRPO from one warm start
    fetch-model NAME [--revision R] [--cache DIR] [--offline]   a hub checkpoint into the shared HF cache, and a report
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any


def _cmd_build_tiny_model(args: argparse.Namespace) -> int:
    from arpo_lib.training.tiny_model import SIZES, build_tiny_model

    path = build_tiny_model(args.out, variant=args.variant, seed=args.seed, overwrite=True, **SIZES[args.size])
    print(f"built {path}")
    return 0


def _torchrun(args: argparse.Namespace, nproc: int, command: list[str]) -> int:
    """Run `python -m arpo_lib <command>` as `nproc` processes (per node) under torchrun; each
    joins the process group and trains its share (arpo_lib/training/distributed.py)."""
    import subprocess

    from arpo_lib.training.distributed import socket_interface_env

    launch = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
    env = dict(os.environ)
    if args.nnodes > 1:
        # c10d rendezvous: the nodes meet at the master's address, each gets its rank as it joins
        # (no node ranks to hand out); the node at that address hosts the store.
        launch += [f"--nnodes={args.nnodes}", "--rdzv-backend=c10d",
                   f"--rdzv-endpoint={args.master_addr}:{args.master_port}", f"--rdzv-id={args.rdzv_id}",
                   "--rdzv-conf=join_timeout=1800"]
        # gloo (the control group) and NCCL on the interface that reaches the master, unless set
        env.update(interfaces := socket_interface_env(args.master_addr, env))
        if interfaces:
            print("socket interfaces:", " ".join(f"{k}={v}" for k, v in interfaces.items()), flush=True)
    else:
        launch += ["--standalone"]
    print("launching:", " ".join(launch + ["-m", "arpo_lib", *command]), flush=True)
    process = subprocess.Popen(launch + ["-m", "arpo_lib", *command], env=env)
    try:
        return process.wait()
    except BaseException:  # stopped (SIGTERM, Ctrl-C): torchrun passes SIGTERM on to every rank
        import signal

        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=TORCHRUN_STOP_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        raise


TORCHRUN_STOP_S = 60.0
"""How long a stopped launch waits for torchrun's ranks to clean up (their servers and
environments) before it kills torchrun."""


def _processes(args: argparse.Namespace, cfg: Any) -> int:
    """Training processes per node this call should start under torchrun (0: train here): the
    `--nproc-per-node` flag, else train.nproc_per_node; never again inside torchrun's processes."""
    from arpo_lib.training.distributed import Ranks

    n = args.nproc_per_node or cfg.train.nproc_per_node
    return n if (n > 1 or args.nnodes > 1) and not Ranks.under_torchrun() else 0


def _is_main_process() -> bool:
    from arpo_lib.training.distributed import Ranks

    return Ranks.from_env().is_main


def _dry_run(args: argparse.Namespace, cfg: Any, config: str) -> int:
    """`--dry-run`: the whole launch checked and its plan printed; nothing started, no model loaded.
    0 with "launch OK", 2 with every problem and its fix."""
    from arpo_lib.workflows.launch_plan import Launch, check_launch

    launch = Launch(args.nproc_per_node, args.nnodes, args.master_addr, args.master_port, args.rdzv_id,
                    args.gpus_per_node)
    plan = check_launch(cfg, launch, config)
    print(plan.report())
    return 0 if plan.ok else 2


def _cmd_train(args: argparse.Namespace) -> int:
    from arpo_lib import build
    from arpo_lib.training.distributed import Ranks

    cfg = build.load_config(args.config, args.overrides)
    if args.dry_run:
        return _dry_run(args, cfg, args.config)
    if not Ranks.under_torchrun():  # the launching process asks the memory planner once, before anything starts
        from arpo_lib.workflows.train import check_fit

        check_fit(cfg)
    if nproc := _processes(args, cfg):
        return _torchrun(args, nproc, ["train", "--config", args.config, *(["--resume"] if args.resume else []),
                                       *args.overrides])
    with build.trainer(cfg, resume=args.resume) as trainer:
        trainer.train()
    if _is_main_process():
        print(f"run directory: {cfg.run_dir}")
    return 0


def _cmd_resume(args: argparse.Namespace) -> int:
    from arpo_lib import build
    from arpo_lib.run.layout import RunDir

    cfg = build.load_config(RunDir(Path(args.run)).config, args.overrides)
    if args.dry_run:
        return _dry_run(args, cfg, str(RunDir(Path(args.run)).config))
    if nproc := _processes(args, cfg):
        # as `train --resume` (torchrun's own parser would take `--run` for its `--run-path`)
        return _torchrun(args, nproc, ["train", "--config", str(RunDir(Path(args.run)).config), "--resume",
                                       *args.overrides])
    with build.trainer(cfg, resume=True) as trainer:
        trainer.train()
    if _is_main_process():
        print(f"run directory: {cfg.run_dir}")
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    from arpo_lib import build
    from arpo_lib.workflows import run_evaluation

    overrides = list(args.overrides) + ([f"model.path={args.model}"] if args.model else [])
    cfg = build.load_config(args.config, overrides)
    out = Path(args.out) if args.out else cfg.run_dir / "eval" / time.strftime("%Y%m%d-%H%M%S")
    result = run_evaluation(cfg, out)
    print(result.table())
    print(f"results: {out}")
    return 0


def _make_prebuilt(model_path: str) -> None:
    """Make `model_path` if it is one of the warm starts the workbench makes once
    (`workflows.prepare.PREBUILT_WARM_STARTS`) and is not made, or was made with another recipe."""
    from arpo_lib import build
    from arpo_lib.experiments import build_warm_start_model
    from arpo_lib.workflows.prepare import PREBUILT_WARM_STARTS, use_repo_root

    key = Path(model_path).as_posix().removeprefix("./")
    if key in PREBUILT_WARM_STARTS:
        use_repo_root()
        build_warm_start_model(build.load_config(PREBUILT_WARM_STARTS[key]), Path(key))


def _cmd_build_warm_start(args: argparse.Namespace) -> int:
    from arpo_lib import build
    from arpo_lib.experiments import build_warm_start_model
    from arpo_lib.workflows.prepare import PREBUILT_WARM_STARTS

    recipe = args.config or PREBUILT_WARM_STARTS.get(Path(args.out).as_posix().removeprefix("./"))
    if recipe is None:
        print(f"error: no recipe for {args.out}: give --config (a config whose warm_start.* makes it)", file=sys.stderr)
        return 2
    out = build_warm_start_model(build.load_config(recipe, list(args.overrides)), Path(args.out))
    record = json.loads((out / "warm_start.json").read_text())
    print(f"warm start: {out} ({record['steps']} SFT steps, loss {record['loss_first']:.3f} -> "
          f"{record['loss_last']:.3f}, {record['seconds']} s when made)")
    return 0


def _cmd_smoke(args: argparse.Namespace) -> int:
    from arpo_lib import build
    from arpo_lib.run import layout
    from arpo_lib.workflows import execute_notebook, format_summary, smoke_seeds_table

    cfg = build.load_config(args.config, list(args.overrides))
    _make_prebuilt(cfg.model.path)  # the smoke's warm start, made once
    seeds = [int(x) for x in args.seeds.split(",")] if args.seeds else [None]
    summaries = []
    for seed in seeds:
        overrides = list(args.overrides) + ([f"train.seed={seed}"] if seed is not None else [])
        name = args.name if seed is None or args.name is None else f"{args.name}-s{seed}"
        out = execute_notebook("notebooks/smoke_test.ipynb", {"config": args.config, "overrides": overrides},
                               run_name=name)
        summary = json.loads((out.parent / layout.SUMMARY).read_text())
        print(format_summary(summary))
        print(f"executed notebook: {out}")
        summaries.append({**summary, "seed": seed if seed is not None else cfg.train.seed})
    if args.seeds:
        table, every = smoke_seeds_table(summaries, args.min_gain)
        print(table)
        if args.out:
            from arpo_lib.run.records import atomic_write_bytes

            record = {"command": "./workbench smoke --seeds " + args.seeds, "config": args.config,
                      "overrides": list(args.overrides), "date": time.strftime("%Y-%m-%d"), "table": table,
                      "every_seed_gained": every, "min_gain": args.min_gain, "summaries": summaries}
            atomic_write_bytes(Path(args.out), (json.dumps(record, indent=1, default=str) + "\n").encode())
            print(f"table and summaries: {args.out}")
        return 0 if every else 1
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

    from arpo_lib import build
    from arpo_lib.run.config import field_docs

    cfg = build.load_config(args.config, args.overrides)
    if args.docs:
        for key, doc in field_docs().items():
            print(f"{key:<36} {doc}")
    else:
        print(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    from arpo_lib import build
    from arpo_lib.training import plan as planner

    cfg = build.load_config(args.config, args.overrides)
    screen = tuple(int(v) for v in args.screen.lower().split("x")) if args.screen else None
    result = planner.plan(cfg, planner.parse_memory(args.gpu_memory), args.gpus, screen)
    print(result.report())
    if args.measure:
        measured = planner.measure(cfg, args.gpus or cfg.train.nproc_per_node, screen,
                                   progress=lambda m: print(m, flush=True))
        planned = {p.name: p.total for p in result.phases}
        print(f"\nmeasured on fake tensors ({measured['tokens']:,} tokens, {measured['patches']:,} patches; "
              "~9% above an H100 where both ran):")
        for name in ("old log-probs", "update", "weight push"):
            if name in planned:
                print(f"- {name}: measured {measured[name] / planner.GIB:.1f} GiB, planned {planned[name] / planner.GIB:.1f}")
    if args.json:
        planner.save_plan(result, args.json)
    if args.write:
        if not result.fits_with_levers:
            print("error: nothing the planner knows brings it under the budget: no config written", file=sys.stderr)
            return 1
        out = planner.write_config(cfg, result, args.write, screen)
        print(f"wrote {out}" + (f" ({' '.join(result.overrides)})" if result.overrides else " (unchanged: it fits)"))
        return 0
    return 0 if result.fits else 1


def _cmd_osworld_tasks(args: argparse.Namespace) -> int:
    from arpo_lib.envs.osworld import tasks as ot

    try:
        if args.action == "fetch":
            if args.source is None and ot.is_fetched(ot.pinned_root()) and not args.force:
                print(f"already fetched: {ot.pinned_root()} (--force fetches again)")
                return 0
            expect = ot.PINNED_EXPECTATIONS if args.pinned else ot.Expectations() if args.any_counts else None
            root = ot.fetch_tasks(args.source, force=args.force, progress=not args.no_progress, expect=expect)
            manifest = ot.read_manifest(root)
            print(f"OSWorld tasks: {root} ({ot.provenance(manifest)}, {manifest['task_count']} tasks, "
                  f"{manifest['file_count']} files)")
            print("  " + ", ".join(f"{d} {n}" for d, n in manifest["domains"].items()))
            for warning in manifest["warnings"]:
                print(f"  warning: {warning}")
        elif args.action == "list" and args.set is None:
            fetched = ot.is_fetched()
            for name, description in ot.TASK_SETS.items():
                size = len(ot.task_set(name)) if fetched else "-"
                print(f"{name:<10} {size:>5}  {description}")
            if not fetched:
                print(f"(not fetched: {ot.FETCH_HINT})")
        elif args.action == "list":
            by_domain = ot.task_set_by_domain(args.set)
            if args.ids:
                print("\n".join(f"{ot.ENV_PREFIX}/{t}" for ids in by_domain.values() for t in ids))
                return 0
            name = args.set.removeprefix(f"{ot.ENV_PREFIX}/")
            print(f"{name}: {ot.TASK_SETS[name]}")
            print(f"  from {ot.task_set_source(name)} of {ot.tasks_root()} ({ot.provenance(ot.read_manifest())})")
            print(f"  {'domain':<22} {'tasks':>5}")
            for domain, ids in by_domain.items():
                print(f"  {domain:<22} {len(ids):>5}")
            print(f"  {'total':<22} {sum(len(ids) for ids in by_domain.values()):>5}")
        elif args.action == "prefetch":
            from arpo_lib.envs.osworld.downloads import DownloadCache, default_download_cache, task_downloads

            names = [t.removeprefix(f"{ot.ENV_PREFIX}/") for t in ot.task_set(args.set)]
            tasks = [ot.load_task(t) for t in names]
            cache = DownloadCache(Path(args.cache) if args.cache else default_download_cache())
            needed = sum(len(task_downloads(t)) for t in tasks)
            print(f"{args.set}: {len(tasks)} tasks, {needed} files to download into {cache.root}")
            report = cache.prefetch(tasks, progress=not args.no_progress)
            print(report.summary())
            return 1 if report.failed else 0
        else:
            problems = ot.verify_cache()
            if problems:
                print("\n".join(problems))
                print(f"the cache {ot.tasks_root()} is damaged ({len(problems)} problems): "
                      "fetch again with `arpo osworld-tasks fetch --force`")
                return 1
            manifest = ot.read_manifest()
            print(f"ok: {manifest['file_count']} files match {ot.tasks_root() / ot.MANIFEST} "
                  f"(tree sha256 {manifest['tree_sha256'][:16]}...)")
    except (ot.TaskDataError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def _cmd_select_tasks(args: argparse.Namespace) -> int:
    from arpo_lib import build
    from arpo_lib.workflows import run_task_selection

    cfg = build.load_config(args.config, args.overrides)
    out = Path(args.out) if args.out else cfg.run.selection
    result = run_task_selection(cfg, out)
    print(result.table())
    print(f"kept tasks: {out / 'kept_tasks.yaml'} (train on them: --config with env.tasks from that file)")
    return 0


def _cmd_export_osworld(args: argparse.Namespace) -> int:
    from arpo_lib.evaluation.osworld_export import export_osworld_results

    eval_dir = Path(args.eval_dir)
    out = export_osworld_results(eval_dir, Path(args.out) if args.out else eval_dir / "osworld_results", args.model)
    print(f"OSWorld layout: {out}")
    return 0


def _cmd_compare(args: argparse.Namespace) -> int:
    from arpo_lib import build
    from arpo_lib.experiments import run_comparison

    cfg = build.load_config(args.config, args.overrides)
    report = run_comparison(cfg, report_only=args.report_only)
    print((cfg.run_dir / "report.md").read_text())
    print(f"experiment: {report['experiment']} (report.md, report.json, comparison.png)")
    return 0


def _cmd_fetch_model(args: argparse.Namespace) -> int:
    from arpo_lib.agent.hf_policy import checkpoint_sampling_defaults
    from arpo_lib.agent.prompt import coord_mode_for, image_processor_limits, load_processor
    from arpo_lib.run import model_fetch

    loaders = model_fetch.CheckpointLoaders(load_processor, coord_mode_for, image_processor_limits,
                                            checkpoint_sampling_defaults)
    try:
        result = model_fetch.fetch_model(args.name, loaders, revision=args.revision, cache=args.cache,
                                         offline=args.offline)
    except model_fetch.FetchModelError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 1 if result.report.problems else 0


def _add_launch_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("several processes (torchrun underneath; one per GPU)")
    g.add_argument("--nproc-per-node", type=int, default=None,
                   help="training processes on this node (default: train.nproc_per_node)")
    g.add_argument("--nnodes", type=int, default=1, help="nodes (run the same command on each)")
    g.add_argument("--master-addr", default="127.0.0.1",
                   help="the rendezvous node's address (c10d rendezvous: every node gives the same one)")
    g.add_argument("--master-port", type=int, default=29500, help="a free port on that node")
    g.add_argument("--rdzv-id", default=os.environ.get("SLURM_JOB_ID", "arpo"),
                   help="the run's rendezvous id, the same on every node (default: $SLURM_JOB_ID, else 'arpo')")
    g.add_argument("--dry-run", action="store_true",
                   help="check the whole launch (config, memory, processes against GPUs and the servers' GPUs, "
                        "what several nodes need, the Ray head) and print its plan; start nothing. "
                        "Exit 0: launch OK; 2: every problem with its fix")
    g.add_argument("--gpus-per-node", type=int, default=None,
                   help="with --dry-run: GPUs of each node (default: $SLURM_GPUS_PER_NODE, CUDA_VISIBLE_DEVICES or "
                        "nvidia-smi here, else unknown)")


def exit_on_sigterm() -> None:
    """SIGTERM (a scheduler's stop, `kill`, `timeout`) unwinds the command like Ctrl-C: Python's
    default ends the process at once, skipping its `finally` and `with` blocks, so the model servers
    and environment workers a run started (each in a process group of its own) outlived it. A second
    SIGTERM while it cleans up ends it at once. Only from the main thread (signal's rule)."""
    import signal
    import threading

    def stop(signum: int, _frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        raise SystemExit(128 + signum)

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, stop)


def exit_with_torchrun() -> None:
    """A rank started by torchrun ends (with what it started in its process group) when torchrun
    is gone. torchrun starts each rank in a session of its own, so a SIGKILL of the launch's
    process group (`kill -9`, a test, a killed terminal) does not reach the ranks: they went on
    training into the run directory. A parent already gone when this starts (reparented to init
    or a subreaper) ends the rank at once."""
    from arpo_lib.run.lifetime import end_group, end_group_with_parent

    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    parent = os.getppid()
    message = f"error: torchrun (process {parent}) is gone: this rank stops"
    try:
        cmdline = Path(f"/proc/{parent}/cmdline").read_bytes().split(b"\0")
    except OSError:
        cmdline = []
    if not any(b"torch.distributed.run" in part or part.endswith(b"torchrun") for part in cmdline):
        end_group(message)
    end_group_with_parent(parent, interval_s=0.5, message=message)


OVERRIDES_EPILOG = """overrides: KEY=VALUE with the config's dotted key names, values in YAML, e.g.
  eval.samples_per_task=2 env.workers=4 'eval.tasks=[osworld/smoke4, osworld/chrome10]' model.path=DIR
Every key and its doc: ./workbench config --docs; the resolved config: ./workbench config --config F [overrides].
An unknown key or an impossible combination is refused with the key named."""


def _print_commands(sub: argparse._SubParsersAction) -> int:
    """One line per command: its name and its help (what `./workbench --help` shows)."""
    for action in sub._choices_actions:
        print(f"  {action.dest:<18} {action.help}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser: one sub-command per workflow."""
    parser = argparse.ArgumentParser(prog="arpo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("build-tiny-model", help="build a tiny UI-TARS-architecture checkpoint")
    p.add_argument("--variant", default="qwen2vl", choices=["qwen2vl", "qwen25vl"])
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--size", default="tiny", choices=["tiny", "small"], help="tiny: ~0.4M parameters; small: ~3.6M")
    p.set_defaults(func=_cmd_build_tiny_model)

    p = sub.add_parser("train", help="train with ARPO (or GRPO: algo.replay.enabled=false)")
    p.add_argument("--config", default="configs/smoke.yaml")
    p.add_argument("--resume", action="store_true", help="continue the run of the same name if it exists")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=5")
    _add_launch_options(p)
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser("resume", help="continue a run from its last complete checkpoint")
    p.add_argument("--run", required=True, help="run directory (holds config.yaml)")
    p.add_argument("overrides", nargs="*")
    _add_launch_options(p)
    p.set_defaults(func=_cmd_resume)

    p = sub.add_parser("eval", help="evaluate a model on a task set", epilog=OVERRIDES_EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/smoke.yaml")
    p.add_argument("--model", help="model directory or Hugging Face id (e.g. runs/x/checkpoints/step_000010/model, "
                                   "ByteDance-Seed/UI-TARS-1.5-7B); the same as model.path=...")
    p.add_argument("--out", help="output directory (default: <run>/eval/<time>)")
    p.add_argument("overrides", nargs="*", help="dotted config overrides KEY=VALUE (see below)")
    p.set_defaults(func=_cmd_eval)

    p = sub.add_parser("smoke", help="the CPU smoke run: executes notebooks/smoke_test.ipynb")
    p.add_argument("--name", default=None, help="run name (default: smoke-<time>)")
    p.add_argument("--config", default="configs/smoke_learning.yaml",
                   help="run config: configs/smoke_learning.yaml (RL raising success on fixed instances, the "
                        "default), configs/smoke.yaml (the tiny model: the machinery only, what CI runs), "
                        "configs/desktop_smoke.yaml (the machinery on real desktop applications)")
    p.add_argument("--seeds", default=None,
                   help="comma-separated training seeds, e.g. 0,1,2,3,4: one smoke run each, then a table of "
                        "success before -> after per seed; exit status 1 unless every seed gained --min-gain")
    p.add_argument("--min-gain", type=float, default=0.10, help="the gain --seeds asks of every seed (default 0.10)")
    p.add_argument("--out", default=None, help="with --seeds: write the table and every seed's summary to this JSON file")
    p.add_argument("overrides", nargs="*")
    p.set_defaults(func=_cmd_smoke)

    p = sub.add_parser("build-warm-start", help="make a warm-started model once (SFT on scripted demonstrations)")
    p.add_argument("--out", default="models/small-uitars-qwen2vl-smoke", help="model directory to make")
    p.add_argument("--config", default=None, help="the config whose warm_start.* makes it (default: the one "
                                                   "--out is known by, e.g. configs/smoke_warm_start.yaml)")
    p.add_argument("overrides", nargs="*")
    p.set_defaults(func=_cmd_build_warm_start)

    p = sub.add_parser("notebook", help="execute a notebook headlessly (papermill) into its run directory")
    notebooks = sorted(path.stem for path in (Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
    p.add_argument("name", help="one of the notebooks in notebooks/: " + ", ".join(notebooks))
    p.add_argument("parameters", nargs="*", help="config=FILE, overrides='[a.b=1, c=2]', run_name=NAME")
    p.set_defaults(func=_cmd_notebook)

    p = sub.add_parser("config", help="print the resolved config (or --docs: every key with its doc)")
    p.add_argument("--config", default=None)
    p.add_argument("--docs", action="store_true")
    p.add_argument("overrides", nargs="*")
    p.set_defaults(func=_cmd_config)

    p = sub.add_parser("plan", help="each phase's peak GPU memory for a config, whether it fits, the levers")
    p.add_argument("--config", default="configs/smoke.yaml")
    p.add_argument("--gpu-memory", default="H100-80GB",
                   help="one GPU: a card's name (A100-40GB, A100-80GB, H100-80GB, H200, L40S, A10G, L4, RTX4090, "
                        "RTX3090, T4: the memory it reports) or a size read as written (40GB = 40e9 bytes, 39.6GiB, 80)")
    p.add_argument("--gpus", type=int, default=None, help="training GPUs (default: train.nproc_per_node)")
    p.add_argument("--screen", default=None,
                   help="screenshot size WxH (default: MiniWoB's 480x630 at scale 3 for MiniWoB tasks, else 1920x1080)")
    p.add_argument("--write", default=None, help="write the config with the levers applied (one that fits) here")
    p.add_argument("--json", default=None, help="write the plan as JSON here")
    p.add_argument("--measure", action="store_true",
                   help="confirm the update's phases by measuring them on fake tensors (7B: ~1.5 min; cached)")
    p.add_argument("overrides", nargs="*")
    p.set_defaults(func=_cmd_plan)

    p = sub.add_parser("osworld-tasks", help="OSWorld task data (ARPO's fork, pinned): fetch, list task sets, verify")
    tasks_sub = p.add_subparsers(dest="action", required=True)
    q = tasks_sub.add_parser("fetch", help="download, validate and cache evaluation_examples/")
    q.add_argument("--source", default=None,
                   help="http(s)/file URL, tarball or checkout directory (default: the pinned GitHub tarball)")
    q.add_argument("--force", action="store_true", help="replace a complete cache")
    q.add_argument("--pinned", action="store_true",
                   help="check ARPO's counts (128 list per domain, 369 tasks, set sizes) for a local source too")
    q.add_argument("--any-counts", action="store_true",
                   help="accept a 128-task list whose per-domain counts are not ARPO's (a fixture or your own list)")
    q.add_argument("--no-progress", action="store_true", help="no download progress bar")
    q = tasks_sub.add_parser("list", help="the task sets, or one set's per-domain table")
    q.add_argument("set", nargs="?", default=None, help="train128, subset32, smoke4, chrome10 or test_all")
    q.add_argument("--ids", action="store_true", help="print the set's env names (osworld/<task_id>) instead")
    tasks_sub.add_parser("verify", help="re-check the cache against its manifest (sha256 of every file)")
    q = tasks_sub.add_parser("prefetch", help="download the files a task set's set-ups need into the machine's "
                                              "shared download cache (resumable; failures per task)")
    q.add_argument("set", nargs="?", default="train128", help="task set (default train128)")
    q.add_argument("--cache", default=None, help="download cache directory (default: $ARPO_OSWORLD_DOWNLOADS or "
                                                 "~/.cache/arpo-workbench/osworld-downloads)")
    q.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=_cmd_osworld_tasks)

    p = sub.add_parser("select-tasks", help="ARPO's task selection: k rollouts of the base policy per task, "
                                            "keep tasks with a success (resumable)")
    p.add_argument("--config", default="configs/smoke.yaml")
    p.add_argument("--out", help="output directory (default: <run>/selection); rerun to resume")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. select.k=16 model.path=...")
    p.set_defaults(func=_cmd_select_tasks)

    p = sub.add_parser("export-osworld", help="mirror an evaluation directory into OSWorld's result layout")
    p.add_argument("eval_dir")
    p.add_argument("--model", default="model", help="model name in the layout (results/pyautogui/screenshot/<model>)")
    p.add_argument("--out", help="result root (default: <eval_dir>/osworld_results)")
    p.set_defaults(func=_cmd_export_osworld)

    p = sub.add_parser("compare", help="ARPO vs GRPO from one warm start, several seeds (resumable)")
    p.add_argument("--config", default="configs/learning_miniwob.yaml")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: write the report of the runs finished so far (while it runs, or after a stop)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. compare.seeds=[0,1,2] name=my-exp")
    p.set_defaults(func=_cmd_compare)

    p = sub.add_parser("fetch-model", help="download a hub checkpoint into the shared Hugging Face cache (size and "
                                           "disk checked first) and report what the workbench makes of it")
    p.add_argument("name", help="hub id, e.g. ByteDance-Seed/UI-TARS-1.5-7B")
    p.add_argument("--revision", default="main", help="branch, tag or commit (default main)")
    p.add_argument("--cache", default=None, help="hub cache directory (default: $HF_HUB_CACHE, else $HF_HOME/hub, "
                                                 "else ~/.cache/huggingface/hub)")
    p.add_argument("--offline", action="store_true", help="do not ask the hub: report a checkpoint already cached")
    p.set_defaults(func=_cmd_fetch_model)

    p = sub.add_parser("commands", help="these commands, one line each")
    p.set_defaults(func=lambda _args: _print_commands(sub))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from arpo_lib.run.config import ConfigError

    if argv is None:  # the command line itself (not a caller in its own process: a test, a notebook)
        exit_on_sigterm()
        exit_with_torchrun()
    try:
        return args.func(args)
    except (ConfigError, FileNotFoundError, FileExistsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
