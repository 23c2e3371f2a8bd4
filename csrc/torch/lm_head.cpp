// The LM head family: linear + cross-entropy without materialising the logits. Schemas, argument
// checks and the chunk loop every backend runs (kernels: cpu/, meta/, cuda/lm_head.cpp; the
// autograd: autograd/lm_head.cpp).
//
//   linear_cross_entropy(input [..., d], weight [V, d], bias [V]?, target [...] int64,
//                        ignore_index, label_smoothing, z_loss, softcap, reduction, divisor?,
//                        chunk_size, fp8) -> loss
//     the loss of cross_entropy(softcap(input . weight^T + bias), target) as
//     core/elementwise/elementwise.h (cross_entropy_rows) defines it per row; reduction 0 none
//     (float32 [...], 0 at ignored rows), 1 mean (over the rows whose target is not
//     ignore_index), 2 sum, or with divisor (one number) the sum divided by it. float32 (float64
//     for float64 input, as the lse below and the fp32 sums of the bias gradient).
//   linear_cross_entropy_forward(input [N, d], weight, bias?, target [N], ..., chunk_size,
//                                grads bool[3], fp8) -> (loss, lse [N] float32, grad_input [N, d] or [0],
//                                grad_weight [V, d] or [0], grad_bias [V] or [0])
//     the loss, each row's log-sum-exp and, for grads (input, weight, bias), the gradients of the
//     loss itself (incoming gradient 1) computed during the forward.
//   linear_cross_entropy_backward(grad_loss, input, weight, bias?, target, lse, ..., grads, fp8)
//       -> (grad_input, grad_weight, grad_bias)
//     the gradients for the incoming grad_loss (the loss's shape), the logits recomputed.
//   linear_cross_entropy_scale_grads_(grads Tensor[], grad_loss []) -> ()
//     each of grads becomes t * grad_loss in place, in fp32 (fp64 for float64) rounded once to t's
//     dtype (lce_scale_reference; PyTorch's t.mul_ on CUDA would round grad_loss to bf16 first);
//     on CUDA one kernel a tensor that reads grad_loss on the device and does nothing when it is 1
//     (the common loss.backward()): the backward of the mean and the sum, whose gradients the
//     forward made.
//
// The tokens go in chunks of lce_chunk_rows: each chunk's logits [c, V] are one GEMM, the rows
// kernel turns them into the loss and the gradient in place, and two GEMMs take the input's and
// the weight's gradients from it (the weight's accumulated in its own dtype, one rounding a
// chunk); only one chunk of logits exists at a time.
//
// fp8 (off by default): the logits' GEMM and the input gradient's run in FP8 through the fp8
// family's ops, per-tensor current scaling: x and the weight quantized once a call (e4m3, each at
// its own amax; the weight's transposed copy too when the input needs a gradient), each chunk's
// logits fp8_linear(x_q, W_q) (+ bias) in the model's dtype with the forward's fast accumulation,
// each chunk's logits' gradient quantized at its own amax (e5m2) and the input's gradient
// fp8_linear(g_q, W_q^T) with the precise one. The weight's gradient stays g^T . x in the model's
// dtype. Needs d and vocab multiples of 16 and a 16- or 32-bit float input; the weight's two FP8
// copies (2 . vocab . d bytes) live through the call.
#include "torch/lm_head.h"

#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>

#include "core/common/types.h"
#include "torch/autograd/guard.h"
#include "torch/autograd/op_calls.h"
#include "torch/checks.h"
#include "torch/fp8.h"

