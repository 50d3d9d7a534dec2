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
  // The tile intrinsics take register numbers as literals, hence one function per use.
  static void zero_acc() {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  }
  static void load_a0(const void* p, long stride) { _tile_loadd(4, p, stride); }
  static void load_a1(const void* p, long stride) { _tile_loadd(5, p, stride); }
  static void load_b0(const void* p, long stride) { _tile_loadd(6, p, stride); }
  static void load_b1(const void* p, long stride) { _tile_loadd(7, p, stride); }
  static void dp00() { _tile_dpbf16ps(0, 4, 6); }
  static void dp01() { _tile_dpbf16ps(1, 4, 7); }
  static void dp10() { _tile_dpbf16ps(2, 5, 6); }
  static void dp11() { _tile_dpbf16ps(3, 5, 7); }
  static void store_acc(int q, void* p, long stride) {
    switch (q) {
      case 0: _tile_stored(0, p, stride); break;
      case 1: _tile_stored(1, p, stride); break;
      case 2: _tile_stored(2, p, stride); break;
      default: _tile_stored(3, p, stride); break;
    }
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
