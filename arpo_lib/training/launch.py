"""Training on several processes from a notebook: the same entry point as the command line
(`python -m arpo_lib train --nproc-per-node N`, torchrun underneath) started as a subprocess, its
output and per-step metrics streamed into the notebook.

    trainer = workflows.open_trainer(cfg, nproc_per_node=2)   # a LaunchedTrainer
    history = trainer.train(on_step=workflows.print_step)      # blocks; interrupt = stop the run

A `LaunchedTrainer` stands in for the in-process `Trainer` where a notebook uses one: both are a
`training.contracts.RunTrainer` (`train`, `warm_start`, `step`, `replay`, `run`, `close`). The processes do the
work, this object watches `metrics.jsonl` and the checkpoints. A stopped or interrupted run
resumes on the next `train`.
"""
from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable

from arpo_lib.algo import ReplayBuffer
from arpo_lib.run import layout
from arpo_lib.run.config import RunConfig, save_config
from arpo_lib.run.records import read_jsonl

NOISE = ("OMP_NUM_THREADS", "*****")
"""torchrun's banner lines, not worth a notebook's attention."""


class LaunchedTrainer:
    """A run trained by `nproc_per_node` processes under torchrun, watched from this process."""

    def __init__(self, cfg: RunConfig, nproc_per_node: int, *, python: str = sys.executable):
        if nproc_per_node < 1:
            raise ValueError(f"nproc_per_node must be at least 1, not {nproc_per_node}")
        self.cfg, self.nproc_per_node, self.python = cfg, nproc_per_node, python
        self.run = cfg.run
        self.run_dir = self.run.root
        self.process: subprocess.Popen | None = None
        self.output: deque[str] = deque(maxlen=200)
        """The processes' last lines of output (for the error message of a failed run)."""
        self._replay: tuple[Path, ReplayBuffer] | None = None

    # -- what a notebook reads ---------------------------------------------------------------------
    @property
    def step(self) -> int:
        return len(read_jsonl(self.run.metrics)) if self.run.metrics.exists() else 0

    @property
    def replay(self) -> ReplayBuffer:
        """The replay buffer of the newest checkpoint (empty before the first)."""
        from arpo_lib.training.checkpoint import latest_checkpoint

        ckpt = latest_checkpoint(self.run.checkpoints)
        if ckpt is None:
            return ReplayBuffer(enabled=self.cfg.algo.replay.enabled)
        if self._replay is None or self._replay[0] != ckpt:  # read once per checkpoint
            self._replay = (ckpt, ReplayBuffer.load(ckpt / layout.REPLAY))
        return self._replay[1]

    def warm_start(self) -> list[float]:
        """Nothing here: the launched run warm-starts itself before its first step (rank 0 trains,
        every rank receives the weights); its losses go to <run>/warm_start.jsonl."""
        return []

    def command(self) -> list[str]:
        """The command line that trains the run (resuming it when it exists)."""
        return [self.python, "-m", "arpo_lib", "train", "--config", str(self.run.root / "launch.yaml"), "--resume",
                f"--nproc-per-node={self.nproc_per_node}"]

    # -- training ----------------------------------------------------------------------------------
    def train(self, on_step: Callable[[dict[str, Any]], None] | None = None, echo: bool = True,
              poll_s: float = 0.5) -> list[dict[str, Any]]:
        """Run (or resume) the training to `train.steps`; call `on_step(metrics)` for each step as
        rank 0 records it and echo the processes' output. Returns the new steps' metrics; raises
        RuntimeError with the output's tail when the run fails. KeyboardInterrupt stops it (the
        checkpoints stay; the next `train` resumes)."""
        from tqdm.auto import tqdm

        self.run.root.mkdir(parents=True, exist_ok=True)
        save_config(self.cfg, self.run.root / "launch.yaml")
        seen = self.step
        lines: queue.Queue[str | None] = queue.Queue()
        self.process = subprocess.Popen(self.command(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        bufsize=1, start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        reader = threading.Thread(target=_pump, args=(self.process.stdout, lines), daemon=True)
        reader.start()
        history: list[dict[str, Any]] = []
        bar = tqdm(total=self.cfg.train.steps, initial=seen, desc=f"{self.nproc_per_node} processes",
                   disable=not self.cfg.logging.progress)
        try:
            while True:
                done = self.process.poll() is not None
                self._drain(lines, echo)
                new = read_jsonl(self.run.metrics)[seen:] if self.run.metrics.exists() else []
                for metrics in new:
                    history.append(metrics)
                    if on_step is not None:
                        on_step(metrics)
                    bar.update(1)
                seen += len(new)
                if done:
                    break
                time.sleep(poll_s)
        except KeyboardInterrupt:
            self.close()
            raise
        finally:
            bar.close()
        reader.join(timeout=5)
        self._drain(lines, echo)
        if self.process.returncode != 0:
            tail = "\n".join(self.output)
            raise RuntimeError(f"the training processes failed (exit {self.process.returncode}); "
                               f"their last output:\n{tail}")
        return history

    def _drain(self, lines: "queue.Queue[str | None]", echo: bool) -> None:
        while True:
            try:
                line = lines.get_nowait()
            except queue.Empty:
                return
            if line is None:
                return
            self.output.append(line)
            if echo and not any(n in line for n in NOISE):
                print(line, flush=True)

    def close(self) -> None:
        """Stop the processes if they still run (torchrun passes the signal on to every rank)."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()

    def __enter__(self) -> "LaunchedTrainer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _pump(stream: Any, lines: "queue.Queue[str | None]") -> None:
    for line in stream:
        lines.put(line.rstrip("\n"))
    lines.put(None)
