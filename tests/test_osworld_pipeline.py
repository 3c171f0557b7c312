"""The OSWorld path end to end without Docker: the evaluation and subset-training notebooks run
on `configs/osworld_smoke4.yaml` by parameters only, with OSWorld-format task data fetched from
our fixture and `FakeDesktopEnv` standing in for the VM (same API as desktop_env's DesktopEnv).

What a user with Docker + KVM changes: nothing but the model path (and dropping the two
fake-specific overrides)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from arpo_lib.envs.osworld import tasks as ot

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
FIXTURE = REPO / "test_data" / "osworld"
FIXTURE_EXPECT = ot.Expectations(
    lists={ot.TRAIN_LIST: {"chrome": 3, "libreoffice_calc": 1, "os": 3}, ot.TEST_ALL_LIST: 8},
    set_sizes={"train128": 7, "test_all": 8, "subset32": 6, "smoke4": 4, "chrome10": 3},
)
FAKE_VM = ["env.options={provider: fake, desktop_env_class: 'arpo_lib.envs.osworld.fake:FakeDesktopEnv', "
           "screen_size: [448, 252], pause_s: 0, backoff_s: 0}", "env.python=null"]


@pytest.fixture()
def task_data(tmp_path, monkeypatch):
    monkeypatch.setenv(ot.ENV_VAR, str(tmp_path / "osworld-tasks"))  # inherited by the workers
    monkeypatch.setenv("ARPO_OSWORLD_DOWNLOADS", str(tmp_path / "downloads"))
    ot.fetch_tasks(FIXTURE, expect=FIXTURE_EXPECT, progress=False)
    return ot.task_set("smoke4")


def _run(notebook: str, tmp_path: Path, tiny: Path, extra: list[str]) -> str:
    from arpo_lib.workflows import execute_notebook

    overrides = [f"model.path={tiny}", "model.coord_mode=auto", "model.max_new_tokens=16", "eval.max_new_tokens=16",
                 f"out_dir={tmp_path}", "logging.progress=false", "env.workers=2", *FAKE_VM, *extra]
    out = execute_notebook(f"notebooks/{notebook}.ipynb",
                           {"config": "configs/osworld_smoke4.yaml", "overrides": overrides},
                           run_name=notebook.replace("_", "-"), out_dir=tmp_path)
    nb = json.loads(out.read_text())
    errors = [o for c in nb["cells"] for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, errors[0].get("evalue") if errors else None
    return "".join("".join(o.get("text", "")) for c in nb["cells"] for o in c.get("outputs", []))


def test_evaluation_notebook_on_osworld_tasks(task_data, tmp_path, tiny_qwen2vl):
    text = _run("evaluation", tmp_path, tiny_qwen2vl, ["select.enabled=true", "select.k=2"])
    assert "per domain" in text and "task selection: kept" in text
    run = tmp_path / "evaluation"
    results = json.loads((run / "eval" / "results.json").read_text())
    assert results["episodes"] == 4 and results["env_errors"] == 0
    assert results["protocol"] == "osworld_uitars"  # the config's: comparable with the fork's UI-TARS numbers
    assert results["desktop_env"]["source"] == "fake"  # no checkers of OSWorld's scored this: said so
    assert results["max_new_tokens"] == 16  # ... except for the cap, shortened for the tiny model, and said so
    assert set(results["per_domain"]) == {"chrome", "os"}  # OSWorld's domains, from the task data
    # the OSWorld fork's layout: trial 0, one example directory per task with result.txt
    model_dir = run / "eval" / "osworld_results" / "pyautogui" / "screenshot" / tiny_qwen2vl.name
    examples = sorted(p.parent for p in model_dir.glob("0/*/*/result.txt"))
    assert sorted(f"osworld/{p.name}" for p in examples) == sorted(task_data)
    assert {p.parent.name for p in examples} == {"chrome", "os"}
    summary = json.loads((run / "eval" / "osworld_results" / f"summary-{tiny_qwen2vl.name}.json").read_text())
    assert summary["trials"]["0"]["examples"] == 4
    selection = json.loads((run / "selection" / "selection.json").read_text())
    assert [t["samples"] for t in selection["tasks"]] == [2, 2, 2, 2]


def test_subset_training_notebook_on_osworld_tasks(task_data, tmp_path, tiny_qwen2vl):
    text = _run("subset_training", tmp_path, tiny_qwen2vl,
                ["train.steps=1", "rollout.group_size=2", "eval.samples_per_task=1", "train.eval_every=1"])
    assert "steps: 1 / 1" in text
    run = tmp_path / "subset-training"
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 1 and metrics[0]["env_errors"] == 0
    # the saved config holds the expanded task list (reproducible without the set's rule)
    import yaml

    assert sorted(yaml.safe_load((run / "config.yaml").read_text())["env"]["tasks"]) == sorted(task_data)


@pytest.mark.parametrize("fault, said", [({"die_at_step": 2}, ("VM", "ConnectionError")),
                                         ({"blank_at_step": 2}, ("the screen is one colour, rgb(0, 0, 0)",))],
                         ids=["dies", "blanks"])
def test_a_vm_dying_mid_episode_is_an_infrastructure_failure_and_rollouts_go_on(tmp_path, monkeypatch,
                                                                                 tiny_qwen2vl, fault, said):
    """One task's VM dies (or its screen goes black, as a blanked or locked VM screen does) at its
    2nd step every time: its episodes are env_error, with the reason in their record (excluded
    from groups, statistics and the replay buffer, never scored 0 as the model's), the worker's VM
    is rebuilt, the other tasks run."""
    import shutil

    from arpo_lib.agent import scripted
    from arpo_lib.envs.workers.pool import EnvPool
    from arpo_lib.evaluation.evaluate import summarize
    from arpo_lib.agent.hf_policy import HFPolicy
    from arpo_lib.rollout.engine import RolloutEngine
    from arpo_lib.types import EpisodeRequest

    tree = tmp_path / "checkout"
    shutil.copytree(FIXTURE / "evaluation_examples", tree / "evaluation_examples")
    dying = "9edf2168-773d-465e-8f86-3491baf41e09"  # an os task of smoke4
    path = tree / "evaluation_examples" / "examples" / "os" / f"{dying}.json"
    task = json.loads(path.read_text())
    task["fake"] = fault
    path.write_text(json.dumps(task))
    monkeypatch.setenv(ot.ENV_VAR, str(tmp_path / "osworld-tasks"))
    ot.fetch_tasks(tree, expect=FIXTURE_EXPECT, progress=False)
    tasks = ot.task_set("smoke4")
    # every response clicks twice, then says finished: 3 steps per episode
    monkeypatch.setattr(scripted, "scripted_response", lambda task, instruction, info, step, *a, **k:
                        "Thought: go.\nAction: click(start_box='(100,100)')" if step < 2 else
                        "Thought: done.\nAction: finished(content='ok')")
    policy = scripted.ScriptedPolicy(HFPolicy(tiny_qwen2vl, device="cpu", coord_mode="qwen25vl", max_new_tokens=8))
    opts = {"provider": "fake", "desktop_env_class": "arpo_lib.envs.osworld_fake:FakeDesktopEnv",
            "screen_size": [448, 252], "pause_s": 0, "backoff_s": 0, "max_steps": 5}
    with EnvPool(2, opts, timeout_s=60) as pool:
        engine = RolloutEngine(policy, pool, max_steps=5)
        requests = [EpisodeRequest(t, 7 + i, i) for t in tasks for i in range(2)]
        trajs = engine.run(requests, progress=False, out_dir=tmp_path / "out")
    by_task = {t: [x for x in trajs if x.task == t] for t in tasks}
    for t, xs in by_task.items():
        if t == f"osworld/{dying}":
            assert [x.status for x in xs] == ["env_error", "env_error"]
            assert all(any(part in x.error for part in said) for x in xs), [x.error for x in xs]
        else:
            assert [x.status for x in xs] == ["ok", "ok"] and all(x.num_steps == 3 for x in xs)
    lost = [m for m in (json.loads(p.read_text()) for p in (tmp_path / "out").rglob("meta.json"))
            if m["status"] == "env_error"]
    assert len(lost) == 2 and all(any(part in m["error"] for part in said) for m in lost)  # in the episode's record
    result = summarize(trajs)
    assert result.env_errors == 2 and result.episodes == 8
    assert sum(r.samples for r in result.tasks) == 6  # the lost episodes count nowhere
