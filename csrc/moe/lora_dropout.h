// LoRA dropout on the routed experts, as PEFT applies it to a LoRA layer's input: A sees x · keep / (1 − p),
// with an independent mask for every (projection, token·K + k, column) — each routed copy of a token is a
// separate call of its expert's LoRA, as in PEFT's per-expert modules. Masks are never stored: a counter-based
// hash of (seed, projection, row, column) regenerates them in backward, on any thread, in any order.
// kt_sft/ops/reference.py implements the same hash (lora_dropout_keep) for the tests.
#pragma once
#include <cstdint>

namespace kt {

inline uint32_t fmix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  h ^= h >> 16;
  return h;
}

struct LoraDropout {
  float p = 0.f;      // 0: off
  uint32_t seed = 0;  // one per forward (and its backward)

  bool on() const { return p > 0.f; }
  // The hash state of one row of one projection; column c then keeps with probability 1 − p.
  uint32_t row_key(int proj, uint32_t row) const { return fmix32(fmix32(seed ^ (uint32_t(proj) * 0x9E3779B9u)) ^ row); }
  bool keep(uint32_t row_key, uint32_t col) const {
    return float(fmix32(row_key ^ col) >> 8) * (1.f / 16777216.f) >= p;
  }
  // dst[j] = src[j] · keep(c0 + j) / (1 − p) for j < n (dst may be src).
  void apply(int proj, uint32_t row, long c0, long n, const float* src, float* dst) const {
    const uint32_t key = row_key(proj, row);
    const float scale = 1.f / (1.f - p);
    for (long j = 0; j < n; ++j) dst[j] = keep(key, uint32_t(c0 + j)) ? src[j] * scale : 0.f;
  }
  // dst[j] += src[j] · keep(c0 + j) / (1 − p): the gradient through the mask.
  void accumulate(int proj, uint32_t row, long c0, long n, const float* src, float* dst) const {
    const uint32_t key = row_key(proj, row);
    const float scale = 1.f / (1.f - p);
    for (long j = 0; j < n; ++j)
      if (keep(key, uint32_t(c0 + j))) dst[j] += src[j] * scale;
  }
};

}  // namespace kt
