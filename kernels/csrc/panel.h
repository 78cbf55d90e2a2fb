// y = x W^T over weights packed in panels of 16 output columns (kernels/linear_cpu.py's `pack`): linear_rows,
// shared by linear.cpp and moe.cpp's packed experts.
#pragma once
#include "prelude.h"

#ifdef JOINTRL_SIMD
// acc[m][v] += x[m, k] * P[k, v·L .. v·L + L) for k = 0..K-1: MR rows x 16 columns of one panel. The
// panel's elements are T, or bfloat16 bits (W = uint16_t) under a float T, widened exactly on load.
template <typename T, int MR, typename W = T>
__attribute__((always_inline)) static inline void panel_rows(const T* __restrict x, int64_t K, const W* __restrict P, T* y, int64_t O,
                              int64_t o0, const char* pf) {
  using Vt = Vec<T>;
  using V = typename Vt::V;
  constexpr int L = Vt::L, NV = 16 / L;
  V acc[MR][NV];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) acc[m][v] = Vt::zero();
  for (int64_t k = 0; k < K; ++k) {
    if (pf != nullptr)
      for (int64_t b = 0; b < int64_t(16 * sizeof(W)); b += 64) __builtin_prefetch(pf + k * 16 * sizeof(W) + b, 0, 3);
    V w[NV];
    for (int v = 0; v < NV; ++v) w[v] = Vt::load(P + k * 16 + v * L);
    for (int m = 0; m < MR; ++m) {
      const V xb = Vt::set1(x[m * K + k]);
      for (int v = 0; v < NV; ++v) acc[m][v] = Vt::fma(w[v], xb, acc[m][v]);
    }
  }
  const int64_t ncol = std::min<int64_t>(16, O - o0);
  for (int m = 0; m < MR; ++m) {
    if (ncol == 16) {
      for (int v = 0; v < NV; ++v) Vt::store(y + m * O + o0 + v * L, acc[m][v]);
    } else {
      alignas(32) T tmp[16];
      for (int v = 0; v < NV; ++v) Vt::store(tmp + v * L, acc[m][v]);
      for (int64_t c = 0; c < ncol; ++c) y[m * O + o0 + c] = tmp[c];
    }
  }
}
#endif

// A panel element as T: bfloat16 bits (uint16_t) widened exactly into a float, else itself.
template <typename T, typename W>
static inline T widen(W w) {
  if constexpr (std::is_same_v<W, uint16_t>) {
    const uint32_t bits = uint32_t(w) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
  } else {
    return w;
  }
}

template <typename T, typename W = T>
__attribute__((noinline)) static void linear_rows(const T* x, int64_t N, int64_t K, const W* P, int64_t O, T* y,
                                                  int64_t pf_bytes = 0) {
  const int64_t Q = (O + 15) / 16;
  for (int64_t q = 0; q < Q; ++q) {
    const W* Pq = P + q * K * 16;
#ifdef JOINTRL_SIMD
    constexpr int MR = std::is_same_v<T, float> ? 6 : 3;  // MR x 16 / L accumulators: 12 vector registers
    // The first pass over a panel prefetches the weights pf_bytes ahead, a line per k (0: none).
    const char* pf = pf_bytes > 0 ? reinterpret_cast<const char*>(Pq) + pf_bytes : nullptr;
    int64_t n = 0;
    for (; n + MR <= N; n += MR, pf = nullptr) panel_rows<T, MR, W>(x + n * K, K, Pq, y + n * O, O, q * 16, pf);
    switch (N - n) {  // the last rows, with the same per-output order
      case 5: if constexpr (MR > 5) panel_rows<T, 5, W>(x + n * K, K, Pq, y + n * O, O, q * 16, pf); break;
      case 4: if constexpr (MR > 4) panel_rows<T, 4, W>(x + n * K, K, Pq, y + n * O, O, q * 16, pf); break;
      case 3: if constexpr (MR > 3) panel_rows<T, 3, W>(x + n * K, K, Pq, y + n * O, O, q * 16, pf); break;
      case 2: panel_rows<T, 2, W>(x + n * K, K, Pq, y + n * O, O, q * 16, pf); break;
      case 1: panel_rows<T, 1, W>(x + n * K, K, Pq, y + n * O, O, q * 16, pf); break;
      default: break;
    }
#else
    const int64_t ncol = std::min<int64_t>(16, O - q * 16);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t c = 0; c < ncol; ++c) {
        T s = 0;
        for (int64_t k = 0; k < K; ++k) s = std::fma(x[n * K + k], widen<T>(Pq[k * 16 + c]), s);
        y[n * O + q * 16 + c] = s;
      }
#endif
  }
}
