// Process-wide state shared by every layer's experts: one thread pool, the kernel set, the driver
// queue for asynchronous calls, and one scratch workspace. All engine calls run on the driver
// thread one at a time, so layers can share the scratch without locks.
#pragma once
#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "../kernels/kernels.h"
#include "../threadpool/async_queue.h"
#include "../threadpool/threadpool.h"

namespace kt {

// Grow-only float buffers, one per named use, reused across calls (page faults of fresh
// multi-hundred-MB buffers cost as much as a small layer's compute).
class Scratch {
 public:
  enum Slot { X, DOUT, HH, P, DG, DU, SLOT_ROWS, BT, Z0, Z1, Z2, PER_THREAD, TILE0, TILE1, TILE2, RANK_TILES, N_SLOTS };
  float* get(Slot s, size_t n);
  bf16* get_bf16(Slot s, size_t n) { return reinterpret_cast<bf16*>(get(s, (n + 1) / 2)); }
  size_t bytes() const;

 private:
  struct Free {
    void operator()(float* p) const { delete_aligned_floats(p); }
  };
  std::unique_ptr<float[], Free> buf_[N_SLOTS];
  // Atomic: capabilities() reads them from another thread while a queued call may grow a buffer.
  std::atomic<size_t> cap_[N_SLOTS] = {};
};

// The rows per expert in a call from which the tile kernels are used (forward_tile_rows, backward_tile_rows derive
// theirs from it). On the GPU machine BF16 tiles won from 1 row per expert up against the float32 avx512 set
// (1.1-1.2x at 1-4 rows, 2.4x at 128), quantized ones from 4 rows in training (BENCHMARKS.md, "AMX crossover");
// 4 keeps the margin where the two were within noise.
constexpr int kTileMinRows = 4;
// The most engine threads configure() takes: max(1024, 4 per CPU this process may use).
int max_threads();

class Runtime {
 public:
  static Runtime& get();
  // tile_min_rows: the rows per expert in a call from which the tile kernels are used, as forward_tile_rows and
  // backward_tile_rows derive them (0: the default, kTileMinRows).
  // n_threads: 0 (one per CPU this process may use) to max_threads(); invalid_argument outside that.
  // Runs on the caller's thread once no engine call is in flight (queue().run_now), so a call that another
  // thread starts meanwhile waits for the new pool rather than running on the one being freed.
  void configure(int n_threads, bool pin, const std::string& kernels, int tile_min_rows = 0);
  // Held while configure swaps the settings: a reader outside the queue (capabilities) takes it to see them
  // whole and the pool alive.
  std::unique_lock<std::mutex> settings_lock() { return std::unique_lock<std::mutex>(settings_mutex_); }
  ThreadPool& pool() { return *pool_; }
  // Throws the reason (no AVX2) when no kernel set was chosen.
  const KernelSet& kernels() const;
  int threads() const { return pool_->size(); }
  int tile_min_rows() const { return tile_min_rows_; }
  // The rows from which an expert takes the tiles in a forward, training or inference. On AMX every format takes
  // them from tile_min_rows: below it the amx set's other kernels (BF16 weights: the float32 form; FP8/INT4: their
  // dot forms on vdpbf16ps) ran BF16 inference 12-16% faster than the tiles at 0.5-2 rows per expert, and from it
  // INT4's and FP8's tiles ran 5-11% faster than those dot forms at 2-4 (Layer Q from RAM, engine_bench, medians);
  // the training forward's crossover lies at 2-4 rows per expert for all three. On emulated tiles (16-lane
  // products) the other kernels win below twice it, INT4's below four times it: inference 14-19% faster at 6-12
  // rows per expert, 4% at 16 (Zen 4, Layer Q, third session of 2026-12-01); FP8's and INT4's training forward from
  // those thresholds instead of tile_min_rows 37% faster at T = 64 and 12-20% at 128 (4 and 8 rows per expert on
  // average), BF16's the same (BENCHMARKS.md, third session of 2026-12-06).
  int forward_tile_rows(Format f) const {
    if (!emulated_tiles()) return tile_min_rows_;
    return (f == Format::int4_group32 ? 4 : 2) * tile_min_rows_;
  }
  // The backward's: experts of every format take the tiles from a quarter of tile_min_rows, where a product of 1-3
  // rows runs without the panel (direct_nn); the forward's other kernels run few rows faster (tiles from 1 or 2
  // rows made Layer Q's forward 20-60% slower at T = 32-64 on Zen 4), the backward's do not. Its off-tile form
  // (gemm_nn) widens every weight to float32, two FMAs where vdpbf16ps does one, and decodes FP8/INT4 panels to
  // float32 first. Layer Q, alternated processes: on Zen 4 (2 threads, emulated tiles) tiles from one row made the
  // backward 15-25% faster at T = 16-32 (1-2 rows per expert on average), INT4's 20-35% and FP8's 8-35% at T =
  // 16-64; on the GPU machine's Xeon (15 threads, AMX) BF16's 27-28%, FP8's 24% and INT4's 40-43% at T = 16-32,
  // 9-21% at 64 (medians); nothing moved beyond the noise at T = 128-512 on Zen 4, 128-2048 on the Xeon
  // (BENCHMARKS.md, eighth session of 2026-12-05 and third session of 2026-12-06).
  int backward_tile_rows() const { return std::max(1, tile_min_rows_ / 4); }
  AsyncQueue& queue() { return *queue_; }
  // The pin setting asked for (the pool's pinned() is false where the OS refused it or threads outnumber CPUs).
  bool pin_requested() const { return pin_; }
  Scratch& scratch() { return scratch_; }

