// The torch layer's op vocabulary (activation and heuristic codes) and the argument checks shared
// by the CPU, CUDA and Meta kernels, so every backend rejects the same inputs with the same
// message; plus the output allocation they share.
#pragma once

#include <ATen/ATen.h>

#include <optional>

#include "core/common/types.h"  // plain C++, no CUDA: also usable in the CPU-only build

namespace fused_dense {

// The op schema's integer activation codes are core::Activation's values.
using ActivationCode = core::Activation;
using core::kHeuristicAuto;
using core::relu_mask_row_bytes;

// Name of an activation code, "unknown" for a code outside the schema (for error messages).
const char* activation_name(int64_t activation);
// Whether an activation code is gated (swiglu, geglu: the gated ops and fused_mlp take it).
bool is_gated_activation(int64_t activation);

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

// The gated ops (swiglu, geglu over the packed layout of core/common/types.h). Return the activation.
ActivationCode check_gated_linear(const at::Tensor& input, const at::Tensor& weight, int64_t activation,
                                  int64_t heuristic);
ActivationCode check_gated_linear_dgrad(const at::Tensor& weight, const at::Tensor& d_output,
                                        const at::Tensor& pre_act, int64_t activation, int64_t heuristic);
ActivationCode check_gated_act_forward(const at::Tensor& pre_act, int64_t activation);

// Output allocation shared by Meta and the real kernels: the saved pre-activation [rows, cols],
// or for ReLU its bit-mask [rows, relu_mask_row_bytes(cols)] uint8.
at::Tensor empty_pre_act(const at::Tensor& like, int64_t rows, int64_t cols, ActivationCode act);

}  // namespace fused_dense
