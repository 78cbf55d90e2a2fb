// The C++ of kernels/moe_cpu.py (its docstring states what each op computes and guarantees), registered
// as torch.ops.jointrl.* ops; built by kernels/build.py.
#include "prelude.h"
#include "panel.h"

namespace jointrl::moe {

#ifdef JOINTRL_SIMD
constexpr int64_t PREFETCH_BLOCKS = 2;  // how far ahead of the pass the weights are prefetched
// outs[n][o + r] = x_n . W_{o+r} for NT tokens x NR rows of W (NT · NR = the vector width): one vector
// accumulator per (row, token) over K, so each loaded row vector serves NT tokens and each token
// vector NR rows, their lanes summed together at the end (each sum in the same order, whatever the
// token's slot: a token's result does not depend on the tokens beside it).
template <typename T, int NT>
static inline void rows_dot_pass(const T* const* xs, const T* W, int64_t o, int64_t K, T* const* outs,
                                 const char* pf) {
  using Wv = Vec<T>;
  using V = typename Wv::V;
  constexpr int NR = Wv::L / NT;
  constexpr int64_t step = Wv::L * Wv::L * sizeof(T);  // bytes of the next block to prefetch per i step
  V acc[NR * NT];
  for (auto& a : acc) a = Wv::zero();
  for (int64_t i = 0; i < K; i += Wv::L) {
    if (pf != nullptr)
      for (int64_t b = 0; b < step; b += 64) __builtin_prefetch(pf + i / Wv::L * step + b, 0, 2);
    V xv[NT];
    for (int n = 0; n < NT; ++n) xv[n] = Wv::load(xs[n] + i);
    for (int r = 0; r < NR; ++r) {
      const V wv = Wv::load(W + (o + r) * K + i);
      for (int n = 0; n < NT; ++n) acc[r * NT + n] = Wv::fma(wv, xv[n], acc[r * NT + n]);
    }
  }
  alignas(32) T res[Wv::L];
  Wv::store(res, Wv::sums(acc));
  for (int r = 0; r < NR; ++r)
    for (int n = 0; n < NT; ++n) outs[n][o + r] = res[r * NT + n];
}

// rows_dot below for K a multiple of the vector width: W in blocks of L rows (in L1 while every token
// passes over them), tokens four, two, then one at a time; rows past the last full block one by one.
template <typename T>
static void rows_dot_simd(const T* const* xs, int64_t M, const T* W, int64_t O, int64_t K, T* const* outs) {
  constexpr int L = Vec<T>::L;
  int64_t o = 0;
  for (; o + L <= O; o += L) {
    // The first pass over this block prefetches the block PREFETCH_BLOCKS on, a few lines per step (the
    // weights come from memory, once per step: without it their loads stall the arithmetic, 1.5x
    // the time at bench_moe batch 32). Past the matrix's end it reads ahead into the next expert's.
    const char* pf = reinterpret_cast<const char*>(W + (o + PREFETCH_BLOCKS * L) * K);
    int64_t n = 0;
    for (; n + 4 <= M; n += 4)
      for (int r = 0; r < L; r += L / 4, pf = nullptr) rows_dot_pass<T, 4>(xs + n, W, o + r, K, outs + n, pf);
    for (; n + 2 <= M; n += 2)
      for (int r = 0; r < L; r += L / 2, pf = nullptr) rows_dot_pass<T, 2>(xs + n, W, o + r, K, outs + n, pf);
    for (; n < M; ++n, pf = nullptr) rows_dot_pass<T, 1>(xs + n, W, o, K, outs + n, pf);
  }
  for (; o < O; ++o)
    for (int64_t n = 0; n < M; ++n) {
      using V = typename Vec<T>::V;
      V acc[L];
      for (auto& a : acc) a = Vec<T>::zero();
      for (int64_t i = 0; i < K; i += L) acc[0] = Vec<T>::fma(Vec<T>::load(W + o * K + i), Vec<T>::load(xs[n] + i), acc[0]);
      alignas(32) T res[L];
      Vec<T>::store(res, Vec<T>::sums(acc));
      outs[n][o] = res[0];
    }
}
#endif

// out_n[o] = x_n . W_o for the M rows x_n (length K) and the O rows of W [O, K], four W rows per pass.
template <typename T>
static void rows_dot(const T* const* xs, int64_t M, const T* W, int64_t O, int64_t K, T* const* outs) {
#ifdef JOINTRL_SIMD
  if (K % Vec<T>::L == 0) return rows_dot_simd<T>(xs, M, W, O, K, outs);
#endif
  int64_t o = 0;
  for (; o + 4 <= O; o += 4) {
    const T* __restrict w0 = W + o * K;
    const T* __restrict w1 = w0 + K;
    const T* __restrict w2 = w1 + K;
    const T* __restrict w3 = w2 + K;
    for (int64_t n = 0; n < M; ++n) {
      const T* __restrict x = xs[n];
      T s0 = 0, s1 = 0, s2 = 0, s3 = 0;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
      for (int64_t i = 0; i < K; ++i) {
        s0 += x[i] * w0[i];
        s1 += x[i] * w1[i];
        s2 += x[i] * w2[i];
        s3 += x[i] * w3[i];
      }
      T* y = outs[n] + o;
      y[0] = s0, y[1] = s1, y[2] = s2, y[3] = s3;
    }
  }
  for (; o < O; ++o) {
    const T* __restrict w = W + o * K;
    for (int64_t n = 0; n < M; ++n) {
      const T* __restrict x = xs[n];
      T s = 0;
#pragma omp simd reduction(+ : s)
      for (int64_t i = 0; i < K; ++i) s += x[i] * w[i];
      outs[n][o] = s;
    }
  }
}

template <typename T>
static void experts(const T* x, const int64_t* ids, const T* wts, const T* gu, const T* down, T* y,
                    int64_t N, int64_t k, int64_t E, int64_t H, int64_t I) {
  const int64_t A = N * k;
  std::vector<int64_t> start(E + 1, 0), order(A);
  for (int64_t a = 0; a < A; ++a) {
    TORCH_CHECK(ids[a] >= 0 && ids[a] < E, "moe_experts: expert id ", ids[a], " out of range [0, ", E, ")");
    ++start[ids[a] + 1];
  }
  for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
  {
    std::vector<int64_t> fill(start.begin(), start.end() - 1);
    for (int64_t a = 0; a < A; ++a) order[fill[ids[a]]++] = a;  // grouped by expert, token order kept
  }
  std::vector<T> y_A(A * H);  // each assignment's expert output, summed per token below
  at::parallel_for(0, E, 1, [&](int64_t e0, int64_t e1) {
    std::vector<const T*> xs, hs;
    std::vector<T*> gs, ys, houts;
    std::vector<T> g, h;
    for (int64_t e = e0; e < e1; ++e) {
      const int64_t M = start[e + 1] - start[e];
      if (M == 0) continue;
      g.resize(M * 2 * I), h.resize(M * I);
      xs.resize(M), hs.resize(M), gs.resize(M), ys.resize(M), houts.resize(M);
      for (int64_t n = 0; n < M; ++n) {
        const int64_t a = order[start[e] + n];
        xs[n] = x + (a / k) * H;
        gs[n] = g.data() + n * 2 * I;
        hs[n] = houts[n] = h.data() + n * I;
        ys[n] = y_A.data() + a * H;
      }
      rows_dot<T>(xs.data(), M, gu + e * 2 * I * H, 2 * I, H, gs.data());
      for (int64_t n = 0; n < M; ++n) {
        const T* __restrict gn = gs[n];
        T* __restrict hn = houts[n];
#pragma omp simd
        for (int64_t i = 0; i < I; ++i) hn[i] = gn[i] / (T(1) + exp_(-gn[i])) * gn[I + i];
      }
      rows_dot<T>(hs.data(), M, down + e * H * I, H, I, ys.data());
    }
  });
  for (int64_t n = 0; n < N; ++n) {
    T* __restrict yn = y + n * H;
    std::fill(yn, yn + H, T(0));
    for (int64_t j = 0; j < k; ++j) {
      const T w = wts[n * k + j];
      const T* __restrict ya = y_A.data() + (n * k + j) * H;
#pragma omp simd
      for (int64_t i = 0; i < H; ++i) yn[i] += w * ya[i];
    }
  }
}

// How far ahead of its first pass over a panel ``linear_rows`` prefetches the weights (a line per k step):
// bench_moe batch 32, 6 layers streamed from memory, one thread: 3.5 ms without, 2.8-3.1 at 1-16 KB.
constexpr int64_t PANEL_PREFETCH_BYTES = 4096;

// The same sum over experts whose matrices are packed in linear_cpu's panels: each active expert's tokens
// gathered into rows, then two ``linear_rows`` calls (every panel read once while all its rows pass over it,
// no per-pass lane sums) with SwiGLU between them; each output one fused sum in k order, so a token's
// result does not depend on the tokens beside it. Past the last active expert's end the prefetch reads
// ahead into the next expert's panels (wasted if that expert is idle this step).
template <typename T, typename W = T>
static void experts_packed(const T* x, const int64_t* ids, const T* wts, const W* gu, const W* down, T* y,
                           int64_t N, int64_t k, int64_t E, int64_t H, int64_t I) {
  const int64_t A = N * k, gu_size = (2 * I + 15) / 16 * H * 16, down_size = (H + 15) / 16 * I * 16;
  std::vector<int64_t> start(E + 1, 0), order(A), pos(A);
  for (int64_t a = 0; a < A; ++a) {
    TORCH_CHECK(ids[a] >= 0 && ids[a] < E, "moe_experts: expert id ", ids[a], " out of range [0, ", E, ")");
    ++start[ids[a] + 1];
  }
  for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
  {
    std::vector<int64_t> fill(start.begin(), start.end() - 1);
    for (int64_t a = 0; a < A; ++a) pos[a] = fill[ids[a]]++, order[pos[a]] = a;
  }
  std::vector<T> y_A(A * H);  // expert outputs in expert order (row pos[a] for assignment a)
  at::parallel_for(0, E, 1, [&](int64_t e0, int64_t e1) {
    std::vector<T> xs, g, h;
    for (int64_t e = e0; e < e1; ++e) {
      const int64_t M = start[e + 1] - start[e];
      if (M == 0) continue;
      xs.resize(M * H), g.resize(M * 2 * I), h.resize(M * I);
      for (int64_t n = 0; n < M; ++n) {
        const T* xn = x + order[start[e] + n] / k * H;
        std::copy(xn, xn + H, xs.data() + n * H);
      }
      linear_rows<T, W>(xs.data(), M, H, gu + e * gu_size, 2 * I, g.data(), PANEL_PREFETCH_BYTES);
      for (int64_t n = 0; n < M; ++n) {
        const T* __restrict gn = g.data() + n * 2 * I;
        T* __restrict hn = h.data() + n * I;
#pragma omp simd
        for (int64_t i = 0; i < I; ++i) hn[i] = gn[i] / (T(1) + exp_(-gn[i])) * gn[I + i];
      }
      linear_rows<T, W>(h.data(), M, I, down + e * down_size, H, y_A.data() + start[e] * H, PANEL_PREFETCH_BYTES);
    }
  });
  for (int64_t n = 0; n < N; ++n) {
    T* __restrict yn = y + n * H;
    std::fill(yn, yn + H, T(0));
    for (int64_t j = 0; j < k; ++j) {
      const T w = wts[n * k + j];
      const T* __restrict ya = y_A.data() + pos[n * k + j] * H;
#pragma omp simd
      for (int64_t i = 0; i < H; ++i) yn[i] += w * ya[i];
    }
  }
}

torch::Tensor moe_experts_packed(torch::Tensor x, torch::Tensor ids, torch::Tensor wts, torch::Tensor gu,
                                 torch::Tensor down, int64_t I) {
  TORCH_CHECK(x.dim() == 2 && ids.dim() == 2 && ids.size(0) == x.size(0) && wts.sizes() == ids.sizes(),
              "moe_experts_packed: x [N, H], ids and weights [N, k]");
  TORCH_CHECK(x.is_contiguous() && ids.is_contiguous() && wts.is_contiguous() && gu.is_contiguous() &&
              down.is_contiguous(), "moe_experts_packed: contiguous inputs");
  const int64_t E = gu.size(0), H = x.size(1);
  TORCH_CHECK(gu.dim() == 4 && gu.size(1) == (2 * I + 15) / 16 && gu.size(2) == H && gu.size(3) == 16 &&
              down.dim() == 4 && down.size(0) == E && down.size(1) == (H + 15) / 16 && down.size(2) == I &&
              down.size(3) == 16, "moe_experts_packed: gate_up [E, ceil(2I/16), H, 16], down [E, ceil(H/16), I, 16]");
  TORCH_CHECK(gu.scalar_type() == down.scalar_type() && x.scalar_type() == wts.scalar_type() &&
              (x.scalar_type() == gu.scalar_type() ||
               (x.scalar_type() == torch::kFloat && gu.scalar_type() == torch::kBFloat16)),
              "moe_experts_packed: panels of x's dtype (or bfloat16 panels under a float32 x), routing weights in x's");
  auto y = torch::empty_like(x);
  if (gu.scalar_type() == torch::kBFloat16 && x.scalar_type() == torch::kFloat) {  // widened exactly on load
    experts_packed<float, uint16_t>(x.data_ptr<float>(), ids.data_ptr<int64_t>(), wts.data_ptr<float>(),
                                    reinterpret_cast<const uint16_t*>(gu.data_ptr<at::BFloat16>()),
                                    reinterpret_cast<const uint16_t*>(down.data_ptr<at::BFloat16>()),
                                    y.data_ptr<float>(), x.size(0), ids.size(1), E, H, I);
    return y;
  }
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "moe_experts_packed", [&] {
    experts_packed<scalar_t>(x.data_ptr<scalar_t>(), ids.data_ptr<int64_t>(), wts.data_ptr<scalar_t>(),
                             gu.data_ptr<scalar_t>(), down.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), x.size(0),
                             ids.size(1), E, H, I);
  });
  return y;
}

