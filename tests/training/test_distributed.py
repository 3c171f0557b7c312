"""Distributed training (FSDP2, torchrun) against one process: the same ARPO steps, the same
weights and metrics, and checkpoints that resume with another number of processes.

The runs are real: `python -m arpo_lib train --nproc-per-node 2` (or a notebook's
`workflows.open_trainer` with train.nproc_per_node=2) starts torchrun, two processes
join a gloo process group on the CPU, each runs its share of the MiniWoB episodes in its own
headless Chromium and its share of every mini-batch on an FSDP2-sharded copy of the tiny model.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from arpo_lib.training import checkpoint, distributed
from tests.conftest import LONG

COMMON = ["train.steps=2", "warm_start.steps=10", "warm_start.demos_per_task=2", "env.workers=1",
          "logging.progress=false", "train.checkpoint_every=1", "train.eval_every=0", "train.keep_checkpoints=3"]
EXACT = ["step", "tasks", "success_rate", "success_by_task", "mean_reward", "format_error_rate", "mean_steps",
         "all_failed_groups", "replay_injections", "replay_size", "tokens", "sequences", "optimizer_steps", "env_steps"]
CLOSE = ["loss", "grad_norm", "approx_kl", "lr"]
FINAL_EVAL = ["train.eval_every=2", "eval.samples_per_task=2"]  # the `runs` pair: evaluated at their last step


# -- the pieces ----------------------------------------------------------------------------------
def test_the_declared_torch_has_fsdp2_where_the_training_imports_it_and_the_set_up_satisfies_it():
    """pyproject's torch floor is a release with FSDP2 public (fully_shard, MixedPrecisionPolicy:
    from torch.distributed.fsdp since 2.6; the floor is 2.7), and the torch the set-up installs
    (scripts/choose_torch.py) meets it."""
    import re

    from packaging.requirements import Requirement
    from packaging.version import Version

    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    root = Path(__file__).resolve().parents[2]
    deps = tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]
    (torch_req,) = [Requirement(d) for d in deps if Requirement(d).name == "torch"]
    floors = [Version(s.version) for s in torch_req.specifier if s.operator == ">="]
    assert floors and min(floors) >= Version("2.7"), torch_req
    installed = re.search(r'PAIR = \("([0-9.]+)"', (root / "scripts" / "choose_torch.py").read_text()).group(1)
    assert torch_req.specifier.contains(installed), (torch_req, installed)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: F401 (where training imports them)


def test_token_balanced_shares_cover_everything_once_and_are_balanced():
    lengths = [900, 120, 450, 450, 30, 600, 610, 75]
    shares = distributed.split_by_tokens(lengths, 3)
    assert sorted(i for s in shares for i in s) == list(range(len(lengths)))
    loads = [sum(lengths[i] for i in s) for s in shares]
    assert max(loads) - min(loads) <= max(lengths)  # greedy longest-first: within one sequence
    assert shares == distributed.split_by_tokens(lengths, 3)  # every rank computes every share
    assert distributed.split_by_tokens([5, 5], 4) == [[0], [1], [], []]


def test_interleave_undoes_the_strided_split():
    items = list("abcdefg")
    assert distributed.interleave([items[r::3] for r in range(3)]) == items
    assert distributed.interleave([items]) == items


def test_optimizer_state_converts_between_positions_and_names(tiny_qwen2vl):
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(tiny_qwen2vl)
    params = [p for p in model.parameters() if p.requires_grad]
    names = [f"net.{n}" for n, p in model.named_parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3)
    sum((p * p).sum() for p in params).backward()
    opt.step()
    state = opt.state_dict()
    by_name = checkpoint.optimizer_state_by_name(state, names)
    assert set(by_name["state"]) == set(names)
    back = checkpoint.optimizer_state_by_position(by_name, names)
    assert back["param_groups"] == state["param_groups"]
    assert all(torch.equal(back["state"][i]["exp_avg"], state["state"][i]["exp_avg"]) for i in state["state"])
    with pytest.raises(ValueError, match="lacks"):
        checkpoint.optimizer_state_by_position(by_name, names[1:])


def test_every_decoder_layer_and_vision_block_is_a_unit(tiny_model):
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(tiny_model)
    units = distributed.shard_units(model)
    cfg = model.config
    assert len(units) == cfg.text_config.num_hidden_layers + cfg.vision_config.depth
    with pytest.raises(ValueError, match="no decoder layers"):
        distributed.shard_units(torch.nn.Linear(2, 2))


def test_the_checkpoint_is_read_once_per_run_and_every_rank_holds_it_whole(tiny_qwen2vl, tmp_path):
    """Rank 0 reads the policy's and the KL reference's weights; rank 1 builds the network with
    nothing read and receives them, the buffers no checkpoint holds too (the rotary embeddings'
    inv_freq, garbage after allocation) and the tied embedding once. Before, every rank read the
    checkpoint (at 7B, 8 x 30.9 GiB of host memory on a node while loading)."""
    from transformers import AutoModelForImageTextToText

    from tests.training.load_once_ranks import digest

    here = Path(__file__).resolve().parent
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                           str(here / "load_once_ranks.py"), str(tmp_path), "configs/smoke.yaml", f"model.path={tiny_qwen2vl}",
                           f"out_dir={tmp_path}", "name=once", "algo.kl_coef=0.05", "logging.progress=false"],
                          capture_output=True, text=True, timeout=600, cwd=here.parents[1])
    assert done.returncode == 0, done.stderr[-4000:]
    zero, one = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert zero["reads"] == [str(tiny_qwen2vl)] * 2 and one["reads"] == [], (zero["reads"], one["reads"])
    assert zero["policy"] == one["policy"] and zero["reference"] == one["reference"]
    assert one["reference"] == digest(AutoModelForImageTextToText.from_pretrained(tiny_qwen2vl).eval())


# -- real runs -----------------------------------------------------------------------------------
def _train(out: Path, model: Path, name: str, nproc: int, *extra: str) -> Path:
    _run(["train", "--config", "configs/smoke.yaml", f"--nproc-per-node={nproc}", f"model.path={model}",
          f"out_dir={out}", f"name={name}", *COMMON, *extra])
    return out / name


def _run(args: list[str]) -> str:
    """Runs `python -m arpo_lib ARGS`; returns its output (stdout and stderr)."""
    done = subprocess.run([sys.executable, "-m", "arpo_lib", *args], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return done.stdout + done.stderr


def _weights(run: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(run / "checkpoints" / f"step_{step:06d}" / "model" / "model.safetensors")


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _assert_same(a: Path, b: Path, small_abs: float = 5e-7, gap_share: float = 0.01) -> None:
    """Same weights (within float noise, far below what a step moves them) and metrics.

    Weights are compared as whole vectors: the difference between the runs must be under 1% of what
    the step moved them (measured: 0.04%). Element-wise maxima are not a fair test under Adam: an
    element whose gradient is ~1e-8 (noise-sized) is divided by a second moment just as small, so
    float noise of the reduction order becomes a sizeable fraction of one step there (4 of 364k
    elements differ by ~1e-5 with a step of 2e-4); they are bounded by half a step.
    `small_abs`: the loss and approx_kl are sums of terms that nearly cancel (a group's advantages
    sum to zero; log-ratios of +-1e-4), ~1e-5 to 1e-4, so float noise in them is bounded absolutely:
    by 5e-7 (float32 log-probs of a few nats carry ~1e-7 each; measured: 5.2e-8 in approx_kl
    -4.73e-4 between 1 and 2 processes on an AVX-512/AMX host, where the former 1e-9 failed, while
    another host had passed it), 0.1% of the values, still far below what a wrong step changes."""
    wa, wb = _weights(a, 2), _weights(b, 2)
    assert wa.keys() == wb.keys()
    before = _weights(a, 1)
    gap = torch.cat([(wa[k] - wb[k]).flatten().float() for k in wa])
    moved = torch.cat([(wa[k] - before[k]).flatten().float() for k in wa])
    figures = {"gap_norm": float(gap.norm()), "moved_norm": float(moved.norm()),
               "gap_max": float(gap.abs().max()), "moved_max": float(moved.abs().max())}
    assert figures["moved_norm"] > 0 and figures["gap_norm"] < gap_share * figures["moved_norm"], figures
    assert figures["gap_max"] < 0.5 * figures["moved_max"], figures
    for ma, mb in zip(_metrics(a), _metrics(b), strict=True):
        assert {k: ma[k] for k in EXACT} == {k: mb[k] for k in EXACT}
        for k in CLOSE:
            assert ma[k] == pytest.approx(mb[k], rel=1e-4, abs=small_abs if k in ("loss", "approx_kl") else 1e-9), k


def _train_from_a_notebook(out: Path, model: Path, name: str, nproc: int) -> tuple[Path, list[dict], str]:
    """What subset_training.ipynb does with overrides=["train.nproc_per_node=N"]."""
    from arpo_lib import workflows

    cfg = workflows.prepare_run("configs/smoke.yaml", [f"model.path={model}", f"out_dir={out}",
                                                       f"train.nproc_per_node={nproc}", *COMMON, *FINAL_EVAL], name)
    trainer = workflows.open_trainer(cfg)
    assert trainer.warm_start() == [] and trainer.step == 0
    streamed: list[dict] = []
    history = trainer.train(on_step=streamed.append, echo=False)
    assert history == streamed and trainer.step == 2
    report = workflows.training_report(trainer)
    trainer.close()
    return out / name, history, report


@pytest.fixture(scope="module")
def runs(tiny_qwen2vl, chromium_available, tmp_path_factory):
    if not chromium_available:
        pytest.skip("needs chromium")
    out = tmp_path_factory.mktemp("distributed")
    two, streamed, report = _train_from_a_notebook(out, tiny_qwen2vl, "np2", 2)
    return out, {1: _train(out, tiny_qwen2vl, "np1", 1, *FINAL_EVAL), 2: two}, streamed, report


def test_two_processes_take_the_same_arpo_steps_as_one(runs):
    _, run, streamed, report = runs
    _assert_same(run[1], run[2])
    two = _metrics(run[2])
    assert streamed == two  # the notebook saw every step as rank 0 recorded it
    assert "steps: 2 / 2" in report and "replay buffer: 0 trajectories" not in report
    assert [m["optimizer_steps"] for m in two] == [2, 2] and two[-1]["replay_size"] > 0
    # rank 0 alone writes the records; both ranks wrote their own episodes into the run
    assert len((run[2] / "metrics.jsonl").read_text().splitlines()) == 2
    assert len(list((run[2] / "rollouts" / "step_000000").rglob("meta.json"))) == 8
    _assert_sharded_checkpoint(run[2] / "checkpoints" / "step_000002", ranks=2)


def test_the_final_evaluation_is_spread_over_the_ranks_and_scores_like_one_process(runs):
    """Each rank plays its share of the evaluation's episodes on its own environments (rank 0
    alone played them all before); every episode's seed is its (seed, task, sample), so the
    summary rank 0 writes is the one process's."""
    from arpo_lib.run import layout

    _, run, streamed, _ = runs
    one, two = (json.loads((run[n] / "eval" / layout.step_name(2) / layout.EVAL_RESULTS).read_text()) for n in (1, 2))
    assert one["episodes"] == 6 and one["episodes_by_rank"] is None
    assert two["episodes_by_rank"] == [3, 3]  # three tasks, two samples each, over two ranks
    for key in ("episodes", "success_rate", "pass_at_k", "mean_steps", "format_error_rate", "env_steps", "tasks"):
        assert one[key] == two[key], key
    assert len(list((run[2] / "eval" / layout.step_name(2)).rglob("meta.json"))) == 6  # both ranks' episodes
    assert streamed[-1]["eval_success_rate"] == one["success_rate"] == _metrics(run[1])[-1]["eval_success_rate"]


