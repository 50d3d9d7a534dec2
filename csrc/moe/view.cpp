#include "view.h"

namespace kt {

const char* dtype_name(DType d) {
  switch (d) {
    case DType::f32: return "float32";
    case DType::bf16: return "bfloat16";
    case DType::i64: return "int64";
    case DType::i32: return "int32";
    case DType::fp8_e4m3: return "float8_e4m3fn";
  }
  return "?";
}

std::string shape_str(const std::vector<int64_t>& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}

static void expect_shape(const View& v, const char* what, const std::vector<int64_t>& shape) {
  if (v.empty()) throw std::invalid_argument(std::string(what) + " is missing; pass a tensor of shape " + shape_str(shape) + ".");
  if (v.shape != shape)
    throw std::invalid_argument(std::string(what) + " has shape " + shape_str(v.shape) + " but the experts need " +
                                shape_str(shape) + ".");
}

void expect(const View& v, const char* what, DType dtype, const std::vector<int64_t>& shape) {
  expect_shape(v, what, shape);
  if (v.dtype != dtype)
    throw std::invalid_argument(std::string(what) + " is " + dtype_name(v.dtype) + " but must be " + dtype_name(dtype) + ".");
}

void expect_float(const View& v, const char* what, const std::vector<int64_t>& shape) {
  expect_shape(v, what, shape);
  if (v.dtype != DType::f32 && v.dtype != DType::bf16)
    throw std::invalid_argument(std::string(what) + " is " + dtype_name(v.dtype) + " but must be float32 or bfloat16.");
}

}  // namespace kt
