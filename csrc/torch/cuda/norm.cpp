// CUDA kernels of the norm family (norm.cpp has their contract): the core's norm kernel, which
// records the amax of its output, then the FP8 family's quantize pass with that amax known; the
// core's norm_backward kernel (one pass for grad_x, the weight and bias gradients' column sums
// beside it), or the reference's ATen composition for float64 (no CUDA kernel) and for widths past
// the kernel's shared-memory column sums.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "core/elementwise/elementwise.h"
#include "torch/cpu/reference.h"
#include "torch/cuda/core_call.h"
#include "torch/cuda/fp8.h"
#include "torch/norm.h"

namespace fused_dense {
namespace {

namespace core = ::fused_dense::core;

NormFp8Result norm_fp8_cuda(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                            double eps, bool layer_norm, int64_t fp8_format, const std::optional<at::Tensor>& scale,
                            bool rowwise, bool columnwise) {
  check_norm_fp8(x, weight, bias, eps, fp8_format, scale);
  const c10::cuda::CUDAGuard guard(x.device());
  auto res = empty_norm_fp8(x, layer_norm, fp8_format, rowwise, columnwise);
  auto& [out, data, data_t, s, s_inv, amax, rstd, mean] = res;
  const bool current = !(scale.has_value() && scale->defined());
  if (current) amax.zero_();  // the norm kernel's atomic maximum starts at 0
  const bool has_bias = bias.has_value() && bias->defined();
  core::NormForwardArgs a;
  a.dtype = core_dtype(x.scalar_type());
  a.rows = x.size(0), a.cols = x.size(1);
  a.x = x.data_ptr();
  a.weight = weight.data_ptr();
  a.bias = has_bias ? bias->data_ptr() : nullptr;
  a.eps = static_cast<float>(eps);
  a.layer_norm = layer_norm;
  a.out = out.data_ptr();
  a.rstd = rstd.data_ptr<float>();
  a.mean = layer_norm ? mean.data_ptr<float>() : nullptr;
  a.amax = current ? amax.data_ptr<float>() : nullptr;
  TORCH_CHECK_NOT_IMPLEMENTED(a.rows <= kMaxCudaDim, "fused_dense::norm_fp8: ", a.rows, " rows are more than the CUDA "
                              "kernel's ", kMaxCudaDim);
  run_core([&] { core::norm_forward(a, at::cuda::getCurrentCUDAStream(x.get_device()).stream()); });
  Fp8QuantizeResult q{data, data_t, s, s_inv, amax, empty_output({0}, x.options())};
  quantize_into(out, std::nullopt, 0, false, fp8_format, current ? nullptr : scale->data_ptr<float>(),
                current ? amax.data_ptr<float>() : nullptr, rowwise, columnwise, false, q);
  return res;
}

NormBackwardResult norm_backward_cuda(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& weight,
                                      const at::Tensor& rstd, const std::optional<at::Tensor>& mean,
                                      std::array<bool, 3> grads) {
  check_norm_backward(grad_out, x, weight, rstd, mean);
  const bool layer_norm = mean.has_value() && mean->defined();
  if (x.scalar_type() == at::kDouble || x.size(1) > core::norm_backward_max_cols(grads[1] && grads[2]) ||
      x.size(0) > kMaxCudaDim)
    return norm_backward_reference(grad_out, x, weight, rstd, mean, grads);
  const c10::cuda::CUDAGuard guard(x.device());
  auto res = empty_norm_grads(x, weight, grads);
  auto& [gx, gw, gb] = res;
  core::NormBackwardArgs a;
  a.dtype = core_dtype(x.scalar_type());
  a.rows = x.size(0), a.cols = x.size(1);
  a.grad_out = grad_out.data_ptr();
  a.x = x.data_ptr();
  a.weight = weight.data_ptr();
  a.rstd = rstd.data_ptr<float>();
  a.mean = layer_norm ? mean->data_ptr<float>() : nullptr;
  a.grad_x = grads[0] ? gx.data_ptr() : nullptr;
  a.grad_weight = grads[1] ? gw.data_ptr() : nullptr;
  a.grad_bias = grads[2] ? gb.data_ptr() : nullptr;
  const std::size_t ws_bytes = core::norm_backward_workspace_bytes(a.rows, a.cols, grads[1], grads[2]);
  const at::Tensor ws = empty_output({static_cast<int64_t>(ws_bytes)}, x.options().dtype(at::kByte));
  run_core([&] {
    core::norm_backward(a, ws_bytes > 0 ? ws.data_ptr() : nullptr, ws_bytes, x.get_device(),
                        at::cuda::getCurrentCUDAStream(x.get_device()).stream());
  });
  return res;
}

}  // namespace
}  // namespace fused_dense

TORCH_LIBRARY_IMPL(fused_dense, CUDA, m) {
  m.impl("norm_fp8", &fused_dense::norm_fp8_cuda);
  m.impl("norm_backward", &fused_dense::norm_backward_cuda);
}
