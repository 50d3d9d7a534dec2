// Cache-line-aligned buffers: the engine's scratch, saved activations and the kernels' panels.
#pragma once
#include <cstddef>
#include <new>
#include <vector>

namespace kt {

// Buffers that 64-byte vectors and tile rows are loaded from and stored to start on a cache line: malloc's
// large blocks start 16 bytes past one (glibc's header before a mapped block), which splits every such row
// over two lines.
constexpr std::align_val_t kLineAlign{64};
template <class T>
struct LineAligned {
  using value_type = T;
  LineAligned() = default;
  template <class U>
  LineAligned(const LineAligned<U>&) {}
  T* allocate(std::size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), kLineAlign)); }
  void deallocate(T* p, std::size_t) { ::operator delete(p, kLineAlign); }
  template <class U>
  bool operator==(const LineAligned<U>&) const { return true; }
  template <class U>
  bool operator!=(const LineAligned<U>&) const { return false; }
};
template <class T>
using aligned_vector = std::vector<T, LineAligned<T>>;
// n floats, uninitialized, for the grow-only buffers (a zero fill would touch every page at once).
inline float* new_aligned_floats(std::size_t n) {
  return static_cast<float*>(::operator new[](n * sizeof(float), kLineAlign));
}
inline void delete_aligned_floats(float* p) { ::operator delete[](p, kLineAlign); }

}  // namespace kt
