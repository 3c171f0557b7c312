"""wandb with trajectories: the episode and evaluation tables' rows from a run
directory, and an offline wandb run read back from its files: the tables, their images, the
per-task curves and the config are there; nothing is logged when disabled, and no table when
logging.wandb_episodes=0. A real training step from the smoke config ends it."""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from arpo_lib.run.config import load_config
from arpo_lib.run.tracking import Tracker, scalars
from arpo_lib.viz.tracking import TrackerMedia, episode_rows, eval_rows, sample_members
from tests.viz.test_draw_widgets import run_dir  # noqa: F401 (the fixture: a run with groups at step 3)

ARTIFACTS = Path(__import__("os").environ.get("ARPO_TEST_ARTIFACTS") or Path(__file__).resolve().parents[2]
                 / "test-artifacts")


def test_replayed_members_come_first_then_one_of_each_group_in_turn():
    a = [{"id": f"a{i}", "replayed": i == 2} for i in range(3)]
    b = [{"id": f"b{i}"} for i in range(2)]
    groups = [{"task": "A", "members": a}, {"task": "B", "members": b}]
    picked = [m["id"] for _, m in sample_members(groups, 4)]
    assert picked == ["a2", "a0", "b0", "a1"]
    assert [m["id"] for _, m in sample_members(groups, 10)] == ["a2", "a0", "b0", "a1", "b1"]
    assert sample_members(groups, 0) == []


def test_episode_rows_hold_the_last_action_drawn_on_its_screen(run_dir):  # noqa: F811
    rows = episode_rows(run_dir, 3, limit=3, image_width=100)
    assert [r["replayed"] for r in rows] == [True, False, False] and rows[0]["success"] is True
    assert [r["task"] for r in rows] == ["miniwob/test-task", "miniwob/other", "miniwob/test-task"]
    full = rows[0]  # member 0 has every step: the last is the format failure
    assert full["steps"] == 6 and full["action"].startswith("format error")
    short = next(r for r in rows[1:] if r["steps"] == 2)  # the two-step members end with the drag
    assert short["thought"] == "move the slider" and "drag" in short["action"]
    for row in rows:
        assert isinstance(row["screenshot"], Image.Image) and row["screenshot"].width <= 100
    raw = Image.open(next((run_dir / "rollouts" / "step_000003" / "t" / "1").glob("step_0.png"))).convert("RGB")
    drawn = np.asarray(short["screenshot"].resize(raw.size)).astype(int)
    assert np.abs(drawn - np.asarray(raw).astype(int)).max() > 60  # the drag is drawn on it
    assert episode_rows(run_dir, 3, limit=0) == []


def test_per_task_numbers_become_curves():
    out = scalars({"step": 2, "loss": 0.5, "tasks": ["a"], "success_by_task": {"a": [1, 4], "b": [0, 0]}})
    assert out == {"step": 2, "loss": 0.5, "success_by_task/a": 0.25}


SMOKE = Path(__file__).resolve().parents[2] / "configs" / "smoke.yaml"  # the run_dir fixture changes the cwd


def _cfg(tmp_path, *extra):
    return load_config(SMOKE, ["logging.wandb=offline", f"out_dir={tmp_path}", "name=w", *extra])


