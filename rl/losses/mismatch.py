"""Train/rollout mismatch: the rollout engine (MXFP4 experts, other kernels) samples from
π_rollout, the learner computes π_θ. Per token, r_t = exp(logp_learner_t − logp_rollout_t)
(the learner's log-prob before the update, detached). Corrections, chosen once by ``mode``:

    none:   w_t = 1
    tis:    w_t = min(r_t, C)                           truncated importance sampling
            (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training")
    icepop: w_t = 1[low <= r_t <= high]                 token masking (Ling Team 2025, Ring-1T "IcePop")
    mis:    w_t = 1[low <= g_i <= high] for every t of sequence i,
            g_i = exp(mean_t log r_t)                   sequence-level geometric-mean masking
            (Liu et al. 2025, "When Speed Kills Stability", MIS)

The weights multiply each token's loss (they never change the normaliser). Always logged:
the mismatch KL(π_rollout || π_θ) by k1 = mean(logp_rollout − logp_learner) and by k3 =
mean(r − 1 − log r) over loss tokens, the fraction of tokens masked (or truncated), and max r.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
from torch import Tensor

from jointrl.rl.losses.common import masked_max, masked_mean


class MismatchMode(enum.StrEnum):
    none = "none"
    tis = "tis"
    icepop = "icepop"
    mis = "mis"


@dataclass(frozen=True, slots=True)
class MismatchCorrection:
    mode: MismatchMode = MismatchMode.none
    tis_cap: float = 2.0
    low: float = 0.5
    high: float = 2.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", MismatchMode(self.mode))
        if self.tis_cap <= 0:
            raise ValueError(f"mismatch tis_cap must be > 0, got {self.tis_cap}")
        if not 0 <= self.low <= 1 <= self.high:
            raise ValueError(f"mismatch mask range needs 0 <= low <= 1 <= high, got ({self.low}, {self.high})")

    def __call__(self, learner_logp_BT: Tensor, rollout_logp_BT: Tensor, mask_BT: Tensor, seq_BT: Tensor,
                 num_seqs: int) -> tuple[Tensor, dict[str, float]]:
        """-> (weight_BT detached, metrics). Shapes all equal; ``seq_BT`` int64 in [0, num_seqs)."""
        with torch.no_grad():
            m_BT = mask_BT.to(learner_logp_BT.dtype)
            log_r_BT = (learner_logp_BT - rollout_logp_BT) * m_BT
            r_BT = log_r_BT.exp()
            if self.mode is MismatchMode.tis:
                w_BT = r_BT.clamp(max=self.tis_cap)
                touched_BT = r_BT > self.tis_cap
            elif self.mode is MismatchMode.icepop:
                keep_BT = (r_BT >= self.low) & (r_BT <= self.high)
                w_BT, touched_BT = keep_BT.to(m_BT.dtype), ~keep_BT
            elif self.mode is MismatchMode.mis:
                flat = seq_BT.reshape(-1)
                sum_S = torch.zeros(num_seqs, dtype=m_BT.dtype, device=m_BT.device).index_add_(0, flat, log_r_BT.reshape(-1))
                len_S = torch.zeros(num_seqs, dtype=m_BT.dtype, device=m_BT.device).index_add_(0, flat, m_BT.reshape(-1))
                g_S = (sum_S / len_S.clamp_min(1)).exp()
                keep_BT = ((g_S >= self.low) & (g_S <= self.high))[seq_BT]
                w_BT, touched_BT = keep_BT.to(m_BT.dtype), ~keep_BT
            else:
                w_BT, touched_BT = torch.ones_like(m_BT), torch.zeros_like(m_BT, dtype=torch.bool)
            metrics = {
                "mismatch/kl_k1": masked_mean(-log_r_BT, m_BT),
                "mismatch/kl_k3": masked_mean(r_BT - 1 - log_r_BT, m_BT),
                "mismatch/corrected_frac": masked_mean(touched_BT.to(m_BT.dtype), m_BT),
                "mismatch/ratio_max": masked_max(r_BT, m_BT),
            }
        return w_BT, metrics
