// What limits the backward's weight-panel reads (an axpy-form item reads a segment of `run` bytes from each
// of 768 weight rows lying 4 KB apart, as dx reads W_gate / W_up at Layer Q): each thread reads its own
// weight stacks (far larger than the caches) item by item, in 4 KB or 2 MB pages, alone or with every thread
// at once; then with tile products between the items, the next item's rows read after them ("after") or
// requested into L2 a share per product while they run ("ahead", as Runtime::parallel_for_ahead does).
//   g++ -O2 -mamx-tile -mamx-bf16 -mavx512f -pthread benchmarks/panel_probe.cpp -o /tmp/panel_probe
//   /tmp/panel_probe 15                            # argument: threads of the all-at-once rows
#include <immintrin.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

constexpr long kRows = 768, kRowBytes = 4096, kMatrix = kRows * kRowBytes, kStack = 24 * kMatrix;  // 72 MB
struct alignas(64) Cfg { uint8_t p = 1, s = 0, r[14] = {}; uint16_t c[16] = {}; uint8_t rows[16] = {}; };
static double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

// compute: tile products per item; ahead: how the next item's rows are read (Ahead)
enum Ahead { kAfter, kSpreadT1, kSpreadT0, kBurstT1, kHot };
struct Config { long run; bool huge; int compute; Ahead ahead; };

static void tiles_on() {
  syscall(SYS_arch_prctl, 0x1023, 18);  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
  Cfg cfg;
  for (int t = 0; t < 8; ++t) cfg.c[t] = 64, cfg.rows[t] = 16;
  _tile_loadconfig(&cfg);
}

static char* stack(bool huge) {
  void* p = nullptr;
  if (posix_memalign(&p, 2 << 20, kStack)) abort();
  madvise(p, kStack, huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
  memset(p, 1, kStack);
  return static_cast<char*>(p);
}

// Item i: rows 0..767 of matrix i % 24, the i-th `run`-byte column segment of them.
static const char* item(const char* base, long i, long run) {
  return base + (i % 24) * kMatrix + ((i / 24) % (kRowBytes / run)) * run;
}

static __m512i read_item(const char* p, long run, __m512i acc) {
  for (long k = 0; k < kRows; ++k)
    for (long o = 0; o < run; o += 64) acc = _mm512_add_epi32(acc, _mm512_load_si512(p + k * kRowBytes + o));
  return acc;
}

static void request(const char* next, long run, long from, long to, bool t0) {
  for (long l = from; l < to; ++l) {
    const char* a = next + (l / (run / 64)) * kRowBytes + (l % (run / 64)) * 64;
    if (t0) _mm_prefetch(a, _MM_HINT_T0); else _mm_prefetch(a, _MM_HINT_T1);
  }
}

// `n` tile products (operands in registers); the next item's lines requested all first (kBurstT1) or a share
// every 8 products (kSpread*).
static void products(int n, const char* next, long run, Ahead ahead) {
  const long lines = kRows * run / 64;
  if (ahead == kBurstT1) request(next, run, 0, lines, false);
  for (int s = 0; s < n; s += 8) {
    for (int q = 0; q < 8; q += 4) { _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7); }
    if (ahead == kSpreadT1 || ahead == kSpreadT0)
      request(next, run, s * lines / n, std::min<long>(n, s + 8) * lines / n, ahead == kSpreadT0);
  }
}

static double products_alone(int n, int threads) {
  std::vector<double> us(threads);
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      tiles_on();
      const double t0 = now();
      for (int i = 0; i < 100; ++i) products(n, nullptr, 64, kAfter);
      us[t] = (now() - t0) / 100 * 1e6;
      _tile_release();
    });
  for (auto& th : pool) th.join();
  double sum = 0;
  for (double u : us) sum += u;
  return sum / threads;
}

static double thread_run(const Config& c, int items, double* sink) {
  tiles_on();
  char* base = stack(c.huge);
  __m512i acc = _mm512_setzero_si512();
  for (int i = 0; i < 48; ++i) acc = read_item(item(base, i, c.run), c.run, acc);  // page tables warm
  const double t0 = now();
  for (int i = 0; i < items; ++i) {
    const long at = c.ahead == kHot ? 0 : i;  // kHot: the same item every time, read from L2
    acc = read_item(item(base, at, c.run), c.run, acc);
    if (c.compute) products(c.compute, item(base, at + 1, c.run), c.run, c.ahead);
  }
  const double t = now() - t0;
  *sink = _mm512_reduce_add_epi32(acc);
  free(base);
  _tile_release();
  return t / items * 1e6;  // µs per item
}

static double all_threads(const Config& c, int threads, int items) {
  std::vector<double> us(threads), sink(threads);
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) pool.emplace_back([&, t] { us[t] = thread_run(c, items, &sink[t]); });
  for (auto& th : pool) th.join();
  double sum = 0;
  for (double u : us) sum += u;
  return sum / threads;
}

int main(int argc, char** argv) {
  const int threads = argc > 1 ? atoi(argv[1]) : 15;
  printf("reads only: µs per item (GB/s per thread); 1 thread | %d threads\n", threads);
  for (bool huge : {false, true})
    for (long run : {512L, 1024L, 2048L, 4096L}) {
      const Config c{run, huge, 0, kAfter};
      const double one = all_threads(c, 1, 400), many = all_threads(c, threads, 400);
      printf("  run %4ld B, %s pages: %7.1f (%5.2f) | %7.1f (%5.2f)\n", run, huge ? "2 MB" : "4 KB", one,
             kRows * run / one / 1e3, many, kRows * run / many / 1e3);
    }
  printf("reads + tile products (twice the reads' time), %d threads: µs per item\n", threads);
  for (bool huge : {false, true})
    for (long run : {512L, 2048L}) {
      const double reads = all_threads({run, huge, 0, kAfter}, threads, 300);
      const int n = int(2 * reads * 1e3 / 6.0);  // ~6 ns per product with every thread on its tile unit
      printf("  run %4ld B, %s pages: reads %6.1f, products alone %6.1f; next item read after %6.1f, requested "
             "(T1 spread %6.1f, T0 spread %6.1f, T1 at once %6.1f); the same item (L2) %6.1f\n", run,
             huge ? "2 MB" : "4 KB", reads, products_alone(n, threads), all_threads({run, huge, n, kAfter}, threads, 200),
             all_threads({run, huge, n, kSpreadT1}, threads, 200), all_threads({run, huge, n, kSpreadT0}, threads, 200),
             all_threads({run, huge, n, kBurstT1}, threads, 200), all_threads({run, huge, n, kHot}, threads, 200));
    }
}
