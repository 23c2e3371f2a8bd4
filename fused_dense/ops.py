"""Typed Python wrappers over torch.ops.fused_dense.*.

The ops take 2-D contiguous tensors; the autograd layer (functional.py) reshapes and makes
inputs contiguous. Activations are passed by name here and by integer code to the ops.
"""
from typing import List, Optional, Tuple, Union

import torch
from torch import Tensor

from ._loader import load_library

load_library()

ACTIVATIONS = {"none": 0, "gelu_approx": 1, "relu": 2, "sqrelu": 3}
HEURISTIC_AUTO = -2
HEURISTIC_UNFUSED = -1

Heuristic = Union[int, str]


def activation_code(activation: str) -> int:
    try:
        return ACTIVATIONS[activation]
    except KeyError:
        raise ValueError(
            f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}"
        ) from None


def heuristic_code(heuristic: Heuristic) -> int:
    """'auto' -> -2 (also accepted as is); -1 (unfused) and cuBLASLt indices >= 0 pass through."""
    if isinstance(heuristic, str):
        if heuristic == "auto":
            return HEURISTIC_AUTO
        raise ValueError(f"heuristic must be 'auto', -1 (unfused) or an index >= 0, got {heuristic!r}")
    if isinstance(heuristic, bool) or not isinstance(heuristic, int):
        raise ValueError(f"heuristic must be 'auto', -1 (unfused) or an index >= 0, got {heuristic!r}")
    if heuristic < HEURISTIC_AUTO:
        raise ValueError(f"heuristic must be 'auto', -1 (unfused) or an index >= 0, got {heuristic}")
    return heuristic


def relu_mask_row_bytes(cols: int) -> int:
    """Bytes per row of the ReLU bit-mask: bit j%8 of byte j//8 of row i is pre_act[i, j] >= 0.

    ">= 0" is cuBLASLt's RELU_AUX convention; every path (fused, unfused, CPU) follows it, so the
    gradient at an exact zero pre-activation is passed (PyTorch's relu passes none there).
    """
    return (cols + 7) // 8


# Each op's default overload, resolved once at import (calling it skips the overload-packet
# resolution). Resolved eagerly, not on first use: torch.compile traces the backward lazily, and
# filling a dict from inside a traced autograd.Function is a side effect it refuses (fullgraph=True
# failed in a fresh process whose first backward was compiled).
_OVERLOADS = {name: getattr(torch.ops.fused_dense, name).default
              for name in ("linear_act", "act_linear_dgrad", "linear_bias_wgrad", "act_forward")}


def _op(name: str):
    return _OVERLOADS[name]


# Entry points taking checked integer codes: the autograd Functions resolve activation and
# heuristic once per call and use these on the per-call path; the named wrappers below convert
# and check their arguments first.

def linear_act_coded(input: Tensor, weight: Tensor, bias: Optional[Tensor], activation: int,
                     save_pre_act: bool, heuristic: int) -> Tuple[Tensor, Optional[Tensor]]:
    res = _op("linear_act")(input, weight, bias, activation, save_pre_act, heuristic)
    return res[0], (res[1] if save_pre_act else None)


def act_linear_dgrad_coded(weight: Tensor, d_output: Tensor, pre_act: Optional[Tensor], activation: int,
                           has_d_bias: bool, heuristic: int) -> Tuple[Tensor, Optional[Tensor]]:
    res = _op("act_linear_dgrad")(weight, d_output, pre_act, activation, has_d_bias, heuristic)
    return res[0], (res[1] if has_d_bias else None)


def act_linear_dgrad_act_out_coded(weight: Tensor, d_output: Tensor, pre_act: Tensor, activation: int,
                                   has_d_bias: bool, heuristic: int) -> Tuple[Tensor, Optional[Tensor], Tensor]:
    """(d_input, d_bias or None, act(pre_act)); gelu_approx and sqrelu only. The activation
    output comes from the pass that reads pre_act for the derivative (checkpoint level 1)."""
    res = _op("act_linear_dgrad")(weight, d_output, pre_act, activation, has_d_bias, heuristic, True)
    return res[0], (res[1] if has_d_bias else None), res[-1]


def act_forward_coded(pre_act: Tensor, activation: int) -> Tensor:
    return _op("act_forward")(pre_act, activation)


def linear_act(input: Tensor, weight: Tensor, bias: Optional[Tensor], activation: str = "none",
               save_pre_act: bool = False, heuristic: Heuristic = "auto") -> Tuple[Tensor, Optional[Tensor]]:
    """out = act(input @ weight.T + bias); returns (out, pre_act or None).

    pre_act is the pre-activation [B, N] in the input dtype, or for 'relu' the uint8 bit-mask
    [B, ceil(N/8)].
    """
    return linear_act_coded(input, weight, bias, activation_code(activation), save_pre_act,
                            heuristic_code(heuristic))


def act_linear_dgrad(weight: Tensor, d_output: Tensor, pre_act: Optional[Tensor], activation: str = "none",
                     has_d_bias: bool = False, heuristic: Heuristic = "auto") -> Tuple[Tensor, Optional[Tensor]]:
    """d_input = (d_output @ weight) * act'(pre_act); returns (d_input, d_bias = d_input.sum(0) or None)."""
    return act_linear_dgrad_coded(weight, d_output, pre_act, activation_code(activation), has_d_bias,
                                  heuristic_code(heuristic))


def linear_bias_wgrad(input: Tensor, d_output: Tensor, has_d_bias: bool) -> Tuple[Tensor, Optional[Tensor]]:
    """(d_weight = d_output.T @ input, d_bias = d_output.sum(0) or None)."""
    res = _op("linear_bias_wgrad")(input, d_output, has_d_bias)
    return res[0], (res[1] if has_d_bias else None)


def act_forward(pre_act: Tensor, activation: str) -> Tensor:
    """act(pre_act), elementwise; used to recompute activations for checkpointing."""
    return act_forward_coded(pre_act, activation_code(activation))