namespace fused_dense {

namespace {

// The chunk rule. The weight gradient's accumulation reads and writes [V, d] once a chunk, so
// its memory traffic per GEMM flop falls as 1 / rows, whatever V and d: the rows of a chunk, not
// its bytes, set the time. A chunk's logits [rows, V] in the input's dtype are rows / d of the
// weight gradient's bytes. The rule takes the largest power of two of rows (at least
// kMinChunkRows; rows that are not a power of two gained nothing: 896 ran as slowly as 512 on the
// H200) whose logits fit the larger of two allowances: a quarter of the weight gradient the step
// holds anyway (d / kChunkRowsPerD rows: 1,024 at d 4096, where 2,048 would be 1.39x the peak of
// Liger's 256-row chunks at vocab 128,256), and kChunkBytesFloor, which gives small vocabularies,
// whose whole head is light, more rows (4,096 at vocab 32,000: Hugging Face + torch.compile's time
// on an H100, where d / 4 rows took up to 1.27x and 2,048 up to 1.05x; 1,024 at d 2048 and vocab
// 128,256: 0.99x it, where 512 took 1.11x).
// Measurements: docs/performance.md, "The LM head and its loss".
constexpr int64_t kChunkRowsPerD = 4;
constexpr int64_t kMinChunkRows = 256;
constexpr int64_t kChunkBytesFloor = int64_t{256} << 20;

void logits_into(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight_t, const std::optional<at::Tensor>& bias) {
  if (bias.has_value() && bias->defined()) {
    at::addmm_out(out, *bias, x, weight_t);
  } else {
    at::mm_out(out, x, weight_t);
  }
}

// The gradient scale every row shares: 1 / (rows counted) for the mean, 1 / divisor, else 1.
at::Tensor base_scale(const at::Tensor& target, const LceOptions& opts, const std::optional<at::Tensor>& divisor,
                      const at::TensorOptions& f32) {
  if (divisor.has_value() && divisor->defined()) return at::reciprocal(divisor->to(f32).reshape({}));
  if (opts.reduction == kReduceMean) return at::reciprocal(target.ne(opts.ignore_index).sum().to(f32.dtype()));
  return at::ones({}, f32);
}

// The FP8 operands of a call with fp8 (the header comment): x's and the weight's e4m3 copies and
// the weight's transposed copy [d, V] (when the input needs a gradient).
struct Fp8Operands {
  at::Tensor x, x_scale_inv, w, w_t, w_scale_inv;
};

Fp8Operands fp8_operands(const at::Tensor& input, const at::Tensor& weight, bool grad_input) {
  auto [xd, xt, xs, xsi, xa, xc] =
      op_calls::fp8_quantize(input, std::nullopt, 0, false, kE4M3Code, std::nullopt, true, false, false);
  auto [wd, wt, ws, wsi, wa, wc] =
      op_calls::fp8_quantize(weight, std::nullopt, 0, false, kE4M3Code, std::nullopt, true, grad_input, false);
  return {xd, xsi, wd, wt, wsi};
}

// One chunk's logits [c, V] from the FP8 copies, in the model's dtype.
at::Tensor fp8_logits(const Fp8Operands& q, int64_t start, int64_t c, const std::optional<at::Tensor>& bias,
                      at::ScalarType dtype) {
  return op_calls::fp8_linear(q.x.narrow(0, start, c), q.w, q.x_scale_inv, q.w_scale_inv, bias, dtype, true,
                              core::kHeuristicAuto);
}

// The gradients of one chunk from its logits' gradient g [c, V]; k: the chunk's index; q: the FP8
// operands (fp8) or null.
void accumulate_grads(const at::Tensor& g, const at::Tensor& x, const at::Tensor& weight, const Fp8Operands* q,
                      int64_t start, int64_t k, at::Tensor& grad_input, at::Tensor& grad_weight,
                      at::Tensor& bias_sums) {
  if (grad_input.numel() > 0) {
    at::Tensor rows = grad_input.narrow(0, start, x.size(0));
    if (q == nullptr) {
      at::mm_out(rows, g, weight);
    } else {
      auto [gd, gt, gs, gsi, ga, gc] =
          op_calls::fp8_quantize(g, std::nullopt, 0, false, kE5M2Code, std::nullopt, true, false, false);
      rows.copy_(op_calls::fp8_linear(gd, q->w_t, gsi, q->w_scale_inv, std::nullopt, g.scalar_type(), false,
                                      core::kHeuristicAuto));
    }
  }
  if (grad_weight.numel() > 0) {
    if (k == 0) {
      at::mm_out(grad_weight, g.t(), x);
    } else {
      grad_weight.addmm_(g.t(), x);
    }
  }
  if (bias_sums.defined()) bias_sums.add_(at::sum(g, {0}, false, bias_sums.scalar_type()));
}

at::Tensor empty_grad_input(const at::Tensor& input, bool need) {
  return need ? at::empty_symint(input.sym_sizes(), input.options()) : at::empty({0}, input.options());
}

at::Tensor empty_grad_weight(const at::Tensor& weight, bool need, bool zero) {
  if (!need) return at::empty({0}, weight.options());
  return zero ? at::zeros(weight.sizes(), weight.options()) : at::empty(weight.sizes(), weight.options());
}

at::Tensor grad_bias_of(const at::Tensor& sums, const std::optional<at::Tensor>& bias, const at::Tensor& input) {
  if (!sums.defined()) return at::empty({0}, input.options());
  return sums.to(bias->scalar_type());
}

}  // namespace

void check_linear_cross_entropy(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                                const at::Tensor& target, const LceOptions& opts,
                                const std::optional<at::Tensor>& divisor, int64_t chunk_size, const char* op) {
  TORCH_CHECK_VALUE(input.dim() == 2, op, ": input must be 2-D [tokens, d], got shape ", input.sym_sizes());
  check_float(op, "input", input);
  const int64_t d = width_of(input, 1);
  TORCH_CHECK_VALUE(weight.dim() == 2 && weight.size(1) == d, op,
                    ": weight must be [vocab, d] with d = input.size(1) = ", d, ", got shape ", weight.sizes());
  TORCH_CHECK_VALUE(weight.size(0) > 0, op, ": weight must have at least one row (the vocabulary), got shape ",
                    weight.sizes());
  check_same(op, "weight", weight, "input", input);
  TORCH_CHECK_VALUE(input.is_contiguous() && weight.is_contiguous(), op,
                    ": input and weight must be contiguous, got strides ", input.sym_strides(), " and ",
                    weight.strides());
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == weight.size(0), op, ": bias must be [vocab] = [",
                      weight.size(0), "], got shape ", bias->sizes());
    check_same(op, "bias", *bias, "input", input);
    TORCH_CHECK_VALUE(bias->is_contiguous(), op, ": bias must be contiguous, got strides ", bias->strides());
  }
  TORCH_CHECK_VALUE(target.scalar_type() == at::kLong, op, ": target must be int64 (class indices), got ",
                    target.scalar_type());
  TORCH_CHECK_VALUE(target.dim() == 1 && target.sym_size(0) == input.sym_size(0), op, ": target must be [tokens] = [",
                    input.sym_size(0), "] (one class index a row of input), got shape ", target.sym_sizes());
  check_same_device(op, "target", target, "input", input);
  TORCH_CHECK_VALUE(target.is_contiguous(), op, ": target must be contiguous, got strides ", target.sym_strides());
  TORCH_CHECK_VALUE(opts.reduction >= kReduceNone && opts.reduction <= kReduceSum, op,
                    ": reduction must be 0 (none), 1 (mean) or 2 (sum), got ", opts.reduction);
  TORCH_CHECK_VALUE(opts.label_smoothing >= 0.0 && opts.label_smoothing <= 1.0, op,
                    ": label_smoothing must be in [0, 1], got ", opts.label_smoothing);
  TORCH_CHECK_VALUE(opts.z_loss >= 0.0 && std::isfinite(opts.z_loss), op, ": z_loss must be finite and >= 0, got ",
                    opts.z_loss);
  TORCH_CHECK_VALUE(opts.softcap >= 0.0 && std::isfinite(opts.softcap), op,
                    ": softcap must be finite and >= 0 (0: none), got ", opts.softcap);
  TORCH_CHECK_VALUE(chunk_size >= 0, op, ": chunk_size must be >= 0 (0: the library's rule), got ", chunk_size);
  if (opts.fp8) {
    const auto t = input.scalar_type();
    TORCH_CHECK_VALUE(t == at::kHalf || t == at::kBFloat16 || t == at::kFloat, op,
                      ": fp8 needs a float16, bfloat16 or float32 input (the FP8 GEMMs' output dtypes), got ", t);
    TORCH_CHECK_VALUE(d % 16 == 0, op, ": fp8 needs d (input.size(1)) a multiple of 16 (the FP8 GEMM's K), got ", d);
    TORCH_CHECK_VALUE(weight.size(0) % 16 == 0, op, ": fp8 needs the vocabulary (weight.size(0)) a multiple of 16 "
                      "(the FP8 GEMMs' N and K; pad the embedding), got ", weight.size(0));
  }
  if (divisor.has_value() && divisor->defined()) {
    TORCH_CHECK_VALUE(opts.reduction == kReduceSum, op, ": divisor divides the sum; it needs reduction 2 (sum), got ",
                      opts.reduction);
    TORCH_CHECK_VALUE(divisor->numel() == 1, op, ": divisor must hold one number, got shape ", divisor->sizes());
    check_same_device(op, "divisor", *divisor, "input", input);
  }
}

