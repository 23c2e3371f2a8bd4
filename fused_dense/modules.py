"""nn.Modules over the fused autograd functions: ``FusedDense``, ``FusedMLP``, ``FusedGatedMLP``
and ``FusedQKV`` (an attention's q / k / v as one FusedDense, with ``fuse_qkv_projections``).

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

__all__ = ["FusedDense", "FusedMLP", "FusedGatedMLP", "FusedQKV", "QKVPart", "fuse_qkv_projections",
           "replace_llama_mlps"]


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


class FusedQKV(FusedDense):
    """The q, k and v projections of one input as one GEMM: a FusedDense whose ``weight`` is q's,
    k's and v's weights stacked ``[sum(out_splits), in_features]`` (``bias`` likewise). The input
    is read once (in FP8 quantized once, and the size rule reads the stacked width, so GQA's
    narrow k / v run in FP8 with q), and backward runs one data-gradient GEMM, not three summed,
    and one weight-gradient GEMM.

    ``forward(x)`` returns the stacked output ``[..., sum(out_splits)]``. ``project(x, i)`` returns
    part i (0 q, 1 k, 2 v) of x's projection: asked for the three parts of one input tensor in turn
    (the same object, unmodified), it runs the GEMM once and hands out its three parts of one
    ``torch.split`` (so backward joins their gradients in one copy); any other call (another input,
    a part asked twice) runs the GEMM again, so a caller that projects different inputs (cross
    attention) gets correct parts at the cost of the whole GEMM each. Between the first and the
    last part the module holds the input and the output.

    :func:`fuse_qkv_projections` (``convert_model(fuse_qkv=True)``) puts one in an attention
    module as ``qkv_proj`` and its three :class:`QKVPart` as ``q_proj`` / ``k_proj`` / ``v_proj``,
    whose state-dict names and shapes stay the attention's own. The parts are no ``nn.Linear``
    layers: what wraps or replaces the projections themselves (an adapter such as PEFT's LoRA on
    ``q_proj``) needs them unfused.
    """

    def __init__(self, in_features: int, out_splits, bias: bool = True, device=None, dtype=None,
                 fp8: Union[None, bool, "_fp8.Float8Recipe"] = None) -> None:
        splits = tuple(out_splits)
        if len(splits) != 3 or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in splits):
            raise ValueError(f"FusedQKV: out_splits must be three widths >= 1 (q, k, v), got {out_splits!r}")
        super().__init__(in_features, sum(splits), bias=bias, device=device, dtype=dtype, fp8=fp8)
        self.out_splits = splits
        self._pending = None  # (x, x's version, the three parts, which were handed out)

    def project(self, x: Tensor, index: int) -> Tensor:
        pending = self._pending
        version = _version_of(x)
        if pending is None or pending[0] is not x or pending[1] != version or pending[3][index]:
            pending = (x, version, self(x).split(self.out_splits, dim=-1), (False, False, False))
        served = tuple(done or i == index for i, done in enumerate(pending[3]))
        self._pending = None if all(served) else pending[:3] + (served,)
        return pending[2][index]

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, out_splits={self.out_splits}"


def _version_of(x: Tensor) -> int:
    """x's version counter (in-place changes), where it has one: not traced under torch.compile
    (a traced input is not changed between the parts' calls of one graph), none for inference
    tensors (inference mode keeps no version counters)."""
    if torch.compiler.is_compiling() or x.is_inference():
        return 0
    return x._version


class QKVPart(nn.Module):
    """Part ``index`` (0 q, 1 k, 2 v) of a :class:`FusedQKV`'s projection, standing where the
    attention module's own projection stood: ``forward(x)`` is ``fused.project(x, index)``. It
    refers to the FusedQKV without holding it as a submodule (the attention module holds it, as
    ``qkv_proj``), so it has no parameters of its own; ``weight`` and ``bias`` are read-only views
    of its rows of the stacked ones (for code that reads a projection's dtype or shape)."""

    def __init__(self, fused: FusedQKV, index: int) -> None:
        super().__init__()
        if index not in (0, 1, 2):
            raise ValueError(f"QKVPart: index must be 0 (q), 1 (k) or 2 (v), got {index!r}")
        object.__setattr__(self, "_fused", fused)  # not registered: its parameters are the attention's qkv_proj's
        self.index = index
        self.in_features = fused.in_features
        self.out_features = fused.out_splits[index]

    def _rows(self, t: Optional[Tensor]) -> Optional[Tensor]:
        if t is None:
            return None
        lo = sum(self._fused.out_splits[:self.index])
        return t.detach()[lo:lo + self.out_features]

    @property
    def weight(self) -> Tensor:
        return self._rows(self._fused.weight)

    @property
    def bias(self) -> Optional[Tensor]:
        return self._rows(self._fused.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self._fused.project(x, self.index)

    def extra_repr(self) -> str:
        return f"{'qkv'[self.index]} of the attention's qkv_proj: in_features={self.in_features}, " \
               f"out_features={self.out_features}"


# An attention module's projections FusedQKV stands for, in its parts' order, and its own name there.
QKV_NAMES = ("q_proj", "k_proj", "v_proj")
_QKV_FUSED = "qkv_proj"


def qkv_fusion_problem(attn: nn.Module) -> str:
    """'' when ``attn`` holds ``q_proj``, ``k_proj``, ``v_proj`` as ``nn.Linear`` layers of one
    input width, dtype and device, all with a bias or none, and no ``qkv_proj`` yet; else why not."""
    layers = [getattr(attn, n, None) for n in QKV_NAMES]
    if not all(type(layer) is nn.Linear for layer in layers):
        return "q_proj, k_proj, v_proj are not all nn.Linear"
    if hasattr(attn, _QKV_FUSED):
        return f"it has a {_QKV_FUSED} already"
    w = [layer.weight for layer in layers]
    if len({(t.shape[1], t.dtype, t.device) for t in w}) != 1:
        return ("q_proj, k_proj, v_proj differ in input width, dtype or device: "
                + ", ".join(f"{tuple(t.shape)} {t.dtype} {t.device}" for t in w))
    if len({layer.bias is None for layer in layers}) != 1:
        return "some of q_proj, k_proj, v_proj have a bias and some not"
    return ""


def fuse_qkv_projections(attn: nn.Module, fp8: Union[None, bool, "_fp8.Float8Recipe"] = None) -> FusedQKV:
    """Replaces, in place, an attention module's ``q_proj``, ``k_proj``, ``v_proj`` (``nn.Linear``
    layers it calls on one input, as Hugging Face's self-attentions do) with one :class:`FusedQKV`
    held as ``attn.qkv_proj`` (their weights and biases stacked: new parameters) and three
    :class:`QKVPart` in their places, so the attention's forward runs unchanged. The attention's
    state_dict keeps ``q_proj.weight`` / ``k_proj.weight`` / ``v_proj.weight`` (and biases): saving
    writes the three parts, loading takes them (or ``qkv_proj.weight`` itself). ValueError naming
    the reason (:func:`qkv_fusion_problem`) for a module that cannot be fused. Call it before
    building the optimizer. Returns the FusedQKV."""
    _fp8.check_fp8_argument(fp8)
    why = qkv_fusion_problem(attn)
    if why:
        raise ValueError(f"fuse_qkv_projections: {type(attn).__name__}: {why}")
    layers = [getattr(attn, n) for n in QKV_NAMES]
    w = layers[0].weight
    splits = tuple(layer.out_features for layer in layers)
    fused = FusedQKV(layers[0].in_features, splits, bias=layers[0].bias is not None, device="meta", dtype=w.dtype)
    with torch.no_grad():
        fused.weight = nn.Parameter(torch.cat([layer.weight.detach() for layer in layers]),
                                    requires_grad=w.requires_grad)
        if fused.bias is not None:
            fused.bias = nn.Parameter(torch.cat([layer.bias.detach() for layer in layers]),
                                      requires_grad=layers[0].bias.requires_grad)
    fused.fp8 = fp8
    _fp8.prepare_layer(fused)
    fused.train(attn.training)
    setattr(attn, _QKV_FUSED, fused)
    for i, name in enumerate(QKV_NAMES):
        part = QKVPart(fused, i)
        part.train(attn.training)
        setattr(attn, name, part)
    attn.register_state_dict_post_hook(_save_qkv_parts)
    attn.register_load_state_dict_pre_hook(_load_qkv_parts)
    return fused


def _save_qkv_parts(module, state_dict, prefix, local_metadata):
    fused = getattr(module, _QKV_FUSED, None)
    if not isinstance(fused, FusedQKV):
        return
    for kind in ("weight", "bias"):
        packed = state_dict.pop(f"{prefix}{_QKV_FUSED}.{kind}", None)
        if packed is not None:
            for name, piece in zip(QKV_NAMES, packed.split(fused.out_splits)):
                state_dict[f"{prefix}{name}.{kind}"] = piece.clone()  # own storage: safetensors refuses shared ones


def _load_qkv_parts(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    fused = getattr(module, _QKV_FUSED, None)
    if not isinstance(fused, FusedQKV):
        return
    for kind in ("weight", "bias"):
        keys = [f"{prefix}{name}.{kind}" for name in QKV_NAMES]
        pieces = [state_dict.get(key) for key in keys]
        if all(p is None for p in pieces):
            continue  # qkv_proj's own given, or missing (load_state_dict reports it)
        if any(p is None for p in pieces):
            error_msgs.append(f"{prefix}: {', '.join(QKV_NAMES)} {kind}s must be loaded together (they are one "
                              f"{_QKV_FUSED}), got only {[k for k, p in zip(keys, pieces) if p is not None]}")
            continue
        for key, piece, rows in zip(keys, pieces, fused.out_splits):
            want = (rows, fused.in_features) if kind == "weight" else (rows,)
            if tuple(piece.shape) != want:
                error_msgs.append(f"{key}: expected shape {want}, got {tuple(piece.shape)}")
                break
        else:
            for key in keys:
                del state_dict[key]
            state_dict[f"{prefix}{_QKV_FUSED}.{kind}"] = torch.cat(pieces)


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


def gate_activation(act_fn, where: str) -> str:
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
    return gate_activation(mlp.act_fn, where)


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
