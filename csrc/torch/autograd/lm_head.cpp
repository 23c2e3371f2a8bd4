// linear_cross_entropy: the LM head's loss with its C++ autograd Function (lm_head.cpp has the
// schemas), composed of linear_cross_entropy_forward / _backward through the dispatcher.
//
// For the mean and the sum the gradients are computed during the forward (the logits are made
// once) and backward scales them by the incoming gradient, in place: a second backward through
// the same graph is refused. For reduction none the backward recomputes the logits chunk by
// chunk with each row's incoming gradient.
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/grad_mode.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <vector>

#include "torch/checks.h"
#include "torch/lm_head.h"

namespace fused_dense {
namespace {

constexpr const char* kOp = "fused_dense::linear_cross_entropy";
using Opt = std::optional<at::Tensor>;
using Grads = std::array<bool, 3>;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

LceForwardResult call_forward(const at::Tensor& x, const at::Tensor& weight, const Opt& bias, const at::Tensor& target,
                              const LceOptions& o, const Opt& divisor, int64_t chunk_size, Grads grads) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("fused_dense::linear_cross_entropy_forward", "")
                       .typed<LceForwardResult(const at::Tensor&, const at::Tensor&, const Opt&, const at::Tensor&,
                                               int64_t, double, double, double, int64_t, const Opt&, int64_t, Grads,
                                               bool)>();
  return op.call(x, weight, bias, target, o.ignore_index, o.label_smoothing, o.z_loss, o.softcap, o.reduction, divisor,
                 chunk_size, grads, o.fp8);
}

LceBackwardResult call_backward(const at::Tensor& grad_loss, const at::Tensor& x, const at::Tensor& weight,
                                const Opt& bias, const at::Tensor& target, const at::Tensor& lse, const LceOptions& o,
                                const Opt& divisor, int64_t chunk_size, Grads grads) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("fused_dense::linear_cross_entropy_backward", "")
                       .typed<LceBackwardResult(const at::Tensor&, const at::Tensor&, const at::Tensor&, const Opt&,
                                                const at::Tensor&, const at::Tensor&, int64_t, double, double, double,
                                                int64_t, const Opt&, int64_t, Grads, bool)>();
  return op.call(grad_loss, x, weight, bias, target, lse, o.ignore_index, o.label_smoothing, o.z_loss, o.softcap,
                 o.reduction, divisor, chunk_size, grads, o.fp8);
}

void call_scale_grads(at::TensorList grads, const at::Tensor& grad_loss) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("fused_dense::linear_cross_entropy_scale_grads_", "")
                       .typed<void(at::TensorList, const at::Tensor&)>();
  op.call(grads, grad_loss);
}

at::Tensor defined_or_none(const at::Tensor& t, bool need) { return need ? t : at::Tensor(); }

struct LceFunction : public torch::autograd::Function<LceFunction> {
  // An absent bias is not a variable input: its position in needs_input_grad is skipped.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight, const Opt& bias,
                            const at::Tensor& target, const Opt& divisor, int64_t ignore_index, double label_smoothing,
                            double z_loss, double softcap, int64_t reduction, int64_t chunk_size, bool fp8) {
    const LceOptions o{ignore_index, label_smoothing, z_loss, softcap, reduction, fp8};
    const bool has_bias = bias.has_value() && bias->defined();
    const Grads needs{ctx->needs_input_grad(0), ctx->needs_input_grad(1), has_bias && ctx->needs_input_grad(2)};
    ctx->saved_data["needs"] = c10::List<bool>({needs[0], needs[1], needs[2]});
    at::AutoDispatchBelowADInplaceOrView below_autograd;  // the ops below record nothing
    if (reduction != kReduceNone) {
      auto [loss, lse, gi, gw, gb] = call_forward(x, weight, bias, target, o, divisor, chunk_size, needs);
      ctx->saved_data["grads"] = c10::List<at::Tensor>({gi, gw, gb});
      ctx->saved_data["spent"] = false;
      return loss;
    }
    auto [loss, lse, gi, gw, gb] = call_forward(x, weight, bias, target, o, divisor, chunk_size, {false, false, false});
    ctx->save_for_backward({x, weight, has_bias ? *bias : at::Tensor(), target, lse});
    ctx->saved_data["options"] = c10::List<double>({label_smoothing, z_loss, softcap});
    ctx->saved_data["ints"] = c10::List<int64_t>({ignore_index, reduction, chunk_size});
    ctx->saved_data["fp8"] = fp8;
    return loss;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    TORCH_CHECK(!at::GradMode::is_enabled(), kOp, ": double backward (create_graph=True) is not supported");
    const auto needs = ctx->saved_data["needs"].toBoolList();
    const Grads need{needs.get(0), needs.get(1), needs.get(2)};
    variable_list out(12);
    if (ctx->saved_data.count("grads")) {
      TORCH_CHECK(!ctx->saved_data["spent"].toBool(), kOp, ": a second backward through the same graph "
                  "(retain_graph=True) is not supported with reduction 'mean' or 'sum': their gradients are computed "
                  "in the forward and handed over by the first backward; use reduction 'none' and reduce outside");
      const at::Tensor g = grad_outputs[0];
      auto grads = ctx->saved_data["grads"].toTensorList();
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      std::vector<at::Tensor> scaled;
      for (int i = 0; i < 3; ++i) {
        if (!need[i]) continue;
        out[i] = grads.get(i);
        if (out[i].sym_numel() > 0) scaled.push_back(out[i]);
      }
      call_scale_grads(scaled, g);
      ctx->saved_data["grads"] = c10::List<at::Tensor>();  // the returned tensors are the only references
      ctx->saved_data["spent"] = true;
      return out;
    }
    const auto saved = ctx->get_saved_variables();  // before leaving autograd: unpack hooks may recompute
    const auto reals = ctx->saved_data["options"].toDoubleList();
    const auto ints = ctx->saved_data["ints"].toIntList();
    const LceOptions o{ints.get(0), reals.get(0), reals.get(1), reals.get(2), ints.get(1),
                       ctx->saved_data["fp8"].toBool()};
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    const Opt bias = saved[2].defined() ? Opt(saved[2]) : std::nullopt;
    auto [gi, gw, gb] = call_backward(grad_outputs[0].contiguous(), saved[0], saved[1], bias, saved[3], saved[4], o,
                                      std::nullopt, ints.get(2), need);
    out[0] = defined_or_none(gi, need[0]);
    out[1] = defined_or_none(gw, need[1]);
    out[2] = defined_or_none(gb, need[2]);
    return out;
  }
};

