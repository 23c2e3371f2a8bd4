"""One call converts a model's dense layers to the fused ones: :func:`convert_model`.

What it recognises (each tested on a real ``transformers`` model, random init, small config, in
tests/test_convert.py):

- gated MLPs of the Llama family (a module with ``gate_proj``, ``up_proj``, ``down_proj`` linear
  layers and an ``act_fn``: Llama, Mistral, Qwen2 with SiLU; Gemma with the tanh GELU) become
  :class:`~fused_dense.FusedGatedMLP` (the packed gate / up weight is a new parameter);
- gated MLPs whose gate and up weights are one stacked linear layer (``gate_up_proj`` [gate; up],
  ``down_proj`` and an ``activation_fn``: Phi-3, GLM, GLM-4) become a
  :class:`ConvertedStackedGatedMLP`, a FusedGatedMLP that saves and loads the stacked
  ``gate_up_proj.weight``; each is checked on a probe input to compute ``down(act(gate) * up)``
  before it is replaced;
- ``nn.Linear`` layers with a bias become :class:`~fused_dense.FusedDense` holding the same
  parameters (the bias add is fused into the GEMM's epilogue); bias-free ones only with
  ``bias_free_linears=True`` or in FP8 (in bf16 a bias-free linear runs the same cuBLASLt GEMM as
  ``nn.Linear``, so converting it gains nothing); the LM head (``lm_head``, or the model's output
  embedding) only with ``lm_head=True``;
- in FP8 with current scaling, a decoder layer's ``input_layernorm`` and
  ``post_attention_layernorm`` (Llama family, GPT-NeoX) or ``ln_1`` and ``ln_2`` (GPT-2) become
  a :class:`~fused_dense.norm.FusedRMSNorm` (LlamaRMSNorm's shape: Llama, Mistral, Qwen2) or a
  :class:`~fused_dense.norm.FusedLayerNorm` (an ``nn.LayerNorm``) holding the same parameters,
  which quantizes its output as it writes it and hands the FP8 copy to q / k / v and the MLP (one
  copy for all: fused_dense/norm.py), where its width meets the recipe's ``min_features``;
- with ``fuse_qkv`` (on by default with ``fp8``), a self-attention's ``q_proj``, ``k_proj``,
  ``v_proj`` (a module named ``self_attn``: Llama, Mistral, Qwen2, Qwen3, Gemma) become one
  :class:`~fused_dense.FusedQKV` GEMM, ``qkv_proj``, whose three parts stand in their places
  (:func:`~fused_dense.fuse_qkv_projections`);
- GPT-2's other ``Conv1D`` layers (the attention's ``c_attn`` / ``c_proj``: ``x @ weight + bias``
  with the weight stored [in, out]) become a :class:`ConvertedConv1D`, a FusedDense that keeps the
  weight [out, in] for the GEMM and saves and loads it in Conv1D's layout (a new parameter).

- MLPs of two linear layers and an activation the fused ops compute (tanh GELU, ReLU, squared
  ReLU), then optionally a dropout (GPT-2's ``c_fc`` / ``c_proj``, stored as ``Conv1D`` [in, out]
  weights; nanoGPT's; GPT-NeoX's ``dense_h_to_4h`` / ``dense_4h_to_h`` with a tanh GELU) become a
  :class:`ConvertedMLP`, a FusedMLP that saves and loads under the MLP's own names and layout;
  each is checked on a probe input to compute ``second(act(first(x)))`` before it is replaced.

What it leaves alone, with the reason in the report: MLPs with the exact (erf) GELU (GPT-NeoX's
default, BERT, Falcon: the fused ops have the tanh GELU, 2e-4 relative apart) or another
activation, whose linear layers are converted one by one; gated MLPs with biases or another
activation, or (stacked) whose forward is not ``down(act(gate) * up)``; MLPs with parts beyond
these.

With ``linear_cross_entropy=True``, a Hugging Face causal LM of a supported family (Llama,
Mistral, Qwen2, Qwen3, Phi-3, Gemma, Gemma 2, Gemma 3, GPT-2: :mod:`fused_dense.causal_lm`) also
computes its training loss with the LM head fused into the cross-entropy
(:func:`fused_dense.loss.linear_cross_entropy`), so the logits are never materialised in training;
reported as ``lm_head`` converted. Another model is reported as left alone there, with the reason.

State-dict names stay the model's own (FusedDense is an ``nn.Linear``; FusedGatedMLP saves and
loads Llama's ``gate_proj`` / ``up_proj`` / ``down_proj``; ConvertedStackedGatedMLP the stacked
``gate_up_proj``; ConvertedMLP its MLP's; ConvertedConv1D Conv1D's layout), so checkpoints load both
ways. Convert before building the optimizer: the gated MLPs, the MLPs and the Conv1D layers hold
new parameters.
"""
import dataclasses
from typing import Callable, List, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from . import fp8 as _fp8
from . import ops
from .causal_lm import causal_lm_family, use_fused_linear_cross_entropy
from .modules import (QKV_NAMES, FusedDense, FusedGatedMLP, FusedMLP, fuse_qkv_projections, fused_gated_mlp_from,
                      gate_activation, gated_activation_of, is_llama_mlp, qkv_fusion_problem)
