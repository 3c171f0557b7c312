"""GPUs by name: the memory each reports to torch (`torch.cuda.get_device_properties(0).total_memory`,
approximately: a card sold as 40 GB shows ~39.6 GiB), its dense bf16 tensor throughput and its
memory bandwidth (vendor figures). `./workbench plan --gpu-memory A100-40GB` plans against the
memory; scripts/gpu_recipes.py scales the H100's measured times by the other two."""
from __future__ import annotations

from dataclasses import dataclass

GIB = 2 ** 30


@dataclass(frozen=True)
class Card:
    name: str
    gib: float
    """Memory the card reports to torch, GiB (approximate)."""
    bf16_tflops: float
    """Dense bf16 tensor throughput (vendor figure)."""
    bandwidth_tbs: float
    """Memory bandwidth, TB/s (vendor figure)."""

    @property
    def bytes(self) -> float:
        return self.gib * GIB


CARDS = {card.name: card for card in (
    Card("H200", 139.8, 989, 4.8),
    Card("H100-80GB", 79.1, 989, 3.35),
    Card("A100-80GB", 79.1, 312, 2.04),
    Card("A100-40GB", 39.6, 312, 1.56),
    Card("L40S", 44.4, 362, 0.86),
    Card("A10G", 22.3, 125, 0.60),
    Card("L4", 22.0, 121, 0.30),
    Card("RTX4090", 23.6, 165, 1.01),
    Card("RTX3090", 23.6, 71, 0.94),
    Card("T4", 14.6, 65, 0.32),
)}


def find(name: str) -> Card | None:
    """The card called `name` (case and '-'/'_'/' ' ignored: 'a100-40gb', 'A100_40GB'), else None."""
    key = name.strip().lower().replace("_", "-").replace(" ", "-")
    return next((card for card in CARDS.values() if card.name.lower() == key), None)
