// Kernel set for AVX-512 with the BF16 dot product (vdpbf16ps): the AVX-512 kernels, plus for BF16 activations (a BF16
// model's) the tile products of tile_body.h with the tile unit's operations run on vdpbf16ps (Bf16Tiles below),
// forward, backward and LoRA as the amx set runs them, for experts with too few rows for a tile a dot-form product that
// rounds the activations to BF16 once per row block and multiplies BF16 pairs straight from the weight rows, and for
// FP8 and INT4 weights off the tiles the dot form of quantized_bf16_dot.h. x is exact in BF16 already; h = silu(g)·u is
// rounded as the model's own dtype would (tests/tolerances.py: BF16_DOT).
#include <cstring>
#include <vector>

#include "simd_avx512.h"
#include "kernel_body.h"
#include "tile_body.h"
#include "quantized_bf16_dot.h"

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
        // Over the whole block (no run-time loop bound), so that acc needs no copy in memory: GCC stored every
        // accumulator at every step otherwise.
#pragma GCC unroll 4
        for (int i = 0; i < DP_MR; ++i)
#pragma GCC unroll 4
          for (int j = 0; j < DP_NR; ++j)
            if (i < mr && j < nr)
              store_chunk(g.c + long(m0 + i) * g.ldc + n0 + j, g.alpha, _mm512_reduce_add_ps(acc[i][j]),
                          g.accumulate, k0 == 0);
      }
    }
  }
}

// The tile unit's result blocks (tile_body.h's `Tiles::block`) on vdpbf16ps, for CPUs with AVX-512 BF16 and no
// AMX: the result's rows are taken 8 at a time, each row's sums for the block's one to three block columns held in
// registers over the whole reduction; each A row's BF16 pairs are broadcast against B's pair-rows, 16 products
// per instruction as the tile unit forms them (pairs summed in float32). 8 to 24 sums in flight hide the
// instruction's latency, and A, B and the sums are each read or written once per reduction block instead of the
// sums going through memory at every step. A rows 4 KB apart (weights read in place at H = 2048, decoded panels of
// K = 2048) lie in one L1 set, whose 8 ways (Zen 4) hold a pass's 8 lines; passes of 16 rows had to broadcast them
// from a staged copy (~10% slower without), and were 20-23% slower with it than two passes of 8 at a lone block
// column (`tile_bench nt 1536 2048 8,12,16`), as the copy made pairs 5-9% slower (BENCHMARKS.md).
// Padding would cost as much as real rows and columns, and an expert's rows rarely fill its last tile (Layer Q at
// T = 512: 32 rows per expert on average), so:
// - A last odd block column joins the pair before it (kColumnBlocks = 3): alone, each of its products needed a
//   broadcast of its own, and ran at ~60% of a pair's rate per product (Zen 4, `tile_bench`; BENCHMARKS.md,
//   "The emulated tiles' last block column").
// - A last block column with at most 8 valid lanes (in column order) runs on 256-bit registers: Zen 4 splits a
//   512-bit vdpbf16ps in two and issues the 256-bit one twice as often, so those lanes cost half there.
// - Groups of 8 rows past the block's valid A rows are not computed, and a last group of at most 4 valid rows
//   takes a pass of 4, 2 or 1 rows: one thread, `tile_bench nn 2048 1536 M` (the backward's form, its weights
//   packed as it goes) 15-30% faster at M = 1-4, 12 and 17; the forward's `nt`, bound by its weight reads at
//   so few rows, the same (BENCHMARKS.md, eighth session of 2026-12-05).
struct Bf16Tiles {
  static constexpr int kColumnBlocks = 3;
  // 1-3 rows without the panel (tile_body.h, direct_nn), except where the backward copy packed it: that form ran
  // them faster (tile_bench nnp), and both sum the same BF16 pairs in the same order.
  static constexpr bool kDirectWhenPacked = false;
  static void begin() {}
  template <class Before, class ATile, class AStride, class BTile>
  static void block(bool i2, int nj, int a_rows, int last_lanes, int KC, Before before, ATile a_tile,
                    AStride a_stride, BTile b_tile, long b_stride, float (*t)[TR * TR]) {
    thread_local std::vector<Step> steps;
    steps.resize(KC);
    for (int kc = 0; kc < KC; ++kc)
      for (int dj = 0; dj < nj; ++dj) steps[kc].b[dj] = reinterpret_cast<const char*>(b_tile(dj, kc));
    const int rows = i2 ? 2 * TR : TR;
    for (int r0 = 0; r0 < std::min(rows, a_rows); r0 += RB) {
      // The pass's rows: 8, or the fewest of 4, 2 and 1 that covers the valid rows left.
      const int left = a_rows - r0, rb = left > 4 ? RB : left > 2 ? 4 : left;
      const SumSteps pass = kSumSteps[nj - 1][last_lanes <= 8][rb == RB ? 0 : rb == 4 ? 1 : rb == 2 ? 2 : 3];
      const int di = r0 / TR;
      for (int kc = 0; kc < KC; ++kc) {
        steps[kc].as = a_stride(kc);
        steps[kc].a = reinterpret_cast<const char*>(a_tile(di, kc)) + (r0 % TR) * steps[kc].as;
      }
      alignas(64) float sums[RB * 3][TR] = {};
      if (r0 == 0)  // before(kc) first packs or requests what step kc reads
        for (int kc = 0; kc < KC; ++kc) {
          before(kc);
          pass(steps.data() + kc, 1, b_stride, sums[0]);
        }
      else
        pass(steps.data(), KC, b_stride, sums[0]);
      for (int r = 0; r < rb; ++r)
        for (int dj = 0; dj < nj; ++dj)
          std::memcpy(t[result_tile(di, dj)] + (r0 % TR + r) * TR, sums[r * nj + dj], TR * sizeof(float));
    }
    for (int r = a_rows; r < rows; ++r)  // rows left out: zeros, which `put` does not store
      for (int dj = 0; dj < nj; ++dj) std::memset(t[result_tile(r / TR, dj)] + (r % TR) * TR, 0, TR * sizeof(float));
  }

