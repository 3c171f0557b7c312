"""The config tree: YAML files, dotted overrides, validation that names the key."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from arpo_lib.run.config import ConfigError, RunConfig, config_from_dict, field_docs, load_config, parse_overrides
from tests.conftest import served_model_overrides

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_load(path):
    cfg = load_config(path)
    assert cfg.name and cfg.env.tasks
    assert config_from_dict(cfg.to_dict()) == cfg  # round trip through a run directory


def test_overrides_are_typed_yaml_values():
    cfg = load_config("configs/smoke.yaml", ["train.lr=3e-6", "algo.replay.enabled=false",
                                               "env.tasks=[miniwob/click-test, miniwob/enter-text]", "train.steps=7"])
    assert cfg.train.lr == 3e-6 and cfg.algo.replay.enabled is False and cfg.train.steps == 7
    assert cfg.env.tasks == ["miniwob/click-test", "miniwob/enter-text"]
    assert parse_overrides({"a.b": 1}) == {"a": {"b": 1}}


@pytest.mark.parametrize("override, key", [
    (["train.lrr=1"], "train.lrr"),
    (["algo.replay.enable=false"], "algo.replay.enable"),
    (["nope=1"], "nope"),
])
def test_unknown_keys_fail_naming_the_key_and_a_suggestion(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config("configs/smoke.yaml", override)


def test_suggestion_for_typo():
    with pytest.raises(ConfigError, match="did you mean lr"):
        load_config(None, ["train.lrr=1"])


@pytest.mark.parametrize("override, key", [
    (["algo.aggregation=sum"], "algo.aggregation"),
    (["rollout.group_size=1"], "rollout.group_size"),
    (["train.updates_per_batch=100"], "train.updates_per_batch"),
    (["rollout.temperature=0"], "rollout.temperature"),
    (["train.lr=abc"], "train.lr"),
    (["train.steps=1.5"], "train.steps"),
    (["algo.replay.enabled=3"], "algo.replay.enabled"),
    (["env.tasks=[]"], "env.tasks"),
    (["name=../x"], "name"),
    (["model.coord_mode=qwen3"], "model.coord_mode"),
    (["logging.wandb=yes"], "logging.wandb"),
    (["train"], "override"),
    (["rollout.backend=vllm"], "rollout.backend"),
    (["rollout.weight_sync=sometimes"], "rollout.weight_sync"),
    (["rollout.backend=server", "rollout.server_url=http://h:1/v1", "rollout.weight_sync=restart"],
     "rollout.weight_sync"),
    (["rollout.backend=server", "rollout.weight_sync=reload"], "rollout.weight_sync"),  # hf server: no reload
    (["rollout.backend=server", "rollout.weight_sync=stream"], "rollout.weight_sync"),  # ... nor a stream
    (["rollout.backend=server", "rollout.weight_sync=stream", "serve.backend=vllm", "serve.weight_sync=true",
      "rollout.stream_backend=mpi"], "rollout.stream_backend"),
    (["rollout.constrained=true"], "rollout.constrained"),
    (["rollout.backend=server", "rollout.constrained=true", "algo.old_logprobs=behaviour"], "algo.old_logprobs"),
    (["rollout.api_key_env=sk-abc123"], "rollout.api_key_env"),
    (["rollout.backend=server", "rollout.server_url=[http://h:1/v1, http://h:1/v1]"], "rollout.server_url"),
    (["rollout.backend=server", "rollout.server_url=[h:1/v1]"], "rollout.server_url"),
    (["rollout.backend=server", "rollout.server_url=[]"], "rollout.server_url"),
    (["serve.device=tpu"], "serve.device"),
    (["env.on_setup_failure=ignore"], "env.on_setup_failure"),
    (["env.on_setup_failure=skip"], "env.on_setup_failure"),  # the smoke's MiniWoB tasks have no observed set-up
])
def test_impossible_values_fail_naming_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config("configs/smoke.yaml", override)


def test_missing_config_file():
    with pytest.raises(ConfigError, match="not found"):
        load_config("configs/none.yaml")


def test_every_field_has_a_docstring():
    docs = field_docs()

    def walk(cls, prefix=""):
        for f in dataclasses.fields(cls):
            key = prefix + f.name
            assert docs.get(key), f"{key} has no docstring"
            if dataclasses.is_dataclass(f.type) or (isinstance(f.type, str) and f.type.endswith("Config")):
                inner = getattr(cls(), f.name)
                if dataclasses.is_dataclass(inner):
                    walk(type(inner), key + ".")
    walk(RunConfig)


def test_a_removed_key_in_an_old_run_directory_is_dropped_with_a_warning():
    data = load_config("configs/smoke.yaml").to_dict()
    data["rollout"]["save_screenshots"] = True  # what run directories written before hold
    with pytest.warns(UserWarning, match="rollout.save_screenshots is no longer used"):
        cfg = config_from_dict(data)
    assert not hasattr(cfg.rollout, "save_screenshots")


def test_server_url_takes_one_url_or_a_list():
    from arpo_lib.run.config import server_urls

    one = load_config("configs/smoke.yaml", ["rollout.backend=server", "rollout.server_url=http://a:1/v1"])
    assert one.rollout.server_url == "http://a:1/v1" and server_urls(one) == ["http://a:1/v1"]
    two = load_config("configs/smoke.yaml", ["rollout.backend=server", "rollout.server_url=[http://a:1/v1, http://b:2/v1]"])
    assert server_urls(two) == ["http://a:1/v1", "http://b:2/v1"]
    assert config_from_dict(two.to_dict()) == two  # and back from a run directory
    assert server_urls(load_config("configs/smoke.yaml", [])) == []


@pytest.mark.parametrize("key, override", [
    ("agent.prompt", "agent.prompt=arpoo"),
    ("eval.protocol", "eval.protocol=osworld"),
    ("train.lr_schedule", "train.lr_schedule=cosin"),
    ("algo.adv_estimator", "algo.adv_estimator=rloo"),
    ("algo.policy_loss", "algo.policy_loss=gspo"),
    ("compare.algos", "compare.algos=[grpo, dapo]"),
])
def test_registered_names_are_checked_naming_the_key_and_the_registered_choices(key, override):
    from arpo_lib.run import registry

    known = next(r for r in (registry.PROMPTS, registry.EVAL_PROTOCOLS, registry.LR_SCHEDULES, registry.ADV_ESTIMATORS,
                             registry.POLICY_LOSSES, registry.COMPARISON_ARMS) if r.key == key)
    with pytest.raises(ConfigError) as info:
        load_config("configs/smoke.yaml", [override])
    message = str(info.value)
    assert message.startswith(f"{key}: unknown {known.kind} ")
    assert message.endswith(f"registered: {', '.join(known)}") and len(known) >= 1


def test_on_setup_failure_reaches_the_osworld_environments():
    from arpo_lib import build

    cfg = load_config("configs/osworld_sandbox.yaml", ["env.on_setup_failure=skip", "env.python=null"])
    assert cfg.env.on_setup_failure == "skip"
    seen = {}

    def fake_pool(n, opts, *args, **kwargs):
        seen.update(opts)

    import arpo_lib.envs.workers.pool as pool_module
    original = pool_module.make_pool
    pool_module.make_pool = fake_pool
    try:
        build.env_pool(cfg)
    finally:
        pool_module.make_pool = original
    assert seen["on_setup_failure"] == "skip" and seen["provider"] == "sandbox"


def test_a_response_at_the_cap_must_fit_in_the_request_timeout():
    """A runaway sample at T=1 that times out is retried with the same seed and stops the run: a
    response at the cap must fit in rollout.request_timeout_s at the stated decode rate."""
    from arpo_lib.run.config import SERVER_DECODE_TOKENS_PER_S

    message = (r"^rollout\.request_timeout_s: 120 s .* \(8192 tokens, model\.max_new_tokens\).* takes 410 s"
               r".*Raise rollout\.request_timeout_s to 410.*model\.max_new_tokens")
    with pytest.raises(ConfigError, match=message):
        load_config("configs/osworld_subset32.yaml", ["rollout.backend=server", "model.max_new_tokens=8192",
                                                      "rollout.request_timeout_s=120"])
    # the evaluation protocol's own cap counts too (osworld_uitars: 4096), eval.max_new_tokens shortens it
    with pytest.raises(ConfigError, match=r"4096 tokens, the cap of eval\.protocol osworld_uitars.*max_new_tokens"):
        load_config("configs/osworld_smoke4.yaml", ["rollout.backend=server", "rollout.request_timeout_s=120"])
    load_config("configs/osworld_smoke4.yaml", ["rollout.backend=server", "rollout.request_timeout_s=120",
                                                "eval.max_new_tokens=1024"])
    # in-process generation has no request timeout; the shipped configs hold the cap with the server too
    load_config("configs/osworld_subset32.yaml", ["rollout.backend=hf", "model.max_new_tokens=8192",
                                                  "rollout.request_timeout_s=1"])
    for path in CONFIGS:
        cfg = load_config(path, ["rollout.backend=server", *served_model_overrides(path)])
        assert cfg.rollout.request_timeout_s * SERVER_DECODE_TOKENS_PER_S >= cfg.model.max_new_tokens, path.name


def test_the_osworld_runs_do_not_write_a_7b_checkpoint_every_step():
    """A 7B full fine-tune's checkpoint is ~93 GiB; the CPU runs keep checkpointing every step."""
    for name in ("osworld_subset32.yaml", "osworld_full128.yaml"):
        cfg = load_config(f"configs/{name}")
        assert cfg.train.checkpoint_every >= 5 and cfg.train.steps // cfg.train.checkpoint_every >= 10, name
    assert load_config("configs/smoke.yaml").train.checkpoint_every == 1
    with pytest.raises(ConfigError, match=r"train\.checkpoint_every: must be >= 1"):
        load_config("configs/smoke.yaml", ["train.checkpoint_every=0"])


