#include "dispatch.h"

#include <stdexcept>

namespace kt {

// __builtin_cpu_supports also checks that the OS saves the wider register state (XGETBV).
CpuFeatures cpu_features() {
  __builtin_cpu_init();
  CpuFeatures f{};
  f.avx2_fma = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  f.avx512 = f.avx2_fma && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl");
  f.avx512_bf16 = f.avx512 && __builtin_cpu_supports("avx512bf16");
  f.amx_bf16 = __builtin_cpu_supports("amx-bf16");
  return f;
}

// In order of preference: the first is the default. avx512 comes before avx512_bf16: on the Xeon (Sapphire
// Rapids class) of BENCHMARKS.md the vdpbf16ps forward did no better than float32 FMAs on widened tiles at
// layer S and was 1.25x slower at layer Q (BF16 forward 246 vs 196 ms, commit d862711), so it is opt-in.
std::vector<std::string> runnable_kernel_sets() {
  CpuFeatures f = cpu_features();
  std::vector<std::string> r;
  if (f.avx512) r.push_back("avx512");
  if (f.avx512_bf16) r.push_back("avx512_bf16");
  if (f.avx2_fma) r.push_back("avx2");
  r.push_back("reference");
  return r;
}

const KernelSet& select_kernels(const std::string& name) {
  auto sets = runnable_kernel_sets();
  std::string want = name;
  if (want.empty()) {
    if (sets.front() == "reference")
      throw std::runtime_error(
          "This CPU lacks AVX2 and FMA, which kt_sft's expert kernels need (any x86-64 CPU since 2013 has them); "
          "run on such a CPU, or force the slow portable path with kt_sft.set_kernels('reference') for testing.");
    want = sets.front();
  }
  bool ok = false;
  for (auto& s : sets) ok |= s == want;
  if (!ok) {
    std::string list;
    for (auto& s : sets) list += (list.empty() ? "" : ", ") + s;
    throw std::runtime_error("Kernel set '" + want + "' cannot run on this CPU; it can run: " + list + ".");
  }
  if (want == "avx512_bf16") return kernels_avx512_bf16();
  if (want == "avx512") return kernels_avx512();
  if (want == "avx2") return kernels_avx2();
  return kernels_reference();
}

}  // namespace kt
