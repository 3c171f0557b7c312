"""Who generates a trainer's rollouts: its own model, or servers on its weights -- rank 0 brings
them to the current version and announces their URLs, the other ranks follow the announcement."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from arpo_lib.run.layout import RunDir
from arpo_lib.serving.weight_sync import FollowingServed
from arpo_lib.training.backend import SingleProcess, TrainingBackend
from arpo_lib.training.distributed import RankFailed
from arpo_lib.training.rollout_source import RolloutSource

URLS = ["http://10.0.0.5:8000/v1"]


class Announcing(SingleProcess):
    """One process standing in for a rank of a group whose rank 0 announced `URLS`."""

    def __init__(self) -> None:
        super().__init__(policy=None)
        self.sent: list[Any] = []

    def broadcast(self, obj: Any) -> Any:
        self.sent.append(obj)
        return URLS if obj is None else obj


class Leading:
    """Servers kept on the trainer's weights (a `ServedWeights`), recording the versions asked for."""

    def __init__(self) -> None:
        self.versions: list[int] = []
        self.urls: list[str] | None = None

    def policy(self, version: int) -> Any:
        self.versions.append(version)
        self.urls = URLS
        return "client"

    def metrics(self) -> dict[str, Any]:
        return {"server_requests": len(self.versions)}

    def close(self) -> None: ...


def _source(served: Any, backend: TrainingBackend, tmp_path: Path) -> RolloutSource:
    return RolloutSource("trained", ["miniwob/click-test"], lambda: None, backend, served=served,
                         run=RunDir(tmp_path), group_size=2, temperature=1.0, top_p=1.0, max_steps=2,
                         format_coef=0.5, format_penalty=-1.0, seed=0, progress=False)


def test_without_servers_the_trained_model_generates(tmp_path):
    backend = Announcing()
    source = _source(None, backend, tmp_path)
    assert source.acting(3) == "trained" and backend.sent == [] and source.metrics() == {}
    source.weights_changed(4)  # nothing to push


def test_rank_0_brings_the_servers_to_the_version_and_announces_them(tmp_path):
    backend, lead = Announcing(), Leading()
    source = _source(lead, backend, tmp_path)
    assert source.acting(3) == "client" and lead.versions == [3] and backend.sent == [URLS]
    assert source.acting(3, announce=False) == "client" and backend.sent == [URLS]  # its evaluation: alone
    source.weights_changed(4)
    assert lead.versions == [3, 3, 4] and source.metrics() == {"server_requests": 3}


def test_the_other_ranks_follow_the_announced_servers(tmp_path):
    backend = Announcing()
    following = FollowingServed(connect=lambda url: f"client of {url}")
    source = _source(following, backend, tmp_path)
    assert source.acting(3) == f"client of {URLS[0]}" and backend.sent == [None]  # received, not sent
    assert following.urls == URLS
    source.weights_changed(4)  # followers never push
    assert source.metrics() == {}


class _ShardsOnly(Announcing):
    """A rank of a group whose ranks keep only shards (FSDP2, keep_full_model=False): `broadcast`
    hands out rank 0's objects in turn; `join_full_weights` records this rank's part in a pass."""

    keeps_full_model = False

    def __init__(self, rank: int, from_rank_0: list[Any] | None = None) -> None:
        super().__init__()
        from arpo_lib.training.distributed import Ranks

        self.ranks, self.from_rank_0, self.joined = Ranks(rank=rank, world_size=2), list(from_rank_0 or []), 0

    def broadcast(self, obj: Any) -> Any:
        self.sent.append(obj)
        return obj if self.ranks.is_main else self.from_rank_0.pop(0)

    def join_full_weights(self) -> None:
        self.joined += 1

    def on_main(self, work: Any) -> Any:
        """Rank 0 runs `work`; a rank 0 failure reaches the others as `failed_on_main` says."""
        self.sent.append("on_main")
        if self.ranks.is_main:
            return work()
        if getattr(self, "failed_on_main", None):
            from arpo_lib.training.distributed import RankFailed

            raise RankFailed(f"rank 0 failed while the others waited for it: {self.failed_on_main}")
        return None


