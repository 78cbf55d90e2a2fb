"""Decode attention over a paged KV cache on CPU: a small C++ loop that reads every key and
value in place, beside the plain-torch reference it must equal.

One query token per sequence; ``o[b, h] = softmax(scale · q[b, h] · K_bᵀ) V_b`` over the
``context_lens[b]`` cached tokens of sequence b, whose token t sits in cache slot
``slots[b, t]`` (the engine expands block tables to slots once per step:
``block_table[b, t // bs] · bs + t % bs``). Query head h reads kv head
``h // (Hq / Hkv)``. The cache is the engine's fused ``kv_PCHD`` [slots, 2 (k, v), Hkv, D], in
q's dtype or, under a float32 q, in bfloat16 (``rollout.kv_dtype``: half the bytes to stream;
each element is widened exactly to float32 as it is read, all arithmetic stays float32).

Why C++ on CPU: in torch, paged attention must first gather every sequence's keys into a
padded tensor (a copy of the whole KV cache per layer per step), which costs more than the
attention itself; this loop reads each key once, where it lies. It is compiled on first use
(``kernels/cpu_extension``); without a compiler ``paged_decode`` falls back to the torch
reference. Scores and softmax run in the input dtype (float32, or float64 for float64); the dot
products may be summed in any order (vectorized), never with fast-math's finite-only rules.
Per sequence, all heads at once, keys in tiles of 16 tokens with an online softmax (running max
and sum; the accumulator rescaled when the max grows): a tile's key and value rows are read once,
together, while they sit in L1 -- the cache is streamed, which is what bounds this kernel (it reads
every cached byte once per step). Scores four keys per pass; exp vectorized (glibc's libmvec on
x86-64, <= 4 ulp). Parallel over sequences with torch's intra-op threads.

Shapes: B sequences, Hq/Hkv heads, D head_dim, P cache slots, S the longest context.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from jointrl.kernels.cpu_extension import load_cpu_extension

__all__ = ["paged_decode", "paged_decode_torch", "load_kernel"]

_SOURCE = r"""
// A cached element as the compute type T: the same type, or bfloat16 bits (uint16_t) widened
// exactly (the top half of a float32), which vectorizes as a zero-extend and a shift.
template <typename T, typename K>
static inline T widen(K x) {
  if constexpr (std::is_same_v<K, uint16_t>) return T(__builtin_bit_cast(float, uint32_t(x) << 16));
  else return x;
}

// Scores of one kv head over a tile of nt tokens: s[j * ld + t] = scale * q_j . k_t for the g query
// heads j of the group, four tokens per pass (four independent sums keep the FMA units busy).
template <typename T, typename K, int64_t DC>
static void scores(const T* q, const K* kv, const int64_t* slots, int64_t nt, int64_t g, int64_t D_,
                   int64_t slot_stride, T scale, T* s, int64_t ld) {
  const int64_t D = DC > 0 ? DC : D_;  // a compile-time head_dim unrolls the d loops
  int64_t t = 0;
  for (; t + 4 <= nt; t += 4) {
    const K* __restrict k0 = kv + slots[t] * slot_stride;
    const K* __restrict k1 = kv + slots[t + 1] * slot_stride;
    const K* __restrict k2 = kv + slots[t + 2] * slot_stride;
    const K* __restrict k3 = kv + slots[t + 3] * slot_stride;
    for (int64_t j = 0; j < g; ++j) {
      const T* __restrict qj = q + j * D;
      T s0 = 0, s1 = 0, s2 = 0, s3 = 0;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
      for (int64_t d = 0; d < D; ++d) {
        s0 += qj[d] * widen<T>(k0[d]);
        s1 += qj[d] * widen<T>(k1[d]);
        s2 += qj[d] * widen<T>(k2[d]);
        s3 += qj[d] * widen<T>(k3[d]);
      }
      T* sj = s + j * ld + t;
      sj[0] = s0 * scale, sj[1] = s1 * scale, sj[2] = s2 * scale, sj[3] = s3 * scale;
    }
  }
  for (; t < nt; ++t) {
    const K* __restrict k = kv + slots[t] * slot_stride;
    for (int64_t j = 0; j < g; ++j) {
      const T* __restrict qj = q + j * D;
      T s0 = 0;
#pragma omp simd reduction(+ : s0)
      for (int64_t d = 0; d < D; ++d) s0 += qj[d] * widen<T>(k[d]);
      s[j * ld + t] = s0 * scale;
    }
  }
}

