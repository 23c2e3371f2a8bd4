"""Autograd functions for fused dense layers: ``FusedDenseFunc`` and ``FusedMLPFunc``.

Signature-compatible with ``flash_attn.ops.fused_dense``: ``fused_dense_func`` computes
``x @ weight.T + bias``; ``fused_mlp_func`` computes ``fc2(act(fc1(x)))`` with the activation
fused into the first GEMM's epilogue and its derivative fused into the second GEMM's dgrad.

``fused_mlp_func`` runs as the single op ``torch.ops.fused_dense.fused_mlp``, whose derivative is a
C++ autograd Function (csrc/torch/mlp_autograd.cpp: the same ops in the same order as
``FusedMLPFunc``, bit-identical results, no Python between the GEMMs), whenever no process group is
given, autocast has nothing to cast and the tensors are row-major of one dtype and device that
the ops serve; otherwise it runs ``FusedMLPFunc``.

Both autograd Functions call only ``torch.ops.fused_dense.*`` (through :mod:`fused_dense.ops`)
for the float16 / bfloat16 / float32 / float64 tensors on the devices the extension has kernels
for (CPU, Meta, and CUDA when built with it). Anything else that ``nn.Linear`` accepts (another
device, a complex or integer dtype) runs the same Functions on plain PyTorch operators, so every
argument combination keeps one behaviour; only the speed differs.

Gradients:
    * nothing is computed or saved for an input whose gradient nobody asked for
      (``ctx.needs_input_grad``);
    * with ``return_residual=True`` the input is returned as a second output and the gradient
      reaching it is added to the input's gradient.

Mixed precision: when autocast is on for the input's device and the input is float16, bfloat16
or float32, the input, the weights and the biases run in ``torch.get_autocast_dtype(device)``,
exactly as ``nn.Linear`` would under autocast. float64 is never autocast.

``checkpoint_lvl`` of :func:`fused_mlp_func` trades memory for recomputation in backward:
    * 0: keep ``x``, the pre-activation and the activation output ``act(fc1(x))``;
    * 1: keep ``x`` and the pre-activation; recompute the activation output in backward.
      ReLU saves a 1-bit-per-element mask instead of its pre-activation and cannot rebuild its
      output from it, so ReLU keeps the mask and the output, as at level 0;
    * 2: keep only ``x``; re-run the fc1 GEMM in backward.
``save_pre_act=False`` (what ``FusedMLP`` passes in eval mode) behaves as level 2, and nothing
at all is saved when no input needs a gradient.

``heuristic`` selects how the activation is fused (fc1 forward and fc2 dgrad): ``'auto'`` the
library's documented rule (see :mod:`fused_dense.modules`), ``-1`` unfused (plain GEMM followed
by this library's own elementwise kernel), ``n >= 0`` entry n of cuBLASLt's algorithm list (an
index past the list raises ValueError on CUDA). The CPU kernels ignore it.

Tensor parallelism (``process_group`` not None), following flash-attn:
    * ``sequence_parallel=True``: ``x`` is this rank's shard of the sequence (dim 0). Forward
      all-gathers it asynchronously while the weights are cast; backward re-gathers it for the
      weight gradient and reduce-scatters the input gradient, overlapped with the wgrad GEMM.
    * ``sequence_parallel=False``: ``x`` is replicated; backward all-reduces the input gradient,
      overlapped with the wgrad GEMM.
    The output of ``fused_mlp_func`` (fc2) is a partial sum that the caller reduces.
"""
import contextlib
from typing import Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from . import ops

__all__ = ["FusedDenseFunc", "FusedMLPFunc", "fused_dense_func", "fused_mlp_func"]

MLP_ACTIVATIONS = ("gelu_approx", "relu", "sqrelu")
CHECKPOINT_LEVELS = (0, 1, 2)

_OP_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_AUTOCAST_ELIGIBLE = (torch.float16, torch.bfloat16, torch.float32)
_AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps")


def _devices_with_kernels():
    devices = []
    for key, device in (("CPU", "cpu"), ("CUDA", "cuda"), ("Meta", "meta")):
        if torch._C._dispatch_has_kernel_for_dispatch_key("fused_dense::linear_act", key):
            devices.append(device)
    return tuple(devices)


# Decided once at import: which device types the compiled ops serve.
_OP_DEVICES = _devices_with_kernels()


# ----------------------------------------------------------------------------------------------
# Argument checks


