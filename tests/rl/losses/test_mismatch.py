"""Train/rollout mismatch corrections (TIS, IcePop, MIS) against values computed by hand."""

import math

import pytest
import torch

from jointrl.rl.losses import GRPOLoss, LossInputs, MismatchCorrection

D = torch.float64
# seq 0: three trained tokens with learner/rollout ratios 3, 3, 1.2; seq 1: one with ratio 0.9
RATIOS = [3.0, 3.0, 1.2, 0.9]
LEARNER = torch.tensor([[0.0, math.log(3.0), math.log(3.0), math.log(1.2), 0.0, math.log(0.9)]], dtype=D)
ROLLOUT = torch.zeros(1, 6, dtype=D)
MASK = torch.tensor([[0, 1, 1, 1, 0, 1]], dtype=D)
SEQ = torch.tensor([[0, 0, 0, 0, 1, 1]])


@pytest.mark.parametrize("mode, weights, corrected", [
    ("none", [1, 1, 1, 1], 0),
    ("tis", [2.0, 2.0, 1.2, 0.9], 2 / 4),   # min(r, C = 2)
    ("icepop", [0, 0, 1, 1], 2 / 4),         # r outside [0.5, 2] masked
    ("mis", [0, 0, 0, 1], 3 / 4),            # seq 0: geometric mean (3*3*1.2)^(1/3) = 2.21 > 2 -> all masked
])
def test_corrections_by_hand(mode, weights, corrected):
    w, m = MismatchCorrection(mode, tis_cap=2.0, low=0.5, high=2.0)(LEARNER, ROLLOUT, MASK, SEQ, 2)
    assert w[MASK > 0].tolist() == pytest.approx(weights)
    assert m["mismatch/corrected_frac"] == pytest.approx(corrected)
    assert m["mismatch/kl_k1"] == pytest.approx(-sum(math.log(r) for r in RATIOS) / 4)
    assert m["mismatch/kl_k3"] == pytest.approx(sum(r - 1 - math.log(r) for r in RATIOS) / 4)
    assert m["mismatch/ratio_max"] == pytest.approx(3.0)


def test_weights_scale_token_losses_not_the_normaliser():
    # ratio 1 (logp = old), A = 1 everywhere: l_t = -1; TIS weights (2, 2, 1.2, .9) over N = 4 tokens
    w, _ = MismatchCorrection("tis", tis_cap=2.0)(LEARNER, ROLLOUT, MASK, SEQ, 2)
    inp = LossInputs(torch.zeros(1, 6, dtype=D), torch.zeros(1, 6, dtype=D), torch.ones(1, 6, dtype=D), MASK, SEQ, 2,
                     norm=4, weight_BT=w)
    loss, _ = GRPOLoss()(inp)
    assert loss.item() == pytest.approx(-(2 + 2 + 1.2 + 0.9) / 4)


def test_bad_mask_range_is_a_value_error():
    with pytest.raises(ValueError, match="low"):
        MismatchCorrection("icepop", low=1.5, high=2.0)
    with pytest.raises(ValueError):
        MismatchCorrection("bogus")
