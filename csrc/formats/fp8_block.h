// FP8 block-128 format (DeepSeek-V3/R1, Kimi-K2-Instruct): float8_e4m3fn values, one float32 scale per
// 128×128 block, W[o, i] = q[o, i] · scale[o / 128, i / 128]. Edge blocks may be partial. Checkpoints with a scale
// per output channel (compressed-tensors FP8, strategy "channel") take blocks of one row: scale[o, i / 128].
// Scalar codec used by the reference kernels and by edge loops of the SIMD kernels.
#pragma once
#include <cmath>
#include <cstdint>

namespace kt {

struct fp8_block {
  static constexpr int BLOCK = 128;
};

// e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; exponent 0 is subnormal. Codes 0x7f/0xff are NaN
// in the format; the engine refuses weights holding them at construction, so they are never decoded.
static inline float fp8_e4m3_to_f32(uint8_t b) {
  const int e = (b >> 3) & 15, m = b & 7;
  const float v = e ? std::ldexp(1.f + m / 8.f, e - 7) : std::ldexp(m / 8.f, -6);
  return b & 0x80 ? -v : v;
}

static inline bool fp8_e4m3_is_nan(uint8_t b) { return (b & 0x7f) == 0x7f; }

}  // namespace kt
