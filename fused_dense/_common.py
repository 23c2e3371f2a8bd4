"""What the package's layers share, below them all: the dtype and autocast choice, the preparation
of a Function's tensors, the three GEMM building blocks on the ops or on plain PyTorch, and the
gated layers' state-dict names. functional.py, pipeline.py, fp8.py, modules.py and parallel.py
import these names (public within the package; the module is private to it). This module imports
only ops.py.
"""
import contextlib
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from . import ops

OP_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
AUTOCAST_ELIGIBLE = (torch.float16, torch.bfloat16, torch.float32)
AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps")


def _devices_with_kernels():
    devices = []
    for key, device in (("CPU", "cpu"), ("CUDA", "cuda"), ("Meta", "meta")):
        if torch._C._dispatch_has_kernel_for_dispatch_key("fused_dense::linear_act", key):
            devices.append(device)
    return tuple(devices)


# Decided once at import: which device types the compiled ops serve.
OP_DEVICES = _devices_with_kernels()


# ----------------------------------------------------------------------------------------------
# dtype and backend choice


def compute_dtype(x: Tensor) -> Tuple[torch.dtype, bool]:
    """(dtype the layer runs in, whether autocast applies): the autocast dtype of x's device when
    autocast is on there and x is float16 / bfloat16 / float32, else x's own dtype."""
    device_type = x.device.type
    if x.dtype in AUTOCAST_ELIGIBLE and device_type in AUTOCAST_DEVICES \
            and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type), True
    return x.dtype, False


def autocast_off(device_type: str):
    """Autocast disabled for the ops inside the Functions when it is on for this device.

    The ops have no autocast kernels, so the Autocast dispatch key falls through and stays active
    for the ATen calls inside their CPU (and float64) kernels, which would then run their float32
    math in the autocast dtype. The Functions cast their inputs themselves, so autocast has
    nothing left to do inside them.
    """
    if device_type in AUTOCAST_DEVICES and torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type=device_type, enabled=False)
    return contextlib.nullcontext()


def prepare(t: Optional[Tensor], dtype: torch.dtype, cast: bool = True) -> Optional[Tensor]:
    """t row-major, and in `dtype` when `cast` (autocast) applies to it: at most one copy.

    (Tensor.to(memory_format=...) returns a non-contiguous tensor unchanged when no dtype or
    device change is asked for, hence the explicit copy.)
    """
    if t is None:
        return None
    target = dtype if cast and t.dtype in AUTOCAST_ELIGIBLE else t.dtype
    if t.dtype == target and t.is_contiguous():
        return t
    out = torch.empty(t.shape, dtype=target, device=t.device)
    out.copy_(t)
    return out


def cast_for_op(t: Optional[Tensor], dtype: torch.dtype, cast: bool) -> Optional[Tensor]:
    """t in `dtype` (when `cast` applies to it) and row-major, by differentiable ops that copy
    only when needed; None stays None."""
    if t is None:
        return None
    if cast and t.dtype in AUTOCAST_ELIGIBLE and t.dtype != dtype:
        t = t.to(dtype)
    return t.contiguous()


def use_ops(x: Tensor, *others: Optional[Tensor]) -> bool:
    """True when the compiled ops can serve these tensors (else the plain-PyTorch path runs)."""
    if x.device.type not in OP_DEVICES or x.dtype not in OP_DTYPES:
        return False
    for t in others:
        if t is not None and (t.dtype != x.dtype or t.device != x.device):
            return False
    return True


def check_op_tensors(where: str, x: Tensor, *others: Optional[Tensor]) -> None:
    if not use_ops(x, *others):
        raise TypeError(
            f"{where}: the fused_dense ops serve tensors of one dtype among "
            f"{[str(d).replace('torch.', '') for d in OP_DTYPES]} on one device among {list(OP_DEVICES)}; "
            f"got x {x.dtype} on {x.device} with "
            + ", ".join(f"{t.dtype} on {t.device}" for t in others if t is not None)
            + " (fused_mlp_func runs other dtypes and devices on plain PyTorch operators)")


