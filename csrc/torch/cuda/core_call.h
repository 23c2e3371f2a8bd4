// What the CUDA kernels share around their core calls (cuda/<family>.cpp): the core's dtype of a
// tensor, the CUDA dimension limit, the core's call context and workspace from PyTorch's caching
// allocator, and the core's errors turned into PyTorch's error classes (docs/contract.md, "Errors").
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <initializer_list>
#include <limits>
#include <optional>
#include <utility>

#include "core/common/types.h"
#include "core/ops/linear.h"

namespace fused_dense {

inline core::DType core_dtype(at::ScalarType t) {
  switch (t) {
    case at::kHalf: return core::DType::kFloat16;
    case at::kBFloat16: return core::DType::kBFloat16;
    case at::kFloat: return core::DType::kFloat32;
    default: TORCH_CHECK_NOT_IMPLEMENTED(false, "fused_dense: no CUDA kernel for dtype ", t);
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

// cuBLASLt takes 64-bit sizes but its kernels, like ours, are only validated up to int32 dims:
// a larger one is NotImplementedError.
inline constexpr int64_t kMaxCudaDim = std::numeric_limits<int32_t>::max();

inline void check_cuda_dims(const char* op, std::initializer_list<std::pair<const char*, int64_t>> dims) {
  for (const auto& [name, value] : dims) {
    TORCH_CHECK_NOT_IMPLEMENTED(value <= kMaxCudaDim, op, ": ", name, " = ", value,
                                " exceeds the largest dimension fused_dense supports on CUDA (", kMaxCudaDim, ")");
  }
}

inline core::LinearContext make_context(const at::Tensor& like, const at::Tensor& workspace) {
  core::LinearContext ctx;
  ctx.device = like.get_device();
  ctx.dtype = core_dtype(like.scalar_type());
  ctx.allow_tf32 = at::globalContext().allowTF32CuBLAS();
  ctx.workspace = core::Workspace{workspace.data_ptr(), static_cast<std::size_t>(workspace.numel())};
  ctx.stream = at::cuda::getCurrentCUDAStream(ctx.device).stream();
  // torch.use_deterministic_algorithms(True): 'auto' never takes a choice timed in this process
  ctx.deterministic = at::globalContext().deterministicAlgorithms();
  return ctx;
}

inline at::Tensor allocate_workspace(const at::Tensor& like, std::size_t bytes) {
  return at::empty({static_cast<int64_t>(bytes)}, like.options().dtype(at::kByte));
}

inline const void* maybe_ptr(const std::optional<at::Tensor>& t) {
  return (t.has_value() && t->defined()) ? t->data_ptr() : nullptr;
}

}  // namespace fused_dense
