"""The one-GPU configs against the planner: one rollout batch and one update of a planned config on
a card capped to the size the config is planned for, measured per phase beside the planner's
prediction.

  python benchmarks/bench_one_gpu.py --config configs/one_gpu_40gb.yaml --cap-gb 38.5 --out "$OUT"   # a GPU
  python benchmarks/bench_one_gpu.py --config configs/one_gpu_24gb.yaml --cap-gb 22.0 --out "$OUT"
  python benchmarks/bench_one_gpu.py --config configs/one_gpu_24gb.yaml --cap-gb 24 --shape tiny \\
      --resolution 448x336 --trajectories 2 --device cpu --out /tmp/r          # the CPU rehearsal (seconds)
  python benchmarks/run_gpu.py 5 --out "$OUT"                                 # both, as part 5 of the GPU runs

On CUDA the process is capped first (`torch.cuda.set_per_process_memory_fraction(cap / total)`,
`--cap-gb` read as GiB, the planner's unit), then the config's model shape is built with random
weights on the device (UI-TARS-1.5-7B or UI-TARS-2B, matched to benchmarks/common.REAL_SHAPES)
through the workbench's own `build.hf_policy` (LoRA rank, frozen vision tower, history_images,
gradient checkpointing, frozen-weight dtype as a run applies them) and the optimizer's state is
made as from the second step on (as a run's steady state). Then the phases, each with its peak
(`torch.cuda.max_memory_allocated`, reset before it) and its seconds:

- generation: one rollout batch of the planner's live episodes (its `generation_rows`:
  env.workers x envs_per_worker, at most the batch) over `env.max_steps` steps of synthetic
  screenshots at the config's screen, KV-cached as rollouts run (bench_rollout.run_episodes),
  responses of `--max-new-tokens` (default 128, the planner's typical response: random weights
  rarely end early; the planner's prediction "as run" uses the same cap and the context reached),
  the host synchronisations counted (CUDA's sync debug mode) and the live blocks right after it
  summarised by where they were allocated (`generation_snapshot`);
- old log-probs and update: `training.update.PolicyUpdate`, the trainer's update (old log-probs,
  the clipped loss, `train.updates_per_batch` optimizer steps) over `--trajectories` sequences
  (default the batch, tasks_per_batch x group_size), each the planner's trajectory: the last
  segment of `env.max_steps` steps with `model.history_images` screenshots kept and responses of
  RESPONSE_TOKENS (one built, copied: the same memory and time, a fraction of the CPU work).

Then the pinned host memory (activation offload's) and, under LoRA, the merge a checkpoint writes
(seconds, host RSS). Each phase records the allocator's reserved peak beside the allocated one.
Each phase is written beside the planner's prediction for the config (`plan.plan` on the cap, the
config's screen) and "as run" (the planner's arithmetic on the trajectory and context measured
here), with the ratios measured / predicted. An out-of-memory is a result (`"oom": true` and the
phase), not a crash. One JSON per config, named after it (`one_gpu_40gb.json`).

On the CPU (`--device cpu`, or no CUDA) there is no cap (the JSON says so); `--shape tiny|tiny25`
swaps the model for the repository's tiny model of the same architecture, predicted by the
planner for that shape on the CPU (`training_of(cfg, 1, "cpu")`: fp32 activations, attention
scores), and measured by torch's memory tracker (MemTracker, as tests/training/test_plan.py);
where the tracker fails, the measured bytes are null and the JSON says why.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import (REAL_SHAPES, device_name, real_config, sync, synthetic_trajectory,  # noqa: E402
                               tiny_model_dir, transformers_version, use_uitars_pixel_limits, write_result)
from arpo_lib.training import plan as P  # noqa: E402

GIB = 2 ** 30
VARIANT_OF = {"qwen2_vl": "qwen2vl", "qwen2_5_vl": "qwen25vl"}


def shape_of(cfg: Any) -> str:
    """The REAL_SHAPES entry of the config's model.path (its architecture and width)."""
    config = P.model_config(cfg.model.path)
    text = config.get_text_config()
    for name, real in REAL_SHAPES.items():
        if (real["variant"] == VARIANT_OF.get(config.model_type) and real["spec"]["hidden_size"] == text.hidden_size
                and real["spec"]["num_hidden_layers"] == text.num_hidden_layers):
            return name
    raise ValueError(f"model.path {cfg.model.path!r} ({config.model_type}, hidden {text.hidden_size}) matches no "
                     f"shape of benchmarks/common.REAL_SHAPES")