from .norm import FusedLayerNorm, FusedRMSNorm, fused_layer_norm_from, fused_rms_norm_from

__all__ = ["ConversionReport", "ConvertedConv1D", "ConvertedMLP", "ConvertedStackedGatedMLP", "convert_model"]

# The attribute pairs of plain two-linear MLPs of common models: (fc1, fc2).
_PLAIN_MLP_NAMES = (("c_fc", "c_proj"), ("dense_h_to_4h", "dense_4h_to_h"), ("fc1", "fc2"), ("w1", "w2"))
# Where those MLPs keep their activation (GPT-2: act, GPT-NeoX: act, nanoGPT: gelu, OPT-style: activation_fn).
_ACT_NAMES = ("act", "act_fn", "activation", "activation_fn", "gelu")


@dataclasses.dataclass
class ConversionReport:
    """What :func:`convert_model` did: ``converted`` (name, what it was, what it is now) and ``left``
    (name, what it is, why it stays), in module order."""
    converted: List[Tuple[str, str, str]] = dataclasses.field(default_factory=list)
    left: List[Tuple[str, str, str]] = dataclasses.field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"fused_dense.convert_model: {len(self.converted)} converted, {len(self.left)} left alone"]
        lines += [f"  converted {name}: {was} -> {now}" for name, was, now in self.converted]
        lines += [f"  left      {name} ({what}): {why}" for name, what, why in self.left]
        return "\n".join(lines)


def _type_name(module: nn.Module) -> str:
    return type(module).__name__


def _is_conv1d(module: nn.Module) -> bool:
    """transformers' GPT-2 Conv1D (a linear layer whose weight is stored [in, out])."""
    return _type_name(module) == "Conv1D" and hasattr(module, "nf") and hasattr(module, "weight")


# The norms of a decoder layer that feed its FP8 projections (q / k / v, GPT-2's c_attn) and its
# MLP: Llama-family and GPT-NeoX names, then GPT-2's.
_DECODER_NORMS = ("input_layernorm", "post_attention_layernorm", "ln_1", "ln_2")


