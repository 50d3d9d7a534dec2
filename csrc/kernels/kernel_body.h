// The generic kernel bodies, written once on a `Simd` traits struct (simd_*.h) and compiled once per
// ISA by reference.cpp / avx2.cpp / avx512.cpp / avx512_bf16.cpp, each inside its own namespace.
// Include only after a simd_*.h header; everything here has internal linkage, so code built with
// wider instructions never leaks into another ISA's object file.
//
// Determinism: every output element is reduced by one fixed chain (lanes over k, then one
// horizontal sum, then the k tail), whatever the tile it falls in, so results do not depend on
// how the engine splits work across threads.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "kernels.h"

namespace {

using kt::bf16;
using kt::fp8_block;
using kt::GemmNN;
using kt::GemmNT;
using kt::int4_group;
using V = Simd::V;
constexpr int W = Simd::W;

// The kernels' own buffers: aligned.h's vectors with an allocator type of this file's, so their methods, compiled
// with this file's ISA flags, have internal linkage too (with kt::aligned_vector the linker could pick this file's
// copy for a baseline file's calls).
template <class T>
struct IsaAligned : kt::LineAligned<T> {
  IsaAligned() = default;
  template <class U>
  IsaAligned(const IsaAligned<U>&) {}
};
template <class T>
using isa_vector = std::vector<T, IsaAligned<T>>;

// Register tiles. Dot form: MR×NR accumulators plus NR B vectors (A comes from memory operands):
// 16 of 32 zmm on AVX-512, 12 + 4 = 16 ymm on AVX2. Axpy form: MR×NV accumulators + NV B vectors
// + 1 broadcast: 24 + 4 + 1 zmm, 12 + 2 + 1 ymm. NV·W divides the engine's 64-column blocks.
constexpr int NT_MR = W == 8 ? 3 : 4;
constexpr int NT_NR = 4;
constexpr int NN_MR = W == 1 ? 4 : 6;
constexpr int NN_NV = W == 16 ? 4 : (W == 8 ? 2 : 4);

inline void store_out(float* c, float alpha, float v, bool accumulate) {
  *c = accumulate ? *c + alpha * v : alpha * v;
}

// Stores one reduced chunk: the first chunk of K writes (or accumulates into) C, later chunks add.
inline void store_chunk(float* c, float alpha, float v, bool accumulate, bool first) {
  store_out(c, alpha, v, accumulate || !first);
}

// BF16 weight tiles are widened to float32 once per tile and reused by every row block of A, so the
// inner loops are pure load+FMA (the widening costs 2 shuffle/shift uops per vector, which on the
// FMA ports cut throughput by a third). K goes in chunks so a widened tile stays in L1 (32 KB).
constexpr int NT_KC = 2048;
constexpr int NN_PANEL = 8192;  // floats of one widened axpy-form panel (KC rows × NV·W columns)

// dst[0, n) = src as float32: BF16 widened W lanes at a time (a plain copy for float32 sources).
template <class TS>
inline void to_f32_row(const TS* src, long n, float* dst) {
  long i = 0;
  for (; i + W <= n; i += W) Simd::store(dst + i, Simd::load(src + i));
  for (; i < n; ++i) dst[i] = kt::to_f32(src[i]);
}

// Quantized weights have no float rows to read in place: every product decodes them into float32 tiles.
template <class TB>
constexpr bool kQuantized = std::is_same_v<TB, fp8_block> || std::is_same_v<TB, int4_group>;
// Weight types a product widens into float32 tiles (float32 weights are read in place).
template <class TB>
constexpr bool kWidens = !std::is_same_v<TB, float>;

// dst[0, len) = row i of B, columns [col0, col0 + len), as float32.
template <class TB>
inline void widen_row(const kt::Rows<TB>& b, long i, long col0, long len, float* dst) {
  to_f32_row(b.at(i) + col0, len, dst);
}

// A cursor reads one quantized weight row segment by segment (an FP8 block or an INT4 group shares one
// scale): raw(k) is W values at column k without their scale (k a multiple of 8), scale(k) the factor that
// makes them exact weights, one(k) the exact weight at column k. S is Simd, a template parameter so that
// raw(), which the scalar set has no vector decode for, is compiled only where it is used. Columns are never
// negative: divided as unsigned_col(k) they take a shift, where a signed division took four instructions more.
inline unsigned long unsigned_col(long k) { return static_cast<unsigned long>(k); }

template <class S>
struct Fp8Cursor {
  static constexpr int SEG = fp8_block::BLOCK;
  const uint8_t* q;  // the row's codes
  const float* sc;   // the row's block scales
  typename S::V raw(long k) const { return S::fp8_scaled(q + k); }
  // raw(k) and raw(k + W) at once where the set decodes pairs faster (Simd::fp8_pairs).
  static constexpr bool kPairs = S::fp8_pairs;
  void raw2(long k, typename S::V& lo, typename S::V& hi) const { S::fp8_scaled2(q + k, lo, hi); }
  float scale(long k) const { return sc[unsigned_col(k) / SEG] * 256.f; }  // raw() is codes · 2^-8
  const char* codes() const { return reinterpret_cast<const char*>(q); }
  static long code_bytes(long K) { return K; }
  float one(long k) const { return kt::fp8_e4m3_to_f32(q[k]) * sc[unsigned_col(k) / SEG]; }
};

template <class S>
struct Int4Cursor {
  static constexpr int SEG = int4_group::GROUP;
  const uint32_t* w;  // the row's words
  const bf16* sc;     // the row's group scales
  typename S::V raw(long k) const { return S::int4_values(w + unsigned_col(k) / 8); }
  static constexpr bool kPairs = false;
  bf16 scale_bits(long k) const { return sc[unsigned_col(k) / SEG]; }  // the group's scale as stored
  float scale(long k) const { return kt::bf16_to_f32(scale_bits(k)); }
  // Columns k, k + 2, … into `even` and k + 1, k + 3, … into `odd`, W each (k even), without their scale and
  // short of S::int4_split_bias: each is nibble − 8 + int4_split_bias.
  void values_split(long k, typename S::V& even, typename S::V& odd) const {
    S::int4_split_values(reinterpret_cast<const uint8_t*>(w) + unsigned_col(k) / 2, even, odd);
  }
  const char* codes() const { return reinterpret_cast<const char*>(w); }
  static long code_bytes(long K) { return (K + 1) / 2; }
  float one(long k) const { return float(kt::int4_nibble(w, k) - 8) * scale(k); }
};

template <class S>
Fp8Cursor<S> cursor(const kt::Rows<fp8_block>& b, long i) {
  const long row = b.row0 + i;
  return {b.q + row * b.ld, b.scale + (row >> b.row_shift) * b.scale_ld};
}

template <class S>
Int4Cursor<S> cursor(const kt::Rows<int4_group>& b, long i) {
  const long row = b.row0 + i;
  return {b.words + row * b.ld, b.scale + row * b.scale_ld};
}

// Quantized rows decoded segment by segment. FP8: codes × 2^-8 (Simd::fp8_scaled) times the block's scale
// × 2^8, powers of two apart from the one rounding of code × scale that torch's float32 dequantization makes
// too; INT4: (nibble − 8) · scale, exact. So the decoded weights equal the reference's bit for bit.
template <class Cursor>
inline void widen_quantized(const Cursor& cur, long col0, long len, float* dst) {
  for (long c = col0, end = col0 + len; c < end;) {
    const long send = std::min(end, (c / Cursor::SEG + 1) * Cursor::SEG);
    if constexpr (W >= 8) {
      if (c % 8 == 0) {  // vector reads start on whole INT4 words
        const V sv = Simd::set1(cur.scale(c));
        if constexpr (Cursor::kPairs)
          for (; c + 2 * W <= send; c += 2 * W) {
            V lo, hi;
            cur.raw2(c, lo, hi);
            Simd::store(dst + (c - col0), Simd::mul(lo, sv));
            Simd::store(dst + (c + W - col0), Simd::mul(hi, sv));
          }
        for (; c + W <= send; c += W) Simd::store(dst + (c - col0), Simd::mul(cur.raw(c), sv));
      }
    }
    for (; c < send; ++c) dst[c - col0] = cur.one(c);
  }
}

inline void widen_row(const kt::Rows<fp8_block>& b, long i, long col0, long len, float* dst) {
  widen_quantized(cursor<Simd>(b, i), col0, len, dst);
}

inline void widen_row(const kt::Rows<int4_group>& b, long i, long col0, long len, float* dst) {
  widen_quantized(cursor<Simd>(b, i), col0, len, dst);
}

// The lines of [begin, end) requested into L1 (Locality 3) or L2 (2), a share at each call of step(), so that
// `steps` calls request them all: the next block of weight rows, spread over this block's reduction.
template <int Locality>
struct LineRun {
  const char* run = nullptr;  // the next line to request
  const char* end = nullptr;
  long per = 0;
  LineRun() = default;
  LineRun(const char* begin, const char* stop, long steps)
      : run(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(begin) & ~uintptr_t(63))), end(stop),
        per(steps ? ((end - run + 63) / 64 + steps - 1) / steps : 0) {}
  void step() {
    for (long l = 0; l < per && run < end; ++l, run += 64) __builtin_prefetch(run, 0, Locality);
  }
};

