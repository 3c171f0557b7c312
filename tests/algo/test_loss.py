"""The clipped policy loss, branch by branch, on hand-computed numbers."""
import math

import pytest
import torch

from arpo_lib.algo import AGGREGATIONS, policy_loss


def one_token(ratio: float, advantage: float, **kwargs):
    """Loss, metrics and d loss / d logprob for a single token with the given ratio."""
    logprobs = torch.tensor([[math.log(ratio)]], requires_grad=True)
    old = torch.zeros(1, 1)
    loss, metrics = policy_loss(logprobs, old, torch.tensor([advantage]), torch.ones(1, 1), **kwargs)
    loss.backward()
    return loss.item(), metrics, logprobs.grad.item()


def test_ratio_one_gives_minus_the_advantage_under_each_aggregation():
    # Two trajectories of 3 and 1 assistant tokens, A = (+1, -2); ratio 1 so loss_t = -A.
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    logprobs = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -9.0, -9.0]])
    adv = torch.tensor([1.0, -2.0])
    seq_loss, m = policy_loss(logprobs, logprobs.clone(), adv, mask, aggregation="seq-mean-token-mean")
    tok_loss, _ = policy_loss(logprobs, logprobs.clone(), adv, mask, aggregation="token-mean")
    # per sequence: -1 and +2 -> mean 0.5; per token: (3 * -1 + 1 * 2) / 4 = -0.25
    assert seq_loss.item() == pytest.approx(0.5)
    assert tok_loss.item() == pytest.approx(-0.25)
    assert m["tokens"] == 4
    assert m["ratio_mean"] == pytest.approx(1.0)
    assert m["ratio_max"] == pytest.approx(1.0)
    assert m["clip_fraction"] == 0.0
    assert m["approx_kl"] == pytest.approx(0.0)


def test_aggregations_agree_on_equal_lengths():
    logprobs = torch.tensor([[-1.0, -2.0], [-0.5, -0.1]])
    old = torch.tensor([[-1.1, -1.8], [-0.5, -0.3]])
    adv = torch.tensor([0.7, -1.3])
    mask = torch.ones(2, 2)
    a, _ = policy_loss(logprobs, old, adv, mask, aggregation="seq-mean-token-mean")
    b, _ = policy_loss(logprobs, old, adv, mask, aggregation="token-mean")
    assert a.item() == pytest.approx(b.item())


def test_seq_mean_skips_sequences_without_tokens():
    mask = torch.tensor([[1, 1], [0, 0]])
    logprobs = torch.zeros(2, 2)
    loss, m = policy_loss(logprobs, logprobs, torch.tensor([2.0, 5.0]), mask)
    assert loss.item() == pytest.approx(-2.0)  # not (-2 + 0) / 2
    assert m["tokens"] == 2


def test_positive_advantage_high_ratio_is_clipped_at_one_plus_clip_high():
    # max(-1.5, -1.3) = -1.3: the clipped term wins, the gradient is cut.
    loss, m, grad = one_token(1.5, 1.0)
    assert loss == pytest.approx(-1.3)
    assert m["clip_fraction"] == 1.0 and m["dual_clip_fraction"] == 0.0
    assert grad == 0.0


def test_clip_is_asymmetric():
    # 1.25 is inside [0.8, 1.3] (it would be clipped by a symmetric 0.2): unclipped, d/dlogp = -A r.
    loss, m, grad = one_token(1.25, 1.0)
    assert loss == pytest.approx(-1.25)
    assert m["clip_fraction"] == 0.0
    assert grad == pytest.approx(-1.25)
    # ... and 0.75 is below 1 - 0.2 = 0.8: for A < 0, max(0.75, 0.8) = 0.8, clipped.
    loss, m, grad = one_token(0.75, -1.0)
    assert loss == pytest.approx(0.8)
    assert m["clip_fraction"] == 1.0 and grad == 0.0


def test_positive_advantage_low_ratio_is_not_clipped():
    # max(-0.5, -0.8) = -0.5: the pessimistic unclipped term; gradient -A r = -0.5.
    loss, m, grad = one_token(0.5, 1.0)
    assert loss == pytest.approx(-0.5)
    assert m["clip_fraction"] == 0.0
    assert grad == pytest.approx(-0.5)


def test_negative_advantage_low_ratio_is_clipped_at_one_minus_clip_low():
    # max(0.5, 0.8) = 0.8
    loss, m, grad = one_token(0.5, -1.0)
    assert loss == pytest.approx(0.8)
    assert m["clip_fraction"] == 1.0
    assert grad == 0.0


def test_negative_advantage_moderate_high_ratio_is_not_clipped():
    # ratio 2 > 1.3 but A < 0: max(2, 1.3) = 2 (below the dual cap 3); gradient -A r = 2.
    loss, m, grad = one_token(2.0, -1.0)
    assert loss == pytest.approx(2.0)
    assert m["clip_fraction"] == 0.0 and m["dual_clip_fraction"] == 0.0
    assert grad == pytest.approx(2.0)


