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
* ``ParallelFusedGatedMLP`` is the gated form on the same pipeline: rank r holds the gate AND up
  rows of the same hidden units ``shard_range(hidden, world, r)``, packed as the local gated
  layer's weight (``ops.pack_gate_up(gate[shard], up[shard])``), and down's columns of those
  units (a ``RowParallelLinear``).

Shard sizes come from ``get_dim_for_local_rank``: features are cut in units of ``multiple_of``
and the first ranks take one unit more when the units do not divide evenly.

FP8 (``fp8=`` of ColumnParallelLinear, RowParallelLinear, ParallelFusedMLP and
ParallelFusedGatedMLP; the meaning, the recipes, :func:`fused_dense.fp8_autocast` and
:func:`fused_dense.convert_to_fp8` as for FusedMLP, fused_dense/fp8.py): the FP8 ops of the
single-process layers run on this rank's shards, between the differentiable collectives of
``distributed.py``:

* ColumnParallelLinear: x all-gathered (sequence parallel; else entered with ``copy_to_group``,
  whose backward all-reduces x's gradient) -> ``fp8_dense`` on the weight shard;
* RowParallelLinear: ``fp8_dense`` on the weight shard (bias on rank 0) -> reduce-scatter
  (sequence parallel) or all-reduce;
* ParallelFusedMLP: x gathered as for the column layer -> ``fused_mlp_fp8`` on the fc1 / fc2
  shards (fc2's bias on rank 0 only, so the reduction adds it once) -> reduce-scatter or
  all-reduce; ParallelFusedGatedMLP alike on its gate / up and down shards.

Scales are per tensor and per rank: a whole input (gathered, or replicated) is quantized alike on
every rank, and alike with the single-process layer; a weight shard, and what is sharded (the
row layer's input, the column layer's output gradient, the MLP's hidden activation and its
gradient), from this rank's amax. Delayed scaling keeps its history per layer and per rank (the
layer's buffers, in its state_dict). The size rule (``min_features``) reads the layer's full
widths (``in_features``, ``out_features``, ``hidden_features`` as given to the constructor), so
every rank decides alike and whether a layer runs in FP8 does not depend on the world size. The
FP8 GEMMs need every width a multiple of 16, this rank's shard included (``multiple_of=16``
makes the shards so). ``overlap_chunks > 1`` (the pipelined paths) does not run in FP8: the layer
raises NotImplementedError.
"""
from typing import Optional, Sequence, Union

import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from . import fp8 as _fp8
from . import ops
from ._common import GatedStateDictNames, check_gated_bias
from .distributed import all_reduce, get_dim_for_local_rank, reduce_scatter
from .fp8 import DENSE_SLOTS, MLP_SLOTS, Fp8Layer
from .functional import fused_dense_func
from .pipeline import PipelinedColumnLinearFunc, PipelinedRowLinearFunc, pipelined_parallel_mlp

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "ParallelFusedMLP", "ParallelFusedGatedMLP", "shard_range"]

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


def _reduce_partial(out: Tensor, process_group: ProcessGroup, sequence_parallel: bool) -> Tensor:
    """Sum the ranks' partial products: this rank's rows of the sum (sequence parallel) or all."""
    return (reduce_scatter if sequence_parallel else all_reduce)(out, process_group)


def _init_parallel_fp8(module: Fp8Layer, fp8, slots: Sequence[str]) -> None:
    """The FP8 argument and state of a parallel layer (Fp8Layer's); an explicit recipe that the
    layer cannot run is refused now rather than at the first forward."""
    module._init_fp8(fp8, slots)
    if fp8 is not None and fp8 is not False:
        module._fp8_recipe()


def _parallel_fp8_recipe(module: Fp8Layer, widths: Sequence[int], pipelined: bool, shard: tuple):
    """The recipe a parallel layer's forward runs under, or None (model dtype): Fp8Layer's, on
    the full ``widths``. ``shard``: (name, full width, multiple_of) of the sharded width, whose
    every rank's shard the FP8 GEMMs need to be a multiple of 16 (checked for all ranks, so all
    raise alike)."""
    recipe = module._fp8_recipe_for(widths)
    if recipe is None:
        return None
    cls = type(module).__name__
    if pipelined:
        raise NotImplementedError(
            f"{cls}: fp8 with overlap_chunks={module.overlap_chunks} is not supported (the pipelined "
            f"blocks run in the model's dtype only); use overlap_chunks=1 with fp8, or fp8=None")
    name, full, multiple_of = shard
    world = dist.get_world_size(module.process_group)
    sizes = [get_dim_for_local_rank(full, world, r, multiple_of or 1) for r in range(world)]
    if any(n % 16 for n in sizes):
        hint = "multiple_of=16 makes them so" if multiple_of is not None else f"choose {name} so"
        raise ValueError(f"{cls}: FP8 needs each rank's shard of {name}={full} to be a multiple of 16, got shards "
                         f"{sizes} over {world} ranks ({hint})")
    return recipe


def _init_parallel_mlp(module: nn.Module, family: str, activation: str, process_group, sequence_parallel: bool,
                       checkpoint_lvl: int, heuristic, overlap_chunks: int) -> None:
    """The checks and options a parallel MLP module of `family` ('plain', 'gated') starts with."""
    ops.check_mlp_arguments(activation, checkpoint_lvl, family)
    ops.heuristic_code(heuristic)
    _check_overlap_chunks(overlap_chunks)
    _require_group(process_group, type(module).__name__)
    module.activation = activation
    module.process_group = process_group
    module.sequence_parallel = sequence_parallel
    module.checkpoint_lvl = checkpoint_lvl
    module.heuristic = heuristic
    module.overlap_chunks = overlap_chunks


class ColumnParallelLinear(Fp8Layer, nn.Linear):
    """``nn.Linear`` whose output features are split across ``process_group``.

    ``self.weight`` is ``[local_out_features, in_features]`` (see the module docstring).
    ``forward(x)``: ``x`` is ``[rows, ..., in_features]`` -- this rank's dim-0 slice when
    ``sequence_parallel`` (all-gathered inside), else the full input, identical on every rank.
    Returns ``[all rows, ..., local_out_features]``. With ``sequence_parallel`` and
    ``overlap_chunks > 1`` the gather of x runs block by block under the blocks' GEMMs
    (``fused_dense.pipeline``).

    ``fp8``: as FusedDense's (a :class:`fused_dense.Float8Recipe`, ``True`` for the default one,
    ``None`` to follow :func:`fused_dense.fp8_autocast`); the module docstring has the FP8 path.
    ``forward``'s ``is_first_microbatch`` keeps (True) or reuses (False) the weight shard's FP8
    copy. FP8 with ``sequence_parallel`` and ``overlap_chunks > 1`` raises NotImplementedError.
    """

    def __init__(self, in_features: int, out_features: int, process_group: ProcessGroup,
                 bias: bool = True, sequence_parallel: bool = True, multiple_of: int = 1,
                 device=None, dtype=None, overlap_chunks: int = 1,
                 fp8: Union[None, bool, "_fp8.Float8Recipe"] = None) -> None:
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
        _init_parallel_fp8(self, fp8, DENSE_SLOTS)

    def _fp8_recipe(self):
        return _parallel_fp8_recipe(self, (self.in_features, self.total_out_features),
                                    self.sequence_parallel and self.overlap_chunks > 1,
                                    ("out_features", self.total_out_features, self.multiple_of))

    def forward(self, x: Tensor, is_first_microbatch: Optional[bool] = None) -> Tensor:
        recipe = self._fp8_recipe()
        if recipe is not None:
            return self._fp8_forward(recipe, x, is_first_microbatch, process_group=self.process_group,
                                     sequence_parallel=self.sequence_parallel)
        if self.sequence_parallel and self.overlap_chunks > 1:
            return PipelinedColumnLinearFunc.apply(x, self.weight, self.bias, self.process_group,
                                                   self.overlap_chunks)
        return fused_dense_func(x, self.weight, self.bias, process_group=self.process_group,
                                sequence_parallel=self.sequence_parallel)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, total_out_features={self.total_out_features}, "
                f"shard=[{self.shard.start}:{self.shard.stop}], "
                f"sequence_parallel={self.sequence_parallel}, fp8={self.fp8!r}")


class RowParallelLinear(Fp8Layer, nn.Linear):
    """``nn.Linear`` whose input features are split across ``process_group``.

    ``self.weight`` is ``[out_features, local_in_features]``; ``self.bias`` exists on rank 0 of
    the group only. ``forward(x)``: ``x`` is ``[rows, ..., local_in_features]`` (e.g. the output
    of a ``ColumnParallelLinear``); returns ``[rows / world_size, ..., out_features]`` (this
    rank's dim-0 slice) when ``sequence_parallel``, else ``[rows, ..., out_features]``. With
    ``overlap_chunks > 1`` the reduction runs block by block under the blocks' GEMMs, and with
    ``sequence_parallel`` the gather of the output gradient in backward likewise.

    ``fp8`` and ``forward``'s ``is_first_microbatch``: as ColumnParallelLinear's. FP8 with
    ``overlap_chunks > 1`` raises NotImplementedError.
    """

    def __init__(self, in_features: int, out_features: int, process_group: ProcessGroup,
                 bias: bool = True, sequence_parallel: bool = True, multiple_of: int = 1,
                 device=None, dtype=None, overlap_chunks: int = 1,
                 fp8: Union[None, bool, "_fp8.Float8Recipe"] = None) -> None:
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
        _init_parallel_fp8(self, fp8, DENSE_SLOTS)

    def _fp8_recipe(self):
        return _parallel_fp8_recipe(self, (self.total_in_features, self.out_features), self.overlap_chunks > 1,
                                    ("in_features", self.total_in_features, self.multiple_of))

    def forward(self, x: Tensor, is_first_microbatch: Optional[bool] = None) -> Tensor:
        recipe = self._fp8_recipe()
        if recipe is not None:
            out = self._fp8_forward(recipe, x, is_first_microbatch)
        elif self.overlap_chunks > 1:
            return PipelinedRowLinearFunc.apply(x, self.weight, self.bias, self.process_group,
                                                self.sequence_parallel, self.overlap_chunks)
        else:
            out = fused_dense_func(x, self.weight, self.bias)
        return _reduce_partial(out, self.process_group, self.sequence_parallel)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, total_in_features={self.total_in_features}, "
                f"shard=[{self.shard.start}:{self.shard.stop}], "
                f"sequence_parallel={self.sequence_parallel}, fp8={self.fp8!r}")


class ParallelFusedMLP(Fp8Layer, nn.Module):
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

    ``fp8``: as FusedMLP's (the module docstring has the tensor-parallel FP8 path); ``forward``'s
    ``is_first_microbatch`` keeps (True) or reuses (False) the shards' FP8 copies. In FP8 the
    collectives are not overlapped with the GEMMs, and ``overlap_chunks > 1`` raises
    NotImplementedError.
    """

    def __init__(self, in_features: int, hidden_features: Optional[int] = None,
                 out_features: Optional[int] = None, activation: str = "gelu_approx",
                 process_group: Optional[ProcessGroup] = None, bias1: bool = True, bias2: bool = True,
                 sequence_parallel: bool = True, checkpoint_lvl: int = 0, heuristic="auto",
                 device=None, dtype=None, overlap_chunks: int = 1,
                 fp8: Union[None, bool, "_fp8.Float8Recipe"] = None) -> None:
        super().__init__()
        _init_parallel_mlp(self, "plain", activation, process_group, sequence_parallel, checkpoint_lvl, heuristic,
                           overlap_chunks)
        factory_kwargs = {"device": device, "dtype": dtype}
        out_features = out_features if out_features is not None else in_features
        hidden_features = hidden_features if hidden_features is not None else in_features * 4
        self.fc1 = ColumnParallelLinear(in_features, hidden_features, process_group, bias=bias1,
                                        sequence_parallel=sequence_parallel, **factory_kwargs)
        self.fc2 = RowParallelLinear(hidden_features, out_features, process_group, bias=bias2,
                                     sequence_parallel=sequence_parallel, **factory_kwargs)
        _init_parallel_fp8(self, fp8, MLP_SLOTS)

    def _fp8_recipe(self):
        hidden = self.fc1.total_out_features
        return _parallel_fp8_recipe(self, (self.fc1.in_features, hidden, self.fc2.out_features),
                                    self.overlap_chunks > 1, ("hidden_features", hidden, None))

    def forward(self, x: Tensor, is_first_microbatch: Optional[bool] = None) -> Tensor:
        recipe = self._fp8_recipe()
        if recipe is not None:
            # fc2's bias lives on rank 0 only: the reduction adds it once.
            out = self._fp8_forward(recipe, x, is_first_microbatch, (self.fc1, self.fc2), self.process_group,
                                    self.sequence_parallel)
            return _reduce_partial(out, self.process_group, self.sequence_parallel)
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
                f"overlap_chunks={self.overlap_chunks}, fp8={self.fp8!r}")


