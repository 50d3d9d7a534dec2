// Variants of the AMX 2×2 reduction step (tile_body.h: 2 A + 2 B tile loads, 4 tdpbf16ps), all operands in L1,
// tiles filled with zeros, ones or random BF16 values: products alone, loads alone, the engine's order, loads
// before products, a double-buffered 1×2 block, one load per two products, stream loads. ns per tdpbf16ps (or
// per load), the median thread. Every thread runs its own copy.
//   g++ -O2 -mamx-tile -mamx-bf16 -mavx512f -pthread benchmarks/tile_order_probe.cpp -o /tmp/tile_order_probe
//   /tmp/tile_order_probe 16 && /tmp/tile_order_probe 8          # argument: threads
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>
#include <algorithm>
#include <random>
typedef uint16_t bf16;
struct alignas(64) Cfg { uint8_t p = 1, s = 0, r[14] = {}; uint16_t c[16] = {}; uint8_t rows[16] = {}; };
static void cfg() { Cfg c; for (int t = 0; t < 8; ++t) c.c[t] = 64, c.rows[t] = 16; _tile_loadconfig(&c); }
static double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
static const int N = 1000000;
static double run(int v, int fill) {
  cfg();
  alignas(64) static thread_local bf16 X[20 * 512];
  std::mt19937 rng(1);
  for (int i = 0; i < 16 * 512; ++i) X[i] = fill == 0 ? 0 : fill == 1 ? 0x3f80 : (0x3f00 | (rng() & 0xff)) ^ ((rng() & 1) << 15);
  _tile_loadd(4, X, 64); _tile_loadd(5, X + 512, 64); _tile_loadd(6, X + 1024, 64); _tile_loadd(7, X + 1536, 64);
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  double t0 = now();
  long dps = 0;
  for (long it = 0; it < N; ++it) {
    const bf16* p = X + (it & 3) * 2048;  // cycle through 16 KB
    switch (v) {
      case 0: _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7); dps += 4; break;
      case 1:
        _tile_loadd(4, X, 64); _tile_loadd(6, X + 512, 64); _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(7, X + 1024, 64); _tile_dpbf16ps(1, 4, 7);
        _tile_loadd(5, X + 1536, 64); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7); dps += 4; break;
      case 2: _tile_loadd(4, p, 64); _tile_loadd(6, p + 512, 64); _tile_loadd(7, p + 1024, 64); _tile_loadd(5, p + 1536, 64); break;
      case 3:
        _tile_loadd(4, p, 64); _tile_loadd(6, p + 512, 64); _tile_loadd(7, p + 1024, 64); _tile_loadd(5, p + 1536, 64);
        _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7); dps += 4; break;
      case 4:  // double-buffered 1x2
        _tile_loadd(2, p, 64); _tile_loadd(4, p + 512, 64); _tile_loadd(5, p + 1024, 64);
        _tile_dpbf16ps(0, 2, 4); _tile_dpbf16ps(1, 2, 5);
        _tile_loadd(3, p + 1536, 64); _tile_loadd(6, p + 2048 - 0, 64); _tile_loadd(7, p + 512 + 0, 64);
        _tile_dpbf16ps(0, 3, 6); _tile_dpbf16ps(1, 3, 7); dps += 4; break;
      case 5:  // one load per iteration only (A), 2 dps
        _tile_loadd(4, p, 64); _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); dps += 2; break;
      case 6:  // loads only, one register
        _tile_loadd(4, p, 64); break;
      case 7:  // 2x2 cycling addresses
        _tile_loadd(4, p, 64); _tile_loadd(6, p + 512, 64); _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(7, p + 1024, 64); _tile_dpbf16ps(1, 4, 7);
        _tile_loadd(5, p + 1536, 64); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7); dps += 4; break;
      case 8:  // tile_stream_loadd (T1 hint) 2x2
        _tile_stream_loadd(4, p, 64); _tile_stream_loadd(6, p + 512, 64); _tile_dpbf16ps(0, 4, 6);
        _tile_stream_loadd(7, p + 1024, 64); _tile_dpbf16ps(1, 4, 7);
        _tile_stream_loadd(5, p + 1536, 64); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7); dps += 4; break;
    }
  }
  double dt = now() - t0;
  alignas(64) float t[256];
  _tile_stored(0, t, 64);
  if (t[0] == 12345.f) printf("x");
  long units = dps ? dps : (v == 2 ? 4L * N : N);
  return dt / units * 1e9;
}
int main(int argc, char** argv) {
  if (syscall(SYS_arch_prctl, 0x1023, 18)) { printf("no AMX permission\n"); return 1; }
  int threads = atoi(argv[1]);
  const char* names[] = {"dp only", "2x2 (engine order, same addr)", "loads only (4 regs)", "2x2 loads first",
                         "1x2 double-buffered", "1 load + 2 dp", "loads only (1 reg)", "2x2 engine order, cycling",
                         "2x2 stream loads"};
  for (int fill = 0; fill < 3; ++fill)
    for (int v = 0; v < 9; ++v) {
      if (fill != 2 && v != 0 && v != 1) continue;
      std::vector<double> res(threads);
      std::vector<std::thread> th;
      for (int ti = 0; ti < threads; ++ti)
        th.emplace_back([&, ti] { run(v, fill); res[ti] = run(v, fill); });
      for (auto& x : th) x.join();
      std::sort(res.begin(), res.end());
      printf("thr=%2d fill=%d %-32s %7.2f ns per %s\n", threads, fill, names[v], res[threads / 2],
             (v == 2 || v == 6) ? "load" : "dp");
    }
}
