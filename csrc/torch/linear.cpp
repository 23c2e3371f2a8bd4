// The op schemas, registered once. CPU, CUDA and Meta kernels live in separate files; the
// flash-attn-compatible entry points are thin composites over the general ops.
#include <torch/library.h>

#include "checks.h"
#include "op_calls.h"

TORCH_LIBRARY(fused_dense, m) {
  // General forms. activation: 0 none, 1 gelu_approx (tanh), 2 relu, 3 sqrelu (4, 5: gated, below).
  // heuristic: -2 auto, -1 unfused, >= 0 index into cuBLASLt's algorithm list.
  m.def("linear_act(Tensor input, Tensor weight, Tensor? bias, int activation, bool save_pre_act, "
        "int heuristic) -> Tensor[]");
  // return_act_out (gelu_approx, sqrelu): act(pre_act) appended to the results, made by the pass
  // that reads pre_act anyway (checkpoint level 1's recompute).
  m.def("act_linear_dgrad(Tensor weight, Tensor d_output, Tensor? pre_act, int activation, "
        "bool has_d_bias, int heuristic, bool return_act_out=False) -> Tensor[]");
  m.def("linear_bias_wgrad(Tensor input, Tensor d_output, bool has_d_bias) -> Tensor[]");
  m.def("act_forward(Tensor pre_act, int activation) -> Tensor");
  // Gated forms, activation 4 swiglu or 5 geglu, over the packed layout (core/common/types.h,
  // kGatedInterleave): weight [2h, K] packed gate and up rows; pre_act gu [B, 2h] packed.
  // gated_linear: [act(g) * u [B, h]] (+ [gu] when save_pre_act).
  m.def("gated_linear(Tensor input, Tensor weight, int activation, bool save_pre_act, int heuristic) -> Tensor[]");
  // gated_linear_dgrad: weight [N, h] (the next layer's), d_output [B, N]: [d_pre [B, 2h] packed]
  // (+ [act(g) * u [B, h]] when return_act_out, checkpoint level 1's rebuild).
  m.def("gated_linear_dgrad(Tensor weight, Tensor d_output, Tensor pre_act, int activation, int heuristic, "
        "bool return_act_out=False) -> Tensor[]");
  m.def("gated_act_forward(Tensor pre_act, int activation) -> Tensor");
  // fused_mlp and its halves: fused_mlp.cpp.
  // flash-attn's fused_dense_lib contract: is_gelu picks GELU, else ReLU.
  m.def("linear_act_forward(Tensor input, Tensor weight, Tensor? bias, bool is_gelu, "
        "bool save_pre_act, int heuristic) -> Tensor[]");
  m.def("bias_act_linear_dgrad_bgrad(Tensor weight, Tensor d_output, Tensor pre_act, bool is_gelu, "
        "int heuristic) -> Tensor[]");
  // Whether this build holds the library's cutlass_sm90 kernels (csrc/core/cutlass_sm90/cutlass_sm90_dgrad.h,
  // cutlass_sm90_forward.h), more candidates of 'auto' on compute capability 9.0.
  m.def("cutlass_gemms_compiled() -> bool", [] {
#if defined(FUSED_DENSE_WITH_CUTLASS_SM90A)
    return true;
#else
    return false;
#endif
  });
}

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

}  // namespace
}  // namespace fused_dense

TORCH_LIBRARY_IMPL(fused_dense, CompositeImplicitAutograd, m) {
  m.impl("linear_act_forward", &fused_dense::linear_act_forward);
  m.impl("bias_act_linear_dgrad_bgrad", &fused_dense::bias_act_linear_dgrad_bgrad);
}
