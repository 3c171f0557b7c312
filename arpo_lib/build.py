"""The composition root: a run's config -> the environment pool, the policy, the rollout engine,
a model server, a trainer. Notebooks, the CLI, evaluation and experiments make their components
here, and only here, so every `*.path`, `env.*`, `rollout.*` and `serve.*` switch is read in one
place.

    cfg     = build.load_config("configs/smoke.yaml", ["train.steps=5"])   # parsed + task names checked
    trainer = build.trainer(cfg)                                           # policy, pool, server, evaluator
    with build.engine(cfg) as engine:                                       # a base-policy rollout engine
        evaluate_run(engine, cfg, out_dir)
"""
from __future__ import annotations

import contextlib
import dataclasses
import copy
import json
import logging
import math
import os
import threading
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch

from arpo_lib import envs
from arpo_lib.agent.hf_policy import HFPolicy, resolve_device
from arpo_lib.agent.server_policy import ServerPolicy
from arpo_lib.evaluation.evaluate import EvalResult, Spread, evaluate_run
from arpo_lib.evaluation.protocols import PROTOCOLS
from arpo_lib.rollout.engine import RolloutEngine
from arpo_lib.run import config as config_module
from arpo_lib.run.config import ConfigError, RunConfig, server_urls
from arpo_lib.run.net import weak_key_reason
from arpo_lib.run.records import atomic_write_bytes, safe_join
from arpo_lib.serving.gateway import announce_host, spans_nodes
from arpo_lib.serving.launch import ServerHandle, ServerSpec, api_key_from_env, free_port, start_server
from arpo_lib.serving.weight_sync import FollowingServed, ServedPolicy, connect_all, save_for_server
from arpo_lib.training import checkpoint as ckpt
from arpo_lib.training.backend import TrainingBackend, training_backend
from arpo_lib.training.checkpoint import Checkpointer
from arpo_lib.training.distributed import Ranks, barrier, broadcast_model, device_for, empty_model, init_process_group
from arpo_lib.training.metrics import RunRecords
from arpo_lib.training.rollout_source import RolloutSource
from arpo_lib.training.sft import WarmStart
from arpo_lib.training.trainer import Trainer
from arpo_lib.viz.tracking import TrackerMedia
from arpo_lib.types import WorkerPool
from arpo_lib.training.contracts import ServedWeights

log = logging.getLogger(__name__)


# -- the config ----------------------------------------------------------------------------------
def load_config(path: str | Path | None = None, overrides: Any = None) -> RunConfig:
    """`run.config.load_config` (YAML + dotted overrides, every field checked) plus what needs the
    layers above it (`check_config`): a misspelt task fails here, naming the key."""
    return check_config(config_module.load_config(path, overrides))


_CHECKED = "_arpo_checked_as"
"""The attribute of a config `check_config` passed: its contents then (`RunConfig.to_dict`)."""
_PREPARED = "_arpo_prepared_as"
"""The attribute of a config `prepare` made: its contents then."""


def _stamp(cfg: RunConfig, mark: str) -> RunConfig:
    object.__setattr__(cfg, mark, cfg.to_dict())
    return cfg


def _stamped(cfg: RunConfig, mark: str) -> bool:
    """Whether `cfg` still holds what it held when stamped with `mark`. `dataclasses.replace` makes
    a config without the stamp, and an edit in place (`cfg.env.tasks = [...]`) no longer matches it:
    both are checked again. A copy (`copy.deepcopy`, pickling to a worker) carries it, rightly."""
    return getattr(cfg, mark, None) == cfg.to_dict()


def check_config(cfg: RunConfig) -> RunConfig:
    """The checks that need more than the config tree: task names against the environment
    registry (`check_tasks`), the server's context against what an episode sends (`check_context`),
    the servers' key of a run over several nodes (`check_nodes`). A config passes once: checked
    again only when it changed since (`_stamped`)."""
    if _stamped(cfg, _CHECKED):
        return cfg
    return _stamp(check_nodes(check_context(check_tasks(cfg))), _CHECKED)


