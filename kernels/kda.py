"""Kimi Delta Attention (KDA): the recurrent step (decode) and the chunked forward (prefill)
as Triton kernels.

Per head, with q, k already L2-normalised (``model/kda.py`` does that, and the short conv),
q scaled by ``K^-1/2`` here, channel-wise log-decay ``g_t ∈ R^K`` (≤ 0) and ``β_t`` a scalar:

    S_t = (I − β_t k_t k_tᵀ) · diag(exp(g_t)) · S_{t−1} + β_t k_t v_tᵀ        S ∈ R^{K×V}
    o_t = S_tᵀ q_t

computed as ``S ← exp(g) ⊙ S; Δ = β (v − Sᵀ k); S ← S + k Δᵀ; o = Sᵀ q`` token by token, the same
order of operations as ``model.kda.kda_recurrent``. The kernel keeps a ``[K, BLOCK_V]`` slice of
the state in registers for all T tokens (one program per (batch, head, value block)), so a
decode step reads the state once and writes it once. ``kda_chunk_forward`` computes the same
recurrence 16 tokens at a time in the WY form (``model.kda.kda_chunked``'s algebra: per chunk a
16×16 unit-triangular inverse by forward substitution, then matmuls against the state), one
program per (batch, head, value block) walking the chunks in order. Forward only; the chunked
backward is not written yet (issue #4): training differentiates the torch reference.

Everything is computed in fp32 (float64 inputs take the torch reference); o and the final
state come back in fp32, as the model's reference returns them.

Layout (kernels/ convention): torch reference, Triton kernel, launcher, public function.
Forward only.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from jointrl.kernels.dispatch import launcher, use_triton

__all__ = ["CHUNK_CONFIG", "RECURRENT_CONFIG", "kda_chunk_forward", "kda_recurrent"]


class RecurrentConfig(NamedTuple):
    block_v: int  # value columns of the state per program
    num_warps: int


RECURRENT_CONFIG = RecurrentConfig(block_v=32, num_warps=4)


class ChunkConfig(NamedTuple):
    chunk: int  # tokens per WY step (exp(-Γ) over a chunk must stay finite in fp32)
    block_v: int
    num_warps: int


CHUNK_CONFIG = ChunkConfig(chunk=16, block_v=32, num_warps=4)


# ---------------------------------------------------------------------------------------
# plain-torch reference
# ---------------------------------------------------------------------------------------


def _kda_recurrent_torch(q_BTNK: Tensor, k_BTNK: Tensor, v_BTNV: Tensor, g_BTNK: Tensor, beta_BTN: Tensor,
                         state_BNKV: Tensor | None) -> tuple[Tensor, Tensor]:
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
def _kda_chunk_fwd_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, s0_ptr, o_ptr, s_ptr,
    T, N, K, V, scale,
    HAS_STATE: tl.constexpr, CHUNK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Program (b·N + n, value block): the WY chunked form, CHUNK tokens per step.

    Within a chunk (Γ = cumsum g from the chunk start, S the entering state):
    A = strict_lower(β ⊙ (k e^Γ)(k e^-Γ)ᵀ); L⁻¹ = (I + A)⁻¹ by forward substitution;
    Δ = L⁻¹(β v) − L⁻¹(β k e^Γ) S; o = (q e^Γ) S + lower(q e^Γ (k e^-Γ)ᵀ) Δ;
    S ← e^Γ_last ⊙ S + (k e^(Γ_last − Γ))ᵀ Δ. Same shapes as the recurrent kernel.
    """
    bn = tl.program_id(0)
    b = bn // N
    n = bn % N
    kk = tl.arange(0, BLOCK_K)
    vv = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    cc = tl.arange(0, CHUNK)
    k_ok = kk < K
    v_ok = vv < V
    s_offs = bn.to(tl.int64) * K * V + kk[:, None] * V + vv[None, :]
    s_mask = k_ok[:, None] & v_ok[None, :]
    if HAS_STATE:
        S = tl.load(s0_ptr + s_offs, mask=s_mask, other=0.0).to(tl.float32)
    else:
        S = tl.zeros([BLOCK_K, BLOCK_V], tl.float32)
    strict = cc[:, None] > cc[None, :]
    incl = cc[:, None] >= cc[None, :]
    for t0 in range(0, T, CHUNK):
        t = t0 + cc
        t_ok = t < T
        row = (b.to(tl.int64) * T + t) * N + n
        kmask = t_ok[:, None] & k_ok[None, :]
        k = tl.load(k_ptr + row[:, None] * K + kk[None, :], mask=kmask, other=0.0).to(tl.float32)
        q = tl.load(q_ptr + row[:, None] * K + kk[None, :], mask=kmask, other=0.0).to(tl.float32) * scale
        g = tl.load(g_ptr + row[:, None] * K + kk[None, :], mask=kmask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + row[:, None] * V + vv[None, :], mask=t_ok[:, None] & v_ok[None, :], other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + row, mask=t_ok, other=0.0).to(tl.float32)
        G = tl.cumsum(g, axis=0)
        G_last = tl.sum(tl.where((cc == CHUNK - 1)[:, None], G, 0.0), axis=0)  # [BLOCK_K]
        k_up = k * tl.exp(G)
        k_down = k * tl.exp(-G)
        q_up = q * tl.exp(G)
        A = tl.where(strict, beta[:, None] * tl.dot(k_up, tl.trans(k_down), input_precision="ieee"), 0.0)
        # (I + A)^-1, row by row: X_i = e_i - sum_{j<i} A_ij X_j
        X = tl.zeros([CHUNK, CHUNK], tl.float32)
        for i in tl.static_range(CHUNK):
            a_i = tl.sum(tl.where((cc == i)[:, None], A, 0.0), axis=0)  # row i of A, [CHUNK]
            x_i = (cc == i).to(tl.float32) - tl.sum(a_i[:, None] * X, axis=0)
            X = tl.where((cc == i)[:, None], x_i[None, :], X)
        U = tl.dot(X, beta[:, None] * v, input_precision="ieee")
        W = tl.dot(X, beta[:, None] * k_up, input_precision="ieee")
        delta = U - tl.dot(W, S, input_precision="ieee")
        M = tl.where(incl, tl.dot(q_up, tl.trans(k_down), input_precision="ieee"), 0.0)
        o = tl.dot(q_up, S, input_precision="ieee") + tl.dot(M, delta, input_precision="ieee")
        tl.store(o_ptr + row[:, None] * V + vv[None, :], o, mask=t_ok[:, None] & v_ok[None, :])
        S = tl.exp(G_last)[:, None] * S + tl.dot(tl.trans(k * tl.exp(G_last[None, :] - G)), delta,
                                                 input_precision="ieee")
    tl.store(s_ptr + s_offs, S, mask=s_mask)


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


