// What the CUDA kernels of the ops share around their core calls (CUDA-only sources): the core's
// dtype of a tensor, and the core's errors turned into PyTorch's error classes.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "core/common/types.h"

namespace fused_dense {

inline core::DType core_dtype(at::ScalarType t) {
  switch (t) {
    case at::kHalf: return core::DType::kFloat16;
    case at::kBFloat16: return core::DType::kBFloat16;
    case at::kFloat: return core::DType::kFloat32;
    default: TORCH_CHECK(false, "fused_dense: no CUDA kernel for dtype ", t);
  }
}

// Runs a core call: HeuristicOutOfRange becomes a ValueError, any other core::Error a RuntimeError,
// each with the core's message.
template <typename Fn>
void run_core(Fn&& fn) {
  try {
    fn();
  } catch (const core::HeuristicOutOfRange& e) {
    TORCH_CHECK_VALUE(false, e.what());
  } catch (const core::Error& e) {
    TORCH_CHECK(false, e.what());
  }
}

}  // namespace fused_dense
