// fused_dense::fused_mlp: fc2(act(fc1(x))) as one op whose derivative is a C++ autograd
// Function, so a FusedMLP forward + backward runs no Python between its six GEMMs. It is
// composed of the four general ops (dispatched per device, so it serves CPU, CUDA and Meta)
// and follows fused_dense/functional.py's FusedMLPFunc rule for rule: what is saved at each
// checkpoint level, what is recomputed, which gradients are computed. The Python Function stays
// the path for what this op does not take: autocast, tensor parallelism, non-contiguous inputs.
#include <ATen/core/grad_mode.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include "op_calls.h"
#include "reference.h"

namespace fused_dense {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr int64_t kNone = static_cast<int64_t>(ActivationCode::kNone);
constexpr int64_t kRelu = static_cast<int64_t>(ActivationCode::kRelu);

using Opt = std::optional<at::Tensor>;
Opt opt(const at::Tensor& t) { return t.defined() ? Opt(t) : std::nullopt; }

// The general ops, through the dispatcher; an undefined bias or pre-activation is passed as None.
std::vector<at::Tensor> linear_act(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias,
                                   int64_t activation, bool save_pre_act, int64_t heuristic) {
  return op_calls::linear_act(input, weight, opt(bias), activation, save_pre_act, heuristic);
}

std::vector<at::Tensor> act_linear_dgrad(const at::Tensor& weight, const at::Tensor& d_output,
                                         const at::Tensor& pre_act, int64_t activation, bool has_d_bias,
                                         int64_t heuristic, bool return_act_out = false) {
  return op_calls::act_linear_dgrad(weight, d_output, opt(pre_act), activation, has_d_bias, heuristic,
                                    return_act_out);
}

using op_calls::act_forward;
using op_calls::linear_bias_wgrad;

// d_output.sum(0) alone (fc2's weight needs no gradient), accumulated in fp32 for 16-bit types.
at::Tensor bias_grad(const at::Tensor& d_output) {
  const auto t = d_output.scalar_type();
  if (t == at::kHalf || t == at::kBFloat16) return d_output.sum(0, false, at::kFloat).to(t);
  return d_output.sum(0);
}

// The op's own argument names in its errors; the general ops check the rest (dtypes, devices,
// contiguity, bias shapes) as they are called.
void check_fused_mlp(const at::Tensor& x, const at::Tensor& weight1, const at::Tensor& weight2, int64_t activation,
                     int64_t checkpoint_lvl) {
  constexpr const char* op = "fused_dense::fused_mlp";
  TORCH_CHECK_VALUE(activation == 1 || activation == 2 || activation == 3, op,
                    ": activation must be 1 (gelu_approx), 2 (relu) or 3 (sqrelu), got ", activation);
  TORCH_CHECK_VALUE(checkpoint_lvl >= 0 && checkpoint_lvl <= 2, op, ": checkpoint_lvl must be 0, 1 or 2, got ",
                    checkpoint_lvl);
  TORCH_CHECK(x.dim() == 2, op, ": x must be 2-D [batch, in_features], got shape ", x.sizes());
  TORCH_CHECK(weight1.dim() == 2 && weight2.dim() == 2, op, ": weight1 and weight2 must be 2-D, got shapes ",
              weight1.sizes(), " and ", weight2.sizes());
  TORCH_CHECK(weight1.size(1) == x.size(1), op, ": weight1.size(1) must equal x.size(1) = ", x.size(1),
              " (in_features), got weight1 shape ", weight1.sizes());
  TORCH_CHECK(weight2.size(1) == weight1.size(0), op, ": weight2.size(1) must equal weight1.size(0) = ",
              weight1.size(0), " (hidden_features), got weight2 shape ", weight2.sizes());
}

at::Tensor forward_only(const at::Tensor& x, const at::Tensor& weight1, const at::Tensor& bias1,
                        const at::Tensor& weight2, const at::Tensor& bias2, int64_t activation, int64_t heuristic) {
  const auto hidden = linear_act(x, weight1, bias1, activation, false, heuristic)[0];
  return linear_act(hidden, weight2, bias2, kNone, false, kHeuristicAuto)[0];
}

struct FusedMLPFunction : public torch::autograd::Function<FusedMLPFunction> {
  // An absent bias is not a variable input: the inputs' positions in needs_input_grad skip it.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight1, const Opt& b1,
                            const at::Tensor& weight2, const Opt& b2, int64_t activation, int64_t checkpoint_lvl,
                            int64_t heuristic) {
    const at::Tensor bias1 = b1.value_or(at::Tensor()), bias2 = b2.value_or(at::Tensor());
    // The ops below record nothing (grad mode is off here): skip their Autograd kernel outright.
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    size_t edge = 0;
    const bool need_x = ctx->needs_input_grad(edge++), need_w1 = ctx->needs_input_grad(edge++);
    const bool need_b1 = bias1.defined() && ctx->needs_input_grad(edge++);
    const bool need_w2 = ctx->needs_input_grad(edge++);
    const bool need_b2 = bias2.defined() && ctx->needs_input_grad(edge++);
    const bool need_d_pre = need_x || need_w1 || need_b1;  // a gradient flows back through the activation
    const bool need_act_out = need_w2;                     // fc2's weight gradient reads act(fc1(x))
    const bool keeps_act_out = checkpoint_lvl == 0 || (checkpoint_lvl == 1 && activation == kRelu);
    bool keep_pre;
    if (checkpoint_lvl == 2) {
      keep_pre = false;
    } else if (keeps_act_out) {
      keep_pre = need_d_pre;
    } else {  // level 1: the pre-activation also rebuilds the activation output
      keep_pre = need_d_pre || need_act_out;
    }
    const bool recompute_fc1 = checkpoint_lvl == 2 && (need_d_pre || need_act_out);

    auto fc1 = linear_act(x, weight1, bias1, activation, keep_pre, heuristic);
    const at::Tensor act_out = fc1[0];
    const at::Tensor pre_act = keep_pre ? fc1[1] : at::Tensor();
    auto out = linear_act(act_out, weight2, bias2, kNone, false, kHeuristicAuto)[0];

    ctx->saved_data["flags"] = c10::List<bool>({need_x, need_w1, need_b1, need_w2, need_b2, recompute_fc1});
    ctx->saved_data["activation"] = activation;
    ctx->saved_data["heuristic"] = heuristic;
    ctx->save_for_backward({
        (need_w1 || recompute_fc1) ? x : at::Tensor(),
        (need_x || recompute_fc1) ? weight1 : at::Tensor(),
        recompute_fc1 ? bias1 : at::Tensor(),
        need_d_pre ? weight2 : at::Tensor(),
        pre_act,
        (keeps_act_out && need_act_out) ? act_out : at::Tensor(),
    });
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    // The gradients are computed by ops without derivatives: a graph of them cannot be built.
    TORCH_CHECK(!at::GradMode::is_enabled(), "fused_dense::fused_mlp: double backward (create_graph=True) is "
                "not supported; the raw fused_dense ops have no derivative");
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &weight1 = saved[1], &bias1 = saved[2], &weight2 = saved[3];
    at::Tensor pre_act = saved[4], act_out = saved[5];
    const auto flags = ctx->saved_data["flags"].toBoolList();
    const bool need_x = flags.get(0), need_w1 = flags.get(1), need_b1 = flags.get(2), need_w2 = flags.get(3);
    const bool need_b2 = flags.get(4), recompute_fc1 = flags.get(5);
    const bool need_d_pre = need_x || need_w1 || need_b1;
    const int64_t activation = ctx->saved_data["activation"].toInt();
    const int64_t heuristic = ctx->saved_data["heuristic"].toInt();
    const at::Tensor g = grad_outputs[0].contiguous();

    at::Tensor grad_x, grad_w1, grad_b1, grad_w2, grad_b2, d_pre;
    if (recompute_fc1) {
      auto fc1 = linear_act(x, weight1, bias1, activation, need_d_pre, heuristic);
      act_out = fc1[0];
      if (need_d_pre) pre_act = fc1[1];
    }
    // Level 1 rebuilds act(pre_act) for fc2's weight gradient; with a gradient through the
    // activation, in the activation-backward pass, which reads pre_act anyway.
    const bool rebuild_act_out = !act_out.defined() && need_w2;
    if (need_d_pre) {
      auto d = act_linear_dgrad(weight2, g, pre_act, activation, need_b1, heuristic, rebuild_act_out);
      d_pre = d[0];
      if (need_b1) grad_b1 = d[1];
      if (rebuild_act_out) act_out = d.back();
    } else if (rebuild_act_out) {
      act_out = act_forward(pre_act, activation);
    }
    if (need_w2) {
      auto w = linear_bias_wgrad(act_out, g, need_b2);
      grad_w2 = w[0];
      if (need_b2) grad_b2 = w[1];
    } else if (need_b2) {
      grad_b2 = bias_grad(g);
    }
    if (need_x) grad_x = act_linear_dgrad(weight1, d_pre, at::Tensor(), kNone, false, kHeuristicAuto)[0];
    if (need_w1) grad_w1 = linear_bias_wgrad(x, d_pre, false)[0];
    // one entry per forward argument; an absent bias and the three integers have none
    return {grad_x, grad_w1, grad_b1, grad_w2, grad_b2, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor fused_mlp_forward(const at::Tensor& x, const at::Tensor& weight1, const Opt& bias1,
                             const at::Tensor& weight2, const Opt& bias2, int64_t activation, int64_t checkpoint_lvl,
                             int64_t heuristic) {
  check_fused_mlp(x, weight1, weight2, activation, checkpoint_lvl);
  return forward_only(x, weight1, bias1.value_or(at::Tensor()), weight2, bias2.value_or(at::Tensor()), activation,
                      heuristic);
}

at::Tensor fused_mlp_autograd(const at::Tensor& x, const at::Tensor& weight1, const Opt& bias1,
                              const at::Tensor& weight2, const Opt& bias2, int64_t activation, int64_t checkpoint_lvl,
                              int64_t heuristic) {
  check_fused_mlp(x, weight1, weight2, activation, checkpoint_lvl);
  const at::Tensor b1 = bias1.value_or(at::Tensor()), b2 = bias2.value_or(at::Tensor());
  const auto requires = [](const at::Tensor& t) { return t.defined() && t.requires_grad(); };
  if (!at::GradMode::is_enabled() ||
      !(requires(x) || requires(weight1) || requires(b1) || requires(weight2) || requires(b2))) {
    // nothing to differentiate: nothing saved, no graph node
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return forward_only(x, weight1, b1, weight2, b2, activation, heuristic);
  }
  return FusedMLPFunction::apply(x, weight1, opt(b1), weight2, opt(b2), activation, checkpoint_lvl, heuristic);
}

}  // namespace
}  // namespace fused_dense

TORCH_LIBRARY_IMPL(fused_dense, CompositeExplicitAutograd, m) {
  m.impl("fused_mlp", &fused_dense::fused_mlp_forward);
}

TORCH_LIBRARY_IMPL(fused_dense, Autograd, m) {
  m.impl("fused_mlp", &fused_dense::fused_mlp_autograd);
}
