// The mlp family's kernels (mlp.cpp has the schemas and checks): fused_mlp, fc2(act(fc1(x))),
// with its C++ autograd, and the halves the tensor-parallel Function calls.
//
// Three layers share one plan (MlpPlan: what the forward keeps for backward, what backward
// recomputes) and one forward / backward body:
//   * fused_mlp                — the op with a C++ autograd Function (FusedMLPFunction): what
//                                fused_dense.fused_mlp_func and FusedMLP run on one process;
//   * fused_mlp_train_forward /
//     fused_mlp_backward       — the same two halves as ops, for an autograd Function that adds
//                                communication between them (fused_dense.functional.FusedMLPFunc,
//                                the tensor-parallel path): it calls these and holds no rule;
//   * fused_mlp_plan           — the plan itself (mlp.cpp), so that Function knows what to save
//                                and when its input must be gathered.
// Everything is composed of the general ops through the dispatcher, so it serves CPU, CUDA and
// Meta alike. The rules are stated in docs/contract.md ("Checkpoint levels").
// The gated activations (swiglu, geglu) run on the same plan and bodies: fc1 is then the gated
// op over the packed weight1 [2h, K] (gated_linear), its pre-activation the packed gu [B, 2h], the
// activation output act(g) * u [B, h], and the activation backward gated_linear_dgrad.
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/grad_mode.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include "torch/autograd/op_calls.h"
#include "torch/autograd/saved.h"
#include "torch/mlp.h"

