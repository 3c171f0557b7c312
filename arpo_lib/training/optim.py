"""The optimizer, its learning-rate schedule, and micro-batches sized by a token budget.

Optimizers: `adamw` (fused on CUDA) or `adafactor` (factored second moments, ~no optimizer
state: what lets a 7B full fine-tune fit; see arpo_lib/agent/model/lora.py for the memory budget).
On FSDP2 shards (several processes) Adafactor is `ShardedAdafactor`: torch's Adafactor cannot
step them (its row and column statistics reduce over the sharded dimension, in place), so this
subclass runs the same update on each rank's rows and sums the few statistics that span ranks.

Token-budget micro-batches: ARPO's sequences range from one screenshot (~3k tokens at 1080p) to
fifteen (~40k). A fixed micro-batch size either wastes the GPU on short ones or runs out of memory
on long ones. Here sequences are sorted by length and packed greedily into micro-batches whose
padded size (rows x longest row) stays within `budget` tokens; a sequence longer than the budget
goes alone. Sorting also keeps padding small. The trainer weights each micro-batch's loss by its
share of the mini-batch, so the gradient is the same whatever the grouping.
"""
from __future__ import annotations

import math
from typing import Any, Sequence, TypeVar

import torch

from arpo_lib.run.registry import LR_SCHEDULES, OPTIMIZERS

T = TypeVar("T")


def make_optimizer(name: str, params: list[torch.nn.Parameter], lr: float,
                   weight_decay: float) -> torch.optim.Optimizer:
    """The registered optimizer `name` (train.optimizer: `adamw`, `adafactor`, or a plug-in's)."""
    return OPTIMIZERS[name](params, lr, weight_decay)


@OPTIMIZERS.register("adamw")
def adamw(params: list[torch.nn.Parameter], lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """AdamW, fused on CUDA (one kernel for all parameters)."""
    fused = bool(params) and all(p.is_cuda for p in params)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=fused or None)


