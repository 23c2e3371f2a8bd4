#include "linear.h"

#include <algorithm>
#include <sstream>

#include "cuda_check.h"
#include "elementwise.h"
#include "cutlass_sm90_dgrad.h"
#include "cutlass_sm90_forward.h"
#include "gated.h"
#include "tuner.h"

// The cutlass_sm90 gated kernels are candidates of the gated layers' 'auto' where the tree has them.
#if __has_include("cutlass_sm90_gated.h")
#include "cutlass_sm90_gated.h"
#define FD_CUTLASS_GATED_HOOKS 1
#endif

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

void zero(void* ptr, int64_t elements, DType dtype, cudaStream_t stream) {
  if (ptr != nullptr && elements > 0)
    FD_CUDA_CHECK(cudaMemsetAsync(ptr, 0, static_cast<std::size_t>(elements) * dtype_size(dtype), stream));
}

enum class OpKind : int64_t { kForward = 0, kWgrad = 1, kDgrad = 2, kGatedForward = 3, kGatedDgrad = 4 };

TuningKey tuning_key(OpKind op, const LinearContext& ctx, int64_t B, int64_t K, int64_t N, Activation act,
                     bool flag_a, bool flag_b) {
  TuningKey key;
  key.v = {static_cast<int64_t>(op), static_cast<int64_t>(ctx.dtype), B, K, N, static_cast<int64_t>(act),
           flag_a, flag_b, ctx.dtype == DType::kFloat32 && ctx.allow_tf32, 0};
  return key;
}

std::string describe(const char* op, const LinearContext& ctx, int64_t B, int64_t K, int64_t N, Activation act) {
  std::ostringstream s;
  s << op << " " << dtype_name(ctx.dtype) << " " << activation_name(act) << " B=" << B << " K=" << K << " N=" << N;
  return s.str();
}

