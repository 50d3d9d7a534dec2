// INT4 weights in the dot form on vdpbf16ps (experts off the tiles: decode, a few rows), for the sets with AVX-512 BF16
// (avx512_bf16, amx) and activations that came in as BF16 (KernelSet::gemm_nt_int4_act): the signed INT4 values are
// exact in BF16, so one table lookup per 32 codes (vpermw) gives BF16 weights that multiply the BF16 activations in
// pairs, where the float32 form (gemm_nt_int4_split) converts 16 codes per lookup and needs two FMAs for what one
// vdpbf16ps does. x is exact in BF16 already; h = silu(g)·u is rounded as the model's own BF16 dtype would
// (tests/tolerances.py: BF16_DOT). Included after kernel_body.h by the two sets' files, compiled with -mavx512bf16.
#pragma once
#include <cstring>

namespace {

// Two groups (64 codes, 32 bytes) per step. Byte b of a row holds codes 2b (low nibble) and 2b + 1 (high):
// widened to 16-bit lanes, a lookup of the low nibbles gives the even-indexed codes, one of the bytes shifted
// right by 4 the odd-indexed ones. The lookup reads an index lane's low 5 bits, so the table repeats the 16
// values twice and the high nibble's low bit left in lane bit 4 needs no mask.
inline __m512i int4_bf16_table() {
  alignas(64) uint16_t t[32];
  for (int i = 0; i < 32; ++i) {
    const float v = float((i & 15) - 8);
    uint32_t bits;
    std::memcpy(&bits, &v, 4);
    t[i] = uint16_t(bits >> 16);  // small integers are exact in BF16: the top half of their float32
  }
  return _mm512_load_si512(t);
}

// Activation row x (K values, K a multiple of 32) as BF16 in the steps' order: per 64 columns, the 32
// even-indexed values, then the 32 odd-indexed ones (a last step of 32 columns padded with zeros).
inline void int4_dot_activations(const float* x, long K, bf16* dst) {
  const __m512i even = _mm512_set_epi16(62, 60, 58, 56, 54, 52, 50, 48, 46, 44, 42, 40, 38, 36, 34, 32, 30, 28, 26,
                                        24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odd = _mm512_add_epi16(even, _mm512_set1_epi16(1));
  long k = 0;
  for (; k + 64 <= K; k += 64) {
    const __m512bh lo = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + k + 16), _mm512_loadu_ps(x + k));
    const __m512bh hi = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + k + 48), _mm512_loadu_ps(x + k + 32));
    const __m512i l = reinterpret_cast<const __m512i&>(lo), h = reinterpret_cast<const __m512i&>(hi);
    _mm512_storeu_si512(dst + k, _mm512_permutex2var_epi16(l, even, h));
    _mm512_storeu_si512(dst + k + 32, _mm512_permutex2var_epi16(l, odd, h));
  }
  if (k < K) {
    for (int t = 0; t < 16; ++t) {
      dst[k + t] = kt::f32_to_bf16(x[k + 2 * t]);
      dst[k + 32 + t] = kt::f32_to_bf16(x[k + 2 * t + 1]);
    }
    std::fill(dst + k + 16, dst + k + 32, bf16(0));
    std::fill(dst + k + 48, dst + k + 64, bf16(0));
  }
}

