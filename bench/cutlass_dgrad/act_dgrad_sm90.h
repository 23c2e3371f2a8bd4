// Probe, not part of the library: fc2's data gradient with the GELU backward and fc1's bias
// gradient fused into the GEMM's epilogue, on CUTLASS 3's Hopper (sm_90a) warp-specialized
// kernels. Question it answers: is one such GEMM faster than what fused_dense does today
// (cuBLASLt GEMM, then this library's elementwise GELU-backward + bias-reduction pass)?
//
//   d_input[B, K] = (d_output[B, N] @ weight[N, K]) * gelu_approx'(pre_act[B, K])
//   d_bias[K]     = sum over B of d_input (summed in fp32 before d_input is rounded)
//
// In CUTLASS's column-major terms the GEMM is D[K, B] = W^T[K, N] * dY^T[N, B]: weight is an
// M-major A, d_output a K-major B, and the bias gradient is a per-row (M) reduction of D.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace fused_dense_probe {

struct ActDgradProblem {
  int64_t batch = 0, in_features = 0, out_features = 0;  // B, K (GEMM rows), N (GEMM depth)
  const void* weight = nullptr;    // [N, K] bf16
  const void* d_output = nullptr;  // [B, N] bf16
  const void* pre_act = nullptr;   // [B, K] bf16
  void* d_input = nullptr;         // [B, K] bf16
  void* d_bias = nullptr;          // [K] bf16
};

// Tile configurations compiled into the probe; names say tile M x N, cluster and schedule.
// Config 3 is not fused: the same kind of GEMM writing d_act only (pre_act and d_bias unused);
// configs 5 and 6 apply the GELU backward but leave d_bias unwritten.
constexpr int kNumConfigs = 7;
const char* config_name(int config);

// The persistent tile scheduler's order: tiles grouped swizzle at a time (1, 2, 4, 8) along
// raster 0 (CUTLASS's heuristic), 1 (along M) or 2 (along N); it decides how much of A and B
// the tiles running at once share in L2.
struct Schedule {
  int swizzle = 1;
  int raster = 0;
};

// Workspace bytes the config needs for this problem (the bias reduction's partial sums and
// tile counters), or an error message in *error.
size_t act_dgrad_workspace_bytes(int config, const ActDgradProblem& p, const Schedule& sched, std::string* error);

// Empty string on success, otherwise what CUTLASS refused or which status it returned.
std::string act_dgrad(int config, const ActDgradProblem& p, const Schedule& sched, void* workspace,
                      size_t workspace_bytes, int sm_count, cudaStream_t stream);

}  // namespace fused_dense_probe
