"""GRPO policy loss with DAPO's decoupled clipping and a choice of aggregation.

Per loss token t of sequence i, with ratio rho_t = exp(logp_t - logp_old_t)::

    l_t = -min(rho_t * A_i, clip(rho_t, 1 - eps_low, 1 + eps_high) * A_i)
          + kl_coef * KL_t(π_θ || π_ref) - entropy_coef * H_t          (Regularizers, optional)

    loss = Aggregation(l)        token_mean (default): Σ m w l / N_tok; seq_mean; seq_sum

GRPO: Shao et al. 2024 (DeepSeekMath); clip-higher, token-mean and dropping zero-variance
groups: Yu et al. 2025 (DAPO). ``w`` is the train/rollout mismatch weight (``mismatch.py``).
The same clipped surrogate with per-token GAE advantages is PPO's policy term (``ppo.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from jointrl.rl.losses.common import Aggregation, LossInputs, Regularizers, aggregate, ratio_metrics


def clipped_surrogate(inp: LossInputs, clip_low: float, clip_high: float) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token -min(rho A, clip(rho) A) [B, T] and its clip statistics over loss tokens."""
    log_ratio_BT = inp.logp_BT - inp.old_logp_BT
    ratio_BT = torch.exp(log_ratio_BT)
    adv_BT = inp.adv_BT.to(ratio_BT.dtype)
    unclipped_BT = ratio_BT * adv_BT
    clipped_BT = ratio_BT.clamp(1 - clip_low, 1 + clip_high) * adv_BT
    loss_BT = -torch.minimum(unclipped_BT, clipped_BT)
    with torch.no_grad():
        m_BT = inp.mask_BT > 0
        n = max(float(m_BT.sum().item()), 1.0)
        active = (unclipped_BT != clipped_BT) & (clipped_BT < unclipped_BT) & m_BT  # the clip binds
        metrics = {
            "clip_frac": float(active.sum().item()) / n,
            "clip_frac_low": float((active & (ratio_BT < 1)).sum().item()) / n,
            "clip_frac_high": float((active & (ratio_BT > 1)).sum().item()) / n,
            **ratio_metrics(log_ratio_BT, inp),
        }
    return loss_BT, metrics


@dataclass(frozen=True, slots=True)
class GRPOLoss:
    clip_low: float = 0.2
    clip_high: float = 0.28
    aggregation: Aggregation = Aggregation.token_mean
    regularizers: Regularizers = field(default_factory=Regularizers)

    def __post_init__(self) -> None:
        if not (0 <= self.clip_low < 1 and self.clip_high >= 0):
            raise ValueError(f"GRPO clip range needs 0 <= clip_low < 1 and clip_high >= 0, got "
                             f"({self.clip_low}, {self.clip_high})")
        object.__setattr__(self, "aggregation", Aggregation(self.aggregation))

    @property
    def per_sequence(self) -> bool:
        """Whether ``LossInputs.norm`` counts sequences (else loss tokens)."""
        return self.aggregation.per_sequence

    def __call__(self, inp: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
        loss_BT, metrics = clipped_surrogate(inp, self.clip_low, self.clip_high)
        loss_BT = self.regularizers(loss_BT, inp, metrics)
        metrics["tokens"] = inp.tokens
        return aggregate(loss_BT, inp, self.aggregation), metrics