def test_dual_clip_caps_negative_advantage_at_dual_clip_times_abs_advantage():
    # max(-A r, -A 1.3) = 10 for A=-2, r=5; capped at 3 * 2 = 6; no gradient through the cap.
    loss, m, grad = one_token(5.0, -2.0)
    assert loss == pytest.approx(6.0)
    assert m["dual_clip_fraction"] == 1.0 and m["clip_fraction"] == 0.0
    assert grad == 0.0
    # without the dual clip it is the plain PPO loss
    loss, m, grad = one_token(5.0, -2.0, dual_clip=None)
    assert loss == pytest.approx(10.0)
    assert m["dual_clip_fraction"] == 0.0
    assert grad == pytest.approx(10.0)


def test_dual_clip_does_not_touch_positive_advantages():
    loss, m, _ = one_token(5.0, 2.0)
    assert loss == pytest.approx(-2.0 * 1.3)
    assert m["dual_clip_fraction"] == 0.0 and m["clip_fraction"] == 1.0


def test_metrics_are_token_shares():
    # One trajectory, A = +1, ratios (1.5, 0.5, 1, 1): only the first token is clipped.
    ratios = torch.tensor([[1.5, 0.5, 1.0, 1.0]])
    logprobs = ratios.log()
    loss, m = policy_loss(logprobs, torch.zeros(1, 4), torch.tensor([1.0]), torch.ones(1, 4))
    assert loss.item() == pytest.approx((-1.3 - 0.5 - 1.0 - 1.0) / 4)
    assert m["clip_fraction"] == pytest.approx(0.25)
    assert m["ratio_mean"] == pytest.approx(1.0)
    assert m["ratio_max"] == pytest.approx(1.5)
    assert m["approx_kl"] == pytest.approx(-(math.log(1.5) + math.log(0.5)) / 4)
    assert all(isinstance(v, (int, float)) for v in m.values())


def test_gradient_flows_only_through_logprobs():
    logprobs = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    old = torch.tensor([[-1.1, -1.9]], requires_grad=True)
    adv = torch.tensor([0.5], requires_grad=True)
    ref = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    loss, _ = policy_loss(logprobs, old, adv, torch.ones(1, 2), ref_logprobs=ref, kl_coef=0.1)
    loss.backward()
    assert logprobs.grad is not None and logprobs.grad.abs().sum() > 0
    assert old.grad is None and adv.grad is None and ref.grad is None


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_masked_positions_have_no_effect(aggregation):
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]])
    clean_new = torch.tensor([[-1.0, -0.2, 0.0, 0.0], [-0.7, 0.0, 0.0, 0.0]])
    clean_old = torch.tensor([[-1.2, -0.1, 0.0, 0.0], [-0.4, 0.0, 0.0, 0.0]])
    garbage = torch.tensor([[0.0, 0.0, 1e4, -1e4], [0.0, 80.0, -300.0, float("inf")]])
    adv = torch.tensor([1.0, -1.5])
    results = []
    for new, old in ((clean_new, clean_old), (clean_new + garbage, clean_old - garbage)):
        new = new.clone().requires_grad_(True)
        loss, m = policy_loss(
            new, old, adv, mask, aggregation=aggregation, ref_logprobs=old + garbage, kl_coef=0.1
        )
        loss.backward()
        results.append((loss.item(), new.grad.clone(), m))
    (clean_loss, clean_grad, clean_m), (dirty_loss, dirty_grad, dirty_m) = results
    assert math.isfinite(dirty_loss) and dirty_loss == pytest.approx(clean_loss)
    assert torch.equal(dirty_grad, clean_grad)
    assert torch.isfinite(dirty_grad).all()
    assert (dirty_grad[~mask.bool()] == 0).all()
    assert dirty_m == pytest.approx(clean_m)


def test_kl_penalty_is_k3_against_the_reference():
    # new = old = 0 and A = 0 so the policy term is 0; ref - new = ln 2:
    # k3 = e^{ln 2} - ln 2 - 1 = 0.30685; d k3 / d new = 1 - e^{ln 2} = -1.
    logprobs = torch.zeros(1, 1, requires_grad=True)
    ref = torch.tensor([[math.log(2.0)]])
    loss, m = policy_loss(
        logprobs, torch.zeros(1, 1), torch.zeros(1), torch.ones(1, 1), ref_logprobs=ref, kl_coef=0.1
    )
    loss.backward()
    assert m["kl"] == pytest.approx(1 - math.log(2.0), abs=1e-6)
    assert loss.item() == pytest.approx(0.1 * (1 - math.log(2.0)), abs=1e-6)
    assert logprobs.grad.item() == pytest.approx(-0.1)
    # without kl_coef the reference is only reported
    loss, m = policy_loss(logprobs, torch.zeros(1, 1), torch.zeros(1), torch.ones(1, 1), ref_logprobs=ref)
    assert loss.item() == 0.0 and "kl" in m


def test_no_kl_metric_without_reference():
    _, m = policy_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1), torch.ones(1, 1))
    assert "kl" not in m


