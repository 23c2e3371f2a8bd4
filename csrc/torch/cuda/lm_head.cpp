// CUDA kernels of the LM head family (lm_head.cpp has their contract): the chunk loop's GEMMs are
// ATen's (cuBLAS), the rows are the core's cross_entropy_rows (core/elementwise/elementwise.h) on
// the tensors' device and stream; float64 takes the reference's rows. The gradients' scaling is
// the core's scale_unless_one for float32 grad_loss and float16 / bfloat16 / float32 tensors,
// else lce_scale_reference.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "core/elementwise/elementwise.h"
#include "torch/cpu/reference.h"
#include "torch/cuda/core_call.h"
#include "torch/lm_head.h"

namespace fused_dense {
namespace {

namespace core = ::fused_dense::core;

struct CudaBackend {
  static void rows(const LceRows& r, const LceOptions& o) {
    if (r.logits.scalar_type() == at::kDouble) return cross_entropy_rows_reference(r, o);
    const c10::cuda::CUDAGuard guard(r.logits.device());
    core::CrossEntropyRowsArgs a;
    a.dtype = core_dtype(r.logits.scalar_type());
    a.rows = r.logits.size(0), a.vocab = r.logits.size(1);
    a.logits = r.logits.data_ptr();
    a.target = r.target.data_ptr<int64_t>();
    a.ignore_index = o.ignore_index;
    a.label_smoothing = static_cast<float>(o.label_smoothing);
    a.z_loss = static_cast<float>(o.z_loss);
    a.softcap = static_cast<float>(o.softcap);
    a.scale = r.scale.data_ptr<float>();
    a.scale_stride = r.scale.dim() == 0 ? 0 : 1;
    a.loss = r.loss.defined() ? r.loss.data_ptr<float>() : nullptr;
    a.lse = r.lse.data_ptr<float>();
    a.lse_known = r.lse_known, a.write_grad = r.write_grad;
    TORCH_CHECK_NOT_IMPLEMENTED(a.rows <= kMaxCudaDim, "fused_dense::linear_cross_entropy: a chunk of ", a.rows,
                                " rows is more than the CUDA kernel's ", kMaxCudaDim);
    run_core([&] { core::cross_entropy_rows(a, at::cuda::getCurrentCUDAStream(r.logits.get_device()).stream()); });
  }

  // The range check reads the targets on the host: not while a CUDA graph is captured (there
  // the rows kernel's NaN marks a target out of range).
  static bool reads_targets(const at::Tensor& target) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    C10_CUDA_CHECK(cudaStreamIsCapturing(at::cuda::getCurrentCUDAStream(target.get_device()).stream(), &capture));
    return capture == cudaStreamCaptureStatusNone;
  }
};

void lce_scale_grads_cuda(at::TensorList grads, const at::Tensor& grad_loss) {
  check_lce_scale_grads(grads, grad_loss);
  const at::Tensor g = grad_loss.reshape({});
  const c10::cuda::CUDAGuard guard(g.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream(g.get_device()).stream();
  for (const at::Tensor& t : grads) {
    const auto dtype = t.scalar_type();
    const bool ours = g.scalar_type() == at::kFloat && t.is_contiguous() &&
                      (dtype == at::kBFloat16 || dtype == at::kHalf || dtype == at::kFloat);
    if (!ours) {
      lce_scale_reference(t, g);
      continue;
    }
    core::ScaleUnlessOneArgs a;
    a.dtype = core_dtype(dtype);
    a.n = t.numel();
    a.data = t.data_ptr();
    a.scale = g.data_ptr<float>();
    a.device = g.get_device();
    run_core([&] { core::scale_unless_one(a, stream); });
  }
}

}  // namespace
}  // namespace fused_dense

TORCH_LIBRARY_IMPL(fused_dense, CUDA, m) {
  m.impl("linear_cross_entropy_forward", &fused_dense::lce_forward_op<fused_dense::CudaBackend>);
  m.impl("linear_cross_entropy_backward", &fused_dense::lce_backward_op<fused_dense::CudaBackend>);
  m.impl("linear_cross_entropy_scale_grads_", &fused_dense::lce_scale_grads_cuda);
}