def _kda_chunk_triton(q_BTNK: Tensor, k_BTNK: Tensor, v_BTNV: Tensor, g_BTNK: Tensor, beta_BTN: Tensor,
                      state_BNKV: Tensor | None, config: ChunkConfig = CHUNK_CONFIG) -> tuple[Tensor, Tensor]:
    B, T, N, K = k_BTNK.shape
    V = v_BTNV.shape[-1]
    dev = v_BTNV.device
    o = torch.empty(B, T, N, V, dtype=torch.float32, device=dev)
    S = torch.empty(B, N, K, V, dtype=torch.float32, device=dev)
    if B * N == 0 or K * V == 0:
        return o.zero_(), S.zero_()
    s0 = state_BNKV.to(torch.float32).contiguous() if state_BNKV is not None else S
    kernel = launcher(_kda_chunk_fwd_kernel, dev)
    kernel[(B * N, triton.cdiv(V, config.block_v))](
        q_BTNK.contiguous(), k_BTNK.contiguous(), v_BTNV.contiguous(), g_BTNK.contiguous(),
        beta_BTN.contiguous(), s0, o, S, T, N, K, V, K**-0.5,
        HAS_STATE=state_BNKV is not None, CHUNK=config.chunk, BLOCK_K=max(16, triton.next_power_of_2(K)),
        BLOCK_V=config.block_v, num_warps=config.num_warps,
    )
    return o, S


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
    if v_BTNV.dtype != torch.float64 and use_triton(v_BTNV.device):
        return _kda_recurrent_triton(q_BTNK, k_BTNK, v_BTNV, g_BTNK, beta_BTN, state_BNKV)
    return _kda_recurrent_torch(q_BTNK, k_BTNK, v_BTNV, g_BTNK, beta_BTN, state_BNKV)


def kda_chunk_forward(q_BTNK: Tensor, k_BTNK: Tensor, v_BTNV: Tensor, g_BTNK: Tensor, beta_BTN: Tensor,
                      state_BNKV: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """KDA over a whole sequence in the chunked (WY) form: the same values as
    :func:`kda_recurrent` up to rounding, for prefill. Forward only: with autograd recording
    (an input requires grad) it runs the torch reference instead. Same arguments and returns
    as :func:`kda_recurrent`.

    The kernel factors ``exp(Γ_i − Γ_j)`` as ``exp(Γ_i) · exp(−Γ_j)`` inside 16-token chunks, so
    the summed log-decay of any chunk must stay above about −80 per channel (fp32 range); the
    model's gate (softplus or the ``linear_lower_bound`` form) gives far less in practice.
    """
    _check_inputs(q_BTNK, k_BTNK, v_BTNV, g_BTNK, beta_BTN, state_BNKV)
    needs_grad = torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (q_BTNK, k_BTNK, v_BTNV, g_BTNK, beta_BTN, state_BNKV))
    if not needs_grad and v_BTNV.dtype != torch.float64 and use_triton(v_BTNV.device):
        return _kda_chunk_triton(q_BTNK, k_BTNK, v_BTNV, g_BTNK, beta_BTN, state_BNKV)
    return _kda_recurrent_torch(q_BTNK, k_BTNK, v_BTNV, g_BTNK, beta_BTN, state_BNKV)
