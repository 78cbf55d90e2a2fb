// The C++ of kernels/norm_rope_cpu.py (its docstring states what each op computes and guarantees), registered
// as torch.ops.jointrl.* ops; built by kernels/build.py.
#include "prelude.h"

namespace jointrl::norm_rope {

// One normalised row: t = w x r; with cos/sin (RoPE, half = D / 2): y = t cos + rotate_half(t) sin.
template <typename T>
static inline void fwd_row(const T* __restrict x, const T* __restrict w, T r, const T* __restrict c,
                           const T* __restrict s, T* __restrict y, T* __restrict t, int64_t D) {
  if (c == nullptr) {
#pragma omp simd
    for (int64_t i = 0; i < D; ++i) y[i] = w[i] * (x[i] * r);
    return;
  }
  const int64_t half = D / 2;
#pragma omp simd
  for (int64_t i = 0; i < D; ++i) t[i] = w[i] * (x[i] * r);
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) y[i] = t[i] * c[i] - t[i + half] * s[i];
#pragma omp simd
  for (int64_t i = half; i < D; ++i) y[i] = t[i] * c[i] + t[i - half] * s[i];
}

// rows [R, D] = [N, heads, D]: cos/sin [N, D] (nullptr: no RoPE) apply to every head of a token.
template <typename T>
static void fwd(const T* xp, const T* wp, double eps, const T* cp, const T* sp, T* yp, T* rp, int64_t R, int64_t D,
                int64_t heads) {
  at::parallel_for(0, R, 64, [&](int64_t r0, int64_t r1) {
    std::vector<T> t(D);
    for (int64_t r = r0; r < r1; ++r) {
      const T* x = xp + r * D;
      const T rho = inv_rms(x, D, eps);
      rp[r] = rho;
      const int64_t n = r / heads;
      fwd_row(x, wp, rho, cp ? cp + n * D : nullptr, sp ? sp + n * D : nullptr, yp + r * D, t.data(), D);
    }
  });
}

std::vector<torch::Tensor> norm_fwd(torch::Tensor x, torch::Tensor w, double eps, torch::Tensor cos, torch::Tensor sin,
                                    int64_t heads) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && w.is_contiguous() && w.numel() == x.size(1) &&
              x.scalar_type() == w.scalar_type(), "norm_fwd: x [R, D] and w [D] contiguous, one dtype");
  const bool rope = cos.numel() > 0;
  TORCH_CHECK(!rope || (cos.is_contiguous() && sin.is_contiguous() && cos.numel() == x.numel() / heads &&
                        sin.numel() == cos.numel() && cos.scalar_type() == x.scalar_type() && x.size(1) % 2 == 0),
              "norm_fwd: cos / sin [R / heads, D] contiguous, x's dtype");
  auto y = torch::empty_like(x);
  auto rstd = torch::empty({x.size(0)}, x.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "norm_fwd", [&] {
    fwd<scalar_t>(x.data_ptr<scalar_t>(), w.data_ptr<scalar_t>(), eps, rope ? cos.data_ptr<scalar_t>() : nullptr,
                  rope ? sin.data_ptr<scalar_t>() : nullptr, y.data_ptr<scalar_t>(), rstd.data_ptr<scalar_t>(),
                  x.size(0), x.size(1), heads);
  });
  return {y, rstd};
}

// dx_r = r (gw - xh mean(gw xh)), gw = g w, xh = x r; dw += g xh, over a chunk of rows into dw_part.
template <typename T>
static void bwd(const T* gp, const T* xp, const T* wp, const T* rp, const T* cp, const T* sp, T* dxp, T* dwp,
                int64_t R, int64_t D, int64_t heads) {
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), R / 64));
  std::vector<T> part(chunks * D, T(0));
  const int64_t half = D / 2;
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    std::vector<T> dt(D), gw(D);
    for (int64_t ch = c0; ch < c1; ++ch) {
      T* __restrict dw = part.data() + ch * D;
      for (int64_t r = R * ch / chunks; r < R * (ch + 1) / chunks; ++r) {
        const T* __restrict g = gp + r * D;
        const T* __restrict x = xp + r * D;
        T* __restrict dx = dxp + r * D;
        const T rho = rp[r];
        if (cp != nullptr) {  // through RoPE first: dt = dy cos + rotate_half^T(dy sin)
          const T* __restrict c = cp + (r / heads) * D;
          const T* __restrict s = sp + (r / heads) * D;
#pragma omp simd
          for (int64_t i = 0; i < half; ++i) dt[i] = g[i] * c[i] + g[i + half] * s[i + half];
#pragma omp simd
          for (int64_t i = half; i < D; ++i) dt[i] = g[i] * c[i] - g[i - half] * s[i - half];
          g = dt.data();
        }
        T dot = 0;
#pragma omp simd reduction(+ : dot)
        for (int64_t i = 0; i < D; ++i) {
          gw[i] = g[i] * wp[i];
          dot += gw[i] * (x[i] * rho);
        }
        const T m = dot / T(D);
#pragma omp simd
        for (int64_t i = 0; i < D; ++i) {
          const T xh = x[i] * rho;
          dx[i] = rho * (gw[i] - xh * m);
          dw[i] += g[i] * xh;
        }
      }
    }
  });
  for (int64_t i = 0; i < D; ++i) {
    T acc = 0;
    for (int64_t ch = 0; ch < chunks; ++ch) acc += part[ch * D + i];
    dwp[i] = acc;
  }
}

std::vector<torch::Tensor> norm_bwd(torch::Tensor g, torch::Tensor x, torch::Tensor w, torch::Tensor rstd,
                                    torch::Tensor cos, torch::Tensor sin, int64_t heads) {
  TORCH_CHECK(g.sizes() == x.sizes() && g.is_contiguous() && x.is_contiguous() && g.scalar_type() == x.scalar_type(),
              "norm_bwd: g and x [R, D] contiguous, one dtype");
  const bool rope = cos.numel() > 0;
  auto dx = torch::empty_like(x);
  auto dw = torch::empty_like(w);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "norm_bwd", [&] {
    bwd<scalar_t>(g.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), w.data_ptr<scalar_t>(), rstd.data_ptr<scalar_t>(),
                  rope ? cos.data_ptr<scalar_t>() : nullptr, rope ? sin.data_ptr<scalar_t>() : nullptr,
                  dx.data_ptr<scalar_t>(), dw.data_ptr<scalar_t>(), x.size(0), x.size(1), heads);
  });
  return {dx, dw};
}

}  // namespace jointrl::norm_rope

TORCH_LIBRARY_FRAGMENT(jointrl, m) {
  m.def("norm_fwd(Tensor x, Tensor w, float eps, Tensor cos, Tensor sin, int heads) -> Tensor[]", &jointrl::norm_rope::norm_fwd);
  m.def("norm_bwd(Tensor g, Tensor x, Tensor w, Tensor rstd, Tensor cos, Tensor sin, int heads) -> Tensor[]", &jointrl::norm_rope::norm_bwd);
}