def test_two_nodes_rendezvous_and_train_like_one_process(runs, tiny_qwen2vl):
    """`--nnodes 2 --master-addr A` as on two machines (here both on this one, one process each,
    c10d rendezvous at the master address, one shared run directory): the same two ARPO steps as
    one process."""
    from arpo_lib.serving.launch import free_port

    out, run, _, _ = runs
    port = free_port()
    command = [sys.executable, "-m", "arpo_lib", "train", "--config", "configs/smoke.yaml", "--nproc-per-node=1",
               "--nnodes=2", "--master-addr=127.0.0.1", f"--master-port={port}", f"--rdzv-id=test-{port}",
               f"model.path={tiny_qwen2vl}", f"out_dir={out}", "name=two-nodes", *COMMON]
    nodes = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in (0, 1)]
    try:
        logs = [node.communicate(timeout=900)[0] for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(log[-3000:] for log in logs)
    assert all("--nnodes=2" in log and "--rdzv-backend=c10d" in log for log in logs)
    _assert_same(run[1], out / "two-nodes")
    _assert_sharded_checkpoint(out / "two-nodes" / "checkpoints" / "step_000002", ranks=2)


def test_lora_with_activation_checkpointing_a_token_budget_token_mean_and_clipping_too(tiny_qwen2vl,
                                                                                       chromium_available, tmp_path):
    """Also the loss aggregated as one token mean over the mini-batch across ranks, and gradient
    clipping that fires (neither had run on two ranks before this test); the sync after each update
    gathers only the adapters (the frozen base is never gathered)."""
    if not chromium_available:
        pytest.skip("needs chromium")
    clip = 1e-3
    extra = ["model.lora_rank=4", "model.gradient_checkpointing=true", "train.token_budget=4000", "train.lr=1e-3",
             "algo.aggregation=token-mean", f"train.grad_clip={clip}"]
    one, two = (_train(tmp_path, tiny_qwen2vl, f"lora{n}", n, *extra) for n in (1, 2))
    _assert_same(one, two)
    assert all(m["grad_norm"] > 10 * clip and m["optimizer_steps"] > 0 for m in _metrics(two))  # it clipped


@pytest.mark.parametrize("written_by, resumed_by", [(2, 1), (1, 2)])
def test_a_checkpoint_resumes_with_another_number_of_processes(runs, written_by, resumed_by):
    out, run, _, _ = runs
    copy = out / f"resume-{written_by}-{resumed_by}"
    shutil.copytree(run[written_by], copy)
    shutil.rmtree(copy / "checkpoints" / "step_000002")  # as if killed during step 2
    shutil.rmtree(copy / "eval", ignore_errors=True)  # (before its evaluation)
    _run(["resume", "--run", str(copy), f"--nproc-per-node={resumed_by}", f"name={copy.name}"])
    _assert_same(run[1], copy)


def test_adafactor_on_two_processes_steps_like_one_and_its_shards_resume_in_one(tiny_qwen2vl, chromium_available,
                                                                               tmp_path):
    """train.optimizer=adafactor with FSDP2 (ShardedAdafactor): the same two ARPO steps as torch's
    Adafactor in one process, and the sharded checkpoint continues in one process."""
    if not chromium_available:
        pytest.skip("needs chromium")
    one, two = (_train(tmp_path, tiny_qwen2vl, f"adafactor{n}", n, "train.optimizer=adafactor") for n in (1, 2))
    # Adafactor divides by factored second moments (row and column means, reduced across shards):
    # float noise is amplified more than under AdamW; 1.08% of the step on an AVX-512/AMX host
    _assert_same(one, two, gap_share=0.03)
    _assert_sharded_checkpoint(two / "checkpoints" / "step_000002", ranks=2)
    shutil.rmtree(two / "checkpoints" / "step_000002")
    _run(["resume", "--run", str(two), "--nproc-per-node=1", f"name={two.name}"])
    _assert_same(one, two, gap_share=0.03)


def _assert_sharded_checkpoint(checkpoint: Path, ranks: int) -> None:
    """Each rank wrote its own optimizer shard (torch.distributed.checkpoint), nothing gathered:
    optimizer.pt holds the schedule only, the manifest covers the shards."""
    shards = sorted(p.name for p in (checkpoint / "optimizer_shards").iterdir())
    assert shards == [".metadata", *[f"__{r}_0.distcp" for r in range(ranks)]]
    assert torch.load(checkpoint / "optimizer.pt", weights_only=False)["optimizer"] is None
    assert f"optimizer_shards/__{ranks - 1}_0.distcp" in json.loads((checkpoint / "manifest.json").read_text())


def test_a_failed_launch_raises_with_the_processes_last_output(tmp_path):
    from arpo_lib import build
    from arpo_lib.training.launch import LaunchedTrainer

    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'Setting OMP_NUM_THREADS environment variable'\n"
                    "echo \"rank 1: ValueError: something broke ($*)\"\nexit 3\n")
    fake.chmod(0o755)
    cfg = build.load_config("configs/smoke.yaml", [f"out_dir={tmp_path}", "name=failing", "train.nproc_per_node=2"])
    trainer = LaunchedTrainer(cfg, 2, python=str(fake))
    with pytest.raises(RuntimeError, match=r"exit 3[\s\S]*something broke .*--nproc-per-node=2"):
        trainer.train(echo=False, poll_s=0.05)
    assert trainer.step == 0 and len(trainer.replay) == 0
    assert (tmp_path / "failing" / "launch.yaml").is_file()
    with pytest.raises(ValueError, match="at least 1"):
        LaunchedTrainer(cfg, 0)


