#include "runtime.h"

#include <pthread.h>

#include <algorithm>
#include <new>
#include <stdexcept>
#include <string>

#include "../kernels/dispatch.h"
#include "saved_pool.h"

namespace kt {

float* Scratch::get(Slot s, size_t n) {
  if (n > cap_[s]) {
    buf_[s].reset();
    cap_[s] = 0;  // a failed allocation below must not leave the old capacity over no buffer
    buf_[s].reset(new_aligned_floats(n));
    cap_[s] = n;
  }
  return buf_[s].get();
}

size_t Scratch::bytes() const {
  size_t b = 0;
  for (size_t c : cap_) b += c * sizeof(float);
  return b;
}

namespace {
Runtime* g_runtime = nullptr;  // set once by get(); the fork handler reaches it without get()'s restart
}

Runtime& Runtime::get() {
  // Never destroyed: calls still queued at exit run on (destroying it freed the scratch under them: a segfault), and
  // a forked child's copy holds threads that do not exist there (joining them hung the child's exit).
  static Runtime* rt = [] {
    g_runtime = new Runtime;
    pthread_atfork(nullptr, nullptr, [] { g_runtime->forget_threads(); });
    return g_runtime;
  }();
  if (rt->forked_.load(std::memory_order_acquire)) rt->restart();
  return *rt;
}

void Runtime::forget_threads() {
  (void)pool_.release();  // abandoned: their threads were not copied, and a lock one of them held stays held
  (void)queue_.release();
  new (&settings_mutex_) std::mutex;
  new (&phase_mutex_) std::mutex;
  new (&restart_mutex_) std::mutex;
  saved_pool_after_fork();
  tickets_after_fork();
  forked_.store(true, std::memory_order_release);
}

void Runtime::restart() {
  std::lock_guard<std::mutex> lock(restart_mutex_);
  if (!forked_.load(std::memory_order_relaxed)) return;
  queue_.reset(new AsyncQueue());
  pool_.reset(new ThreadPool(n_threads_, pin_));
  forked_.store(false, std::memory_order_release);
}

Runtime::Runtime() : queue_(new AsyncQueue()) {
  try {
    configure(0, true, "");
  } catch (const std::exception& e) {
    no_kernels_reason_ = e.what();
    pool_.reset(new ThreadPool(0, true));
  }
}

const KernelSet& Runtime::kernels() const {
  if (!kernels_) throw std::runtime_error(no_kernels_reason_);
  return *kernels_;
}

int max_threads() { return std::max(1024, 4 * available_cpus()); }

void Runtime::configure(int n_threads, bool pin, const std::string& kernels, int tile_min_rows) {
  // A thread count past what the OS lets a process start would leave it creating threads until it stalls (seen
  // at 100000); the engine runs best with one thread per physical core anyway.
  if (n_threads < 0 || n_threads > max_threads())
    throw std::invalid_argument("threads=" + std::to_string(n_threads) + " is out of range: the engine takes 0 (one "
                                "per CPU this process may use) to " + std::to_string(max_threads()) +
                                " threads; one per physical core is fastest.");
  const KernelSet* ks = &select_kernels(kernels);  // throws before anything changes
  queue_->run_now([&] { apply(n_threads, pin, ks, tile_min_rows); })->wait();
}

void Runtime::apply(int n_threads, bool pin, const KernelSet* ks, int tile_min_rows) {
  std::lock_guard<std::mutex> lock(settings_mutex_);
  kernels_ = ks;
  // At most 2^24: forward_tile_rows multiplies it by up to 4 in an int.
  tile_min_rows_ = tile_min_rows > 0 ? std::min(tile_min_rows, 1 << 24) : kTileMinRows;
  if (!pool_ || pool_->size() != (n_threads > 0 ? n_threads : available_cpus()) || pin_ != pin) {
    pool_.reset();
    try {
      pool_.reset(new ThreadPool(n_threads, pin));
    } catch (...) {  // the OS refused a thread: keep a pool of the default size so later calls still run
      pool_.reset(new ThreadPool(0, pin_));
      n_threads_ = 0;
      throw;
    }
    pin_ = pin;
    n_threads_ = n_threads;
  }
}

void Runtime::add_phase(const char* name, double seconds) {
  std::lock_guard<std::mutex> lock(phase_mutex_);
  for (auto& ph : phases_)
    if (ph.first == name) {
      ph.second += seconds;
      return;
    }
  phases_.emplace_back(name, seconds);
}

std::vector<std::pair<std::string, double>> Runtime::phase_seconds(bool reset) {
  std::lock_guard<std::mutex> lock(phase_mutex_);
  std::vector<std::pair<std::string, double>> out = phases_;
  if (reset) phases_.clear();
  return out;
}

void Runtime::parallel_for(long n, const std::function<void(long, int)>& body) {
  if (n <= 0) return;
  if (n == 1) return body(0, 0);  // one item runs on one thread anyway: no hand-off (decode's T = 1 phases)
  std::atomic<long> next{0};
  pool_->run([&](int ith, int) {
    for (long i = next.fetch_add(1); i < n; i = next.fetch_add(1)) body(i, ith);
  });
}

void Runtime::parallel_for_ahead(long n, const std::function<void(long, long, int)>& body) {
  if (n <= 0) return;
  if (n == 1) return body(0, -1, 0);
  std::atomic<long> next{0};
  pool_->run([&](int ith, int) {
    for (long i = next.fetch_add(1); i < n;) {
      const long after = next.fetch_add(1);
      body(i, after < n ? after : -1, ith);
      i = after;
    }
  });
}

}  // namespace kt
