// Autograd kernel of the raw ops: they have no derivative formulas (the autograd.Functions in
// fused_dense/functional.py are the differentiable API). Without this kernel, a tensor that
// requires grad would fall through to the backend kernel and the CPU reference's ATen calls
// would record an autograd graph of theirs: gradients on CPU, silently none on CUDA. Here it is a
// clear error instead; with grad mode off (as inside autograd.Function.forward) the call
// simply continues below autograd.
#include "torch/autograd/guard.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/grad_mode.h>

#include <string>

namespace fused_dense {
namespace {

void autograd_guard(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  if (at::GradMode::is_enabled()) {
    const auto& schema = op.schema();
    const size_t n = schema.arguments().size();
    for (size_t i = 0; i < n; ++i) {
      const c10::IValue& arg = (*stack)[stack->size() - n + i];
      const bool needs_grad = arg.isTensor() && arg.toTensor().defined() && arg.toTensor().requires_grad();
      TORCH_CHECK(!needs_grad, schema.name(), ": argument '", schema.arguments()[i].name(),
                  "' requires grad, but the raw fused_dense ops have no derivative; use the autograd "
                  "functions (fused_dense.fused_dense_func / fused_mlp_func, FusedDense, FusedMLP), or "
                  "call the op under torch.no_grad() / on detached tensors");
    }
  }
  op.redispatchBoxed(keys & c10::after_autograd_keyset, stack);
}

}  // namespace

void def_raw_op(torch::Library& m, const char* schema) {
  m.def(schema);
  const std::string s(schema);
  const std::string name = s.substr(0, s.find('('));
  m.impl(name.c_str(), torch::dispatch(c10::DispatchKey::Autograd,
                                       torch::CppFunction::makeFromBoxedFunction<&autograd_guard>()));
}

}  // namespace fused_dense