@pytest.mark.parametrize("replicas", [1, 2] if LONG else [2])  # 2 replicas cover 1's paths too; both under ARPO_LONG_TESTS
def test_two_processes_roll_out_through_servers_that_rank_0_keeps_current(tiny_qwen2vl, chromium_available, tmp_path,
                                                                          replicas):
    """rollout.backend=server with 2 processes: rank 0 starts the server(s) (serve.replicas) and
    restarts them on the new weights after every update; both ranks spread their episodes over
    all of them. No rank keeps the full model once training starts: the weights the
    servers load and the checkpoints hold are gathered from the shards with both ranks."""
    if not chromium_available:
        pytest.skip("needs chromium")
    output = _run(["train", "--config", "configs/smoke.yaml", "--nproc-per-node=2", f"model.path={tiny_qwen2vl}",
                   f"out_dir={tmp_path}", "name=served", *COMMON, "rollout.backend=server", "serve.backend=hf",
                   "rollout.weight_sync=restart", "env.max_steps=2", "model.max_new_tokens=24",
                   f"serve.replicas={replicas}", *FINAL_EVAL])
    run = tmp_path / "served"
    # the final evaluation through the servers too, each rank playing its share
    evaluated = json.loads((run / "eval" / "step_000002" / "results.json").read_text())
    assert evaluated["episodes"] == 6 and evaluated["episodes_by_rank"] == [3, 3], evaluated
    for rank in (0, 1):
        assert f"rank {rank}: the full model is dropped" in output, output[-3000:]
    metrics = _metrics(run)
    assert [m["step"] for m in metrics] == [1, 2] and all(m["optimizer_steps"] == 2 for m in metrics)
    # rank 0's own client sent its half of the episodes' requests; the server holds the final weights
    assert 0 < metrics[-1]["server_requests"] and metrics[-1]["seconds_sync_total"] > 0
    served = load_file(run / "server_weights" / "model.safetensors")
    final = _weights(run, 2)
    assert all(torch.equal(served[k], final[k]) for k in final)
    episodes = list((run / "rollouts" / "step_000001").rglob("meta.json"))
    assert len(episodes) == 8 and all(json.loads(p.read_text())["status"] == "ok" for p in episodes)
    if replicas > 1:  # every replica answered rank 0's episodes, and was restarted on the final weights
        by_replica = metrics[-1]["server_requests_by_replica"]
        assert len(by_replica) == 2 and min(by_replica) > 0
        infos = [json.loads((run / name).read_text()) for name in ("server.json", "server_1.json")]
        assert infos[0]["url"] != infos[1]["url"]
        assert (run / "server_1.log").is_file()


