// The FP8 / INT4 dot form on vdpbf16ps (quantized_bf16_dot.h: decode's product, one activation row) on one thread:
// each call a fresh slice of N weight rows × K from 512 MB of slices (RAM), or the same slice every call (hot: the
// instructions' own rate). Run two copies at once for both cores of the dev machine.
//   g++ -O3 -std=gnu++17 -Icsrc -Icsrc/kernels -mavx2 -mfma -mf16c -mavx512f -mavx512bw -mavx512vl -mavx512dq \
//       -mavx512bf16 -mavx512vbmi [-DPROBE_FP8] benchmarks/quantized_dot_probe.cpp -o /tmp/qdot_probe
//   /tmp/qdot_probe 512 2048 3000 0 [rows]      # N K calls hot(0|1) [activation rows, 1 by default]
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#ifdef PROBE_FP8
#include "kernels/fp8_bf16_dot.cpp"
using Format = kt::fp8_block;
#else
#include "kernels/avx512_bf16.cpp"
using Format = kt::int4_group;
namespace kt {  // the FP8 dot form lives in its own file (AVX-512 VBMI flags); this build never calls it
void gemm_nt_fp8_bf16_dot(const GemmNT<fp8_block>&) { std::abort(); }
}  // namespace kt
#endif

int main(int argc, char** argv) {
  if (argc < 5) {
    std::fprintf(stderr, "usage: %s N K calls hot(0|1) [rows]\n", argv[0]);
    return 1;
  }
  const int N = std::atoi(argv[1]), K = std::atoi(argv[2]), calls = std::atoi(argv[3]);
  const bool hot = std::atoi(argv[4]) != 0;
  const int M = argc > 5 ? std::atoi(argv[5]) : 1;
#ifdef PROBE_FP8
  const long row_bytes = K, scales = ((N + 127) / 128) * ((K + 127) / 128);
  const char* name = "fp8";
#else
  const long row_bytes = K / 2, scales = long(N) * (K / 32);
  const char* name = "int4";
#endif
  const long slice = N * row_bytes, slices = hot ? 1 : (1L << 29) / slice;
  std::vector<uint8_t> codes(slices * slice);
  for (size_t i = 0; i < codes.size(); ++i) codes[i] = uint8_t((i * 2654435761u >> 13) & 0x77);
  std::vector<float> a(long(M) * K, 0.5f), c(long(M) * N);
#ifdef PROBE_FP8
  std::vector<float> s(slices * scales, 0.01f);
  auto rows_of = [&](long sl) {
    return kt::Rows<Format>{codes.data() + sl * slice, K, s.data() + sl * scales, (K + 127) / 128, 0};
  };
#else
  std::vector<bf16> s(slices * scales, bf16(0x3c23));
  auto rows_of = [&](long sl) {
    return kt::Rows<Format>{reinterpret_cast<const uint32_t*>(codes.data() + sl * slice), K / 8, s.data() + sl * scales,
                       K / 32, 0};
  };
#endif
  auto call = [&](long i) {
    const kt::GemmNT<Format> g{M, N, K, {nullptr, a.data(), K}, rows_of(i % slices), c.data(), N, 1.f, false};
#ifdef PROBE_FP8
    kt::gemm_nt_fp8_bf16_dot(g);
#else
    gemm_nt_int4_act(g);
#endif
  };
  for (long i = 0; i < slices; ++i) call(i);  // every page touched once
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < calls; ++i) call(i);
  const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("%s N=%d K=%d rows=%d hot=%d: %.1f G weights/s, codes at %.1f GB/s\n", name, N, K, M, int(hot),
              double(N) * K * calls / sec / 1e9, double(slice) * calls / sec / 1e9);
}
