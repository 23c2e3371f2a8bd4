// The mlp_fp8 family's argument checks (mlp_fp8.cpp), run by its autograd (autograd/mlp_fp8.cpp).
#pragma once

#include <ATen/ATen.h>

#include <cstddef>
#include <optional>

namespace fused_dense {

// fused_mlp_fp8's arguments: the shapes of x [B, K], weight1 [h, K] (gated: the packed [2h, K])
// and weight2 [N, h], the widths K and h positive multiples of 16 and N a multiple of 16 (the FP8
// GEMMs'), the codes, the scaling vectors and the count of weights_fp8 (kFp8WeightTensors a weight).
void check_mlp_fp8(const at::Tensor& x, const at::Tensor& weight1, const at::Tensor& weight2, int64_t activation,
                   int64_t grad_format, const std::optional<at::Tensor>& scales,
                   const std::optional<at::Tensor>& amax_out, at::TensorList weights_fp8);

// fp8_dense's arguments: x [B, K], weight [N, K], K a positive multiple of 16, N a multiple of 16.
void check_fp8_dense(const at::Tensor& x, const at::Tensor& weight, int64_t grad_format,
                     const std::optional<at::Tensor>& scales, const std::optional<at::Tensor>& amax_out,
                     at::TensorList weights_fp8);

// x_fp8: empty, or x's FP8 copies made before the op (a norm's, norm_fp8, or the traced quantize
// under torch.compile): [data [B, K] e4m3, data_t [K, pad16(B)] e4m3 (or [0] where no weight
// gradient reads it), scale_inv [], amax [] float32]. The op reads them as they are, whatever scale
// made them: current scaling's at x's own amax, delayed scaling's at the caller's x scale
// (scales[0]); amax_out's x entry receives their amax. Checked against x.
void check_x_fp8(const at::Tensor& x, at::TensorList x_fp8, const char* op);

// A weight's FP8 copies, made by fp8_quantize(weight, rowwise and columnwise; e4m3, scaled from
// its own amax): the data, its transposed copy (or empty: made again in backward, at `scale`, so
// with the same bytes and no second amax pass), the scale's reciprocal and the scale.
inline constexpr size_t kFp8WeightTensors = 4;
struct Fp8Weight {
  at::Tensor data, data_t, scale_inv, scale;
};

// The FP8 copies of the i-th weight (weight1, weight2) in weights_fp8, checked against it.
Fp8Weight fp8_weight_at(at::TensorList weights_fp8, size_t i, const at::Tensor& weight, const char* op);

}  // namespace fused_dense