@pytest.mark.long  # async over a server (one process) and two processes over servers run in CI
def test_two_processes_play_the_next_batch_ahead_on_the_servers_that_rank_0_restarts(tiny_qwen2vl,
                                                                                      chromium_available, tmp_path):
    """Asynchronous ARPO on two ranks: rollout.max_staleness=1 with 2 training processes. Each rank plays its
    share of the next batch while the update runs; before rank 0 restarts the server on the new
    weights, every rank waits for its own requests in flight and holds new ones back, then learns
    the new version and the new server's URL. Without that, rank 1's requests ran into the stopped
    server (its episodes failed) or recorded the version before the push."""
    if not chromium_available:
        pytest.skip("needs chromium")
    _run(["train", "--config", "configs/smoke.yaml", "--nproc-per-node=2", f"model.path={tiny_qwen2vl}",
          f"out_dir={tmp_path}", "name=ahead", *COMMON, "train.steps=3", "train.updates_per_batch=1",
          "rollout.backend=server", "serve.backend=hf", "rollout.weight_sync=restart", "rollout.max_staleness=1",
          "rollout.mode=async", "env.max_steps=2", "model.max_new_tokens=24"])
    run = tmp_path / "ahead"
    metrics = _metrics(run)
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert metrics[0]["staleness_max"] == 0 and all(m["staleness_max"] <= 1 for m in metrics)
    for step in (1, 2):  # the batches played ahead, on both ranks (requests interleave by rank)
        episodes = sorted((run / "rollouts" / f"step_{step:06d}").rglob("meta.json"))
        assert len(episodes) == 8 and all(json.loads(p.read_text())["status"] == "ok" for p in episodes)
        by_rank: dict[int, set] = {0: set(), 1: set()}
        for meta in episodes:
            index = json.loads(meta.read_text())["sample"]
            lines = [json.loads(line) for line in (meta.parent / "traj.jsonl").read_text().splitlines()]
            by_rank.setdefault(index % 2, set()).update(line["weights_version"] for line in lines)
        warm = 1  # the warm start is version 1; batch k is started on version k (one update each)
        for versions in by_rank.values():
            assert versions and versions <= {warm + step - 1, warm + step}, (step, by_rank)


