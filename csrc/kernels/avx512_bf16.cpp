// Kernel set for AVX-512 with the BF16 dot product (vdpbf16ps): the AVX-512 kernels, plus for BF16 activations (a BF16
// model's) the tile products of tile_body.h with the tile unit's operations run on vdpbf16ps (Bf16Tiles below),
// forward, backward and LoRA as the amx set runs them, for experts with too few rows for a tile a dot-form product that
// rounds the activations to BF16 once per row block and multiplies BF16 pairs straight from the weight rows, and for
// FP8 and INT4 weights off the tiles the dot form of quantized_bf16_dot.h. x is exact in BF16 already; h = silu(g)·u is
// rounded as the model's own dtype would (tests/tolerances.py: BF16_DOT).
#include <cstring>

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

// The tile unit's operations (tile_body.h's `Tiles` policy) on vdpbf16ps, for CPUs with AVX-512 BF16 and no
// AMX: the four 16×16 float32 accumulators live in memory (4 KB, in L1), load_* only note where an operand
// is, and a tile product runs row by row: each A row's 16 BF16 pairs broadcast against B's 16 pair-rows held
// in registers, 16 products per instruction as the tile unit forms them (pairs summed in float32).
struct Bf16Tiles {
  struct State {
    alignas(64) float acc[4][TR * TR];
    const char* a[2];
    const char* b[2];
    long a_stride[2], b_stride[2];
  };
  static State& state() {
    thread_local State s;
    return s;
  }
  static void begin() {}
  static void zero_acc() { std::memset(state().acc, 0, sizeof(state().acc)); }
  static void load_a0(const void* p, long stride) { load(state().a[0], state().a_stride[0], p, stride); }
  static void load_a1(const void* p, long stride) { load(state().a[1], state().a_stride[1], p, stride); }
  static void load_b0(const void* p, long stride) { load(state().b[0], state().b_stride[0], p, stride); }
  static void load_b1(const void* p, long stride) { load(state().b[1], state().b_stride[1], p, stride); }
  static void dp00() { dp(0, 0, 0); }
  static void dp01() { dp(1, 0, 1); }
  static void dp10() { dp(2, 1, 0); }
  static void dp11() { dp(3, 1, 1); }
  static void store_acc(int q, void* p, long stride) {
    for (int r = 0; r < TR; ++r)
      _mm512_storeu_ps(static_cast<char*>(p) + r * stride, _mm512_load_ps(state().acc[q] + r * TR));
  }

 private:
  static void load(const char*& at, long& at_stride, const void* p, long stride) {
    at = static_cast<const char*>(p);
    at_stride = stride;
  }
  // acc[q] += A_i · B_j: row r of the result gathers A's row r pair by pair against B's pair-rows, RB rows at
  // a time so that RB independent sums hide the instruction's latency.
  static constexpr int RB = 8;
  static void dp(int q, int i, int j) {
    State& s = state();
    __m512bh b[TR];
    for (int p = 0; p < TR; ++p) b[p] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(s.b[j] + p * s.b_stride[j]));
    for (int r0 = 0; r0 < TR; r0 += RB) {
      __m512 v[RB];
      for (int r = 0; r < RB; ++r) v[r] = _mm512_load_ps(s.acc[q] + (r0 + r) * TR);
      for (int p = 0; p < TR; ++p)
        for (int r = 0; r < RB; ++r) {
          int pair;
          std::memcpy(&pair, s.a[i] + (r0 + r) * s.a_stride[i] + 4 * p, 4);
          v[r] = _mm512_dpbf16_ps(v[r], reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair)), b[p]);
        }
      for (int r = 0; r < RB; ++r) _mm512_store_ps(s.acc[q] + (r0 + r) * TR, v[r]);
    }
  }
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
