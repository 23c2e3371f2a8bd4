"""FP8 training on Hopper (compute capability 8.9+): recipes, the scaling state a layer keeps, and
the ways in.

A layer in FP8 keeps its master weights (and so the optimizer state) in the model's dtype. Each
step quantizes, per tensor, the input, the activation between the MLP's GEMMs (a gated MLP's
act(gate) * up), the output gradient and the gradient at the activation (a gated MLP's packed
gate / up gradient), and runs the six GEMMs in FP8 with outputs in the
model's dtype (csrc/torch/autograd/mlp_fp8.cpp has the dataflow). Weights are quantized from their
own amax when their FP8 copy is made, under either recipe; activations and gradients follow the
recipe:

* ``Float8Recipe(scaling='current')``: each tensor's scale comes from its own amax in the same
  step (one extra read of the tensor), as torchao's ``tensorwise`` float8. Stateless.
* ``Float8Recipe(scaling='delayed')``: the scale comes from the amax history of earlier steps
  (``amax_history_len`` steps, their max or the most recent), as TransformerEngine's delayed
  scaling; the amax of this step is recorded while quantizing. The history, the scales and the
  latest amaxes are buffers of the layer (``fp8_amax_history``, ``fp8_scales``, ``fp8_amax``),
  so ``state_dict`` saves and restores them. Before any amax is recorded the scale is 1. Each
  rank records the amaxes of what it quantized; with ``amax_reduction_group`` the ranks of that
  group take their max before it enters the history, so they all hold the same history and
  scales (data-parallel and FSDP2 ranks quantize different tokens, tensor-parallel ranks hold
  different shards).

Activations and weights are e4m3; gradients e5m2 (``grad_format='e5m2'``, the default) or e4m3.
Values beyond the format's range saturate to its largest finite value; a NaN makes the
quantized tensor NaN (current scaling: the whole tensor, through its scale).

Ways in: the ``fp8=`` argument of :class:`FusedDense`, :class:`FusedMLP`, :class:`FusedGatedMLP`
and the tensor-parallel ``ColumnParallelLinear``, ``RowParallelLinear``, ``ParallelFusedMLP`` and
``ParallelFusedGatedMLP`` (a recipe, or ``True``
for the default recipe), :func:`fp8_autocast` around the forward, or :func:`convert_to_fp8` over a
whole model. Whether a layer runs in FP8 never depends on the batch: it is the user's choice,
narrowed by the recipe's size rule (``min_features``: a layer whose smallest width is below it
stays in the model's dtype; 0 forces FP8 everywhere). A tensor-parallel layer's rule reads its
full widths, not its shard's (fused_dense/parallel.py), so every rank decides alike.

The FP8 copy of the weights is made on every call by default. ``forward(x, is_first_microbatch=
True)`` makes it and keeps it, ``is_first_microbatch=False`` reuses the kept copy (gradient
accumulation: one cast per optimizer step). The argument is explicit, so CUDA graphs and
torch.compile see no hidden host state.
"""
import dataclasses
import functools
import threading
import warnings
from typing import List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.weak import WeakTensorKeyDictionary

from . import ops
from ._common import autocast_off, cast_for_op, compute_dtype

__all__ = ["Float8Recipe", "fp8_autocast", "convert_to_fp8", "DEFAULT_MIN_FEATURES"]

# The size rule's default: layers narrower than this stay in the model's dtype (bench/fp8.py's
# run of record, docs/results/fp8-*.md, shows where FP8 wins on the H200).
DEFAULT_MIN_FEATURES = 2048
# Float8Recipe.compiled_input_quantize's values (its docstring says what each does).
COMPILED_INPUT_QUANTIZE = ("traced", "traced_rowwise", "op")