// pack_experts into bfloat16 panels out [E, ceil(O/16), K, 16] of a float32 w [E, O, K], where every weight
// is exactly a bfloat16 (its low 16 bits zero: MXFP4-dequantized weights are, e2m1 times a power of two).
// False at the first weight that is not (out is then partly written and must not be used).
bool pack_bf16_exact(torch::Tensor w, torch::Tensor out) {
  TORCH_CHECK(w.dim() == 3 && w.is_contiguous() && w.scalar_type() == torch::kFloat && out.is_contiguous() &&
              out.scalar_type() == torch::kBFloat16 && out.dim() == 4 && out.size(0) == w.size(0) &&
              out.size(1) == (w.size(1) + 15) / 16 && out.size(2) == w.size(2) && out.size(3) == 16,
              "pack_bf16_exact: float32 w [E, O, K] and bfloat16 out [E, ceil(O/16), K, 16], contiguous");
  const int64_t E = w.size(0), O = w.size(1), K = w.size(2), Q = out.size(1);
  const uint32_t* src = reinterpret_cast<const uint32_t*>(w.data_ptr<float>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  uint32_t low = 0;  // OR of every weight's low 16 bits
  for (int64_t e = 0; e < E; ++e)
    for (int64_t q = 0; q < Q; ++q) {
      uint16_t* P = dst + (e * Q + q) * K * 16;
      for (int64_t c = 0; c < 16; ++c) {
        const int64_t o = q * 16 + c;
        if (o >= O) {
          for (int64_t kk = 0; kk < K; ++kk) P[kk * 16 + c] = 0;
          continue;
        }
        const uint32_t* row = src + (e * O + o) * K;
        for (int64_t kk = 0; kk < K; ++kk) {
          low |= row[kk];
          P[kk * 16 + c] = uint16_t(row[kk] >> 16);
        }
      }
      if (low & 0xFFFFu) return false;
    }
  return true;
}

torch::Tensor moe_experts(torch::Tensor x, torch::Tensor ids, torch::Tensor wts, torch::Tensor gu,
                          torch::Tensor down) {
  TORCH_CHECK(x.is_contiguous() && ids.is_contiguous() && wts.is_contiguous() && gu.is_contiguous() &&
              down.is_contiguous(), "moe_experts: contiguous inputs");
  TORCH_CHECK(x.scalar_type() == gu.scalar_type() && x.scalar_type() == down.scalar_type() &&
              x.scalar_type() == wts.scalar_type(), "moe_experts: x, weights and routing weights differ in dtype");
  auto y = torch::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "moe_experts", [&] {
    experts<scalar_t>(x.data_ptr<scalar_t>(), ids.data_ptr<int64_t>(), wts.data_ptr<scalar_t>(),
                      gu.data_ptr<scalar_t>(), down.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), x.size(0),
                      ids.size(1), gu.size(0), x.size(1), down.size(2));
  });
  return y;
}

}  // namespace jointrl::moe

TORCH_LIBRARY_FRAGMENT(jointrl, m) {
  m.def("moe_experts(Tensor x, Tensor ids, Tensor wts, Tensor gu, Tensor dn) -> Tensor", &jointrl::moe::moe_experts);
  m.def("moe_experts_packed(Tensor x, Tensor ids, Tensor wts, Tensor gu, Tensor dn, int I) -> Tensor", &jointrl::moe::moe_experts_packed);
  m.def("pack_bf16_exact(Tensor w, Tensor(a!) out) -> bool", &jointrl::moe::pack_bf16_exact);
}
