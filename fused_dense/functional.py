"""Autograd functions for fused dense layers: ``FusedDenseFunc`` and ``FusedMLPFunc``.

Signature-compatible with ``flash_attn.ops.fused_dense``: ``fused_dense_func`` computes
``x @ weight.T + bias``; ``fused_mlp_func`` computes ``fc2(act(fc1(x)))`` with the activation
fused into the first GEMM's epilogue and its derivative fused into the second GEMM's dgrad.

One MLP autograd: without a process group ``fused_mlp_func`` runs the op
``torch.ops.fused_dense.fused_mlp``, whose derivative is a C++ autograd Function
(csrc/torch/autograd/mlp.cpp; no Python runs between the GEMMs of a step). ``FusedMLPFunc`` (flash-
attn's name, the tensor-parallel path) adds only communication around the same C++ forward and
backward halves. The checkpoint rules live once, in C++ (csrc/torch/mlp.h). Likewise
``fused_dense_func`` without a process group runs the op ``torch.ops.fused_dense.dense`` (C++
derivative, csrc/torch/autograd/linear.cpp); ``FusedDenseFunc`` serves process groups and flash-attn
callers.

``fused_mlp_func`` serves float16 / bfloat16 / float32 / float64 tensors on the devices the
extension has kernels for (CPU, Meta, and CUDA when built with it) through the ops; anything else
that ``nn.Linear`` accepts (another device, a complex dtype) runs the same computation on plain
PyTorch operators, differentiated by PyTorch. ``FusedDenseFunc`` does likewise inside itself.

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
tuner's measured choice (its rules: docs/contract.md, "Heuristic codes"), ``-1`` unfused (plain GEMM followed
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
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from . import ops
from ._common import (AUTOCAST_DEVICES, AUTOCAST_ELIGIBLE, as_2d, autocast_off, bias_grad, cast_for_op,
                      check_op_tensors, compute_dtype, dgrad, linear,
                      prepare, use_ops, wait, wgrad)

__all__ = ["FusedDenseFunc", "FusedMLPFunc", "fused_dense_func", "fused_mlp_func", "fused_gated_mlp_func"]


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


def _prepare_inputs(x: Tensor, params, dtype: torch.dtype, autocast: bool, gather_group):
    """(x, the whole x, params) in the layer's dtype and row-major; with gather_group, the
    all-gather of x runs while the parameters are cast."""
    x = prepare(x, dtype)
    total_x, handle = (x, None) if gather_group is None else _start_gather(x, gather_group)
    params = tuple(prepare(t, dtype, autocast) for t in params)
    wait(handle)
    return x, total_x, params


# ----------------------------------------------------------------------------------------------
# Dense


class FusedDenseFunc(torch.autograd.Function):
    """out = x @ weight.T + bias; optionally also returns x (``return_residual``)."""

    @staticmethod
    def forward(ctx, x, weight, bias, return_residual=False, process_group=None, sequence_parallel=True):
        dtype, autocast = compute_dtype(x)
        with autocast_off(x.device.type):
            return FusedDenseFunc._forward(ctx, x, weight, bias, return_residual, process_group, sequence_parallel,
                                           dtype, autocast)

    @staticmethod
    def _forward(ctx, x, weight, bias, return_residual, process_group, sequence_parallel, dtype, autocast):
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        gather = process_group is not None and sequence_parallel
        x, total_x, (weight, bias) = _prepare_inputs(x, (weight, bias), dtype, autocast,
                                                     process_group if gather else None)
        batch_shape = total_x.shape[:-1]
        on_ops = use_ops(total_x, weight, bias)
        out = linear(as_2d(total_x), weight, bias, on_ops)

        ctx.use_ops = on_ops
        ctx.return_residual = return_residual
        ctx.process_group = process_group
        ctx.sequence_parallel = sequence_parallel
        # Saved: the input only for the weight gradient (the local shard when it is re-gathered
        # in backward), the weight only for the input gradient.
        ctx.save_for_backward((x if gather else total_x) if need_w else None, weight if need_x else None)
        return _function_outputs(out, batch_shape, x if return_residual else None)

    @staticmethod
    def backward(ctx, grad_output, *grad_rest):
        with autocast_off(grad_output.device.type):
            return FusedDenseFunc._backward(ctx, grad_output, *grad_rest)

    @staticmethod
    def _backward(ctx, grad_output, *grad_rest):
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        process_group = ctx.process_group
        gather = process_group is not None and ctx.sequence_parallel
        on_ops = ctx.use_ops
        grad_output = grad_output.contiguous()
        g = as_2d(grad_output)
        grad_x = grad_w = grad_b = None

        handle_x = None
        total_x = x
        if need_w and gather:
            total_x, handle_x = _start_gather(x, process_group)
        handle_dx = None
        if need_x:
            grad_x = dgrad(weight, g, on_ops)
            grad_x = grad_x.reshape(*grad_output.shape[:-1], grad_x.shape[-1])
            if process_group is not None:
                grad_x, handle_dx = _start_input_grad_reduction(grad_x, process_group, ctx.sequence_parallel)
        if need_w:
            wait(handle_x)
            grad_w, grad_b = wgrad(as_2d(total_x), g, need_b, on_ops)
        elif need_b:
            grad_b = bias_grad(g)
        if need_x:
            wait(handle_dx)
            if ctx.return_residual and grad_rest[0] is not None:
                grad_x = grad_x + grad_rest[0]
        return grad_x, grad_w, grad_b, None, None, None


def fused_dense_func(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, return_residual: bool = False,
                     process_group=None, sequence_parallel: bool = True):
    """x @ weight.T + bias for x of shape [..., in_features]; (out, x) with return_residual.

    Without a process group this is ``torch.ops.fused_dense.dense``, whose derivative is a C++
    autograd Function (no Python in the step; autocast resolved here as for
    :func:`fused_mlp_func`); with one, :class:`FusedDenseFunc`."""
    if process_group is None and x.dim() >= 1:
        return _one_process_dense(x, weight, bias, return_residual)
    return FusedDenseFunc.apply(x, weight, bias, return_residual, process_group, sequence_parallel)


_op_dense = ops.op_overload("dense")


def _one_process_dense(x: Tensor, weight: Tensor, bias: Optional[Tensor], return_residual: bool):
    """The dense op (or, for what the ops do not serve, FusedDenseFunc's plain-PyTorch path) on one
    process. Without autocast (the common case) nothing is cast and autocast is not left: FusedDense's
    per-call host time is held to nn.Linear's (bench host section), so this path asks for the
    autocast state once and makes no call it does not need."""
    device_type = x.device.type
    if x.dtype in AUTOCAST_ELIGIBLE and device_type in AUTOCAST_DEVICES and torch.is_autocast_enabled(device_type):
        return _autocast_dense(x, weight, bias, return_residual)
    if not use_ops(x, weight, bias):
        return _flat_call(lambda x2, rr: FusedDenseFunc.apply(x2, weight, bias, rr, None, True), x, return_residual)
    out = _op_dense(x, weight, bias)  # folds x to rows and back in C++, as nn.Linear does
    return (out, x) if return_residual else out


def _autocast_dense(x: Tensor, weight: Tensor, bias: Optional[Tensor], return_residual: bool):
    """_one_process_dense under autocast: x, the weight and the bias cast to the autocast dtype as
    nn.Linear's would be (differentiably), then the op with autocast off."""
    dtype, autocast = compute_dtype(x)
    xc = cast_for_op(x, dtype, True)
    w, b = cast_for_op(weight, dtype, autocast), cast_for_op(bias, dtype, autocast)
    if not use_ops(xc, w, b):
        return _flat_call(lambda x2, rr: FusedDenseFunc.apply(x2, weight, bias, rr, None, True), x, return_residual)
    with autocast_off(x.device.type):
        out = _op_dense(xc, w, b)
    if not return_residual:
        return out
    # the residual is x itself, or under autocast the cast x that the layer read
    return out, (xc if xc.dtype != x.dtype else x)


def _flat_call(apply_2d, x: Tensor, return_residual: bool):
    """Runs an autograd Function on x flattened to 2-D and reshapes its output back, both outside
    the Function, and returns x itself as the residual where autocast leaves it as it is. A
    reshape inside a Function (or an input it returns) makes that output a view created in a
    custom Function, which PyTorch refuses to modify in place; done here, the outputs take in-place
    ops (dropout(inplace=True), add_) as nn.Linear's do, and autograd adds the residual's gradient
    to x's by itself. Under autocast the residual is the cast input, which the Function returns.

    apply_2d(x2, return_residual) runs the Function on the 2-D x2."""
    dtype, autocast = compute_dtype(x)
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
    """out = fc2(act(fc1(x))): flash-attn's autograd Function, with its arguments.

    It holds the tensor-parallel communication only (the gather of x, the reduction of its
    gradient, overlapped with fc1's weight-gradient GEMM). What is saved, what is recomputed and
    which gradients are computed is decided by the C++ ops it calls
    (``fused_mlp_plan`` / ``fused_mlp_train_forward`` / ``fused_mlp_backward``), the same code that
    is the derivative of ``torch.ops.fused_dense.fused_mlp``, which :func:`fused_mlp_func` runs
    without a process group.
    """

    @staticmethod
    def forward(ctx, x, weight1, bias1, weight2, bias2, activation="gelu_approx", save_pre_act=True,
                return_residual=False, checkpoint_lvl=0, heuristic=0, process_group=None,
                sequence_parallel=True):
        act = ops.check_mlp_arguments(activation, checkpoint_lvl, "any")
        code = ops.heuristic_code(heuristic)
        lvl = checkpoint_lvl if save_pre_act else 2
        dtype, autocast = compute_dtype(x)
        with autocast_off(x.device.type):
            gather = process_group is not None and sequence_parallel
            x, total_x, (weight1, bias1, weight2, bias2) = _prepare_inputs(
                x, (weight1, bias1, weight2, bias2), dtype, autocast, process_group if gather else None)
            check_op_tensors("FusedMLPFunc", total_x, weight1, bias1, weight2, bias2)
            needs = list(ctx.needs_input_grad[:5])
            needs[2] = needs[2] and bias1 is not None
            needs[4] = needs[4] and bias2 is not None
            plan = ops.mlp_plan(act, lvl, needs)
            res = ops.op_overload("fused_mlp_train_forward")(as_2d(total_x), weight1, bias1, weight2, bias2, act, lvl,
                                                             code, needs)
        ctx.mlp = (act, lvl, code, needs, plan["recompute_fc1"])
        ctx.return_residual = return_residual
        ctx.process_group = process_group
        ctx.sequence_parallel = sequence_parallel
        ctx.save_for_backward(
            (x if gather else total_x) if plan["save_x"] else None,
            weight1 if plan["save_weight1"] else None,
            bias1 if plan["save_bias1"] else None,
            weight2 if plan["save_weight2"] else None,
            *res[1:],
        )
        return _function_outputs(res[0], total_x.shape[:-1], x if return_residual else None)

    @staticmethod
    def backward(ctx, grad_output, *grad_rest):
        with autocast_off(grad_output.device.type):
            return FusedMLPFunc._backward(ctx, grad_output, *grad_rest)

    @staticmethod
    def _backward(ctx, grad_output, *grad_rest):
        x, weight1, bias1, weight2, *saved = ctx.saved_tensors
        act, lvl, code, needs, recompute_fc1 = ctx.mlp
        need_x, need_w1, need_b1, need_w2, need_b2 = needs
        process_group = ctx.process_group
        g = as_2d(grad_output.contiguous())

        handle_x = None
        total_x = x
        if x is not None and process_group is not None and ctx.sequence_parallel:
            total_x, handle_x = _start_gather(x, process_group)
        if recompute_fc1:  # fc1 is re-run first: x must be whole now
            wait(handle_x)
            handle_x = None
        total_x2 = None if total_x is None else as_2d(total_x)
        grads = iter(ops.op_overload("fused_mlp_backward")(g, total_x2 if recompute_fc1 else None, weight1, bias1,
                                                           weight2, saved, act, lvl, code, needs))
        d_pre = next(grads) if need_w1 else None
        grad_x = next(grads) if need_x else None
        grad_b1 = next(grads) if need_b1 else None
        grad_w2 = next(grads) if need_w2 else None
        grad_b2 = next(grads) if need_b2 else None
        handle_dx = None
        if need_x:
            grad_x = grad_x.reshape(*grad_output.shape[:-1], grad_x.shape[-1])
            if process_group is not None:
                grad_x, handle_dx = _start_input_grad_reduction(grad_x, process_group, ctx.sequence_parallel)
        grad_w1 = None
        if need_w1:
            wait(handle_x)
            grad_w1, _ = ops.linear_bias_wgrad(total_x2, d_pre, False)
        if need_x:
            wait(handle_dx)
            if ctx.return_residual and grad_rest[0] is not None:
                grad_x = grad_x + grad_rest[0]
        return grad_x, grad_w1, grad_b1, grad_w2, grad_b2, None, None, None, None, None, None, None


def _plain_act(pre: Tensor, activation: str) -> Tensor:
    if activation in ops.GATED_ACTIVATIONS:  # the packed gate and up pre-activations
        gate, up = ops.unpack_gate_up(pre, dim=-1)
        return _plain_act(gate, "silu" if activation == "swiglu" else "gelu_approx") * up
    if activation == "silu":
        return F.silu(pre)
    if activation == "gelu_approx":
        return F.gelu(pre, approximate="tanh")
    if activation == "relu":
        return F.relu(pre)
    if activation == "sqrelu":
        return F.relu(pre).square()
    return pre


def _plain_mlp(x: Tensor, weight1: Tensor, bias1: Optional[Tensor], weight2: Tensor, bias2: Optional[Tensor],
               activation: str) -> Tensor:
    """The MLP on plain PyTorch operators, differentiated by PyTorch: for the dtypes and devices
    the compiled ops do not serve (complex, integer, other devices), as nn.Linear would run."""
    return F.linear(_plain_act(F.linear(x, weight1, bias1), activation), weight2, bias2)


def fused_mlp_func(x: Tensor, weight1: Tensor, weight2: Tensor, bias1: Optional[Tensor] = None,
                   bias2: Optional[Tensor] = None, activation: str = "gelu_approx", save_pre_act: bool = True,
                   return_residual: bool = False, checkpoint_lvl: int = 0, heuristic: Union[int, str] = 0,
                   process_group=None, sequence_parallel: bool = True):
    """fc2(act(fc1(x))) for x of shape [..., in_features]; (out, x) with return_residual.

    weight1: [hidden, in], weight2: [out, hidden]. With a process_group the result is fc2's
    partial sum on this rank; the caller reduces it (reduce-scatter or all-reduce).

    Without a process group this is ``torch.ops.fused_dense.fused_mlp``, whose derivative is the
    C++ autograd Function (no Python between the six GEMMs of a step). Autocast is resolved here,
    before the op: the input, weights and biases are cast to the autocast dtype as nn.Linear's
    would be (differentiably, so gradients reach the original tensors), then the op runs with
    autocast off.
    """
    act = ops.check_mlp_arguments(activation, checkpoint_lvl)
    if process_group is not None:
        ops.heuristic_code(heuristic)
        return FusedMLPFunc.apply(x, weight1, bias1, weight2, bias2, activation, save_pre_act, return_residual,
                                  checkpoint_lvl, heuristic, process_group, sequence_parallel)
    return _one_process_mlp(x, weight1, weight2, bias1, bias2, activation, act, save_pre_act, return_residual,
                            checkpoint_lvl, heuristic)


def _one_process_mlp(x, weight1, weight2, bias1, bias2, activation, act, save_pre_act, return_residual,
                     checkpoint_lvl, heuristic):
    """The MLP op (or, for what the ops do not serve, plain PyTorch) on one process: fused_mlp_func's
    and fused_gated_mlp_func's body, with the activation checked to its code."""
    code = ops.heuristic_code(heuristic)
    lvl = checkpoint_lvl if save_pre_act else 2
    dtype, autocast = compute_dtype(x)
    xc = cast_for_op(x, dtype, True)
    params = [cast_for_op(t, dtype, autocast) for t in (weight1, bias1, weight2, bias2)]
    if xc.dim() == 0 or not use_ops(xc, *params):
        with autocast_off(x.device.type):
            out = _plain_mlp(xc, *params, activation)
    else:
        x2 = xc if xc.dim() == 2 else xc.reshape(-1, xc.shape[-1])
        with autocast_off(x.device.type):
            out = _op_fused_mlp(x2, params[0], params[1], params[2], params[3], act, lvl, code)
        if xc.dim() != 2:
            out = out.reshape(*xc.shape[:-1], out.shape[-1])
    if not return_residual:
        return out
    # the residual is x itself, or under autocast the cast x that the layer read
    return out, (xc if xc.dtype != x.dtype else x)


_op_fused_mlp = ops.op_overload("fused_mlp")


def fused_gated_mlp_func(x: Tensor, weight1: Tensor, weight2: Tensor, activation: str = "swiglu",
                         save_pre_act: bool = True, checkpoint_lvl: int = 0, heuristic: Union[int, str] = "auto",
                         bias2: Optional[Tensor] = None, return_residual: bool = False):
    """down(act(gate(x)) * up(x)) for x of shape [..., in_features]: the gated MLP of Llama-family
    models (act = SiLU for 'swiglu', tanh GELU for 'geglu'); (out, x) with return_residual.

    weight1 is the packed gate and up weight [2 * hidden, in_features] (``ops.pack_gate_up(gate_proj,
    up_proj)``; layout in docs/contract.md), weight2 the down weight [out_features, hidden]. bias2 is
    the optional down bias; the gated GEMM takes no bias. checkpoint_lvl and heuristic mean what
    they mean for :func:`fused_mlp_func`: level 0 keeps x, the packed pre-activation gu and the
    gated output, 1 keeps x and gu, 2 keeps x only. The tensor-parallel form is
    :class:`fused_dense.parallel.ParallelFusedGatedMLP`.

    The arguments, against the two forms users know: Hugging Face's LlamaMLP keeps gate_proj and
    up_proj as two weights and has no function form; flash-attn's GatedMlp packs fc1 as the two
    halves [up; gate] of one [2h, d] weight (``y, gate = fc1(x).chunk(2, -1)``) with bias1 and bias2
    on by default. Here weight1 is one packed weight as in flash-attn, but in the interleaved layout
    the fused GEMM reads (build it with ``ops.pack_gate_up`` from either form: flash-attn's halves
    are ``up, gate = w.chunk(2)``); activation is a name, as fused_mlp_func's; and there is no fc1
    bias, as in the Llama-family checkpoints.
    """
    act = ops.check_mlp_arguments(activation, checkpoint_lvl, "gated")
    return _one_process_mlp(x, weight1, weight2, None, bias2, activation, act, save_pre_act, return_residual,
                            checkpoint_lvl, heuristic)
