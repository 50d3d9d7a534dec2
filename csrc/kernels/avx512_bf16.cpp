// Kernel set compiled for the avx512_bf16 path (compile flags in CMakeLists.txt).
#include "simd_avx512.h"
#include "kernel_body.h"

namespace kt {
const KernelSet& kernels_avx512_bf16() {
  static const KernelSet set = make_kernel_set("avx512_bf16");
  return set;
}
}  // namespace kt
