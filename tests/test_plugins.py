"""A plug-in from outside arpo_lib (tests/plugins/example_plugin.py) adds an environment family, a
policy loss, an advantage estimator, a prompt and an evaluation protocol; a run that names it
in its config uses every one, through the real command line, without an edit to arpo_lib."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.plugins import example_plugin

REPO = Path(__file__).resolve().parents[1]
PLUGIN = "tests.plugins.example_plugin"


def _workbench(*args: str, log: Path) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "arpo_lib", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=900, env={**os.environ, example_plugin.LOG_VAR: str(log)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def _calls(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.is_file() else []


def test_a_run_naming_the_plugin_trains_and_evaluates_with_everything_it_registers(tmp_path, tiny_qwen2vl):
    from transformers import AutoTokenizer

    log = tmp_path / "plugin.jsonl"
    run = tmp_path / "plug"
    _workbench("train", "--config", "configs/smoke.yaml", f"plugins=[{PLUGIN}]", f"model.path={tiny_qwen2vl}",
               f"out_dir={tmp_path}", "name=plug", "env.tasks=[example/click-box]", "env.options={}",
               "env.workers=1", "env.max_steps=2", "agent.prompt=example_terse",
               "algo.adv_estimator=example_centered", "algo.policy_loss=example_reinforce",
               "train.steps=1", "train.tasks_per_batch=1", "train.updates_per_batch=1", "rollout.group_size=2",
               "warm_start.steps=0", "warm_start.demos_per_task=0", "train.demo_replay=1", "train.eval_every=0",
               "logging.progress=false", log=log)
    trained = _calls(log)
    me = {c["pid"] for c in trained if c["what"] == "loss"}
    assert [c for c in trained if c["what"] == "advantages"], "the plug-in's advantage estimator was not called"
    assert me, "the plug-in's policy loss was not called"
    made = {c["pid"] for c in trained if c["what"] == "make"}
    assert made and not made & me, "the plug-in's environments are made in the worker processes"

    # the scripted demonstration for the replay buffer came from the family's demonstrator
    demos = [json.loads(p.read_text()) for p in (run / "demos").rglob("meta.json")]
    assert demos and all(d["task"] == "example/click-box" and d["task_score"] == 1.0 for d in demos)

    # the rollouts' conversations hold the plug-in's prompt (decoded from the stored token ids)
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen2vl)
    stored = sorted((run / "rollouts").rglob("tokens.pt"))
    assert stored
    text = tokenizer.decode(torch.load(stored[0])[0]["input_ids"])
    assert example_plugin.PROMPT_MARK in text and "Click the red box." in text

    # an evaluation under the plug-in's protocol, from the run's saved config (which names the plug-in)
    out = tmp_path / "eval"
    _workbench("eval", "--config", str(run / "config.yaml"), "--out", str(out), "eval.protocol=example_protocol",
               "eval.samples_per_task=1", "eval.osworld_results=false", log=log)
    results = json.loads((out / "results.json").read_text())
    assert results["protocol"] == "example_protocol"
    assert set(results["per_domain"]) == {"boxes"}  # the family's own domains
    evaluated = sorted(out.rglob("tokens.pt"))
    assert evaluated and example_plugin.PROMPT_MARK in tokenizer.decode(torch.load(evaluated[0])[0]["input_ids"])


def test_a_run_without_the_plugin_does_not_know_its_names():
    from arpo_lib.run.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"plugins: plug-in 'tests\.plugins\.nope' cannot be imported"):
        load_config(None, ["plugins=[tests.plugins.nope]"])
    code = ("from arpo_lib.run.config import load_config; "
            "load_config(None, ['algo.policy_loss=example_reinforce'])")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert done.returncode != 0 and "algo.policy_loss: unknown policy loss 'example_reinforce'" in done.stderr
