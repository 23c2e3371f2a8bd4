"""Hugging Face causal LMs trained through the fused LM head loss: :func:`use_fused_linear_cross_entropy`.

After ``use_fused_linear_cross_entropy(model)``, a forward in training mode (``model.training``)
with ``labels`` runs the model's decoder, then computes Hugging Face's causal-LM loss
(``ForCausalLMLoss``) from the last hidden states and the LM head's weight with
:func:`fused_dense.loss.linear_cross_entropy`, so the ``[tokens, vocab]`` logits never exist: the
labels shifted by one (padded on the right with ``ignore_index``, or the ``shift_labels`` keyword as
given), ``ignore_index`` -100 (or the keyword), the mean over the counted tokens, or the sum divided
by the ``num_items_in_batch`` keyword when it is given, and Gemma 2's and 3's
``config.final_logit_softcapping`` as the softcap. The output is the model's own output class with
``loss`` set and ``logits=None``; the decoder's other outputs (the cache, hidden states,
attentions) are carried over as they are. The loss is float32, as transformers' (float64 for a
float64 model, whose transformers loss is float32: the logits are cast with ``.float()``).

Every other call (eval mode, no labels, ``generate``, or a ``loss_function`` set on the model
afterwards) runs the class's own forward unchanged. The instance's ``forward`` is replaced (the
class is not touched); ``del model.forward`` restores it. The LM head's weight and bias are read at
each call, so a head that :func:`fused_dense.convert_model` replaced later is the one used; its
GEMMs run in the weight's dtype (autocast's under autocast).

Supported families (each tested on a small random-init model in tests/test_lm_head_hf.py): Llama,
Mistral, Qwen2, Qwen3, Phi-3, Gemma, Gemma 2, Gemma 3 (text) and GPT-2. Others are refused with a
ValueError: families that transform the logits further (Cohere's ``logit_scale``, Granite's
``logits_scaling``, ...) would otherwise get a wrong loss; a subclass that overrides ``forward``,
a model whose ``loss_function`` is not Hugging Face's causal-LM loss, one whose instance
``forward`` is replaced already (such as accelerate's device-map hooks) and an LM head in FP8 are
refused for the same reason.
"""
import dataclasses
import functools
import inspect
import types
import typing
from typing import NamedTuple, Optional, Tuple

import torch.nn.functional as F
from torch import nn

from .loss import linear_cross_entropy
from .modules import FusedDense

__all__ = ["use_fused_linear_cross_entropy", "causal_lm_family", "SUPPORTED_FAMILIES"]


class _Family(NamedTuple):
    module: str  # transformers.models.<module>.modeling_<module>
    decoder: str  # the attribute holding the base model the class's forward calls
    softcap: Optional[str]  # the config attribute of a softcap applied to the logits, if any


# class name -> how its forward computes the loss
_FAMILIES = {
    "LlamaForCausalLM": _Family("llama", "model", None),
    "MistralForCausalLM": _Family("mistral", "model", None),
    "Qwen2ForCausalLM": _Family("qwen2", "model", None),
    "GemmaForCausalLM": _Family("gemma", "model", None),
    "Gemma2ForCausalLM": _Family("gemma2", "model", "final_logit_softcapping"),
    "Gemma3ForCausalLM": _Family("gemma3", "model", "final_logit_softcapping"),
    "Qwen3ForCausalLM": _Family("qwen3", "model", None),
    "Phi3ForCausalLM": _Family("phi3", "model", None),
    "GPT2LMHeadModel": _Family("gpt2", "transformer", None),
}
SUPPORTED_FAMILIES = tuple(_FAMILIES)

# The forward's arguments that stay with the LM head (never passed to the decoder).
_HEAD_ARGUMENTS = ("labels", "logits_to_keep")
# The marker attribute of a patched instance: the patch's settings.
_SETTINGS = "_fused_dense_linear_cross_entropy"


