"""Kimi Delta Attention (KDA): the recurrent step (decode) and the chunked form (prefill and
training, forward and backward) as Triton kernels.

Per head, with q, k already L2-normalised (``model/kda.py`` does that, and the short conv),
q scaled by ``K^-1/2`` here, channel-wise log-decay ``g_t ∈ R^K`` (≤ 0) and ``β_t`` a scalar:

    S_t = (I − β_t k_t k_tᵀ) · diag(exp(g_t)) · S_{t−1} + β_t k_t v_tᵀ        S ∈ R^{K×V}
    o_t = S_tᵀ q_t

computed as ``S ← exp(g) ⊙ S; Δ = β (v − Sᵀ k); S ← S + k Δᵀ; o = Sᵀ q`` token by token, the same
order of operations as ``model.kda.kda_recurrent``. The kernel keeps a ``[K, BLOCK_V]`` slice of
the state in registers for all T tokens (one program per (batch, head, value block)), so a
decode step reads the state once and writes it once. ``kda_chunk`` computes the same
recurrence 16 tokens at a time in the WY form (``model.kda.kda_chunked``'s algebra: per chunk a
16×16 unit-triangular inverse by forward substitution, then matmuls against the state), one
program per (batch, head, value block) walking the chunks in order.

Its backward (an ``autograd.Function``) follows flash-linear-attention's plan for
``chunk_kda``'s backward in a simpler shape: first recompute the state entering every chunk
(the forward kernel with ``STATES_ONLY``), then one program per (batch, head, value block)
walks the chunks in reverse, carrying ∂L/∂state, and differentiates each chunk's WY
algebra by hand (the formulas are in ``_kda_chunk_bwd_kernel``). fla splits this into
several kernels that run the chunks in parallel and only the state gradient sequentially;
here the whole chunk backward is sequential per program (less parallel, one launch).

Everything is computed in fp32 (the public functions send float64 inputs to the torch
reference; the private launchers run float64 in the kernels too, which the interpreter tests
use to check the algebra); o and the final state come back in fp32, as the model's reference
returns them, and gradients in their inputs' dtypes.

Layout (kernels/ convention): torch reference, Triton kernels, launchers, autograd Function,
public functions.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from jointrl.kernels.dispatch import launcher, use_triton

__all__ = ["CHUNK_BWD_CONFIG", "CHUNK_CONFIG", "RECURRENT_CONFIG", "kda_chunk", "kda_chunk_torch", "kda_chunk_triton",
           "kda_recurrent", "kda_recurrent_torch", "kda_recurrent_triton"]


class RecurrentConfig(NamedTuple):
    block_v: int  # value columns of the state per program
    num_warps: int


RECURRENT_CONFIG = RecurrentConfig(block_v=32, num_warps=4)


class ChunkConfig(NamedTuple):
    chunk: int  # tokens per WY step (exp(-Γ) over a chunk must stay finite in fp32)
    block_v: int
    num_warps: int


CHUNK_CONFIG = ChunkConfig(chunk=16, block_v=32, num_warps=4)


class ChunkBwdConfig(NamedTuple):
    block_v: int  # value columns per program (dq, dk, dg, dβ are summed over value blocks)
    num_warps: int


CHUNK_BWD_CONFIG = ChunkBwdConfig(block_v=32, num_warps=8)


# ---------------------------------------------------------------------------------------
# plain-torch reference
# ---------------------------------------------------------------------------------------


def kda_recurrent_torch(q_BTNK: Tensor, k_BTNK: Tensor, v_BTNV: Tensor, g_BTNK: Tensor, beta_BTN: Tensor,
                        state_BNKV: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The torch reference of the recurrence, token by token (the one reference every KDA form is tested
    against): q, k L2-normalised, q scaled by K^-1/2 here → (o [B, T, N, V], state [B, N, K, V]) in fp32
    (float64 for float64 values)."""
    work = torch.float64 if v_BTNV.dtype == torch.float64 else torch.float32
    q, k, v, g, beta = (x.to(work) for x in (q_BTNK, k_BTNK, v_BTNV, g_BTNK, beta_BTN))
    B, T, N, K = k.shape
    V = v.shape[-1]
    q = q * K**-0.5
    S = torch.zeros(B, N, K, V, dtype=work, device=v.device) if state_BNKV is None else state_BNKV.to(work).clone()
    o = torch.empty(B, T, N, V, dtype=work, device=v.device)
    for t in range(T):
        S = S * g[:, t].exp()[..., None]
        delta_BNV = beta[:, t, :, None] * (v[:, t] - torch.einsum("bnkv,bnk->bnv", S, k[:, t]))
        S = S + k[:, t, :, :, None] * delta_BNV[:, :, None, :]
        o[:, t] = torch.einsum("bnkv,bnk->bnv", S, q[:, t])
    return o, S


# Largest log-decay span Γ_first − Γ_last of a block for which `_decayed_products` factorises
# exp(Γ_i − Γ_j) around the block's middle: the factors stay within exp(±span/2) and every product
# within exp(±span), far from overflow.
_FACTORED_SPAN = {torch.float32: 80.0, torch.float64: 600.0}
_DIRECT_BLOCK = 8  # blocks this small that still span too much take the direct form