def _check_activation(activation) -> str:
    if not isinstance(activation, str) or activation not in MLP_ACTIVATIONS:
        raise ValueError(f"activation must be one of {list(MLP_ACTIVATIONS)}, got {activation!r}")
    return activation


def _check_checkpoint_lvl(checkpoint_lvl) -> int:
    if isinstance(checkpoint_lvl, bool) or not isinstance(checkpoint_lvl, int) \
            or checkpoint_lvl not in CHECKPOINT_LEVELS:
        raise ValueError(f"checkpoint_lvl must be 0, 1 or 2, got {checkpoint_lvl!r}")
    return checkpoint_lvl


# ----------------------------------------------------------------------------------------------
# dtype and backend choice


def _compute_dtype(x: Tensor) -> Tuple[torch.dtype, bool]:
    """(dtype the layer runs in, whether autocast applies): the autocast dtype of x's device when
    autocast is on there and x is float16 / bfloat16 / float32, else x's own dtype."""
    device_type = x.device.type
    if x.dtype in _AUTOCAST_ELIGIBLE and device_type in _AUTOCAST_DEVICES \
            and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type), True
    return x.dtype, False


def _autocast_off(device_type: str):
    """Autocast disabled for the ops inside the Functions when it is on for this device.

    The ops have no autocast kernels, so the Autocast dispatch key falls through and stays active
    for the ATen calls inside their CPU (and float64) kernels, which would then run their float32
    math in the autocast dtype. The Functions cast their inputs themselves, so autocast has
    nothing left to do inside them.
    """
    if device_type in _AUTOCAST_DEVICES and torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type=device_type, enabled=False)
    return contextlib.nullcontext()


def _prepare(t: Optional[Tensor], dtype: torch.dtype, cast: bool = True) -> Optional[Tensor]:
    """t row-major, and in `dtype` when `cast` (autocast) applies to it: at most one copy.

    (Tensor.to(memory_format=...) returns a non-contiguous tensor unchanged when no dtype or
    device change is asked for, hence the explicit copy.)
    """
    if t is None:
        return None
    target = dtype if cast and t.dtype in _AUTOCAST_ELIGIBLE else t.dtype
    if t.dtype == target and t.is_contiguous():
        return t
    out = torch.empty(t.shape, dtype=target, device=t.device)
    out.copy_(t)
    return out


def _use_ops(x: Tensor, *others: Optional[Tensor]) -> bool:
    """True when the compiled ops can serve these tensors (else the plain-PyTorch path runs)."""
    if x.device.type not in _OP_DEVICES or x.dtype not in _OP_DTYPES:
        return False
    for t in others:
        if t is not None and (t.dtype != x.dtype or t.device != x.device):
            return False
    return True


# ----------------------------------------------------------------------------------------------
# The three GEMM building blocks, on the ops or on plain PyTorch.


def _plain_act(pre: Tensor, activation: str) -> Tensor:
    if activation == "gelu_approx":
        return F.gelu(pre, approximate="tanh")
    if activation == "relu":
        return F.relu(pre)
    if activation == "sqrelu":
        return F.relu(pre).square()
    return pre


def _linear_act(x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: str, save_pre_act: bool,
                heuristic: int, use_ops: bool) -> Tuple[Tensor, Optional[Tensor]]:
    if use_ops:  # activation and heuristic were checked up front
        return ops.linear_act_coded(x, weight, bias, ops.ACTIVATIONS[activation], save_pre_act, heuristic)
    pre = F.linear(x, weight, bias)
    out = _plain_act(pre, activation)
    if not save_pre_act:
        return out, None
    return out, (pre >= 0 if activation == "relu" else pre)


def _act_forward(pre_act: Tensor, activation: str, use_ops: bool) -> Tensor:
    if use_ops:
        return ops.act_forward_coded(pre_act, ops.ACTIVATIONS[activation])
    return _plain_act(pre_act, activation)


def _act_dgrad(weight: Tensor, d_output: Tensor, pre_act: Optional[Tensor], activation: str, has_d_bias: bool,
               heuristic: int, use_ops: bool) -> Tuple[Tensor, Optional[Tensor]]:
    if use_ops:
        return ops.act_linear_dgrad_coded(weight, d_output, pre_act, ops.ACTIVATIONS[activation], has_d_bias,
                                          heuristic)
    d = d_output @ weight.conj()
    if activation == "gelu_approx":
        d = torch.ops.aten.gelu_backward(d, pre_act, approximate="tanh")
    elif activation == "relu":
        d = d * pre_act.to(d.dtype)
    elif activation == "sqrelu":
        d = d * (2 * F.relu(pre_act))
    return d, (d.sum(0) if has_d_bias else None)


