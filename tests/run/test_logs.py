"""The library's log lines reach whatever stdout is current (terminal, notebook, pytest capture)."""
from __future__ import annotations

import io
import logging
import subprocess
import sys

import arpo_lib  # noqa: F401  (installs the default handler)
from arpo_lib.run.logs import ROOT


def test_info_lines_go_to_the_current_stdout(capsys):
    logging.getLogger("arpo_lib.training.trainer").info("warm start: %d SFT steps", 3)
    logging.getLogger("arpo_lib.build").warning("no server")
    out = capsys.readouterr().out
    assert "warm start: 3 SFT steps\n" in out and "warning: no server\n" in out


def test_a_replaced_stdout_receives_the_lines(monkeypatch):
    buffer = io.StringIO()
    monkeypatch.setattr(sys, "stdout", buffer)
    logging.getLogger("arpo_lib.x").info("hello")
    assert buffer.getvalue() == "hello\n"


def test_an_application_that_configures_logging_keeps_control():
    code = ("import logging, io, sys; stream = io.StringIO(); h = logging.StreamHandler(stream); "
            f"logging.getLogger({ROOT!r}).addHandler(h); import arpo_lib; "
            "logging.getLogger('arpo_lib.x').warning('mine'); "
            "assert len(logging.getLogger('arpo_lib').handlers) == 1; print(stream.getvalue().strip())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "mine"
