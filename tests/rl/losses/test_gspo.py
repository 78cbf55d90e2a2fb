"""GSPO's sequence-level ratio and clipping against values computed by hand."""

import math

import pytest
import torch

from jointrl.rl.losses import GSPOLoss, LossInputs

D = torch.float64


def test_gspo_loss_and_gradient_by_hand():
    # one packed row: seq 0 = positions 0..2 (trained 1, 2), seq 1 = positions 3..4 (trained 4)
    old = torch.zeros(1, 5, dtype=D)
    logp = torch.tensor([[0.0, math.log(1.1), math.log(0.9), 0.0, math.log(2.0)]], dtype=D, requires_grad=True)
    mask = torch.tensor([[0, 1, 1, 0, 1]], dtype=D)
    seq = torch.tensor([[0, 0, 0, 1, 1]])
    adv = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0]], dtype=D)
    loss, m = GSPOLoss(clip_low=0.2, clip_high=0.28)(LossInputs(logp, old, adv, mask, seq, 2, norm=2))
    s0 = math.sqrt(1.1 * 0.9)  # geometric mean of the token ratios, inside the clip range
    # seq 1: s = 2.0 > 1.28 with A > 0 -> clipped to 1.28 (no gradient)
    assert loss.item() == pytest.approx(-(s0 + 1.28) / 2, abs=1e-12)
    assert m["clip_frac"] == pytest.approx(1 / 2) and m["clip_frac_high"] == pytest.approx(1 / 2)
    assert m["ratio_max"] == pytest.approx(2.0) and m["ratio_min"] == pytest.approx(s0)
    loss.backward()
    # d/dlogp_t of -s0 * A / 2 with s0 = exp(mean of 2 log-ratios): -s0 / 2 / 2 on each trained token of seq 0
    expected = [0.0, -s0 / 4, -s0 / 4, 0.0, 0.0]
    assert logp.grad[0].tolist() == pytest.approx(expected, abs=1e-12)


def test_gspo_negative_advantage_clips_low():
    # s = 0.5 with A = -1: min(-0.5, clip(0.5, 0.8, ..) * -1 = -0.8) = -0.8 -> loss 0.8
    logp = torch.tensor([[0.0, math.log(0.5)]], dtype=D)
    inp = LossInputs(logp, torch.zeros(1, 2, dtype=D), -torch.ones(1, 2, dtype=D), torch.tensor([[0, 1]], dtype=D),
                     torch.zeros(1, 2, dtype=torch.long), 1, norm=1)
    loss, m = GSPOLoss(clip_low=0.2, clip_high=0.28)(inp)
    assert loss.item() == pytest.approx(0.8)
    assert m["clip_frac_low"] == 1.0
