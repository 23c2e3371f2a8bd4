#include "core/common/types.h"

#include <string>

namespace fused_dense::core {

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat16:
      return "float16";
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kFloat32:
      return "float32";
  }
  // Reached only through a cast from an out-of-range integer; error messages still need a name.
  return "unknown";
}

const char* activation_name(Activation act) {
  switch (act) {
    case Activation::kNone:
      return "none";
    case Activation::kGeluTanh:
      return "gelu_approx";
    case Activation::kRelu:
      return "relu";
    case Activation::kSquaredRelu:
      return "sqrelu";
    case Activation::kSwiGLU:
      return "swiglu";
    case Activation::kGeGLU:
      return "geglu";
  }
  return "unknown";
}

const char* fp8_format_name(Fp8Format f) {
  switch (f) {
    case Fp8Format::kE4M3:
      return "e4m3";
    case Fp8Format::kE5M2:
      return "e5m2";
  }
  return "unknown";
}

std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kFloat16:
    case DType::kBFloat16:
      return 2;
    case DType::kFloat32:
      return 4;
  }
  // A size of 0 would silently turn byte counts into 0, so an invalid code must not pass.
  throw Error("fused_dense: invalid dtype code " + std::to_string(static_cast<int>(dtype)));
}

}  // namespace fused_dense::core
