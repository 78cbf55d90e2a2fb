"""Decode and prefill-chunk attention over a paged KV cache, with GQA.

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

Prefill chunks (``paged_prefill_triton``): ``paged_attention_cpu.paged_prefill_torch``'s contract -- the
engine's step of C chunks in one call, chunk c's ``count_C[c]`` queries at rows ``row0_C[c] + i`` of
``q [N, Hq, D]`` and positions ``start_C[c] + i`` of a sequence whose token t sits in slot
``slots_CS[c, t]`` of the fused ``[P, 2, Hkv, D]`` pool (its block table expanded to slots, i.e. a table of
one-slot blocks); query i sees keys ``0 .. start + i`` (its cached prefix and its own chunk, causally).
Kernel: one program per (tile of ``BLOCK_M`` rows of a chunk, kv head), a row being a (query, head of the
GQA group) pair -- row r of chunk c is query ``r // G``, head ``kvh·G + r % G`` -- so every key tile
loaded is used by all the group's heads of ``BLOCK_M / G`` queries. It walks the chunk's keys ``BLOCK_N`` at
a time up to the tile's last position (gathering slots; causal mask per row) with the same fp32 online
softmax and dot precision rules as decode; a cache in another dtype than q (a bfloat16 pool under a
float32 model) is converted tile by tile as it is read, never copied whole. The grid has
``ceil(N·G / BLOCK_M) + C`` programs along the rows (at least the sum over chunks of their tiles, known
without reading ``count_C`` on the host: no device sync); each program finds its chunk from a cumulative
sum of the chunks' tile counts, and the spare ones return at once. Rows of ``out`` outside the chunks
(the step's decode rows) are not written.

Attention sinks and a sliding window (gpt-oss; ``paged_attention_cpu``'s references define them): with
``sinks_H`` [Hq] each head's sink s_h joins the denominator once the keys are walked (the running max m taken
over it: ``l ← l·2^(m - m') + 2^(s_h·log2 e - m')``, the accumulator rescaled alike); with ``window`` the
query at position i sees keys j > i - window, and the walk starts at the first key any row of the program
sees (decode: ``ctx - window``; prefill: the tile's first row's), so tiles wholly outside the window are
never read. Both are constexpr switches: without them the kernels are today's.

Layout (kernels/ convention): torch reference, Triton kernels, launchers, public functions (the prefill's
reference is ``paged_attention_cpu.paged_prefill_torch``, the one the C++ kernel is tested against too).
Forward only (the engine does not differentiate).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from jointrl.kernels import paged_attention_cpu
from jointrl.kernels.dispatch import interpreting, launcher, use_triton

__all__ = ["DECODE_CONFIG", "PREFILL_CONFIG", "paged_attention_decode", "paged_prefill_triton"]


class DecodeConfig(NamedTuple):
    block_n: int  # context tokens per step
    num_warps: int
    num_stages: int


DECODE_CONFIG = DecodeConfig(block_n=64, num_warps=4, num_stages=2)


class PrefillConfig(NamedTuple):
    block_m: int  # (query, head) rows per program
    block_n: int  # keys per step
    num_warps: int
    num_stages: int


PREFILL_CONFIG = PrefillConfig(block_m=64, block_n=64, num_warps=4, num_stages=2)


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
def _softmax_tile(s, v, m_i, l_i, acc):
    """One key tile of the online softmax in base 2 (flash attention's update): scores ``s`` [R, N] (masked
    -inf), values ``v`` [N, D], running max ``m_i`` [R], denominator ``l_i`` [R], numerator ``acc`` [R, D]
    -> the three after this tile."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return m_new, l_i, acc


