// The mlp_fp8 family's kernels (mlp_fp8.cpp has the schemas and checks): the FP8 autograd of the
// MLP (fused_mlp_fp8) and of one linear layer (fp8_dense), composed of the FP8 ops (fp8.cpp)
// through the dispatcher, so it serves CPU, CUDA and Meta alike. The MLP follows the checkpoint
// rules of mlp.h, the same plan as the bf16 MLP.
//
// Per step, with per-tensor scales (current: from each tensor's amax; delayed: `scales`); for the
// gated activations (swiglu, geglu) pre is the packed gu [B, 2h] (core/common/types.h), act(pre) is
// act(g) * u [B, h] and d_act * act'(pre) the packed (d_h * u * act'(g), d_h * act(g)) [B, 2h]:
//   forward   xq = Q(x) (e4m3; + x^T when weight1 needs a gradient), or the caller's x_fp8
//             (given without x^T, x's row-major copy is kept and transposed in backward)
//             pre = fp8_linear(xq, W1q) + b1                       (model dtype)
//             aq = Q(act(pre)) (e4m3; + its transpose for fc2's weight gradient)
//             (plain activations: these two as one op, fp8_linear_act)
//             out = fp8_linear(aq, W2q) + b2
//   backward  gq = Q(grad_out) (grad_format; rowwise, transposed, column sums = grad of b2)
//             d_act = fp8_linear(gq, W2q^T)                         (model dtype)
//             dq = Q(d_act * act'(pre)) (grad_format; row-major, column sums = grad of b1), then
//             its transposed copy from dq's bytes (fp8_transpose), once d_act and pre are freed
//             grad_W2 = fp8_linear(gq^T, aq^T), grad_x = fp8_linear(dq, W1q^T),
//             grad_W1 = fp8_linear(dq^T, xq^T)
// The transposed copies are padded along the tokens to a multiple of 16 with zeros (the K of the
// weight-gradient GEMMs). The weights' FP8 copies (data, data^T, scale_inv) come in as arguments:
// the caller makes them once per optimizer step and may reuse them across micro-batches. Handed
// without data^T (empty; Recipe save_weight_fp8=False), the step holds no weight copy from the
// forward to the backward, which quantizes the weight again for its data gradient at the scale the
// copies were made with (weight_t: one cast pass, the same bytes as the transposed copy).
// The forward GEMMs use Hopper's fast FP8 accumulation, the gradient GEMMs the precise one.
// Level 1 rebuilds aq^T from pre, level 2 re-runs fc1 from xq: both with the forward's scales,
// so the rebuilt tensors are the forward's bits and no amax is recorded again.
// save_pre_fp8 (level 0): pre is kept as Q(pre) (e4m3, its own amax), written by the op that
// quantizes act(pre) from the same loads (input_fp8 / pre_fp8: one more write of pre's bytes, no
// read), and backward's quantize of the activation's gradient reads pre' = dequantized Q(pre)
// rounded to the model dtype in act'(pre') (fp8_quantize's pre_scale_inv): half the bytes of the
// pre-activation, none of it rebuilt in the model's dtype, for act'(pre) evaluated 3 mantissa bits
// from pre (off by default); the forward then makes aq^T from aq's bytes (fp8_transpose) and x's
// transposed copy after pre is freed (from x's row-major bytes where fc1 held them, else from x
// at x's scale), and where backward may free Q(pre) (no
// retain_graph) the gradient's row-major FP8 copy is written over it (fp8_quantize_grad_), so the
// step holds no second tensor of its size.
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/grad_mode.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <algorithm>

#include "torch/autograd/op_calls.h"
#include "torch/autograd/saved.h"
#include "torch/fp8.h"
#include "torch/mlp.h"
#include "torch/mlp_fp8.h"

