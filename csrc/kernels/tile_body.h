// The tile-unit products of kernels.h (TileKernels), written once on a `Tiles` policy: amx.cpp passes the
// AMX instructions, avx512_bf16.cpp the same operations on vdpbf16ps. Packing and stores use AVX-512 (BW,
// BF16), which every CPU with either has. Include after simd_avx512.h and kernel_body.h (widen_row decodes
// weight rows).
//
// Tiles::block computes a block of up to 2×2 16×16 float32 results (2×3 on the emulated tiles; result_tile
// places them) from the A operands of its block rows (16 rows × 32 BF16 per reduction block) and the B operands
// of its block columns (16 pairs of k × 16 columns × 2), one pass over K; every output element is reduced in one
// fixed order (32-column reduction blocks in turn, BF16 pairs summed in float32 as the tile unit does), whatever
// the thread that computes it and whatever block it falls in.
//
// Dot form (x·Wᵀ) runs transposed: the weight rows are the A operand, loaded in place from the expert's
// BF16 rows (or from a decoded panel), and the activations, packed once per call in the nt layout, are the
// B operand; each 16×16 result is transposed on its way out. Axpy form (dy·W) packs the weight panel of
// the item into the B layout (pairs of weight rows interleaved) and loads the row-major activations as A.
#pragma once
#include <type_traits>
#include <vector>

#include "kernel_body.h"

namespace {

using kt::TileNN;
using kt::TileNT;
constexpr int TR = 16;           // rows of a tile
constexpr int TC = 32;           // BF16 columns of a tile row (64 bytes)
constexpr int TBLK = TR * TC;    // BF16 elements of one packed block
constexpr long TBYTES = TC * 2;  // bytes of a tile row

inline __mmask16 first16(long n) { return n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1); }
inline __mmask32 first32(long n) { return n >= 32 ? __mmask32(0xffffffff) : __mmask32((1u << n) - 1); }

// Permute indices of transpose16's stage s for the row r of each pair (lo) and its partner r + 2^s (hi); an
// index ≥ 16 takes lane index − 16 of the partner.
struct TransposeIndex {
  alignas(64) int lo[4][16];
  alignas(64) int hi[4][16];
};
constexpr TransposeIndex transpose_index() {
  TransposeIndex t{};
  for (int s = 0; s < 4; ++s)
    for (int c = 0; c < 16; ++c) {
      const int d = 1 << s;
      const bool upper = c & d;
      t.lo[s][c] = upper ? 16 + c - d : c;  // r keeps its lanes with bit s clear, takes r + d's shifted up
      t.hi[s][c] = upper ? 16 + c : c + d;  // r + d takes r's lanes with bit s set shifted down, keeps its own
    }
  return t;
}
constexpr TransposeIndex kTransposeIndex = transpose_index();

// v[i] lane j ← v[j] lane i: a 16×16 matrix of 32-bit elements transposed in registers. Stage s swaps bit s of
// the row index with bit s of the lane index, one two-source permute per row (64 in all, no memory: a gather
// or scatter of 16 lanes costs several times more per tile, and more where the microcode mitigates Gather
// Data Sampling).
inline void transpose16(__m512i* v) {
  for (int s = 0; s < 4; ++s) {
    const int d = 1 << s;
    const __m512i lo = _mm512_load_si512(kTransposeIndex.lo[s]), hi = _mm512_load_si512(kTransposeIndex.hi[s]);
    for (int r = 0; r < 16; ++r) {
      if (r & d) continue;
      const __m512i a = v[r], b = v[r + d];
      v[r] = _mm512_permutex2var_epi32(a, lo, b);
      v[r + d] = _mm512_permutex2var_epi32(a, hi, b);
    }
  }
}

// 32 floats from src (the first `n` of them; zeros for the rest) times `scale` rounded to BF16 (nearest even,
// as round_to_bf16), as 16 pairs of BF16 in one vector.
inline __m512i bf16_pairs(const float* src, long n, float scale = 1.f) {
  __m512 lo = n > 0 ? _mm512_maskz_loadu_ps(first16(n), src) : _mm512_setzero_ps();
  __m512 hi = n > 16 ? _mm512_maskz_loadu_ps(first16(n - 16), src + 16) : _mm512_setzero_ps();
  if (scale != 1.f) {
    lo = _mm512_mul_ps(lo, _mm512_set1_ps(scale));
    hi = _mm512_mul_ps(hi, _mm512_set1_ps(scale));
  }
  const __m512bh v = _mm512_cvtne2ps_pbh(hi, lo);
  return reinterpret_cast<const __m512i&>(v);
}

// The end of the 32-column steps over columns [k0, k0 + klen) of a K-column matrix: the last step of the
// matrix runs to its padded width.
inline long pack_end(int K, long k0, long klen) { return k0 + klen == K ? kt::tile_ld(K) : k0 + klen; }

// The BF16 pairs of row m, columns [k, k + 32): zeros past the row's real columns [k0, k0 + klen) and past M.
inline __m512i row_pairs(int M, long k0, long klen, const kt::Rows<float>& a, long m, long k) {
  return m < M ? bf16_pairs(a.at(m) + k, k0 + klen - k) : _mm512_setzero_si512();
}

