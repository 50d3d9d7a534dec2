#include "sum_squares.h"

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "../formats/bf16.h"
#include "runtime.h"

namespace kt {

namespace {

constexpr int64_t kChunk = 1 << 16;  // elements per work item: 256 KB of float32, many items per thread

// Four independent float64 accumulators keep the adds from waiting on each other; memory is the limit anyway.
template <class T>
double chunk_sum(const T* x, int64_t n) {
  double s[4] = {0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 4 <= n; i += 4)
    for (int k = 0; k < 4; ++k) {
      const double v = to_f32(x[i + k]);
      s[k] += v * v;
    }
  for (; i < n; ++i) {
    const double v = to_f32(x[i]);
    s[0] += v * v;
  }
  return (s[0] + s[1]) + (s[2] + s[3]);
}

}  // namespace

double sum_squares(const std::vector<View>& tensors) {
  struct Item {
    const View* t;
    int64_t begin, n;
  };
  std::vector<Item> items;
  for (const View& t : tensors) {
    if (t.dtype != DType::f32 && t.dtype != DType::bf16)
      throw std::invalid_argument(std::string("sum_squares takes float32 or bfloat16 tensors, not ") +
                                  dtype_name(t.dtype) + ".");
    const int64_t n = t.numel();
    for (int64_t b = 0; b < n; b += kChunk) items.push_back({&t, b, std::min(kChunk, n - b)});
  }
  std::vector<double> partial(items.size());
  Runtime& rt = Runtime::get();
  // Through the queue, as engine calls run: after the calls in flight, and never beside a configure swapping the
  // pool (a second caller of the pool would wait on it forever).
  rt.queue().run_now([&] {
    rt.parallel_for(static_cast<long>(items.size()), [&](long i, int) {
      const Item& it = items[i];
      partial[i] = it.t->dtype == DType::f32 ? chunk_sum(it.t->as<float>() + it.begin, it.n)
                                             : chunk_sum(it.t->as<bf16>() + it.begin, it.n);
    });
  })->wait();
  double total = 0;
  for (double p : partial) total += p;
  return total;
}

}  // namespace kt
