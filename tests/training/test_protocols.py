"""The training contracts of `arpo_lib.types` hold for what implements them: both trainers are a
`RunTrainer` (what a notebook holds), `HFPolicy` a `TrainablePolicy`, the served weights a
`ServedWeights` (a `FollowingWeights` on the other ranks) -- by members (runtime_checkable
isinstance) and by signature (every call the protocol allows, the implementation accepts)."""
from __future__ import annotations

import inspect
from typing import Any, Callable, Protocol

import pytest

from arpo_lib import build
from arpo_lib.run.config import load_config
from arpo_lib.serving.weight_sync import FollowingServed, ServedPolicy
from arpo_lib.training.launch import LaunchedTrainer
from arpo_lib.training.trainer import Trainer
from arpo_lib.types import Policy
from arpo_lib.training.contracts import FollowingWeights, RunTrainer, ServedWeights, TrainablePolicy

CALLABLE_DUNDERS = ("__call__", "__enter__", "__exit__")


def protocol_methods(protocol: type) -> dict[str, Callable[..., Any]]:
    """The methods a protocol declares (its own and its protocol bases')."""
    methods: dict[str, Callable[..., Any]] = {}
    for base in reversed(protocol.__mro__):
        if base is Protocol or not getattr(base, "_is_protocol", False):
            continue
        for name, value in vars(base).items():
            if inspect.isfunction(value) and (not name.startswith("_") or name in CALLABLE_DUNDERS):
                methods[name] = value
    return methods


def signature_problems(implementation: type, protocol: type) -> list[str]:
    """How `implementation`'s methods fail to accept the calls `protocol`'s allow (empty: none)."""
    problems = []
    for name, declared in protocol_methods(protocol).items():
        actual = getattr(implementation, name, None)
        if not callable(actual):
            problems.append(f"{name}: missing")
            continue
        want = list(inspect.signature(declared).parameters.values())[1:]  # without self
        have = list(inspect.signature(actual).parameters.values())[1:]
        by_name = {p.name: p for p in have}
        var_positional = any(p.kind is p.VAR_POSITIONAL for p in have)
        var_keyword = any(p.kind is p.VAR_KEYWORD for p in have)
        for i, p in enumerate(want):
            if p.kind is p.VAR_POSITIONAL:
                if not var_positional:
                    problems.append(f"{name}: takes no *{p.name}")
                continue
            if p.kind is p.VAR_KEYWORD:
                if not var_keyword:
                    problems.append(f"{name}: takes no **{p.name}")
                continue
            q = by_name.get(p.name)
            if q is None:
                if not (p.kind is p.KEYWORD_ONLY and var_keyword):
                    problems.append(f"{name}: no parameter {p.name!r}")
                continue
            if p.kind is p.POSITIONAL_OR_KEYWORD and (q.kind is not q.POSITIONAL_OR_KEYWORD or have.index(q) != i):
                problems.append(f"{name}: {p.name!r} is not positional argument {i}")
            if p.kind is p.KEYWORD_ONLY and q.kind not in (q.POSITIONAL_OR_KEYWORD, q.KEYWORD_ONLY):
                problems.append(f"{name}: {p.name!r} cannot be passed by keyword")
            if p.default is not p.empty and q.default is q.empty:
                problems.append(f"{name}: {p.name!r} is optional in the protocol, required here")
        declared_names = {p.name for p in want}
        for q in have:
            if q.name not in declared_names and q.default is q.empty and q.kind not in (q.VAR_POSITIONAL,
                                                                                         q.VAR_KEYWORD):
                problems.append(f"{name}: requires {q.name!r}, which the protocol does not pass")
    return problems


def _cfg(tmp_path, model, *overrides):
    return load_config("configs/smoke.yaml", [f"model.path={model}", f"out_dir={tmp_path}", "name=p",
                                              "logging.progress=false", *overrides])


def test_both_trainers_are_run_trainers(tmp_path, tiny_qwen2vl):
    cfg = _cfg(tmp_path, tiny_qwen2vl)
    launched = LaunchedTrainer(cfg, 2)
    assert isinstance(launched, RunTrainer)
    with build.trainer(cfg) as trainer:
        assert isinstance(trainer, RunTrainer)
    for implementation in (Trainer, LaunchedTrainer):
        assert signature_problems(implementation, RunTrainer) == [], implementation.__name__


def test_a_trainer_that_breaks_the_contract_is_caught():
    class NoWarmStart:
        cfg = run = run_dir = step = replay = None

        def train(self, *, on_step=None): ...
        def close(self): ...
        def __enter__(self): ...
        def __exit__(self, *exc): ...

    class PositionalSteps(NoWarmStart):
        def warm_start(self): ...
        def train(self, on_step_and_more, *, echo=True): ...  # on_step renamed, and required

    assert not isinstance(NoWarmStart(), RunTrainer)
    assert signature_problems(NoWarmStart, RunTrainer) == ["warm_start: missing"]
    assert isinstance(PositionalSteps(), RunTrainer)  # the members are there ...
    assert signature_problems(PositionalSteps, RunTrainer) == [  # ... but not the calls
        "train: no parameter 'on_step'", "train: requires 'on_step_and_more', which the protocol does not pass"]


def test_the_policy_a_trainer_updates_is_a_trainable_policy(tmp_path, tiny_qwen2vl):
    from arpo_lib.agent.hf_policy import HFPolicy

    class ActsOnly:  # a Policy without the training side, as a server's client
        coord_mode = "qwen2vl"

        def new_conversation(self, instruction): ...
        def generate(self, segments, **sampling): ...
        def parse(self, text, image_size, rules="workbench"): ...
        def release(self, key): ...

    policy = build.hf_policy(_cfg(tmp_path, tiny_qwen2vl))
    assert isinstance(policy, TrainablePolicy)
    assert signature_problems(HFPolicy, TrainablePolicy) == []
    assert isinstance(ActsOnly(), Policy) and not isinstance(ActsOnly(), TrainablePolicy)


def test_served_weights_lead_on_rank_0_and_follow_elsewhere():
    served = ServedPolicy(connect=lambda url: None, save_weights=lambda: "", sync="none", url="http://h:1/v1")
    following = FollowingServed(connect=lambda url: None)
    assert isinstance(served, ServedWeights) and not isinstance(served, FollowingWeights)
    assert isinstance(following, FollowingWeights)
    assert served.urls is None and following.urls is None  # nothing connected yet
    assert signature_problems(ServedPolicy, ServedWeights) == []
    assert signature_problems(FollowingServed, FollowingWeights) == []


@pytest.mark.parametrize("name", ["policy", "rollouts", "backend", "sft", "records", "checkpoints", "evaluator",
                                  "reference"])
def test_the_trainers_collaborators_are_typed(name):
    annotation = inspect.signature(Trainer.__init__).parameters[name].annotation
    assert annotation is not inspect.Parameter.empty and "Any" not in str(annotation), annotation
