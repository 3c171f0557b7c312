"""ARPO's training loop: sample tasks, roll out G times each, score, replay, advantages, update.

    for step in range(cfg.train.steps):
        tasks   = task_batch(step)                      # seeded epoch permutations
        trajs   = rollouts(tasks x G)                   # parallel browsers, batched generation
        groups  = per task: replay.maybe_inject(...)    # ARPO: rescue all-failed groups
                  then replay.add(fresh trajectories)
        adv     = group_advantages(rewards)             # per group, Bessel std
        update  = PPO clipped loss, one epoch, `updates_per_batch` optimizer steps
        metrics -> metrics.jsonl; checkpoint (model, optimizer, replay buffer, RNG, data order)

Departures from the original, on purpose:
- Infrastructure failures (a crashed browser/VM) are dropped from their group, not scored 0.
- Sequences with advantage exactly 0 are counted in the loss normaliser but not run through the
  model: their loss and gradient are exactly zero, so the result is the same at lower cost.
- `algo.old_logprobs=recompute` (default, as ARPO) recomputes old log-probs with the current
  policy before the update; `behaviour` uses the log-probs stored at sampling time instead.
- Checkpoints include the replay buffer and the data order; `resume` continues exactly.
"""
from __future__ import annotations

import json
import math
import os
import random
import shutil
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from arpo_lib.algo import ReplayBuffer, group_advantages, is_all_failed, policy_loss
from arpo_lib.config import RunConfig, config_from_dict, resolve_task_sets, save_config
from arpo_lib.envs.worker import EnvPool
from arpo_lib.fast.batching import token_budget_batches
from arpo_lib.fast.memory import make_optimizer
from arpo_lib.policy import HFPolicy, policy_from_config
from arpo_lib.prompt import Segment
from arpo_lib.records import append_jsonl, atomic_write_text, fsync_dir, read_jsonl, safe_join
from arpo_lib.rollout import EpisodeRequest, RolloutEngine, Trajectory, load_trajectory
from arpo_lib.tracking import Tracker


def stable_seed(*parts: Any) -> int:
    """A seed from any parts, identical across processes and Python versions."""
    return zlib.crc32(repr(parts).encode()) & 0x7FFFFFFF


def task_batch(tasks: list[str], step: int, tasks_per_batch: int, seed: int) -> list[str]:
    """Tasks of rollout batch `step`: distinct tasks, slices of a seeded per-epoch permutation.

    An epoch has len(tasks) // tasks_per_batch batches; the remainder of a permutation is left
    out of that epoch (the next epoch's permutation differs), so a batch never holds a task twice.
    Depends only on its arguments, so a resumed run continues the same order.
    """
    per_epoch = len(tasks) // tasks_per_batch
    if per_epoch == 0:
        raise ValueError(f"tasks_per_batch={tasks_per_batch} > {len(tasks)} tasks")
    epoch, index = divmod(step, per_epoch)
    order = list(tasks)
    random.Random(stable_seed(seed, "epoch", epoch)).shuffle(order)
    return order[index * tasks_per_batch:(index + 1) * tasks_per_batch]


@dataclass
class Group:
    task: str
    trajectories: list[Trajectory]
    advantages: list[float]
    injected: bool
    all_failed: bool


def write_groups(path: Path, groups: list[Group]) -> None:
    """What each group trained on: members (fresh or replayed), rewards, advantages (for the group view)."""
    data = [{
        "task": g.task, "all_failed": g.all_failed, "injected": g.injected,
        "members": [{"dir": t.directory, "task_score": t.task_score, "reward": t.reward, "advantage": a,
                     "replayed": t.replayed, "format_ok": t.format_ok, "num_steps": t.num_steps}
                    for t, a in zip(g.trajectories, g.advantages)],
    } for g in groups]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1))


