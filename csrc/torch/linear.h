// The linear family's argument checks (linear.cpp), run by its CPU, Meta and CUDA kernels.
#pragma once

#include <ATen/ATen.h>

#include <optional>

#include "torch/checks.h"

namespace fused_dense {

// Each returns the validated activation.
ActivationCode check_linear_act(const at::Tensor& input, const at::Tensor& weight,
                                const std::optional<at::Tensor>& bias, int64_t activation,
                                bool save_pre_act, int64_t heuristic);
void check_wgrad(const at::Tensor& input, const at::Tensor& d_output);
ActivationCode check_act_linear_dgrad(const at::Tensor& weight, const at::Tensor& d_output,
                                      const std::optional<at::Tensor>& pre_act, int64_t activation,
                                      int64_t heuristic, bool return_act_out);
ActivationCode check_act_forward(const at::Tensor& pre_act, int64_t activation);

// input [B, K] and weight [N, K] of a forward GEMM; weight [N, K] and d_output [B, N] of a
// data-gradient GEMM (the gated family's checks use them too).
void check_forward_operands(const char* op, const at::Tensor& input, const at::Tensor& weight);
void check_dgrad_operands(const char* op, const at::Tensor& weight, const at::Tensor& d_output);

}  // namespace fused_dense
