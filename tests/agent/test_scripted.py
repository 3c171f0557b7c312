"""The scripted MiniWoB agent, directly and wrapped as a policy in the real rollout path.

Browser tests use real headless Chromium, one browser at a time (one environment per task,
reused over seeds and coordinate modes), and the tiny locally built model.
"""
from __future__ import annotations

import pytest
from PIL import Image

from arpo_lib.actions import MAX_PIXELS, MIN_PIXELS, parse_response
from arpo_lib.agent.scripted import SCRIPTED_TASKS, ScriptedPolicy, infer_task, scripted_response, task_name
from arpo_lib.types import SamplingParams

SCALE = 2
SIZE = (160 * SCALE, 210 * SCALE)
MODES = {
    # UI-TARS 1.0 / 2B-SFT: relative 0..1000
    "qwen2vl": (28, MIN_PIXELS, MAX_PIXELS),
    # UI-TARS-1.5: absolute pixels of the smart-resized image; the tiny model's small limits
    # (320x420 -> 252x336) make the rounding coarser than any real checkpoint's.
    "qwen25vl": (28, 28 * 28 * 4, 28 * 28 * 128),
}


from tests.conftest import needs_browser  # noqa: E402


def _element(ref, tag, left, top, width, height, *, parent=0, text="", value="", id="", classes="",
             focused=False, tampered=False):
    return {"ref": ref, "parent": parent, "tag": tag, "text": text, "value": value, "id": id,
            "classes": classes, "left": left, "top": top, "width": width, "height": height,
            "focused": focused, "tampered": tampered, "is_leaf": True}


CLICK_TEST_INFO = {"dom_elements": [_element(4, "button", 100, 200, 60, 40, id="subbtn", text="Click Me!")]}


@pytest.fixture(scope="module")
def tiny_policy(tmp_path_factory):
    from arpo_lib.agent.hf_policy import HFPolicy
    from arpo_lib.training.tiny_model import build_tiny_model

    path = build_tiny_model(tmp_path_factory.mktemp("scripted") / "tiny-qwen25vl", variant="qwen25vl")
    return HFPolicy(path, device="cpu")


# ---- no browser needed ----------------------------------------------------------------------

def test_unsupported_task_lists_supported_ones():
    with pytest.raises(ValueError, match="click-test.*login-user"):
        scripted_response("miniwob/book-flight", "Book a flight.", {"dom_elements": []}, 0, SIZE, "qwen2vl")
    with pytest.raises(ValueError, match="supported tasks"):
        infer_task("Book the cheapest flight.", {})
    assert task_name("miniwob/click-test-v1") == "click-test"


@pytest.mark.parametrize("mode", sorted(MODES))
def test_click_lands_on_the_element_in_both_coordinate_modes(mode):
    factor, min_pixels, max_pixels = MODES[mode]
    text = scripted_response("click-test", "Click the button.", CLICK_TEST_INFO, 0, SIZE, mode,
                             (factor, min_pixels, max_pixels))
    assert text.startswith("Thought: ") and "\nAction: click(start_box='(" in text
    (action,) = parse_response(text, SIZE, mode, factor=factor, min_pixels=min_pixels,
                               max_pixels=max_pixels).actions
    x, y = action.point
    assert abs(x - 130) < 2 and abs(y - 220) < 2


def test_infer_task_reads_instruction_and_page():
    assert infer_task('Click on the "ok" button.', {}) == "click-button"
    assert infer_task("Click button ONE, then click button TWO.", {}) == "click-button-sequence"
    checkbox = {"dom_elements": [_element(5, "input_checkbox", 0, 0, 10, 10)]}
    radio = {"dom_elements": [_element(5, "input_radio", 0, 0, 10, 10)]}
    assert infer_task("Select ab and click Submit.", checkbox) == "click-checkboxes"
    assert infer_task("Select ab and click Submit.", radio) == "click-option"


def test_checkbox_state_comes_from_the_dom():
    label = _element(5, "label", 0, 100, 90, 22)
    info = {"dom_elements": [
        label, _element(6, "input_checkbox", 10, 100, 20, 20, parent=5, value="True"),
        _element(-1, "t", 40, 100, 40, 22, parent=5, text="abc"),
        _element(9, "button", 0, 200, 100, 40, id="subbtn", text="Submit"),
    ]}
    # checked but not asked for: unselect it; asked for and checked: submit
    text = scripted_response("click-checkboxes", "Select nothing and click Submit.", info, 0, SIZE, "qwen2vl")
    assert "unselect" in text and "(62," in text  # x = 20 / 320 * 1000
    text = scripted_response("click-checkboxes", "Select abc and click Submit.", info, 1, SIZE, "qwen2vl")
    assert "Submit" in text and "(156," in text


