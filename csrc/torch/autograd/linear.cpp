// The flash-attn-compatible entry points (linear.cpp has their schemas): composites of the
// general ops, reached through the dispatcher, so every device's kernel and the autograd guard run.
#include <torch/library.h>

#include "torch/autograd/op_calls.h"
#include "torch/checks.h"

namespace fused_dense {
namespace {

std::vector<at::Tensor> linear_act_forward(const at::Tensor& input, const at::Tensor& weight,
                                           const std::optional<at::Tensor>& bias, bool is_gelu,
                                           bool save_pre_act, int64_t heuristic) {
  const auto act = is_gelu ? ActivationCode::kGeluTanh : ActivationCode::kRelu;
  return op_calls::linear_act(input, weight, bias, static_cast<int64_t>(act), save_pre_act, heuristic);
}

std::vector<at::Tensor> bias_act_linear_dgrad_bgrad(const at::Tensor& weight, const at::Tensor& d_output,
                                                    const at::Tensor& pre_act, bool is_gelu,
                                                    int64_t heuristic) {
  const auto act = is_gelu ? ActivationCode::kGeluTanh : ActivationCode::kRelu;
  return op_calls::act_linear_dgrad(weight, d_output, pre_act, static_cast<int64_t>(act), true, heuristic, false);
}

}  // namespace
}  // namespace fused_dense

TORCH_LIBRARY_IMPL(fused_dense, CompositeImplicitAutograd, m) {
  m.impl("linear_act_forward", &fused_dense::linear_act_forward);
  m.impl("bias_act_linear_dgrad_bgrad", &fused_dense::bias_act_linear_dgrad_bgrad);
}
