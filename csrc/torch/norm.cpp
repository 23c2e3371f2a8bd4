// The norm family: RMSNorm / LayerNorm with the FP8 copies of their output in one op, for the
// FP8 layers that read a normalised input. Schemas and argument checks (kernels: cpu/, meta/,
// cuda/norm.cpp).
//
//   norm_fp8(x [R, C], weight [C], bias [C]?, eps, layer_norm, fp8_format, scale []?, rowwise,
//            columnwise)
//       -> (out [R, C], data [R, C] or [0], data_t [C, pad16(R)] or [0], scale [], scale_inv [],
//           amax [], rstd [R], mean [R] or [0])
//     out = (x - mean) * rstd * weight + bias, rounded once to x's dtype (RMSNorm: layer_norm
//     false, mean 0; rstd = 1 / sqrt(mean over the row of (x - mean)^2 + eps); fp32 math), and
//     (data, data_t, scale, scale_inv, amax) = fp8_quantize(out, fp8_format, scale, rowwise,
//     columnwise): the same bytes as the two ops run one after the other. On CUDA the norm kernel
//     records the amax of out as it writes it, so current scaling needs no amax pass over out.
//     float16, bfloat16 or float32; rstd and mean are float32.
//   norm_backward(grad_out [R, C], x, weight, rstd, mean?, grads bool[3])
//       -> (grad_x [R, C] or [0], grad_weight [C] or [0], grad_bias [C] or [0])
//     the gradients of out (LayerNorm when mean is given, else RMSNorm), fp32 math (fp64 for
//     float64); on CUDA the core's norm_backward kernel (the ATen composition of cpu/norm.cpp for
//     float64 and widths past the kernel's limit), elsewhere that composition.
#include "torch/norm.h"

#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cmath>

#include "torch/autograd/guard.h"
#include "torch/checks.h"
#include "torch/fp8.h"

namespace fused_dense {

namespace {

void check_vector_of(const at::Tensor& t, const at::Tensor& x, const char* op, const char* name) {
  TORCH_CHECK_VALUE(t.dim() == 1 && t.sym_size(0) == x.sym_size(1), op, ": ", name, " must be [cols] = [",
                    x.sym_size(1), "], got shape ", t.sym_sizes());
  check_same(op, name, t, "x", x);
  TORCH_CHECK_VALUE(t.is_contiguous(), op, ": ", name, " must be contiguous, got strides ", t.sym_strides());
}

}  // namespace

void check_norm_fp8(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias, double eps,
                    int64_t fp8_format, const std::optional<at::Tensor>& scale) {
  constexpr const char* op = "fused_dense::norm_fp8";
  check_matrix(op, "x", x);
  check_float(op, "x", x);
  check_vector_of(weight, x, op, "weight");
  if (bias.has_value() && bias->defined()) check_vector_of(*bias, x, op, "bias");
  TORCH_CHECK_VALUE(std::isfinite(eps) && eps >= 0, op, ": eps must be finite and >= 0, got ", eps);
  TORCH_CHECK_VALUE(x.scalar_type() != at::kDouble, op,
                    ": x must be float16, bfloat16 or float32 (the dtypes fp8_quantize reads), got ", x.scalar_type());
  TORCH_CHECK_VALUE(x.sym_size(1) % 8 == 0, op, ": x.size(1) (cols) must be a multiple of 8 (the FP8 copies), got ",
                    x.sym_size(1));
  check_fp8_quantize(x, std::nullopt, 0, false, fp8_format, scale);  // out is what fp8_quantize reads
}

void check_norm_backward(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& weight,
                         const at::Tensor& rstd, const std::optional<at::Tensor>& mean) {
  constexpr const char* op = "fused_dense::norm_backward";
  check_matrix(op, "x", x);
  check_float(op, "x", x);
  check_vector_of(weight, x, op, "weight");
  TORCH_CHECK_VALUE(grad_out.sym_sizes() == x.sym_sizes(), op, ": grad_out must have x's shape ", x.sym_sizes(),
                    ", got ", grad_out.sym_sizes());
  check_same(op, "grad_out", grad_out, "x", x);
  const auto stats = float_math_dtype(x);
  TORCH_CHECK_VALUE(rstd.scalar_type() == stats && rstd.dim() == 1 && rstd.sym_size(0) == x.sym_size(0), op,
                    ": rstd must be ", stats, " [rows] = [", x.sym_size(0), "] (norm_fp8's), got ", rstd.scalar_type(),
                    " ", rstd.sym_sizes());
  check_same_device(op, "rstd", rstd, "x", x);
  if (mean.has_value() && mean->defined()) {
    TORCH_CHECK_VALUE(mean->scalar_type() == stats && mean->sym_sizes() == rstd.sym_sizes(), op, ": mean must be ",
                      stats, " [rows] = [", x.sym_size(0), "], got ", mean->scalar_type(), " ", mean->sym_sizes());
    check_same_device(op, "mean", *mean, "x", x);
  }
}

NormFp8Result empty_norm_fp8(const at::Tensor& x, bool layer_norm, int64_t fp8_format, bool rowwise, bool columnwise) {
  auto [data, data_t, s, s_inv, amax, sums] =
      empty_fp8_quantize(x, width_of(x, 1), fp8_format, rowwise, columnwise, false);
  (void)sums;
  const auto stats = x.options().dtype(float_math_dtype(x));
  const c10::SymInt rows = x.sym_size(0);
  return {at::empty_like(x), data, data_t, s, s_inv, amax, at::empty_symint({rows}, stats),
          layer_norm ? at::empty_symint({rows}, stats) : at::empty({0}, stats)};
}

NormBackwardResult empty_norm_grads(const at::Tensor& x, const at::Tensor& weight, std::array<bool, 3> grads) {
  const auto none = x.options();
  return {grads[0] ? at::empty_like(x) : at::empty({0}, none), grads[1] ? at::empty_like(weight) : at::empty({0}, none),
          grads[2] ? at::empty_like(weight) : at::empty({0}, none)};
}

}  // namespace fused_dense

TORCH_LIBRARY_FRAGMENT(fused_dense, m) {
  using fused_dense::def_raw_op;
  def_raw_op(m, "norm_fp8(Tensor x, Tensor weight, Tensor? bias, float eps, bool layer_norm, int fp8_format, "
             "Tensor? scale, bool rowwise, bool columnwise) "
             "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  def_raw_op(m, "norm_backward(Tensor grad_out, Tensor x, Tensor weight, Tensor rstd, Tensor? mean, bool[3] grads) "
             "-> (Tensor, Tensor, Tensor)");
}
