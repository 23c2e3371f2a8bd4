// Meta (fake) kernels of the gated family: shapes and dtypes only, with the real kernels' checks.
#include <torch/library.h>

#include "torch/gated.h"

namespace fused_dense {
namespace {

std::vector<at::Tensor> gated_linear_meta(const at::Tensor& input, const at::Tensor& weight, int64_t activation,
                                          bool save_pre_act, int64_t heuristic) {
  check_gated_linear(input, weight, activation, heuristic);
  auto out = at::empty_symint({input.sym_size(0), weight.size(0) / 2}, input.options());
  if (!save_pre_act) return {out};
  return {out, at::empty_symint({input.sym_size(0), weight.size(0)}, input.options())};
}

std::vector<at::Tensor> gated_linear_dgrad_meta(const at::Tensor& weight, const at::Tensor& d_output,
                                                const at::Tensor& pre_act, int64_t activation, int64_t heuristic,
                                                bool return_act_out) {
  check_gated_linear_dgrad(weight, d_output, pre_act, activation, heuristic);
  std::vector<at::Tensor> out{at::empty_symint({d_output.sym_size(0), 2 * weight.size(1)}, weight.options())};
  if (return_act_out) out.push_back(at::empty_symint({d_output.sym_size(0), weight.size(1)}, weight.options()));
  return out;
}

void gated_linear_dgrad_meta_(const at::Tensor& pre_act, const at::Tensor& weight, const at::Tensor& d_output,
                              int64_t activation, int64_t heuristic) {
  check_gated_linear_dgrad_(pre_act, weight, d_output, activation, heuristic);
}

at::Tensor gated_act_forward_meta(const at::Tensor& pre_act, int64_t activation) {
  check_gated_act_forward(pre_act, activation);
  return at::empty_symint({pre_act.sym_size(0), pre_act.sym_size(1) / 2}, pre_act.options());
}

}  // namespace
}  // namespace fused_dense

TORCH_LIBRARY_IMPL(fused_dense, Meta, m) {
  m.impl("gated_linear", &fused_dense::gated_linear_meta);
  m.impl("gated_linear_dgrad", &fused_dense::gated_linear_dgrad_meta);
  m.impl("gated_linear_dgrad_", &fused_dense::gated_linear_dgrad_meta_);
  m.impl("gated_act_forward", &fused_dense::gated_act_forward_meta);
}
