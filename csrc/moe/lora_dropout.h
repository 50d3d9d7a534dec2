// LoRA dropout on the routed experts, as PEFT applies it to a LoRA layer's input: A sees x · keep / (1 − p),
// with an independent mask for every (projection, token·K + k, column) — each routed copy of a token is a
// separate call of its expert's LoRA, as in PEFT's per-expert modules. Masks are never stored: a counter-based
// hash of (seed, projection, row, column) regenerates them in backward, on any thread, in any order.
// kt_sft/ops/reference.py implements the same hash (lora_dropout_keep) for the tests.
//
// The hash functions are `static`: every file that includes this gets its own copy, compiled with its own ISA
// flags (the kernel sets vectorize the per-column loop), so no wider-ISA copy can be shared with another file.
#pragma once
#include <cstdint>

namespace kt {

static inline uint32_t fmix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  h ^= h >> 16;
  return h;
}

// The hash state of one row of one projection.
static inline uint32_t dropout_row_key(uint32_t seed, int proj, uint32_t row) {
  return fmix32(fmix32(seed ^ (uint32_t(proj) * 0x9E3779B9u)) ^ row);
}

// Column `col` of a row is kept with probability 1 − p: the top 24 bits of its hash, as a uniform in [0, 1)
// (exact in float32; converted as a signed int, which AVX2 vectorizes).
static inline bool dropout_keeps(uint32_t row_key, uint32_t col, float p) {
  return float(int32_t(fmix32(row_key ^ col) >> 8)) * (1.f / 16777216.f) >= p;
}

struct LoraDropout {
  float p = 0.f;      // 0: off
  uint32_t seed = 0;  // one per forward (and its backward)
  bool on() const { return p > 0.f; }
};

}  // namespace kt
