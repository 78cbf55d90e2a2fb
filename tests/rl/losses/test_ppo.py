"""PPO's clipped value loss and GAE against values computed by hand."""

import pytest
import torch

from jointrl.rl.advantages import token_gae
from jointrl.rl.losses import LossInputs, PPOLoss

D = torch.float64


def test_ppo_value_clipping_by_hand():
    # ratio 1, advantages +.5 / -.5: the policy terms cancel; only the value loss remains
    t = lambda *x: torch.tensor([x], dtype=D)  # noqa: E731
    inp = LossInputs(t(0.0, 0.0), t(0.0, 0.0), t(0.5, -0.5), t(1, 1), torch.zeros(1, 2, dtype=torch.long), 1, norm=2,
                     values_BT=t(0.5, 0.9), old_values_BT=t(0.2, 0.8), returns_BT=t(1.0, 1.0))
    loss, m = PPOLoss(value_clip=0.2, vf_coef=0.5)(inp)
    # token 0: V .5, V_old .2 -> Vc = .2 + clip(.3, +-.2) = .4; max((.5-1)^2, (.4-1)^2) = .36 -> .18
    # token 1: V .9, V_old .8 -> Vc = .9; both .01 -> .005
    assert loss.item() == pytest.approx(0.5 * (0.18 + 0.005) / 2, abs=1e-12)
    assert m["vf_loss"] == pytest.approx((0.18 + 0.005) / 2)
    assert m["vf_clip_frac"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="values_BT"):
        PPOLoss()(LossInputs(t(0.0), t(0.0), t(0.0), t(1), torch.zeros(1, 1, dtype=torch.long), 1, 1.0))


@pytest.mark.parametrize("gamma, lam, adv, ret", [
    # values .5 .6 .7, reward 1 at the last token
    # delta = (.1, .1, .3); A_2 = .3, A_1 = .1 + .5 * .3 = .25, A_0 = .1 + .5 * .25 = .225
    (1.0, 0.5, [0.225, 0.25, 0.3], [0.725, 0.85, 1.0]),
    # delta = (.9*.6-.5, .9*.7-.6, .3) = (.04, .03, .3); A_1 = .03 + .9 * .3 = .3, A_0 = .04 + .9 * .3 = .31
    # returns with lam = 1 are the discounted Monte-Carlo returns .81, .9, 1
    (0.9, 1.0, [0.31, 0.3, 0.3], [0.81, 0.9, 1.0]),
])
def test_gae_by_hand(gamma, lam, adv, ret):
    a, r = token_gae(1.0, torch.tensor([0.5, 0.6, 0.7], dtype=D), gamma, lam)
    assert a.tolist() == pytest.approx(adv, abs=1e-12)
    assert r.tolist() == pytest.approx(ret, abs=1e-12)
    with pytest.raises(ValueError, match="gamma"):
        token_gae(1.0, torch.zeros(2), 1.5, 0.5)
