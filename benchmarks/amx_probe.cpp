// The tile unit's ceiling on this CPU, for the loop tile_body.h runs (a 2×2 block of 16×16 results, one
// reduction step = 2 A tiles + 2 B tiles loaded, 4 tdpbf16ps): ns per tdpbf16ps (16·16·32 multiply-adds)
// with no loads, with loads from L1, and over the work items of the forward (64 weight rows × 128 token rows,
// K = 2048 or 768), weights read in place from rows (strided, as the engine does) or from packed 1 KB tiles,
// hot in L2 or streamed from memory. Every thread runs its own copy. `percpu` runs the first two loops on each
// CPU in turn, alone, three times over, the 2x2 loop in two orders alternated (each load just before its first
// product, or a step's four loads first): on shared cloud hosts the loop with loads has run ~4x slower on some
// CPUs than on others, which ones changing from second to second, while tdpbf16ps alone ran alike on all
// (BENCHMARKS.md).
//   g++ -O2 -mamx-tile -mamx-bf16 -mavx512f -pthread benchmarks/amx_probe.cpp -o /tmp/amx_probe
//   /tmp/amx_probe 1 && /tmp/amx_probe 16          # argument: threads
//   /tmp/amx_probe percpu
#include <immintrin.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>
#include <algorithm>
typedef uint16_t bf16;
struct alignas(64) Cfg { uint8_t p = 1, s = 0, r[14] = {}; uint16_t c[16] = {}; uint8_t rows[16] = {}; };
static void cfg() { Cfg c; for (int t = 0; t < 8; ++t) c.c[t] = 64, c.rows[t] = 16; _tile_loadconfig(&c); }
static double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

// 64-byte aligned bf16 ones: a tile row that straddles two cache lines loads about 2x slower.
struct Buf {
  std::vector<bf16> v;
  bf16* p;
  explicit Buf(size_t n) : v(n + 32, 0x3f80), p(v.data() + (32 - (uintptr_t(v.data()) % 64) / 2) % 32) {}
  bf16* data() { return p; }
};

// mode 0: dp only. 1: L1 loads. 2: item strided A (in place weights) 3: item packed A
// weights: per item 64 rows x K; activations 128 x K packed nt
static double run(int mode, int K, long witems, int reps, bool put) {
  cfg();
  const int KC = K / 32, IB = 4, JB = 8;
  Buf X(size_t(JB) * 16 * K), W(size_t(witems) * 64 * K);
  alignas(64) float t[256];
  float sink = 0;
  double t0 = now();
  long dps = 0;
  for (int rep = 0; rep < reps; ++rep) {
    if (mode == 0) {
      for (long it = 0; it < 100000; ++it) { _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7); }
      dps += 400000; continue;
    }
    if (mode == 1) {
      for (long it = 0; it < 100000; ++it) {
        _tile_loadd(4, X.data(), 64); _tile_loadd(6, X.data() + 512, 64); _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(7, X.data() + 1024, 64); _tile_dpbf16ps(1, 4, 7);
        _tile_loadd(5, X.data() + 1536, 64); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
      }
      dps += 400000; continue;
    }
    if (mode == 6) {  // the same, a step's four loads first (amx.cpp's order since 7512fe8)
      for (long it = 0; it < 100000; ++it) {
        _tile_loadd(4, X.data(), 64); _tile_loadd(6, X.data() + 512, 64); _tile_loadd(7, X.data() + 1024, 64);
        _tile_loadd(5, X.data() + 1536, 64);
        _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
      }
      dps += 400000; continue;
    }
    for (long item = 0; item < witems; ++item) {
      const bf16* w = W.data() + item * 64 * K;
      for (int i = 0; i < IB; i += 2)
        for (int j = 0; j < JB; j += 2) {
          _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
          for (int kc = 0; kc < KC; ++kc) {
            if (mode == 2) {
              _tile_loadd(4, w + long(i) * 16 * K + kc * 32, K * 2);
              _tile_loadd(5, w + long(i + 1) * 16 * K + kc * 32, K * 2);
            } else {
              _tile_loadd(4, w + (long(i) * KC + kc) * 512, 64);
              _tile_loadd(5, w + (long(i + 1) * KC + kc) * 512, 64);
            }
            _tile_loadd(6, X.data() + (long(j) * KC + kc) * 512, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_loadd(7, X.data() + (long(j + 1) * KC + kc) * 512, 64);
            _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
          }
          if (put) {
            _tile_stored(0, t, 64); sink += t[3]; _tile_stored(1, t, 64); sink += t[5];
            _tile_stored(2, t, 64); sink += t[7]; _tile_stored(3, t, 64); sink += t[9];
          }
          dps += 4 * KC;
        }
    }
  }
  double dt = now() - t0;
  if (sink == 12345) printf("x");
  return dt / dps * 1e9;  // ns per dp
}

int main(int argc, char** argv) {
  syscall(SYS_arch_prctl, 0x1023, 18);
  if (argc > 1 && !strcmp(argv[1], "percpu")) {
    const int ncpu = int(std::thread::hardware_concurrency());
    for (int pass = 0; pass < 3; ++pass)
      for (int cpu = 0; cpu < ncpu; ++cpu)
        std::thread([&] {
          cpu_set_t set;
          CPU_ZERO(&set);
          CPU_SET(cpu, &set);
          sched_setaffinity(0, sizeof set, &set);
          run(1, 2048, 1, 1, false);
          std::vector<double> l1, first;  // the two orders alternated, so both meet the CPU's same spells
          for (int rep = 0; rep < 7; ++rep) l1.push_back(run(1, 2048, 1, 1, false)), first.push_back(run(6, 2048, 1, 1, false));
          std::sort(l1.begin(), l1.end());
          std::sort(first.begin(), first.end());
          const double dp = run(0, 2048, 1, 3, false);
          printf("pass %d cpu %2d: dp-only %.2f ns/dp, L1 2x2 %.2f ns/dp (%.1fx), loads first %.2f (medians of 7)\n", pass,
                 cpu, dp, l1[3], l1[3] / dp, first[3]);
        }).join();
    return 0;
  }
  int threads = atoi(argv[1]);
  const char* names[] = {"dp-only", "L1 2x2", "items strided A (L2 hot)", "items packed A (L2 hot)",
                         "items strided A (DRAM)", "items packed A (DRAM)"};
  for (int K : {2048, 768}) {
    for (int v = 0; v < 6; ++v) {
      if (K == 768 && v < 2) continue;
      std::vector<double> res(threads);
      std::vector<std::thread> th;
      for (int ti = 0; ti < threads; ++ti)
        th.emplace_back([&, ti] {
          int mode = v < 2 ? v : (v % 2 == 0 ? 2 : 3);
          long witems = v >= 4 ? 256L * 2048 / K : 1;
          int reps = v < 2 ? 3 : (v >= 4 ? 2 : 200);
          run(mode, K, witems, 1, false);
          res[ti] = run(mode, K, witems, reps, true);
        });
      for (auto& x : th) x.join();
      std::sort(res.begin(), res.end());
      double ns = res[threads / 2];
      printf("K=%d thr=%d %-28s %.2f ns/dp  = %.0f GFLOP/s/core  x%d = %.2f TFLOP/s\n", K, threads, names[v], ns,
             16384 / ns, threads, 16384 / ns * threads / 1000);
    }
  }
}
