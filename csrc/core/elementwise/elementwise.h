// Memory-bound kernels for everything around the GEMM that cuBLASLt's epilogues either cannot
// do (squared ReLU, widths the ReLU bit-mask refuses) or do slower than a separate pass.
// Row-major [rows, cols] matrices, contiguous. `dtype` is the element type of every matrix
// and vector argument (bias, bias_grad included); arithmetic is in fp32. `device` is the device
// the pointers and the stream belong to (its multiprocessor count sizes the grids).
//
// Where each part lives:
//   bias_act_forward.cu     bias_act_forward, act_forward (and the non-ReLU-mask forward kernel)
//   relu_mask_forward.cu    the ReLU forward that writes the bit-mask
//   act_backward.cu         act_backward_bias_grad (checks; the pass without bias gradient)
//   bias_grad_reduction.cu  the pass with bias gradient, reduction_workspace_bytes
//   sum_partials.cu         sum_partials
//   gated_act.cu            gated_act_forward, gated_act_backward
//   cross_entropy.cu        cross_entropy_rows, scale_unless_one
//   norm.cu                 norm_forward, norm_backward
// and, shared by those files only: vector_pack.cuh (element conversions, 16-byte vectors),
// flat_grid.cuh (launch shape, grid-stride iteration), type_dispatch.cuh (codes to template
// arguments), act_backward_step.cuh (one vector of the activation backward, the ReLU mask
// unpacked), elementwise_checks.h (argument checks), elementwise_launch.h (cross-file launchers).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "core/common/types.h"

