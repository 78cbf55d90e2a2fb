"""The learner's RMSNorm and q/k-norm + RoPE on CPU, forward and backward, one C++ call each.

    rms_norm:       y_r = w ⊙ x_r · ρ_r,   ρ_r = 1 / sqrt(mean(x_r²) + eps)
                    dx_r = ρ_r (g_r ⊙ w − x̂_r · mean(g_r ⊙ w ⊙ x̂_r)),  x̂_r = x_r ρ_r;  dw = Σ_r g_r ⊙ x̂_r
    qk_norm_rope:   per token n and head h: t = rms_norm(x_nh) (weight w [D]), then RoPE
                    y = t ⊙ cos_n + rotate_half(t) ⊙ sin_n,   rotate_half(t) = [-t₂, t₁];
                    backward: dt = dy ⊙ cos_n + [dy₂ ⊙ sin₂, −dy₁ ⊙ sin₁] (rotate_half's transpose), then
                    rms_norm's backward

Why: in autograd the model's ``RMSNorm`` is 6 ops forward and about 12 backward, ``apply_rope`` 5 and
8, each a full pass over the activations (with its allocation); a bench_moe learner step runs 25
norms and 12 RoPEs over ~1,100 tokens. These do the same arithmetic in one pass forward and one
backward (two for ``dw``'s per-thread partial sums).

Equal to the torch references (``*_torch``: the model's ``RMSNorm`` / ``apply_rope`` arithmetic)
up to summation order: float64 to ~1e-15 relative, float32 to a few ulp, values and gradients
(tests/kernels/test_norm_rope_cpu.py). Compiled at first use (``kernels/cpu_extension``);
``load_kernel()`` is None without a toolchain and ``rms_norm`` / ``qk_norm_rope`` then run the
references through autograd.

Shapes: R rows, D the normalised width (hidden, or head_dim), N tokens, h heads.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from jointrl.kernels.cpu_extension import load_cpu_extension

__all__ = ["load_kernel", "rms_norm", "rms_norm_torch", "qk_norm_rope", "qk_norm_rope_torch", "usable"]

_SOURCE = r"""

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
"""


@functools.cache
def load_kernel():
    """The compiled extension, or None when it cannot be built here (no compiler)."""
    return load_cpu_extension("jointrl_norm_rope_cpu", _SOURCE, ["norm_fwd", "norm_bwd"])


def usable(x: Tensor) -> bool:
    """Whether ``rms_norm`` / ``qk_norm_rope`` run the C++ kernel for ``x``: CPU, float32/64, compiled."""
    return x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64) and load_kernel() is not None


class _NormRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_RD, w_D, eps, cos_ND, sin_ND, heads):
        y_RD, rstd_R = load_kernel().norm_fwd(x_RD, w_D, eps, cos_ND, sin_ND, heads)
        ctx.save_for_backward(x_RD, w_D, rstd_R, cos_ND, sin_ND)
        ctx.heads = heads
        return y_RD

    @staticmethod
    def backward(ctx, dy_RD):
        x_RD, w_D, rstd_R, cos_ND, sin_ND = ctx.saved_tensors
        dx_RD, dw_D = load_kernel().norm_bwd(dy_RD.contiguous(), x_RD, w_D, rstd_R, cos_ND, sin_ND, ctx.heads)
        return dx_RD, dw_D, None, None, None, None


def rms_norm_torch(x: Tensor, w_D: Tensor, eps: float) -> Tensor:
    """``model.norm.RMSNorm``'s arithmetic over the last dim (float32/64 x)."""
    return w_D * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rms_norm(x: Tensor, w_D: Tensor, eps: float) -> Tensor:
    """x [..., D], w [D] (x's dtype) → y [..., D], differentiable in x and w."""
    if not usable(x):
        return rms_norm_torch(x, w_D, eps)
    D = x.shape[-1]
    empty = x.new_empty(0)
    return _NormRope.apply(x.reshape(-1, D).contiguous(), w_D.contiguous(), eps, empty, empty, 1).view(x.shape)


def qk_norm_rope_torch(x_NhD: Tensor, w_D: Tensor, eps: float, cos_ND: Tensor, sin_ND: Tensor) -> Tensor:
    """``model.attention``'s per-head q/k-norm then ``apply_rope``, on [N, heads, D]."""
    t = rms_norm_torch(x_NhD, w_D, eps)
    x1, x2 = t.chunk(2, dim=-1)
    return t * cos_ND[:, None] + torch.cat((-x2, x1), dim=-1) * sin_ND[:, None]


def qk_norm_rope(x_NhD: Tensor, w_D: Tensor, eps: float, cos_ND: Tensor, sin_ND: Tensor) -> Tensor:
    """x [N, heads, D] (a projection's heads), w [D], cos/sin [N, D] → [N, heads, D] normed per head and
    rotated, differentiable in x and w."""
    if not usable(x_NhD):
        return qk_norm_rope_torch(x_NhD, w_D, eps, cos_ND, sin_ND)
    N, h, D = x_NhD.shape
    return _NormRope.apply(x_NhD.reshape(N * h, D).contiguous(), w_D.contiguous(), eps, cos_ND.contiguous(),
                           sin_ND.contiguous(), h).view(N, h, D)