def _decayed_products(k: Tensor, q: Tensor, G: Tensor) -> tuple[Tensor, Tensor]:
    """(K, M) [.., C, C] with X[i, j] = Σ_d x_i[d] k_j[d] exp(Γ_i[d] − Γ_j[d]) for j ≤ i (x = k, q), 0 above.

    Γ is non-increasing along C (a cumulative sum of log-decays ≤ 0). Exact in every case, through
    three forms:
    - factored (two matmuls): exp(Γ_i − Γ_j) = exp(Γ_i − m) · exp(m − Γ_j), m the middle of the
      block's span, when no block spans more than `_FACTORED_SPAN` (so no factor can overflow);
    - halved, when some block spans more (a trained forget gate does: the step cost grew ~10x on
      the direct form over whole chunks before this existed). The lower-left quarter, rows i of the second half and
      columns j of the first, is again two matmuls around R = Γ at the end of the first half, with
      exp(Γ_i − R) ≤ 1 and exp(R − Γ_j) ≤ 1; the two diagonal quarters recurse, as one batch;
    - direct, for blocks of ≤ `_DIRECT_BLOCK` tokens that still span too much: only non-positive
      exponents, through a [.., C, C, K] tensor.
    Entries above the diagonal are dropped (`tril`, or never computed), not multiplied by 0, so a
    large value there never reaches a gradient.
    """
    C = G.shape[-2]
    span = (G[..., :1, :] - G[..., -1:, :]).max().item() if G.numel() else 0.0
    if G.dtype in _FACTORED_SPAN and span <= _FACTORED_SPAN[G.dtype]:
        mid = 0.5 * (G[..., :1, :] + G[..., -1:, :])
        k_right = (k * (mid - G).exp()).transpose(-1, -2)[..., None, :, :]  # [.., 1, K, C]
        left = torch.stack((k, q), dim=-3) * (G - mid).exp()[..., None, :, :]  # [.., 2, C, K]
        return (left @ k_right).tril().unbind(-3)
    if C > _DIRECT_BLOCK and C % 2 == 0:
        h = C // 2
        R = G[..., h - 1:h, :]
        k_right = (k[..., :h, :] * (R - G[..., :h, :]).exp()).transpose(-1, -2)[..., None, :, :]
        left = torch.stack((k[..., h:, :], q[..., h:, :]), dim=-3) * (G[..., h:, :] - R).exp()[..., None, :, :]
        lower_k, lower_q = (left @ k_right).unbind(-3)                      # [.., h, h]
        halves = [x.unflatten(-2, (2, h)) for x in (k, q, G)]               # [.., 2, h, K]
        diag_k, diag_q = _decayed_products(*halves)                          # [.., 2, h, h]
        zeros = diag_k.new_zeros(diag_k.shape[:-3] + (h, h))
        def assemble(diag: Tensor, lower: Tensor) -> Tensor:
            top = torch.cat((diag[..., 0, :, :], zeros), dim=-1)
            return torch.cat((top, torch.cat((lower, diag[..., 1, :, :]), dim=-1)), dim=-2)
        return assemble(diag_k, lower_k), assemble(diag_q, lower_q)
    incl_CC1 = torch.ones(C, C, dtype=torch.bool, device=G.device).tril()[..., None]
    k_decay = k[..., None, :, :] * (G[..., :, None, :] - G[..., None, :, :]).masked_fill(~incl_CC1, float("-inf")).exp()
    return (k[..., :, None, :] * k_decay).sum(-1), (q[..., :, None, :] * k_decay).sum(-1)


