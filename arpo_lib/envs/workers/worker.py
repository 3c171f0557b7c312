"""Environment worker processes: one environment (one browser or VM) per process.

The rollout engine talks to workers over pipes with three commands: reset, step, close (and
`ping`, which reports the worker's interpreter and process). Calls are sent to all workers first
and answered afterwards, so browsers work in parallel while the policy batches its model calls
across environments. A worker that does not answer within the timeout, or whose process died, is
killed and restarted; the episode it was running is reported as an infrastructure failure
(`EnvError`), never as a policy failure.

Two ways to start a worker, one protocol:
- `python=None` (the default): a `multiprocessing` spawn child of this interpreter, on a pipe.
- `python="/path/to/other/venv/bin/python"`: the worker runs in ANOTHER interpreter
  (`python -m arpo_lib.envs.workers.worker`), for backends whose packages cannot live beside ours
  (OSWorld's `desktop-env` pins old torch/numpy). It sees only this package (on PYTHONPATH) and
  its own site-packages, and connects back over a unix socket in a private directory with a
  random key it reads from stdin. Everything after the connection (the command loop, timeouts,
  restarts, killing the process group) is the same code for both.

A run's plug-ins (`plugins:` in its config) are imported by the worker before its first
environment is made, so a family a plug-in registers exists here too; a worker in another
interpreter gets the plug-ins' directories on its path.

`arpo_lib.envs.workers.pool` groups workers into pools: these local processes, or Ray actors
(`arpo_lib.envs.workers.ray_pool`) that each hold one local worker on a cluster node.

This module must not import torch: workers stay light (~50 MB + the browser).
"""
from __future__ import annotations

import hashlib
import importlib.util
import multiprocessing as mp
import os
import resource
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import asdict
from multiprocessing.connection import Client, Listener
from typing import Any

import arpo_lib
import desktop_sandbox
from arpo_lib.actions import Action
from arpo_lib.envs.base import EnvError
from arpo_lib.run.lifetime import end_group_with_parent
from arpo_lib.run.registry import import_plugins, plugin_path


CONNECT_TIMEOUT_S = 60.0
"""Longest a worker in another interpreter may take to start and connect back."""
DEFAULT_MEMORY_MIB = 8192
"""A worker's data memory (RLIMIT_DATA, the soft limit: heap and private mappings), by default.
The worker is where the host reads what the agent made: OSWorld's getters download the files the
agent saved and its metrics parse them (openpyxl, python-docx, lxml, PIL) in this process. A
3 MB document that unpacks to gigabytes would otherwise take the host's memory and, through the
kernel's OOM killer, most likely the trainer (the largest process). OSWorld's own evaluator
needs ~1.2 GiB once imported."""
OOM_SCORE_ADJ = 1000
"""Every worker (and what it starts: browsers, sandboxes, VM clients) is the kernel's first
choice when the host runs out of memory: an environment is restarted and its episode counted as
an infrastructure failure; a trainer killed loses the run's progress since its last checkpoint."""


def confine_worker(memory_mib: int | None) -> None:
    """Make this worker process the one the host can lose: the OOM killer's first choice, and a
    soft RLIMIT_DATA of `memory_mib` MiB (None: none). Soft only: the programs a worker starts
    (a sandbox's processes) set their own limits, which may be higher, below the unchanged hard
    limit; nothing the agent runs can reach this process to raise it."""
    try:
        with open("/proc/self/oom_score_adj", "w") as f:  # raising it needs no privilege
            f.write(str(OOM_SCORE_ADJ))
    except OSError:
        pass  # not Linux, or /proc read-only: the memory limit still holds
    if memory_mib is not None:
        hard = resource.getrlimit(resource.RLIMIT_DATA)[1]
        limit = memory_mib * 2**20
        if hard != resource.RLIM_INFINITY:
            limit = min(limit, hard)
        resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))


def check_memory_mib(memory_mib: Any) -> int | None:
    """`memory_mib` as a worker takes it, or ValueError naming what is wrong."""
    if memory_mib is None:
        return None
    if isinstance(memory_mib, bool) or not isinstance(memory_mib, int) or memory_mib < 256:
        raise ValueError(f"worker memory_mib must be an integer >= 256 (MiB) or None (no limit), got {memory_mib!r}")
    return memory_mib


