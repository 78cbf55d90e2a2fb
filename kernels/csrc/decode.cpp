// The C++ of kernels/decode_cpu.py (its docstring states what each op computes and guarantees), registered
// as torch.ops.jointrl.* ops; built by kernels/build.py.
#include "prelude.h"

namespace jointrl::decode {

template <typename T>
static void rms_rows(const T* xp, const T* __restrict wp, T* yp, int64_t N, int64_t H, double eps) {
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const T* __restrict xn = xp + n * H;
      T* __restrict yn = yp + n * H;
      const T r = inv_rms(xn, H, eps);
#pragma omp simd
      for (int64_t i = 0; i < H; ++i) yn[i] = wp[i] * (xn[i] * r);
    }
  });
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && w.is_contiguous() && w.numel() == x.size(1) &&
              x.scalar_type() == w.scalar_type(), "rms_norm: x [N, H] and w [H] contiguous, one dtype");
  auto y = torch::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "rms_norm", [&] {
    rms_rows<scalar_t>(x.data_ptr<scalar_t>(), w.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), x.size(0), x.size(1),
                       eps);
  });
  return y;
}

// A value as the cache's element: the same type, or bfloat16 bits rounded as torch's ``.to(bfloat16)``
// rounds (to nearest even, NaN kept).
template <typename C, typename T>
static inline C narrow(T x) {
  if constexpr (std::is_same_v<C, uint16_t>) return c10::BFloat16(static_cast<float>(x)).x;
  else return x;
}

template <typename T, typename C>
static void qk_rows(const T* xp, const T* wp, double eps, const T* cp, const T* sp, C* kvp, const int64_t* sl, T* qp,
                    int64_t N, int64_t Hq, int64_t Hkv, int64_t D) {
  const int64_t G = Hq + Hkv, F = (Hq + 2 * Hkv) * D, half = D / 2;
  at::parallel_for(0, N, 4, [&](int64_t n0, int64_t n1) {
    std::vector<T> t(D), r(D);
    for (int64_t n = n0; n < n1; ++n) {
      const T* __restrict c = cp + n * D;
      const T* __restrict s = sp + n * D;
      C* kv_n = kvp + sl[n] * 2 * Hkv * D;
      for (int64_t g = 0; g < G; ++g) {
        const T* __restrict x = xp + n * F + g * D;
        T* __restrict tt = t.data();
        if (wp != nullptr) {
          const T inv = inv_rms(x, D, eps);
          const T* __restrict wg = wp + g * D;
#pragma omp simd
          for (int64_t i = 0; i < D; ++i) tt[i] = wg[i] * (x[i] * inv);
        } else {
          std::copy(x, x + D, tt);
        }
        T* __restrict o = g < Hq ? qp + (n * Hq + g) * D : r.data();
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) o[i] = tt[i] * c[i] + (-tt[half + i]) * s[i];
#pragma omp simd
        for (int64_t i = half; i < D; ++i) o[i] = tt[i] * c[i] + tt[i - half] * s[i];
        if (g >= Hq) {
          C* __restrict k = kv_n + (g - Hq) * D;
          for (int64_t i = 0; i < D; ++i) k[i] = narrow<C>(o[i]);
        }
      }
      const T* __restrict v = xp + n * F + G * D;
      C* __restrict kv_v = kv_n + Hkv * D;
      for (int64_t i = 0; i < Hkv * D; ++i) kv_v[i] = narrow<C>(v[i]);
    }
  });
}

