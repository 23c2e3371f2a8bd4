// The shared vocabulary and check helpers (checks.h). Every argument mistake is a ValueError
// (TORCH_CHECK_VALUE): docs/contract.md, "Errors".
#include "torch/checks.h"

#include <c10/util/Exception.h>

#include <limits>

namespace fused_dense {

const char* activation_name(int64_t activation) {
  if (activation < 0 || activation > std::numeric_limits<int>::max()) return "unknown";
  return core::activation_name(static_cast<core::Activation>(activation));
}

bool is_activation(int64_t activation) { return activation >= kNoActivation && activation <= kLastActivation; }

bool is_plain_activation(int64_t activation) {
  return activation >= kNoActivation && activation <= kLastPlainActivation;
}

bool is_gated_activation(int64_t activation) {
  return is_activation(activation) && core::is_gated(static_cast<core::Activation>(activation));
}

std::string activation_choices(int64_t first, int64_t last) {
  std::string s;
  for (int64_t code = first; code <= last; ++code) {
    if (code > first) s += code == last ? " or " : ", ";
    s += std::to_string(code) + " (" + activation_name(code) + ")";
  }
  return s;
}

ActivationCode check_activation_in(const char* op, int64_t activation, int64_t first, int64_t last,
                                   const char* note) {
  TORCH_CHECK_VALUE(activation >= first && activation <= last, op, ": activation must be ",
                    activation_choices(first, last), ", got ", activation, " (", activation_name(activation), ")",
                    note);
  return static_cast<ActivationCode>(activation);
}

void check_matrix(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK_VALUE(t.defined(), op, ": ", name, " must be a tensor, got an undefined tensor");
  TORCH_CHECK_VALUE(t.dim() == 2, op, ": ", name, " must be 2-D, got ", t.dim(), "-D with shape ", t.sizes());
  TORCH_CHECK_VALUE(t.is_contiguous(), op, ": ", name, " must be contiguous (row-major), got strides ", t.strides(),
                    " for shape ", t.sizes());
}

at::ScalarType float_math_dtype(const at::Tensor& t) {
  return t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

void check_float(const char* op, const char* name, const at::Tensor& t) {
  const auto s = t.scalar_type();
  TORCH_CHECK_VALUE(s == at::kHalf || s == at::kBFloat16 || s == at::kFloat || s == at::kDouble, op, ": ", name,
                    " must have dtype float16, bfloat16, float32 or float64, got ", s);
}

void check_same(const char* op, const char* name, const at::Tensor& t, const char* ref_name, const at::Tensor& ref) {
  TORCH_CHECK_VALUE(t.scalar_type() == ref.scalar_type(), op, ": ", name, " must have the dtype of ", ref_name, " (",
                    ref.scalar_type(), "), got ", t.scalar_type());
  check_same_device(op, name, t, ref_name, ref);
}

void check_same_device(const char* op, const char* name, const at::Tensor& t, const char* ref_name,
                       const at::Tensor& ref) {
  TORCH_CHECK_VALUE(t.device() == ref.device(), op, ": ", name, " must be on the device of ", ref_name, " (",
                    ref.device(), "), got ", t.device());
}

void check_heuristic(const char* op, int64_t heuristic) {
  TORCH_CHECK_VALUE(heuristic >= kHeuristicAuto, op,
                    ": heuristic must be -2 (auto), -1 (unfused) or a cuBLASLt algorithm index >= 0, got ",
                    heuristic);
  TORCH_CHECK_VALUE(heuristic <= std::numeric_limits<int>::max(), op, ": heuristic must fit in int32, got ",
                    heuristic);
}

PreActLayout pre_act_layout(const at::Tensor& like, int64_t rows, int64_t cols, ActivationCode act) {
  if (act == ActivationCode::kRelu) return {{rows, relu_mask_row_bytes(cols)}, like.options().dtype(at::kByte)};
  return {{rows, cols}, like.options()};
}

at::Tensor empty_pre_act(const at::Tensor& like, const c10::SymInt& rows, int64_t cols, ActivationCode act) {
  const PreActLayout layout = pre_act_layout(like, 0, cols, act);  // the width and dtype; rows may be symbolic
  return at::empty_symint({rows, c10::SymInt(layout.sizes[1])}, layout.options);
}

}  // namespace fused_dense
