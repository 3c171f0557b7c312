"""Crash-safe runs: the trainer process is SIGKILLed at random moments, over many trials.

Each trial starts a real training run (real browser, tiny model, warm start, demonstrations in the
replay buffer), kills its whole process group at a random moment, sometimes kills the resume too,
then resumes to the end. The result must equal an uninterrupted reference run exactly: every
metric line once and identical (timings aside), the same task order and groups per step, the same
replay buffer (contents, generator state, counters), the same optimizer state and weights.
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from arpo_lib.run.records import read_jsonl
from arpo_lib.training.checkpoint import latest_checkpoint

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
STEPS = 5
TIMINGS = ("seconds_rollout", "seconds_update", "env_steps_per_s", "seconds_eval")


def _train_args(model: Path, out: Path, name: str, nproc: int = 1) -> list[str]:
    return [sys.executable, "-m", "arpo_lib", "train", "--config", "configs/smoke.yaml", f"--nproc-per-node={nproc}",
            f"model.path={model}", f"out_dir={out}", f"name={name}",
            "env.tasks=[miniwob/click-test,miniwob/click-button]", "env.workers=1", "env.max_steps=2",
            "model.max_new_tokens=24", "rollout.group_size=2", "train.tasks_per_batch=2",
            "train.updates_per_batch=1", f"train.steps={STEPS}", "warm_start.steps=2",
            "warm_start.demos_per_task=1", "train.demo_replay=1", "train.keep_checkpoints=2",
            "logging.progress=false"]


def _resume_args(run: Path, nproc: int = 1) -> list[str]:
    return [sys.executable, "-m", "arpo_lib", "resume", "--run", str(run), f"--nproc-per-node={nproc}"]


def _start(cmd: list[str]) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="2")
    return subprocess.Popen(cmd, cwd=REPO, start_new_session=True, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _run_to_end(cmd: list[str]) -> float:
    start = time.monotonic()
    proc = _start(cmd)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err.decode()[-3000:]
    return time.monotonic() - start


def _kill_at(cmd: list[str], run: Path, after_lines: int, extra_s: float) -> float | None:
    """Start `cmd`; once the run's metrics file has `after_lines` lines (0: at once), wait
    `extra_s` more and SIGKILL the process group. Returns the seconds from start to the kill,
    or None if the process finished first."""
    start = time.monotonic()
    proc = _start(cmd)
    try:
        while len(read_jsonl(run / "metrics.jsonl")) < after_lines:
            if proc.poll() is not None:
                return None
            time.sleep(0.05)
        try:
            proc.wait(timeout=extra_s)
            return None
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return time.monotonic() - start
    finally:
        proc.stderr.close()


def _where(run: Path, seconds: float) -> dict:
    """When a kill landed: seconds after the start, the newest checkpoint and metric line then."""
    ck = latest_checkpoint(run / "checkpoints")
    lines = read_jsonl(run / "metrics.jsonl")
    return {"at_s": round(seconds, 2), "checkpoint": ck.name if ck else None,
            "metric_lines": len(lines)}


def _final_state(run: Path) -> dict:
    """Everything that must continue exactly, with the run's own name taken out of paths."""
    ck = latest_checkpoint(run / "checkpoints")
    metrics = [{k: v for k, v in m.items() if k not in TIMINGS} for m in read_jsonl(run / "metrics.jsonl")]
    groups = [json.loads(p.read_text()) for p in sorted((run / "rollouts").glob("step_*/groups.json"))]
    replay = json.loads((ck / "replay.json").read_text())
    state = json.loads((ck / "trainer_state.json").read_text())
    return {
        "checkpoint": ck.name, "step": state["step"], "metrics": metrics,
        "groups": json.loads(json.dumps(groups).replace(str(run), "RUN")),
        "replay": json.loads(json.dumps(replay).replace(str(run), "RUN")),
        "warm_start": read_jsonl(run / "warm_start.jsonl"),
        "weights": load_file(ck / "model" / "model.safetensors"),
        "optimizer": torch.load(ck / "optimizer.pt", weights_only=False),
        "optimizer_shards": _shards(ck),
    }


