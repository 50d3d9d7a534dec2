// Kernel set compiled for the reference path (compile flags in CMakeLists.txt).
#include "simd_scalar.h"
#include "kernel_body.h"

namespace kt {
const KernelSet& kernels_reference() {
  static const KernelSet set = make_kernel_set("reference");
  return set;
}
}  // namespace kt
