"""Decode attention over a paged KV cache (one new query token per sequence), with GQA.

Keys and values live in fixed-size blocks of ``block_size`` token slots; sequence ``b``'s
token ``t`` sits in physical block ``block_table[b, t // block_size]``, slot
``t % block_size``. Blocks need not be contiguous or in order, and entries of a row past
``ceil(context_lens[b] / block_size)`` are never read (they may hold -1 or stale ids: the
table can have holes). Query head ``h`` reads kv head ``h // (Hq / Hkv)``.

``o[b, h] = softmax(scale · q[b, h] · K_bᵀ) V_b`` over the ``context_lens[b]`` cached tokens;
a sequence with no cached token gets zeros.

The caches are ``[num_blocks, block_size, Hkv, D]`` with any strides over the first three
dims (D contiguous), so the engine's fused ``[slots, 2, Hkv, D]`` cache
(``rl/rollout/model_runner.py``) passes as two strided views without a copy.

Kernel: one program per (sequence, kv head) holds that head's ``G = Hq / Hkv`` queries as a
``[BLOCK_G >= 16, BLOCK_D]`` tile (padding rows masked), walks the context ``BLOCK_N`` tokens
at a time (gathering slots through the block table) with an online softmax in fp32. Long
contexts with few heads would want the context split across programs (flash-decoding); not
done yet. Under the interpreter the dots run in fp32 (its bf16 ``tl.dot`` is broken); on CUDA
bf16/fp16 operands go to ``tl.dot`` directly (p is rounded to the value dtype, as in
FlashAttention), fp32 ones as IEEE fp32.

Layout (kernels/ convention): torch reference, Triton kernel, launcher, public function.
Forward only (the engine does not differentiate).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from jointrl.kernels.dispatch import interpreting, launcher, use_triton

__all__ = ["DECODE_CONFIG", "paged_attention_decode"]


class DecodeConfig(NamedTuple):
    block_n: int  # context tokens per step
    num_warps: int
    num_stages: int


DECODE_CONFIG = DecodeConfig(block_n=64, num_warps=4, num_stages=2)


# ---------------------------------------------------------------------------------------
# plain-torch reference
# ---------------------------------------------------------------------------------------


def _paged_attention_torch(q_BHD: Tensor, k_cache: Tensor, v_cache: Tensor, block_table_BM: Tensor,
                           context_lens_B: Tensor, scale: float) -> Tensor:
    """Gather each sequence's keys/values through its table, then plain softmax attention in
    fp32 (float64 for float64 inputs)."""
    B, Hq, D = q_BHD.shape
    block_size, Hkv = k_cache.shape[1], k_cache.shape[2]
    work = torch.float64 if q_BHD.dtype == torch.float64 else torch.float32
    out_BHD = torch.zeros(B, Hq, D, dtype=work, device=q_BHD.device)
    for b, ctx in enumerate(context_lens_B.tolist()):
        if ctx == 0:
            continue
        t_S = torch.arange(ctx, device=q_BHD.device)
        phys_S = block_table_BM[b, t_S // block_size].long()
        k_SHD = k_cache[phys_S, t_S % block_size].to(work).repeat_interleave(Hq // Hkv, dim=1)
        v_SHD = v_cache[phys_S, t_S % block_size].to(work).repeat_interleave(Hq // Hkv, dim=1)
        s_HS = torch.einsum("hd,shd->hs", q_BHD[b].to(work), k_SHD) * scale
        out_BHD[b] = torch.einsum("hs,shd->hd", torch.softmax(s_HS, dim=-1), v_SHD)
    return out_BHD.to(q_BHD.dtype)


# ---------------------------------------------------------------------------------------
# Triton kernel
# ---------------------------------------------------------------------------------------


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, ctx_ptr, o_ptr,
    qk_scale, G, D, block_size,
    stride_qb, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_tb,
    stride_ob, stride_oh,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr,
):
    """Program (b, kv head): o[b, kvh·G:(kvh+1)·G] over context_lens[b] paged tokens.

    qk_scale = scale · log2(e) (the softmax runs in base 2).
    """
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    ctx = tl.load(ctx_ptr + b)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_ok = g < G
    d_ok = d < D
    heads = kvh * G + g
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for t0 in range(0, ctx, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        t_ok = t < ctx
        phys = tl.load(table_ptr + b * stride_tb + t // block_size, mask=t_ok, other=0).to(tl.int64)
        slot = t % block_size
        kv_mask = t_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + phys[:, None] * stride_kb + slot[:, None] * stride_ks + kvh * stride_kh + d[None, :],
                    mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + phys[:, None] * stride_vb + slot[:, None] * stride_vs + kvh * stride_vh + d[None, :],
                    mask=kv_mask, other=0.0)
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
        s = tl.where(t_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # no context: acc = 0, out = 0
    tl.store(o_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :], out.to(o_ptr.dtype.element_ty),
             mask=g_ok[:, None] & d_ok[None, :])


# ---------------------------------------------------------------------------------------
# launcher
# ---------------------------------------------------------------------------------------


def decode_tiles(num_q_heads: int, num_kv_heads: int, head_dim: int) -> tuple[int, int]:
    """(BLOCK_G, BLOCK_D): query heads per kv head and head_dim, padded to powers of two >= 16
    (``tl.dot``'s smallest tile)."""
    return max(16, triton.next_power_of_2(num_q_heads // num_kv_heads)), max(16, triton.next_power_of_2(head_dim))


def _paged_attention_triton(q_BHD: Tensor, k_cache: Tensor, v_cache: Tensor, block_table_BM: Tensor,
                            context_lens_B: Tensor, scale: float, config: DecodeConfig = DECODE_CONFIG) -> Tensor:
    B, Hq, D = q_BHD.shape
    block_size, Hkv = k_cache.shape[1], k_cache.shape[2]
    out_BHD = torch.empty_like(q_BHD)
    if B == 0:
        return out_BHD
    block_g, block_d = decode_tiles(Hq, Hkv, D)
    q_BHD = q_BHD if q_BHD.stride(-1) == 1 else q_BHD.contiguous()
    table = block_table_BM.to(torch.int32)
    kernel = launcher(_paged_decode_kernel, q_BHD.device)
    kernel[(B, Hkv)](
        q_BHD, k_cache, v_cache, table, context_lens_B.to(torch.int32), out_BHD,
        scale * math.log2(math.e), Hq // Hkv, D, block_size,
        q_BHD.stride(0), q_BHD.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        table.stride(0),
        out_BHD.stride(0), out_BHD.stride(1),
        BLOCK_G=block_g, BLOCK_D=block_d, BLOCK_N=config.block_n,
        DOT_FP32=interpreting(kernel) or q_BHD.dtype == torch.float32,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out_BHD


# ---------------------------------------------------------------------------------------
# public API
# ---------------------------------------------------------------------------------------


def paged_attention_decode(q_BHD: Tensor, k_cache: Tensor, v_cache: Tensor, block_table_BM: Tensor,
                           context_lens_B: Tensor, scale: float | None = None) -> Tensor:
    """Attention of one new query token per sequence over its paged KV cache.

    Args:
        q_BHD: ``[B, Hq, D]`` queries.
        k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]`` (any strides on the first
            three dims, D contiguous), same dtype as ``q``; ``Hq % Hkv == 0``.
        block_table_BM: int ``[B, M]`` physical block of each logical block; only the first
            ``ceil(context_lens[b] / block_size)`` entries of row ``b`` are read.
        context_lens_B: int ``[B]`` cached tokens per sequence (0 allowed: zeros out).
        scale: softmax scale, default ``D ** -0.5``.

    Returns:
        ``o [B, Hq, D]`` in ``q``'s dtype.
    """
    if q_BHD.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"q must be [B, Hq, D] and k/v caches [num_blocks, block_size, Hkv, D], got "
                         f"{tuple(q_BHD.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    B, Hq, D = q_BHD.shape
    Hkv = k_cache.shape[2]
    if k_cache.shape[3] != D or Hq % Hkv != 0:
        raise ValueError(f"caches {tuple(k_cache.shape)} do not fit q {tuple(q_BHD.shape)}: need head_dim {D} "
                         f"and Hq a multiple of Hkv")
    if block_table_BM.dim() != 2 or block_table_BM.shape[0] != B or context_lens_B.shape != (B,):
        raise ValueError(f"block_table must be [B, M] and context_lens [B] with B = {B}, got "
                         f"{tuple(block_table_BM.shape)}, {tuple(context_lens_B.shape)}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache need a contiguous last (head_dim) dim")
    scale = D ** -0.5 if scale is None else scale
    if use_triton(q_BHD.device):
        return _paged_attention_triton(q_BHD, k_cache, v_cache, block_table_BM, context_lens_B, scale)
    return _paged_attention_torch(q_BHD, k_cache, v_cache, block_table_BM, context_lens_B, scale)