def check_nodes(cfg: RunConfig, environ: Mapping[str, str] | None = None) -> RunConfig:
    """A torchrun job with processes on other nodes (`gateway.spans_nodes`) whose rank 0 starts the
    servers must give them a key, set on this node: the other nodes reach them through a gateway
    that passes on only key-protected requests (serving/gateway.py), and without one rank 0 would
    fail only once its model had loaded. ConfigError at load, on every rank, naming the fix."""
    environ = os.environ if environ is None else environ
    if not spans_nodes(environ) or cfg.rollout.backend != "server" or server_urls(cfg):
        return cfg
    name = cfg.rollout.api_key_env or cfg.serve.api_key_env
    fix = (f"export {name or 'ARPO_SERVE_API_KEY'}, the same long random value, on every node (scripts/slurm_train.sh "
           f"generates one)")
    if name is None:
        raise ConfigError("serve.api_key_env: this run spans several nodes, whose ranks reach rank 0's servers through "
                          f"a gateway that wants a key: set serve.api_key_env=ARPO_SERVE_API_KEY and {fix}")
    key = environ.get(name, "")
    if not key:
        raise ConfigError(f"serve.api_key_env: {name} is not set (or empty) on this node: {fix}")
    if weak := weak_key_reason(key, "the other nodes"):
        raise ConfigError(f"serve.api_key_env: {name} on this node: {weak}")
    return cfg


def check_tasks(cfg: RunConfig) -> RunConfig:
    """Every task of env.tasks, eval.tasks and select.tasks names a registered environment (or a
    task set, expanded when the run starts); ConfigError naming the key otherwise."""
    for key, tasks in (("env.tasks", cfg.env.tasks), ("eval.tasks", cfg.eval.tasks or []),
                       ("select.tasks", cfg.select.tasks or [])):
        for task in tasks:
            if envs.is_task_set_name(task):
                continue  # expanded by resolve_task_sets when the run starts (needs the task data)
            try:
                envs.check_env_name(task)
            except ValueError as exc:
                raise ConfigError(f"{key}: {exc}") from exc
    return cfg


PROMPT_MARGIN_TOKENS = 2048
"""Context an episode's requests hold beyond screenshots and responses: the system line and the
prompt (the registered ones are ~1,200 characters, ~350 tokens), the task's instruction, and the
chat template's ~12 tokens a turn (~180 over 15 turns), with room to spare."""

DEFAULT_SCREEN = (1920, 1080)
"""The screenshot size assumed where the config names none: the default screen of the OSWorld and
desktop families (and ARPO's)."""


def screenshot_size(cfg: RunConfig) -> tuple[tuple[int, int], str]:
    """((width, height), where it comes from): the run's screenshots as its config sets them
    (OSWorld's `screen_size` option, the desktop family's `screen`, MiniWoB's `scale` times its
    160 x 210 task area), else `DEFAULT_SCREEN`."""
    # Read here, not asked of the family: EnvFamily has no field for its screen yet.
    options = cfg.env.options
    for key in ("screen_size", "screen"):
        if key in options:
            size = options[key]
            if not (isinstance(size, (list, tuple)) and len(size) == 2
                    and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in size)):
                raise ConfigError(f"env.options.{key}: expected [width, height] in pixels, got {size!r}")
            return (size[0], size[1]), f"env.options.{key}"
    tasks = cfg.env.tasks + (cfg.eval.tasks or []) + (cfg.select.tasks or [])
    if tasks and all(t.partition("/")[0] == "miniwob" for t in tasks):
        import inspect

        from arpo_lib.envs.miniwob.env import TASK_HEIGHT, TASK_WIDTH, MiniWoBEnv  # no browser imported

        scale = options.get("scale", inspect.signature(MiniWoBEnv).parameters["scale"].default)
        return (TASK_WIDTH * scale, TASK_HEIGHT * scale), f"MiniWoB's task area at scale {scale}"
    return DEFAULT_SCREEN, "the OSWorld and desktop families' default screen"


