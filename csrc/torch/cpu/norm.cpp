// The norm family's reference (norm.cpp has the ops' contract): plain ATen, fp32 math (fp64 for
// float64), the FP8 copies by fp8_quantize through the dispatcher.
#include <torch/library.h>

#include "torch/autograd/op_calls.h"
#include "torch/cpu/reference.h"
#include "torch/norm.h"

namespace fused_dense {

namespace {

NormFp8Result norm_fp8_reference(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                                 double eps, bool layer_norm, int64_t fp8_format, const std::optional<at::Tensor>& scale,
                                 bool rowwise, bool columnwise) {
  check_norm_fp8(x, weight, bias, eps, fp8_format, scale);
  const auto stats = float_math_dtype(x);
  const at::Tensor xf = x.to(stats);
  const at::Tensor mean = layer_norm ? xf.mean({1}) : at::zeros({x.size(0)}, xf.options());
  const at::Tensor centred = xf - mean.unsqueeze(1);
  const at::Tensor rstd = at::rsqrt((centred * centred).mean({1}) + eps);
  at::Tensor y = centred * rstd.unsqueeze(1) * weight.to(stats);
  if (bias.has_value() && bias->defined()) y = y + bias->to(stats);
  const at::Tensor out = y.to(x.scalar_type());
  auto [data, data_t, s, s_inv, amax, sums] =
      op_calls::fp8_quantize(out, std::nullopt, 0, false, fp8_format, scale, rowwise, columnwise, false);
  (void)sums;
  return {out, data, data_t, s, s_inv, amax, rstd, layer_norm ? mean : at::empty({0}, xf.options())};
}

}  // namespace

NormBackwardResult norm_backward_reference(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& weight,
                                           const at::Tensor& rstd, const std::optional<at::Tensor>& mean,
                                           std::array<bool, 3> grads) {
  check_norm_backward(grad_out, x, weight, rstd, mean);
  const bool layer_norm = mean.has_value() && mean->defined();
  const auto stats = float_math_dtype(x);
  const at::Tensor g = grad_out.to(stats);
  at::Tensor xhat = x.to(stats);
  if (layer_norm) xhat = xhat - mean->unsqueeze(1);
  xhat = xhat * rstd.unsqueeze(1);
  auto [gx, gw, gb] = empty_norm_grads(x, weight, grads);
  if (grads[0]) {
    const at::Tensor gy = g * weight.to(stats);
    at::Tensor inner = gy - xhat * (gy * xhat).mean({1}, true);
    if (layer_norm) inner = inner - gy.mean({1}, true);
    gx = (inner * rstd.unsqueeze(1)).to(x.scalar_type());
  }
  if (grads[1]) gw = (g * xhat).sum(0).to(weight.scalar_type());
  if (grads[2]) gb = g.sum(0).to(weight.scalar_type());
  return {gx, gw, gb};
}

}  // namespace fused_dense

TORCH_LIBRARY_IMPL(fused_dense, CPU, m) {
  m.impl("norm_fp8", &fused_dense::norm_fp8_reference);
  m.impl("norm_backward", &fused_dense::norm_backward_reference);
}
