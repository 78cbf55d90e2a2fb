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


class Experts(nn.Module):
    """E SwiGLU experts: y_e(x) = down_e(silu(gate_e x) ⊙ up_e x), stored fused as 3-D tensors."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        E, H, I = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.zeros(E, 2 * I, H))
        self.down_proj = nn.Parameter(torch.zeros(E, H, I))
        self.kernels: Kernels = kernels_for("torch")  # MoETransformer.set_kernels hands down the model's

    def forward(self, x_NH: torch.Tensor, ids_Nk: torch.Tensor, weights_Nk: torch.Tensor) -> torch.Tensor:
        """y_n = Σ_j weights[n, j] · y_{ids[n, j]}(x_n). Assignments are sorted by expert and each
        expert runs once on its contiguous slice (one host sync for the per-expert counts).
        Inference on CPU with a few tokens per expert (decode) runs ``kernels/moe_cpu`` instead on the
        ``cpu`` kernel backend: one C++ call that streams each active expert's weights once."""
        N, k = ids_Nk.shape
        E = self.gate_up_proj.shape[0]
        needs_grad = torch.is_grad_enabled() and any(
            t.requires_grad for t in (x_NH, weights_Nk, self.gate_up_proj, self.down_proj))
        if self.kernels.cpp and moe_cpu.use_kernel(x_NH, ids_Nk, E, needs_grad):
            return moe_cpu.moe_experts(x_NH, ids_Nk, weights_Nk, self.gate_up_proj, self.down_proj)
        ids_A = ids_Nk.reshape(-1)  # A = N·k assignments
        order_A = torch.argsort(ids_A, stable=True)
        counts = torch.bincount(ids_A, minlength=E).tolist()
        amp = x_NH.device.type  # autocast casts float32 only (float64 stays float64), and so does this path
        dtype = torch.get_autocast_dtype(amp) if torch.is_autocast_enabled(amp) and x_NH.dtype == torch.float32 else None
        return RoutedSwiGLU.apply(x_NH, weights_Nk, self.gate_up_proj, self.down_proj, order_A, order_A // k, counts,
                                  dtype)