def _settled_tables(run: Path, data_dir: Path, names: set[str], timeout_s: float = 60) -> dict[str, dict]:
    """_offline_tables once it holds `names`: wandb's service process may still be writing the
    record file after finish() returns (seen twice in clean-clone runs of the suite, on a loaded
    machine: the table was not named there yet)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            tables = _offline_tables(run, data_dir)
        except (AssertionError, ValueError, StopIteration):  # a table named before its images
            tables = {}
        if names <= tables.keys():
            return tables
        time.sleep(1)
    return _offline_tables(run, data_dir)


def _offline_tables(run_dir: Path, data_dir: Path) -> dict[str, dict]:
    """The tables an offline run will upload, read back from its files: wandb logs a table as an
    artifact whose files (the table's JSON and its images) wait in WANDB_DATA_DIR's staging area,
    named in the run's record file (run-*.wandb). Returns {table name: its JSON}, after checking
    that every image it references is staged, by content, and named in the record file."""
    import hashlib

    (run,) = (run_dir / "wandb").glob("offline-run-*")
    record = next(run.glob("run-*.wandb")).read_bytes()
    staging = data_dir / "artifacts" / "staging"
    staged = {p: p.read_bytes() for p in staging.iterdir()} if staging.is_dir() else {}
    by_digest: dict[str, list[Path]] = {}
    for p, b in staged.items():
        by_digest.setdefault(hashlib.sha256(b).hexdigest(), []).append(p)
    tables = {}
    for path, raw in staged.items():
        try:
            table = json.loads(raw)
        except ValueError:
            continue
        if not isinstance(table, dict) or table.get("_type") != "table" or str(path).encode() not in record:
            continue
        for row in table["data"]:
            for cell in row:
                if isinstance(cell, dict) and cell.get("_type") == "image-file":
                    (image,) = [p for p in by_digest[cell["sha256"]] if str(p).encode() in record]
                    assert Image.open(image).width == cell["width"]
                    cell["staged"] = str(image)
        name = "episodes" if "screenshot" in table["columns"] else "eval_tasks"
        assert f"{name}.table.json".encode() in record
        tables[name] = table
    return tables


@pytest.fixture
def offline_wandb(monkeypatch, tmp_path):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    for var in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / var.lower()))
    yield tmp_path / "wandb_data_dir"
    wandb.teardown()


def test_an_offline_run_holds_the_episode_and_evaluation_tables_with_their_images(offline_wandb, run_dir,  # noqa: F811
                                                                                   tmp_path):
    cfg = _cfg(tmp_path)
    (run_dir / "eval" / "step_000004").mkdir(parents=True)
    (run_dir / "eval" / "step_000004" / "results.json").write_text(json.dumps({"tasks": [
        {"task": "miniwob/test-task", "samples": 2, "successes": 1, "success_rate": 0.5, "pass_at_k": 1.0,
         "mean_steps": 3.0, "format_error_rate": 0.0, "env_errors": 0}]}))
    tracker = Tracker(cfg, TrackerMedia(run_dir, episodes=3, image_width=120))
    tracker.log({"step": 4, "success_rate": 0.25, "success_by_task": {"miniwob/test-task": [1, 4]},
                 "eval_success_rate": 0.5}, step=4)
    tracker.finish()
    tables = _settled_tables(cfg.run_dir, offline_wandb, {"episodes", "eval_tasks"})
    table = tables["episodes"]
    assert table["columns"][:3] == ["task", "success", "task_score"] and "screenshot" in table["columns"]
    assert len(table["data"]) == 3
    shot = table["columns"].index("screenshot")
    assert all(row[shot]["_type"] == "image-file" and row[shot]["width"] <= 120 for row in table["data"])
    assert [row[table["columns"].index("replayed")] for row in table["data"]] == [True, False, False]
    assert tables["eval_tasks"]["data"][0][:3] == ["miniwob/test-task", 2, 1]
    record = next((cfg.run_dir / "wandb").glob("offline-run-*/run-*.wandb")).read_bytes()
    assert b"success_by_task/miniwob/test-task" in record and b"wandb_episodes" in record  # curves, config


def test_no_tables_when_the_bound_is_zero(offline_wandb, run_dir, tmp_path):  # noqa: F811
    cfg = _cfg(tmp_path)
    tracker = Tracker(cfg, TrackerMedia(run_dir, episodes=0))
    tracker.log({"step": 4, "success_rate": 0.25}, step=4)
    tracker.finish()
    assert _offline_tables(cfg.run_dir, offline_wandb) == {}
    assert eval_rows(run_dir, "step_000009") == []


@pytest.mark.slow
def test_a_smoke_training_step_logs_its_episodes_to_an_offline_run(offline_wandb, tiny_qwen2vl, chromium_available,
                                                                   tmp_path):
    from arpo_lib import build

    cfg = load_config("configs/smoke.yaml", [
        f"model.path={tiny_qwen2vl}", f"out_dir={tmp_path}", "name=wb", "env.tasks=[miniwob/click-test]",
        "env.workers=1", "env.max_steps=2", "rollout.group_size=2", "train.tasks_per_batch=1", "train.steps=1",
        "warm_start.steps=0", "warm_start.demos_per_task=0", "train.demo_replay=0", "train.eval_every=0",
        "logging.wandb=offline", "logging.wandb_episodes=2", "logging.progress=false"])
    with build.trainer(cfg) as trainer:
        trainer.train()
    table = _settled_tables(cfg.run_dir, offline_wandb, {"episodes"})["episodes"]
    assert len(table["data"]) == 2 and {row[0] for row in table["data"]} == {"miniwob/click-test"}
    shot = table["columns"].index("screenshot")
    assert all(row[shot]["_type"] == "image-file" for row in table["data"])
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    _picture(table).save(ARTIFACTS / "wandb_episodes.png")


def _picture(table: dict) -> Image.Image:
    """The table as read back, drawn row by row (docs/notebooks.md's picture of it; wandb's own page
    needs its server): the staged screenshot, then the other columns."""
    from PIL import ImageDraw

    cols = table["columns"]
    shots = [Image.open(row[cols.index("screenshot")]["staged"]).convert("RGB") for row in table["data"]]
    width = max(s.width for s in shots) + 520
    height = sum(max(s.height, 150) + 10 for s in shots) + 30
    out = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(out)
    draw.text((8, 8), "wandb table 'episodes' (step 1), read back from the offline run", fill="black")
    y = 30
    for row, shot in zip(table["data"], shots):
        out.paste(shot, (8, y))
        text = "\n".join(f"{c}: {str(v)[:60]}" for c, v in zip(cols, row) if c != "screenshot")
        draw.multiline_text((shot.width + 20, y), text, fill="black", spacing=3)
        y += max(shot.height, 150) + 10
    return out
