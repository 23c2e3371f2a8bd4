// The LM head family's reference (lm_head.cpp has the ops' contract): the chunk loop over the
// rows in plain ATen.
#include <torch/library.h>

#include <limits>

#include "torch/cpu/reference.h"
#include "torch/lm_head.h"

namespace fused_dense {

void cross_entropy_rows_reference(const LceRows& r, const LceOptions& o) {
  const auto math = r.logits.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const at::Tensor y = r.logits.to(math);
  const int64_t V = y.size(1);
  const double eps = o.label_smoothing, zl = o.z_loss;
  at::Tensor z = y, cap;  // the capped logits and tanh(y / softcap)
  if (o.softcap > 0) {
    cap = at::tanh(y / o.softcap);
    z = cap * o.softcap;
  }
  const at::Tensor valid = r.target.ne(o.ignore_index);
  const at::Tensor in_range = r.target.ge(0).logical_and(r.target.lt(V));
  const at::Tensor bad = valid.logical_and(in_range.logical_not());
  const at::Tensor index = at::where(in_range, r.target, at::zeros_like(r.target)).unsqueeze(1);
  const at::Tensor nan = at::full({}, std::numeric_limits<double>::quiet_NaN(), y.options());
  const at::Tensor zero = at::zeros({}, y.options());
  // a row's value: 0 where ignored, NaN where its target is out of range
  auto per_row = [&](const at::Tensor& v) { return at::where(bad, nan, at::where(valid, v, zero)); };
  at::Tensor lse;
  if (r.lse_known) {
    lse = r.lse.to(math);
  } else {
    lse = at::logsumexp(z, {1});
    at::Tensor loss = (1 - eps) * (lse - z.gather(1, index).squeeze(1));
    if (eps > 0) loss = loss + eps * (lse - z.mean(1));
    if (zl > 0) loss = loss + zl * lse * lse;
    r.lse.copy_(per_row(lse));
    if (r.loss.defined()) r.loss.copy_(per_row(loss));
  }
  if (!r.write_grad) return;
  at::Tensor g = at::exp(z - lse.unsqueeze(1)) * (1 + 2 * zl * lse).unsqueeze(1);
  if (eps > 0) g = g - eps / static_cast<double>(V);
  g.scatter_add_(1, index, at::full({index.size(0), 1}, -(1 - eps), g.options()));
  if (o.softcap > 0) g = g * (1 - cap * cap);
  const at::Tensor s = r.scale.to(math);
  g = g * (s.dim() == 0 ? s : s.unsqueeze(1));
  r.logits.copy_(at::where(bad.unsqueeze(1), nan, at::where(valid.unsqueeze(1), g, zero)));
}

namespace {

void lce_scale_grads_cpu(at::TensorList grads, const at::Tensor& grad_loss) {
  check_lce_scale_grads(grads, grad_loss);
  for (const at::Tensor& t : grads) lce_scale_reference(t, grad_loss);
}

struct CpuBackend {
  static void rows(const LceRows& r, const LceOptions& o) { cross_entropy_rows_reference(r, o); }
  static bool reads_targets(const at::Tensor&) { return true; }
};

}  // namespace
}  // namespace fused_dense

TORCH_LIBRARY_IMPL(fused_dense, CPU, m) {
  m.impl("linear_cross_entropy_forward", &fused_dense::lce_forward_op<fused_dense::CpuBackend>);
  m.impl("linear_cross_entropy_backward", &fused_dense::lce_backward_op<fused_dense::CpuBackend>);
  m.impl("linear_cross_entropy_scale_grads_", &fused_dense::lce_scale_grads_cpu);
}
