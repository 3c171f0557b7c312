"""ARPO's grouping as a pure function: a batch, the buffer, a loader and an estimator in, groups out."""
from arpo_lib.algo import ReplayBuffer, item_directory, make_groups, replay_item
from arpo_lib.types import EpisodeStatus, Trajectory


def traj(task, score, sample, status=EpisodeStatus.OK):
    return Trajectory(task=task, seed=0, sample=sample, instruction="", task_score=score, format_ok=True,
                      reward=score, status=status, directory=f"/runs/x/{task}/{sample}")


def test_an_all_failed_group_gets_a_stored_success_loaded_once_and_fresh_successes_are_stored_after():
    buffer = ReplayBuffer(capacity_per_task=4, seed=0)
    buffer.add("a", replay_item("/runs/old/a/7", 1.0, 1.0), 1.0)
    loaded = []

    def load(directory):
        loaded.append(directory)
        return traj("a", 1.0, 7)

    batch = [traj("a", 0.0, i) for i in range(4)] + [traj("b", 1.0, 0), traj("b", 0.0, 1),
                                                     traj("b", 0.0, 2, EpisodeStatus.ENV_ERROR)]
    groups = make_groups(["a", "b", "a"], batch, buffer, load=load, advantages=lambda r: [x - sum(r) / len(r) for x in r])
    assert [g.task for g in groups] == ["a", "b"]
    a, b = groups
    assert loaded == ["/runs/old/a/7"] and a.injected and a.all_failed
    assert a.trajectories[0].replayed and a.trajectories[0].sample == 7 and [t.sample for t in a.trajectories[1:]] == [1, 2, 3]
    assert a.advantages == [0.75, -0.25, -0.25, -0.25]
    assert not b.injected and [t.sample for t in b.trajectories] == [0, 1]  # the infrastructure failure dropped
    assert [item_directory(i) for i in buffer.successes("b")] == ["/runs/x/b/0"]
    assert [item_directory(i) for i in buffer.successes("a")] == ["/runs/old/a/7"]  # failures are not stored


def test_a_task_left_with_one_trajectory_forms_no_group_but_its_success_is_stored():
    buffer = ReplayBuffer(seed=0)
    batch = [traj("c", 1.0, 0), traj("c", 0.0, 1, EpisodeStatus.ENV_ERROR)]
    assert make_groups(["c"], batch, buffer, load=lambda d: None, advantages=lambda r: r) == []
    assert [item_directory(i) for i in buffer.successes("c")] == ["/runs/x/c/0"]
