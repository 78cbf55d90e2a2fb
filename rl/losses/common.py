"""What every policy loss shares: its inputs, the aggregation rules, KL and entropy terms.

Tensors are token-shaped, any layout (``[B, T]`` right-padded or packed rows); ``seq`` says
which sequence each token belongs to, so sequence-level rules work on packed rows too.
Normalisers are passed in (``LossInputs.norm``) so a micro-batch's loss is its share of the
*global* batch's loss however the batch is split over micro-batches and ranks.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
from torch import Tensor


class Aggregation(enum.StrEnum):
    """How per-token losses l_t of sequences i become one number (``m`` = loss mask, w = weight).

    token_mean: Σ_i Σ_t m w l_t / N_tok            (DAPO, Yu et al. 2025)
    seq_mean:   Σ_i (Σ_t m w l_t / |y_i|) / N_seq   (GRPO as written, Shao et al. 2024)
    seq_sum:    Σ_i  Σ_t m w l_t / N_seq            (Dr. GRPO's sum over tokens, Liu et al. 2025, with
                                                     the batch's sequence count as the constant)
    N_tok / N_seq: loss tokens / sequences with a loss token in the global batch; |y_i| the
    loss tokens of sequence i. Correction weights w never change the normalisers.
    """

    token_mean = "token_mean"
    seq_mean = "seq_mean"
    seq_sum = "seq_sum"

    @property
    def per_sequence(self) -> bool:
        return self is not Aggregation.token_mean


class KLEstimator(enum.StrEnum):
    """Per-token estimators of KL(π_θ || π_ref) from samples of π_θ (Schulman 2020, "Approximating KL").

    k1: log π_θ − log π_ref                    (unbiased, can be negative)
    k3: r − log r − 1, r = π_ref / π_θ         (unbiased, >= 0; GRPO's choice)
    """

    k1 = "k1"
    k3 = "k3"


@dataclass(slots=True)
class LossInputs:
    """One micro-batch, all token tensors the same shape (written ``_BT``; packed rows work too).

    logp: learner log-probs (with grad). old_logp: behaviour log-probs, the ratio's denominator.
    adv: per-token advantage (GRPO/GSPO: the sequence's advantage on each of its tokens).
    mask: 1.0 on tokens that train. seq: int64 sequence index in ``[0, num_seqs)`` (any valid
    index where mask is 0). norm: this micro-batch's normaliser, N_tok or N_seq of the global
    batch divided by the data-parallel world size (gradients are averaged over ranks).
    weight: train/rollout mismatch correction per token (detached), None = 1.
    ref_logp: reference-policy log-probs (KL term), entropy: per-token policy entropy.
    values / old_values / returns: PPO critic outputs, their pre-update values, GAE returns.
    """

    logp_BT: Tensor
    old_logp_BT: Tensor
    adv_BT: Tensor
    mask_BT: Tensor
    seq_BT: Tensor
    num_seqs: int
    norm: float
    weight_BT: Tensor | None = None
    ref_logp_BT: Tensor | None = None
    entropy_BT: Tensor | None = None
    values_BT: Tensor | None = None
    old_values_BT: Tensor | None = None
    returns_BT: Tensor | None = None

    def __post_init__(self) -> None:
        for name in ("old_logp_BT", "adv_BT", "mask_BT", "seq_BT", "weight_BT", "ref_logp_BT", "entropy_BT",
                     "values_BT", "old_values_BT", "returns_BT"):
            t = getattr(self, name)
            if t is not None and t.shape != self.logp_BT.shape:
                raise ValueError(f"LossInputs.{name} has shape {tuple(t.shape)}, logp_BT has {tuple(self.logp_BT.shape)}")
        if self.norm <= 0:
            raise ValueError(f"LossInputs.norm must be > 0, got {self.norm}")

    @property
    def tokens(self) -> float:
        return float(self.mask_BT.sum().item())

    def per_seq_sum(self, x_BT: Tensor) -> Tensor:
        """Σ_t x over each sequence's tokens -> [num_seqs] (x already masked by the caller)."""
        out_S = torch.zeros(self.num_seqs, dtype=x_BT.dtype, device=x_BT.device)
        return out_S.index_add_(0, self.seq_BT.reshape(-1), x_BT.reshape(-1))

    def seq_lengths(self) -> Tensor:
        """|y_i|: loss tokens per sequence, [num_seqs], at least 1 (avoids 0/0 on empty ones)."""
        return self.per_seq_sum(self.mask_BT.to(self.logp_BT.dtype)).clamp_min(1)


def aggregate(loss_BT: Tensor, inp: LossInputs, agg: Aggregation) -> Tensor:
    """``Aggregation`` of per-token losses (docstring there); masked and weighted here."""
    w_BT = inp.mask_BT.to(loss_BT.dtype)
    if inp.weight_BT is not None:
        w_BT = w_BT * inp.weight_BT
    lw_BT = loss_BT * w_BT
    if agg is Aggregation.token_mean:
        return lw_BT.sum() / inp.norm
    per_seq_S = inp.per_seq_sum(lw_BT)
    if agg is Aggregation.seq_mean:
        per_seq_S = per_seq_S / inp.seq_lengths()
    return per_seq_S.sum() / inp.norm


def kl_per_token(logp_BT: Tensor, ref_logp_BT: Tensor, estimator: KLEstimator) -> Tensor:
    """``KLEstimator`` of KL(π_θ || π_ref) at each token (with gradient through ``logp_BT``)."""
    if estimator is KLEstimator.k1:
        return logp_BT - ref_logp_BT
    log_r_BT = ref_logp_BT - logp_BT
    return torch.exp(log_r_BT) - log_r_BT - 1


def masked_mean(x_BT: Tensor, mask_BT: Tensor) -> float:
    return float((x_BT * mask_BT).sum().item() / max(mask_BT.sum().item(), 1.0))


def masked_max(x_BT: Tensor, mask_BT: Tensor) -> float:
    sel = x_BT[mask_BT > 0]
    return float(sel.max().item()) if sel.numel() else float("-inf")


def masked_min(x_BT: Tensor, mask_BT: Tensor) -> float:
    sel = x_BT[mask_BT > 0]
    return float(sel.min().item()) if sel.numel() else float("inf")


@dataclass(frozen=True, slots=True)
class Regularizers:
    """Optional per-token terms added to a policy loss before aggregation::

        l_t += kl_coef * KL_t(π_θ || π_ref) - entropy_coef * H_t(π_θ)

    ``kl_coef = 0`` means no reference policy exists at all (the learner builds none).
    """

    kl_coef: float = 0.0
    kl_estimator: KLEstimator = KLEstimator.k3
    entropy_coef: float = 0.0

    def __post_init__(self) -> None:
        if self.kl_coef < 0 or self.entropy_coef < 0:
            raise ValueError(f"kl_coef and entropy_coef must be >= 0, got {self.kl_coef}, {self.entropy_coef}")

    def __call__(self, loss_BT: Tensor, inp: LossInputs, metrics: dict[str, float]) -> Tensor:
        if self.kl_coef:
            if inp.ref_logp_BT is None:
                raise ValueError("kl_coef > 0 needs LossInputs.ref_logp_BT (reference-policy log-probs)")
            kl_BT = kl_per_token(inp.logp_BT, inp.ref_logp_BT, self.kl_estimator)
            loss_BT = loss_BT + self.kl_coef * kl_BT
            metrics["kl_ref"] = masked_mean(kl_BT.detach(), inp.mask_BT)
        if inp.entropy_BT is not None:
            if self.entropy_coef:
                loss_BT = loss_BT - self.entropy_coef * inp.entropy_BT
            metrics["entropy"] = masked_mean(inp.entropy_BT.detach(), inp.mask_BT)
        return loss_BT


def ratio_metrics(log_ratio_BT: Tensor, inp: LossInputs) -> dict[str, float]:
    """Ratio and advantage statistics over the loss tokens; approx_kl = k3 of KL(π_old || π_θ)."""
    lr_BT = log_ratio_BT.detach()
    ratio_BT = lr_BT.exp()
    m_BT = inp.mask_BT.to(lr_BT.dtype)
    adv_BT = inp.adv_BT.to(lr_BT.dtype)
    return {
        "approx_kl": masked_mean(ratio_BT - 1 - lr_BT, m_BT),
        "ratio_mean": masked_mean(ratio_BT, m_BT),
        "ratio_max": masked_max(ratio_BT, m_BT),
        "ratio_min": masked_min(ratio_BT, m_BT),
        "adv_mean": masked_mean(adv_BT, m_BT),
        "adv_abs_mean": masked_mean(adv_BT.abs(), m_BT),
        "adv_max": masked_max(adv_BT, m_BT),
        "adv_min": masked_min(adv_BT, m_BT),
    }
