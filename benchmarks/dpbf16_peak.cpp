// The BF16 dot product's ceiling on this CPU, for the avx512_bf16 set's emulated tile products: vdpbf16ps
// (16 lanes × 2 multiply-adds) and, for scale, vfmadd231ps on 512-bit registers, 12 independent sums each so
// that throughput, not latency, bounds the loop. Run one copy per core at once to see the all-core rate. -O3: at
// -O2 GCC 12 keeps the sums in memory (a load and a store around every instruction), which halves the rate.
//   g++ -O3 -mavx512f -mavx512bw -mavx512bf16 benchmarks/dpbf16_peak.cpp -o /tmp/dpbf16_peak
//   for c in 0 1; do taskset -c $c /tmp/dpbf16_peak & done; wait
#include <immintrin.h>

#include <chrono>
#include <cstdio>

template <class Step>
double per_second(Step step) {
  constexpr long kIters = 200000000;
  const auto t0 = std::chrono::steady_clock::now();
  for (long n = 0; n < kIters; ++n) step();
  return kIters * 12 / std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

int main() {
  __m512 acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = _mm512_set1_ps(float(i));
  __m512bh a = reinterpret_cast<__m512bh>(_mm512_set1_epi32(0x3f803f80));  // pairs of 1.0
  const __m512bh b = a;
  const double dp = per_second([&] {
    for (int i = 0; i < 12; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
    __asm__ volatile("" : "+v"(a));  // keeps the loop from being folded away
  });
  __m512 u = _mm512_set1_ps(1.f);
  const __m512 v = _mm512_set1_ps(0.f);
  const double fma = per_second([&] {
    for (int i = 0; i < 12; ++i) acc[i] = _mm512_fmadd_ps(acc[i], u, v);
    __asm__ volatile("" : "+v"(u));
  });
  float sink = 0.f;
  for (int i = 0; i < 12; ++i) sink += _mm512_reduce_add_ps(acc[i]);
  std::printf("vdpbf16ps %.2f G/s = %.0f GFLOP/s; vfmadd231ps %.2f G/s = %.0f GFLOP/s (%g)\n", dp / 1e9, dp * 64 / 1e9,
              fma / 1e9, fma * 32 / 1e9, sink);
}
