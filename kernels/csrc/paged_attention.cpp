// The C++ of kernels/paged_attention_cpu.py (its docstring states what each op computes and guarantees), registered
// as torch.ops.jointrl.* ops; built by kernels/build.py.
#include "prelude.h"
#include <numeric>

namespace jointrl::paged_attention {

constexpr int64_t TILE = 16;      // keys per online-softmax step
constexpr int64_t LD = TILE + 16;  // a row of scores: a tile, plus room for a pass of keys to run past it

// A cached element as the compute type T: the same type, or bfloat16 bits (uint16_t) widened
// exactly (the top half of a float32), which vectorizes as a zero-extend and a shift.
template <typename T, typename K>
static inline T widen(K x) {
  if constexpr (std::is_same_v<K, uint16_t>) return T(__builtin_bit_cast(float, uint32_t(x) << 16));
  else return x;
}

// The next tile's cache rows, prefetched (into L2) line by line in address order -- each row whole, row
// after row -- a few lines between the dot products' steps, so that the requests go out at about the rate
// memory answers them. (Issued in bursts -- the whole tile at its start, a few rows per pass of keys -- they
// fill the core's miss buffers and this tile's own loads wait behind them: one thread, 6 layers of
// 50 rows x 600 keys in 2 MiB pages, medians of 5 alternated runs, 1.36 us per tile (the old per-head
// bursts) and 1.8 (the whole tile at its start) against 0.93; 32 x 320 keys 1.11 -> 0.70; rows whose keys
// sit in cache ~0.1 us per tile slower.) The cursor: byte ``off`` of row ``row``.
struct Prefetch {
  const char* const* rows;
  int64_t n_rows, row_bytes, row = 0, off = 0;
  void rest() {
    for (; row < n_rows; ++row, off = 0)
      for (; off < row_bytes; off += 64) __builtin_prefetch(rows[row] + off, 0, 2);
  }
};

#ifdef JOINTRL_SIMD
// s[j * LD + t] = scale · q_j · k_t for the tile's nt keys (rows kr[t]) and the g query heads q_j of one
// kv head. NK keys x NJ heads per pass (NK · NJ = the vector width, NJ divides g): one vector
// accumulator per (key, head) over head_dim, so each loaded key vector serves the NJ heads, and the
// lanes of all NK · NJ accumulators are summed together at the end (no horizontal sum per dot
// product). A pass past nt repeats the last key; its scores land in the row's padding, never read.
// While the passes run, the next pf_lines lines of pf go out, spread evenly over the steps of the dot
// products (the cursor held in registers).
template <typename T, typename K, int NK, int64_t DC, typename W = Vec<T>>
static void scores_simd(const T* q, const K* const* kr, int64_t nt, int64_t g, int64_t D_, T scale, T* s,
                        Prefetch& pf, int64_t pf_lines) {
  using V = typename W::V;
  constexpr int NJ = W::L / NK;
  const int64_t D = DC > 0 ? DC : D_;
  const int64_t steps = (nt + NK - 1) / NK * ((g + NJ - 1) / NJ) * (D / W::L);
  const int64_t per_step = (pf_lines + steps - 1) / steps, row_bytes = pf.row_bytes;
  const char* const* rows = pf.rows;
  int64_t row = pf.row, off = pf.off, left = pf_lines;
  for (int64_t t = 0; t < nt; t += NK) {
    const K* k[NK];
    for (int kk = 0; kk < NK; ++kk) k[kk] = kr[std::min<int64_t>(t + kk, nt - 1)];
    for (int64_t j0 = 0; j0 < g; j0 += NJ) {
      V acc[NJ * NK];
      for (auto& a : acc) a = W::zero();
      for (int64_t d = 0; d < D; d += W::L) {
        for (int64_t u = 0; u < per_step && left > 0 && row < pf.n_rows; ++u, --left) {
          __builtin_prefetch(rows[row] + off, 0, 2);
          if ((off += 64) >= row_bytes) off = 0, ++row;
        }
        V kv[NK];
        for (int kk = 0; kk < NK; ++kk) kv[kk] = W::load(k[kk] + d);
        for (int jj = 0; jj < NJ; ++jj) {
          const V qv = W::load(q + (j0 + jj) * D + d);
          for (int kk = 0; kk < NK; ++kk) acc[jj * NK + kk] = W::fma(qv, kv[kk], acc[jj * NK + kk]);
        }
      }
      alignas(64) T r[W::L];
      W::store(r, W::mul(W::sums(acc), W::set1(scale)));
      for (int jj = 0; jj < NJ; ++jj)
        for (int kk = 0; kk < NK; ++kk) s[(j0 + jj) * LD + t + kk] = r[jj * NK + kk];
    }
  }
  pf.row = row, pf.off = off;
}

// For NH query heads h of one kv head: acc_h[0, NV·L) = alpha_h · acc_h + Σ_t p_h[t] · v_t[off, off + NV·L)
// over the tile's nt value rows vr[t], the accumulators held in registers across the tile; each value
// vector is loaded once for the NH heads. Per element the same operations in the same order whatever NH.
template <typename T, typename K, int NV, int NH, typename W = Vec<T>>
static inline void values_simd(const T* const* p, const K* const* vr, int64_t off, int64_t nt, const T* alpha,
                               T* const* acc) {
  using V = typename W::V;
  V a[NH][NV];
  for (int h = 0; h < NH; ++h) {
    const V al = W::set1(alpha[h]);
    for (int i = 0; i < NV; ++i) a[h][i] = W::mul(W::load(acc[h] + off + i * W::L), al);
  }
  for (int64_t t = 0; t < nt; ++t) {
    V pt[NH];
    for (int h = 0; h < NH; ++h) pt[h] = W::set1(p[h][t]);
    const K* v = vr[t] + off;
    for (int i = 0; i < NV; ++i) {
      const V x = W::load(v + i * W::L);
      for (int h = 0; h < NH; ++h) a[h][i] = W::fma(pt[h], x, a[h][i]);
    }
  }
  for (int h = 0; h < NH; ++h)
    for (int i = 0; i < NV; ++i) W::store(acc[h] + off + i * W::L, a[h][i]);
}

// values_simd over a whole head_dim D for NH heads (a multiple of the vector width).
template <typename T, typename K, int NH, typename W = Vec<T>>
static void values_row(const T* const* p, const K* const* vr, int64_t nt, int64_t D, const T* alpha, T* const* acc) {
  constexpr int64_t L = W::L;
  int64_t d = 0;  // 8 vectors per head per pass (NH = 2: 16 accumulators)
  for (; d + 8 * L <= D; d += 8 * L) values_simd<T, K, 8, NH, W>(p, vr, d, nt, alpha, acc);
  switch ((D - d) / L) {
    case 7: values_simd<T, K, 7, NH, W>(p, vr, d, nt, alpha, acc); break;
    case 6: values_simd<T, K, 6, NH, W>(p, vr, d, nt, alpha, acc); break;
    case 5: values_simd<T, K, 5, NH, W>(p, vr, d, nt, alpha, acc); break;
    case 4: values_simd<T, K, 4, NH, W>(p, vr, d, nt, alpha, acc); break;
    case 3: values_simd<T, K, 3, NH, W>(p, vr, d, nt, alpha, acc); break;
    case 2: values_simd<T, K, 2, NH, W>(p, vr, d, nt, alpha, acc); break;
    case 1: values_simd<T, K, 1, NH, W>(p, vr, d, nt, alpha, acc); break;
    default: break;
  }
}
#endif

// Without AVX2 + FMA, or a head_dim that is not a multiple of the vector width: the compiler's
// vectorization of each dot product (a horizontal sum per key and head), four keys per pass.
template <typename T, typename K, int64_t DC>
static void scores(const T* q, const K* const* kr, int64_t nt, int64_t g, int64_t D_, T scale, T* s) {
  const int64_t D = DC > 0 ? DC : D_;
  int64_t t = 0;
  for (; t + 4 <= nt; t += 4) {
    const K* __restrict k0 = kr[t];
    const K* __restrict k1 = kr[t + 1];
    const K* __restrict k2 = kr[t + 2];
    const K* __restrict k3 = kr[t + 3];
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
      T* sj = s + j * LD + t;
      sj[0] = s0 * scale, sj[1] = s1 * scale, sj[2] = s2 * scale, sj[3] = s3 * scale;
    }
  }
  for (; t < nt; ++t) {
    const K* __restrict k = kr[t];
    for (int64_t j = 0; j < g; ++j) {
      const T* __restrict qj = q + j * D;
      T s0 = 0;
#pragma omp simd reduction(+ : s0)
      for (int64_t d = 0; d < D; ++d) s0 += qj[d] * widen<T>(k[d]);
      s[j * LD + t] = s0 * scale;
    }
  }
}

