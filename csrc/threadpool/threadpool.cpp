#include "threadpool.h"

#include <pthread.h>
#include <sched.h>

#include <stdexcept>
#include <string>
#include <system_error>

namespace kt {

static std::vector<int> allowed_cpus() {
  std::vector<int> cpus;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    for (int c = 0; c < CPU_SETSIZE; ++c)
      if (CPU_ISSET(c, &set)) cpus.push_back(c);
  }
  if (cpus.empty()) {
    unsigned hw = std::thread::hardware_concurrency();
    for (unsigned c = 0; c < (hw ? hw : 1); ++c) cpus.push_back(int(c));
  }
  return cpus;
}

int available_cpus() { return int(allowed_cpus().size()); }

static bool pin_to(pthread_t t, int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  return pthread_setaffinity_np(t, sizeof(set), &set) == 0;
}

ThreadPool::ThreadPool(int n_threads, bool pin) : cpus_(allowed_cpus()) {
  n_ = n_threads > 0 ? n_threads : int(cpus_.size());
  // Pinning more threads than allowed CPUs would stack them; then let the OS place them.
  bool do_pin = pin && n_ <= int(cpus_.size());
  try {
    for (int i = 1; i < n_; ++i) threads_.emplace_back([this, i] { worker(i); });
  } catch (const std::system_error& e) {  // stop the workers started so far: a joinable thread's destructor aborts
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    cv_start_.notify_all();
    for (auto& t : threads_) t.join();
    throw std::runtime_error("the OS refused to start engine thread " + std::to_string(threads_.size() + 1) + " of " +
                             std::to_string(n_) + " (" + e.what() + "); configure fewer threads.");
  }
  if (do_pin) {
    bool ok = true;
    for (int i = 1; i < n_; ++i) ok &= pin_to(threads_[i - 1].native_handle(), cpus_[i]);
    pinned_ = ok;
  }
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_start_.notify_all();
  for (auto& t : threads_) t.join();
}

void ThreadPool::worker(int ith) {
  uint64_t seen = 0;
  for (;;) {
    // A job published while this thread spins is taken without the lock (its fields were written before
    // the release store of published_): fifteen workers taking one mutex in turn cost more than a short
    // phase itself. Only a thread that goes to sleep takes the lock, to wait.
    uint64_t gen = seen;
    if (!spin_until([&] { return (gen = published_.load(std::memory_order_acquire)) != seen; })) {
      std::unique_lock<std::mutex> lk(mu_);
      cv_start_.wait(lk, [&] { return stop_ || published_.load(std::memory_order_relaxed) != seen; });
      if (stop_) return;
      gen = published_.load(std::memory_order_relaxed);
    }
    seen = gen;
    const std::function<void(int, int)>* job = job_;
    std::exception_ptr err;
    try {
      (*job)(ith, n_);
    } catch (...) {
      err = std::current_exception();
    }
    if (err) {
      std::lock_guard<std::mutex> lk(mu_);
      if (!error_) error_ = err;
    }
    if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      std::lock_guard<std::mutex> lk(mu_);
      cv_done_.notify_one();
    }
  }
}

void ThreadPool::run(const std::function<void(int, int)>& fn) {
  std::lock_guard<std::mutex> one(run_mu_);
  if (n_ == 1) {
    fn(0, 1);
    return;
  }
  {
    // Under the lock for the threads that sleep (they check published_ holding it); notify_all costs no
    // system call when none does.
    std::lock_guard<std::mutex> lk(mu_);
    job_ = &fn;
    pending_.store(n_ - 1, std::memory_order_relaxed);
    error_ = nullptr;
    published_.store(published_.load(std::memory_order_relaxed) + 1, std::memory_order_release);
  }
  cv_start_.notify_all();
  std::exception_ptr err;
  try {
    fn(0, n_);
  } catch (...) {
    err = std::current_exception();
  }
  if (!spin_until([&] { return pending_.load(std::memory_order_acquire) == 0; })) {
    std::unique_lock<std::mutex> lk(mu_);
    cv_done_.wait(lk, [&] { return pending_.load(std::memory_order_acquire) == 0; });
  }
  if (!err) err = error_;  // written before its thread's decrement of pending_, which the loads above acquire
  job_ = nullptr;
  if (err) std::rethrow_exception(err);
}

}  // namespace kt
