"""A process that ends with the process that started it: environment workers (their parent, the
trainer or a Ray actor) and training ranks (torchrun). Each kills its own process group, so what
it started there (a browser, a driver, a VM client) goes with it."""
from __future__ import annotations

import os
import signal
import sys
import threading
import time


def end_group(message: str | None = None) -> None:
    """SIGKILL this process's group at once, saying `message` on stderr first."""
    if message:
        print(message, file=sys.stderr, flush=True)
    os.killpg(os.getpgid(0), signal.SIGKILL)


def end_group_with_parent(parent: int | None = None, interval_s: float = 1.0, message: str | None = None) -> None:
    """A daemon thread that ends this process's group (`end_group`) once its parent process
    (`parent`, by default the current one) is gone: the process was reparented."""
    parent = os.getppid() if parent is None else parent

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval_s)
        end_group(message)

    threading.Thread(target=watch, daemon=True, name="arpo-end-with-parent").start()
