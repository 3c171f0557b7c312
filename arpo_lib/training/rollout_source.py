"""Where a trainer's rollouts come from: which tasks a batch holds (`task_batch`: the data order),
who generates (the trained model in this process, or model servers kept on its weights), on which
environments, with which sampling settings, and which share of the episodes each process runs.

    tasks = task_batch(rollouts.tasks, step, tasks_per_batch, seed)
    trajs, env_steps = rollouts.sample(tasks, step, version)   # tasks x G seeded episodes, every rank
    rollouts.weights_changed(version)                          # servers: the new weights from now on
    engine = rollouts.engine(version, announce=False)          # rank 0's evaluation

`build.trainer` makes it from `rollout.*`, `env.*` and the reward shaping of `algo.*`, so the
trainer never reads those keys. Distributed (torchrun), each rank plays its share of a batch's
episodes in its own environments and every rank gets the whole batch; with servers, rank 0 keeps
them current and announces their URLs, the other ranks follow (`training.contracts.FollowingWeights`).
"""
from __future__ import annotations

import random
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import torch

from arpo_lib.rollout.engine import RolloutEngine, SharedWorkers
from arpo_lib.rollout.store import without_pixels
from arpo_lib.run.layout import RunDir
from arpo_lib.run.seeding import stable_seed
from arpo_lib.training.backend import TrainingBackend
from arpo_lib.types import Policy, Trajectory, WorkerPool, episode_requests
from arpo_lib.training.contracts import FollowingWeights, ServedWeights, TrainablePolicy


def task_batch(tasks: list[str], step: int, tasks_per_batch: int, seed: int) -> list[str]:
    """Tasks of rollout batch `step`: distinct tasks, slices of a seeded per-epoch permutation.

    An epoch has len(tasks) // tasks_per_batch batches; the remainder of a permutation is left
    out of that epoch (the next epoch's permutation differs), so a batch never holds a task twice.
    Depends only on its arguments, so a resumed run continues the same order.
    """
    per_epoch = len(tasks) // tasks_per_batch
    if per_epoch == 0:
        raise ValueError(f"tasks_per_batch={tasks_per_batch} > {len(tasks)} tasks")
    epoch, index = divmod(step, per_epoch)
    order = list(tasks)
    random.Random(stable_seed(seed, "epoch", epoch)).shuffle(order)
    return order[index * tasks_per_batch:(index + 1) * tasks_per_batch]


class PromptMismatchError(RuntimeError):
    """The servers' prompts are not the trainer's (`RolloutSource._check_prompts`)."""


