// Argument validation shared by the CPU, CUDA and Meta kernels, so every backend rejects the
// same inputs with the same message.
#include "checks.h"

#include <c10/util/Exception.h>

#include <limits>

namespace fused_dense {
namespace {

bool supported_dtype(at::ScalarType t) {
  return t == at::kHalf || t == at::kBFloat16 || t == at::kFloat || t == at::kDouble;
}

void check_matrix(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.defined(), op, ": ", name, " must be a tensor, got an undefined tensor");
  TORCH_CHECK(t.dim() == 2, op, ": ", name, " must be 2-D, got ", t.dim(), "-D with shape ", t.sizes());
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous (row-major), got strides ",
              t.strides(), " for shape ", t.sizes());
}

void check_float(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(supported_dtype(t.scalar_type()), op, ": ", name,
              " must have dtype float16, bfloat16, float32 or float64, got ", t.scalar_type());
}

void check_same(const char* op, const char* name, const at::Tensor& t, const char* ref_name,
                const at::Tensor& ref) {
  TORCH_CHECK(t.scalar_type() == ref.scalar_type(), op, ": ", name, " must have the dtype of ",
              ref_name, " (", ref.scalar_type(), "), got ", t.scalar_type());
  TORCH_CHECK(t.device() == ref.device(), op, ": ", name, " must be on the device of ", ref_name,
              " (", ref.device(), "), got ", t.device());
}

// The activations of the non-gated ops; a gated code is refused with the ops that take it.
ActivationCode check_activation(const char* op, int64_t activation) {
  TORCH_CHECK_VALUE(!is_gated_activation(activation), op, ": activation ", activation, " (", activation_name(activation),
                    ") is gated; it is taken by the gated ops (gated_linear, gated_linear_dgrad, "
                    "gated_act_forward) and fused_mlp");
  TORCH_CHECK_VALUE(activation >= 0 && activation <= 3, op,
                    ": activation must be 0 (none), 1 (gelu_approx), 2 (relu) or 3 (sqrelu), got ",
                    activation);
  return static_cast<ActivationCode>(activation);
}

// input [B, K] and weight [N, K] of a forward GEMM.
void check_forward_operands(const char* op, const at::Tensor& input, const at::Tensor& weight) {
  check_matrix(op, "input", input);
  check_float(op, "input", input);
  check_matrix(op, "weight", weight);
  check_same(op, "weight", weight, "input", input);
  TORCH_CHECK(input.size(1) == weight.size(1), op, ": input.size(1) (in_features) must equal weight.size(1) = ",
              weight.size(1), ", got input shape ", input.sizes(), " and weight shape ", weight.sizes());
}

// weight [N, K] and d_output [B, N] of a data-gradient GEMM.
void check_dgrad_operands(const char* op, const at::Tensor& weight, const at::Tensor& d_output) {
  check_matrix(op, "weight", weight);
  check_float(op, "weight", weight);
  check_matrix(op, "d_output", d_output);
  check_same(op, "d_output", d_output, "weight", weight);
  TORCH_CHECK(d_output.size(1) == weight.size(0), op, ": d_output.size(1) must equal weight.size(0) = ",
              weight.size(0), " (out_features), got d_output shape ", d_output.sizes());
}

ActivationCode check_gated_activation(const char* op, int64_t activation) {
  TORCH_CHECK_VALUE(is_gated_activation(activation), op, ": activation must be 4 (swiglu) or 5 (geglu), got ", activation,
                    " (", activation_name(activation), ")");
  return static_cast<ActivationCode>(activation);
}

void check_heuristic(const char* op, int64_t heuristic) {
  TORCH_CHECK_VALUE(heuristic >= kHeuristicAuto, op,
                    ": heuristic must be -2 (auto), -1 (unfused) or a cuBLASLt algorithm index >= 0, got ",
                    heuristic);
  TORCH_CHECK_VALUE(heuristic <= std::numeric_limits<int>::max(), op, ": heuristic must fit in int32, got ",
                    heuristic);
}

}  // namespace

const char* activation_name(int64_t activation) {
  if (activation < 0 || activation > std::numeric_limits<int>::max()) return "unknown";
  return core::activation_name(static_cast<core::Activation>(activation));
}

bool is_gated_activation(int64_t activation) {
  return activation >= 0 && activation <= std::numeric_limits<int>::max() &&
         core::is_gated(static_cast<core::Activation>(activation));
}

ActivationCode check_linear_act(const at::Tensor& input, const at::Tensor& weight,
                                const std::optional<at::Tensor>& bias, int64_t activation,
                                bool save_pre_act, int64_t heuristic) {
  constexpr const char* op = "fused_dense::linear_act";
  check_forward_operands(op, input, weight);
  if (bias.has_value() && bias->defined()) {
    check_same(op, "bias", *bias, "input", input);
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == weight.size(0), op, ": bias must have shape [",
                weight.size(0), "] (out_features), got ", bias->sizes());
    TORCH_CHECK(bias->is_contiguous(), op, ": bias must be contiguous, got strides ", bias->strides());
  }
  const ActivationCode act = check_activation(op, activation);
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
  TORCH_CHECK(input.size(0) == d_output.size(0), op, ": d_output.size(0) (batch) must equal input.size(0) = ",
              input.size(0), ", got d_output shape ", d_output.sizes());
}