def pool_for(cfg: RunConfig) -> Any:
    """The run's environment workers: local processes or Ray actors (env.backend), in the
    interpreter env.python names (`auto`: OSWorld's own environment for osworld tasks)."""
    from arpo_lib.envs.worker import make_pool

    opts = dict(cfg.env.options)
    opts.setdefault("max_steps", cfg.env.max_steps)
    python = cfg.env.python
    if python == "auto":
        python = None
        tasks = cfg.env.tasks + (cfg.eval.tasks or []) + (cfg.select.tasks or [])
        if any(t.startswith("osworld/") for t in tasks):
            from arpo_lib.envs.osworld import find_osworld_python

            python = find_osworld_python()
            if python is None:
                raise RuntimeError("env.python=auto: no interpreter with desktop_env found "
                                   "(run scripts/setup_osworld.sh or set $ARPO_OSWORLD_PYTHON)")
    ray = {"ray_address": cfg.env.ray_address, "ray_resource": cfg.env.ray_resource,
           "ray_num_cpus": cfg.env.ray_num_cpus} if cfg.env.backend == "ray" else {}
    return make_pool(cfg.env.workers, opts, cfg.env.step_timeout_s, cfg.env.envs_per_worker,
                     backend=cfg.env.backend, python=python, **ray)


