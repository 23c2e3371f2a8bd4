// Calls of the general ops through the dispatcher, for the kernels composed of them (the
// flash-attn-compatible entry points, dense, fused_mlp): each device's kernel runs, and each op's
// handle is looked up once. Also the bias gradient those kernels take alone (bias_grad).
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <optional>
#include <tuple>
#include <vector>

namespace fused_dense::op_calls {

using OptTensor = std::optional<at::Tensor>;

// d_output.sum(0) alone (the weight beside the bias needs no gradient, so no GEMM epilogue makes
// it), accumulated in fp32 for 16-bit types.
inline at::Tensor bias_grad(const at::Tensor& d_output) {
  const auto t = d_output.scalar_type();
  if (t == at::kHalf || t == at::kBFloat16) return d_output.sum(0, false, at::kFloat).to(t);
  return d_output.sum(0);
}

inline std::vector<at::Tensor> linear_act(const at::Tensor& input, const at::Tensor& weight, const OptTensor& bias,
                                          int64_t activation, bool save_pre_act, int64_t heuristic) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("fused_dense::linear_act", "")
                       .typed<std::vector<at::Tensor>(const at::Tensor&, const at::Tensor&, const OptTensor&, int64_t,
                                                      bool, int64_t)>();
  return op.call(input, weight, bias, activation, save_pre_act, heuristic);
}

inline std::vector<at::Tensor> act_linear_dgrad(const at::Tensor& weight, const at::Tensor& d_output,
                                                const OptTensor& pre_act, int64_t activation, bool has_d_bias,
                                                int64_t heuristic, bool return_act_out) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("fused_dense::act_linear_dgrad", "")
                       .typed<std::vector<at::Tensor>(const at::Tensor&, const at::Tensor&, const OptTensor&, int64_t,
                                                      bool, int64_t, bool)>();
  return op.call(weight, d_output, pre_act, activation, has_d_bias, heuristic, return_act_out);
}

inline std::vector<at::Tensor> linear_bias_wgrad(const at::Tensor& input, const at::Tensor& d_output,
                                                 bool has_d_bias) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("fused_dense::linear_bias_wgrad", "")
                       .typed<std::vector<at::Tensor>(const at::Tensor&, const at::Tensor&, bool)>();
  return op.call(input, d_output, has_d_bias);
}

inline at::Tensor act_forward(const at::Tensor& pre_act, int64_t activation) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("fused_dense::act_forward", "")
                       .typed<at::Tensor(const at::Tensor&, int64_t)>();
  return op.call(pre_act, activation);
}

inline std::vector<at::Tensor> gated_linear(const at::Tensor& input, const at::Tensor& weight, int64_t activation,
                                            bool save_pre_act, int64_t heuristic) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("fused_dense::gated_linear", "")
                       .typed<std::vector<at::Tensor>(const at::Tensor&, const at::Tensor&, int64_t, bool, int64_t)>();
  return op.call(input, weight, activation, save_pre_act, heuristic);
}

inline std::vector<at::Tensor> gated_linear_dgrad(const at::Tensor& weight, const at::Tensor& d_output,
                                                  const at::Tensor& pre_act, int64_t activation, int64_t heuristic,
                                                  bool return_act_out) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("fused_dense::gated_linear_dgrad", "")
                       .typed<std::vector<at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                                                      int64_t, bool)>();
  return op.call(weight, d_output, pre_act, activation, heuristic, return_act_out);
}

inline void gated_linear_dgrad_(const at::Tensor& pre_act, const at::Tensor& weight, const at::Tensor& d_output,
                                int64_t activation, int64_t heuristic) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("fused_dense::gated_linear_dgrad_", "")
                       .typed<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, int64_t)>();
  op.call(pre_act, weight, d_output, activation, heuristic);
}

inline at::Tensor gated_act_forward(const at::Tensor& pre_act, int64_t activation) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("fused_dense::gated_act_forward", "")
                       .typed<at::Tensor(const at::Tensor&, int64_t)>();
  return op.call(pre_act, activation);
}

using Fp8Quantized = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

inline Fp8Quantized fp8_quantize(const at::Tensor& input, const OptTensor& pre_act, int64_t activation, bool backward,
                                 int64_t fp8_format, const OptTensor& scale, bool rowwise, bool columnwise,
                                 bool column_sums, const OptTensor& pre_scale_inv = std::nullopt,
                                 const OptTensor& input_fp8 = std::nullopt, const OptTensor& input_scale_inv = std::nullopt) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("fused_dense::fp8_quantize", "")
                       .typed<Fp8Quantized(const at::Tensor&, const OptTensor&, int64_t, bool, int64_t, const OptTensor&,
                                           bool, bool, bool, const OptTensor&, const OptTensor&, const OptTensor&)>();
  return op.call(input, pre_act, activation, backward, fp8_format, scale, rowwise, columnwise, column_sums,
                 pre_scale_inv, input_fp8, input_scale_inv);
}

using Fp8QuantizedGrad = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

inline Fp8QuantizedGrad fp8_quantize_grad_(const at::Tensor& pre_act, const at::Tensor& input, int64_t activation,
                                           int64_t fp8_format, const OptTensor& scale, bool column_sums,
                                           const at::Tensor& pre_scale_inv) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("fused_dense::fp8_quantize_grad_", "")
                       .typed<Fp8QuantizedGrad(const at::Tensor&, const at::Tensor&, int64_t, int64_t, const OptTensor&,
                                               bool, const at::Tensor&)>();
  return op.call(pre_act, input, activation, fp8_format, scale, column_sums, pre_scale_inv);
}

inline at::Tensor fp8_transpose(const at::Tensor& data) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("fused_dense::fp8_transpose", "")
                       .typed<at::Tensor(const at::Tensor&)>();
  return op.call(data);
}

inline at::Tensor fp8_linear(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& input_scale_inv,
                             const at::Tensor& weight_scale_inv, const OptTensor& bias, at::ScalarType out_dtype,
                             bool fast_accum, int64_t heuristic) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("fused_dense::fp8_linear", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         const OptTensor&, at::ScalarType, bool, int64_t)>();
  return op.call(input, weight, input_scale_inv, weight_scale_inv, bias, out_dtype, fast_accum, heuristic);
}

using Fp8LinearAct = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

inline Fp8LinearAct fp8_linear_act(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& input_scale_inv,
                                   const at::Tensor& weight_scale_inv, const OptTensor& bias, at::ScalarType out_dtype,
                                   int64_t activation, const OptTensor& scale, bool columnwise,
                                   const OptTensor& pre_fp8 = std::nullopt, const OptTensor& pre_scale_inv = std::nullopt) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("fused_dense::fp8_linear_act", "")
                       .typed<Fp8LinearAct(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                           const OptTensor&, at::ScalarType, int64_t, const OptTensor&, bool,
                                           const OptTensor&, const OptTensor&)>();
  return op.call(input, weight, input_scale_inv, weight_scale_inv, bias, out_dtype, activation, scale, columnwise,
                 pre_fp8, pre_scale_inv);
}

}  // namespace fused_dense::op_calls
