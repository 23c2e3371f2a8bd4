// From the runtime dtype and activation codes to the kernels' template arguments (internal to the
// elementwise kernels): f(tag) is called with the tag of the code's type or activation.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <string>
#include <type_traits>

#include "core/common/types.h"

namespace fused_dense::core::elementwise_detail {

template <typename T>
struct TypeTag {
  using type = T;
};

template <Activation A>
using ActTag = std::integral_constant<Activation, A>;

template <typename F>
void dispatch_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kFloat16:
      f(TypeTag<__half>{});
      return;
    case DType::kBFloat16:
      f(TypeTag<__nv_bfloat16>{});
      return;
    case DType::kFloat32:
      f(TypeTag<float>{});
      return;
  }
  throw Error("fused_dense: unsupported dtype code " + std::to_string(static_cast<int>(dtype)));
}

template <typename F>
void dispatch_act(Activation act, F&& f) {
  switch (act) {
    case Activation::kNone:
      f(ActTag<Activation::kNone>{});
      return;
    case Activation::kGeluTanh:
      f(ActTag<Activation::kGeluTanh>{});
      return;
    case Activation::kRelu:
      f(ActTag<Activation::kRelu>{});
      return;
    case Activation::kSquaredRelu:
      f(ActTag<Activation::kSquaredRelu>{});
      return;
    case Activation::kSwiGLU:
    case Activation::kGeGLU:
      break;  // the gating kernels' own dispatch: dispatch_gated_act
  }
  throw Error("fused_dense: unsupported activation code " + std::to_string(static_cast<int>(act)));
}

template <typename F>
void dispatch_gated_act(Activation act, F&& f) {
  switch (act) {
    case Activation::kSwiGLU:
      f(ActTag<Activation::kSwiGLU>{});
      return;
    case Activation::kGeGLU:
      f(ActTag<Activation::kGeGLU>{});
      return;
    default:
      break;
  }
  throw Error("fused_dense: not a gated activation code " + std::to_string(static_cast<int>(act)));
}

}  // namespace fused_dense::core::elementwise_detail
