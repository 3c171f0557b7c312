"""The `osworld_uitars` and `arpo_train` protocols against a transcript of what the OSWorld fork's
evaluation runner and ARPO's training rollouts do (test_data/protocols/fork_runner_transcript.yaml,
written from their code, each row naming the file and function it comes from).

Each row's model responses go through our rollout engine, under the row's protocol, to the fake VM
(OSWorldEnv driving FakeDesktopEnv in this process): what was sampled and how, what DesktopEnv.step
received, whether result.txt was written and with which score, and the episode's status must be
what the transcript says. A scripted text policy stands in for the model (no weights, no browser).
"""
from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from arpo_lib.actions import parse_response
from arpo_lib.envs.osworld.env import OSWorldEnv
from arpo_lib.envs.osworld.fake import FakeDesktopEnv, load_fake_task
from arpo_lib.envs.workers.worker import step_actions
from arpo_lib.evaluation.protocols import PROTOCOLS
from arpo_lib.rollout.engine import RolloutEngine
from arpo_lib.rollout.store import read_trajectory
from arpo_lib.types import EpisodeRequest, Generation, SamplingParams

TRANSCRIPT = yaml.safe_load((Path(__file__).resolve().parents[2] / "test_data" / "protocols"
                             / "fork_runner_transcript.yaml").read_text())
EVAL_TEMPERATURE = 0.5
"""eval.temperature where a protocol takes the run's (ARPO validates at 0.5)."""
POINTER_CALLS = ("click", "doubleClick", "rightClick", "moveTo", "dragTo")


class _Conversation:
    """What the engine needs of a TokenConversation: the responses the model was shown."""

    def __init__(self) -> None:
        self.responses: list[str] = []
        self.segments: list[Any] = []

    def add_observation(self, screenshot: Any) -> None:
        pass

    def add_response(self, text: str, token_ids: list[int], logprobs: list[float]) -> None:
        self.responses.append(text)

    @property
    def current(self) -> list[str]:
        return list(self.responses)


class TextPolicy:
    """Answers with the next of a list of texts and records how each was asked for."""

    coord_mode = "qwen25vl"

    def __init__(self, responses: list[str]) -> None:
        self.responses = list(responses)
        self.sampled: list[dict[str, Any]] = []
        self.conversations: list[_Conversation] = []

    def new_conversation(self, instruction: str) -> _Conversation:
        self.conversations.append(_Conversation())
        return self.conversations[-1]

    def generate(self, segments, *, sampling=SamplingParams(), contexts=None, seeds=None, cache_keys=None):
        out = []
        for _ in segments:
            self.sampled.append({"temperature": sampling.temperature, "max_tokens": sampling.max_new_tokens,
                                 "frequency_penalty": sampling.frequency_penalty})
            out.append(Generation(self.responses.pop(0), [1], [0.0]))
        return out

    def parse(self, text, image_size, rules="workbench"):
        return parse_response(text, image_size, "qwen25vl", rules=rules)

    def release(self, key: Any) -> None:
        pass


class InlineWorker:
    """An environment worker in this process: the real worker's commands, answered at once."""

    def __init__(self, make_env: Any) -> None:
        self.make_env, self.env, self.answer = make_env, None, None

    def send(self, cmd: str, payload: Any) -> None:
        if cmd == "reset":
            if self.env is not None:
                self.env.close()
            self.env = self.make_env()
            self.answer = self.env.reset(seed=payload[1])
        else:
            self.answer = step_actions(self.env, payload)

    def recv(self) -> Any:
        return self.answer


class InlinePool:
    def __init__(self, make_env: Any) -> None:
        self.workers = [InlineWorker(make_env)]

    def __len__(self) -> int:
        return 1

    def close(self) -> None:
        if self.workers[0].env is not None:
            self.workers[0].env.close()


def sent_as_in_the_transcript(code: str) -> str | list[str]:
    """WAIT/DONE/FAIL, or the code's pyautogui and time calls (pointer coordinates, x=, y= and
    button= left out)."""
    if code in ("WAIT", "DONE", "FAIL"):
        return code
    calls = []
    for stmt in ast.parse(code).body:
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
            call = stmt.value
            name = call.func.attr  # type: ignore[attr-defined]
            args = [] if name in POINTER_CALLS else [ast.unparse(a) for a in call.args]
            args += [f"{k.arg}={ast.unparse(k.value)}" for k in call.keywords if k.arg not in ("x", "y", "button")]
            calls.append(f"{name}({', '.join(args)})" if args else name)
    return calls


@pytest.fixture(autouse=True)
def _fresh_fake():
    FakeDesktopEnv.clear()
    yield
    FakeDesktopEnv.clear()