def kda_chunk_torch(q_BTNK: Tensor, k_BTNK: Tensor, v_BTNV: Tensor, g_BTNK: Tensor,
                beta_BTN: Tensor, state_BNKV: Tensor | None = None, chunk: int = 64
                ) -> tuple[Tensor, Tensor]:
    """The torch reference of the chunked form: ``kda_recurrent_torch``'s recurrence, C tokens at a time
    (exact up to rounding; T need not divide by C), batched over chunks -- the form the model trains and
    prefills with on CPU (the Triton kernel's 16-token chunks use the same algebra).

    Inside a chunk, with Γ_i = Σ_{j≤i} g_j (cumulative log-decay from the chunk start) and S the state
    entering the chunk, the delta rule unrolls to the WY form

        A[i, j] = β_i Σ_d k_i[d] k_j[d] exp(Γ_i[d] − Γ_j[d])        (j < i; 0 elsewhere)
        U = (I + A)⁻¹ (β ⊙ V),   W = (I + A)⁻¹ (β ⊙ k ⊙ exp(Γ))      (unit lower-triangular solve)
        Δ = U − W S                                                  (the chunk's corrected values)
        O = (q ⊙ exp(Γ)) S + M Δ,  M[i, j] = Σ_d q_i[d] k_j[d] exp(Γ_i[d] − Γ_j[d])   (j ≤ i)
        S' = exp(Γ_C) ⊙ S + (k ⊙ exp(Γ_C − Γ))ᵀ Δ

    Every exponent here is ≤ 0 (A and M: see `_decayed_products`). A, M, U, W depend on the chunk's own tokens only, so
    they are computed for all chunks at once (batched over chunks: few, large ops, which is what makes
    training on CPU affordable); only the state hand-over S → S' (two small matmuls per chunk) runs
    chunk by chunk, and the outputs are again one batched product over chunks. Memory is O(T·C·K) per
    head (the decayed products of every chunk). Returns (o [B, T, N, V], final state [B, N, K, V]).
    """
    B, T, N, K = k_BTNK.shape
    V = v_BTNV.shape[-1]
    C = chunk
    pad = (-T) % C
    # [B, N, n, C, ·]; padded tokens have k = v = β = g = 0, so they leave the state unchanged.
    def split(x: Tensor) -> Tensor:
        x = x.transpose(1, 2)
        x = F.pad(x, (0, 0, 0, pad)) if x.dim() == 4 else F.pad(x, (0, pad))
        return x.reshape(B, N, -1, C, *x.shape[3:])
    q, k, v, g = (split(x) for x in (q_BTNK * K ** -0.5, k_BTNK, v_BTNV, g_BTNK))
    beta_BNnC1 = split(beta_BTN)[..., None]
    S = (torch.zeros(B, N, K, V, dtype=v.dtype, device=v.device)
         if state_BNKV is None else state_BNKV.to(v.dtype))
    if T == 0:
        return v_BTNV.new_zeros(B, 0, N, V), S
    G = g.cumsum(dim=-2)                                                   # [B, N, n, C, K]
    A, M = _decayed_products(k, q, G)
    A = A.tril(-1) * beta_BNnC1                                            # [B, N, n, C, C]
    rhs = torch.cat((beta_BNnC1 * v, beta_BNnC1 * k * G.exp()), dim=-1)
    UW = torch.linalg.solve_triangular(A + torch.eye(C, dtype=v.dtype, device=v.device), rhs,
                                       upper=False, unitriangular=True)
    U, W = UW.split((V, K), dim=-1)
    G_last = G[..., -1:, :]                                                # [B, N, n, 1, K]
    k_to_end_BNnKC = (k * (G_last - G).exp()).transpose(-1, -2)
    decay_end_BNnK1 = G_last.transpose(-1, -2).exp()
    states, deltas = [], []
    # unbind, not x[:, :, c] per chunk: each indexing's backward zero-fills a whole [B, N, n, ..]
    # gradient (quadratic in the chunk count; a third of a layer's forward + backward at 2.4 K tokens)
    for U_c, W_c, decay_c, k_to_end_c in zip(U.unbind(2), W.unbind(2), decay_end_BNnK1.unbind(2),
                                             k_to_end_BNnKC.unbind(2), strict=True):
        states.append(S)
        delta = U_c - W_c @ S
        deltas.append(delta)
        S = decay_c * S + k_to_end_c @ delta
    o = (q * G.exp()) @ torch.stack(states, dim=2) + M @ torch.stack(deltas, dim=2)   # [B, N, n, C, V]
    return o.reshape(B, N, -1, V)[:, :, :T].transpose(1, 2), S



# ---------------------------------------------------------------------------------------
# Triton kernel
# ---------------------------------------------------------------------------------------


