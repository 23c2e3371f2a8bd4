"""RMSNorm that hands its FP8 output to the FP8 layers it feeds: :class:`FusedRMSNorm`.

A decoder layer normalises its input once and feeds the result to several projections (q / k /
v, or the MLP). With FP8 layers each would quantize that input for itself; a
:class:`FusedRMSNorm` with ``fp8_handoff`` set instead runs the op ``norm_fp8`` (the norm and the
FP8 copies of its output, e4m3, current scaling: docs/contract.md, "Norms with FP8 output") and
hands the copies to the FP8 layers that read its output (``fused_dense.fp8``, ``hand_off``).
Without ``fp8_handoff`` (or under torch.compile, or for inputs the op does not take) it computes
Hugging Face's ``LlamaRMSNorm``: in float32, the normalised input rounded to the input's dtype,
then times the weight.
"""
from typing import Optional

import torch
from torch import Tensor, nn

from . import fp8 as _fp8

__all__ = ["FusedRMSNorm"]

_OP_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_E4M3 = 0


class _NormFp8Function(torch.autograd.Function):
    """out = RMSNorm(x) with its FP8 copies (not differentiable); backward: norm_backward."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float, columnwise: bool):
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        out, data, data_t, _, scale_inv, amax, rstd, _ = torch.ops.fused_dense.norm_fp8(
            x2, weight, None, eps, False, _E4M3, None, True, columnwise)
        ctx.save_for_backward(x2, weight, rstd)
        ctx.mark_non_differentiable(data, data_t, scale_inv, amax)
        return out.view(x.shape), data, data_t, scale_inv, amax

    @staticmethod
    def backward(ctx, grad_out, *unused):
        x2, weight, rstd = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        gx, gw, _ = torch.ops.fused_dense.norm_backward(grad_out.reshape(x2.shape).contiguous(), x2, weight, rstd,
                                                        None, [need_x, need_w, False])
        return (gx.view(grad_out.shape) if need_x else None), (gw if need_w else None), None, None


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

    def _hands_off(self, x: Tensor) -> bool:
        # under autocast the FP8 layers read a cast of the output, not the output: nothing to hand over
        return (self.fp8_handoff and self.training and not torch.compiler.is_compiling()
                and x.dtype in _OP_DTYPES and x.dtype == self.weight.dtype and x.shape[-1] % 16 == 0
                and x.numel() > 0 and x.device.type in ("cpu", "cuda")
                and not torch.is_autocast_enabled(x.device.type))

    def forward(self, x: Tensor) -> Tensor:
        if self._hands_off(x):
            columnwise = torch.is_grad_enabled()
            out, *copies = _NormFp8Function.apply(x, self.weight, float(self.variance_epsilon), columnwise)
            _fp8.hand_off(out, copies)
            return out
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, fp8_handoff={self.fp8_handoff}"


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
