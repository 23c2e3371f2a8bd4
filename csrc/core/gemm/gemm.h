// The one cuBLASLt matmul entry of the library. Every op (forward with GELU/ReLU aux,
// wgrad with BGRADB, dgrad with DGELU/DRELU + BGRAD, plain) is a GemmProblem plus pointers.
//
// cuBLASLt is column-major: D[m, n] = op(A)[m, k] * op(B)[k, n] (+ D when accumulate).
// The row-major PyTorch views map onto it in linear.cpp.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "core/common/types.h"

namespace fused_dense::core {

enum class Epilogue : int {
  kNone = 0,     // with_bias: D += bias (length m)
  kGelu,         // D = gelu(AB [+ bias]); see with_bias
  kGeluAux,      // as kGelu, and aux = AB [+ bias] (the pre-activation)
  kRelu,
  kReluAux,      // aux = bit-mask of AB [+ bias] >= 0 (what cuBLASLt writes, measured on the H200)
  kDGelu,        // D = AB * gelu'(aux); with bias_grad: bias_grad = row sums of D
  kDRelu,        // D = AB * (aux bit set)
  kBGradB,       // bias_grad[n] = sum over k of B  (the wgrad bias gradient)
};

struct GemmProblem {
  int device = 0;  // the device the call runs on: its cuBLASLt handle and workspace policy
  DType dtype = DType::kBFloat16;  // A, B, D, bias and aux element type
  bool trans_a = false;
  bool trans_b = false;
  int64_t m = 0, n = 0, k = 0;
  int64_t lda = 0, ldb = 0, ldd = 0;
  Epilogue epilogue = Epilogue::kNone;
  bool with_bias = false;    // forward epilogues: bias added before the activation
  bool with_bias_grad = false;  // kDGelu / kDRelu: also write the bias gradient
  int64_t ld_aux = 0;        // in elements (bits for the ReLU mask)
  bool accumulate = false;   // beta = 1
  bool allow_tf32 = false;   // fp32 only
  // FP8 operands (fp8.h): A and B hold elements of a_format / b_format (trans_a and !trans_b:
  // both K-major, the one layout Hopper's FP8 GEMMs take), dequantized by the device scalars
  // GemmPointers::a_scale / b_scale; D and bias stay `dtype`. fast_accum: Hopper's fast FP8
  // accumulation (CUBLASLT_MATMUL_DESC_FAST_ACCUM).
  bool fp8 = false;
  Fp8Format a_format = Fp8Format::kE4M3, b_format = Fp8Format::kE4M3;
  bool fast_accum = false;
};

struct GemmPointers {
  const void* a = nullptr;
  const void* b = nullptr;
  void* d = nullptr;
  const void* bias = nullptr;  // forward bias, length m
  void* bias_grad = nullptr;   // BGRAD output: length m (DGELU/DRELU) or n (BGRADB)
  void* aux = nullptr;
  const float* a_scale = nullptr;  // FP8 only: A's dequantization factor (its scale_inv)
  const float* b_scale = nullptr;
};

struct Workspace {
  void* ptr = nullptr;
  std::size_t bytes = 0;
};

// Workspace policy for cuBLASLt: 32 MiB on compute capability >= 9, 4 MiB otherwise (of `device`,
// device_info.h).
std::size_t gemm_workspace_bytes(int device);

// Number of algorithms cuBLASLt's heuristic offers for a problem (0 = refused). Cached.
int gemm_algorithm_count(const GemmProblem& problem);

// Runs the problem with the heuristic-th algorithm of cuBLASLt's list (0 = its first choice).
// Throws HeuristicOutOfRange when heuristic >= gemm_algorithm_count(problem), and Error
// when cuBLASLt refuses the problem or the launch fails.
void gemm(const GemmProblem& problem, const GemmPointers& ptrs, int heuristic,
          const Workspace& workspace, cudaStream_t stream);

// The algorithm at `index` of cuBLASLt's list for the problem (its heuristic, asked once per
// problem); false past the end of the list. A tuned choice stores the algorithm itself, so that
// it can run at another M of its bucket (tuner.h).
bool gemm_algorithm(const GemmProblem& problem, int index, cublasLtMatmulAlgo_t* algo);

// Runs the problem with a stored algorithm after checking it for this exact problem with
// cublasLtMatmulAlgoCheck (once per problem and algorithm; no heuristic query). False, with
// nothing launched, when the check refuses it or it needs more workspace than given, and false
// when cuBLASLt reports CUBLAS_STATUS_NOT_SUPPORTED at launch. The algorithm must come from a
// problem whose operands were at least as aligned as these (gemm_algorithm's lists assume 256
// bytes; the caller checks).
bool try_gemm_algorithm(const GemmProblem& problem, const GemmPointers& ptrs, const cublasLtMatmulAlgo_t& algo,
                        const Workspace& workspace, cudaStream_t stream);

// How many times this process asked cuBLASLt's heuristic for an algorithm list (one per distinct
// problem, alignment and workspace): what a new token count costs on the per-call path.
int64_t gemm_heuristic_queries();
// GEMM plans now held (bounded: the least recently used are dropped).
int64_t gemm_plans_cached();

// Returns false instead of throwing when cuBLASLt offers no algorithm or reports
// CUBLAS_STATUS_NOT_SUPPORTED at launch, so a caller can take its unfused path.
bool try_gemm(const GemmProblem& problem, const GemmPointers& ptrs, int heuristic,
              const Workspace& workspace, cudaStream_t stream);

}  // namespace fused_dense::core
