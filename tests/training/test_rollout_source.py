"""Who generates a trainer's rollouts: its own model, or servers on its weights -- rank 0 brings
them to the current version and announces their URLs, the other ranks follow the announcement."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from arpo_lib.run.layout import RunDir
from arpo_lib.serving.weight_sync import FollowingServed
from arpo_lib.training.backend import SingleProcess, TrainingBackend
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