namespace fused_dense {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using Opt = std::optional<at::Tensor>;

Opt opt(const at::Tensor& t) { return t.defined() ? Opt(t) : std::nullopt; }

// One quantized tensor: what the GEMMs and the rebuilds read.
struct Q {
  at::Tensor data, data_t, scale, scale_inv, amax, sums;
};

Q quantize(const at::Tensor& input, const Opt& pre_act, int64_t activation, bool backward, int64_t format,
           const Opt& scale, bool rowwise, bool columnwise, bool column_sums, const Opt& pre_scale_inv = std::nullopt,
           const Opt& input_fp8 = std::nullopt, const Opt& input_scale_inv = std::nullopt) {
  auto [d, t, s, si, a, c] = op_calls::fp8_quantize(input, pre_act, activation, backward, format, scale, rowwise,
                                                     columnwise, column_sums, pre_scale_inv, input_fp8, input_scale_inv);
  return Q{d, t, s, si, a, c};
}

// x's quantized copy: x_fp8 when the caller made it (check_x_fp8; with its transposed copy x_fp8[1]
// empty, the op makes that copy in backward from x_fp8[0]: x_t_from_rows), else fp8_quantize of x (e4m3;
// the transposed copy when a weight gradient reads it).
Q input_q(const at::Tensor& x, at::TensorList x_fp8, const Opt& scale, bool columnwise) {
  if (x_fp8.empty()) return quantize(x, std::nullopt, 0, false, kE4M3Code, scale, true, columnwise, false);
  return Q{x_fp8[0], x_fp8[1], at::Tensor(), x_fp8[2], x_fp8[3], at::Tensor()};
}

// Whether the weight gradient's operand x^T is left to backward: the caller's x_fp8 came without
// its transposed copy (under torch.compile, Recipe compiled_input_quantize='traced_rowwise'), so
// the row-major copy is kept in its place and backward transposes it (fp8_transpose, the same
// bytes as the quantize pass's transposed copy) right before the weight-gradient GEMM.
bool x_t_from_rows(at::TensorList x_fp8, bool weight_grad) {
  return weight_grad && !x_fp8.empty() && x_fp8[1].sym_numel() == 0;
}

// The copies of an FP8 weight a Function keeps for backward: the row-major one only where backward
// re-runs the forward GEMM (`rows`: level 2's fc1), the transposed one where a data gradient reads
// it (`cols`; handed empty, the scale weight_t casts at instead), scale_inv always; the others are
// left undefined. The copies are the caller's per-step tensors, so a copy kept here is one the step
// holds from the forward to the backward: keeping the row-major copies as well held twice the FP8
// weight bytes backward reads through every eager step (60 MiB more a decoder layer at
// llama-2048). Under torch.compile only what backward reads is saved.
c10::List<at::Tensor> kept_weight(const Fp8Weight& w, bool rows, bool cols) {
  const bool cast_again = cols && w.data_t.sym_numel() == 0;
  return c10::List<at::Tensor>(
      {rows ? w.data : at::Tensor(), cols ? w.data_t : at::Tensor(), w.scale_inv, cast_again ? w.scale : at::Tensor()});
}

// A weight's kept copies (kept_weight's list) as the Fp8Weight backward reads.
Fp8Weight kept_weight_of(const c10::List<at::Tensor>& l) {
  return Fp8Weight{l.get(0), l.get(1), l.get(2), l.get(3)};
}

// The weight's transposed copy for a data gradient: the one the caller handed, or, where it handed
// none (an empty data_t: Recipe save_weight_fp8=False), the saved weight cast at the scale its
// copies were made with (its own amax's, e4m3; weights_fp8's contract): the same bytes, from one
// pass over the weight where its amax would take a second.
at::Tensor weight_t(const Fp8Weight& w, const at::Tensor& weight) {
  if (w.data_t.defined() && w.data_t.sym_numel() != 0) return w.data_t;
  TORCH_INTERNAL_ASSERT(weight.defined() && w.scale.defined(),
                        "weight_t: no transposed copy and no saved weight and scale to make it from");
  return quantize(weight.contiguous(), std::nullopt, 0, false, kE4M3Code, w.scale, false, true, false).data_t;
}

// The slot of a delayed-scaling scale, or none (current scaling).
Opt slot(const Opt& scales, int64_t i) {
  if (!scales.has_value() || !scales->defined()) return std::nullopt;
  return scales->select(0, i);
}

void record_amax(const Opt& amax_out, int64_t i, const at::Tensor& amax) {
  if (amax_out.has_value() && amax_out->defined()) amax_out->select(0, i).copy_(amax);
}

// The scaling state an FP8 Function keeps for backward (not differentiable inputs: kept as values).
void save_scaling(AutogradContext* ctx, const Opt& scales, const Opt& amax_out) {
  ctx->saved_data["scales"] = scales.has_value() ? c10::IValue(*scales) : c10::IValue();
  ctx->saved_data["amax_out"] = amax_out.has_value() ? c10::IValue(*amax_out) : c10::IValue();
}

std::pair<Opt, Opt> saved_scaling(AutogradContext* ctx) {
  const auto opt_of = [](const c10::IValue& i) { return i.isTensor() ? Opt(i.toTensor()) : std::nullopt; };
  return {opt_of(ctx->saved_data["scales"]), opt_of(ctx->saved_data["amax_out"])};
}

// ---------------------------------------------------------------------------------------------
// The MLP

constexpr const char* kMlpOp = "fused_dense::fused_mlp_fp8";

struct Fp8MlpConfig {
  int64_t activation = 1, checkpoint_lvl = 0, grad_format = 1;
  bool save_pre_fp8 = false;
  // pre kept as its e4m3 copy: only at level 0 (levels 1 and 2 rebuild from pre or x, bit for bit)
  bool pre_in_fp8() const { return save_pre_fp8 && checkpoint_lvl == 0; }
};

// What the forward keeps (beyond weights and biases).
struct Fp8MlpSaved {
  at::Tensor x_data, x_t, x_scale_inv;  // x_data: level 2 only; x_t: x's row-major copy with x_t_rows
  at::Tensor pre;                       // keep_pre (its e4m3 copy with pre_in_fp8)
  at::Tensor pre_scale_inv;             // pre_in_fp8
  at::Tensor a_t, a_scale, a_scale_inv;  // a_t: keep_act_out; a_scale: rebuilds_act; a_scale_inv: need_act_out
  bool x_t_rows = false;                 // x_t holds x's row-major copy (x_t_from_rows)
  at::Tensor weight1, weight2;           // where its data gradient runs: the weight (weight_t)
};

// Whether backward makes the activation's FP8 copy again at the forward's scale (a_scale): level 2
// re-runs fc1 with it, level 1 rebuilds the transposed copy from pre. Level 0 keeps the copy.
bool rebuilds_act(const MlpPlan& p) { return p.recompute_fc1 || (p.need_act_out && !p.keep_act_out); }

// fc1 and the quantize of its activation as one op (fp8_linear_act, one GEMM's epilogue writing
// the activation (delayed scaling) or its amax (current) where the device allows) for the plain
// activations; the gated ones run fp8_linear and fp8_quantize.
bool fc1_one_op(const Fp8MlpConfig& c) { return !is_gated_activation(c.activation); }

at::Tensor mlp_forward(const MlpPlan& p, const Fp8MlpConfig& c, const at::Tensor& x, at::TensorList x_fp8,
                       const Fp8Weight& w1, const Opt& b1, const Fp8Weight& w2, const Opt& b2, const Opt& scales,
                       const Opt& amax_out, Fp8MlpSaved* s) {
  const auto dtype = x.scalar_type();
  // pre's e4m3 copy, written by the ops that read pre for the activation (pre_in_fp8 and kept).
  const bool pre_copy = s != nullptr && p.keep_pre && c.pre_in_fp8();
  // With pre's e4m3 copy kept, the pass over pre is the forward's peak: x's transposed copy (for
  // fc1's weight gradient) is made after it (the same bytes), unless the caller handed x's copies
  // over: from x's row-major copy where fc1 holds it through the pass anyway (fp8_linear_act),
  // else from x at x's own scale (the gated fc1 frees that copy before the pass).
  const bool x_t_after_pre = pre_copy && p.keep_act_out && p.need.w1 && x_fp8.empty();
  Q xq = input_q(x, x_fp8, slot(scales, 0), p.need.w1 && !x_t_after_pre);
  record_amax(amax_out, 0, xq.amax);
  const bool x_t_rows = s != nullptr && x_t_from_rows(x_fp8, p.need.w1);
  const at::Tensor x_rows = x_t_rows ? xq.data : at::Tensor();
  const int64_t pre_cols = w1.data.size(0);
  const Opt pre8 =
      pre_copy ? Opt(at::empty_symint({x.sym_size(0), pre_cols}, x.options().dtype(at::kFloat8_e4m3fn))) : std::nullopt;
  const Opt pre8_si = pre_copy ? Opt(at::empty({}, x.options().dtype(at::kFloat))) : std::nullopt;
  // With pre's e4m3 copy kept, the pass over pre writes pre8 and the activation's copies while pre
  // is alive: the activation's transposed copy is then made from its row-major bytes after pre is
  // freed (fp8_transpose, the same bytes), so that pass holds one FP8 copy of the activation.
  const bool a_t_after_pre = pre_copy && p.keep_act_out;
  const bool a_t_now = p.keep_act_out && !a_t_after_pre;
  at::Tensor pre;
  Q aq;
  if (fc1_one_op(c)) {
    auto [pr, d, t, sc, si, am] = op_calls::fp8_linear_act(xq.data, w1.data, xq.scale_inv, w1.scale_inv, b1, dtype,
                                                           c.activation, slot(scales, 1), a_t_now, pre8, pre8_si);
    pre = pr;
    aq = Q{d, t, sc, si, am, at::Tensor()};
  } else {
    pre = op_calls::fp8_linear(xq.data, w1.data, xq.scale_inv, w1.scale_inv, b1, dtype, true, -2);
    if (s != nullptr && !p.recompute_fc1) xq.data.reset();  // x's row-major copy has no reader left
    aq = quantize(pre, std::nullopt, c.activation, false, kE4M3Code, slot(scales, 1), true, a_t_now, false,
                  std::nullopt, pre8, pre8_si);
  }
  record_amax(amax_out, 1, aq.amax);
  if (s != nullptr) {
    s->x_data = p.recompute_fc1 ? xq.data : at::Tensor();
    s->x_t = !p.need.w1 ? at::Tensor() : x_t_rows ? x_rows : xq.data_t;
    s->x_t_rows = x_t_rows;
    s->x_scale_inv = xq.scale_inv;
    s->pre = p.keep_pre ? pre : at::Tensor();
    if (pre_copy) {
      s->pre = *pre8;
      s->pre_scale_inv = *pre8_si;
    }
    s->a_scale = rebuilds_act(p) ? aq.scale : at::Tensor();
    s->a_scale_inv = p.need_act_out ? aq.scale_inv : at::Tensor();
  }
  // What fc2 does not read is released before its output is allocated (the transient peak): x's
  // copies and pre where nothing keeps them, the activation's transposed copy where level 1 / 2
  // rebuilds it.
  const at::Tensor x_scale = xq.scale;
  at::Tensor x_rows_held = x_t_after_pre && fc1_one_op(c) ? xq.data : at::Tensor();
  xq = Q{};
  pre.reset();
  // x's transposed copy: from x's row-major FP8 bytes where fc1 held them through the pass
  // (fp8_linear_act), else cast again from x at x's scale; the same bytes either way.
  if (x_t_after_pre)
    s->x_t = x_rows_held.defined() ? op_calls::fp8_transpose(x_rows_held)
                                   : quantize(x, std::nullopt, 0, false, kE4M3Code, x_scale, false, true, false).data_t;
  x_rows_held.reset();
  if (a_t_after_pre) aq.data_t = op_calls::fp8_transpose(aq.data);
  if (s != nullptr) s->a_t = p.keep_act_out ? aq.data_t : at::Tensor();
  aq.data_t.reset();
  return op_calls::fp8_linear(aq.data, w2.data, aq.scale_inv, w2.scale_inv, b2, dtype, true, -2);
}

struct Fp8MlpGrads {
  at::Tensor x, w1, b1, w2, b2;
};

// Each temporary is released once its last reader has run, and g once it is quantized (the caller
// hands its reference over), so the step's transient peak holds as few of them at once as the
// order of the GEMMs allows. With free_saved the saved pre (or its e4m3 copy) and the activation's
// transposed copy are freed likewise (drop_saved); x's copies, which a norm may share with other
// layers, live until autograd releases them.
Fp8MlpGrads mlp_backward(const MlpPlan& p, const Fp8MlpConfig& c, at::Tensor g, const Fp8Weight& w1,
                         const Opt& b1, const Fp8Weight& w2, const at::ScalarType weight_dtype, Fp8MlpSaved s,
                         const Opt& scales, const Opt& amax_out, bool free_saved) {
  // A weight handed without its transposed copy has it made from s.weight1 / s.weight2 right
  // before its data-gradient GEMM (weight_t), so the two copies are never alive at once.
  Fp8MlpGrads r;
  const auto dtype = g.scalar_type();
  if (p.recompute_fc1 && fc1_one_op(c)) {
    // Level 2 with the forward's op and scale: the forward's pre and (transposed) activation.
    auto [pr, d, t, sc, si, am] = op_calls::fp8_linear_act(s.x_data, w1.data, s.x_scale_inv, w1.scale_inv, b1, dtype,
                                                           c.activation, s.a_scale, p.need_act_out);
    s.pre = pr;
    if (p.need_act_out) s.a_t = t;
  } else if (p.recompute_fc1) {
    s.pre = op_calls::fp8_linear(s.x_data, w1.data, s.x_scale_inv, w1.scale_inv, b1, dtype, true, -2);
  }
  if (p.need_act_out && !s.a_t.defined()) {
    // Levels 1 and 2: the forward's transposed activation, rebuilt with the forward's scale.
    s.a_t = quantize(s.pre, std::nullopt, c.activation, false, kE4M3Code, s.a_scale, false, true, false).data_t;
  }
  Q gq = quantize(g, std::nullopt, 0, false, c.grad_format, slot(scales, 2), p.need_d_pre, p.need.w2, p.need.b2);
  g.reset();
  record_amax(amax_out, 2, gq.amax);
  if (p.need.b2) r.b2 = gq.sums;
  if (p.need.w2) r.w2 = op_calls::fp8_linear(gq.data_t, s.a_t, gq.scale_inv, s.a_scale_inv, std::nullopt,
                                             weight_dtype, false, -2);
  gq.data_t.reset();
  drop_saved(s.a_t, free_saved);
  if (p.need_d_pre) {
    at::Tensor d_act = op_calls::fp8_linear(gq.data, weight_t(w2, s.weight2), gq.scale_inv, w2.scale_inv, std::nullopt,
                                            dtype, false, -2);
    gq = Q{};
    // The activation's gradient quantized row-major only, d_act and pre freed, then the transposed
    // copy made from the row-major bytes (fp8_transpose: the bytes the quantize pass would have
    // written), so the pass never holds d_act, pre and both copies at once. With pre_in_fp8, s.pre is
    // the e4m3 copy, read dequantized (pre_scale_inv) with no tensor of pre in the model's dtype, and
    // where this backward may free it, the row-major copy is written over it (fp8_quantize_grad_).
    Q dq;
    const bool pre8 = s.pre_scale_inv.defined();
    const bool in_place = pre8 && free_saved && may_write_over(s.pre);
    if (in_place) {
      auto [sc, si, am, sums] = op_calls::fp8_quantize_grad_(s.pre, d_act, c.activation, c.grad_format,
                                                             slot(scales, 3), p.need.b1, s.pre_scale_inv);
      dq = Q{s.pre.view(fp8_scalar_type(static_cast<core::Fp8Format>(c.grad_format))), at::Tensor(), sc, si, am,
             sums};
      s.pre.reset();  // its storage is dq.data's now, freed with it below (the node still holds it)
    } else {
      dq = quantize(d_act, s.pre, c.activation, true, c.grad_format, slot(scales, 3), true, false, p.need.b1,
                    pre8 ? Opt(s.pre_scale_inv) : Opt());
      drop_saved(s.pre, free_saved);
    }
    d_act.reset();
    record_amax(amax_out, 3, dq.amax);
    if (p.need.b1) r.b1 = dq.sums;
    if (p.need.w1) dq.data_t = op_calls::fp8_transpose(dq.data);
    if (p.need.x)
      r.x = op_calls::fp8_linear(dq.data, weight_t(w1, s.weight1), dq.scale_inv, w1.scale_inv, std::nullopt, dtype,
                                 false, -2);
    drop_saved(dq.data, in_place);
    if (p.need.w1) {
      const at::Tensor x_t = s.x_t_rows ? op_calls::fp8_transpose(s.x_t.contiguous()) : s.x_t;
      r.w1 = op_calls::fp8_linear(dq.data_t, x_t, dq.scale_inv, s.x_scale_inv, std::nullopt, weight_dtype, false, -2);
    }
  }
  return r;
}

struct FusedMLPFp8Function : public torch::autograd::Function<FusedMLPFp8Function> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight1, const Opt& bias1,
                            const at::Tensor& weight2, const Opt& bias2, int64_t activation, int64_t checkpoint_lvl,
                            at::TensorList weights_fp8, int64_t grad_format, const Opt& scales, const Opt& amax_out,
                            at::TensorList x_fp8, bool save_pre_fp8) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    const bool has_b1 = bias1.has_value() && bias1->defined(), has_b2 = bias2.has_value() && bias2->defined();
    size_t edge = 0;
    MlpNeeds need;
    need.x = ctx->needs_input_grad(edge++);
    need.w1 = ctx->needs_input_grad(edge++);
    need.b1 = has_b1 && ctx->needs_input_grad(edge++);
    need.w2 = ctx->needs_input_grad(edge++);
    need.b2 = has_b2 && ctx->needs_input_grad(edge++);
    const Fp8MlpConfig c{activation, checkpoint_lvl, grad_format, save_pre_fp8};
    const MlpPlan p = make_plan(activation, checkpoint_lvl, need, kMlpOp);
    const Fp8Weight w1 = fp8_weight_at(weights_fp8, 0, weight1, kMlpOp);
    const Fp8Weight w2 = fp8_weight_at(weights_fp8, 1, weight2, kMlpOp);
    Fp8MlpSaved s;
    at::Tensor out = mlp_forward(p, c, x, x_fp8, w1, bias1, w2, bias2, scales, amax_out, &s);
    ctx->saved_data["x_fp8_count"] = static_cast<int64_t>(x_fp8.size());
    ctx->saved_data["needs"] = c10::List<bool>({need.x, need.w1, need.b1, need.w2, need.b2});
    ctx->saved_data["config"] = c10::List<int64_t>({activation, checkpoint_lvl, grad_format, save_pre_fp8 ? 1 : 0});
    ctx->saved_data["x_t_rows"] = s.x_t_rows;
    ctx->saved_data["weight_dtype"] = static_cast<int64_t>(weight1.scalar_type());
    // The FP8 weight copies and the scaling state are not differentiable inputs: kept as values,
    // only those backward reads (kept_weight).
    ctx->saved_data["w1"] = kept_weight(w1, p.recompute_fc1, need.x);
    ctx->saved_data["w2"] = kept_weight(w2, false, p.need_d_pre);
    save_scaling(ctx, scales, amax_out);
    // A weight whose data gradient runs is saved as nn.Linear saves it (no copy: it is the
    // parameter), so a weight changed in place before backward is autograd's error with or without
    // its transposed FP8 copy; weight_t reads it only where no copy was handed.
    ctx->save_for_backward({p.save_b1 && has_b1 ? *bias1 : at::Tensor(), s.x_data, s.x_t, s.x_scale_inv, s.pre, s.a_t,
                            s.a_scale, s.a_scale_inv, s.pre_scale_inv, need.x ? weight1 : at::Tensor(),
                            p.need_d_pre ? weight2 : at::Tensor()});
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    TORCH_CHECK(!at::GradMode::is_enabled(), kMlpOp, ": double backward (create_graph=True) is not supported");
    // Unpacked before autograd is left below: an unpack hook may recompute the forward
    // (torch.utils.checkpoint without reentrance), which must record its own graph.
    const auto v = ctx->get_saved_variables();
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    const auto flags = ctx->saved_data["needs"].toBoolList();
    const MlpNeeds need{flags.get(0), flags.get(1), flags.get(2), flags.get(3), flags.get(4)};
    const auto cfg = ctx->saved_data["config"].toIntList();
    const Fp8MlpConfig c{cfg.get(0), cfg.get(1), cfg.get(2), cfg.get(3) != 0};
    const MlpPlan p = make_plan(c.activation, c.checkpoint_lvl, need, kMlpOp);
    const auto l1 = ctx->saved_data["w1"].toTensorList(), l2 = ctx->saved_data["w2"].toTensorList();
    const Fp8Weight w1 = kept_weight_of(l1), w2 = kept_weight_of(l2);
    const auto [scales, amax_out] = saved_scaling(ctx);
    const auto weight_dtype = static_cast<at::ScalarType>(ctx->saved_data["weight_dtype"].toInt());
    Fp8MlpSaved s{v[1], v[2], v[3], v[4], v[8], v[5], v[6], v[7]};
    s.x_t_rows = ctx->saved_data["x_t_rows"].toBool();
    s.weight1 = v[9];
    s.weight2 = v[10];
    at::Tensor g = grad_outputs[0].contiguous();
    grad_outputs[0].reset();  // g's one reference is handed to mlp_backward, which releases it when quantized
    Fp8MlpGrads r = mlp_backward(p, c, std::move(g), w1, opt(v[0]), w2, weight_dtype, std::move(s), scales, amax_out,
                                 may_free_saved());
    // One entry per forward argument, a tensor list counting one per tensor: x, weight1, bias1,
    // weight2, bias2, then activation, checkpoint_lvl, the FP8 weight tensors (kFp8WeightTensors a
    // weight), grad_format, scales, amax_out, the x_fp8 tensors and save_pre_fp8, none of which has
    // a gradient.
    variable_list grads{r.x, r.w1, r.b1, r.w2, r.b2};
    grads.resize(5 + 2 + 2 * kFp8WeightTensors + 3 + ctx->saved_data["x_fp8_count"].toInt() + 1);
    return grads;
  }
};

