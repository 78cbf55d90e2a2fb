"""Per-domain reward normalisation by hand (group advantages: tests/rl/losses/test_grpo.py)."""

import pytest

from jointrl.rl.advantages import normalize_rewards_by_domain
from jointrl.rl.types import FinishReason, Trajectory


def traj(domain, reward, finish=FinishReason.STOP):
    return Trajectory([1], [1], [0.0], [0], domain, "t", "g", reward=reward, finish_reason=finish)


def test_rewards_standardised_within_each_domain():
    trajs = [traj("a", 1), traj("b", 10), traj("a", 0), traj("b", 20), traj("b", 30), traj("a", 5, FinishReason.ENV_ERROR)]
    out = normalize_rewards_by_domain(trajs, eps=0.0)
    # a: mean .5, std .5 -> +1, -1 (the env_error one is left out and untouched)
    # b: mean 20, std sqrt(200/3) -> -1.2247, 0, +1.2247
    s = (200 / 3) ** 0.5
    assert [t.reward for t in out] == pytest.approx([1, -10 / s, -1, 0, 10 / s, 5])
    assert out[1].reward_info["raw_reward"] == 10 and trajs[1].reward == 10
