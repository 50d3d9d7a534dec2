// One persistent pool of worker threads. The calling thread takes part as thread 0, so a pool of
// n threads starts n-1 workers. Work is a function of (ith, nth); run() returns when every thread
// has finished it. Kernels never create threads, allocate or read the environment (STYLE.md 5).
#pragma once
#include <immintrin.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace kt {

// Threads spin this long for the next job or the last worker before sleeping on a condition variable:
// waking a sleeping thread costs 10-50 us, which a decode step's six short phases would pay six times
// over. The budget is time, read every 64 pauses: one pause lasts ~10 to ~140 cycles across x86 cores
// (2000 of them were 48 us on the dev machine's EPYC, ~100+ us on the GPU machine's Xeon).
constexpr auto kSpin = std::chrono::microseconds(100);

// Spins until done() or kSpin has passed; returns done(). The pool's threads, and the engine's items that wait
// on others (moe/experts.cpp), then sleep or yield.
template <class Done>
bool spin_until(Done done) {
  const auto end = std::chrono::steady_clock::now() + kSpin;
  for (;;) {
    for (int i = 0; i < 64; ++i) {
      if (done()) return true;
      _mm_pause();
    }
    if (std::chrono::steady_clock::now() >= end) return done();
  }
}

class ThreadPool {
 public:
  // n_threads <= 0 means the number of CPUs this process may run on. pin: bind thread i to the
  // i-th allowed CPU (ignored where the OS refuses).
  explicit ThreadPool(int n_threads, bool pin);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return n_; }
  bool pinned() const { return pinned_; }
  // Runs fn(ith, nth) on all threads; the first exception thrown by any thread is rethrown here.
  void run(const std::function<void(int, int)>& fn);

 private:
  void worker(int ith);
  int n_;
  bool pinned_ = false;
  std::vector<std::thread> threads_;
  std::vector<int> cpus_;
  std::mutex mu_;
  std::condition_variable cv_start_, cv_done_;
  const std::function<void(int, int)>* job_ = nullptr;
  std::atomic<uint64_t> published_{0};  // jobs published so far; written under mu_, read by spinning threads
  std::atomic<int> pending_{0};
  bool stop_ = false;
  std::exception_ptr error_;
  std::mutex run_mu_;  // one run() at a time
};

int available_cpus();

}  // namespace kt
