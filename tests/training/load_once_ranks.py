"""Run under torchrun by tests/training/test_distributed.py: `build.trainer` on gloo ranks, with a
spy on every read of a checkpoint's weights (`from_pretrained`). Each rank writes OUT/rank<r>.json:
how many times it read weights, and a digest of its policy's and its KL reference's parameters
and buffers (the buffers no checkpoint holds included: the rotary embeddings' `inv_freq`)."""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForImageTextToText

from arpo_lib import build

READS: list[str] = []


def _spy() -> None:
    real = AutoModelForImageTextToText.from_pretrained.__func__

    def counted(cls, path, *args, **kwargs):
        READS.append(str(path))
        return real(cls, path, *args, **kwargs)

    AutoModelForImageTextToText.from_pretrained = classmethod(counted)


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        h.update(name.encode())
        h.update(tensor.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()


def main(out: str, config: str, *overrides: str) -> None:
    _spy()
    cfg = build.load_config(config, list(overrides))
    with build.trainer(cfg) as trainer:
        rank = trainer.backend.ranks.rank
        found = {"reads": READS, "policy": digest(trainer.policy.model), "reference": digest(trainer.reference)}
        (Path(out) / f"rank{rank}.json").write_text(json.dumps(found))


if __name__ == "__main__":
    main(*sys.argv[1:])
