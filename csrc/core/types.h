// Framework-free vocabulary shared by the cuBLASLt GEMM and the elementwise kernels.
// No PyTorch header may be included anywhere under csrc/core.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

namespace fused_dense::core {

enum class DType : int { kFloat16 = 0, kBFloat16 = 1, kFloat32 = 2 };

// Integer codes are part of the op schema (the `activation` argument), keep them stable.
enum class Activation : int { kNone = 0, kGeluTanh = 1, kRelu = 2, kSquaredRelu = 3 };

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
