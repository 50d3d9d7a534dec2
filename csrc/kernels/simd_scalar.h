// One-lane "vector" for the portable reference kernels: the generic kernel body compiled on it is
// the scalar reference path, with exactly the loop structure of the SIMD paths.
#pragma once
#include <cmath>

#include "../formats/bf16.h"

namespace {
struct Simd {
  using V = float;
  static constexpr int W = 1;
  static constexpr bool fp8_pairs = false;
  static constexpr bool int4_split = false;
  static V zero() { return 0.f; }
  static V set1(float x) { return x; }
  static V load(const float* p) { return *p; }
  static V load(const kt::bf16* p) { return kt::bf16_to_f32(*p); }
  static void store(float* p, V v) { *p = v; }
  static V fma(V a, V b, V c) { return std::fma(a, b, c); }
  static V add(V a, V b) { return a + b; }
  static V mul(V a, V b) { return a * b; }
  static float hsum(V v) { return v; }
  static V exp(V x) { return std::exp(x); }
  static V div(V a, V b) { return a / b; }
  // As minps / maxps (simd_avx512.h): b where either is NaN.
  static V min(V a, V b) { return a < b ? a : b; }
  static V max(V a, V b) { return a > b ? a : b; }
  static V zero_where_ge(V a, V b, V v) { return a >= b ? 0.f : v; }
};
}  // namespace