// Pair p of row m goes to pair-row p of its block, column m % 16: the block is the transpose of its 16 rows'
// pairs, built in registers and stored as 1 KB in one piece.
void pack_nt(int M, int K, long k0, long klen, kt::Rows<float> a, bf16* dst) {
  const long kblocks = kt::tile_ld(K) / TC, kend = pack_end(K, k0, klen);
  for (long m0 = 0; m0 < kt::tile_rows(M); m0 += TR)
    for (long k = k0; k < kend; k += TC) {
      __m512i v[TR];
      for (int i = 0; i < TR; ++i) v[i] = row_pairs(M, k0, klen, a, m0 + i, k);
      transpose16(v);
      bf16* blk = dst + ((m0 / TR) * kblocks + k / TC) * TBLK;
      for (int p = 0; p < TR; ++p) _mm512_storeu_si512(blk + p * TC, v[p]);
    }
}

void pack_nn(int M, int K, long k0, long klen, kt::Rows<float> a, bf16* dst) {
  const long ld = kt::nn_ld(K), kend = pack_end(K, k0, klen);
  for (long m = 0; m < kt::tile_rows(M); ++m)
    for (long k = k0; k < kend; k += TC) _mm512_storeu_si512(dst + m * ld + k, row_pairs(M, k0, klen, a, m, k));
}

// dst[0, n) = scale · src[0, n) rounded to BF16 (nearest even), 16 at a time.
inline void round_to_bf16(long n, const float* src, bf16* dst, float scale = 1.f) {
  for (long i = 0; i < n; i += 16) {
    const __mmask16 m = first16(n - i);
    __m512 x = _mm512_maskz_loadu_ps(m, src + i);
    if (scale != 1.f) x = _mm512_mul_ps(x, _mm512_set1_ps(scale));
    const __m256bh v = _mm512_cvtneps_pbh(x);
    _mm256_mask_storeu_epi16(dst + i, m, reinterpret_cast<const __m256i&>(v));
  }
}

// 32 quantized weights from column c (a multiple of 8; c + 32 within c's block or group) as BF16: each
// weight × its scale in float32, rounded once to the nearest even BF16, as widen_row then round_to_bf16 give.
// FP8: the codes widened in pairs of vectors, scaled and rounded together.
inline __m512i bf16x32(const Fp8Cursor<Simd>& cur, long c) {
  __m512 lo, hi;
  cur.raw2(c, lo, hi);
  const __m512 s = _mm512_set1_ps(cur.scale(c));
  const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_mul_ps(hi, s), _mm512_mul_ps(lo, s));
  return reinterpret_cast<const __m512i&>(v);
}

// INT4: the group's 16 possible weights, (nibble − 8) · scale, rounded once into a table that each nibble
// indexes (vpermw reads the low 5 bits of an index lane), so a weight costs no arithmetic of its own.
inline __m512i bf16x32(const Int4Cursor<Simd>& cur, long c) {
  // The scale's BF16 bits in the upper half of every 32-bit lane (the lower halves zero) are its float32.
  const short bits = short(cur.scale_bits(c));
  const __m512 scale = _mm512_castsi512_ps(_mm512_maskz_set1_epi16(0xAAAAAAAAu, bits));
  const __m512 values =
      _mm512_mul_ps(_mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7), scale);
  const __m256bh rounded = _mm512_cvtneps_pbh(values);
  const __m512i table = _mm512_castsi256_si512(reinterpret_cast<const __m256i&>(rounded));
  // Byte j holds weights 2j (low nibble) and 2j + 1 (high): spread into 16-bit lanes 2j and 2j + 1.
  const auto* bytes = reinterpret_cast<const __m128i*>(cur.w + unsigned_col(c) / 8);
  const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128(bytes));
  const __m512i nibbles = _mm512_and_si512(_mm512_or_si512(x, _mm512_slli_epi32(x, 12)), _mm512_set1_epi32(0x000f000f));
  return _mm512_permutexvar_epi16(nibbles, table);
}

// Row i of B, columns [col0, col0 + len), as BF16 into dst: for BF16 weights the row itself (nothing
// copied), for float32 rows (LoRA) times `scale` rounded to the nearest even BF16, for quantized ones decoded
// and rounded once (a weight × its block or group scale, in float32, to the nearest BF16): 32 at a time
// straight to BF16, the edges of a block or group through float32. `scale` applies to float32 rows only.
template <class TB>
const bf16* row_bf16(const kt::Rows<TB>& b, long i, long col0, long len, bf16* dst, float scale = 1.f) {
  if constexpr (std::is_same_v<TB, bf16>) {
    return b.at(i) + col0;
  } else if constexpr (std::is_same_v<TB, float>) {
    round_to_bf16(len, b.at(i) + col0, dst, scale);
    return dst;
  } else {
    const auto cur = cursor<Simd>(b, i);
    using Cursor = std::decay_t<decltype(cur)>;
    alignas(64) float edge[32];
    // From a multiple of 32 every 32-column step lies inside one block or group (both multiples of 32): the whole
    // segment is one run of steps, without bookkeeping per block or group.
    const bool aligned = col0 % 32 == 0;
    for (long c = col0, end = col0 + len; c < end;) {
      const long send = aligned ? end : std::min(end, (c / Cursor::SEG + 1) * Cursor::SEG);
      if (c % 8 == 0)
        for (; c + 32 <= send; c += 32) _mm512_storeu_si512(dst + (c - col0), bf16x32(cur, c));
      for (long n; c < send; c += n) {
        n = std::min<long>(send - c, 32);
        widen_row(b, i, c, n, edge);
        round_to_bf16(n, edge, dst + (c - col0));
      }
    }
    return dst;
  }
}

