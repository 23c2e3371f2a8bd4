// The FP8 GEMM of a linear layer (fp8_linear.h) on the one cuBLASLt entry (gemm.h), and the fc1
// forward's choice between the cutlass_sm90 FP8 kernel (cutlass_sm90_fp8.h) and that GEMM followed
// by the quantize pass (fp8_quantize.h).
#include <algorithm>
#include <sstream>
#include <string>

#include "core/common/cuda_check.h"
#include "core/cutlass_sm90/cutlass_sm90_fp8.h"
#include "core/elementwise/elementwise.h"
#include "core/elementwise/fp8_quantize.h"
#include "core/gemm/gemm.h"
#include "core/ops/dispatch.h"
#include "core/ops/fp8_linear.h"
#include "core/tuning/tuning_arena.h"

namespace fused_dense::core {

namespace {

using dispatch_detail::aligned256;
using dispatch_detail::op_setup;
using dispatch_detail::OpKind;
using dispatch_detail::OpProblems;
using dispatch_detail::run_gemm;

OpKind fp8_op_kind(const Fp8LinearArgs& a) {
  if (a.input_format == Fp8Format::kE5M2) return OpKind::kFp8E5M2xE4M3;
  return a.weight_format == Fp8Format::kE5M2 ? OpKind::kFp8E4M3xE5M2 : OpKind::kFp8E4M3xE4M3;
}

// Column-major view: D[N, B] = W[N, K] . X[K, B], both operands K-major (TN), as linear_act. The
// bias joins the GEMM's epilogue; where cuBLASLt refuses that epilogue beside the output type (fp16,
// fp32) an index choice adds it in a second pass, and a stored algorithm reports the refusal (the
// dispatch then runs cuBLASLt's first algorithm for the exact problem, that way).
auto fp8_setup(const LinearContext& ctx, const Fp8LinearArgs& a) {
  OpProblems s;
  GemmProblem& p = s.plain;
  p.device = ctx.device;
  p.dtype = ctx.dtype;
  p.fp8 = true;
  p.a_format = a.weight_format;
  p.b_format = a.input_format;
  p.fast_accum = a.fast_accum;
  p.trans_a = true;
  p.trans_b = false;
  p.m = a.out_features, p.n = a.batch, p.k = a.in_features;
  p.lda = a.in_features, p.ldb = a.in_features, p.ldd = a.out_features;
  p.with_bias = a.bias != nullptr;
  s.aligned = aligned256(a.weight) && aligned256(a.input) && aligned256(a.out);
  s.max_plain = 8;
  const Workspace ws = gemm_workspace_part(ctx);
  const GemmProblem with_bias = p;
  const auto run = [=](const Choice& c) -> bool {
    GemmPointers ptrs;
    ptrs.a = a.weight;
    ptrs.b = a.input;
    ptrs.d = a.out;
    ptrs.bias = a.bias;
    ptrs.a_scale = a.weight_scale_inv;
    ptrs.b_scale = a.input_scale_inv;
    if (run_gemm(with_bias, ptrs, c, ws, ctx.stream)) return true;
    if (a.bias == nullptr || c.has_algo) return false;
    GemmProblem no_bias = with_bias;
    no_bias.with_bias = false;
    ptrs.bias = nullptr;
    gemm(no_bias, ptrs, c.algorithm, ws, ctx.stream);
    bias_act_forward(ctx.dtype, Activation::kNone, a.out, a.bias, a.out, nullptr, a.batch, a.out_features, ctx.device,
                     ctx.stream);
    return true;
  };
  return op_setup(s, run);
}

// The call's operands at batch M for measuring: the input from the arena, pseudo-random FP8 values
// of its format spread as a quantized tensor's (TuningArena::fp8_values); the weight, bias and
// scales are the call's own (read only).
Fp8LinearArgs fp8_synthetic(const Fp8LinearArgs& a, int64_t M, DType dtype, TuningArena& arena) {
  Fp8LinearArgs t = a;
  t.batch = M;
  t.input = arena.fp8_values(M * a.in_features, a.input_format);
  t.out = arena.scratch(static_cast<std::size_t>(M * a.out_features) * dtype_size(dtype));
  return t;
}

}  // namespace

void fp8_linear(const LinearContext& ctx, const Fp8LinearArgs& a) {
  std::ostringstream msg;
  if (a.input_format == Fp8Format::kE5M2 && a.weight_format == Fp8Format::kE5M2)
    msg << "input and weight cannot both be e5m2 (no FP8 GEMM takes two e5m2 operands)";
  else if (a.in_features % 16 != 0 || a.out_features % 16 != 0)
    msg << "in_features and out_features must be multiples of 16, got " << a.in_features << " and " << a.out_features;
  if (!msg.str().empty()) throw Error("fused_dense: fp8_linear: " + msg.str());
  if (a.batch == 0 || a.out_features == 0) return;
  if (a.in_features == 0) {
    // The empty sum (a weight gradient over no tokens): out = bias, or zeros.
    FD_CUDA_CHECK(cudaMemsetAsync(a.out, 0, static_cast<std::size_t>(a.batch * a.out_features) * dtype_size(ctx.dtype),
                                  ctx.stream));
    if (a.bias != nullptr)
      bias_act_forward(ctx.dtype, Activation::kNone, a.out, a.bias, a.out, nullptr, a.batch, a.out_features,
                       ctx.device, ctx.stream);
    return;
  }
  // 'auto' measures cuBLASLt's algorithms as for the other GEMMs (tuner.h): its first choice lost up
  // to 14% to another of its list at a Llama layer's forward shapes (docs/performance.md, "FP8
  // GEMMs under 'auto'"). The rule is that first choice. The key is the batch's bucket with the
  // exact in_features: for a weight gradient (input: the gradient's transposed copy) the token
  // count is in_features, so each count is measured at its own (or served the rule's choice).
  const char* name = a.input_format == Fp8Format::kE5M2    ? "fp8_linear e5m2 x e4m3"
                     : a.weight_format == Fp8Format::kE5M2 ? "fp8_linear e4m3 x e5m2"
                                                           : "fp8_linear e4m3 x e4m3";
  dispatch_detail::dispatch(
      a.heuristic, Choice{false, 0}, ctx, a, fp8_op_kind(a), a.in_features, a.out_features, Activation::kNone,
      a.bias != nullptr, a.fast_accum, name, fp8_setup,
      [&](const Fp8LinearArgs& args, int64_t M, TuningArena& arena) {
        return fp8_synthetic(args, M, ctx.dtype, arena);
      },
      [](int device, const Fp8LinearArgs&) { return gemm_workspace_bytes(device); });
}

namespace {

// The quantize pass of fc1's activation: v = act(pre) into e4m3; known_amax: the amax of v the
// cutlass_sm90 GEMM recorded (current scaling), in place of the amax pass.
Fp8QuantizeArgs act_quantize_args(DType dtype, const Fp8LinearActArgs& a, const float* known_amax) {
  Fp8QuantizeArgs q;
  q.dtype = dtype;
  q.rows = a.batch, q.cols = a.out_features;
  q.input = a.pre;
  q.activation = a.activation;
  q.backward = false;
  q.format = Fp8Format::kE4M3;
  q.scale = a.scale;
  q.known_amax = known_amax;
  q.data = a.data, q.data_t = a.data_t;
  q.scale_out = a.scale_out, q.scale_inv_out = a.scale_inv_out, q.amax_out = a.amax;
  q.input_data = a.pre_data, q.input_scale_inv_out = a.pre_scale_inv_out;
  return q;
}

}  // namespace

// Bytes at the workspace's end that hold pre's amax from the GEMM to the cast pass.
constexpr std::size_t kPreAmaxBytes = 256;

std::size_t fp8_linear_act_workspace_bytes(int device, DType dtype, const Fp8LinearActArgs& a) {
  return std::max(gemm_workspace_bytes(device),
                  fp8_quantize_workspace_bytes(device, act_quantize_args(dtype, a, nullptr))) +
         kPreAmaxBytes;
}

void fp8_linear_act(const LinearContext& ctx, const Fp8LinearActArgs& a) {
  if (a.activation != Activation::kGeluTanh && a.activation != Activation::kRelu &&
      a.activation != Activation::kSquaredRelu)
    throw Error(std::string("fused_dense: fp8_linear_act: activation must be gelu_approx, relu or sqrelu, got ") +
                activation_name(a.activation));
  const bool pre_copy = a.pre_scale_inv_out != nullptr;
  if (pre_copy && a.pre_data == nullptr && a.batch > 0)
    throw Error("fused_dense: fp8_linear_act: pre's e4m3 copy (pre_scale_inv_out) needs pre_data");
  if (ctx.workspace.bytes < kPreAmaxBytes) throw Error("fused_dense: fp8_linear_act: workspace too small");
  const bool delayed = a.scale != nullptr;
  // [GEMM's part | quantize's part, in turn ... | pre's amax]
  float* pre_amax = reinterpret_cast<float*>(static_cast<char*>(ctx.workspace.ptr) + ctx.workspace.bytes -
                                             kPreAmaxBytes);
  const Workspace quantize_ws{ctx.workspace.ptr, ctx.workspace.bytes - kPreAmaxBytes};
  const Workspace gemm_ws{quantize_ws.ptr, std::min(quantize_ws.bytes, gemm_workspace_bytes(ctx.device))};
  CutlassSm90Fp8ForwardArgs c;
  c.device = ctx.device;
  c.batch = a.batch, c.in_features = a.in_features, c.out_features = a.out_features;
  c.dtype = ctx.dtype;
  c.activation = a.activation;
  c.input = a.input, c.weight = a.weight, c.bias = a.bias;
  c.input_scale_inv = a.input_scale_inv, c.weight_scale_inv = a.weight_scale_inv;
  c.scale = a.scale;
  if (cutlass_sm90_fp8_forward_fits(c)) {
    c.pre = a.pre;
    if (delayed) {
      c.data = a.data;
      c.data_t = a.data_t;
    }
    c.amax = a.amax;
    c.pre_amax = pre_copy ? pre_amax : nullptr;
    // A refusal here would make the recomputation's path differ from the forward's.
    if (!cutlass_sm90_fp8_forward(c, gemm_ws, ctx.stream))
      throw Error("fused_dense: fp8_linear_act: the cutlass_sm90 FP8 forward kernel refused a problem it fits "
                  "(batch " + std::to_string(a.batch) + ", in_features " + std::to_string(a.in_features) +
                  ", out_features " + std::to_string(a.out_features) + ")");
    if (delayed) {
      fp8_write_scales(a.scale, a.scale_out, a.scale_inv_out, ctx.stream);
      if (pre_copy) {
        // pre's copy: one cast pass at the amax the GEMM recorded.
        Fp8QuantizeArgs q;
        q.dtype = ctx.dtype;
        q.rows = a.batch, q.cols = a.out_features;
        q.input = a.pre;
        q.known_amax = pre_amax;
        q.data = a.pre_data;
        q.scale_inv_out = a.pre_scale_inv_out;
        fp8_quantize(q, quantize_ws.ptr, quantize_ws.bytes, ctx.device, ctx.stream);
      }
    } else {
      // The cast of act(pre) with the amax the GEMM recorded; it writes the scales (amax stays),
      // and pre's copy at pre's recorded amax.
      Fp8QuantizeArgs q = act_quantize_args(ctx.dtype, a, a.amax);
      q.input_known_amax = pre_copy ? pre_amax : nullptr;
      fp8_quantize(q, quantize_ws.ptr, quantize_ws.bytes, ctx.device, ctx.stream);
    }
    return;
  }
  Fp8LinearArgs l;
  l.batch = a.batch, l.in_features = a.in_features, l.out_features = a.out_features;
  l.input = a.input, l.input_format = Fp8Format::kE4M3;
  l.weight = a.weight, l.weight_format = Fp8Format::kE4M3;
  l.input_scale_inv = a.input_scale_inv, l.weight_scale_inv = a.weight_scale_inv;
  l.bias = a.bias;
  l.out = a.pre;
  l.fast_accum = true;
  l.heuristic = kHeuristicAuto;
  LinearContext gemm_ctx = ctx;
  gemm_ctx.workspace = gemm_ws;
  fp8_linear(gemm_ctx, l);
  fp8_quantize(act_quantize_args(ctx.dtype, a, nullptr), quantize_ws.ptr, quantize_ws.bytes, ctx.device, ctx.stream);
}

}  // namespace fused_dense::core