def _family_class(model: nn.Module) -> Tuple[Optional[type], str]:
    """(the supported transformers class that `model` is an instance of, '') or (None, why not)."""
    for cls in type(model).__mro__:
        family = _FAMILIES.get(cls.__name__)
        if family is not None and cls.__module__ == f"transformers.models.{family.module}.modeling_{family.module}":
            if type(model).forward is not cls.forward:
                return None, (f"{type(model).__name__} overrides the forward of {cls.__name__}, which may compute "
                              "its logits or loss differently")
            return cls, ""
    return None, (f"{type(model).__name__} is not a supported causal LM (supported: {', '.join(SUPPORTED_FAMILIES)}; "
                  "other families may transform the logits, e.g. Cohere's logit_scale or Granite's logits_scaling, "
                  "which the fused loss does not reproduce)")


def _hf_causal_lm_loss():
    try:
        from transformers.loss.loss_utils import LOSS_MAPPING
    except ImportError:
        return None
    return LOSS_MAPPING.get("ForCausalLM")


def causal_lm_family(model: nn.Module) -> Tuple[Optional[str], str]:
    """(the supported class name of `model`, '') when :func:`use_fused_linear_cross_entropy` can
    patch it, else (None, the reason it cannot)."""
    cls, why = _family_class(model)
    if cls is None:
        return None, why
    own = vars(model).get("forward")
    if own is not None and getattr(own, "__func__", None) is not _fused_forward(cls):
        return None, (f"its forward is already replaced on the instance ({own!r}, e.g. by accelerate's hooks), "
                      "which the fused loss would bypass")
    family = _FAMILIES[cls.__name__]
    decoder = getattr(model, family.decoder, None)
    if not isinstance(decoder, nn.Module):
        return None, f"{type(model).__name__} has no decoder module at .{family.decoder}"
    head = getattr(model, "lm_head", None)
    if type(head) not in (nn.Linear, FusedDense):
        return None, f"its lm_head is {type(head).__name__}, expected torch.nn.Linear or fused_dense.FusedDense"
    if getattr(head, "fp8", None):
        return None, "its lm_head runs in FP8, which the fused loss does not"
    hf_loss = _hf_causal_lm_loss()
    if hf_loss is None or model.loss_function is not hf_loss:
        return None, (f"its loss_function is {getattr(model.loss_function, '__name__', model.loss_function)!r}, "
                      "not transformers' ForCausalLMLoss")
    outer = inspect.signature(cls.forward).parameters
    inner = inspect.signature(type(decoder).forward).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in inner.values())
    missing = [n for n, p in outer.items() if n != "self" and n not in _HEAD_ARGUMENTS and n not in inner
               and p.kind is not inspect.Parameter.VAR_KEYWORD and not takes_any]
    if missing:
        return None, f"its decoder's forward does not take {missing}"
    if _output_class(cls) is None:
        return None, f"the return annotation of {cls.__name__}.forward is no output class with loss and logits"
    return cls.__name__, ""


def _output_class(cls: type) -> Optional[type]:
    try:
        out = typing.get_type_hints(inspect.unwrap(cls.forward)).get("return")
    except Exception:  # noqa: BLE001 - an annotation that does not resolve is simply not usable
        return None
    if not (isinstance(out, type) and dataclasses.is_dataclass(out)):
        return None
    names = {f.name for f in dataclasses.fields(out)}
    return out if {"loss", "logits"} <= names else None


