// The gated family's reference (cpu/reference.h): plain ATen, device-generic, over the packed
// layout of core/common/types.h.
#include <torch/library.h>

#include <utility>

#include "torch/cpu/reference.h"
#include "torch/gated.h"

namespace fused_dense {
namespace {

// The packed layout's columns of the units' gate and up values (core/common/types.h).
std::pair<at::Tensor, at::Tensor> gated_columns(int64_t hidden, const at::Device& device) {
  auto gate = at::empty({hidden}, at::TensorOptions().dtype(at::kLong));
  auto up = at::empty({hidden}, at::TensorOptions().dtype(at::kLong));
  auto* g = gate.data_ptr<int64_t>();
  auto* u = up.data_ptr<int64_t>();
  for (int64_t j = 0; j < hidden; ++j) {
    g[j] = core::gated_gate_column(j);
    u[j] = core::gated_up_column(j, hidden);
  }
  return {gate.to(device), up.to(device)};
}

// act(g) of the gate in math precision, for ATen's act (and its derivative below).
at::Tensor gate_act(const at::Tensor& g, ActivationCode act) {
  return act == ActivationCode::kSwiGLU ? at::silu(g) : at::gelu(g, "tanh");
}

// (act(g), act'(g) * d) of the gate in math precision.
std::pair<at::Tensor, at::Tensor> gate_act_and_grad(const at::Tensor& g, const at::Tensor& d, ActivationCode act) {
  if (act == ActivationCode::kSwiGLU) return {gate_act(g, act), at::silu_backward(d, g)};
  return {gate_act(g, act), gelu_tanh_backward(d, g)};
}

}  // namespace

std::vector<at::Tensor> gated_linear_reference(const at::Tensor& input, const at::Tensor& weight, int64_t activation,
                                               bool save_pre_act, int64_t heuristic) {
  NoAutocast no_autocast;
  const ActivationCode act = check_gated_linear(input, weight, activation, heuristic);
  const auto dtype = input.scalar_type();
  auto gu = at::matmul(input.to(math_type(dtype)), weight.to(math_type(dtype)).t()).to(dtype).contiguous();
  auto out = gated_act_forward_reference(gu, static_cast<int64_t>(act));
  if (!save_pre_act) return {out};
  return {out, gu};
}

std::vector<at::Tensor> gated_linear_dgrad_reference(const at::Tensor& weight, const at::Tensor& d_output,
                                                     const at::Tensor& pre_act, int64_t activation, int64_t heuristic,
                                                     bool return_act_out) {
  NoAutocast no_autocast;
  const ActivationCode act = check_gated_linear_dgrad(weight, d_output, pre_act, activation, heuristic);
  const auto dtype = weight.scalar_type();
  const auto mt = math_type(dtype);
  auto d_h = at::matmul(d_output.to(mt), weight.to(mt)).to(dtype).to(mt);  // rounded GEMM result
  auto d_pre = gated_value_grad(d_h, pre_act.to(mt), act).to(dtype);
  if (!return_act_out) return {d_pre};
  return {d_pre, gated_act_forward_reference(pre_act, activation)};
}

void gated_linear_dgrad_reference_(const at::Tensor& pre_act, const at::Tensor& weight, const at::Tensor& d_output,
                                   int64_t activation, int64_t heuristic) {
  check_gated_linear_dgrad_(pre_act, weight, d_output, activation, heuristic);
  // computed whole before pre_act is written: the same bits as gated_linear_dgrad
  const at::Tensor d_pre = gated_linear_dgrad_reference(weight, d_output, pre_act, activation, heuristic, false)[0];
  pre_act.copy_(d_pre);
}

at::Tensor gated_act_forward_reference(const at::Tensor& pre_act, int64_t activation) {
  NoAutocast no_autocast;
  const ActivationCode act = check_gated_act_forward(pre_act, activation);
  const auto dtype = pre_act.scalar_type();
  return gated_value(pre_act.to(math_type(dtype)), act).to(dtype).contiguous();
}

at::Tensor gated_value(const at::Tensor& gu, ActivationCode act) {
  const auto [gate_cols, up_cols] = gated_columns(gu.size(1) / 2, gu.device());
  return gate_act(gu.index_select(1, gate_cols), act) * gu.index_select(1, up_cols);
}

at::Tensor gated_value_grad(const at::Tensor& d_h, const at::Tensor& gu, ActivationCode act) {
  const auto [gate_cols, up_cols] = gated_columns(d_h.size(1), gu.device());
  const at::Tensor g = gu.index_select(1, gate_cols), u = gu.index_select(1, up_cols);
  auto [a, d_g] = gate_act_and_grad(g, d_h * u, act);
  auto d_pre = at::empty_like(gu);
  d_pre.index_copy_(1, gate_cols, d_g);
  d_pre.index_copy_(1, up_cols, d_h * a);
  return d_pre;
}

}  // namespace fused_dense

TORCH_LIBRARY_IMPL(fused_dense, CPU, m) {
  m.impl("gated_linear", &fused_dense::gated_linear_reference);
  m.impl("gated_linear_dgrad", &fused_dense::gated_linear_dgrad_reference);
  m.impl("gated_linear_dgrad_", &fused_dense::gated_linear_dgrad_reference_);
  m.impl("gated_act_forward", &fused_dense::gated_act_forward_reference);
}
