"""Evaluation protocols: numbers are comparable only when measured the same way.

`eval.protocol` names one; every report names the protocol it used, and a baseline is measured
with the same one.

- `run`: the run's own settings: `agent.prompt`, `eval.temperature`, the environment options as
  configured. What MiniWoB experiments use.
- `arpo_train`: ARPO's validation during training: its training prompt (`arpo`), `eval.temperature`
  (ARPO validates at 0.5), OSWorld's `pause` 0.5 s after each action; no action is replaced.
- `osworld_uitars`: the ARPO authors' OSWorld fork's UI-TARS evaluation agent: its prompt
  (`osworld_uitars15`), temperature 0 with frequency_penalty 1, `pause` 1 s, the 15th action
  (the last allowed) replaced by FAIL when it is not already final, and `call_user` answered with
  WAIT up to 3 times per episode before it counts as FAIL. (Its README's `--temperature 0.6` never
  reaches the agent.)
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EvalProtocol:
    name: str
    prompt: str | None = None
    """The prompt to use; None = the run's `agent.prompt`."""
    temperature: float | None = None
    """Sampling temperature; None = `eval.temperature`."""
    frequency_penalty: float = 0.0
    """OpenAI-style: each token's logit lowered by this times its count in the response so far."""
    fail_at_last_step: bool = False
    """The last allowed step's action becomes FAIL unless it already ends the episode."""
    call_user_waits: int = 0
    """`call_user` is answered with WAIT this many times per episode before it counts."""
    osworld_pause_s: float | None = None
    """OSWorld's wait after each action (DesktopEnv.step's `pause`); None = env.options."""
    description: str = ""


PROTOCOLS: dict[str, EvalProtocol] = {
    "run": EvalProtocol("run", description="the run's own prompt, temperature and environment options"),
    "arpo_train": EvalProtocol("arpo_train", prompt="arpo", osworld_pause_s=0.5,
                               description="ARPO's validation: its training prompt, eval.temperature, pause 0.5 s"),
    "osworld_uitars": EvalProtocol("osworld_uitars", prompt="osworld_uitars15", temperature=0.0, frequency_penalty=1.0,
                                   fail_at_last_step=True, call_user_waits=3, osworld_pause_s=1.0,
                                   description="the OSWorld fork's UI-TARS agent: T=0, frequency_penalty 1, "
                                               "15th action FAIL, call_user -> WAIT x3, pause 1 s"),
}