def test_interrupting_a_launched_run_stops_its_processes(tmp_path):
    """What a notebook's interrupt does: KeyboardInterrupt inside `train` ends the whole process
    group (torchrun and its ranks) and is raised again; the run can be resumed later."""
    import time

    from arpo_lib import build
    from arpo_lib.training.launch import LaunchedTrainer

    fake = tmp_path / "python"  # stands in for torchrun: records a step, then trains "forever"
    fake.write_text('#!/bin/sh\ndir=$(dirname "$5")\n'
                    'echo \'{"step": 1, "success_rate": 0.5}\' > "$dir/metrics.jsonl"\nsleep 120 & wait\n')
    fake.chmod(0o755)
    cfg = build.load_config("configs/smoke.yaml", [f"out_dir={tmp_path}", "name=interrupted"])
    trainer = LaunchedTrainer(cfg, 2, python=str(fake))

    def interrupt(metrics):
        raise KeyboardInterrupt

    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        trainer.train(on_step=interrupt, echo=False, poll_s=0.05)
    assert trainer.process.poll() is not None and time.monotonic() - start < 30
    assert trainer.step == 1


def test_on_gpus_the_control_traffic_goes_on_a_gloo_side_group(monkeypatch):
    """NCCL carries FSDP2's collectives with a 30-minute timeout; objects, sums and
    barriers go on a gloo side group with the long one (pickles never touch GPU memory; CPU
    tensors cannot go through NCCL). The calls are recorded: this machine has no GPU."""
    import torch.distributed as dist

    from arpo_lib.training import distributed as dist_

    calls: list[tuple] = []
    side = object()
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: calls.append(("set_device", i)))
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.append(("init", backend, kw["timeout"])))
    monkeypatch.setattr(dist, "new_group", lambda **kw: calls.append(("new_group", kw["backend"], kw["timeout"])) or side)
    for name in ("all_gather_object", "barrier", "broadcast_object_list", "all_reduce"):
        monkeypatch.setattr(dist, name, lambda *a, _name=name, **kw: calls.append((_name, kw.get("group"))))
    monkeypatch.setattr(dist, "broadcast", lambda box, **kw: calls.append(("announce", kw["group"])))
    plain = dist_.Ranks(rank=1, world_size=8, local_rank=1)
    ranks = dist_.init_process_group(plain, torch.device("cuda"))  # the ranks carry the side group
    dist_.gather_objects(["episode"], ranks)
    dist_.barrier(ranks)
    dist_.all_reduce_sum([1.0], ranks)
    dist_._announce(ranks)
    monkeypatch.setattr(dist, "broadcast_object_list", lambda box, **kw: calls.append(("broadcast", kw["group"])))
    dist_.broadcast_object("urls", ranks)
    assert calls[:3] == [("set_device", 1), ("init", "nccl", dist_.COLLECTIVE_TIMEOUT),
                         ("new_group", "gloo", dist_.CONTROL_TIMEOUT)]
    assert ranks.control is side and [c[1] for c in calls[3:]] == [side] * 5
    assert ranks == plain and plain.control is None  # the same place among the ranks; nothing global changed
    assert dist_.COLLECTIVE_TIMEOUT.total_seconds() == 1800 and dist_.CONTROL_TIMEOUT > dist_.COLLECTIVE_TIMEOUT
    calls.clear()
    on_cpu = dist_.init_process_group(plain, torch.device("cpu"))  # the CPU: one gloo group, the long timeout
    assert calls == [("init", "gloo", dist_.CONTROL_TIMEOUT)] and on_cpu.control is None


