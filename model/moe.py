"""The MoE FFN: fused SwiGLU experts, optional shared experts, and the dense SwiGLU MLP.

Parameter layout equals transformers 5.x: `gate.weight` [E, H] (+ `gate.e_score_correction_bias` [E]
for the sigmoid router, model/routing.py), `experts.gate_up_proj` [E, 2I, H] (gate rows first, then up
rows) and `experts.down_proj` [E, H, I], each expert matrix laid out as an `nn.Linear` weight
(out, in), so MXFP4 blocks run along `in`. Shared experts are one SwiGLU MLP of width
n_shared_experts·I named as DeepSeek-V3's `shared_experts.{gate,up,down}_proj.weight`, with Qwen2-MoE's
`shared_expert_gate.weight` [1, H] when gated. The dense MLP of the first layers has the same names.

The routed experts are a kernel op (``kernels/moe_experts``: ``moe_experts``, and ``moe_experts_mxfp4`` over
MXFP4-resident experts), called through the op table the model hands down (``self.kernels``, ``kernels/ops``).

Shapes: N tokens (B·T flattened), H hidden, I expert width, E experts, k experts per token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from jointrl.kernels.ops import Kernels, kernels_for
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


MXFP4_BUFFERS = ("mxfp4_gate_up_blocks", "mxfp4_gate_up_scales", "mxfp4_down_blocks", "mxfp4_down_scales")


class Experts(nn.Module):
    """E SwiGLU experts: y_e(x) = down_e(silu(gate_e x) ⊙ up_e x), stored fused as 3-D tensors."""

    plain_swiglu = True  # what the engine's C++ MoE ops compute (model/paged.moe_forward's fast path)

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        E, H, I = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.zeros(E, 2 * I, H))
        self.down_proj = nn.Parameter(torch.zeros(E, H, I))
        self.kernels: Kernels = kernels_for("torch")  # MoETransformer.set_kernels hands down the model's
        # MXFP4-resident experts (load_mxfp4), else None: non-persistent buffers, so they follow the module's
        # .to(device) (uint8: no dtype cast) and stay out of state_dict (HF's names, the push's targets)
        for name in MXFP4_BUFFERS:
            self.register_buffer(name, None, persistent=False)

    def forward(self, x_NH: torch.Tensor, ids_Nk: torch.Tensor, weights_Nk: torch.Tensor) -> torch.Tensor:
        """y_n = Σ_j weights[n, j] · y_{ids[n, j]}(x_n), through the kernel table: ``moe_experts_mxfp4`` over
        the MXFP4-resident experts when the layer holds them (``load_mxfp4``), else ``moe_experts`` over the
        dense parameters (``kernels/moe_experts``: the torch reference, the C++ loop on ``cpu``, the grouped
        Triton matmuls on ``triton`` for inference)."""
        if self.mxfp4_gate_up_blocks is not None:
            return self.kernels.moe_experts_mxfp4(x_NH, ids_Nk, weights_Nk, self.mxfp4_gate_up_blocks,
                                                  self.mxfp4_gate_up_scales, self.mxfp4_down_blocks,
                                                  self.mxfp4_down_scales)
        return self.kernels.moe_experts(x_NH, ids_Nk, weights_Nk, self.gate_up_proj, self.down_proj)

    @torch.no_grad()
    def load_mxfp4(self, gate_up_blocks: torch.Tensor, gate_up_scales: torch.Tensor, down_blocks: torch.Tensor,
                   down_scales: torch.Tensor) -> None:
        """Hold the routed experts MXFP4-resident (``kernels/mxfp4.quantize_mxfp4`` of ``gate_up_proj`` and
        ``down_proj``: uint8 blocks [E, 2I, H/2], [E, H, I/2] and scales [E, 2I, H/32], [E, H, I/32], what a
        weight push delivers), held as non-persistent buffers on the weights' device (moved with the module,
        not in ``state_dict``); forwards then run ``moe_experts_mxfp4`` on them (the MXFP4 MoE kernel on
        ``triton``, dequantize-then-torch elsewhere) and the dense parameters are not read: neither by
        ``forward`` nor by the engine, whose C++ ``cpu`` paths over packed dense experts step aside for such a
        layer (``model.paged.moe_forward``, ``ModelRunner._decode_plan``). The buffers are copies of their own
        (a push bucket's payload is not kept alive). A later
        ``load_mxfp4`` replaces them, ``drop_mxfp4`` returns to the dense parameters. Raises ``ValueError``
        naming a tensor whose dtype or shape does not match this layer's experts."""
        E, two_i, H = self.gate_up_proj.shape
        I = self.down_proj.shape[2]
        want = {"gate_up_blocks": (E, two_i, H // 2), "gate_up_scales": (E, two_i, H // 32),
                "down_blocks": (E, H, I // 2), "down_scales": (E, H, I // 32)}
        got = dict(gate_up_blocks=gate_up_blocks, gate_up_scales=gate_up_scales, down_blocks=down_blocks,
                   down_scales=down_scales)
        for name, t in got.items():
            if t.dtype != torch.uint8 or tuple(t.shape) != want[name]:
                raise ValueError(f"{name} must be uint8 {list(want[name])}, got {t.dtype} {list(t.shape)}")
        dev = self.gate_up_proj.device
        for name, t in zip(MXFP4_BUFFERS, got.values()):
            # a copy of its own: ``t.to(dev)`` on the same device returns t itself, often a view into a push
            # bucket's payload, which it would keep alive whole
            setattr(self, name, t.to(dev, copy=True).contiguous())

    def drop_mxfp4(self) -> None:
        """Forget the MXFP4-resident experts: forwards read the dense parameters again."""
        for name in MXFP4_BUFFERS:
            setattr(self, name, None)


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
