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


def test_group_relative_estimator_selects_in_the_driver_and_passes_advantages_through():
    from types import SimpleNamespace

    import torch

    from jointrl.rl.advantages import GroupRelative

    trajs = [traj("a", 1), traj("a", 0), traj("b", 3), traj("a", 7, FinishReason.ENV_ERROR)]
    res = GroupRelative(scale_by_std=False).select(trajs)
    assert [t.reward for t in res.kept] == [1, 0, 3] and res.advantages == pytest.approx([1 - 4 / 3, 0 - 4 / 3, 3 - 4 / 3])
    assert res.stats["env_error"] == 1
    by_domain = GroupRelative(scale_by_std=False, by_domain=True).select(trajs)  # a: +1, -1; b alone: 0
    assert by_domain.advantages == pytest.approx([1, -1, 0], abs=1e-5)
    adv_BT = torch.ones(1, 2)
    assert GroupRelative().token_terms(SimpleNamespace(adv=adv_BT), None).adv_BT is adv_BT


def test_gae_estimator_keeps_every_scored_trajectory_and_runs_gae_per_sequence():
    from types import SimpleNamespace

    import torch
    from torch import nn

    from jointrl.rl.advantages import GAE, token_gae
    from jointrl.rl.learner.value_head import values

    trajs = [traj("a", 1), traj("a", 1), traj("a", 0, FinishReason.ENV_ERROR)]
    res = GAE().select(trajs)
    assert len(res.kept) == 2 and res.advantages == [0.0, 0.0] and res.stats["env_error"] == 1
    model = nn.Module()
    model.value_head = nn.Linear(2, 1, dtype=torch.float64)
    hidden_BTH = torch.randn(1, 6, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    # row 0 packs sequence 0 (tokens 0-2, loss on 1-2) and sequence 1 (tokens 3-5, loss on 4-5)
    mb = SimpleNamespace(seg=torch.tensor([[0, 0, 0, 1, 1, 1]]), loss_mask=torch.tensor([[0, 1, 1, 0, 1, 1]]),
                         rewards=torch.tensor([1.0, -1.0], dtype=torch.float64), num_seqs=2, adv=None)
    terms = GAE(gamma=0.9, lam=0.8).token_terms(mb, values(model, hidden_BTH))
    v_BT = model.value_head(hidden_BTH).squeeze(-1)
    v_BT = torch.cat([torch.zeros(1, 1, dtype=torch.float64), v_BT[:, :-1]], 1).detach()  # V of the state before t
    for seq, idx, reward in ((0, [1, 2], 1.0), (1, [4, 5], -1.0)):
        a, r = token_gae(reward, v_BT[0, idx], 0.9, 0.8)
        assert terms.adv_BT[0, idx].tolist() == pytest.approx(a.tolist()) and terms.returns_BT[0, idx].tolist() == pytest.approx(r.tolist())
    assert terms.values_BT.requires_grad and not terms.old_values_BT.requires_grad
    assert terms.adv_BT[0, [0, 3]].tolist() == [0.0, 0.0]
