"""Untrusted input beyond model output: names that become paths, config and task names, servers
that are down or hang, and secrets that must never be written anywhere."""
from __future__ import annotations

import re
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from arpo_lib.run.config import ConfigError, load_config
from arpo_lib.run.records import safe_join, safe_name
from arpo_lib.agent.client import ServerError, chat_completion

REPO = Path(__file__).resolve().parents[2]
HOSTILE_NAMES = ["..", "../../etc/passwd", "/etc/passwd", "a/../../b", "~root", ".hidden", "-rf", "",
                 "a\x00b", "C:\\Windows", "\\\\server\\share", "%2e%2e%2f", "名前", "a" * 500, ". .", "...."]


# -------------------------------------------------------------------------------------- paths
@settings(max_examples=2000, deadline=None, derandomize=True)
@given(st.lists(st.text(max_size=40), min_size=1, max_size=4))
def test_safe_join_never_leaves_its_base(parts):
    base = Path("/tmp/arpo-base")
    path = safe_join(base, *parts)
    assert path.resolve().is_relative_to(base) and path != base
    for component in path.relative_to(base).parts:
        assert component == safe_name(component) and component not in ("", ".", "..")
        assert not component.startswith(".") and len(component) <= 120
        assert re.fullmatch(r"[A-Za-z0-9._-]+", component)


@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_hostile_names_stay_inside(name, tmp_path):
    path = safe_join(tmp_path, "miniwob", name, "0")
    assert path.resolve().is_relative_to(tmp_path.resolve()) and len(path.relative_to(tmp_path).parts) == 3


@pytest.mark.parametrize("name", HOSTILE_NAMES + ["run/x", "a b"])
def test_run_names_that_are_not_plain_directory_names_are_refused(name):
    with pytest.raises(ConfigError, match="^name: "):
        load_config("configs/smoke.yaml", [f"name={name!r}" if name else "name=''"])


def test_notebook_run_name_is_checked_before_anything_is_written(tmp_path):
    from arpo_lib.workflows import execute_notebook

    with pytest.raises(ValueError, match="run_name"):
        execute_notebook("notebooks/smoke_test.ipynb", {}, run_name="../../outside", out_dir=tmp_path)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("override,key", [
    ("env.tasks=[miniwob/../../etc]", "env.tasks"), ("env.tasks=[/etc/passwd]", "env.tasks"),
    ("env.tasks=[miniwob/click-tset]", "env.tasks"), ("eval.tasks=[nosuch/family]", "eval.tasks"),
    ("env.tasks=[miniwob/]", "env.tasks"), ("train.lr=abc", "train.lr"), ("train=5", "train"),
    ("env.workers=two", "env.workers"), ("algo.replay.nope=1", "algo.replay.nope"),
])
def test_bad_task_names_and_config_values_fail_at_load_naming_the_field(override, key):
    from arpo_lib import build

    with pytest.raises(ConfigError, match=f"^{re.escape(key)}"):
        build.load_config("configs/smoke.yaml", [override])  # what the CLI and the notebooks load with


def test_a_config_file_that_is_not_a_mapping_is_refused(tmp_path):
    for text in ["- a\n- b\n", "just text\n", "env: [1, 2]\n", "env:\n  tasks: 5\n"]:
        bad = tmp_path / "bad.yaml"
        bad.write_text(text)
        with pytest.raises(ConfigError):
            load_config(str(bad))


# -------------------------------------------------------------------------------------- servers
def test_a_server_that_accepts_but_never_answers_gives_a_clear_error_in_bounded_time(figures):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        start = time.monotonic()
        with pytest.raises(ServerError, match=r"after 3 attempts \(0.5 s timeout each\)"):
            chat_completion(f"http://127.0.0.1:{port}/v1", [{"role": "user", "content": "x"}], model="m",
                            timeout_s=0.5, retries=2, backoff_s=0.05)
        seconds = time.monotonic() - start
    # 3 attempts x 0.5 s + back-off: bounded, whatever the server does.
    assert seconds < 10
    figures.update(attempts=3, timeout_s=0.5, seconds_to_error=round(seconds, 2))


