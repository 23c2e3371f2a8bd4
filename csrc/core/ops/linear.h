// The three dense-layer computations in PyTorch's row-major terms, one function per op of the
// same name, each choosing between a fused cuBLASLt epilogue, plain GEMM + this library's
// elementwise kernel and, where they apply, the cutlass_sm90 kernels: the heuristic argument's
// path, or with 'auto' the tuner's choice (linear.cpp's dispatch asks choose() of tuner.h once).
// The FP8 forms: fp8_linear.h.
//   linear_act (forward):        out[B,N] = act(input[B,K] @ weight[N,K]^T + bias[N]), pre_act
//                                saved on request
//   linear_bias_wgrad:           d_weight[N,K] = d_output[B,N]^T @ input[B,K],
//                                d_bias[N] = sum_b d_output
//   act_linear_dgrad:            d_input[B,K] = (d_output[B,N] @ weight[N,K]) * act'(pre_act[B,K]),
//                                d_bias[K], act(pre_act) on request
// (The fourth op, act_forward, is elementwise only: elementwise.h.)
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "core/gemm/gemm.h"
#include "core/common/types.h"

namespace fused_dense::core {

struct LinearContext {
  int device = 0;  // the device of the call's tensors and stream (device_info.h is keyed by it)
  DType dtype = DType::kBFloat16;
  bool allow_tf32 = false;
  Workspace workspace;  // gemm_workspace_bytes(device) at least, plus reduction bytes if asked
  cudaStream_t stream = nullptr;
  // Deterministic mode (tuner.h, choose()'s `fixed`): 'auto' takes no choice timed in this process.
  bool deterministic = false;
};

// The GEMM's part of the context's workspace: its first gemm_workspace_bytes(device) bytes (the
// size cuBLASLt's algorithm lists assume; a workspace with reduction scratch is longer).
inline Workspace gemm_workspace_part(const LinearContext& ctx) {
  return Workspace{ctx.workspace.ptr, std::min(ctx.workspace.bytes, gemm_workspace_bytes(ctx.device))};
}

struct LinearActArgs {
  int64_t batch = 0, in_features = 0, out_features = 0;
  const void* input = nullptr;
  const void* weight = nullptr;
  const void* bias = nullptr;  // may be null
  Activation activation = Activation::kNone;
  void* out = nullptr;
  void* pre_act = nullptr;  // may be null; ReLU: bit-mask [batch, relu_mask_row_bytes(N)]
  int heuristic = kHeuristicAuto;
};

struct LinearBiasWgradArgs {
  int64_t batch = 0, in_features = 0, out_features = 0;
  const void* input = nullptr;
  const void* d_output = nullptr;
  void* d_weight = nullptr;
  void* d_bias = nullptr;  // may be null
};

struct ActLinearDgradArgs {
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
std::size_t linear_act_workspace_bytes(int device, const LinearActArgs& args);
std::size_t linear_bias_wgrad_workspace_bytes(int device, const LinearBiasWgradArgs& args);
std::size_t act_linear_dgrad_workspace_bytes(int device, const ActLinearDgradArgs& args);

void linear_act(const LinearContext& ctx, const LinearActArgs& args);
void linear_bias_wgrad(const LinearContext& ctx, const LinearBiasWgradArgs& args);
void act_linear_dgrad(const LinearContext& ctx, const ActLinearDgradArgs& args);

}  // namespace fused_dense::core
