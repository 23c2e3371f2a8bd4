// Meta (fake) kernels of the LM head family: shapes and dtypes only, with the real kernels' checks.
#include <torch/library.h>

#include "torch/lm_head.h"

namespace fused_dense {
namespace {

LceForwardResult lce_forward_meta(const at::Tensor& input, const at::Tensor& weight,
                                  const std::optional<at::Tensor>& bias, const at::Tensor& target, int64_t ignore_index,
                                  double label_smoothing, double z_loss, double softcap, int64_t reduction,
                                  const std::optional<at::Tensor>& divisor, int64_t chunk_size,
                                  std::array<bool, 3> grads, bool fp8) {
  checked_lce_options(input, weight, bias, target, ignore_index, label_smoothing, z_loss, softcap, reduction, divisor,
                      chunk_size, fp8, nullptr, nullptr);
  return empty_lce_forward(input, weight, bias, reduction, grads);
}

LceBackwardResult lce_backward_meta(const at::Tensor& grad_loss, const at::Tensor& input, const at::Tensor& weight,
                                    const std::optional<at::Tensor>& bias, const at::Tensor& target,
                                    const at::Tensor& lse, int64_t ignore_index, double label_smoothing, double z_loss,
                                    double softcap, int64_t reduction, const std::optional<at::Tensor>& divisor,
                                    int64_t chunk_size, std::array<bool, 3> grads, bool fp8) {
  checked_lce_options(input, weight, bias, target, ignore_index, label_smoothing, z_loss, softcap, reduction, divisor,
                      chunk_size, fp8, &grad_loss, &lse);
  return empty_lce_grads(input, weight, bias, grads);
}

// In place: nothing to compute for fake tensors.
void lce_scale_grads_meta(at::TensorList grads, const at::Tensor& grad_loss) { check_lce_scale_grads(grads, grad_loss); }

}  // namespace
}  // namespace fused_dense

TORCH_LIBRARY_IMPL(fused_dense, Meta, m) {
  m.impl("linear_cross_entropy_forward", &fused_dense::lce_forward_meta);
  m.impl("linear_cross_entropy_backward", &fused_dense::lce_backward_meta);
  m.impl("linear_cross_entropy_scale_grads_", &fused_dense::lce_scale_grads_meta);
}
