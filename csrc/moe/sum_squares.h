// The sum of squares of many float32/bf16 tensors on the engine's threads: gradient-norm clipping over the CPU
// experts' LoRA gradients (kt_sft/ops/grad_clip.py). torch's norm of a CPU tensor runs on one thread (~9 GB/s
// on the GPU machine), and at 48 Qwen3-30B-A3B layers those gradients are 3.1 GiB.
#pragma once
#include <vector>

#include "view.h"

namespace kt {

// Σ x² over every element of every tensor, accumulated in float64 in a fixed order (chunks of a fixed size,
// added up in order), so the result does not depend on the thread count.
double sum_squares(const std::vector<View>& tensors);

}  // namespace kt
