"""Evaluation protocols: numbers are comparable only when measured the same way.

`eval.protocol` names one of `PROTOCOLS` (the registry `EVAL_PROTOCOLS`: a plug-in registers
its own with `EVAL_PROTOCOLS.register(name, EvalProtocol(name, ...))`); every report names the
protocol it used, and a baseline is measured with the same one.

- `run`: the run's own settings: `agent.prompt`, `eval.temperature`, the environment options as
  configured, our action rules (`arpo_lib.actions`, rules "workbench"). What MiniWoB experiments use.
- `arpo_train`: ARPO's validation during training (verl/trainer/gui_agent.py): its training prompt
  (`arpo`), `eval.temperature` (ARPO validates at 0.5), OSWorld's `pause` 0.5 s after each action,
  ARPO's action rules (its converter's names, typing, drag and scroll: rules "arpo"); a response
  that cannot be parsed ends the episode at once; no action is replaced; a checker that raises
  scores 0.
- `osworld_uitars`: the ARPO authors' OSWorld fork's UI-TARS evaluation, its agent
  (mm_agents/uitars_agent.py, `UITARSAgent` with its default runtime_conf) under its runner
  (run_multienv_uitars.py + lib_run_single.py): its prompt (`osworld_uitars15`), temperature 0 with
  frequency_penalty 1, responses of at most 4096 tokens, `pause` 1 s, ARPO's action rules (the same
  converter), a response that cannot be parsed sampled again at temperature 1 (3 samples in all)
  before the episode ends with DONE, the 15th action (the last allowed) replaced by FAIL when it is
  not already final, `call_user` answered with WAIT up to 3 times per episode before it counts as
  FAIL (`error_env` is FAIL at once), and an episode lost to an exception (a checker that raises,
  the converter raising on `press`) left without a result, to be run again on a later pass (here
  up to 2 more passes, `eval.rerun_passes`, over the episodes without a result, infrastructure
  failures included; the fork's runner runs them again each time it is started). Its headline,
  pass_at_n.py's "Acc", is reported first.
  (Its README's `--temperature 0.6` and the runner's `--max_tokens` never reach the agent.)
  One departure: the WAITs for `call_user` are counted per episode here; the fork's agent never
  resets its counter (`cur_callusr_count` is not in `reset()`), so in each runner process only the
  first three `call_user` of the whole run are answered with WAIT, which depends on how tasks are
  spread over processes.
"""
from __future__ import annotations

from dataclasses import dataclass

from arpo_lib.evaluation.rules import ProtocolRules

from arpo_lib.run.registry import EVAL_PROTOCOLS


@dataclass(frozen=True)
class EvalProtocol:
    name: str
    prompt: str | None = None
    """The prompt to use; None = the run's `agent.prompt`."""
    temperature: float | None = None
    """Sampling temperature; None = `eval.temperature`."""
    frequency_penalty: float = 0.0
    """OpenAI-style: each token's logit lowered by this times its count in the response so far."""
    max_new_tokens: int | None = None
    """Longest response in tokens; None = `model.max_new_tokens`."""
    fail_at_last_step: bool = False
    """The last allowed step's action becomes FAIL unless it already ends the episode."""
    call_user_waits: int = 0
    """`call_user` is answered with WAIT this many times per episode before it counts."""
    osworld_pause_s: float | None = None
    """OSWorld's wait after each action (DesktopEnv.step's `pause`); None = env.options."""
    action_rules: str = "workbench"
    """Which action names are valid and how actions are carried out (`arpo_lib.actions.ACTION_RULES`)."""
    parse_attempts: int = 1
    """Samples per step until one can be parsed; when none can, the episode ends (DONE) as a format
    failure."""
    retry_temperature: float = 1.0
    """The temperature of the samples after the first."""
    unfinished_on_error: bool = False
    """An episode the OSWorld fork's runner loses to an exception (a checker that raises, a converter
    that raises) gets no result (status `unfinished`) instead of a score of 0 or a format failure."""
    rerun_passes: int = 0
    """More passes over the episodes left without a result (unfinished or an infrastructure failure):
    the fork's runner runs every example without result.txt again when it is started again
    (get_unfinished); `eval.rerun_passes` overrides."""
    report_fork_acc_first: bool = False
    """The report leads with pass_at_n.py's "Acc" (the fork's headline) before our rates."""
    description: str = ""

    def rollout_rules(self, max_new_tokens: int | None = None) -> ProtocolRules:
        """The rules this protocol gives the rollout engine; `max_new_tokens` replaces its response
        cap (`build.response_cap`: a run may shorten it)."""
        return ProtocolRules(frequency_penalty=self.frequency_penalty,
                             max_new_tokens=self.max_new_tokens if max_new_tokens is None else max_new_tokens,
                             fail_at_last_step=self.fail_at_last_step, call_user_waits=self.call_user_waits,
                             action_rules=self.action_rules, parse_attempts=self.parse_attempts,
                             retry_temperature=self.retry_temperature, unfinished_on_error=self.unfinished_on_error)


PROTOCOLS = EVAL_PROTOCOLS
"""Every protocol by name (`eval.protocol`)."""

for _protocol in (
    EvalProtocol("run", description="the run's own prompt, temperature, environment options and action rules"),
    EvalProtocol("arpo_train", prompt="arpo", osworld_pause_s=0.5, action_rules="arpo",
                 description="ARPO's validation: its training prompt, eval.temperature, pause 0.5 s, "
                             "its action rules"),
    EvalProtocol("osworld_uitars", prompt="osworld_uitars15", temperature=0.0, frequency_penalty=1.0,
                 max_new_tokens=4096, fail_at_last_step=True, call_user_waits=3, osworld_pause_s=1.0,
                 action_rules="arpo", parse_attempts=3, retry_temperature=1.0,
                 unfinished_on_error=True, rerun_passes=2, report_fork_acc_first=True,
                 description="the OSWorld fork's UI-TARS agent: T=0, frequency_penalty 1, 4096 tokens, "
                             "ARPO's action rules, unparsable responses sampled again at T=1 (3 in all), "
                             "15th action FAIL, call_user -> WAIT x3, pause 1 s, exceptions leave "
                             "the episode unfinished, run again on up to 2 more passes"),
):
    EVAL_PROTOCOLS.register(_protocol.name, _protocol)
