"""The MoE FFN of Qwen3-MoE: softmax top-k router, fused SwiGLU experts, load-balancing loss.

Parameter layout equals transformers 5.x's `Qwen3MoeSparseMoeBlock`: `gate.weight` [E, H],
`experts.gate_up_proj` [E, 2I, H] (gate rows first, then up rows) and `experts.down_proj` [E, H, I],
each expert matrix laid out as an `nn.Linear` weight (out, in), so MXFP4 blocks run along `in`.

Shapes: N tokens (B·T flattened), H hidden, I expert width, E experts, k experts per token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from jointrl.model.config import MoEConfig
from jointrl.model.norm import compute_dtype


class TopKRouter(nn.Module):
    """p = softmax(x Wᵀ) over all E experts; top-k of p (or replayed ids); weights renormalised to sum 1
    when `norm_topk_prob`. The softmax runs in float32 (float64 for a float64 model), as HF's."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.weight = nn.Parameter(torch.zeros(config.num_experts, config.hidden_size))

    def forward(self, x_NH: torch.Tensor, replay_ids_Nk: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """→ (logits_NE in x's dtype, probs_NE in compute dtype, ids_Nk, weights_Nk in x's dtype).

        With `replay_ids_Nk` those experts are used instead of the top-k; their weights are still the
        router's probabilities at those ids, so the router keeps its gradient (routing replay, R3).
        """
        logits_NE = F.linear(x_NH, self.weight)
        probs_NE = torch.softmax(logits_NE, dim=-1, dtype=compute_dtype(x_NH.dtype))
        if replay_ids_Nk is None:
            top_Nk, ids_Nk = torch.topk(probs_NE, self.top_k, dim=-1)
        else:
            ids_Nk = replay_ids_Nk
            top_Nk = probs_NE.gather(1, ids_Nk)
        if self.norm_topk_prob:
            top_Nk = top_Nk / top_Nk.sum(dim=-1, keepdim=True)
        return logits_NE, probs_NE, ids_Nk, top_Nk.to(x_NH.dtype)


class Experts(nn.Module):
    """E SwiGLU experts: y_e(x) = down_e(silu(gate_e x) ⊙ up_e x), stored fused as 3-D tensors."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        E, H, I = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.zeros(E, 2 * I, H))
        self.down_proj = nn.Parameter(torch.zeros(E, H, I))

    def forward(self, x_NH: torch.Tensor, ids_Nk: torch.Tensor, weights_Nk: torch.Tensor) -> torch.Tensor:
        """y_n = Σ_j weights[n, j] · y_{ids[n, j]}(x_n). Assignments are sorted by expert and each
        expert runs once on its contiguous slice (one host sync for the per-expert counts)."""
        N, k = ids_Nk.shape
        E = self.gate_up_proj.shape[0]
        ids_A = ids_Nk.reshape(-1)  # A = N·k assignments
        order_A = torch.argsort(ids_A, stable=True)
        token_A = order_A // k
        counts = torch.bincount(ids_A, minlength=E).tolist()
        x_AH = x_NH[token_A]
        outs, start = [], 0
        for e, count in enumerate(counts):
            if count == 0:
                continue
            gate_aI, up_aI = F.linear(x_AH[start:start + count], self.gate_up_proj[e]).chunk(2, dim=-1)
            outs.append(F.linear(F.silu(gate_aI) * up_aI, self.down_proj[e]))
            start += count
        y_AH = torch.cat(outs) * weights_Nk.reshape(-1)[order_A, None]
        return torch.zeros_like(x_NH).index_add_(0, token_A, y_AH)


class SparseMoeBlock(nn.Module):
    """Router + experts; every token goes to k experts, no shared expert."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.experts = Experts(config)
        self.gate = TopKRouter(config)

    def forward(self, x_BTH: torch.Tensor, replay_ids_Nk: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """→ (y_BTH, router logits_NE, probs_NE, ids_Nk), N = B·T."""
        x_NH = x_BTH.reshape(-1, x_BTH.shape[-1])
        logits_NE, probs_NE, ids_Nk, weights_Nk = self.gate(x_NH, replay_ids_Nk)
        y_NH = self.experts(x_NH, ids_Nk, weights_Nk)
        return y_NH.view_as(x_BTH), logits_NE, probs_NE, ids_Nk


def load_balancing_loss(probs_per_layer: list[torch.Tensor], ids_per_layer: list[torch.Tensor],
                        num_experts: int, token_mask_N: torch.Tensor | None = None) -> torch.Tensor:
    """Switch-Transformer balance loss, pooled over layers exactly as HF's `load_balancing_loss_func`:

        f_e = (# assignments to e over all layers and real tokens) / (L · N_real)
        P_e = (Σ over layers and real tokens of p_e) / (L · N_real)
        loss = E · Σ_e f_e · P_e          (= k when routing is perfectly uniform)

    `ids_per_layer` are the experts actually used (the replayed ids under routing replay; HF's own
    top-k otherwise, which is the same thing). Padding tokens (mask 0) are left out.
    """
    probs_LNE = torch.stack(probs_per_layer)
    ids_LNk = torch.stack(ids_per_layer)
    L, N, k = ids_LNk.shape
    if token_mask_N is None:
        token_mask_N = torch.ones(N, dtype=probs_LNE.dtype, device=probs_LNE.device)
    mask_LN = token_mask_N.to(probs_LNE.dtype).expand(L, N)
    counts_E = torch.zeros(num_experts, dtype=probs_LNE.dtype, device=probs_LNE.device).scatter_add_(
        0, ids_LNk.reshape(-1), mask_LN[..., None].expand(L, N, k).reshape(-1))
    prob_sum_E = (probs_LNE * mask_LN[..., None]).sum(dim=(0, 1))
    rows = mask_LN.sum().clamp_min(1)
    return num_experts * torch.sum((counts_E / rows) * (prob_sum_E / rows))
