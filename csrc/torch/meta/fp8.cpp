// Meta (fake) kernels of the FP8 family: shapes and dtypes only, with the real kernels' checks.
#include <torch/library.h>

#include "torch/fp8.h"

namespace fused_dense {
namespace {

Fp8QuantizeResult fp8_quantize_meta(const at::Tensor& input, const std::optional<at::Tensor>& pre_act,
                                    int64_t activation, bool backward, int64_t fp8_format,
                                    const std::optional<at::Tensor>& scale, bool rowwise, bool columnwise,
                                    bool column_sums, const std::optional<at::Tensor>& pre_scale_inv,
                                    const std::optional<at::Tensor>& input_fp8,
                                    const std::optional<at::Tensor>& input_scale_inv) {
  check_fp8_quantize(input, pre_act, activation, backward, fp8_format, scale, pre_scale_inv, input_fp8,
                     input_scale_inv);
  return empty_fp8_quantize(input, fp8_quantized_cols(input, activation, backward), fp8_format, rowwise, columnwise,
                            column_sums);
}

Fp8QuantizeGradResult fp8_quantize_grad_meta_(const at::Tensor& pre_act, const at::Tensor& input, int64_t activation,
                                              int64_t fp8_format, const std::optional<at::Tensor>& scale,
                                              bool column_sums, const at::Tensor& pre_scale_inv) {
  check_fp8_quantize_grad_(pre_act, input, activation, fp8_format, scale, pre_scale_inv);
  return empty_fp8_quantize_grad(input, activation, column_sums);
}

at::Tensor fp8_transpose_meta(const at::Tensor& data) {
  check_fp8_transpose(data);
  return at::empty_symint({data.sym_size(1), core::fp8_padded_rows(data.sym_size(0))}, data.options());
}

std::tuple<at::Tensor, at::Tensor> fp8_scales_meta(const at::Tensor& value, bool delayed, int64_t fp8_format) {
  check_fp8_scales(value, delayed, fp8_format);
  return {at::empty({}, value.options()), at::empty({}, value.options())};
}

at::Tensor fp8_linear_meta(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& input_scale_inv,
                           const at::Tensor& weight_scale_inv, const std::optional<at::Tensor>& bias,
                           at::ScalarType out_dtype, bool fast_accum, int64_t heuristic) {
  (void)fast_accum;
  (void)heuristic;
  check_fp8_linear(input, weight, input_scale_inv, weight_scale_inv, bias, out_dtype);
  return at::empty_symint({input.sym_size(0), weight.sym_size(0)}, input.options().dtype(out_dtype));
}

Fp8LinearActResult fp8_linear_act_meta(const at::Tensor& input, const at::Tensor& weight,
                                       const at::Tensor& input_scale_inv, const at::Tensor& weight_scale_inv,
                                       const std::optional<at::Tensor>& bias, at::ScalarType out_dtype,
                                       int64_t activation, const std::optional<at::Tensor>& scale,
                                       bool columnwise, const std::optional<at::Tensor>& pre_fp8,
                                       const std::optional<at::Tensor>& pre_scale_inv) {
  check_fp8_linear_act(input, weight, input_scale_inv, weight_scale_inv, bias, out_dtype, activation, scale, pre_fp8,
                       pre_scale_inv);
  return empty_fp8_linear_act(input, weight, out_dtype, columnwise);
}

}  // namespace
}  // namespace fused_dense

TORCH_LIBRARY_IMPL(fused_dense, Meta, m) {
  m.impl("fp8_quantize", &fused_dense::fp8_quantize_meta);
  m.impl("fp8_quantize_grad_", &fused_dense::fp8_quantize_grad_meta_);
  m.impl("fp8_transpose", &fused_dense::fp8_transpose_meta);
  m.impl("fp8_scales", &fused_dense::fp8_scales_meta);
  m.impl("fp8_linear", &fused_dense::fp8_linear_meta);
  m.impl("fp8_linear_act", &fused_dense::fp8_linear_act_meta);
}
