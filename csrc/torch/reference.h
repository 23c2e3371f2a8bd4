// Argument checks shared by every backend, and the ATen reference implementation (used as the
// CPU kernel, and by the CUDA kernel for dtypes cuBLASLt is not asked to serve).
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <vector>

#include "../core/types.h"  // plain C++, no CUDA: also usable in the CPU-only build

namespace fused_dense {

// The op schema's integer activation codes are core::Activation's values.
using ActivationCode = core::Activation;
using core::kHeuristicAuto;
using core::relu_mask_row_bytes;

// Name of an activation code, "unknown" for a code outside the schema (for error messages).
const char* activation_name(int64_t activation);

// Checks: each TORCH_CHECK names the argument, the expected and the actual value.
// Return the validated activation.
ActivationCode check_linear_act(const at::Tensor& input, const at::Tensor& weight,
                                const std::optional<at::Tensor>& bias, int64_t activation,
                                bool save_pre_act, int64_t heuristic);
void check_wgrad(const at::Tensor& input, const at::Tensor& d_output);
ActivationCode check_act_linear_dgrad(const at::Tensor& weight, const at::Tensor& d_output,
                                      const std::optional<at::Tensor>& pre_act, int64_t activation,
                                      int64_t heuristic, bool return_act_out);
ActivationCode check_act_forward(const at::Tensor& pre_act, int64_t activation);

// Output allocation shared by Meta and the real kernels.
at::Tensor empty_pre_act(const at::Tensor& like, int64_t rows, int64_t cols, ActivationCode act);

// Reference kernels (device-generic ATen composition, fp32 math for 16-bit inputs, rounding at
// the same points as the CUDA path: the GEMM result, then the elementwise result).
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

}  // namespace fused_dense