@triton.jit
def _kda_recurrent_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, s0_ptr, o_ptr, s_ptr,
    T, N, K, V, scale,
    HAS_STATE: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Program (b·N + n, value block): state slice S[:, vb] over T tokens.

    q, k, g [B, T, N, K]; v [B, T, N, V]; beta [B, T, N]; s0, s [B, N, K, V] fp32; o [B, T, N, V] fp32.
    """
    bn = tl.program_id(0)
    b = bn // N
    n = bn % N
    kk = tl.arange(0, BLOCK_K)
    vv = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    k_ok = kk < K
    v_ok = vv < V
    s_offs = bn.to(tl.int64) * K * V + kk[:, None] * V + vv[None, :]
    s_mask = k_ok[:, None] & v_ok[None, :]
    if HAS_STATE:
        S = tl.load(s0_ptr + s_offs, mask=s_mask, other=0.0).to(tl.float32)
    else:
        S = tl.zeros([BLOCK_K, BLOCK_V], tl.float32)
    for t in range(T):
        row = (b.to(tl.int64) * T + t) * N + n  # token (b, t), head n
        k = tl.load(k_ptr + row * K + kk, mask=k_ok, other=0.0).to(tl.float32)
        q = tl.load(q_ptr + row * K + kk, mask=k_ok, other=0.0).to(tl.float32) * scale
        g = tl.load(g_ptr + row * K + kk, mask=k_ok, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + row * V + vv, mask=v_ok, other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + row).to(tl.float32)
        S = S * tl.exp(g)[:, None]
        delta = beta * (v - tl.sum(S * k[:, None], axis=0))
        S = S + k[:, None] * delta[None, :]
        o = tl.sum(S * q[:, None], axis=0)
        tl.store(o_ptr + row * V + vv, o, mask=v_ok)
    tl.store(s_ptr + s_offs, S, mask=s_mask)


@triton.jit
def _load_chunk(q_ptr, k_ptr, g_ptr, beta_ptr, row, t_ok, kk, k_ok, cc, K, scale, CHUNK: tl.constexpr,
                cd: tl.constexpr):
    """One chunk's q (scaled), k, Γ = cumsum g, Γ_last = Γ[CHUNK − 1] and β, in the compute dtype cd.

    Rows past T load as zeros, so they leave the state unchanged and Γ_last is the last real row's Γ.
    """
    kmask = t_ok[:, None] & k_ok[None, :]
    offs = row[:, None] * K + kk[None, :]
    q = tl.load(q_ptr + offs, mask=kmask, other=0.0).to(cd) * scale
    k = tl.load(k_ptr + offs, mask=kmask, other=0.0).to(cd)
    G = tl.cumsum(tl.load(g_ptr + offs, mask=kmask, other=0.0).to(cd), axis=0)
    G_last = tl.sum(tl.where((cc == CHUNK - 1)[:, None], G, 0.0), axis=0)
    beta = tl.load(beta_ptr + row, mask=t_ok, other=0.0).to(cd)
    return q, k, G, G_last, beta


@triton.jit
def _wy_inverse(k_up, k_down, beta, cc, CHUNK: tl.constexpr):
    """KK = (k e^Γ)(k e^-Γ)ᵀ and X = (I + A)⁻¹ for A = strict_lower(β ⊙ KK), row by row by forward
    substitution: X_i = e_i − Σ_{j<i} A_ij X_j (CHUNK steps of a [CHUNK, CHUNK] update)."""
    KK = tl.dot(k_up, tl.trans(k_down), input_precision="ieee")
    A = tl.where(cc[:, None] > cc[None, :], beta[:, None] * KK, 0.0)
    X = tl.zeros([CHUNK, CHUNK], KK.dtype)
    for i in range(CHUNK):
        a_i = tl.sum(tl.where((cc == i)[:, None], A, 0.0), axis=0)  # row i of A, [CHUNK]
        x_i = (cc == i).to(KK.dtype) - tl.sum(a_i[:, None] * X, axis=0)
        X = tl.where((cc == i)[:, None], x_i[None, :], X)
    return KK, X


@triton.jit
def _kda_chunk_fwd_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, s0_ptr, o_ptr, s_ptr, h_ptr,
    T, N, K, V, scale,
    HAS_STATE: tl.constexpr, STATES_ONLY: tl.constexpr, CHUNK: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Program (b·N + n, value block): the WY chunked form, CHUNK tokens per step.

    Within a chunk (Γ = cumsum g from the chunk start, S the entering state):
    A = strict_lower(β ⊙ (k e^Γ)(k e^-Γ)ᵀ); L⁻¹ = (I + A)⁻¹ by forward substitution;
    Δ = L⁻¹(β v) − L⁻¹(β k e^Γ) S; o = (q e^Γ) S + lower(q e^Γ (k e^-Γ)ᵀ) Δ;
    S ← e^Γ_last ⊙ S + (k e^(Γ_last − Γ))ᵀ Δ. Same shapes as the recurrent kernel, and
    h [B, N, n_chunks, K, V]: with STATES_ONLY, the state entering every chunk is stored there
    instead of o (the backward's recomputation). fp32 throughout, fp64 for fp64 states.
    """
    bn = tl.program_id(0)
    b = bn // N
    n = bn % N
    kk = tl.arange(0, BLOCK_K)
    vv = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    cc = tl.arange(0, CHUNK)
    k_ok = kk < K
    v_ok = vv < V
    s_offs = kk[:, None] * V + vv[None, :]
    s_mask = k_ok[:, None] & v_ok[None, :]
    cd = s_ptr.dtype.element_ty
    if HAS_STATE:
        S = tl.load(s0_ptr + bn.to(tl.int64) * K * V + s_offs, mask=s_mask, other=0.0).to(cd)
    else:
        S = tl.zeros([BLOCK_K, BLOCK_V], cd)
    n_chunks = tl.cdiv(T, CHUNK)
    for c in range(n_chunks):
        t = c * CHUNK + cc
        t_ok = t < T
        row = (b.to(tl.int64) * T + t) * N + n
        q, k, G, G_last, beta = _load_chunk(q_ptr, k_ptr, g_ptr, beta_ptr, row, t_ok, kk, k_ok, cc, K, scale, CHUNK, cd)
        v_mask = t_ok[:, None] & v_ok[None, :]
        v = tl.load(v_ptr + row[:, None] * V + vv[None, :], mask=v_mask, other=0.0).to(cd)
        k_up = k * tl.exp(G)
        k_down = k * tl.exp(-G)
        _, X = _wy_inverse(k_up, k_down, beta, cc, CHUNK)
        U = tl.dot(X, beta[:, None] * v, input_precision="ieee")
        W = tl.dot(X, beta[:, None] * k_up, input_precision="ieee")
        delta = U - tl.dot(W, S, input_precision="ieee")
        if STATES_ONLY:
            tl.store(h_ptr + (bn.to(tl.int64) * n_chunks + c) * K * V + s_offs, S, mask=s_mask)
        else:
            q_up = q * tl.exp(G)
            M = tl.where(cc[:, None] >= cc[None, :], tl.dot(q_up, tl.trans(k_down), input_precision="ieee"), 0.0)
            o = tl.dot(q_up, S, input_precision="ieee") + tl.dot(M, delta, input_precision="ieee")
            tl.store(o_ptr + row[:, None] * V + vv[None, :], o, mask=v_mask)
        S = tl.exp(G_last)[:, None] * S + tl.dot(tl.trans(k * tl.exp(G_last[None, :] - G)), delta,
                                                 input_precision="ieee")
    tl.store(s_ptr + bn.to(tl.int64) * K * V + s_offs, S, mask=s_mask)