def _worker_main(conn: Any, env_options: dict[str, Any], cache_size: int = 1, plugins: Sequence[str] = (),
                 memory_mib: int | None = None) -> None:
    # Own process group: the browser and its driver join it, so killing the group cleans up all.
    os.setsid()
    confine_worker(memory_mib)
    _group_watchdog()
    _exit_with_parent()
    from arpo_lib.envs import make_env, split_instance

    # Open environments by task name, least recently used first: switching back to a task
    # reuses its browser instead of starting a new one (~1 s).
    envs: OrderedDict[str, Any] = OrderedDict()
    env = None
    plugins_imported = False

    def close_quietly(e: Any) -> None:
        try:
            e.close()
        except Exception:
            pass

    try:
        while True:
            try:
                cmd, payload = conn.recv()
            except EOFError:
                break
            try:
                if cmd == "close":
                    break
                if cmd == "reset":
                    if not plugins_imported:  # here, so that a plug-in that fails is a setup error
                        import_plugins(plugins)
                        plugins_imported = True
                    name, seed = payload
                    # A fixed instance (`task@7`) is its task's environment reset with its own seed.
                    name, fixed = split_instance(name)
                    seed = seed if fixed is None else fixed
                    env = envs.pop(name, None)
                    if env is None:
                        while len(envs) >= cache_size:
                            close_quietly(envs.popitem(last=False)[1])
                        env = make_env(name, **env_options)
                    envs[name] = env
                    obs, info = env.reset(seed=seed)
                    conn.send(("ok", (obs, info)))
                elif cmd == "step":
                    if env is None:
                        raise EnvError("step before reset")
                    conn.send(("ok", step_actions(env, payload)))
                elif cmd == "ping":
                    conn.send(("ok", worker_facts()))
                else:
                    conn.send(("error", f"unknown command {cmd!r}"))
            except Exception as exc:  # reported to the engine, which decides what it means
                kind = "fatal" if _is_setup_error(exc) else "env_error"
                if env is not None and kind == "env_error":
                    # A broken environment is dropped; the next reset builds a fresh one.
                    for name, e in list(envs.items()):
                        if e is env:
                            del envs[name]
                    close_quietly(env)
                    env = None
                conn.send((kind, f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}"))
    finally:
        for e in envs.values():
            close_quietly(e)


def _group_watchdog() -> "subprocess.Popen[bytes]":
    """A tiny shell in this worker's process group that kills the group once the worker is gone,
    however it went: a worker SIGKILLed on its own (Ray's raylet kills a dead actor's child
    processes, not their children) would otherwise leave its browser and driver running,
    orphaned to init. It costs one `sh` and a `kill -0` a second."""
    me, group = os.getpid(), os.getpgid(0)
    script = f"while kill -0 {me} 2>/dev/null; do sleep 1; done; kill -9 -{group} 2>/dev/null"
    return subprocess.Popen(["/bin/sh", "-c", script], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, close_fds=True)


def _exit_with_parent() -> None:
    """Kill this worker's process group (itself, the browser, the VM client) when the process
    that started it disappears. An idle worker sees EOF on its connection anyway; this covers a
    worker stuck inside a browser call when its parent is SIGKILLed (a Ray actor killed on
    timeout, a trainer killed by the OOM killer)."""
    end_group_with_parent()


def step_actions(env: Any, payload: list[dict[str, Any]]) -> tuple:
    """Step `env` with each action of one response (`action_payload`) until the episode ends.
    Returns the last step's (obs, reward, terminated, truncated, info), its info's `action_error`
    holding every action's, not only the last one's."""
    result, errors = None, []
    for action_dict in payload:
        result = env.step(Action(**action_dict))
        if isinstance(result[4], dict) and result[4].get("action_error"):
            errors.append(str(result[4]["action_error"]))
        if result[2] or result[3]:
            break
    if errors and isinstance(result[4], dict):
        result[4]["action_error"] = "; ".join(errors)
    return result


def worker_facts() -> dict[str, Any]:
    """What the `ping` command answers: which interpreter and process serve this environment, its
    memory limit and OOM score (`confine_worker`), the memory it holds now and the most it has held."""
    return {
        "executable": sys.executable,
        "prefix": sys.prefix,
        "version": sys.version.split()[0],
        "pid": os.getpid(),
        "pgid": os.getpgid(0),
        "sys_path": list(sys.path),
        "torch_loaded": "torch" in sys.modules,
        "torch_importable": importlib.util.find_spec("torch") is not None,
        "memory_limit_mib": _data_limit_mib(),
        "oom_score_adj": _oom_score_adj(),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,  # Linux: KiB
        "rss_mib": _rss_mib(),
    }


def _rss_mib() -> int | None:
    """The memory this process holds now (its start-up peak, in `peak_rss_mib`, can be far above)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize() // 2**20
    except (OSError, ValueError, IndexError):
        return None


def _data_limit_mib() -> int | None:
    soft = resource.getrlimit(resource.RLIMIT_DATA)[0]
    return None if soft == resource.RLIM_INFINITY else soft // 2**20


def _oom_score_adj() -> int | None:
    try:
        with open("/proc/self/oom_score_adj") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


class EnvSetupError(RuntimeError):
    """The environment cannot be created at all (unknown name, missing browser, bad option, an
    interpreter that does not exist or cannot import arpo_lib): retrying will not help, so the run
    stops with the worker's message."""


def answer(status: str, value: Any) -> Any:
    """A worker's (status, value) reply as the engine sees it: the value, EnvError (an
    infrastructure failure of this episode) or EnvSetupError (the run cannot go on)."""
    if status == "ok":
        return value
    if status == "env_error":
        raise EnvError(value)
    raise EnvSetupError(value)


def _is_setup_error(exc: BaseException) -> bool:
    if isinstance(exc, EnvError):
        return False
    return isinstance(exc, (ValueError, TypeError, ImportError, FileNotFoundError)) or \
        type(exc).__name__ == "BrowserNotFoundError"


class _InterpreterProcess:
    """A worker started with another interpreter, seen through the part of
    `multiprocessing.Process` that `EnvWorker` uses (pid, is_alive, exitcode, kill, join)."""

    def __init__(self, popen: subprocess.Popen):
        self.popen = popen
        self.pid = popen.pid

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def kill(self) -> None:
        self.popen.kill()

    def join(self, timeout: float | None = None) -> None:
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass


def _resolve_interpreter(python: str | None) -> str | None:
    """None when `python` is this interpreter (the spawn path), else its absolute path.

    Paths are compared without resolving symlinks: every venv's python links to the same base
    interpreter, but each venv is a different environment."""
    if python is None or os.path.abspath(python) == os.path.abspath(sys.executable):
        return None
    path = python if os.sep in python else shutil.which(python)
    if not path or not os.path.isfile(path) or not os.access(path, os.X_OK):
        raise EnvSetupError(f"environment worker interpreter {python!r} does not exist or is not executable")
    path = os.path.abspath(path)
    return None if path == os.path.abspath(sys.executable) else path


def _interpreter_env(extra_path: Sequence[str] = ()) -> dict[str, str]:
    """Our environment, but with only this package and the desktop sandbox's (and `extra_path`: the
    plug-ins' directories) on the path: none of our venv's packages."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONHOME", "PYTHONPATH", "VIRTUAL_ENV")}
    packages = [os.path.dirname(os.path.abspath(m.__file__)) for m in (arpo_lib, desktop_sandbox)]
    root = os.path.dirname(packages[0])
    if os.path.basename(root) in ("site-packages", "dist-packages"):
        # Installed into our venv (not editable): that directory would bring all our packages
        # along, so the worker gets one that holds links to these packages alone, under the
        # user's cache (a fixed name in /tmp could be planted by another user).
        digest = hashlib.sha256(packages[0].encode()).hexdigest()[:12]
        root = os.path.join(os.path.expanduser("~"), ".cache", "arpo-workbench", "worker-path", digest)
        for package in packages:
            link = os.path.join(root, os.path.basename(package))
            if not os.path.islink(link):
                os.makedirs(root, exist_ok=True)
                staging = f"{link}.{os.getpid()}"
                os.symlink(package, staging)
                os.replace(staging, link)
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([root, *extra_path]))
    return env


def _dup_or_devnull(fd: int) -> int:
    try:
        return os.dup(fd)
    except OSError:  # this process runs without that stream
        return os.open(os.devnull, os.O_WRONLY)


def _tail(path: str, limit: int = 4000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - limit))
            return f.read().decode(errors="replace").strip()
    except OSError:
        return ""


class EnvWorker:
    """A handle on one worker process.

    `python`: run the worker with this interpreter (another venv's python) instead of a spawn
    child of ours; None, or our own `sys.executable`, keeps the spawn path.
    `plugins`: modules the worker imports before it makes an environment (the run's plug-ins).
    `memory_mib`: the worker's data memory limit (`confine_worker`; None: none).
    `fresh_interpreter`: start `python -m arpo_lib.envs.workers.worker` even with our own interpreter.
    For hosts whose main module is not ours: a spawn child re-imports the parent's `__main__`,
    which in a Ray actor is Ray's worker script (+65 MB and a Ray import per worker).
    """

    def __init__(self, env_options: dict[str, Any], timeout_s: float, cache_size: int = 1, *,
                 python: str | None = None, fresh_interpreter: bool = False, plugins: Sequence[str] = (),
                 memory_mib: int | None = DEFAULT_MEMORY_MIB):
        self.env_options = env_options
        self.memory_mib = check_memory_mib(memory_mib)
        self.timeout_s = timeout_s
        self.cache_size = cache_size
        self.plugins = list(plugins)
        self.python = _resolve_interpreter(python)
        if self.python is None and fresh_interpreter:
            self.python = os.path.abspath(sys.executable)
        self._ctx = mp.get_context("spawn")
        self.restarts = 0
        # an episode's thread restarts a worker whose connection broke while the trainer's thread
        # closes the pool (a batch playing ahead at the end of a run): one at a time, and a closed
        # worker stays closed (its process was half started under the close, or outlived it)
        self._lifecycle = threading.RLock()
        self._closed = False
        self._start()

    def _start(self) -> None:
        if self.python is None:
            self.conn, child = self._ctx.Pipe()
            self.process = self._ctx.Process(
                target=_worker_main, args=(child, self.env_options, self.cache_size, self.plugins, self.memory_mib),
                daemon=True)
            self.process.start()
            child.close()
        else:
            self._start_interpreter()
        self.busy = False

    # -- the other-interpreter path --------------------------------------------------------------
    def _start_interpreter(self) -> None:
        # The directory holds the socket and the start-up output, and lives only until the worker
        # connected: nothing is left on disk however the worker or this process ends later.
        private_dir = tempfile.mkdtemp(prefix="arpo-envworker-")  # mode 0700: ours only
        address = os.path.join(private_dir, "worker.sock")
        startup_log = os.path.join(private_dir, "startup.log")
        authkey = secrets.token_bytes(32)
        env = _interpreter_env(plugin_path(self.plugins))
        # Once connected, the worker writes to our stdout/stderr, as a spawn child does.
        console = (_dup_or_devnull(1), _dup_or_devnull(2))
        try:
            with Listener(address, family="AF_UNIX", authkey=authkey) as listener:  # closing removes the socket
                with open(startup_log, "wb") as log:
                    try:
                        popen = subprocess.Popen(
                            [self.python, "-m", "arpo_lib.envs.workers.worker", address, *map(str, console)],
                            stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, pass_fds=console, env=env)
                    except OSError as exc:
                        raise EnvSetupError(f"cannot start environment worker interpreter {self.python!r}: {exc}") \
                            from exc
                self.process = _InterpreterProcess(popen)
                try:
                    popen.stdin.write(authkey.hex().encode() + b"\n")  # never argv: other users can read that
                    popen.stdin.close()
                except OSError:
                    pass  # it died at once; _accept reports why
                self.conn = self._accept(listener, address, authkey, startup_log, env["PYTHONPATH"])
        finally:
            for fd in console:
                os.close(fd)
            shutil.rmtree(private_dir, ignore_errors=True)
        self.conn.send((self.env_options, self.cache_size, self.plugins, self.memory_mib))

    def _accept(self, listener: Listener, address: str, authkey: bytes, startup_log: str, pythonpath: str) -> Any:
        """The worker's connection, waiting while it lives and at most CONNECT_TIMEOUT_S."""
        box: dict[str, Any] = {}

        def accept() -> None:
            try:
                box["conn"] = listener.accept()
            except Exception as exc:
                box["error"] = exc

        thread = threading.Thread(target=accept, daemon=True, name="arpo-envworker-accept")
        thread.start()
        deadline = time.monotonic() + CONNECT_TIMEOUT_S
        failure = None
        while thread.is_alive():
            thread.join(0.05)
            if not thread.is_alive():
                break
            if not self.process.is_alive():
                failure = f"exited with code {self.process.exitcode} before connecting"
            elif time.monotonic() > deadline:
                failure = f"did not connect within {CONNECT_TIMEOUT_S:.0f} s"
            if failure:
                try:  # accept() has no timeout: connecting ourselves ends it
                    Client(address, family="AF_UNIX", authkey=authkey).close()
                except Exception:
                    pass
                thread.join(5)
                break
        if failure is None and "error" in box:
            failure = f"failed to connect: {box['error']!r}"
        if failure is None:
            return box["conn"]
        if "conn" in box:
            box["conn"].close()
        self.process.join(0.5)  # let its last words reach the log
        self.conn = None
        self.kill()
        raise EnvSetupError(f"the environment worker in {self.python} {failure} (it needs pillow and the "
                            f"environment's own packages; arpo_lib comes from PYTHONPATH={pythonpath}). "
                            f"Its output:\n{_tail(startup_log) or '(nothing)'}")

    # -- the protocol (both paths) ----------------------------------------------------------------
    def send(self, cmd: str, payload: Any = None) -> None:
        try:
            self.conn.send((cmd, payload))
            self.busy, self.sent_at = True, time.monotonic()
        except (BrokenPipeError, OSError) as exc:
            self.restart()
            raise EnvError(f"worker pipe broken: {exc}") from exc

    def ready(self) -> bool:
        """The answer to the last command is in, or `recv` would raise at once (the process died):
        `recv` then does not block. An asynchronous rollout asks this of every busy worker."""
        if time.monotonic() - getattr(self, "sent_at", 0.0) > self.timeout_s:
            return True  # recv raises its timeout (after waiting once more)
        try:
            return self.conn.poll(0) or not self.process.is_alive()
        except (OSError, ValueError):  # a closed connection: recv raises
            return True

    def recv(self) -> Any:
        """The answer to the last command; raises EnvError (after restarting) on crash or timeout."""
        deadline = time.monotonic() + self.timeout_s
        try:
            while not self.conn.poll(0.05):
                if not self.process.is_alive():
                    raise EnvError(f"worker process died (exit code {self.process.exitcode})")
                if time.monotonic() > deadline:
                    raise EnvError(f"environment call timed out after {self.timeout_s:.0f} s")
            status, value = self.conn.recv()
        except (EOFError, OSError) as exc:
            self.restart()
            raise EnvError(f"worker connection lost: {exc}") from exc
        except EnvError:
            self.restart()
            raise
        finally:
            self.busy = False
        return answer(status, value)

    def call(self, cmd: str, payload: Any = None) -> Any:
        self.send(cmd, payload)
        return self.recv()

    def restart(self) -> None:
        with self._lifecycle:
            self.restarts += 1
            self.kill()
            if not self._closed:
                self._start()

    def kill(self) -> None:
        try:
            if self.conn is not None:
                self.conn.close()
        except Exception:
            pass
        # The browser and driver are in the worker's process group: they must not outlive it.
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError, TypeError):
            pass
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=10)

    def close(self) -> None:
        with self._lifecycle:
            self._closed = True
            if self.process.is_alive():
                try:
                    self.conn.send(("close", None))
                    self.process.join(timeout=15)
                except Exception:
                    pass
            self.kill()  # also reaps any browser process left in the worker's group


def action_payload(actions: list[Action]) -> list[dict[str, Any]]:
    return [asdict(a) for a in actions]


def _serve(address: str, stdout_fd: int, stderr_fd: int) -> None:
    """The worker side of the other-interpreter path: connect back, then the common loop."""
    authkey = bytes.fromhex(sys.stdin.readline().strip())
    conn = Client(address, family="AF_UNIX", authkey=authkey)
    # Connected: from now on write where the parent writes (start-up errors went to its log).
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(stdout_fd, 1)
    os.dup2(stderr_fd, 2)
    os.close(stdout_fd)
    os.close(stderr_fd)
    env_options, cache_size, plugins, memory_mib = conn.recv()
    _worker_main(conn, env_options, cache_size, plugins, memory_mib)


if __name__ == "__main__":
    # Run the copy imported under the package name, so pickled classes have one identity.
    from arpo_lib.envs.workers import worker as _module

    _module._serve(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
