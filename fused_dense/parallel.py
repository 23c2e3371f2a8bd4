"""Tensor-parallel (and sequence-parallel) dense layers on torch.distributed.

Layout, for a process group of ``world_size`` ranks:

* ``ColumnParallelLinear`` holds a slice of the *output* features: its ``weight`` is rows
  ``[start, start + local_out)`` of the full ``[out_features, in_features]`` weight, its bias the
  same slice of the full bias. Input: the full activations (``sequence_parallel=False``) or this
  rank's dim-0 slice of them (``sequence_parallel=True``: gathered inside, before the GEMM).
  Output: this rank's slice of the output features, for every row.
* ``RowParallelLinear`` holds a slice of the *input* features: ``weight`` is columns
  ``[start, start + local_in)`` of the full weight. Each rank computes a partial product and the
  partials are summed across ranks: reduce-scattered along dim 0 (``sequence_parallel=True``,
  so each rank ends with its slice of the rows) or all-reduced (every rank gets all rows).
  The bias lives on rank 0 of the group only and is added to rank 0's partial sum, so it is
  counted once; its gradient on rank 0 is then the full gradient, and no rank needs a
  collective for it (nor a ``_shared_params`` / ``_sequence_parallel`` marker, which would make
  the helpers in ``distributed.py`` issue collectives that only rank 0 joins).
* ``ParallelFusedMLP`` is ``ColumnParallelLinear`` (fc1) -> activation -> ``RowParallelLinear``
  (fc2) in one fused autograd Function, with the gather of its input and the reduction of its
  output pipelined against its GEMMs in ``overlap_chunks`` row blocks (``fused_dense.pipeline``);
  the hidden activations never leave the rank.

Shard sizes come from ``get_dim_for_local_rank``: features are cut in units of ``multiple_of``
and the first ranks take one unit more when the units do not divide evenly.
"""
from typing import Optional

import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from . import ops
from .distributed import all_reduce, get_dim_for_local_rank, reduce_scatter
from .functional import fused_dense_func
from .pipeline import PipelinedColumnLinearFunc, PipelinedRowLinearFunc, pipelined_parallel_mlp

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "ParallelFusedMLP", "shard_range"]

def shard_range(dim: int, world_size: int, rank: int, multiple_of: int = 1) -> slice:
    """The slice of ``range(dim)`` that ``rank`` holds (shards in rank order, sizes from
    ``get_dim_for_local_rank``). Handy to load a full, unsharded weight into a parallel layer."""
    start = sum(get_dim_for_local_rank(dim, world_size, r, multiple_of) for r in range(rank))
    return slice(start, start + get_dim_for_local_rank(dim, world_size, rank, multiple_of))


def _check_overlap_chunks(overlap_chunks) -> None:
    if isinstance(overlap_chunks, bool) or not isinstance(overlap_chunks, int) or overlap_chunks < 1:
        raise ValueError(f"overlap_chunks must be an integer >= 1, got {overlap_chunks!r}")


def _require_group(process_group: Optional[ProcessGroup], cls: str) -> None:
    if process_group is None:
        raise ValueError(f"{cls} needs a process_group (e.g. torch.distributed.group.WORLD)")


class ColumnParallelLinear(nn.Linear):
    """``nn.Linear`` whose output features are split across ``process_group``.

    ``self.weight`` is ``[local_out_features, in_features]`` (see the module docstring).
    ``forward(x)``: ``x`` is ``[rows, ..., in_features]`` -- this rank's dim-0 slice when
    ``sequence_parallel`` (all-gathered inside), else the full input, identical on every rank.
    Returns ``[all rows, ..., local_out_features]``. With ``sequence_parallel`` and
    ``overlap_chunks > 1`` the gather of x runs block by block under the blocks' GEMMs
    (``fused_dense.pipeline``).
    """

    def __init__(self, in_features: int, out_features: int, process_group: ProcessGroup,
                 bias: bool = True, sequence_parallel: bool = True, multiple_of: int = 1,
                 device=None, dtype=None, overlap_chunks: int = 1) -> None:
        _require_group(process_group, type(self).__name__)
        _check_overlap_chunks(overlap_chunks)
        world_size = dist.get_world_size(process_group)
        rank = dist.get_rank(process_group)
        local_out = get_dim_for_local_rank(out_features, world_size, rank, multiple_of)
        super().__init__(in_features, local_out, bias=bias, device=device, dtype=dtype)
        self.process_group = process_group
        self.sequence_parallel = sequence_parallel
        self.multiple_of = multiple_of
        self.total_out_features = out_features
        self.shard = shard_range(out_features, world_size, rank, multiple_of)
        self.overlap_chunks = overlap_chunks

    def forward(self, x: Tensor) -> Tensor:
        if self.sequence_parallel and self.overlap_chunks > 1:
            return PipelinedColumnLinearFunc.apply(x, self.weight, self.bias, self.process_group,
                                                   self.overlap_chunks)
        return fused_dense_func(x, self.weight, self.bias, process_group=self.process_group,
                                sequence_parallel=self.sequence_parallel)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, total_out_features={self.total_out_features}, "
                f"shard=[{self.shard.start}:{self.shard.stop}], "
                f"sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(nn.Linear):
    """``nn.Linear`` whose input features are split across ``process_group``.

    ``self.weight`` is ``[out_features, local_in_features]``; ``self.bias`` exists on rank 0 of
    the group only. ``forward(x)``: ``x`` is ``[rows, ..., local_in_features]`` (e.g. the output
    of a ``ColumnParallelLinear``); returns ``[rows / world_size, ..., out_features]`` (this
    rank's dim-0 slice) when ``sequence_parallel``, else ``[rows, ..., out_features]``. With
    ``overlap_chunks > 1`` the reduction runs block by block under the blocks' GEMMs, and with
    ``sequence_parallel`` the gather of the output gradient in backward likewise.
    """

    def __init__(self, in_features: int, out_features: int, process_group: ProcessGroup,
                 bias: bool = True, sequence_parallel: bool = True, multiple_of: int = 1,
                 device=None, dtype=None, overlap_chunks: int = 1) -> None:
        _require_group(process_group, type(self).__name__)
        _check_overlap_chunks(overlap_chunks)
        world_size = dist.get_world_size(process_group)
        rank = dist.get_rank(process_group)
        local_in = get_dim_for_local_rank(in_features, world_size, rank, multiple_of)
        super().__init__(local_in, out_features, bias=bias and rank == 0, device=device, dtype=dtype)
        self.process_group = process_group
        self.sequence_parallel = sequence_parallel
        self.multiple_of = multiple_of
        self.total_in_features = in_features
        self.shard = shard_range(in_features, world_size, rank, multiple_of)
        self.overlap_chunks = overlap_chunks

    def forward(self, x: Tensor) -> Tensor:
        if self.overlap_chunks > 1:
            return PipelinedRowLinearFunc.apply(x, self.weight, self.bias, self.process_group,
                                                self.sequence_parallel, self.overlap_chunks)
        out = fused_dense_func(x, self.weight, self.bias)
        reduce_fn = reduce_scatter if self.sequence_parallel else all_reduce
        return reduce_fn(out, self.process_group)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, total_in_features={self.total_in_features}, "
                f"shard=[{self.shard.start}:{self.shard.stop}], "
                f"sequence_parallel={self.sequence_parallel}")


