// Buffers that a training forward saves for its backward, recycled across steps. A layer's g and u are
// N·I floats each (Layer Q: 50 MB apiece); malloc maps blocks that large fresh on every call, and faulting
// in and zeroing them again each step cost ~50 ms of a ~120 ms Layer Q forward on the GPU machine.
#pragma once
#include <cstddef>
#include <memory>

namespace kt {

// Returns a buffer to the pool when its owner (Saved) goes.
struct SavedFree {
  size_t cap = 0;
  void operator()(float* p) const;
};
using SavedBuffer = std::unique_ptr<float[], SavedFree>;

// At least n floats: a free buffer of n up to 1/8 more, else a new one of n + n/8 (so slightly longer
// batches reuse it). On a miss the free buffers are released first: the shapes changed, and what the pool
// keeps never exceeds what recent steps saved.
SavedBuffer take_saved(size_t n);

}  // namespace kt