@pytest.mark.parametrize("name", sorted(TRANSCRIPT["protocols"]))
def test_the_protocol_table_says_what_the_sources_do(name):
    protocol = PROTOCOLS[name]
    for field, value in TRANSCRIPT["protocols"][name].items():
        assert getattr(protocol, field) == value, field


def run_row(row: dict[str, Any], tmp_path: Path) -> tuple[Any, TextPolicy]:
    protocol = PROTOCOLS[row["protocol"]]
    config = load_fake_task(row["task"])
    if row.get("faults"):
        config["fake"] = row["faults"]
    pool = InlinePool(lambda: OSWorldEnv(config, provider="fake", desktop_env_class=FakeDesktopEnv,
                                         cache_root=tmp_path / "cache", download_cache=None, pause_s=0,
                                         backoff_s=0, max_steps=15))
    policy = TextPolicy(row["responses"])
    engine = RolloutEngine(policy, pool, max_steps=15, rules=protocol.rollout_rules())
    temperature = EVAL_TEMPERATURE if protocol.temperature is None else protocol.temperature
    try:
        (traj,) = engine.run([EpisodeRequest(f"osworld/{row['task']}", 1, 0)], temperature=temperature,
                             out_dir=tmp_path / "eval", progress=False)
    finally:
        pool.close()
    return traj, policy


@pytest.mark.parametrize("row", TRANSCRIPT["rows"], ids=[r["name"] for r in TRANSCRIPT["rows"]])
def test_the_engine_does_what_the_transcript_says(row, tmp_path):
    traj, policy = run_row(row, tmp_path)
    assert policy.responses == [], "every response of the row is sampled"
    sent = [sent_as_in_the_transcript(c.args["action"]) for c in FakeDesktopEnv.calls if c.method == "step"]
    assert sent == row["sent"]
    if "sampled" in row:
        assert [{k: s[k] for k in ("temperature", "max_tokens")} for s in policy.sampled] == row["sampled"]
    assert {s["frequency_penalty"] for s in policy.sampled} == {PROTOCOLS[row["protocol"]].frequency_penalty}
    result = Path(traj.directory) / "result.txt"
    if row["result"] is None:
        assert not result.exists()
    else:
        assert float(result.read_text()) == row["result"]
    assert (traj.status.value, traj.format_ok) == (row["status"], row["format_ok"])
    if "seen_responses" in row:
        assert len(policy.conversations[0].responses) == row["seen_responses"]


def test_responses_sampled_again_are_recorded_but_never_shown_to_the_model(tmp_path):
    row = TRANSCRIPT["rows"][0]
    traj, policy = run_row(row, tmp_path)
    assert traj.steps[0].discarded == row["responses"][:2] and traj.steps[0].response == row["responses"][2]
    assert policy.conversations[0].responses == row["responses"][2:]
    back = read_trajectory(traj.directory).trajectory
    assert back.steps[0].discarded == row["responses"][:2] and back.steps[1].discarded == []


def test_an_unfinished_episode_says_why_and_is_not_scored(tmp_path):
    from arpo_lib.evaluation.evaluate import summarize, unfinished_requests

    row = next(r for r in TRANSCRIPT["rows"] if r.get("faults") == {"checker_raises": True}
               and r["protocol"] == "osworld_uitars")
    traj, _ = run_row(row, tmp_path)
    assert "checker raised" in traj.error and "KeyError" in traj.checker_error
    assert traj.reward == 0.0 and traj.segments == []
    result = summarize([traj])
    assert (result.unfinished, result.env_errors, result.tasks[0].samples) == (1, 0, 0)
    assert "unfinished (no result, not in the rates; to run again): 1" in result.table()
    assert unfinished_requests([traj]) == [EpisodeRequest("osworld/fake-click", 1, 0)]


def test_what_the_environment_says_about_an_action_is_in_the_trajectory(tmp_path):
    """Typing outside ASCII on a VM without a clipboard tool (our rules paste such text): the step
    record and traj.jsonl say what was lost."""
    row = {"protocol": "run", "task": "fake-type", "faults": {"clipboard": False},
           "responses": ["Action: type(content='hello wörld\\n')", "Action: finished(content='')"]}
    traj, _ = run_row(row, tmp_path)
    assert "no clipboard tool" in traj.steps[0].action_error and "'ö'" in traj.steps[0].action_error
    assert traj.steps[1].action_error is None
    line = json.loads((Path(traj.directory) / "traj.jsonl").read_text().splitlines()[0])
    assert line["action_error"] == traj.steps[0].action_error
    assert traj.task_score == 0.0  # "hello wrld" is not what the task asks for