@dataclasses.dataclass(frozen=True)
class Float8Recipe:
    """How a layer runs in FP8.

    Args:
        scaling: ``'current'`` (each tensor scaled from its own amax) or ``'delayed'`` (from the
            amax history of earlier steps; a layer's first training step, with no history yet,
            runs current scaling and records the amaxes the second step scales from).
        grad_format: FP8 format of the gradients, ``'e5m2'`` or ``'e4m3'``.
        amax_history_len: steps of amax history (delayed scaling).
        amax_compute: ``'max'`` (the history's max) or ``'most_recent'`` (delayed scaling).
        min_features: the size rule: FP8 only where every width of the layer is at least this.
        amax_reduction_group: delayed scaling: a ``torch.distributed`` process group whose ranks
            share their amaxes (their max, one all-reduce of a few floats per layer and step,
            when the next step derives its scales), or None (each rank its own). Every rank of
            the group must run the same FP8 layers in the same order. A NaN amax enters the
            history as inf (the scale is then kept, as for a NaN).
        compiled_input_quantize: under torch.compile, ``'traced'`` (a layer's input quantized in
            PyTorch ops Inductor fuses with what makes it; delayed scaling: at the layer's x scale),
            ``'traced_rowwise'`` (the same, the row-major copy only: the op makes the transposed
            copy the weight gradient reads in backward, ``fp8_transpose``, instead of a traced
            transpose) or ``'op'`` (the op's kernels). The same bytes every way.
        save_pre_fp8: an MLP at checkpoint level 0 keeps its pre-activation (gated: gu) for
            backward as an e4m3 copy scaled from its own amax instead of in the model's dtype, and
            evaluates the activation's derivative at that copy dequantized: saved bytes 0.5x the
            bf16 MLP's instead of 0.72x (GELU, hidden 4d), for a derivative taken 3 mantissa bits
            from the pre-activation. Off by default (docs/contract.md, "Checkpoint levels").
        save_weight_fp8: keep each weight's transposed FP8 copy (its data gradient's operand) from
            the forward to the backward (True), or hold none and quantize the weight again in
            backward at the forward's scale (False: the same bytes; one byte a weight element less
            through the step, for one more cast pass over each weight in backward). Copies kept for
            later micro-batches (``is_first_microbatch``) are whole either way. Under both, a weight
            changed in place between the forward and a backward that reads it is autograd's error,
            as with nn.Linear.
    """

    scaling: str = "current"
    grad_format: str = "e5m2"
    amax_history_len: int = 16
    amax_compute: str = "max"
    min_features: int = DEFAULT_MIN_FEATURES
    amax_reduction_group: Optional[object] = dataclasses.field(default=None, compare=False)
    compiled_input_quantize: str = "traced"
    save_pre_fp8: bool = False
    save_weight_fp8: bool = True

    def __post_init__(self):
        if self.scaling not in ("current", "delayed"):
            raise ValueError(f"Float8Recipe: scaling must be 'current' or 'delayed', got {self.scaling!r}")
        if self.grad_format not in ops.FP8_FORMATS:
            raise ValueError(f"Float8Recipe: grad_format must be one of {sorted(ops.FP8_FORMATS)}, got {self.grad_format!r}")
        if not isinstance(self.amax_history_len, int) or self.amax_history_len < 1:
            raise ValueError(f"Float8Recipe: amax_history_len must be an int >= 1, got {self.amax_history_len!r}")
        if self.amax_compute not in ("max", "most_recent"):
            raise ValueError(f"Float8Recipe: amax_compute must be 'max' or 'most_recent', got {self.amax_compute!r}")
        if self.compiled_input_quantize not in COMPILED_INPUT_QUANTIZE:
            raise ValueError(f"Float8Recipe: compiled_input_quantize must be one of {COMPILED_INPUT_QUANTIZE}, got "
                             f"{self.compiled_input_quantize!r}")
        for name in ("save_pre_fp8", "save_weight_fp8"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Float8Recipe: {name} must be True or False, got {getattr(self, name)!r}")
        if not isinstance(self.min_features, int) or self.min_features < 0:
            raise ValueError(f"Float8Recipe: min_features must be an int >= 0, got {self.min_features!r}")
        if self.amax_reduction_group is not None:
            if self.scaling != "delayed":
                raise ValueError("Float8Recipe: amax_reduction_group applies to scaling='delayed' (current scaling "
                                 "takes each tensor's own amax), got scaling='current'")
            if not (dist.is_available() and isinstance(self.amax_reduction_group, dist.ProcessGroup)):
                raise TypeError("Float8Recipe: amax_reduction_group must be a torch.distributed.ProcessGroup, got "
                                f"{type(self.amax_reduction_group).__name__}")

    @property
    def grad_format_code(self) -> int:
        return ops.FP8_FORMATS[self.grad_format]

    def applies(self, widths: Sequence[int]) -> bool:
        """Whether a layer of these widths runs in FP8 under this recipe (the size rule)."""
        return min(widths) >= self.min_features


def resolve_recipe(fp8: Union[None, bool, Float8Recipe]) -> Optional[Float8Recipe]:
    """A layer's ``fp8`` argument as a recipe: its own, else :func:`fp8_autocast`'s, else None."""
    if fp8 is None or fp8 is False:
        return _AUTOCAST[0]
    if fp8 is True:
        return Float8Recipe()
    if isinstance(fp8, Float8Recipe):
        return fp8
    raise TypeError(f"fp8 must be None, a bool or a fused_dense.Float8Recipe, got {type(fp8).__name__}")


def check_fp8_argument(fp8) -> None:
    if not (fp8 is None or isinstance(fp8, (bool, Float8Recipe))):
        raise TypeError(f"fp8 must be None, a bool or a fused_dense.Float8Recipe, got {type(fp8).__name__}")


# The recipe of the innermost active fp8_autocast (process-wide, as torch's autocast state is
# per thread: set and restored under the lock).
_AUTOCAST: List[Optional[Float8Recipe]] = [None]
_AUTOCAST_LOCK = threading.Lock()


class fp8_autocast:
    """Run every FusedDense / FusedMLP / tensor-parallel layer whose ``fp8`` argument is unset in
    FP8 inside the block (``recipe`` or the default recipe), as TransformerEngine's
    ``fp8_autocast``. ``enabled=False`` turns an outer block off. The state is process-wide."""

    def __init__(self, enabled: bool = True, recipe: Optional[Float8Recipe] = None):
        if recipe is not None and not isinstance(recipe, Float8Recipe):
            raise TypeError(f"fp8_autocast: recipe must be a fused_dense.Float8Recipe, got {type(recipe).__name__}")
        self._recipe = (recipe or Float8Recipe()) if enabled else None
        self._saved = None

    def __enter__(self):
        with _AUTOCAST_LOCK:
            self._saved = _AUTOCAST[0]
            _AUTOCAST[0] = self._recipe
        return self

    def __exit__(self, *exc):
        with _AUTOCAST_LOCK:
            _AUTOCAST[0] = self._saved
        return False


def convert_to_fp8(model: torch.nn.Module, recipe: Optional[Float8Recipe] = None) -> torch.nn.Module:
    """Set ``recipe`` (default: ``Float8Recipe()``) on every FusedDense, FusedMLP, FusedGatedMLP and
    tensor-parallel layer of ``model`` (every :class:`Fp8Layer`), in place; returns the model.
    ``nn.Linear`` layers that are not fused_dense layers are left alone."""
    recipe = recipe or Float8Recipe()
    for module in model.modules():
        if isinstance(module, Fp8Layer):
            module.fp8 = recipe
            prepare_layer(module)
    return model


def prepare_layer(module: torch.nn.Module) -> None:
    """Make the buffers of a layer's own delayed recipe now (its ``fp8`` was set after it was
    built), so that its first FP8 step may run under torch.compile."""
    recipe = module.fp8 if isinstance(module.fp8, Float8Recipe) else None
    if recipe is not None and recipe.scaling == "delayed":
        ensure_delayed_buffers(module, recipe, module._fp8_state.slots, next(module.parameters()).device)


# ----------------------------------------------------------------------------------------------
# The per-layer state and the calls of the ops


def quantize_weight(weight: Tensor, transposed: bool = True) -> List[Tensor]:
    """The FP8 copies of a weight [N, K] (e4m3, scaled from its amax): [data, data_t, scale_inv,
    scale]; data_t empty where not ``transposed`` (the FP8 ops then cast the weight again in
    backward, at ``scale``: the same bytes, with no second amax pass)."""
    data, data_t, scale, scale_inv, _, _ = torch.ops.fused_dense.fp8_quantize(
        weight.detach().contiguous(), None, 0, False, 0, None, True, transposed, False)
    return [data, data_t, scale_inv, scale]


class Fp8State:
    """What a layer keeps for FP8: the kept weight copies (is_first_microbatch) and, for delayed
    scaling, its scaling buffers (registered on the layer, so state_dict holds them). ``slots``
    names the tensors the op scales, in the op's order."""

    def __init__(self, slots: Sequence[str]):
        self.slots = tuple(slots)
        self.weights: Optional[List[Tensor]] = None

    def weight_copies(self, weights: Sequence[Tensor], is_first_microbatch: Optional[bool],
                      transposed: bool = True) -> List[Tensor]:
        """The weights' FP8 copies for one call (quantize_weight), made now or (is_first_microbatch
        False) the ones kept by the last is_first_microbatch=True call, which are kept whole; else
        without the transposed copies where not ``transposed`` (Float8Recipe.save_weight_fp8)."""
        if is_first_microbatch is False:
            if self.weights is None:
                raise ValueError("is_first_microbatch=False reuses the FP8 weights kept by an earlier call with "
                                 "is_first_microbatch=True, but none are kept")
            return self.weights
        transposed = transposed or bool(is_first_microbatch)
        copies = [t for w in weights for t in quantize_weight(w, transposed)]
        self.weights = copies if is_first_microbatch else None
        return copies


# Delayed scaling's state: float32 through every ``Module.to`` (Fp8Layer._apply).
SCALING_BUFFERS = ("fp8_amax_history", "fp8_scales", "fp8_amax", "fp8_format_max")


def ensure_delayed_buffers(module: torch.nn.Module, recipe: Float8Recipe, slots: Sequence[str],
                           device: torch.device) -> None:
    """Register the delayed-scaling buffers where missing (or of another history length or
    device): history zeros, scales 1, amaxes zeros. Buffers loaded from a state_dict are kept."""
    n = len(slots)
    device = torch.device(device)
    key = (recipe.amax_history_len, recipe.grad_format, str(device))
    if getattr(module, "_fp8_buffer_key", None) == key:
        return
    if torch.compiler.is_compiling():
        # Buffers registered while torch.compile traces break its graph (inductor refuses the
        # mutated state): they must exist before the first compiled step.
        raise RuntimeError(
            f"fused_dense: {type(module).__name__} runs delayed scaling, whose buffers are made on the layer's "
            f"first FP8 step, here inside torch.compile. Make them before compiling: build the layer with "
            f"fp8=Float8Recipe(scaling='delayed', ...), set the recipe with fused_dense.convert_to_fp8 or "
            f"replace_llama_mlps(fp8=...), or run one step eagerly first")
    hist = getattr(module, "fp8_amax_history", None)
    if hist is None or tuple(hist.shape) != (recipe.amax_history_len, n) or hist.device != device:
        f32 = {"dtype": torch.float32, "device": device}
        module.register_buffer("fp8_amax_history", torch.zeros(recipe.amax_history_len, n, **f32))
        module.register_buffer("fp8_scales", torch.ones(n, **f32))
        module.register_buffer("fp8_amax", torch.zeros(n, **f32))
        scaling_started(module, False)
    elif not hasattr(module, "_fp8_scaling_started"):
        scaling_started(module, bool(hist.any()) or bool(module.fp8_amax.any()))
    module.register_buffer("fp8_format_max", fp8_max_of_slots(recipe, slots, device), persistent=False)
    module._fp8_buffer_key = key


def scaling_started(module: torch.nn.Module, started: bool) -> None:
    """Whether the layer's delayed scaling has amaxes to derive its scales from (_scaling): False
    for fresh buffers, True once a training step has recorded them or a state_dict brought them."""
    module._fp8_scaling_started = started
    module._fp8_current_step = False


def fp8_max_of_slots(recipe: Float8Recipe, slots: Sequence[str], device) -> Tensor:
    return torch.tensor([ops.FP8_FORMAT_MAX[recipe.grad_format if s.startswith("grad") else "e4m3"] for s in slots],
                        dtype=torch.float32, device=device)


def delayed_scales(module: torch.nn.Module, recipe: Float8Recipe, slots: Sequence[str]) -> Tensor:
    """Push the latest amaxes into the history (max-reduced over the recipe's amax_reduction_group),
    derive this step's scales (kept where no amax has been recorded, or the amax is not finite),
    and return a copy of them for the op."""
    hist, amax, scales = module.fp8_amax_history, module.fp8_amax, module.fp8_scales
    with torch.no_grad():
        if recipe.amax_reduction_group is not None:
            # NaN as inf: a MAX reduction need not propagate NaN on every backend; inf keeps the
            # scale as a NaN would.
            amax = torch.nan_to_num(amax, nan=float("inf"))
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=recipe.amax_reduction_group)
        hist.copy_(torch.roll(hist, 1, 0))
        hist[0].copy_(amax)
        ref = hist.amax(0) if recipe.amax_compute == "max" else hist[0]
        ok = torch.isfinite(ref) & (ref > 0)
        scales.copy_(torch.where(ok, scale_from_amax(ref, module.fp8_format_max), scales))
    return scales.clone()


