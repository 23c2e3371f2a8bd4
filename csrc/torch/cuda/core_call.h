// What the CUDA kernels share around their core calls (cuda/<family>.cpp): the core's dtype of a
// tensor, the CUDA dimension limit, the core's call context and workspace (a buffer kept per stream,
// or one from the caching allocator), and the core's errors turned into PyTorch's error classes
// (docs/contract.md, "Errors").
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/EmptyTensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

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

// An output of a CUDA kernel, allocated as ATen's own CUDA kernels allocate theirs
// (at::detail::empty_cuda, from the caching allocator), not through the dispatcher again: at::empty
// is an op call of its own on the per-call path (9 a FusedMLP step in the H200 host profile).
inline at::Tensor empty_output(at::IntArrayRef sizes, const at::TensorOptions& options) {
  return at::detail::empty_cuda(sizes, options);
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

// The workspace of one core call. Requests up to kMaxStreamWorkspaceBytes are served from one
// buffer per (device, stream), kept and grown to the largest such request seen there, so the
// per-call path allocates nothing: calls on one stream run in order, so they can share it. At most
// kMaxStreamWorkspaces buffers are kept, the least recently used given back first; a buffer is
// allocated on its own stream, so the caching allocator reuses its memory only behind that
// stream's pending work. Larger requests (the gated ops' intermediate at large M), and every
// request while the stream captures a CUDA graph (the graph keeps its addresses, so they must stay
// the graph's own: the caching allocator keeps them in the graph's pool), are allocated for the call.
inline constexpr std::size_t kMaxStreamWorkspaceBytes = std::size_t{64} << 20;
inline constexpr std::size_t kMaxStreamWorkspaces = 16;

// The call keeps a reference to the buffer it was given: should another host thread grow the same
// stream's buffer meanwhile, the old one returns to the caching allocator only once this call has
// enqueued its work (and then in stream order).
inline at::Tensor stream_workspace(const at::Tensor& like, cudaStream_t stream, std::size_t bytes) {
  struct Entry {
    int device;
    cudaStream_t stream;
    at::Tensor buffer;
  };
  struct Cache {
    std::mutex mutex;
    std::vector<Entry> entries;  // most recently used last
  };
  static Cache* cache = new Cache();  // never destroyed: its buffers would outlive the CUDA context
  const int device = like.get_device();
  std::lock_guard<std::mutex> lock(cache->mutex);
  auto& entries = cache->entries;
  auto it = std::find_if(entries.begin(), entries.end(),
                         [&](const Entry& e) { return e.device == device && e.stream == stream; });
  if (it != entries.end() && static_cast<std::size_t>(it->buffer.numel()) >= bytes) {
    if (std::next(it) != entries.end()) std::rotate(it, std::next(it), entries.end());
    return entries.back().buffer;
  }
  if (it != entries.end()) entries.erase(it);
  if (entries.size() >= kMaxStreamWorkspaces) entries.erase(entries.begin());
  entries.push_back(Entry{device, stream, at::empty({static_cast<int64_t>(bytes)}, like.options().dtype(at::kByte))});
  return entries.back().buffer;
}

class CallWorkspace {
 public:
  CallWorkspace(const at::Tensor& like, std::size_t bytes) : bytes_(bytes) {
    const cudaStream_t stream = at::cuda::getCurrentCUDAStream(like.get_device()).stream();
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    held_ = (bytes <= kMaxStreamWorkspaceBytes && capture == cudaStreamCaptureStatusNone)
                ? stream_workspace(like, stream, bytes)
                : at::empty({static_cast<int64_t>(bytes)}, like.options().dtype(at::kByte));
  }
  core::Workspace get() const { return core::Workspace{held_.data_ptr(), bytes_}; }

 private:
  at::Tensor held_;  // the stream's buffer, or this call's own
  std::size_t bytes_ = 0;
};

inline core::LinearContext make_context(const at::Tensor& like, const CallWorkspace& workspace) {
  core::LinearContext ctx;
  ctx.device = like.get_device();
  ctx.dtype = core_dtype(like.scalar_type());
  ctx.allow_tf32 = at::globalContext().allowTF32CuBLAS();
  ctx.workspace = workspace.get();
  ctx.stream = at::cuda::getCurrentCUDAStream(ctx.device).stream();
  // torch.use_deterministic_algorithms(True): 'auto' never takes a choice timed in this process
  ctx.deterministic = at::globalContext().deterministicAlgorithms();
  return ctx;
}

inline const void* maybe_ptr(const std::optional<at::Tensor>& t) {
  return (t.has_value() && t->defined()) ? t->data_ptr() : nullptr;
}

}  // namespace fused_dense
