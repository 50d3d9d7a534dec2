// Kernel set for AVX-512 with the BF16 dot product (vdpbf16ps): the AVX-512 kernels, plus a dot-form
// product with BF16 weights for BF16 activations (the forward projections of a BF16 model), which rounds
// the activations to BF16 once per row block and multiplies BF16 pairs straight from the weight rows: 32
// multiply-adds per instruction and no widening of the weights. x is exact in BF16 already; h = silu(g)·u
// is rounded as the model's own dtype would (tests/tolerances.py: BF16_DOT).
#include "simd_avx512.h"
#include "kernel_body.h"

namespace {

constexpr int DP_MR = 4, DP_NR = 4, DP_KC = 2048;  // A block: 4 rows × 2048 BF16 = 16 KB on the stack

void gemm_nt_bf16_dot(const GemmNT<bf16>& g) {
  alignas(64) bf16 abuf[DP_MR][DP_KC];
  for (int k0 = 0; k0 < g.K; k0 += DP_KC) {
    const int klen = std::min(DP_KC, g.K - k0), kpad = (klen + 31) / 32 * 32;
    const __mmask32 tail = klen % 32 ? __mmask32((1u << (klen % 32)) - 1) : __mmask32(~0u);
    for (int m0 = 0; m0 < g.M; m0 += DP_MR) {
      const int mr = std::min(DP_MR, g.M - m0);
      for (int i = 0; i < DP_MR; ++i) {
        const float* a = g.a.at(m0 + std::min(i, mr - 1)) + k0;
        int k = 0;
        for (; k + 32 <= klen; k += 32) {
          __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(a + k + 16), _mm512_loadu_ps(a + k));
          _mm512_store_si512(reinterpret_cast<__m512i*>(&abuf[i][k]), reinterpret_cast<__m512i&>(v));
        }
        for (; k < klen; ++k) abuf[i][k] = kt::f32_to_bf16(a[k]);
        for (; k < kpad; ++k) abuf[i][k] = 0;  // pairs past K multiply zeros (masked weights below)
      }
      for (int n0 = 0; n0 < g.N; n0 += DP_NR) {
        const int nr = std::min(DP_NR, g.N - n0);
        const bf16* b[DP_NR];
        for (int j = 0; j < DP_NR; ++j) b[j] = g.b.at(n0 + std::min(j, nr - 1)) + k0;
        __m512 acc[DP_MR][DP_NR];
        for (int i = 0; i < DP_MR; ++i)
          for (int j = 0; j < DP_NR; ++j) acc[i][j] = _mm512_setzero_ps();
        for (int k = 0; k < kpad; k += 32) {
          const __mmask32 m = k + 32 <= klen ? __mmask32(~0u) : tail;
          __m512i bv[DP_NR];
          for (int j = 0; j < DP_NR; ++j) bv[j] = _mm512_maskz_loadu_epi16(m, b[j] + k);
          for (int i = 0; i < DP_MR; ++i) {
            __m512i av = _mm512_load_si512(reinterpret_cast<const __m512i*>(&abuf[i][k]));
            for (int j = 0; j < DP_NR; ++j)
              acc[i][j] = _mm512_dpbf16_ps(acc[i][j], reinterpret_cast<__m512bh&>(av), reinterpret_cast<__m512bh&>(bv[j]));
          }
        }
        for (int i = 0; i < mr; ++i)
          for (int j = 0; j < nr; ++j)
            store_chunk(g.c + long(m0 + i) * g.ldc + n0 + j, g.alpha, _mm512_reduce_add_ps(acc[i][j]), g.accumulate,
                        k0 == 0);
      }
    }
  }
}

}  // namespace

namespace kt {
const KernelSet& kernels_avx512_bf16() {
  static const KernelSet set = [] {
    KernelSet s = make_kernel_set("avx512_bf16");
    s.gemm_nt_bf16_act = gemm_nt_bf16_dot;
    return s;
  }();
  return set;
}
}  // namespace kt
