"""The trainer's grouping and update under faults, on synthetic trajectories (no browser):
non-finite gradients, the KL term of zero-advantage sequences, lone successes, and a malformed
response scored by the environment's checker."""
from __future__ import annotations


import pytest
import torch
from PIL import Image

from arpo_lib import build
from arpo_lib.agent.prompt import response_text
from arpo_lib.algo import policy_loss
from arpo_lib.envs.osworld.fake import FAKE_DESKTOP_ENV, FAKE_TASK_LOADER
from arpo_lib.envs.workers.pool import EnvPool
from arpo_lib.run.config import load_config
from arpo_lib.rollout.engine import RolloutEngine
from arpo_lib.training.trainer import NonFiniteGradientError
from arpo_lib.types import EpisodeRequest, EpisodeStatus, Group, Trajectory

RESPONSES = ["Thought: I click.\nAction: click(start_box='(10,20)')", "Action: wait()", "Action: finished()"]


def _cfg(tmp_path, model, *overrides):
    return load_config("configs/smoke.yaml", [
        f"model.path={model}", f"out_dir={tmp_path}", "name=u", "train.updates_per_batch=1", "train.lr=1e-3",
        "warm_start.steps=0", "warm_start.demos_per_task=0", "train.demo_replay=0", "logging.progress=false",
        "rollout.group_size=2", *overrides])


def _trajectory(policy, task: str, i: int, score: float = 0.0) -> Trajectory:
    conv = policy.new_conversation("click the button")
    conv.add_observation(Image.new("RGB", (84, 56), (i * 40 % 255, 90, 200)))
    ids = policy.tokenizer(RESPONSES[i % 3], add_special_tokens=False)["input_ids"] + [policy.eos_ids[0]]
    conv.add_response(response_text(policy.tokenizer, ids, policy.eos_ids), ids, [-1.0] * len(ids))
    return Trajectory(task=task, seed=i, sample=i, task_score=score, reward=score, segments=conv.segments,
                      directory=f"/runs/x/{task}/{i}")


def _groups(policy, advantages):
    trajs = [_trajectory(policy, "miniwob/click-test", i) for i in range(len(advantages))]
    return [Group("miniwob/click-test", trajs, list(advantages), False, False)]


def _params(trainer):
    return [p.detach().clone() for p in trainer.policy.trainable_parameters()]


def test_a_nan_gradient_skips_the_step_instead_of_poisoning_the_weights(tmp_path, tiny_qwen2vl, capsys):
    with build.trainer(_cfg(tmp_path, tiny_qwen2vl, "train.updates_per_batch=2")) as trainer:
        policy = trainer.policy
        honest = policy.sequence_logprobs
        policy.sequence_logprobs = lambda segs, *a, **k: [lp * float("nan") if torch.is_grad_enabled() else lp
                                                          for lp in honest(segs, *a, **k)]
        before = _params(trainer)
        stats = trainer.update(_groups(policy, [1.0, -1.0, 0.5, -0.5]))
        after = _params(trainer)
    assert stats["skipped_steps"] == 2 and stats["optimizer_steps"] == 0
    assert all(torch.equal(a, b) for a, b in zip(before, after))  # untouched, and finite
    assert trainer.weights_version == 0 and trainer.consecutive_skips == 2
    assert "optimizer step skipped" in capsys.readouterr().out


def test_too_many_non_finite_steps_in_a_row_stop_the_run(tmp_path, tiny_qwen2vl):
    with build.trainer(_cfg(tmp_path, tiny_qwen2vl, "train.max_skipped_steps=2")) as trainer:
        policy = trainer.policy
        honest = policy.sequence_logprobs
        poison = {"on": True}
        policy.sequence_logprobs = lambda segs, *a, **k: [
            lp * float("inf") if poison["on"] and torch.is_grad_enabled() else lp for lp in honest(segs, *a, **k)]
        groups = _groups(policy, [1.0, -1.0])
        trainer.update(groups)
        poison["on"] = False
        assert trainer.update(groups)["optimizer_steps"] == 1 and trainer.consecutive_skips == 0  # a good step resets
        poison["on"] = True
        trainer.update(groups)
        with pytest.raises(NonFiniteGradientError, match="2 optimizer steps in a row"):
            trainer.update(groups)