@triton.jit
def _sink_column(sink, m_i, l_i, acc):
    """A sink's column (base-2 logit ``sink`` [R], attending to nothing) joins the softmax: its exp joins the
    denominator, the running max is taken over it too (an empty context still gives 0, not NaN)."""
    m_new = tl.maximum(m_i, sink)
    alpha = tl.exp2(m_i - m_new)
    return m_new, l_i * alpha + tl.exp2(sink - m_new), acc * alpha[:, None]


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, ctx_ptr, o_ptr, sinks_ptr,
    qk_scale, G, D, block_size, window,
    stride_qb, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_tb,
    stride_ob, stride_oh,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr,
    SINKS: tl.constexpr, WINDOW: tl.constexpr,
):
    """Program (b, kv head): o[b, kvh·G:(kvh+1)·G] over context_lens[b] paged tokens (with WINDOW only the
    last ``window`` of them: the walk starts there; with SINKS each head's sink joins the denominator).

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
    lo = 0
    if WINDOW:
        lo = tl.maximum(ctx - window, 0)  # keys ctx - window .. ctx - 1
    for t0 in range(lo, ctx, BLOCK_N):
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
        m_i, l_i, acc = _softmax_tile(s, v, m_i, l_i, acc)
    if SINKS:  # the sink's exp(sink - m) joins the denominator (the running max taken over it too)
        sink = tl.load(sinks_ptr + heads, mask=g_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        m_i, l_i, acc = _sink_column(sink, m_i, l_i, acc)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # no context: acc = 0, out = 0
    tl.store(o_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :], out.to(o_ptr.dtype.element_ty),
             mask=g_ok[:, None] & d_ok[None, :])


@triton.jit
def _paged_prefill_kernel(
    q_ptr, kv_ptr, slots_ptr, start_ptr, row0_ptr, count_ptr, o_ptr, sinks_ptr,
    qk_scale, C, G, D, window,
    stride_qn, stride_qh,
    stride_kvp, stride_kvc, stride_kvh,
    stride_sc,
    stride_on, stride_oh,
    BLOCK_C: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_FP32: tl.constexpr, SINKS: tl.constexpr, WINDOW: tl.constexpr,
):
    """Program (row tile, kv head): rows ``tile·BLOCK_M ..`` of the chunk the tile falls in (module
    docstring). qk_scale = scale · log2(e). WINDOW: row at position i sees keys j > i - window, the walk
    starting at the tile's first row's first key; SINKS: each row's head's sink joins its denominator."""
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    cs = tl.arange(0, BLOCK_C)
    tiles_C = (tl.load(count_ptr + cs, mask=cs < C, other=0).to(tl.int32) * G + BLOCK_M - 1) // BLOCK_M
    ends_C = tl.cumsum(tiles_C, axis=0)
    if pid >= tl.sum(tiles_C):  # a spare program of the grid's upper bound
        return
    c = tl.sum((ends_C <= pid).to(tl.int32))
    tile = pid - tl.sum(tl.where(cs < c, tiles_C, 0))
    count = tl.load(count_ptr + c).to(tl.int32)
    start = tl.load(start_ptr + c)
    row0 = tl.load(row0_ptr + c)
    r = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    r_ok = r < count * G
    i = tl.minimum(r // G, count - 1)  # rows past the chunk repeat its last query, never stored
    heads = kvh * G + r % G
    pos = start + i
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q_mask = r_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + (row0 + i)[:, None] * stride_qn + heads[:, None] * stride_qh + d[None, :],
                mask=q_mask, other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    kv_end = start + tl.minimum((tile * BLOCK_M + BLOCK_M - 1) // G, count - 1) + 1  # the tile's keys
    lo = 0
    if WINDOW:
        lo = tl.maximum(start + (tile * BLOCK_M) // G - window + 1, 0)  # the first row's first visible key
    for t0 in range(lo, kv_end, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        t_ok = t < kv_end
        slot = tl.load(slots_ptr + c * stride_sc + t, mask=t_ok, other=0).to(tl.int64)
        kv_mask = t_ok[:, None] & d_ok[None, :]
        k_off = slot[:, None] * stride_kvp + kvh * stride_kvh + d[None, :]
        k = tl.load(kv_ptr + k_off, mask=kv_mask, other=0.0)
        v = tl.load(kv_ptr + stride_kvc + k_off, mask=kv_mask, other=0.0)
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        else:
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
        s = tl.where(t[None, :] <= pos[:, None], s, float("-inf"))  # causal; the row's own key is always visible
        if WINDOW:
            s = tl.where(t[None, :] > pos[:, None] - window, s, float("-inf"))
        m_i, l_i, acc = _softmax_tile(s, v, m_i, l_i, acc)
    if SINKS:  # as in decode
        sink = tl.load(sinks_ptr + heads).to(tl.float32) * 1.4426950408889634
        m_i, l_i, acc = _sink_column(sink, m_i, l_i, acc)
    out = acc / l_i[:, None]
    tl.store(o_ptr + (row0 + i)[:, None] * stride_on + heads[:, None] * stride_oh + d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=q_mask)


# ---------------------------------------------------------------------------------------
# launcher
# ---------------------------------------------------------------------------------------


def decode_tiles(num_q_heads: int, num_kv_heads: int, head_dim: int) -> tuple[int, int]:
    """(BLOCK_G, BLOCK_D): query heads per kv head and head_dim, padded to powers of two >= 16
    (``tl.dot``'s smallest tile)."""
    return max(16, triton.next_power_of_2(num_q_heads // num_kv_heads)), max(16, triton.next_power_of_2(head_dim))


def _paged_attention_triton(q_BHD: Tensor, k_cache: Tensor, v_cache: Tensor, block_table_BM: Tensor,
                            context_lens_B: Tensor, scale: float, config: DecodeConfig = DECODE_CONFIG,
                            sinks_H: Tensor | None = None, window: int | None = None) -> Tensor:
    B, Hq, D = q_BHD.shape
    block_size, Hkv = k_cache.shape[1], k_cache.shape[2]
    out_BHD = torch.empty_like(q_BHD)
    if B == 0:
        return out_BHD
    block_g, block_d = decode_tiles(Hq, Hkv, D)
    q_BHD = q_BHD if q_BHD.stride(-1) == 1 else q_BHD.contiguous()
    table = block_table_BM.to(torch.int32)
    kernel = launcher(_paged_decode_kernel, q_BHD.device)
    sinks = q_BHD if sinks_H is None else sinks_H.to(torch.float32).contiguous()  # unread without SINKS
    kernel[(B, Hkv)](
        q_BHD, k_cache, v_cache, table, context_lens_B.to(torch.int32), out_BHD, sinks,
        scale * math.log2(math.e), Hq // Hkv, D, block_size, window or 0,
        q_BHD.stride(0), q_BHD.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        table.stride(0),
        out_BHD.stride(0), out_BHD.stride(1),
        BLOCK_G=block_g, BLOCK_D=block_d, BLOCK_N=config.block_n,
        DOT_FP32=interpreting(kernel) or q_BHD.dtype == torch.float32,
        SINKS=sinks_H is not None, WINDOW=window is not None,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out_BHD


def prefill_tiles(num_chunks: int, head_dim: int) -> tuple[int, int]:
    """(BLOCK_C, BLOCK_D): the chunk count and head_dim padded to powers of two >= 16."""
    return max(16, triton.next_power_of_2(num_chunks)), max(16, triton.next_power_of_2(head_dim))


def _paged_prefill_triton(q_NHD: Tensor, kv_PCHD: Tensor, slots_CS: Tensor, start_C: Tensor, row0_C: Tensor,
                          count_C: Tensor, scale: float, out_NHD: Tensor,
                          config: PrefillConfig = PREFILL_CONFIG, sinks_H: Tensor | None = None,
                          window: int | None = None) -> Tensor:
    N, Hq, D = q_NHD.shape
    C, Hkv = slots_CS.shape[0], kv_PCHD.shape[2]
    if C == 0 or N == 0:
        return out_NHD
    G = Hq // Hkv
    block_c, block_d = prefill_tiles(C, D)
    q_NHD = q_NHD if q_NHD.stride(-1) == 1 else q_NHD.contiguous()
    kernel = launcher(_paged_prefill_kernel, q_NHD.device)
    sinks = q_NHD if sinks_H is None else sinks_H.to(torch.float32).contiguous()  # unread without SINKS
    kernel[(triton.cdiv(N * G, config.block_m) + C, Hkv)](
        q_NHD, kv_PCHD, slots_CS, start_C, row0_C, count_C, out_NHD, sinks,
        scale * math.log2(math.e), C, G, D, window or 0,
        q_NHD.stride(0), q_NHD.stride(1),
        kv_PCHD.stride(0), kv_PCHD.stride(1), kv_PCHD.stride(2),
        slots_CS.stride(0),
        out_NHD.stride(0), out_NHD.stride(1),
        BLOCK_C=block_c, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_D=block_d,
        DOT_FP32=interpreting(kernel) or q_NHD.dtype == torch.float32,
        SINKS=sinks_H is not None, WINDOW=window is not None,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out_NHD


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


def paged_prefill_triton(q_NHD: Tensor, kv_PCHD: Tensor, slots_CS: Tensor, start_C: Tensor, row0_C: Tensor,
                         count_C: Tensor, scale: float, out_NHD: Tensor, sinks_H: Tensor | None = None,
                         window: int | None = None) -> Tensor:
    """Causal attention of C prefill chunks over the engine's paged pool, written into ``out_NHD``
    (``paged_attention_cpu.paged_prefill``'s contract, the triton op table's ``paged_prefill``).

    Args:
        q_NHD: ``[N, Hq, D]`` queries; chunk c's are rows ``row0_C[c] .. row0_C[c] + count_C[c]``.
        kv_PCHD: ``[P, 2, Hkv, D]`` the pool (slot p's key and value; any strides, D contiguous), in q's
            dtype or another float dtype (converted as read); ``Hq % Hkv == 0``.
        slots_CS: int64 ``[C, S]`` slot of each token of chunk c's sequence; entries past
            ``start_C[c] + count_C[c]`` are not read.
        start_C, row0_C, count_C: int64 ``[C]`` the chunk's first position, first row of q, query count
            (any strides: the engine passes the columns of one [C, 3] tensor).
        scale: softmax scale.
        out_NHD: ``[N, Hq, D]`` (D contiguous): the chunks' rows are written, the others left as they are.
        sinks_H: optional ``[Hq]`` per-head sink logits (join the softmax denominator, attend to nothing).
        window: optional sliding window: the query at position i sees keys j with ``i - window < j <= i``.

    Returns:
        ``out_NHD``. Float64 queries run the reference (the kernel works in fp32).
    """
    if q_NHD.dim() != 3 or kv_PCHD.dim() != 4 or kv_PCHD.shape[1] != 2 or out_NHD.shape != q_NHD.shape:
        raise ValueError(f"paged_prefill: q and out [N, Hq, D], kv [P, 2, Hkv, D]; got {tuple(q_NHD.shape)}, "
                         f"{tuple(out_NHD.shape)}, {tuple(kv_PCHD.shape)}")
    Hq, D = q_NHD.shape[1:]
    if kv_PCHD.shape[3] != D or Hq % kv_PCHD.shape[2]:
        raise ValueError(f"paged_prefill: kv {tuple(kv_PCHD.shape)} does not fit q {tuple(q_NHD.shape)}: need "
                         f"head_dim {D} and Hq a multiple of Hkv")
    C = slots_CS.shape[0]
    if slots_CS.dim() != 2 or not start_C.shape == row0_C.shape == count_C.shape == (C,):
        raise ValueError(f"paged_prefill: slots [C, S] and start, row0, count [C]; got {tuple(slots_CS.shape)}, "
                         f"{tuple(start_C.shape)}, {tuple(row0_C.shape)}, {tuple(count_C.shape)}")
    if kv_PCHD.stride(-1) != 1 or out_NHD.stride(-1) != 1:
        raise ValueError("paged_prefill: kv and out need a contiguous last (head_dim) dim")
    if q_NHD.dtype == torch.float64:
        return paged_attention_cpu.paged_prefill_torch(q_NHD, kv_PCHD, slots_CS, start_C, row0_C, count_C, scale,
                                                       out_NHD, sinks_H, window)
    return _paged_prefill_triton(q_NHD, kv_PCHD, slots_CS.contiguous(), start_C.contiguous(), row0_C.contiguous(),
                                 count_C.contiguous(), scale, out_NHD, sinks_H=sinks_H, window=window)
