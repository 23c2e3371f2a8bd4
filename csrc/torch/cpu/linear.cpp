// The linear family's reference (cpu/reference.h): plain ATen, device-generic.
#include <torch/library.h>

#include "torch/cpu/reference.h"
#include "torch/linear.h"

namespace fused_dense {
namespace {

// Bit (j % 8) of byte (j / 8) of row i is set exactly when bits[i, j] (see core/common/types.h).
at::Tensor pack_mask(const at::Tensor& positive) {
  const int64_t rows = positive.size(0), cols = positive.size(1), bytes = relu_mask_row_bytes(cols);
  auto bits = at::zeros({rows, bytes * 8}, positive.options().dtype(at::kByte));
  bits.narrow(1, 0, cols).copy_(positive);
  auto weights = at::tensor({1, 2, 4, 8, 16, 32, 64, 128}, bits.options().dtype(at::kInt));
  return (bits.view({rows, bytes, 8}).to(at::kInt) * weights).sum(-1).to(at::kByte);
}

at::Tensor unpack_mask(const at::Tensor& mask, int64_t cols) {
  const int64_t rows = mask.size(0), bytes = mask.size(1);
  auto weights = at::tensor({1, 2, 4, 8, 16, 32, 64, 128}, mask.options().dtype(at::kByte));
  auto bits = mask.unsqueeze(-1).bitwise_and(weights).ne(0).view({rows, bytes * 8});
  return bits.narrow(1, 0, cols);
}

at::Tensor apply_act(const at::Tensor& x, ActivationCode act) {
  switch (act) {
    case ActivationCode::kNone: return x;
    case ActivationCode::kGeluTanh: return at::gelu(x, "tanh");
    case ActivationCode::kRelu: return at::relu(x);
    case ActivationCode::kSquaredRelu: return at::relu(x).square();
    case ActivationCode::kSwiGLU:
    case ActivationCode::kGeGLU: break;  // refused by the checks: the gated family (cpu/gated.cpp)
  }
  return x;
}

}  // namespace

// d * gelu'(p), tanh approximation. ATen's formula takes 0 * inf (NaN) where p^2 overflows
// (|p| >= ~2e19 in fp32, ~1e154 in fp64, and +-inf); the CUDA kernels give the limits 1 and 0
// there. The derivative is already exactly 1 or 0 from |p| = 20 on in fp32 and fp64, so clamping
// there changes nothing else; clamp keeps NaN.
at::Tensor gelu_tanh_backward(const at::Tensor& d, const at::Tensor& p) {
  return at::gelu_backward(d, p.clamp(-20.0, 20.0), "tanh");
}

std::vector<at::Tensor> linear_act_reference(const at::Tensor& input, const at::Tensor& weight,
                                             const std::optional<at::Tensor>& bias, int64_t activation,
                                             bool save_pre_act, int64_t heuristic) {
  NoAutocast no_autocast;
  const ActivationCode act = check_linear_act(input, weight, bias, activation, save_pre_act, heuristic);
  const auto dtype = input.scalar_type();
  const auto mt = math_type(dtype);
  auto pre = at::matmul(input.to(mt), weight.to(mt).t());
  if (bias.has_value() && bias->defined()) pre = pre + bias->to(mt);
  pre = pre.to(dtype);  // rounded where the CUDA path stores the GEMM (+ bias) result
  auto out = apply_act(pre.to(mt), act).to(dtype).contiguous();
  if (!save_pre_act) return {out};
  if (act == ActivationCode::kRelu) return {out, pack_mask(pre.ge(0))};
  return {out, pre.contiguous()};
}

std::vector<at::Tensor> linear_bias_wgrad_reference(const at::Tensor& input, const at::Tensor& d_output,
                                                    bool has_d_bias) {
  NoAutocast no_autocast;
  check_wgrad(input, d_output);
  const auto dtype = input.scalar_type();
  const auto mt = math_type(dtype);
  auto d_weight = at::matmul(d_output.to(mt).t(), input.to(mt)).to(dtype).contiguous();
  if (!has_d_bias) return {d_weight};
  return {d_weight, d_output.to(mt).sum(0).to(dtype)};
}

std::vector<at::Tensor> act_linear_dgrad_reference(const at::Tensor& weight, const at::Tensor& d_output,
                                                   const std::optional<at::Tensor>& pre_act,
                                                   int64_t activation, bool has_d_bias, int64_t heuristic,
                                                   bool return_act_out) {
  NoAutocast no_autocast;
  const ActivationCode act = check_act_linear_dgrad(weight, d_output, pre_act, activation, heuristic, return_act_out);
  const auto dtype = weight.scalar_type();
  const auto mt = math_type(dtype);
  auto d_act = at::matmul(d_output.to(mt), weight.to(mt)).to(dtype).to(mt);  // rounded GEMM result
  at::Tensor d_pre;
  switch (act) {
    case ActivationCode::kNone: d_pre = d_act; break;
    case ActivationCode::kGeluTanh: d_pre = gelu_tanh_backward(d_act, pre_act->to(mt)); break;
    case ActivationCode::kRelu: d_pre = d_act * unpack_mask(*pre_act, weight.size(1)).to(mt); break;
    case ActivationCode::kSquaredRelu: d_pre = d_act * 2 * at::relu(pre_act->to(mt)); break;
    case ActivationCode::kSwiGLU:
    case ActivationCode::kGeGLU: break;  // refused by the checks: the gated family (cpu/gated.cpp)
  }
  std::vector<at::Tensor> out{d_pre.to(dtype).contiguous()};
  if (has_d_bias) out.push_back(out[0].to(mt).sum(0).to(dtype));
  if (return_act_out) out.push_back(act_forward_reference(*pre_act, activation));
  return out;
}

at::Tensor act_forward_reference(const at::Tensor& pre_act, int64_t activation) {
  NoAutocast no_autocast;
  const ActivationCode act = check_act_forward(pre_act, activation);
  auto out = apply_act(pre_act.to(math_type(pre_act.scalar_type())), act).to(pre_act.scalar_type()).contiguous();
  // The schema promises a fresh tensor; the identity on fp32/fp64 would otherwise alias pre_act.
  return out.is_same(pre_act) ? out.clone() : out;
}

}  // namespace fused_dense

TORCH_LIBRARY_IMPL(fused_dense, CPU, m) {
  m.impl("linear_act", &fused_dense::linear_act_reference);
  m.impl("linear_bias_wgrad", &fused_dense::linear_bias_wgrad_reference);
  m.impl("act_linear_dgrad", &fused_dense::act_linear_dgrad_reference);
  m.impl("act_forward", &fused_dense::act_forward_reference);
}