// Dot-form tile: rows a[i], b[j] hold k in [0, klen) of this chunk; `next` is requested as it runs.
template <int MR, int NR, class TBp>
void nt_tile(const float* const* a, const TBp* const* b, int klen, int mr, int nr, float* c, long ldc, float alpha,
             bool accumulate, bool first, LineRun<2> next = {}) {
  V acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = Simd::zero();
  const int kv = klen - klen % W;
  for (int k = 0; k < kv; k += W) {
    next.step();
    V bv[NR];
    for (int j = 0; j < NR; ++j) bv[j] = Simd::load(b[j] + k);
    for (int i = 0; i < MR; ++i) {
      V av = Simd::load(a[i] + k);
      for (int j = 0; j < NR; ++j) acc[i][j] = Simd::fma(av, bv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < mr; ++i) {
    for (int j = 0; j < nr; ++j) {
      float s = Simd::hsum(acc[i][j]);
      for (int k = kv; k < klen; ++k) s = std::fma(a[i][k], kt::to_f32(b[j][k]), s);
      store_chunk(c + long(i) * ldc + j, alpha, s, accumulate, first);
    }
  }
}

// Row blocks of MR activation rows against NR weight rows at a time, K in chunks of NT_KC. With `widen`
// the NR weight rows of a chunk are decoded to float32 once and reused by every row block.
template <int MR, int NR, class TB>
void gemm_nt_tiles(const GemmNT<TB>& g, bool widen) {
  alignas(64) float wide[kWidens<TB> ? NR * NT_KC : 1];
  for (int k0 = 0; k0 < g.K; k0 += NT_KC) {
    const int klen = std::min(NT_KC, g.K - k0);
    for (int n0 = 0; n0 < g.N; n0 += NR) {
      const int nr = std::min(NR, g.N - n0);
      // Rows past the edge repeat the last real row; their results are computed and dropped.
      const float* bw[NR];
      const TB* b[NR];
      for (int j = 0; j < NR; ++j) {
        const long row = n0 + std::min(j, nr - 1);
        if (widen) {
          bw[j] = wide + j * NT_KC;
          widen_row(g.b, row, k0, klen, wide + j * NT_KC);
        } else if constexpr (!kQuantized<TB>) {
          b[j] = g.b.at(row) + k0;
        }
      }
      for (int m0 = 0; m0 < g.M; m0 += MR) {
        const int mr = std::min(MR, g.M - m0);
        const float* a[MR];
        for (int i = 0; i < MR; ++i) a[i] = g.a.at(m0 + std::min(i, mr - 1)) + k0;
        float* c = g.c + long(m0) * g.ldc + n0;
        if (widen) {
          nt_tile<MR, NR>(a, bw, klen, mr, nr, c, g.ldc, g.alpha, g.accumulate, k0 == 0);
        } else if constexpr (!kQuantized<TB>) {
          // Rows read in place and lying one after another (a whole reduction per chunk): the next block's are one
          // run, requested while the first row block computes. An expert's rows at decode are too short (1.5 KB at
          // I = 768) for the hardware prefetchers to ramp up before each is read: Layer Q BF16 decode's down phase
          // took 1.13-1.17 ms against 0.73-0.81 requested (Zen 4, 2 threads; BENCHMARKS.md). Into L1 it ran slower
          // than with no requests.
          LineRun<2> next;
          const int nn = std::min(NR, g.N - n0 - NR);
          if (m0 == 0 && nn > 0 && !g.b.ptrs && klen == g.K && g.b.ld == g.K)
            next = LineRun<2>(reinterpret_cast<const char*>(g.b.at(n0 + NR)),
                              reinterpret_cast<const char*>(g.b.at(n0 + NR + nn)), klen / W);
          nt_tile<MR, NR>(a, b, klen, mr, nr, c, g.ldc, g.alpha, g.accumulate, k0 == 0, next);
        }
      }
    }
  }
}

// The codes of the next block of weight rows, requested while this block computes, a share per segment: quantized
// rows (1-2 KB at H = 2048) are too short for the hardware prefetchers to ramp up, and decode otherwise waited on
// the first lines of every row (the instructions after the code loads took most of its samples on the dev machine).
// Rows that lie one after another (an expert's rows: always, in the engine) are one run of lines, walked by one
// pointer: the per-row bookkeeping had taken about a dozen instructions per line, two lines a step in decode.
// Into L1 (Locality 3) unless the caller says L2 (2).
template <class Cursor, int Locality = 3>
struct NextBlockRequests {
  const Cursor* next;  // the next block's rows
  int rows;
  long row_lines, per_segment;
  int row = 0;    // the next line to request: row of the next block,
  long line = 0;  // and line within it
  LineRun<Locality> run;  // the rows as one run, when they are
  NextBlockRequests(const Cursor* next_rows, int nn, long K, long segments)
      : next(next_rows), rows(std::max(nn, 0)), row_lines((Cursor::code_bytes(K) + 63) / 64),
        per_segment(segments ? (rows * row_lines + segments - 1) / segments : 0) {
    if (!rows) return;
    const long bytes = Cursor::code_bytes(K);
    for (int j = 1; j < rows; ++j)
      if (next[j].codes() != next[0].codes() + j * bytes) return;
    run = LineRun<Locality>(next[0].codes(), next[0].codes() + rows * bytes, segments);
  }
  void segment() {
    if (run.run) {
      run.step();
      return;
    }
    for (long l = 0; l < per_segment && row < rows; ++l) {
      __builtin_prefetch(next[row].codes() + line * 64, 0, Locality);
      if (++line == row_lines) line = 0, ++row;
    }
  }
};

// Quantized weights decoded in registers and used at once, for one or two activation rows (decode), where a
// decoded tile would be used only once: products with a segment's raw values are summed, then scaled once,
// which saves a multiply per vector.
template <int MR, int NR, class S, class TB>
void gemm_nt_fused(const GemmNT<TB>& g) {
  using Cursor = decltype(cursor<S>(g.b, 0));
  using VS = typename S::V;
  const long kv = g.K - g.K % S::W;
  for (int n0 = 0; n0 < g.N; n0 += NR) {
    const int nr = std::min(NR, g.N - n0);
    Cursor cur[NR], next[NR];
    const int nn = std::min(NR, g.N - n0 - NR);  // rows of the next block
    for (int j = 0; j < NR; ++j) cur[j] = cursor<S>(g.b, n0 + std::min(j, nr - 1));
    for (int j = 0; j < nn; ++j) next[j] = cursor<S>(g.b, n0 + NR + j);
    // FP8 codes into L2 with AVX-512: its decode 10-20% faster on Zen 4 (2 threads), where into L1 was faster with AVX2
    // (BENCHMARKS.md); INT4 into L1.
    constexpr int locality = std::is_same_v<TB, fp8_block> && S::W == 16 ? 2 : 3;
    NextBlockRequests<Cursor, locality> requests(next, nn, g.K, (kv + Cursor::SEG - 1) / Cursor::SEG);
    for (int m0 = 0; m0 < g.M; m0 += MR) {
      const int mr = std::min(MR, g.M - m0);
      const float* a[MR];
      for (int i = 0; i < MR; ++i) a[i] = g.a.at(m0 + std::min(i, mr - 1));
      VS acc[MR][NR];
      for (int i = 0; i < MR; ++i)
        for (int j = 0; j < NR; ++j) acc[i][j] = S::zero();
      for (long k0 = 0; k0 < kv; k0 += Cursor::SEG) {
        const long k1 = std::min<long>(k0 + Cursor::SEG, kv);
        requests.segment();
        VS seg[MR][NR];
        for (int i = 0; i < MR; ++i)
          for (int j = 0; j < NR; ++j) seg[i][j] = S::zero();
        long k = k0;
        // Pairs of vectors where the set decodes them together: each lane's chain still takes k, then k + W.
        if constexpr (Cursor::kPairs)
          for (; k + 2 * S::W <= k1; k += 2 * S::W) {
            VS av[MR], av2[MR];
            for (int i = 0; i < MR; ++i) av[i] = S::load(a[i] + k), av2[i] = S::load(a[i] + k + S::W);
            for (int j = 0; j < NR; ++j) {
              VS w, w2;
              cur[j].raw2(k, w, w2);
              for (int i = 0; i < MR; ++i) seg[i][j] = S::fma(av2[i], w2, S::fma(av[i], w, seg[i][j]));
            }
          }
        for (; k < k1; k += S::W) {
          VS av[MR];
          for (int i = 0; i < MR; ++i) av[i] = S::load(a[i] + k);
          for (int j = 0; j < NR; ++j) {
            const VS w = cur[j].raw(k);
            for (int i = 0; i < MR; ++i) seg[i][j] = S::fma(av[i], w, seg[i][j]);
          }
        }
        for (int j = 0; j < NR; ++j) {
          const VS sv = S::set1(cur[j].scale(k0));
          for (int i = 0; i < MR; ++i) acc[i][j] = S::fma(seg[i][j], sv, acc[i][j]);
        }
      }
      for (int i = 0; i < mr; ++i)
        for (int j = 0; j < nr; ++j) {
          float s = S::hsum(acc[i][j]);
          for (long k = kv; k < g.K; ++k) s = std::fma(a[i][k], cur[j].one(k), s);
          store_out(g.c + long(m0 + i) * g.ldc + n0 + j, g.alpha, s, g.accumulate);
        }
    }
  }
}

// INT4 decode where the set splits a byte's two nibbles at once (Simd::int4_split), K a multiple of the group:
// the even- and odd-indexed weights of a group come out as separate vectors, so the activation rows are read
// from a copy whose groups list their even-indexed values first (made once per call). A set whose split values
// are the codes (int4_split_bias 8) takes the offset off once per row: Σ_g s_g Σ (q − 8)·x = Σ_g s_g Σ q·x −
// 8 Σ_g s_g Σ_g x. A block's group scales are widened once, so a group costs the loop one broadcast per weight
// row besides its decoding and FMAs.
template <int MR, int NR, class S>
void gemm_nt_int4_split(const GemmNT<int4_group>& g) {
  using Cursor = Int4Cursor<S>;
  using VS = typename S::V;
  constexpr int G = int4_group::GROUP;
  constexpr float bias = S::int4_split_bias;
  const long groups = g.K / G;
  thread_local isa_vector<float> xs, sums, scales;
  xs.resize(size_t(g.M) * g.K);
  if constexpr (bias != 0) sums.resize(size_t(g.M) * groups);
  scales.resize(size_t(NR) * groups);
  for (int i = 0; i < g.M; ++i) {
    const float* x = g.a.at(i);
    float* d = xs.data() + long(i) * g.K;
    for (long q = 0; q < g.K; q += G) {
      for (int t = 0; t < G / 2; ++t) {
        d[q + t] = x[q + 2 * t];
        d[q + G / 2 + t] = x[q + 2 * t + 1];
      }
      if constexpr (bias != 0) {
        float sum = 0.f;
        for (int t = 0; t < G / 2; ++t) sum += x[q + 2 * t] + x[q + 2 * t + 1];
        sums[long(i) * groups + q / G] = sum;
      }
    }
  }
  for (int n0 = 0; n0 < g.N; n0 += NR) {
    const int nr = std::min(NR, g.N - n0);
    Cursor cur[NR], next[NR];
    const int nn = std::min(NR, g.N - n0 - NR);
    for (int j = 0; j < NR; ++j) {
      cur[j] = cursor<S>(g.b, n0 + std::min(j, nr - 1));
      to_f32_row(cur[j].sc, groups, scales.data() + j * groups);
    }
    for (int j = 0; j < nn; ++j) next[j] = cursor<S>(g.b, n0 + NR + j);
    NextBlockRequests<Cursor> requests(next, nn, g.K, groups);
    for (int m0 = 0; m0 < g.M; m0 += MR) {
      const int mr = std::min(MR, g.M - m0);
      const float* a[MR];
      for (int i = 0; i < MR; ++i) a[i] = xs.data() + (m0 + std::min(i, mr - 1)) * g.K;
      VS acc[MR][NR];
      for (int i = 0; i < MR; ++i)
        for (int j = 0; j < NR; ++j) acc[i][j] = S::zero();
      for (long q = 0; q < groups; ++q) {
        requests.segment();
        VS seg[MR][NR];
        for (int i = 0; i < MR; ++i)
          for (int j = 0; j < NR; ++j) seg[i][j] = S::zero();
        for (int h = 0; h < G / 2; h += S::W) {  // W bytes of the group's G / 2: 2·W weights
          VS ae[MR], ao[MR];
          for (int i = 0; i < MR; ++i) ae[i] = S::load(a[i] + q * G + h), ao[i] = S::load(a[i] + q * G + G / 2 + h);
          for (int j = 0; j < NR; ++j) {
            VS even, odd;
            cur[j].values_split(q * G + 2 * h, even, odd);
            for (int i = 0; i < MR; ++i) seg[i][j] = S::fma(ao[i], odd, S::fma(ae[i], even, seg[i][j]));
          }
        }
        for (int j = 0; j < NR; ++j) {
          const VS sv = S::set1(scales[j * groups + q]);
          for (int i = 0; i < MR; ++i) acc[i][j] = S::fma(seg[i][j], sv, acc[i][j]);
        }
      }
      for (int i = 0; i < mr; ++i)
        for (int j = 0; j < nr; ++j) {
          float offset = 0.f;  // Σ_g s_g Σ_g x
          if constexpr (bias != 0) {
            const float* gs = sums.data() + (m0 + i) * groups;
            const float* sc = scales.data() + j * groups;
            VS off = S::zero();
            long q = 0;
            for (; q + S::W <= groups; q += S::W) off = S::fma(S::load(sc + q), S::load(gs + q), off);
            offset = S::hsum(off);
            for (; q < groups; ++q) offset = std::fma(sc[q], gs[q], offset);
          }
          store_out(g.c + long(m0 + i) * g.ldc + n0 + j, g.alpha, S::hsum(acc[i][j]) - bias * offset, g.accumulate);
        }
    }
  }
}

template <class TB, class S = Simd>
void gemm_nt(const GemmNT<TB>& g) {
  if constexpr (kQuantized<TB> && S::W >= 8) {
    // Weight rows in flight: 2·MR·NR accumulators (segment and total) fit 16 ymm with NR·MR = 4 on AVX2,
    // 32 zmm with NR·MR = 8 on AVX-512.
    constexpr int RN = S::W == 8 ? 4 : 8;
    if constexpr (std::is_same_v<TB, int4_group> && S::int4_split)
      if (g.M <= 2 && g.K % int4_group::GROUP == 0)
        return g.M == 1 ? gemm_nt_int4_split<1, RN, S>(g) : gemm_nt_int4_split<2, RN / 2, S>(g);
    if (g.M == 1) return gemm_nt_fused<1, RN, S>(g);
    if (g.M == 2) return gemm_nt_fused<2, RN / 2, S>(g);
  }
  // One activation row (decode): every FMA is useful with MR = 1, and 8 weight rows in flight keep the memory
  // streams busy (8 accumulators + 8 weight vectors fit the 16 ymm of AVX2). BF16 rows are read in place there;
  // widening pays off once a tile is reused by more than one row block.
  if (g.M == 1) return gemm_nt_tiles<1, 8>(g, kQuantized<TB>);
  gemm_nt_tiles<NT_MR, NT_NR>(g, kQuantized<TB> || (kWidens<TB> && g.M > NT_MR));
}

template <bool Trans, class TB>
inline float a_elem(const GemmNN<TB>& g, long m, long k) {
  if (Trans) {
    float v = g.a.at(k)[g.a_off + m];
    return g.kscale ? v * g.kscale[k] : v;
  }
  return g.a.at(m)[g.a_off + k];
}

// MR rows × NV vectors of columns starting at n0, reduced over k in [k0, k1); the first `ncols` columns are
// stored. B row k is panel + (k − k0)·NV·W when widened, else read in place.
template <bool Trans, int NV, class TB>
void nn_tile(const GemmNN<TB>& g, int m0, int mr, int n0, int k0, int k1, const float* panel, int ncols = NV * W) {
  V acc[NN_MR][NV];
  for (int i = 0; i < NN_MR; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = Simd::zero();
  const float* arow[NN_MR];
  if (!Trans)
    for (int i = 0; i < NN_MR; ++i) arow[i] = g.a.at(m0 + std::min(i, mr - 1)) + g.a_off;
  for (int k = k0; k < k1; ++k) {
    V bv[NV];
    if (panel) {
      const float* br = panel + long(k - k0) * NV * W;
      for (int v = 0; v < NV; ++v) bv[v] = Simd::load(br + v * W);
    } else if constexpr (!kQuantized<TB>) {
      const TB* br = g.b.at(k) + g.b_off + n0;
      for (int v = 0; v < NV; ++v) bv[v] = Simd::load(br + v * W);
    }
    const float* acol = Trans ? g.a.at(k) + g.a_off + m0 : nullptr;
    const float ks = Trans && g.kscale ? g.kscale[k] : 1.f;
    for (int i = 0; i < NN_MR; ++i) {
      float av = Trans ? acol[std::min(i, mr - 1)] * ks : arow[i][k];
      V avv = Simd::set1(av);
      for (int v = 0; v < NV; ++v) acc[i][v] = Simd::fma(avv, bv[v], acc[i][v]);
    }
  }
  // Whole vectors are stored as vectors: with a short reduction (LoRA's K = r) one store per element would
  // cost more than the products (a third of the forward's down phase at Layer Q on the GPU machine).
  const V alpha = Simd::set1(g.alpha);
  const bool add = g.accumulate || k0 != 0;
  float lane[W];
  for (int i = 0; i < mr; ++i) {
    float* c = g.c + long(m0 + i) * g.ldc + n0;
    for (int v = 0; v < NV; ++v) {
      if ((v + 1) * W <= ncols) {
        Simd::store(c + v * W, add ? Simd::fma(alpha, acc[i][v], Simd::load(c + v * W)) : Simd::mul(alpha, acc[i][v]));
        continue;
      }
      Simd::store(lane, acc[i][v]);
      for (int l = 0; l < W && v * W + l < ncols; ++l)
        store_chunk(c + v * W + l, g.alpha, lane[l], g.accumulate, k0 == 0);
    }
  }
}

// Columns past the last full tile: one column at a time, the same k chain as a vector lane.
template <bool Trans, class TB>
void nn_column(const GemmNN<TB>& g, int n) {
  for (int m = 0; m < g.M; ++m) {
    float s = 0.f;
    for (int k = 0; k < g.K; ++k) s = std::fma(a_elem<Trans>(g, m, k), kt::to_f32(g.b.at(k)[g.b_off + n]), s);
    store_out(g.c + long(m) * g.ldc + n, g.alpha, s, g.accumulate);
  }
}

// Quantized B: every panel decoded, the last one partial (its missing columns zeros, computed and dropped).
template <bool Trans, class TB>
void gemm_nn_decoded(const GemmNN<TB>& g) {
  constexpr int NB = NN_NV * W, KC = NN_PANEL / NB;
  alignas(64) float panel[NN_PANEL];
  for (int n0 = 0; n0 < g.N; n0 += NB) {
    const int nb = std::min(NB, g.N - n0);
    for (int k0 = 0; k0 < g.K; k0 += KC) {
      const int k1 = std::min(g.K, k0 + KC);
      for (int k = k0; k < k1; ++k) {
        float* row = panel + long(k - k0) * NB;
        widen_row(g.b, k, g.b_off + n0, nb, row);
        std::fill(row + nb, row + NB, 0.f);
      }
      for (int m0 = 0; m0 < g.M; m0 += NN_MR) nn_tile<Trans, NN_NV>(g, m0, std::min(NN_MR, g.M - m0), n0, k0, k1, panel, nb);
    }
  }
}

template <bool Trans, class TB>
void gemm_nn_impl(const GemmNN<TB>& g) {
  if constexpr (kQuantized<TB>) {
    gemm_nn_decoded<Trans>(g);
  } else {
    constexpr int NB = NN_NV * W, KC = NN_PANEL / NB;
    const bool widen = kWidens<TB> && g.M > NN_MR;
    alignas(64) float panel[kWidens<TB> ? NN_PANEL : 1];
    const int nfull = g.N - g.N % NB, nvec = g.N - g.N % W;
    for (int n0 = 0; n0 < nfull; n0 += NB) {
      for (int k0 = 0; k0 < g.K; k0 += KC) {
        const int k1 = std::min(g.K, k0 + KC);
        if (widen)
          for (int k = k0; k < k1; ++k) widen_row(g.b, k, g.b_off + n0, NB, panel + long(k - k0) * NB);
        for (int m0 = 0; m0 < g.M; m0 += NN_MR)
          nn_tile<Trans, NN_NV>(g, m0, std::min(NN_MR, g.M - m0), n0, k0, k1, widen ? panel : nullptr);
      }
    }
    for (int n0 = nfull; n0 < nvec; n0 += W)
      for (int m0 = 0; m0 < g.M; m0 += NN_MR) nn_tile<Trans, 1>(g, m0, std::min(NN_MR, g.M - m0), n0, 0, g.K, nullptr);
    for (int n = nvec; n < g.N; ++n) nn_column<Trans>(g, n);
  }
}

template <class TB>
void gemm_nn(const GemmNN<TB>& g) {
  if (g.a_trans)
    gemm_nn_impl<true>(g);
  else
    gemm_nn_impl<false>(g);
}

// The gated unit h = a(g')·(u' + up_offset) with g' = min(g, limit), u' = clamp(u, −limit, limit) and
// a(g') = g'·sigmoid(alpha·g'·(1 + cubic·g'²)): SwiGLU (silu) at the defaults, GPT-OSS's clamped form with its alpha,
// limit and +1, GeGLU's tanh-approximated gelu with its alpha and cubic. At cubic 0 the cubic term is skipped (not
// multiplied by 0, which would turn an infinite g into NaN). Otherwise it is taken of g' clamped to ±CUBIC_BOUND
// (cubic_arg), past which sigmoid is 0 or 1 in float32 for GeGLU: the exp below saturates short of that, and the
// backward's g'³-sized factor would turn its remainder into large gradients (or NaN past ~1e13). Written for lanes and
// for the tail alike; the clamps keep a NaN input (minps passes its second operand on).
constexpr float CUBIC_BOUND = 15.f;

template <class S>
inline typename S::V cubic_arg(typename S::V gl) {
  return S::max(S::set1(-CUBIC_BOUND), S::min(S::set1(CUBIC_BOUND), gl));
}

template <class S>
inline typename S::V glu_lane(typename S::V g, typename S::V u, const kt::Glu& f, typename S::V& gl, typename S::V& s) {
  using VV = typename S::V;
  gl = S::min(S::set1(f.limit), g);
  const VV ul = S::max(S::set1(-f.limit), S::min(S::set1(f.limit), u));
  VV z = gl;
  if (f.cubic != 0.f) {
    const VV gc = cubic_arg<S>(gl);
    z = S::mul(gc, S::fma(S::mul(S::set1(f.cubic), gc), gc, S::set1(1.f)));
  }
  s = S::div(S::set1(1.f), S::add(S::set1(1.f), S::exp(S::mul(S::set1(-f.alpha), z))));
  return S::add(ul, S::set1(f.up_offset));
}

struct Scalar1 {  // the tail's one-lane ops, the same arithmetic as Simd's lanes
  using V = float;
  static V set1(float x) { return x; }
  static V min(V a, V b) { return a < b ? a : b; }
  static V max(V a, V b) { return a > b ? a : b; }
  static V mul(V a, V b) { return a * b; }
  static V add(V a, V b) { return a + b; }
  static V div(V a, V b) { return a / b; }
  static V exp(V x) { return std::exp(x); }
  static V fma(V a, V b, V c) { return std::fma(a, b, c); }
  static V zero_where_ge(V a, V b, V v) { return a >= b ? 0.f : v; }
};

// Without a gate, h = relu(u)² and du = dh·2·relu(u). As torch's relu, a NaN u passes on (maxps returns its second
// operand where either is NaN).
void relu2(long n, const float* u, float* h) {
  long i = 0;
  for (; i + W <= n; i += W) {
    const V r = Simd::max(Simd::set1(0.f), Simd::load(u + i));
    Simd::store(h + i, Simd::mul(r, r));
  }
  for (; i < n; ++i) {
    const float r = Scalar1::max(0.f, u[i]);
    h[i] = r * r;
  }
}

void relu2_backward(long n, const float* u, const float* dh, float* du) {
  long i = 0;
  for (; i + W <= n; i += W) {
    const V r = Simd::max(Simd::set1(0.f), Simd::load(u + i));
    Simd::store(du + i, Simd::mul(Simd::load(dh + i), Simd::add(r, r)));
  }
  for (; i < n; ++i) du[i] = dh[i] * 2.f * Scalar1::max(0.f, u[i]);
}

void glu(long n, const float* g, const float* u, float* h, const kt::Glu& f) {
  if (!f.gated) return relu2(n, u, h);
  long i = 0;
  for (; i + W <= n; i += W) {
    V gl, s;
    const V up = glu_lane<Simd>(Simd::load(g + i), Simd::load(u + i), f, gl, s);
    Simd::store(h + i, Simd::mul(Simd::mul(gl, s), up));
  }
  for (; i < n; ++i) {
    float gl, s;
    const float up = glu_lane<Scalar1>(g[i], u[i], f, gl, s);
    h[i] = gl * s * up;
  }
}

// With s = sigmoid(alpha·(g' + cubic·g'³)): a'(g') = s·(1 + alpha·g'·(1 + 3·cubic·g'²)·(1 − s));
// dg = dh·(u' + up_offset)·a'(g') where g < limit, du = dh·a(g') where |u| < limit (at the limit itself none passes,
// as torch's clamp gives).
template <class S>
inline void glu_backward_lane(typename S::V gv, typename S::V uv, typename S::V dhv, const kt::Glu& f,
                              typename S::V& dg, typename S::V& du) {
  using VV = typename S::V;
  VV gl, s;
  const VV up = glu_lane<S>(gv, uv, f, gl, s);
  const VV one = S::set1(1.f);
  VV dz = S::set1(f.alpha), gz = gl;  // alpha·dz/dg', and the g' it multiplies (cubic_arg's where there is a cubic)
  if (f.cubic != 0.f) {
    gz = cubic_arg<S>(gl);
    dz = S::mul(dz, S::fma(S::mul(S::set1(3.f * f.cubic), gz), gz, one));
  }
  const VV da = S::mul(s, S::fma(S::mul(dz, gz), S::add(one, S::mul(s, S::set1(-1.f))), one));
  dg = S::zero_where_ge(gv, S::set1(f.limit), S::mul(S::mul(dhv, up), da));
  const VV d = S::mul(dhv, S::mul(gl, s));
  du = S::zero_where_ge(uv, S::set1(f.limit), S::zero_where_ge(S::set1(-f.limit), uv, d));
}

void glu_backward(long n, const float* g, const float* u, const float* dh, float* dg, float* du, const kt::Glu& f) {
  if (!f.gated) return relu2_backward(n, u, dh, du);
  long i = 0;
  for (; i + W <= n; i += W) {
    V dgv, duv;
    glu_backward_lane<Simd>(Simd::load(g + i), Simd::load(u + i), Simd::load(dh + i), f, dgv, duv);
    Simd::store(dg + i, dgv);
    Simd::store(du + i, duv);
  }
  for (; i < n; ++i) glu_backward_lane<Scalar1>(g[i], u[i], dh[i], f, dg[i], du[i]);
}

void bf16_to_f32(long n, const bf16* src, float* dst) { to_f32_row(src, n, dst); }

void f32_to_bf16(long n, const float* src, bf16* dst) {
  for (long i = 0; i < n; ++i) dst[i] = kt::f32_to_bf16(src[i]);
}

void scale(long n, float alpha, float* x) {
  long i = 0;
  const V av = Simd::set1(alpha);
  for (; i + W <= n; i += W) Simd::store(x + i, Simd::mul(av, Simd::load(x + i)));
  for (; i < n; ++i) x[i] *= alpha;
}

void axpy(long n, float alpha, const float* x, float* y) {
  long i = 0;
  const V av = Simd::set1(alpha);
  for (; i + W <= n; i += W) Simd::store(y + i, Simd::fma(av, Simd::load(x + i), Simd::load(y + i)));
  for (; i < n; ++i) y[i] = std::fma(alpha, x[i], y[i]);
}

float dot(long n, const float* a, const float* b) {
  V acc = Simd::zero();
  long i = 0;
  for (; i + W <= n; i += W) acc = Simd::fma(Simd::load(a + i), Simd::load(b + i), acc);
  float s = Simd::hsum(acc);
  for (; i < n; ++i) s = std::fma(a[i], b[i], s);
  return s;
}

// A plain loop the compiler vectorizes with each ISA file's flags (32-bit multiplies, shifts, a compare); src is
// read unconditionally (a multiply by 0 or 1/(1 − p), as torch's dropout does) so no load is conditional.
void lora_dropout(uint32_t row_key, long c0, long n, float p, const float* src, float* dst, bool accumulate) {
  const float scale = 1.f / (1.f - p);
  if (accumulate)
    for (long j = 0; j < n; ++j) dst[j] += src[j] * (kt::dropout_keeps(row_key, uint32_t(c0 + j), p) ? scale : 0.f);
  else
    for (long j = 0; j < n; ++j) dst[j] = src[j] * (kt::dropout_keeps(row_key, uint32_t(c0 + j), p) ? scale : 0.f);
}

[[maybe_unused]] kt::KernelSet make_kernel_set(const char* name) {  // unused in fp8_bf16_dot.cpp
  return kt::KernelSet{name,
                       gemm_nt<bf16>,
                       gemm_nt<bf16>,
                       gemm_nt<float>,
                       gemm_nn<bf16>,
                       gemm_nn<float>,
                       gemm_nt<fp8_block>,
                       gemm_nt<fp8_block>,
                       gemm_nn<fp8_block>,
                       gemm_nt<int4_group>,
                       gemm_nt<int4_group>,
                       gemm_nn<int4_group>,
                       glu,
                       glu_backward,
                       bf16_to_f32,
                       f32_to_bf16,
                       scale,
                       axpy,
                       dot,
                       lora_dropout,
                       nullptr};
}

}  // namespace
