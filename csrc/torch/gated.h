// The gated family's argument checks (gated.cpp), run by its CPU, Meta and CUDA kernels.
#pragma once

#include <ATen/ATen.h>

#include "torch/checks.h"

namespace fused_dense {

// Each returns the validated (gated) activation.
ActivationCode check_gated_linear(const at::Tensor& input, const at::Tensor& weight, int64_t activation,
                                  int64_t heuristic);
ActivationCode check_gated_linear_dgrad(const at::Tensor& weight, const at::Tensor& d_output,
                                        const at::Tensor& pre_act, int64_t activation, int64_t heuristic);
// gated_linear_dgrad_ (in place over pre_act): gated_linear_dgrad's checks, and pre_act is no other operand.
ActivationCode check_gated_linear_dgrad_(const at::Tensor& pre_act, const at::Tensor& weight,
                                         const at::Tensor& d_output, int64_t activation, int64_t heuristic);
ActivationCode check_gated_act_forward(const at::Tensor& pre_act, int64_t activation);

}  // namespace fused_dense