class ParallelFusedGatedMLP(GatedStateDictNames, Fp8Layer, nn.Module):
    """Tensor-parallel ``FusedGatedMLP``: down(act(gate(x)) * up(x)) with gate and up
    column-parallel and down row-parallel over ``process_group``.

    Rank r holds the hidden units ``self.shard = shard_range(hidden_features, world, r)``: the gate
    and the up rows of those same units, packed (``gate_up_proj.weight``, ``[2 * local_hidden,
    in_features]``), and down's columns of them (``down_proj``, a ``RowParallelLinear``). Input and
    output follow ``sequence_parallel`` as in ``ParallelFusedMLP``; ``activation``,
    ``checkpoint_lvl``, ``heuristic`` and ``overlap_chunks`` mean what they mean there and in
    ``FusedGatedMLP``. ``bias`` must be False.

    state_dict / load_state_dict use LlamaMLP's names for this rank's shards (``gate_proj.weight``
    and ``up_proj.weight`` ``[local_hidden, in_features]``, ``down_proj.weight`` ``[out,
    local_hidden]``). ``load_full_state_dict`` loads a whole, unsharded FusedGatedMLP or LlamaMLP
    state_dict, cutting this rank's shard out of it.

    ``fp8``: as ParallelFusedMLP's: the FP8 step gathers x, runs the gated FP8 MLP on this rank's
    units and reduces down's partial sums; the size rule reads the full widths, and every rank's
    shard of hidden_features must be a multiple of 16. ``forward``'s ``is_first_microbatch`` keeps
    (True) or reuses (False) the shards' FP8 copies. FP8 with ``overlap_chunks > 1`` raises
    NotImplementedError.
    """

    def __init__(self, in_features: int, hidden_features: int, out_features: Optional[int] = None,
                 activation: str = "swiglu", process_group: Optional[ProcessGroup] = None, bias: bool = False,
                 sequence_parallel: bool = True, checkpoint_lvl: int = 0, heuristic="auto", device=None,
                 dtype=None, overlap_chunks: int = 1, fp8: Union[None, bool, "_fp8.Float8Recipe"] = None) -> None:
        super().__init__()
        check_gated_bias(bias)
        _init_parallel_mlp(self, "gated", activation, process_group, sequence_parallel, checkpoint_lvl, heuristic,
                           overlap_chunks)
        factory_kwargs = {"device": device, "dtype": dtype}
        out_features = out_features if out_features is not None else in_features
        world_size, rank = dist.get_world_size(process_group), dist.get_rank(process_group)
        self.hidden_features = hidden_features
        self.shard = shard_range(hidden_features, world_size, rank)
        local_hidden = self.shard.stop - self.shard.start
        self.gate_up_proj = nn.Linear(in_features, 2 * local_hidden, bias=False, **factory_kwargs)
        self.down_proj = RowParallelLinear(hidden_features, out_features, process_group, bias=False,
                                           sequence_parallel=sequence_parallel, **factory_kwargs)
        assert self.down_proj.shard == self.shard  # the same units on both sides
        _init_parallel_fp8(self, fp8, MLP_SLOTS)
        self._register_gated_state_dict_names()

    def _fp8_recipe(self):
        return _parallel_fp8_recipe(self, (self.gate_up_proj.in_features, self.hidden_features,
                                           self.down_proj.out_features),
                                    self.overlap_chunks > 1, ("hidden_features", self.hidden_features, None))

    def forward(self, x: Tensor, is_first_microbatch: Optional[bool] = None) -> Tensor:
        recipe = self._fp8_recipe()
        if recipe is not None:
            out = self._fp8_forward(recipe, x, is_first_microbatch, (self.gate_up_proj, self.down_proj),
                                    self.process_group, self.sequence_parallel)
            return _reduce_partial(out, self.process_group, self.sequence_parallel)
        return pipelined_parallel_mlp(
            x, self.gate_up_proj.weight, self.down_proj.weight, None, None, activation=self.activation,
            save_pre_act=self.training, checkpoint_lvl=self.checkpoint_lvl, heuristic=self.heuristic,
            process_group=self.process_group, sequence_parallel=self.sequence_parallel,
            chunks=self.overlap_chunks,
        )

    def load_full_state_dict(self, state_dict, strict: bool = True):
        """Loads this rank's shard of a whole (unsharded) gated MLP state_dict: LlamaMLP's or
        FusedGatedMLP's names (``gate_proj.weight``, ``up_proj.weight``, ``down_proj.weight``;
        or the packed ``gate_up_proj.weight``)."""
        sd = dict(state_dict)
        if "gate_up_proj.weight" in sd:
            sd["gate_proj.weight"], sd["up_proj.weight"] = ops.unpack_gate_up(sd.pop("gate_up_proj.weight"))
        for name in ("gate_proj.weight", "up_proj.weight"):
            if name in sd:
                sd[name] = sd[name][self.shard]
        if "down_proj.weight" in sd:
            sd["down_proj.weight"] = sd["down_proj.weight"][:, self.shard]
        return self.load_state_dict(sd, strict=strict)

    def extra_repr(self) -> str:
        return (f"activation={self.activation!r}, shard=[{self.shard.start}:{self.shard.stop}], "
                f"sequence_parallel={self.sequence_parallel}, checkpoint_lvl={self.checkpoint_lvl}, "
                f"heuristic={self.heuristic!r}, overlap_chunks={self.overlap_chunks}, fp8={self.fp8!r}")
