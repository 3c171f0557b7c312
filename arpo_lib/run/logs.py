"""The library's log lines, shown the same way in a terminal and in a notebook.

Every module logs through `logging.getLogger(__name__)`; this module gives the package's root
logger (`arpo_lib`) one handler that writes plain messages to whatever `sys.stdout` is at the
moment of writing (a terminal, a Jupyter kernel's stream, pytest's capture), unless the
application has configured logging for it. Progress stays on tqdm bars.
"""
from __future__ import annotations

import logging
import sys

ROOT = "arpo_lib"


class _CurrentStdout(logging.StreamHandler):
    """A StreamHandler bound to the current `sys.stdout` at each record, not at creation:
    Jupyter and pytest replace `sys.stdout` after the library was imported."""

    def __init__(self) -> None:
        super().__init__(sys.stdout)

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stdout
        super().emit(record)


class _Format(logging.Formatter):
    """`message` for INFO, `warning: message` / `error: message` above it."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        if record.levelno >= logging.WARNING:
            return f"{record.levelname.lower()}: {text}"
        return text


def install_default_handler() -> None:
    """Show the library's INFO lines on stdout, once, unless someone configured the `arpo_lib`
    logger already (then their handlers and levels apply)."""
    logger = logging.getLogger(ROOT)
    if logger.handlers or getattr(logger, "_arpo_default", False):
        return
    handler = _CurrentStdout()
    handler.setFormatter(_Format("%(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    logger._arpo_default = True  # type: ignore[attr-defined]