class RoutedSwiGLU(torch.autograd.Function):
    """out_n = Σ_j w[n, j] · y_{ids[n, j]}(x_n), y_e(x) = down_e(silu(gate_e x) ⊙ up_e x), as one
    autograd node: x_NH [N, H], weights_Nk [N, k], gate_up [E, 2I, H] (gate rows first), down
    [E, H, I]; assignment a = order_A[i] is (token a // k, slot a % k), ``token_A`` = order_A // k,
    sorted by expert, ``counts[e]`` of them for expert e → out_NH.

    Each expert's matmuls write into row slices of whole-[A, ·] buffers, and the backward writes
    each expert's weight gradients straight into one [E, ...] gradient (experts without rows get
    zeros). Autograd over per-expert slices, `proj[e]` / `unbind`, `chunk` and `cat` instead
    zero-filled, stacked or concatenated [A, H] and [E, ...] buffers per expert and layer (~30 % of
    a profiled bench_moe learner step before it). The token gather, the routing weights and the
    scatter back are in the same node, so the backward's weight terms run on [A, I] rather than
    [A, H] (dw_a = <dout_a @ down_e, act_a>, dact_a = w_a · dout_a @ down_e) and SwiGLU's backward
    is ``silu_backward``. tests/model/test_grouped_swiglu.py checks values and gradients against
    plain autograd in float64.

    ``dtype``: the matmuls' dtype (None: x's). Under ``torch.autocast`` ``Experts`` passes the autocast
    dtype (``learner.autocast``): the gathered tokens and the expert weights are cast once per layer,
    every matmul and SwiGLU runs in it, the output is summed back in x's dtype and the gradients come
    back in each input's own dtype (the fp32 weights keep fp32 gradients for the optimizer). In bfloat16 /
    float16 on CPU each expert's slice is padded to ``padded_rows`` with zero tokens of routing weight 0, so
    the matmuls meet few shapes (oneDNN builds a kernel per shape): the same values and gradients (tested),
    less time per learner step (tests/bench/results.md, "Model and learner").
    """

    @staticmethod
    def forward(ctx, x_NH, weights_Nk, gate_up_EOH, down_EHI, order_A, token_A, counts, dtype=None):
        N, H, I = x_NH.shape[0], x_NH.shape[1], down_EHI.shape[2]
        k = order_A.shape[0] // max(N, 1)
        ctx.dtypes = (x_NH.dtype, gate_up_EOH.dtype, down_EHI.dtype)
        if dtype is not None:
            gate_up_EOH, down_EHI = gate_up_EOH.to(dtype), down_EHI.to(dtype)
        # bfloat16 / float16 on CPU: each expert's rows rounded up (padded_rows) so oneDNN reuses its kernels;
        # a pad row is a zero token (index N of x with a zero row appended) of routing weight 0
        layout = padded_layout(counts, order_A, N, k) if _pads(gate_up_EOH) else None
        if layout is not None:
            counts, order_A, token_A = layout
            x_NH = torch.cat((x_NH, x_NH.new_zeros(1, H)))
            weights_Nk = torch.cat((weights_Nk.reshape(-1), weights_Nk.new_zeros(1)))
        A = order_A.shape[0]
        x_AH = x_NH.index_select(0, token_A).to(gate_up_EOH.dtype)
        h_AO = x_AH.new_empty(A, 2 * I)
        for e, rows in _expert_rows(counts):
            torch.mm(x_AH[rows], gate_up_EOH[e].t(), out=h_AO[rows])
        silu_AI = F.silu(h_AO[:, :I])
        act_AI = silu_AI * h_AO[:, I:]
        y_AH = x_AH.new_empty(A, down_EHI.shape[1])
        for e, rows in _expert_rows(counts):
            torch.mm(act_AI[rows], down_EHI[e].t(), out=y_AH[rows])
        w_A1 = weights_Nk.reshape(-1)[order_A, None].to(y_AH.dtype)
        out_NH = torch.zeros_like(x_NH).index_add_(0, token_A, y_AH.mul_(w_A1).to(x_NH.dtype))
        ctx.save_for_backward(x_AH, gate_up_EOH, down_EHI, h_AO, silu_AI, act_AI, w_A1, order_A, token_A)
        ctx.counts, ctx.padded, ctx.nk = counts, layout is not None, (N, k)
        return out_NH[:N] if layout is not None else out_NH

    @staticmethod
    def backward(ctx, dout_NH):
        x_AH, gate_up_EOH, down_EHI, h_AO, silu_AI, act_AI, w_A1, order_A, token_A = ctx.saved_tensors
        counts, I = ctx.counts, down_EHI.shape[2]
        N, k = ctx.nk
        if ctx.padded:  # the pad rows' token N: a zero row of dout, and a dummy row / slot in dx / dw dropped below
            dout_NH = torch.cat((dout_NH, dout_NH.new_zeros(1, dout_NH.shape[1])))
        dyw_AH = dout_NH.index_select(0, token_A).to(down_EHI.dtype)  # dL/d(w_a y_a)
        d_gate_up, d_down = torch.empty_like(gate_up_EOH), torch.empty_like(down_EHI)
        for e in (e for e, c in enumerate(counts) if c == 0):
            d_gate_up[e].zero_()
            d_down[e].zero_()
        g_AI = act_AI.new_empty(act_AI.shape)  # dyw_a @ down_e = dL/dact_a / w_a
        for e, rows in _expert_rows(counts):
            torch.mm(dyw_AH[rows], down_EHI[e], out=g_AI[rows])
        dw_A = (g_AI * act_AI).sum(-1, dtype=ctx.dtypes[0])  # routing-weight gradients summed in x's dtype
        actw_AI = act_AI * w_A1
        for e, rows in _expert_rows(counts):
            torch.mm(dyw_AH[rows].t(), actw_AI[rows], out=d_down[e])
        d_act_AI = g_AI.mul_(w_A1)
        dh_AO = h_AO.new_empty(h_AO.shape)
        torch.ops.aten.silu_backward(d_act_AI * h_AO[:, I:], h_AO[:, :I], grad_input=dh_AO[:, :I])
        torch.mul(d_act_AI, silu_AI, out=dh_AO[:, I:])
        dx_AH = x_AH.new_empty(x_AH.shape)
        for e, rows in _expert_rows(counts):
            torch.mm(dh_AO[rows], gate_up_EOH[e], out=dx_AH[rows])
            torch.mm(dh_AO[rows].t(), x_AH[rows], out=d_gate_up[e])
        x_dtype, gate_up_dtype, down_dtype = ctx.dtypes
        dx_NH = dout_NH.new_zeros(dout_NH.shape, dtype=x_dtype).index_add_(0, token_A, dx_AH.to(x_dtype))[:N]
        dw_Nk = dw_A.new_empty(N * k + ctx.padded, dtype=x_dtype)
        dw_Nk = dw_Nk.index_copy_(0, order_A, dw_A.to(x_dtype))[:N * k].view(N, k)  # the pads' dummy slot N·k dropped
        return dx_NH, dw_Nk, d_gate_up.to(gate_up_dtype), d_down.to(down_dtype), None, None, None, None