  // Engine phase profile: while on, each Phase scope of a call adds its wall time under its name.
  void set_profiling(bool on) { profiling_ = on; }
  bool profiling() const { return profiling_; }
  void add_phase(const char* name, double seconds);
  // Seconds per phase name since the last reset, in the order the phases first ran.
  std::vector<std::pair<std::string, double>> phase_seconds(bool reset);

  // Runs body(item) for item in [0, n) across the pool; items are handed out dynamically, and each
  // item writes only its own outputs, so results do not depend on the thread count.
  void parallel_for(long n, const std::function<void(long, int)>& body);
  // The same, each thread taking its next item before it runs the current one: body(item, next, thread) knows
  // the item it runs next (-1 when none) and can request that item's memory while it computes.
  void parallel_for_ahead(long n, const std::function<void(long, long, int)>& body);

 private:
  Runtime();
  // Whether the kernel set's tiles are the tile unit's operations on vdpbf16ps (no AMX).
  bool emulated_tiles() const {
    const TileKernels* t = kernels().tiles;
    return t && t->emulated;
  }
  void apply(int n_threads, bool pin, const KernelSet* kernels, int tile_min_rows);
  // fork() copies none of the pool's or the driver's threads: in the child (its one thread, in the fork handler)
  // they are abandoned and every lock made anew, and the next get() starts new ones, so a child that never calls
  // the engine (a DataLoader worker) starts none.
  void forget_threads();
  void restart();
  std::atomic<bool> forked_{false};
  std::mutex restart_mutex_;
  std::mutex settings_mutex_;
  std::unique_ptr<ThreadPool> pool_;
  const KernelSet* kernels_ = nullptr;
  std::string no_kernels_reason_;
  bool pin_ = true;
  int n_threads_ = 0;  // as asked for: 0 is one per CPU
  int tile_min_rows_ = kTileMinRows;
  std::unique_ptr<AsyncQueue> queue_;
  Scratch scratch_;
  std::atomic<bool> profiling_{false};
  std::mutex phase_mutex_;  // calls run on the driver thread while Python may read the profile
  std::vector<std::pair<std::string, double>> phases_;
};

// The phases of one engine call, in sequence: ph("name") ends the running phase and starts the next, the
// destructor ends the last. Each adds its wall time to the runtime's profile when it is on (no clock read
// otherwise).
class Phases {
 public:
  explicit Phases(Runtime& rt) : rt_(rt), on_(rt.profiling()) {}
  ~Phases() { end(); }
  Phases(const Phases&) = delete;
  Phases& operator=(const Phases&) = delete;
  void operator()(const char* name) {
    end();
    if (on_) name_ = name, t0_ = std::chrono::steady_clock::now();
  }

 private:
  void end() {
    if (name_) rt_.add_phase(name_, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count());
    name_ = nullptr;
  }
  Runtime& rt_;
  const bool on_;
  const char* name_ = nullptr;
  std::chrono::steady_clock::time_point t0_;
};

}  // namespace kt
