// BF16 storage format: the upper 16 bits of an IEEE float32.
// Scalar codecs used by the reference kernels and by edge loops of the SIMD kernels. The codecs of formats/*.h are
// static: each file gets its own copy, so one compiled with an ISA's flags is never the one a baseline file calls.
#pragma once
#include <cstdint>
#include <cstring>

namespace kt {

using bf16 = uint16_t;
static_assert(sizeof(bf16) == 2, "bf16 is two bytes");

static inline float bf16_to_f32(bf16 v) {
  uint32_t bits = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Round to nearest even, as torch's float->bfloat16 cast does; NaN stays a quiet NaN.
static inline bf16 f32_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return bf16((bits >> 16) | 0x40u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return bf16(bits >> 16);
}

static inline float to_f32(float v) { return v; }
static inline float to_f32(bf16 v) { return bf16_to_f32(v); }

}  // namespace kt