namespace fused_dense::core {

// out = act(x + bias). bias (length cols) may be null. When pre_act is non-null it receives
// x + bias (GELU, squared ReLU, none) or, for ReLU, the bit-mask (relu_mask_row_bytes(cols)
// bytes per row). x may alias out or pre_act (in-place use after a plain GEMM).
void bias_act_forward(DType dtype, Activation act, const void* x, const void* bias, void* out,
                      void* pre_act, int64_t rows, int64_t cols, int device, cudaStream_t stream);

// The op act_forward: out = act(pre_act), bit-identical to the activation output of the forward
// that saved pre_act (bias_act_forward without bias or saved pre-activation).
void act_forward(DType dtype, Activation act, const void* pre_act, void* out, int64_t rows, int64_t cols,
                 int device, cudaStream_t stream);

// grad_in = grad * act'(pre_act); bias_grad[j] = sum_i grad_in[i, j] when bias_grad is non-null.
// For kNone pre_act is ignored (grad_in = grad, which may then be the same buffer).
// For ReLU pre_act is the bit-mask. grad_in may alias grad.
// act_out, when non-null (gelu_approx and sqrelu only), also receives act(pre_act) in the same
// pass, bit-identical to bias_act_forward's output: checkpoint level 1 rebuilds the activation
// output there instead of in a separate pass that would read pre_act a second time.
// workspace holds the fp32 partial column sums; reduction_workspace_bytes says how much is
// needed; a smaller workspace is used with fewer row chunks (never wrong, only slower). The
// bias gradient is the same bits on every device for the same inputs and workspace size.
std::size_t reduction_workspace_bytes(int64_t rows, int64_t cols);
void act_backward_bias_grad(DType dtype, Activation act, const void* grad, const void* pre_act,
                            void* grad_in, void* bias_grad, int64_t rows, int64_t cols,
                            void* workspace, std::size_t workspace_bytes, int device, cudaStream_t stream,
                            void* act_out = nullptr);

// out[j] = sum over p < nparts of partial[p * stride + j] for j < cols (fp32 partial sums, e.g.
// per-tile column sums written by a GEMM epilogue), in an order fixed by nparts alone, converted
// to dtype. stride >= cols.
void sum_partials(DType dtype, const float* partial, int64_t stride, int64_t nparts, int64_t cols, void* out,
                  cudaStream_t stream);

// The gating of a gated MLP (act = SiLU for kSwiGLU, tanh GELU for kGeGLU) over a packed
// pre-activation gu [rows, 2 hidden] (the layout of types.h, kGatedInterleave):
//   gated_act_forward:  out[i, j] = act(g[i, j]) * u[i, j], out [rows, hidden];
//   gated_act_backward: d_gu = (d_g, d_u) in gu's layout, d_g = d_out * u * act'(g),
//                       d_u = d_out * act(g), from d_out [rows, hidden]; when out is non-null it
//                       also receives act(g) * u, bit-identical to gated_act_forward's (checkpoint
//                       level 1 rebuilds it in this pass). d_gu may be gu itself.
// fp32 math, one rounding per result.
void gated_act_forward(DType dtype, Activation act, const void* gu, void* out, int64_t rows, int64_t hidden,
                       int device, cudaStream_t stream);
void gated_act_backward(DType dtype, Activation act, const void* d_out, const void* gu, void* d_gu, void* out,
                        int64_t rows, int64_t hidden, int device, cudaStream_t stream);

// Cross-entropy over rows of logits y [rows, vocab] (the LM head's chunk), one block per row,
// fp32 math. With z = softcap * tanh(y / softcap) (z = y when softcap is 0), lse = log sum_j
// exp(z_j), eps = label_smoothing and t = target[i]:
//   loss[i] = (1 - eps) (lse - z_t) + eps (lse - mean_j z_j) + z_loss lse^2;
//   write_grad: y[i, j] is overwritten by scale[i * scale_stride] * d loss[i] / d y_j
//     = scale * (exp(z_j - lse) (1 + 2 z_loss lse) - eps / vocab - (1 - eps) [j = t]) * dz/dy
//     with dz/dy = 1 - (z / softcap)^2 (1 without softcap).
// A row whose target is ignore_index gets loss 0, lse 0 and a zero gradient; a target outside
// [0, vocab) otherwise gets NaN in all three. lse_known: lse is read instead of computed (the
// backward's recomputation), and loss is not written. loss may be null.
struct CrossEntropyRowsArgs {
  DType dtype = DType::kBFloat16;
  int64_t rows = 0, vocab = 0;
  void* logits = nullptr;
  const int64_t* target = nullptr;
  int64_t ignore_index = -100;
  float label_smoothing = 0.f, z_loss = 0.f, softcap = 0.f;
  const float* scale = nullptr;
  int64_t scale_stride = 0;
  float* loss = nullptr;
  float* lse = nullptr;
  bool lse_known = false, write_grad = false;
};
void cross_entropy_rows(const CrossEntropyRowsArgs& args, cudaStream_t stream);

// data[0..n) *= *scale in place (fp32 math, rounded once to dtype), where *scale, read on the
// device, is not 1; when it
// is 1 every block returns at once. The LM head's backward scales the gradients the forward made
// by the incoming gradient, which is 1 in the common loss.backward(): no host read, graph-safe.
struct ScaleUnlessOneArgs {
  DType dtype = DType::kBFloat16;
  int64_t n = 0;
  void* data = nullptr;
  const float* scale = nullptr;
  int device = 0;
};
void scale_unless_one(const ScaleUnlessOneArgs& args, cudaStream_t stream);

// RMSNorm (layer_norm false: mean = 0) or LayerNorm over rows of x [rows, cols], one block per
// row, fp32 math: rstd = 1 / sqrt(mean_j (x_j - mean)^2 + eps), out = (x - mean) * rstd * weight
// + bias rounded once to dtype (weight, bias [cols] in dtype; bias may be null). rstd [rows] and,
// where non-null, mean [rows] are float32. amax, where non-null, takes the atomic maximum of |out|
// over the rows (NaN if any out is NaN) and must start at 0: the current scaling amax that
// fp8_quantize then takes as known_amax.
struct NormForwardArgs {
  DType dtype = DType::kBFloat16;
  int64_t rows = 0, cols = 0;
  const void* x = nullptr;
  const void* weight = nullptr;
  const void* bias = nullptr;
  float eps = 1e-6f;
  bool layer_norm = false;
  void* out = nullptr;
  float* rstd = nullptr;
  float* mean = nullptr;
  float* amax = nullptr;
};
void norm_forward(const NormForwardArgs& args, cudaStream_t stream);

// The gradients of norm_forward's out (LayerNorm where mean is non-null, else RMSNorm), fp32
// math from the rounded inputs, one rounding of each result:
//   xhat = (x - mean) * rstd, gy = grad_out * weight,
//   grad_x = rstd * (gy - xhat * mean_j(gy * xhat) - mean_j(gy))   (RMSNorm: no last term),
//   grad_weight = sum_i grad_out * xhat, grad_bias = sum_i grad_out.
// Each output is skipped where its pointer is null. The column sums go through fp32 partial sums
// per block into workspace (norm_backward_workspace_bytes), then sum_partials: their order is
// fixed by rows alone, so the bits are the same on every device. A block keeps its partial sums
// in shared memory, 4 bytes per column and sum: cols <= norm_backward_max_cols(both sums).
struct NormBackwardArgs {
  DType dtype = DType::kBFloat16;
  int64_t rows = 0, cols = 0;
  const void* grad_out = nullptr;
  const void* x = nullptr;
  const void* weight = nullptr;
  const float* rstd = nullptr;
  const float* mean = nullptr;
  void* grad_x = nullptr;
  void* grad_weight = nullptr;
  void* grad_bias = nullptr;
};
std::size_t norm_backward_workspace_bytes(int64_t rows, int64_t cols, bool weight, bool bias);
int64_t norm_backward_max_cols(bool weight_and_bias);
void norm_backward(const NormBackwardArgs& args, void* workspace, std::size_t workspace_bytes, int device,
                   cudaStream_t stream);

}  // namespace fused_dense::core
