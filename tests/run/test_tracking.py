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


def test_only_rank_0_starts_a_tracker_and_logs(tmp_path, monkeypatch):
    """wandb (and its tables) are rank 0's: the other ranks of a distributed run never create a
    tracker, so they neither log nor read episodes for tables."""
    from arpo_lib.training import metrics as metrics_module

    made = []

    class Recording:
        def __init__(self, cfg, media=None):
            made.append(media)
            self.logged = []

        def log(self, m, step):
            self.logged.append(step)

        def finish(self):
            pass

    class Backend:
        def __init__(self, main):
            self.is_main = main

        def barrier(self):
            pass

    monkeypatch.setattr(metrics_module, "Tracker", Recording)
    cfg = _cfg(tmp_path, "offline")
    media = object()
    for main in (False, True):
        records = metrics_module.RunRecords(cfg, Backend(main), media)
        records.start(0, resume=False)
        records.log({"step": 1, "success_rate": 0.5})
        assert (records.tracker is not None) == main
    assert made == [media] and records.tracker.logged == [1]
