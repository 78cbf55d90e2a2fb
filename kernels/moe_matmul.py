"""Grouped MoE matmuls over MXFP4 expert weights (dequantized inside the kernel) or dense ones.

The routed experts of ``model/moe.py`` (``gate_up_proj [E, 2I, H]``, gate rows first, then up
rows; ``down_proj [E, H, I]``) quantized along their last (input) dim by
``kernels.mxfp4.quantize_mxfp4``. Assignments (token, expert) are sorted by expert, so expert
``e`` owns rows ``offsets[e]:offsets[e + 1]`` of the sorted activations; an expert may own none.

* ``moe_swiglu_mxfp4``: ``h_a = silu(x_a G_eᵀ) ⊙ (x_a U_eᵀ)`` for each assignment ``a`` of expert
  ``e`` (``G_e``, ``U_e`` the gate and up halves of ``gate_up_proj[e]``): one kernel, two
  accumulators, SwiGLU fused into the epilogue.
* ``moe_down_mxfp4``: ``y_a = w_a · (h_a D_eᵀ)``, the routing weight applied in the epilogue.
* ``moe_experts_mxfp4``: the whole routed-expert FFN of ``model.moe.Experts`` for ``[N, H]``
  tokens and their top-k ``(ids, weights)``: sort, both kernels, unsort and sum over k
  (deterministic: no atomics). ``moe_experts_mxfp4_torch`` / ``_triton``: the same on one
  implementation whatever the process-wide backend (the op table's ``moe_experts_mxfp4``).
* ``moe_experts_dense_triton``: the same FFN over dense bf16 / fp16 / fp32 experts on the same two
  kernels (``MXFP4=False``: the weight tile is loaded, not decoded): the ``triton`` op table's
  ``moe_experts`` for inference (``kernels/moe_experts``).

Numerics: products of the activations and the dequantized weights are exact in fp32 (an
E2M1 value times a power of two has two significant bits), and both kernels accumulate in
fp32; ``h`` is rounded to the activations' dtype between the two matmuls, as the reference
does, and ``y`` is returned in that dtype. On CUDA, bf16/fp16 activations feed ``tl.dot``
directly (the dequantized weights are exact in bf16); fp32 activations use IEEE fp32 dots (no
TF32). Under the interpreter every dot runs in fp32 (its bf16 ``tl.dot`` is broken). So the
kernels equal "dequantize, then torch in fp32" up to fp32 summation order.

Tiling: a tile is ``BLOCK_M`` consecutive rows of one expert. The tile list is built on the
device (no host sync) with a static upper bound ``(A + E·(BLOCK_M - 1)) // BLOCK_M`` tiles;
unused tiles exit at once. Two configs: ``DECODE`` (``BLOCK_M = 16``) when there are at most
16 assignments per expert on average, else ``PREFILL``.

Layout (kernels/ convention): torch reference, Triton kernels, launchers, public functions.
Forward only: the learner trains bf16 experts, not MXFP4 ones.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from jointrl.kernels.dispatch import interpreting, launcher, use_triton
from jointrl.kernels.mxfp4 import MXFP4_BLOCK, _e2m1_tile, dequantize_mxfp4

__all__ = ["DECODE", "PREFILL", "TileConfig", "moe_down_mxfp4", "moe_experts_dense_triton", "moe_experts_mxfp4",
           "moe_experts_mxfp4_torch", "moe_experts_mxfp4_triton", "moe_swiglu_mxfp4"]


class TileConfig(NamedTuple):
    block_m: int  # sorted assignments per tile (one expert)
    block_n: int  # output columns per tile
    block_k: int  # reduction step, a multiple of 32 (whole MXFP4 blocks)
    num_warps: int
    num_stages: int


DECODE = TileConfig(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=3)
PREFILL = TileConfig(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=3)


def pick_config(num_assignments: int, num_experts: int) -> TileConfig:
    return DECODE if num_assignments <= 16 * num_experts else PREFILL


# ---------------------------------------------------------------------------------------
# plain-torch reference: dequantize, then fp32 matmuls expert by expert
# ---------------------------------------------------------------------------------------


def _moe_swiglu_torch(x_AH: Tensor, offsets_E1: Tensor, blocks: Tensor, scales: Tensor) -> Tensor:
    """x [A, H], offsets int [E+1], MXFP4 gate_up [E, 2I, H/2] + [E, 2I, H/32] -> h [A, I] (x's dtype)."""
    w_EFH = dequantize_mxfp4(blocks, scales, torch.float32)  # F = 2I
    inter = w_EFH.shape[1] // 2
    h_AI = torch.zeros(x_AH.shape[0], inter, dtype=torch.float32, device=x_AH.device)
    bounds = offsets_E1.tolist()
    for e in range(w_EFH.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            gate_aI, up_aI = (x_AH[lo:hi].float() @ w_EFH[e].T).split(inter, dim=-1)
            h_AI[lo:hi] = F.silu(gate_aI) * up_aI
    return h_AI.to(x_AH.dtype)


def _moe_down_torch(h_AI: Tensor, offsets_E1: Tensor, blocks: Tensor, scales: Tensor, weights_A: Tensor) -> Tensor:
    """h [A, I], MXFP4 down [E, H, I/2] + [E, H, I/32], weights [A] -> y [A, H] (h's dtype)."""
    w_EHI = dequantize_mxfp4(blocks, scales, torch.float32)
    y_AH = torch.zeros(h_AI.shape[0], w_EHI.shape[1], dtype=torch.float32, device=h_AI.device)
    bounds = offsets_E1.tolist()
    for e in range(w_EHI.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            y_AH[lo:hi] = (h_AI[lo:hi].float() @ w_EHI[e].T) * weights_A[lo:hi, None].float()
    return y_AH.to(h_AI.dtype)


# ---------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------


@triton.jit
def _weight_tile(wb_ptr, ws_ptr, w_rows, n_ok, k0, K, MXFP4: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """Rows ``w_rows`` [BLOCK_N] (int64, masked by ``n_ok``), columns ``k0:k0 + BLOCK_K`` of a weight with
    ``K`` input columns: MXFP4 (wb uint8 [rows, K/2], ws uint8 [rows, K/32]) decoded to fp32, or dense (wb
    [rows, K] in its own dtype, ws unused); out-of-range entries 0."""
    if MXFP4:
        kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        ks = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        w_bytes = tl.load(wb_ptr + w_rows[:, None] * (K // 2) + kb[None, :],
                          mask=n_ok[:, None] & (kb < K // 2)[None, :], other=0)
        w_scale = tl.load(ws_ptr + w_rows[:, None] * (K // 32) + ks[None, :],
                          mask=n_ok[:, None] & (ks < K // 32)[None, :], other=127)
        w = _e2m1_tile(w_bytes.to(tl.int32), w_scale.to(tl.int32), BLOCK_N, BLOCK_K)
    else:
        kk = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(wb_ptr + w_rows[:, None] * K + kk[None, :], mask=n_ok[:, None] & (kk < K)[None, :], other=0.0)
    return w


@triton.jit
def _moe_swiglu_kernel(
    x_ptr, tile_expert_ptr, tile_row_ptr, offsets_ptr, wb_ptr, ws_ptr, h_ptr,
    H, I,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr, MXFP4: tl.constexpr,
):
    """One (tile, column block): h[rows, n] = silu(x G_eᵀ) ⊙ (x U_eᵀ), weights read (MXFP4: decoded) per K step.

    x [A, H]; MXFP4: wb uint8 [E, 2I, H/2], ws uint8 [E, 2I, H/32]; dense: wb [E, 2I, H] (ws unused); h [A, I].
    """
    e = tl.load(tile_expert_ptr + tl.program_id(0))
    if e < 0:
        return
    row0 = tl.load(tile_row_ptr + tl.program_id(0))
    row_end = tl.load(offsets_ptr + e + 1)
    rows = row0 + tl.arange(0, BLOCK_M)
    row_ok = rows < row_end
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < I
    e64 = e.to(tl.int64)
    gate_rows = e64 * 2 * I + n  # rows of gate_up_proj[e]; up rows are I further
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * H + kk[None, :],
                    mask=row_ok[:, None] & (kk < H)[None, :], other=0.0)
        w_g = _weight_tile(wb_ptr, ws_ptr, gate_rows, n_ok, k0, H, MXFP4, BLOCK_N, BLOCK_K)
        w_u = _weight_tile(wb_ptr, ws_ptr, gate_rows + I, n_ok, k0, H, MXFP4, BLOCK_N, BLOCK_K)
        if DOT_FP32:
            xd = x.to(tl.float32)
            w_g = w_g.to(tl.float32)
            w_u = w_u.to(tl.float32)
        else:
            xd = x
            w_g = w_g.to(x.dtype)
            w_u = w_u.to(x.dtype)
        acc_g = tl.dot(xd, tl.trans(w_g), acc_g, input_precision="ieee")
        acc_u = tl.dot(xd, tl.trans(w_u), acc_u, input_precision="ieee")
    h = acc_g * tl.sigmoid(acc_g) * acc_u
    tl.store(h_ptr + rows.to(tl.int64)[:, None] * I + n[None, :], h.to(h_ptr.dtype.element_ty),
             mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _moe_down_kernel(
    h_ptr, tile_expert_ptr, tile_row_ptr, offsets_ptr, wb_ptr, ws_ptr, w_ptr, y_ptr,
    H, I,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr, MXFP4: tl.constexpr,
):
    """One (tile, column block): y[rows, n] = w[rows] · (h D_eᵀ)[rows, n].

    h [A, I]; MXFP4: wb uint8 [E, H, I/2], ws uint8 [E, H, I/32]; dense: wb [E, H, I] (ws unused);
    w [A] routing weights; y [A, H].
    """
    e = tl.load(tile_expert_ptr + tl.program_id(0))
    if e < 0:
        return
    row0 = tl.load(tile_row_ptr + tl.program_id(0))
    row_end = tl.load(offsets_ptr + e + 1)
    rows = row0 + tl.arange(0, BLOCK_M)
    row_ok = rows < row_end
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < H
    w_rows = e.to(tl.int64) * H + n
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        h = tl.load(h_ptr + rows.to(tl.int64)[:, None] * I + kk[None, :],
                    mask=row_ok[:, None] & (kk < I)[None, :], other=0.0)
        w_d = _weight_tile(wb_ptr, ws_ptr, w_rows, n_ok, k0, I, MXFP4, BLOCK_N, BLOCK_K)
        if DOT_FP32:
            hd = h.to(tl.float32)
            w_d = w_d.to(tl.float32)
        else:
            hd = h
            w_d = w_d.to(h.dtype)
        acc = tl.dot(hd, tl.trans(w_d), acc, input_precision="ieee")
    route_w = tl.load(w_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    y = acc * route_w[:, None]
    tl.store(y_ptr + rows.to(tl.int64)[:, None] * H + n[None, :], y.to(y_ptr.dtype.element_ty),
             mask=row_ok[:, None] & n_ok[None, :])


# ---------------------------------------------------------------------------------------
# launchers
# ---------------------------------------------------------------------------------------


def _tiles(offsets_E1: Tensor, num_assignments: int, block_m: int) -> tuple[Tensor, Tensor]:
    """Device-side tile list: (expert int32 [T], first row int32 [T]); expert -1 = unused tile.

    T = (A + E·(block_m - 1)) // block_m bounds Σ_e ceil(count_e / block_m) without a host sync.
    """
    num_experts = offsets_E1.numel() - 1
    offsets = offsets_E1.to(torch.int64)
    tiles_E = (offsets[1:] - offsets[:-1] + block_m - 1) // block_m
    last_E = torch.cumsum(tiles_E, 0)  # one past each expert's last tile
    bound = (num_assignments + num_experts * (block_m - 1)) // block_m
    t = torch.arange(bound, device=offsets.device)
    expert_T = torch.searchsorted(last_E, t, right=True)
    used = expert_T < num_experts
    e = expert_T.clamp(max=num_experts - 1)
    row_T = offsets[e] + (t - (last_E[e] - tiles_E[e])) * block_m
    return torch.where(used, expert_T, -1).to(torch.int32), row_T.to(torch.int32)


def _dot_fp32(kernel, x: Tensor) -> bool:
    return interpreting(kernel) or x.dtype == torch.float32


def _moe_swiglu_triton(x_AH: Tensor, offsets_E1: Tensor, blocks: Tensor, scales: Tensor | None,
                       config: TileConfig | None = None) -> Tensor:
    """MXFP4 gate_up (blocks, scales), or dense gate_up [E, 2I, H] as ``blocks`` with ``scales`` None."""
    A, H = x_AH.shape
    E, two_i, _ = blocks.shape
    inter = two_i // 2
    cfg = config or pick_config(A, E)
    h_AI = torch.empty(A, inter, dtype=x_AH.dtype, device=x_AH.device)
    if A == 0 or inter == 0:
        return h_AI.zero_()
    tile_e, tile_row = _tiles(offsets_E1, A, cfg.block_m)
    kernel = launcher(_moe_swiglu_kernel, x_AH.device)
    grid = (tile_e.numel(), triton.cdiv(inter, cfg.block_n))
    kernel[grid](
        x_AH.contiguous(), tile_e, tile_row, offsets_E1.to(torch.int32).contiguous(),
        blocks.contiguous(), (blocks if scales is None else scales).contiguous(), h_AI, H, inter,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, DOT_FP32=_dot_fp32(kernel, x_AH),
        MXFP4=scales is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return h_AI


def _moe_down_triton(h_AI: Tensor, offsets_E1: Tensor, blocks: Tensor, scales: Tensor | None, weights_A: Tensor,
                     config: TileConfig | None = None) -> Tensor:
    """MXFP4 down (blocks, scales), or dense down [E, H, I] as ``blocks`` with ``scales`` None."""
    A, inter = h_AI.shape
    E, H, _ = blocks.shape
    cfg = config or pick_config(A, E)
    y_AH = torch.empty(A, H, dtype=h_AI.dtype, device=h_AI.device)
    if A == 0 or H == 0:
        return y_AH.zero_()
    tile_e, tile_row = _tiles(offsets_E1, A, cfg.block_m)
    kernel = launcher(_moe_down_kernel, h_AI.device)
    grid = (tile_e.numel(), triton.cdiv(H, cfg.block_n))
    kernel[grid](
        h_AI.contiguous(), tile_e, tile_row, offsets_E1.to(torch.int32).contiguous(),
        blocks.contiguous(), (blocks if scales is None else scales).contiguous(), weights_A.contiguous(), y_AH, H,
        inter, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, DOT_FP32=_dot_fp32(kernel, h_AI),
        MXFP4=scales is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return y_AH


# ---------------------------------------------------------------------------------------
# public API
# ---------------------------------------------------------------------------------------


def _check_weights(blocks: Tensor, scales: Tensor, name: str) -> None:
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise TypeError(f"{name} blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if (blocks.dim() != 3 or scales.dim() != 3 or blocks.shape[:2] != scales.shape[:2]
            or blocks.shape[2] != (MXFP4_BLOCK // 2) * scales.shape[2]):
        raise ValueError(f"{name}: blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} "
                         "must be [E, out, in/2] and [E, out, in/32]")


def _check_rows(x: Tensor, offsets_E1: Tensor, num_experts: int, in_dim: int, name: str) -> None:
    if x.dim() != 2 or x.shape[1] != in_dim:
        raise ValueError(f"{name} must be [A, {in_dim}], got {tuple(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be floating point, got {x.dtype}")
    if offsets_E1.shape != (num_experts + 1,):
        raise ValueError(f"offsets must be [E + 1] = [{num_experts + 1}], got {tuple(offsets_E1.shape)}")


def moe_swiglu_mxfp4(x_AH: Tensor, offsets_E1: Tensor, gate_up_blocks: Tensor, gate_up_scales: Tensor) -> Tensor:
    """SwiGLU of the gate/up projection for assignments sorted by expert, MXFP4 weights.

    Args:
        x_AH: ``[A, H]`` activations (bf16, fp16 or fp32), rows sorted by expert.
        offsets_E1: int ``[E + 1]``, ``offsets[0] = 0``, ``offsets[E] = A``, non-decreasing:
            expert ``e`` owns rows ``offsets[e]:offsets[e + 1]``.
        gate_up_blocks, gate_up_scales: ``quantize_mxfp4(gate_up_proj)``, uint8 ``[E, 2I, H/2]``
            and ``[E, 2I, H/32]`` (gate rows ``0:I``, up rows ``I:2I``).

    Returns:
        ``h [A, I]`` in ``x``'s dtype: ``silu(x G_eᵀ) ⊙ (x U_eᵀ)`` row by row.
    """
    _check_weights(gate_up_blocks, gate_up_scales, "gate_up")
    _check_rows(x_AH, offsets_E1, gate_up_blocks.shape[0], 2 * gate_up_blocks.shape[2], "x_AH")
    if use_triton(x_AH.device):
        return _moe_swiglu_triton(x_AH, offsets_E1, gate_up_blocks, gate_up_scales)
    return _moe_swiglu_torch(x_AH, offsets_E1, gate_up_blocks, gate_up_scales)


def moe_down_mxfp4(h_AI: Tensor, offsets_E1: Tensor, down_blocks: Tensor, down_scales: Tensor,
                   weights_A: Tensor) -> Tensor:
    """Down projection for assignments sorted by expert, scaled by their routing weights.

    Args:
        h_AI: ``[A, I]`` (output of :func:`moe_swiglu_mxfp4`), rows sorted by expert.
        offsets_E1: int ``[E + 1]`` as in :func:`moe_swiglu_mxfp4`.
        down_blocks, down_scales: ``quantize_mxfp4(down_proj)``, uint8 ``[E, H, I/2]`` and
            ``[E, H, I/32]``.
        weights_A: ``[A]`` routing weight of each assignment.

    Returns:
        ``y [A, H]`` in ``h``'s dtype: ``weights[a] · h_a D_eᵀ``.
    """
    _check_weights(down_blocks, down_scales, "down")
    _check_rows(h_AI, offsets_E1, down_blocks.shape[0], 2 * down_blocks.shape[2], "h_AI")
    if weights_A.shape != (h_AI.shape[0],):
        raise ValueError(f"weights_A must be [{h_AI.shape[0]}], got {tuple(weights_A.shape)}")
    if use_triton(h_AI.device):
        return _moe_down_triton(h_AI, offsets_E1, down_blocks, down_scales, weights_A)
    return _moe_down_torch(h_AI, offsets_E1, down_blocks, down_scales, weights_A)


def moe_experts_mxfp4(x_NH: Tensor, ids_Nk: Tensor, weights_Nk: Tensor, gate_up_blocks: Tensor,
                      gate_up_scales: Tensor, down_blocks: Tensor, down_scales: Tensor) -> Tensor:
    """The routed-expert FFN of ``model.moe.Experts`` with MXFP4 weights.

    ``y_n = Σ_j weights[n, j] · down_e(silu(gate_e x_n) ⊙ up_e x_n)``, ``e = ids[n, j]``.

    Args:
        x_NH: ``[N, H]`` tokens.
        ids_Nk: int ``[N, k]`` expert ids in ``[0, E)``; weights_Nk: ``[N, k]`` routing weights.
        gate_up_blocks, gate_up_scales: uint8 ``[E, 2I, H/2]``, ``[E, 2I, H/32]``.
        down_blocks, down_scales: uint8 ``[E, H, I/2]``, ``[E, H, I/32]``.

    Returns:
        ``y [N, H]`` in ``x``'s dtype. The k contributions of a token are summed in fp32 in a
        fixed order (no atomics), so the result is deterministic.
    """
    return _routed(x_NH, ids_Nk, weights_Nk, gate_up_blocks.shape[0],
                   lambda x_AH, off: moe_swiglu_mxfp4(x_AH, off, gate_up_blocks, gate_up_scales),
                   lambda h_AI, off, w_A: moe_down_mxfp4(h_AI, off, down_blocks, down_scales, w_A))


def moe_experts_mxfp4_torch(x_NH: Tensor, ids_Nk: Tensor, weights_Nk: Tensor, gate_up_blocks: Tensor,
                            gate_up_scales: Tensor, down_blocks: Tensor, down_scales: Tensor) -> Tensor:
    """:func:`moe_experts_mxfp4` on the torch reference (dequantize, fp32 matmuls per expert), whatever the
    process-wide backend: the ``torch`` / ``cpu`` kernel table's ``moe_experts_mxfp4``."""
    return _routed(x_NH, ids_Nk, weights_Nk, gate_up_blocks.shape[0],
                   lambda x_AH, off: _moe_swiglu_torch(x_AH, off, gate_up_blocks, gate_up_scales),
                   lambda h_AI, off, w_A: _moe_down_torch(h_AI, off, down_blocks, down_scales, w_A))


def moe_experts_mxfp4_triton(x_NH: Tensor, ids_Nk: Tensor, weights_Nk: Tensor, gate_up_blocks: Tensor,
                             gate_up_scales: Tensor, down_blocks: Tensor, down_scales: Tensor) -> Tensor:
    """:func:`moe_experts_mxfp4` on the Triton kernels, whatever the process-wide backend (the ``triton``
    kernel table's ``moe_experts_mxfp4``). Forward only."""
    _check_weights(gate_up_blocks, gate_up_scales, "gate_up")
    _check_weights(down_blocks, down_scales, "down")
    return _routed(x_NH, ids_Nk, weights_Nk, gate_up_blocks.shape[0],
                   lambda x_AH, off: _moe_swiglu_triton(x_AH, off, gate_up_blocks, gate_up_scales),
                   lambda h_AI, off, w_A: _moe_down_triton(h_AI, off, down_blocks, down_scales, w_A))


def moe_experts_dense_triton(x_NH: Tensor, ids_Nk: Tensor, weights_Nk: Tensor, gate_up_EOH: Tensor,
                             down_EHI: Tensor) -> Tensor:
    """The routed-expert FFN over dense experts (``gate_up [E, 2I, H]``, ``down [E, H, I]``, bf16 / fp16 /
    fp32) on the same grouped kernels: the ``triton`` kernel table's ``moe_experts`` when no gradient is
    needed (``kernels/moe_experts.moe_experts_triton``). The tokens are cast to the weights' dtype, each
    matmul accumulates in fp32, ``h`` and each assignment's ``y`` are rounded to the weights' dtype (as the
    reference ``RoutedSwiGLU``), the k contributions summed in fp32 in slot order → ``y [N, H]`` in x's dtype."""
    if gate_up_EOH.dim() != 3 or down_EHI.dim() != 3 or down_EHI.shape[0] != gate_up_EOH.shape[0] \
            or gate_up_EOH.shape[1] != 2 * down_EHI.shape[2] or down_EHI.shape[1] != gate_up_EOH.shape[2]:
        raise ValueError(f"gate_up {tuple(gate_up_EOH.shape)} and down {tuple(down_EHI.shape)} must be "
                         "[E, 2I, H] and [E, H, I]")
    if x_NH.dim() != 2 or x_NH.shape[1] != gate_up_EOH.shape[2]:
        raise ValueError(f"x_NH must be [N, {gate_up_EOH.shape[2]}], got {tuple(x_NH.shape)}")
    wdt = gate_up_EOH.dtype
    down_EHI = down_EHI.to(wdt)
    return _routed(x_NH.to(wdt), ids_Nk, weights_Nk.to(wdt), gate_up_EOH.shape[0],
                   lambda x_AH, off: _moe_swiglu_triton(x_AH, off, gate_up_EOH, None),
                   lambda h_AI, off, w_A: _moe_down_triton(h_AI, off, down_EHI, None, w_A)).to(x_NH.dtype)


def _counts(ids_A: Tensor, num_experts: int) -> Tensor:
    """Assignments per expert, int64 [E], without a host sync (``torch.bincount`` reads the largest id back on
    CUDA to size its output): a scatter-add of ones into E zeros (integer adds: order-free, so deterministic)."""
    return torch.zeros(num_experts, dtype=torch.int64, device=ids_A.device).scatter_add_(
        0, ids_A.to(torch.int64), torch.ones_like(ids_A, dtype=torch.int64))


def _routed(x_NH: Tensor, ids_Nk: Tensor, weights_Nk: Tensor, num_experts: int, swiglu, down) -> Tensor:
    """Sort the N·k assignments by expert, ``h = swiglu(x sorted, offsets)``, ``y = down(h, offsets, weights
    sorted)``, unsort and sum over k in fp32 (fixed order) → [N, H] in x's dtype. With the Triton kernels
    (``_moe_*_triton``) no host sync and no value-dependent shape: the counts by scatter-add (``_counts``), the
    tile list and its grid bounded by N·k and E (``_tiles``), so a CUDA graph can capture it (a decode step,
    ``rl/rollout/cuda_graphs.py``); the torch reference reads the offsets on the host."""
    if ids_Nk.dim() != 2 or ids_Nk.shape[0] != x_NH.shape[0] or weights_Nk.shape != ids_Nk.shape:
        raise ValueError(f"ids_Nk {tuple(ids_Nk.shape)} and weights_Nk {tuple(weights_Nk.shape)} "
                         f"must both be [N, k] with N = {x_NH.shape[0]}")
    N, k = ids_Nk.shape
    E = num_experts
    ids_A = ids_Nk.reshape(-1)
    order_A = torch.argsort(ids_A, stable=True)
    offsets_E1 = torch.zeros(E + 1, dtype=torch.int32, device=x_NH.device)
    offsets_E1[1:] = torch.cumsum(_counts(ids_A, E), 0)
    h_AI = swiglu(x_NH[order_A // k], offsets_E1)
    y_sorted_AH = down(h_AI, offsets_E1, weights_Nk.reshape(-1)[order_A])
    y_AH = torch.empty_like(y_sorted_AH).index_copy_(0, order_A, y_sorted_AH)
    return y_AH.view(N, k, y_AH.shape[1]).float().sum(1).to(x_NH.dtype)
