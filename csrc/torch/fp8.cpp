// The FP8 family: fp8_quantize (and fp8_quantize_grad_, fp8_transpose), fp8_linear, fp8_linear_act: their schemas, argument checks and the
// output allocation the kernels share (kernels: cpu/, meta/, cuda/fp8.cpp). Per-tensor scaling, the
// rule of core/common/types.h (fp8_scale_from_amax).
//
//   fp8_quantize(input [R, C], pre_act?, activation, backward, fp8_format, scale?, rowwise,
//                columnwise, column_sums, pre_scale_inv? = None)
//       -> (data [R, C] or [0], data_t [C, pad16(R)] or [0], scale [], scale_inv [], amax [],
//           column_sums [C] or [0])
//     v = input, act(input) (backward false, activation > 0) or input * act'(pre_act) (backward);
//     gated activations (4 swiglu, 5 geglu; the packed layout of core/common/types.h): v = act(g) * u
//     [R, C / 2] of the packed gu input [R, C], or in backward the packed (d_h * u * act'(g),
//     d_h * act(g)) [R, 2 C] of d_h = input [R, C] and pre_act = gu [R, 2 C];
//     q = saturate(v * scale) in e4m3 (fp8_format 0) or e5m2 (1); scale None: current scaling from
//     amax = max |v|, else delayed scaling with the given scale and amax recorded. pre_scale_inv
//     (backward only; float32 []): pre_act is float8_e4m3fn and read as
//     (pre_act.float() * pre_scale_inv).to(input's dtype), what an MLP saved with save_pre_fp8.
//     input_fp8 (float8_e4m3fn, input's shape) with input_scale_inv (float32 []), forward with an
//     activation only: written with input's own e4m3 copy at input's own amax (current scaling
//     whatever `scale`) and its scale_inv, the bytes of fp8_quantize(input, None, 0, False, 0, None,
//     True, False, False), from the same passes (what an MLP keeps with save_pre_fp8).
//   fp8_quantize_grad_(pre_act [R, C'], input, activation, fp8_format, scale?, column_sums,
//                      pre_scale_inv) -> (scale [], scale_inv [], amax [], column_sums [C'] or [0])
//     the backward fp8_quantize(input, pre_act, activation, True, fp8_format, scale, True, False,
//     column_sums, pre_scale_inv) with its data written over pre_act (float8_e4m3fn, the e4m3 copy
//     an MLP saved, which nothing reads after it): pre_act's bytes are then data's, in fp8_format
//     (view them as that dtype). The gradient of an activation quantized without a second tensor
//     of its size.
//   fp8_transpose(data [R, C]) -> data_t [C, pad16(R)]
//     the byte transpose of FP8 data (e4m3 or e5m2, C a multiple of 16), the padding columns zeros:
//     fp8_quantize's data_t of the values whose data is `data` (per-tensor scaling), made after the
//     high-precision source is gone.
//   fp8_scales(value [], delayed, fp8_format) -> (scale [], scale_inv [])
//     the scale and scale_inv fp8_quantize returns for a tensor of amax `value` (current scaling)
//     or, delayed, at the scale `value`, without the pass. For a
//     quantization written in PyTorch ops (fused_dense.fp8's traced_quantize), whose own divisions
//     would round otherwise under torch.compile (Inductor's Triton division is not correctly
//     rounded; Python's 448 / amax is a reciprocal and a product).
//   fp8_linear(input [B, K], weight [N, K], input_scale_inv [], weight_scale_inv [], bias [N]?,
//              out_dtype, fast_accum, heuristic) -> out [B, N]
//     out = (input . weight^T) * input_scale_inv * weight_scale_inv + bias, FP8 operands (not both
//     e5m2), K and N multiples of 16 (K 0: the empty sum, out = bias or zeros: a weight gradient
//     over no tokens).
//   fp8_linear_act(input [B, K], weight [N, K], input_scale_inv [], weight_scale_inv [], bias [N]?,
//                  out_dtype, activation, scale []?, columnwise)
//       -> (pre [B, N], data [B, N], data_t [N, pad16(B)] or [0], scale [], scale_inv [], amax [])
//     an MLP's fc1 forward: pre = fp8_linear(..., fast_accum) and fp8_quantize(pre, activation
//     1-3, e4m3, scale, rowwise, columnwise) of it, in one op; input and weight e4m3; scale None:
//     current scaling. pre_fp8 ([B, N] float8_e4m3fn) with pre_scale_inv (float32 []): written
//     as fp8_quantize's input_fp8 / input_scale_inv of pre. Where it can (core/cutlass_sm90/cutlass_sm90_fp8.h) the CUDA kernel runs both in one GEMM
//     (delayed scaling) or one GEMM that records the amax of act(pre) and one cast pass (current
//     scaling), else the two ops' kernels; the bytes of data / data_t and the amax are
//     fp8_quantize's of pre either way.
#include "torch/fp8.h"

