"""The PPO-style clipped policy loss used by GRPO and ARPO, on per-token log-probabilities.

Per assistant token t of trajectory i, with ratio r = exp(logp - old_logp) and the trajectory's
advantage A_i broadcast to all its tokens:

    loss_t = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))      (asymmetric "clip-higher")
    loss_t = min(loss_t, -A dual_clip)            when A < 0           (dual clip, Ye et al. 2020)

ARPO uses clip_low 0.2, clip_high 0.3, dual clip 3.0, no KL term, no entropy bonus; the branch
structure matches `compute_policy_loss` in verl's core_algos.py (as vendored by ARPO).

How the per-token losses become one number is a choice the original makes by accident (its
micro-batch size decides it); here it is the explicit `aggregation` argument:
- "seq-mean-token-mean": mean over the tokens of each trajectory, then mean over trajectories
  (what ARPO gets with micro-batches of one trajectory): every trajectory weighs the same.
- "token-mean": mean over all tokens of the batch: long trajectories weigh more.

The trainer calls the loss that `algo.policy_loss` names in `POLICY_LOSSES` (one signature:
`loss(logprobs, old_logprobs, advantages, mask, cfg, *, ref_logprobs=None, is_weights=None)
-> (loss, metrics)`); `ppo_clip` is the one above, its knobs read from the run's `algo.*`.
"""
from __future__ import annotations

import typing

import torch

from arpo_lib.run.config import Aggregation, AlgoConfig
from arpo_lib.run.registry import POLICY_LOSSES

AGGREGATIONS: tuple[str, ...] = typing.get_args(Aggregation)
"""The loss aggregations: the choices of algo.aggregation (run/config.py's `Aggregation`)."""

# exp() of a log-ratio beyond this overflows float32 long before it means anything (verl clamps too).
_MAX_LOG_RATIO = 20.0
# The k3 estimator explodes when the policy drifts far from the reference; verl clamps it here.
_MAX_K3 = 10.0


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of x over mask (both (B, T)); 0 when the mask is empty."""
    return torch.where(mask, x, 0.0).sum() / mask.sum().clamp_min(1)


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, aggregation: str) -> torch.Tensor:
    """Reduce a per-token quantity to a scalar.

    Args:
        per_token: (B, T) values; positions outside the mask are ignored whatever they hold.
        mask: (B, T) bool, True on the tokens that count.
        aggregation: one of AGGREGATIONS (see the module docstring).

    Returns:
        () scalar. A batch with no masked token gives 0 (still attached to the graph, so a
        distributed step can call backward on it like on any other micro-batch).
    """
    values = torch.where(mask, per_token, 0.0)  # (B, T)
    if aggregation == "token-mean":
        return values.sum() / mask.sum().clamp_min(1)
    if aggregation == "seq-mean-token-mean":
        tokens_per_seq = mask.sum(dim=1)  # (B,)
        seq_means = values.sum(dim=1) / tokens_per_seq.clamp_min(1)  # (B,)
        # A sequence with no assistant token has no mean; it must not pull the average to 0.
        has_tokens = tokens_per_seq > 0  # (B,)
        return torch.where(has_tokens, seq_means, 0.0).sum() / has_tokens.sum().clamp_min(1)
    raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")


def truncated_is_weights(old_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance weights min(pi_old / mu, cap) per token (TIS, as verl and AReaL apply
    to stale or mismatched rollouts): `old_logprobs` under the policy before this update,
    `behaviour_logprobs` under the one that sampled the tokens. Same shape in and out, detached."""
    log_ratio = (old_logprobs.detach() - behaviour_logprobs.detach()).clamp(max=_MAX_LOG_RATIO)
    return torch.exp(log_ratio).clamp(max=cap)


