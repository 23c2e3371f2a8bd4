// The two GEMM computations of a gated MLP (act = SiLU for kSwiGLU, tanh GELU for kGeGLU), in
// PyTorch's row-major terms, over the packed fc1 layout of types.h (kGatedInterleave):
//   gated_linear (forward):  gu[B,2h] = input[B,K] @ weight[2h,K]^T (saved on request),
//                            out[B,h] = act(g) * u
//   gated_linear_dgrad:      d_h[B,h] = d_output[B,N] @ weight[N,h] (fc2's weight),
//                            d_pre[B,2h] = (d_h * u * act'(g), d_h * act(g)) in gu's layout,
//                            act(g) * u on request (checkpoint level 1's rebuild)
// Each chooses, like linear.h's ops, among the unfused path (one plain cuBLASLt GEMM, then the
// gating kernel of elementwise.h) and, where the tree holds cutlass_sm90_gated.h, the
// cutlass_sm90 gated kernels (candidates of 'auto' only). The weight gradients of a gated MLP are
// plain GEMMs: linear.h's linear_bias_wgrad. The implementation lives in linear.cpp, beside the
// dispatch it shares.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/ops/linear.h"

namespace fused_dense::core {

struct GatedLinearArgs {
  int64_t batch = 0, in_features = 0, hidden = 0;  // weight [2 hidden, in_features]
  const void* input = nullptr;
  const void* weight = nullptr;
  Activation activation = Activation::kSwiGLU;
  void* out = nullptr;      // [batch, hidden]
  void* pre_act = nullptr;  // may be null: gu [batch, 2 hidden], packed
  int heuristic = kHeuristicAuto;
};

struct GatedLinearDgradArgs {
  int64_t batch = 0, hidden = 0, out_features = 0;  // weight [out_features, hidden]
  const void* weight = nullptr;
  const void* d_output = nullptr;  // [batch, out_features]
  const void* pre_act = nullptr;   // gu [batch, 2 hidden], packed
  Activation activation = Activation::kSwiGLU;
  void* d_pre = nullptr;    // [batch, 2 hidden], packed
  void* act_out = nullptr;  // may be null: act(g) * u [batch, hidden], bit-identical to the forward's
  int heuristic = kHeuristicAuto;
};

// Bytes of workspace each call needs: the GEMM's, then the unfused path's intermediate (gu when
// the forward does not save it, d_h in the data gradient).
std::size_t gated_linear_workspace_bytes(int device, DType dtype, const GatedLinearArgs& args);
std::size_t gated_linear_dgrad_workspace_bytes(int device, DType dtype, const GatedLinearDgradArgs& args);

void gated_linear(const LinearContext& ctx, const GatedLinearArgs& args);
void gated_linear_dgrad(const LinearContext& ctx, const GatedLinearDgradArgs& args);

}  // namespace fused_dense::core