def check_context(cfg: RunConfig) -> RunConfig:
    """serve.max_model_len holds an episode's longest request, or ConfigError naming the numbers and
    the fixes. vLLM refuses (HTTP 400, which the client does not retry: the run stops) a request
    whose prompt plus max_tokens exceed it. The last step's request holds the screenshots kept
    (model.history_images, at most env.max_steps), every earlier response as text (all are kept)
    and room for its own, each at the response cap, and the prompt (`PROMPT_MARGIN_TOKENS`). A
    screenshot costs what the checkpoint's image processor makes of the run's screen
    (`screenshot_size`); a checkpoint whose processor config is not on this machine is assumed not
    to downscale it (UI-TARS's limits). Only vLLM has the limit (serve.backend=vllm)."""
    if cfg.serve.backend != "vllm":
        return cfg
    from arpo_lib.agent.prompt import QWEN_DEFAULT_MAX_PIXELS, checkpoint_image_limits, screenshot_tokens

    (width, height), screen_from = screenshot_size(cfg)
    limits = checkpoint_image_limits(cfg.model.path) or (28, 3136, QWEN_DEFAULT_MAX_PIXELS)
    per_image = screenshot_tokens((width, height), limits)
    cap, cap_key = config_module.longest_response(cfg)
    steps, kept = cfg.env.max_steps, cfg.model.history_images

    def request(step: int) -> int:  # step `step`'s (from 1): its screenshots, step - 1 responses and its own
        return min(step, kept) * per_image + step * cap + PROMPT_MARGIN_TOKENS

    needed = request(steps)
    if needed <= cfg.serve.max_model_len:
        return cfg
    first = next(k for k in range(1, steps + 1) if request(k) > cfg.serve.max_model_len)
    lower = "model.max_new_tokens" if cap_key == "model.max_new_tokens" else "eval.max_new_tokens"
    raise ConfigError(
        f"serve.max_model_len: {cfg.serve.max_model_len} tokens cannot hold an episode's last request, "
        f"{needed} tokens: {min(steps, kept)} screenshots (model.history_images, at most env.max_steps) x "
        f"{per_image} tokens ({width}x{height}, {screen_from}, under the processor's max_pixels {limits[2]}) "
        f"+ {steps} responses (env.max_steps) x {cap} tokens ({cap_key}) + {PROMPT_MARGIN_TOKENS} for the "
        f"prompt. With responses at the cap vLLM refuses the requests from step {first} on (HTTP 400), which "
        f"stops the run. Raise serve.max_model_len to {needed} or more (vLLM allows up to the model's context: "
        f"128000 for UI-TARS-1.5-7B), or lower model.history_images or {lower}")


def engine_options(cfg: RunConfig) -> dict[str, Any]:
    """How a rollout engine schedules its episodes (`rollout.mode`, `gather_window_s`, `max_batch`)."""
    r = cfg.rollout
    return {"mode": r.mode, "gather_window_s": r.gather_window_s, "max_batch": r.max_batch}


def check_gpus(cfg: RunConfig, policy: HFPolicy | None = None, *, on_gpus: bool | None = None) -> None:
    """A training run on a GPU that starts its own model server on a GPU must say which GPUs the
    server gets (serve.cuda_devices), or ConfigError: a server that inherits every GPU takes GPU 0,
    where the first training process holds the model (vLLM at serve.gpu_memory_utilization 0.9
    then refuses to start; the hf server loads a second copy beside it). `policy`: the trained
    policy when one is passed in (its device counts instead of model.device). `on_gpus`: whether
    the run's nodes have GPUs, for a launch checked from another machine (`train --dry-run`, which
    checks serve.cuda_devices against its own plan); None: this machine's devices."""
    if cfg.rollout.backend != "server" or server_urls(cfg):
        return
    from arpo_lib.agent.hf_policy import resolve_device

    if on_gpus is not None:
        trains_on = "cuda" if on_gpus and cfg.model.device != "cpu" else "cpu"
    else:
        trains_on = policy.device.type if policy is not None else resolve_device(cfg.model.device).type
    if cfg.serve.cuda_devices is not None:
        if trains_on == "cuda" and on_gpus is None:
            check_server_gpus_are_free(cfg)
        return
    if on_gpus is not None:
        on_cpu = cfg.serve.device == "cpu" if cfg.serve.backend == "vllm" else cfg.model.device == "cpu"
        serves_on = "cuda" if on_gpus and not on_cpu else "cpu"
    elif cfg.serve.backend == "vllm":
        serves_on = ServerSpec(cfg.model.path, backend="vllm", options={"device": cfg.serve.device}).vllm_device
    else:  # our hf server loads the model on model.device, as the trainer does
        serves_on = resolve_device(cfg.model.device).type
    if trains_on == "cuda" and serves_on == "cuda":
        servers = "each of the servers" if cfg.serve.replicas > 1 else "the server"
        raise ConfigError(
            f"serve.cuda_devices: this run trains on a GPU and starts its own {cfg.serve.backend} server on a GPU "
            f"without serve.cuda_devices, so the server would take GPU 0, where the first training process holds "
            f"the model. Give {servers} GPUs the training does not use (one entry per replica, e.g. "
            f"serve.cuda_devices=[1] beside one training process on GPU 0, or serve.cuda_devices=[4,5] for two "
            f"replicas beside four on GPUs 0-3), or serve.cuda_devices=[0] to share GPU 0 on purpose with "
            f"serve.gpu_memory_utilization lowered to what the trainer leaves; or use rollout.server_url for a "
            f"server started elsewhere")


def training_gpus(processes: int, visible: list[str] | None = None) -> list[str]:
    """The GPUs a node's `processes` training processes take: process k its k-th visible GPU
    (`visible`: CUDA_VISIBLE_DEVICES's list; none: the node's GPUs 0, 1, ...)."""
    return list(visible[:processes]) if visible else [str(i) for i in range(processes)]


