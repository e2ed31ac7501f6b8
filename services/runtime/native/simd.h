// 16 floats at a time for the element-wise and attention kernels: loads that widen float32,
// bfloat16 or float16 to float32, stores that round back (to nearest even, as c10's conversions do),
// and a vector exp. With AVX-512 (F and BW) these are intrinsics; elsewhere `kSimd` is false and the
// kernels take their scalar loops, which do the same arithmetic.
#pragma once

#include "common.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define TANDEM_SIMD 1
#endif

namespace tandem {

#ifdef TANDEM_SIMD
constexpr bool kSimd = true;
constexpr int kWidth = 16;

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// float32 bits rounded to bfloat16's (nearest even; NaN stays a quiet NaN), in the high halves.
inline __m512i bf16_bits(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_mask_blend_epi32(nan, rounded, _mm512_set1_epi32(0x7fc00000));
}

inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(c10::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_bits(v), 16)));
}
inline void store16(c10::Half* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}

// v rounded to T and widened back: what a torch op in T leaves between two steps.
template <typename T>
inline __m512 round16(__m512 v);
template <>
inline __m512 round16<float>(__m512 v) { return v; }
template <>
inline __m512 round16<c10::BFloat16>(__m512 v) {
  return _mm512_castsi512_ps(_mm512_and_si512(bf16_bits(v), _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}
template <>
inline __m512 round16<c10::Half>(__m512 v) { return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT)); }

// `fast_exp` on 16 lanes (the same reduction and polynomial).
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.33f)), _mm512_set1_ps(88.72f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(y, n);
}
#else
constexpr bool kSimd = false;
constexpr int kWidth = 1;
#endif

}  // namespace tandem
