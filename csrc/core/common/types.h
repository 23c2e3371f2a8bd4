// Framework-free vocabulary shared by the cuBLASLt GEMM and the elementwise kernels.
// No PyTorch header may be included anywhere under csrc/core.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

// The few helpers below that device code calls too (the gated layout).
#if defined(__CUDACC__)
#define FD_HOST_DEVICE __host__ __device__
#else
#define FD_HOST_DEVICE
#endif

namespace fused_dense::core {

enum class DType : int { kFloat16 = 0, kBFloat16 = 1, kFloat32 = 2 };

// Integer codes are part of the op schema (the `activation` argument), keep them stable.
// kSwiGLU and kGeGLU are the gated activations act(g) * u of a gated MLP (SiLU, and GELU with the
// tanh approximation); they take a packed pre-activation of twice the output's width (below).
enum class Activation : int { kNone = 0, kGeluTanh = 1, kRelu = 2, kSquaredRelu = 3, kSwiGLU = 4, kGeGLU = 5 };

FD_HOST_DEVICE constexpr bool is_gated(Activation act) { return act == Activation::kSwiGLU || act == Activation::kGeGLU; }

// The packed layout of a gated MLP's fc1, one definition: the weight [2h, d] holds the gate and
// up rows of the h hidden units interleaved in blocks of kGatedInterleave units. Block b holds the
// gate rows of units [b G, min(b G + G, h)), then the up rows of the same units; only the last
// block may be short. The pre-activation gu [rows, 2h] and its gradient have the same column
// layout, so the GEMMs over the packed weight are plain GEMMs. 8 = the column distance between
// the two values a thread holds in each 8-column group of a row of a wgmma accumulator, so in the
// cutlass_sm90 gated kernels (batch along CUTLASS's M, features along N) a thread holds the gate
// and the up value of its units (cutlass_sm90_gated.h).
inline constexpr int64_t kGatedInterleave = 8;

// Columns of hidden unit j's gate and up values in a packed row of a gated layer of h units.
FD_HOST_DEVICE inline int64_t gated_gate_column(int64_t unit) {
  return (unit / kGatedInterleave) * 2 * kGatedInterleave + unit % kGatedInterleave;
}
FD_HOST_DEVICE inline int64_t gated_up_column(int64_t unit, int64_t hidden) {
  const int64_t start = (unit / kGatedInterleave) * kGatedInterleave;
  const int64_t width = hidden - start < kGatedInterleave ? hidden - start : kGatedInterleave;
  return gated_gate_column(unit) + width;
}

// FP8 element formats (elementwise/fp8_quantize.h). Integer codes are part of the op schemas (the
// `fp8_format` arguments): keep them stable. Codes run 0 .. kFp8FormatCount - 1.
enum class Fp8Format : int { kE4M3 = 0, kE5M2 = 1 };
inline constexpr int kFp8FormatCount = 2;

// The largest finite value of each format (e4m3fn: 448, e5m2: 57344): saturation clamps to it.
FD_HOST_DEVICE inline float fp8_max(Fp8Format f) { return f == Fp8Format::kE4M3 ? 448.f : 57344.f; }

// The smallest amax a scale is computed from: an all-zero tensor (amax 0) gets the scale of
// 1e-12 instead of an infinite one, so its zeros stay zeros (0 * inf would be NaN).
inline constexpr float kFp8MinAmax = 1e-12f;

// The current-scaling rule, one definition (the CPU reference computes the same fp32 expression):
// scale = fp8_max / max(amax, kFp8MinAmax); a NaN amax gives a NaN scale (a NaN in the tensor
// makes the whole quantized tensor NaN, so a diverged step is not hidden). An infinite amax gives
// scale 0.
FD_HOST_DEVICE inline float fp8_scale_from_amax(float amax, Fp8Format f) {
  if (amax != amax) return amax;
  return fp8_max(f) / (amax > kFp8MinAmax ? amax : kFp8MinAmax);
}

// Rows of the transposed copy are padded to a multiple of this (with zeros), so that it can be
// the K-major operand of an FP8 GEMM over the rows (cuBLASLt needs K and the leading dimension of
// FP8 operands to be multiples of 16).
inline constexpr int64_t kFp8RowPad = 16;
// Int is int64_t, or in the binding c10::SymInt (the token count, symbolic under torch.compile).
template <typename Int>
inline Int fp8_padded_rows(const Int& rows) { return (rows + kFp8RowPad - 1) / kFp8RowPad * kFp8RowPad; }

// The heuristic argument: >= 0 picks that entry of cuBLASLt's list for the fused epilogue.
constexpr int kHeuristicUnfused = -1;  // plain GEMM + elementwise kernel
constexpr int kHeuristicAuto = -2;     // measured choice (tuner.h), or the fixed rule

const char* dtype_name(DType dtype);
const char* activation_name(Activation act);
const char* fp8_format_name(Fp8Format f);
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