def cap_memory(cap_gib: float, device: torch.device) -> dict:
    """Cap this process's CUDA memory at `cap_gib` GiB (before anything is built)."""
    if device.type != "cuda":
        return {"applied": False, "why": "not on CUDA: no per-process memory cap on the CPU"}
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = min(1.0, cap_gib * GIB / total)
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    return {"applied": True, "fraction": fraction, "card_gib": total / GIB,
            "call": f"torch.cuda.set_per_process_memory_fraction({fraction:.4f})"}


def build(cfg: Any, shape: str, device: torch.device, text_layers: int | None, vision_layers: int | None):
    """(policy, the model's config) through `build.hf_policy`, the workbench's own constructor: the
    tiny checkpoint, or a real shape's random weights built on the device (the processor and
    tokenizer are the tiny model's of that architecture)."""
    from transformers import AutoModelForImageTextToText

    from arpo_lib import build as workbench

    model = None
    if shape in ("tiny", "tiny25"):
        path = tiny_model_dir("qwen2vl" if shape == "tiny" else "qwen25vl")
        model_config = P.model_config(str(path))
    else:
        path = tiny_model_dir(REAL_SHAPES[shape]["variant"])
        model_config = real_config(shape, text_layers, vision_layers)
        with torch.device(device):
            model = AutoModelForImageTextToText.from_config(model_config, dtype=torch.float32)
    policy = workbench.hf_policy(cfg, str(path), device=str(device), model=model)
    use_uitars_pixel_limits(policy)
    return policy, model_config


def shape_of_model(shape: str, cfg: Any, model_config: Any) -> tuple[P.ModelShape, str]:
    """(the planner's ModelShape of what is built, where it comes from): the config's own model for
    an unshrunk real shape (as `plan` reads it), else the built model's config.json."""
    if shape in REAL_SHAPES and model_config.get_text_config().num_hidden_layers == \
            REAL_SHAPES[shape]["spec"]["num_hidden_layers"] and model_config.vision_config.depth == \
            REAL_SHAPES[shape]["spec"]["vision_depth"]:
        return P.cached_shape(cfg.model.path), f"the config's model.path ({cfg.model.path})"
    with tempfile.TemporaryDirectory() as tmp:
        model_config.save_pretrained(tmp)
        return P.model_shape(tmp), f"the built model ({shape})"


class Meter:
    """Each phase's peak bytes and seconds: CUDA's allocator peak (reset before the phase), or on
    the CPU torch's MemTracker over the model, the optimizer and what the phase allocates."""

    def __init__(self, device: torch.device, policy: Any, optimizer: Any):
        self.device, self.policy, self.optimizer = device, policy, optimizer
        self.extra: list = []
        """Tensors made before a phase that it holds (its inputs' pixels)."""
        self.how = ("torch.cuda.max_memory_allocated, reset before each phase" if device.type == "cuda" else
                    "LiveBytes (CPU): the most bytes of live tensor storages at once, weights and optimizer "
                    "state included (a torch dispatch mode)")

    def run(self, name: str, fn: Callable[[], Any]) -> tuple[dict, Any]:
        row: dict[str, Any] = {"phase": name, "oom": False}
        out = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
        sync(self.device)
        start = time.perf_counter()
        try:
            if self.device.type == "cuda":
                out = fn()
                sync(self.device)
                row["measured_bytes"] = torch.cuda.max_memory_allocated(self.device)
                row["reserved_bytes"] = torch.cuda.max_memory_reserved(self.device)
                row["reserved_gib"] = row["reserved_bytes"] / GIB
            else:
                row["measured_bytes"], out = self._cpu(fn, row)
        except (torch.OutOfMemoryError, RuntimeError) as exc:  # some kernels raise a plain RuntimeError
            if not isinstance(exc, torch.OutOfMemoryError) and "out of memory" not in str(exc).lower():
                raise
            row.update(oom=True, error=str(exc).splitlines()[0][:200])
            if self.device.type == "cuda":
                row["measured_bytes"] = torch.cuda.max_memory_allocated(self.device)
                row["reserved_bytes"] = torch.cuda.max_memory_reserved(self.device)
        row["seconds"] = time.perf_counter() - start
        return row, out

    def _cpu(self, fn: Callable[[], Any], row: dict) -> tuple[int | None, Any]:
        state = [t for st in self.optimizer.state.values() for t in st.values()]
        held = [*self.policy.model.parameters(), *self.policy.model.buffers(), *state, *self.extra]
        try:
            tracker = LiveBytes(held)
        except Exception as exc:  # noqa: BLE001 (say why, run untracked)
            row["measured_why_null"] = f"the live-bytes tracker failed to start: {exc}"[:200]
            return None, fn()
        with tracker:
            out = fn()
        return tracker.peak, out


