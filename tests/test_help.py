"""What `./workbench --help` and the commands' `--help` tell a new user: every command, every
notebook, how overrides are written."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _workbench_help() -> str:
    done = subprocess.run(["./workbench", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def _subcommands() -> list[str]:
    import argparse

    from arpo_lib import cli

    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return list(sub.choices)


def test_workbench_help_lists_every_command_with_one_line_each():
    text = _workbench_help()
    for case in re.findall(r"^  ([a-z][a-z-]+)\)", (ROOT / "workbench").read_text(), re.M):
        if case not in ("help",):
            assert f"./workbench {case}" in text, f"the wrapper's own {case} is not in --help"
    listed = re.findall(r"^  ([a-z][a-z-]+) {2,}\S", text.split("Commands of the arpo command line")[1], re.M)
    assert listed == _subcommands()
    assert {"train", "eval", "plan", "notebook", "compare", "osworld-tasks"} <= set(listed)


def test_workbench_help_needs_no_environment(tmp_path):
    """A fresh clone has no .venv yet: the help comes from the system's python3 without the set-up."""
    import shutil

    shutil.copytree(ROOT / "arpo_lib", tmp_path / "arpo_lib", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "workbench", tmp_path / "workbench")
    (tmp_path / "notebooks").mkdir()
    done = subprocess.run(["./workbench", "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "train " in done.stdout and "[setup]" not in done.stderr, done.stderr
    assert not (tmp_path / ".venv").exists()


def test_notebook_help_lists_every_notebook(capsys):
    from arpo_lib import cli

    try:
        cli.main(["notebook", "--help"])
    except SystemExit:
        pass
    text = " ".join(capsys.readouterr().out.split())
    for path in (ROOT / "notebooks").glob("*.ipynb"):
        assert path.stem in text


def test_eval_help_says_how_overrides_are_written(capsys):
    from arpo_lib import cli

    try:
        cli.main(["eval", "--help"])
    except SystemExit:
        pass
    text = capsys.readouterr().out
    flat = " ".join(text.split())
    assert "KEY=VALUE" in flat and "./workbench config --docs" in flat and "Hugging Face id" in flat
    # the example overrides are ones the config accepts
    example = re.search(r"overrides: KEY=VALUE.*?e\.g\.\n\s+([^\n]*)", text, re.S).group(1)
    from arpo_lib import build

    build.load_config("configs/smoke.yaml", [w.strip("'") for w in re.findall(r"'[^']*'|\S+", example)
                                             if not w.startswith("model.path")])