def scale_from_amax(amax: Tensor, fp8_max) -> Tensor:
    """The scaling rule, fp8_max / max(amax, FP8_MIN_AMAX) (the op fp8_scales', docs/contract.md),
    in PyTorch ops that give the op's bits in eager and under torch.compile: divided in float64 and
    rounded once to float32, which is the correctly rounded float32 quotient (53 >= 2 * 24 + 2
    bits). A float32 division would not do: Inductor's on the GPU is not correctly rounded, and
    ``448 / amax`` in PyTorch is a reciprocal and a product. NaN stays NaN, inf gives 0."""
    num = fp8_max.double() if isinstance(fp8_max, Tensor) else amax.new_full((), fp8_max, dtype=torch.float64)
    return (num / amax.clamp_min(ops.FP8_MIN_AMAX).double()).float()


def inverse_scale(scale: Tensor) -> Tensor:
    """1 / scale correctly rounded to float32, eager and compiled (as scale_from_amax divides)."""
    return torch.reciprocal(scale.double()).float()


MLP_SLOTS = ("x", "act", "grad_out", "grad_pre")
DENSE_SLOTS = ("x", "grad_out")


def torchao_converted(linear: torch.nn.Module) -> bool:
    """Whether torchao's float8 conversion replaced this nn.Linear (its Float8Linear)."""
    return type(linear).__name__ == "Float8Linear" and type(linear).__module__.startswith("torchao")


