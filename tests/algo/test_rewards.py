"""Rewards, group advantages and the all-failed test, on hand-computed numbers."""
import math

import pytest
import torch

from arpo_lib.algo import group_advantages, is_all_failed, trajectory_reward


def test_trajectory_reward_adds_half_the_format_penalty():
    assert trajectory_reward(1.0, True) == 1.0
    assert trajectory_reward(0.0, True) == 0.0
    assert trajectory_reward(1.0, False) == 0.5
    assert trajectory_reward(0.0, False) == -0.5
    assert trajectory_reward(0.25, False, format_coef=1.0, format_penalty=-2.0) == -1.75


def test_trajectory_reward_rejects_nan():
    with pytest.raises(ValueError, match="finite"):
        trajectory_reward(math.nan, True)


def test_one_success_in_eight_gives_the_paper_numbers():
    # mean 1/8, Bessel var (0.875^2 + 7 * 0.125^2) / 7 = 1/8, std 0.35355
    adv = group_advantages(torch.tensor([1.0, 0, 0, 0, 0, 0, 0, 0]))
    assert adv.shape == (8,)
    assert round(adv[0].item(), 3) == 2.475
    assert all(round(a, 3) == -0.354 for a in adv[1:].tolist())
    assert abs(adv.sum().item()) < 1e-5


def test_all_equal_rewards_give_zero_advantages():
    for value in (0.0, 1.0, -0.5):
        adv = group_advantages(torch.full((8,), value))
        assert torch.equal(adv, torch.zeros(8))


def test_group_of_one_gives_zero_not_nan():
    adv = group_advantages(torch.tensor([0.7]))
    assert adv.tolist() == [0.0]


def test_accepts_a_list_and_a_batch_of_groups():
    adv = group_advantages([[1.0, 0.0], [3.0, 3.0]])  # (N=2, G=2)
    # first group: mean 0.5, Bessel std sqrt(0.5) = 0.7071 -> +-0.7071
    assert adv.shape == (2, 2)
    assert adv[0].tolist() == pytest.approx([0.70711, -0.70711], abs=1e-4)
    assert adv[1].tolist() == [0.0, 0.0]


def test_group_advantages_rejects_bad_input():
    with pytest.raises(ValueError, match="shaped"):
        group_advantages(torch.zeros(2, 2, 2))
    with pytest.raises(ValueError, match="finite"):
        group_advantages(torch.tensor([1.0, float("nan")]))
    with pytest.raises(ValueError, match="at least one"):
        group_advantages(torch.zeros(0))


@pytest.mark.parametrize(
    "scores, expected",
    [
        ([0.0] * 8, True),
        ([1.0] + [0.0] * 7, False),  # a success: population std 0.33
        ([1.0] * 8, False),  # all successes: flat but mean >= 0.2
        ([0.15] * 8, True),  # flat partial credit below the mean threshold
        ([0.2] * 8, False),  # mean threshold is strict
    ],
)
def test_is_all_failed(scores, expected):
    assert is_all_failed(scores) is expected


def test_is_all_failed_uses_population_std_like_the_original():
    # [0, 0.095]: population std 0.0475 < 0.05, Bessel std 0.0672 > 0.05.
    assert is_all_failed([0.0, 0.095]) is True
    assert is_all_failed(torch.tensor([0.0, 0.095])) is True
    assert is_all_failed([0.0, 0.095], std_threshold=0.04) is False


def test_is_all_failed_rejects_empty():
    with pytest.raises(ValueError):
        is_all_failed([])


def test_group_advantages_without_std_normalisation_only_centre():
    # (1 x 15, -0.5): mean 0.90625; centred: +0.09375 for each success, -1.40625 for the outlier.
    rewards = [1.0] * 15 + [-0.5]
    centred = group_advantages(rewards, norm_by_std=False)
    assert centred[:15].tolist() == pytest.approx([0.09375] * 15, abs=1e-7)
    assert centred[15].item() == pytest.approx(-1.40625, abs=1e-7)
    # standardised, the same group blows the outlier up to -3.75 (Bessel std 0.375)
    assert group_advantages(rewards)[15].item() == pytest.approx(-3.75, rel=1e-5)
    # a balanced binary group: centred is +-0.5, standardised +-0.935 (std 0.5345 with G=8)
    balanced = group_advantages([1.0, 0.0] * 4, norm_by_std=False)
    assert balanced.tolist() == pytest.approx([0.5, -0.5] * 4)
    assert group_advantages([0.3] * 4, norm_by_std=False).tolist() == [0.0] * 4
    assert group_advantages([[1.0, 0.0], [2.0, 4.0]], norm_by_std=False).tolist() == [[0.5, -0.5], [-1.0, 1.0]]
