"""The composition root: task names checked before anything starts, every switch read once."""
from __future__ import annotations

import pytest

from arpo_lib import build
from arpo_lib.run.config import ConfigError, config_from_dict, load_config
from arpo_lib.serving.weight_sync import ServedPolicy


@pytest.mark.parametrize("override, key", [
    (["env.tasks=[miniwob/click-buton]"], "env.tasks"),
    (["eval.tasks=[miniwob/nope]"], "eval.tasks"),
    (["select.tasks=[nofamily/x]"], "select.tasks"),
    (["env.tasks=[miniwob]"], "env.tasks"),
])
def test_a_bad_task_name_fails_at_load_naming_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        build.load_config("configs/smoke.yaml", override)
    load_config("configs/smoke.yaml", override)  # the ground-floor parser does not know the registry


def test_a_misspelt_task_gets_a_suggestion():
    with pytest.raises(ConfigError, match="Did you mean: miniwob/click-button"):
        build.load_config("configs/smoke.yaml", ["env.tasks=[miniwob/click-buton]"])


def test_task_sets_pass_the_check_and_need_the_data_to_expand(tmp_path, monkeypatch):
    monkeypatch.setenv("ARPO_OSWORLD_TASKS", str(tmp_path / "none"))
    cfg = build.load_config("configs/smoke.yaml", ["env.tasks=[osworld/subset32]"])
    with pytest.raises(ConfigError, match="osworld-tasks fetch"):
        build.resolve_task_sets(cfg)


def test_components_check_task_names_too(tmp_path):
    """A config rebuilt from a dict (a run directory) is checked before a trainer starts anything."""
    data = load_config("configs/smoke.yaml", [f"out_dir={tmp_path}"]).to_dict()
    data["env"]["tasks"] = ["miniwob/click-buton"]
    with pytest.raises(ConfigError, match="env.tasks"):
        build.trainer(config_from_dict(data))
    assert not (tmp_path / "smoke").exists()


def test_hf_policy_reads_every_model_switch(tiny_qwen2vl):
    cfg = load_config("configs/smoke.yaml", [f"model.path={tiny_qwen2vl}", "model.kv_cache=false",
                                             "model.logprob_chunk=7", "model.history_images=4",
                                             "model.max_new_tokens=9", "model.coord_mode=qwen25vl"])
    policy = build.hf_policy(cfg)
    assert (policy.kv_cache, policy.logprob_chunk, policy.history_images, policy.max_new_tokens,
            policy.coord_mode) == (False, 7, 4, 9, "qwen25vl")


def test_the_trainer_receives_what_build_makes(tmp_path, tiny_qwen2vl):
    cfg = load_config("configs/smoke.yaml", [f"model.path={tiny_qwen2vl}", f"out_dir={tmp_path}", "name=b",
                                             "rollout.backend=server", "rollout.weight_sync=restart",
                                             "logging.progress=false"])
    with build.trainer(cfg) as trainer:
        served = trainer.rollouts.served
        assert isinstance(served, ServedPolicy) and served.server is None  # started at the first rollout
        assert trainer.evaluator is not None and trainer.rollouts._pool is None  # the pool starts when first used
        assert trainer.reference is None and (tmp_path / "b" / "config.yaml").is_file()
    with pytest.raises(FileExistsError):
        (tmp_path / "b" / "metrics.jsonl").write_text("")
        build.trainer(cfg)


def test_the_kl_reference_is_a_frozen_copy_of_the_start(tmp_path, tiny_qwen2vl):
    cfg = load_config("configs/smoke.yaml", [f"model.path={tiny_qwen2vl}", f"out_dir={tmp_path}", "name=kl",
                                             "algo.kl_coef=0.1", "logging.progress=false"])
    with build.trainer(cfg) as trainer:
        assert trainer.reference is not None and not any(p.requires_grad for p in trainer.reference.parameters())


def test_instances_per_task_makes_fixed_instances_of_the_training_tasks():
    """env.instances_per_task turns each MiniWoB training task into fixed instances (one layout
    each, like an OSWorld task); explicit instances and evaluation tasks are left as named."""
    cfg = build.load_config("configs/smoke.yaml", ["env.tasks=[miniwob/click-test, miniwob/focus-text@5]",
                                                   "env.instances_per_task=2", "eval.tasks=[miniwob/click-test]"])
    build.resolve_task_sets(cfg)
    assert cfg.env.tasks == ["miniwob/click-test@0", "miniwob/click-test@1", "miniwob/focus-text@5"]
    assert cfg.eval.tasks == ["miniwob/click-test"]  # fresh layouts: a held-out measure
    build.resolve_task_sets(cfg)  # a second pass (a derived config) expands nothing twice
    assert len(cfg.env.tasks) == 3
    with pytest.raises(ConfigError, match="env.instances_per_task"):
        build.load_config("configs/smoke.yaml", ["env.instances_per_task=-1"])
    with pytest.raises(ConfigError, match="env.tasks"):
        build.load_config("configs/smoke.yaml", ["env.tasks=[miniwob/click-test@one]"])
