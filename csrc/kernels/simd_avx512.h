// 16-lane float32 vectors on AVX-512F. BF16 loads widen to float32 (bf16 is the top half of a float).
#pragma once
#include <immintrin.h>

#include "../formats/bf16.h"

namespace {
struct Simd {
  using V = __m512;
  static constexpr int W = 16;
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V load(const kt::bf16* p) {
    __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  // As in simd_avx2.h, 16 codes at a time.
  static V fp8_scaled(const uint8_t* p) {
    __m256i h = _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 7);
    h = _mm256_add_epi16(h, _mm256_and_si256(h, _mm256_set1_epi16(0x4000)));  // sign from bit 14 to bit 15
    return _mm512_cvtph_ps(h);
  }
  // 2·W codes at once, the same values as two fp8_scaled: the integer steps run once on 32 lanes.
  static constexpr bool fp8_pairs = true;
  static void fp8_scaled2(const uint8_t* p, V& lo, V& hi) {
    __m512i h = _mm512_slli_epi16(_mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 7);
    h = _mm512_add_epi16(h, _mm512_and_si512(h, _mm512_set1_epi16(0x4000)));
    lo = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
    hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
  }
  // As in simd_avx2.h, a group's 16 bytes give its 16 even- and 16 odd-indexed weights, here as the signed
  // values (nibble − 8, int4_signed below): one step masks, converts and takes the offset off (int4_split_bias
  // 0: nothing left to correct per row).
  static constexpr bool int4_split = true;
  static constexpr int int4_split_bias = 0;
  static void int4_split_values(const uint8_t* p, V& even, V& odd) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    even = int4_signed(b);
    odd = int4_signed(_mm512_srli_epi32(b, 4));
  }
  // The W = 16 nibbles of two int32 words, lowest first, as the signed INT4 values (nibble − 8) in float32.
  static V int4_values(const uint32_t* p) {
    __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi32(int(p[0]))), _mm256_set1_epi32(int(p[1])), 1);
    const __m512i shifts = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28);
    return int4_signed(_mm512_srlv_epi32(w, shifts));
  }
  // The low 4 bits (a nibble) of each lane as the signed INT4 value nibble − 8 in float32: a table lookup reads
  // only the low 4 bits of each index lane, so it masks, subtracts 8 and converts in one step.
  static V int4_signed(__m512i nibbles) {
    return _mm512_permutexvar_ps(nibbles, _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7));
  }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V div(V a, V b) { return _mm512_div_ps(a, b); }
  // b where either is NaN, as minps does: min(limit, x) passes a NaN x on.
  static V min(V a, V b) { return _mm512_min_ps(a, b); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  // v where a >= b is false (a NaN keeps v), else 0.
  static V zero_where_ge(V a, V b, V v) { return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(a, b, _CMP_NGE_UQ), v); }
  static float hsum(V v) { return _mm512_reduce_add_ps(v); }
  // Same range reduction and polynomial as the AVX2 path; scalef applies 2^n.
  static V exp(V x) {
    x = _mm512_max_ps(_mm512_min_ps(x, set1(88.f)), set1(-87.f));
    V n = _mm512_roundscale_ps(_mm512_mul_ps(x, set1(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    V r = _mm512_fnmadd_ps(n, set1(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, set1(-2.12194440e-4f), r);
    V p = set1(1.f / 720);
    p = fma(p, r, set1(1.f / 120));
    p = fma(p, r, set1(1.f / 24));
    p = fma(p, r, set1(1.f / 6));
    p = fma(p, r, set1(0.5f));
    p = fma(p, r, set1(1.f));
    p = fma(p, r, set1(1.f));
    return _mm512_scalef_ps(p, n);
  }
};
}  // namespace
