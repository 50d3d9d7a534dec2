// The tile-unit products of kernels.h (TileKernels), written once on a `Tiles` policy: amx.cpp passes the
// AMX instructions. Include after a simd_*.h header and kernel_body.h (widen_row decodes weight rows).
//
// Tiles: four accumulators hold a 2×2 block of 16×16 float32 results (acc q = block (q/2, q%2)), a0/a1 the
// A operands of its two block rows (16 rows × 32 BF16), b0/b1 the B operands of its two block columns (16
// pairs of k × 16 columns × 2); dpIJ accumulates aI·bJ. One pass over K per 32×32 result block; every
// output element is reduced by the tile unit in one fixed order, whatever the thread that computes it.
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

// Where element (m, k) of the nt layout sits, relative to the start of its matrix.
inline long nt_index(long m, long k, long kblocks) {
  return ((m / TR) * kblocks + k / TC) * TBLK + ((k % TC) / 2) * TC + (m % TR) * 2 + k % 2;
}

void pack_nt(int M, int K, long k0, long klen, kt::Rows<float> a, bf16* dst) {
  const long ld = kt::tile_ld(K), kend = k0 + klen == K ? ld : k0 + klen;
  for (long m = 0; m < kt::tile_rows(M); ++m) {
    const float* src = m < M ? a.at(m) : nullptr;
    for (long k = k0; k < kend; ++k)
      dst[nt_index(m, k, ld / TC)] = src && k < k0 + klen ? kt::f32_to_bf16(src[k]) : bf16(0);
  }
}

void pack_nn(int M, int K, long k0, long klen, kt::Rows<float> a, bf16* dst) {
  const long ld = kt::tile_ld(K), kend = k0 + klen == K ? ld : k0 + klen;
  for (long m = 0; m < kt::tile_rows(M); ++m) {
    bf16* row = dst + m * ld;
    if (m < M) f32_to_bf16(klen, a.at(m) + k0, row + k0);
    std::fill(row + (m < M ? k0 + klen : k0), row + kend, bf16(0));
  }
}

// Row i of B, columns [col0, col0 + len), as BF16: copied for BF16 weights, decoded and rounded once for
// quantized ones (a weight × its block or group scale, in float32, to the nearest BF16).
template <class TB>
void row_bf16(const kt::Rows<TB>& b, long i, long col0, long len, bf16* dst, std::vector<float>& wide) {
  if constexpr (std::is_same_v<TB, bf16>) {
    std::copy(b.at(i) + col0, b.at(i) + col0 + len, dst);
  } else {
    wide.resize(len);
    widen_row(b, i, col0, len, wide.data());
    f32_to_bf16(len, wide.data(), dst);
  }
}

// Stores one 16×16 result tile `t` (row-major, as the tile unit writes it) to C at (m0, n0), keeping the
// mr × nr part inside C; with `transposed`, t holds the result's columns as its rows.
void put_tile(const float* t, bool transposed, int m0, int mr, int n0, int nr, float* c, long ldc, bool accumulate) {
  for (int i = 0; i < mr; ++i) {
    float* row = c + long(m0 + i) * ldc + n0;
    for (int j = 0; j < nr; ++j) {
      const float v = transposed ? t[j * TR + i] : t[i * TR + j];
      row[j] = accumulate ? row[j] + v : v;
    }
  }
}

// The 2×2 block loop shared by both forms. a_tile(i, kc) / b_tile(j, kc) point at A block-row i and B
// block-column j of reduction block kc, with their row strides in bytes; tile (i, j) of the result
// covers rows i·16.. and columns j·16.. of the product A·B, which `put(i, j, t)` stores.
template <class Tiles, class ATile, class BTile, class Put>
void tile_blocks(int IB, int JB, int KC, long a_stride, long b_stride, ATile a_tile, BTile b_tile, Put put) {
  alignas(64) float t[TR * TR];
  Tiles::begin();
  for (int i = 0; i < IB; i += 2) {
    const bool i2 = i + 1 < IB;
    for (int j = 0; j < JB; j += 2) {
      const bool j2 = j + 1 < JB;
      Tiles::zero_acc();
      for (int kc = 0; kc < KC; ++kc) {
        Tiles::load_a0(a_tile(i, kc), a_stride);
        Tiles::load_b0(b_tile(j, kc), b_stride);
        Tiles::dp00();
        if (j2) {
          Tiles::load_b1(b_tile(j + 1, kc), b_stride);
          Tiles::dp01();
        }
        if (i2) {
          Tiles::load_a1(a_tile(i + 1, kc), a_stride);
          Tiles::dp10();
          if (j2) Tiles::dp11();
        }
      }
      for (int q = 0; q < 4; ++q) {
        const int di = q / 2, dj = q % 2;
        if ((di && !i2) || (dj && !j2)) continue;
        Tiles::store_acc(q, t, TR * 4);
        put(i + di, j + dj, t);
      }
    }
  }
}