def serving_gpus(cfg: RunConfig) -> list[str]:
    """The GPUs serve.cuda_devices gives the run's own servers, each once, in order."""
    named = [d.strip() for entry in cfg.serve.cuda_devices or [] for d in str(entry).split(",") if d.strip()]
    return list(dict.fromkeys(named))


@dataclasses.dataclass(frozen=True)
class GpuClash:
    """Training processes and the run's own servers on the same GPUs of a node."""

    training: list[str]
    """The GPUs the node's training processes take, process k the k-th."""
    shared: list[str]
    """Those of them serve.cuda_devices also gives the servers."""

    @property
    def processes_that_fit(self) -> int:
        """Training processes the node can start before the first GPU a server takes."""
        return self.training.index(self.shared[0])

    def fix(self) -> str:
        fit = self.processes_that_fit
        if fit == 0:
            return (f"give the servers GPUs the training processes do not take (serve.cuda_devices past GPU "
                    f"{self.training[-1]})")
        return (f"start fewer training processes: --nproc-per-node {fit} (train.nproc_per_node; under "
                f"scripts/slurm_train.sh ARPO_NPROC_PER_NODE={fit}), or give the servers other GPUs")

    def __str__(self) -> str:
        return (f"serve.cuda_devices: the run's servers would share GPU(s) {', '.join(self.shared)} with this node's "
                f"{len(self.training)} training processes (on GPUs {', '.join(self.training)}). {self.fix()}")


def server_gpu_clash(cfg: RunConfig, training: list[str]) -> GpuClash | None:
    """Where the GPUs serve.cuda_devices gives the run's servers overlap `training`, the GPUs a
    node's training processes take (`training_gpus`); None when they do not (or the servers run
    on the CPU)."""
    serving = set(serving_gpus(cfg))
    shared = [g for g in training if g in serving]
    return GpuClash(list(training), shared) if shared and cfg.serve.device != "cpu" else None


