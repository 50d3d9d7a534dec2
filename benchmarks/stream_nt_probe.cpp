// The emulated tiles' dot form (tile_nt on vdpbf16ps, avx512_bf16.cpp) on weights streamed from RAM, as the
// forward's gate/up items read them: each call a fresh slice of N weight rows × K (512 MB of slices in all), M
// activation rows hot, the next slice requested into L2 during the call as the engine's `next` does (argument
// `next` = 1) or left to the hardware prefetchers (0). One thread; run two copies for both cores of the dev machine.
//   g++ -O3 -std=gnu++17 -Icsrc -Icsrc/kernels -mavx2 -mfma -mf16c -mavx512f -mavx512bw -mavx512vl -mavx512dq \
//       -mavx512bf16 benchmarks/stream_nt_probe.cpp -o /tmp/stream_nt_probe
//   /tmp/stream_nt_probe 32 64 2048 4000 1      # M N K calls next
#include "kernels/avx512_bf16.cpp"

#include <chrono>
#include <cstdio>
#include <cstdlib>

// The FP8 dot form lives in its own file (AVX-512 VBMI flags); this probe never calls it.
namespace kt {
void gemm_nt_fp8_bf16_dot(const GemmNT<fp8_block>&) { std::abort(); }
}  // namespace kt

int main(int argc, char** argv) {
  if (argc < 6) {
    std::fprintf(stderr, "usage: %s M N K calls next(0|1)\n", argv[0]);
    return 1;
  }
  const int M = std::atoi(argv[1]), N = std::atoi(argv[2]), K = std::atoi(argv[3]), calls = std::atoi(argv[4]);
  const bool request_next = std::atoi(argv[5]) != 0;
  const long slice = long(N) * K, slices = (1L << 29) / (slice * 2);
  std::vector<bf16> w(slices * slice, bf16(0x3f80)), a(kt::tile_rows(M) * kt::tile_ld(K), bf16(0x3f80));
  std::vector<float> c(long(M) * N);
  auto call = [&](long i) {
    kt::Upcoming next{};
    if (request_next)
      next = {reinterpret_cast<const char*>(w.data() + ((i + 1) % slices) * slice), long(K) * 2, long(K) * 2, N};
    const kt::Rows<bf16> rows{nullptr, w.data() + (i % slices) * slice, K};
    tile_nt<Bf16Tiles, bf16>(kt::TileNT<bf16>{M, N, K, a.data(), rows, c.data(), N, false, next});
  };
  for (long i = 0; i < slices; ++i) call(i);  // every page touched once
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < calls; ++i) call(i);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("M=%d N=%d K=%d next=%d: %.0f GFLOP/s, weights read at %.1f GB/s\n", M, N, K, int(request_next),
              2.0 * M * N * K * calls / s / 1e9, 2.0 * slice * calls / s / 1e9);
}
