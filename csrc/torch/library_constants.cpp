// The codes of the op schemas, published once for Python to read (fused_dense/ops.py): the
// activation names in code order, the heuristic codes, the ReLU bit-mask's bytes per row.
// They are defined in csrc/core/types.h; nothing else spells them out.
#include <torch/library.h>

#include <string>
#include <tuple>
#include <vector>

#include "reference.h"

namespace fused_dense {
namespace {

// (activation names indexed by code, heuristic 'auto' code, heuristic 'unfused' code, the MLP's
// checkpoint levels)
std::tuple<std::vector<std::string>, int64_t, int64_t, std::vector<int64_t>> library_constants() {
  std::vector<std::string> names;
  for (int code = 0; code < 64; ++code) {  // codes are dense from 0; the first unnamed one ends them
    const std::string name = activation_name(code);
    if (name == "unknown") break;
    names.push_back(name);
  }
  return {names, core::kHeuristicAuto, core::kHeuristicUnfused, {0, 1, 2}};  // fused_mlp.cpp's MlpPlan
}

}  // namespace
}  // namespace fused_dense

TORCH_LIBRARY_FRAGMENT(fused_dense, m) {
  m.def("library_constants() -> (str[] activation_names, int heuristic_auto, int heuristic_unfused, "
        "int[] checkpoint_levels)",
        &fused_dense::library_constants);
  // Bytes per row of the ReLU bit-mask for a pre-activation of `cols` columns (docs/contract.md).
  m.def("relu_mask_row_bytes(int cols) -> int", [](int64_t cols) { return fused_dense::core::relu_mask_row_bytes(cols); });
}