def _evaluate_fake(tmp_path: Path, faults: dict[str, Any], samples: int, **kwargs: Any) -> Any:
    from arpo_lib.evaluation.evaluate import evaluate

    config = load_fake_task("fake-click")
    config["fake"] = faults
    pool = InlinePool(lambda: OSWorldEnv(config, provider="fake", desktop_env_class=FakeDesktopEnv,
                                         cache_root=tmp_path / "cache", download_cache=None, pause_s=0,
                                         backoff_s=0, max_steps=15))
    policy = TextPolicy(["Action: click(start_box='(966,546)')", "Action: finished(content='')"] * 8)
    engine = RolloutEngine(policy, pool, max_steps=15, rules=PROTOCOLS["osworld_uitars"].rollout_rules())
    try:
        return evaluate(engine, ["osworld/fake-click"], samples_per_task=samples, temperature=0.0,
                        out_dir=tmp_path / "eval", progress=False, protocol="osworld_uitars", **kwargs)
    finally:
        pool.close()


def test_episodes_without_a_result_run_again_and_the_forks_acc_leads(tmp_path):
    """Under osworld_uitars an episode whose checker raised is run again on the next pass (as the
    fork's get_unfinished does), the replaced attempt kept aside; the report leads with
    pass_at_n.py's Acc."""
    result = _evaluate_fake(tmp_path, {"checker_raises": 1}, samples=2)
    assert result.rerun == [{"pass": 1, "episodes": 1, "still_without_result": 0}]
    assert (result.unfinished, result.tasks[0].samples, result.tasks[0].successes) == (0, 2, 2)
    assert (result.fork_acc, result.fork_acc_over_all, result.fork_tasks_with_result) == (1.0, 1.0, 1)
    sample0 = tmp_path / "eval" / "osworld" / "fake-click" / "0"
    assert float((sample0 / "result.txt").read_text()) == 1.0
    kept = tmp_path / "eval" / "unfinished_attempts" / "pass_0" / "osworld" / "fake-click" / "0"
    assert json.loads((kept / "meta.json").read_text())["status"] == "unfinished"
    assert not (kept / "result.txt").exists()
    lines = result.table().splitlines()
    assert lines[1].startswith("the fork's Acc (pass_at_n.py): 1.000 (1 of 1 tasks with a result)")
    assert "pass 1: 1 episode(s) without a result run again, 0 still without one" in lines
    saved = json.loads((tmp_path / "eval" / "results.json").read_text())
    assert saved["rerun"] == result.rerun and saved["fork_acc"] == 1.0


@pytest.mark.parametrize("passes, expected", [(None, 2), (0, 0)])
def test_reruns_are_bounded_and_what_stays_without_a_result_is_reported(tmp_path, passes, expected):
    """A checker that always raises: the protocol's 2 more passes (or eval.rerun_passes), then the
    episodes are reported unfinished; the fork's Acc has no task with a result, Acc over all is 0."""
    result = _evaluate_fake(tmp_path, {"checker_raises": True}, samples=1, rerun_passes=passes)
    assert [p["pass"] for p in result.rerun] == list(range(1, expected + 1))
    assert all(p["still_without_result"] == 1 for p in result.rerun)
    assert (result.unfinished, result.tasks_total, result.fork_tasks_with_result) == (1, 1, 0)
    assert (result.fork_acc, result.fork_acc_over_all) == (0.0, 0.0)
    attempts = sorted(p.name for p in (tmp_path / "eval" / "unfinished_attempts").glob("pass_*")) if expected else []
    assert attempts == [f"pass_{n}" for n in range(expected)]


def test_infrastructure_failures_are_run_again_with_the_unfinished():
    """The fork's runner writes no result for an episode its environment lost either: both are
    what its next pass runs; the workbench's own `unfinished_requests` keeps its old meaning."""
    from arpo_lib.evaluation.evaluate import summarize, unfinished_requests
    from arpo_lib.types import EpisodeStatus, Trajectory

    trajs = [Trajectory("osworld/a", 1, 0, task_score=1.0), Trajectory("osworld/a", 2, 1, status=EpisodeStatus.ENV_ERROR),
             Trajectory("osworld/b", 3, 0, status=EpisodeStatus.UNFINISHED)]
    assert unfinished_requests(trajs) == [EpisodeRequest("osworld/b", 3, 0)]
    assert unfinished_requests(trajs, env_errors=True) == [EpisodeRequest("osworld/a", 2, 1),
                                                           EpisodeRequest("osworld/b", 3, 0)]
    result = summarize(trajs)
    # task a solved in its one sample with a result; b has none: Acc 1/1, over all 1/2
    assert (result.fork_acc, result.fork_acc_over_all, result.tasks_total) == (1.0, 0.5, 2)
    assert result.table().splitlines()[-1].startswith("the fork's Acc (pass_at_n.py): 1.000 (1 of 1 tasks")
