// The three dense-layer computations in PyTorch's row-major terms, each choosing between a
// fused cuBLASLt epilogue and plain GEMM + this library's elementwise kernel.
//   forward:  out[B,N] = act(input[B,K] @ weight[N,K]^T + bias[N]), pre_act saved on request
//   wgrad:    d_weight[N,K] = d_output[B,N]^T @ input[B,K], d_bias[N] = sum_b d_output
//   dgrad:    d_input[B,K] = (d_output[B,N] @ weight[N,K]) * act'(pre_act[B,K]), d_bias[K],
//             act(pre_act) on request
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "gemm.h"
#include "types.h"

namespace fused_dense::core {

struct LinearContext {
  int device = 0;
  DType dtype = DType::kBFloat16;
  bool allow_tf32 = false;
  Workspace workspace;  // gemm_workspace_bytes(device) at least, plus reduction bytes if asked
  cudaStream_t stream = nullptr;
};

struct ForwardArgs {
  int64_t batch = 0, in_features = 0, out_features = 0;
  const void* input = nullptr;
  const void* weight = nullptr;
  const void* bias = nullptr;  // may be null
  Activation activation = Activation::kNone;
  void* out = nullptr;
  void* pre_act = nullptr;  // may be null; ReLU: bit-mask [batch, relu_mask_row_bytes(N)]
  int heuristic = kHeuristicAuto;
};

struct WgradArgs {
  int64_t batch = 0, in_features = 0, out_features = 0;
  const void* input = nullptr;
  const void* d_output = nullptr;
  void* d_weight = nullptr;
  void* d_bias = nullptr;  // may be null
};

struct DgradArgs {
  int64_t batch = 0, in_features = 0, out_features = 0;
  const void* weight = nullptr;
  const void* d_output = nullptr;
  const void* pre_act = nullptr;  // null exactly when activation is kNone
  Activation activation = Activation::kNone;
  void* d_input = nullptr;
  void* d_bias = nullptr;  // may be null
  // may be null; gelu_approx / sqrelu only: act(pre_act) [batch, in_features], bit-identical to
  // the forward's activation output, written by the pass that reads pre_act anyway
  void* act_out = nullptr;
  int heuristic = kHeuristicAuto;
};

// Bytes of workspace each call needs (GEMM workspace plus any reduction scratch).
std::size_t forward_workspace_bytes(int device, const ForwardArgs& args);
std::size_t wgrad_workspace_bytes(int device, const WgradArgs& args);
std::size_t dgrad_workspace_bytes(int device, const DgradArgs& args);

void linear_act_forward(const LinearContext& ctx, const ForwardArgs& args);
void linear_wgrad(const LinearContext& ctx, const WgradArgs& args);
void act_linear_dgrad(const LinearContext& ctx, const DgradArgs& args);

}  // namespace fused_dense::core
