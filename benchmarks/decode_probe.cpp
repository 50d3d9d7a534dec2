// The tile path's quantized row decoder (row_bf16 in csrc/kernels/tile_body.h: FP8/INT4 weights straight to
// BF16) against widening to float32 and rounding (widen_row + round_to_bf16, what it replaced): bit equality
// over random rows, scales that make zero, subnormal and near-overflow products, segments on and off the
// block/group boundaries; then ns per weight of both on one thread. Needs AVX-512-BF16 to run.
//   g++ -std=c++17 -O2 -mavx2 -mfma -mf16c -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512bf16 \
//       -mamx-tile -mamx-bf16 -Icsrc benchmarks/decode_probe.cpp -o /tmp/decode_probe && /tmp/decode_probe
#include "kernels/simd_avx512.h"
#include "kernels/kernel_body.h"
#include "kernels/tile_body.h"
#include <chrono>
#include <cstdio>
#include <random>
template <class TB>
void old_path(const kt::Rows<TB>& b, long i, long col0, long len, bf16* dst) {
  std::vector<float> wide(len);
  widen_row(b, i, col0, len, wide.data());
  round_to_bf16(len, wide.data(), dst);
}
static double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
int main() {
  std::mt19937 rng(7);
  const long R = 64, K = 2048 + 40;  // K not a multiple of 128: partial FP8 block, INT4 groups whole
  std::vector<uint32_t> words(R * ((K + 7) / 8));
  for (auto& w : words) w = rng();
  std::vector<bf16> s4(R * ((K + 31) / 32));
  for (size_t j = 0; j < s4.size(); ++j) {
    float v = std::ldexp(float(rng() % 1000 + 1) / 1000.f, int(rng() % 60) - 40);
    if (j % 97 == 0) v = 0.f;
    if (j % 89 == 0) v = std::ldexp(1.f, -130);   // a subnormal product
    if (j % 83 == 0) v = std::ldexp(1.f, 125);    // products near the float32 limit
    s4[j] = kt::f32_to_bf16(j % 2 ? -v : v);
  }
  std::vector<uint8_t> q(R * K);
  for (auto& c : q) c = uint8_t(rng());
  std::vector<float> s8(((R + 127) / 128) * ((K + 127) / 128));
  for (size_t j = 0; j < s8.size(); ++j) s8[j] = std::ldexp(float(rng() % 1000 + 1) / 1000.f, int(rng() % 20) - 10);
  kt::Rows<int4_group> b4{words.data(), (K + 7) / 8, s4.data(), (K + 31) / 32, 0};
  kt::Rows<fp8_block> b8{q.data(), K, s8.data(), (K + 127) / 128, 0};
  std::vector<bf16> a(K), o(K);
  long bad = 0, checked = 0;
  const long segs[][2] = {{0, K}, {0, 256}, {256, 512}, {8, 200}, {5, 77}, {1024, 33}, {2048, 40}, {96, 1}};
  for (long i = 0; i < R; ++i)
    for (auto& sg : segs) {
      const bf16* p = row_bf16(b4, i, sg[0], sg[1], a.data());
      old_path(b4, i, sg[0], sg[1], o.data());
      for (long j = 0; j < sg[1]; ++j) bad += (p[j] != o[j]) && !((o[j] & 0x7fff) > 0x7f80 && (p[j] & 0x7fff) > 0x7f80);
      p = row_bf16(b8, i, sg[0], sg[1], a.data());
      old_path(b8, i, sg[0], sg[1], o.data());
      for (long j = 0; j < sg[1]; ++j) bad += (p[j] != o[j]) && !((o[j] & 0x7fff) > 0x7f80 && (p[j] & 0x7fff) > 0x7f80);
      checked += 2 * sg[1];
    }
  printf("bit mismatches: %ld of %ld\n", bad, checked);
  for (int fmt = 0; fmt < 2; ++fmt) {
    double tn = 1e9, to = 1e9;
    for (int rep = 0; rep < 5; ++rep) {
      double t0 = now();
      for (long i = 0; i < R; ++i) fmt ? (void)row_bf16(b8, i, 0, 2048, a.data()) : (void)row_bf16(b4, i, 0, 2048, a.data());
      double t1 = now();
      for (long i = 0; i < R; ++i) fmt ? old_path(b8, i, 0, 2048, o.data()) : old_path(b4, i, 0, 2048, o.data());
      double t2 = now();
      tn = std::min(tn, t1 - t0), to = std::min(to, t2 - t1);
    }
    printf("%s: new %.3f ns/weight, old %.3f ns/weight\n", fmt ? "fp8" : "int4", tn / (R * 2048) * 1e9, to / (R * 2048) * 1e9);
  }
}