def _act_dgrad_act_out(weight: Tensor, d_output: Tensor, pre_act: Tensor, activation: str, has_d_bias: bool,
                       heuristic: int, use_ops: bool) -> Tuple[Tensor, Optional[Tensor], Tensor]:
    """_act_dgrad plus act(pre_act), for gelu_approx / sqrelu: level 1 rebuilds the activation
    output in the pass that reads pre_act anyway."""
    if use_ops:
        return ops.act_linear_dgrad_act_out_coded(weight, d_output, pre_act, ops.ACTIVATIONS[activation],
                                                  has_d_bias, heuristic)
    d_pre, d_bias = _act_dgrad(weight, d_output, pre_act, activation, has_d_bias, heuristic, use_ops)
    return d_pre, d_bias, _plain_act(pre_act, activation)


def _wgrad(x: Tensor, d_output: Tensor, has_d_bias: bool, use_ops: bool) -> Tuple[Tensor, Optional[Tensor]]:
    if use_ops:
        return ops.linear_bias_wgrad(x, d_output, has_d_bias)
    return d_output.t() @ x.conj(), (d_output.sum(0) if has_d_bias else None)


def _bias_grad(d_output: Tensor) -> Tensor:
    """d_output.sum(0) alone (when the weight needs no gradient), accumulated in fp32 for 16-bit."""
    if d_output.dtype in (torch.float16, torch.bfloat16):
        return d_output.sum(0, dtype=torch.float32).to(d_output.dtype)
    return d_output.sum(0)


def _as_2d(t: Tensor) -> Tensor:
    return t.reshape(-1, t.shape[-1])


def _function_outputs(out: Tensor, batch_shape, residual: Optional[Tensor]):
    """What a Function's forward returns: out in x's batch shape, and the residual when asked.
    2-D outputs are returned as they are: even a same-shape reshape would make the output a view
    created inside the Function, which PyTorch then refuses to modify in place (see _flat_call)."""
    if len(batch_shape) != 1:
        out = out.reshape(*batch_shape, out.shape[-1])
    return out if residual is None else (out, residual)


# ----------------------------------------------------------------------------------------------
# Tensor-parallel helpers (fused_dense.distributed is only imported when a group is given).


def _start_gather(x: Tensor, process_group):
    from .distributed import all_gather_raw

    return all_gather_raw(x, process_group, async_op=True)


def _start_input_grad_reduction(grad: Tensor, process_group, sequence_parallel: bool):
    from .distributed import all_reduce_raw, reduce_scatter_raw

    if sequence_parallel:
        return reduce_scatter_raw(grad, process_group, async_op=True)
    return all_reduce_raw(grad, process_group, async_op=True)


def _wait(handle) -> None:
    if handle is not None:
        handle.wait()


# ----------------------------------------------------------------------------------------------
# Dense


