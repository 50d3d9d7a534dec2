// Kernel set for AMX (Sapphire Rapids and later): the AVX-512 kernels, plus the tile-unit products of tile_body.h for
// BF16 activations and, for FP8 and INT4 weights off the tiles, the dot form of quantized_bf16_dot.h. The OS must have
// granted the tile state to the process first (dispatch.cpp asks); each product loads the tile configuration itself,
// since other libraries on the same thread (oneDNN) load their own.
#include "simd_avx512.h"
#include "kernel_body.h"
#include "tile_body.h"
#include "quantized_bf16_dot.h"

namespace {

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

struct AmxTiles {
  static void begin() {
    static const TileConfig cfg = [] {
      TileConfig c;
      for (int t = 0; t < 8; ++t) c.colsb[t] = TBYTES, c.rows[t] = TR;
      return c;
    }();
    _tile_loadconfig(&cfg);
  }
  // Tile registers 0-3 accumulate the four results, 4 and 5 hold the A operands, 6 and 7 the B operands (the
  // intrinsics take register numbers as literals): one or two block columns at a time. The counts of valid A rows
  // and B lanes go unused: the tiles are configured once, full.
  static constexpr int kColumnBlocks = 2;
  // 1-3 rows without the panel (tile_body.h, direct_nn; runtime.h) whether or not the backward copy packed it: the
  // tile unit rounds its sums otherwise than direct_nn's vdpbf16ps, and the copy's results stay bit-identical.
  static constexpr bool kDirectWhenPacked = true;
  template <class Before, class ATile, class AStride, class BTile>
  static void block(bool i2, int nj, int, int, int KC, Before before, ATile a_tile, AStride a_stride, BTile b_tile,
                    long b_stride, float (*t)[TR * TR]) {
    const bool j2 = nj == 2;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    // A step's four loads before its four products: on the GPU test machine's Xeon, alternated with each load just
    // before its first product on each CPU, the loop ran 2-5% faster on quiet cores, 0-4% on contended ones
    // (BENCHMARKS.md).
    for (int kc = 0; kc < KC; ++kc) {
      before(kc);
      _tile_loadd(4, a_tile(0, kc), a_stride(kc));
      _tile_loadd(6, b_tile(0, kc), b_stride);
      if (j2) _tile_loadd(7, b_tile(1, kc), b_stride);
      if (i2) _tile_loadd(5, a_tile(1, kc), a_stride(kc));
      _tile_dpbf16ps(0, 4, 6);
      if (j2) _tile_dpbf16ps(1, 4, 7);
      if (i2) {
        _tile_dpbf16ps(2, 5, 6);
        if (j2) _tile_dpbf16ps(3, 5, 7);
      }
    }
    constexpr long stride = TR * sizeof(float);
    _tile_stored(0, t[0], stride);
    if (j2) _tile_stored(1, t[1], stride);
    if (i2) _tile_stored(2, t[2], stride);
    if (i2 && j2) _tile_stored(3, t[3], stride);
  }
};

}  // namespace

namespace kt {
const KernelSet& kernels_amx() {
  static const KernelSet set = [] {
    KernelSet s = make_kernel_set("amx");
    use_quantized_bf16_dot(s, true);
    s.tiles = &tile_kernels<AmxTiles>(false);
    return s;
  }();
  return set;
}
}  // namespace kt