_TORCHAO_WARNED = [False]


def warn_torchao_once() -> None:
    if not _TORCHAO_WARNED[0]:
        _TORCHAO_WARNED[0] = True
        warnings.warn("fused_dense: torchao's convert_to_float8_training replaced fc1 / fc2 of a FusedMLP; the "
                      "FusedMLP runs them in fused_dense's FP8 (current scaling, as torchao's tensorwise). Set "
                      "FusedMLP(fp8=...) or fused_dense.convert_to_fp8 instead to choose the recipe.", stacklevel=3)


# ----------------------------------------------------------------------------------------------
# The FP8 side of every layer


class Fp8Layer:
    """The base of every layer that runs in FP8 (FusedDense, FusedMLP, FusedGatedMLP,
    ColumnParallelLinear, RowParallelLinear, ParallelFusedMLP, ParallelFusedGatedMLP): the ``fp8``
    argument and the per-layer state (kept weight copies, delayed-scaling buffers and their loading
    from a state_dict), the size rule, and the FP8 step of ``forward``. :func:`convert_to_fp8`
    finds the layers by this class.

    A layer calls :meth:`_init_fp8` once its parameters exist, asks :meth:`_fp8_recipe_for` with its
    widths for the recipe its forward runs under, and runs :meth:`_fp8_forward` when there is one.
    An MLP layer has ``activation``, ``checkpoint_lvl`` and ``training``."""

    def _init_fp8(self, fp8, slots: Sequence[str]) -> None:
        """The ``fp8`` argument and the FP8 state for the op's scaled tensors ``slots``
        (DENSE_SLOTS, MLP_SLOTS). Delayed scaling's buffers are made now when the layer is built
        with a delayed recipe (else on its first FP8 step), and on load when a state_dict carries
        them."""
        check_fp8_argument(fp8)
        self.fp8 = fp8
        self._fp8_state = Fp8State(slots)
        prepare_layer(self)
        self.register_load_state_dict_pre_hook(functools.partial(_load_scaling_state, slots=tuple(slots)))

    def _apply(self, fn, recurse=True):
        """``Module.to`` / ``.cuda()`` / ``.bfloat16()`` move the scaling buffers but keep them
        float32: the ops read them as float32, and a bf16 copy of a scale would also lose its value.
        The moved buffer is the old float32 values on the new device (never a round trip through
        the new dtype)."""
        old = {name: self._buffers.get(name) for name in SCALING_BUFFERS}
        super()._apply(fn, recurse)
        for name, before in old.items():
            after = self._buffers.get(name)
            if before is not None and after is not None and after.dtype != torch.float32:
                self._buffers[name] = before.to(device=after.device)
        return self

    def _fp8_recipe_for(self, widths: Sequence[int], torchao_layers: Sequence[torch.nn.Module] = ()):
        """The recipe the forward runs under, or None (model dtype): the layer's ``fp8`` (else
        fp8_autocast's), or current scaling with a warning where torchao's converter replaced one
        of ``torchao_layers``; narrowed by the size rule on ``widths``."""
        recipe = resolve_recipe(self.fp8)
        if recipe is None and any(torchao_converted(layer) for layer in torchao_layers):
            warn_torchao_once()
            recipe = Float8Recipe(scaling="current", min_features=0)
        if recipe is None or not recipe.applies(widths):
            return None
        return recipe

    def _fp8_forward(self, recipe: Float8Recipe, x: Tensor, is_first_microbatch: Optional[bool],
                     gemms: Optional[Tuple[torch.nn.Module, torch.nn.Module]] = None, process_group=None,
                     sequence_parallel: bool = True) -> Tensor:
        """The FP8 step: x entered into ``process_group`` (:func:`_parallel_input`), then the op
        fp8_dense over the layer's ``weight`` / ``bias``, or with ``gemms`` = (fc1, fc2) the op
        fused_mlp_fp8 over those (FusedMLP's fc1 / fc2, a gated MLP's gate_up_proj / down_proj)
        with the layer's activation and checkpoint level (2 in eval mode). The weights are the
        full layers or this rank's shards, whose partial sums the caller reduces."""
        x = _parallel_input(x, process_group, sequence_parallel)
        if gemms is None:
            xc, x2, (b,) = _op_inputs(x, (self.bias,))
            weights = self._fp8_state.weight_copies((self.weight,), is_first_microbatch, recipe.save_weight_fp8)
            scales, amax_out = _scaling(self, recipe, DENSE_SLOTS, x.device)
            x_fp8 = quantized_copies(x, xc, recipe, x2, torch.is_grad_enabled() and self.weight.requires_grad,
                                     scales)
            with autocast_off(x.device.type):
                out = torch.ops.fused_dense.fp8_dense(x2, self.weight, b, weights, recipe.grad_format_code, scales,
                                                      amax_out, x_fp8)
        else:
            act = ops.mlp_activation_code(self.activation, "any")
            lvl = self.checkpoint_lvl if self.training else 2
            fc1, fc2 = gemms
            xc, x2, (b1, b2) = _op_inputs(x, (fc1.bias, fc2.bias))
            weights = self._fp8_state.weight_copies((fc1.weight, fc2.weight), is_first_microbatch,
                                                    recipe.save_weight_fp8)
            scales, amax_out = _scaling(self, recipe, MLP_SLOTS, x.device)
            x_fp8 = quantized_copies(x, xc, recipe, x2, torch.is_grad_enabled() and fc1.weight.requires_grad,
                                     scales)
            with autocast_off(x.device.type):
                out = torch.ops.fused_dense.fused_mlp_fp8(x2, fc1.weight, b1, fc2.weight, b2, act, lvl, weights,
                                                          recipe.grad_format_code, scales, amax_out, x_fp8,
                                                          recipe.save_pre_fp8)
        return out if xc.dim() == 2 else out.reshape(*xc.shape[:-1], out.shape[-1])


