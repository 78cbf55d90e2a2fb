"""GRPO advantages and loss against values computed by hand."""

import math

import pytest
import torch

from jointrl.rl.advantages import grpo_advantages
from jointrl.rl.losses import GRPOLoss
from jointrl.rl.types import FinishReason, Trajectory


def traj(group, reward, finish=FinishReason.STOP):
    return Trajectory([1], [1], [0.0], [0], "terminal", "t", group, reward=reward, finish_reason=finish)


def test_group_advantages_by_hand():
    # group a: rewards 1, 0, 0, 1 -> mean .5, std .5 -> +1, -1, -1, +1 (eps 1e-6)
    # group b: all equal -> dropped; group c: one member after env_error exclusion -> dropped
    trajs = [traj("a", 1), traj("a", 0), traj("b", 1), traj("a", 0), traj("b", 1), traj("a", 1),
             traj("c", 1), traj("c", 0, FinishReason.ENV_ERROR)]
    res = grpo_advantages(trajs, eps=0.0)
    assert [t.group_id for t in res.kept] == ["a"] * 4
    assert res.advantages == pytest.approx([1, -1, -1, 1])
    assert res.stats["env_error"] == 1
    assert res.stats["groups_dropped_zero_variance"] == 1 and res.stats["groups_dropped_small"] == 1
    unscaled = grpo_advantages(trajs, scale_by_std=False)
    assert unscaled.advantages == pytest.approx([0.5, -0.5, -0.5, 0.5])


def test_env_error_members_are_excluded_not_scored_zero():
    # with the env_error counted as 0 the mean would be 1/3; excluded, it is 1/2
    trajs = [traj("a", 1), traj("a", 0), traj("a", 0, FinishReason.ENV_ERROR)]
    res = grpo_advantages(trajs, scale_by_std=False)
    assert res.advantages == pytest.approx([0.5, -0.5])


def test_grpo_loss_by_hand():
    # two sequences, three positions; mask picks 2 + 1 tokens; N (global) = 4 (another rank holds 1 more)
    logp = torch.tensor([[0.0, math.log(0.5), math.log(0.9)], [0.0, math.log(0.2), 0.0]], dtype=torch.float64)
    old = torch.tensor([[0.0, math.log(0.4), math.log(0.5)], [0.0, math.log(0.4), 0.0]], dtype=torch.float64)
    mask = torch.tensor([[0, 1, 1], [0, 1, 0]], dtype=torch.float64)
    adv = torch.tensor([1.0, -2.0], dtype=torch.float64)
    # ratios: 1.25 (A=+1: min(1.25, clip 1.25) = 1.25), 1.8 (A=+1: min(1.8, 1.28) = 1.28),
    #         0.5 (A=-2: min(-1.0, clip(.5)=.8 * -2 = -1.6) = -1.6)
    expected = -(1.25 + 1.28 - 1.6) / 4
    loss, m = GRPOLoss(clip_low=0.2, clip_high=0.28)(logp, old, adv, mask, num_tokens=4)
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    assert m["clip_frac"] == pytest.approx(2 / 3)  # the 1.8 and 0.5 ratios are clipped
    assert m["tokens"] == 3


def test_grpo_loss_gradient_only_through_unclipped_tokens():
    logp = torch.tensor([[math.log(0.5), math.log(0.9)]], dtype=torch.float64, requires_grad=True)
    old = torch.log(torch.tensor([[0.4, 0.5]], dtype=torch.float64))
    loss, _ = GRPOLoss()(logp, old, torch.tensor([1.0], dtype=torch.float64), torch.ones(1, 2), num_tokens=2)
    loss.backward()
    # d/dlogp of -ratio*A/N = -ratio/2 for the unclipped token; 0 for the clipped one
    assert logp.grad[0, 0].item() == pytest.approx(-1.25 / 2)
    assert logp.grad[0, 1].item() == 0.0


def test_bad_clip_range_is_a_value_error():
    with pytest.raises(ValueError, match="clip"):
        GRPOLoss(clip_low=1.5)