def _shards(checkpoint: Path) -> dict[str, object]:
    """The optimizer state a distributed run wrote as torch.distributed.checkpoint shards, whole
    and flattened (`state.<param>.<field>` -> value); {} for a one-process checkpoint."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    shards = checkpoint / "optimizer_shards"
    if not shards.is_dir():
        return {}
    whole = checkpoint.parent / f"{checkpoint.name}.whole.pt"
    dcp_to_torch_save(shards, whole)
    state = torch.load(whole, weights_only=False)
    whole.unlink()

    def flat(prefix: str, value: object) -> dict[str, object]:
        if isinstance(value, dict):
            return {k: v for key, sub in value.items() for k, v in flat(f"{prefix}.{key}", sub).items()}
        if isinstance(value, list):
            return {k: v for i, sub in enumerate(value) for k, v in flat(f"{prefix}.{i}", sub).items()}
        return {prefix: value}

    return flat("", state)


def _assert_same(a: dict, b: dict, trial: str) -> None:
    for key in ("checkpoint", "step", "metrics", "groups", "replay", "warm_start"):
        assert a[key] == b[key], f"{trial}: {key} differs"
    for name, tensor in a["weights"].items():
        assert torch.equal(tensor, b["weights"][name]), f"{trial}: weight {name} differs"
    oa, ob = a["optimizer"]["optimizer"], b["optimizer"]["optimizer"]
    if oa is None:  # written by several processes: the state is in the shards
        sa, sb = a["optimizer_shards"], b["optimizer_shards"]
        assert ob is None and sa.keys() == sb.keys() and any(".exp_avg_sq" in k for k in sa)
        for key in sa:
            same = torch.equal(sa[key], sb[key]) if torch.is_tensor(sa[key]) else sa[key] == sb[key]
            assert same, f"{trial}: optimizer {key} differs"
    else:
        assert oa["state"].keys() == ob["state"].keys()
        for k in oa["state"]:
            for field in ("step", "exp_avg", "exp_avg_sq"):
                assert torch.equal(torch.as_tensor(oa["state"][k][field]), torch.as_tensor(ob["state"][k][field])), \
                    f"{trial}: optimizer {field} differs"
    assert a["optimizer"]["scheduler"] == b["optimizer"]["scheduler"]


@pytest.fixture(scope="module")
def references(tiny_qwen2vl, chromium_available, tmp_path_factory):
    """`references(nproc)`: an uninterrupted run's final state, its wall time and seconds per step
    (each computed once per module)."""
    if not chromium_available:
        pytest.skip("needs chromium")
    done: dict[int, tuple[dict, float, float]] = {}

    def get(nproc: int) -> tuple[dict, float, float]:
        if nproc not in done:
            out = tmp_path_factory.mktemp(f"reference{nproc}")
            seconds = _run_to_end(_train_args(tiny_qwen2vl, out, "reference", nproc))
            final = _final_state(out / "reference")
            step_seconds = max(0.5, sum(m["seconds_rollout"] + m["seconds_update"]
                                        for m in read_jsonl(out / "reference" / "metrics.jsonl")) / STEPS)
            assert final["step"] == STEPS and [m["step"] for m in final["metrics"]] == list(range(1, STEPS + 1))
            done[nproc] = final, seconds, step_seconds
        return done[nproc]

    return get


# two processes: long only (a killed launch and a killed rank are tested below at CI size)
@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.long)], ids=["1-process", "2-processes"])
def test_sigkill_at_random_moments_then_resume_continues_exactly(tmp_path, tiny_qwen2vl, references, figures, scale,
                                                                 nproc):
    """With 2 processes (torchrun, FSDP2 on gloo) the whole group -- torchrun, both ranks, their
    browsers -- is killed; the resumed run must equal an uninterrupted 2-process run exactly."""
    trials = scale(1, 20) if nproc == 1 else scale(1, 10)  # ARPO_LONG_TESTS=1: the many-trial variant
    reference, reference_seconds, step_seconds = references(nproc)

    rng = random.Random(20261122)
    log = []
    for trial in range(trials):
        name = f"trial{trial}"
        run = tmp_path / name
        kills = []
        # Kills land in every phase: a quarter anywhere in a run's life (imports, demonstrations,
        # warm start), the rest after a random number of finished steps plus a random part of a
        # step (rollouts, the update, the checkpoint write). Every other trial also kills the
        # first resume.
        for attempt, cmd in enumerate([_train_args(tiny_qwen2vl, tmp_path, name, nproc), _resume_args(run, nproc)]):
            if attempt == 1 and not (trial % 2 and (run / "config.yaml").is_file()):
                break
            done = len(read_jsonl(run / "metrics.jsonl"))
            if rng.random() < 0.25:
                after, extra = 0, rng.uniform(1.5, 0.9 * reference_seconds)
            else:
                after, extra = rng.randint(min(done, STEPS - 1), STEPS - 1), rng.uniform(0.0, 1.2 * step_seconds)
            at = _kill_at(cmd, run, after, extra)
            if at is not None:
                kills.append(_where(run, at))
        if (run / "config.yaml").is_file():
            _run_to_end(_resume_args(run, nproc))
        else:  # killed before the run directory existed: a fresh start is the right recovery
            _run_to_end(_train_args(tiny_qwen2vl, tmp_path, name, nproc))
        ck = latest_checkpoint(run / "checkpoints")
        _assert_same(reference, _final_state(run), f"trial {trial} (kills at {kills} s)")
        log.append({"trial": trial, "kills": kills, "final": ck.name})
        for p in run.glob("rollouts/*/*/*/*/*.png"):  # keep the temp dir small on long runs
            p.unlink()
    assert sum(len(t["kills"]) for t in log) >= trials // 2  # (a run may finish before its kill)
    figures.update(processes=nproc, trials=trials, kills=sum(len(t["kills"]) for t in log), steps_per_run=STEPS,
                   kills_before_first_checkpoint=sum(k["checkpoint"] is None for t in log for k in t["kills"]),
                   kills_by_checkpoint={c: sum((k["checkpoint"] or "none") == c for t in log for k in t["kills"])
                                        for c in sorted({k["checkpoint"] or "none" for t in log for k in t["kills"]})},
                   reference_run_seconds=round(reference_seconds, 1), trial_log=log)


def _stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat's fields after the command name (state first), or None when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _identity(pid: int) -> str | None:
    """A process's start time (clock ticks after boot): with the pid, it names one process, not a
    later one the pid was reused for."""
    fields = _stat(pid)
    return fields[19] if fields else None


def _alive(pid: int, identity: str) -> bool:
    """The same process still runs (a zombie has exited: only its entry waits to be reaped)."""
    fields = _stat(pid)
    return bool(fields) and fields[19] == identity and fields[0] != "Z"


def _descendants(root: int) -> set[int]:
    """Every live process below `root` (from /proc's parent links)."""
    children: dict[int, list[int]] = {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(proc.name))
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _rank_pid(root: int, rank: int, timeout_s: float = 120.0) -> int:
    """The pid of torchrun's worker `rank` below `root`: the topmost process with RANK=`rank` in
    its environment (its environment workers and browsers inherit the variable)."""

    def has_rank(pid: int) -> bool:
        try:
            return f"RANK={rank}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            return False

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for pid in _descendants(root):
            try:
                parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if has_rank(pid) and not has_rank(parent):
                return pid
        time.sleep(0.2)
    raise AssertionError(f"no process of rank {rank} appeared")


def test_a_killed_launch_takes_its_ranks_with_it(tmp_path, tiny_qwen2vl):
    """torchrun starts each rank in a session of its own, so a SIGKILL of the launch's process
    group misses them: they went on training into the run directory beside whatever resumed it.
    Each rank ends once torchrun is gone, with its environment workers."""
    run = tmp_path / "orphans"
    proc = _start(_train_args(tiny_qwen2vl, tmp_path, run.name, 2))
    try:
        ranks = [_rank_pid(proc.pid, 0), _rank_pid(proc.pid, 1)]
        while not (run / "config.yaml").is_file():  # both ranks are well past their imports
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
            time.sleep(0.05)
        tree = {pid: _identity(pid) for pid in {*ranks, *_descendants(ranks[0]), *_descendants(ranks[1])}}
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and torchrun, not the ranks' sessions
        proc.wait()
        proc.stderr.close()
    deadline = time.monotonic() + 20
    while (left := [pid for pid, ident in tree.items() if ident and _alive(pid, ident)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"processes of the killed launch still run: {left}"
    lines = len(read_jsonl(run / "metrics.jsonl"))
    time.sleep(2)
    assert len(read_jsonl(run / "metrics.jsonl")) == lines  # nothing writes into the run any more


def test_one_rank_killed_stops_the_whole_group_and_the_run_resumes_exactly(tmp_path, tiny_qwen2vl, references,
                                                                           figures):
    """SIGKILL rank 1 alone (as the OOM killer would) in the middle of a 2-process run: rank 0
    must not wait forever in a collective -- the launcher ends the group and exits non-zero,
    naming the lost rank, leaving no process behind -- and a resume continues exactly."""
    reference, _, step_seconds = references(2)
    run = tmp_path / "one-rank"
    proc = _start(_train_args(tiny_qwen2vl, tmp_path, run.name, 2))
    try:
        while len(read_jsonl(run / "metrics.jsonl")) < 2:
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
            time.sleep(0.05)
        time.sleep(0.5 * step_seconds)  # into step 3: rollouts or the update
        victim = _rank_pid(proc.pid, 1)
        tree = {pid: _identity(pid) for pid in _descendants(proc.pid)}  # torchrun, both ranks, workers, browsers
        killed_at = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        _, err = proc.communicate(timeout=300)
        stopped_s = time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    err = err.decode()
    assert proc.returncode != 0, err[-5000:]
    assert "SIGKILL" in err and "rank      : 1" in err, err[-3000:]
    # environment workers notice their parent's exit within a second on an idle machine; once, under
    # a full test run's load, two were still there after a fixed 3 s: wait up to 20 s for them
    deadline = time.monotonic() + 20
    while (left := [pid for pid, ident in tree.items() if ident and _alive(pid, ident)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"processes of the killed run still alive: {left}"
    _run_to_end(_resume_args(run, 2))
    _assert_same(reference, _final_state(run), "one rank killed")
    figures.update(seconds_from_kill_to_group_exit=round(stopped_s, 1), metric_lines_at_kill=2)