#include <c10/util/Exception.h>
#include <torch/library.h>

#include "torch/autograd/guard.h"

namespace fused_dense {

namespace {

bool is_fp8(at::ScalarType t) { return t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2; }

void check_scalar_float(const at::Tensor& t, const at::Tensor& like, const char* op, const char* name) {
  TORCH_CHECK_VALUE(t.scalar_type() == at::kFloat, op, ": ", name, " must be float32, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.sym_numel() == 1, op, ": ", name, " must hold one element, got shape ", t.sym_sizes());
  TORCH_CHECK_VALUE(t.device() == like.device(), op, ": ", name, " must be on ", like.device(), " (the input's device), got ",
                    t.device());
}

}  // namespace

void check_e4m3_copy(const char* op, const char* name, const char* scale_inv_name,
                     const std::optional<at::Tensor>& copy, const std::optional<at::Tensor>& scale_inv,
                     c10::SymIntArrayRef shape, const at::Tensor& like) {
  const bool has_copy = copy.has_value() && copy->defined();
  const bool has_si = scale_inv.has_value() && scale_inv->defined();
  TORCH_CHECK_VALUE(has_copy == has_si, op, ": ", name, " and ", scale_inv_name, " go together: pass both or neither, "
                    "got ", has_copy ? "" : "no ", name, " and ", has_si ? "" : "no ", scale_inv_name);
  if (!has_copy) return;
  TORCH_CHECK_VALUE(copy->scalar_type() == at::kFloat8_e4m3fn, op, ": ", name, " must be float8_e4m3fn, got ",
                    copy->scalar_type());
  TORCH_CHECK_VALUE(copy->sym_sizes() == shape, op, ": ", name, " must have shape ", shape, ", got ",
                    copy->sym_sizes());
  TORCH_CHECK_VALUE(copy->device() == like.device(), op, ": ", name, " must be on ", like.device(), ", got ",
                    copy->device());
  TORCH_CHECK_VALUE(copy->is_contiguous(), op, ": ", name, " must be contiguous, got strides ", copy->sym_strides());
  check_scalar_float(*scale_inv, like, op, scale_inv_name);
}

core::Fp8Format fp8_format_of(int64_t code, const char* op, const char* name) {
  TORCH_CHECK_VALUE(code >= 0 && code < core::kFp8FormatCount, op, ": ", name, " must be 0 (e4m3) or 1 (e5m2), got ", code);
  return static_cast<core::Fp8Format>(code);
}

at::ScalarType fp8_scalar_type(core::Fp8Format f) {
  return f == core::Fp8Format::kE4M3 ? at::kFloat8_e4m3fn : at::kFloat8_e5m2;
}

core::Fp8Format fp8_format_of_dtype(at::ScalarType t) {
  return t == at::kFloat8_e4m3fn ? core::Fp8Format::kE4M3 : core::Fp8Format::kE5M2;
}

void check_fp8_quantize(const at::Tensor& input, const std::optional<at::Tensor>& pre_act, int64_t activation,
                        bool backward, int64_t fp8_format, const std::optional<at::Tensor>& scale,
                        const std::optional<at::Tensor>& pre_scale_inv, const std::optional<at::Tensor>& input_fp8,
                        const std::optional<at::Tensor>& input_scale_inv) {
  constexpr const char* op = "fused_dense::fp8_quantize";
  TORCH_CHECK_VALUE(input.dim() == 2, op, ": input must be 2-D [rows, cols], got shape ", input.sym_sizes());
  const auto t = input.scalar_type();
  TORCH_CHECK_VALUE(t == at::kHalf || t == at::kBFloat16 || t == at::kFloat, op,
                    ": input must be float16, bfloat16 or float32, got ", t);
  TORCH_CHECK_VALUE(input.is_contiguous(), op, ": input must be contiguous, got strides ", input.sym_strides());
  check_activation_in(op, activation, kNoActivation, kLastActivation);
  const bool gated = is_gated_activation(activation);
  if (gated && !backward) {
    TORCH_CHECK_VALUE(input.sym_size(1) % 16 == 0, op, ": a gated forward's input is the packed gu [rows, 2 hidden]; "
                      "input.size(1) must be a multiple of 16 (hidden a multiple of 8), got ", input.sym_size(1));
  } else {
    TORCH_CHECK_VALUE(input.sym_size(1) % 8 == 0, op, ": input.size(1) (cols) must be a multiple of 8, got ",
                      input.sym_size(1));
  }
  fp8_format_of(fp8_format, op, "fp8_format");
  const bool has_pre = pre_act.has_value() && pre_act->defined();
  const bool pre8 = pre_scale_inv.has_value() && pre_scale_inv->defined();
  TORCH_CHECK_VALUE(!pre8 || backward, op, ": pre_scale_inv (an e4m3 pre_act) is read only with backward=True");
  if (backward) {
    TORCH_CHECK_VALUE(activation != kNoActivation, op, ": backward=True needs an activation (",
                      activation_choices(kNoActivation + 1, kLastActivation), "), got 0 (none)");
    TORCH_CHECK_VALUE(has_pre, op, ": backward=True needs pre_act (the activation's input), got None");
    if (gated) {
      TORCH_CHECK_VALUE(pre_act->dim() == 2 && pre_act->sym_size(0) == input.sym_size(0) &&
                            pre_act->sym_size(1) == 2 * input.sym_size(1),
                        op, ": a gated backward's pre_act must be the packed gu [", input.sym_size(0), ", ",
                        2 * input.sym_size(1), "] of input d_h ", input.sym_sizes(), ", got ", pre_act->sym_sizes());
    } else {
      TORCH_CHECK_VALUE(pre_act->sym_sizes() == input.sym_sizes(), op, ": pre_act must have input's shape ",
                        input.sym_sizes(), ", got ", pre_act->sym_sizes());
    }
    if (pre8) {
      TORCH_CHECK_VALUE(pre_act->scalar_type() == at::kFloat8_e4m3fn, op,
                        ": with pre_scale_inv, pre_act must be float8_e4m3fn, got ", pre_act->scalar_type());
      check_scalar_float(*pre_scale_inv, input, op, "pre_scale_inv");
    } else {
      TORCH_CHECK_VALUE(pre_act->scalar_type() == t, op, ": pre_act must have input's dtype ", t,
                        " (or be float8_e4m3fn with pre_scale_inv), got ", pre_act->scalar_type());
    }
    TORCH_CHECK_VALUE(pre_act->device() == input.device(), op, ": pre_act must be on ", input.device(), ", got ",
                      pre_act->device());
    TORCH_CHECK_VALUE(pre_act->is_contiguous(), op, ": pre_act must be contiguous, got strides ",
                      pre_act->sym_strides());
  } else {
    TORCH_CHECK_VALUE(!has_pre, op, ": pre_act is read only with backward=True; for the forward, input is the "
                      "pre-activation");
  }
  if (scale.has_value() && scale->defined()) check_scalar_float(*scale, input, op, "scale");
  if (input_fp8.has_value() && input_fp8->defined())
    TORCH_CHECK_VALUE(!backward && activation != kNoActivation, op, ": input_fp8 (the input's e4m3 copy) is written "
                      "by the forward with an activation (backward=False, activation > 0), got backward=",
                      backward ? "True" : "False", ", activation ", activation);
  check_e4m3_copy(op, "input_fp8", "input_scale_inv", input_fp8, input_scale_inv, input.sym_sizes(), input);
}

// A general FP8 GEMM: either operand may carry the token count (the weight gradient's do), so
// every size is read symbolically.
void check_fp8_linear(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& input_scale_inv,
                      const at::Tensor& weight_scale_inv, const std::optional<at::Tensor>& bias,
                      at::ScalarType out_dtype, const char* op) {
  TORCH_CHECK_VALUE(input.dim() == 2 && weight.dim() == 2, op,
                    ": input and weight must be 2-D ([batch, in_features], [out_features, in_features]), got shapes ",
                    input.sym_sizes(), " and ", weight.sym_sizes());
  TORCH_CHECK_VALUE(is_fp8(input.scalar_type()), op, ": input must be float8_e4m3fn or float8_e5m2, got ",
                    input.scalar_type());
  TORCH_CHECK_VALUE(is_fp8(weight.scalar_type()), op, ": weight must be float8_e4m3fn or float8_e5m2, got ",
                    weight.scalar_type());
  TORCH_CHECK_VALUE(!(input.scalar_type() == at::kFloat8_e5m2 && weight.scalar_type() == at::kFloat8_e5m2), op,
                    ": input and weight cannot both be float8_e5m2 (no FP8 GEMM takes two e5m2 operands)");
  TORCH_CHECK_VALUE(weight.sym_size(1) == input.sym_size(1), op,
                    ": weight.size(1) must equal input.size(1) = ", input.sym_size(1),
                    " (in_features), got weight shape ", weight.sym_sizes());
  // in_features 0 (a weight gradient over no tokens) is the empty sum: out = bias, or zeros.
  TORCH_CHECK_VALUE(input.sym_size(1) % 16 == 0, op, ": in_features must be a multiple of 16, got ", input.sym_size(1));
  TORCH_CHECK_VALUE(weight.sym_size(0) % 16 == 0, op, ": out_features (weight.size(0)) must be a multiple of 16, got ",
                    weight.sym_size(0));
  TORCH_CHECK_VALUE(input.is_contiguous() && weight.is_contiguous(), op,
                    ": input and weight must be contiguous (K-major), got strides ", input.sym_strides(), " and ",
                    weight.sym_strides());
  TORCH_CHECK_VALUE(weight.device() == input.device(), op, ": weight must be on ", input.device(), ", got ",
                    weight.device());
  TORCH_CHECK_VALUE(out_dtype == at::kHalf || out_dtype == at::kBFloat16 || out_dtype == at::kFloat, op,
                    ": out_dtype must be float16, bfloat16 or float32, got ", out_dtype);
  check_scalar_float(input_scale_inv, input, op, "input_scale_inv");
  check_scalar_float(weight_scale_inv, input, op, "weight_scale_inv");
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->sym_size(0) == weight.sym_size(0), op, ": bias must be 1-D of length ",
                      weight.sym_size(0), " (out_features), got shape ", bias->sym_sizes());
    TORCH_CHECK_VALUE(bias->scalar_type() == out_dtype, op, ": bias must have out_dtype ", out_dtype, ", got ",
                      bias->scalar_type());
    TORCH_CHECK_VALUE(bias->device() == input.device() && bias->is_contiguous(), op, ": bias must be contiguous on ",
                      input.device());
  }
}