@OPTIMIZERS.register("adafactor")
def adafactor(params: list[torch.nn.Parameter], lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """Adafactor (factored second moments: ~no optimizer state), sharded-aware under FSDP2."""
    sharded = any(_is_dtensor(p) for p in params)
    return (ShardedAdafactor if sharded else torch.optim.Adafactor)(params, lr=lr, weight_decay=weight_decay)


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


class ShardedAdafactor(torch.optim.Adafactor):
    """torch.optim.Adafactor's update (its single-tensor algorithm, same hyper-parameters and state
    keys) for parameters sharded on their first dimension by FSDP2 (DTensors, `Shard(0)` on a 1-D
    mesh); plain tensors are stepped as torch's would be.

    Each rank updates its own rows. What spans ranks is summed over the mesh's process group, two
    all-reduces per step for all parameters together: (1) every parameter's squared norm, the
    column sums of squared gradients of 2-D parameters (their rows are the sharded dimension) and
    the sums of the row statistics; (2) every update's squared norm. The state is sharded like the
    parameters (row statistics and vectors' variances: `Shard(0)`; a 2-D parameter's column
    statistics: `Replicate`), stored as DTensors so torch.distributed.checkpoint saves and
    re-shards it and a checkpoint moves between this and torch's Adafactor (1 process)."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # noqa: C901 (one algorithm, kept in one place)
        import torch.distributed as dist

        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["maximize"]:
                raise ValueError("ShardedAdafactor: maximize is not supported")
            lr, wd, (eps1, eps2), d = group["lr"], group["weight_decay"], group["eps"], group["d"]
            work = []  # (param, this rank's part of it, of its gradient, its state, its device mesh or None)
            for p in group["params"]:
                if p.grad is None:
                    continue
                local_p, local_g, mesh = _local(p), _local(p.grad), getattr(p, "device_mesh", None)
                state = self.state[p]
                if not state:
                    state.update(_adafactor_state(p, local_p))
                work.append((p, local_p, local_g, state, mesh))
            if not work:
                continue
            group_pg = next((w[4].get_group() for w in work if w[4] is not None), None)
            if group_pg is not None and any(w[4] is None for w in work):
                # a whole tensor's sums would be added up once per rank
                raise ValueError("ShardedAdafactor: a parameter group mixes sharded and whole tensors")
            # (1) parameter norms, 2-D column sums, row-statistic sums
            c = []  # one-minus-beta2 per parameter
            for p, lp, lg, state, _ in work:
                state["step"] += 1
                step = float(state["step"])
                c.append(step ** group["beta2_decay"])
                if lg.dim() > 1:
                    _local(state["row_var"]).lerp_((lg * lg).sum(dim=-1, keepdim=True) / p.shape[-1], c[-1])
            first = [lp.float().square().sum().reshape(1) for _, lp, _, _, _ in work]
            for p, _, lg, state, _ in work:
                if lg.dim() == 2:
                    first += [(lg * lg).sum(dim=-2).reshape(-1), _local(state["row_var"]).sum().reshape(1)]
            flat = torch.cat(first)
            if group_pg is not None:
                dist.all_reduce(flat, group=group_pg)
            sums = iter(flat.split([t.numel() for t in first]))
            param_sq = [next(sums) for _ in work]
            updates = []
            for i, (p, lp, lg, state, _) in enumerate(work):
                eps1_ = torch.finfo(lp.dtype).eps if eps1 is None else eps1
                step = float(state["step"])
                rho = min(lr, 1 / step ** 0.5)
                alpha = max(eps2, float(param_sq[i]) ** 0.5 / p.numel() ** 0.5) * rho
                if wd != 0:
                    lp.mul_(1 - lr * wd)
                if lg.dim() > 1:
                    row_var, col_var = _local(state["row_var"]), _local(state["col_var"])
                    if lg.dim() == 2:
                        col_sum, row_sum = next(sums), next(sums)
                        col_var.lerp_((col_sum / p.shape[-2]).reshape(col_var.shape), c[i])
                        row_mean = row_sum / p.shape[-2]
                    else:  # dims -1 and -2 are local: only dim 0 is sharded
                        col_var.lerp_((lg * lg).sum(dim=-2, keepdim=True) / p.shape[-2], c[i])
                        row_mean = row_var.mean(dim=-2, keepdim=True)
                    var = (row_var @ col_var) / row_mean.clamp(min=eps1_)
                else:
                    variance = _local(state["variance"])
                    variance.lerp_(lg * lg, c[i])
                    var = variance.clone()
                update = var.clamp(min=eps1_ * eps1_).rsqrt_().mul_(lg)
                updates.append((lp, update, alpha))
            # (2) update norms
            upd_sq = torch.cat([u.square().sum().reshape(1) for _, u, _ in updates])
            if group_pg is not None:
                dist.all_reduce(upd_sq, group=group_pg)
            for (p, *_), (lp, update, alpha), sq in zip(work, updates, upd_sq.tolist()):
                denom = max(1.0, sq ** 0.5 / (p.numel() ** 0.5 * d))
                lp.add_(update, alpha=-alpha / denom)
        return loss


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (sharing its storage), or the tensor itself."""
    return t._local_tensor if _is_dtensor(t) else t


def _adafactor_state(p: torch.Tensor, local_p: torch.Tensor) -> dict[str, torch.Tensor]:
    """Zero state of torch's Adafactor for `p`, as DTensors sharded like `p` when it is one."""
    state: dict[str, torch.Tensor] = {"step": torch.tensor(0.0, dtype=torch.float32)}
    if p.dim() > 1:
        shapes = {"row_var": (p.shape[:-1] + (1,), local_p.shape[:-1] + (1,)),
                  "col_var": (p.shape[:-2] + (1, p.shape[-1]), local_p.shape[:-2] + (1, p.shape[-1]))}
    else:
        shapes = {"variance": (p.shape, local_p.shape)}
    for key, (global_shape, local_shape) in shapes.items():
        local = torch.zeros(local_shape, dtype=p.dtype, device=local_p.device)
        if not _is_dtensor(p):
            state[key] = local
            continue
        from torch.distributed.tensor import DTensor, Replicate, Shard

        if p.device_mesh.ndim != 1 or tuple(p.placements) != (Shard(0),):
            raise ValueError(f"ShardedAdafactor needs parameters sharded on dim 0 of a 1-D mesh, not {p.placements}")
        replicated = key == "col_var" and p.dim() == 2
        if replicated:
            local = torch.zeros(global_shape, dtype=p.dtype, device=local_p.device)
        state[key] = DTensor.from_local(local, p.device_mesh, [Replicate() if replicated else Shard(0)],
                                        run_check=False, shape=torch.Size(global_shape),
                                        stride=torch.zeros(global_shape).stride())
    return state


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes held by the optimizer's state tensors (moments, factored statistics)."""
    return sum(v.numel() * v.element_size() for state in optimizer.state.values()
               for v in state.values() if torch.is_tensor(v))


@LR_SCHEDULES.register("constant")
def constant_schedule(progress: float, min_lr_ratio: float) -> float:
    """The peak rate to the end (ARPO)."""
    return 1.0


@LR_SCHEDULES.register("cosine")
def cosine_schedule(progress: float, min_lr_ratio: float) -> float:
    """Half a cosine from the peak to `min_lr_ratio` (verl's cosine schedule with its min_lr_ratio)."""
    return min_lr_ratio + (1.0 - min_lr_ratio) * (0.5 * (1.0 + math.cos(math.pi * progress)))


@LR_SCHEDULES.register("linear")
def linear_schedule(progress: float, min_lr_ratio: float) -> float:
    """A straight line from the peak to `min_lr_ratio`."""
    return min_lr_ratio + (1.0 - min_lr_ratio) * (1.0 - progress)


def lr_factor(update: int, total_updates: int, warmup_ratio: float, schedule: str = "constant",
              min_lr_ratio: float = 0.0) -> float:
    """The learning rate of optimizer step `update` (0-based) as a share of the peak: linear
    warm-up over the first `warmup_ratio` of `total_updates` (ARPO's subset run: 5%; the first step
    already uses lr / warmup, not 0), then the registered `schedule` (`LR_SCHEDULES`: `constant`,
    as ARPO, or a `cosine` or `linear` decay) of the progress through the rest, which reaches 1
    at the last step."""
    shape = LR_SCHEDULES[schedule]  # an unknown name fails here, at step 0 too
    total = max(1, total_updates)
    warmup = math.ceil(warmup_ratio * total)
    if update < warmup:
        return (update + 1) / warmup
    return shape(min(1.0, (update - warmup) / max(1, total - warmup - 1)), min_lr_ratio)


def warmup_schedule(optimizer: torch.optim.Optimizer, total_updates: int, warmup_ratio: float,
                    schedule: str = "constant", min_lr_ratio: float = 0.0) -> torch.optim.lr_scheduler.LambdaLR:
    """torch's LambdaLR over `lr_factor` (its state is one counter, saved in every checkpoint)."""
    lr_factor(0, total_updates, warmup_ratio, schedule, min_lr_ratio)  # unknown schedule: fail here
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda u: lr_factor(u, total_updates, warmup_ratio, schedule, min_lr_ratio))


