"""The command line: every command's errors are one line naming the problem, exit code 2."""
from __future__ import annotations

import yaml

from arpo_lib import cli


def test_config_prints_the_resolved_tree(capsys):
    assert cli.main(["config", "--config", "configs/smoke.yaml", "train.steps=3", "algo.replay.enabled=false"]) == 0
    tree = yaml.safe_load(capsys.readouterr().out)
    assert tree["train"]["steps"] == 3 and tree["algo"]["replay"]["enabled"] is False


def test_config_docs_list_every_key(capsys):
    assert cli.main(["config", "--docs"]) == 0
    out = capsys.readouterr().out
    assert "algo.replay.success_threshold" in out and "train.lr" in out


def test_bad_keys_and_task_names_exit_2_naming_the_key(capsys):
    assert cli.main(["config", "train.lrr=1"]) == 2
    assert "train.lrr" in capsys.readouterr().err
    assert cli.main(["train", "--config", "configs/smoke.yaml", "env.tasks=[miniwob/click-buton]"]) == 2
    assert "env.tasks" in capsys.readouterr().err
    assert cli.main(["eval", "--config", "configs/none.yaml"]) == 2
    assert "not found" in capsys.readouterr().err


def test_train_then_resume_a_run_without_steps(tmp_path, tiny_qwen2vl, capsys):
    args = ["--config", "configs/smoke.yaml", f"model.path={tiny_qwen2vl}", f"out_dir={tmp_path}", "name=c",
            "train.steps=0", "warm_start.steps=0", "warm_start.demos_per_task=0", "train.demo_replay=0",
            "logging.progress=false"]
    assert cli.main(["train", *args]) == 0
    assert (tmp_path / "c" / "config.yaml").is_file()
    assert f"run directory: {tmp_path / 'c'}" in capsys.readouterr().out
    assert cli.main(["train", *args]) == 0  # no step recorded yet: nothing to overwrite
    (tmp_path / "c" / "metrics.jsonl").write_text("")
    assert cli.main(["train", *args]) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert cli.main(["resume", "--run", str(tmp_path / "c")]) == 0