template <typename T, typename K>
static void values(const T* p, const K* const* vr, int64_t nt, int64_t D, T alpha, T* __restrict acc) {
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) acc[d] *= alpha;
  for (int64_t t = 0; t < nt; ++t) {
    const K* __restrict v = vr[t];
    const T pt = p[t];
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) acc[d] += pt * widen<T>(v[d]);
  }
}

// At most this many rows per group (group_rows): their accumulators stay in L1/L2.
constexpr int64_t GMAX = 16;

struct Group {
  int64_t begin, end;  // a run of order[]
  int64_t shared;      // keys [0, shared) sit in the same cache slots for every row of the group (a multiple of TILE)
};

// Rows that read the same cache slots for their first keys -- the samples of a GRPO group forked from one
// prompt (copy-on-write blocks), prompts that hit the prefix cache -- are grouped, so that each shared tile
// is streamed from memory once for the whole group instead of once per row: rows ordered by their first
// slot, runs of equal first slots cut to GMAX rows, and a run's shared span the longest whole-tile prefix
// on which all its rows' slots agree (within every row's context). A row's arithmetic does not depend on
// its group: it adds the same tiles in the same order either way (bit for bit the same result).
static std::vector<Group> group_rows(const int64_t* slots, const int64_t* ctx, int64_t B, int64_t S,
                                     std::vector<int64_t>& order) {
  order.resize(B);
  std::iota(order.begin(), order.end(), int64_t(0));
  auto key = [&](int64_t b) { return ctx[b] > 0 ? slots[b * S] : -1 - b; };
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return key(a) < key(b); });
  std::vector<Group> groups;
  for (int64_t i = 0; i < B;) {
    int64_t j = i + 1;
    while (j < B && j - i < GMAX && ctx[order[j]] > 0 && key(order[j]) == key(order[i])) ++j;
    int64_t shared = 0;
    if (j - i > 1) {
      int64_t n = ctx[order[i]];
      for (int64_t r = i + 1; r < j; ++r) n = std::min(n, ctx[order[r]]);
      const int64_t* s0 = slots + order[i] * S;
      for (; shared < n; ++shared) {
        bool same = true;
        for (int64_t r = i + 1; r < j && same; ++r) same = slots[order[r] * S + shared] == s0[shared];
        if (!same) break;
      }
      shared -= shared % TILE;
    }
    groups.push_back({i, j, shared});
    i = j;
  }
  return groups;
}