def token_budget_batches(lengths: Sequence[int], budget: int, packed: bool = False) -> list[list[int]]:
    """Indices grouped into micro-batches (longest first) whose size stays within `budget` tokens:
    rows x max(length) for padded rows, sum(length) when the micro-batch is packed into one row."""
    if budget <= 0:
        raise ValueError("token budget must be positive")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        longest = lengths[current[0]] if current else lengths[i]
        size = sum(lengths[j] for j in current) + lengths[i] if packed else (len(current) + 1) * longest
        if current and size > budget:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def padding_fraction(batches: Sequence[Sequence[int]], lengths: Sequence[int]) -> float:
    """Share of the padded tokens that are padding."""
    padded = sum(len(b) * max(lengths[i] for i in b) for b in batches if b)
    real = sum(lengths[i] for b in batches for i in b)
    return 0.0 if padded == 0 else 1.0 - real / padded


def micro_batches(items: Sequence[T], lengths: Sequence[int], token_budget: int, size: int,
                  packed: bool = False) -> list[list[T]]:
    """`items` in micro-batches: by token budget when `token_budget` > 0 (`token_budget_batches`),
    else `size` at a time in order."""
    if token_budget > 0:
        return [[items[i] for i in b] for b in token_budget_batches(lengths, token_budget, packed=packed)]
    return [list(items[i:i + size]) for i in range(0, len(items), size)]
