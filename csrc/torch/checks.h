// The binding's op vocabulary (activation and heuristic codes, their ranges) and the argument-check
// helpers every family's checks are built from (csrc/torch/README.md), so every op and every
// backend rejects a mistake of one kind with the same exception type (docs/contract.md, "Errors")
// and a message that names the op, the argument, the expected and the actual value.
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <string>

#include "core/common/types.h"  // plain C++, no CUDA: also usable in the CPU-only build

namespace fused_dense {

// The op schema's integer activation codes are core::Activation's values.
using ActivationCode = core::Activation;
using core::kHeuristicAuto;
using core::relu_mask_row_bytes;

// The codes' ranges, from core::Activation: 0 none, the plain activations up to
// kLastPlainActivation, then the gated ones up to kLastActivation.
inline constexpr int64_t kNoActivation = static_cast<int64_t>(ActivationCode::kNone);
inline constexpr int64_t kLastPlainActivation = static_cast<int64_t>(ActivationCode::kSquaredRelu);
inline constexpr int64_t kLastActivation = static_cast<int64_t>(ActivationCode::kGeGLU);

// Name of an activation code, "unknown" for a code outside the schema (for error messages).
const char* activation_name(int64_t activation);
// Whether a code is one of the schema's: 0 to kLastActivation.
bool is_activation(int64_t activation);
// Whether a code is plain (not gated): 0 (none) to kLastPlainActivation.
bool is_plain_activation(int64_t activation);
// Whether a code is gated (swiglu, geglu: the gated ops and the MLPs take it).
bool is_gated_activation(int64_t activation);

// The codes first..last as a message lists them: "1 (gelu_approx), 2 (relu) or 3 (sqrelu)".
std::string activation_choices(int64_t first, int64_t last);

// `activation` among first..last, else a ValueError "<op>: activation must be <choices>, got
// <code> (<name>)<note>". Returns it.
ActivationCode check_activation_in(const char* op, int64_t activation, int64_t first, int64_t last,
                                   const char* note = "");

// Argument checks; each raises ValueError (TORCH_CHECK_VALUE) naming the argument.
// t is defined, 2-D and contiguous.
void check_matrix(const char* op, const char* name, const at::Tensor& t);
// t is float16, bfloat16, float32 or float64.
void check_float(const char* op, const char* name, const at::Tensor& t);
// t has the dtype and the device of ref.
void check_same(const char* op, const char* name, const at::Tensor& t, const char* ref_name, const at::Tensor& ref);
// t is on the device of ref.
void check_same_device(const char* op, const char* name, const at::Tensor& t, const char* ref_name,
                       const at::Tensor& ref);
// heuristic is -2 (auto), -1 (unfused) or an index >= 0 that fits in int32.
void check_heuristic(const char* op, int64_t heuristic);

// A width of a tensor that also carries the token count (a dimension other than the rows), as the
// integer it is. Under torch.compile the token count is symbolic, and Tensor::size(d) would read
// the whole shape and specialise the graph to it; sym_size(d) reads this one dimension.
inline int64_t width_of(const at::Tensor& t, int64_t dim) { return t.sym_size(dim).guard_int(__FILE__, __LINE__); }

// The dtype the reference math and the float statistics of an op on t use: float64 for float64
// t, else float32 (the loss and lse of lm_head, the rstd and mean of norm).
at::ScalarType float_math_dtype(const at::Tensor& t);

// The saved pre-activation's shape and options, shared by Meta and the real kernels: [rows, cols]
// in like's dtype, or for ReLU its bit-mask [rows, relu_mask_row_bytes(cols)] uint8.
struct PreActLayout {
  std::array<int64_t, 2> sizes;
  at::TensorOptions options;
};
PreActLayout pre_act_layout(const at::Tensor& like, int64_t rows, int64_t cols, ActivationCode act);

// The saved pre-activation allocated through at::empty (Meta; CUDA allocates it with empty_output).
// rows is a SymInt: under torch.compile the token count is symbolic (docs/contract.md).
at::Tensor empty_pre_act(const at::Tensor& like, const c10::SymInt& rows, int64_t cols, ActivationCode act);

}  // namespace fused_dense