def padded_rows(count: int) -> int:
    """``count`` rounded up to a multiple of 2^max(3, ⌊log2 count⌋ - 3): at most 8 sizes per octave (1-8 -> 8,
    9-16 -> 16, ..., 129-144 -> 144, ...), at most 1/8 more rows than counted past 64 (at most 7 below).

    Why: torch's bfloat16 / float16 CPU matmul is oneDNN's, which builds a kernel per matrix shape and
    caches it (1024 shapes by default). An expert's row count changes every step, so with exact counts every
    expert matmul built a fresh kernel (1.6x the time of a fixed shape: tests/bench/results.md, "Model and
    learner"). Rounded, a learner step meets a few dozen sizes per matmul shape, which the cache keeps."""
    if count <= 8:
        return 8 if count else 0
    step = 1 << max(3, count.bit_length() - 1 - 3)
    return -(-count // step) * step


def padded_layout(counts: list[int], order_A: torch.Tensor, N: int, k: int
                  ) -> tuple[list[int], torch.Tensor, torch.Tensor] | None:
    """Each expert's rows rounded up to ``padded_rows``: → (padded counts, order_P, token_P) over P ≥ A rows,
    the expert's assignments first in each slice, then pads whose assignment is the dummy N·k (token N);
    None when no count changes."""
    padded = [padded_rows(c) for c in counts]
    if padded == counts:
        return None
    shift = []  # per expert: how far its rows move
    start = pstart = 0
    for c, p in zip(counts, padded):
        shift.append(pstart - start)
        start, pstart = start + c, pstart + p
    A, P = order_A.shape[0], pstart
    dev = order_A.device
    slot_A = torch.arange(A, device=dev) + torch.repeat_interleave(torch.tensor(shift, device=dev),
                                                                    torch.tensor(counts, device=dev), output_size=A)
    order_P = torch.full((P,), N * k, dtype=order_A.dtype, device=dev).index_copy_(0, slot_A, order_A)
    return padded, order_P, order_P // k


def _pads(w: torch.Tensor) -> bool:
    """Whether expert matmuls over ``w`` run on oneDNN's per-shape kernels: bfloat16 / float16 on CPU."""
    return w.device.type == "cpu" and w.dtype in (torch.bfloat16, torch.float16)


def _expert_rows(counts: list[int]):
    """(expert, its row slice) for every expert with rows."""
    start = 0
    for e, count in enumerate(counts):
        if count:
            yield e, slice(start, start + count)
        start += count


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
