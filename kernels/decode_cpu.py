"""The small per-row ops of a decode step on CPU, each one C++ call instead of 5-15 torch ops.

    rms_norm:            y_n = w ⊙ x_n / sqrt(mean(x_n²) + eps)
    qk_norm_rope_store:  per head g of the fused q|k|v projection row n:
                         t = w_g ⊙ x / sqrt(mean(x²) + eps)         (q and k heads; skipped without w)
                         r = t ⊙ cos_n + rotate_half(t) ⊙ sin_n      (RoPE, rotate_half(t) = [-t₂, t₁])
                         q heads → q_n; k heads → kv[slot_n, 0]; v heads (raw) → kv[slot_n, 1]
    route_softmax_topk:  p = softmax(logits_n); ids = top-k(p) (descending, ties: lower id first);
                         w = p[ids] / (Σ p[ids] + 1e-20) if normalize; w *= scale
    decode_layer:        a whole decoder layer of a pure decode step (``ModelRunner._decode_planned``): rms_norm,
                         the packed q|k|v projection, qk_norm_rope_store, paged_decode, the o projection added
                         to x, rms_norm, the router's projection, route_softmax_topk, the packed experts added
                         to x -- those C++ calls in that order (``csrc/decode_layer.cpp``), one registry call
                         instead of nine; returns the expert ids [N, k]. Raw op only (``load_kernel()``).

Why: a bench_moe decode step (6 layers) at batch 1-32 issued ~35 torch ops per layer for norms,
q/k-norm, RoPE, the paged KV write and the router -- each 2-40 µs of dispatch and allocation on
one thread, about as much as the step's matmuls at batch 1. These loops do the same arithmetic
per row (row-independent, so batch-invariant), in one call each.

Equal to the torch references below (``*_torch``: the model's ``RMSNorm`` / ``rotate_half``
RoPE / ``TopKRouter`` softmax arithmetic, op for op) up to summation order and fused
multiply-adds: float64 to ~1e-15 relative, float32 to a few ulp (tests/kernels/test_decode_cpu.py).
The C++ is ``csrc/decode.cpp`` (``torch.ops.jointrl.*``, built by ``kernels/build``); ``load_kernel()`` is
None where it cannot be built, and callers then use the references (``rl/rollout/model_runner`` does).

Shapes: N rows, H hidden, Hq / Hkv query / key-value heads, D head_dim, G = Hq + Hkv normed heads,
F = (Hq + 2·Hkv)·D, P cache slots, E experts, k experts per token.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from jointrl.kernels.cpu_extension import load_ops
from jointrl.kernels.norm_rope_cpu import rms_norm_torch  # the one RMSNorm reference

__all__ = ["load_kernel", "rms_norm", "rms_norm_torch", "qk_norm_rope_store", "qk_norm_rope_store_torch",
           "route_softmax_topk", "route_softmax_topk_torch"]

@functools.cache
def load_kernel():
    """The ops (``kernels/cpu_extension.load_ops``), or None where they cannot be built here."""
    return load_ops(["rms_norm", "qk_norm_rope_store", "route_softmax_topk", "decode_layer"])


def rms_norm(x_NH: Tensor, w_H: Tensor, eps: float) -> Tensor:
    """x [N, H], w [H] (x's dtype, float32/64) → y [N, H]."""
    lib = load_kernel()
    if lib is None:
        return rms_norm_torch(x_NH, w_H, eps)
    return lib.rms_norm(x_NH.contiguous(), w_H.contiguous(), eps)


def qk_norm_rope_store_torch(qkv_NF: Tensor, w_GD: Tensor | None, eps: float, cos_ND: Tensor, sin_ND: Tensor,
                             kv_PCHD: Tensor, slot_N: Tensor, Hq: int, Hkv: int) -> Tensor:
    """The torch reference of ``qk_norm_rope_store`` (the runner's former per-layer ops)."""
    N, D = qkv_NF.shape[0], kv_PCHD.shape[-1]
    qk_NGD = qkv_NF[:, :(Hq + Hkv) * D].reshape(N, Hq + Hkv, D)
    if w_GD is not None:
        qk_NGD = rms_norm_torch(qk_NGD, w_GD, eps)
    x1, x2 = qk_NGD.chunk(2, dim=-1)
    qk_NGD = qk_NGD * cos_ND[:, None] + torch.cat((-x2, x1), dim=-1) * sin_ND[:, None]
    q_NHD, k_NHD = qk_NGD.split((Hq, Hkv), dim=1)
    v_NHD = qkv_NF[:, (Hq + Hkv) * D:].reshape(N, Hkv, D)
    kv_PCHD.index_copy_(0, slot_N, torch.stack((k_NHD, v_NHD), dim=1).to(kv_PCHD.dtype))
    return q_NHD.contiguous()


def qk_norm_rope_store(qkv_NF: Tensor, w_GD: Tensor | None, eps: float, cos_ND: Tensor, sin_ND: Tensor,
                       kv_PCHD: Tensor, slot_N: Tensor, Hq: int, Hkv: int) -> Tensor:
    """qkv [N, (Hq + 2·Hkv)·D], w [Hq + Hkv, D] or None (no q/k-norm), cos/sin [N, D], kv [P, 2, Hkv, D]
    (written at rows ``slot_N`` [N] int64), → q [N, Hq, D] after norm and RoPE. One dtype throughout
    (float32/64), except a bfloat16 cache under float32 (``rollout.kv_dtype``: keys and values rounded to
    nearest even as they are stored, as ``.to(torch.bfloat16)`` rounds); the torch reference otherwise
    and without a compiler."""
    lib = load_kernel()
    bf16_under_f32 = kv_PCHD.dtype == torch.bfloat16 and qkv_NF.dtype == torch.float32
    if lib is None or not (kv_PCHD.dtype == qkv_NF.dtype or bf16_under_f32) or not kv_PCHD.is_contiguous():
        return qk_norm_rope_store_torch(qkv_NF, w_GD, eps, cos_ND, sin_ND, kv_PCHD, slot_N, Hq, Hkv)
    w = w_GD.contiguous() if w_GD is not None else qkv_NF.new_empty(0)
    return lib.qk_norm_rope_store(qkv_NF.contiguous(), w, eps, cos_ND.contiguous(), sin_ND.contiguous(), kv_PCHD,
                                  slot_N.contiguous(), Hq, Hkv)


def route_softmax_topk_torch(logits_NE: Tensor, k: int, normalize: bool, scale: float = 1.0
                             ) -> tuple[Tensor, Tensor]:
    """``model.routing.TopKRouter``'s softmax path (float32/64 logits) → (ids [N, k] int64, weights [N, k])."""
    p_NE = torch.softmax(logits_NE, dim=-1)
    ids_Nk = torch.topk(p_NE, k, dim=-1).indices
    w_Nk = p_NE.gather(1, ids_Nk)
    if normalize:
        w_Nk = w_Nk / (w_Nk.sum(dim=-1, keepdim=True) + 1e-20)
    if scale != 1.0:
        w_Nk = w_Nk * scale
    return ids_Nk, w_Nk


def route_softmax_topk(logits_NE: Tensor, k: int, normalize: bool, scale: float = 1.0) -> tuple[Tensor, Tensor]:
    """logits [N, E] float32/64 → (ids [N, k] int64, by descending probability; weights [N, k])."""
    lib = load_kernel()
    if lib is None:
        return route_softmax_topk_torch(logits_NE, k, normalize, scale)
    ids_Nk, w_Nk = lib.route_softmax_topk(logits_NE.contiguous(), k, normalize, scale)
    return ids_Nk, w_Nk
