"""The GUI environment contract, in Gymnasium's spirit but typed for screenshot-driven agents.

An environment shows a screen and an instruction, takes one UI-TARS action per step, and ends
with the task's own score. Every backend (MiniWoB++ in Chromium, OSWorld VMs, test doubles)
implements `GUIEnv`; the rollout engine and the notebooks only ever see this interface.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any

from PIL import Image

from arpo_lib.actions import Action


@dataclass
class Observation:
    """What the agent sees at one step."""

    screenshot: Image.Image
    """The screen exactly as the model will see it (PIL RGB image, screenshot pixel coordinates)."""
    instruction: str
    """The task instruction in natural language."""
    step: int = 0
    """How many actions have been taken in this episode so far."""


class EnvError(RuntimeError):
    """The environment itself failed (browser crashed, VM unreachable): not the policy's fault."""


class GUIEnv(abc.ABC):
    """A GUI task environment: `reset` -> (Observation, info); `step(Action)` -> 5-tuple.

    `step` returns (observation, reward, terminated, truncated, info):
    - reward is 0 until the episode ends, then the task's score (binary 0/1 or raw, per backend
      option), also when the step cap ended it (OSWorld checks the final state either way);
    - terminated: the task ended (solved, failed, or the agent said finished/call_user);
    - truncated: the step cap was reached first.
    After either flag, call `reset` before stepping again.
    """

    name: str = "env"
    max_steps: int = 15

    @abc.abstractmethod
    def reset(self, seed: int | None = None) -> tuple[Observation, dict[str, Any]]:
        """Start a new episode (deterministic for a given seed where the backend allows it)."""

    @abc.abstractmethod
    def step(self, action: Action) -> tuple[Observation, float, bool, bool, dict[str, Any]]:
        """Execute one action."""

    def close(self) -> None:
        """Release the browser / VM. Safe to call twice."""

    def __enter__(self) -> "GUIEnv":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class EnvSpec:
    """A registered environment family: names `<prefix>/<task>` are built by `factory(task, **options)`."""

    prefix: str
    factory: Any
    description: str = ""
    tasks: list[str] = field(default_factory=list)
