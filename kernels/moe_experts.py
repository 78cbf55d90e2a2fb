"""The routed experts over dense weights, as one op: ``y_n = Σ_j w[n, j] · down_e(silu(gate_e x_n) ⊙ up_e x_n)``,
``e = ids[n, j]`` (``model.moe.Experts`` calls it through its kernel table, ``kernels/ops``).

* ``moe_experts_torch``: the torch reference (one per op): assignments sorted by expert, each expert's
  matmuls on its contiguous slice, all in one autograd node (``RoutedSwiGLU``), autocast-aware.
* ``moe_experts_cpu``: ``kernels/moe_cpu``'s C++ loop for inference on a few rows per expert
  (``moe_cpu.use_kernel``), the reference otherwise (gradients, many rows, float16 / bfloat16).
* ``moe_experts_triton``: ``moe_matmul.moe_experts_dense_triton`` (the grouped Triton matmuls) when no
  gradient is needed, the reference otherwise (the grouped kernels are forward only) and for float64.

Shapes: N tokens, k experts per token, E experts, H hidden, I expert width; ``gate_up [E, 2I, H]`` (gate
rows first, then up rows) and ``down [E, H, I]``, each matrix an ``nn.Linear`` weight (out, in).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from jointrl.kernels import moe_cpu, moe_matmul

__all__ = ["RoutedSwiGLU", "moe_experts_cpu", "moe_experts_torch", "moe_experts_triton", "padded_layout",
           "padded_rows"]


def _needs_grad(*tensors: Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _autocast_dtype(x_NH: Tensor) -> torch.dtype | None:
    """The matmul dtype under ``torch.autocast`` for x's device (None: x's). Autocast casts float32 only
    (float64 stays float64), and so do these ops."""
    amp = x_NH.device.type
    return torch.get_autocast_dtype(amp) if torch.is_autocast_enabled(amp) and x_NH.dtype == torch.float32 else None


def moe_experts_torch(x_NH: Tensor, ids_Nk: Tensor, weights_Nk: Tensor, gate_up_EOH: Tensor, down_EHI: Tensor
                      ) -> Tensor:
    """The reference: x [N, H], ids [N, k] int64, weights [N, k], gate_up [E, 2I, H], down [E, H, I] → y [N, H]
    in x's dtype, differentiable in x, weights, gate_up and down. Assignments are sorted by expert and each
    expert runs once on its contiguous slice (one host sync for the per-expert counts); under autocast the
    matmuls run in the autocast dtype (``RoutedSwiGLU``)."""
    N, k = ids_Nk.shape
    E = gate_up_EOH.shape[0]
    ids_A = ids_Nk.reshape(-1)  # A = N·k assignments
    order_A = torch.argsort(ids_A, stable=True)
    counts = torch.bincount(ids_A, minlength=E).tolist()
    return RoutedSwiGLU.apply(x_NH, weights_Nk, gate_up_EOH, down_EHI, order_A, order_A // k, counts,
                              _autocast_dtype(x_NH))


def moe_experts_cpu(x_NH: Tensor, ids_Nk: Tensor, weights_Nk: Tensor, gate_up_EOH: Tensor, down_EHI: Tensor
                    ) -> Tensor:
    """The ``cpu`` table's op: one C++ call that streams each active expert's weights once
    (``moe_cpu.moe_experts``) for inference in float32 / float64 with a few rows per expert, else the reference."""
    needs_grad = _needs_grad(x_NH, weights_Nk, gate_up_EOH, down_EHI)
    if moe_cpu.use_kernel(x_NH, ids_Nk, gate_up_EOH.shape[0], needs_grad):
        return moe_cpu.moe_experts(x_NH, ids_Nk, weights_Nk, gate_up_EOH, down_EHI)
    return moe_experts_torch(x_NH, ids_Nk, weights_Nk, gate_up_EOH, down_EHI)


def moe_experts_triton(x_NH: Tensor, ids_Nk: Tensor, weights_Nk: Tensor, gate_up_EOH: Tensor, down_EHI: Tensor
                       ) -> Tensor:
    """The ``triton`` table's op: the grouped Triton matmuls (``moe_matmul.moe_experts_dense_triton``: fp32
    accumulation, h rounded to the matmul dtype as the reference does) for inference; the reference where a
    gradient is needed (the kernels are forward only: the learner's experts train through ``RoutedSwiGLU``)
    or for float64 (the kernels work in fp32 at most). Under autocast the weights are cast to the autocast
    dtype first, as the reference does."""
    if gate_up_EOH.dtype == torch.float64 or _needs_grad(x_NH, weights_Nk, gate_up_EOH, down_EHI):
        return moe_experts_torch(x_NH, ids_Nk, weights_Nk, gate_up_EOH, down_EHI)
    dtype = _autocast_dtype(x_NH)
    if dtype is not None:
        gate_up_EOH, down_EHI = gate_up_EOH.to(dtype), down_EHI.to(dtype)
    return moe_matmul.moe_experts_dense_triton(x_NH, ids_Nk, weights_Nk, gate_up_EOH, down_EHI)


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