ActivationCode check_act_linear_dgrad(const at::Tensor& weight, const at::Tensor& d_output,
                                      const std::optional<at::Tensor>& pre_act, int64_t activation,
                                      int64_t heuristic, bool return_act_out) {
  constexpr const char* op = "fused_dense::act_linear_dgrad";
  check_dgrad_operands(op, weight, d_output);
  const ActivationCode act = check_activation(op, activation);
  check_heuristic(op, heuristic);
  TORCH_CHECK_VALUE(!return_act_out || act == ActivationCode::kGeluTanh || act == ActivationCode::kSquaredRelu, op,
                    ": return_act_out=True needs activation 1 (gelu_approx) or 3 (sqrelu), whose pre_act holds "
                    "the pre-activation values, got activation ", activation, " (", activation_name(activation), ")");
  const int64_t B = d_output.size(0), K = weight.size(1);
  const bool has_pre = pre_act.has_value() && pre_act->defined();
  if (act == ActivationCode::kNone) {
    TORCH_CHECK_VALUE(!has_pre, op, ": pre_act must be None when activation is 0 (none)");
    return act;
  }
  TORCH_CHECK_VALUE(has_pre, op, ": pre_act is required for activation ", activation_name(activation));
  const at::Tensor& p = *pre_act;
  TORCH_CHECK(p.device() == weight.device(), op, ": pre_act must be on the device of weight (",
              weight.device(), "), got ", p.device());
  check_matrix(op, "pre_act", p);
  if (act == ActivationCode::kRelu) {
    TORCH_CHECK(p.scalar_type() == at::kByte, op,
                ": for relu, pre_act must be the uint8 bit-mask saved by the forward, got dtype ",
                p.scalar_type());
    TORCH_CHECK(p.size(0) == B && p.size(1) == relu_mask_row_bytes(K), op,
                ": for relu, pre_act (bit-mask) must have shape [", B, ", ", relu_mask_row_bytes(K),
                "] = [batch, ceil(in_features / 8)], got ", p.sizes());
  } else {
    TORCH_CHECK(p.scalar_type() == weight.scalar_type(), op, ": for ", activation_name(activation),
                ", pre_act must have the dtype of weight (", weight.scalar_type(), "), got ",
                p.scalar_type());
    TORCH_CHECK(p.size(0) == B && p.size(1) == K, op, ": pre_act must have shape [", B, ", ", K,
                "] = [batch, in_features], got ", p.sizes());
  }
  return act;
}

ActivationCode check_act_forward(const at::Tensor& pre_act, int64_t activation) {
  constexpr const char* op = "fused_dense::act_forward";
  check_float(op, "pre_act", pre_act);
  TORCH_CHECK(pre_act.is_contiguous(), op, ": pre_act must be contiguous, got strides ", pre_act.strides());
  return check_activation(op, activation);
}

ActivationCode check_gated_linear(const at::Tensor& input, const at::Tensor& weight, int64_t activation,
                                  int64_t heuristic) {
  constexpr const char* op = "fused_dense::gated_linear";
  check_forward_operands(op, input, weight);
  TORCH_CHECK(weight.size(0) % 2 == 0, op, ": weight must be the packed gate and up rows [2 * hidden, in_features], "
              "so weight.size(0) must be even, got weight shape ", weight.sizes());
  const ActivationCode act = check_gated_activation(op, activation);
  check_heuristic(op, heuristic);
  return act;
}

ActivationCode check_gated_linear_dgrad(const at::Tensor& weight, const at::Tensor& d_output,
                                        const at::Tensor& pre_act, int64_t activation, int64_t heuristic) {
  constexpr const char* op = "fused_dense::gated_linear_dgrad";
  check_dgrad_operands(op, weight, d_output);
  const ActivationCode act = check_gated_activation(op, activation);
  check_heuristic(op, heuristic);
  check_matrix(op, "pre_act", pre_act);
  check_same(op, "pre_act", pre_act, "weight", weight);
  const int64_t B = d_output.size(0), H = weight.size(1);
  TORCH_CHECK(pre_act.size(0) == B && pre_act.size(1) == 2 * H, op, ": pre_act must have shape [", B, ", ", 2 * H,
              "] = [batch, 2 * hidden] (the packed gate and up pre-activations), got ", pre_act.sizes());
  return act;
}

ActivationCode check_gated_act_forward(const at::Tensor& pre_act, int64_t activation) {
  constexpr const char* op = "fused_dense::gated_act_forward";
  check_matrix(op, "pre_act", pre_act);
  check_float(op, "pre_act", pre_act);
  TORCH_CHECK(pre_act.size(1) % 2 == 0, op, ": pre_act must be the packed [rows, 2 * hidden], so its width must "
              "be even, got shape ", pre_act.sizes());
  return check_gated_activation(op, activation);
}

at::Tensor empty_pre_act(const at::Tensor& like, int64_t rows, int64_t cols, ActivationCode act) {
  if (act == ActivationCode::kRelu)
    return at::empty({rows, relu_mask_row_bytes(cols)}, like.options().dtype(at::kByte));
  return at::empty({rows, cols}, like.options());
}

}  // namespace fused_dense
