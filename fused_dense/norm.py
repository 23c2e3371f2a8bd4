"""RMSNorm and LayerNorm that hand their FP8 output to the FP8 layers they feed:
:class:`FusedRMSNorm`, :class:`FusedLayerNorm`.

A decoder layer normalises its input once and feeds the result to several projections (q / k /
v, or the MLP). With FP8 layers each would quantize that input for itself; a norm here with
``fp8_handoff`` set instead runs the op ``norm_fp8`` (the norm and the FP8 copies of its output,
e4m3, current scaling: docs/contract.md, "Norms with FP8 output") and hands the copies to the FP8
layers that read its output (``fused_dense.fp8``, ``hand_off``). Without ``fp8_handoff`` (or under
torch.compile, or for inputs the op does not take) :class:`FusedRMSNorm` computes Hugging Face's
``LlamaRMSNorm`` (in float32, the normalised input rounded to the input's dtype, then times the
weight) and :class:`FusedLayerNorm` ``torch.nn.functional.layer_norm``.
"""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import fp8 as _fp8

__all__ = ["FusedLayerNorm", "FusedRMSNorm"]

_OP_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_E4M3 = 0


class _NormFp8Function(torch.autograd.Function):
    """out = RMSNorm(x) or LayerNorm(x) with its FP8 copies (not differentiable); backward:
    norm_backward."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Optional[Tensor], eps: float, layer_norm: bool,
                columnwise: bool):
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        out, data, data_t, _, scale_inv, amax, rstd, mean = torch.ops.fused_dense.norm_fp8(
            x2, weight, bias, eps, layer_norm, _E4M3, None, True, columnwise)
        ctx.save_for_backward(x2, weight, rstd, mean if layer_norm else None)
        ctx.has_bias = bias is not None
        ctx.mark_non_differentiable(data, data_t, scale_inv, amax)
        return out.view(x.shape), data, data_t, scale_inv, amax

    @staticmethod
    def backward(ctx, grad_out, *unused):
        x2, weight, rstd, mean = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = ctx.has_bias and ctx.needs_input_grad[2]
        gx, gw, gb = torch.ops.fused_dense.norm_backward(grad_out.reshape(x2.shape).contiguous(), x2, weight, rstd,
                                                         mean, [need_x, need_w, need_b])
        return ((gx.view(grad_out.shape) if need_x else None), (gw if need_w else None), (gb if need_b else None),
                None, None, None)


def _hands_off(module: nn.Module, x: Tensor) -> bool:
    """Whether ``module`` (a norm with ``fp8_handoff`` and ``weight``) makes its output with the op
    and hands the copies over: training, eager, an input the op takes. Under autocast the FP8
    layers read a cast of the output, not the output: nothing to hand over."""
    return (module.fp8_handoff and module.training and not torch.compiler.is_compiling()
            and x.dtype in _OP_DTYPES and x.dtype == module.weight.dtype and x.shape[-1] % 16 == 0
            and x.numel() > 0 and x.device.type in ("cpu", "cuda")
            and not torch.is_autocast_enabled(x.device.type))


class FusedRMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dim, Hugging Face ``LlamaRMSNorm``'s
    module shape (``weight``, ``variance_epsilon``) and state-dict names.

    fp8_handoff: in training, make the output with the op ``norm_fp8`` and hand its FP8 copies to
    the FP8 layers (current scaling) that read it; the output is then rounded once from float32
    (``(x * rstd * weight)``), not twice as Hugging Face's (within one unit of the last place).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, fp8_handoff: bool = False, device=None,
                 dtype=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.variance_epsilon = eps
        self.fp8_handoff = fp8_handoff

    def forward(self, x: Tensor) -> Tensor:
        if _hands_off(self, x):
            columnwise = torch.is_grad_enabled()
            out, *copies = _NormFp8Function.apply(x, self.weight, None, float(self.variance_epsilon), False, columnwise)
            _fp8.hand_off(out, copies)
            return out
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, fp8_handoff={self.fp8_handoff}"


class FusedLayerNorm(nn.LayerNorm):
    """``torch.nn.LayerNorm`` over the last dim (with ``weight``; ``bias`` optional) whose output,
    with ``fp8_handoff`` in training, is made by the op ``norm_fp8`` and its FP8 copies handed to
    the FP8 layers (current scaling) that read it. An ``nn.LayerNorm``: same attributes, state-dict
    names and ``isinstance``. The handed-off output is ``(x - mean) * rstd * weight + bias`` in
    float32 rounded once, as ``layer_norm``'s, with the row sums in another order (within one unit
    of the last place where no cancellation by the bias makes it smaller).
    """

    def __init__(self, normalized_shape: int, eps: float = 1e-5, bias: bool = True, fp8_handoff: bool = False,
                 device=None, dtype=None) -> None:
        super().__init__(normalized_shape, eps=eps, elementwise_affine=True, bias=bias, device=device, dtype=dtype)
        if len(self.normalized_shape) != 1:
            raise ValueError(f"FusedLayerNorm: normalized_shape must be one width (the last dim), "
                             f"got {tuple(self.normalized_shape)}")
        self.fp8_handoff = fp8_handoff

    def forward(self, x: Tensor) -> Tensor:
        if _hands_off(self, x) and (self.bias is None or self.bias.dtype == x.dtype):
            columnwise = torch.is_grad_enabled()
            out, *copies = _NormFp8Function.apply(x, self.weight, self.bias, float(self.eps), True, columnwise)
            _fp8.hand_off(out, copies)
            return out
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8_handoff={self.fp8_handoff}"


def fused_rms_norm_from(norm: nn.Module, fp8_handoff: bool) -> Optional[FusedRMSNorm]:
    """A FusedRMSNorm holding ``norm``'s weight Parameter, for a module of LlamaRMSNorm's shape
    (``weight`` [hidden], ``variance_epsilon``), else None."""
    weight, eps = getattr(norm, "weight", None), getattr(norm, "variance_epsilon", None)
    if not isinstance(weight, nn.Parameter) or weight.dim() != 1 or not isinstance(eps, float):
        return None
    fused = FusedRMSNorm(weight.shape[0], eps, fp8_handoff, device="meta")
    fused.weight = weight
    fused.train(norm.training)
    return fused


def fused_layer_norm_from(norm: nn.Module, fp8_handoff: bool) -> Optional[FusedLayerNorm]:
    """A FusedLayerNorm holding ``norm``'s weight and bias Parameters, for an ``nn.LayerNorm`` over
    one width with a weight, else None."""
    if not isinstance(norm, nn.LayerNorm) or len(norm.normalized_shape) != 1 or \
            not isinstance(norm.weight, nn.Parameter):
        return None
    fused = FusedLayerNorm(norm.normalized_shape[0], norm.eps, norm.bias is not None, fp8_handoff, device="meta")
    fused.weight = norm.weight
    if norm.bias is not None:
        fused.bias = norm.bias
    fused.train(norm.training)
    return fused