LceOptions checked_lce_options(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                               const at::Tensor& target, int64_t ignore_index, double label_smoothing, double z_loss,
                               double softcap, int64_t reduction, const std::optional<at::Tensor>& divisor,
                               int64_t chunk_size, bool fp8, const at::Tensor* grad_loss, const at::Tensor* lse) {
  const char* op = grad_loss == nullptr ? "fused_dense::linear_cross_entropy_forward"
                                        : "fused_dense::linear_cross_entropy_backward";
  const LceOptions opts{ignore_index, label_smoothing, z_loss, softcap, reduction, fp8};
  check_linear_cross_entropy(input, weight, bias, target, opts, divisor, chunk_size, op);
  if (grad_loss != nullptr) check_lce_backward(*grad_loss, *lse, input, reduction, op);
  return opts;
}

void check_lce_backward(const at::Tensor& grad_loss, const at::Tensor& lse, const at::Tensor& input,
                        int64_t reduction, const char* op) {
  const c10::SymInt N = input.sym_size(0);
  if (reduction == kReduceNone) {
    TORCH_CHECK_VALUE(grad_loss.dim() == 1 && grad_loss.sym_size(0) == N, op, ": grad_loss must be [tokens] = [", N,
                      "] (reduction none), got shape ", grad_loss.sym_sizes());
  } else {
    TORCH_CHECK_VALUE(grad_loss.sym_numel() == 1, op,
                      ": grad_loss must hold one number (the reduced loss's "
                      "gradient), got shape ",
                      grad_loss.sym_sizes());
  }
  check_same_device(op, "grad_loss", grad_loss, "input", input);
  TORCH_CHECK_VALUE(lse.scalar_type() == float_math_dtype(input) && lse.dim() == 1 && lse.sym_size(0) == N, op,
                    ": lse must be ", float_math_dtype(input), " [tokens] = [", N, "] (the forward's), got ",
                    lse.scalar_type(), " ", lse.sym_sizes());
  check_same_device(op, "lse", lse, "input", input);
}

