#include "saved_pool.h"

#include <iterator>
#include <map>
#include <mutex>
#include <new>

#include "../kernels/aligned.h"

namespace kt {

namespace {

struct Pool {
  std::mutex mu;
  std::multimap<size_t, float*> free;  // capacity → buffer
  size_t allocated = 0;
};

// Never destroyed: buffers may come back from Python objects freed during interpreter shutdown.
Pool& pool() {
  static Pool* p = new Pool;
  return *p;
}

}  // namespace

void SavedFree::operator()(float* p) const {
  Pool& pl = pool();
  std::lock_guard<std::mutex> lock(pl.mu);
  pl.free.emplace(cap, p);
}

SavedBuffer take_saved(size_t n) {
  Pool& pl = pool();
  {
    std::lock_guard<std::mutex> lock(pl.mu);
    auto it = pl.free.lower_bound(n);
    if (it != pl.free.end() && it->first <= 2 * n) {
      SavedBuffer b(it->second, SavedFree{it->first});
      pl.free.erase(it);
      return b;
    }
    if (it != pl.free.begin()) {
      const auto below = std::prev(it);  // the largest free buffer smaller than n
      if (below->first >= n / 2) {
        delete_aligned_floats(below->second);
        pl.free.erase(below);
      }
    }
    ++pl.allocated;
  }
  const size_t cap = n + n / 8;
  return SavedBuffer(new_aligned_floats(cap), SavedFree{cap});
}

size_t saved_pool_allocations() {
  Pool& pl = pool();
  std::lock_guard<std::mutex> lock(pl.mu);
  return pl.allocated;
}

size_t saved_pool_free_bytes() {
  Pool& pl = pool();
  std::lock_guard<std::mutex> lock(pl.mu);
  size_t floats = 0;
  for (const auto& entry : pl.free) floats += entry.first;
  return floats * sizeof(float);
}

void saved_pool_release() {
  Pool& pl = pool();
  std::lock_guard<std::mutex> lock(pl.mu);
  for (auto& [cap, p] : pl.free) delete_aligned_floats(p);
  pl.free.clear();
}

void saved_pool_after_fork() { new (&pool().mu) std::mutex; }

}  // namespace kt
