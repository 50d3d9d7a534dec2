// RAWINT4 group-32 format (compressed-tensors "pack-quantized", symmetric; Kimi-K2-Thinking / K2.5 routed
// experts): element j of a row is the nibble at bits 4·(j % 8) of int32 word j / 8, stored as q + 8, and
// W[o, j] = (nibble − 8) · scale[o, j / 32] with BF16 scales. Rows hold ceil(in / 8) words.
#pragma once
#include <cstdint>

#include "bf16.h"

namespace kt {

struct int4_group {
  static constexpr int GROUP = 32;
};

static inline int int4_nibble(const uint32_t* row, long j) {
  return int((row[j / 8] >> (4 * (j % 8))) & 15u);
}

}  // namespace kt
