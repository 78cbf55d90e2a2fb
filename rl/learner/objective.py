"""From config to the learner's objective, decided once at construction (never by strings in the
hot loop): the policy loss (``algo.name``) with its regularisers, the mismatch correction and
whether its weights enter the loss, which log-probs are the ratio's denominator, and the
advantage estimator's learner half (``rl/advantages.py``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from jointrl.rl.advantages import GAE, GroupRelative, build_estimator
from jointrl.rl.config import Algorithm, BehaviourLogprobs, Config, MismatchMode
from jointrl.rl.losses import GRPOLoss, GSPOLoss, MismatchCorrection, PPOLoss, Regularizers, SFTLoss

PolicyLoss = GRPOLoss | GSPOLoss | PPOLoss | SFTLoss


def build_loss(cfg: Config) -> PolicyLoss:
    a = cfg.algo
    reg = Regularizers(kl_coef=a.kl_coef, kl_estimator=a.kl_estimator, entropy_coef=a.entropy_coef)
    losses: dict[Algorithm, Callable[[], PolicyLoss]] = {
        Algorithm.grpo: lambda: GRPOLoss(a.clip_low, a.clip_high, a.aggregation, reg),
        Algorithm.gspo: lambda: GSPOLoss(a.clip_low, a.clip_high, reg),
        Algorithm.ppo: lambda: PPOLoss(a.clip_low, a.clip_high, a.value_clip, a.vf_coef, a.aggregation, reg),
        Algorithm.sft: lambda: SFTLoss(a.aggregation, reg),  # demonstrations (rl/sft.py): negative log-likelihood
    }
    return losses[a.name]()


def build_mismatch(cfg: Config) -> MismatchCorrection:
    a = cfg.algo
    return MismatchCorrection(a.mismatch, a.tis_cap, a.mismatch_low, a.mismatch_high)


def _learner_logprobs(learner_BT: Tensor, rollout_BT: Tensor) -> Tensor:
    return learner_BT


def _rollout_logprobs(learner_BT: Tensor, rollout_BT: Tensor) -> Tensor:
    return rollout_BT


BEHAVIOUR: dict[BehaviourLogprobs, Callable[[Tensor, Tensor], Tensor]] = {
    BehaviourLogprobs.learner: _learner_logprobs, BehaviourLogprobs.rollout: _rollout_logprobs}


@dataclass(frozen=True, slots=True)
class Objective:
    """What a micro-batch's loss is made of. ``behaviour(learner_logp_BT, rollout_logp_BT)`` gives the
    ratio's denominator (both detached); ``correction`` runs once per micro-batch for its metrics and,
    where ``reweights``, its weights multiply each token's loss."""

    loss: PolicyLoss
    correction: MismatchCorrection
    reweights: bool
    behaviour: Callable[[Tensor, Tensor], Tensor]
    estimator: GroupRelative | GAE

    @property
    def per_sequence(self) -> bool:
        """Whether the loss's normaliser counts sequences (else loss tokens)."""
        return self.loss.per_sequence


def build_objective(cfg: Config) -> Objective:
    return Objective(build_loss(cfg), build_mismatch(cfg), cfg.algo.mismatch is not MismatchMode.none,
                     BEHAVIOUR[cfg.algo.behaviour_logprobs], build_estimator(cfg.algo))