# -- waiting for rank 0, and rank 0 failing (2 gloo ranks; gloo stands in for NCCL) -------------
HANG_RANKS = Path(__file__).resolve().parent / "hang_ranks.py"


def _hang_ranks(scenario: str, collective_timeout_s: float, out: Path) -> list[dict]:
    """What each rank of `tests/training/hang_ranks.py SCENARIO` reported (rank 0, rank 1)."""
    import os

    root = HANG_RANKS.parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(HANG_RANKS), scenario, str(collective_timeout_s), str(out)],
                          capture_output=True, text=True, timeout=180, cwd=root, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_a_warm_start_longer_than_the_collective_timeout_still_reaches_every_rank(tmp_path):
    """Rank 0 warm-starts alone (hours at 7B) while the others wait to receive the
    weights. They wait on the gloo control group, not in the broadcast: with a 3 s collective
    timeout and a 6 s warm start, the broadcast on the old code timed out on rank 1."""
    from tests.training.hang_ranks import WARM_START_S

    zero, one = _hang_ranks("late-warm-start", 3, tmp_path)
    assert zero["raised"] is None and one["raised"] is None, (zero, one)
    assert one["seconds"] > 3 and zero["seconds"] >= WARM_START_S  # rank 1 waited past the collective timeout
    assert zero["weights"] == one["weights"] == [7.0] * 15  # rank 0's trained weights on both
    assert zero["losses"] == [0.25] and one["losses"] == []


