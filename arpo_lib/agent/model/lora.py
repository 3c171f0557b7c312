"""Memory switches for the policy update: LoRA adapters (peft) and low-memory optimizers.

Where a 7B full fine-tune's memory goes (fp32 master weights, as the trainer keeps): weights 28 GB,
gradients 28 GB, AdamW's two moments 56 GB -- 112 GB before one activation. The two ways down:

- LoRA (`model.lora_rank > 0`): the base weights are frozen; only low-rank adapters on the attention
  and MLP projections of the language model train, so gradients and optimizer state shrink to the
  adapters' size (~0.5% of the parameters at rank 16). Saved checkpoints hold the merged weights
  (loadable by vLLM or any HF code) and the adapter itself (what resume loads).
- Frozen weights in the compute dtype (`model.frozen_weights_dtype: auto`): with LoRA the base
  weights never change, and autocast casts every Linear weight to bf16 before its matmul anyway,
  so the frozen Linear weights are stored in bf16 at no change in any output (tested): 7B's base
  drops from 33 to ~18 GB. Embeddings and norms stay fp32 (they set the residual stream's dtype).
- Adafactor (`train.optimizer: adafactor`, torch.optim.Adafactor; on FSDP2 shards
  `training.optim.ShardedAdafactor`): factored second moments and no first moment, so optimizer
  state is ~O(rows + cols) per matrix instead of 2 x params.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The language model's projections. The vision tower's fused `qkv` and its merger stay frozen."""
ADAPTER = "default"


def apply_lora(model: Any, rank: int, alpha: float, dropout: float = 0.0,
               targets: Iterable[str] = LORA_TARGETS, seed: int = 0) -> Any:
    """Wrap the language model's projections in LoRA adapters, in place; returns the PeftModel.

    `model` keeps working as before (peft swaps the target modules inside it); only adapter
    parameters require grad afterwards. The adapters' random init depends only on `seed` (not on
    the global generator's state), so a run and its resume start from the same adapters.
    """
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as exc:  # pragma: no cover - peft is a declared dependency
        raise ImportError("LoRA needs peft: pip install peft (scripts/setup.sh installs it)") from exc

    # Regex over module names: only the language model's projections (Qwen-VL names them
    # model.language_model.layers.N.{self_attn,mlp}.X), never the vision tower's.
    pattern = r".*language_model.*\.(" + "|".join(targets) + r")$"
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=pattern, bias="none")
    with torch.random.fork_rng(devices=[model.device] if model.device.type == "cuda" else []):
        torch.manual_seed(seed)
        return get_peft_model(model, config)


def cast_frozen_linears(model: Any, dtype: torch.dtype) -> int:
    """Store every frozen nn.Linear (weights not trained: LoRA base layers, vision tower, LM head)
    in `dtype`; returns the bytes saved. Only sound when the forward runs under autocast to that
    dtype, which casts those weights to it anyway."""
    saved = 0
    # A tied LM head shares its weight with the input embedding, which must stay fp32.
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    for module in model.modules():
        if (isinstance(module, torch.nn.Linear) and not module.weight.requires_grad
                and module.weight.dtype != dtype and id(module.weight) not in embeddings):
            before = sum(p.numel() * p.element_size() for p in module.parameters(recurse=False))
            module.to(dtype)
            saved += before - sum(p.numel() * p.element_size() for p in module.parameters(recurse=False))
    return saved


def _merged(layer: Any) -> torch.Tensor:
    """One LoRA layer's weight with its delta folded in, on the layer's device. In fp32 whatever
    the stored base dtype: a bf16 sum would round small updates away."""
    with torch.no_grad():
        return layer.get_base_layer().weight.float() + layer.get_delta_weight(ADAPTER).float()


def merged_state_dict(model: Any, host: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """The model's weights with every LoRA delta folded in, under the base model's own names:
    what `save_pretrained` of an un-adapted model would write. Weights are not modified. Each
    merged weight is made on the model's device and moved to `host` before the next is made: on a
    GPU one fp32 merged weight exists at a time (all of them at once: ~26 GB at 7B, at every
    checkpoint); the merged weights live in host memory, where the save writes them from."""
    from peft.tuners.lora import LoraLayer

    state = {}
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            base = module.get_base_layer()
            state[f"{name}.weight"] = _merged(module).to(host, copy=True)
            if getattr(base, "bias", None) is not None:
                state[f"{name}.bias"] = base.bias.detach()
    for key, value in model.state_dict().items():
        if "lora_" in key or ".base_layer." in key:
            continue
        state.setdefault(key, value)
    return state


class MergedWeight:
    """A LoRA layer's weight with its delta folded in, computed only when asked for: it has the
    shape, dtype and `full_tensor()` of an FSDP2 shard, which `agent.model.shards.full_tensors`
    materialises one at a time, so a push holds one merged weight at once, never all of them."""

    def __init__(self, layer: Any):
        self.layer = layer
        self.shape = layer.get_base_layer().weight.shape
        self.dtype = torch.float32  # the merge's dtype (see merged_state_dict)

    def full_tensor(self) -> torch.Tensor:
        return _merged(self.layer)


def merged_weights(model: Any) -> list[tuple[str, Any]]:
    """(name, tensor) of the model's parameters, in module order, tied ones once, under the base
    model's names (the `merged_state_dict` names, which a server's loader accepts, unlike peft's
    `base_layer` and `lora_A`): a LoRA layer's weight as a `MergedWeight`, merged when read."""
    from peft.tuners.lora import LoraLayer

    layers = {name: module for name, module in model.named_modules() if isinstance(module, LoraLayer)}
    out: list[tuple[str, Any]] = []
    for name, param in model.named_parameters():
        if "lora_" in name:
            continue
        owner, _, leaf = name.rpartition(".")
        layer = owner.removesuffix(".base_layer")
        if layer != owner and layer in layers:
            out.append((f"{layer}.{leaf}", MergedWeight(layers[layer]) if leaf == "weight" else param))
        else:
            out.append((name, param))
    return out


def adapter_state_dict(peft_model: Any) -> dict[str, torch.Tensor]:
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(peft_model, adapter_name=ADAPTER)


def load_adapter_state_dict(peft_model: Any, state: dict[str, torch.Tensor]) -> None:
    from peft import set_peft_model_state_dict

    result = set_peft_model_state_dict(peft_model, state, adapter_name=ADAPTER)
    unexpected = getattr(result, "unexpected_keys", [])
    if unexpected:
        raise ValueError(f"adapter checkpoint does not fit this model: unexpected keys {unexpected[:3]}")