class FusedDenseFunc(torch.autograd.Function):
    """out = x @ weight.T + bias; optionally also returns x (``return_residual``)."""

    @staticmethod
    def forward(ctx, x, weight, bias, return_residual=False, process_group=None, sequence_parallel=True):
        dtype, autocast = _compute_dtype(x)
        with _autocast_off(x.device.type):
            return FusedDenseFunc._forward(ctx, x, weight, bias, return_residual, process_group, sequence_parallel,
                                           dtype, autocast)

    @staticmethod
    def _forward(ctx, x, weight, bias, return_residual, process_group, sequence_parallel, dtype, autocast):
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        x = _prepare(x, dtype)
        gather = process_group is not None and sequence_parallel
        handle = None
        total_x = x
        if gather:
            total_x, handle = _start_gather(x, process_group)
        weight = _prepare(weight, dtype, autocast)
        bias = _prepare(bias, dtype, autocast)
        _wait(handle)
        batch_shape = total_x.shape[:-1]
        use_ops = _use_ops(total_x, weight, bias)
        out, _ = _linear_act(_as_2d(total_x), weight, bias, "none", False, ops.HEURISTIC_AUTO, use_ops)

        ctx.use_ops = use_ops
        ctx.return_residual = return_residual
        ctx.process_group = process_group
        ctx.sequence_parallel = sequence_parallel
        # Saved: the input only for the weight gradient (the local shard when it is re-gathered
        # in backward), the weight only for the input gradient.
        ctx.save_for_backward((x if gather else total_x) if need_w else None, weight if need_x else None)
        return _function_outputs(out, batch_shape, x if return_residual else None)

    @staticmethod
    def backward(ctx, grad_output, *grad_rest):
        with _autocast_off(grad_output.device.type):
            return FusedDenseFunc._backward(ctx, grad_output, *grad_rest)

    @staticmethod
    def _backward(ctx, grad_output, *grad_rest):
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        process_group = ctx.process_group
        gather = process_group is not None and ctx.sequence_parallel
        use_ops = ctx.use_ops
        grad_output = grad_output.contiguous()
        g = _as_2d(grad_output)
        grad_x = grad_w = grad_b = None

        handle_x = None
        total_x = x
        if need_w and gather:
            total_x, handle_x = _start_gather(x, process_group)
        handle_dx = None
        if need_x:
            grad_x, _ = _act_dgrad(weight, g, None, "none", False, ops.HEURISTIC_AUTO, use_ops)
            grad_x = grad_x.reshape(*grad_output.shape[:-1], grad_x.shape[-1])
            if process_group is not None:
                grad_x, handle_dx = _start_input_grad_reduction(grad_x, process_group, ctx.sequence_parallel)
        if need_w:
            _wait(handle_x)
            grad_w, grad_b = _wgrad(_as_2d(total_x), g, need_b, use_ops)
        elif need_b:
            grad_b = _bias_grad(g)
        if need_x:
            _wait(handle_dx)
            if ctx.return_residual and grad_rest[0] is not None:
                grad_x = grad_x + grad_rest[0]
        return grad_x, grad_w, grad_b, None, None, None


def fused_dense_func(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, return_residual: bool = False,
                     process_group=None, sequence_parallel: bool = True):
    """x @ weight.T + bias for x of shape [..., in_features]; (out, x) with return_residual."""
    if process_group is None and x.dim() >= 1:
        return _flat_call(lambda x2, rr: FusedDenseFunc.apply(x2, weight, bias, rr, None, sequence_parallel), x,
                          return_residual)
    return FusedDenseFunc.apply(x, weight, bias, return_residual, process_group, sequence_parallel)


def _flat_call(apply_2d, x: Tensor, return_residual: bool):
    """Runs an autograd Function on x flattened to 2-D and reshapes its output back, both outside
    the Function, and returns x itself as the residual where autocast leaves it as it is. A
    reshape inside a Function (or an input it returns) makes that output a view created in a
    custom Function, which PyTorch refuses to modify in place; done here, the outputs take in-place
    ops (dropout(inplace=True), add_) as nn.Linear's do, and autograd adds the residual's gradient
    to x's by itself. Under autocast the residual is the cast input, which the Function returns.

    apply_2d(x2, return_residual) runs the Function on the 2-D x2."""
    dtype, autocast = _compute_dtype(x)
    residual_is_x = not autocast or x.dtype == dtype
    res = apply_2d(x if x.dim() == 2 else x.reshape(-1, x.shape[-1]), return_residual and not residual_is_x)
    out, residual = res if isinstance(res, tuple) else (res, None)
    if x.dim() != 2:
        out = out.reshape(*x.shape[:-1], out.shape[-1])
        residual = None if residual is None else residual.reshape(x.shape)
    if not return_residual:
        return out
    return out, (x if residual_is_x else residual)


# ----------------------------------------------------------------------------------------------
# MLP


