#include "saved_pool.h"

#include <map>
#include <mutex>

namespace kt {

namespace {

struct Pool {
  std::mutex mu;
  std::multimap<size_t, float*> free;  // capacity → buffer
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
    if (it != pl.free.end() && it->first <= n + n / 8) {
      SavedBuffer b(it->second, SavedFree{it->first});
      pl.free.erase(it);
      return b;
    }
    for (auto& [cap, p] : pl.free) delete[] p;
    pl.free.clear();
  }
  const size_t cap = n + n / 8;
  return SavedBuffer(new float[cap], SavedFree{cap});
}

}  // namespace kt
