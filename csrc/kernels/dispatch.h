// Picks the kernel set from CPUID at run time. Only this file and the per-ISA files know ISA names.
#pragma once
#include <string>
#include <vector>

#include "kernels.h"

namespace kt {

struct CpuFeatures {
  bool avx2_fma, avx512, avx512_bf16, amx_bf16;
};

CpuFeatures cpu_features();
// Whether the tile kernels ("amx") may run here, and a sentence saying why not (empty when they may).
bool tiles_granted();
std::string tiles_status();
// Kernel sets this CPU can run, best first ("reference" always last).
std::vector<std::string> runnable_kernel_sets();
// The best runnable set, or the named one; throws std::runtime_error with the reason when the CPU
// cannot run it (or, with an empty name, when it lacks AVX2 + FMA).
const KernelSet& select_kernels(const std::string& name);

}  // namespace kt
