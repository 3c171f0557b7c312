"""Moved: the loop is `arpo_lib.training.trainer.Trainer`, built with `arpo_lib.build.trainer(cfg)`.
This name stays for notebooks written before the package layout (`from arpo_lib.trainer import
Trainer; trainer = Trainer(cfg)`)."""
from __future__ import annotations

import warnings
from typing import Any


def Trainer(cfg: Any, *, resume: bool = False, policy: Any = None) -> Any:  # noqa: N802 (the old class name)
    """`arpo_lib.build.trainer(cfg, resume=..., policy=...)`."""
    from arpo_lib import build

    warnings.warn("arpo_lib.trainer.Trainer(cfg) is now arpo_lib.build.trainer(cfg)", DeprecationWarning, stacklevel=2)
    return build.trainer(cfg, resume=resume, policy=policy)
