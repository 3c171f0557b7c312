"""Experiment tracking: wandb off by default, offline mode writes a syncable run; JSONL stays the source of truth."""
from __future__ import annotations


import pytest

from arpo_lib.run.config import load_config
from arpo_lib.run.tracking import Tracker


def _cfg(tmp_path, mode):
    return load_config("configs/smoke.yaml", [f"logging.wandb={mode}", f"out_dir={tmp_path}", "name=w"])


def test_disabled_is_a_no_op_and_never_imports_wandb(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "wandb", None)  # importing it would fail
    tracker = Tracker(_cfg(tmp_path, "disabled"))
    tracker.log({"loss": 1.0}, step=1)
    tracker.finish()
    assert not (tmp_path / "w").exists()


def test_offline_run_is_written_for_later_sync(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    cfg = _cfg(tmp_path, "offline")
    cfg.run_dir.mkdir(parents=True)
    tracker = Tracker(cfg)
    for step in range(1, 4):
        tracker.log({"success_rate": step / 10, "tasks": ["a"], "loss": 0.5}, step=step)
    tracker.finish()
    runs = list((cfg.run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    assert list(runs[0].glob("*.wandb")), "the offline run file `wandb sync` uploads"
    import wandb

    wandb.teardown()  # wandb's background service would otherwise live as long as this process