# ---- inputs quantized where they are made ------------------------------------------------------
# A norm that feeds FP8 layers (fused_dense/norm.py, FusedRMSNorm) quantizes its output as it
# writes it (the op norm_fp8) and hands the copies over here, keyed by the output tensor; each FP8
# layer that reads that very tensor takes them (the ops' x_fp8) instead of quantizing it again:
# q / k / v and the MLP read one copy. The copies are fp8_quantize's of the output, byte for byte,
# so a layer computes the same bits with or without them. Weak keys: an entry goes with its tensor.
_HANDOFF = WeakTensorKeyDictionary()
_HANDOFF_LOCK = threading.Lock()


def hand_off(out: Tensor, copies: Sequence[Tensor]) -> None:
    """Records ``copies`` = [data, data_t, scale_inv, amax] (e4m3, current scaling) as ``out``'s FP8
    copies, valid while ``out`` is not modified in place."""
    with _HANDOFF_LOCK:
        _HANDOFF[out] = (out._version, list(copies))


def quantized_copies(x: Tensor, xc: Tensor, recipe: Float8Recipe, x2: Tensor, columnwise: bool,
                     scales: Optional[Tensor] = None) -> List[Tensor]:
    """x's FP8 copies for the op's x_fp8, ``[]`` where the op quantizes x itself. Under
    torch.compile: :func:`traced_quantize` of the op's input ``x2``, which Inductor fuses with what
    makes it (the norm before it; with current scaling q / k / v's three quantizations of one input
    are one after AOTAutograd's common-subexpression pass; with delayed scaling, at the layer's x
    scale ``scales[0]``, each layer's cast joins the producer's kernel). Eager, current scaling: the
    copies handed over for x, if x is unchanged since and read as it is (``xc`` is x: no cast, no
    gather); delayed scaling: none (each layer quantizes x at its own scale in the op)."""
    if torch.compiler.is_compiling():
        if recipe.compiled_input_quantize == "op":
            return []
        rows_only = recipe.compiled_input_quantize == "traced_rowwise"
        return traced_quantize(x2, columnwise and not rows_only, None if scales is None else scales[0])
    if recipe.scaling != "current" or xc is not x:
        return []
    with _HANDOFF_LOCK:
        entry = _HANDOFF.get(x)
    if entry is None or entry[0] != x._version:
        return []
    return entry[1]


