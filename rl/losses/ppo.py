"""PPO with a learned critic: clipped policy surrogate on per-token GAE advantages plus a
clipped value loss (Schulman et al. 2017, "Proximal Policy Optimization"; GAE: Schulman et
al. 2016; value clipping as in OpenAI baselines / Ouyang et al. 2022).

Per loss token t, with advantages A_t and returns R_t from ``advantages.token_gae``::

    policy_t = -min(rho_t A_t, clip(rho_t, 1 - eps_low, 1 + eps_high) A_t)   (+ Regularizers)
    Vc_t     = V_old_t + clip(V_t - V_old_t, -eps_v, eps_v)
    value_t  = 0.5 * max((V_t - R_t)^2, (Vc_t - R_t)^2)
    loss     = Aggregation(policy) + vf_coef * Aggregation(value)

``V_t`` is the critic's value of the state before token t (the same shift as log-probs).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from jointrl.rl.losses.common import Aggregation, LossInputs, Regularizers, aggregate, masked_mean
from jointrl.rl.losses.grpo import clipped_surrogate


@dataclass(frozen=True, slots=True)
class PPOLoss:
    clip_low: float = 0.2
    clip_high: float = 0.2
    value_clip: float = 0.2
    vf_coef: float = 0.5
    aggregation: Aggregation = Aggregation.token_mean
    regularizers: Regularizers = field(default_factory=Regularizers)

    def __post_init__(self) -> None:
        if not (0 <= self.clip_low < 1 and self.clip_high >= 0):
            raise ValueError(f"PPO clip range needs 0 <= clip_low < 1 and clip_high >= 0, got "
                             f"({self.clip_low}, {self.clip_high})")
        if self.value_clip < 0 or self.vf_coef < 0:
            raise ValueError(f"PPO value_clip and vf_coef must be >= 0, got {self.value_clip}, {self.vf_coef}")
        object.__setattr__(self, "aggregation", Aggregation(self.aggregation))

    @property
    def per_sequence(self) -> bool:
        return self.aggregation.per_sequence

    def __call__(self, inp: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
        if inp.values_BT is None or inp.old_values_BT is None or inp.returns_BT is None:
            raise ValueError("PPOLoss needs LossInputs.values_BT, old_values_BT and returns_BT (the critic)")
        policy_BT, metrics = clipped_surrogate(inp, self.clip_low, self.clip_high)
        policy_BT = self.regularizers(policy_BT, inp, metrics)
        v_BT, old_BT, ret_BT = inp.values_BT, inp.old_values_BT, inp.returns_BT
        v_clipped_BT = old_BT + (v_BT - old_BT).clamp(-self.value_clip, self.value_clip)
        unclipped_BT = (v_BT - ret_BT) ** 2
        clipped_BT = (v_clipped_BT - ret_BT) ** 2
        value_BT = 0.5 * torch.maximum(unclipped_BT, clipped_BT)
        m_BT = inp.mask_BT.to(v_BT.dtype)
        with torch.no_grad():
            metrics["vf_loss"] = masked_mean(value_BT, m_BT)
            metrics["vf_clip_frac"] = masked_mean((clipped_BT > unclipped_BT).to(m_BT.dtype), m_BT)
            metrics["value_mean"] = masked_mean(v_BT, m_BT)
            metrics["return_mean"] = masked_mean(ret_BT, m_BT)
        metrics["tokens"] = inp.tokens
        loss = aggregate(policy_BT, inp, self.aggregation) + self.vf_coef * aggregate(value_BT, inp, self.aggregation)
        return loss, metrics
