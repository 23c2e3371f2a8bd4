"""Typed Python wrappers over torch.ops.fused_dense.*.

The ops take 2-D contiguous tensors; the autograd layer (functional.py) reshapes and makes
inputs contiguous. Activations are passed by name here and by integer code to the ops; the codes
and every rule about them come from the compiled library.
"""
import functools
from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from ._loader import load_library

load_library()

# The schema's codes, defined once in C++ (csrc/core/common/types.h) and read here.
(_ACTIVATION_NAMES, HEURISTIC_AUTO, HEURISTIC_UNFUSED, _LEVELS, _GATED_CODES,
 GATED_INTERLEAVE, FP8_ROW_PAD) = torch.ops.fused_dense.library_constants()
CHECKPOINT_LEVELS = tuple(_LEVELS)
ACTIVATIONS = {name: code for code, name in enumerate(_ACTIVATION_NAMES)}
# The gated activations act(g) * u of a gated MLP (its fc1 is the packed gate and up weight).
GATED_ACTIVATIONS = tuple(_ACTIVATION_NAMES[code] for code in _GATED_CODES)
# The activations a (non-gated) MLP takes between its two GEMMs (every other one but 'none').
MLP_ACTIVATIONS = tuple(name for name in _ACTIVATION_NAMES
                        if ACTIVATIONS[name] != ACTIVATIONS["none"] and name not in GATED_ACTIVATIONS)

# The FP8 formats by name -> schema code (the ops' `fp8_format` / `grad_format` arguments), and the
# largest finite value of each, where saturation clamps.
FP8_FORMATS = {name: code for code, name in enumerate(torch.ops.fused_dense.fp8_formats())}
FP8_FORMAT_MAX = {name: torch.ops.fused_dense.fp8_format_max(code) for name, code in FP8_FORMATS.items()}
# Current scaling's scale is FP8_FORMAT_MAX / max(amax, FP8_MIN_AMAX).
FP8_MIN_AMAX = torch.ops.fused_dense.fp8_min_amax()

Heuristic = Union[int, str]


def activation_code(activation: str) -> int:
    """The schema code of an activation name; ValueError naming the valid ones otherwise."""
    try:
        return ACTIVATIONS[activation]
    except (KeyError, TypeError):
        raise ValueError(
            f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}"
        ) from None


_MLP_FAMILIES = {"plain": MLP_ACTIVATIONS, "gated": GATED_ACTIVATIONS, "any": MLP_ACTIVATIONS + GATED_ACTIVATIONS}


def mlp_activation_code(activation: str, family: str = "plain") -> int:
    """As activation_code, for the activation between an MLP's GEMMs ('none' is refused). family:
    'plain' (FusedMLP's), 'gated' (FusedGatedMLP's) or 'any'."""
    names = _MLP_FAMILIES[family]
    if not isinstance(activation, str) or activation not in names:
        raise ValueError(f"activation must be one of {list(names)}, got {activation!r}")
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


def check_mlp_arguments(activation: str, checkpoint_lvl: int, family: str = "plain") -> int:
    """The MLP's activation code, after checking it (among `family`'s, as mlp_activation_code) and
    checkpoint_lvl; ValueError naming the argument otherwise. Plain Python over the compiled
    library's codes, so torch.compile traces it."""
    code = mlp_activation_code(activation, family)
    if isinstance(checkpoint_lvl, bool) or not isinstance(checkpoint_lvl, int) \
            or checkpoint_lvl not in CHECKPOINT_LEVELS:
        levels = ", ".join(map(str, CHECKPOINT_LEVELS[:-1])) + f" or {CHECKPOINT_LEVELS[-1]}"
        raise ValueError(f"checkpoint_lvl must be {levels}, got {checkpoint_lvl!r}")
    return code


def mlp_plan(activation: int, checkpoint_lvl: int, needs_input_grad) -> dict:
    """The MLP's checkpoint plan (csrc/torch/mlp.h): what the forward keeps and what
    backward recomputes, for the given needs_input_grad of (x, weight1, bias1, weight2, bias2)."""
    flags = op_overload("fused_mlp_plan")(activation, checkpoint_lvl, [bool(n) for n in needs_input_grad])
    return dict(zip(_PLAN_FIELDS, flags))


@functools.lru_cache(maxsize=None)
def _gated_columns(hidden: int) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    gate, up = torch.ops.fused_dense.gated_columns(hidden)
    return tuple(gate), tuple(up)


def gated_columns(hidden: int, device=None) -> Tuple[Tensor, Tensor]:
    """(gate, up): int64 tensors of the packed rows (or columns) that hold each of the `hidden`
    units' gate and up values, in the layout the compiled library defines (csrc/core/common/types.h:
    blocks of GATED_INTERLEAVE units, each block's gate rows, then its up rows; docs/contract.md)."""
    if isinstance(hidden, bool) or not isinstance(hidden, int) or hidden < 0:
        raise ValueError(f"hidden must be an integer >= 0, got {hidden!r}")
    gate, up = _gated_columns(hidden)
    return (torch.tensor(gate, dtype=torch.long, device=device), torch.tensor(up, dtype=torch.long, device=device))


def pack_gate_up(gate: Tensor, up: Tensor, dim: int = 0) -> Tensor:
    """The packed [.., 2h, ..] tensor of a gated layer from its gate and up parts [.., h, ..] along
    `dim`: e.g. Hugging Face's gate_proj.weight and up_proj.weight [h, d] -> the fc1 weight [2h, d]
    that the gated ops take."""
    if gate.shape != up.shape:
        raise ValueError(f"gate and up must have the same shape, got {tuple(gate.shape)} and {tuple(up.shape)}")
    if gate.dim() == 0:
        raise ValueError("gate and up must have at least one dimension")
    dim = dim % gate.dim()
    g_cols, u_cols = gated_columns(gate.shape[dim], gate.device)
    shape = list(gate.shape)
    shape[dim] *= 2
    packed = gate.new_empty(shape)
    packed.index_copy_(dim, g_cols, gate)
    packed.index_copy_(dim, u_cols, up)
    return packed