// Resolves the heuristic argument into runs of `run_choice`: an explicit index tries the fused
// epilogue and, where cuBLASLt refuses it, the unfused path with the same index into the plain
// list; 'auto' measures (tuner.h), the cutlass_sm90 variants included (`cutlass_variants()` of
// them, asked only when tuning).
template <typename RunChoice, typename Describe, typename CutlassVariants>
void dispatch(int heuristic, bool fused_possible, const GemmProblem& fused_problem,
              const GemmProblem& plain_problem, CutlassVariants&& cutlass_variants, const Choice& rule,
              const LinearContext& ctx, const TuningKey& key, Describe&& describe_problem, RunChoice&& run_choice) {
  if (heuristic == kHeuristicUnfused || (heuristic >= 0 && !fused_possible)) {
    run_choice(Choice{false, std::max(heuristic, 0)});
    return;
  }
  if (heuristic >= 0) {
    if (!run_choice(Choice{true, heuristic})) run_choice(Choice{false, heuristic});
    return;
  }
  // Once tuned, the per-call cost of 'auto' is this one lookup; the algorithm counts and the
  // description are only needed to tune.
  Choice choice;
  if (!cached_choice(ctx.device, key, &choice)) {
    const int fused_count = fused_possible ? gemm_algorithm_count(fused_problem) : 0;
    const int plain_count = gemm_algorithm_count(plain_problem);
    Choice fallback = rule;
    if (fallback.fused && fused_count == 0) fallback = Choice{false, 0};
    choice = tune(ctx.device, key, describe_problem(), fused_count, plain_count, cutlass_variants(), fallback,
                  run_choice, ctx.stream);
  }
  // A choice tuned on aligned operands may not exist in the list of a less aligned call (nor
  // may the cutlass_sm90 kernels take such operands).
  bool done = false;
  try {
    done = run_choice(choice);
  } catch (const HeuristicOutOfRange&) {
  }
  if (!done) run_choice(Choice{false, 0});
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
  const bool mask = a.activation == Activation::kRelu && a.pre_act != nullptr;
  // With a saved GELU / squared-ReLU pre-activation the GEMM writes it and the kernel reads it
  // back; otherwise the GEMM writes `out` and the kernel works in place.
  void* gemm_target = (a.pre_act != nullptr && !mask) ? a.pre_act : a.out;
  if (K == 0) {
    zero(gemm_target, B * N, ctx.dtype, ctx.stream);
    bias_act_forward(ctx.dtype, a.activation, gemm_target, a.bias, a.out, a.pre_act, B, N, ctx.device,
                     ctx.stream);
    return;
  }
  // The unfused path still adds the bias in the GEMM's fp32 epilogue: adding it after the GEMM
  // result is rounded to 16 bits would let that rounding flip the sign of x.w + b wherever
  // x.w ~= -b, and every flipped ReLU unit passes (or blocks) a whole gradient element.
  GemmProblem plain = base_problem(ctx);
  plain.trans_a = true;
  plain.m = N, plain.n = B, plain.k = K;
  plain.lda = K, plain.ldb = K, plain.ldd = N;
  plain.with_bias = a.bias != nullptr;

  GemmProblem fused = plain;
  fused.ld_aux = N;
  switch (a.activation) {
    case Activation::kNone: fused.epilogue = Epilogue::kNone; break;
    case Activation::kGeluTanh: fused.epilogue = a.pre_act ? Epilogue::kGeluAux : Epilogue::kGelu; break;
    case Activation::kRelu: fused.epilogue = a.pre_act ? Epilogue::kReluAux : Epilogue::kRelu; break;
    case Activation::kSquaredRelu: break;
    case Activation::kSwiGLU:
    case Activation::kGeGLU:
      throw Error(std::string("fused_dense: linear_act: ") + activation_name(a.activation) +
                  " is gated; gated_linear (gated.h) takes it");
  }
  const bool fused_possible = a.activation != Activation::kSquaredRelu &&
                              (a.pre_act == nullptr || aux_ld_accepted(a.activation, N));
  const Workspace ws = gemm_part(ctx);
  CutlassSm90ForwardArgs cutlass;
  cutlass.device = ctx.device;
  cutlass.batch = B, cutlass.in_features = K, cutlass.out_features = N;
  cutlass.dtype = ctx.dtype;
  cutlass.activation = a.activation;
  cutlass.input = a.input, cutlass.weight = a.weight, cutlass.bias = a.bias, cutlass.out = a.out;
  cutlass.pre_act = a.pre_act;

  auto run_choice = [&](const Choice& c) -> bool {
    if (c.cutlass >= 0) return cutlass_sm90_forward(c.cutlass, cutlass, ws, ctx.stream);
    GemmPointers ptrs;
    ptrs.a = a.weight;
    ptrs.b = a.input;
    if (c.fused) {
      ptrs.d = a.out;
      ptrs.bias = a.bias;
      ptrs.aux = a.pre_act;
      return try_gemm(fused, ptrs, c.algorithm, ws, ctx.stream);
    }
    ptrs.d = gemm_target;
    ptrs.bias = a.bias;
    // cuBLASLt refuses the BIAS epilogue for some operand alignments (seen on the H200 for bf16
    // at a 2-byte offset). Then the bias still joins the sum before the 16-bit rounding: the
    // target is filled with bias rows and the GEMM accumulates onto it (beta = 1, fp32 math).
    // Adding it after the rounding instead loses |x.w| * 2^-11 absolutely, which is a large
    // relative error wherever x.w ~= -b (seen by the fuzz test: 1.2e-2 on a single fp16 row).
    if (a.bias == nullptr) {
      gemm(plain, ptrs, c.algorithm, ws, ctx.stream);
    } else if (!try_gemm(plain, ptrs, c.algorithm, ws, ctx.stream)) {
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
  // Rule without measurement: the fused epilogue, cuBLASLt's first choice. Only 'auto' takes the
  // cutlass_sm90 forward (gelu_approx with bias and saved pre-activation), and only where measured
  // faster.
  dispatch(a.heuristic, fused_possible, fused, plain, [&] { return cutlass_sm90_forward_variants(cutlass); },
           Choice{true, 0}, ctx,
           tuning_key(OpKind::kForward, ctx, B, K, N, a.activation, a.bias != nullptr, a.pre_act != nullptr),
           [&] { return describe("forward", ctx, B, K, N, a.activation); }, run_choice);
}

void linear_bias_wgrad(const LinearContext& ctx, const LinearBiasWgradArgs& a) {
  const int64_t B = a.batch, K = a.in_features, N = a.out_features;
  if (B == 0) {
    zero(a.d_weight, N * K, ctx.dtype, ctx.stream);
    zero(a.d_bias, N, ctx.dtype, ctx.stream);
    return;
  }
  if (N == 0) return;
  auto column_sum = [&] {
    act_backward_bias_grad(ctx.dtype, Activation::kNone, a.d_output, nullptr, nullptr, a.d_bias, B, N,
                           ctx.workspace.ptr, ctx.workspace.bytes, ctx.device, ctx.stream);
  };
  if (K == 0) {
    if (a.d_bias != nullptr) column_sum();
    return;
  }
  GemmProblem plain = base_problem(ctx);
  plain.trans_b = true;
  plain.m = K, plain.n = N, plain.k = B;
  plain.lda = K, plain.ldb = N, plain.ldd = K;
  GemmProblem fused = plain;
  fused.epilogue = Epilogue::kBGradB;
  const Workspace ws = gemm_part(ctx);

  auto run_choice = [&](const Choice& c) -> bool {
    GemmPointers ptrs;
    ptrs.a = a.input;
    ptrs.b = a.d_output;
    ptrs.d = a.d_weight;
    if (c.fused) {
      ptrs.bias_grad = a.d_bias;
      return try_gemm(fused, ptrs, c.algorithm, ws, ctx.stream);
    }
    gemm(plain, ptrs, c.algorithm, ws, ctx.stream);
    if (a.d_bias != nullptr) column_sum();
    return true;
  };
  // The op linear_bias_wgrad takes no heuristic (as flash-attn's fused_dense_lib's does not): it is
  // always 'auto'; the rule fuses BGRADB.
  dispatch(kHeuristicAuto, a.d_bias != nullptr, fused, plain, [] { return 0; }, Choice{a.d_bias != nullptr, 0},
           ctx,
           tuning_key(OpKind::kWgrad, ctx, B, K, N, Activation::kNone, a.d_bias != nullptr, false),
           [&] { return describe("wgrad", ctx, B, K, N, Activation::kNone); }, run_choice);
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
  auto rebuild_act_out = [&] {
    if (a.act_out != nullptr)
      bias_act_forward(ctx.dtype, a.activation, a.pre_act, nullptr, a.act_out, nullptr, B, K, ctx.device,
                       ctx.stream);
  };
  if (N == 0) {
    zero(a.d_input, B * K, ctx.dtype, ctx.stream);
    zero(a.d_bias, K, ctx.dtype, ctx.stream);
    rebuild_act_out();
    return;
  }
  GemmProblem plain = base_problem(ctx);
  plain.m = K, plain.n = B, plain.k = N;
  plain.lda = K, plain.ldb = N, plain.ldd = K;
  GemmProblem fused = plain;
  fused.epilogue = a.activation == Activation::kRelu ? Epilogue::kDRelu : Epilogue::kDGelu;
  fused.with_bias_grad = a.d_bias != nullptr;
  fused.ld_aux = K;
  const bool fused_possible = (a.activation == Activation::kGeluTanh || a.activation == Activation::kRelu) &&
                              aux_ld_accepted(a.activation, K);
  const bool needs_kernel = a.activation != Activation::kNone || a.d_bias != nullptr;
  const Workspace ws = gemm_part(ctx);
  CutlassSm90DgradArgs cutlass;
  cutlass.device = ctx.device;
  cutlass.batch = B, cutlass.in_features = K, cutlass.out_features = N;
  cutlass.dtype = ctx.dtype;
  cutlass.activation = a.activation;
  cutlass.weight = a.weight, cutlass.d_output = a.d_output, cutlass.pre_act = a.pre_act;
  cutlass.d_input = a.d_input, cutlass.d_bias = a.d_bias;

  auto run_choice = [&](const Choice& c) -> bool {
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
      if (!try_gemm(fused, ptrs, c.algorithm, ws, ctx.stream)) return false;
      rebuild_act_out();  // the epilogue reads pre_act but cannot write act(pre_act)
      return true;
    }
    gemm(plain, ptrs, c.algorithm, ws, ctx.stream);
    if (needs_kernel)
      act_backward_bias_grad(ctx.dtype, a.activation, a.d_input, a.pre_act, a.d_input, a.d_bias, B, K,
                             ctx.workspace.ptr, ctx.workspace.bytes, ctx.device, ctx.stream, a.act_out);
    return true;
  };
  // Rule without measurement: unfused. On the H200 DGELU_BGRAD is slower than GEMM + one
  // elementwise pass at every benchmarked shape (0.158 vs 0.124 ms at 8192x1024x4096:
  // docs/performance.md).
  // act_out is not part of the key: a call with it takes the choice of the call without it, so
  // checkpoint level 1 computes the same gradients as level 0, bit for bit.
  // Only 'auto' takes the cutlass_sm90 data gradient, and only where the tuner measured it faster.
  dispatch(a.heuristic, fused_possible, fused, plain, [&] { return cutlass_sm90_dgrad_variants(cutlass); },
           Choice{false, 0},
           ctx, tuning_key(OpKind::kDgrad, ctx, B, K, N, a.activation, a.d_bias != nullptr, false),
           [&] { return describe("dgrad", ctx, B, K, N, a.activation); }, run_choice);
}

// ---- gated layers (gated.h) ----

namespace {

// The cutlass_sm90 gated kernels (cutlass_sm90_gated.h: the forward with act(g) * u in its
// epilogue; the down projection's data gradient with the gating derivative in its epilogue,
// writing d_pre packed) as candidates of 'auto'. A tree without that header builds these hooks
// with no variants, and 'auto' measures the unfused path alone.
#if defined(FD_CUTLASS_GATED_HOOKS)

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

int gated_forward_cutlass_variants(const LinearContext& ctx, const GatedLinearArgs& a) {
  return cutlass_sm90_gated_forward_variants(cutlass_gated_forward_args(ctx, a));
}
bool gated_forward_cutlass(int v, const LinearContext& ctx, const GatedLinearArgs& a, const Workspace& ws) {
  return cutlass_sm90_gated_forward(v, cutlass_gated_forward_args(ctx, a), ws, ctx.stream);
}
int gated_dgrad_cutlass_variants(const LinearContext& ctx, const GatedLinearDgradArgs& a) {
  return cutlass_sm90_gated_dgrad_variants(cutlass_gated_dgrad_args(ctx, a));
}
// writes act_out itself when asked
bool gated_dgrad_cutlass(int v, const LinearContext& ctx, const GatedLinearDgradArgs& a, const Workspace& ws) {
  return cutlass_sm90_gated_dgrad(v, cutlass_gated_dgrad_args(ctx, a), ws, ctx.stream);
}
#else
int gated_forward_cutlass_variants(const LinearContext&, const GatedLinearArgs&) { return 0; }
bool gated_forward_cutlass(int, const LinearContext&, const GatedLinearArgs&, const Workspace&) { return false; }
int gated_dgrad_cutlass_variants(const LinearContext&, const GatedLinearDgradArgs&) { return 0; }
bool gated_dgrad_cutlass(int, const LinearContext&, const GatedLinearDgradArgs&, const Workspace&) { return false; }
#endif

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
  void* gu = a.pre_act != nullptr ? a.pre_act : gated_scratch(ctx, elements_bytes(B, 2 * H, ctx.dtype));
  if (K == 0) {
    zero(gu, B * 2 * H, ctx.dtype, ctx.stream);
    gated_act_forward(ctx.dtype, a.activation, gu, a.out, B, H, ctx.device, ctx.stream);
    return;
  }
  GemmProblem plain = base_problem(ctx);
  plain.trans_a = true;
  plain.m = 2 * H, plain.n = B, plain.k = K;
  plain.lda = K, plain.ldb = K, plain.ldd = 2 * H;
  const Workspace ws = gemm_part(ctx);
  auto run_choice = [&](const Choice& c) -> bool {
    if (c.cutlass >= 0) return gated_forward_cutlass(c.cutlass, ctx, a, ws);
    GemmPointers ptrs;
    ptrs.a = a.weight;
    ptrs.b = a.input;
    ptrs.d = gu;
    gemm(plain, ptrs, c.algorithm, ws, ctx.stream);
    gated_act_forward(ctx.dtype, a.activation, gu, a.out, B, H, ctx.device, ctx.stream);
    return true;
  };
  // No cuBLASLt epilogue pairs two accumulators: the rule and every explicit heuristic take the
  // unfused path; 'auto' also measures the cutlass_sm90 gated variants.
  dispatch(a.heuristic, false, plain, plain, [&] { return gated_forward_cutlass_variants(ctx, a); },
           Choice{false, 0}, ctx,
           tuning_key(OpKind::kGatedForward, ctx, B, K, H, a.activation, false, a.pre_act != nullptr),
           [&] { return describe("gated forward", ctx, B, K, H, a.activation); }, run_choice);
}

void gated_linear_dgrad(const LinearContext& ctx, const GatedLinearDgradArgs& a) {
  check_gated("gated_linear_dgrad", a.activation);
  const int64_t B = a.batch, H = a.hidden, N = a.out_features;
  if (B == 0 || H == 0) return;
  void* d_h = gated_scratch(ctx, elements_bytes(B, H, ctx.dtype));
  if (N == 0) {
    zero(d_h, B * H, ctx.dtype, ctx.stream);
    gated_act_backward(ctx.dtype, a.activation, d_h, a.pre_act, a.d_pre, a.act_out, B, H, ctx.device, ctx.stream);
    return;
  }
  GemmProblem plain = base_problem(ctx);
  plain.m = H, plain.n = B, plain.k = N;
  plain.lda = H, plain.ldb = N, plain.ldd = H;
  const Workspace ws = gemm_part(ctx);
  auto run_choice = [&](const Choice& c) -> bool {
    if (c.cutlass >= 0) return gated_dgrad_cutlass(c.cutlass, ctx, a, ws);
    GemmPointers ptrs;
    ptrs.a = a.weight;
    ptrs.b = a.d_output;
    ptrs.d = d_h;
    gemm(plain, ptrs, c.algorithm, ws, ctx.stream);
    gated_act_backward(ctx.dtype, a.activation, d_h, a.pre_act, a.d_pre, a.act_out, B, H, ctx.device, ctx.stream);
    return true;
  };
  // act_out is not part of the key, as in act_linear_dgrad: level 1 takes level 0's choice.
  dispatch(a.heuristic, false, plain, plain, [&] { return gated_dgrad_cutlass_variants(ctx, a); }, Choice{false, 0},
           ctx, tuning_key(OpKind::kGatedDgrad, ctx, B, H, N, a.activation, false, false),
           [&] { return describe("gated dgrad", ctx, B, H, N, a.activation); }, run_choice);
}

}  // namespace fused_dense::core