at::Tensor fused_mlp_fp8_forward(const at::Tensor& x, const at::Tensor& weight1, const Opt& bias1,
                                 const at::Tensor& weight2, const Opt& bias2, int64_t activation,
                                 int64_t checkpoint_lvl, at::TensorList weights_fp8, int64_t grad_format,
                                 const Opt& scales, const Opt& amax_out, at::TensorList x_fp8, bool save_pre_fp8) {
  check_mlp_fp8(x, weight1, weight2, activation, grad_format, scales, amax_out, weights_fp8);
  check_x_fp8(x, x_fp8, kMlpOp);
  const MlpPlan p = make_plan(activation, checkpoint_lvl, MlpNeeds{}, kMlpOp);
  const Fp8MlpConfig c{activation, checkpoint_lvl, grad_format, save_pre_fp8};
  return mlp_forward(p, c, x, x_fp8, fp8_weight_at(weights_fp8, 0, weight1, kMlpOp), bias1,
                     fp8_weight_at(weights_fp8, 1, weight2, kMlpOp), bias2, scales, amax_out, nullptr);
}

at::Tensor fused_mlp_fp8_autograd(const at::Tensor& x, const at::Tensor& weight1, const Opt& bias1,
                                  const at::Tensor& weight2, const Opt& bias2, int64_t activation,
                                  int64_t checkpoint_lvl, at::TensorList weights_fp8, int64_t grad_format,
                                  const Opt& scales, const Opt& amax_out, at::TensorList x_fp8, bool save_pre_fp8) {
  check_mlp_fp8(x, weight1, weight2, activation, grad_format, scales, amax_out, weights_fp8);
  check_x_fp8(x, x_fp8, kMlpOp);
  check_mlp_codes(activation, checkpoint_lvl, kMlpOp);
  const auto requires = [](const Opt& t) { return t.has_value() && t->defined() && t->requires_grad(); };
  if (!at::GradMode::is_enabled() || !(x.requires_grad() || weight1.requires_grad() || requires(bias1) ||
                                       weight2.requires_grad() || requires(bias2))) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return fused_mlp_fp8_forward(x, weight1, bias1, weight2, bias2, activation, checkpoint_lvl, weights_fp8,
                                 grad_format, scales, amax_out, x_fp8, save_pre_fp8);
  }
  return FusedMLPFp8Function::apply(x, weight1, bias1, weight2, bias2, activation, checkpoint_lvl, weights_fp8,
                                    grad_format, scales, amax_out, x_fp8, save_pre_fp8);
}

