#include "dispatch.h"

#include <sys/syscall.h>
#include <unistd.h>

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
  f.amx_bf16 = f.avx512_bf16 && __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16");
  return f;
}

// Linux hands the tile registers' state (8 KB per thread) only to processes that ask for it; without the
// grant the first tile instruction kills the process. Asked once; the answer holds for every thread.
bool tiles_granted() {
  static const bool granted = [] {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return cpu_features().amx_bf16 && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return granted;
}

std::string tiles_status() {
  if (!cpu_features().amx_bf16) return "this CPU has no AMX-BF16 tile unit";
  if (!tiles_granted())
    return "the OS refused the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM; Linux 5.16 or later grants it): "
           "running the next kernel set instead";
  return "";
}

// In order of preference: the first is the default. amx is avx512 plus tile products; avx512_bf16 is avx512
// plus the same tile products on vdpbf16ps, which on an AVX-512 BF16 CPU without AMX (AMD Zen 4) ran Layer Q
// training ~1.3x faster than avx512's float32 FMAs (BENCHMARKS.md).
std::vector<std::string> runnable_kernel_sets() {
  CpuFeatures f = cpu_features();
  std::vector<std::string> r;
  if (tiles_granted()) r.push_back("amx");
  if (f.avx512_bf16) r.push_back("avx512_bf16");
  if (f.avx512) r.push_back("avx512");
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
  if (want == "amx") return kernels_amx();
  if (want == "avx512_bf16") return kernels_avx512_bf16();
  if (want == "avx512") return kernels_avx512();
  if (want == "avx2") return kernels_avx2();
  return kernels_reference();
}

}  // namespace kt
