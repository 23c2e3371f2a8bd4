"""nn.Modules over the fused autograd functions: ``FusedDense`` and ``FusedMLP``.

Drop-in replacements for ``flash_attn.ops.fused_dense.FusedDense`` / ``FusedMLP`` (same
constructor and ``forward(x, process_group=None)`` signatures). Parameters are ordinary
``nn.Linear`` parameters, so state_dicts load to and from plain PyTorch models: ``FusedDense``
*is* an ``nn.Linear``; ``FusedMLP`` holds ``fc1`` and ``fc2`` as ``nn.Linear``.

``heuristic='auto'`` (the ``FusedMLP`` default) is passed to the ops as code -2 and resolved in the
C++ core (csrc/core/linear.cpp, csrc/core/tuner.h), per GEMM (fc1 forward, fc2 dgrad through the
activation, and the plain GEMMs):

* on CUDA, each problem (op, dtype, widths, activation, bias / aux flags) and bucket of the token
  count takes its choice from the shipped table or the cache file, or times the candidates once at
  the bucket's representative token count -- the fused cuBLASLt epilogue (GELU_AUX / RELU_AUX with
  bias, DGELU / DRELU with bias gradient) with several cuBLASLt algorithms, and the plain GEMM
  followed by this library's elementwise kernel with several plain algorithms -- within a time
  budget, and keeps the fastest for the process (``fused_dense.tuning`` has the rules and
  settings);
* without measuring (``FUSED_DENSE_TUNING=0``, budget spent, or while a CUDA graph is being captured) a fixed
  rule chosen from H200 measurements applies: forward uses the fused epilogue with cuBLASLt's first
  algorithm; dgrad uses the plain GEMM + this library's fused activation-derivative / bias-gradient
  kernel (faster than cuBLASLt's DGELU_BGRAD at every measured shape).

Where cuBLASLt has no epilogue for a case (squared ReLU; a ReLU bit-mask or GELU pre-activation
whose width cuBLASLt's aux rules refuse) the unfused path runs, whatever the heuristic. ``-1``
forces the unfused path, ``n >= 0`` entry n of cuBLASLt's list (an index past the list is a
ValueError). The CPU kernels ignore the heuristic.
"""
from typing import Optional, Union

from torch import Tensor, nn

from . import ops
from .functional import fused_dense_func, fused_mlp_func

__all__ = ["FusedDense", "FusedMLP"]


class FusedDense(nn.Linear):
    """``nn.Linear`` whose forward/backward run on the fused ops.

    ``return_residual=True`` makes ``forward`` return ``(out, x)``. With a ``process_group``
    (tensor parallelism), ``x`` is this rank's sequence shard and is all-gathered before the GEMM
    (see :func:`fused_dense.functional.fused_dense_func`).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, return_residual: bool = False,
                 device=None, dtype=None) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.return_residual = return_residual

    def forward(self, x: Tensor, process_group=None):
        return fused_dense_func(x, self.weight, self.bias, return_residual=self.return_residual,
                                process_group=process_group)


class FusedMLP(nn.Module):
    """fc2(act(fc1(x))) with the activation fused into the GEMMs.

    Args:
        in_features: input width.
        hidden_features: fc1 output width (default ``4 * in_features``).
        out_features: fc2 output width (default ``in_features``).
        bias1, bias2: whether fc1 / fc2 have a bias.
        activation: ``'gelu_approx'`` (GELU, tanh approximation), ``'relu'`` or ``'sqrelu'``
            (squared ReLU).
        return_residual: forward returns ``(out, x)``.
        checkpoint_lvl: 0 keeps the pre-activation and activation output for backward, 1
            recomputes the activation output (ReLU keeps both, as at 0), 2 recomputes fc1.
        heuristic: ``'auto'`` (the rule in this module's docstring), ``-1`` (unfused) or a
            cuBLASLt algorithm index ``>= 0``.

    In eval mode nothing beyond the input itself is kept for backward (fc1 is recomputed if a
    backward does happen), and under ``torch.no_grad()`` nothing at all.
    """

    def __init__(self, in_features: int, hidden_features: Optional[int] = None, out_features: Optional[int] = None,
                 bias1: bool = True, bias2: bool = True, activation: str = "gelu_approx",
                 return_residual: bool = False, checkpoint_lvl: int = 0, heuristic: Union[int, str] = "auto",
                 device=None, dtype=None) -> None:
        super().__init__()
        ops.check_mlp_arguments(activation, checkpoint_lvl)
        ops.heuristic_code(heuristic)
        factory_kwargs = {"device": device, "dtype": dtype}
        out_features = out_features if out_features is not None else in_features
        hidden_features = hidden_features if hidden_features is not None else in_features * 4
        self.activation = activation
        self.return_residual = return_residual
        self.checkpoint_lvl = checkpoint_lvl
        self.heuristic = heuristic
        self.fc1 = nn.Linear(in_features, hidden_features, bias=bias1, **factory_kwargs)
        self.fc2 = nn.Linear(hidden_features, out_features, bias=bias2, **factory_kwargs)

    def forward(self, x: Tensor, process_group=None):
        out = fused_mlp_func(
            x, self.fc1.weight, self.fc2.weight, self.fc1.bias, self.fc2.bias,
            activation=self.activation,
            save_pre_act=self.training,
            return_residual=self.return_residual,
            checkpoint_lvl=self.checkpoint_lvl,
            heuristic=self.heuristic,
            process_group=process_group,
        )
        if self.return_residual:
            out, x = out
        if process_group is not None:
            # fc2's output is a partial sum per rank: sum it and keep this rank's sequence shard.
            from .distributed import reduce_scatter

            out = reduce_scatter(out, process_group)
        return (out, x) if self.return_residual else out

    def extra_repr(self) -> str:
        return (f"activation={self.activation!r}, checkpoint_lvl={self.checkpoint_lvl}, "
                f"heuristic={self.heuristic!r}, return_residual={self.return_residual}")