class _Pushing(Leading):
    """Rank 0's servers: a pass over the weights when the version they hold is not the one asked for."""

    def __init__(self) -> None:
        super().__init__()
        self.held: int | None = None
        self.passes = 0

    def passes_over_weights(self, version: int) -> bool:
        return self.held != version

    def policy(self, version: int) -> Any:
        if self.held != version:
            self.passes, self.held = self.passes + 1, version
        return super().policy(version)


def test_without_a_full_copy_every_rank_takes_part_in_each_pass_over_the_weights(tmp_path):
    """Where no rank keeps the full model, a push (or the save a server loads) gathers
    the shards with every rank: rank 0 tells the others before each, they join exactly then."""
    lead, zero = _Pushing(), _ShardsOnly(0)
    source = _source(lead, zero, tmp_path)
    assert source.acting(3) == "client" and lead.passes == 1
    # "a pass follows", rank 0's servers brought to it under on_main, the same confirmed, the URLs
    assert zero.sent == [True, "on_main", "on_main", URLS]
    source.weights_changed(3)  # nothing new: no pass
    source.weights_changed(5)
    assert lead.passes == 2 and zero.sent[4:] == [False, "on_main", True, "on_main"]
    assert source.acting(5, announce=False) == "client"  # rank 0's evaluation alone: nothing to gather
    lead.held = 4
    with pytest.raises(RuntimeError, match="rank 0 alone cannot"):  # it would wait for the others forever
        source.acting(5, announce=False)

    # rank 1 hears the same decisions and joins exactly the passes rank 0 makes
    one = _ShardsOnly(1, [True, URLS, False, True])
    following = FollowingServed(connect=lambda url: f"client of {url}")
    follower = _source(following, one, tmp_path)
    assert follower.acting(3) == f"client of {URLS[0]}" and one.joined == 1
    follower.weights_changed(3)
    follower.weights_changed(5)
    assert one.joined == 2 and one.from_rank_0 == []
    assert one.sent.count("on_main") == 4  # where rank 0 ran its servers' part, rank 1 waited for its outcome

    # rank 0's servers fail after a pass (a confirmation that does not match): rank 1 raises at
    # once with its error, never reaching the announcement it would otherwise wait for
    one = _ShardsOnly(1, [True])
    one.failed_on_main = "WeightSyncError: the server at http://10.0.0.5:8000 confirmed another checksum"
    with pytest.raises(RankFailed, match="confirmed another checksum"):
        _source(FollowingServed(connect=str), one, tmp_path).acting(7)
    assert one.joined == 1 and one.sent == [None, "on_main"]


class _SecondOfTwo(SingleProcess):
    """One process standing in for rank 1 of 2: `gather` records the pickled bytes it would
    send and returns rank 0's episodes (what rank 0 sent) around its own."""

    def __init__(self, from_rank_0: list[Any]) -> None:
        super().__init__(policy=None)
        from arpo_lib.training.distributed import Ranks

        self.ranks = Ranks(rank=1, world_size=2)
        self.from_rank_0, self.sent_bytes = from_rank_0, 0

    def gather(self, mine: list[Any]) -> list[Any]:
        import pickle

        self.sent_bytes += len(pickle.dumps(mine))
        return [t for pair in zip(self.from_rank_0, mine) for t in pair]


def _episode(tmp_path: Path, processor: Any, sample: int) -> Any:
    """A stored episode with one 640x480 screenshot in its segment, pixels encoded as at sampling."""
    from PIL import Image

    from arpo_lib.rollout.store import write_trajectory
    from arpo_lib.types import Segment, Trajectory

    shot = Image.new("RGB", (640, 480), (30 * sample, 90, 200))
    shot.paste((255, 255, 255), (40, 40, 200, 120))
    enc = processor.image_processor(images=[shot], return_tensors="pt")
    seg = Segment(input_ids=[1, 2, 3], mm_token_type_ids=[0, 1, 0], loss_mask=[0, 0, 1],
                  behaviour_logprobs=[0.0, 0.0, -1.0], pixel_values=[enc["pixel_values"]],
                  image_grid_thw=list(enc["image_grid_thw"]), screenshot_steps=[0])
    traj = Trajectory("miniwob/click-test", seed=sample, sample=sample, segments=[seg])
    write_trajectory(traj, tmp_path / "rollouts" / str(sample), [shot])
    return traj