def check_server_gpus_are_free(cfg: RunConfig, environ: Mapping[str, str] | None = None) -> None:
    """ConfigError when the GPUs serve.cuda_devices gives the run's own servers are ones this node's
    training processes use (`server_gpu_clash`): `--nproc-per-node 8` beside servers on GPUs 6
    and 7 puts two trainers and two vLLM servers on the same GPUs."""
    environ = os.environ if environ is None else environ
    local = int(environ.get("LOCAL_WORLD_SIZE", 0) or 0)
    if local < 1:
        return  # not under torchrun: one process, on the GPU model.device names
    visible = [d.strip() for d in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if clash := server_gpu_clash(cfg, training_gpus(local, visible)):
        raise ConfigError(str(clash))


def resolve_task_sets(cfg: RunConfig) -> RunConfig:
    """`cfg` with the task-set names (`osworld/subset32`) of env.tasks, eval.tasks and select.tasks
    expanded into task names, and env.tasks' MiniWoB tasks into fixed instances
    (env.instances_per_task): a new config, the caller's unchanged (`cfg` itself when nothing
    expands). Needs the task data: a ConfigError says how to fetch it."""
    try:
        env_tasks = envs.expand_instances(envs.expand_task_names(cfg.env.tasks), cfg.env.instances_per_task)
        eval_tasks = envs.expand_task_names(cfg.eval.tasks) if cfg.eval.tasks else cfg.eval.tasks
        select_tasks = envs.expand_task_names(cfg.select.tasks) if cfg.select.tasks else cfg.select.tasks
    except (FileNotFoundError, ValueError) as exc:
        raise ConfigError(f"env.tasks: {exc}") from exc
    if (env_tasks, eval_tasks, select_tasks) == (cfg.env.tasks, cfg.eval.tasks, cfg.select.tasks):
        return cfg
    return dataclasses.replace(cfg, env=dataclasses.replace(cfg.env, tasks=env_tasks),
                               eval=dataclasses.replace(cfg.eval, tasks=eval_tasks),
                               select=dataclasses.replace(cfg.select, tasks=select_tasks))


def prepare(cfg: RunConfig) -> RunConfig:
    """A config ready to run: checked against the layers above the config tree (`check_config`)
    and its task sets expanded (`resolve_task_sets`). What `trainer` and `engine` run on; a
    workflow that reads the tasks beside an engine prepares first and hands the engine the result.
    Preparing a prepared config (the trainer's engine, an evaluation's) is free: nothing is checked
    or expanded twice unless the config changed in between."""
    if _stamped(cfg, _PREPARED):
        return cfg
    ready = resolve_task_sets(check_config(cfg))
    if ready is not cfg:  # expanded: the new config holds only names the check accepts
        _stamp(ready, _CHECKED)
    return _stamp(ready, _PREPARED)


# -- components ----------------------------------------------------------------------------------
def env_pool(cfg: RunConfig, share: int = 1) -> WorkerPool:
    """The run's environment workers: local processes or Ray actors (env.backend), in the
    interpreter env.python names (`auto`: the one the tasks' families need), importing the run's
    plug-ins. `share`: the number of training processes splitting the episodes (each gets its part
    of env.workers)."""
    opts = dict(cfg.env.options)
    opts.setdefault("max_steps", cfg.env.max_steps)
    if cfg.env.on_setup_failure != "run":  # validated: every task is an OSWorld one
        opts["on_setup_failure"] = cfg.env.on_setup_failure
    python = env_python(cfg)
    record_desktop_env(cfg)
    ray = {"ray_address": cfg.env.ray_address, "ray_resource": cfg.env.ray_resource,
           "ray_num_cpus": cfg.env.ray_num_cpus} if cfg.env.backend == "ray" else {}
    from arpo_lib.envs.workers.pool import make_pool

    return make_pool(math.ceil(cfg.env.workers / share), opts, cfg.env.step_timeout_s, cfg.env.envs_per_worker,
                     backend=cfg.env.backend, python=python, plugins=cfg.plugins,
                     memory_mib=cfg.env.worker_memory_mib, **ray)


def env_python(cfg: RunConfig) -> str | None:
    """The interpreter of the environment workers (env.python; `auto`: the one the families of
    the run's tasks need, e.g. OSWorld's own environment, else this one, None)."""
    python = cfg.env.python
    if python != "auto":
        return python
    tasks = cfg.env.tasks + (cfg.eval.tasks or []) + (cfg.select.tasks or [])
    families = {f.name: f for f in map(envs.family_of, tasks) if f.python is not None}
    if len(families) > 1:
        raise ConfigError(f"env.python: the tasks' families {', '.join(families)} each need an interpreter of "
                          "their own; run them separately")
    return next(iter(families.values())).python() if families else None


def record_desktop_env(cfg: RunConfig) -> dict[str, Any] | None:
    """`desktop_env_build` written to <run>/desktop_env.json (the run record: which checkers scored
    its rewards); a run that changes build on resume keeps the earlier ones in `previous`."""
    from arpo_lib.envs.osworld.build_info import desktop_env_of, same_build

    build = desktop_env_of(cfg)
    if build is None:
        return None

    path = cfg.run.root / "desktop_env.json"
    record = {**build, "previous": []}
    if path.is_file():
        try:
            old = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            old = None
        if old and same_build(old, build):
            return old
        if old:
            record["previous"] = [*old.pop("previous", []), old]
            log.warning("the run's desktop_env changed: %s -> %s; rewards before and after are scored by "
                        "different checkers", old.get("label"), build["label"])
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, (json.dumps(record, indent=1) + "\n").encode())
    return record


def hf_policy(cfg: RunConfig, path: str | Path | None = None, *, lora: bool = True,
              prompt: str | None = None, device: str | None = None, model: Any = None,
              trainable: bool = True) -> HFPolicy:
    """The in-process policy with every `model.*` switch and `agent.prompt` (or `prompt`).
    `lora=False` for inference on saved (merged) weights; `device` replaces model.device; `model`:
    a ready network instead of the checkpoint's weights (the benchmarks' random real shapes).
    `trainable=False` (an evaluation): one copy of the weights in the compute dtype, no training levers."""
    m = cfg.model
    if not trainable:
        return HFPolicy(path or m.path, device=device or m.device, compute_dtype=m.compute_dtype,
                        coord_mode=m.coord_mode, history_images=m.history_images, max_new_tokens=m.max_new_tokens,
                        kv_cache=m.kv_cache, prefill_batch_tokens=m.prefill_batch_tokens,
                        vision_attention=m.vision_attention, logprob_chunk=m.logprob_chunk,
                        prompt=prompt or cfg.agent.prompt, model=model, weights_dtype="compute")
    return HFPolicy(
        path or m.path, device=device or m.device, compute_dtype=m.compute_dtype, coord_mode=m.coord_mode,
        history_images=m.history_images, max_new_tokens=m.max_new_tokens,
        gradient_checkpointing=m.gradient_checkpointing,
        checkpoint_every_n_layers=m.checkpoint_every_n_layers, activation_offload=m.activation_offload,
        freeze_vision_tower=m.freeze_vision_tower,
        kv_cache=m.kv_cache, prefill_batch_tokens=m.prefill_batch_tokens, vision_attention=m.vision_attention,
        logprob_chunk=m.logprob_chunk, lora_rank=m.lora_rank if lora else 0, lora_alpha=m.lora_alpha,
        lora_dropout=m.lora_dropout, lora_seed=cfg.train.seed, frozen_weights_dtype=m.frozen_weights_dtype,
        prompt=prompt or cfg.agent.prompt, model=model)