// MR activation rows × NR weight rows per block; float32 lane i of a step's product sums codes 4i .. 4i + 3 of
// the 64, so lanes 0-7 belong to the first group and 8-15 to the second, and one multiply by the two groups'
// scales (each spread over its 8 lanes) finishes the step.
template <int MR, int NR>
void int4_bf16_dot(const GemmNT<int4_group>& g) {
  using Cursor = Int4Cursor<Simd>;
  const long steps = (g.K + 63) / 64;
  const bool half_last = g.K % 64 != 0;
  thread_local kt::aligned_vector<bf16> xs;
  xs.resize(size_t(g.M) * steps * 64);
  for (int i = 0; i < g.M; ++i) int4_dot_activations(g.a.at(i), g.K, xs.data() + long(i) * steps * 64);
  const __m512i table = int4_bf16_table();
  for (int n0 = 0; n0 < g.N; n0 += NR) {
    const int nr = std::min(NR, g.N - n0);
    Cursor cur[NR], next[NR];
    const int nn = std::min(NR, g.N - n0 - NR);
    for (int j = 0; j < NR; ++j) cur[j] = cursor<Simd>(g.b, n0 + std::min(j, nr - 1));
    for (int j = 0; j < nn; ++j) next[j] = cursor<Simd>(g.b, n0 + NR + j);
    NextBlockRequests<Cursor> requests(next, nn, g.K, steps);
    for (int m0 = 0; m0 < g.M; m0 += MR) {
      const int mr = std::min(MR, g.M - m0);
      const bf16* a[MR];
      for (int i = 0; i < MR; ++i) a[i] = xs.data() + (m0 + std::min(i, mr - 1)) * steps * 64;
      __m512 acc[MR][NR];
      for (int i = 0; i < MR; ++i)
        for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
      for (long s = 0; s < steps; ++s) {
        requests.segment();
        const bool half = half_last && s == steps - 1;  // one group: 16 bytes, one scale
        __m512bh xe[MR], xo[MR];
        for (int i = 0; i < MR; ++i) {
          const __m512i e = _mm512_load_si512(a[i] + s * 64), o = _mm512_load_si512(a[i] + s * 64 + 32);
          xe[i] = reinterpret_cast<const __m512bh&>(e);
          xo[i] = reinterpret_cast<const __m512bh&>(o);
        }
        for (int j = 0; j < NR; ++j) {
          const char* p = cur[j].codes() + s * 32;
          const __m256i bytes =
              half ? _mm256_maskz_loadu_epi8(0xFFFF, p) : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
          const __m512i w = _mm512_cvtepu8_epi16(bytes);
          const __m512i lo = _mm512_permutexvar_epi16(w, table);
          const __m512i hi = _mm512_permutexvar_epi16(_mm512_srli_epi16(w, 4), table);
          uint32_t two = 0;
          std::memcpy(&two, cur[j].sc + 2 * s, half ? 2 : 4);
          const __m512i d = _mm512_set1_epi32(int(two));
          const __m512 sv = _mm512_castsi512_ps(  // lanes 0-7: the low BF16 shifted up; 8-15: the high one kept
              _mm512_mask_slli_epi32(_mm512_and_si512(d, _mm512_set1_epi32(int(0xFFFF0000u))), 0x00FF, d, 16));
          for (int i = 0; i < MR; ++i) {
            __m512 seg = _mm512_dpbf16_ps(_mm512_setzero_ps(), reinterpret_cast<const __m512bh&>(lo), xe[i]);
            seg = _mm512_dpbf16_ps(seg, reinterpret_cast<const __m512bh&>(hi), xo[i]);
            acc[i][j] = _mm512_fmadd_ps(seg, sv, acc[i][j]);
          }
        }
      }
      for (int i = 0; i < mr; ++i)
        for (int j = 0; j < nr; ++j)
          store_out(g.c + long(m0 + i) * g.ldc + n0 + j, g.alpha, _mm512_reduce_add_ps(acc[i][j]), g.accumulate);
    }
  }
}

// Whole groups (K a multiple of 32); any number of activation rows, two at a time: on the dev machine (Zen 4, 2
// threads) this was faster than widening tiles of weights to float32 for reuse (gemm_nt) at every size tried, up to
// 64 rows per expert (Layer Q INT4 inference forwards with tiles off, T = 64 .. 1024: 41-437 ms against 67-485),
// and four rows at a time no faster.
// At most kDotRows activation rows per pass over the weights, so the thread's reordered copy of them stays small
// (64 rows of DeepSeek-V3's H = 7168: 0.9 MB) however many rows an expert off the tiles has.
constexpr int kDotRows = 64;
void gemm_nt_int4_act(const GemmNT<int4_group>& g) {
  if (g.K % int4_group::GROUP) return gemm_nt<int4_group>(g);
  if (g.M == 1) return int4_bf16_dot<1, 8>(g);
  for (int m0 = 0; m0 < g.M; m0 += kDotRows) {
    GemmNT<int4_group> part = g;
    part.M = std::min(kDotRows, g.M - m0);
    if (g.a.ptrs)
      part.a.ptrs = g.a.ptrs + m0;
    else
      part.a.base = g.a.base + m0 * g.a.ld;
    part.c = g.c + m0 * g.ldc;
    int4_bf16_dot<2, 4>(part);
  }
}

}  // namespace
