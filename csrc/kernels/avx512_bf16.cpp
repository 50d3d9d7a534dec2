// Kernel set for AVX-512 with the BF16 dot product (vdpbf16ps): the AVX-512 kernels, plus dot-form products
// for BF16 activations (the forward projections of a BF16 model) that round the activations to BF16 once
// per row block and multiply BF16 pairs, 32 multiply-adds per instruction: BF16 weights straight from their
// rows, INT4 weights for one or two rows (decode) as the exact BF16 values nibble − 8, one table lookup per
// 32 weights, each group's products scaled once. x is exact in BF16 already; h = silu(g)·u is rounded as the
// model's own dtype would (tests/tolerances.py: BF16_DOT).
#include <type_traits>

#include "simd_avx512.h"
#include "kernel_body.h"

namespace {

constexpr int DP_KC = 2048;  // A block: up to 4 rows × 2048 BF16 = 16 KB on the stack

// The exact BF16 values −8..7 in lanes 0..15, the table INT4 nibbles index.
inline __m512i int4_table() {
  const __m256bh v = _mm512_cvtneps_pbh(_mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7));
  return _mm512_castsi256_si512(reinterpret_cast<const __m256i&>(v));
}

// Weights [k, k + 32) of one row as 16 BF16 pairs, the first `valid` of them read (zeros for the rest: no
// read past a row's last word, which may end the allocation). INT4: the nibbles themselves, unscaled.
inline __m512i pairs32(const bf16* row, long k, int valid, __m512i) {
  const __mmask32 m = valid >= 32 ? __mmask32(~0u) : __mmask32((1u << valid) - 1);
  return _mm512_maskz_loadu_epi16(m, row + k);
}
inline __m512i pairs32(const Int4Cursor<Simd>& cur, long k, int valid, __m512i table) {
  const __mmask16 m = valid >= 32 ? __mmask16(0xffff) : __mmask16((1u << ((valid + 1) / 2)) - 1);
  const __m512i w = _mm512_permutexvar_epi16(Simd::int4_lanes(_mm_maskz_loadu_epi8(m, cur.w + k / 8)), table);
  return valid >= 32 ? w : _mm512_maskz_mov_epi16(__mmask32((1u << valid) - 1), w);
}

inline const bf16* dot_row(const kt::Rows<bf16>& b, long i) { return b.at(i); }
inline Int4Cursor<Simd> dot_row(const kt::Rows<int4_group>& b, long i) { return cursor<Simd>(b, i); }

// Where the row block after this one starts: INT4 rows (1 KB at H = 2048) are too short for the hardware
// prefetchers to ramp up, so their codes are requested a share per step while this block computes.
inline kt::Upcoming next_rows(const kt::Rows<bf16>&, long, long, long) { return {}; }
inline kt::Upcoming next_rows(const kt::Rows<int4_group>& b, long row, long rows, long K) {
  return {reinterpret_cast<const char*>(cursor<Simd>(b, row).w), b.ld * 4, (K + 1) / 2, rows};
}

template <int MR, int NR, class TB>
void gemm_nt_dot(const GemmNT<TB>& g) {
  constexpr bool kInt4 = std::is_same_v<TB, int4_group>;
  const __m512i table = int4_table();
  alignas(64) bf16 abuf[MR][DP_KC];
  for (int k0 = 0; k0 < g.K; k0 += DP_KC) {
    const int klen = std::min(DP_KC, g.K - k0), kpad = (klen + 31) / 32 * 32;
    for (int m0 = 0; m0 < g.M; m0 += MR) {
      const int mr = std::min(MR, g.M - m0);
      for (int i = 0; i < MR; ++i) {
        const float* a = g.a.at(m0 + std::min(i, mr - 1)) + k0;
        int k = 0;
        for (; k + 32 <= klen; k += 32) {
          __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(a + k + 16), _mm512_loadu_ps(a + k));
          _mm512_store_si512(reinterpret_cast<__m512i*>(&abuf[i][k]), reinterpret_cast<__m512i&>(v));
        }
        for (; k < klen; ++k) abuf[i][k] = kt::f32_to_bf16(a[k]);
        for (; k < kpad; ++k) abuf[i][k] = 0;
      }
      for (int n0 = 0; n0 < g.N; n0 += NR) {
        const int nr = std::min(NR, g.N - n0);
        decltype(dot_row(g.b, 0)) b[NR];
        for (int j = 0; j < NR; ++j) b[j] = dot_row(g.b, n0 + std::min(j, nr - 1));
        const kt::Upcoming next = next_rows(g.b, n0 + NR, std::max(0, std::min(NR, g.N - n0 - NR)), g.K);
        __m512 acc[MR][NR];
        for (int i = 0; i < MR; ++i)
          for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
        for (int k = 0; k < kpad; k += 32) {
          request_share(next, k / 32, kpad / 32);
          __m512i bv[NR];
          for (int j = 0; j < NR; ++j) bv[j] = pairs32(b[j], k0 + k, std::min(32, klen - k), table);
          for (int i = 0; i < MR; ++i) {
            const __m512i av = _mm512_load_si512(reinterpret_cast<const __m512i*>(&abuf[i][k]));
            for (int j = 0; j < NR; ++j) {
              const __m512bh x = reinterpret_cast<const __m512bh&>(av), w = reinterpret_cast<const __m512bh&>(bv[j]);
              if constexpr (kInt4)  // a group is one step: its products, then its scale
                acc[i][j] = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), x, w),
                                            _mm512_set1_ps(b[j].scale(k0 + k)), acc[i][j]);
              else
                acc[i][j] = _mm512_dpbf16_ps(acc[i][j], x, w);
            }
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

// One activation row (decode) reads 8 weight rows at a time, as gemm_nt does.
void gemm_nt_bf16_dot(const GemmNT<bf16>& g) {
  if (g.M == 1) return gemm_nt_dot<1, 8>(g);
  gemm_nt_dot<4, 4>(g);
}

// Three or more rows reuse each decoded weight tile: there the float32 widening of gemm_nt does less work.
void gemm_nt_int4_dot(const GemmNT<int4_group>& g) {
  if (g.M == 1) return gemm_nt_dot<1, 8>(g);
  if (g.M == 2) return gemm_nt_dot<2, 4>(g);
  gemm_nt<int4_group>(g);
}

}  // namespace

namespace kt {
const KernelSet& kernels_avx512_bf16() {
  static const KernelSet set = [] {
    KernelSet s = make_kernel_set("avx512_bf16");
    s.gemm_nt_bf16_act = gemm_nt_bf16_dot;
    s.gemm_nt_int4_act = gemm_nt_int4_dot;
    return s;
  }();
  return set;
}
}  // namespace kt
