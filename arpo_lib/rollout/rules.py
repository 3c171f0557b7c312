"""The rules of a rollout the engine asks about instead of knowing them: how to sample a step's
response, which action rules parse it, what is sent to the environment instead of it, and what
an exception costs the episode.

`RolloutRules` is both the interface and training's rules (ARPO's rollouts: one sample per step,
the parsed actions as they are, a checker that raises scores 0, a response the converter refuses
is a format failure). Evaluation protocols that reproduce another runner (the OSWorld fork's
UI-TARS agent) subclass it: `arpo_lib.evaluation.rules.ProtocolRules`, built by
`EvalProtocol.rollout_rules()`.
"""
from __future__ import annotations

from typing import Any

from arpo_lib.types import SamplingParams


class RolloutRules:
    """Training's rules; override a method to change one."""

    action_rules: str = "workbench"
    """Which action names are valid and how actions are carried out (`arpo_lib.actions.ACTION_RULES`)."""
    parse_attempts: int = 1
    """Responses sampled per step until one can be parsed; when none can, the episode ends (DONE)
    as a format failure."""

    def sampling(self, base: SamplingParams, attempt: int) -> SamplingParams:
        """How to sample attempt `attempt` (0 = the first) of a step's response, given the run's
        temperature and top_p in `base`."""
        return base

    def actions(self, actions: list[dict[str, Any]], *, step: int, max_steps: int,
                memory: dict[str, Any]) -> list[dict[str, Any]]:
        """The actions sent to the environment for the parsed `actions` of step `step` (1-based);
        `memory` is the episode's own, kept between its steps."""
        return actions

    def unfinished(self, why: str) -> str | None:
        """An episode lost to an exception (`why`: a checker that raised, a converter that raised
        on the response): the error to record when the episode is left without a result, to be
        run again (`EpisodeStatus.UNFINISHED`); None keeps it (a checker's error scores 0, the
        converter's is a format failure)."""
        return None


TRAINING_RULES = RolloutRules()