void check_fp8_linear_act(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& input_scale_inv,
                          const at::Tensor& weight_scale_inv, const std::optional<at::Tensor>& bias,
                          at::ScalarType out_dtype, int64_t activation, const std::optional<at::Tensor>& scale,
                          const std::optional<at::Tensor>& pre_fp8, const std::optional<at::Tensor>& pre_scale_inv) {
  constexpr const char* op = "fused_dense::fp8_linear_act";
  check_fp8_linear(input, weight, input_scale_inv, weight_scale_inv, bias, out_dtype, op);
  TORCH_CHECK_VALUE(input.scalar_type() == at::kFloat8_e4m3fn && weight.scalar_type() == at::kFloat8_e4m3fn, op,
                    ": input and weight must be float8_e4m3fn (the forward's format), got ", input.scalar_type(),
                    " and ", weight.scalar_type());
  check_activation_in(op, activation, kNoActivation + 1, kLastPlainActivation,
                      "; the gated MLPs use fp8_linear and fp8_quantize");
  if (scale.has_value() && scale->defined()) check_scalar_float(*scale, input, op, "scale");
  check_e4m3_copy(op, "pre_fp8", "pre_scale_inv", pre_fp8, pre_scale_inv, {input.sym_size(0), weight.size(0)}, input);
}

