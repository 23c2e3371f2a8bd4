// The linear family's kernels above the backends (linear.cpp has the schemas): the
// flash-attn-compatible entry points, and dense with its C++ autograd Function. All are composed
// of the general ops through the dispatcher, so every device's kernel and the autograd guard run.
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/accumulate.h>
#include <torch/autograd.h>
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

// ---- dense: x @ weight.T + bias, the FusedDense layer's step, with no Python in it ----

constexpr const char* kDenseOp = "fused_dense::dense";
using Opt = std::optional<at::Tensor>;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

at::Tensor dense_forward(const at::Tensor& x, const at::Tensor& weight, const Opt& bias) {
  return op_calls::linear_act(x, weight, bias, kNoActivation, false, kHeuristicAuto)[0];
}

struct DenseFunction : public torch::autograd::Function<DenseFunction> {
  // An absent bias is not a variable input: its position in needs_input_grad is skipped.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight, const Opt& bias) {
    const bool has_bias = bias.has_value() && bias->defined();
    const bool need_x = ctx->needs_input_grad(0), need_w = ctx->needs_input_grad(1);
    const bool need_b = has_bias && ctx->needs_input_grad(2);
    at::AutoDispatchBelowADInplaceOrView below_autograd;  // the ops below record nothing
    auto out = dense_forward(x, weight, bias);
    ctx->saved_data["needs"] = c10::List<bool>({need_x, need_w, need_b});
    // x only for the weight gradient, the weight only for the input gradient
    ctx->save_for_backward({need_w ? x : at::Tensor(), need_x ? weight : at::Tensor()});
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    TORCH_CHECK(!at::GradMode::is_enabled(), kDenseOp, ": double backward (create_graph=True) is "
                "not supported; the raw fused_dense ops have no derivative");
    const auto saved = ctx->get_saved_variables();  // before leaving autograd: unpack hooks may recompute
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    const auto needs = ctx->saved_data["needs"].toBoolList();
    const bool need_x = needs.get(0), need_w = needs.get(1), need_b = needs.get(2);
    const at::Tensor g = grad_outputs[0].contiguous();
    at::Tensor grad_x, grad_w, grad_b;
    if (need_x)
      grad_x = op_calls::act_linear_dgrad(saved[1], g, std::nullopt, kNoActivation, false, kHeuristicAuto, false)[0];
    if (need_w) {
      auto w = op_calls::linear_bias_wgrad(saved[0], g, need_b);
      grad_w = w[0];
      if (need_b) grad_b = w[1];
    } else if (need_b) {
      grad_b = op_calls::bias_grad(g);
    }
    return {grad_x, grad_w, grad_b};
  }
};

void check_dense(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK_VALUE(x.dim() >= 1, kDenseOp, ": x must have at least 1 dimension [..., in_features], got shape ",
                    x.sym_sizes());
  TORCH_CHECK_VALUE(weight.dim() == 2, kDenseOp, ": weight must be 2-D [out_features, in_features], got shape ",
                    weight.sizes());
  TORCH_CHECK_VALUE(x.sym_size(-1) == weight.size(1), kDenseOp,
                    ": x.size(-1) (in_features) must equal weight.size(1) = ", weight.size(1), ", got x shape ",
                    x.sym_sizes(), " and weight shape ", weight.sizes());
}

// x as the 2-D row-major [rows, in_features] the GEMMs read (x itself when it already is), and
// the output's shape [..., out_features]. In the Autograd kernel the reshape and the copy are
// recorded as PyTorch's own ops, outside DenseFunction, so the output takes in-place ops.
at::Tensor rows_of(const at::Tensor& x) {
  if (x.dim() == 2) return x.contiguous();
  const int64_t K = width_of(x, -1);
  const auto lead = x.sym_sizes().slice(0, x.dim() - 1);
  const c10::SymInt rows = K == 0 ? c10::multiply_integers(lead.begin(), lead.end()) : c10::SymInt(-1);
  return x.reshape_symint({rows, K}).contiguous();
}

at::Tensor shaped_like(const at::Tensor& out, const at::Tensor& x) {
  if (x.dim() == 2) return out;
  auto sizes = x.sym_sizes().vec();  // symbolic under torch.compile: no guard on the token count
  sizes.back() = out.sym_size(1);
  return out.view_symint(sizes);
}

Opt contiguous(const Opt& t) { return t.has_value() && t->defined() ? Opt(t->contiguous()) : t; }

at::Tensor dense_composite(const at::Tensor& x, const at::Tensor& weight, const Opt& bias) {
  check_dense(x, weight);
  return shaped_like(dense_forward(rows_of(x), weight.contiguous(), contiguous(bias)), x);
}

at::Tensor dense_autograd(const at::Tensor& x, const at::Tensor& weight, const Opt& bias) {
  check_dense(x, weight);
  const bool bias_requires = bias.has_value() && bias->defined() && bias->requires_grad();
  // row-major operands (a copy, where one is needed, is PyTorch's own differentiable op)
  const at::Tensor x2 = rows_of(x), w = weight.contiguous();
  const Opt b = contiguous(bias);
  if (!at::GradMode::is_enabled() || !(x.requires_grad() || weight.requires_grad() || bias_requires)) {
    at::Tensor out;
    {
      at::AutoDispatchBelowADInplaceOrView below_autograd;  // nothing to differentiate: no node, nothing saved
      out = dense_forward(x2, w, b);
    }
    return shaped_like(out, x);
  }
  return shaped_like(DenseFunction::apply(x2, w, b), x);
}

}  // namespace
}  // namespace fused_dense

TORCH_LIBRARY_IMPL(fused_dense, CompositeExplicitAutograd, m) {
  m.impl("dense", &fused_dense::dense_composite);
}

TORCH_LIBRARY_IMPL(fused_dense, Autograd, m) {
  m.impl("dense", &fused_dense::dense_autograd);
}

TORCH_LIBRARY_IMPL(fused_dense, CompositeImplicitAutograd, m) {
  m.impl("linear_act_forward", &fused_dense::linear_act_forward);
  m.impl("bias_act_linear_dgrad_bgrad", &fused_dense::bias_act_linear_dgrad_bgrad);
}