def test_a_section_checks_its_own_fields_when_made_not_only_in_a_whole_config():
    """Rules live beside the fields: a section made alone (or replaced) fails naming the full key."""
    import dataclasses

    from arpo_lib.run.config import RolloutConfig, ServeConfig, TrainConfig

    cfg = load_config("configs/smoke.yaml")
    with pytest.raises(ConfigError, match=r"^rollout\.mode: 'eager' is not one of \['lockstep', 'async'\]"):
        dataclasses.replace(cfg.rollout, mode="eager")
    with pytest.raises(ConfigError, match=r"^train\.warmup_ratio: must be in \[0, 1\)"):
        TrainConfig(warmup_ratio=1.0)
    with pytest.raises(ConfigError, match=r"^serve\.host: '0\.0\.0\.0' makes the server reachable"):
        ServeConfig(host="0.0.0.0")
    with pytest.raises(ConfigError, match=r"^algo\.replay\.capacity_per_task: must be >= 1, got 0"):
        load_config("configs/smoke.yaml", ["algo.replay.capacity_per_task=0"])
    assert RolloutConfig(server_url=["http://a:1/v1", "http://b:1/v1"]).server_urls() == ["http://a:1/v1", "http://b:1/v1"]


def test_closed_choices_are_literal_types_and_the_loss_reads_its_choices_from_the_config():
    import typing

    from arpo_lib.algo import AGGREGATIONS
    from arpo_lib.run.config import AlgoConfig, Aggregation

    assert AGGREGATIONS == typing.get_args(Aggregation) == ("seq-mean-token-mean", "token-mean")
    assert typing.get_type_hints(AlgoConfig)["aggregation"] is Aggregation
    with pytest.raises(ConfigError, match=r"^algo\.aggregation: 'sum' is not one of"):
        load_config("configs/smoke.yaml", ["algo.aggregation=sum"])


def test_the_optimizer_is_a_registry_a_plugin_can_add_to():
    import torch

    from arpo_lib.run.registry import OPTIMIZERS
    from arpo_lib.training.optim import make_optimizer

    with pytest.raises(ConfigError, match=r"^train\.optimizer: unknown optimizer 'lion'.*registered: adamw, adafactor"):
        load_config("configs/smoke.yaml", ["train.optimizer=lion"])
    OPTIMIZERS.register("sgd_for_test", lambda params, lr, weight_decay: torch.optim.SGD(params, lr=lr))
    try:
        assert load_config("configs/smoke.yaml", ["train.optimizer=sgd_for_test"]).train.optimizer == "sgd_for_test"
        weight = torch.nn.Parameter(torch.ones(2))
        assert isinstance(make_optimizer("sgd_for_test", [weight], 0.1, 0.0), torch.optim.SGD)
    finally:
        OPTIMIZERS._entries.pop("sgd_for_test")