Fp8LinearActResult empty_fp8_linear_act(const at::Tensor& input, const at::Tensor& weight, at::ScalarType out_dtype,
                                        bool columnwise) {
  const c10::SymInt B = input.sym_size(0);
  const int64_t N = weight.size(0);
  const auto f8 = input.options().dtype(at::kFloat8_e4m3fn);
  const auto f32 = input.options().dtype(at::kFloat);
  return {at::empty_symint({B, N}, input.options().dtype(out_dtype)),
          at::empty_symint({B, N}, f8),
          columnwise ? at::empty_symint({N, core::fp8_padded_rows(B)}, f8) : at::empty({0}, f8),
          at::empty({}, f32),
          at::empty({}, f32),
          at::empty({}, f32)};
}

void check_fp8_quantize_grad_(const at::Tensor& pre_act, const at::Tensor& input, int64_t activation,
                              int64_t fp8_format, const std::optional<at::Tensor>& scale,
                              const at::Tensor& pre_scale_inv) {
  constexpr const char* op = "fused_dense::fp8_quantize_grad_";
  TORCH_CHECK_VALUE(pre_scale_inv.defined(), op, ": pre_scale_inv (pre_act's e4m3 scale_inv) is required");
  TORCH_CHECK_VALUE(pre_act.scalar_type() == at::kFloat8_e4m3fn, op,
                    ": pre_act must be float8_e4m3fn (the gradient is written over an e4m3 copy), got ",
                    pre_act.scalar_type());
  TORCH_CHECK_VALUE(!pre_act.is_alias_of(input), op,
                    ": pre_act is overwritten with the quantized gradient, so it must not share memory with input");
  check_fp8_quantize(input, pre_act, activation, true, fp8_format, scale, pre_scale_inv);
}

