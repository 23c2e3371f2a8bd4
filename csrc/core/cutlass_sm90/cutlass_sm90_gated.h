// The library's cutlass_sm90 kernels of the gated MLP (SwiGLU / GeGLU) for Hopper (CUTLASS 3,
// sm_90a), the gating done in the epilogue of the GEMM next to it:
//  * forward: gu = x @ W^T (W the packed fc1 weight [2h, d], no bias) and out = act(g) * u from
//    the fp32 accumulator, optionally gu itself rounded for the backward;
//  * data gradient of the down projection: d_h = d_out @ W2 (W2 [N, h]) in fp32, then from g and
//    u read back from gu, d_g = d_h * u * act'(g) and d_u = d_h * act(g) into d_gu (packed), and
//    optionally h = act(g) * u (the activation a checkpointed forward dropped).
// act is SiLU (kSwiGLU) or the GELU tanh approximation (kGeGLU), activation_math.cuh's fast
// forms, fp32 math throughout.
//
// The packed layout (types.h, kGatedInterleave = G = 8): column block b of W's rows / gu's
// columns holds the gate of units [b G, b G + G), then their up. Both GEMMs run as row-major
// D[B, n] = A[B, k] * B[k, n] in CUTLASS's terms (the batch along M, features along N), so in
// the wgmma accumulator (cute's CLayout_64xN) each thread holds, at each of its rows, the column
// pairs 2q, 2q + 1 (q = lane % 4) of every 8-column group: columns c and c + G = gate and up of
// the same units in the forward, and two neighbouring units (one 4-byte word of gu, d_gu, out
// and h) in both kernels. With G = 8 a packed block is one 8-column group, so the 4 lanes of a
// row together hold whole groups: 16 contiguous bytes of out or h, 32 of gu or d_gu (g then u).
// The kernels are written for G = 8 (a static_assert in the .cu). (With out features along M
// instead, as the library's other forward kernel has them, a thread holds rows r and r + 8, which
// pairs as well for G = 8, but every access is then 2 bytes wide: the neighbouring units of a
// column sit in neighbouring threads.)
//
// Epilogue: the stock TMA epilogues map one accumulator element to one element of one output
// tile of the accumulator's shape; the forward's out has half the columns of its accumulator
// tile and the backward's d_gu twice, each at packed positions, so neither fits. The epilogue is
// the library's own (GatedEpilogue in the .cu, run through CUTLASS's adapter for epilogues
// without shared memory): each thread computes on its accumulator registers and loads / stores
// global memory directly; the 4 lanes of a row exchange words by warp shuffles (a 4 x 4
// transpose) so that each access is 16 bytes, one 8-value group, where a thread's own values are
// one 4-byte word per group. Rows and column groups past the problem's edge are computed and not
// stored (the exchanges need every lane). In the ping-pong configuration the epilogue of one warp
// group runs under the other's MMAs.
//
// Compiled in when the build finds CUTLASS's headers and targets sm_90a
// (FUSED_DENSE_WITH_CUTLASS_SM90A, setup.py); otherwise the kernels offer no variant.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/gemm/gemm.h"
#include "core/common/types.h"

namespace fused_dense::core {

struct CutlassSm90GatedForwardArgs {
  int device = 0;
  int64_t batch = 0, in_features = 0, hidden = 0;  // B, d, h
  DType dtype = DType::kBFloat16;
  Activation activation = Activation::kSwiGLU;  // kSwiGLU or kGeGLU
  const void* input = nullptr;                  // x [B, d]
  const void* weight = nullptr;                 // W [2h, d], packed
  void* out = nullptr;                          // [B, h] = act(g) * u
  void* gu = nullptr;                           // [B, 2h] packed pre-activation; null: not stored
};

struct CutlassSm90GatedDgradArgs {
  int device = 0;
  int64_t batch = 0, hidden = 0, out_features = 0;  // B, h, N
  DType dtype = DType::kBFloat16;
  Activation activation = Activation::kSwiGLU;  // kSwiGLU or kGeGLU
  const void* d_output = nullptr;               // [B, N]
  const void* weight = nullptr;                 // W2 [N, h]
  const void* gu = nullptr;                     // [B, 2h] packed, as the forward stored it
  void* d_gu = nullptr;                         // [B, 2h] packed; may be gu itself (in place)
  void* act_out = nullptr;                      // [B, h] = act(g) * u; null: not computed
};

// How many variants the tuner may time (tile configurations times kCutlassOrders tile-scheduler
// orders, numbered as tuner.h says); 0 unless the kernel is compiled in, the device is compute
// capability 9.0, the activation kSwiGLU or kGeGLU, the dtype fp16 / bf16, h a multiple of
// kGatedInterleave, every width a multiple of 8 and every pointer 16-byte aligned.
int cutlass_sm90_gated_forward_variants(const CutlassSm90GatedForwardArgs& a);
int cutlass_sm90_gated_dgrad_variants(const CutlassSm90GatedDgradArgs& a);

// Enqueue variant `variant` on the stream. False, with nothing launched, when the problem does
// not fit (checked on every call: a tuned shape may come back at another offset), CUTLASS
// refuses it, or the workspace is too small.
bool cutlass_sm90_gated_forward(int variant, const CutlassSm90GatedForwardArgs& a, const Workspace& ws,
                                cudaStream_t stream);
bool cutlass_sm90_gated_dgrad(int variant, const CutlassSm90GatedDgradArgs& a, const Workspace& ws,
                              cudaStream_t stream);

}  // namespace fused_dense::core
