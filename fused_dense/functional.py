"""Autograd functions for fused dense layers: ``FusedDenseFunc`` and ``FusedMLPFunc``.

Signature-compatible with ``flash_attn.ops.fused_dense``: ``fused_dense_func`` computes
``x @ weight.T + bias``; ``fused_mlp_func`` computes ``fc2(act(fc1(x)))`` with the activation
fused into the first GEMM's epilogue and its derivative fused into the second GEMM's dgrad.

One MLP autograd: without a process group ``fused_mlp_func`` runs the op
``torch.ops.fused_dense.fused_mlp``, whose derivative is a C++ autograd Function
(csrc/torch/autograd/mlp.cpp; no Python runs between the GEMMs of a step). ``FusedMLPFunc`` (flash-
attn's name, the tensor-parallel path) adds only communication around the same C++ forward and
backward halves. The checkpoint rules live once, in that C++ file.

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

from . import fp8 as _fp8
from . import ops

__all__ = ["FusedDenseFunc", "FusedMLPFunc", "fused_dense_func", "fused_mlp_func", "fused_gated_mlp_func"]

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


def _linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], use_ops: bool) -> Tensor:
    if use_ops:
        return ops.linear_act_coded(x, weight, bias, ops.ACTIVATIONS["none"], False, ops.HEURISTIC_AUTO)[0]
    return F.linear(x, weight, bias)


def _dgrad(weight: Tensor, d_output: Tensor, use_ops: bool) -> Tensor:
    if use_ops:
        return ops.act_linear_dgrad_coded(weight, d_output, None, ops.ACTIVATIONS["none"], False,
                                          ops.HEURISTIC_AUTO)[0]
    return d_output @ weight.conj()


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


def _prepare_inputs(x: Tensor, params, dtype: torch.dtype, autocast: bool, gather_group):
    """(x, the whole x, params) in the layer's dtype and row-major; with gather_group, the
    all-gather of x runs while the parameters are cast."""
    x = _prepare(x, dtype)
    total_x, handle = (x, None) if gather_group is None else _start_gather(x, gather_group)
    params = tuple(_prepare(t, dtype, autocast) for t in params)
    _wait(handle)
    return x, total_x, params


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
        gather = process_group is not None and sequence_parallel
        x, total_x, (weight, bias) = _prepare_inputs(x, (weight, bias), dtype, autocast,
                                                     process_group if gather else None)
        batch_shape = total_x.shape[:-1]
        use_ops = _use_ops(total_x, weight, bias)
        out = _linear(_as_2d(total_x), weight, bias, use_ops)

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
            grad_x = _dgrad(weight, g, use_ops)
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
        dtype, autocast = _compute_dtype(x)
        with _autocast_off(x.device.type):
            gather = process_group is not None and sequence_parallel
            x, total_x, (weight1, bias1, weight2, bias2) = _prepare_inputs(
                x, (weight1, bias1, weight2, bias2), dtype, autocast, process_group if gather else None)
            _check_op_tensors("FusedMLPFunc", total_x, weight1, bias1, weight2, bias2)
            needs = list(ctx.needs_input_grad[:5])
            needs[2] = needs[2] and bias1 is not None
            needs[4] = needs[4] and bias2 is not None
            plan = ops.mlp_plan(act, lvl, needs)
            res = ops._op("fused_mlp_train_forward")(_as_2d(total_x), weight1, bias1, weight2, bias2, act, lvl, code,
                                                     needs)
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
        with _autocast_off(grad_output.device.type):
            return FusedMLPFunc._backward(ctx, grad_output, *grad_rest)

    @staticmethod
    def _backward(ctx, grad_output, *grad_rest):
        x, weight1, bias1, weight2, *saved = ctx.saved_tensors
        act, lvl, code, needs, recompute_fc1 = ctx.mlp
        need_x, need_w1, need_b1, need_w2, need_b2 = needs
        process_group = ctx.process_group
        g = _as_2d(grad_output.contiguous())

        handle_x = None
        total_x = x
        if x is not None and process_group is not None and ctx.sequence_parallel:
            total_x, handle_x = _start_gather(x, process_group)
        if recompute_fc1:  # fc1 is re-run first: x must be whole now
            _wait(handle_x)
            handle_x = None
        total_x2 = None if total_x is None else _as_2d(total_x)
        grads = iter(ops._op("fused_mlp_backward")(g, total_x2 if recompute_fc1 else None, weight1, bias1, weight2,
                                                   saved, act, lvl, code, needs))
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
            _wait(handle_x)
            grad_w1, _ = ops.linear_bias_wgrad(total_x2, d_pre, False)
        if need_x:
            _wait(handle_dx)
            if ctx.return_residual and grad_rest[0] is not None:
                grad_x = grad_x + grad_rest[0]
        return grad_x, grad_w1, grad_b1, grad_w2, grad_b2, None, None, None, None, None, None, None


def _check_op_tensors(where: str, x: Tensor, *others: Optional[Tensor]) -> None:
    if not _use_ops(x, *others):
        raise TypeError(
            f"{where}: the fused_dense ops serve tensors of one dtype among "
            f"{[str(d).replace('torch.', '') for d in _OP_DTYPES]} on one device among {list(_OP_DEVICES)}; "
            f"got x {x.dtype} on {x.device} with "
            + ", ".join(f"{t.dtype} on {t.device}" for t in others if t is not None)
            + " (fused_mlp_func runs other dtypes and devices on plain PyTorch operators)")


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
    dtype, autocast = _compute_dtype(x)
    xc = _cast_for_op(x, dtype, True)
    params = [_cast_for_op(t, dtype, autocast) for t in (weight1, bias1, weight2, bias2)]
    if xc.dim() == 0 or not _use_ops(xc, *params):
        with _autocast_off(x.device.type):
            out = _plain_mlp(xc, *params, activation)
    else:
        x2 = xc if xc.dim() == 2 else xc.reshape(-1, xc.shape[-1])
        with _autocast_off(x.device.type):
            out = _op_fused_mlp(x2, params[0], params[1], params[2], params[3], act, lvl, code)
        if xc.dim() != 2:
            out = out.reshape(*xc.shape[:-1], out.shape[-1])
    if not return_residual:
        return out
    # the residual is x itself, or under autocast the cast x that the layer read
    return out, (xc if xc.dtype != x.dtype else x)


def _cast_for_op(t: Optional[Tensor], dtype: torch.dtype, cast: bool) -> Optional[Tensor]:
    """t in `dtype` (when `cast` applies to it) and row-major, by differentiable ops that copy
    only when needed; None stays None."""
    if t is None:
        return None
    if cast and t.dtype in _AUTOCAST_ELIGIBLE and t.dtype != dtype:
        t = t.to(dtype)
    return t.contiguous()


_op_fused_mlp = ops._op("fused_mlp")


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


# ----------------------------------------------------------------------------------------------
# FP8 (fused_dense/fp8.py): the layers' calls of the FP8 ops, whose derivatives are C++ autograd
# Functions (csrc/torch/autograd/mlp_fp8.cpp).

_FP8_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _fp8_inputs(x: Tensor, params):
    """x as a 2-D row-major tensor in the layer's compute dtype (autocast resolved as for the other
    ops), and the biases in that dtype; the weights stay as they are (quantized from any dtype)."""
    dtype, autocast = _compute_dtype(x)
    if dtype not in _FP8_DTYPES:
        raise TypeError(f"FP8 layers take float16, bfloat16 or float32 inputs, got {dtype}")
    xc = _cast_for_op(x, dtype, True)
    biases = [None if b is None else _cast_for_op(b, dtype, True) for b in params]
    x2 = xc if xc.dim() == 2 else xc.reshape(-1, xc.shape[-1])
    return xc, x2, biases


def _fp8_scaling(module, recipe, slots, device):
    if recipe.scaling != "delayed":
        return None, None
    _fp8.ensure_delayed_buffers(module, recipe, slots, device)
    return _fp8.delayed_scales(module, recipe, slots), module.fp8_amax


def fp8_parallel_input(x: Tensor, process_group, sequence_parallel: bool = True) -> Tensor:
    """The input of a tensor-parallel FP8 step, differentiably: x in the layer's compute dtype
    (cast before the gather, as the other tensor-parallel paths cast), all-gathered along dim 0
    when ``sequence_parallel`` (x is this rank's rows; backward reduce-scatters x's gradient),
    else x itself, replicated (backward all-reduces the ranks' partial gradients). x as it is
    without a process group. The FP8 op then quantizes the whole input the same on every rank."""
    if process_group is None:
        return x
    from .distributed import all_gather, copy_to_group

    dtype, _ = _compute_dtype(x)
    xc = _cast_for_op(x, dtype, True)
    return all_gather(xc, process_group) if sequence_parallel else copy_to_group(xc, process_group)


def fp8_mlp_call(module, layers, recipe, x: Tensor, activation: str, checkpoint_lvl: int,
                 is_first_microbatch: Optional[bool]) -> Tensor:
    """The FP8 MLP step of FusedMLP, FusedGatedMLP and their parallel forms: the op fused_mlp_fp8
    over ``layers`` = (fc1, fc2) (FusedMLP's fc1 / fc2, a gated MLP's gate_up_proj / down_proj: the
    full layers or this rank's shards, whose partial sums the caller reduces), with the module's
    weight copies and scaling state."""
    act = _fp8.activation_code(activation)
    fc1, fc2 = layers
    xc, x2, (b1, b2) = _fp8_inputs(x, (fc1.bias, fc2.bias))
    weights = module._fp8_state.weight_copies((fc1.weight, fc2.weight), is_first_microbatch)
    scales, amax_out = _fp8_scaling(module, recipe, _fp8.MLP_SLOTS, x.device)
    with _autocast_off(x.device.type):
        out = torch.ops.fused_dense.fused_mlp_fp8(x2, fc1.weight, b1, fc2.weight, b2, act, checkpoint_lvl, weights,
                                                  recipe.grad_format_code, scales, amax_out)
    return out if xc.dim() == 2 else out.reshape(*xc.shape[:-1], out.shape[-1])


def fp8_dense_call(module, recipe, x: Tensor, is_first_microbatch: Optional[bool]) -> Tensor:
    """The FP8 step of FusedDense and the parallel linear layers (``module.weight`` / ``.bias``,
    a shard there): the op fp8_dense with the layer's weight copy and scaling state."""
    xc, x2, (b,) = _fp8_inputs(x, (module.bias,))
    weights = module._fp8_state.weight_copies((module.weight,), is_first_microbatch)
    scales, amax_out = _fp8_scaling(module, recipe, _fp8.DENSE_SLOTS, x.device)
    with _autocast_off(x.device.type):
        out = torch.ops.fused_dense.fp8_dense(x2, module.weight, b, weights, recipe.grad_format_code, scales, amax_out)
    return out if xc.dim() == 2 else out.reshape(*xc.shape[:-1], out.shape[-1])