void check_targets_in_range(const at::Tensor& target, int64_t vocab, int64_t ignore_index, const char* op) {
  if (target.numel() == 0) return;
  const at::Tensor bad = target.ne(ignore_index).logical_and(target.lt(0).logical_or(target.ge(vocab)));
  if (!bad.any().item<bool>()) return;
  const int64_t row = bad.to(at::kByte).argmax().item<int64_t>();
  TORCH_CHECK_VALUE(false, op, ": target must hold class indices in [0, ", vocab, ") or ignore_index (", ignore_index,
                    "), got ", target[row].item<int64_t>(), " at row ", row);
}

void check_lce_scale_grads(at::TensorList grads, const at::Tensor& grad_loss) {
  constexpr const char* op = "fused_dense::linear_cross_entropy_scale_grads_";
  TORCH_CHECK_VALUE(grad_loss.numel() == 1 && at::isFloatingType(grad_loss.scalar_type()), op,
                    ": grad_loss must be one floating-point number, got ", grad_loss.scalar_type(), " of shape ",
                    grad_loss.sizes());
  for (size_t i = 0; i < grads.size(); ++i) {
    TORCH_CHECK_VALUE(grads[i].device() == grad_loss.device(), op, ": grads[", i, "] must be on grad_loss's device ",
                      grad_loss.device(), ", got ", grads[i].device());
    TORCH_CHECK_VALUE(at::isFloatingType(grads[i].scalar_type()), op, ": grads[", i,
                      "] must be floating point, got ", grads[i].scalar_type());
  }
}

