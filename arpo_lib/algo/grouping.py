"""A rollout batch into training groups, with ARPO's replay: a pure function of the batch, the
buffer and two callables (how to load a replayed trajectory, how to turn rewards into advantages).

    groups = make_groups(tasks, trajectories, buffer, load=..., advantages=...)

Per task: infrastructure failures dropped; an all-failed group gets one stored success of its task
in place of its first member (`ReplayBuffer.maybe_inject`); the fresh successes are stored after
the injection (the order of ARPO's `apply_replay`); advantages over the group. A task left with
fewer than two trajectories forms no group, but its lone success is still stored, as in ARPO.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from arpo_lib.algo.replay import ReplayBuffer, item_directory, replay_item
from arpo_lib.types import Group, Trajectory


def make_groups(tasks: Sequence[str], trajectories: Sequence[Trajectory], replay: ReplayBuffer,
                *, load: Callable[[str], Trajectory],
                advantages: Callable[[list[float]], list[float]]) -> list[Group]:
    """The batch's groups, in the order of `tasks` (each task once).

    Args:
        tasks: the batch's tasks (repeats are grouped once).
        trajectories: the batch's fresh trajectories, any order; `ok` ones only are trained on.
        replay: the run's buffer (stores and injects; disabled, it does neither).
        load: a stored trajectory's directory -> the trajectory (tokens; the update adds pixels).
        advantages: a group's rewards -> their advantages (the run's estimator).
    """
    groups = []
    for task in dict.fromkeys(tasks):
        fresh = [t for t in trajectories if t.task == task and t.ok]
        items = [replay_item(t.directory, t.task_score, t.reward) for t in fresh]
        if len(fresh) < 2:
            # No comparison possible (all but one rollout hit infrastructure failures), but a
            # lone success is still a success: it goes into the replay buffer, as in ARPO.
            for t, item in zip(fresh, items):
                replay.add(task, item, t.task_score)
            continue
        result = replay.maybe_inject(task, items, [t.task_score for t in fresh])
        group = list(fresh)
        if result.replaced is not None:
            replayed = load(item_directory(result.group[result.replaced]))
            replayed.replayed = True
            group[result.replaced] = replayed
        for t, item in zip(fresh, items):  # after injection, with the fresh (pre-replacement) group
            replay.add(task, item, t.task_score)
        groups.append(Group(task, group, advantages([t.reward for t in group]), result.injected, result.all_failed))
    return groups
