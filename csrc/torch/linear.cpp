// The linear family: linear_act, act_linear_dgrad, linear_bias_wgrad, act_forward, the
// flash-attn-compatible entry points over them (linear_act_forward, bias_act_linear_dgrad_bgrad)
// and dense, the layer with its derivative: their schemas and argument checks. Kernels: cpu/,
// meta/, cuda/linear.cpp; the composites and dense's autograd: autograd/linear.cpp.
#include "torch/linear.h"

#include <c10/util/Exception.h>
#include <torch/library.h>

#include "torch/autograd/guard.h"

namespace fused_dense {
namespace {

// The activations of the plain ops; a gated code is refused with the ops that take it.
ActivationCode check_plain_activation(const char* op, int64_t activation) {
  TORCH_CHECK_VALUE(!is_gated_activation(activation), op, ": activation ", activation, " (", activation_name(activation),
                    ") is gated; it is taken by the gated ops (gated_linear, gated_linear_dgrad, "
                    "gated_act_forward) and fused_mlp");
  return check_activation_in(op, activation, kNoActivation, kLastPlainActivation);
}

}  // namespace

void check_forward_operands(const char* op, const at::Tensor& input, const at::Tensor& weight) {
  check_matrix(op, "input", input);
  check_float(op, "input", input);
  check_matrix(op, "weight", weight);
  check_same(op, "weight", weight, "input", input);
  TORCH_CHECK_VALUE(input.sym_size(1) == weight.size(1), op,
                    ": input.size(1) (in_features) must equal weight.size(1) = ", weight.size(1), ", got input shape ",
                    input.sym_sizes(), " and weight shape ", weight.sizes());
}

void check_dgrad_operands(const char* op, const at::Tensor& weight, const at::Tensor& d_output) {
  check_matrix(op, "weight", weight);
  check_float(op, "weight", weight);
  check_matrix(op, "d_output", d_output);
  check_same(op, "d_output", d_output, "weight", weight);
  TORCH_CHECK_VALUE(d_output.sym_size(1) == weight.size(0), op,
                    ": d_output.size(1) must equal weight.size(0) = ", weight.size(0),
                    " (out_features), got d_output shape ", d_output.sym_sizes());
}

ActivationCode check_linear_act(const at::Tensor& input, const at::Tensor& weight,
                                const std::optional<at::Tensor>& bias, int64_t activation,
                                bool save_pre_act, int64_t heuristic) {
  constexpr const char* op = "fused_dense::linear_act";
  check_forward_operands(op, input, weight);
  if (bias.has_value() && bias->defined()) {
    check_same(op, "bias", *bias, "input", input);
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == weight.size(0), op, ": bias must have shape [",
                      weight.size(0), "] (out_features), got ", bias->sizes());
    TORCH_CHECK_VALUE(bias->is_contiguous(), op, ": bias must be contiguous, got strides ", bias->strides());
  }
  const ActivationCode act = check_plain_activation(op, activation);
  TORCH_CHECK_VALUE(!(save_pre_act && act == ActivationCode::kNone), op,
                    ": save_pre_act=True needs an activation; with activation 0 (none) there is no "
                    "pre-activation to save");
  check_heuristic(op, heuristic);
  return act;
}

void check_wgrad(const at::Tensor& input, const at::Tensor& d_output) {
  constexpr const char* op = "fused_dense::linear_bias_wgrad";
  check_matrix(op, "input", input);
  check_float(op, "input", input);
  check_matrix(op, "d_output", d_output);
  check_same(op, "d_output", d_output, "input", input);
  TORCH_CHECK_VALUE(input.sym_size(0) == d_output.sym_size(0), op,
                    ": d_output.size(0) (batch) must equal input.size(0) = ", input.sym_size(0),
                    ", got d_output shape ", d_output.sym_sizes());
}