class FusedMLPFunc(torch.autograd.Function):
    """out = fc2(act(fc1(x))) with the activation fused into the GEMMs; see the module docstring."""

    @staticmethod
    def forward(ctx, x, weight1, bias1, weight2, bias2, activation="gelu_approx", save_pre_act=True,
                return_residual=False, checkpoint_lvl=0, heuristic=0, process_group=None,
                sequence_parallel=True):
        dtype, autocast = _compute_dtype(x)
        with _autocast_off(x.device.type):
            return FusedMLPFunc._forward(ctx, x, weight1, bias1, weight2, bias2, activation, save_pre_act,
                                         return_residual, checkpoint_lvl, heuristic, process_group,
                                         sequence_parallel, dtype, autocast)

    @staticmethod
    def _forward(ctx, x, weight1, bias1, weight2, bias2, activation, save_pre_act, return_residual,
                 checkpoint_lvl, heuristic, process_group, sequence_parallel, dtype, autocast):
        activation = _check_activation(activation)
        checkpoint_lvl = _check_checkpoint_lvl(checkpoint_lvl)
        heuristic = ops.heuristic_code(heuristic)
        if not save_pre_act:
            checkpoint_lvl = 2
        need_x, need_w1, need_b1, need_w2, need_b2 = ctx.needs_input_grad[:5]
        need_d_pre = need_x or need_w1 or need_b1  # a gradient flows back through the activation
        need_act_out = need_w2  # fc2's weight gradient reads act(fc1(x))
        keeps_act_out = checkpoint_lvl == 0 or (checkpoint_lvl == 1 and activation == "relu")
        if checkpoint_lvl == 2:
            keep_pre = False
        elif keeps_act_out:
            keep_pre = need_d_pre
        else:  # level 1: the pre-activation also rebuilds the activation output
            keep_pre = need_d_pre or need_act_out
        recompute_fc1 = checkpoint_lvl == 2 and (need_d_pre or need_act_out)

        x = _prepare(x, dtype)
        gather = process_group is not None and sequence_parallel
        handle = None
        total_x = x
        if gather:
            total_x, handle = _start_gather(x, process_group)
        weight1 = _prepare(weight1, dtype, autocast)
        bias1 = _prepare(bias1, dtype, autocast)
        weight2 = _prepare(weight2, dtype, autocast)
        bias2 = _prepare(bias2, dtype, autocast)
        _wait(handle)
        batch_shape = total_x.shape[:-1]
        use_ops = _use_ops(total_x, weight1, bias1, weight2, bias2)

        act_out, pre_act = _linear_act(_as_2d(total_x), weight1, bias1, activation, keep_pre, heuristic, use_ops)
        out, _ = _linear_act(act_out, weight2, bias2, "none", False, ops.HEURISTIC_AUTO, use_ops)

        ctx.use_ops = use_ops
        ctx.activation = activation
        ctx.checkpoint_lvl = checkpoint_lvl
        ctx.heuristic = heuristic
        ctx.return_residual = return_residual
        ctx.process_group = process_group
        ctx.sequence_parallel = sequence_parallel
        ctx.recompute_fc1 = recompute_fc1
        save_x = need_w1 or recompute_fc1
        ctx.save_for_backward(
            (x if gather else total_x) if save_x else None,
            weight1 if (need_x or recompute_fc1) else None,
            bias1 if recompute_fc1 else None,
            weight2 if need_d_pre else None,
            pre_act,
            act_out if (keeps_act_out and need_act_out) else None,
        )
        return _function_outputs(out, batch_shape, x if return_residual else None)

    @staticmethod
    def backward(ctx, grad_output, *grad_rest):
        with _autocast_off(grad_output.device.type):
            return FusedMLPFunc._backward(ctx, grad_output, *grad_rest)

    @staticmethod
    def _backward(ctx, grad_output, *grad_rest):
        x, weight1, bias1, weight2, pre_act, act_out = ctx.saved_tensors
        need_x, need_w1, need_b1, need_w2, need_b2 = ctx.needs_input_grad[:5]
        need_d_pre = need_x or need_w1 or need_b1
        activation, heuristic, use_ops = ctx.activation, ctx.heuristic, ctx.use_ops
        process_group = ctx.process_group
        gather = process_group is not None and ctx.sequence_parallel
        grad_output = grad_output.contiguous()
        g = _as_2d(grad_output)
        grad_x = grad_w1 = grad_b1 = grad_w2 = grad_b2 = None

        handle_x = None
        total_x = x
        if gather and x is not None:
            total_x, handle_x = _start_gather(x, process_group)
        if ctx.recompute_fc1:
            _wait(handle_x)
            handle_x = None
            act_out, pre_act = _linear_act(_as_2d(total_x), weight1, bias1, activation, need_d_pre, heuristic,
                                           use_ops)
        # Level 1 rebuilds act(pre_act) for fc2's weight gradient; with a gradient through the
        # activation, in the activation-backward pass, which reads pre_act anyway.
        rebuild_act_out = act_out is None and need_w2
        if need_d_pre and rebuild_act_out:
            d_pre, grad_b1, act_out = _act_dgrad_act_out(weight2, g, pre_act, activation, need_b1, heuristic,
                                                         use_ops)
        elif need_d_pre:
            d_pre, grad_b1 = _act_dgrad(weight2, g, pre_act, activation, need_b1, heuristic, use_ops)
        elif rebuild_act_out:
            act_out = _act_forward(pre_act, activation, use_ops)

        if need_w2:
            grad_w2, grad_b2 = _wgrad(act_out, g, need_b2, use_ops)
        elif need_b2:
            grad_b2 = _bias_grad(g)
        if need_d_pre:
            handle_dx = None
            if need_x:
                grad_x, _ = _act_dgrad(weight1, d_pre, None, "none", False, ops.HEURISTIC_AUTO, use_ops)
                grad_x = grad_x.reshape(*grad_output.shape[:-1], grad_x.shape[-1])
                if process_group is not None:
                    grad_x, handle_dx = _start_input_grad_reduction(grad_x, process_group, ctx.sequence_parallel)
            if need_w1:
                _wait(handle_x)
                grad_w1, _ = _wgrad(_as_2d(total_x), d_pre, False, use_ops)
            if need_x:
                _wait(handle_dx)
                if ctx.return_residual and grad_rest[0] is not None:
                    grad_x = grad_x + grad_rest[0]
        return grad_x, grad_w1, grad_b1, grad_w2, grad_b2, None, None, None, None, None, None, None


