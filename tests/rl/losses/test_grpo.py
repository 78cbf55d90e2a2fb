"""GRPO advantages and loss against values computed by hand."""

import math

import pytest
import torch

from jointrl.rl.advantages import grpo_advantages
from jointrl.rl.losses import Aggregation, GRPOLoss, KLEstimator, LossInputs, Regularizers
from jointrl.rl.types import FinishReason, Trajectory

D = torch.float64


def traj(group, reward, finish=FinishReason.STOP):
    return Trajectory([1], [1], [0.0], [0], "terminal", "t", group, reward=reward, finish_reason=finish)


def inputs(logp, old, adv_B, mask, norm, **kw):
    logp, old, mask = (torch.tensor(x, dtype=D) for x in (logp, old, mask))
    adv = torch.tensor(adv_B, dtype=D)[:, None].expand_as(logp).clone()
    seq = torch.arange(logp.shape[0])[:, None].expand_as(logp).clone()
    return LossInputs(logp, old, adv, mask, seq, logp.shape[0], norm, **kw)


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
    inp = inputs([[0.0, math.log(0.5), math.log(0.9)], [0.0, math.log(0.2), 0.0]],
                 [[0.0, math.log(0.4), math.log(0.5)], [0.0, math.log(0.4), 0.0]],
                 [1.0, -2.0], [[0, 1, 1], [0, 1, 0]], norm=4)
    # ratios: 1.25 (A=+1: min(1.25, clip 1.25) = 1.25), 1.8 (A=+1: min(1.8, 1.28) = 1.28),
    #         0.5 (A=-2: min(-1.0, clip(.5)=.8 * -2 = -1.6) = -1.6)
    expected = -(1.25 + 1.28 - 1.6) / 4
    loss, m = GRPOLoss(clip_low=0.2, clip_high=0.28)(inp)
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    assert m["clip_frac"] == pytest.approx(2 / 3)  # the 1.8 and 0.5 ratios are clipped
    assert m["clip_frac_high"] == pytest.approx(1 / 3) and m["clip_frac_low"] == pytest.approx(1 / 3)
    assert m["ratio_max"] == pytest.approx(1.8) and m["ratio_min"] == pytest.approx(0.5)
    assert m["ratio_mean"] == pytest.approx((1.25 + 1.8 + 0.5) / 3)
    assert m["adv_mean"] == pytest.approx((1 + 1 - 2) / 3) and m["adv_min"] == -2.0
    # approx_kl: k3 of KL(old || new) = mean(r - 1 - log r)
    assert m["approx_kl"] == pytest.approx(sum(r - 1 - math.log(r) for r in (1.25, 1.8, 0.5)) / 3)
    assert m["tokens"] == 3


@pytest.mark.parametrize("agg, norm, expected", [
    # ratio 1 everywhere, so l_t = -A_i: seq 0 has two tokens at -1, seq 1 one token at +3
    (Aggregation.token_mean, 3, (-1 - 1 + 3) / 3),   # / N_tok
    (Aggregation.seq_mean, 2, (-1 + 3) / 2),         # per-sequence token means / N_seq
    (Aggregation.seq_sum, 2, (-2 + 3) / 2),          # per-sequence token sums / N_seq
])
def test_aggregations_by_hand(agg, norm, expected):
    inp = inputs([[0.0, -1.0, -2.0], [0.0, -1.0, 0.0]], [[0.0, -1.0, -2.0], [0.0, -1.0, 0.0]],
                 [1.0, -3.0], [[0, 1, 1], [0, 1, 0]], norm=norm)
    loss, _ = GRPOLoss(aggregation=agg)(inp)
    assert loss.item() == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("estimator, kl", [
    (KLEstimator.k1, math.log(2)),                  # log pi - log pi_ref = log .5 - log .25
    (KLEstimator.k3, 0.5 + math.log(2) - 1),         # r - log r - 1, r = pi_ref / pi = .5
])
def test_kl_and_entropy_terms_by_hand(estimator, kl):
    # one trained token, A = 0 so only the regularisers remain: 0.1 * KL - 0.01 * H, H = 1.2
    inp = inputs([[0.0, math.log(0.5)]], [[0.0, math.log(0.5)]], [0.0], [[0, 1]], norm=1,
                 ref_logp_BT=torch.tensor([[0.0, math.log(0.25)]], dtype=D),
                 entropy_BT=torch.tensor([[0.0, 1.2]], dtype=D))
    loss, m = GRPOLoss(regularizers=Regularizers(kl_coef=0.1, kl_estimator=estimator, entropy_coef=0.01))(inp)
    assert loss.item() == pytest.approx(0.1 * kl - 0.01 * 1.2, abs=1e-12)
    assert m["kl_ref"] == pytest.approx(kl) and m["entropy"] == pytest.approx(1.2)
    with pytest.raises(ValueError, match="ref_logp_BT"):
        GRPOLoss(regularizers=Regularizers(kl_coef=0.1))(inputs([[0.0, 0.0]], [[0.0, 0.0]], [0.0], [[0, 1]], 1))


def test_grpo_loss_gradient_only_through_unclipped_tokens():
    logp = torch.tensor([[math.log(0.5), math.log(0.9)]], dtype=D, requires_grad=True)
    old = torch.log(torch.tensor([[0.4, 0.5]], dtype=D))
    inp = LossInputs(logp, old, torch.ones(1, 2, dtype=D), torch.ones(1, 2, dtype=D), torch.zeros(1, 2, dtype=torch.long), 1, 2)
    loss, _ = GRPOLoss()(inp)
    loss.backward()
    # d/dlogp of -ratio*A/N = -ratio/2 for the unclipped token; 0 for the clipped one
    assert logp.grad[0, 0].item() == pytest.approx(-1.25 / 2)
    assert logp.grad[0, 1].item() == 0.0


def test_bad_inputs_are_value_errors():
    with pytest.raises(ValueError, match="clip"):
        GRPOLoss(clip_low=1.5)
    with pytest.raises(ValueError, match="adv_BT"):
        LossInputs(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 3), torch.zeros(1, 2),
                   torch.zeros(1, 2, dtype=torch.long), 1, 1.0)
