// A tensor as it crosses the Python boundary: data pointer, dtype, shape. The C++ side owns none of
// it; Python keeps the tensor alive for the duration of the call. Only dense row-major views pass.
#pragma once
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace kt {

enum class DType { f32, bf16, i64, i32, fp8_e4m3 };

struct View {
  void* data = nullptr;  // may be null for a tensor with no elements
  DType dtype = DType::f32;
  std::vector<int64_t> shape;
  bool present = false;  // false: the argument was None

  bool empty() const { return !present; }
  int64_t numel() const {
    int64_t n = 1;
    for (auto s : shape) n *= s;
    return n;
  }
  template <class T>
  T* as() const { return static_cast<T*>(data); }
};

const char* dtype_name(DType d);
std::string shape_str(const std::vector<int64_t>& s);

// Throws std::invalid_argument (ValueError in Python) naming the argument, what it got and what it needs.
void expect(const View& v, const char* what, DType dtype, const std::vector<int64_t>& shape);
void expect_float(const View& v, const char* what, const std::vector<int64_t>& shape);

}  // namespace kt
