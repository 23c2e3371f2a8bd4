"""Typed Python wrappers over torch.ops.fused_dense.*.

The ops take 2-D contiguous tensors; the autograd layer (functional.py) reshapes and makes
inputs contiguous. Activations are passed by name here and by integer code to the ops; the codes
and every rule about them come from the compiled library.
"""
from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from ._loader import load_library

load_library()

# The schema's codes, defined once in C++ (csrc/core/types.h) and read here.
_ACTIVATION_NAMES, HEURISTIC_AUTO, HEURISTIC_UNFUSED, _LEVELS = torch.ops.fused_dense.library_constants()
CHECKPOINT_LEVELS = tuple(_LEVELS)
ACTIVATIONS = {name: code for code, name in enumerate(_ACTIVATION_NAMES)}
# The activations an MLP takes between its two GEMMs (every one but 'none').
MLP_ACTIVATIONS = tuple(name for name in _ACTIVATION_NAMES if ACTIVATIONS[name] != ACTIVATIONS["none"])

Heuristic = Union[int, str]


def activation_code(activation: str) -> int:
    """The schema code of an activation name; ValueError naming the valid ones otherwise."""
    try:
        return ACTIVATIONS[activation]
    except (KeyError, TypeError):
        raise ValueError(
            f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}"
        ) from None


def mlp_activation_code(activation: str) -> int:
    """As activation_code, for the activation between an MLP's GEMMs ('none' is refused)."""
    if not isinstance(activation, str) or activation not in MLP_ACTIVATIONS:
        raise ValueError(f"activation must be one of {list(MLP_ACTIVATIONS)}, got {activation!r}")
    return ACTIVATIONS[activation]


def heuristic_code(heuristic: Heuristic) -> int:
    """'auto' -> the auto code; integers pass as they are. The ops check the range (a code below
    'auto' or an index past cuBLASLt's list is an error there); this only turns the name into
    its code and refuses what is not an integer."""
    if isinstance(heuristic, str):
        if heuristic == "auto":
            return HEURISTIC_AUTO
    elif isinstance(heuristic, int) and not isinstance(heuristic, bool):
        if heuristic >= HEURISTIC_AUTO:
            return heuristic
    raise ValueError(f"heuristic must be 'auto', -1 (unfused) or an index >= 0, got {heuristic!r}")


def relu_mask_row_bytes(cols: int) -> int:
    """Bytes per row of the ReLU bit-mask (layout: docs/contract.md)."""
    return torch.ops.fused_dense.relu_mask_row_bytes(cols)


def check_mlp_arguments(activation: str, checkpoint_lvl: int) -> int:
    """The MLP's activation code, after checking it and checkpoint_lvl; ValueError naming the
    argument otherwise. Plain Python over the compiled library's codes, so torch.compile traces it."""
    code = mlp_activation_code(activation)
    if isinstance(checkpoint_lvl, bool) or not isinstance(checkpoint_lvl, int) \
            or checkpoint_lvl not in CHECKPOINT_LEVELS:
        levels = ", ".join(map(str, CHECKPOINT_LEVELS[:-1])) + f" or {CHECKPOINT_LEVELS[-1]}"
        raise ValueError(f"checkpoint_lvl must be {levels}, got {checkpoint_lvl!r}")
    return code


def mlp_plan(activation: int, checkpoint_lvl: int, needs_input_grad) -> dict:
    """The MLP's checkpoint plan (csrc/torch/fused_mlp.cpp): what the forward keeps and what
    backward recomputes, for the given needs_input_grad of (x, weight1, bias1, weight2, bias2)."""
    flags = _op("fused_mlp_plan")(activation, checkpoint_lvl, [bool(n) for n in needs_input_grad])
    return dict(zip(_PLAN_FIELDS, flags))


_PLAN_FIELDS = ("keep_pre", "keep_act_out", "recompute_fc1", "save_x", "save_weight1", "save_bias1",
                "save_weight2")


# Each op's default overload, resolved once at import (calling it skips the overload-packet
# resolution). Resolved eagerly, not on first use: torch.compile traces the backward lazily, and
# filling a dict from inside a traced autograd.Function is a side effect it refuses (fullgraph=True
# failed in a fresh process whose first backward was compiled).
_OVERLOADS = {name: getattr(torch.ops.fused_dense, name).default
              for name in ("linear_act", "act_linear_dgrad", "linear_bias_wgrad", "act_forward", "fused_mlp",
                           "fused_mlp_plan", "fused_mlp_train_forward", "fused_mlp_backward")}


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