namespace fused_dense {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using Opt = std::optional<at::Tensor>;

Opt opt(const at::Tensor& t) { return t.defined() ? Opt(t) : std::nullopt; }

// fc1 and its activation: [act_out] (+ [pre_act] when save_pre_act).
std::vector<at::Tensor> fc1_forward(const at::Tensor& x, const at::Tensor& weight1, const at::Tensor& bias1,
                                    int64_t activation, bool save_pre_act, int64_t heuristic) {
  if (is_gated_activation(activation)) return op_calls::gated_linear(x, weight1, activation, save_pre_act, heuristic);
  return op_calls::linear_act(x, weight1, opt(bias1), activation, save_pre_act, heuristic);
}

// The gradient at fc1's pre-activation from fc2's output gradient: [d_pre] (+ [d_bias1] when
// has_d_bias) (+ [act_out] when return_act_out).
std::vector<at::Tensor> act_backward(const at::Tensor& weight2, const at::Tensor& g, const at::Tensor& pre_act,
                                     int64_t activation, bool has_d_bias, int64_t heuristic, bool return_act_out) {
  if (is_gated_activation(activation))
    return op_calls::gated_linear_dgrad(weight2, g, pre_act, activation, heuristic, return_act_out);
  return op_calls::act_linear_dgrad(weight2, g, opt(pre_act), activation, has_d_bias, heuristic, return_act_out);
}

at::Tensor act_rebuild(const at::Tensor& pre_act, int64_t activation) {
  if (is_gated_activation(activation)) return op_calls::gated_act_forward(pre_act, activation);
  return op_calls::act_forward(pre_act, activation);
}

// What the forward keeps for backward, beyond the inputs named by the plan's save_* flags.
struct MlpSaved {
  at::Tensor pre_act, act_out;
};

at::Tensor mlp_forward(const MlpPlan& p, const at::Tensor& x, const at::Tensor& weight1, const at::Tensor& bias1,
                       const at::Tensor& weight2, const at::Tensor& bias2, int64_t activation, int64_t heuristic,
                       MlpSaved* saved) {
  auto fc1 = fc1_forward(x, weight1, bias1, activation, p.keep_pre, heuristic);
  auto out = op_calls::linear_act(fc1[0], weight2, opt(bias2), kNoActivation, false, kHeuristicAuto)[0];
  if (saved != nullptr) {
    saved->pre_act = p.keep_pre ? fc1[1] : at::Tensor();
    saved->act_out = p.keep_act_out ? fc1[0] : at::Tensor();
  }
  return out;
}

// Gradients of everything but weight1 (whose GEMM the tensor-parallel Function overlaps with the
// input gradient's reduction), plus d_pre, the gradient at the pre-activation that weight1's
// gradient reads. x is needed only when the plan recomputes fc1.
struct MlpGrads {
  at::Tensor d_pre, x, b1, w2, b2;
};

// release_saved: free pre_act and act_out after their last reader (drop_saved); the order puts fc2's
// weight gradient, act_out's last reader, before the activation's backward allocates d_pre where
// act_out is at hand, so the step never holds act_out and d_pre at once (the same bits in either
// order: the two read nothing of each other).
MlpGrads mlp_backward(const MlpPlan& p, const at::Tensor& g, const at::Tensor& x, const at::Tensor& weight1,
                      const at::Tensor& bias1, const at::Tensor& weight2, MlpSaved s, int64_t activation,
                      int64_t heuristic, bool release_saved) {
  MlpGrads r;
  if (p.recompute_fc1) {
    auto fc1 = fc1_forward(x, weight1, bias1, activation, p.need_d_pre, heuristic);
    s.act_out = fc1[0];
    if (p.need_d_pre) s.pre_act = fc1[1];
  }
  // Level 1 rebuilds act(pre_act) for fc2's weight gradient; with a gradient through the
  // activation, in the activation-backward pass, which reads pre_act anyway.
  const bool rebuild_act_out = !s.act_out.defined() && p.need_act_out;
  const auto fc2_grads = [&] {
    if (p.need.w2) {
      auto w = op_calls::linear_bias_wgrad(s.act_out, g, p.need.b2);
      r.w2 = w[0];
      if (p.need.b2) r.b2 = w[1];
    } else if (p.need.b2) {
      r.b2 = op_calls::bias_grad(g);
    }
    // an act_out that shares pre_act's storage goes with pre_act
    const bool shares = s.act_out.defined() && s.pre_act.defined() && s.act_out.is_alias_of(s.pre_act);
    drop_saved(s.act_out, release_saved && !shares);
  };
  if (!rebuild_act_out) fc2_grads();
  // The gated d_pre is written over gu where nothing reads gu after it (gu is this backward's own:
  // freed after its last reader, or recomputed): the step never holds gu and d_gu at once. The
  // same op and choice as out of place, so the same bits.
  const bool gated_in_place = p.need_d_pre && !p.need.b1 && is_gated_activation(activation) && !rebuild_act_out &&
                              (release_saved || p.recompute_fc1) && may_write_over(s.pre_act) &&
                              !(s.act_out.defined() && s.act_out.is_alias_of(s.pre_act));
  if (gated_in_place) {
    op_calls::gated_linear_dgrad_(s.pre_act, weight2, g, activation, heuristic);
    r.d_pre = std::move(s.pre_act);  // gu's storage, now d_gu: freed with d_pre, not before
  } else if (p.need_d_pre) {
    auto d = act_backward(weight2, g, s.pre_act, activation, p.need.b1, heuristic, rebuild_act_out);
    r.d_pre = d[0];
    if (p.need.b1) r.b1 = d[1];
    if (rebuild_act_out) s.act_out = d.back();
  } else if (rebuild_act_out) {
    s.act_out = act_rebuild(s.pre_act, activation);
  }
  drop_saved(s.pre_act, release_saved);
  if (rebuild_act_out) fc2_grads();
  if (p.need.x) r.x = op_calls::act_linear_dgrad(weight1, r.d_pre, std::nullopt, kNoActivation, false, kHeuristicAuto,
                                                 false)[0];
  return r;
}

at::Tensor weight1_grad(const at::Tensor& x, const at::Tensor& d_pre) {
  return op_calls::linear_bias_wgrad(x, d_pre, false)[0];
}

constexpr const char* kOp = "fused_dense::fused_mlp";

struct FusedMLPFunction : public torch::autograd::Function<FusedMLPFunction> {
  // An absent bias is not a variable input: the inputs' positions in needs_input_grad skip it.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight1, const Opt& b1,
                            const at::Tensor& weight2, const Opt& b2, int64_t activation, int64_t checkpoint_lvl,
                            int64_t heuristic) {
    const at::Tensor bias1 = b1.value_or(at::Tensor()), bias2 = b2.value_or(at::Tensor());
    // The ops below record nothing (grad mode is off here): skip their Autograd kernel outright.
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    size_t edge = 0;
    MlpNeeds need;
    need.x = ctx->needs_input_grad(edge++);
    need.w1 = ctx->needs_input_grad(edge++);
    need.b1 = bias1.defined() && ctx->needs_input_grad(edge++);
    need.w2 = ctx->needs_input_grad(edge++);
    need.b2 = bias2.defined() && ctx->needs_input_grad(edge++);
    const MlpPlan p = make_plan(activation, checkpoint_lvl, need, kOp);
    MlpSaved s;
    auto out = mlp_forward(p, x, weight1, bias1, weight2, bias2, activation, heuristic, &s);
    ctx->saved_data["needs"] = c10::List<bool>({need.x, need.w1, need.b1, need.w2, need.b2});
    ctx->saved_data["activation"] = activation;
    ctx->saved_data["checkpoint_lvl"] = checkpoint_lvl;
    ctx->saved_data["heuristic"] = heuristic;
    ctx->save_for_backward({p.save_x ? x : at::Tensor(), p.save_w1 ? weight1 : at::Tensor(),
                            p.save_b1 ? bias1 : at::Tensor(), p.save_w2 ? weight2 : at::Tensor(), s.pre_act,
                            s.act_out});
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    // The gradients are computed by ops without derivatives: a graph of them cannot be built.
    TORCH_CHECK(!at::GradMode::is_enabled(), kOp, ": double backward (create_graph=True) is "
                "not supported; the raw fused_dense ops have no derivative");
    // Unpacked before autograd is left below: an unpack hook may recompute the forward
    // (torch.utils.checkpoint without reentrance), which must record its own graph.
    const auto saved = ctx->get_saved_variables();
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    const auto flags = ctx->saved_data["needs"].toBoolList();
    const MlpNeeds need{flags.get(0), flags.get(1), flags.get(2), flags.get(3), flags.get(4)};
    const int64_t activation = ctx->saved_data["activation"].toInt();
    const int64_t heuristic = ctx->saved_data["heuristic"].toInt();
    const MlpPlan p = make_plan(activation, ctx->saved_data["checkpoint_lvl"].toInt(), need, kOp);
    const at::Tensor g = grad_outputs[0].contiguous();
    // The node's saved intermediates are freed after their last reader unless the graph is kept
    // (retain_graph=True), whose next backward reads them again.
    MlpGrads r = mlp_backward(p, g, saved[0], saved[1], saved[2], saved[3], MlpSaved{saved[4], saved[5]},
                              activation, heuristic, may_free_saved());
    at::Tensor grad_w1 = need.w1 ? weight1_grad(saved[0], r.d_pre) : at::Tensor();
    // d_pre's last reader is issued; written over the saved gu, it is that storage, which the
    // node would hold until this returns
    drop_saved(r.d_pre, true);
    // one entry per forward argument; an absent bias and the three integers have none
    return {r.x, grad_w1, r.b1, r.w2, r.b2, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor fused_mlp_forward(const at::Tensor& x, const at::Tensor& weight1, const Opt& bias1,
                             const at::Tensor& weight2, const Opt& bias2, int64_t activation, int64_t checkpoint_lvl,
                             int64_t heuristic) {
  check_mlp_shapes(x, weight1, bias1, weight2, activation, kOp);
  const MlpPlan p = make_plan(activation, checkpoint_lvl, MlpNeeds{}, kOp);
  return mlp_forward(p, x, weight1, bias1.value_or(at::Tensor()), weight2, bias2.value_or(at::Tensor()),
                     activation, heuristic, nullptr);
}

at::Tensor fused_mlp_autograd(const at::Tensor& x, const at::Tensor& weight1, const Opt& bias1,
                              const at::Tensor& weight2, const Opt& bias2, int64_t activation, int64_t checkpoint_lvl,
                              int64_t heuristic) {
  check_mlp_shapes(x, weight1, bias1, weight2, activation, kOp);
  check_mlp_codes(activation, checkpoint_lvl, kOp);
  const auto requires = [](const Opt& t) { return t.has_value() && t->defined() && t->requires_grad(); };
  if (!at::GradMode::is_enabled() ||
      !(x.requires_grad() || weight1.requires_grad() || requires(bias1) || weight2.requires_grad() ||
        requires(bias2))) {
    // nothing to differentiate: nothing saved, no graph node
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return fused_mlp_forward(x, weight1, bias1, weight2, bias2, activation, checkpoint_lvl, heuristic);
  }
  return FusedMLPFunction::apply(x, weight1, bias1, weight2, bias2, activation, checkpoint_lvl, heuristic);
}

// ---- the halves as ops, for the tensor-parallel autograd Function ----

constexpr const char* kTrainForwardOp = "fused_dense::fused_mlp_train_forward";
constexpr const char* kBackwardOp = "fused_dense::fused_mlp_backward";

// [out] + [pre_act if keep_pre] + [act_out if keep_act_out]
std::vector<at::Tensor> fused_mlp_train_forward(const at::Tensor& x, const at::Tensor& weight1, const Opt& bias1,
                                                const at::Tensor& weight2, const Opt& bias2, int64_t activation,
                                                int64_t checkpoint_lvl, int64_t heuristic,
                                                const c10::List<bool>& needs) {
  check_mlp_shapes(x, weight1, bias1, weight2, activation, kTrainForwardOp);
  const MlpPlan p =
      make_plan(activation, checkpoint_lvl, needs_from_list(needs, kTrainForwardOp), kTrainForwardOp);
  MlpSaved s;
  std::vector<at::Tensor> res{mlp_forward(p, x, weight1, bias1.value_or(at::Tensor()), weight2,
                                          bias2.value_or(at::Tensor()), activation, heuristic, &s)};
  if (p.keep_pre) res.push_back(s.pre_act);
  if (p.keep_act_out) res.push_back(s.act_out);
  return res;
}

// [d_pre if weight1 needs a gradient] + [grad_x] + [grad_bias1] + [grad_weight2] + [grad_bias2],
// each only where that input needs a gradient. x: given when the plan recomputes fc1 (else None).
std::vector<at::Tensor> fused_mlp_backward(const at::Tensor& grad_out, const Opt& x, const Opt& weight1,
                                           const Opt& bias1, const Opt& weight2, at::TensorList saved,
                                           int64_t activation, int64_t checkpoint_lvl, int64_t heuristic,
                                           const c10::List<bool>& needs) {
  const MlpPlan p = make_plan(activation, checkpoint_lvl, needs_from_list(needs, kBackwardOp), kBackwardOp);
  const size_t expected = static_cast<size_t>(p.keep_pre) + static_cast<size_t>(p.keep_act_out);
  TORCH_CHECK_VALUE(saved.size() == expected, kBackwardOp, ": saved must hold the ", expected,
                    " tensor(s) fused_mlp_train_forward returned after out for this plan, got ", saved.size());
  const auto need_given = [](bool needed, const Opt& t, const char* name) {
    TORCH_CHECK_VALUE(!needed || (t.has_value() && t->defined()), kBackwardOp, ": ", name,
                      " is required by this plan, got None");
  };
  need_given(p.recompute_fc1, x, "x");
  need_given(p.need.x || p.recompute_fc1, weight1, "weight1");
  need_given(p.need_d_pre, weight2, "weight2");
  MlpSaved s;
  size_t i = 0;
  if (p.keep_pre) s.pre_act = saved[i++];
  if (p.keep_act_out) s.act_out = saved[i++];
  const auto val = [](const Opt& t) { return t.value_or(at::Tensor()); };
  // The tensor-parallel Function owns what it saved: nothing of it is freed here.
  MlpGrads r = mlp_backward(p, grad_out.contiguous(), val(x), val(weight1), val(bias1), val(weight2), s,
                            activation, heuristic, /*release_saved=*/false);
  std::vector<at::Tensor> res;
  if (p.need.w1) res.push_back(r.d_pre);
  if (p.need.x) res.push_back(r.x);
  if (p.need.b1) res.push_back(r.b1);
  if (p.need.w2) res.push_back(r.w2);
  if (p.need.b2) res.push_back(r.b2);
  return res;
}

}  // namespace
}  // namespace fused_dense

TORCH_LIBRARY_IMPL(fused_dense, CompositeExplicitAutograd, m) {
  m.impl("fused_mlp", &fused_dense::fused_mlp_forward);
}

TORCH_LIBRARY_IMPL(fused_dense, Autograd, m) {
  m.impl("fused_mlp", &fused_dense::fused_mlp_autograd);
}

// The halves decompose into the general ops (whose Autograd kernel refuses tensors that require
// grad while grad mode is on): they are called from inside an autograd Function's forward / backward.
TORCH_LIBRARY_IMPL(fused_dense, CompositeImplicitAutograd, m) {
  m.impl("fused_mlp_train_forward", &fused_dense::fused_mlp_train_forward);
  m.impl("fused_mlp_backward", &fused_dense::fused_mlp_backward);
}
