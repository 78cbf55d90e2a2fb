"""The routed experts of ``model.moe.Experts`` for a few tokens on CPU: one C++ call per layer.

    y_n = Σ_j w[n, j] · down_e(silu(gate_e x_n) ⊙ up_e x_n),   e = ids[n, j]

Why: at decode a layer sees a few tokens per expert (batch 32, top-2 of 16: about 4), and 16
experts x 3 small torch ops per layer, each a BLAS GEMM of about 4 rows, cost far more than the
arithmetic. This loop streams each active expert's weight rows once and fuses SwiGLU. With AVX2 + FMA
(and a width that is a multiple of the vector width), the weight rows go in blocks of 8 (float) /
4 (double) that stay in L1 while every token of the expert passes over them, up to 4 tokens x 2 rows
per pass, one vector accumulator per dot product, their lanes summed together at the end, and the
weights a few blocks ahead are prefetched (they are streamed from memory once per step, and the loads
stalled the arithmetic without); elsewhere four rows per pass against every token. It adds the k weighted
outputs of each token in slot order (deterministic, no atomics); a token's sums run in the same
order whatever tokens share its experts (tested bit for bit: ``rollout.batch_invariant`` needs it).
Parallel over experts with torch's intra-op threads. ``model.moe.Experts`` keeps its per-expert
BLAS matmuls whenever gradients are needed and for many rows per expert (``use_kernel``).

``moe_experts_packed`` is the same sum over expert matrices packed once in ``linear_cpu``'s panels
(``pack_experts``; the rollout runner keeps that copy beside the model's and repacks it when the weights
change): each active expert's tokens gathered into rows, then ``linear_cpu``'s panel loop -- no lane sums
per pass, every panel a contiguous 4-16 KB stretch the hardware prefetcher follows, software prefetch
4 KB ahead. A token's result
is again one sum per output in k order, whatever shares its experts.

The C++ is ``csrc/moe.cpp`` (``torch.ops.jointrl.moe_experts`` / ``moe_experts_packed`` / ``pack_bf16_exact``,
built by ``kernels/build``; measurements: tests/bench/results.md, "C++ CPU kernels"); ``load_kernel()`` is None
where it cannot be built. Equal to the
per-expert torch loop up to summation order (tests/kernels/test_moe_cpu.py, float64 and float32).

Shapes: N tokens, k experts per token, E experts, H hidden, I expert width; ``gate_up [E, 2I, H]``
(gate rows, then up rows) and ``down [E, H, I]``, each matrix an ``nn.Linear`` weight (out, in).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from jointrl.kernels import linear_cpu
from jointrl.kernels.cpu_extension import load_ops

__all__ = ["moe_experts", "moe_experts_packed", "pack_experts", "pack_experts_bf16", "panel_shapes", "load_kernel",
           "use_kernel"]

# Assignments (token, slot) per expert on average up to which ``Experts`` uses this loop. Measured on
# bench_moe shapes, one thread (thread CPU time): 4.7x faster than per-expert BLAS at 2 rows per
# expert (batch 32 decode), 1.7x at 32, even at 128-256 (a 1-2K-token prefill chunk).
MAX_ROWS_PER_EXPERT = 128

@functools.cache
def load_kernel():
    """The ops (``kernels/cpu_extension.load_ops``), or None where they cannot be built here."""
    return load_ops(["moe_experts", "moe_experts_packed", "pack_bf16_exact"])


def use_kernel(x_NH: Tensor, ids_Nk: Tensor, num_experts: int, needs_grad: bool) -> bool:
    """Whether ``Experts`` should call ``moe_experts``: inference on CPU in float32/64, a few rows
    per expert, and the kernel builds here."""
    return (not needs_grad and x_NH.device.type == "cpu" and x_NH.dtype in (torch.float32, torch.float64)
            and ids_Nk.numel() <= MAX_ROWS_PER_EXPERT * num_experts and load_kernel() is not None)


def moe_experts(x_NH: Tensor, ids_Nk: Tensor, weights_Nk: Tensor, gate_up_EOH: Tensor, down_EHI: Tensor) -> Tensor:
    """x [N, H], ids [N, k] int64, weights [N, k] (x's dtype), gate_up [E, 2I, H], down [E, H, I]
    → y [N, H]. Forward only (no autograd)."""
    return load_kernel().moe_experts(x_NH.contiguous(), ids_Nk.contiguous(), weights_Nk.contiguous(),
                              gate_up_EOH.contiguous(), down_EHI.contiguous())


def pack_experts(gate_up_EOH: Tensor, down_EHI: Tensor, out: tuple[Tensor, Tensor] | None = None
                 ) -> tuple[Tensor, Tensor]:
    """(gate_up, down) → each expert's matrix in ``linear_cpu.pack``'s panels: gate_up [E, ceil(2I/16), H, 16],
    down [E, ceil(H/16), I, 16] (``pack(gate_up[e])`` is ``gate_up_packed[e]``). ``out``: an earlier
    ``pack_experts`` of weights of these shapes, overwritten in place (``linear_cpu.pack_into``: one strided
    copy each, no new memory: tests/bench/results.md, "ModelRunner")."""
    if out is not None:
        return linear_cpu.pack_into(out[0], gate_up_EOH.detach()), linear_cpu.pack_into(out[1], down_EHI.detach())
    return _pack3(gate_up_EOH), _pack3(down_EHI)


def panel_shapes(gate_up_EOH: Tensor, down_EHI: Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shapes of ``pack_experts``'s (gate_up, down) panels."""
    P = linear_cpu.PANEL
    return tuple((w.shape[0], -(-w.shape[1] // P), w.shape[2], P) for w in (gate_up_EOH, down_EHI))


def pack_experts_bf16(gate_up_EOH: Tensor, down_EHI: Tensor, out: tuple[Tensor, Tensor]) -> bool:
    """``pack_experts`` of float32 experts into bfloat16 panels ``out`` (shapes ``panel_shapes``), when every
    weight is exactly a bfloat16 -- MXFP4-dequantized experts are (an e2m1 value, two mantissa bits, times a
    power of two), so the panels then hold the same numbers in half the bytes and ``moe_experts_packed``,
    which widens them exactly on load, gives the same result bit for bit. False (``out`` partly written,
    not to be used) when a weight is not, or the kernel is unavailable."""
    kernel = load_kernel()
    if kernel is None or gate_up_EOH.dtype != torch.float32 or down_EHI.dtype != torch.float32:
        return False
    return all(kernel.pack_bf16_exact(w.detach().contiguous(), o) for w, o in zip((gate_up_EOH, down_EHI), out))


def _pack3(w_EOK: Tensor) -> Tensor:
    E, O, K = w_EOK.shape
    P = linear_cpu.PANEL
    return F.pad(w_EOK.detach(), (0, 0, 0, -O % P)).view(E, -1, P, K).transpose(2, 3).contiguous()


def moe_experts_packed(x_NH: Tensor, ids_Nk: Tensor, weights_Nk: Tensor, gate_up_packed: Tensor,
                       down_packed: Tensor, intermediate: int) -> Tensor:
    """``moe_experts`` over ``pack_experts``'s panels, or ``pack_experts_bf16``'s under a float32 x
    (``intermediate`` = I) → y [N, H]. Forward only."""
    return load_kernel().moe_experts_packed(x_NH.contiguous(), ids_Nk.contiguous(), weights_Nk.contiguous(),
                                            gate_up_packed, down_packed, intermediate)