// input [..., d] as rows [N, d] and target [...] as [N] (PyTorch's own differentiable reshape,
// outside the Function), after checking that their leading shapes agree.
std::pair<at::Tensor, at::Tensor> rows_of(const at::Tensor& input, const at::Tensor& target) {
  TORCH_CHECK_VALUE(input.dim() >= 1, kOp, ": input must be [..., d], got shape ", input.sym_sizes());
  TORCH_CHECK_VALUE(target.sym_sizes() == input.sym_sizes().slice(0, input.dim() - 1), kOp,
                    ": target must have input's leading shape ", input.sym_sizes().slice(0, input.dim() - 1),
                    " (one class index a row of input), got shape ", target.sym_sizes());
  const int64_t d = width_of(input, -1);
  const at::Tensor x =
      input.dim() == 2 ? input.contiguous() : input.reshape_symint({target.sym_numel(), d}).contiguous();
  return {x, target.reshape({-1}).contiguous()};
}

at::Tensor shaped_loss(const at::Tensor& loss, const at::Tensor& target, int64_t reduction) {
  return reduction == kReduceNone ? loss.view_symint(target.sym_sizes()) : loss;
}

Opt contiguous(const Opt& t) { return t.has_value() && t->defined() ? Opt(t->contiguous()) : t; }

at::Tensor lce_composite(const at::Tensor& input, const at::Tensor& weight, const Opt& bias, const at::Tensor& target,
                         int64_t ignore_index, double label_smoothing, double z_loss, double softcap, int64_t reduction,
                         const Opt& divisor, int64_t chunk_size, bool fp8) {
  auto [x, t] = rows_of(input, target);
  const LceOptions o{ignore_index, label_smoothing, z_loss, softcap, reduction, fp8};
  auto res = call_forward(x, weight.contiguous(), contiguous(bias), t, o, divisor, chunk_size, {false, false, false});
  return shaped_loss(std::get<0>(res), target, reduction);
}

at::Tensor lce_autograd(const at::Tensor& input, const at::Tensor& weight, const Opt& bias, const at::Tensor& target,
                        int64_t ignore_index, double label_smoothing, double z_loss, double softcap, int64_t reduction,
                        const Opt& divisor, int64_t chunk_size, bool fp8) {
  const bool bias_requires = bias.has_value() && bias->defined() && bias->requires_grad();
  if (!at::GradMode::is_enabled() || !(input.requires_grad() || weight.requires_grad() || bias_requires)) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;  // nothing to differentiate: no node, nothing saved
    return lce_composite(input, weight, bias, target, ignore_index, label_smoothing, z_loss, softcap, reduction,
                         divisor, chunk_size, fp8);
  }
  auto [x, t] = rows_of(input, target);
  const at::Tensor loss = LceFunction::apply(x, weight.contiguous(), contiguous(bias), t, divisor, ignore_index,
                                             label_smoothing, z_loss, softcap, reduction, chunk_size, fp8);
  return shaped_loss(loss, target, reduction);
}

}  // namespace
}  // namespace fused_dense

TORCH_LIBRARY_IMPL(fused_dense, CompositeExplicitAutograd, m) {
  m.impl("linear_cross_entropy", &fused_dense::lce_composite);
}

TORCH_LIBRARY_IMPL(fused_dense, Autograd, m) {
  m.impl("linear_cross_entropy", &fused_dense::lce_autograd);
}
