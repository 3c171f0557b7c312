"""The rollout rules of an evaluation protocol: what the rollout engine does differently from
training when an evaluation reproduces another runner (the OSWorld fork's UI-TARS agent under its
runner: `evaluation.protocols` says where each rule comes from).

`EvalProtocol.rollout_rules()` builds them; the engine only calls the `RolloutRules` hooks.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from arpo_lib.actions import FINAL_KINDS, Action
from arpo_lib.envs.workers.worker import action_payload
from arpo_lib.rollout.rules import RolloutRules
from arpo_lib.types import SamplingParams


@dataclass(frozen=True)
class ProtocolRules(RolloutRules):
    """A protocol's rules; the defaults are training's (`RolloutRules`). Fields as in
    `evaluation.protocols.EvalProtocol`."""

    frequency_penalty: float = 0.0
    max_new_tokens: int | None = None
    """The response cap; None = the policy's (`model.max_new_tokens`)."""
    fail_at_last_step: bool = False
    call_user_waits: int = 0
    action_rules: str = "workbench"
    parse_attempts: int = 1
    retry_temperature: float = 1.0
    unfinished_on_error: bool = False

    def sampling(self, base: SamplingParams, attempt: int) -> SamplingParams:
        """The run's temperature first, `retry_temperature` for the samples after an unparsable one
        (as the fork's agent does); the penalty and the cap on every sample."""
        return replace(base, temperature=base.temperature if attempt == 0 else self.retry_temperature,
                       frequency_penalty=self.frequency_penalty, max_new_tokens=self.max_new_tokens)

    def actions(self, actions: list[dict[str, Any]], *, step: int, max_steps: int,
                memory: dict[str, Any]) -> list[dict[str, Any]]:
        """The fork's UI-TARS agent's replacements: call_user answered with WAIT a few times per
        episode, and a last allowed action that does not end the episode turned into FAIL."""
        kinds = [a["kind"] for a in actions]
        waits = memory.get("call_user_waits", 0)
        if self.call_user_waits and "call_user" in kinds and waits < self.call_user_waits:
            memory["call_user_waits"] = waits + 1
            return action_payload([Action("wait", rules=self.action_rules)])
        final = any(k in FINAL_KINDS for k in kinds)
        if self.fail_at_last_step and step >= max_steps and not final:
            return action_payload([Action("call_user", rules=self.action_rules)])  # OSWorld's FAIL
        return actions

    def unfinished(self, why: str) -> str | None:
        """The fork's runner writes no result for an example whose checker raised (evaluate()
        raised) or whose agent raised outside its resample loop (its converter on `press`), and
        runs it again on its next pass. (ARPO's training, and ours: a score of 0 / a format failure.)"""
        if not self.unfinished_on_error:
            return None
        return why + " (the OSWorld fork's runner writes no result for it and runs it again on its next pass)"
