"""The MoE FFN: fused SwiGLU experts, optional shared experts, and the dense SwiGLU MLP.

Parameter layout equals transformers 5.x: `gate.weight` [E, H] (+ `gate.e_score_correction_bias` [E]
for the sigmoid router, model/routing.py), `experts.gate_up_proj` [E, 2I, H] (gate rows first, then up
rows) and `experts.down_proj` [E, H, I], each expert matrix laid out as an `nn.Linear` weight
(out, in), so MXFP4 blocks run along `in`. Shared experts are one SwiGLU MLP of width
n_shared_experts·I named as DeepSeek-V3's `shared_experts.{gate,up,down}_proj.weight`, with Qwen2-MoE's
`shared_expert_gate.weight` [1, H] when gated. The dense MLP of the first layers has the same names.

Shapes: N tokens (B·T flattened), H hidden, I expert width, E experts, k experts per token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from jointrl.kernels import moe_cpu
from jointrl.model.config import MoEConfig
from jointrl.model.routing import TopKRouter, load_balancing_loss

__all__ = ["MLP", "Experts", "SparseMoeBlock", "TopKRouter", "load_balancing_loss"]


class MLP(nn.Module):
    """SwiGLU: y = down(silu(gate x) ⊙ up x). The dense FFN and the (fused) shared experts."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Experts(nn.Module):
    """E SwiGLU experts: y_e(x) = down_e(silu(gate_e x) ⊙ up_e x), stored fused as 3-D tensors."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        E, H, I = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.zeros(E, 2 * I, H))
        self.down_proj = nn.Parameter(torch.zeros(E, H, I))

    def forward(self, x_NH: torch.Tensor, ids_Nk: torch.Tensor, weights_Nk: torch.Tensor) -> torch.Tensor:
        """y_n = Σ_j weights[n, j] · y_{ids[n, j]}(x_n). Assignments are sorted by expert and each
        expert runs once on its contiguous slice (one host sync for the per-expert counts).
        Inference on CPU with a few tokens per expert (decode) runs ``kernels/moe_cpu`` instead:
        one C++ call that streams each active expert's weights once."""
        N, k = ids_Nk.shape
        E = self.gate_up_proj.shape[0]
        needs_grad = torch.is_grad_enabled() and any(
            t.requires_grad for t in (x_NH, weights_Nk, self.gate_up_proj, self.down_proj))
        if moe_cpu.use_kernel(x_NH, ids_Nk, E, needs_grad):
            return moe_cpu.moe_experts(x_NH, ids_Nk, weights_Nk, self.gate_up_proj, self.down_proj)
        ids_A = ids_Nk.reshape(-1)  # A = N·k assignments
        order_A = torch.argsort(ids_A, stable=True)
        token_A = order_A // k
        counts = torch.bincount(ids_A, minlength=E).tolist()
        x_AH = x_NH[token_A]
        # One unbind, not `proj[e]` per expert: each index's backward would zero-fill a whole
        # [E, ...] gradient (22 % of a profiled learner step); unbind's backward stacks once.
        # Likewise one split, not `x_AH[start:start + count]` per expert: each slice's backward
        # zero-fills an [A, H] gradient (18 % of a profiled learner step); split's backward cats once.
        gate_up_E, down_E = self.gate_up_proj.unbind(0), self.down_proj.unbind(0)
        outs = []
        for e, x_aH in enumerate(x_AH.split(counts)):
            if x_aH.shape[0] == 0:
                continue
            gate_aI, up_aI = F.linear(x_aH, gate_up_E[e]).chunk(2, dim=-1)
            outs.append(F.linear(F.silu(gate_aI) * up_aI, down_E[e]))
        y_AH = torch.cat(outs) * weights_Nk.reshape(-1)[order_A, None]
        return torch.zeros_like(x_NH).index_add_(0, token_A, y_AH)


class SparseMoeBlock(nn.Module):
    """y = Σ_j w_j · expert_{id_j}(x)  [+ g(x) · shared(x)], g = sigmoid(x·w_g) if gated else 1."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        # Registration order = HF's (experts, gate, shared_experts), so state_dict() orders keys alike.
        self.experts = Experts(config)
        self.gate = TopKRouter(config)
        self.shared_experts = (MLP(config.hidden_size, config.n_shared_experts * config.moe_intermediate_size)
                               if config.n_shared_experts else None)
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False) if config.shared_expert_gate else None

    def forward(self, x_BTH: torch.Tensor, replay_ids_Nk: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """→ (y_BTH, router logits_NE, probs_NE, ids_Nk), N = B·T."""
        x_NH = x_BTH.reshape(-1, x_BTH.shape[-1])
        logits_NE, probs_NE, ids_Nk, weights_Nk = self.gate(x_NH, replay_ids_Nk)
        y_NH = self.experts(x_NH, ids_Nk, weights_Nk)
        if self.shared_experts is not None:
            shared_NH = self.shared_experts(x_NH)
            if self.shared_expert_gate is not None:
                shared_NH = torch.sigmoid(self.shared_expert_gate(x_NH)) * shared_NH
            y_NH = y_NH + shared_NH
        return y_NH.view_as(x_BTH), logits_NE, probs_NE, ids_Nk
