// 8-lane float32 vectors on AVX2 + FMA. BF16 loads widen to float32 (bf16 is the top half of a float).
#pragma once
#include <immintrin.h>

#include "../formats/bf16.h"

namespace {
struct Simd {
  using V = __m256;
  static constexpr int W = 8;
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V load(const kt::bf16* p) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  // W float8_e4m3fn codes as float32 · 2^-8: each byte shifted left by 7 in a 16-bit lane puts exponent and
  // mantissa in a half float's fields (exponent bias 15 instead of 7, so subnormals map to subnormals) and
  // the sign in bit 14, which adding bit 14 to itself moves to bit 15; F16C converts that exactly.
  static V fp8_scaled(const uint8_t* p) {
    __m128i h = _mm_slli_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))), 7);
    h = _mm_add_epi16(h, _mm_and_si128(h, _mm_set1_epi16(0x4000)));  // sign from bit 14 to bit 15
    return _mm256_cvtph_ps(h);
  }
  // 2·W codes at once, the same values as two fp8_scaled: the integer steps run once on 16 lanes (FP8
  // decode ~10% faster on Zen 3, where it is bound by these steps and the conversions).
  static constexpr bool fp8_pairs = true;
  static void fp8_scaled2(const uint8_t* p, V& lo, V& hi) {
    __m256i h = _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 7);
    h = _mm256_add_epi16(h, _mm256_and_si256(h, _mm256_set1_epi16(0x4000)));
    lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
    hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
  }
  // 2·W INT4 nibbles from W bytes (byte t holds weights 2t, low nibble, and 2t + 1) as their codes 0..15 in
  // float32, without the offset 8: the even-indexed weights in `even`, the odd in `odd`. Half the integer
  // steps per weight of int4_values (a byte widening, a mask or a shift, a conversion per W weights).
  static constexpr bool int4_split = true;
  static constexpr int int4_split_bias = 8;  // the codes come without their offset: the kernel takes it off per row
  static void int4_split_values(const uint8_t* p, V& even, V& odd) {
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    even = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15)));
    odd = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
  }
  // The W = 8 nibbles of one int32 word, lowest first, as the signed INT4 values (nibble − 8) in float32.
  static V int4_values(const uint32_t* p) {
    __m256i v = _mm256_srlv_epi32(_mm256_set1_epi32(int(p[0])), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28));
    v = _mm256_sub_epi32(_mm256_and_si256(v, _mm256_set1_epi32(15)), _mm256_set1_epi32(8));
    return _mm256_cvtepi32_ps(v);
  }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V div(V a, V b) { return _mm256_div_ps(a, b); }
  // As in simd_avx512.h.
  static V min(V a, V b) { return _mm256_min_ps(a, b); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static V zero_where_ge(V a, V b, V v) { return _mm256_and_ps(_mm256_cmp_ps(a, b, _CMP_NGE_UQ), v); }
  static float hsum(V v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  // exp(x) = 2^n · e^r with n = round(x·log2 e) and r = x − n·ln2 split in two parts (Cody–Waite),
  // e^r by its degree-6 Taylor polynomial: |r| ≤ 0.347 gives ≤ 2 ulp relative error.
  static V exp(V x) {
    x = _mm256_max_ps(_mm256_min_ps(x, set1(88.f)), set1(-87.f));
    V n = _mm256_round_ps(_mm256_mul_ps(x, set1(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    V r = _mm256_fnmadd_ps(n, set1(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, set1(-2.12194440e-4f), r);
    V p = set1(1.f / 720);
    p = fma(p, r, set1(1.f / 120));
    p = fma(p, r, set1(1.f / 24));
    p = fma(p, r, set1(1.f / 6));
    p = fma(p, r, set1(0.5f));
    p = fma(p, r, set1(1.f));
    p = fma(p, r, set1(1.f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
  }
};
}  // namespace