// ---------------------------------------------------------------------------------------------
// One linear layer

constexpr const char* kDenseOp = "fused_dense::fp8_dense";

struct Fp8DenseFunction : public torch::autograd::Function<Fp8DenseFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight, const Opt& bias,
                            at::TensorList weights_fp8, int64_t grad_format, const Opt& scales, const Opt& amax_out,
                            at::TensorList x_fp8) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    const bool has_b = bias.has_value() && bias->defined();
    const bool need_x = ctx->needs_input_grad(0), need_w = ctx->needs_input_grad(1);
    const bool need_b = has_b && ctx->needs_input_grad(2);
    const Fp8Weight w = fp8_weight_at(weights_fp8, 0, weight, kDenseOp);
    const Q xq = input_q(x, x_fp8, slot(scales, 0), need_w);
    record_amax(amax_out, 0, xq.amax);
    at::Tensor out = op_calls::fp8_linear(xq.data, w.data, xq.scale_inv, w.scale_inv, bias, x.scalar_type(), true, -2);
    const bool x_t_rows = x_t_from_rows(x_fp8, need_w);
    ctx->saved_data["x_t_rows"] = x_t_rows;
    ctx->saved_data["needs"] = c10::List<bool>({need_x, need_w, need_b});
    ctx->saved_data["x_fp8_count"] = static_cast<int64_t>(x_fp8.size());
    ctx->saved_data["grad_format"] = grad_format;
    ctx->saved_data["weight_dtype"] = static_cast<int64_t>(weight.scalar_type());
    ctx->saved_data["w"] = kept_weight(w, false, need_x);
    save_scaling(ctx, scales, amax_out);
    const at::Tensor x_kept = !need_w ? at::Tensor() : x_t_rows ? xq.data : xq.data_t;
    // The weight saved where the data gradient runs, as in the MLP above.
    ctx->save_for_backward({x_kept, xq.scale_inv, need_x ? weight : at::Tensor()});
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    TORCH_CHECK(!at::GradMode::is_enabled(), kDenseOp, ": double backward (create_graph=True) is not supported");
    // Unpacked before autograd is left below: an unpack hook may recompute the forward
    // (torch.utils.checkpoint without reentrance), which must record its own graph.
    const auto v = ctx->get_saved_variables();
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    const auto needs = ctx->saved_data["needs"].toBoolList();
    const bool need_x = needs.get(0), need_w = needs.get(1), need_b = needs.get(2);
    const int64_t grad_format = ctx->saved_data["grad_format"].toInt();
    const auto wl = ctx->saved_data["w"].toTensorList();
    const auto [scales, amax_out] = saved_scaling(ctx);
    const auto weight_dtype = static_cast<at::ScalarType>(ctx->saved_data["weight_dtype"].toInt());
    const at::Tensor g = grad_outputs[0].contiguous();
    const Q gq = quantize(g, std::nullopt, 0, false, grad_format, slot(scales, 1), need_x, need_w, need_b);
    record_amax(amax_out, 1, gq.amax);
    at::Tensor gx, gw, gb;
    if (need_x) {
      const Fp8Weight w = kept_weight_of(wl);
      gx = op_calls::fp8_linear(gq.data, weight_t(w, v[2]), gq.scale_inv, w.scale_inv, std::nullopt, g.scalar_type(),
                                false, -2);
    }
    if (need_w) {
      const at::Tensor x_t = ctx->saved_data["x_t_rows"].toBool() ? op_calls::fp8_transpose(v[0].contiguous()) : v[0];
      gw = op_calls::fp8_linear(gq.data_t, x_t, gq.scale_inv, v[1], std::nullopt, weight_dtype, false, -2);
    }
    if (need_b) gb = gq.sums;
    // x, weight, bias, then the FP8 weight tensors (kFp8WeightTensors), grad_format, scales,
    // amax_out and the x_fp8 tensors (no gradients)
    variable_list grads{gx, gw, gb};
    grads.resize(3 + kFp8WeightTensors + 3 + ctx->saved_data["x_fp8_count"].toInt());
    return grads;
  }
};

