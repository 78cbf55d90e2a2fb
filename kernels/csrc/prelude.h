// The common head of every CPU kernel source (kernels/cpu_extension.py's docstring says what each part is for):
// headers; on x86-64 glibc the declarations of libmvec's vector exp variants (<= 4 ulp), so that `omp simd`
// loops calling exp_ run a vector of lanes at a time; where the build targets AVX2 + FMA (JOINTRL_SIMD),
// Vec<float> / Vec<double> (load / fma / store of 8 floats or 4 doubles, and `sums`, the lane sums of a full
// vector's count of accumulators as one vector); with AVX-512, Vec16, the same for 16 floats; and inv_rms,
// RMSNorm's scale.
#pragma once
#include <torch/all.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) && defined(__GLIBC__)
extern "C" {
#pragma omp declare simd notinbranch
float expf(float) noexcept;
#pragma omp declare simd notinbranch
double exp(double) noexcept;
}
#endif

template <typename T>
static inline T exp_(T x) {
  if constexpr (std::is_same_v<T, float>) return expf(x);
  else return exp(x);
}

// AVX2 + FMA: 256-bit vectors of T for the kernels' hand-laid loops (a kernel keeps a plain loop for
// other machines and shapes).
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define JOINTRL_SIMD 1
template <typename T>
struct Vec;
template <>
struct Vec<float> {
  using V = __m256;
  static constexpr int L = 8;
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V load(const uint16_t* p) {  // 8 bfloat16 widened exactly: zero-extend, shift into the top half
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
  }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V zero() { return _mm256_setzero_ps(); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static void store(float* p, V x) { _mm256_storeu_ps(p, x); }
  static V sums(const V* a) {  // [lane sum of a[0], ..., lane sum of a[7]]
    const V u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const V u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
  }
};
template <>
struct Vec<double> {
  using V = __m256d;
  static constexpr int L = 4;
  static V load(const double* p) { return _mm256_loadu_pd(p); }
  static V set1(double x) { return _mm256_set1_pd(x); }
  static V zero() { return _mm256_setzero_pd(); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_pd(a, b, c); }
  static V mul(V a, V b) { return _mm256_mul_pd(a, b); }
  static void store(double* p, V x) { _mm256_storeu_pd(p, x); }
  static V sums(const V* a) {  // [lane sum of a[0], ..., lane sum of a[3]]
    const V t0 = _mm256_hadd_pd(a[0], a[1]), t1 = _mm256_hadd_pd(a[2], a[3]);
    return _mm256_add_pd(_mm256_permute2f128_pd(t0, t1, 0x20), _mm256_permute2f128_pd(t0, t1, 0x31));
  }
};
#ifdef __AVX512F__
// 16 floats (AVX-512): the same FMAs as Vec<float> in half the instructions, for loops that are instruction
// bound while their data sit in cache (paged attention's decode and prefill)
struct Vec16 {
  using V = __m512;
  static constexpr int L = 16;
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V load(const uint16_t* p) {  // 16 bfloat16 widened exactly
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
  }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V zero() { return _mm512_setzero_ps(); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static void store(float* p, V x) { _mm512_storeu_ps(p, x); }
  static V sums(const V* a) {  // [lane sum of a[0], ..., lane sum of a[15]]
    V w[4];  // w[j]: in each 128-bit lane, that lane's sums of a[4j .. 4j + 3]
    for (int j = 0; j < 4; ++j) {
      const V* b = a + 4 * j;
      const V u = _mm512_add_ps(_mm512_unpacklo_ps(b[0], b[1]), _mm512_unpackhi_ps(b[0], b[1]));
      const V v = _mm512_add_ps(_mm512_unpacklo_ps(b[2], b[3]), _mm512_unpackhi_ps(b[2], b[3]));
      w[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(u), _mm512_castps_pd(v))),
                           _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(u), _mm512_castps_pd(v))));
    }
    const V s01 = _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x44), _mm512_shuffle_f32x4(w[0], w[1], 0xEE));
    const V s23 = _mm512_add_ps(_mm512_shuffle_f32x4(w[2], w[3], 0x44), _mm512_shuffle_f32x4(w[2], w[3], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, 0x88), _mm512_shuffle_f32x4(s01, s23, 0xDD));
  }
};
#endif
#endif

// 1 / sqrt(mean(x^2) + eps) over x[0..n): RMSNorm's scale, shared by the decode step and the learner's norms
template <typename T>
static inline T inv_rms(const T* __restrict x, int64_t n, double eps) {
  T ss = 0;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  return T(1) / std::sqrt(ss / T(n) + T(eps));
}
