// The mlp_fp8 family: fused_mlp_fp8 (the FP8 MLP) and fp8_dense (one FP8 linear layer), each with a
// C++ derivative: their schemas and argument checks. Kernels, composed of the FP8 ops through the
// dispatcher for every device: autograd/mlp_fp8.cpp (which has the dataflow).
#include "torch/mlp_fp8.h"

#include <c10/util/Exception.h>
#include <torch/library.h>

#include "torch/fp8.h"
#include "torch/mlp.h"

namespace fused_dense {
namespace {

using Opt = std::optional<at::Tensor>;

constexpr const char* kMlpOp = "fused_dense::fused_mlp_fp8";
constexpr const char* kDenseOp = "fused_dense::fp8_dense";

void check_vector(const Opt& t, int64_t n, const at::Tensor& x, const char* op, const char* name) {
  if (!t.has_value() || !t->defined()) return;
  TORCH_CHECK_VALUE(t->dim() == 1 && t->sym_size(0) == n && t->scalar_type() == at::kFloat, op, ": ", name,
                    " must be a float32 vector of ", n, " elements, got ", t->scalar_type(), " of shape ",
                    t->sym_sizes());
  check_same_device(op, name, *t, "x", x);
}

// A width of the layer's FP8 GEMMs, named as the user knows it: a multiple of 16 (positive where it
// is a GEMM's reduction length, which fp8_linear requires).
void check_fp8_width(const char* op, const char* name, int64_t value, bool positive) {
  TORCH_CHECK_VALUE(value % 16 == 0 && (!positive || value > 0), op, ": ", name, " must be a ",
                    positive ? "positive " : "", "multiple of 16 (the FP8 GEMMs' widths), got ", value);
}

}  // namespace

void check_mlp_fp8(const at::Tensor& x, const at::Tensor& weight1, const at::Tensor& weight2, int64_t activation,
                   int64_t grad_format, const Opt& scales, const Opt& amax_out, at::TensorList weights_fp8) {
  TORCH_CHECK_VALUE(x.dim() == 2, kMlpOp, ": x must be 2-D [batch, in_features], got shape ", x.sym_sizes());
  TORCH_CHECK_VALUE(weight1.dim() == 2 && weight2.dim() == 2, kMlpOp, ": weight1 and weight2 must be 2-D, got shapes ",
                    weight1.sizes(), " and ", weight2.sizes());
  TORCH_CHECK_VALUE(weight1.size(1) == x.sym_size(1), kMlpOp,
                    ": weight1.size(1) must equal x.size(1) = ", x.sym_size(1), " (in_features), got weight1 shape ",
                    weight1.sizes());
  check_mlp_codes(activation, 0, kMlpOp);
  if (is_gated_activation(activation)) {
    TORCH_CHECK_VALUE(weight1.size(0) == 2 * weight2.size(1), kMlpOp, ": a gated MLP's weight1 is the packed gate / "
                      "up weight [2 hidden, in_features] for weight2 [out_features, hidden = ", weight2.size(1),
                      "], so weight1.size(0) must be ", 2 * weight2.size(1), ", got weight1 shape ", weight1.sizes());
  } else {
    TORCH_CHECK_VALUE(weight2.size(1) == weight1.size(0), kMlpOp, ": weight2.size(1) must equal weight1.size(0) = ",
                      weight1.size(0), " (hidden_features), got weight2 shape ", weight2.sizes());
  }
  check_fp8_width(kMlpOp, "in_features (x.size(1))", width_of(x, 1), true);
  check_fp8_width(kMlpOp, "hidden_features (weight2.size(1))", weight2.size(1), true);
  check_fp8_width(kMlpOp, "out_features (weight2.size(0))", weight2.size(0), false);
  fp8_format_of(grad_format, kMlpOp, "grad_format");
  check_vector(scales, 4, x, kMlpOp, "scales");
  check_vector(amax_out, 4, x, kMlpOp, "amax_out");
  TORCH_CHECK_VALUE(weights_fp8.size() == 2 * kFp8WeightTensors, kMlpOp, ": weights_fp8 must hold ",
                    2 * kFp8WeightTensors, " tensors (data, data_t, scale_inv, scale of weight1, then of weight2), got ",
                    weights_fp8.size());
}

void check_fp8_dense(const at::Tensor& x, const at::Tensor& weight, int64_t grad_format, const Opt& scales,
                     const Opt& amax_out, at::TensorList weights_fp8) {
  TORCH_CHECK_VALUE(x.dim() == 2, kDenseOp, ": x must be 2-D [batch, in_features], got shape ", x.sym_sizes());
  TORCH_CHECK_VALUE(weight.dim() == 2 && weight.size(1) == x.sym_size(1), kDenseOp,
                    ": weight must be [out_features, in_features = ", x.sym_size(1), "], got shape ", weight.sizes());
  check_fp8_width(kDenseOp, "in_features (x.size(1))", width_of(x, 1), true);
  check_fp8_width(kDenseOp, "out_features (weight.size(0))", weight.size(0), false);
  fp8_format_of(grad_format, kDenseOp, "grad_format");
  check_vector(scales, 2, x, kDenseOp, "scales");
  check_vector(amax_out, 2, x, kDenseOp, "amax_out");
  TORCH_CHECK_VALUE(weights_fp8.size() == kFp8WeightTensors, kDenseOp, ": weights_fp8 must hold ", kFp8WeightTensors,
                    " tensors (the weight's data, data_t, scale_inv, scale), got ", weights_fp8.size());
}

void check_x_fp8(const at::Tensor& x, at::TensorList x_fp8, const char* op) {
  if (x_fp8.empty()) return;
  TORCH_CHECK_VALUE(x_fp8.size() == 4, op, ": x_fp8 must be empty or hold 4 tensors (x's data, data_t, scale_inv, "
                    "amax), got ", x_fp8.size());
  const at::Tensor &d = x_fp8[0], &t = x_fp8[1];
  TORCH_CHECK_VALUE(d.scalar_type() == at::kFloat8_e4m3fn && d.sym_sizes() == x.sym_sizes(), op,
                    ": x_fp8[0] must be x's float8_e4m3fn copy of shape ", x.sym_sizes(), ", got ", d.scalar_type(),
                    " ", d.sym_sizes());
  const c10::SymInt ld = core::fp8_padded_rows(x.sym_size(0));
  TORCH_CHECK_VALUE(t.scalar_type() == at::kFloat8_e4m3fn &&
                        (t.sym_numel() == 0 || (t.dim() == 2 && t.sym_size(0) == x.sym_size(1) && t.sym_size(1) == ld)),
                    op, ": x_fp8[1] must be x's transposed float8_e4m3fn copy [", x.sym_size(1), ", ", ld,
                    "] or empty, got ", t.scalar_type(), " ", t.sym_sizes());
  for (int i = 2; i < 4; ++i) {
    TORCH_CHECK_VALUE(x_fp8[i].scalar_type() == at::kFloat && x_fp8[i].sym_numel() == 1, op, ": x_fp8[", i,
                      "] must be a float32 scalar (", i == 2 ? "scale_inv" : "amax", "), got ", x_fp8[i].scalar_type(),
                      " ", x_fp8[i].sym_sizes());
  }
  for (const auto& e : x_fp8) check_same_device(op, "x_fp8", e, "x", x);
}

Fp8Weight fp8_weight_at(at::TensorList w, size_t i, const at::Tensor& weight, const char* op) {
  const size_t base = kFp8WeightTensors * i;
  const at::Tensor& d = w[base];
  const at::Tensor& t = w[base + 1];
  TORCH_CHECK_VALUE(d.sizes() == weight.sizes(), op, ": weights_fp8[", base, "] must be weight", i + 1,
                    "'s FP8 copy of shape ", weight.sizes(), ", got ", d.sizes());
  for (size_t k = 2; k < kFp8WeightTensors; ++k) {
    const at::Tensor& s = w[base + k];
    TORCH_CHECK_VALUE(s.numel() == 1 && s.scalar_type() == at::kFloat, op, ": weights_fp8[", base + k, "] must be weight",
                      i + 1, "'s float32 ", k == 2 ? "scale_inv" : "scale", ", got ", s.scalar_type(), " of shape ",
                      s.sizes());
  }
  TORCH_CHECK_VALUE(d.scalar_type() == at::kFloat8_e4m3fn && t.scalar_type() == at::kFloat8_e4m3fn, op,
                    ": weights_fp8 must hold float8_e4m3fn weights, got ", d.scalar_type(), " and ", t.scalar_type());
  TORCH_CHECK_VALUE(t.numel() == 0 || (t.dim() == 2 && t.size(0) == weight.size(1) && t.size(1) == weight.size(0)), op,
                    ": weights_fp8[", base + 1, "] must be weight", i + 1, "'s transposed FP8 copy [", weight.size(1),
                    ", ", weight.size(0), "] or empty (made again in backward), got ", t.sizes());
  return Fp8Weight{d, t, w[base + 2], w[base + 3]};
}

}  // namespace fused_dense

