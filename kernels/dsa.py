"""DeepSeek sparse attention (gated DSA): lightning-indexer scores and attention over the
selected keys, as Triton kernels beside their torch references.

* ``indexer_scores(q_BTnD, w_BTn, k_BSD)``: ``I[b, t, s] = Σ_j w[b, t, j] · ReLU(q_j[b, t] · k[b, s]
  / √Di)``, fp32. Visibility (causality, padding) is the caller's mask on the result.
* ``select_topk(scores_BTS, visible_BTS, k)`` (``kernels/topk.py``, re-exported here): the k
  visible keys with the largest scores, ties to the most recent key (``topk.topk_mask``'s
  rule), as ids ``[B, T, k]`` in position order padded with -1.
* ``sparse_attention(q_BTHD, k_BSHD, v_BSHD, ids_BTk)``: ``o[b, t, h] = softmax_i(q·k_{ids[i]} ·
  scale) v_{ids[i]}`` over the selected keys (-1 entries skipped; a query with none gets zeros),
  GQA (query head h reads kv head ``h // (Hq / Hkv)``), forward and backward
  (``torch.autograd.Function``). The selection is shared by all heads of a token, as in DSA.

The op table (``kernels/ops``) gives the gated_dsa layer (``model/dsa.py``, per query chunk of c queries,
keys [B, S, Hkv, D]) ``dsa_scores`` (``indexer_scores_torch``, the one reference of the indexer; Triton for
inference: the kernel is forward only, so the indexer loss trains through the reference), ``dsa_select``
(``topk.select_keys_torch`` / ``_triton``) and ``dsa_attend`` (``sparse_attention_torch``, the one reference
of the sparse attention, which ``sparse_attention``'s own layout wraps; on Triton the forward and backward
kernels, with the probabilities the indexer loss needs recomputed by the reference without gradient).

Kernels: the indexer runs one ``[BLOCK_T, BLOCK_S]`` tile per program, one ``tl.dot`` per indexer
head. Sparse attention runs one program per (token, kv head) with that group's query heads as
a ``[BLOCK_G >= 16, BLOCK_D]`` tile and gathers ``BLOCK_N`` selected keys per step (online
softmax, log-sum-exp saved); the backward recomputes the probabilities from the saved
log-sum-exp and scatters dK, dV with fp32 atomic adds (selected keys are shared between
queries), so dK/dV are not bit-deterministic on GPU. Under the interpreter the dots run in
fp32 (its bf16 ``tl.dot`` is broken); on CUDA bf16 operands go to ``tl.dot`` directly.

Layout (kernels/ convention): torch references, Triton kernels, launchers, autograd Function,
public functions.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from jointrl.kernels.dispatch import interpreting, launcher, use_triton
from jointrl.kernels.topk import select_topk

__all__ = ["INDEXER_CONFIG", "SPARSE_CONFIG", "indexer_scores", "indexer_scores_torch", "indexer_scores_triton",
           "select_topk", "sparse_attention", "sparse_attention_torch", "sparse_attention_triton",
           "sparse_probs_torch", "sparse_values_torch"]


class IndexerConfig(NamedTuple):
    block_t: int
    block_s: int
    num_warps: int


class SparseConfig(NamedTuple):
    block_n: int  # selected keys per step
    num_warps: int


INDEXER_CONFIG = IndexerConfig(block_t=64, block_s=64, num_warps=4)
SPARSE_CONFIG = SparseConfig(block_n=32, num_warps=4)


def _tiles_gd(hq: int, hkv: int, d: int) -> tuple[int, int]:
    return max(16, triton.next_power_of_2(hq // hkv)), max(16, triton.next_power_of_2(d))


# ---------------------------------------------------------------------------------------
# plain-torch references
# ---------------------------------------------------------------------------------------


def indexer_scores_torch(q_BcnD: Tensor, w_Bcn: Tensor, k_BSD: Tensor) -> Tensor:
    """The reference (the gated_dsa layer's indexer): I [B, c, S] = Σ_j w[·, j] · ReLU(q_j · k / √Di), in
    float64 if q or w is float64, else float32; differentiable."""
    cdt = torch.float64 if torch.float64 in (q_BcnD.dtype, w_Bcn.dtype) else torch.float32
    B, c, n, D = q_BcnD.shape
    # Two plain batched matmuls; the 1/√Di goes after the head sum (ReLU(s·x) = s·ReLU(x), s > 0),
    # on [B, c, S] instead of [B, c, n, S].
    dots_BcnS = torch.matmul(q_BcnD.to(cdt).reshape(B, c * n, D), k_BSD.to(cdt).transpose(1, 2)).view(B, c, n, -1)
    return torch.matmul(w_Bcn.to(cdt).unsqueeze(2), F.relu(dots_BcnS)).squeeze(2) * D ** -0.5


def _gather_rows(x_BSKD: Tensor, idx_Bck: Tensor) -> Tensor:
    """Each query's selected keys (or values) [B, Hkv, c, k, D] from x [B, S, Hkv, D] contiguous, read as
    [B·S, Hkv·D] rows (an index_select of whole rows, several times faster than a gather over an
    expanded index)."""
    B, S, Hkv, D = x_BSKD.shape
    c, k = idx_Bck.shape[1:]
    rows = (idx_Bck + torch.arange(B, device=idx_Bck.device)[:, None, None] * S).reshape(-1)
    return x_BSKD.reshape(B * S, Hkv * D).index_select(0, rows).view(B, c, k, Hkv, D).permute(0, 3, 1, 2, 4)


def sparse_probs_torch(q_BHcD: Tensor, k_BSKD: Tensor, idx_Bck: Tensor, valid_Bck: Tensor, scale: float) -> Tensor:
    """softmax over each query's selected keys of q·k·scale, [B, Hq, c, k] in float32 (float64 for float64 q;
    GQA by grouping); all 0 where a query has no key (as a fully masked SDPA row gives 0), finite gradients."""
    B, Hq, c, D = q_BHcD.shape
    Hkv = k_BSKD.shape[2]
    cdt = torch.float64 if q_BHcD.dtype == torch.float64 else torch.float32
    q_BKGcD = (q_BHcD * scale).view(B, Hkv, Hq // Hkv, c, D)
    logits = torch.einsum("bkgcd,bkcjd->bkgcj", q_BKGcD, _gather_rows(k_BSKD, idx_Bck)).reshape(B, Hq, c, -1)
    logits = logits.to(cdt).masked_fill(~valid_Bck[:, None], torch.finfo(cdt).min)
    return torch.softmax(logits, dim=-1) * valid_Bck[:, None]


def sparse_values_torch(probs_BHck: Tensor, v_BSKD: Tensor, idx_Bck: Tensor) -> Tensor:
    """Σ_j probs[·, j] · v_{idx[j]} → [B, Hq, c, D] in v's dtype (probs cast to it)."""
    B, Hq, c, k = probs_BHck.shape
    Hkv = v_BSKD.shape[2]
    p_BKGck = probs_BHck.to(v_BSKD.dtype).view(B, Hkv, Hq // Hkv, c, k)
    return torch.einsum("bkgcj,bkcjd->bkgcd", p_BKGck, _gather_rows(v_BSKD, idx_Bck)).reshape(B, Hq, c, -1)


def sparse_attention_torch(q_BHcD: Tensor, k_BSKD: Tensor, v_BSKD: Tensor, idx_Bck: Tensor, valid_Bck: Tensor,
                           want_probs: bool) -> tuple[Tensor, Tensor | None]:
    """The op table's ``dsa_attend`` reference (the gated_dsa layer's sparse attention, scale 1/√D):
    → (o [B, Hq, c, D] in v's dtype, probs [B, Hq, c, k] — the attention weights, returned for the
    indexer loss — or None without ``want_probs``); differentiable in q, k, v."""
    probs = sparse_probs_torch(q_BHcD, k_BSKD, idx_Bck, valid_Bck, q_BHcD.shape[-1] ** -0.5)
    return sparse_values_torch(probs, v_BSKD, idx_Bck), probs if want_probs else None


def _sparse_attention_torch(q_BTHD: Tensor, k_BSHD: Tensor, v_BSHD: Tensor, ids_BTk: Tensor, scale: float) -> Tensor:
    """``sparse_attention``'s layout of the reference (``sparse_probs_torch``, ``sparse_values_torch``), computed
    in float32 (float64 for float64); differentiable."""
    work = torch.float64 if q_BTHD.dtype == torch.float64 else torch.float32
    valid_BTk = ids_BTk >= 0
    idx_BTk = ids_BTk.clamp_min(0).long()
    probs = sparse_probs_torch(q_BTHD.transpose(1, 2).to(work), k_BSHD.to(work).contiguous(), idx_BTk, valid_BTk,
                               scale)
    o_BHTD = sparse_values_torch(probs, v_BSHD.to(work).contiguous(), idx_BTk)
    return o_BHTD.transpose(1, 2).to(q_BTHD.dtype)


# ---------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------


@triton.jit
def _indexer_kernel(
    q_ptr, w_ptr, k_ptr, out_ptr, T, S, NH, Di, scale,
    BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, DOT_FP32: tl.constexpr,
):
    """q [B, T, NH, Di], w [B, T, NH], k [B, S, Di] -> out fp32 [B, T, S]."""
    b = tl.program_id(0)
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    s = tl.program_id(2) * BLOCK_S + tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    t_ok, s_ok, d_ok = t < T, s < S, d < Di
    b64 = b.to(tl.int64)
    k = tl.load(k_ptr + (b64 * S + s)[:, None] * Di + d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_FP32:
        k = k.to(tl.float32)
    acc = tl.zeros([BLOCK_T, BLOCK_S], tl.float32)
    for j in range(NH):
        row = (b64 * T + t) * NH + j
        q = tl.load(q_ptr + row[:, None] * Di + d[None, :], mask=t_ok[:, None] & d_ok[None, :], other=0.0)
        if DOT_FP32:
            q = q.to(tl.float32)
        w = tl.load(w_ptr + row, mask=t_ok, other=0.0).to(tl.float32)
        dots = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        acc += w[:, None] * tl.maximum(dots, 0.0)
    tl.store(out_ptr + (b64 * T + t)[:, None] * S + s[None, :], acc, mask=t_ok[:, None] & s_ok[None, :])


@triton.jit
def _sparse_fwd_kernel(
    q_ptr, k_ptr, v_ptr, ids_ptr, o_ptr, lse_ptr,
    T, S, Hq, Hkv, D, NK, scale,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr,
):
    """Program (b·T + t, kv head): q/o [B, T, Hq, D], k/v [B, S, Hkv, D], ids [B, T, NK],
    lse fp32 [B, T, Hq] (natural log; -inf for a query with no key)."""
    bt = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    b = bt // T
    G = Hq // Hkv
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_ok, d_ok = g < G, d < D
    heads = kvh * G + g
    q = tl.load(q_ptr + (bt * Hq + heads)[:, None] * D + d[None, :], mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    qk_scale = scale * 1.4426950408889634  # softmax in base 2
    for n0 in range(0, NK, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        idx = tl.load(ids_ptr + bt * NK + n, mask=n < NK, other=-1)
        sel = idx >= 0
        rows = (b * S + tl.maximum(idx, 0)) * Hkv + kvh
        kv_mask = sel[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + rows[:, None] * D + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + rows[:, None] * D + d[None, :], mask=kv_mask, other=0.0)
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
        s = tl.where(sel[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(o_ptr + (bt * Hq + heads)[:, None] * D + d[None, :], o.to(o_ptr.dtype.element_ty),
             mask=g_ok[:, None] & d_ok[None, :])
    lse = tl.where(l_i > 0, (m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    tl.store(lse_ptr + bt * Hq + heads, lse, mask=g_ok)


@triton.jit
def _sparse_bwd_kernel(
    q_ptr, k_ptr, v_ptr, ids_ptr, o_ptr, do_ptr, lse_ptr, dq_ptr, dk_ptr, dv_ptr,
    T, S, Hq, Hkv, D, NK, scale,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr,
):
    """Program (b·T + t, kv head): dq [B, T, Hq, D]; dk, dv fp32 [B, S, Hkv, D] by atomic adds.

    p = exp(s - lse); dp = do vᵀ; ds = p ⊙ (dp − rowsum(do ⊙ o)); dq = scale · ds k;
    dk += scale · dsᵀ q; dv += pᵀ do.
    """
    bt = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    b = bt // T
    G = Hq // Hkv
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_ok, d_ok = g < G, d < D
    heads = kvh * G + g
    qo_offs = (bt * Hq + heads)[:, None] * D + d[None, :]
    qo_mask = g_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + qo_offs, mask=qo_mask, other=0.0)
    do = tl.load(do_ptr + qo_offs, mask=qo_mask, other=0.0)
    o = tl.load(o_ptr + qo_offs, mask=qo_mask, other=0.0).to(tl.float32)
    if DOT_FP32:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    delta = tl.sum(do.to(tl.float32) * o, axis=1)
    lse = tl.load(lse_ptr + bt * Hq + heads, mask=g_ok, other=float("-inf"))
    lse = tl.where(lse == float("-inf"), float("inf"), lse)  # no key: p = exp(-inf) = 0
    dq = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for n0 in range(0, NK, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        idx = tl.load(ids_ptr + bt * NK + n, mask=n < NK, other=-1)
        sel = idx >= 0
        rows = (b * S + tl.maximum(idx, 0)) * Hkv + kvh
        kv_mask = sel[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + rows[:, None] * D + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + rows[:, None] * D + d[None, :], mask=kv_mask, other=0.0)
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        p = tl.where(sel[None, :], tl.exp(s - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision="ieee")
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision="ieee")
        dk = tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision="ieee") * scale
        dv = tl.dot(tl.trans(p.to(do.dtype)), do, input_precision="ieee")
        tl.atomic_add(dk_ptr + rows[:, None] * D + d[None, :], dk, mask=kv_mask)
        tl.atomic_add(dv_ptr + rows[:, None] * D + d[None, :], dv, mask=kv_mask)
    tl.store(dq_ptr + qo_offs, (dq * scale).to(dq_ptr.dtype.element_ty), mask=qo_mask)


# ---------------------------------------------------------------------------------------
# launchers
# ---------------------------------------------------------------------------------------


def _indexer_scores_triton(q_BTnD: Tensor, w_BTn: Tensor, k_BSD: Tensor, config: IndexerConfig = INDEXER_CONFIG) -> Tensor:
    B, T, NH, Di = q_BTnD.shape
    S = k_BSD.shape[1]
    out = torch.empty(B, T, S, dtype=torch.float32, device=q_BTnD.device)
    if out.numel() == 0:
        return out
    kernel = launcher(_indexer_kernel, q_BTnD.device)
    grid = (B, triton.cdiv(T, config.block_t), triton.cdiv(S, config.block_s))
    kernel[grid](q_BTnD.contiguous(), w_BTn.contiguous(), k_BSD.contiguous(), out, T, S, NH, Di, Di**-0.5,
                 BLOCK_T=config.block_t, BLOCK_S=config.block_s, BLOCK_D=max(16, triton.next_power_of_2(Di)),
                 DOT_FP32=interpreting(kernel) or q_BTnD.dtype == torch.float32, num_warps=config.num_warps)
    return out


def _sparse_fwd_triton(q, k, v, ids, scale, config: SparseConfig = SPARSE_CONFIG):
    B, T, Hq, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    o = torch.empty_like(q)
    lse = torch.empty(B, T, Hq, dtype=torch.float32, device=q.device)
    if B * T == 0:
        return o, lse
    block_g, block_d = _tiles_gd(Hq, Hkv, D)
    kernel = launcher(_sparse_fwd_kernel, q.device)
    kernel[(B * T, Hkv)](q, k, v, ids, o, lse, T, S, Hq, Hkv, D, ids.shape[-1], scale,
                         BLOCK_G=block_g, BLOCK_D=block_d, BLOCK_N=config.block_n,
                         DOT_FP32=interpreting(kernel) or q.dtype == torch.float32, num_warps=config.num_warps)
    return o, lse


def _sparse_bwd_triton(q, k, v, ids, o, do, lse, scale, config: SparseConfig = SPARSE_CONFIG):
    B, T, Hq, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    dq = torch.empty_like(q)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    if B * T:
        block_g, block_d = _tiles_gd(Hq, Hkv, D)
        kernel = launcher(_sparse_bwd_kernel, q.device)
        kernel[(B * T, Hkv)](q, k, v, ids, o, do, lse, dq, dk, dv, T, S, Hq, Hkv, D, ids.shape[-1], scale,
                             BLOCK_G=block_g, BLOCK_D=block_d, BLOCK_N=config.block_n,
                             DOT_FP32=interpreting(kernel) or q.dtype == torch.float32, num_warps=config.num_warps)
    else:
        dq.zero_()
    return dq, dk.to(k.dtype), dv.to(v.dtype)


class _SparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ids, scale):
        q, k, v, ids = q.contiguous(), k.contiguous(), v.contiguous(), ids.to(torch.int32).contiguous()
        o, lse = _sparse_fwd_triton(q, k, v, ids, scale)
        ctx.save_for_backward(q, k, v, ids, o, lse)
        ctx.scale = scale
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, ids, o, lse = ctx.saved_tensors
        dq, dk, dv = _sparse_bwd_triton(q, k, v, ids, o, do.contiguous(), lse, ctx.scale)
        return dq, dk, dv, None, None


# ---------------------------------------------------------------------------------------
# public API
# ---------------------------------------------------------------------------------------


def indexer_scores(q_BTnD: Tensor, w_BTn: Tensor, k_BSD: Tensor) -> Tensor:
    """Lightning-indexer scores (forward only: the indexer trains through the torch path).

    Args:
        q_BTnD: ``[B, T, n, Di]`` indexer queries; w_BTn: ``[B, T, n]`` head weights;
        k_BSD: ``[B, S, Di]`` indexer keys.

    Returns:
        ``I [B, T, S]`` fp32 (float64 for float64 queries), unmasked.
    """
    if q_BTnD.dim() != 4 or w_BTn.shape != q_BTnD.shape[:3] or k_BSD.dim() != 3 \
            or k_BSD.shape[0] != q_BTnD.shape[0] or k_BSD.shape[2] != q_BTnD.shape[3]:
        raise ValueError(f"indexer_scores needs q [B, T, n, Di], w [B, T, n], k [B, S, Di]; got "
                         f"{tuple(q_BTnD.shape)}, {tuple(w_BTn.shape)}, {tuple(k_BSD.shape)}")
    if q_BTnD.dtype != torch.float64 and use_triton(q_BTnD.device):
        return _indexer_scores_triton(q_BTnD, w_BTn, k_BSD)
    return indexer_scores_torch(q_BTnD, w_BTn, k_BSD)


def sparse_attention(q_BTHD: Tensor, k_BSHD: Tensor, v_BSHD: Tensor, ids_BTk: Tensor,
                     scale: float | None = None) -> Tensor:
    """Attention of each query over its selected keys (module docstring); differentiable in q, k, v.

    Args:
        q_BTHD: ``[B, T, Hq, D]``; k_BSHD, v_BSHD: ``[B, S, Hkv, D]``, ``Hq % Hkv == 0``.
        ids_BTk: int ``[B, T, k]`` selected key positions in ``[0, S)``, -1 for none; distinct
            within a row.
        scale: default ``D ** -0.5``.

    Returns:
        ``o [B, T, Hq, D]`` in q's dtype.
    """
    if q_BTHD.dim() != 4 or k_BSHD.dim() != 4 or v_BSHD.shape != k_BSHD.shape or k_BSHD.shape[0] != q_BTHD.shape[0] \
            or k_BSHD.shape[3] != q_BTHD.shape[3] or q_BTHD.shape[2] % k_BSHD.shape[2] != 0:
        raise ValueError(f"sparse_attention needs q [B, T, Hq, D] and k, v [B, S, Hkv, D] with Hq % Hkv == 0; got "
                         f"{tuple(q_BTHD.shape)}, {tuple(k_BSHD.shape)}, {tuple(v_BSHD.shape)}")
    if ids_BTk.dim() != 3 or ids_BTk.shape[:2] != q_BTHD.shape[:2]:
        raise ValueError(f"ids must be [B, T, k] = [{q_BTHD.shape[0]}, {q_BTHD.shape[1]}, k], got {tuple(ids_BTk.shape)}")
    scale = q_BTHD.shape[-1] ** -0.5 if scale is None else scale
    if q_BTHD.dtype != torch.float64 and use_triton(q_BTHD.device):
        return _SparseAttention.apply(q_BTHD, k_BSHD, v_BSHD, ids_BTk, scale)
    return _sparse_attention_torch(q_BTHD, k_BSHD, v_BSHD, ids_BTk, scale)


def sparse_attention_triton(q_BHcD: Tensor, k_BSKD: Tensor, v_BSKD: Tensor, idx_Bck: Tensor, valid_Bck: Tensor,
                            want_probs: bool) -> tuple[Tensor, Tensor | None]:
    """``sparse_attention_torch``'s contract on the sparse-attention kernels (forward and backward through
    ``_SparseAttention``); ``want_probs``: the probabilities come from the reference without gradient (the
    indexer loss uses them detached). Float64 takes the reference."""
    if q_BHcD.dtype == torch.float64:
        return sparse_attention_torch(q_BHcD, k_BSKD, v_BSKD, idx_Bck, valid_Bck, want_probs)
    ids_Bck = torch.where(valid_Bck, idx_Bck, -1)
    dt = q_BHcD.dtype  # the kernels read q, k and v in one dtype (a cache may hold keys in another)
    o_BcHD = _SparseAttention.apply(q_BHcD.transpose(1, 2), k_BSKD.to(dt), v_BSKD.to(dt), ids_Bck,
                                    q_BHcD.shape[-1] ** -0.5)
    probs = None
    if want_probs:
        with torch.no_grad():
            probs = sparse_probs_torch(q_BHcD, k_BSKD, idx_Bck, valid_Bck, q_BHcD.shape[-1] ** -0.5)
    return o_BcHD.transpose(1, 2).to(v_BSKD.dtype), probs


def indexer_scores_triton(q_BcnD: Tensor, w_Bcn: Tensor, k_BSD: Tensor) -> Tensor:
    """``indexer_scores_torch``'s contract on the indexer kernel when no gradient is needed (the kernel is
    forward only: the indexer trains through the reference) and nothing is float64."""
    if torch.float64 in (q_BcnD.dtype, w_Bcn.dtype) or (
            torch.is_grad_enabled() and any(t.requires_grad for t in (q_BcnD, w_Bcn, k_BSD))):
        return indexer_scores_torch(q_BcnD, w_Bcn, k_BSD)
    return _indexer_scores_triton(q_BcnD, w_Bcn, k_BSD)
