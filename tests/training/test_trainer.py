"""The ARPO training loop on real MiniWoB++ tasks with the real tiny model."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import math
import time
from pathlib import Path

import pytest
import torch

from arpo_lib.run.config import ConfigError, load_config
from arpo_lib.run.records import read_jsonl
from arpo_lib.training.checkpoint import latest_checkpoint
from arpo_lib.training.optim import lr_factor
from arpo_lib import build
from arpo_lib.training.trainer import task_batch

REPO = Path(__file__).resolve().parents[2]
TASKS = ["miniwob/click-test", "miniwob/click-button"]


def test_task_batches_are_distinct_deterministic_and_cover_every_task():
    tasks = [f"t{i}" for i in range(5)]
    seen = []
    for step in range(10):
        batch = task_batch(tasks, step, 2, seed=3)
        assert len(batch) == len(set(batch)) == 2
        assert batch == task_batch(tasks, step, 2, seed=3)
        seen += batch
    assert set(seen) == set(tasks)
    assert [task_batch(tasks, s, 2, 3) for s in range(4)] != [task_batch(tasks, s, 2, 4) for s in range(4)]


def _cfg(tmp_path, model, *overrides):
    return load_config("configs/smoke.yaml", [
        f"model.path={model}", f"out_dir={tmp_path}", "name=t", f"env.tasks=[{','.join(TASKS)}]",
        "env.workers=1", "env.max_steps=2", "model.max_new_tokens=24", "rollout.group_size=2",
        "train.tasks_per_batch=2", "train.updates_per_batch=1", "train.steps=2", "train.lr=1e-3",
        "warm_start.steps=0", "warm_start.demos_per_task=0", "train.demo_replay=0",
        "logging.progress=false", *overrides])


def _params(trainer):
    return {k: v.detach().clone() for k, v in trainer.policy.model.state_dict().items()}


@pytest.mark.slow
def test_replay_rescues_all_failed_groups_and_the_update_changes_parameters(tmp_path, tiny_qwen2vl, chromium_available):
    """The random tiny model fails every episode. GRPO then has zero advantages and learns
    nothing; ARPO injects a stored success into each all-failed group and does learn."""
    def one_step(cfg):
        with build.trainer(cfg) as trainer:
            before = _params(trainer)
            (m,) = trainer.train()
            return m, before, _params(trainer)

    m, before, after = one_step(_cfg(tmp_path, tiny_qwen2vl, "train.steps=1", "train.demo_replay=1",
                                     "algo.replay.enabled=true"))
    assert m["all_failed_groups"] == 1.0 and m["success_rate"] == 0.0
    assert m["replay_injections"] == 2 and m["loss"] != 0.0 and m["grad_norm"] > 0
    assert any(not torch.equal(before[k], after[k]) for k in before)
    replayed = [d for d in (tmp_path / "t" / "demos").rglob("meta.json")]
    assert len(replayed) == 2  # one demonstration per task, referenced by the buffer

    m, before, after = one_step(_cfg(tmp_path, tiny_qwen2vl, "name=grpo", "train.steps=1",
                                     "algo.replay.enabled=false"))
    assert m["replay_injections"] == 0 and m["loss"] == 0.0
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.slow
def test_run_directory_metrics_and_checkpoints(tmp_path, tiny_qwen2vl, chromium_available):
    cfg = _cfg(tmp_path, tiny_qwen2vl, "train.demo_replay=1", "train.keep_checkpoints=1")
    with build.trainer(cfg) as trainer:
        trainer.train()
    run = tmp_path / "t"
    metrics = read_jsonl(run / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    for key in ("success_rate", "mean_reward", "all_failed_groups", "replay_injections", "loss", "clip_fraction",
                "grad_norm", "tokens", "seconds_rollout", "seconds_update", "env_steps_per_s"):
        assert key in metrics[0]
    for m in metrics:  # [successes, episodes] of each task of the batch, adding up to the step's rate
        by_task = m["success_by_task"]
        assert set(by_task) == set(m["tasks"])
        assert sum(s for s, _ in by_task.values()) / sum(n for _, n in by_task.values()) == m["success_rate"]
    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert ckpts == ["step_000002"]  # keep_checkpoints=1
    ck = run / "checkpoints" / "step_000002"
    for name in ("model/config.json", "model/model.safetensors", "optimizer.pt", "replay.json", "trainer_state.json", ".complete"):
        assert (ck / name).is_file(), name
    assert (run / "rollouts" / "step_000000" / "miniwob" / "click-test" / "0" / "traj.jsonl").is_file()


@pytest.mark.slow
def test_resume_continues_exactly(tmp_path, tiny_qwen2vl, chromium_available):
    """2 steps straight == 1 step, stop, resume, 1 step: same metrics, weights, optimizer and buffer."""
    straight = _cfg(tmp_path, tiny_qwen2vl, "name=straight", "train.demo_replay=1")
    with build.trainer(straight) as t:
        t.train()
        w_straight, buf_straight = _params(t), t.replay.state_dict()
        opt_straight = t.optimizer.state_dict()
    split = _cfg(tmp_path, tiny_qwen2vl, "name=split", "train.demo_replay=1")
    with build.trainer(split) as t:
        t.train(steps=1)
    with build.trainer(split, resume=True) as t:
        assert t.step == 1
        t.train()
        w_split, buf_split = _params(t), t.replay.state_dict()
        opt_split = t.optimizer.state_dict()
    assert not list((tmp_path / "split").glob("config.until_*"))  # same config: nothing kept aside
    drop = ("seconds_rollout", "seconds_update", "env_steps_per_s")
    a = [{k: v for k, v in m.items() if k not in drop} for m in read_jsonl(tmp_path / "straight" / "metrics.jsonl")]
    b = [{k: v for k, v in m.items() if k not in drop} for m in read_jsonl(tmp_path / "split" / "metrics.jsonl")]
    assert a == b
    for k in w_straight:
        assert torch.allclose(w_straight[k], w_split[k], atol=1e-6), k
    # Same buffer: contents (paths differ only by the run name), generator state and counters.
    as_text = lambda buf, name: json.dumps(buf, sort_keys=True).replace(f"/{name}/", "/RUN/")
    assert as_text(buf_straight, "straight") == as_text(buf_split, "split")
    assert buf_straight["total_injections"] > 0
    assert opt_straight["state"].keys() == opt_split["state"].keys()
    for k in opt_straight["state"]:
        assert torch.allclose(opt_straight["state"][k]["exp_avg"], opt_split["state"][k]["exp_avg"], atol=1e-6)


@pytest.mark.slow
def test_a_run_that_dies_in_its_final_evaluation_resumes_at_the_evaluation(tmp_path, tiny_qwen2vl, chromium_available):
    """The last step's checkpoint is written before its evaluation (hours at full scale): a run
    that fails evaluating resumes with the update kept, evaluates, and logs the step once, with the
    same metrics as a run that never failed."""
    evaluating = ["train.eval_every=2", "eval.samples_per_task=1"]
    straight = _cfg(tmp_path, tiny_qwen2vl, "name=straight", *evaluating)
    with build.trainer(straight) as t:
        t.train()
        w_straight = _params(t)
    died = _cfg(tmp_path, tiny_qwen2vl, "name=died", *evaluating)
    t = build.trainer(died)
    evaluator = t.evaluator

    class DiesEvaluating:
        def due(self, step):
            return evaluator.due(step)

        def __call__(self, *args, **kwargs):
            raise RuntimeError("the machine went away during the final evaluation")

    t.evaluator = DiesEvaluating()
    with pytest.raises(RuntimeError, match="went away"), t:
        t.train()
    assert latest_checkpoint(tmp_path / "died" / "checkpoints").name == "step_000002"  # the update is kept
    assert [m["step"] for m in read_jsonl(tmp_path / "died" / "metrics.jsonl")] == [1]
    with build.trainer(died, resume=True) as t:
        assert t.step == 2
        finished = t.train()
        w_died = _params(t)
    assert [m["step"] for m in finished] == [2] and "eval_success_rate" in finished[0]
    drop = ("seconds_rollout", "seconds_update", "seconds_eval", "env_steps_per_s")
    a = [{k: v for k, v in m.items() if k not in drop} for m in read_jsonl(tmp_path / "straight" / "metrics.jsonl")]
    b = [{k: v for k, v in m.items() if k not in drop} for m in read_jsonl(tmp_path / "died" / "metrics.jsonl")]
    assert a == b and "eval_success_rate" in a[1]
    for k in w_straight:
        assert torch.equal(w_straight[k], w_died[k]), k
    # resumed again: nothing is pending, nothing is evaluated twice
    with build.trainer(died, resume=True) as t:
        assert t.train() == []
    assert [m["step"] for m in read_jsonl(tmp_path / "died" / "metrics.jsonl")] == [1, 2]


def test_partial_checkpoint_is_skipped(tmp_path):
    ck = tmp_path / "checkpoints"
    (ck / "step_000001").mkdir(parents=True)
    (ck / "step_000001" / ".complete").write_text("ok")
    (ck / "step_000002").mkdir()  # killed while writing: no marker
    (ck / ".tmp_step_000003").mkdir()
    assert latest_checkpoint(ck).name == "step_000001"


def test_torn_metrics_line_is_ignored(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text('{"step": 1}\n{"step": 2}\n{"ste')
    assert [m["step"] for m in read_jsonl(p)] == [1, 2]


def test_existing_run_is_not_overwritten(tmp_path, tiny_qwen2vl):
    cfg = _cfg(tmp_path, tiny_qwen2vl)
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "metrics.jsonl").write_text("")
    with pytest.raises(FileExistsError, match="resume"):
        build.trainer(cfg)


@pytest.mark.slow
def test_killed_training_resumes_with_nothing_lost_or_repeated(tmp_path, tiny_qwen2vl, chromium_available):
    """SIGKILL the trainer process after its first checkpoint, resume from the CLI, and check
    every step's metric line appears exactly once."""
    args = [f"model.path={tiny_qwen2vl}", f"out_dir={tmp_path}", "name=k", f"env.tasks=[{','.join(TASKS)}]",
            "env.workers=1", "env.max_steps=2", "model.max_new_tokens=24", "rollout.group_size=2",
            "train.tasks_per_batch=2", "train.updates_per_batch=1", "train.steps=4", "warm_start.steps=0",
            "warm_start.demos_per_task=0", "train.demo_replay=1", "logging.progress=false"]
    cmd = [sys.executable, "-m", "arpo_lib", "train", "--config", "configs/smoke.yaml", *args]
    proc = subprocess.Popen(cmd, cwd=REPO, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    run = tmp_path / "k"
    deadline = time.time() + 240
    while latest_checkpoint(run / "checkpoints") is None and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
    time.sleep(0.7)  # somewhere inside step 2
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    done = subprocess.run([sys.executable, "-m", "arpo_lib", "resume", "--run", str(run)], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed" in done.stdout
    steps = [m["step"] for m in read_jsonl(run / "metrics.jsonl")]
    assert steps == [1, 2, 3, 4]
    assert latest_checkpoint(run / "checkpoints").name == "step_000004"


def _scheduled_lrs(trainer, updates: int) -> list[float]:
    """The learning rate of each of `updates` optimizer steps (the trainer is closed after)."""
    lrs = []
    for _ in range(updates):
        lrs.append(trainer.scheduler.get_last_lr()[0])
        trainer.optimizer.step()
        trainer.scheduler.step()
    trainer.close()
    return lrs


def test_warmup_schedule(tmp_path, tiny_qwen2vl):
    cfg = _cfg(tmp_path, tiny_qwen2vl, "train.steps=4", "train.warmup_ratio=0.5", "train.lr=1e-3")
    lrs = _scheduled_lrs(build.trainer(cfg), 4)  # 4 updates, 2 of them warm-up: lr 0.5e-3, 1e-3, 1e-3, ...
    assert lrs == pytest.approx([0.5e-3, 1e-3, 1e-3, 1e-3])


def test_decaying_lr_schedules_end_at_min_lr_ratio(tmp_path, tiny_qwen2vl):
    cfg = _cfg(tmp_path, tiny_qwen2vl, "train.steps=5", "train.warmup_ratio=0.2", "train.lr=1e-3",
               "train.lr_schedule=cosine", "train.min_lr_ratio=0.1")
    lrs = _scheduled_lrs(build.trainer(cfg), 5)  # 1 warm-up, then cos over 4 steps from 1e-3 to 1e-4
    half = 1e-4 + 0.9e-3 * 0.5 * (1 + math.cos(math.pi / 3))
    assert lrs == pytest.approx([1e-3, 1e-3, half, 1e-4 + 0.9e-3 * 0.25, 1e-4])
    assert [lr_factor(u, 4, 0.0, "linear") for u in range(4)] == pytest.approx([1.0, 2 / 3, 1 / 3, 0.0])
    assert lr_factor(10, 4, 0.0, "linear", 0.2) == pytest.approx(0.2)  # past the end: stays at the floor


@pytest.mark.parametrize("override, message", [("train.lr_schedule=step", "train.lr_schedule"),
                                               ("train.min_lr_ratio=1.5", "train.min_lr_ratio")])
def test_lr_schedule_options_are_checked(tmp_path, tiny_qwen2vl, override, message):
    with pytest.raises(ConfigError, match=message):
        _cfg(tmp_path, tiny_qwen2vl, override)


@pytest.mark.slow
def test_optional_kl_penalty_against_the_initial_policy(tmp_path, tiny_qwen2vl, chromium_available):
    cfg = _cfg(tmp_path, tiny_qwen2vl, "train.steps=1", "train.demo_replay=1", "algo.kl_coef=0.1",
               "train.updates_per_batch=2")
    with build.trainer(cfg) as trainer:
        assert trainer.reference is not None
        (m,) = trainer.train()
    assert m["replay_injections"] > 0 and m["optimizer_steps"] == 2 and m["kl"] >= 0.0


def test_resume_without_a_checkpoint_starts_over_without_duplicate_lines(tmp_path, tiny_qwen2vl):
    """Killed before its first checkpoint: the metric lines already written are for steps that
    will run again."""
    cfg = _cfg(tmp_path, tiny_qwen2vl)
    run = tmp_path / "t"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 0.0}\n')
    t = build.trainer(cfg, resume=True)
    assert t.step == 0 and read_jsonl(run / "metrics.jsonl") == []
    t.close()


def test_a_resume_with_a_changed_config_keeps_the_config_the_run_had(tmp_path, tiny_qwen2vl, caplog):
    """config.yaml records how the run was made: a resume with the same config leaves it alone;
    one with another lr keeps the earlier config as config.until_step_<N>.yaml, names the key."""
    import yaml

    cfg = _cfg(tmp_path, tiny_qwen2vl)
    build.trainer(cfg).close()
    run = tmp_path / "t"
    build.trainer(cfg, resume=True).close()
    assert sorted(p.name for p in run.glob("config*.yaml")) == ["config.yaml"]
    changed = _cfg(tmp_path, tiny_qwen2vl, "train.lr=0.002")
    with caplog.at_level("WARNING"):
        build.trainer(changed, resume=True).close()
    assert sorted(p.name for p in run.glob("config*.yaml")) == ["config.until_step_000000.yaml", "config.yaml"]
    assert yaml.safe_load((run / "config.until_step_000000.yaml").read_text())["train"]["lr"] == cfg.train.lr
    assert yaml.safe_load((run / "config.yaml").read_text())["train"]["lr"] == 0.002
    assert "train.lr" in caplog.text and "config.until_step_000000.yaml" in caplog.text


@pytest.mark.slow
def test_damaged_checkpoint_is_detected_and_the_previous_one_used(tmp_path, tiny_qwen2vl, chromium_available):
    from arpo_lib.training.checkpoint import checkpoint_problem, usable_checkpoint

    cfg = _cfg(tmp_path, tiny_qwen2vl, "train.keep_checkpoints=2")
    with build.trainer(cfg) as t:
        t.train()
    ck = tmp_path / "t" / "checkpoints"
    assert checkpoint_problem(ck / "step_000002") is None and usable_checkpoint(ck).name == "step_000002"
    weights = ck / "step_000002" / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # truncated, e.g. a disk filled up later
    assert "model.safetensors" in checkpoint_problem(ck / "step_000002")
    # Resuming skips the damaged step 2, goes back to step 1 and redoes step 2.
    with build.trainer(cfg, resume=True) as t:
        assert t.step == 1
        t.train()
    assert [m["step"] for m in read_jsonl(tmp_path / "t" / "metrics.jsonl")] == [1, 2]
    assert checkpoint_problem(ck / "step_000002") is None
    # A damaged buffer is caught too.
    (ck / "step_000002" / "replay.json").write_text("{not json")
    assert "replay.json" in checkpoint_problem(ck / "step_000002")


def test_infrastructure_failures_are_dropped_from_groups_and_never_stored(tmp_path, tiny_qwen2vl):
    from arpo_lib.types import Trajectory

    with build.trainer(_cfg(tmp_path, tiny_qwen2vl, "algo.replay.enabled=true")) as trainer:
        def traj(task, status, score, i):
            return Trajectory(task=task, seed=i, sample=i, status=status, task_score=score, reward=score,
                              directory=str(tmp_path / f"{task[-4:]}{i}"))

        a, b = TASKS
        trajs = [traj(a, "ok", 1.0, 0), traj(a, "env_error", 0.0, 1), traj(a, "ok", 0.0, 2),
                 traj(b, "ok", 1.0, 3), traj(b, "env_error", 0.0, 4)]  # b: one usable rollout only
        groups = trainer.make_groups([a, b], trajs)
    assert [g.task for g in groups] == [a]  # b cannot be compared: skipped, not scored
    assert [t.status for t in groups[0].trajectories] == ["ok", "ok"]
    assert groups[0].advantages[0] > 0 > groups[0].advantages[1]
    stored = [e["item"]["dir"] for task in (a, b) for e in trainer.replay.state_dict()["tasks"].get(task, [])]
    # the successes, b's lone one included (stored though its group is too small to train on, as
    # ARPO would); never an infrastructure failure
    assert stored == [str(tmp_path / f"{a[-4:]}0"), str(tmp_path / f"{b[-4:]}3")]


@pytest.mark.parametrize("norm, expected", [("true", [1.1547, -0.57735, -0.57735]),
                                             ("false", [0.66667, -0.33333, -0.33333])])
def test_group_advantages_follow_algo_norm_adv_by_std(tmp_path, tiny_qwen2vl, norm, expected):
    from arpo_lib.types import Trajectory

    with build.trainer(_cfg(tmp_path, tiny_qwen2vl, f"algo.norm_adv_by_std={norm}")) as trainer:
        trajs = [Trajectory(task=TASKS[0], seed=i, sample=i, status="ok", task_score=s, reward=s,
                            directory=str(tmp_path / str(i))) for i, s in enumerate([1.0, 0.0, 0.0])]
        groups = trainer.make_groups(TASKS[:1], trajs)
    assert groups[0].advantages == pytest.approx(expected, abs=1e-4)


@pytest.mark.slow
def test_lora_adafactor_token_budget_run_resumes_exactly(tmp_path, tiny_qwen2vl, chromium_available):
    """The memory switches through the whole trainer: only adapters change, the checkpoint's
    model is a plain (merged) checkpoint, and a resume (base + adapter) continues exactly."""
    switches = ("model.lora_rank=4", "model.lora_alpha=8", "train.optimizer=adafactor", "train.token_budget=4000",
                "train.pack=true",
                "model.gradient_checkpointing=true", "train.demo_replay=1")
    straight = _cfg(tmp_path, tiny_qwen2vl, "name=straight", *switches)
    with build.trainer(straight) as t:
        base = {k: v.clone() for k, v in _params(t).items() if "lora_" not in k}
        t.train()
        w_straight = _params(t)
    changed = [k for k in w_straight if "lora_" in k and not k.endswith("lora_A.default.weight")]
    assert any(not torch.equal(w_straight[k], torch.zeros_like(w_straight[k])) for k in changed)
    for k, v in base.items():
        assert torch.equal(w_straight[k], v), k  # frozen base weights
    ckpt = sorted((tmp_path / "straight" / "checkpoints").glob("step_*"))[-1] / "model"
    assert (ckpt / "adapter.pt").is_file()
    from transformers import AutoModelForImageTextToText

    plain = AutoModelForImageTextToText.from_pretrained(ckpt)
    assert not any("lora" in n for n, _ in plain.named_parameters())
    split = _cfg(tmp_path, tiny_qwen2vl, "name=split", *switches)
    with build.trainer(split) as t:
        t.train(steps=1)
    with build.trainer(split, resume=True) as t:
        assert t.step == 1
        t.train()
        w_split = _params(t)
    for k in w_straight:
        assert torch.allclose(w_straight[k], w_split[k], atol=1e-6), k


@pytest.mark.slow
def test_demonstrations_for_fixed_instances_come_from_fresh_layouts(tiny_qwen2vl, chromium_available):
    """The warm start must not see the screens RL is measured on: fixed instances of a task
    (`click-test@0`) get demonstrations of the task on other layouts, collected once per task."""
    from arpo_lib.agent.hf_policy import HFPolicy
    from arpo_lib.envs.workers.pool import EnvPool
    from arpo_lib.training.sft import collect_demonstrations

    policy = HFPolicy(tiny_qwen2vl, device="cpu", max_new_tokens=48)
    with EnvPool(1, {"scale": 2, "max_steps": 3}) as pool:
        demos = collect_demonstrations(policy, pool, ["miniwob/click-test@0", "miniwob/click-test@1"], 2, seed=0,
                                       max_steps=3, progress=False)
    assert [d.task for d in demos] == ["miniwob/click-test"] * 2
    # Episode seeds of the task itself (each its own layout), none of the instances' seeds.
    assert len({d.seed for d in demos}) == 2 and not {d.seed for d in demos} & {0, 1}


def test_a_failing_trainer_releases_the_ranks_waiting_for_it_before_closing_anything_else():
    """On rank 0, a push that failed mid-way leaves the others waiting in its pass over
    the weights; closing the environments can take minutes, so they are released first."""
    from types import SimpleNamespace

    from arpo_lib.training.trainer import Trainer

    calls = []
    fake = SimpleNamespace(rollouts=SimpleNamespace(close=lambda: calls.append("rollouts")),
                           records=SimpleNamespace(close=lambda: calls.append("records")),
                           backend=SimpleNamespace(stop_weights_pass=lambda: calls.append("stop pass"),
                                                   close=lambda failed: calls.append(("backend", failed))))
    Trainer.close(fake, failed=True)  # type: ignore[arg-type]
    assert calls == ["stop pass", "rollouts", "records", ("backend", True)]
    calls.clear()
    Trainer.close(fake)  # type: ignore[arg-type]
    assert calls == ["rollouts", "records", ("backend", False)]