def fused_mlp_func(x: Tensor, weight1: Tensor, weight2: Tensor, bias1: Optional[Tensor] = None,
                   bias2: Optional[Tensor] = None, activation: str = "gelu_approx", save_pre_act: bool = True,
                   return_residual: bool = False, checkpoint_lvl: int = 0, heuristic: Union[int, str] = 0,
                   process_group=None, sequence_parallel: bool = True):
    """fc2(act(fc1(x))) for x of shape [..., in_features]; (out, x) with return_residual.

    weight1: [hidden, in], weight2: [out, hidden]. With a process_group the result is fc2's
    partial sum on this rank; the caller reduces it (reduce-scatter or all-reduce).
    """
    _check_activation(activation)
    _check_checkpoint_lvl(checkpoint_lvl)
    code = ops.heuristic_code(heuristic)
    if process_group is None and _native_mlp_applies(x, weight1, bias1, weight2, bias2):
        # The same computation with its derivative in C++ (csrc/torch/mlp_autograd.cpp): no Python
        # runs between the GEMMs of a forward + backward.
        act_code, lvl = ops.ACTIVATIONS[activation], checkpoint_lvl if save_pre_act else 2
        # no autocast here, so the residual is always x itself and rr is False
        return _flat_call(lambda x2, rr: _NATIVE_MLP(x2, weight1, bias1, weight2, bias2, act_code, lvl, code), x,
                          return_residual)
    if process_group is None and x.dim() >= 1:
        return _flat_call(lambda x2, rr: FusedMLPFunc.apply(x2, weight1, bias1, weight2, bias2, activation,
                                                             save_pre_act, rr, checkpoint_lvl, heuristic, None,
                                                             sequence_parallel),
                          x, return_residual)
    return FusedMLPFunc.apply(x, weight1, bias1, weight2, bias2, activation, save_pre_act, return_residual,
                              checkpoint_lvl, heuristic, process_group, sequence_parallel)


# The compiled op with the C++ derivative, when this build has it (None: FusedMLPFunc does all).
_NATIVE_MLP = getattr(torch.ops.fused_dense, "fused_mlp").default \
    if hasattr(torch.ops.fused_dense, "fused_mlp") else None


def _native_mlp_applies(x: Tensor, weight1: Tensor, bias1: Optional[Tensor], weight2: Tensor,
                        bias2: Optional[Tensor]) -> bool:
    """True when fused_dense::fused_mlp computes exactly what FusedMLPFunc would: the ops serve the
    tensors, which share one dtype and device and are already row-major (FusedMLPFunc would copy
    them), and autocast has nothing to cast."""
    if _NATIVE_MLP is None or x.dim() == 0 or not x.is_contiguous() or not _use_ops(x, weight1, bias1, weight2, bias2):
        return False
    if x.dtype in _AUTOCAST_ELIGIBLE and x.device.type in _AUTOCAST_DEVICES and torch.is_autocast_enabled(x.device.type):
        return False
    return weight1.is_contiguous() and weight2.is_contiguous() and (bias1 is None or bias1.is_contiguous()) \
        and (bias2 is None or bias2.is_contiguous())
