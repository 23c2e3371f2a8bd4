"""One call converts a model's dense layers to the fused ones: :func:`convert_model`.

What it recognises (each tested on a real ``transformers`` model, random init, small config, in
tests/test_convert.py):

- gated MLPs of the Llama family (a module with ``gate_proj``, ``up_proj``, ``down_proj`` linear
  layers and an ``act_fn``: Llama, Mistral, Qwen2 with SiLU; Gemma with the tanh GELU) become
  :class:`~fused_dense.FusedGatedMLP` (the packed gate / up weight is a new parameter);
- ``nn.Linear`` layers with a bias become :class:`~fused_dense.FusedDense` holding the same
  parameters (the bias add is fused into the GEMM's epilogue); bias-free ones only with
  ``bias_free_linears=True`` or in FP8 (in bf16 a bias-free linear runs the same cuBLASLt GEMM as
  ``nn.Linear``, so converting it gains nothing); the LM head (``lm_head``, or the model's output
  embedding) only with ``lm_head=True``.

What it leaves alone, with the reason in the report: GPT-2's ``Conv1D`` layers (their weight is
stored [in, out], and GPT-2's MLP applies dropout after ``c_proj``); MLPs of two plain linears and
a GELU (GPT-NeoX, BERT, Falcon, nanoGPT), whose linears are converted one by one but which do not
become a FusedMLP here (their state-dict names and the exact (erf) GELU many of them use are not
handled yet); gated MLPs with biases or another activation.

State-dict names stay the model's own (FusedDense is an ``nn.Linear``; FusedGatedMLP saves and
loads Llama's ``gate_proj`` / ``up_proj`` / ``down_proj``), so checkpoints load both ways. Convert
before building the optimizer: the gated MLPs hold new parameters.
"""
import dataclasses
from typing import Callable, List, Optional, Tuple, Union

from torch import nn

from . import fp8 as _fp8
from .modules import FusedDense, FusedGatedMLP, fused_gated_mlp_from, gated_activation_of, is_llama_mlp

__all__ = ["ConversionReport", "convert_model"]

# The attribute pairs of plain two-linear MLPs of common models: (fc1, fc2).
_PLAIN_MLP_NAMES = (("c_fc", "c_proj"), ("dense_h_to_4h", "dense_4h_to_h"), ("fc1", "fc2"), ("w1", "w2"))


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


def _plain_mlp_pair(module: nn.Module) -> Optional[Tuple[str, str]]:
    for first, second in _PLAIN_MLP_NAMES:
        a, b = getattr(module, first, None), getattr(module, second, None)
        if a is not None and b is not None and (isinstance(a, nn.Linear) or _is_conv1d(a)) \
                and (isinstance(b, nn.Linear) or _is_conv1d(b)):
            return first, second
    return None


def _fused_dense_from(linear: nn.Linear, fp8) -> FusedDense:
    """A FusedDense holding the same Parameter objects (ties, such as a tied LM head, stay)."""
    fused = FusedDense(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta",
                       dtype=linear.weight.dtype)
    fused.weight = linear.weight
    if linear.bias is not None:
        fused.bias = linear.bias
    fused.fp8 = fp8
    _fp8.prepare_layer(fused)
    fused.train(linear.training)
    return fused


def convert_model(model: nn.Module, *, fp8: Union[None, bool, "_fp8.Float8Recipe"] = None,
                  module_filter: Optional[Callable[[str, nn.Module], bool]] = None, lm_head: bool = False,
                  bias_free_linears: Optional[bool] = None, checkpoint_lvl: int = 0,
                  heuristic: Union[int, str] = "auto", verbose: bool = False) -> ConversionReport:
    """Replaces, in place, the dense layers of `model` that the library runs faster (module
    docstring) and returns a :class:`ConversionReport` of what it converted and what it left and
    why (printed with ``verbose=True``).

    fp8: the new layers' FP8 argument (``None``: follow :func:`fused_dense.fp8_autocast`; a
        :class:`fused_dense.Float8Recipe` or ``True``: FP8, with the recipe's size rule).
    module_filter: ``module_filter(name, module) -> bool`` chooses among the candidates (gated MLPs
        and linear layers); one it refuses is reported as left alone.
    lm_head: convert the LM head too (``lm_head`` or ``model.get_output_embeddings()``).
    bias_free_linears: convert linear layers without a bias (default: only with ``fp8``).
    checkpoint_lvl, heuristic: the FusedGatedMLPs' arguments.

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
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    report = ConversionReport()
    replacements = []  # (name, new module)
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

    for name, module in model.named_modules():
        if not name or covered(name) or isinstance(module, (FusedDense, FusedGatedMLP)):
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
        pair = _plain_mlp_pair(module)
        if pair is not None and not isinstance(module, nn.Linear):
            why = ("GPT-2's Conv1D stores its weight [in, out] and a dropout follows c_proj: not converted"
                   if _is_conv1d(getattr(module, pair[0])) else
                   f"a plain MLP ({pair[0]} -> activation -> {pair[1]}) is not made a FusedMLP yet (its state-dict "
                   f"names, and the exact GELU many use); its linear layers are converted one by one")
            report.left.append((name, _type_name(module), why))
            continue
        if _is_conv1d(module):
            report.left.append((name, "Conv1D", "weight stored [in, out] (GPT-2): not converted"))
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

    if not replacements:
        if candidates:
            raise ValueError(f"convert_model: module_filter refused all {candidates} candidates:\n{report}")
        raise ValueError(f"convert_model: found nothing to convert in {_type_name(model)}:\n{report}")
    for name, new in replacements:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, new)
    if verbose:
        print(report)
    return report