// The line at p requested into L2, by asm: GCC 12's mod/ref analysis finds that a function whose only effect is
// _mm_prefetch touches no memory and deletes the calls to it (-fno-ipa-modref keeps them). Before this form the
// built kernels held only tile_nn's requests of BF16 rows (inlined into code that stores); request_share's, INT4
// rows' and tile_nt's in-place weight requests (which ride on Tiles::block's out-of-line `before` call) were
// dropped, whatever the comments below and the sessions that measured them said (BENCHMARKS.md).
inline void request_line(const void* p) { asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p))); }

// The lines of row i's columns [col0, col0 + len) as stored (BF16 values; FP8 or INT4 codes and their
// scales), requested into L2.
template <class TB>
void request_row(const kt::Rows<TB>& b, long i, long col0, long len) {
  auto lines = [](const void* p, long bytes) {
    const uintptr_t a = reinterpret_cast<uintptr_t>(p);
    for (uintptr_t l = a & ~uintptr_t(63); l < a + bytes; l += 64)
      request_line(reinterpret_cast<const char*>(l));
  };
  if constexpr (std::is_same_v<TB, bf16>) {
    lines(b.at(i) + col0, len * 2);
  } else {
    const auto cur = cursor<Simd>(b, i);
    using Cursor = std::decay_t<decltype(cur)>;
    lines(cur.codes() + Cursor::code_bytes(col0), Cursor::code_bytes(col0 + len) - Cursor::code_bytes(col0));
    const long first = col0 / Cursor::SEG, last = (col0 + len - 1) / Cursor::SEG;
    lines(cur.sc + first, long(sizeof(*cur.sc)) * (last - first + 1));
  }
}

// Share `at` of `total` of the next product's lines (u; a partial first or last line of a run counted whole),
// requested into L2: a product asks for one share per reduction step, so the requests spread over its run.
inline void request_share(const kt::Upcoming& u, long at, long total) {
  if (!u.rows) return;
  const long per = (u.len + 63) / 64 + ((reinterpret_cast<uintptr_t>(u.p) | uintptr_t(u.stride)) % 64 != 0);
  const long lines = u.rows * per;
  for (long l = at * lines / total, end = (at + 1) * lines / total; l < end; ++l) {
    const uintptr_t run = reinterpret_cast<uintptr_t>(u.p + (l / per) * u.stride) & ~uintptr_t(63);
    request_line(reinterpret_cast<const char*>(run + (l % per) * 64));
  }
}

// Stores one 16×16 result tile `t` (row-major, as the tile unit writes it) times alpha to C at (m0, n0),
// keeping the mr × nr part inside C; with `transposed`, t holds the result's columns as its rows. With `stream`
// (not accumulating), rows of 16 columns on a 64-byte boundary go around the caches; the product ends with an
// sfence then, so that they are visible to the threads that read them after the phase.
void put_tile(const float* t, bool transposed, int m0, int mr, int n0, int nr, float* c, long ldc, bool accumulate,
              float alpha, bool stream) {
  const __mmask16 cols = first16(nr);
  __m512i rows[TR];
  if (transposed) {
    for (int i = 0; i < TR; ++i) rows[i] = _mm512_load_si512(t + i * TR);
    transpose16(rows);
  }
  for (int i = 0; i < mr; ++i) {
    float* row = c + long(m0 + i) * ldc + n0;
    __m512 v = transposed ? _mm512_castsi512_ps(rows[i]) : _mm512_maskz_loadu_ps(cols, t + i * TR);
    if (alpha != 1.f) v = _mm512_mul_ps(v, _mm512_set1_ps(alpha));
    if (accumulate) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(cols, row));
    if (stream && !accumulate && nr == TR && reinterpret_cast<uintptr_t>(row) % 64 == 0)
      _mm512_stream_ps(row, v);
    else
      _mm512_mask_storeu_ps(row, cols, v);
  }
}

// Rows k and k + 1 of 32 columns (w0, w1) interleaved into the B operand's pair rows of two block columns by
// in-lane unpacks, one shuffle each, where a two-source word permute (vpermt2w, which keeps the columns in order)
// is listed as several micro-ops on Intel's server cores (instruction tables; not measured here): 128-bit lane L
// of `lo` pairs columns 8L .. 8L + 3, `hi` columns 8L + 4 .. 8L + 7. The backward packs every weight pair this way.
inline void unpack_pair(__m512i w0, __m512i w1, __m512i& lo, __m512i& hi) {
  lo = _mm512_unpacklo_epi16(w0, w1);
  hi = _mm512_unpackhi_epi16(w0, w1);
}

// The result tiles of such a pair (t0 from `lo`, t1 from `hi`) back in column order: each row's 4-column pieces
// alternate between the two.
inline void unpair_columns(float* t0, float* t1) {
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
  for (int r = 0; r < TR; ++r) {
    const __m512 a = _mm512_load_ps(t0 + r * TR), b = _mm512_load_ps(t1 + r * TR);
    _mm512_store_ps(t0 + r * TR, _mm512_permutex2var_ps(a, first, b));
    _mm512_store_ps(t1 + r * TR, _mm512_permutex2var_ps(a, second, b));
  }
}