def test_a_server_that_closes_connections_is_retried_then_reported():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        stop = threading.Event()

        def slam() -> None:
            listener.settimeout(0.2)
            while not stop.is_set():
                try:
                    conn, _ = listener.accept()
                    conn.close()
                except OSError:
                    pass

        thread = threading.Thread(target=slam, daemon=True)
        thread.start()
        try:
            with pytest.raises(ServerError, match="after 2 attempts"):
                chat_completion(f"http://127.0.0.1:{port}/v1", [{"role": "user", "content": "x"}], model="m",
                                timeout_s=2, retries=1, backoff_s=0.01)
        finally:
            stop.set()
            thread.join()


# -------------------------------------------------------------------------------------- secrets
SECRETS = {
    "WANDB_API_KEY": "0123456789abcdef0123456789abcdef01234567",
    "HF_TOKEN": "hf_SecretTokenForArpoAuditXyz1234567890",
    "OPENAI_API_KEY": "sk-arpoAuditSecret1234567890abcdefXYZ",
    "HUGGING_FACE_HUB_TOKEN": "hf_AnotherSecretForArpoAudit0987654321",
}
# Shapes of real credentials, for the repository scan (a key starts a word: "task-data-..." in a
# link's anchor is not one).
SECRET_PATTERNS = [re.compile(p) for p in (r"(?<![A-Za-z0-9])hf_[A-Za-z0-9]{30,}", r"(?<![A-Za-z0-9])sk-[A-Za-z0-9_-]{20,}",
                                           r"(?i)wandb[^\n]{0,40}[0-9a-f]{40}", r"AKIA[0-9A-Z]{16}",
                                           r"-----BEGIN [A-Z ]*PRIVATE KEY-----")]


def _files_containing(root: Path, needles: list[str]) -> list[str]:
    hits = []
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink():
            data = path.read_bytes()
            hits += [f"{path}: {n[:6]}..." for n in needles if n.encode() in data]
    return hits


@pytest.mark.slow
def test_secrets_in_the_environment_never_reach_run_directories(tmp_path, tiny_qwen2vl, chromium_available,
                                                                 monkeypatch, figures):
    """A training step with evaluation, demonstrations, checkpoints and wandb (offline), with
    credentials in the environment, as on a real cluster: none of them is written anywhere."""
    pytest.importorskip("wandb")
    from arpo_lib import build

    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    cfg = load_config("configs/smoke.yaml", [
        f"model.path={tiny_qwen2vl}", f"out_dir={tmp_path / 'runs'}", "name=secrets", "env.workers=1",
        "env.max_steps=2", "model.max_new_tokens=16", "rollout.group_size=2", "train.tasks_per_batch=2",
        "train.steps=1", "warm_start.steps=1", "warm_start.demos_per_task=1", "train.demo_replay=1",
        "train.eval_every=1", "eval.samples_per_task=1", "logging.wandb=offline", "logging.progress=false"])
    with build.trainer(cfg) as trainer:
        trainer.train()
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    hits = _files_containing(tmp_path, list(SECRETS.values()))
    assert not hits, hits
    figures.update(files_checked=len(files), secrets_planted=len(SECRETS), leaks=0)


def test_no_credentials_in_tracked_files(figures):
    """Notebooks (with their outputs), configs, docs and code: nothing shaped like a credential."""
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    hits, checked = [], 0
    for rel in tracked.splitlines():
        path = REPO / rel
        if not path.is_file() or path.suffix in (".png", ".safetensors", ".pt", ".bin"):
            continue
        text = path.read_text(errors="replace")
        checked += 1
        if rel == "tests/reliability/test_untrusted_input.py":
            continue  # the planted fake secrets above
        hits += [f"{rel}: {m.group()[:8]}..." for p in SECRET_PATTERNS for m in p.finditer(text)]
    assert not hits, hits
    figures.update(tracked_files_checked=checked, patterns=len(SECRET_PATTERNS), hits=0)
