"""The scripted agent: each environment family's demonstrator, written as the model would write it.

`scripted_response` asks the task's family (`EnvFamily.demonstrate`, arpo_lib/envs) for the next
turn -- MiniWoB's reads the page's DOM (arpo_lib/envs/miniwob/scripted.py), the desktop suite's and
OSWorld's replay the solutions their task files hold -- and writes it as a UI-TARS turn,
``Thought: ...\nAction: ...``, with `format_response`, so coordinates are in the model's own
convention (relative 0..1000 for Qwen2-VL, absolute pixels of the smart-resized image for
Qwen2.5-VL). A family without a demonstrator has no scripted agent.

`ScriptedPolicy` wraps a real `HFPolicy` so scripted episodes go through the ordinary rollout
path: the scripted text is tokenised with the model's tokenizer and its behaviour log-probs are
the model's own log-probs of those tokens, so the trajectories are valid training data
(demonstrations that the model itself "could have sampled", scored exactly like its samples).

Uses: smoke tests that need successful trajectories from an untrained tiny model, seeding a
replay buffer, and checking the environment + action round trip end to end.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from arpo_lib import envs
from arpo_lib.actions import MAX_PIXELS, MIN_PIXELS, format_response
from arpo_lib.types import SamplingParams
# The MiniWoB demonstrator's names, kept here for their older callers (sft's message, tests).
from arpo_lib.envs.miniwob.scripted import SCRIPTED_TASKS, infer_task, task_name  # noqa: F401

_BARE_NAMES = "miniwob"
"""The family of a task named without one (`click-test`): what `infer_task` answers, and what
callers wrote before there were other families."""


def _family_task(task: str) -> tuple[envs.EnvFamily, str]:
    """(family, task within it) of a task name; an instance's `@<seed>` dropped."""
    return envs.check_env_name(task if "/" in task else f"{_BARE_NAMES}/{task}", listed=False)


def scripted_response(
    task: str,
    instruction: str,
    info: dict[str, Any],
    step: int,
    image_size: tuple[int, int],
    coord_mode: str,
    resize: tuple[int, int, int] = (28, MIN_PIXELS, MAX_PIXELS),
) -> str:
    """The scripted agent's next UI-TARS turn for a task (`<family>/<task>`; a bare name is
    MiniWoB's, with or without `-v1`).

    `info` is the environment's info dict (MiniWoB's `dom_elements` are read); `step` the number
    of actions taken so far; `image_size` the screenshot's (width, height); `coord_mode`/`resize` =
    (factor, min_pixels, max_pixels) as the policy parses (`HFPolicy.coord_mode`, `HFPolicy.resize`).
    Raises ValueError for a task without a demonstrator (MiniWoB's lists `SCRIPTED_TASKS`) or a
    page the script does not understand.
    """
    family, name = _family_task(task)
    if family.demonstrate is None:
        raise ValueError(f"no scripted agent for task {task!r}: the {family.name} family has no demonstrator")
    thought, actions = family.demonstrate(name, instruction, info, step, image_size)
    factor, min_pixels, max_pixels = resize
    return format_response(thought, actions, image_size, coord_mode, factor=factor,
                           min_pixels=min_pixels, max_pixels=max_pixels)


def supports(task: str) -> bool:
    """Whether the scripted agent can demonstrate `task`: its family's demonstrator says so (a
    MiniWoB task it has a solver for, any task of the desktop suite, whose files hold their
    solutions, an OSWorld task with a scripted solution for the desktop sandbox)."""
    try:
        family, name = _family_task(task)
    except ValueError:
        return False
    return family.demonstrates is not None and family.demonstrates(name)


# --------------------------------------------------------------------------------------------
# The policy wrapper
# --------------------------------------------------------------------------------------------


class ScriptedPolicy:
    """A policy that answers with the scripted agent, scored by a real model.

    Everything but `generate` is the base policy's (`new_conversation`, `parse`, `coord_mode`,
    `resize`, `processor`, `tokenizer`, `model`, `save`, `sequence_logprobs`, ...), so the
    rollout engine and the trainer treat it as that model. `generate` returns the scripted
    response as tokens of the base tokenizer followed by `<|im_end|>`, with the base model's
    log-probs of those tokens (at the given temperature; 1 for temperature 0) as the
    behaviour log-probs.

    The task of each context is `context.task` when the context has one, else it is inferred
    from the instruction and page (`infer_task`).
    """

    def __init__(self, base: Any):
        self.base = base

    def __getattr__(self, name: str) -> Any:
        # Only called for attributes not found on the wrapper itself.
        if name == "base":
            raise AttributeError(name)
        return getattr(self.base, name)

    def response_tokens(self, text: str) -> list[int]:
        """Token ids of a response as the model would emit them: text + <|im_end|>."""
        tokenizer = self.base.tokenizer
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        return list(ids) + [tokenizer.convert_tokens_to_ids("<|im_end|>")]

    def generate(
        self,
        segments: Sequence[Any],
        *,
        sampling: SamplingParams = SamplingParams(),
        contexts: Sequence[Any] | None = None,
        seeds: Sequence[int] | None = None,
        cache_keys: Sequence[Any] | None = None,
    ) -> list[Any]:
        """One scripted response per (segment, context), scored at `sampling.temperature`; the
        other sampling options are ignored (a script is never cut short), as are `cache_keys`."""
        import torch

        from arpo_lib.types import Generation, Segment

        if not segments:
            return []
        if contexts is None or len(contexts) != len(segments):
            raise ValueError("ScriptedPolicy.generate needs one context (instruction, screenshot, "
                             "info, step) per segment")
        texts, token_ids, scored = [], [], []
        for seg, ctx in zip(segments, contexts):
            task = getattr(ctx, "task", None) or infer_task(ctx.instruction, ctx.info)
            text = scripted_response(task, ctx.instruction, ctx.info, ctx.step, ctx.screenshot.size,
                                     self.base.coord_mode, self.base.resize)
            ids = self.response_tokens(text)
            texts.append(text)
            token_ids.append(ids)
            # The segment with the response appended; only the new tokens are scored (earlier
            # responses in the segment were scored when they were produced).
            scored.append(Segment(
                input_ids=seg.input_ids + ids,
                mm_token_type_ids=seg.mm_token_type_ids + [0] * len(ids),
                loss_mask=[0] * len(seg) + [1] * len(ids),
                pixel_values=seg.pixel_values, image_grid_thw=seg.image_grid_thw,
                screenshot_steps=seg.screenshot_steps))
        scale = sampling.temperature if sampling.temperature > 0 else 1.0
        with torch.no_grad():
            logprobs = self.base.sequence_logprobs(scored, scale)
        return [Generation(text=t, token_ids=ids, logprobs=lp.float().cpu().tolist())
                for t, ids, lp in zip(texts, token_ids, logprobs)]