// Dot form, transposed: result tile (i, j) = weight rows i·16.., activation rows j·16...
template <class Tiles, class TB>
void tile_nt(const TileNT<TB>& g) {
  if (g.M <= 0 || g.N <= 0) return;
  const long ld = kt::tile_ld(g.K);
  const bf16* w = nullptr;
  long ldw = ld;
  if constexpr (std::is_same_v<TB, bf16>)
    if (!g.b.ptrs && g.N % TR == 0 && g.K % TC == 0) w = g.b.base, ldw = g.b.ld;
  thread_local std::vector<bf16> panel;
  thread_local std::vector<float> wide;
  if (!w) {  // decoded rows, zeros past N and K: tile loads never leave the panel
    panel.assign(kt::tile_rows(g.N) * ld, bf16(0));
    for (long n = 0; n < g.N; ++n) row_bf16(g.b, n, 0, g.K, panel.data() + n * ld, wide);
    w = panel.data();
  }
  const int KC = int(ld / TC);
  tile_blocks<Tiles>(
      int(kt::tile_rows(g.N) / TR), int(kt::tile_rows(g.M) / TR), KC, ldw * 2, TBYTES,
      [&](int i, int kc) { return w + long(i) * TR * ldw + kc * TC; },
      [&](int j, int kc) { return g.a + (long(j) * KC + kc) * TBLK; },
      [&](int i, int j, const float* t) {
        put_tile(t, true, j * TR, std::min(TR, g.M - j * TR), i * TR, std::min(TR, g.N - i * TR), g.c, g.ldc,
                 g.accumulate);
      });
}

// Axpy form: the item's weight panel B[0..K, b_off..b_off + N) packed as the B operand (the nt layout of
// its transpose), then result tile (i, j) = activation rows i·16.., output columns j·16...
template <class Tiles, class TB>
void tile_nn(const TileNN<TB>& g) {
  if (g.M <= 0 || g.N <= 0) return;
  const long ld = kt::tile_ld(g.K), np = kt::tile_rows(g.N);
  const int KC = int(ld / TC);
  thread_local std::vector<bf16> panel, rows;
  thread_local std::vector<float> wide;
  panel.resize(np * ld);
  rows.assign(2 * np, bf16(0));
  for (long k = 0; k < ld; k += 2) {
    for (int h = 0; h < 2; ++h)
      if (k + h < g.K) row_bf16(g.b, k + h, g.b_off, g.N, rows.data() + h * np, wide);
      else std::fill_n(rows.data() + h * np, g.N, bf16(0));
    for (long n = 0; n < np; ++n) {
      bf16* d = panel.data() + nt_index(n, k, KC);
      d[0] = rows[n];
      d[1] = rows[np + n];
    }
  }
  tile_blocks<Tiles>(
      int(kt::tile_rows(g.M) / TR), int(np / TR), KC, ld * 2, TBYTES,
      [&](int i, int kc) { return g.a + long(i) * TR * ld + kc * TC; },
      [&](int j, int kc) { return panel.data() + (long(j) * KC + kc) * TBLK; },
      [&](int i, int j, const float* t) {
        put_tile(t, false, i * TR, std::min(TR, g.M - i * TR), j * TR, std::min(TR, g.N - j * TR), g.c, g.ldc,
                 g.accumulate);
      });
}

template <class Tiles>
const kt::TileKernels& tile_kernels() {
  static const kt::TileKernels t{pack_nt,
                                 pack_nn,
                                 tile_nt<Tiles, bf16>,
                                 tile_nt<Tiles, fp8_block>,
                                 tile_nt<Tiles, int4_group>,
                                 tile_nn<Tiles, bf16>,
                                 tile_nn<Tiles, fp8_block>,
                                 tile_nn<Tiles, int4_group>};
  return t;
}

}  // namespace