class LiveBytes:
    """On the CPU, where no allocator keeps a peak: the bytes of live tensor storages, the given
    ones (weights, optimizer state, inputs made before) and every new one an op makes (not one it
    shares with the op's inputs: a view, an in-place result) until it is freed: a dispatch mode, as
    torch's MemTracker counts them without its per-module bookkeeping, which refuses frozen
    parameters and repeated forwards. `live` now, `peak` the most at once, `shapes` those the new
    tensors were made in. It may be entered several times; what it counts stays counted."""

    def __init__(self, tensors: list = ()):
        self.live = self.peak = 0
        self.refs: dict[int, Any] = {}
        self.shapes: set[tuple[int, ...]] = set()
        for t in tensors:
            self._add(t)

    def _add(self, t: Any, inputs: set[int] = frozenset()) -> None:
        import weakref

        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        st = t.untyped_storage()
        key, n = st.data_ptr(), st.nbytes()
        if not n or key in self.refs or key in inputs:
            return
        self.refs[key] = weakref.ref(st, lambda _, key=key, n=n: self._free(key, n))
        self.live += n
        self.peak = max(self.peak, self.live)
        self.shapes.add(tuple(t.shape))

    def _free(self, key: int, n: int) -> None:
        if self.refs.pop(key, None) is not None:
            self.live -= n

    def __enter__(self) -> "LiveBytes":
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves

        tracker = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                          if isinstance(t, torch.Tensor) and t.device.type != "meta"}
                for t in tree_leaves(out):
                    tracker._add(t, inputs)
                return out

        self.mode = Mode()
        self.mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.mode.__exit__(*exc)


def snapshot_summary(device: torch.device, top: int = 12) -> dict | None:
    """The live CUDA blocks grouped by where they were allocated (the innermost frame in the
    workbench or transformers), largest first: what holds the memory right after a phase.
    Needs `torch.cuda.memory._record_memory_history` on before the phase; None on the CPU."""
    if device.type != "cuda":
        return None
    try:
        snap = torch.cuda.memory._snapshot()
    except Exception as exc:  # noqa: BLE001
        return {"error": str(exc)[:200]}
    by_site: dict[str, list[int]] = {}
    for segment in snap.get("segments", []):
        for block in segment.get("blocks", []):
            if block.get("state") != "active_allocated":
                continue
            frames = block.get("frames") or []
            site = next((f"{Path(f['filename']).name}:{f['line']} {f['name']}" for f in frames
                         if "arpo_lib" in f["filename"] or "transformers" in f["filename"]), "elsewhere")
            entry = by_site.setdefault(site, [0, 0])
            entry[0] += block["size"]
            entry[1] += 1
    ranked = sorted(by_site.items(), key=lambda kv: -kv[1][0])[:top]
    return {"top": [{"site": site, "gib": b / GIB, "blocks": n} for site, (b, n) in ranked]}


def count_syncs(device: torch.device, fn: Callable[[], Any]) -> tuple[Any, int | None]:
    """`fn()` with CUDA's sync debug mode warning at every host synchronisation; returns its result
    and the syncs counted (None on the CPU)."""
    if device.type != "cuda":
        return fn(), None
    import warnings

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out = fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return out, sum(1 for w in seen if "synchroniz" in str(w.message).lower())


