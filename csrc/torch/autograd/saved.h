// What the C++ autograd Functions (mlp.cpp, mlp_fp8.cpp) do with a saved intermediate once its
// last reader in backward has been issued.
#pragma once

#include <ATen/ATen.h>
#include <ATen/FunctionalTensorWrapper.h>
#include <torch/csrc/autograd/graph_task.h>

namespace fused_dense {

// Whether this backward may free its node's saved intermediates: the graph task keeps no graph
// (retain_graph=False), so no later backward reads them. Called inside a Function's backward.
inline bool may_free_saved() { return !torch::autograd::get_current_graph_task_keep_graph(); }

// Whether t's memory may be freed or written over by the Function that made it: a tensor with
// storage on CPU or CUDA, not one of tracing (Python dispatch, functionalization).
inline bool may_write_over(const at::Tensor& t) {
  return t.defined() && t.has_storage() && (t.is_cuda() || t.is_cpu()) &&
         !t.unsafeGetTensorImpl()->is_python_dispatch() && !at::functionalization::impl::isFunctionalTensor(t);
}

// Drops t, and where `free`, frees its memory. The autograd node holds its saved variables until
// its backward returns, so dropping this reference alone frees nothing: emptying the storage
// returns the block to the allocator (reused in stream order, after the kernels already issued on
// it). `free` only for the Function's own intermediates (a pre-activation, an activation or its
// FP8 copy: never an input, never a copy another layer shares) and where may_free_saved(). A
// tensor of tracing (Python dispatch, functionalization) or of a device other than CPU and CUDA is
// only dropped. torch.compile's backward frees such activations after their last reader likewise.
inline void drop_saved(at::Tensor& t, bool free) {
  if (free && may_write_over(t)) t.storage().unsafeGetStorageImpl()->reset();
  t.reset();
}

}  // namespace fused_dense
