// Kernel set compiled for the avx2 path (compile flags in CMakeLists.txt).
#include "simd_avx2.h"
#include "kernel_body.h"

namespace kt {
const KernelSet& kernels_avx2() {
  static const KernelSet set = make_kernel_set("avx2");
  return set;
}
}  // namespace kt