# ----------------------------------------------------------------------------------------------
# The three GEMM building blocks, on the ops or on plain PyTorch.


def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], on_ops: bool) -> Tensor:
    if on_ops:
        return ops.linear_act_coded(x, weight, bias, ops.ACTIVATIONS["none"], False, ops.HEURISTIC_AUTO)[0]
    return F.linear(x, weight, bias)


def dgrad(weight: Tensor, d_output: Tensor, on_ops: bool) -> Tensor:
    if on_ops:
        return ops.act_linear_dgrad_coded(weight, d_output, None, ops.ACTIVATIONS["none"], False,
                                          ops.HEURISTIC_AUTO)[0]
    return d_output @ weight.conj()


def wgrad(x: Tensor, d_output: Tensor, has_d_bias: bool, on_ops: bool) -> Tuple[Tensor, Optional[Tensor]]:
    if on_ops:
        return ops.linear_bias_wgrad(x, d_output, has_d_bias)
    return d_output.t() @ x.conj(), (d_output.sum(0) if has_d_bias else None)


def bias_grad(d_output: Tensor) -> Tensor:
    """d_output.sum(0) alone (when the weight needs no gradient), accumulated in fp32 for 16-bit."""
    if d_output.dtype in (torch.float16, torch.bfloat16):
        return d_output.sum(0, dtype=torch.float32).to(d_output.dtype)
    return d_output.sum(0)


def as_2d(t: Tensor) -> Tensor:
    return t.reshape(-1, t.shape[-1])


def wait(handle) -> None:
    """Waits for an asynchronous collective's handle; None (nothing in flight) passes."""
    if handle is not None:
        handle.wait()


# ----------------------------------------------------------------------------------------------
# The gated layers (FusedGatedMLP, ParallelFusedGatedMLP)

_GATE_PROJ, _UP_PROJ, _PACKED = "gate_proj.weight", "up_proj.weight", "gate_up_proj.weight"


class GatedStateDictNames:
    """State-dict names of Hugging Face's LlamaMLP for a module whose packed gate and up weight is
    ``gate_up_proj.weight``: saving writes ``gate_proj.weight`` and ``up_proj.weight`` (unpacked
    with ``ops.unpack_gate_up``) in its place; loading takes those two (packed with
    ``ops.pack_gate_up``) or ``gate_up_proj.weight`` itself. ``down_proj.weight`` is the same
    tensor in both. The mixin of FusedGatedMLP and ParallelFusedGatedMLP (whose shards save and
    load this rank's units)."""

    def _register_gated_state_dict_names(self) -> None:
        self.register_state_dict_post_hook(_save_unpacked)
        self.register_load_state_dict_pre_hook(_load_packed)


def _save_unpacked(module, state_dict, prefix, local_metadata):
    packed = state_dict.pop(prefix + _PACKED, None)
    if packed is not None:
        gate, up = ops.unpack_gate_up(packed)
        state_dict[prefix + _GATE_PROJ], state_dict[prefix + _UP_PROJ] = gate, up


def _load_packed(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    gate, up = state_dict.get(prefix + _GATE_PROJ), state_dict.get(prefix + _UP_PROJ)
    if gate is None and up is None:
        return  # gate_up_proj.weight given itself, or missing (load_state_dict reports it)
    if gate is None or up is None:
        error_msgs.append(f"{prefix}: {_GATE_PROJ} and {_UP_PROJ} must be loaded together, got only "
                          f"{_GATE_PROJ if up is None else _UP_PROJ}")
        return
    if gate.shape != up.shape:
        error_msgs.append(f"{prefix}: {_GATE_PROJ} and {_UP_PROJ} must have the same shape, got "
                          f"{tuple(gate.shape)} and {tuple(up.shape)}")
        return
    del state_dict[prefix + _GATE_PROJ], state_dict[prefix + _UP_PROJ]
    state_dict[prefix + _PACKED] = ops.pack_gate_up(gate, up)


def check_gated_bias(bias) -> None:
    if bias is not False:
        raise ValueError(f"bias must be False: the gated layers have no bias (Llama-family MLPs have none), got "
                         f"{bias!r}")
