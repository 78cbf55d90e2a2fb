"""Decode attention over a paged KV cache on CPU: a small C++ loop that reads every key and
value in place, beside the plain-torch reference it must equal.

One query token per sequence; ``o[b, h] = softmax(scale · q[b, h] · K_bᵀ) V_b`` over the
``context_lens[b]`` cached tokens of sequence b, whose token t sits in cache slot
``slots[b, t]`` (the engine expands block tables to slots once per step:
``block_table[b, t // bs] · bs + t % bs``). Query head h reads kv head
``h // (Hq / Hkv)``. The cache is the engine's fused ``kv_PCHD`` [slots, 2 (k, v), Hkv, D].

Why C++ on CPU: in torch, paged attention must first gather every sequence's keys into a
padded tensor (a copy of the whole KV cache per layer per step), which costs more than the
attention itself; this loop reads each key once, where it lies. It is compiled on first use
with ``torch.utils.cpp_extension.load_inline`` (about a minute, cached in
``~/.cache/torch_extensions``); without a compiler ``paged_decode`` falls back to the torch
reference. Scores and softmax run in the input dtype (float32, or float64 for float64); the dot
products may be summed in any order (vectorized), never with fast-math's finite-only rules.
Parallel over (sequence, kv head) with torch's intra-op threads.

Shapes: B sequences, Hq/Hkv heads, D head_dim, P cache slots, S the longest context.
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch import Tensor

__all__ = ["paged_decode", "paged_decode_torch", "load_kernel"]

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <limits>
#include <vector>

template <typename T>
static void decode(const T* q, const T* kv, T* out, const int64_t* slots, const int64_t* ctx,
                   int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t S, T scale) {
  const int64_t g = Hq / Hkv, slot_stride = 2 * Hkv * D, v_off = Hkv * D;
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> scores, acc(g * D);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / Hkv, h = i % Hkv, n = ctx[b];
      const T* qb = q + (b * Hq + h * g) * D;
      T* ob = out + (b * Hq + h * g) * D;
      scores.assign(g * n, T(0));
      for (int64_t t = 0; t < n; ++t) {
        const T* k = kv + slots[b * S + t] * slot_stride + h * D;
        for (int64_t j = 0; j < g; ++j) {
          const T* __restrict qj = qb + j * D;
          T s = 0;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < D; ++d) s += qj[d] * k[d];
          scores[j * n + t] = s * scale;
        }
      }
      std::fill(acc.begin(), acc.end(), T(0));
      std::vector<T> denom(g, T(0));
      for (int64_t j = 0; j < g; ++j) {
        T mx = -std::numeric_limits<T>::infinity();
        for (int64_t t = 0; t < n; ++t) mx = std::max(mx, scores[j * n + t]);
        for (int64_t t = 0; t < n; ++t) {
          T p = std::exp(scores[j * n + t] - mx);
          scores[j * n + t] = p;
          denom[j] += p;
        }
      }
      for (int64_t t = 0; t < n; ++t) {
        const T* v = kv + slots[b * S + t] * slot_stride + v_off + h * D;
        for (int64_t j = 0; j < g; ++j) {
          const T p = scores[j * n + t];
          T* __restrict a = acc.data() + j * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) a[d] += p * v[d];
        }
      }
      for (int64_t j = 0; j < g; ++j)
        for (int64_t d = 0; d < D; ++d) ob[j * D + d] = n ? acc[j * D + d] / denom[j] : T(0);
    }
  });
}

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor kv, torch::Tensor slots, torch::Tensor ctx,
                           double scale) {
  TORCH_CHECK(q.is_contiguous() && kv.is_contiguous() && slots.is_contiguous() && ctx.is_contiguous(),
              "paged_decode: contiguous inputs");
  TORCH_CHECK(q.scalar_type() == kv.scalar_type(), "paged_decode: q and kv dtypes differ");
  auto out = torch::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "paged_decode", [&] {
    decode<scalar_t>(q.data_ptr<scalar_t>(), kv.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                     slots.data_ptr<int64_t>(), ctx.data_ptr<int64_t>(), q.size(0), q.size(1), kv.size(2),
                     q.size(2), slots.size(1), static_cast<scalar_t>(scale));
  });
  return out;
}
"""


@functools.cache
def load_kernel():
    """The compiled extension, or None when it cannot be built here (no compiler)."""
    try:
        from torch.utils.cpp_extension import load_inline

        return load_inline(name="jointrl_paged_decode_cpu", cpp_sources=_SOURCE, functions=["paged_decode"],
                           extra_cflags=["-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno",
                                                 "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math"], verbose=False)
    except Exception as e:  # no toolchain: the torch reference still works
        warnings.warn(f"paged_decode: C++ kernel unavailable, using the torch reference ({e})")
        return None


def paged_decode_torch(q_BHD: Tensor, kv_PCHD: Tensor, slots_BS: Tensor, ctx_B: Tensor, scale: float) -> Tensor:
    """The reference: gather every sequence's keys/values (padded to S, masked), then softmax attention."""
    B, Hq, D = q_BHD.shape
    Hkv, S = kv_PCHD.shape[2], slots_BS.shape[1]
    kv_BSCHD = kv_PCHD.index_select(0, slots_BS.reshape(-1)).view(B, S, 2, Hkv, D)
    q_BHgD = q_BHD.view(B, Hkv, Hq // Hkv, D)
    scores_BHgS = torch.einsum("bhgd,bshd->bhgs", q_BHgD, kv_BSCHD[:, :, 0]) * scale
    pad_B11S = (torch.arange(S)[None, :] >= ctx_B[:, None])[:, None, None, :]
    p_BHgS = torch.softmax(scores_BHgS.masked_fill(pad_B11S, -torch.inf), dim=-1).nan_to_num(0.0)
    return torch.einsum("bhgs,bshd->bhgd", p_BHgS, kv_BSCHD[:, :, 1]).reshape(B, Hq, D)


def paged_decode(q_BHD: Tensor, kv_PCHD: Tensor, slots_BS: Tensor, ctx_B: Tensor, scale: float) -> Tensor:
    """q [B, Hq, D], kv [P, 2, Hkv, D], slots [B, S] int64 (entries past ctx_B[b] unread), ctx [B] int64
    → out [B, Hq, D]. The C++ kernel when it builds here, else the torch reference."""
    if q_BHD.dim() != 3 or kv_PCHD.dim() != 4 or kv_PCHD.shape[1] != 2 or slots_BS.shape[0] != q_BHD.shape[0]:
        raise ValueError(f"paged_decode: q [B, Hq, D], kv [P, 2, Hkv, D], slots [B, S]; got {tuple(q_BHD.shape)}, "
                         f"{tuple(kv_PCHD.shape)}, {tuple(slots_BS.shape)}")
    kernel = load_kernel()
    if kernel is None:
        return paged_decode_torch(q_BHD, kv_PCHD, slots_BS, ctx_B, scale)
    return kernel.paged_decode(q_BHD.contiguous(), kv_PCHD, slots_BS.contiguous(), ctx_B.contiguous(), scale)