at::Tensor fp8_dense_forward(const at::Tensor& x, const at::Tensor& weight, const Opt& bias, at::TensorList weights_fp8,
                             int64_t grad_format, const Opt& scales, const Opt& amax_out, at::TensorList x_fp8) {
  check_fp8_dense(x, weight, grad_format, scales, amax_out, weights_fp8);
  check_x_fp8(x, x_fp8, kDenseOp);
  const Fp8Weight w = fp8_weight_at(weights_fp8, 0, weight, kDenseOp);
  const Q xq = input_q(x, x_fp8, slot(scales, 0), false);
  record_amax(amax_out, 0, xq.amax);
  return op_calls::fp8_linear(xq.data, w.data, xq.scale_inv, w.scale_inv, bias, x.scalar_type(), true, -2);
}

at::Tensor fp8_dense_autograd(const at::Tensor& x, const at::Tensor& weight, const Opt& bias, at::TensorList weights_fp8,
                              int64_t grad_format, const Opt& scales, const Opt& amax_out, at::TensorList x_fp8) {
  check_fp8_dense(x, weight, grad_format, scales, amax_out, weights_fp8);
  check_x_fp8(x, x_fp8, kDenseOp);
  const bool b_grad = bias.has_value() && bias->defined() && bias->requires_grad();
  if (!at::GradMode::is_enabled() || !(x.requires_grad() || weight.requires_grad() || b_grad)) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return fp8_dense_forward(x, weight, bias, weights_fp8, grad_format, scales, amax_out, x_fp8);
  }
  return Fp8DenseFunction::apply(x, weight, bias, weights_fp8, grad_format, scales, amax_out, x_fp8);
}

}  // namespace
}  // namespace fused_dense

TORCH_LIBRARY_IMPL(fused_dense, CompositeExplicitAutograd, m) {
  m.impl("fused_mlp_fp8", &fused_dense::fused_mlp_fp8_forward);
  m.impl("fp8_dense", &fused_dense::fp8_dense_forward);
}

TORCH_LIBRARY_IMPL(fused_dense, Autograd, m) {
  m.impl("fused_mlp_fp8", &fused_dense::fused_mlp_fp8_autograd);
  m.impl("fp8_dense", &fused_dense::fp8_dense_autograd);
}
