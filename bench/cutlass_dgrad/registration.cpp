// torch op over the probe kernel: fused_dense_probe::act_dgrad(weight, d_output, pre_act, config)
// -> (d_input, d_bias). Loaded with torch.ops.load_library by bench/cutlass_dgrad_probe.py.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "act_dgrad_sm90.h"

namespace {

void check_operand(const at::Tensor& t, const char* name, int64_t rows, int64_t cols) {
  TORCH_CHECK(t.is_cuda(), "act_dgrad: ", name, " must be a CUDA tensor, got ", t.device());
  TORCH_CHECK(t.scalar_type() == at::kBFloat16, "act_dgrad: ", name, " must be bfloat16, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 2 && t.size(0) == rows && t.size(1) == cols, "act_dgrad: ", name, " must be [", rows, ", ",
              cols, "], got ", t.sizes());
  TORCH_CHECK(t.is_contiguous(), "act_dgrad: ", name, " must be contiguous");
}

std::tuple<at::Tensor, at::Tensor> act_dgrad(const at::Tensor& weight, const at::Tensor& d_output,
                                             const at::Tensor& pre_act, int64_t config,
                                             int64_t swizzle, int64_t raster) {
  TORCH_CHECK(weight.dim() == 2 && d_output.dim() == 2, "act_dgrad: weight and d_output must be 2-D");
  const int64_t n = weight.size(0), k = weight.size(1), b = d_output.size(0);
  check_operand(weight, "weight", n, k);
  check_operand(d_output, "d_output", b, n);
  check_operand(pre_act, "pre_act", b, k);
  TORCH_CHECK(n % 8 == 0 && k % 8 == 0 && b % 8 == 0, "act_dgrad: every dim must be a multiple of 8, got B=", b,
              " N=", n, " K=", k);
  TORCH_CHECK(config >= 0 && config < fused_dense_probe::kNumConfigs, "act_dgrad: config must be in [0, ",
              fused_dense_probe::kNumConfigs, "), got ", config);
  TORCH_CHECK(swizzle == 1 || swizzle == 2 || swizzle == 4 || swizzle == 8,
              "act_dgrad: swizzle must be 1, 2, 4 or 8, got ", swizzle);
  TORCH_CHECK(raster >= 0 && raster <= 2, "act_dgrad: raster must be 0 (heuristic), 1 (along M) or 2 (along N), got ",
              raster);
  const fused_dense_probe::Schedule sched{static_cast<int>(swizzle), static_cast<int>(raster)};
  c10::cuda::CUDAGuard guard(weight.device());
  at::Tensor d_input = at::empty({b, k}, weight.options());
  at::Tensor d_bias = at::empty({k}, weight.options());
  fused_dense_probe::ActDgradProblem p;
  p.batch = b;
  p.in_features = k;
  p.out_features = n;
  p.weight = weight.data_ptr();
  p.d_output = d_output.data_ptr();
  p.pre_act = pre_act.data_ptr();
  p.d_input = d_input.data_ptr();
  p.d_bias = d_bias.data_ptr();
  std::string error;
  const size_t bytes = fused_dense_probe::act_dgrad_workspace_bytes(static_cast<int>(config), p, sched, &error);
  TORCH_CHECK(error.empty(), "act_dgrad (", fused_dense_probe::config_name(static_cast<int>(config)), "): ", error);
  at::Tensor workspace = at::empty({static_cast<int64_t>(bytes) + 1}, weight.options().dtype(at::kByte));
  static const int sm_count = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  error = fused_dense_probe::act_dgrad(static_cast<int>(config), p, sched, workspace.data_ptr(), bytes, sm_count,
                                       at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(error.empty(), "act_dgrad (", fused_dense_probe::config_name(static_cast<int>(config)), "): ", error);
  return {d_input, d_bias};
}

std::string config_name(int64_t config) {
  const char* name = fused_dense_probe::config_name(static_cast<int>(config));
  TORCH_CHECK(name != nullptr, "config_name: config out of range: ", config);
  return name;
}

}  // namespace

TORCH_LIBRARY(fused_dense_probe, m) {
  m.def("act_dgrad(Tensor weight, Tensor d_output, Tensor pre_act, int config, int swizzle=1, int raster=0) -> (Tensor, Tensor)");
  m.def("config_name(int config) -> str", &config_name);
  m.def("num_configs() -> int", [] { return static_cast<int64_t>(fused_dense_probe::kNumConfigs); });
}

TORCH_LIBRARY_IMPL(fused_dense_probe, CUDA, m) { m.impl("act_dgrad", &act_dgrad); }
