// Meta (fake) kernels of the norm family: shapes and dtypes only, with the real kernels' checks.
#include <torch/library.h>

#include "torch/norm.h"

namespace fused_dense {
namespace {

NormFp8Result norm_fp8_meta(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                            double eps, bool layer_norm, int64_t fp8_format, const std::optional<at::Tensor>& scale,
                            bool rowwise, bool columnwise) {
  check_norm_fp8(x, weight, bias, eps, fp8_format, scale);
  return empty_norm_fp8(x, layer_norm, fp8_format, rowwise, columnwise);
}

NormBackwardResult norm_backward_meta(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& weight,
                                      const at::Tensor& rstd, const std::optional<at::Tensor>& mean,
                                      std::array<bool, 3> grads) {
  check_norm_backward(grad_out, x, weight, rstd, mean);
  return empty_norm_grads(x, weight, grads);
}

}  // namespace
}  // namespace fused_dense

TORCH_LIBRARY_IMPL(fused_dense, Meta, m) {
  m.impl("norm_fp8", &fused_dense::norm_fp8_meta);
  m.impl("norm_backward", &fused_dense::norm_backward_meta);
}
