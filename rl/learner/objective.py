"""From config to the learner's objective, decided once at construction (never by strings
in the hot loop): the policy loss (``algo.name``), its regularisers, the mismatch correction."""

from __future__ import annotations

from jointrl.rl.config import Config
from jointrl.rl.losses import (Aggregation, GRPOLoss, GSPOLoss, KLEstimator, MismatchCorrection, PPOLoss,
                               Regularizers, SFTLoss)


def build_loss(cfg: Config) -> GRPOLoss | GSPOLoss | PPOLoss | SFTLoss:
    a = cfg.algo
    reg = Regularizers(kl_coef=a.kl_coef, kl_estimator=KLEstimator(a.kl_estimator), entropy_coef=a.entropy_coef)
    if a.name == "gspo":
        return GSPOLoss(a.clip_low, a.clip_high, reg)
    if a.name == "sft":  # demonstrations (rl/sft.py): the same batches, negative log-likelihood
        return SFTLoss(Aggregation(a.aggregation), reg)
    if a.name == "ppo":
        return PPOLoss(a.clip_low, a.clip_high, a.value_clip, a.vf_coef, Aggregation(a.aggregation), reg)
    return GRPOLoss(a.clip_low, a.clip_high, Aggregation(a.aggregation), reg)


def build_mismatch(cfg: Config) -> MismatchCorrection:
    a = cfg.algo
    return MismatchCorrection(a.mismatch, a.tis_cap, a.mismatch_low, a.mismatch_high)
