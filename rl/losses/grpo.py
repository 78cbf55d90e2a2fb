"""GRPO policy loss with DAPO's decoupled clipping, token-mean aggregation.

Per sampled token t of sequence i, with ratio rho_t = exp(logp_t - logp_old_t)::

    l_t = -min(rho_t * A_i, clip(rho_t, 1 - eps_low, 1 + eps_high) * A_i)

    loss = sum_{i,t} mask_t * l_t / N                  N = number of sampled tokens in the
                                                       *global* batch (token-mean, DAPO)

GRPO: Shao et al. 2024 (DeepSeekMath); clip-higher and token-mean: Yu et al. 2025 (DAPO).
The normaliser N is passed in so the loss is the same however the batch is split into
micro-batches and ranks. No KL term (the skeleton's default; issue #8 adds KL and GSPO/PPO).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class GRPOLoss:
    clip_low: float = 0.2
    clip_high: float = 0.28

    def __post_init__(self) -> None:
        if not (0 <= self.clip_low < 1 and self.clip_high >= 0):
            raise ValueError(f"GRPO clip range needs 0 <= clip_low < 1 and clip_high >= 0, got "
                             f"({self.clip_low}, {self.clip_high})")

    def __call__(self, logp_BT: torch.Tensor, old_logp_BT: torch.Tensor, adv_B: torch.Tensor,
                 mask_BT: torch.Tensor, num_tokens: float) -> tuple[torch.Tensor, dict[str, float]]:
        """Shapes: ``logp_BT``, ``old_logp_BT``, ``mask_BT`` [B, T]; ``adv_B`` [B]. Returns (loss, metrics)."""
        mask_BT = mask_BT.to(logp_BT.dtype)
        ratio_BT = torch.exp(logp_BT - old_logp_BT)
        adv_BT = adv_B[:, None].to(logp_BT.dtype)
        unclipped = ratio_BT * adv_BT
        clipped = ratio_BT.clamp(1 - self.clip_low, 1 + self.clip_high) * adv_BT
        loss = -(torch.minimum(unclipped, clipped) * mask_BT).sum() / num_tokens
        with torch.no_grad():
            n = mask_BT.sum().clamp(min=1)
            clip_frac = (((unclipped != clipped) & (mask_BT > 0)).to(mask_BT.dtype).sum() / n).item()
            approx_kl = (0.5 * (logp_BT - old_logp_BT) ** 2 * mask_BT).sum().item() / n.item()
        return loss, {"clip_frac": clip_frac, "approx_kl": approx_kl, "tokens": float(mask_BT.sum().item())}
