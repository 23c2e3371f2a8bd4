"""nn.Modules over the fused autograd functions: ``FusedDense`` and ``FusedMLP``.

Drop-in replacements for ``flash_attn.ops.fused_dense.FusedDense`` / ``FusedMLP`` (same
constructor and ``forward(x, process_group=None)`` signatures). Parameters are ordinary
``nn.Linear`` parameters, so state_dicts load to and from plain PyTorch models: ``FusedDense``
*is* an ``nn.Linear``; ``FusedMLP`` holds ``fc1`` and ``fc2`` as ``nn.Linear``.

``heuristic='auto'`` (the ``FusedMLP`` default) is the tuner's measured choice, made in the C++
core per GEMM (fc1 forward, fc2 dgrad through the activation, and the plain GEMMs); its rules are
written in docs/contract.md ("Heuristic codes") and steered by :mod:`fused_dense.tuning`. ``-1``
forces the unfused path, ``n >= 0`` entry n of cuBLASLt's list (an index past the list is a
ValueError). The CPU kernels ignore the heuristic.
"""
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import fp8 as _fp8
from . import ops
from ._common import GatedStateDictNames, check_gated_bias
from .fp8 import DENSE_SLOTS, MLP_SLOTS, Fp8Layer
from .functional import fused_dense_func, fused_gated_mlp_func, fused_mlp_func

__all__ = ["FusedDense", "FusedMLP", "FusedGatedMLP", "replace_llama_mlps"]


class FusedDense(Fp8Layer, nn.Linear):
    """``nn.Linear`` whose forward/backward run on the fused ops.

    ``return_residual=True`` makes ``forward`` return ``(out, x)``. With a ``process_group``
    (tensor parallelism), ``x`` is this rank's sequence shard and is all-gathered before the GEMM
    (see :func:`fused_dense.functional.fused_dense_func`).

    ``fp8``: a :class:`fused_dense.Float8Recipe` (or ``True`` for the default one) runs the layer's
    three GEMMs in FP8 (fused_dense/fp8.py); ``None`` follows :func:`fused_dense.fp8_autocast`.
    ``forward``'s ``is_first_microbatch`` keeps (True) or reuses (False) the weight's FP8 copy.
    With a ``process_group`` the FP8 step is the same composition: x is all-gathered (backward
    reduce-scatters its gradient), then quantized whole, alike on every rank; the size rule reads
    ``out_features`` times the group's size (the full width, for even shards).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, return_residual: bool = False,
                 device=None, dtype=None, fp8: Union[None, bool, "_fp8.Float8Recipe"] = None) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.return_residual = return_residual
        self._init_fp8(fp8, DENSE_SLOTS)

    def _fp8_recipe(self, process_group=None):
        return self._fp8_recipe_for((self.in_features, self.out_features * _group_size(process_group)))

    def forward(self, x: Tensor, process_group=None, is_first_microbatch: Optional[bool] = None):
        recipe = self._fp8_recipe(process_group)
        if recipe is not None:
            out = self._fp8_forward(recipe, x, is_first_microbatch, process_group=process_group)
            return (out, x) if self.return_residual else out
        return fused_dense_func(x, self.weight, self.bias, return_residual=self.return_residual,
                                process_group=process_group)


class FusedMLP(Fp8Layer, nn.Module):
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
        heuristic: ``'auto'`` (the tuner's choice, this module's docstring), ``-1`` (unfused) or a
            cuBLASLt algorithm index ``>= 0``.
        fp8: a :class:`fused_dense.Float8Recipe` (or ``True`` for the default one) runs the six
            GEMMs in FP8 (fused_dense/fp8.py; the checkpoint levels mean the same); ``None``
            follows :func:`fused_dense.fp8_autocast`. ``forward``'s ``is_first_microbatch`` keeps
            (True) or reuses (False) the weights' FP8 copies. With a ``process_group`` (this
            rank's hidden shard, x its rows) the FP8 step gathers x, runs the FP8 MLP on the
            shards and reduce-scatters fc2's partial sums, as in the model's dtype; the size rule
            reads the hidden width times the group's size.

    If torchao's ``convert_to_float8_training`` replaces fc1 and fc2, the MLP runs them in this
    library's FP8 with current scaling (and warns once), never silently in the model's dtype.

    In eval mode nothing beyond the input itself is kept for backward (fc1 is recomputed if a
    backward does happen), and under ``torch.no_grad()`` nothing at all.
    """

    def __init__(self, in_features: int, hidden_features: Optional[int] = None, out_features: Optional[int] = None,
                 bias1: bool = True, bias2: bool = True, activation: str = "gelu_approx",
                 return_residual: bool = False, checkpoint_lvl: int = 0, heuristic: Union[int, str] = "auto",
                 device=None, dtype=None, fp8: Union[None, bool, "_fp8.Float8Recipe"] = None) -> None:
        super().__init__()
        ops.check_mlp_arguments(activation, checkpoint_lvl)
        _fp8.check_fp8_argument(fp8)
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
        self._init_fp8(fp8, MLP_SLOTS)

    def _fp8_recipe(self, process_group=None):
        hidden = self.fc1.out_features * _group_size(process_group)
        return self._fp8_recipe_for((self.fc1.in_features, hidden, self.fc2.out_features), (self.fc1, self.fc2))

    def forward(self, x: Tensor, process_group=None, is_first_microbatch: Optional[bool] = None):
        recipe = self._fp8_recipe(process_group)
        if recipe is not None:
            out = self._fp8_forward(recipe, x, is_first_microbatch, (self.fc1, self.fc2), process_group)
        else:
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
                f"heuristic={self.heuristic!r}, return_residual={self.return_residual}, fp8={self.fp8!r}")