// Where tile_blocks keeps result tile (di, dj) of a block: 2·di + dj for the first two block columns (the tile
// unit's four), 4 + di for a third.
inline int result_tile(int di, int dj) { return dj < 2 ? 2 * di + dj : 4 + di; }

// Block columns that tile_blocks' pass from block column j of JB takes: two, the last one alone, or where the
// policy takes three (Tiles::kColumnBlocks), the last three together; and how many passes that makes.
template <class Tiles>
int column_pass(int j, int JB) {
  return JB - j == 3 && Tiles::kColumnBlocks >= 3 ? 3 : std::min(2, JB - j);
}
template <class Tiles>
long column_passes(int JB) {
  long n = 0;
  for (int j = 0; j < JB; j += column_pass<Tiles>(j, JB)) ++n;
  return n;
}

// The block loop shared by both forms. a_tile(i, kc) / b_tile(j, kc) point at A block-row i and B
// block-column j of reduction block kc, with their row strides in bytes (A's per reduction block: a_stride(kc));
// tile (i, j) of the result covers rows i·16.. and columns j·16.. of the product A·B, which `put(i, j, t)`
// stores. make_b(j, kc) runs before B tile (j, kc) is first loaded (during the first block row), so a B operand
// packed on the way overlaps its memory reads with the tile products of the previous tiles. ahead(i, step, steps) runs at
// each of the `steps` reduction steps of block row pair i, so that A operands read from memory can be
// requested a block row pair ahead, spread over the time its tile products take. Each block of two block rows by
// column_pass's block columns is the policy's `Tiles::block`, which calls before(kc) ahead of its first use of
// reduction block kc's operands.
// With `unpacked_pairs`, the B operand of a pair of block columns holds their 32 columns in the order
// unpack_pair stores them, and each result tile pair is put back in column order (unpair_columns) before `put`;
// a block column that is not part of a pair (the last of an odd count) holds its columns in order.
// Of the A rows and B columns the tiles cover, the first `rows` and `cols` hold data (the rest is padding, whose
// results `put` does not store): each block is told how many of its A rows do (`a_rows`) and, where its last
// block column's lanes are in column order, how many of them (`last_lanes`, else 16), so that a policy may
// leave the others' products out.
template <class Tiles, class ATile, class AStride, class BTile, class MakeB, class Ahead, class Put>
void tile_blocks(int IB, int JB, long rows, long cols, int KC, AStride a_stride, long b_stride, ATile a_tile,
                 BTile b_tile, MakeB make_b, Ahead ahead, Put put, bool unpacked_pairs = false) {
  alignas(64) float t[6][TR * TR];
  Tiles::begin();
  const long steps = column_passes<Tiles>(JB) * KC;
  for (int i = 0; i < IB; i += 2) {
    const bool i2 = i + 1 < IB;
    for (int j = 0, nj; j < JB; j += nj) {
      nj = column_pass<Tiles>(j, JB);
      auto before = [&](int kc) {
        ahead(i, long(j / 2) * KC + kc, steps);
        if (i == 0)
          for (int dj = 0; dj < nj; ++dj) make_b(j + dj, kc);
      };
      const int a_rows = int(std::min<long>(2 * TR, rows - long(i) * TR));
      const bool in_order = !(unpacked_pairs && nj == 2);
      const int last_lanes = in_order ? int(std::min<long>(TR, cols - long(j + nj - 1) * TR)) : TR;
      Tiles::block(
          i2, nj, a_rows, last_lanes, KC, before, [&](int di, int kc) { return a_tile(i + di, kc); }, a_stride,
          [&](int dj, int kc) { return b_tile(j + dj, kc); }, b_stride, t);
      for (int di = 0; di < (i2 ? 2 : 1); ++di) {
        if (unpacked_pairs && nj >= 2) unpair_columns(t[result_tile(di, 0)], t[result_tile(di, 1)]);
        for (int dj = 0; dj < nj; ++dj) put(i + di, j + dj, t[result_tile(di, dj)]);
      }
    }
  }
}

