// The constants family: the codes and numbers of the op schemas, published once for Python to
// read (fused_dense/ops.py, fused_dense/fp8.py): the activation names in code order, the heuristic
// codes, the MLP's checkpoint levels, the gated codes and the gated layout, the ReLU bit-mask's
// bytes per row, the FP8 formats' names and largest values, and whether the build holds the cutlass_sm90
// kernels. They are defined in csrc/core/common/types.h, checks.h and mlp.h; nothing else spells
// them out. Tensor-free ops: each is defined with its function.
#include <torch/library.h>

#include <string>
#include <tuple>
#include <vector>

#include "torch/checks.h"
#include "torch/fp8.h"
#include "torch/mlp.h"

namespace fused_dense {
namespace {

// (activation names indexed by code, heuristic 'auto' code, heuristic 'unfused' code, the MLP's
// checkpoint levels, the gated activation codes, the gated layout's interleave, the multiple the
// FP8 transposed copies pad their rows to)
std::tuple<std::vector<std::string>, int64_t, int64_t, std::vector<int64_t>, std::vector<int64_t>, int64_t, int64_t>
library_constants() {
  std::vector<std::string> names;
  std::vector<int64_t> gated, levels;
  for (int64_t code = kNoActivation; code <= kLastActivation; ++code) {
    names.push_back(activation_name(code));
    if (is_gated_activation(code)) gated.push_back(code);
  }
  for (int64_t level = 0; level <= kMaxCheckpointLevel; ++level) levels.push_back(level);
  return {names, core::kHeuristicAuto, core::kHeuristicUnfused, levels, gated, core::kGatedInterleave,
          core::kFp8RowPad};
}

// The packed columns of the gate and of the up value of each of `hidden` units (core/common/types.h).
std::tuple<std::vector<int64_t>, std::vector<int64_t>> gated_columns(int64_t hidden) {
  TORCH_CHECK_VALUE(hidden >= 0, "fused_dense::gated_columns: hidden must be >= 0, got ", hidden);
  std::vector<int64_t> gate(hidden), up(hidden);
  for (int64_t j = 0; j < hidden; ++j) {
    gate[j] = core::gated_gate_column(j);
    up[j] = core::gated_up_column(j, hidden);
  }
  return {gate, up};
}

// The largest finite value of an FP8 format, 0 e4m3 or 1 e5m2 (core::fp8_max): saturation clamps to it.
double fp8_format_max(int64_t fp8_format) {
  return core::fp8_max(fp8_format_of(fp8_format, "fused_dense::fp8_format_max", "fp8_format"));
}

// The FP8 format names indexed by code (core::fp8_format_name).
std::vector<std::string> fp8_formats() {
  std::vector<std::string> names;
  for (int code = 0; code < core::kFp8FormatCount; ++code)
    names.push_back(core::fp8_format_name(static_cast<core::Fp8Format>(code)));
  return names;
}

bool cutlass_gemms_compiled() {
#if defined(FUSED_DENSE_WITH_CUTLASS_SM90A)
  return true;
#else
  return false;
#endif
}

}  // namespace
}  // namespace fused_dense

TORCH_LIBRARY_FRAGMENT(fused_dense, m) {
  m.def("library_constants() -> (str[] activation_names, int heuristic_auto, int heuristic_unfused, "
        "int[] checkpoint_levels, int[] gated_activations, int gated_interleave, int fp8_row_pad)",
        &fused_dense::library_constants);
  // The gated layout's columns of each unit's gate and up value, for packing weights (ops.py).
  m.def("gated_columns(int hidden) -> (int[] gate, int[] up)", &fused_dense::gated_columns);
  // Bytes per row of the ReLU bit-mask for a pre-activation of `cols` columns (docs/contract.md).
  m.def("relu_mask_row_bytes(int cols) -> int", [](int64_t cols) { return fused_dense::core::relu_mask_row_bytes(cols); });
  // The FP8 format names in code order, and the largest finite value of fp8_format 0 (e4m3) or 1 (e5m2).
  m.def("fp8_formats() -> str[]", &fused_dense::fp8_formats);
  m.def("fp8_format_max(int fp8_format) -> float", &fused_dense::fp8_format_max);
  // The smallest amax current scaling divides by (core/common/types.h, fp8_scale_from_amax).
  m.def("fp8_min_amax() -> float", []() { return static_cast<double>(fused_dense::core::kFp8MinAmax); });
  // Whether this build holds the library's cutlass_sm90 kernels (csrc/core/cutlass_sm90/), more
  // candidates of 'auto' on compute capability 9.0.
  m.def("cutlass_gemms_compiled() -> bool", &fused_dense::cutlass_gemms_compiled);
}
