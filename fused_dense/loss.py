"""The LM head fused with its loss: linear + cross-entropy without materialising the logits.

:func:`linear_cross_entropy` computes ``cross_entropy(x @ weight.T + bias, target)`` chunk by chunk
over the tokens (the op ``fused_dense::linear_cross_entropy``, docs/contract.md): each chunk's
logits ``[chunk, vocab]`` are computed, turned into the loss and, in training, into their own
gradient in place, and the input and weight gradients are accumulated from them, so at most one
chunk of logits exists at a time. :class:`FusedLinearCrossEntropyLoss` is its module form.
"""
from typing import Optional, Union

import torch
from torch import Tensor, nn

from . import ops
from ._common import autocast_off, cast_for_op, compute_dtype

__all__ = ["linear_cross_entropy", "FusedLinearCrossEntropyLoss", "REDUCTIONS"]

# reduction name -> the op's code
REDUCTIONS = {"none": 0, "mean": 1, "sum": 2}

_op = ops.op_overload("linear_cross_entropy")


def _reduction_code(reduction: str) -> int:
    code = REDUCTIONS.get(reduction) if isinstance(reduction, str) else None
    if code is None:
        raise ValueError(f"linear_cross_entropy: reduction must be one of {sorted(REDUCTIONS)}, got {reduction!r}")
    return code


def _divisor(num_items_in_batch, reduction: str, device) -> Optional[Tensor]:
    if num_items_in_batch is None:
        return None
    if reduction != "mean":
        raise ValueError("linear_cross_entropy: num_items_in_batch replaces the mean's divisor (Hugging Face's "
                         f"loss normalisation) and needs reduction='mean', got reduction={reduction!r}")
    if isinstance(num_items_in_batch, Tensor):
        if num_items_in_batch.numel() != 1:
            raise ValueError("linear_cross_entropy: num_items_in_batch must hold one number, got shape "
                             f"{tuple(num_items_in_batch.shape)}")
        return num_items_in_batch.reshape(()).to(device=device, dtype=torch.float32)
    if isinstance(num_items_in_batch, bool) or not isinstance(num_items_in_batch, (int, float)):
        raise TypeError("linear_cross_entropy: num_items_in_batch must be a number or a one-element tensor, got "
                        f"{type(num_items_in_batch).__name__}")
    return torch.tensor(float(num_items_in_batch), dtype=torch.float32, device=device)