// Keys in tiles of TILE tokens with an online softmax (running max m and sum l per query head; acc rescaled
// by alpha = exp(m_old - m_new) as the tile is added): per kv head, the tile's scores for all its query
// heads, then their softmax, then the weighted values. A task is a group of rows (group_rows): first the
// shared tiles, each for every row of the group in turn while it sits in L1, then each row's own tiles.
template <typename T, typename K, int64_t DC>
static void decode(const T* q, const K* kv, T* out, const int64_t* slots, const int64_t* ctx,
                   int64_t B, int64_t Hq, int64_t Hkv, int64_t D_, int64_t S, T scale) {
  const int64_t D = DC > 0 ? DC : D_;
  const int64_t g = Hq / Hkv, slot_stride = 2 * Hkv * D, v_off = Hkv * D;
#ifdef JOINTRL_SIMD
  constexpr bool simd_types = std::is_same_v<T, K> || (std::is_same_v<T, float> && std::is_same_v<K, uint16_t>);
  constexpr int64_t VL = simd_types ? Vec<T>::L : 1;
  const bool simd = simd_types && D % VL == 0;
  const int64_t nj = std::min<int64_t>(g & -g, VL);  // heads per pass: the largest power of 2 dividing g
#ifdef __AVX512F__
  const bool wide = std::is_same_v<T, float> && simd && D % 16 == 0;  // Vec16
  const int64_t nj16 = std::min<int64_t>(g & -g, 16);
#endif
#endif
  std::vector<int64_t> order;
  const std::vector<Group> groups = group_rows(slots, ctx, B, S, order);
  at::parallel_for(0, int64_t(groups.size()), 1, [&](int64_t gbegin, int64_t gend) {
    std::vector<T> s(Hq * LD), acc(GMAX * Hq * D), m(GMAX * Hq), l(GMAX * Hq), alpha(Hq);
    std::vector<const K*> kr(TILE), vr(TILE);
    std::vector<const char*> pf_rows(TILE);
    // One tile [t0, t0 + nt) of the row with query qb and slots sl into its state (acc, m, l); meanwhile
    // the pf_n rows at slots nsl (the next tile this thread reads) are prefetched, during the scores (the rest,
    // and all of them on the plain path, at the end).
    auto tile = [&](const T* qb, const int64_t* sl, int64_t t0, int64_t nt, T* ac, T* mr, T* lr,
                    const int64_t* nsl, int64_t pf_n) {
      for (int64_t t = 0; t < pf_n; ++t) pf_rows[t] = reinterpret_cast<const char*>(kv + nsl[t] * slot_stride);
      Prefetch pf{pf_rows.data(), pf_n, slot_stride * int64_t(sizeof(K))};
      const int64_t pf_share = (pf_n * pf.row_bytes / 64 + Hkv - 1) / Hkv;  // lines during each kv head's scores
      for (int64_t h = 0; h < Hkv; ++h) {
        for (int64_t t = 0; t < nt; ++t) kr[t] = kv + sl[t0 + t] * slot_stride + h * D;
        const T* qh = qb + h * g * D;
        T* sh = s.data() + h * g * LD;
#ifdef JOINTRL_SIMD
        if constexpr (simd_types) {
#ifdef __AVX512F__
          if constexpr (std::is_same_v<T, float>) {
            if (wide) {
              if (nj16 == 16) scores_simd<T, K, 1, DC, Vec16>(qh, kr.data(), nt, g, D, scale, sh, pf, pf_share);
              else if (nj16 == 8) scores_simd<T, K, 2, DC, Vec16>(qh, kr.data(), nt, g, D, scale, sh, pf, pf_share);
              else if (nj16 == 4) scores_simd<T, K, 4, DC, Vec16>(qh, kr.data(), nt, g, D, scale, sh, pf, pf_share);
              else if (nj16 == 2) scores_simd<T, K, 8, DC, Vec16>(qh, kr.data(), nt, g, D, scale, sh, pf, pf_share);
              else scores_simd<T, K, 16, DC, Vec16>(qh, kr.data(), nt, g, D, scale, sh, pf, pf_share);
              continue;
            }
          }
#endif
          if (simd) {
            if (nj == VL) scores_simd<T, K, 1, DC>(qh, kr.data(), nt, g, D, scale, sh, pf, pf_share);
            else if (nj * 2 == VL) scores_simd<T, K, 2, DC>(qh, kr.data(), nt, g, D, scale, sh, pf, pf_share);
            else if (nj * 4 == VL) scores_simd<T, K, 4, DC>(qh, kr.data(), nt, g, D, scale, sh, pf, pf_share);
            else if constexpr (VL == 8) scores_simd<T, K, 8, DC>(qh, kr.data(), nt, g, D, scale, sh, pf, pf_share);
            continue;
          }
        }
#endif
        scores<T, K, DC>(qh, kr.data(), nt, g, D, scale, sh);
      }
      pf.rest();
      for (int64_t i = 0; i < Hq; ++i) {
        T* __restrict si = s.data() + i * LD;
        T mx = mr[i];
#pragma omp simd reduction(max : mx)
        for (int64_t t = 0; t < nt; ++t) mx = std::max(mx, si[t]);
        alpha[i] = exp_(mr[i] - mx);  // exp(-inf) = 0 on the first tile
        T sum = 0;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < nt; ++t) {
          si[t] = exp_(si[t] - mx);
          sum += si[t];
        }
        lr[i] = lr[i] * alpha[i] + sum;
        mr[i] = mx;
      }
      for (int64_t h = 0; h < Hkv; ++h) {
        for (int64_t t = 0; t < nt; ++t) vr[t] = kv + sl[t0 + t] * slot_stride + v_off + h * D;
        int64_t i = h * g;
#ifdef JOINTRL_SIMD
        if constexpr (simd_types) {
#ifdef __AVX512F__
          if constexpr (std::is_same_v<T, float>) {
            if (wide) {
              for (; i + 2 <= (h + 1) * g; i += 2) {
                const T* p2[2] = {s.data() + i * LD, s.data() + (i + 1) * LD};
                T* a2[2] = {ac + i * D, ac + (i + 1) * D};
                values_row<T, K, 2, Vec16>(p2, vr.data(), nt, D, alpha.data() + i, a2);
              }
              for (; i < (h + 1) * g; ++i) {
                const T* p1[1] = {s.data() + i * LD};
                T* a1[1] = {ac + i * D};
                values_row<T, K, 1, Vec16>(p1, vr.data(), nt, D, alpha.data() + i, a1);
              }
              continue;
            }
          }
#endif
          if (simd) {
#ifdef __AVX512VL__  // 32 vector registers: two heads per pass share each loaded value vector
            for (; i + 2 <= (h + 1) * g; i += 2) {
              const T* p2[2] = {s.data() + i * LD, s.data() + (i + 1) * LD};
              T* a2[2] = {ac + i * D, ac + (i + 1) * D};
              values_row<T, K, 2>(p2, vr.data(), nt, D, alpha.data() + i, a2);
            }
#endif
            for (; i < (h + 1) * g; ++i) {
              const T* p1[1] = {s.data() + i * LD};
              T* a1[1] = {ac + i * D};
              values_row<T, K, 1>(p1, vr.data(), nt, D, alpha.data() + i, a1);
            }
            continue;
          }
        }
#endif
        for (; i < (h + 1) * g; ++i) {
          values<T, K>(s.data() + i * LD, vr.data(), nt, D, alpha[i], ac + i * D);
        }
      }
    };
    for (int64_t gi = gbegin; gi < gend; ++gi) {
      const Group& G = groups[gi];
      const int64_t G0 = G.begin, n_rows = G.end - G.begin, P = G.shared;
      std::fill(acc.begin(), acc.begin() + n_rows * Hq * D, T(0));
      std::fill(m.begin(), m.begin() + n_rows * Hq, -std::numeric_limits<T>::infinity());
      std::fill(l.begin(), l.begin() + n_rows * Hq, T(0));
      // the first tile a row reads after the shared span (its own keys), or the next group's first: what
      // to prefetch when this thread's work moves on
      auto next_first = [&](int64_t r, int64_t& pf_n) -> const int64_t* {
        if (r + 1 < n_rows) {
          const int64_t b = order[G0 + r + 1];
          pf_n = std::max<int64_t>(0, std::min(TILE, ctx[b] - P));
          return slots + b * S + P;
        }
        if (gi + 1 < gend) {
          const int64_t b = order[groups[gi + 1].begin];
          pf_n = std::min(TILE, ctx[b]);
          return slots + b * S;
        }
        pf_n = 0;
        return nullptr;
      };
      const int64_t* sl0 = slots + order[G0] * S;
      for (int64_t t0 = 0; t0 < P; t0 += TILE) {  // shared tiles: streamed once, read by every row from L1
        for (int64_t r = 0; r < n_rows; ++r) {
          const int64_t b = order[G0 + r];
          int64_t pf_n = 0;
          const int64_t* nsl = nullptr;
          if (r == 0 && t0 + TILE < P) nsl = sl0 + t0 + TILE, pf_n = TILE;
          tile(q + b * Hq * D, slots + b * S, t0, TILE, acc.data() + r * Hq * D, m.data() + r * Hq,
               l.data() + r * Hq, nsl, pf_n);
        }
      }
      for (int64_t r = 0; r < n_rows; ++r) {
        const int64_t b = order[G0 + r], n = ctx[b];
        const int64_t* sl = slots + b * S;
        T* ac = acc.data() + r * Hq * D;
        T *mr = m.data() + r * Hq, *lr = l.data() + r * Hq;
        for (int64_t t0 = P; t0 < n; t0 += TILE) {
          const int64_t nt = std::min(TILE, n - t0);
          int64_t pf_n = 0;
          const int64_t* nsl = t0 + TILE < n ? (pf_n = std::min(TILE, n - t0 - TILE), sl + t0 + TILE) : next_first(r, pf_n);
          tile(q + b * Hq * D, sl, t0, nt, ac, mr, lr, nsl, pf_n);
        }
        T* ob = out + b * Hq * D;
        for (int64_t i = 0; i < Hq; ++i)
          for (int64_t d = 0; d < D; ++d) ob[i * D + d] = n ? ac[i * D + d] / lr[i] : T(0);
      }
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
// Prefill chunks over the paged cache, float32 queries (a float32 or bfloat16 cache): chunk c's count[c]
// queries are q's rows row0[c] + i, at positions start[c] + i of their sequence, whose token t sits in slot
// slots[c, t]; query i attends to keys 0 .. start[c] + i (causal). A task is one (chunk, kv head); its rows
// are (query, head of the GQA group) pairs, r = i * g + j. Rows in lanes: 8 rows to a vector, their queries
// transposed once ([D][8] per vector) and their state -- accumulators [D][8], running max and sum -- kept
// the same way, so a key's score for 8 rows is one broadcast and one FMA per d (no horizontal sums) and the
// online softmax runs down the lanes (the max, exp and sum of 8 rows per vector op; no per-row reductions).
// Keys in tiles of TILE read in place, each tile once per pass for the rows that see any of it, in blocks
// of NRV vectors while it sits in L1; a pass covers SB rows, whose state stays in L2. Keys past a row's own
// position get probability 0.
#ifdef JOINTRL_SIMD
#ifdef __AVX512VL__
constexpr int NRV = 3;  // row vectors per block: 8 keys x 3 accumulators + 3 query vectors in 32 registers
#else
constexpr int NRV = 1;  // 8 accumulators + a query vector in 16
#endif
constexpr int64_t SB = 24 * 8;  // rows per pass over the keys (their state: 2 x 48 KB at head_dim 64)

// One tile (keys kr[0..nt), values vr[0..nt)) into a block of NV row vectors: qt [NV][D][8] their queries,
// at [NV][D][8] their accumulators, m and l [NV * 8] their running max and sum. With ``mask``, row i of the
// block sees the tile's keys 0 .. lim[i] (lim[i] < 0: none of them); without, all nt.
template <typename K, int NV, typename W>
static void prefill_block(const float* qt, float* at, float* m, float* l, const K* const* kr, const K* const* vr,
                          int64_t nt, int64_t D, float scale, const float* lim, bool mask) {
  using V = typename W::V;
  constexpr int L = W::L, NL = NV * W::L;
  alignas(64) float s[TILE * NL], mx[NL], al[NL], sm[NL];  // s[t * NL + i]: key t, row i of the block
  for (int64_t k0 = 0; k0 < nt; k0 += 8) {  // scores, 8 keys x NV row vectors per pass
    const K* kp[8];
    for (int kk = 0; kk < 8; ++kk) kp[kk] = kr[std::min<int64_t>(k0 + kk, nt - 1)];
    V a[8][NV];
    for (auto& x : a)
      for (auto& y : x) y = W::zero();
    for (int64_t d = 0; d < D; ++d) {
      V qv[NV];
      for (int v = 0; v < NV; ++v) qv[v] = W::load(qt + (v * D + d) * L);
      for (int kk = 0; kk < 8; ++kk) {
        const V kb = W::set1(widen<float>(kp[kk][d]));
        for (int v = 0; v < NV; ++v) a[kk][v] = W::fma(qv[v], kb, a[kk][v]);
      }
    }
    const V sc = W::set1(scale);
    for (int kk = 0; kk < 8; ++kk)
      for (int v = 0; v < NV; ++v) W::store(s + (k0 + kk) * NL + v * L, W::mul(a[kk][v], sc));
  }
  constexpr float ninf = -std::numeric_limits<float>::infinity();
  if (mask)
    for (int64_t t = 0; t < nt; ++t) {
#pragma omp simd
      for (int i = 0; i < NL; ++i) s[t * NL + i] = float(t) <= lim[i] ? s[t * NL + i] : ninf;
    }
#pragma omp simd
  for (int i = 0; i < NL; ++i) mx[i] = m[i], sm[i] = 0.f;
  for (int64_t t = 0; t < nt; ++t) {
#pragma omp simd
    for (int i = 0; i < NL; ++i) mx[i] = std::max(mx[i], s[t * NL + i]);
  }
#pragma omp simd
  for (int i = 0; i < NL; ++i) al[i] = exp_(m[i] - mx[i]);  // exp(-inf) = 0 on the first tile
  for (int64_t t = 0; t < nt; ++t) {
#pragma omp simd
    for (int i = 0; i < NL; ++i) {
      s[t * NL + i] = exp_(s[t * NL + i] - mx[i]);
      sm[i] += s[t * NL + i];
    }
  }
#pragma omp simd
  for (int i = 0; i < NL; ++i) l[i] = l[i] * al[i] + sm[i], m[i] = mx[i];
  for (int64_t d0 = 0; d0 < D; d0 += 8) {  // the weighted values, 8 dims x NV row vectors per pass
    V a[8][NV], alv[NV];
    for (int v = 0; v < NV; ++v) alv[v] = W::load(al + v * L);
    for (int dd = 0; dd < 8; ++dd)
      for (int v = 0; v < NV; ++v) a[dd][v] = W::mul(W::load(at + (v * D + d0 + dd) * L), alv[v]);
    for (int64_t t = 0; t < nt; ++t) {
      V p[NV];
      for (int v = 0; v < NV; ++v) p[v] = W::load(s + t * NL + v * L);
      const K* vt = vr[t] + d0;
      for (int dd = 0; dd < 8; ++dd) {
        const V vb = W::set1(widen<float>(vt[dd]));
        for (int v = 0; v < NV; ++v) a[dd][v] = W::fma(p[v], vb, a[dd][v]);
      }
    }
    for (int dd = 0; dd < 8; ++dd)
      for (int v = 0; v < NV; ++v) W::store(at + (v * D + d0 + dd) * L, a[dd][v]);
  }
}

template <typename K, typename W>
static void prefill(const float* q, const K* kv, float* out, const int64_t* slots, const int64_t* start,
                    const int64_t* row0, const int64_t* count, int64_t C, int64_t Hq, int64_t Hkv, int64_t D,
                    int64_t S, float scale) {
  constexpr int64_t L = W::L;
  const int64_t g = Hq / Hkv, slot_stride = 2 * Hkv * D, v_off = Hkv * D;
  at::parallel_for(0, C * Hkv, 1, [&](int64_t task0, int64_t task1) {
    std::vector<float> qt, at_, m, l;
    alignas(64) float lim[NRV * L];
    std::vector<const K*> kr(TILE), vr(TILE);
    for (int64_t task = task0; task < task1; ++task) {
      const int64_t c = task / Hkv, h = task % Hkv, n = count[c], c0 = start[c], R = n * g;
      const int64_t* sl = slots + c * S;
      for (int64_t R0 = 0; R0 < R; R0 += SB) {  // a pass over the keys for rows [R0, R1)
        const int64_t R1 = std::min(R, R0 + SB), nv = (R1 - R0 + L - 1) / L;
        qt.assign(nv * D * L, 0.f);
        at_.assign(nv * D * L, 0.f);
        m.assign(nv * L, -std::numeric_limits<float>::infinity());
        l.assign(nv * L, 0.f);
        for (int64_t r = R0; r < R1; ++r) {  // row r: query r / g of the chunk, head h * g + r % g
          const float* src = q + ((row0[c] + r / g) * Hq + h * g + r % g) * D;
          float* dst = qt.data() + (r - R0) / L * D * L + (r - R0) % L;
          for (int64_t d = 0; d < D; ++d) dst[d * L] = src[d];
        }
        const int64_t nk = c0 + (R1 - 1) / g + 1;  // the keys the pass's last row sees
        for (int64_t t0 = 0; t0 < nk; t0 += TILE) {
          const int64_t nt = std::min(TILE, nk - t0);
          for (int64_t t = 0; t < nt; ++t) kr[t] = kv + sl[t0 + t] * slot_stride + h * D, vr[t] = kr[t] + v_off;
          if (t0 + TILE < nk)  // this head's keys and values of the next tile
            for (int64_t t = t0 + TILE; t < std::min(nk, t0 + 2 * TILE); ++t) {
              const char* row = reinterpret_cast<const char*>(kv + sl[t] * slot_stride + h * D);
              for (int64_t off = 0; off < D * int64_t(sizeof(K)); off += 64) {
                __builtin_prefetch(row + off, 0, 2);
                __builtin_prefetch(row + v_off * sizeof(K) + off, 0, 2);
              }
            }
          // from the block holding the first row that sees key t0 (query t0 - c0)
          const int64_t first = std::max(R0, std::max<int64_t>(0, t0 - c0) * g);
          for (int64_t v0 = (first - R0) / L; v0 < nv; v0 += NRV) {
            const int64_t nb = std::min<int64_t>(NRV, nv - v0), rlo = R0 + v0 * L;
            const bool mask = c0 + rlo / g - t0 < nt - 1;  // the block's first row misses some of the tile
            if (mask)
              for (int64_t i = 0; i < nb * L; ++i)
                lim[i] = rlo + i < R1 ? float(c0 + (rlo + i) / g - t0) : float(TILE);
            float *a = at_.data() + v0 * D * L, *mv = m.data() + v0 * L, *lv = l.data() + v0 * L;
            const float* qv = qt.data() + v0 * D * L;
            if constexpr (NRV >= 3) {
              if (nb == 3) { prefill_block<K, 3, W>(qv, a, mv, lv, kr.data(), vr.data(), nt, D, scale, lim, mask); continue; }
              if (nb == 2) { prefill_block<K, 2, W>(qv, a, mv, lv, kr.data(), vr.data(), nt, D, scale, lim, mask); continue; }
            }
            prefill_block<K, 1, W>(qv, a, mv, lv, kr.data(), vr.data(), nt, D, scale, lim, mask);
          }
        }
        for (int64_t r = R0; r < R1; ++r) {
          float* o = out + ((row0[c] + r / g) * Hq + h * g + r % g) * D;
          const float* a = at_.data() + (r - R0) / L * D * L + (r - R0) % L;
          const float lr = l[r - R0];
          for (int64_t d = 0; d < D; ++d) o[d] = a[d * L] / lr;
        }
      }
    }
  });
}
#endif

bool prefill_supported() {
#ifdef JOINTRL_SIMD
  return true;
#else
  return false;
#endif
}

void paged_prefill(torch::Tensor q, torch::Tensor kv, torch::Tensor slots, torch::Tensor start, torch::Tensor row0,
                   torch::Tensor count, double scale, torch::Tensor out) {
  TORCH_CHECK(q.is_contiguous() && kv.is_contiguous() && slots.is_contiguous() && start.is_contiguous() &&
              row0.is_contiguous() && count.is_contiguous() && out.is_contiguous(), "paged_prefill: contiguous inputs");
  TORCH_CHECK(q.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat &&
              (kv.scalar_type() == at::kFloat || kv.scalar_type() == at::kBFloat16),
              "paged_prefill: float32 q and out, a float32 or bfloat16 cache");
  TORCH_CHECK(q.size(2) % 8 == 0, "paged_prefill: head_dim a multiple of 8");
#ifdef JOINTRL_SIMD
  auto go = [&](auto* kv_ptr) {
    using K = std::remove_const_t<std::remove_pointer_t<decltype(kv_ptr)>>;
#ifdef __AVX512F__  // 16 rows to a vector: the same FMAs in half the instructions
    prefill<K, Vec16>(q.data_ptr<float>(), kv_ptr, out.data_ptr<float>(), slots.data_ptr<int64_t>(),
               start.data_ptr<int64_t>(), row0.data_ptr<int64_t>(), count.data_ptr<int64_t>(), slots.size(0),
               q.size(1), kv.size(2), q.size(2), slots.size(1), static_cast<float>(scale));
#else
    prefill<K, Vec<float>>(q.data_ptr<float>(), kv_ptr, out.data_ptr<float>(), slots.data_ptr<int64_t>(),
               start.data_ptr<int64_t>(), row0.data_ptr<int64_t>(), count.data_ptr<int64_t>(), slots.size(0),
               q.size(1), kv.size(2), q.size(2), slots.size(1), static_cast<float>(scale));
#endif
  };
  if (kv.scalar_type() == at::kBFloat16) go(reinterpret_cast<const uint16_t*>(kv.data_ptr()));
  else go(kv.data_ptr<float>());
#else
  TORCH_CHECK(false, "paged_prefill: built without AVX2 + FMA");
#endif
}

}  // namespace jointrl::paged_attention

TORCH_LIBRARY_FRAGMENT(jointrl, m) {
  m.def("paged_decode(Tensor q, Tensor kv, Tensor slots, Tensor ctx, float scale) -> Tensor", &jointrl::paged_attention::paged_decode);
  m.def("paged_prefill(Tensor q, Tensor kv, Tensor slots, Tensor start, Tensor row0, Tensor count, float scale, Tensor(a!) out) -> ()", &jointrl::paged_attention::paged_prefill);
  m.def("prefill_supported() -> bool", &jointrl::paged_attention::prefill_supported);
}
