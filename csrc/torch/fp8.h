// The FP8 family's checks, format helpers and output allocation (fp8.cpp), shared by its CPU,
// Meta and CUDA kernels (cpu/, meta/, cuda/fp8.cpp) and the FP8 autograd (autograd/mlp_fp8.cpp).
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

#include "core/common/types.h"
#include "torch/checks.h"

namespace fused_dense {

// The schemas' fp8_format codes: core::Fp8Format's values.
inline constexpr int64_t kE4M3Code = static_cast<int64_t>(core::Fp8Format::kE4M3);
inline constexpr int64_t kE5M2Code = static_cast<int64_t>(core::Fp8Format::kE5M2);

// (data, data_t, scale, scale_inv, amax, column_sums): fp8.cpp's header comment.
using Fp8QuantizeResult = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

core::Fp8Format fp8_format_of(int64_t code, const char* op, const char* name);
at::ScalarType fp8_scalar_type(core::Fp8Format f);
core::Fp8Format fp8_format_of_dtype(at::ScalarType t);  // float8_e4m3fn or float8_e5m2

void check_fp8_quantize(const at::Tensor& input, const std::optional<at::Tensor>& pre_act, int64_t activation,
                        bool backward, int64_t fp8_format, const std::optional<at::Tensor>& scale,
                        const std::optional<at::Tensor>& pre_scale_inv = std::nullopt,
                        const std::optional<at::Tensor>& input_fp8 = std::nullopt,
                        const std::optional<at::Tensor>& input_scale_inv = std::nullopt);
// fp8_quantize_grad_ (in place over an e4m3 pre_act): fp8_quantize's backward checks, pre_scale_inv
// given, and pre_act neither input nor sharing memory with it.
void check_fp8_quantize_grad_(const at::Tensor& pre_act, const at::Tensor& input, int64_t activation,
                              int64_t fp8_format, const std::optional<at::Tensor>& scale,
                              const at::Tensor& pre_scale_inv);
// fp8_transpose: data [R, C] float8 (e4m3 or e5m2), contiguous, C a multiple of 16.
void check_fp8_transpose(const at::Tensor& data);
// fp8_scales: value (an amax, or with delayed a scale) float32 with one element; fp8_format 0 or 1.
core::Fp8Format check_fp8_scales(const at::Tensor& value, bool delayed, int64_t fp8_format);

void check_fp8_linear(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& input_scale_inv,
                      const at::Tensor& weight_scale_inv, const std::optional<at::Tensor>& bias,
                      at::ScalarType out_dtype, const char* op = "fused_dense::fp8_linear");

// (pre, data, data_t, scale, scale_inv, amax) of fp8_linear_act: fp8.cpp's header comment.
using Fp8LinearActResult = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

void check_fp8_linear_act(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& input_scale_inv,
                          const at::Tensor& weight_scale_inv, const std::optional<at::Tensor>& bias,
                          at::ScalarType out_dtype, int64_t activation, const std::optional<at::Tensor>& scale,
                          const std::optional<at::Tensor>& pre_fp8 = std::nullopt,
                          const std::optional<at::Tensor>& pre_scale_inv = std::nullopt);

// The outputs of fp8_linear_act, allocated (Meta and CUDA share it).
Fp8LinearActResult empty_fp8_linear_act(const at::Tensor& input, const at::Tensor& weight, at::ScalarType out_dtype,
                                        bool columnwise);

// The width of fp8_quantize's output: input's, half of it (gated forward) or twice (gated backward).
int64_t fp8_quantized_cols(const at::Tensor& input, int64_t activation, bool backward);

// The outputs of fp8_quantize [rows, cols], allocated (Meta and CUDA share it).
Fp8QuantizeResult empty_fp8_quantize(const at::Tensor& input, int64_t cols, int64_t fp8_format, bool rowwise,
                                     bool columnwise, bool column_sums);

// The scalar outputs and column sums of fp8_quantize_grad_ (scale, scale_inv, amax, column_sums):
// fp8_quantize's without data and data_t.
using Fp8QuantizeGradResult = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
Fp8QuantizeGradResult empty_fp8_quantize_grad(const at::Tensor& input, int64_t activation, bool column_sums);

}  // namespace fused_dense