def test_empty_mask_gives_zero_loss_that_can_backward():
    logprobs = torch.zeros(2, 3, requires_grad=True)
    loss, m = policy_loss(logprobs, torch.zeros(2, 3), torch.ones(2), torch.zeros(2, 3))
    loss.backward()
    assert loss.item() == 0.0 and m["tokens"] == 0 and m["ratio_max"] == 0.0
    assert torch.equal(logprobs.grad, torch.zeros(2, 3))


def test_float64_inputs_stay_float64():
    """Reference computations (verl comparisons, hand-computed numbers) run in float64: the loss
    must not round them to float32 on the way."""
    torch.manual_seed(0)
    logprobs = (torch.randn(3, 5, dtype=torch.float64) * 0.1 - 1.0).requires_grad_()
    old = logprobs.detach() + torch.randn(3, 5, dtype=torch.float64) * 1e-9
    adv = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64)
    loss, _ = policy_loss(logprobs, old, adv, torch.ones(3, 5), clip_low=0.2, clip_high=0.3, dual_clip=None)
    loss.backward()
    ratio = torch.exp(logprobs.detach() - old)
    expected = (-(adv[:, None] * ratio)).mean(dim=1).mean()  # no clip is active this close to 1
    assert loss.dtype == torch.float64 and logprobs.grad.dtype == torch.float64
    assert abs(loss.item() - expected.item()) < 1e-15
    assert torch.allclose(logprobs.grad, -(adv[:, None] * ratio) / 15, atol=1e-15, rtol=0)


def test_approx_kl_metric_clamps_runaway_log_ratios_as_verl():
    new = torch.tensor([[-1.0, -60.0]])
    old = torch.tensor([[-1.0, -1.0]])  # old - new = 0 and 59: the second clamps at 20
    _, m = policy_loss(new, old, torch.tensor([1.0]), torch.ones(1, 2))
    assert m["approx_kl"] == pytest.approx(10.0)


def test_bf16_inputs_give_a_float32_loss():
    logprobs = torch.tensor([[-1.0, -2.0]], dtype=torch.bfloat16, requires_grad=True)
    loss, _ = policy_loss(logprobs, logprobs.detach(), torch.tensor([1.0]), torch.ones(1, 2))
    loss.backward()
    assert loss.dtype == torch.float32 and logprobs.grad.dtype == torch.bfloat16


def test_bad_arguments_fail_with_clear_messages():
    x, a, mask = torch.zeros(2, 3), torch.zeros(2), torch.ones(2, 3)
    with pytest.raises(ValueError, match="seq-mean-token-mean.*token-mean"):
        policy_loss(x, x, a, mask, aggregation="sum")
    with pytest.raises(ValueError, match=r"logprobs must be shaped \(B, T\)"):
        policy_loss(torch.zeros(6), x, a, mask)
    with pytest.raises(ValueError, match="old_logprobs"):
        policy_loss(x, torch.zeros(2, 4), a, mask)
    with pytest.raises(ValueError, match="mask"):
        policy_loss(x, x, a, torch.ones(3, 3))
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(x, x, torch.zeros(2, 1), mask)
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(x, x, a, mask, kl_coef=0.1)
    with pytest.raises(ValueError, match="dual_clip"):
        policy_loss(x, x, a, mask, dual_clip=0.5)
    with pytest.raises(ValueError, match="clip_low"):
        policy_loss(x, x, a, mask, clip_low=1.0)
    with pytest.raises(ValueError, match="advantages must be finite"):
        policy_loss(x, x, torch.tensor([0.0, float("nan")]), mask)


def test_truncated_importance_weights_on_hand_computed_numbers():
    from arpo_lib.algo import truncated_is_weights

    old = torch.tensor([[-1.0, -0.1, -3.0]], dtype=torch.float64)
    behaviour = torch.tensor([[-1.5, -2.0, -1.0]], dtype=torch.float64)
    w = truncated_is_weights(old, behaviour, cap=2.0)
    assert torch.allclose(w, torch.tensor([[math.exp(0.5), 2.0, math.exp(-2.0)]], dtype=torch.float64))


def test_importance_weights_multiply_each_tokens_clipped_objective():
    logprobs = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64, requires_grad=True)
    weights = torch.tensor([[1.6487, 2.0, 0.1353]], dtype=torch.float64)
    loss, _ = policy_loss(logprobs, logprobs.detach(), torch.tensor([1.0], dtype=torch.float64),
                          torch.ones(1, 3), is_weights=weights)
    loss.backward()
    # ratio 1 everywhere: per-token loss -A * w, token mean of one sequence
    assert loss.item() == pytest.approx(-(1.6487 + 2.0 + 0.1353) / 3, abs=1e-12)
    assert torch.allclose(logprobs.grad, -weights / 3)
    unweighted, _ = policy_loss(logprobs, logprobs.detach(), torch.tensor([1.0], dtype=torch.float64), torch.ones(1, 3))
    assert unweighted.item() == pytest.approx(-1.0)
