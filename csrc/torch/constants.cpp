// The codes of the op schemas, published once for Python to read (fused_dense/ops.py): the
// activation names in code order, the heuristic codes, the ReLU bit-mask's bytes per row, the
// gated codes and the gated layout.
// They are defined in csrc/core/common/types.h; nothing else spells them out.
#include <torch/library.h>

#include <string>
#include <tuple>
#include <vector>

#include "reference.h"

namespace fused_dense {
namespace {

// (activation names indexed by code, heuristic 'auto' code, heuristic 'unfused' code, the MLP's
// checkpoint levels, the gated activation codes, the gated layout's interleave)
std::tuple<std::vector<std::string>, int64_t, int64_t, std::vector<int64_t>, std::vector<int64_t>, int64_t>
library_constants() {
  std::vector<std::string> names;
  std::vector<int64_t> gated;
  for (int code = 0; code < 64; ++code) {  // codes are dense from 0; the first unnamed one ends them
    const std::string name = activation_name(code);
    if (name == "unknown") break;
    names.push_back(name);
    if (core::is_gated(static_cast<core::Activation>(code))) gated.push_back(code);
  }
  return {names, core::kHeuristicAuto, core::kHeuristicUnfused, {0, 1, 2},  // fused_mlp.cpp's MlpPlan
          gated, core::kGatedInterleave};
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

}  // namespace
}  // namespace fused_dense

TORCH_LIBRARY_FRAGMENT(fused_dense, m) {
  m.def("library_constants() -> (str[] activation_names, int heuristic_auto, int heuristic_unfused, "
        "int[] checkpoint_levels, int[] gated_activations, int gated_interleave)",
        &fused_dense::library_constants);
  // The gated layout's columns of each unit's gate and up value, for packing weights (ops.py).
  m.def("gated_columns(int hidden) -> (int[] gate, int[] up)", &fused_dense::gated_columns);
  // Bytes per row of the ReLU bit-mask for a pre-activation of `cols` columns (docs/contract.md).
  m.def("relu_mask_row_bytes(int cols) -> int", [](int64_t cols) { return fused_dense::core::relu_mask_row_bytes(cols); });
}
