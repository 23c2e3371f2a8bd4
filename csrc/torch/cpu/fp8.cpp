// The FP8 family's reference (fp8.cpp has the ops' contract): plain ATen, fp32 math, the scaling
// rule of core/common/types.h (fp8_scale_from_amax).
#include <torch/library.h>

#include "torch/cpu/reference.h"
#include "torch/fp8.h"

namespace fused_dense {
namespace {

// v of the quantize pass, in fp32.
// pre_scale_inv: pre_act is e4m3, read as its dequantized value rounded to input's dtype.
at::Tensor quantized_value(const at::Tensor& input, const std::optional<at::Tensor>& pre_act, int64_t activation,
                           bool backward, const std::optional<at::Tensor>& pre_scale_inv) {
  const at::Tensor x = input.to(at::kFloat);
  const auto act = static_cast<ActivationCode>(activation);
  at::Tensor p;
  if (backward) {
    p = pre_act->to(at::kFloat);
    if (pre_scale_inv.has_value() && pre_scale_inv->defined())
      p = (p * pre_scale_inv->reshape({})).to(input.scalar_type()).to(at::kFloat);
  }
  if (is_gated_activation(activation)) return backward ? gated_value_grad(x, p, act) : gated_value(x, act);
  if (backward) {
    switch (act) {
      case ActivationCode::kGeluTanh: return at::gelu_backward(x, p, "tanh");
      case ActivationCode::kRelu: return x * (p > 0).to(at::kFloat);
      default: return x * (2 * at::relu(p));
    }
  }
  switch (act) {
    case ActivationCode::kGeluTanh: return at::gelu(x, "tanh");
    case ActivationCode::kRelu: return at::relu(x);
    case ActivationCode::kSquaredRelu: return at::relu(x).square();
    default: return x;
  }
}

// The scale (the given one, else fp8_scale_from_amax's rule: fp8_max / max(amax, kFp8MinAmax), NaN
// kept, as clamp propagates it) and its reciprocal: fp8_quantize_reference's and fp8_scales'.
std::tuple<at::Tensor, at::Tensor> scales_of(const at::Tensor& amax, core::Fp8Format format,
                                             const std::optional<at::Tensor>& scale) {
  const at::Tensor s = (scale.has_value() && scale->defined())
                           ? scale->reshape({}).clone()
                           : core::fp8_max(format) / at::clamp(amax.reshape({}), core::kFp8MinAmax);
  return {s, at::reciprocal(s)};
}

Fp8QuantizeResult fp8_quantize_reference(const at::Tensor& input, const std::optional<at::Tensor>& pre_act,
                                         int64_t activation, bool backward, int64_t fp8_format,
                                         const std::optional<at::Tensor>& scale, bool rowwise, bool columnwise,
                                         bool column_sums, const std::optional<at::Tensor>& pre_scale_inv,
                                         const std::optional<at::Tensor>& input_fp8,
                                         const std::optional<at::Tensor>& input_scale_inv) {
  check_fp8_quantize(input, pre_act, activation, backward, fp8_format, scale, pre_scale_inv, input_fp8,
                     input_scale_inv);
  if (input_fp8.has_value() && input_fp8->defined()) {
    // The input's own copy: the same reference at activation 0 (none), e4m3, current scaling.
    auto [d, dt, s, si, a, c] = fp8_quantize_reference(input, std::nullopt, 0, false, 0, std::nullopt, true, false,
                                                       false, std::nullopt, std::nullopt, std::nullopt);
    input_fp8->copy_(d);
    input_scale_inv->copy_(si.reshape(input_scale_inv->sizes()));
  }
  const auto format = static_cast<core::Fp8Format>(fp8_format);
  const float fmax = core::fp8_max(format);
  const at::Tensor v = quantized_value(input, pre_act, activation, backward, pre_scale_inv);
  const auto f32 = input.options().dtype(at::kFloat);
  const at::Tensor amax = v.numel() == 0 ? at::zeros({}, f32) : v.abs().max();
  const auto [s, s_inv] = scales_of(amax, format, scale);
  const at::Tensor q = at::clamp(v * s, -fmax, fmax).to(fp8_scalar_type(format));
  const int64_t R = v.size(0), C = v.size(1);
  at::Tensor data = rowwise ? q : at::empty({0}, input.options().dtype(fp8_scalar_type(format)));
  at::Tensor data_t = at::empty({0}, data.options());
  if (columnwise) {
    at::Tensor t = at::zeros({C, core::fp8_padded_rows(R)}, f32);
    t.narrow(1, 0, R).copy_(q.to(at::kFloat).t());
    data_t = t.to(fp8_scalar_type(format));
  }
  at::Tensor sums = column_sums ? v.sum(0).to(input.scalar_type()) : at::empty({0}, input.options());
  return {data, data_t, s, s_inv, amax.reshape({}), sums};
}

Fp8QuantizeGradResult fp8_quantize_grad_reference_(const at::Tensor& pre_act, const at::Tensor& input,
                                                   int64_t activation, int64_t fp8_format,
                                                   const std::optional<at::Tensor>& scale, bool column_sums,
                                                   const at::Tensor& pre_scale_inv) {
  check_fp8_quantize_grad_(pre_act, input, activation, fp8_format, scale, pre_scale_inv);
  auto [data, data_t, s, s_inv, amax, sums] = fp8_quantize_reference(
      input, pre_act, activation, true, fp8_format, scale, true, false, column_sums, pre_scale_inv, std::nullopt,
      std::nullopt);
  (void)data_t;
  pre_act.view(at::kByte).copy_(data.view(at::kByte));  // read in full above, then written over
  return {s, s_inv, amax, sums};
}

// fp8_quantize_reference's scale and scale_inv (scales_of).
std::tuple<at::Tensor, at::Tensor> fp8_scales_reference(const at::Tensor& value, bool delayed, int64_t fp8_format) {
  const core::Fp8Format format = check_fp8_scales(value, delayed, fp8_format);
  return delayed ? scales_of(at::Tensor(), format, value) : scales_of(value, format, std::nullopt);
}

at::Tensor fp8_transpose_reference(const at::Tensor& data) {
  check_fp8_transpose(data);
  const int64_t R = data.size(0), C = data.size(1);
  at::Tensor t = at::zeros({C, core::fp8_padded_rows(R)}, data.options().dtype(at::kByte));
  t.narrow(1, 0, R).copy_(data.view(at::kByte).t());
  return t.view(data.scalar_type());
}

at::Tensor fp8_linear_reference(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& input_scale_inv,
                                const at::Tensor& weight_scale_inv, const std::optional<at::Tensor>& bias,
                                at::ScalarType out_dtype, bool fast_accum, int64_t heuristic) {
  (void)fast_accum;
  (void)heuristic;
  check_fp8_linear(input, weight, input_scale_inv, weight_scale_inv, bias, out_dtype);
  at::Tensor out = at::matmul(input.to(at::kFloat), weight.to(at::kFloat).t()) *
                   (input_scale_inv.reshape({}) * weight_scale_inv.reshape({}));
  if (bias.has_value() && bias->defined()) out = out + bias->to(at::kFloat);
  return out.to(out_dtype);
}

Fp8LinearActResult fp8_linear_act_reference(const at::Tensor& input, const at::Tensor& weight,
                                            const at::Tensor& input_scale_inv, const at::Tensor& weight_scale_inv,
                                            const std::optional<at::Tensor>& bias, at::ScalarType out_dtype,
                                            int64_t activation, const std::optional<at::Tensor>& scale,
                                            bool columnwise, const std::optional<at::Tensor>& pre_fp8,
                                            const std::optional<at::Tensor>& pre_scale_inv) {
  check_fp8_linear_act(input, weight, input_scale_inv, weight_scale_inv, bias, out_dtype, activation, scale, pre_fp8,
                       pre_scale_inv);
  const at::Tensor pre =
      fp8_linear_reference(input, weight, input_scale_inv, weight_scale_inv, bias, out_dtype, true, -2);
  auto [data, data_t, s, s_inv, amax, sums] = fp8_quantize_reference(
      pre, std::nullopt, activation, false, 0, scale, true, columnwise, false, std::nullopt, pre_fp8, pre_scale_inv);
  (void)sums;
  return {pre, data, data_t, s, s_inv, amax};
}

}  // namespace
}  // namespace fused_dense

TORCH_LIBRARY_IMPL(fused_dense, CPU, m) {
  m.impl("fp8_quantize", &fused_dense::fp8_quantize_reference);
  m.impl("fp8_quantize_grad_", &fused_dense::fp8_quantize_grad_reference_);
  m.impl("fp8_transpose", &fused_dense::fp8_transpose_reference);
  m.impl("fp8_scales", &fused_dense::fp8_scales_reference);
  m.impl("fp8_linear", &fused_dense::fp8_linear_reference);
  m.impl("fp8_linear_act", &fused_dense::fp8_linear_act_reference);
}