def _check_shapes(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    ref_logprobs: torch.Tensor | None,
) -> None:
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be shaped (B, T), got {tuple(logprobs.shape)}")
    expected = tuple(logprobs.shape)
    for name, tensor in (("old_logprobs", old_logprobs), ("mask", mask), ("ref_logprobs", ref_logprobs)):
        if tensor is not None and tuple(tensor.shape) != expected:
            raise ValueError(f"{name} must have the shape of logprobs {expected}, got {tuple(tensor.shape)}")
    if tuple(advantages.shape) != expected[:1]:
        raise ValueError(
            f"advantages must be shaped (B,) = ({expected[0]},), one per trajectory, "
            f"got {tuple(advantages.shape)}"
        )


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.3,
    dual_clip: float | None = 3.0,
    aggregation: str = "seq-mean-token-mean",
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped policy-gradient loss of a batch of trajectories.

    Args:
        logprobs: (B, T) log-probabilities of the sampled tokens under the current policy;
            the only input the gradient flows into.
        old_logprobs: (B, T) log-probabilities under the policy that sampled them (detached).
        advantages: (B,) one advantage per trajectory, given to each of its tokens (detached).
        mask: (B, T) 1/True on assistant tokens (the ones the policy produced), 0 elsewhere.
            Masked-out positions may hold anything, even inf or NaN: they are replaced before use.
        clip_low, clip_high: the ratio is clipped to [1 - clip_low, 1 + clip_high].
        dual_clip: for A < 0 the per-token loss is capped at dual_clip * |A|; None disables it.
        aggregation: "seq-mean-token-mean" or "token-mean" (module docstring).
        ref_logprobs: (B, T) reference-policy log-probabilities, for an optional KL penalty.
        kl_coef: weight of the k3 ("low_var_kl") penalty; needs ref_logprobs when > 0.
        is_weights: (B, T) importance weights (detached) multiplying each token's clipped
            objective, e.g. `truncated_is_weights` for off-policy data; None = 1 everywhere.

    Returns:
        loss: () scalar to minimise.
        metrics: python numbers: clip_fraction (share of tokens where the clipped term won, so the
            gradient is cut), dual_clip_fraction, approx_kl (token mean of old - new, each
            clamped to +-20 as the ratio is), ratio_mean, ratio_max, pg_loss, tokens; kl when ref_logprobs is given.
    """
    _check_shapes(logprobs, old_logprobs, advantages, mask, ref_logprobs)
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
    if not 0.0 <= clip_low < 1.0:
        raise ValueError(f"clip_low must be in [0, 1), got {clip_low}")
    if clip_high < 0.0:
        raise ValueError(f"clip_high must be >= 0, got {clip_high}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (or None to disable it), got {dual_clip}")
    if kl_coef < 0.0:
        raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
    if kl_coef > 0.0 and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs")
    if not torch.isfinite(advantages).all():
        raise ValueError(f"advantages must be finite, got {advantages.tolist()}")

    m = mask.bool()  # (B, T)
    # Computed in float32 at least: bf16/fp16 log-probs are upcast, float64 ones stay float64.
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    # Zero the padding first: where() blocks both its values and its gradients, so garbage in
    # masked positions can reach neither the loss nor the gradient (0 * inf would be NaN).
    new = torch.where(m, logprobs.to(dtype), 0.0)  # (B, T)
    old = torch.where(m, old_logprobs.detach().to(dtype), 0.0)  # (B, T)
    adv = advantages.detach().to(device=new.device, dtype=dtype)[:, None].expand_as(new)  # (B, T)

    log_ratio = (new - old).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)  # (B, T)
    ratio = torch.exp(log_ratio)  # (B, T)
    loss_unclipped = -adv * ratio
    loss_clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(loss_unclipped, loss_clipped)  # pessimistic bound, as in PPO
    clip_active = loss_clipped > loss_unclipped
    if dual_clip is not None:
        # A very large ratio on a bad token would otherwise give an unbounded loss (and gradient).
        cap = -adv * dual_clip
        dual_active = (adv < 0) & (per_token > cap)
        per_token = torch.where(adv < 0, torch.minimum(per_token, cap), per_token)
    else:
        dual_active = torch.zeros_like(m)

    if is_weights is not None:
        if tuple(is_weights.shape) != tuple(logprobs.shape):
            raise ValueError(f"is_weights must have the shape of logprobs {tuple(logprobs.shape)}, "
                             f"got {tuple(is_weights.shape)}")
        per_token = per_token * torch.where(m, is_weights.detach().to(dtype), 0.0)
    pg_loss = aggregate(per_token, m, aggregation)
    loss = pg_loss
    kl_value: torch.Tensor | None = None
    if ref_logprobs is not None:
        ref = torch.where(m, ref_logprobs.detach().to(dtype), 0.0)
        # k3 = exp(ref - new) - (ref - new) - 1: unbiased for KL(new || ref), always >= 0.
        delta = ref - new
        k3 = (torch.exp(delta) - delta - 1.0).clamp(-_MAX_K3, _MAX_K3)  # (B, T)
        kl_value = aggregate(k3, m, aggregation)
        if kl_coef > 0.0:
            loss = loss + kl_coef * kl_value

    with torch.no_grad():
        n_tokens = int(m.sum().item())
        metrics: dict[str, float] = {
            "pg_loss": float(pg_loss.item()),
            "clip_fraction": float(_masked_mean(clip_active.float(), m).item()),
            "dual_clip_fraction": float(_masked_mean(dual_active.float(), m).item()),
            # of the clamped log-ratio, as verl's ppo_kl: one runaway token cannot swamp the metric
            "approx_kl": float(_masked_mean(-log_ratio, m).item()),
            "ratio_mean": float(_masked_mean(ratio, m).item()),
            "ratio_max": float(ratio[m].max().item()) if n_tokens else 0.0,
            "tokens": n_tokens,
        }
        if kl_value is not None:
            metrics["kl"] = float(kl_value.item())
    return loss, metrics


@POLICY_LOSSES.register("ppo_clip")
def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: AlgoConfig,
    *,
    ref_logprobs: torch.Tensor | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GRPO's and ARPO's loss: `policy_loss` with `algo.clip_low`, `clip_high`, `dual_clip`,
    `aggregation` and `kl_coef`. Shapes as `policy_loss`: (B, T) tokens, (B,) advantages."""
    return policy_loss(logprobs, old_logprobs, advantages, mask, clip_low=cfg.clip_low, clip_high=cfg.clip_high,
                       dual_clip=cfg.dual_clip, aggregation=cfg.aggregation, ref_logprobs=ref_logprobs,
                       kl_coef=cfg.kl_coef, is_weights=is_weights)