def reference_model(cfg: RunConfig, device: torch.device, ranks: Ranks) -> Any:
    """The frozen KL reference: the model the run started from (`model.path`), read by rank 0
    and broadcast to the others."""
    from transformers import AutoModelForImageTextToText

    model = (AutoModelForImageTextToText.from_pretrained(cfg.model.path, dtype=torch.float32) if ranks.is_main
             else empty_model(cfg.model.path, device)).to(device).eval().requires_grad_(False)
    broadcast_model(model, ranks)
    return model


def server(cfg: RunConfig, model_path: str | None = None, replica: int = 0, port: int | None = None) -> ServerHandle:
    """Start the model server the config describes (`serve.*`) for `model_path` (default
    `model.path`); its pid and url go to <run>/server.json (replica i > 0 of a fleet:
    server_i.json, its log server_i.log). `port` overrides serve.port. Not yet healthy: `wait_healthy()`."""
    s = cfg.serve
    model_path = model_path or cfg.model.path
    if s.backend == "hf":
        options = {"device": cfg.model.device, "dtype": cfg.model.compute_dtype, "max_new_tokens": cfg.model.max_new_tokens}
    else:
        options = {"max_model_len": s.max_model_len, "max_images": cfg.model.history_images, "dtype": s.dtype,
                   "gpu_memory_utilization": s.gpu_memory_utilization, "enable_prefix_caching": True,
                   "device": s.device, "enforce_eager": s.enforce_eager, "weight_sync": s.weight_sync,
                   "tensor_parallel_size": s.tensor_parallel_size}
    run = cfg.run
    run.root.mkdir(parents=True, exist_ok=True)
    log_path, info_path = run.server_log, run.server_info
    if replica:
        log_path = log_path.with_name(f"{log_path.stem}_{replica}{log_path.suffix}")
        info_path = info_path.with_name(f"{info_path.stem}_{replica}{info_path.suffix}")
    env = {"CUDA_VISIBLE_DEVICES": s.cuda_devices[replica]} if s.cuda_devices else None
    log.info("starting the %s server for %s (log: %s)", s.backend, model_path, log_path)
    handle = start_server(model_path, backend=s.backend, host=s.host, port=port or s.port or None,
                          served_model_name=s.served_model_name, log_path=log_path, python=s.python,
                          api_key_env=s.api_key_env, env=env, **options)
    info_path.write_text(json.dumps({
        "pid": handle.pid, "url": handle.url, "base_url": handle.base_url, "model": handle.model,
        "backend": s.backend, "log_path": str(handle.log_path), "api_key_env": s.api_key_env}, indent=1))
    return handle


def server_policy(cfg: RunConfig, url: str | None = None, prompt: str | None = None) -> ServerPolicy:
    """A client policy for the server at `url` (default rollout.server_url), with `rollout.*`'s
    request settings."""
    r = cfg.rollout
    given = server_urls(cfg)
    started_here = url is not None and url not in given
    url = url or (given[0] if given else None)
    if not url:
        raise ValueError("rollout.backend=server needs rollout.server_url (or a server the workflow starts)")
    # a server this run started wants serve.api_key_env's key unless the client names its own
    key_env = r.api_key_env or (cfg.serve.api_key_env if started_here else None)
    return ServerPolicy(url, cfg.model.path, served_model=r.server_model, api_key_env=key_env,
                        coord_mode=cfg.model.coord_mode, history_images=cfg.model.history_images,
                        max_new_tokens=cfg.model.max_new_tokens, timeout_s=r.request_timeout_s,
                        retries=r.request_retries, constrained=r.constrained, prompt=prompt or cfg.agent.prompt)