void lce_scale_reference(const at::Tensor& t, const at::Tensor& grad_loss) {
  const auto math = float_math_dtype(t);
  t.copy_(t.to(math).mul(grad_loss.reshape({}).to(math)));
}

int64_t lce_chunk_rows(int64_t rows, int64_t d, int64_t vocab, int64_t element_bytes, int64_t chunk_size) {
  int64_t c = chunk_size;
  if (c <= 0) {
    TORCH_CHECK_VALUE(d > 0 && vocab > 0 && element_bytes > 0, "linear_cross_entropy_chunk_rows: d, vocab and "
                      "element_bytes must be positive, got ", d, ", ", vocab, " and ", element_bytes);
    const int64_t row_bytes = vocab * element_bytes;
    const int64_t allowance = std::max(d / kChunkRowsPerD * row_bytes, kChunkBytesFloor);
    c = kMinChunkRows;
    while (c * 2 * row_bytes <= allowance) c *= 2;
  }
  return std::max<int64_t>(std::min(c, rows), 1);
}

namespace {

// The gradients being made, allocated; bias_sums: the bias gradient's fp32 (fp64) sums.
struct ChunkGrads {
  at::Tensor input, weight, bias_sums;
  bool any = false;
};

ChunkGrads empty_chunk_grads(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                             std::array<bool, 3> grads) {
  const bool gb = grads[2] && bias.has_value() && bias->defined();
  return {empty_grad_input(input, grads[0]), empty_grad_weight(weight, grads[1], input.size(0) == 0),
          gb ? at::zeros({weight.size(0)}, input.options().dtype(float_math_dtype(input))) : at::Tensor(),
          grads[0] || grads[1] || gb};
}

// The chunk loop: each chunk's logits, then rows_of(start, c, logits) (the rows kernel's call),
// then, when gradients are made, their share of the chunk.
template <typename RowsOf>
void run_chunks(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                int64_t chunk_size, bool fp8, ChunkGrads& g, RowsOf&& rows_of) {
  const int64_t N = input.size(0), V = weight.size(0);
  if (N == 0) return;
  const int64_t C = lce_chunk_rows(N, input.size(1), V, input.element_size(), chunk_size);
  // fp8: each chunk's logits are fp8_linear's output (the allocator hands the last chunk's back)
  const Fp8Operands q = fp8 ? fp8_operands(input, weight, g.input.numel() > 0) : Fp8Operands{};
  at::Tensor buffer = fp8 ? at::Tensor() : at::empty({std::min(C, N), V}, input.options());
  const at::Tensor weight_t = weight.t();
  for (int64_t start = 0, k = 0; start < N; start += C, ++k) {
    const int64_t c = std::min(C, N - start);
    const at::Tensor x = input.narrow(0, start, c);
    at::Tensor logits;
    if (fp8) {
      logits = fp8_logits(q, start, c, bias, input.scalar_type());
    } else {
      logits = buffer.narrow(0, 0, c);
      logits_into(logits, x, weight_t, bias);
    }
    rows_of(start, c, logits);
    if (g.any) accumulate_grads(logits, x, weight, fp8 ? &q : nullptr, start, k, g.input, g.weight, g.bias_sums);
  }
}

}  // namespace

LceForwardResult lce_forward(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                             const at::Tensor& target, const LceOptions& opts, const std::optional<at::Tensor>& divisor,
                             int64_t chunk_size, std::array<bool, 3> grads, LceRowsFn rows_fn) {
  const int64_t N = input.size(0);
  const auto acc = input.options().dtype(float_math_dtype(input));
  const at::Tensor scale = base_scale(target, opts, divisor, acc);
  at::Tensor loss_rows = at::empty({N}, acc), lse = at::empty({N}, acc);
  ChunkGrads g = empty_chunk_grads(input, weight, bias, grads);
  run_chunks(input, weight, bias, chunk_size, opts.fp8, g, [&](int64_t start, int64_t c, const at::Tensor& logits) {
    rows_fn({logits, target.narrow(0, start, c), scale, loss_rows.narrow(0, start, c), lse.narrow(0, start, c), false,
             g.any},
            opts);
  });
  at::Tensor loss = opts.reduction == kReduceNone ? loss_rows : loss_rows.sum() * scale;
  return {loss, lse, g.input, g.weight, grad_bias_of(g.bias_sums, bias, input)};
}

