#include "linear.h"

#include <algorithm>

#include "cuda_check.h"
#include "elementwise.h"

namespace fused_dense::core {
namespace {

// cuBLASLt's aux operand rules, seen on the H200 with CUDA 13.0: the ReLU bit-mask needs its
// leading dimension (in bits) to be a multiple of 128, the GELU pre-activation a multiple of 8.
bool aux_ld_accepted(Activation act, int64_t ld) {
  if (act == Activation::kRelu) return ld % 128 == 0;
  if (act == Activation::kGeluTanh) return ld % 8 == 0;
  return false;
}

Workspace gemm_part(const LinearContext& ctx) {
  return Workspace{ctx.workspace.ptr, std::min(ctx.workspace.bytes, gemm_workspace_bytes(ctx.device))};
}

GemmProblem base_problem(const LinearContext& ctx) {
  GemmProblem p;
  p.device = ctx.device;
  p.dtype = ctx.dtype;
  p.allow_tf32 = ctx.allow_tf32;
  return p;
}

// The unfused path runs the plain GEMM; an explicit heuristic indexes its list instead.
int plain_heuristic(int heuristic) { return heuristic >= 0 ? heuristic : 0; }

void zero(void* ptr, int64_t elements, DType dtype, cudaStream_t stream) {
  if (ptr != nullptr && elements > 0)
    FD_CUDA_CHECK(cudaMemsetAsync(ptr, 0, static_cast<std::size_t>(elements) * dtype_size(dtype), stream));
}

}  // namespace

std::size_t forward_workspace_bytes(int device, const ForwardArgs&) { return gemm_workspace_bytes(device); }

std::size_t wgrad_workspace_bytes(int device, const WgradArgs& a) {
  return std::max(gemm_workspace_bytes(device),
                  a.d_bias ? reduction_workspace_bytes(a.batch, a.out_features) : std::size_t{0});
}

std::size_t dgrad_workspace_bytes(int device, const DgradArgs& a) {
  return std::max(gemm_workspace_bytes(device),
                  a.d_bias ? reduction_workspace_bytes(a.batch, a.in_features) : std::size_t{0});
}

void linear_act_forward(const LinearContext& ctx, const ForwardArgs& a) {
  const int64_t B = a.batch, K = a.in_features, N = a.out_features;
  if (B == 0 || N == 0) return;
  const bool mask = a.activation == Activation::kRelu && a.pre_act != nullptr;
  // With a saved GELU / squared-ReLU pre-activation the GEMM writes it and the kernel reads it
  // back; otherwise the GEMM writes `out` and the kernel works in place.
  void* gemm_target = (a.pre_act != nullptr && !mask) ? a.pre_act : a.out;
  if (K == 0) {
    zero(gemm_target, B * N, ctx.dtype, ctx.stream);
    bias_act_forward(ctx.dtype, a.activation, gemm_target, a.bias, a.out, a.pre_act, B, N, ctx.stream);
    return;
  }
  GemmProblem p = base_problem(ctx);
  p.trans_a = true;
  p.m = N, p.n = B, p.k = K;
  p.lda = K, p.ldb = K, p.ldd = N;
  GemmPointers ptrs;
  ptrs.a = a.weight;
  ptrs.b = a.input;
  const Workspace ws = gemm_part(ctx);

  const bool epilogue_exists = a.activation != Activation::kSquaredRelu &&
                               (a.pre_act == nullptr || aux_ld_accepted(a.activation, N));
  if (a.heuristic != kHeuristicUnfused && epilogue_exists) {
    GemmProblem fused = p;
    fused.with_bias = a.bias != nullptr;
    switch (a.activation) {
      case Activation::kNone: fused.epilogue = Epilogue::kNone; break;
      case Activation::kGeluTanh: fused.epilogue = a.pre_act ? Epilogue::kGeluAux : Epilogue::kGelu; break;
      case Activation::kRelu: fused.epilogue = a.pre_act ? Epilogue::kReluAux : Epilogue::kRelu; break;
      case Activation::kSquaredRelu: break;
    }
    fused.ld_aux = N;
    GemmPointers fptrs = ptrs;
    fptrs.d = a.out;
    fptrs.bias = a.bias;
    fptrs.aux = a.pre_act;
    const int h = a.heuristic == kHeuristicAuto ? 0 : a.heuristic;
    if (try_gemm(fused, fptrs, h, ws, ctx.stream)) return;
  }
  ptrs.d = gemm_target;
  gemm(p, ptrs, plain_heuristic(a.heuristic), ws, ctx.stream);
  if (a.activation == Activation::kNone && a.bias == nullptr) return;
  bias_act_forward(ctx.dtype, a.activation, gemm_target, a.bias, a.out, a.pre_act, B, N, ctx.stream);
}

void linear_wgrad(const LinearContext& ctx, const WgradArgs& a) {
  const int64_t B = a.batch, K = a.in_features, N = a.out_features;
  if (B == 0) {
    zero(a.d_weight, N * K, ctx.dtype, ctx.stream);
    zero(a.d_bias, N, ctx.dtype, ctx.stream);
    return;
  }
  if (N == 0) return;
  if (K > 0) {
    GemmProblem p = base_problem(ctx);
    p.trans_b = true;
    p.m = K, p.n = N, p.k = B;
    p.lda = K, p.ldb = N, p.ldd = K;
    GemmPointers ptrs;
    ptrs.a = a.input;
    ptrs.b = a.d_output;
    ptrs.d = a.d_weight;
    const Workspace ws = gemm_part(ctx);
    if (a.d_bias != nullptr) {
      GemmProblem fused = p;
      fused.epilogue = Epilogue::kBGradB;
      GemmPointers fptrs = ptrs;
      fptrs.bias_grad = a.d_bias;
      if (try_gemm(fused, fptrs, 0, ws, ctx.stream)) return;
    }
    gemm(p, ptrs, 0, ws, ctx.stream);
  }
  if (a.d_bias != nullptr) {
    act_backward_bias_grad(ctx.dtype, Activation::kNone, a.d_output, nullptr, nullptr, a.d_bias, B, N,
                           ctx.workspace.ptr, ctx.workspace.bytes, ctx.stream);
  }
}

void act_linear_dgrad(const LinearContext& ctx, const DgradArgs& a) {
  const int64_t B = a.batch, K = a.in_features, N = a.out_features;
  if (B == 0 || K == 0) {
    if (B == 0) zero(a.d_bias, K, ctx.dtype, ctx.stream);
    return;
  }
  const bool needs_kernel = a.activation != Activation::kNone || a.d_bias != nullptr;
  if (N == 0) {
    zero(a.d_input, B * K, ctx.dtype, ctx.stream);
    zero(a.d_bias, K, ctx.dtype, ctx.stream);
    return;
  }
  GemmProblem p = base_problem(ctx);
  p.m = K, p.n = B, p.k = N;
  p.lda = K, p.ldb = N, p.ldd = K;
  GemmPointers ptrs;
  ptrs.a = a.weight;
  ptrs.b = a.d_output;
  ptrs.d = a.d_input;
  const Workspace ws = gemm_part(ctx);

  // 'auto' keeps dgrad unfused: on the H200 DGELU_BGRAD measured slower than GEMM + one
  // elementwise pass at every shape of ../shared/BASELINES.md (0.158 vs 0.124 ms at 8192x1024x4096).
  const bool try_fused = a.heuristic >= 0 && (a.activation == Activation::kGeluTanh ||
                                              a.activation == Activation::kRelu) &&
                         aux_ld_accepted(a.activation, K);
  if (try_fused) {
    GemmProblem fused = p;
    fused.epilogue = a.activation == Activation::kRelu ? Epilogue::kDRelu : Epilogue::kDGelu;
    fused.with_bias_grad = a.d_bias != nullptr;
    fused.ld_aux = K;
    GemmPointers fptrs = ptrs;
    fptrs.aux = const_cast<void*>(a.pre_act);
    fptrs.bias_grad = a.d_bias;
    if (try_gemm(fused, fptrs, a.heuristic, ws, ctx.stream)) return;
  }
  gemm(p, ptrs, plain_heuristic(a.heuristic), ws, ctx.stream);
  if (!needs_kernel) return;
  act_backward_bias_grad(ctx.dtype, a.activation, a.d_input, a.pre_act, a.d_input, a.d_bias, B, K,
                         ctx.workspace.ptr, ctx.workspace.bytes, ctx.stream);
}

}  // namespace fused_dense::core