// acc_j += sum_t p[j * ld + t] * v_t over a tile, four tokens per pass.
template <typename T, typename K, int64_t DC>
static void weighted_values(const T* p, const K* kv, const int64_t* slots, int64_t nt, int64_t g, int64_t D_,
                            int64_t slot_stride, T* acc, int64_t ld) {
  const int64_t D = DC > 0 ? DC : D_;  // a compile-time head_dim unrolls the d loops
  int64_t t = 0;
  for (; t + 4 <= nt; t += 4) {
    const K* __restrict v0 = kv + slots[t] * slot_stride;
    const K* __restrict v1 = kv + slots[t + 1] * slot_stride;
    const K* __restrict v2 = kv + slots[t + 2] * slot_stride;
    const K* __restrict v3 = kv + slots[t + 3] * slot_stride;
    for (int64_t j = 0; j < g; ++j) {
      const T* pj = p + j * ld + t;
      const T p0 = pj[0], p1 = pj[1], p2 = pj[2], p3 = pj[3];
      T* __restrict a = acc + j * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d)
        a[d] += p0 * widen<T>(v0[d]) + p1 * widen<T>(v1[d]) + p2 * widen<T>(v2[d]) + p3 * widen<T>(v3[d]);
    }
  }
  for (; t < nt; ++t) {
    const K* __restrict v = kv + slots[t] * slot_stride;
    for (int64_t j = 0; j < g; ++j) {
      const T pj = p[j * ld + t];
      T* __restrict a = acc + j * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) a[d] += pj * widen<T>(v[d]);
    }
  }
}