def use_fused_linear_cross_entropy(model: nn.Module, *, chunk_size: Optional[int] = None, fp8: bool = False) -> str:
    """Makes `model` (a supported transformers causal LM, module docstring) compute its training
    loss with :func:`fused_dense.loss.linear_cross_entropy`, without materialising the logits.

    chunk_size: tokens per chunk of the fused loss (None: the op's rule).
    fp8: the head's logits and input-gradient GEMMs in FP8 (:func:`fused_dense.loss.linear_cross_entropy`'s
        ``fp8``; off by default).
    Returns a one-line description of what now computes the loss. Calling it again on the same
    model updates chunk_size and fp8. A model it does not support is a ValueError naming its class and the
    reason (the supported families among it).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"use_fused_linear_cross_entropy: model must be a torch.nn.Module, got {type(model).__name__}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0):
        raise ValueError(f"use_fused_linear_cross_entropy: chunk_size must be a positive int or None, "
                         f"got {chunk_size!r}")
    if not isinstance(fp8, bool):
        raise TypeError(f"use_fused_linear_cross_entropy: fp8 must be True or False, got {type(fp8).__name__}")
    name, why = causal_lm_family(model)
    if name is None:
        raise ValueError(f"use_fused_linear_cross_entropy: {why}")
    cls = next(c for c in type(model).__mro__ if c.__name__ == name)
    setattr(model, _SETTINGS, {"chunk_size": chunk_size, "fp8": fp8})
    model.forward = types.MethodType(_fused_forward(cls), model)
    family = _FAMILIES[name]
    softcap = f", softcap config.{family.softcap}" if family.softcap else ""
    in_fp8 = " in FP8" if fp8 else ""
    return (f"{name}: training loss (labels given, model.training) through fused_dense linear_cross_entropy{in_fp8} "
            f"from .{family.decoder}'s last hidden state and lm_head{softcap}; logits not returned in training")


@functools.lru_cache(maxsize=None)
def _fused_forward(cls: type):
    """The forward replacing `cls.forward` on a patched instance (one function per class; its
    signature, through __wrapped__, is the class's)."""
    class_forward = cls.forward
    family = _FAMILIES[cls.__name__]
    signature = inspect.signature(class_forward)
    var_keyword = next((n for n, p in signature.parameters.items() if p.kind is inspect.Parameter.VAR_KEYWORD), None)
    output_class = _output_class(cls)
    carried = [f.name for f in dataclasses.fields(output_class) if f.name not in ("loss", "logits")]

    @functools.wraps(class_forward)
    def forward(self, *args, **kwargs):
        if not self.training or self.loss_function is not _hf_causal_lm_loss():
            return class_forward(self, *args, **kwargs)
        return_dict = kwargs.pop("return_dict", None)
        arguments = signature.bind(self, *args, **kwargs).arguments
        labels = arguments.pop("labels", None)
        if labels is None:
            return class_forward(self, *args, **kwargs, **({} if return_dict is None else {"return_dict": return_dict}))
        if return_dict is None:
            return_dict = getattr(self.config, "return_dict", True)
        del arguments["self"]
        arguments.pop("logits_to_keep", None)
        extra = arguments.pop(var_keyword, {}) if var_keyword else {}
        outputs = getattr(self, family.decoder)(**arguments, **extra)
        hidden = outputs.last_hidden_state if hasattr(outputs, "last_hidden_state") else outputs[0]
        softcap = (getattr(self.config, family.softcap, None) or None) if family.softcap else None
        settings = getattr(self, _SETTINGS)
        loss = _causal_lm_loss(self.lm_head, hidden, labels, extra, softcap, settings["chunk_size"],
                               settings.get("fp8", False))
        result = output_class(loss=loss, logits=None, **{n: getattr(outputs, n, None) for n in carried})
        return result if return_dict else result.to_tuple()

    return forward


def _causal_lm_loss(head: nn.Linear, hidden, labels, extra: dict, softcap, chunk_size, fp8):
    """transformers' ForCausalLMLoss(head(hidden), labels, **extra) with the head and the loss fused."""
    ignore_index = extra.get("ignore_index", -100)
    shift_labels = extra.get("shift_labels")
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    target = shift_labels.reshape(-1).to(hidden.device)
    x = hidden.reshape(-1, hidden.shape[-1])
    if target.shape[0] != x.shape[0]:
        raise ValueError(f"causal LM loss: the labels give {target.shape[0]} targets (shape "
                         f"{tuple(shift_labels.shape)}), the decoder {x.shape[0]} hidden states "
                         f"(shape {tuple(hidden.shape[:-1])})")
    return linear_cross_entropy(x, head.weight, target, head.bias, ignore_index=ignore_index, softcap=softcap,
                                num_items_in_batch=extra.get("num_items_in_batch"), chunk_size=chunk_size, fp8=fp8)
