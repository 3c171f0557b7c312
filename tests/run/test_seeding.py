"""Seeds from names, and the fingerprint of a host's numerics that the recorded notebooks carry."""
from __future__ import annotations

import subprocess
import sys

import torch

from arpo_lib.run import seeding


def test_stable_seed_is_the_same_in_another_process():
    here = seeding.stable_seed(3, "demo", "miniwob/click-test", 1)
    there = subprocess.run([sys.executable, "-c", "from arpo_lib.run.seeding import stable_seed; "
                            "print(stable_seed(3, 'demo', 'miniwob/click-test', 1))"],
                           capture_output=True, text=True, check=True).stdout.strip()
    assert str(here) == there and 0 <= here < 2**31
    assert seeding.stable_seed(3, "demo") != seeding.stable_seed(4, "demo")


def test_numerics_fingerprint_names_what_changes_the_rounding(monkeypatch):
    line = seeding.numerics_fingerprint()
    assert line.startswith(f"torch {torch.__version__}, cpu {torch.backends.cpu.get_cpu_capability()} (")
    assert f"{torch.get_num_threads()} threads" in line and "\n" not in line
    # the thread count is part of it: reductions are split per thread
    monkeypatch.setattr(torch, "get_num_threads", lambda: 977)
    assert "977 threads" in seeding.numerics_fingerprint() and seeding.numerics_fingerprint() != line


def test_numerics_fingerprint_without_proc_cpuinfo(monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError("no /proc here")

    monkeypatch.setattr("builtins.open", refuse)
    assert "(unknown)" in seeding.numerics_fingerprint()


def test_the_recorded_notebooks_name_a_browser_and_a_fingerprint():
    from pathlib import Path

    lines = (Path(__file__).resolve().parents[2] / "notebooks" / "RECORDED_WITH").read_text().splitlines()
    assert len(lines) == 2 and lines[1].startswith("torch "), lines