TORCH_LIBRARY_FRAGMENT(fused_dense, m) {
  // FP8 fc2(act(fc1(x))) with a C++ derivative; activation 1 to 5 (4, 5: gated, weight1 the packed
  // gate / up weight); checkpoint_lvl 0 / 1 / 2;
  // weights_fp8: [data, data_t, scale_inv, scale] of weight1, then of weight2 (fp8_quantize, e4m3,
  // each scaled from its own amax); a data_t empty: backward quantizes that weight again for it at
  // that scale;
  // grad_format: 0 e4m3, 1 e5m2; scales: delayed scaling's [x, act, grad_out, d_pre] or None
  // (current scaling); amax_out: [4] written with those tensors' amaxes (grad_out, d_pre: in backward);
  // x_fp8: x quantized before the op (mlp_fp8.h, check_x_fp8), used in place of quantizing x; with
  // its transposed copy empty, backward makes that copy from the row-major one (fp8_transpose);
  // save_pre_fp8: at checkpoint level 0 the pre-activation is kept for backward as its e4m3 copy
  // (current scaling, its own amax) instead of in the model's dtype, and dequantized there.
  m.def("fused_mlp_fp8(Tensor x, Tensor weight1, Tensor? bias1, Tensor weight2, Tensor? bias2, int activation, "
        "int checkpoint_lvl, Tensor[] weights_fp8, int grad_format, Tensor? scales, Tensor(a!)? amax_out, "
        "Tensor[] x_fp8, bool save_pre_fp8=False) -> Tensor");
  // FP8 x @ weight.T + bias with a C++ derivative; weights_fp8 [data, data_t, scale_inv, scale] as
  // fused_mlp_fp8's;
  // scales / amax_out: [x, grad_out]; x_fp8 as fused_mlp_fp8's.
  m.def("fp8_dense(Tensor x, Tensor weight, Tensor? bias, Tensor[] weights_fp8, int grad_format, Tensor? scales, "
        "Tensor(a!)? amax_out, Tensor[] x_fp8) -> Tensor");
}
