// The C++ of kernels/mxfp4.py (its docstring states what each op computes and guarantees), registered
// as torch.ops.jointrl.* ops; built by kernels/build.py.
#include "prelude.h"
#include <cstring>

namespace jointrl::mxfp4 {

// One MXFP4 block: the Triton kernel's integer rounding (shared exponent from the bits of the largest
// |x|; each element's 24-bit significand shifted to E2M1's step at its magnitude, round half to even
// with guard and sticky bits), on x's fp32 bits.
template <bool CEIL>
static inline void quant_block(const uint32_t* __restrict bits, uint8_t* __restrict out, uint8_t* __restrict scale) {
  uint32_t amax = 0;
#pragma omp simd reduction(max : amax)
  for (int i = 0; i < 32; ++i) amax = std::max(amax, bits[i] & 0x7FFFFFFFu);
  if (amax >= 0x7F800000u) {  // NaN or inf in the block: scale 0xFF, nibbles 0
    *scale = 0xFF;
    std::memset(out, 0, 16);
    return;
  }
  int32_t e = int32_t(amax >> 23) - 129;  // floor(log2 amax) - emax(E2M1); zero / subnormal amax: -129
  if (CEIL) e += (amax & 0x7FFFFFu) > 0x400000u;  // mantissa above 1.5: 6 * 2^e < amax
  e = std::min(std::max(e, -127), 127);
  *scale = uint8_t(e + 127);
  uint8_t nib[32];
#pragma omp simd
  for (int i = 0; i < 32; ++i) {
    const uint32_t m = bits[i] & 0x7FFFFFFFu;
    const int32_t ex = int32_t(m >> 23), ex_n = std::max(ex, 1);
    const uint32_t sig = (m & 0x7FFFFFu) | (ex > 0 ? 0x800000u : 0u);
    const int32_t ty_pos = std::max(ex_n - 127 - e - int32_t(ex == 0), 0);  // y = |x| / 2^e has exponent ty
    const int32_t sh = std::min(ty_pos + 149 - ex_n + e, 25);  // 21..25: S down to units of E2M1's step
    uint32_t q = sig >> sh;
    const uint32_t guard = (sig >> (sh - 1)) & 1u, sticky = (sig & ((1u << (sh - 1)) - 1u)) != 0u;
    q += guard & (sticky | (q & 1u));
    nib[i] = uint8_t(std::min<uint32_t>(2u * uint32_t(ty_pos) + q, 7u) | ((bits[i] >> 28) & 8u));
  }
#pragma omp simd
  for (int j = 0; j < 16; ++j) out[j] = uint8_t(nib[2 * j] | (nib[2 * j + 1] << 4));
}

// x [n, 32] float32 or bfloat16 (contiguous) -> blocks uint8 [n, 16], scales uint8 [n]
void quantize(torch::Tensor x, torch::Tensor blocks, torch::Tensor scales, bool ceil) {
  const int64_t n = scales.numel();
  const bool bf16 = x.scalar_type() == torch::kBFloat16;
  const uint8_t* xp = static_cast<const uint8_t*>(x.data_ptr());
  uint8_t* bp = blocks.data_ptr<uint8_t>();
  uint8_t* sp = scales.data_ptr<uint8_t>();
  at::parallel_for(0, n, 4096, [&](int64_t lo, int64_t hi) {
    uint32_t widened[32];
    for (int64_t r = lo; r < hi; ++r) {
      const uint32_t* bits;
      if (bf16) {
        const uint16_t* h = reinterpret_cast<const uint16_t*>(xp) + r * 32;
#pragma omp simd
        for (int i = 0; i < 32; ++i) widened[i] = uint32_t(h[i]) << 16;  // exact
        bits = widened;
      } else {
        bits = reinterpret_cast<const uint32_t*>(xp) + r * 32;
      }
      if (ceil) quant_block<true>(bits, bp + r * 16, sp + r);
      else quant_block<false>(bits, bp + r * 16, sp + r);
    }
  });
}

// The two decoded E2M1 elements of a byte (low nibble first) at scale 1, as fp32 bits: code c is 0,
// 0.5 (c == 1) or exponent c/2 - 1 with mantissa bit c & 1 (c >= 2); bit 3 of the nibble is the sign.
static inline uint32_t e2m1_bits(uint32_t nib) {
  const uint32_t c = nib & 7u;
  const uint32_t v = c >= 2 ? ((((c >> 1) + 126u) << 23) | ((c & 1u) << 22)) : (c == 1 ? (126u << 23) : 0u);
  return v | ((nib & 8u) << 28);
}

struct PairTable {
  float pair[256][2];
  PairTable() {
    for (uint32_t b = 0; b < 256; ++b) {
      const uint32_t lo = e2m1_bits(b & 0xFu), hi = e2m1_bits(b >> 4);
      std::memcpy(&pair[b][0], &lo, 4);
      std::memcpy(&pair[b][1], &hi, 4);
    }
  }
};

// blocks uint8 [n, 16], scales uint8 [n] -> out [n, 32] float32 or bfloat16 (contiguous): each byte's two
// elements from a table, times 2^(s - 127) built from bits: exact (every product has at most two
// significant bits, so bfloat16 takes the fp32 bits' top half), but for 4 * 2^127 and 6 * 2^127, which
// overflow to inf; scale 0xFF gives NaN.
void dequantize(torch::Tensor blocks, torch::Tensor scales, torch::Tensor out) {
  static const PairTable table;
  const int64_t n = scales.numel();
  const bool bf16 = out.scalar_type() == torch::kBFloat16;
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  const uint8_t* sp = scales.data_ptr<uint8_t>();
  uint8_t* op = static_cast<uint8_t*>(out.data_ptr());
  at::parallel_for(0, n, 4096, [&](int64_t lo, int64_t hi) {
    alignas(32) float v[32];
    alignas(32) float val[32];
    for (int64_t r = lo; r < hi; ++r) {
      const uint32_t s = sp[r];
      const uint32_t sbits = s == 255 ? 0x7FC00000u : (s > 0 ? s << 23 : 1u << 22);
      float mult;
      std::memcpy(&mult, &sbits, 4);
      const uint8_t* b = bp + r * 16;
      for (int j = 0; j < 16; ++j) std::memcpy(v + 2 * j, table.pair[b[j]], 8);
      float* dst = bf16 ? val : reinterpret_cast<float*>(op) + r * 32;
#pragma omp simd
      for (int j = 0; j < 32; ++j) dst[j] = v[j] * mult;
      if (bf16) {
        uint32_t u[32];
        std::memcpy(u, val, sizeof(u));
        uint16_t* o = reinterpret_cast<uint16_t*>(op) + r * 32;
#pragma omp simd
        for (int j = 0; j < 32; ++j) o[j] = uint16_t(u[j] >> 16);
      }
    }
  });
}

}  // namespace jointrl::mxfp4

TORCH_LIBRARY_FRAGMENT(jointrl, m) {
  m.def("mxfp4_quantize(Tensor x, Tensor(a!) blocks, Tensor(b!) scales, bool ceil) -> ()", &jointrl::mxfp4::quantize);
  m.def("mxfp4_dequantize(Tensor blocks, Tensor scales, Tensor(a!) out) -> ()", &jointrl::mxfp4::dequantize);
}