def test_a_warm_start_that_fails_on_rank_0_makes_every_rank_raise_at_once(tmp_path):
    """Rank 0's warm start raises after 1 s and rank 0 stays alive for 10 s more (a trainer
    closing its environments): rank 1 raises within seconds, naming rank 0's error. On the old
    code it waited in the broadcast until rank 0 had gone (on GPUs: NCCL's 30 minutes)."""
    zero, one = _hang_ranks("failed-warm-start", 60, tmp_path)
    assert zero["raised"] == "RuntimeError: CUDA out of memory (injected)"
    assert one["raised"].startswith("RankFailed") and "CUDA out of memory (injected)" in one["raised"], one
    assert one["seconds"] < 5, one


def test_a_checkpoint_that_fails_on_rank_0_makes_every_rank_raise_at_once(tmp_path):
    """Rank 0 writes the checkpoint's shared parts alone; when that fails (a full disk) and rank 0
    lingers, rank 1 raises within seconds with its error. On the old code it waited at the
    barrier after the write until rank 0 had gone."""
    zero, one = _hang_ranks("failed-checkpoint", 60, tmp_path)
    assert zero["raised"] == "OSError: No space left on device (injected)"
    assert one["raised"].startswith("RankFailed") and "No space left on device (injected)" in one["raised"], one
    assert one["seconds"] < 5, one


@pytest.fixture(scope="module")
def push_ranks(tmp_path_factory):
    return _hang_ranks("push", 60, tmp_path_factory.mktemp("push"))


def test_a_push_that_fails_mid_way_makes_every_rank_raise_at_once(push_ranks):
    """Server mode without a full copy: rank 0 consumes a pass over the shards' weights, each
    gathered with every rank. A whole pass hands rank 0 every weight under its full-model name;
    one whose consumer fails at the third tensor (rank 0 then lingers 10 s) releases rank 1 at
    once with `RankFailed`, where on the old code it waited in the fourth gather."""
    zero, one = push_ranks
    assert zero["pass_names"] and zero["pass_gap"] == 0.0
    assert zero["raised"] == "ConnectionError: the server went away (injected)"
    assert one["raised"] == ("RankFailed: rank 0 failed during its pass over the weights (3 of 6 gathered): "
                             "ConnectionError: the server went away (injected)")
    assert one["seconds"] < 5, one


@pytest.mark.parametrize("scenario, error", [
    ("push-fails-before", "ConnectionError: POST /pause: connection refused (injected)"),
    ("push-fails-mid", "ConnectionError: the server went away at tensor 2 (injected)"),
])
def test_a_push_that_fails_on_rank_0_ends_every_rank_at_once_with_its_error(tmp_path, scenario, error):
    """The trainer's own path to a push (`RolloutSource.weights_changed` over FSDP2 without a full
    copy): rank 0's servers fail before the first gather (a refused /pause) or mid-way, and rank 0
    lingers 10 s. Rank 1, waiting in the pass's gathers, raises within seconds with rank 0's
    exception text. On the code before, rank 0's error went out as a pickled object whose size
    rank 1 read as the next gather's announcement, and rank 1 entered a gather rank 0 never joined
    (on GPUs: NCCL's 30 minutes)."""
    zero, one = _hang_ranks(scenario, 60, tmp_path)
    assert zero["raised"] == error, zero
    assert one["raised"].startswith("RankFailed: rank 0 failed during its pass over the weights") and error in one["raised"], one
    assert one["seconds"] < 5, one


