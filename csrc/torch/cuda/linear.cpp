// CUDA kernels of the linear family: validate, allocate outputs and workspace from PyTorch's
// caching allocator, then hand raw pointers to the framework-free core, with the tensors' device
// and that device's current stream.
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "core/elementwise/elementwise.h"
#include "core/ops/linear.h"
#include "torch/cpu/reference.h"
#include "torch/cuda/core_call.h"
#include "torch/linear.h"

namespace fused_dense {
namespace {

std::vector<at::Tensor> linear_act_cuda(const at::Tensor& input, const at::Tensor& weight,
                                        const std::optional<at::Tensor>& bias, int64_t activation,
                                        bool save_pre_act, int64_t heuristic) {
  if (input.scalar_type() == at::kDouble)
    return linear_act_reference(input, weight, bias, activation, save_pre_act, heuristic);
  const ActivationCode act = check_linear_act(input, weight, bias, activation, save_pre_act, heuristic);
  check_cuda_dims("fused_dense::linear_act", {{"batch (input.size(0))", input.size(0)},
                                              {"in_features", input.size(1)},
                                              {"out_features", weight.size(0)}});
  c10::cuda::CUDAGuard guard(input.device());
  const int64_t B = input.size(0), N = weight.size(0);
  auto out = empty_output({B, N}, input.options());
  at::Tensor pre_act;
  if (save_pre_act) {
    const PreActLayout layout = pre_act_layout(input, B, N, act);
    pre_act = empty_output(layout.sizes, layout.options);
  }

  core::LinearActArgs args;
  args.batch = B, args.in_features = input.size(1), args.out_features = N;
  args.input = input.data_ptr();
  args.weight = weight.data_ptr();
  args.bias = maybe_ptr(bias);
  args.activation = act;
  args.out = out.data_ptr();
  args.pre_act = save_pre_act ? pre_act.data_ptr() : nullptr;
  args.heuristic = static_cast<int>(heuristic);
  run_core([&] {
    const CallWorkspace ws(input, core::linear_act_workspace_bytes(input.get_device(), args));
    core::linear_act(make_context(input, ws), args);
  });
  if (!save_pre_act) return {out};
  return {out, pre_act};
}

std::vector<at::Tensor> linear_bias_wgrad_cuda(const at::Tensor& input, const at::Tensor& d_output,
                                               bool has_d_bias) {
  if (input.scalar_type() == at::kDouble) return linear_bias_wgrad_reference(input, d_output, has_d_bias);
  check_wgrad(input, d_output);
  check_cuda_dims("fused_dense::linear_bias_wgrad", {{"batch (input.size(0))", input.size(0)},
                                                     {"in_features", input.size(1)},
                                                     {"out_features", d_output.size(1)}});
  c10::cuda::CUDAGuard guard(input.device());
  const int64_t N = d_output.size(1), K = input.size(1);
  auto d_weight = empty_output({N, K}, input.options());
  at::Tensor d_bias;
  if (has_d_bias) d_bias = empty_output({N}, input.options());

  core::LinearBiasWgradArgs args;
  args.batch = input.size(0), args.in_features = K, args.out_features = N;
  args.input = input.data_ptr();
  args.d_output = d_output.data_ptr();
  args.d_weight = d_weight.data_ptr();
  args.d_bias = has_d_bias ? d_bias.data_ptr() : nullptr;
  run_core([&] {
    const CallWorkspace ws(input, core::linear_bias_wgrad_workspace_bytes(input.get_device(), args));
    core::linear_bias_wgrad(make_context(input, ws), args);
  });
  if (!has_d_bias) return {d_weight};
  return {d_weight, d_bias};
}

std::vector<at::Tensor> act_linear_dgrad_cuda(const at::Tensor& weight, const at::Tensor& d_output,
                                              const std::optional<at::Tensor>& pre_act, int64_t activation,
                                              bool has_d_bias, int64_t heuristic, bool return_act_out) {
  if (weight.scalar_type() == at::kDouble)
    return act_linear_dgrad_reference(weight, d_output, pre_act, activation, has_d_bias, heuristic, return_act_out);
  const ActivationCode act = check_act_linear_dgrad(weight, d_output, pre_act, activation, heuristic, return_act_out);
  check_cuda_dims("fused_dense::act_linear_dgrad", {{"batch (d_output.size(0))", d_output.size(0)},
                                                    {"in_features", weight.size(1)},
                                                    {"out_features", weight.size(0)}});
  c10::cuda::CUDAGuard guard(weight.device());
  const int64_t B = d_output.size(0), K = weight.size(1);
  auto d_input = empty_output({B, K}, weight.options());
  at::Tensor d_bias, act_out;
  if (has_d_bias) d_bias = empty_output({K}, weight.options());
  if (return_act_out) act_out = empty_output({B, K}, weight.options());

  core::ActLinearDgradArgs args;
  args.batch = B, args.in_features = K, args.out_features = weight.size(0);
  args.weight = weight.data_ptr();
  args.d_output = d_output.data_ptr();
  args.pre_act = maybe_ptr(pre_act);
  args.activation = act;
  args.d_input = d_input.data_ptr();
  args.d_bias = has_d_bias ? d_bias.data_ptr() : nullptr;
  args.act_out = return_act_out ? act_out.data_ptr() : nullptr;
  args.heuristic = static_cast<int>(heuristic);
  run_core([&] {
    const CallWorkspace ws(weight, core::act_linear_dgrad_workspace_bytes(weight.get_device(), args));
    core::act_linear_dgrad(make_context(weight, ws), args);
  });
  std::vector<at::Tensor> out{d_input};
  if (has_d_bias) out.push_back(d_bias);
  if (return_act_out) out.push_back(act_out);
  return out;
}

at::Tensor act_forward_cuda(const at::Tensor& pre_act, int64_t activation) {
  if (pre_act.scalar_type() == at::kDouble) return act_forward_reference(pre_act, activation);
  const ActivationCode act = check_act_forward(pre_act, activation);
  c10::cuda::CUDAGuard guard(pre_act.device());
  auto out = empty_output(pre_act.sizes(), pre_act.options());
  if (pre_act.numel() == 0) return out;
  const int64_t cols = pre_act.dim() == 0 ? 1 : pre_act.size(-1);
  const int64_t rows = cols == 0 ? 0 : pre_act.numel() / cols;
  run_core([&] {
    const int device = pre_act.get_device();
    core::act_forward(core_dtype(pre_act.scalar_type()), act, pre_act.data_ptr(), out.data_ptr(), rows, cols, device,
                      at::cuda::getCurrentCUDAStream(device).stream());
  });
  return out;
}

}  // namespace
}  // namespace fused_dense

TORCH_LIBRARY_IMPL(fused_dense, CUDA, m) {
  m.impl("linear_act", &fused_dense::linear_act_cuda);
  m.impl("linear_bias_wgrad", &fused_dense::linear_bias_wgrad_cuda);
  m.impl("act_linear_dgrad", &fused_dense::act_linear_dgrad_cuda);
  m.impl("act_forward", &fused_dense::act_forward_cuda);
}