def traced_quantize(x2: Tensor, columnwise: bool, scale: Optional[Tensor] = None) -> List[Tensor]:
    """fp8_quantize(x2, e4m3, rowwise, ``columnwise``) written in PyTorch ops, the same bytes
    (tests/test_norm_handoff.py): [data, data_t, scale_inv, amax]; current scaling (the scale from
    x2's amax), or delayed at ``scale`` (float32, one element). The scale and its inverse carry
    fp8_quantize's bits (scale_from_amax, inverse_scale: a scale one ulp off would change the
    bytes) in ops Inductor fuses into the cast, not in an opaque op call and kernel of their own."""
    fmax = ops.FP8_FORMAT_MAX["e4m3"]
    v = x2.float()
    # an empty batch's amax is 0, as the op's (amax() of no elements raises); the size test is a
    # static guard under torch.compile, which specialises sizes 0 and 1
    amax = v.abs().amax() if x2.numel() else v.new_zeros(())
    scale = scale_from_amax(amax.detach(), fmax) if scale is None else scale.reshape(())
    scale_inv = inverse_scale(scale)
    q = (v * scale).clamp(-fmax, fmax)
    data = q.to(torch.float8_e4m3fn)
    if columnwise:
        # Traced, not fp8_transpose(data): the op (kept for backward, never recomputed) made the
        # linears alone 4% faster compiled but the llama-4096 step no faster and 192 MiB heavier
        # (H100, bench.model); in the model Inductor writes this copy in a forward kernel.
        # The tokens padded with zeros to a multiple of ops.FP8_ROW_PAD (core::fp8_padded_rows, in
        # its form, so that a symbolic token count gives the ops' checks the same expression), then
        # transposed.
        # Padded after the transpose, a count already a multiple of 16 (no padding) gave a copy in
        # the transposed layout where the symbolic count's trace expected a row-major one.
        rows = x2.shape[0]
        pad = (rows + ops.FP8_ROW_PAD - 1) // ops.FP8_ROW_PAD * ops.FP8_ROW_PAD - rows
        data_t = torch.nn.functional.pad(q, (0, 0, 0, pad)).t().contiguous().to(torch.float8_e4m3fn)
    else:
        data_t = x2.new_empty((0,), dtype=torch.float8_e4m3fn)
    return [data, data_t, scale_inv, amax]