def _handoff_norm(name: str, module: nn.Module, recipe) -> Tuple[Optional[nn.Module], str, str]:
    """(the norm handing its FP8 output over, '', what it is now) for a decoder layer's RMSNorm or
    LayerNorm when the new layers run FP8 with current scaling; (None, reason, '') for one that
    stays; (None, '', '') for what is not such a norm."""
    if name.split(".")[-1] not in _DECODER_NORMS or recipe is None or recipe.scaling != "current":
        return None, "", ""
    kind = _type_name(module)
    if kind.endswith("RMSNorm"):
        fused, now = fused_rms_norm_from(module, fp8_handoff=True), "FusedRMSNorm"
        why = "not LlamaRMSNorm's shape (weight, variance_epsilon; Gemma's 1 + weight is another)"
    elif isinstance(module, nn.LayerNorm):
        fused, now = fused_layer_norm_from(module, fp8_handoff=True), "FusedLayerNorm"
        why = "an nn.LayerNorm over more than the last dim or without a weight"
    elif kind.endswith("LayerNorm"):
        return None, "not torch.nn.LayerNorm (its own class): its FP8 layers quantize its output themselves", ""
    else:
        return None, "", ""
    if fused is None:
        return None, why + ": its FP8 layers quantize its output themselves", ""
    width = fused.weight.shape[0]
    if not recipe.applies([width]):
        return None, (f"width {width} < the FP8 recipe's min_features {recipe.min_features}: the layers it feeds "
                      "run in bf16, nothing to hand over"), ""
    return fused, "", now + " (FP8 output handed to its layers)"


def _plain_mlp_pair(module: nn.Module) -> Optional[Tuple[str, str]]:
    for first, second in _PLAIN_MLP_NAMES:
        a, b = getattr(module, first, None), getattr(module, second, None)
        if a is not None and b is not None and (isinstance(a, nn.Linear) or _is_conv1d(a)) \
                and (isinstance(b, nn.Linear) or _is_conv1d(b)):
            return first, second
    return None


def _plain_activation(fn) -> Tuple[Optional[str], str]:
    """(FusedMLP activation, '') for an activation the fused ops compute (tanh GELU, ReLU, squared
    ReLU), by what it computes; (None, reason) otherwise."""
    probe = torch.linspace(-6.0, 6.0, 97, dtype=torch.float64)
    with torch.no_grad():
        try:
            value = fn(probe)
        except Exception as exc:  # noqa: BLE001 - anything it cannot take is simply not ours
            return None, f"its activation {fn!r} could not be evaluated ({type(exc).__name__})"
    for name, ref in (("gelu_approx", F.gelu(probe, approximate="tanh")), ("relu", F.relu(probe)),
                      ("sqrelu", F.relu(probe) ** 2)):
        if torch.allclose(value, ref, rtol=1e-6, atol=1e-9):
            return name, ""
    if torch.allclose(value, F.gelu(probe), rtol=1e-6, atol=1e-9):
        return None, ("exact (erf) GELU: the fused ops have the tanh GELU (2e-4 relative apart); its linear "
                      "layers are converted one by one")
    return None, f"activation {fn!r} is none of tanh GELU, ReLU, squared ReLU; its linear layers are converted one by one"


class ConvertedMLP(FusedMLP):
    """A FusedMLP standing in for a model's own MLP ``second(act(first(x)))`` (then its dropout,
    if it has one): its state_dict keeps the MLP's names (``first`` for fc1, ``second`` for fc2;
    a GPT-2 ``Conv1D``'s weight saved and loaded in its [in, out] layout), so checkpoints load both
    ways. Built by :func:`convert_model`."""

    def __init__(self, names: Tuple[str, str], transposed: Tuple[bool, bool], dropout: Optional[nn.Module],
                 **kwargs) -> None:
        super().__init__(**kwargs)
        self.state_names = tuple(names)
        self.transposed = tuple(transposed)
        self.dropout = dropout
        self.register_state_dict_post_hook(_save_as_model)
        self.register_load_state_dict_pre_hook(_load_as_model)

    def forward(self, x, process_group=None, is_first_microbatch=None):
        out = super().forward(x, process_group, is_first_microbatch)
        return out if self.dropout is None else self.dropout(out)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, state_names={self.state_names}"


class ConvertedConv1D(FusedDense):
    """A FusedDense standing in for a GPT-2 ``Conv1D`` (``x @ weight + bias``, weight stored
    [in, out]): the weight is kept [out, in], as the GEMM reads it, and saved and loaded in
    Conv1D's [in, out] layout under the same names, so checkpoints load both ways. Built by
    :func:`convert_model`."""

    def __init__(self, in_features: int, out_features: int, device=None, dtype=None) -> None:
        super().__init__(in_features, out_features, bias=True, device=device, dtype=dtype)
        self.register_state_dict_post_hook(_save_as_conv1d)
        self.register_load_state_dict_pre_hook(_load_as_conv1d)


