"""``y = x Wᵀ`` for the few rows of a decode step on CPU, against a weight packed once in panels.

    y[n, o] = Σ_k x[n, k] · W[o, k]      (k ascending, one fused multiply-add per term)

Why: a bench_moe decode step runs 19 ``F.linear`` calls over 16-256 rows (q|k|v, o_proj and the
router of each layer, the head). At so few rows MKL's sgemm on this machine reaches ~40 GFLOP/s on a
warm weight and ~25 on one streamed from memory (every weight is, once per step: 43 MB of model
against a shared 32 MB L3), about half the step's matmul time lost. Here the weight is packed
once (``pack``: panels of 16 output columns, ``[ceil(O/16), K, 16]``, zero-padded, each panel
contiguous so the hardware prefetcher streams it) and every panel is read once per call while all
rows pass over it, 6 (float) / 3 (double) rows x 16 columns of vector accumulators at a time.

Every output is one sum in k order, whatever the number of rows or a row's place among them: a
row's result does not depend on what shares its call (batch-invariant, as ``rollout.batch_invariant``
wants, though the runner keeps its tiled path there). Against ``F.linear`` it differs only by
summation order: float64 to ~1e-15 relative, float32 to a few ulp (tests/kernels/test_linear_cpu.py).

Compiled at first use (``kernels/cpu_extension``); ``load_kernel()`` is None without a toolchain,
and the caller (``rl/rollout/model_runner``) then keeps ``F.linear``. Single-threaded by design (decode rows are few; one
torch thread is the rollout actor's setting).

The runner calls it at every row count. Past a decode step's rows it still beats MKL's sgemm here: one
thread, Zen 4, warm weights, bench_moe's q|k|v (256 -> 512) at 400 / 800 / 2048 rows 1.05 / 2.13 / 5.18 ms
against 1.25 / 2.53 / 6.44 (~100 against ~84 GFLOP/s); in the engine, runs alternated, the bench's agentic
workload 11.2 -> 10.6 CPU-s and a 2048-token prefill step 185 -> 173 ms. (An earlier measurement had MKL
~10% ahead at 512 rows, and the runner kept ``F.linear`` past 256 rows.)

Shapes: N rows, K input features, O outputs, Q = ceil(O / 16) panels.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from jointrl.kernels.cpu_extension import load_cpu_extension

__all__ = ["PANEL", "PANEL_SOURCE", "load_kernel", "pack", "linear"]

PANEL = 16  # output columns per packed panel

# y = x Wᵀ over packed panels (``linear_rows``), shared with ``moe_cpu``'s packed experts.
PANEL_SOURCE = r"""
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
"""

_SOURCE = PANEL_SOURCE + r"""
torch::Tensor linear_packed(torch::Tensor x, torch::Tensor packed, int64_t O) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && packed.is_contiguous() && packed.dim() == 3 &&
              packed.size(2) == 16 && packed.size(1) == x.size(1) && packed.size(0) == (O + 15) / 16 &&
              x.scalar_type() == packed.scalar_type(),
              "linear_packed: x [N, K] and packed [ceil(O/16), K, 16] contiguous, one dtype");
  auto y = torch::empty({x.size(0), O}, x.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "linear_packed", [&] {
    // prefetched 4 KB ahead of the first pass over each panel, as moe_cpu's experts are: 13 projections of
    // bench_moe's decode step at 16 rows, weights streamed from memory, 0.81 -> 0.70 ms (warm: 0.44 either way)
    linear_rows<scalar_t>(x.data_ptr<scalar_t>(), x.size(0), x.size(1), packed.data_ptr<scalar_t>(), O,
                          y.data_ptr<scalar_t>(), 4096);
  });
  return y;
}
"""


@functools.cache
def load_kernel():
    """The compiled extension, or None when it cannot be built here (no compiler)."""
    return load_cpu_extension("jointrl_linear_cpu", _SOURCE, ["linear_packed"])


def pack(w_OK: Tensor, out: Tensor | None = None) -> Tensor:
    """W [O, K] → panels [ceil(O/16), K, 16]: panel q holds columns 16q .. 16q + 15 of Wᵀ (zeros past O).
    ``out``: an earlier ``pack`` of a weight of this shape, overwritten in place (one strided copy, no new
    memory: a runner repacking after a weight update); its padding columns stay zero."""
    O, K = w_OK.shape
    if out is None:
        return F.pad(w_OK.detach(), (0, 0, 0, -O % PANEL)).view(-1, PANEL, K).transpose(1, 2).contiguous()
    pack_into(out.unsqueeze(0), w_OK.detach().unsqueeze(0))
    return out


def pack_into(out_EQKP: Tensor, w_EOK: Tensor) -> Tensor:
    """Write ``pack(w_EOK[e])`` into ``out_EQKP[e]`` for every e (``out``: panels of this shape whose columns
    past O are zero, as ``pack`` leaves them) → ``out_EQKP``. Raises ``ValueError`` when ``out`` is not
    panels of ``w``'s shape and dtype (a copy into larger panels would leave old weights in the rest)."""
    E, O, K = w_EOK.shape
    full = O // PANEL
    want = (E, full + bool(O % PANEL), K, PANEL)
    if tuple(out_EQKP.shape) != want or out_EQKP.dtype != w_EOK.dtype:
        raise ValueError(f"out {tuple(out_EQKP.shape)} {out_EQKP.dtype} is not the panels of a {w_EOK.dtype} weight "
                         f"[E, O, K] = {(E, O, K)}: expected {want}")
    out_EQKP[:, :full].copy_(w_EOK[:, :full * PANEL].view(E, full, PANEL, K).transpose(2, 3))
    if O % PANEL:
        out_EQKP[:, full, :, :O % PANEL].copy_(w_EOK[:, full * PANEL:].transpose(1, 2))
    return out_EQKP


def linear(x_NK: Tensor, packed_QKP: Tensor, out_features: int) -> Tensor:
    """x [N, K] (float32/64, CPU) and ``pack(W)`` → x Wᵀ [N, O]. No autograd; needs ``load_kernel()``."""
    return load_kernel().linear_packed(x_NK.contiguous(), packed_QKP, out_features)
