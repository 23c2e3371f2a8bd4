#include "core/ops/linear.h"

#include <algorithm>
#include <cstdint>
#include <functional>
#include <optional>
#include <sstream>
#include <utility>
#include <vector>

#include "core/common/cuda_check.h"
#include "core/elementwise/elementwise.h"
#include "core/cutlass_sm90/cutlass_sm90_dgrad.h"
#include "core/cutlass_sm90/cutlass_sm90_forward.h"
#include "core/cutlass_sm90/cutlass_sm90_gated.h"
#include "core/ops/dispatch.h"
#include "core/ops/gated.h"
#include "core/tuning/tuner.h"
#include "core/tuning/tuning_arena.h"

namespace fused_dense::core {
namespace {

using dispatch_detail::aligned256;
using dispatch_detail::dispatch;
using dispatch_detail::op_setup;
using dispatch_detail::OpKind;
using dispatch_detail::OpProblems;
using dispatch_detail::run_gemm;

// cuBLASLt's aux operand rules, seen on the H200 with CUDA 13.0: the ReLU bit-mask needs its
// leading dimension (in bits) to be a multiple of 128, the GELU pre-activation a multiple of 8.
bool aux_ld_accepted(Activation act, int64_t ld) {
  if (act == Activation::kRelu) return ld % 128 == 0;
  if (act == Activation::kGeluTanh) return ld % 8 == 0;
  return false;
}

GemmProblem base_problem(const LinearContext& ctx) {
  GemmProblem p;
  p.device = ctx.device;
  p.dtype = ctx.dtype;
  p.allow_tf32 = ctx.allow_tf32;
  return p;
}

void zero(void* ptr, int64_t elements, DType dtype, cudaStream_t stream) {
  if (ptr != nullptr && elements > 0)
    FD_CUDA_CHECK(cudaMemsetAsync(ptr, 0, static_cast<std::size_t>(elements) * dtype_size(dtype), stream));
}

// ---- the three ops' setups and synthetic operands ----

auto forward_setup(const LinearContext& ctx, const LinearActArgs& a) {
  const int64_t B = a.batch, K = a.in_features, N = a.out_features;
  const bool mask = a.activation == Activation::kRelu && a.pre_act != nullptr;
  // With a saved GELU / squared-ReLU pre-activation the GEMM writes it and the kernel reads it
  // back; otherwise the GEMM writes `out` and the kernel works in place.
  void* gemm_target = (a.pre_act != nullptr && !mask) ? a.pre_act : a.out;
  OpProblems s;
  // The unfused path still adds the bias in the GEMM's fp32 epilogue: adding it after the GEMM
  // result is rounded to 16 bits would let that rounding flip the sign of x.w + b wherever
  // x.w ~= -b, and every flipped ReLU unit passes (or blocks) a whole gradient element.
  GemmProblem& plain = s.plain;
  plain = base_problem(ctx);
  plain.trans_a = true;
  plain.m = N, plain.n = B, plain.k = K;
  plain.lda = K, plain.ldb = K, plain.ldd = N;
  plain.with_bias = a.bias != nullptr;
  s.fused = plain;
  s.fused.ld_aux = N;
  switch (a.activation) {
    case Activation::kNone: s.fused.epilogue = Epilogue::kNone; break;
    case Activation::kGeluTanh: s.fused.epilogue = a.pre_act ? Epilogue::kGeluAux : Epilogue::kGelu; break;
    case Activation::kRelu: s.fused.epilogue = a.pre_act ? Epilogue::kReluAux : Epilogue::kRelu; break;
    case Activation::kSquaredRelu: break;
    case Activation::kSwiGLU:
    case Activation::kGeGLU:
      throw Error(std::string("fused_dense: linear_act: ") + activation_name(a.activation) +
                  " is gated; gated_linear (gated.h) takes it");
  }
  s.fused_possible = a.activation != Activation::kSquaredRelu &&
                     (a.pre_act == nullptr || aux_ld_accepted(a.activation, N));
  s.aligned = aligned256(a.weight) && aligned256(a.input) && aligned256(a.out) &&
              (a.pre_act == nullptr || aligned256(a.pre_act));
  CutlassSm90ForwardArgs cutlass;
  cutlass.device = ctx.device;
  cutlass.batch = B, cutlass.in_features = K, cutlass.out_features = N;
  cutlass.dtype = ctx.dtype;
  cutlass.activation = a.activation;
  cutlass.input = a.input, cutlass.weight = a.weight, cutlass.bias = a.bias, cutlass.out = a.out;
  cutlass.pre_act = a.pre_act;
  const auto variants = [cutlass] { return cutlass_sm90_forward_variants(cutlass); };
  const Workspace ws = gemm_workspace_part(ctx);
  const GemmProblem fused = s.fused;
  const auto run = [=](const Choice& c) -> bool {
    if (c.cutlass >= 0) return cutlass_sm90_forward(c.cutlass, cutlass, ws, ctx.stream);
    GemmPointers ptrs;
    ptrs.a = a.weight;
    ptrs.b = a.input;
    if (c.fused) {
      ptrs.d = a.out;
      ptrs.bias = a.bias;
      ptrs.aux = a.pre_act;
      return run_gemm(fused, ptrs, c, ws, ctx.stream);
    }
    ptrs.d = gemm_target;
    ptrs.bias = a.bias;
    // cuBLASLt refuses the BIAS epilogue for some operand alignments (seen on the H200 for bf16
    // at a 2-byte offset). Then the bias still joins the sum before the 16-bit rounding: the
    // target is filled with bias rows and the GEMM accumulates onto it (beta = 1, fp32 math).
    // Adding it after the rounding instead loses |x.w| * 2^-11 absolutely, which is a large
    // relative error wherever x.w ~= -b (seen by the fuzz test: 1.2e-2 on a single fp16 row).
    if (!run_gemm(plain, ptrs, c, ws, ctx.stream)) {
      // a stored algorithm refused: the dispatch falls back to the first plain algorithm
      if (a.bias == nullptr || c.has_algo) return false;
      GemmProblem onto_bias = plain;
      onto_bias.with_bias = false;
      onto_bias.accumulate = true;
      zero(gemm_target, B * N, ctx.dtype, ctx.stream);
      bias_act_forward(ctx.dtype, Activation::kNone, gemm_target, a.bias, gemm_target, nullptr, B, N, ctx.device,
                       ctx.stream);
      // the index chose among the BIAS-epilogue algorithms, which cuBLASLt just refused: take
      // its first choice for the accumulating problem
      gemm(onto_bias, ptrs, 0, ws, ctx.stream);
    }
    // A saved GELU / squared-ReLU pre-activation is already in place; the ReLU mask is always
    // left to the kernel.
    if (a.activation != Activation::kNone)
      bias_act_forward(ctx.dtype, a.activation, gemm_target, nullptr, a.out, mask ? a.pre_act : nullptr, B, N,
                       ctx.device, ctx.stream);
    return true;
  };
  return op_setup(s, run, variants);
}

LinearActArgs forward_synthetic(const LinearActArgs& a, int64_t M, DType dtype, TuningArena& arena) {
  LinearActArgs t = a;  // the weight and bias are the call's own (read only, the same at every M)
  t.batch = M;
  t.input = arena.values(M * a.in_features, dtype);
  t.out = arena.scratch(static_cast<std::size_t>(M * a.out_features) * dtype_size(dtype));
  if (a.pre_act != nullptr)
    t.pre_act = a.activation == Activation::kRelu
                    ? arena.scratch(static_cast<std::size_t>(M * relu_mask_row_bytes(a.out_features)))
                    : arena.scratch(static_cast<std::size_t>(M * a.out_features) * dtype_size(dtype));
  return t;
}

auto wgrad_setup(const LinearContext& ctx, const LinearBiasWgradArgs& a) {
  const int64_t B = a.batch, N = a.out_features;
  OpProblems s;
  s.plain = base_problem(ctx);
  s.plain.trans_b = true;
  s.plain.m = a.in_features, s.plain.n = N, s.plain.k = B;
  s.plain.lda = a.in_features, s.plain.ldb = N, s.plain.ldd = a.in_features;
  s.fused = s.plain;
  s.fused.epilogue = Epilogue::kBGradB;
  s.fused_possible = a.d_bias != nullptr;
  s.aligned = aligned256(a.input) && aligned256(a.d_output) && aligned256(a.d_weight);
  const Workspace ws = gemm_workspace_part(ctx);
  const GemmProblem plain = s.plain, fused = s.fused;
  const auto run = [=](const Choice& c) -> bool {
    GemmPointers ptrs;
    ptrs.a = a.input;
    ptrs.b = a.d_output;
    ptrs.d = a.d_weight;
    if (c.fused) {
      ptrs.bias_grad = a.d_bias;
      return run_gemm(fused, ptrs, c, ws, ctx.stream);
    }
    if (!run_gemm(plain, ptrs, c, ws, ctx.stream)) return false;
    if (a.d_bias != nullptr)
      act_backward_bias_grad(ctx.dtype, Activation::kNone, a.d_output, nullptr, nullptr, a.d_bias, B, N,
                             ctx.workspace.ptr, ctx.workspace.bytes, ctx.device, ctx.stream);
    return true;
  };
  return op_setup(s, run);
}

LinearBiasWgradArgs wgrad_synthetic(const LinearBiasWgradArgs& a, int64_t M, DType dtype, TuningArena& arena) {
  LinearBiasWgradArgs t = a;
  t.batch = M;
  t.input = arena.values(M * a.in_features, dtype);
  t.d_output = arena.values(M * a.out_features, dtype);
  t.d_weight = arena.scratch(static_cast<std::size_t>(a.out_features * a.in_features) * dtype_size(dtype));
  if (a.d_bias != nullptr) t.d_bias = arena.scratch(static_cast<std::size_t>(a.out_features) * dtype_size(dtype));
  return t;
}

auto dgrad_setup(const LinearContext& ctx, const ActLinearDgradArgs& a) {
  const int64_t B = a.batch, K = a.in_features, N = a.out_features;
  OpProblems s;
  s.plain = base_problem(ctx);
  s.plain.m = K, s.plain.n = B, s.plain.k = N;
  s.plain.lda = K, s.plain.ldb = N, s.plain.ldd = K;
  s.fused = s.plain;
  s.fused.epilogue = a.activation == Activation::kRelu ? Epilogue::kDRelu : Epilogue::kDGelu;
  s.fused.with_bias_grad = a.d_bias != nullptr;
  s.fused.ld_aux = K;
  s.fused_possible = (a.activation == Activation::kGeluTanh || a.activation == Activation::kRelu) &&
                     aux_ld_accepted(a.activation, K);
  s.aligned = aligned256(a.weight) && aligned256(a.d_output) && aligned256(a.d_input);
  const bool needs_kernel = a.activation != Activation::kNone || a.d_bias != nullptr;
  CutlassSm90DgradArgs cutlass;
  cutlass.device = ctx.device;
  cutlass.batch = B, cutlass.in_features = K, cutlass.out_features = N;
  cutlass.dtype = ctx.dtype;
  cutlass.activation = a.activation;
  cutlass.weight = a.weight, cutlass.d_output = a.d_output, cutlass.pre_act = a.pre_act;
  cutlass.d_input = a.d_input, cutlass.d_bias = a.d_bias;
  const auto variants = [cutlass] { return cutlass_sm90_dgrad_variants(cutlass); };
  const Workspace ws = gemm_workspace_part(ctx);
  const GemmProblem plain = s.plain, fused = s.fused;
  auto rebuild_act_out = [=] {
    if (a.act_out != nullptr)
      bias_act_forward(ctx.dtype, a.activation, a.pre_act, nullptr, a.act_out, nullptr, B, K, ctx.device,
                       ctx.stream);
  };
  const auto run = [=](const Choice& c) -> bool {
    if (c.cutlass >= 0) {
      // the whole workspace: CUTLASS's scratch, then the epilogue's partial bias-gradient sums
      if (!cutlass_sm90_dgrad(c.cutlass, cutlass, ctx.workspace, ctx.stream)) return false;
      rebuild_act_out();
      return true;
    }
    GemmPointers ptrs;
    ptrs.a = a.weight;
    ptrs.b = a.d_output;
    ptrs.d = a.d_input;
    if (c.fused) {
      ptrs.aux = const_cast<void*>(a.pre_act);
      ptrs.bias_grad = a.d_bias;
      if (!run_gemm(fused, ptrs, c, ws, ctx.stream)) return false;
      rebuild_act_out();  // the epilogue reads pre_act but cannot write act(pre_act)
      return true;
    }
    if (!run_gemm(plain, ptrs, c, ws, ctx.stream)) return false;
    if (needs_kernel)
      act_backward_bias_grad(ctx.dtype, a.activation, a.d_input, a.pre_act, a.d_input, a.d_bias, B, K,
                             ctx.workspace.ptr, ctx.workspace.bytes, ctx.device, ctx.stream, a.act_out);
    return true;
  };
  return op_setup(s, run, variants);
}

ActLinearDgradArgs dgrad_synthetic(const ActLinearDgradArgs& a, int64_t M, DType dtype, TuningArena& arena) {
  ActLinearDgradArgs t = a;  // the weight is the call's own
  t.batch = M;
  t.d_output = arena.values(M * a.out_features, dtype);
  if (a.pre_act != nullptr)
    t.pre_act = a.activation == Activation::kRelu
                    ? arena.random_bytes(static_cast<std::size_t>(M * relu_mask_row_bytes(a.in_features)))
                    : arena.values(M * a.in_features, dtype);
  t.d_input = arena.scratch(static_cast<std::size_t>(M * a.in_features) * dtype_size(dtype));
  if (a.d_bias != nullptr) t.d_bias = arena.scratch(static_cast<std::size_t>(a.in_features) * dtype_size(dtype));
  if (a.act_out != nullptr) t.act_out = arena.scratch(static_cast<std::size_t>(M * a.in_features) * dtype_size(dtype));
  return t;
}

}  // namespace

std::size_t linear_act_workspace_bytes(int device, const LinearActArgs&) { return gemm_workspace_bytes(device); }

std::size_t linear_bias_wgrad_workspace_bytes(int device, const LinearBiasWgradArgs& a) {
  return std::max(gemm_workspace_bytes(device),
                  a.d_bias ? reduction_workspace_bytes(a.batch, a.out_features) : std::size_t{0});
}

std::size_t act_linear_dgrad_workspace_bytes(int device, const ActLinearDgradArgs& a) {
  return std::max(gemm_workspace_bytes(device),
                  a.d_bias ? reduction_workspace_bytes(a.batch, a.in_features) : std::size_t{0});
}

void linear_act(const LinearContext& ctx, const LinearActArgs& a) {
  const int64_t B = a.batch, K = a.in_features, N = a.out_features;
  if (B == 0 || N == 0) return;
  if (K == 0) {
    const bool mask = a.activation == Activation::kRelu && a.pre_act != nullptr;
    void* target = (a.pre_act != nullptr && !mask) ? a.pre_act : a.out;
    zero(target, B * N, ctx.dtype, ctx.stream);
    bias_act_forward(ctx.dtype, a.activation, target, a.bias, a.out, a.pre_act, B, N, ctx.device, ctx.stream);
    return;
  }
  // Rule without measurement: the fused epilogue, cuBLASLt's first choice. Only 'auto' takes the
  // cutlass_sm90 forward (gelu_approx with bias and saved pre-activation), and only where measured
  // faster.
  dispatch(a.heuristic, Choice{true, 0}, ctx, a, OpKind::kForward, K, N, a.activation, a.bias != nullptr,
           a.pre_act != nullptr, "forward", forward_setup,
           [&](const LinearActArgs& args, int64_t M, TuningArena& arena) {
             return forward_synthetic(args, M, ctx.dtype, arena);
           },
           linear_act_workspace_bytes);
}

void linear_bias_wgrad(const LinearContext& ctx, const LinearBiasWgradArgs& a) {
  const int64_t B = a.batch, K = a.in_features, N = a.out_features;
  if (B == 0) {
    zero(a.d_weight, N * K, ctx.dtype, ctx.stream);
    zero(a.d_bias, N, ctx.dtype, ctx.stream);
    return;
  }
  if (N == 0) return;
  if (K == 0) {
    if (a.d_bias != nullptr)
      act_backward_bias_grad(ctx.dtype, Activation::kNone, a.d_output, nullptr, nullptr, a.d_bias, B, N,
                             ctx.workspace.ptr, ctx.workspace.bytes, ctx.device, ctx.stream);
    return;
  }
  // The op linear_bias_wgrad takes no heuristic (as flash-attn's fused_dense_lib's does not): it is
  // always 'auto'; the rule fuses BGRADB. Its M is the GEMM's reduction dimension, the batch.
  dispatch(kHeuristicAuto, Choice{a.d_bias != nullptr, 0}, ctx, a, OpKind::kWgrad, K, N, Activation::kNone,
           a.d_bias != nullptr, false, "wgrad", wgrad_setup,
           [&](const LinearBiasWgradArgs& args, int64_t M, TuningArena& arena) {
             return wgrad_synthetic(args, M, ctx.dtype, arena);
           },
           linear_bias_wgrad_workspace_bytes);
}

void act_linear_dgrad(const LinearContext& ctx, const ActLinearDgradArgs& a) {
  const int64_t B = a.batch, K = a.in_features, N = a.out_features;
  if (a.act_out != nullptr && a.activation != Activation::kGeluTanh && a.activation != Activation::kSquaredRelu)
    throw Error(std::string("fused_dense: act_linear_dgrad: act_out needs a gelu_approx or sqrelu pre_act, got ") +
                activation_name(a.activation));
  if (B == 0 || K == 0) {
    if (B == 0) zero(a.d_bias, K, ctx.dtype, ctx.stream);
    return;
  }
  if (N == 0) {
    zero(a.d_input, B * K, ctx.dtype, ctx.stream);
    zero(a.d_bias, K, ctx.dtype, ctx.stream);
    if (a.act_out != nullptr)
      bias_act_forward(ctx.dtype, a.activation, a.pre_act, nullptr, a.act_out, nullptr, B, K, ctx.device,
                       ctx.stream);
    return;
  }
  // Rule without measurement: unfused. On the H200 DGELU_BGRAD is slower than GEMM + one
  // elementwise pass at every benchmarked shape (docs/performance.md, "The data gradient through
  // the activation").
  // act_out is not part of the key: a call with it takes the choice of the call without it, so
  // checkpoint level 1 computes the same gradients as level 0, bit for bit.
  // Only 'auto' takes the cutlass_sm90 data gradient, and only where the tuner measured it faster.
  dispatch(a.heuristic, Choice{false, 0}, ctx, a, OpKind::kDgrad, K, N, a.activation, a.d_bias != nullptr, false,
           "dgrad", dgrad_setup,
           [&](const ActLinearDgradArgs& args, int64_t M, TuningArena& arena) {
             return dgrad_synthetic(args, M, ctx.dtype, arena);
           },
           act_linear_dgrad_workspace_bytes);
}

// ---- gated layers (gated.h) ----

namespace {

CutlassSm90GatedForwardArgs cutlass_gated_forward_args(const LinearContext& ctx, const GatedLinearArgs& a) {
  CutlassSm90GatedForwardArgs c;
  c.device = ctx.device;
  c.batch = a.batch, c.in_features = a.in_features, c.hidden = a.hidden;
  c.dtype = ctx.dtype;
  c.activation = a.activation;
  c.input = a.input, c.weight = a.weight, c.out = a.out, c.gu = a.pre_act;
  return c;
}

CutlassSm90GatedDgradArgs cutlass_gated_dgrad_args(const LinearContext& ctx, const GatedLinearDgradArgs& a) {
  CutlassSm90GatedDgradArgs c;
  c.device = ctx.device;
  c.batch = a.batch, c.hidden = a.hidden, c.out_features = a.out_features;
  c.dtype = ctx.dtype;
  c.activation = a.activation;
  c.d_output = a.d_output, c.weight = a.weight, c.gu = a.pre_act, c.d_gu = a.d_pre, c.act_out = a.act_out;
  return c;
}

// The unfused path's intermediate lies after the GEMM's workspace, at a 256-byte boundary.
std::size_t gated_scratch_offset(int device) { return (gemm_workspace_bytes(device) + 255) / 256 * 256; }

void* gated_scratch(const LinearContext& ctx, std::size_t bytes) {
  const std::size_t offset = gated_scratch_offset(ctx.device);
  if (ctx.workspace.ptr == nullptr || ctx.workspace.bytes < offset + bytes)
    throw Error("fused_dense: the gated layer's workspace holds " + std::to_string(ctx.workspace.bytes) +
                " bytes, needs " + std::to_string(offset + bytes));
  return static_cast<char*>(ctx.workspace.ptr) + offset;
}

void check_gated(const char* op, Activation act) {
  if (!is_gated(act))
    throw Error(std::string("fused_dense: ") + op + ": activation must be gated (swiglu or geglu), got " +
                activation_name(act));
}

std::size_t elements_bytes(int64_t rows, int64_t cols, DType dtype) {
  return static_cast<std::size_t>(rows) * static_cast<std::size_t>(cols) * dtype_size(dtype);
}

// No cuBLASLt epilogue pairs two accumulators: the unfused path (plain GEMM of width 2h, then the
// gating kernel) is the rule and every explicit heuristic's path; 'auto' also measures the
// cutlass_sm90 gated variants. The intermediate (gu when the forward does not keep it) is taken
// from the workspace on each run, so a setup at another M needs no workspace of its own.
auto gated_forward_setup(const LinearContext& ctx, const GatedLinearArgs& a) {
  const int64_t B = a.batch, K = a.in_features, H = a.hidden;
  OpProblems s;
  s.plain = base_problem(ctx);
  s.plain.trans_a = true;
  s.plain.m = 2 * H, s.plain.n = B, s.plain.k = K;
  s.plain.lda = K, s.plain.ldb = K, s.plain.ldd = 2 * H;
  s.fused = s.plain;
  s.aligned = aligned256(a.weight) && aligned256(a.input) &&
              aligned256(a.pre_act != nullptr ? a.pre_act : ctx.workspace.ptr);
  const CutlassSm90GatedForwardArgs cutlass = cutlass_gated_forward_args(ctx, a);
  const auto variants = [cutlass] { return cutlass_sm90_gated_forward_variants(cutlass); };
  const Workspace ws = gemm_workspace_part(ctx);
  const GemmProblem plain = s.plain;
  const auto run = [=](const Choice& c) -> bool {
    if (c.cutlass >= 0) return cutlass_sm90_gated_forward(c.cutlass, cutlass, ws, ctx.stream);
    void* gu = a.pre_act != nullptr ? a.pre_act : gated_scratch(ctx, elements_bytes(B, 2 * H, ctx.dtype));
    GemmPointers ptrs;
    ptrs.a = a.weight;
    ptrs.b = a.input;
    ptrs.d = gu;
    if (!run_gemm(plain, ptrs, c, ws, ctx.stream)) return false;
    gated_act_forward(ctx.dtype, a.activation, gu, a.out, B, H, ctx.device, ctx.stream);
    return true;
  };
  return op_setup(s, run, variants);
}

GatedLinearArgs gated_forward_synthetic(const GatedLinearArgs& a, int64_t M, DType dtype, TuningArena& arena) {
  GatedLinearArgs t = a;  // the weight is the call's own
  t.batch = M;
  t.input = arena.values(M * a.in_features, dtype);
  t.out = arena.scratch(elements_bytes(M, a.hidden, dtype));
  if (a.pre_act != nullptr) t.pre_act = arena.scratch(elements_bytes(M, 2 * a.hidden, dtype));
  return t;
}

auto gated_dgrad_setup(const LinearContext& ctx, const GatedLinearDgradArgs& a) {
  const int64_t B = a.batch, H = a.hidden, N = a.out_features;
  OpProblems s;
  s.plain = base_problem(ctx);
  s.plain.m = H, s.plain.n = B, s.plain.k = N;
  s.plain.lda = H, s.plain.ldb = N, s.plain.ldd = H;
  s.fused = s.plain;
  s.aligned = aligned256(a.weight) && aligned256(a.d_output) && aligned256(ctx.workspace.ptr);
  const CutlassSm90GatedDgradArgs cutlass = cutlass_gated_dgrad_args(ctx, a);
  const auto variants = [cutlass] { return cutlass_sm90_gated_dgrad_variants(cutlass); };
  const Workspace ws = gemm_workspace_part(ctx);
  const GemmProblem plain = s.plain;
  const auto run = [=](const Choice& c) -> bool {
    // the cutlass_sm90 kernel writes act_out itself when asked
    if (c.cutlass >= 0) return cutlass_sm90_gated_dgrad(c.cutlass, cutlass, ws, ctx.stream);
    void* d_h = gated_scratch(ctx, elements_bytes(B, H, ctx.dtype));
    GemmPointers ptrs;
    ptrs.a = a.weight;
    ptrs.b = a.d_output;
    ptrs.d = d_h;
    if (!run_gemm(plain, ptrs, c, ws, ctx.stream)) return false;
    gated_act_backward(ctx.dtype, a.activation, d_h, a.pre_act, a.d_pre, a.act_out, B, H, ctx.device, ctx.stream);
    return true;
  };
  return op_setup(s, run, variants);
}

GatedLinearDgradArgs gated_dgrad_synthetic(const GatedLinearDgradArgs& a, int64_t M, DType dtype, TuningArena& arena) {
  GatedLinearDgradArgs t = a;  // the weight is the call's own
  t.batch = M;
  t.d_output = arena.values(M * a.out_features, dtype);
  t.pre_act = arena.values(M * 2 * a.hidden, dtype);
  t.d_pre = arena.scratch(elements_bytes(M, 2 * a.hidden, dtype));
  if (a.act_out != nullptr) t.act_out = arena.scratch(elements_bytes(M, a.hidden, dtype));
  return t;
}

}  // namespace

std::size_t gated_linear_workspace_bytes(int device, DType dtype, const GatedLinearArgs& a) {
  if (a.pre_act != nullptr) return gemm_workspace_bytes(device);
  return gated_scratch_offset(device) + elements_bytes(a.batch, 2 * a.hidden, dtype);
}

std::size_t gated_linear_dgrad_workspace_bytes(int device, DType dtype, const GatedLinearDgradArgs& a) {
  return gated_scratch_offset(device) + elements_bytes(a.batch, a.hidden, dtype);
}

void gated_linear(const LinearContext& ctx, const GatedLinearArgs& a) {
  check_gated("gated_linear", a.activation);
  const int64_t B = a.batch, K = a.in_features, H = a.hidden;
  if (B == 0 || H == 0) return;
  if (K == 0) {
    void* gu = a.pre_act != nullptr ? a.pre_act : gated_scratch(ctx, elements_bytes(B, 2 * H, ctx.dtype));
    zero(gu, B * 2 * H, ctx.dtype, ctx.stream);
    gated_act_forward(ctx.dtype, a.activation, gu, a.out, B, H, ctx.device, ctx.stream);
    return;
  }
  dispatch(a.heuristic, Choice{false, 0}, ctx, a, OpKind::kGatedForward, K, H, a.activation, false,
           a.pre_act != nullptr, "gated forward", gated_forward_setup,
           [&](const GatedLinearArgs& args, int64_t M, TuningArena& arena) {
             return gated_forward_synthetic(args, M, ctx.dtype, arena);
           },
           [&](int device, const GatedLinearArgs& args) { return gated_linear_workspace_bytes(device, ctx.dtype, args); });
}

void gated_linear_dgrad(const LinearContext& ctx, const GatedLinearDgradArgs& a) {
  check_gated("gated_linear_dgrad", a.activation);
  const int64_t B = a.batch, H = a.hidden, N = a.out_features;
  if (B == 0 || H == 0) return;
  if (N == 0) {
    void* d_h = gated_scratch(ctx, elements_bytes(B, H, ctx.dtype));
    zero(d_h, B * H, ctx.dtype, ctx.stream);
    gated_act_backward(ctx.dtype, a.activation, d_h, a.pre_act, a.d_pre, a.act_out, B, H, ctx.device, ctx.stream);
    return;
  }
  // act_out is not part of the key, as in act_linear_dgrad: level 1 takes level 0's choice.
  dispatch(a.heuristic, Choice{false, 0}, ctx, a, OpKind::kGatedDgrad, H, N, a.activation, false, false,
           "gated dgrad", gated_dgrad_setup,
           [&](const GatedLinearDgradArgs& args, int64_t M, TuningArena& arena) {
             return gated_dgrad_synthetic(args, M, ctx.dtype, arena);
           },
           [&](int device, const GatedLinearDgradArgs& args) {
             return gated_linear_dgrad_workspace_bytes(device, ctx.dtype, args);
           });
}

}  // namespace fused_dense::core