void check_fp8_transpose(const at::Tensor& data) {
  constexpr const char* op = "fused_dense::fp8_transpose";
  TORCH_CHECK_VALUE(data.dim() == 2, op, ": data must be 2-D [rows, cols], got shape ", data.sym_sizes());
  TORCH_CHECK_VALUE(is_fp8(data.scalar_type()), op, ": data must be float8_e4m3fn or float8_e5m2, got ",
                    data.scalar_type());
  TORCH_CHECK_VALUE(data.is_contiguous(), op, ": data must be contiguous, got strides ", data.sym_strides());
  TORCH_CHECK_VALUE(data.sym_size(1) % 16 == 0, op, ": data.size(1) (cols) must be a multiple of 16, got ",
                    data.sym_size(1));
}

core::Fp8Format check_fp8_scales(const at::Tensor& value, bool delayed, int64_t fp8_format) {
  constexpr const char* op = "fused_dense::fp8_scales";
  const char* name = delayed ? "value (the scale, delayed=True)" : "value (the amax, delayed=False)";
  TORCH_CHECK_VALUE(value.scalar_type() == at::kFloat, op, ": ", name, " must be float32, got ", value.scalar_type());
  TORCH_CHECK_VALUE(value.sym_numel() == 1, op, ": ", name, " must hold one element, got shape ", value.sym_sizes());
  return fp8_format_of(fp8_format, op, "fp8_format");
}