torch::Tensor qk_norm_rope_store(torch::Tensor qkv, torch::Tensor w, double eps, torch::Tensor cos,
                                 torch::Tensor sin, torch::Tensor kv, torch::Tensor slots, int64_t Hq, int64_t Hkv) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() && cos.is_contiguous() && sin.is_contiguous() &&
              kv.is_contiguous() && slots.is_contiguous(), "qk_norm_rope_store: contiguous inputs");
  TORCH_CHECK(kv.dim() == 4 && kv.size(1) == 2 && kv.size(2) == Hkv, "qk_norm_rope_store: kv [P, 2, Hkv, D]");
  const int64_t N = qkv.size(0), D = kv.size(3), G = Hq + Hkv, F = (Hq + 2 * Hkv) * D, P = kv.size(0);
  TORCH_CHECK(qkv.size(1) == F && D % 2 == 0 && cos.size(0) == N && cos.size(1) == D && slots.numel() == N,
              "qk_norm_rope_store: qkv [N, (Hq + 2 Hkv) D], cos/sin [N, D], slots [N]");
  const bool bf16_kv = kv.scalar_type() == at::kBFloat16;
  TORCH_CHECK((qkv.scalar_type() == kv.scalar_type() || (bf16_kv && qkv.scalar_type() == at::kFloat)) &&
              qkv.scalar_type() == cos.scalar_type() && qkv.scalar_type() == sin.scalar_type(),
              "qk_norm_rope_store: one dtype (the cache may be bfloat16 under float32)");
  const bool norm = w.numel() > 0;
  TORCH_CHECK(!norm || (w.is_contiguous() && w.numel() == G * D && w.scalar_type() == qkv.scalar_type()),
              "qk_norm_rope_store: w [Hq + Hkv, D] or empty");
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t n = 0; n < N; ++n) TORCH_CHECK(sl[n] >= 0 && sl[n] < P, "qk_norm_rope_store: slot out of range");
  auto q = torch::empty({N, Hq, D}, qkv.options());
  AT_DISPATCH_FLOATING_TYPES(qkv.scalar_type(), "qk_norm_rope_store", [&] {
    auto run = [&](auto* kv_ptr) {
      qk_rows(qkv.data_ptr<scalar_t>(), norm ? w.data_ptr<scalar_t>() : nullptr, eps, cos.data_ptr<scalar_t>(),
              sin.data_ptr<scalar_t>(), kv_ptr, sl, q.data_ptr<scalar_t>(), N, Hq, Hkv, D);
    };
    if (bf16_kv) run(reinterpret_cast<uint16_t*>(kv.data_ptr()));
    else run(kv.data_ptr<scalar_t>());
  });
  return q;
}

template <typename T>
static void route_rows(const T* lp, int64_t* ip, T* wp, int64_t N, int64_t E, int64_t k, bool normalize,
                       double scale) {
  std::vector<T> p(E);
  for (int64_t n = 0; n < N; ++n) {
    const T* __restrict x = lp + n * E;
    T m = -std::numeric_limits<T>::infinity();
    for (int64_t e = 0; e < E; ++e) m = std::max(m, x[e]);
    T sum = 0;
    for (int64_t e = 0; e < E; ++e) sum += (p[e] = exp_(x[e] - m));
    for (int64_t e = 0; e < E; ++e) p[e] = p[e] / sum;
    int64_t* id = ip + n * k;
    T* w = wp + n * k;
    for (int64_t j = 0; j < k; ++j) {  // selection: k is small (2-8)
      int64_t best = -1;
      for (int64_t e = 0; e < E; ++e) {
        bool taken = false;
        for (int64_t i = 0; i < j; ++i) taken |= id[i] == e;
        if (!taken && (best < 0 || p[e] > p[best])) best = e;
      }
      id[j] = best, w[j] = p[best];
    }
    if (normalize) {
      T tot = 0;
      for (int64_t j = 0; j < k; ++j) tot += w[j];
      tot += T(1e-20);
      for (int64_t j = 0; j < k; ++j) w[j] = w[j] / tot;
    }
    if (scale != 1.0)
      for (int64_t j = 0; j < k; ++j) w[j] = w[j] * T(scale);
  }
}

std::vector<torch::Tensor> route_softmax_topk(torch::Tensor logits, int64_t k, bool normalize, double scale) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && k >= 1 && k <= logits.size(1),
              "route_softmax_topk: logits [N, E] contiguous, 1 <= k <= E");
  const int64_t N = logits.size(0), E = logits.size(1);
  auto ids = torch::empty({N, k}, logits.options().dtype(torch::kLong));
  auto wts = torch::empty({N, k}, logits.options());
  AT_DISPATCH_FLOATING_TYPES(logits.scalar_type(), "route_softmax_topk", [&] {
    route_rows<scalar_t>(logits.data_ptr<scalar_t>(), ids.data_ptr<int64_t>(), wts.data_ptr<scalar_t>(), N, E, k,
                         normalize, scale);
  });
  return {ids, wts};
}

}  // namespace jointrl::decode

TORCH_LIBRARY_FRAGMENT(jointrl, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor", &jointrl::decode::rms_norm);
  m.def("qk_norm_rope_store(Tensor qkv, Tensor w, float eps, Tensor cos, Tensor sin, Tensor(a!) kv, Tensor slot, int Hq, int Hkv) -> Tensor", &jointrl::decode::qk_norm_rope_store);
  m.def("route_softmax_topk(Tensor logits, int k, bool normalize, float scale) -> Tensor[]", &jointrl::decode::route_softmax_topk);
}
