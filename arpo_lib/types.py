"""The data that flows between the packages, and the two interfaces they meet at.

    EpisodeRequest --(RolloutEngine: Policy x WorkerPool)--> Trajectory --(replay, advantages)--> Group

`Policy` is what the rollout engine asks of whoever acts (the in-process model, a model behind
a server, the scripted demonstrator), `SamplingParams` how it asks, and `Segment` the tokens it
sends; `WorkerPool` is what it asks of the environments (local worker processes or Ray actors).
Torch-free and importing only `run/`: environment workers in OSWorld's own interpreter import
this module too.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, Sequence, runtime_checkable

from arpo_lib.run import layout
from arpo_lib.run.seeding import stable_seed

if TYPE_CHECKING:  # annotations only: this module imports run/ alone (and never torch, for the workers)
    import torch
    from PIL import Image


SUCCESS_THRESHOLD = 0.5
"""A trajectory *solved* its task when its task score is above this: success rates, pass@k and
task selection count these. Checkers score 0..1 and OSWorld's give partial credit, so "solved"
needs a cut; binary MiniWoB rewards are 0 or 1 either way. The replay buffer has its own, lower
threshold (`algo.replay.success_threshold`, ARPO's 0.1): it keeps anything with credit."""


class EpisodeStatus(str, enum.Enum):
    """How an episode ended, as far as training is concerned."""

    OK = "ok"
    """The policy played it out (success or not): it counts."""
    ENV_ERROR = "env_error"
    """An infrastructure failure (a crashed browser or VM): excluded from training and statistics."""
    SETUP_FAILED = "setup_failed"
    """The task's set-up did not do what it asked and the environment skipped the episode
    (OSWorld's `on_setup_failure: skip`): not played, excluded from training and statistics,
    counted apart from infrastructure failures (the task, not the machine, is at fault here)."""
    UNFINISHED = "unfinished"
    """Lost to an exception that the OSWorld fork's evaluation runner catches (a checker that raises,
    its converter raising on an action) under a protocol that follows it (`unfinished_on_error`): no
    score and no result.txt, excluded from the statistics, to be run again on a later pass
    (`evaluation.evaluate.unfinished_requests`) as the fork's runner re-runs examples without a result."""

    def __str__(self) -> str:
        return self.value


@dataclass
class EpisodeRequest:
    """One episode to run."""

    task: str
    seed: int
    sample: int = 0
    """Index within the task's group (0..G-1)."""


def episode_requests(tasks: Sequence[str], samples: int, *salt: Any) -> list[EpisodeRequest]:
    """`samples` episodes of every task, each seeded by (salt..., task, sample): the same
    episodes whenever the salt is the same (`episode_requests(tasks, 8, seed, step)`)."""
    return [EpisodeRequest(task, stable_seed(*salt, task, i), i) for task in tasks for i in range(samples)]


@dataclass
class PolicyContext:
    """What an episode looks like right now, beside its tokens (for policies that read the page)."""

    instruction: str
    screenshot: "Image.Image"
    info: dict[str, Any]
    step: int
    task: str = ""
    screenshots: list[Any] = field(default_factory=list)
    """Every screenshot of the episode so far, the current one last (server policies send them)."""
    responses: list[str] = field(default_factory=list)
    """The responses so far, one fewer than screenshots."""


@dataclass
class Segment:
    """One training sequence. ids/mask/logprobs are aligned 1-D lists over tokens."""

    input_ids: list[int] = field(default_factory=list)
    mm_token_type_ids: list[int] = field(default_factory=list)
    """1 at image tokens (Qwen-VL's M-RoPE needs it), 0 elsewhere."""
    loss_mask: list[int] = field(default_factory=list)
    """1 at sampled assistant tokens (the only tokens trained on)."""
    behaviour_logprobs: list[float] = field(default_factory=list)
    """Log-prob of each token under the sampling policy (0 where loss_mask is 0)."""
    pixel_values: list["torch.Tensor"] = field(default_factory=list)
    """Per image: (patches, C*T*P*P), straight from the image processor."""
    image_grid_thw: list["torch.Tensor"] = field(default_factory=list)
    """Per image: (3,)."""
    screenshot_steps: list[int] = field(default_factory=list)
    """Episode step index of each image in this segment (to reload it from step_N.png)."""

    def __len__(self) -> int:
        return len(self.input_ids)

    def extend(self, ids: list[int], mm_types: list[int], mask: int, logprobs: list[float] | None = None) -> None:
        self.input_ids += ids
        self.mm_token_type_ids += mm_types
        self.loss_mask += [mask] * len(ids)
        self.behaviour_logprobs += logprobs if logprobs is not None else [0.0] * len(ids)

    def tensors(self) -> dict[str, "torch.Tensor"]:
        """Model inputs for this sequence, batch dimension 1."""
        import torch

        out = {
            "input_ids": torch.tensor([self.input_ids]),  # (1, T)
            "attention_mask": torch.ones(1, len(self.input_ids), dtype=torch.long),
            "mm_token_type_ids": torch.tensor([self.mm_token_type_ids], dtype=torch.int),
        }
        if self.pixel_values:
            out["pixel_values"] = torch.cat(self.pixel_values)
            out["image_grid_thw"] = torch.stack(self.image_grid_thw)
        return out

    def token_data(self) -> dict[str, Any]:
        """What is saved to disk (tokens.pt): everything but the pixels, which step_N.png reproduce."""
        return {
            "input_ids": self.input_ids, "mm_token_type_ids": self.mm_token_type_ids,
            "loss_mask": self.loss_mask, "behaviour_logprobs": self.behaviour_logprobs,
            "screenshot_steps": self.screenshot_steps,
        }


@dataclass(frozen=True)
class SamplingParams:
    """How one `Policy.generate` call samples: every policy reads its options from here, so a new
    sampling option is a field of this class (and its use where it is implemented)."""

    temperature: float = 1.0
    """0 = greedy; otherwise softmax(logits / temperature)."""
    top_p: float = 1.0
    """Nucleus sampling: the smallest set of tokens whose probability reaches top_p (1 = all)."""
    max_new_tokens: int | None = None
    """Longest response in tokens; None = the policy's own cap (`model.max_new_tokens`)."""
    frequency_penalty: float = 0.0
    """OpenAI's meaning: each token's logit lowered by this times its count in the response so far
    (an evaluation protocol's); behaviour log-probs are of the penalised distribution."""

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1 or None, got {self.max_new_tokens}")


@dataclass
class Generation:
    """One sampled response."""

    text: str
    token_ids: list[int]
    logprobs: list[float]
    """Log-prob of each sampled token under the distribution it was sampled from (the behaviour policy)."""
    weights_version: int | None = None
    """The trainer's weight version that produced it, where a server's version can change between
    requests (asynchronous training: `serving.weight_sync.ServedPolicy.versioned`); None: the batch's."""


@dataclass
class StepRecord:
    step: int
    response: str
    actions: list[dict[str, Any]]
    parse_error: str | None
    reward: float
    terminated: bool
    truncated: bool
    seconds: float
    action_error: str | None = None
    """What the environment reported about carrying the actions out (info["action_error"]: a
    refused action, a failed command, typing without a clipboard)."""
    discarded: list[str] = field(default_factory=list)
    """Responses sampled before `response` and thrown away because they could not be parsed (a
    protocol that samples again, as the OSWorld fork's agent does); the model never saw them."""
    weights_version: int | None = None
    """The weight version that produced `response` when it may differ from the trajectory's
    `policy_version` (rollouts overlapping an update, `rollout.max_staleness`); None: the same."""


@dataclass
class Trajectory:
    """A finished episode, plus what training needs."""

    task: str
    seed: int
    sample: int
    instruction: str = ""
    steps: list[StepRecord] = field(default_factory=list)
    task_score: float = 0.0
    """The environment's score of the episode (its checker), 0 if never terminated."""
    format_ok: bool = True
    """False when a response could not be parsed (that ended the episode)."""
    reward: float = 0.0
    """task_score + format_coef x format reward."""
    status: EpisodeStatus = EpisodeStatus.OK
    error: str | None = None
    segments: list[Segment] = field(default_factory=list)
    directory: str | None = None
    replayed: bool = False
    """True when this trajectory came from the replay buffer instead of a fresh rollout."""
    checker_error: str | None = None
    """The environment's checker raised scoring this episode (scored 0, as in ARPO; counted)."""
    policy_version: int = 0
    """The trainer's weight version that sampled it (counts warm start and optimizer steps):
    how stale a replayed trajectory is, in updates."""
    seconds: float = 0.0
    setup_failures: list[str] = field(default_factory=list)
    """What the task's set-up did not do (the reset's info["setup_failures"]; OSWorld's sandbox
    provider observes each step): the episode ran anyway unless its status is `setup_failed`."""

    def __post_init__(self) -> None:
        self.status = EpisodeStatus(self.status)  # "ok" / "env_error" from a file or a caller

    @property
    def num_steps(self) -> int:
        return len(self.steps)

    @property
    def ok(self) -> bool:
        return self.status == EpisodeStatus.OK

    @property
    def success(self) -> bool:
        return self.ok and self.task_score > SUCCESS_THRESHOLD

    def summary(self) -> dict[str, Any]:
        return {
            "task": self.task, "seed": self.seed, "sample": self.sample, "instruction": self.instruction,
            "task_score": self.task_score, "format_ok": self.format_ok, "reward": self.reward,
            "status": self.status.value, "error": self.error, "num_steps": self.num_steps,
            "replayed": self.replayed, "policy_version": self.policy_version, "checker_error": self.checker_error, "seconds": round(self.seconds, 3),
            "setup_failures": list(self.setup_failures),
        }


@dataclass
class Group:
    """The G trajectories of one task in one training step, as trained on."""

    task: str
    trajectories: list[Trajectory]
    advantages: list[float]
    injected: bool
    """One member was replaced by a stored success (ARPO)."""
    all_failed: bool

    def record(self) -> dict[str, Any]:
        """This group's entry in groups.json (`run.layout.group_record`; the group view reads it)."""
        return layout.group_record(self.task, all_failed=self.all_failed, injected=self.injected, members=[
            {"dir": t.directory, "task_score": t.task_score, "reward": t.reward, "advantage": a,
             "replayed": t.replayed, "format_ok": t.format_ok, "num_steps": t.num_steps}
            for t, a in zip(self.trajectories, self.advantages)])


class Conversation(Protocol):
    """An episode's token-exact conversation, as the engine uses it (`arpo_lib.agent.prompt.
    TokenConversation`, which a policy's `new_conversation` opens)."""

    segments: list[Segment]
    """The episode's training sequences so far, the current one last."""

    @property
    def current(self) -> Segment:
        """The sequence the next response extends."""
        ...

    def add_observation(self, screenshot: "Image.Image") -> None:
        """The next screenshot as a user turn, the assistant turn opened."""
        ...

    def add_response(self, text: str, token_ids: list[int], logprobs: list[float]) -> None:
        """The sampled response, token for token (trained on)."""
        ...


class ParsedActions(Protocol):
    """A response's parse, as the engine uses it (`arpo_lib.actions.ParsedResponse`)."""

    thought: str
    actions: list[Any]
    """The actions (`arpo_lib.actions.Action`), in order."""


@runtime_checkable
class Policy(Protocol):
    """Whoever acts in a rollout: `HFPolicy`, `ServerPolicy`, `ScriptedPolicy`.

    The engine opens one conversation per episode, asks for every live episode's next response
    in one `generate` call, parses it, and releases the episode's state when it ends.
    """

    coord_mode: str
    """The model's coordinate convention (`qwen2vl` relative 0..1000, `qwen25vl` absolute pixels)."""

    def new_conversation(self, instruction: str) -> Conversation:
        """A token-exact conversation for a new episode."""
        ...

    def generate(self, segments: Sequence[Segment], *, sampling: SamplingParams = SamplingParams(),
                 contexts: Sequence[PolicyContext] | None = None, seeds: Sequence[int] | None = None,
                 cache_keys: Sequence[Any] | None = None) -> list[Generation]:
        """One response per segment (the episode's tokens so far), all sampled as `sampling` says,
        each with its own seed; `contexts` (what the episode looks like) and `cache_keys` (which
        episode's cache to extend) are per episode."""
        ...

    def parse(self, text: str, image_size: tuple[int, int], rules: str = "workbench") -> ParsedActions:
        """A response's actions in screen pixels under the named action rules
        (`arpo_lib.actions.ACTION_RULES`); raises `ActionParseError`."""
        ...

    def release(self, key: Any) -> None:
        """Forget whatever the policy keeps for an episode (its KV cache)."""
        ...


class Worker(Protocol):
    """One environment worker: a command goes out, its answer comes back later (so many
    environments work in parallel). Failures raise `arpo_lib.envs.base.EnvError`."""

    def send(self, cmd: str, payload: Any) -> None: ...

    def recv(self) -> Any: ...

    # Optional: `ready() -> bool`, the answer is in (recv will not block). Asynchronous rollouts
    # (`rollout.mode=async`) poll it; a worker without it is waited for, as in lockstep.


class WorkerPool(Protocol):
    """Environment workers: `arpo_lib.envs.workers.pool.EnvPool` (local processes) or
    `arpo_lib.envs.workers.ray_pool.RayEnvPool` (Ray actors)."""

    workers: Sequence[Worker]

    def __len__(self) -> int: ...

    def close(self) -> None: ...

    def __enter__(self) -> "WorkerPool": ...

    def __exit__(self, *exc: object) -> None: ...