 private:
  static constexpr int RB = 8;  // A rows per pass (fewer in a last group of at most 4 valid rows)
  // One reduction block: A's rows from a, `as` bytes apart; the block columns' B operands. A line each: at 40
  // bytes apart the backward's products ran ~4% slower on Zen 4 (`tile_bench nn 2048 768 16`: 420 against 404-408
  // us).
  struct alignas(64) Step {
    const char* a;
    long as;
    const char* b[3];
  };
  // sums[r · NJ + dj] += Σ over n steps of A row r · B column block dj, for the pass's R rows; with HALF, the
  // last block column's first 8 lanes only (256-bit registers; its other 8 sums stay as they were). A leaf of its
  // own, so that the sums' registers do not depend on what the caller inlines around it (inlined in the block
  // loop, they went to the stack in some callers and ran the products 2-3x slower).
  template <int NJ, bool HALF, int R>
  [[gnu::noinline]] static void sum_steps(const Step* st, int n, long b_stride, float* sums) {
    constexpr int NF = HALF ? NJ - 1 : NJ;  // NF block columns in 512-bit registers
    __m512 v[R][NF > 0 ? NF : 1];
    __m256 h[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 3
      for (int dj = 0; dj < NF; ++dj) v[r][dj] = _mm512_load_ps(sums + (r * NJ + dj) * TR);
      if constexpr (HALF) h[r] = _mm256_load_ps(sums + (r * NJ + NJ - 1) * TR);
    }
    for (int k = 0; k < n; ++k) {
      const char* a = st[k].a;
      const long as = st[k].as;
      for (int p = 0; p < TR; ++p) {
        __m512bh bp[NF > 0 ? NF : 1];
#pragma GCC unroll 3
        for (int dj = 0; dj < NF; ++dj)
          bp[dj] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(st[k].b[dj] + p * b_stride));
        __m256bh bh;
        if constexpr (HALF) {
          const char* last = st[k].b[NJ - 1] + p * b_stride;
          bh = reinterpret_cast<__m256bh>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(last)));
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          int pair;
          std::memcpy(&pair, a + r * as + 4 * p, 4);
          const __m512i ap = _mm512_set1_epi32(pair);
#pragma GCC unroll 3
          for (int dj = 0; dj < NF; ++dj) v[r][dj] = _mm512_dpbf16_ps(v[r][dj], reinterpret_cast<__m512bh>(ap), bp[dj]);
          if constexpr (HALF)
            h[r] = _mm256_dpbf16_ps(h[r], reinterpret_cast<__m256bh>(_mm512_castsi512_si256(ap)), bh);
        }
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 3
      for (int dj = 0; dj < NF; ++dj) _mm512_store_ps(sums + (r * NJ + dj) * TR, v[r][dj]);
      if constexpr (HALF) _mm256_store_ps(sums + (r * NJ + NJ - 1) * TR, h[r]);
    }
  }
  using SumSteps = void (*)(const Step*, int, long, float*);
  template <int NJ, bool HALF>
  static constexpr SumSteps kRowCounts[4] = {sum_steps<NJ, HALF, RB>, sum_steps<NJ, HALF, 4>, sum_steps<NJ, HALF, 2>,
                                             sum_steps<NJ, HALF, 1>};
  // [NJ - 1][HALF][rows: 8, 4, 2, 1]
  static constexpr const SumSteps* kSumSteps[3][2] = {{kRowCounts<1, false>, kRowCounts<1, true>},
                                                      {kRowCounts<2, false>, kRowCounts<2, true>},
                                                      {kRowCounts<3, false>, kRowCounts<3, true>}};
};

}  // namespace

namespace kt {
const KernelSet& kernels_avx512_bf16() {
  static const KernelSet set = [] {
    KernelSet s = make_kernel_set("avx512_bf16");
    // One to three rows (decode) would leave the dot form's 4-row blocks mostly repeating a row: the
    // AVX-512 product reads the weights once per row instead (Layer Q BF16 decode 4.1 -> 3.2-3.4 ms on Zen 4).
    s.gemm_nt_bf16_act = [](const GemmNT<bf16>& g) { (g.M >= DP_MR ? gemm_nt_bf16_dot : gemm_nt<bf16>)(g); };
    use_quantized_bf16_dot(s, false);
    s.tiles = &tile_kernels<Bf16Tiles>(true);
    return s;
  }();
  return set;
}
}  // namespace kt
