// The mlp family: fused_mlp, fc2(act(fc1(x))) with a C++ derivative, and its pieces for the
// tensor-parallel autograd Function (fused_mlp_plan, fused_mlp_train_forward, fused_mlp_backward):
// their schemas and the MLP's argument checks (the plan: mlp.h). Kernels, composed of the linear
// and gated ops through the dispatcher for every device: autograd/mlp.cpp.
#include "torch/mlp.h"

#include <torch/library.h>

namespace fused_dense {

void check_mlp_shapes(const at::Tensor& x, const at::Tensor& weight1, const std::optional<at::Tensor>& bias1,
                      const at::Tensor& weight2, int64_t activation, const char* op) {
  TORCH_CHECK_VALUE(x.dim() == 2, op, ": x must be 2-D [batch, in_features], got shape ", x.sym_sizes());
  TORCH_CHECK_VALUE(weight1.dim() == 2 && weight2.dim() == 2, op, ": weight1 and weight2 must be 2-D, got shapes ",
                    weight1.sizes(), " and ", weight2.sizes());
  TORCH_CHECK_VALUE(weight1.size(1) == x.sym_size(1), op, ": weight1.size(1) must equal x.size(1) = ", x.sym_size(1),
                    " (in_features), got weight1 shape ", weight1.sizes());
  if (!is_gated_activation(activation)) {
    TORCH_CHECK_VALUE(weight2.size(1) == weight1.size(0), op, ": weight2.size(1) must equal weight1.size(0) = ",
                      weight1.size(0), " (hidden_features), got weight2 shape ", weight2.sizes());
    return;
  }
  TORCH_CHECK_VALUE(weight1.size(0) % 2 == 0, op, ": for ", activation_name(activation),
                    ", weight1 is the packed gate and up rows [2 * hidden, in_features], so weight1.size(0) must be "
                    "even, got weight1 shape ", weight1.sizes());
  TORCH_CHECK_VALUE(weight2.size(1) * 2 == weight1.size(0), op, ": for ", activation_name(activation),
                    ", weight2.size(1) must equal weight1.size(0) / 2 = ", weight1.size(0) / 2,
                    " (hidden_features), got weight2 shape ", weight2.sizes());
  TORCH_CHECK_VALUE(!(bias1.has_value() && bias1->defined()), op, ": ", activation_name(activation),
                    " takes no bias1 (the gated layers have no fc1 bias), got a tensor of shape ", bias1->sym_sizes());
}

namespace {

// [keep_pre, keep_act_out, recompute_fc1, save_x, save_weight1, save_bias1, save_weight2]
c10::List<bool> fused_mlp_plan(int64_t activation, int64_t checkpoint_lvl, const c10::List<bool>& needs) {
  constexpr const char* op = "fused_dense::fused_mlp_plan";
  const MlpPlan p = make_plan(activation, checkpoint_lvl, needs_from_list(needs, op), op);
  return c10::List<bool>({p.keep_pre, p.keep_act_out, p.recompute_fc1, p.save_x, p.save_w1, p.save_b1, p.save_w2});
}

}  // namespace
}  // namespace fused_dense

TORCH_LIBRARY_FRAGMENT(fused_dense, m) {
  // fc2(act(fc1(x))) for 2-D x with a C++ derivative; activation 1, 2, 3, or gated 4 (swiglu) / 5 (geglu)
  // with the packed weight1 [2h, K] and no bias1; checkpoint_lvl 0 / 1 / 2;
  // heuristic applies to fc1's forward and the activation's backward.
  m.def("fused_mlp(Tensor x, Tensor weight1, Tensor? bias1, Tensor weight2, Tensor? bias2, int activation, "
        "int checkpoint_lvl, int heuristic) -> Tensor");
  // needs_input_grad: x, weight1, bias1, weight2, bias2. Tensor-free: defined with its function.
  m.def("fused_mlp_plan(int activation, int checkpoint_lvl, bool[] needs_input_grad) -> bool[]",
        &fused_dense::fused_mlp_plan);
  // Composites of the guarded general ops, called inside an autograd Function's forward / backward.
  m.def("fused_mlp_train_forward(Tensor x, Tensor weight1, Tensor? bias1, Tensor weight2, Tensor? bias2, "
        "int activation, int checkpoint_lvl, int heuristic, bool[] needs_input_grad) -> Tensor[]");
  m.def("fused_mlp_backward(Tensor grad_out, Tensor? x, Tensor? weight1, Tensor? bias1, Tensor? weight2, "
        "Tensor[] saved, int activation, int checkpoint_lvl, int heuristic, bool[] needs_input_grad) -> Tensor[]");
}