def _group_size(process_group) -> int:
    """The ranks a FusedDense / FusedMLP shard is one of: the size rule reads its sharded width
    (FusedDense's out_features, FusedMLP's hidden width) times this, which is the full width
    when the caller's shards are even (every rank then decides alike)."""
    if process_group is None:
        return 1
    import torch.distributed as dist

    return dist.get_world_size(process_group)


# ----------------------------------------------------------------------------------------------
# Gated MLP


class FusedGatedMLP(GatedStateDictNames, Fp8Layer, nn.Module):
    """down(act(gate(x)) * up(x)), the gated MLP of Llama, Mistral, Qwen ('swiglu': act = SiLU) and
    Gemma ('geglu': act = GELU, tanh approximation, as Hugging Face's ``gelu_pytorch_tanh``).

    Args:
        in_features: input width (Hugging Face's ``hidden_size``).
        hidden_features: the gated width h (``intermediate_size``). Required, as in LlamaMLP: the
            models set it (flash-attn's GatedMlp derives 8/3 * in_features rounded to multiple_of).
        out_features: down's output width (default ``in_features``).
        activation: ``'swiglu'`` or ``'geglu'`` (names, as FusedMLP's activation; flash-attn's
            GatedMlp takes a function, LlamaMLP a config string).
        bias: False. The gated GEMM takes no bias (LlamaMLP's ``mlp_bias=True`` is not supported);
            True is a ValueError.
        checkpoint_lvl: 0 keeps x, the packed pre-activation gu [.., 2h] and the gated output
            [.., h] for backward; 1 keeps x and gu and rebuilds the gated output in backward's
            gating pass; 2 keeps only x and re-runs the gate / up GEMM (docs/contract.md).
        heuristic: ``'auto'``, ``-1`` (unfused) or a cuBLASLt algorithm index, as FusedMLP's.
        fp8: a :class:`fused_dense.Float8Recipe` (or ``True`` for the default one) runs the six
            GEMMs in FP8 as FusedMLP's ``fp8`` does (the gated activation act(gate) * up and its
            gradient are quantized in one pass each; fused_dense/fp8.py); ``None`` follows
            :func:`fused_dense.fp8_autocast`. The size rule reads in_features, hidden_features and
            out_features. ``forward``'s ``is_first_microbatch`` keeps (True) or reuses (False) the
            weights' FP8 copies.

    Parameters: ``gate_up_proj`` (an ``nn.Linear`` without bias, ``in_features -> 2h``) holds the
    gate and up weights packed as the fused GEMM reads them (``ops.pack_gate_up``; layout in
    docs/contract.md); ``down_proj`` (``h -> out_features``). The state_dict uses LlamaMLP's names
    and layout whatever the packing: ``gate_proj.weight``, ``up_proj.weight``, ``down_proj.weight``
    on saving, and loading takes them (or ``gate_up_proj.weight``), so a LlamaMLP's state_dict loads
    here and this module's into a LlamaMLP. ``forward(x)`` takes ``[..., in_features]``.

    If torchao's ``convert_to_float8_training`` replaces gate_up_proj and down_proj, the MLP runs
    them in this library's FP8 with current scaling (and warns once), as FusedMLP does.
    """

    def __init__(self, in_features: int, hidden_features: int, out_features: Optional[int] = None,
                 activation: str = "swiglu", bias: bool = False, checkpoint_lvl: int = 0,
                 heuristic: Union[int, str] = "auto", device=None, dtype=None,
                 fp8: Union[None, bool, "_fp8.Float8Recipe"] = None) -> None:
        super().__init__()
        ops.check_mlp_arguments(activation, checkpoint_lvl, "gated")
        ops.heuristic_code(heuristic)
        check_gated_bias(bias)
        _fp8.check_fp8_argument(fp8)
        factory_kwargs = {"device": device, "dtype": dtype}
        out_features = out_features if out_features is not None else in_features
        self.activation = activation
        self.checkpoint_lvl = checkpoint_lvl
        self.heuristic = heuristic
        self.hidden_features = hidden_features
        self.gate_up_proj = nn.Linear(in_features, 2 * hidden_features, bias=False, **factory_kwargs)
        self.down_proj = nn.Linear(hidden_features, out_features, bias=False, **factory_kwargs)
        self._init_fp8(fp8, MLP_SLOTS)
        self._register_gated_state_dict_names()

    def _fp8_recipe(self):
        return self._fp8_recipe_for((self.gate_up_proj.in_features, self.hidden_features, self.down_proj.out_features),
                                    (self.gate_up_proj, self.down_proj))

    def forward(self, x: Tensor, is_first_microbatch: Optional[bool] = None) -> Tensor:
        recipe = self._fp8_recipe()
        if recipe is not None:
            return self._fp8_forward(recipe, x, is_first_microbatch, (self.gate_up_proj, self.down_proj))
        return fused_gated_mlp_func(x, self.gate_up_proj.weight, self.down_proj.weight, activation=self.activation,
                                    save_pre_act=self.training, checkpoint_lvl=self.checkpoint_lvl,
                                    heuristic=self.heuristic)

    def extra_repr(self) -> str:
        return (f"activation={self.activation!r}, checkpoint_lvl={self.checkpoint_lvl}, "
                f"heuristic={self.heuristic!r}, fp8={self.fp8!r}")