def linear_cross_entropy(x: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor] = None, *,
                         ignore_index: int = -100, label_smoothing: float = 0.0, z_loss: float = 0.0,
                         softcap: Optional[float] = None, reduction: str = "mean",
                         num_items_in_batch: Union[None, int, float, Tensor] = None,
                         chunk_size: Optional[int] = None, fp8: bool = False) -> Tensor:
    """``cross_entropy(softcap(x @ weight.T + bias), target)`` without materialising the logits.

    x: ``[..., d]`` (the hidden states); weight: ``[vocab, d]``; target: int64 ``[...]`` (x's leading
    shape), entries in ``[0, vocab)`` or ``ignore_index`` (those rows add nothing and are not
    counted by the mean); bias: ``[vocab]`` or None.
    label_smoothing: as :func:`torch.nn.functional.cross_entropy`'s (class-index targets).
    z_loss: adds ``z_loss * logsumexp(logits)**2`` for every counted row (PaLM's z-loss).
    softcap: logits become ``softcap * tanh(logits / softcap)`` before the softmax (Gemma 2).
    reduction: ``'mean'`` (over the counted rows), ``'sum'`` or ``'none'`` (float32 ``[...]``, 0 at
    ignored rows). num_items_in_batch: with ``'mean'``, the divisor in place of the count (Hugging
    Face's gradient-accumulation normalisation: the sum over this batch divided by it).
    chunk_size: tokens per chunk (None: the op's rule, docs/contract.md; what it picks:
        ``torch.ops.fused_dense.linear_cross_entropy_chunk_rows(tokens, d, vocab, x.element_size(), 0)``).
    fp8: the logits' GEMM and the input gradient's in FP8 (per-tensor current scaling: x and the
        weight in e4m3, each chunk's logits' gradient in e5m2; the weight's gradient stays in the
        model's dtype); off by default. Needs d and the vocabulary multiples of 16 and, on a GPU,
        compute capability 8.9 or later; holds the weight's two FP8 copies (2 · vocab · d bytes)
        through the call. docs/contract.md, "The LM head".

    Returns the loss in float32 (float64 for float64 inputs). The input, weight and bias gradients are computed during the forward
    when ``reduction`` is ``'mean'`` or ``'sum'`` (backward then scales them by the incoming
    gradient), and recomputed chunk by chunk in backward for ``'none'``. A second backward through
    the same graph (``retain_graph=True``) is refused for the first kind.
    Under autocast x, weight and bias run in the autocast dtype (as ``nn.Linear`` would).
    """
    code = _reduction_code(reduction)
    if softcap is None:
        softcap = 0.0
    elif not softcap > 0:
        raise ValueError(f"linear_cross_entropy: softcap must be positive or None, got {softcap}")
    if chunk_size is None:
        chunk_size = 0
    elif isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"linear_cross_entropy: chunk_size must be a positive int or None, got {chunk_size!r}")
    divisor = _divisor(num_items_in_batch, reduction, x.device)
    if divisor is not None:
        code = REDUCTIONS["sum"]
    if not isinstance(target, Tensor):
        raise TypeError(f"linear_cross_entropy: target must be a tensor, got {type(target).__name__}")
    if not isinstance(fp8, bool):
        raise TypeError(f"linear_cross_entropy: fp8 must be True or False, got {type(fp8).__name__}")
    dtype, autocast = compute_dtype(x)
    if autocast:
        x = cast_for_op(x, dtype, True)
        weight, bias = cast_for_op(weight, dtype, True), cast_for_op(bias, dtype, True)
        with autocast_off(x.device.type):
            return _op(x, weight, bias, target, ignore_index, float(label_smoothing), float(z_loss), float(softcap),
                       code, divisor, chunk_size, fp8)
    return _op(x, weight, bias, target, ignore_index, float(label_smoothing), float(z_loss), float(softcap), code,
               divisor, chunk_size, fp8)


class FusedLinearCrossEntropyLoss(nn.Module):
    """The module form of :func:`linear_cross_entropy`: ``loss_fn(x, weight, target, bias=None)``
    with the loss's settings held by the module (it has no parameters: pass the LM head's)."""

    def __init__(self, ignore_index: int = -100, label_smoothing: float = 0.0, z_loss: float = 0.0,
                 softcap: Optional[float] = None, reduction: str = "mean", chunk_size: Optional[int] = None,
                 fp8: bool = False) -> None:
        super().__init__()
        _reduction_code(reduction)
        self.ignore_index, self.label_smoothing, self.z_loss = ignore_index, label_smoothing, z_loss
        self.softcap, self.reduction, self.chunk_size, self.fp8 = softcap, reduction, chunk_size, fp8

    def forward(self, x: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor] = None,
                num_items_in_batch=None) -> Tensor:
        return linear_cross_entropy(x, weight, target, bias, ignore_index=self.ignore_index,
                                    label_smoothing=self.label_smoothing, z_loss=self.z_loss, softcap=self.softcap,
                                    reduction=self.reduction, num_items_in_batch=num_items_in_batch,
                                    chunk_size=self.chunk_size, fp8=self.fp8)

    def extra_repr(self) -> str:
        return (f"ignore_index={self.ignore_index}, label_smoothing={self.label_smoothing}, z_loss={self.z_loss}, "
                f"softcap={self.softcap}, reduction={self.reduction!r}, chunk_size={self.chunk_size}, fp8={self.fp8}")