Fp8QuantizeGradResult empty_fp8_quantize_grad(const at::Tensor& input, int64_t activation, bool column_sums) {
  const int64_t C = fp8_quantized_cols(input, activation, true);
  const auto f32 = input.options().dtype(at::kFloat);
  return {at::empty({}, f32), at::empty({}, f32), at::empty({}, f32),
          column_sums ? at::empty({C}, input.options()) : at::empty({0}, input.options())};
}

int64_t fp8_quantized_cols(const at::Tensor& input, int64_t activation, bool backward) {
  const int64_t cols = width_of(input, 1);
  if (!is_gated_activation(activation)) return cols;
  return backward ? 2 * cols : cols / 2;
}

Fp8QuantizeResult empty_fp8_quantize(const at::Tensor& input, int64_t cols, int64_t fp8_format, bool rowwise,
                                     bool columnwise, bool column_sums) {
  const c10::SymInt R = input.sym_size(0);
  const int64_t C = cols;
  const auto fp8 = fp8_scalar_type(static_cast<core::Fp8Format>(fp8_format));
  const auto f8 = input.options().dtype(fp8);
  const auto f32 = input.options().dtype(at::kFloat);
  return {rowwise ? at::empty_symint({R, C}, f8) : at::empty({0}, f8),
          columnwise ? at::empty_symint({C, core::fp8_padded_rows(R)}, f8) : at::empty({0}, f8),
          at::empty({}, f32),
          at::empty({}, f32),
          at::empty({}, f32),
          column_sums ? at::empty({C}, input.options()) : at::empty({0}, input.options())};
}

}  // namespace fused_dense

TORCH_LIBRARY_FRAGMENT(fused_dense, m) {
  using fused_dense::def_raw_op;
  def_raw_op(m, "fp8_quantize(Tensor input, Tensor? pre_act, int activation, bool backward, int fp8_format, Tensor? scale, "
             "bool rowwise, bool columnwise, bool column_sums, Tensor? pre_scale_inv=None, "
             "Tensor(a!)? input_fp8=None, Tensor(b!)? input_scale_inv=None) "
             "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  def_raw_op(m, "fp8_quantize_grad_(Tensor(a!) pre_act, Tensor input, int activation, int fp8_format, Tensor? scale, "
             "bool column_sums, Tensor pre_scale_inv) -> (Tensor, Tensor, Tensor, Tensor)");
  def_raw_op(m, "fp8_transpose(Tensor data) -> Tensor");
  def_raw_op(m, "fp8_scales(Tensor value, bool delayed, int fp8_format) -> (Tensor, Tensor)");
  def_raw_op(m, "fp8_linear(Tensor input, Tensor weight, Tensor input_scale_inv, Tensor weight_scale_inv, Tensor? bias, "
             "ScalarType out_dtype, bool fast_accum, int heuristic) -> Tensor");
  def_raw_op(m, "fp8_linear_act(Tensor input, Tensor weight, Tensor input_scale_inv, Tensor weight_scale_inv, Tensor? bias, "
             "ScalarType out_dtype, int activation, Tensor? scale, bool columnwise, "
             "Tensor(a!)? pre_fp8=None, Tensor(b!)? pre_scale_inv=None) "
             "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
}
