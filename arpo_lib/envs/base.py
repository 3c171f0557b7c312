"""The GUI environment contract, in Gymnasium's spirit but typed for screenshot-driven agents.

An environment shows a screen and an instruction, takes one UI-TARS action per step, and ends
with the task's own score. Every backend (MiniWoB++ in Chromium, OSWorld VMs, test doubles)
implements `GUIEnv`; the rollout engine and the notebooks only ever see this interface. An
`EnvFamily` says how to make a family's environments and what else differs between families.
"""
from __future__ import annotations

import abc
from collections.abc import Callable, Collection, Sequence
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
    _steps: int = 0
    """Steps taken in this episode (reset sets 0)."""
    _episode_over: bool = True
    """Until a reset, and after a step that ended the episode."""

    @abc.abstractmethod
    def reset(self, seed: int | None = None) -> tuple[Observation, dict[str, Any]]:
        """Start a new episode (deterministic for a given seed where the backend allows it)."""

    def step(self, action: Action) -> tuple[Observation, float, bool, bool, dict[str, Any]]:
        """Execute one action: what every family checks first (open, the episode not over), the
        step counted, then the family's `_step` (a family may override `step` whole instead)."""
        self._check_open()
        if self._episode_over:
            raise RuntimeError(f"{self.name}: the episode is over: call reset()")
        self._steps += 1
        return self._step(action)

    def _step(self, action: Action) -> tuple[Observation, float, bool, bool, dict[str, Any]]:
        raise NotImplementedError(f"{type(self).__name__} implements step() or _step()")

    def _check_open(self) -> None:
        """Raise RuntimeError when the environment is closed (for families that can tell)."""

    def close(self) -> None:
        """Release the browser / VM. Safe to call twice."""

    def __enter__(self) -> "GUIEnv":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


Plan = tuple[str, list[Action]]
"""(thought, actions): one turn of a scripted demonstrator, points in screenshot pixels."""


@dataclass
class EnvFamily:
    """One environment family and everything the workbench knows about it: task names are
    `<name>/<task>`, built by `make(task, **options)`. Registered in `arpo_lib.envs` (the registry
    `ENV_FAMILIES`); whatever differs between families is a field here, not a test of its name."""

    name: str
    """The prefix of its task names (no `/`)."""
    make: Callable[..., GUIEnv]
    """`make(task, **options)` -> a new environment. Heavy dependencies are imported in here, so
    that registering a family (and importing `arpo_lib.envs`) stays cheap."""
    description: str = ""
    """One line for listings: what the environments are and their options."""
    tasks: Sequence[str] | Callable[[], Sequence[str]] = ()
    """Its task names, or a function listing them (called when first needed). Empty: any task
    name is handed to `make`, which checks it."""
    cache_tasks: bool = True
    """False: list the tasks anew every time (a list that grows while a process runs: fetched data)."""
    seeded_layouts: bool = False
    """Each episode draws its layout from its seed, so `<task>@<seed>` names one fixed instance
    (MiniWoB); without, a task is one fixed configuration already (OSWorld)."""
    alias: Callable[[str], str] | None = None
    """Another spelling of a task -> its listed name (MiniWoB's gymnasium ids `click-test-v1`)."""
    domain: Callable[[str], str] | None = None
    """task -> the domain results are grouped under (OSWorld's `chrome`, `gimp`, ...); None: the
    family's name."""
    task_sets: Callable[[], Collection[str]] | None = None
    """Names of task sets: `<name>/<set>` stands for many tasks (OSWorld's `subset32`)."""
    expand_task_set: Callable[[str], list[str]] | None = None
    """A set's name -> the full names of its tasks (may need fetched data: FileNotFoundError)."""
    demonstrates: Callable[[str], bool] | None = None
    """Whether the scripted demonstrator can show a task."""
    demonstrate: Callable[[str, str, dict[str, Any], int, tuple[int, int]], Plan] | None = None
    """The scripted demonstrator: (task, instruction, info, step, screenshot size) -> its next
    turn (ValueError for a task or page it cannot handle). None: the family has none."""
    python: Callable[[], str] | None = None
    """With env.python=auto: the interpreter its environment workers need (raising when there is
    none, saying how to make one). None: this one."""
    _listed: list[str] | None = field(default=None, init=False, repr=False, compare=False)

    def task_names(self) -> list[str]:
        """Its task names ([]: any), listed once unless `cache_tasks` is False."""
        if not callable(self.tasks):
            return list(self.tasks)
        if self._listed is None or not self.cache_tasks:
            self._listed = list(self.tasks())
        return self._listed


def solution_plan(texts: Sequence[str] | None, task: str, step: int, screen_size: tuple[int, int]) -> Plan:
    """Step `step` of a task's scripted solution, then finished(). Solutions are UI-TARS action
    texts in Qwen2.5-VL's model space (for the default resize), read so into screenshot pixels."""
    from arpo_lib.actions import parse_response

    if texts is None:
        raise ValueError(f"no scripted solution for task {task!r}")
    if step < len(texts):
        thought, text = f"Step {step + 1} of {len(texts)} of the task.", texts[step]
    else:
        thought, text = "The task is done.", "finished(content='')"
    return thought, parse_response(f"Thought: {thought}\nAction: {text}", screen_size, "qwen25vl").actions
