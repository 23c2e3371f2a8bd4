// The launchers one elementwise file offers another (internal to the elementwise files). They
// enqueue their kernels without checking arguments: the entry points of elementwise.h have.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "core/common/types.h"

namespace fused_dense::core::elementwise_detail {

// relu_mask_forward.cu: out = relu(x + bias) and mask = the bit-mask of x + bias >= 0
// (relu_mask_row_bytes(cols) bytes per row); bias may be null. ptrs_aligned: x, out and bias
// are 16-byte aligned (the vector paths also need cols % 8 == 0, checked here).
void launch_bias_relu_mask(DType dtype, const void* x, const void* bias, void* out, uint8_t* mask, int64_t rows,
                           int64_t cols, bool ptrs_aligned, int device, cudaStream_t stream);

// bias_grad_reduction.cu: the row-chunk count of the bias-gradient reduction that
// reduction_workspace_bytes sizes the workspace for; rows > 0, cols > 0.
int64_t preferred_reduction_chunks(int64_t rows, int64_t cols);

// bias_grad_reduction.cu: grad_in = grad * act'(pre_act) (not written when grad_in is null),
// act_out = act(pre_act) when non-null, and bias_grad = the column sums of grad_in, reduced over
// nchunks row chunks through `partial` (nchunks * cols floats). ptrs_aligned: every matrix
// pointer given is 16-byte aligned (the vector path also needs cols to be a multiple of the
// vector width, checked here).
void launch_act_backward_bias_grad(DType dtype, Activation act, const void* grad, const void* pre_act, void* grad_in,
                                   void* act_out, void* bias_grad, int64_t rows, int64_t cols, float* partial,
                                   int64_t nchunks, bool ptrs_aligned, cudaStream_t stream);

// sum_partials.cu: out[j] = sum over p < nparts of partial[p * stride + j], j < cols, in dtype.
void launch_sum_partials(DType dtype, const float* partial, int64_t stride, int64_t nparts, int64_t cols, void* out,
                         cudaStream_t stream);

}  // namespace fused_dense::core::elementwise_detail
