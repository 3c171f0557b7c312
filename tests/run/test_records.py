"""Durable run records: appends survive a kill, torn lines are skipped, names stay inside the run."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from arpo_lib.run.records import append_jsonl, atomic_write_bytes, atomic_write_text, read_jsonl, safe_join, safe_name


def test_append_and_read_back_skipping_a_torn_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    append_jsonl(path, {"step": 1})
    append_jsonl(path, {"step": 2, "tasks": ["a"]})
    with open(path, "a") as fh:
        fh.write('{"step": 3, "loss"')  # a line torn by a crash mid-write
    assert read_jsonl(path) == [{"step": 1}, {"step": 2, "tasks": ["a"]}]
    assert read_jsonl(tmp_path / "missing.jsonl") == []


def test_non_object_lines_are_not_records(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text('[1, 2]\n"text"\n{"ok": true}\n')
    assert read_jsonl(path) == [{"ok": True}]


def test_a_killed_appender_loses_at_most_its_last_line(tmp_path):
    path = tmp_path / "log.jsonl"
    code = ("import sys, os, signal; from arpo_lib.run.records import append_jsonl\n"
            f"for i in range(50): append_jsonl(__import__('pathlib').Path({str(path)!r}), {{'i': i}})\n"
            "os.kill(os.getpid(), signal.SIGKILL)")
    subprocess.run([sys.executable, "-c", code])
    assert [r["i"] for r in read_jsonl(path)] == list(range(50))


def test_atomic_write_replaces_whole_files_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "state.json"
    atomic_write_text(path, json.dumps({"v": 1}))
    atomic_write_bytes(path, b'{"v": 2}')
    assert json.loads(path.read_text()) == {"v": 2}
    assert os.listdir(tmp_path) == ["state.json"]


@pytest.mark.parametrize("text, name", [
    ("miniwob/click-test", "miniwob_click-test"),
    ("../../etc/passwd", "etc_passwd"),
    (".hidden", "hidden"),
    ("", "task"),
    ("..", "task"),
    ("a" * 300, "a" * 120),
])
def test_safe_name_is_one_plain_component(text, name):
    assert safe_name(text) == name


def test_safe_join_never_leaves_its_base(tmp_path):
    assert safe_join(tmp_path, "eval", "../x") == tmp_path / "eval" / "x"
    assert safe_join(tmp_path, "a/b") == tmp_path / "a_b"
    (tmp_path / "link").symlink_to("/")
    with pytest.raises(ValueError, match="would leave"):
        safe_join(tmp_path, "link")
