// The FP8 GEMM of a linear layer (fp8.h) on the one cuBLASLt entry (gemm.h).
#include <sstream>

#include "core/elementwise/elementwise.h"
#include "core/elementwise/fp8_quantize.h"
#include "core/ops/fp8_linear.h"
#include "core/gemm/gemm.h"

namespace fused_dense::core {

void fp8_linear(const LinearContext& ctx, const Fp8LinearArgs& a) {
  std::ostringstream msg;
  if (a.input_format == Fp8Format::kE5M2 && a.weight_format == Fp8Format::kE5M2)
    msg << "input and weight cannot both be e5m2 (no FP8 GEMM takes two e5m2 operands)";
  else if (a.in_features % 16 != 0 || a.out_features % 16 != 0)
    msg << "in_features and out_features must be multiples of 16, got " << a.in_features << " and " << a.out_features;
  else if (a.in_features == 0)
    msg << "in_features must be positive";
  if (!msg.str().empty()) throw Error("fused_dense: fp8_linear: " + msg.str());
  if (a.batch == 0 || a.out_features == 0) return;
  // Column-major view: D[N, B] = W[N, K] . X[K, B], both operands K-major (TN), as linear_act.
  GemmProblem p;
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
  GemmPointers ptrs;
  ptrs.a = a.weight;
  ptrs.b = a.input;
  ptrs.d = a.out;
  ptrs.bias = a.bias;
  ptrs.a_scale = a.weight_scale_inv;
  ptrs.b_scale = a.input_scale_inv;
  const int heuristic = a.heuristic >= 0 ? a.heuristic : 0;
  if (try_gemm(p, ptrs, heuristic, ctx.workspace, ctx.stream)) return;
  // cuBLASLt refuses a fused bias beside some output types (fp16, fp32): add it in a second pass.
  if (p.with_bias) {
    p.with_bias = false;
    gemm(p, ptrs, heuristic, ctx.workspace, ctx.stream);
    bias_act_forward(ctx.dtype, Activation::kNone, a.out, a.bias, a.out, nullptr, a.batch, a.out_features,
                     ctx.device, ctx.stream);
    return;
  }
  gemm(p, ptrs, heuristic, ctx.workspace, ctx.stream);
}

}  // namespace fused_dense::core