def _gate_activation(act_fn, where: str) -> str:
    """'swiglu' or 'geglu' for a Hugging Face MLP's act_fn, by what it computes (SiLU, or GELU with
    the tanh approximation); ValueError naming the module otherwise."""
    probe = torch.linspace(-6.0, 6.0, 97, dtype=torch.float64)
    with torch.no_grad():
        value = act_fn(probe)
    for name, ref in (("swiglu", F.silu(probe)), ("geglu", F.gelu(probe, approximate="tanh"))):
        if torch.allclose(value, ref, rtol=1e-6, atol=1e-9):
            return name
    raise ValueError(f"{where}: act_fn {act_fn!r} is neither SiLU nor GELU (tanh approximation); FusedGatedMLP "
                     f"takes 'swiglu' and 'geglu' only")


def is_llama_mlp(module: nn.Module) -> bool:
    """Whether `module` has the Hugging Face Llama-family MLP's shape: ``gate_proj``, ``up_proj``,
    ``down_proj`` linear layers and a callable ``act_fn``."""
    return all(isinstance(getattr(module, n, None), nn.Linear) for n in ("gate_proj", "up_proj", "down_proj")) \
        and callable(getattr(module, "act_fn", None))


def gated_activation_of(mlp: nn.Module, where: str) -> str:
    """The FusedGatedMLP activation of a Llama-family MLP ('swiglu' or 'geglu'); ValueError naming
    `where` when it has biases or another activation."""
    if any(getattr(mlp, n).bias is not None for n in ("gate_proj", "up_proj", "down_proj")):
        raise ValueError(f"{where} has biases (mlp_bias=True); FusedGatedMLP has none")
    return _gate_activation(mlp.act_fn, where)


def fused_gated_mlp_from(mlp: nn.Module, activation: str, checkpoint_lvl: int = 0,
                         heuristic: Union[int, str] = "auto",
                         fp8: Union[None, bool, "_fp8.Float8Recipe"] = None) -> "FusedGatedMLP":
    """A FusedGatedMLP holding a Llama-family MLP's weights (packed gate / up: new parameters), on
    its device and dtype and in its training mode."""
    w = mlp.gate_proj.weight
    fused = FusedGatedMLP(mlp.gate_proj.in_features, mlp.gate_proj.out_features, mlp.down_proj.out_features,
                          activation=activation, checkpoint_lvl=checkpoint_lvl, heuristic=heuristic,
                          device=w.device, dtype=w.dtype)
    fused.load_state_dict(mlp.state_dict())
    fused.fp8 = fp8  # after the load, which the delayed recipe's buffers would otherwise refuse
    _fp8.prepare_layer(fused)
    fused.train(mlp.training)
    return fused


def replace_llama_mlps(model: nn.Module, checkpoint_lvl: int = 0, heuristic: Union[int, str] = "auto",
                       fp8: Union[None, bool, "_fp8.Float8Recipe"] = None) -> int:
    """Replaces, in place, every Hugging Face Llama-family MLP in `model` (a module with
    ``gate_proj``, ``up_proj``, ``down_proj`` linear layers and an ``act_fn`` of SiLU or tanh GELU:
    LlamaMLP, MistralMLP, Qwen2MLP, GemmaMLP, ...) with a FusedGatedMLP holding the same weights,
    on the same device and dtype; returns how many it replaced. Every MLP is checked before any is
    replaced: one with biases or another activation is a ValueError naming it. The new modules hold
    new parameters (the packed gate / up weight): call it before building the optimizer. The model's
    state_dict keeps Hugging Face's names, so its checkpoints load either way. ``fp8`` is the new
    modules' FP8 argument (FusedGatedMLP's)."""
    _fp8.check_fp8_argument(fp8)
    found = [(name, m) for name, m in model.named_modules() if is_llama_mlp(m)]
    plans = []
    for name, mlp in found:
        if not name:
            raise ValueError("replace_llama_mlps: the model itself is an MLP; build a FusedGatedMLP and load its "
                             "state_dict instead")
        plans.append((name, mlp, gated_activation_of(mlp, f"replace_llama_mlps: {name}")))
    for name, mlp, activation in plans:
        fused = fused_gated_mlp_from(mlp, activation, checkpoint_lvl, heuristic, fp8)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, fused)
    return len(plans)