@triton.jit
def _kda_chunk_bwd_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, h_ptr, do_ptr, dst_ptr,
    dq_ptr, dk_ptr, dv_ptr, dg_ptr, dbeta_ptr, ds0_ptr,
    T, N, K, V, scale,
    CHUNK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Program (b·N + n, value block vb): the chunks in reverse, carrying dS = ∂L/∂(state leaving
    the chunk), [K, BLOCK_V], from dst (∂L/∂final state) down to ds0 (∂L/∂initial state).

    Per chunk, with qg = q e^Γ, kg = k e^Γ, kn = k e^-Γ, kd = k e^(Γ_last − Γ), S = h[chunk]
    and U, W, Δ, M, X as in the forward (reverse-mode of its five lines, last to first):
        dΔ = Mᵀ dO + kd dS;   dM = lower(dO Δᵀ);   dkd = Δ dSᵀ;   dW = −dΔ Sᵀ
        dqg = dO Sᵀ + dM kn;  dkn = dMᵀ qg + dKKᵀ kg;   dbv = Xᵀ dΔ;   dbkg = Xᵀ dW
        dA = −strict_lower(dbv Uᵀ + dbkg Wᵀ);   dKK = β ⊙ dA;   dkg = dKK kn + β dbkg
        dβ = rowsum(dA ⊙ KK + dbv ⊙ v + dbkg ⊙ kg);   dv = β dbv
        dΓ = dqg⊙qg + dkg⊙kg − dkn⊙kn − dkd⊙kd,
            plus at the last row colsum(dkd⊙kd) + e^Γ_last ⊙ rowsum(dS⊙S)
        dg = reverse cumsum of dΓ;   dS ← e^Γ_last ⊙ dS + qgᵀ dO − Wᵀ dΔ
    dv and ds0 cover only this program's value block and are complete; dq, dk, dg, dβ are its
    share of a sum over value blocks: they go to [n_vblocks, ...] buffers indexed by vb.
    """
    bn = tl.program_id(0)
    vb = tl.program_id(1)
    b = bn // N
    n = bn % N
    kk = tl.arange(0, BLOCK_K)
    vv = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    cc = tl.arange(0, CHUNK)
    k_ok = kk < K
    v_ok = vv < V
    s_offs = kk[:, None] * V + vv[None, :]
    s_mask = k_ok[:, None] & v_ok[None, :]
    cd = h_ptr.dtype.element_ty
    dS = tl.load(dst_ptr + bn.to(tl.int64) * K * V + s_offs, mask=s_mask, other=0.0).to(cd)
    n_chunks = tl.cdiv(T, CHUNK)
    part = vb.to(tl.int64) * tl.num_programs(0) * T  # this value block's slice of the partial sums, in rows
    strict = cc[:, None] > cc[None, :]
    incl = cc[:, None] >= cc[None, :]
    for i in range(n_chunks):
        c = n_chunks - 1 - i
        t = c * CHUNK + cc
        t_ok = t < T
        row = (b.to(tl.int64) * T + t) * N + n
        q, k, G, G_last, beta = _load_chunk(q_ptr, k_ptr, g_ptr, beta_ptr, row, t_ok, kk, k_ok, cc, K, scale, CHUNK, cd)
        v_mask = t_ok[:, None] & v_ok[None, :]
        v = tl.load(v_ptr + row[:, None] * V + vv[None, :], mask=v_mask, other=0.0).to(cd)
        do = tl.load(do_ptr + row[:, None] * V + vv[None, :], mask=v_mask, other=0.0).to(cd)
        S = tl.load(h_ptr + (bn.to(tl.int64) * n_chunks + c) * K * V + s_offs, mask=s_mask, other=0.0)
        e_up = tl.exp(G)
        e_down = tl.exp(-G)
        e_dec = tl.exp(G_last[None, :] - G)
        qg = q * e_up
        kg = k * e_up
        kn = k * e_down
        kd = k * e_dec
        KK, X = _wy_inverse(kg, kn, beta, cc, CHUNK)
        U = tl.dot(X, beta[:, None] * v, input_precision="ieee")
        W = tl.dot(X, beta[:, None] * kg, input_precision="ieee")
        delta = U - tl.dot(W, S, input_precision="ieee")
        M = tl.where(incl, tl.dot(qg, tl.trans(kn), input_precision="ieee"), 0.0)

        d_delta = tl.dot(tl.trans(M), do, input_precision="ieee") + tl.dot(kd, dS, input_precision="ieee")
        dM = tl.where(incl, tl.dot(do, tl.trans(delta), input_precision="ieee"), 0.0)
        dkd = tl.dot(delta, tl.trans(dS), input_precision="ieee")
        dW = -tl.dot(d_delta, tl.trans(S), input_precision="ieee")
        dqg = tl.dot(do, tl.trans(S), input_precision="ieee") + tl.dot(dM, kn, input_precision="ieee")
        dbv = tl.dot(tl.trans(X), d_delta, input_precision="ieee")
        dbkg = tl.dot(tl.trans(X), dW, input_precision="ieee")
        dA = -tl.where(strict, tl.dot(dbv, tl.trans(U), input_precision="ieee")
                       + tl.dot(dbkg, tl.trans(W), input_precision="ieee"), 0.0)
        dKK = beta[:, None] * dA
        dkg = tl.dot(dKK, kn, input_precision="ieee") + beta[:, None] * dbkg
        dkn = tl.dot(tl.trans(dM), qg, input_precision="ieee") + tl.dot(tl.trans(dKK), kg, input_precision="ieee")
        dbeta = tl.sum(dA * KK, axis=1) + tl.sum(dbv * v, axis=1) + tl.sum(dbkg * kg, axis=1)
        dG = dqg * qg + dkg * kg - dkn * kn - dkd * kd
        dG_last = tl.sum(dkd * kd, axis=0) + tl.exp(G_last) * tl.sum(dS * S, axis=1)
        dG += tl.where((cc == CHUNK - 1)[:, None], dG_last[None, :], 0.0)
        dg = tl.sum(dG, axis=0)[None, :] - tl.cumsum(dG, axis=0) + dG  # Σ_{j ≥ i} dΓ_j

        tl.store(dv_ptr + row[:, None] * V + vv[None, :], beta[:, None] * dbv, mask=v_mask)
        kmask = t_ok[:, None] & k_ok[None, :]
        offs = (part + row)[:, None] * K + kk[None, :]
        tl.store(dq_ptr + offs, dqg * e_up * scale, mask=kmask)
        tl.store(dk_ptr + offs, dkg * e_up + dkn * e_down + dkd * e_dec, mask=kmask)
        tl.store(dg_ptr + offs, dg, mask=kmask)
        tl.store(dbeta_ptr + part + row, dbeta, mask=t_ok)
        dS = tl.exp(G_last)[:, None] * dS + tl.dot(tl.trans(qg), do, input_precision="ieee") \
            - tl.dot(tl.trans(W), d_delta, input_precision="ieee")
    tl.store(ds0_ptr + bn.to(tl.int64) * K * V + s_offs, dS, mask=s_mask)


# ---------------------------------------------------------------------------------------
# launcher
# ---------------------------------------------------------------------------------------


def _kda_recurrent_triton(q_BTNK: Tensor, k_BTNK: Tensor, v_BTNV: Tensor, g_BTNK: Tensor, beta_BTN: Tensor,
                          state_BNKV: Tensor | None, config: RecurrentConfig = RECURRENT_CONFIG
                          ) -> tuple[Tensor, Tensor]:
    B, T, N, K = k_BTNK.shape
    V = v_BTNV.shape[-1]
    dev = v_BTNV.device
    o = torch.empty(B, T, N, V, dtype=torch.float32, device=dev)
    S = torch.empty(B, N, K, V, dtype=torch.float32, device=dev)
    if B * N == 0 or K * V == 0:
        return o.zero_(), S.zero_()
    s0 = state_BNKV.to(torch.float32).contiguous() if state_BNKV is not None else S
    kernel = launcher(_kda_recurrent_kernel, dev)
    kernel[(B * N, triton.cdiv(V, config.block_v))](
        q_BTNK.contiguous(), k_BTNK.contiguous(), v_BTNV.contiguous(), g_BTNK.contiguous(),
        beta_BTN.contiguous(), s0, o, S, T, N, K, V, K**-0.5,
        HAS_STATE=state_BNKV is not None, BLOCK_K=max(16, triton.next_power_of_2(K)), BLOCK_V=config.block_v,
        num_warps=config.num_warps,
    )
    return o, S


def _work_dtype(v: Tensor) -> torch.dtype:
    """fp32, or fp64 for fp64 values (the interpreter tests check the algebra in fp64)."""
    return torch.float64 if v.dtype == torch.float64 else torch.float32


def _kda_chunk_launch(q_BTNK: Tensor, k_BTNK: Tensor, v_BTNV: Tensor, g_BTNK: Tensor, beta_BTN: Tensor,
                      state_BNKV: Tensor | None, states_only: bool, config: ChunkConfig = CHUNK_CONFIG
                      ) -> tuple[Tensor, Tensor]:
    """→ (o [B, T, N, V], final state), or with ``states_only`` (h [B, N, n_chunks, K, V] = the
    state entering each chunk, final state)."""
    B, T, N, K = k_BTNK.shape
    V = v_BTNV.shape[-1]
    dev, work = v_BTNV.device, _work_dtype(v_BTNV)
    n_chunks = triton.cdiv(T, config.chunk)
    out = torch.empty(*((B, N, n_chunks, K, V) if states_only else (B, T, N, V)), dtype=work, device=dev)
    S = torch.empty(B, N, K, V, dtype=work, device=dev)
    if B * N == 0 or K * V == 0:
        return out.zero_(), S.zero_()
    s0 = state_BNKV.to(work).contiguous() if state_BNKV is not None else S
    kernel = launcher(_kda_chunk_fwd_kernel, dev)
    kernel[(B * N, triton.cdiv(V, config.block_v))](
        q_BTNK.contiguous(), k_BTNK.contiguous(), v_BTNV.contiguous(), g_BTNK.contiguous(),
        beta_BTN.contiguous(), s0, out, S, out, T, N, K, V, K**-0.5,
        HAS_STATE=state_BNKV is not None, STATES_ONLY=states_only, CHUNK=config.chunk,
        BLOCK_K=max(16, triton.next_power_of_2(K)), BLOCK_V=config.block_v, num_warps=config.num_warps,
    )
    return out, S


def _kda_chunk_triton(q_BTNK: Tensor, k_BTNK: Tensor, v_BTNV: Tensor, g_BTNK: Tensor, beta_BTN: Tensor,
                      state_BNKV: Tensor | None) -> tuple[Tensor, Tensor]:
    return _kda_chunk_launch(q_BTNK, k_BTNK, v_BTNV, g_BTNK, beta_BTN, state_BNKV, states_only=False)


def _kda_chunk_bwd_triton(q_BTNK: Tensor, k_BTNK: Tensor, v_BTNV: Tensor, g_BTNK: Tensor, beta_BTN: Tensor,
                          state_BNKV: Tensor | None, do_BTNV: Tensor, dstate_BNKV: Tensor | None,
                          config: ChunkBwdConfig = CHUNK_BWD_CONFIG) -> tuple[Tensor, ...]:
    """Gradients (dq, dk, dv, dg, dβ, d state₀) in the work dtype, given ∂L/∂o and ∂L/∂(final
    state) (None: zero). Recomputes the chunk-entry states first (one extra forward pass, held
    only during the backward: B·N·⌈T/16⌉·K·V floats)."""
    B, T, N, K = k_BTNK.shape
    V = v_BTNV.shape[-1]
    dev, work = v_BTNV.device, _work_dtype(v_BTNV)
    h, _ = _kda_chunk_launch(q_BTNK, k_BTNK, v_BTNV, g_BTNK, beta_BTN, state_BNKV, states_only=True)
    n_vblocks = triton.cdiv(V, config.block_v)
    dq, dk, dg = (torch.empty(n_vblocks, B, T, N, K, dtype=work, device=dev) for _ in range(3))
    dbeta = torch.empty(n_vblocks, B, T, N, dtype=work, device=dev)
    dv = torch.empty(B, T, N, V, dtype=work, device=dev)
    ds0 = torch.empty(B, N, K, V, dtype=work, device=dev)
    dst = (torch.zeros(B, N, K, V, dtype=work, device=dev) if dstate_BNKV is None
           else dstate_BNKV.to(work).contiguous())
    if B * N == 0 or K * V == 0:
        return dq.sum(0).zero_(), dk.sum(0).zero_(), dv.zero_(), dg.sum(0).zero_(), dbeta.sum(0).zero_(), dst
    kernel = launcher(_kda_chunk_bwd_kernel, dev)
    kernel[(B * N, n_vblocks)](
        q_BTNK.contiguous(), k_BTNK.contiguous(), v_BTNV.contiguous(), g_BTNK.contiguous(), beta_BTN.contiguous(),
        h, do_BTNV.to(work).contiguous(), dst, dq, dk, dv, dg, dbeta, ds0, T, N, K, V, K**-0.5,
        CHUNK=CHUNK_CONFIG.chunk, BLOCK_K=max(16, triton.next_power_of_2(K)), BLOCK_V=config.block_v,
        num_warps=config.num_warps,
    )
    return dq.sum(0), dk.sum(0), dv, dg.sum(0), dbeta.sum(0), ds0


class _KDAChunk(torch.autograd.Function):
    """o, final state = the chunked kernel; the backward recomputes the chunk states (above)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, state):
        ctx.save_for_backward(q, k, v, g, beta, state)
        return _kda_chunk_triton(q, k, v, g, beta, state)

    @staticmethod
    def backward(ctx, do, dstate):
        q, k, v, g, beta, state = ctx.saved_tensors
        grads = _kda_chunk_bwd_triton(q, k, v, g, beta, state, do, dstate)
        dq, dk, dv, dg, dbeta, ds0 = (d.to(x.dtype) if x is not None else None
                                      for d, x in zip(grads, (q, k, v, g, beta, state)))
        return dq, dk, dv, dg, dbeta, ds0