def test_a_rank_other_than_0_failing_mid_pass_ends_the_run_when_it_exits(tmp_path):
    """A rank other than 0 whose gather fails (its own out-of-memory) leaves rank 0 inside
    that gather; nothing of ours can announce it (rank 0 is in the collective, not waiting for an
    announcement). The failing rank leaves the group without waiting (`backend.close(failed=True)`),
    closes its environments and exits: rank 0 is then stopped (torchrun ends the other processes of a
    failed run; on gloo it also sees the peer gone), long before the collective timeout (120 s)."""
    import os
    import time

    root = HANG_RANKS.parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(HANG_RANKS), "other-fails-mid-pass", "120", str(tmp_path)],
                          capture_output=True, text=True, timeout=180, cwd=root, env=env)
    seconds = time.monotonic() - t0
    assert done.returncode != 0  # the run failed ...
    one = json.loads((tmp_path / "rank1.json").read_text())
    assert one["raised"] == "CUDA out of memory (injected)"
    progress = tmp_path / "rank0.progress"
    assert not (tmp_path / "rank0.json").exists() or json.loads((tmp_path / "rank0.json").read_text())["raised"]
    assert int(progress.read_text()) < 3 if progress.exists() else True  # rank 0 never got the third weight
    assert seconds < 60, seconds  # ... at rank 1's exit, not at the 120 s timeout


def test_the_optimizer_shards_are_planned_on_the_control_group_and_round_trip(push_ranks):
    """torch.distributed.checkpoint plans with object collectives (pickles): on the gloo control
    group, not the default group (NCCL on GPUs). Spied on `dcp.save`/`dcp.load`; the state loads
    back exactly."""
    for report in push_ranks:
        assert report["dcp_on_control_group"] == [["save", True], ["load", True]], report
        assert report["optimizer_state_gap"] == 0.0 and report["optimizer_state_moved"] > 1e-3


def test_the_weight_pass_is_gathered_once_and_stops_once(monkeypatch):
    """A pass announces exactly as many gathers as the others join; `stop` after the end (or a
    second `stop`) announces nothing, since no rank is waiting for it. The consumer sees each
    shard's shape and dtype."""
    net = torch.nn.Linear(2, 2)
    sent = []
    monkeypatch.setattr(distributed, "_announce", lambda ranks, signal=None: sent.append(signal) or signal)
    weights = distributed.WeightPass(net, distributed.Ranks(rank=0, world_size=2))
    assert [n for n, _ in weights.weights] == ["weight", "bias"]
    assert weights.weights[0][1].shape == (2, 2) and weights.weights[1][1].dtype == torch.float32
    torch.testing.assert_close(weights.weights[0][1].full_tensor(), net.weight)
    assert weights.open
    weights.weights[1][1].full_tensor()
    assert not weights.open
    with pytest.raises(RuntimeError, match="over"):
        weights.weights[1][1].full_tensor()
    weights.stop()
    stopped = distributed.WeightPass(net, distributed.Ranks(rank=0, world_size=2))
    stopped.stop()
    stopped.stop()
    assert sent == [distributed._GO, distributed._GO, distributed._STOP]


# -- several nodes: the socket interface ---------------------------------------------------------
def test_the_socket_interface_is_the_one_that_reaches_the_master():
    """gloo and NCCL are told the interface this node reaches the master through; a variable the
    user set is kept. 127.0.0.1 leaves through `lo` on any Linux machine; a fake table names
    what a cluster node would have."""
    assert distributed.interface_towards("127.0.0.1") == "lo"
    assert distributed.interface_towards("127.0.0.1", {"ib0": "10.1.0.7", "lo": "127.0.0.1"}) == "lo"
    assert distributed.interface_towards("127.0.0.1", {"ib0": "10.1.0.7"}) is None
    assert distributed.interface_towards("no-such-host.invalid") is None
    assert distributed.socket_interface_env("127.0.0.1", {}) == {"GLOO_SOCKET_IFNAME": "lo",
                                                                 "NCCL_SOCKET_IFNAME": "lo"}
    assert distributed.socket_interface_env("127.0.0.1", {"NCCL_SOCKET_IFNAME": "ib0"}) == {
        "GLOO_SOCKET_IFNAME": "lo"}
    assert distributed.socket_interface_env("127.0.0.1", {"GLOO_SOCKET_IFNAME": "eth1",
                                                          "NCCL_SOCKET_IFNAME": "ib0"}) == {}
    assert distributed.socket_interface_env("no-such-host.invalid", {}) == {}  # logged; nothing guessed