def _load_scaling_state(module, state_dict, prefix, *args, slots):
    """A state_dict with delayed-scaling buffers loads into a layer that has none yet."""
    hist = state_dict.get(prefix + "fp8_amax_history")
    if hist is not None and getattr(module, "fp8_amax_history", None) is None:
        n = len(slots)
        f32 = {"dtype": torch.float32, "device": next(module.parameters()).device}
        module.register_buffer("fp8_amax_history", torch.zeros(hist.shape[0], n, **f32))
        module.register_buffer("fp8_scales", torch.ones(n, **f32))
        module.register_buffer("fp8_amax", torch.zeros(n, **f32))
    if hist is not None:
        amax = state_dict.get(prefix + "fp8_amax")
        scaling_started(module, bool(hist.any()) or (amax is not None and bool(amax.any())))


# The FP8 ops' derivatives are C++ autograd Functions (csrc/torch/autograd/mlp_fp8.cpp).
_OP_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _op_inputs(x: Tensor, biases):
    """x as a 2-D row-major tensor in the layer's compute dtype (autocast resolved as for the other
    ops), and the biases in that dtype; the weights stay as they are (quantized from any dtype)."""
    dtype, _ = compute_dtype(x)
    if dtype not in _OP_DTYPES:
        raise TypeError(f"FP8 layers take float16, bfloat16 or float32 inputs, got {dtype}")
    xc = cast_for_op(x, dtype, True)
    biases = [None if b is None else cast_for_op(b, dtype, True) for b in biases]
    x2 = xc if xc.dim() == 2 else xc.reshape(-1, xc.shape[-1])
    return xc, x2, biases


