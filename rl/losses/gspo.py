"""GSPO: sequence-level, length-normalised importance ratio and clipping (Zheng et al. 2025,
"Group Sequence Policy Optimization").

For sequence i with loss tokens y_i (|y_i| of them) and group advantage A_i::

    s_i = exp( (1/|y_i|) Σ_t (logp_t - logp_old_t) )          (geometric mean of token ratios)
    l_i = -min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i)
    loss = Σ_i w_i l_i / N_seq  (+ the Regularizers' per-token terms, sequence-mean aggregated)

The paper's ranges are small (eps_low 3e-4, eps_high 4e-4; ``conf/algo/gspo.yaml``).
``w_i`` is the mean of sequence i's mismatch-correction weights (exact for MIS, whose weights
are per sequence). N_seq: sequences with a loss token in the global batch (``LossInputs.norm``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from jointrl.rl.losses.common import Aggregation, LossInputs, Regularizers, aggregate, masked_max, masked_mean, masked_min


@dataclass(frozen=True, slots=True)
class GSPOLoss:
    clip_low: float = 3e-4
    clip_high: float = 4e-4
    regularizers: Regularizers = field(default_factory=Regularizers)
    per_sequence: bool = True  # the normaliser counts sequences

    def __post_init__(self) -> None:
        if not (0 <= self.clip_low < 1 and self.clip_high >= 0):
            raise ValueError(f"GSPO clip range needs 0 <= clip_low < 1 and clip_high >= 0, got "
                             f"({self.clip_low}, {self.clip_high})")

    def __call__(self, inp: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
        m_BT = inp.mask_BT.to(inp.logp_BT.dtype)
        len_S = inp.seq_lengths()
        log_s_S = inp.per_seq_sum((inp.logp_BT - inp.old_logp_BT) * m_BT) / len_S
        s_S = torch.exp(log_s_S)
        adv_S = inp.per_seq_sum(inp.adv_BT.to(m_BT.dtype) * m_BT) / len_S
        has_tokens_S = (inp.per_seq_sum(m_BT) > 0).to(m_BT.dtype)
        w_S = has_tokens_S if inp.weight_BT is None else inp.per_seq_sum(inp.weight_BT * m_BT) / len_S
        unclipped_S = s_S * adv_S
        clipped_S = s_S.clamp(1 - self.clip_low, 1 + self.clip_high) * adv_S
        seq_loss = -(torch.minimum(unclipped_S, clipped_S) * w_S).sum() / inp.norm
        with torch.no_grad():
            n = max(float(has_tokens_S.sum().item()), 1.0)
            active_S = (clipped_S < unclipped_S) & (has_tokens_S > 0)
            metrics = {
                "clip_frac": float(active_S.sum().item()) / n,  # fraction of sequences
                "clip_frac_low": float((active_S & (s_S < 1)).sum().item()) / n,
                "clip_frac_high": float((active_S & (s_S > 1)).sum().item()) / n,
                "approx_kl": masked_mean((inp.logp_BT - inp.old_logp_BT).detach().exp() - 1
                                         - (inp.logp_BT - inp.old_logp_BT).detach(), m_BT),
                "ratio_mean": masked_mean(s_S.detach(), has_tokens_S),  # sequence ratios s_i
                "ratio_max": masked_max(s_S.detach(), has_tokens_S),
                "ratio_min": masked_min(s_S.detach(), has_tokens_S),
                "adv_mean": masked_mean(adv_S.detach(), has_tokens_S),
                "adv_abs_mean": masked_mean(adv_S.detach().abs(), has_tokens_S),
                "adv_max": masked_max(adv_S.detach(), has_tokens_S),
                "adv_min": masked_min(adv_S.detach(), has_tokens_S),
            }
        reg_BT = self.regularizers(torch.zeros_like(inp.logp_BT), inp, metrics)
        loss = seq_loss + aggregate(reg_BT, inp, Aggregation.seq_mean) if reg_BT.requires_grad else seq_loss
        metrics["tokens"] = inp.tokens
        return loss, metrics
