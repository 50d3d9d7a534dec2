// Kernel set compiled for the avx512 path (compile flags in CMakeLists.txt).
#include "simd_avx512.h"
#include "kernel_body.h"

namespace kt {
const KernelSet& kernels_avx512() {
  static const KernelSet set = make_kernel_set("avx512");
  return set;
}
}  // namespace kt