class ParallelFusedMLP(nn.Module):
    """Tensor-parallel ``FusedMLP``: ``fc2(act(fc1(x)))`` with fc1 a ``ColumnParallelLinear``
    and fc2 a ``RowParallelLinear`` over ``process_group``.

    Input and output follow the ``sequence_parallel`` convention of the two layers: with it,
    ``x`` and the result are this rank's dim-0 slices; without it, both are full and identical on
    every rank. ``hidden_features`` defaults to ``4 * in_features`` and ``out_features`` to
    ``in_features``; the hidden features are split as evenly as possible (first ranks take the
    remainder). ``activation``, ``checkpoint_lvl`` and ``heuristic`` mean what they mean for
    ``FusedMLP``. ``overlap_chunks`` (at most one per local row) is the number of row blocks
    whose collectives run under the neighbouring blocks' GEMMs, forward and backward
    (``fused_dense.pipeline``); the default 1 overlaps only backward's communication, as a
    single block allows.
    """

    def __init__(self, in_features: int, hidden_features: Optional[int] = None,
                 out_features: Optional[int] = None, activation: str = "gelu_approx",
                 process_group: Optional[ProcessGroup] = None, bias1: bool = True, bias2: bool = True,
                 sequence_parallel: bool = True, checkpoint_lvl: int = 0, heuristic="auto",
                 device=None, dtype=None, overlap_chunks: int = 1) -> None:
        super().__init__()
        ops.check_mlp_arguments(activation, checkpoint_lvl)
        ops.heuristic_code(heuristic)
        _check_overlap_chunks(overlap_chunks)
        _require_group(process_group, type(self).__name__)
        factory_kwargs = {"device": device, "dtype": dtype}
        out_features = out_features if out_features is not None else in_features
        hidden_features = hidden_features if hidden_features is not None else in_features * 4
        self.activation = activation
        self.process_group = process_group
        self.sequence_parallel = sequence_parallel
        self.checkpoint_lvl = checkpoint_lvl
        self.heuristic = heuristic
        self.overlap_chunks = overlap_chunks
        self.fc1 = ColumnParallelLinear(in_features, hidden_features, process_group, bias=bias1,
                                        sequence_parallel=sequence_parallel, **factory_kwargs)
        self.fc2 = RowParallelLinear(hidden_features, out_features, process_group, bias=bias2,
                                     sequence_parallel=sequence_parallel, **factory_kwargs)

    def forward(self, x: Tensor) -> Tensor:
        # The gather of x, fc1, the activation, fc2 and the reduction of its partial sums, with
        # the collectives of each row block running under the neighbouring blocks' GEMMs
        # (fused_dense/pipeline.py), forward and backward.
        return pipelined_parallel_mlp(
            x, self.fc1.weight, self.fc2.weight, self.fc1.bias, self.fc2.bias,
            activation=self.activation, save_pre_act=self.training,
            checkpoint_lvl=self.checkpoint_lvl, heuristic=self.heuristic,
            process_group=self.process_group, sequence_parallel=self.sequence_parallel,
            chunks=self.overlap_chunks,
        )

    def extra_repr(self) -> str:
        return (f"activation={self.activation!r}, sequence_parallel={self.sequence_parallel}, "
                f"checkpoint_lvl={self.checkpoint_lvl}, heuristic={self.heuristic!r}, "
                f"overlap_chunks={self.overlap_chunks}")
