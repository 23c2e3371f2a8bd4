// CUDA kernels of the FP8 family (fp8.cpp has their contract): validate, allocate from PyTorch's
// caching allocator, hand raw pointers to the core (core/elementwise/fp8_quantize.h,
// core/ops/fp8_linear.h) on the tensors' device and stream.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "core/common/device_info.h"
#include "core/elementwise/fp8_quantize.h"
#include "core/ops/fp8_linear.h"
#include "torch/cuda/core_call.h"
#include "torch/cuda/fp8.h"
#include "torch/fp8.h"

namespace fused_dense {

void quantize_into(const at::Tensor& x, const std::optional<at::Tensor>& pre, int64_t activation, bool backward,
                   int64_t fp8_format, const float* scale, const float* known_amax, bool rowwise, bool columnwise,
                   bool column_sums, Fp8QuantizeResult& res, const float* pre_scale_inv, uint8_t* input_data,
                   float* input_scale_inv) {
  auto& [data, data_t, s, s_inv, amax, sums] = res;
  core::Fp8QuantizeArgs a;
  a.dtype = core_dtype(x.scalar_type());
  a.rows = x.size(0), a.cols = fp8_quantized_cols(x, activation, backward);
  a.input = x.data_ptr();
  a.pre_act = (pre.has_value() && pre->defined()) ? pre->data_ptr() : nullptr;
  a.pre_scale_inv = pre_scale_inv;
  a.activation = static_cast<core::Activation>(activation);
  a.backward = backward;
  a.format = static_cast<core::Fp8Format>(fp8_format);
  a.scale = scale;
  a.known_amax = known_amax;
  a.data = rowwise ? static_cast<uint8_t*>(data.data_ptr()) : nullptr;
  a.data_t = columnwise ? static_cast<uint8_t*>(data_t.data_ptr()) : nullptr;
  a.scale_out = s.data_ptr<float>();
  a.scale_inv_out = s_inv.data_ptr<float>();
  a.amax_out = amax.data_ptr<float>();
  a.column_sums = column_sums ? sums.data_ptr() : nullptr;
  a.input_data = input_data;
  a.input_scale_inv_out = input_scale_inv;
  const int device = x.get_device();
  run_core([&] {
    const std::size_t bytes = core::fp8_quantize_workspace_bytes(device, a);
    const CallWorkspace ws(x, bytes);
    core::fp8_quantize(a, ws.get().ptr, bytes, device, at::cuda::getCurrentCUDAStream(device).stream());
  });
}

namespace {

namespace core = ::fused_dense::core;

void check_fp8_device(const at::Tensor& t, const char* op) {
  const auto& info = core::device_info(t.get_device());
  const int cc = info.cc_major() * 10 + info.cc_minor();
  TORCH_CHECK_NOT_IMPLEMENTED(cc >= 89, op, ": FP8 needs a GPU of compute capability 8.9 or newer (Ada, Hopper), but ",
                              t.device(), " has ", info.cc_major(), ".", info.cc_minor());
}

bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

// An e4m3 copy the kernels write in place (input_fp8, pre_fp8; checked by check_e4m3_copy): its
// bytes and its scale_inv's pointer, or nulls. The kernels store 16 bytes at a time.
std::pair<uint8_t*, float*> e4m3_copy_ptrs(const std::optional<at::Tensor>& copy,
                                           const std::optional<at::Tensor>& scale_inv, const char* op,
                                           const char* name) {
  if (!copy.has_value() || !copy->defined()) return {nullptr, nullptr};
  TORCH_CHECK_VALUE(copy->numel() == 0 || aligned16(*copy), op, ": ", name, " must be 16-byte aligned, got address ",
                    copy->data_ptr());
  return {static_cast<uint8_t*>(copy->data_ptr()), scale_inv->data_ptr<float>()};
}

Fp8QuantizeResult fp8_quantize_cuda(const at::Tensor& input, const std::optional<at::Tensor>& pre_act,
                                    int64_t activation, bool backward, int64_t fp8_format,
                                    const std::optional<at::Tensor>& scale, bool rowwise, bool columnwise,
                                    bool column_sums, const std::optional<at::Tensor>& pre_scale_inv,
                                    const std::optional<at::Tensor>& input_fp8,
                                    const std::optional<at::Tensor>& input_scale_inv) {
  check_fp8_quantize(input, pre_act, activation, backward, fp8_format, scale, pre_scale_inv, input_fp8,
                     input_scale_inv);
  const auto [copy, copy_si] = e4m3_copy_ptrs(input_fp8, input_scale_inv, "fused_dense::fp8_quantize", "input_fp8");
  c10::cuda::CUDAGuard guard(input.device());
  // The kernels load 16 bytes at a time: a view at an odd offset is copied first.
  const at::Tensor x = aligned16(input) ? input : input.clone();
  std::optional<at::Tensor> pre = pre_act;
  if (pre.has_value() && pre->defined() && !aligned16(*pre)) pre = pre->clone();
  auto res = empty_fp8_quantize(x, fp8_quantized_cols(x, activation, backward), fp8_format, rowwise, columnwise,
                                column_sums);
  const float* s = (scale.has_value() && scale->defined()) ? scale->data_ptr<float>() : nullptr;
  const float* psi = (pre_scale_inv.has_value() && pre_scale_inv->defined()) ? pre_scale_inv->data_ptr<float>() : nullptr;
  quantize_into(x, pre, activation, backward, fp8_format, s, nullptr, rowwise, columnwise, column_sums, res, psi, copy,
                copy_si);
  return res;
}

Fp8QuantizeGradResult fp8_quantize_grad_cuda_(const at::Tensor& pre_act, const at::Tensor& input, int64_t activation,
                                              int64_t fp8_format, const std::optional<at::Tensor>& scale,
                                              bool column_sums, const at::Tensor& pre_scale_inv) {
  constexpr const char* op = "fused_dense::fp8_quantize_grad_";
  check_fp8_quantize_grad_(pre_act, input, activation, fp8_format, scale, pre_scale_inv);
  TORCH_CHECK_VALUE(pre_act.numel() == 0 || aligned16(pre_act), op, ": pre_act must be 16-byte aligned (it is "
                    "written in place), got address ", pre_act.data_ptr());
  c10::cuda::CUDAGuard guard(input.device());
  const at::Tensor x = aligned16(input) ? input : input.clone();
  const auto [s, s_inv, amax, sums] = empty_fp8_quantize_grad(x, activation, column_sums);
  // The quantize pass's data is pre_act's own bytes (fp8_quantize.h, in place).
  Fp8QuantizeResult res{pre_act, at::Tensor(), s, s_inv, amax, sums};
  const float* sc = (scale.has_value() && scale->defined()) ? scale->data_ptr<float>() : nullptr;
  quantize_into(x, pre_act, activation, true, fp8_format, sc, nullptr, true, false, column_sums, res,
                pre_scale_inv.data_ptr<float>());
  return {s, s_inv, amax, sums};
}

at::Tensor fp8_transpose_cuda(const at::Tensor& data) {
  check_fp8_transpose(data);
  c10::cuda::CUDAGuard guard(data.device());
  const at::Tensor d = aligned16(data) ? data : data.clone();
  at::Tensor out = empty_output({d.size(1), core::fp8_padded_rows(d.size(0))}, d.options());
  const int device = d.get_device();
  run_core([&] {
    core::fp8_transpose(static_cast<const uint8_t*>(d.data_ptr()), d.size(0), d.size(1),
                        static_cast<uint8_t*>(out.data_ptr()), at::cuda::getCurrentCUDAStream(device).stream());
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> fp8_scales_cuda(const at::Tensor& value, bool delayed, int64_t fp8_format) {
  const core::Fp8Format format = check_fp8_scales(value, delayed, fp8_format);
  c10::cuda::CUDAGuard guard(value.device());
  const at::Tensor t = value.reshape({}).contiguous();
  at::Tensor s = empty_output({}, t.options()), s_inv = empty_output({}, t.options());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream(t.get_device()).stream();
  run_core([&] {
    if (delayed)
      core::fp8_write_scales(t.data_ptr<float>(), s.data_ptr<float>(), s_inv.data_ptr<float>(), stream);
    else
      core::fp8_scales_of_amax(t.data_ptr<float>(), format, s.data_ptr<float>(), s_inv.data_ptr<float>(), stream);
  });
  return {s, s_inv};
}

at::Tensor fp8_linear_cuda(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& input_scale_inv,
                           const at::Tensor& weight_scale_inv, const std::optional<at::Tensor>& bias,
                           at::ScalarType out_dtype, bool fast_accum, int64_t heuristic) {
  constexpr const char* op = "fused_dense::fp8_linear";
  check_fp8_linear(input, weight, input_scale_inv, weight_scale_inv, bias, out_dtype);
  c10::cuda::CUDAGuard guard(input.device());
  check_fp8_device(input, op);
  TORCH_CHECK_VALUE(heuristic >= -2, op, ": heuristic must be -2 (auto), -1 or an index >= 0, got ", heuristic);
  // cuBLASLt's FP8 kernels need 16-byte aligned operands.
  const at::Tensor x = aligned16(input) ? input : input.clone();
  const at::Tensor w = aligned16(weight) ? weight : weight.clone();
  std::optional<at::Tensor> b = bias;
  if (b.has_value() && b->defined() && !aligned16(*b)) b = b->clone();
  auto out = empty_output({x.size(0), w.size(0)}, x.options().dtype(out_dtype));
  core::Fp8LinearArgs a;
  a.batch = x.size(0), a.in_features = x.size(1), a.out_features = w.size(0);
  a.input = x.data_ptr();
  a.input_format = fp8_format_of_dtype(x.scalar_type());
  a.weight = w.data_ptr();
  a.weight_format = fp8_format_of_dtype(w.scalar_type());
  a.input_scale_inv = input_scale_inv.data_ptr<float>();
  a.weight_scale_inv = weight_scale_inv.data_ptr<float>();
  a.bias = (b.has_value() && b->defined()) ? b->data_ptr() : nullptr;
  a.out = out.data_ptr();
  a.fast_accum = fast_accum;
  // -1 (unfused) has no meaning for a plain GEMM: cuBLASLt's first algorithm; -2 ('auto') the
  // tuner's choice (core/tuning/tuner.h).
  a.heuristic = static_cast<int>(heuristic);
  const int device = x.get_device();
  run_core([&] {
    core::LinearContext ctx;
    ctx.device = device;
    ctx.dtype = core_dtype(out_dtype);
    const std::size_t bytes = core::gemm_workspace_bytes(device);
    const CallWorkspace ws(x, bytes);
    ctx.workspace = ws.get();
    ctx.stream = at::cuda::getCurrentCUDAStream(device).stream();
    ctx.deterministic = at::globalContext().deterministicAlgorithms();
    core::fp8_linear(ctx, a);
  });
  return out;
}

// The fc1 forward of core/ops/fp8_linear.h (fp8_linear_act), which chooses between the
// cutlass_sm90 FP8 kernel and fp8_linear's GEMM + fp8_quantize's passes.
Fp8LinearActResult fp8_linear_act_cuda(const at::Tensor& input, const at::Tensor& weight,
                                       const at::Tensor& input_scale_inv, const at::Tensor& weight_scale_inv,
                                       const std::optional<at::Tensor>& bias, at::ScalarType out_dtype,
                                       int64_t activation, const std::optional<at::Tensor>& scale, bool columnwise,
                                       const std::optional<at::Tensor>& pre_fp8,
                                       const std::optional<at::Tensor>& pre_scale_inv) {
  constexpr const char* op = "fused_dense::fp8_linear_act";
  check_fp8_linear_act(input, weight, input_scale_inv, weight_scale_inv, bias, out_dtype, activation, scale, pre_fp8,
                       pre_scale_inv);
  const auto [copy, copy_si] = e4m3_copy_ptrs(pre_fp8, pre_scale_inv, op, "pre_fp8");
  c10::cuda::CUDAGuard guard(input.device());
  check_fp8_device(input, op);
  // The FP8 GEMMs need 16-byte aligned operands.
  const at::Tensor x = aligned16(input) ? input : input.clone();
  const at::Tensor w = aligned16(weight) ? weight : weight.clone();
  std::optional<at::Tensor> b = bias;
  if (b.has_value() && b->defined() && !aligned16(*b)) b = b->clone();
  Fp8LinearActResult res = empty_fp8_linear_act(x, w, out_dtype, columnwise);
  auto& [pre, data, data_t, s, s_inv, amax] = res;
  core::Fp8LinearActArgs a;
  a.batch = x.size(0), a.in_features = x.size(1), a.out_features = w.size(0);
  a.input = x.data_ptr(), a.weight = w.data_ptr();
  a.input_scale_inv = input_scale_inv.data_ptr<float>(), a.weight_scale_inv = weight_scale_inv.data_ptr<float>();
  a.bias = (b.has_value() && b->defined()) ? b->data_ptr() : nullptr;
  a.activation = static_cast<core::Activation>(activation);
  a.scale = (scale.has_value() && scale->defined()) ? scale->data_ptr<float>() : nullptr;
  a.pre = pre.data_ptr();
  a.data = static_cast<uint8_t*>(data.data_ptr());
  a.data_t = columnwise ? static_cast<uint8_t*>(data_t.data_ptr()) : nullptr;
  a.scale_out = s.data_ptr<float>(), a.scale_inv_out = s_inv.data_ptr<float>(), a.amax = amax.data_ptr<float>();
  a.pre_data = copy, a.pre_scale_inv_out = copy_si;
  const int device = x.get_device();
  run_core([&] {
    core::LinearContext ctx;
    ctx.device = device;
    ctx.dtype = core_dtype(out_dtype);
    const std::size_t bytes = core::fp8_linear_act_workspace_bytes(device, ctx.dtype, a);
    const CallWorkspace ws(x, bytes);
    ctx.workspace = ws.get();
    ctx.stream = at::cuda::getCurrentCUDAStream(device).stream();
    ctx.deterministic = at::globalContext().deterministicAlgorithms();
    core::fp8_linear_act(ctx, a);
  });
  return res;
}

}  // namespace
}  // namespace fused_dense

TORCH_LIBRARY_IMPL(fused_dense, CUDA, m) {
  m.impl("fp8_quantize", &fused_dense::fp8_quantize_cuda);
  m.impl("fp8_quantize_grad_", &fused_dense::fp8_quantize_grad_cuda_);
  m.impl("fp8_transpose", &fused_dense::fp8_transpose_cuda);
  m.impl("fp8_scales", &fused_dense::fp8_scales_cuda);
  m.impl("fp8_linear", &fused_dense::fp8_linear_cuda);
  m.impl("fp8_linear_act", &fused_dense::fp8_linear_act_cuda);
}
