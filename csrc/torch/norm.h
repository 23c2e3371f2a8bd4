// The norm family's checks and output allocation (norm.cpp), shared by its CPU, Meta and CUDA
// kernels (cpu/, meta/, cuda/norm.cpp).
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <optional>
#include <tuple>

namespace fused_dense {

// (out, data, data_t, scale, scale_inv, amax, rstd, mean): norm.cpp's header comment.
using NormFp8Result =
    std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
using NormBackwardResult = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

void check_norm_fp8(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias, double eps,
                    int64_t fp8_format, const std::optional<at::Tensor>& scale);
void check_norm_backward(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& weight,
                         const at::Tensor& rstd, const std::optional<at::Tensor>& mean);

// The outputs of norm_fp8 (Meta and CUDA share it).
NormFp8Result empty_norm_fp8(const at::Tensor& x, bool layer_norm, int64_t fp8_format, bool rowwise, bool columnwise);
NormBackwardResult empty_norm_grads(const at::Tensor& x, const at::Tensor& weight, std::array<bool, 3> grads);

}  // namespace fused_dense