def pinned_host_bytes() -> dict | None:
    """The pinned host memory CUDA's caching host allocator holds (activation offload's)."""
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if stats is None or not torch.cuda.is_available():
        return None
    try:
        s = stats()
    except Exception as exc:  # noqa: BLE001
        return {"error": str(exc)[:200]}
    keys = [k for k in s if "allocated_bytes" in k or "reserved_bytes" in k]
    return {k: s[k] for k in keys}


def lora_merge(policy: Any) -> dict | None:
    """A LoRA checkpoint's merge (`lora.merged_state_dict`, what a checkpoint writes): seconds and
    the host RSS before and after (the merged fp32 weights land in host memory one at a time)."""
    if getattr(policy, "peft_model", None) is None:
        return None
    import psutil

    from arpo_lib.agent.model.lora import merged_state_dict

    rss = psutil.Process().memory_info().rss
    start = time.perf_counter()
    merged = merged_state_dict(policy.model)
    seconds = time.perf_counter() - start
    after = psutil.Process().memory_info().rss
    size = sum(t.numel() * t.element_size() for t in merged.values())
    del merged
    return {"seconds": seconds, "host_rss_before_gib": rss / GIB, "host_rss_after_gib": after / GIB,
            "merged_gib": size / GIB}


def warm_optimizer_state(update: Any) -> None:
    """The optimizer's state as from the second step on (a run's generation and old log-probs hold
    it): one step on zero gradients, then the gradients freed."""
    for group in update.optimizer.param_groups:
        for p in group["params"]:
            p.grad = torch.zeros_like(p)
    update.optimizer.step()
    update.optimizer.zero_grad(set_to_none=True)