class RolloutSource:
    """A trainer's rollouts (see the module docstring).

    Args:
        policy: the trained policy (it generates when `served` is None).
        tasks: the tasks trained on (env.tasks, task sets expanded).
        make_pool: builds the environment pool when first needed.
        backend: the training processes (this one's share of the episodes, the gather).
        served: model servers following the trained weights (rollout.backend=server); on ranks
            other than 0, a follower of rank 0's servers.
        run: the run directory (<run>/rollouts/step_N).
        group_size: G, the rollouts of each task in a batch (rollout.group_size).
        temperature, top_p: sampling (rollout.*); the update's log-probs use the same temperature.
        max_steps: the episode length limit (env.max_steps).
        format_coef, format_penalty: the reward's format term (algo.*).
        seed: the run's seed (train.seed): episodes and sampling are seeded by (seed, step).
        progress: progress bars.
        engine_options: `RolloutEngine`'s scheduling (rollout.mode, gather_window_s, max_batch).
        max_staleness: batches sampled ahead by servers while the trainer updates (`run_ahead`);
            each response then records the weight version that produced it.
    """

    def __init__(self, policy: TrainablePolicy, tasks: list[str], make_pool: Callable[[], WorkerPool],
                 backend: TrainingBackend, *, served: ServedWeights | None, run: RunDir, group_size: int,
                 temperature: float, top_p: float, max_steps: int, format_coef: float, format_penalty: float, seed: int,
                 progress: bool, engine_options: dict[str, Any] | None = None, max_staleness: int = 0):
        self.policy, self.tasks, self.backend, self.served, self.run = policy, tasks, backend, served, run
        self.group_size, self.temperature, self.top_p, self.seed = group_size, temperature, top_p, seed
        self.max_steps, self.format_coef, self.format_penalty, self.progress = (max_steps, format_coef,
                                                                                format_penalty, progress)
        self._make_pool = make_pool
        self._pool: WorkerPool | None = None
        self.engine_options = dict(engine_options or {})
        """How the engine schedules episodes (`RolloutEngine`'s mode, gather_window_s, max_batch)."""
        self.max_staleness = max_staleness
        """Rollout batches sampled ahead, while the updates before them run (rollout.max_staleness)."""
        self._ahead: dict[int, tuple[Future, RolloutEngine]] = {}  # step -> its batch running in the background
        self._runner: ThreadPoolExecutor | None = None
        self._shared = SharedWorkers() if max_staleness else None
        self._prompts_checked = False
        """The environments, shared by the batches that run at once (the oldest first)."""
        self.env_seconds = self.generator_seconds = 0.0
        """Over the run so far: seconds the environments were busy (summed over this process's
        workers) and the generator was (`RolloutEngine.busy`); benchmarks/bench_async.py reads them."""

    @property
    def pool(self) -> WorkerPool:
        if self._pool is None:
            self._pool = self._make_pool()
        return self._pool

    def acting(self, version: int, announce: bool = True) -> Policy:
        """Who generates: this process's model, or the servers holding weight version `version`.
        Distributed, rank 0 brings the servers up to date and (`announce`) tells the other ranks
        their URLs, which all call this together (a rollout batch, a run's evaluation); `announce=False`:
        this process alone (an evaluation outside a distributed run)."""
        if self.served is None:
            return self.policy
        if announce and self._gathered:
            self._bring_servers_to(version)
        if isinstance(self.served, FollowingWeights):
            self.backend.on_main(lambda: None)  # rank 0 brings its servers to the version meanwhile
            urls = self.backend.broadcast(None)
            if not self.max_staleness:
                return self.served.follow(urls)
            with self.served.version_lock.push():  # the batch ahead's requests see one version each
                self.served.learned(version, urls)
            return self.served.versioned()
        if self._gathered and not announce and self.served.passes_over_weights(version):
            raise RuntimeError(f"rank 0 alone cannot bring the servers to weight version {version}: the weights "
                               "exist only as shards, gathered with every rank (weights_changed first)")
        if not announce:
            return self.served.policy(version)
        # under on_main: when rank 0's servers fail (a start, a confirmation) the other ranks raise
        # at once with its error instead of waiting for the announcement until rank 0 has gone
        policy = self.backend.on_main(lambda: self.served.policy(version))
        self.backend.broadcast(self.served.urls)
        return self.served.versioned() if self.max_staleness else policy

    @property
    def _gathered(self) -> bool:
        """No rank holds the full model: the servers' weights are gathered from every rank's shards."""
        return not self.backend.keeps_full_model

    def _bring_servers_to(self, version: int) -> None:
        """Every rank together (no full copy): rank 0 says whether bringing the servers to `version`
        reads the weights, then saves or sends them while the others take part in the gathers."""
        if isinstance(self.served, FollowingWeights):
            if self.backend.broadcast(None):
                self.backend.join_full_weights()
            self.backend.on_main(lambda: None)  # rank 0's servers confirm the version (or fail: raises here too)
            return
        if self.backend.broadcast(self.served.passes_over_weights(version)):
            self.backend.expect_weights_pass()  # the others wait in its gathers from now on: a failure stops it
        self.backend.on_main(lambda: self.served.policy(version))  # the others take part in its gathers first

    def engine(self, version: int, announce: bool = True, keep_pixels: bool = True,
               batch: int | None = None) -> RolloutEngine:
        """A rollout engine over this process's environments (see `acting`). `keep_pixels=False`:
        finished episodes drop their pixels once written (the update re-encodes them from disk).
        `batch`: the training batch it plays, sharing the environments with the batches ahead."""
        shared = {"shared": self._shared, "batch": batch} if batch is not None and self._shared else {}
        return RolloutEngine(self.acting(version, announce), self.pool, max_steps=self.max_steps,
                             format_coef=self.format_coef, format_penalty=self.format_penalty, keep_pixels=keep_pixels,
                             **self.engine_options, **shared)

    def run_ahead(self, step: int, version: int, last_step: int, tasks_of: Callable[[int], list[str]]) -> None:
        """Start the batches after `step` (up to `max_staleness` of them, none past `last_step`)
        that are not running yet, in the background, on the servers' current weights (`version`):
        they play while batch `step` finishes and the trainer updates, on the environments that
        batch `step` no longer needs (`SharedWorkers`: an older batch gets a free one first), and
        the pushes after the updates land between their requests (`ServedPolicy.version_lock`),
        never within one response. Called before batch `step` is sampled."""
        if step not in self._ahead and self._shared is not None:
            self._shared.want(step, True)  # batch `step` is about to start here: it goes first
        for ahead in range(step + 1, min(step + 1 + self.max_staleness, last_step)):
            if ahead in self._ahead:
                continue
            requests = episode_requests(tasks_of(ahead), self.group_size, self.seed, ahead)
            out_dir = self.run.rollouts(ahead)
            if out_dir.exists():
                shutil.rmtree(out_dir)
            engine = RolloutEngine(self.served.versioned(), self.pool, max_steps=self.max_steps,
                                   format_coef=self.format_coef, format_penalty=self.format_penalty, keep_pixels=False,
                                   **self.engine_options, shared=self._shared, batch=ahead)
            if self._runner is None:  # a thread per batch ahead: they share the environments
                self._runner = ThreadPoolExecutor(max_workers=self.max_staleness, thread_name_prefix="arpo-ahead")
            future = self._runner.submit(engine.run, self.backend.share(requests), temperature=self.temperature,
                                         top_p=self.top_p, out_dir=out_dir, progress=False,
                                         description=f"rollout {ahead} (ahead)", policy_version=version)
            self._ahead[ahead] = (future, engine)

    def wait_ahead(self) -> None:
        """Until the batches running ahead are done (before anything else uses the environments:
        an evaluation)."""
        for future, _ in self._ahead.values():
            future.exception()

    def sample(self, tasks: list[str], step: int, version: int) -> tuple[list[Trajectory], int]:
        """Rollout batch `step`: G seeded episodes of every task, played by weight version
        `version` into <run>/rollouts/step_N; returns every trajectory in request order (on every
        rank) and the environment steps taken (over all ranks). A batch started ahead
        (`run_ahead`) is waited for instead: played by the versions its steps record."""
        if step in self._ahead:
            future, engine = self._ahead.pop(step)
            mine = future.result()
            self._count(engine)
            self._check_prompts()
            return self.gather(mine), int(self.backend.all_reduce_sum([engine.env_steps])[0])
        requests = episode_requests(tasks, self.group_size, self.seed, step)
        out_dir = self.run.rollouts(step)
        if out_dir.exists() and self.backend.is_main:  # a step being redone after a crash
            shutil.rmtree(out_dir)
        self.backend.barrier()
        torch.manual_seed(stable_seed(self.seed, "sample", step))
        engine = self.engine(version, keep_pixels=False, batch=step)  # a batch's pixels: ~50 MB per 1080p screenshot
        mine = engine.run(self.backend.share(requests), temperature=self.temperature, top_p=self.top_p,
                          out_dir=out_dir, progress=self.progress, description=f"rollout {step}",
                          policy_version=version)
        self._count(engine)
        self._check_prompts()
        free = getattr(self.policy, "free_generation_memory", None)
        if self.served is None and free is not None:  # it generated here: its caches go before the update
            free()
        return self.gather(mine), int(self.backend.all_reduce_sum([engine.env_steps])[0])

    def _check_prompts(self) -> None:
        """After this process's first batch through servers: a prompt the server tokenized otherwise
        than the trainer (another chat template or tokenizer) stops the run, naming the first
        differing token. Its behaviour log-probs belong to another prompt than the one trained on."""
        if self._prompts_checked or self.served is None:
            return
        self._prompts_checked = True
        mismatch = getattr(getattr(self.served, "client", None), "first_prompt_mismatch", None)
        if mismatch:
            raise PromptMismatchError(
                f"the servers tokenized a prompt otherwise than the trainer ({mismatch}): their chat template or "
                "tokenizer is not the model's (serve a copy of model.path's own files, or a server that matches); "
                "training on this would pair the server's log-probs with another prompt")

    def _count(self, engine: RolloutEngine) -> None:
        busy = getattr(engine, "busy", None)  # (a stand-in engine may not keep the time)
        if busy is not None:
            self.env_seconds += sum(busy.env_seconds)
            self.generator_seconds += busy.generator_seconds

    def gather(self, mine: list[Trajectory]) -> list[Trajectory]:
        """Every rank's episodes in request order: the others' as tokens and metadata only, never
        pixels (`store.without_pixels`; the update re-encodes the screenshots of the sequences this
        rank trains on from the shared run directory); this rank's own keep theirs."""
        if not self.backend.ranks.distributed:
            return self.backend.gather(mine)
        trajs = self.backend.gather([without_pixels(t) for t in mine])
        trajs[self.backend.ranks.rank::self.backend.ranks.world_size] = mine
        return trajs

    def weights_changed(self, version: int) -> None:
        """The trained weights are now version `version`: the servers generate with them from now on.
        Distributed with batches playing ahead, every rank first holds its own requests back (after
        those in flight, which end: no push is under way yet), so no rank's response straddles rank
        0's push; each learns the new version, and the servers' URLs (a restart moves them), before
        its requests go on."""
        if self.served is None:
            return
        if not (self.max_staleness and self.backend.ranks.distributed):
            if self._gathered:  # every rank calls this: they take part in the push
                self._bring_servers_to(version)
            else:
                self.served.policy(version)
            return
        with self.served.version_lock.push():
            self.backend.barrier()  # no rank has a request in flight, none starts one
            if self._gathered:
                self._bring_servers_to(version)
            else:  # rank 0 pushes the full copy it holds; the others wait for it
                self.backend.on_main(lambda: self.served.policy(version))
            urls = self.backend.broadcast(None if isinstance(self.served, FollowingWeights) else self.served.urls)
            if isinstance(self.served, FollowingWeights):
                self.served.learned(version, urls)

    def metrics(self) -> dict[str, Any]:
        """The servers' counters (requests, mismatches, sync time), for the step's metrics."""
        return self.served.metrics() if self.served is not None else {}

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()  # first: a batch running ahead then ends at once (its episodes fail)
            self._pool = None
        if self._runner is not None:
            self._runner.shutdown(wait=True, cancel_futures=True)
            self._runner = None
            self._ahead.clear()
        if self.served is not None:
            self.served.close()