ActivationCode check_act_linear_dgrad(const at::Tensor& weight, const at::Tensor& d_output,
                                      const std::optional<at::Tensor>& pre_act, int64_t activation,
                                      int64_t heuristic, bool return_act_out) {
  constexpr const char* op = "fused_dense::act_linear_dgrad";
  check_dgrad_operands(op, weight, d_output);
  const ActivationCode act = check_plain_activation(op, activation);
  check_heuristic(op, heuristic);
  TORCH_CHECK_VALUE(!return_act_out || act == ActivationCode::kGeluTanh || act == ActivationCode::kSquaredRelu, op,
                    ": return_act_out=True needs activation 1 (gelu_approx) or 3 (sqrelu), whose pre_act holds "
                    "the pre-activation values, got activation ", activation, " (", activation_name(activation), ")");
  const c10::SymInt B = d_output.sym_size(0);
  const int64_t K = weight.size(1);
  const bool has_pre = pre_act.has_value() && pre_act->defined();
  if (act == ActivationCode::kNone) {
    TORCH_CHECK_VALUE(!has_pre, op, ": pre_act must be None when activation is 0 (none)");
    return act;
  }
  TORCH_CHECK_VALUE(has_pre, op, ": pre_act is required for activation ", activation_name(activation));
  const at::Tensor& p = *pre_act;
  check_same_device(op, "pre_act", p, "weight", weight);
  check_matrix(op, "pre_act", p);
  if (act == ActivationCode::kRelu) {
    TORCH_CHECK_VALUE(p.scalar_type() == at::kByte, op,
                      ": for relu, pre_act must be the uint8 bit-mask saved by the forward, got dtype ",
                      p.scalar_type());
    TORCH_CHECK_VALUE(p.sym_size(0) == B && p.sym_size(1) == relu_mask_row_bytes(K), op,
                      ": for relu, pre_act (bit-mask) must have shape [", B, ", ", relu_mask_row_bytes(K),
                      "] = [batch, ceil(in_features / 8)], got ", p.sym_sizes());
  } else {
    TORCH_CHECK_VALUE(p.scalar_type() == weight.scalar_type(), op, ": for ", activation_name(activation),
                      ", pre_act must have the dtype of weight (", weight.scalar_type(), "), got ",
                      p.scalar_type());
    TORCH_CHECK_VALUE(p.sym_size(0) == B && p.sym_size(1) == K, op, ": pre_act must have shape [", B, ", ", K,
                      "] = [batch, in_features], got ", p.sym_sizes());
  }
  return act;
}

ActivationCode check_act_forward(const at::Tensor& pre_act, int64_t activation) {
  constexpr const char* op = "fused_dense::act_forward";
  check_float(op, "pre_act", pre_act);
  TORCH_CHECK_VALUE(pre_act.is_contiguous(), op, ": pre_act must be contiguous, got strides ", pre_act.sym_strides());
  return check_plain_activation(op, activation);
}

}  // namespace fused_dense

TORCH_LIBRARY_FRAGMENT(fused_dense, m) {
  using fused_dense::def_raw_op;
  // activation: 0 none, 1 gelu_approx (tanh), 2 relu, 3 sqrelu (4, 5: the gated family).
  // heuristic: -2 auto, -1 unfused, >= 0 index into cuBLASLt's algorithm list.
  def_raw_op(m, "linear_act(Tensor input, Tensor weight, Tensor? bias, int activation, bool save_pre_act, "
                "int heuristic) -> Tensor[]");
  // return_act_out (gelu_approx, sqrelu): act(pre_act) appended to the results, made by the pass
  // that reads pre_act anyway (checkpoint level 1's recompute).
  def_raw_op(m, "act_linear_dgrad(Tensor weight, Tensor d_output, Tensor? pre_act, int activation, "
                "bool has_d_bias, int heuristic, bool return_act_out=False) -> Tensor[]");
  def_raw_op(m, "linear_bias_wgrad(Tensor input, Tensor d_output, bool has_d_bias) -> Tensor[]");
  def_raw_op(m, "act_forward(Tensor pre_act, int activation) -> Tensor");
  // flash-attn's fused_dense_lib contract: is_gelu picks GELU, else ReLU. Composites of the ops
  // above (autograd/linear.cpp), whose guard they reach.
  m.def("linear_act_forward(Tensor input, Tensor weight, Tensor? bias, bool is_gelu, "
        "bool save_pre_act, int heuristic) -> Tensor[]");
  m.def("bias_act_linear_dgrad_bgrad(Tensor weight, Tensor d_output, Tensor pre_act, bool is_gelu, "
        "int heuristic) -> Tensor[]");
  // x @ weight.T + bias for x [..., in_features] with a C++ derivative (FusedDense's step on one
  // process): the forward is linear_act, the backward act_linear_dgrad and linear_bias_wgrad (the
  // bias gradient fused into the weight gradient's GEMM), heuristic 'auto' throughout; x is folded
  // to 2-D rows and the output unfolded around them (autograd/linear.cpp).
  m.def("dense(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
}