def test_ranks_exchange_tokens_not_pixels_and_re_encode_the_pixels_exactly(tmp_path, tiny_qwen2vl):
    """Regression: an episode's screenshots went to every rank as fp32 pixels (~50 MB per 1080p
    screenshot, over NCCL). Now a rank sends tokens and metadata, keeps its own episodes' pixels,
    and `load_pixels` re-encodes another rank's from the run directory bit for bit."""
    import pickle

    import torch
    from transformers import AutoProcessor

    from arpo_lib.rollout.store import load_pixels, without_pixels

    processor = AutoProcessor.from_pretrained(tiny_qwen2vl)
    theirs, mine = _episode(tmp_path, processor, 0), _episode(tmp_path, processor, 1)
    pixels_bytes = len(pickle.dumps(mine))
    backend = _SecondOfTwo([without_pixels(theirs)])
    got = _source(None, backend, tmp_path).gather([mine])
    assert pixels_bytes > 1_000_000 and backend.sent_bytes < 8_000  # the cap: tokens and metadata only
    assert got[1] is mine and got[1].segments[0].pixel_values  # its own keep their pixels
    other = got[0].segments[0]
    assert other.pixel_values == [] and other.input_ids == [1, 2, 3] and other.screenshot_steps == [0]
    load_pixels(other, got[0].directory, processor)
    assert torch.equal(other.pixel_values[0], theirs.segments[0].pixel_values[0])
    assert torch.equal(other.image_grid_thw[0], theirs.segments[0].image_grid_thw[0])


def test_a_rollout_batch_drops_its_pixels_once_written_and_rank_0s_evaluation_keeps_them(tmp_path, monkeypatch):
    """Regression: a batch held every finished episode's fp32 pixels until the update (~130 GB at
    32x8 1080p episodes); the training batch's engine drops them once written (the update
    re-encodes them per micro-batch), the evaluation's keeps its default."""
    from arpo_lib.training import rollout_source

    made = []

    class Engine:
        env_steps = 0

        def __init__(self, policy: Any, pool: Any, **kwargs: Any) -> None:
            made.append(kwargs)

        def run(self, requests: list, **kwargs: Any) -> list:
            return []

    monkeypatch.setattr(rollout_source, "RolloutEngine", Engine)
    source = _source(None, SingleProcess(policy=None), tmp_path)
    assert source.sample(["miniwob/click-test"], step=1, version=1) == ([], 0)
    source.engine(1, announce=False)
    assert [kw["keep_pixels"] for kw in made] == [False, True]


def test_the_rollouts_caches_are_freed_before_the_update(tmp_path, monkeypatch):
    """Regression: nothing returned the rollouts' memory before the update: episodes' KV caches left
    by an episode that did not release its own, and the GPU allocator's cached blocks. After an
    in-process batch the policy forgets every cache and, on a GPU, empties the allocator's cache;
    with servers generating there is nothing of ours to free."""
    import torch

    from arpo_lib.agent.hf_policy import HFPolicy
    from arpo_lib.training import rollout_source

    class Engine:
        env_steps = 0

        def __init__(self, policy: Any, pool: Any, **kwargs: Any) -> None:
            pass

        def run(self, requests: list, **kwargs: Any) -> list:
            order.append("rollouts")
            return []

    class Policy:
        device = torch.device("cuda")  # as far as the release sees
        cached = type("Cached", (), {"clear": lambda self: order.append("caches cleared")})()
        free_generation_memory = HFPolicy.free_generation_memory

    order: list[str] = []
    monkeypatch.setattr(rollout_source, "RolloutEngine", Engine)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: order.append("allocator emptied"))
    source = _source(None, SingleProcess(policy=None), tmp_path)
    source.policy = Policy()
    source.sample(["miniwob/click-test"], step=1, version=1)
    assert order == ["rollouts", "caches cleared", "allocator emptied"]
    order.clear()
    Policy.device = torch.device("cpu")
    source.sample(["miniwob/click-test"], step=2, version=1)
    assert order == ["rollouts", "caches cleared"]  # no allocator on the CPU
    order.clear()
    served = _source(Leading(), SingleProcess(policy=None), tmp_path)
    served.policy = Policy()
    served.sample(["miniwob/click-test"], step=3, version=1)
    assert order == ["rollouts"]
