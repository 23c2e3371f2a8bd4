// Framework-free vocabulary shared by the cuBLASLt GEMM and the elementwise kernels.
// No PyTorch header may be included anywhere under csrc/core.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

namespace fused_dense::core {

enum class DType : int { kFloat16 = 0, kBFloat16 = 1, kFloat32 = 2 };

// Integer codes are part of the op schema (the `activation` argument), keep them stable.
// kSwiGLU / kGeGLU are the gated activations act(g) * u of a gated MLP (act = SiLU / GELU tanh
// approximation), g and u packed as kGatedInterleave says.
// TODO(gated): the gated-MLP ops branch defines these codes and kGatedInterleave too; keep one
// definition when the branches meet (the cutlass_sm90_gated kernels need only the names).
enum class Activation : int { kNone = 0, kGeluTanh = 1, kRelu = 2, kSquaredRelu = 3, kSwiGLU = 4, kGeGLU = 5 };

// The packed fc1 weight of a gated MLP, W[2h, d], holds the gate and up rows interleaved in
// blocks of kGatedInterleave hidden units: block b is the gate rows of units [b G, b G + G), then
// the up rows of the same units. The pre-activation gu[B, 2h] and its gradient use the same
// column order. 8 = the column distance between the values a thread holds at the same row of a
// wgmma accumulator (cutlass_sm90_gated.h), so a thread holds the gate and up of its units.
inline constexpr int64_t kGatedInterleave = 8;

// The heuristic argument: >= 0 picks that entry of cuBLASLt's list for the fused epilogue.
constexpr int kHeuristicUnfused = -1;  // plain GEMM + elementwise kernel
constexpr int kHeuristicAuto = -2;     // measured choice (tuner.h), or the fixed rule

const char* dtype_name(DType dtype);
const char* activation_name(Activation act);
std::size_t dtype_size(DType dtype);

// Bytes per row of the ReLU bit-mask: bit (j % 8) of byte (j / 8) of row i is set
// exactly when pre_act[i, j] >= 0. Rows are padded to whole bytes (padding bits 0).
// ">= 0" is what cuBLASLt's RELU_AUX epilogue writes (measured on the H200, CUDA 13.0: an exact
// zero sets its bit); every path follows it so fused, unfused and CPU masks agree bit for bit.
// It differs from PyTorch's relu backward only at pre_act == 0 exactly (subgradient 1, not 0).
inline int64_t relu_mask_row_bytes(int64_t cols) { return (cols + 7) / 8; }

// Every failure inside the core surfaces as this type; the torch layer turns it into a
// c10::Error so Python sees a RuntimeError carrying the same message.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// Raised for a heuristic index past the algorithms cuBLASLt offers for a problem.
class HeuristicOutOfRange : public Error {
 public:
  using Error::Error;
};

}  // namespace fused_dense::core