LceBackwardResult lce_backward(const at::Tensor& grad_loss, const at::Tensor& input, const at::Tensor& weight,
                               const std::optional<at::Tensor>& bias, const at::Tensor& target, const at::Tensor& lse,
                               const LceOptions& opts, const std::optional<at::Tensor>& divisor, int64_t chunk_size,
                               std::array<bool, 3> grads, LceRowsFn rows_fn) {
  const auto acc = input.options().dtype(float_math_dtype(input));
  // per row for reduction none, else one scale for every row
  const bool per_row = opts.reduction == kReduceNone;
  const at::Tensor scale = per_row ? grad_loss.to(acc).contiguous()
                                   : (grad_loss.to(acc).reshape({}) * base_scale(target, opts, divisor, acc));
  ChunkGrads g = empty_chunk_grads(input, weight, bias, grads);
  if (g.any) {
    run_chunks(input, weight, bias, chunk_size, opts.fp8, g, [&](int64_t start, int64_t c, const at::Tensor& logits) {
      rows_fn({logits, target.narrow(0, start, c), per_row ? scale.narrow(0, start, c) : scale, at::Tensor(),
               lse.narrow(0, start, c), true, true},
              opts);
    });
  }
  return {g.input, g.weight, grad_bias_of(g.bias_sums, bias, input)};
}

LceForwardResult empty_lce_forward(const at::Tensor& input, const at::Tensor& weight,
                                   const std::optional<at::Tensor>& bias, int64_t reduction, std::array<bool, 3> grads) {
  const c10::SymInt N = input.sym_size(0);
  const auto f32 = input.options().dtype(float_math_dtype(input));
  auto [gi, gw, gb] = empty_lce_grads(input, weight, bias, grads);
  return {reduction == kReduceNone ? at::empty_symint({N}, f32) : at::empty({}, f32), at::empty_symint({N}, f32), gi,
          gw, gb};
}

LceBackwardResult empty_lce_grads(const at::Tensor& input, const at::Tensor& weight,
                                  const std::optional<at::Tensor>& bias, std::array<bool, 3> grads) {
  const bool gb = grads[2] && bias.has_value() && bias->defined();
  return {empty_grad_input(input, grads[0]), empty_grad_weight(weight, grads[1], false),
          gb ? at::empty({weight.size(0)}, bias->options()) : at::empty({0}, input.options())};
}

}  // namespace fused_dense

TORCH_LIBRARY_FRAGMENT(fused_dense, m) {
  using fused_dense::def_raw_op;
  def_raw_op(m, "linear_cross_entropy_forward(Tensor input, Tensor weight, Tensor? bias, Tensor target, int ignore_index, "
             "float label_smoothing, float z_loss, float softcap, int reduction, Tensor? divisor, int chunk_size, "
             "bool[3] grads, bool fp8=False) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  def_raw_op(m, "linear_cross_entropy_backward(Tensor grad_loss, Tensor input, Tensor weight, Tensor? bias, "
             "Tensor target, Tensor lse, int ignore_index, float label_smoothing, float z_loss, float softcap, "
             "int reduction, Tensor? divisor, int chunk_size, bool[3] grads, bool fp8=False) -> (Tensor, Tensor, Tensor)");
  m.def("linear_cross_entropy(Tensor input, Tensor weight, Tensor? bias, Tensor target, int ignore_index=-100, "
        "float label_smoothing=0., float z_loss=0., float softcap=0., int reduction=1, Tensor? divisor=None, "
        "int chunk_size=0, bool fp8=False) -> Tensor");
  def_raw_op(m, "linear_cross_entropy_scale_grads_(Tensor(a!)[] grads, Tensor grad_loss) -> ()");
  m.def("linear_cross_entropy_chunk_rows(int rows, int d, int vocab, int element_bytes, int chunk_size) -> int",
        &fused_dense::lce_chunk_rows);
}