def unpack_gate_up(packed: Tensor, dim: int = 0) -> Tuple[Tensor, Tensor]:
    """(gate, up) of a packed gated tensor along `dim`: the inverse of pack_gate_up."""
    if packed.dim() == 0 or packed.shape[dim] % 2 != 0:
        raise ValueError(f"packed must have an even size along dim {dim}, got shape {tuple(packed.shape)}")
    g_cols, u_cols = gated_columns(packed.shape[dim] // 2, packed.device)
    return packed.index_select(dim, g_cols), packed.index_select(dim, u_cols)


_PLAN_FIELDS = ("keep_pre", "keep_act_out", "recompute_fc1", "save_x", "save_weight1", "save_bias1",
                "save_weight2")


# Each op's default overload, resolved once at import (calling it skips the overload-packet
# resolution). Resolved eagerly, not on first use: torch.compile traces the backward lazily, and
# filling a dict from inside a traced autograd.Function is a side effect it refuses (fullgraph=True
# failed in a fresh process whose first backward was compiled).
_OVERLOADS = {name: getattr(torch.ops.fused_dense, name).default
              for name in ("linear_act", "act_linear_dgrad", "linear_bias_wgrad", "act_forward", "dense", "fused_mlp",
                           "fused_mlp_plan", "fused_mlp_train_forward", "fused_mlp_backward", "gated_linear",
                           "gated_linear_dgrad", "gated_act_forward", "linear_cross_entropy")}


def op_overload(name: str):
    """The default overload of ``torch.ops.fused_dense.<name>`` (resolved at import), for the
    autograd code that calls an op directly with checked codes."""
    return _OVERLOADS[name]


# Entry points taking checked integer codes: the autograd Functions resolve activation and
# heuristic once per call and use these on the per-call path; the named wrappers below convert
# and check their arguments first.

def linear_act_coded(input: Tensor, weight: Tensor, bias: Optional[Tensor], activation: int,
                     save_pre_act: bool, heuristic: int) -> Tuple[Tensor, Optional[Tensor]]:
    res = op_overload("linear_act")(input, weight, bias, activation, save_pre_act, heuristic)
    return res[0], (res[1] if save_pre_act else None)


def act_linear_dgrad_coded(weight: Tensor, d_output: Tensor, pre_act: Optional[Tensor], activation: int,
                           has_d_bias: bool, heuristic: int) -> Tuple[Tensor, Optional[Tensor]]:
    res = op_overload("act_linear_dgrad")(weight, d_output, pre_act, activation, has_d_bias, heuristic)
    return res[0], (res[1] if has_d_bias else None)


def act_linear_dgrad_act_out_coded(weight: Tensor, d_output: Tensor, pre_act: Tensor, activation: int,
                                   has_d_bias: bool, heuristic: int) -> Tuple[Tensor, Optional[Tensor], Tensor]:
    """(d_input, d_bias or None, act(pre_act)); gelu_approx and sqrelu only. The activation
    output comes from the pass that reads pre_act for the derivative (checkpoint level 1)."""
    res = op_overload("act_linear_dgrad")(weight, d_output, pre_act, activation, has_d_bias, heuristic, True)
    return res[0], (res[1] if has_d_bias else None), res[-1]


def act_forward_coded(pre_act: Tensor, activation: int) -> Tensor:
    return op_overload("act_forward")(pre_act, activation)


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
    res = op_overload("linear_bias_wgrad")(input, d_output, has_d_bias)
    return res[0], (res[1] if has_d_bias else None)


def act_forward(pre_act: Tensor, activation: str) -> Tensor:
    """act(pre_act), elementwise; used to recompute activations for checkpointing."""
    return act_forward_coded(pre_act, activation_code(activation))


def gated_linear(input: Tensor, weight: Tensor, activation: str = "swiglu", save_pre_act: bool = False,
                 heuristic: Heuristic = "auto") -> Tuple[Tensor, Optional[Tensor]]:
    """(act(g) * u [B, h], the packed pre-activation gu [B, 2h] or None): gu = input @ weight.T for
    the packed weight [2h, K] (pack_gate_up); act is SiLU ('swiglu') or tanh GELU ('geglu')."""
    res = op_overload("gated_linear")(input, weight, mlp_activation_code(activation, "gated"), save_pre_act,
                              heuristic_code(heuristic))
    return res[0], (res[1] if save_pre_act else None)


def gated_linear_dgrad(weight: Tensor, d_output: Tensor, pre_act: Tensor, activation: str = "swiglu",
                       heuristic: Heuristic = "auto") -> Tensor:
    """The packed gradient d_gu [B, 2h] at the pre-activation gu [B, 2h], from the gradient
    d_output [B, N] of the next layer's output and its weight [N, h]."""
    return op_overload("gated_linear_dgrad")(weight, d_output, pre_act, mlp_activation_code(activation, "gated"),
                                     heuristic_code(heuristic))[0]


def gated_act_forward(pre_act: Tensor, activation: str = "swiglu") -> Tensor:
    """act(g) * u [B, h] of a packed pre-activation gu [B, 2h]."""
    return op_overload("gated_act_forward")(pre_act, mlp_activation_code(activation, "gated"))
