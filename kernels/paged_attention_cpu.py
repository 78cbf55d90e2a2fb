"""Decode and prefill-chunk attention over a paged KV cache on CPU: small C++ loops that read every key
and value in place, beside the plain-torch references they must equal.

One query token per sequence; ``o[b, h] = softmax(scale · q[b, h] · K_bᵀ) V_b`` over the
``context_lens[b]`` cached tokens of sequence b, whose token t sits in cache slot
``slots[b, t]`` (the engine expands block tables to slots once per step:
``block_table[b, t // bs] · bs + t % bs``). Query head h reads kv head
``h // (Hq / Hkv)``. The cache is the engine's fused ``kv_PCHD`` [slots, 2 (k, v), Hkv, D], in
q's dtype or, under a float32 q, in bfloat16 (``rollout.kv_dtype``: half the bytes to stream;
each element is widened exactly to float32 as it is read, all arithmetic stays float32).

Why C++ on CPU: in torch, paged attention must first gather every sequence's keys into a
padded tensor (a copy of the whole KV cache per layer per step), which costs more than the
attention itself; this loop reads each key once, where it lies. The C++ is ``csrc/paged_attention.cpp``
(``torch.ops.jointrl.paged_decode`` / ``paged_prefill``, built by ``kernels/build``); where it cannot be
built ``paged_decode`` falls back to the torch reference. Measurements of each step below:
tests/bench/results.md, "C++ CPU kernels". Scores and softmax run in the input dtype (float32, or float64
for float64); the dot products may be summed in any order (vectorized), never with fast-math's finite-only
rules.
Per sequence, all heads at once, keys in tiles of 16 tokens with an online softmax (running max
and sum; the accumulator rescaled as each tile is added): a tile's key and value rows are read once,
together, while they sit in L1 -- the cache is streamed (every cached byte once per step). With AVX2
+ FMA (``JOINTRL_SIMD``) and head_dim a multiple of the vector width: scores for NK keys x NJ query
heads of one kv head per pass (NK · NJ = 8 floats / 4 doubles; all the GQA group's heads share each
loaded key vector), one vector accumulator per dot product, their lanes summed together at the end
instead of a horizontal sum per key; the weighted values with each head's accumulator in registers
across the tile, with AVX-512VL's 32 registers two heads of a GQA group per pass sharing each loaded
value vector (and the tile's max a vector reduction: both bit for bit the results without). While a tile
is worked on, the next tile this thread reads is prefetched into L2 line by line in address order, a few
lines between the steps of the scores' dot products, so that the requests go out at about the rate
memory answers them: issued in bursts (each kv head's part of the next tile as that head's work began,
as before) they filled the core's miss buffers, and the tile's own loads waited behind them. Without AVX2
+ FMA, or for other head_dims, a compiler-vectorized loop (a horizontal sum per dot product, four keys per
pass). With AVX-512 (the ``avx512`` build), a float32 query and head_dim a multiple of 16 the same loops run
on 16-float vectors (``Vec16``): the same FMAs in half the instructions, the loop being instruction bound
while a tile sits in cache; the result differs from the 8-float path's (the ``avx2`` build) in the last bits
only, the sums' order. exp vectorized (glibc's libmvec on x86-64, <= 4 ulp).

Shared prefixes: rows whose first keys sit in the same cache slots -- the samples of a GRPO group,
forked from one prompt (copy-on-write blocks), or prompts that hit the prefix cache -- are grouped
(up to 16 rows), and each tile of their common whole-tile prefix is worked on for every row of the group
in turn while it sits in L1, then each row's own keys. A row's result is the same bits either way (it adds
the same tiles in the same order; ``tests/kernels/test_paged_attention_cpu.py``). Parallel over
groups with torch's intra-op threads.

Prefill chunks (``paged_prefill``): the step's chunks in one call, each query attending causally to its
sequence's keys up to its own position, read in place through the chunk's slots -- no gather of the
keys, no mask tensor, no SDPA call per chunk. float32 queries only (a float32 or bfloat16 cache, head_dim a
multiple of 8); float64 (the exactness tests) and bfloat16 models run the torch reference, SDPA per chunk
on gathered keys. Per (chunk, kv head) its rows -- (query, head of the GQA group) pairs -- go 8 to a vector
register (16 with AVX-512), rows in lanes: their queries transposed once, so that a key's scores for a
vector of rows are one broadcast and one FMA per dimension (no horizontal sums), and the online softmax's
max, exp and sum run down the lanes, a vector of rows per instruction (with one accumulator per dot
product and a softmax per row, as decode does, the sums and the per-row softmax took about a third of the
time). Each lane's arithmetic is the same whatever the vector width (the same bits from 8 or 16 lanes).
Each tile of keys is read once for all the rows that see it, in blocks of 3 vectors of rows while it sits
in L1.

Attention sinks and a sliding window (gpt-oss, ``model/gpt_oss.py``): both ops take optional ``sinks_H`` [Hq]
(head h's logit joins every query's softmax denominator and attends to nothing:
``p_s = exp(s_s) / (Σ_s' exp(s_s') + exp(sinks_H[h]))``) and ``window`` (the query at position i sees keys j with
``i - window < j <= i``). The C++ kernels have neither: such calls run the torch references.

Shapes: B sequences, Hq/Hkv heads, D head_dim, P cache slots, S the longest context; C prefill chunks.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from jointrl.kernels.cpu_extension import load_ops

__all__ = ["paged_decode", "paged_decode_torch", "paged_prefill", "paged_prefill_torch", "load_kernel"]

@functools.cache
def load_kernel():
    """The ops (``kernels/cpu_extension.load_ops``), or None where they cannot be built here."""
    return load_ops(["paged_decode", "paged_prefill", "prefill_supported"])


def paged_decode_torch(q_BHD: Tensor, kv_PCHD: Tensor, slots_BS: Tensor, ctx_B: Tensor, scale: float,
                       sinks_H: Tensor | None = None, window: int | None = None) -> Tensor:
    """The reference: gather every sequence's keys/values (padded to S, masked), then softmax attention.
    ``sinks_H`` [Hq] (optional): a per-head logit that joins the softmax's denominator and attends to nothing;
    ``window`` (optional): the query at position ctx - 1 sees only keys j > ctx - 1 - window (module docstring)."""
    B, Hq, D = q_BHD.shape
    Hkv, S = kv_PCHD.shape[2], slots_BS.shape[1]
    kv_BSCHD = kv_PCHD.index_select(0, slots_BS.reshape(-1)).view(B, S, 2, Hkv, D).to(q_BHD.dtype)
    q_BHgD = q_BHD.view(B, Hkv, Hq // Hkv, D)
    scores_BHgS = torch.einsum("bhgd,bshd->bhgs", q_BHgD, kv_BSCHD[:, :, 0]) * scale
    s_1S = torch.arange(S, device=ctx_B.device)[None, :]
    pad_B11S = (s_1S >= ctx_B[:, None])[:, None, None, :]
    if window is not None:
        pad_B11S = pad_B11S | (s_1S <= (ctx_B - 1 - window)[:, None])[:, None, None, :]
    scores_BHgS = scores_BHgS.masked_fill(pad_B11S, -torch.inf)
    if sinks_H is None:
        p_BHgS = torch.softmax(scores_BHgS, dim=-1).nan_to_num(0.0)
    else:
        sink_BHg1 = sinks_H.to(scores_BHgS.dtype).view(1, Hkv, Hq // Hkv, 1).expand(B, -1, -1, 1)
        p_BHgS = torch.softmax(torch.cat((scores_BHgS, sink_BHg1), dim=-1), dim=-1)[..., :-1]
    return torch.einsum("bhgs,bshd->bhgd", p_BHgS, kv_BSCHD[:, :, 1]).reshape(B, Hq, D)


def paged_decode(q_BHD: Tensor, kv_PCHD: Tensor, slots_BS: Tensor, ctx_B: Tensor, scale: float,
                 sinks_H: Tensor | None = None, window: int | None = None) -> Tensor:
    """q [B, Hq, D], kv [P, 2, Hkv, D] (q's dtype, or bfloat16 under a float32 q; a bfloat16 q runs as float32), slots [B, S] int64
    (entries past ctx_B[b] unread), ctx [B] int64 → out [B, Hq, D]. The C++ kernel when it builds
    here, else the torch reference; with ``sinks_H`` or ``window`` (gpt-oss) always the reference (the C++
    kernel has neither)."""
    if q_BHD.dim() != 3 or kv_PCHD.dim() != 4 or kv_PCHD.shape[1] != 2 or slots_BS.shape[0] != q_BHD.shape[0]:
        raise ValueError(f"paged_decode: q [B, Hq, D], kv [P, 2, Hkv, D], slots [B, S]; got {tuple(q_BHD.shape)}, "
                         f"{tuple(kv_PCHD.shape)}, {tuple(slots_BS.shape)}")
    kernel = load_kernel()
    if kernel is None or sinks_H is not None or window is not None:
        return paged_decode_torch(q_BHD, kv_PCHD, slots_BS, ctx_B, scale, sinks_H, window)
    if q_BHD.dtype == torch.bfloat16 and kv_PCHD.dtype == torch.bfloat16:  # a bfloat16 model: the kernel's
        # bfloat16-cache path under a float32 q (the query widened exactly), the output rounded back
        return kernel.paged_decode(q_BHD.float().contiguous(), kv_PCHD, slots_BS.contiguous(), ctx_B.contiguous(),
                                   scale).to(torch.bfloat16)
    return kernel.paged_decode(q_BHD.contiguous(), kv_PCHD, slots_BS.contiguous(), ctx_B.contiguous(), scale)


def paged_prefill_torch(q_NHD: Tensor, kv_PCHD: Tensor, slots_CS: Tensor, start_C: Tensor, row0_C: Tensor,
                        count_C: Tensor, scale: float, out_NHD: Tensor, sinks_H: Tensor | None = None,
                        window: int | None = None) -> Tensor:
    """The reference: per chunk, its keys/values gathered (in q's dtype), a causal mask (and the window's:
    query at position i sees keys j > i - window), one SDPA call; with ``sinks_H`` [Hq] the softmax over the
    scores and each head's sink logit (dropped: it attends to nothing), in q's dtype."""
    Hq, Hkv = q_NHD.shape[1], kv_PCHD.shape[2]
    for j, (r0, n, c) in enumerate(zip(row0_C.tolist(), count_C.tolist(), start_C.tolist())):
        kv_SCHD = kv_PCHD.index_select(0, slots_CS[j, :c + n]).to(q_NHD.dtype)
        dev = q_NHD.device  # the references run on a GPU too (the triton table's prefill)
        s_1S, i_T1 = torch.arange(c + n, device=dev)[None, :], torch.arange(c, c + n, device=dev)[:, None]
        mask_TS = s_1S <= i_T1
        if window is not None:
            mask_TS = mask_TS & (s_1S > i_T1 - window)
        q_1HTD = q_NHD[r0:r0 + n].transpose(0, 1)[None]
        k_1HSD, v_1HSD = kv_SCHD[None, :, 0].transpose(1, 2), kv_SCHD[None, :, 1].transpose(1, 2)
        if sinks_H is None:
            out_1HTD = F.scaled_dot_product_attention(q_1HTD, k_1HSD, v_1HSD, attn_mask=mask_TS, scale=scale,
                                                      enable_gqa=Hq != Hkv)
        else:
            g = Hq // Hkv
            s_1HTS = torch.matmul(q_1HTD, k_1HSD.repeat_interleave(g, dim=1).transpose(2, 3)) * scale
            s_1HTS = s_1HTS.masked_fill(~mask_TS, -torch.inf)
            sink_1HT1 = sinks_H.to(s_1HTS.dtype).view(1, Hq, 1, 1).expand(1, Hq, n, 1)
            p_1HTS = torch.softmax(torch.cat((s_1HTS, sink_1HT1), dim=-1), dim=-1)[..., :-1]
            out_1HTD = torch.matmul(p_1HTS, v_1HSD.repeat_interleave(g, dim=1))
        out_NHD[r0:r0 + n] = out_1HTD[0].transpose(0, 1)
    return out_NHD


def paged_prefill(q_NHD: Tensor, kv_PCHD: Tensor, slots_CS: Tensor, start_C: Tensor, row0_C: Tensor,
                  count_C: Tensor, scale: float, out_NHD: Tensor, sinks_H: Tensor | None = None,
                  window: int | None = None) -> Tensor:
    """Causal attention of C prefill chunks over the paged cache, written into ``out_NHD``: chunk c's
    ``count_C[c]`` queries are rows ``row0_C[c] + i`` of q [N, Hq, D], at positions ``start_C[c] + i`` of a
    sequence whose token t sits in slot ``slots_CS[c, t]`` (int64, entries past start + count unread); query
    i sees keys 0 .. start + i. The C++ kernel for float32 queries (a float32 or bfloat16 cache, head_dim a
    multiple of 8, AVX2 + FMA), else the torch reference (SDPA per chunk); with ``sinks_H`` [Hq] or ``window``
    (``paged_prefill_torch``) always the reference."""
    kernel = load_kernel()
    if (kernel is None or not kernel.prefill_supported() or q_NHD.dtype != torch.float32
            or out_NHD.dtype != torch.float32 or q_NHD.shape[2] % 8 or not out_NHD.is_contiguous()
            or sinks_H is not None or window is not None):
        return paged_prefill_torch(q_NHD, kv_PCHD, slots_CS, start_C, row0_C, count_C, scale, out_NHD, sinks_H, window)
    kernel.paged_prefill(q_NHD.contiguous(), kv_PCHD, slots_CS.contiguous(), start_C.contiguous(),
                         row0_C.contiguous(), count_C.contiguous(), scale, out_NHD)
    return out_NHD