def test_with_a_kl_term_zero_advantage_sequences_still_count(tmp_path, tiny_qwen2vl):
    """Their policy loss is zero but their KL to the reference is not: the update's gradient must
    equal the one computed over every sequence."""
    cfg = _cfg(tmp_path, tiny_qwen2vl, "algo.kl_coef=0.5", "train.grad_clip=1e9")
    with build.trainer(cfg) as trainer:
        policy = trainer.policy
        with torch.no_grad():  # move the policy away from the reference, so the KL has a gradient
            for p in policy.model.parameters():
                p.add_(torch.randn_like(p) * 0.02)
        groups = _groups(policy, [1.5, 0.0, 0.0, -1.5])
        segs = [t.segments[0] for t in groups[0].trajectories]
        # The update's order is a seeded shuffle; the loss is a mean over sequences, so order-free.
        seen = {}
        trainer.optimizer.step = lambda *a, **k: seen.update(
            grads=[p.grad.detach().clone() for p in policy.trainable_parameters()])
        trainer.update(groups)
        policy.model.train()
        policy.model.zero_grad(set_to_none=True)
        new = policy.sequence_logprobs(segs, 1.0)
        with torch.no_grad():
            ref = policy.sequence_logprobs(segs, 1.0, model=trainer.reference)
        pad = lambda xs: torch.nn.utils.rnn.pad_sequence(xs, batch_first=True)  # noqa: E731
        loss, _ = policy_loss(pad(new), pad([x.detach() for x in new]), torch.tensor([1.5, 0.0, 0.0, -1.5]),
                              pad([torch.ones_like(x) for x in new]), ref_logprobs=pad(ref), kl_coef=0.5)
        loss.backward()
        want = [p.grad for p in policy.trainable_parameters()]
    assert all(torch.allclose(g, w, atol=1e-6, rtol=1e-4) for g, w in zip(seen["grads"], want))


def test_a_lone_success_after_infrastructure_failures_is_stored_for_replay(tmp_path, tiny_qwen2vl):
    with build.trainer(_cfg(tmp_path, tiny_qwen2vl, "rollout.group_size=4")) as trainer:
        policy = trainer.policy
        trajs = [_trajectory(policy, "miniwob/click-test", i, score=1.0 if i == 0 else 0.0) for i in range(4)]
        for t in trajs[1:]:
            t.status = EpisodeStatus.ENV_ERROR
        groups = trainer.make_groups(["miniwob/click-test"], trajs)
        assert groups == []  # nothing to compare it with: no update from this task
        assert [s["dir"] for s in trainer.replay.successes("miniwob/click-test")] == [trajs[0].directory]


class _FixedResponses:
    """A policy that answers from a script, one response per step (the tiny model's tokens)."""

    def __init__(self, base, responses):
        self.base, self.responses = base, responses
        self.coord_mode, self.release, self.parse = base.coord_mode, base.release, base.parse
        self.new_conversation = base.new_conversation

    def generate(self, segments, *, contexts=None, **kw):
        from arpo_lib.types import Generation

        out = []
        for ctx in contexts:
            text = self.responses[ctx.step]
            ids = self.base.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.base.eos_ids[0]]
            out.append(Generation(text, ids, [0.0] * len(ids)))
        return out


@pytest.mark.slow
def test_a_malformed_response_ends_the_episode_through_the_checker(tmp_path, tiny_qwen2vl):
    """ARPO steps the environment with DONE and lets the checker score the state reached: a
    task done before the malformed response scores 1 (reward 1 - 0.5), not -0.5."""
    policy = build.hf_policy(_cfg(tmp_path, tiny_qwen2vl))
    click = "Action: click(start_box='(500,500)')"  # relative 0..1000: the screen's centre, on fake-click's target
    options = {"provider": "fake", "desktop_env_class": FAKE_DESKTOP_ENV, "task_loader": FAKE_TASK_LOADER,
               "cache_root": str(tmp_path / "vm"), "pause_s": 0, "max_steps": 5}
    with EnvPool(1, options, timeout_s=120) as pool:
        engine = RolloutEngine(_FixedResponses(policy, [click, "I am not an action"]), pool, max_steps=5)
        (traj,) = engine.run([EpisodeRequest("osworld/fake-click", 0)], progress=False, out_dir=tmp_path / "out")
    assert traj.ok and not traj.format_ok
    assert traj.task_score == 1.0 and traj.reward == pytest.approx(0.5)
    assert [s.parse_error is None for s in traj.steps] == [True, False]
    assert traj.steps[-1].terminated and traj.steps[-1].reward == 1.0


