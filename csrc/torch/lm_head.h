// The LM head family's checks and its chunk loop (lm_head.cpp), shared by its CPU, Meta and CUDA
// kernels (cpu/, meta/, cuda/lm_head.cpp) and its autograd (autograd/lm_head.cpp).
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <optional>
#include <tuple>

namespace fused_dense {

// The reduction codes of the schema: 0 none, 1 mean, 2 sum.
inline constexpr int64_t kReduceNone = 0, kReduceMean = 1, kReduceSum = 2;

// The loss's settings (the schema's scalars). fp8: the logits' and the input gradient's GEMMs in
// FP8 (lm_head.cpp's header comment).
struct LceOptions {
  int64_t ignore_index = -100;
  double label_smoothing = 0.0, z_loss = 0.0, softcap = 0.0;
  int64_t reduction = kReduceMean;
  bool fp8 = false;
};

// One chunk's rows for the backend's cross-entropy kernel (core/elementwise/elementwise.h,
// cross_entropy_rows, has the math): logits [c, vocab] in and, with write_grad, the gradient
// out; scale fp32 [] or [c]; loss fp32 [c] or undefined; lse fp32 [c], read when lse_known.
struct LceRows {
  at::Tensor logits, target, scale, loss, lse;
  bool lse_known = false, write_grad = false;
};
using LceRowsFn = void (*)(const LceRows& rows, const LceOptions& opts);

void check_linear_cross_entropy(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                                const at::Tensor& target, const LceOptions& opts,
                                const std::optional<at::Tensor>& divisor, int64_t chunk_size, const char* op);

// The schema's scalars as options, after the forward's checks (grad_loss and lse null) or the
// backward's (both given).
LceOptions checked_lce_options(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                               const at::Tensor& target, int64_t ignore_index, double label_smoothing, double z_loss,
                               double softcap, int64_t reduction, const std::optional<at::Tensor>& divisor,
                               int64_t chunk_size, bool fp8, const at::Tensor* grad_loss, const at::Tensor* lse);

// grad_loss has the loss's shape (reduction none: [tokens], else []) and lse is float32 [tokens].
void check_lce_backward(const at::Tensor& grad_loss, const at::Tensor& lse, const at::Tensor& input,
                        int64_t reduction, const char* op);

// Targets outside [0, vocab) other than ignore_index: a ValueError naming the first one. Reads
// the targets on the host (a device synchronisation on a GPU).
void check_targets_in_range(const at::Tensor& target, int64_t vocab, int64_t ignore_index, const char* op);

// The tokens per chunk: chunk_size when positive, else the rule of lm_head.cpp for a head of
// width d and vocab rows whose logits take element_bytes each (the input's dtype).
int64_t lce_chunk_rows(int64_t rows, int64_t d, int64_t vocab, int64_t element_bytes, int64_t chunk_size);

// linear_cross_entropy_scale_grads_'s argument checks (every backend): each of grads on
// grad_loss's device, grad_loss one number of a floating dtype.
void check_lce_scale_grads(at::TensorList grads, const at::Tensor& grad_loss);
// t = t * grad_loss in fp32 (fp64 for float64), rounded once to t's dtype: the CPU kernel and the
// CUDA kernel's fallback.
void lce_scale_reference(const at::Tensor& t, const at::Tensor& grad_loss);

// (loss, lse, grad_input, grad_weight, grad_bias): lm_head.cpp's header comment.
using LceForwardResult = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
using LceBackwardResult = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

// The ops' chunk loops over a backend's rows kernel (inputs checked, contiguous).
LceForwardResult lce_forward(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                             const at::Tensor& target, const LceOptions& opts, const std::optional<at::Tensor>& divisor,
                             int64_t chunk_size, std::array<bool, 3> grads, LceRowsFn rows_fn);
LceBackwardResult lce_backward(const at::Tensor& grad_loss, const at::Tensor& input, const at::Tensor& weight,
                               const std::optional<at::Tensor>& bias, const at::Tensor& target, const at::Tensor& lse,
                               const LceOptions& opts, const std::optional<at::Tensor>& divisor, int64_t chunk_size,
                               std::array<bool, 3> grads, LceRowsFn rows_fn);

// An op kernel over a backend: Backend::rows runs the rows of a chunk, Backend::reads_targets(t)
// says whether the targets may be read on the host to refuse those out of range (else the rows
// kernel poisons those rows with NaN).
template <typename Backend>
LceForwardResult lce_forward_op(const at::Tensor& input, const at::Tensor& weight,
                                const std::optional<at::Tensor>& bias, const at::Tensor& target, int64_t ignore_index,
                                double label_smoothing, double z_loss, double softcap, int64_t reduction,
                                const std::optional<at::Tensor>& divisor, int64_t chunk_size,
                                std::array<bool, 3> grads, bool fp8) {
  const LceOptions opts = checked_lce_options(input, weight, bias, target, ignore_index, label_smoothing, z_loss,
                                              softcap, reduction, divisor, chunk_size, fp8, nullptr, nullptr);
  if (Backend::reads_targets(target))
    check_targets_in_range(target, weight.size(0), ignore_index, "fused_dense::linear_cross_entropy_forward");
  return lce_forward(input, weight, bias, target, opts, divisor, chunk_size, grads, &Backend::rows);
}

template <typename Backend>
LceBackwardResult lce_backward_op(const at::Tensor& grad_loss, const at::Tensor& input, const at::Tensor& weight,
                                  const std::optional<at::Tensor>& bias, const at::Tensor& target,
                                  const at::Tensor& lse, int64_t ignore_index, double label_smoothing, double z_loss,
                                  double softcap, int64_t reduction, const std::optional<at::Tensor>& divisor,
                                  int64_t chunk_size, std::array<bool, 3> grads, bool fp8) {
  const LceOptions opts = checked_lce_options(input, weight, bias, target, ignore_index, label_smoothing, z_loss,
                                              softcap, reduction, divisor, chunk_size, fp8, &grad_loss, &lse);
  if (Backend::reads_targets(target))
    check_targets_in_range(target, weight.size(0), ignore_index, "fused_dense::linear_cross_entropy_backward");
  return lce_backward(grad_loss, input, weight, bias, target, lse, opts, divisor, chunk_size, grads, &Backend::rows);
}

// The outputs, allocated (Meta).
LceForwardResult empty_lce_forward(const at::Tensor& input, const at::Tensor& weight,
                                   const std::optional<at::Tensor>& bias, int64_t reduction, std::array<bool, 3> grads);
LceBackwardResult empty_lce_grads(const at::Tensor& input, const at::Tensor& weight,
                                  const std::optional<at::Tensor>& bias, std::array<bool, 3> grads);

}  // namespace fused_dense
