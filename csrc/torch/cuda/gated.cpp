// CUDA kernels of the gated family: validate, allocate from PyTorch's caching allocator, hand raw
// pointers to the core (core/ops/gated.h) on the tensors' device and stream.
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "core/elementwise/elementwise.h"
#include "core/ops/gated.h"
#include "torch/cpu/reference.h"
#include "torch/cuda/core_call.h"
#include "torch/gated.h"

namespace fused_dense {
namespace {

std::vector<at::Tensor> gated_linear_cuda(const at::Tensor& input, const at::Tensor& weight, int64_t activation,
                                          bool save_pre_act, int64_t heuristic) {
  if (input.scalar_type() == at::kDouble)
    return gated_linear_reference(input, weight, activation, save_pre_act, heuristic);
  const ActivationCode act = check_gated_linear(input, weight, activation, heuristic);
  check_cuda_dims("fused_dense::gated_linear", {{"batch (input.size(0))", input.size(0)},
                                                {"in_features", input.size(1)},
                                                {"2 * hidden (weight.size(0))", weight.size(0)}});
  c10::cuda::CUDAGuard guard(input.device());
  const int64_t B = input.size(0), H = weight.size(0) / 2;
  auto out = empty_output({B, H}, input.options());
  at::Tensor pre_act;
  if (save_pre_act) pre_act = empty_output({B, 2 * H}, input.options());

  core::GatedLinearArgs args;
  args.batch = B, args.in_features = input.size(1), args.hidden = H;
  args.input = input.data_ptr();
  args.weight = weight.data_ptr();
  args.activation = act;
  args.out = out.data_ptr();
  args.pre_act = save_pre_act ? pre_act.data_ptr() : nullptr;
  args.heuristic = static_cast<int>(heuristic);
  run_core([&] {
    const auto bytes = core::gated_linear_workspace_bytes(input.get_device(), core_dtype(input.scalar_type()), args);
    const CallWorkspace ws(input, bytes);
    core::gated_linear(make_context(input, ws), args);
  });
  if (!save_pre_act) return {out};
  return {out, pre_act};
}

// The core's gated data gradient into d_pre (which may be pre_act itself: the unfused path's
// gating pass and the cutlass_sm90 epilogue each read every gate and up element before writing
// its gradient there, and nothing else reads it).
void run_gated_dgrad(const at::Tensor& weight, const at::Tensor& d_output, const at::Tensor& pre_act,
                     ActivationCode act, int64_t heuristic, void* d_pre, void* act_out) {
  check_cuda_dims("fused_dense::gated_linear_dgrad", {{"batch (d_output.size(0))", d_output.size(0)},
                                                      {"2 * hidden (pre_act.size(1))", pre_act.size(1)},
                                                      {"out_features", weight.size(0)}});
  core::GatedLinearDgradArgs args;
  args.batch = d_output.size(0), args.hidden = weight.size(1), args.out_features = weight.size(0);
  args.weight = weight.data_ptr();
  args.d_output = d_output.data_ptr();
  args.pre_act = pre_act.data_ptr();
  args.activation = act;
  args.d_pre = d_pre;
  args.act_out = act_out;
  args.heuristic = static_cast<int>(heuristic);
  run_core([&] {
    const auto bytes =
        core::gated_linear_dgrad_workspace_bytes(weight.get_device(), core_dtype(weight.scalar_type()), args);
    const CallWorkspace ws(weight, bytes);
    core::gated_linear_dgrad(make_context(weight, ws), args);
  });
}

std::vector<at::Tensor> gated_linear_dgrad_cuda(const at::Tensor& weight, const at::Tensor& d_output,
                                                const at::Tensor& pre_act, int64_t activation, int64_t heuristic,
                                                bool return_act_out) {
  if (weight.scalar_type() == at::kDouble)
    return gated_linear_dgrad_reference(weight, d_output, pre_act, activation, heuristic, return_act_out);
  const ActivationCode act = check_gated_linear_dgrad(weight, d_output, pre_act, activation, heuristic);
  c10::cuda::CUDAGuard guard(weight.device());
  const int64_t B = d_output.size(0), H = weight.size(1);
  auto d_pre = empty_output({B, 2 * H}, weight.options());
  at::Tensor act_out;
  if (return_act_out) act_out = empty_output({B, H}, weight.options());
  run_gated_dgrad(weight, d_output, pre_act, act, heuristic, d_pre.data_ptr(),
                  return_act_out ? act_out.data_ptr() : nullptr);
  if (!return_act_out) return {d_pre};
  return {d_pre, act_out};
}

void gated_linear_dgrad_cuda_(const at::Tensor& pre_act, const at::Tensor& weight, const at::Tensor& d_output,
                              int64_t activation, int64_t heuristic) {
  if (weight.scalar_type() == at::kDouble)
    return gated_linear_dgrad_reference_(pre_act, weight, d_output, activation, heuristic);
  const ActivationCode act = check_gated_linear_dgrad_(pre_act, weight, d_output, activation, heuristic);
  c10::cuda::CUDAGuard guard(weight.device());
  run_gated_dgrad(weight, d_output, pre_act, act, heuristic, pre_act.data_ptr(), nullptr);
}

at::Tensor gated_act_forward_cuda(const at::Tensor& pre_act, int64_t activation) {
  if (pre_act.scalar_type() == at::kDouble) return gated_act_forward_reference(pre_act, activation);
  const ActivationCode act = check_gated_act_forward(pre_act, activation);
  c10::cuda::CUDAGuard guard(pre_act.device());
  const int64_t rows = pre_act.size(0), H = pre_act.size(1) / 2;
  auto out = empty_output({rows, H}, pre_act.options());
  run_core([&] {
    const int device = pre_act.get_device();
    core::gated_act_forward(core_dtype(pre_act.scalar_type()), act, pre_act.data_ptr(), out.data_ptr(), rows, H,
                            device, at::cuda::getCurrentCUDAStream(device).stream());
  });
  return out;
}

}  // namespace
}  // namespace fused_dense

TORCH_LIBRARY_IMPL(fused_dense, CUDA, m) {
  m.impl("gated_linear", &fused_dense::gated_linear_cuda);
  m.impl("gated_linear_dgrad", &fused_dense::gated_linear_dgrad_cuda);
  m.impl("gated_linear_dgrad_", &fused_dense::gated_linear_dgrad_cuda_);
  m.impl("gated_act_forward", &fused_dense::gated_act_forward_cuda);
}
