"""Drop-in replacement for flash-attn's `fused_dense_lib` extension module.

Same three functions, argument order and returns, so code written for
`import fused_dense_lib as fused_dense_cuda` runs unchanged.
"""
from typing import List, Optional

from torch import Tensor

import fused_dense  # noqa: F401  (loads the op library)
import torch


def linear_act_forward(input: Tensor, weight: Tensor, bias: Optional[Tensor], is_gelu: bool,
                       save_pre_act: bool, heuristic: int) -> List[Tensor]:
    """[out] or [out, pre_act]: GELU -> pre-activation [B, N]; ReLU -> bit-mask [B, N/8] uint8."""
    return torch.ops.fused_dense.linear_act_forward(input, weight, bias, is_gelu, save_pre_act, heuristic)


def linear_bias_wgrad(input: Tensor, d_output: Tensor, has_d_bias: bool) -> List[Optional[Tensor]]:
    """[d_weight [N, K], d_bias [N] or None]."""
    res = torch.ops.fused_dense.linear_bias_wgrad(input, d_output, has_d_bias)
    return [res[0], res[1] if has_d_bias else None]


def bias_act_linear_dgrad_bgrad(weight: Tensor, d_output: Tensor, pre_act: Tensor, is_gelu: bool,
                                heuristic: int) -> List[Tensor]:
    """[d_input = (d_output @ weight) * act'(pre_act), d_bias [K]]."""
    return torch.ops.fused_dense.bias_act_linear_dgrad_bgrad(weight, d_output, pre_act, is_gelu, heuristic)


__all__ = ["linear_act_forward", "linear_bias_wgrad", "bias_act_linear_dgrad_bgrad"]