// Dot form, transposed: result tile (i, j) = weight rows i·16.., activation rows j·16... The f32 segment's rows
// (LoRA's B) × scale, rounded to BF16 into a panel of their own, are its last reduction blocks.
template <class Tiles, class TB>
void tile_nt(const TileNT<TB>& g) {
  if (g.M <= 0 || g.N <= 0) return;
  const long ld = kt::tile_ld(g.K), ldf = kt::tile_ld(g.f32.K);
  const bf16* w = nullptr;
  long ldw = ld;
  if constexpr (std::is_same_v<TB, bf16>)
    if (!g.b.ptrs && g.N % TR == 0 && g.K % TC == 0) w = g.b.base, ldw = g.b.ld;
  thread_local isa_vector<bf16> panel;
  if (!w) {  // decoded rows, zeros past N and K: tile loads never leave the panel
    panel.resize(kt::tile_rows(g.N) * ld);
    for (long n = 0; n < g.N; ++n) {
      bf16* row = panel.data() + n * ld;
      const bf16* src = row_bf16(g.b, n, 0, g.K, row);
      if (src != row) std::copy(src, src + g.K, row);
      std::fill(row + g.K, row + ld, bf16(0));
    }
    std::fill(panel.begin() + g.N * ld, panel.end(), bf16(0));
    w = panel.data();
  }
  thread_local isa_vector<bf16> f32_panel;
  if (g.f32.a) {
    f32_panel.assign(kt::tile_rows(g.N) * ldf, bf16(0));
    for (long n = 0; n < g.N; ++n) row_bf16(g.f32.b, n, 0, g.f32.K, f32_panel.data() + n * ldf, g.f32.scale);
  }
  const int KW = int(ld / TC), KF = g.f32.a ? int(ldf / TC) : 0, KC = KW + KF, IB = int(kt::tile_rows(g.N) / TR);
  // Weights read in place: the rows of the next block row pair (2·16 rows of K columns, 1.5-14 KB apart, 32
  // streams that the hardware prefetchers do not follow) are requested into L2 a slice per step while this
  // pair computes, so that the pass that first reads them does not wait on memory.
  const bool in_place = w != panel.data();
  const long row_lines = (g.K * 2 + 63) / 64;
  // The next product's bytes (g.next) are requested likewise, spread over all the steps of this one.
  auto ahead = [&](int i, long step, long steps) {
    request_share(g.next, long(i / 2) * steps + step, long((IB + 1) / 2) * steps);
    const int next = i + 2;
    if (!in_place || next >= IB) return;
    const long rows = std::min(2 * TR, int(g.N) - next * TR), lines = rows * row_lines;
    for (long l = step * lines / steps, end = (step + 1) * lines / steps; l < end; ++l)
      request_line(reinterpret_cast<const char*>(w + (long(next) * TR + l / row_lines) * ldw) + (l % row_lines) * 64);
  };
  tile_blocks<Tiles>(
      IB, int(kt::tile_rows(g.M) / TR), g.N, g.M, KC, [&](int kc) { return (kc < KW ? ldw : ldf) * 2; }, TBYTES,
      [&](int i, int kc) {
        return kc < KW ? w + long(i) * TR * ldw + kc * TC : f32_panel.data() + long(i) * TR * ldf + (kc - KW) * TC;
      },
      [&](int j, int kc) {
        return kc < KW ? g.a + (long(j) * KW + kc) * TBLK : g.f32.a + (long(j) * KF + kc - KW) * TBLK;
      },
      [](int, int) {}, ahead,
      [&](int i, int j, const float* t) {
        put_tile(t, true, j * TR, std::min(TR, g.M - j * TR), i * TR, std::min(TR, g.N - i * TR), g.c, g.ldc,
                 g.accumulate, g.alpha, g.stream);
      });
  if (g.stream) _mm_sfence();
}

