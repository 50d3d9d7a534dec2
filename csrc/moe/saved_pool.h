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

// At least n floats: the smallest free buffer of n up to 2n (a shorter batch reuses a longer one's buffers),
// else a new one of n + n/8 (so slightly longer batches reuse it). Batch lengths vary from step to step, and
// with gradient checkpointing's kept first passes every layer holds its buffers at once (kt_sft/ops/
// kept_forward.py), so a miss must not drop the pool: it releases only the largest free buffer of n/2 up to n,
// the same kind of buffer from a shorter batch, which this kind of request has outgrown. The pool then holds
// one set of buffers per factor of two of batch length at most.
SavedBuffer take_saved(size_t n);

// Buffers allocated so far (every take_saved that found none to reuse), for tests.
size_t saved_pool_allocations();
// Bytes of the free buffers: RAM the OS counts as used that a later pass reuses (kept_forward.py's room check).
size_t saved_pool_free_bytes();
// Frees the free list (buffers in use are unaffected); tests start from an empty pool with it.
void saved_pool_release();
// In a forked child: the pool's lock may have been held by a thread that does not exist there.
void saved_pool_after_fork();

}  // namespace kt