def test_scripted_policy_delegates_and_scores_its_tokens(tiny_policy):
    policy = ScriptedPolicy(tiny_policy)
    assert policy.coord_mode == tiny_policy.coord_mode and policy.tokenizer is tiny_policy.tokenizer
    assert policy.parse == tiny_policy.parse and policy.model is tiny_policy.model
    from arpo_lib.types import PolicyContext

    conv = policy.new_conversation("Click the button.")
    shot = Image.new("RGB", SIZE, "white")
    conv.add_observation(shot)
    ctx = PolicyContext("Click the button.", shot, CLICK_TEST_INFO, 0)
    (greedy,) = policy.generate([conv.current], sampling=SamplingParams(temperature=0.0), contexts=[ctx])
    (hot,) = policy.generate([conv.current], sampling=SamplingParams(temperature=2.0), contexts=[ctx])
    eos = tiny_policy.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert greedy.token_ids == hot.token_ids and greedy.token_ids[-1] == eos
    assert tiny_policy.tokenizer.decode(greedy.token_ids[:-1]) == greedy.text
    assert policy.parse(greedy.text, SIZE).actions[0].kind == "click"
    assert len(greedy.logprobs) == len(greedy.token_ids) and all(lp <= 0 for lp in greedy.logprobs)
    assert greedy.logprobs != hot.logprobs  # temperature 0 scores at T=1, not at T=2
    with pytest.raises(ValueError, match="context"):
        policy.generate([conv.current])


# ---- real Chromium ---------------------------------------------------------------------------

@pytest.mark.slow
@needs_browser
def test_scripted_agent_solves_every_supported_task():
    from arpo_lib.envs import make_env

    failures = []
    for task in SCRIPTED_TASKS:
        env = make_env(f"miniwob/{task}", scale=SCALE)
        try:
            for seed, mode in ((0, "qwen2vl"), (1, "qwen25vl"), (2, "qwen2vl"), (3, "qwen25vl")):
                factor, min_pixels, max_pixels = MODES[mode]
                obs, info = env.reset(seed=seed)
                reward, texts = 0.0, []
                for step in range(env.max_steps):
                    text = scripted_response(task, obs.instruction, info, step, obs.screenshot.size,
                                             mode, MODES[mode])
                    texts.append(text)
                    (action,) = parse_response(text, obs.screenshot.size, mode, factor=factor,
                                               min_pixels=min_pixels, max_pixels=max_pixels).actions
                    obs, reward, terminated, truncated, info = env.step(action)
                    if terminated or truncated:
                        break
                if reward != 1.0:
                    failures.append((task, seed, mode, texts))
        finally:
            env.close()
    assert not failures


@pytest.mark.slow
@needs_browser
def test_scripted_policy_rollouts_are_trainable(tiny_policy, tmp_path):
    import torch

    from arpo_lib.envs.workers.pool import EnvPool
    from arpo_lib.rollout.engine import RolloutEngine
    from arpo_lib.types import EpisodeRequest

    policy = ScriptedPolicy(tiny_policy)
    requests = [EpisodeRequest(f"miniwob/{task}", seed, sample)
                for task in ("click-checkboxes", "login-user") for sample, seed in enumerate((3, 4))]
    with EnvPool(1, {"scale": SCALE}) as pool:
        trajs = RolloutEngine(policy, pool, max_steps=10).run(requests, temperature=1.0,
                                                             out_dir=tmp_path, progress=False)
    assert min(t.num_steps for t in trajs if "login" in t.task) >= 4  # click, type, tab, type, login
    for traj in trajs:
        assert traj.status == "ok" and traj.task_score == 1.0 and traj.format_ok, traj.summary()
        (seg,) = traj.segments
        trained = [t for t, m in zip(seg.input_ids, seg.loss_mask) if m]
        expected = [t for rec in traj.steps for t in policy.response_tokens(rec.response)]
        assert trained == expected
        behaviour = torch.tensor([lp for lp, m in zip(seg.behaviour_logprobs, seg.loss_mask) if m])
        with torch.no_grad():
            (current,) = tiny_policy.sequence_logprobs([seg], 1.0)
        torch.testing.assert_close(behaviour, current.float(), atol=1e-5, rtol=0)


def test_wrong_text_in_a_focused_field_is_replaced_in_one_turn():
    info = {"dom_elements": [
        _element(7, "input_text", 10, 150, 200, 40, id="tt", value="oops", focused=True),
        _element(8, "button", 10, 250, 100, 40, id="subbtn", text="Submit"),
    ]}
    text = scripted_response("enter-text", 'Enter "Ann" into the text field and press Submit.', info, 2,
                             SIZE, "qwen2vl")
    actions = parse_response(text, SIZE, "qwen2vl").actions
    assert [a.kind for a in actions] == ["hotkey", "type"] and actions[1].text == "Ann"
