"""Environment worker processes: one environment (one browser or VM) per process.

The rollout engine talks to workers over pipes with three commands: reset, step, close.
Calls are sent to all workers first and answered afterwards, so browsers work in parallel while
the policy batches its model calls across environments. A worker that does not answer within
the timeout, or whose process died, is killed and restarted; the episode it was running is
reported as an infrastructure failure (`EnvError`), never as a policy failure.

This module must not import torch: spawned workers stay light (~50 MB + the browser).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
import traceback
from collections import OrderedDict
from dataclasses import asdict
from typing import Any

from arpo_lib.actions import Action
from arpo_lib.envs.base import EnvError


def _worker_main(conn: Any, env_options: dict[str, Any], cache_size: int = 1) -> None:
    # Own process group: the browser and its driver join it, so killing the group cleans up all.
    os.setsid()
    from arpo_lib.envs import make_env

    # Open environments by task name, least recently used first: switching back to a task
    # reuses its browser instead of starting a new one (~1 s).
    envs: OrderedDict[str, Any] = OrderedDict()
    env = None

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
                    name, seed = payload
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
                    result = None
                    for action_dict in payload:
                        result = env.step(Action(**action_dict))
                        if result[2] or result[3]:
                            break
                    conn.send(("ok", result))
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


class EnvSetupError(RuntimeError):
    """The environment cannot be created at all (unknown name, missing browser, bad option):
    retrying will not help, so the run stops with the worker's message."""


def _is_setup_error(exc: BaseException) -> bool:
    if isinstance(exc, EnvError):
        return False
    return isinstance(exc, (ValueError, TypeError, ImportError, FileNotFoundError)) or \
        type(exc).__name__ == "BrowserNotFoundError"


class EnvWorker:
    """A handle on one worker process."""

    def __init__(self, env_options: dict[str, Any], timeout_s: float, cache_size: int = 1):
        self.env_options = env_options
        self.timeout_s = timeout_s
        self.cache_size = cache_size
        self._ctx = mp.get_context("spawn")
        self.restarts = 0
        self._start()

    def _start(self) -> None:
        self.conn, child = self._ctx.Pipe()
        self.process = self._ctx.Process(target=_worker_main, args=(child, self.env_options, self.cache_size), daemon=True)
        self.process.start()
        child.close()
        self.busy = False

    def send(self, cmd: str, payload: Any = None) -> None:
        try:
            self.conn.send((cmd, payload))
            self.busy = True
        except (BrokenPipeError, OSError) as exc:
            self.restart()
            raise EnvError(f"worker pipe broken: {exc}") from exc

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
        if status == "ok":
            return value
        if status == "env_error":
            raise EnvError(value)
        raise EnvSetupError(value)

    def call(self, cmd: str, payload: Any = None) -> Any:
        self.send(cmd, payload)
        return self.recv()

    def restart(self) -> None:
        self.restarts += 1
        self.kill()
        self._start()

    def kill(self) -> None:
        try:
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
        if self.process.is_alive():
            try:
                self.conn.send(("close", None))
                self.process.join(timeout=15)
            except Exception:
                pass
        self.kill()  # also reaps any browser process left in the worker's group


class EnvPool:
    """`n` worker processes sharing the same make_env options."""

    def __init__(self, n: int, env_options: dict[str, Any] | None = None, timeout_s: float = 120.0,
                 cache_size: int = 1):
        self.workers = [EnvWorker(dict(env_options or {}), timeout_s, cache_size) for _ in range(n)]

    def __len__(self) -> int:
        return len(self.workers)

    @property
    def restarts(self) -> int:
        return sum(w.restarts for w in self.workers)

    def close(self) -> None:
        for w in self.workers:
            w.close()

    def __enter__(self) -> "EnvPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def action_payload(actions: list[Action]) -> list[dict[str, Any]]:
    return [asdict(a) for a in actions]