def groups_of(segment: Any, trajectories: int, group_size: int) -> list:
    """`trajectories` copies of `segment` (each its own object: the update keys by id) in groups of
    `group_size`, advantages +-1 (every sequence runs through the model)."""
    from arpo_lib.types import Group, Trajectory

    trajs = [Trajectory(task="synthetic", seed=0, sample=i, segments=[copy.copy(segment)]) for i in range(trajectories)]
    groups = []
    for start in range(0, trajectories, group_size):
        members = trajs[start:start + group_size]
        groups.append(Group(task="synthetic", trajectories=members,
                            advantages=[1.0 if i % 2 == 0 else -1.0 for i in range(len(members))],
                            injected=False, all_failed=False))
    return groups


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="a planned config (configs/one_gpu_40gb.yaml)")
    ap.add_argument("--cap-gb", type=float, required=True, help="the card the config is planned for (GiB)")
    ap.add_argument("--shape", default="auto", choices=["auto", "tiny", "tiny25", "2b", "7b"],
                    help="auto: the config's model.path matched to REAL_SHAPES (random weights); tiny/tiny25: "
                         "the local tiny model of the same architecture (a CPU rehearsal)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--resolution", default=None, help="screenshot WxH (default: the config's screen)")
    ap.add_argument("--max-new-tokens", type=int, default=128,
                    help="the rollout's response length (random weights rarely end early: about this many are decoded)")
    ap.add_argument("--steps", type=int, default=None, help="rollout steps and trajectory length (default env.max_steps)")
    ap.add_argument("--trajectories", type=int, default=None,
                    help="sequences in the update (default the batch: tasks_per_batch x group_size)")
    ap.add_argument("--text-layers", type=int, default=None, help="shrink a real shape's decoder (a CPU check)")
    ap.add_argument("--vision-layers", type=int, default=None, help="shrink a real shape's vision tower")
    ap.add_argument("--out", default=None, help="results directory (default benchmarks/results on CUDA, "
                                                "a temporary directory on the CPU)")
    args = ap.parse_args(argv)

    from arpo_lib.agent.hf_policy import resolve_device
    from arpo_lib.run.config import load_config
    from arpo_lib.training.backend import SingleProcess
    from arpo_lib.training.update import PolicyUpdate
    from benchmarks.bench_rollout import run_episodes

    cfg = load_config(args.config)
    name = Path(args.config).stem
    device = resolve_device(args.device)
    cap = cap_memory(args.cap_gb, device)  # before anything is built
    shape = shape_of(cfg) if args.shape == "auto" else args.shape
    screen = (tuple(int(x) for x in args.resolution.lower().split("x")) if args.resolution
              else P.default_screen(cfg))
    steps = args.steps or cfg.env.max_steps
    if steps != cfg.env.max_steps:
        cfg = _with_steps(cfg, steps)
    trajectories = args.trajectories or cfg.train.tasks_per_batch * cfg.rollout.group_size
    result: dict[str, Any] = {
        "benchmark": "one_gpu", "name": name, "config": args.config, "device": device_name(device),
        "shape": shape, "cap_gib": args.cap_gb, "cap": cap, "screen": list(screen),
        "settings": {"lora_rank": cfg.model.lora_rank, "optimizer": cfg.train.optimizer,
                     "freeze_vision_tower": cfg.model.freeze_vision_tower, "history_images": cfg.model.history_images,
                     "gradient_checkpointing": cfg.model.gradient_checkpointing, "steps": steps,
                     "rollout_max_new_tokens": args.max_new_tokens, "trajectories": trajectories,
                     "updates_per_batch": cfg.train.updates_per_batch, "text_layers": args.text_layers,
                     "vision_layers": args.vision_layers},
        "torch": torch.__version__, "transformers": transformers_version(), "oom": False, "oom_phase": None,
        "command": "python benchmarks/bench_one_gpu.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    out_dir = args.out or (None if device.type == "cuda" else tempfile.mkdtemp(prefix="one_gpu_"))

    def finish() -> dict:
        print_result(result)
        path = write_result(name, result, out_dir)
        print(f"written {path}")
        return result

    start = time.perf_counter()
    try:  # the weights, then the optimizer's state as from the second step on
        policy, model_config = build(cfg, shape, device, args.text_layers, args.vision_layers)
        backend = SingleProcess(policy, micro_batch_size=cfg.train.micro_batch_size,
                                token_budget=cfg.train.token_budget, pack=cfg.train.pack)
        update = PolicyUpdate(cfg, policy, backend, temperature=cfg.rollout.temperature)
        warm_optimizer_state(update)
        sync(device)
    except torch.OutOfMemoryError as exc:
        result.update(oom=True, oom_phase="build", phases=[], build={"error": str(exc).splitlines()[0][:200]})
        return finish()
    model_shape, shape_source = shape_of_model(shape, cfg, model_config)
    training = P.training_of(cfg, 1, device.type)
    planned = P.workload(cfg, model_shape, screen, 1)
    predicted = {p.name: p for p in P.phases(model_shape, planned, training)}
    result["build"] = {"seconds": time.perf_counter() - start, "params": sum(p.numel() for p in policy.model.parameters()),
                       "trainable": sum(p.numel() for p in policy.trainable_parameters())}
    result["planner"] = {"fits": max(p.total for p in predicted.values()) <= P.usable(args.cap_gb * GIB),
                         "usable_gib": P.usable(args.cap_gb * GIB) / GIB, "workload": dataclasses.asdict(planned),
                         "training": dataclasses.asdict(training),
                         "shape": shape_source}
    meter = Meter(device, policy, update.optimizer)
    result["memory_measured_by"] = meter.how
    rows = []

    # generation: one rollout batch of the planned live episodes
    policy.model.eval()
    if device.type == "cuda":
        torch.cuda.memory._record_memory_history(max_entries=200_000)
    with torch.no_grad():
        (row, episodes), syncs = count_syncs(device, lambda: meter.run("generation", lambda: run_episodes(
            policy, planned.generation_rows, steps, screen, args.max_new_tokens, True, device)))
    row["host_syncs"] = syncs
    decoded = sum(len(t) for step in (episodes or {}).get("tokens", []) for t in step) or None
    row["host_syncs_per_decoded_token"] = syncs / decoded if syncs is not None and decoded else None
    result["generation_snapshot"] = snapshot_summary(device)  # the episodes' caches still alive
    if device.type == "cuda":
        torch.cuda.memory._record_memory_history(enabled=None)
    policy.free_generation_memory()
    rows.append(row)
    context = episodes["final_tokens"] // planned.generation_rows if episodes else None
    # old log-probs and update: the trainer's update over the planned trajectories
    segment = synthetic_trajectory(policy, steps, screen, min(cfg.model.max_new_tokens, P.RESPONSE_TOKENS))
    groups = groups_of(segment, trajectories, cfg.rollout.group_size)
    meter.extra = [t for t in (*segment.pixel_values, *segment.image_grid_thw) if isinstance(t, torch.Tensor)]
    items = [(seg, adv) for g in groups for t, adv in zip(g.trajectories, g.advantages) for seg in t.segments]
    row, old = meter.run("old log-probs", lambda: update._old_logprobs([backend.plan(items)],
                                                                       {id(s): None for s, _ in items}))
    rows.append(row)
    metrics = None
    if old is None:
        rows.append({"phase": "update", "oom": False, "skipped": "the old log-probs did not finish"})
    else:  # the trainer's update, its old log-probs the ones just taken (a phase of their own)
        update._old_logprobs = lambda plans, directories: old
        row, metrics = meter.run("update", lambda: update(groups, step=0, weights_version=0))
        rows.append(row)
    if metrics:
        result["update_metrics"] = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
    result["pinned_host"] = pinned_host_bytes()
    try:
        result["lora_merge"] = lora_merge(policy)
    except Exception as exc:  # noqa: BLE001 (a result, not a crash)
        result["lora_merge"] = {"error": f"{type(exc).__name__}: {exc}"[:200]}

    # the planner's arithmetic on what ran: the trajectory built here, the rollout's context and cap
    as_run = dataclasses.replace(planned, tokens=len(segment), patches=sum(int(g.prod()) for g in segment.image_grid_thw),
                                 trained=sum(segment.loss_mask), generation_context=context or planned.generation_context,
                                 max_new_tokens=args.max_new_tokens)
    predicted_as_run = {p.name: p for p in P.phases(model_shape, as_run, training)}
    result["planner"]["workload_as_run"] = dataclasses.asdict(as_run)
    for table_ in (predicted, predicted_as_run):  # the update's peak is the larger of its two moments
        tower = table_.pop("update, frozen tower's forward", None)
        if tower is not None and tower.total > table_["update"].total:
            table_["update"] = tower
    for row in rows:
        for key, table_ in (("predicted", predicted), ("predicted_as_run", predicted_as_run)):
            phase = table_.get(row["phase"])
            row[f"{key}_bytes"] = phase.total if phase else None
            row[f"{key}_parts_gib"] = {k: v / GIB for k, v in phase.parts.items()} if phase else None
        for key in ("predicted", "predicted_as_run"):
            measured, pred = row.get("measured_bytes"), row.get(f"{key}_bytes")
            row["ratio" if key == "predicted" else "ratio_as_run"] = measured / pred if measured and pred else None
        row["measured_gib"] = row["measured_bytes"] / GIB if row.get("measured_bytes") else None
        row["predicted_gib"] = row["predicted_bytes"] / GIB if row.get("predicted_bytes") else None
        if row["oom"] and not result["oom"]:
            result.update(oom=True, oom_phase=row["phase"])
    result["phases"] = rows
    result["trajectory"] = {"tokens": len(segment), "trained": sum(segment.loss_mask),
                            "screenshots": len(segment.image_grid_thw), "rollout_context": context}
    return finish()


def _with_steps(cfg: Any, steps: int) -> Any:
    from arpo_lib.run.config import config_from_dict

    data = cfg.to_dict()
    data["env"]["max_steps"] = steps
    return config_from_dict(data)


def print_result(r: dict) -> None:
    from benchmarks.common import table

    print(f"{r['name']}: {r['shape']} on {r['device']}, cap {r['cap_gib']} GiB ({'applied' if r['cap']['applied'] else 'not applied'})")
    print(table([{"phase": p["phase"], "oom": p["oom"], "seconds": p.get("seconds"), "measured GiB": p.get("measured_gib"),
                  "predicted GiB": p.get("predicted_gib"), "ratio": p.get("ratio"), "ratio as run": p.get("ratio_as_run")}
                 for p in r.get("phases", [])],
                ["phase", "oom", "seconds", "measured GiB", "predicted GiB", "ratio", "ratio as run"]))


if __name__ == "__main__":
    main()
