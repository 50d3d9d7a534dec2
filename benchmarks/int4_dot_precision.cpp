// How far the INT4 dot form (quantized_bf16_dot.h: decode's product on vdpbf16ps) lands from a float64 sum of the
// same BF16 activations and INT4 weights: N = 256 random weight rows of K columns, activations normal with every
// 97th one 100× larger (outliers), one or more activation rows. Prints the worst |error| over Σ|x·s| of a row and
// the relative L2 error over all outputs. Build against another commit's csrc to compare kernels.
//   g++ -O2 -std=gnu++17 -Icsrc -Icsrc/kernels -mavx2 -mfma -mf16c -mavx512f -mavx512bw -mavx512vl -mavx512dq \
//       -mavx512bf16 benchmarks/int4_dot_precision.cpp -o /tmp/int4_dot_precision
//   /tmp/int4_dot_precision 2048 1      # K rows
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "kernels/avx512_bf16.cpp"
namespace kt {  // the FP8 dot form lives in its own file (AVX-512 VBMI flags); this build never calls it
void gemm_nt_fp8_bf16_dot(const GemmNT<fp8_block>&) { std::abort(); }
}  // namespace kt

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s K rows (K a multiple of 32)\n", argv[0]);
    return 1;
  }
  const int N = 256, K = std::atoi(argv[1]), M = std::atoi(argv[2]);
  std::mt19937 rng(1);
  std::normal_distribution<float> normal;
  std::vector<uint8_t> codes(size_t(N) * K / 2);
  for (auto& c : codes) c = uint8_t(rng());
  std::vector<bf16> scales(size_t(N) * (K / 32));
  for (auto& s : scales) s = kt::f32_to_bf16(0.01f * (1 + float(rng() % 100) / 50.f));
  std::vector<float> a(size_t(M) * K);
  for (size_t i = 0; i < a.size(); ++i)
    a[i] = kt::bf16_to_f32(kt::f32_to_bf16(normal(rng) * (i % 97 == 0 ? 100.f : 1.f)));  // exact in BF16
  std::vector<float> c(size_t(M) * N);
  const kt::GemmNT<kt::int4_group> g{
      M, N, K, {nullptr, a.data(), K},
      kt::Rows<kt::int4_group>{reinterpret_cast<const uint32_t*>(codes.data()), K / 8, scales.data(), K / 32, 0},
      c.data(), N, 1.f, false};
  gemm_nt_int4_act(g);
  double worst = 0, err2 = 0, ref2 = 0;
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < N; ++n) {
      double ref = 0, mag = 0;
      for (int k = 0; k < K; ++k) {
        const int nibble = (codes[(size_t(n) * K + k) / 2] >> (4 * (k & 1))) & 15;
        const double xs = double(a[size_t(m) * K + k]) * kt::bf16_to_f32(scales[size_t(n) * (K / 32) + k / 32]);
        ref += xs * (nibble - 8);
        mag += std::fabs(xs);
      }
      const double e = std::fabs(c[size_t(m) * N + n] - ref);
      worst = std::max(worst, e / mag);
      err2 += e * e;
      ref2 += ref * ref;
    }
  std::printf("K=%d rows=%d: max |err| / sum|x s| = %.3g, relative L2 = %.3g\n", K, M, worst, std::sqrt(err2 / ref2));
}
