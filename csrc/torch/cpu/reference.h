// The ATen reference implementation of the ops (cpu/<family>.cpp): the CPU kernel of every op,
// the CUDA kernel for float64 (a dtype cuBLASLt is not asked to serve), and the definition the
// CUDA kernels are tested against.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <optional>
#include <vector>

#include "torch/checks.h"
#include "torch/lm_head.h"
#include "torch/norm.h"

namespace fused_dense {

// Device-generic ATen composition, fp32 math for 16-bit inputs, rounding at the same points as
// the CUDA path: the GEMM result, then the elementwise result.
std::vector<at::Tensor> linear_act_reference(const at::Tensor& input, const at::Tensor& weight,
                                             const std::optional<at::Tensor>& bias, int64_t activation,
                                             bool save_pre_act, int64_t heuristic);
std::vector<at::Tensor> linear_bias_wgrad_reference(const at::Tensor& input, const at::Tensor& d_output,
                                                    bool has_d_bias);
std::vector<at::Tensor> act_linear_dgrad_reference(const at::Tensor& weight, const at::Tensor& d_output,
                                                   const std::optional<at::Tensor>& pre_act,
                                                   int64_t activation, bool has_d_bias, int64_t heuristic,
                                                   bool return_act_out);
at::Tensor act_forward_reference(const at::Tensor& pre_act, int64_t activation);

// The gated ops: gu = input @ weight.T (rounded), out = act(g) * u over the packed layout.
std::vector<at::Tensor> gated_linear_reference(const at::Tensor& input, const at::Tensor& weight, int64_t activation,
                                               bool save_pre_act, int64_t heuristic);
std::vector<at::Tensor> gated_linear_dgrad_reference(const at::Tensor& weight, const at::Tensor& d_output,
                                                     const at::Tensor& pre_act, int64_t activation, int64_t heuristic,
                                                     bool return_act_out);
void gated_linear_dgrad_reference_(const at::Tensor& pre_act, const at::Tensor& weight, const at::Tensor& d_output,
                                   int64_t activation, int64_t heuristic);
at::Tensor gated_act_forward_reference(const at::Tensor& pre_act, int64_t activation);

// The gating math in the inputs' own precision, unrounded (the FP8 quantize reference): act(g) * u
// [R, h] of the packed gu [R, 2h], and the packed (d_h * u * act'(g), d_h * act(g)) [R, 2h].
at::Tensor gated_value(const at::Tensor& gu, ActivationCode act);
at::Tensor gated_value_grad(const at::Tensor& d_h, const at::Tensor& gu, ActivationCode act);

// ---- shared by the reference's families

inline at::ScalarType math_type(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

// The reference promises a precision of its choosing (fp32 math for 16-bit inputs); an enclosing
// torch.autocast must not re-cast the matmuls inside it.
struct NoAutocast {
  c10::impl::ExcludeDispatchKeyGuard guard{c10::autocast_dispatch_keyset};
};

// d * gelu'(p), tanh approximation, with the CUDA kernels' limits where p^2 overflows (cpu/linear.cpp).
at::Tensor gelu_tanh_backward(const at::Tensor& d, const at::Tensor& p);

// The LM head's rows (lm_head.h, LceRows; the math of core/elementwise/elementwise.h,
// cross_entropy_rows) in fp32 (fp64 for float64 logits), device-generic.
void cross_entropy_rows_reference(const LceRows& rows, const LceOptions& opts);

// The norm family's gradients (norm.cpp), device-generic: the CPU and the CUDA kernel.
NormBackwardResult norm_backward_reference(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& weight,
                                           const at::Tensor& rstd, const std::optional<at::Tensor>& mean,
                                           std::array<bool, 3> grads);

}  // namespace fused_dense