// Axpy form at 1-3 rows (on the emulated tiles: when nothing is packed ahead): each pair of weight rows is
// interleaved in registers (unpack_pair) and multiplied there, so the weights are read once and never stored.
// tile_nn's panel is written and read again for every item, which at 1-3 rows took about half of the product's time
// (tile_bench nn 2048 1536: 381-409 µs at M = 1-3 against 181-218 with the panel packed ahead; direct 238 / 281 /
// 354 µs; Zen 4; on AMX, one thread, direct 10-20% faster than the panel at 1-2 rows; BENCHMARKS.md). Columns go
// in blocks of S 32-column strips whose 2·M·S sums stay in registers; each block walks every weight row again, in
// pieces of S cache lines, so from 4 rows (S ≤ 3) the short pieces made it as slow as the panel (4 rows) or slower
// (6-8 rows: 940-1010 against 530-560 µs). Every element is reduced over its segments' pairs in order, as a pass of
// the emulated tiles reduces a chunk.
template <int M, int S, class TB>
void direct_nn_rows(const TileNN<TB>& g) {
  static_assert(2 * M * S <= 24, "the sums stay in registers");
  constexpr int W = 32 * S;
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
  const long blocks = (g.N + W - 1) / W, pairs = (long(g.K) + g.second.K + g.f32[0].K + g.f32[1].K + 1) / 2;
  long step = 0;
  for (long c0 = 0; c0 < g.N; c0 += W) {
    __m512 acc[M][S][2];
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m)
#pragma GCC unroll 12
      for (int s = 0; s < S; ++s) acc[m][s][0] = acc[m][s][1] = _mm512_setzero_ps();
    // Pairs of rows k, k + 1 of one segment (A's columns k, k + 1), row(k, s) giving strip s of row k (k < K).
    auto reduce = [&](const bf16* a, long lda, int K, auto row) {
      for (long k = 0; k < K; k += 2, ++step) {
        request_share(g.next, step, blocks * pairs);
        __m512i pair[M];
#pragma GCC unroll 8
        for (int m = 0; m < M; ++m) pair[m] = _mm512_set1_epi32(*reinterpret_cast<const int*>(a + m * lda + k));
#pragma GCC unroll 12
        for (int s = 0; s < S; ++s) {
          if (c0 + 32 * s >= g.N) break;
          __m512i lo, hi;
          unpack_pair(row(k, s), k + 1 < K ? row(k + 1, s) : _mm512_setzero_si512(), lo, hi);
#pragma GCC unroll 8
          for (int m = 0; m < M; ++m) {
            const __m512bh p = reinterpret_cast<const __m512bh&>(pair[m]);
            acc[m][s][0] = _mm512_dpbf16_ps(acc[m][s][0], p, reinterpret_cast<const __m512bh&>(lo));
            acc[m][s][1] = _mm512_dpbf16_ps(acc[m][s][1], p, reinterpret_cast<const __m512bh&>(hi));
          }
        }
      }
    };
    // Strip s of a float32 row times scale, rounded to BF16.
    auto rounded = [&](const float* row, int s, float scale) {
      return bf16_pairs(row + g.b_off + c0 + 32 * s, g.N - c0 - 32 * s, scale);
    };
    auto weights = [&](const kt::Rows<TB>& b, const bf16* a, int K) {
      if (!a) return;
      reduce(a, kt::nn_ld(K), K, [&](long k, int s) {
        const long c = g.b_off + c0 + 32 * s;
        if constexpr (std::is_same_v<TB, float>) {
          return rounded(b.at(k), s, 1.f);
        } else {
          // The first row of the pair 4 pairs on, into L2 (tile_bench nn 2048 1536, M = 2: 281 µs; none 295;
          // both rows of that pair 321; 2 or 8 pairs on as fast).
          if (k + 8 < K && s == 0) request_row(b, k + 8, g.b_off + c0, std::min<long>(W, g.N - c0));
          if constexpr (std::is_same_v<TB, bf16>)
            return _mm512_maskz_loadu_epi16(first32(g.N - c0 - 32 * s), b.at(k) + c);
          else
            return bf16x32(cursor<Simd>(b, k), c);
        }
      });
    };
    weights(g.b, g.a, g.K);
    weights(g.second.b, g.second.a, g.second.K);
    for (const auto& f : g.f32)
      if (f.a) reduce(f.a, kt::nn_ld(f.K), f.K, [&](long k, int s) { return rounded(f.b.at(k), s, f.scale); });
    // The sums back in column order (lo holds columns 8L .. 8L + 3 of each 128-bit lane L, hi 8L + 4 ..), times
    // alpha, into C as put_tile stores a tile. Not through put_tile's tile buffer: so stored, the 2-row product ran
    // ~4% slower (tile_bench nn 2048 1536 2: 296-301 against 284-286 µs, alternated).
    for (int m = 0; m < M; ++m)
#pragma GCC unroll 12
      for (int s = 0; s < S; ++s) {
        if (c0 + 32 * s >= g.N) break;
        for (int h = 0; h < 2; ++h) {
          const long n0 = c0 + 32 * s + 16 * h, nr = g.N - n0;
          if (nr <= 0) break;
          __m512 v = _mm512_permutex2var_ps(acc[m][s][0], h ? second : first, acc[m][s][1]);
          float* out = g.c + long(m) * g.ldc + n0;
          if (g.alpha != 1.f) v = _mm512_mul_ps(v, _mm512_set1_ps(g.alpha));
          if (g.accumulate) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(first16(nr), out));
          if (g.stream && !g.accumulate && nr >= TR && reinterpret_cast<uintptr_t>(out) % 64 == 0)
            _mm512_stream_ps(out, v);
          else
            _mm512_mask_storeu_ps(out, first16(nr), v);
        }
      }
  }
  if (g.stream) _mm_sfence();
}

// Whether direct_nn_rows computes this product: 1-3 rows, quantized weights whose 32-column strips each lie in one
// block or group (bf16x32's condition; else tile_nn decodes them via a buffer), and nothing packed ahead unless
// `when_packed` (the tile set's kDirectWhenPacked).
template <class TB>
bool direct_nn(const TileNN<TB>& g, bool when_packed) {
  if (g.M > 3 || (!when_packed && (g.packed[0] || g.packed[1]))) return false;
  if constexpr (!std::is_same_v<TB, bf16>)
    if (g.b_off % TC != 0 || g.N % TC != 0) return false;
  if (g.M == 1)
    direct_nn_rows<1, 12>(g);
  else if (g.M == 2)
    direct_nn_rows<2, 6>(g);
  else
    direct_nn_rows<3, 4>(g);
  return true;
}