# ---------------------------------------------------------------------------------------
# public API
# ---------------------------------------------------------------------------------------


def _check_inputs(q_BTNK, k_BTNK, v_BTNV, g_BTNK, beta_BTN, state_BNKV) -> None:
    B, T, N, K = k_BTNK.shape if k_BTNK.dim() == 4 else (None,) * 4
    if (B is None or q_BTNK.shape != k_BTNK.shape or g_BTNK.shape != k_BTNK.shape
            or v_BTNV.dim() != 4 or v_BTNV.shape[:3] != (B, T, N) or beta_BTN.shape != (B, T, N)):
        raise ValueError(f"KDA needs q, k, g [B, T, N, K], v [B, T, N, V], beta [B, T, N]; got q {tuple(q_BTNK.shape)}, "
                         f"k {tuple(k_BTNK.shape)}, v {tuple(v_BTNV.shape)}, g {tuple(g_BTNK.shape)}, "
                         f"beta {tuple(beta_BTN.shape)}")
    if state_BNKV is not None and state_BNKV.shape != (B, N, K, v_BTNV.shape[-1]):
        raise ValueError(f"state must be [B, N, K, V] = {[B, N, K, v_BTNV.shape[-1]]}, got {tuple(state_BNKV.shape)}")


def kda_recurrent(q_BTNK: Tensor, k_BTNK: Tensor, v_BTNV: Tensor, g_BTNK: Tensor, beta_BTN: Tensor,
                  state_BNKV: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """KDA token by token from an optional state (module docstring); T = 1 is the decode step.

    Args:
        q_BTNK, k_BTNK: ``[B, T, N, K]`` L2-normalised queries and keys (q is scaled by
            ``K^-1/2`` here).
        v_BTNV: ``[B, T, N, V]`` values.
        g_BTNK: ``[B, T, N, K]`` log-decay (≤ 0).
        beta_BTN: ``[B, T, N]`` write strengths.
        state_BNKV: ``[B, N, K, V]`` state before the first token, or None for zeros.

    Returns:
        ``(o [B, T, N, V], state [B, N, K, V])``, fp32 (float64 for float64 values).
    """
    _check_inputs(q_BTNK, k_BTNK, v_BTNV, g_BTNK, beta_BTN, state_BNKV)
    if use_triton(v_BTNV.device):
        return kda_recurrent_triton(q_BTNK, k_BTNK, v_BTNV, g_BTNK, beta_BTN, state_BNKV)
    return kda_recurrent_torch(q_BTNK, k_BTNK, v_BTNV, g_BTNK, beta_BTN, state_BNKV)


def kda_chunk(q_BTNK: Tensor, k_BTNK: Tensor, v_BTNV: Tensor, g_BTNK: Tensor, beta_BTN: Tensor,
              state_BNKV: Tensor | None = None, chunk: int = 64) -> tuple[Tensor, Tensor]:
    """KDA over a whole sequence in the chunked (WY) form: the same values as
    :func:`kda_recurrent` up to rounding, for prefill and training. Differentiable in q, k, v,
    g, beta and the state (the Triton path through an ``autograd.Function`` whose backward is
    the chunked backward kernel; the reference, ``kda_chunk_torch`` with ``chunk`` tokens per chunk,
    through autograd). Same arguments and returns as :func:`kda_recurrent`.

    The kernels factor ``exp(Γ_i − Γ_j)`` as ``exp(Γ_i) · exp(−Γ_j)`` inside 16-token chunks, so
    the summed log-decay of any chunk must stay above about −80 per channel (fp32 range); the
    model's gate (softplus or the ``linear_lower_bound`` form) gives far less in practice.
    """
    _check_inputs(q_BTNK, k_BTNK, v_BTNV, g_BTNK, beta_BTN, state_BNKV)
    if use_triton(v_BTNV.device):
        return kda_chunk_triton(q_BTNK, k_BTNK, v_BTNV, g_BTNK, beta_BTN, state_BNKV)
    return kda_chunk_torch(q_BTNK, k_BTNK, v_BTNV, g_BTNK, beta_BTN, state_BNKV, chunk)


def kda_recurrent_triton(q_BTNK: Tensor, k_BTNK: Tensor, v_BTNV: Tensor, g_BTNK: Tensor, beta_BTN: Tensor,
                         state_BNKV: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``kda_recurrent`` on the Triton kernel (float64 values: the reference, the kernels work in fp32)."""
    if v_BTNV.dtype == torch.float64:
        return kda_recurrent_torch(q_BTNK, k_BTNK, v_BTNV, g_BTNK, beta_BTN, state_BNKV)
    return _kda_recurrent_triton(q_BTNK, k_BTNK, v_BTNV, g_BTNK, beta_BTN, state_BNKV)


def kda_chunk_triton(q_BTNK: Tensor, k_BTNK: Tensor, v_BTNV: Tensor, g_BTNK: Tensor, beta_BTN: Tensor,
                     state_BNKV: Tensor | None = None, chunk: int = 64) -> tuple[Tensor, Tensor]:
    """``kda_chunk`` on the Triton kernels, forward and backward (``chunk`` is the reference's: the
    kernels take 16 tokens at a time; float64 values: the reference)."""
    if v_BTNV.dtype == torch.float64:
        return kda_chunk_torch(q_BTNK, k_BTNK, v_BTNV, g_BTNK, beta_BTN, state_BNKV, chunk)
    return _KDAChunk.apply(q_BTNK, k_BTNK, v_BTNV, g_BTNK, beta_BTN, state_BNKV)