def recomputing() -> bool:
    """Whether this forward runs inside a backward pass: activation checkpointing
    (torch.utils.checkpoint, with or without reentrance; Hugging Face's
    ``gradient_checkpointing_enable``) recomputing it. Not traced (under torch.compile: False)."""
    if torch.compiler.is_compiling():
        return False
    return torch._C._current_graph_task_id() != -1  # what torch.utils.checkpoint itself reads


def _scaling(module, recipe: Float8Recipe, slots: Sequence[str], device):
    """(scales, amax output) of the op: both None under current scaling.

    Delayed scaling: until the layer's first training step (grad enabled) has run, its scales
    have no amax to come from, so that step (and any forward before it) runs current scaling and
    records its tensors' amaxes (scales None, amax output given): the next step's scales derive
    from them. (With scale 1 instead, the first step's e5m2 gradients below 2^-16 would flush to
    zero.) With an ``amax_reduction_group`` the first step keeps scale 1: current scaling would
    scale each rank from its own amaxes, and the group's ranks quantize alike. A forward
    recomputed in backward (activation checkpointing) scales as the forward it recomputes did and
    does not advance the amax history: the step's history moves once."""
    if recipe.scaling != "delayed":
        return None, None
    ensure_delayed_buffers(module, recipe, slots, device)
    if recomputing():
        if module._fp8_current_step:
            return None, module.fp8_amax
        return module.fp8_scales.clone(), module.fp8_amax
    if not module._fp8_scaling_started and recipe.amax_reduction_group is None:
        if torch.is_grad_enabled():
            module._fp8_scaling_started = True
            module._fp8_current_step = True
        return None, module.fp8_amax
    module._fp8_current_step = False
    return delayed_scales(module, recipe, slots), module.fp8_amax


def _parallel_input(x: Tensor, process_group, sequence_parallel: bool = True) -> Tensor:
    """The input of a tensor-parallel FP8 step, differentiably: x in the layer's compute dtype
    (cast before the gather, as the other tensor-parallel paths cast), all-gathered along dim 0
    when ``sequence_parallel`` (x is this rank's rows; backward reduce-scatters x's gradient),
    else x itself, replicated (backward all-reduces the ranks' partial gradients). x as it is
    without a process group. The FP8 op then quantizes the whole input the same on every rank."""
    if process_group is None:
        return x
    from .distributed import all_gather, copy_to_group

    dtype, _ = compute_dtype(x)
    xc = cast_for_op(x, dtype, True)
    return all_gather(xc, process_group) if sequence_parallel else copy_to_group(xc, process_group)