// Axpy form: the item's weight panel B[0..K, b_off..b_off + N) packed as the B operand (the nt layout of its
// transpose) while the first block row computes; result tile (i, j) = activation rows i·16.., output
// columns j·16... With more segments (TileNN's `second`, `f32`) their reduction blocks follow B's in the panel.
// A panel over kPanelBytes is packed and used in chunks of reduction blocks, each chunk's products added into
// C: wide items then read long contiguous pieces of each weight row whatever the reduction's length.
template <class Tiles, class TB>
void tile_nn(const TileNN<TB>& g) {
  if (g.M <= 0 || g.N <= 0) return;
  if (direct_nn(g, Tiles::kDirectWhenPacked)) return;
  // With the weights' B operand packed ahead (g.packed), block columns go in pairs to the end, as that copy
  // stores them: the panel of the other segments then has the same order, and tiles past N are not put. (An even
  // count: tile_blocks takes a lone or third block column's lanes to be in column order.)
  const bool prepacked = g.packed[0] != nullptr;
  const long np = prepacked ? (g.N + TC - 1) / TC * TC : kt::tile_rows(g.N);
  // Reduction segments in panel order: source 0 is (a, b), 1 `second`, 2 and 3 `f32`.
  struct Segment {
    int source, K, kc0, blocks;
    const bf16* a;
    long ld;
  };
  Segment seg[4];
  int nseg = 0, KC = 0;
  auto add = [&](int source, const bf16* a, int K) {
    const int blocks = int(kt::tile_ld(K) / TC);
    seg[nseg++] = {source, K, KC, blocks, a, kt::nn_ld(K)};
    KC += blocks;
  };
  add(0, g.a, g.K);
  if (g.second.a) add(1, g.second.a, g.second.K);
  for (int f = 0; f < 2; ++f)
    if (g.f32[f].a) add(2 + f, g.f32[f].a, g.f32[f].K);
  auto segment_of = [&](int kc) -> const Segment& {
    int s = 0;
    while (kc >= seg[s].kc0 + seg[s].blocks) ++s;
    return seg[s];
  };
  // Tile (j, kc) of a segment whose B operand was packed ahead (null for the others).
  auto packed_tile = [&](const Segment& s, int j, int kc) -> const bf16* {
    if (s.source > 1 || !g.packed[s.source]) return nullptr;
    return g.packed[s.source] + (long(j) * g.packed_blocks + (kc - s.kc0)) * TBLK;
  };
  const int CH = int(std::min<long>(KC, std::max<long>(1, kt::kPanelBytes / (np * TBYTES))));
  int c0 = 0, ch = CH;  // the chunk being reduced: reduction blocks [c0, c0 + ch), panel slots [0, ch)
  // Block column j of the panel starts at j · cs: its ch blocks of 1 KB and one cache line more. A pair of weight
  // rows is stored into every block column; ch KB apart (a multiple of 4 KB in any chunk of 4, 8, .. blocks)
  // those N/16 stores would fall in one L1 set (64 sets of 12 lines) and miss there. At the DeepSeek-V3 layer,
  // T = 512, the backward measured ~15% faster with the line (Layer Q, T = 2048: ~5%; BENCHMARKS.md).
  constexpr long kLine = TC;
  auto column_stride = [&] { return long(ch) * TBLK + kLine; };
  long cs = column_stride();
  thread_local isa_vector<bf16> panel, decoded;
  panel.resize((np / TR) * cs);
  decoded.resize(2 * np);
  // Tile row (k % 32) / 2 of block (j, k / 32) interleaves rows k and k + 1 of B over the block's 16 columns. A
  // pair of block columns takes unpack_pair's order; a last lone block column its 16 columns in order, by a
  // two-source permute whose element i takes column i / 2 of row k for even i and of row k + 1 (index 32 +) for odd i.
  const __m512i pair_lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                           37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  // That tile row of panel slot kc, in block column 0.
  auto pair_row = [&](int kc, long k) { return panel.data() + long(kc) * TBLK + ((k % TC) / 2) * TC; };
  // Rows k, k + 1 (32 columns each, w0 and w1) into their tile rows of the two block columns at dst; the second
  // only where the panel has it (more than 16 columns left).
  auto store_pair = [&](bf16* dst, __m512i w0, __m512i w1, long left) {
    if (left > TR || prepacked) {  // both block columns: unpacked (tile_blocks puts the results back in order)
      __m512i lo, hi;
      unpack_pair(w0, w1, lo, hi);
      _mm512_storeu_si512(dst, lo);
      _mm512_storeu_si512(dst + cs, hi);
    } else {
      _mm512_storeu_si512(dst, _mm512_permutex2var_epi16(w0, pair_lo, w1));
    }
  };
  // Rows k, k + 1 of a segment's B (K rows; null past K) into their tile row of panel slot kc, 32 columns (one
  // 64-byte load per row) at a time: the backward 4-11% faster than 16-column loads at Layer Q and the
  // DeepSeek-V3 layer on AMX (BENCHMARKS.md).
  auto pack_pair = [&](int kc, long k, const bf16* r0, const bf16* r1) {
    bf16* dst = pair_row(kc, k);
    for (long c = 0; c < g.N; c += TC, dst += 2 * cs) {
      const __mmask32 mask = first32(g.N - c);
      store_pair(dst, r0 ? _mm512_maskz_loadu_epi16(mask, r0 + c) : _mm512_setzero_si512(),
                 r1 ? _mm512_maskz_loadu_epi16(mask, r1 + c) : _mm512_setzero_si512(), g.N - c);
    }
  };
  // Quantized rows k, k + 1 whose segment is whole 32-column steps (each inside one block or group): decoded
  // 32 columns at a time straight into registers and interleaved there, instead of a round trip through
  // `decoded` and pack_pair's loads.
  auto pack_decoded_pair = [&](const auto& b, int K, int kc, long k) {
    bf16* dst = pair_row(kc, k);
    const auto r0 = cursor<Simd>(b, std::min<long>(k, K - 1)), r1 = cursor<Simd>(b, std::min<long>(k + 1, K - 1));
    for (long c = 0; c < g.N; c += TC, dst += 2 * cs)
      store_pair(dst, k < K ? bf16x32(r0, g.b_off + c) : _mm512_setzero_si512(),
                 k + 1 < K ? bf16x32(r1, g.b_off + c) : _mm512_setzero_si512(), g.N - c);
  };
  // Rows of a segment, a reduction block of them: each row is read (or decoded) once per item as one contiguous
  // segment of N columns; float32 rows (f32: LoRA A) times the segment's scale. The rows lie a page or more
  // apart, out of the hardware prefetchers' reach: the rows two reduction blocks ahead (BF16 values, FP8 or INT4
  // codes with their scales) are requested into L2 while this one is packed (BF16 at the DeepSeek-V3 layer, T =
  // 4096: backward ~10% faster than requesting the next block's into L1, which was as fast at Layer Q; none:
  // slower at both. The quantized rows' requests were compiled out by GCC 12 until request_line: since, on Zen 4
  // at Layer Q, T = 512, INT4's backward 22-36% faster, FP8's `dout·W_down` 22-35%; BENCHMARKS.md).
  auto pack_weights = [&](const auto& b, int K, int kc, long k0, float scale) {
    using RowsOf = std::decay_t<decltype(b)>;
    constexpr bool quantized =
        std::is_same_v<RowsOf, kt::Rows<fp8_block>> || std::is_same_v<RowsOf, kt::Rows<int4_group>>;
    for (long k = k0; k < k0 + TC; k += 2) {
      if constexpr (!std::is_same_v<RowsOf, kt::Rows<float>>)
        for (long row = k + 2 * TC; row < std::min<long>(k + 2 * TC + 2, K); ++row) request_row(b, row, g.b_off, g.N);
      if constexpr (quantized)
        if (g.b_off % TC == 0 && g.N % TC == 0) {
          pack_decoded_pair(b, K, kc, k);
          continue;
        }
      pack_pair(kc, k, k < K ? row_bf16(b, k, g.b_off, g.N, decoded.data(), scale) : nullptr,
                k + 1 < K ? row_bf16(b, k + 1, g.b_off, g.N, decoded.data() + np, scale) : nullptr);
    }
  };
  // Reduction block c0 + kc of every block column at once, when the first block column asks for it. A segment
  // packed ahead has nothing to pack: block column j's tile two reduction blocks on (the tiles of a block column
  // lie in a row, 1 KB each) is requested into L2 as the first block row reaches this one. On the GPU machine two
  // blocks on ran the DeepSeek-V3 layer's backward as fast as four or six and faster than none, and requesting every
  // block column's tiles when the first block column reaches a block (as the packing reads its rows) was slower
  // (BENCHMARKS.md, fourth session of 2026-12-05).
  auto make_b = [&](int j, int kc) {
    const Segment& s = segment_of(c0 + kc);
    if (packed_tile(s, j, c0 + kc)) {
      if (c0 + kc + 2 < s.kc0 + s.blocks)
        for (int l = 0; l < TR; ++l) request_line(packed_tile(s, j, c0 + kc + 2) + l * TC);
      return;
    }
    if (j != 0) return;
    const long k0 = long(c0 + kc - s.kc0) * TC;
    if (s.source == 0)
      pack_weights(g.b, g.K, kc, k0, 1.f);
    else if (s.source == 1)
      pack_weights(g.second.b, g.second.K, kc, k0, 1.f);
    else {
      const auto& f = g.f32[s.source - 2];
      pack_weights(f.b, f.K, kc, k0, f.scale);
    }
  };
  // The next product's weight rows (g.next) are requested into L2 while this one computes, spread over the
  // steps of all its chunks.
  const int IB = int(kt::tile_rows(g.M) / TR), JB = int(np / TR);
  const long passes = column_passes<Tiles>(JB), total = long((IB + 1) / 2) * passes * KC;
  auto ahead = [&](int i, long step, long steps) {
    request_share(g.next, long((IB + 1) / 2) * passes * c0 + long(i / 2) * steps + step, total);
  };
  for (; c0 < KC; c0 += CH) {
    ch = std::min(CH, KC - c0);
    cs = column_stride();
    tile_blocks<Tiles>(
        IB, JB, g.M, g.N, ch, [&](int kc) { return segment_of(c0 + kc).ld * 2; }, TBYTES,
        [&](int i, int kc) {
          const Segment& s = segment_of(c0 + kc);
          return s.a + long(i) * TR * s.ld + long(c0 + kc - s.kc0) * TC;
        },
        [&](int j, int kc) {
          const bf16* ahead_of_call = packed_tile(segment_of(c0 + kc), j, c0 + kc);
          return ahead_of_call ? ahead_of_call : panel.data() + long(j) * cs + long(kc) * TBLK;
        },
        make_b, ahead,
        [&](int i, int j, const float* t) {
          if (j * TR >= g.N) return;
          put_tile(t, false, i * TR, std::min(TR, g.M - i * TR), j * TR, std::min(TR, g.N - j * TR), g.c, g.ldc,
                   g.accumulate || c0 > 0, g.alpha, g.stream && CH == KC);
        },
        true);
  }
  if (g.stream) _mm_sfence();
}

template <class Tiles>
const kt::TileKernels& tile_kernels(bool emulated) {
  static const kt::TileKernels t{pack_nt,
                                 pack_nn,
                                 tile_nt<Tiles, bf16>,
                                 tile_nt<Tiles, fp8_block>,
                                 tile_nt<Tiles, int4_group>,
                                 tile_nn<Tiles, bf16>,
                                 tile_nn<Tiles, fp8_block>,
                                 tile_nn<Tiles, int4_group>,
                                 tile_nt<Tiles, float>,
                                 tile_nn<Tiles, float>,
                                 emulated};
  return t;
}

}  // namespace