def _save_as_conv1d(module, state_dict, prefix, local_metadata):
    key = f"{prefix}weight"
    if key in state_dict:
        state_dict[key] = state_dict[key].t().contiguous()


def _load_as_conv1d(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    key = f"{prefix}weight"
    if key in state_dict:
        state_dict[key] = state_dict[key].t()


def _finished(fused: nn.Module, like: nn.Module, fp8):
    """`fused` with its FP8 argument set (after any state_dict load, which the delayed recipe's
    buffers would otherwise refuse), its FP8 state prepared and `like`'s training mode."""
    fused.fp8 = fp8
    _fp8.prepare_layer(fused)
    fused.train(like.training)
    return fused


def _parts_beyond(module: nn.Module, known) -> List[str]:
    """The children of `module` not named in `known`, then its own parameters: what a conversion
    keeping only `known` would drop."""
    extra = sorted(n for n, _ in module.named_children() if n not in known)
    return extra + sorted(n for n, _ in module.named_parameters(recurse=False))


def _dense_from_conv1d(conv: nn.Module, fp8) -> ConvertedConv1D:
    """A ConvertedConv1D with conv's values: the weight transposed into a new parameter, the bias
    the same Parameter object."""
    w = conv.weight  # [in, out]
    fused = ConvertedConv1D(w.shape[0], w.shape[1], device="meta", dtype=w.dtype)
    fused.weight = nn.Parameter(w.detach().t().contiguous(), requires_grad=w.requires_grad)
    fused.bias = conv.bias
    return _finished(fused, conv, fp8)


def _renames(module: "ConvertedMLP"):
    return zip(("fc1", "fc2"), module.state_names, module.transposed)


def _save_as_model(module, state_dict, prefix, local_metadata):
    for ours, theirs, transposed in _renames(module):
        for part in ("weight", "bias"):
            value = state_dict.pop(f"{prefix}{ours}.{part}", None)
            if value is not None:
                state_dict[f"{prefix}{theirs}.{part}"] = value.t().contiguous() if transposed and part == "weight" \
                    else value


def _load_as_model(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    for ours, theirs, transposed in _renames(module):
        for part in ("weight", "bias"):
            value = state_dict.pop(f"{prefix}{theirs}.{part}", None)
            if value is not None:
                state_dict[f"{prefix}{ours}.{part}"] = value.t() if transposed and part == "weight" else value


def _linear_parts(layer: nn.Module) -> Tuple[torch.Tensor, Optional[torch.Tensor], bool]:
    """(weight as [out, in], bias, transposed) of an nn.Linear or a GPT-2 Conv1D."""
    if _is_conv1d(layer):
        return layer.weight.t(), layer.bias, True
    return layer.weight, layer.bias, False


def _probe_error(module: nn.Module, fused: nn.Module, weight: torch.Tensor) -> Optional[float]:
    """None when `fused` computes what `module` does on a probe input (4 rows of weight's input
    width, its device and dtype; both in eval mode for the call, no dropout), else the relative
    error: above what the dtype's rounding gives (float64 1e-9, float32 1e-4, 16-bit 3e-2)."""
    was_training = module.training
    module.eval(), fused.eval()
    probe = torch.randn(4, weight.shape[1], generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    probe = probe.to(device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        want, got = module(probe).double(), fused(probe).double()
    module.train(was_training)
    tol = {torch.float64: 1e-9, torch.float32: 1e-4}.get(weight.dtype, 3e-2)
    err = float((got - want).norm() / want.norm().clamp_min(1e-30))
    return None if err <= tol else err


def _converted_mlp_from(module: nn.Module, pair: Tuple[str, str], activation: str, checkpoint_lvl, heuristic,
                        fp8) -> Tuple[Optional[ConvertedMLP], str]:
    """A ConvertedMLP holding the MLP's weights, or (None, reason) when the MLP has parts it would
    not keep or does not compute second(act(first(x))) (checked on a probe input)."""
    first, second = getattr(module, pair[0]), getattr(module, pair[1])
    act_name = next(n for n in _ACT_NAMES if callable(getattr(module, n, None)))
    dropout = getattr(module, "dropout", None)
    known = set(pair) | {act_name} | ({"dropout"} if isinstance(dropout, nn.Dropout) else set())
    extra = _parts_beyond(module, known)
    if extra:
        return None, f"parts beyond two linear layers, an activation and a dropout: {extra}"
    w1, b1, t1 = _linear_parts(first)
    w2, b2, t2 = _linear_parts(second)
    if w1.shape[0] != w2.shape[1]:
        return None, f"{pair[0]} gives {w1.shape[0]} features, {pair[1]} takes {w2.shape[1]}"
    fused = ConvertedMLP(pair, (t1, t2), dropout if isinstance(dropout, nn.Dropout) else None,
                         in_features=w1.shape[1], hidden_features=w1.shape[0], out_features=w2.shape[0],
                         bias1=b1 is not None, bias2=b2 is not None, activation=activation,
                         checkpoint_lvl=checkpoint_lvl, heuristic=heuristic, device=w1.device, dtype=w1.dtype)
    with torch.no_grad():
        fused.fc1.weight.copy_(w1)
        fused.fc2.weight.copy_(w2)
        for mine, theirs in ((fused.fc1.bias, b1), (fused.fc2.bias, b2)):
            if theirs is not None:
                mine.copy_(theirs)
        # the module must compute second(act(first(x))) (dropout aside): compare on a probe input
        # (not on the meta device, where a model built for later materialisation has no values:
        # there the structure above decides)
        if w1.device.type == "meta":
            return _finished(fused, module, fp8), ""
        err = _probe_error(module, fused, w1)
        if err is not None:
            return None, f"its forward is not {pair[1]}(act({pair[0]}(x))) (probe relative error {err:.1e})"
    return _finished(fused, module, fp8), ""


# A gated MLP whose gate and up weights are one linear layer, stacked [gate; up] along its outputs:
# these names (Phi-3's, GLM's and GLM-4's: ``gate, up = gate_up_proj(x).chunk(2, -1)``).
_STACKED_GATE_UP, _STACKED_DOWN = "gate_up_proj", "down_proj"


class ConvertedStackedGatedMLP(FusedGatedMLP):
    """A FusedGatedMLP standing in for a gated MLP whose gate and up weights are one stacked linear
    layer, ``gate_up_proj.weight`` = [gate; up] ([2h, in], gate's rows first) and ``down_proj``:
    its state_dict saves and loads that stacked layout under that name (this module's own
    parameter of the name holds them packed, as the fused GEMM reads them), so checkpoints load
    both ways. Built by :func:`convert_model`."""

    def _register_gated_state_dict_names(self) -> None:
        self.register_state_dict_post_hook(_save_stacked)
        self.register_load_state_dict_pre_hook(_load_stacked)


def _save_stacked(module, state_dict, prefix, local_metadata):
    key = f"{prefix}{_STACKED_GATE_UP}.weight"
    packed = state_dict.get(key)
    if packed is not None:
        state_dict[key] = torch.cat(ops.unpack_gate_up(packed), dim=0)


def _load_stacked(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    key = f"{prefix}{_STACKED_GATE_UP}.weight"
    stacked = state_dict.get(key)
    if stacked is None:
        return  # missing: load_state_dict reports it
    if stacked.dim() != 2 or stacked.shape[0] % 2:
        error_msgs.append(f"{prefix}: {key} must be the stacked [gate; up] weight [2h, in_features], got shape "
                          f"{tuple(stacked.shape)}")
        return
    gate, up = stacked.chunk(2, dim=0)
    state_dict[key] = ops.pack_gate_up(gate, up)


def _is_stacked_gated_mlp(module: nn.Module) -> bool:
    """Whether `module` has the stacked gated MLP's parts: ``gate_up_proj`` and ``down_proj`` linear
    layers (no ``gate_proj``) and an activation attribute."""
    return (not isinstance(module, nn.Linear) and getattr(module, "gate_proj", None) is None
            and all(type(getattr(module, n, None)) is nn.Linear for n in (_STACKED_GATE_UP, _STACKED_DOWN))
            and any(callable(getattr(module, n, None)) for n in _ACT_NAMES))


def _stacked_gated_mlp_from(module: nn.Module, checkpoint_lvl, heuristic,
                            fp8) -> Tuple[Optional[ConvertedStackedGatedMLP], str, str]:
    """(a ConvertedStackedGatedMLP holding the MLP's weights, '', its activation), or (None, reason,
    '') when the MLP has biases, parts it would not keep, widths that do not pair, an activation
    the gated ops do not compute, or a forward that is not down(act(gate) * up) (checked on a probe
    input, except on the meta device, where the structure decides)."""
    gate_up, down = getattr(module, _STACKED_GATE_UP), getattr(module, _STACKED_DOWN)
    act_name = next(n for n in _ACT_NAMES if callable(getattr(module, n, None)))
    known = {_STACKED_GATE_UP, _STACKED_DOWN, act_name}
    extra = _parts_beyond(module, known)
    if extra:
        return None, f"parts beyond gate_up_proj, down_proj and an activation: {extra}", ""
    if gate_up.bias is not None or down.bias is not None:
        return None, "has biases; FusedGatedMLP has none", ""
    if gate_up.out_features != 2 * down.in_features:
        return None, (f"gate_up_proj gives {gate_up.out_features} features, not twice the {down.in_features} "
                      f"down_proj takes"), ""
    try:
        activation = gate_activation(getattr(module, act_name), _type_name(module))
    except ValueError as exc:
        return None, str(exc).split(": ", 1)[-1], ""
    w = gate_up.weight
    fused = ConvertedStackedGatedMLP(gate_up.in_features, down.in_features, down.out_features, activation=activation,
                                     checkpoint_lvl=checkpoint_lvl, heuristic=heuristic, device=w.device,
                                     dtype=w.dtype)
    fused.load_state_dict(module.state_dict(), strict=False)
    err = None if w.device.type == "meta" else _probe_error(module, fused, w)
    if err is not None:
        return None, (f"its forward is not down_proj(act(gate) * up) with [gate; up] = gate_up_proj(x) (probe "
                      f"relative error {err:.1e})"), ""
    return _finished(fused, module, fp8), "", activation


def _fused_dense_from(linear: nn.Linear, fp8) -> FusedDense:
    """A FusedDense holding the same Parameter objects (ties, such as a tied LM head, stay)."""
    fused = FusedDense(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta",
                       dtype=linear.weight.dtype)
    fused.weight = linear.weight
    if linear.bias is not None:
        fused.bias = linear.bias
    return _finished(fused, linear, fp8)


def convert_model(model: nn.Module, *, fp8: Union[None, bool, "_fp8.Float8Recipe"] = None,
                  module_filter: Optional[Callable[[str, nn.Module], bool]] = None, lm_head: bool = False,
                  bias_free_linears: Optional[bool] = None, checkpoint_lvl: int = 0,
                  heuristic: Union[int, str] = "auto", linear_cross_entropy: bool = False,
                  fuse_qkv: Optional[bool] = None, verbose: bool = False) -> ConversionReport:
    """Replaces, in place, the dense layers of `model` that the library runs faster (module
    docstring) and returns a :class:`ConversionReport` of what it converted and what it left and
    why (printed with ``verbose=True``).

    fp8: the new layers' FP8 argument (``None``: follow :func:`fused_dense.fp8_autocast`; a
        :class:`fused_dense.Float8Recipe` or ``True``: FP8, with the recipe's size rule).
    module_filter: ``module_filter(name, module) -> bool`` chooses among the candidates (gated MLPs,
        plain MLPs and linear layers); one it refuses is reported as left alone.
    lm_head: convert the LM head too (``lm_head`` or ``model.get_output_embeddings()``).
    bias_free_linears: convert linear layers without a bias (default: only with ``fp8``).
    checkpoint_lvl, heuristic: the new MLPs' arguments (FusedGatedMLP, ConvertedMLP).
    linear_cross_entropy: a supported Hugging Face causal LM computes its training loss with the LM
        head fused into the loss (:func:`fused_dense.use_fused_linear_cross_entropy`);
        any other model is reported as left alone there.
    fuse_qkv: a self-attention (a module named ``self_attn``, as Hugging Face names them) whose
        ``q_proj``, ``k_proj``, ``v_proj`` are ``nn.Linear`` layers of one input width runs them as
        one GEMM (:func:`fused_dense.fuse_qkv_projections`: a :class:`fused_dense.FusedQKV`, new
        parameters; the state-dict names stay). In FP8 the size rule then reads the stacked
        width, so narrow k / v projections (GQA) run in FP8 with q. ``module_filter`` is asked
        about the attention module; one it refuses keeps its projections as candidates.
        Default: on with ``fp8``, off in bf16 (docs/performance.md, "q / k / v as one GEMM", has
        the measurements); only ``True`` reports a model without such an attention.

    A model with nothing to convert, or a filter that refuses every candidate, is a ValueError.
    Call it before building the optimizer.
    """
    _fp8.check_fp8_argument(fp8)
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert_model: model must be a torch.nn.Module, got {type(model).__name__}")
    if module_filter is not None and not callable(module_filter):
        raise TypeError(f"convert_model: module_filter must be callable (name, module) -> bool, got "
                        f"{type(module_filter).__name__}")
    if bias_free_linears is None:
        bias_free_linears = bool(fp8)
    if fuse_qkv is not None and not isinstance(fuse_qkv, bool):
        raise TypeError(f"convert_model: fuse_qkv must be None, True or False, got {fuse_qkv!r}")
    qkv_asked = fuse_qkv is True
    if fuse_qkv is None:
        fuse_qkv = bool(fp8)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    report = ConversionReport()
    replacements = []  # (name, new module)
    fusions = []  # attention modules whose q / k / v become one FusedQKV
    qkv_attentions = 0  # self_attn modules with nn.Linear q / k / v seen (fused, refused or left)
    candidates = 0
    taken = set()  # names whose submodules are handled with them

    def covered(name: str) -> bool:
        return any(name == t or name.startswith(t + ".") for t in taken)

    def wanted(name: str, module: nn.Module) -> bool:
        nonlocal candidates
        candidates += 1
        if module_filter is None or module_filter(name, module):
            return True
        report.left.append((name, _type_name(module), "refused by module_filter"))
        return False

    recipe = None if fp8 is None or fp8 is False else _fp8.resolve_recipe(fp8)
    for name, module in model.named_modules():
        if not name or covered(name):
            continue
        if isinstance(module, (FusedDense, FusedGatedMLP, FusedMLP, FusedRMSNorm, FusedLayerNorm)):  # converted already
            taken.add(name)
            continue
        if fuse_qkv and name.split(".")[-1] == "self_attn" and \
                all(type(getattr(module, n, None)) is nn.Linear for n in QKV_NAMES):
            qkv_attentions += 1
            why = qkv_fusion_problem(module)
            if why:
                report.left.append((name, _type_name(module), f"q / k / v not fused: {why}"))
            elif wanted(name, module):
                taken.update(f"{name}.{n}" for n in QKV_NAMES)
                fusions.append(name)
                report.converted.append((name, f"{_type_name(module)} q_proj, k_proj, v_proj",
                                         "FusedQKV qkv_proj (one GEMM; q_proj, k_proj, v_proj its parts)"))
            continue
        norm, why, now = _handoff_norm(name, module, recipe)
        if norm is not None or why:
            if norm is None:
                report.left.append((name, _type_name(module), why))
            elif wanted(name, module):
                replacements.append((name, norm))
                report.converted.append((name, _type_name(module), now))
            continue
        if is_llama_mlp(module):
            try:
                activation = gated_activation_of(module, f"convert_model: {name}")
            except ValueError as exc:
                report.left.append((name, _type_name(module), str(exc).split(": ", 1)[-1]))
                continue  # its linears are still candidates
            taken.add(name)
            if wanted(name, module):
                replacements.append((name, fused_gated_mlp_from(module, activation, checkpoint_lvl, heuristic, fp8)))
                report.converted.append((name, _type_name(module), f"FusedGatedMLP({activation})"))
            continue
        if _is_stacked_gated_mlp(module):
            taken.add(name)
            if not wanted(name, module):
                continue
            fused, why, activation = _stacked_gated_mlp_from(module, checkpoint_lvl, heuristic, fp8)
            if fused is None:
                taken.discard(name)  # its linears are still candidates
                report.left.append((name, _type_name(module), why))
                continue
            replacements.append((name, fused))
            report.converted.append((name, _type_name(module), f"ConvertedStackedGatedMLP({activation})"))
            continue
        pair = _plain_mlp_pair(module)
        if pair is not None and not isinstance(module, nn.Linear):
            act_name = next((n for n in _ACT_NAMES if callable(getattr(module, n, None))), None)
            activation, why = _plain_activation(getattr(module, act_name)) if act_name else \
                (None, "no activation attribute found (act, act_fn, activation, activation_fn, gelu)")
            if activation is None:
                report.left.append((name, _type_name(module), why))
                continue  # its linears are still candidates
            if not wanted(name, module):
                taken.add(name)
                continue
            fused, why = _converted_mlp_from(module, pair, activation, checkpoint_lvl, heuristic, fp8)
            if fused is None:
                report.left.append((name, _type_name(module), why))
                continue
            taken.add(name)
            replacements.append((name, fused))
            report.converted.append((name, _type_name(module), f"ConvertedMLP({activation})"))
            continue
        if _is_conv1d(module):
            if wanted(name, module):
                replacements.append((name, _dense_from_conv1d(module, fp8)))
                report.converted.append((name, "Conv1D", "ConvertedConv1D"))
            continue
        if not isinstance(module, nn.Linear) or type(module) is not nn.Linear:
            continue
        if (module is head or name.split(".")[-1] == "lm_head") and not lm_head:
            report.left.append((name, "Linear", "the LM head (lm_head=True converts it)"))
            continue
        if module.bias is None and not bias_free_linears:
            report.left.append((name, "Linear", "no bias: in bf16 it runs the same cuBLASLt GEMM as nn.Linear "
                                                "(bias_free_linears=True or fp8 converts it)"))
            continue
        if wanted(name, module):
            replacements.append((name, _fused_dense_from(module, fp8)))
            report.converted.append((name, "Linear", "FusedDense"))

    if qkv_asked and not qkv_attentions:
        report.left.append(("fuse_qkv", "q / k / v", "no module named self_attn with nn.Linear q_proj, k_proj, v_proj"))
    loss_patch = None
    if linear_cross_entropy:
        family, why = causal_lm_family(model)
        if family is None:
            report.left.append(("lm_head", "lm_head + loss", why))
        else:
            loss_patch = ("lm_head", "lm_head + loss", "fused linear cross-entropy (training)")

    if not replacements and not fusions and loss_patch is None:
        if candidates:
            raise ValueError(f"convert_model: module_filter refused all {candidates} candidates:\n{report}")
        raise ValueError(f"convert_model: found nothing to convert in {_type_name(model)}:\n{report}")
    for name, new in replacements:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, new)
    for name in fusions:
        fuse_qkv_projections(model.get_submodule(name), fp8)
    if loss_patch is not None:  # checked again: the replacements may have changed the LM head (FP8)
        family, why = causal_lm_family(model)
        if family is None:
            report.left.append(loss_patch[:2] + (why,))
        else:
            use_fused_linear_cross_entropy(model)
            report.converted.append(loss_patch)
    if verbose:
        print(report)
    return report
