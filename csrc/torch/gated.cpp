// The gated family: gated_linear, gated_linear_dgrad (and gated_linear_dgrad_, in place over
// pre_act), gated_act_forward (activation 4 swiglu or 5 geglu over the packed layout of
// core/common/types.h, kGatedInterleave): their schemas and argument checks. Kernels: cpu/, meta/, cuda/gated.cpp.
#include "torch/gated.h"

#include <c10/util/Exception.h>
#include <torch/library.h>

#include "torch/autograd/guard.h"
#include "torch/linear.h"

namespace fused_dense {
namespace {

ActivationCode check_gated_activation(const char* op, int64_t activation) {
  return check_activation_in(op, activation, kLastPlainActivation + 1, kLastActivation);
}

}  // namespace

ActivationCode check_gated_linear(const at::Tensor& input, const at::Tensor& weight, int64_t activation,
                                  int64_t heuristic) {
  constexpr const char* op = "fused_dense::gated_linear";
  check_forward_operands(op, input, weight);
  TORCH_CHECK_VALUE(weight.size(0) % 2 == 0, op,
                    ": weight must be the packed gate and up rows [2 * hidden, in_features], "
                    "so weight.size(0) must be even, got weight shape ", weight.sizes());
  const ActivationCode act = check_gated_activation(op, activation);
  check_heuristic(op, heuristic);
  return act;
}

namespace {

ActivationCode check_gated_dgrad_call(const char* op, const at::Tensor& weight, const at::Tensor& d_output,
                                      const at::Tensor& pre_act, int64_t activation, int64_t heuristic) {
  check_dgrad_operands(op, weight, d_output);
  const ActivationCode act = check_gated_activation(op, activation);
  check_heuristic(op, heuristic);
  check_matrix(op, "pre_act", pre_act);
  check_same(op, "pre_act", pre_act, "weight", weight);
  const c10::SymInt B = d_output.sym_size(0);
  const int64_t H = weight.size(1);
  TORCH_CHECK_VALUE(pre_act.sym_size(0) == B && pre_act.sym_size(1) == 2 * H, op, ": pre_act must have shape [", B,
                    ", ", 2 * H, "] = [batch, 2 * hidden] (the packed gate and up pre-activations), got ",
                    pre_act.sym_sizes());
  return act;
}

}  // namespace

ActivationCode check_gated_linear_dgrad(const at::Tensor& weight, const at::Tensor& d_output,
                                        const at::Tensor& pre_act, int64_t activation, int64_t heuristic) {
  return check_gated_dgrad_call("fused_dense::gated_linear_dgrad", weight, d_output, pre_act, activation, heuristic);
}

ActivationCode check_gated_linear_dgrad_(const at::Tensor& pre_act, const at::Tensor& weight,
                                         const at::Tensor& d_output, int64_t activation, int64_t heuristic) {
  constexpr const char* op = "fused_dense::gated_linear_dgrad_";
  const ActivationCode act = check_gated_dgrad_call(op, weight, d_output, pre_act, activation, heuristic);
  TORCH_CHECK_VALUE(!pre_act.is_alias_of(d_output) && !pre_act.is_alias_of(weight), op,
                    ": pre_act is overwritten with the gradient, so it must be neither d_output nor weight, nor "
                    "share memory with them");
  return act;
}

ActivationCode check_gated_act_forward(const at::Tensor& pre_act, int64_t activation) {
  constexpr const char* op = "fused_dense::gated_act_forward";
  check_matrix(op, "pre_act", pre_act);
  check_float(op, "pre_act", pre_act);
  TORCH_CHECK_VALUE(pre_act.sym_size(1) % 2 == 0, op,
                    ": pre_act must be the packed [rows, 2 * hidden], so its width must be even, got shape ",
                    pre_act.sym_sizes());
  return check_gated_activation(op, activation);
}

}  // namespace fused_dense

TORCH_LIBRARY_FRAGMENT(fused_dense, m) {
  using fused_dense::def_raw_op;
  // weight [2h, K] packed gate and up rows; pre_act gu [B, 2h] packed.
  // gated_linear: [act(g) * u [B, h]] (+ [gu] when save_pre_act).
  def_raw_op(m, "gated_linear(Tensor input, Tensor weight, int activation, bool save_pre_act, int heuristic) "
                "-> Tensor[]");
  // gated_linear_dgrad: weight [N, h] (the next layer's), d_output [B, N]: [d_pre [B, 2h] packed]
  // (+ [act(g) * u [B, h]] when return_act_out, checkpoint level 1's rebuild).
  def_raw_op(m, "gated_linear_dgrad(Tensor weight, Tensor d_output, Tensor pre_act, int activation, int heuristic, "
                "bool return_act_out=False) -> Tensor[]");
  // gated_linear_dgrad_: gated_linear_dgrad's d_pre written over pre_act itself (level 0 and the
  // recomputed level 2 of the MLP's backward, where gu has no reader after it).
  def_raw_op(m, "gated_linear_dgrad_(Tensor(a!) pre_act, Tensor weight, Tensor d_output, int activation, "
                "int heuristic) -> ()");
  def_raw_op(m, "gated_act_forward(Tensor pre_act, int activation) -> Tensor");
}