def served_policy(cfg: RunConfig, trained: HFPolicy, backend: TrainingBackend) -> ServedPolicy:
    """Rollouts of a training run through a server (rollout.backend=server) that follows the
    trained policy's weights (rollout.weight_sync), read through the training `backend` (from
    the shards, with every rank, where no rank keeps the full model)."""
    r = cfg.rollout

    handed_out: set[int] = set()
    lock = threading.Lock()

    def start(model_dir: str, replica: int) -> ServerHandle:
        port = None
        if cfg.serve.replicas > 1:  # replicas start at once: each its own port, none handed out twice
            with lock:
                port = next(p for p in iter(lambda: free_port(cfg.serve.host), None) if p not in handed_out)
                handed_out.add(port)
        handle = server(cfg, model_path=model_dir, replica=replica, port=port)
        try:
            handle.wait_healthy(timeout_s=cfg.serve.startup_timeout_s)
        except BaseException:
            handle.stop()
            raise
        return handle

    def save() -> str:
        return str(save_for_server(backend.save_policy, cfg.run.server_weights))

    def weights() -> list[tuple[str, Any]]:  # checkpoint names (vLLM maps them), tied weights once
        return backend.full_weights()

    wire = getattr(torch, cfg.serve.dtype, None) if cfg.serve.dtype in ("float32", "bfloat16", "float16") else None
    # Over several nodes the other ranks reach the servers at an address of this node, not loopback.
    announce = announce_host(cfg.serve.announce_host) if spans_nodes() else None
    key = api_key_from_env(r.api_key_env or cfg.serve.api_key_env) if announce else None
    return ServedPolicy(connect=lambda url: server_policy(cfg, url), save_weights=save, sync=r.weight_sync,
                        url=r.server_url, start=start if r.server_url is None else None,
                        initial_model=trained.path, replicas=cfg.serve.replicas, weights=weights,
                        wire_dtype=wire, stream_host=r.stream_host, stream_backend=r.stream_backend,
                        announce_host=announce, api_key=key)


class RunEvaluation:
    """The evaluation a trainer runs: due every train.eval_every steps and at the last (0: only
    when asked); (engine, label, tasks) -> EvalResult in <run>/eval/<label>."""

    def __init__(self, cfg: RunConfig):
        self.cfg, self.run = cfg, cfg.run

    def due(self, step: int) -> bool:
        every = self.cfg.train.eval_every
        return bool(every) and (step % every == 0 or step == self.cfg.train.steps)

    def __call__(self, engine: RolloutEngine, label: str, tasks: list[str] | None = None,
                 spread: Spread | None = None) -> EvalResult:
        # The training engine: the run's prompt and environment options, so protocol `run`.
        return evaluate_run(engine, self.cfg, safe_join(self.run.eval_root, label), tasks=tasks,
                            description=f"eval {label}", protocol="run", spread=spread)


def evaluator(cfg: RunConfig) -> RunEvaluation:
    """The evaluation a trainer runs (`RunEvaluation`)."""
    return RunEvaluation(cfg)


def trainer(cfg: RunConfig, *, resume: bool = False, policy: HFPolicy | None = None,
            ranks: Ranks | None = None) -> Trainer:
    """A Trainer with everything it works with. `resume` continues the run in `cfg.run_dir` from
    its newest intact checkpoint (a run directory is never reused without it). A `policy`
    passed in (tests, notebooks holding a model) is used instead of loading `model.path`.
    Under torchrun (`ranks`: from its environment variables) this process joins the process
    group and trains its share on its own device (arpo_lib/training/distributed.py)."""
    cfg = prepare(cfg)
    check_gpus(cfg, policy)
    ranks = Ranks.from_env() if ranks is None else ranks
    if ranks.distributed:
        ranks = init_process_group(ranks, torch.device(device_for(ranks, cfg.model.device).replace("auto", "cpu")))
    run = cfg.run
    checkpoint = ckpt.resume_point(run, resume)
    barrier(ranks)  # every rank has looked at the run directory before rank 0 writes into it
    lora = cfg.model.lora_rank > 0
    if policy is None:
        # With LoRA a resume loads the base weights plus the saved adapter (the checkpoint's
        # merged weights would apply the adapter twice).
        model_path = str(checkpoint / "model") if checkpoint is not None and not lora else cfg.model.path
        device = device_for(ranks, cfg.model.device)
        # rank 0 reads the checkpoint, every other rank receives it (read once per run, not per rank)
        shell = None if ranks.is_main else empty_model(model_path, resolve_device(device))
        trained = hf_policy(cfg, model_path, device=device, model=shell)
        broadcast_model(trained.model, ranks)
    else:
        trained = policy
        if checkpoint is not None and not lora:
            trained.model.load_state_dict(ckpt.load_model_state(checkpoint / "model"))
    if checkpoint is not None and lora:
        trained.load_adapter(checkpoint / "model")
    reference = reference_model(cfg, trained.device, ranks) if cfg.algo.kl_coef > 0 else None
    t, r = cfg.train, cfg.rollout
    # With model servers and full fine-tuning, no rank keeps a full copy once training starts:
    # nothing generates in-process (training/backend.py, FSDP2). LoRA keeps it (the merge for
    # the servers needs the base weights whole).
    backend = training_backend(trained, ranks, micro_batch_size=t.micro_batch_size, token_budget=t.token_budget,
                               pack=t.pack, keep_full_model=r.backend != "server" or lora)
    served: ServedWeights | None = None
    if r.backend == "server":  # distributed: rank 0 keeps the server current, the others follow
        served = (served_policy(cfg, trained, backend) if ranks.is_main
                  else FollowingServed(connect=lambda url: server_policy(cfg, url), rank=ranks.rank))
    media = (TrackerMedia(cfg.run_dir, cfg.logging.wandb_episodes, cfg.logging.wandb_image_width)
             if cfg.logging.wandb != "disabled" else None)
    records = RunRecords(cfg, backend, media)
    rollouts = RolloutSource(trained, cfg.env.tasks, lambda: env_pool(cfg, ranks.world_size), backend, served=served,
                             run=run, group_size=r.group_size, temperature=r.temperature, top_p=r.top_p,
                             max_steps=cfg.env.max_steps, format_coef=cfg.algo.format_coef,
                             format_penalty=cfg.algo.format_penalty, seed=t.seed, progress=records.progress,
                             engine_options=engine_options(cfg), max_staleness=r.max_staleness)
    ws = cfg.warm_start
    sft = WarmStart(trained, backend, lambda: rollouts.pool, run=run, tasks=cfg.env.tasks,
                    demos_per_task=ws.demos_per_task, steps=ws.steps, lr=ws.lr, batch_size=ws.batch_size,
                    demo_replay=t.demo_replay, seed=t.seed, max_steps=cfg.env.max_steps, progress=records.progress,
                    done=checkpoint is not None)
    checkpoints = Checkpointer(run, backend, every=t.checkpoint_every, keep=t.keep_checkpoints, last_step=t.steps,
                               resume_from=checkpoint)
    return Trainer(cfg, trained, rollouts=rollouts, backend=backend, sft=sft, records=records,
                   checkpoints=checkpoints, evaluator=evaluator(cfg), reference=reference, resume=resume)


