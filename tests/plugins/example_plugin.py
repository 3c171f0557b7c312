"""A plug-in from outside arpo_lib: an environment family, a policy loss, an advantage estimator,
a prompt and an evaluation protocol, each one registration. A run uses it by naming it:

    plugins: [tests.plugins.example_plugin]
    env: {tasks: [example/click-box], options: {}}
    agent: {prompt: example_terse}
    algo: {adv_estimator: example_centered, policy_loss: example_reinforce}
    eval: {protocol: example_protocol}

What it registers records its use: with $ARPO_EXAMPLE_PLUGIN_LOG set, every estimator and loss
call and every environment made appends a JSON line there (with the process id), so a test can
tell that each was really used, and where. Its top-level imports are light (no torch): the
environment workers import it too.
"""
from __future__ import annotations

import json
import os
import random
from typing import Any

from PIL import Image, ImageDraw

from arpo_lib.actions import Action
from arpo_lib.agent.prompt_library import Prompt
from arpo_lib.envs import EnvFamily, GUIEnv, Observation, register_family
from arpo_lib.evaluation.protocols import EvalProtocol
from arpo_lib.run.registry import ADV_ESTIMATORS, EVAL_PROTOCOLS, POLICY_LOSSES, PROMPTS

LOG_VAR = "ARPO_EXAMPLE_PLUGIN_LOG"
PROMPT_MARK = "EXAMPLE PLUGIN PROMPT"
"""Text of the plug-in's prompt that no other prompt has: a conversation holding it used it."""
SCREEN = (224, 168)
TASKS = ("click-box", "click-small-box")


def record(what: str, **details: Any) -> None:
    path = os.environ.get(LOG_VAR)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"what": what, "pid": os.getpid(), **details}) + "\n")


# ---- an environment family -------------------------------------------------------------------

class BoxEnv(GUIEnv):
    """Click the red box: the layout (where the box is) drawn from the episode's seed; one click
    inside it solves the task, `finished` or the step cap ends it unsolved."""

    def __init__(self, task: str, max_steps: int = 5, slow_seeds: tuple[int, ...] = (), slow_step_s: float = 0.0):
        if task not in TASKS:
            raise ValueError(f"unknown example task {task!r}")
        self.name = f"example/{task}"
        self.max_steps = max_steps
        self.slow_seeds, self.slow_step_s, self.seed = tuple(slow_seeds), slow_step_s, None
        """Episodes of these seeds take `slow_step_s` per step (asynchronous rollouts' tests)."""
        self.size = 50 if task == "click-box" else 20
        self.box = (0, 0, 0, 0)
        self.steps = 0
        record("make", task=task)

    def _observation(self) -> Observation:
        image = Image.new("RGB", SCREEN, "white")
        ImageDraw.Draw(image).rectangle(self.box, fill="red")
        return Observation(image, "Click the red box.", self.steps)

    def reset(self, seed: int | None = None) -> tuple[Observation, dict[str, Any]]:
        rng = random.Random(seed)
        x, y = rng.randrange(SCREEN[0] - self.size), rng.randrange(SCREEN[1] - self.size)
        self.box, self.steps, self.seed = (x, y, x + self.size, y + self.size), 0, seed
        return self._observation(), {"box": self.box, "seed": seed}

    def step(self, action: Action) -> tuple[Observation, float, bool, bool, dict[str, Any]]:
        if self.seed in self.slow_seeds:
            import time

            time.sleep(self.slow_step_s)
        self.steps += 1
        x1, y1, x2, y2 = self.box
        hit = action.kind == "click" and action.point is not None and \
            x1 <= action.point[0] <= x2 and y1 <= action.point[1] <= y2
        terminated = hit or action.kind in ("finished", "call_user")
        truncated = not terminated and self.steps >= self.max_steps
        return self._observation(), float(hit), terminated, truncated, {"box": self.box, "seed": self.seed}


def demonstrate(task: str, instruction: str, info: dict[str, Any], step: int,
                screen_size: tuple[int, int]) -> tuple[str, list[Action]]:
    x1, y1, x2, y2 = info["box"]
    return "The red box is there. I click its centre.", [Action("click", point=((x1 + x2) / 2, (y1 + y2) / 2))]


register_family(EnvFamily(
    "example", lambda task, **options: BoxEnv(task, **options), "red boxes to click (tests/plugins)",
    tasks=TASKS, seeded_layouts=True, domain=lambda task: "boxes",
    demonstrates=lambda task: task in TASKS, demonstrate=demonstrate,
))


# ---- an advantage estimator and a policy loss ------------------------------------------------

@ADV_ESTIMATORS.register("example_centered")
def centered(rewards: Any, cfg: Any) -> Any:
    """Rewards minus the group's mean (no std): (G,) -> (G,)."""
    record("advantages", rewards=[float(r) for r in rewards])
    return rewards - rewards.mean()


@POLICY_LOSSES.register("example_reinforce")
def reinforce(logprobs: Any, old_logprobs: Any, advantages: Any, mask: Any, cfg: Any, *,
              ref_logprobs: Any = None, is_weights: Any = None) -> tuple[Any, dict[str, float]]:
    """Plain REINFORCE: -A log p, the token mean over the batch (no ratio, no clip)."""
    import torch

    m = mask.bool()
    per_token = -advantages[:, None] * logprobs
    loss = torch.where(m, per_token, 0.0).sum() / m.sum().clamp_min(1)
    record("loss", tokens=int(m.sum()))
    return loss, {"pg_loss": float(loss.detach()), "tokens": int(m.sum())}


# ---- a prompt and an evaluation protocol -----------------------------------------------------

PROMPTS.register("example_terse", Prompt(
    name="example_terse", system="You are a helpful assistant.",
    user=f"{PROMPT_MARK}. Answer as\nThought: ...\nAction: click(start_box='(x,y)')\n\nTask: {{instruction}}\n",
    source="tests/plugins/example_plugin.py"))

EVAL_PROTOCOLS.register("example_protocol", EvalProtocol(
    "example_protocol", prompt="example_terse", temperature=0.0, description="the example plug-in's: greedy, its prompt"))
