// Meta (fake) kernels of the linear family: shapes and dtypes only, for torch.compile and
// FakeTensor. They run the same checks as the real kernels so tracing rejects what execution would
// reject.
#include <torch/library.h>

#include "torch/linear.h"

namespace fused_dense {
namespace {

std::vector<at::Tensor> linear_act_meta(const at::Tensor& input, const at::Tensor& weight,
                                        const std::optional<at::Tensor>& bias, int64_t activation,
                                        bool save_pre_act, int64_t heuristic) {
  const ActivationCode act = check_linear_act(input, weight, bias, activation, save_pre_act, heuristic);
  auto out = at::empty_symint({input.sym_size(0), weight.size(0)}, input.options());
  if (!save_pre_act) return {out};
  return {out, empty_pre_act(input, input.sym_size(0), weight.size(0), act)};
}

std::vector<at::Tensor> linear_bias_wgrad_meta(const at::Tensor& input, const at::Tensor& d_output,
                                               bool has_d_bias) {
  check_wgrad(input, d_output);
  const int64_t N = width_of(d_output, 1), K = width_of(input, 1);
  auto d_weight = at::empty({N, K}, input.options());
  if (!has_d_bias) return {d_weight};
  return {d_weight, at::empty({N}, input.options())};
}

std::vector<at::Tensor> act_linear_dgrad_meta(const at::Tensor& weight, const at::Tensor& d_output,
                                              const std::optional<at::Tensor>& pre_act, int64_t activation,
                                              bool has_d_bias, int64_t heuristic, bool return_act_out) {
  check_act_linear_dgrad(weight, d_output, pre_act, activation, heuristic, return_act_out);
  std::vector<at::Tensor> out{at::empty_symint({d_output.sym_size(0), weight.size(1)}, weight.options())};
  if (has_d_bias) out.push_back(at::empty({weight.size(1)}, weight.options()));
  if (return_act_out) out.push_back(at::empty_symint({d_output.sym_size(0), weight.size(1)}, weight.options()));
  return out;
}

at::Tensor act_forward_meta(const at::Tensor& pre_act, int64_t activation) {
  check_act_forward(pre_act, activation);
  return at::empty_like(pre_act);
}

}  // namespace
}  // namespace fused_dense

TORCH_LIBRARY_IMPL(fused_dense, Meta, m) {
  m.impl("linear_act", &fused_dense::linear_act_meta);
  m.impl("linear_bias_wgrad", &fused_dense::linear_bias_wgrad_meta);
  m.impl("act_linear_dgrad", &fused_dense::act_linear_dgrad_meta);
  m.impl("act_forward", &fused_dense::act_forward_meta);
}