class Trainer:
    """Runs ARPO (or GRPO with `algo.replay.enabled=false`) for a `RunConfig`."""

    def __init__(self, cfg: RunConfig, *, resume: bool = False, policy: HFPolicy | None = None):
        self.cfg = resolve_task_sets(cfg)
        self.run_dir = cfg.run_dir
        self.ckpt_dir = self.run_dir / "checkpoints"
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.step = 0
        checkpoint = usable_checkpoint(self.ckpt_dir) if resume else None
        if resume and checkpoint is None and self.metrics_path.exists():
            print(f"[arpo] no complete checkpoint in {self.ckpt_dir}; starting from step 0")
        if not resume and self.metrics_path.exists():
            raise FileExistsError(f"{self.run_dir} already holds a run: resume it or choose another name")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, self.run_dir / "config.yaml")

        lora = cfg.model.lora_rank > 0
        # With LoRA a resume loads the base weights plus the saved adapter (the checkpoint's
        # merged weights would apply the adapter twice).
        model_path = str(checkpoint / "model") if checkpoint and not lora else cfg.model.path
        self.policy = policy or policy_from_config(cfg, model_path)
        if checkpoint is not None and lora:
            self.policy.load_adapter(checkpoint / "model")
        elif checkpoint is not None and policy is not None:
            self.policy.model.load_state_dict(_load_model_state(checkpoint / "model"))
        self.optimizer = make_optimizer(cfg.train.optimizer, self.policy.trainable_parameters(), cfg.train.lr,
                                        cfg.train.weight_decay)
        total_updates = max(1, cfg.train.steps * cfg.train.updates_per_batch)
        warmup = math.ceil(cfg.train.warmup_ratio * total_updates)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda u: min(1.0, (u + 1) / warmup) if warmup > 0 else 1.0)
        rp = cfg.algo.replay
        self.replay: ReplayBuffer[dict[str, Any]] = ReplayBuffer(
            capacity_per_task=rp.capacity_per_task, success_threshold=rp.success_threshold,
            enabled=rp.enabled, seed=stable_seed(cfg.train.seed, "replay"),
            std_threshold=rp.std_threshold, mean_threshold=rp.mean_threshold)
        self.ref_model = None
        if cfg.algo.kl_coef > 0:  # the reference is the model the run started from (cfg.model.path)
            from transformers import AutoModelForImageTextToText

            self.ref_model = AutoModelForImageTextToText.from_pretrained(cfg.model.path, dtype=torch.float32)
            self.ref_model.to(self.policy.device).eval().requires_grad_(False)
        if checkpoint is not None:
            self._load_checkpoint(checkpoint)
        if resume:
            self._drop_metrics_after_step()
        self.tracker = Tracker(cfg)
        self._pool: EnvPool | None = None
        self._demos_seeded = self._warm_started = checkpoint is not None
        # Rollouts through a server (rollout.backend=server): the server this trainer started (if
        # any), the client policy, and which weights the server holds.
        self.server: Any = None
        self._server_policy: Any = None
        self._weights_version = 0
        self._served_version: int | None = None
        self.seconds_sync = 0.0
        self._demos: list[Trajectory] | None = None
        self.seconds_warm_start = 0.0
        """Demonstrations + supervised warm start, for the run summary."""

    # -- environment pool (shared with evaluation) -------------------------------------------
    @property
    def pool(self) -> EnvPool:
        if self._pool is None:
            self._pool = pool_for(self.cfg)
        return self._pool

    def engine(self) -> RolloutEngine:
        """The rollout engine with the generating policy: this process's model, or the server
        (brought up to date with the current weights first)."""
        return RolloutEngine(self.rollout_policy(), self.pool, max_steps=self.cfg.env.max_steps,
                             format_coef=self.cfg.algo.format_coef, format_penalty=self.cfg.algo.format_penalty)

    # -- generation through a server (rollout.backend=server) --------------------------------
    def rollout_policy(self) -> Any:
        if self.cfg.rollout.backend == "hf":
            return self.policy
        from arpo_lib.server_policy import policy_for

        r = self.cfg.rollout
        if self._server_policy is None:
            if r.server_url is None:  # this trainer runs its own server, on the weights it holds now
                model_dir = self._save_served_weights() if r.weight_sync != "none" else self.policy.path
                self._server_policy = policy_for(self.cfg, self._start_server(model_dir))
                self._served_version = self._weights_version
            else:  # someone else's server: what it holds is unknown, so it gets our weights first
                self._server_policy = policy_for(self.cfg, r.server_url)
                self._served_version = None
            if r.weight_sync == "none" and self._weights_version > 0:
                print("[arpo] warning: rollout.weight_sync=none, so the server does not have the weights "
                      "of the warm start or of the updates: rollouts are off-policy")
        if self._served_version != self._weights_version and r.weight_sync != "none":
            self._push_weights()
        return self._server_policy

    def _save_served_weights(self) -> str:
        from arpo_lib.weight_sync import save_for_server

        return str(save_for_server(self.policy, self.run_dir / "server_weights"))

    def _start_server(self, model_dir: str) -> str:
        from arpo_lib.workflows import start_policy_server

        self.server = start_policy_server(self.cfg, model_path=model_dir)
        self.server.wait_healthy(timeout_s=self.cfg.serve.startup_timeout_s)
        return self.server.base_url

    def _push_weights(self) -> None:
        """Make the server generate with the current weights (rollout.weight_sync)."""
        from arpo_lib.server_policy import policy_for
        from arpo_lib.weight_sync import reload_weights

        t0 = time.monotonic()
        model_dir = self._save_served_weights()
        if self.cfg.rollout.weight_sync == "reload":
            reload_weights(self._server_policy.base_url, model_dir)
        else:  # restart
            if self.server is None:
                raise RuntimeError("rollout.weight_sync=restart needs the server this trainer started "
                                   "(leave rollout.server_url unset)")
            self.server.stop()
            old = self._server_policy
            old.close()
            self._server_policy = policy_for(self.cfg, self._start_server(model_dir))
            for counter in ("requests", "prompt_mismatches", "inexact"):  # totals over the run
                setattr(self._server_policy, counter, getattr(old, counter))
        self._served_version = self._weights_version
        self.seconds_sync += time.monotonic() - t0

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        if self._server_policy is not None:
            self._server_policy.close()
            self._server_policy = None
        if self.server is not None:
            self.server.stop()
            self.server = None
        self.tracker.finish()

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the loop ------------------------------------------------------------------------------
    def train(self, steps: int | None = None, on_step: Any = None) -> list[dict[str, Any]]:
        """Run until `cfg.train.steps` rollout batches are done (or `steps` more); returns their
        metrics. `on_step(metrics)` is called after each step (e.g. `workflows.print_step`)."""
        from tqdm.auto import tqdm

        end = self.cfg.train.steps if steps is None else min(self.cfg.train.steps, self.step + steps)
        if self.step == 0:
            self.warm_start()
            self.seed_replay_with_demos()
        history = []
        bar = tqdm(total=end, initial=self.step, desc="ARPO" if self.replay.enabled else "GRPO",
                   disable=not self.cfg.logging.progress)
        while self.step < end:
            metrics = self.train_step()
            history.append(metrics)
            if on_step is not None:
                on_step(metrics)
            bar.update(1)
            bar.set_postfix(success=f"{metrics['success_rate']:.2f}", loss=f"{metrics['loss']:.4f}",
                            injected=metrics["replay_injections"])
        bar.close()
        return history

    def train_step(self) -> dict[str, Any]:
        cfg = self.cfg
        step = self.step
        t0 = time.monotonic()
        tasks = task_batch(cfg.env.tasks, step, cfg.train.tasks_per_batch, cfg.train.seed)
        requests = [EpisodeRequest(task, stable_seed(cfg.train.seed, step, task, i), i)
                    for task in tasks for i in range(cfg.rollout.group_size)]
        rollout_dir = self.run_dir / "rollouts" / f"step_{step:06d}"
        if rollout_dir.exists():  # a step being redone after a crash
            shutil.rmtree(rollout_dir)
        torch.manual_seed(stable_seed(cfg.train.seed, "sample", step))
        engine = self.engine()
        trajs = engine.run(requests, temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                           out_dir=rollout_dir, progress=cfg.logging.progress, description=f"rollout {step}")
        t_rollout = time.monotonic() - t0

        groups = self.make_groups(tasks, trajs)
        write_groups(rollout_dir / "groups.json", groups)
        t1 = time.monotonic()
        update = self.update(groups)
        if self._server_policy is not None and cfg.rollout.weight_sync != "none":
            self.rollout_policy()  # the server generates with the new weights from now on
        t_update = time.monotonic() - t1

        fresh = [t for t in trajs if t.status == "ok"]
        self.step += 1
        evaluation = {}
        if cfg.train.eval_every and (self.step % cfg.train.eval_every == 0 or self.step == cfg.train.steps):
            evaluation = self.evaluate(f"step_{self.step:06d}")
        metrics = {
            "step": self.step,
            "tasks": tasks,
            "success_rate": _mean([float(t.success) for t in fresh]),
            "mean_task_score": _mean([t.task_score for t in fresh]),
            "mean_reward": _mean([t.reward for t in fresh]),
            "format_error_rate": _mean([float(not t.format_ok) for t in fresh]),
            "mean_steps": _mean([t.num_steps for t in fresh]),
            "env_errors": sum(t.status != "ok" for t in trajs),
            "all_failed_groups": _mean([float(g.all_failed) for g in groups]),
            "replay_injections": sum(g.injected for g in groups),
            "replay_size": len(self.replay),
            "env_steps": engine.env_steps,
            "env_steps_per_s": engine.env_steps / max(t_rollout, 1e-9),
            "lr": self.scheduler.get_last_lr()[0],
            **update,
            "seconds_rollout": round(t_rollout, 3),
            "seconds_update": round(t_update, 3),
            **self._server_metrics(),
            **evaluation,
        }
        append_jsonl(self.metrics_path, metrics)
        self.tracker.log(metrics, step=self.step)
        if self.step % cfg.train.checkpoint_every == 0 or self.step == cfg.train.steps:
            self.save_checkpoint()
        return metrics

    def _server_metrics(self) -> dict[str, Any]:
        if self._server_policy is None:
            return {}
        p = self._server_policy
        return {"server_requests": p.requests, "server_prompt_mismatches": p.prompt_mismatches,
                "server_inexact": p.inexact, "seconds_sync_total": round(self.seconds_sync, 3)}

    def demonstrations(self) -> list[Trajectory]:
        """Successful scripted demonstrations for the warm start and replay seeding, collected once
        (`max(warm_start.demos_per_task, train.demo_replay)` per supported task) into <run>/demos."""
        if self._demos is None:
            from arpo_lib.sft import collect_demonstrations

            n = max(self.cfg.warm_start.demos_per_task, self.cfg.train.demo_replay)
            self._demos = collect_demonstrations(
                self.policy, self.pool, self.cfg.env.tasks, n, seed=self.cfg.train.seed,
                out_dir=self.run_dir / "demos", max_steps=self.cfg.env.max_steps,
                progress=self.cfg.logging.progress) if n > 0 else []
        return self._demos

    def warm_start(self) -> list[float]:
        """Supervised warm start before the first step (once; a resumed run has it in its weights)."""
        ws = self.cfg.warm_start
        if ws.steps <= 0 or self.step > 0 or self._warm_started:
            return []
        from arpo_lib.sft import supervised_warm_start

        t0 = time.monotonic()
        demos = self.demonstrations()
        per_task: dict[str, int] = {}
        chosen = []
        for t in demos:
            if per_task.get(t.task, 0) < ws.demos_per_task:
                per_task[t.task] = per_task.get(t.task, 0) + 1
                chosen.append(t)
        losses = supervised_warm_start(self.policy, chosen, steps=ws.steps, lr=ws.lr, batch_size=ws.batch_size,
                                       seed=self.cfg.train.seed, progress=self.cfg.logging.progress)
        self._warm_started = True
        self._weights_version += 1
        self.seconds_warm_start = time.monotonic() - t0
        append_jsonl(self.run_dir / "warm_start.jsonl", {"demos": len(chosen), "steps": ws.steps,
                                                         "loss_first": losses[0], "loss_last": losses[-1]})
        print(f"[arpo] warm start: {ws.steps} SFT steps on {len(chosen)} demonstrations, "
              f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")
        return losses

    def seed_replay_with_demos(self) -> int:
        """Put `train.demo_replay` scripted demonstrations per task into the replay buffer (once,
        before the first step; they are saved with the buffer). Returns how many were stored."""
        n = self.cfg.train.demo_replay
        if n <= 0 or self.step > 0 or self._demos_seeded or not self.replay.enabled:
            return 0
        per_task: dict[str, int] = {}
        stored = 0
        for t in self.demonstrations():
            if per_task.get(t.task, 0) < n:
                per_task[t.task] = per_task.get(t.task, 0) + 1
                stored += self.replay.add(t.task, {"dir": t.directory, "score": t.task_score, "reward": t.reward},
                                          t.task_score)
        missing = sorted(set(self.cfg.env.tasks) - set(per_task))
        if missing:
            print(f"[arpo] no demonstrations for {missing}; their replay starts empty")
        self._demos_seeded = True
        print(f"[arpo] replay buffer seeded with {stored} scripted demonstrations")
        return stored

    def evaluate(self, label: str) -> dict[str, Any]:
        """Evaluate the current policy with the run's eval protocol into <run>/eval/<label>;
        returns `eval_*` metrics for the metrics line."""
        from arpo_lib.evaluate import evaluate

        cfg = self.cfg
        result = evaluate(self.engine(), cfg.eval.tasks or cfg.env.tasks, samples_per_task=cfg.eval.samples_per_task,
                          temperature=cfg.eval.temperature, seed=cfg.eval.seed, out_dir=safe_join(self.run_dir / "eval", label),
                          progress=cfg.logging.progress, description=f"eval {label}")
        return {"eval_success_rate": result.success_rate, "eval_pass_at_k": result.pass_at_k,
                "eval_format_error_rate": result.format_error_rate, "eval_mean_steps": result.mean_steps,
                "seconds_eval": round(result.seconds, 3)}

    def make_groups(self, tasks: list[str], trajs: list[Trajectory]) -> list[Group]:
        """Per task: drop infrastructure failures, inject a replayed success into all-failed groups
        (ARPO), store fresh successes, compute advantages."""
        groups = []
        for task in dict.fromkeys(tasks):
            fresh = [t for t in trajs if t.task == task and t.status == "ok"]
            if len(fresh) < 2:
                continue  # no comparison possible (all but one rollout hit infrastructure failures)
            refs = [{"dir": t.directory, "score": t.task_score, "reward": t.reward} for t in fresh]
            scores = [t.task_score for t in fresh]
            all_failed = is_all_failed(scores, self.replay.std_threshold, self.replay.mean_threshold)
            new_refs, _, injected = self.replay.maybe_inject(task, refs, scores)
            group = list(fresh)
            if injected:
                for i, (old, new) in enumerate(zip(refs, new_refs)):
                    if old["dir"] != new["dir"]:
                        replayed = load_trajectory(new["dir"], self.policy.processor)
                        replayed.replayed = True
                        group[i] = replayed
            for t in fresh:  # after injection, with the fresh (pre-replacement) group
                self.replay.add(task, {"dir": t.directory, "score": t.task_score, "reward": t.reward}, t.task_score)
            adv = group_advantages(torch.tensor([t.reward for t in group], dtype=torch.float64),
                                   eps=self.cfg.algo.adv_eps).tolist()
            groups.append(Group(task, group, adv, injected, all_failed))
        return groups

    # -- the policy update -----------------------------------------------------------------------
    def update(self, groups: list[Group]) -> dict[str, Any]:
        """One PPO epoch over the batch, split into `updates_per_batch` optimizer steps."""
        cfg = self.cfg
        items = [(seg, adv) for g in groups for t, adv in zip(g.trajectories, g.advantages)
                 for seg in t.segments if any(seg.loss_mask)]
        stats = {"loss": 0.0, "clip_fraction": 0.0, "grad_norm": 0.0, "tokens": 0, "sequences": len(items),
                 "optimizer_steps": 0, "approx_kl": 0.0, "kl": 0.0}
        if not items:
            return stats
        rng = random.Random(stable_seed(cfg.train.seed, "shuffle", self.step))
        rng.shuffle(items)
        temperature = cfg.rollout.temperature
        # Old log-probs for the whole batch before any update (ratio starts at 1, as ARPO).
        old: dict[int, torch.Tensor] = {}
        for seg, adv in items:
            if adv != 0.0:
                if cfg.algo.old_logprobs == "behaviour":
                    old[id(seg)] = torch.tensor([lp for lp, m in zip(seg.behaviour_logprobs, seg.loss_mask) if m])
                else:
                    with torch.no_grad():
                        old[id(seg)] = self.policy.sequence_logprobs([seg], temperature)[0].detach().cpu()
        minibatches = [items[i::cfg.train.updates_per_batch] for i in range(cfg.train.updates_per_batch)]
        self.policy.model.train()
        losses, clips, norms, kls, ref_kls = [], [], [], [], []
        for mb in minibatches:
            if not mb:
                continue
            n_seq = len(mb)
            n_tok = sum(sum(seg.loss_mask) for seg, _ in mb)
            active = [(seg, adv) for seg, adv in mb if adv != 0.0]
            self.optimizer.zero_grad(set_to_none=True)
            mb_loss = 0.0
            for micro in self._micro_batches(active):
                segs = [s for s, _ in micro]
                new = self.policy.sequence_logprobs(segs, temperature, pack=cfg.train.pack)
                logprobs = _pad(new)
                old_lp = _pad([old[id(s)].to(logprobs.device) for s in segs])
                mask = _pad([torch.ones_like(t) for t in new])
                advs = torch.tensor([a for _, a in micro], dtype=logprobs.dtype, device=logprobs.device)
                ref_lp = None
                if self.ref_model is not None:
                    with torch.no_grad():
                        ref_lp = _pad(self._ref_logprobs(segs, temperature))
                loss, m = policy_loss(logprobs, old_lp, advs, mask, clip_low=cfg.algo.clip_low,
                                      clip_high=cfg.algo.clip_high, dual_clip=cfg.algo.dual_clip,
                                      aggregation=cfg.algo.aggregation, ref_logprobs=ref_lp,
                                      kl_coef=cfg.algo.kl_coef)
                # Exact aggregation across micro-batches: weight by this micro-batch's share.
                if cfg.algo.aggregation == "token-mean":
                    weight = float(mask.sum()) / n_tok
                else:
                    weight = len(micro) / n_seq
                (loss * weight).backward()
                mb_loss += loss.item() * weight
                clips.append(m.get("clip_fraction", 0.0))
                kls.append(m.get("approx_kl", 0.0))
                ref_kls.append(m.get("kl", 0.0))
            norm = torch.nn.utils.clip_grad_norm_(self.policy.trainable_parameters(), cfg.train.grad_clip)
            self.optimizer.step()
            self.scheduler.step()
            losses.append(mb_loss)
            norms.append(float(norm))
            stats["optimizer_steps"] += 1
            self._weights_version += 1
            stats["tokens"] += n_tok
        self.policy.model.eval()
        stats.update(loss=_mean(losses), clip_fraction=_mean(clips), grad_norm=_mean(norms), approx_kl=_mean(kls),
                     kl=_mean(ref_kls))
        return stats

    def _micro_batches(self, items: list[tuple[Segment, float]]) -> list[list[tuple[Segment, float]]]:
        """Fixed-size micro-batches, or token-budget ones (train.token_budget)."""
        budget = self.cfg.train.token_budget
        if budget > 0:
            lengths = [len(s) for s, _ in items]
            return [[items[i] for i in b] for b in token_budget_batches(lengths, budget, packed=self.cfg.train.pack)]
        size = self.cfg.train.micro_batch_size
        return [items[i:i + size] for i in range(0, len(items), size)]

    def _ref_logprobs(self, segs: list[Segment], temperature: float) -> list[torch.Tensor]:
        model, self.policy.model = self.policy.model, self.ref_model
        try:
            return self.policy.sequence_logprobs(segs, temperature)
        finally:
            self.policy.model = model

    # -- checkpoints -------------------------------------------------------------------------------
    def save_checkpoint(self) -> Path:
        """Write model, optimizer, scheduler, replay buffer, RNG and step atomically."""
        final = self.ckpt_dir / f"step_{self.step:06d}"
        tmp = self.ckpt_dir / f".tmp_step_{self.step:06d}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        self.policy.save(tmp / "model")
        torch.save({"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()},
                   tmp / "optimizer.pt")
        self.replay.save(tmp / "replay.json")
        state = {"step": self.step, "torch_rng": torch.get_rng_state().tolist(),
                 "config": self.cfg.to_dict(), "time": time.time()}
        (tmp / "trainer_state.json").write_text(json.dumps(state))
        manifest = {}
        for f in sorted(tmp.rglob("*")):
            if f.is_file():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
                manifest[str(f.relative_to(tmp))] = f.stat().st_size
        # The manifest lets a resume detect a checkpoint damaged after it was written (truncated
        # or missing files) without loading gigabytes; `.complete` marks a finished write.
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
        (tmp / ".complete").write_text("ok\n")
        fsync_dir(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(self.ckpt_dir)
        for old in sorted(p for p in self.ckpt_dir.glob("step_*") if p.is_dir())[:-self.cfg.train.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def _load_checkpoint(self, checkpoint: Path) -> None:
        opt = torch.load(checkpoint / "optimizer.pt", weights_only=False)
        self.optimizer.load_state_dict(opt["optimizer"])
        self.scheduler.load_state_dict(opt["scheduler"])
        self.replay = ReplayBuffer.load(checkpoint / "replay.json")
        state = json.loads((checkpoint / "trainer_state.json").read_text())
        self.step = int(state["step"])
        torch.set_rng_state(torch.tensor(state["torch_rng"], dtype=torch.uint8))
        print(f"[arpo] resumed {self.run_dir} at step {self.step} from {checkpoint.name}")

    def _drop_metrics_after_step(self) -> None:
        """Metric lines written after the checkpoint we start from belong to steps that will be
        redone: drop them, so no step is logged twice. Starting over from step 0 redoes the warm
        start too, so its record goes as well."""
        if self.step == 0:
            (self.run_dir / "warm_start.jsonl").unlink(missing_ok=True)
        if not self.metrics_path.exists():
            return
        kept = [m for m in read_jsonl(self.metrics_path) if m.get("step", 0) <= self.step]
        atomic_write_text(self.metrics_path, "".join(json.dumps(m) + "\n" for m in kept))


def latest_checkpoint(ckpt_dir: Path) -> Path | None:
    """The newest checkpoint with its `.complete` marker; partial ones are skipped."""
    if not ckpt_dir.is_dir():
        return None
    complete = [p for p in ckpt_dir.glob("step_*") if (p / ".complete").is_file()]
    return max(complete, key=lambda p: p.name) if complete else None


def checkpoint_problem(checkpoint: Path) -> str | None:
    """Why a checkpoint cannot be resumed from (None when it looks intact): unfinished, files
    missing or of the wrong size, unreadable state or replay buffer."""
    if not (checkpoint / ".complete").is_file():
        return "unfinished (no .complete marker)"
    try:
        manifest = json.loads((checkpoint / "manifest.json").read_text())
        for name, size in manifest.items():
            path = checkpoint / name
            if not path.is_file():
                return f"{name} is missing"
            if path.stat().st_size != size:
                return f"{name} has {path.stat().st_size} bytes, expected {size}"
        json.loads((checkpoint / "trainer_state.json").read_text())
        ReplayBuffer.load(checkpoint / "replay.json")
    except (OSError, ValueError) as exc:
        return f"unreadable: {exc}"
    return None


def usable_checkpoint(ckpt_dir: Path) -> Path | None:
    """The newest checkpoint that is complete and intact; damaged ones are reported and skipped."""
    if not ckpt_dir.is_dir():
        return None
    for checkpoint in sorted((p for p in ckpt_dir.glob("step_*") if p.is_dir()), reverse=True):
        problem = checkpoint_problem(checkpoint)
        if problem is None:
            return checkpoint
        print(f"[arpo] skipping checkpoint {checkpoint.name}: {problem}")
    return None


def _load_model_state(model_dir: Path) -> dict[str, torch.Tensor]:
    """Weights of a checkpoint's model, for a policy object the caller passed in."""
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).state_dict()


def _pad(seqs: list[torch.Tensor]) -> torch.Tensor:
    return torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True)


def _mean(xs: list[float]) -> float:
    return float(sum(xs) / len(xs)) if xs else 0.0


def load_run_config(run_dir: str | Path) -> RunConfig:
    """The config a run directory was started with."""
    import yaml

    return config_from_dict(yaml.safe_load((Path(run_dir) / "config.yaml").read_text()))
