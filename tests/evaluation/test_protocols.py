"""Evaluation protocols: what each one changes, and that a run reports the one it used.

The frequency penalty on the tiny model (naive generation, the KV-cache path and our server agree,
and it changes what greedy decoding says); the OSWorld fork's action rules (call_user answered
with WAIT three times, the last step's action turned into FAIL) through the rollout engine on the
fake VM; build.engine wiring each protocol's prompt, pause and rules. The rest of each protocol,
row by row against the fork's runner and ARPO's training: test_fork_transcript.py.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from arpo_lib import build
from arpo_lib.agent.hf_policy import FrequencyPenalty, HFPolicy
from arpo_lib.agent.prompt import get_prompt
from arpo_lib.evaluation.protocols import PROTOCOLS
from arpo_lib.run.config import load_config
from arpo_lib.types import SamplingParams

REPO = Path(__file__).resolve().parents[2]


def _screen(seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (112, 140, 3), dtype=np.uint8))


def test_the_protocols_say_what_their_sources_do():
    fork = PROTOCOLS["osworld_uitars"]
    assert (fork.prompt, fork.temperature, fork.frequency_penalty, fork.fail_at_last_step, fork.call_user_waits,
            fork.osworld_pause_s) == ("osworld_uitars15", 0.0, 1.0, True, 3, 1.0)
    arpo = PROTOCOLS["arpo_train"]
    assert (arpo.prompt, arpo.temperature, arpo.frequency_penalty, arpo.fail_at_last_step, arpo.call_user_waits,
            arpo.osworld_pause_s) == ("arpo", None, 0.0, False, 0, 0.5)
    run = PROTOCOLS["run"]
    assert (run.prompt, run.temperature, run.frequency_penalty, run.osworld_pause_s) == (None, None, 0.0, None)


def test_frequency_penalty_counts_only_generated_tokens():
    ids = torch.tensor([[5, 5, 7, 5, 7]])  # a prompt of 2 tokens, then 5, 7, 7... generated: [7, 5, 7]
    scores = torch.zeros(1, 10)
    out = FrequencyPenalty(1.5, prompt_width=2)(ids, scores)
    expected = torch.zeros(1, 10)
    expected[0, 7], expected[0, 5] = -3.0, -1.5
    assert torch.equal(out, expected)


@pytest.fixture(scope="module")
def policies(tiny_qwen2vl):
    naive = HFPolicy(tiny_qwen2vl, device="cpu", max_new_tokens=24, kv_cache=False)
    cached = HFPolicy(tiny_qwen2vl, device="cpu", max_new_tokens=24, kv_cache=True)
    return naive, cached


def _segments(policy, n=3):
    segs = []
    for i in range(n):
        conv = policy.new_conversation(f"Click button {i}")
        conv.add_observation(_screen(i))
        segs.append(conv.current)
    return segs


def test_penalised_greedy_decoding_agrees_across_paths_and_changes_the_answer(policies):
    naive, cached = policies
    segs = _segments(naive)
    greedy, penalised = SamplingParams(temperature=0), SamplingParams(temperature=0, frequency_penalty=1.0)
    plain = naive.generate(segs, sampling=greedy)
    a = naive.generate(segs, sampling=penalised)
    b = cached.generate(_segments(cached), sampling=penalised, cache_keys=["x", "y", "z"])
    assert [g.token_ids for g in a] == [g.token_ids for g in b]  # two implementations, one answer
    for ga, gb in zip(a, b):
        assert np.allclose(ga.logprobs, gb.logprobs, atol=1e-4)
    # a random tiny model repeats itself: the penalty must change what it says
    assert [g.token_ids for g in a] != [g.token_ids for g in plain]
    repeats = lambda gens: sum(len(g.token_ids) - len(set(g.token_ids)) for g in gens)  # noqa: E731
    assert repeats(a) < repeats(plain)


def test_penalised_sampling_logprobs_are_of_the_penalised_distribution(policies):
    naive, cached = policies
    sampling = SamplingParams(temperature=1.0, frequency_penalty=0.7)
    a = naive.generate(_segments(naive), sampling=sampling, seeds=[1, 2, 3])
    b = cached.generate(_segments(cached), sampling=sampling, seeds=[1, 2, 3], cache_keys=["p", "q", "r"])
    assert [g.token_ids for g in a] == [g.token_ids for g in b]
    for ga, gb in zip(a, b):
        assert np.allclose(ga.logprobs, gb.logprobs, atol=1e-4)


@pytest.mark.slow
def test_our_server_applies_the_penalty_as_the_in_process_policy(tiny_qwen2vl, policies, tmp_path):
    from arpo_lib.agent.client import chat_completion, ui_tars_messages
    from arpo_lib.serving.launch import start_server

    naive, _ = policies
    with start_server(tiny_qwen2vl, device="cpu", threads=1, max_new_tokens=24, served_model_name="tiny",
                      log_path=tmp_path / "server.log") as server:
        server.wait_healthy(timeout_s=60, poll_s=0.2)
        reply = chat_completion(server.base_url, ui_tars_messages("Click button 0", [_screen(0)], [],
                                                                  prompt=naive.prompt),
                                model="tiny", temperature=0, max_tokens=24, logprobs=True,
                                extra_body={"frequency_penalty": 1.0, "skip_special_tokens": False})
    (ours,) = naive.generate(_segments(naive, 1), sampling=SamplingParams(temperature=0, frequency_penalty=1.0))
    assert reply["choices"][0]["token_ids"] == ours.token_ids


def test_build_engine_wires_each_protocol(tiny_qwen2vl, tmp_path, monkeypatch):
    """The OSWorld fork's protocol: its prompt, T=0 at evaluation, frequency penalty 1, its action
    rules and a 1 s pause in every environment worker's options; ARPO's: its prompt and 0.5 s."""
    from arpo_lib.envs.osworld import tasks as ot

    monkeypatch.setenv(ot.ENV_VAR, str(tmp_path / "osworld-tasks"))
    from tests.test_osworld_pipeline import FIXTURE, FIXTURE_EXPECT

    ot.fetch_tasks(FIXTURE, expect=FIXTURE_EXPECT, progress=False)
    cfg = load_config(REPO / "configs" / "osworld_smoke4.yaml", [
        f"model.path={tiny_qwen2vl}", "model.coord_mode=auto", f"out_dir={tmp_path}", "env.workers=1",
        "env.python=null", "env.options={provider: fake, desktop_env_class: "
        "'arpo_lib.envs.osworld.fake:FakeDesktopEnv', pause_s: 0, backoff_s: 0}"])
    assert cfg.agent.prompt == "arpo" and cfg.eval.protocol == "osworld_uitars"
    for name, prompt, pause, penalty in (("osworld_uitars", "osworld_uitars15", 1.0, 1.0), ("arpo_train", "arpo", 0.5, 0.0),
                                         ("run", "arpo", 0, 0.0)):
        with build.engine(cfg, protocol=name) as engine:
            rules = engine.rules
            assert engine.policy.prompt == get_prompt(prompt)
            assert rules.frequency_penalty == penalty
            assert (rules.fail_at_last_step, rules.call_user_waits) == ((True, 3) if name == "osworld_uitars" else (False, 0))
            assert (rules.action_rules, rules.max_new_tokens, rules.parse_attempts, rules.unfinished_on_error) == \
                {"osworld_uitars": ("arpo", 4096, 3, True), "arpo_train": ("arpo", None, 1, False),
                 "run": ("workbench", None, 1, False)}[name]
            assert rules == PROTOCOLS[name].rollout_rules()
            assert all(w.env_options["pause_s"] == pause for w in engine.pool.workers)
    assert cfg.env.options["pause_s"] == 0  # the caller's config is not changed
    # eval.max_new_tokens shortens a protocol's own cap (a tiny model on the CPU), and only that
    assert build.response_cap(cfg, PROTOCOLS["osworld_uitars"]) == 4096
    short = load_config(REPO / "configs" / "osworld_smoke4.yaml", ["eval.max_new_tokens=16"])
    assert build.response_cap(short, PROTOCOLS["osworld_uitars"]) == 16
    assert build.response_cap(short, PROTOCOLS["run"]) is None  # model.max_new_tokens


@pytest.mark.slow
def test_the_forks_action_rules_on_the_fake_vm(tmp_path, monkeypatch, tiny_qwen2vl):
    """call_user is answered with WAIT three times and then FAIL; a click on the last allowed
    step becomes FAIL; without the rules (training), neither happens."""
    from arpo_lib.agent import scripted
    from arpo_lib.envs.osworld import tasks as ot
    from arpo_lib.envs.workers.pool import EnvPool
    from arpo_lib.evaluation.rules import ProtocolRules
    from arpo_lib.rollout.engine import RolloutEngine
    from arpo_lib.types import EpisodeRequest
    from tests.test_osworld_pipeline import FIXTURE, FIXTURE_EXPECT

    monkeypatch.setenv(ot.ENV_VAR, str(tmp_path / "osworld-tasks"))
    monkeypatch.setenv("ARPO_OSWORLD_DOWNLOADS", str(tmp_path / "downloads"))
    ot.fetch_tasks(FIXTURE, expect=FIXTURE_EXPECT, progress=False)
    task = ot.task_set("smoke4")[0]
    say = {"text": ""}
    monkeypatch.setattr(scripted, "scripted_response", lambda *a, **k: say["text"])
    policy = scripted.ScriptedPolicy(HFPolicy(tiny_qwen2vl, device="cpu", coord_mode="qwen25vl", max_new_tokens=8))
    opts = {"provider": "fake", "desktop_env_class": "arpo_lib.envs.osworld.fake:FakeDesktopEnv",
            "screen_size": [448, 252], "pause_s": 0, "backoff_s": 0, "max_steps": 5}

    def kinds(engine, text):
        say["text"] = text
        (traj,) = engine.run([EpisodeRequest(task, 1, 0)], progress=False)
        return [[a["kind"] for a in s.actions] for s in traj.steps]

    with EnvPool(1, opts, timeout_s=60) as pool:
        fork = RolloutEngine(policy, pool, max_steps=5, rules=ProtocolRules(fail_at_last_step=True, call_user_waits=3))
        assert kinds(fork, "Thought: I need help.\nAction: call_user()") == [["wait"]] * 3 + [["call_user"]]
        assert kinds(fork, "Thought: go.\nAction: click(start_box='(100,100)')") == [["click"]] * 4 + [["call_user"]]
        assert kinds(fork, "Thought: hold on.\nAction: wait()") == [["wait"]] * 5  # WAIT stays WAIT
        training = RolloutEngine(policy, pool, max_steps=5)
        assert kinds(training, "Thought: I need help.\nAction: call_user()") == [["call_user"]]
        assert kinds(training, "Thought: go.\nAction: click(start_box='(100,100)')") == [["click"]] * 5


@pytest.mark.slow
def test_every_result_names_its_protocol(tmp_path, tiny_qwen2vl, chromium_available):
    from arpo_lib.evaluation.evaluate import evaluate_run

    cfg = load_config(None, [f"model.path={tiny_qwen2vl}", f"out_dir={tmp_path}", "env.tasks=[miniwob/click-test]",
                             "eval.samples_per_task=1", "env.workers=1", "logging.progress=false",
                             "eval.protocol=arpo_train"])
    with build.engine(cfg, protocol=cfg.eval.protocol) as engine:
        result = evaluate_run(engine, cfg, tmp_path / "eval")
    assert result.protocol == "arpo_train" and result.table().startswith("protocol: arpo_train")
    assert json.loads((tmp_path / "eval" / "results.json").read_text())["protocol"] == "arpo_train"