@pytest.mark.parametrize("kind", ["replayed", "stale"])
def test_replayed_members_are_weighted_by_truncated_importance_ratios(tmp_path, tiny_qwen2vl, kind):
    """algo.replay.correction=tis: a replayed member's tokens weigh min(pi_old / mu, cap), mu the
    stored behaviour probability; fresh members weigh 1. Checked against the loss written out.
    `stale` (asynchronous ARPO): a fresh member sampled by older weights (a batch played ahead of the
    update) weighs the same under algo.stale_correction=tis, the default."""
    from arpo_lib.algo import truncated_is_weights

    correction = "algo.replay.correction=tis" if kind == "replayed" else "algo.stale_correction=tis"
    cfg = _cfg(tmp_path, tiny_qwen2vl, correction, "algo.replay.tis_cap=2.0", "train.grad_clip=1e9")
    with build.trainer(cfg) as trainer:
        policy = trainer.policy
        groups = _groups(policy, [2.0, -0.5, -0.5, -1.0])
        for t in groups[0].trajectories:  # sampled by the weights the update starts from
            t.policy_version = 5
        replayed = groups[0].trajectories[0]
        replayed.replayed, replayed.policy_version = kind == "replayed", 0 if kind == "replayed" else 4
        seg = replayed.segments[0]
        n = sum(seg.loss_mask)
        # Behaviour log-probs of an older policy: some tokens now likelier (weight capped), some less.
        mu = [(-0.2 if k % 2 else -9.0) for k in range(n)]
        it = iter(mu)
        seg.behaviour_logprobs = [next(it) if m else 0.0 for m in seg.loss_mask]
        trainer.weights_version = 5
        seen = {}
        trainer.optimizer.step = lambda *a, **k: seen.update(
            grads=[p.grad.detach().clone() for p in policy.trainable_parameters()])
        stats = trainer.update(groups)
        segs = [t.segments[0] for t in groups[0].trajectories]
        policy.model.train()
        policy.model.zero_grad(set_to_none=True)
        new = policy.sequence_logprobs(segs, 1.0)
        old = [x.detach() for x in new]
        weights = [truncated_is_weights(old[0].double(), torch.tensor(mu, dtype=torch.float64), 2.0).float()] + \
                  [torch.ones_like(x) for x in new[1:]]
        pad = lambda xs: torch.nn.utils.rnn.pad_sequence(xs, batch_first=True)  # noqa: E731
        loss, _ = policy_loss(pad(new), pad(old), torch.tensor([2.0, -0.5, -0.5, -1.0]),
                              pad([torch.ones_like(x) for x in new]), is_weights=pad(weights))
        loss.backward()
        want = [p.grad for p in policy.trainable_parameters()]
    assert all(torch.allclose(g, w, atol=1e-6, rtol=1e-4) for g, w in zip(seen["grads"], want))
    if kind == "replayed":
        assert stats["replay_age_mean"] == 5 and stats["replay_age_max"] == 5
    assert stats["is_weight_max"] == 2.0 and 0 < stats["is_capped_share"] < 1
    assert stats["is_weight_mean"] == pytest.approx(float(weights[0].mean()), rel=1e-5)


def test_without_correction_replayed_data_is_treated_as_on_policy(tmp_path, tiny_qwen2vl):
    with build.trainer(_cfg(tmp_path, tiny_qwen2vl)) as trainer:
        groups = _groups(trainer.policy, [2.0, -0.5, -0.5, -1.0])
        groups[0].trajectories[0].replayed = True
        stats = trainer.update(groups)
    assert "is_weight_mean" not in stats and stats["replay_age_mean"] == 0


@pytest.mark.slow
def test_a_rollout_batch_keeps_no_pixels_and_the_update_trains_as_with_them(tmp_path, tiny_qwen2vl):
    """Regression: every finished episode kept its fp32 pixels until the update (~50 MB per 1080p
    screenshot, ~130 GB at 32x8 episodes). With `keep_pixels=False` the engine drops them once the
    trajectory is written; the update re-encodes each micro-batch's from disk and drops them after,
    with the same loss, metrics and weights as from pixels held in memory."""
    from arpo_lib.rollout.store import load_trajectory

    policy = build.hf_policy(_cfg(tmp_path, tiny_qwen2vl))
    click = "Action: click(start_box='(500,500)')"
    options = {"provider": "fake", "desktop_env_class": FAKE_DESKTOP_ENV, "task_loader": FAKE_TASK_LOADER,
               "cache_root": str(tmp_path / "vm"), "pause_s": 0, "max_steps": 3}
    with EnvPool(1, options, timeout_s=120) as pool:
        engine = RolloutEngine(_FixedResponses(policy, [RESPONSES[1], click, "Action: finished()"]), pool,
                               max_steps=3, keep_pixels=False)
        trajs = engine.run([EpisodeRequest("osworld/fake-click", i, i) for i in range(2)], progress=False,
                           out_dir=tmp_path / "out")
    segs = [s for t in trajs for s in t.segments]
    assert all(t.ok for t in trajs) and len(segs) == 2
    assert all(s.screenshot_steps and s.pixel_values == [] for s in segs)  # before: 3 screenshots' pixels each
    held = [load_trajectory(t.directory, policy.processor) for t in trajs]  # as the update saw them before
    assert all(len(s.pixel_values) == 3 for t in held for s in t.segments)

    def update(trajectories, name):
        # Two optimizer steps: the second one's ratios (and loss) come from weights the first changed.
        with build.trainer(_cfg(tmp_path / name, tiny_qwen2vl, "train.updates_per_batch=2")) as trainer:
            stats = trainer.update([Group("osworld/fake-click", trajectories, [1.0, -0.5], False, False)])
            return stats, _params(trainer)

    stats, params = update(trajs, "dropped")
    want_stats, want_params = update(held, "held")
    assert stats["optimizer_steps"] == 2 and stats["loss"] == want_stats["loss"] != 0.0
    assert {k: stats[k] for k in want_stats} == want_stats
    assert all(torch.equal(a, b) for a, b in zip(params, want_params))
    assert all(s.pixel_values == [] for s in segs)  # dropped again after their micro-batch