// One sequence per task, all heads, keys in tiles of TILE tokens with an online softmax (running
// max m and sum l per query head; acc rescaled when m grows), so each tile's key and value rows
// (whole cache slots) are read once, together, while they sit in L1.
template <typename T, typename K, int64_t DC>
static void decode(const T* q, const K* kv, T* out, const int64_t* slots, const int64_t* ctx,
                   int64_t B, int64_t Hq, int64_t Hkv, int64_t D_, int64_t S, T scale) {
  const int64_t D = DC > 0 ? DC : D_;
  constexpr int64_t TILE = 16;
  const int64_t g = Hq / Hkv, slot_stride = 2 * Hkv * D, v_off = Hkv * D;
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> s(Hq * TILE), acc(Hq * D), m(Hq), l(Hq);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n = ctx[b];
      const int64_t* sl = slots + b * S;
      const T* qb = q + b * Hq * D;
      std::fill(acc.begin(), acc.end(), T(0));
      std::fill(m.begin(), m.end(), -std::numeric_limits<T>::infinity());
      std::fill(l.begin(), l.end(), T(0));
      for (int64_t t0 = 0; t0 < n; t0 += TILE) {
        const int64_t nt = std::min(TILE, n - t0);
        for (int64_t h = 0; h < Hkv; ++h)
          scores<T, K, DC>(qb + h * g * D, kv + h * D, sl + t0, nt, g, D, slot_stride, scale, s.data() + h * g * TILE, TILE);
        for (int64_t i = 0; i < Hq; ++i) {
          T* __restrict si = s.data() + i * TILE;
          T mx = m[i];
          for (int64_t t = 0; t < nt; ++t) mx = std::max(mx, si[t]);
          const T alpha = exp_(m[i] - mx);  // exp(-inf) = 0 on the first tile
          T sum = 0;
#pragma omp simd reduction(+ : sum)
          for (int64_t t = 0; t < nt; ++t) {
            si[t] = exp_(si[t] - mx);
            sum += si[t];
          }
          l[i] = l[i] * alpha + sum;
          m[i] = mx;
          if (alpha != T(1)) {
            T* __restrict a = acc.data() + i * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) a[d] *= alpha;
          }
        }
        for (int64_t h = 0; h < Hkv; ++h)
          weighted_values<T, K, DC>(s.data() + h * g * TILE, kv + v_off + h * D, sl + t0, nt, g, D, slot_stride,
                             acc.data() + h * g * D, TILE);
      }
      T* ob = out + b * Hq * D;
      for (int64_t i = 0; i < Hq; ++i)
        for (int64_t d = 0; d < D; ++d) ob[i * D + d] = n ? acc[i * D + d] / l[i] : T(0);
    }
  });
}

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor kv, torch::Tensor slots, torch::Tensor ctx,
                           double scale) {
  TORCH_CHECK(q.is_contiguous() && kv.is_contiguous() && slots.is_contiguous() && ctx.is_contiguous(),
              "paged_decode: contiguous inputs");
  const bool bf16_kv = kv.scalar_type() == at::kBFloat16;
  TORCH_CHECK(q.scalar_type() == kv.scalar_type() || (bf16_kv && q.scalar_type() == at::kFloat),
              "paged_decode: kv must have q's dtype, or be bfloat16 for a float32 q");
  auto out = torch::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "paged_decode", [&] {
    auto run = [&](auto* kv_ptr) {
      using K = std::remove_const_t<std::remove_pointer_t<decltype(kv_ptr)>>;
      auto go = [&](auto dc) {
        decode<scalar_t, K, decltype(dc)::value>(q.data_ptr<scalar_t>(), kv_ptr, out.data_ptr<scalar_t>(),
                                                 slots.data_ptr<int64_t>(), ctx.data_ptr<int64_t>(), q.size(0),
                                                 q.size(1), kv.size(2), q.size(2), slots.size(1),
                                                 static_cast<scalar_t>(scale));
      };
      if (q.size(2) == 64) go(std::integral_constant<int64_t, 64>());
      else if (q.size(2) == 128) go(std::integral_constant<int64_t, 128>());
      else go(std::integral_constant<int64_t, 0>());
    };
    if (bf16_kv) run(reinterpret_cast<const uint16_t*>(kv.data_ptr()));
    else run(kv.data_ptr<scalar_t>());
  });
  return out;
}
"""


@functools.cache
def load_kernel():
    """The compiled extension, or None when it cannot be built here (no compiler)."""
    return load_cpu_extension("jointrl_paged_decode_cpu", _SOURCE, ["paged_decode"])


def paged_decode_torch(q_BHD: Tensor, kv_PCHD: Tensor, slots_BS: Tensor, ctx_B: Tensor, scale: float) -> Tensor:
    """The reference: gather every sequence's keys/values (padded to S, masked), then softmax attention."""
    B, Hq, D = q_BHD.shape
    Hkv, S = kv_PCHD.shape[2], slots_BS.shape[1]
    kv_BSCHD = kv_PCHD.index_select(0, slots_BS.reshape(-1)).view(B, S, 2, Hkv, D).to(q_BHD.dtype)
    q_BHgD = q_BHD.view(B, Hkv, Hq // Hkv, D)
    scores_BHgS = torch.einsum("bhgd,bshd->bhgs", q_BHgD, kv_BSCHD[:, :, 0]) * scale
    pad_B11S = (torch.arange(S)[None, :] >= ctx_B[:, None])[:, None, None, :]
    p_BHgS = torch.softmax(scores_BHgS.masked_fill(pad_B11S, -torch.inf), dim=-1).nan_to_num(0.0)
    return torch.einsum("bhgs,bshd->bhgd", p_BHgS, kv_BSCHD[:, :, 1]).reshape(B, Hq, D)


def paged_decode(q_BHD: Tensor, kv_PCHD: Tensor, slots_BS: Tensor, ctx_B: Tensor, scale: float) -> Tensor:
    """q [B, Hq, D], kv [P, 2, Hkv, D] (q's dtype, or bfloat16 under a float32 q), slots [B, S] int64
    (entries past ctx_B[b] unread), ctx [B] int64 → out [B, Hq, D]. The C++ kernel when it builds
    here, else the torch reference."""
    if q_BHD.dim() != 3 or kv_PCHD.dim() != 4 or kv_PCHD.shape[1] != 2 or slots_BS.shape[0] != q_BHD.shape[0]:
        raise ValueError(f"paged_decode: q [B, Hq, D], kv [P, 2, Hkv, D], slots [B, S]; got {tuple(q_BHD.shape)}, "
                         f"{tuple(kv_PCHD.shape)}, {tuple(slots_BS.shape)}")
    kernel = load_kernel()
    if kernel is None:
        return paged_decode_torch(q_BHD, kv_PCHD, slots_BS, ctx_B, scale)
    return kernel.paged_decode(q_BHD.contiguous(), kv_PCHD, slots_BS.contiguous(), ctx_B.contiguous(), scale)