def response_cap(cfg: RunConfig, protocol: Any) -> int | None:
    """The engine's response cap under `protocol`: eval.max_new_tokens where a protocol sets a cap
    of its own and the run shortens it, else the protocol's; None = model.max_new_tokens."""
    if protocol.max_new_tokens is None:
        return None
    return cfg.eval.max_new_tokens or protocol.max_new_tokens


@contextlib.contextmanager
def engine(cfg: RunConfig, scripted: bool = False, protocol: str = "run") -> Iterator[RolloutEngine]:
    """A rollout engine for `cfg.model.path` without a trainer (evaluation, task selection): the
    in-process model, or a server (the one at rollout.server_url, or one started for the
    duration); environment workers as configured (env.backend, env.python). `scripted`: the
    scripted agent acts instead (its tokens scored by the model), an upper-bound baseline.
    `protocol` (evaluation.protocols): its prompt, OSWorld pause, sampling and action rules."""
    cfg = prepare(cfg)
    p = PROTOCOLS[protocol]
    if p.osworld_pause_s is not None and any(t.startswith("osworld/") for t in cfg.env.tasks + (cfg.eval.tasks or [])):
        cfg = copy.deepcopy(cfg)
        cfg.env.options = {**cfg.env.options, "pause_s": p.osworld_pause_s}
    handle, acting = None, None
    try:  # from the server's start: a stop while it loads (SIGTERM, Ctrl-C) must not orphan it
        if cfg.rollout.backend == "server":
            # Generation on the server: only the processor is loaded here (a GPU's memory stays vLLM's).
            urls = server_urls(cfg)
            if not urls:
                handle = server(cfg)
                handle.wait_healthy(timeout_s=cfg.serve.startup_timeout_s)
                urls = [handle.base_url]
            acting = connect_all(lambda url: server_policy(cfg, url, prompt=p.prompt), urls)
            log.info("generating with %s at %s", acting.served_model, ", ".join(urls))
        else:
            acting = hf_policy(cfg, lora=False, prompt=p.prompt, trainable=False)  # one copy, compute dtype
            if scripted:
                from arpo_lib.agent.scripted import ScriptedPolicy

                acting = ScriptedPolicy(acting)
        with env_pool(cfg) as pool:
            yield RolloutEngine(acting, pool, max_steps=cfg.env.max_steps, format_coef=cfg.algo.format_coef,
                                format_penalty=cfg.algo.format_penalty, rules=p.rollout_rules(response_cap(cfg, p)),
                                **engine_options(cfg))
    finally:
        if cfg.rollout.backend == "server" and acting is not None:
            acting.close()
        if handle is not None:
            handle.stop()
